//! A model write in a caller's transaction, in steps: read the row, its manifest, the catalog and
//! the expected claims together; decide every claim; plan the row, its entries, its manifest and
//! its events; then buffer them all at once (so a refused write leaves nothing behind).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::catalog::{IndexState, PlannedIndex, WritePlan};
use super::index::{self, Entry};
use super::{
    Mode, Stored, TitoModel, TitoModelTrait, TitoOperation, TitoOptions, code_entries,
    encode_manifest, index_configs, load, no_row, planned_entries, planned_entries_reusing, stamp,
};
use crate::engine::{self, TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::ShapeError;

/// What a write has read and decided about its row before it plans any write.
struct RowWrite<'a> {
    table: &'a str,
    id: &'a str,
    plan: &'a WritePlan,
    configs: &'a [(crate::model::TitoIndexConfig, bool)],
    stored: Option<&'a Stored>,
    /// The shape version the row is written in.
    version: u32,
    /// The keys the row's manifest lists (its entries and claims before the write).
    old_listed: HashSet<String>,
}

/// The unique claims of a write, once decided.
struct Claims {
    /// Every claim the row holds after the write.
    held: Vec<String>,
    /// Duplicates a building unique index tolerates (the row already had them).
    tolerated: HashSet<String>,
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// Writes an existing row again in the shape writers may write, as an update that publishes
    /// no event and keeps the row's timestamps: its entries' copies follow, its claims are kept
    /// (a shape rewrite's batch).
    pub(crate) async fn rewrite_in(&self, tx: &E::Transaction, model: T) -> TitoResult<()> {
        let options = TitoOptions::without_events().keeping_timestamps();
        self.write_in(tx, model, Mode::Update, &options).await?;
        Ok(())
    }

