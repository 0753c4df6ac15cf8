//! Concurrency and rate limits, stored with the queue and enforced in the store, so they hold
//! over every worker of every process.
//!
//! - **Concurrency**: at most N invocations of the queue (and at most M of one business key,
//!   the event's `key`) running at once. A worker takes a *slot* in the store before it starts a
//!   handler, in one transaction for everything a pull found: `{queue}:running:all:{i}` for
//!   `i < N`, `{queue}:running:key:{key}:{i}` for `i < M`. Two workers taking one slot both
//!   write its key, so one of them conflicts, replays and sees it taken. A slot names its
//!   holder and is free again when the holder releases it (after the invocation's outcome
//!   commits or fails), or when the holder is gone: a standalone worker's heartbeat
//!   (`{queue}:worker:{id}`, renewed with its leases) expired, a cluster node's record expired
//!   or changed epoch, or (on the embedded engine) the store was opened again since. A worker
//!   that lost its partition lease but is alive keeps its slots while its handlers run, so a
//!   takeover never runs more than the limit.
//! - **Rate**: at most S starts per interval for the queue (and per business key). Each limit
//!   keeps a log of its last S start times (engine time) under `{queue}:rate:all` and
//!   `{queue}:rate:key:{key}`; a start is admitted when fewer than S of them fall in the last
//!   interval, and written to the log in the same transaction. An invocation over the limit is
//!   moved, in that transaction, to the second its turn is expected (its row's due time
//!   changes; no worker polls for it meanwhile). If others take that turn first it moves again.
//!
//! An invocation waiting for a concurrency slot stays where it is and is pulled again at its
//! partition's next poll (at once after a slot of this process is released; within the idle
//! backoff for slots released elsewhere). Limits are read by workers with the pause records, at
//! most [`PAUSE_CHECK`](super::PAUSE_CHECK) apart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Queue;
use super::pull::Pulled;
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::event::publish::insert_pending;
use crate::keys;

/// The largest concurrency limit accepted (slots are read one key each).
pub const MAX_CONCURRENCY_LIMIT: u32 = 1024;
/// The largest number of starts a rate limit counts (its log keeps one time per start).
pub const MAX_RATE_STARTS: u32 = 1000;
/// The shortest interval of a rate limit (due times are whole seconds).
pub const MIN_RATE_INTERVAL: Duration = Duration::from_secs(1);
/// The longest interval of a rate limit.
pub const MAX_RATE_INTERVAL: Duration = Duration::from_secs(24 * 60 * 60);

/// "At most `starts` starts per `per`".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rate {
    /// Starts allowed in any interval of length `per` (1..=[`MAX_RATE_STARTS`]).
    pub starts: u32,
    /// The interval ([`MIN_RATE_INTERVAL`]..=[`MAX_RATE_INTERVAL`]).
    #[serde(with = "millis")]
    pub per: Duration,
}

impl Rate {
    /// `starts` per `per`.
    pub fn new(starts: u32, per: Duration) -> Self {
        Rate { starts, per }
    }

    /// A rate written `STARTS/INTERVAL` or `STARTS per INTERVAL`, the interval a number with
    /// `ms`, `s`, `m`, `h` or `d` (a space between them is allowed, and a decimal point:
    /// `1.5s`): `100/1m`, `5/1s`, `10 per 1.5 s` (what `tito queue limits --rate` and the
    /// dashboard take). Every rate's [`Display`](std::fmt::Display) form parses back to the
    /// same rate. An interval finer than a millisecond is refused here; the bounds are checked
    /// when the limits are set.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tito::queue::Rate;
    ///
    /// assert_eq!(Rate::parse("100/1m").unwrap(), Rate::new(100, Duration::from_secs(60)));
    /// let rate = Rate::new(10, Duration::from_millis(1500));
    /// assert_eq!(rate.to_string(), "10 per 1.5 s");
    /// assert_eq!(Rate::parse(&rate.to_string()).unwrap(), rate);
    /// assert!(Rate::parse("100").is_err());
    /// ```
    pub fn parse(text: &str) -> TitoResult<Rate> {
        let bad = || {
            TitoError::invalid_argument(format!(
                "{text:?} is not a rate: write STARTS/INTERVAL, such as 100/1m, 5/1s or 10/1.5s \
                 (ms, s, m, h or d)"
            ))
        };
        let (starts, per) = text
            .split_once('/')
            .or_else(|| text.split_once(" per "))
            .ok_or_else(bad)?;
        let starts: u32 = starts.trim().parse().map_err(|_| bad())?;
        let per = per.trim();
        let split = per
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (amount, unit) = (&per[..split], per[split..].trim_start());
        let unit_ms: u64 = match unit {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        let (whole, fraction) = amount.split_once('.').unwrap_or((amount, ""));
        if whole.is_empty()
            || fraction.contains('.')
            || (amount.contains('.') && fraction.is_empty())
        {
            return Err(bad());
        }
        // Exact arithmetic: the fraction as a numerator over 10^digits.
        let whole: u64 = whole.parse().map_err(|_| bad())?;
        let digits = u32::try_from(fraction.len()).map_err(|_| bad())?;
        let numerator: u64 = if fraction.is_empty() {
            0
        } else {
            fraction.parse().map_err(|_| bad())?
        };
        let scale = 10u64.checked_pow(digits).ok_or_else(bad)?;
        let fraction_ms = numerator.checked_mul(unit_ms).ok_or_else(bad)?;
        if !fraction_ms.is_multiple_of(scale) {
            return Err(TitoError::invalid_argument(format!(
                "{text:?}: a rate's interval is counted in whole milliseconds"
            )));
        }
        let ms = whole
            .checked_mul(unit_ms)
            .and_then(|ms| ms.checked_add(fraction_ms / scale))
            .ok_or_else(bad)?;
        Ok(Rate::new(starts, Duration::from_millis(ms)))
    }

    fn check(&self, name: &str) -> TitoResult<()> {
        if self.starts == 0 || self.starts > MAX_RATE_STARTS {
            return Err(TitoError::invalid_argument(format!(
                "Limits::{name} allows {} starts; it must allow 1 to {MAX_RATE_STARTS}",
                self.starts
            )));
        }
        if self.per < MIN_RATE_INTERVAL || self.per > MAX_RATE_INTERVAL {
            return Err(TitoError::invalid_argument(format!(
                "Limits::{name} counts starts over {}; the interval must be from {} to {}",
                interval_text(self.per),
                interval_text(MIN_RATE_INTERVAL),
                interval_text(MAX_RATE_INTERVAL),
            )));
        }
        Ok(())
    }

    fn per_ms(&self) -> u64 {
        crate::util::millis(self.per)
    }
}

/// `10 per 1.5 s`, `5 per 9 d`, `100 per 1 m`: the interval in the largest unit (d, h, m, s)
/// that states it exactly in at most three decimals, else in milliseconds (or in seconds with
/// every digit, for an interval finer than a millisecond). [`Rate::parse`] reads it back.
impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} per {}", self.starts, interval_text(self.per))
    }
}

