//! Typed queues: a [`Topic`] (a queue's name and its payload type) opened on a store gives a
//! [`TopicQueue`], whose publications and workers take that payload type only.
//!
//! A queue is declared once, with everything it needs ([`QueueSpec`]: partitions, retention,
//! limits, failure policy, periodic jobs), and opened on a store with [`QueueSpec::open`]:
//! publishers, workers, periodic runners and operator calls then all go through the one typed
//! handle.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{FailurePolicy, Limits, PeriodicJob, Published, Queue, QueueConfig, QueueEvent};
use crate::engine::TitoEngine;
use crate::error::{TitoError, TitoResult};
use crate::event::Topic;

/// A queue declared once: its topic (name and payload type) and its settings. Build it where
/// the topic is defined, open it on a store at start-up ([`QueueSpec::open`]), and hand the
/// [`TopicQueue`] it gives to publishers, workers and operator code.
///
/// ```
/// use std::time::Duration;
/// use serde::{Deserialize, Serialize};
/// use tito::queue::{FailurePolicy, Limits, PeriodicJob, QueueSpec, Schedule, Topic};
/// use tito::{QueueEvent, QueueHandlerOutcome, Workers, WorkerConfig};
///
/// #[derive(Clone, Serialize, Deserialize)]
/// enum Email { Welcome { to: String }, Digest }
///
/// const EMAILS: Topic<Email> = Topic::new("emails");
///
/// fn emails() -> tito::TitoResult<QueueSpec<Email>> {
///     Ok(EMAILS
///         .spec(4, Duration::from_secs(7 * 86_400))
///         .limits(Limits::none().key_concurrency(1))
///         .failure_policy(FailurePolicy::new(5))
///         .periodic(PeriodicJob::new(Schedule::every("digest", Duration::from_secs(3600))?, Email::Digest)))
/// }
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), tito::TitoError> {
/// let db = tito::Embedded::temporary().await?;
/// // At first boot too: the limits are stored before anything was published.
/// let emails = emails()?.open(db.clone()).await?;
/// emails.publish(QueueEvent::now("ada", Email::Welcome { to: "ada@example.com".into() })).await?;
///
/// let mut workers = Workers::new();
/// workers.spawn_worker(&emails, WorkerConfig::new(0..4), |event: QueueEvent<Email>| async move {
///     let _ = event.payload;                   // the declared failure policy applies
///     Ok(QueueHandlerOutcome::Acknowledge)
/// });
/// workers.spawn_periodic(&emails, emails.periodic_jobs());
/// emails.pause(None, "maintenance").await?;   // operator calls on the same handle
/// emails.resume(None).await?;
/// workers.shutdown().await?;
/// # db.close().await
/// # }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct QueueSpec<T> {
    /// The topic: the queue's name and payload type.
    pub topic: Topic<T>,
    /// Partitions and retention (its topic is the spec's).
    pub config: QueueConfig,
    /// The limits stored when the queue is opened (`None`: the stored ones are left alone).
    pub limits: Option<Limits>,
    /// The failure policy of workers started on the opened queue whose own config has none.
    pub failure_policy: Option<FailurePolicy>,
    /// The periodic jobs its runners publish ([`TopicQueue::periodic_jobs`]).
    pub periodic: Vec<PeriodicJob<T>>,
    /// How [`Workers::start`](crate::Workers::start) runs its workers (`None`: every
    /// partition, the defaults).
    pub worker: Option<super::WorkerConfig>,
}

impl<T> Topic<T> {
    /// The declaration of this topic's queue: `partitions` partitions, completed rows kept for
    /// `retention`; add limits, a failure policy and periodic jobs with the setters.
    pub fn spec(self, partitions: u32, retention: Duration) -> QueueSpec<T> {
        QueueSpec {
            topic: self,
            config: QueueConfig::new(partitions, retention).topic(self.name()),
            limits: None,
            failure_policy: None,
            periodic: Vec::new(),
            worker: None,
        }
    }
}

