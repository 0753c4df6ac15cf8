//! Inspection for operator tools: bounded, paginated reads of what a store holds, without the
//! application's model types.
//!
//! Every call reads in one read-only transaction and is bounded: pages hold at most
//! [`MAX_PAGE_LIMIT`] items, counts stop at a bound and say so ([`Count::more`]), listings of
//! names (tables, queues, kv namespaces) read one short scan per name they return. Cursors are
//! the project's opaque page cursors ([`TitoPage::cursor`]); a cursor from another range is
//! refused.
//!
//! Rows that do not decode are returned, never skipped: a queue row that is not an invocation
//! comes back as a [`QueueRow`] with [`QueueRow::malformed`] set and its raw bytes, a table row
//! that is not JSON as a [`RawRow`] whose [`RawRow::value`] is `None`.
//!
//! # Examples
//!
//! ```
//! use tito::backend::memory::Memory;
//! use tito::inspect::{self, QueueState};
//! use tito::{Queue, QueueConfig, QueueEvent, TitoError};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), TitoError> {
//! let db = Memory::new();
//! let queue = Queue::new(db.clone(), QueueConfig::new(4, std::time::Duration::from_secs(60)));
//! queue.publish(QueueEvent::now("user:1", "welcome")).await?;
//!
//! let queues = inspect::queues(&db, 10).await?;
//! assert_eq!(queues[0].label, "default");
//! let overview = inspect::queue_overview(&db, None).await?;
//! assert_eq!(overview.due_now.value, 1);
//! let partition = overview.partitions.iter().find(|p| p.due_now.value == 1).unwrap();
//! let page = inspect::queue_scan(&db, None, QueueState::Pending(partition.partition), None, 10).await?;
//! assert_eq!(page.items[0].event.as_ref().unwrap().key, "user:1");
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::engine::read_only;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::StoredEvent;
use crate::keys;
use crate::model::query::narrow_to_cursor;
use crate::model::{MAX_PAGE_LIMIT, TitoPage};
use crate::queue::{AsideRecord, QueueOwner, UndecodableNote};

/// Where counts stop: past it a [`Count`] says "more than".
pub const COUNT_BOUND: u64 = 10_000;

/// Rows read per scan while counting.
const COUNT_SCAN: usize = 1000;

/// A count read by a bounded scan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Count {
    /// Keys counted (at most the bound).
    pub value: u64,
    /// Whether the scan stopped at the bound with keys left: the count is at least `value`.
    pub more: bool,
}

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.value, if self.more { "+" } else { "" })
    }
}

fn check_limit(limit: usize) -> TitoResult<usize> {
    if limit == 0 || limit > MAX_PAGE_LIMIT {
        return Err(TitoError::invalid_argument(format!(
            "an inspection page holds 1 to {MAX_PAGE_LIMIT} items, got {limit}"
        )));
    }
    Ok(limit)
}

/// Counts the keys in `[start, end)`, stopping at `bound`.
async fn count_in<X: TitoTransaction>(
    tx: &X,
    start: &[u8],
    end: &[u8],
    bound: u64,
) -> TitoResult<Count> {
    let mut start = start.to_vec();
    let mut value = 0u64;
    while value < bound && start.as_slice() < end {
        let want = COUNT_SCAN.min((bound - value) as usize + 1);
        let rows = tx.scan(&start, end, want).await?;
        let full = rows.len() == want;
        let take = rows.len().min((bound - value) as usize);
        value += take as u64;
        if take < rows.len() {
            return Ok(Count { value, more: true });
        }
        match rows.last() {
            Some((key, _)) if full => start = keys::key_after_bytes(key),
            _ => return Ok(Count { value, more: false }),
        }
    }
    // At the bound: one more key means "more".
    let more = value >= bound && !tx.scan(&start, end, 1).await?.is_empty();
    Ok(Count { value, more })
}

/// Counts the keys under `prefix`, stopping at `bound` (1 to 10,000,000).
pub async fn count_prefix<E: TitoEngine>(db: &E, prefix: &str, bound: u64) -> TitoResult<Count> {
    if bound == 0 || bound > 10_000_000 {
        return Err(TitoError::invalid_argument(format!(
            "a count bound must be between 1 and 10000000, got {bound}"
        )));
    }
    let end = keys::prefix_end(prefix.to_string());
    read_only(db, async |tx| {
        count_in(tx, prefix.as_bytes(), end.as_bytes(), bound).await
    })
    .await
}

/// The distinct values of the segment that follows `prefix` (a raw text ending where a segment
/// starts), in key order, at most `limit`: one scan of one key per value.
async fn distinct_segments<X: TitoTransaction>(
    tx: &X,
    prefix: &str,
    limit: usize,
) -> TitoResult<Vec<String>> {
    let end = keys::prefix_end(prefix.to_string());
    let mut start = prefix.as_bytes().to_vec();
    let mut found = Vec::new();
    while found.len() < limit {
        let rows = tx.scan(&start, end.as_bytes(), 1).await?;
        let Some((key, _)) = rows.first() else {
            break;
        };
        let text = String::from_utf8_lossy(key);
        let rest = &text[prefix.len().min(text.len())..];
        let segment = rest.split(keys::SEPARATOR).next().unwrap_or_default();
        found.push(segment.to_string());
        // Past every key of this segment: `{prefix}{segment};` sorts after `{prefix}{segment}:…`.
        start = keys::prefix_end(format!("{prefix}{segment}{}", keys::SEPARATOR)).into_bytes();
    }
    Ok(found)
}

// ---------------------------------------------------------------------------------------------
// Queues
// ---------------------------------------------------------------------------------------------

/// One queue a store holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueueInfo {
    /// Its topic (`None`: the default queue).
    pub topic: Option<String>,
    /// Its `queue` label in metrics: the topic, or `default`.
    pub label: String,
    /// Its partition count, as recorded by its first publication or worker.
    pub partitions: Option<u32>,
}

