//! The lease lifecycle of one worker, standalone or in a cluster: take, renew, drain, release.
//! Its one owner, [`LeaseKeeper`], is shared by both kinds of worker.
//!
//! # The drain rule
//!
//! A partition this worker stops running (assigned away in a cluster, or every partition once
//! shutdown is signalled) is *draining*: no handler starts on it, but its lease keeps being
//! renewed (standalone: its expiry key; cluster: the node heartbeat) until no handler of it
//! runs and no outcome of it waits to commit. Only then is it released. So a slow handler never
//! sees its partition taken while it runs and its holder is alive, and its outcome is applied
//! under the lease it was started under.
//!
//! # Freshness
//!
//! A worker starts handlers only while its leases are *fresh*: less than two thirds of a lease
//! (standalone) or of the node TTL (cluster) since the start of its last successful renewal.
//! A worker that was paused, or could not reach the store, for longer than that starts nothing
//! until it has renewed again, because by then another worker may have taken its partitions.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::engine::TitoEngine;
use crate::error::TitoError;
use crate::keys;
use crate::queue::Queue;
use crate::queue::cluster::Node;
use crate::queue::lease::{self, Lease};
use crate::telemetry::names;

/// Whether this worker runs retention, and a wake-up for when it starts to.
#[derive(Default)]
pub(super) struct Maintenance {
    on: AtomicBool,
    started: Notify,
}

impl Maintenance {
    pub fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Resolves when maintenance is switched on (at once if a switch-on was missed).
    pub async fn started(&self) {
        self.started.notified().await;
    }

    fn set(&self, on: bool) {
        // Becoming the maintainer (a newly elected coordinator) runs a pass at once.
        if on && !self.on.swap(true, Ordering::Relaxed) {
            self.started.notify_one();
        } else if !on {
            self.on.store(false, Ordering::Relaxed);
        }
    }
}

enum Mode {
    Standalone {
        partitions: Vec<u32>,
        duration: Duration,
    },
    Cluster(Node),
}

/// The leases one worker holds and their lifecycle.
pub(super) struct LeaseKeeper<E> {
    queue: Arc<Queue<E>>,
    id: String,
    mode: Mode,
    held: HashMap<u32, Lease>,
    /// Held partitions no handler may start on; released once none of theirs runs.
    draining: HashSet<u32>,
    next_at: Instant,
    /// New handlers may start until then (see the module docs on freshness).
    fresh_until: Instant,
    maintenance: Arc<Maintenance>,
    /// The fence slots written into the holder records this worker takes.
    fences: u32,
}

/// How long to wait before the next tick while partitions drain, so handed-off partitions move
/// quickly.
const DRAIN_POLL: Duration = Duration::from_millis(50);

impl<E: TitoEngine> LeaseKeeper<E> {
    /// A standalone worker's leases over `partitions`, each lasting `duration` unrenewed.
    pub fn standalone(
        queue: Arc<Queue<E>>,
        id: String,
        partitions: Vec<u32>,
        duration: Duration,
        fences: u32,
    ) -> Self {
        // A standalone worker always maintains; the loop starts with a pass.
        let maintenance = Arc::new(Maintenance {
            on: AtomicBool::new(true),
            started: Notify::new(),
        });
        Self::new(
            queue,
            id,
            Mode::Standalone {
                partitions,
                duration,
            },
            maintenance,
            fences,
        )
    }

    /// A cluster node's leases: the partitions the membership assigns to it.
    pub fn cluster(queue: Arc<Queue<E>>, node: Node, fences: u32) -> Self {
        let id = node.id.clone();
        Self::new(queue, id, Mode::Cluster(node), Arc::default(), fences)
    }

    fn new(
        queue: Arc<Queue<E>>,
        id: String,
        mode: Mode,
        maintenance: Arc<Maintenance>,
        fences: u32,
    ) -> Self {
        LeaseKeeper {
            fences,
            queue,
            id,
            mode,
            held: HashMap::new(),
            draining: HashSet::new(),
            next_at: Instant::now(),
            fresh_until: Instant::now(),
            maintenance,
        }
    }

