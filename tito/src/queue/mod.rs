//! The partitioned scheduled queue: events published in the same transaction as your data,
//! handled by workers whose closures are typed by the event struct.
//!
//! - **Publication** writes a pending row keyed by partition, due time, the publishing
//!   transaction's version and the event id (see `docs/storage-layout.md` for the layout; named queues
//!   live under `queue@{name}:`, the default one under `queue:`). A model that declares events
//!   (`#[tito(event = "..")]`, or [`TitoModelTrait::events`](crate::model::TitoModelTrait::events)
//!   by hand) publishes one [`ModelEvent`] per declared event with every write, to the queue
//!   named like the event, in the write's transaction;
//!   [`TitoOptions::without_events`](crate::model::TitoOptions::without_events) switches them
//!   off for one write.
//! - **Partitions**: `FNV-1a-64(key) % partitions` ([`partition_for`]). The count is stored with
//!   the queue on first use; a handle that disagrees is refused before it writes anything.
//! - **Workers** ([`run_worker`]) lease their partitions (leases timed by engine versions), pull
//!   due rows with a fair cursor, run handlers concurrently under a timeout, and apply outcomes
//!   in transactions that re-check (by writing) the partition lease. `Acknowledge` completes the
//!   row; `Reschedule` completes it and inserts the replacement atomically. Anything else (error,
//!   panic, timeout, lost lease, failed commit) leaves the exact invocation pending, to run
//!   again after a short pause. A worker given a [`FailurePolicy`] counts the failed attempts
//!   instead, backs off between them and sets the last one aside in a dead state.
//! - **Retention**: completed rows older than `completed_retention` are deleted by the workers'
//!   maintenance in bounded batches.
//! - **Idempotent publication**: each queue keeps one key per event id
//!   (`{queue}:event:{id}`) naming the id's live invocation. Publishing an id that has one
//!   (pending, or completed within the retention window) writes nothing and answers
//!   [`Published::duplicate`]; a `Reschedule` replacement takes the id over; retention and
//!   owner erasure release it. So at most one invocation of an id is live at a time, and a
//!   second publication is never a second run. Two racing publications of one id both write its
//!   key, so one of them conflicts, replays and finds the other.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use futures::FutureExt;
//! use serde::{Deserialize, Serialize};
//! use tito::backend::embedded::Embedded;
//! use tito::queue::run_worker;
//! use tito::{Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, WorkerConfig};
//!
//! #[derive(Clone, Debug, Serialize, Deserialize)]
//! struct UserCreated {
//!     id: String,
//! }
//!
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> Result<(), tito::TitoError> {
//! let db = Embedded::temporary().await?;
//! let queue = Arc::new(Queue::new(
//!     db.clone(),
//!     QueueConfig::new(4, Duration::from_secs(3 * 24 * 60 * 60)),
//! ));
//! queue
//!     .publish(QueueEvent::now("user:123", UserCreated { id: "123".into() }))
//!     .await?;
//!
//! let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
//! let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
//! let worker = tokio::spawn(run_worker(
//!     queue.clone(),
//!     WorkerConfig::new(0..4),
//!     move |event: QueueEvent<UserCreated>| {
//!         let seen_tx = seen_tx.clone();
//!         async move {
//!             seen_tx.send(event.payload.id.clone()).unwrap();
//!             Ok(QueueHandlerOutcome::Acknowledge)
//!         }
//!         .boxed()
//!     },
//!     shutdown_rx,
//! ));
//! assert_eq!(seen_rx.recv().await.as_deref(), Some("123"));
//! shutdown_tx.send(true).unwrap();
//! worker.await.unwrap();
//! # Ok(())
//! # }
//! ```

mod cancel;
#[cfg(feature = "test-util")]
pub mod cluster;
#[cfg(not(feature = "test-util"))]
mod cluster;
mod completed;
mod dead;
pub mod graph;
/// Partition leases as stored: internal, public with the `test-util` feature for tests that
/// take a lease over as another worker would.
#[cfg(feature = "test-util")]
pub mod lease;
#[cfg(not(feature = "test-util"))]
pub(crate) mod lease;
mod limits;
mod pause;
mod periodic;
mod pull;
mod results;
pub mod testing;
mod topic;
mod unique;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::event::nudge::{
    NUDGE_EXPIRY, NUDGE_REFRESH, NudgeFigures, PEERS_FRESH, RECEIVE_RATE, figures as nudge_figures,
};
use crate::event::publish::{check_meta, forget_event_id};
pub use crate::event::{
    HandlerResult, MAX_JSON_DEPTH, MAX_OWNER_BYTES, MAX_QUEUE_EVENT_BYTES, MAX_RESULT_BYTES,
    MAX_URGENCY, ModelEvent, Published, QueueEvent, QueueHandlerOutcome, QueueHandlerResult,
    QueueOwner, RelativeDue, TitoOperation, Topic, URGENCY_STEP, partition_for,
};
#[allow(deprecated)]
pub use crate::event::{MAX_PRIORITY, PRIORITY_STEP};
pub use crate::runtime::{Stop, Workers};
pub(crate) use cancel::with_cancellation;
pub use cancel::{
    Cancellation, MAX_CANCEL_REASON, cancel, cancel_owner, cancellation, check_cancel_reason,
};
pub use cluster::{ClusterConfig, ClusterState, MIN_TTL, cluster_state};
pub use dead::{DeadInvocation, dead, discard_dead, retry_dead};
pub(crate) use limits::{
    Admitted, Gate, Holder, Unslotted, admit, claim_running, read_limits, release_slots,
    store_open, sweep_orphan_slots,
};
pub use limits::{
    LimitUsage, Limits, MAX_CONCURRENCY_LIMIT, MAX_RATE_INTERVAL, MAX_RATE_STARTS,
    MIN_RATE_INTERVAL, Rate, check_limits, limit_usage, limits, set_limits,
};
pub(crate) use pause::read_paused;
pub use pause::{
    MAX_PAUSE_REASON, PAUSE_CHECK, PauseRecord, Paused, check_pause_reason, pause, paused, resume,
};
pub use periodic::{
    CRON_HORIZON, MAX_INTERVAL, PeriodicJob, Schedule, ScheduleView, TICK_TIMEOUT, run_periodic,
    schedules, tick_id,
};
pub use pull::{MAX_PASS_AGE, MAX_SCAN_ROWS, RESTART_BUDGET, SCAN_ROWS};
pub use results::{AWAIT_POLL_MAX, Finished, InvocationState};
pub use topic::{QueueSpec, TopicQueue, WorkerQueue};
pub use unique::{MAX_UNIQUE_KEY_BYTES, MAX_UNIQUE_PERIOD, Unique, UniqueStates};
pub(crate) use worker::AfterFailure;
pub(crate) use worker::report_prefix;
pub use worker::{
    DEPTH_BOUND, DEPTH_PARTITIONS, DepthSample, FailurePolicy, MAX_ATTEMPTS, MAX_SETTING,
    MIN_LEASE, MinuteFigures, PartitionRuns, REPORT_DETAIL_BYTES, REPORT_EVERY, REPORT_GONE_AFTER,
    REPORT_KEPT, REPORT_MINUTES, Shutdown, WorkerConfig, WorkerReport, run_cluster_worker,
    run_transactional_worker, run_worker,
};

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::StoredEvent;
use crate::keys;
use crate::telemetry::names;

/// Every row under `prefix`, read in scans of 1024 (one scan for the small record sets it is
/// used for: pause records, concurrency slots).
/// `items` in the transactions a bulk publication writes them in: at most [`PUBLISH_BATCH`]
/// events and [`PUBLISH_BATCH_BYTES`] each, and at least one, however large.
pub(in crate::queue) fn publish_chunks(items: &[unique::ToPublish]) -> Vec<&[unique::ToPublish]> {
    let mut chunks = Vec::new();
    let mut rest = items;
    while !rest.is_empty() {
        let mut take = 1;
        let mut bytes = rest[0].bytes.len();
        while take < rest.len()
            && take < PUBLISH_BATCH
            && bytes + rest[take].bytes.len() <= PUBLISH_BATCH_BYTES
        {
            bytes += rest[take].bytes.len();
            take += 1;
        }
        let (chunk, after) = rest.split_at(take);
        chunks.push(chunk);
        rest = after;
    }
    chunks
}

pub(crate) async fn scan_prefix<X: TitoTransaction>(
    tx: &X,
    prefix: &str,
) -> TitoResult<Vec<(Vec<u8>, Vec<u8>)>> {
    const PAGE: usize = 1024;
    let end = keys::prefix_end(prefix.to_string());
    let mut rows = Vec::new();
    let mut from = prefix.as_bytes().to_vec();
    loop {
        let page = tx.scan(&from, end.as_bytes(), PAGE).await?;
        let full = page.len() == PAGE;
        if let Some((last, _)) = page.last() {
            from = keys::key_after_bytes(last);
        }
        rows.extend(page);
        if !full {
            return Ok(rows);
        }
    }
}

/// Refuses an operator's reason (`what`: "a pause's reason") over `max` bytes, naming the
/// queue whose storage root is `root`.
fn check_reason(root: &str, what: &str, why: &str, max: usize) -> TitoResult<()> {
    if why.len() > max {
        return Err(naming_queue(
            root,
            TitoError::invalid_argument(format!(
                "{what} holds at most {max} bytes; {} given",
                why.len()
            )),
        ));
    }
    Ok(())
}

/// `err` with the queue under `root` named in front of its message when it refuses an argument
/// (`queue "mail": ...`): an operator's tool works on several queues, and a refusal must say
/// which one it is about. Other errors are returned as they are.
pub(crate) fn naming_queue(root: &str, err: TitoError) -> TitoError {
    match err {
        TitoError::InvalidArgument(message) => {
            TitoError::InvalidArgument(format!("queue {:?}: {message}", keys::queue_name(root)))
        }
        other => other,
    }
}

/// The refusal of a partition the queue under `root` does not have (`count` partitions), as
/// every operator call and inspection says it.
pub(crate) fn no_such_partition(root: &str, count: u32, partition: u32) -> TitoError {
    TitoError::invalid_argument(format!(
        "queue {:?} has {count} partition{} (0 to {}): no partition {partition}",
        keys::queue_name(root),
        if count == 1 { "" } else { "s" },
        count.saturating_sub(1)
    ))
}

/// Refuses `partition` unless the queue named `topic` (`None`: the default queue) has it, with
/// the message [`pause`], [`resume`] and [`crate::inspect::queue_scan`] give, and `NotFound` for
/// a queue nothing was ever published to or declared. For tools that check an operator's input
/// before asking for confirmation.
pub async fn check_partition<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    partition: u32,
) -> TitoResult<()> {
    let root = keys::queue_root(topic);
    engine::read_only(db, async |tx| {
        pause::check_partition(tx, &root, Some(partition)).await
    })
    .await
}

