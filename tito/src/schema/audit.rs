//! Audit and repair of a table against its ready indexes: every row's entries, claims and
//! manifest, then every entry, claim and manifest against the rows, in bounded batches whose
//! position and findings are stored after each batch (`schema-audit:{table}`), so a run killed
//! midway continues where it stopped.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use super::build::{read_catalog, scan_rows_with_manifests};
use super::{Catalog, DEFAULT_BATCH, IndexState};
use crate::engine::{TitoEngine, TitoTransaction};
use crate::error::{TitoError, TitoResult};
use crate::keys;
use crate::model::catalog::{PlannedIndex, TableHandle, WritePlan};
use crate::model::index::Entry;
use crate::model::{
    TitoModel, TitoModelTrait, encode_manifest, index_configs, parse_manifest, planned_entries,
};

/// How many keys of each kind a report names.
pub const FIRST_KEYS: usize = 10;

/// A kind of inconsistency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AuditKind {
    /// An index entry or claim a row implies is absent.
    MissingEntry,
    /// An index entry, claim or manifest that no row implies (its row is gone or holds other
    /// values), or a key a manifest names that its row does not imply.
    OrphanedEntry,
    /// An index entry whose copy of the row differs from the row (or, in an index of keys, an
    /// entry that holds anything).
    StaleClone,
    /// A row without a manifest.
    MissingManifest,
    /// A manifest that does not decode, or that does not name the keys its row implies.
    MalformedManifest,
    /// A unique claim a row implies that holds another row's id.
    WrongClaim,
    /// A row that does not decode into the model.
    MalformedRow,
    /// A row stored in a shape version the model's code does not read (newer than the code,
    /// not declared, or refused by a conversion): no code that ran the audit reads it. Delete
    /// it, or deploy code that converts it ([`crate::model::shape`]).
    UnreadableRow,
}

/// How many of one kind were found, and the first keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditFinding {
    /// How many.
    pub count: u64,
    /// The first [`FIRST_KEYS`] keys.
    pub first: Vec<String>,
}

/// What an audit found (and a repair fixed).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AuditReport {
    /// The table.
    pub table: String,
    /// Whether this was a repair.
    pub repair: bool,
    /// Rows checked.
    pub rows: u64,
    /// Index entries, claims and manifests checked against the rows.
    pub keys: u64,
    /// What was found, by kind.
    pub findings: BTreeMap<AuditKind, AuditFinding>,
    /// What a repair could not fix: claims that two rows both imply (duplicates), rows that do
    /// not decode.
    pub unrepaired: Vec<String>,
    /// Whether the run finished (a stored report of a killed run is unfinished).
    pub finished: bool,
}

impl AuditReport {
    /// Whether nothing was found.
    pub fn is_clean(&self) -> bool {
        self.findings.values().all(|f| f.count == 0)
    }

    /// How many of `kind` were found.
    pub fn count(&self, kind: AuditKind) -> u64 {
        self.findings.get(&kind).map_or(0, |f| f.count)
    }

    fn found(&mut self, kind: AuditKind, key: &str) {
        let finding = self.findings.entry(kind).or_default();
        finding.count += 1;
        if finding.first.len() < FIRST_KEYS {
            finding.first.push(key.to_string());
        }
    }
}

/// Where an audit or repair is, after a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// `rows`, `entries of {index}`, `claims of {index}` or `manifests`.
    pub phase: String,
    /// Rows checked so far.
    pub rows_done: u64,
    /// The table's size when the run started, counted up to a bound.
    pub rows_estimate: Option<u64>,
    /// Keys of the later phases checked so far.
    pub keys_done: u64,
}

/// The stored state of a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunState {
    phase: usize,
    cursor: Option<String>,
    rows_estimate: Option<u64>,
    report: AuditReport,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Rows,
    Entries(String),
    Claims(String),
    Manifests,
}

impl Phase {
    fn name(&self) -> String {
        match self {
            Phase::Rows => "rows".into(),
            Phase::Entries(index) => format!("entries of {index}"),
            Phase::Claims(index) => format!("claims of {index}"),
            Phase::Manifests => "manifests".into(),
        }
    }
}

/// What a row implies: its entries, its claims, and the indexes it cannot be checked against.
struct Implied {
    entries: Vec<Entry>,
    claims: Vec<String>,
    skipped: Vec<String>,
}

/// Planned entries as entries and the distinct claims among them.
fn split_claims(entries: Vec<(Entry, IndexState)>) -> (Vec<Entry>, Vec<String>) {
    let mut out = Vec::new();
    let mut claims = Vec::new();
    for (entry, _) in entries {
        if let Some(claim) = &entry.claim
            && !claims.contains(claim)
        {
            claims.push(claim.clone());
        }
        out.push(entry);
    }
    (out, claims)
}

