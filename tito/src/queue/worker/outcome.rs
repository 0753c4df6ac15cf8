//! Applying outcomes: batches of acknowledgements and replacements, each batch one transaction
//! that re-checks the partition leases it applies under and locks a fence slot of each.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;

use super::Running;
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::publish::insert_pending;
use crate::event::{QueueHandlerOutcome, StoredEvent};
use crate::keys;
use crate::queue::Queue;
use crate::queue::completed::store_completed;
use crate::queue::graph::{self, Finish, Wake};
use crate::queue::lease::HeldCheck;
use crate::queue::pull::Pulled;
use crate::telemetry::names;

/// A worker's outcomes apply their ends to graphs by folds (see `queue::graph`).
const FOLDED: graph::Apply = graph::Apply::Folded;

/// An outcome ready to commit.
pub(super) struct Outcome {
    pub running: Running,
    pub kind: OutcomeKind,
}

/// What an outcome does to its invocation.
pub(super) enum OutcomeKind {
    /// Completed, with the handler's result when it returned one.
    Acknowledge { result: Option<serde_json::Value> },
    /// Completed, and the checked replacement inserted.
    Reschedule(Box<StoredEvent>),
    /// A failed attempt under a failure policy: replaced by the same invocation due after
    /// `backoff`, its failure counted.
    Retry { backoff: Duration, error: String },
    /// The last failed attempt under a failure policy: moved to the dead state.
    Dead { error: String },
}

/// Applies outcomes in batches of at most `batch_size`; whatever does not commit stays pending
/// (or, on an unknown outcome, is either completed or delivered again). Returns every key it
/// handled, applied or not, so the caller can forget them. `cluster`: `owner` is a cluster
/// node (its leases live as long as its node record, read with the rest).
pub(super) async fn commit<E: TitoEngine>(
    queue: &Queue<E>,
    owner: &str,
    cluster: bool,
    batch_size: usize,
    outcomes: Vec<Outcome>,
) -> Committed {
    let counters = queue.counters();
    let mut batches: Vec<Vec<Outcome>> = Vec::new();
    for outcome in outcomes {
        // Two invocations of one event never share a batch (their completed keys would).
        let slot = batches.iter().position(|batch| {
            batch.len() < batch_size
                && !batch
                    .iter()
                    .any(|o| o.running.pulled.stored.id == outcome.running.pulled.stored.id)
        });
        match slot {
            Some(index) => batches[index].push(outcome),
            None => batches.push(vec![outcome]),
        }
    }
    let mut done = Vec::new();
    let mut lease_lost = false;
    for batch in batches {
        metrics::histogram!(names::QUEUE_OUTCOME_BATCH, "queue" => queue.label().to_string())
            .record(batch.len() as f64);
        match apply(queue, owner, cluster, &batch).await {
            Ok((applied, lost)) => {
                lease_lost |= lost;
                for outcome in &batch {
                    if !applied.contains(&outcome.running.pulled.key) {
                        continue;
                    }
                    match outcome.kind {
                        OutcomeKind::Acknowledge { .. } => {
                            queue.count(&counters.acknowledged, names::QUEUE_ACKNOWLEDGED, 1)
                        }
                        OutcomeKind::Reschedule(_) => {
                            queue.count(&counters.rescheduled, names::QUEUE_RESCHEDULED, 1)
                        }
                        OutcomeKind::Retry { .. } => {
                            queue.count(&counters.retried, names::QUEUE_RETRIED, 1)
                        }
                        OutcomeKind::Dead { .. } => {
                            queue.count(&counters.dead, names::QUEUE_DEAD, 1)
                        }
                    }
                }
                let skipped = batch.len() - applied.len();
                if skipped > 0 {
                    let failures = names::QUEUE_OUTCOME_FAILURES;
                    queue.count(&counters.outcome_failures, failures, skipped as u64);
                }
            }
            Err(err) => {
                let failures = names::QUEUE_OUTCOME_FAILURES;
                queue.count(&counters.outcome_failures, failures, batch.len() as u64);
                tracing::warn!(error = %err, invocations = batch.len(), "queue outcomes not applied; the invocations stay pending");
            }
        }
        done.extend(batch.into_iter().map(|o| o.running.pulled.key));
    }
    Committed { done, lease_lost }
}

