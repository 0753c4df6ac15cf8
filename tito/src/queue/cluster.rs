//! Cluster mode: several worker processes share one queue's partitions without configured
//! ranges.
//!
//! - **Membership**: each node writes `{queue}:node:{id}` (its epoch, a fresh random number per
//!   process run, and an expiry in engine versions) every third of `node_ttl`. A node whose record
//!   expired is no longer a member; its record is deleted after `drop_after`. On the embedded
//!   engine the record also names the store open of the node's process: a record (or a
//!   coordinator role, or a lease) of an earlier open was left by a process the store's lock
//!   proves gone, so it counts as expired at once instead of after `node_ttl`.
//! - **Coordinator**: one node at a time holds `{queue}:coordinator` (a lease with a generation,
//!   expiring after `coordinator_ttl`). It publishes the member list (`{queue}:members`) and runs
//!   completed-row retention. When it stops renewing, another node takes the key on its next
//!   tick.
//! - **Assignment**: sticky and balanced ([`balanced_assignment`]), stored by the coordinator
//!   with the member list. Every member holds `floor(P/N)` or `ceil(P/N)` partitions; a
//!   partition stays with its owner while that owner is a member and within its quota. When
//!   membership changes, only the partitions of departed members and the excess of members over
//!   their new quota move (a join moves at most `ceil(P/(N+1))`), like Kafka's cooperative
//!   sticky assignor. Free partitions go to the member below quota with the highest rendezvous
//!   score, so a first assignment is deterministic for a membership.
//! - **Leases**: a partition lease names its holder and the holder's epoch, with a generation as
//!   fencing token, and no expiry of its own: it is valid while the holder's node record is
//!   alive with that epoch. Renewing every lease is therefore one write (the node record), and
//!   that write never conflicts with the holder's outcome transactions, which lock the lease
//!   (holder) key only: a takeover of a dead node's partition writes that key. A node takes an
//!   assigned partition when its lease is free, released, or held by a dead node (locking that
//!   node's record, so a heartbeat racing the takeover makes one of them fail); it stops
//!   pulling partitions assigned away, drains them (heartbeat still running), then releases
//!   them. A node that shuts down keeps heartbeating until its last outcome is applied.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use super::lease::NodeRecord;
use super::lease::{Lease, left_by_a_gone_process};
use super::store_open;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// Cluster-mode settings. Build with [`ClusterConfig::new`] and the setters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// This node's id; by default the `HOSTNAME` (a pod's name) or `node`, plus a boot id, so a
    /// restarted pod is a new member.
    pub node_id: Option<String>,
    /// How long a node stays a member without a heartbeat.
    pub node_ttl: Duration,
    /// How long after its expiry a dead node's record is deleted.
    pub drop_after: Duration,
    /// How long the coordinator lease lasts without renewal.
    pub coordinator_ttl: Duration,
}

impl ClusterConfig {
    /// The defaults: 10 s node and coordinator TTLs, records of dead nodes kept 60 s.
    pub fn new() -> Self {
        ClusterConfig {
            node_id: None,
            node_ttl: Duration::from_secs(10),
            drop_after: Duration::from_secs(60),
            coordinator_ttl: Duration::from_secs(10),
        }
    }

    /// A fixed node id.
    pub fn node_id(mut self, id: impl Into<String>) -> Self {
        self.node_id = Some(id.into());
        self
    }

    /// The node TTL.
    pub fn node_ttl(mut self, ttl: Duration) -> Self {
        self.node_ttl = ttl;
        self
    }

    /// How long dead node records are kept.
    pub fn drop_after(mut self, after: Duration) -> Self {
        self.drop_after = after;
        self
    }

    /// The coordinator lease TTL.
    pub fn coordinator_ttl(mut self, ttl: Duration) -> Self {
        self.coordinator_ttl = ttl;
        self
    }
}