/// The plan of what rows must hold: the catalog's ready indexes (all of the code's without a
/// catalog). Ready indexes whose condition this code lacks cannot be checked and are skipped.
fn audit_plan(handle: &TableHandle, catalog: Option<&Catalog>) -> TitoResult<WritePlan> {
    let definitions = |name: &str| {
        catalog
            .and_then(|c| c.indexes.get(name).map(|e| e.definition.clone()))
            .or_else(|| handle.code.definitions.get(name).cloned())
    };
    Ok(plan_of(handle, catalog)?.with_stored_shapes(definitions))
}

fn plan_of(handle: &TableHandle, catalog: Option<&Catalog>) -> TitoResult<WritePlan> {
    let Some(catalog) = catalog else {
        return handle.plan(None);
    };
    let mut indexes = Vec::new();
    for (name, entry) in &catalog.indexes {
        if entry.state != IndexState::Ready {
            continue;
        }
        let stored = match handle.code.definitions.get(name) {
            Some(definition) if *definition == entry.definition => None,
            _ if entry.definition.condition.is_none() => Some(entry.definition.config(name)?),
            _ => continue,
        };
        indexes.push(PlannedIndex::new(
            name,
            &entry.definition,
            IndexState::Ready,
            stored,
        ));
    }
    Ok(WritePlan {
        version: catalog.version,
        // Builds and audits write entries, never rows.
        writable: u32::MAX,
        indexes,
    })
}

fn phases(plan: &WritePlan) -> Vec<Phase> {
    let mut out = vec![Phase::Rows];
    for index in &plan.indexes {
        out.push(Phase::Entries(index.name.clone()));
        if index.unique {
            out.push(Phase::Claims(index.name.clone()));
        }
    }
    out.push(Phase::Manifests);
    out
}

/// The last audit or repair of a table, finished or not (for dashboards and tools).
pub async fn last_audit<E: TitoEngine>(db: &E, table: &str) -> TitoResult<Option<AuditReport>> {
    crate::engine::read_only(db, async |tx| {
        let key = keys::schema_audit_key(table);
        match tx.get(key.as_bytes()).await? {
            Some(bytes) => Ok(Some(parse_state(&key, &bytes)?.report)),
            None => Ok(None),
        }
    })
    .await
}

fn parse_state(key: &str, bytes: &[u8]) -> TitoResult<RunState> {
    serde_json::from_slice(bytes)
        .map_err(|err| TitoError::Integrity(format!("audit state {key:?} is malformed: {err}")))
}

impl<E: TitoEngine, T: TitoModelTrait> TitoModel<E, T> {
    /// Checks the table against its ready indexes and reports every inconsistency, with counts
    /// and the first keys of each kind; writes nothing but its own progress. `progress` is
    /// called after every batch. A run that was killed continues where it stopped.
    pub async fn audit(&self, progress: impl FnMut(&Progress)) -> TitoResult<AuditReport> {
        self.run_audit(false, progress).await
    }

    /// [`Self::audit`] that also fixes what it finds, in the same bounded batches: missing and
    /// stale entries are written from the row, orphans deleted, claims given back to the row
    /// that implies them, manifests rewritten. Claims two rows both imply and rows that do not
    /// decode are left and listed in [`AuditReport::unrepaired`].
    pub async fn repair(&self, progress: impl FnMut(&Progress)) -> TitoResult<AuditReport> {
        self.run_audit(true, progress).await
    }

    /// The last audit or repair of this table.
    pub async fn last_audit(&self) -> TitoResult<Option<AuditReport>> {
        last_audit(self.engine(), &T::default().table()).await
    }

    async fn run_audit(
        &self,
        repair: bool,
        mut progress: impl FnMut(&Progress),
    ) -> TitoResult<AuditReport> {
        let handle = TableHandle::of::<E, T>(self.engine()).await?;
        loop {
            let this = self.clone();
            let shared = handle.clone();
            let (state, phase_name) = self
                .engine()
                .transaction(|tx| async move { this.audit_batch(&tx, &shared, repair).await })
                .await?;
            progress(&Progress {
                phase: phase_name,
                rows_done: state.report.rows,
                rows_estimate: state.rows_estimate,
                keys_done: state.report.keys,
            });
            if state.report.finished {
                return Ok(state.report);
            }
        }
    }

