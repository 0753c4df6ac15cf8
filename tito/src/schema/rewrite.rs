//! Shape rewrites: the rows of a table stored in another shape version than the one its writers
//! may write, written again in that version (with the copies of them in index entries), in
//! bounded batches. Each batch is one transaction that also moves the rewrite's cursor, so a
//! rewrite killed at any point continues after its last committed batch.
//!
//! A batch writes each row it changes as an update without events that keeps the row's
//! timestamps: a writer of the same row that commits meanwhile conflicts with the batch (one of
//! the two replays, and the replayed batch sees the row as written). A row no shape of the code
//! reads, or whose conversion refuses it, is counted and listed, never dropped; a row a write
//! rule refuses in the new shape (a unique value another row holds) is counted and listed too.
//! Neither stops the others.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::build::{read_catalog, scan_rows};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::{TitoModel, TitoModelTrait};

/// How many rows of each kind a rewrite lists (it counts them all).
pub const REWRITE_FIRST: usize = 10;

/// A row a rewrite left as it is, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LeftRow {
    /// The row's id (what [`TitoModel::delete_by_id`](crate::TitoModel::delete_by_id) takes).
    pub id: String,
    /// The row's storage key.
    pub key: String,
    /// Its stored shape version (0: a malformed version header).
    pub version: u32,
    /// Why it was left.
    pub reason: String,
}

/// Rows of one kind a rewrite left: how many, and the first [`REWRITE_FIRST`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LeftRows {
    /// How many.
    pub count: u64,
    /// The first ones.
    pub first: Vec<LeftRow>,
}

impl LeftRows {
    fn add(&mut self, id: &str, key: String, version: u32, reason: String) {
        self.count += 1;
        if self.first.len() < REWRITE_FIRST {
            self.first.push(LeftRow {
                id: id.to_string(),
                key,
                version,
                reason,
            });
        }
    }
}

/// A table's shape rewrite as stored after each batch (`schema-rewrite:{table}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RewriteProgress {
    /// The version rows are rewritten to: the one writers may write when the run started.
    pub target: u32,
    /// The last row handled (the next batch starts after it).
    pub cursor: Option<String>,
    /// Rows read so far.
    pub rows_done: u64,
    /// Rows written in the target version so far.
    pub rewritten: u64,
    /// The table's size when the run started, counted up to a bound.
    pub rows_estimate: Option<u64>,
    /// Rows the code does not read (a version it does not declare, a conversion that refused
    /// them, a malformed header or body): left as they are, readable by no code that ran the
    /// rewrite. Delete them, or deploy code that converts them and rewrite again.
    pub unconvertible: LeftRows,
    /// Rows whose write in the target version a write rule refused (a unique value another
    /// row holds, a downgrade that failed) or that the write found inconsistent (no manifest:
    /// the audit reports it, a repair mends it): left in their version.
    pub refused: LeftRows,
    /// Whether the run read every row.
    pub finished: bool,
    /// Engine time (Unix ms) the run started.
    pub started_ms: u64,
    /// Engine time (Unix ms) the run finished.
    pub finished_ms: Option<u64>,
}

/// What one rewrite batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RewriteStep {
    /// Rows read by this batch (0 and [`finished`](Self::finished) unset: nothing was left).
    pub handled: usize,
    /// Rows written in the target version by this batch.
    pub rewritten: usize,
    /// Whether the run finished in this batch.
    pub finished: bool,
    /// The run's progress after the batch.
    pub progress: RewriteProgress,
    /// Set when the run may not start yet: how long until the [write
    /// grace](crate::schema::write_grace) after the allowed version changed has passed.
    /// Nothing was done.
    pub waiting: Option<Duration>,
}

impl RewriteStep {
    /// Whether there was nothing left to do (the run had finished before this batch).
    pub fn idle(&self) -> bool {
        self.handled == 0 && !self.finished && self.waiting.is_none()
    }
}

/// How a whole rewrite runs ([`TitoModel::rewrite_shapes`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RewriteOptions {
    /// Rows per batch (1 to [`MAX_SCAN_LIMIT`](crate::engine::MAX_SCAN_LIMIT)).
    pub batch: usize,
    /// A pause between two batches, to leave the store to its other writers.
    pub pause: Duration,
}

impl Default for RewriteOptions {
    fn default() -> Self {
        RewriteOptions {
            batch: super::DEFAULT_BATCH,
            pause: Duration::ZERO,
        }
    }
}

impl RewriteOptions {
    /// Rows per batch.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// A pause between batches.
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }
}

/// Reads a table's shape rewrite as its last batch stored it (for tools that have no model
/// type).
pub async fn rewrite_progress<E: TitoEngine>(
    db: &E,
    table: &str,
) -> TitoResult<Option<RewriteProgress>> {
    crate::engine::read_only(db, async |tx| read_progress(tx, table).await).await
}

