//! Handler supervision: one invocation runs to a report under the timeout, panics caught. Plain
//! handlers decide an outcome for the worker to apply; transactional handlers run inside the
//! transaction that applies it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Running;
use super::outcome::{complete, successor};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::TitoError;
use crate::event::{QueueEvent, QueueHandlerOutcome, QueueHandlerResult};
use crate::queue::lease::HeldCheck;

/// What a handler task reports.
pub(super) enum Report<T> {
    /// The handler decided; the worker applies the outcome.
    Done(QueueHandlerOutcome<T>),
    /// A transactional handler's outcome already committed with its work.
    Applied { rescheduled: bool },
    /// An error, panic or timeout: the invocation stays pending, or a failure policy decides.
    Failed(Failure),
}

/// A failed attempt.
pub(super) struct Failure {
    pub error: TitoError,
    /// A panic (a failure policy may make it fatal).
    pub panicked: bool,
    /// Whether it counts as the invocation's failed attempt: not when the worker lost the
    /// partition's lease or the row was gone (erased by its owner, completed elsewhere).
    pub counts: bool,
}

impl Failure {
    /// An error the handler returned (or a timeout): always the invocation's failed attempt,
    /// whatever its kind. A handler's own `NotFound` (the row it names was deleted) is the
    /// classic poison message, and must die under a failure policy like any other error.
    pub fn of_handler(error: TitoError) -> Self {
        Failure {
            error,
            panicked: false,
            counts: true,
        }
    }

    /// The worker's own evidence that the attempt was not the invocation's: its partition lease
    /// was lost, its pending row is gone (erased by its owner, cancelled, completed
    /// elsewhere), or its transaction's commit kept conflicting. Not counted.
    fn of_worker(error: TitoError) -> Self {
        Failure {
            error,
            panicked: false,
            counts: false,
        }
    }
}

/// Why a transactional handler's transaction did not commit: the worker's own evidence (its
/// lease was lost, or the row is gone), a commit that still conflicted after the transaction's
/// replays, and everything else (the handler's errors, storage errors), kept apart so that
/// only the evidence and the conflicts excuse an attempt. Each rolls back.
#[derive(Debug)]
enum Rolled {
    Evidence(TitoError),
    /// The commit conflicted as often as the retry policy allows: the handler did nothing
    /// wrong (another transaction kept writing what this one wrote), so the invocation stays
    /// pending and runs again without a failed attempt counted.
    Contended(TitoError),
    Failed(TitoError),
}

impl From<TitoError> for Rolled {
    fn from(error: TitoError) -> Self {
        match error {
            TitoError::RetriesExhausted { .. } | TitoError::Conflict { .. } => {
                Rolled::Contended(error)
            }
            error => Rolled::Failed(error),
        }
    }
}

/// Closed once the user's handler future of one invocation was first polled (or the invocation
/// ended without calling it): the next invocation of the same business key waits for it.
#[derive(Clone)]
pub(super) struct FirstPolled(Arc<tokio::sync::Semaphore>);

impl Default for FirstPolled {
    fn default() -> Self {
        FirstPolled(Arc::new(tokio::sync::Semaphore::new(0)))
    }
}

impl FirstPolled {
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }

    fn close(&self) {
        self.0.close();
    }
}

/// What the task of one invocation knows about its start.
struct Start {
    /// The first-poll signal, taken by the first handler call.
    polled: Option<FirstPolled>,
    /// The queue's wake-ups in this process and the invocation's pending row: a cancel of it
    /// committed in this process before the first call keeps the handler from being called.
    wakeups: Arc<crate::event::wake::Wakeups>,
    key: String,
}

tokio::task_local! {
    static START: std::cell::RefCell<Option<Start>>;
}

/// Whether the invocation this task runs was cancelled in this process before its handler was
/// first called (checked right before that call; `false` once it was called).
fn cancelled_before_start() -> bool {
    START
        .try_with(|start| {
            start.borrow().as_ref().is_some_and(|start| {
                start.polled.is_some() && start.wakeups.was_cancelled(&start.key)
            })
        })
        .unwrap_or(false)
}

/// The worker's evidence that an invocation was cancelled before its handler's first call.
fn cancelled_unstarted(key: &str) -> TitoError {
    TitoError::NotFound(format!(
        "invocation {key} was cancelled before its handler started"
    ))
}

