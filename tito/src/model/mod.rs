//! Models: rows of a table with sparse secondary indexes and reverse-index manifests, written
//! and read one model at a time, in a caller's transaction or in one of their own.
//!
//! Storage layout (see `docs/storage-layout.md`):
//!
//! ```text
//! table:{table}:{id}                          the row, as JSON (`v{N}:` first from shape version 2)
//! index:{table}:{index}:{field}:{value}..:table:{table}:{id}   an index entry, a clone of the row
//! unique:{table}:{index}:{field}:{value}..    a unique index's claim, holding the owner's id
//! reverse-index:table:{table}:{id}            the manifest: the row's index keys and claims
//! ```
//!
//! Index names belong to their table (the table leads every index and claim key), so two models
//! may both declare `by_email` without sharing entries or claims.
//!
//! Every write validates what it is about to change first: the row and its manifest exist
//! together, the manifest is a JSON array naming only this row's `index:` keys (ending in this
//! exact row key) and claims of this table that this row holds, and every key it names exists.
//! Anything else is [`TitoError::Integrity`] naming the key, and nothing is written.
//!
//! # In a caller's transaction
//!
//! The `*_with_options` writes join a transaction the caller commits. A write that fails leaves
//! nothing of itself in that transaction: the row, its manifest, the claims it would take or
//! give back, every key and value size and the events it would publish are read and checked
//! first, and only then is anything buffered. So a caller may handle, say,
//! [`TitoError::UniqueViolation`] and commit its other writes. A failure after the first write
//! was buffered (an I/O error) marks the transaction failed
//! ([`TitoTransaction::fail`]): its commit is refused with
//! [`TitoError::TransactionAborted`].
//!
//! The manifest is the one record of what a row holds: an update removes exactly the entries
//! and claims it lists that the new row no longer implies, and a delete removes exactly what it
//! lists. A condition that depends on the row is evaluated once, on the row being written.
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tito::backend::embedded::Embedded;
//! use tito::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};
//! use tito::TitoEngine;
//!
//! #[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
//! struct User {
//!     id: String,
//!     email: String,
//! }
//!
//! impl TitoModelTrait for User {
//!     fn id(&self) -> String {
//!         self.id.clone()
//!     }
//!     fn table(&self) -> String {
//!         "user".into()
//!     }
//!     fn indexes(&self) -> Vec<TitoIndexConfig> {
//!         vec![TitoIndexConfig {
//!             condition: true,
//!             name: "by_email".into(),
//!             fields: vec![TitoIndexField { name: "email".into(), r#type: TitoIndexBlockType::String }],
//!         }]
//!     }
//! }
//!
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> Result<(), tito::TitoError> {
//! let db = Embedded::temporary().await?;
//! let users = db.clone().model::<User>();
//! users.build(User { id: "1".into(), email: "ada@example.com".into() }).await?;
//!
//! let page = users.query_by_index("by_email").value("ada@example.com").execute().await?;
//! assert_eq!(page.items[0].id, "1");
//! assert_eq!(users.find_by_id("1", vec![]).await?.email, "ada@example.com");
//! # Ok(())
//! # }
//! ```
//!
//! # `#[derive(TitoModel)]`
//!
//! The derive writes the same `impl TitoModelTrait` from attributes, and a typed query method
//! per index (on a generated `{Struct}Queries` trait, implemented for `TitoModel<E, Struct>`).
//!
//! | attribute | meaning |
//! |---|---|
//! | `#[tito(table = "user")]` | the table (default: the struct's name in snake case) |
//! | `#[tito(index = "name: field, field")]` | a secondary index over those fields, in key order |
//! | `#[tito(index = "..", condition = "method")]` | only rows where `fn method(&self) -> bool` holds |
//! | `#[tito(index = "..", condition = "method", condition_version = 2)]` | the condition's identity for the schema catalog: bump it when the method's meaning changes (default 1; see [`crate::schema`]) |
//! | `#[tito(unique_index = "name: field")]` | a unique index (same forms) |
//! | `#[tito(event = "name")]` | every write publishes a [`ModelEvent`](crate::queue::ModelEvent) to queue `name`, runnable at the time of the write; the constant `Struct::NAME_EVENT` is its typed [`Topic`](crate::queue::Topic) |
//! | `#[tito(event = "name", at = "x")]` | runnable at field `x` (`i64` seconds, `DateTime<Utc>`, `Option` of those) or method `fn x(&self) -> i64` |
//! | `#[tito(event = "name", on = "insert, delete")]` | published only by those operations (`insert`, `update`, `delete`; an upsert is one of the first two) |
//! | `#[tito(id)]` on a field | the id (`String` or an integer); default: the field named `id` |
//! | `#[tito(manual_timestamps)]` | Tito never sets `created_at` / `updated_at` (see [`TitoModelTrait::managed_timestamps`]) |
//!
//! Index field types come from the Rust types: `String`, integers, floats, `bool`,
//! `chrono::DateTime<Utc>`, `uuid::Uuid` (feature `uuid`), your unit enums and newtypes with
//! `#[derive(tito::IndexValue)]` (see [`value`]), and `Option<T>` (sparse) or `Vec<T>` (one
//! entry per element) of those. Field names follow serde's `rename` and `rename_all`. Mistakes
//! are compile errors at the token that is wrong.
//!
//! For `index = "by_team_created: team_id, created_at"` the typed methods are
//! `by_team_created(&team)` (binds `team_id`; `by_team_created_range(a..b)` ranges over it), then
//! on the result `created_at_eq(&t)` (binds the next field) or `created_at(from..to)` (ranges
//! over it). Binding out of order, ranging before the earlier fields are bound, or a value of
//! the wrong type does not compile. Every stage is the ordinary [`IndexQuery`] through `Deref`:
//! `limit`, `cursor`, `reverse`, `execute`.
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tito::backend::embedded::Embedded;
//! use tito::{TitoEngine, TitoModel};
//!
//! #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
//! #[tito(index = "by_team_created: team_id, created_at")]
//! #[tito(unique_index = "by_email: email")]
//! #[tito(event = "user")]
//! struct User {
//!     #[tito(id)]
//!     id: String,
//!     email: String,
//!     team_id: String,
//!     created_at: i64,
//! }
//!
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> Result<(), tito::TitoError> {
//! let db = Embedded::temporary().await?;
//! let users = db.clone().model::<User>();
//! users.build(User { id: "1".into(), email: "a@x".into(), team_id: "core".into(), created_at: 0 }).await?;
//! // `created_at` is set from the transaction's time on insert.
//! let page = users.by_team_created("core").created_at(1..).limit(Some(10)).execute().await?;
//! assert_eq!(page.items.len(), 1);
//! assert_eq!(users.by_email("a@x").execute().await?.items[0].id, "1");
//! # Ok(())
//! # }
//! ```

pub(crate) mod catalog;
mod config;
pub(crate) mod index;
pub(crate) mod query;
pub(crate) mod rewriters;
pub mod shape;
pub mod value;
mod write;

use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use tracing::Instrument;

use serde_json::Value;

pub use config::{
    TitoCondition, TitoEventConfig, TitoIndexBlockType, TitoIndexConfig, TitoIndexField,
    TitoModelTrait, TitoOperation, TitoOptions,
};
pub use index::MAX_INDEX_ENTRIES_PER_ROW;
pub use query::{DEFAULT_PAGE_LIMIT, IndexQuery, MAX_PAGE_LIMIT, QueryArg, TableQuery, TitoPage};
pub use shape::{MAX_VERSION, ShapeError, TitoShape, read_exact};
pub use value::{IndexValue, ScalarIndexValue};

pub(crate) use crate::engine::read_only;
use crate::engine::{self, OnStore, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use catalog::{IndexState, TableHandle, WritePlan};

/// The operations on one model type. Cheap to clone; get one with
/// [`TitoEngine::model`].
pub struct TitoModel<E, T> {
    db: E,
    /// The table's schema handle once reconciled, shared by clones (no registry lookup per
    /// write).
    schema: Arc<OnceLock<Arc<TableHandle>>>,
    _model: PhantomData<fn() -> T>,
}

impl<E: Clone, T> Clone for TitoModel<E, T> {
    fn clone(&self) -> Self {
        TitoModel {
            db: self.db.clone(),
            schema: self.schema.clone(),
            _model: PhantomData,
        }
    }
}

impl<E, T> std::fmt::Debug for TitoModel<E, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TitoModel")
            .field("model", &std::any::type_name::<T>())
            .finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Insert,
    Update,
    Upsert,
}

impl Mode {
    /// The `operation` field of the `tito.model` span.
    fn name(self) -> &'static str {
        match self {
            Mode::Insert => "insert",
            Mode::Update => "update",
            Mode::Upsert => "upsert",
        }
    }
}

/// A row and its manifest as stored, validated.
pub(crate) struct Stored {
    /// The row's JSON as stored, in the shape of [`Stored::version`] (a write converts it to the
    /// code's shape before it uses it); the row's text when it is not JSON (version 0).
    pub row: Value,
    /// The row's shape version as stored (0: no version header or JSON could be read).
    pub version: u32,
    /// The row as stored.
    pub bytes: Vec<u8>,
    pub manifest: Vec<String>,
    /// The schema version the manifest was written under (0: before catalogs).
    pub manifest_version: u64,
}

/// A manifest as stored: the schema version it was written under and the keys.
#[derive(serde::Serialize, serde::Deserialize)]
struct ManifestRecord {
    v: u64,
    keys: Vec<String>,
}

pub(crate) fn encode_manifest(version: u64, keys: &[String]) -> TitoResult<Vec<u8>> {
    Ok(serde_json::to_vec(&ManifestRecord {
        v: version,
        keys: keys.to_vec(),
    })?)
}

/// A missing row, as the user wrote its id (the storage key follows, for operators).
fn no_row(table: &str, id: &str) -> String {
    format!(
        "table {table:?} has no row with id {id:?} (key {})",
        keys::row_key(table, id)
    )
}

fn integrity(message: String) -> TitoError {
    TitoError::Integrity(message)
}

/// All index configs of a model, each with whether it is unique; duplicate names are an error.
pub(crate) fn index_configs<T: TitoModelTrait>(
    model: &T,
) -> TitoResult<Vec<(TitoIndexConfig, bool)>> {
    let mut all: Vec<(TitoIndexConfig, bool)> = model
        .indexes()
        .into_iter()
        .map(|c| (c, false))
        .chain(model.unique_indexes().into_iter().map(|c| (c, true)))
        .collect();
    let mut names = HashSet::new();
    for (config, _) in &all {
        if config.name.is_empty() {
            return Err(TitoError::invalid_argument(format!(
                "an index of table {:?} has an empty name",
                model.table()
            )));
        }
        if !names.insert(config.name.clone()) {
            return Err(TitoError::invalid_argument(format!(
                "table {:?} declares index {:?} twice",
                model.table(),
                config.name
            )));
        }
    }
    all.shrink_to_fit();
    Ok(all)
}

/// The index entries of a row for the indexes a write plan maintains, each with its index's
/// state. `code` holds the code's configs with their conditions evaluated on the row.
pub(crate) fn planned_entries(
    plan: &WritePlan,
    code: &[(TitoIndexConfig, bool)],
    row: &Value,
    table: &str,
    id: &str,
) -> TitoResult<Vec<(index::Entry, IndexState)>> {
    planned_entries_reusing(plan, code, row, table, id, &mut [])
}

/// The entries of `row` for each of the code's configs (aligned with `code`, each with its own
/// uniqueness), `None` where computing them failed (the write plan computes them again and
/// reports the error where it would have).
fn code_entries(
    code: &[(TitoIndexConfig, bool)],
    row: &Value,
    table: &str,
    id: &str,
) -> Vec<Option<Vec<index::Entry>>> {
    code.iter()
        .map(|(config, unique)| index::entries(config, *unique, row, table, id).ok())
        .collect()
}

/// [`planned_entries`], taking the entries of a planned index from `known` (see
/// [`code_entries`], computed for the same `row`) where the plan maintains the code's config
/// as it is, with the same uniqueness.
fn planned_entries_reusing(
    plan: &WritePlan,
    code: &[(TitoIndexConfig, bool)],
    row: &Value,
    table: &str,
    id: &str,
    known: &mut [Option<Vec<index::Entry>>],
) -> TitoResult<Vec<(index::Entry, IndexState)>> {
    let mut out = Vec::new();
    for planned in &plan.indexes {
        let in_code = code.iter().position(|(c, _)| c.name == planned.name);
        let config = match (&planned.stored, in_code) {
            (Some(config), _) => config,
            (None, Some(at)) => &code[at].0,
            (None, None) => {
                return Err(integrity(format!(
                    "index {:?} of table {table:?} is planned from code that does not declare it",
                    planned.name
                )));
            }
        };
        let reused = in_code
            .filter(|&at| code[at].1 == planned.unique && code[at].0 == *config)
            .and_then(|at| known.get_mut(at)?.take());
        let entries = match reused {
            Some(entries) => entries,
            None => index::entries(config, planned.unique, row, table, id)?,
        };
        for mut entry in entries {
            entry.key_only = planned.key_only;
            out.push((entry, planned.state));
        }
    }
    Ok(out)
}

/// The operation a write's events report: what the write did (`did`), or what the caller stated
/// in its options when that does not contradict it (an upsert may also be stated as `Upsert`).
/// `None` when the options switch events off.
fn reported_operation(
    options: &TitoOptions,
    did: TitoOperation,
    upsert: bool,
    table: &str,
    id: &str,
) -> TitoResult<Option<TitoOperation>> {
    if options.skip_events {
        return match options.events {
            Some(stated) => Err(TitoError::invalid_argument(format!(
                "the options of a write of row {id:?} of table {table:?} both state its events \
                 report {stated:?} and switch events off"
            ))),
            None => Ok(None),
        };
    }
    match options.events {
        None => Ok(Some(did)),
        Some(stated) if stated == did || (upsert && stated == TitoOperation::Upsert) => {
            Ok(Some(stated))
        }
        Some(stated) => {
            let what = match (upsert, did) {
                (true, TitoOperation::Insert) => "is an upsert that inserts",
                (true, _) => "is an upsert that updates",
                (false, TitoOperation::Insert) => "is an insert",
                (false, TitoOperation::Update) => "is an update",
                (false, _) => "is a delete",
            };
            Err(TitoError::invalid_argument(format!(
                "the write of row {id:?} of table {table:?} {what}, but its options state its \
                 events report {stated:?}; state {did:?}, or no operation \
                 (TitoOptions::default() reports what the write does)"
            )))
        }
    }
}

/// The event configs a write reporting `operation` publishes, checked before anything is
/// written: a queue name that no `Queue` can open, or a negative time, is refused.
fn declared_events<T: TitoModelTrait>(
    model: &T,
    operation: TitoOperation,
) -> TitoResult<Vec<TitoEventConfig>> {
    let mut out = Vec::new();
    for config in model.events() {
        if config.name.is_empty() {
            return Err(TitoError::invalid_argument(format!(
                "an event config of table {:?} has an empty queue name",
                model.table()
            )));
        }
        if config.timestamp < 0 {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} of table {:?} has a negative timestamp {}",
                config.name,
                model.table(),
                config.timestamp
            )));
        }
        if model.publishes_on(&config.name, operation) {
            out.push(config);
        }
    }
    Ok(out)
}