impl<T> QueueSpec<T> {
    /// The limits to store at open.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = Some(limits);
        self
    }

    /// The failure policy of the queue's workers.
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = Some(policy);
        self
    }

    /// One more periodic job (a payload of the topic's type: a job of another type does not
    /// compile).
    pub fn periodic(mut self, job: PeriodicJob<T>) -> Self {
        self.periodic.push(job);
        self
    }

    /// How [`Workers::start`](crate::Workers::start) runs the queue's workers: its partitions,
    /// concurrency, timeouts (default: every partition, the defaults). Checked at
    /// [`open`](Self::open), which refuses a partition range reaching past the queue's
    /// partitions and a `worker_id` here: every process shares the declaration, and two workers
    /// of one id would both hold its leases.
    pub fn worker(mut self, config: super::WorkerConfig) -> Self {
        self.worker = Some(config);
        self
    }

    /// Opens the queue on `db`, declaring it: the partition count is stored when the store has
    /// none (so limits and pauses can be set before anything is published) and checked
    /// otherwise; the declared limits are stored when they differ from the stored ones. Refused
    /// with [`TitoError::InvalidArgument`], before anything is written, when a setting is bad,
    /// two periodic jobs share a name, the store holds another partition count, or the queue
    /// receives a model's events ([`Topic::model_events`]) and the count is not the store's
    /// ([`TitoEngine::partitions`]: the count every write publishes them with).
    pub async fn open<E: TitoEngine>(&self, db: E) -> TitoResult<TopicQueue<E, T>>
    where
        T: Clone,
    {
        super::periodic::check_job_names(self.topic.name(), &self.periodic)?;
        check_model_event_partitions(self.topic, &db, &self.config, "spec")?;
        if let Some(limits) = &self.limits {
            limits.check()?;
        }
        if let Some(policy) = &self.failure_policy {
            policy.check()?;
        }
        if let Some(worker) = &self.worker {
            worker.check(self.config.partitions)?;
            // A declaration names the partitions it runs: one the queue lacks is a mistake (a
            // partition count changed in one place and not the other), not a range to clip.
            if worker.partitions.end > self.config.partitions {
                return Err(TitoError::invalid_argument(format!(
                    "queue {:?}: QueueSpec::worker runs partitions {:?}, but the queue has \
                     partitions 0..{}: declare a range within them",
                    self.topic.name(),
                    worker.partitions,
                    self.config.partitions
                )));
            }
            if let Some(id) = &worker.worker_id {
                return Err(TitoError::invalid_argument(format!(
                    "queue {:?}: leave worker_id unset in QueueSpec::worker (a declaration is \
                     shared by every process, and two workers of one id would both hold its \
                     leases); give a process its own id with Workers::start_with, not {id:?}",
                    self.topic.name()
                )));
            }
        }
        let queue = Arc::new(Queue::new(db, self.config.clone()));
        queue.declare().await?;
        if let Some(limits) = &self.limits
            && queue.limits().await? != *limits
        {
            queue.set_limits(limits.clone()).await?;
        }
        Ok(TopicQueue {
            queue,
            topic: self.topic,
            failure_policy: self.failure_policy.clone(),
            periodic: Arc::new(self.periodic.clone()),
            worker: self.worker.clone(),
        })
    }
}

impl<T> Topic<T> {
    /// Opens the topic's queue on `db` with `config`'s partitions and retention; the queue's
    /// name is the topic's. A `config` naming another topic is refused with
    /// [`TitoError::InvalidArgument`] (the two names would disagree), and so is a topic of
    /// model events ([`Topic::model_events`]) with another partition count than the store's.
    ///
    /// ```
    /// use serde::{Deserialize, Serialize};
    /// use std::time::Duration;
    /// use tito::queue::{QueueConfig, QueueEvent, Topic};
    /// use tito::TitoEngine;
    ///
    /// #[derive(Clone, Serialize, Deserialize)]
    /// struct Email { to: String }
    ///
    /// const EMAILS: Topic<Email> = Topic::new("emails");
    ///
    /// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
    /// # async fn main() -> Result<(), tito::TitoError> {
    /// let db = tito::Embedded::temporary().await?;
    /// let emails = EMAILS.queue(db.clone(), QueueConfig::new(4, Duration::from_secs(60)))?;
    /// emails.publish(QueueEvent::now("ada", Email { to: "ada@example.com".into() })).await?;
    /// // emails.publish(QueueEvent::now("ada", "not an email")) does not compile.
    /// assert_eq!(emails.queue().pending_count(tito::queue::partition_for("ada", 4)).await?, 1);
    /// # db.close().await
    /// # }
    /// ```
    pub fn queue<E: TitoEngine>(self, db: E, config: QueueConfig) -> TitoResult<TopicQueue<E, T>> {
        check_model_event_partitions(self, &db, &config, "QueueConfig::new")?;
        match config.topic.as_deref() {
            Some(named) if named != self.name() => Err(TitoError::invalid_argument(format!(
                "topic {:?} was opened with a QueueConfig naming queue {named:?}; leave the \
                 config's topic unset (the topic names the queue)",
                self.name()
            ))),
            _ => Ok(TopicQueue {
                queue: Arc::new(Queue::new(db, config.topic(self.name()))),
                topic: self,
                failure_policy: None,
                periodic: Arc::new(Vec::new()),
                worker: None,
            }),
        }
    }
}

