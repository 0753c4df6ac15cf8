//! A table's stored index catalog, as the model layer reads and keeps it: reconciliation of the
//! code's index declarations with the catalog on a model type's first use, the per-store cache
//! of catalogs, and the plan of which indexes a write maintains. Builds, drops, audit and repair
//! of indexes run in [`crate::schema`], which documents the whole life of an index.

use std::any::TypeId;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait, decode_model,
    index_configs,
};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::util::lock;

/// How long a process trusts the catalog state it read last before a query reads it again.
pub const CATALOG_REFRESH: Duration = Duration::from_secs(1);

/// How many schema versions a catalog remembers the code of (to recognise an older deploy).
const HISTORY: usize = 32;

/// The state of one index in the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum IndexState {
    /// Writers maintain it; a build is filling it for older rows. Queries are refused.
    Building,
    /// Complete: queries use it.
    Ready,
    /// Removed from the code: its entries and claims are being deleted. Queries are refused.
    Dropping,
}

impl std::fmt::Display for IndexState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IndexState::Building => "building",
            IndexState::Ready => "ready",
            IndexState::Dropping => "dropping",
        })
    }
}

/// What an index is, as the catalog stores it: the identity the code is compared against.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexDefinition {
    /// The fields in key order, with their types (`string`, `number`, `integer`, `unsigned`,
    /// `boolean`, `timestamp`).
    pub fields: Vec<(String, String)>,
    /// Whether a combination of values may belong to one row only.
    pub unique: bool,
    /// The condition's name and version, when rows are in the index only where it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<(String, u32)>,
    /// Whether entries hold only their key, not a copy of the row
    /// ([`TitoModelTrait::key_only_indexes`]).
    /// Absent from the stored definition when false, so catalogs written before the layout
    /// existed keep their fingerprints.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub key_only: bool,
}

impl std::fmt::Display for IndexDefinition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields: Vec<String> = self
            .fields
            .iter()
            .map(|(name, kind)| format!("{name}: {kind}"))
            .collect();
        write!(f, "({})", fields.join(", "))?;
        if self.unique {
            f.write_str(" unique")?;
        }
        if let Some((name, version)) = &self.condition {
            write!(f, " where {name} v{version}")?;
        }
        if self.key_only {
            f.write_str(" keys only")?;
        }
        Ok(())
    }
}

/// One index of a catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogIndex {
    /// Its definition.
    pub definition: IndexDefinition,
    /// Its state.
    pub state: IndexState,
    /// The schema version at which it entered this state.
    pub since: u64,
    /// Engine time (Unix ms) before which its build or drop does not start: the
    /// [write grace](write_grace) after the change, so that every write that read the catalog
    /// before the change has committed or failed.
    #[serde(default)]
    pub not_before_ms: u64,
}

/// The default [`write_grace`]: ten seconds.
pub const DEFAULT_WRITE_GRACE: Duration = Duration::from_secs(10);

/// How long a build or drop on store `db` waits after its index's state changed before it scans
/// rows. A write that read the catalog before the change and commits after the build scanned
/// past its row would be missed; the wait outlasts every such write that lives shorter than it
/// (Tito's own write transactions live milliseconds). Writes in a caller's transaction that
/// stays open longer than this across an index registration are what [`TitoModel::audit`] is
/// for. [`DEFAULT_WRITE_GRACE`] unless [`set_write_grace`] changed it for this store.
///
/// [`TitoModel::audit`]: crate::model::TitoModel::audit
pub fn write_grace<E: TitoEngine>(db: &E) -> Duration {
    Duration::from_millis(db.extensions().get::<SchemaState>().grace_ms())
}

/// Sets [`write_grace`] for store `db` in this process (every clone of the handle; catalog
/// changes made afterwards use it; another store keeps its own). Refused over an hour.
pub fn set_write_grace<E: TitoEngine>(db: &E, grace: Duration) -> TitoResult<()> {
    if grace > Duration::from_secs(3600) {
        return Err(TitoError::invalid_argument(format!(
            "the schema write grace is at most an hour, got {grace:?}"
        )));
    }
    let state = db.extensions().get::<SchemaState>();
    state
        .write_grace_ms
        .store(crate::util::millis(grace), Ordering::Relaxed);
    Ok(())
}