/// The logical id of a model event: `{table}:{id}:{version}`, with the version of the write
/// ([`engine::write_version`]: the same across the transaction's replays). A table and id over
/// 512 bytes together are named by the id's FNV-1a hash instead (`{table}:#{hash}:{version}`),
/// keeping the queue's keys short.
pub(crate) fn model_event_id(table: &str, id: &str, version: u64) -> String {
    if table.len() + id.len() <= 512 {
        format!("{table}:{id}:{version}")
    } else {
        format!("{table}:#{:016x}:{version}", keys::fnv1a(id.as_bytes()))
    }
}

/// A manifest's schema version and keys. Manifests written before catalogs are a plain JSON
/// array of keys (version 0).
pub(crate) fn parse_manifest(key: &str, bytes: &[u8]) -> TitoResult<(u64, Vec<String>)> {
    if let Ok(record) = serde_json::from_slice::<ManifestRecord>(bytes) {
        return Ok((record.v, record.keys));
    }
    serde_json::from_slice::<Vec<String>>(bytes)
        .map(|keys| (0, keys))
        .map_err(|err| {
            integrity(format!(
                "manifest {key:?} is neither a manifest record nor a JSON array of keys: {err}"
            ))
        })
}

/// A stored row as `T`, upgraded from an older shape version (see [`shape`]).
pub(crate) fn decode_model<T: TitoModelTrait>(key: &str, bytes: &[u8]) -> TitoResult<T> {
    shape::decode_row(key, bytes)
}

