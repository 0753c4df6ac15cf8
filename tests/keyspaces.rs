//! API v2 keyspaces: two Tito handles on two keyspaces of one cluster see nothing of each other
//! (rows, schema catalogs, queues, kv, garbage collection), every key they write carries their
//! keyspace's prefix, and mistakes are clear errors. The engine suites also run on two
//! keyspaces at once (`support::TikvKeyspacesBackend`).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::tikv::{TiKV, TiKVOptions};
use tito::kv::Kv;
use tito::queue::{Queue, QueueConfig, QueueEvent};
use tito::{TitoEngine, TitoError, TitoModel, TitoTransaction};
use tito_tikv_test_server::{
    Fault as ServerFault, FaultRule as ServerRule, TestCluster, keyspace_prefix,
};

/// One table, as one service sees it: rows indexed by team.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[tito(table = "ks_users")]
#[tito(index = "ks_user_by_team: team")]
struct TeamUser {
    id: String,
    team: String,
}

/// The same table name, as another service sees it: another index, which on one store would
/// replace the first (and build over its rows).
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[tito(table = "ks_users")]
#[tito(unique_index = "ks_user_by_email: email")]
struct MailUser {
    id: String,
    email: String,
}

async fn on(cluster: &TestCluster, keyspace: &str) -> TiKV {
    TiKV::connect_with(
        cluster.pd_endpoints(),
        TiKVOptions::default().keyspace(keyspace),
    )
    .await
    .unwrap()
}

