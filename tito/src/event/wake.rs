//! Waking this process's workers after a commit published to their queue.
//!
//! Each store keeps one [`Wakeups`] per queue (on its handle's extensions), shared by every
//! `Queue` handle of that queue and every publication path: a publication registers a wake-up
//! of its partition on its transaction ([`TitoTransaction::after_commit`]), which runs only once
//! the commit succeeded, so a worker never polls for a row it cannot see yet. Workers watch a
//! generation counter and read which partitions were woken since the generation they saw: no
//! wake-up is lost between two waits, and two workers of different partitions never take each
//! other's.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use crate::engine::{TitoEngine, TitoTransaction};

/// The wake-ups of one queue on one store.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    /// The queue's root (its key prefix), and a hash of it (what nudges name it by).
    root: String,
    root_hash: u64,
    /// The addresses of other processes' workers of this queue (see `nudge`).
    peers: Mutex<Peers>,
    /// Whether a worker of this process listens to nudges for the queue.
    listen: Listen,
    /// Where this store's nudges go out (set when the store has nudges on).
    sender: std::sync::OnceLock<Sender>,
    /// The latest generation, and the generation of each partition's latest wake-up.
    state: Mutex<(u64, HashMap<u32, u64>)>,
    /// Wakes the workers waiting in [`Wakeups::changed_since`], in the order they began to
    /// wait (a `watch` channel would wake them in a random order, and the simulation's runs
    /// must repeat exactly).
    notify: Notify,
    /// Counts cancellations committed in this process (see [`Wakeups::cancels`]).
    cancels: std::sync::atomic::AtomicU64,
    /// The pending rows cancelled in this process most recently (at most [`RECENT_CANCELS`]),
    /// looked up by a handler's start ([`Wakeups::was_cancelled`]).
    cancelled: Mutex<(HashSet<String>, VecDeque<String>)>,
    /// The most partitions a queue handle of this process gave the queue: a nudge naming a
    /// partition past them is dropped, so the wake-up map holds only partitions this process
    /// can work.
    partitions: std::sync::atomic::AtomicU32,
}

/// How many of the latest cancelled rows a queue remembers in this process: far more than a
/// worker can have between reading a row and starting it.
pub(crate) const RECENT_CANCELS: usize = 16_384;

impl Wakeups {
    fn new(root: &str) -> Self {
        Wakeups {
            root: root.to_string(),
            root_hash: crate::keys::fnv1a(root.as_bytes()),
            ..Wakeups::default()
        }
    }

    /// The queue's root.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    /// The other processes' listening addresses, as last read.
    pub(crate) fn peers(&self) -> Arc<Vec<std::net::SocketAddr>> {
        crate::util::lock(&self.peers).addresses()
    }

    /// Whether the addresses must be read again; `true` claims the read.
    pub(crate) fn peers_stale(&self) -> bool {
        crate::util::lock(&self.peers).stale_and_claim()
    }

    /// The addresses read (`None`: the read failed; read again at the next send).
    pub(crate) fn set_peers(&self, addresses: Option<Vec<std::net::SocketAddr>>) {
        crate::util::lock(&self.peers).set(addresses);
    }

    /// Sets where nudges go out (once).
    pub(crate) fn set_sender(&self, sender: Sender) {
        let _ = self.sender.set(sender);
    }

    /// Nudges the other processes' workers of the queue (`None`: a cancellation).
    fn nudge(&self, partition: Option<u32>) {
        if let Some(sender) = self.sender.get() {
            sender.send(self.root_hash, &self.peers(), partition);
        }
    }

    /// Marks that a worker of this process listens to the queue's nudges.
    pub(crate) fn listen(&self, on: bool) {
        self.listen.set(on);
    }

    /// Whether a worker of this process listens to the queue's nudges.
    pub(crate) fn listening(&self) -> bool {
        self.listen.get()
    }