/// The queues of a store (at most `limit`, 1 to [`MAX_PAGE_LIMIT`]): the default queue first,
/// then named ones in topic order.
pub async fn queues<E: TitoEngine>(db: &E, limit: usize) -> TitoResult<Vec<QueueInfo>> {
    let limit = check_limit(limit)?;
    read_only(db, async |tx| {
        let mut out = Vec::new();
        let default = keys::queue_root(None);
        let prefix = format!("{default}{}", keys::SEPARATOR);
        let end = keys::prefix_end(prefix.clone());
        if !tx
            .scan(prefix.as_bytes(), end.as_bytes(), 1)
            .await?
            .is_empty()
        {
            out.push(QueueInfo {
                topic: None,
                label: crate::telemetry::queue_label(None),
                partitions: partitions_of(tx, &default).await?,
            });
        }
        for encoded in distinct_segments(tx, "queue@", limit.saturating_sub(out.len())).await? {
            let Ok(topic) = keys::decode_str(&encoded) else {
                continue;
            };
            let root = keys::queue_root(Some(&topic));
            out.push(QueueInfo {
                label: crate::telemetry::queue_label(Some(&topic)),
                partitions: partitions_of(tx, &root).await?,
                topic: Some(topic),
            });
        }
        Ok(out)
    })
    .await
}

/// Whether the store holds anything of the queue named `topic` (`None`: the default queue): a
/// row, a pause, limits, a lease, its partition count. A mistyped name holds nothing.
pub async fn queue_exists<E: TitoEngine>(db: &E, topic: Option<&str>) -> TitoResult<bool> {
    let prefix = format!("{}{}", keys::queue_root(topic), keys::SEPARATOR);
    Ok(count_prefix(db, &prefix, 1).await?.value > 0)
}

/// How many dead invocations the queue named `topic` holds, counted up to `bound` (as
/// [`QueueOverview::dead`] counts them, without the rest of the overview).
pub async fn queue_dead_count<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    bound: u64,
) -> TitoResult<Count> {
    count_prefix(db, &keys::dead_prefix(&keys::queue_root(topic)), bound).await
}

async fn partitions_of<X: TitoTransaction>(tx: &X, root: &str) -> TitoResult<Option<u32>> {
    crate::queue::stored_partition_count(tx, root).await
}

/// A partition lease as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeaseView {
    /// The worker (or cluster node) holding it.
    pub holder: String,
    /// Increases with every change of holder.
    pub generation: u64,
    /// When it runs out without renewal (engine time, Unix ms); 0 when unknown.
    pub expires_ms: u64,
}

impl LeaseView {
    /// Whether it ran out before `now_ms` (engine time): its holder no longer holds the
    /// partition, and the next worker to ask takes it. `false` when the expiry is unknown.
    pub fn ran_out(&self, now_ms: u64) -> bool {
        self.expires_ms != 0 && self.expires_ms < now_ms
    }
}

/// One partition of a queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PartitionView {
    /// The partition.
    pub partition: u32,
    /// Pending invocations due now (by the engine's clock).
    pub due_now: Count,
    /// Pending invocations due later.
    pub future: Count,
    /// The due time of the oldest pending invocation (Unix s).
    pub oldest_due: Option<u64>,
    /// How late the oldest due invocation is (s; 0 when none is due).
    pub oldest_late_s: u64,
    /// Its lease, unless free.
    pub lease: Option<LeaseView>,
}

/// A queue at a glance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueOverview {
    /// The queue.
    pub info: QueueInfo,
    /// The engine time the overview was read at (Unix ms).
    pub now_ms: u64,
    /// Every partition.
    pub partitions: Vec<PartitionView>,
    /// Due now, summed over partitions.
    pub due_now: Count,
    /// Due later, summed over partitions.
    pub future: Count,
    /// The oldest due time of all partitions (Unix s).
    pub oldest_due: Option<u64>,
    /// Completed invocations kept (within the retention).
    pub completed: Count,
    /// Invocations in the dead state (a failure policy gave up on them; see
    /// [`crate::Queue::dead`]).
    pub dead: Count,
    /// What is paused ([`crate::Queue::pause`]).
    pub paused: crate::queue::Paused,
    /// The queue's limits and how close it is to them ([`crate::Queue::set_limits`]).
    pub limits: crate::queue::LimitUsage,
    /// Invocations completed in each of the last [`THROUGHPUT_MINUTES`] minutes, the current
    /// (partial) minute first.
    pub completed_per_minute: Vec<Count>,
    /// Cluster members, as the coordinator published them (empty for standalone workers).
    pub members: Vec<String>,
    /// The cluster coordinator, if one holds a valid lease.
    pub coordinator: Option<String>,
    /// The reports of workers that ran on the queue within [`REPORT_SHOWN`] (their host, age
    /// and handler figures), newest first.
    pub workers: Vec<crate::queue::WorkerReport>,
    /// Handler runs of the last [`THROUGHPUT_MINUTES`] minutes (the current one partial),
    /// summed over those workers' reports (each written every
    /// [`REPORT_EVERY`](crate::queue::REPORT_EVERY)).
    pub handlers: crate::queue::MinuteFigures,
    /// The last [`HOUR_MINUTES`] minutes, oldest first and the current (partial) one last,
    /// from every worker report read (see [`QueueOverview::hour_of`]).
    pub hour: Vec<HourMinute>,
    /// Each partition's last hour in brief, by partition.
    pub partition_hours: Vec<PartitionHour>,
    /// The reports the hour is read from (those written within [`REPORT_KEPT`](crate::queue::REPORT_KEPT)).
    #[serde(skip)]
    hour_reports: Vec<crate::queue::WorkerReport>,
}

/// How many minutes the hour of an overview covers.
pub const HOUR_MINUTES: u64 = 60;