/// An interval in words, exactly: `1.5 s`, `9 d`, `90 ms`.
fn interval_text(per: Duration) -> String {
    if !per.subsec_nanos().is_multiple_of(1_000_000) {
        let text = format!("{}.{:09}", per.as_secs(), per.subsec_nanos());
        return format!("{} s", text.trim_end_matches('0'));
    }
    let ms = per.as_millis();
    for (unit, name) in [
        (86_400_000u128, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1000, "s"),
    ] {
        if ms >= unit && (ms * 1000).is_multiple_of(unit) {
            let thousandths = ms * 1000 / unit;
            let text = format!("{}.{:03}", thousandths / 1000, thousandths % 1000);
            let text = text.trim_end_matches('0').trim_end_matches('.');
            return format!("{text} {name}");
        }
    }
    format!("{ms} ms")
}

mod millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(crate::util::millis(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// A queue's limits; `None` is unlimited. Set with [`Queue::set_limits`].
///
/// ```
/// use std::time::Duration;
/// use tito::queue::{Limits, Rate};
///
/// // At most 8 handlers of the queue at once over every worker, one per customer key, and
/// // at most 100 starts a minute per customer.
/// let limits = Limits::none()
///     .concurrency(8)
///     .key_concurrency(1)
///     .key_rate(Rate::new(100, Duration::from_secs(60)));
/// assert_eq!(limits.key_concurrency, Some(1));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Limits {
    /// At most this many invocations of the queue running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// At most this many invocations of one business key (the event's `key`) running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_concurrency: Option<u32>,
    /// At most so many starts of the queue per interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// At most so many starts of one business key per interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_rate: Option<Rate>,
}

impl Limits {
    /// No limit.
    pub fn none() -> Self {
        Limits::default()
    }

    /// At most `n` running in the queue.
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = Some(n);
        self
    }

    /// At most `n` running per business key.
    pub fn key_concurrency(mut self, n: u32) -> Self {
        self.key_concurrency = Some(n);
        self
    }

    /// At most `rate` starts in the queue.
    pub fn rate(mut self, rate: Rate) -> Self {
        self.rate = Some(rate);
        self
    }

    /// At most `rate` starts per business key.
    pub fn key_rate(mut self, rate: Rate) -> Self {
        self.key_rate = Some(rate);
        self
    }

    /// Whether nothing is limited.
    pub fn is_none(&self) -> bool {
        *self == Limits::default()
    }

    /// Refuses zero and oversized limits, naming the setting.
    pub fn check(&self) -> TitoResult<()> {
        for (name, value) in [
            ("concurrency", self.concurrency),
            ("key_concurrency", self.key_concurrency),
        ] {
            if let Some(n) = value
                && (n == 0 || n > MAX_CONCURRENCY_LIMIT)
            {
                return Err(TitoError::invalid_argument(format!(
                    "Limits::{name} is {n}; it must be from 1 to {MAX_CONCURRENCY_LIMIT} (to \
                     stop a queue, pause it)"
                )));
            }
        }
        if let Some(rate) = &self.rate {
            rate.check("rate")?;
        }
        if let Some(rate) = &self.key_rate {
            rate.check("key_rate")?;
        }
        Ok(())
    }
}

/// The limits as stored under `{queue}:limits`, with the highest slot counts ever set (a lowered
/// limit still counts the slots above it until their holders release them).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LimitsRecord {
    #[serde(flatten)]
    pub limits: Limits,
    #[serde(default)]
    pub queue_slots_seen: u32,
    #[serde(default)]
    pub key_slots_seen: u32,
}

impl LimitsRecord {
    fn active(&self) -> bool {
        !self.limits.is_none()
    }
}

/// Reads the stored limits (absent: none).
pub(crate) async fn read_limits<X: TitoTransaction>(
    tx: &X,
    root: &str,
) -> TitoResult<LimitsRecord> {
    decode_limits(root, tx.get(keys::limits_key(root).as_bytes()).await?)
}

/// The limits record as stored (absent: none).
fn decode_limits(root: &str, stored: Option<Vec<u8>>) -> TitoResult<LimitsRecord> {
    match stored {
        None => Ok(LimitsRecord::default()),
        Some(bytes) => serde_json::from_slice(&bytes).map_err(|err| {
            TitoError::Integrity(format!(
                "the limits of queue {:?} do not decode: {err}",
                keys::queue_name(root)
            ))
        }),
    }
}

impl<E: TitoEngine> Queue<E> {
    /// Stores the queue's limits (replacing the ones before): every worker of the queue, in
    /// every process, applies them within [`PAUSE_CHECK`](super::PAUSE_CHECK). `Limits::none()`
    /// lifts them. Refused with `InvalidArgument` when a limit is zero or too large, and with
    /// `NotFound` for a queue nothing was ever published to.
    pub async fn set_limits(&self, limits: Limits) -> TitoResult<()> {
        set_limits_under(&self.db, &self.root, limits).await
    }

    /// The queue's stored limits.
    pub async fn limits(&self) -> TitoResult<Limits> {
        limits_under(&self.db, &self.root).await
    }

    /// How close the queue is to its limits now (see [`LimitUsage`]).
    pub async fn limit_usage(&self) -> TitoResult<LimitUsage> {
        usage_under(&self.db, &self.root).await
    }
}