    /// Another process committed a cancellation: workers check their running invocations.
    pub(crate) fn cancel_elsewhere(&self) {
        self.cancels
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        crate::util::lock(&self.state).0 += 1;
        self.notify.notify_waiters();
    }

    /// How many cancellations of this queue committed in this process: a worker whose count
    /// is behind checks its running invocations at once.
    pub(crate) fn cancels(&self) -> u64 {
        self.cancels.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Once `tx` has committed: records the pending rows `keys` it cancelled (before the cancel
    /// returns), counts a cancellation and wakes the workers (no partition is polled for it).
    pub(crate) fn cancelled_after_commit<X: TitoTransaction>(
        self: &Arc<Self>,
        tx: &X,
        keys: Vec<String>,
    ) {
        let wakeups = self.clone();
        tx.after_commit(Box::new(move || {
            {
                let mut cancelled = crate::util::lock(&wakeups.cancelled);
                let (set, order) = &mut *cancelled;
                for key in keys {
                    if set.insert(key.clone()) {
                        order.push_back(key);
                    }
                }
                while order.len() > RECENT_CANCELS {
                    if let Some(oldest) = order.pop_front() {
                        set.remove(&oldest);
                    }
                }
            }
            wakeups
                .cancels
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            crate::util::lock(&wakeups.state).0 += 1;
            wakeups.notify.notify_waiters();
            wakeups.nudge(None);
        }));
    }

    /// Whether the pending row `key` was cancelled in this process (among the latest
    /// [`RECENT_CANCELS`]).
    pub(crate) fn was_cancelled(&self, key: &str) -> bool {
        crate::util::lock(&self.cancelled).0.contains(key)
    }

    /// Records that a queue handle of this process has `partitions` partitions.
    pub(crate) fn has_partitions(&self, partitions: u32) {
        self.partitions
            .fetch_max(partitions, std::sync::atomic::Ordering::AcqRel);
    }

    /// A nudge from another process: wakes the workers of `partition` when this process has
    /// a queue handle with that partition; `false` (nothing recorded) otherwise.
    pub(crate) fn wake_nudged(&self, partition: u32) -> bool {
        if partition >= self.partitions.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        self.wake(partition);
        true
    }

    /// How many partitions the wake-up map holds (for tests of its bound).
    #[cfg(test)]
    pub(crate) fn partitions_recorded(&self) -> usize {
        crate::util::lock(&self.state).1.len()
    }

    /// Wakes the workers of `partition` (this process's, of this queue on this store).
    pub(crate) fn wake(&self, partition: u32) {
        {
            let mut state = crate::util::lock(&self.state);
            state.0 += 1;
            let generation = state.0;
            state.1.insert(partition, generation);
        }
        self.notify.notify_waiters();
    }

    /// The latest generation.
    pub(crate) fn generation(&self) -> u64 {
        crate::util::lock(&self.state).0
    }

    /// Resolves once a wake-up came after generation `seen` (at once if one has).
    pub(crate) async fn changed_since(&self, seen: u64) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a wake-up between the two is not lost.
            notified.as_mut().enable();
            if self.generation() != seen {
                return;
            }
            notified.await;
        }
    }

    /// The latest generation, and the partitions woken after generation `seen`.
    pub(crate) fn woken_since(&self, seen: u64) -> (u64, Vec<u32>) {
        let state = crate::util::lock(&self.state);
        let partitions = state
            .1
            .iter()
            .filter(|(_, generation)| **generation > seen)
            .map(|(partition, _)| *partition)
            .collect();
        (state.0, partitions)
    }

    /// After `tx` commits, wakes (and nudges) the workers of each of `partitions`.
    pub(crate) fn wake_all_after_commit<X: TitoTransaction>(
        self: &Arc<Self>,
        tx: &X,
        partitions: Vec<u32>,
    ) {
        let wakeups = self.clone();
        tx.after_commit(Box::new(move || {
            for partition in partitions {
                wakeups.wake(partition);
                wakeups.nudge(Some(partition));
            }
        }));
    }

