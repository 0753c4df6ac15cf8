//! Models that change shape: rows written by older code read by newer code (gets, queries over
//! copied and keyed entries, inbox claims, deletes and their events), rows newer than the code
//! refused, rows no conversion reads refused and still deletable. Run on every backend.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tito::model::{ShapeError, TitoModelTrait};
use tito::queue::ModelEvent;
use tito::queue::testing::drain;
use tito::{
    QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel, TitoShape, TitoTransaction,
};

use crate::support::{Ctx, read};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! shapes_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            shapes,
            [
                rows_of_older_code_read_as_the_newest_shape,
                a_row_newer_than_the_code_is_refused_never_misread,
                a_row_no_conversion_reads_is_refused_and_deletable,
                writes_store_the_newest_shape_and_its_copies,
                a_rolling_deploy_writes_the_allowed_shape_until_the_next_is_allowed,
                old_and_new_code_writing_at_once_leave_every_row_readable_by_both,
                an_inbox_claims_older_rows_and_leaves_newer_ones_to_newer_code,
                model_events_reach_handlers_of_both_deploys,
                a_rewrite_moves_every_row_to_the_allowed_shape,
                an_inbox_sets_aside_a_row_no_conversion_reads,
                an_upgrade_that_changes_an_indexed_value_keeps_each_deploys_index,
                a_conversion_that_panics_is_a_refusal_and_the_row_stays_deletable,
                a_rollback_rewrites_rows_back_to_the_older_shape_in_maintenance,
                a_conversion_that_changes_the_id_is_a_refusal,
                a_downgraded_write_beside_a_conditional_index_indexes_the_stored_values,
                a_table_whose_rows_predate_the_catalog_stays_at_version_one,
                a_newer_handler_reads_an_older_events_row_through_its_conversion,
                a_delete_by_the_next_deploy_publishes_the_allowed_shape,
                an_inbox_row_whose_downgrade_panics_is_set_aside_and_the_group_goes_on,
                an_older_row_that_is_not_its_versions_json_is_an_integrity_error,
            ]
        );
    };
}

/// The code as deployed first: no version declared (version 1), a name in one field.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member")]
#[tito(index = "member_by_team: team")]
#[tito(index = "member_keys_by_team: team", entries = "keys")]
#[tito(event = "member_changed")]
pub struct OldMember {
    pub id: String,
    pub team: String,
    pub name: String,
}

/// Version 1 as a previous shape of [`Member`].
#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct MemberV1 {
    pub id: String,
    pub team: String,
    pub name: String,
}

/// Version 2: the name split in two; a name without a space does not convert.
#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 2, from = "MemberV1", upgrade = "split_name")]
pub struct MemberV2 {
    pub id: String,
    pub team: String,
    pub first: String,
    pub last: String,
}

fn split_name(v1: MemberV1) -> Result<MemberV2, String> {
    let (first, last) = v1
        .name
        .split_once(' ')
        .ok_or_else(|| format!("{:?} has no space to split at", v1.name))?;
    Ok(MemberV2 {
        id: v1.id,
        team: v1.team,
        first: first.to_string(),
        last: last.to_string(),
    })
}

/// The code as deployed now: version 3, the same indexes, a display name added.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member", version = 3, from = "MemberV2")]
#[tito(index = "member_by_team: team")]
#[tito(index = "member_keys_by_team: team", entries = "keys")]
#[tito(event = "member_changed")]
pub struct Member {
    pub id: String,
    pub team: String,
    pub first: String,
    pub last: String,
    pub display: String,
}

impl From<MemberV2> for Member {
    fn from(v2: MemberV2) -> Self {
        Member {
            display: format!("{} {}", v2.first, v2.last),
            id: v2.id,
            team: v2.team,
            first: v2.first,
            last: v2.last,
        }
    }
}

/// The next deploy of the first code, written for a rolling deploy: version 2 from version 1,
/// with a downgrade so that it can write version 1 while old instances run.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(
    table = "member",
    version = 2,
    from = "MemberV1",
    upgrade = "split_next"
)]
#[tito(downgrade = "join_next")]
#[tito(index = "member_by_team: team")]
#[tito(index = "member_keys_by_team: team", entries = "keys")]
#[tito(event = "member_changed")]
pub struct MemberNext {
    pub id: String,
    pub team: String,
    pub first: String,
    pub last: String,
}

fn split_next(v1: MemberV1) -> Result<MemberNext, String> {
    let v2 = split_name(v1)?;
    Ok(MemberNext {
        id: v2.id,
        team: v2.team,
        first: v2.first,
        last: v2.last,
    })
}

fn join_next(next: &MemberNext) -> MemberV1 {
    MemberV1 {
        id: next.id.clone(),
        team: next.team.clone(),
        name: format!("{} {}", next.first, next.last),
    }
}

fn next(id: &str, team: &str, first: &str, last: &str) -> MemberNext {
    MemberNext {
        id: id.into(),
        team: team.into(),
        first: first.into(),
        last: last.into(),
    }
}

/// Version 3 with no previous shapes declared: it reads no older row.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "member", version = 3)]
#[tito(index = "member_by_team: team")]
#[tito(index = "member_keys_by_team: team", entries = "keys")]
#[tito(event = "member_changed")]
pub struct MemberNoChain {
    pub id: String,
    pub team: String,
    pub display: String,
}

fn old(id: &str, team: &str, name: &str) -> OldMember {
    OldMember {
        id: id.into(),
        team: team.into(),
        name: name.into(),
    }
}

fn member(id: &str, team: &str, first: &str, last: &str) -> Member {
    Member {
        id: id.into(),
        team: team.into(),
        first: first.into(),
        last: last.into(),
        display: format!("{first} {last}"),
    }
}

fn row_key(id: &str) -> String {
    tito::keys::row_key("member", id)
}

fn ids(items: &[Member]) -> Vec<&str> {
    let mut ids: Vec<&str> = items.iter().map(|m| m.id.as_str()).collect();
    ids.sort();
    ids
}

pub async fn rows_of_older_code_read_as_the_newest_shape<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldMember>();
    for (id, name) in [("1", "Ada Lovelace"), ("2", "Grace Hopper")] {
        olds.build(old(id, "a", name)).await.unwrap();
    }
    let members = ctx.db.clone().model::<Member>();
    assert_eq!(
        members.find_by_id("1", vec![]).await.unwrap(),
        member("1", "a", "Ada", "Lovelace")
    );
    let many: Vec<Member> = members
        .find_by_ids(&["1".to_string(), "2".to_string()])
        .await
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(ids(&many), ["1", "2"]);
    // Entries holding copies of version-1 rows, and entries holding keys.
    let copies = members.member_by_team("a").execute().await.unwrap();
    assert_eq!(
        copies.items,
        vec![
            member("1", "a", "Ada", "Lovelace"),
            member("2", "a", "Grace", "Hopper")
        ]
    );
    let keyed = members.member_keys_by_team("a").execute().await.unwrap();
    assert_eq!(keyed.items, copies.items);
    // The rows were not rewritten by being read.
    assert!(
        !read(&ctx.db, row_key("1").as_bytes())
            .await
            .unwrap()
            .starts_with(b"v")
    );
}

pub async fn writes_store_the_newest_shape_and_its_copies<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Ada Lovelace")).await.unwrap();
    let members = ctx.db.clone().model::<Member>();
    // An update that changes nothing but the shape still rewrites the row in the new shape
    // (once version 3 is allowed: the old code ran on this table; the new code's first query
    // recorded its version).
    let same = members.find_by_id("1", vec![]).await.unwrap();
    members.member_by_team("a").execute().await.unwrap();
    tito::schema::allow_shape_version(&ctx.db, "member", 3)
        .await
        .unwrap();
    members.update(same.clone()).await.unwrap();
    let stored = read(&ctx.db, row_key("1").as_bytes()).await.unwrap();
    assert!(
        stored.starts_with(b"v3:{"),
        "{}",
        String::from_utf8_lossy(&stored)
    );
    let copies = members.member_by_team("a").execute().await.unwrap();
    assert_eq!(copies.items, vec![same]);
    // A new row is written in the new shape from the start; the old code's index of keys
    // and of copies find it through the same entries.
    members
        .build(member("2", "a", "Grace", "Hopper"))
        .await
        .unwrap();
    let stored = read(&ctx.db, row_key("2").as_bytes()).await.unwrap();
    assert!(stored.starts_with(b"v3:{"));
    let keyed = members.member_keys_by_team("a").execute().await.unwrap();
    assert_eq!(ids(&keyed.items), ["1", "2"]);
    let page = tito::inspect::table_rows(&ctx.db, "member", None, 10)
        .await
        .unwrap();
    assert_eq!(
        page.items.iter().map(|r| r.version).collect::<Vec<_>>(),
        [3, 3]
    );
    assert_eq!(
        page.items[0].value.as_ref().unwrap()["display"],
        "Ada Lovelace"
    );
}