pub(super) async fn read_progress<X: TitoTransaction>(
    tx: &X,
    table: &str,
) -> TitoResult<Option<RewriteProgress>> {
    let key = keys::schema_rewrite_key(table);
    match tx.get(key.as_bytes()).await? {
        Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|err| {
            TitoError::Integrity(format!("{key:?} is not a rewrite's progress: {err}"))
        }),
        None => Ok(None),
    }
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// Rewrites the table's rows stored in another shape version than the one its writers may
    /// write ([`crate::schema::Shapes::writable`]) in that version, with the copies of them in
    /// index entries, batch after batch until every row was read; calls `progress` after each
    /// batch and returns the run's progress. A run that finished before starts again from the
    /// first row (rows older code wrote since are rewritten too); one that was killed
    /// continues after its last batch.
    ///
    /// The code must write the target version: its own, or one it declares a downgrade to
    /// (the rewrite of a rollback). Queue workers run the same batches in their maintenance,
    /// one per pass, for every versioned model this process used; this call is for running
    /// one on its own (a migration step, a test).
    pub async fn rewrite_shapes(
        &self,
        options: RewriteOptions,
        mut progress: impl FnMut(&RewriteStep),
    ) -> TitoResult<RewriteProgress> {
        check_batch(options.batch)?;
        self.restart_finished_rewrite().await?;
        loop {
            let step = self.rewrite_step(options.batch).await?;
            if let Some(wait) = step.waiting {
                tokio::time::sleep(wait.min(Duration::from_millis(250))).await;
                continue;
            }
            if step.idle() {
                return Ok(step.progress);
            }
            progress(&step);
            if step.finished {
                return Ok(step.progress);
            }
            if !options.pause.is_zero() {
                tokio::time::sleep(options.pause).await;
            }
        }
    }

    /// One batch of at most `batch` rows of the table's shape rewrite: starts a run when none
    /// ran for the version writers may write now, continues an unfinished one, and is idle
    /// when one finished.
    pub async fn rewrite_step(&self, batch: usize) -> TitoResult<RewriteStep> {
        check_batch(batch)?;
        match self.rewrite_batch(batch).await? {
            Some(step) => Ok(step),
            None => {
                let table = T::default().table();
                let writable = super::catalog(self.engine(), &table)
                    .await?
                    .map_or(1, |c| c.shapes.writable());
                Err(TitoError::SchemaMismatch(format!(
                    "table {table:?}: writers write shape version {writable}, and this code \
                     ({}) writes version {} without a downgrade to it: run the rewrite with code \
                     that writes version {writable}",
                    std::any::type_name::<T>(),
                    T::VERSION
                )))
            }
        }
    }

    /// Marks a finished run as to be started again by the next batch.
    async fn restart_finished_rewrite(&self) -> TitoResult<()> {
        let table = T::default().table();
        self.engine()
            .transaction(|tx| {
                let table = table.clone();
                async move {
                    if let Some(progress) = read_progress(&tx, &table).await?
                        && progress.finished
                    {
                        tx.delete(keys::schema_rewrite_key(&table).into_bytes())
                            .await?;
                    }
                    Ok(())
                }
            })
            .await
    }

    /// One batch; `None` when this code cannot write the version writers may write.
    async fn rewrite_batch(&self, batch: usize) -> TitoResult<Option<RewriteStep>> {
        // Reconciled first: the catalog records this code's version and the table as used.
        let handle = self.schema_handle().await?;
        let this = self.clone();
        let step = self
            .engine()
            .transaction_with(self.engine().retry_policy().max_attempts(50), |tx| {
                let this = this.clone();
                async move { this.rewrite_tx(&tx, batch).await }
            })
            .await?;
        if let Some(step) = &step {
            if step.handled > 0 {
                let labels = [("table", handle.table().to_string())];
                metrics::counter!(crate::telemetry::names::SHAPE_REWRITTEN, &labels)
                    .increment(step.rewritten as u64);
            }
            if step.finished {
                let p = &step.progress;
                tracing::info!(
                    table = %handle.table(),
                    version = p.target,
                    rows = p.rows_done,
                    rewritten = p.rewritten,
                    unconvertible = p.unconvertible.count,
                    refused = p.refused.count,
                    "shape rewrite finished"
                );
            }
        }
        Ok(step)
    }

    async fn rewrite_tx(
        &self,
        tx: &E::Transaction,
        batch: usize,
    ) -> TitoResult<Option<RewriteStep>> {
        let table = T::default().table();
        let Some(catalog) = read_catalog(tx, &table).await? else {
            return Ok(Some(RewriteStep::default()));
        };
        // A change of the allowed version (or any catalog change) while the batch runs makes
        // it replay, and the replay reads the new target.
        tx.lock_keys(&[keys::schema_key(&table).into_bytes()])
            .await?;
        let target = catalog.shapes.writable();
        let grace_ms = super::write_grace(self.engine()).as_millis() as u64;
        if T::VERSION < target || (T::VERSION > target && !T::downgrades_to(target)) {
            return Ok(None);
        }
        let now_ms = crate::engine::version_millis(tx.start_version());
        let mut progress = match read_progress(tx, &table).await? {
            Some(p) if p.target == target => p,
            // A new run (the allowed version moved, or none ran): a writer that read the
            // catalog before the change may still commit a row in the version it allowed
            // then, so the run starts once the grace after the change has passed.
            _ if now_ms < catalog.shapes.changed_ms + grace_ms => {
                return Ok(Some(RewriteStep {
                    waiting: Some(Duration::from_millis(
                        catalog.shapes.changed_ms + grace_ms - now_ms,
                    )),
                    ..RewriteStep::default()
                }));
            }
            _ => RewriteProgress {
                target,
                started_ms: now_ms,
                rows_estimate: super::estimate_rows(tx, &table, super::ESTIMATE_CAP).await?,
                ..RewriteProgress::default()
            },
        };
        if progress.finished {
            return Ok(Some(RewriteStep {
                progress,
                ..RewriteStep::default()
            }));
        }
        let rows = scan_rows(tx, &table, progress.cursor.as_deref(), batch).await?;
        let mut rewritten = 0;
        for (id, bytes) in &rows {
            let row_key = keys::row_key(&table, id);
            let Some((version, _)) = crate::model::shape::split(bytes) else {
                progress.unconvertible.add(
                    id,
                    row_key,
                    0,
                    "its version header is malformed".to_string(),
                );
                continue;
            };
            if version == target {
                continue;
            }
            let model: T = match crate::model::decode_model(&row_key, bytes) {
                Ok(model) => model,
                Err(TitoError::RowShape { reason, .. }) => {
                    progress.unconvertible.add(id, row_key, version, reason);
                    continue;
                }
                Err(TitoError::Integrity(reason)) => {
                    progress.unconvertible.add(id, row_key, version, reason);
                    continue;
                }
                Err(err) => return Err(err),
            };
            match self.rewrite_in(tx, model).await {
                Ok(()) => rewritten += 1,
                // Refusals decided before anything of the row was written: the row stays.
                // A row the write path finds inconsistent (no manifest) is left too: one row
                // never stops the others; the audit reports it.
                Err(
                    err @ (TitoError::UniqueViolation { .. }
                    | TitoError::SchemaMismatch(_)
                    | TitoError::InvalidArgument(_)
                    | TitoError::Integrity(_)),
                ) => progress.refused.add(id, row_key, version, err.to_string()),
                Err(err) => return Err(err),
            }
        }
        progress.rows_done += rows.len() as u64;
        progress.rewritten += rewritten as u64;
        if let Some((last, _)) = rows.last() {
            progress.cursor = Some(last.clone());
        }
        let finished = rows.len() < batch;
        if finished {
            progress.finished = true;
            progress.finished_ms = Some(now_ms);
        }
        tx.put(
            keys::schema_rewrite_key(&table).into_bytes(),
            serde_json::to_vec(&progress)?,
        )
        .await?;
        Ok(Some(RewriteStep {
            handled: rows.len(),
            rewritten,
            finished,
            progress,
            waiting: None,
        }))
    }
}

