//! Unknown commit outcomes resolved through commit markers: applied → the closure's value with
//! no second run; not applied → exactly one replay; undecidable → `CommitOutcomeUnknown` naming
//! the marker. Through `FaultyEngine` on every backend, and on TiKV through the test server's
//! lost-reply, never-delivered and killed-server faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tito::backend::memory::{Memory, MemoryClock, MemoryOptions};
use tito::engine::{
    Fault, FaultPoint, FaultRule, FaultyEngine, resolve_commit, sweep_commit_markers,
    version_from_millis, version_millis,
};
use tito::keys;
use tito::{RetryPolicy, TitoEngine, TitoError, TitoTransaction};
use tito_tikv_test_server::{Fault as ServerFault, FaultRule as ServerRule};

use crate::support::{Ctx, read, test_server_ctx};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! unknown_outcomes_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            unknown_outcomes,
            [
                an_applied_commit_returns_the_closures_value_without_a_second_run,
                a_commit_that_did_not_apply_is_replayed_exactly_once,
                an_undecidable_outcome_is_returned_and_can_be_decided_later,
                bad_bounds_and_keys_are_refused_before_anything_runs,
                a_transaction_older_than_half_the_retention_is_never_fenced,
                the_default_policy_still_returns_unknown_outcomes,
                a_store_wide_policy_resolves_every_transaction,
            ]
        );
    };
}

mod embedded {
    crate::unknown_outcomes_suite!(crate::support::EmbeddedBackend);
}

mod tikv {
    crate::unknown_outcomes_suite!(crate::support::TikvBackend);
}

mod memory {
    crate::unknown_outcomes_suite!(crate::support::MemoryBackend);
}

fn resolving() -> RetryPolicy {
    RetryPolicy::default()
        .initial_backoff(Duration::from_millis(1))
        .resolve_unknown_outcomes_within(Duration::from_secs(20))
}

/// Adds one to the counter under `key` (a read-modify-write: a second application shows) and
/// returns the new count; counts the closure's runs in `runs`.
async fn increment<E: TitoEngine>(
    db: &E,
    policy: RetryPolicy,
    key: Vec<u8>,
    runs: &Arc<AtomicU32>,
) -> Result<u32, TitoError> {
    let runs = Arc::clone(runs);
    db.transaction_with(policy, |tx| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        let current = match tx.get(&key).await? {
            Some(bytes) => String::from_utf8(bytes).unwrap().parse::<u32>().unwrap(),
            None => 0,
        };
        tx.put(key, (current + 1).to_string().into_bytes()).await?;
        Ok(current + 1)
    })
    .await
}

async fn counter<E: TitoEngine>(db: &E, key: &[u8]) -> u32 {
    read(db, key)
        .await
        .map(|bytes| String::from_utf8(bytes).unwrap().parse().unwrap())
        .unwrap_or(0)
}

/// Every commit marker in the store, with its value.
async fn markers<E: TitoEngine>(db: &E) -> Vec<(String, Vec<u8>)> {
    let tx = db.begin().await.unwrap();
    let start = b"commit-marker:".to_vec();
    let end = keys::prefix_end_bytes(&start);
    let rows = tx.scan(&start, &end, 1000).await.unwrap();
    tx.rollback().await.unwrap();
    rows.into_iter()
        .map(|(k, v)| (String::from_utf8(k).unwrap(), v))
        .collect()
}

/// The commit marker an unknown-outcome error names.
fn marker_in(err: &TitoError) -> Vec<u8> {
    let text = err.to_string();
    let at = text
        .find("commit-marker:")
        .expect("the error names its marker");
    text[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .as_bytes()
        .to_vec()
}

pub async fn an_applied_commit_returns_the_closures_value_without_a_second_run<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let db = FaultyEngine::new(ctx.db.clone());
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeCommitted,
    ));
    let runs = Arc::new(AtomicU32::new(0));
    let value = increment(&db, resolving(), ctx.key("n"), &runs)
        .await
        .expect("an applied commit resolves as a success");
    assert_eq!(
        value, 1,
        "the closure's value from the attempt that committed"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "no second run");
    assert_eq!(db.faults().injected(), 1);
    assert_eq!(counter(&db, &ctx.key("n")).await, 1);
    let markers = markers(&db).await;
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert_eq!(markers[0].1, b"committed");
}

