//! Moving a store (`tito::store`): a copy between engines leaves a destination the application
//! runs on as it ran on the source; it is refused into a store that holds data, resumes after an
//! interruption, catches up with what changed, and `verify` names what differs.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::memory::{Memory, MemoryClock, MemoryOptions};
use tito::store::{CopyOptions, Difference, Existing, VerifyOptions, copy, verify};
use tito::{Embedded, TitoEngine, TitoError, TitoModel, TitoTransaction};

use crate::support::{pending_total, test_server_ctx};

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "copied_user")]
#[tito(unique_index = "by_email: email")]
#[tito(index = "by_team: team")]
struct CopiedUser {
    #[tito(id)]
    id: String,
    email: String,
    team: String,
}

fn user(i: usize) -> CopiedUser {
    CopiedUser {
        id: format!("u{i:05}"),
        email: format!("u{i}@example.com"),
        team: format!("t{}", i % 7),
    }
}

/// A store with rows, index entries, pending queue rows and kv keys.
async fn fill<E: TitoEngine>(db: &E, users: usize, events: usize) {
    let model = db.clone().model::<CopiedUser>();
    for chunk in (0..users).collect::<Vec<_>>().chunks(100) {
        let (model, chunk) = (model.clone(), chunk.to_vec());
        db.transaction(|tx| {
            let (model, chunk) = (model.clone(), chunk.clone());
            async move {
                for i in chunk {
                    model
                        .build_with_options(user(i), Default::default(), &tx)
                        .await?;
                }
                Ok::<_, TitoError>(())
            }
        })
        .await
        .unwrap();
    }
    let queue = crate::support::queue(db, 4);
    for i in 0..events {
        queue
            .publish(tito::QueueEvent::now(format!("k{}", i % 5), i as u64))
            .await
            .unwrap();
    }
    let kv = tito::kv::Kv::new(db.clone());
    kv.put("settings", "theme", "dark", None, None)
        .await
        .unwrap();
}

/// What the application sees: every user by id and by its unique index, a team's members, the
/// queue's backlog and a kv key.
async fn seen<E: TitoEngine>(
    db: &E,
    users: usize,
) -> (Vec<CopiedUser>, usize, usize, Option<String>) {
    let model = db.clone().model::<CopiedUser>();
    let mut found = Vec::new();
    for i in 0..users {
        let by_id = model.get(&user(i).id).await.unwrap();
        let by_email = model.get_by_email(&user(i).email).await.unwrap();
        assert_eq!(by_id.as_ref(), by_email.as_ref());
        if let Some(u) = by_id {
            found.push(u);
        }
    }
    let team = model
        .by_team("t3")
        .limit(Some(1000))
        .execute()
        .await
        .unwrap()
        .items
        .len();
    let backlog = pending_total(&crate::support::queue(db, 4)).await;
    let kv = tito::kv::Kv::new(db.clone());
    let theme = kv
        .get("settings", "theme")
        .await
        .unwrap()
        .map(|entry| entry.value.to_string());
    (found, team, backlog, theme)
}

/// Whether `verify` finds the two stores equal.
async fn same<A: TitoEngine, B: TitoEngine>(a: &A, b: &B) -> bool {
    verify(a, b, VerifyOptions::new(), |_| {})
        .await
        .unwrap()
        .equal()
}

