//! Models: CRUD, sparse/composite/array/unique indexes, manifests and integrity, the query
//! builder and its cursors. Written once, run on every backend.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tito::model::{
    TitoEventConfig, TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait,
    TitoOperation, TitoOptions,
};
use tito::{TitoEngine, TitoError, TitoTransaction};

use crate::support::{Ctx, read};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! models_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            models,
            [
                the_seed_sample_works,
                insert_update_upsert_delete,
                indexes_are_sparse_and_follow_arrays,
                composite_indexes_take_prefixes_and_ranges,
                unique_indexes_refuse_a_second_row,
                unique_index_races_have_one_winner,
                updates_touch_only_changed_index_keys,
                concurrent_updates_of_one_row_converge,
                timestamps_only_where_the_model_has_them,
                integrity_errors_change_nothing,
                scans_fail_on_corrupt_rows,
                cursors_page_forward_and_backward,
                query_mistakes_are_clear_errors,
                key_only_entries_hold_keys_and_queries_read_the_rows,
            ]
        );
    };
}

fn field(name: &str, kind: TitoIndexBlockType) -> TitoIndexField {
    TitoIndexField {
        name: name.to_string(),
        r#type: kind,
    }
}

fn index(name: &str, fields: Vec<TitoIndexField>) -> TitoIndexConfig {
    TitoIndexConfig {
        condition: true,
        name: name.to_string(),
        fields,
    }
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct User {
    id: String,
    name: String,
    email: String,
}

impl TitoModelTrait for User {
    fn id(&self) -> String {
        self.id.clone()
    }

    fn table(&self) -> String {
        "user".to_string()
    }

    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![TitoIndexConfig {
            condition: true,
            name: "by_email".to_string(),
            fields: vec![TitoIndexField {
                name: "email".to_string(),
                r#type: TitoIndexBlockType::String,
            }],
        }]
    }

    fn events(&self) -> Vec<TitoEventConfig> {
        let now = chrono::Utc::now().timestamp();
        vec![
            TitoEventConfig {
                name: "user".to_string(),
                timestamp: now,
            },
            TitoEventConfig {
                name: "analytics".to_string(),
                timestamp: now,
            },
        ]
    }
}

fn user(id: &str, email: &str) -> User {
    User {
        id: id.into(),
        name: format!("name {id}"),
        email: email.into(),
    }
}

/// A model with every kind of index.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Item {
    id: String,
    team: Option<String>,
    rank: i64,
    score: f64,
    tags: Vec<String>,
    handle: String,
    active: bool,
}

impl TitoModelTrait for Item {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "item".into()
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![
            index(
                "item_by_team",
                vec![field("team", TitoIndexBlockType::String)],
            ),
            index(
                "item_by_team_rank",
                vec![
                    field("team", TitoIndexBlockType::String),
                    field("rank", TitoIndexBlockType::Integer),
                ],
            ),
            index(
                "item_by_tag",
                vec![field("tags", TitoIndexBlockType::String)],
            ),
            index(
                "item_by_score",
                vec![field("score", TitoIndexBlockType::Number)],
            ),
            TitoIndexConfig {
                condition: self.active,
                name: "item_active".into(),
                fields: vec![field("rank", TitoIndexBlockType::Integer)],
            },
        ]
    }
    fn unique_indexes(&self) -> Vec<TitoIndexConfig> {
        vec![index(
            "item_by_handle",
            vec![field("handle", TitoIndexBlockType::String)],
        )]
    }
}

fn item(id: &str, team: Option<&str>, rank: i64) -> Item {
    Item {
        id: id.into(),
        team: team.map(Into::into),
        rank,
        score: rank as f64 / 2.0,
        tags: vec![],
        handle: format!("h-{id}"),
        active: true,
    }
}

fn ids<T: TitoModelTrait>(items: &[T]) -> Vec<String> {
    items.iter().map(|m| m.id()).collect()
}

/// Every key under a prefix, read directly through the engine.
async fn keys_under<E: TitoEngine>(db: &E, prefix: &str) -> Vec<String> {
    let tx = db.begin().await.unwrap();
    let end = tito::prefix_end(prefix.to_string());
    let rows = tx
        .scan(prefix.as_bytes(), end.as_bytes(), 10_000)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    rows.into_iter()
        .map(|(k, _)| String::from_utf8(k).unwrap())
        .collect()
}

async fn raw_put<E: TitoEngine>(db: &E, key: &str, value: &[u8]) {
    let (key, value) = (key.as_bytes().to_vec(), value.to_vec());
    db.transaction(|tx| async move { tx.put(key, value).await })
        .await
        .unwrap();
}

