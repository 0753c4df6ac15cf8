//! Index builds and drops: bounded batches, each one transaction that also moves the work's
//! cursor, so a build or drop killed at any point continues after its last committed batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::{
    Catalog, CatalogIndex, DEFAULT_BATCH, IndexProgress, IndexState, Step, TableSchema,
    parse_catalog, read_progress, table_schema,
};
use crate::engine::{RetryPolicy, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::catalog::{PlannedIndex, TableHandle, WritePlan};
use crate::model::{TitoModel, TitoModelTrait, encode_manifest, parse_manifest, planned_entries};

/// How many rows with duplicate values a failed unique build names.
const DUPLICATES_SHOWN: usize = 10;

/// Build batches meet writers of the same rows: replay them more often than a plain write.
fn batch_policy<E: TitoEngine>(db: &E) -> RetryPolicy {
    db.retry_policy().max_attempts(50)
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// The table's stored schema: its catalog version and every index with its state and, while
    /// a build or drop runs, its progress. Reconciles the catalog with this code first (as any
    /// first use does).
    pub async fn schema(&self) -> TitoResult<TableSchema> {
        let handle = TableHandle::of::<E, T>(self.engine()).await?;
        table_schema(self.engine(), handle.table()).await
    }

    /// Runs builds and drops of this table's indexes until none is left, calling `progress`
    /// after every batch, and returns the schema then. A unique build over duplicate values
    /// stops with [`TitoError::DuplicateValues`]: fix the rows, then call
    /// [`Self::restart_build`] and this again.
    ///
    /// Queue workers run the same batches in their maintenance for every model this process
    /// used; this call is for running them on their own (a migration step, a test).
    pub async fn build_indexes(&self, mut progress: impl FnMut(&Step)) -> TitoResult<TableSchema> {
        loop {
            let step = self.schema_step(DEFAULT_BATCH).await?;
            if step.idle() {
                return self.schema().await;
            }
            if let Some(wait) = step.waiting {
                tokio::time::sleep(wait.min(Duration::from_millis(250))).await;
                continue;
            }
            progress(&step);
        }
    }

    /// One batch of at most `batch` rows (1 to [`MAX_SCAN_LIMIT`](crate::engine::MAX_SCAN_LIMIT))
    /// of the table's schema work: the first building index is built further, else the first
    /// dropping one is dropped further. An idle [`Step`] means nothing is left.
    pub async fn schema_step(&self, batch: usize) -> TitoResult<Step> {
        check_batch(batch)?;
        let handle = TableHandle::of::<E, T>(self.engine()).await?;
        step(self.engine(), &handle, batch).await
    }

    /// Starts a build that stopped on duplicate values again, from the first row.
    pub async fn restart_build(&self, index: &str) -> TitoResult<()> {
        let handle = TableHandle::of::<E, T>(self.engine()).await?;
        let table = handle.table().to_string();
        let index = index.to_string();
        self.engine()
            .transaction(|tx| async move {
                let catalog = read_catalog(&tx, &table).await?;
                match catalog.as_ref().and_then(|c| c.indexes.get(&index)) {
                    Some(entry) if entry.state == IndexState::Building => {}
                    _ => {
                        return Err(TitoError::invalid_argument(format!(
                            "index {index:?} of table {table:?} is not building"
                        )));
                    }
                }
                let progress = IndexProgress {
                    rows_estimate: read_progress(&tx, &table, &index)
                        .await?
                        .and_then(|p| p.rows_estimate),
                    ..IndexProgress::default()
                };
                write_progress(&tx, &table, &index, &progress).await
            })
            .await
    }
}

/// One batch of at most `batch` rows of the schema work of `handle`'s table on `db`
/// (reconciling first when the catalog vanished): the first building index is built further,
/// else the first dropping one is dropped further. An idle [`Step`] means nothing is left.
pub(super) async fn step<E: TitoEngine>(
    db: &E,
    handle: &Arc<TableHandle>,
    batch: usize,
) -> TitoResult<Step> {
    check_batch(batch)?;
    handle.clone().ensure_reconciled(db).await?;
    let shared = handle.clone();
    let outcome = db
        .transaction_with(batch_policy(db), |tx| async move {
            step_tx(&tx, &shared, batch).await
        })
        .await?;
    match outcome {
        Outcome::Done(step) => {
            if let Some(index) = &step.index {
                let labels = [
                    ("table", handle.table().to_string()),
                    ("index", index.clone()),
                    ("work", step.work.to_string()),
                ];
                metrics::counter!(crate::telemetry::names::SCHEMA_ROWS, &labels)
                    .increment(step.handled as u64);
                if step.finished {
                    metrics::counter!(crate::telemetry::names::SCHEMA_FINISHED, &labels)
                        .increment(1);
                }
            }
            if step.finished {
                handle.invalidate();
                tracing::info!(table = %handle.table(), index = ?step.index, work = step.work, "schema work finished");
            }
            Ok(step)
        }
        Outcome::Duplicates { index, rows } => Err(TitoError::DuplicateValues {
            table: handle.table().to_string(),
            index,
            rows,
        }),
    }
}

/// Refuses a batch size outside 1 to [`MAX_SCAN_LIMIT`](crate::engine::MAX_SCAN_LIMIT).
fn check_batch(batch: usize) -> TitoResult<()> {
    if batch == 0 || batch > crate::engine::MAX_SCAN_LIMIT {
        return Err(TitoError::invalid_argument(format!(
            "a schema batch must be between 1 and {} rows, got {batch}",
            crate::engine::MAX_SCAN_LIMIT
        )));
    }
    Ok(())
}

async fn step_tx<X: TitoTransaction>(
    tx: &X,
    handle: &TableHandle,
    batch: usize,
) -> TitoResult<Outcome> {
    let table = handle.table();
    let Some(mut catalog) = read_catalog(tx, table).await? else {
        return Ok(Outcome::Done(Step::default()));
    };
    // Work and writers exclude each other through the catalog key: a reconcile or another
    // step that changes it makes this batch replay.
    tx.lock_keys(&[keys::schema_key(table).into_bytes()])
        .await?;
    let mut work = None;
    for (name, entry) in &catalog.indexes {
        // Only code that declares a conditional index can decide which rows it holds.
        let buildable = entry.definition.condition.is_none()
            || handle.code.definitions.get(name) == Some(&entry.definition);
        let candidate = match entry.state {
            IndexState::Building => buildable,
            IndexState::Dropping => work.is_none(),
            _ => false,
        };
        // Ready indexes have no progress to read: no request per ready index per step.
        if !candidate {
            continue;
        }
        let progress = read_progress(tx, table, name).await?.unwrap_or_default();
        match entry.state {
            IndexState::Building if progress.failure.is_none() => {
                work = Some((name.clone(), entry.clone(), progress));
                break;
            }
            IndexState::Dropping => work = Some((name.clone(), entry.clone(), progress)),
            _ => {}
        }
    }
    let Some((name, entry, progress)) = work else {
        return Ok(Outcome::Done(Step::default()));
    };
    let now_ms = crate::engine::version_millis(tx.start_version());
    if now_ms < entry.not_before_ms {
        return Ok(Outcome::Done(Step {
            index: Some(name),
            work: "wait",
            waiting: Some(Duration::from_millis(entry.not_before_ms - now_ms)),
            progress,
            ..Step::default()
        }));
    }
    match entry.state {
        IndexState::Building => {
            build_batch(tx, handle, &mut catalog, &name, &entry, progress, batch).await
        }
        _ => drop_batch(tx, table, &mut catalog, &name, progress, batch)
            .await
            .map(Outcome::Done),
    }
}

#[allow(clippy::too_many_arguments)]
async fn build_batch<X: TitoTransaction>(
    tx: &X,
    handle: &TableHandle,
    catalog: &mut Catalog,
    name: &str,
    entry: &CatalogIndex,
    mut progress: IndexProgress,
    batch: usize,
) -> TitoResult<Outcome> {
    let table = handle.table();
    let plan = WritePlan {
        version: catalog.version,
        // Builds and audits write entries, never rows.
        writable: u32::MAX,
        indexes: vec![PlannedIndex::new(
            name,
            &entry.definition,
            IndexState::Building,
            match handle.code.definitions.get(name) {
                Some(_) => None,
                None => Some(entry.definition.config(name)?),
            },
        )],
    }
    .with_stored_shapes(|_| Some(entry.definition.clone()));
    // A row stored in another shape version is indexed as the code that wrote it indexes it:
    // the definition applied to the row as stored (an index whose condition is code cannot be
    // told for it: this code's condition decides, the values are the row's as stored).
    let (stored_plan, skipped) = plan.for_stored_shape();
    let other_shape = skipped.is_empty().then_some(&stored_plan);
    if progress.rows_done == 0 && progress.rows_estimate.is_none() {
        progress.rows_estimate = super::estimate_rows(tx, table, super::ESTIMATE_CAP).await?;
    }
    let (rows, manifests) =
        scan_rows_with_manifests(tx, table, progress.cursor.as_deref(), batch).await?;

    // First every read and check, then (only without duplicates) every write.
    let mut claimed: HashMap<String, String> = HashMap::new();
    let mut duplicates: Vec<(String, String)> = Vec::new();
    let mut writes: Vec<Write> = Vec::new();
    for ((id, bytes), manifest) in rows.iter().zip(&manifests) {
        let row_key = keys::row_key(table, id);
        // A row no shape of the code reads is left out (it cannot be indexed by values it
        // cannot read): the build goes on with the others, the audit reports it.
        let row: Value = match (handle.code.row_value)(&row_key, bytes) {
            Ok(row) => row,
            Err(TitoError::RowShape { .. }) => continue,
            Err(err) => return Err(err),
        };
        let stored_version = crate::model::shape::split(bytes).map(|(v, _)| v);
        let other_version = stored_version != Some(handle.code.shape_version);
        let (row_plan, row, code) = match other_shape {
            Some(stored_plan) if other_version => {
                let (_, stored) = crate::model::shape::stored_value(&row_key, bytes)?;
                (stored_plan, stored, Vec::new())
            }
            // An index whose condition is code: the row is in it when this code's condition
            // says so, under the values as stored (as a write through a downgrade indexes it).
            None if other_version => {
                let (_, stored) = crate::model::shape::stored_value(&row_key, bytes)?;
                (&plan, stored, (handle.code.row_configs)(&row_key, bytes)?)
            }
            _ => {
                let code = match plan.indexes[0].stored {
                    Some(_) => Vec::new(),
                    None => (handle.code.row_configs)(&row_key, bytes)?,
                };
                (&plan, row, code)
            }
        };
        let (_, mut listed) = match manifest {
            Some(m) => parse_manifest(&keys::manifest_key(table, id), m)?,
            None => (0, Vec::new()),
        };
        let mut added = Vec::new();
        for (entry, _) in planned_entries(row_plan, &code, &row, table, id)? {
            if let Some(claim) = &entry.claim {
                let owner = match claimed.get(claim) {
                    Some(owner) => Some(owner.clone()),
                    None => tx
                        .get(claim.as_bytes())
                        .await?
                        .map(|o| String::from_utf8_lossy(&o).into_owned()),
                };
                match owner {
                    Some(owner) if owner != *id => {
                        if duplicates.len() < DUPLICATES_SHOWN {
                            duplicates.push((owner, id.clone()));
                        }
                        continue;
                    }
                    _ => {
                        claimed.insert(claim.clone(), id.clone());
                    }
                }
                if !listed.contains(claim) {
                    added.push(claim.clone());
                }
            }
            if !listed.contains(&entry.key) {
                added.push(entry.key.clone());
            }
            // Rewritten even when listed: a copy must be the row as it is now.
            writes.push(Write::Entry(entry.key.clone(), entry.value(bytes)));
        }
        // The manifest now lists every index of this schema version: it is written under it.
        listed.extend(added);
        writes.push(Write::Manifest(keys::manifest_key(table, id), listed));
    }
    if !duplicates.is_empty() {
        // Nothing of this batch is written; the build stops where it is, unready.
        let list: Vec<String> = duplicates
            .iter()
            .map(|(a, b)| format!("{a} and {b}"))
            .collect();
        progress.failure = Some(format!(
            "rows hold the same values of unique index {name:?}: {}",
            list.join(", ")
        ));
        write_progress(tx, table, name, &progress).await?;
        return Ok(Outcome::Duplicates {
            index: name.to_string(),
            rows: duplicates,
        });
    }
    // Each indexed row is written again (unchanged): a write of the row that committed
    // after this batch's snapshot, from a writer that did not see the index, conflicts with
    // this batch or this batch with it, on every engine.
    for (id, bytes) in &rows {
        tx.put(keys::row_key(table, id).into_bytes(), bytes.clone())
            .await?;
    }
    for (claim, id) in &claimed {
        tx.put(claim.clone().into_bytes(), id.clone().into_bytes())
            .await?;
    }
    for write in writes {
        match write {
            Write::Entry(key, value) => tx.put(key.into_bytes(), value).await?,
            Write::Manifest(key, listed) => {
                tx.put(key.into_bytes(), encode_manifest(catalog.version, &listed)?)
                    .await?
            }
        }
    }
    progress.rows_done += rows.len() as u64;
    if let Some((last, _)) = rows.last() {
        progress.cursor = Some(last.clone());
    }
    let finished = rows.len() < batch;
    if finished {
        let next = catalog.version + 1;
        if let Some(entry) = catalog.indexes.get_mut(name) {
            entry.state = IndexState::Ready;
            entry.since = next;
        }
        bump_and_store(tx, table, catalog).await?;
        progress.rows_finished = true;
        // Progress is kept while work runs; a ready index has none.
        tx.delete(keys::schema_progress_key(table, name).into_bytes())
            .await?;
    } else {
        write_progress(tx, table, name, &progress).await?;
    }
    Ok(Outcome::Done(Step {
        index: Some(name.to_string()),
        work: "build",
        handled: rows.len(),
        finished,
        progress,
        waiting: None,
    }))
}

/// A write a build batch makes once it found no duplicates.
enum Write {
    Entry(String, Vec<u8>),
    Manifest(String, Vec<String>),
}

/// What a step's transaction decided.
enum Outcome {
    Done(Step),
    Duplicates {
        index: String,
        rows: Vec<(String, String)>,
    },
}

pub(super) async fn read_catalog<X: TitoTransaction>(
    tx: &X,
    table: &str,
) -> TitoResult<Option<Catalog>> {
    match tx.get(keys::schema_key(table).as_bytes()).await? {
        Some(bytes) => parse_catalog(table, &bytes).map(Some),
        None => Ok(None),
    }
}

pub(super) async fn write_progress<X: TitoTransaction>(
    tx: &X,
    table: &str,
    index: &str,
    progress: &IndexProgress,
) -> TitoResult<()> {
    tx.put(
        keys::schema_progress_key(table, index).into_bytes(),
        serde_json::to_vec(progress)?,
    )
    .await
}

/// Stores a changed catalog under a new version (the code fingerprint stays the latest one).
async fn bump_and_store<X: TitoTransaction>(
    tx: &X,
    table: &str,
    catalog: &mut Catalog,
) -> TitoResult<()> {
    let latest = catalog.latest_fingerprint().unwrap_or_default().to_string();
    catalog.bump(&latest);
    tx.put(
        keys::schema_key(table).into_bytes(),
        serde_json::to_vec(catalog)?,
    )
    .await
}

/// Up to `limit` rows of `table` after the row `after` (from the first without one), as
/// `(id, bytes)`. A key under the table prefix that is not a row key is an integrity error.
pub(super) async fn scan_rows<X: TitoTransaction>(
    tx: &X,
    table: &str,
    after: Option<&str>,
    limit: usize,
) -> TitoResult<Vec<(String, Vec<u8>)>> {
    let prefix = keys::table_prefix(table);
    let start = match after {
        Some(id) => keys::key_after(keys::row_key(table, id)),
        None => prefix.clone(),
    };
    let end = keys::prefix_end(prefix);
    let rows = tx.scan(start.as_bytes(), end.as_bytes(), limit).await?;
    rows.into_iter()
        .map(|(key, value)| {
            let text = keys::key_str(&key)?;
            let id = keys::row_key_id(text, table).ok_or_else(|| {
                TitoError::Integrity(format!("{text:?} is not a row key of table {table:?}"))
            })?;
            Ok((id, value))
        })
        .collect()
}

/// [`scan_rows`], and the manifest of each row (read in one request), aligned with the rows.
pub(super) async fn scan_rows_with_manifests<X: TitoTransaction>(
    tx: &X,
    table: &str,
    after: Option<&str>,
    limit: usize,
) -> TitoResult<RowsAndManifests> {
    let rows = scan_rows(tx, table, after, limit).await?;
    let manifest_keys: Vec<Vec<u8>> = rows
        .iter()
        .map(|(id, _)| keys::manifest_key(table, id).into_bytes())
        .collect();
    let manifests = tx.batch_get(&manifest_keys).await?;
    Ok((rows, manifests))
}

/// Rows as `(id, bytes)` and their manifests.
pub(super) type RowsAndManifests = (Vec<(String, Vec<u8>)>, Vec<Option<Vec<u8>>>);

/// One batch of a drop: first the rows (their manifests stop naming the index, its entries and
/// claims go), then whatever is left under the index's prefixes; then the index leaves the
/// catalog and its name is free.
async fn drop_batch<X: TitoTransaction>(
    tx: &X,
    table: &str,
    catalog: &mut Catalog,
    name: &str,
    mut progress: IndexProgress,
    batch: usize,
) -> TitoResult<Step> {
    let mut handled = 0;
    if !progress.rows_finished {
        let (rows, manifests) =
            scan_rows_with_manifests(tx, table, progress.cursor.as_deref(), batch).await?;
        for ((id, _), manifest) in rows.iter().zip(&manifests) {
            let Some(manifest) = manifest else { continue };
            let key = keys::manifest_key(table, id);
            let (version, listed) = parse_manifest(&key, manifest)?;
            let (gone, kept): (Vec<String>, Vec<String>) = listed
                .into_iter()
                .partition(|k| keys::index_name_of(k, table).as_deref() == Some(name));
            if gone.is_empty() {
                continue;
            }
            for key in gone {
                if keys::is_claim_key_of(&key, table)
                    && tx.get(key.as_bytes()).await?.as_deref() != Some(id.as_bytes())
                {
                    continue;
                }
                tx.delete(key.into_bytes()).await?;
            }
            tx.put(key.into_bytes(), encode_manifest(version, &kept)?)
                .await?;
        }
        handled = rows.len();
        progress.rows_done += rows.len() as u64;
        if let Some((last, _)) = rows.last() {
            progress.cursor = Some(last.clone());
        }
        progress.rows_finished = rows.len() < batch;
        write_progress(tx, table, name, &progress).await?;
        return Ok(Step {
            index: Some(name.to_string()),
            work: "drop",
            handled,
            finished: false,
            progress,
            waiting: None,
        });
    }
    // Leftovers that no manifest named (orphans), by prefix.
    let mut left = batch;
    let index_prefix = keys::index_prefix(table, name, &[])?;
    for prefix in [index_prefix, keys::unique_prefix(table, name)] {
        let end = keys::prefix_end(prefix.clone());
        let keys_left = tx.scan(prefix.as_bytes(), end.as_bytes(), left).await?;
        for (key, _) in &keys_left {
            tx.delete(key.clone()).await?;
        }
        handled += keys_left.len();
        left -= keys_left.len();
        if left == 0 {
            break;
        }
    }
    let finished = left > 0;
    if finished {
        catalog.indexes.remove(name);
        bump_and_store(tx, table, catalog).await?;
        tx.delete(keys::schema_progress_key(table, name).into_bytes())
            .await?;
    } else {
        write_progress(tx, table, name, &progress).await?;
    }
    Ok(Step {
        index: Some(name.to_string()),
        work: "drop",
        handled,
        finished,
        progress,
        waiting: None,
    })
}
