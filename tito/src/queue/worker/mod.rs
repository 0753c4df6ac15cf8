//! Workers: `run_worker`, `run_transactional_worker` and `run_cluster_worker` share one loop,
//! made of four jobs, each in a file of its own:
//!
//! - [`leases`]: the lease lifecycle (take, renew, drain, release) and the drain rule;
//! - [`pulling`]: per-partition cursors and handler starts;
//! - [`handler`]: supervision of one invocation (timeout, panics, the transactional variant);
//! - [`outcome`]: batched, lease-checked outcome commits.
//!
//! # Shutdown
//!
//! Shutdown is looked at before every lease take, pull and handler start, and it wins every
//! race with other wake-ups: once it is signalled (even before the worker starts), no new pull
//! and no new handler starts. The handlers already started finish (bounded by
//! `handler_timeout`), their outcomes are applied, and meanwhile their partitions' leases (and,
//! in a cluster, the node's heartbeat) keep being renewed; then the leases are released.

mod handler;
mod leases;
mod outcome;
mod policy;
mod pulling;
mod report;

pub(in crate::queue) use outcome::{complete, remove_pending};
pub(crate) use policy::AfterFailure;
pub use policy::{FailurePolicy, MAX_ATTEMPTS};
pub(crate) use report::report_prefix;
pub use report::{
    DEPTH_BOUND, DEPTH_PARTITIONS, DepthSample, MinuteFigures, PartitionRuns, REPORT_DETAIL_BYTES,
    REPORT_EVERY, REPORT_GONE_AFTER, REPORT_KEPT, REPORT_MINUTES, WorkerReport,
};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

use super::Queue;
use super::cluster::{ClusterConfig, Node};
use crate::engine::TitoEngine;
use crate::error::{TitoError, TitoResult};
use crate::event::{QueueEvent, QueueHandlerResult, new_event_id};
use crate::runtime::OwnedTask;
pub use crate::runtime::Shutdown;
use crate::telemetry::names;
use handler::{Failure, Invoker, Report};
use leases::{LeaseKeeper, Maintenance};
use outcome::{Outcome, OutcomeKind};
use pulling::{Cooling, Pulling};
use tracing::Instrument;

/// One invocation being handled: what a handler runs and what its outcome applies to.
pub(super) struct Running {
    pub pulled: crate::queue::pull::Pulled,
    /// The generation of the partition lease it was pulled under.
    pub generation: u64,
    /// The worker's fence slots: each transaction that applies its outcome holds one of its
    /// partition's (see `queue::lease`).
    pub fences: Arc<crate::queue::lease::FencePool>,
    /// How often a transactional handler was called again for this attempt (its transaction
    /// replayed); set by the handler's task.
    pub replays: u64,
}

/// How a worker runs. Build with [`WorkerConfig::new`] and the setters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// The partitions this worker may run (it runs those whose lease it gets).
    pub partitions: Range<u32>,
    /// Handlers in flight at once.
    pub concurrency: usize,
    /// Invocations pulled from one partition at a time.
    pub page_size: usize,
    /// How long a handler may run; past it the invocation stays pending. Also bounds the drain
    /// at shutdown.
    pub handler_timeout: Duration,
    /// How long a partition lease lasts without renewal (renewed every third of it).
    pub lease_duration: Duration,
    /// The longest pause between polls of a partition with nothing runnable. Also the longest
    /// pause before this worker starts an invocation whose handler failed again: the pause
    /// starts at 50 ms and doubles with every failure in a row (the invocation stays pending
    /// meanwhile; another worker may take it sooner). The invocation is started at its
    /// partition's first poll after the pause, so the gap between two runs can reach the pause
    /// plus one idle poll pause.
    pub max_idle_backoff: Duration,
    /// The pause between maintenance passes once their work has caught up. A pass deletes
    /// completed rows past retention, expired commit markers
    /// ([`sweep_commit_markers`](crate::engine::sweep_commit_markers)), expired kv keys (with
    /// [`Self::sweep_kv`]), finished job graphs (with [`Self::expire_graphs`]) and runs one
    /// batch of index builds and drops for every model this
    /// process used on the store ([`crate::schema::maintain`]). Only the maintainer runs it:
    /// every standalone worker, the coordinator in cluster mode.
    pub maintenance_interval: Duration,
    /// Outcomes committed together at most.
    pub outcome_batch: usize,
    /// How long a finished handler's outcome may wait for others to join its transaction: the
    /// worker commits the outcomes it holds once `outcome_batch` of them are ready, once the
    /// first of them has waited this long, or when it stops, whichever comes first. Zero (the
    /// default) commits at once what finished by then; handlers that finish while a commit
    /// runs join the next one, so batches grow with the load without adding latency. A window
    /// adds up to its length to the time from a handler's end to its outcome's commit (and to
    /// the time a limit's slot is held); a crash inside it loses the outcomes it held, so
    /// their handlers run again (at-least-once, as after any crash before a commit). At most a
    /// third of `lease_duration`.
    pub outcome_delay: Duration,
    /// The worker's identity in leases; a fresh one per run by default. A fixed id must be
    /// unique among running workers: two workers with one id would share its leases.
    pub worker_id: Option<String>,
    /// Also prune expired [`crate::kv`] keys during maintenance.
    pub sweep_kv: bool,
    /// Also delete, during maintenance, the records of finished workflows and batches
    /// published more than this long ago ([`WorkerConfig::expire_graphs`]); `None` (the
    /// default) leaves them to [`Graphs::expire`](crate::queue::graph::Graphs::expire) and
    /// `tito gc`.
    pub expire_graphs: Option<Duration>,
    /// What a failed attempt leads to; `None` (the default) leaves the invocation pending,
    /// unchanged, to run again.
    pub failure_policy: Option<FailurePolicy>,
}