/// A table's stored index catalog.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Catalog {
    /// Increases with every change.
    pub version: u64,
    /// The indexes by name.
    pub indexes: BTreeMap<String, CatalogIndex>,
    /// `(version, fingerprint)` of the code seen at recent versions, oldest first.
    #[serde(default)]
    history: Vec<(u64, String)>,
    /// The rows' shape versions: which ones code has declared, and the newest writers may write.
    #[serde(default, skip_serializing_if = "Shapes::is_unset")]
    pub shapes: Shapes,
}

/// The shape versions of a table's rows, as its catalog records them
/// ([`crate::model::shape`]): every version some code declared on first use, and the newest
/// one writers may write. Code of a newer version reads its rows at once but writes the
/// [`writable`](Shapes::writable) version (through its declared downgrade) until an operator
/// allows its own ([`crate::schema::allow_shape_version`]), so that instances of the previous
/// deploy never meet a row they cannot read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shapes {
    /// The newest version writers may write (0 in a catalog written before versions were
    /// recorded: rows there are version 1).
    pub writable: u32,
    /// Each version some code declared, with the engine time (Unix ms) it was first seen.
    pub seen: BTreeMap<u32, u64>,
    /// The engine time (Unix ms) an operator last changed [`writable`](Shapes::writable) (0:
    /// never). A rewrite to the new version waits the [`write_grace`] after it, so that a
    /// write that read the catalog before the change commits before the rewrite reads rows.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub changed_ms: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl Shapes {
    fn is_unset(&self) -> bool {
        self.writable == 0 && self.seen.is_empty()
    }

    /// The newest version writers may write (1 when none was recorded).
    pub fn writable(&self) -> u32 {
        self.writable.max(1)
    }

    /// Records code of shape `version` on first use; `fresh`: this registration creates the
    /// catalog (no older code can have written the table). Returns whether anything changed.
    fn register(&mut self, version: u32, fresh: bool, now_ms: u64) -> bool {
        let mut changed = false;
        if self.is_unset() {
            // A new table writes the first code's shape; a table older than recorded shapes
            // holds rows of version 1, and code of that version may still run.
            self.writable = if fresh { version } else { 1 };
            self.seen.insert(self.writable, now_ms);
            changed = true;
        }
        if let std::collections::btree_map::Entry::Vacant(slot) = self.seen.entry(version) {
            slot.insert(now_ms);
            changed = true;
        }
        changed
    }
}

impl Catalog {
    /// The schema version whose code had this fingerprint, if the catalog remembers it.
    fn version_of(&self, fingerprint: &str) -> Option<u64> {
        self.history
            .iter()
            .rev()
            .find(|(_, fp)| fp == fingerprint)
            .map(|(v, _)| *v)
    }

    pub(crate) fn latest_fingerprint(&self) -> Option<&str> {
        self.history.last().map(|(_, fp)| fp.as_str())
    }

    pub(crate) fn bump(&mut self, fingerprint: &str) {
        self.version += 1;
        self.history.push((self.version, fingerprint.to_string()));
        if self.history.len() > HISTORY {
            let extra = self.history.len() - HISTORY;
            self.history.drain(..extra);
        }
    }
}

/// Decodes a stored catalog; an error names the key, never panics.
pub(crate) fn parse_catalog(table: &str, bytes: &[u8]) -> TitoResult<Catalog> {
    serde_json::from_slice(bytes).map_err(|err| {
        TitoError::Integrity(format!(
            "schema catalog {:?} is not a catalog: {err}",
            keys::schema_key(table)
        ))
    })
}

/// A build's or a drop's progress.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexProgress {
    /// Rows handled so far.
    pub rows_done: u64,
    /// The table's size when the work started, counted up to a bound (`None`: more than it).
    pub rows_estimate: Option<u64>,
    /// The id of the last row handled; the next batch continues after it.
    pub cursor: Option<String>,
    /// Whether the row pass is over (a drop then deletes leftover entries by prefix).
    #[serde(default)]
    pub rows_finished: bool,
    /// Why a build stopped (duplicates of a unique index), until it is started again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