async fn copy_and_check<S: TitoEngine, D: TitoEngine>(from: &S, to: &D) {
    fill(from, 300, 40).await;
    let mut ranges = 0;
    let report = copy(from, to, CopyOptions::new().batch(97), |_| ranges += 1)
        .await
        .unwrap();
    assert!(report.progress.keys_read > 300 && ranges >= 3, "{report:?}");
    assert_eq!(report.progress.keys_read, report.progress.keys_written);
    assert_eq!(report.progress.keys_deleted, 0);
    let verified = verify(from, to, VerifyOptions::new().batch(50), |_| {})
        .await
        .unwrap();
    assert!(verified.equal(), "{verified:?}");
    assert_eq!(verified.keys_a, report.progress.keys_read);
    assert_eq!(seen(from, 300).await, seen(to, 300).await);
    // The application goes on on the destination: its workers run the copied backlog.
    let queue = crate::support::queue(to, 4);
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        queue.clone(),
        tito::WorkerConfig::new(0..4),
        |_: tito::QueueEvent<u64>| async { Ok(tito::QueueHandlerOutcome::Acknowledge) },
    );
    crate::support::wait_for("the copied backlog runs", Duration::from_secs(30), || {
        let queue = queue.clone();
        async move { pending_total(&queue).await == 0 }
    })
    .await;
    workers.shutdown().await.unwrap();
    // And writes through its indexes as on the source.
    let model = to.clone().model::<CopiedUser>();
    let clash = model.build(CopiedUser {
        id: "new".into(),
        email: user(5).email,
        team: "t1".into(),
    });
    assert!(clash.await.is_err(), "the unique index came along");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_store_copied_to_tikv_runs_as_before() {
    let from = Embedded::temporary().await.unwrap();
    let to = test_server_ctx().await;
    copy_and_check(&from, &to.db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tikv_store_copied_to_sqlite_runs_as_before() {
    let from = test_server_ctx().await;
    let to = tito::backend::sqlite::Sqlite::temporary().await.unwrap();
    copy_and_check(&from.db, &to).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_is_refused_into_a_store_that_holds_data_and_overwrites_on_request() {
    let (from, to) = (Memory::new(), Memory::new());
    fill(&from, 20, 3).await;
    to.transaction(|tx| async move { tx.put(b"zz-other".to_vec(), b"1".to_vec()).await })
        .await
        .unwrap();
    let refused = copy(&from, &to, CopyOptions::new(), |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(refused, TitoError::InvalidArgument(_))
            && refused
                .to_string()
                .contains("holds data (its first key is \"zz-other\")"),
        "{refused}"
    );
    assert_eq!(to.len(), 1, "nothing was written");
    let report = copy(
        &from,
        &to,
        CopyOptions::new().existing(Existing::Overwrite),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(report.progress.keys_deleted, 1);
    assert!(same(&from, &to).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_copy_resumes_and_ends_equal() {
    let (from, to) = (Memory::new(), Memory::new());
    fill(&from, 500, 10).await;
    // Killed after three ranges committed (the callback panics, as a kill would stop it).
    let task = {
        let (from, to) = (from.clone(), to.clone());
        tokio::spawn(async move {
            let mut ranges = 0;
            copy(&from, &to, CopyOptions::new().batch(50), move |_| {
                ranges += 1;
                assert!(ranges < 3, "killed");
            })
            .await
        })
    };
    assert!(task.await.unwrap_err().is_panic());
    // The source changes meanwhile, before and after the cursor.
    let model = from.clone().model::<CopiedUser>();
    model.delete_by_id(&user(1).id).await.unwrap();
    model
        .update(CopiedUser {
            team: "moved".into(),
            ..user(499)
        })
        .await
        .unwrap();
    // Not taken for an empty store, nor silently restarted.
    let refused = copy(&from, &to, CopyOptions::new(), |_| {})
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("interrupted copy"),
        "{refused}"
    );
    let report = copy(
        &from,
        &to,
        CopyOptions::new().batch(50).existing(Existing::Resume),
        |_| {},
    )
    .await
    .unwrap();
    assert!(report.progress.resumed);
    let verified = verify(&from, &to, VerifyOptions::new(), |_| {})
        .await
        .unwrap();
    assert!(verified.equal(), "{verified:?}");
    assert_eq!(seen(&from, 500).await, seen(&to, 500).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_pass_writes_only_what_changed() {
    let (from, to) = (Memory::new(), Memory::new());
    fill(&from, 200, 0).await;
    copy(&from, &to, CopyOptions::new(), |_| {}).await.unwrap();
    let model = from.clone().model::<CopiedUser>();
    model.delete_by_id(&user(7).id).await.unwrap();
    model.build(user(1000)).await.unwrap();
    let before = verify(&from, &to, VerifyOptions::new(), |_| {})
        .await
        .unwrap();
    assert!(!before.equal());
    let report = copy(
        &from,
        &to,
        CopyOptions::new().existing(Existing::Resume),
        |_| {},
    )
    .await
    .unwrap();
    // The deleted row, its index entries, claim and manifest; the new row's.
    assert_eq!(report.progress.keys_deleted, 5, "{report:?}");
    assert_eq!(report.progress.keys_written, 5, "{report:?}");
    assert!(same(&from, &to).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_the_first_differing_keys_in_order() {
    let (a, b) = (Memory::new(), Memory::new());
    for db in [&a, &b] {
        db.transaction(|tx| async move {
            for i in 0..2500u32 {
                tx.put(format!("k{i:05}").into_bytes(), b"v".to_vec())
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    b.transaction(|tx| async move {
        tx.put(b"k00010".to_vec(), b"changed".to_vec()).await?;
        tx.delete(b"k01500".to_vec()).await?;
        tx.put(b"k01500x".to_vec(), b"v".to_vec()).await
    })
    .await
    .unwrap();
    let mut ranges = Vec::new();
    let report = verify(&a, &b, VerifyOptions::new().batch(1000).report(2), |r| {
        ranges.push(r.clone())
    })
    .await
    .unwrap();
    assert_eq!(report.differing_keys, 3);
    assert_eq!(
        report.first_differences,
        [
            Difference::Changed("\"k00010\"".into()),
            Difference::OnlyInA("\"k01500\"".into())
        ]
    );
    assert_eq!((report.keys_a, report.keys_b), (2500, 2500));
    assert_eq!(report.ranges, 3);
    assert_eq!(report.ranges_differing, 2);
    assert!(!ranges[0].equal() && !ranges[1].equal() && ranges[2].equal());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_with_far_more_keys_is_cleared_in_bounded_transactions() {
    let (from, to) = (Memory::new(), Memory::new());
    from.transaction(|tx| async move { tx.put(b"a".to_vec(), b"1".to_vec()).await })
        .await
        .unwrap();
    for chunk in 0..25u32 {
        to.transaction(|tx| async move {
            for i in 0..1000u32 {
                tx.put(format!("b{chunk:02}{i:04}").into_bytes(), b"x".to_vec())
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    }
    let mut steps = 0;
    let report = copy(
        &from,
        &to,
        CopyOptions::new().existing(Existing::Overwrite),
        |_| steps += 1,
    )
    .await
    .unwrap();
    assert_eq!(report.progress.keys_deleted, 25_000);
    assert!(steps >= 3, "{steps} transactions for 25,000 deletes");
    assert!(same(&from, &to).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_waits_for_a_destination_clock_behind_the_sources_or_says_by_how_much() {
    // A source whose clock runs 1.5 s ahead of the destination's.
    let ahead = tito::engine::version_millis(Memory::new().current_version().await.unwrap()) + 1500;
    let from =
        Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime { epoch_ms: ahead }))
            .unwrap();
    fill(&from, 5, 1).await;
    let to = Memory::new();
    let refused = copy(
        &from,
        &to,
        CopyOptions::new().clock_wait(Duration::from_millis(100)),
        |_| {},
    )
    .await
    .unwrap_err();
    assert!(
        refused.to_string().contains("ms behind the source's"),
        "{refused}"
    );
    // The keys are there; a catch-up pass once the clock passed finishes the copy.
    let report = copy(
        &from,
        &to,
        CopyOptions::new().existing(Existing::Resume),
        |_| {},
    )
    .await
    .unwrap();
    assert!(report.clock_waited_ms > 0, "{report:?}");
    assert_eq!(report.progress.keys_written, 0);
    assert!(to.current_version().await.unwrap() > report.snapshot_version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_copy_and_verify_options_are_refused() {
    let (a, b) = (Memory::new(), Memory::new());
    for options in [
        CopyOptions::new().batch(0),
        CopyOptions::new().batch(tito::store::MAX_BATCH + 1),
        CopyOptions::new().batch_bytes(0),
        CopyOptions::new().keys_per_second(0),
    ] {
        let err = copy(&a, &b, options, |_| {}).await.unwrap_err();
        assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    }
    let err = verify(&a, &b, VerifyOptions::new().batch(0), |_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    // A throttled copy keeps to its rate: 40 keys at 100 per second take 0.3 s at least.
    a.transaction(|tx| async move {
        for i in 0..40u32 {
            tx.put(format!("k{i:02}").into_bytes(), b"v".to_vec())
                .await?;
        }
        Ok::<_, TitoError>(())
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    copy(
        &a,
        &b,
        CopyOptions::new().batch(10).keys_per_second(100),
        |_| {},
    )
    .await
    .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// A backup taken from inside the process while writers commit: opened as a store, it holds
/// every transaction acknowledged before the backup began, each whole, and its audit is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_under_load_restores_every_acknowledged_commit() {
    let db = Embedded::temporary().await.unwrap();
    fill(&db, 50, 0).await;
    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (db, acknowledged, stop) = (db.clone(), acknowledged.clone(), stop.clone());
            tokio::spawn(async move {
                let model = db.clone().model::<CopiedUser>();
                let mut i = 10_000 + w * 100_000;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    model.build(user(i)).await.unwrap();
                    acknowledged.lock().unwrap().push(i);
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before: Vec<usize> = acknowledged.lock().unwrap().clone();
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("backup");
    let report = tito::store::backup(&db, &target, CopyOptions::new().batch(64), |_| {})
        .await
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for writer in writers {
        writer.await.unwrap();
    }
    let restored = Embedded::open(&target).await.unwrap();
    let model = restored.clone().model::<CopiedUser>();
    for i in before.iter().copied().chain(0..50) {
        let row = model.get(&user(i).id).await.unwrap();
        assert_eq!(
            row,
            Some(user(i)),
            "user {i}, acknowledged before the backup"
        );
    }
    let audit = model.audit(|_| {}).await.unwrap();
    assert!(audit.is_clean(), "{audit:?}");
    assert!(report.progress.keys_read > 0);
    // A second backup into the same directory is refused, and the backup stays as it was.
    restored.close().await.unwrap();
    drop((model, restored));
    let refused = tito::store::backup(&db, &target, CopyOptions::new(), |_| {})
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("already holds a store"),
        "{refused}"
    );
}

/// `TITO_COPY_USERS=1000000 cargo test --release --test tito store_copy::copy_at_size --
/// --ignored --nocapture`: copies a store of that many users (five keys each) from the embedded
/// engine to another embedded store and to the TiKV test server, and verifies both; prints the
/// rates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: TITO_COPY_USERS users (default 100,000)"]
async fn copy_at_size() {
    let users: usize = std::env::var("TITO_COPY_USERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let from = Embedded::temporary().await.unwrap();
    let started = std::time::Instant::now();
    fill(&from, users, 0).await;
    println!(
        "seeded {users} users in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let dir = tempfile::tempdir().unwrap();
    let embedded = Embedded::open(dir.path().join("copy")).await.unwrap();
    let tikv = test_server_ctx().await;
    for (name, result) in [
        ("embedded", {
            let started = std::time::Instant::now();
            let report = copy(&from, &embedded, CopyOptions::new(), |_| {})
                .await
                .unwrap();
            let copied = started.elapsed();
            let started = std::time::Instant::now();
            let verified = verify(&from, &embedded, VerifyOptions::new(), |_| {})
                .await
                .unwrap();
            (report, copied, verified, started.elapsed())
        }),
        ("TiKV test server", {
            let started = std::time::Instant::now();
            let report = copy(&from, &tikv.db, CopyOptions::new(), |_| {})
                .await
                .unwrap();
            let copied = started.elapsed();
            let started = std::time::Instant::now();
            let verified = verify(&from, &tikv.db, VerifyOptions::new(), |_| {})
                .await
                .unwrap();
            (report, copied, verified, started.elapsed())
        }),
    ] {
        let (report, copied, verified, verify_time) = result;
        assert!(verified.equal());
        let keys = report.progress.keys_read as f64;
        println!(
            "embedded -> {name}: {keys} keys ({:.1} MiB) copied in {:.1} s ({:.0} keys/s), \
             verified in {:.1} s ({:.0} keys/s)",
            report.progress.bytes_written as f64 / (1 << 20) as f64,
            copied.as_secs_f64(),
            keys / copied.as_secs_f64(),
            verify_time.as_secs_f64(),
            keys / verify_time.as_secs_f64()
        );
    }
}

/// Leases, heartbeats, reports and slots stay behind by default: a worker on the destination
/// starts the invocation that was running in the source at once, not when the source worker's
/// 60 s lease would have expired; verify leaves them out the same way unless asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_stay_behind_so_the_destinations_workers_take_over_at_once() {
    let from = Embedded::temporary().await.unwrap();
    let queue = crate::support::queue(&from, 2);
    queue
        .publish(tito::QueueEvent::now("k", 1u64))
        .await
        .unwrap();
    queue
        .set_limits(tito::queue::Limits::none().concurrency(5))
        .await
        .unwrap();
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut source_workers = tito::Workers::new();
    source_workers.spawn_worker(
        queue.clone(),
        tito::WorkerConfig::new(0..2).lease_duration(Duration::from_secs(60)),
        move |_: tito::QueueEvent<u64>| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(());
                std::future::pending::<()>().await;
                Ok(tito::QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    started.recv().await.unwrap();
    let to = test_server_ctx().await;
    copy(&from, &to.db, CopyOptions::new(), |_| {})
        .await
        .unwrap();
    let tx = to.db.begin().await.unwrap();
    let copied = tx.scan(b"queue:", b"queue;", 1000).await.unwrap();
    tx.rollback().await.unwrap();
    let left: Vec<String> = copied
        .iter()
        .filter(|(k, _)| tito::store::is_holder_key(k))
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(same(&from, &to.db).await);
    let with_holders = verify(&from, &to.db, VerifyOptions::new().holders(true), |_| {})
        .await
        .unwrap();
    assert!(with_holders.differing_keys >= 3, "{with_holders:?}");
    // The destination's worker runs the invocation now.
    let moved = crate::support::queue(&to.db, 2);
    let (ran_tx, mut ran) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = tito::Workers::new();
    workers.spawn_worker(
        moved.clone(),
        tito::WorkerConfig::new(0..2),
        move |_: tito::QueueEvent<u64>| {
            let ran_tx = ran_tx.clone();
            async move {
                let _ = ran_tx.send(());
                Ok(tito::QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    tokio::time::timeout(Duration::from_secs(20), ran.recv())
        .await
        .expect("started long before the source's 60 s lease would expire")
        .unwrap();
    workers.shutdown().await.unwrap();
    drop(source_workers);
}

#[test]
fn holder_keys_are_told_from_the_rest() {
    use tito::store::is_holder_key;
    for key in [
        "queue:lease:0003",
        "queue:lease-expiry:0003",
        "queue:worker:w1",
        "queue:report:w1",
        "queue:node:n1",
        "queue:coordinator",
        "queue:members",
        "queue:running:all:0001",
        "queue@mail:running:key:k:0000",
        "queue@mail:lease:0000",
        "queue:nudge:w1",
        "queue@mail:nudge:w2",
        "inbox-lease:email_job:j1",
    ] {
        assert!(is_holder_key(key.as_bytes()), "{key}");
    }
    for key in [
        "queue:pending:0000:00000000001700000000:00000000000000000001:e",
        "queue@lease:pending:0000:00000000001700000000:00000000000000000001:e",
        "queue@worker:meta",
        "queue:limits",
        "queue:paused:all",
        "table:lease:1",
        "kv:queue:lease",
        "queue@nudge:meta",
        "queue",
    ] {
        assert!(!is_holder_key(key.as_bytes()), "{key}");
    }
}

/// What writers acknowledged while a store moved: the last state of each user they touched
/// (`None`: deleted).
type Acknowledged = Arc<std::sync::Mutex<std::collections::BTreeMap<usize, Option<CopiedUser>>>>;

/// Writers that insert, change and delete users of `db` until the store refuses them (it
/// moved), recording each acknowledged write; any other failure fails the test. Each writer
/// returns the refusal it met.
fn movers<E: TitoEngine>(
    db: &E,
    writers: std::ops::Range<usize>,
    acknowledged: &Acknowledged,
) -> Vec<tokio::task::JoinHandle<TitoError>> {
    writers
        .map(|w| {
            let (db, acknowledged) = (db.clone(), acknowledged.clone());
            tokio::spawn(async move {
                let model = db.clone().model::<CopiedUser>();
                let mut n = 0usize;
                loop {
                    n += 1;
                    let fresh = 10_000_000 * (w + 1) + n;
                    // Writers change disjoint users (w modulo 3), so the last acknowledged
                    // change of a user is the one stored.
                    let old = (n * 7 % 100) * 3 + w % 3;
                    let result = match n % 3 {
                        0 => model
                            .build(user(fresh))
                            .await
                            .map(|_| (fresh, Some(user(fresh)))),
                        1 => {
                            let mut changed = user(old);
                            changed.team = format!("moved-{n}");
                            model
                                .update(changed.clone())
                                .await
                                .map(|_| (old, Some(changed)))
                        }
                        _ => {
                            // Deletes only rows this writer made (never one another writes).
                            let doomed = 10_000_000 * (w + 1) + n - 2;
                            model
                                .delete_by_id(&user(doomed).id)
                                .await
                                .map(|_| (doomed, None))
                        }
                    };
                    match result {
                        Ok((id, state)) => {
                            acknowledged.lock().unwrap().insert(id, state);
                        }
                        Err(err @ TitoError::StoreMoved { .. }) => return err,
                        Err(TitoError::NotFound(_)) => {}
                        Err(err) => panic!("writer {w}: {err}"),
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect()
}

/// Moves `from` (filled, under two writers) to `to` and checks: the writers are refused only
/// by the switch, with the new store's name; every acknowledged write is in `to`; the stores
/// verify equal; `to` audits clean and takes writes; the source still reads.
async fn move_under_writers<S: TitoEngine, D: TitoEngine>(
    from: &S,
    to: &D,
) -> tito::store::MigrateReport {
    fill(from, 300, 20).await;
    let acknowledged = Acknowledged::default();
    let writers = movers(from, 0..2, &acknowledged);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut passes = 0u32;
    let report = tito::store::migrate(
        from,
        to,
        tito::store::MigrateOptions::new("the new store")
            .copy(CopyOptions::new().batch(97))
            .settle_keys(5),
        |p| passes = passes.max(p.pass),
    )
    .await
    .unwrap();
    for writer in writers {
        let refusal = writer.await.unwrap();
        assert!(refusal.to_string().contains("the new store"), "{refusal}");
    }
    assert_eq!(passes, report.progress.pass, "{report:?}");
    assert!(report.progress.pass >= 2, "{report:?}");
    let model = to.clone().model::<CopiedUser>();
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(acknowledged.len() > 10, "the writers wrote during the move");
    for (id, state) in &acknowledged {
        let found = model.get(&user(*id).id).await.unwrap();
        assert_eq!(&found, state, "user {id}, acknowledged before the switch");
    }
    let verified = verify(from, to, VerifyOptions::new(), |_| {})
        .await
        .unwrap();
    assert!(verified.equal(), "{verified:?}");
    let audit = model.audit(|_| {}).await.unwrap();
    assert!(audit.is_clean(), "{audit:?}");
    model.build(user(999_999)).await.unwrap();
    // The source: reads work, writes are refused, a move elsewhere is refused.
    let source = from.clone().model::<CopiedUser>();
    assert_eq!(
        source.get(&user(1).id).await.unwrap(),
        model.get(&user(1).id).await.unwrap()
    );
    let refused = source.build(user(999_998)).await.unwrap_err();
    assert!(matches!(refused, TitoError::StoreMoved { .. }), "{refused}");
    let elsewhere = tito::store::migrate(
        from,
        &Memory::new(),
        tito::store::MigrateOptions::new("another store"),
        |_| {},
    )
    .await
    .unwrap_err();
    assert!(
        elsewhere
            .to_string()
            .contains("already moved to the new store"),
        "{elsewhere}"
    );
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_store_moves_to_tikv_under_writers_and_refuses_writes_after() {
    let dir = tempfile::tempdir().unwrap();
    let from = Embedded::open(dir.path().join("store")).await.unwrap();
    let to = test_server_ctx().await;
    let report = move_under_writers(&from, &to.db).await;
    assert!(report.tracked, "{report:?}");
    assert!(report.last_pass_keys <= report.progress.keys_written + report.progress.keys_deleted);
    // The marker outlives the process: a reopened source still refuses writes, until reopened
    // for writes on purpose.
    from.close().await.unwrap();
    drop(from);
    let from = Embedded::open(dir.path().join("store")).await.unwrap();
    let model = from.clone().model::<CopiedUser>();
    let refused = model.build(user(999_997)).await.unwrap_err();
    assert!(
        refused.to_string().contains("moved to the new store"),
        "{refused}"
    );
    let removed = tito::store::reopen(&from).await.unwrap();
    assert_eq!(removed.map(|m| m.to).as_deref(), Some("the new store"));
    model.build(user(999_997)).await.unwrap();
    assert_eq!(tito::store::reopen(&from).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_store_moves_to_an_embedded_one_under_writers() {
    let from = tito::backend::sqlite::Sqlite::temporary().await.unwrap();
    let to = Embedded::temporary().await.unwrap();
    let report = move_under_writers(&from, &to).await;
    assert!(report.tracked, "{report:?}");
}

/// On TiKV, another process (a second connection: its own gate) keeps writing; it sees the
/// marker at its next check, and nothing it had acknowledged is missing from the destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tikv_store_moves_while_another_process_writes() {
    let from = test_server_ctx().await;
    let other = tito::backend::tikv::TiKV::connect(from.cluster.as_ref().unwrap().pd_endpoints())
        .await
        .unwrap();
    let to = Memory::new();
    let acknowledged = Acknowledged::default();
    let others = movers(&other, 2..3, &acknowledged);
    let report = move_under_writers(&from.db, &to).await;
    assert!(!report.tracked, "{report:?}");
    for writer in others {
        let refusal = writer.await.unwrap();
        assert!(refusal.to_string().contains("the new store"), "{refusal}");
    }
    let model = to.clone().model::<CopiedUser>();
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(!acknowledged.is_empty());
    for (id, state) in &acknowledged {
        assert_eq!(&model.get(&user(*id).id).await.unwrap(), state, "user {id}");
    }
    // Reopened for writes, the other process writes again after its next check.
    tito::store::reopen(&from.db).await.unwrap();
    crate::support::wait_for(
        "the other process takes writes again",
        Duration::from_secs(10),
        || {
            let model = other.clone().model::<CopiedUser>();
            async move { model.build(user(888_888)).await.is_ok() }
        },
    )
    .await;
}

/// A move called again after its switch (a failed last pass, a killed mover) finishes with a
/// full last pass; a range delete during a move makes the next pass compare every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_called_again_after_its_switch_finishes() {
    // A finished move called again copies nothing: the new store may hold writes of its own
    // by then, and they stay.
    let from = Memory::new();
    fill(&from, 200, 10).await;
    let to = Memory::new();
    let first = tito::store::migrate(&from, &to, tito::store::MigrateOptions::new("b"), |_| {})
        .await
        .unwrap();
    assert_eq!(
        (first.progress.pass, first.last_pass_keys),
        (2, 0),
        "nothing changed: no catch-up pass, nothing in the last"
    );
    let marker = tito::store::moved(&from).await.unwrap().unwrap();
    assert!(marker.finished_ms.is_some(), "{marker:?}");
    to.clone()
        .model::<CopiedUser>()
        .build(user(9_999))
        .await
        .unwrap();
    for _ in 0..2 {
        let again = tito::store::migrate(&from, &to, tito::store::MigrateOptions::new("b"), |_| {})
            .await
            .unwrap_err();
        assert!(
            again.to_string().contains("finished") && again.to_string().contains("reopen"),
            "{again}"
        );
    }
    let kept = to
        .clone()
        .model::<CopiedUser>()
        .get(&user(9_999).id)
        .await
        .unwrap();
    assert_eq!(kept, Some(user(9_999)), "the new store's own write stays");

    // A mover killed after its switch began (the marker written, no last pass): called again,
    // it runs a full last pass and the stores end equal.
    let from = Memory::new();
    fill(&from, 200, 10).await;
    let to = Memory::new();
    let switched = serde_json::json!({ "to": "b", "at_ms": 1 });
    from.transaction(|tx| {
        let marker = serde_json::to_vec(&switched).unwrap();
        async move { tx.put(tito::engine::MOVED_KEY.to_vec(), marker).await }
    })
    .await
    .unwrap();
    let again = tito::store::migrate(&from, &to, tito::store::MigrateOptions::new("b"), |_| {})
        .await
        .unwrap();
    assert_eq!(again.progress.pass, 1);
    assert!(again.last_pass_keys >= 200, "{again:?}");
    assert!(same(&from, &to).await);
    // Range deletes are refused on a moved store.
    let refused = from
        .delete_range(b"table:copied_user:", b"table:copied_user;")
        .await
        .unwrap_err();
    assert!(matches!(refused, TitoError::StoreMoved { .. }), "{refused}");
    // Reopened, the store moves again (here onward to a third store), and so does the second.
    tito::store::reopen(&from).await.unwrap();
    from.clone()
        .model::<CopiedUser>()
        .build(user(7_777))
        .await
        .unwrap();
    let third = Memory::new();
    tito::store::migrate(&from, &third, tito::store::MigrateOptions::new("c"), |_| {})
        .await
        .unwrap();
    assert!(same(&from, &third).await);
    let fourth = Memory::new();
    tito::store::migrate(
        &third,
        &fourth,
        tito::store::MigrateOptions::new("d"),
        |_| {},
    )
    .await
    .unwrap();
    assert!(same(&third, &fourth).await);
}

/// A move whose first pass failed (a destination that refused a commit) is called again with
/// the same options: its first pass resumes from the cursor the failed one left, and the move
/// finishes with the stores equal; the source took writes all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_first_pass_failed_resumes_when_called_again() {
    use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
    let from = Memory::new();
    fill(&from, 300, 20).await;
    let to = FaultyEngine::new(Memory::new());
    to.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::Storage)
            .skip(3)
            .times(1),
    );
    let options = || tito::store::MigrateOptions::new("b").copy(CopyOptions::new().batch(50));
    let failed = tito::store::migrate(&from, &to, options(), |_| {})
        .await
        .unwrap_err();
    assert!(failed.to_string().contains("injected"), "{failed}");
    assert_eq!(tito::store::moved(&from).await.unwrap(), None);
    from.clone()
        .model::<CopiedUser>()
        .build(user(8_888))
        .await
        .unwrap();
    let report = tito::store::migrate(&from, &to, options(), |_| {})
        .await
        .unwrap();
    assert!(report.progress.resumed, "{report:?}");
    assert!(same(&from, to.inner()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_move_options_are_refused() {
    let (from, to) = (Memory::new(), Memory::new());
    for (options, says) in [
        (
            tito::store::MigrateOptions::new(" "),
            "needs the new store's name",
        ),
        (
            tito::store::MigrateOptions::new("x".repeat(1025)),
            "over 1,024 bytes",
        ),
        (
            tito::store::MigrateOptions::new("tikv:a\nb"),
            "control character",
        ),
        (
            tito::store::MigrateOptions::new("b").settle_keys(0),
            "settle_keys",
        ),
        (
            tito::store::MigrateOptions::new("b").max_passes(0),
            "max_passes",
        ),
        (
            tito::store::MigrateOptions::new("b").max_passes(101),
            "max_passes",
        ),
        (
            tito::store::MigrateOptions::new("b").copy(CopyOptions::new().batch(0)),
            "batch",
        ),
    ] {
        let err = tito::store::migrate(&from, &to, options, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }
    // Nothing was marked.
    assert_eq!(tito::store::moved(&from).await.unwrap(), None);
    from.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
        .await
        .unwrap();
}

/// `TITO_COPY_USERS=1000000 cargo test --release --test tito store_copy::move_at_size --
/// --ignored --nocapture`: moves a store of that many users from the embedded engine to
/// another embedded store and to the TiKV test server while two writers insert and change
/// users, and prints each move's passes, the keys of its last pass and its downtime (how long
/// the writers were refused before the destination held every acknowledged write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: TITO_COPY_USERS users (default 100,000)"]
async fn move_at_size() {
    let users: usize = std::env::var("TITO_COPY_USERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let tikv = test_server_ctx().await;
    let dir = tempfile::tempdir().unwrap();
    for name in ["embedded", "TiKV test server"] {
        let from = Embedded::open(dir.path().join(format!("from-{}", name.len())))
            .await
            .unwrap();
        let started = std::time::Instant::now();
        fill(&from, users, 0).await;
        println!(
            "seeded {users} users in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let acknowledged = Acknowledged::default();
        let writers = movers(&from, 0..2, &acknowledged);
        let started = std::time::Instant::now();
        let report = if name == "embedded" {
            let to = Embedded::open(dir.path().join("to")).await.unwrap();
            tito::store::migrate(&from, &to, tito::store::MigrateOptions::new(name), |_| {})
                .await
                .unwrap()
        } else {
            tito::store::migrate(
                &from,
                &tikv.db,
                tito::store::MigrateOptions::new(name),
                |_| {},
            )
            .await
            .unwrap()
        };
        let took = started.elapsed();
        for writer in writers {
            writer.await.unwrap();
        }
        let writes = acknowledged.lock().unwrap().len();
        println!(
            "embedded -> {name}: {} keys read in {} passes, {:.1} s in all; writers \
             acknowledged {writes} users' writes ({:.0}/s) during the move; the last pass \
             copied {} keys; downtime {} ms",
            report.progress.keys_read,
            report.progress.pass,
            took.as_secs_f64(),
            writes as f64 / took.as_secs_f64(),
            report.last_pass_keys,
            report.downtime_ms
        );
    }
}

/// Fills the filesystem of `dir` with a ballast file until a write fails, then gives back
/// `leave` bytes: the next writes there find the disk full after about that much.
fn fill_disk(dir: &std::path::Path, leave: u64) -> std::path::PathBuf {
    use std::io::Write;
    let ballast = dir.join("ballast");
    let mut file = std::fs::File::create(&ballast).unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => written += n as u64,
        }
    }
    let _ = file.sync_all();
    file.set_len(written.saturating_sub(leave)).unwrap();
    file.sync_all().unwrap();
    ballast
}

/// `TITO_FULL_DISK_DIR=/mnt/small cargo test --test tito store_copy::a_copy_onto_a_full_disk
/// -- --ignored`, where `/mnt/small` is an empty directory on a small filesystem of its own
/// (`mount -t tmpfs -o size=64m tmpfs /mnt/small`): a copy into an embedded and into a SQLite
/// store on a disk that fills up fails with the device's error, leaves the source as it was,
/// and once space is freed a resumed copy ends equal to the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs TITO_FULL_DISK_DIR: an empty directory on a small filesystem of its own"]
async fn a_copy_onto_a_full_disk_fails_clearly_and_resumes_once_space_is_freed() {
    let Ok(dir) = std::env::var("TITO_FULL_DISK_DIR") else {
        panic!("set TITO_FULL_DISK_DIR to an empty directory on a small filesystem");
    };
    let dir = std::path::PathBuf::from(dir);
    // A source of about 12 MiB: users and kv values of 4 KiB.
    let from = Memory::new();
    fill(&from, 2_000, 20).await;
    let kv = tito::kv::Kv::new(from.clone());
    let value = "v".repeat(4096);
    for i in 0..3_000 {
        kv.put("blobs", &format!("b{i:05}"), &value, None, None)
            .await
            .unwrap();
    }
    let before = Memory::new();
    copy(&from, &before, CopyOptions::new(), |_| {})
        .await
        .unwrap();
    for engine in ["embedded", "sqlite"] {
        let path = dir.join(engine);
        let ballast = fill_disk(&dir, 4 << 20);
        // The copy into the store at `path` of this engine (opened, then closed after it).
        macro_rules! on_store {
            (|$to:ident| $body:expr) => {
                match engine {
                    "embedded" => {
                        let $to = Embedded::open(&path).await.unwrap();
                        let result = $body;
                        let _ = $to.close().await;
                        result
                    }
                    _ => {
                        let $to = tito::backend::sqlite::Sqlite::open(&path).await.unwrap();
                        let result = $body;
                        let _ = $to.close().await;
                        result
                    }
                }
            };
        }
        let refused = on_store!(|to| copy(&from, &to, CopyOptions::new().batch(200), |_| {}).await);
        let err = refused.expect_err("a copy larger than the free space must fail");
        let message = err.to_string();
        println!("{engine}: {message}");
        assert!(
            message.contains("No space left on device")
                || message.contains("disk is full")
                || message.contains("database or disk is full"),
            "{engine}: the device's error is named: {message}"
        );
        assert!(same(&from, &before).await, "the source is untouched");
        std::fs::remove_file(&ballast).unwrap();
        // Space freed: the destination opens again and the copy resumes to the end.
        let report = on_store!(|to| {
            let resumed = CopyOptions::new().batch(200).existing(Existing::Resume);
            let report = copy(&from, &to, resumed, |_| {}).await.unwrap();
            let verified = verify(&from, &to, VerifyOptions::new(), |_| {})
                .await
                .unwrap();
            assert!(verified.equal(), "{engine}: {verified:?}");
            assert_eq!(seen(&from, 2_000).await, seen(&to, 2_000).await);
            report
        });
        println!(
            "{engine}: resumed ({}), {} keys written after the disk was freed",
            report.progress.resumed, report.progress.keys_written
        );
        std::fs::remove_dir_all(&path).unwrap();
    }
}

/// Asserts that `to` carries every key of `from` a copy must carry, and nothing else of the
/// kind (holder keys of its own may stay).
async fn carries_all<S: TitoEngine, D: TitoEngine>(from: &S, to: &D, holders: bool, what: &str) {
    use crate::support::{carried, every_key};
    let (source, copied) = (every_key(from).await, every_key(to).await);
    let (want, got) = (carried(&source, holders), carried(&copied, holders));
    let missing: Vec<_> = want
        .keys()
        .filter(|k| got.get(*k) != want.get(*k))
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .take(5)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty() && want.len() == got.len(),
        "{what}: {} keys to carry, {} carried; missing or different {missing:?}, extra {extra:?}",
        want.len(),
        got.len()
    );
}

/// The source of the round-six defect: a first key, six leases, a table row and a last key.
async fn leases_between<E: TitoEngine>(db: &E) {
    db.transaction(|tx| async move {
        tx.put(b"a-first".to_vec(), b"1".to_vec()).await?;
        for p in 0..6 {
            tx.put(format!("queue:lease:{p:04}").into_bytes(), b"w1".to_vec())
                .await?;
        }
        tx.put(b"table:user:1".to_vec(), b"{}".to_vec()).await?;
        tx.put(b"zz-last".to_vec(), b"2".to_vec()).await
    })
    .await
    .unwrap();
}

async fn copy_past_leases<S: TitoEngine, D: TitoEngine>(from: &S, to: &D) {
    leases_between(from).await;
    for batch in [1, 2, 3, 5, 6, 7, 1000] {
        let report = copy(
            from,
            to,
            CopyOptions::new()
                .batch(batch)
                .existing(Existing::Overwrite),
            |_| {},
        )
        .await
        .unwrap();
        carries_all(from, to, false, &format!("batch {batch}")).await;
        assert_eq!(report.progress.keys_read, 3, "batch {batch}: {report:?}");
        // A catch-up pass over the finished copy changes nothing.
        let again = copy(
            from,
            to,
            CopyOptions::new().batch(batch).existing(Existing::Resume),
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(
            (again.progress.keys_written, again.progress.keys_deleted),
            (0, 0),
            "batch {batch}: {again:?}"
        );
        carries_all(from, to, false, &format!("catch-up at batch {batch}")).await;
        // With the holders, every key.
        copy(
            from,
            to,
            CopyOptions::new()
                .batch(batch)
                .holders(true)
                .existing(Existing::Overwrite),
            |_| {},
        )
        .await
        .unwrap();
        carries_all(from, to, true, &format!("holders at batch {batch}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_reads_past_a_run_of_leases_longer_than_its_batch_on_every_engine() {
    copy_past_leases(&Memory::new(), &Memory::new()).await;
    let embedded = Embedded::temporary().await.unwrap();
    let sqlite = tito::backend::sqlite::Sqlite::temporary().await.unwrap();
    copy_past_leases(&embedded, &sqlite).await;
    let tikv = test_server_ctx().await;
    let other = Embedded::temporary().await.unwrap();
    copy_past_leases(&other, &tikv.db).await;
}

/// A small deterministic generator (xorshift), so a failing case replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_resumes_at_random_batches_over_runs_of_skipped_keys_lose_nothing() {
    for seed in 1..=24u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (from, to) = (Memory::new(), Memory::new());
        let mut keys: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for i in 0..(50 + rng.below(150)) {
            keys.push((
                format!("d:{i:05}").into_bytes(),
                vec![b'v'; rng.below(40) as usize],
            ));
            if rng.below(6) == 0 {
                // A run of keys a copy skips, up to 2,100 long (past a default batch).
                let run = if rng.below(4) == 0 {
                    1000 + rng.below(1100)
                } else {
                    rng.below(12)
                };
                for r in 0..run {
                    let key = match rng.below(4) {
                        0 => format!("d:{i:05}:queue:lease:{r:05}"),
                        _ => format!("queue@t{i}:lease:{r:05}"),
                    };
                    keys.push((key.into_bytes(), b"holder".to_vec()));
                }
            }
        }
        keys.push((b"store-copy".to_vec(), b"{not a record".to_vec()));
        keys.push((b"zz-last".to_vec(), b"z".to_vec()));
        keys.sort();
        crate::support::put_all(&from, &keys).await;
        // Keys the destination must lose, and holders of its own it keeps.
        to.transaction(|tx| async move {
            tx.put(b"d:00003x".to_vec(), b"stale".to_vec()).await?;
            tx.put(b"queue:lease:9999".to_vec(), b"mine".to_vec())
                .await?;
            tx.put(b"zzz-stale".to_vec(), b"stale".to_vec()).await
        })
        .await
        .unwrap();
        let batch = match rng.below(4) {
            0 => 1,
            1 => 1 + rng.below(8) as usize,
            2 => 1 + rng.below(300) as usize,
            _ => 1000,
        };
        let bytes = if rng.below(3) == 0 {
            1 + rng.below(200) as usize
        } else {
            4 << 20
        };
        let options = CopyOptions::new()
            .batch(batch)
            .batch_bytes(bytes)
            .existing(Existing::Overwrite);
        // Interrupted after a few ranges (as a kill would stop it), then resumed.
        let stop_after = rng.below(6);
        let interrupted = {
            let (from, to, options) = (from.clone(), to.clone(), options.clone());
            tokio::spawn(async move {
                let mut ranges = 0;
                copy(&from, &to, options, move |_| {
                    ranges += 1;
                    assert!(ranges <= stop_after, "killed");
                })
                .await
            })
            .await
        };
        let what = format!("seed {seed}, batch {batch}, bytes {bytes}, stop after {stop_after}");
        if let Ok(finished) = interrupted {
            finished.unwrap_or_else(|err| panic!("{what}: {err}"));
        } else {
            copy(
                &from,
                &to,
                options.clone().existing(Existing::Resume),
                |_| {},
            )
            .await
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        }
        carries_all(&from, &to, false, &what).await;
        assert_eq!(
            super::support::read(&to, b"queue:lease:9999")
                .await
                .as_deref(),
            Some(&b"mine"[..]),
            "{what}: the destination's own holder key stays"
        );
        assert!(same(&from, &to).await, "{what}");
        // A catch-up pass writes and deletes nothing.
        let again = copy(&from, &to, options.existing(Existing::Resume), |_| {})
            .await
            .unwrap();
        assert_eq!(
            (again.progress.keys_written, again.progress.keys_deleted),
            (0, 0),
            "{what}: {again:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_at_small_batches_carries_every_key_past_leases_and_its_marker() {
    for batch in [1, 2, 5] {
        let (from, to) = (Memory::new(), Memory::new());
        fill(&from, 60, 10).await;
        leases_between(&from).await;
        let options = tito::store::MigrateOptions::new("b").copy(CopyOptions::new().batch(batch));
        tito::store::migrate(&from, &to, options, |_| {})
            .await
            .unwrap();
        assert!(tito::store::moved(&from).await.unwrap().is_some());
        carries_all(&from, &to, false, &format!("moved at batch {batch}")).await;
        // A copy of the moved store (its marker among the keys) at a batch of 1.
        let other = Memory::new();
        copy(&from, &other, CopyOptions::new().batch(1), |_| {})
            .await
            .unwrap();
        carries_all(&from, &other, false, "a moved store copied at batch 1").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overwrite_ignores_a_damaged_copy_record_and_a_resume_says_to_overwrite() {
    let (from, to) = (Memory::new(), Memory::new());
    fill(&from, 30, 3).await;
    to.transaction(|tx| async move {
        tx.put(b"store-copy".to_vec(), b"{damaged".to_vec()).await?;
        tx.put(b"old".to_vec(), b"1".to_vec()).await
    })
    .await
    .unwrap();
    let resumed = copy(
        &from,
        &to,
        CopyOptions::new().existing(Existing::Resume),
        |_| {},
    )
    .await
    .unwrap_err();
    assert!(
        resumed.to_string().contains("is damaged") && resumed.to_string().contains("overwrite"),
        "{resumed}"
    );
    let refused = copy(&from, &to, CopyOptions::new(), |_| {})
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("overwrite"), "{refused}");
    copy(
        &from,
        &to,
        CopyOptions::new().batch(7).existing(Existing::Overwrite),
        |_| {},
    )
    .await
    .unwrap();
    carries_all(&from, &to, false, "overwritten").await;
    assert_eq!(super::support::read(&to, b"store-copy").await, None);
}

/// A move whose later pass failed (a storage error in the destination, or a mover killed
/// during it) is, before the switch, called again and resumes: its first pass compares the
/// destination whole instead of refusing it as a store that holds data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_later_pass_failed_resumes_when_called_again() {
    use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
    for killed in [false, true] {
        let from = Memory::new();
        fill(&from, 200, 20).await;
        let to = FaultyEngine::new(Memory::new());
        let options = || {
            tito::store::MigrateOptions::new("b")
                .copy(CopyOptions::new().batch(5))
                .settle_keys(1)
        };
        let (from_task, to_task) = (from.clone(), to.clone());
        let failed = {
            let task = tokio::spawn(async move {
                let faults = to_task.clone();
                let writer = from_task.clone();
                let mut wrote = false;
                tito::store::migrate(&from_task, &to_task, options(), move |p| {
                    // Writes during the first pass, so that the move runs a second one.
                    if p.pass == 1 && p.keys_read > 0 && !wrote {
                        wrote = true;
                        let model = writer.clone().model::<CopiedUser>();
                        tokio::task::block_in_place(|| {
                            tokio::runtime::Handle::current().block_on(async {
                                for i in 0..5 {
                                    model.build(user(20_000 + i)).await.unwrap();
                                }
                            })
                        });
                    }
                    if p.pass == 2 {
                        if killed {
                            panic!("the mover is killed in its second pass");
                        }
                        faults
                            .faults()
                            .add(FaultRule::new(FaultPoint::Commit, Fault::Storage).always());
                    }
                })
                .await
            });
            task.await
        };
        match (killed, failed) {
            (true, Err(join)) => assert!(join.is_panic()),
            (false, Ok(Err(err))) => assert!(err.to_string().contains("injected"), "{err}"),
            (_, other) => panic!("killed {killed}: {other:?}"),
        }
        to.faults().clear();
        assert_eq!(tito::store::moved(&from).await.unwrap(), None);
        let report = tito::store::migrate(&from, &to, options(), |_| {})
            .await
            .unwrap_or_else(|err| panic!("killed {killed}: {err}"));
        assert!(report.progress.resumed, "{report:?}");
        carries_all(&from, to.inner(), false, &format!("killed {killed}")).await;
        assert_eq!(super::support::read(to.inner(), b"store-copy").await, None);
    }
}