async fn raw_delete<E: TitoEngine>(db: &E, key: &str) {
    let key = key.as_bytes().to_vec();
    db.transaction(|tx| async move { tx.delete(key).await })
        .await
        .unwrap();
}

pub async fn the_seed_sample_works<E: TitoEngine>(ctx: Ctx<E>) {
    let db = ctx.db.clone();
    let users = db.clone().model::<User>();
    let (id, email) = ("123".to_string(), "ada@example.com".to_string());
    let new_user = user(&id, &email);

    let users_in_tx = users.clone();
    let built = db
        .transaction(|tx| async move {
            users_in_tx
                .build_with_options(
                    new_user,
                    TitoOptions::with_events(TitoOperation::Insert),
                    &tx,
                )
                .await
        })
        .await
        .unwrap();
    assert_eq!(built.email, email);

    let found = users.find_by_id(&id, vec![]).await.unwrap();
    assert_eq!(found, user(&id, &email));

    let mut query = users.query_by_index("by_email");
    let results = query.value(&email).limit(Some(10)).execute().await.unwrap();
    assert_eq!(results.items, vec![user(&id, &email)]);
    assert_eq!(results.cursor, None);

    // Relationships are not loaded: asking for one is a clear error.
    let err = users
        .find_by_id(&id, vec!["team".into()])
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
}

pub async fn insert_update_upsert_delete<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<User>();
    users.build(user("1", "a@x")).await.unwrap();
    // A second insert of the same id fails and writes nothing.
    let err = users.build(user("1", "b@x")).await.unwrap_err();
    assert!(matches!(err, TitoError::AlreadyExists(_)), "{err:?}");
    assert_eq!(users.find_by_id("1", vec![]).await.unwrap().email, "a@x");
    assert!(
        users
            .query_by_index("by_email")
            .value("b@x")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Update needs the row.
    let err = users.update(user("2", "c@x")).await.unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
    users.update(user("1", "b@x")).await.unwrap();
    assert!(
        users
            .query_by_index("by_email")
            .value("a@x")
            .execute()
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert_eq!(
        ids(&users
            .query_by_index("by_email")
            .value("b@x")
            .execute()
            .await
            .unwrap()
            .items),
        ["1"]
    );

    // Upsert inserts or replaces.
    users.upsert(user("2", "c@x")).await.unwrap();
    users.upsert(user("2", "d@x")).await.unwrap();
    let found = users
        .find_by_ids(&["2".into(), "9".into(), "1".into()])
        .await
        .unwrap();
    assert_eq!(
        found,
        vec![Some(user("2", "d@x")), None, Some(user("1", "b@x"))]
    );

    // Delete removes the row, its entries and its manifest.
    users.delete_by_id("1").await.unwrap();
    assert!(matches!(
        users.find_by_id("1", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
    assert!(matches!(
        users.delete_by_id("1").await,
        Err(TitoError::NotFound(_))
    ));
    assert!(
        keys_under(&ctx.db, "index:user:by_email:email:b@x:")
            .await
            .is_empty()
    );
    assert!(
        keys_under(&ctx.db, "reverse-index:table:user:;1")
            .await
            .is_empty()
    );

    // The table scan sees what is left; rows of models without indexes have manifests too.
    let page = users.find().execute().await.unwrap();
    assert_eq!(ids(&page.items), ["2"]);
    assert_eq!(
        read(&ctx.db, b"reverse-index:table:user:;2")
            .await
            .as_deref(),
        Some(&br#"{"v":1,"keys":["index:user:by_email:email:d@x:table:user:;2"]}"#[..])
    );
}

pub async fn indexes_are_sparse_and_follow_arrays<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    let mut tagged = item("t", Some(""), 1);
    tagged.tags = vec!["red".into(), "blue".into(), "red".into()];
    tagged.active = false;
    items.build(tagged).await.unwrap();
    items.build(item("n", None, 2)).await.unwrap();
    items.build(item("s", Some("core"), 3)).await.unwrap();

    // Empty and missing team: no entry in either team index.
    assert_eq!(
        keys_under(&ctx.db, "index:item:item_by_team:").await.len(),
        1
    );
    assert_eq!(
        keys_under(&ctx.db, "index:item:item_by_team_rank:")
            .await
            .len(),
        1
    );
    // One entry per distinct tag.
    assert_eq!(
        ids(&items
            .query_by_index("item_by_tag")
            .value("red")
            .execute()
            .await
            .unwrap()
            .items),
        ["t"]
    );
    assert_eq!(
        keys_under(&ctx.db, "index:item:item_by_tag:").await.len(),
        2
    );
    // The condition keeps inactive rows out.
    assert_eq!(
        ids(&items
            .query_by_index("item_active")
            .execute()
            .await
            .unwrap()
            .items),
        ["n", "s"]
    );
    // Index values are whole rows.
    let page = items
        .query_by_index("item_by_tag")
        .value("blue")
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items[0].tags, vec!["red", "blue", "red"]);
}

pub async fn composite_indexes_take_prefixes_and_ranges<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    for (id, team, rank) in [
        ("a", "x", -5),
        ("b", "x", 3),
        ("c", "x", 20),
        ("d", "y", 1),
        ("e", "xy", 2),
    ] {
        items.build(item(id, Some(team), rank)).await.unwrap();
    }
    let q = |team: &'static str| {
        let mut query = items.query_by_index("item_by_team_rank");
        query.value(team);
        query
    };
    // A prefix never matches a longer value ("x" vs "xy").
    assert_eq!(ids(&q("x").execute().await.unwrap().items), ["a", "b", "c"]);
    assert_eq!(
        ids(&q("x").range(0..20).execute().await.unwrap().items),
        ["b"]
    );
    assert_eq!(
        ids(&q("x").range(-5..=20).execute().await.unwrap().items),
        ["a", "b", "c"]
    );
    assert_eq!(
        ids(&q("x").range(..3).execute().await.unwrap().items),
        ["a"]
    );
    assert_eq!(
        ids(&q("x")
            .range(4..)
            .reverse(true)
            .execute()
            .await
            .unwrap()
            .items),
        ["c"]
    );
    let both = items
        .query_by_index("item_by_team_rank")
        .value("x")
        .value(&3)
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(&both.items), ["b"]);
    // Range on the first field; numbers sort as numbers, negatives included.
    assert_eq!(
        ids(&items
            .query_by_index("item_by_score")
            .range(-3.0..2.0)
            .execute()
            .await
            .unwrap()
            .items),
        ["a", "d", "e", "b"]
    );
    assert_eq!(
        ids(&items
            .query_by_index("item_by_team")
            .range("x".."y")
            .execute()
            .await
            .unwrap()
            .items),
        ["a", "b", "c", "e"]
    );
}