/// What [`commit`] did.
pub(super) struct Committed {
    /// Every key it handled, applied or not.
    pub done: Vec<String>,
    /// Whether the store said a lease of this worker is no longer held (its expiry passed on
    /// the store's clock, which may have jumped ahead of this host's): no handler may start
    /// before the worker renewed its leases.
    pub lease_lost: bool,
}

/// One outcome transaction; returns the keys of the invocations it completed. It reads
/// everything it checks in one batch before writing: each partition's lease (holder record and
/// expiry, or for a cluster node its own node record) and each invocation's pending row; on TiKV
/// that is one read round trip whatever the batch holds. (An end of a graph's member writes its
/// end record without reading anything.)
async fn apply<E: TitoEngine>(
    queue: &Queue<E>,
    owner: &str,
    cluster: bool,
    batch: &[Outcome],
) -> TitoResult<(HashSet<String>, bool)> {
    let root = queue.root();
    let partitions = queue.config().partitions;
    // One check per partition and lease generation (a partition lost and taken again between
    // two pulls has invocations of both generations).
    let mut order: Vec<(u32, u64)> = batch
        .iter()
        .map(|o| (o.running.pulled.parsed.partition, o.running.generation))
        .collect();
    order.sort_unstable();
    order.dedup();
    // A fence slot per partition, held for the whole transaction (the worker's handler
    // transactions hold others).
    let mut fences: HashMap<u32, crate::queue::lease::Fence> = HashMap::new();
    for outcome in batch {
        let partition = outcome.running.pulled.parsed.partition;
        fences
            .entry(partition)
            .or_insert_with(|| outcome.running.fences.take(partition));
    }
    let checks: Vec<((u32, u64), HeldCheck<'_>)> = order
        .iter()
        .map(|&(p, g)| {
            let slot = fences.get(&p).and_then(|fence| fence.slot());
            ((p, g), HeldCheck::new(root, p, owner, cluster).fenced(slot))
        })
        .collect();
    let mut reads: Vec<Vec<u8>> = checks.iter().flat_map(|(_, c)| c.keys().to_vec()).collect();
    let lease_reads = reads.len();
    reads.extend(
        batch
            .iter()
            .map(|o| o.running.pulled.key.clone().into_bytes()),
    );
    let pending_reads = reads.len();
    // An acknowledgement whose commit outcome is unknown is resolved, not guessed: applied, it
    // counts as applied; proven not applied, it is replayed (after re-checking the lease).
    let policy = queue.engine().retry_policy().resolving();
    let (checks, reads) = (&checks, &reads);
    queue
        .engine()
        .transaction_with(policy, |tx| async move {
            let values = tx.batch_get(reads).await?;
            let (lease_values, pending) = values[..pending_reads].split_at(lease_reads);
            let mut held: HashMap<(u32, u64), bool> = HashMap::new();
            let mut lost = false;
            let per_check = lease_values.chunks(HeldCheck::KEYS);
            for (&((partition, generation), ref check), values) in checks.iter().zip(per_check) {
                let ok = check.decide(&tx, generation, values).await?;
                if !ok {
                    tracing::warn!(partition, "partition lease lost; outcomes left pending");
                    lost = true;
                }
                held.insert((partition, generation), ok);
            }
            let mut applied = HashSet::new();
            for (outcome, row) in batch.iter().zip(pending) {
                let pulled = &outcome.running.pulled;
                if !held[&(pulled.parsed.partition, outcome.running.generation)] {
                    continue;
                }
                // Erased by its owner meanwhile: nothing to complete.
                if row.is_none() {
                    continue;
                }
                let wakes = match &outcome.kind {
                    OutcomeKind::Acknowledge { result } => {
                        complete(&tx, root, partitions, pulled, None, result.as_ref(), FOLDED)
                            .await?
                    }
                    OutcomeKind::Reschedule(next) => {
                        complete(&tx, root, partitions, pulled, Some(next), None, FOLDED).await?
                    }
                    OutcomeKind::Retry { backoff, error } => {
                        retry(&tx, root, partitions, pulled, *backoff, error).await?;
                        Vec::new()
                    }
                    OutcomeKind::Dead { error } => bury(&tx, root, pulled, error).await?,
                };
                graph::wake_after_commit(queue.engine(), &tx, wakes);
                applied.insert(pulled.key.clone());
            }
            Ok::<_, TitoError>((applied, lost))
        })
        .await
}

/// Completes one invocation inside `tx`, whose pending row the caller read and found: deletes
/// the pending row, writes the completed row (with the handler's `result`), moves the owner key
/// and the event-id key, and inserts the replacement. Without a replacement the invocation
/// ended, and its end is applied to its workflow and batch: returns the partitions that got
/// due rows (to wake once `tx` commits).
pub(in crate::queue) async fn complete<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    pulled: &Pulled,
    replacement: Option<&StoredEvent>,
    result: Option<&serde_json::Value>,
    apply: graph::Apply,
) -> TitoResult<Vec<Wake>> {
    remove_pending(tx, root, pulled).await?;
    let mut completed = pulled.stored.clone();
    completed.result = result.map(|value| crate::event::StoredResult {
        value: value.clone(),
    });
    store_completed(tx, root, &mut completed, replacement.is_none()).await?;
    match replacement {
        // The replacement takes the event id over.
        Some(next) => {
            insert_pending(tx, root, partitions, next, next.to_bytes()?).await?;
            Ok(Vec::new())
        }
        None => {
            let how = match completed.cancelled {
                Some(_) => Finish::Cancelled,
                None => Finish::Completed,
            };
            graph::finished(tx, root, &completed, how, apply).await
        }
    }
}

