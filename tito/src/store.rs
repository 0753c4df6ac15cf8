//! Moving a store: [`copy`] every key of one store into another, on any two engines (the
//! embedded store, SQLite, TiKV, memory), and [`verify`] that two stores hold the same keys.
//!
//! A copy is a sequence of passes. A pass reads the source in one snapshot (one read-only
//! transaction), range after range of at most [`CopyOptions::batch`] keys, compares each range
//! with the destination's and writes the difference (new and changed keys, and deletes of keys
//! the source no longer has) in one destination transaction per range, with the pass's cursor.
//! So:
//! - **Resumable.** The cursor lives in the destination (key `store-copy`), written with the
//!   range it ends. A copy killed at any moment continues, with [`Existing::Resume`], from the
//!   range after the last one committed; it reads the rest in a new snapshot, then the ranges
//!   before the cursor again in that same snapshot, so the finished pass is one consistent
//!   snapshot of the source whatever happened before.
//! - **Catching up.** Another pass over a destination that holds an earlier copy (again with
//!   [`Existing::Resume`]) writes only what changed since: every pass leaves the destination
//!   equal to the source as of the pass's snapshot (when nothing else writes the destination).
//! - **Bounded.** Memory holds two ranges (the source's and the destination's), whatever the
//!   store's size; a range stops early at [`CopyOptions::batch_bytes`].
//! - **Clocks.** Rows hold times and versions of the source's clock (due times, leases, kv
//!   versions, commit markers). A copy finishes only when the destination's clock is past the
//!   source's snapshot, waiting up to [`CopyOptions::clock_wait`] for it (a local store may be
//!   up to three seconds ahead of the wall clock after a crash, see
//!   [`crate::backend::embedded`]), and fails naming the gap otherwise.
//!
//! What a copy leaves out by default: what only says who runs what now ([`is_holder_key`]:
//! queue partition leases and their expiries, workers' heartbeats and reports, cluster
//! memberships and the coordinator, concurrency slots, inbox claims' leases). The processes
//! that held them are stopped before the last pass, so the destination's workers take over at
//! once instead of waiting for leases to expire; the destination's own such keys are left as
//! they are. [`CopyOptions::holders`] copies them too. Copy a store while its application is
//! stopped, or run passes while it writes and stop it for the last one: a write committed to
//! the source after the last pass's snapshot is not in the destination. [`verify`] after the
//! last pass proves the destination equal (holder keys left out the same way).
//!
//! ```
//! use tito::backend::memory::Memory;
//! use tito::store::{CopyOptions, VerifyOptions, copy, verify};
//! use tito::{TitoEngine, TitoError, TitoTransaction};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), TitoError> {
//! let (from, to) = (Memory::new(), Memory::new());
//! from.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
//!     .await?;
//! let report = copy(&from, &to, CopyOptions::new(), |_| {}).await?;
//! assert_eq!(report.progress.keys_written, 1);
//! assert!(verify(&from, &to, VerifyOptions::new(), |_| {}).await?.equal());
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::gate::{Gate, MOVED_CHECK_INTERVAL, MOVED_COMMIT_DEADLINE, Tracked};
use crate::engine::{
    KvPair, MAX_SCAN_LIMIT, MOVED_KEY, Moved, TitoEngine, TitoTransaction, version_millis,
};
use crate::error::{TitoError, TitoResult};
use crate::keys::{display_key, key_after_bytes};

/// The destination key that holds an unfinished copy's progress (a copy's cursor). It is not
/// copied, compared or counted as data.
pub const COPY_RECORD_KEY: &[u8] = b"store-copy";

/// Whether a key only says who runs what now, and is left out of copies and verifications by
/// default: a queue's partition leases and their expiries, its workers' heartbeats and reports,
/// its cluster memberships and coordinator, its concurrency slots, its workers' nudge addresses
/// (`{queue}:lease:`, `:lease-expiry:`, `:lease-fence:`, `:worker:`, `:report:`, `:node:`, `:coordinator`,
/// `:members`, `:running:`, `:nudge:`),
/// and inbox claims' leases (`inbox-lease:`). See `docs/storage-layout.md`.
pub fn is_holder_key(key: &[u8]) -> bool {
    let Ok(key) = std::str::from_utf8(key) else {
        return false;
    };
    if key.starts_with("inbox-lease:") {
        return true;
    }
    // `queue:` (the queue without a topic) or `queue@{topic}:` (the topic ends at its first
    // `:`, which an encoded topic never holds).
    let rest = match (key.strip_prefix("queue:"), key.strip_prefix("queue@")) {
        (Some(rest), _) => rest,
        (None, Some(named)) => match named.split_once(':') {
            Some((_, rest)) => rest,
            None => return false,
        },
        (None, None) => return false,
    };
    matches!(
        rest.split(':').next(),
        Some(
            "lease"
                | "lease-expiry"
                | "lease-fence"
                | "worker"
                | "report"
                | "node"
                | "coordinator"
                | "members"
                | "running"
                | "nudge"
        )
    )
}

/// Whether a copy or a verification leaves `key` out: the copy record, a moved store's marker,
/// and (unless `holders`) the holder keys.
fn skipped(key: &[u8], holders: bool) -> bool {
    key == COPY_RECORD_KEY || key == MOVED_KEY || (!holders && is_holder_key(key))
}

/// The most keys a copy or a verification reads per range.
pub const MAX_BATCH: usize = MAX_SCAN_LIMIT;

/// What [`copy`] does with a destination that holds keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Existing {
    /// Refuse it (the default): a copy starts only into an empty store.
    #[default]
    Refuse,
    /// Continue an interrupted copy from its cursor, or bring an earlier copy up to date (a
    /// catch-up pass); a destination with keys but no copy record is compared from its first
    /// key. The destination ends equal to the source either way.
    Resume,
    /// Make the destination equal to the source from its first key, deleting every key the
    /// source does not have (an interrupted copy's cursor is ignored).
    Overwrite,
}