    async fn audit_batch(
        &self,
        tx: &E::Transaction,
        handle: &TableHandle,
        repair: bool,
    ) -> TitoResult<(RunState, String)> {
        let table = handle.table().to_string();
        let state_key = keys::schema_audit_key(&table);
        let catalog = read_catalog(tx, &table).await?;
        let plan = audit_plan(handle, catalog.as_ref())?;
        let phases = phases(&plan);
        let mut state = match tx.get(state_key.as_bytes()).await? {
            Some(bytes) => {
                let state = parse_state(&state_key, &bytes)?;
                (!state.report.finished && state.report.repair == repair).then_some(state)
            }
            None => None,
        };
        if state.is_none() {
            state = Some(RunState {
                phase: 0,
                cursor: None,
                rows_estimate: super::estimate_rows(tx, &table, super::ESTIMATE_CAP).await?,
                report: AuditReport {
                    table: table.clone(),
                    repair,
                    ..AuditReport::default()
                },
            });
        }
        let mut state = state.unwrap_or_else(|| unreachable!());
        let phase = phases.get(state.phase).cloned().unwrap_or(Phase::Manifests);
        let done = match &phase {
            Phase::Rows => self.audit_rows(tx, &plan, &mut state, repair).await?,
            Phase::Entries(index) => {
                let prefix = keys::index_prefix(&table, index, &[])?;
                self.audit_keys(tx, &plan, &mut state, repair, &prefix, KeySort::Entry)
                    .await?
            }
            Phase::Claims(index) => {
                let prefix = keys::unique_prefix(&table, index);
                self.audit_keys(tx, &plan, &mut state, repair, &prefix, KeySort::Claim)
                    .await?
            }
            Phase::Manifests => {
                let prefix = format!("reverse-index:{}", keys::table_prefix(&table));
                self.audit_keys(tx, &plan, &mut state, repair, &prefix, KeySort::Manifest)
                    .await?
            }
        };
        if done {
            state.phase += 1;
            state.cursor = None;
            if state.phase >= phases.len() {
                state.report.finished = true;
            }
        }
        tx.put(state_key.into_bytes(), serde_json::to_vec(&state)?)
            .await?;
        Ok((state, phase.name()))
    }

    /// The keys a row implies under `plan` (its entries, each with its layout, and its claims),
    /// or the kind of finding when it does not decode. A row stored in another shape version
    /// than the code's implies what its writer wrote: the indexes' definitions applied to the
    /// row as stored; those whose condition is code cannot be told and are left unchecked.
    fn implied(
        &self,
        plan: &WritePlan,
        table: &str,
        id: &str,
        bytes: &[u8],
    ) -> Result<Implied, AuditKind> {
        let row_key = keys::row_key(table, id);
        let row = match crate::model::shape::row_value::<T>(&row_key, bytes) {
            Ok(row) => row,
            Err(TitoError::RowShape { .. }) => return Err(AuditKind::UnreadableRow),
            Err(_) => return Err(AuditKind::MalformedRow),
        };
        let stored_version = crate::model::shape::split(bytes).map(|(v, _)| v);
        if stored_version != Some(T::VERSION) {
            let (stored_plan, skipped) = plan.for_stored_shape();
            let (_, stored) = crate::model::shape::stored_value(&row_key, bytes)
                .map_err(|_| AuditKind::MalformedRow)?;
            let (entries, claims) = split_claims(
                planned_entries(&stored_plan, &[], &stored, table, id)
                    .map_err(|_| AuditKind::MalformedRow)?,
            );
            return Ok(Implied {
                entries,
                claims,
                skipped,
            });
        }
        let (entries, claims) = self
            .implied_by(plan, table, id, &row_key, bytes, row)
            .ok_or(AuditKind::MalformedRow)?;
        Ok(Implied {
            entries,
            claims,
            skipped: Vec::new(),
        })
    }

    fn implied_by(
        &self,
        plan: &WritePlan,
        table: &str,
        id: &str,
        row_key: &str,
        bytes: &[u8],
        row: serde_json::Value,
    ) -> Option<(Vec<Entry>, Vec<String>)> {
        let code = if plan.indexes.iter().any(|i| i.stored.is_none()) {
            let model: T = crate::model::decode_model(row_key, bytes).ok()?;
            index_configs(&model).ok()?
        } else {
            Vec::new()
        };
        let entries = planned_entries(plan, &code, &row, table, id).ok()?;
        Some(split_claims(entries))
    }