pub async fn a_commit_that_did_not_apply_is_replayed_exactly_once<E: TitoEngine>(ctx: Ctx<E>) {
    let db = FaultyEngine::new(ctx.db.clone());
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeNotCommitted,
    ));
    let runs = Arc::new(AtomicU32::new(0));
    let value = increment(&db, resolving(), ctx.key("n"), &runs)
        .await
        .expect("a commit proven not applied is replayed");
    assert_eq!(value, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "exactly one replay");
    assert_eq!(counter(&db, &ctx.key("n")).await, 1, "applied once");
    // The lost attempt's marker is fenced; the replay's is committed.
    let mut values: Vec<Vec<u8>> = markers(&db).await.into_iter().map(|(_, v)| v).collect();
    values.sort();
    assert_eq!(values, vec![b"committed".to_vec(), b"fenced".to_vec()]);

    // Replays count against the attempts: with one attempt, a proven loss is "exhausted"
    // (nothing was written), never a guess.
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeNotCommitted,
    ));
    let runs = Arc::new(AtomicU32::new(0));
    let err = increment(&db, resolving().max_attempts(1), ctx.key("m"), &runs)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::RetriesExhausted { attempts: 1, .. }),
        "got {err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(counter(&db, &ctx.key("m")).await, 0);
}

pub async fn an_undecidable_outcome_is_returned_and_can_be_decided_later<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    for (fault, applied) in [
        (Fault::UnknownOutcomeCommitted, true),
        (Fault::UnknownOutcomeNotCommitted, false),
    ] {
        let db = FaultyEngine::new(ctx.db.clone());
        db.faults().add(FaultRule::new(FaultPoint::Commit, fault));
        // The store cannot be read while the bound runs: no round can decide.
        db.faults().add(
            FaultRule::new(FaultPoint::Get, Fault::Storage)
                .when_key_starts_with("commit-marker:")
                .always(),
        );
        let key = ctx.key(if applied { "applied" } else { "lost" });
        let runs = Arc::new(AtomicU32::new(0));
        let policy = resolving().resolve_unknown_outcomes_within(Duration::from_millis(200));
        let started = Instant::now();
        let err = increment(&db, policy, key.clone(), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::CommitOutcomeUnknown { .. }),
            "got {err:?}"
        );
        assert!(!err.is_retryable());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the bound ends the resolution"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "never replayed");
        assert!(db.faults().calls(FaultPoint::Get) >= 2, "rounds were tried");

        // Once the store answers, the marker named in the error decides for good.
        db.faults().clear();
        let marker = marker_in(&err);
        let decided = resolve_commit(&db, &marker, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(decided, applied, "{err}");
        assert_eq!(counter(&db, &key).await, u32::from(applied));
        // Deciding is stable: a fenced marker stays fenced, a committed one committed.
        assert_eq!(
            resolve_commit(&db, &marker, Duration::from_secs(5))
                .await
                .unwrap(),
            applied
        );
    }
}