pub async fn a_row_newer_than_the_code_is_refused_never_misread<E: TitoEngine>(ctx: Ctx<E>) {
    let members = ctx.db.clone().model::<Member>();
    members
        .build(member("1", "a", "Ada", "Lovelace"))
        .await
        .unwrap();
    // The old code after a rollback: every read of the row says what it is.
    let olds = ctx.db.clone().model::<OldMember>();
    let err = olds.find_by_id("1", vec![]).await.unwrap_err();
    match &err {
        TitoError::RowShape {
            key,
            version,
            code_version,
            ..
        } => assert_eq!((key.clone(), *version, *code_version), (row_key("1"), 3, 1)),
        other => panic!("expected RowShape, got {other:?}"),
    }
    assert!(err.to_string().contains("newer than this code"), "{err}");
    assert!(matches!(
        olds.member_by_team("a").execute().await.unwrap_err(),
        TitoError::RowShape { version: 3, .. }
    ));
    assert!(matches!(
        olds.member_keys_by_team("a").execute().await.unwrap_err(),
        TitoError::RowShape { version: 3, .. }
    ));
    // An update by the old code is refused, and leaves the row as it was.
    let err = olds.update(old("1", "a", "Ada King")).await.unwrap_err();
    assert!(
        matches!(err, TitoError::RowShape { version: 3, .. }),
        "{err:?}"
    );
    assert_eq!(
        members.find_by_id("1", vec![]).await.unwrap(),
        member("1", "a", "Ada", "Lovelace")
    );
    // A delete by the old code removes it whatever its shape, with its entries.
    olds.delete_by_id("1").await.unwrap();
    assert!(
        members
            .member_by_team("a")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(read(&ctx.db, row_key("1").as_bytes()).await.is_none());
}

pub async fn a_row_no_conversion_reads_is_refused_and_deletable<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "b", "Plato")).await.unwrap();
    olds.build(old("2", "b", "Ada Lovelace")).await.unwrap();
    let members = ctx.db.clone().model::<Member>();
    let err = members.find_by_id("1", vec![]).await.unwrap_err();
    match &err {
        TitoError::RowShape {
            version: 1,
            code_version: 3,
            reason,
            ..
        } => assert!(
            reason.contains("from version 1 to 2") && reason.contains("no space"),
            "{reason}"
        ),
        other => panic!("expected RowShape, got {other:?}"),
    }
    // The query meets it too: refused, never skipped silently.
    assert!(matches!(
        members.member_by_team("b").execute().await.unwrap_err(),
        TitoError::RowShape { version: 1, .. }
    ));
    // An update of it is refused (its values cannot be read); a delete removes it, and its
    // event carries the row as stored.
    assert!(matches!(
        members
            .update(member("1", "b", "Pla", "To"))
            .await
            .unwrap_err(),
        TitoError::RowShape { version: 1, .. }
    ));
    members.delete_by_id("1").await.unwrap();
    assert_eq!(
        ids(&members.member_by_team("b").execute().await.unwrap().items),
        ["2"]
    );
    let queue = Member::MEMBER_CHANGED_EVENT
        .spec(ctx.db.partitions(), Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    // A handler typed by the model cannot decode the deleted row's event; one typed by JSON
    // reads what was stored.
    let raw = tito::Topic::<ModelEvent<Value>>::new(Member::MEMBER_CHANGED_EVENT.name())
        .spec(ctx.db.partitions(), Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    drop(queue);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    drain(&raw, move |event: QueueEvent<ModelEvent<Value>>| {
        let sink = sink.clone();
        async move {
            sink.lock().unwrap().push(event.payload);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    let delete = seen
        .iter()
        .find(|e| e.operation == tito::TitoOperation::Delete && e.id == "1")
        .expect("the delete's event");
    assert_eq!(delete.row["name"], "Plato");
    // Even a row that is not JSON at all (nor has a readable header) is deleted.
    olds.build(old("7", "b", "Ada Lovelace")).await.unwrap();
    for bytes in [&b"v9x:{"[..], b"\xff\xfe not json"] {
        let (key, value) = (row_key("7").into_bytes(), bytes.to_vec());
        ctx.db
            .transaction(|tx| {
                let (key, value) = (key.clone(), value.clone());
                async move { tito::TitoTransaction::put(&tx, key, value).await }
            })
            .await
            .unwrap();
        assert!(members.find_by_id("7", vec![]).await.is_err());
    }
    members.delete_by_id("7").await.unwrap();
    assert!(read(&ctx.db, row_key("7").as_bytes()).await.is_none());
    // The shape error of a conversion says so when matched on.
    assert_eq!(
        ShapeError::conversion(1, 2, "x").to_string(),
        "the conversion from version 1 to 2 refused it: x"
    );
    assert_eq!(<Member as TitoModelTrait>::VERSION, 3);
}

pub async fn a_rolling_deploy_writes_the_allowed_shape_until_the_next_is_allowed<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Ada Lovelace")).await.unwrap();
    // The new deploy reads version 1 and, while the catalog allows version 1 only, writes it.
    let nexts = ctx.db.clone().model::<MemberNext>();
    nexts
        .build(next("2", "a", "Grace", "Hopper"))
        .await
        .unwrap();
    let stored = read(&ctx.db, row_key("2").as_bytes()).await.unwrap();
    assert!(
        stored.starts_with(b"{"),
        "{}",
        String::from_utf8_lossy(&stored)
    );
    assert_eq!(
        olds.find_by_id("2", vec![]).await.unwrap(),
        old("2", "a", "Grace Hopper")
    );
    nexts.update(next("1", "a", "Ada", "King")).await.unwrap();
    assert_eq!(
        olds.find_by_id("1", vec![]).await.unwrap(),
        old("1", "a", "Ada King")
    );
    assert_eq!(
        olds.member_by_team("a")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        2
    );
    // Code two versions ahead with no downgrade to version 1 is refused, saying what to do.
    let members = ctx.db.clone().model::<Member>();
    let err = members
        .build(member("3", "a", "Alan", "Turing"))
        .await
        .unwrap_err();
    match &err {
        TitoError::SchemaMismatch(message) => assert!(
            message.contains("allow-version member 3") && message.contains("version 1"),
            "{message}"
        ),
        other => panic!("expected SchemaMismatch, got {other:?}"),
    }
    // The compatibility check says the same before anything is written: version 3 reads
    // every stored version but cannot write yet; version 2 can (its downgrade; version 3 is
    // declared, but no one may write it yet); a version-3 model without previous shapes reads
    // none of the stored rows.
    let check = tito::schema::check_shapes::<_, Member>(&ctx.db, 100)
        .await
        .unwrap();
    assert!(check.unreadable().is_empty() && !check.writes, "{check:?}");
    assert_eq!(check.versions[&1].rows, 2);
    let check = tito::schema::check_shapes::<_, MemberNext>(&ctx.db, 100)
        .await
        .unwrap();
    assert!(check.is_compatible(), "{check:?}");
    let check = tito::schema::check_shapes::<_, MemberNoChain>(&ctx.db, 100)
        .await
        .unwrap();
    assert_eq!(check.unreadable(), [1], "{check:?}");
    assert!(!check.is_compatible());
    let counts = tito::schema::shape_versions(&ctx.db, "member", 100)
        .await
        .unwrap();
    let shapes = counts.shapes.clone().unwrap();
    assert_eq!(
        (
            shapes.writable(),
            shapes.seen.keys().copied().collect::<Vec<_>>()
        ),
        (1, vec![1, 2, 3])
    );
    assert_eq!(counts.rows.into_iter().collect::<Vec<_>>(), [(1, 2)]);
    // Only a version some code declared can be allowed.
    assert!(matches!(
        tito::schema::allow_shape_version(&ctx.db, "member", 4)
            .await
            .unwrap_err(),
        TitoError::InvalidArgument(_)
    ));
    // Every old instance is gone: version 2 is allowed, and written.
    tito::schema::allow_shape_version(&ctx.db, "member", 2)
        .await
        .unwrap();
    nexts.build(next("4", "b", "Alan", "Turing")).await.unwrap();
    let stored = read(&ctx.db, row_key("4").as_bytes()).await.unwrap();
    assert!(
        stored.starts_with(b"v2:{"),
        "{}",
        String::from_utf8_lossy(&stored)
    );
    assert_eq!(
        members.find_by_id("4", vec![]).await.unwrap(),
        member("4", "b", "Alan", "Turing")
    );
    // The old code meets it as newer than itself, and the check says so before a rollback.
    let check = tito::schema::check_shapes::<_, OldMember>(&ctx.db, 100)
        .await
        .unwrap();
    assert_eq!(check.unreadable(), [2], "{check:?}");
    assert!(matches!(
        olds.find_by_id("4", vec![]).await.unwrap_err(),
        TitoError::RowShape {
            version: 2,
            code_version: 1,
            ..
        }
    ));
    // Version 3 still waits for its own step; then it writes, and version-2 code keeps writing
    // its own shape, which version 3 reads.
    assert!(
        members
            .build(member("5", "b", "Edsger", "Dijkstra"))
            .await
            .is_err()
    );
    tito::schema::allow_shape_version(&ctx.db, "member", 3)
        .await
        .unwrap();
    members
        .build(member("5", "b", "Edsger", "Dijkstra"))
        .await
        .unwrap();
    assert!(
        read(&ctx.db, row_key("5").as_bytes())
            .await
            .unwrap()
            .starts_with(b"v3:{")
    );
    nexts
        .build(next("6", "b", "Barbara", "Liskov"))
        .await
        .unwrap();
    assert!(
        read(&ctx.db, row_key("6").as_bytes())
            .await
            .unwrap()
            .starts_with(b"v2:{")
    );
    assert_eq!(
        ids(&members.member_by_team("b").execute().await.unwrap().items),
        ["4", "5", "6"]
    );
    // A rollback of the catalog: version-2 code writes version 1 again.
    tito::schema::allow_shape_version(&ctx.db, "member", 1)
        .await
        .unwrap();
    nexts
        .update(next("6", "b", "Barbara", "Liskov"))
        .await
        .unwrap();
    assert_eq!(
        olds.find_by_id("6", vec![]).await.unwrap(),
        old("6", "b", "Barbara Liskov")
    );
}

pub async fn old_and_new_code_writing_at_once_leave_every_row_readable_by_both<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("seed", "a", "Ada Lovelace")).await.unwrap();
    let nexts = ctx.db.clone().model::<MemberNext>();
    // Both deploys write the same rows at once while version 1 is the one allowed.
    let writer_old = {
        let olds = olds.clone();
        tokio::spawn(async move {
            for i in 0..30 {
                olds.upsert(old(&format!("r{}", i % 10), "a", &format!("Old {i}")))
                    .await
                    .unwrap();
            }
        })
    };
    let writer_new = {
        let nexts = nexts.clone();
        tokio::spawn(async move {
            for i in 0..30 {
                nexts
                    .upsert(next(
                        &format!("r{}", (i + 5) % 10),
                        "a",
                        "New",
                        &i.to_string(),
                    ))
                    .await
                    .unwrap();
            }
        })
    };
    writer_old.await.unwrap();
    writer_new.await.unwrap();
    let by_old = olds.member_by_team("a").execute().await.unwrap().items;
    let by_new = nexts.member_by_team("a").execute().await.unwrap().items;
    assert_eq!(by_old.len(), 11);
    assert_eq!(by_new.len(), 11);
    for row in &by_old {
        let as_new = nexts.find_by_id(&row.id, vec![]).await.unwrap();
        assert_eq!(format!("{} {}", as_new.first, as_new.last), row.name);
    }
}

/// An inbox as the first code declares it.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(inbox, table = "hook")]
pub struct OldHook {
    pub id: String,
    #[tito(group)]
    pub endpoint: String,
    pub body: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct HookV1 {
    pub id: String,
    pub endpoint: String,
    pub body: String,
}

/// The next deploy: the body split into lines, and a downgrade for the rolling deploy.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(
    inbox,
    table = "hook",
    version = 2,
    from = "HookV1",
    downgrade = "hook_v1"
)]
pub struct Hook {
    pub id: String,
    #[tito(group)]
    pub endpoint: String,
    pub lines: Vec<String>,
}