/// [`Queue::set_limits`] on the queue named `topic` (`None`: the default queue), for tools.
pub async fn set_limits<E: TitoEngine>(
    db: &E,
    topic: Option<&str>,
    limits: Limits,
) -> TitoResult<()> {
    set_limits_under(db, &keys::queue_root(topic), limits).await
}

/// [`Queue::limits`] on the queue named `topic`, for tools.
pub async fn limits<E: TitoEngine>(db: &E, topic: Option<&str>) -> TitoResult<Limits> {
    limits_under(db, &keys::queue_root(topic)).await
}

/// [`Queue::limit_usage`] on the queue named `topic`, for tools.
pub async fn limit_usage<E: TitoEngine>(db: &E, topic: Option<&str>) -> TitoResult<LimitUsage> {
    usage_under(db, &keys::queue_root(topic)).await
}

/// [`Limits::check`] with the queue named `topic` (`None`: the default queue) named in the
/// refusal, as [`set_limits`] refuses them: for tools that check an operator's input before
/// asking for confirmation.
pub fn check_limits(topic: Option<&str>, limits: &Limits) -> TitoResult<()> {
    limits
        .check()
        .map_err(|err| super::naming_queue(&keys::queue_root(topic), err))
}

async fn set_limits_under<E: TitoEngine>(db: &E, root: &str, limits: Limits) -> TitoResult<()> {
    limits
        .check()
        .map_err(|err| super::naming_queue(root, err))?;
    let root = root.to_string();
    let open = store_open(db);
    let before = db
        .transaction(|tx| {
            let (root, limits) = (root.clone(), limits.clone());
            async move {
                if super::stored_partition_count(&tx, &root).await?.is_none() {
                    return Err(TitoError::NotFound(format!(
                        "no queue {:?} (nothing was ever published to it)",
                        keys::queue_name(&root)
                    )));
                }
                let before = read_limits(&tx, &root).await.unwrap_or_default();
                // The slots counted from now on: up to the new limit, and above it only up to
                // the highest slot a live holder still has (so a lowered or lifted limit stops
                // reading slots nobody holds).
                let (queue_held, key_held) = held_slot_bounds(&tx, &root, open).await?;
                let record = LimitsRecord {
                    queue_slots_seen: queue_held.max(limits.concurrency.unwrap_or(0)),
                    key_slots_seen: key_held.max(limits.key_concurrency.unwrap_or(0)),
                    limits,
                };
                tx.put(
                    keys::limits_key(&root).into_bytes(),
                    serde_json::to_vec(&record)?,
                )
                .await?;
                Ok::<_, TitoError>(before.limits)
            }
        })
        .await?;
    tracing::info!(queue = %root, ?limits, "queue limits set");
    let unrated = limits.rate.is_none() && limits.key_rate.is_none();
    if before.rate != limits.rate || before.key_rate != limits.key_rate || unrated {
        // What the old rates moved follows the new ones. (Without rates, whatever is still
        // moved goes back: a restore that failed before, for one.)
        let restored = restore_moved(db, &root).await?;
        if restored > 0 {
            tracing::info!(queue = %root, restored, "rows a rate limit moved returned to their due time");
        }
    }
    Ok(())
}

/// One past the highest queue-wide and per-key slot index a live holder has (0: none).
async fn held_slot_bounds<X: TitoTransaction>(
    tx: &X,
    root: &str,
    open: Option<u64>,
) -> TitoResult<(u32, u32)> {
    let prefix = keys::slots_prefix(root);
    let all_prefix = format!("{prefix}all:");
    let slots: Vec<(String, Slot)> = super::scan_prefix(tx, &prefix)
        .await?
        .into_iter()
        .filter_map(|(key, value)| {
            let key = String::from_utf8(key).ok()?;
            Some((key, serde_json::from_slice::<Slot>(&value).ok()?))
        })
        .collect();
    let occupied: Vec<Slot> = slots.iter().map(|(_, slot)| slot.clone()).collect();
    let alive = Liveness::read(tx, root, open, None, &occupied).await?;
    let (mut queue_held, mut key_held) = (0u32, 0u32);
    for (key, slot) in &slots {
        if !alive.holds(slot) {
            continue;
        }
        // Every slot key ends with its index (`:{slot:04}`).
        let Some(index) = key.rsplit(':').next().and_then(|i| i.parse::<u32>().ok()) else {
            continue;
        };
        if key.starts_with(&all_prefix) {
            queue_held = queue_held.max(index + 1);
        } else {
            key_held = key_held.max(index + 1);
        }
    }
    Ok((queue_held, key_held))
}

async fn limits_under<E: TitoEngine>(db: &E, root: &str) -> TitoResult<Limits> {
    let root = root.to_string();
    engine::read_only(db, async |tx| Ok(read_limits(tx, &root).await?.limits)).await
}

/// How close a queue is to its limits at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LimitUsage {
    /// The limits.
    pub limits: Limits,
    /// Queue-wide concurrency slots held by live workers.
    pub running: u32,
    /// Business keys with at least one slot held, and how many each.
    pub running_by_key: BTreeMap<String, u32>,
    /// Starts counted by the queue-wide rate limit in its current interval.
    pub recent_starts: u32,
}

async fn usage_under<E: TitoEngine>(db: &E, root: &str) -> TitoResult<LimitUsage> {
    let root = root.to_string();
    let open = store_open(db);
    engine::read_only(db, async |tx| {
        let record = read_limits(tx, &root).await?;
        let prefix = keys::slots_prefix(&root);
        let mut usage = LimitUsage {
            limits: record.limits.clone(),
            ..LimitUsage::default()
        };
        let slots = super::scan_prefix(tx, &prefix).await?;
        let records: Vec<(Vec<u8>, Option<Slot>)> = slots
            .into_iter()
            .map(|(key, value)| (key, serde_json::from_slice(&value).ok()))
            .collect();
        let occupied: Vec<Slot> = records.iter().filter_map(|r| r.1.clone()).collect();
        let alive = Liveness::read(tx, &root, open, None, &occupied).await?;
        let all_prefix = format!("{prefix}all:");
        for (key, slot) in &records {
            let Some(slot) = slot else { continue };
            if !alive.holds(slot) {
                continue;
            }
            let text = keys::key_str(key).unwrap_or_default();
            if text.starts_with(&all_prefix) {
                usage.running += 1;
            } else if let Some(key) = &slot.key {
                *usage.running_by_key.entry(key.clone()).or_default() += 1;
            }
        }
        if let Some(rate) = &record.limits.rate {
            let now = engine::version_millis(tx.start_version());
            let log = read_log(tx, &keys::queue_rate_key(&root)).await?;
            usage.recent_starts = log.in_window(now, rate).len() as u32;
        }
        Ok(usage)
    })
    .await
}

