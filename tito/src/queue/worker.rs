//! `run_worker`: leases, pulls, concurrent handlers under a timeout, batched outcome commits,
//! maintenance, and a draining shutdown.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::cluster::{ClusterConfig, Node};
use super::event::{
    QueueEvent, QueueHandlerOutcome, QueueHandlerResult, StoredEvent, new_event_id,
};
use super::lease::{self, Lease};
use super::pull::{Cursor, Pulled};
use super::{Queue, QueueStats, write_pending};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

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
    /// The longest pause between polls of a partition with nothing runnable.
    pub max_idle_backoff: Duration,
    /// The pause between maintenance passes once retention has caught up.
    pub maintenance_interval: Duration,
    /// Outcomes committed together at most.
    pub outcome_batch: usize,
    /// The worker's identity in leases; a fresh one per run by default.
    pub worker_id: Option<String>,
    /// Also prune expired [`crate::kv`] keys during maintenance.
    pub sweep_kv: bool,
}

impl WorkerConfig {
    /// A worker for these partitions, with the defaults: 16 handlers in flight, pages of 16, a
    /// ten-minute handler timeout, 15-second leases, idle partitions polled at most every 2 s,
    /// maintenance every 30 s, outcome batches of 64.
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
            worker_id: None,
            sweep_kv: false,
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
}

/// What stops a worker: `run_worker` stops pulling once it resolves, drains the handlers that
/// started and returns.
pub trait Shutdown: Send + 'static {
    /// Resolves when the worker must stop.
    fn wait(self) -> BoxFuture<'static, ()>;
}

impl Shutdown for tokio::sync::watch::Receiver<bool> {
    /// Stops when the value becomes `true` or the sender is dropped.
    fn wait(mut self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let _ = self.wait_for(|stop| *stop).await;
        })
    }
}

impl<T: Send + 'static> Shutdown for tokio::sync::oneshot::Receiver<T> {
    /// Stops when a value is sent or the sender is dropped.
    fn wait(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let _ = self.await;
        })
    }
}

impl<T: Clone + Send + 'static> Shutdown for tokio::sync::broadcast::Receiver<T> {
    /// Stops at the first message, or when every sender is dropped.
    fn wait(mut self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            loop {
                match self.recv().await {
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    _ => return,
                }
            }
        })
    }
}

impl Shutdown for BoxFuture<'static, ()> {
    fn wait(self) -> BoxFuture<'static, ()> {
        self
    }
}

/// One invocation being handled.
struct Running {
    pulled: Pulled,
    generation: u64,
}

/// What a handler task reports.
enum Report<T> {
    /// The handler decided; the worker applies the outcome.
    Done(QueueHandlerOutcome<T>),
    /// A transactional handler's outcome already committed with its work.
    Applied {
        rescheduled: bool,
    },
    Failed(String),
}

/// Runs one invocation to its report (the handler, under the timeout, panics caught).
type Invoker<T> =
    Arc<dyn Fn(Running, QueueEvent<T>) -> BoxFuture<'static, (Running, Report<T>)> + Send + Sync>;

/// Runs a handler that decides an outcome for the worker to apply (`run_worker`,
/// `run_cluster_worker`).
fn plain_invoker<T, F, Fut>(handler: F, timeout: Duration) -> Invoker<T>
where
    T: Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    let handler = Arc::new(handler);
    Arc::new(move |running, event| {
        let handler = handler.clone();
        Box::pin(async move {
            let report = match supervise(timeout, async move {
                handler(event)
                    .await
                    .map_err(|err| format!("handler error: {err}"))
            })
            .await
            {
                Ok(outcome) => Report::Done(outcome),
                Err(why) => Report::Failed(why),
            };
            (running, report)
        })
    })
}

/// Catches a panic and enforces the timeout around one invocation's work.
async fn supervise<R>(
    timeout: Duration,
    work: impl Future<Output = Result<R, String>> + Send,
) -> Result<R, String> {
    match tokio::time::timeout(timeout, AssertUnwindSafe(work).catch_unwind()).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err("handler panicked".into()),
        Err(_) => Err(format!("handler timed out after {timeout:?}")),
    }
}