/// Reads and validates a row with its manifest and every key the manifest lists, and the
/// table's catalog in the same request; returns the row and what a write maintains.
///
/// `also` are keys the caller will read next (the unique claims a write expects to take): they
/// join the same request, and their values come back in order.
///
/// Keys the manifest lists for indexes that are no longer live (dropping, or gone) are not
/// required to exist: a drop deletes them while the manifests still name them.
async fn load<X: TitoTransaction>(
    tx: &X,
    table: &str,
    id: &str,
    handle: &TableHandle,
    also: &[String],
) -> TitoResult<(Option<Stored>, WritePlan, Vec<Option<Vec<u8>>>)> {
    let row_key = keys::row_key(table, id);
    let manifest_key = keys::manifest_key(table, id);
    let mut wanted = Vec::with_capacity(3 + also.len());
    wanted.extend([
        row_key.into_bytes(),
        manifest_key.into_bytes(),
        keys::schema_key(table).into_bytes(),
    ]);
    wanted.extend(also.iter().map(|k| k.clone().into_bytes()));
    let mut found = tx.batch_get(&wanted).await?;
    let extra = found.split_off(3);
    let plan = handle.plan(found.pop().flatten().as_deref())?;
    let stored = validate(tx, table, id, found, &plan).await?;
    Ok((stored, plan, extra))
}