/// One minute of a queue, or of one of its partitions, from the workers' reports: handler runs,
/// failures, run times and lateness at start (its [`MinuteFigures`](crate::queue::MinuteFigures),
/// read through it: `m.runs`, `m.mean_ms()`), and the depth sampled in the minute.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HourMinute {
    /// The minute's handler figures (the per-partition figures and depth samples of a
    /// report's minute are not kept here).
    #[serde(flatten)]
    pub figures: crate::queue::MinuteFigures,
    /// Rows due, summed over the partitions counted by the minute: each partition's last count
    /// at or before it (`None`: no partition was counted yet). The current minute's is the
    /// overview's own count of every partition.
    pub due: Option<u64>,
    /// Some partition had more rows due than its sample counted.
    pub due_more: bool,
    /// How many partitions the depth sums.
    pub sampled: u32,
    /// How late the oldest due row of the sampled partitions was (s).
    pub oldest_late_s: Option<u64>,
}

impl std::ops::Deref for HourMinute {
    type Target = crate::queue::MinuteFigures;

    fn deref(&self) -> &Self::Target {
        &self.figures
    }
}

impl HourMinute {
    /// A minute with nothing in it yet.
    pub fn at(minute: u64) -> Self {
        HourMinute {
            figures: crate::queue::MinuteFigures {
                minute,
                ..Default::default()
            },
            ..HourMinute::default()
        }
    }

    /// Runs that did not fail: the minute's throughput.
    pub fn handled(&self) -> u64 {
        self.runs.saturating_sub(self.failed)
    }

    /// Minutes summed: runs, failures and times added (the longest kept), `minute` the first
    /// one's, and the depth the last one's (the current depth when they end with the current
    /// minute).
    pub fn sum_of(minutes: &[HourMinute]) -> HourMinute {
        let mut total = HourMinute::at(minutes.first().map_or(0, |m| m.minute));
        for m in minutes {
            total.figures.add(&m.figures);
        }
        if let Some(last) = minutes.last() {
            (
                total.due,
                total.due_more,
                total.sampled,
                total.oldest_late_s,
            ) = (last.due, last.due_more, last.sampled, last.oldest_late_s);
        }
        total
    }

    fn add_depth(&mut self, due: u64, more: bool, oldest_late_s: u64) {
        self.due = Some(self.due.unwrap_or(0) + due);
        self.due_more |= more;
        self.sampled += 1;
        self.oldest_late_s = Some(self.oldest_late_s.unwrap_or(0).max(oldest_late_s));
    }
}

/// One partition's last hour in brief.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PartitionHour {
    /// The partition.
    pub partition: u32,
    /// Its figures over the hour summed (`minute` is the first; `due` and `oldest_late_s` are
    /// the current minute's).
    pub total: HourMinute,
    /// Its handled runs per minute, oldest first (as [`QueueOverview::hour`]).
    pub handled: Vec<u64>,
}

impl QueueOverview {
    /// The last [`HOUR_MINUTES`] minutes of the whole queue (`None`) or of one partition, oldest
    /// first. Runs are summed over every worker's report; a minute's depth sums each
    /// partition's last count at or before it, and the current minute's is this overview's own
    /// count.
    pub fn hour_of(&self, partition: Option<u32>) -> Vec<HourMinute> {
        let (first, now, mut minutes) = self.blank_hour();
        // The last sample per (minute, partition).
        let mut samples: Samples = BTreeMap::new();
        for (figures, at) in self.report_minutes(first, minutes.len()) {
            let slot = &mut minutes[at];
            match partition {
                None => slot.figures.add(figures),
                Some(p) => {
                    if let Some(runs) = figures.partitions.iter().find(|r| r.partition == p) {
                        slot.figures.add(&runs.figures(figures.minute));
                    }
                }
            }
            for sample in &figures.depth {
                if partition.is_none_or(|p| p == sample.partition) {
                    keep_latest(&mut samples, figures.minute, sample);
                }
            }
        }
        carry_depth(&mut minutes, now, samples);
        self.count_now(&mut minutes, partition);
        minutes
    }

    /// Every partition's hour in brief, in one pass over the reports.
    fn partition_hours(&self) -> Vec<PartitionHour> {
        let (first, now, blank) = self.blank_hour();
        let mut runs: BTreeMap<u32, Vec<HourMinute>> = BTreeMap::new();
        let mut samples: BTreeMap<u32, Samples> = BTreeMap::new();
        for (figures, at) in self.report_minutes(first, blank.len()) {
            for r in &figures.partitions {
                runs.entry(r.partition).or_insert_with(|| blank.clone())[at]
                    .figures
                    .add(&r.figures(figures.minute));
            }
            for sample in &figures.depth {
                keep_latest(
                    samples.entry(sample.partition).or_default(),
                    figures.minute,
                    sample,
                );
            }
        }
        self.partitions
            .iter()
            .map(|view| {
                let p = view.partition;
                let mut minutes = runs.remove(&p).unwrap_or_else(|| blank.clone());
                carry_depth(&mut minutes, now, samples.remove(&p).unwrap_or_default());
                self.count_now(&mut minutes, Some(p));
                PartitionHour {
                    partition: p,
                    total: HourMinute::sum_of(&minutes),
                    handled: minutes.iter().map(HourMinute::handled).collect(),
                }
            })
            .collect()
    }

    /// The hour's first minute, the current one, and a blank minute for each.
    fn blank_hour(&self) -> (u64, u64, Vec<HourMinute>) {
        let now = self.now_ms / 60_000;
        let first = (now + 1).saturating_sub(HOUR_MINUTES);
        let minutes = (first..=now).map(HourMinute::at).collect();
        (first, now, minutes)
    }

    /// Every report's minutes within the hour, with their place in it.
    fn report_minutes(
        &self,
        first: u64,
        len: usize,
    ) -> impl Iterator<Item = (&crate::queue::MinuteFigures, usize)> {
        self.hour_reports
            .iter()
            .flat_map(|report| &report.minutes)
            .filter_map(move |figures| {
                let at = figures.minute.checked_sub(first)? as usize;
                (at < len).then_some((figures, at))
            })
    }