/// Refuses a `key` that is not the key of a pending row of the queue named `topic` (`None`:
/// the default queue), with [`TitoError::InvalidArgument`] saying what such a key looks like:
/// the check [`set_aside`] makes before it reads anything. For tools that check an operator's
/// input before asking for confirmation.
pub fn check_pending_key(topic: Option<&str>, key: &str) -> TitoResult<()> {
    parse_pending_key_arg(&keys::queue_root(topic), key).map(|_| ())
}

/// [`check_pending_key`], and the key's partition one the queue has ([`check_partition`]'s
/// refusal otherwise): every check [`set_aside`] makes before it reads the row. A well-formed
/// key that names no row passes (the row may have run meanwhile: [`set_aside`] then says it
/// moved nothing).
pub async fn check_set_aside_key<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    key: &str,
) -> TitoResult<()> {
    let parsed = parse_pending_key_arg(&keys::queue_root(topic), key)?;
    check_partition(db, topic, parsed.partition).await
}

/// `key` as a pending key of the queue under `root`; a key that is not one (mistyped, cut
/// short, of another queue) is an operator's mistake, refused as an invalid argument that says
/// what a pending key looks like.
fn parse_pending_key_arg(root: &str, key: &str) -> TitoResult<keys::PendingKey> {
    keys::parse_pending_key(root, key).map_err(|err| {
        let why = match err {
            TitoError::Integrity(message) => message,
            other => other.to_string(),
        };
        TitoError::invalid_argument(format!(
            "queue {:?}: {key:?} is not the key of one of its pending rows ({}); such a key \
             reads {root}:pending:PPPP:TTTTTTTTTTTTTTTTTTTT:VVVVVVVVVVVVVVVVVVVV:EVENT-ID (a \
             four-digit partition, a 20-digit due time and version, the event id), as an \
             inspection of the queue's pending rows prints it",
            keys::queue_name(root),
            why.strip_prefix(&format!("pending key {key:?} "))
                .unwrap_or(&why)
        ))
    })
}