/// Options of [`copy`].
#[derive(Clone, Debug)]
pub struct CopyOptions {
    batch: usize,
    batch_bytes: usize,
    existing: Existing,
    keys_per_second: Option<u64>,
    clock_wait: Duration,
    count_first: bool,
    holders: bool,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            batch: 1000,
            batch_bytes: 4 << 20,
            existing: Existing::Refuse,
            keys_per_second: None,
            clock_wait: Duration::from_secs(10),
            count_first: false,
            holders: false,
        }
    }
}

impl CopyOptions {
    /// Ranges of 1,000 keys or 4 MiB, an empty destination, no throttle, up to 10 s for the
    /// destination's clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys per range (1 to [`MAX_BATCH`]): one destination transaction each.
    pub fn batch(mut self, keys: usize) -> Self {
        self.batch = keys;
        self
    }

    /// Bytes of keys and values per range (at least 1): a range ends at the first key that
    /// reaches it (a range holds at least one key).
    pub fn batch_bytes(mut self, bytes: usize) -> Self {
        self.batch_bytes = bytes;
        self
    }

    /// What to do with a destination that holds keys.
    pub fn existing(mut self, existing: Existing) -> Self {
        self.existing = existing;
        self
    }

    /// Reads at most this many source keys per second on average (at least 1), to spare a
    /// store that serves an application.
    pub fn keys_per_second(mut self, rate: u64) -> Self {
        self.keys_per_second = Some(rate);
        self
    }

    /// How long a finished copy waits for the destination's clock to pass the source's.
    pub fn clock_wait(mut self, wait: Duration) -> Self {
        self.clock_wait = wait;
        self
    }

    /// Counts the source's keys (one more read of them) before copying, so progress has a
    /// total and an estimate of the time left.
    pub fn count_first(mut self, count: bool) -> Self {
        self.count_first = count;
        self
    }

    /// Copies the keys that say who runs what now ([`is_holder_key`]) too: leases are then
    /// taken over in the destination only when they expire.
    pub fn holders(mut self, copy: bool) -> Self {
        self.holders = copy;
        self
    }

    fn check(&self) -> TitoResult<()> {
        check_batch(self.batch)?;
        if self.batch_bytes == 0 {
            return Err(TitoError::invalid_argument(
                "a copy's batch_bytes must be at least 1",
            ));
        }
        if self.keys_per_second == Some(0) {
            return Err(TitoError::invalid_argument(
                "a copy's keys_per_second must be at least 1 (leave it unset for no throttle)",
            ));
        }
        Ok(())
    }
}

fn check_batch(batch: usize) -> TitoResult<()> {
    if batch == 0 || batch > MAX_BATCH {
        return Err(TitoError::invalid_argument(format!(
            "a batch must be between 1 and {MAX_BATCH} keys, got {batch}"
        )));
    }
    Ok(())
}

/// Where a copy is, after each range it committed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyProgress {
    /// Passes started by this call (1 for a copy into an empty store).
    pub pass: u32,
    /// Source keys read by this call.
    pub keys_read: u64,
    /// Keys written to the destination (new or changed) by this call.
    pub keys_written: u64,
    /// Keys deleted from the destination (the source does not have them) by this call.
    pub keys_deleted: u64,
    /// Bytes of keys and values written by this call.
    pub bytes_written: u64,
    /// The source's keys, when counted first ([`CopyOptions::count_first`]).
    pub total_keys: Option<u64>,
    /// Whether this call started from an interrupted copy's cursor.
    pub resumed: bool,
    /// The last key of the last range committed (shown as text).
    pub cursor: Option<String>,
}

/// What a finished [`copy`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyReport {
    /// The counts of the whole call.
    #[serde(flatten)]
    pub progress: CopyProgress,
    /// The source's snapshot version the destination now equals.
    pub snapshot_version: u64,
    /// How long the destination's clock took to pass the source's, in milliseconds.
    pub clock_waited_ms: u64,
    /// How long the call took, in milliseconds.
    pub elapsed_ms: u64,
}

/// An interrupted copy's progress, kept in the destination.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct CopyRecord {
    /// Ranges up to and including this key are copied in the current pass.
    cursor: Vec<u8>,
    /// The snapshot the pass started with (for the message of a refused destination).
    snapshot_version: u64,
}

/// Copies every key of `from` into `to`, in passes of ranges (see the module docs), calling
/// `progress` after each range. Refuses a destination that holds keys unless
/// [`CopyOptions::existing`] says otherwise, and fails when the destination's clock does not
/// pass the source's in [`CopyOptions::clock_wait`].
pub async fn copy<S: TitoEngine, D: TitoEngine>(
    from: &S,
    to: &D,
    options: CopyOptions,
    progress: impl FnMut(&CopyProgress),
) -> TitoResult<CopyReport> {
    copy_pass(from, to, options, false, progress).await
}