pub async fn bad_bounds_and_keys_are_refused_before_anything_runs<E: TitoEngine>(ctx: Ctx<E>) {
    let runs = Arc::new(AtomicU32::new(0));
    for bound in [
        Duration::ZERO,
        Duration::from_micros(999),
        tito::engine::MAX_RESOLUTION_BOUND + Duration::from_millis(1),
        Duration::MAX,
    ] {
        let policy = RetryPolicy::default().resolve_unknown_outcomes_within(bound);
        let err = increment(&ctx.db, policy, ctx.key("n"), &runs)
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{bound:?}: {err:?}"
        );
        assert!(err.to_string().contains("bound"), "{err}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");
    assert_eq!(read(&ctx.db, &ctx.key("n")).await, None);
    assert!(markers(&ctx.db).await.is_empty(), "nothing was written");
    // The edges themselves are accepted.
    for bound in [Duration::from_millis(1), tito::engine::MAX_RESOLUTION_BOUND] {
        let policy = RetryPolicy::default().resolve_unknown_outcomes_within(bound);
        increment(&ctx.db, policy, ctx.key("n"), &runs)
            .await
            .unwrap();
    }

    for key in [
        &b""[..],
        b"table:user:1",
        b"commit-marker:",
        b"commit-marker:03:00000000000000000001:0000000000000004",
        b"\xff\xfe",
    ] {
        let err = resolve_commit(&ctx.db, key, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{key:?}: {err:?}"
        );
    }
    let marker = keys::commit_marker_key(1 << 40, 3);
    let err = resolve_commit(&ctx.db, marker.as_bytes(), Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let fenced = markers(&ctx.db)
        .await
        .into_iter()
        .filter(|(_, value)| value.as_slice() != b"committed")
        .count();
    assert_eq!(fenced, 0, "no refused key was fenced");
}

pub async fn a_transaction_older_than_half_the_retention_is_never_fenced<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // A marker that may have been swept must not be mistaken for an absent one.
    let now = version_millis(ctx.db.current_version().await.unwrap());
    let old = version_from_millis(now - 2 * 3600 * 1000);
    let marker = keys::commit_marker_key(old, 5);
    let err = resolve_commit(&ctx.db, marker.as_bytes(), Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("retention"), "{err}");
    assert!(markers(&ctx.db).await.is_empty(), "no fence was written");

    // A recent absent marker is fenced, and a marker with a foreign value is reported.
    let recent = keys::commit_marker_key(version_from_millis(now), 6);
    assert!(
        !resolve_commit(&ctx.db, recent.as_bytes(), Duration::from_secs(5))
            .await
            .unwrap()
    );
    let odd = keys::commit_marker_key(version_from_millis(now), 7);
    let key = odd.clone().into_bytes();
    ctx.db
        .transaction(|tx| async move { tx.put(key, b"maybe".to_vec()).await })
        .await
        .unwrap();
    let err = resolve_commit(&ctx.db, odd.as_bytes(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("maybe"), "{err}");
}

pub async fn the_default_policy_still_returns_unknown_outcomes<E: TitoEngine>(ctx: Ctx<E>) {
    let db = FaultyEngine::new(ctx.db.clone());
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeNotCommitted,
    ));
    let runs = Arc::new(AtomicU32::new(0));
    let err = increment(&db, RetryPolicy::default(), ctx.key("n"), &runs)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "{err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(
        markers(&db).await.is_empty(),
        "no marker without the option"
    );
}

pub async fn a_store_wide_policy_resolves_every_transaction<E: TitoEngine>(ctx: Ctx<E>) {
    /// The same store with a store-wide policy, as `EmbeddedOptions::retry_policy`,
    /// `TiKV::with_retry_policy` and `MemoryOptions::retry_policy` give it.
    #[derive(Clone)]
    struct WithPolicy<E>(E, RetryPolicy);
    impl<E: TitoEngine> TitoEngine for WithPolicy<E> {
        type Transaction = E::Transaction;
        async fn begin(&self) -> tito::TitoResult<E::Transaction> {
            self.0.begin().await
        }
        async fn current_version(&self) -> tito::TitoResult<u64> {
            self.0.current_version().await
        }
        async fn garbage_collect(&self, retention: Duration) -> tito::TitoResult<u64> {
            self.0.garbage_collect(retention).await
        }
        async fn delete_range(&self, start: &[u8], end: &[u8]) -> tito::TitoResult<()> {
            self.0.delete_range(start, end).await
        }
        fn retry_policy(&self) -> RetryPolicy {
            self.1.clone()
        }
        fn extensions(&self) -> &tito::engine::Extensions {
            self.0.extensions()
        }
    }
    let db = FaultyEngine::new(WithPolicy(ctx.db.clone(), resolving()));
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeNotCommitted,
    ));
    let runs = Arc::new(AtomicU32::new(0));
    let counter_runs = Arc::clone(&runs);
    let key = ctx.key("n");
    let value = db
        .transaction(|tx| async move {
            counter_runs.fetch_add(1, Ordering::SeqCst);
            tx.put(key, b"1".to_vec()).await?;
            Ok::<_, TitoError>("done")
        })
        .await
        .unwrap();
    assert_eq!(value, "done");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn markers_expire_after_the_retention_window() {
    let db = Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime {
        epoch_ms: 1_700_000_000_000,
    }))
    .unwrap();
    for n in 0..40u32 {
        let key = format!("k{n}").into_bytes();
        db.transaction_with(
            resolving(),
            |tx| async move { tx.put(key, b"v".to_vec()).await },
        )
        .await
        .unwrap();
    }
    assert_eq!(markers(&db).await.len(), 40);
    // Spread over several buckets, as the layout promises.
    let buckets: std::collections::HashSet<String> = markers(&db)
        .await
        .into_iter()
        .map(|(key, _)| keys::parse_commit_marker_key(&key).unwrap().0.to_string())
        .collect();
    assert!(buckets.len() >= 8, "{buckets:?}");

    // Not yet expired.
    tokio::time::advance(Duration::from_secs(3500)).await;
    assert_eq!(sweep_commit_markers(&db, 1000).await.unwrap(), 0);
    let key = b"late".to_vec();
    db.transaction_with(
        resolving(),
        |tx| async move { tx.put(key, b"v".to_vec()).await },
    )
    .await
    .unwrap();

    // Past the window: bounded batches delete the old ones, the recent one stays.
    tokio::time::advance(Duration::from_secs(200)).await;
    assert_eq!(sweep_commit_markers(&db, 25).await.unwrap(), 25);
    assert_eq!(sweep_commit_markers(&db, 25).await.unwrap(), 15);
    assert_eq!(sweep_commit_markers(&db, 25).await.unwrap(), 0);
    let left = markers(&db).await;
    assert_eq!(left.len(), 1, "{left:?}");
    // A zero batch still makes progress (clamped to one).
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert_eq!(sweep_commit_markers(&db, 0).await.unwrap(), 1);
}

