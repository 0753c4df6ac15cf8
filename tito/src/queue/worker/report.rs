//! A worker's report: who runs it and what its handlers did in the last hour, written to
//! `{queue}:report:{worker}` about every [`REPORT_EVERY`] and when the worker stops, so an
//! operator (the dashboard's charts, `tito queue stats`) sees handler figures, hosts and ages
//! without a metrics backend.
//!
//! Per minute a report holds the handler runs, failures, run times and lateness (how long
//! after its due time a handler started) of each partition the worker ran, and once a minute a
//! sample of the depth of up to [`DEPTH_PARTITIONS`] of the partitions it holds (in turn, when
//! it holds more): how many rows are due, counted up to [`DEPTH_BOUND`] shared by the partitions
//! sampled, and how late the oldest of them is. A report keeps per-partition figures for as many
//! recent minutes as fit in [`REPORT_DETAIL_BYTES`]; older minutes keep their totals only.
//!
//! The report is advisory: a write that fails is logged and tried again at the next interval,
//! and nothing reads it to decide anything. Reports not written for [`REPORT_KEPT`] are deleted
//! by the next worker that starts on the queue.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::TitoResult;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::keys;
use crate::queue::Queue;

/// How often a running worker writes its report.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// How many minutes of handler figures a report keeps (the current, partial minute first).
pub const REPORT_MINUTES: usize = 60;

/// How many due rows a worker counts at most for its minute's depth sample, shared by the
/// partitions it samples (each counts at least one).
pub const DEPTH_BOUND: u64 = 10_000;

/// How many of its partitions a worker samples a minute at most (in turn, when it holds more).
pub const DEPTH_PARTITIONS: usize = 64;

/// About how many bytes of per-partition figures and depth samples a report keeps; past it the
/// oldest minutes keep their totals only.
pub const REPORT_DETAIL_BYTES: usize = 128 * 1024;

/// How long a report nobody writes is kept (a worker that stopped, or whose process died).
pub const REPORT_KEPT: Duration = Duration::from_secs(3600);

/// How many stale reports a starting worker deletes at most (the rest go at later starts).
const STALE_SWEEP: usize = 256;

/// The handlers of one worker in one minute.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MinuteFigures {
    /// The minute (Unix seconds / 60, by the worker's clock).
    pub minute: u64,
    /// Handler runs that ended in this minute.
    pub runs: u64,
    /// Of those, the ones that failed (an error, a panic or a timeout).
    pub failed: u64,
    /// Their run time, summed (ms).
    pub total_ms: u64,
    /// The longest of them (ms).
    pub max_ms: u64,
    /// How late they started, summed (ms after their due time).
    #[serde(default)]
    pub late_total_ms: u64,
    /// The latest start of them (ms after its due time).
    #[serde(default)]
    pub late_max_ms: u64,
    /// Transactional handler calls run again because their transaction did not commit (see
    /// the guide's Transactional handlers), for the runs that ended in this minute.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replayed: u64,
    /// The same figures per partition, by partition (stored as arrays).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionRuns>,
    /// The depth of each partition the worker held, sampled once in the minute (stored as
    /// arrays).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depth: Vec<DepthSample>,
}

impl MinuteFigures {
    /// Adds another minute's figures to these (the queue-wide ones; per-partition figures and
    /// depth samples are not merged).
    pub fn add(&mut self, other: &MinuteFigures) {
        self.runs += other.runs;
        self.failed += other.failed;
        self.total_ms = self.total_ms.saturating_add(other.total_ms);
        self.max_ms = self.max_ms.max(other.max_ms);
        self.late_total_ms = self.late_total_ms.saturating_add(other.late_total_ms);
        self.late_max_ms = self.late_max_ms.max(other.late_max_ms);
        self.replayed += other.replayed;
    }

    /// The mean run time (ms), if anything ran.
    pub fn mean_ms(&self) -> Option<u64> {
        (self.runs > 0).then(|| self.total_ms / self.runs)
    }