impl ClusterConfig {
    /// Checks the settings: TTLs of at least [`MIN_TTL`] (a node renews every third of its TTL)
    /// and, like `drop_after`, at most [`MAX_SETTING`](super::MAX_SETTING); a node id of 1 to
    /// [`MAX_OWNER_BYTES`](super::MAX_OWNER_BYTES) bytes.
    pub fn check(&self) -> TitoResult<()> {
        for (name, ttl) in [
            ("node_ttl", self.node_ttl),
            ("coordinator_ttl", self.coordinator_ttl),
        ] {
            if ttl < MIN_TTL || ttl > super::MAX_SETTING {
                return Err(TitoError::invalid_argument(format!(
                    "ClusterConfig::{name} is {ttl:?}; it must be between {MIN_TTL:?} and {:?}",
                    super::MAX_SETTING
                )));
            }
        }
        if self.drop_after > super::MAX_SETTING {
            return Err(TitoError::invalid_argument(format!(
                "ClusterConfig::drop_after is {:?}, over {:?}",
                self.drop_after,
                super::MAX_SETTING
            )));
        }
        if let Some(id) = &self.node_id
            && (id.is_empty() || id.len() > super::MAX_OWNER_BYTES)
        {
            return Err(TitoError::invalid_argument(format!(
                "ClusterConfig::node_id must be 1 to {} bytes, not {}",
                super::MAX_OWNER_BYTES,
                id.len()
            )));
        }
        Ok(())
    }
}

/// The shortest node or coordinator TTL accepted.
pub const MIN_TTL: Duration = Duration::from_millis(30);

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig::new()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Coordinator {
    node: String,
    generation: u64,
    expires: u64,
    /// The store open of the holder's process (embedded engine; see [`NodeRecord::open`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    open: Option<u64>,
}

impl Coordinator {
    /// Whether the role is held at engine version `now`, seen from a process whose store open
    /// is `open`.
    fn held(&self, now: u64, open: Option<u64>) -> bool {
        self.expires > now && !left_by_a_gone_process(self.open, open)
    }
}

/// What the coordinator publishes: the members and, per partition, the index of its owner in
/// `members` (empty before the first balanced assignment).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Members {
    members: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    owners: Vec<u32>,
}

impl Members {
    /// The owner of every partition, when the stored assignment covers `partitions`; otherwise
    /// rendezvous hashing over the members (a list written before assignments were stored).
    fn assignment(&self, partitions: u32) -> Vec<Option<String>> {
        if self.owners.len() == partitions as usize {
            self.owners
                .iter()
                .map(|i| self.members.get(*i as usize).cloned())
                .collect()
        } else {
            (0..partitions)
                .map(|p| rendezvous_owner(&self.members, p).cloned())
                .collect()
        }
    }
}