    /// The current minute's depth: what this overview counted itself.
    fn count_now(&self, minutes: &mut [HourMinute], partition: Option<u32>) {
        let Some(current) = minutes.last_mut() else {
            return;
        };
        for view in &self.partitions {
            if partition.is_none_or(|p| p == view.partition) {
                current.add_depth(view.due_now.value, view.due_now.more, view.oldest_late_s);
            }
        }
    }

    fn with_hour(mut self) -> Self {
        self.hour = self.hour_of(None);
        self.partition_hours = self.partition_hours();
        self
    }
}

/// Depth samples by (minute, partition).
type Samples = BTreeMap<(u64, u32), crate::queue::DepthSample>;

/// Keeps the later of two samples of one partition in one minute.
fn keep_latest(samples: &mut Samples, minute: u64, sample: &crate::queue::DepthSample) {
    let entry = samples.entry((minute, sample.partition)).or_insert(*sample);
    if sample.at_ms > entry.at_ms {
        *entry = *sample;
    }
}

/// Each past minute's depth: every partition's last count at or before it (a worker samples at
/// most `DEPTH_PARTITIONS` of its partitions a minute, so a count carries forward).
fn carry_depth(minutes: &mut [HourMinute], now: u64, samples: Samples) {
    let mut last: BTreeMap<u32, crate::queue::DepthSample> = BTreeMap::new();
    let mut samples = samples.into_iter().peekable();
    for slot in minutes.iter_mut().filter(|m| m.minute < now) {
        while let Some(((_, partition), sample)) =
            samples.next_if(|((minute, _), _)| *minute <= slot.minute)
        {
            last.insert(partition, sample);
        }
        for sample in last.values() {
            slot.add_depth(sample.due, sample.more, sample.oldest_late_s);
        }
    }
}

/// How long after its last write a worker's report is still shown.
pub const REPORT_SHOWN: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// How many worker reports an overview reads at most.
pub const REPORTS_READ: usize = 256;

/// How many minutes of throughput an overview shows.
pub const THROUGHPUT_MINUTES: u64 = 5;

/// A queue's overview: per partition, pending work due now and later (bounded counts), the
/// oldest due time and how late it is, and the lease; completed rows in the retention window
/// and per minute; cluster members and coordinator. Reads one transaction; its cost is bounded
/// by partitions × 2 counts of at most [`COUNT_BOUND`] keys.
pub async fn queue_overview<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
) -> TitoResult<QueueOverview> {
    let overview = read_only(db, async |tx| overview_in(tx, topic).await).await?;
    with_cluster_and_limits(db, topic, overview).await
}

/// A queue's overview, its page of pending rows of one partition and its page of completed rows
/// read in one transaction, so the three agree: a pending row's failed attempt is never shown
/// beside a partition that, read a moment earlier, no worker had leased yet. `partition` is the
/// one asked for, else the one with the most work due; `limit` bounds both pages (1 to
/// [`MAX_PAGE_LIMIT`]). A store without the queue is [`TitoError::NotFound`]; a partition the
/// queue does not have is refused. Cluster members and limit usage are read after, as
/// [`queue_overview`] reads them.
pub async fn queue_view<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    partition: Option<u32>,
    pending_cursor: Option<&str>,
    completed_cursor: Option<&str>,
    limit: usize,
) -> TitoResult<QueueView> {
    let limit = check_limit(limit)?;
    let view = read_only(db, async |tx| {
        let overview = overview_in(tx, topic).await?;
        let Some(partitions) = overview.info.partitions else {
            return Err(TitoError::NotFound(format!(
                "no queue {:?} in this store",
                overview.info.label
            )));
        };
        let partition = match partition {
            Some(p) if p >= partitions => {
                return Err(crate::queue::no_such_partition(
                    &keys::queue_root(topic),
                    partitions,
                    p,
                ));
            }
            Some(p) => p,
            None => overview
                .partitions
                .iter()
                .max_by_key(|p| {
                    (
                        p.due_now.value,
                        p.future.value,
                        std::cmp::Reverse(p.partition),
                    )
                })
                .map_or(0, |p| p.partition),
        };
        let pending = queue_scan_in(
            tx,
            topic,
            QueueState::Pending(partition),
            pending_cursor,
            limit,
        )
        .await?;
        let completed =
            queue_scan_in(tx, topic, QueueState::Completed, completed_cursor, limit).await?;
        Ok(QueueView {
            overview,
            partition,
            pending,
            completed,
        })
    })
    .await?;
    let overview = with_cluster_and_limits(db, topic, view.overview).await?;
    Ok(QueueView { overview, ..view })
}

/// What [`queue_view`] reads: one snapshot of a queue's page.
#[derive(Clone, Debug)]
pub struct QueueView {
    /// The queue's overview.
    pub overview: QueueOverview,
    /// The partition whose pending rows are listed.
    pub partition: u32,
    /// A page of that partition's pending rows, in due order.
    pub pending: TitoPage<QueueRow>,
    /// A page of the completed rows, newest first.
    pub completed: TitoPage<QueueRow>,
}

/// Adds cluster members, the coordinator and limit usage to an overview (each read in its own
/// transaction).
async fn with_cluster_and_limits<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    mut overview: QueueOverview,
) -> TitoResult<QueueOverview> {
    if let Some(partitions) = overview.info.partitions {
        let mut config = crate::QueueConfig::new(partitions, std::time::Duration::from_secs(60));
        config.topic = topic.map(str::to_string);
        let state = crate::queue::cluster_state(&crate::Queue::new(db.clone(), config)).await?;
        overview.members = state.members;
        overview.coordinator = state.coordinator;
        overview.limits = crate::queue::limit_usage(db, topic).await?;
    }
    Ok(overview)
}