pub async fn unique_indexes_refuse_a_second_row<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    items.build(item("1", None, 1)).await.unwrap();
    let mut twin = item("2", None, 2);
    twin.handle = "h-1".into();
    let err = items.build(twin.clone()).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::UniqueViolation { index, owner } if index == "item_by_handle" && owner == "1"),
        "{err:?}"
    );
    assert!(matches!(
        items.find_by_id("2", vec![]).await,
        Err(TitoError::NotFound(_))
    ));

    // Inside one transaction: the second write sees the first one's claim.
    let (a, b) = (items.clone(), twin.clone());
    let err = ctx
        .db
        .transaction(|tx| async move {
            let mut first = b.clone();
            first.id = "3".into();
            first.handle = "fresh".into();
            a.build_with_options(first, TitoOptions::default(), &tx)
                .await?;
            let mut second = b;
            second.handle = "fresh".into();
            a.build_with_options(second, TitoOptions::default(), &tx)
                .await
        })
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::UniqueViolation { .. }), "{err:?}");

    // A handle given up is free for another row; the unique index is queryable.
    let mut moved = item("1", None, 1);
    moved.handle = "other".into();
    items.update(moved).await.unwrap();
    items.build(twin).await.unwrap();
    assert_eq!(
        ids(&items
            .query_by_index("item_by_handle")
            .value("h-1")
            .execute()
            .await
            .unwrap()
            .items),
        ["2"]
    );
    items.delete_by_id("2").await.unwrap();
    items.build(item("4", None, 4)).await.unwrap();
    let mut again = item("5", None, 5);
    again.handle = "h-1".into();
    items.build(again).await.unwrap();
}

pub async fn unique_index_races_have_one_winner<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    let mut tasks = Vec::new();
    for n in 0..6 {
        let items = items.clone();
        tasks.push(tokio::spawn(async move {
            let mut racer = item(&format!("r{n}"), None, n);
            racer.handle = "contested".into();
            items.build(racer).await
        }));
    }
    let mut wins = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) => wins += 1,
            Err(TitoError::UniqueViolation { .. }) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(wins, 1);
    assert_eq!(
        items
            .query_by_index("item_by_handle")
            .value("contested")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    assert_eq!(items.find().execute().await.unwrap().items.len(), 1);
}

