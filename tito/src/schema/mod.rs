//! Schema evolution: a stored index catalog per table, online index builds and drops, and an
//! audit with repair.
//!
//! Every table has a catalog under `schema:{table}` (layout in [`crate::keys`]): the indexes
//! the table has, each with its definition (fields and their types, unique or not, the
//! identity of its condition), its state, and a schema version that increases with every
//! change.
//!
//! ```text
//!  code declares index  --first use-->  building  --build done-->  ready
//!  code drops index     --first use-->  dropping  --drop done--->  (gone; the name is free)
//! ```
//!
//! # Examples
//!
//! A table written by one deploy, then used by the next, which adds an index:
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tito::backend::embedded::Embedded;
//! use tito::schema::IndexState;
//! use tito::{TitoEngine, TitoError, TitoModel};
//!
//! #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
//! #[tito(table = "user")]
//! struct UserV1 { id: String, email: String }
//!
//! #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
//! #[tito(table = "user")]
//! #[tito(index = "by_email: email")]
//! struct UserV2 { id: String, email: String }
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), TitoError> {
//! # tito::schema::set_write_grace(std::time::Duration::from_millis(10))?;
//! let db = Embedded::temporary().await?;
//! db.clone().model::<UserV1>().build(UserV1 { id: "1".into(), email: "a@x".into() }).await?;
//!
//! let users = db.clone().model::<UserV2>();
//! // Registered as building: the row written before is not in it yet.
//! assert!(matches!(users.by_email("a@x").execute().await, Err(TitoError::IndexNotReady { .. })));
//! let schema = users.build_indexes(|_step| {}).await?;
//! assert_eq!(schema.indexes[0].state, IndexState::Ready);
//! assert_eq!(users.by_email("a@x").execute().await?.items.len(), 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Reconciliation
//!
//! The first operation of a process on a model type reads the catalog and reconciles it with
//! the code (one transaction; afterwards nothing extra is read per operation):
//!
//! - an index the catalog lacks is registered as **building**; writers maintain it from then
//!   on, and a build fills it for older rows in bounded, resumable batches
//!   ([`TitoModel::build_indexes`], or a queue worker's maintenance). Only the table's first
//!   registration, when there is no catalog yet and no row, registers its indexes as **ready**
//!   at once: no writer can have read an older catalog. An index added later to a table that
//!   happens to be empty waits for the [`write_grace`] and a build pass like any other (the pass
//!   is one short scan), because a writer of the previous deploy may be committing a row that
//!   its older catalog did not index;
//! - an index the catalog has but the code no longer declares goes to **dropping**: its entries
//!   and claims are deleted in bounded batches, and its name cannot be declared again until
//!   that is done ([`TitoError::SchemaMismatch`]);
//! - an index whose definition changed under the same name is refused with
//!   [`TitoError::SchemaMismatch`]: give the new definition a new name (add it, let it build,
//!   move the queries, then remove the old one). Tito never reinterprets entries written under
//!   another definition.
//!
//! Code whose set of index definitions the catalog has already seen at an older version (an
//! instance of the previous deploy that restarts) reconciles nothing: it never moves the
//! catalog back.
//!
//! # Writers and rolling deploys
//!
//! Every write reads the catalog key in the same request as the row and its manifest (no
//! extra round trip, no lock: writers of a table never conflict through the catalog), and
//! maintains exactly the catalog's building and ready indexes:
//!
//! - indexes the code declares, with the code's condition;
//! - indexes the code does not declare but that have no condition: from the stored definition.
//!   So an older deploy keeps a plain index that a newer deploy added complete;
//! - an index with a condition the code does not have refuses the write with
//!   [`TitoError::SchemaMismatch`] naming both schema versions: finish the deploy first.
//!
//! Why no row can be missing from a ready index. A writer that read the catalog after the
//! index was registered maintains it. One that read it before either committed before the
//! build's first batch (which waits [`write_grace`] after the registration before it scans
//! anything), and the build's scan sees its row; or it overlaps a batch that indexes its row,
//! and since every batch writes the rows it indexes again, the two write the same key and one
//! of them fails and replays (the writer then sees the index). What the argument cannot cover
//! is a write in a caller's transaction that stays open longer than the grace across the
//! registration and inserts a row the build already passed: [`TitoModel::audit`] finds such
//! a row and [`TitoModel::repair`] indexes it.
//!
//! A unique index that is building enforces itself on new values (a write that gives a
//! row a value another row holds fails with [`TitoError::UniqueViolation`]) but tolerates the
//! duplicates that already exist (a write that keeps a row's value is not refused); the build
//! finds them, stops with [`TitoError::UniqueViolation`] listing the first ids, leaves the
//! index building and changes no row. Fix the rows, then build again.
//!
//! # Queries
//!
//! A query on an index that is not ready fails with [`TitoError::IndexNotReady`] carrying the
//! build's progress. The state is cached per process and read again at most every
//! [`CATALOG_REFRESH`].
//!
//! # Manifests
//!
//! Manifests record the schema version they were written under, so an integrity check can tell
//! a complete manifest of an older schema (its keys of since-added indexes are missing because
//! it is older) from a corrupt one; a row is re-indexed under the current schema on its next
//! write.
//!
//! # Audit and repair
//!
//! [`TitoModel::audit`] scans a table and its ready indexes and reports missing entries,
//! orphaned entries, stale clones (an entry's copy differs from the row), missing or malformed
//! manifests and claims held for the wrong row, with counts and the first keys of each kind.
//! [`TitoModel::repair`] fixes them in bounded batches (a dry run is the audit). Both report
//! progress through a callback and resume from their last batch after a crash.
//!
//! [`TitoModel::build_indexes`]: crate::model::TitoModel::build_indexes
//! [`TitoModel::audit`]: crate::model::TitoModel::audit
//! [`TitoModel::repair`]: crate::model::TitoModel::repair
//! [`TitoError::SchemaMismatch`]: crate::TitoError::SchemaMismatch
//! [`TitoError::UniqueViolation`]: crate::TitoError::UniqueViolation
//! [`TitoError::IndexNotReady`]: crate::TitoError::IndexNotReady

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};