/// Runs `work` (one invocation) once `previous` (the invocation of the same key started before
/// it) was first polled, and closes `polled` once the user's handler future of `work` was first
/// polled, or `work` ended or was dropped without calling it. So a key's handlers first run in
/// the order they were started, whatever order the runtime polls tasks in.
pub(super) async fn in_start_order<F: Future>(
    previous: Option<FirstPolled>,
    polled: FirstPolled,
    (wakeups, key): (Arc<crate::event::wake::Wakeups>, String),
    work: F,
) -> F::Output {
    /// Closes the signal when the invocation ends or is dropped, whatever it did.
    struct CloseOnDrop(FirstPolled);
    impl Drop for CloseOnDrop {
        fn drop(&mut self) {
            self.0.close();
        }
    }
    let _closed = CloseOnDrop(polled.clone());
    if let Some(previous) = previous {
        // Closed, never granted: this returns once the previous handler was first polled.
        let _ = previous.0.acquire().await;
    }
    let start = Start {
        polled: Some(polled),
        wakeups,
        key,
    };
    START
        .scope(std::cell::RefCell::new(Some(start)), work)
        .await
}

/// The user's handler future, which closes this task's first-poll signal once first polled.
fn first_polled<F: Future>(work: F) -> impl Future<Output = F::Output> {
    struct Signal<F> {
        work: std::pin::Pin<Box<F>>,
        polled: Option<FirstPolled>,
    }
    impl<F: Future> Future for Signal<F> {
        type Output = F::Output;
        fn poll(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<F::Output> {
            let out = self.work.as_mut().poll(cx);
            if let Some(polled) = self.polled.take() {
                polled.close();
            }
            out
        }
    }
    let polled = START
        .try_with(|start| start.borrow_mut().as_mut().and_then(|s| s.polled.take()))
        .ok()
        .flatten();
    Signal {
        work: Box::pin(work),
        polled,
    }
}

/// Runs one invocation to its report.
pub(super) type Invoker<T> =
    Arc<dyn Fn(Running, QueueEvent<T>) -> BoxFuture<'static, (Running, Report<T>)> + Send + Sync>;

/// Runs a handler that decides an outcome for the worker to apply (`run_worker`,
/// `run_cluster_worker`).
pub(super) fn plain<T, F, Fut>(handler: F, timeout: Duration) -> Invoker<T>
where
    T: Send + 'static,
    F: Fn(QueueEvent<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    let handler = Arc::new(handler);
    Arc::new(move |running, event| {
        let handler = handler.clone();
        Box::pin(async move {
            // Checked in the same poll as the first call, with nothing awaited in between.
            if cancelled_before_start() {
                let evidence = cancelled_unstarted(&running.pulled.key);
                return (running, Report::Failed(Failure::of_worker(evidence)));
            }
            // The call that builds the future is supervised with it: a handler that panics
            // before it returns a future is an invocation that panicked, not a lost task.
            let report =
                match supervise(timeout, async move { first_polled(handler(event)).await }).await {
                    Ok(outcome) => Report::Done(outcome),
                    Err(failure) => Report::Failed(failure),
                };
            (running, report)
        })
    })
}

/// Runs a handler inside the transaction that applies its outcome (`run_transactional_worker`):
/// the handler's writes, the lease check and the outcome commit together or not at all.
pub(super) fn transactional<E, T, F, Fut>(
    queue: &crate::queue::Queue<E>,
    owner: String,
    handler: F,
    timeout: Duration,
) -> Invoker<T>
where
    E: TitoEngine,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    F: Fn(QueueEvent<T>, E::Transaction) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = QueueHandlerResult<T>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let db = queue.engine().clone();
    let root = queue.root().to_string();
    let partitions = queue.config().partitions;
    // The handler's writes and its outcome commit together; an unknown outcome is resolved
    // (applied: done; proven not applied: the handler runs again in a new transaction).
    let policy = db.retry_policy().resolving();
    let (counters, label) = (queue.shared_counters(), queue.label().to_string());
    Arc::new(move |mut running: Running, event: QueueEvent<T>| {
        let (handler, db, root, owner) = (handler.clone(), db.clone(), root.clone(), owner.clone());
        let (pulled, generation) = (running.pulled.clone(), running.generation);
        let policy = policy.clone();
        let (counters, label) = (counters.clone(), label.clone());
        Box::pin(async move {
            let waker = db.clone();
            // A fence slot of its partition, held by this invocation's transaction alone: the
            // worker's other handlers lock other slots, so their commits never conflict on the
            // lease, while a takeover (which writes every slot) still fences them all.
            let fence = running.fences.take(pulled.parsed.partition);
            let slot = fence.slot();
            // How often the handler was called for this attempt: more than once when its
            // transaction was replayed.
            let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let called = calls.clone();
            let work = db.transaction_with(policy, |tx| {
                let waker = waker.clone();
                let called = called.clone();
                let (handler, event, pulled, root, owner) = (
                    handler.clone(),
                    event.clone(),
                    pulled.clone(),
                    root.clone(),
                    owner.clone(),
                );
                async move {
                    if cancelled_before_start() {
                        return Err(Rolled::Evidence(cancelled_unstarted(&pulled.key)));
                    }
                    // The lease and the pending row first, read in one batch, so that an
                    // attempt replayed after a takeover (its fence slot written) or a cancel
                    // (its row deleted) ends here without calling the handler again.
                    let partition = pulled.parsed.partition;
                    let check = HeldCheck::new(&root, partition, &owner, false).fenced(slot);
                    let mut reads = check.keys().to_vec();
                    reads.push(pulled.key.clone().into_bytes());
                    let row_at = reads.len() - 1;
                    let values = tx.batch_get(&reads).await?;
                    let (lease, row) = values[..=row_at].split_at(row_at);
                    if !check.decide(&tx, generation, lease).await? {
                        return Err(Rolled::Evidence(TitoError::LeaseLost(format!(
                            "partition {partition}"
                        ))));
                    }
                    if row[0].is_none() {
                        return Err(Rolled::Evidence(TitoError::NotFound(format!(
                            "invocation {} is no longer pending",
                            pulled.key
                        ))));
                    }
                    called.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    // The handler's own error counts as its attempt's, whatever its kind.
                    let outcome = first_polled(handler(event, tx.clone()))
                        .await
                        .map_err(Rolled::Failed)?;
                    let next =
                        successor(&pulled.stored, &outcome).map_err(TitoError::InvalidArgument)?;
                    let result = super::outcome::result_of(outcome);
                    let wakes = complete(
                        &tx,
                        &root,
                        partitions,
                        &pulled,
                        next.as_ref(),
                        result.as_ref(),
                        crate::queue::graph::Apply::Folded,
                    )
                    .await?;
                    crate::queue::graph::wake_after_commit(&waker, &tx, wakes);
                    Ok::<_, Rolled>(next.is_some())
                }
            });
            // The worker's evidence passes the supervisor as a value, the rest as errors.
            let work = work.map(|result| match result {
                Ok(rescheduled) => Ok(Ok(rescheduled)),
                Err(Rolled::Evidence(error) | Rolled::Contended(error)) => Ok(Err(error)),
                Err(Rolled::Failed(error)) => Err(error),
            });
            let report = match supervise(timeout, work).await {
                Ok(Ok(rescheduled)) => Report::Applied { rescheduled },
                Ok(Err(evidence)) => Report::Failed(Failure::of_worker(evidence)),
                Err(failure) => Report::Failed(failure),
            };
            let replays = calls
                .load(std::sync::atomic::Ordering::Relaxed)
                .saturating_sub(1);
            running.replays = replays;
            if replays > 0 {
                crate::queue::QueueCounters::bump(&counters.replayed, replays);
                metrics::counter!(crate::telemetry::names::QUEUE_REPLAYED, "queue" => label)
                    .increment(replays);
            }
            (running, report)
        })
    })
}

/// Catches a panic and enforces the timeout around one invocation's work.
async fn supervise<R>(
    timeout: Duration,
    work: impl Future<Output = Result<R, TitoError>> + Send,
) -> Result<R, Failure> {
    match tokio::time::timeout(timeout, AssertUnwindSafe(work).catch_unwind()).await {
        Ok(Ok(result)) => result.map_err(Failure::of_handler),
        Ok(Err(panic)) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned());
            Err(Failure {
                error: TitoError::handler(match message {
                    Some(message) => format!("handler panicked: {message}"),
                    None => "handler panicked".to_string(),
                }),
                panicked: true,
                counts: true,
            })
        }
        Err(_) => Err(Failure::of_handler(TitoError::handler(format!(
            "handler timed out after {timeout:?}"
        )))),
    }
}