/// Deletes a pending row, its pending owner key and its rate-limit move record inside `tx`.
pub(in crate::queue) async fn remove_pending<X: TitoTransaction>(
    tx: &X,
    root: &str,
    pulled: &Pulled,
) -> TitoResult<()> {
    tx.delete(pulled.key.clone().into_bytes()).await?;
    if pulled.stored.moved_from.is_some() {
        tx.delete(keys::moved_key(root, &pulled.stored.id).into_bytes())
            .await?;
    }
    if let Some(owner) = &pulled.stored.owner {
        let pending_owner = keys::owner_key(
            root,
            &owner.kind,
            &owner.id,
            keys::OWNER_PENDING,
            &pulled.key,
        );
        tx.delete(pending_owner.into_bytes()).await?;
    }
    Ok(())
}

/// A failed attempt under a failure policy, inside `tx`: the pending row is replaced by the same
/// invocation (id, key, owner, payload) with one more failure and the error, due at the first
/// whole second at or after `backoff` from the transaction's time (never before its own due
/// time). The replacement takes the event id over.
pub(super) async fn retry<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    pulled: &Pulled,
    backoff: Duration,
    error: &str,
) -> TitoResult<()> {
    remove_pending(tx, root, pulled).await?;
    let now_ms = crate::engine::version_millis(tx.start_version());
    let due_ms = now_ms.saturating_add(crate::util::millis(backoff));
    let due = i64::try_from(due_ms.div_ceil(1000)).unwrap_or(i64::MAX);
    let mut next = pulled.stored.clone();
    next.timestamp = next.timestamp.max(due);
    next.moved_from = None;
    next.failures = next.failures.saturating_add(1);
    next.last_error = Some(bounded_error(error));
    insert_pending(tx, root, partitions, &next, next.to_bytes()?).await?;
    Ok(())
}