    /// After `tx` commits, wakes (and nudges) the workers of `partition`.
    pub(crate) fn wake_after_commit<X: TitoTransaction>(self: &Arc<Self>, tx: &X, partition: u32) {
        let wakeups = self.clone();
        tx.after_commit(Box::new(move || {
            wakeups.wake(partition);
            wakeups.nudge(Some(partition));
        }));
    }
}

/// Every queue's wake-ups on one store.
#[derive(Debug, Default)]
pub(crate) struct StoreWakeups(Mutex<HashMap<String, Arc<Wakeups>>>);

impl StoreWakeups {
    /// The wake-ups of the queue at `root`, made at the first call.
    pub(crate) fn of_root(&self, root: &str) -> Arc<Wakeups> {
        crate::util::lock(&self.0)
            .entry(root.to_string())
            .or_insert_with(|| Arc::new(Wakeups::new(root)))
            .clone()
    }

    /// The wake-ups of the queue whose root hashes to `hash`.
    pub(crate) fn by_hash(&self, hash: u64) -> Option<Arc<Wakeups>> {
        crate::util::lock(&self.0)
            .values()
            .find(|wakeups| wakeups.root_hash == hash)
            .cloned()
    }
}

/// The wake-ups of the queue at `root` on store `db`.
/// The wake-ups of the queue at `root` on store `db`, without nudges (see
/// `super::nudge::wakeups`, which every writer uses).
pub(crate) fn local_wakeups<E: TitoEngine>(db: &E, root: &str) -> Arc<Wakeups> {
    db.extensions().get::<StoreWakeups>().of_root(root)
}

/// The wake-ups of the queue at `root` on store `db`, only if something asked for them already
/// (a writer with nobody to wake allocates nothing).
pub(crate) fn existing_wakeups<E: TitoEngine>(db: &E, root: &str) -> Option<Arc<Wakeups>> {
    let all = db.extensions().get::<StoreWakeups>();
    crate::util::lock(&all.0).get(root).cloned()
}

/// The wake-ups key of a table whose new rows an inbox subscription waits for.
pub(crate) fn table_rows(table: &str) -> String {
    format!("rows of {table}")
}

// What nudges need of each queue's wake-ups (`super::nudge` sends and receives them).

/// How old a process's list of a queue's listening addresses may be when it sends.
pub const PEERS_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// A nudge's kinds: new work in a partition, or a cancellation.
pub(crate) const KIND_WORK: u8 = 0;
pub(crate) const KIND_CANCEL: u8 = 1;

#[derive(Debug)]
pub(crate) struct Outgoing {
    pub(crate) peers: Arc<Vec<SocketAddr>>,
    pub(crate) root_hash: u64,
    pub(crate) kind: u8,
    pub(crate) partition: u32,
}

/// What a process knows of the workers listening to one queue.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    addresses: Arc<Vec<SocketAddr>>,
    read_at: Option<Instant>,
    reading: bool,
}

impl Peers {
    pub(crate) fn stale_and_claim(&mut self) -> bool {
        if self.reading || self.read_at.is_some_and(|at| at.elapsed() < PEERS_FRESH) {
            return false;
        }
        self.reading = true;
        true
    }

    pub(crate) fn set(&mut self, addresses: Option<Vec<SocketAddr>>) {
        self.reading = false;
        if let Some(addresses) = addresses {
            self.addresses = Arc::new(addresses);
            self.read_at = Some(Instant::now());
        }
    }

    pub(crate) fn addresses(&self) -> Arc<Vec<SocketAddr>> {
        self.addresses.clone()
    }
}

/// Whether this process's workers listen to nudges on the queue (`true` once one registered).
#[derive(Debug, Default)]
pub(crate) struct Listen(AtomicBool);