/// How many completed rows one maintenance batch deletes at most.
pub const RETENTION_BATCH: usize = 256;

/// A queue's fixed settings.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueConfig {
    /// The number of partitions (1..=10 000); stored with the queue on first use.
    pub partitions: u32,
    /// How long completed invocations are kept before maintenance deletes them.
    pub completed_retention: Duration,
    /// The queue's name; `None` is the default queue (keys under `queue:`).
    pub topic: Option<String>,
}

impl QueueConfig {
    /// The default queue with `partitions` partitions, keeping completed rows for
    /// `completed_retention`.
    pub fn new(partitions: u32, completed_retention: Duration) -> Self {
        QueueConfig {
            partitions,
            completed_retention,
            topic: None,
        }
    }

    /// The queue named `topic` instead (the queue a model's `event = "topic"` publishes to).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }
}

crate::counters::counters! {
    /// The counters of one queue handle and its workers, as plain numbers at one moment
    /// ([`Queue::stats`]).
    pub struct QueueStats / QueueCounters {
        /// Invocations handed to handlers.
        delivered,
        /// Invocations acknowledged.
        acknowledged,
        /// Invocations completed with a replacement.
        rescheduled,
        /// Handler errors, panics and timeouts (the invocation stayed pending, or a failure
        /// policy retried it or moved it to the dead state).
        failed,
        /// Failed attempts a failure policy scheduled again.
        retried,
        /// Invocations a failure policy moved to the dead state.
        dead,
        /// Outcomes not applied: their transaction did not commit (the invocations stayed
        /// pending, or the outcome is unknown), their lease was no longer held, or their row was
        /// gone when it committed (cancelled or erased meanwhile).
        outcome_failures,
        /// Pending rows that could not be read as invocations of this queue (left in place).
        malformed,
        /// Storage scans of pending rows.
        scans,
        /// Completed rows deleted by maintenance.
        expired,
        /// Partition leases lost to another worker or to expiry.
        leases_lost,
        /// Publications of an event id that already had a live invocation (nothing written).
        duplicates,
        /// Invocations found runnable that waited for a concurrency slot (left pending).
        limited,
        /// Invocations a rate limit moved to a later due time.
        rate_limited,
        /// Transactional handler calls run again because their transaction did not commit (a
        /// conflict, or an unknown outcome resolved as not applied): the handler ran more
        /// than once for one attempt of its invocation.
        replayed,
    }
}

