//! Inbox: a model whose rows are the queue. The service's own records (email jobs, webhooks to
//! deliver) are claimed, leased and completed in place, with their indexes, transactions and
//! events; Tito creates nothing the model did not declare.
//!
//! The model names which fields play which role ([`InboxSpec`], by hand or with the derive's
//! `#[tito(inbox)]` and field roles). Every role but the id is optional, and each rule applies
//! only where its role exists:
//!
//! | role | type | meaning |
//! |---|---|---|
//! | `group` | `String` | the queue the row belongs to (a subscription serves one group) |
//! | `priority` | integer | claim order: lower first |
//! | `retry_after` | `i64`, Unix ms | not claimable before it (a delayed job); 0 means now |
//! | `attempt` | integer | counts claims; at `max_attempts` the row is dead-lettered |
//! | `processed_at` | `Option<i64>`, Unix ms | set by `Ack`; a processed row is never claimed |
//! | `locked_until` | `Option<i64>`, Unix ms | the lease: set by a claim, extended while the handler runs (without it, the lease lives in a key of its own, `inbox-lease:{table}:{id}`) |
//! | `partition_key` | `String` | delivered with the row |
//! | `headers` | string map | delivered as a `BTreeMap<String, String>` |
//! | `payload` | any | what the handler receives, decoded; without it, the whole row |
//!
//! Claims walk the model's claim index (`{table}_inbox_claim` over group, priority and
//! retry_after, holding only unprocessed rows) in claim order: priority, then retry_after, then
//! id. A claim, its lease extensions and its outcome are model updates (or, without a
//! `locked_until` role, writes of the row's lease key), so a lost lease cannot apply an outcome
//! and two workers never claim one row, whatever roles the model declares. Rows that do not
//! deserialize are reported and set aside under `inbox-bad:{table}:{id}`, outside every model's
//! key range, so they never block the rows behind them, claims, or scans of the table.
//!
//! A claim reads at most [`CLAIM_SCANS`] scans of [`CLAIM_SCAN_ROWS`] rows. When it reaches
//! that bound without filling its request (many processed or leased rows ahead), the next claim
//! continues where it stopped instead of starting over, and wraps to the start at the end: every
//! ready row is reached, with bounded work per claim.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::task::JoinSet;

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self, KeyValue};
use crate::model::{
    TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModel, TitoModelTrait, TitoOptions,
};
use crate::runtime::Shutdown;
use crate::telemetry::names;
use tracing::Instrument;

/// Which fields of a model play which inbox role. Build with [`InboxSpec::new`] and the setters
/// (each takes the field's name in the row's JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxSpec {
    /// The group field.
    pub group: Option<String>,
    /// The priority field.
    pub priority: Option<String>,
    /// The partition key field.
    pub partition_key: Option<String>,
    /// The retry-after field (Unix ms).
    pub retry_after: Option<String>,
    /// The attempt counter field.
    pub attempt: Option<String>,
    /// The processed-at field (Unix ms or null).
    pub processed_at: Option<String>,
    /// The lease field (Unix ms or null).
    pub locked_until: Option<String>,
    /// The headers field (a string map).
    pub headers: Option<String>,
    /// The payload field.
    pub payload: Option<String>,
}

macro_rules! role_setters {
    ($($role:ident),*) => {$(
        #[doc = concat!("Names the `", stringify!($role), "` field.")]
        pub fn $role(mut self, field: &str) -> Self {
            self.$role = Some(field.to_string());
            self
        }
    )*};
}

impl InboxSpec {
    /// No roles but the id.
    pub fn new() -> Self {
        InboxSpec::default()
    }

    role_setters!(
        group,
        priority,
        partition_key,
        retry_after,
        attempt,
        processed_at,
        locked_until,
        headers,
        payload
    );

    /// The name of the claim index of `table`.
    pub fn claim_index_name(table: &str) -> String {
        format!("{table}_inbox_claim")
    }

    /// The claim index a model with these roles must declare in `indexes()`: group, priority and
    /// retry_after (those that exist), holding only unprocessed rows. `processed` is whether
    /// this row is processed. `None` when no ordering role exists (claims then walk the table in
    /// id order, its primary index).
    pub fn claim_index(&self, table: &str, processed: bool) -> Option<TitoIndexConfig> {
        let mut fields = Vec::new();
        if let Some(group) = &self.group {
            fields.push(TitoIndexField {
                name: group.clone(),
                r#type: TitoIndexBlockType::String,
            });
        }
        if let Some(priority) = &self.priority {
            fields.push(TitoIndexField {
                name: priority.clone(),
                r#type: TitoIndexBlockType::Integer,
            });
        }
        if let Some(retry_after) = &self.retry_after {
            fields.push(TitoIndexField {
                name: retry_after.clone(),
                r#type: TitoIndexBlockType::Integer,
            });
        }
        (!fields.is_empty()).then(|| TitoIndexConfig {
            condition: !processed,
            name: Self::claim_index_name(table),
            fields,
        })
    }
}

/// A model whose rows are an inbox. `#[derive(TitoModel)]` with `#[tito(inbox)]` implements it;
/// by hand, return the spec and declare [`InboxSpec::claim_index`] in `indexes()`.
pub trait InboxModel: TitoModelTrait {
    /// The roles of the model's fields.
    fn inbox_spec() -> InboxSpec;
}

/// What happened to a delivered row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxOutcome {
    /// Done: `processed_at` is set (without that role, the row is deleted).
    Ack,
    /// Deleted.
    Drop,
    /// Ready again now.
    Retry,
    /// Ready again after this long. Needs a `retry_after` role: on a model without one, a
    /// nonzero delay is refused ([`Inbox::complete`] returns [`TitoError::InvalidArgument`],
    /// `run_inbox` logs it at error level and the row is claimable again when its lease ends).
    /// A delay beyond what Unix milliseconds in an `i64` can hold saturates to "never".
    RetryAfter(Duration),
}

