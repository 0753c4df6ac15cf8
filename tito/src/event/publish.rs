//! Planning a publication inside a transaction: the queue's stored partition count, the
//! pending row with its owner and event-id keys, idempotency by event id, and a model event's
//! publication. Reads happen first; the writes go into an [`engine::Writes`] plan that the
//! caller applies (so a refused publication leaves nothing in the caller's transaction).

use serde::{Deserialize, Serialize};

use super::{ModelEvent, QueueEvent, StoredEvent, partition_for};
use crate::engine::{self, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

#[derive(Serialize, Deserialize)]
struct QueueMeta {
    partitions: u32,
}

/// Checks the stored partition count of a queue; plans its metadata when the queue has none
/// yet. Returns whether the metadata was there.
pub(crate) async fn check_meta<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    writes: &mut engine::Writes,
) -> TitoResult<bool> {
    check_meta_or(tx, root, partitions, writes, |stored| {
        format!(
            "queue {:?} has {stored} partitions; this handle was configured with {partitions} \
             (declare it with TOPIC.spec({stored}, ..) or QueueConfig::new({stored}, ..); a \
             model's events use the store's partition count, db.partitions())",
            keys::queue_name(root)
        )
    })
    .await
}

/// [`check_meta`], saying `mismatch(stored)` when the stored count is another.
async fn check_meta_or<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    writes: &mut engine::Writes,
    mismatch: impl FnOnce(u32) -> String,
) -> TitoResult<bool> {
    match stored_partitions(tx, root).await? {
        Some(stored) if stored != partitions => Err(TitoError::invalid_argument(mismatch(stored))),
        Some(_) => Ok(true),
        None => {
            writes.put(
                keys::queue_meta_key(root),
                serde_json::to_vec(&QueueMeta { partitions })?,
            );
            Ok(false)
        }
    }
}

/// The partition count stored for the queue at `root`, if it has metadata.
pub(crate) async fn stored_partitions<X: TitoTransaction>(
    tx: &X,
    root: &str,
) -> TitoResult<Option<u32>> {
    let key = keys::queue_meta_key(root);
    match tx.get(key.as_bytes()).await? {
        Some(bytes) => {
            let meta: QueueMeta = serde_json::from_slice(&bytes).map_err(|err| {
                TitoError::Integrity(format!("queue metadata {key:?} is malformed: {err}"))
            })?;
            Ok(Some(meta.partitions))
        }
        None => Ok(None),
    }
}

/// Plans a pending row, its owner key and its event-id key (pointing at the row), with no
/// duplicate check. Returns the row's key. A due time relative to the publication is counted
/// here, from the transaction's time: the clock workers compare it with.
pub(crate) fn plan_insert(
    start_version: u64,
    root: &str,
    partitions: u32,
    stored: &StoredEvent,
    bytes: Vec<u8>,
    writes: &mut engine::Writes,
) -> TitoResult<String> {
    let settled = stored.settle_due(start_version);
    let (stored, bytes) = match &settled {
        Some(settled) => (settled, settled.to_bytes()?),
        None => (stored, bytes),
    };
    let partition = partition_for(&stored.key, partitions);
    // Ordered by the due time less the urgency's boost; the row keeps its own due time.
    let key = keys::pending_key(
        root,
        partition,
        stored.ordered_at(),
        start_version,
        &stored.id,
    );
    writes.put(key.clone(), bytes);
    writes.put(
        keys::event_id_key(root, &stored.id),
        key.clone().into_bytes(),
    );
    if let Some(owner) = &stored.owner {
        let owner_key = keys::owner_key(root, &owner.kind, &owner.id, keys::OWNER_PENDING, &key);
        writes.put(owner_key, Vec::new());
    }
    Ok(key)
}

/// Writes a pending row, its owner key and its event-id key (pointing at the row), with no
/// duplicate check: publication checked it, and a replacement takes over its own id.
pub(crate) async fn insert_pending<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    stored: &StoredEvent,
    bytes: Vec<u8>,
) -> TitoResult<String> {
    let mut writes = engine::Writes::default();
    let key = plan_insert(
        tx.start_version(),
        root,
        partitions,
        stored,
        bytes,
        &mut writes,
    )?;
    writes.apply(tx).await?;
    Ok(key)
}

/// Deletes the event-id key of `id` when it still points at `storage_key` (a newer invocation
/// of the id keeps its own).
pub(crate) async fn forget_event_id<X: TitoTransaction>(
    tx: &X,
    root: &str,
    id: &str,
    storage_key: &str,
) -> TitoResult<()> {
    let id_key = keys::event_id_key(root, id);
    if tx.get(id_key.as_bytes()).await?.as_deref() == Some(storage_key.as_bytes()) {
        tx.delete(id_key.into_bytes()).await?;
    }
    Ok(())
}

/// A model's event, encoded and checked (id, timestamp, owner, size) before a write begins.
#[derive(Debug)]
pub(crate) struct PreparedEvent {
    stored: StoredEvent,
    bytes: Vec<u8>,
}

impl PreparedEvent {
    pub(crate) fn new<T: Serialize>(event: &QueueEvent<ModelEvent<T>>) -> TitoResult<Self> {
        let stored = StoredEvent::from_event(event)?;
        let bytes = stored.to_bytes()?;
        Ok(PreparedEvent { stored, bytes })
    }
}

/// Plans the publication of a model's event to the queue named `topic` (the model layer's
/// hook): reads the queue's metadata and the event's id key now, adds the writes to `writes`.
/// Returns the queue's root and the partition to wake after the commit.
///
/// A model event's id is made from its row and its write's version, which no other transaction
/// shares; an id already live in the queue was published by an earlier write of the same row in
/// this transaction, so this one takes the next free `{id}.{n}` (the same sequence on a replay).
pub(crate) async fn plan_model_event<X: TitoTransaction>(
    tx: &X,
    topic: &str,
    partitions: u32,
    mut event: PreparedEvent,
    writes: &mut engine::Writes,
) -> TitoResult<(String, u32)> {
    let root = keys::queue_root(Some(topic));
    // The write chose no count: the store's is the only one, so the fix is the store's.
    check_meta_or(tx, &root, partitions, writes, |stored| {
        format!(
            "open the store with {stored} partitions, the count queue {topic:?} holds: this \
             write publishes a model event to it with the store's count ({partitions}, \
             db.partitions()), and a queue keeps the count it was first used with"
        )
    })
    .await?;
    let base = event.stored.id.clone();
    for n in 1u32.. {
        let id_key = keys::event_id_key(&root, &event.stored.id);
        if tx.get(id_key.as_bytes()).await?.is_none() && !writes.has(id_key.as_bytes()) {
            break;
        }
        event.stored.id = format!("{base}.{n}");
        event.bytes = event.stored.to_bytes()?;
    }
    let partition = partition_for(&event.stored.key, partitions);
    plan_insert(
        tx.start_version(),
        &root,
        partitions,
        &event.stored,
        event.bytes,
        writes,
    )?;
    Ok((root, partition))
}