/// One pass of [`copy`]. At its end the copy record goes, or with `keep_record` (a pass of a
/// [`migrate`] that has not finished) it stays, its cursor before the first key: a move called
/// again after a later pass failed resumes (compares the destination whole) instead of
/// refusing it as a store that holds data.
async fn copy_pass<S: TitoEngine, D: TitoEngine>(
    from: &S,
    to: &D,
    options: CopyOptions,
    keep_record: bool,
    mut progress: impl FnMut(&CopyProgress),
) -> TitoResult<CopyReport> {
    options.check()?;
    let started = Instant::now();
    // An overwrite ignores an interrupted copy's cursor, so it reads none (a damaged record
    // is overwritten like every other key).
    let record = match options.existing {
        Existing::Overwrite => None,
        Existing::Refuse | Existing::Resume => read_record(to).await?,
    };
    let mut state = CopyProgress::default();
    // Where this pass starts: an interrupted copy's cursor, or the first key.
    let start = match (options.existing, &record) {
        (Existing::Refuse, Some(record)) => {
            return Err(TitoError::invalid_argument(format!(
                "the destination holds an interrupted copy (its last range ends at {}, of the \
                 source's snapshot at {} ms): resume it, or overwrite the destination",
                display_key(&record.cursor),
                version_millis(record.snapshot_version)
            )));
        }
        (Existing::Refuse, None) => {
            if let Some(first) = first_data_key(to).await? {
                return Err(TitoError::invalid_argument(format!(
                    "the destination holds data (its first key is {}): copy into an empty \
                     store, resume an earlier copy into it, or overwrite it",
                    display_key(&first)
                )));
            }
            None
        }
        (Existing::Resume, Some(record)) => {
            state.resumed = true;
            Some(key_after_bytes(&record.cursor))
        }
        (Existing::Resume | Existing::Overwrite, _) => None,
    };
    if options.count_first {
        state.total_keys = Some(count_keys(from, options.holders).await?);
    }
    let throttle = Throttle::new(options.keys_per_second);
    state.pass = 1;
    let source = from.begin().await?;
    let snapshot = source.start_version();
    // From the cursor to the end, then from the first key to the cursor, in one snapshot: the
    // pass is consistent although its first part ran in another.
    let spans = match start {
        Some(cursor) => vec![(cursor.clone(), Vec::new()), (Vec::new(), cursor)],
        None => vec![(Vec::new(), Vec::new())],
    };
    let result = async {
        for (start, end) in &spans {
            let span = (start.as_slice(), end.as_slice());
            copy_range(
                &source,
                to,
                &options,
                span,
                &throttle,
                &mut state,
                &mut progress,
            )
            .await?;
        }
        Ok::<_, TitoError>(())
    }
    .await;
    let _ = source.rollback().await;
    result?;
    let clock_waited = wait_for_clock(to, snapshot, options.clock_wait).await?;
    // The pass is whole: the record goes (a later copy is a catch-up pass, or refused), or
    // says so for a move that goes on.
    let whole = serde_json::to_vec(&CopyRecord {
        cursor: Vec::new(),
        snapshot_version: snapshot,
    })?;
    to.transaction(|tx| {
        let whole = whole.clone();
        async move {
            if keep_record {
                tx.put(COPY_RECORD_KEY.to_vec(), whole).await
            } else {
                tx.delete(COPY_RECORD_KEY.to_vec()).await
            }
        }
    })
    .await?;
    Ok(CopyReport {
        progress: state,
        snapshot_version: snapshot,
        clock_waited_ms: crate::util::millis(clock_waited),
        elapsed_ms: crate::util::millis(started.elapsed()),
    })
}

/// Backs up a running store into a new embedded store at `dir` (which must not hold a store):
/// one [`copy`] pass, so the backup is the store as of one snapshot, every commit acknowledged
/// before the call began included, whatever commits meanwhile; then closes the backup. For
/// stores an application holds open (the embedded and SQLite stores have one owner): call it
/// from that process. To restore, open the backup's directory (or [`copy`] it into a fresh
/// store of another engine). Returns the copy's report.
pub async fn backup<S: TitoEngine>(
    from: &S,
    dir: impl AsRef<std::path::Path>,
    options: CopyOptions,
    progress: impl FnMut(&CopyProgress),
) -> TitoResult<CopyReport> {
    let dir = dir.as_ref();
    if crate::backend::embedded::Embedded::is_store(dir) {
        return Err(TitoError::invalid_argument(format!(
            "{} already holds a store: back up into a new directory",
            dir.display()
        )));
    }
    let to = crate::backend::embedded::Embedded::open(dir).await?;
    let report = copy(from, &to, options.existing(Existing::Refuse), progress).await;
    let closed = to.close().await;
    let report = report?;
    closed?;
    Ok(report)
}

/// Options of [`migrate`].
#[derive(Clone, Debug)]
pub struct MigrateOptions {
    to: String,
    copy: CopyOptions,
    settle_keys: u64,
    max_passes: u32,
}

impl MigrateOptions {
    /// A move to the store named `to` (the name the source's refusals show, for example
    /// `tikv:pd1:2379`): the copy's defaults, catch-up passes until one changes fewer than
    /// 1,000 keys, at most 10 passes before the switch.
    pub fn new(to: impl Into<String>) -> Self {
        MigrateOptions {
            to: to.into(),
            copy: CopyOptions::new(),
            settle_keys: 1000,
            max_passes: 10,
        }
    }

    /// The options of every pass (batch, throttle, holders, what to do with a destination
    /// that holds data on the first pass).
    pub fn copy(mut self, copy: CopyOptions) -> Self {
        self.copy = copy;
        self
    }

    /// Switch once a catch-up pass changed fewer keys than this (at least 1): the switch's
    /// last pass then copies about as many.
    pub fn settle_keys(mut self, keys: u64) -> Self {
        self.settle_keys = keys;
        self
    }

    /// Switch after this many passes (1 to 100) even if writes kept up with the copy.
    pub fn max_passes(mut self, passes: u32) -> Self {
        self.max_passes = passes;
        self
    }

    fn check(&self) -> TitoResult<()> {
        self.copy.check()?;
        if self.to.trim().is_empty() {
            return Err(TitoError::invalid_argument(
                "a move needs the new store's name (the source's refusals show it)",
            ));
        }
        if self.to.len() > 1024 {
            return Err(TitoError::invalid_argument(
                "the new store's name is over 1,024 bytes",
            ));
        }
        if self.to.chars().any(char::is_control) {
            return Err(TitoError::invalid_argument(format!(
                "the new store's name {:?} holds a control character (a line break, a tab): \
                 every refusal of the source shows it, on one line",
                self.to
            )));
        }
        if self.settle_keys == 0 {
            return Err(TitoError::invalid_argument(
                "a move's settle_keys must be at least 1",
            ));
        }
        if !(1..=100).contains(&self.max_passes) {
            return Err(TitoError::invalid_argument(format!(
                "a move's max_passes must be from 1 to 100, got {}",
                self.max_passes
            )));
        }
        Ok(())
    }
}

