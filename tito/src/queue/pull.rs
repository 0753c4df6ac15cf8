//! The fair cursor over one partition's pending rows.
//!
//! A pass starts by freezing two things: the runnable boundary (the engine's current time in
//! seconds: rows due at or before it are runnable) and the version horizon (the engine's current
//! version). Rows are keyed by their due time less their urgency's boost
//! ([`crate::queue::URGENCY_STEP`] per step); a row whose own due time is still past the
//! boundary is stepped over, and its due time bounds the wait before the next pass. The pass
//! then walks rows in key order (due time, then enqueue version) in scans of the rows it still
//! wants (at least [`SCAN_ROWS`], at most [`MAX_SCAN_ROWS`]). A row enqueued at or after the horizon (for example one a handler just
//! created for "now") in a bucket the pass served at its urgency is stepped over, so newly
//! created same-time work can never keep later buckets waiting. Malformed rows are counted, logged, left
//! in place and stepped over. When a scan finds nothing more, the pass is over.
//!
//! The cursor also goes back to the front at a pull when that is cheap: when the rows it would
//! read again (those it passed over, and those of the partition still in flight or cooling) are
//! at most [`RESTART_BUDGET`]. So a row that sorts before the cursor (a more urgent row
//! published meanwhile, by this process or another; a row that waited for a concurrency slot)
//! is seen at the next pull. Going back keeps the pass (its horizon, and the buckets it
//! returned rows of, each with the highest urgency it returned there): a row created during
//! the pass is skipped only when the pass already served its bucket at its urgency or a higher
//! one, so work a handler re-creates for a time already served still waits for the next pass,
//! while new work at another time, or more urgent than what the pass served in its bucket (a
//! high urgency whose ordering time falls on a served second), does not: urgency wins, and the
//! fairness rule is for rows of equal urgency. The runnable boundary moves on to the pull's
//! time. When the front is crowded with rows that cannot run (a backlog waiting for one key's
//! slot, rows no worker can decode, many not yet due), the cursor goes on past them and goes
//! back at the latest [`MAX_PASS_AGE`] after it last did; meanwhile every pull also reads one
//! scan of the front, which finds rows published there since the pass began (a higher
//! urgency) in a bucket the pass has not served.

use std::time::Duration;

use tokio::time::Instant;

use crate::engine::{self, TitoTransaction};
use crate::error::TitoResult;
use crate::keys::{self, PendingKey};

use super::QueueCounters;
use crate::event::StoredEvent;

/// At least this many rows per storage scan (a pull that wants more reads up to what it wants,
/// at most [`MAX_SCAN_ROWS`]: on TiKV each scan is a round trip).
pub const SCAN_ROWS: usize = 16;

/// At most this many rows per storage scan.
pub const MAX_SCAN_ROWS: usize = 256;

/// The cursor goes back to the front of its partition at a pull when at most this many rows
/// before it would be read again.
pub const RESTART_BUDGET: usize = 64;

/// The longest the cursor goes on before it goes back to the front of its partition.
pub const MAX_PASS_AGE: Duration = Duration::from_secs(1);

/// One runnable invocation.
#[derive(Clone, Debug)]
pub(crate) struct Pulled {
    pub key: String,
    pub parsed: PendingKey,
    pub stored: StoredEvent,
}

#[derive(Debug)]
struct Pass {
    /// Rows due at or before it (Unix s) are runnable; moved on when the cursor goes back to
    /// the front.
    boundary: u64,
    /// Rows enqueued at or after it were created during the pass.
    horizon: u64,
    next: Vec<u8>,
    /// The earliest own due time of rows the pass stepped over because an urgency orders them
    /// before it.
    early: Option<u64>,
    /// Rows read since the cursor last went back to the front and not started (stepped over,
    /// malformed, refused by a limit).
    passed_over: usize,
    /// When the cursor last went back to the front.
    began: Instant,
    /// The ordering buckets (seconds) the pass returned rows of, each with the highest urgency
    /// it returned there: rows created during the pass in one of them wait for the next pass
    /// (the fairness rule) unless they are more urgent than every row the pass returned of
    /// that bucket; past [`MAX_VISITED`] buckets, every bucket up to `visited_below.0` counts
    /// as one, served at urgency `visited_below.1`.
    visited: std::collections::HashMap<u64, u8>,
    visited_below: Option<(u64, u8)>,
}

/// The most buckets a pass remembers one by one.
const MAX_VISITED: usize = 4096;

