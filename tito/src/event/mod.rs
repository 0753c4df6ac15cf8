//! What is published: queue events, owners, handler outcomes, the stored form of an
//! invocation, the event a model write publishes, and (in [`publish`]) the planning of a
//! publication inside a transaction.
//!
//! This is the layer under both the model layer (whose writes publish their events here) and
//! the queue (whose publications and workers use it): a write never needs the queue's workers.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{TitoError, TitoResult};

pub(crate) mod links;
pub(crate) mod nudge;
pub(crate) mod publish;
pub(crate) mod readers;
pub(crate) mod wake;

/// The largest serialized invocation a queue accepts (1 MiB).
pub const MAX_QUEUE_EVENT_BYTES: usize = 1024 * 1024;

/// The longest owner kind or id, in bytes.
pub const MAX_OWNER_BYTES: usize = 512;

/// Who an event belongs to, for bounded erasure (`delete_by_owner_matching_in_tx`). Opaque to
/// Tito; kind and id are non-empty and at most [`MAX_OWNER_BYTES`] each.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QueueOwner {
    /// The owner's kind, such as `"user"`.
    pub kind: String,
    /// The owner's id.
    pub id: String,
}

impl QueueOwner {
    /// An owner.
    pub fn new(kind: impl Into<String>, id: impl Into<String>) -> Self {
        QueueOwner {
            kind: kind.into(),
            id: id.into(),
        }
    }

    pub(crate) fn check(&self) -> TitoResult<()> {
        for (what, value) in [("kind", &self.kind), ("id", &self.id)] {
            if value.is_empty() || value.len() > MAX_OWNER_BYTES {
                return Err(TitoError::invalid_argument(format!(
                    "a queue owner {what} must be 1 to {MAX_OWNER_BYTES} bytes, not {}",
                    value.len()
                )));
            }
        }
        Ok(())
    }
}

/// One event: a logical id, the business key that picks its partition, a payload, the Unix
/// second when it becomes runnable, and an optional owner.
///
/// # Due times
///
/// Workers compare due times with the store's clock (the time in its versions: the embedded
/// and SQLite stores' oracle, PD's timestamp oracle on TiKV), never with their host's, and a
/// due time relative to now is counted from that clock too: [`QueueEvent::now`],
/// [`QueueEvent::after`] and [`QueueEvent::retried_after`] record their delay, and publication
/// counts it from the publishing transaction's time. So an event published with a delay never
/// starts before that delay has passed on the store's clock, whatever the host's clock says
/// (a store whose clock runs ahead after a crash, a host whose clock is behind PD's).
/// `timestamp` holds this host's estimate until then; setting it yourself makes it the due
/// time. An absolute due time ([`QueueEvent::at`], [`QueueEvent::new`],
/// [`QueueEvent::rescheduled`], [`QueueEvent::advanced`]) is read on the store's clock, which
/// follows the wall clock (PD's may jump up to three seconds ahead of it after a leader change;
/// the embedded and SQLite stores wait out such a lead when they open after a crash, see
/// [`crate::backend::embedded`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueEvent<T> {
    /// The logical id; kept across [`QueueEvent::rescheduled`] replacements.
    pub id: String,
    /// The business key; events with one key share a partition.
    pub key: String,
    /// The application's data.
    pub payload: T,
    /// When the event becomes runnable, in Unix seconds (never negative).
    pub timestamp: i64,
    /// Who the event belongs to, if anyone.
    pub owner: Option<QueueOwner>,
    /// Which attempt this delivery is, from 1. A worker with a
    /// [`FailurePolicy`](crate::queue::FailurePolicy) counts failed attempts beside the row
    /// (never in the payload) and delivers the next one with this raised by one; without a
    /// policy a failure changes nothing, so every delivery is attempt 1. Ignored when
    /// publishing: an invocation starts at attempt 1.
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// From 0 (the default) to [`MAX_URGENCY`]: among due invocations of a partition, a
    /// higher urgency runs first; each step of urgency counts as [`URGENCY_STEP`] of
    /// waiting, so a less urgent one that waited longer than the difference is not passed over
    /// (see [`QueueEvent::with_urgency`]). Kept by replacements, retries and steps.
    ///
    /// Named so as not to be confused with an inbox's `#[tito(priority)]` role, a sort key of
    /// the user's rows where the lower value is claimed first.
    #[serde(default, alias = "priority")]
    pub urgency: u8,
    /// How many attempts this event gets (1 to [`MAX_ATTEMPTS`](crate::queue::MAX_ATTEMPTS)),
    /// whatever the worker's [`FailurePolicy`](crate::queue::FailurePolicy) says: a failure
    /// policy per kind of job on one queue (see [`QueueEvent::with_max_attempts`]). Kept by
    /// replacements and steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Set on delivery when the invocation is a step of a workflow
    /// ([`Workflow`](crate::queue::graph::Workflow)): which workflow and step, to read its
    /// dependencies' results with
    /// [`Graphs::dependency`](crate::queue::graph::Graphs::dependency). Ignored when
    /// publishing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<crate::event::links::StepOf>,
    /// Set on delivery when the invocation is a child of a batch
    /// ([`Batch`](crate::queue::graph::Batch)): the batch's id. Ignored when publishing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    /// Set by the constructors of a due time relative to now ([`QueueEvent::now`],
    /// [`QueueEvent::after`], [`QueueEvent::retried_after`]): the delay, counted at
    /// publication from the store's clock (see "Due times" on [`QueueEvent`]). Opaque: it
    /// goes along in struct update syntax (`QueueEvent { payload, ..event }`), and a struct
    /// literal that names every field writes `relative: RelativeDue::default()` (the due time
    /// is then `timestamp`, as given).
    #[serde(skip)]
    pub relative: RelativeDue,
}