/// Writes a dead-lettered row into another model, inside the claim's transaction.
pub type DeadLetterWriter<E, M> = Arc<
    dyn Fn(M, <E as TitoEngine>::Transaction) -> BoxFuture<'static, TitoResult<()>> + Send + Sync,
>;

/// Where rows go when their attempts run out.
#[derive(Clone)]
pub enum DeadLetter<E: TitoEngine, M> {
    /// Into another group of the same model.
    Group(String),
    /// Into another model: the callback writes it inside the transaction; the row is deleted.
    Model(DeadLetterWriter<E, M>),
}

/// Where "now" comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InboxClock {
    /// The host's clock.
    #[default]
    Host,
    /// The engine's clock (the time in its versions; TSO physical time on TiKV).
    Engine,
}

/// How a subscription runs. Build with [`InboxConfig::new`] and the setters.
#[non_exhaustive]
pub struct InboxConfig<E: TitoEngine, M> {
    /// The group served (ignored when the model has no group role).
    pub group: String,
    /// Handlers in flight at once.
    pub concurrency: usize,
    /// How long a claim holds a row; extended every third of it while the handler runs.
    pub lease: Duration,
    /// Claims at which a row is dead-lettered instead of delivered (with an attempt role).
    pub max_attempts: u64,
    /// Where dead letters go; `None` leaves rows at the limit in place (reported).
    pub dead_letter: Option<DeadLetter<E, M>>,
    /// Where "now" comes from.
    pub clock: InboxClock,
    /// The longest pause between claims when nothing is ready.
    pub max_idle: Duration,
}

impl<E: TitoEngine, M> InboxConfig<E, M> {
    /// A subscription to `group`: 8 handlers, 30 s leases, 5 attempts, no dead letter, host clock.
    pub fn new(group: impl Into<String>) -> Self {
        InboxConfig {
            group: group.into(),
            concurrency: 8,
            lease: Duration::from_secs(30),
            max_attempts: 5,
            dead_letter: None,
            clock: InboxClock::Host,
            max_idle: Duration::from_secs(1),
        }
    }

    /// Handlers in flight at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The lease length.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Claims before dead-lettering.
    pub fn max_attempts(mut self, attempts: u64) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Where dead letters go.
    pub fn dead_letter(mut self, dead_letter: DeadLetter<E, M>) -> Self {
        self.dead_letter = Some(dead_letter);
        self
    }

    /// Where "now" comes from.
    pub fn clock(mut self, clock: InboxClock) -> Self {
        self.clock = clock;
        self
    }

    /// The longest idle pause.
    pub fn max_idle(mut self, pause: Duration) -> Self {
        self.max_idle = pause;
        self
    }

    /// Checks the settings: a lease of at least [`MIN_INBOX_LEASE`] (it is extended every third
    /// of it), at least one handler and one attempt, a nonzero idle pause, and no duration over
    /// [`MAX_SETTING`](crate::queue::MAX_SETTING). `claim`, `extend`
    /// and `run_inbox` refuse a configuration that fails it with
    /// [`TitoError::InvalidArgument`] naming the setting, before anything is written.
    pub fn check(&self) -> TitoResult<()> {
        let bad = |what: String| Err(TitoError::invalid_argument(what));
        let longest = crate::queue::MAX_SETTING;
        if self.lease < MIN_INBOX_LEASE || self.lease > longest {
            return bad(format!(
                "InboxConfig::lease is {:?}; it must be between {MIN_INBOX_LEASE:?} and {longest:?}",
                self.lease
            ));
        }
        if self.max_idle > longest {
            return bad(format!(
                "InboxConfig::max_idle is {:?}, over {longest:?}",
                self.max_idle
            ));
        }
        if self.concurrency == 0 {
            return bad("InboxConfig::concurrency is zero".into());
        }
        if self.max_attempts == 0 {
            return bad("InboxConfig::max_attempts is zero".into());
        }
        if self.max_idle.is_zero() {
            return bad("InboxConfig::max_idle is zero".into());
        }
        Ok(())
    }
}

/// One delivered row.
#[derive(Clone, Debug, PartialEq)]
pub struct InboxDelivery<P> {
    /// The row's id.
    pub id: String,
    /// The payload (or the whole row, without a payload role).
    pub payload: P,
    /// The headers (empty without that role).
    pub headers: BTreeMap<String, String>,
    /// Which claim this is (1 for the first), when the model counts attempts.
    pub attempt: u64,
    /// The row's partition key, when it has one.
    pub partition_key: Option<String>,
}

crate::counters::counters! {
    /// The counters of one inbox handle and its subscriptions, as plain numbers at one moment
    /// ([`Inbox::stats`]).
    pub struct InboxStats / InboxCounters {
        /// Rows claimed and handed to the handler.
        claimed,
        /// Outcomes applied.
        completed,
        /// Handler errors, panics and timeouts (the row is claimable again after its lease).
        failed,
        /// Outcomes refused because the lease was lost.
        lease_lost,
        /// Rows moved to the dead letter.
        dead_lettered,
        /// Rows set aside because they do not deserialize.
        bad,
    }
}

/// The (model, group) subscriptions of one store in this process, on the store's handle
/// ([`TitoEngine::extensions`]).
#[derive(Default)]
struct Subscriptions(Mutex<HashSet<String>>);

/// The registration of one (model, group) subscription of a store in this process.
struct Subscription(Arc<Subscriptions>, String);