impl WorkerConfig {
    /// A worker for these partitions, with the defaults: 16 handlers in flight, pages of 16, a
    /// ten-minute handler timeout, 15-second leases, idle partitions polled at most every 2 s,
    /// maintenance every 30 s, outcome batches of 64 committed as soon as they are ready (no
    /// outcome window).
    pub fn new(partitions: Range<u32>) -> Self {
        WorkerConfig {
            partitions,
            concurrency: 16,
            page_size: 16,
            handler_timeout: Duration::from_secs(600),
            lease_duration: Duration::from_secs(15),
            max_idle_backoff: Duration::from_secs(2),
            maintenance_interval: Duration::from_secs(30),
            outcome_batch: 64,
            outcome_delay: Duration::ZERO,
            worker_id: None,
            sweep_kv: false,
            expire_graphs: None,
            failure_policy: None,
        }
    }

    /// Handlers in flight at once (at least one).
    pub fn concurrency(mut self, handlers: usize) -> Self {
        self.concurrency = handlers.max(1);
        self
    }

    /// Invocations pulled from one partition at a time (at least one).
    pub fn page_size(mut self, size: usize) -> Self {
        self.page_size = size.max(1);
        self
    }

    /// The handler timeout.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// The lease duration.
    pub fn lease_duration(mut self, duration: Duration) -> Self {
        self.lease_duration = duration;
        self
    }

    /// The longest idle pause of a partition.
    pub fn max_idle_backoff(mut self, backoff: Duration) -> Self {
        self.max_idle_backoff = backoff;
        self
    }

    /// The pause between maintenance passes.
    pub fn maintenance_interval(mut self, interval: Duration) -> Self {
        self.maintenance_interval = interval;
        self
    }

    /// Outcomes committed together at most (at least one).
    pub fn outcome_batch(mut self, outcomes: usize) -> Self {
        self.outcome_batch = outcomes.max(1);
        self
    }

    /// The outcome window: how long a finished handler's outcome may wait for others to commit
    /// with it (see [`Self::outcome_delay`](WorkerConfig#structfield.outcome_delay)).
    pub fn outcome_delay(mut self, delay: Duration) -> Self {
        self.outcome_delay = delay;
        self
    }

    /// The worker's identity in leases.
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// Makes the worker's maintenance also prune expired key/value entries (bounded batches,
    /// same cadence as completed-row retention).
    pub fn sweep_kv(mut self, sweep: bool) -> Self {
        self.sweep_kv = sweep;
        self
    }

    /// Makes the worker's maintenance also delete the records of workflows and batches that
    /// finished and were published more than `older_than` ago, as
    /// [`Graphs::expire`](crate::queue::graph::Graphs::expire) does (their ids stop being
    /// idempotency keys then). Each pass looks at up to 256 workflows and 256 batches from
    /// where the last pass stopped, and passes follow at once while they delete and records
    /// remain, so a store's graphs are gone through in turn at a bounded cost per pass. One
    /// worker on the store is enough: graphs belong to the store, not to a queue.
    pub fn expire_graphs(mut self, older_than: Duration) -> Self {
        self.expire_graphs = Some(older_than);
        self
    }