    /// Writes `model` in `tx` as `mode` says; returns the row as stored (timestamps stamped).
    pub(super) async fn write_in(
        &self,
        tx: &E::Transaction,
        model: T,
        mode: Mode,
        options: &TitoOptions,
    ) -> TitoResult<T> {
        let id = model.id();
        let table = model.table();
        if id.is_empty() {
            return Err(TitoError::invalid_argument(format!(
                "a row of table {table:?} has an empty id"
            )));
        }
        let row_key = keys::row_key(&table, &id);
        let handle = self.schema_handle().await?;
        let mut row = serde_json::to_value(&model)?;
        reads_back::<T>(&row, &table, &id)?;
        let mut configs = index_configs(&model)?;
        // The row's entries under the code's indexes, computed once: the write plan takes them
        // unless the catalog maintains an index otherwise or the row's timestamps are stamped.
        let mut known = code_entries(&configs, &row, &table, &id);
        // The claims the row will take, as far as the code's indexes tell before the catalog and
        // the stored row are read: they join the row's read, saving a request each. A claim the
        // write ends up needing that is not among them (a stamped field, a catalog that differs)
        // is read on its own.
        let expected_claims: Vec<String> = known
            .iter()
            .flatten()
            .flatten()
            .filter_map(|entry| entry.claim.clone())
            .collect();
        let (mut stored, plan, claim_owners) =
            load(tx, &table, &id, &handle, &expected_claims).await?;
        // An insert over any stored row is `AlreadyExists`, whether this code reads it or not
        // (an idempotent import treats it as "already there").
        if mode == Mode::Insert && stored.is_some() {
            return Err(TitoError::AlreadyExists(format!(
                "table {table:?} already has a row with id {id:?} (key {row_key})"
            )));
        }
        // A row stored in another shape version is read in the code's shape (upgraded through
        // the model's previous shapes) before anything compares or stamps it; one that does not
        // read refuses the write (a delete removes it).
        if let Some(s) = stored.as_mut()
            && s.version != T::VERSION
        {
            s.row = super::shape::row_value::<T>(&row_key, &s.bytes)?;
        }
        let mut prefetched: HashMap<String, Option<Vec<u8>>> =
            expected_claims.into_iter().zip(claim_owners).collect();
        if mode == Mode::Update && stored.is_none() {
            return Err(TitoError::NotFound(no_row(&table, &id)));
        }
        let did = match stored {
            Some(_) => TitoOperation::Update,
            None => TitoOperation::Insert,
        };
        let operation = super::reported_operation(options, did, mode == Mode::Upsert, &table, &id)?;

        let stamped = model.managed_timestamps()
            && !options.keep_timestamps
            && stamp(
                &mut row,
                stored.as_ref().map(|s| &s.row),
                engine::version_millis(tx.start_version()),
            );
        // What was stored, as the model: re-read only when timestamps changed it, and then its
        // indexes (whose conditions may read the timestamps) and entries are evaluated again.
        let stored_model: T = if stamped {
            let stored_model: T = serde_json::from_value(row.clone())?;
            configs = index_configs(&stored_model)?;
            known.clear();
            stored_model
        } else {
            model
        };
        let mut new_entries =
            planned_entries_reusing(&plan, &configs, &row, &table, &id, &mut known)?;
        let (version, json) = written_shape(&stored_model, &row, &table, plan.writable)?;
        // A row written in an older shape (through the downgrade) is indexed as the code of
        // that shape indexes it: the definitions applied to the row as stored, so that the code
        // still running finds it by the values it reads. An index whose condition is code
        // (which cannot be evaluated on a shape this code does not hold) takes the row when
        // this code's condition says so, with the values as stored too.
        if version != T::VERSION {
            let (stored_plan, skipped) =
                plan.for_stored_shape_with(|name| handle.code.definitions.get(name).cloned());
            let stored: Value = serde_json::from_slice(&json)?;
            let mut entries = planned_entries(&stored_plan, &[], &stored, &table, &id)?;
            let conditional = WritePlan {
                version: plan.version,
                writable: plan.writable,
                indexes: plan
                    .indexes
                    .iter()
                    .filter(|index| skipped.contains(&index.name))
                    .map(|index| PlannedIndex {
                        name: index.name.clone(),
                        unique: index.unique,
                        key_only: index.key_only,
                        state: index.state,
                        stored: None,
                        as_stored: None,
                    })
                    .collect(),
            };
            entries.extend(planned_entries(
                &conditional,
                &configs,
                &stored,
                &table,
                &id,
            )?);
            new_entries = entries;
        }
        let step = RowWrite {
            table: &table,
            id: &id,
            plan: &plan,
            configs: &configs,
            stored: stored.as_ref(),
            version,
            // What the row held before comes from its manifest, never from evaluating the
            // indexes (and their row-dependent conditions) on the old row again.
            old_listed: stored
                .as_ref()
                .map(|s| s.manifest.iter().cloned().collect())
                .unwrap_or_default(),
        };

        // Everything that can refuse the write is decided before the first write is buffered
        // (claims taken by other rows, the sizes of every key and value), so a caller that
        // handles the error in its own transaction and commits leaves nothing half-written.
        let mut writes = engine::Writes::default();
        let claims = self
            .plan_claims(tx, &step, &new_entries, &mut prefetched, &mut writes)
            .await?;
        // Events carry the row in the shape it is stored in, so that the workers of a deploy
        // still running read them too.
        let event_row: Option<Value> = match (operation, version == T::VERSION) {
            (Some(_), false) => Some(serde_json::from_slice(&json)?),
            _ => None,
        };
        plan_row(&step, new_entries, claims, row_key, &row, json, &mut writes)?;
        let mut wakes = Vec::new();
        if let Some(operation) = operation {
            let events = match &event_row {
                Some(stored_row) => {
                    self.prepare_events(tx, operation, &stored_model, stored_row, version)?
                }
                None => {
                    self.prepare_events(tx, operation, &stored_model, &stored_model, version)?
                }
            };
            wakes = self.plan_events(tx, events, &mut writes).await?;
        }
        writes.apply(tx).await?;
        self.wake_after_commit(tx, wakes);
        // A new row wakes this process's inbox subscriptions of the table after the commit.
        if matches!(mode, Mode::Insert | Mode::Upsert)
            && let Some(rows) = crate::event::wake::existing_wakeups(
                &self.db,
                &crate::event::wake::table_rows(&table),
            )
        {
            rows.wake_after_commit(tx, 0);
        }
        Ok(stored_model)
    }