    /// The mean lateness at start (ms), if anything ran.
    pub fn mean_late_ms(&self) -> Option<u64> {
        (self.runs > 0).then(|| self.late_total_ms / self.runs)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One partition's handler runs in one minute. Stored as an array, `[partition, runs, failed,
/// total_ms, max_ms, late_total_ms, late_max_ms]`, to keep an hour of a worker's partitions
/// small.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "(u32, u64, u64, u64, u64, u64, u64)")]
#[serde(into = "(u32, u64, u64, u64, u64, u64, u64)")]
pub struct PartitionRuns {
    /// The partition.
    pub partition: u32,
    /// Handler runs that ended in the minute.
    pub runs: u64,
    /// Of those, the ones that failed.
    pub failed: u64,
    /// Their run time, summed (ms).
    pub total_ms: u64,
    /// The longest of them (ms).
    pub max_ms: u64,
    /// How late they started, summed (ms).
    pub late_total_ms: u64,
    /// The latest start of them (ms).
    pub late_max_ms: u64,
}

impl From<(u32, u64, u64, u64, u64, u64, u64)> for PartitionRuns {
    fn from(t: (u32, u64, u64, u64, u64, u64, u64)) -> Self {
        PartitionRuns {
            partition: t.0,
            runs: t.1,
            failed: t.2,
            total_ms: t.3,
            max_ms: t.4,
            late_total_ms: t.5,
            late_max_ms: t.6,
        }
    }
}

impl From<PartitionRuns> for (u32, u64, u64, u64, u64, u64, u64) {
    fn from(p: PartitionRuns) -> Self {
        (
            p.partition,
            p.runs,
            p.failed,
            p.total_ms,
            p.max_ms,
            p.late_total_ms,
            p.late_max_ms,
        )
    }
}

impl PartitionRuns {
    /// A partition's share of a minute's figures.
    fn of(partition: u32, f: &MinuteFigures) -> Self {
        PartitionRuns {
            partition,
            runs: f.runs,
            failed: f.failed,
            total_ms: f.total_ms,
            max_ms: f.max_ms,
            late_total_ms: f.late_total_ms,
            late_max_ms: f.late_max_ms,
        }
    }

    /// As a minute's figures (for sums over partitions).
    pub fn figures(&self, minute: u64) -> MinuteFigures {
        MinuteFigures {
            minute,
            runs: self.runs,
            failed: self.failed,
            total_ms: self.total_ms,
            max_ms: self.max_ms,
            late_total_ms: self.late_total_ms,
            late_max_ms: self.late_max_ms,
            ..MinuteFigures::default()
        }
    }
}

/// A held partition's depth when a worker sampled it. Stored as an array, `[partition, due,
/// more, oldest_late_s, at_ms]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    from = "(u32, u64, bool, u64, u64)",
    into = "(u32, u64, bool, u64, u64)"
)]
pub struct DepthSample {
    /// The partition.
    pub partition: u32,
    /// Rows due at the sample (their due time passed), counted up to the bound.
    pub due: u64,
    /// More rows were due than counted.
    pub more: bool,
    /// How late the oldest due row was (s; 0 when none was due).
    pub oldest_late_s: u64,
    /// When the sample was read (engine time, Unix ms).
    pub at_ms: u64,
}

impl From<(u32, u64, bool, u64, u64)> for DepthSample {
    fn from(t: (u32, u64, bool, u64, u64)) -> Self {
        DepthSample {
            partition: t.0,
            due: t.1,
            more: t.2,
            oldest_late_s: t.3,
            at_ms: t.4,
        }
    }
}

impl From<DepthSample> for (u32, u64, bool, u64, u64) {
    fn from(d: DepthSample) -> Self {
        (d.partition, d.due, d.more, d.oldest_late_s, d.at_ms)
    }
}

