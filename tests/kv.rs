//! The key/value store: versions, expiry, compare-and-set, counters, listing, the sweeper and
//! races. Written once, run on every backend.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tito::kv::{Kv, MAX_KV_KEY_BYTES, MAX_KV_VALUE_BYTES, is_live};
use tito::model::TitoOptions;
use tito::queue::run_transactional_worker;
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel,
    TitoTransaction, WorkerConfig,
};

use crate::support::{Ctx, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! kv_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            kv,
            [
                versions_are_tokens_and_guard_writes,
                expiry_hides_a_key_from_its_instant,
                tokens_are_never_reused_after_expiry_and_prune,
                counters_count_and_refuse_non_integers,
                concurrent_put_if_absent_has_one_winner,
                concurrent_increments_all_count,
                listing_is_byte_ordered_with_a_keyset_cursor,
                bad_input_is_refused_before_writing,
                writes_join_the_callers_transaction,
                the_sweeper_prunes_in_bounded_batches,
                a_redelivered_event_has_no_second_effect,
                sweepers_run_alone_or_in_a_worker,
            ]
        );
    };
}

fn ns<E>(ctx: &Ctx<E>) -> String {
    format!("{}kv", ctx.ns)
}

#[test]
fn existence_has_one_definition_at_the_boundary() {
    assert!(is_live(None, 100));
    assert!(is_live(Some(101), 100));
    assert!(!is_live(Some(100), 100), "expired at its instant");
    assert!(!is_live(Some(99), 100));
}

pub async fn versions_are_tokens_and_guard_writes<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    assert_eq!(kv.get(&ns, "a").await.unwrap(), None);
    let v1 = kv
        .put(&ns, "a", &json!({"n": 1}), Some(0), None)
        .await
        .unwrap();
    assert_ne!(v1, 0);
    let entry = kv.get(&ns, "a").await.unwrap().unwrap();
    assert_eq!((entry.value.clone(), entry.version), (json!({"n": 1}), v1));

    // Compare-and-set: a stale expectation fails and writes nothing.
    let err = kv
        .put(&ns, "a", &json!({"n": 2}), Some(0), None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TitoError::VersionMismatch { expected: 0, actual, .. } if actual == v1),
        "{err:?}"
    );
    let v2 = kv
        .put(&ns, "a", &json!({"n": 2}), Some(v1), None)
        .await
        .unwrap();
    assert_ne!(v2, v1);
    assert!(matches!(
        kv.put(&ns, "a", &1, Some(v1), None).await,
        Err(TitoError::VersionMismatch { .. })
    ));
    assert_eq!(
        kv.get(&ns, "a").await.unwrap().unwrap().value,
        json!({"n": 2})
    );

    // Delete with an expected version.
    assert!(matches!(
        kv.delete(&ns, "a", Some(v1)).await,
        Err(TitoError::VersionMismatch { .. })
    ));
    assert!(kv.delete(&ns, "a", Some(v2)).await.unwrap());
    assert!(!kv.delete(&ns, "a", None).await.unwrap());
    assert_eq!(kv.get(&ns, "a").await.unwrap(), None);

    // put_if_absent.
    assert!(
        kv.put_if_absent(&ns, "b", &"x", None)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(kv.put_if_absent(&ns, "b", &"y", None).await.unwrap(), None);
    assert_eq!(
        kv.get(&ns, "b")
            .await
            .unwrap()
            .unwrap()
            .decode::<String>()
            .unwrap(),
        "x"
    );
}