mod audit;
mod build;

pub use audit::{AuditFinding, AuditKind, AuditReport, FIRST_KEYS, Progress, last_audit};

/// How long a process trusts the catalog state it read last before a query reads it again.
pub const CATALOG_REFRESH: Duration = Duration::from_secs(1);

/// Rows one build, drop, audit or repair batch handles at most by default.
pub const DEFAULT_BATCH: usize = 256;

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

static WRITE_GRACE_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFAULT_WRITE_GRACE.as_millis() as u64);

/// How long a build or drop waits after its index's state changed before it scans rows. A write
/// that read the catalog before the change and commits after the build scanned past its row
/// would be missed; the wait outlasts every such write that lives shorter than it (Tito's own
/// write transactions live milliseconds). Writes in a caller's transaction that stays open
/// longer than this across an index registration are what [`TitoModel::audit`] is for.
///
/// [`TitoModel::audit`]: crate::model::TitoModel::audit
pub fn write_grace() -> Duration {
    Duration::from_millis(WRITE_GRACE_MS.load(std::sync::atomic::Ordering::Relaxed))
}

/// Sets [`write_grace`] for this process (catalog changes made afterwards use it). Refused
/// over an hour.
pub fn set_write_grace(grace: Duration) -> TitoResult<()> {
    if grace > Duration::from_secs(3600) {
        return Err(TitoError::invalid_argument(format!(
            "the schema write grace is at most an hour, got {grace:?}"
        )));
    }
    WRITE_GRACE_MS.store(
        grace.as_millis() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
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

    fn latest_fingerprint(&self) -> Option<&str> {
        self.history.last().map(|(_, fp)| fp.as_str())
    }

    fn bump(&mut self, fingerprint: &str) {
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

/// One index as [`TitoModel::schema`](crate::model::TitoModel::schema) reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct IndexStatus {
    /// The index.
    pub name: String,
    /// Its state.
    pub state: IndexState,
    /// Its definition.
    pub definition: IndexDefinition,
    /// The schema version at which it entered its state.
    pub since: u64,
    /// A build's or drop's progress, while one runs.
    pub progress: Option<IndexProgress>,
}

/// A table's schema as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct TableSchema {
    /// The table.
    pub table: String,
    /// The catalog's version (0: no catalog yet).
    pub version: u64,
    /// The indexes, by name.
    pub indexes: Vec<IndexStatus>,
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
    fn config(&self, name: &str) -> TitoResult<TitoIndexConfig> {
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
}

impl CodeSchema {
    pub(crate) fn of<T: TitoModelTrait>() -> TitoResult<CodeSchema> {
        let model = T::default();
        let conditions: HashMap<String, (String, u32)> = model
            .conditions()
            .into_iter()
            .map(|c| (c.index, (c.name, c.version)))
            .collect();
        let mut key_only: HashSet<String> = model.key_only_indexes().into_iter().collect();
        let mut definitions = BTreeMap::new();
        for (config, unique) in crate::model::index_configs(&model)? {
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
        })
    }
}

/// What one write maintains, derived from the catalog it read.
pub(crate) struct WritePlan {
    /// The catalog version (0 without a catalog).
    pub version: u64,
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
        }
    }
}