async fn validate<X: TitoTransaction>(
    tx: &X,
    table: &str,
    id: &str,
    found: Vec<Option<Vec<u8>>>,
    plan: &WritePlan,
) -> TitoResult<Option<Stored>> {
    let row_key = keys::row_key(table, id);
    let manifest_key = keys::manifest_key(table, id);
    let mut found = found.into_iter();
    let (row, manifest) = match (found.next().flatten(), found.next().flatten()) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(integrity(format!(
                "row {row_key:?} has no manifest {manifest_key:?}"
            )));
        }
        (None, Some(_)) => {
            return Err(integrity(format!(
                "manifest {manifest_key:?} is orphaned: row {row_key:?} does not exist"
            )));
        }
        (Some(row), Some(manifest)) => (row, manifest),
    };
    // A row that does not read is kept as text: a delete removes it all the same, and a write
    // that needs its values refuses it when it converts it.
    let (version, row_value) = shape::stored_value(&row_key, &row)
        .unwrap_or_else(|_| (0, Value::String(String::from_utf8_lossy(&row).into_owned())));
    let (manifest_version, manifest) = parse_manifest(&manifest_key, &manifest)?;
    if let Some(bad) = manifest
        .iter()
        .find(|key| !keys::is_index_key_of(key, table, id) && !keys::is_claim_key_of(key, table))
    {
        return Err(integrity(format!(
            "manifest {manifest_key:?} names {bad:?}, which is neither an index key of \
             {row_key:?} nor a unique claim of table {table:?}"
        )));
    }
    let live: Vec<&String> = manifest
        .iter()
        .filter(|key| {
            plan.version == 0
                || keys::index_name_of(key, table).is_some_and(|index| plan.is_live(&index))
        })
        .collect();
    if !live.is_empty() {
        let listed: Vec<Vec<u8>> = live.iter().map(|k| k.as_bytes().to_vec()).collect();
        let present = tx.batch_get(&listed).await?;
        for (key, value) in live.iter().zip(&present) {
            match value {
                None => {
                    return Err(integrity(format!(
                        "manifest {manifest_key:?} names {key:?}, which does not exist"
                    )));
                }
                Some(owner) if keys::is_claim_key_of(key, table) && owner != id.as_bytes() => {
                    return Err(integrity(format!(
                        "manifest {manifest_key:?} names claim {key:?}, which another row holds"
                    )));
                }
                Some(_) => {}
            }
        }
    }
    Ok(Some(Stored {
        row: row_value,
        version,
        bytes: row,
        manifest,
        manifest_version,
    }))
}

