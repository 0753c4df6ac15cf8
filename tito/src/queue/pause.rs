//! Pausing a queue, or one of its partitions: a stored record that every worker of the queue
//! (in every process) reads before it pulls, at most [`PAUSE_CHECK`] apart. A paused partition
//! starts nothing new; handlers already running finish and their outcomes are applied, and the
//! worker keeps its leases (another worker does not take the partition over to run it).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Queue;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;

/// How stale a worker's view of the pause records may be: a pause stops new starts, and a
/// resume restarts them, within this (one scan of the records per check, while pulling).
pub const PAUSE_CHECK: Duration = Duration::from_millis(500);

/// The longest reason kept with a pause.
pub const MAX_PAUSE_REASON: usize = 1024;

/// A pause as stored: why, and when (engine time, Unix ms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRecord {
    /// What the operator gave.
    pub why: String,
    /// When it was paused (Unix ms, the engine's clock).
    pub at_ms: u64,
}

/// What is paused in a queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paused {
    /// The whole queue, when paused.
    pub queue: Option<PauseRecord>,
    /// Single partitions, by number.
    pub partitions: BTreeMap<u32, PauseRecord>,
}

impl Paused {
    /// Whether workers start nothing in `partition`.
    pub fn holds(&self, partition: u32) -> bool {
        self.queue.is_some() || self.partitions.contains_key(&partition)
    }

    /// Whether nothing at all is paused.
    pub fn is_empty(&self) -> bool {
        self.queue.is_none() && self.partitions.is_empty()
    }
}

impl<E: TitoEngine> Queue<E> {
    /// Pauses the queue (`partition: None`) or one partition: every worker of the queue stops
    /// starting invocations there within [`PAUSE_CHECK`] of the commit. Running handlers
    /// finish; publications go on. `why` is kept for operators. Pausing what is already paused
    /// keeps the first record and returns `false`.
    pub async fn pause(&self, partition: Option<u32>, why: &str) -> TitoResult<bool> {
        pause_under(&self.db, &self.root, partition, why).await
    }

    /// Resumes the queue or one partition (the same `partition` as the pause: resuming the
    /// queue does not resume partitions paused one by one). `false` when it was not paused.
    pub async fn resume(&self, partition: Option<u32>) -> TitoResult<bool> {
        resume_under(&self.db, &self.root, partition).await
    }

    /// What is paused.
    pub async fn paused(&self) -> TitoResult<Paused> {
        paused_under(&self.db, &self.root).await
    }
}

/// [`Queue::pause`] on the queue named `topic` (`None`: the default queue), for tools.
pub async fn pause<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    partition: Option<u32>,
    why: &str,
) -> TitoResult<bool> {
    pause_under(db, &keys::queue_root(topic), partition, why).await
}

/// [`Queue::resume`] on the queue named `topic`, for tools.
pub async fn resume<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    partition: Option<u32>,
) -> TitoResult<bool> {
    resume_under(db, &keys::queue_root(topic), partition).await
}

/// [`Queue::paused`] on the queue named `topic`, for tools.
pub async fn paused<E: TitoEngine>(db: &E, topic: Option<&str>) -> TitoResult<Paused> {
    paused_under(db, &keys::queue_root(topic)).await
}

/// The queue exists (something was published to it: a mistyped topic is not paused), and
/// `partition`, if given, is one of its partitions.
pub(super) async fn check_partition<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partition: Option<u32>,
) -> TitoResult<()> {
    let count = super::stored_partition_count(tx, root).await?;
    match (count, partition) {
        (Some(_), None) => Ok(()),
        (Some(count), Some(partition)) if partition < count => Ok(()),
        (Some(count), Some(partition)) => Err(super::no_such_partition(root, count, partition)),
        (None, _) => Err(TitoError::NotFound(format!(
            "no queue {:?} (nothing was ever published to it)",
            keys::queue_name(root)
        ))),
    }
}

/// Refuses a pause's reason over [`MAX_PAUSE_REASON`] bytes for the queue named `topic`
/// (`None`: the default queue), naming the queue, as [`pause`] does (for tools that check an
/// operator's input before asking for confirmation).
pub fn check_pause_reason(topic: Option<&str>, why: &str) -> TitoResult<()> {
    check_reason_under(&keys::queue_root(topic), why)
}

fn check_reason_under(root: &str, why: &str) -> TitoResult<()> {
    super::check_reason(root, "a pause's reason", why, MAX_PAUSE_REASON)
}

async fn pause_under<E: TitoEngine>(
    db: &E,
    root: &str,
    partition: Option<u32>,
    why: &str,
) -> TitoResult<bool> {
    check_reason_under(root, why)?;
    let key = keys::paused_key(root, partition);
    let (root, why) = (root.to_string(), why.to_string());
    let paused = db
        .transaction(|tx| {
            let (root, key, why) = (root.clone(), key.clone(), why.clone());
            async move {
                check_partition(&tx, &root, partition).await?;
                if tx.get(key.as_bytes()).await?.is_some() {
                    return Ok(false);
                }
                let record = PauseRecord {
                    why,
                    at_ms: engine::version_millis(tx.start_version()),
                };
                tx.put(key.into_bytes(), serde_json::to_vec(&record)?)
                    .await?;
                Ok::<_, TitoError>(true)
            }
        })
        .await?;
    if paused {
        tracing::info!(queue = root, ?partition, "queue paused");
    }
    Ok(paused)
}

async fn resume_under<E: TitoEngine>(
    db: &E,
    root: &str,
    partition: Option<u32>,
) -> TitoResult<bool> {
    let key = keys::paused_key(root, partition);
    let wakeups = crate::event::nudge::wakeups(db, root);
    let owned_root = root.to_string();
    let resumed = db
        .transaction(|tx| {
            let (root, key, wakeups) = (owned_root.clone(), key.clone(), wakeups.clone());
            async move {
                check_partition(&tx, &root, partition).await?;
                if tx.get(key.as_bytes()).await?.is_none() {
                    return Ok(false);
                }
                tx.delete(key.into_bytes()).await?;
                let count = super::stored_partition_count(&tx, &root)
                    .await?
                    .unwrap_or(0);
                match partition {
                    Some(partition) => wakeups.wake_after_commit(&tx, partition),
                    None => {
                        for partition in 0..count {
                            wakeups.wake_after_commit(&tx, partition);
                        }
                    }
                }
                Ok::<_, TitoError>(true)
            }
        })
        .await?;
    if resumed {
        tracing::info!(queue = root, ?partition, "queue resumed");
    }
    Ok(resumed)
}

async fn paused_under<E: TitoEngine>(db: &E, root: &str) -> TitoResult<Paused> {
    let root = root.to_string();
    engine::read_only(db, async |tx| read_paused(tx, &root).await).await
}

/// The pause records of the queue under `root`, in one scan.
pub(crate) async fn read_paused<X: TitoTransaction>(tx: &X, root: &str) -> TitoResult<Paused> {
    // One scan for any ordinary queue (a handful of records); more only with over a
    // thousand partitions paused one by one.
    let rows = super::scan_prefix(tx, &keys::paused_prefix(root)).await?;
    let mut paused = Paused::default();
    for (key, value) in rows {
        let record: PauseRecord = serde_json::from_slice(&value).map_err(|err| {
            TitoError::Integrity(format!("pause record {}: {err}", keys::display_key(&key)))
        })?;
        match keys::parse_paused_key(root, &key)? {
            None => paused.queue = Some(record),
            Some(partition) => {
                paused.partitions.insert(partition, record);
            }
        }
    }
    Ok(paused)
}