/// A due time given as a delay from now, as [`QueueEvent::now`], [`QueueEvent::after`] and
/// [`QueueEvent::retried_after`] record it in [`QueueEvent::relative`]: `timestamp` as this
/// host's clock estimated it, and the delay. At publication the delay is counted from the
/// publishing transaction's time (the store's clock, the one workers compare due times with),
/// unless the caller changed `timestamp` since: then the time it set is the due time. The
/// default is none (the due time is `timestamp`). Never stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelativeDue(Option<Relative>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Relative {
    estimate: i64,
    delay_ms: u64,
}

/// The highest urgency.
pub const MAX_URGENCY: u8 = 9;

/// The former name of [`MAX_URGENCY`].
#[deprecated(
    note = "renamed MAX_URGENCY (higher runs first; an inbox's priority runs lower first)"
)]
pub const MAX_PRIORITY: u8 = MAX_URGENCY;

/// The most attempts a [`FailurePolicy`](crate::queue::FailurePolicy) or an event's own
/// [`max_attempts`](QueueEvent::max_attempts) accepts.
pub const MAX_ATTEMPTS: u32 = 10_000;

/// How much waiting one step of urgency is worth.
pub const URGENCY_STEP: std::time::Duration = std::time::Duration::from_secs(60);

/// The former name of [`URGENCY_STEP`].
#[deprecated(note = "renamed URGENCY_STEP")]
pub const PRIORITY_STEP: std::time::Duration = URGENCY_STEP;

/// The whole second an event due `delay_ms` after the moment `now_ms` (Unix milliseconds) is
/// due at: rounded up, so it never comes before the delay is over; an event due now is due at
/// the moment's own second (rounded down: due already, not a fraction of a second later).
fn due_second(now_ms: i64, delay_ms: u64) -> i64 {
    if delay_ms == 0 {
        return now_ms.div_euclid(1000);
    }
    let ms = now_ms.saturating_add(i64::try_from(delay_ms).unwrap_or(i64::MAX));
    ms.div_euclid(1000) + i64::from(ms.rem_euclid(1000) > 0)
}

fn first_attempt() -> u32 {
    1
}

static ID_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new, unique logical id: the time, a process counter and a random number.
pub(crate) fn new_event_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    let count = ID_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(nanos);
    hasher.write_u64(count);
    format!("{nanos:016x}{count:08x}{:016x}", hasher.finish())
}

impl<T> QueueEvent<T> {
    /// An event with a fresh logical id, due at `timestamp` (Unix seconds). For "now", "at" and
    /// "in" there are [`QueueEvent::now`], [`QueueEvent::at`] and [`QueueEvent::after`].
    pub fn new(key: impl Into<String>, payload: T, timestamp: i64) -> Self {
        QueueEvent {
            id: new_event_id(),
            key: key.into(),
            payload,
            timestamp,
            owner: None,
            attempt: 1,
            urgency: 0,
            max_attempts: None,
            workflow: None,
            batch: None,
            relative: RelativeDue(None),
        }
    }