/// The overview's figures read in `tx` (members and limits left empty).
async fn overview_in<X: TitoTransaction>(tx: &X, topic: Option<&str>) -> TitoResult<QueueOverview> {
    let root = keys::queue_root(topic);
    let now_ms = engine::version_millis(tx.start_version());
    let now_s = now_ms / 1000;
    let count = partitions_of(tx, &root).await?;
    let info = QueueInfo {
        topic: topic.map(str::to_string),
        label: crate::telemetry::queue_label(topic),
        partitions: count,
    };
    let mut partitions = Vec::new();
    let (mut due_now, mut future) = (Count::default(), Count::default());
    let mut oldest_due: Option<u64> = None;
    for partition in 0..count.unwrap_or(0) {
        let prefix = keys::pending_partition_prefix(&root, partition);
        let end = keys::prefix_end(prefix.clone());
        // Due now: due time at or before this second.
        let boundary = keys::pending_bucket_prefix(&root, partition, now_s + 1);
        let now_count = count_in(tx, prefix.as_bytes(), boundary.as_bytes(), COUNT_BOUND).await?;
        let later = count_in(tx, boundary.as_bytes(), end.as_bytes(), COUNT_BOUND).await?;
        let first = tx.scan(prefix.as_bytes(), end.as_bytes(), 1).await?;
        // The first row is the next to run; its own due time (its key's is less a
        // urgency's boost).
        let oldest = first.first().and_then(|(key, value)| {
            if let Ok(stored) = StoredEvent::parse(value) {
                return Some(stored.timestamp.max(0) as u64);
            }
            let text = keys::key_str(key).ok()?;
            keys::parse_pending_key(&root, text)
                .ok()
                .map(|k| k.timestamp)
        });
        let lease = lease_of(tx, &root, partition).await?;
        add(&mut due_now, now_count);
        add(&mut future, later);
        if let Some(due) = oldest {
            oldest_due = Some(oldest_due.map_or(due, |o| o.min(due)));
        }
        partitions.push(PartitionView {
            partition,
            due_now: now_count,
            future: later,
            oldest_due: oldest,
            oldest_late_s: oldest.map_or(0, |due| now_s.saturating_sub(due)),
            lease,
        });
    }
    let completed_prefix = keys::completed_prefix(&root);
    let completed_end = keys::prefix_end(completed_prefix.clone());
    let completed = count_in(
        tx,
        completed_prefix.as_bytes(),
        completed_end.as_bytes(),
        COUNT_BOUND,
    )
    .await?;
    let dead_prefix = keys::dead_prefix(&root);
    let dead_end = keys::prefix_end(dead_prefix.clone());
    let dead = count_in(tx, dead_prefix.as_bytes(), dead_end.as_bytes(), COUNT_BOUND).await?;
    let paused = crate::queue::read_paused(tx, &root).await?;
    let (workers, handlers, hour_reports) = worker_reports(tx, &root, now_ms).await?;
    let minute_start = now_s - now_s % 60;
    let mut completed_per_minute = Vec::new();
    for minute in 0..THROUGHPUT_MINUTES {
        let from_s = minute_start.saturating_sub(60 * minute);
        let to = if minute == 0 {
            completed_end.clone()
        } else {
            let to_s = from_s + 60;
            keys::completed_before(&root, engine::version_from_millis(to_s * 1000))
        };
        let from = keys::completed_before(&root, engine::version_from_millis(from_s * 1000));
        completed_per_minute.push(count_in(tx, from.as_bytes(), to.as_bytes(), COUNT_BOUND).await?);
    }
    Ok(QueueOverview {
        info,
        now_ms,
        partitions,
        due_now,
        future,
        oldest_due,
        completed,
        dead,
        paused,
        limits: crate::queue::LimitUsage::default(),
        completed_per_minute,
        members: Vec::new(),
        coordinator: None,
        workers,
        handlers,
        hour: Vec::new(),
        partition_hours: Vec::new(),
        hour_reports,
    }
    .with_hour())
}

/// The reports written within [`REPORT_SHOWN`] of `now_ms`, newest first, their handler
/// figures of the last [`THROUGHPUT_MINUTES`] minutes summed, and every report read (for the
/// hour). A report that does not parse is left out.
async fn worker_reports<X: TitoTransaction>(
    tx: &X,
    root: &str,
    now_ms: u64,
) -> TitoResult<(
    Vec<crate::queue::WorkerReport>,
    crate::queue::MinuteFigures,
    Vec<crate::queue::WorkerReport>,
)> {
    let prefix = crate::queue::report_prefix(root);
    let end = keys::prefix_end(prefix.clone());
    let shown_ms = REPORT_SHOWN.as_millis() as u64;
    let mut all: Vec<crate::queue::WorkerReport> = tx
        .scan(prefix.as_bytes(), end.as_bytes(), REPORTS_READ)
        .await?
        .into_iter()
        .filter_map(|(_, value)| serde_json::from_slice(&value).ok())
        .collect();
    all.sort_by_key(|r| std::cmp::Reverse(r.written_ms));
    let reports: Vec<crate::queue::WorkerReport> = all
        .iter()
        .filter(|r| now_ms.saturating_sub(r.written_ms) <= shown_ms)
        .cloned()
        .collect();
    let since = (now_ms / 60_000).saturating_sub(THROUGHPUT_MINUTES - 1);
    let mut handlers = crate::queue::MinuteFigures {
        minute: since,
        ..Default::default()
    };
    for report in &reports {
        handlers.add(&report.since(since));
    }
    Ok((reports, handlers, all))
}

fn add(total: &mut Count, part: Count) {
    total.value += part.value;
    total.more |= part.more;
}

async fn lease_of<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: u32,
) -> TitoResult<Option<LeaseView>> {
    let keys = [
        keys::lease_key(root, partition).into_bytes(),
        keys::lease_expiry_key(root, partition).into_bytes(),
    ];
    let values = tx.batch_get(&keys).await?;
    let Some((lease, expires)) =
        crate::queue::lease::holder_of(values[0].as_deref(), values[1].as_deref())
    else {
        return Ok(None);
    };
    Ok(Some(LeaseView {
        holder: lease.owner,
        generation: lease.generation,
        expires_ms: if expires == 0 {
            0
        } else {
            engine::version_millis(expires)
        },
    }))
}