impl Pass {
    /// Whether a row of `urgency` created during the pass in `bucket` waits for the next pass:
    /// the pass returned a row of that bucket at least as urgent. A more urgent row does not
    /// wait (urgency wins; the fairness rule is for rows of equal urgency).
    fn served(&self, bucket: u64, urgency: u8) -> bool {
        self.visited
            .get(&bucket)
            .is_some_and(|&most| urgency <= most)
            || self
                .visited_below
                .is_some_and(|(below, most)| bucket <= below && urgency <= most)
    }

    fn visit(&mut self, bucket: u64, urgency: u8) {
        if let Some(most) = self.visited.get_mut(&bucket) {
            *most = (*most).max(urgency);
            return;
        }
        if self.visited.len() >= MAX_VISITED {
            let (mut top, mut most) = self.visited_below.unwrap_or((bucket, urgency));
            for (b, u) in self.visited.drain() {
                top = top.max(b);
                most = most.max(u);
            }
            self.visited_below = Some((top.max(bucket), most.max(urgency)));
            return;
        }
        self.visited.insert(bucket, urgency);
    }
}

/// A partition's cursor; executor state only, never stored.
#[derive(Debug)]
pub(crate) struct Cursor {
    partition: u32,
    pass: Option<Pass>,
}

/// What a pull found.
#[derive(Debug, Default)]
pub(crate) struct PullResult {
    pub items: Vec<Pulled>,
    /// The pass ended (nothing more runnable before the next pass).
    pub exhausted: bool,
    /// When the pass ended: the due time (Unix seconds) of the first row after the boundary.
    pub next_due: Option<u64>,
    /// The engine's time (Unix ms) of the pull, to wait for `next_due` by.
    pub now_ms: u64,
}

impl Cursor {
    pub fn new(partition: u32) -> Self {
        Cursor {
            partition,
            pass: None,
        }
    }

    /// Counts rows a pull returned that did not start (a limit refused them): the pass went
    /// past them.
    pub fn passed_over(&mut self, rows: usize) {
        if let Some(pass) = &mut self.pass {
            pass.passed_over = pass.passed_over.saturating_add(rows);
        }
    }