impl From<HookV1> for Hook {
    fn from(v1: HookV1) -> Self {
        Hook {
            id: v1.id,
            endpoint: v1.endpoint,
            lines: v1.body.lines().map(str::to_string).collect(),
        }
    }
}

fn hook_v1(hook: &Hook) -> HookV1 {
    HookV1 {
        id: hook.id.clone(),
        endpoint: hook.endpoint.clone(),
        body: hook.lines.join("\n"),
    }
}

/// Runs an inbox of `M` on group "shop" until `until` holds of what it delivered, or `for_at_most`
/// passed; returns the deliveries.
async fn run_hooks<E: TitoEngine, M: tito::inbox::InboxModel + PartialEq>(
    db: &E,
    for_at_most: Duration,
    until: usize,
) -> (Vec<M>, Vec<String>) {
    run_hooks_until::<E, M>(db, for_at_most, until, None).await
}

/// [`run_hooks`] that also stops once the row `set_aside` is set aside.
async fn run_hooks_until<E: TitoEngine, M: tito::inbox::InboxModel + PartialEq>(
    db: &E,
    for_at_most: Duration,
    until: usize,
    set_aside: Option<&str>,
) -> (Vec<M>, Vec<String>) {
    use tito::inbox::{Inbox, InboxConfig, InboxDelivery, InboxOutcome, run_inbox};
    let inbox = std::sync::Arc::new(Inbox::<E, M>::new(db.clone()).unwrap());
    let seen: std::sync::Arc<std::sync::Mutex<Vec<M>>> = Default::default();
    let sink = seen.clone();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        InboxConfig::new("shop").max_idle(Duration::from_millis(20)),
        move |delivery: InboxDelivery<M>| {
            sink.lock().unwrap().push(delivery.payload);
            async { Ok(InboxOutcome::Ack) }
        },
        rx,
    ));
    let started = std::time::Instant::now();
    while started.elapsed() < for_at_most && seen.lock().unwrap().len() < until {
        if let Some(id) = set_aside
            && inbox.bad_rows().await.unwrap().iter().any(|bad| bad == id)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    let bad = inbox.bad_rows().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    (seen, bad)
}

pub async fn an_inbox_claims_older_rows_and_leaves_newer_ones_to_newer_code<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldHook>();
    for id in ["h1", "h2"] {
        olds.build(OldHook {
            id: id.into(),
            endpoint: "shop".into(),
            body: "a\nb".into(),
        })
        .await
        .unwrap();
    }
    // The new code's inbox claims rows of version 1 (its claim writes version 1 back while the
    // catalog allows no other) and is delivered them in its own shape.
    let (seen, bad) = run_hooks::<E, Hook>(&ctx.db, Duration::from_secs(30), 2).await;
    let mut ids: Vec<&str> = seen.iter().map(|h| h.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["h1", "h2"]);
    assert!(seen.iter().all(|h| h.lines == ["a", "b"]), "{seen:?}");
    assert!(bad.is_empty(), "{bad:?}");
    // A row of version 2, once allowed: the old code's inbox leaves it (not set aside), and the
    // new code's takes it.
    tito::schema::allow_shape_version(&ctx.db, "hook", 2)
        .await
        .unwrap();
    let hooks = ctx.db.clone().model::<Hook>();
    hooks
        .build(Hook {
            id: "h3".into(),
            endpoint: "shop".into(),
            lines: vec!["c".into()],
        })
        .await
        .unwrap();
    let (seen, bad) = run_hooks::<E, OldHook>(&ctx.db, Duration::from_millis(400), 1).await;
    assert!(seen.is_empty(), "{seen:?}");
    assert!(bad.is_empty(), "{bad:?}");
    let (seen, _) = run_hooks::<E, Hook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(seen[0].lines, ["c"]);
}

/// A next deploy of the inbox whose conversion refuses an empty body (with a downgrade for the
/// rolling deploy).
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(
    inbox,
    table = "hook",
    version = 2,
    from = "HookV1",
    upgrade = "strict_lines",
    downgrade = "strict_down"
)]
pub struct StrictHook {
    pub id: String,
    #[tito(group)]
    pub endpoint: String,
    pub lines: Vec<String>,
}

fn strict_down(hook: &StrictHook) -> HookV1 {
    HookV1 {
        id: hook.id.clone(),
        endpoint: hook.endpoint.clone(),
        body: hook.lines.join("\n"),
    }
}

fn strict_lines(v1: HookV1) -> Result<StrictHook, String> {
    if v1.body.is_empty() {
        return Err("an empty body has no lines".into());
    }
    Ok(StrictHook {
        id: v1.id,
        endpoint: v1.endpoint,
        lines: v1.body.lines().map(str::to_string).collect(),
    })
}