/// Refuses a queue of model events declared with another partition count than the store's:
/// every write publishes its events with the store's count
/// ([`TitoEngine::partitions`]), so each would be refused once the queue stored another.
/// `form` is how the count was given (`spec`, `QueueConfig::new`), for the message.
fn check_model_event_partitions<E: TitoEngine, T>(
    topic: Topic<T>,
    db: &E,
    config: &QueueConfig,
    form: &str,
) -> TitoResult<()> {
    let (store, given) = (db.partitions(), config.partitions);
    if !topic.receives_model_events() || store == given {
        return Ok(());
    }
    Err(TitoError::invalid_argument(format!(
        "declare queue {:?} with {form}(db.partitions(), ..), the store's partition count ({store}), \
         not {given}: it receives a model's events, which every write publishes with the \
         store's count (to use {given}, open the store with {given} partitions)",
        topic.name()
    )))
}

/// A queue whose events carry payloads of type `T` ([`QueueSpec::open`], [`Topic::queue`]):
/// its publications take `QueueEvent<T>`, and [`Workers`](crate::Workers) started on it take
/// handlers and periodic jobs of `T` only. Operator calls (`pause`, `set_limits`, `cancel`,
/// `cancel_owner`, `dead`, `retry_dead`, `stats`, ..) are the [`Queue`]'s, reached through
/// it. Cheap to clone; clones share one [`Queue`].
pub struct TopicQueue<E, T> {
    queue: Arc<Queue<E>>,
    topic: Topic<T>,
    failure_policy: Option<FailurePolicy>,
    periodic: Arc<Vec<PeriodicJob<T>>>,
    worker: Option<super::WorkerConfig>,
}

impl<E, T> Clone for TopicQueue<E, T> {
    fn clone(&self) -> Self {
        TopicQueue {
            queue: self.queue.clone(),
            topic: self.topic,
            failure_policy: self.failure_policy.clone(),
            periodic: self.periodic.clone(),
            worker: self.worker.clone(),
        }
    }
}

impl<E, T> std::ops::Deref for TopicQueue<E, T> {
    type Target = Queue<E>;

    /// The queue's operator calls and counters. (Its publications are typed on the topic
    /// queue itself.)
    fn deref(&self) -> &Queue<E> {
        &self.queue
    }
}

impl<E, T: Clone> TopicQueue<E, T> {
    /// The periodic jobs the queue was declared with.
    pub fn periodic_jobs(&self) -> Vec<PeriodicJob<T>> {
        self.periodic.as_ref().clone()
    }
}

impl<E: TitoEngine, T> TopicQueue<E, T> {
    /// How [`Workers::start`](crate::Workers::start) runs this queue's workers: the declared
    /// [`QueueSpec::worker`], else every partition with the defaults.
    pub fn worker_config(&self) -> super::WorkerConfig {
        self.worker
            .clone()
            .unwrap_or_else(|| super::WorkerConfig::new(0..self.queue.config().partitions))
    }
}

impl crate::Workers {
    /// Starts what declared queue `queue` runs, from its declaration: a worker with `handler`
    /// ([`TopicQueue::worker_config`]: every partition unless the spec says otherwise, its
    /// failure policy) and, when it declares periodic jobs, their runner. One call instead of
    /// `spawn_worker(&q, WorkerConfig::new(0..partitions), ..)` and `spawn_periodic(&q,
    /// q.periodic_jobs())`; [`start_with`](Self::start_with) overrides the worker's config.
    pub fn start<E, T, F, Fut>(&mut self, queue: &TopicQueue<E, T>, handler: F) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = super::QueueHandlerResult<T>> + Send + 'static,
    {
        self.start_with(queue, queue.worker_config(), handler)
    }

    /// [`start`](Self::start) with the worker's config given here (its failure policy, when it
    /// has none, is still the declared one).
    pub fn start_with<E, T, F, Fut>(
        &mut self,
        queue: &TopicQueue<E, T>,
        config: super::WorkerConfig,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = super::QueueHandlerResult<T>> + Send + 'static,
    {
        self.spawn_worker(queue, config, handler);
        self.start_periodic(queue)
    }

    /// [`start`](Self::start) with a transactional handler
    /// ([`run_transactional_worker`](super::run_transactional_worker)).
    pub fn start_transactional<E, T, F, Fut>(
        &mut self,
        queue: &TopicQueue<E, T>,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = super::QueueHandlerResult<T>> + Send + 'static,
    {
        self.start_transactional_with(queue, queue.worker_config(), handler)
    }

    /// [`start_transactional`](Self::start_transactional) with the worker's config given here.
    pub fn start_transactional_with<E, T, F, Fut>(
        &mut self,
        queue: &TopicQueue<E, T>,
        config: super::WorkerConfig,
        handler: F,
    ) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = super::QueueHandlerResult<T>> + Send + 'static,
    {
        self.spawn_transactional_worker(queue, config, handler);
        self.start_periodic(queue)
    }

    /// The declared periodic jobs' runner, when there are any.
    fn start_periodic<E, T>(&mut self, queue: &TopicQueue<E, T>) -> &mut Self
    where
        E: TitoEngine,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        let jobs = queue.periodic_jobs();
        if !jobs.is_empty() {
            self.spawn_periodic(queue, jobs);
        }
        self
    }
}

impl<E, T> std::fmt::Debug for TopicQueue<E, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopicQueue")
            .field("topic", &self.topic)
            .field("queue", &self.queue)
            .finish()
    }
}