// ---------------------------------------------------------------------------------------------
// TiKV through the test server: the faults a real cluster has.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_lost_commit_reply_resolves_as_committed() {
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    // The primary (the first key written) commits on the server; every reply to it is lost.
    cluster.add_fault(
        ServerRule::new("KvCommit", ServerFault::LoseResponse)
            .when_key_starts_with(ctx.key("a"))
            .always(),
    );
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let (a, z) = (ctx.key("a"), ctx.key("z"));
    let value = ctx
        .db
        .transaction_with(resolving(), |tx| async move {
            counted.fetch_add(1, Ordering::SeqCst);
            tx.put(a, b"p".to_vec()).await?;
            tx.put(z, b"s".to_vec()).await?;
            Ok::<_, TitoError>(7)
        })
        .await
        .expect("resolved as committed");
    cluster.clear_faults();
    assert_eq!(value, 7);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        read(&ctx.db, &ctx.key("z")).await.as_deref(),
        Some(&b"s"[..])
    );
    assert_eq!(
        read(&ctx.db, &ctx.key("a")).await.as_deref(),
        Some(&b"p"[..])
    );
    let markers = markers(&ctx.db).await;
    assert_eq!(markers.len(), 1);
    assert_eq!(markers[0].1, b"committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_commit_that_never_arrived_is_replayed_exactly_once() {
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    // The primary's commit never reaches the server: the attempt stays prewritten until its
    // lock TTL runs out and the resolution's read rolls it back.
    cluster.add_fault(
        ServerRule::new("KvCommit", ServerFault::Unavailable)
            .when_key_starts_with(ctx.key("a"))
            .always(),
    );
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let server = cluster.clone();
    let (a, z) = (ctx.key("a"), ctx.key("z"));
    let started = Instant::now();
    let value = ctx
        .db
        .transaction_with(resolving(), |tx| async move {
            if counted.fetch_add(1, Ordering::SeqCst) == 1 {
                // The replay's commit is delivered.
                server.clear_faults();
            }
            let n = tx.get(&a).await?.map_or(0, |v| v.len());
            tx.put(a, vec![b'x'; n + 1]).await?;
            tx.put(z, b"s".to_vec()).await?;
            Ok::<_, TitoError>(n + 1)
        })
        .await
        .expect("a commit proven lost is replayed");
    let took = started.elapsed();
    assert_eq!(value, 1, "applied once");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "exactly one replay");
    assert_eq!(
        read(&ctx.db, &ctx.key("a")).await.as_deref(),
        Some(&b"x"[..])
    );
    let mut values: Vec<Vec<u8>> = markers(&ctx.db).await.into_iter().map(|(_, v)| v).collect();
    values.sort();
    assert_eq!(values, vec![b"committed".to_vec(), b"fenced".to_vec()]);
    assert_eq!(cluster.lock_count(), 0);
    println!("a lost commit resolved and replayed in {took:?} (lock TTL 3 s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_killed_server_leaves_the_outcome_unknown_within_the_bound() {
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    // Both servers die while the commit is under way (its prewrite is in flight).
    cluster.add_fault(
        ServerRule::new("KvPrewrite", ServerFault::Delay(Duration::from_millis(400)))
            .when_key_starts_with(ctx.key("a"))
            .always(),
    );
    let killer = cluster.clone();
    let kill = tokio::spawn(async move {
        while killer.calls("KvPrewrite") == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        killer.kill();
    });
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let (a, z) = (ctx.key("a"), ctx.key("z"));
    let bound = Duration::from_secs(2);
    let started = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(90),
        ctx.db.transaction_with(
            resolving().resolve_unknown_outcomes_within(bound),
            |tx| async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tx.put(a, b"p".to_vec()).await?;
                tx.put(z, b"s".to_vec()).await?;
                Ok::<_, TitoError>(())
            },
        ),
    )
    .await
    .expect("the commit and its resolution give up");
    kill.await.unwrap();
    let err = outcome.unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "got {err:?}"
    );
    assert!(err.to_string().contains("commit-marker:"), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never replayed");
    println!(
        "undecidable after {:?} (bound {bound:?})",
        started.elapsed()
    );
}