    /// Pulls up to `want` runnable invocations that are not `in_flight`. `behind`: how many of
    /// the partition's rows this worker holds back from starting now (in flight, cooling), which
    /// a new pass would read again.
    pub async fn pull<X: TitoTransaction>(
        &mut self,
        tx: &X,
        root: &str,
        want: usize,
        skip: &(dyn Fn(&str) -> bool + Sync),
        stats: &QueueCounters,
        behind: usize,
    ) -> TitoResult<PullResult> {
        let mut result = PullResult {
            now_ms: engine::version_millis(tx.start_version()),
            ..PullResult::default()
        };
        let partition_prefix = keys::pending_partition_prefix(root, self.partition);
        if let Some(pass) = &mut self.pass
            && (pass.passed_over.saturating_add(behind) <= RESTART_BUDGET
                || pass.began.elapsed() >= MAX_PASS_AGE)
        {
            // Back to the front: what sorts before the cursor now (a more urgent row published
            // meanwhile, a row that waited for a slot) is seen at this pull. The pass keeps its
            // horizon and the buckets it visited, so work it created in them still waits.
            pass.next = partition_prefix.clone().into_bytes();
            pass.boundary = pass
                .boundary
                .max(engine::version_millis(tx.start_version()) / 1000);
            pass.passed_over = 0;
            pass.began = Instant::now();
        } else if let Some(pass) = &mut self.pass {
            // Not back to the front (it is crowded): one scan of the front still finds what
            // was published there since the pass began (a more urgent row), unless the pass
            // already served its bucket.
            let now_s = engine::version_millis(tx.start_version()) / 1000;
            let runnable = pass.boundary.max(now_s);
            let end = keys::pending_bucket_prefix(root, self.partition, runnable + 1);
            let front = tx
                .scan(partition_prefix.as_bytes(), end.as_bytes(), SCAN_ROWS)
                .await?;
            QueueCounters::bump(&stats.scans, 1);
            for (key, value) in front {
                if key >= pass.next || result.items.len() >= want {
                    break;
                }
                let Ok(text) = keys::key_str(&key) else {
                    continue;
                };
                let Ok(parsed) = keys::parse_pending_key(root, text) else {
                    continue;
                };
                if parsed.version < pass.horizon || skip(text) {
                    continue;
                }
                let Ok(stored) = StoredEvent::parse(&value) else {
                    continue;
                };
                if pass.served(parsed.timestamp, stored.urgency)
                    || stored.timestamp.max(0) as u64 > runnable
                {
                    continue;
                }
                pass.visit(parsed.timestamp, stored.urgency);
                result.items.push(Pulled {
                    key: text.to_string(),
                    parsed,
                    stored,
                });
            }
        }
        while result.items.len() < want {
            let pass = self.pass.get_or_insert_with(|| Pass {
                boundary: engine::version_millis(tx.start_version()) / 1000,
                horizon: tx.start_version(),
                next: partition_prefix.clone().into_bytes(),
                early: None,
                passed_over: 0,
                began: Instant::now(),
                visited: Default::default(),
                visited_below: None,
            });
            let end = keys::pending_bucket_prefix(root, self.partition, pass.boundary + 1);
            let limit = (want - result.items.len()).clamp(SCAN_ROWS, MAX_SCAN_ROWS);
            let rows = tx.scan(&pass.next, end.as_bytes(), limit).await?;
            QueueCounters::bump(&stats.scans, 1);
            if rows.is_empty() {
                let early = pass.early;
                self.pass = None;
                result.exhausted = true;
                let after = next_due(tx, root, self.partition, &end).await?;
                result.next_due = match (after, early) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                break;
            }
            for (key, value) in rows {
                pass.next = keys::key_after_bytes(&key);
                // Counted now, taken back below if the row is returned.
                pass.passed_over += 1;
                let Ok(text) = keys::key_str(&key) else {
                    malformed(stats, root, &key, "is not UTF-8");
                    continue;
                };
                let parsed = match keys::parse_pending_key(root, text) {
                    Ok(parsed) => parsed,
                    Err(err) => {
                        malformed(stats, root, &key, &err.to_string());
                        continue;
                    }
                };
                if skip(text) {
                    continue;
                }
                let stored = match StoredEvent::parse(&value) {
                    Ok(stored) => stored,
                    Err(err) => {
                        malformed(stats, root, &key, &err.to_string());
                        continue;
                    }
                };
                if parsed.version >= pass.horizon && pass.served(parsed.timestamp, stored.urgency) {
                    // Enqueued during this pass in a bucket it already served at this urgency
                    // or a higher one: waits for the next pass. (Rows after it in the bucket
                    // were enqueued during the pass too; a more urgent one among them is still
                    // taken.)
                    continue;
                }
                // An urgency orders a row before its own due time: it is not runnable yet.
                let due = stored.timestamp.max(0) as u64;
                if due > pass.boundary {
                    pass.early = Some(pass.early.map_or(due, |e| e.min(due)));
                    continue;
                }
                pass.passed_over -= 1;
                pass.visit(parsed.timestamp, stored.urgency);
                result.items.push(Pulled {
                    key: text.to_string(),
                    parsed,
                    stored,
                });
                if result.items.len() == want {
                    break;
                }
            }
        }
        Ok(result)
    }
}

fn malformed(stats: &QueueCounters, root: &str, key: &[u8], why: &str) {
    QueueCounters::bump(&stats.malformed, 1);
    let label = crate::telemetry::queue_label_of_root(root);
    metrics::counter!(crate::telemetry::names::QUEUE_MALFORMED, "queue" => label).increment(1);
    // Name the row as the user wrote it where its key can be read; the stored key otherwise.
    match std::str::from_utf8(key)
        .ok()
        .and_then(|text| keys::parse_pending_key(root, text).ok())
    {
        Some(parsed) => tracing::warn!(
            queue = %crate::telemetry::queue_label_of_root(root),
            partition = parsed.partition,
            event_id = %parsed.event_id,
            why,
            "malformed pending queue row left in place"
        ),
        None => tracing::warn!(
            queue = %crate::telemetry::queue_label_of_root(root),
            key = %keys::display_key(key),
            why,
            "malformed pending queue row left in place"
        ),
    }
}

/// The due time of the first pending row at or after `from` in the partition.
async fn next_due<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: u32,
    from: &str,
) -> TitoResult<Option<u64>> {
    let end = keys::prefix_end(keys::pending_partition_prefix(root, partition));
    let rows = tx.scan(from.as_bytes(), end.as_bytes(), 1).await?;
    Ok(rows.first().and_then(|(key, _)| {
        let text = keys::key_str(key).ok()?;
        keys::parse_pending_key(root, text)
            .ok()
            .map(|k| k.timestamp)
    }))
}
