//! Partition leases: which worker may run a partition, with a generation (fencing token) and an
//! expiry measured in engine versions, never in a node's clock.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// A lease as stored under `{queue}:lease:{partition}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Lease {
    pub owner: String,
    pub generation: u64,
    /// The engine version after which the lease is void (standalone leases).
    pub expires: u64,
    /// Cluster leases: the holder's process epoch; the lease is valid while the holder's node
    /// record is alive with this epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

fn parse(key: &str, bytes: &[u8]) -> Option<Lease> {
    match serde_json::from_slice(bytes) {
        Ok(lease) => Some(lease),
        Err(err) => {
            tracing::warn!(key, error = %err, "malformed partition lease; treating it as free");
            None
        }
    }
}

/// Takes every free or expired lease among `partitions` and renews the ones `owner` holds, in
/// one transaction. Returns the leases `owner` holds afterwards.
pub(crate) async fn acquire<E: TitoEngine>(
    db: &E,
    root: &str,
    partitions: &[u32],
    owner: &str,
    duration_ms: u64,
) -> TitoResult<HashMap<u32, Lease>> {
    let keys: Vec<String> = partitions
        .iter()
        .map(|p| keys::lease_key(root, *p))
        .collect();
    db.transaction(|tx| {
        let keys = keys.clone();
        async move {
            let now = tx.start_version();
            let expires = now.saturating_add(engine::version_from_millis(duration_ms));
            let raw: Vec<Vec<u8>> = keys.iter().map(|k| k.clone().into_bytes()).collect();
            let current = tx.batch_get(&raw).await?;
            let mut held = HashMap::new();
            for ((partition, key), value) in partitions.iter().zip(&keys).zip(current) {
                let lease = value.as_deref().and_then(|v| parse(key, v));
                let generation = match &lease {
                    // A cluster lease is not a standalone worker's to take.
                    Some(lease) if lease.epoch.is_some() => continue,
                    Some(lease) if lease.owner == owner && lease.expires > now => lease.generation,
                    Some(lease) if lease.expires > now => continue,
                    Some(lease) => lease.generation + 1,
                    None => 1,
                };
                let lease = Lease {
                    owner: owner.to_string(),
                    generation,
                    expires,
                    epoch: None,
                };
                tx.put(key.clone().into_bytes(), serde_json::to_vec(&lease)?)
                    .await?;
                held.insert(*partition, lease);
            }
            Ok::<_, TitoError>(held)
        }
    })
    .await
}

/// Inside an outcome transaction: whether `owner` still holds `partition` at `generation`. When
/// it does, the lease key is locked, so a takeover committed after this transaction started
/// makes the commit fail instead of applying the outcome.
pub(crate) async fn still_held<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: u32,
    owner: &str,
    generation: u64,
) -> TitoResult<bool> {
    let key = keys::lease_key(root, partition);
    let Some(bytes) = tx.get(key.as_bytes()).await? else {
        return Ok(false);
    };
    let Some(lease) = parse(&key, &bytes) else {
        return Ok(false);
    };
    if lease.owner != owner || lease.generation != generation {
        return Ok(false);
    }
    // Standalone leases expire by version; cluster leases live as long as their holder's node
    // record (which `holder_alive` locks too).
    if !super::cluster::holder_alive(tx, root, &lease).await? {
        return Ok(false);
    }
    tx.lock_keys(&[key.into_bytes()]).await?;
    Ok(true)
}

/// Gives up the leases `owner` holds among `partitions`, so another worker can take them now.
pub(crate) async fn release<E: TitoEngine>(
    db: &E,
    root: &str,
    partitions: &[u32],
    owner: &str,
) -> TitoResult<()> {
    let keys: Vec<String> = partitions
        .iter()
        .map(|p| keys::lease_key(root, *p))
        .collect();
    db.transaction(|tx| {
        let keys = keys.clone();
        async move {
            let raw: Vec<Vec<u8>> = keys.iter().map(|k| k.clone().into_bytes()).collect();
            let current = tx.batch_get(&raw).await?;
            for (key, value) in keys.iter().zip(current) {
                if value
                    .as_deref()
                    .and_then(|v| parse(key, v))
                    .is_some_and(|lease| lease.owner == owner)
                {
                    tx.delete(key.clone().into_bytes()).await?;
                }
            }
            Ok::<_, TitoError>(())
        }
    })
    .await
}