/// tikv-client 0.4.0 drops the error of a failed region lookup while it splits a prewrite or a
/// commit into per-region requests (`stream::iter(Err(e))` in `Shardable for PrewriteRequest`
/// and `CommitRequest` yields nothing), so a primary commit that failed in transport and was
/// retried while PD was unreachable is reported as committed by the client although it never
/// reached TiKV. Tito reads the primary back at the commit's version before it reports a
/// commit (see the `backend::tikv` module docs): this one is an unknown outcome, never a
/// success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_commit_cut_off_with_the_cluster_is_never_reported_as_applied() {
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    cluster.add_fault(
        ServerRule::new("KvCommit", ServerFault::Delay(Duration::from_millis(400)))
            .when_key_starts_with(ctx.key("a"))
            .always(),
    );
    let killer = cluster.clone();
    let kill = tokio::spawn(async move {
        while killer.calls("KvCommit") == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        killer.kill();
    });
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("a"), b"p".to_vec()).await.unwrap();
    tx.put(ctx.key("z"), b"s".to_vec()).await.unwrap();
    let result = tx.commit().await;
    kill.await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    match result {
        // Applied for real: nothing is left locked.
        Ok(()) => assert_eq!(
            cluster.lock_count(),
            0,
            "the commit was reported as applied, but its keys are still only prewritten"
        ),
        // Not known, or known to be in part (the client goes on to commit the secondary after
        // its false report): the caller is told so, and nothing replays it as a conflict.
        Err(err) => assert!(
            matches!(
                err,
                TitoError::CommitOutcomeUnknown { .. } | TitoError::PartialCommit { .. }
            ),
            "{err:?}"
        ),
    }
}

