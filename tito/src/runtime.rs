//! What long-running work (queue workers, inbox subscriptions, the kv sweeper) shares and
//! that belongs to no one of them: the signal that stops it.

use futures::future::BoxFuture;

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