    /// This event due `delay` after its publication on the store's clock (its `timestamp` this
    /// host's estimate of that, whole seconds rounded up).
    fn due_in(mut self, delay: std::time::Duration) -> Self {
        let now_ms = chrono::Utc::now().timestamp_millis();
        let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.timestamp = due_second(now_ms, delay_ms);
        self.relative = RelativeDue(Some(Relative {
            estimate: self.timestamp,
            delay_ms,
        }));
        self
    }

    /// The delay from publication when the due time is still the one a relative constructor
    /// set (the caller did not set `timestamp` since).
    pub(crate) fn delay_ms(&self) -> Option<u64> {
        self.relative
            .0
            .filter(|r| r.estimate == self.timestamp)
            .map(|r| r.delay_ms)
    }

    /// An event due now, with a fresh logical id: at its publication, on the store's clock
    /// (`timestamp` holds this host's clock in whole seconds until then; see "Due times").
    ///
    /// ```
    /// use tito::QueueEvent;
    ///
    /// let event = QueueEvent::now("user:1", "welcome");
    /// assert!((event.timestamp - chrono::Utc::now().timestamp()).abs() <= 1);
    /// ```
    pub fn now(key: impl Into<String>, payload: T) -> Self {
        QueueEvent::new(key, payload, 0).due_in(std::time::Duration::ZERO)
    }

    /// An event due at `when` (its whole second: a fraction rounds up, so it never runs early).
    ///
    /// ```
    /// use chrono::{TimeZone, Utc};
    /// use tito::QueueEvent;
    ///
    /// let when = Utc.with_ymd_and_hms(2030, 1, 1, 9, 0, 0).unwrap();
    /// let event = QueueEvent::at("report:2030", "yearly report", when);
    /// assert_eq!(event.timestamp, when.timestamp());
    /// ```
    pub fn at(key: impl Into<String>, payload: T, when: chrono::DateTime<chrono::Utc>) -> Self {
        let secs = when.timestamp();
        let due = if when.timestamp_subsec_nanos() > 0 {
            secs.saturating_add(1)
        } else {
            secs
        };
        QueueEvent::new(key, payload, due)
    }

    /// An event due `delay` after its publication, on the store's clock (a fraction of a second
    /// rounds up; `timestamp` holds this host's estimate until then; see "Due times").
    ///
    /// ```
    /// use std::time::Duration;
    /// use tito::QueueEvent;
    ///
    /// let event = QueueEvent::after("user:1", "reminder", Duration::from_secs(3600));
    /// assert!(event.timestamp >= chrono::Utc::now().timestamp() + 3599);
    /// ```
    pub fn after(key: impl Into<String>, payload: T, delay: std::time::Duration) -> Self {
        QueueEvent::new(key, payload, 0).due_in(delay)
    }

    /// The same event with this logical id (for idempotent publication).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// The same event with an urgency, from 0 (the default) to [`MAX_URGENCY`] (a higher one
    /// is refused at publication). Higher runs first.
    ///
    /// The rule: pending rows are ordered by their due time less `urgency` ×
    /// [`URGENCY_STEP`] (one minute), so among due invocations of a partition an urgency-9
    /// one runs before an urgency-0 one that became due less than nine minutes earlier, and
    /// after one that has waited longer (rows ordered at the same second run in the order they
    /// were enqueued). A less urgent invocation therefore never waits more than
    /// [`MAX_URGENCY`] minutes behind more urgent ones that keep arriving (ageing). An
    /// invocation never runs before its own due time, whatever its urgency.
    ///
    /// ```
    /// use tito::queue::QueueEvent;
    ///
    /// let reset = QueueEvent::now("user:7", "reset").with_urgency(9);
    /// assert_eq!(reset.urgency, 9);
    /// ```
    pub fn with_urgency(mut self, urgency: u8) -> Self {
        self.urgency = urgency;
        self
    }