/// What a finished [`migrate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateReport {
    /// The counts of every pass together (`pass`: how many ran, the last one included).
    #[serde(flatten)]
    pub progress: CopyProgress,
    /// Keys the last pass (during the switch) wrote or deleted.
    pub last_pass_keys: u64,
    /// Whether catch-up passes copied only the keys written since the pass before (a store
    /// with one owner), rather than comparing every key.
    pub tracked: bool,
    /// How long the source refused writes before the destination held everything: from the
    /// switch's start to the end of the last pass, in milliseconds.
    pub downtime_ms: u64,
    /// The source's snapshot version the destination now equals.
    pub snapshot_version: u64,
    /// How long the call took, in milliseconds.
    pub elapsed_ms: u64,
}

/// Moves a store that an application keeps writing: copies it into `to` ([`copy`]), runs
/// catch-up passes while writes go on, then switches: the source refuses writes through Tito
/// from then on ([`TitoError::StoreMoved`], naming [`MigrateOptions::new`]'s store), and a last
/// pass copies what the writers committed before. Returns when `to` holds every write the
/// source acknowledged; point the application at `to` then.
///
/// - On a store with one owner (embedded, SQLite, memory), call it in the process that holds
///   the store. Every commit passes the store's write gate, which records the keys written
///   while the move runs: catch-up passes and the last one copy only those keys, so the switch
///   refuses writes for about as long as it takes to copy the keys written during the pass
///   before it.
/// - On TiKV (other processes write too) each pass compares every key, and the switch waits
///   for every process to see the marker: [`MOVED_CHECK_INTERVAL`] plus
///   [`MOVED_COMMIT_DEADLINE`] (11 s) before its last pass.
///
/// Reads keep working on the source. A call that fails during the switch leaves the source
/// refusing writes: call it again (it runs a last full pass and finishes), or [`reopen`] the
/// source to abandon the move.
pub async fn migrate<S: TitoEngine, D: TitoEngine>(
    from: &S,
    to: &D,
    options: MigrateOptions,
    mut progress: impl FnMut(&CopyProgress),
) -> TitoResult<MigrateReport> {
    options.check()?;
    let started = Instant::now();
    let gate = from.extensions().get::<Gate>();
    let local = gate.is_local();
    let resume = options.copy.clone().existing(Existing::Resume);
    let mut totals = CopyProgress::default();
    let mut run_pass = async |tracked: Option<Tracked>,
                              first: bool,
                              totals: &mut CopyProgress|
           -> TitoResult<(u64, u64)> {
        let this = totals.pass + 1;
        let mut report_progress = |p: &CopyProgress| {
            let mut shown = p.clone();
            shown.pass = this;
            progress(&shown);
        };
        // Shown once as the pass starts, so a pass with nothing to copy is seen too.
        report_progress(&CopyProgress::default());
        let report = match tracked {
            Some(Tracked::Keys(keys)) => {
                copy_keys(from, to, keys, &options.copy, &mut report_progress).await?
            }
            _ => {
                let options = if first {
                    options.copy.clone()
                } else {
                    resume.clone()
                };
                // Until the move finishes, its record stays in the destination (a pass of
                // tracked keys leaves it as it is).
                copy_pass(from, to, options, true, &mut report_progress).await?
            }
        };
        let p = &report.progress;
        totals.pass = this;
        totals.keys_read += p.keys_read;
        totals.keys_written += p.keys_written;
        totals.keys_deleted += p.keys_deleted;
        totals.bytes_written += p.bytes_written;
        totals.total_keys = totals.total_keys.or(p.total_keys);
        // Later passes resume the move's own record: only the first says an earlier call's.
        totals.resumed |= p.resumed && this == 1;
        totals.cursor = p.cursor.clone();
        Ok((p.keys_written + p.keys_deleted, report.snapshot_version))
    };
    let marked = read_moved(from).await?;
    if let Some(moved) = &marked
        && moved.to != options.to
    {
        return Err(TitoError::invalid_argument(format!(
            "this store already moved to {} (at {} ms): finish that move, or reopen the \
             store for writes before moving it elsewhere",
            moved.to, moved.at_ms
        )));
    }
    if let Some(moved) = &marked
        && let Some(finished_ms) = moved.finished_ms
    {
        return Err(TitoError::invalid_argument(format!(
            "this store's move to {} finished (at {finished_ms} ms): the new store took over \
             and may hold writes of its own, so nothing is copied again. To move this store \
             again, reopen it for writes first (tito::store::reopen)",
            moved.to
        )));
    }
    if marked.is_none() {
        if local {
            gate.flip(|state| state.take_tracked()).await;
        }
        // A first pass that stopped before (an error, a killed mover) left its cursor in the
        // destination: this one resumes it.
        let resume_first =
            options.copy.existing == Existing::Refuse && read_record(to).await?.is_some();
        let result = async {
            let (mut changed, _) = run_pass(None, !resume_first, &mut totals).await?;
            while totals.pass < options.max_passes {
                if local {
                    // What the next pass would copy: the keys written since the last one.
                    match gate.tracked_keys() {
                        Some(keys) if keys < options.settle_keys => break,
                        _ => {}
                    }
                    let tracked = gate.flip(|state| state.take_tracked()).await;
                    run_pass(Some(tracked), false, &mut totals).await?;
                } else {
                    if changed < options.settle_keys {
                        break;
                    }
                    changed = run_pass(None, false, &mut totals).await?.0;
                }
            }
            Ok::<_, TitoError>(())
        }
        .await;
        if let Err(err) = result {
            if local {
                gate.flip(|state| state.stop_tracking()).await;
            }
            return Err(err);
        }
    }
    // The switch: from here the source refuses writes through Tito.
    let switch = Instant::now();
    let moved = match marked {
        Some(moved) => moved,
        None => Moved {
            to: options.to.clone(),
            at_ms: version_millis(from.current_version().await?),
            finished_ms: None,
        },
    };
    let tracked = {
        let moved = moved.clone();
        gate.flip(move |state| {
            state.set_moved(Some(moved));
            state.stop_tracking()
        })
        .await
    };
    let marker = serde_json::to_vec(&moved)?;
    let finished = async {
        from.transaction(|tx| {
            let marker = marker.clone();
            async move { tx.put(MOVED_KEY.to_vec(), marker).await }
        })
        .await?;
        if !local {
            // Every process sees the marker at its next check, and every commit let through
            // before has its version by then (see `engine::gate`).
            tokio::time::sleep(MOVED_CHECK_INTERVAL + MOVED_COMMIT_DEADLINE).await;
        }
        // A pass that found nothing recorded still runs: it waits for the clocks.
        let tracked = match tracked {
            Tracked::Keys(keys) if local => Some(Tracked::Keys(keys)),
            _ => None,
        };
        run_pass(tracked, false, &mut totals).await
    }
    .await;
    let finished = match finished {
        // The marker says the move finished, so a call made again later (the application
        // already writes to the new store) copies nothing over the new store's writes.
        Ok(done) => {
            to.transaction(|tx| async move { tx.delete(COPY_RECORD_KEY.to_vec()).await })
                .await?;
            let marker = serde_json::to_vec(&Moved {
                finished_ms: Some(version_millis(from.current_version().await?)),
                ..moved.clone()
            })?;
            from.transaction(|tx| {
                let marker = marker.clone();
                async move { tx.put(MOVED_KEY.to_vec(), marker).await }
            })
            .await
            .map(|()| done)
        }
        Err(err) => Err(err),
    };
    let (last_pass_keys, snapshot_version) = finished.map_err(|err| TitoError::Storage {
        message: format!(
            "the move's switch failed after the source began refusing writes (it names \
                 {}): call the move again to finish it, or reopen the source for writes to \
                 abandon it",
            moved.to
        ),
        source: Some(Box::new(err)),
    })?;
    Ok(MigrateReport {
        progress: totals,
        last_pass_keys,
        tracked: local,
        downtime_ms: crate::util::millis(switch.elapsed()),
        snapshot_version,
        elapsed_ms: crate::util::millis(started.elapsed()),
    })
}

