//! Partition leases as stored: which worker may run a partition, with a generation (fencing
//! token), and for standalone leases an expiry measured in engine versions, never in a node's
//! clock.
//!
//! # Three kinds of key per lease, so that neither renewals nor a holder's own concurrent
//! # transactions conflict with each other
//!
//! - `{queue}:lease:{p}` holds the **holder record** (owner, generation, the number of fence
//!   slots the holder uses, and for cluster leases the holder's epoch). It is written only when
//!   the lease changes hands: taken (the generation goes up by one) or released (the owner is
//!   cleared, the generation kept, so generations only ever grow).
//! - `{queue}:lease-expiry:{p}` holds a standalone lease's expiry. Renewals write only this key.
//!   (Cluster leases have none: they live as long as their holder's node record.)
//! - `{queue}:lease-fence:{p}:{slot}`, slots `0..fences`: each transaction of the holder that
//!   applies outcomes on `p` (a transactional handler's, an outcome batch's) holds a slot that
//!   no other transaction of the holder holds at the same time (a [`FencePool`]).
//!
//! An outcome transaction checks the holder record (owner and generation) and the expiry at its
//! start version, then locks its fence slot. A takeover and a release write the holder key and
//! every fence slot of the holder they replace, so a takeover committed after the outcome
//! transaction started makes the outcome's commit fail (the fence), while two outcome
//! transactions of one holder lock different slots and never conflict with each other: the
//! partition's commits do not funnel through one key. A renewal writes only the expiry key, so
//! the holder's own renewals never conflict with its outcomes, however long a transactional
//! handler runs. A renewal and a takeover both write the expiry key, so they cannot both commit.
//!
//! A holder record without `fences` (written by a version before fence slots), a transaction
//! with no free slot (more at once than the holder declared), and a check without a slot lock
//! the holder key instead: the fence holds, at the cost of conflicts among those transactions.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// A lease's holder record as stored under `{queue}:lease:{partition}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The holder; empty once released.
    pub owner: String,
    /// The fencing token: one more at each change of hands.
    pub generation: u64,
    /// The expiry when the lease was taken (the expiry key has the current one).
    #[serde(default)]
    pub expires: u64,
    /// Cluster leases: the holder's process epoch; the lease is valid while the holder's node
    /// record is alive with this epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Standalone leases on an engine that proves one process per store (embedded): the
    /// store open of the holder's process. A lease of another open was left by a process
    /// that is gone and is taken at once, without waiting for its expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<u64>,
    /// How many fence slots (`0..fences`) the holder's transactions lock instead of the holder
    /// key; a takeover or release writes them all. Absent in records of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fences: Option<u32>,
}

/// The most fence slots a lease has.
pub(crate) const MAX_FENCES: u32 = 256;

/// The fence slots of a worker running `concurrency` handlers: one per handler transaction and
/// one for the worker's outcome batch (one at a time), at most [`MAX_FENCES`].
pub(crate) fn fence_count(concurrency: usize) -> u32 {
    u32::try_from(concurrency.saturating_add(1))
        .unwrap_or(MAX_FENCES)
        .clamp(2, MAX_FENCES)
}

/// Writes every fence slot of `previous` (the holder record being replaced or released) inside
/// `tx`, so each transaction of that holder still open fails to commit. Each slot takes the
/// generation that replaced it.
pub(crate) async fn fence_out<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: u32,
    previous: Option<&Lease>,
    generation: u64,
) -> TitoResult<()> {
    let Some(fences) = previous.and_then(|lease| lease.fences) else {
        return Ok(());
    };
    for slot in 0..fences.min(MAX_FENCES) {
        tx.put(
            keys::lease_fence_key(root, partition, slot).into_bytes(),
            generation.to_string().into_bytes(),
        )
        .await?;
    }
    Ok(())
}

/// Hands out fence slots of one worker's leases: per partition, the lowest slot no transaction
/// of the worker holds. A slot goes back when its [`Fence`] is dropped.
#[derive(Debug)]
pub(crate) struct FencePool {
    fences: u32,
    used: std::sync::Mutex<HashMap<u32, std::collections::BTreeSet<u32>>>,
}

impl FencePool {
    /// A pool of `fences` slots per partition (what the worker writes into its holder records).
    pub fn new(fences: u32) -> std::sync::Arc<Self> {
        std::sync::Arc::new(FencePool {
            fences,
            used: Default::default(),
        })
    }

    /// A free slot of `partition`, held until the returned value is dropped; `None` inside it
    /// when every slot is taken (the transaction then locks the holder key).
    pub fn take(self: &std::sync::Arc<Self>, partition: u32) -> Fence {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let taken = used.entry(partition).or_default();
        let slot = (0..self.fences).find(|slot| !taken.contains(slot));
        if let Some(slot) = slot {
            taken.insert(slot);
        }
        Fence {
            pool: self.clone(),
            partition,
            slot,
        }
    }
}

