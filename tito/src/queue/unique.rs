//! Unique jobs with a window: at most one publication per *unique key* (an explicit key, or
//! fields of the payload) per period, beyond the one-live-invocation-per-id rule.
//!
//! A publication under [`Unique`] reads `{queue}:unique:{key}`, the last publication that took
//! the key (its event id and until when it holds the key). While that holds, and the id's
//! invocation is in a state the rule covers ([`UniqueStates`]), nothing is written and the
//! answer is a duplicate naming the invocation it collided with. Otherwise the event is
//! published as usual and takes the key for the period. Two racing publications of one key
//! both write its record, so one of them conflicts, replays and finds the other.
//! `{queue}:unique-exp:{until_ms}:{key}` indexes the records by expiry; maintenance deletes the
//! expired ones.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Queue, RETENTION_BATCH};
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::publish::plan_insert;
use crate::event::{Published, QueueEvent, StoredEvent};
use crate::keys;

/// The longest unique key accepted (bytes, as built).
pub const MAX_UNIQUE_KEY_BYTES: usize = 1024;
/// The longest period a unique key is held.
pub const MAX_UNIQUE_PERIOD: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Which states of the earlier invocation make a publication a duplicate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum UniqueStates {
    /// Only while it is pending (waiting or running): once it completed, the key is free
    /// again within the period. "Not two at once."
    #[default]
    Pending,
    /// Pending, completed (cancelled included) or dead, for the whole period, as long as the
    /// queue keeps its row (completed rows are kept for the queue's retention). "At most one
    /// per period."
    Any,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum UniqueBy {
    Key(String),
    Fields(Vec<String>),
}

/// A publication's uniqueness rule: what makes two publications the same job, for how long,
/// and in which states of the first the second is refused.
///
/// ```
/// use std::time::Duration;
/// use tito::queue::{Unique, UniqueStates};
///
/// // One reminder per user per hour, counting those already sent in that hour.
/// let rule = Unique::fields(["user_id"], Duration::from_secs(3600)).covering(UniqueStates::Any);
/// # let _ = rule;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unique {
    by: UniqueBy,
    period: Duration,
    states: UniqueStates,
}

impl Unique {
    /// Unique by an explicit key, for `period`.
    pub fn key(key: impl Into<String>, period: Duration) -> Self {
        Unique {
            by: UniqueBy::Key(key.into()),
            period,
            states: UniqueStates::default(),
        }
    }

    /// Unique by these fields of the payload (a JSON object once serialized), for `period`:
    /// two payloads with equal values in every named field are the same job.
    pub fn fields<S: Into<String>>(fields: impl IntoIterator<Item = S>, period: Duration) -> Self {
        Unique {
            by: UniqueBy::Fields(fields.into_iter().map(Into::into).collect()),
            period,
            states: UniqueStates::default(),
        }
    }

    /// The states of the earlier invocation that make a publication a duplicate (default
    /// [`UniqueStates::Pending`]).
    pub fn covering(mut self, states: UniqueStates) -> Self {
        self.states = states;
        self
    }

    /// The unique key of a payload, checked: refused with `InvalidArgument` when the period is
    /// zero or over [`MAX_UNIQUE_PERIOD`], the field list is empty or names a field the payload
    /// does not have, or the key is empty or over [`MAX_UNIQUE_KEY_BYTES`].
    fn key_of(&self, payload: &Value) -> TitoResult<String> {
        if self.period.is_zero() || self.period > MAX_UNIQUE_PERIOD {
            return Err(TitoError::invalid_argument(format!(
                "a unique period of {:?}; it must be more than zero and at most \
                 {MAX_UNIQUE_PERIOD:?}",
                self.period
            )));
        }
        let key = match &self.by {
            UniqueBy::Key(key) => key.clone(),
            UniqueBy::Fields(fields) => {
                if fields.is_empty() {
                    return Err(TitoError::invalid_argument("Unique::fields names no field"));
                }
                let Value::Object(object) = payload else {
                    return Err(TitoError::invalid_argument(
                        "Unique::fields needs a payload that serializes as a JSON object",
                    ));
                };
                let mut values = Vec::with_capacity(fields.len());
                for field in fields {
                    let value = object.get(field).ok_or_else(|| {
                        TitoError::invalid_argument(format!(
                            "Unique::fields names {field:?}, which the payload does not have"
                        ))
                    })?;
                    values.push(value.clone());
                }
                // Field names and values, as JSON: equal values give equal keys.
                serde_json::to_string(&(fields, values))?
            }
        };
        if key.is_empty() || key.len() > MAX_UNIQUE_KEY_BYTES {
            return Err(TitoError::invalid_argument(format!(
                "a unique key of {} bytes; it must hold 1 to {MAX_UNIQUE_KEY_BYTES}",
                key.len()
            )));
        }
        Ok(key)
    }
}

