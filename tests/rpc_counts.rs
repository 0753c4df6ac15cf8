//! What each model operation costs on TiKV, counted by the test server per gRPC method, with
//! every kind of key (rows, manifests, index entries, claims, the catalog) in a region of its
//! own, as in a table large enough to span regions. The counts are exact: a change that adds a
//! round trip to an operation fails here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoModel};
use tito_tikv_test_server::TestCluster;

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[tito(table = "rpc_users")]
#[tito(unique_index = "rpc_user_by_email: email")]
#[tito(index = "rpc_user_by_team_created: team, created")]
struct User {
    id: String,
    email: String,
    team: String,
    created: i64,
}

fn user(i: i64, team: &str) -> User {
    User {
        id: format!("u{i}"),
        email: format!("u{i}@example.com"),
        team: team.to_string(),
        created: 1_700_000_000 + i,
    }
}

/// The calls of the data methods between two snapshots of the counters. (Timestamps come over
/// one PD stream, which the server counts once.)
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(method, _)| method.starts_with("Kv"))
        .map(|(method, n)| (method.clone(), n - before.get(method).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The counters once they stop moving: the commits of secondary keys run after a commit's reply.
async fn quiet(cluster: &TestCluster) -> BTreeMap<String, u64> {
    let mut last = cluster.all_calls();
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let now = cluster.all_calls();
        if now == last {
            return now;
        }
        last = now;
    }
}

fn calls(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(m, n)| (m.to_string(), *n)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_model_operations_cost_the_counted_requests() {
    let cluster = TestCluster::start().await.unwrap();
    for split in ["index:", "reverse-index:", "schema:", "table:", "unique:"] {
        cluster.split(split);
    }
    let db = TiKV::connect(cluster.pd_endpoints()).await.unwrap();
    let users = db.clone().model::<User>();
    // First use: the catalog is registered, then every operation runs warm.
    users.build(user(0, "core")).await.unwrap();
    for i in 1..12 {
        users.build(user(i, "core")).await.unwrap();
    }

    let mut table = Vec::new();
    macro_rules! count {
        ($name:expr, $op:expr) => {{
            let before = quiet(&cluster).await;
            $op;
            let counted = delta(&before, &quiet(&cluster).await);
            table.push(($name, counted.clone()));
            counted
        }};
    }

    let insert = count!(
        "insert (unique email, composite index)",
        users.build(user(100, "core")).await.unwrap()
    );
    let get = count!(
        "get by id",
        assert_eq!(users.find_by_id("u100", vec![]).await.unwrap().team, "core")
    );
    let query = count!("team's 10 newest (reverse index query)", {
        let page = users
            .rpc_user_by_team_created("core")
            .reverse(true)
            .limit(Some(10))
            .execute()
            .await
            .unwrap();
        assert_eq!(page.items.len(), 10);
        assert_eq!(page.items[0].id, "u100");
    });
    let update = count!(
        "update moving the row to another team",
        users.update(user(100, "edge")).await.unwrap()
    );
    let delete = count!("delete by id", users.delete_by_id("u100").await.unwrap());

    for (name, counted) in &table {
        println!("{name:<45} {counted:?}");
    }
    // A write reads the row, manifest, catalog and the claims it expects to take in one
    // request (one call per region, in parallel), prewrites each region it writes, commits the
    // primary's region, then the secondaries' after the reply (the client groups them by region,
    // the primary's region again included when it holds other keys).
    assert_eq!(
        insert,
        calls(&[("KvBatchGet", 4), ("KvCommit", 4), ("KvPrewrite", 4)])
    );
    assert_eq!(get, calls(&[("KvGet", 1)]));
    assert_eq!(query, calls(&[("KvScan", 1)]));
    // An update or a delete also checks the keys the manifest lists (entries and the claim).
    assert_eq!(
        update,
        calls(&[("KvBatchGet", 5), ("KvCommit", 4), ("KvPrewrite", 3)])
    );
    assert_eq!(
        delete,
        calls(&[("KvBatchGet", 5), ("KvCommit", 5), ("KvPrewrite", 4)])
    );
}