/// What a cluster looks like, for tooling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterState {
    /// The node holding the coordinator lease, if it is valid.
    pub coordinator: Option<String>,
    /// The published member list.
    pub members: Vec<String>,
    /// Node records, alive or not.
    pub nodes: Vec<NodeRecord>,
    /// The partition -> member assignment the member list implies.
    pub assignment: BTreeMap<u32, String>,
    /// The partition -> holder leases as stored.
    pub leases: BTreeMap<u32, String>,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer: spreads FNV's output over all bits.
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The rendezvous score of a member for a partition.
pub fn rendezvous_score(member: &str, partition: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in member.as_bytes().iter().chain(&partition.to_be_bytes()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(hash)
}

/// The member a partition belongs to: the highest score, ties to the smaller id.
pub fn rendezvous_owner(members: &[String], partition: u32) -> Option<&String> {
    members.iter().max_by(|a, b| {
        rendezvous_score(a, partition)
            .cmp(&rendezvous_score(b, partition))
            .then_with(|| b.cmp(a))
    })
}

/// A balanced, sticky assignment of `0..partitions` to `members`, given each partition's
/// previous owner (`previous[p]`; missing entries count as none).
///
/// - Balance: every member gets `floor(P/N)` or `ceil(P/N)` partitions; the `P mod N` larger
///   quotas go to the members that already hold the most (ties to the smaller id).
/// - Stickiness: a partition keeps its previous owner while that owner is a member and within
///   its quota; a member over its quota gives up the partitions it scores lowest on.
/// - Free partitions (new, orphaned or given up) go, in order, to the member below its quota
///   with the highest [`rendezvous_score`].
///
/// So a join moves only the joiner's quota (at most `ceil(P/(N+1))`) and a leave only the
/// leaver's partitions. Returns one owner per partition (`None` only when `members` is empty).
pub fn balanced_assignment(
    members: &[String],
    partitions: u32,
    previous: &[Option<String>],
) -> Vec<Option<String>> {
    let mut members: Vec<&String> = members.iter().collect();
    members.sort();
    members.dedup();
    let n = members.len();
    if n == 0 {
        return vec![None; partitions as usize];
    }
    let index: HashMap<&str, usize> = members
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut kept: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut free: Vec<u32> = Vec::new();
    for p in 0..partitions {
        match previous
            .get(p as usize)
            .and_then(|o| o.as_deref())
            .and_then(|o| index.get(o))
        {
            Some(m) => kept[*m].push(p),
            None => free.push(p),
        }
    }
    let base = partitions as usize / n;
    let extra = partitions as usize % n;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| kept[*b].len().cmp(&kept[*a].len()).then(a.cmp(b)));
    let mut quota = vec![base; n];
    for m in order.into_iter().take(extra) {
        quota[m] += 1;
    }
    for (m, held) in kept.iter_mut().enumerate() {
        if held.len() > quota[m] {
            let member = members[m];
            held.sort_by_key(|p| std::cmp::Reverse((rendezvous_score(member, *p), *p)));
            free.extend(held.drain(quota[m]..));
        }
    }
    free.sort_unstable();
    for p in free {
        let best = (0..n)
            .filter(|m| kept[*m].len() < quota[*m])
            .max_by(|a, b| {
                rendezvous_score(members[*a], p)
                    .cmp(&rendezvous_score(members[*b], p))
                    .then_with(|| b.cmp(a))
            })
            .expect("quotas add up to the partition count");
        kept[best].push(p);
    }
    let mut owners = vec![None; partitions as usize];
    for (m, held) in kept.into_iter().enumerate() {
        for p in held {
            owners[p as usize] = Some(members[m].clone());
        }
    }
    owners
}

fn node_id_from_env() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".to_string());
    let boot = crate::event::new_event_id();
    format!("{host}-{}", &boot[boot.len() - 12..])
}

fn random_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write(crate::event::new_event_id().as_bytes());
    hasher.finish().max(1)
}

/// This process's membership in one queue's cluster.
pub(crate) struct Node {
    pub config: ClusterConfig,
    pub id: String,
    pub epoch: u64,
}

/// What one tick decided.
pub(crate) struct Tick {
    pub coordinator: bool,
    pub assigned: Vec<u32>,
}

fn ms(duration: Duration) -> u64 {
    crate::util::millis(duration)
}

impl Node {
    pub fn new(config: ClusterConfig) -> Self {
        let id = config.node_id.clone().unwrap_or_else(node_id_from_env);
        Node {
            config,
            id,
            epoch: random_epoch(),
        }
    }

    /// Heartbeat, coordinator election (and, as coordinator, the member list and assignment),
    /// then this node's assignment.
    pub async fn tick<E: TitoEngine>(
        &self,
        db: &E,
        root: &str,
        partitions: u32,
    ) -> TitoResult<Tick> {
        self.heartbeat(db, root).await?;
        let coordinator = self.elect(db, root).await?;
        if coordinator {
            self.publish_members(db, root, partitions).await?;
        }
        let members = read_members(db, root).await?;
        let assigned = members
            .assignment(partitions)
            .into_iter()
            .enumerate()
            .filter(|(_, owner)| owner.as_deref() == Some(self.id.as_str()))
            .map(|(p, _)| p as u32)
            .collect();
        Ok(Tick {
            coordinator,
            assigned,
        })
    }