/// A fence slot held by one transaction (see [`FencePool`]).
#[derive(Debug)]
pub(crate) struct Fence {
    pool: std::sync::Arc<FencePool>,
    partition: u32,
    slot: Option<u32>,
}

impl Fence {
    /// The slot, or `None` when none was free.
    pub fn slot(&self) -> Option<u32> {
        self.slot
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        let Some(slot) = self.slot else { return };
        let mut used = self.pool.used.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(taken) = used.get_mut(&self.partition) {
            taken.remove(&slot);
            if taken.is_empty() {
                used.remove(&self.partition);
            }
        }
    }
}

impl Lease {
    /// Whether the lease was released (anyone may take it).
    pub fn released(&self) -> bool {
        self.owner.is_empty()
    }
}

/// Parses a holder record; a malformed one is logged and treated as absent (free).
pub(crate) fn parse(key: &str, bytes: &[u8]) -> Option<Lease> {
    match serde_json::from_slice(bytes) {
        Ok(lease) => Some(lease),
        Err(err) => {
            tracing::warn!(key, error = %err, "malformed partition lease; treating it as free");
            None
        }
    }
}

/// A partition's lease as operators see it, decoded as workers decode it: the holder record
/// and the expiry to show (the expiry key's version, else the one recorded when the lease was
/// taken). `None` when the lease is free, released or malformed (workers treat it as free).
pub(crate) fn holder_of(record: Option<&[u8]>, expiry: Option<&[u8]>) -> Option<(Lease, u64)> {
    let lease: Lease = serde_json::from_slice(record?).ok()?;
    if lease.released() {
        return None;
    }
    let expires = expiry
        .and_then(|bytes| std::str::from_utf8(bytes).ok()?.parse().ok())
        .unwrap_or(lease.expires);
    Some((lease, expires))
}

/// Parses an expiry record (a decimal version); a malformed one reads as expired.
fn parse_expiry(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

/// Standalone leases: renews the leases `owner` holds among `partitions` and, when `take` is
/// set, takes every free, released or expired one, in one transaction. Returns the leases
/// `owner` holds afterwards. Renewing writes only expiry keys.
pub async fn acquire<E: TitoEngine>(
    db: &E,
    root: &str,
    partitions: &[u32],
    owner: &str,
    duration_ms: u64,
    take: bool,
    fences: u32,
) -> TitoResult<HashMap<u32, Lease>> {
    let holder_keys: Vec<Vec<u8>> = partitions
        .iter()
        .map(|p| keys::lease_key(root, *p).into_bytes())
        .collect();
    let expiry_keys: Vec<Vec<u8>> = partitions
        .iter()
        .map(|p| keys::lease_expiry_key(root, *p).into_bytes())
        .collect();
    let owner = owner.to_string();
    let open = db.extensions().get::<engine::ExclusiveOpen>().get();
    db.transaction(|tx| {
        let (holder_keys, expiry_keys, owner) =
            (holder_keys.clone(), expiry_keys.clone(), owner.clone());
        async move {
            let now = tx.start_version();
            let expires = now.saturating_add(engine::version_from_millis(duration_ms));
            let mut wanted = holder_keys.clone();
            wanted.extend(expiry_keys.iter().cloned());
            let mut current = tx.batch_get(&wanted).await?;
            let expiries = current.split_off(partitions.len());
            // The worker's heartbeat: the concurrency slots it holds stay held while it lives,
            // whatever happens to its leases (see `queue::limits`).
            tx.put(
                keys::worker_heartbeat_key(root, &owner).into_bytes(),
                expires.to_string().into_bytes(),
            )
            .await?;
            let mut held = HashMap::new();
            for (i, partition) in partitions.iter().enumerate() {
                let key = keys::display_key(&holder_keys[i]);
                let lease = current[i].as_deref().and_then(|v| parse(&key, v));
                let expiry = match (&expiries[i], &lease) {
                    (Some(bytes), _) => parse_expiry(bytes),
                    (None, Some(lease)) => lease.expires,
                    (None, None) => 0,
                };
                let generation = match &lease {
                    // A cluster lease is not a standalone worker's to take.
                    Some(lease) if lease.epoch.is_some() && !lease.released() => continue,
                    // Still ours: nobody took it since (taking writes the holder record), even
                    // if it expired meanwhile. Renew the expiry only.
                    Some(lease) if lease.owner == owner => {
                        tx.put(expiry_keys[i].clone(), expires.to_string().into_bytes())
                            .await?;
                        held.insert(*partition, lease.clone());
                        continue;
                    }
                    // Held by a worker of an earlier open of this store: that process is gone
                    // (the store's lock proves it), so its lease is taken at once.
                    Some(lease) if take && open.is_some() && lease.open != open => {
                        lease.generation + 1
                    }
                    Some(lease) if !lease.released() && expiry > now => continue,
                    _ if !take => continue,
                    Some(lease) => lease.generation + 1,
                    None => 1,
                };
                fence_out(&tx, root, *partition, lease.as_ref(), generation).await?;
                let lease = Lease {
                    owner: owner.clone(),
                    generation,
                    expires,
                    epoch: None,
                    open,
                    fences: Some(fences),
                };
                tx.put(holder_keys[i].clone(), serde_json::to_vec(&lease)?)
                    .await?;
                tx.put(expiry_keys[i].clone(), expires.to_string().into_bytes())
                    .await?;
                held.insert(*partition, lease);
            }
            Ok::<_, TitoError>(held)
        }
    })
    .await
}

/// The lease check of an outcome transaction: whether `owner` still holds a partition at a
/// generation. When it does, the transaction's fence slot (or the holder key) is locked, so a
/// takeover committed after this transaction started makes the commit fail instead of applying
/// the outcome (renewals do not touch either). Split in two so its reads join the transaction's one batched read:
/// [`HeldCheck::keys`] (the holder record, then the expiry key, or for a cluster node its node
/// record) and [`HeldCheck::decide`] on their values.
pub(crate) struct HeldCheck<'a> {
    root: &'a str,
    owner: &'a str,
    partition: u32,
    /// The holder key, then the expiry key (standalone) or the owner's node record (cluster).
    keys: [Vec<u8>; HeldCheck::KEYS],
    cluster: bool,
    /// The fence slot the transaction holds (see [`FencePool`]); `None`: the holder key.
    fence: Option<u32>,
}

