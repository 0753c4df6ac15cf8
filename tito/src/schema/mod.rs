//! Schema evolution: a stored index catalog per table, online index builds and drops, and an
//! audit with repair.
//!
//! Every table has a catalog under `schema:{table}` (layout in `docs/storage-layout.md`): the indexes
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
//! let db = Embedded::temporary().await?;
//! # tito::schema::set_write_grace(&db, std::time::Duration::from_millis(10))?;
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
//! finds them, stops with [`TitoError::DuplicateValues`] listing the first ids, leaves the
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
//! [`TitoError::DuplicateValues`]: crate::TitoError::DuplicateValues
//! [`TitoError::IndexNotReady`]: crate::TitoError::IndexNotReady

use std::time::Duration;

use serde::Serialize;

use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::TitoResult;
use crate::keys;
pub use crate::model::catalog::{
    CATALOG_REFRESH, Catalog, CatalogIndex, DEFAULT_WRITE_GRACE, IndexDefinition, IndexProgress,
    IndexState, Shapes, set_write_grace, write_grace,
};
use crate::model::catalog::{parse_catalog, read_progress};

mod audit;
mod build;
mod rewrite;
mod shapes;

pub use audit::{AuditFinding, AuditKind, AuditReport, FIRST_KEYS, Progress, last_audit};
pub use rewrite::{
    LeftRow, LeftRows, REWRITE_FIRST, RewriteOptions, RewriteProgress, RewriteStep,
    rewrite_progress,
};
pub use shapes::{
    ShapeCheck, ShapeCounts, ShapeVerdict, allow_shape_version, check_shapes, reads_version,
    shape_versions,
};

/// Rows one build, drop, audit or repair batch handles at most by default.
pub const DEFAULT_BATCH: usize = 256;

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

/// Reads a table's catalog, without reconciling anything (for tools that have no model type).
pub async fn catalog<E: TitoEngine>(db: &E, table: &str) -> TitoResult<Option<Catalog>> {
    crate::engine::read_only(db, async |tx| {
        match tx.get(keys::schema_key(table).as_bytes()).await? {
            Some(bytes) => parse_catalog(table, &bytes).map(Some),
            None => Ok(None),
        }
    })
    .await
}

/// A table's schema with every index's state and progress (for tools that have no model type).
pub async fn table_schema<E: TitoEngine>(db: &E, table: &str) -> TitoResult<TableSchema> {
    crate::engine::read_only(db, async |tx| {
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

/// Runs one step of schema work (build or drop) for every table a model handle of this process
/// has used on this store, or when none is left, one batch of each shape rewrite
/// ([`TitoModel::rewrite_shapes`](crate::model::TitoModel::rewrite_shapes)); returns how many
/// steps did work. Queue workers call it from their
/// maintenance (the coordinator only, in cluster mode). A failing table is logged and skipped.
pub async fn maintain<E: TitoEngine>(db: &E) -> usize {
    let mut worked = 0;
    for handle in crate::model::catalog::used_tables(db) {
        match build::step(db, &handle, DEFAULT_BATCH).await {
            Ok(step) if !step.idle() && step.waiting.is_none() => worked += 1,
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(table = %handle.table(), error = %err, "schema maintenance step failed")
            }
        }
    }
    // Shape rewrites of the versioned models this process uses: one batch per table, once the
    // index work is done.
    if worked == 0 {
        worked += rewrite::maintain(db).await;
    }
    worked
}
