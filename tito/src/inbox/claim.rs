//! Claims, lease extensions, outcomes and dead letters: each one transaction that re-checks the
//! claim it acts under.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self, KeyValue};
use crate::model::TitoOptions;
use crate::telemetry::names;

use super::{
    CLAIM_SCAN_ROWS, CLAIM_SCANS, DeadLetter, Inbox, InboxConfig, InboxDelivery, InboxModel,
    InboxOutcome, field_i64, ms, set,
};

/// One row of a claim scan, as [`Inbox::candidate`] judged it.
enum Candidate {
    /// Not claimable now; go on.
    Skip,
    /// Delayed, and every row after it in its priority is later still: continue the scan here.
    LaterPriority(Vec<u8>),
    /// Claimable: its id, its row and the fingerprint of the row as stored.
    Ready(String, Value, u64),
}

/// The headers role of `row` as a string map (non-string values as their JSON text).
fn headers_of(spec: &super::InboxSpec, row: &Value) -> BTreeMap<String, String> {
    spec.headers
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
        .unwrap_or_default()
}

/// A claimed row: its id and the lease it holds (what [`Inbox::complete`] checks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxClaim {
    pub(super) id: String,
    pub(super) locked_until: Option<i64>,
    pub(super) attempt: Option<i64>,
}

