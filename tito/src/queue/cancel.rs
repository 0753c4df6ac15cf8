//! Cancelling invocations: a pending invocation is completed as cancelled (it never runs; its
//! completed row records why and keeps the event id until retention deletes it). One that a
//! handler is running loses its pending row the same way: the worker's outcome finds the row
//! gone and applies nothing (a transactional handler's writes roll back), and the handler's
//! [`Cancellation`] fires: at once in this process, within a third of the worker's lease
//! duration in another (its periodic check of its running invocations' rows). A worker of this
//! process re-reads what a pull found when a cancel committed during the pull, so nothing it
//! starts was cancelled before; one in another process whose pull read the row just before the
//! cancel may start it, and is then told as above.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Queue;
use super::graph::Wake;
use super::pull::Pulled;
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::{QueueOwner, StoredEvent};
use crate::keys;

/// The longest reason kept with a cancellation.
pub const MAX_CANCEL_REASON: usize = 1024;

/// How many invocations of one owner one transaction of [`Queue::cancel_owner`] cancels.
const OWNER_BATCH: usize = 256;

impl<E: TitoEngine> Queue<E> {
    /// Cancels the pending invocation `id`: it is completed as cancelled with `why` (it never
    /// starts again; publishing the id again is a duplicate until retention deletes the
    /// completed row). A handler running it when the cancel commits is told through its
    /// [`Cancellation`], and its outcome is not applied. `false` when `id` is not pending
    /// (unknown, completed, dead).
    pub async fn cancel(&self, id: &str, why: &str) -> TitoResult<bool> {
        cancel_under(&self.db, &self.root, id, why).await
    }

    /// Cancels every pending invocation of `owner` (through the owner index, in transactions
    /// of at most 256); returns how many.
    pub async fn cancel_owner(&self, owner: &QueueOwner, why: &str) -> TitoResult<usize> {
        cancel_owner_under(&self.db, &self.root, owner, why).await
    }
}

/// [`Queue::cancel`] on the queue named `topic` (`None`: the default queue), for tools.
pub async fn cancel<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    id: &str,
    why: &str,
) -> TitoResult<bool> {
    cancel_under(db, &keys::queue_root(topic), id, why).await
}

/// [`Queue::cancel_owner`] on the queue named `topic`, for tools.
pub async fn cancel_owner<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    owner: &QueueOwner,
    why: &str,
) -> TitoResult<usize> {
    cancel_owner_under(db, &keys::queue_root(topic), owner, why).await
}

/// Refuses a cancellation's reason over [`MAX_CANCEL_REASON`] bytes for the queue named
/// `topic` (`None`: the default queue), naming the queue, as [`cancel`] and [`cancel_owner`]
/// do (for tools that check an operator's input before asking for confirmation).
pub fn check_cancel_reason(topic: Option<&str>, why: &str) -> TitoResult<()> {
    check_reason_under(&keys::queue_root(topic), why)
}

fn check_reason_under(root: &str, why: &str) -> TitoResult<()> {
    super::check_reason(root, "a cancellation's reason", why, MAX_CANCEL_REASON)
}

/// Completes the pending (or waiting) row `key` as cancelled inside `tx`; `None` when it is not
/// there, else the partitions its end made rows due in (a workflow's dependents that run
/// anyway), to wake once `tx` commits.
pub(super) async fn cancel_row<X: TitoTransaction>(
    tx: &X,
    root: &str,
    key: &str,
    why: &str,
) -> TitoResult<Option<Vec<Wake>>> {
    if key.starts_with(&keys::waiting_prefix(root)) {
        return super::graph::cancel_waiting(tx, root, key, why).await;
    }
    let Ok(parsed) = keys::parse_pending_key(root, key) else {
        return Ok(None);
    };
    let Some(row) = tx.get(key.as_bytes()).await? else {
        return Ok(None);
    };
    let mut stored = StoredEvent::parse(&row)?;
    stored.cancelled = Some(why.to_string());
    let partitions = super::stored_partition_count(tx, root).await?.unwrap_or(1);
    let pulled = Pulled {
        key: key.to_string(),
        parsed,
        stored,
    };
    // Its end is folded after the commit (the caller folds it before it returns): the cancel's
    // transaction writes nothing a fold of its graph writes.
    let folded = super::graph::Apply::Folded;
    let wakes = super::worker::complete(tx, root, partitions, &pulled, None, None, folded).await?;
    Ok(Some(wakes))
}

