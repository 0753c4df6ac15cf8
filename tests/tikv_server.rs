//! The TiKV engine through the real `tikv-client` against the protocol-level test server, for
//! what only a server can show: regions and their errors, commits whose outcome is lost, lock
//! resolution of abandoned transactions, a killed server, GC.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoError, TitoTransaction};
use tito_tikv_test_server::{Fault, FaultRule, RegionFault, TestCluster};

use crate::support::{Ctx, read, test_server_ctx, wait_for};

fn cluster(ctx: &Ctx<TiKV>) -> Arc<TestCluster> {
    ctx.cluster.clone().expect("a test-server context")
}

async fn write_all(db: &TiKV, pairs: &[(Vec<u8>, &'static [u8])]) -> Result<(), TitoError> {
    let tx = db.begin().await?;
    for (key, value) in pairs {
        tx.put(key.clone(), value.to_vec()).await?;
    }
    tx.commit().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_and_commits_cross_region_boundaries() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    assert_eq!(cluster.regions().len(), 5);

    // One transaction over four regions; the scan must stitch them back in order.
    let keys: Vec<Vec<u8>> = ["a", "c", "k10", "s", "z"]
        .iter()
        .map(|k| ctx.key(k))
        .collect();
    let pairs: Vec<(Vec<u8>, &'static [u8])> =
        keys.iter().map(|k| (k.clone(), &b"v"[..])).collect();
    write_all(&ctx.db, &pairs).await.unwrap();
    let prewrites = cluster.calls("KvPrewrite");
    assert!(prewrites >= 4, "one prewrite per region, got {prewrites}");

    let tx = ctx.db.begin().await.unwrap();
    let forward = tx.scan(&ctx.key(""), &ctx.key("~"), 100).await.unwrap();
    let found: Vec<Vec<u8>> = forward.into_iter().map(|(k, _)| k).collect();
    assert_eq!(found, keys);
    let backward = tx
        .scan_reverse(&ctx.key(""), &ctx.key("~"), 3)
        .await
        .unwrap();
    let found: Vec<Vec<u8>> = backward.into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        found,
        vec![keys[4].clone(), keys[3].clone(), keys[2].clone()]
    );
    let got = tx
        .batch_get(&[keys[4].clone(), ctx.key("nothing"), keys[0].clone()])
        .await
        .unwrap();
    assert_eq!(got, vec![Some(b"v".to_vec()), None, Some(b"v".to_vec())]);
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_under_a_cached_region_is_followed() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    write_all(&ctx.db, &[(ctx.key("m1"), b"1"), (ctx.key("m2"), b"2")])
        .await
        .unwrap();

    // The client caches the region of m1/m2; splitting it between them makes the cache stale.
    assert!(cluster.split(ctx.key("m2")));
    write_all(&ctx.db, &[(ctx.key("m1"), b"one"), (ctx.key("m2"), b"two")])
        .await
        .unwrap();
    assert_eq!(
        read(&ctx.db, &ctx.key("m2")).await.as_deref(),
        Some(&b"two"[..])
    );
    assert!(cluster.calls("GetRegion") + cluster.calls("GetRegionByID") >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_errors_are_retried_by_the_client() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    cluster.inject_region_error("KvPrewrite", RegionFault::NotLeader, 2);
    cluster.inject_region_error("KvCommit", RegionFault::EpochNotMatch, 2);
    cluster.inject_region_error("KvGet", RegionFault::EpochNotMatch, 1);
    write_all(&ctx.db, &[(ctx.key("a"), b"1")]).await.unwrap();
    assert_eq!(
        read(&ctx.db, &ctx.key("a")).await.as_deref(),
        Some(&b"1"[..])
    );
    assert!(cluster.calls("KvPrewrite") >= 3);
    assert!(cluster.calls("KvCommit") >= 3);

    // A region error the client does not retry is a storage error, not a conflict.
    cluster.inject_region_error("KvGet", RegionFault::ServerIsBusy, 1);
    let tx = ctx.db.begin().await.unwrap();
    let err = tx.get(&ctx.key("a")).await.unwrap_err();
    assert!(matches!(err, TitoError::Storage { .. }), "got {err:?}");
    assert!(!err.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_conflicts_from_the_server_are_retryable() {
    let ctx = test_server_ctx().await;
    let first = ctx.db.begin().await.unwrap();
    let second = ctx.db.begin().await.unwrap();
    first.put(ctx.key("x"), b"1".to_vec()).await.unwrap();
    second.put(ctx.key("x"), b"2".to_vec()).await.unwrap();
    first.commit().await.unwrap();
    let err = second.commit().await.unwrap_err();
    assert!(matches!(err, TitoError::Conflict { .. }), "got {err:?}");
    // The loser's locks (if any) were rolled back; the winner's value stands.
    assert_eq!(cluster(&ctx).lock_count(), 0);
    assert_eq!(
        read(&ctx.db, &ctx.key("x")).await.as_deref(),
        Some(&b"1"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_primary_commit_reply_is_an_unknown_outcome_that_did_commit() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    // Keys in two regions: the primary commits on the server, every reply to it is lost.
    let (primary, secondary) = (ctx.key("a"), ctx.key("z"));
    cluster.add_fault(
        FaultRule::new("KvCommit", Fault::LoseResponse)
            .when_key_starts_with(primary.clone())
            .always(),
    );
    let err = write_all(
        &ctx.db,
        &[(primary.clone(), b"p"), (secondary.clone(), b"s")],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "got {err:?}"
    );
    assert!(!err.is_retryable());
    cluster.clear_faults();

    // It did commit: a reader finds the secondary still locked, resolves the lock through the
    // primary's status, and sees both values.
    assert!(cluster.lock_count() >= 1);
    assert_eq!(read(&ctx.db, &secondary).await.as_deref(), Some(&b"s"[..]));
    assert_eq!(read(&ctx.db, &primary).await.as_deref(), Some(&b"p"[..]));
    assert_eq!(cluster.lock_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undelivered_primary_commit_is_an_unknown_outcome_rolled_back_after_its_ttl() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    let (primary, secondary) = (ctx.key("a"), ctx.key("z"));
    cluster.add_fault(
        FaultRule::new("KvCommit", Fault::Unavailable)
            .when_key_starts_with(primary.clone())
            .always(),
    );
    let err = write_all(
        &ctx.db,
        &[(primary.clone(), b"p"), (secondary.clone(), b"s")],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "got {err:?}"
    );
    cluster.clear_faults();
    assert_eq!(cluster.lock_count(), 2);

    // Abandoned locks block readers until their TTL (3 s in tikv-client) runs out; then the
    // reader rolls the transaction back and sees nothing.
    let db = ctx.db.clone();
    let key = secondary.clone();
    wait_for(
        "the abandoned transaction to be rolled back",
        Duration::from_secs(30),
        || {
            let db = db.clone();
            let key = key.clone();
            async move {
                let tx = db.begin().await.unwrap();
                let result = tx.get(&key).await;
                let _ = tx.rollback().await;
                matches!(result, Ok(None))
            }
        },
    )
    .await;
    assert_eq!(read(&ctx.db, &primary).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_resolves_abandoned_locks_and_keeps_the_safe_point_moving_forward() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    for value in [&b"1"[..], b"2", b"3"] {
        write_all(&ctx.db, &[(ctx.key("k"), value)]).await.unwrap();
    }
    // An abandoned transaction: prewritten, never committed.
    cluster.add_fault(FaultRule::new("KvCommit", Fault::Unavailable).always());
    write_all(&ctx.db, &[(ctx.key("abandoned"), b"x")])
        .await
        .unwrap_err();
    cluster.clear_faults();
    assert_eq!(cluster.lock_count(), 1);
    let versions = cluster.version_count();

    tokio::time::sleep(Duration::from_millis(20)).await;
    let safe_point = ctx
        .db
        .garbage_collect(Duration::from_millis(1))
        .await
        .unwrap();
    assert_eq!(cluster.gc_safe_point(), safe_point);
    assert_eq!(
        cluster.lock_count(),
        0,
        "GC resolves locks older than the safe point"
    );
    assert!(
        cluster.version_count() < versions,
        "old versions were collected"
    );
    assert_eq!(
        read(&ctx.db, &ctx.key("k")).await.as_deref(),
        Some(&b"3"[..])
    );
    assert_eq!(read(&ctx.db, &ctx.key("abandoned")).await, None);

    // An older safe point does not move PD's back.
    ctx.db
        .garbage_collect(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(cluster.gc_safe_point(), safe_point);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delays_are_waited_out() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    write_all(&ctx.db, &[(ctx.key("slow"), b"v")])
        .await
        .unwrap();
    cluster.add_fault(FaultRule::new(
        "KvGet",
        Fault::Delay(Duration::from_millis(300)),
    ));
    let started = Instant::now();
    assert_eq!(
        read(&ctx.db, &ctx.key("slow")).await.as_deref(),
        Some(&b"v"[..])
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// A latency set on the cluster delays every request, timestamps included: a read-write
/// transaction (a timestamp, a read, a prewrite, a timestamp, a commit) takes at least five of
/// them (at least three without the timestamps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_delays_every_request() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    let round = |n: u32| {
        let db = ctx.db.clone();
        let key = ctx.key(&format!("lat-{n}"));
        async move {
            let started = Instant::now();
            let tx = db.begin().await.unwrap();
            assert!(tx.get(&key).await.unwrap().is_none());
            tx.put(key, b"v".to_vec()).await.unwrap();
            tx.commit().await.unwrap();
            started.elapsed()
        }
    };
    // Warmed up (regions cached, connections open) before measuring.
    round(0).await;
    cluster.set_latency(Duration::from_millis(40));
    let slow = round(1).await;
    assert!(slow >= Duration::from_millis(5 * 40), "{slow:?}");
    cluster.set_latency(Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_fails_the_transaction_instead_of_hanging() {
    let ctx = test_server_ctx().await;
    let cluster = cluster(&ctx);
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("a"), b"1".to_vec()).await.unwrap();
    tx.put(ctx.key("z"), b"2".to_vec()).await.unwrap();
    cluster.kill();
    // The bound is generous: the client backs off and retries before it gives up.
    let outcome = tokio::time::timeout(Duration::from_secs(60), tx.commit()).await;
    let err = outcome.expect("the commit gave up").unwrap_err();
    // Unknown when the commit was sent; a plain failure when the check of the moved marker
    // that precedes it (once a second) could not reach the cluster, and nothing was sent.
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. })
            || matches!(&err, TitoError::Storage { message, .. } if message.contains("timestamp") || message.contains("moved marker")),
        "got {err:?}"
    );
    // Nothing was applied.
    assert_eq!(cluster.lock_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_it_does_not_serve_fail_fast() {
    let cluster = TestCluster::start().await.unwrap();
    let raw = tikv_client::RawClient::new(cluster.pd_endpoints())
        .await
        .unwrap();
    let started = Instant::now();
    let err = raw.get(b"k".to_vec()).await.unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("unimplemented")
            || format!("{err:?}").contains("Unimplemented"),
        "got {err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// How long a transaction of many keys takes to commit on the test server, at 0 and 2 ms per
/// request, beside the commit deadline (`MOVED_COMMIT_DEADLINE`): a measurement for the
/// guide's statement of how large a TiKV transaction may be.
/// `cargo test --release --test tito -- --ignored tikv_server::large_transactions_commit_in_time --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; prints figures"]
async fn large_transactions_commit_in_time() {
    for latency_ms in [0u64, 2] {
        for keys in [10_000usize, 40_000, 100_000] {
            let cluster = TestCluster::start().await.unwrap();
            cluster.set_latency(std::time::Duration::from_millis(latency_ms));
            let db = TiKV::connect(cluster.pd_endpoints()).await.unwrap();
            let started = std::time::Instant::now();
            let result = db
                .transaction(|tx| async move {
                    for n in 0..keys {
                        tx.put(format!("large:{n:08}").into_bytes(), vec![7u8; 100])
                            .await?;
                    }
                    Ok::<_, TitoError>(())
                })
                .await;
            println!(
                "{latency_ms} ms per request, {keys} keys of 100 bytes: {} in {:.1} s (deadline {} s)",
                match &result {
                    Ok(()) => "committed".to_string(),
                    Err(err) => format!("failed ({err})"),
                },
                started.elapsed().as_secs_f64(),
                tito::engine::MOVED_COMMIT_DEADLINE.as_secs()
            );
        }
    }
}