/// A concurrency slot as stored: who holds it, for which invocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Slot {
    /// The holder: a standalone worker's id or a cluster node's id.
    pub holder: String,
    /// A cluster node's epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// The store open of the holder's process (embedded engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<u64>,
    /// The pending key of the invocation it runs.
    pub invocation: String,
    /// The business key (per-key slots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// When it was taken (engine time, Unix ms).
    pub at_ms: u64,
}

/// Who takes slots: a worker, as its slots name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub id: String,
    pub epoch: Option<u64>,
    pub open: Option<u64>,
}

impl Holder {
    fn is(&self, slot: &Slot) -> bool {
        slot.holder == self.id && slot.epoch == self.epoch && slot.open == self.open
    }
}

/// Which holders of some slots are alive, read in one batch at a transaction's start.
struct Liveness {
    open: Option<u64>,
    alive: HashSet<(String, Option<u64>)>,
    me: Option<Holder>,
}

impl Liveness {
    async fn read<X: TitoTransaction>(
        tx: &X,
        root: &str,
        open: Option<u64>,
        me: Option<&Holder>,
        slots: &[Slot],
    ) -> TitoResult<Liveness> {
        let mut wanted: Vec<(String, Option<u64>)> = Vec::new();
        for slot in slots {
            if me.is_some_and(|me| me.is(slot)) {
                continue;
            }
            if open.is_some() && slot.open.is_some() && slot.open != open {
                continue;
            }
            let who = (slot.holder.clone(), slot.epoch);
            if !wanted.contains(&who) {
                wanted.push(who);
            }
        }
        let reads: Vec<Vec<u8>> = wanted
            .iter()
            .map(|(holder, epoch)| match epoch {
                Some(_) => keys::node_key(root, holder).into_bytes(),
                None => keys::worker_heartbeat_key(root, holder).into_bytes(),
            })
            .collect();
        let values = if reads.is_empty() {
            Vec::new()
        } else {
            tx.batch_get(&reads).await?
        };
        let now = tx.start_version();
        let mut alive = HashSet::new();
        for ((holder, epoch), value) in wanted.into_iter().zip(values) {
            let Some(value) = value else { continue };
            let lives = match epoch {
                Some(epoch) => serde_json::from_slice::<super::lease::NodeRecord>(&value)
                    .is_ok_and(|node| node.epoch == epoch && node.expires > now),
                None => std::str::from_utf8(&value)
                    .ok()
                    .and_then(|text| text.parse::<u64>().ok())
                    .is_some_and(|expires| expires > now),
            };
            if lives {
                alive.insert((holder, epoch));
            }
        }
        Ok(Liveness {
            open,
            alive,
            me: me.cloned(),
        })
    }

    fn holds(&self, slot: &Slot) -> bool {
        if self.me.as_ref().is_some_and(|me| me.is(slot)) {
            return true;
        }
        if self.open.is_some() && slot.open.is_some() && slot.open != self.open {
            return false;
        }
        self.alive.contains(&(slot.holder.clone(), slot.epoch))
    }
}

/// This process's open of the store, when the engine proves one process per store (embedded).
pub(crate) fn store_open<E: TitoEngine>(db: &E) -> Option<u64> {
    db.extensions().get::<engine::ExclusiveOpen>().get()
}

/// A rate limit's log: the engine times (Unix ms) of its most recent starts, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct RateLog {
    starts: Vec<u64>,
}

impl RateLog {
    fn in_window(&self, now: u64, rate: &Rate) -> Vec<u64> {
        let from = now.saturating_sub(rate.per_ms());
        self.starts.iter().copied().filter(|t| *t > from).collect()
    }

    /// Whether one more start at `now` stays within `rate`.
    fn admits(&self, now: u64, rate: &Rate) -> bool {
        (self.in_window(now, rate).len() as u64) < u64::from(rate.starts)
    }

    /// When the `nth` (from 0) start refused now is expected to be admitted.
    fn turn(&self, now: u64, rate: &Rate, nth: u64) -> u64 {
        let window = self.in_window(now, rate);
        let starts = u64::from(rate.starts);
        if window.is_empty() {
            return now;
        }
        // The k-th start refused now waits for the (k mod S)-th start of the window to leave
        // it, k / S intervals later.
        let index = (nth % starts).min(window.len() as u64 - 1) as usize;
        window[index]
            .saturating_add(rate.per_ms().saturating_mul(1 + nth / starts))
            .max(now)
    }

    fn record(&mut self, now: u64, rate: &Rate) {
        self.starts = self.in_window(now, rate);
        self.starts.push(now);
        let keep = rate.starts as usize;
        if self.starts.len() > keep {
            self.starts.drain(..self.starts.len() - keep);
        }
    }
}

async fn read_log<X: TitoTransaction>(tx: &X, key: &str) -> TitoResult<RateLog> {
    Ok(tx
        .get(key.as_bytes())
        .await?
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default())
}

/// What the limits let a worker do with what a pull found.
#[derive(Debug, Default)]
pub(crate) struct Admitted {
    /// Invocations to start, with the slot keys they hold.
    pub start: Vec<(Pulled, Vec<Vec<u8>>)>,
    /// Invocations left waiting for a concurrency slot.
    pub waiting: usize,
    /// Those invocations.
    pub waited: Vec<Pulled>,
    /// Invocations moved to a later due time by a rate limit.
    pub moved: usize,
    /// The stored limits are not the ones the worker read: nothing was admitted; read them
    /// again before the next pull.
    pub stale: bool,
}

impl Admitted {
    /// Adds what another admission let through.
    pub fn merge(&mut self, other: Admitted) {
        self.start.extend(other.start);
        self.waiting += other.waiting;
        self.waited.extend(other.waited);
        self.moved += other.moved;
        self.stale |= other.stale;
    }
}