pub async fn expiry_hides_a_key_from_its_instant<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    kv.put(&ns, "short", &1, None, Some(Duration::from_millis(300)))
        .await
        .unwrap();
    kv.put(&ns, "long", &2, None, Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    let entry = kv.get(&ns, "short").await.unwrap().unwrap();
    let expires = entry.expires_ms.unwrap();
    let got = kv
        .get_many(&ns, &["short".into(), "none".into(), "long".into()])
        .await
        .unwrap();
    assert!(got[0].is_some() && got[1].is_none() && got[2].is_some());

    let k = kv.clone();
    let n = ns.clone();
    wait_for("the expiry", Duration::from_secs(10), move || {
        let (k, n) = (k.clone(), n.clone());
        async move { k.get(&n, "short").await.unwrap().is_none() }
    })
    .await;
    // Nothing deleted it: it is invisible because its instant passed (at the engine's now).
    let tx = ctx.db.begin().await.unwrap();
    let now = tito::engine::version_millis(tx.start_version());
    assert!(now >= expires);
    assert!(
        tx.get(format!("kv:{}:short", ns.replace(':', ";<")).as_bytes())
            .await
            .unwrap()
            .is_some()
    );
    tx.rollback().await.unwrap();
    // Expired is absent for every operation.
    let got = kv
        .get_many(&ns, &["short".into(), "long".into()])
        .await
        .unwrap();
    assert!(got[0].is_none() && got[1].is_some());
    assert!(
        kv.put(&ns, "short", &3, Some(0), None).await.is_ok(),
        "expected 0 matches an expired key"
    );
    assert_eq!(
        kv.incr(&ns, "gone", 1, Some(Duration::from_millis(1)))
            .await
            .unwrap(),
        1
    );
}

pub async fn tokens_are_never_reused_after_expiry_and_prune<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    let mut seen = std::collections::HashSet::new();
    for round in 0..3 {
        let version = kv
            .put(&ns, "k", &round, Some(0), Some(Duration::from_millis(20)))
            .await
            .unwrap();
        assert!(seen.insert(version), "token {version} issued twice");
        let k = kv.clone();
        let n = ns.clone();
        wait_for("the expiry", Duration::from_secs(10), move || {
            let (k, n) = (k.clone(), n.clone());
            async move { k.get(&n, "k").await.unwrap().is_none() }
        })
        .await;
        // Pruned: the row itself is gone before the next write.
        while kv.sweep(100).await.unwrap() > 0 {}
    }
}

pub async fn counters_count_and_refuse_non_integers<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    assert_eq!(kv.incr(&ns, "c", 5, None).await.unwrap(), 5);
    assert_eq!(kv.incr(&ns, "c", -7, None).await.unwrap(), -2);
    kv.put(&ns, "s", &"text", None, None).await.unwrap();
    let err = kv.incr(&ns, "s", 1, None).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::InvalidArgument(m) if m.contains("not an integer")),
        "{err:?}"
    );
    kv.put(&ns, "max", &i64::MAX, None, None).await.unwrap();
    assert!(matches!(
        kv.incr(&ns, "max", 1, None).await,
        Err(TitoError::InvalidArgument(_))
    ));
    assert_eq!(
        kv.get(&ns, "max").await.unwrap().unwrap().value,
        json!(i64::MAX)
    );
}

pub async fn concurrent_put_if_absent_has_one_winner<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = Arc::new(ns(&ctx));
    let mut tasks = Vec::new();
    for n in 0..8 {
        let (kv, ns) = (kv.clone(), ns.clone());
        tasks.push(tokio::spawn(async move {
            kv.put_if_absent(&ns, "once", &n, None).await.unwrap()
        }));
    }
    let mut winners = 0;
    for task in tasks {
        winners += usize::from(task.await.unwrap().is_some());
    }
    assert_eq!(winners, 1);
}

pub async fn concurrent_increments_all_count<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = Arc::new(ns(&ctx));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (kv, ns) = (kv.clone(), ns.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                kv.incr(&ns, "hits", 1, None).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(kv.get(&ns, "hits").await.unwrap().unwrap().value, json!(40));
}