impl<E: TitoEngine, M: InboxModel> Inbox<E, M> {
    /// Claims up to `n` ready rows of `config.group` in one transaction (replayed on conflicts,
    /// so two claimers never take one row). Dead-letters rows whose attempts ran out. The
    /// building block of [`run_inbox`](super::run_inbox), for custom workers.
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
    pub(super) fn claim_prefix(
        &self,
        group: &str,
        priority: Option<i64>,
    ) -> TitoResult<Option<String>> {
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

    /// One claim in `tx`: scans the claim index from where the last bounded claim of the group
    /// stopped (wrapping once to the start), at most [`CLAIM_SCANS`] scans, taking up to `n`
    /// claimable rows.
    pub(super) async fn claim_tx<P: DeserializeOwned + Send>(
        &self,
        config: &InboxConfig<E, M>,
        n: usize,
        tx: &E::Transaction,
    ) -> TitoResult<Vec<(InboxClaim, InboxDelivery<P>)>> {
        config.check()?;
        let now = self.now_ms(tx, config.clock).await;
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
                match self.candidate(tx, config, now, &key, &value).await? {
                    Candidate::Skip => {}
                    Candidate::LaterPriority(next) => {
                        jump = Some(next);
                        break;
                    }
                    Candidate::Ready(id, row, print) => {
                        if let Some(taken) = self.take(tx, config, now, id, row, print).await? {
                            claimed.push(taken);
                        }
                    }
                }
            }
            let jumped = jump.is_some();
            if let Some(next) = jump {
                start = next;
            }
            // The end of the range: a claim that began mid-way wraps once to the start.
            if start >= end || (!jumped && exhausted) {
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

    /// What one row of a claim scan is: skipped (set aside, processed, leased, delayed, out of
    /// attempts: dead-lettered), the first delayed row of its priority (everything after it
    /// there is later still), or ready to take.
    async fn candidate(
        &self,
        tx: &E::Transaction,
        config: &InboxConfig<E, M>,
        now: i64,
        key: &[u8],
        value: &[u8],
    ) -> TitoResult<Candidate> {
        let spec = &self.spec;
        let text = keys::key_str(key)?;
        let id = if text.starts_with("index:") {
            keys::index_key_row(text)?.1
        } else {
            keys::decode_str(&text[keys::table_prefix(&self.table).len()..])?
        };
        if let Some(record) = tx.get(self.bad_key(&id).as_bytes()).await? {
            if super::set_aside_for(&record, value, M::VERSION) {
                return Ok(Candidate::Skip);
            }
            // The row was written again since it was set aside, or code of another shape
            // version set it aside: read it again.
            tx.delete(self.bad_key(&id).into_bytes()).await?;
        }
        let row = match crate::model::shape::row_value::<M>(text, value) {
            Ok(row) => row,
            // A row newer than this code waits for code that reads it (after a rollback, the
            // newer deploy takes it again); nothing is set aside for it.
            Err(TitoError::RowShape {
                version,
                code_version,
                ..
            }) if version > code_version => return Ok(Candidate::Skip),
            // An older row no conversion of this code reads: while writers may write an older
            // version than this code's, code of that version may still run and read it, so it
            // is left to that code; once this code's version is allowed, it is set aside.
            Err(TitoError::RowShape { .. }) if self.older_code_may_run(tx).await? => {
                return Ok(Candidate::Skip);
            }
            Err(err) => {
                let why = match err {
                    TitoError::RowShape { .. } => err.to_string(),
                    _ => "the row is not JSON".to_string(),
                };
                self.set_aside(tx, &id, &why, keys::fnv1a(value)).await?;
                return Ok(Candidate::Skip);
            }
        };
        if field_i64(&row, &spec.processed_at).is_some() {
            return Ok(Candidate::Skip);
        }
        if let Some(retry_after) = field_i64(&row, &spec.retry_after)
            && retry_after > now
        {
            if let Some(priority) = field_i64(&row, &spec.priority)
                && let Some(bucket) = self.claim_prefix(&config.group, Some(priority))?
            {
                return Ok(Candidate::LaterPriority(
                    keys::prefix_end(bucket).into_bytes(),
                ));
            }
            return Ok(Candidate::Skip);
        }
        if let Some(until) = self.lease_of(tx, &id, &row).await?
            && until > now
        {
            return Ok(Candidate::Skip);
        }
        if serde_json::from_value::<M>(row.clone()).is_err() {
            self.set_aside(
                tx,
                &id,
                "the row does not deserialize into the model",
                keys::fnv1a(value),
            )
            .await?;
            return Ok(Candidate::Skip);
        }
        if let Some(done) = field_i64(&row, &spec.attempt)
            && done as u64 >= config.max_attempts
        {
            self.dead_letter(tx, config, row, &id).await?;
            return Ok(Candidate::Skip);
        }
        Ok(Candidate::Ready(id, row, keys::fnv1a(value)))
    }

    /// Whether the table's catalog lets writers write an older shape version than this code's
    /// (a rolling deploy: code of that version may still run).
    async fn older_code_may_run(&self, tx: &E::Transaction) -> TitoResult<bool> {
        let Some(bytes) = tx.get(keys::schema_key(&self.table).as_bytes()).await? else {
            return Ok(false);
        };
        let catalog = crate::model::catalog::parse_catalog(&self.table, &bytes)?;
        Ok(catalog.shapes.writable() < M::VERSION)
    }

    /// Takes a ready row: its lease and attempt counter, written as a model update (and, without
    /// a `locked_until` role, the lease key), and what its handler is delivered. A payload that
    /// does not decode as `P` sets the row aside instead (`None`).
    async fn take<P: DeserializeOwned>(
        &self,
        tx: &E::Transaction,
        config: &InboxConfig<E, M>,
        now: i64,
        id: String,
        mut row: Value,
        print: u64,
    ) -> TitoResult<Option<(InboxClaim, InboxDelivery<P>)>> {
        let spec = &self.spec;
        let locked_until = Some(now.saturating_add(ms(config.lease)));
        let attempt = field_i64(&row, &spec.attempt).map(|a| a + 1);
        if spec.locked_until.is_some() {
            // The lease is a field of the row: set here, written with the row below.
            self.set_lease(tx, &id, &mut row, locked_until).await?;
        }
        if let Some(a) = attempt {
            set(&mut row, &spec.attempt, Value::from(a));
        }
        let payload_json = match &spec.payload {
            Some(field) => row.get(field).cloned().unwrap_or(Value::Null),
            None => row.clone(),
        };
        let Ok(payload) = serde_json::from_value::<P>(payload_json) else {
            self.set_aside(tx, &id, "the payload does not deserialize", print)
                .await?;
            return Ok(None);
        };
        let model: M = serde_json::from_value(row.clone())?;
        match self
            .models
            .update_with_options(model, TitoOptions::without_events(), tx)
            .await
        {
            Ok(_) => {}
            // A write refused before anything of it was buffered (a downgrade that fails or
            // panics, a claim another row holds): the row is set aside for this code and
            // counted, as a row it cannot read is, and the claim goes on with the others.
            Err(
                err @ (TitoError::SchemaMismatch(_)
                | TitoError::RowShape { .. }
                | TitoError::InvalidArgument(_)
                | TitoError::UniqueViolation { .. }),
            ) => {
                let why = format!("the claim cannot write the row back: {err}");
                self.set_aside(tx, &id, &why, print).await?;
                return Ok(None);
            }
            Err(err) => return Err(err),
        }
        if spec.locked_until.is_none() {
            // The lease is a key of its own, written once the row's write was accepted.
            self.set_lease(tx, &id, &mut row, locked_until).await?;
        }
        let claim = InboxClaim {
            id: id.clone(),
            locked_until,
            attempt,
        };
        let delivery = InboxDelivery {
            id,
            payload,
            headers: headers_of(spec, &row),
            attempt: attempt.unwrap_or(1).max(0) as u64,
            partition_key: spec
                .partition_key
                .as_ref()
                .and_then(|f| row.get(f))
                .and_then(Value::as_str)
                .map(str::to_string),
        };
        Ok(Some((claim, delivery)))
    }

    pub(super) async fn dead_letter(
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
                    .update_with_options(model, TitoOptions::without_events(), tx)
                    .await?;
            }
            Some(DeadLetter::Model(write)) => {
                let model: M = serde_json::from_value(row)?;
                write(model, tx.clone()).await?;
                self.set_lease(tx, id, &mut Value::Null, None).await?;
                self.models
                    .delete_by_id_with_options(id, TitoOptions::without_events(), tx)
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
    pub(super) async fn held(
        &self,
        tx: &E::Transaction,
        claim: &InboxClaim,
    ) -> TitoResult<Option<Value>> {
        let Ok(model) = self.models.find_by_id_in_tx(&claim.id, tx).await else {
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
                        .update_with_options(model, TitoOptions::without_events(), &tx)
                        .await?;
                }
                Ok(Some(InboxClaim {
                    locked_until: Some(until),
                    ..claim.clone()
                }))
            })
            .await
    }

    /// Releases a row whose delivery failed (attempt `attempt`), if the claim still holds it:
    /// dead-lettered when `dead` (a fatal panic) or out of attempts and a dead letter is
    /// configured, otherwise ready again after `backoff` (with a `retry_after` role; without
    /// one the lease is kept until it ends, the only delay such a row can carry). Returns
    /// whether the row was released.
    pub(super) async fn release_failed(
        &self,
        config: &InboxConfig<E, M>,
        claim: &InboxClaim,
        backoff: Duration,
        dead: bool,
    ) -> TitoResult<bool> {
        if dead && config.dead_letter.is_some() {
            return self
                .db
                .transaction_with(self.db.retry_policy().resolving(), |tx| async move {
                    let Some(row) = self.held(&tx, claim).await? else {
                        return Ok(false);
                    };
                    self.dead_letter(&tx, config, row, &claim.id).await?;
                    Ok(true)
                })
                .await;
        }
        if self.spec.retry_after.is_none() {
            return Ok(false);
        }
        self.complete(config, claim, InboxOutcome::RetryAfter(backoff))
            .await
    }

    /// Refuses an outcome the model's roles cannot carry out: a delay without a `retry_after`
    /// role (the row would be ready again at once, hammering whatever the handler calls).
    pub(super) fn check_outcome(&self, outcome: InboxOutcome) -> TitoResult<()> {
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
                            .delete_by_id_with_options(
                                &claim.id,
                                TitoOptions::without_events(),
                                &tx,
                            )
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
                    .update_with_options(model, TitoOptions::without_events(), &tx)
                    .await?;
                Ok(true)
            })
            .await
    }
}
