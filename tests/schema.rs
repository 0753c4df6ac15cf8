//! Schema evolution: indexes added to a table with rows are built online while writers keep
//! going (old and new code side by side), dropped indexes leave nothing behind, unique builds
//! over duplicates stop without changing rows, redefinitions are refused, queries on unready
//! indexes say so, audit finds corruption written through the engine and repair fixes it, and
//! a build killed with SIGKILL resumes from its cursor. Written once, run on every backend.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::model::{TitoModelTrait, TitoOptions};
use tito::schema::{AuditKind, IndexState};
use tito::{TitoEngine, TitoError, TitoModel, TitoTransaction};

use crate::support::{Ctx, read, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! schema_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            schema,
            [
                a_new_index_on_a_busy_table_matches_a_filtered_scan,
                older_code_is_refused_only_for_conditions_it_lacks,
                a_drop_removes_every_entry_and_claim,
                a_unique_build_over_duplicates_stops_and_changes_no_row,
                a_changed_definition_is_refused_with_a_rename_hint,
                audit_finds_each_kind_and_repair_fixes_it,
                queue_maintenance_builds_indexes,
                bad_batch_sizes_are_refused,
            ]
        );
    };
}

mod embedded {
    crate::schema_suite!(crate::support::EmbeddedBackend);
}

mod tikv {
    crate::schema_suite!(crate::support::TikvBackend);
}

mod memory {
    crate::schema_suite!(crate::support::MemoryBackend);
}