impl Subscription {
    fn take(subscriptions: Arc<Subscriptions>, name: String) -> TitoResult<Subscription> {
        let fresh = crate::util::lock(&subscriptions.0).insert(name.clone());
        if !fresh {
            return Err(TitoError::AlreadySubscribed(name));
        }
        Ok(Subscription(subscriptions, name))
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        crate::util::lock(&self.0.0).remove(&self.1);
    }
}

fn host_now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn field_i64(row: &Value, field: &Option<String>) -> Option<i64> {
    field
        .as_ref()
        .and_then(|f| row.get(f))
        .and_then(Value::as_i64)
}

fn set(row: &mut Value, field: &Option<String>, value: Value) {
    if let (Some(field), Some(object)) = (field, row.as_object_mut()) {
        object.insert(field.clone(), value);
    }
}

/// The state of an inbox row, as operator tools show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InboxRowState {
    /// Claimable now.
    Ready,
    /// Not claimable before its `retry_after`.
    Delayed,
    /// Claimed; its lease has not run out.
    Leased,
    /// Done (`processed_at` set).
    Processed,
}

/// Counts of one group's rows by state ([`Inbox::counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct InboxCounts {
    /// Claimable now.
    pub ready: u64,
    /// Waiting for their retry time.
    pub delayed: u64,
    /// Under a live lease.
    pub leased: u64,
    /// Processed (kept by models with a `processed_at` role).
    pub processed: u64,
    /// Rows of the table read (all groups).
    pub scanned: u64,
    /// Whether the count stopped at its bound with rows left.
    pub more: bool,
    /// Rows set aside because they do not decode (all groups).
    pub bad: crate::inspect::Count,
}

/// One row of an inbox scan ([`Inbox::scan`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct InboxRow {
    /// The row's id.
    pub id: String,
    /// Its state now.
    pub state: InboxRowState,
    /// Its claims so far (with an `attempt` role).
    pub attempt: Option<i64>,
    /// Not claimable before (Unix ms; with a `retry_after` role).
    pub retry_after: Option<i64>,
    /// Its lease's end (Unix ms), if it has one (not read for processed rows).
    pub locked_until: Option<i64>,
    /// When it was processed (Unix ms; with a `processed_at` role).
    pub processed_at: Option<i64>,
    /// The whole row.
    pub row: Value,
}

/// A claimed row: its id and the lease it holds (what [`Inbox::complete`] checks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxClaim {
    id: String,
    locked_until: Option<i64>,
    attempt: Option<i64>,
}

/// An inbox over model `M` on engine `E`.
pub struct Inbox<E, M> {
    db: E,
    models: TitoModel<E, M>,
    spec: InboxSpec,
    table: String,
    stats: Arc<InboxCounters>,
    /// Per group: where the next claim continues after one that stopped at its scan bound.
    resume: Mutex<HashMap<String, Vec<u8>>>,
    _model: PhantomData<fn() -> M>,
}

/// The scans one claim reads at most.
pub const CLAIM_SCANS: usize = 16;

/// The rows one claim scan reads.
pub const CLAIM_SCAN_ROWS: usize = 64;

/// The shortest inbox lease accepted.
pub const MIN_INBOX_LEASE: Duration = Duration::from_millis(30);

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

impl<E: TitoEngine, M: InboxModel> Inbox<E, M> {
    /// The inbox of `M`. Checks that the model declares its claim index, with copies of the
    /// rows as its entries.
    pub fn new(db: E) -> TitoResult<Self> {
        let spec = M::inbox_spec();
        let sample = M::default();
        let table = sample.table();
        if let Some(expected) = spec.claim_index(&table, false) {
            let declared = sample
                .indexes()
                .into_iter()
                .find(|i| i.name == expected.name);
            if declared.as_ref().map(|i| &i.fields) != Some(&expected.fields) {
                return Err(TitoError::invalid_argument(format!(
                    "model {table:?} must declare its inbox claim index {:?} (InboxSpec::claim_index) in indexes()",
                    expected.name
                )));
            }
            // Claims read rows from the claim index's entries.
            if sample.key_only_indexes().contains(&expected.name) {
                return Err(TitoError::invalid_argument(format!(
                    "the inbox claim index {:?} of model {table:?} must hold copies of the rows, \
                     not only keys (remove it from key_only_indexes())",
                    expected.name
                )));
            }
        }
        Ok(Inbox {
            models: TitoModel::new(db.clone()),
            db,
            spec,
            table,
            stats: Arc::default(),
            resume: Mutex::default(),
            _model: PhantomData,
        })
    }

    /// The counters of this handle and its subscriptions, as plain numbers now.
    pub fn stats(&self) -> InboxStats {
        self.stats.snapshot()
    }

    /// Adds one to an inbox metric of `group` (with an `outcome` label when given).
    fn record(&self, metric: &'static str, group: &str, outcome: Option<&'static str>) {
        let (table, group) = (self.table.clone(), group.to_string());
        match outcome {
            Some(outcome) => {
                metrics::counter!(metric, "table" => table, "group" => group, "outcome" => outcome)
                    .increment(1)
            }
            None => metrics::counter!(metric, "table" => table, "group" => group).increment(1),
        }
    }

    async fn now_ms(&self, tx: &E::Transaction, clock: InboxClock) -> i64 {
        match clock {
            InboxClock::Host => host_now_ms(),
            InboxClock::Engine => engine::version_millis(tx.start_version()) as i64,
        }
    }

    fn bad_key(&self, id: &str) -> String {
        keys::inbox_bad_key(&self.table, id)
    }