/// A queue on an engine. Share it as `Arc<Queue<E>>` between publishers and workers.
pub struct Queue<E> {
    db: E,
    config: QueueConfig,
    root: String,
    /// The `queue` label of its metrics.
    label: String,
    stats: Arc<QueueCounters>,
    meta_known: AtomicBool,
    /// This queue's wake-ups on this store, shared with every handle of the queue.
    pub(crate) wakeups: Arc<crate::event::wake::Wakeups>,
}

impl<E> std::fmt::Debug for Queue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("root", &self.root)
            .field("config", &self.config)
            .finish()
    }
}

impl<E: TitoEngine> Queue<E> {
    /// A queue handle. Nothing is read or written until the first publication or pull.
    pub fn new(db: E, config: QueueConfig) -> Self {
        let root = keys::queue_root(config.topic.as_deref());
        let wakeups = crate::event::nudge::wakeups(&db, &root);
        wakeups.has_partitions(config.partitions);
        Queue {
            label: crate::telemetry::queue_label(config.topic.as_deref()),
            wakeups,
            db,
            config,
            root,
            stats: Arc::default(),
            meta_known: AtomicBool::new(false),
        }
    }

    /// Counts a publication (its transaction woke the partition's workers on commit).
    fn published(&self, published: &Published) {
        if published.duplicate {
            self.count(&self.stats.duplicates, names::QUEUE_DUPLICATES, 1);
        } else {
            metrics::counter!(names::QUEUE_PUBLISHED, "queue" => self.label.clone()).increment(1);
        }
    }

    /// Adds `by` to one of the handle's counters and to its metric.
    pub(crate) fn count(&self, counter: &AtomicU64, metric: &'static str, by: u64) {
        QueueCounters::bump(counter, by);
        metrics::counter!(metric, "queue" => self.label.clone()).increment(by);
    }

    /// The `queue` label of this queue's metrics and spans: its topic, or `default`.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The engine.
    pub fn engine(&self) -> &E {
        &self.db
    }

    /// The settings.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The counters of this handle and its workers, as plain numbers now.
    pub fn stats(&self) -> QueueStats {
        self.stats.snapshot()
    }

    pub(crate) fn counters(&self) -> &QueueCounters {
        &self.stats
    }

    /// The counters, shared (for what outlives a borrow of the handle).
    pub(crate) fn shared_counters(&self) -> Arc<QueueCounters> {
        self.stats.clone()
    }

    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    fn check_config(&self) -> TitoResult<()> {
        engine::check_partitions(self.config.partitions)?;
        if let Some(topic) = &self.config.topic
            && topic.is_empty()
        {
            return Err(TitoError::invalid_argument("a queue topic is empty"));
        }
        Ok(())
    }

    /// Checks the stored partition count in `tx` (once per handle after it was found), writing
    /// it when the queue has none yet.
    pub(crate) async fn ensure_meta(&self, tx: &E::Transaction) -> TitoResult<()> {
        let mut writes = engine::Writes::default();
        self.plan_meta(tx, &mut writes).await?;
        writes.apply(tx).await
    }

    /// [`Self::ensure_meta`], planning the metadata's write instead of writing it.
    async fn plan_meta(&self, tx: &E::Transaction, writes: &mut engine::Writes) -> TitoResult<()> {
        self.check_config()?;
        if self.meta_known.load(Ordering::Relaxed) {
            return Ok(());
        }
        if check_meta(tx, &self.root, self.config.partitions, writes).await? {
            self.meta_known.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Declares the queue on its store: stores its partition count when the store has none
    /// (so its limits and pauses can be set before anything is published) and checks it
    /// otherwise ([`TitoError::InvalidArgument`] when they differ). Publications and workers
    /// do the same on first use.
    pub async fn declare(&self) -> TitoResult<()> {
        self.check_config()?;
        // The closure owns what it uses (no borrow of `self`): the future stays `Send`.
        let (root, partitions) = (self.root.clone(), self.config.partitions);
        self.db
            .transaction(|tx| {
                let root = root.clone();
                async move {
                    let mut writes = engine::Writes::default();
                    check_meta(&tx, &root, partitions, &mut writes).await?;
                    writes.apply(&tx).await
                }
            })
            .await?;
        self.meta_known.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Publishes an event in a transaction of its own.
    ///
    /// Publication is idempotent per event id ([`QueueEvent::with_id`]): while an invocation of
    /// the id is pending, or completed and not yet deleted by retention, publishing the id
    /// again writes nothing and answers [`Published::duplicate`].
    pub async fn publish<T: Serialize>(&self, event: QueueEvent<T>) -> TitoResult<Published> {
        self.publish_under(&event, None).await
    }

    /// Publishes an event inside `tx`, atomically with the rest of it; idempotent per event id
    /// like [`Queue::publish`].
    pub async fn publish_in_tx<T: Serialize>(
        &self,
        event: &QueueEvent<T>,
        tx: &E::Transaction,
    ) -> TitoResult<Published> {
        self.publish_under_in_tx(event, None, tx).await
    }

    /// Publishes `events` in transactions of their own, in their order, each transaction
    /// holding at most [`PUBLISH_BATCH`] events and [`PUBLISH_BATCH_BYTES`] of payload: one
    /// commit (and, on TiKV, one batched read of the event ids) per transaction instead of one
    /// per event. Returns one answer per event, in order; each is idempotent per event id as
    /// in [`Queue::publish`], also against an event earlier in the list.
    ///
    /// Every event is checked before anything is written. When a transaction fails, the ones
    /// before it stay committed and the error says how many events were published: publishing
    /// the same events again is safe, since those already published are answered as duplicates
    /// by their ids.
    pub async fn publish_many<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
    ) -> TitoResult<Vec<Published>> {
        self.publish_many_under(events, None).await
    }

    /// [`Queue::publish_many`] inside `tx`, atomically with the rest of it: all or none. At
    /// most [`MAX_PUBLISH_IN_TX`] events (a larger list belongs in `publish_many`'s bounded
    /// transactions).
    pub async fn publish_many_in_tx<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        self.publish_many_under_in_tx(events, None, tx).await
    }

    /// [`Queue::publish_many`] under one uniqueness rule, checked for each event (see
    /// [`Queue::publish_unique`]); two events of the list with one unique key publish the
    /// first, the second is its duplicate.
    pub async fn publish_many_unique<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        unique: &unique::Unique,
    ) -> TitoResult<Vec<Published>> {
        self.publish_many_under(events, Some(unique)).await
    }