    /// Gives the worker a failure policy: attempts counted, backoff, a dead state.
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = Some(policy);
        self
    }

    /// Checks the settings against each other and against the queue's partition count; the
    /// `run_*` functions call it before they take a lease or start anything.
    ///
    /// Refused, with [`TitoError::InvalidArgument`] naming the setting: an empty partition
    /// range or one that starts past the queue's partitions; zero `concurrency`, `page_size` or
    /// `outcome_batch`; a `lease_duration` under [`MIN_LEASE`] (renewals every third of it
    /// would spin); a zero `handler_timeout`, `maintenance_interval` or `max_idle_backoff`; any
    /// of those durations over [`MAX_SETTING`]; an `outcome_delay` over a third of
    /// `lease_duration` (outcomes held past a renewal); an empty `worker_id`.
    pub fn check(&self, queue_partitions: u32) -> TitoResult<()> {
        let bad = |what: String| Err(TitoError::invalid_argument(what));
        if self.partitions.is_empty() || self.partitions.start >= queue_partitions {
            return bad(format!(
                "WorkerConfig::partitions {:?} holds none of the queue's partitions 0..{queue_partitions}",
                self.partitions
            ));
        }
        for (name, value) in [
            ("concurrency", self.concurrency),
            ("page_size", self.page_size),
            ("outcome_batch", self.outcome_batch),
        ] {
            if value == 0 {
                return bad(format!(
                    "WorkerConfig::{name} is zero; it must be at least 1"
                ));
            }
        }
        // (name, value, shortest accepted): the lease is renewed every third of itself.
        for (name, value, shortest) in [
            ("lease_duration", self.lease_duration, MIN_LEASE),
            (
                "handler_timeout",
                self.handler_timeout,
                Duration::from_nanos(1),
            ),
            (
                "maintenance_interval",
                self.maintenance_interval,
                Duration::from_nanos(1),
            ),
            (
                "max_idle_backoff",
                self.max_idle_backoff,
                Duration::from_nanos(1),
            ),
        ] {
            if value < shortest || value > MAX_SETTING {
                return bad(format!(
                    "WorkerConfig::{name} is {value:?}; it must be more than zero, at least \
                     {shortest:?} and at most {MAX_SETTING:?}"
                ));
            }
        }
        if self.outcome_delay > self.lease_duration / 3 {
            return bad(format!(
                "WorkerConfig::outcome_delay is {:?}; it must be at most a third of \
                 lease_duration ({:?} / 3 = {:?}): lower the delay or lengthen the lease",
                self.outcome_delay,
                self.lease_duration,
                self.lease_duration / 3
            ));
        }
        if self.worker_id.as_deref() == Some("") {
            return bad("WorkerConfig::worker_id is empty".into());
        }
        if let Some(policy) = &self.failure_policy {
            policy.check()?;
        }
        Ok(())
    }
}

/// The shortest partition lease accepted.
pub const MIN_LEASE: Duration = Duration::from_millis(30);

/// The longest duration any worker, cluster or inbox setting accepts (30 days): longer ones are
/// a mistake, and timers past it would overflow.
pub const MAX_SETTING: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Shutdown as the loop sees it: asked for or not, polled without waiting.
pub(super) struct Stop {
    signal: Option<BoxFuture<'static, ()>>,
}

impl Stop {
    fn new(shutdown: impl Shutdown) -> Self {
        Stop {
            signal: Some(shutdown.wait()),
        }
    }

    /// Whether shutdown was asked for (the signal is polled once, never after it resolved).
    pub fn requested(&mut self) -> bool {
        match &mut self.signal {
            None => true,
            Some(signal) => {
                if signal.as_mut().now_or_never().is_some() {
                    self.signal = None;
                    true
                } else {
                    false
                }
            }
        }
    }

    /// Resolves when shutdown is asked for.
    async fn wait(&mut self) {
        if let Some(signal) = &mut self.signal {
            signal.await;
            self.signal = None;
        }
    }
}

/// Runs a worker until `shutdown` resolves: leases the configured partitions, hands runnable
/// invocations of type `T` to `handler` (several at once), applies each outcome in a transaction
/// that re-checks the partition lease, and deletes expired completed rows. Returns after the
/// handlers that started have finished (bounded by the handler timeout), their outcomes were
/// applied and the leases released. A configuration that [`WorkerConfig::check`] refuses is
/// returned as [`TitoError::InvalidArgument`] before anything is read or written.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    if let Err(err) = config.check(queue.config().partitions) {
        return Box::pin(async move { Err(err) });
    }
    let invoke = handler::plain(handler, config.handler_timeout);
    let id = worker_id(&config);
    let leases = standalone_leases(&queue, &config, id);
    // Boxed here, where the engine is generic: the compiler proves the loop `Send` once, instead
    // of at every call site with a concrete engine (where it trips over higher-ranked lifetimes).
    Box::pin(worker_loop(queue, config, leases, invoke, shutdown))
}

