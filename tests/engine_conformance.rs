//! The storage contract, checked the same way on every backend.
//!
//! Each case is a generic function over the engine; `conformance_suite!(Backend)` runs them all
//! on one backend (see `engine_embedded.rs` and `engine_tikv.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tito::engine::{MAX_SCAN_LIMIT, version_millis};
use tito::{RetryPolicy, TitoEngine, TitoError, TitoTransaction};

use crate::support::{Ctx, read};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            engine_conformance,
            [
                snapshot_reads_ignore_later_commits,
                reads_see_own_writes,
                one_of_two_writers_commits,
                concurrent_increments_converge,
                locked_keys_conflict_with_writers,
                reads_are_not_validated,
                scans_respect_bounds_limits_and_direction,
                scan_arguments_are_checked,
                batch_get_keeps_request_order,
                versions_are_ordered_and_tell_time,
                delete_range_removes_exactly_the_range,
                delete_range_checks_its_bounds,
                garbage_collection_checks_its_argument,
                finished_transactions_refuse_work,
                dropped_transactions_leave_nothing,
            ]
        );
    };
}

async fn put_committed<E: TitoEngine>(db: &E, key: Vec<u8>, value: &[u8]) {
    let value = value.to_vec();
    db.transaction(|tx| async move { tx.put(key, value).await })
        .await
        .expect("commit");
}

pub async fn snapshot_reads_ignore_later_commits<E: TitoEngine>(ctx: Ctx<E>) {
    let (db, k) = (&ctx.db, ctx.key("k"));
    put_committed(db, k.clone(), b"old").await;

    let reader = db.begin().await.unwrap();
    assert_eq!(reader.get(&k).await.unwrap().as_deref(), Some(&b"old"[..]));
    put_committed(db, k.clone(), b"new").await;
    put_committed(db, ctx.key("k2"), b"fresh").await;

    // The reader keeps its snapshot, for point reads and scans.
    assert_eq!(reader.get(&k).await.unwrap().as_deref(), Some(&b"old"[..]));
    assert_eq!(reader.get(&ctx.key("k2")).await.unwrap(), None);
    let scanned = reader.scan(&ctx.key(""), &ctx.key("~"), 10).await.unwrap();
    assert_eq!(scanned, vec![(k.clone(), b"old".to_vec())]);
    reader.rollback().await.unwrap();

    // A transaction that starts later sees the new state.
    assert_eq!(read(db, &k).await.as_deref(), Some(&b"new"[..]));
}

pub async fn reads_see_own_writes<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    put_committed(db, ctx.key("a"), b"1").await;
    put_committed(db, ctx.key("c"), b"3").await;

    let tx = db.begin().await.unwrap();
    tx.put(ctx.key("b"), b"2".to_vec()).await.unwrap();
    tx.put(ctx.key("c"), b"33".to_vec()).await.unwrap();
    tx.delete(ctx.key("a")).await.unwrap();
    assert_eq!(
        tx.get(&ctx.key("b")).await.unwrap().as_deref(),
        Some(&b"2"[..])
    );
    assert_eq!(tx.get(&ctx.key("a")).await.unwrap(), None);
    let forward = tx.scan(&ctx.key(""), &ctx.key("~"), 10).await.unwrap();
    assert_eq!(
        forward,
        vec![
            (ctx.key("b"), b"2".to_vec()),
            (ctx.key("c"), b"33".to_vec())
        ]
    );
    let backward = tx
        .scan_reverse(&ctx.key(""), &ctx.key("~"), 10)
        .await
        .unwrap();
    assert_eq!(
        backward,
        vec![
            (ctx.key("c"), b"33".to_vec()),
            (ctx.key("b"), b"2".to_vec())
        ]
    );

    // Others do not see it before the commit, and do after.
    assert_eq!(read(db, &ctx.key("b")).await, None);
    tx.commit().await.unwrap();
    assert_eq!(read(db, &ctx.key("b")).await.as_deref(), Some(&b"2"[..]));
    assert_eq!(read(db, &ctx.key("a")).await, None);
}

pub async fn one_of_two_writers_commits<E: TitoEngine>(ctx: Ctx<E>) {
    let (db, k) = (&ctx.db, ctx.key("contended"));
    let first = db.begin().await.unwrap();
    let second = db.begin().await.unwrap();
    first.put(k.clone(), b"first".to_vec()).await.unwrap();
    second.put(k.clone(), b"second".to_vec()).await.unwrap();
    second
        .put(ctx.key("side-effect"), b"x".to_vec())
        .await
        .unwrap();

    first.commit().await.expect("the first committer wins");
    let err = second
        .commit()
        .await
        .expect_err("the second writer must conflict");
    assert!(
        err.is_retryable(),
        "a write-write conflict must be retryable, got {err:?}"
    );
    assert!(matches!(err, TitoError::Conflict { .. }), "got {err:?}");

    assert_eq!(read(db, &k).await.as_deref(), Some(&b"first"[..]));
    assert_eq!(
        read(db, &ctx.key("side-effect")).await,
        None,
        "a conflicting commit writes nothing"
    );
}