impl Listen {
    pub(crate) fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Where a store's nudges go out: its socket's queue.
#[derive(Clone, Debug)]
pub(crate) struct Sender {
    pub(crate) out: tokio::sync::mpsc::Sender<Outgoing>,
}

impl Sender {
    /// Queues a nudge of the queue `root_hash` (`None`: a cancellation) to `peers`. A full
    /// queue drops it: the receivers poll as they would without it.
    pub(crate) fn send(
        &self,
        root_hash: u64,
        peers: &Arc<Vec<SocketAddr>>,
        partition: Option<u32>,
    ) {
        if peers.is_empty() {
            return;
        }
        let (kind, partition) = match partition {
            Some(partition) => (KIND_WORK, partition),
            None => (KIND_CANCEL, 0),
        };
        let _ = self.out.try_send(Outgoing {
            peers: peers.clone(),
            root_hash,
            kind,
            partition,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backend::memory::Memory;
    use crate::model::{TitoEventConfig, TitoModelTrait, TitoOperation, TitoOptions};
    use crate::queue::{Queue, QueueConfig};
    use crate::{QueueEvent, TitoError};

    #[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
    struct Note {
        id: String,
    }

    impl TitoModelTrait for Note {
        fn id(&self) -> String {
            self.id.clone()
        }
        fn table(&self) -> String {
            "note".into()
        }
        fn events(&self) -> Vec<TitoEventConfig> {
            vec![TitoEventConfig {
                name: "notes".into(),
                timestamp: 0,
            }]
        }
    }

    fn woken(wakeups: &Wakeups) -> Vec<u32> {
        let mut partitions = wakeups.woken_since(0).1;
        partitions.sort_unstable();
        partitions
    }

    #[tokio::test]
    async fn publications_wake_after_their_commit_and_never_otherwise() -> Result<(), TitoError> {
        let db = Memory::new();
        let queue = Queue::new(db.clone(), QueueConfig::new(1, Duration::from_secs(60)));
        let wakeups = queue.wakeups.clone();
        // Another handle of the same queue shares the wake-ups; another queue does not.
        let twin = Queue::new(db.clone(), QueueConfig::new(1, Duration::from_secs(60)));
        assert!(Arc::ptr_eq(&wakeups, &twin.wakeups));
        let notes = super::local_wakeups(&db, &crate::keys::queue_root(Some("notes")));
        assert!(!Arc::ptr_eq(&wakeups, &notes));

        // In a caller's transaction: nothing before the commit, the partition after it.
        let tx = db.begin().await?;
        queue
            .publish_in_tx(&QueueEvent::new("k", 1u32, 0), &tx)
            .await?;
        assert!(woken(&wakeups).is_empty(), "woken before the commit");
        tx.commit().await?;
        assert_eq!(woken(&wakeups), [0]);

        // Rolled back, or refused at commit: no wake-up.
        let (before, _) = wakeups.woken_since(0);
        let tx = db.begin().await?;
        queue
            .publish_in_tx(&QueueEvent::new("k", 2u32, 0), &tx)
            .await?;
        tx.rollback().await?;
        let tx = db.begin().await?;
        queue
            .publish_in_tx(&QueueEvent::new("k", 3u32, 0), &tx)
            .await?;
        tx.fail(&TitoError::invalid_argument("the caller gave up"));
        assert!(tx.commit().await.is_err());
        assert_eq!(
            wakeups.woken_since(0).0,
            before,
            "no wake-up without a commit"
        );

        // In its own transaction, and a model write with events: woken by their commits.
        queue.publish(QueueEvent::new("k", 4u32, 0)).await?;
        assert!(wakeups.woken_since(before).0 > before);
        let model = crate::model::TitoModel::<_, Note>::new(db.clone());
        let tx = db.begin().await?;
        model
            .build_with_options(
                Note { id: "n1".into() },
                TitoOptions::with_events(TitoOperation::Insert),
                &tx,
            )
            .await?;
        assert!(woken(&notes).is_empty(), "woken before the commit");
        tx.commit().await?;
        assert_eq!(woken(&notes), [0]);
        Ok(())
    }
}