/// Sets `created_at` / `updated_at` where the row's shape has them (as a number: Unix seconds;
/// as a string: RFC 3339). Fields the model does not serialize are never added. Returns whether
/// it set any.
fn stamp(row: &mut Value, previous: Option<&Value>, now_millis: u64) -> bool {
    let Some(object) = row.as_object_mut() else {
        return false;
    };
    let mut changed = false;
    let now = chrono::DateTime::from_timestamp_millis(now_millis as i64).unwrap_or_default();
    let value_like = |template: &Value| match template {
        Value::Number(_) => Some(Value::from(now.timestamp())),
        Value::String(_) => Some(Value::from(
            now.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        )),
        _ => None,
    };
    if let Some(template) = object.get("created_at") {
        let kept = previous
            .and_then(|p| p.get("created_at"))
            .filter(|v| !v.is_null())
            .cloned();
        if let Some(value) = kept.or_else(|| value_like(template)) {
            object.insert("created_at".into(), value);
            changed = true;
        }
    }
    if let Some(value) = object.get("updated_at").and_then(value_like) {
        object.insert("updated_at".into(), value);
        changed = true;
    }
    changed
}

/// What [`TitoEngine::model`] builds for a model type.
impl<E: TitoEngine, T: TitoModelTrait> OnStore<E> for T {
    type Handle = TitoModel<E, T>;

    fn handle(engine: E) -> TitoModel<E, T> {
        TitoModel::new(engine)
    }
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// The operations on `T` stored in `db`.
    pub fn new(db: E) -> Self {
        shape::register::<E, T>(&db);
        TitoModel {
            db,
            schema: Arc::default(),
            _model: PhantomData,
        }
    }

