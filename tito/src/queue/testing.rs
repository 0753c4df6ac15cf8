//! Helpers for tests of code that publishes and handles events: run a queue until nothing due
//! is left ([`drain`]) and wait for one invocation to settle ([`settled`]), instead of polling
//! with sleeps. They use the real worker, leases and outcomes, on whatever engine the test
//! uses. Both keep to their time: a drain's handlers still running when it is over are
//! cancelled ([`Drained::cut_off`]), and any duration is taken, `Duration::MAX` included.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{AsideRecord, Paused, Queue, QueueStats, WorkerConfig, WorkerQueue, run_worker};
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
    /// Transactional handler calls run again because their transaction did not commit (a
    /// conflict replays the handler; see the guide's Transactional handlers).
    pub replayed: u64,
    /// Pending rows due when the drain ended (rows whose handler fails without a failure
    /// policy stay due: they are counted here once the drain's time is up; so are rows a pause
    /// holds).
    pub still_due: usize,
    /// Handlers still running when the drain's time was over: cancelled there, each a failed
    /// attempt as a handler timeout is (counted in `failed`; the invocation stays pending, or
    /// the failure policy decides).
    pub cut_off: u64,
    /// What was paused when the drain ended. A pause holds its rows: a drain does not wait for
    /// them (they are in `still_due`), and ends at once when only paused rows are due.
    pub paused: Paused,
}

/// Runs a worker over every partition of `queue` with `handler` (and the queue's declared
/// failure policy and worker settings: handler timeout, concurrency, page size, lease and
/// outcome batching of [`QueueSpec::worker`](crate::queue::QueueSpec::worker)) until no
/// pending row is due, or [`DRAIN_WITHIN`] has passed; returns what
/// it did. Work the handler creates for now (a `Reschedule`, an `Advance`) runs too, and so do
/// a failure policy's retries due before the drain's time is up (so a test sees attempts run
/// out); other rows due later stay pending. Rows in a paused queue or partition are not waited
/// for ([`Drained::paused`] says what was paused). For tests, as Oban's `drain_queue`.
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
/// due). Handlers still running when `within` is over are cancelled, as a handler timeout
/// cancels them: each is a failed attempt, its outcome is committed and the worker's leases
/// released before the drain returns, and [`Drained::cut_off`] counts them.
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
    let declared = queue.declared_worker_config();
    drain_core(
        queue.into_queue(),
        policy,
        declared,
        within,
        move |queue, config, cut| {
            let handler = move |event: QueueEvent<T>| CutOff::bound(cut.clone(), handler(event));
            let (stop, stopped) = tokio::sync::watch::channel(false);
            (
                stop,
                tokio::spawn(run_worker(queue, config, handler, stopped)),
            )
        },
    )
    .await
}

/// [`drain`] with a transactional handler (as
/// [`run_transactional_worker`](super::run_transactional_worker) runs it): its writes and
/// each outcome commit together, replayed after a conflict.
///
/// ```
/// use std::time::Duration;
/// use tito::queue::testing::drain_transactional;
/// use tito::queue::Topic;
/// use tito::{QueueEvent, QueueHandlerOutcome, TitoError, TitoTransaction};
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), TitoError> {
/// let db = tito::Embedded::temporary().await?;
/// const JOBS: Topic<u32> = Topic::new("jobs");
/// let jobs = JOBS.spec(2, Duration::from_secs(3600)).open(db.clone()).await?;
/// jobs.publish(QueueEvent::now("k", 7u32)).await?;
/// let drained = drain_transactional(&jobs, |event: QueueEvent<u32>, tx| async move {
///     tx.put(format!("seen:{}", event.payload).into_bytes(), b"1".to_vec()).await?;
///     Ok(QueueHandlerOutcome::Acknowledge)
/// })
/// .await?;
/// assert_eq!(drained.acknowledged, 1);
/// # db.close().await
/// # }
/// ```
pub async fn drain_transactional<E, T, F, Fut>(
    queue: impl WorkerQueue<E, T>,
    handler: F,
) -> TitoResult<Drained>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    drain_transactional_within(queue, handler, DRAIN_WITHIN).await
}

/// [`drain_transactional`], for at most `within` (as [`drain_within`]).
pub async fn drain_transactional_within<E, T, F, Fut>(
    queue: impl WorkerQueue<E, T>,
    handler: F,
    within: Duration,
) -> TitoResult<Drained>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    let policy = queue.declared_failure_policy();
    let declared = queue.declared_worker_config();
    drain_core(
        queue.into_queue(),
        policy,
        declared,
        within,
        move |queue, config, cut| {
            let handler = move |event: QueueEvent<T>, tx: E::Transaction| {
                CutOff::bound(cut.clone(), handler(event, tx))
            };
            let (stop, stopped) = tokio::sync::watch::channel(false);
            let worker = super::run_transactional_worker(queue, config, handler, stopped);
            (stop, tokio::spawn(worker))
        },
    )
    .await
}

/// The drain's time, which bounds its handlers too: one still running at the deadline is cut
/// off there (the worker's shutdown would otherwise wait for it up to `handler_timeout`).
#[derive(Clone)]
struct CutOff {
    deadline: Instant,
    within: Duration,
    count: Arc<AtomicU64>,
}

impl CutOff {
    /// `work`, cancelled as a failed attempt once the drain's time is over.
    async fn bound<T, W>(cut: CutOff, work: W) -> QueueHandlerResult<T>
    where
        W: Future<Output = QueueHandlerResult<T>>,
    {
        match tokio::time::timeout_at(cut.deadline, work).await {
            Ok(result) => result,
            Err(_) => {
                cut.count.fetch_add(1, Ordering::Relaxed);
                Err(TitoError::handler(format!(
                    "cancelled: the drain's time ({:?}) was over while the handler ran",
                    cut.within
                )))
            }
        }
    }
}

