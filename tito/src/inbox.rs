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
//! | `locked_until` | `Option<i64>`, Unix ms | the lease: set by a claim, extended while the handler runs |
//! | `partition_key` | `String` | delivered with the row |
//! | `headers` | string map | delivered as a `BTreeMap<String, String>` |
//! | `payload` | any | what the handler receives, decoded; without it, the whole row |
//!
//! Claims walk the model's claim index (`{table}_inbox_claim` over group, priority and
//! retry_after, holding only unprocessed rows) in claim order: priority, then retry_after, then
//! id. A claim, its lease extensions and its outcome are model updates, so a lost lease cannot
//! apply an outcome and two workers never claim one row. Rows that do not deserialize are
//! reported and set aside (`{table}:inbox-bad:{id}`), never blocking the rows behind them.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
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
use crate::queue::Shutdown;

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
    /// Ready again after this long.
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

fn registry() -> &'static Mutex<HashSet<String>> {
    static SUBSCRIPTIONS: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    SUBSCRIPTIONS.get_or_init(Mutex::default)
}

/// The registration of one (store, model, group) subscription in this process.
struct Subscription(String);

impl Subscription {
    fn take(name: String) -> TitoResult<Subscription> {
        let mut subscriptions = registry().lock().unwrap_or_else(|e| e.into_inner());
        if !subscriptions.insert(name.clone()) {
            return Err(TitoError::AlreadySubscribed(name));
        }
        Ok(Subscription(name))
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
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
    _model: PhantomData<fn() -> M>,
}

impl<E: TitoEngine, M: InboxModel> Inbox<E, M> {
    /// The inbox of `M`. Checks that the model declares its claim index.
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
        }
        Ok(Inbox {
            models: TitoModel::new(db.clone()),
            db,
            spec,
            table,
            stats: Arc::default(),
            _model: PhantomData,
        })
    }

    /// The counters of this handle and its subscriptions, as plain numbers now.
    pub fn stats(&self) -> InboxStats {
        self.stats.snapshot()
    }

    async fn now_ms(&self, tx: &E::Transaction, clock: InboxClock) -> i64 {
        match clock {
            InboxClock::Host => host_now_ms(),
            InboxClock::Engine => engine::version_millis(tx.start_version()) as i64,
        }
    }

    fn bad_key(&self, id: &str) -> String {
        let mut key = format!(
            "{}:inbox-bad:",
            keys::table_prefix(&self.table).trim_end_matches(':')
        );
        keys::encode_str(id, &mut key);
        key
    }

    /// The ids of rows set aside because they do not deserialize.
    pub async fn bad_rows(&self) -> TitoResult<Vec<String>> {
        let prefix = self.bad_key("");
        let end = keys::prefix_end(prefix.clone());
        crate::model::read_only(&self.db, async |tx| {
            let rows = tx
                .scan(prefix.as_bytes(), end.as_bytes(), engine::MAX_SCAN_LIMIT)
                .await?;
            rows.iter()
                .map(|(k, _)| keys::decode_str(&keys::key_str(k)?[prefix.len()..]))
                .collect()
        })
        .await
    }

    /// Claims up to `n` ready rows of `config.group` in one transaction (replayed on conflicts,
    /// so two claimers never take one row). Dead-letters rows whose attempts ran out. The
    /// building block of [`run_inbox`], for custom workers.
    pub async fn claim<P: DeserializeOwned + Send>(
        &self,
        config: &InboxConfig<E, M>,
        n: usize,
    ) -> TitoResult<Vec<(InboxClaim, InboxDelivery<P>)>> {
        self.db
            .transaction(|tx| async move { self.claim_tx::<P>(config, n, &tx).await })
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
        keys::index_prefix(&index.name, &bound).map(Some)
    }

    async fn claim_tx<P: DeserializeOwned + Send>(
        &self,
        config: &InboxConfig<E, M>,
        n: usize,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<(InboxClaim, InboxDelivery<P>)>> {
        let now = self.now_ms(tx, config.clock).await;
        let spec = &self.spec;
        let prefix = self
            .claim_prefix(&config.group, None)?
            .unwrap_or_else(|| keys::table_prefix(&self.table));
        let end = keys::prefix_end(prefix.clone()).into_bytes();
        let mut start = prefix.into_bytes();
        let mut claimed = Vec::new();
        // Bounded: at most 16 scans of 64 rows per claim.
        for _ in 0..16 {
            if claimed.len() >= n {
                break;
            }
            let rows = tx.scan(&start, &end, 64).await?;
            let exhausted = rows.len() < 64;
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
                if let Some(until) = field_i64(&row, &spec.locked_until)
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
                // The claim: lease and attempt counter, written as a model update.
                let locked_until = spec
                    .locked_until
                    .as_ref()
                    .map(|_| now + config.lease.as_millis() as i64);
                let next_attempt = attempt.map(|a| a + 1);
                if let Some(until) = locked_until {
                    set(&mut row, &spec.locked_until, Value::from(until));
                }
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
                continue;
            }
            if exhausted {
                break;
            }
        }
        Ok(claimed)
    }

    async fn set_aside(&self, tx: &E::Transaction, id: &str, why: &str) -> TitoResult<()> {
        tracing::warn!(table = %self.table, id, why, "inbox row set aside");
        self.stats.bad.fetch_add(1, Ordering::Relaxed);
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
                if self.spec.locked_until.is_some() {
                    set(&mut row, &self.spec.locked_until, Value::Null);
                }
                let model: M = serde_json::from_value(row)?;
                self.models
                    .update_with_options(model, TitoOptions::default(), tx)
                    .await?;
            }
            Some(DeadLetter::Model(write)) => {
                let model: M = serde_json::from_value(row)?;
                write(model, tx.clone()).await?;
                self.models
                    .delete_by_id_with_options(id, TitoOptions::default(), tx)
                    .await?;
            }
        }
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Reads the row and checks that `claim` still holds it.
    async fn held(&self, tx: &E::Transaction, claim: &InboxClaim) -> TitoResult<Option<Value>> {
        let Ok(model) = self.models.find_by_id_tx(&claim.id, tx).await else {
            return Ok(None);
        };
        let row = serde_json::to_value(&model)?;
        let same_lease = claim.locked_until.is_none()
            || field_i64(&row, &self.spec.locked_until) == claim.locked_until;
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
        if self.spec.locked_until.is_none() {
            return Ok(Some(claim.clone()));
        }
        self.db
            .transaction(|tx| async move {
                let Some(mut row) = self.held(&tx, claim).await? else {
                    return Ok(None);
                };
                let until = self.now_ms(&tx, config.clock).await + config.lease.as_millis() as i64;
                set(&mut row, &self.spec.locked_until, Value::from(until));
                let model: M = serde_json::from_value(row)?;
                self.models
                    .update_with_options(model, TitoOptions::default(), &tx)
                    .await?;
                Ok(Some(InboxClaim {
                    locked_until: Some(until),
                    ..claim.clone()
                }))
            })
            .await
    }

    /// Applies an outcome if the claim still holds the row; `false` when the lease was lost.
    pub async fn complete(
        &self,
        config: &InboxConfig<E, M>,
        claim: &InboxClaim,
        outcome: InboxOutcome,
    ) -> TitoResult<bool> {
        self.db
            .transaction(|tx| async move {
                let Some(mut row) = self.held(&tx, claim).await? else {
                    return Ok(false);
                };
                let now = self.now_ms(&tx, config.clock).await;
                let spec = &self.spec;
                let unlock = |row: &mut Value| {
                    if spec.locked_until.is_some() {
                        set(row, &spec.locked_until, Value::Null);
                    }
                };
                match outcome {
                    InboxOutcome::Ack if spec.processed_at.is_some() => {
                        set(&mut row, &spec.processed_at, Value::from(now));
                        unlock(&mut row);
                    }
                    InboxOutcome::Ack | InboxOutcome::Drop => {
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
                        let delay = match outcome {
                            InboxOutcome::RetryAfter(d) => d.as_millis() as i64,
                            _ => 0,
                        };
                        set(&mut row, &spec.retry_after, Value::from(now + delay));
                        unlock(&mut row);
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
    let _subscription =
        Subscription::take(format!("{}/{}/{group}", inbox.db.store_id(), inbox.table))?;
    let config = Arc::new(config);
    let handler = Arc::new(handler);
    let mut shutdown = shutdown.wait();
    let mut running: JoinSet<()> = JoinSet::new();
    let mut idle = Duration::from_millis(5);
    let mut stopping = false;
    loop {
        while running.try_join_next().is_some() {}
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
                        running.spawn(handle(
                            inbox.clone(),
                            config.clone(),
                            handler.clone(),
                            claim,
                            delivery,
                        ));
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
    let mut work = std::panic::AssertUnwindSafe(handler(delivery))
        .catch_unwind()
        .boxed();
    let mut claim = claim;
    let extend_every = config.lease / 3;
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = tokio::time::sleep(extend_every) => {
                match inbox.extend(&config, &claim).await {
                    Ok(Some(extended)) => claim = extended,
                    Ok(None) => {
                        inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
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
            tracing::warn!(id = %claim.id, error = %err, "inbox handler failed; the row is claimable when its lease ends");
            return;
        }
        Err(_) => {
            inbox.stats.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(id = %claim.id, "inbox handler panicked");
            return;
        }
    };
    match inbox.complete(&config, &claim, outcome).await {
        Ok(true) => {
            inbox.stats.completed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(false) => {
            inbox.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(id = %claim.id, "inbox outcome refused: the lease was lost");
        }
        Err(err) => {
            tracing::warn!(id = %claim.id, error = %err, "applying an inbox outcome failed")
        }
    }
}