/// A worker's report as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The worker's id (the holder its leases name).
    pub worker: String,
    /// The process that runs it: `pid N on HOST`.
    pub runner: String,
    /// When the worker wrote its first report (engine time, Unix ms).
    pub started_ms: u64,
    /// When it wrote this one (engine time, Unix ms).
    pub written_ms: u64,
    /// The worker stopped (shut down) after writing it.
    pub stopped: bool,
    /// Its handlers in the last [`REPORT_MINUTES`] minutes, newest first; minutes without runs
    /// or a depth sample are left out.
    pub minutes: Vec<MinuteFigures>,
}

/// A worker that has not stopped but wrote no report for this long is gone (its process was
/// killed or lost the store): three report intervals.
pub const REPORT_GONE_AFTER: Duration = Duration::from_secs(3 * REPORT_EVERY.as_secs());

impl WorkerReport {
    /// Whether the worker is gone at `now_ms` (engine time): it did not stop, and wrote no
    /// report for [`REPORT_GONE_AFTER`].
    pub fn gone(&self, now_ms: u64) -> bool {
        !self.stopped
            && now_ms.saturating_sub(self.written_ms) > REPORT_GONE_AFTER.as_millis() as u64
    }

    /// Whether the worker runs at `now_ms`: neither stopped nor gone.
    pub fn running(&self, now_ms: u64) -> bool {
        !self.stopped && !self.gone(now_ms)
    }

    /// What the worker's state adds after "reported N s ago": nothing for a running worker,
    /// " (stopped)", or " (gone: no report for N s)".
    pub fn state_note(&self, now_ms: u64) -> String {
        if self.stopped {
            " (stopped)".into()
        } else if self.gone(now_ms) {
            format!(
                " (gone: no report for {} s, its process was likely killed)",
                now_ms.saturating_sub(self.written_ms) / 1000
            )
        } else {
            String::new()
        }
    }

    /// The figures of the minutes at or after `since_minute`, summed.
    pub fn since(&self, since_minute: u64) -> MinuteFigures {
        let mut sum = MinuteFigures {
            minute: since_minute,
            ..MinuteFigures::default()
        };
        for minute in self.minutes.iter().filter(|m| m.minute >= since_minute) {
            sum.add(minute);
        }
        sum
    }
}

/// Handler runs of one worker, per minute; shared by the worker loop and its handler tasks.
#[derive(Debug, Default)]
pub(crate) struct Figures {
    minutes: Mutex<VecDeque<MinuteFigures>>,
}

impl Figures {
    /// Records one handler run of `partition` that started `late_ms` after its due time, took
    /// `took` and failed or not.
    pub fn record(&self, partition: u32, took: Duration, failed: bool, late_ms: u64, replays: u64) {
        let ms = crate::util::millis(took);
        let run = PartitionRuns {
            partition,
            runs: 1,
            failed: u64::from(failed),
            total_ms: ms,
            max_ms: ms,
            late_total_ms: late_ms,
            late_max_ms: late_ms,
        };
        let mut minutes = crate::util::lock(&self.minutes);
        let current = newest(&mut minutes, minute_now());
        current.add(&run.figures(current.minute));
        current.replayed += replays;
        add_partition_runs(&mut current.partitions, &run);
    }

    /// Adds the minutes of an earlier run under the same worker id (its last report) to these:
    /// totals and per-partition figures summed minute by minute, a depth sample kept where
    /// this run has none.
    fn absorb(&self, earlier: &[MinuteFigures]) {
        let mut minutes = crate::util::lock(&self.minutes);
        for old in earlier {
            match minutes.iter_mut().find(|m| m.minute == old.minute) {
                Some(kept) => {
                    kept.add(old);
                    for runs in &old.partitions {
                        add_partition_runs(&mut kept.partitions, runs);
                    }
                    if kept.depth.is_empty() {
                        kept.depth = old.depth.clone();
                    }
                }
                None => {
                    let at = minutes.partition_point(|m| m.minute > old.minute);
                    minutes.insert(at, old.clone());
                }
            }
        }
        minutes.truncate(REPORT_MINUTES);
        keep_detail_within(minutes.make_contiguous(), REPORT_DETAIL_BYTES);
    }