/// A unique key's record.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct UniqueRecord {
    id: String,
    until_ms: u64,
}

impl<E: TitoEngine> Queue<E> {
    /// Publishes `event` unless a publication with the same unique key holds it (see
    /// [`Unique`]): then nothing is written, and the answer is a duplicate whose `key` is the
    /// storage key of the invocation it collided with and whose `collided_id` is that event's
    /// id. Idempotent per event id as well, like [`Queue::publish`].
    pub async fn publish_unique<T: Serialize>(
        &self,
        event: QueueEvent<T>,
        unique: &Unique,
    ) -> TitoResult<Published> {
        self.publish_under(&event, Some(unique)).await
    }

    /// [`Queue::publish_unique`] inside `tx`, atomically with the rest of it.
    pub async fn publish_unique_in_tx<T: Serialize>(
        &self,
        event: &QueueEvent<T>,
        unique: &Unique,
        tx: &E::Transaction,
    ) -> TitoResult<Published> {
        self.publish_under_in_tx(event, Some(unique), tx).await
    }

    /// One maintenance step: deletes up to [`RETENTION_BATCH`] unique-key records whose period
    /// ended. Returns how many.
    pub async fn sweep_unique(&self) -> TitoResult<usize> {
        let root = self.root.clone();
        self.db
            .transaction(|tx| {
                let root = root.clone();
                async move {
                    let now = engine::version_millis(tx.start_version());
                    let prefix = keys::unique_exp_prefix(&root);
                    let end = keys::unique_exp_key(&root, now, "");
                    let rows = tx
                        .scan(prefix.as_bytes(), end.as_bytes(), RETENTION_BATCH)
                        .await?;
                    let mut deleted = 0;
                    for (key, _) in &rows {
                        tx.delete(key.clone()).await?;
                        let Some((until, unique_key)) = keys::key_str(key)
                            .ok()
                            .and_then(|k| keys::parse_unique_exp_key(&root, k))
                        else {
                            continue;
                        };
                        let record_key = keys::unique_key(&root, &unique_key).into_bytes();
                        let record = tx.get(&record_key).await?;
                        let same = record
                            .and_then(|b| serde_json::from_slice::<UniqueRecord>(&b).ok())
                            .is_some_and(|r| r.until_ms == until);
                        if same {
                            tx.delete(record_key).await?;
                        }
                        deleted += 1;
                    }
                    Ok::<_, TitoError>(deleted)
                }
            })
            .await
    }
}

/// A uniqueness rule with the key it gives an event, checked before any transaction.
#[derive(Clone, Debug)]
pub(super) struct Keyed {
    rule: Unique,
    key: String,
}

impl Keyed {
    pub(super) fn of(rule: Option<&Unique>, stored: &StoredEvent) -> TitoResult<Option<Keyed>> {
        rule.map(|rule| {
            Ok(Keyed {
                key: rule.key_of(&stored.payload)?,
                rule: rule.clone(),
            })
        })
        .transpose()
    }
}

/// One event of a publication, checked and encoded before any transaction: its stored form,
/// its bytes, and its uniqueness rule with the key it gives the event.
#[derive(Clone, Debug)]
pub(super) struct ToPublish {
    pub stored: StoredEvent,
    pub bytes: Vec<u8>,
    pub unique: Option<Keyed>,
}

impl ToPublish {
    /// `event` checked (its key, payload, due time, owner; the unique key of `unique`).
    pub(super) fn of<T: Serialize>(
        event: &QueueEvent<T>,
        unique: Option<&Unique>,
    ) -> TitoResult<ToPublish> {
        let stored = StoredEvent::from_event(event)?;
        let bytes = stored.to_bytes()?;
        let unique = Keyed::of(unique, &stored)?;
        Ok(ToPublish {
            stored,
            bytes,
            unique,
        })
    }
}

/// Reads `keys` (each once, however often named) in one batched read.
async fn read_once<X: TitoTransaction>(
    tx: &X,
    keys: impl IntoIterator<Item = String>,
) -> TitoResult<HashMap<String, Option<Vec<u8>>>> {
    let mut wanted: Vec<String> = keys.into_iter().collect();
    wanted.sort_unstable();
    wanted.dedup();
    match wanted.as_slice() {
        [] => return Ok(HashMap::new()),
        // One key: a plain read (on TiKV a `KvGet`, the same round trip).
        [key] => {
            let value = tx.get(key.as_bytes()).await?;
            return Ok(HashMap::from([(key.clone(), value)]));
        }
        _ => {}
    }
    let raw: Vec<Vec<u8>> = wanted.iter().map(|k| k.clone().into_bytes()).collect();
    let values = tx.batch_get(&raw).await?;
    Ok(wanted.into_iter().zip(values).collect())
}