pub async fn updates_touch_only_changed_index_keys<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    let mut it = item("u", Some("x"), 1);
    it.tags = vec!["a".into(), "b".into()];
    items.build(it.clone()).await.unwrap();
    let before = keys_under(&ctx.db, "index:").await;

    // The same row written again writes nothing at all.
    let counted = tito::engine::FaultyEngine::new(ctx.db.clone());
    counted
        .clone()
        .model::<Item>()
        .update(it.clone())
        .await
        .unwrap();
    assert_eq!(counted.faults().calls(tito::engine::FaultPoint::Put), 0);
    assert_eq!(counted.faults().calls(tito::engine::FaultPoint::Delete), 0);

    // One tag replaced: its entry goes, the new one comes, the others stay (with new values).
    it.tags = vec!["a".into(), "c".into()];
    items.update(it.clone()).await.unwrap();
    let after = keys_under(&ctx.db, "index:").await;
    let removed: Vec<&String> = before.iter().filter(|k| !after.contains(k)).collect();
    let added: Vec<&String> = after.iter().filter(|k| !before.contains(k)).collect();
    assert_eq!(removed, ["index:item:item_by_tag:tags:b:table:item:u"]);
    assert_eq!(added, ["index:item:item_by_tag:tags:c:table:item:u"]);
    let page = items
        .query_by_index("item_by_tag")
        .value("a")
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items[0].tags, vec!["a", "c"]);
}