    /// Files the depth samples of `minute` (replacing any it had).
    fn sampled(&self, minute: u64, samples: Vec<DepthSample>) {
        let mut minutes = crate::util::lock(&self.minutes);
        newest(&mut minutes, minute).depth = samples;
    }

    /// The kept minutes within the last [`REPORT_MINUTES`], newest first, with `samples` as
    /// the current minute's depth when given.
    fn snapshot(&self, samples: Option<(u64, &[DepthSample])>) -> Vec<MinuteFigures> {
        let now = minute_now();
        let oldest = now.saturating_sub(REPORT_MINUTES as u64 - 1);
        let mut minutes: Vec<MinuteFigures> = crate::util::lock(&self.minutes)
            .iter()
            .filter(|m| m.minute >= oldest)
            .cloned()
            .collect();
        if let Some((minute, samples)) = samples {
            match minutes.iter_mut().find(|m| m.minute == minute) {
                Some(m) => m.depth = samples.to_vec(),
                None => {
                    let at = minutes.partition_point(|m| m.minute > minute);
                    minutes.insert(
                        at,
                        MinuteFigures {
                            minute,
                            depth: samples.to_vec(),
                            ..MinuteFigures::default()
                        },
                    );
                }
            }
        }
        keep_detail_within(&mut minutes, REPORT_DETAIL_BYTES);
        minutes
    }

    /// Whether `minute` has its depth samples.
    fn has_depth(&self, minute: u64) -> bool {
        crate::util::lock(&self.minutes)
            .iter()
            .any(|m| m.minute == minute && !m.depth.is_empty())
    }
}

/// Adds `runs` to its partition's figures in `partitions` (kept in partition order), or files
/// them as that partition's.
fn add_partition_runs(partitions: &mut Vec<PartitionRuns>, runs: &PartitionRuns) {
    match partitions.binary_search_by_key(&runs.partition, |p| p.partition) {
        Ok(at) => {
            let mut sum = partitions[at].figures(0);
            sum.add(&runs.figures(0));
            partitions[at] = PartitionRuns::of(runs.partition, &sum);
        }
        Err(at) => partitions.insert(at, *runs),
    }
}

/// Drops the per-partition figures and depth samples of the oldest minutes (newest first in
/// `minutes`) once the newer ones take about `bytes` as stored; totals stay.
fn keep_detail_within(minutes: &mut [MinuteFigures], bytes: usize) {
    // As stored: about 40 bytes a partition's figures, 30 a depth sample.
    let mut used = 0usize;
    for minute in minutes.iter_mut() {
        let detail = minute.partitions.len() * 40 + minute.depth.len() * 30;
        if used + detail > bytes {
            minute.partitions = Vec::new();
            minute.depth = Vec::new();
        } else {
            used += detail;
        }
    }
}

/// The current minute (Unix seconds / 60, by this host's clock).
fn minute_now() -> u64 {
    (chrono::Utc::now().timestamp().max(0) as u64) / 60
}

/// The newest kept minute, pushed first when `minute` is newer (the oldest beyond
/// [`REPORT_MINUTES`] dropped). A clock that stepped back files under the newest minute.
fn newest(minutes: &mut VecDeque<MinuteFigures>, minute: u64) -> &mut MinuteFigures {
    if minutes.front().is_none_or(|m| m.minute < minute) {
        minutes.push_front(MinuteFigures {
            minute,
            ..MinuteFigures::default()
        });
        minutes.truncate(REPORT_MINUTES);
        // What no report would carry is not kept in memory either.
        keep_detail_within(minutes.make_contiguous(), REPORT_DETAIL_BYTES);
    }
    minutes.front_mut().expect("a minute was just pushed")
}