fn check_batch(batch: usize) -> TitoResult<()> {
    if batch == 0 || batch > crate::engine::MAX_SCAN_LIMIT {
        return Err(TitoError::invalid_argument(format!(
            "a rewrite batch must be between 1 and {} rows, got {batch}",
            crate::engine::MAX_SCAN_LIMIT
        )));
    }
    Ok(())
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// One maintenance batch of this model's rewrite: `None` when this code cannot write the
    /// allowed version (an older model of the table may), else whether the batch did work.
    pub(crate) async fn maintenance_rewrite(&self) -> TitoResult<Option<bool>> {
        Ok(self
            .rewrite_batch(super::DEFAULT_BATCH)
            .await?
            .map(|step| !step.idle() && step.waiting.is_none()))
    }
}

/// Runs one rewrite batch per table a versioned model of this process uses on `db`, by the
/// newest model that writes the allowed version; returns how many batches did work. A failing
/// table is logged and skipped.
pub(super) async fn maintain<E: TitoEngine>(db: &E) -> usize {
    let mut worked = 0;
    for (table, steps) in crate::model::rewriters::by_table(db) {
        for step in steps {
            match step(db.clone()).await {
                // This model does not write the allowed version: an older one may.
                Ok(None) => continue,
                Ok(Some(did)) => worked += usize::from(did),
                Err(err) => {
                    tracing::warn!(table = %table, error = %err, "shape rewrite step failed")
                }
            }
            break;
        }
    }
    worked
}