/// Which rows of a queue a scan reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueState {
    /// A partition's pending invocations, by due time then enqueue order.
    Pending(u32),
    /// Completed invocations, most recently processed first.
    Completed,
}

/// An invocation as stored.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventView {
    /// The event id.
    pub id: String,
    /// The event's key (its partition is derived from it).
    pub key: String,
    /// Its due time (Unix s).
    pub timestamp: i64,
    /// Its owner, if any.
    pub owner: Option<QueueOwner>,
    /// Its payload.
    pub payload: Value,
    /// Why it was cancelled, for a completed row of a cancelled invocation.
    pub cancelled: Option<String>,
    /// Its urgency (0 to 9; higher runs first).
    pub urgency: u8,
    /// The attempt its next (or, for a completed row, its last) delivery is, from 1: its
    /// failed attempts so far plus one.
    pub attempt: u32,
    /// The error of its last failed attempt, if one failed (under a failure policy).
    pub last_error: Option<String>,
}

/// One row of a queue scan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueRow {
    /// The storage key (UTF-8; a key that is not is shown escaped).
    pub key: String,
    /// The partition (pending rows).
    pub partition: Option<u32>,
    /// When it is due (Unix s) for pending rows: the row's own due time (from the key when the
    /// row does not decode).
    pub due: Option<u64>,
    /// When it completed (engine time, Unix ms) for completed rows, from the key.
    pub processed_ms: Option<u64>,
    /// The invocation, when the row decodes.
    pub event: Option<EventView>,
    /// Why the row does not decode, when it does not.
    pub malformed: Option<String>,
    /// The raw value, for rows that do not decode (as stored; shown lossily as text).
    pub raw: Option<String>,
    /// A worker's note that this pending row does not decode as its handler's event type: the
    /// row waits for a worker of the right type, or for [`crate::Queue::set_aside`].
    pub undecodable: Option<UndecodableNote>,
}

/// Up to `limit` pending and completed rows of one owner (by its owner keys), with their values.
async fn owned_rows<E: TitoEngine>(
    db: &E,
    root: &str,
    kind: &str,
    owner: &str,
    limit: usize,
) -> TitoResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let prefix = keys::owner_prefix(root, kind, owner);
    let end = keys::prefix_end(prefix.clone());
    read_only(db, async |tx| {
        let mut targets = Vec::new();
        for (key, _) in tx.scan(prefix.as_bytes(), end.as_bytes(), limit).await? {
            let Ok(text) = keys::key_str(&key) else {
                continue;
            };
            let state = text[prefix.len()..].split(':').next().unwrap_or_default();
            if state == keys::OWNER_DEAD {
                continue;
            }
            if let Ok(target) = keys::owner_key_target(text) {
                targets.push(target.into_bytes());
            }
        }
        let values = tx.batch_get(&targets).await?;
        Ok(targets
            .into_iter()
            .zip(values)
            .filter_map(|(key, value)| value.map(|v| (key, v)))
            .collect())
    })
    .await
}

/// A page of a queue's pending rows of one partition (in due order) or of its completed rows
/// (newest first), at most `limit` (1 to [`MAX_PAGE_LIMIT`]), continuing from `cursor`.
/// Malformed rows are returned with their raw bytes, never skipped. A partition the queue does
/// not have is refused, naming the queue and its partitions (as [`crate::queue::pause`] does).
pub async fn queue_scan<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    state: QueueState,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<QueueRow>> {
    let limit = check_limit(limit)?;
    read_only(db, async |tx| {
        if let QueueState::Pending(partition) = state {
            let root = keys::queue_root(topic);
            if let Some(count) = partitions_of(tx, &root).await?
                && partition >= count
            {
                return Err(crate::queue::no_such_partition(&root, count, partition));
            }
        }
        queue_scan_in(tx, topic, state, cursor, limit).await
    })
    .await
}