impl crate::runtime::Workers {
    /// Starts [`run_worker`] in this set: `queue`'s partitions `config` names, `handler` typed by
    /// the event. `queue` is a queue handle (`Arc<Queue<E>>`; the handler names its payload
    /// type) or a [`TopicQueue`](super::TopicQueue) (the handler must take its payload type).
    pub fn spawn_worker<E, T, F, Fut>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        config: WorkerConfig,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Send + 'static,
        F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    {
        let (queue, config) = declared(queue, config);
        self.spawn(|stop| run_worker(queue, config, handler, stop))
    }

    /// [`spawn_worker`](Self::spawn_worker) with shared state: `handler` gets its own clone of
    /// `state` with every event (as axum hands `State` to a route), so it needs no clones of
    /// its own.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tito::queue::Topic;
    /// # use tito::{QueueEvent, QueueHandlerOutcome, Workers, WorkerConfig};
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), tito::TitoError> {
    /// # let db = tito::Embedded::temporary().await?;
    /// const SIGNUPS: Topic<String> = Topic::new("signups");
    /// let signups = SIGNUPS.spec(4, Duration::from_secs(3600)).open(db.clone()).await?;
    /// let kv = tito::kv::Kv::new(db.clone());
    /// let mut workers = Workers::new();
    /// workers.spawn_worker_with(&signups, WorkerConfig::new(0..4), kv, |kv, event: QueueEvent<String>| async move {
    ///     kv.incr("signups", &event.payload, 1, None).await?;
    ///     Ok(QueueHandlerOutcome::Acknowledge)
    /// });
    /// workers.shutdown().await?;
    /// # db.close().await
    /// # }
    /// ```
    pub fn spawn_worker_with<E, T, S, F, Fut>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        config: WorkerConfig,
        state: S,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Send + 'static,
        S: Clone + Send + Sync + 'static,
        F: Fn(S, QueueEvent<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    {
        self.spawn_worker(queue, config, move |event| handler(state.clone(), event))
    }

    /// Starts [`run_transactional_worker`] in this set (`queue` as for
    /// [`spawn_worker`](Self::spawn_worker)).
    pub fn spawn_transactional_worker<E, T, F, Fut>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        config: WorkerConfig,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    {
        let (queue, config) = declared(queue, config);
        self.spawn(|stop| run_transactional_worker(queue, config, handler, stop))
    }

    /// [`spawn_transactional_worker`](Self::spawn_transactional_worker) with shared state, as
    /// [`spawn_worker_with`](Self::spawn_worker_with).
    pub fn spawn_transactional_worker_with<E, T, S, F, Fut>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        config: WorkerConfig,
        state: S,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        S: Clone + Send + Sync + 'static,
        F: Fn(S, QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    {
        self.spawn_transactional_worker(queue, config, move |event, tx| {
            handler(state.clone(), event, tx)
        })
    }

    /// Starts [`run_cluster_worker`] in this set (`queue` as for
    /// [`spawn_worker`](Self::spawn_worker)).
    pub fn spawn_cluster_worker<E, T, F, Fut>(
        &mut self,
        queue: impl super::WorkerQueue<E, T>,
        config: WorkerConfig,
        cluster: ClusterConfig,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Send + 'static,
        F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    {
        let (queue, config) = declared(queue, config);
        self.spawn(|stop| run_cluster_worker(queue, config, cluster, handler, stop))
    }
}

/// The queue a worker runs on, and its config with the queue's declared failure policy when the
/// config has none.
fn declared<E, T>(
    queue: impl super::WorkerQueue<E, T>,
    mut config: WorkerConfig,
) -> (Arc<Queue<E>>, WorkerConfig) {
    if config.failure_policy.is_none() {
        config.failure_policy = queue.declared_failure_policy();
    }
    (queue.into_queue(), config)
}

/// Like [`run_worker`], but each handler runs inside the transaction that applies its outcome:
/// its writes (an idempotency marker, the effect, model writes with events) and the
/// acknowledgement or replacement commit together or not at all. The transaction is replayed
/// after a conflict, so the handler may run more than once per delivery; its storage effects
/// apply once. An error, panic, timeout or lost lease rolls everything back and leaves the
/// invocation pending. Lease renewals never conflict with these transactions (see
/// [`crate::queue`]'s lease notes), so a handler of any length under the timeout commits on
/// its first attempt when nothing else touched its rows.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_transactional_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    if let Err(err) = config.check(queue.config().partitions) {
        return Box::pin(async move { Err(err) });
    }
    let id = worker_id(&config);
    let invoke = handler::transactional(&queue, id.clone(), handler, config.handler_timeout);
    let leases = standalone_leases(&queue, &config, id);
    Box::pin(worker_loop(queue, config, leases, invoke, shutdown))
}

/// [`run_worker`] in cluster mode: the node joins the queue's cluster (see
/// [`ClusterConfig`](crate::queue::ClusterConfig)) and runs the partitions the membership assigns to it, instead of
/// a configured range (`config.partitions` is ignored). Completed-row retention runs on the
/// elected coordinator only, starting the moment it is elected.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_cluster_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    mut config: WorkerConfig,
    cluster: ClusterConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    config.partitions = 0..queue.config().partitions;
    if let Err(err) = config.check(queue.config().partitions).and(cluster.check()) {
        return Box::pin(async move { Err(err) });
    }
    let node = Node::new(cluster);
    config.worker_id = Some(node.id.clone());
    let invoke = handler::plain(handler, config.handler_timeout);
    let fences = crate::queue::lease::fence_count(config.concurrency);
    let leases = LeaseKeeper::cluster(queue.clone(), node, fences);
    Box::pin(worker_loop(queue, config, leases, invoke, shutdown))
}