type Started = (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<TitoResult<()>>,
);

/// Runs the worker `start` starts (over every partition, with the declared failure policy)
/// until nothing is due or `within` passed, and says what it did.
async fn drain_core<E: TitoEngine>(
    queue: Arc<Queue<E>>,
    policy: Option<super::FailurePolicy>,
    declared: Option<WorkerConfig>,
    within: Duration,
    start: impl FnOnce(Arc<Queue<E>>, WorkerConfig, CutOff) -> Started,
) -> TitoResult<Drained> {
    queue.declare().await?;
    let mut config = WorkerConfig::new(0..queue.config().partitions)
        .max_idle_backoff(Duration::from_millis(10))
        .maintenance_interval(Duration::from_secs(3600));
    // A declared worker's handler settings apply (its handler timeout above all); the drain
    // keeps its own partitions (all), idle polling and maintenance.
    if let Some(declared) = declared {
        config.concurrency = declared.concurrency;
        config.page_size = declared.page_size;
        config.handler_timeout = declared.handler_timeout;
        config.lease_duration = declared.lease_duration;
        config.outcome_batch = declared.outcome_batch;
        config.outcome_delay = declared.outcome_delay;
    }
    config.failure_policy = policy;
    let before = queue.stats();
    let cut_off = CutOff {
        deadline: crate::util::deadline_after(within),
        within,
        count: Arc::default(),
    };
    let deadline = cut_off.deadline;
    let (stop, worker) = start(queue.clone(), config, cut_off.clone());
    let retries_until = Some(within);
    let (mut runnable, _) = due_now(&queue, retries_until, false).await?;
    loop {
        while runnable > 0 && Instant::now() < deadline && !worker.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            (runnable, _) = due_now(&queue, retries_until, false).await?;
        }
        // Graph ends not folded yet may make more rows due (a released step, a callback):
        // folded here (this process's fold of them may be under way too), then looked at again.
        if Instant::now() >= deadline
            || worker.is_finished()
            || !super::graph::fold::pending(queue.engine()).await?
        {
            break;
        }
        super::graph::fold::sweep(queue.engine()).await?;
        (runnable, _) = due_now(&queue, retries_until, false).await?;
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
    let (still_due, paused) = due_now(&queue, None, true).await?;
    Ok(Drained {
        delivered: delta(|s| s.delivered),
        acknowledged: delta(|s| s.acknowledged),
        rescheduled: delta(|s| s.rescheduled),
        failed: delta(|s| s.failed),
        retried: delta(|s| s.retried),
        dead: delta(|s| s.dead),
        replayed: delta(|s| s.replayed),
        still_due,
        cut_off: cut_off.count.load(Ordering::Relaxed),
        paused,
    })
}

/// Pending rows whose own due time has come (engine time), and with `retries` those a failure
/// policy scheduled again within that time from now; only in partitions no pause holds unless
/// `in_paused`. Returned with what is paused.
async fn due_now<E: TitoEngine>(
    queue: &Queue<E>,
    retries: Option<Duration>,
    in_paused: bool,
) -> TitoResult<(usize, Paused)> {
    let root = queue.root().to_string();
    let partitions = queue.config().partitions;
    read_only(queue.engine(), async |tx| {
        let paused = super::read_paused(tx, &root).await?;
        let now_ms = engine::version_millis(tx.start_version());
        let now_s = (now_ms / 1000) as i64;
        let retry_s = retries.map_or(now_s, |within| {
            (now_ms.saturating_add(crate::util::millis(within)) / 1000) as i64
        });
        let mut due = 0;
        let mut seen = 0;
        for partition in (0..partitions).filter(|p| in_paused || !paused.holds(*p)) {
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
        Ok((due, paused))
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
    /// Moved out of its partition ([`Queue::set_aside`], `tito queue set-aside`) and kept under
    /// `{queue}:aside:`; no worker runs it.
    SetAside {
        /// Why it was set aside.
        why: String,
    },
}

/// The most set-aside rows [`settled`] looks through for an id (a test's queue has few).
pub const MAX_ASIDE_ROWS: usize = 10_000;

/// Waits up to `within` (any duration, `Duration::MAX` included) for the live invocation of
/// event id `id` to complete, die or be set aside, and says which (`Settled::Pending` if it did
/// not in time). A `Reschedule` or `Advance` keeps the id pending until the last step
/// completes. [`TitoError::NotFound`] when the queue has no invocation of the id (never
/// published, or deleted by retention) and no set-aside row of it.
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
            // Setting a row aside releases its id: look for it among the set-aside rows.
            if let Some(why) = set_aside_why(tx, &root, id).await? {
                return Ok(Settled::SetAside { why });
            }
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

/// Why the last set-aside row of event id `id` was set aside, if the queue under `root` keeps
/// one (looking through at most [`MAX_ASIDE_ROWS`]).
async fn set_aside_why<X: TitoTransaction>(
    tx: &X,
    root: &str,
    id: &str,
) -> TitoResult<Option<String>> {
    let prefix = keys::aside_prefix(root);
    let end = keys::prefix_end(prefix.clone());
    let rows = tx
        .scan(prefix.as_bytes(), end.as_bytes(), MAX_ASIDE_ROWS)
        .await?;
    Ok(rows.into_iter().rev().find_map(|(_, value)| {
        let record: AsideRecord = serde_json::from_slice(&value).ok()?;
        (record.row.get("id")?.as_str()? == id).then_some(record.why)
    }))
}