    /// The lease a row is under (its end, Unix ms): the `locked_until` field, or without that
    /// role the row's lease key.
    async fn lease_of(
        &self,
        tx: &E::Transaction,
        id: &str,
        row: &Value,
    ) -> TitoResult<Option<i64>> {
        if self.spec.locked_until.is_some() {
            return Ok(field_i64(row, &self.spec.locked_until));
        }
        let key = keys::inbox_lease_key(&self.table, id);
        Ok(tx
            .get(key.as_bytes())
            .await?
            .and_then(|bytes| std::str::from_utf8(&bytes).ok()?.parse().ok()))
    }

    /// Sets (or, with `None`, clears) a row's lease: in the row (written by the caller's model
    /// update) or in its lease key.
    async fn set_lease(
        &self,
        tx: &E::Transaction,
        id: &str,
        row: &mut Value,
        until: Option<i64>,
    ) -> TitoResult<()> {
        if self.spec.locked_until.is_some() {
            set(
                row,
                &self.spec.locked_until,
                until.map_or(Value::Null, Value::from),
            );
            return Ok(());
        }
        let key = keys::inbox_lease_key(&self.table, id).into_bytes();
        match until {
            Some(until) => tx.put(key, until.to_string().into_bytes()).await,
            None => tx.delete(key).await,
        }
    }

    /// The ids of rows set aside because they do not deserialize.
    pub async fn bad_rows(&self) -> TitoResult<Vec<String>> {
        let prefix = keys::inbox_bad_prefix(&self.table);
        let end = keys::prefix_end(prefix.clone());
        crate::engine::read_only(&self.db, async |tx| {
            let rows = tx
                .scan(prefix.as_bytes(), end.as_bytes(), engine::MAX_SCAN_LIMIT)
                .await?;
            rows.iter()
                .map(|(k, _)| keys::decode_str(&keys::key_str(k)?[prefix.len()..]))
                .collect()
        })
        .await
    }

    /// The state of a row now (host clock), from its roles, and its lease's end (not read for
    /// a processed row: `None`).
    async fn state_of(
        &self,
        tx: &E::Transaction,
        id: &str,
        row: &Value,
        now: i64,
    ) -> TitoResult<(InboxRowState, Option<i64>)> {
        if field_i64(row, &self.spec.processed_at).is_some() {
            return Ok((InboxRowState::Processed, None));
        }
        let lease = self.lease_of(tx, id, row).await?;
        let state = if lease.is_some_and(|until| until > now) {
            InboxRowState::Leased
        } else if field_i64(row, &self.spec.retry_after).is_some_and(|at| at > now) {
            InboxRowState::Delayed
        } else {
            InboxRowState::Ready
        };
        Ok((state, lease))
    }

    /// A stored row's id and JSON, when it is JSON and belongs to `group`.
    fn group_row(&self, key: &[u8], value: &[u8], group: &str) -> Option<(String, Value)> {
        let row = serde_json::from_slice::<Value>(value).ok()?;
        let in_group = match &self.spec.group {
            Some(field) => row.get(field).and_then(Value::as_str) == Some(group),
            None => true,
        };
        if !in_group {
            return None;
        }
        let id = keys::row_key_id(&String::from_utf8_lossy(key), &self.table).unwrap_or_default();
        Some((id, row))
    }

    /// Counts the rows of `group` by state (host clock), reading at most
    /// [`COUNT_BOUND`](crate::inspect::COUNT_BOUND) rows of the table (all groups): past that,
    /// [`InboxCounts::more`] is set and the counts cover the rows read. Rows set aside as bad
    /// are counted apart (all groups). For operator tools.
    pub async fn counts(&self, group: &str) -> TitoResult<InboxCounts> {
        let prefix = keys::table_prefix(&self.table);
        let end = keys::prefix_end(prefix.clone());
        let bound = crate::inspect::COUNT_BOUND as usize;
        let now = host_now_ms();
        let mut counts = crate::engine::read_only(&self.db, async |tx| {
            let mut counts = InboxCounts::default();
            let mut start = prefix.clone().into_bytes();
            while counts.scanned < bound as u64 {
                let want = 1000.min(bound - counts.scanned as usize);
                let rows = tx.scan(&start, end.as_bytes(), want).await?;
                for (key, value) in &rows {
                    counts.scanned += 1;
                    let Some((id, row)) = self.group_row(key, value, group) else {
                        continue;
                    };
                    match self.state_of(tx, &id, &row, now).await?.0 {
                        InboxRowState::Ready => counts.ready += 1,
                        InboxRowState::Delayed => counts.delayed += 1,
                        InboxRowState::Leased => counts.leased += 1,
                        InboxRowState::Processed => counts.processed += 1,
                    }
                }
                match rows.last() {
                    Some((key, _)) if rows.len() == want => start = keys::key_after_bytes(key),
                    _ => return Ok(counts),
                }
            }
            counts.more = !tx.scan(&start, end.as_bytes(), 1).await?.is_empty();
            Ok(counts)
        })
        .await?;
        counts.bad =
            crate::inspect::count_prefix(&self.db, &keys::inbox_bad_prefix(&self.table), 10_000)
                .await?;
        Ok(counts)
    }