fn worker_id(config: &WorkerConfig) -> String {
    config
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("worker-{}", new_event_id()))
}

fn standalone_leases<E: TitoEngine>(
    queue: &Arc<Queue<E>>,
    config: &WorkerConfig,
    id: String,
) -> LeaseKeeper<E> {
    let partitions = config
        .partitions
        .clone()
        .filter(|p| *p < queue.config().partitions)
        .collect();
    let fences = crate::queue::lease::fence_count(config.concurrency);
    LeaseKeeper::standalone(queue.clone(), id, partitions, config.lease_duration, fences)
}

async fn worker_loop<E, T, S>(
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    mut leases: LeaseKeeper<E>,
    invoke: Invoker<T>,
    shutdown: S,
) -> TitoResult<()>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    S: Shutdown,
{
    let mut stop = Stop::new(shutdown);
    // A partition count that contradicts the queue's stored one is a mistake in the program,
    // not a passing failure: the worker ends with it before it takes a lease, also when it is
    // asked to stop before it started, so the set's shutdown says it. (An unreachable store is
    // passing: the lease ticks retry.)
    if let Err(err @ TitoError::InvalidArgument(_)) = check_partitions(&queue).await {
        return Err(err);
    }
    if stop.requested() {
        // Asked to stop before it started: take nothing, start nothing.
        return Ok(());
    }
    // Owned by this future: dropped (the worker's task aborted, its future dropped), it aborts
    // the maintenance task, which would otherwise hold the store forever.
    let (stop_maintenance, maintenance_stopped) = tokio::sync::watch::channel(false);
    let maintenance = spawn_maintenance(&queue, &config, leases.maintenance(), maintenance_stopped);
    let mut pulling = Pulling::new(
        config.max_idle_backoff,
        config.page_size,
        config.concurrency,
        config.lease_duration / 3,
        leases.holder(),
    );
    let mut reporter = report::Reporter::new(leases.id());
    let mut listening = crate::event::nudge::Registration::new(leases.id());
    pulling.figures = reporter.figures.clone();
    // Invocations handed to handlers and not yet settled (running, or outcome not committed),
    // with their partitions: the partitions that cannot be released yet.
    let mut in_flight: HashMap<String, u32> = HashMap::new();
    let mut handlers: JoinSet<(Running, Report<T>)> = JoinSet::new();
    let mut ready: Vec<Outcome> = Vec::new();
    // When the outcomes in `ready` are committed at the latest (the first of them waited the
    // outcome window).
    let mut window_ends: Option<tokio::time::Instant> = None;
    // The outcome commit in flight, with the keys it holds.
    let mut committing: Option<(OwnedTask<outcome::Committed>, Vec<String>)> = None;
    let mut stopping = false;

    loop {
        pulling.release_settled(&queue, &in_flight).await;
        stopping = stopping || stop.requested();
        let busy: HashSet<u32> = in_flight.values().copied().collect();
        leases.tick(&busy, stopping).await;
        if reporter.due() {
            let held: Vec<u32> = leases.runnable().map(|(partition, _)| partition).collect();
            reporter.write(&queue, false, &held).await;
        }
        if !stopping {
            listening.write_if_due(queue.engine(), &queue.wakeups).await;
        }
        stopping = stopping || stop.requested();
        if !stopping {
            pulling.sync(leases.runnable());
            pulling
                .start(
                    &queue,
                    leases.fresh_until(),
                    &mut in_flight,
                    &mut handlers,
                    &invoke,
                    &mut stop,
                )
                .await;
        }
        pulling.check_cancelled(&queue, &in_flight).await;
        // Collect every finished handler, then commit their outcomes together.
        while let Some(Some(joined)) = handlers.join_next().now_or_never() {
            collect(
                &queue,
                &config,
                joined,
                &mut ready,
                &mut in_flight,
                &mut pulling.cooling,
            );
        }
        if !ready.is_empty() && committing.is_none() {
            let now = tokio::time::Instant::now();
            let ends = *window_ends.get_or_insert(now + config.outcome_delay);
            // While the window is open the loop goes on (starting handlers, collecting those
            // that finish) and wakes at its end at the latest.
            if ready.len() >= config.outcome_batch || stopping || now >= ends {
                window_ends = None;
                // Committed beside the loop, which goes on pulling and starting meanwhile (on
                // TiKV a commit is several round trips): the keys stay in flight, so no pull
                // returns them, their partitions stay held and their limit slots stay taken
                // until the result is filed. One commit at a time: what finishes meanwhile
                // joins the next.
                let outcomes = std::mem::take(&mut ready);
                let keys: Vec<String> = outcomes
                    .iter()
                    .map(|o| o.running.pulled.key.clone())
                    .collect();
                let (queue, owner) = (queue.clone(), leases.id().to_string());
                let (cluster, batch) = (leases.is_cluster(), config.outcome_batch);
                let task = OwnedTask::spawn(async move {
                    outcome::commit(&queue, &owner, cluster, batch, outcomes).await
                });
                committing = Some((task, keys));
                continue;
            }
        }
        if stopping && handlers.is_empty() && ready.is_empty() && committing.is_none() {
            pulling.release_settled(&queue, &in_flight).await;
            break;
        }
        let mut wake_at = leases.next_at();
        if let Some(ends) = window_ends {
            wake_at = wake_at.min(ends);
        }
        if let Some(check) = pulling.next_cancel_check() {
            wake_at = wake_at.min(check);
        }
        // Stale leases start nothing: wait for the next renewal instead of polling.
        let fresh = tokio::time::Instant::now() < leases.fresh_until();
        if !stopping
            && fresh
            && let Some(poll) = pulling.next_wake(handlers.len())
        {
            wake_at = wake_at.min(poll);
        }
        let (wakeups, seen) = (queue.wakeups.clone(), pulling.seen());
        // Biased: a shutdown signal wins over every other wake-up.
        tokio::select! {
            biased;
            _ = stop.wait(), if !stopping => stopping = true,
            joined = handlers.join_next(), if !handlers.is_empty() => {
                if let Some(joined) = joined {
                    let cooling = &mut pulling.cooling;
                    collect(&queue, &config, joined, &mut ready, &mut in_flight, cooling);
                }
            }
            committed = async { (&mut committing.as_mut().expect("guarded").0).await }, if committing.is_some() => {
                let (_, keys) = committing.take().expect("guarded");
                match committed {
                    Ok(committed) => {
                        for key in committed.done {
                            in_flight.remove(&key);
                        }
                        if committed.lease_lost {
                            // This host's timer says the leases are fresh, the store's clock
                            // says one is not (it jumped ahead): starting more handlers would
                            // run them for nothing (their outcomes refused) until the next
                            // renewal, which comes now.
                            leases.renew_now();
                        }
                    }
                    Err(err) => {
                        // Only a panic gets here: the outcomes' rows stay pending and run again.
                        tracing::error!(error = %err, "an outcome commit was lost");
                        for key in keys {
                            in_flight.remove(&key);
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(wake_at) => {}
            // A commit in this process published to the queue: `start` reads which partitions.
            _ = wakeups.changed_since(seen), if !stopping => {}
        }
    }
    // Gone before the worker returns: a maintenance task still alive when the program's runtime
    // shuts down would be polled without timers and panic. A pass in progress finishes first
    // (bounded), so what it committed is counted before the worker returns.
    let _ = stop_maintenance.send(true);
    maintenance.join_within(MAINTENANCE_DRAIN).await;
    leases.release_all().await;
    listening.remove(queue.engine(), &queue.wakeups).await;
    reporter.write(&queue, true, &[]).await;
    Ok(())
}

/// Checks (and on first use records) the queue's partition count in a transaction of its own.
pub(in crate::queue) async fn check_partitions<E: TitoEngine>(queue: &Queue<E>) -> TitoResult<()> {
    queue
        .engine()
        .transaction(|tx| async move { queue.ensure_meta(&tx).await })
        .await
}

/// Files one finished handler: an outcome to commit, or a failure (the invocation stays
/// pending and is forgotten here).
fn collect<E: TitoEngine, T: Serialize>(
    queue: &Queue<E>,
    config: &WorkerConfig,
    joined: Result<(Running, Report<T>), tokio::task::JoinError>,
    ready: &mut Vec<Outcome>,
    in_flight: &mut HashMap<String, u32>,
    cooling: &mut Cooling,
) {
    let counters = queue.counters();
    let (running, report) = match joined {
        Ok(done) => done,
        Err(err) => {
            // Only an aborted task gets here; panics are caught in the task.
            tracing::error!(error = %err, "a handler task was lost");
            return;
        }
    };
    let outcome = match report {
        Report::Applied { rescheduled } => {
            if rescheduled {
                queue.count(&counters.rescheduled, names::QUEUE_RESCHEDULED, 1);
            } else {
                queue.count(&counters.acknowledged, names::QUEUE_ACKNOWLEDGED, 1);
            }
            cooling.settled(&running.pulled.key);
            in_flight.remove(&running.pulled.key);
            return;
        }
        Report::Failed(failure) => Err(failure),
        Report::Done(handled) => match outcome::successor(&running.pulled.stored, &handled) {
            Ok(Some(next)) => Ok(OutcomeKind::Reschedule(Box::new(next))),
            Ok(None) => Ok(OutcomeKind::Acknowledge {
                result: outcome::result_of(handled),
            }),
            Err(why) => Err(Failure::of_handler(TitoError::InvalidArgument(why))),
        },
    };
    match outcome {
        Ok(kind) => {
            cooling.settled(&running.pulled.key);
            ready.push(Outcome { running, kind })
        }
        Err(failure) => {
            queue.count(&counters.failed, names::QUEUE_FAILED, 1);
            let attempt = running.pulled.stored.failures.saturating_add(1);
            // The event's own attempts override the worker's policy (or make one).
            let own = running.pulled.stored.max_attempts;
            let policy = match (config.failure_policy.clone(), own) {
                (Some(policy), Some(attempts)) => Some(policy.attempts(attempts)),
                (Some(policy), None) => Some(policy),
                (None, Some(attempts)) => Some(FailurePolicy::new(attempts)),
                (None, None) => None,
            };
            let policy = policy.as_ref().filter(|_| failure.counts);
            match policy.map(|p| p.after_failure(attempt, failure.panicked)) {
                // The policy's outcome commits like any other; until it does the row stays
                // in flight here.
                Some(after) => {
                    let pulled = &running.pulled;
                    tracing::warn!(queue = %queue.label(), partition = pulled.parsed.partition, event_id = %pulled.stored.id, key = %pulled.stored.key, attempt, error = %failure.error, ?after, "handler failed");
                    let error = failure.error.to_string();
                    let kind = match after {
                        AfterFailure::Retry(backoff) => OutcomeKind::Retry { backoff, error },
                        AfterFailure::Dead => OutcomeKind::Dead { error },
                    };
                    cooling.settled(&running.pulled.key);
                    ready.push(Outcome { running, kind });
                }
                None => {
                    cooling.failed(&running.pulled.key, config.max_idle_backoff);
                    let pulled = &running.pulled;
                    tracing::warn!(queue = %queue.label(), partition = pulled.parsed.partition, event_id = %pulled.stored.id, key = %pulled.stored.key, error = %failure.error, "handler failed; invocation left pending");
                    in_flight.remove(&running.pulled.key);
                }
            }
        }
    }
}

/// How long a stopping worker waits for a maintenance pass in progress to finish before it
/// aborts it.
const MAINTENANCE_DRAIN: Duration = Duration::from_secs(10);

/// Retention (and optionally the kv sweep) while this worker is the maintainer: at once when it
/// becomes one, then every `maintenance_interval`, or at once again after a full batch. Ends
/// between passes once `stop` is set (or its sender is gone); a pass is never cut short by it.
fn spawn_maintenance<E: TitoEngine>(
    queue: &Arc<Queue<E>>,
    config: &WorkerConfig,
    maintenance: Arc<Maintenance>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> OwnedTask<()> {
    let queue = queue.clone();
    let interval = config.maintenance_interval;
    let sweep_kv = config.sweep_kv;
    let mut graphs = config
        .expire_graphs
        .map(|older_than| (older_than, crate::queue::graph::GraphSweep::default()));
    OwnedTask::spawn(async move {
        loop {
            if *stop.borrow() {
                return;
            }
            if !maintenance.on() {
                tokio::select! {
                    biased;
                    _ = stopped(&mut stop) => return,
                    _ = maintenance.started() => continue,
                }
            }
            let span = tracing::debug_span!("tito.maintenance", queue = %queue.label());
            let full = maintenance_pass(&queue, sweep_kv, graphs.as_mut())
                .instrument(span)
                .await;
            if full {
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    biased;
                    _ = stopped(&mut stop) => return,
                    _ = tokio::time::sleep(interval) => {}
                    // Losing and regaining the role within an interval runs a pass at once.
                    _ = maintenance.started() => {}
                }
            }
        }
    })
}

/// Resolves once `stop` is set or its sender is gone.
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// One maintenance pass; whether some step did a full batch (more may be waiting).
async fn maintenance_pass<E: TitoEngine>(
    queue: &Queue<E>,
    sweep_kv: bool,
    graphs: Option<&mut (Duration, crate::queue::graph::GraphSweep)>,
) -> bool {
    let mut full = false;
    match queue.expire_completed().await {
        // A full batch: more may be waiting; continue at once.
        Ok(deleted) => full |= deleted == super::RETENTION_BATCH,
        Err(err) => tracing::warn!(error = %err, "queue maintenance failed"),
    }
    match queue.sweep_undecodable().await {
        Ok(deleted) => full |= deleted == super::RETENTION_BATCH,
        Err(err) => tracing::warn!(error = %err, "sweeping undecodable notes failed"),
    }
    match queue.restore_unrated().await {
        Ok(restored) if restored > 0 => {
            tracing::info!(
                restored,
                "rows a lifted rate limit had moved returned to their due time"
            )
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "returning rate-moved rows failed"),
    }
    match queue.sweep_unique().await {
        Ok(deleted) => full |= deleted == super::RETENTION_BATCH,
        Err(err) => tracing::warn!(error = %err, "sweeping expired unique keys failed"),
    }
    // Graph ends whose fold did not run where they were committed (a crash, an unknown
    // outcome): folded here.
    match crate::queue::graph::fold::sweep(queue.engine()).await {
        Ok(0) => {}
        Ok(graphs) => tracing::info!(graphs, "graph ends left unfolded were folded"),
        Err(err) => tracing::warn!(error = %err, "folding graph ends left behind failed"),
    }
    if sweep_kv {
        match crate::kv::sweep_expired(queue.engine(), crate::kv::SWEEP_BATCH).await {
            Ok(deleted) => full |= deleted == crate::kv::SWEEP_BATCH,
            Err(err) => tracing::warn!(error = %err, "kv sweep failed"),
        }
    }
    if let Some((older_than, sweep)) = graphs {
        let store = crate::queue::graph::Graphs::new(queue.engine().clone());
        match store.expire_step(*older_than, sweep).await {
            Ok((expired, more)) => {
                let deleted = expired.workflows + expired.batches;
                if deleted > 0 {
                    tracing::info!(
                        workflows = expired.workflows,
                        batches = expired.batches,
                        "finished graphs expired"
                    );
                }
                // Go on at once while pages delete; a pass over records that stay waits.
                full |= more && deleted > 0;
            }
            Err(err) => tracing::warn!(error = %err, "expiring finished graphs failed"),
        }
    }
    // Outcome transactions write commit markers; the maintainer expires them.
    let batch = crate::engine::COMMIT_MARKER_SWEEP_BATCH;
    match crate::engine::sweep_commit_markers(queue.engine(), batch).await {
        Ok(deleted) => full |= deleted == batch,
        Err(err) => tracing::warn!(error = %err, "commit marker sweep failed"),
    }
    // Index builds and drops of the models this process uses: one batch per table.
    full |= crate::schema::maintain(queue.engine()).await > 0;
    full
}
