//! Helpers for tests of code that publishes and handles events: run a queue until nothing due
//! is left ([`drain`]) and wait for one invocation to settle ([`settled`]), instead of polling
//! with sleeps. They use the real worker, leases and outcomes, on whatever engine the test
//! uses.
//!
//! ```
//! use std::time::Duration;
//! use tito::queue::testing::{Settled, drain, settled};
//! use tito::queue::Topic;
//! use tito::{QueueEvent, QueueHandlerOutcome, TitoError};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), TitoError> {
//! let db = tito::Embedded::temporary().await?;
//! const JOBS: Topic<u32> = Topic::new("jobs");
//! let jobs = JOBS.spec(2, Duration::from_secs(3600)).open(db.clone()).await?;
//! let event = QueueEvent::now("k", 7u32);
//! let id = event.id.clone();
//! jobs.publish(event).await?;
//! let doomed = QueueEvent::now("k", 8u32).with_max_attempts(1);
//! let doomed_id = doomed.id.clone();
//! jobs.publish(doomed).await?;
//! let drained = drain(&jobs, |event: QueueEvent<u32>| async move {
//!     if event.payload == 7 { Ok(QueueHandlerOutcome::Acknowledge) } else { Err(TitoError::handler("no")) }
//! })
//! .await?;
//! assert_eq!((drained.acknowledged, drained.dead, drained.still_due), (1, 1, 0));
//! assert!(matches!(settled(&jobs, &doomed_id, Duration::from_secs(5)).await?, Settled::Dead { attempts: 1, .. }));
//! assert!(matches!(settled(&jobs, &id, Duration::from_secs(5)).await?, Settled::Completed { .. }));
//! # db.close().await
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use super::{Queue, QueueStats, WorkerConfig, WorkerQueue, run_worker};
use crate::engine::{self, TitoEngine, TitoTransaction, read_only};
use crate::error::{TitoError, TitoResult};
use crate::event::{QueueEvent, QueueHandlerResult, StoredEvent};
use crate::keys;

/// How long [`drain`] runs at most.
pub const DRAIN_WITHIN: Duration = Duration::from_secs(10);

/// The most pending rows [`drain`] looks at (a test's queue is small).
pub const MAX_DRAINED_ROWS: usize = 100_000;

/// What [`drain`] did: the handle's counters over the drain, and what is still due.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Invocations handed to the handler.
    pub delivered: u64,
    /// Invocations acknowledged.
    pub acknowledged: u64,
    /// Invocations completed with a replacement or a next step.
    pub rescheduled: u64,
    /// Failed attempts (errors, panics, timeouts).
    pub failed: u64,
    /// Failed attempts a failure policy scheduled again.
    pub retried: u64,
    /// Invocations a failure policy moved to the dead state.
    pub dead: u64,
    /// Pending rows due when the drain ended (rows whose handler fails without a failure
    /// policy stay due: they are counted here once the drain's time is up).
    pub still_due: usize,
}

/// Runs a worker over every partition of `queue` with `handler` (and the queue's declared
/// failure policy) until no pending row is due, or [`DRAIN_WITHIN`] has passed; returns what
/// it did. Work the handler creates for now (a `Reschedule`, an `Advance`) runs too, and so do
/// a failure policy's retries due before the drain's time is up (so a test sees attempts run
/// out); other rows due later stay pending. For tests, as Oban's `drain_queue`.
pub async fn drain<E, T, F, Fut>(queue: impl WorkerQueue<E, T>, handler: F) -> TitoResult<Drained>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    drain_within(queue, handler, DRAIN_WITHIN).await
}