pub async fn an_inbox_sets_aside_a_row_no_conversion_reads<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldHook>();
    let hook = |id: &str, body: &str| OldHook {
        id: id.into(),
        endpoint: "shop".into(),
        body: body.into(),
    };
    for (id, body) in [("h1", "a"), ("h2", ""), ("h3", "b\nc")] {
        olds.build(hook(id, body)).await.unwrap();
    }
    // The next deploy runs beside the first (version 1 allowed): it leaves the row it cannot
    // read to the first, which reads it, and takes the others.
    ctx.db.clone().model::<StrictHook>().schema().await.unwrap();
    let (seen, bad) = run_hooks::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 2).await;
    let mut ids: Vec<&str> = seen.iter().map(|h| h.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["h1", "h3"]);
    assert!(bad.is_empty(), "{bad:?}");
    let (seen, _) = run_hooks::<E, OldHook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(seen, [hook("h2", "")]);
    // Once its version is allowed (the first deploy is gone), a row no conversion reads is set
    // aside with the reason, and the ones around it are delivered.
    olds.build(hook("h4", "")).await.unwrap();
    olds.build(hook("h5", "e")).await.unwrap();
    tito::schema::allow_shape_version(&ctx.db, "hook", 2)
        .await
        .unwrap();
    let (seen, bad) = run_hooks::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(
        seen.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(),
        ["h5"]
    );
    assert_eq!(bad, ["h4"]);
    let why = read(&ctx.db, tito::keys::inbox_bad_key("hook", "h4").as_bytes())
        .await
        .unwrap();
    let why = String::from_utf8_lossy(&why);
    assert!(
        why.contains("from version 1 to 2") && why.contains("an empty body has no lines"),
        "{why}"
    );
    // It stays as stored; written again (fixed), it is read again and delivered.
    assert!(
        read(&ctx.db, tito::keys::row_key("hook", "h4").as_bytes())
            .await
            .is_some()
    );
    olds.update(hook("h4", "fixed")).await.unwrap();
    let (seen, bad) = run_hooks::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(
        seen.iter().map(|h| h.lines.clone()).collect::<Vec<_>>(),
        [vec!["fixed".to_string()]]
    );
    assert!(bad.is_empty(), "{bad:?}");
    // Another one set aside, then deleted: it is gone, and no longer listed.
    olds.build(hook("h6", "")).await.unwrap();
    let (_, bad) =
        run_hooks_until::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1, Some("h6")).await;
    assert_eq!(bad, ["h6"]);
    let stricts = ctx.db.clone().model::<StrictHook>();
    stricts.delete_by_id("h6").await.unwrap();
    assert!(
        read(&ctx.db, tito::keys::row_key("hook", "h6").as_bytes())
            .await
            .is_none()
    );
    let inbox = tito::inbox::Inbox::<E, StrictHook>::new(ctx.db.clone()).unwrap();
    assert!(inbox.bad_rows().await.unwrap().is_empty());

    // A rollback: the newer code set a row aside that the older code reads; once version 1 is
    // allowed again, the older code's inbox takes it (the record was the newer code's).
    olds.build(hook("h7", "")).await.unwrap();
    let (_, bad) =
        run_hooks_until::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1, Some("h7")).await;
    assert_eq!(bad, ["h7"]);
    tito::schema::allow_shape_version(&ctx.db, "hook", 1)
        .await
        .unwrap();
    let old_inbox = tito::inbox::Inbox::<E, OldHook>::new(ctx.db.clone()).unwrap();
    assert!(old_inbox.bad_rows().await.unwrap().is_empty());
    let (seen, bad) = run_hooks::<E, OldHook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(seen, [hook("h7", "")]);
    assert!(bad.is_empty(), "{bad:?}");
    assert!(
        read(&ctx.db, tito::keys::inbox_bad_key("hook", "h7").as_bytes())
            .await
            .is_none(),
        "the newer code's record went when the older code read the row"
    );
    // The newer code, allowed again, sets aside only what it cannot read: the row as the older
    // code left it is set aside again by its own record.
    tito::schema::allow_shape_version(&ctx.db, "hook", 2)
        .await
        .unwrap();
    olds.build(hook("h8", "")).await.unwrap();
    let (_, bad) =
        run_hooks_until::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1, Some("h8")).await;
    assert_eq!(bad, ["h8"]);
    // A requeue is an operator's "try again": it clears a record that set the row aside (here
    // one written as older versions wrote them, holding for any row and any code).
    olds.build(hook("h9", "i")).await.unwrap();
    let db = ctx.db.clone();
    let tx = db.begin().await.unwrap();
    tito::TitoTransaction::put(
        &tx,
        tito::keys::inbox_bad_key("hook", "h9").into_bytes(),
        b"the payload does not deserialize".to_vec(),
    )
    .await
    .unwrap();
    tito::TitoTransaction::commit(&tx).await.unwrap();
    let mut listed = inbox.bad_rows().await.unwrap();
    listed.sort();
    assert_eq!(listed, ["h8", "h9"]);
    inbox.requeue("h9", "shop").await.unwrap();
    assert_eq!(inbox.bad_rows().await.unwrap(), ["h8"]);
    let (seen, _) = run_hooks::<E, StrictHook>(&ctx.db, Duration::from_secs(30), 1).await;
    assert_eq!(
        seen.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(),
        ["h9"]
    );
}

/// A conversion whose result has another id than the row's key.
#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct TagV1 {
    pub id: String,
    pub tag: String,
}

/// The next code lowercases ids on the way up (a mistake: `ABC` would read as `abc`), and its
/// downgrade uppercases them (the same mistake on the way down).
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(
    table = "tag",
    version = 2,
    from = "TagV1",
    upgrade = "tag_up",
    downgrade = "tag_down"
)]
pub struct Tag {
    pub id: String,
    pub tag: String,
    pub n: u32,
}

fn tag_up(v1: TagV1) -> Result<Tag, String> {
    Ok(Tag {
        id: v1.id.to_lowercase(),
        tag: v1.tag,
        n: 1,
    })
}

fn tag_down(tag: &Tag) -> TagV1 {
    TagV1 {
        id: tag.id.to_uppercase(),
        tag: tag.tag.clone(),
    }
}

/// The first code of the `tag` table.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "tag")]
pub struct OldTag {
    pub id: String,
    pub tag: String,
}