    /// [`Queue::publish_many_unique`] inside `tx`, atomically with the rest of it.
    pub async fn publish_many_unique_in_tx<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        unique: &unique::Unique,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        self.publish_many_under_in_tx(events, Some(unique), tx)
            .await
    }

    /// [`Queue::publish`], or with a uniqueness rule [`Queue::publish_unique`].
    async fn publish_under<T: Serialize>(
        &self,
        event: &QueueEvent<T>,
        unique: Option<&unique::Unique>,
    ) -> TitoResult<Published> {
        let item = unique::ToPublish::of(event, unique)?;
        let mut published = self.publish_checked(std::slice::from_ref(&item)).await?;
        Ok(published.remove(0))
    }

    /// [`Queue::publish_in_tx`], or with a uniqueness rule [`Queue::publish_unique_in_tx`].
    async fn publish_under_in_tx<T: Serialize>(
        &self,
        event: &QueueEvent<T>,
        unique: Option<&unique::Unique>,
        tx: &E::Transaction,
    ) -> TitoResult<Published> {
        let item = unique::ToPublish::of(event, unique)?;
        let mut published = self
            .publish_checked_in_tx(std::slice::from_ref(&item), tx)
            .await?;
        Ok(published.remove(0))
    }

    /// Checks every event of a list before anything is written, naming the first bad one.
    fn check_all<T: Serialize>(
        events: &[QueueEvent<T>],
        unique: Option<&unique::Unique>,
    ) -> TitoResult<Vec<unique::ToPublish>> {
        events
            .iter()
            .enumerate()
            .map(|(at, event)| {
                unique::ToPublish::of(event, unique).map_err(|err| {
                    if events.len() == 1 {
                        return err;
                    }
                    match err {
                        TitoError::InvalidArgument(why) => TitoError::InvalidArgument(format!(
                            "event {at} of {} (id {:?}): {why}; nothing was published",
                            events.len(),
                            event.id
                        )),
                        other => other,
                    }
                })
            })
            .collect()
    }

    async fn publish_many_under<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        unique: Option<&unique::Unique>,
    ) -> TitoResult<Vec<Published>> {
        let items = Self::check_all(events, unique)?;
        self.check_config()?;
        let mut published = Vec::with_capacity(items.len());
        for chunk in publish_chunks(&items) {
            match self.publish_checked(chunk).await {
                Ok(answers) => published.extend(answers),
                Err(err) if published.is_empty() => return Err(err),
                Err(err) => {
                    return Err(TitoError::PartiallyPublished {
                        published: published.len(),
                        total: items.len(),
                        cause: Box::new(err),
                    });
                }
            }
        }
        Ok(published)
    }

    async fn publish_many_under_in_tx<T: Serialize>(
        &self,
        events: &[QueueEvent<T>],
        unique: Option<&unique::Unique>,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        if events.len() > MAX_PUBLISH_IN_TX {
            return Err(TitoError::invalid_argument(format!(
                "{} events published in one transaction; at most {MAX_PUBLISH_IN_TX}: \
                 publish_many writes a longer list in bounded transactions of its own",
                events.len()
            )));
        }
        let items = Self::check_all(events, unique)?;
        self.publish_checked_in_tx(&items, tx).await
    }

    /// Publishes checked events in one transaction of their own.
    async fn publish_checked(&self, items: &[unique::ToPublish]) -> TitoResult<Vec<Published>> {
        self.check_config()?;
        crate::event::nudge::prepare(&self.db, &self.wakeups);
        let root = self.root.clone();
        let partitions = self.config.partitions;
        let known = self.meta_known.load(Ordering::Relaxed);
        let wakeups = self.wakeups.clone();
        let items: Arc<[unique::ToPublish]> = items.into();
        // The closure owns what it uses (no borrow of `self` or of `items`), so the future
        // stays `Send` for callers with a concrete engine.
        let planned = self
            .db
            .transaction(|tx| {
                let (root, wakeups, items) = (root.clone(), wakeups.clone(), items.clone());
                async move {
                    let mut writes = engine::Writes::default();
                    if !known {
                        check_meta(&tx, &root, partitions, &mut writes).await?;
                    }
                    let planned = unique::plan(&tx, &root, partitions, &items, &mut writes).await?;
                    writes.apply(&tx).await?;
                    wake_planned(&wakeups, &tx, &planned);
                    Ok::<_, TitoError>(planned)
                }
            })
            .await?;
        self.meta_known.store(true, Ordering::Relaxed);
        Ok(self.answered(planned))
    }

    /// Publishes checked events inside `tx`.
    async fn publish_checked_in_tx(
        &self,
        items: &[unique::ToPublish],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        crate::event::nudge::prepare(&self.db, &self.wakeups);
        // Reads first, then every write checked and buffered together: an error leaves nothing
        // of this publication in the caller's transaction.
        let mut writes = engine::Writes::default();
        self.plan_meta(tx, &mut writes).await?;
        let planned =
            unique::plan(tx, &self.root, self.config.partitions, items, &mut writes).await?;
        writes.apply(tx).await?;
        // After the caller's commit, never before: a worker woken earlier would poll for a
        // row it cannot see yet and back off.
        wake_planned(&self.wakeups, tx, &planned);
        Ok(self.answered(planned))
    }

    /// Counts planned publications and returns their answers.
    fn answered(&self, planned: Vec<(Published, u32)>) -> Vec<Published> {
        planned
            .into_iter()
            .map(|(published, _)| {
                self.published(&published);
                published
            })
            .collect()
    }

    /// How many invocations are pending in a partition (counted in bounded scans).
    pub async fn pending_count(&self, partition: u32) -> TitoResult<usize> {
        let prefix = keys::pending_partition_prefix(&self.root, partition);
        self.count_prefix(&prefix).await
    }

    /// How many completed invocations are kept (counted in bounded scans).
    pub async fn completed_count(&self) -> TitoResult<usize> {
        self.count_prefix(&keys::completed_prefix(&self.root)).await
    }

    async fn count_prefix(&self, prefix: &str) -> TitoResult<usize> {
        let end = keys::prefix_end(prefix.to_string()).into_bytes();
        let mut start = prefix.as_bytes().to_vec();
        let mut count = 0;
        let tx = self.db.begin().await?;
        loop {
            let rows = tx.scan(&start, &end, 1000).await?;
            count += rows.len();
            match rows.last() {
                Some((key, _)) if rows.len() == 1000 => start = keys::key_after_bytes(key),
                _ => break,
            }
        }
        let _ = tx.rollback().await;
        Ok(count)
    }

    /// Deletes, inside `tx`, this owner's invocations (pending or completed) for which
    /// `predicate` returns true, with their owner keys; returns how many. Only the owner's keys
    /// are scanned. Rows whose payload does not decode as `T` are left alone.
    ///
    /// Everything is read first and every delete is buffered together at the end: an error
    /// leaves nothing of the erasure in `tx`, and an error while buffering marks `tx` failed, so
    /// it refuses to commit (never half an erasure, such as an event id released while its
    /// invocation stays pending).
    pub async fn delete_by_owner_matching_in_tx<T, F>(
        &self,
        owner: &QueueOwner,
        predicate: F,
        tx: &E::Transaction,
    ) -> TitoResult<usize>
    where
        T: DeserializeOwned,
        F: Fn(&QueueEvent<T>) -> bool,
    {
        owner.check()?;
        let prefix = keys::owner_prefix(&self.root, &owner.kind, &owner.id);
        let mut writes = engine::Writes::default();
        let mut deleted = 0;
        let mut ended = Vec::new();
        for (owner_key, _) in scan_prefix(tx, &prefix).await? {
            let owner_key_text = keys::key_str(&owner_key)?;
            let target = keys::owner_key_target(owner_key_text)?;
            let Some(bytes) = tx.get(target.as_bytes()).await? else {
                // A dangling owner key: remove it.
                writes.delete(owner_key);
                continue;
            };
            let Ok(stored) = serde_json::from_slice::<StoredEvent>(&bytes) else {
                continue;
            };
            let Ok(event) = stored.typed::<T>() else {
                continue;
            };
            if predicate(&event) {
                // An erased invocation that had not ended ends for its workflow and batch as a
                // cancelled one.
                let live = target.starts_with(&format!("{}:pending:", self.root))
                    || target.starts_with(&keys::waiting_prefix(&self.root));
                if live && (stored.step.is_some() || stored.batch.is_some()) {
                    ended.push(stored.clone());
                }
                // The id may be published again, unless a newer invocation holds it.
                let id_key = keys::event_id_key(&self.root, &stored.id);
                if tx.get(id_key.as_bytes()).await?.as_deref() == Some(target.as_bytes()) {
                    writes.delete(id_key);
                }
                if stored.moved_from.is_some() {
                    writes.delete(keys::moved_key(&self.root, &stored.id));
                }
                writes.delete(target);
                writes.delete(owner_key);
                deleted += 1;
            }
        }
        writes.apply(tx).await?;
        if !ended.is_empty() {
            engine::aborting(tx, async {
                for stored in &ended {
                    let wakes = graph::finished(
                        tx,
                        &self.root,
                        stored,
                        graph::Finish::Cancelled,
                        graph::Apply::Now,
                    )
                    .await?;
                    graph::wake_after_commit(&self.db, tx, wakes);
                }
                Ok(())
            })
            .await?;
        }
        Ok(deleted)
    }

    /// One maintenance step: deletes up to [`RETENTION_BATCH`] completed rows older than the
    /// retention (malformed ones too), with their owner keys. Returns how many it deleted; a
    /// full batch means more may be waiting.
    pub async fn expire_completed(&self) -> TitoResult<usize> {
        let root = self.root.clone();
        let retention_ms = crate::util::millis(self.config.completed_retention);
        let stats = self.stats.clone();
        let deleted = self
            .db
            .transaction(|tx| {
                let root = root.clone();
                async move {
                    let now_ms = engine::version_millis(tx.start_version());
                    let Some(cutoff_ms) = now_ms.checked_sub(retention_ms) else {
                        return Ok(0);
                    };
                    let start = keys::completed_prefix(&root).into_bytes();
                    let end = keys::completed_before(&root, engine::version_from_millis(cutoff_ms))
                        .into_bytes();
                    let rows = tx.scan(&start, &end, RETENTION_BATCH).await?;
                    for (key, value) in &rows {
                        if let Ok(stored) = serde_json::from_slice::<StoredEvent>(value)
                            && let Ok(text) = keys::key_str(key)
                        {
                            // The id may be published again once its completed row is gone.
                            forget_event_id(&tx, &root, &stored.id, text).await?;
                        }
                        if let Ok(stored) = serde_json::from_slice::<StoredEvent>(value)
                            && let Some(owner) = &stored.owner
                            && let Ok(text) = keys::key_str(key)
                        {
                            let owner_key = keys::owner_key(
                                &root,
                                &owner.kind,
                                &owner.id,
                                keys::OWNER_COMPLETED,
                                text,
                            );
                            tx.delete(owner_key.into_bytes()).await?;
                        }
                        tx.delete(key.clone()).await?;
                    }
                    Ok::<_, TitoError>(rows.len())
                }
            })
            .await?;
        self.count(&stats.expired, names::QUEUE_EXPIRED, deleted as u64);
        Ok(deleted)
    }

    /// Records that a worker cannot decode the pending row `key` as `type_name`, for
    /// operators (the inspection API, the dashboard, `tito queue peek`), unless the row is gone.
    pub(crate) async fn note_undecodable(
        &self,
        key: &str,
        type_name: &str,
        error: &str,
    ) -> TitoResult<()> {
        let note_key = keys::undecodable_key(&self.root, key)?;
        let note = serde_json::to_vec(&UndecodableNote {
            type_name: type_name.to_string(),
            error: error.to_string(),
            row: keys::undecodable_key_is_hashed(&self.root, &note_key).then(|| key.to_string()),
        })?;
        let key = key.to_string();
        self.db
            .transaction(|tx| {
                let (key, note_key, note) = (key.clone(), note_key.clone(), note.clone());
                async move {
                    if tx.get(key.as_bytes()).await?.is_some() {
                        tx.put(note_key.into_bytes(), note).await?;
                    }
                    Ok::<_, TitoError>(())
                }
            })
            .await
    }

    /// Moves the pending row `key` aside: it leaves the partition (no worker sees it again)
    /// with its owner key and its event id (the id may be published again), and is kept under
    /// `{queue}:aside:` with `why` (listed by [`crate::inspect::queue_aside`]). For rows no
    /// worker can decode, or that should not run. Returns `false` when the row is not pending.
    /// [`set_aside`] does the same with the queue's topic alone (for tools).
    pub async fn set_aside(&self, key: &str, why: &str) -> TitoResult<bool> {
        set_aside_under(&self.db, &self.root, key, why).await
    }

    /// One maintenance step: deletes up to [`RETENTION_BATCH`] undecodable notes whose rows are
    /// no longer pending (another worker ran them, or they were set aside). Returns how many.
    pub async fn sweep_undecodable(&self) -> TitoResult<usize> {
        let root = self.root.clone();
        self.db
            .transaction(|tx| {
                let root = root.clone();
                async move {
                    let prefix = keys::undecodable_prefix(&root);
                    let end = keys::prefix_end(prefix.clone());
                    let notes = tx
                        .scan(prefix.as_bytes(), end.as_bytes(), RETENTION_BATCH)
                        .await?;
                    // The row a note is about: named by its key, or by its value when the key
                    // is hashed. A note that names none is deleted (no row matches it).
                    let targets: Vec<Vec<u8>> = notes
                        .iter()
                        .map(|(k, v)| {
                            serde_json::from_slice::<UndecodableNote>(v)
                                .ok()
                                .and_then(|note| note.row)
                                .or_else(|| {
                                    keys::key_str(k)
                                        .ok()
                                        .and_then(|k| keys::undecodable_target(&root, k).ok())
                                })
                                .unwrap_or_else(|| keys::undecodable_prefix(&root))
                                .into_bytes()
                        })
                        .collect();
                    let live = tx.batch_get(&targets).await?;
                    let mut deleted = 0;
                    for ((note, _), row) in notes.iter().zip(live) {
                        if row.is_none() {
                            tx.delete(note.clone()).await?;
                            deleted += 1;
                        }
                    }
                    Ok::<_, TitoError>(deleted)
                }
            })
            .await
    }
}