async fn cancel_under<E: TitoEngine>(db: &E, root: &str, id: &str, why: &str) -> TitoResult<bool> {
    check_reason_under(root, why)?;
    if id.is_empty() {
        return Err(TitoError::invalid_argument("an event id is empty"));
    }
    let id_key = keys::event_id_key(root, id);
    let wakeups = crate::event::nudge::wakeups(db, root);
    let (root, why) = (root.to_string(), why.to_string());
    let cancelled = db
        .transaction(|tx| {
            let (root, why, id_key) = (root.clone(), why.clone(), id_key.clone());
            let wakeups = wakeups.clone();
            let db = db.clone();
            async move {
                let Some(target) = tx.get(id_key.as_bytes()).await? else {
                    return Ok::<_, TitoError>((false, Vec::new()));
                };
                let target = keys::key_str(&target)?.to_string();
                let Some(wakes) = cancel_row(&tx, &root, &target, &why).await? else {
                    return Ok((false, Vec::new()));
                };
                let folds = super::graph::folds_in(&wakes);
                super::graph::wake_after_commit(&db, &tx, wakes);
                wakeups.cancelled_after_commit(&tx, vec![target]);
                Ok((true, folds))
            }
        })
        .await?;
    let (cancelled, folds) = cancelled;
    super::graph::fold_now(db, folds).await;
    if cancelled {
        tracing::info!(queue = root, id, why, "queue invocation cancelled");
    }
    Ok(cancelled)
}

async fn cancel_owner_under<E: TitoEngine>(
    db: &E,
    root: &str,
    owner: &QueueOwner,
    why: &str,
) -> TitoResult<usize> {
    check_reason_under(root, why)?;
    owner.check()?;
    // Waiting workflow steps first: a pending one cancelled first could release them.
    let mut total = 0;
    for state in [keys::OWNER_WAITING, keys::OWNER_PENDING] {
        total += cancel_owner_state(db, root, owner, state, why).await?;
    }
    if total > 0 {
        tracing::info!(queue = root, owner = ?owner, total, why, "queue invocations cancelled");
    }
    Ok(total)
}

/// Cancels an owner's invocations whose owner keys are in `state` (pending or waiting).
async fn cancel_owner_state<E: TitoEngine>(
    db: &E,
    root: &str,
    owner: &QueueOwner,
    state: &str,
    why: &str,
) -> TitoResult<usize> {
    let prefix = format!(
        "{}{state}:",
        keys::owner_prefix(root, &owner.kind, &owner.id),
    );
    let end = keys::prefix_end(prefix.clone());
    let wakeups = crate::event::nudge::wakeups(db, root);
    // A batch is one transaction. Workers complete and lock rows of the same owner meanwhile,
    // and a large transaction loses every race against them: a batch whose transaction keeps
    // conflicting is halved (down to one row, which conflicts only with the worker completing
    // that very row), so the erasure always makes progress under load.
    let mut batch_rows = OWNER_BATCH;
    let quick = db.retry_policy().max_attempts(3);
    let mut total = 0;
    loop {
        let (root, why, prefix, end) = (
            root.to_string(),
            why.to_string(),
            prefix.clone(),
            end.clone(),
        );
        let policy = if batch_rows > 1 {
            quick.clone()
        } else {
            db.retry_policy()
        };
        let batch = db
            .transaction_with(policy, |tx| {
                let (root, why, prefix, end) =
                    (root.clone(), why.clone(), prefix.clone(), end.clone());
                let wakeups = wakeups.clone();
                let db = db.clone();
                async move {
                    let rows = tx
                        .scan(prefix.as_bytes(), end.as_bytes(), batch_rows)
                        .await?;
                    let mut cancelled = Vec::new();
                    let mut folds = Vec::new();
                    for (owner_key, _) in &rows {
                        let target = keys::owner_key_target(keys::key_str(owner_key)?)?;
                        if let Some(wakes) = cancel_row(&tx, &root, &target, &why).await? {
                            folds.extend(super::graph::folds_in(&wakes));
                            super::graph::wake_after_commit(&db, &tx, wakes);
                            cancelled.push(target);
                        } else {
                            // A dangling owner key: remove it so the scan moves on.
                            tx.delete(owner_key.clone()).await?;
                        }
                    }
                    let count = cancelled.len();
                    if count > 0 {
                        wakeups.cancelled_after_commit(&tx, cancelled);
                    }
                    Ok::<_, TitoError>((count, rows.len(), folds))
                }
            })
            .await;
        let batch = match batch {
            Ok((count, seen, folds)) => {
                super::graph::fold_now(db, folds).await;
                (count, seen)
            }
            Err(TitoError::RetriesExhausted { .. }) if batch_rows > 1 => {
                batch_rows = (batch_rows / 4).max(1);
                continue;
            }
            Err(err) => return Err(err),
        };
        total += batch.0;
        if batch.1 < batch_rows {
            break;
        }
        // Grows back after a batch that went through.
        batch_rows = (batch_rows * 2).min(OWNER_BATCH);
    }
    Ok(total)
}