/// Plans publications in their order: without a rule, an event's pending row (unless its id is
/// a duplicate); with one, a duplicate when the key is held in a covered state, else the row
/// and the key's new record. What they check is read in at most two batched reads (the event
/// ids and unique records, then the invocations of the records that hold a key), and each event
/// sees the ones planned before it: an id or a unique key taken earlier in the list makes a
/// duplicate of that invocation, as a second publication would after the first committed.
pub(super) async fn plan<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    items: &[ToPublish],
    writes: &mut engine::Writes,
) -> TitoResult<Vec<(Published, u32)>> {
    let now = engine::version_millis(tx.start_version());
    let id_key = |id: &str| keys::event_id_key(root, id);
    let first = read_once(
        tx,
        items.iter().flat_map(|item| {
            let record = item.unique.as_ref().map(|u| keys::unique_key(root, &u.key));
            std::iter::once(id_key(&item.stored.id)).chain(record)
        }),
    )
    .await?;
    let record_of = |unique_key: &str| {
        first
            .get(&keys::unique_key(root, unique_key))
            .cloned()
            .flatten()
            .and_then(|bytes| serde_json::from_slice::<UniqueRecord>(&bytes).ok())
    };
    // The invocations of the records that hold their key now (not read already).
    let second = read_once(
        tx,
        items
            .iter()
            .filter_map(|item| record_of(&item.unique.as_ref()?.key))
            .filter(|record| now < record.until_ms)
            .map(|record| id_key(&record.id))
            .filter(|key| !first.contains_key(key)),
    )
    .await?;
    let stored_live = |id: &str| -> Option<Vec<u8>> {
        let key = id_key(id);
        first
            .get(&key)
            .or_else(|| second.get(&key))
            .cloned()
            .flatten()
    };
    // What this plan took so far: ids (their pending keys) and unique keys (the id taking it).
    let mut taken_ids: HashMap<&str, String> = HashMap::new();
    let mut taken_keys: HashMap<&str, &str> = HashMap::new();
    let mut planned = Vec::with_capacity(items.len());
    for item in items {
        let stored = &item.stored;
        let partition = crate::event::partition_for(&stored.key, partitions);
        // The invocation holding `id`: one planned here, or a live one in the store.
        let live = |id: &str| -> Option<String> {
            match taken_ids.get(id) {
                Some(key) => Some(key.clone()),
                None => stored_live(id).and_then(|bytes| String::from_utf8(bytes).ok()),
            }
        };
        let mut record = None;
        if let Some(Keyed {
            rule,
            key: unique_key,
        }) = &item.unique
        {
            // The key's holder: taken earlier in this plan (live until past `now`), or the
            // store's record.
            let holder = match taken_keys.get(unique_key.as_str()) {
                Some(id) => Some(((*id).to_string(), u64::MAX)),
                None => {
                    record = record_of(unique_key);
                    record.as_ref().map(|r| (r.id.clone(), r.until_ms))
                }
            };
            if let Some((holder, until_ms)) = holder
                && now < until_ms
                && holder != stored.id
                && let Some(live) = live(&holder)
            {
                let pending = live.starts_with(&format!("{root}:pending:"));
                if pending || rule.states == UniqueStates::Any {
                    let mut published = Published::duplicate_of(holder.clone(), live);
                    published.collided_id = Some(holder);
                    planned.push((published, partition));
                    continue;
                }
            }
        }
        if let Some(key) = live(&stored.id) {
            planned.push((Published::duplicate_of(stored.id.clone(), key), partition));
            continue;
        }
        let key = plan_insert(
            tx.start_version(),
            root,
            partitions,
            stored,
            item.bytes.clone(),
            writes,
        )?;
        taken_ids.insert(&stored.id, key.clone());
        if let Some(Keyed {
            rule,
            key: unique_key,
        }) = &item.unique
        {
            if let Some(old) = &record {
                writes.delete(keys::unique_exp_key(root, old.until_ms, unique_key));
            }
            let until_ms = now.saturating_add(crate::util::millis(rule.period));
            let fresh = UniqueRecord {
                id: stored.id.clone(),
                until_ms,
            };
            writes.put(
                keys::unique_key(root, unique_key),
                serde_json::to_vec(&fresh)?,
            );
            writes.put(keys::unique_exp_key(root, until_ms, unique_key), Vec::new());
            taken_keys.insert(unique_key, &stored.id);
        }
        planned.push((Published::new(stored.id.clone(), key), partition));
    }
    Ok(planned)
}