/// Takes writes through Tito on a store a [`migrate`] marked as moved again: deletes the
/// marker. Other processes of a TiKV store take writes again within [`MOVED_CHECK_INTERVAL`].
/// Returns the marker it removed (`None`: the store was not marked).
pub async fn reopen<S: TitoEngine>(store: &S) -> TitoResult<Option<Moved>> {
    let moved = read_moved(store).await?;
    if moved.is_some() {
        store
            .transaction(|tx| async move { tx.delete(MOVED_KEY.to_vec()).await })
            .await?;
    }
    store
        .extensions()
        .get::<Gate>()
        .flip(|state| state.set_moved(None))
        .await;
    Ok(moved)
}

/// The store's moved marker, read now.
pub async fn moved<S: TitoEngine>(store: &S) -> TitoResult<Option<Moved>> {
    read_moved(store).await
}

async fn read_moved<S: TitoEngine>(store: &S) -> TitoResult<Option<Moved>> {
    crate::engine::read_only(store, async |tx| {
        tx.get(MOVED_KEY)
            .await?
            .as_deref()
            .map(crate::engine::gate::decode)
            .transpose()
    })
    .await
}

/// Copies the keys a store's gate recorded, as of one snapshot of the source: each is written
/// with the source's value, or deleted where the source has none, in transactions of at most
/// [`CopyOptions::batch`] keys; then waits for the destination's clock like [`copy`].
async fn copy_keys<S: TitoEngine, D: TitoEngine>(
    from: &S,
    to: &D,
    keys: std::collections::BTreeSet<Vec<u8>>,
    options: &CopyOptions,
    progress: &mut impl FnMut(&CopyProgress),
) -> TitoResult<CopyReport> {
    let started = Instant::now();
    let mut state = CopyProgress {
        pass: 1,
        ..CopyProgress::default()
    };
    let throttle = Throttle::new(options.keys_per_second);
    let source = from.begin().await?;
    let snapshot = source.start_version();
    let keys: Vec<Vec<u8>> = keys
        .into_iter()
        .filter(|key| !skipped(key, options.holders))
        .collect();
    let result = async {
        for chunk in keys.chunks(options.batch) {
            let mut pairs = Vec::with_capacity(chunk.len());
            for key in chunk {
                pairs.push((key.clone(), source.get(key).await?));
            }
            let (written, deleted, bytes) = to
                .transaction(|tx| {
                    let pairs = pairs.clone();
                    async move {
                        let (mut written, mut deleted, mut bytes) = (0u64, 0u64, 0u64);
                        for (key, value) in pairs {
                            match value {
                                Some(value) => {
                                    bytes += (key.len() + value.len()) as u64;
                                    written += 1;
                                    tx.put(key, value).await?;
                                }
                                None => {
                                    deleted += 1;
                                    tx.delete(key).await?;
                                }
                            }
                        }
                        Ok::<_, TitoError>((written, deleted, bytes))
                    }
                })
                .await?;
            state.keys_read += chunk.len() as u64;
            state.keys_written += written;
            state.keys_deleted += deleted;
            state.bytes_written += bytes;
            state.cursor = chunk.last().map(|key| display_key(key));
            progress(&state);
            throttle.wait(state.keys_read).await;
        }
        Ok::<_, TitoError>(())
    }
    .await;
    let _ = source.rollback().await;
    result?;
    let clock_waited = wait_for_clock(to, snapshot, options.clock_wait).await?;
    Ok(CopyReport {
        progress: state,
        snapshot_version: snapshot,
        clock_waited_ms: crate::util::millis(clock_waited),
        elapsed_ms: crate::util::millis(started.elapsed()),
    })
}