/// Leaves a lock of `db`'s on `key` whose commit never arrives (the client gives up on its
/// primary's commit).
async fn abandon_a_lock(cluster: &TestCluster, db: &TiKV, key: &[u8]) {
    cluster.add_fault(ServerRule::new("KvCommit", ServerFault::Unavailable).always());
    let tx = db.begin().await.unwrap();
    tx.put(key.to_vec(), b"never".to_vec()).await.unwrap();
    let err = tx.commit().await.unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "{err:?}"
    );
    cluster.clear_faults();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_two_keyspaces_see_nothing_of_each_other() {
    let cluster = TestCluster::start().await.unwrap();
    let (alpha_id, beta_id) = (
        cluster.create_keyspace("alpha"),
        cluster.create_keyspace("beta"),
    );
    let alpha = on(&cluster, "alpha").await;
    let beta = on(&cluster, "beta").await;
    assert_eq!(alpha.keyspace(), Some("alpha"));
    let plain = TiKV::connect(cluster.pd_endpoints()).await.unwrap();

    // Rows and schema catalogs: the same table under two definitions, each ready at once on
    // its own empty table (on one store the second would drop the first's index and build).
    let teams = alpha.clone().model::<TeamUser>();
    for (id, team) in [("u1", "core"), ("u2", "core"), ("u3", "edge")] {
        teams
            .build(TeamUser {
                id: id.into(),
                team: team.into(),
            })
            .await
            .unwrap();
    }
    let mails = beta.clone().model::<MailUser>();
    assert!(matches!(
        mails.find_by_id("u1", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
    mails
        .build(MailUser {
            id: "u1".into(),
            email: "ada@example.com".into(),
        })
        .await
        .unwrap();
    let found = mails
        .ks_user_by_email("ada@example.com")
        .execute()
        .await
        .unwrap();
    assert_eq!(found.items.len(), 1);
    let core = teams.ks_user_by_team("core").execute().await.unwrap();
    assert_eq!(
        core.items.len(),
        2,
        "alpha's index untouched by beta's catalog"
    );
    assert_eq!(teams.find_by_id("u1", vec![]).await.unwrap().team, "core");
    assert_eq!(
        tito::inspect::tables(&alpha, 10).await.unwrap(),
        vec!["ks_users".to_string()]
    );
    assert_eq!(
        tito::inspect::tables(&plain, 10).await.unwrap(),
        Vec::<String>::new()
    );

    // Queues: alpha's queue of 4 partitions holds three events; beta's queue of the same name
    // is empty and takes another partition count.
    let now = chrono::Utc::now().timestamp() + 3600;
    let jobs = Queue::new(
        alpha.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)),
    );
    for key in ["j1", "j2", "j3"] {
        jobs.publish(QueueEvent::new(key, 1u32, now)).await.unwrap();
    }
    let other = Queue::new(beta.clone(), QueueConfig::new(8, Duration::from_secs(3600)));
    other
        .publish(QueueEvent::new("b1", 2u32, now))
        .await
        .unwrap();
    let mut pending = (0, 0);
    for p in 0..4 {
        pending.0 += jobs.pending_count(p).await.unwrap();
    }
    for p in 0..8 {
        pending.1 += other.pending_count(p).await.unwrap();
    }
    assert_eq!(pending, (3, 1));
    let overview = tito::inspect::queue_overview(&plain, None).await.unwrap();
    assert_eq!(
        overview.info.partitions, None,
        "nothing of either on API v1"
    );

    // kv: the same namespace and key, two values.
    let (kv_a, kv_b) = (Kv::new(alpha.clone()), Kv::new(beta.clone()));
    kv_a.put("cfg", "mode", &"fast", Some(0), None)
        .await
        .unwrap();
    assert_eq!(kv_b.get("cfg", "mode").await.unwrap(), None);
    kv_b.put("cfg", "mode", &"safe", Some(0), None)
        .await
        .unwrap();
    assert_eq!(
        kv_a.get("cfg", "mode").await.unwrap().unwrap().value,
        serde_json::json!("fast")
    );

    // Every key either handle wrote carries its keyspace's prefix.
    let (pa, pb) = (keyspace_prefix(alpha_id), keyspace_prefix(beta_id));
    let stored = cluster.stored_keys();
    assert!(stored.iter().any(|k| k.starts_with(&pa)));
    assert!(stored.iter().any(|k| k.starts_with(&pb)));
    for key in &stored {
        assert!(key.starts_with(&pa) || key.starts_with(&pb), "{key:?}");
    }

    // Garbage collection: alpha's resolves alpha's abandoned locks only and leaves the
    // cluster's safe point (beta's history, beta's locks) alone.
    abandon_a_lock(&cluster, &alpha, b"gc:a").await;
    abandon_a_lock(&cluster, &beta, b"gc:b").await;
    let old = beta.begin().await.unwrap();
    kv_b.put("cfg", "mode", &"safer", None, None).await.unwrap();
    assert_eq!(cluster.lock_count(), 2);
    // Past the locks' TTL, so that a resolution may roll them back.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let safe = alpha
        .garbage_collect(Duration::from_millis(1))
        .await
        .unwrap();
    assert!(safe > old.start_version());
    assert_eq!(
        cluster.gc_safe_point(),
        0,
        "the cluster's safe point is not a keyspace's"
    );
    assert_eq!(cluster.lock_count(), 1, "beta's lock is beta's");
    let mut reread = Vec::new();
    for key in cluster.stored_keys() {
        if key.starts_with(&pb) {
            reread.push(key);
        }
    }
    assert!(reread.iter().any(|k| k.ends_with(b"gc:b")));
    beta.garbage_collect(Duration::from_millis(1))
        .await
        .unwrap();
    assert_eq!(cluster.lock_count(), 0);
    // A transaction of beta's older than alpha's collection still reads its snapshot.
    let entry = {
        let key = old.scan(b"kv:", b"kv;", 10).await.unwrap();
        key.len()
    };
    assert!(entry > 0, "beta's old snapshot still reads");
    old.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_keyspace_mistakes_are_clear_errors() {
    let cluster = TestCluster::start().await.unwrap();
    cluster.create_keyspace("alpha");
    // A keyspace the cluster does not have.
    let err = TiKV::connect_with(
        cluster.pd_endpoints(),
        TiKVOptions::default()
            .keyspace("alpah")
            .connect_timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("no keyspace \"alpah\""), "{text}");
    assert!(text.contains("pd-ctl keyspace create alpah"), "{text}");
    // Names PD would refuse, refused before any connection.
    for bad in ["", "has space", "dot.ted", &"k".repeat(65)] {
        let err = TiKV::connect_with(vec!["127.0.0.1:1"], TiKVOptions::default().keyspace(bad))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{bad:?}: {err:?}"
        );
        assert!(err.to_string().contains("not a keyspace name"), "{err}");
    }
    // The longest valid name is taken.
    let long = "k".repeat(64);
    cluster.create_keyspace(&long);
    on(&cluster, &long).await;
}
