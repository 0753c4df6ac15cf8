//! Reading an inbox as an operator does: counts per state, rows page by page, rows set aside,
//! and putting a row back in line.

use serde_json::Value;

use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys::{self};
use crate::model::TitoOptions;

use super::{Inbox, InboxModel, field_i64, host_now_ms, set};

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
    /// Records of rows set aside because they do not decode (all groups). Such a row is also
    /// counted in its state; a record whose row was written again since, or that code of
    /// another shape version made, is counted until the next claim reads the row again.
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

impl<E: TitoEngine, M: InboxModel> Inbox<E, M> {
    /// The ids of rows set aside because they do not deserialize (or no conversion of the
    /// model reads them), as they are stored now: a row deleted since is not listed, and one
    /// written again since is read again by the next claim, as is one that code of another
    /// shape version set aside (this code reads it through its own conversions).
    pub async fn bad_rows(&self) -> TitoResult<Vec<String>> {
        let prefix = keys::inbox_bad_prefix(&self.table);
        let end = keys::prefix_end(prefix.clone());
        crate::engine::read_only(&self.db, async |tx| {
            let records = tx
                .scan(prefix.as_bytes(), end.as_bytes(), engine::MAX_SCAN_LIMIT)
                .await?;
            let ids: Vec<String> = records
                .iter()
                .map(|(k, _)| keys::decode_str(&keys::key_str(k)?[prefix.len()..]))
                .collect::<TitoResult<_>>()?;
            let row_keys: Vec<Vec<u8>> = ids
                .iter()
                .map(|id| keys::row_key(&self.table, id).into_bytes())
                .collect();
            let rows = tx.batch_get(&row_keys).await?;
            Ok(ids
                .into_iter()
                .zip(records.iter().zip(rows))
                .filter(|(_, ((_, record), row))| {
                    row.as_deref()
                        .is_some_and(|row| super::set_aside_for(record, row, M::VERSION))
                })
                .map(|(id, _)| id)
                .collect())
        })
        .await
    }

    /// The state of a row now (host clock), from its roles, and its lease's end (not read for
    /// a processed row: `None`).
    pub(super) async fn state_of(
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

    /// A stored row's id and JSON (in the model's current shape), when it reads and belongs to
    /// `group`.
    pub(super) fn group_row(
        &self,
        key: &[u8],
        value: &[u8],
        group: &str,
    ) -> Option<(String, Value)> {
        let text = String::from_utf8_lossy(key);
        let row = crate::model::shape::row_value::<M>(&text, value).ok()?;
        let in_group = match &self.spec.group {
            Some(field) => row.get(field).and_then(Value::as_str) == Some(group),
            None => true,
        };
        if !in_group {
            return None;
        }
        let id = keys::row_key_id(&text, &self.table).unwrap_or_default();
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
        let cursors = crate::model::query::narrow_to_cursor(&mut start, &mut end, false, cursor)?;
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
                last.map(|k| cursors.encode(&k))
            } else {
                None
            };
            Ok(crate::TitoPage { items, cursor })
        })
        .await
    }

    /// Moves a row into `group` as a fresh job: attempts 0, no delay, no lease, not processed
    /// (the roles the model has). For moving a dead-lettered row back (dead letters into a
    /// group), or trying a set-aside row again: a record that set it aside is cleared. A
    /// missing row is [`TitoError::NotFound`].
    pub async fn requeue(&self, id: &str, group: &str) -> TitoResult<()> {
        let (id, group) = (id.to_string(), group.to_string());
        self.db
            .transaction(|tx| {
                let (id, group) = (id.clone(), group.clone());
                async move {
                    let model = self.models.find_by_id_in_tx(&id, &tx).await?;
                    // An operator's "try again": a record that set the row aside goes too.
                    tx.delete(self.bad_key(&id).into_bytes()).await?;
                    let mut row = serde_json::to_value(&model)?;
                    set(&mut row, &self.spec.group, Value::from(group));
                    set(&mut row, &self.spec.attempt, Value::from(0));
                    set(&mut row, &self.spec.retry_after, Value::from(0));
                    set(&mut row, &self.spec.processed_at, Value::Null);
                    self.set_lease(&tx, &id, &mut row, None).await?;
                    let model: M = serde_json::from_value(row)?;
                    self.models
                        .update_with_options(model, TitoOptions::without_events(), &tx)
                        .await?;
                    tracing::info!(table = %self.table, id, "inbox row requeued");
                    Ok(())
                }
            })
            .await
    }
}