/// An outcome ready to commit.
struct Outcome {
    running: Running,
    replacement: Option<StoredEvent>,
}

struct PartitionState {
    cursor: Cursor,
    next_poll: Instant,
    backoff: Duration,
}

const MIN_IDLE_BACKOFF: Duration = Duration::from_millis(10);

/// Runs a worker until `shutdown` resolves: leases the configured partitions, hands runnable
/// invocations of type `T` to `handler` (several at once), applies each outcome in a transaction
/// that re-checks the partition lease, and deletes expired completed rows. Returns after the
/// handlers that started have finished (bounded by the handler timeout) and their outcomes were
/// applied.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, ()>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    let invoke = plain_invoker(handler, config.handler_timeout);
    // Boxed here, where the engine is generic: the compiler proves the loop `Send` once, instead
    // of at every call site with a concrete engine (where it trips over higher-ranked lifetimes).
    Box::pin(worker_loop(queue, config, None, invoke, shutdown))
}

/// Like [`run_worker`], but each handler runs inside the transaction that applies its outcome:
/// its writes (an idempotency marker, the effect, model writes with events) and the
/// acknowledgement or replacement commit together or not at all. The transaction is replayed
/// after a conflict, so the handler may run more than once per delivery; its storage effects
/// apply once. An error, panic, timeout or lost lease rolls everything back and leaves the
/// invocation pending.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_transactional_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    mut config: WorkerConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, ()>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    let owner = config
        .worker_id
        .get_or_insert_with(|| format!("worker-{}", new_event_id()))
        .clone();
    let timeout = config.handler_timeout;
    let handler = Arc::new(handler);
    let db = queue.engine().clone();
    let root = queue.root().to_string();
    let partitions = queue.config().partitions;
    let invoke: Invoker<T> = Arc::new(move |running: Running, event: QueueEvent<T>| {
        let (handler, db, root, owner) = (handler.clone(), db.clone(), root.clone(), owner.clone());
        let (pulled, generation) = (running.pulled.clone(), running.generation);
        Box::pin(async move {
            let work = db.transaction(|tx| {
                let (handler, event, pulled, root, owner) = (
                    handler.clone(),
                    event.clone(),
                    pulled.clone(),
                    root.clone(),
                    owner.clone(),
                );
                async move {
                    let outcome = handler(event, tx.clone()).await?;
                    let next = match outcome {
                        QueueHandlerOutcome::Acknowledge => None,
                        QueueHandlerOutcome::Reschedule(next) => Some(
                            replacement(&pulled.stored, &next)
                                .map_err(TitoError::InvalidArgument)?,
                        ),
                    };
                    let partition = pulled.parsed.partition;
                    if !lease::still_held(&tx, &root, partition, &owner, generation).await? {
                        return Err(TitoError::LeaseLost(format!("partition {partition}")));
                    }
                    if !complete(&tx, &root, partitions, &pulled, next.as_ref()).await? {
                        return Err(TitoError::NotFound(format!(
                            "invocation {} is no longer pending",
                            pulled.key
                        )));
                    }
                    Ok::<_, TitoError>(next.is_some())
                }
            });
            let report =
                match supervise(
                    timeout,
                    async move { work.await.map_err(|err| err.to_string()) },
                )
                .await
                {
                    Ok(rescheduled) => Report::Applied { rescheduled },
                    Err(why) => Report::Failed(why),
                };
            (running, report)
        })
    });
    Box::pin(worker_loop(queue, config, None, invoke, shutdown))
}