    /// A page of the rows of `group` (in id order), only those in `state` when given, with
    /// their roles. Reads at most 10 × `limit` rows of the table (`limit` 1 to
    /// [`MAX_PAGE_LIMIT`](crate::model::MAX_PAGE_LIMIT)); a page may hold fewer rows than
    /// `limit` and still have a cursor (it stopped at that bound). For operator tools.
    pub async fn scan(
        &self,
        group: &str,
        state: Option<InboxRowState>,
        cursor: Option<&str>,
        limit: usize,
    ) -> TitoResult<crate::TitoPage<InboxRow>> {
        if limit == 0 || limit > crate::model::MAX_PAGE_LIMIT {
            return Err(TitoError::invalid_argument(format!(
                "an inbox page holds 1 to {} rows, got {limit}",
                crate::model::MAX_PAGE_LIMIT
            )));
        }
        let prefix = keys::table_prefix(&self.table);
        let mut end = keys::prefix_end(prefix.clone()).into_bytes();
        let mut start = prefix.clone().into_bytes();
        crate::model::query::narrow_to_cursor(&mut start, &mut end, false, cursor)?;
        let budget = limit * 10;
        let now = host_now_ms();
        crate::engine::read_only(&self.db, async |tx| {
            let rows = tx.scan(&start, &end, budget).await?;
            let full = rows.len() == budget;
            let mut items = Vec::new();
            let mut last = None;
            for (key, value) in &rows {
                last = Some(key.clone());
                let Some((id, row)) = self.group_row(key, value, group) else {
                    continue;
                };
                let (row_state, lease) = self.state_of(tx, &id, &row, now).await?;
                if state.is_some_and(|wanted| wanted != row_state) {
                    continue;
                }
                items.push(InboxRow {
                    attempt: field_i64(&row, &self.spec.attempt),
                    retry_after: field_i64(&row, &self.spec.retry_after),
                    locked_until: lease,
                    processed_at: field_i64(&row, &self.spec.processed_at),
                    id,
                    state: row_state,
                    row,
                });
                if items.len() == limit {
                    break;
                }
            }
            let stopped_early = items.len() == limit && last.as_ref() != rows.last().map(|r| &r.0);
            let cursor = if full || stopped_early {
                last.map(|k| crate::model::query::encode_cursor(&k))
            } else {
                None
            };
            Ok(crate::TitoPage { items, cursor })
        })
        .await
    }

    /// Moves a row into `group` as a fresh job: attempts 0, no delay, no lease, not processed
    /// (the roles the model has). For moving a dead-lettered row back (dead letters into a
    /// group). A missing row is [`TitoError::NotFound`].
    pub async fn requeue(&self, id: &str, group: &str) -> TitoResult<()> {
        let (id, group) = (id.to_string(), group.to_string());
        self.db
            .transaction(|tx| {
                let (id, group) = (id.clone(), group.clone());
                async move {
                    let model = self.models.find_by_id_tx(&id, &tx).await?;
                    let mut row = serde_json::to_value(&model)?;
                    set(&mut row, &self.spec.group, Value::from(group));
                    set(&mut row, &self.spec.attempt, Value::from(0));
                    set(&mut row, &self.spec.retry_after, Value::from(0));
                    set(&mut row, &self.spec.processed_at, Value::Null);
                    self.set_lease(&tx, &id, &mut row, None).await?;
                    let model: M = serde_json::from_value(row)?;
                    self.models
                        .update_with_options(model, TitoOptions::default(), &tx)
                        .await?;
                    tracing::info!(table = %self.table, id, "inbox row requeued");
                    Ok(())
                }
            })
            .await
    }

    /// The table this inbox reads.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The roles of the inbox's model.
    pub fn spec(&self) -> &InboxSpec {
        &self.spec
    }

    /// Claims up to `n` ready rows of `config.group` in one transaction (replayed on conflicts,
    /// so two claimers never take one row). Dead-letters rows whose attempts ran out. The
    /// building block of [`run_inbox`], for custom workers.
    pub async fn claim<P: DeserializeOwned + Send>(
        &self,
        config: &InboxConfig<E, M>,
        n: usize,
    ) -> TitoResult<Vec<(InboxClaim, InboxDelivery<P>)>> {
        // A claim whose outcome is unknown is resolved: applied, its rows are handed out now
        // instead of waiting out a lease nobody works under.
        self.db
            .transaction_with(self.db.retry_policy().resolving(), |tx| async move {
                self.claim_tx::<P>(config, n, &tx).await
            })
            .await
    }

    /// The claim index prefix of `group` (when the model has a group role) and, when given, one
    /// priority within it; `None` without a claim index.
    fn claim_prefix(&self, group: &str, priority: Option<i64>) -> TitoResult<Option<String>> {
        let Some(index) = self.spec.claim_index(&self.table, false) else {
            return Ok(None);
        };
        let group_value = KeyValue::String(group.to_string());
        let priority_value = priority.map(KeyValue::I64);
        let mut bound: Vec<(&str, &KeyValue)> = Vec::new();
        if let Some(field) = &self.spec.group {
            bound.push((field.as_str(), &group_value));
        }
        if let (Some(field), Some(value)) = (&self.spec.priority, &priority_value) {
            bound.push((field.as_str(), value));
        }
        keys::index_prefix(&self.table, &index.name, &bound).map(Some)
    }