/// The limits as a worker applies them: the record, and whether anything is limited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gate {
    record: LimitsRecord,
}

impl Gate {
    pub fn new(record: LimitsRecord) -> Self {
        Gate { record }
    }

    /// Whether starts go through [`admit`].
    pub fn active(&self) -> bool {
        self.record.active()
    }

    pub fn limits(&self) -> &Limits {
        &self.record.limits
    }
}

/// In one transaction: takes concurrency slots and rate-log entries for what `pulled` holds, in
/// order, as far as the limits allow; moves what a rate limit refuses to its expected turn.
/// Rows that left the pending state since the pull are dropped.
pub(crate) async fn admit<E: TitoEngine>(
    queue: &Queue<E>,
    me: &Holder,
    gate: &Gate,
    pulled: Vec<Pulled>,
) -> TitoResult<Admitted> {
    if pulled.is_empty() {
        return Ok(Admitted::default());
    }
    let root = queue.root();
    let partitions = queue.config().partitions;
    let open = store_open(queue.engine());
    let record = &gate.record;
    let limits = &record.limits;
    let mut business: Vec<&str> = pulled.iter().map(|p| p.stored.key.as_str()).collect();
    business.sort_unstable();
    business.dedup();
    // Slot keys read: the queue's, then each key's, then the rate logs, then the rows.
    let queue_slots: Vec<Vec<u8>> = match limits.concurrency {
        Some(n) => (0..n.max(record.queue_slots_seen))
            .map(|i| keys::queue_slot_key(root, i).into_bytes())
            .collect(),
        None => Vec::new(),
    };
    let key_slots: Vec<(&str, Vec<Vec<u8>>)> = match limits.key_concurrency {
        Some(n) => business
            .iter()
            .map(|key| {
                let slots = (0..n.max(record.key_slots_seen))
                    .map(|i| keys::key_slot_key(root, key, i).into_bytes())
                    .collect();
                (*key, slots)
            })
            .collect(),
        None => Vec::new(),
    };
    let rate_keys: Vec<(Option<&str>, Vec<u8>)> = limits
        .rate
        .iter()
        .map(|_| (None, keys::queue_rate_key(root).into_bytes()))
        .chain(limits.key_rate.iter().flat_map(|_| {
            business
                .iter()
                .map(|key| (Some(*key), keys::key_rate_key(root, key).into_bytes()))
        }))
        .collect();
    // The limits record first: the gate applies only the limits stored now (it locks the
    // record, so limits set while it decides make it look again), never a stale reading.
    let limits_key = keys::limits_key(root).into_bytes();
    let mut reads: Vec<Vec<u8>> = vec![limits_key.clone()];
    reads.extend(queue_slots.iter().cloned());
    for (_, slots) in &key_slots {
        reads.extend(slots.iter().cloned());
    }
    reads.extend(rate_keys.iter().map(|(_, key)| key.clone()));
    reads.extend(pulled.iter().map(|p| p.key.clone().into_bytes()));
    let (reads, queue_slots, key_slots, rate_keys, pulled, limits_key) = (
        &reads,
        &queue_slots,
        &key_slots,
        &rate_keys,
        &pulled,
        &limits_key,
    );
    // A commit whose outcome is unknown is resolved, not guessed: slots written and never
    // used would stay held while this worker lives.
    let policy = queue.engine().retry_policy().resolving();
    queue
        .engine()
        .transaction_with(policy, |tx| async move {
            let now = engine::version_millis(tx.start_version());
            let mut values = tx.batch_get(reads).await?;
            let stored = decode_limits(root, values.remove(0))?;
            if stored != *record {
                return Ok(Admitted {
                    stale: true,
                    ..Admitted::default()
                });
            }
            tx.lock_keys(std::slice::from_ref(limits_key)).await?;
            let (mut queue_held, mut key_held, mut logs, rows) =
                split_reads(values, queue_slots.len(), key_slots, rate_keys.len());
            let mut occupied: Vec<Slot> = Vec::new();
            for slot in queue_held.iter().chain(key_held.iter().flatten()).flatten() {
                occupied.push(slot.clone());
            }
            let alive = Liveness::read(&tx, root, open, Some(me), &occupied).await?;
            // Slots above a lowered limit (or taken above it for invocations that ran before
            // it was set) stop being read once nobody alive holds one.
            let queue_shrinks = limits.concurrency.filter(|n| {
                record.queue_slots_seen > *n
                    && queue_held
                        .iter()
                        .skip(*n as usize)
                        .all(|slot| !matches!(slot, Some(slot) if alive.holds(slot)))
            });
            let key_shrinks = match limits.key_concurrency {
                Some(m) if record.key_slots_seen > m => {
                    let (_, key_top) = held_slot_bounds(&tx, root, open).await?;
                    (key_top < record.key_slots_seen).then_some(key_top.max(m))
                }
                _ => None,
            };
            if queue_shrinks.is_some() || key_shrinks.is_some() {
                // `stored` is the record this transaction read (and locked), equal to the
                // worker's: only its slot counts change.
                let mut shrunk = stored;
                if let Some(n) = queue_shrinks {
                    shrunk.queue_slots_seen = n;
                }
                if let Some(m) = key_shrinks {
                    shrunk.key_slots_seen = m;
                }
                tx.put(limits_key.clone(), serde_json::to_vec(&shrunk)?)
                    .await?;
            }
            let mut admitted = Admitted::default();
            // The rate logs an admitted start was recorded in (written back at the end).
            let mut touched = vec![false; rate_keys.len()];
            let mut refused_by_log: HashMap<usize, u64> = HashMap::new();
            for (item, present) in pulled.iter().zip(rows) {
                if !present {
                    continue;
                }
                let key = item.stored.key.as_str();
                let key_index = key_slots.iter().position(|(k, _)| *k == key);
                let queue_slot = match limits.concurrency {
                    Some(n) => match free_slot(&alive, &queue_held, n) {
                        Some(i) => Some(i),
                        None => {
                            admitted.waiting += 1;
                            admitted.waited.push(item.clone());
                            continue;
                        }
                    },
                    None => None,
                };
                let key_slot = match (limits.key_concurrency, key_index) {
                    (Some(n), Some(k)) => match free_slot(&alive, &key_held[k], n) {
                        Some(i) => Some((k, i)),
                        None => {
                            admitted.waiting += 1;
                            admitted.waited.push(item.clone());
                            continue;
                        }
                    },
                    _ => None,
                };
                // The rate logs this item counts in.
                let item_logs: Vec<(usize, Rate)> = rate_keys
                    .iter()
                    .enumerate()
                    .filter(|(_, (k, _))| k.is_none() || *k == Some(key))
                    .map(|(i, (k, _))| {
                        let rate = if k.is_none() {
                            limits.rate
                        } else {
                            limits.key_rate
                        };
                        (i, rate.expect("a rate log is read only for a set rate"))
                    })
                    .collect();
                let over: Vec<(usize, Rate)> = item_logs
                    .iter()
                    .copied()
                    .filter(|(i, rate)| !logs[*i].admits(now, rate))
                    .collect();
                if !over.is_empty() {
                    let turn = over
                        .iter()
                        .map(|(i, rate)| {
                            let nth = refused_by_log.entry(*i).or_default();
                            let at = logs[*i].turn(now, rate, *nth);
                            *nth += 1;
                            at
                        })
                        .max()
                        .unwrap_or(now);
                    postpone(&tx, root, partitions, item, turn).await?;
                    admitted.moved += 1;
                    continue;
                }
                for (i, rate) in &item_logs {
                    logs[*i].record(now, rate);
                    touched[*i] = true;
                }
                let mut held_keys = Vec::new();
                if let Some(i) = queue_slot {
                    let record = new_slot(me, &item.key, None, now);
                    tx.put(queue_slots[i].clone(), serde_json::to_vec(&record)?)
                        .await?;
                    queue_held[i] = Some(record);
                    held_keys.push(queue_slots[i].clone());
                }
                if let Some((k, i)) = key_slot {
                    let record = new_slot(me, &item.key, Some(key), now);
                    let slot_key = key_slots[k].1[i].clone();
                    tx.put(slot_key.clone(), serde_json::to_vec(&record)?)
                        .await?;
                    key_held[k][i] = Some(record);
                    held_keys.push(slot_key);
                }
                admitted.start.push((item.clone(), held_keys));
            }
            for (i, (_, key)) in rate_keys.iter().enumerate() {
                if touched[i] {
                    tx.put(key.clone(), serde_json::to_vec(&logs[i])?).await?;
                }
            }
            // The admission is the start's point of no return: a cancel (or an owner's
            // erasure, or a set-aside) that commits after this transaction read the rows makes
            // it conflict and replay, and the replay no longer finds them. So nothing whose
            // cancel committed before the admission starts.
            let admitted_rows: Vec<Vec<u8>> = admitted
                .start
                .iter()
                .map(|(item, _)| item.key.clone().into_bytes())
                .collect();
            if !admitted_rows.is_empty() {
                tx.lock_keys(&admitted_rows).await?;
            }
            // A row a rate limit moved that starts now is no longer waiting for its turn: a
            // limits change must not move it back under its running handler.
            for (item, _) in &admitted.start {
                if item.stored.moved_from.is_some() {
                    tx.delete(keys::moved_key(root, &item.stored.id).into_bytes())
                        .await?;
                }
            }
            Ok::<_, TitoError>(admitted)
        })
        .await
}