/// Copies `range` (an empty end: the end of the key space) of the source's snapshot into the
/// destination, range after range.
async fn copy_range<X: TitoTransaction, D: TitoEngine>(
    source: &X,
    to: &D,
    options: &CopyOptions,
    (start, end): (&[u8], &[u8]),
    throttle: &Throttle,
    state: &mut CopyProgress,
    progress: &mut impl FnMut(&CopyProgress),
) -> TitoResult<()> {
    let mut from = start.to_vec();
    loop {
        if !end.is_empty() && from.as_slice() >= end {
            return Ok(());
        }
        let range = source_range(source, &from, end, options).await?;
        // The span this range covers: up to its last key read (a key the copy skips included),
        // or (the source has nothing left in the span) to the span's end, so the destination's
        // keys past the source's last go too. Never an empty range for the end: a range whose
        // keys were all skipped still ends where its scan stopped.
        let (upto, tail) = match &range.last_read {
            Some(last) => (key_after_bytes(last), false),
            None => (end.to_vec(), true),
        };
        let synced = sync_range(
            to,
            range.pairs,
            (&from, &upto),
            range.last_read.as_deref(),
            source.start_version(),
            options.holders,
        )
        .await?;
        state.keys_read += synced.source_keys;
        state.keys_written += synced.written;
        state.keys_deleted += synced.deleted;
        state.bytes_written += synced.bytes;
        if let Some(reached) = &synced.reached {
            state.cursor = Some(display_key(reached));
            progress(state);
        }
        throttle.wait(state.keys_read).await;
        match synced.reached {
            // Stopped early (too many deletes for one transaction): continue after it.
            Some(reached) if !synced.whole => from = key_after_bytes(&reached),
            _ if tail => return Ok(()),
            _ => from = upto,
        }
    }
}

/// One range of the source, as a copy reads it.
struct SourceRange {
    /// The range's keys the copy takes (skipped keys left out).
    pairs: Vec<KvPair>,
    /// The last key the range covers, skipped or not: the next range starts after it. `None`
    /// when the scan read nothing: the range covers the rest of the span.
    last_read: Option<Vec<u8>>,
}

/// The next range of the source: up to `batch` keys from `from`, ending early at the key that
/// reaches `batch_bytes`. Skipped keys (the copy record, the moved marker, holder keys) count
/// towards the batch and are left out of `pairs`, but never end the span: the range covers
/// every key it read.
async fn source_range<X: TitoTransaction>(
    source: &X,
    from: &[u8],
    end: &[u8],
    options: &CopyOptions,
) -> TitoResult<SourceRange> {
    let scanned = source.scan(from, end, options.batch).await?;
    // The span may go on past the last key read, even after a scan shorter than the batch
    // (an engine may answer fewer keys than asked): only a scan that reads nothing ends it.
    let mut last_read = scanned.last().map(|(last, _)| last.clone());
    let mut pairs = Vec::with_capacity(scanned.len());
    let mut bytes = 0usize;
    for (key, value) in scanned {
        if skipped(&key, options.holders) {
            continue;
        }
        bytes += key.len() + value.len();
        let full = bytes >= options.batch_bytes;
        if full {
            // The range ends at this key: what follows it is the next range's.
            last_read = Some(key.clone());
        }
        pairs.push((key, value));
        if full {
            break;
        }
    }
    Ok(SourceRange { pairs, last_read })
}

/// The most deletes one destination transaction of a copy holds (a destination with far more
/// keys than the source in one span is cleared over several).
const MAX_DELETES: u64 = 10_000;

/// What one destination transaction of a copy did.
#[derive(Default)]
struct Synced {
    written: u64,
    deleted: u64,
    bytes: u64,
    /// Source keys handled (written or found equal).
    source_keys: u64,
    /// The last key handled (every key up to it is equal in both stores).
    reached: Option<Vec<u8>>,
    /// Whether the whole span was handled.
    whole: bool,
}

/// Makes the destination's `from..upto` (an empty `upto`: the end) equal to `pairs` in one
/// transaction, with the copy record's cursor at the last key handled; stops early after
/// [`MAX_DELETES`] deletes.
async fn sync_range<D: TitoEngine>(
    to: &D,
    pairs: Vec<KvPair>,
    (from, upto): (&[u8], &[u8]),
    last_read: Option<&[u8]>,
    snapshot: u64,
    holders: bool,
) -> TitoResult<Synced> {
    let (from, upto) = (from.to_vec(), upto.to_vec());
    let last_read = last_read.map(<[u8]>::to_vec);
    to.transaction(|tx| {
        let (pairs, from, upto, last_read) =
            (pairs.clone(), from.clone(), upto.clone(), last_read.clone());
        async move {
            let mut theirs = Pager::new(tx.clone(), from, upto, holders);
            let mut ours = pairs.into_iter().peekable();
            let mut synced = Synced {
                whole: true,
                ..Synced::default()
            };
            loop {
                if synced.deleted >= MAX_DELETES {
                    synced.whole = false;
                    break;
                }
                let there = theirs.peek().await?.cloned();
                let ours_next = ours.peek().cloned();
                // A destination key before the source's next (or past its last) goes.
                if let Some((other, _)) = there
                    .as_ref()
                    .filter(|(other, _)| ours_next.as_ref().is_none_or(|(key, _)| other < key))
                {
                    tx.delete(other.clone()).await?;
                    theirs.advance();
                    synced.deleted += 1;
                    synced.reached = Some(other.clone());
                    continue;
                }
                let Some((key, value)) = ours_next else { break };
                // The source's key: written unless the destination holds it with its value.
                let matched = there.filter(|(other, _)| *other == key);
                if matched.is_some() {
                    theirs.advance();
                }
                if matched.is_none_or(|(_, other_value)| other_value != value) {
                    synced.written += 1;
                    synced.bytes += (key.len() + value.len()) as u64;
                    tx.put(key.clone(), value).await?;
                }
                ours.next();
                synced.source_keys += 1;
                synced.reached = Some(key);
            }
            // The whole span is equal now: the cursor goes to its last key read, a skipped
            // one included, so a resumed copy does not read it again.
            if synced.whole && last_read.is_some() {
                synced.reached = last_read;
            }
            if let Some(cursor) = &synced.reached {
                let record = CopyRecord {
                    cursor: cursor.clone(),
                    snapshot_version: snapshot,
                };
                tx.put(COPY_RECORD_KEY.to_vec(), serde_json::to_vec(&record)?)
                    .await?;
            }
            Ok::<_, TitoError>(synced)
        }
    })
    .await
}