    /// The former name of [`Self::with_urgency`].
    #[deprecated(
        note = "renamed with_urgency: higher runs first, unlike an inbox's #[tito(priority)] role, where lower is claimed first"
    )]
    pub fn with_priority(self, urgency: u8) -> Self {
        self.with_urgency(urgency)
    }

    /// The same event with its own number of attempts: its failures are counted and it goes to
    /// the dead state after `attempts` of them, with the worker's failure policy's backoff (or
    /// the default one, `FailurePolicy::new(attempts)`, on a worker without a policy). For
    /// jobs of different kinds on one queue: a password reset tried ten times, a newsletter
    /// twice. Refused at publication outside 1 to [`MAX_ATTEMPTS`](crate::queue::MAX_ATTEMPTS).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// The same event with an owner.
    pub fn with_owner(mut self, owner: QueueOwner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The replacement of this event for `Reschedule`: the same id, key, owner and payload,
    /// runnable at `timestamp`.
    pub fn rescheduled(self, timestamp: i64) -> Self {
        QueueEvent {
            timestamp,
            relative: RelativeDue(None),
            ..self
        }
    }

    /// The next step of this event for `Advance`: the same id, key and owner, with `payload`,
    /// runnable at `timestamp`.
    ///
    /// ```
    /// use tito::{QueueEvent, QueueHandlerOutcome};
    ///
    /// #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    /// enum Signup { SendWelcome, SendTips { day: u32 } }
    ///
    /// let event = QueueEvent::new("user-1", Signup::SendWelcome, 1_700_000_000);
    /// let next = event.clone().advanced(Signup::SendTips { day: 1 }, event.timestamp + 86_400);
    /// assert_eq!((next.id.as_str(), next.key.as_str()), (event.id.as_str(), "user-1"));
    /// let outcome = QueueHandlerOutcome::Advance(next);
    /// # let _ = outcome;
    /// ```
    pub fn advanced(self, payload: T, timestamp: i64) -> Self {
        QueueEvent {
            payload,
            timestamp,
            relative: RelativeDue(None),
            ..self
        }
    }

    /// The replacement of this event, runnable `backoff` after the outcome's commit on the
    /// store's clock (a fraction of a second rounds up), for a handler that retries on its own
    /// terms with `Reschedule` (a worker's [`FailurePolicy`](crate::queue::FailurePolicy)
    /// retries failed attempts by itself).
    pub fn retried_after(self, backoff: std::time::Duration) -> Self {
        self.due_in(backoff)
    }
}

/// What a handler decided about one invocation.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum QueueHandlerOutcome<T> {
    /// Done: the invocation moves to completed.
    Acknowledge,
    /// Done, with a result kept on the completed row for whoever awaits it
    /// ([`Queue::await_result`](crate::Queue::await_result)) until retention deletes the row.
    /// Build it with [`QueueHandlerOutcome::acknowledge_with`].
    AcknowledgeWith(HandlerResult),
    /// Done, and the replacement (same id, key, owner and payload; see
    /// [`QueueEvent::rescheduled`]) is inserted in the same transaction.
    Reschedule(QueueEvent<T>),
    /// Done with this step: the invocation moves to completed (its history), and the next step
    /// of the same logical event is inserted in the same transaction: the same id, key and
    /// owner, a new payload and due time (see [`QueueEvent::advanced`]), starting again at
    /// attempt 1. For multi-step jobs: each step's payload says where the job is.
    Advance(QueueEvent<T>),
}

/// The most bytes a handler's result takes as JSON: a larger one is refused by
/// [`QueueHandlerOutcome::acknowledge_with`].
pub const MAX_RESULT_BYTES: usize = 64 * 1024;

/// The deepest nesting of arrays and objects an event's payload or a handler's result may have:
/// rows are read back with JSON's usual recursion limit (128 levels, the row's own included),
/// so deeper values are refused when they are given rather than stored unreadable.
pub const MAX_JSON_DEPTH: usize = 64;

/// How deeply `value` nests arrays and objects (a scalar is 0). Iterative: any depth is counted.
fn json_depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        match value {
            Value::Array(items) => stack.extend(items.iter().map(|item| (item, depth + 1))),
            Value::Object(fields) => stack.extend(fields.values().map(|field| (field, depth + 1))),
            _ => continue,
        }
        deepest = deepest.max(depth + 1);
    }
    deepest
}

/// Refuses `value` when it nests deeper than [`MAX_JSON_DEPTH`]; `what` names it in the error.
fn check_json_depth(value: &Value, what: impl std::fmt::Display) -> TitoResult<()> {
    let depth = json_depth(value);
    if depth > MAX_JSON_DEPTH {
        return Err(TitoError::invalid_argument(format!(
            "{what} nests {depth} levels of arrays and objects; at most {MAX_JSON_DEPTH} are kept \
             (a stored row must read back): flatten it"
        )));
    }
    Ok(())
}

/// A handler's result as stored: JSON of at most [`MAX_RESULT_BYTES`] and [`MAX_JSON_DEPTH`]
/// levels.
#[derive(Clone, Debug, PartialEq)]
pub struct HandlerResult(pub(crate) Value);

/// A result on a completed row: wrapped, so that a result of JSON `null` (`()`, `None`) reads
/// back as a result, not as none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredResult {
    pub value: Value,
}