    /// Decides the unique claims of the row's new entries: a claim another row holds refuses the
    /// write with [`TitoError::UniqueViolation`], unless a unique index still building tolerates
    /// a duplicate the row already had (its build reports it); a new claim is planned, so racing
    /// writers conflict on it. Claims the row no longer holds are released.
    async fn plan_claims(
        &self,
        tx: &E::Transaction,
        step: &RowWrite<'_>,
        new_entries: &[(Entry, IndexState)],
        prefetched: &mut HashMap<String, Option<Vec<u8>>>,
        writes: &mut engine::Writes,
    ) -> TitoResult<Claims> {
        let mut held: Vec<String> = Vec::new();
        let mut tolerated: HashSet<String> = HashSet::new();
        let mut old_claims: Option<HashSet<String>> = None;
        for (entry, state) in new_entries {
            let Some(claim) = &entry.claim else { continue };
            if held.contains(claim) || tolerated.contains(claim) {
                continue;
            }
            if step.old_listed.contains(claim) {
                held.push(claim.clone());
                continue;
            }
            let owner = match prefetched.remove(claim) {
                Some(owner) => owner,
                None => tx.get(claim.as_bytes()).await?,
            };
            match owner {
                Some(owner) if owner != step.id.as_bytes() => {
                    if *state == IndexState::Building {
                        let old = match &old_claims {
                            Some(old) => old,
                            None => old_claims.insert(step.claims_of_stored_row()?),
                        };
                        if old.contains(claim) {
                            tolerated.insert(claim.clone());
                            continue;
                        }
                    }
                    return Err(TitoError::UniqueViolation {
                        index: entry.index.clone(),
                        owner: String::from_utf8_lossy(&owner).into_owned(),
                    });
                }
                _ => writes.put(claim.clone(), step.id.as_bytes().to_vec()),
            }
            held.push(claim.clone());
        }
        for claim in step
            .old_listed
            .iter()
            .filter(|k| keys::is_claim_key_of(k, step.table) && !held.contains(k))
        {
            self.release_claim(tx, claim, step.id, writes).await?;
        }
        Ok(Claims { held, tolerated })
    }

    /// Plans the release of a claim the row held: read now, deleted with the other writes.
    pub(super) async fn release_claim(
        &self,
        tx: &E::Transaction,
        claim: &str,
        id: &str,
        writes: &mut engine::Writes,
    ) -> TitoResult<()> {
        let owner = tx.get(claim.as_bytes()).await?;
        // A claim held by another row is not ours to remove.
        if owner.as_deref() == Some(id.as_bytes()) {
            writes.delete(claim.as_bytes().to_vec());
        }
        Ok(())
    }
}

impl RowWrite<'_> {
    /// The claims the stored row's values take under the current plan (read only when a
    /// building unique index meets a duplicate).
    fn claims_of_stored_row(&self) -> TitoResult<HashSet<String>> {
        Ok(match self.stored {
            Some(s) => planned_entries(self.plan, self.configs, &s.row, self.table, self.id)?
                .into_iter()
                .filter_map(|(e, _)| e.claim)
                .collect(),
            None => HashSet::new(),
        })
    }
}

/// Plans the row, its index entries and its manifest: entries the row no longer has are
/// deleted, new ones written, copies rewritten only when the row changed (a key-only entry
/// never changes), the manifest and the row only when they changed.
fn plan_row(
    step: &RowWrite<'_>,
    new_entries: Vec<(Entry, IndexState)>,
    claims: Claims,
    row_key: String,
    row: &Value,
    json: Vec<u8>,
    writes: &mut engine::Writes,
) -> TitoResult<()> {
    let bytes = super::shape::encode(step.version, json);
    let kept: Vec<index::Entry> = new_entries
        .into_iter()
        .filter(|(e, _)| {
            e.claim
                .as_ref()
                .is_none_or(|c| !claims.tolerated.contains(c))
        })
        .map(|(e, _)| e)
        .collect();
    let row_changed = step
        .stored
        .is_none_or(|s| s.row != *row || s.version != step.version);
    let new_set: HashSet<&String> = kept.iter().map(|e| &e.key).chain(&claims.held).collect();
    for key in step
        .old_listed
        .iter()
        .filter(|k| !keys::is_claim_key_of(k, step.table) && !new_set.contains(k))
    {
        writes.delete(key.clone());
    }
    for entry in &kept {
        let fresh = !step.old_listed.contains(&entry.key);
        if fresh || (row_changed && !entry.key_only) {
            writes.put(entry.key.clone(), entry.value(&bytes));
        }
    }
    let manifest: Vec<String> = kept.into_iter().map(|e| e.key).chain(claims.held).collect();
    let keys_changed = step
        .stored
        .is_none_or(|s| s.manifest != manifest || s.manifest_version != step.plan.version);
    if keys_changed {
        writes.put(
            keys::manifest_key(step.table, step.id),
            encode_manifest(step.plan.version, &manifest)?,
        );
    }
    if row_changed {
        writes.put(row_key, bytes);
    }
    Ok(())
}