impl std::fmt::Display for IndexProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rows_estimate {
            Some(total) => write!(f, "{} of about {total} rows", self.rows_done)?,
            None => write!(f, "{} rows", self.rows_done)?,
        }
        if let Some(failure) = &self.failure {
            write!(f, "; stopped: {failure}")?;
        }
        Ok(())
    }
}

fn parse_progress(key: &str, bytes: &[u8]) -> TitoResult<IndexProgress> {
    serde_json::from_slice(bytes)
        .map_err(|err| TitoError::Integrity(format!("progress {key:?} is malformed: {err}")))
}

fn kind_name(kind: TitoIndexBlockType) -> &'static str {
    match kind {
        TitoIndexBlockType::String => "string",
        TitoIndexBlockType::Number => "number",
        TitoIndexBlockType::Integer => "integer",
        TitoIndexBlockType::Unsigned => "unsigned",
        TitoIndexBlockType::Boolean => "boolean",
        TitoIndexBlockType::Timestamp => "timestamp",
        #[allow(unreachable_patterns)]
        _ => "unknown",
    }
}

fn kind_of(name: &str) -> Option<TitoIndexBlockType> {
    Some(match name {
        "string" => TitoIndexBlockType::String,
        "number" => TitoIndexBlockType::Number,
        "integer" => TitoIndexBlockType::Integer,
        "unsigned" => TitoIndexBlockType::Unsigned,
        "boolean" => TitoIndexBlockType::Boolean,
        "timestamp" => TitoIndexBlockType::Timestamp,
        _ => return None,
    })
}

impl IndexDefinition {
    /// The index config a writer uses for an index it only knows from the catalog (it has no
    /// condition, or the write is refused before this is used).
    pub(crate) fn config(&self, name: &str) -> TitoResult<TitoIndexConfig> {
        let fields = self
            .fields
            .iter()
            .map(|(field, kind)| {
                Ok(TitoIndexField {
                    name: field.clone(),
                    r#type: kind_of(kind).ok_or_else(|| {
                        TitoError::Integrity(format!(
                            "the catalog gives field {field:?} of index {name:?} the unknown type {kind:?}"
                        ))
                    })?,
                })
            })
            .collect::<TitoResult<Vec<_>>>()?;
        Ok(TitoIndexConfig {
            condition: true,
            name: name.to_string(),
            fields,
        })
    }
}

/// The index definitions a model's code declares, by name, and their fingerprint.
pub(crate) struct CodeSchema {
    pub definitions: BTreeMap<String, IndexDefinition>,
    pub fingerprint: String,
    /// The code's index configs of one stored row (decoded as the model type): what a build
    /// indexes a row under, without the build naming the type.
    pub row_configs: RowConfigs,
    /// One stored row as JSON of the code's shape (upgraded from an older shape version).
    pub row_value: RowValue,
    /// The shape version the code reads and writes ([`TitoModelTrait::VERSION`]).
    pub shape_version: u32,
}

/// A stored row in the code's shape: `(row key, row bytes) -> row`.
pub(crate) type RowValue = fn(&str, &[u8]) -> TitoResult<serde_json::Value>;

/// The index configs model code gives one stored row: `(row key, row bytes) -> configs`.
pub(crate) type RowConfigs = fn(&str, &[u8]) -> TitoResult<Vec<(TitoIndexConfig, bool)>>;

fn row_configs<T: TitoModelTrait>(
    row_key: &str,
    bytes: &[u8],
) -> TitoResult<Vec<(TitoIndexConfig, bool)>> {
    let model: T = decode_model(row_key, bytes)?;
    index_configs(&model)
}