pub async fn listing_is_byte_ordered_with_a_keyset_cursor<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    for key in [
        "user:b", "user:a", "user:a2", "user:a20", "user:é", "user:Z", "other",
    ] {
        kv.put(&ns, key, &key, None, None).await.unwrap();
    }
    kv.put(
        &ns,
        "user:expired",
        &0,
        None,
        Some(Duration::from_millis(1)),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut keys = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = kv.list(&ns, "user:", 2, cursor.as_deref()).await.unwrap();
        assert!(page.entries.len() <= 2);
        keys.extend(page.entries.into_iter().map(|e| e.key));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
    }
    // Byte order: uppercase before lowercase, `a2` before `a20`, non-ASCII last.
    assert_eq!(
        keys,
        [
            "user:Z", "user:a", "user:a2", "user:a20", "user:b", "user:é"
        ]
    );
    // A cursor outside the prefix, and a zero page, are refused.
    assert!(matches!(
        kv.list(&ns, "user:", 2, Some("other")).await,
        Err(TitoError::InvalidArgument(_))
    ));
    assert!(matches!(
        kv.list(&ns, "user:", 0, None).await,
        Err(TitoError::InvalidArgument(_))
    ));
    assert_eq!(kv.list(&ns, "", 100, None).await.unwrap().entries.len(), 7);
}

pub async fn bad_input_is_refused_before_writing<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    let invalid = |r: Result<u64, TitoError>| {
        assert!(matches!(r, Err(TitoError::InvalidArgument(_))), "{r:?}")
    };
    invalid(
        kv.put(&ns, "big", &"x".repeat(MAX_KV_VALUE_BYTES), None, None)
            .await,
    );
    invalid(kv.put(&ns, "", &1, None, None).await);
    invalid(
        kv.put(&ns, &"k".repeat(MAX_KV_KEY_BYTES + 1), &1, None, None)
            .await,
    );
    invalid(kv.put("", "k", &1, None, None).await);
    invalid(kv.put(&ns, "k", &1, None, Some(Duration::ZERO)).await);
    assert!(kv.list(&ns, "", 10, None).await.unwrap().entries.is_empty());
}

pub async fn writes_join_the_callers_transaction<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    let tx = ctx.db.begin().await.unwrap();
    kv.put_in_tx(&ns, "marker", &true, Some(0), None, &tx)
        .await
        .unwrap();
    tx.put(ctx.key("effect"), b"1".to_vec()).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(kv.get(&ns, "marker").await.unwrap(), None);

    let (k, n, effect) = (kv.clone(), ns.clone(), ctx.key("effect"));
    ctx.db
        .transaction(|tx| async move {
            k.put_in_tx(&n, "marker", &true, Some(0), None, &tx).await?;
            k.incr_in_tx(&n, "count", 1, None, &tx).await?;
            tx.put(effect, b"1".to_vec()).await
        })
        .await
        .unwrap();
    assert!(kv.get(&ns, "marker").await.unwrap().is_some());
    assert_eq!(kv.get(&ns, "count").await.unwrap().unwrap().value, json!(1));
}