    /// Writes this node's record with a fresh expiry: renews its membership and, with it, every
    /// partition lease it holds.
    pub async fn heartbeat<E: TitoEngine>(&self, db: &E, root: &str) -> TitoResult<()> {
        let (id, epoch, node_ttl) = (self.id.clone(), self.epoch, ms(self.config.node_ttl));
        let open = store_open(db);
        let root_owned = root.to_string();
        db.transaction(|tx| {
            let (id, root) = (id.clone(), root_owned.clone());
            async move {
                let record = NodeRecord {
                    id: id.clone(),
                    epoch,
                    expires: tx
                        .start_version()
                        .saturating_add(engine::version_from_millis(node_ttl)),
                    open,
                };
                tx.put(
                    keys::node_key(&root, &id).into_bytes(),
                    serde_json::to_vec(&record)?,
                )
                .await?;
                Ok::<_, TitoError>(())
            }
        })
        .await
    }

    async fn elect<E: TitoEngine>(&self, db: &E, root: &str) -> TitoResult<bool> {
        let (id, ttl) = (self.id.clone(), ms(self.config.coordinator_ttl));
        let key = keys::coordinator_key(root);
        let open = store_open(db);
        db.transaction(|tx| {
            let (id, key) = (id.clone(), key.clone());
            async move {
                let now = tx.start_version();
                let current: Option<Coordinator> = tx
                    .get(key.as_bytes())
                    .await?
                    .and_then(|b| serde_json::from_slice(&b).ok());
                // A role held under an earlier open of an embedded store was held by a process
                // that is gone (the store's lock proves it): taken at once.
                let generation = match &current {
                    Some(c) if c.node == id && c.held(now, open) => c.generation,
                    Some(c) if c.held(now, open) => return Ok(false),
                    Some(c) => c.generation + 1,
                    None => 1,
                };
                let lease = Coordinator {
                    node: id,
                    generation,
                    expires: now.saturating_add(engine::version_from_millis(ttl)),
                    open,
                };
                tx.put(key.into_bytes(), serde_json::to_vec(&lease)?)
                    .await?;
                Ok::<_, TitoError>(true)
            }
        })
        .await
    }

    /// Gives up the coordinator role if this node holds it, so another node takes it at its next
    /// tick instead of after the role's TTL.
    pub async fn resign<E: TitoEngine>(&self, db: &E, root: &str) -> TitoResult<()> {
        let (id, key) = (self.id.clone(), keys::coordinator_key(root));
        db.transaction(|tx| {
            let (id, key) = (id.clone(), key.clone());
            async move {
                let current: Option<Coordinator> = tx
                    .get(key.as_bytes())
                    .await?
                    .and_then(|b| serde_json::from_slice(&b).ok());
                if let Some(mut role) = current.filter(|c| c.node == id) {
                    // Expired, not deleted: the next coordinator's generation is one more.
                    role.expires = 0;
                    tx.put(key.into_bytes(), serde_json::to_vec(&role)?).await?;
                }
                Ok::<_, TitoError>(())
            }
        })
        .await
    }

    /// As coordinator: the live nodes become the member list, with a balanced assignment that
    /// keeps partitions where they are when it can; long-dead records are deleted.
    async fn publish_members<E: TitoEngine>(
        &self,
        db: &E,
        root: &str,
        partitions: u32,
    ) -> TitoResult<()> {
        let drop_after = ms(self.config.drop_after);
        let open = store_open(db);
        let root = root.to_string();
        db.transaction(|tx| {
            let root = root.clone();
            async move {
                let now = tx.start_version();
                let nodes = scan_nodes(&tx, &root).await?;
                let mut live: Vec<String> = Vec::new();
                for node in &nodes {
                    // A node of an earlier open of an embedded store is gone, whatever its
                    // expiry (see `NodeRecord::open`).
                    if node.alive(now, open) {
                        live.push(node.id.clone());
                    } else if node
                        .expires
                        .saturating_add(engine::version_from_millis(drop_after))
                        < now
                    {
                        tx.delete(keys::node_key(&root, &node.id).into_bytes())
                            .await?;
                    }
                }
                live.sort();
                let current = members_in(&tx, &root).await?;
                let owners =
                    balanced_assignment(&live, partitions, &current.assignment(partitions));
                let index: HashMap<&String, u32> = live
                    .iter()
                    .enumerate()
                    .map(|(i, m)| (m, i as u32))
                    .collect();
                let owners: Vec<u32> = if index.is_empty() {
                    Vec::new()
                } else {
                    owners
                        .iter()
                        .map(|o| o.as_ref().map_or(u32::MAX, |m| index[m]))
                        .collect()
                };
                let next = Members {
                    members: live,
                    owners,
                };
                if current != next {
                    tx.put(
                        keys::members_key(&root).into_bytes(),
                        serde_json::to_vec(&next)?,
                    )
                    .await?;
                }
                Ok::<_, TitoError>(())
            }
        })
        .await
    }