impl WritePlan {
    /// Whether keys of `index` belong to a live (building or ready) index.
    pub fn is_live(&self, index: &str) -> bool {
        self.indexes.iter().any(|i| i.name == index)
    }
}

/// The per-process knowledge about one (store, table, model type).
pub(crate) struct TableHandle {
    table: String,
    code: CodeSchema,
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

/// What the schema layer keeps per store in this process, on the store's handle
/// ([`TitoEngine::extensions`]): never shared between two stores.
#[derive(Default)]
struct SchemaState {
    /// Each (table, model type)'s handle, reconciled on first use.
    handles: Mutex<HashMap<(String, TypeId), Arc<TableHandle>>>,
    /// The last catalog read of each table, shared by every model type of the table.
    catalogs: Mutex<HashMap<String, SharedCatalog>>,
    /// `(table, model type, builder)` for every table a model handle reconciled, run by queue
    /// maintenance: every model type of a table gets a turn, so a conditional index is built by
    /// the code that declares it.
    builders: Mutex<Vec<(String, TypeId, ErasedBuilder)>>,
}

type SharedCatalog = Arc<Mutex<Option<CachedCatalog>>>;

/// A [`Builder`] of some engine type, behind `Any` so one registry holds every engine's.
type ErasedBuilder = Arc<dyn Any + Send + Sync>;

type Builder<E> =
    Arc<dyn Fn(E) -> futures::future::BoxFuture<'static, TitoResult<Step>> + Send + Sync>;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

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
        if !*lock(&handle.reconciled) {
            let catalog = reconcile(db, handle.clone()).await?;
            handle.remember(catalog.as_ref().map(|(b, c)| (b.clone(), c.clone())));
            *lock(&handle.reconciled) = true;
            register_builder::<E, T>(db, &handle.table);
        }
        Ok(handle)
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

/// Counts a table's rows up to `cap` (keys only matter; bounded scans).
async fn estimate_rows<X: TitoTransaction>(
    tx: &X,
    table: &str,
    cap: u64,
) -> TitoResult<Option<u64>> {
    let prefix = keys::table_prefix(table);
    let end = keys::prefix_end(prefix.clone());
    let mut start = prefix.into_bytes();
    let mut count = 0u64;
    loop {
        let rows = tx
            .scan(&start, end.as_bytes(), crate::engine::MAX_SCAN_LIMIT)
            .await?;
        count += rows.len() as u64;
        if count > cap {
            return Ok(None);
        }
        match rows.last() {
            Some((last, _)) if rows.len() == crate::engine::MAX_SCAN_LIMIT => {
                start = keys::key_after_bytes(last);
            }
            _ => return Ok(Some(count)),
        }
    }
}

/// The largest table a build counts before it starts (larger ones report no estimate).
const ESTIMATE_CAP: u64 = 1_000_000;

/// Reconciles the catalog with the code in one transaction (see the module docs). Returns the
/// catalog as stored afterwards.
async fn reconcile<E: TitoEngine>(
    db: &E,
    handle: Arc<TableHandle>,
) -> TitoResult<Option<(Vec<u8>, Catalog)>> {
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
        // Code the catalog already saw at an older version: an older deploy. Change nothing.
        if catalog.latest_fingerprint() == Some(fingerprint)
            || catalog.version_of(fingerprint).is_some()
        {
            return Ok(stored.map(|bytes| (bytes, catalog)));
        }
        let mut empty: Option<bool> = None;
        let next = catalog.version + 1;
        let not_before = crate::engine::version_millis(tx.start_version())
            .saturating_add(write_grace().as_millis() as u64);
        for (name, definition) in &handle.code.definitions {
            match catalog.indexes.get(name) {
                None => {
                    let is_empty = match empty {
                        Some(known) => known,
                        None => {
                            let prefix = keys::table_prefix(table);
                            let end = keys::prefix_end(prefix.clone());
                            let known = tx
                                .scan(prefix.as_bytes(), end.as_bytes(), 1)
                                .await?
                                .is_empty();
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

/// Reads a table's catalog, without reconciling anything (for tools that have no model type).
pub async fn catalog<E: TitoEngine>(db: &E, table: &str) -> TitoResult<Option<Catalog>> {
    crate::model::read_only(db, async |tx| {
        match tx.get(keys::schema_key(table).as_bytes()).await? {
            Some(bytes) => parse_catalog(table, &bytes).map(Some),
            None => Ok(None),
        }
    })
    .await
}

/// A table's schema with every index's state and progress (for tools that have no model type).
pub async fn table_schema<E: TitoEngine>(db: &E, table: &str) -> TitoResult<TableSchema> {
    crate::model::read_only(db, async |tx| {
        let catalog = match tx.get(keys::schema_key(table).as_bytes()).await? {
            Some(bytes) => parse_catalog(table, &bytes)?,
            None => Catalog::default(),
        };
        let mut indexes = Vec::new();
        for (name, entry) in &catalog.indexes {
            let progress = match entry.state {
                IndexState::Ready => None,
                _ => read_progress(tx, table, name).await?,
            };
            indexes.push(IndexStatus {
                name: name.clone(),
                state: entry.state,
                definition: entry.definition.clone(),
                since: entry.since,
                progress,
            });
        }
        Ok(TableSchema {
            table: table.to_string(),
            version: catalog.version,
            indexes,
        })
    })
    .await
}

/// What one step of background schema work did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Step {
    /// The index worked on, if any work was left.
    pub index: Option<String>,
    /// What kind of work (`build` or `drop`).
    pub work: &'static str,
    /// Rows (or leftover keys) handled by this step.
    pub handled: usize,
    /// Whether the index finished (became ready, or its drop completed) in this step.
    pub finished: bool,
    /// Its progress after the step.
    pub progress: IndexProgress,
    /// Set when the work may not start yet: how long until the [write grace](write_grace)
    /// after the index's change has passed. Nothing was done.
    pub waiting: Option<Duration>,
}

impl Step {
    /// Whether there was no work left.
    pub fn idle(&self) -> bool {
        self.index.is_none()
    }
}

fn register_builder<E: TitoEngine, T: TitoModelTrait>(db: &E, table: &str) {
    let builder: Builder<E> =
        Arc::new(|db: E| Box::pin(async move { db.model::<T>().schema_step(DEFAULT_BATCH).await }));
    let state = db.extensions().get::<SchemaState>();
    let mut entry = lock(&state.builders);
    let kind = TypeId::of::<T>();
    if !entry.iter().any(|(t, k, _)| t == table && *k == kind) {
        entry.push((table.to_string(), kind, Arc::new(builder) as ErasedBuilder));
    }
}

/// Runs one step of schema work (build or drop) for every table a model handle of this process
/// has used on this store; returns how many steps did work. Queue workers call it from their
/// maintenance (the coordinator only, in cluster mode). A failing table is logged and skipped.
pub async fn maintain<E: TitoEngine>(db: &E) -> usize {
    let state = db.extensions().get::<SchemaState>();
    let builders: Vec<(String, Builder<E>)> = lock(&state.builders)
        .iter()
        .filter_map(|(table, _, any)| {
            any.clone()
                .downcast::<Builder<E>>()
                .ok()
                .map(|b| (table.clone(), (*b).clone()))
        })
        .collect();
    let mut worked = 0;
    for (table, builder) in builders {
        match builder(db.clone()).await {
            Ok(step) if !step.idle() && step.waiting.is_none() => worked += 1,
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(table = %table, error = %err, "schema maintenance step failed")
            }
        }
    }
    worked
}