impl<T> QueueHandlerOutcome<T> {
    /// Done, with `result` kept on the completed row (serialized as JSON; JSON holds no NaN or
    /// infinity, which are kept as `null`). Refused with [`TitoError::InvalidArgument`] when it
    /// takes more than [`MAX_RESULT_BYTES`] (keep a large result in a model or a kv key of your
    /// own and return its key) or nests deeper than [`MAX_JSON_DEPTH`]. A handler that returns
    /// the error (`acknowledge_with(&r)?`) makes a failed attempt of it.
    pub fn acknowledge_with<R: Serialize>(result: &R) -> TitoResult<Self> {
        let value = serde_json::to_value(result)?;
        check_json_depth(&value, "a handler's result")?;
        let bytes = serde_json::to_vec(&value)?.len();
        if bytes > MAX_RESULT_BYTES {
            return Err(TitoError::invalid_argument(format!(
                "a handler's result takes {bytes} bytes as JSON; at most {MAX_RESULT_BYTES} are \
                 kept: store a large result in a model or kv key of your own and return its key"
            )));
        }
        Ok(QueueHandlerOutcome::AcknowledgeWith(HandlerResult(value)))
    }
}

/// What a handler returns. An `Err` leaves the invocation pending, unchanged.
pub type QueueHandlerResult<T> = Result<QueueHandlerOutcome<T>, TitoError>;

/// The partition of a business key: FNV-1a (64-bit) of its UTF-8 bytes, modulo the partition
/// count. Stable across processes, platforms and Rust releases.
pub fn partition_for(key: &str, partitions: u32) -> u32 {
    (crate::keys::fnv1a(key.as_bytes()) % u64::from(partitions.max(1))) as u32
}

/// An invocation as stored in a pending or completed row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredEvent {
    pub id: String,
    pub key: String,
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<QueueOwner>,
    pub payload: Value,
    /// Set on completed rows: the version of the completing transaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processed_at: Option<u64>,
    /// Failed attempts so far, counted by workers with a failure policy.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: u32,
    /// The last failure's error, under a failure policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Set on dead rows: the version of the transaction that moved it there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_at: Option<u64>,
    /// Set on completed rows of cancelled invocations: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled: Option<String>,
    /// A completed row's handler result ([`QueueHandlerOutcome::AcknowledgeWith`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StoredResult>,
    /// The urgency (0 by default), stored under its former name.
    #[serde(default, skip_serializing_if = "is_zero_u8", rename = "priority")]
    pub urgency: u8,
    /// Set while a rate limit has moved the row past its own due time: that due time (the row
    /// returns to it when the limits change).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_from: Option<i64>,
    /// The event's own number of attempts ([`QueueEvent::max_attempts`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// A workflow step's link: its workflow, its name, and while it waits what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<crate::event::links::StepLink>,
    /// A batch child's link: its batch and the shard its completion counts in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<crate::event::links::BatchLink>,
    /// Before publication only: the due time is this delay after the publishing transaction's
    /// time ([`QueueEvent::delay_ms`]), set by [`StoredEvent::settle_due`].
    #[serde(skip)]
    pub due_in_ms: Option<u64>,
}