/// A worker's note that it cannot decode a pending row as its handler's event type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct UndecodableNote {
    /// The handler's event type (Rust's name for it).
    pub type_name: String,
    /// Why the row does not decode as that type.
    pub error: String,
    /// The pending row's key, when the note's own key cannot hold it (a row key within a few
    /// bytes of the key limit: the note's key is then hashed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<String>,
}

/// A row moved aside ([`Queue::set_aside`]), as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AsideRecord {
    /// Why it was moved aside.
    pub why: String,
    /// The row as it was (JSON, or its bytes as text when it was not JSON).
    pub row: Value,
}

/// [`Queue::set_aside`] on the queue named `topic` (`None`: the default queue), for tools that
/// have no queue handle: the row's key is enough.
pub async fn set_aside<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    key: &str,
    why: &str,
) -> TitoResult<bool> {
    set_aside_under(db, &keys::queue_root(topic), key, why).await
}

/// The most events [`Queue::publish_many`] commits in one transaction.
pub const PUBLISH_BATCH: usize = 1_000;
/// The most payload bytes (as stored) [`Queue::publish_many`] commits in one transaction (an
/// event is at most [`MAX_QUEUE_EVENT_BYTES`], so at least
/// four go together).
pub const PUBLISH_BATCH_BYTES: usize = 4 << 20;
/// The most events [`Queue::publish_many_in_tx`] publishes in a caller's transaction.
pub const MAX_PUBLISH_IN_TX: usize = 10_000;

