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

mod claim;
mod config;
mod rows;
mod run;
mod spec;

pub use claim::InboxClaim;
pub use config::{
    DeadLetter, DeadLetterWriter, InboxClock, InboxConfig, InboxDelivery, InboxOutcome,
};
pub use rows::{InboxCounts, InboxRow, InboxRowState};
pub use run::run_inbox;
pub use spec::{InboxModel, InboxSpec};

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self};
use crate::model::TitoModel;
use crate::telemetry::names;

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
}

/// The last line of a set-aside record: the fingerprint of the row it was made for.
const SET_ASIDE_ROW: &str = "row fnv1a ";

/// The line before it: the shape version of the code that set the row aside.
const SET_ASIDE_CODE: &str = "code shape ";

/// Whether a set-aside record holds for a row stored as `row`, read by code of shape version
/// `code`. A record holds for the row as it was stored when it was made (a row written again is
/// read again) and for code of the shape version that made it: code of another version reads
/// the row through its own conversions (after a rollback, the older code takes a row the newer
/// code's conversion refused). A record without these lines, as older versions wrote them,
/// holds for any row and any code.
pub(super) fn set_aside_for(record: &[u8], row: &[u8], code: u32) -> bool {
    let record = String::from_utf8_lossy(record);
    let Some((rest, last)) = record.rsplit_once('\n') else {
        return true;
    };
    let Some(print) = last.strip_prefix(SET_ASIDE_ROW) else {
        return true;
    };
    if print != format!("{:016x}", keys::fnv1a(row)) {
        return false;
    }
    match rest
        .rsplit_once('\n')
        .and_then(|(_, line)| line.strip_prefix(SET_ASIDE_CODE))
    {
        Some(made_by) => made_by.parse::<u32>().is_ok_and(|v| v == code),
        None => true,
    }
}

impl<E: TitoEngine, M: InboxModel> Inbox<E, M> {
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

    /// The table this inbox reads.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The roles of the inbox's model.
    pub fn spec(&self) -> &InboxSpec {
        &self.spec
    }

    /// Sets a row aside: a record under its id that says why, ending with the shape version of
    /// this code and the fingerprint of the row as stored (`print`, its [`keys::fnv1a`]), so
    /// that the record holds for that row and code of that version only: a row written again
    /// under the id (fixed, rewritten in another shape, deleted and inserted anew), or read by
    /// code of another shape version, is read again and the record goes.
    async fn set_aside(
        &self,
        tx: &E::Transaction,
        id: &str,
        why: &str,
        print: u64,
    ) -> TitoResult<()> {
        tracing::warn!(table = %self.table, id, why, "inbox row set aside");
        self.stats.bad.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::INBOX_BAD_ROWS, "table" => self.table.clone()).increment(1);
        let record = format!(
            "{why}\n{SET_ASIDE_CODE}{}\n{SET_ASIDE_ROW}{print:016x}",
            M::VERSION
        );
        tx.put(self.bad_key(id).into_bytes(), record.into_bytes())
            .await
    }
}