    /// Takes the leases among `wanted` that are free, released or held by a dead node; returns
    /// every lease among `wanted` this node holds afterwards. Leases already held are not
    /// rewritten.
    pub async fn acquire<E: TitoEngine>(
        &self,
        db: &E,
        root: &str,
        wanted: &[u32],
        fences: u32,
    ) -> TitoResult<HashMap<u32, Lease>> {
        let (id, epoch) = (self.id.clone(), self.epoch);
        let open = store_open(db);
        let root = root.to_string();
        let wanted = wanted.to_vec();
        db.transaction(|tx| {
            let (id, root, wanted) = (id.clone(), root.clone(), wanted.clone());
            async move {
                let now = tx.start_version();
                let lease_keys: Vec<Vec<u8>> = wanted
                    .iter()
                    .map(|p| keys::lease_key(&root, *p).into_bytes())
                    .collect();
                let current = tx.batch_get(&lease_keys).await?;
                let mut holders: HashMap<String, Option<NodeRecord>> = HashMap::new();
                let mut held = HashMap::new();
                for ((partition, key), value) in wanted.iter().zip(lease_keys).zip(current) {
                    let lease: Option<Lease> =
                        value.and_then(|v| super::lease::parse(&keys::display_key(&key), &v));
                    let generation = match &lease {
                        Some(l) if l.owner == id && l.epoch == Some(epoch) => {
                            held.insert(*partition, l.clone());
                            continue;
                        }
                        Some(l) if l.released() => l.generation + 1,
                        // A standalone worker's lease: taken once it expired, or at once when
                        // its holder's process is gone (an earlier open of an embedded store).
                        Some(l) if l.epoch.is_none() => {
                            if !left_by_a_gone_process(l.open, open)
                                && super::lease::expiry(&tx, &root, *partition, l).await? > now
                            {
                                continue;
                            }
                            l.generation + 1
                        }
                        Some(l) => {
                            if !holders.contains_key(&l.owner) {
                                let record = read_node(&tx, &root, &l.owner).await?;
                                holders.insert(l.owner.clone(), record);
                            }
                            let alive = holders[&l.owner]
                                .as_ref()
                                .is_some_and(|n| Some(n.epoch) == l.epoch && n.alive(now, open));
                            if alive {
                                continue;
                            }
                            // Taking over from a dead holder: lock its record, so a heartbeat
                            // it commits meanwhile (it was only slow) makes this commit fail
                            // instead of leaving two nodes that both think they hold it.
                            tx.lock_keys(&[keys::node_key(&root, &l.owner).into_bytes()])
                                .await?;
                            l.generation + 1
                        }
                        None => 1,
                    };
                    super::lease::fence_out(&tx, &root, *partition, lease.as_ref(), generation)
                        .await?;
                    let lease = Lease {
                        owner: id.clone(),
                        generation,
                        expires: u64::MAX,
                        epoch: Some(epoch),
                        open: None,
                        fences: Some(fences),
                    };
                    tx.put(key, serde_json::to_vec(&lease)?).await?;
                    held.insert(*partition, lease);
                }
                Ok::<_, TitoError>(held)
            }
        })
        .await
    }
}