/// A conversion that returns another id than the row's is a refusal: the row is never read as
/// another one, a rewrite lists it (and never overwrites the row of that other id), and a write
/// whose downgrade changes the id is refused.
pub async fn a_conversion_that_changes_the_id_is_a_refusal<E: TitoEngine>(ctx: Ctx<E>) {
    // No writer races the rewrite: it need not wait the default ten seconds.
    tito::schema::set_write_grace(&ctx.db, std::time::Duration::from_millis(20)).unwrap();
    let olds = ctx.db.clone().model::<OldTag>();
    for id in ["ABC", "abc", "Mixed"] {
        olds.build(OldTag {
            id: id.into(),
            tag: format!("t-{id}"),
        })
        .await
        .unwrap();
    }
    let tags = ctx.db.clone().model::<Tag>();
    let err = tags.find_by_id("ABC", vec![]).await.unwrap_err();
    match &err {
        TitoError::RowShape { reason, .. } => {
            assert!(reason.contains("must keep the row's id"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A row whose id the conversion keeps reads as itself.
    let abc = tags.find_by_id("abc", vec![]).await.unwrap();
    assert_eq!((abc.id.as_str(), abc.tag.as_str()), ("abc", "t-abc"));
    // Writes through the downgrade that changes the id are refused; nothing is stored.
    let err = tags
        .update(Tag {
            id: "abc".into(),
            tag: "t-new".into(),
            n: 2,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TitoError::SchemaMismatch(m) if m.contains("must keep the row's id")),
        "{err:?}"
    );
    assert_eq!(olds.find_by_id("abc", vec![]).await.unwrap().tag, "t-abc");
    // The rewrite lists the two rows and leaves the third's data as it was.
    tito::schema::allow_shape_version(&ctx.db, "tag", 2)
        .await
        .unwrap();
    let done = tags
        .rewrite_shapes(tito::schema::RewriteOptions::default().batch(1), |_| {})
        .await
        .unwrap();
    assert_eq!((done.rows_done, done.rewritten), (3, 1), "{done:?}");
    let mut left: Vec<&str> = done
        .unconvertible
        .first
        .iter()
        .map(|r| r.id.as_str())
        .collect();
    left.sort();
    assert_eq!(left, ["ABC", "Mixed"]);
    let abc = tags.find_by_id("abc", vec![]).await.unwrap();
    assert_eq!(
        (abc.id.as_str(), abc.tag.as_str(), abc.n),
        ("abc", "t-abc", 1)
    );
    for id in ["ABC", "Mixed"] {
        tags.delete_by_id(id).await.unwrap();
    }
    assert_eq!(tags.find().execute().await.unwrap().items.len(), 1);
    // Bounds of the counts: 0 is refused, the largest is taken.
    assert!(matches!(
        tito::schema::shape_versions(&ctx.db, "tag", 0).await,
        Err(TitoError::InvalidArgument(_))
    ));
    let counts = tito::schema::shape_versions(&ctx.db, "tag", u64::MAX)
        .await
        .unwrap();
    assert_eq!(counts.rows.get(&2), Some(&1));
    assert!(!counts.more);
    let check = tito::schema::check_shapes::<_, Tag>(&ctx.db, u64::MAX)
        .await
        .unwrap();
    assert!(check.is_compatible(), "{check:?}");
}

pub async fn model_events_reach_handlers_of_both_deploys<E: TitoEngine>(ctx: Ctx<E>) {
    let retention = Duration::from_secs(3600);
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Ada Lovelace")).await.unwrap();
    // The new deploy writes while version 1 is the one allowed: its events carry version-1
    // rows, which the old deploy's handlers read as they are.
    let nexts = ctx.db.clone().model::<MemberNext>();
    nexts.update(next("1", "a", "Ada", "King")).await.unwrap();
    nexts
        .build(next("2", "a", "Grace", "Hopper"))
        .await
        .unwrap();
    let old_queue = OldMember::MEMBER_CHANGED_EVENT
        .spec(ctx.db.partitions(), retention)
        .open(ctx.db.clone())
        .await
        .unwrap();
    let names = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = names.clone();
    let drained = drain(
        &old_queue,
        move |event: QueueEvent<ModelEvent<OldMember>>| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(event.payload.row.name);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (drained.delivered, drained.acknowledged),
        (3, 3),
        "{drained:?}"
    );
    let mut seen = names.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, ["Ada King", "Ada Lovelace", "Grace Hopper"]);
    // The old deploy writes again; a handler typed by the version-3 model reads its events'
    // rows through the conversions (this process has a handle of the model).
    let _members = ctx.db.clone().model::<Member>();
    olds.update(old("2", "a", "Grace Brewster")).await.unwrap();
    let queue = Member::MEMBER_CHANGED_EVENT
        .spec(ctx.db.partitions(), retention)
        .open(ctx.db.clone())
        .await
        .unwrap();
    let rows = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = rows.clone();
    let drained = drain(&queue, move |event: QueueEvent<ModelEvent<Member>>| {
        let sink = sink.clone();
        async move {
            sink.lock().unwrap().push(event.payload.row);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(
        (drained.delivered, drained.acknowledged),
        (1, 1),
        "{drained:?}"
    );
    assert_eq!(
        rows.lock().unwrap().clone(),
        vec![member("2", "a", "Grace", "Brewster")]
    );
}

/// Every model event published on the table so far, drained (each once).
async fn drain_member_events<E: TitoEngine>(db: &E) -> Vec<ModelEvent<Value>> {
    let raw = tito::Topic::<ModelEvent<Value>>::new(Member::MEMBER_CHANGED_EVENT.name())
        .spec(db.partitions(), Duration::from_secs(3600))
        .open(db.clone())
        .await
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    drain(&raw, move |event: QueueEvent<ModelEvent<Value>>| {
        let sink = sink.clone();
        async move {
            sink.lock().unwrap().push(event.payload);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    let mut seen = seen.lock().unwrap();
    std::mem::take(&mut *seen)
}

/// Rows of the table by stored shape version.
async fn versions<E: TitoEngine>(db: &E) -> Vec<(u32, u64)> {
    tito::schema::shape_versions(db, "member", 10_000)
        .await
        .unwrap()
        .rows
        .into_iter()
        .collect()
}

pub async fn a_rewrite_moves_every_row_to_the_allowed_shape<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldMember>();
    for i in 0..40 {
        // Two names without a space: no conversion reads them.
        let name = match i {
            7 => "Plato".to_string(),
            23 => "Socrates".to_string(),
            i => format!("Name {i}"),
        };
        olds.build(old(&format!("m{i:02}"), ["a", "b"][i % 2], &name))
            .await
            .unwrap();
    }
    assert_eq!(drain_member_events(&ctx.db).await.len(), 40);
    let members = ctx.db.clone().model::<Member>();
    // While version 1 is the one allowed, this code cannot write it: the rewrite says so and
    // changes nothing.
    let err = members.rewrite_step(10).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::SchemaMismatch(m) if m.contains("version 1")),
        "{err:?}"
    );
    for batch in [0, tito::engine::MAX_SCAN_LIMIT + 1] {
        assert!(matches!(
            members.rewrite_step(batch).await.unwrap_err(),
            TitoError::InvalidArgument(_)
        ));
    }
    assert_eq!(versions(&ctx.db).await, [(1, 40)]);
    tito::schema::set_write_grace(&ctx.db, Duration::from_millis(300)).unwrap();
    tito::schema::allow_shape_version(&ctx.db, "member", 3)
        .await
        .unwrap();
    // A write that read the catalog before the change may still commit in the version allowed
    // before: the run starts once the write grace has passed.
    let waiting = members.rewrite_step(10).await.unwrap();
    assert!(
        waiting
            .waiting
            .is_some_and(|w| w <= Duration::from_millis(300))
            && waiting.handled == 0,
        "{waiting:?}"
    );
    let mut steps = Vec::new();
    let done = members
        .rewrite_shapes(tito::schema::RewriteOptions::default().batch(7), |step| {
            steps.push((step.handled, step.progress.rows_done))
        })
        .await
        .unwrap();
    assert_eq!(steps.len(), 6, "{steps:?}");
    assert_eq!(steps.last(), Some(&(5, 40)));
    assert!(done.finished && done.target == 3, "{done:?}");
    assert_eq!((done.rows_done, done.rewritten), (40, 38));
    assert_eq!(done.rows_estimate, Some(40));
    // The rows no conversion reads are counted and listed with why, never dropped.
    assert_eq!(done.unconvertible.count, 2);
    let left: Vec<(&str, &str, u32)> = done
        .unconvertible
        .first
        .iter()
        .map(|r| (r.id.as_str(), r.key.as_str(), r.version))
        .collect();
    assert_eq!(
        left,
        [
            ("m07", row_key("m07").as_str(), 1),
            ("m23", row_key("m23").as_str(), 1)
        ]
    );
    assert!(done.unconvertible.first[0].reason.contains("no space"));
    assert_eq!(done.refused.count, 0);
    assert_eq!(versions(&ctx.db).await, [(1, 2), (3, 38)]);
    // The copies in index entries moved too (the audit compares each copy with its row), and
    // the audit names the rows no code of this model reads.
    let report = members.audit(|_| {}).await.unwrap();
    assert_eq!(
        report.count(tito::schema::AuditKind::StaleClone),
        0,
        "{report:?}"
    );
    assert_eq!(report.count(tito::schema::AuditKind::MissingEntry), 0);
    assert_eq!(report.count(tito::schema::AuditKind::UnreadableRow), 2);
    assert_eq!(report.count(tito::schema::AuditKind::MalformedRow), 0);
    let copies = members.member_by_team("b").execute().await;
    // Team "b" holds m07 and m23: its query meets them and says so.
    assert!(matches!(
        copies,
        Err(TitoError::RowShape { version: 1, .. })
    ));
    let team_a = members.member_by_team("a").execute().await.unwrap().items;
    assert_eq!(team_a.len(), 20);
    assert_eq!(
        team_a.iter().find(|m| m.id == "m00").unwrap().display,
        "Name 0"
    );
    // A rewrite publishes no event.
    assert!(drain_member_events(&ctx.db).await.is_empty());
    // The same counts reach operators, with the run.
    let counts = tito::schema::shape_versions(&ctx.db, "member", 100)
        .await
        .unwrap();
    assert_eq!(counts.rewrite.as_ref(), Some(&done));
    // A finished run is idle to its next batch; a new run reads every row again and rewrites
    // nothing more.
    assert!(members.rewrite_step(10).await.unwrap().idle());
    let again = members
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!(
        (again.rows_done, again.rewritten, again.unconvertible.count),
        (40, 0, 2)
    );
    // The rows left are deleted by id; then every row is in the allowed shape.
    members.delete_by_id("m07").await.unwrap();
    members.delete_by_id("m23").await.unwrap();
    assert_eq!(versions(&ctx.db).await, [(3, 38)]);
    assert!(members.audit(|_| {}).await.unwrap().is_clean());
    assert_eq!(
        members
            .member_by_team("b")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        18
    );
}

pub async fn a_rollback_rewrites_rows_back_to_the_older_shape_in_maintenance<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldMember>();
    for i in 0..30 {
        olds.build(old(&format!("r{i:02}"), "a", &format!("First {i}")))
            .await
            .unwrap();
    }
    let nexts = ctx.db.clone().model::<MemberNext>();
    // The new deploy's first use records its version.
    assert_eq!(
        nexts
            .member_by_team("a")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        30
    );
    // Every old instance is gone: version 2 is allowed, and a queue worker's maintenance
    // rewrites the table in the background, a batch per pass.
    tito::schema::set_write_grace(&ctx.db, Duration::from_millis(20)).unwrap();
    tito::schema::allow_shape_version(&ctx.db, "member", 2)
        .await
        .unwrap();
    let queue = MemberNext::MEMBER_CHANGED_EVENT
        .spec(ctx.db.partitions(), Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let config = tito::WorkerConfig::new(0..ctx.db.partitions())
        .max_idle_backoff(Duration::from_millis(20))
        .maintenance_interval(Duration::from_millis(20));
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        &queue,
        config,
        |_event: QueueEvent<ModelEvent<MemberNext>>| async { Ok(QueueHandlerOutcome::Acknowledge) },
    );
    let rewritten = |target: u32| {
        let db = ctx.db.clone();
        move || {
            let db = db.clone();
            async move {
                let counts = tito::schema::shape_versions(&db, "member", 100)
                    .await
                    .unwrap();
                counts.rows.keys().copied().collect::<Vec<_>>() == [target]
                    && counts
                        .rewrite
                        .is_some_and(|r| r.finished && r.target == target)
            }
        }
    };
    crate::support::wait_for(
        "the rewrite to version 2",
        Duration::from_secs(30),
        rewritten(2),
    )
    .await;
    assert_eq!(
        nexts.find_by_id("r05", vec![]).await.unwrap(),
        next("r05", "a", "First", "5")
    );
    // A rollback: version 1 is allowed again, and the same maintenance writes every row back in
    // version 1 through the model's downgrade, so the old code can be deployed again.
    nexts
        .update(next("r05", "a", "Fifth", "Row"))
        .await
        .unwrap();
    tito::schema::allow_shape_version(&ctx.db, "member", 1)
        .await
        .unwrap();
    crate::support::wait_for(
        "the rewrite back to version 1",
        Duration::from_secs(30),
        rewritten(1),
    )
    .await;
    workers.shutdown().await.unwrap();
    let all = olds.member_by_team("a").execute().await.unwrap().items;
    assert_eq!(all.len(), 30);
    assert_eq!(
        olds.find_by_id("r05", vec![]).await.unwrap(),
        old("r05", "a", "Fifth Row")
    );
    assert!(olds.audit(|_| {}).await.unwrap().is_clean());
}

// ---------------------------------------------------------------------------------------------
// A rewrite killed with SIGKILL under writers resumes from its cursor and loses no write (the
// embedded store, a child process).
// ---------------------------------------------------------------------------------------------

const REWRITE_DIR_VAR: &str = "TITO_REWRITE_CHILD_DIR";
const REWRITE_ROWS: u64 = 2000;
const REWRITE_BATCH: usize = 50;

/// The child: rewrites the table in small batches, reporting each, while a writer updates rows
/// and reports each acknowledged write. Does nothing unless started by the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by a_killed_rewrite_resumes_from_its_cursor_and_loses_no_write"]
async fn shape_rewrite_child() {
    let Ok(dir) = std::env::var(REWRITE_DIR_VAR) else {
        return;
    };
    let db = tito::backend::embedded::Embedded::open(&dir).await.unwrap();
    tito::schema::set_write_grace(&db, Duration::from_millis(1)).unwrap();
    let nexts = db.model::<MemberNext>();
    let writer = {
        let nexts = nexts.clone();
        tokio::spawn(async move {
            for seq in 0u64.. {
                let id = format!("r{:04}", (seq * 37) % REWRITE_ROWS);
                nexts
                    .update(next(&id, "a", "Seq", &seq.to_string()))
                    .await
                    .unwrap();
                println!("wrote {id} {seq}");
            }
        })
    };
    loop {
        let step = nexts.rewrite_step(REWRITE_BATCH).await.unwrap();
        println!("rewrote {}", step.progress.rows_done);
        if step.finished || step.idle() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    writer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rewrite_resumes_from_its_cursor_and_loses_no_write() {
    use std::collections::HashMap;
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use tito::backend::embedded::Embedded;

    let dir = tempfile::tempdir().unwrap();
    {
        let db = Embedded::open(dir.path()).await.unwrap();
        let olds = db.clone().model::<OldMember>();
        for chunk in (0..REWRITE_ROWS).collect::<Vec<_>>().chunks(200) {
            let olds = olds.clone();
            let chunk = chunk.to_vec();
            db.transaction(|tx| {
                let (olds, chunk) = (olds.clone(), chunk.clone());
                async move {
                    for i in chunk {
                        let row = old(&format!("r{i:04}"), "a", &format!("First {i}"));
                        olds.build_with_options(
                            row,
                            tito::model::TitoOptions::without_events(),
                            &tx,
                        )
                        .await?;
                    }
                    Ok::<(), TitoError>(())
                }
            })
            .await
            .unwrap();
        }
        // The new deploy has run, and every old instance is gone.
        db.clone().model::<MemberNext>().schema().await.unwrap();
        tito::schema::allow_shape_version(&db, "member", 2)
            .await
            .unwrap();
        db.close().await.unwrap();
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "shapes::shape_rewrite_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REWRITE_DIR_VAR, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reported = 0;
    let mut acked: HashMap<String, u64> = HashMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(done) = line.strip_prefix("rewrote ") {
            reported = done.parse::<u64>().unwrap();
            if reported >= REWRITE_ROWS / 2 {
                break;
            }
        } else if let Some(write) = line.strip_prefix("wrote ") {
            let (id, seq) = write.split_once(' ').unwrap();
            acked.insert(id.to_string(), seq.parse().unwrap());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the child rewrote too slowly"
        );
    }
    assert!(reported >= REWRITE_ROWS / 2, "the child stopped early");
    child.kill().unwrap(); // SIGKILL, in the middle of the rewrite and of a write
    child.wait().unwrap();

    let db = Embedded::open(dir.path()).await.unwrap();
    let stored = tito::schema::rewrite_progress(&db, "member")
        .await
        .unwrap()
        .unwrap();
    assert!(
        !stored.finished && stored.rows_done >= reported && stored.rows_done < REWRITE_ROWS,
        "{stored:?}"
    );
    tito::schema::set_write_grace(&db, Duration::from_millis(1)).unwrap();
    let nexts = db.clone().model::<MemberNext>();
    let mut handled = 0;
    let done = nexts
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |step| {
            handled += step.handled as u64
        })
        .await
        .unwrap();
    assert!(done.finished);
    assert_eq!(
        handled,
        REWRITE_ROWS - stored.rows_done,
        "the resumed rewrite read only the rows after its cursor"
    );
    assert_eq!(versions(&db).await, [(2, REWRITE_ROWS)]);
    // Every acknowledged write is there (or a later one the kill cut before its report).
    assert!(acked.len() > 10, "the writer wrote {} rows", acked.len());
    for (id, seq) in &acked {
        let row = nexts.find_by_id(id, vec![]).await.unwrap();
        assert_eq!(row.first, "Seq", "{id}");
        assert!(
            row.last.parse::<u64>().unwrap() >= *seq,
            "{id}: {row:?} < {seq}"
        );
    }
    let rows = nexts
        .member_by_team("a")
        .limit(1000)
        .execute()
        .await
        .unwrap();
    assert_eq!(rows.items.len(), 1000);
    assert!(nexts.audit(|_| {}).await.unwrap().is_clean());
    println!(
        "killed after {} of {REWRITE_ROWS} rows ({} writes acknowledged); the resumed rewrite read {handled}",
        stored.rows_done,
        acked.len()
    );
    db.close().await.unwrap();
}

/// Accounts: the first code keeps the email as given; the next lowercases it on upgrade and
/// writes the older shape while it must.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "acct")]
#[tito(unique_index = "acct_by_email: email")]
pub struct AcctOld {
    pub id: String,
    pub email: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct Acct1 {
    pub id: String,
    pub email: String,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "acct", version = 2, from = "Acct1", downgrade = "acct_down")]
#[tito(unique_index = "acct_by_email: email")]
pub struct Acct {
    pub id: String,
    pub email: String,
    pub lower: bool,
}

impl From<Acct1> for Acct {
    fn from(v1: Acct1) -> Self {
        Acct {
            id: v1.id,
            email: v1.email.to_lowercase(),
            lower: true,
        }
    }
}

fn acct_down(acct: &Acct) -> Acct1 {
    Acct1 {
        id: acct.id.clone(),
        email: acct.email.clone(),
    }
}

fn acct_old(id: &str, email: &str) -> AcctOld {
    AcctOld {
        id: id.into(),
        email: email.into(),
    }
}

pub async fn an_upgrade_that_changes_an_indexed_value_keeps_each_deploys_index<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<AcctOld>();
    olds.build(acct_old("a", "Ann@X")).await.unwrap();
    // The next deploy runs beside the first (version 1 allowed). Its audit and repair check a
    // row of version 1 against what its writer wrote (the email as stored), find nothing and
    // change nothing.
    let news = ctx.db.clone().model::<Acct>();
    news.schema().await.unwrap();
    let audit = news.audit(|_| {}).await.unwrap();
    assert!(audit.is_clean(), "{audit:?}");
    let repair = news.repair(|_| {}).await.unwrap();
    assert!(repair.is_clean(), "{repair:?}");
    let found = olds.acct_by_email("Ann@X").execute().await.unwrap().items;
    assert_eq!(
        found.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
    assert!(matches!(
        olds.build(acct_old("d", "Ann@X")).await.unwrap_err(),
        TitoError::UniqueViolation { .. }
    ));
    // A row the next code writes in version 1 is indexed as version 1 reads it.
    news.build(Acct {
        id: "b".into(),
        email: "Bob@Y".into(),
        lower: false,
    })
    .await
    .unwrap();
    let found = olds.acct_by_email("Bob@Y").execute().await.unwrap().items;
    assert_eq!(
        found.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
    assert!(olds.audit(|_| {}).await.unwrap().is_clean());
    // Once version 2 is allowed, the rewrite writes the upgraded values and their entries.
    tito::schema::set_write_grace(&ctx.db, Duration::from_millis(1)).unwrap();
    tito::schema::allow_shape_version(&ctx.db, "acct", 2)
        .await
        .unwrap();
    let done = news
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!((done.rewritten, done.refused.count), (2, 0), "{done:?}");
    let found = news.acct_by_email("ann@x").execute().await.unwrap().items;
    assert_eq!(
        found.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
    assert!(
        news.acct_by_email("Ann@X")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(news.audit(|_| {}).await.unwrap().is_clean());
}

/// A next shape whose conversion panics on one value.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "pn")]
#[tito(index = "pn_by_n: n")]
pub struct PnOld {
    pub id: String,
    pub n: i64,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct Pn1 {
    pub id: String,
    pub n: i64,
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "pn", version = 2, from = "Pn1", upgrade = "pn_up")]
#[tito(index = "pn_by_n: n")]
pub struct Pn {
    pub id: String,
    pub n: i64,
}

fn pn_up(v1: Pn1) -> Result<Pn, String> {
    if v1.n == 666 {
        panic!("a conversion that panics");
    }
    Ok(Pn { id: v1.id, n: v1.n })
}

pub async fn a_conversion_that_panics_is_a_refusal_and_the_row_stays_deletable<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<PnOld>();
    for (id, n) in [("a", 1), ("p", 666), ("z", 2)] {
        olds.build(PnOld { id: id.into(), n }).await.unwrap();
    }
    let news = ctx.db.clone().model::<Pn>();
    // A read is refused with the panic's message, never unwound into the caller.
    let err = news.find_by_id("p", vec![]).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::RowShape { reason, .. } if reason.contains("panicked: a conversion that panics")),
        "{err:?}"
    );
    // A worker's maintenance and a rewrite go on past it; it is listed, never dropped.
    tito::schema::set_write_grace(&ctx.db, Duration::from_millis(1)).unwrap();
    news.schema().await.unwrap();
    tito::schema::allow_shape_version(&ctx.db, "pn", 2)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // A row whose manifest is gone is left too (the write path finds it inconsistent).
    let manifest = tito::keys::manifest_key("pn", "z").into_bytes();
    ctx.db
        .transaction(|tx| {
            let manifest = manifest.clone();
            async move { tito::TitoTransaction::delete(&tx, manifest).await }
        })
        .await
        .unwrap();
    tito::schema::maintain(&ctx.db).await;
    let done = news
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!(done.unconvertible.count, 1, "{done:?}");
    assert_eq!(
        done.unconvertible.first[0].key,
        tito::keys::row_key("pn", "p")
    );
    assert_eq!(done.refused.count, 1, "{done:?}");
    assert_eq!(done.refused.first[0].key, tito::keys::row_key("pn", "z"));
    assert_eq!(done.refused.first[0].id, "z");
    assert_eq!(versions_of(&ctx.db, "pn").await, [(1, 2), (2, 1)]);
    // A repair mends the manifest; the next run rewrites the row.
    news.repair(|_| {}).await.unwrap();
    let done = news
        .rewrite_shapes(tito::schema::RewriteOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!((done.rewritten, done.refused.count), (1, 0), "{done:?}");
    assert_eq!(versions_of(&ctx.db, "pn").await, [(1, 1), (2, 2)]);
    // The delete removes it with its entries.
    news.delete_by_id("p").await.unwrap();
    assert!(
        read(&ctx.db, tito::keys::row_key("pn", "p").as_bytes())
            .await
            .is_none()
    );
    assert!(news.pn_by_n(666).execute().await.unwrap().items.is_empty());
    assert!(news.audit(|_| {}).await.unwrap().is_clean());
}

async fn versions_of<E: TitoEngine>(db: &E, table: &str) -> Vec<(u32, u64)> {
    tito::schema::shape_versions(db, table, 10_000)
        .await
        .unwrap()
        .rows
        .into_iter()
        .collect()
}

/// The first code of a table with a plain and a conditional index on one field.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "sku")]
#[tito(index = "sku_by_code: code")]
#[tito(index = "sku_live_by_code: code", condition = "is_live")]
pub struct SkuOld {
    pub id: String,
    pub code: String,
    pub live: bool,
}

impl SkuOld {
    fn is_live(&self) -> bool {
        self.live
    }
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct Sku1 {
    pub id: String,
    pub code: String,
    pub live: bool,
}

/// The next code: codes in lower case, written upper case through the downgrade.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "sku", version = 2, from = "Sku1", downgrade = "sku_down")]
#[tito(index = "sku_by_code: code")]
#[tito(index = "sku_live_by_code: code", condition = "is_live")]
pub struct Sku {
    pub id: String,
    pub code: String,
    pub live: bool,
}

impl Sku {
    fn is_live(&self) -> bool {
        self.live
    }
}

impl From<Sku1> for Sku {
    fn from(v1: Sku1) -> Self {
        Sku {
            id: v1.id,
            code: v1.code.to_lowercase(),
            live: v1.live,
        }
    }
}

fn sku_down(sku: &Sku) -> Sku1 {
    Sku1 {
        id: sku.id.clone(),
        code: sku.code.to_uppercase(),
        live: sku.live,
    }
}

pub async fn a_downgraded_write_beside_a_conditional_index_indexes_the_stored_values<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<SkuOld>();
    olds.build(SkuOld {
        id: "a".into(),
        code: "ABC".into(),
        live: true,
    })
    .await
    .unwrap();
    // The next deploy writes while version 1 is allowed: the row is stored as version 1 reads
    // it, and the plain index holds that value, as beside an unconditional index alone.
    let news = ctx.db.clone().model::<Sku>();
    news.build(Sku {
        id: "b".into(),
        code: "xyz".into(),
        live: true,
    })
    .await
    .unwrap();
    let stored = read(&ctx.db, row_key_of("sku", "b").as_bytes())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&stored).contains("\"XYZ\""));
    let found = olds.sku_by_code("XYZ").execute().await.unwrap().items;
    assert_eq!(
        found.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
    assert!(
        news.sku_by_code("xyz")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );
    for (who, report) in [
        ("old", olds.audit(|_| {}).await.unwrap()),
        ("new", news.audit(|_| {}).await.unwrap()),
    ] {
        assert!(report.is_clean(), "{who} code's audit: {report:?}");
    }
    // The same after an update by the next deploy, and after a restart of both.
    news.update(Sku {
        id: "b".into(),
        code: "xyw".into(),
        live: true,
    })
    .await
    .unwrap();
    let (olds, news) = (
        ctx.db.clone().model::<SkuOld>(),
        ctx.db.clone().model::<Sku>(),
    );
    let found = olds.sku_by_code("XYW").execute().await.unwrap().items;
    assert_eq!(found.len(), 1);
    assert!(
        olds.sku_by_code("XYZ")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(news.audit(|_| {}).await.unwrap().is_clean());

    // An orphaned entry that the row's manifest lists is counted once, not by both the row
    // phase and the entry phase.
    let manifest_key = tito::keys::manifest_key("sku", "b");
    let manifest: Value =
        serde_json::from_slice(&read(&ctx.db, manifest_key.as_bytes()).await.unwrap()).unwrap();
    let listed: Vec<String> = serde_json::from_value(manifest["keys"].clone()).unwrap();
    let entry = listed
        .iter()
        .find(|k| k.contains(":sku_by_code:"))
        .unwrap_or_else(|| panic!("{listed:?}"))
        .clone();
    let orphan = entry.replace("XYW", "QQQ");
    assert_ne!(orphan, entry);
    let mut manifest = manifest;
    manifest["keys"]
        .as_array_mut()
        .unwrap()
        .push(Value::from(orphan.clone()));
    let bytes = serde_json::to_vec(&manifest).unwrap();
    ctx.db
        .transaction(|tx| {
            let (manifest_key, orphan, bytes) =
                (manifest_key.clone(), orphan.clone(), bytes.clone());
            async move {
                tx.put(orphan.into_bytes(), Vec::new()).await?;
                tx.put(manifest_key.into_bytes(), bytes).await
            }
        })
        .await
        .unwrap();
    let report = olds.audit(|_| {}).await.unwrap();
    assert_eq!(
        report.count(tito::schema::AuditKind::OrphanedEntry),
        1,
        "{report:?}"
    );
}

fn row_key_of(table: &str, id: &str) -> String {
    tito::keys::row_key(table, id)
}

pub async fn a_table_whose_rows_predate_the_catalog_stays_at_version_one<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Ada Lovelace")).await.unwrap();
    // A store written before catalogs were recorded: rows and manifests, no catalog.
    let catalog = tito::keys::schema_key("member");
    ctx.db
        .transaction(|tx| {
            let catalog = catalog.clone();
            async move { tx.delete(catalog.into_bytes()).await }
        })
        .await
        .unwrap();
    // The next deploy's first use leaves version 1 the one writers write: the code still
    // running reads what the next deploy writes.
    let nexts = ctx.db.clone().model::<MemberNext>();
    nexts
        .build(next("2", "a", "Grace", "Hopper"))
        .await
        .unwrap();
    assert_eq!(versions(&ctx.db).await, [(1, 2)]);
    let olds = ctx.db.clone().model::<OldMember>();
    assert_eq!(
        olds.find_by_id("2", vec![]).await.unwrap().name,
        "Grace Hopper"
    );
}

/// The first code of a table of subscriptions.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "sub")]
#[tito(event = "sub_changed")]
pub struct SubOld {
    pub id: String,
    pub email: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
pub struct Sub1 {
    pub id: String,
    pub email: String,
}

/// The next code: the domain, taken from the email by the conversion; serde alone would give
/// an empty one.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "sub", version = 2, from = "Sub1")]
#[tito(event = "sub_changed")]
pub struct Sub {
    pub id: String,
    pub email: String,
    #[serde(default)]
    pub domain: String,
}

impl From<Sub1> for Sub {
    fn from(v1: Sub1) -> Self {
        let domain = v1.email.split('@').nth(1).unwrap_or_default().to_string();
        Sub {
            id: v1.id,
            email: v1.email,
            domain,
        }
    }
}

pub async fn a_newer_handler_reads_an_older_events_row_through_its_conversion<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<SubOld>();
    olds.build(SubOld {
        id: "s".into(),
        email: "ann@x.org".into(),
    })
    .await
    .unwrap();
    let subs = ctx.db.clone().model::<Sub>();
    assert_eq!(subs.find_by_id("s", vec![]).await.unwrap().domain, "x.org");
    let queue = Sub::SUB_CHANGED_EVENT
        .spec(ctx.db.partitions(), Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let rows = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = rows.clone();
    let drained = drain(&queue, move |event: QueueEvent<ModelEvent<Sub>>| {
        let sink = sink.clone();
        async move {
            sink.lock()
                .unwrap()
                .push((event.payload.row, event.payload.shape));
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(drained.acknowledged, 1, "{drained:?}");
    let rows = rows.lock().unwrap().clone();
    assert_eq!(rows[0].0.domain, "x.org");
    assert_eq!(rows[0].1, 2);
}

pub async fn a_delete_by_the_next_deploy_publishes_the_allowed_shape<E: TitoEngine>(ctx: Ctx<E>) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Ada Lovelace")).await.unwrap();
    let nexts = ctx.db.clone().model::<MemberNext>();
    nexts.delete_by_id("1").await.unwrap();
    let old_queue = OldMember::MEMBER_CHANGED_EVENT
        .spec(ctx.db.partitions(), Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let drained = drain(
        &old_queue,
        move |event: QueueEvent<ModelEvent<OldMember>>| {
            let sink = sink.clone();
            async move {
                sink.lock()
                    .unwrap()
                    .push((event.payload.operation, event.payload.row.name));
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (drained.delivered, drained.acknowledged, drained.still_due),
        (2, 2, 0),
        "{drained:?}"
    );
    assert!(seen.lock().unwrap().contains(&(
        tito::model::TitoOperation::Delete,
        "Ada Lovelace".to_string()
    )));
}

/// The next deploy of the inbox, whose downgrade panics on one body.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(
    inbox,
    table = "hook",
    version = 2,
    from = "HookV1",
    downgrade = "fragile_down"
)]
pub struct FragileHook {
    pub id: String,
    #[tito(group)]
    pub endpoint: String,
    pub lines: Vec<String>,
}

impl From<HookV1> for FragileHook {
    fn from(v1: HookV1) -> Self {
        FragileHook {
            id: v1.id,
            endpoint: v1.endpoint,
            lines: v1.body.lines().map(str::to_string).collect(),
        }
    }
}

fn fragile_down(hook: &FragileHook) -> HookV1 {
    assert!(
        !hook.lines.iter().any(|l| l == "boom"),
        "this downgrade cannot write a boom"
    );
    HookV1 {
        id: hook.id.clone(),
        endpoint: hook.endpoint.clone(),
        body: hook.lines.join("\n"),
    }
}

pub async fn an_inbox_row_whose_downgrade_panics_is_set_aside_and_the_group_goes_on<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldHook>();
    for (id, body) in [("1", "a"), ("2", "boom"), ("3", "c")] {
        olds.build(OldHook {
            id: id.into(),
            endpoint: "shop".into(),
            body: body.into(),
        })
        .await
        .unwrap();
    }
    // Version 1 is allowed: the claim writes rows back through the downgrade, which panics on
    // row 2. The other rows are delivered; row 2 is set aside for this code, and counted.
    let (seen, bad) =
        run_hooks_until::<E, FragileHook>(&ctx.db, Duration::from_secs(20), 2, None).await;
    let mut ids: Vec<&str> = seen.iter().map(|h| h.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["1", "3"]);
    assert_eq!(bad, ["2"]);
    // Code of version 1 still takes it: the record holds for the code that made it.
    let (seen, _) = run_hooks::<E, OldHook>(&ctx.db, Duration::from_secs(20), 1).await;
    assert_eq!(
        seen.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(),
        ["2"]
    );
}

pub async fn an_older_row_that_is_not_its_versions_json_is_an_integrity_error<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let olds = ctx.db.clone().model::<OldMember>();
    olds.build(old("1", "a", "Plato")).await.unwrap();
    let members = ctx.db.clone().model::<Member>();
    // A row no conversion reads: an insert over it is `AlreadyExists`, as over any row.
    assert!(matches!(
        members
            .build(member("1", "a", "Pla", "To"))
            .await
            .unwrap_err(),
        TitoError::AlreadyExists(_)
    ));
    // Broken JSON under a version-2 header and under none (version 1), read by version-3 code:
    // not a shape question.
    for (id, bytes) in [("2", &b"v2:{not json"[..]), ("3", b"{not json")] {
        olds.build(old(id, "a", "Ada Lovelace")).await.unwrap();
        let key = row_key(id);
        ctx.db
            .transaction(|tx| {
                let key = key.clone();
                async move { tx.put(key.into_bytes(), bytes.to_vec()).await }
            })
            .await
            .unwrap();
        let err = members.find_by_id(id, vec![]).await.unwrap_err();
        assert!(matches!(err, TitoError::Integrity(_)), "{id}: {err:?}");
        assert!(matches!(
            members.build(member(id, "a", "B", "C")).await.unwrap_err(),
            TitoError::AlreadyExists(_)
        ));
    }
    let report = members.audit(|_| {}).await.unwrap();
    use tito::schema::AuditKind;
    assert_eq!(report.count(AuditKind::MalformedRow), 2, "{report:?}");
    assert_eq!(report.count(AuditKind::UnreadableRow), 1, "{report:?}");
}