fn is_zero_u8(n: &u8) -> bool {
    *n == 0
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl StoredEvent {
    /// Checks an event and turns it into its stored form. Nothing is written on error.
    pub fn from_event<T: Serialize>(event: &QueueEvent<T>) -> TitoResult<StoredEvent> {
        if event.timestamp < 0 {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} has a negative timestamp {}",
                event.id, event.timestamp
            )));
        }
        if event.id.is_empty() {
            return Err(TitoError::invalid_argument("an event id is empty"));
        }
        if let Some(owner) = &event.owner {
            owner.check()?;
        }
        if let Some(attempts) = event.max_attempts
            && (attempts == 0 || attempts > MAX_ATTEMPTS)
        {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} has max_attempts {attempts}; it must be from 1 to {}",
                event.id, MAX_ATTEMPTS
            )));
        }
        if event.urgency > MAX_URGENCY {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} has urgency {}; urgencies go from 0 to {MAX_URGENCY}",
                event.id, event.urgency
            )));
        }
        Ok(StoredEvent {
            id: event.id.clone(),
            key: event.key.clone(),
            timestamp: event.timestamp,
            owner: event.owner.clone(),
            payload: {
                let payload = serde_json::to_value(&event.payload)?;
                check_json_depth(&payload, format_args!("event {:?}'s payload", event.id))?;
                payload
            },
            processed_at: None,
            failures: 0,
            last_error: None,
            dead_at: None,
            cancelled: None,
            result: None,
            urgency: event.urgency,
            moved_from: None,
            max_attempts: event.max_attempts,
            step: None,
            batch: None,
            due_in_ms: event.delay_ms(),
        })
    }

    /// The due time the row is ordered by: its own, less [`URGENCY_STEP`] per step of
    /// urgency. Due times in the first [`MAX_URGENCY`] steps after the Unix epoch (a "due long
    /// ago" such as 0) are ordered as the end of that span, so the boost never reaches below
    /// zero and urgencies order them like any other (among themselves, such rows keep their
    /// publication order).
    pub fn ordered_at(&self) -> u64 {
        let span = u64::from(MAX_URGENCY) * URGENCY_STEP.as_secs();
        let boost = u64::from(self.urgency) * URGENCY_STEP.as_secs();
        (self.timestamp.max(0) as u64).max(span) - boost
    }

    /// This event with a due time relative to its publication counted from `start_version`
    /// (the publishing transaction's time, the store's clock), or `None` when its due time is
    /// absolute.
    pub fn settle_due(&self, start_version: u64) -> Option<StoredEvent> {
        let delay_ms = self.due_in_ms?;
        let now_ms =
            i64::try_from(crate::engine::version_millis(start_version)).unwrap_or(i64::MAX);
        Some(StoredEvent {
            timestamp: due_second(now_ms, delay_ms),
            due_in_ms: None,
            ..self.clone()
        })
    }

    /// The bytes of the row, refused when over [`MAX_QUEUE_EVENT_BYTES`].
    pub fn to_bytes(&self) -> TitoResult<Vec<u8>> {
        let bytes = serde_json::to_vec(self)?;
        if bytes.len() > MAX_QUEUE_EVENT_BYTES {
            return Err(TitoError::invalid_argument(format!(
                "event {:?} is {} bytes serialized, over MAX_QUEUE_EVENT_BYTES ({MAX_QUEUE_EVENT_BYTES})",
                self.id,
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// A stored row's value, or an integrity error.
    pub fn parse(bytes: &[u8]) -> TitoResult<StoredEvent> {
        serde_json::from_slice(bytes)
            .map_err(|err| TitoError::Integrity(format!("queue row is not an invocation: {err}")))
    }

    pub fn typed<T: DeserializeOwned>(&self) -> TitoResult<QueueEvent<T>> {
        self.typed_from(self.payload.clone())
    }

    /// [`Self::typed`] with `payload` in place of the stored one (a model event's row read in
    /// a newer shape).
    pub fn typed_from<T: DeserializeOwned>(&self, payload: Value) -> TitoResult<QueueEvent<T>> {
        Ok(QueueEvent {
            id: self.id.clone(),
            key: self.key.clone(),
            payload: serde_json::from_value(payload)?,
            timestamp: self.timestamp,
            owner: self.owner.clone(),
            attempt: self.failures.saturating_add(1),
            urgency: self.urgency,
            max_attempts: self.max_attempts,
            workflow: self.step.as_ref().map(|link| crate::event::links::StepOf {
                workflow: link.workflow.clone(),
                step: link.step.clone(),
            }),
            batch: self.batch.as_ref().map(|link| link.id.clone()),
            relative: RelativeDue(None),
        })
    }
}

/// The write an event reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum TitoOperation {
    /// A new row.
    Insert,
    /// A changed row.
    Update,
    /// A row written whether or not it existed.
    Upsert,
    /// A removed row.
    Delete,
}

/// The event a model write publishes when its options ask for events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelEvent<T> {
    /// The write.
    pub operation: TitoOperation,
    /// The model's table.
    pub table: String,
    /// The row's id.
    pub id: String,
    /// The row as written (for a delete: as it was stored). A delete of a row written by an
    /// older shape of the model, which no longer decodes as the model, carries that row as
    /// stored too: a handler typed `ModelEvent<Model>` cannot decode it (the worker counts it
    /// as undecodable and leaves it to operators); one typed `ModelEvent<serde_json::Value>`
    /// reads it. Such a delete's events are due at the delete's time.
    pub row: T,
    /// The shape version `row` is in ([`crate::model::shape`]; 1, the default, is left out of
    /// the stored event). A worker whose process has a model of the table with a newer shape
    /// reads an older row through that model's conversions before its handler sees it.
    #[serde(default = "first_shape", skip_serializing_if = "is_first_shape")]
    pub shape: u32,
}

fn first_shape() -> u32 {
    1
}

fn is_first_shape(shape: &u32) -> bool {
    *shape == 1
}

/// A queue's name and the type of its events' payloads, in one value: a queue opened from it
/// ([`Topic::queue`](crate::queue::Topic::queue)) publishes only `QueueEvent<T>` and its workers
/// take only handlers of `QueueEvent<T>`, so the name, the publisher and the handler cannot
/// disagree.
///
/// `#[derive(TitoModel)]` generates one per declared event, as an associated constant named
/// after the event: `#[tito(event = "user_created")]` on `User` gives
/// `User::USER_CREATED_EVENT: Topic<ModelEvent<User>>` (made with [`Topic::model_events`]).
/// For events published by hand, declare one: `const EMAILS: Topic<Email> =
/// Topic::new("emails");`.
pub struct Topic<T> {
    name: &'static str,
    model_events: bool,
    payload: std::marker::PhantomData<fn() -> T>,
}

impl<T> Topic<T> {
    /// The queue named `name`, carrying payloads of type `T`.
    pub const fn new(name: &'static str) -> Self {
        Topic {
            name,
            model_events: false,
            payload: std::marker::PhantomData,
        }
    }

    /// The queue's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// Whether a model's writes publish to this queue ([`Topic::model_events`]): they do so
    /// with the store's partition count, so the queue must be declared with it.
    pub const fn receives_model_events(&self) -> bool {
        self.model_events
    }
}

impl<M> Topic<ModelEvent<M>> {
    /// The queue named `name` that a model's writes publish their [`ModelEvent`]s to (the
    /// derive's `{NAME}_EVENT` constants are made with it; use it for a model whose `events()`
    /// is written by hand). Writes publish with the store's partition count
    /// ([`TitoEngine::partitions`](crate::engine::TitoEngine::partitions)), so opening the
    /// queue with another count is refused.
    pub const fn model_events(name: &'static str) -> Self {
        Topic {
            name,
            model_events: true,
            payload: std::marker::PhantomData,
        }
    }
}

impl<T> Clone for Topic<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Topic<T> {}

impl<T> std::fmt::Debug for Topic<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topic")
            .field("name", &self.name)
            .field("model_events", &self.model_events)
            .field("payload", &std::any::type_name::<T>())
            .finish()
    }
}