/// tikv-client 0.4.0's second defect: a secondary whose prewrite fails in transport while PD
/// cannot be reached is dropped from the prewrite (its region is looked up again, the lookup
/// fails, and the failure is swallowed), and the primary then commits without it. The client
/// alone reports success with `z` never written; Tito reads every key back and reports the
/// commit as applied in part, whether PD is back by then (`z` proven missing) or not (`z`
/// unchecked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_secondary_left_out_of_the_prewrite_is_never_reported_as_applied() {
    for pd_back_after in [Some(Duration::from_millis(300)), None] {
        let ctx = test_server_ctx().await;
        let cluster = ctx.cluster.clone().unwrap();
        // The regions of both keys in the client's cache, as in a running service.
        assert_eq!(read(&ctx.db, &ctx.key("a")).await, None);
        assert_eq!(read(&ctx.db, &ctx.key("z")).await, None);
        cluster.add_fault(ServerRule::new("GetRegion", ServerFault::Unavailable).always());
        cluster.add_fault(
            ServerRule::new("KvPrewrite", ServerFault::Unavailable)
                .when_key_starts_with(ctx.key("z")),
        );
        let healer = cluster.clone();
        let heal = tokio::spawn(async move {
            if let Some(after) = pd_back_after {
                while healer.calls("KvCommit") == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(after).await;
                healer.clear_faults();
            }
        });
        let tx = ctx.db.begin().await.unwrap();
        tx.put(ctx.key("a"), b"p".to_vec()).await.unwrap();
        tx.put(ctx.key("z"), b"s".to_vec()).await.unwrap();
        let result = tx.commit().await;
        heal.await.unwrap();
        cluster.clear_faults();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (a, z) = (
            read(&ctx.db, &ctx.key("a")).await,
            read(&ctx.db, &ctx.key("z")).await,
        );
        // The fault leaves `z` out every time with this client (the client alone says `Ok`).
        match result {
            Err(TitoError::PartialCommit { message, keys }) => {
                assert_eq!(a.as_deref(), Some(&b"p"[..]), "{message}");
                assert_eq!(z, None, "{message}");
                assert_eq!(keys, vec![ctx.key("z")], "{message}");
                let proven = pd_back_after.is_some();
                assert_eq!(
                    message.contains("do not hold the write"),
                    proven,
                    "{message}"
                );
                assert_eq!(
                    message.contains("could not be read back"),
                    !proven,
                    "{message}"
                );
            }
            other => panic!("{other:?} (a: {a:?}, z: {z:?}, PD back after {pd_back_after:?})"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_refuse_a_bad_resolution_bound_when_opened() {
    use tito::backend::embedded::{Embedded, EmbeddedOptions};
    let bad = RetryPolicy::default().resolve_unknown_outcomes_within(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let err = Embedded::open_with(dir.path(), EmbeddedOptions::new().retry_policy(bad.clone()))
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let err = Memory::with_options(MemoryOptions::new().retry_policy(bad)).unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    // A good one is taken, and is the handle's policy.
    let good = RetryPolicy::default().resolve_unknown_outcomes();
    let db = Memory::with_options(MemoryOptions::new().retry_policy(good.clone())).unwrap();
    assert_eq!(db.retry_policy(), good);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_marker_rides_in_the_same_requests() {
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    let calls = || (cluster.calls("KvPrewrite"), cluster.calls("KvCommit"));
    let mut cost = Vec::new();
    for policy in [RetryPolicy::default(), resolving()] {
        let before = calls();
        for n in 0..10 {
            let key = ctx.key(&format!("a{n}"));
            ctx.db
                .transaction_with(policy.clone(), |tx| async move {
                    tx.put(key, b"v".to_vec()).await
                })
                .await
                .unwrap();
        }
        // Secondary commits run in the background after the primary's: let them land.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = calls();
        cost.push((after.0 - before.0, after.1 - before.1));
    }
    println!(
        "10 one-key transactions: (prewrites, commits) without marker {:?}, with {:?}",
        cost[0], cost[1]
    );
    // The marker sorts into the same region as the key here: the same prewrite request, and
    // one more commit request (its secondary, committed after the reply).
    assert_eq!(cost[1].0, cost[0].0);
    assert_eq!(cost[1].1, cost[0].1 + 10);
}

// ---------------------------------------------------------------------------------------------
// How each error at or after the primary's commit is classified (the table in `backend::tikv`).
// ---------------------------------------------------------------------------------------------

/// One plain commit of two keys (`a`, the primary, and `z`, a secondary in another region)
/// with `rule` armed; the commit's result.
async fn commit_two_keys(ctx: &Ctx<tito::TiKV>, rule: ServerRule) -> Result<(), TitoError> {
    ctx.cluster.as_ref().unwrap().add_fault(rule);
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("a"), b"p".to_vec()).await.unwrap();
    tx.put(ctx.key("z"), b"s".to_vec()).await.unwrap();
    tx.commit().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_outcomes_at_the_primary_commit_are_classified() {
    use tito_tikv_test_server::RegionFault;
    // NotLeader / EpochNotMatch once: the client reloads the region and commits: applied.
    for fault in [RegionFault::NotLeader, RegionFault::EpochNotMatch] {
        let ctx = test_server_ctx().await;
        let rule = ServerRule::new("KvCommit", ServerFault::Region(fault))
            .when_key_starts_with(ctx.key("a"));
        commit_two_keys(&ctx, rule).await.unwrap();
        assert_eq!(
            read(&ctx.db, &ctx.key("a")).await.as_deref(),
            Some(&b"p"[..]),
            "{fault:?}"
        );
        assert_eq!(
            read(&ctx.db, &ctx.key("z")).await.as_deref(),
            Some(&b"s"[..]),
            "{fault:?}"
        );
    }
    // A region error on every try (ServerIsBusy): the commit was never applied, but Tito cannot
    // tell that from the client's error alone: unknown, never a conflict to replay blindly.
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    let rule = ServerRule::new("KvCommit", ServerFault::Region(RegionFault::ServerIsBusy))
        .when_key_starts_with(ctx.key("a"))
        .always();
    let err = commit_two_keys(&ctx, rule).await.unwrap_err();
    assert!(
        matches!(err, TitoError::CommitOutcomeUnknown { .. }),
        "{err:?}"
    );
    cluster.clear_faults();
    // Not applied: once its locks are rolled back (TTL), the keys are as they were.
    assert_eq!(read(&ctx.db, &ctx.key("a")).await, None);
    assert_eq!(read(&ctx.db, &ctx.key("z")).await, None);
    // Under a resolving policy the same fault is decided (fenced: not committed) and the
    // closure replayed once, after which it applies.
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let server = cluster.clone();
    cluster.add_fault(
        ServerRule::new("KvCommit", ServerFault::Region(RegionFault::ServerIsBusy))
            .when_key_starts_with(ctx.key("b"))
            .always(),
    );
    let (b, y) = (ctx.key("b"), ctx.key("y"));
    ctx.db
        .transaction_with(resolving(), |tx| async move {
            if counted.fetch_add(1, Ordering::SeqCst) == 1 {
                server.clear_faults();
            }
            tx.put(b, b"p".to_vec()).await?;
            tx.put(y, b"s".to_vec()).await
        })
        .await
        .unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "replayed once, once decided"
    );
    assert_eq!(
        read(&ctx.db, &ctx.key("y")).await.as_deref(),
        Some(&b"s"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_failures_after_the_primary_commit_leave_it_applied() {
    use tito_tikv_test_server::RegionFault;
    // A secondary's commit fails (a region error on every try, or the store unreachable): the
    // primary committed, so the transaction did; readers roll the secondary forward.
    for fault in [
        ServerFault::Region(RegionFault::ServerIsBusy),
        ServerFault::Unavailable,
    ] {
        let ctx = test_server_ctx().await;
        let cluster = ctx.cluster.clone().unwrap();
        let rule = ServerRule::new("KvCommit", fault.clone())
            .when_key_starts_with(ctx.key("z"))
            .always();
        commit_two_keys(&ctx, rule).await.unwrap();
        // Let the client's background commit of the secondary fail, then read it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.clear_faults();
        assert_eq!(
            read(&ctx.db, &ctx.key("z")).await.as_deref(),
            Some(&b"s"[..]),
            "{fault:?}"
        );
        assert_eq!(
            read(&ctx.db, &ctx.key("a")).await.as_deref(),
            Some(&b"p"[..]),
            "{fault:?}"
        );
        assert_eq!(cluster.lock_count(), 0, "{fault:?}");
    }
}

/// The TiKV suite's fault mix: transactions of three keys in three regions (`a` the primary,
/// `c` and `z` secondaries), each under one fault drawn from a seeded menu that includes both
/// client defects (a transport failure at the primary's commit or at a secondary's prewrite
/// while PD cannot be reached, PD back after a while or not at all), lost replies, region
/// errors and failed secondary commits. Whatever happens, what Tito reports matches what is
/// stored: `Ok` is whole, a conflict or a rejected commit left nothing, an unknown outcome is
/// all or nothing, and a partial commit names exactly the keys that do not hold the write.
/// `TITO_TIKV_FAULT_ROUNDS` (default 16) and `TITO_TIKV_FAULT_SEED` widen the hunt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_commits_under_a_fault_mix_report_what_is_stored() {
    use tito_tikv_test_server::RegionFault;
    let rounds: u64 = std::env::var("TITO_TIKV_FAULT_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(16);
    let seed: u64 = std::env::var("TITO_TIKV_FAULT_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(29);
    let mut state = seed;
    let mut next = move |bound: u64| {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % bound
    };
    let ctx = test_server_ctx().await;
    let cluster = ctx.cluster.clone().unwrap();
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    for round in 0..rounds {
        let keys = [
            ctx.key(&format!("a{round}")),
            ctx.key(&format!("c{round}")),
            ctx.key(&format!("z{round}")),
        ];
        for key in &keys {
            assert_eq!(read(&ctx.db, key).await, None);
        }
        let (primary, secondary) = (keys[0].clone(), keys[1 + next(2) as usize].clone());
        let pd_down = [None, Some(100), Some(300), Some(u64::MAX)][next(4) as usize];
        let (name, rule) = match next(8) {
            0 => ("none", None),
            1 => (
                "primary commit unavailable",
                Some(
                    ServerRule::new("KvCommit", ServerFault::Unavailable)
                        .when_key_starts_with(primary.clone()),
                ),
            ),
            2 => (
                "secondary prewrite unavailable",
                Some(
                    ServerRule::new("KvPrewrite", ServerFault::Unavailable)
                        .when_key_starts_with(secondary.clone()),
                ),
            ),
            3 => (
                "primary commit reply lost",
                Some(
                    ServerRule::new("KvCommit", ServerFault::LoseResponse)
                        .when_key_starts_with(primary.clone()),
                ),
            ),
            4 => (
                "secondary prewrite reply lost",
                Some(
                    ServerRule::new("KvPrewrite", ServerFault::LoseResponse)
                        .when_key_starts_with(secondary.clone()),
                ),
            ),
            5 => (
                "secondary prewrite region error",
                Some(
                    ServerRule::new(
                        "KvPrewrite",
                        ServerFault::Region(RegionFault::EpochNotMatch),
                    )
                    .when_key_starts_with(secondary.clone()),
                ),
            ),
            6 => (
                "secondary commit busy",
                Some(
                    ServerRule::new("KvCommit", ServerFault::Region(RegionFault::ServerIsBusy))
                        .when_key_starts_with(secondary.clone())
                        .always(),
                ),
            ),
            _ => (
                "secondary commit unavailable",
                Some(
                    ServerRule::new("KvCommit", ServerFault::Unavailable)
                        .when_key_starts_with(secondary.clone())
                        .always(),
                ),
            ),
        };
        if let Some(rule) = rule {
            cluster.add_fault(rule);
        }
        if pd_down.is_some() {
            cluster.add_fault(ServerRule::new("GetRegion", ServerFault::Unavailable).always());
        }
        let healer = cluster.clone();
        let heal = tokio::spawn(async move {
            if let Some(ms) = pd_down.filter(|ms| *ms != u64::MAX) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                healer.clear_faults();
            }
        });
        let value = format!("v{round}").into_bytes();
        let tx = ctx.db.begin().await.unwrap();
        for key in &keys {
            tx.put(key.clone(), value.clone()).await.unwrap();
        }
        let result = tx.commit().await;
        heal.await.unwrap();
        cluster.clear_faults();
        // Secondary commits run after the reply, and locks of an unapplied commit are rolled
        // back once their TTL has run out (the reads below wait for that).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut holds = Vec::new();
        for key in &keys {
            holds.push(read(&ctx.db, key).await.as_deref() == Some(&value[..]));
        }
        let what = format!(
            "round {round} (seed {seed}): {name}, PD down {pd_down:?}: {result:?}, keys hold the write: {holds:?}"
        );
        let outcome = match &result {
            Ok(()) => {
                assert!(holds.iter().all(|h| *h), "{what}");
                "ok"
            }
            Err(TitoError::CommitOutcomeUnknown { .. }) => {
                assert!(
                    holds.iter().all(|h| *h) || holds.iter().all(|h| !*h),
                    "{what}"
                );
                "unknown"
            }
            Err(TitoError::PartialCommit {
                keys: named,
                message,
            }) => {
                // Every key that does not hold the write is named; with the primary holding
                // it, a named key that holds it is one that could not be checked.
                for (key, held) in keys.iter().zip(&holds) {
                    if !held {
                        assert!(named.contains(key), "{what}");
                    } else if holds[0] && named.contains(key) {
                        assert!(message.contains("could not be read back"), "{what}");
                    }
                }
                "partial"
            }
            Err(err) if err.is_retryable() || matches!(err, TitoError::Storage { .. }) => {
                assert!(holds.iter().all(|h| !*h), "{what}");
                "not applied"
            }
            Err(_) => panic!("{what}"),
        };
        println!("{what}");
        *seen.entry(format!("{name} -> {outcome}")).or_default() += 1;
    }
    println!("fault mix, {rounds} rounds, seed {seed}: {seen:#?}");
    assert_eq!(cluster.lock_count(), 0, "locks left behind");
}