    /// The table's schema handle, reconciled with the catalog on first use.
    pub(crate) async fn schema_handle(&self) -> TitoResult<Arc<TableHandle>> {
        if let Some(handle) = self.schema.get()
            && handle.is_reconciled()
        {
            return Ok(handle.clone());
        }
        let handle = TableHandle::of::<E, T>(&self.db).await?;
        let _ = self.schema.set(handle.clone());
        Ok(handle)
    }

    /// The engine.
    pub fn engine(&self) -> &E {
        &self.db
    }

    fn table() -> String {
        T::default().table()
    }

    /// Inserts a new row in a transaction of its own (replayed on conflicts). A row with the
    /// same id is [`TitoError::AlreadyExists`].
    pub async fn build(&self, model: T) -> TitoResult<T> {
        self.in_own_transaction(model, Mode::Insert).await
    }

    /// Inserts a new row inside `tx`.
    pub async fn build_with_options(
        &self,
        model: T,
        options: TitoOptions,
        tx: &E::Transaction,
    ) -> TitoResult<T> {
        self.write(tx, model, Mode::Insert, &options).await
    }

    /// Replaces an existing row in a transaction of its own. A missing row is
    /// [`TitoError::NotFound`].
    pub async fn update(&self, model: T) -> TitoResult<T> {
        self.in_own_transaction(model, Mode::Update).await
    }

    /// Replaces an existing row inside `tx`.
    pub async fn update_with_options(
        &self,
        model: T,
        options: TitoOptions,
        tx: &E::Transaction,
    ) -> TitoResult<T> {
        self.write(tx, model, Mode::Update, &options).await
    }

    /// Inserts or replaces a row in a transaction of its own.
    pub async fn upsert(&self, model: T) -> TitoResult<T> {
        self.in_own_transaction(model, Mode::Upsert).await
    }

    /// Inserts or replaces a row inside `tx`.
    pub async fn upsert_with_options(
        &self,
        model: T,
        options: TitoOptions,
        tx: &E::Transaction,
    ) -> TitoResult<T> {
        self.write(tx, model, Mode::Upsert, &options).await
    }

    /// Deletes a row, its index entries, claims and manifest in a transaction of its own.
    pub async fn delete_by_id(&self, id: &str) -> TitoResult<()> {
        self.schema_handle().await?;
        let this = self.clone();
        let id = id.to_string();
        self.db
            .transaction(|tx| async move {
                this.delete_by_id_with_options(&id, TitoOptions::default(), &tx)
                    .await
            })
            .await
    }

    /// Deletes a row inside `tx`. A missing row is [`TitoError::NotFound`]. A row that no longer
    /// decodes as `T` (written by an older shape of the model) is deleted all the same, with
    /// the index entries and claims its manifest lists; its events carry the row as stored
    /// (see [`ModelEvent::row`](crate::event::ModelEvent::row)).
    pub async fn delete_by_id_with_options(
        &self,
        id: &str,
        options: TitoOptions,
        tx: &E::Transaction,
    ) -> TitoResult<()> {
        let table = Self::table();
        let span = tracing::debug_span!("tito.model", table = %table, operation = "delete", id);
        self.delete_in(&table, id, options, tx)
            .instrument(span)
            .await
    }