/// The last failed attempt under a failure policy, inside `tx`: the pending row moves to the
/// queue's dead state (`{queue}:dead:{event id}`) with its failure count and error; the owner
/// key and the event-id key follow it, so the id stays taken while it is dead.
pub(super) async fn bury<X: TitoTransaction>(
    tx: &X,
    root: &str,
    pulled: &Pulled,
    error: &str,
) -> TitoResult<Vec<Wake>> {
    remove_pending(tx, root, pulled).await?;
    let mut dead = pulled.stored.clone();
    dead.moved_from = None;
    dead.failures = dead.failures.saturating_add(1);
    dead.last_error = Some(bounded_error(error));
    dead.dead_at = Some(tx.start_version());
    let dead_key = keys::dead_key(root, &dead.id);
    tx.put(dead_key.clone().into_bytes(), serde_json::to_vec(&dead)?)
        .await?;
    if let Some(owner) = &dead.owner {
        let owner_key = keys::owner_key(root, &owner.kind, &owner.id, keys::OWNER_DEAD, &dead_key);
        tx.put(owner_key.into_bytes(), Vec::new()).await?;
    }
    tx.put(
        keys::event_id_key(root, &dead.id).into_bytes(),
        dead_key.into_bytes(),
    )
    .await?;
    graph::finished(tx, root, &dead, Finish::Dead, graph::Apply::Folded).await
}

/// The longest error text kept beside a row.
const MAX_ERROR_BYTES: usize = 2048;

/// An error's text, cut at a character boundary to at most [`MAX_ERROR_BYTES`].
fn bounded_error(error: &str) -> String {
    if error.len() <= MAX_ERROR_BYTES {
        return error.to_string();
    }
    let mut end = MAX_ERROR_BYTES;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &error[..end])
}

/// The result an outcome carries ([`QueueHandlerOutcome::AcknowledgeWith`]).
pub(super) fn result_of<T>(outcome: QueueHandlerOutcome<T>) -> Option<serde_json::Value> {
    match outcome {
        QueueHandlerOutcome::AcknowledgeWith(result) => Some(result.0),
        _ => None,
    }
}

/// Checks the event a handler's outcome inserts after the invocation it completes: a
/// `Reschedule` replacement keeps the id, key, owner and payload (only the timestamp may
/// change); an `Advance` step keeps the id, key and owner. Both keep the invocation's urgency
/// and its own number of attempts, however the event was built (those fields of the new event
/// are not read). `None` for
/// `Acknowledge`.
pub(super) fn successor<T: Serialize>(
    current: &StoredEvent,
    outcome: &QueueHandlerOutcome<T>,
) -> Result<Option<StoredEvent>, String> {
    let (next, keeps_payload, how) = match outcome {
        QueueHandlerOutcome::Reschedule(next) => (
            next,
            true,
            "a Reschedule replacement must keep the event's id, key, owner and payload: build it with QueueEvent::rescheduled, or return an Advance (QueueEvent::advanced) to run it again with another payload",
        ),
        QueueHandlerOutcome::Advance(next) => (
            next,
            false,
            "an Advance step must keep the event's id, key and owner (use QueueEvent::advanced)",
        ),
        _ => return Ok(None),
    };
    let mut next = StoredEvent::from_event(next).map_err(|err| err.to_string())?;
    next.urgency = current.urgency;
    next.max_attempts = current.max_attempts;
    // A workflow step or batch child stays one until its last step ends.
    next.step = current.step.clone();
    next.batch = current.batch.clone();
    next.to_bytes().map_err(|err| err.to_string())?;
    if next.id != current.id
        || next.key != current.key
        || next.owner != current.owner
        || (keeps_payload && next.payload != current.payload)
    {
        return Err(how.into());
    }
    Ok(Some(next))
}