type SplitReads = (
    Vec<Option<Slot>>,
    Vec<Vec<Option<Slot>>>,
    Vec<RateLog>,
    Vec<bool>,
);

/// The gate's batched read, split: the queue's slots, each key's slots, the rate logs, and
/// whether each pulled row is still pending.
fn split_reads(
    values: Vec<Option<Vec<u8>>>,
    queue_slots: usize,
    key_slots: &[(&str, Vec<Vec<u8>>)],
    rate_logs: usize,
) -> SplitReads {
    let mut values = values.into_iter();
    let mut decode = |n: usize| -> Vec<Option<Slot>> {
        let mut out = Vec::with_capacity(n);
        for value in values.by_ref().take(n) {
            out.push(value.and_then(|bytes| serde_json::from_slice(&bytes).ok()));
        }
        out
    };
    let queue_held = decode(queue_slots);
    let mut key_held = Vec::with_capacity(key_slots.len());
    for (_, slots) in key_slots {
        key_held.push(decode(slots.len()));
    }
    let mut logs = Vec::with_capacity(rate_logs);
    for value in values.by_ref().take(rate_logs) {
        logs.push(
            value
                .and_then(|bytes| serde_json::from_slice(&bytes).ok())
                .unwrap_or_default(),
        );
    }
    let rows = values.map(|v| v.is_some()).collect();
    (queue_held, key_held, logs, rows)
}

/// The first free slot under `limit` (empty, or its holder gone), unless `limit` live slots
/// are held (a lowered limit counts the slots above it too).
fn free_slot(alive: &Liveness, slots: &[Option<Slot>], limit: u32) -> Option<usize> {
    let mut held = 0usize;
    for slot in slots.iter().flatten() {
        if alive.holds(slot) {
            held += 1;
        }
    }
    if held >= limit as usize {
        return None;
    }
    (0..(limit as usize).min(slots.len()))
        .find(|&i| !matches!(&slots[i], Some(slot) if alive.holds(slot)))
}

fn new_slot(me: &Holder, invocation: &str, key: Option<&str>, now: u64) -> Slot {
    Slot {
        holder: me.id.clone(),
        epoch: me.epoch,
        open: me.open,
        invocation: invocation.to_string(),
        key: key.map(str::to_string),
        at_ms: now,
    }
}

/// Moves a pending invocation to the whole second at or after `turn_ms` (never earlier than
/// its own due time): the row is replaced by the same invocation under its new due time, which
/// takes the event id over.
async fn postpone<X: TitoTransaction>(
    tx: &X,
    root: &str,
    partitions: u32,
    item: &Pulled,
    turn_ms: u64,
) -> TitoResult<()> {
    super::worker::remove_pending(tx, root, item).await?;
    let due = i64::try_from(turn_ms.div_ceil(1000)).unwrap_or(i64::MAX);
    let mut next = item.stored.clone();
    // Its own due time is kept, and the move recorded: when the limits change, the row
    // returns to it ([`restore_moved`]).
    next.moved_from = Some(item.stored.moved_from.unwrap_or(item.stored.timestamp));
    next.timestamp = next.timestamp.max(due);
    insert_pending(tx, root, partitions, &next, next.to_bytes()?).await?;
    tx.put(keys::moved_key(root, &next.id).into_bytes(), Vec::new())
        .await?;
    Ok(())
}