impl<'a> HeldCheck<'a> {
    /// How many keys [`Self::keys`] holds.
    pub const KEYS: usize = 2;

    /// The check of `owner`'s lease on `partition`; `cluster` when `owner` is a cluster node.
    pub fn new(root: &'a str, partition: u32, owner: &'a str, cluster: bool) -> Self {
        let second = match cluster {
            true => keys::node_key(root, owner),
            false => keys::lease_expiry_key(root, partition),
        };
        HeldCheck {
            root,
            owner,
            partition,
            keys: [
                keys::lease_key(root, partition).into_bytes(),
                second.into_bytes(),
            ],
            cluster,
            fence: None,
        }
    }

    /// The check of a transaction that holds fence slot `fence` of the partition (`None`: no
    /// slot was free): it locks that slot instead of the holder key when the holder record has
    /// it.
    pub fn fenced(mut self, fence: Option<u32>) -> Self {
        self.fence = fence;
        self
    }

    /// The keys to read, in the order [`Self::decide`] takes their values.
    pub fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }

    /// Whether the lease is still held at `generation`, from the values of [`Self::keys`]; locks
    /// the holder key when it is. A lease of the other kind than the check expected (never
    /// written by this owner) has what it needs read separately.
    pub async fn decide<X: TitoTransaction>(
        &self,
        tx: &X,
        generation: u64,
        values: &[Option<Vec<u8>>],
    ) -> TitoResult<bool> {
        let holder = &self.keys[0];
        let Some(bytes) = values.first().and_then(|v| v.as_deref()) else {
            return Ok(false);
        };
        let Some(lease) = parse(&keys::display_key(holder), bytes) else {
            return Ok(false);
        };
        if lease.released() || lease.owner != self.owner || lease.generation != generation {
            return Ok(false);
        }
        let second = values.get(1).and_then(|v| v.as_deref());
        let alive = match (lease.epoch, self.cluster) {
            // Cluster leases live as long as their holder's node record.
            (Some(_), true) => node_alive(second, &lease, tx),
            (Some(_), false) => holder_alive(tx, self.root, &lease).await?,
            (None, false) => second.map_or(lease.expires, parse_expiry) > tx.start_version(),
            (None, true) => {
                expiry(tx, self.root, self.partition, &lease).await? > tx.start_version()
            }
        };
        if !alive {
            return Ok(false);
        }
        match (self.fence, lease.fences) {
            (Some(slot), Some(fences)) if slot < fences.min(MAX_FENCES) => {
                let fence = keys::lease_fence_key(self.root, self.partition, slot);
                tx.lock_keys(&[fence.into_bytes()]).await?;
            }
            _ => tx.lock_keys(std::slice::from_ref(holder)).await?,
        }
        Ok(true)
    }
}