/// [`queue_scan`] in `tx`.
async fn queue_scan_in<X: TitoTransaction>(
    tx: &X,
    topic: Option<&str>,
    state: QueueState,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<QueueRow>> {
    let root = keys::queue_root(topic);
    let (prefix, reverse) = match state {
        QueueState::Pending(partition) => (keys::pending_partition_prefix(&root, partition), false),
        QueueState::Completed => (keys::completed_prefix(&root), true),
    };
    let page = raw_page_in(tx, &prefix, reverse, cursor, limit).await?;
    let mut items: Vec<QueueRow> = page
        .items
        .into_iter()
        .map(|(key, value)| queue_row(&root, state, &key, &value))
        .collect();
    if let QueueState::Pending(_) = state
        && !items.is_empty()
    {
        // Workers' notes of rows they cannot decode, in one read.
        let notes: Vec<Vec<u8>> = items
            .iter()
            .map(|row| {
                keys::undecodable_key(&root, &row.key)
                    .unwrap_or_default()
                    .into_bytes()
            })
            .collect();
        let found = tx.batch_get(&notes).await?;
        for (row, note) in items.iter_mut().zip(found) {
            row.undecodable = note.and_then(|bytes| serde_json::from_slice(&bytes).ok());
        }
    }
    Ok(TitoPage {
        items,
        cursor: page.cursor,
    })
}

/// The invocations of the queue named `topic` a search finds, whatever their partition: the
/// one whose event id is `text` (pending or completed); for a `text` written `kind:id`, that
/// owner's pending and completed invocations (at most `limit`); and the pending ones whose
/// business key is `text` (read from the key's own partition, at most `limit` rows, 1 to
/// [`MAX_PAGE_LIMIT`]). An empty text finds nothing.
pub async fn queue_find<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    text: &str,
    limit: usize,
) -> TitoResult<Vec<QueueRow>> {
    let limit = check_limit(limit)?;
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let root = keys::queue_root(topic);
    let mut found = Vec::new();
    // By event id: its live invocation's key, then the row.
    let id_key = keys::event_id_key(&root, text);
    let row = read_only(db, async |tx| {
        let Some(key) = tx.get(id_key.as_bytes()).await? else {
            return Ok(None);
        };
        let value = tx.get(&key).await?;
        Ok(value.map(|value| (key, value)))
    })
    .await?;
    if let Some((key, value)) = row {
        let pending = key.starts_with(format!("{root}:pending:").as_bytes());
        let state = if pending {
            QueueState::Pending(0)
        } else {
            QueueState::Completed
        };
        found.push(queue_row(&root, state, &key, &value));
    }
    // By owner, written `kind:id`: the owner's pending and completed invocations.
    if let Some((kind, owner)) = text.split_once(':')
        && !kind.is_empty()
        && !owner.is_empty()
    {
        for (key, value) in owned_rows(db, &root, kind, owner, limit).await? {
            if !found.iter().any(|f| f.key.as_bytes() == key.as_slice()) {
                let state = if key.starts_with(format!("{root}:pending:").as_bytes()) {
                    QueueState::Pending(0)
                } else {
                    QueueState::Completed
                };
                found.push(queue_row(&root, state, &key, &value));
            }
        }
    }
    // By business key: the pending rows of its partition that carry it.
    let Some(partitions) = queues(db, MAX_PAGE_LIMIT)
        .await?
        .into_iter()
        .find(|q| q.topic.as_deref() == topic)
        .and_then(|q| q.partitions)
    else {
        return Ok(found);
    };
    let partition = crate::event::partition_for(text, partitions);
    let mut cursor = None;
    let mut read = 0;
    while read < limit {
        let page = queue_scan(
            db,
            topic,
            QueueState::Pending(partition),
            cursor.as_deref(),
            (limit - read).min(MAX_PAGE_LIMIT),
        )
        .await?;
        read += page.items.len();
        for row in page.items {
            let holds = row.event.as_ref().is_some_and(|e| e.key == text);
            if holds && !found.iter().any(|f| f.key == row.key) {
                found.push(row);
            }
        }
        match page.cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    Ok(found)
}

/// A row moved aside ([`crate::Queue::set_aside`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AsideRow {
    /// Its key under `{queue}:aside:`.
    pub key: String,
    /// Why it was moved aside, and the row as it was; `None` when the record does not decode.
    pub record: Option<AsideRecord>,
    /// The raw value, when the record does not decode.
    pub raw: Option<String>,
}

/// A page of the rows a queue moved aside, in key order (partition, due time), at most `limit`
/// (1 to [`MAX_PAGE_LIMIT`]), continuing from `cursor`.
pub async fn queue_aside<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<AsideRow>> {
    let limit = check_limit(limit)?;
    let root = keys::queue_root(topic);
    let page = raw_page(db, &keys::aside_prefix(&root), false, cursor, limit).await?;
    let items = page
        .items
        .into_iter()
        .map(|(key, value)| {
            let record: Option<AsideRecord> = serde_json::from_slice(&value).ok();
            AsideRow {
                key: keys::key_text(&key),
                raw: record
                    .is_none()
                    .then(|| String::from_utf8_lossy(&value).into_owned()),
                record,
            }
        })
        .collect();
    Ok(TitoPage {
        items,
        cursor: page.cursor,
    })
}

fn queue_row(root: &str, state: QueueState, key: &[u8], value: &[u8]) -> QueueRow {
    let text = keys::key_text(key);
    let (mut partition, mut due, mut processed_ms) = (None, None, None);
    let mut problems = Vec::new();
    match state {
        QueueState::Pending(_) => match keys::parse_pending_key(root, &text) {
            Ok(parsed) => {
                partition = Some(parsed.partition);
                due = Some(parsed.timestamp);
            }
            Err(err) => problems.push(err.to_string()),
        },
        QueueState::Completed => {
            let rest = text
                .strip_prefix(&keys::completed_prefix(root))
                .unwrap_or_default();
            match rest.split(keys::SEPARATOR).next().map(str::parse::<u64>) {
                Some(Ok(version)) => processed_ms = Some(engine::version_millis(version)),
                _ => problems.push(format!("completed key {text:?} has no processed time")),
            }
        }
    }
    let event = match StoredEvent::parse(value) {
        Ok(stored) => Some(EventView {
            id: stored.id,
            key: stored.key,
            timestamp: stored.timestamp,
            owner: stored.owner,
            payload: stored.payload,
            cancelled: stored.cancelled,
            urgency: stored.urgency,
            attempt: stored.failures.saturating_add(1),
            last_error: stored.last_error,
        }),
        Err(err) => {
            problems.push(err.to_string());
            None
        }
    };
    // A pending key orders the row by its due time less its urgency's boost: the row's own
    // due time is the one shown.
    if let (Some(_), Some(event)) = (due, &event) {
        due = Some(event.timestamp.max(0) as u64);
    }
    let malformed = (!problems.is_empty()).then(|| problems.join("; "));
    QueueRow {
        raw: malformed
            .is_some()
            .then(|| String::from_utf8_lossy(value).into_owned()),
        key: text,
        partition,
        due,
        processed_ms,
        event,
        malformed,
        undecodable: None,
    }
}