impl<E: TitoEngine> Queue<E> {
    /// One maintenance step: when the queue has no rate limit, rows a rate limit moved that are
    /// still ahead of their own due time go back to it (a limits change whose restore failed,
    /// for one). Returns how many.
    pub(crate) async fn restore_unrated(&self) -> TitoResult<usize> {
        let limits = self.limits().await?;
        if limits.rate.is_some() || limits.key_rate.is_some() {
            return Ok(0);
        }
        restore_moved(&self.db, &self.root).await
    }
}

/// How many moved rows one transaction of [`restore_moved`] returns.
const RESTORE_BATCH: usize = 256;

/// Returns every row a rate limit moved to its own due time (in batches of
/// [`RESTORE_BATCH`], each a transaction): after the limits changed, what the old limit
/// moved follows the new one (the gate moves it again if the new limit still refuses it).
/// Returns how many rows moved back.
async fn restore_moved<E: TitoEngine>(db: &E, root: &str) -> TitoResult<usize> {
    let wakeups = crate::event::nudge::wakeups(db, root);
    let prefix = keys::moved_prefix(root);
    let end = keys::prefix_end(prefix.clone());
    let root = root.to_string();
    let mut total = 0;
    loop {
        // The closure owns what it uses (no borrows), so `set_limits`'s future stays `Send`
        // for callers with a concrete engine.
        let (restored, more) = db
            .transaction(|tx| {
                let (root, prefix, end) = (root.clone(), prefix.clone(), end.clone());
                let wakeups = wakeups.clone();
                async move {
                    let root = root.as_str();
                    let partitions = super::stored_partition_count(&tx, root).await?.unwrap_or(1);
                    let marks = tx
                        .scan(prefix.as_bytes(), end.as_bytes(), RESTORE_BATCH)
                        .await?;
                    let mut restored = 0;
                    for (mark, _) in &marks {
                        let id = keys::key_str(mark)
                            .ok()
                            .and_then(|text| text.strip_prefix(prefix.as_str()))
                            .and_then(|encoded| keys::decode_str(encoded).ok());
                        let id_key = id.as_deref().map(|id| keys::event_id_key(root, id));
                        let target = match &id_key {
                            Some(id_key) => tx.get(id_key.as_bytes()).await?,
                            None => None,
                        };
                        let row = match &target {
                            Some(target) => tx.get(target).await?.map(|row| (target.clone(), row)),
                            None => None,
                        };
                        let moved = row.and_then(|(target, row)| {
                            let key = String::from_utf8(target).ok()?;
                            let parsed = keys::parse_pending_key(root, &key).ok()?;
                            let stored = crate::event::StoredEvent::parse(&row).ok()?;
                            stored.moved_from.map(|own| (key, parsed, stored, own))
                        });
                        let Some((key, parsed, stored, own)) = moved else {
                            // Completed or cancelled since: nothing to return. (A row that
                            // started lost its mark when the gate admitted it.)
                            tx.delete(mark.clone()).await?;
                            continue;
                        };
                        let item = Pulled {
                            key,
                            parsed,
                            stored,
                        };
                        super::worker::remove_pending(&tx, root, &item).await?;
                        let mut back = item.stored.clone();
                        back.timestamp = own;
                        back.moved_from = None;
                        insert_pending(&tx, root, partitions, &back, back.to_bytes()?).await?;
                        wakeups.wake_after_commit(&tx, item.parsed.partition);
                        restored += 1;
                    }
                    Ok::<_, TitoError>((restored, marks.len() == RESTORE_BATCH))
                }
            })
            .await?;
        total += restored;
        if !more {
            return Ok(total);
        }
    }
}

/// An invocation running without the slots the current limits ask for (it started before they
/// were set): its pending key, its business key, and whether it lacks a queue-wide slot and a
/// per-key slot.
pub(crate) struct Unslotted {
    pub invocation: String,
    pub key: String,
    pub queue: bool,
    pub per_key: bool,
}