/// Writes one worker's report.
pub(crate) struct Reporter {
    worker: String,
    pub figures: Arc<Figures>,
    started_ms: Option<u64>,
    /// Whether the last report of an earlier run under this worker id was read (and its
    /// minutes taken over).
    took_over: bool,
    next: Instant,
    /// Where the next depth sample starts among the held partitions (in partition order).
    depth_turn: u32,
}

impl Reporter {
    pub fn new(worker: &str) -> Self {
        Reporter {
            worker: worker.to_string(),
            figures: Arc::default(),
            started_ms: None,
            took_over: false,
            next: Instant::now(),
            depth_turn: 0,
        }
    }

    /// Up to [`DEPTH_PARTITIONS`] of `held` to sample, in partition order from where the last
    /// sample stopped (every partition, when it holds no more).
    fn in_turn(&mut self, held: &[u32]) -> Vec<u32> {
        let mut held = held.to_vec();
        held.sort_unstable();
        if held.len() <= DEPTH_PARTITIONS {
            return held;
        }
        let start = held.partition_point(|&p| p < self.depth_turn);
        let turn: Vec<u32> = held
            .iter()
            .cycle()
            .skip(start)
            .take(DEPTH_PARTITIONS)
            .copied()
            .collect();
        self.depth_turn = turn.last().map_or(0, |p| p.wrapping_add(1));
        turn
    }

    /// Whether the report is due (at once the first time, then every [`REPORT_EVERY`]).
    pub fn due(&self) -> bool {
        Instant::now() >= self.next
    }

    /// Writes the report now, with a depth sample of the `held` partitions once a minute;
    /// `stopped` when the worker is done.
    pub async fn write<E: TitoEngine>(&mut self, queue: &Queue<E>, stopped: bool, held: &[u32]) {
        self.next = Instant::now() + REPORT_EVERY;
        let first = self.started_ms.is_none();
        let root = queue.root().to_string();
        let key = report_key(&root, &self.worker);
        let minute = minute_now();
        // Once a minute, and not by a worker on its way out (its partitions are being let go).
        let sample = !stopped && !held.is_empty() && !self.figures.has_depth(minute);
        let sampled: Vec<u32> = if sample {
            self.in_turn(held)
        } else {
            Vec::new()
        };
        let sampled = &sampled;
        if !self.took_over {
            // A worker started again under its id (a fixed `worker_id`, a cluster node id)
            // writes where its earlier run reported: that run's hour is carried on, not lost.
            match read_report(queue.engine(), &key).await {
                Ok(earlier) => {
                    self.took_over = true;
                    if let Some(earlier) = earlier {
                        self.figures.absorb(&earlier.minutes);
                    }
                }
                Err(err) => {
                    tracing::debug!(
                        queue = %queue.label(),
                        worker = %self.worker,
                        error = %err,
                        "an earlier report under this worker id was not read; tried again later"
                    );
                    return;
                }
            }
        }
        let (worker, started) = (self.worker.clone(), self.started_ms);
        let figures = self.figures.clone();
        let written: TitoResult<(u64, Vec<DepthSample>)> = queue
            .engine()
            .transaction(|tx| {
                let (root, key, worker, figures) =
                    (root.clone(), key.clone(), worker.clone(), figures.clone());
                async move {
                    let now_ms = engine::version_millis(tx.start_version());
                    if first {
                        sweep_stale(&tx, &root, &key, now_ms).await?;
                    }
                    let samples = if sample {
                        depth_samples(&tx, &root, sampled, now_ms).await?
                    } else {
                        Vec::new()
                    };
                    let report = WorkerReport {
                        worker,
                        runner: crate::util::runner().to_string(),
                        started_ms: started.unwrap_or(now_ms),
                        written_ms: now_ms,
                        stopped,
                        minutes: figures.snapshot(sample.then_some((minute, &samples))),
                    };
                    tx.put(key.into_bytes(), serde_json::to_vec(&report)?)
                        .await?;
                    Ok::<_, crate::TitoError>((report.started_ms, samples))
                }
            })
            .await;
        match written {
            Ok((started_ms, samples)) => {
                self.started_ms = Some(started_ms);
                if sample {
                    self.figures.sampled(minute, samples);
                }
            }
            Err(err) => tracing::debug!(
                queue = %queue.label(),
                worker = %self.worker,
                error = %err,
                "a worker's report was not written; it is tried again later"
            ),
        }
    }
}

