//! The fair cursor over one partition's pending rows.
//!
//! A pass starts by freezing two things: the runnable boundary (the engine's current time in
//! seconds: rows due at or before it are runnable) and the version horizon (the engine's current
//! version). Rows are keyed by their due time less their priority's boost
//! ([`crate::queue::PRIORITY_STEP`] per step); a row whose own due time is still past the
//! boundary is stepped over, and its due time bounds the wait before the next pass. The pass then walks rows in key order (due time, then enqueue version) in scans of
//! at most [`SCAN_ROWS`] rows. A row enqueued at or after the horizon (for example one a handler
//! just created for "now") makes the cursor jump past its whole due-time bucket, so newly created
//! same-time work can never keep later buckets waiting. Malformed rows are counted, logged, left
//! in place and stepped over. When a scan finds nothing more, the pass is over; the next pull
//! starts a new pass from the oldest runnable row.

use crate::engine::{self, TitoTransaction};
use crate::error::TitoResult;
use crate::keys::{self, PendingKey};

use super::QueueCounters;
use crate::event::StoredEvent;

/// At most this many rows per storage scan.
pub const SCAN_ROWS: usize = 16;

/// One runnable invocation.
#[derive(Clone, Debug)]
pub(crate) struct Pulled {
    pub key: String,
    pub parsed: PendingKey,
    pub stored: StoredEvent,
}

#[derive(Debug)]
struct Pass {
    boundary: u64,
    horizon: u64,
    next: Vec<u8>,
    /// The earliest own due time of rows the pass stepped over because a priority orders them
    /// before it.
    early: Option<u64>,
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

    /// Pulls up to `want` runnable invocations that are not `in_flight`.
    pub async fn pull<X: TitoTransaction>(
        &mut self,
        tx: &X,
        root: &str,
        want: usize,
        skip: &(dyn Fn(&str) -> bool + Sync),
        stats: &QueueCounters,
    ) -> TitoResult<PullResult> {
        let mut result = PullResult {
            now_ms: engine::version_millis(tx.start_version()),
            ..PullResult::default()
        };
        let partition_prefix = keys::pending_partition_prefix(root, self.partition);
        while result.items.len() < want {
            let pass = self.pass.get_or_insert_with(|| Pass {
                boundary: engine::version_millis(tx.start_version()) / 1000,
                horizon: tx.start_version(),
                next: partition_prefix.clone().into_bytes(),
                early: None,
            });
            let end = keys::pending_bucket_prefix(root, self.partition, pass.boundary + 1);
            let rows = tx.scan(&pass.next, end.as_bytes(), SCAN_ROWS).await?;
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
                if parsed.version >= pass.horizon {
                    // Enqueued during this pass: skip the rest of its due-time bucket.
                    let bucket =
                        keys::pending_bucket_prefix(root, self.partition, parsed.timestamp);
                    pass.next = keys::prefix_end(bucket).into_bytes();
                    break;
                }
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
                // A priority orders a row before its own due time: it is not runnable yet.
                let due = stored.timestamp.max(0) as u64;
                if due > pass.boundary {
                    pass.early = Some(pass.early.map_or(due, |e| e.min(due)));
                    continue;
                }
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
    tracing::warn!(key = %keys::display_key(key), why, "malformed pending queue row left in place");
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