/// What a publication did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// The event id of the invocation `key` names: the published event's, or for a duplicate
    /// by unique key the holder's (`collided_id`). Await its end with
    /// [`Queue::await_result`](crate::Queue::await_result).
    pub id: String,
    /// The storage key of the event's invocation: the new pending row, or, for a duplicate,
    /// the live invocation (pending or completed) that already holds the event id.
    pub key: String,
    /// Whether the event id already had a live invocation, or (for
    /// [`Queue::publish_unique`](crate::Queue::publish_unique)) its unique key was held, so
    /// nothing was written.
    pub duplicate: bool,
    /// For a duplicate by unique key: the id of the event that holds the key (`key` is its
    /// invocation).
    pub collided_id: Option<String>,
}

impl Published {
    pub(crate) fn new(id: String, key: String) -> Self {
        Published {
            id,
            key,
            duplicate: false,
            collided_id: None,
        }
    }

    pub(crate) fn duplicate_of(id: String, key: String) -> Self {
        Published {
            id,
            key,
            duplicate: true,
            collided_id: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Defect 10: queue rows decode or are refused, never panic.
        #[test]
        fn queue_rows_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            if let Ok(stored) = StoredEvent::parse(&bytes) {
                let _ = stored.typed::<u32>();
            }
        }
    }

    #[test]
    fn partitions_are_pinned() {
        // Test vectors: changing the hash would move every pending event of a deployed queue.
        assert_eq!(
            partition_for("", 1024),
            (0xcbf2_9ce4_8422_2325u64 % 1024) as u32
        );
        assert_eq!(partition_for("user:123", 4), partition_for("user:123", 4));
        let vectors = [
            ("a", 0xaf63_dc4c_8601_ec8cu64),
            ("foobar", 0x85944171f73967e8),
        ];
        for (key, hash) in vectors {
            assert_eq!(
                partition_for(key, u32::MAX),
                (hash % u64::from(u32::MAX)) as u32,
                "{key}"
            );
        }
    }