    /// One batch of the row phase; returns whether the phase is over.
    async fn audit_rows(
        &self,
        tx: &E::Transaction,
        plan: &WritePlan,
        state: &mut RunState,
        repair: bool,
    ) -> TitoResult<bool> {
        let table = T::default().table();
        let (rows, manifests) =
            scan_rows_with_manifests(tx, &table, state.cursor.as_deref(), DEFAULT_BATCH).await?;
        for ((id, bytes), manifest) in rows.iter().zip(&manifests) {
            let row_key = keys::row_key(&table, id);
            let manifest_key = keys::manifest_key(&table, id);
            let report = &mut state.report;
            report.rows += 1;
            let Implied {
                entries,
                claims,
                skipped,
            } = match self.implied(plan, &table, id, bytes) {
                Ok(implied) => implied,
                Err(kind) => {
                    report.found(kind, &row_key);
                    if repair {
                        report.unrepaired.push(row_key);
                    }
                    continue;
                }
            };
            let listed: Option<Vec<String>> = match manifest {
                None => {
                    report.found(AuditKind::MissingManifest, &manifest_key);
                    None
                }
                Some(m) => match parse_manifest(&manifest_key, m) {
                    Ok((_, listed)) => Some(listed),
                    Err(_) => {
                        report.found(AuditKind::MalformedManifest, &manifest_key);
                        None
                    }
                },
            };
            let wanted: Vec<Vec<u8>> = entries
                .iter()
                .map(|e| &e.key)
                .chain(&claims)
                .map(|k| k.clone().into_bytes())
                .collect();
            let present = tx.batch_get(&wanted).await?;
            let mut manifest_out: Vec<String> = Vec::new();
            for (entry, value) in entries.iter().zip(&present) {
                let key = &entry.key;
                // A copy must equal the row; a key-only entry must be empty.
                let expected = entry.value(bytes);
                match value {
                    None => {
                        report.found(AuditKind::MissingEntry, key);
                        if repair {
                            tx.put(key.clone().into_bytes(), expected).await?;
                        }
                    }
                    Some(held) if *held != expected => {
                        report.found(AuditKind::StaleClone, key);
                        if repair {
                            tx.put(key.clone().into_bytes(), expected).await?;
                        }
                    }
                    Some(_) => {}
                }
                manifest_out.push(key.clone());
            }
            for (claim, owner) in claims.iter().zip(&present[entries.len()..]) {
                match owner {
                    None => {
                        report.found(AuditKind::MissingEntry, claim);
                        if repair {
                            tx.put(claim.clone().into_bytes(), id.clone().into_bytes())
                                .await?;
                        }
                    }
                    Some(owner) if owner != id.as_bytes() => {
                        report.found(AuditKind::WrongClaim, claim);
                        if repair {
                            let other = String::from_utf8_lossy(owner).into_owned();
                            if self
                                .row_implies_claim(tx, plan, &table, &other, claim)
                                .await?
                            {
                                report.unrepaired.push(format!(
                                    "{claim} (rows {other:?} and {id:?} hold the same values)"
                                ));
                                continue;
                            }
                            tx.put(claim.clone().into_bytes(), id.clone().into_bytes())
                                .await?;
                        }
                    }
                    Some(_) => {}
                }
                manifest_out.push(claim.clone());
            }
            if let Some(listed) = &listed {
                let implied: HashSet<&String> =
                    entries.iter().map(|e| &e.key).chain(&claims).collect();
                let live = |key: &String| {
                    keys::index_name_of(key, &table)
                        .is_some_and(|index| plan.is_live(&index) && !skipped.contains(&index))
                };
                let mut mismatch = false;
                for key in listed {
                    if live(key) && !implied.contains(key) {
                        report.found(AuditKind::OrphanedEntry, key);
                        mismatch = true;
                        if repair {
                            let owned = !keys::is_claim_key_of(key, &table)
                                || tx.get(key.as_bytes()).await?.as_deref() == Some(id.as_bytes());
                            if owned {
                                tx.delete(key.clone().into_bytes()).await?;
                            }
                        }
                    } else if !live(key) {
                        // Keys of indexes that are building or dropping stay as listed.
                        manifest_out.push(key.clone());
                    }
                }
                if implied.iter().any(|k| !listed.contains(k)) {
                    report.found(AuditKind::MalformedManifest, &manifest_key);
                    mismatch = true;
                }
                if !mismatch {
                    continue;
                }
            }
            if repair {
                manifest_out.dedup();
                tx.put(
                    manifest_key.into_bytes(),
                    encode_manifest(plan.version, &manifest_out)?,
                )
                .await?;
            }
        }
        if let Some((last, _)) = rows.last() {
            state.cursor = Some(last.clone());
        }
        Ok(rows.len() < DEFAULT_BATCH)
    }