/// The depth of each of `held`: its rows due at `now_ms`, counted up to its share of
/// [`DEPTH_BOUND`], and how late the first of them is.
async fn depth_samples<X: TitoTransaction>(
    tx: &X,
    root: &str,
    held: &[u32],
    now_ms: u64,
) -> TitoResult<Vec<DepthSample>> {
    let now_s = now_ms / 1000;
    let bound = (DEPTH_BOUND / held.len().max(1) as u64).max(1);
    let mut samples = Vec::with_capacity(held.len());
    for &partition in held {
        let prefix = keys::pending_partition_prefix(root, partition);
        // Due: a due time at or before this second.
        let end = keys::pending_bucket_prefix(root, partition, now_s + 1);
        let mut start = prefix.into_bytes();
        let (mut due, mut more, mut oldest) = (0u64, false, None);
        loop {
            let want = DEPTH_PAGE.min((bound - due) as usize + 1);
            let rows = tx.scan(&start, end.as_bytes(), want).await?;
            if oldest.is_none()
                && let Some((_, value)) = rows.first()
            {
                // The first row runs next; its own due time (its key's is less an urgency's
                // boost). A row that does not decode counts, without a lateness.
                oldest = Some(
                    crate::event::StoredEvent::parse(value)
                        .map_or(now_s, |stored| stored.timestamp.max(0) as u64),
                );
            }
            let take = rows.len().min((bound - due) as usize);
            due += take as u64;
            if take < rows.len() {
                more = true;
                break;
            }
            match rows.last() {
                Some((key, _)) if rows.len() == want => start = keys::key_after_bytes(key),
                _ => break,
            }
        }
        samples.push(DepthSample {
            partition,
            due,
            more,
            oldest_late_s: oldest.map_or(0, |o| now_s.saturating_sub(o)),
            at_ms: now_ms,
        });
    }
    Ok(samples)
}

/// Rows read per scan of a depth sample.
const DEPTH_PAGE: usize = 1_000;

/// Deletes up to [`STALE_SWEEP`] reports of the queue not written for [`REPORT_KEPT`] (never
/// `own`, and never one that does not parse as a report: that is left for an operator).
async fn sweep_stale<X: TitoTransaction>(
    tx: &X,
    root: &str,
    own: &str,
    now_ms: u64,
) -> TitoResult<()> {
    let prefix = report_prefix(root);
    let end = keys::prefix_end(prefix.clone());
    let kept_ms = REPORT_KEPT.as_millis() as u64;
    for (key, value) in tx
        .scan(prefix.as_bytes(), end.as_bytes(), STALE_SWEEP)
        .await?
    {
        if key == own.as_bytes() {
            continue;
        }
        if let Ok(report) = serde_json::from_slice::<WorkerReport>(&value)
            && now_ms.saturating_sub(report.written_ms) > kept_ms
        {
            tx.delete(key).await?;
        }
    }
    Ok(())
}

/// The report at `key`, if one is stored and parses (one that does not is left to be
/// overwritten, as before).
async fn read_report<E: TitoEngine>(db: &E, key: &str) -> TitoResult<Option<WorkerReport>> {
    let bytes = engine::read_only(db, async |tx| tx.get(key.as_bytes()).await).await?;
    Ok(bytes.and_then(|bytes| serde_json::from_slice(&bytes).ok()))
}