pub async fn the_sweeper_prunes_in_bounded_batches<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    for n in 0..5 {
        kv.put(
            &ns,
            &format!("t{n}"),
            &n,
            None,
            Some(Duration::from_millis(1)),
        )
        .await
        .unwrap();
    }
    kv.put(&ns, "forever", &1, None, None).await.unwrap();
    kv.put(&ns, "later", &1, None, Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(kv.sweep(2).await.unwrap(), 2);
    assert_eq!(kv.sweep(2).await.unwrap(), 2);
    assert_eq!(kv.sweep(2).await.unwrap(), 1);
    assert_eq!(kv.sweep(2).await.unwrap(), 0);
    let tx = ctx.db.begin().await.unwrap();
    let prefix = tito::keys::kv_namespace_prefix(&ns);
    let rows = tx
        .scan(
            prefix.as_bytes(),
            tito::prefix_end(prefix.clone()).as_bytes(),
            100,
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(rows.len(), 2, "only the live keys are left");
}

#[derive(TitoModel, Default, Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Wallet {
    pub id: String,
    pub balance: i64,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Credit {
    pub wallet: String,
    pub amount: i64,
}

/// The idempotency marker, the effect and the acknowledgement commit in one transaction, so a
/// second delivery of one logical event (published twice here) has no second effect.
pub async fn a_redelivered_event_has_no_second_effect<E: TitoEngine>(ctx: Ctx<E>) {
    let wallets = ctx.db.clone().model::<Wallet>();
    wallets
        .build(Wallet {
            id: "w".into(),
            balance: 0,
        })
        .await
        .unwrap();
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_secs(60)),
    ));
    let credit = QueueEvent::new(
        "wallet:w",
        Credit {
            wallet: "w".into(),
            amount: 10,
        },
        chrono::Utc::now().timestamp(),
    );
    assert!(!queue.publish(credit.clone()).await.unwrap().duplicate);
    // The producer retried: same logical id, no second invocation.
    assert!(queue.publish(credit.clone()).await.unwrap().duplicate);
    queue
        .publish(QueueEvent::new(
            "wallet:w",
            Credit {
                wallet: "w".into(),
                amount: 5,
            },
            chrono::Utc::now().timestamp(),
        ))
        .await
        .unwrap();

    // A delivery whose effect already committed with its marker (an earlier run whose
    // acknowledgement was lost): delivered again, it must have no second effect.
    let replayed = QueueEvent::new(
        "wallet:w",
        Credit {
            wallet: "w".into(),
            amount: 100,
        },
        chrono::Utc::now().timestamp(),
    );
    queue.publish(replayed.clone()).await.unwrap();

    let kv = Kv::new(ctx.db.clone());
    let markers = ns(&ctx);
    kv.put_if_absent(&markers, &replayed.id, &true, None)
        .await
        .unwrap()
        .expect("a fresh marker");
    let (stop, rx) = tokio::sync::watch::channel(false);
    let (w, k) = (wallets.clone(), kv.clone());
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(50)),
        move |event: QueueEvent<Credit>, tx: E::Transaction| {
            let (wallets, kv, markers) = (w.clone(), k.clone(), markers.clone());
            async move {
                if kv
                    .put_if_absent_in_tx(&markers, &event.id, &true, None, &tx)
                    .await?
                    .is_none()
                {
                    return Ok(QueueHandlerOutcome::Acknowledge); // seen before: no effect
                }
                let mut wallet = wallets.find_by_id_in_tx(&event.payload.wallet, &tx).await?;
                wallet.balance += event.payload.amount;
                wallets
                    .update_with_options(wallet, TitoOptions::default(), &tx)
                    .await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    let q = queue.clone();
    wait_for(
        "three completed invocations",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.completed_count().await.unwrap() == 3 }
        },
    )
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(wallets.find_by_id("w", vec![]).await.unwrap().balance, 15);
    assert!(kv.get(&ns(&ctx), &credit.id).await.unwrap().is_some());
}

pub async fn sweepers_run_alone_or_in_a_worker<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = ns(&ctx);
    let count_rows = |db: E, ns: String| async move {
        let tx = db.begin().await.unwrap();
        let prefix = tito::keys::kv_namespace_prefix(&ns);
        let n = tx
            .scan(
                prefix.as_bytes(),
                tito::prefix_end(prefix.clone()).as_bytes(),
                100,
            )
            .await
            .unwrap()
            .len();
        tx.rollback().await.unwrap();
        n
    };
    // On its own.
    kv.put(&ns, "a", &1, None, Some(Duration::from_millis(1)))
        .await
        .unwrap();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let sweeper = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.run_sweeper(Duration::from_millis(20), rx).await })
    };
    let (db, n) = (ctx.db.clone(), ns.clone());
    wait_for("the sweeper", Duration::from_secs(10), move || {
        let (db, n) = (db.clone(), n.clone());
        async move { count_rows(db, n).await == 0 }
    })
    .await;
    stop.send(true).unwrap();
    sweeper.await.unwrap();

    // In a queue worker's maintenance.
    kv.put(&ns, "b", &1, None, Some(Duration::from_millis(1)))
        .await
        .unwrap();
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(1, Duration::from_secs(60)),
    ));
    let (stop, rx) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(tito::queue::run_worker(
        queue,
        WorkerConfig::new(0..1)
            .sweep_kv(true)
            .maintenance_interval(Duration::from_millis(20)),
        |_event: QueueEvent<i64>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    let (db, n) = (ctx.db.clone(), ns.clone());
    wait_for("the worker's sweep", Duration::from_secs(10), move || {
        let (db, n) = (db.clone(), n.clone());
        async move { count_rows(db, n).await == 0 }
    })
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
}