/// Tells a running handler that its invocation was cancelled (or otherwise left the pending
/// state: erased by its owner, moved aside). Get it with [`cancellation`] inside the handler.
#[derive(Clone, Debug, Default)]
pub struct Cancellation {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    cancelled: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Cancellation {
    /// Whether the invocation was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancelled.load(Ordering::Acquire)
    }

    /// Waits until the invocation is cancelled (forever for one that is not).
    pub async fn cancelled(&self) {
        loop {
            let notified = self.inner.notify.notified();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn cancel(&self) {
        self.inner.cancelled.store(true, Ordering::Release);
        self.inner.notify.notify_waiters();
    }
}

tokio::task_local! {
    static CURRENT: Cancellation;
}

/// The running handler's [`Cancellation`]; outside a queue handler, one that never fires.
///
/// ```no_run
/// # use tito::{QueueEvent, QueueHandlerOutcome, TitoError};
/// # async fn work(_: &u32) {}
/// async fn handle(event: QueueEvent<u32>) -> Result<QueueHandlerOutcome<u32>, TitoError> {
///     let cancel = tito::queue::cancellation();
///     tokio::select! {
///         _ = work(&event.payload) => Ok(QueueHandlerOutcome::Acknowledge),
///         // Cancelled meanwhile: its outcome would not be applied anyway.
///         _ = cancel.cancelled() => Err(TitoError::handler("cancelled")),
///     }
/// }
/// ```
pub fn cancellation() -> Cancellation {
    CURRENT.try_with(Cancellation::clone).unwrap_or_default()
}

/// Runs `work` with `token` as its [`cancellation`].
pub(crate) async fn with_cancellation<F: std::future::Future>(
    token: Cancellation,
    work: F,
) -> F::Output {
    CURRENT.scope(token, work).await
}

use super::graph::{self, Graphs, batch, workflow};
use crate::engine;

impl<E: TitoEngine> Graphs<E> {
    /// Cancels every step of workflow `id` that has not finished (waiting or pending; a
    /// running handler is told, see [`cancellation`]), dependents
    /// before what they depend on, in transactions of up to 128 steps. Returns how many it
    /// cancelled; 0 for an unknown or finished workflow.
    pub async fn cancel_workflow(&self, id: &str, why: &str) -> TitoResult<usize> {
        graph::check_name("a workflow id", id)?;
        graph::check_reason(why)?;
        let steps = engine::read_only(self.engine(), async |tx| {
            workflow::step_records(tx, id).await
        })
        .await?;
        // Dependents first: a dependency cancelled first would release the steps that run
        // anyway, only for them to be cancelled next.
        let order = workflow::reverse_topological(&steps);
        let mut total = 0;
        for chunk in order.chunks(workflow::CANCEL_BATCH) {
            let chunk: Arc<Vec<(String, workflow::StepRecord)>> =
                Arc::new(chunk.iter().map(|&i| steps[i].clone()).collect());
            let (db, why) = (self.engine().clone(), why.to_string());
            let workflow_id = id.to_string();
            let (cancelled, folds) = self
                .engine()
                .transaction(|tx| {
                    let (chunk, db, why) = (chunk.clone(), db.clone(), why.clone());
                    let workflow_id = workflow_id.clone();
                    async move {
                        let mut cancelled = 0;
                        let mut folds = Vec::new();
                        for (name, record) in chunk.iter() {
                            let id_key = keys::event_id_key(&record.q, &record.id);
                            let Some(at) = tx.get(id_key.as_bytes()).await? else {
                                continue;
                            };
                            let at = keys::key_str(&at)?.to_string();
                            // Still this step (its id may name a later invocation).
                            let Some(row) = tx.get(at.as_bytes()).await? else {
                                continue;
                            };
                            if !workflow::row_is_step(&row, &workflow_id, name)? {
                                continue;
                            }
                            if let Some(wakes) = cancel_row(&tx, &record.q, &at, &why).await? {
                                folds.extend(graph::folds_in(&wakes));
                                graph::wake_after_commit(&db, &tx, wakes);
                                crate::event::nudge::wakeups(&db, &record.q)
                                    .cancelled_after_commit(&tx, vec![at]);
                                cancelled += 1;
                            }
                        }
                        Ok::<_, TitoError>((cancelled, folds))
                    }
                })
                .await?;
            graph::fold_now(self.engine(), folds).await;
            total += cancelled;
        }
        if total > 0 {
            tracing::info!(workflow = id, total, why, "workflow cancelled");
        }
        Ok(total)
    }

    /// Cancels every open child of batch `id` (in transactions of up to 128), and closes it so
    /// that its `Complete` callback fires once they are cancelled. Returns how many it
    /// cancelled.
    pub async fn cancel_batch(&self, id: &str, why: &str) -> TitoResult<usize> {
        graph::check_name("a batch id", id)?;
        graph::check_reason(why)?;
        match self.close_batch(id).await {
            Err(TitoError::NotFound(_)) => return Ok(0),
            closed => closed?,
        };
        let prefix = keys::batch_child_prefix(id);
        let end = keys::prefix_end(prefix.clone());
        let mut from = prefix.into_bytes();
        let mut total = 0;
        loop {
            let (db, why, start) = (self.engine().clone(), why.to_string(), from.clone());
            let batch_id = id.to_string();
            let (cancelled, last, seen, folds) = self
                .engine()
                .transaction(|tx| {
                    let (db, why, start, end) =
                        (db.clone(), why.clone(), start.clone(), end.clone());
                    let batch_id = batch_id.clone();
                    async move {
                        let rows = tx.scan(&start, end.as_bytes(), batch::CANCEL_BATCH).await?;
                        let mut cancelled = 0;
                        let mut folds = Vec::new();
                        for (key, value) in &rows {
                            let child: batch::ChildRecord =
                                graph::parse("batch child", key, value)?;
                            let at = tx
                                .get(keys::event_id_key(&child.q, &child.id).as_bytes())
                                .await?;
                            let Some(at) = at else { continue };
                            let at = keys::key_str(&at)?.to_string();
                            // Still this batch's child (its id may name a later invocation).
                            let Some(row) = tx.get(at.as_bytes()).await? else {
                                continue;
                            };
                            let stored = crate::event::StoredEvent::parse(&row)?;
                            if stored.batch.as_ref().map(|link| link.id.as_str())
                                != Some(batch_id.as_str())
                            {
                                continue;
                            }
                            if let Some(wakes) = cancel_row(&tx, &child.q, &at, &why).await? {
                                folds.extend(graph::folds_in(&wakes));
                                graph::wake_after_commit(&db, &tx, wakes);
                                crate::event::nudge::wakeups(&db, &child.q)
                                    .cancelled_after_commit(&tx, vec![at]);
                                cancelled += 1;
                            }
                        }
                        let last = rows.last().map(|(key, _)| key.clone());
                        Ok::<_, TitoError>((cancelled, last, rows.len(), folds))
                    }
                })
                .await?;
            graph::fold_now(self.engine(), folds).await;
            total += cancelled;
            match last {
                Some(last) if seen == batch::CANCEL_BATCH => from = keys::key_after_bytes(&last),
                _ => break,
            }
        }
        if total > 0 {
            tracing::info!(batch = id, total, why, "batch cancelled");
        }
        Ok(total)
    }
}