/// [`run_worker`] in cluster mode: the node joins the queue's cluster (see
/// [`crate::queue::cluster`]) and runs the partitions the membership assigns to it, instead of
/// a configured range (`config.partitions` is ignored). Completed-row retention runs on the
/// elected coordinator only.
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_cluster_worker<E, T, F, Fut, S>(
    queue: Arc<Queue<E>>,
    mut config: WorkerConfig,
    cluster: ClusterConfig,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, ()>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
    S: Shutdown,
{
    let node = Node::new(cluster);
    config.worker_id = Some(node.id.clone());
    config.partitions = 0..queue.config().partitions;
    let invoke = plain_invoker(handler, config.handler_timeout);
    Box::pin(worker_loop(queue, config, Some(node), invoke, shutdown))
}

async fn worker_loop<E, T, S>(
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    node: Option<Node>,
    invoke: Invoker<T>,
    shutdown: S,
) where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Send + 'static,
    S: Shutdown,
{
    let mut worker = Worker::new(queue, config, node);
    let mut shutdown = shutdown.wait();
    let maintenance = worker.spawn_maintenance();
    let mut handlers: JoinSet<(Running, Report<T>)> = JoinSet::new();
    let mut ready: Vec<Outcome> = Vec::new();
    let mut stopping = false;

    loop {
        if !stopping {
            worker.renew_leases_if_due().await;
            worker.start_handlers(&mut handlers, &invoke).await;
        }
        // Collect every finished handler, then commit their outcomes together.
        while let Some(Some(joined)) = handlers.join_next().now_or_never() {
            worker.collect(joined, &mut ready);
        }
        if !ready.is_empty() {
            worker.commit(std::mem::take(&mut ready)).await;
            continue;
        }
        if stopping && handlers.is_empty() {
            break;
        }
        let wake_at = if stopping {
            Instant::now() + Duration::from_secs(3600)
        } else {
            worker.next_wake()
        };
        let wakeups = worker.queue.wakeups.clone();
        tokio::select! {
            joined = handlers.join_next(), if !handlers.is_empty() => {
                if let Some(joined) = joined {
                    worker.collect(joined, &mut ready);
                }
            }
            _ = tokio::time::sleep_until(wake_at) => {}
            _ = wakeups.notify.notified(), if !stopping => {}
            _ = &mut shutdown, if !stopping => {
                stopping = true;
            }
        }
    }
    maintenance.abort();
    worker.release_leases().await;
}

struct Worker<E> {
    queue: Arc<Queue<E>>,
    config: WorkerConfig,
    id: String,
    leases: HashMap<u32, Lease>,
    next_lease_at: Instant,
    partitions: HashMap<u32, PartitionState>,
    in_flight: HashSet<String>,
    /// Cluster mode: this node's membership.
    node: Option<Node>,
    /// Whether this worker runs retention (always standalone; the coordinator in a cluster).
    maintains: Arc<AtomicBool>,
    /// Cluster mode: partitions assigned away, still held until their handlers finish.
    draining: HashSet<u32>,
}

impl<E: TitoEngine> Worker<E> {
    fn new(queue: Arc<Queue<E>>, config: WorkerConfig, node: Option<Node>) -> Self {
        let id = config
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("worker-{}", new_event_id()));
        let maintains = Arc::new(AtomicBool::new(node.is_none()));
        Worker {
            queue,
            config,
            id,
            leases: HashMap::new(),
            next_lease_at: Instant::now(),
            partitions: HashMap::new(),
            in_flight: HashSet::new(),
            node,
            maintains,
            draining: HashSet::new(),
        }
    }

    fn stats(&self) -> &QueueStats {
        self.queue.stats()
    }

    fn spawn_maintenance(&self) -> tokio::task::JoinHandle<()> {
        let queue = self.queue.clone();
        let interval = self.config.maintenance_interval;
        let sweep_kv = self.config.sweep_kv;
        let maintains = self.maintains.clone();
        tokio::spawn(async move {
            loop {
                if !maintains.load(Ordering::Relaxed) {
                    tokio::time::sleep(interval).await;
                    continue;
                }
                let mut full = false;
                match queue.expire_completed().await {
                    // A full batch: more may be waiting; continue at once.
                    Ok(deleted) => full |= deleted == super::RETENTION_BATCH,
                    Err(err) => tracing::warn!(error = %err, "queue maintenance failed"),
                }
                if sweep_kv {
                    match crate::kv::sweep_expired(queue.engine(), crate::kv::SWEEP_BATCH).await {
                        Ok(deleted) => full |= deleted == crate::kv::SWEEP_BATCH,
                        Err(err) => tracing::warn!(error = %err, "kv sweep failed"),
                    }
                }
                if full {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(interval).await;
                }
            }
        })
    }

    async fn renew_leases_if_due(&mut self) {
        if Instant::now() < self.next_lease_at {
            return;
        }
        if self.node.is_some() {
            self.cluster_tick().await;
            return;
        }
        let duration_ms = u64::try_from(self.config.lease_duration.as_millis()).unwrap_or(u64::MAX);
        let partitions: Vec<u32> = self
            .config
            .partitions
            .clone()
            .filter(|p| *p < self.queue.config().partitions)
            .collect();
        let result = async {
            let tx = self.queue.engine().begin().await?;
            let checked = self.queue.ensure_meta(&tx).await;
            match checked {
                Ok(()) => tx.commit().await?,
                Err(err) => {
                    let _ = tx.rollback().await;
                    return Err(err);
                }
            }
            lease::acquire(
                self.queue.engine(),
                self.queue.root(),
                &partitions,
                &self.id,
                duration_ms,
            )
            .await
        }
        .await;
        match result {
            Ok(held) => {
                for partition in self.leases.keys() {
                    let kept = held.get(partition).is_some_and(|l| {
                        Some(l.generation) == self.leases.get(partition).map(|o| o.generation)
                    });
                    if !kept {
                        QueueStats::bump(&self.stats().leases_lost, 1);
                    }
                }
                self.partitions.retain(|p, _| held.contains_key(p));
                for partition in held.keys() {
                    self.partitions
                        .entry(*partition)
                        .or_insert_with(|| PartitionState {
                            cursor: Cursor::new(*partition),
                            next_poll: Instant::now(),
                            backoff: MIN_IDLE_BACKOFF,
                        });
                }
                self.leases = held;
                self.next_lease_at = Instant::now() + self.config.lease_duration / 3;
            }
            Err(err) => {
                tracing::warn!(error = %err, "partition lease renewal failed");
                self.next_lease_at = Instant::now() + self.config.lease_duration / 10;
            }
        }
    }

    /// Cluster mode: heartbeat, election, assignment; take assigned partitions, drain and
    /// release the ones assigned away.
    async fn cluster_tick(&mut self) {
        let node = self.node.as_ref().expect("cluster mode");
        let interval = node.config.node_ttl / 3;
        let partitions = self.queue.config().partitions;
        let result = async {
            let tx = self.queue.engine().begin().await?;
            match self.queue.ensure_meta(&tx).await {
                Ok(()) => tx.commit().await?,
                Err(err) => {
                    let _ = tx.rollback().await;
                    return Err(err);
                }
            }
            let tick = node
                .tick(self.queue.engine(), self.queue.root(), partitions)
                .await?;
            let held = node
                .acquire(self.queue.engine(), self.queue.root(), &tick.assigned)
                .await?;
            Ok::<_, TitoError>((tick, held))
        }
        .await;
        let (tick, held) = match result {
            Ok(done) => done,
            Err(err) => {
                tracing::warn!(error = %err, "cluster tick failed");
                self.next_lease_at = Instant::now() + interval / 3;
                return;
            }
        };
        self.maintains.store(tick.coordinator, Ordering::Relaxed);
        let assigned: HashSet<u32> = tick.assigned.iter().copied().collect();
        for (partition, lease) in &self.leases {
            if !assigned.contains(partition) {
                self.draining.insert(*partition);
            } else if held.get(partition).map(|l| l.generation) != Some(lease.generation) {
                QueueStats::bump(&self.stats().leases_lost, 1);
            }
        }
        let mut leases = held;
        for partition in &self.draining {
            if let Some(lease) = self.leases.get(partition) {
                leases.insert(*partition, lease.clone());
            }
        }
        self.partitions
            .retain(|p, _| leases.contains_key(p) && assigned.contains(p));
        for partition in leases.keys().filter(|p| assigned.contains(p)) {
            self.partitions
                .entry(*partition)
                .or_insert_with(|| PartitionState {
                    cursor: Cursor::new(*partition),
                    next_poll: Instant::now(),
                    backoff: MIN_IDLE_BACKOFF,
                });
        }
        self.leases = leases;
        // Drained partitions (no handler running) go back to the cluster.
        let busy: HashSet<u32> = self
            .in_flight
            .iter()
            .filter_map(|key| {
                keys::parse_pending_key(self.queue.root(), key)
                    .ok()
                    .map(|k| k.partition)
            })
            .collect();
        let done: Vec<u32> = self
            .draining
            .iter()
            .copied()
            .filter(|p| !busy.contains(p))
            .collect();
        if !done.is_empty() {
            match lease::release(self.queue.engine(), self.queue.root(), &done, &self.id).await {
                Ok(()) => {
                    for partition in &done {
                        self.draining.remove(partition);
                        self.leases.remove(partition);
                    }
                }
                Err(err) => tracing::warn!(error = %err, "releasing drained partitions failed"),
            }
        }
        // Come back sooner while draining, so handed-off partitions move quickly.
        let next = if self.draining.is_empty() {
            interval
        } else {
            interval.min(Duration::from_millis(50))
        };
        self.next_lease_at = Instant::now() + next;
    }

    fn next_wake(&self) -> Instant {
        let free = self.in_flight.len() < self.config.concurrency;
        let mut wake = self.next_lease_at;
        if free {
            for state in self.partitions.values() {
                wake = wake.min(state.next_poll);
            }
        }
        wake
    }

    async fn start_handlers<T>(
        &mut self,
        handlers: &mut JoinSet<(Running, Report<T>)>,
        invoke: &Invoker<T>,
    ) where
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        for partition in self.queue.wakeups.take() {
            if let Some(state) = self.partitions.get_mut(&partition) {
                state.next_poll = Instant::now();
                state.backoff = MIN_IDLE_BACKOFF;
            }
        }
        let mut due: Vec<u32> = self
            .partitions
            .iter()
            .filter(|(_, s)| s.next_poll <= Instant::now())
            .map(|(p, _)| *p)
            .collect();
        due.sort_unstable();
        for partition in due {
            let free = self.config.concurrency.saturating_sub(self.in_flight.len());
            if free == 0 {
                return;
            }
            let want = free.min(self.config.page_size);
            let Some(generation) = self.leases.get(&partition).map(|l| l.generation) else {
                continue;
            };
            let pulled = {
                let state = self.partitions.get_mut(&partition).expect("due partition");
                let queue = &self.queue;
                let in_flight = &self.in_flight;
                async {
                    let tx = queue.engine().begin().await?;
                    let result = state
                        .cursor
                        .pull(&tx, queue.root(), want, in_flight, queue.stats())
                        .await;
                    let _ = tx.rollback().await;
                    result
                }
                .await
            };
            let state = self.partitions.get_mut(&partition).expect("due partition");
            let pulled = match pulled {
                Ok(pulled) => pulled,
                Err(err) => {
                    tracing::warn!(partition, error = %err, "pulling queue rows failed");
                    state.next_poll = Instant::now() + state.backoff;
                    state.backoff = (state.backoff * 2).min(self.config.max_idle_backoff);
                    continue;
                }
            };
            if pulled.exhausted && pulled.items.is_empty() {
                state.backoff = (state.backoff * 2).min(self.config.max_idle_backoff);
                let mut next = Instant::now() + state.backoff;
                if let Some(due) = pulled.next_due {
                    // Wake at the due second exactly (plus a millisecond), not a whole second late.
                    let now_ms = chrono::Utc::now().timestamp_millis().max(0) as u64;
                    let until_due =
                        Duration::from_millis(due.saturating_mul(1000).saturating_sub(now_ms) + 1);
                    next = next.min(Instant::now() + until_due);
                }
                state.next_poll = next;
            } else {
                // Work was found: come back at once (no sleep after a full page).
                state.backoff = MIN_IDLE_BACKOFF;
                state.next_poll = Instant::now();
            }
            for item in pulled.items {
                let event = match item.stored.typed::<T>() {
                    Ok(event) => event,
                    Err(err) => {
                        QueueStats::bump(&self.stats().malformed, 1);
                        tracing::warn!(key = %item.key, error = %err, "queue row does not decode as the handler's event type; left in place");
                        continue;
                    }
                };
                self.in_flight.insert(item.key.clone());
                QueueStats::bump(&self.stats().delivered, 1);
                let running = Running {
                    pulled: item,
                    generation,
                };
                handlers.spawn(invoke(running, event));
            }
        }
    }

    fn collect<T: Serialize>(
        &mut self,
        joined: Result<(Running, Report<T>), tokio::task::JoinError>,
        ready: &mut Vec<Outcome>,
    ) {
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
                let counter = if rescheduled {
                    &self.stats().rescheduled
                } else {
                    &self.stats().acknowledged
                };
                QueueStats::bump(counter, 1);
                self.in_flight.remove(&running.pulled.key);
                return;
            }
            Report::Failed(why) => Err(why),
            Report::Done(QueueHandlerOutcome::Acknowledge) => Ok(None),
            Report::Done(QueueHandlerOutcome::Reschedule(next)) => {
                replacement(&running.pulled.stored, &next).map(Some)
            }
        };
        match outcome {
            Ok(replacement) => ready.push(Outcome {
                running,
                replacement,
            }),
            Err(why) => {
                QueueStats::bump(&self.stats().failed, 1);
                tracing::warn!(key = %running.pulled.key, why, "invocation left pending");
                self.in_flight.remove(&running.pulled.key);
            }
        }
    }

    /// Applies outcomes in batches; whatever does not commit stays pending (or, on an unknown
    /// outcome, is either completed or delivered again).
    async fn commit(&mut self, outcomes: Vec<Outcome>) {
        let mut batches: Vec<Vec<Outcome>> = Vec::new();
        for outcome in outcomes {
            // Two invocations of one event never share a batch (their completed keys would).
            let slot = batches.iter().position(|batch| {
                batch.len() < self.config.outcome_batch
                    && !batch
                        .iter()
                        .any(|o| o.running.pulled.stored.id == outcome.running.pulled.stored.id)
            });
            match slot {
                Some(index) => batches[index].push(outcome),
                None => batches.push(vec![outcome]),
            }
        }
        for batch in batches {
            let keys: Vec<String> = batch.iter().map(|o| o.running.pulled.key.clone()).collect();
            match self.apply(&batch).await {
                Ok(applied) => {
                    for outcome in &batch {
                        if !applied.contains(&outcome.running.pulled.key) {
                            continue;
                        }
                        let counter = match outcome.replacement {
                            Some(_) => &self.stats().rescheduled,
                            None => &self.stats().acknowledged,
                        };
                        QueueStats::bump(counter, 1);
                    }
                    let skipped = batch.len() - applied.len();
                    if skipped > 0 {
                        QueueStats::bump(&self.stats().outcome_failures, skipped as u64);
                    }
                }
                Err(err) => {
                    QueueStats::bump(&self.stats().outcome_failures, batch.len() as u64);
                    tracing::warn!(error = %err, invocations = batch.len(), "queue outcomes not applied; the invocations stay pending");
                }
            }
            for key in keys {
                self.in_flight.remove(&key);
            }
        }
    }

    /// One outcome transaction; returns the keys of the invocations it completed.
    async fn apply(&self, batch: &[Outcome]) -> TitoResult<HashSet<String>> {
        let root = self.queue.root().to_string();
        let partitions = self.queue.config().partitions;
        let owner = self.id.clone();
        self.queue
            .engine()
            .transaction(|tx| {
                let root = root.clone();
                let owner = owner.clone();
                async move {
                    let mut held: HashMap<u32, bool> = HashMap::new();
                    let mut applied = HashSet::new();
                    for outcome in batch {
                        let pulled = &outcome.running.pulled;
                        let partition = pulled.parsed.partition;
                        let ok = match held.get(&partition) {
                            Some(ok) => *ok,
                            None => {
                                let ok = lease::still_held(
                                    &tx,
                                    &root,
                                    partition,
                                    &owner,
                                    outcome.running.generation,
                                )
                                .await?;
                                if !ok {
                                    tracing::warn!(
                                        partition,
                                        "partition lease lost; outcomes left pending"
                                    );
                                }
                                held.insert(partition, ok);
                                ok
                            }
                        };
                        if !ok {
                            continue;
                        }
                        if complete(&tx, &root, partitions, pulled, outcome.replacement.as_ref())
                            .await?
                        {
                            applied.insert(pulled.key.clone());
                        }
                    }
                    Ok::<_, TitoError>(applied)
                }
            })
            .await
    }

    async fn release_leases(&self) {
        let partitions: Vec<u32> = self.leases.keys().copied().collect();
        if !partitions.is_empty()
            && let Err(err) = lease::release(
                self.queue.engine(),
                self.queue.root(),
                &partitions,
                &self.id,
            )
            .await
        {
            tracing::warn!(error = %err, "releasing partition leases failed; they expire on their own");
        }
        if let Some(node) = &self.node {
            // Leaving: the coordinator drops this node at its next tick.
            let key = keys::node_key(self.queue.root(), &node.id).into_bytes();
            let result = self
                .queue
                .engine()
                .transaction(|tx| {
                    let key = key.clone();
                    async move { tx.delete(key).await }
                })
                .await;
            if let Err(err) = result {
                tracing::warn!(error = %err, "removing the node record failed; it expires on its own");
            }
        }
    }
}