/// The first deploy: one index.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
pub struct MemberV1 {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

/// The next deploy: a plain index more.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
#[tito(index = "by_name: name")]
pub struct MemberV2 {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

/// A deploy after that: a conditional index more.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
#[tito(index = "by_name: name")]
#[tito(index = "active_by_team: team", condition = "is_active")]
pub struct MemberV3 {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

impl MemberV3 {
    fn is_active(&self) -> bool {
        self.active
    }
}

/// The first deploy with a unique email index.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team")]
#[tito(unique_index = "by_email: email")]
pub struct MemberUnique {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

/// A deploy that keeps only a name index.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_name: name")]
pub struct MemberNameOnly {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

/// `by_team` redefined under its old name.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "by_team: team, name")]
pub struct MemberRedefined {
    pub id: String,
    pub team: String,
    pub name: String,
    pub email: String,
    pub active: bool,
}

const TEAMS: [&str; 5] = ["core", "web", "data", "ops", "sales"];
const NAMES: [&str; 7] = ["ada", "bo", "cy", "di", "ed", "flo", "gus"];

fn member<T: From<MemberV1>>(n: u64) -> T {
    T::from(MemberV1 {
        id: format!("m{n:06}"),
        team: TEAMS[(n % 5) as usize].into(),
        name: NAMES[(n % 7) as usize].into(),
        email: format!("m{n}@example.com"),
        active: n.is_multiple_of(2),
    })
}

macro_rules! from_v1 {
    ($($t:ty),*) => {$(
        impl From<MemberV1> for $t {
            fn from(m: MemberV1) -> Self {
                Self { id: m.id, team: m.team, name: m.name, email: m.email, active: m.active }
            }
        }
    )*};
}
from_v1!(
    MemberV2,
    MemberV3,
    MemberUnique,
    MemberNameOnly,
    MemberRedefined
);

/// Inserts rows in transactions of 200.
async fn load<E: TitoEngine, T: TitoModelTrait>(db: &E, rows: Vec<T>) {
    let model = db.clone().model::<T>();
    for chunk in rows.chunks(200) {
        let chunk = chunk.to_vec();
        let model = model.clone();
        db.transaction(|tx| async move {
            for row in chunk {
                model
                    .build_with_options(row, TitoOptions::default(), &tx)
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
}

/// Every row of the table, through a model.
async fn all_rows<E: TitoEngine, T: TitoModelTrait>(model: &TitoModel<E, T>) -> Vec<T> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = model
            .find()
            .limit(Some(1000))
            .cursor(cursor)
            .execute()
            .await
            .unwrap();
        out.extend(page.items);
        match page.cursor {
            Some(next) => cursor = Some(next),
            None => return out,
        }
    }
}

/// Every id an index query returns for one value, through every page.
async fn index_ids<E: TitoEngine, T: TitoModelTrait>(
    model: &TitoModel<E, T>,
    index: &str,
    value: &str,
) -> TitoResultIds {
    let mut out = BTreeSet::new();
    let mut cursor = None;
    loop {
        let page = model
            .query_by_index(index)
            .value(value)
            .limit(Some(1000))
            .cursor(cursor)
            .execute()
            .await?;
        out.extend(page.items.iter().map(|m| m.id()));
        match page.cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(out),
        }
    }
}

type TitoResultIds = Result<BTreeSet<String>, TitoError>;

/// Keys under a prefix.
async fn keys_under<E: TitoEngine>(db: &E, prefix: &str) -> Vec<String> {
    let tx = db.begin().await.unwrap();
    let end = tito::keys::prefix_end(prefix.to_string());
    let mut out = Vec::new();
    let mut from = prefix.as_bytes().to_vec();
    loop {
        let page = tx.scan(&from, end.as_bytes(), 1000).await.unwrap();
        let Some((last, _)) = page.last() else { break };
        from = tito::keys::key_after_bytes(last);
        out.extend(page.into_iter().map(|(k, _)| String::from_utf8(k).unwrap()));
    }
    tx.rollback().await.unwrap();
    out
}

fn state_of(schema: &tito::schema::TableSchema, index: &str) -> Option<IndexState> {
    schema
        .indexes
        .iter()
        .find(|i| i.name == index)
        .map(|i| i.state)
}

/// Builds and drops wait this long after a catalog change (the default is ten seconds).
fn short_grace<E: TitoEngine>(db: &E) {
    tito::schema::set_write_grace(db, Duration::from_millis(50)).unwrap();
}

fn rows_for_busy_table() -> u64 {
    std::env::var("TITO_SCHEMA_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

pub async fn a_new_index_on_a_busy_table_matches_a_filtered_scan<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let rows = rows_for_busy_table();
    let v1 = ctx.db.clone().model::<MemberV1>();
    load(&ctx.db, (0..rows).map(member::<MemberV1>).collect()).await;
    assert_eq!(
        state_of(&v1.schema().await.unwrap(), "by_team"),
        Some(IndexState::Ready)
    );

    // The new code registers its index as building; queries on it are refused with progress.
    let v2 = ctx.db.clone().model::<MemberV2>();
    let schema = v2.schema().await.unwrap();
    assert_eq!(state_of(&schema, "by_name"), Some(IndexState::Building));
    assert_eq!(schema.version, 2);
    let err = v2.by_name("ada").execute().await.unwrap_err();
    match &err {
        TitoError::IndexNotReady { index, state, .. } => {
            assert_eq!(index, "by_name");
            assert_eq!(state, "building (0 rows)");
        }
        other => panic!("expected IndexNotReady, got {other:?}"),
    }
    // The first batch counts the table; progress says how far the build is.
    let first = loop {
        let step = v2.schema_step(256).await.unwrap();
        match step.waiting {
            // The write grace after the registration.
            Some(wait) => tokio::time::sleep(wait).await,
            None => break step,
        }
    };
    assert_eq!(first.handled, 256);
    assert_eq!(first.progress.rows_estimate, Some(rows));
    tokio::time::sleep(tito::schema::CATALOG_REFRESH).await;
    match v2.by_name("ada").execute().await.unwrap_err() {
        TitoError::IndexNotReady { state, .. } => {
            assert_eq!(state, format!("building (256 of about {rows} rows)"))
        }
        other => panic!("expected IndexNotReady, got {other:?}"),
    }

    // Writers of both deploys keep changing names while the index builds.
    let stop = Arc::new(AtomicBool::new(false));
    let updates = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (db, stop, updates) = (ctx.db.clone(), stop.clone(), updates.clone());
        writers.push(tokio::spawn(async move {
            let mut n = w * 7919 + 1;
            while !stop.load(Ordering::Relaxed) {
                n = (n * 48271) % 2_147_483_647;
                let id = format!("m{:06}", n % rows);
                let name = NAMES[(n / 7 % 7) as usize].to_string();
                let result = if w % 2 == 0 {
                    let m = db.clone().model::<MemberV1>();
                    match m.find_by_id(&id, vec![]).await {
                        Ok(mut row) => {
                            row.name = name;
                            m.update(row).await.map(|_| ())
                        }
                        Err(err) => Err(err),
                    }
                } else {
                    let m = db.clone().model::<MemberV2>();
                    match m.find_by_id(&id, vec![]).await {
                        Ok(mut row) => {
                            row.name = name;
                            m.update(row).await.map(|_| ())
                        }
                        Err(err) => Err(err),
                    }
                };
                // A steady stream of updates, not a flood: about 250 a second per writer.
                tokio::time::sleep(Duration::from_millis(4)).await;
                match result {
                    Ok(()) => {
                        updates.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TitoError::RetriesExhausted { .. }) => {}
                    Err(other) => panic!("a writer failed: {other:?}"),
                }
            }
        }));
    }
    let mut steps = 0;
    let mut last_done = 0;
    let started = Instant::now();
    let schema = v2
        .build_indexes(|step| {
            steps += 1;
            assert!(
                step.progress.rows_done >= last_done,
                "progress moves forward"
            );
            last_done = step.progress.rows_done;
        })
        .await
        .unwrap();
    let took = started.elapsed();
    // A few writes after the build too.
    let during = updates.load(Ordering::Relaxed);
    wait_for("writes after the build", Duration::from_secs(30), || {
        let updates = updates.clone();
        async move { updates.load(Ordering::Relaxed) >= during + 20 }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }
    assert_eq!(state_of(&schema, "by_name"), Some(IndexState::Ready));
    assert!(steps as u64 >= rows / 256, "bounded batches: {steps}");
    assert_eq!(last_done, rows);
    assert!(during > 0, "writers ran during the build");
    println!(
        "built by_name over {rows} rows in {took:?} ({steps} batches) with {during} concurrent updates"
    );

    // Exactly what a filtered table scan returns, for every value.
    let table = all_rows(&v2).await;
    assert_eq!(table.len() as u64, rows);
    for name in NAMES {
        let expected: BTreeSet<String> = table
            .iter()
            .filter(|m| m.name == name)
            .map(|m| m.id.clone())
            .collect();
        let found = index_ids(&v2, "by_name", name).await.unwrap();
        assert_eq!(found, expected, "by_name = {name}");
    }
    let clean = v2.audit(|_| {}).await.unwrap();
    assert!(clean.is_clean(), "{clean:?}");
}

pub async fn older_code_is_refused_only_for_conditions_it_lacks<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let v1 = ctx.db.clone().model::<MemberV1>();
    load(&ctx.db, (0..300).map(member::<MemberV1>).collect()).await;
    let v2 = ctx.db.clone().model::<MemberV2>();
    v2.build_indexes(|_| {}).await.unwrap();

    // The older deploy restarts: it changes nothing in the catalog and keeps the plain index
    // it does not know complete.
    let mut row = v1.find_by_id("m000001", vec![]).await.unwrap();
    row.name = "zed".into();
    v1.update(row).await.unwrap();
    v1.build(member::<MemberV1>(1000)).await.unwrap();
    assert_eq!(v2.schema().await.unwrap().version, 3);
    assert_eq!(
        index_ids(&v2, "by_name", "zed").await.unwrap(),
        BTreeSet::from(["m000001".to_string()])
    );
    let newcomer: MemberV1 = member(1000);
    assert!(
        index_ids(&v2, "by_name", &newcomer.name)
            .await
            .unwrap()
            .contains("m001000")
    );

    // A conditional index the older deploys lack: their writes are refused, naming both
    // schema versions; the new deploy writes.
    let v3 = ctx.db.clone().model::<MemberV3>();
    let schema = v3.schema().await.unwrap();
    assert_eq!(
        state_of(&schema, "active_by_team"),
        Some(IndexState::Building)
    );
    for err in [
        v1.build(member::<MemberV1>(2000)).await.unwrap_err(),
        v2.build(member::<MemberV2>(2001)).await.unwrap_err(),
    ] {
        match &err {
            TitoError::SchemaMismatch(message) => {
                assert!(message.contains("schema version 4"), "{message}");
                // The older code's own version: 1 for the first deploy, 3 for the second (its
                // build finished at 3).
                assert!(
                    message.contains("(schema version 1)")
                        || message.contains("(schema version 3)"),
                    "{message}"
                );
                assert!(message.contains("is_active"), "{message}");
            }
            other => panic!("expected SchemaMismatch, got {other:?}"),
        }
    }
    assert!(matches!(
        v1.find_by_id("m002000", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
    v3.build(member::<MemberV3>(2002)).await.unwrap();
    v3.build_indexes(|_| {}).await.unwrap();
    let expected: BTreeSet<String> = all_rows(&v3)
        .await
        .into_iter()
        .filter(|m| m.active && m.team == "core")
        .map(|m| m.id)
        .collect();
    assert_eq!(
        index_ids(&v3, "active_by_team", "core").await.unwrap(),
        expected
    );
    // Reads of the older deploys still work.
    assert_eq!(v1.by_team("core").execute().await.unwrap().items.len(), 61);
}

pub async fn a_drop_removes_every_entry_and_claim<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let old = ctx.db.clone().model::<MemberUnique>();
    load(&ctx.db, (0..300).map(member::<MemberUnique>).collect()).await;
    assert_eq!(
        keys_under(&ctx.db, "index:member:by_team:").await.len(),
        300
    );
    assert_eq!(
        keys_under(&ctx.db, "unique:member:by_email:").await.len(),
        300
    );
    // An orphan no manifest names goes too.
    ctx.db
        .transaction(|tx| async move {
            tx.put(
                b"index:member:by_team:team:gone:table:member:nobody".to_vec(),
                b"{}".to_vec(),
            )
            .await
        })
        .await
        .unwrap();

    let new = ctx.db.clone().model::<MemberNameOnly>();
    let schema = new.schema().await.unwrap();
    assert_eq!(state_of(&schema, "by_team"), Some(IndexState::Dropping));
    assert_eq!(state_of(&schema, "by_email"), Some(IndexState::Dropping));
    assert_eq!(state_of(&schema, "by_name"), Some(IndexState::Building));
    assert!(matches!(
        old.by_team("core").execute().await,
        Err(TitoError::IndexNotReady { .. })
    ));

    // The name cannot come back while its drop runs.
    let again = ctx.db.clone().model::<MemberV2>();
    match again.schema().await.unwrap_err() {
        TitoError::SchemaMismatch(message) => {
            assert!(message.contains("still being dropped"), "{message}")
        }
        other => panic!("expected SchemaMismatch, got {other:?}"),
    }

    let schema = new.build_indexes(|_| {}).await.unwrap();
    let names: Vec<&str> = schema.indexes.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["by_name"]);
    assert_eq!(state_of(&schema, "by_name"), Some(IndexState::Ready));
    assert!(
        keys_under(&ctx.db, "index:member:by_team:")
            .await
            .is_empty()
    );
    assert!(
        keys_under(&ctx.db, "unique:member:by_email:")
            .await
            .is_empty()
    );
    for manifest in keys_under(&ctx.db, "reverse-index:table:member:").await {
        let text = String::from_utf8(read(&ctx.db, manifest.as_bytes()).await.unwrap()).unwrap();
        assert!(
            !text.contains("by_team") && !text.contains("by_email"),
            "{text}"
        );
        assert!(text.contains("by_name"), "{text}");
    }
    assert!(keys_under(&ctx.db, "schema-progress:").await.is_empty());
    let audit = new.audit(|_| {}).await.unwrap();
    assert!(audit.is_clean(), "{audit:?}");

    // Once dropped, the name is free again: a later deploy brings it back and builds it.
    let back = ctx.db.clone().model::<MemberV2>();
    back.build_indexes(|_| {}).await.unwrap();
    assert_eq!(
        back.by_team("core").execute().await.unwrap().items.len(),
        60
    );
}

pub async fn a_unique_build_over_duplicates_stops_and_changes_no_row<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let plain = ctx.db.clone().model::<MemberV1>();
    let mut rows: Vec<MemberV1> = (0..600).map(member).collect();
    rows[10].email = "same@example.com".into();
    rows[20].email = "same@example.com".into();
    rows[510].email = "twin@example.com".into();
    rows[520].email = "twin@example.com".into();
    load(&ctx.db, rows).await;
    let before = all_rows(&plain).await;

    let unique = ctx.db.clone().model::<MemberUnique>();
    let err = unique.build_indexes(|_| {}).await.unwrap_err();
    let TitoError::DuplicateValues { index, rows, .. } = &err else {
        panic!("expected DuplicateValues, got {err:?}");
    };
    assert_eq!(index, "by_email");
    assert_eq!(rows, &[("m000010".to_string(), "m000020".to_string())]);
    assert!(err.to_string().contains("m000010"), "{err}");
    assert_eq!(all_rows(&plain).await, before, "no row changed");
    let schema = unique.schema().await.unwrap();
    let status = schema
        .indexes
        .iter()
        .find(|i| i.name == "by_email")
        .unwrap();
    assert_eq!(status.state, IndexState::Building);
    assert!(
        status
            .progress
            .as_ref()
            .unwrap()
            .failure
            .as_ref()
            .unwrap()
            .contains("m000020"),
        "{status:?}"
    );
    match unique
        .by_email("m1@example.com")
        .execute()
        .await
        .unwrap_err()
    {
        TitoError::IndexNotReady { state, .. } => assert!(state.contains("stopped"), "{state}"),
        other => panic!("expected IndexNotReady, got {other:?}"),
    }
    // Stopped is stopped: another call finds nothing to do until it is restarted.
    unique.build_indexes(|_| {}).await.unwrap();

    // While it builds, writers claim values: the first writer of a duplicated value takes it,
    // the other row keeping the value is tolerated, and a new row with it is refused.
    for id in ["m000020", "m000010"] {
        let mut kept = unique.find_by_id(id, vec![]).await.unwrap();
        kept.name = "renamed".into();
        unique.update(kept).await.unwrap();
    }
    let mut copycat: MemberUnique = member(900);
    copycat.email = "same@example.com".into();
    assert!(matches!(
        unique.build(copycat).await,
        Err(TitoError::UniqueViolation { .. })
    ));

    // Fix the rows, start the build again: it completes.
    for (id, email) in [
        ("m000020", "fixed20@example.com"),
        ("m000520", "fixed520@example.com"),
    ] {
        let mut row = unique.find_by_id(id, vec![]).await.unwrap();
        row.email = email.into();
        unique.update(row).await.unwrap();
    }
    unique.restart_build("by_email").await.unwrap();
    let schema = unique.build_indexes(|_| {}).await.unwrap();
    assert_eq!(state_of(&schema, "by_email"), Some(IndexState::Ready));
    let found = unique.by_email("same@example.com").execute().await.unwrap();
    assert_eq!(found.items.len(), 1);
    assert_eq!(found.items[0].id, "m000010");
    assert_eq!(
        keys_under(&ctx.db, "unique:member:by_email:").await.len(),
        600
    );
    assert!(unique.audit(|_| {}).await.unwrap().is_clean());
    assert!(matches!(
        unique.restart_build("by_email").await,
        Err(TitoError::InvalidArgument(_))
    ));
}

pub async fn a_changed_definition_is_refused_with_a_rename_hint<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let v1 = ctx.db.clone().model::<MemberV1>();
    v1.build(member(1)).await.unwrap();
    let changed = ctx.db.clone().model::<MemberRedefined>();
    for err in [
        changed.schema().await.unwrap_err(),
        changed.build(member(2)).await.unwrap_err(),
        changed.by_team("core").execute().await.unwrap_err(),
    ] {
        match err {
            TitoError::SchemaMismatch(message) => {
                assert!(message.contains("by_team"), "{message}");
                assert!(message.contains("(team: string)"), "{message}");
                assert!(
                    message.contains("(team: string, name: string)"),
                    "{message}"
                );
                assert!(message.contains("new name"), "{message}");
            }
            other => panic!("expected SchemaMismatch, got {other:?}"),
        }
    }
    assert_eq!(v1.schema().await.unwrap().version, 1, "nothing changed");
    assert!(matches!(
        v1.find_by_id("m000002", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
}

pub async fn audit_finds_each_kind_and_repair_fixes_it<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let model = ctx.db.clone().model::<MemberUnique>();
    load(&ctx.db, (0..300).map(member::<MemberUnique>).collect()).await;
    let clean = model.audit(|_| {}).await.unwrap();
    assert!(clean.is_clean(), "{clean:?}");
    assert_eq!(clean.rows, 300);
    assert!(clean.finished);

    use tito::keys::{KeyValue, index_key, manifest_key, unique_claim_key};
    let id = |n: u64| format!("m{n:06}");
    let team_entry = |n: u64, team: &str| {
        index_key(
            "by_team",
            &[("team", &KeyValue::String(team.into()))],
            "member",
            &id(n),
        )
        .unwrap()
    };
    let email_claim = |email: &str| {
        unique_claim_key(
            "member",
            "by_email",
            &[("email", &KeyValue::String(email.into()))],
        )
        .unwrap()
    };
    let ghost = email_claim("ghost@example.com");
    let corrupt = vec![
        // A missing entry.
        (team_entry(1, "web"), None),
        // An orphaned entry: its row does not exist.
        (team_entry(999, "web"), Some(b"{}".to_vec())),
        // An orphaned entry: its row holds another team.
        (team_entry(2, "ops"), Some(b"{}".to_vec())),
        // A stale clone.
        (
            team_entry(3, "ops"),
            Some(br#"{"id":"m000003","team":"old"}"#.to_vec()),
        ),
        // A missing manifest.
        (manifest_key("member", &id(4)), None),
        // A malformed manifest.
        (manifest_key("member", &id(5)), Some(b"{not json".to_vec())),
        // A claim held for the wrong row.
        (email_claim("m6@example.com"), Some(b"m000007".to_vec())),
        // An orphaned claim.
        (ghost.clone(), Some(b"m000008".to_vec())),
    ];
    for (key, value) in &corrupt {
        let (key, value) = (key.clone().into_bytes(), value.clone());
        assert!(
            read(&ctx.db, &key).await.is_some() || value.is_some(),
            "{} exists before corruption",
            String::from_utf8_lossy(&key)
        );
        ctx.db
            .transaction(|tx| async move {
                match value {
                    Some(v) => tx.put(key, v).await,
                    None => tx.delete(key).await,
                }
            })
            .await
            .unwrap();
    }

    let mut seen = Vec::new();
    let report = model.audit(|p| seen.push(p.clone())).await.unwrap();
    assert!(
        !seen.is_empty() && seen.last().unwrap().rows_done == 300,
        "{seen:?}"
    );
    assert_eq!(seen.last().unwrap().rows_estimate, Some(300));
    let first = |kind: AuditKind| {
        report
            .findings
            .get(&kind)
            .map(|f| f.first.clone())
            .unwrap_or_default()
    };
    assert!(
        first(AuditKind::MissingEntry).contains(&team_entry(1, "web")),
        "{report:?}"
    );
    assert!(
        first(AuditKind::OrphanedEntry).contains(&team_entry(999, "web")),
        "{report:?}"
    );
    assert!(
        first(AuditKind::OrphanedEntry).contains(&team_entry(2, "ops")),
        "{report:?}"
    );
    assert!(
        first(AuditKind::OrphanedEntry).contains(&ghost),
        "{report:?}"
    );
    assert_eq!(
        first(AuditKind::StaleClone),
        [team_entry(3, "ops")],
        "{report:?}"
    );
    assert_eq!(
        first(AuditKind::MissingManifest),
        [manifest_key("member", &id(4))]
    );
    assert!(
        first(AuditKind::MalformedManifest).contains(&manifest_key("member", &id(5))),
        "{report:?}"
    );
    assert_eq!(
        first(AuditKind::WrongClaim),
        [email_claim("m6@example.com")],
        "{report:?}"
    );
    // The audit wrote nothing but its progress.
    assert_eq!(read(&ctx.db, team_entry(1, "web").as_bytes()).await, None);

    let repaired = model.repair(|_| {}).await.unwrap();
    assert!(repaired.repair && repaired.finished);
    assert!(repaired.unrepaired.is_empty(), "{repaired:?}");
    let again = model.audit(|_| {}).await.unwrap();
    assert!(again.is_clean(), "{again:?}");
    assert_eq!(model.last_audit().await.unwrap(), Some(again));
    assert_eq!(
        model.by_team("web").execute().await.unwrap().items.len(),
        60
    );
    assert_eq!(
        model
            .by_email("m6@example.com")
            .execute()
            .await
            .unwrap()
            .items[0]
            .id,
        "m000006"
    );
}

pub async fn queue_maintenance_builds_indexes<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    load(&ctx.db, (0..400).map(member::<MemberV1>).collect()).await;
    let v2 = ctx.db.clone().model::<MemberV2>();
    assert_eq!(
        state_of(&v2.schema().await.unwrap(), "by_name"),
        Some(IndexState::Building)
    );
    let queue = crate::support::queue(&ctx.db, 1);
    let (stop, rx) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(tito::queue::run_worker(
        queue,
        // A pass every 100 ms: the build takes a pass after the write grace.
        tito::WorkerConfig::new(0..1)
            .max_idle_backoff(Duration::from_millis(50))
            .maintenance_interval(Duration::from_millis(100)),
        |_event: tito::QueueEvent<serde_json::Value>| async move {
            Ok(tito::QueueHandlerOutcome::Acknowledge)
        },
        rx,
    ));
    let model = v2.clone();
    wait_for(
        "the worker's maintenance to build by_name",
        Duration::from_secs(60),
        move || {
            let model = model.clone();
            async move { model.by_name("ada").execute().await.is_ok() }
        },
    )
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    let expected = all_rows(&v2)
        .await
        .iter()
        .filter(|m| m.name == "ada")
        .count();
    assert_eq!(
        index_ids(&v2, "by_name", "ada").await.unwrap().len(),
        expected
    );
}

pub async fn bad_batch_sizes_are_refused<E: TitoEngine>(ctx: Ctx<E>) {
    short_grace(&ctx.db);
    let v1 = ctx.db.clone().model::<MemberV1>();
    for batch in [0, tito::engine::MAX_SCAN_LIMIT + 1, usize::MAX] {
        assert!(matches!(
            v1.schema_step(batch).await,
            Err(TitoError::InvalidArgument(_))
        ));
    }
    assert!(v1.schema_step(1).await.unwrap().idle());
    // A grace over an hour is refused and leaves the setting as it was.
    for grace in [Duration::from_secs(3601), Duration::MAX] {
        assert!(matches!(
            tito::schema::set_write_grace(&ctx.db, grace),
            Err(TitoError::InvalidArgument(_))
        ));
    }
    assert_eq!(
        tito::schema::write_grace(&ctx.db),
        Duration::from_millis(50)
    );
    assert!(
        v1.schema_step(tito::engine::MAX_SCAN_LIMIT)
            .await
            .unwrap()
            .idle()
    );
}

// ---------------------------------------------------------------------------------------------
// A build killed with SIGKILL resumes from its cursor (the embedded store, a child process).
// ---------------------------------------------------------------------------------------------

const BUILD_DIR_VAR: &str = "TITO_SCHEMA_CHILD_DIR";
const BUILD_ROWS: u64 = 3000;
const BUILD_BATCH: usize = 100;

/// The child: builds `by_name` in small batches, reporting each. Does nothing unless started by
/// the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by a_killed_build_resumes_from_its_cursor"]
async fn schema_build_child() {
    let Ok(dir) = std::env::var(BUILD_DIR_VAR) else {
        return;
    };
    let db = tito::backend::embedded::Embedded::open(&dir).await.unwrap();
    short_grace(&db);
    let v2 = db.model::<MemberV2>();
    loop {
        let step = v2.schema_step(BUILD_BATCH).await.unwrap();
        if step.idle() {
            break;
        }
        println!("built {}", step.progress.rows_done);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_build_resumes_from_its_cursor() {
    use tito::backend::embedded::Embedded;
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        short_grace(&db);
        load(&db, (0..BUILD_ROWS).map(member::<MemberV1>).collect()).await;
        db.close().await.unwrap();
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "schema::schema_build_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(BUILD_DIR_VAR, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reported = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        if let Some(done) = line.unwrap().strip_prefix("built ") {
            reported = done.parse::<u64>().unwrap();
            if reported >= BUILD_ROWS / 2 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the child built too slowly");
    }
    assert!(reported >= BUILD_ROWS / 2, "the child stopped early");
    child.kill().unwrap(); // SIGKILL, in the middle of the build
    child.wait().unwrap();

    let db = Embedded::open(dir.path()).await.unwrap();
    let v2 = db.clone().model::<MemberV2>();
    let schema = v2.schema().await.unwrap();
    let status = schema.indexes.iter().find(|i| i.name == "by_name").unwrap();
    assert_eq!(status.state, IndexState::Building);
    let stored = status.progress.clone().unwrap().rows_done;
    assert!(
        stored >= reported && stored < BUILD_ROWS,
        "{stored} of {BUILD_ROWS}"
    );
    let mut rewritten = 0;
    let schema = v2
        .build_indexes(|step| rewritten += step.handled as u64)
        .await
        .unwrap();
    assert_eq!(state_of(&schema, "by_name"), Some(IndexState::Ready));
    assert_eq!(
        rewritten,
        BUILD_ROWS - stored,
        "the resumed build handled only the rows after its cursor"
    );
    println!("killed after {stored} of {BUILD_ROWS} rows; the resumed build rewrote {rewritten}");
    for name in NAMES {
        let expected = (0..BUILD_ROWS)
            .filter(|n| NAMES[(n % 7) as usize] == name)
            .count();
        assert_eq!(
            index_ids(&v2, "by_name", name).await.unwrap().len(),
            expected
        );
    }
    assert!(v2.audit(|_| {}).await.unwrap().is_clean());
    db.close().await.unwrap();
}