pub async fn concurrent_updates_of_one_row_converge<E: TitoEngine>(ctx: Ctx<E>) {
    #[derive(Default, Clone, Debug, Serialize, Deserialize)]
    struct Counter {
        id: String,
        hits: u64,
    }
    impl TitoModelTrait for Counter {
        fn id(&self) -> String {
            self.id.clone()
        }
        fn table(&self) -> String {
            "counter".into()
        }
        fn indexes(&self) -> Vec<TitoIndexConfig> {
            vec![index(
                "counter_by_hits",
                vec![field("hits", TitoIndexBlockType::Unsigned)],
            )]
        }
    }
    let counters = Arc::new(ctx.db.clone().model::<Counter>());
    counters
        .build(Counter {
            id: "c".into(),
            hits: 0,
        })
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let counters = counters.clone();
        let db = ctx.db.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let counters = (*counters).clone();
                db.transaction(|tx| async move {
                    let mut c = counters.find_by_id_in_tx("c", &tx).await?;
                    c.hits += 1;
                    counters
                        .update_with_options(c, TitoOptions::default(), &tx)
                        .await
                })
                .await
                .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(counters.find_by_id("c", vec![]).await.unwrap().hits, 20);
    // Exactly one index entry, at the final value.
    assert_eq!(
        keys_under(&ctx.db, "index:counter:counter_by_hits:")
            .await
            .len(),
        1
    );
    assert_eq!(
        counters
            .query_by_index("counter_by_hits")
            .value(&20u64)
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

pub async fn timestamps_only_where_the_model_has_them<E: TitoEngine>(ctx: Ctx<E>) {
    #[derive(Default, Clone, Debug, Serialize, Deserialize)]
    struct Post {
        id: String,
        body: String,
        created_at: i64,
        updated_at: String,
    }
    impl TitoModelTrait for Post {
        fn id(&self) -> String {
            self.id.clone()
        }
        fn table(&self) -> String {
            "post".into()
        }
    }
    let posts = ctx.db.clone().model::<Post>();
    let before = chrono::Utc::now().timestamp() - 1;
    let built = posts
        .build(Post {
            id: "p".into(),
            body: "x".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(built.created_at >= before, "{built:?}");
    assert!(
        chrono::DateTime::parse_from_rfc3339(&built.updated_at).is_ok(),
        "{built:?}"
    );
    let updated = posts
        .update(Post {
            id: "p".into(),
            body: "y".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        updated.created_at, built.created_at,
        "created_at is kept on update"
    );

    // A model without the fields gets nothing added.
    let users = ctx.db.clone().model::<User>();
    users.build(user("u", "u@x")).await.unwrap();
    let row = read(&ctx.db, b"table:user:u").await.unwrap();
    let json: serde_json::Value = serde_json::from_slice(&row).unwrap();
    assert_eq!(json.as_object().unwrap().len(), 3, "{json}");
}

pub async fn integrity_errors_change_nothing<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<User>();
    for id in ["1", "2", "3", "4"] {
        users.build(user(id, &format!("{id}@x"))).await.unwrap();
    }
    let expect_integrity = |result: Result<(), TitoError>, what: &str| {
        assert!(
            matches!(result, Err(TitoError::Integrity(_))),
            "{what}: {result:?}"
        );
    };

    // Missing manifest.
    raw_delete(&ctx.db, "reverse-index:table:user:;1").await;
    expect_integrity(
        users.update(user("1", "new@x")).await.map(drop),
        "missing manifest",
    );
    expect_integrity(users.delete_by_id("1").await, "missing manifest on delete");
    assert_eq!(users.find_by_id("1", vec![]).await.unwrap().email, "1@x");

    // Orphaned manifest: no row.
    raw_delete(&ctx.db, "table:user:;2").await;
    expect_integrity(
        users.build(user("2", "2@x")).await.map(drop),
        "orphaned manifest",
    );
    expect_integrity(users.delete_by_id("2").await, "orphaned manifest on delete");

    // A manifest naming another row's key (cross-record), and a malformed one.
    raw_put(
        &ctx.db,
        "reverse-index:table:user:;3",
        br#"["index:user:by_email:email:4@x:table:user:;4"]"#,
    )
    .await;
    expect_integrity(users.delete_by_id("3").await, "cross-record manifest");
    assert_eq!(users.find_by_id("4", vec![]).await.unwrap().email, "4@x");
    raw_put(&ctx.db, "reverse-index:table:user:;3", b"{not json").await;
    expect_integrity(
        users.update(user("3", "z@x")).await.map(drop),
        "malformed manifest",
    );

    // A listed key that is gone.
    raw_delete(&ctx.db, "index:user:by_email:email:;4@x:table:user:;4").await;
    expect_integrity(users.delete_by_id("4").await, "listed key missing");
    assert!(
        read(&ctx.db, b"table:user:;4").await.is_some(),
        "nothing was deleted"
    );
}

pub async fn scans_fail_on_corrupt_rows<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<User>();
    users.build(user("1", "a@x")).await.unwrap();
    users.build(user("3", "c@x")).await.unwrap();
    raw_put(&ctx.db, "table:user:;2", b"{broken").await;
    let err = users.find().execute().await.unwrap_err();
    assert!(
        matches!(&err, TitoError::Integrity(m) if m.contains("table:user:;2")),
        "{err:?}"
    );
    raw_put(&ctx.db, "table:user:;2", br#"{"id": 2}"#).await;
    assert!(matches!(
        users.find().execute().await,
        Err(TitoError::Integrity(_))
    ));
    // The page before the corrupt row is fine.
    let page = users.find().end("2").execute().await.unwrap();
    assert_eq!(ids(&page.items), ["1"]);
    // A corrupt index entry fails the index query too.
    raw_put(
        &ctx.db,
        "index:user:by_email:email:a@x:table:user:;1",
        b"[]",
    )
    .await;
    assert!(matches!(
        users
            .query_by_index("by_email")
            .value("a@x")
            .execute()
            .await,
        Err(TitoError::Integrity(_))
    ));
    assert!(users.find_by_id("2", vec![]).await.is_err());

    // A key that is not UTF-8 inside the table's range fails the scan too.
    let (key, value) = (
        b"table:user:\xff".to_vec(),
        br#"{"id":"x","name":"","email":""}"#.to_vec(),
    );
    ctx.db
        .transaction(|tx| async move { tx.put(key, value).await })
        .await
        .unwrap();
    let err = users.find().start("3").execute().await.unwrap_err();
    assert!(
        matches!(&err, TitoError::Integrity(m) if m.contains("UTF-8")),
        "{err:?}"
    );
}

pub async fn cursors_page_forward_and_backward<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<User>();
    // `a2` and `a20`: continuing after a2 must not skip a20.
    for id in ["a1", "a2", "a20", "a3", "b"] {
        users.build(user(id, "same@x")).await.unwrap();
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = users
            .query_by_index("by_email")
            .value("same@x")
            .limit(Some(2))
            .cursor(cursor.clone())
            .execute()
            .await
            .unwrap();
        seen.extend(ids(&page.items));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(seen, ["a1", "a2", "a20", "a3", "b"]);

    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = users
            .find()
            .reverse(true)
            .limit(Some(2))
            .cursor(cursor.clone())
            .execute()
            .await
            .unwrap();
        seen.extend(ids(&page.items));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(seen, ["b", "a3", "a20", "a2", "a1"]);

    let first = users
        .find()
        .start("a2")
        .limit(Some(1))
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(&first.items), ["a2"]);
    let next = users
        .find()
        .start("a2")
        .limit(Some(1))
        .cursor(first.cursor.clone())
        .execute()
        .await
        .unwrap();
    assert_eq!(ids(&next.items), ["a20"]);

    // A cursor from another range is refused; so is a forged one.
    let err = users
        .find()
        .start("b")
        .cursor(first.cursor)
        .execute()
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let err = users
        .find()
        .cursor(Some("garbage".into()))
        .execute()
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
}

pub async fn query_mistakes_are_clear_errors<E: TitoEngine>(ctx: Ctx<E>) {
    let items = ctx.db.clone().model::<Item>();
    items.build(item("1", Some("x"), 1)).await.unwrap();
    let invalid = |result: Result<tito::TitoPage<Item>, TitoError>, what: &str| {
        let err = result.unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{what}: {err:?}"
        );
        err.to_string()
    };
    let msg = invalid(
        items.query_by_index("nope").execute().await,
        "unknown index",
    );
    assert!(msg.contains("nope"), "{msg}");
    invalid(
        items
            .query_by_index("item_by_team")
            .value("x")
            .value("y")
            .execute()
            .await,
        "too many values",
    );
    invalid(
        items
            .query_by_index("item_by_team")
            .value("x")
            .range(1..2)
            .execute()
            .await,
        "range past the fields",
    );
    let msg = invalid(
        items
            .query_by_index("item_by_team_rank")
            .value(&5)
            .execute()
            .await,
        "wrong type",
    );
    assert!(msg.contains("team"), "{msg}");
    invalid(
        items
            .query_by_index("item_by_team_rank")
            .value("x")
            .value("high")
            .execute()
            .await,
        "wrong type in second field",
    );
    invalid(
        items
            .query_by_index("item_by_team")
            .limit(Some(0))
            .execute()
            .await,
        "zero limit",
    );
    invalid(
        items.find().limit(Some(0)).execute().await,
        "zero limit on find",
    );
}

/// The futures of every model operation can be spawned on a multi-threaded runtime.
#[allow(dead_code)]
fn model_futures_are_send<E: TitoEngine>(db: E, tx: &E::Transaction) {
    fn send<T: Send>(_: T) {}
    let users = db.model::<User>();
    send(users.build(user("1", "a@x")));
    send(users.update_with_options(user("1", "a@x"), TitoOptions::default(), tx));
    send(users.delete_by_id("1"));
    send(users.find_by_id("1", vec![]));
    send(users.find_by_ids(&[]));
    send(users.find().execute());
    send(users.query_by_index("by_email").value("a@x").execute());
    send(users.query_by_index("by_email").execute_in_tx(tx));
}

/// The same, with a concrete engine: what users write (auto traits of async fns are checked at
/// the call site there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_futures_spawn_with_a_concrete_engine() {
    let db = tito::backend::embedded::Embedded::temporary()
        .await
        .unwrap();
    let users = db.clone().model::<User>();
    let u = users.clone();
    tokio::spawn(async move { u.build(user("1", "a@x")).await })
        .await
        .unwrap()
        .unwrap();
    let u = users.clone();
    let found = tokio::spawn(async move { u.find_by_id("1", vec![]).await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.email, "a@x");
    let u = users.clone();
    let page =
        tokio::spawn(async move { u.query_by_index("by_email").value("a@x").execute().await })
            .await
            .unwrap()
            .unwrap();
    assert_eq!(page.items.len(), 1);
    let u = users.clone();
    tokio::spawn(async move {
        db.transaction(|tx| async move {
            u.update_with_options(user("1", "b@x"), TitoOptions::default(), &tx)
                .await
        })
        .await
    })
    .await
    .unwrap()
    .unwrap();
}

/// A model with both entry layouts: `entries = "keys"` on a composite and a unique index, copies
/// (the default) on another.
// clippy's duplicated_attributes reads two `entries = "keys"` as one attribute given twice
// (rust-clippy#12923).
#[allow(clippy::duplicated_attributes)]
#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "doc")]
#[tito(index = "doc_by_owner_rank: owner, rank", entries = "keys")]
#[tito(unique_index = "doc_by_slug: slug", entries = "keys")]
#[tito(index = "doc_by_owner: owner", entries = "copies")]
struct Doc {
    id: String,
    owner: String,
    slug: String,
    rank: i64,
    body: String,
}

fn doc(i: i64, owner: &str) -> Doc {
    Doc {
        id: format!("d{i}"),
        owner: owner.to_string(),
        slug: format!("s{i}"),
        rank: i,
        body: format!("the body of document {i}, long enough to be worth not copying"),
    }
}

/// The same table and index name with copies: another definition of `doc_by_owner_rank`.
#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "doc")]
#[tito(index = "doc_by_owner_rank: owner, rank")]
#[tito(unique_index = "doc_by_slug: slug", entries = "keys")]
#[tito(index = "doc_by_owner: owner")]
struct DocWithCopies {
    id: String,
    owner: String,
    slug: String,
    rank: i64,
    body: String,
}

/// The next deploy of [`Doc`]: one more index of keys, built over the rows already there.
// clippy's duplicated_attributes reads two `entries = "keys"` as one attribute given twice
// (rust-clippy#12923).
#[allow(clippy::duplicated_attributes)]
#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "doc")]
#[tito(index = "doc_by_owner_rank: owner, rank", entries = "keys")]
#[tito(unique_index = "doc_by_slug: slug", entries = "keys")]
#[tito(index = "doc_by_owner: owner", entries = "copies")]
#[tito(index = "doc_by_rank: rank", entries = "keys")]
struct DocV2 {
    id: String,
    owner: String,
    slug: String,
    rank: i64,
    body: String,
}

/// Entries and their values under `prefix`.
async fn entries_under<E: TitoEngine>(db: &E, prefix: &str) -> Vec<(String, Vec<u8>)> {
    let tx = db.begin().await.unwrap();
    let end = tito::prefix_end(prefix.to_string());
    let rows = tx
        .scan(prefix.as_bytes(), end.as_bytes(), 10_000)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    rows.into_iter()
        .map(|(k, v)| (String::from_utf8(k).unwrap(), v))
        .collect()
}

pub async fn key_only_entries_hold_keys_and_queries_read_the_rows<E: TitoEngine>(ctx: Ctx<E>) {
    // No writer races the later deploy's build: it need not wait the default ten seconds.
    tito::schema::set_write_grace(&ctx.db, std::time::Duration::from_millis(50)).unwrap();
    let docs = ctx.db.clone().model::<Doc>();
    for i in 1..=5 {
        docs.build(doc(i, "a")).await.unwrap();
    }
    for i in 6..=7 {
        docs.build(doc(i, "b")).await.unwrap();
    }
    // Keys only: empty values. Copies: the row's bytes.
    let keyed = entries_under(&ctx.db, "index:doc:doc_by_owner_rank:").await;
    assert_eq!(keyed.len(), 7);
    assert!(keyed.iter().all(|(_, v)| v.is_empty()), "{keyed:?}");
    let slugs = entries_under(&ctx.db, "index:doc:doc_by_slug:").await;
    assert_eq!(slugs.len(), 7);
    assert!(slugs.iter().all(|(_, v)| v.is_empty()));
    let copies = entries_under(&ctx.db, "index:doc:doc_by_owner:").await;
    let d1 = tito::keys::row_key("doc", "d1");
    let row = read(&ctx.db, d1.as_bytes()).await.unwrap();
    assert_eq!(copies.len(), 7);
    assert_eq!(copies[0].1, row);

    // Queries read the rows: pages of two, newest first, cursors across pages.
    let mut ranks = Vec::new();
    let mut cursor = None;
    loop {
        let page = docs
            .doc_by_owner_rank("a")
            .reverse(true)
            .limit(Some(2))
            .cursor(cursor)
            .execute()
            .await
            .unwrap();
        assert!(page.items.len() <= 2);
        ranks.extend(page.items.iter().map(|d| (d.rank, d.body.clone())));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    let expected: Vec<(i64, String)> = (1..=5).rev().map(|i| (i, doc(i, "a").body)).collect();
    assert_eq!(ranks, expected);
    let page = docs
        .doc_by_owner_rank("b")
        .rank(7..)
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items, vec![doc(7, "b")]);
    let by_slug = docs.doc_by_slug("s3").execute().await.unwrap();
    assert_eq!(by_slug.items, vec![doc(3, "a")]);
    // A unique index of keys still refuses a second row with its values.
    let mut clash = doc(8, "a");
    clash.slug = "s3".into();
    assert!(matches!(
        docs.build(clash).await,
        Err(TitoError::UniqueViolation { .. })
    ));

    // An update that keeps every entry's key rewrites the row and the copy, not the keys.
    let counted = tito::engine::FaultyEngine::new(ctx.db.clone());
    let mut changed = doc(2, "a");
    changed.body = "a new body".into();
    counted
        .clone()
        .model::<Doc>()
        .update(changed.clone())
        .await
        .unwrap();
    assert_eq!(counted.faults().calls(tito::engine::FaultPoint::Put), 2);
    let page = docs
        .doc_by_owner_rank("a")
        .rank_eq(2)
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items, vec![changed.clone()]);
    // Moving a key moves the entry (still empty).
    changed.rank = 20;
    docs.update(changed.clone()).await.unwrap();
    let newest = docs
        .doc_by_owner_rank("a")
        .reverse(true)
        .limit(Some(1))
        .execute()
        .await
        .unwrap();
    assert_eq!(newest.items, vec![changed.clone()]);
    let keyed = entries_under(&ctx.db, "index:doc:doc_by_owner_rank:").await;
    assert_eq!(keyed.len(), 7);
    assert!(keyed.iter().all(|(_, v)| v.is_empty()));
    docs.delete_by_id("d7").await.unwrap();
    assert!(
        docs.doc_by_owner_rank("b")
            .execute()
            .await
            .unwrap()
            .items
            .iter()
            .all(|d| d.id == "d6")
    );

    // The catalog records the layout; the same name with copies is another definition.
    let schema = tito::schema::table_schema(&ctx.db, "doc").await.unwrap();
    let layout: Vec<(String, bool)> = schema
        .indexes
        .iter()
        .map(|i| (i.name.clone(), i.definition.key_only))
        .collect();
    assert_eq!(
        layout,
        [
            ("doc_by_owner".to_string(), false),
            ("doc_by_owner_rank".to_string(), true),
            ("doc_by_slug".to_string(), true),
        ]
    );
    let shown = schema.indexes[1].definition.to_string();
    assert!(shown.ends_with("keys only"), "{shown}");
    let other = DocWithCopies {
        id: "d9".into(),
        owner: "a".into(),
        slug: "s9".into(),
        rank: 9,
        body: String::new(),
    };
    match ctx.db.clone().model::<DocWithCopies>().build(other).await {
        Err(TitoError::SchemaMismatch(message)) => {
            assert!(message.contains("doc_by_owner_rank"), "{message}")
        }
        other => panic!("expected SchemaMismatch, got {other:?}"),
    }

    // An index of keys added by a later deploy is built with empty entries and queried.
    let v2 = ctx.db.clone().model::<DocV2>();
    v2.build_indexes(|_| {}).await.unwrap();
    let built = entries_under(&ctx.db, "index:doc:doc_by_rank:").await;
    assert_eq!(built.len(), 6);
    assert!(built.iter().all(|(_, v)| v.is_empty()));
    let low = v2.doc_by_rank_range(..4).execute().await.unwrap();
    let ids: Vec<&str> = low.items.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["d1", "d3"]);
    assert!(v2.audit(|_| {}).await.unwrap().is_clean());

    // The audit expects empty entries: one that holds bytes is found and emptied.
    assert!(docs.audit(|_| {}).await.unwrap().is_clean());
    let tampered = keyed[0].0.clone();
    let tx = ctx.db.begin().await.unwrap();
    tx.put(tampered.clone().into_bytes(), b"{}".to_vec())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let report = docs.repair(|_| {}).await.unwrap();
    assert_eq!(report.count(tito::schema::AuditKind::StaleClone), 1);
    assert_eq!(read(&ctx.db, tampered.as_bytes()).await, Some(Vec::new()));
    assert!(docs.audit(|_| {}).await.unwrap().is_clean());

    // An entry whose row is gone (deleted behind Tito's back) fails the query, naming both.
    let tx = ctx.db.begin().await.unwrap();
    tx.delete(d1.clone().into_bytes()).await.unwrap();
    tx.commit().await.unwrap();
    match docs.doc_by_owner_rank("a").rank_eq(1).execute().await {
        Err(TitoError::Integrity(message)) => {
            assert!(message.contains(&d1), "{message}");
            assert!(message.contains("does not exist"), "{message}");
        }
        other => panic!("expected an integrity error, got {other:?}"),
    }
}

/// A hand-written model naming a key-only index it does not declare is refused.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Misnamed {
    id: String,
}

impl TitoModelTrait for Misnamed {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "misnamed".to_string()
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![index(
            "misnamed_by_id",
            vec![field("id", TitoIndexBlockType::String)],
        )]
    }
    fn key_only_indexes(&self) -> Vec<String> {
        vec!["misnamed_by_idd".to_string()]
    }
}

#[tokio::test]
async fn key_only_names_must_be_indexes() {
    let db = tito::backend::memory::Memory::new();
    match db
        .model::<Misnamed>()
        .build(Misnamed { id: "1".into() })
        .await
    {
        Err(TitoError::InvalidArgument(message)) => {
            assert!(message.contains("misnamed_by_idd"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