/// Pages through a range of one transaction, skipping the copy record (and, unless `holders`,
/// the holder keys).
struct Pager<X: TitoTransaction> {
    tx: X,
    next: Vec<u8>,
    end: Vec<u8>,
    buffer: VecDeque<KvPair>,
    done: bool,
    holders: bool,
}

/// Keys a pager reads per request.
const PAGE: usize = 1000;

impl<X: TitoTransaction> Pager<X> {
    fn new(tx: X, start: Vec<u8>, end: Vec<u8>, holders: bool) -> Self {
        Pager {
            tx,
            next: start,
            end,
            buffer: VecDeque::new(),
            done: false,
            holders,
        }
    }

    async fn peek(&mut self) -> TitoResult<Option<&KvPair>> {
        while self.buffer.is_empty() && !self.done {
            if !self.end.is_empty() && self.next >= self.end {
                self.done = true;
                break;
            }
            let page = self.tx.scan(&self.next, &self.end, PAGE).await?;
            if page.len() < PAGE {
                self.done = true;
            }
            if let Some((last, _)) = page.last() {
                self.next = key_after_bytes(last);
            }
            let holders = self.holders;
            self.buffer
                .extend(page.into_iter().filter(|(key, _)| !skipped(key, holders)));
        }
        Ok(self.buffer.front())
    }

    fn advance(&mut self) {
        self.buffer.pop_front();
    }
}

async fn read_record<D: TitoEngine>(to: &D) -> TitoResult<Option<CopyRecord>> {
    crate::engine::read_only(to, async |tx| match tx.get(COPY_RECORD_KEY).await? {
        Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|err| {
            TitoError::Integrity(format!(
                "the destination's copy record (key {}) is damaged: {err}; overwrite the \
                 destination to copy again from the first key (Existing::Overwrite, \
                 tito store copy --overwrite)",
                display_key(COPY_RECORD_KEY)
            ))
        }),
        None => Ok(None),
    })
    .await
}

async fn first_data_key<D: TitoEngine>(to: &D) -> TitoResult<Option<Vec<u8>>> {
    crate::engine::read_only(to, async |tx| {
        // Every key counts as data here, holder keys too.
        let mut pager = Pager::new(tx.clone(), Vec::new(), Vec::new(), true);
        Ok(pager.peek().await?.map(|(key, _)| key.clone()))
    })
    .await
}

async fn count_keys<S: TitoEngine>(from: &S, holders: bool) -> TitoResult<u64> {
    crate::engine::read_only(from, async |tx| {
        let mut pager = Pager::new(tx.clone(), Vec::new(), Vec::new(), holders);
        let mut count = 0u64;
        while pager.peek().await?.is_some() {
            pager.advance();
            count += 1;
        }
        Ok(count)
    })
    .await
}

/// Waits until the destination hands out versions past `version` (the source's snapshot).
async fn wait_for_clock<D: TitoEngine>(
    to: &D,
    version: u64,
    wait: Duration,
) -> TitoResult<Duration> {
    let started = Instant::now();
    loop {
        let now = to.current_version().await?;
        if now > version {
            return Ok(started.elapsed());
        }
        if started.elapsed() >= wait {
            return Err(TitoError::invalid_argument(format!(
                "the destination's clock is {} ms behind the source's (the copied rows hold \
                 times of the source's clock): waited {wait:?}; wait until the destination's \
                 clock passes {} ms and copy again with resume (a catch-up pass)",
                version_millis(version).saturating_sub(version_millis(now)),
                version_millis(version)
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Spaces out ranges to an average rate of keys per second.
struct Throttle {
    rate: Option<u64>,
    started: Instant,
}

impl Throttle {
    fn new(rate: Option<u64>) -> Self {
        Throttle {
            rate,
            started: Instant::now(),
        }
    }

    async fn wait(&self, keys: u64) {
        if let Some(rate) = self.rate {
            let due = Duration::from_secs_f64(keys as f64 / rate as f64);
            let elapsed = self.started.elapsed();
            if due > elapsed {
                tokio::time::sleep(due - elapsed).await;
            }
        }
    }
}

/// Options of [`verify`].
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    batch: usize,
    report: usize,
    holders: bool,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            batch: 1000,
            report: 10,
            holders: false,
        }
    }
}

impl VerifyOptions {
    /// Ranges of 1,000 keys; the first 10 differing keys named.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys per compared range (1 to [`MAX_BATCH`]).
    pub fn batch(mut self, keys: usize) -> Self {
        self.batch = keys;
        self
    }

    /// How many differing keys the report names (the rest are counted).
    pub fn report(mut self, keys: usize) -> Self {
        self.report = keys;
        self
    }

    /// Compares the keys that say who runs what now ([`is_holder_key`]) too.
    pub fn holders(mut self, compare: bool) -> Self {
        self.holders = compare;
        self
    }
}

/// One compared range: the keys of store A from `first` to `last`, and the keys B holds in the
/// same span, with their counts and hashes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeSummary {
    /// The range's first key (A's, or B's when A has none left), as text.
    pub first: String,
    /// The range's last key, as text.
    pub last: String,
    /// Keys of A in the range.
    pub count_a: u64,
    /// Keys of B in the range.
    pub count_b: u64,
    /// A hash of A's keys and values in the range (FNV-1a, 64 bits).
    pub hash_a: u64,
    /// The same hash of B's.
    pub hash_b: u64,
}

impl RangeSummary {
    /// Whether both stores hold the same keys and values in the range.
    pub fn equal(&self) -> bool {
        self.count_a == self.count_b && self.hash_a == self.hash_b
    }
}

/// How one key differs between the stores.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Difference {
    /// Only store A has the key.
    OnlyInA(String),
    /// Only store B has the key.
    OnlyInB(String),
    /// Both have it, with different values.
    Changed(String),
}

/// What [`verify`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Keys in store A (the copy record left out).
    pub keys_a: u64,
    /// Keys in store B.
    pub keys_b: u64,
    /// Bytes of keys and values in A.
    pub bytes_a: u64,
    /// Ranges compared.
    pub ranges: u64,
    /// Ranges whose counts or hashes differ.
    pub ranges_differing: u64,
    /// Keys that differ, in all.
    pub differing_keys: u64,
    /// The first differing keys, in key order (up to [`VerifyOptions::report`]).
    pub first_differences: Vec<Difference>,
    /// The snapshot version of A compared.
    pub version_a: u64,
    /// The snapshot version of B compared.
    pub version_b: u64,
}