/// `{queue}:report:{worker}`: a worker's report.
pub(crate) fn report_key(root: &str, worker: &str) -> String {
    let mut key = report_prefix(root);
    keys::encode_bounded(worker, &mut key);
    key
}

/// `{queue}:report:`, every worker report of a queue.
pub(crate) fn report_prefix(root: &str) -> String {
    format!("{root}:report:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_sum_runs_failures_and_times_per_minute() {
        let figures = Figures::default();
        figures.record(3, Duration::from_millis(10), false, 500, 0);
        figures.record(1, Duration::from_millis(30), true, 1500, 2);
        figures.record(3, Duration::from_millis(20), false, 0, 1);
        let minutes = figures.snapshot(None);
        assert_eq!(minutes.len(), 1);
        let m = &minutes[0];
        assert_eq!((m.runs, m.failed, m.total_ms, m.max_ms), (3, 1, 60, 30));
        // Replayed transactional calls, for the dashboard.
        assert_eq!(m.replayed, 3);
        assert_eq!((m.late_total_ms, m.late_max_ms), (2000, 1500));
        assert_eq!(m.mean_ms(), Some(20));
        assert_eq!(m.mean_late_ms(), Some(666));
        assert_eq!(MinuteFigures::default().mean_ms(), None);
        // Per partition, in partition order.
        let parts: Vec<(u32, u64, u64, u64, u64)> = m
            .partitions
            .iter()
            .map(|p| (p.partition, p.runs, p.failed, p.total_ms, p.late_max_ms))
            .collect();
        assert_eq!(parts, vec![(1, 1, 1, 30, 1500), (3, 2, 0, 30, 500)]);
        // A depth sample joins the minute it was read in, replacing an earlier one.
        let sample = DepthSample {
            partition: 3,
            due: 12,
            more: false,
            oldest_late_s: 4,
            at_ms: 9,
        };
        figures.sampled(m.minute, vec![sample]);
        assert!(figures.has_depth(m.minute));
        assert_eq!(figures.snapshot(None)[0].depth, vec![sample]);
        // Stored compactly, and read back the same.
        let json = serde_json::to_string(&figures.snapshot(None)[0]).unwrap();
        assert!(
            json.contains("\"partitions\":[[1,1,1,30,30,1500,1500],[3,2,0,30,20,500,500]]"),
            "{json}"
        );
        assert!(json.contains("\"depth\":[[3,12,false,4,9]]"), "{json}");
        let back: MinuteFigures = serde_json::from_str(&json).unwrap();
        assert_eq!(back, figures.snapshot(None)[0]);
        // A report written before per-partition figures reads with none.
        let old: MinuteFigures =
            serde_json::from_str(r#"{"minute":5,"runs":2,"failed":1,"total_ms":8,"max_ms":5}"#)
                .unwrap();
        assert_eq!((old.runs, old.late_total_ms), (2, 0));
        assert!(old.partitions.is_empty() && old.depth.is_empty());
    }

    #[test]
    fn a_report_keeps_detail_of_its_newest_minutes_within_its_bound() {
        let minute = |minute: u64, partitions: u32| MinuteFigures {
            minute,
            runs: u64::from(partitions),
            partitions: (0..partitions)
                .map(|partition| PartitionRuns {
                    partition,
                    runs: 1,
                    ..PartitionRuns::default()
                })
                .collect(),
            ..MinuteFigures::default()
        };
        // Newest first: 100 partitions a minute is 4,000 bytes; 10,000 bytes keep two minutes.
        let mut minutes: Vec<MinuteFigures> = (0..5).rev().map(|m| minute(m, 100)).collect();
        keep_detail_within(&mut minutes, 10_000);
        let kept: Vec<usize> = minutes.iter().map(|m| m.partitions.len()).collect();
        assert_eq!(kept, [100, 100, 0, 0, 0]);
        assert!(minutes.iter().all(|m| m.runs == 100), "totals stay");
        // Stored, a report of 10,000 partitions a minute for an hour stays near the bound.
        let mut big: Vec<MinuteFigures> = (0..60).rev().map(|m| minute(m, 10_000)).collect();
        keep_detail_within(&mut big, REPORT_DETAIL_BYTES);
        let json = serde_json::to_vec(&big).unwrap();
        assert!(json.len() < 2 * REPORT_DETAIL_BYTES, "{} bytes", json.len());
    }

    /// Prints how large an hour of a busy worker's report is as stored, by partitions held
    /// (`cargo test -p tito --lib report_sizes -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn report_sizes() {
        for partitions in [1u32, 4, 16, 38, 64, 256] {
            let mut minutes: Vec<MinuteFigures> = (0..60u64)
                .rev()
                .map(|m| {
                    let minute = 29_500_000 + m;
                    let runs: Vec<PartitionRuns> = (0..partitions)
                        .map(|partition| PartitionRuns {
                            partition,
                            runs: 1_234,
                            failed: 12,
                            total_ms: 45_678,
                            max_ms: 890,
                            late_total_ms: 123_456,
                            late_max_ms: 2_345,
                        })
                        .collect();
                    let mut figures = MinuteFigures {
                        minute,
                        ..MinuteFigures::default()
                    };
                    for r in &runs {
                        figures.add(&r.figures(minute));
                    }
                    figures.partitions = runs;
                    figures.depth = (0..partitions.min(DEPTH_PARTITIONS as u32))
                        .map(|partition| DepthSample {
                            partition,
                            due: 4_321,
                            more: false,
                            oldest_late_s: 17,
                            at_ms: minute * 60_000 + 5_000,
                        })
                        .collect();
                    figures
                })
                .collect();
            keep_detail_within(&mut minutes, REPORT_DETAIL_BYTES);
            let detailed = minutes.iter().filter(|m| !m.partitions.is_empty()).count();
            let bytes = serde_json::to_vec(&minutes).unwrap().len();
            println!(
                "{partitions:>4} partitions: {bytes:>7} bytes for an hour, {detailed} minutes with per-partition detail"
            );
        }
    }

    #[test]
    fn a_worker_samples_its_partitions_in_turn() {
        let mut reporter = Reporter::new("w");
        let few: Vec<u32> = vec![3, 1, 2];
        assert_eq!(reporter.in_turn(&few), [1, 2, 3]);
        let many: Vec<u32> = (0..150).rev().collect();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let turn = reporter.in_turn(&many);
            assert_eq!(turn.len(), DEPTH_PARTITIONS);
            seen.extend(turn);
        }
        // Three turns of 64 cover all 150, wrapping around.
        assert_eq!(seen.len(), 150);
        // Partitions let go meanwhile: the turn goes on from the next one held.
        let fewer: Vec<u32> = (0..150).filter(|p| p % 2 == 0).collect();
        let turn = reporter.in_turn(&fewer);
        assert!(turn.iter().all(|p| p % 2 == 0) && turn.len() == DEPTH_PARTITIONS);
    }

    #[test]
    fn a_report_sums_the_minutes_asked_for() {
        let minute = |minute, runs, failed| MinuteFigures {
            minute,
            runs,
            failed,
            total_ms: runs * 5,
            max_ms: 7,
            ..MinuteFigures::default()
        };
        let report = WorkerReport {
            worker: "w".into(),
            runner: "pid 1 on h".into(),
            started_ms: 0,
            written_ms: 0,
            stopped: false,
            minutes: vec![minute(100, 4, 1), minute(98, 2, 2), minute(90, 50, 0)],
        };
        let sum = report.since(96);
        assert_eq!(
            (sum.runs, sum.failed, sum.total_ms, sum.max_ms),
            (6, 3, 30, 7)
        );
        assert_eq!(report.since(101).runs, 0);
    }
}
