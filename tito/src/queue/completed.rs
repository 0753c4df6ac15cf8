//! Writing an invocation's completed row (used by the outcome path, cancellations and the
//! workflows' cascades).

use crate::engine::TitoTransaction;
use crate::error::TitoResult;
use crate::event::StoredEvent;
use crate::keys;

/// Writes `completed` as a completed row inside `tx` (its `processed_at` set to the
/// transaction's version) with its owner key; `keeps_id`: the event-id key points at it (the
/// completed row keeps the id until retention deletes it). Returns the row's key.
pub(in crate::queue) async fn store_completed<X: TitoTransaction>(
    tx: &X,
    root: &str,
    completed: &mut StoredEvent,
    keeps_id: bool,
) -> TitoResult<String> {
    let processed_at = tx.start_version();
    completed.processed_at = Some(processed_at);
    let completed_key = keys::completed_key(
        root,
        processed_at,
        completed.timestamp.max(0) as u64,
        &completed.id,
    );
    tx.put(
        completed_key.clone().into_bytes(),
        serde_json::to_vec(&completed)?,
    )
    .await?;
    if let Some(owner) = &completed.owner {
        let completed_owner = keys::owner_key(
            root,
            &owner.kind,
            &owner.id,
            keys::OWNER_COMPLETED,
            &completed_key,
        );
        tx.put(completed_owner.into_bytes(), Vec::new()).await?;
    }
    if keeps_id {
        tx.put(
            keys::event_id_key(root, &completed.id).into_bytes(),
            completed_key.clone().into_bytes(),
        )
        .await?;
    }
    Ok(completed_key)
}