/// Takes slots for invocations that started before a concurrency limit was set, in one
/// transaction, so the limit counts them: the first slots nobody alive holds, above the limit
/// when it is full (the record then counts slots up to the highest one taken, so gates read
/// them until they are released). Returns the slot keys taken per invocation.
pub(crate) async fn claim_running<E: TitoEngine>(
    queue: &Queue<E>,
    me: &Holder,
    running: &[Unslotted],
) -> TitoResult<Vec<(String, String, Vec<Vec<u8>>)>> {
    if running.is_empty() {
        return Ok(Vec::new());
    }
    let root = queue.root();
    let open = store_open(queue.engine());
    let policy = queue.engine().retry_policy().resolving();
    queue
        .engine()
        .transaction_with(policy, |tx| async move {
            let mut record = read_limits(&tx, root).await?;
            let seen_before = (record.queue_slots_seen, record.key_slots_seen);
            let limits = record.limits.clone();
            let needs_queue: Vec<&Unslotted> = running
                .iter()
                .filter(|r| r.queue && limits.concurrency.is_some())
                .collect();
            let needs_key: Vec<&Unslotted> = running
                .iter()
                .filter(|r| r.per_key && limits.key_concurrency.is_some())
                .collect();
            // Every slot that could be free for them: up to the counted ones plus one each.
            let queue_keys: Vec<Vec<u8>> = match limits.concurrency {
                Some(n) => (0..n.max(record.queue_slots_seen) + needs_queue.len() as u32)
                    .map(|i| keys::queue_slot_key(root, i).into_bytes())
                    .collect(),
                None => Vec::new(),
            };
            let mut business: Vec<&str> = needs_key.iter().map(|r| r.key.as_str()).collect();
            business.sort_unstable();
            business.dedup();
            let per_key_count = |key: &str| needs_key.iter().filter(|r| r.key == key).count();
            let key_keys: Vec<(&str, Vec<Vec<u8>>)> = match limits.key_concurrency {
                Some(m) => business
                    .iter()
                    .map(|key| {
                        let top = m.max(record.key_slots_seen) + per_key_count(key) as u32;
                        let slots = (0..top)
                            .map(|i| keys::key_slot_key(root, key, i).into_bytes())
                            .collect();
                        (*key, slots)
                    })
                    .collect(),
                None => Vec::new(),
            };
            let mut reads = queue_keys.clone();
            for (_, slots) in &key_keys {
                reads.extend(slots.iter().cloned());
            }
            let values = tx.batch_get(&reads).await?;
            let (mut queue_held, mut key_held, _, _) =
                split_reads(values, queue_keys.len(), &key_keys, 0);
            let occupied: Vec<Slot> = queue_held
                .iter()
                .chain(key_held.iter().flatten())
                .flatten()
                .cloned()
                .collect();
            let alive = Liveness::read(&tx, root, open, Some(me), &occupied).await?;
            let now = engine::version_millis(tx.start_version());
            let free = |held: &[Option<Slot>]| {
                held.iter()
                    .position(|slot| !matches!(slot, Some(slot) if alive.holds(slot)))
            };
            let mut taken: Vec<(String, String, Vec<Vec<u8>>)> = Vec::new();
            let mut take = |invocation: &str, key: &str, slot: Vec<u8>| match taken
                .iter_mut()
                .find(|(i, _, _)| i == invocation)
            {
                Some((_, _, slots)) => slots.push(slot),
                None => taken.push((invocation.to_string(), key.to_string(), vec![slot])),
            };
            for item in &needs_queue {
                let Some(i) = free(&queue_held) else { continue };
                let slot = new_slot(me, &item.invocation, None, now);
                tx.put(queue_keys[i].clone(), serde_json::to_vec(&slot)?)
                    .await?;
                queue_held[i] = Some(slot);
                record.queue_slots_seen = record.queue_slots_seen.max(i as u32 + 1);
                take(&item.invocation, &item.key, queue_keys[i].clone());
            }
            for item in &needs_key {
                let Some(k) = key_keys.iter().position(|(key, _)| *key == item.key) else {
                    continue;
                };
                let Some(i) = free(&key_held[k]) else {
                    continue;
                };
                let slot = new_slot(me, &item.invocation, Some(&item.key), now);
                let slot_key = key_keys[k].1[i].clone();
                tx.put(slot_key.clone(), serde_json::to_vec(&slot)?).await?;
                key_held[k][i] = Some(slot);
                record.key_slots_seen = record.key_slots_seen.max(i as u32 + 1);
                take(&item.invocation, &item.key, slot_key);
            }
            if (record.queue_slots_seen, record.key_slots_seen) != seen_before {
                tx.put(
                    keys::limits_key(root).into_bytes(),
                    serde_json::to_vec(&record)?,
                )
                .await?;
            }
            Ok::<_, TitoError>(taken)
        })
        .await
}

/// Releases slots `me` holds: each `(invocation, slot key)` is deleted if it still names `me`
/// and that invocation (one transaction). Returns what was settled (released, or no longer
/// ours).
pub(crate) async fn release_slots<E: TitoEngine>(
    queue: &Queue<E>,
    me: &Holder,
    slots: &[(String, Vec<u8>)],
) -> TitoResult<()> {
    if slots.is_empty() {
        return Ok(());
    }
    let reads: Vec<Vec<u8>> = slots.iter().map(|(_, key)| key.clone()).collect();
    let (reads, slots) = (&reads, slots);
    queue
        .engine()
        .transaction(|tx| async move {
            let values = tx.batch_get(reads).await?;
            for ((invocation, key), value) in slots.iter().zip(values) {
                let Some(slot) = value.and_then(|b| serde_json::from_slice::<Slot>(&b).ok()) else {
                    continue;
                };
                if me.is(&slot) && slot.invocation == *invocation {
                    tx.delete(key.clone()).await?;
                }
            }
            Ok::<_, TitoError>(())
        })
        .await
}

/// Deletes every slot naming `me` whose invocation is not in `keep` (slots a failed gate
/// transaction may have written). Reads the queue's slots in pages of 1024.
pub(crate) async fn sweep_orphan_slots<E: TitoEngine>(
    queue: &Queue<E>,
    me: &Holder,
    keep: &HashSet<String>,
) -> TitoResult<usize> {
    let prefix = &keys::slots_prefix(queue.root());
    queue
        .engine()
        .transaction(|tx| async move {
            let mut deleted = 0;
            for (key, value) in super::scan_prefix(&tx, prefix).await? {
                let Ok(slot) = serde_json::from_slice::<Slot>(&value) else {
                    continue;
                };
                if me.is(&slot) && !keep.contains(&slot.invocation) {
                    tx.delete(key).await?;
                    deleted += 1;
                }
            }
            Ok::<_, TitoError>(deleted)
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_print_exactly_and_parse_back() {
        for (ms, text) in [
            (1000, "1 s"),
            (1500, "1.5 s"),
            (60_000, "1 m"),
            (90_000, "1.5 m"),
            (3_601_000, "3601 s"),
            (86_400_000, "1 d"),
            (777_600_000, "9 d"),
            (250, "250 ms"),
            (1001, "1.001 s"),
        ] {
            let rate = Rate::new(10, Duration::from_millis(ms));
            assert_eq!(rate.to_string(), format!("10 per {text}"));
            assert_eq!(Rate::parse(&rate.to_string()).unwrap(), rate, "{text}");
        }
        for (text, ms) in [
            ("100/1m", 60_000),
            ("5/1s", 1000),
            ("10/1.5s", 1500),
            ("10 / 1500ms", 1500),
            ("3/0.25 h", 900_000),
            ("10 per 1.5 s", 1500),
        ] {
            assert_eq!(
                Rate::parse(text).unwrap().per,
                Duration::from_millis(ms),
                "{text}"
            );
        }
        for bad in [
            "100",
            "x/1s",
            "1/1w",
            "1/1.s",
            "1/.5s",
            "1/1.2.3s",
            "1/s",
            "1/1.0001s",
        ] {
            assert!(
                matches!(Rate::parse(bad), Err(TitoError::InvalidArgument(_))),
                "{bad}"
            );
        }
    }
}