pub async fn concurrent_increments_converge<E: TitoEngine>(ctx: Ctx<E>) {
    let db = ctx.db.clone();
    // Eight tasks on one key conflict a lot: allow many attempts.
    let policy = RetryPolicy::default()
        .max_attempts(200)
        .max_backoff(Duration::from_millis(20));
    let k = ctx.key("counter");
    put_committed(&db, k.clone(), b"0").await;
    let runs = Arc::new(AtomicU32::new(0));
    let tasks = 8;
    let per_task = 5;
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (db, k, runs, policy) = (db.clone(), k.clone(), Arc::clone(&runs), policy.clone());
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let (k, runs) = (k.clone(), Arc::clone(&runs));
                db.transaction_with(policy.clone(), |tx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let current = tx.get(&k).await?.expect("counter exists");
                    let n: u64 = String::from_utf8(current).unwrap().parse().unwrap();
                    tx.put(k, (n + 1).to_string().into_bytes()).await?;
                    Ok::<_, TitoError>(())
                })
                .await
                .expect("increment eventually commits");
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
    let total = tasks * per_task;
    assert_eq!(read(&db, &k).await, Some(total.to_string().into_bytes()));
    // Every increment ran at least once; conflicts made some run again.
    assert!(runs.load(Ordering::SeqCst) >= total);
}

/// A transaction that locks `fence` and writes `effect`, not yet committed.
async fn locked_writer<E: TitoEngine>(db: &E, fence: &[u8], effect: Vec<u8>) -> E::Transaction {
    let locker = db.begin().await.unwrap();
    locker.lock_keys(&[fence.to_vec()]).await.unwrap();
    locker.put(effect, b"done".to_vec()).await.unwrap();
    locker
}

pub async fn locked_keys_conflict_with_writers<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    let fence = ctx.key("fence");
    put_committed(db, fence.clone(), b"v1").await;

    let locker = locked_writer(db, &fence, ctx.key("effect")).await;
    put_committed(db, fence.clone(), b"v2").await;
    let err = locker
        .commit()
        .await
        .expect_err("a locked key written by another must conflict");
    assert!(err.is_retryable(), "got {err:?}");
    assert_eq!(read(db, &ctx.key("effect")).await, None);

    // Without an interfering writer the locked commit goes through.
    let locker = locked_writer(db, &fence, ctx.key("effect")).await;
    locker.commit().await.unwrap();
    assert_eq!(
        read(db, &ctx.key("effect")).await.as_deref(),
        Some(&b"done"[..])
    );
}

pub async fn reads_are_not_validated<E: TitoEngine>(ctx: Ctx<E>) {
    // Write skew is allowed: each transaction reads the key the other writes.
    let db = &ctx.db;
    put_committed(db, ctx.key("x"), b"0").await;
    put_committed(db, ctx.key("y"), b"0").await;
    let a = db.begin().await.unwrap();
    let b = db.begin().await.unwrap();
    assert!(a.get(&ctx.key("y")).await.unwrap().is_some());
    assert!(b.get(&ctx.key("x")).await.unwrap().is_some());
    a.put(ctx.key("x"), b"a".to_vec()).await.unwrap();
    b.put(ctx.key("y"), b"b".to_vec()).await.unwrap();
    // The contract allows a backend to fail one of these, but a backend with the TiKV model
    // commits both; neither may report anything but success or a retryable conflict.
    for tx in [a, b] {
        if let Err(err) = tx.commit().await {
            assert!(err.is_retryable(), "got {err:?}");
        }
    }
}