/// The shape version a write stores and the row's JSON in it: the code's own while the table's
/// catalog lets writers write it, else the newest shape writers may write, through the model's
/// downgrade. Without one the write is refused, naming the step that allows the code's shape.
pub(super) fn written_shape<T: TitoModelTrait>(
    model: &T,
    row: &Value,
    table: &str,
    writable: u32,
) -> TitoResult<(u32, Vec<u8>)> {
    if T::VERSION <= writable {
        return Ok((T::VERSION, serde_json::to_vec(row)?));
    }
    let downgraded = super::shape::guarded(T::VERSION, writable, || {
        model
            .downgrade(writable)
            .map_or(Err(ShapeError::Unknown), |r| r)
    });
    let downgraded = match downgraded {
        Err(ShapeError::Unknown) => None,
        other => Some(other),
    };
    // What older code will read is what this code reads back: the downgraded row must upgrade
    // again, to a row of the same id (else this code could not read its own write, or would
    // read it as another row).
    let downgraded = downgraded.map(|result| {
        result.and_then(|json| {
            let back = super::shape::guarded(writable, T::VERSION, || T::upgrade(writable, &json))
                .map_err(|reason| {
                    ShapeError::conversion(
                        T::VERSION,
                        writable,
                        format!("this code cannot read the row it gives back: {reason}"),
                    )
                })?;
            let id = model.id();
            let kept = |stored: &Value| match stored {
                Value::String(text) => *text == id,
                Value::Number(number) => number.to_string() == id,
                _ => true,
            };
            if let Ok(Value::Object(older)) = serde_json::from_slice::<Value>(&json)
                && let Some(stored) = older.get(T::ID_FIELD)
                && !kept(stored)
            {
                return Err(ShapeError::conversion(
                    T::VERSION,
                    writable,
                    format!(
                        "it wrote the id {stored} for the row {id:?} (a conversion must keep the \
                         row's id)"
                    ),
                ));
            }
            // Read back under the row's key, as a read would check it.
            super::shape::keeps_id(&keys::row_key(table, &id), &back)
                .map_err(|message| ShapeError::conversion(T::VERSION, writable, message))?;
            Ok(json)
        })
    });
    match downgraded {
        Some(Ok(json)) => Ok((writable, json)),
        Some(Err(reason)) => Err(TitoError::SchemaMismatch(format!(
            "table {table:?}: writers may write shape version {writable} while older code may \
             still run, and converting this row of version {} down to it failed: {reason}",
            T::VERSION
        ))),
        None => Err(TitoError::SchemaMismatch(format!(
            "table {table:?}: this code writes shape version {code} of {}, but the catalog lets \
             writers write version {writable} until every instance reads {code}; a \
             `downgrade = \"function\"` beside `from` (to the shape `from` names, one version \
             down: deploy one version at a time) lets this code write version {writable} \
             meanwhile, or, once no older code runs, allow version {code}: `tito table \
             allow-version {table} {code}` (or `tito::schema::allow_shape_version`)",
            std::any::type_name::<T>(),
            code = T::VERSION,
        ))),
    }
}

/// Refuses a row whose JSON would not read back as `T`. JSON has no NaN or infinity: serde
/// writes such an `f32`/`f64` as `null`, which the field then cannot be read from, so the row
/// would be stored and never read again. Only a row holding a `null` is decoded to check (one
/// without cannot have lost a float that way).
fn reads_back<T: TitoModelTrait>(row: &Value, table: &str, id: &str) -> TitoResult<()> {
    fn has_null(value: &Value) -> bool {
        match value {
            Value::Null => true,
            Value::Array(items) => items.iter().any(has_null),
            Value::Object(fields) => fields.values().any(has_null),
            _ => false,
        }
    }
    if !has_null(row) {
        return Ok(());
    }
    match serde_json::from_value::<T>(row.clone()) {
        Ok(_) => Ok(()),
        Err(err) => Err(TitoError::invalid_argument(format!(
            "the row {id:?} of table {table:?} would not read back ({err}): nothing was \
             written; a float holding NaN or infinity is written by JSON as null (store it as \
             an Option, or check it before the write)"
        ))),
    }
}
