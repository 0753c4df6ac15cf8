//! Typed queues: a [`Topic`] (a queue's name and its payload type) opened on a store gives a
//! [`TopicQueue`], whose publications and workers take that payload type only.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Published, Queue, QueueConfig, QueueEvent};
use crate::engine::TitoEngine;
use crate::error::{TitoError, TitoResult};
use crate::event::Topic;

impl<T> Topic<T> {
    /// Opens the topic's queue on `db` with `config`'s partitions and retention; the queue's
    /// name is the topic's. A `config` naming another topic is refused with
    /// [`TitoError::InvalidArgument`] (the two names would disagree).
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
        match config.topic.as_deref() {
            Some(named) if named != self.name() => Err(TitoError::invalid_argument(format!(
                "topic {:?} was opened with a QueueConfig naming queue {named:?}; leave the \
                 config's topic unset (the topic names the queue)",
                self.name()
            ))),
            _ => Ok(TopicQueue {
                queue: Arc::new(Queue::new(db, config.topic(self.name()))),
                topic: self,
            }),
        }
    }
}

/// A queue whose events carry payloads of type `T` ([`Topic::queue`]): its publications take
/// `QueueEvent<T>`, and [`Workers`](crate::Workers) started on it take handlers of
/// `QueueEvent<T>` only. Cheap to clone; clones share one [`Queue`].
pub struct TopicQueue<E, T> {
    queue: Arc<Queue<E>>,
    topic: Topic<T>,
}

impl<E, T> Clone for TopicQueue<E, T> {
    fn clone(&self) -> Self {
        TopicQueue {
            queue: self.queue.clone(),
            topic: self.topic,
        }
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
}

/// What [`Workers`](crate::Workers) start a worker on: a queue handle, `Arc<Queue<E>>`, whose
/// handler names its payload type, or a [`TopicQueue<E, T>`], whose payload type the handler
/// must take.
pub trait WorkerQueue<E, T> {
    /// The queue handle the worker runs on.
    fn into_queue(self) -> Arc<Queue<E>>;
}

impl<E, T> WorkerQueue<E, T> for Arc<Queue<E>> {
    fn into_queue(self) -> Arc<Queue<E>> {
        self
    }
}

impl<E, T: DeserializeOwned> WorkerQueue<E, T> for TopicQueue<E, T> {
    fn into_queue(self) -> Arc<Queue<E>> {
        self.queue
    }
}

impl<E, T: DeserializeOwned> WorkerQueue<E, T> for &TopicQueue<E, T> {
    fn into_queue(self) -> Arc<Queue<E>> {
        self.queue.clone()
    }
}