/// [`drain`], for at most `within` (any duration; `Duration::MAX` waits as long as rows are
/// due).
pub async fn drain_within<E, T, F, Fut>(
    queue: impl WorkerQueue<E, T>,
    handler: F,
    within: Duration,
) -> TitoResult<Drained>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    let policy = queue.declared_failure_policy();
    let queue = queue.into_queue();
    queue.declare().await?;
    let mut config = WorkerConfig::new(0..queue.config().partitions)
        .max_idle_backoff(Duration::from_millis(10))
        .maintenance_interval(Duration::from_secs(3600));
    config.failure_policy = policy;
    let before = queue.stats();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(run_worker(queue.clone(), config, handler, stopped));
    let deadline = crate::util::deadline_after(within);
    let retries_until = Some(within);
    let mut still_due = due_now(&queue, retries_until).await?;
    while still_due > 0 && Instant::now() < deadline && !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
        still_due = due_now(&queue, retries_until).await?;
    }
    let _ = stop.send(true);
    match worker.await {
        Ok(result) => result?,
        Err(err) => {
            return Err(TitoError::handler(format!(
                "the drain's worker failed: {err}"
            )));
        }
    }
    let after = queue.stats();
    let delta = |pick: fn(&QueueStats) -> u64| pick(&after).saturating_sub(pick(&before));
    Ok(Drained {
        delivered: delta(|s| s.delivered),
        acknowledged: delta(|s| s.acknowledged),
        rescheduled: delta(|s| s.rescheduled),
        failed: delta(|s| s.failed),
        retried: delta(|s| s.retried),
        dead: delta(|s| s.dead),
        still_due: due_now(&queue, None).await?,
    })
}

/// Pending rows of every partition whose own due time has come (engine time), and with
/// `retries` those a failure policy scheduled again within that time from now.
async fn due_now<E: TitoEngine>(queue: &Queue<E>, retries: Option<Duration>) -> TitoResult<usize> {
    let root = queue.root().to_string();
    let partitions = queue.config().partitions;
    read_only(queue.engine(), async |tx| {
        let now_ms = engine::version_millis(tx.start_version());
        let now_s = (now_ms / 1000) as i64;
        let retry_s = retries.map_or(now_s, |within| {
            (now_ms.saturating_add(crate::util::millis(within)) / 1000) as i64
        });
        let mut due = 0;
        let mut seen = 0;
        for partition in 0..partitions {
            let prefix = keys::pending_partition_prefix(&root, partition);
            for (_, value) in super::scan_prefix(tx, &prefix).await? {
                seen += 1;
                if seen > MAX_DRAINED_ROWS {
                    return Err(TitoError::invalid_argument(format!(
                        "drain looks at most {MAX_DRAINED_ROWS} pending rows; the queue has more"
                    )));
                }
                if StoredEvent::parse(&value).is_ok_and(|row| {
                    row.timestamp <= now_s || (row.failures > 0 && row.timestamp <= retry_s)
                }) {
                    due += 1;
                }
            }
        }
        Ok(due)
    })
    .await
}

/// Where an invocation of an event id ended up.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// Completed: acknowledged, or cancelled (with why).
    Completed {
        /// Why it was cancelled, when it was.
        cancelled: Option<String>,
    },
    /// In the dead state after its last attempt.
    Dead {
        /// Its failed attempts.
        attempts: u32,
        /// The last attempt's error.
        error: String,
    },
    /// Still pending when the wait ended.
    Pending,
}

/// Waits up to `within` (any duration, `Duration::MAX` included) for the live invocation of event id `id` to complete or die, and says
/// which (`Settled::Pending` if it did not in time). A `Reschedule` or `Advance` keeps the id
/// pending until the last step completes. [`TitoError::NotFound`] when the queue has no
/// invocation of the id (never published, or deleted by retention).
pub async fn settled<E: TitoEngine>(
    queue: &Queue<E>,
    id: &str,
    within: Duration,
) -> TitoResult<Settled> {
    let deadline = crate::util::deadline_after(within);
    loop {
        let state = settled_now(queue, id).await?;
        if state != Settled::Pending || Instant::now() >= deadline {
            return Ok(state);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn settled_now<E: TitoEngine>(queue: &Queue<E>, id: &str) -> TitoResult<Settled> {
    let root = queue.root().to_string();
    read_only(queue.engine(), async |tx| {
        let id_key = keys::event_id_key(&root, id);
        let Some(target) = tx.get(id_key.as_bytes()).await? else {
            return Err(TitoError::NotFound(format!(
                "no invocation of event {id:?} in queue {}",
                queue.label()
            )));
        };
        let target_text = keys::key_str(&target)?.to_string();
        let row = match tx.get(&target).await? {
            Some(row) => StoredEvent::parse(&row)?,
            None => return Ok(Settled::Pending),
        };
        if target_text.starts_with(&keys::completed_prefix(&root)) {
            Ok(Settled::Completed {
                cancelled: row.cancelled,
            })
        } else if target_text.starts_with(&keys::dead_prefix(&root)) {
            Ok(Settled::Dead {
                attempts: row.failures,
                error: row.last_error.unwrap_or_default(),
            })
        } else {
            Ok(Settled::Pending)
        }
    })
    .await
}