    async fn delete_in(
        &self,
        table: &str,
        id: &str,
        options: TitoOptions,
        tx: &E::Transaction,
    ) -> TitoResult<()> {
        let table = table.to_string();
        let handle = self.schema_handle().await?;
        let (stored, plan, _) = load(tx, &table, id, &handle, &[]).await?;
        let stored = stored.ok_or_else(|| TitoError::NotFound(no_row(&table, id)))?;
        let operation = reported_operation(&options, TitoOperation::Delete, false, &table, id)?;
        // A row that does not read as `T` (a shape no declared conversion reads, a newer one,
        // not JSON) is deleted all the same: its events carry the row as stored, and
        // are the ones `T::default()` declares, due at the delete's time (a due time read
        // from the row cannot be read).
        let events = match operation {
            Some(operation) => {
                match shape::decode_row::<T>(&keys::row_key(&table, id), &stored.bytes) {
                    // In the shape writers may write, as an update's events are: the running
                    // deploy's handlers read it. Without a downgrade to it, as stored.
                    Ok(model) if T::VERSION > plan.writable => {
                        let row = serde_json::to_value(&model)?;
                        match write::written_shape(&model, &row, &table, plan.writable) {
                            Ok((version, json)) => {
                                let row: serde_json::Value = serde_json::from_slice(&json)?;
                                self.prepare_events(tx, operation, &model, &row, version)?
                            }
                            Err(_) => self.prepare_events(
                                tx,
                                operation,
                                &model,
                                &stored.row,
                                stored.version,
                            )?,
                        }
                    }
                    Ok(model) => self.prepare_events(tx, operation, &model, &model, T::VERSION)?,
                    Err(err) => {
                        tracing::warn!(table = %table, id, error = %err, "deleting a row that does not decode as its model");
                        let now = (engine::version_millis(tx.start_version()) / 1000) as i64;
                        let configs = declared_events(&T::default(), operation)?
                            .into_iter()
                            .map(|config| TitoEventConfig {
                                timestamp: now,
                                ..config
                            })
                            .collect();
                        self.events_of(
                            tx,
                            operation,
                            configs,
                            (&table, id),
                            &stored.row,
                            stored.version,
                        )?
                    }
                }
            }
            None => Vec::new(),
        };
        // Exactly what the manifest lists: entries and claims (a condition that depends on the
        // row is never evaluated again, least of all on a default row). Read first, then
        // written together (see `write_in`).
        let mut writes = engine::Writes::default();
        for key in stored.manifest {
            if keys::is_claim_key_of(&key, &table) {
                self.release_claim(tx, &key, id, &mut writes).await?;
            } else {
                writes.delete(key.into_bytes());
            }
        }
        writes.delete(keys::manifest_key(&table, id).into_bytes());
        writes.delete(keys::row_key(&table, id).into_bytes());
        let wakes = self.plan_events(tx, events, &mut writes).await?;
        writes.apply(tx).await?;
        self.wake_after_commit(tx, wakes);
        Ok(())
    }

    /// The model's events for `operation` ([`declared_events`]), encoded and checked before
    /// anything is written: one [`ModelEvent`] per event config, to the queue named like the
    /// config, keyed `{table}:{id}`, with the id [`model_event_id`] gives.
    ///
    /// [`ModelEvent`]: crate::event::ModelEvent
    fn prepare_events<R: serde::Serialize>(
        &self,
        tx: &E::Transaction,
        operation: TitoOperation,
        model: &T,
        row: &R,
        shape: u32,
    ) -> TitoResult<Vec<(String, crate::event::publish::PreparedEvent)>> {
        let configs = declared_events(model, operation)?;
        self.events_of(
            tx,
            operation,
            configs,
            (&model.table(), &model.id()),
            row,
            shape,
        )
    }

    /// [`Self::prepare_events`] for the event configs `configs` of the row `table`/`id`.
    fn events_of<R: serde::Serialize>(
        &self,
        tx: &E::Transaction,
        operation: TitoOperation,
        configs: Vec<TitoEventConfig>,
        (table, id): (&str, &str),
        row: &R,
        shape: u32,
    ) -> TitoResult<Vec<(String, crate::event::publish::PreparedEvent)>> {
        let (table, id) = (table.to_string(), id.to_string());
        let event_id = model_event_id(&table, &id, engine::write_version(tx));
        configs
            .into_iter()
            .map(|config| {
                let event = crate::event::QueueEvent::new(
                    format!("{table}:{id}"),
                    crate::event::ModelEvent {
                        operation,
                        table: table.clone(),
                        id: id.clone(),
                        row,
                        shape,
                    },
                    config.timestamp,
                )
                .with_id(event_id.clone());
                Ok((
                    config.name,
                    crate::event::publish::PreparedEvent::new(&event)?,
                ))
            })
            .collect()
    }

    /// Plans the publication of prepared events: their queues' metadata and id keys are read
    /// now, their writes join `writes`. Returns the (queue root, partition) pairs to wake once
    /// the transaction commits ([`Self::wake_after_commit`], after the writes are buffered).
    async fn plan_events(
        &self,
        tx: &E::Transaction,
        events: Vec<(String, crate::event::publish::PreparedEvent)>,
        writes: &mut engine::Writes,
    ) -> TitoResult<Vec<(String, u32)>> {
        let mut wakes = Vec::new();
        for (topic, event) in events {
            let partitions = self.db.partitions();
            wakes.push(
                crate::event::publish::plan_model_event(tx, &topic, partitions, event, writes)
                    .await?,
            );
        }
        Ok(wakes)
    }

    /// Wakes this process's workers of each (queue root, partition) once `tx` commits.
    fn wake_after_commit(&self, tx: &E::Transaction, wakes: Vec<(String, u32)>) {
        for (root, partition) in wakes {
            crate::event::nudge::wakeups(&self.db, &root).wake_after_commit(tx, partition);
        }
    }