/// A standalone lease's current expiry: its expiry key, or the holder record's for a lease
/// written before expiry keys existed.
pub(crate) async fn expiry<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: u32,
    lease: &Lease,
) -> TitoResult<u64> {
    Ok(tx
        .get(keys::lease_expiry_key(root, partition).as_bytes())
        .await?
        .map_or(lease.expires, |bytes| parse_expiry(&bytes)))
}

/// Gives up the leases `owner` holds among `partitions`, so another worker can take them now.
/// The holder record keeps its generation (the next holder's is one more).
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
    let expiry_keys: Vec<Vec<u8>> = partitions
        .iter()
        .map(|p| keys::lease_expiry_key(root, *p).into_bytes())
        .collect();
    db.transaction(|tx| {
        let (keys, expiry_keys) = (keys.clone(), expiry_keys.clone());
        async move {
            let raw: Vec<Vec<u8>> = keys.iter().map(|k| k.clone().into_bytes()).collect();
            let current = tx.batch_get(&raw).await?;
            let each = partitions
                .iter()
                .zip(keys.iter().zip(expiry_keys))
                .zip(current);
            for ((partition, (key, expiry_key)), value) in each {
                let Some(mut lease) = value.as_deref().and_then(|v| parse(key, v)) else {
                    continue;
                };
                if lease.owner != owner {
                    continue;
                }
                // Its slots are written here: the next holder has none to write.
                fence_out(&tx, root, *partition, Some(&lease), lease.generation).await?;
                lease.owner.clear();
                lease.epoch = None;
                lease.expires = 0;
                lease.fences = None;
                tx.put(key.clone().into_bytes(), serde_json::to_vec(&lease)?)
                    .await?;
                tx.delete(expiry_key).await?;
            }
            Ok::<_, TitoError>(())
        }
    })
    .await
}

// Lease liveness: whether a lease's holder is alive (a node record, in cluster mode).

/// A node record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's id.
    pub id: String,
    /// The process run's epoch.
    pub epoch: u64,
    /// The engine version after which the node is no longer a member.
    pub expires: u64,
    /// On an engine that proves one process per store (embedded): the store open of the node's
    /// process. A record of another open was left by a process that is gone: the node is no
    /// longer a member, whatever its expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<u64>,
}

impl NodeRecord {
    /// Whether the node is a member at engine version `now`, seen from a process whose store
    /// open is `open` ([`crate::queue::store_open`]).
    pub(crate) fn alive(&self, now: u64, open: Option<u64>) -> bool {
        self.expires > now && !left_by_a_gone_process(self.open, open)
    }
}

/// Whether a record that names the store open `written` was left by a process that is gone,
/// seen from a process whose store open is `ours`: on an engine that proves one process per
/// store (`ours` is set), every record of another open.
pub(crate) fn left_by_a_gone_process(written: Option<u64>, ours: Option<u64>) -> bool {
    ours.is_some() && written != ours
}

/// Inside an outcome transaction: whether a cluster lease's holder is alive with its epoch at
/// the transaction's start. The node record is not locked (heartbeats rewrite it); a takeover
/// after the holder's expiry writes the lease key, which the caller locks.
pub(crate) async fn holder_alive<X: TitoTransaction>(
    tx: &X,
    root: &str,
    lease: &Lease,
) -> TitoResult<bool> {
    if lease.epoch.is_none() {
        return Ok(lease.expires > tx.start_version());
    }
    let node = tx
        .get(keys::node_key(root, &lease.owner).as_bytes())
        .await?;
    Ok(node_alive(node.as_deref(), lease, tx))
}

/// Whether a cluster lease's holder is alive by its node record's value (`None`: no record),
/// with its epoch, at `tx`'s start version.
pub(crate) fn node_alive<X: TitoTransaction>(node: Option<&[u8]>, lease: &Lease, tx: &X) -> bool {
    let Some(node) = node.and_then(|b| serde_json::from_slice::<NodeRecord>(b).ok()) else {
        return false;
    };
    lease.epoch == Some(node.epoch) && node.expires > tx.start_version()
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Defect 10: lease decoders never panic on arbitrary bytes.
        #[test]
        fn lease_records_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = parse("k", &bytes);
            let _ = parse_expiry(&bytes);
        }
    }

    #[test]
    fn a_released_lease_keeps_its_generation() {
        let lease = Lease {
            owner: String::new(),
            generation: 7,
            expires: 0,
            epoch: None,
            open: None,
            fences: None,
        };
        assert!(lease.released());
        let bytes = serde_json::to_vec(&lease).unwrap();
        assert_eq!(parse("k", &bytes), Some(lease));
        assert_eq!(parse_expiry(b"123"), 123);
        assert_eq!(parse_expiry(b"x"), 0);
    }
}