impl VerifyReport {
    /// Whether the stores hold the same keys with the same values.
    pub fn equal(&self) -> bool {
        self.differing_keys == 0
    }
}

/// Compares two stores key by key, each in one snapshot, range by range (counts and hashes per
/// range, passed to `range` as they are done), in bounded memory; names the first differing
/// keys. Changes nothing. The copy record ([`COPY_RECORD_KEY`]) is left out, and so are holder
/// keys ([`is_holder_key`]) unless [`VerifyOptions::holders`].
pub async fn verify<A: TitoEngine, B: TitoEngine>(
    a: &A,
    b: &B,
    options: VerifyOptions,
    mut range: impl FnMut(&RangeSummary),
) -> TitoResult<VerifyReport> {
    check_batch(options.batch)?;
    let (ta, tb) = (a.begin().await?, b.begin().await?);
    let mut report = VerifyReport {
        version_a: ta.start_version(),
        version_b: tb.start_version(),
        ..VerifyReport::default()
    };
    let result = compare(&ta, &tb, &options, &mut report, &mut range).await;
    let _ = ta.rollback().await;
    let _ = tb.rollback().await;
    result.map(|()| report)
}

async fn compare<A: TitoTransaction, B: TitoTransaction>(
    ta: &A,
    tb: &B,
    options: &VerifyOptions,
    report: &mut VerifyReport,
    range: &mut impl FnMut(&RangeSummary),
) -> TitoResult<()> {
    let mut pa = Pager::new(ta.clone(), Vec::new(), Vec::new(), options.holders);
    let mut pb = Pager::new(tb.clone(), Vec::new(), Vec::new(), options.holders);
    let mut summary: Option<RangeSummary> = None;
    let mut in_range = 0usize;
    let differs = |report: &mut VerifyReport, difference: Difference| {
        report.differing_keys += 1;
        if report.first_differences.len() < options.report {
            report.first_differences.push(difference);
        }
    };
    loop {
        let next_a = pa.peek().await?.cloned();
        let next_b = pb.peek().await?.cloned();
        let (key, value_a, value_b) = match (next_a, next_b) {
            (None, None) => break,
            (Some((ka, va)), None) => (ka, Some(va), None),
            (None, Some((kb, vb))) => (kb, None, Some(vb)),
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(&kb) {
                std::cmp::Ordering::Less => (ka, Some(va), None),
                std::cmp::Ordering::Greater => (kb, None, Some(vb)),
                std::cmp::Ordering::Equal => (ka, Some(va), Some(vb)),
            },
        };
        if value_a.is_some() {
            pa.advance();
        }
        if value_b.is_some() {
            pb.advance();
        }
        let shown = display_key(&key);
        let current = summary.get_or_insert_with(|| RangeSummary {
            first: shown.clone(),
            last: shown.clone(),
            count_a: 0,
            count_b: 0,
            hash_a: FNV_OFFSET,
            hash_b: FNV_OFFSET,
        });
        current.last = shown.clone();
        if let Some(value) = &value_a {
            current.count_a += 1;
            current.hash_a = fnv(fnv(current.hash_a, &key), value);
            report.keys_a += 1;
            report.bytes_a += (key.len() + value.len()) as u64;
        }
        if let Some(value) = &value_b {
            current.count_b += 1;
            current.hash_b = fnv(fnv(current.hash_b, &key), value);
            report.keys_b += 1;
        }
        match (&value_a, &value_b) {
            (Some(_), None) => differs(report, Difference::OnlyInA(shown)),
            (None, Some(_)) => differs(report, Difference::OnlyInB(shown)),
            (Some(va), Some(vb)) if va != vb => differs(report, Difference::Changed(shown)),
            _ => {}
        }
        in_range += 1;
        if in_range == options.batch {
            finish_range(&mut summary, report, range);
            in_range = 0;
        }
    }
    finish_range(&mut summary, report, range);
    Ok(())
}

fn finish_range(
    summary: &mut Option<RangeSummary>,
    report: &mut VerifyReport,
    range: &mut impl FnMut(&RangeSummary),
) {
    if let Some(done) = summary.take() {
        report.ranges += 1;
        if !done.equal() {
            report.ranges_differing += 1;
        }
        range(&done);
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over a length-prefixed field, so ("ab", "c") and ("a", "bc") hash apart.
fn fnv(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}