    #[test]
    fn due_times_round_up_to_their_second() {
        use chrono::TimeZone;
        let before = chrono::Utc::now().timestamp();
        let now = QueueEvent::now("k", 1u8);
        assert!(now.timestamp >= before && now.timestamp <= chrono::Utc::now().timestamp());
        let whole = chrono::Utc.timestamp_opt(1_800_000_000, 0).unwrap();
        assert_eq!(QueueEvent::at("k", 1u8, whole).timestamp, 1_800_000_000);
        let fraction = chrono::Utc.timestamp_opt(1_800_000_000, 1).unwrap();
        assert_eq!(QueueEvent::at("k", 1u8, fraction).timestamp, 1_800_000_001);
        let start_ms = chrono::Utc::now().timestamp_millis();
        let later = QueueEvent::after("k", 1u8, std::time::Duration::from_millis(1500));
        // Never before the delay is over: at or after start + 1.5 s, rounded up.
        assert!(later.timestamp * 1000 >= start_ms + 1500, "{later:?}");
        assert!(later.timestamp * 1000 <= chrono::Utc::now().timestamp_millis() + 2500);
        // A delay too large to represent saturates instead of wrapping.
        let far = QueueEvent::after("k", 1u8, std::time::Duration::MAX);
        assert!(far.timestamp > 0);
        // Distinct events get distinct ids.
        assert_ne!(QueueEvent::now("k", 1u8).id, QueueEvent::now("k", 1u8).id);
    }

    #[test]
    #[allow(deprecated)]
    fn the_former_priority_names_still_work() {
        let event = QueueEvent::now("k", 0u8).with_priority(4);
        assert_eq!(event.urgency, 4);
        assert_eq!((MAX_PRIORITY, PRIORITY_STEP), (MAX_URGENCY, URGENCY_STEP));
        // A row stored before the rename, and one stored after, read the same urgency.
        let stored = StoredEvent::from_event(&event).unwrap();
        let json = serde_json::to_value(&stored).unwrap();
        assert_eq!(json["priority"], 4, "{json}");
        let back: StoredEvent = serde_json::from_value(json).unwrap();
        assert_eq!(back.urgency, 4);
        let delivered: QueueEvent<u8> = serde_json::from_value(serde_json::json!({
            "id": "e", "key": "k", "payload": 0, "timestamp": 0, "priority": 7
        }))
        .unwrap();
        assert_eq!(delivered.urgency, 7);
        let over = QueueEvent::now("k", 0u8).with_urgency(MAX_URGENCY + 1);
        let err = StoredEvent::from_event(&over).unwrap_err().to_string();
        assert!(
            err.contains("urgency 10; urgencies go from 0 to 9"),
            "{err}"
        );
    }

    #[test]
    fn the_ordering_time_keeps_urgencies_near_the_epoch() {
        let stored = |timestamp: i64, urgency: u8| StoredEvent {
            timestamp,
            urgency,
            ..StoredEvent::from_event(&QueueEvent::new("k", 0u8, 0)).unwrap()
        };
        assert_eq!(stored(0, 9).ordered_at(), 0);
        assert_eq!(stored(0, 0).ordered_at(), 540);
        assert_eq!(stored(200, 9).ordered_at(), 0);
        assert!(stored(0, 5).ordered_at() < stored(100, 0).ordered_at());
        // Away from the epoch, nothing changes: due time less a minute per step.
        assert_eq!(stored(1_800_000_000, 3).ordered_at(), 1_800_000_000 - 180);
        assert_eq!(stored(1_800_000_000, 0).ordered_at(), 1_800_000_000);
    }

    #[test]
    fn events_are_checked() {
        assert!(StoredEvent::from_event(&QueueEvent::new("k", 1, -1)).is_err());
        let owner = QueueOwner::new("", "1");
        assert!(StoredEvent::from_event(&QueueEvent::new("k", 1, 0).with_owner(owner)).is_err());
        let owner = QueueOwner::new("u", "x".repeat(513));
        assert!(StoredEvent::from_event(&QueueEvent::new("k", 1, 0).with_owner(owner)).is_err());
        let big =
            StoredEvent::from_event(&QueueEvent::new("k", "x".repeat(MAX_QUEUE_EVENT_BYTES), 0))
                .unwrap();
        assert!(big.to_bytes().is_err());
        let event = QueueEvent::new("k", 5, 10).with_owner(QueueOwner::new("u", "1"));
        let again = event.clone().rescheduled(20);
        assert_eq!(
            (
                again.id.as_str(),
                again.key.as_str(),
                again.payload,
                again.timestamp
            ),
            (event.id.as_str(), "k", 5, 20)
        );
        assert_ne!(new_event_id(), new_event_id());
    }
}
