//! What long-running work (queue workers, inbox subscriptions, the kv sweeper) shares and
//! that belongs to no one of them: the signal that stops it, [`Workers`], a set of them with
//! one shutdown, and the guard that ties a task one of them starts to its own lifetime.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::TitoResult;

/// What stops a worker: once it resolves, `run_worker` starts no new pull or handler, drains the
/// handlers that started (keeping their leases), applies their outcomes, releases its leases and
/// returns.
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

/// A task started on behalf of an owner (a worker's maintenance), aborted when the guard drops.
///
/// The owner keeps the guard in its own future, so the task ends with the owner however the
/// owner ends: returning, or its future dropped or its task aborted. Without it a task would
/// outlive a cancelled owner and keep what it holds (the store's handle) forever.
pub(crate) struct OwnedTask<T> {
    handle: JoinHandle<T>,
}

impl<T: Send + 'static> OwnedTask<T> {
    /// Starts `task` on the current Tokio runtime.
    pub(crate) fn spawn(task: impl Future<Output = T> + Send + 'static) -> Self {
        OwnedTask {
            handle: tokio::spawn(task),
        }
    }

    /// Waits for the task to end by itself, at most `bound`; aborts it past that. `None` when
    /// it did not end (aborted) or panicked.
    pub(crate) async fn join_within(mut self, bound: Duration) -> Option<T> {
        match tokio::time::timeout(bound, &mut self.handle).await {
            Ok(Ok(value)) => Some(value),
            _ => None,
        }
    }
}

impl<T> Future for OwnedTask<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.handle).poll(cx)
    }
}

impl<T> Drop for OwnedTask<T> {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// The shutdown signal [`Workers`] hands to what it starts: resolves when
/// [`Workers::shutdown`] is called or the set is dropped.
#[derive(Clone, Debug)]
pub struct Stop(watch::Receiver<bool>);

impl Shutdown for Stop {
    fn wait(self) -> BoxFuture<'static, ()> {
        self.0.wait()
    }
}

/// Running workers (queue workers, inbox subscriptions, a kv sweeper) that stop together.
///
/// Each `spawn_*` method starts one on the current Tokio runtime with the set's shutdown;
/// [`Workers::shutdown`] signals them all and waits until each has drained by its own rules
/// (a queue worker finishes the handlers it started and applies their outcomes, then releases
/// its leases). Dropping the set signals the same shutdown without waiting for it.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use serde::{Deserialize, Serialize};
/// use tito::prelude::*;
///
/// #[derive(Clone, Debug, Serialize, Deserialize)]
/// struct Mail { to: String }
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), TitoError> {
/// let db = Embedded::temporary().await?;
/// let queue = Arc::new(Queue::new(db.clone(), QueueConfig::new(4, Duration::from_secs(3600))));
/// let mut workers = Workers::new();
/// workers.spawn_worker(queue.clone(), WorkerConfig::new(0..4), |event: QueueEvent<Mail>| async move {
///     println!("mail to {}", event.payload.to);
///     Ok(QueueHandlerOutcome::Acknowledge)
/// });
/// queue.publish(QueueEvent::now("ada", Mail { to: "ada@example.com".into() })).await?;
/// // .. the application runs ..
/// workers.shutdown().await?; // drains every worker of the set
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Workers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<TitoResult<()>>>,
}

impl Default for Workers {
    fn default() -> Self {
        Workers::new()
    }
}

impl Workers {
    /// An empty set.
    pub fn new() -> Self {
        Workers {
            stop: watch::channel(false).0,
            tasks: Vec::new(),
        }
    }

    /// Starts `run(stop)` on the current Tokio runtime, where `run` is any of Tito's run
    /// functions given the set's shutdown: `workers.spawn(|stop| run_worker(queue, config,
    /// handler, stop))`. Panics outside a Tokio runtime, as `tokio::spawn` does.
    pub fn spawn<F, Fut>(&mut self, run: F) -> &mut Self
    where
        F: FnOnce(Stop) -> Fut,
        Fut: Future<Output = TitoResult<()>> + Send + 'static,
    {
        let stop = Stop(self.stop.subscribe());
        let signal = self.stop.subscribe();
        let work = run(stop);
        self.tasks.push(tokio::spawn(async move {
            let result = work.await;
            // A worker that ends with an error before the set's shutdown (a refused
            // configuration, a store that failed) is said at once, not only by `shutdown`.
            if let Err(err) = &result
                && !*signal.borrow()
            {
                tracing::error!(error = %err, "a worker of a Workers set stopped with an error; Workers::shutdown returns it");
            }
            result
        }));
        self
    }

    /// How many workers the set started.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether the set started none.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Signals every worker of the set to stop and waits until each has drained. Returns the
    /// first error a worker ended with (a refused configuration, a store that failed), after
    /// waiting for all of them; a worker that panicked resumes its panic here.
    pub async fn shutdown(self) -> TitoResult<()> {
        let _ = self.stop.send(true);
        let mut first = Ok(());
        for task in self.tasks {
            match task.await {
                Ok(result) => {
                    if first.is_ok() {
                        first = result;
                    }
                }
                Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
                // Cancelled: only a runtime that is shutting down cancels a task.
                Err(_) => {}
            }
        }
        first
    }
}