    /// The worker's identity in leases.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The worker as its concurrency slots name it.
    pub fn holder(&self) -> crate::queue::Holder {
        crate::queue::Holder {
            id: self.id.clone(),
            epoch: match &self.mode {
                Mode::Cluster(node) => Some(node.epoch),
                Mode::Standalone { .. } => None,
            },
            open: crate::queue::store_open(self.queue.engine()),
        }
    }

    /// Whether the worker is a cluster node (its leases live as long as its node record).
    pub fn is_cluster(&self) -> bool {
        matches!(self.mode, Mode::Cluster(_))
    }

    /// When the next tick is due.
    pub fn next_at(&self) -> Instant {
        self.next_at
    }

    pub fn maintenance(&self) -> Arc<Maintenance> {
        self.maintenance.clone()
    }

    /// Until when new handlers may start.
    pub fn fresh_until(&self) -> Instant {
        self.fresh_until
    }

    /// After the store refused an outcome because a lease of this worker is no longer held:
    /// nothing starts until the leases are renewed, at the next tick, which is due at once.
    pub fn renew_now(&mut self) {
        let now = Instant::now();
        self.fresh_until = now;
        self.next_at = now;
    }

    /// The partitions handlers may start on, with their lease generations.
    pub fn runnable(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.held
            .iter()
            .filter(|(p, _)| !self.draining.contains(p))
            .map(|(p, lease)| (*p, lease.generation))
    }

    /// When due: renews what is held and (unless `stopping`) takes what this worker should run;
    /// then releases draining partitions that no handler of `busy` uses.
    pub async fn tick(&mut self, busy: &HashSet<u32>, stopping: bool) {
        if Instant::now() < self.next_at {
            return;
        }
        if stopping {
            self.draining.extend(self.held.keys().copied());
        }
        let period = match &self.mode {
            Mode::Standalone { duration, .. } => *duration,
            Mode::Cluster(node) => node.config.node_ttl,
        };
        let interval = period / 3;
        let began = Instant::now();
        let next = match self.renew(stopping).await {
            Ok(()) => {
                self.fresh_until = began + period * 2 / 3;
                interval
            }
            Err(err) => {
                tracing::warn!(error = %err, worker = %self.id, "partition lease renewal failed");
                interval / 3
            }
        };
        let done: Vec<u32> = self
            .draining
            .iter()
            .copied()
            .filter(|p| !busy.contains(p))
            .collect();
        if !done.is_empty() {
            match lease::release(self.queue.engine(), self.queue.root(), &done, &self.id).await {
                Ok(()) => {
                    for partition in &done {
                        self.draining.remove(partition);
                        self.held.remove(partition);
                    }
                }
                Err(err) => tracing::warn!(error = %err, "releasing drained partitions failed"),
            }
        }
        let next = if self.draining.is_empty() {
            next
        } else {
            next.min(DRAIN_POLL)
        };
        self.next_at = Instant::now() + next;
        self.report_held();
    }

    /// Sets the `tito_queue_leases_held` gauge of this worker.
    fn report_held(&self) {
        metrics::gauge!(
            names::QUEUE_LEASES_HELD,
            "queue" => self.queue.label().to_string(),
            "worker" => self.id.clone()
        )
        .set(self.held.len() as f64);
    }