impl CodeSchema {
    pub(crate) fn of<T: TitoModelTrait>() -> TitoResult<CodeSchema> {
        let model = T::default();
        if let Some(problem) = model.index_value_problem() {
            return Err(TitoError::invalid_argument(format!(
                "model of table {:?} cannot be indexed as declared: {problem}",
                model.table()
            )));
        }
        let conditions: HashMap<String, (String, u32)> = model
            .conditions()
            .into_iter()
            .map(|c| (c.index, (c.name, c.version)))
            .collect();
        let mut key_only: HashSet<String> = model.key_only_indexes().into_iter().collect();
        let mut definitions = BTreeMap::new();
        for (config, unique) in index_configs(&model)? {
            let definition = IndexDefinition {
                fields: config
                    .fields
                    .iter()
                    .map(|f| (f.name.clone(), kind_name(f.r#type).to_string()))
                    .collect(),
                unique,
                condition: conditions.get(&config.name).cloned(),
                key_only: key_only.remove(&config.name),
            };
            definitions.insert(config.name, definition);
        }
        if let Some(name) = key_only.into_iter().min() {
            return Err(TitoError::invalid_argument(format!(
                "table {:?} names {name:?} among its key-only indexes, but declares no index of \
                 that name",
                model.table()
            )));
        }
        let canonical = serde_json::to_vec(&definitions)?;
        Ok(CodeSchema {
            fingerprint: format!("{:016x}", keys::fnv1a(&canonical)),
            definitions,
            row_configs: row_configs::<T>,
            row_value: super::shape::row_value::<T>,
            shape_version: T::VERSION,
        })
    }
}

/// What one write maintains, derived from the catalog it read.
pub(crate) struct WritePlan {
    /// The catalog version (0 without a catalog).
    pub version: u64,
    /// The newest shape version writers may write (`u32::MAX` without a catalog: any).
    pub writable: u32,
    /// Catalog indexes (building or ready) the write maintains, with where their config
    /// comes from.
    pub indexes: Vec<PlannedIndex>,
}

pub(crate) struct PlannedIndex {
    pub name: String,
    pub unique: bool,
    /// Entries hold only their key.
    pub key_only: bool,
    pub state: IndexState,
    /// `None`: take the code's config (its condition evaluated on the row).
    pub stored: Option<TitoIndexConfig>,
    /// The config its stored definition gives when that has no condition (set by
    /// [`WritePlan::with_stored_shapes`]): how a row of another shape version is indexed, its
    /// fields read from the row as stored, as the code that wrote it indexed it.
    pub as_stored: Option<TitoIndexConfig>,
}

impl PlannedIndex {
    /// Index `name` as `definition` defines it, in `state`, with its config from `stored`
    /// (`None`: the code's).
    pub(crate) fn new(
        name: &str,
        definition: &IndexDefinition,
        state: IndexState,
        stored: Option<TitoIndexConfig>,
    ) -> Self {
        PlannedIndex {
            name: name.to_string(),
            unique: definition.unique,
            key_only: definition.key_only,
            state,
            stored,
            as_stored: None,
        }
    }
}

impl WritePlan {
    /// This plan with each index's config from its definition when that has no condition
    /// (`definitions`: the catalog's, else the code's), for [`Self::for_stored_shape`].
    pub(crate) fn with_stored_shapes(
        mut self,
        definitions: impl Fn(&str) -> Option<IndexDefinition>,
    ) -> Self {
        for index in &mut self.indexes {
            index.as_stored = definitions(&index.name)
                .filter(|d| d.condition.is_none())
                .and_then(|d| d.config(&index.name).ok());
        }
        self
    }

    /// The plan that says which entries a row stored in another shape version than the code's
    /// implies: every index from its stored definition, applied to the row as stored (the
    /// entries the code that wrote it wrote), and the names of the indexes that cannot be told
    /// (their condition is code, evaluated on a shape this code does not hold).
    pub(crate) fn for_stored_shape(&self) -> (WritePlan, Vec<String>) {
        self.for_stored_shape_with(|_| None)
    }

    /// [`Self::for_stored_shape`], with the definitions of indexes this plan takes from the
    /// code (`definitions`, when [`Self::with_stored_shapes`] did not set them).
    pub(crate) fn for_stored_shape_with(
        &self,
        definitions: impl Fn(&str) -> Option<IndexDefinition>,
    ) -> (WritePlan, Vec<String>) {
        let mut skipped = Vec::new();
        let mut indexes = Vec::new();
        for index in &self.indexes {
            let config = index
                .stored
                .clone()
                .or_else(|| index.as_stored.clone())
                .or_else(|| {
                    definitions(&index.name)
                        .filter(|d| d.condition.is_none())
                        .and_then(|d| d.config(&index.name).ok())
                });
            match config {
                Some(config) => indexes.push(PlannedIndex {
                    name: index.name.clone(),
                    unique: index.unique,
                    key_only: index.key_only,
                    state: index.state,
                    stored: Some(config),
                    as_stored: None,
                }),
                None => skipped.push(index.name.clone()),
            }
        }
        let plan = WritePlan {
            version: self.version,
            writable: self.writable,
            indexes,
        };
        (plan, skipped)
    }

    /// Whether keys of `index` belong to a live (building or ready) index.
    pub fn is_live(&self, index: &str) -> bool {
        self.indexes.iter().any(|i| i.name == index)
    }
}

/// The per-process knowledge about one (store, table, model type).
pub(crate) struct TableHandle {
    table: String,
    pub(crate) code: CodeSchema,
    reconciled: Mutex<bool>,
    /// Shared by every model type of the table on this store: a catalog change one of them
    /// makes or reads is seen by all.
    cached: Arc<Mutex<Option<CachedCatalog>>>,
}

#[derive(Clone)]
struct CachedCatalog {
    bytes: Option<Vec<u8>>,
    catalog: Option<Arc<Catalog>>,
    read_at: Instant,
}

/// What the model layer keeps per store in this process about catalogs, on the store's handle
/// ([`TitoEngine::extensions`]): never shared between two stores.
struct SchemaState {
    /// Each (table, model type)'s handle, reconciled on first use.
    handles: Mutex<HashMap<(String, TypeId), Arc<TableHandle>>>,
    /// The last catalog read of each table, shared by every model type of the table.
    catalogs: Mutex<HashMap<String, SharedCatalog>>,
    /// Every (table, model type) reconciled on this store, in the order of first use: what
    /// queue maintenance builds ([`used_tables`]). Every model type of a table gets a turn, so
    /// a conditional index is built by the code that declares it.
    used: Mutex<Vec<Arc<TableHandle>>>,
    /// The [`write_grace`] in milliseconds.
    write_grace_ms: AtomicU64,
}

impl Default for SchemaState {
    fn default() -> Self {
        SchemaState {
            handles: Mutex::default(),
            catalogs: Mutex::default(),
            used: Mutex::default(),
            write_grace_ms: AtomicU64::new(crate::util::millis(DEFAULT_WRITE_GRACE)),
        }
    }
}

impl SchemaState {
    fn grace_ms(&self) -> u64 {
        self.write_grace_ms.load(Ordering::Relaxed)
    }
}

/// The handles of every (table, model type) this process reconciled on store `db`, in the order
/// of their first use.
pub(crate) fn used_tables<E: TitoEngine>(db: &E) -> Vec<Arc<TableHandle>> {
    lock(&db.extensions().get::<SchemaState>().used).clone()
}

type SharedCatalog = Arc<Mutex<Option<CachedCatalog>>>;

impl TableHandle {
    /// The handle of model `T` on store `db`, reconciled with the catalog on first use.
    pub(crate) async fn of<E: TitoEngine, T: TitoModelTrait>(
        db: &E,
    ) -> TitoResult<Arc<TableHandle>> {
        let table = T::default().table();
        let state = db.extensions().get::<SchemaState>();
        let key = (table.clone(), TypeId::of::<T>());
        let handle = {
            let existing = lock(&state.handles).get(&key).cloned();
            match existing {
                Some(handle) => handle,
                None => {
                    let handle = Arc::new(TableHandle {
                        table,
                        code: CodeSchema::of::<T>()?,
                        reconciled: Mutex::new(false),
                        cached: lock(&state.catalogs)
                            .entry(key.0.clone())
                            .or_default()
                            .clone(),
                    });
                    lock(&state.handles).entry(key).or_insert(handle).clone()
                }
            }
        };
        handle.clone().ensure_reconciled(db).await?;
        Ok(handle)
    }

    /// Records the catalog a reconciliation returned and the table as used on `db`.
    fn reconciled<E: TitoEngine>(self: &Arc<Self>, db: &E, catalog: Option<(Vec<u8>, Catalog)>) {
        self.remember(catalog);
        *lock(&self.reconciled) = true;
        let state = db.extensions().get::<SchemaState>();
        let mut used = lock(&state.used);
        if !used.iter().any(|h| Arc::ptr_eq(h, self)) {
            used.push(self.clone());
        }
    }

    /// Reconciles the catalog with this handle's code unless that was done: on the first use,
    /// and again when the catalog vanished under a running process (a store reset).
    pub(crate) async fn ensure_reconciled<E: TitoEngine>(
        self: Arc<Self>,
        db: &E,
    ) -> TitoResult<()> {
        if !self.is_reconciled() {
            let catalog = reconcile(db, self.clone()).await?;
            self.reconciled(db, catalog);
        }
        Ok(())
    }

    pub(crate) fn table(&self) -> &str {
        &self.table
    }

    /// Whether the catalog was reconciled with this code (false again after the catalog
    /// vanished under a running process).
    pub(crate) fn is_reconciled(&self) -> bool {
        *lock(&self.reconciled)
    }

    /// Forgets the cached catalog (after this process changed it): the next query reads it.
    pub(crate) fn invalidate(&self) {
        *lock(&self.cached) = None;
    }

    fn remember(&self, catalog: Option<(Vec<u8>, Catalog)>) {
        let (bytes, catalog) = match catalog {
            Some((bytes, catalog)) => (Some(bytes), Some(Arc::new(catalog))),
            None => (None, None),
        };
        *lock(&self.cached) = Some(CachedCatalog {
            bytes,
            catalog,
            read_at: Instant::now(),
        });
    }

    /// The catalog `bytes` (just read from storage) decode to, reusing the last parse when they
    /// are the same.
    fn catalog_of(&self, bytes: Option<&[u8]>) -> TitoResult<Option<Arc<Catalog>>> {
        if let Some(cached) = lock(&self.cached).as_mut()
            && cached.bytes.as_deref() == bytes
        {
            cached.read_at = Instant::now();
            return Ok(cached.catalog.clone());
        }
        let catalog = match bytes {
            Some(bytes) => Some(parse_catalog(&self.table, bytes)?),
            None => None,
        };
        let catalog = catalog.map(Arc::new);
        *lock(&self.cached) = Some(CachedCatalog {
            bytes: bytes.map(<[u8]>::to_vec),
            catalog: catalog.clone(),
            read_at: Instant::now(),
        });
        Ok(catalog)
    }

    /// The catalog a query may trust: the cached one when fresh, else read in `tx`.
    pub(crate) async fn catalog_for_query<X: TitoTransaction>(
        &self,
        tx: &X,
    ) -> TitoResult<Option<Arc<Catalog>>> {
        if let Some(cached) = lock(&self.cached).as_ref()
            && cached.read_at.elapsed() < CATALOG_REFRESH
        {
            return Ok(cached.catalog.clone());
        }
        let bytes = tx.get(keys::schema_key(&self.table).as_bytes()).await?;
        self.catalog_of(bytes.as_deref())
    }

    /// Checks that `index` may be queried; returns whether its entries hold only their keys
    /// (as the catalog defines it, or the code without a catalog).
    pub(crate) async fn check_queryable<X: TitoTransaction>(
        &self,
        tx: &X,
        index: &str,
    ) -> TitoResult<bool> {
        let Some(catalog) = self.catalog_for_query(tx).await? else {
            return Ok(self.code.definitions.get(index).is_some_and(|d| d.key_only));
        };
        let state = match catalog.indexes.get(index) {
            Some(entry) if entry.state == IndexState::Ready => {
                return Ok(entry.definition.key_only);
            }
            Some(entry) => {
                let progress = read_progress(tx, &self.table, index).await?;
                match progress {
                    Some(progress) => format!("{} ({progress})", entry.state),
                    None => entry.state.to_string(),
                }
            }
            None => format!(
                "the catalog (version {}) does not list it; it is registered by the first \
                 operation of code that declares it",
                catalog.version
            ),
        };
        Err(TitoError::IndexNotReady {
            table: self.table.clone(),
            index: index.to_string(),
            state,
        })
    }

    /// What a write that read `catalog_bytes` maintains; refuses code that cannot maintain a
    /// live index.
    pub(crate) fn plan(&self, catalog_bytes: Option<&[u8]>) -> TitoResult<WritePlan> {
        let Some(catalog) = self.catalog_of(catalog_bytes)? else {
            // No catalog (a store reset under a running process): the code's indexes, as
            // before catalogs existed. The next first use registers them.
            *lock(&self.reconciled) = false;
            return Ok(WritePlan {
                version: 0,
                writable: u32::MAX,
                indexes: self
                    .code
                    .definitions
                    .iter()
                    .map(|(name, d)| PlannedIndex::new(name, d, IndexState::Ready, None))
                    .collect(),
            });
        };
        let mut indexes = Vec::new();
        for (name, entry) in &catalog.indexes {
            if entry.state == IndexState::Dropping {
                continue;
            }
            let stored = match self.code.definitions.get(name) {
                Some(definition) if *definition == entry.definition => None,
                Some(definition) => {
                    return Err(self.redefined(&catalog, name, entry, definition));
                }
                None if entry.definition.condition.is_none() => {
                    Some(entry.definition.config(name)?)
                }
                None => {
                    let (condition, version) =
                        entry.definition.condition.clone().unwrap_or_default();
                    return Err(TitoError::SchemaMismatch(format!(
                        "table {:?} is at schema version {}, whose index {name:?} depends on \
                         condition {condition:?} v{version}, which this code ({}) does not \
                         declare: finish deploying the code that does before writing with this one",
                        self.table,
                        catalog.version,
                        self.code_version(&catalog)
                    )));
                }
            };
            indexes.push(PlannedIndex::new(
                name,
                &entry.definition,
                entry.state,
                stored,
            ));
        }
        Ok(WritePlan {
            version: catalog.version,
            writable: catalog.shapes.writable(),
            indexes,
        })
    }

    fn code_version(&self, catalog: &Catalog) -> String {
        match catalog.version_of(&self.code.fingerprint) {
            Some(v) => format!("schema version {v}"),
            None => "a schema the catalog has not registered".to_string(),
        }
    }

    fn redefined(
        &self,
        catalog: &Catalog,
        name: &str,
        entry: &CatalogIndex,
        declared: &IndexDefinition,
    ) -> TitoError {
        TitoError::SchemaMismatch(format!(
            "index {name:?} of table {:?} is stored as {} (schema version {}) but this code \
             ({}) declares it as {declared}: give the new definition a new name, let it build, \
             then remove the old one",
            self.table,
            entry.definition,
            catalog.version,
            self.code_version(catalog)
        ))
    }
}

/// Reads a progress record.
pub(crate) async fn read_progress<X: TitoTransaction>(
    tx: &X,
    table: &str,
    index: &str,
) -> TitoResult<Option<IndexProgress>> {
    let key = keys::schema_progress_key(table, index);
    match tx.get(key.as_bytes()).await? {
        Some(bytes) => parse_progress(&key, &bytes).map(Some),
        None => Ok(None),
    }
}

/// Whether `table` holds no row.
async fn table_is_empty<X: TitoTransaction>(tx: &X, table: &str) -> TitoResult<bool> {
    let prefix = keys::table_prefix(table);
    let end = keys::prefix_end(prefix.clone());
    Ok(tx
        .scan(prefix.as_bytes(), end.as_bytes(), 1)
        .await?
        .is_empty())
}

/// Reconciles the catalog with the code in one transaction (see the module docs). Returns the
/// catalog as stored afterwards.
async fn reconcile<E: TitoEngine>(
    db: &E,
    handle: Arc<TableHandle>,
) -> TitoResult<Option<(Vec<u8>, Catalog)>> {
    let grace_ms = db.extensions().get::<SchemaState>().grace_ms();
    db.transaction(|tx| async move {
        let handle = &handle;
        let table = &handle.table;
        let key = keys::schema_key(table);
        let stored = tx.get(key.as_bytes()).await?;
        let mut catalog = match &stored {
            Some(bytes) => parse_catalog(table, bytes)?,
            None => Catalog::default(),
        };
        let fingerprint = handle.code.fingerprint.as_str();
        let now_ms = crate::engine::version_millis(tx.start_version());
        // Whether the table holds no row (read once, and only where it matters: without a
        // catalog record, or for a new index).
        let mut empty: Option<bool> = None;
        if stored.is_none() {
            empty = Some(table_is_empty(&tx, table).await?);
        }
        // Fresh: nothing was written to the table before (no catalog record and no row). A table
        // whose rows predate the catalog holds rows of version 1, as older code wrote them.
        let fresh = stored.is_none() && empty == Some(true);
        let shapes_changed = catalog
            .shapes
            .register(handle.code.shape_version, fresh, now_ms);
        // Code the catalog already saw at an older version: an older deploy. Change nothing
        // but the record of its shape.
        if catalog.latest_fingerprint() == Some(fingerprint)
            || catalog.version_of(fingerprint).is_some()
        {
            if shapes_changed && stored.is_some() {
                let bytes = serde_json::to_vec(&catalog)?;
                tx.put(key.into_bytes(), bytes.clone()).await?;
                return Ok(Some((bytes, catalog)));
            }
            return Ok(stored.map(|bytes| (bytes, catalog)));
        }
        let next = catalog.version + 1;
        let not_before = crate::engine::version_millis(tx.start_version()).saturating_add(grace_ms);
        for (name, definition) in &handle.code.definitions {
            match catalog.indexes.get(name) {
                None => {
                    let is_empty = match empty {
                        Some(known) => known,
                        None => {
                            let known = table_is_empty(&tx, table).await?;
                            empty = Some(known);
                            known
                        }
                    };
                    // Ready at once only on the table's first registration, and only when it
                    // has no rows: no writer can have read a catalog before this one (a writer
                    // reconciles before it writes, and two first registrations write the same
                    // catalog key, so one replays). Once a catalog exists, a writer of older code
                    // may be committing a row it read the old catalog for, which touches no key
                    // this registration writes: the index builds after the write grace like any
                    // other, which is one short pass when the table is empty.
                    let state = if stored.is_none() && is_empty {
                        IndexState::Ready
                    } else {
                        IndexState::Building
                    };
                    catalog.indexes.insert(
                        name.clone(),
                        CatalogIndex {
                            definition: definition.clone(),
                            state,
                            since: next,
                            not_before_ms: not_before,
                        },
                    );
                    if state == IndexState::Building {
                        // The table is counted by the first build batch, not here: a first use
                        // stays one short transaction.
                        let progress = IndexProgress::default();
                        tx.put(
                            keys::schema_progress_key(table, name).into_bytes(),
                            serde_json::to_vec(&progress)?,
                        )
                        .await?;
                    }
                }
                Some(entry) if entry.state == IndexState::Dropping => {
                    return Err(TitoError::SchemaMismatch(format!(
                        "index {name:?} of table {table:?} is still being dropped (since schema \
                         version {}); its name can be declared again once the drop is done \
                         (TitoModel::build_indexes runs it)",
                        entry.since
                    )));
                }
                Some(entry) if entry.definition != *definition => {
                    return Err(handle.redefined(&catalog, name, entry, definition));
                }
                Some(_) => {}
            }
        }
        let removed: Vec<String> = catalog
            .indexes
            .iter()
            .filter(|(name, entry)| {
                entry.state != IndexState::Dropping && !handle.code.definitions.contains_key(*name)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in removed {
            if let Some(entry) = catalog.indexes.get_mut(&name) {
                entry.state = IndexState::Dropping;
                entry.since = next;
                entry.not_before_ms = not_before;
            }
            tx.put(
                keys::schema_progress_key(table, &name).into_bytes(),
                serde_json::to_vec(&IndexProgress::default())?,
            )
            .await?;
        }
        catalog.bump(fingerprint);
        let bytes = serde_json::to_vec(&catalog)?;
        tx.put(key.into_bytes(), bytes.clone()).await?;
        tracing::info!(table = %table, version = catalog.version, "schema catalog reconciled");
        Ok(Some((bytes, catalog)))
    })
    .await
}