/// Completes one invocation inside `tx`: deletes the pending row, writes the completed row,
/// moves the owner key and inserts the replacement. Returns false (writing nothing) when the
/// pending row is gone (erased by its owner meanwhile).
async fn complete<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    pulled: &Pulled,
    replacement: Option<&StoredEvent>,
) -> TitoResult<bool> {
    if tx.get(pulled.key.as_bytes()).await?.is_none() {
        return Ok(false);
    }
    tx.delete(pulled.key.clone().into_bytes()).await?;
    let processed_at = tx.start_version();
    let mut completed = pulled.stored.clone();
    completed.processed_at = Some(processed_at);
    let completed_key =
        keys::completed_key(root, processed_at, pulled.parsed.timestamp, &completed.id);
    tx.put(
        completed_key.clone().into_bytes(),
        serde_json::to_vec(&completed)?,
    )
    .await?;
    if let Some(owner) = &completed.owner {
        let pending_owner = keys::owner_key(
            root,
            &owner.kind,
            &owner.id,
            keys::OWNER_PENDING,
            &pulled.key,
        );
        tx.delete(pending_owner.into_bytes()).await?;
        let completed_owner = keys::owner_key(
            root,
            &owner.kind,
            &owner.id,
            keys::OWNER_COMPLETED,
            &completed_key,
        );
        tx.put(completed_owner.into_bytes(), Vec::new()).await?;
    }
    if let Some(next) = replacement {
        write_pending(tx, root, partitions, next).await?;
    }
    Ok(true)
}

/// Checks a `Reschedule` replacement against the invocation it replaces: same id, key, owner
/// and payload; only the timestamp may change.
fn replacement<T: Serialize>(
    current: &StoredEvent,
    next: &QueueEvent<T>,
) -> Result<StoredEvent, String> {
    let next = StoredEvent::from_event(next).map_err(|err| err.to_string())?;
    next.to_bytes().map_err(|err| err.to_string())?;
    if next.id != current.id
        || next.key != current.key
        || next.owner != current.owner
        || next.payload != current.payload
    {
        return Err(
            "a Reschedule replacement must keep the event's id, key, owner and payload (use QueueEvent::rescheduled)"
                .into(),
        );
    }
    Ok(next)
}