    async fn renew(&mut self, stopping: bool) -> Result<(), TitoError> {
        let queue = self.queue.clone();
        if !stopping {
            let tx = queue.engine().begin().await?;
            match queue.ensure_meta(&tx).await {
                Ok(()) => crate::engine::TitoTransaction::commit(&tx).await?,
                Err(err) => {
                    let _ = crate::engine::TitoTransaction::rollback(&tx).await;
                    return Err(err);
                }
            }
        }
        let (db, root) = (queue.engine(), queue.root());
        match &self.mode {
            Mode::Standalone {
                partitions,
                duration,
            } => {
                let duration_ms = crate::util::millis(*duration);
                let wanted: Vec<u32> = if stopping {
                    self.held.keys().copied().collect()
                } else {
                    partitions.clone()
                };
                let held = lease::acquire(
                    db,
                    root,
                    &wanted,
                    &self.id,
                    duration_ms,
                    !stopping,
                    self.fences,
                )
                .await?;
                self.count_lost(&held, |_| true);
                self.draining.retain(|p| held.contains_key(p));
                self.held = held;
            }
            Mode::Cluster(node) if stopping => {
                // Cluster leases live as long as the node record: the heartbeat renews them all.
                node.heartbeat(db, root).await?;
            }
            Mode::Cluster(node) => {
                let tick = node.tick(db, root, queue.config().partitions).await?;
                let acquired = node.acquire(db, root, &tick.assigned, self.fences).await?;
                self.maintenance.set(tick.coordinator);
                let assigned: HashSet<u32> = tick.assigned.iter().copied().collect();
                self.count_lost(&acquired, |p| assigned.contains(p));
                let mut held = acquired;
                for (partition, lease) in &self.held {
                    if !assigned.contains(partition) {
                        // Assigned away: keep it (the heartbeat renews it) until it drains.
                        self.draining.insert(*partition);
                        held.insert(*partition, lease.clone());
                    }
                }
                self.draining.retain(|p| !assigned.contains(p));
                self.held = held;
            }
        }
        Ok(())
    }

    /// Counts the leases among `considered` this worker held and no longer holds at the same
    /// generation.
    fn count_lost(&self, now: &HashMap<u32, Lease>, considered: impl Fn(&u32) -> bool) {
        let lost = self
            .held
            .iter()
            .filter(|(p, _)| considered(p))
            .filter(|(p, lease)| now.get(p).map(|l| l.generation) != Some(lease.generation))
            .count();
        if lost > 0 {
            let counters = self.queue.counters();
            self.queue
                .count(&counters.leases_lost, names::QUEUE_LEASES_LOST, lost as u64);
        }
    }

    /// Releases every lease (and, in a cluster, the node's membership and coordinator role).
    pub async fn release_all(&mut self) {
        let partitions: Vec<u32> = self.held.keys().copied().collect();
        let (db, root) = (self.queue.engine(), self.queue.root());
        if !partitions.is_empty()
            && let Err(err) = lease::release(db, root, &partitions, &self.id).await
        {
            tracing::warn!(error = %err, "releasing partition leases failed; they expire on their own");
        }
        self.held.clear();
        self.report_held();
        self.draining.clear();
        if let Mode::Standalone { .. } = &self.mode {
            // Gone: the slots it may still hold are free at once.
            let key = keys::worker_heartbeat_key(root, &self.id);
            if let Err(err) = delete_key(db, key).await {
                tracing::debug!(error = %err, "removing the worker heartbeat failed; it expires on its own");
            }
        }
        if let Mode::Cluster(node) = &self.mode {
            // Leaving: the coordinator drops this node at its next tick.
            if let Err(err) = delete_key(db, keys::node_key(root, &node.id)).await {
                tracing::warn!(error = %err, "removing the node record failed; it expires on its own");
            }
            if let Err(err) = node.resign(db, root).await {
                tracing::warn!(error = %err, "resigning as coordinator failed; the role expires on its own");
            }
        }
    }
}

/// Deletes one key in a transaction of its own.
async fn delete_key<E: TitoEngine>(db: &E, key: String) -> Result<(), TitoError> {
    let key = key.into_bytes();
    db.transaction(|tx| {
        let key = key.clone();
        async move { crate::engine::TitoTransaction::delete(&tx, key).await }
    })
    .await
}