async fn read_node<X: TitoTransaction>(
    tx: &X,
    root: &str,
    id: &str,
) -> TitoResult<Option<NodeRecord>> {
    Ok(tx
        .get(keys::node_key(root, id).as_bytes())
        .await?
        .and_then(|b| serde_json::from_slice(&b).ok()))
}

async fn scan_nodes<X: TitoTransaction>(tx: &X, root: &str) -> TitoResult<Vec<NodeRecord>> {
    let prefix = keys::node_prefix(root);
    let end = keys::prefix_end(prefix.clone()).into_bytes();
    let mut start = prefix.into_bytes();
    let mut nodes = Vec::new();
    loop {
        let rows = tx.scan(&start, &end, 1000).await?;
        let full = rows.len() == 1000;
        for (key, value) in &rows {
            match serde_json::from_slice::<NodeRecord>(value) {
                Ok(node) => nodes.push(node),
                Err(err) => {
                    tracing::warn!(key = %keys::display_key(key), error = %err, "malformed node record ignored")
                }
            }
        }
        match rows.last() {
            Some((key, _)) if full => start = keys::key_after_bytes(key),
            _ => return Ok(nodes),
        }
    }
}

/// The published member list, read in `tx` (empty before the first coordinator publishes).
async fn members_in<X: TitoTransaction>(tx: &X, root: &str) -> TitoResult<Members> {
    Ok(tx
        .get(keys::members_key(root).as_bytes())
        .await?
        .and_then(|b| serde_json::from_slice::<Members>(&b).ok())
        .unwrap_or_default())
}

async fn read_members<E: TitoEngine>(db: &E, root: &str) -> TitoResult<Members> {
    let tx = db.begin().await?;
    let members = members_in(&tx, root).await;
    let _ = tx.rollback().await;
    members
}