    async fn claim_tx<P: DeserializeOwned + Send>(
        &self,
        config: &InboxConfig<E, M>,
        n: usize,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<(InboxClaim, InboxDelivery<P>)>> {
        config.check()?;
        let now = self.now_ms(tx, config.clock).await;
        let spec = &self.spec;
        let prefix = self
            .claim_prefix(&config.group, None)?
            .unwrap_or_else(|| keys::table_prefix(&self.table));
        let end = keys::prefix_end(prefix.clone()).into_bytes();
        let first = prefix.into_bytes();
        let resumed = crate::util::lock(&self.resume)
            .remove(&config.group)
            .filter(|at| *at >= first && *at < end);
        let mut start = resumed.clone().unwrap_or_else(|| first.clone());
        let mut wrapped = resumed.is_none();
        let mut claimed = Vec::new();
        let mut bounded = true;
        // Bounded: at most CLAIM_SCANS scans of CLAIM_SCAN_ROWS rows per claim.
        for _ in 0..CLAIM_SCANS {
            if claimed.len() >= n {
                bounded = false;
                break;
            }
            let rows = tx.scan(&start, &end, CLAIM_SCAN_ROWS).await?;
            let exhausted = rows.len() < CLAIM_SCAN_ROWS;
            let mut jump: Option<Vec<u8>> = None;
            for (key, value) in rows {
                if claimed.len() >= n {
                    break;
                }
                start = keys::key_after_bytes(&key);
                let text = keys::key_str(&key)?;
                let id = if text.starts_with("index:") {
                    keys::index_key_row(text)?.1
                } else {
                    keys::decode_str(&text[keys::table_prefix(&self.table).len()..])?
                };
                if tx.get(self.bad_key(&id).as_bytes()).await?.is_some() {
                    continue;
                }
                let Ok(mut row) = serde_json::from_slice::<Value>(&value) else {
                    self.set_aside(tx, &id, "the row is not JSON").await?;
                    continue;
                };
                if field_i64(&row, &spec.processed_at).is_some() {
                    continue;
                }
                if let Some(retry_after) = field_i64(&row, &spec.retry_after)
                    && retry_after > now
                {
                    // Later rows of this priority are later still: skip to the next priority.
                    if let Some(priority) = field_i64(&row, &spec.priority)
                        && let Some(bucket) = self.claim_prefix(&config.group, Some(priority))?
                    {
                        jump = Some(keys::prefix_end(bucket).into_bytes());
                        break;
                    }
                    continue;
                }
                if let Some(until) = self.lease_of(tx, &id, &row).await?
                    && until > now
                {
                    continue;
                }
                if serde_json::from_value::<M>(row.clone()).is_err() {
                    self.set_aside(tx, &id, "the row does not deserialize into the model")
                        .await?;
                    continue;
                }
                let attempt = field_i64(&row, &spec.attempt);
                if let Some(done) = attempt
                    && done as u64 >= config.max_attempts
                {
                    self.dead_letter(tx, config, row, &id).await?;
                    continue;
                }
                // The claim: lease and attempt counter, written as a model update (and, without a
                // `locked_until` role, the lease key).
                let until = now.saturating_add(ms(config.lease));
                let locked_until = Some(until);
                let next_attempt = attempt.map(|a| a + 1);
                self.set_lease(tx, &id, &mut row, locked_until).await?;
                if let Some(a) = next_attempt {
                    set(&mut row, &spec.attempt, Value::from(a));
                }
                let payload_json = match &spec.payload {
                    Some(field) => row.get(field).cloned().unwrap_or(Value::Null),
                    None => row.clone(),
                };
                let payload: P = match serde_json::from_value(payload_json) {
                    Ok(payload) => payload,
                    Err(_) => {
                        self.set_aside(tx, &id, "the payload does not deserialize")
                            .await?;
                        continue;
                    }
                };
                let model: M = serde_json::from_value(row.clone())?;
                self.models
                    .update_with_options(model, TitoOptions::default(), tx)
                    .await?;
                let headers = spec
                    .headers
                    .as_ref()
                    .and_then(|f| row.get(f))
                    .and_then(Value::as_object)
                    .map(|map| {
                        map.iter()
                            .map(|(k, v)| {
                                (
                                    k.clone(),
                                    v.as_str().map_or_else(|| v.to_string(), str::to_string),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let partition_key = spec
                    .partition_key
                    .as_ref()
                    .and_then(|f| row.get(f))
                    .and_then(Value::as_str)
                    .map(str::to_string);
                claimed.push((
                    InboxClaim {
                        id: id.clone(),
                        locked_until,
                        attempt: next_attempt,
                    },
                    InboxDelivery {
                        id,
                        payload,
                        headers,
                        attempt: next_attempt.unwrap_or(1).max(0) as u64,
                        partition_key,
                    },
                ));
            }
            if let Some(next) = jump {
                start = next;
                if start >= end {
                    if wrapped {
                        bounded = false;
                        break;
                    }
                    (start, wrapped) = (first.clone(), true);
                }
                continue;
            }
            if exhausted {
                // The end: a claim that began mid-way wraps once to the start.
                if wrapped {
                    bounded = false;
                    break;
                }
                (start, wrapped) = (first.clone(), true);
            }
        }
        if bounded && claimed.len() < n {
            // Stopped by the scan bound: the next claim continues here.
            crate::util::lock(&self.resume).insert(config.group.clone(), start);
        }
        Ok(claimed)
    }

    async fn set_aside(&self, tx: &E::Transaction, id: &str, why: &str) -> TitoResult<()> {
        tracing::warn!(table = %self.table, id, why, "inbox row set aside");
        self.stats.bad.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::INBOX_BAD_ROWS, "table" => self.table.clone()).increment(1);
        tx.put(self.bad_key(id).into_bytes(), why.as_bytes().to_vec())
            .await
    }

    async fn dead_letter(
        &self,
        tx: &E::Transaction,
        config: &InboxConfig<E, M>,
        mut row: Value,
        id: &str,
    ) -> TitoResult<()> {
        match &config.dead_letter {
            None => {
                tracing::warn!(table = %self.table, id, "inbox row out of attempts and no dead letter configured");
                return Ok(());
            }
            Some(DeadLetter::Group(group)) => {
                set(&mut row, &self.spec.group, Value::from(group.clone()));
                self.set_lease(tx, id, &mut row, None).await?;
                let model: M = serde_json::from_value(row)?;
                self.models
                    .update_with_options(model, TitoOptions::default(), tx)
                    .await?;
            }
            Some(DeadLetter::Model(write)) => {
                let model: M = serde_json::from_value(row)?;
                write(model, tx.clone()).await?;
                self.set_lease(tx, id, &mut Value::Null, None).await?;
                self.models
                    .delete_by_id_with_options(id, TitoOptions::default(), tx)
                    .await?;
            }
        }
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(
            names::INBOX_DEAD_LETTERED,
            "table" => self.table.clone(),
            "group" => config.group.clone()
        )
        .increment(1);
        Ok(())
    }

    /// Reads the row and checks that `claim` still holds it.
    async fn held(&self, tx: &E::Transaction, claim: &InboxClaim) -> TitoResult<Option<Value>> {
        let Ok(model) = self.models.find_by_id_tx(&claim.id, tx).await else {
            return Ok(None);
        };
        let row = serde_json::to_value(&model)?;
        let same_lease = self.lease_of(tx, &claim.id, &row).await? == claim.locked_until;
        let same_attempt =
            claim.attempt.is_none() || field_i64(&row, &self.spec.attempt) == claim.attempt;
        Ok((same_lease && same_attempt).then_some(row))
    }

    /// Extends a claim's lease; returns the new claim, or `None` when it was lost.
    pub async fn extend(
        &self,
        config: &InboxConfig<E, M>,
        claim: &InboxClaim,
    ) -> TitoResult<Option<InboxClaim>> {
        config.check()?;
        self.db
            .transaction_with(self.db.retry_policy().resolving(), |tx| async move {
                let Some(mut row) = self.held(&tx, claim).await? else {
                    return Ok(None);
                };
                let until = self
                    .now_ms(&tx, config.clock)
                    .await
                    .saturating_add(ms(config.lease));
                self.set_lease(&tx, &claim.id, &mut row, Some(until))
                    .await?;
                if self.spec.locked_until.is_some() {
                    let model: M = serde_json::from_value(row)?;
                    self.models
                        .update_with_options(model, TitoOptions::default(), &tx)
                        .await?;
                }
                Ok(Some(InboxClaim {
                    locked_until: Some(until),
                    ..claim.clone()
                }))
            })
            .await
    }

    /// Refuses an outcome the model's roles cannot carry out: a delay without a `retry_after`
    /// role (the row would be ready again at once, hammering whatever the handler calls).
    fn check_outcome(&self, outcome: InboxOutcome) -> TitoResult<()> {
        if let InboxOutcome::RetryAfter(delay) = outcome
            && !delay.is_zero()
            && self.spec.retry_after.is_none()
        {
            return Err(TitoError::invalid_argument(format!(
                "InboxOutcome::RetryAfter({delay:?}) needs a `retry_after` role, which inbox model \
                 {:?} does not declare: without one the row would be ready again at once. Declare \
                 #[tito(retry_after)] on an i64 field (Unix milliseconds), or return \
                 InboxOutcome::Retry",
                self.table
            )));
        }
        Ok(())
    }

    /// Applies an outcome if the claim still holds the row; `false` when the lease was lost.
    /// An outcome the model's roles cannot carry out ([`InboxOutcome::RetryAfter`] with a
    /// delay, on a model without a `retry_after` role) is [`TitoError::InvalidArgument`] and
    /// changes nothing: the row is claimable again when its lease ends.
    pub async fn complete(
        &self,
        config: &InboxConfig<E, M>,
        claim: &InboxClaim,
        outcome: InboxOutcome,
    ) -> TitoResult<bool> {
        self.check_outcome(outcome)?;
        // An outcome whose commit is unknown is resolved: applied, it is not delivered again;
        // proven not applied, it is replayed while the claim still holds the row.
        self.db
            .transaction_with(self.db.retry_policy().resolving(), |tx| async move {
                let Some(mut row) = self.held(&tx, claim).await? else {
                    return Ok(false);
                };
                let now = self.now_ms(&tx, config.clock).await;
                let spec = &self.spec;
                match outcome {
                    InboxOutcome::Ack if spec.processed_at.is_some() => {
                        set(&mut row, &spec.processed_at, Value::from(now));
                        self.set_lease(&tx, &claim.id, &mut row, None).await?;
                    }
                    InboxOutcome::Ack | InboxOutcome::Drop => {
                        self.set_lease(&tx, &claim.id, &mut row, None).await?;
                        self.models
                            .delete_by_id_with_options(&claim.id, TitoOptions::default(), &tx)
                            .await?;
                        return Ok(true);
                    }
                    InboxOutcome::Retry | InboxOutcome::RetryAfter(_) => {
                        let attempts = field_i64(&row, &spec.attempt).unwrap_or(0).max(0) as u64;
                        if spec.attempt.is_some()
                            && attempts >= config.max_attempts
                            && config.dead_letter.is_some()
                        {
                            self.dead_letter(&tx, config, row, &claim.id).await?;
                            return Ok(true);
                        }
                        // A delay past the end of i64 milliseconds saturates: "never again".
                        let delay = match outcome {
                            InboxOutcome::RetryAfter(d) => ms(d),
                            _ => 0,
                        };
                        set(
                            &mut row,
                            &spec.retry_after,
                            Value::from(now.saturating_add(delay)),
                        );
                        self.set_lease(&tx, &claim.id, &mut row, None).await?;
                    }
                }
                let model: M = serde_json::from_value(row)?;
                self.models
                    .update_with_options(model, TitoOptions::default(), &tx)
                    .await?;
                Ok(true)
            })
            .await
    }
}

/// Serves one group of an inbox until `shutdown` resolves: claims ready rows (up to
/// `concurrency` in flight), hands each to `handler` (the payload decoded as `P`, or the whole
/// row), extends leases while it runs and applies its outcome if the lease still holds. An
/// `Err`, a panic or a lost lease applies nothing: the row is claimable again when its lease
/// ends. A second subscription to the same (model, group) in this process fails at once with
/// [`TitoError::AlreadySubscribed`].
///
/// The returned future is `Send + 'static`: spawn it, or await it in place.
pub fn run_inbox<E, M, P, F, Fut, S>(
    inbox: Arc<Inbox<E, M>>,
    config: InboxConfig<E, M>,
    handler: F,
    shutdown: S,
) -> BoxFuture<'static, TitoResult<()>>
where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
    S: Shutdown,
{
    if let Err(err) = config.check() {
        return Box::pin(async move { Err(err) });
    }
    Box::pin(inbox_loop(inbox, config, handler, shutdown))
}

async fn inbox_loop<E, M, P, F, Fut, S>(
    inbox: Arc<Inbox<E, M>>,
    config: InboxConfig<E, M>,
    handler: F,
    shutdown: S,
) -> TitoResult<()>
where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
    S: Shutdown,
{
    let group = if inbox.spec.group.is_some() {
        config.group.clone()
    } else {
        String::new()
    };
    let _subscription = Subscription::take(
        inbox.db.extensions().get::<Subscriptions>(),
        format!("{}/{group}", inbox.table),
    )?;
    let config = Arc::new(config);
    let handler = Arc::new(handler);
    let mut shutdown = shutdown.wait();
    let mut running: JoinSet<()> = JoinSet::new();
    let mut idle = Duration::from_millis(5);
    let mut stopping = false;
    loop {
        while running.try_join_next().is_some() {}
        // Shutdown is looked at before every claim (and wins the select below).
        if !stopping && shutdown.as_mut().now_or_never().is_some() {
            stopping = true;
        }
        if stopping {
            if running.is_empty() {
                return Ok(());
            }
            let _ = running.join_next().await;
            continue;
        }
        let free = config.concurrency.saturating_sub(running.len());
        let mut claimed_any = false;
        if free > 0 {
            match inbox.claim::<P>(&config, free).await {
                Ok(claims) => {
                    claimed_any = !claims.is_empty();
                    for (claim, delivery) in claims {
                        inbox.stats.claimed.fetch_add(1, Ordering::Relaxed);
                        inbox.record(names::INBOX_CLAIMED, &config.group, None);
                        let span = tracing::info_span!(
                            "tito.inbox.delivery",
                            table = %inbox.table,
                            group = %config.group,
                            id = %claim.id,
                            attempt = delivery.attempt,
                        );
                        let work = handle(
                            inbox.clone(),
                            config.clone(),
                            handler.clone(),
                            claim,
                            delivery,
                        );
                        running.spawn(work.instrument(span));
                    }
                }
                Err(err) => tracing::warn!(error = %err, "inbox claim failed"),
            }
        }
        idle = if claimed_any {
            Duration::from_millis(5)
        } else {
            (idle * 2).min(config.max_idle)
        };
        let full = running.len() >= config.concurrency;
        let pause = if claimed_any && !full {
            Duration::ZERO
        } else {
            idle
        };
        tokio::select! {
            biased;
            _ = &mut shutdown => stopping = true,
            _ = running.join_next(), if full => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

async fn handle<E, M, P, F, Fut>(
    inbox: Arc<Inbox<E, M>>,
    config: Arc<InboxConfig<E, M>>,
    handler: Arc<F>,
    claim: InboxClaim,
    delivery: InboxDelivery<P>,
) where
    E: TitoEngine,
    M: InboxModel,
    P: DeserializeOwned + Send + 'static,
    F: Fn(InboxDelivery<P>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TitoResult<InboxOutcome>> + Send + 'static,
{
    // The call that builds the future is supervised with it (a handler that panics before it
    // returns a future fails like one whose future panics).
    let mut work = std::panic::AssertUnwindSafe(async move { handler(delivery).await })
        .catch_unwind()
        .boxed();
    let mut claim = claim;
    let extend_every = config.lease / 3;
    let result = loop {
        tokio::select! {
            biased;
            result = &mut work => break result,
            _ = tokio::time::sleep(extend_every) => {
                match inbox.extend(&config, &claim).await {
                    Ok(Some(extended)) => claim = extended,
                    Ok(None) => {
                        inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
                        inbox.record(names::INBOX_OUTCOMES, &config.group, Some("lease_lost"));
                        tracing::warn!(id = %claim.id, "inbox lease lost while the handler ran");
                    }
                    Err(err) => tracing::warn!(id = %claim.id, error = %err, "extending an inbox lease failed"),
                }
            }
        }
    };
    let outcome = match result {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(err)) => {
            inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("failed"));
            tracing::warn!(id = %claim.id, error = %err, "inbox handler failed; the row is claimable when its lease ends");
            return;
        }
        Err(_) => {
            inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("failed"));
            tracing::warn!(id = %claim.id, "inbox handler panicked");
            return;
        }
    };
    match inbox.complete(&config, &claim, outcome).await {
        Ok(true) => {
            inbox.stats.completed.fetch_add(1, Ordering::Relaxed);
            let label = match outcome {
                InboxOutcome::Ack => "ack",
                InboxOutcome::Drop => "drop",
                InboxOutcome::Retry | InboxOutcome::RetryAfter(_) => "retry",
            };
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some(label));
        }
        Ok(false) => {
            inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("lease_lost"));
            tracing::warn!(id = %claim.id, "inbox outcome refused: the lease was lost");
        }
        Err(err @ TitoError::InvalidArgument(_)) => {
            inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
            inbox.record(names::INBOX_OUTCOMES, &config.group, Some("refused"));
            tracing::error!(id = %claim.id, error = %err, "inbox outcome refused; the row is claimable when its lease ends");
        }
        Err(err) => {
            tracing::warn!(id = %claim.id, error = %err, "applying an inbox outcome failed")
        }
    }
}
