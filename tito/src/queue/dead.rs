//! The dead state: invocations a failure policy gave up on, kept until an operator retries
//! (back to pending, attempt 1) or discards them.

use serde::Serialize;
use serde_json::Value;

use super::{Queue, QueueOwner};
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::StoredEvent;
use crate::event::publish::{forget_event_id, insert_pending};
use crate::keys;

/// An invocation in a queue's dead state.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadInvocation {
    /// The event id (its event-id key points at the dead row, so publishing the id again is a
    /// duplicate until the row is retried or discarded).
    pub id: String,
    /// The business key.
    pub key: String,
    /// How many attempts failed.
    pub attempts: u32,
    /// The last attempt's error.
    pub error: String,
    /// When it died (engine time, Unix ms).
    pub dead_at_ms: u64,
    /// Its due time when it last ran (Unix s).
    pub timestamp: i64,
    /// Its owner, if any.
    pub owner: Option<QueueOwner>,
    /// The payload, as JSON.
    pub payload: Value,
    /// Its storage key (`{queue}:dead:{id}`).
    pub storage_key: String,
}

impl DeadInvocation {
    pub(crate) fn from_row(key: &[u8], value: &[u8]) -> TitoResult<Self> {
        let storage_key = crate::keys::key_text(key);
        let stored = StoredEvent::parse(value)
            .map_err(|err| TitoError::Integrity(format!("dead row {storage_key:?}: {err}")))?;
        Ok(DeadInvocation {
            id: stored.id,
            key: stored.key,
            attempts: stored.failures,
            error: stored.last_error.unwrap_or_default(),
            dead_at_ms: stored.dead_at.map_or(0, engine::version_millis),
            timestamp: stored.timestamp,
            owner: stored.owner,
            payload: stored.payload,
            storage_key,
        })
    }
}

impl<E: TitoEngine> Queue<E> {
    /// Up to `limit` (1 to 1,000) dead invocations in event-id order, after the id `after`.
    pub async fn dead(&self, after: Option<&str>, limit: usize) -> TitoResult<Vec<DeadInvocation>> {
        list_dead_under(&self.db, &self.root, after, limit).await
    }

    /// Moves the dead invocation `id` back to pending: attempt 1, due now, its failures and error
    /// cleared; this process's workers are woken after the commit. `false` when `id` is not dead.
    pub async fn retry_dead(&self, id: &str) -> TitoResult<bool> {
        retry_dead_under(&self.db, &self.root, id).await
    }

    /// Deletes the dead invocation `id` with its owner key and its event-id key (the id may be
    /// published again). `false` when `id` is not dead.
    pub async fn discard_dead(&self, id: &str) -> TitoResult<bool> {
        discard_dead_under(&self.db, &self.root, id).await
    }
}

/// [`Queue::dead`] on the queue named `topic` (`None`: the default queue), for tools.
pub async fn dead<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    after: Option<&str>,
    limit: usize,
) -> TitoResult<Vec<DeadInvocation>> {
    list_dead_under(db, &keys::queue_root(topic), after, limit).await
}

/// [`Queue::retry_dead`] on the queue named `topic`, for tools.
pub async fn retry_dead<E: TitoEngine>(db: &E, topic: Option<&str>, id: &str) -> TitoResult<bool> {
    retry_dead_under(db, &keys::queue_root(topic), id).await
}

/// [`Queue::discard_dead`] on the queue named `topic`, for tools.
pub async fn discard_dead<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    id: &str,
) -> TitoResult<bool> {
    discard_dead_under(db, &keys::queue_root(topic), id).await
}

async fn list_dead_under<E: TitoEngine>(
    db: &E,
    root: &str,
    after: Option<&str>,
    limit: usize,
) -> TitoResult<Vec<DeadInvocation>> {
    if limit == 0 || limit > 1000 {
        return Err(TitoError::invalid_argument(format!(
            "a page of dead invocations holds 1 to 1000; {limit} asked"
        )));
    }
    let prefix = keys::dead_prefix(root);
    let start = match after {
        Some(id) => keys::key_after(keys::dead_key(root, id)),
        None => prefix.clone(),
    };
    let end = keys::prefix_end(prefix);
    let rows = engine::read_only(db, async |tx| {
        tx.scan(start.as_bytes(), end.as_bytes(), limit).await
    })
    .await?;
    rows.iter()
        .map(|(key, value)| DeadInvocation::from_row(key, value))
        .collect()
}

/// Deletes a dead row's keys inside `tx` (a transaction of its own, rolled back on error): the
/// row, its owner key, and its event-id key when it still points at the row. Returns the row, or
/// `None` when `id` is not dead.
async fn remove_dead<X: TitoTransaction>(
    tx: &X,
    root: &str,
    id: &str,
) -> TitoResult<Option<StoredEvent>> {
    let dead_key = keys::dead_key(root, id);
    let Some(value) = tx.get(dead_key.as_bytes()).await? else {
        return Ok(None);
    };
    let stored = StoredEvent::parse(&value)
        .map_err(|err| TitoError::Integrity(format!("dead row {dead_key:?}: {err}")))?;
    forget_event_id(tx, root, id, &dead_key).await?;
    if let Some(owner) = &stored.owner {
        let owner_key = keys::owner_key(root, &owner.kind, &owner.id, keys::OWNER_DEAD, &dead_key);
        tx.delete(owner_key.into_bytes()).await?;
    }
    tx.delete(dead_key.into_bytes()).await?;
    Ok(Some(stored))
}

async fn retry_dead_under<E: TitoEngine>(db: &E, root: &str, id: &str) -> TitoResult<bool> {
    let (root, id) = (root.to_string(), id.to_string());
    let wakeups = crate::event::nudge::wakeups(db, &root);
    db.transaction(|tx| {
        let (root, id, wakeups) = (root.clone(), id.clone(), wakeups.clone());
        async move {
            let Some(mut stored) = remove_dead(&tx, &root, &id).await? else {
                return Ok(false);
            };
            // An error from here on rolls the removal back with the rest.
            let partitions = crate::event::publish::stored_partitions(&tx, &root)
                .await?
                .ok_or_else(|| {
                    TitoError::Integrity(format!(
                        "dead invocation {id:?} of queue {:?}, whose partition count is not \
                         recorded",
                        keys::queue_name(&root)
                    ))
                })?;
            let now_s = engine::version_millis(tx.start_version()) / 1000;
            stored.timestamp = i64::try_from(now_s).unwrap_or(i64::MAX);
            stored.failures = 0;
            stored.last_error = None;
            stored.dead_at = None;
            // A batch counted the child dead when it died: run again, it is no child of it
            // (the batch's callbacks fired or will fire on that count). A workflow step stays
            // one: the steps holding for it run once it completes.
            stored.batch = None;
            let bytes = stored.to_bytes()?;
            insert_pending(&tx, &root, partitions, &stored, bytes).await?;
            wakeups.wake_after_commit(&tx, crate::event::partition_for(&stored.key, partitions));
            Ok::<_, TitoError>(true)
        }
    })
    .await
}

async fn discard_dead_under<E: TitoEngine>(db: &E, root: &str, id: &str) -> TitoResult<bool> {
    let (root, id) = (root.to_string(), id.to_string());
    db.transaction(|tx| {
        let (root, id) = (root.clone(), id.clone());
        async move { Ok::<_, TitoError>(remove_dead(&tx, &root, &id).await?.is_some()) }
    })
    .await
}