    async fn row_implies_claim(
        &self,
        tx: &E::Transaction,
        plan: &WritePlan,
        table: &str,
        id: &str,
        claim: &str,
    ) -> TitoResult<bool> {
        let Some(bytes) = tx.get(keys::row_key(table, id).as_bytes()).await? else {
            return Ok(false);
        };
        Ok(self
            .implied(plan, table, id, &bytes)
            .is_ok_and(|implied| implied.claims.iter().any(|c| c == claim)))
    }

    /// One batch of a key phase (entries, claims or manifests under `prefix`): every key must
    /// be implied by an existing row. Returns whether the phase is over.
    async fn audit_keys(
        &self,
        tx: &E::Transaction,
        plan: &WritePlan,
        state: &mut RunState,
        repair: bool,
        prefix: &str,
        sort: KeySort,
    ) -> TitoResult<bool> {
        let table = T::default().table();
        let start = match &state.cursor {
            Some(cursor) => keys::key_after(cursor.clone()),
            None => prefix.to_string(),
        };
        let end = keys::prefix_end(prefix.to_string());
        let found = tx
            .scan(start.as_bytes(), end.as_bytes(), DEFAULT_BATCH)
            .await?;
        // The row each key belongs to.
        let mut owners: Vec<Option<String>> = Vec::with_capacity(found.len());
        for (key, value) in &found {
            let text = keys::key_str(key)?;
            owners.push(match sort {
                KeySort::Entry => keys::index_key_row(text)
                    .ok()
                    .filter(|(t, _)| *t == table)
                    .map(|(_, id)| id),
                KeySort::Claim => std::str::from_utf8(value).ok().map(str::to_string),
                KeySort::Manifest => text
                    .strip_prefix("reverse-index:")
                    .and_then(|row| keys::row_key_id(row, &table)),
            });
        }
        let wanted: Vec<Vec<u8>> = owners
            .iter()
            .flatten()
            .map(|id| keys::row_key(&table, id).into_bytes())
            .collect();
        let mut fetched = tx.batch_get(&wanted).await?.into_iter();
        let rows: Vec<Option<Vec<u8>>> = owners
            .iter()
            .map(|owner| owner.as_ref().and_then(|_| fetched.next().flatten()))
            .collect();
        // The keys each owner's manifest lists: the row phase judged those already (a key
        // counted there is not counted again here).
        let listed: Vec<Vec<String>> = match sort {
            KeySort::Manifest => vec![Vec::new(); owners.len()],
            _ => {
                let manifest_keys: Vec<Vec<u8>> = owners
                    .iter()
                    .flatten()
                    .map(|id| keys::manifest_key(&table, id).into_bytes())
                    .collect();
                let mut manifests = tx.batch_get(&manifest_keys).await?.into_iter();
                owners
                    .iter()
                    .map(|owner| {
                        let manifest = owner.as_ref().and_then(|_| manifests.next().flatten());
                        match (owner, manifest) {
                            (Some(id), Some(bytes)) => {
                                parse_manifest(&keys::manifest_key(&table, id), &bytes)
                                    .map(|(_, listed)| listed)
                                    .unwrap_or_default()
                            }
                            _ => Vec::new(),
                        }
                    })
                    .collect()
            }
        };
        for ((((key, _), owner), row), listed) in found.iter().zip(&owners).zip(&rows).zip(&listed)
        {
            let text = keys::key_str(key)?;
            state.report.keys += 1;
            let implied = match (owner, row) {
                (Some(_), Some(_)) if listed.iter().any(|k| k == text) => true,
                (Some(id), Some(bytes)) => match sort {
                    KeySort::Manifest => true,
                    _ => match self.implied(plan, &table, id, bytes) {
                        // A row that does not decode was reported in the row phase.
                        Err(_) => true,
                        Ok(implied) => {
                            keys::index_name_of(text, &table)
                                .is_some_and(|index| implied.skipped.contains(&index))
                                || match sort {
                                    KeySort::Entry => implied.entries.iter().any(|e| e.key == text),
                                    _ => implied.claims.iter().any(|k| k == text),
                                }
                        }
                    },
                },
                _ => false,
            };
            if !implied {
                state.report.found(AuditKind::OrphanedEntry, text);
                if repair {
                    tx.delete(key.clone()).await?;
                }
            }
        }
        if let Some((last, _)) = found.last() {
            state.cursor = Some(keys::key_str(last)?.to_string());
        }
        Ok(found.len() < DEFAULT_BATCH)
    }
}

/// What a key phase walks.
#[derive(Clone, Copy)]
enum KeySort {
    Entry,
    Claim,
    Manifest,
}