/// The cluster as stored: coordinator, members, node records, assignment and leases.
pub async fn cluster_state<E: TitoEngine>(queue: &super::Queue<E>) -> TitoResult<ClusterState> {
    let root = queue.root();
    let partitions = queue.config().partitions;
    let open = store_open(queue.engine());
    let tx = queue.engine().begin().await?;
    let now = tx.start_version();
    let coordinator = tx
        .get(keys::coordinator_key(root).as_bytes())
        .await?
        .and_then(|b| serde_json::from_slice::<Coordinator>(&b).ok())
        .filter(|c| c.held(now, open))
        .map(|c| c.node);
    let published = members_in(&tx, root).await?;
    let nodes = scan_nodes(&tx, root).await?;
    let mut leases = BTreeMap::new();
    for chunk in (0..partitions).collect::<Vec<_>>().chunks(1000) {
        let keys: Vec<Vec<u8>> = chunk
            .iter()
            .map(|p| keys::lease_key(root, *p).into_bytes())
            .collect();
        for (p, value) in chunk.iter().zip(tx.batch_get(&keys).await?) {
            if let Some(lease) = value.and_then(|v| serde_json::from_slice::<Lease>(&v).ok())
                && !lease.released()
            {
                leases.insert(*p, lease.owner);
            }
        }
    }
    let _ = tx.rollback().await;
    let assignment = published
        .assignment(partitions)
        .into_iter()
        .enumerate()
        .filter_map(|(p, owner)| owner.map(|m| (p as u32, m)))
        .collect();
    Ok(ClusterState {
        coordinator,
        members: published.members,
        nodes,
        assignment,
        leases,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    #[test]
    fn rendezvous_is_deterministic_balanced_and_moves_little() {
        let partitions = 1024;
        let four = names(4);
        let owners: Vec<&String> = (0..partitions)
            .map(|p| rendezvous_owner(&four, p).unwrap())
            .collect();
        // Deterministic, and independent of the list's order.
        let mut shuffled = four.clone();
        shuffled.reverse();
        for p in 0..partitions {
            assert_eq!(rendezvous_owner(&shuffled, p), Some(owners[p as usize]));
        }
        // Balanced within 25 % of the mean.
        for node in &four {
            let count = owners.iter().filter(|o| **o == node).count();
            assert!((192..=320).contains(&count), "{node}: {count}");
        }
        // A fifth node takes partitions only from the others, about a fifth of them.
        let five = names(5);
        let moved = (0..partitions)
            .filter(|p| rendezvous_owner(&five, *p) != Some(owners[*p as usize]))
            .count();
        assert!(moved <= 1024 / 5 + 60, "moved {moved}");
        for p in 0..partitions {
            let now = rendezvous_owner(&five, p).unwrap();
            assert!(now == owners[p as usize] || now == "node-4");
        }
        assert_eq!(rendezvous_owner(&[], 3), None);
    }

    fn counts(owners: &[Option<String>], members: &[String]) -> Vec<usize> {
        members
            .iter()
            .map(|m| owners.iter().filter(|o| o.as_ref() == Some(m)).count())
            .collect()
    }

    fn moves(before: &[Option<String>], after: &[Option<String>]) -> usize {
        before.iter().zip(after).filter(|(a, b)| a != b).count()
    }

    /// Defect 5: floor(P/N) or ceil(P/N) per member, and a join or leave moves only what
    /// balance requires.
    #[test]
    fn defect_5_assignment_is_balanced_and_sticky() {
        for partitions in [1u32, 2, 3, 4, 7, 16, 100, 1024] {
            let mut owners: Vec<Option<String>> = Vec::new();
            for n in 1..=16usize {
                let members = names(n);
                let next = balanced_assignment(&members, partitions, &owners);
                assert!(next.iter().all(Option::is_some));
                let (lo, hi) = (partitions as usize / n, (partitions as usize).div_ceil(n));
                for count in counts(&next, &members) {
                    assert!(
                        count == lo || count == hi,
                        "P={partitions} N={n}: {count} not in {lo}..={hi}"
                    );
                }
                if n > 1 {
                    // A join moves at most ceil(P/N) partitions, all of them to the joiner.
                    let moved = moves(&owners, &next);
                    assert!(
                        moved <= (partitions as usize).div_ceil(n),
                        "P={partitions} N={n}: {moved}"
                    );
                    for (before, after) in owners.iter().zip(&next) {
                        assert!(
                            before == after || after.as_deref() == Some(members[n - 1].as_str())
                        );
                    }
                }
                // Same inputs, same answer; and a stable membership keeps it.
                assert_eq!(balanced_assignment(&members, partitions, &next), next);
                owners = next;
            }
            // Leaves: only the leaver's partitions move.
            for n in (1..16usize).rev() {
                let members = names(n);
                let next = balanced_assignment(&members, partitions, &owners);
                let leaver = format!("node-{n}");
                for (before, after) in owners.iter().zip(&next) {
                    assert!(before == after || before.as_deref() == Some(leaver.as_str()));
                }
                for count in counts(&next, &members) {
                    assert!(
                        count == partitions as usize / n
                            || count == (partitions as usize).div_ceil(n)
                    );
                }
                owners = next;
            }
        }
        // Four partitions on two nodes: two each (rendezvous alone gave 1 and 3).
        let two = names(2);
        assert_eq!(counts(&balanced_assignment(&two, 4, &[]), &two), vec![2, 2]);
        assert!(balanced_assignment(&[], 4, &[]).iter().all(Option::is_none));
    }

    proptest::proptest! {
        /// Defect 10: member lists and node records never panic their decoders.
        #[test]
        fn cluster_records_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = serde_json::from_slice::<Members>(&bytes).map(|m| m.assignment(8));
            let _ = serde_json::from_slice::<NodeRecord>(&bytes);
            let _ = serde_json::from_slice::<Coordinator>(&bytes);
        }

        #[test]
        fn forged_owner_indexes_are_harmless(owners in proptest::collection::vec(proptest::num::u32::ANY, 0..8)) {
            let members = Members { members: names(3), owners };
            let _ = members.assignment(8);
        }
    }
}