pub async fn scans_respect_bounds_limits_and_direction<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    let names: Vec<String> = (0..20).map(|i| format!("k{i:02}")).collect();
    {
        let names = names.clone();
        let keys: Vec<Vec<u8>> = names.iter().map(|n| ctx.key(n)).collect();
        db.transaction(|tx| async move {
            for key in keys {
                tx.put(key.clone(), key).await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    let tx = db.begin().await.unwrap();
    let keys = |pairs: Vec<(Vec<u8>, Vec<u8>)>| -> Vec<String> {
        pairs
            .into_iter()
            .map(|(k, v)| {
                assert_eq!(k, v);
                String::from_utf8(k).unwrap()[ctx.ns.len()..].to_string()
            })
            .collect()
    };

    // Start inclusive, end exclusive.
    let got = keys(
        tx.scan(&ctx.key("k05"), &ctx.key("k08"), 100)
            .await
            .unwrap(),
    );
    assert_eq!(got, ["k05", "k06", "k07"]);
    // The limit cuts the page.
    let got = keys(tx.scan(&ctx.key("k05"), &ctx.key("k99"), 2).await.unwrap());
    assert_eq!(got, ["k05", "k06"]);
    // Reverse starts below the end and walks down to the start.
    let got = keys(
        tx.scan_reverse(&ctx.key("k05"), &ctx.key("k08"), 100)
            .await
            .unwrap(),
    );
    assert_eq!(got, ["k07", "k06", "k05"]);
    let got = keys(
        tx.scan_reverse(&ctx.key("k00"), &ctx.key("k99"), 3)
            .await
            .unwrap(),
    );
    assert_eq!(got, ["k19", "k18", "k17"]);
    // An open end runs to the end of the key space (here: of this test's keys).
    let got = keys(tx.scan(&ctx.key("k18"), b"", 100).await.unwrap());
    assert_eq!(got, ["k18", "k19"]);
    let got = keys(tx.scan_reverse(&ctx.key("k17"), b"", 2).await.unwrap());
    assert_eq!(got, ["k19", "k18"]);
    // Continuing after an exact key with key_after sees every later key.
    let after = tito::keys::key_after_bytes(&ctx.key("k01"));
    let got = keys(tx.scan(&after, &ctx.key("k03"), 100).await.unwrap());
    assert_eq!(got, ["k02"]);
    // An empty range.
    assert!(
        tx.scan(&ctx.key("k50"), &ctx.key("k60"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    tx.rollback().await.unwrap();
}

pub async fn scan_arguments_are_checked<E: TitoEngine>(ctx: Ctx<E>) {
    let tx = ctx.db.begin().await.unwrap();
    let (a, b) = (ctx.key("a"), ctx.key("b"));
    for result in [
        tx.scan(&a, &b, 0).await,
        tx.scan(&a, &b, MAX_SCAN_LIMIT + 1).await,
        tx.scan(&b, &a, 10).await,
        tx.scan(&a, &a, 10).await,
        tx.scan_reverse(&a, &b, 0).await,
        tx.scan_reverse(&b, &a, 10).await,
    ] {
        assert!(
            matches!(result, Err(TitoError::InvalidArgument(_))),
            "got {result:?}"
        );
    }
    assert!(tx.scan(&a, &b, MAX_SCAN_LIMIT).await.is_ok());
    tx.rollback().await.unwrap();
}

pub async fn batch_get_keeps_request_order<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    put_committed(db, ctx.key("one"), b"1").await;
    put_committed(db, ctx.key("three"), b"3").await;
    let tx = db.begin().await.unwrap();
    tx.put(ctx.key("two"), b"2".to_vec()).await.unwrap();
    let got = tx
        .batch_get(&[
            ctx.key("three"),
            ctx.key("missing"),
            ctx.key("one"),
            ctx.key("two"),
        ])
        .await
        .unwrap();
    assert_eq!(
        got,
        vec![
            Some(b"3".to_vec()),
            None,
            Some(b"1".to_vec()),
            Some(b"2".to_vec())
        ]
    );
    assert_eq!(
        tx.batch_get(&[]).await.unwrap(),
        Vec::<Option<Vec<u8>>>::new()
    );
    tx.rollback().await.unwrap();
}

pub async fn versions_are_ordered_and_tell_time<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    let mut last = 0;
    for _ in 0..50 {
        let tx = db.begin().await.unwrap();
        assert!(
            tx.start_version() > last,
            "start versions must strictly increase"
        );
        last = tx.start_version();
        tx.rollback().await.unwrap();
        let now = db.current_version().await.unwrap();
        assert!(now > last);
        last = now;
    }
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let physical = version_millis(last);
    // The physical part is the store's clock: close to this machine's (generously).
    assert!(
        physical.abs_diff(wall) < 60_000,
        "version {last} says {physical} ms, clock says {wall}"
    );
}

pub async fn delete_range_removes_exactly_the_range<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    // More keys than one batch of the embedded engine's range deletion.
    let count = 2_500;
    for chunk in (0..count).collect::<Vec<u32>>().chunks(500) {
        let keys: Vec<Vec<u8>> = chunk.iter().map(|i| ctx.key(&format!("r{i:05}"))).collect();
        db.transaction(|tx| async move {
            for key in keys {
                tx.put(key, b"v".to_vec()).await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    put_committed(db, ctx.key("before"), b"v").await;
    put_committed(db, ctx.key("s-after"), b"v").await;

    db.delete_range(&ctx.key("r00010"), &ctx.key("r02400"))
        .await
        .unwrap();

    let tx = db.begin().await.unwrap();
    let mut remaining = Vec::new();
    let mut from = ctx.key("");
    loop {
        let page = tx.scan(&from, &ctx.key("~"), 1000).await.unwrap();
        let Some((last, _)) = page.last() else { break };
        from = tito::keys::key_after_bytes(last);
        remaining.extend(
            page.into_iter()
                .map(|(k, _)| String::from_utf8(k).unwrap()[ctx.ns.len()..].to_string()),
        );
    }
    tx.rollback().await.unwrap();
    let mut expected: Vec<String> = vec!["before".into()];
    expected.extend((0..10).map(|i| format!("r{i:05}")));
    expected.extend((2400..count).map(|i| format!("r{i:05}")));
    expected.push("s-after".into());
    assert_eq!(remaining, expected);
}

pub async fn delete_range_checks_its_bounds<E: TitoEngine>(ctx: Ctx<E>) {
    let (a, b) = (ctx.key("a"), ctx.key("b"));
    ctx.db
        .transaction(|tx| {
            let a = a.clone();
            async move { tx.put(a, b"kept".to_vec()).await }
        })
        .await
        .unwrap();
    // Defect 11: a destructive call names both bounds; an empty one is refused, not "to the
    // edge of the key space".
    for result in [
        ctx.db.delete_range(&b, &a).await,
        ctx.db.delete_range(&a, &a).await,
        ctx.db.delete_range(b"", &b).await,
        ctx.db.delete_range(&a, b"").await,
        ctx.db.delete_range(b"", b"").await,
    ] {
        assert!(
            matches!(result, Err(TitoError::InvalidArgument(_))),
            "got {result:?}"
        );
    }
    assert_eq!(read(&ctx.db, &a).await.as_deref(), Some(&b"kept"[..]));
    // A well-formed range that holds nothing is fine.
    ctx.db.delete_range(&b, &ctx.key("c")).await.unwrap();
    assert_eq!(read(&ctx.db, &a).await.as_deref(), Some(&b"kept"[..]));
}

pub async fn garbage_collection_checks_its_argument<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    let result = db.garbage_collect(Duration::ZERO).await;
    assert!(
        matches!(result, Err(TitoError::InvalidArgument(_))),
        "got {result:?}"
    );
    let result = db.garbage_collect(Duration::from_micros(10)).await;
    assert!(
        matches!(result, Err(TitoError::InvalidArgument(_))),
        "sub-millisecond: {result:?}"
    );

    put_committed(db, ctx.key("g"), b"1").await;
    let safe = db.garbage_collect(Duration::from_secs(3600)).await.unwrap();
    assert!(safe > 0);
    let now = db.current_version().await.unwrap();
    assert!(safe < now, "the safe point lies in the past");
    // A longer window than the one already applied still succeeds.
    db.garbage_collect(Duration::from_secs(7200)).await.unwrap();
    // Data survives collection.
    assert_eq!(read(db, &ctx.key("g")).await.as_deref(), Some(&b"1"[..]));
}

pub async fn finished_transactions_refuse_work<E: TitoEngine>(ctx: Ctx<E>) {
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("f"), b"1".to_vec()).await.unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(
        tx.get(&ctx.key("f")).await,
        Err(TitoError::TransactionFinished(_))
    ));
    assert!(matches!(
        tx.put(ctx.key("f"), b"2".to_vec()).await,
        Err(TitoError::TransactionFinished(_))
    ));
    assert!(matches!(
        tx.commit().await,
        Err(TitoError::TransactionFinished(_))
    ));
    assert!(matches!(
        tx.rollback().await,
        Err(TitoError::TransactionFinished(_))
    ));

    let tx = ctx.db.begin().await.unwrap();
    tx.rollback().await.unwrap();
    assert!(matches!(
        tx.commit().await,
        Err(TitoError::TransactionFinished(_))
    ));
    // A transaction with no writes commits.
    let tx = ctx.db.begin().await.unwrap();
    tx.get(&ctx.key("f")).await.unwrap();
    tx.commit().await.unwrap();
}

pub async fn dropped_transactions_leave_nothing<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    {
        let tx = db.begin().await.unwrap();
        tx.put(ctx.key("dropped"), b"x".to_vec()).await.unwrap();
        // Dropped without commit or rollback.
    }
    // A transaction future cancelled while its closure waits.
    let key = ctx.key("cancelled");
    let cancelled = tokio::time::timeout(
        Duration::from_millis(50),
        db.transaction(|tx| async move {
            tx.put(key, b"x".to_vec()).await?;
            std::future::pending::<()>().await;
            Ok::<_, TitoError>(())
        }),
    )
    .await;
    assert!(cancelled.is_err(), "the transaction future was cut off");
    assert_eq!(read(db, &ctx.key("dropped")).await, None);
    assert_eq!(read(db, &ctx.key("cancelled")).await, None);
    // The store still works, and the same keys can be written.
    put_committed(db, ctx.key("cancelled"), b"y").await;
    assert_eq!(
        read(db, &ctx.key("cancelled")).await.as_deref(),
        Some(&b"y"[..])
    );
}