    async fn in_own_transaction(&self, model: T, mode: Mode) -> TitoResult<T> {
        // Reconciled before the transaction starts, so its snapshot holds the catalog.
        self.schema_handle().await?;
        let this = self.clone();
        self.db
            .transaction(
                |tx| async move { this.write(&tx, model, mode, &TitoOptions::default()).await },
            )
            .await
    }

    async fn write(
        &self,
        tx: &E::Transaction,
        model: T,
        mode: Mode,
        options: &TitoOptions,
    ) -> TitoResult<T> {
        let span = tracing::debug_span!(
            "tito.model",
            table = %model.table(),
            operation = mode.name(),
            id = %model.id()
        );
        self.write_in(tx, model, mode, options)
            .instrument(span)
            .await
    }

    /// Reads one row by id in a transaction of its own. A missing row is
    /// [`TitoError::NotFound`]. Tito loads one model at a time: `relationships` must be empty
    /// (load related records explicitly).
    pub async fn find_by_id(&self, id: &str, relationships: Vec<String>) -> TitoResult<T> {
        if !relationships.is_empty() {
            return Err(TitoError::invalid_argument(format!(
                "Tito does not load relationships ({relationships:?}); read related models explicitly"
            )));
        }
        read_only(&self.db, async |tx| self.find_by_id_in_tx(id, tx).await).await
    }

    /// Reads one row by id inside `tx`.
    pub async fn find_by_id_in_tx(&self, id: &str, tx: &E::Transaction) -> TitoResult<T> {
        self.get_in_tx(id, tx)
            .await?
            .ok_or_else(|| TitoError::NotFound(no_row(&Self::table(), id)))
    }

    /// Reads one row by id in a transaction of its own: `None` when the table has no such row
    /// ([`Self::find_by_id`] answers [`TitoError::NotFound`] instead).
    ///
    /// ```
    /// # use serde::{Deserialize, Serialize};
    /// # use tito::prelude::*;
    /// # #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
    /// # struct Member { id: String }
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), TitoError> {
    /// let db = Embedded::temporary().await?;
    /// let members = db.clone().model::<Member>();
    /// assert!(members.get("1").await?.is_none());
    /// members.build(Member { id: "1".into() }).await?;
    /// assert_eq!(members.get("1").await?.map(|m| m.id).as_deref(), Some("1"));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn get(&self, id: &str) -> TitoResult<Option<T>> {
        read_only(&self.db, async |tx| self.get_in_tx(id, tx).await).await
    }

    /// [`Self::get`] inside `tx`.
    pub async fn get_in_tx(&self, id: &str, tx: &E::Transaction) -> TitoResult<Option<T>> {
        let table = Self::table();
        let key = keys::row_key(&table, id);
        let span = tracing::debug_span!("tito.model", table = %table, operation = "get", id);
        match tx.get(key.as_bytes()).instrument(span).await? {
            Some(bytes) => decode_model(&key, &bytes).map(Some),
            None => Ok(None),
        }
    }

    /// Reads many rows in one round trip, in a transaction of its own; the answer is aligned
    /// with `ids` (`None` for a missing row).
    pub async fn find_by_ids(&self, ids: &[String]) -> TitoResult<Vec<Option<T>>> {
        read_only(&self.db, async |tx| self.find_by_ids_in_tx(ids, tx).await).await
    }

    /// Reads many rows in one round trip inside `tx`.
    pub async fn find_by_ids_in_tx(
        &self,
        ids: &[String],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Option<T>>> {
        let table = Self::table();
        let keys: Vec<String> = ids.iter().map(|id| keys::row_key(&table, id)).collect();
        let raw: Vec<Vec<u8>> = keys.iter().map(|k| k.clone().into_bytes()).collect();
        let values = tx.batch_get(&raw).await?;
        keys.iter()
            .zip(values)
            .map(|(key, value)| value.map(|bytes| decode_model(key, &bytes)).transpose())
            .collect()
    }

    /// A query over one index.
    pub fn query_by_index(&self, index: &str) -> IndexQuery<E, T> {
        IndexQuery::new(self.clone(), index)
    }

    /// A scan of the table in id order.
    pub fn find(&self) -> TableQuery<E, T> {
        TableQuery::new(self.db.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Defect 10: manifests and rows decode or are refused, never panic.
        #[test]
        fn manifests_and_rows_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            if let Ok((_, listed)) = parse_manifest("m", &bytes) {
                for key in listed {
                    let _ = keys::is_index_key_of(&key, "t", "1");
                    let _ = keys::is_claim_key_of(&key, "t");
                }
            }
            let _ = shape::stored_value("r", &bytes);
        }
    }
}