impl<E: TitoEngine, T: Serialize> TopicQueue<E, T> {
    /// The untyped queue handle (counts, inspection, the seed's `run_worker`).
    pub fn queue(&self) -> &Arc<Queue<E>> {
        &self.queue
    }

    /// The topic.
    pub fn topic(&self) -> Topic<T> {
        self.topic
    }

    /// [`Queue::publish`], typed.
    pub async fn publish(&self, event: QueueEvent<T>) -> TitoResult<Published> {
        self.queue.publish(event).await
    }

    /// [`Queue::publish_unique`], typed.
    pub async fn publish_unique(
        &self,
        event: QueueEvent<T>,
        unique: &super::Unique,
    ) -> TitoResult<Published> {
        self.queue.publish_unique(event, unique).await
    }

    /// [`Queue::publish_unique_in_tx`], typed.
    pub async fn publish_unique_in_tx(
        &self,
        event: &QueueEvent<T>,
        unique: &super::Unique,
        tx: &E::Transaction,
    ) -> TitoResult<Published> {
        self.queue.publish_unique_in_tx(event, unique, tx).await
    }

    /// [`Queue::publish_in_tx`], typed.
    pub async fn publish_in_tx(
        &self,
        event: &QueueEvent<T>,
        tx: &E::Transaction,
    ) -> TitoResult<Published> {
        self.queue.publish_in_tx(event, tx).await
    }

    /// [`Queue::publish_many`], typed: bounded transactions of their own.
    pub async fn publish_many(&self, events: &[QueueEvent<T>]) -> TitoResult<Vec<Published>> {
        self.queue.publish_many(events).await
    }

    /// [`Queue::publish_many_in_tx`], typed: all in the caller's transaction.
    pub async fn publish_many_in_tx(
        &self,
        events: &[QueueEvent<T>],
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        self.queue.publish_many_in_tx(events, tx).await
    }

    /// [`Queue::publish_many_unique`], typed.
    pub async fn publish_many_unique(
        &self,
        events: &[QueueEvent<T>],
        unique: &super::Unique,
    ) -> TitoResult<Vec<Published>> {
        self.queue.publish_many_unique(events, unique).await
    }

    /// [`Queue::publish_many_unique_in_tx`], typed.
    pub async fn publish_many_unique_in_tx(
        &self,
        events: &[QueueEvent<T>],
        unique: &super::Unique,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<Published>> {
        self.queue
            .publish_many_unique_in_tx(events, unique, tx)
            .await
    }
}

/// What [`Workers`](crate::Workers) start a worker on: a queue handle, `Arc<Queue<E>>`, whose
/// handler names its payload type, or a [`TopicQueue<E, T>`], whose payload type the handler
/// must take.
pub trait WorkerQueue<E, T> {
    /// The failure policy the queue was declared with (for workers whose config has none).
    fn declared_failure_policy(&self) -> Option<FailurePolicy> {
        None
    }

    /// The worker settings the queue was declared with ([`QueueSpec::worker`]), if any: a
    /// drain ([`crate::queue::testing::drain`]) runs its handlers with them.
    fn declared_worker_config(&self) -> Option<super::WorkerConfig> {
        None
    }

    /// The queue handle the worker runs on.
    fn into_queue(self) -> Arc<Queue<E>>;
}

impl<E, T> WorkerQueue<E, T> for Arc<Queue<E>> {
    fn into_queue(self) -> Arc<Queue<E>> {
        self
    }
}

impl<E, T: DeserializeOwned> WorkerQueue<E, T> for TopicQueue<E, T> {
    fn declared_failure_policy(&self) -> Option<FailurePolicy> {
        self.failure_policy.clone()
    }

    fn declared_worker_config(&self) -> Option<super::WorkerConfig> {
        self.worker.clone()
    }

    fn into_queue(self) -> Arc<Queue<E>> {
        self.queue
    }
}

impl<E, T: DeserializeOwned> WorkerQueue<E, T> for &TopicQueue<E, T> {
    fn declared_failure_policy(&self) -> Option<FailurePolicy> {
        self.failure_policy.clone()
    }

    fn declared_worker_config(&self) -> Option<super::WorkerConfig> {
        self.worker.clone()
    }

    fn into_queue(self) -> Arc<Queue<E>> {
        self.queue.clone()
    }
}