/// After `tx` commits, wakes the workers of every partition that received an invocation.
fn wake_planned<X: TitoTransaction>(
    wakeups: &Arc<crate::event::wake::Wakeups>,
    tx: &X,
    planned: &[(Published, u32)],
) {
    let mut woken: Vec<u32> = planned
        .iter()
        .filter(|(published, _)| !published.duplicate)
        .map(|(_, partition)| *partition)
        .collect();
    woken.sort_unstable();
    woken.dedup();
    if !woken.is_empty() {
        wakeups.wake_all_after_commit(tx, woken);
    }
}

/// The partition count stored for the queue under `root` (`None`: nothing published yet).
pub(crate) async fn stored_partition_count<X: TitoTransaction>(
    tx: &X,
    root: &str,
) -> TitoResult<Option<u32>> {
    Ok(tx
        .get(keys::queue_meta_key(root).as_bytes())
        .await?
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|meta| meta.get("partitions")?.as_u64())
        .map(|p| p as u32))
}

async fn set_aside_under<E: TitoEngine>(
    db: &E,
    root: &str,
    key: &str,
    why: &str,
) -> TitoResult<bool> {
    let parsed = parse_pending_key_arg(root, key)?;
    let aside = keys::aside_key(root, key)?;
    let note_key = keys::undecodable_key(root, key)?;
    let (root, key, why) = (root.to_string(), key.to_string(), why.to_string());
    db.transaction(|tx| {
        let (root, key, why, aside, note_key) = (
            root.clone(),
            key.clone(),
            why.clone(),
            aside.clone(),
            note_key.clone(),
        );
        let (event_id, partition) = (parsed.event_id.clone(), parsed.partition);
        async move {
            // A partition the queue lacks can never hold the row: refused, not "not pending".
            pause::check_partition(&tx, &root, Some(partition)).await?;
            let Some(value) = tx.get(key.as_bytes()).await? else {
                return Ok(false);
            };
            let row: Value = serde_json::from_slice(&value)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&value).into_owned()));
            let mut writes = engine::Writes::default();
            if let Ok(stored) = StoredEvent::parse(&value)
                && let Some(owner) = &stored.owner
            {
                writes.delete(keys::owner_key(
                    &root,
                    &owner.kind,
                    &owner.id,
                    keys::OWNER_PENDING,
                    &key,
                ));
            }
            let id_key = keys::event_id_key(&root, &event_id);
            if tx.get(id_key.as_bytes()).await?.as_deref() == Some(key.as_bytes()) {
                writes.delete(id_key);
            }
            writes.delete(key.clone());
            writes.delete(note_key);
            writes.put(aside, serde_json::to_vec(&AsideRecord { why, row })?);
            writes.apply(&tx).await?;
            Ok::<_, TitoError>(true)
        }
    })
    .await
}