/// One page of raw `(key, value)` pairs under `prefix`.
async fn raw_page<E: TitoEngine>(
    db: &E,
    prefix: &str,
    reverse: bool,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<(Vec<u8>, Vec<u8>)>> {
    read_only(db, async |tx| {
        raw_page_in(tx, prefix, reverse, cursor, limit).await
    })
    .await
}

/// [`raw_page`] in `tx`.
async fn raw_page_in<X: TitoTransaction>(
    tx: &X,
    prefix: &str,
    reverse: bool,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<(Vec<u8>, Vec<u8>)>> {
    let mut start = prefix.as_bytes().to_vec();
    let mut end = keys::prefix_end(prefix.to_string()).into_bytes();
    let cursors = narrow_to_cursor(&mut start, &mut end, reverse, cursor)?;
    let mut rows = if reverse {
        tx.scan_reverse(&start, &end, limit + 1).await?
    } else {
        tx.scan(&start, &end, limit + 1).await?
    };
    let more = rows.len() > limit;
    rows.truncate(limit);
    let cursor = if more {
        rows.last().map(|(k, _)| cursors.encode(k))
    } else {
        None
    };
    Ok(TitoPage {
        items: rows,
        cursor,
    })
}

// ---------------------------------------------------------------------------------------------
// Tables
// ---------------------------------------------------------------------------------------------

/// The tables of a store that hold rows, in name order, at most `limit`.
pub async fn tables<E: TitoEngine>(db: &E, limit: usize) -> TitoResult<Vec<String>> {
    let limit = check_limit(limit)?;
    read_only(db, async |tx| {
        let names = distinct_segments(tx, "table:", limit).await?;
        Ok(names
            .iter()
            .filter_map(|encoded| keys::decode_str(encoded).ok())
            .collect())
    })
    .await
}

/// A table row as stored.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RawRow {
    /// Its id, from the key (`None` when the key does not decode).
    pub id: Option<String>,
    /// The storage key.
    pub key: String,
    /// The row, when it is JSON (as stored: a row of an older shape version is not converted).
    pub value: Option<Value>,
    /// The raw bytes as text, when it is not.
    pub raw: Option<String>,
    /// The row's shape version ([`crate::model::shape`]: 1 for a row without a version header;
    /// 0 when the header is malformed).
    pub version: u32,
}

fn raw_row(table: &str, key: &[u8], value: &[u8]) -> RawRow {
    let text = keys::key_text(key);
    let (version, json) = crate::model::shape::split(value).unwrap_or((0, value));
    let parsed = serde_json::from_slice::<Value>(json).ok();
    RawRow {
        id: keys::row_key_id(&text, table),
        key: text,
        version,
        raw: parsed
            .is_none()
            .then(|| String::from_utf8_lossy(value).into_owned()),
        value: parsed,
    }
}

/// A page of a table's rows in id order.
pub async fn table_rows<E: TitoEngine>(
    db: &E,
    table: &str,
    cursor: Option<&str>,
    limit: usize,
) -> TitoResult<TitoPage<RawRow>> {
    let limit = check_limit(limit)?;
    let page = raw_page(db, &keys::table_prefix(table), false, cursor, limit).await?;
    Ok(TitoPage {
        items: page
            .items
            .iter()
            .map(|(k, v)| raw_row(table, k, v))
            .collect(),
        cursor: page.cursor,
    })
}

/// One row of a table by id, as stored.
pub async fn table_row<E: TitoEngine>(db: &E, table: &str, id: &str) -> TitoResult<Option<RawRow>> {
    let key = keys::row_key(table, id);
    read_only(db, async |tx| {
        Ok(tx
            .get(key.as_bytes())
            .await?
            .map(|value| raw_row(table, key.as_bytes(), &value)))
    })
    .await
}

/// A table's row count, up to [`COUNT_BOUND`].
pub async fn table_count<E: TitoEngine>(db: &E, table: &str) -> TitoResult<Count> {
    count_prefix(db, &keys::table_prefix(table), COUNT_BOUND).await
}

// ---------------------------------------------------------------------------------------------
// Key/value namespaces
// ---------------------------------------------------------------------------------------------

/// The kv namespaces that hold keys (expired ones included until swept), at most `limit`.
pub async fn kv_namespaces<E: TitoEngine>(db: &E, limit: usize) -> TitoResult<Vec<String>> {
    let limit = check_limit(limit)?;
    read_only(db, async |tx| {
        let names = distinct_segments(tx, "kv:", limit).await?;
        Ok(names
            .iter()
            .filter_map(|encoded| keys::decode_str(encoded).ok())
            .collect())
    })
    .await
}

/// A namespace's stored keys (expired ones included until swept), up to [`COUNT_BOUND`].
pub async fn kv_count<E: TitoEngine>(db: &E, namespace: &str) -> TitoResult<Count> {
    count_prefix(db, &keys::kv_namespace_prefix(namespace), COUNT_BOUND).await
}

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

/// The key under which an inbox row of `table` that cannot be read is noted (set aside, out of
/// every claim), as the dashboard and `tito inbox dead` show it.
pub fn inbox_bad_key(table: &str, id: &str) -> String {
    keys::inbox_bad_key(table, id)
}

/// A storage key shown as its segments, each decoded from its string encoding where it is
/// one (numbers stay as their digits). The key is given as it is, or in the quoted form keys
/// are printed in (`"\xff\u{1}k"`); a segment that is not UTF-8 text (no key Tito
/// writes has one) is shown in that quoted form.
///
/// ```
/// // The row key of id `a:1` in table `user` (`:` and the digit escaped in the segment).
/// let key = "table:user:a;<;1";
/// assert_eq!(tito::inspect::key_segments(key.as_bytes()).unwrap(), ["table", "user", "a:1"]);
/// // A key that is not UTF-8 text, as other commands print it.
/// let printed = r#""table:\xff\u{1}k""#;
/// assert_eq!(tito::inspect::key_segments(printed.as_bytes()).unwrap(), ["table", r#""\xff\u{1}k""#]);
/// ```
pub fn key_segments(key: &[u8]) -> TitoResult<Vec<String>> {
    // The quoted form the other commands print a key in (`"\xff..."`), or the key itself.
    let owned = std::str::from_utf8(key)
        .ok()
        .and_then(keys::parse_display_key);
    let key = owned.as_deref().unwrap_or(key);
    // Split on the separator's byte (ASCII, so never part of a longer UTF-8 character): a
    // text key splits as `keys::segments` splits it.
    Ok(key
        .split(|&byte| byte == keys::SEPARATOR as u8)
        .map(|segment| match std::str::from_utf8(segment) {
            Ok(text) => keys::decode_str(text).unwrap_or_else(|_| text.to_string()),
            Err(_) => keys::display_key(segment),
        })
        .collect())
}
