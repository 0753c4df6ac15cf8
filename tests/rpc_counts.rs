//! What each model operation and each queue publication and outcome costs on TiKV, counted by
//! the test server per gRPC method, with every kind of key (rows, manifests, index entries,
//! claims, the catalog; pending rows per partition, completed rows, event ids, leases, commit
//! markers) in a region of its own, as in a store large enough to span regions. The counts are
//! exact: a change that adds a round trip to an operation fails here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoModel, TitoTransaction};
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

/// The same table shape with the composite index's entries holding only keys.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[tito(table = "rpc_keyed_users")]
#[tito(index = "rpc_keyed_by_team_created: team, created", entries = "keys")]
struct KeyedUser {
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
    quiet_except(cluster, &[]).await
}

/// The counters of every method but `ignored` once those stop moving (a worker's polls,
/// `KvScan`, keep going as often as its backoff says).
async fn quiet_except(cluster: &TestCluster, ignored: &[&str]) -> BTreeMap<String, u64> {
    // A process reads the moved marker again at a commit when its last read is over a second
    // old (`MOVED_CHECK_INTERVAL`): when that falls into a measured window depends on the
    // machine's pace, not on the operation, so those reads are not counted.
    let counted = || {
        let mut calls = cluster.all_calls();
        calls.retain(|method, _| !ignored.contains(&method.as_str()));
        let marker_reads = cluster.calls_for("KvGet", tito::engine::MOVED_KEY);
        if let Some(gets) = calls.get_mut("KvGet") {
            *gets -= marker_reads;
        }
        calls.retain(|_, count| *count > 0);
        calls
    };
    let mut last = counted();
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let now = counted();
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
    let db = counted_handle(&cluster).await;
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
    // Plain transactions of one key and of four keys in four regions: what a commit costs,
    // the read of its primary at the commit's version included (see `backend::tikv`).
    let one_key = count!("transaction of 1 key", {
        db.transaction(|tx| async move { tx.put(b"table:one".to_vec(), b"1".to_vec()).await })
            .await
            .unwrap()
    });
    let four_keys = count!("transaction of 4 keys in 4 regions", {
        db.transaction(|tx| async move {
            for key in [
                "index:four",
                "reverse-index:four",
                "table:four",
                "unique:four",
            ] {
                tx.put(key.as_bytes().to_vec(), b"4".to_vec()).await?;
            }
            Ok::<_, tito::TitoError>(())
        })
        .await
        .unwrap()
    });

    // The same query over entries that hold only keys: the entries, then the rows in one
    // batched read (one more round trip).
    let keyed = db.clone().model::<KeyedUser>();
    for i in 0..12 {
        let u = user(i, "core");
        keyed
            .build(KeyedUser {
                id: u.id,
                email: u.email,
                team: u.team,
                created: u.created,
            })
            .await
            .unwrap();
    }
    let keyed_query = count!("team's 10 newest, entries of keys", {
        let page = keyed
            .rpc_keyed_by_team_created("core")
            .reverse(true)
            .limit(Some(10))
            .execute()
            .await
            .unwrap();
        assert_eq!(page.items.len(), 10);
        assert_eq!(page.items[0].id, "u11");
    });

    for (name, counted) in &table {
        println!("{name:<45} {counted:?}");
    }
    assert_eq!(keyed_query, calls(&[("KvBatchGet", 1), ("KvScan", 1)]));
    // Every committed write transaction reads each key it wrote back at the commit's version
    // (`KvGet`, one per key, in parallel; see `backend::tikv`). Without any check the one-key
    // transaction cost {KvCommit: 1, KvPrewrite: 1} and the four-key one {KvCommit: 4,
    // KvPrewrite: 4}; reading the primary alone added one `KvGet` to each.
    assert_eq!(
        one_key,
        calls(&[("KvCommit", 1), ("KvGet", 1), ("KvPrewrite", 1)])
    );
    assert_eq!(
        four_keys,
        calls(&[("KvCommit", 4), ("KvGet", 4), ("KvPrewrite", 4)])
    );
    // A write reads the row, manifest, catalog and the claims it expects to take in one
    // request (one call per region, in parallel), prewrites each region it writes, commits the
    // primary's region, then the secondaries' after the reply (the client groups them by region,
    // the primary's region again included when it holds other keys), and reads its five keys
    // back (the row, its manifest, the email's claim, the index entry, the catalog's count).
    assert_eq!(
        insert,
        calls(&[
            ("KvBatchGet", 4),
            ("KvCommit", 4),
            ("KvGet", 5),
            ("KvPrewrite", 4)
        ])
    );
    assert_eq!(get, calls(&[("KvGet", 1)]));
    assert_eq!(query, calls(&[("KvScan", 1)]));
    // An update or a delete also checks the keys the manifest lists (entries and the claim).
    assert_eq!(
        update,
        calls(&[
            ("KvBatchGet", 5),
            ("KvCommit", 4),
            ("KvGet", 5),
            ("KvPrewrite", 3)
        ])
    );
    assert_eq!(
        delete,
        calls(&[
            ("KvBatchGet", 5),
            ("KvCommit", 5),
            ("KvGet", 5),
            ("KvPrewrite", 4)
        ])
    );
}

/// What one outcome case costs: its events (key, owner?) and what each handler answers.
struct OutcomeCase {
    name: &'static str,
    keys: Vec<String>,
    owned: bool,
    reschedule: bool,
    /// Run by `run_transactional_worker` (the handler in the outcome's transaction).
    transactional: bool,
    /// Published as the children of one batch (no callback).
    batch: bool,
}

/// Publishes the case's events, lets a worker start all of them (each handler waits), then
/// opens the gate and counts the calls until the outcomes are applied. The worker runs on this
/// test's single thread, so every handler has finished when the worker looks, and the outcomes
/// commit as one batch. Pulls (`KvScan`) are left out: the worker polls again once its slots
/// are free, as often as its backoff says.
async fn outcome_calls(
    cluster: &TestCluster,
    db: &TiKV,
    case: &OutcomeCase,
) -> BTreeMap<String, u64> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tito::queue::{
        Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueOwner, WorkerConfig,
        run_transactional_worker, run_worker,
    };

    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)),
    ));
    let now = chrono::Utc::now().timestamp() - 1;
    let mut children = Vec::new();
    for key in &case.keys {
        let mut event = QueueEvent::new(key.clone(), 1u32, now);
        if case.owned {
            event = event.with_owner(QueueOwner::new("user", key.clone()));
        }
        if case.batch {
            children.push(event);
        } else {
            queue.publish(event).await.unwrap();
        }
    }
    if case.batch {
        use tito::queue::graph::{Batch, Graphs};
        Graphs::new(db.clone())
            .publish_batch(
                &Batch::new(format!("batch-{}", case.name)),
                &*queue,
                &children,
            )
            .await
            .unwrap();
    }
    let started = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let reschedule = case.reschedule;
    let config = WorkerConfig::new(0..2)
        .concurrency(case.keys.len())
        .page_size(case.keys.len())
        .outcome_batch(64)
        .lease_duration(Duration::from_secs(600))
        .maintenance_interval(Duration::from_secs(600));
    let answer = move |event: &QueueEvent<u32>| {
        if reschedule {
            let later = event.timestamp + 3600;
            QueueHandlerOutcome::Reschedule(event.clone().rescheduled(later))
        } else {
            QueueHandlerOutcome::Acknowledge
        }
    };
    let worker = if case.transactional {
        let (started, gate) = (started.clone(), gate.clone());
        tokio::spawn(run_transactional_worker(
            queue.clone(),
            config,
            move |event: QueueEvent<u32>, _tx| {
                let (started, gate) = (started.clone(), gate.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    Ok(answer(&event))
                }
            },
            stopped,
        ))
    } else {
        let (started, gate) = (started.clone(), gate.clone());
        tokio::spawn(run_worker(
            queue.clone(),
            config,
            move |event: QueueEvent<u32>| {
                let (started, gate) = (started.clone(), gate.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    Ok(answer(&event))
                }
            },
            stopped,
        ))
    };
    while started.load(Ordering::SeqCst) < case.keys.len() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = quiet_except(cluster, &["KvScan"]).await;
    gate.add_permits(case.keys.len());
    let target = case.keys.len() as u64;
    while queue.stats().acknowledged + queue.stats().rescheduled < target {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counted = delta(&before, &quiet_except(cluster, &["KvScan"]).await);
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    // Leave nothing for the next case.
    let leftover = queue.stats();
    assert_eq!(leftover.outcome_failures, 0, "{}", case.name);
    println!("{:<45} {counted:?}", case.name);
    counted
}

#[tokio::test(flavor = "current_thread")]
async fn tikv_queue_outcomes_cost_the_counted_requests() {
    let cluster = TestCluster::start().await.unwrap();
    // Each kind of queue key in a region of its own, as in a queue large enough to span regions.
    for split in [
        "batch-child:",
        "batch-shard:",
        "batch:",
        "commit-marker:",
        "queue:completed:",
        "queue:event:",
        "queue:lease-expiry:",
        "queue:lease:",
        "queue:meta",
        "queue:owner:",
        "queue:pending:0000:",
        "queue:pending:0001:",
    ] {
        cluster.split(split);
    }
    let db = counted_handle(&cluster).await;
    // Keys of events that land in partition 0 and in partition 1.
    let in_partition = |p: u32, n: usize, tag: &str| -> Vec<String> {
        (0..)
            .map(|i| format!("{tag}-{i}"))
            .filter(|k| tito::queue::partition_for(k, 2) == p)
            .take(n)
            .collect()
    };
    let cases = [
        OutcomeCase {
            name: "acknowledge 1",
            keys: in_partition(0, 1, "a"),
            owned: false,
            reschedule: false,
            transactional: false,
            batch: false,
        },
        OutcomeCase {
            name: "reschedule 1",
            keys: in_partition(0, 1, "b"),
            owned: false,
            reschedule: true,
            transactional: false,
            batch: false,
        },
        OutcomeCase {
            name: "acknowledge 1 with an owner",
            keys: in_partition(0, 1, "c"),
            owned: true,
            reschedule: false,
            transactional: false,
            batch: false,
        },
        OutcomeCase {
            name: "acknowledge 4 in one partition (one batch)",
            keys: in_partition(0, 4, "d"),
            owned: false,
            reschedule: false,
            transactional: false,
            batch: false,
        },
        OutcomeCase {
            name: "acknowledge 4 over two partitions (one batch)",
            keys: [in_partition(0, 2, "e"), in_partition(1, 2, "e")].concat(),
            owned: false,
            reschedule: false,
            transactional: false,
            batch: false,
        },
        OutcomeCase {
            name: "acknowledge 1 (transactional worker)",
            keys: in_partition(0, 1, "f"),
            owned: false,
            reschedule: false,
            transactional: true,
            batch: false,
        },
        OutcomeCase {
            name: "acknowledge 1 batch child",
            keys: in_partition(0, 1, "g"),
            owned: false,
            reschedule: false,
            transactional: false,
            batch: true,
        },
        OutcomeCase {
            name: "acknowledge 4 batch children (one batch)",
            keys: in_partition(0, 4, "h"),
            owned: false,
            reschedule: false,
            transactional: false,
            batch: true,
        },
        OutcomeCase {
            name: "acknowledge 1 batch child (transactional worker)",
            keys: in_partition(0, 1, "i"),
            owned: false,
            reschedule: false,
            transactional: true,
            batch: true,
        },
    ];
    // A publication, with no worker running: the event-id check, then the pending row and the
    // event-id key (the queue's partition count was checked by an earlier publication), then
    // the read of both back at the commit's version.
    let queue = tito::queue::Queue::new(
        db.clone(),
        tito::queue::QueueConfig::new(2, std::time::Duration::from_secs(3600)),
    );
    let now = chrono::Utc::now().timestamp();
    queue
        .publish(tito::queue::QueueEvent::new("p-0", 1u32, now + 3600))
        .await
        .unwrap();
    let before = quiet(&cluster).await;
    queue
        .publish(tito::queue::QueueEvent::new("p-1", 1u32, now + 3600))
        .await
        .unwrap();
    let publish = delta(&before, &quiet(&cluster).await);
    println!("{:<45} {publish:?}", "publish 1");
    assert_eq!(
        publish,
        calls(&[("KvCommit", 2), ("KvGet", 3), ("KvPrewrite", 2)])
    );

    let mut counted = Vec::new();
    for case in &cases {
        counted.push(outcome_calls(&cluster, &db, case).await);
    }
    // Every outcome batch reads in one request (one call per region it reads, in parallel):
    // the lease's holder record and expiry, and each invocation's pending row. It then
    // prewrites every region it writes (the pending rows deleted and the replacement, the
    // completed rows, the event-id keys, the owner keys, the holder key it locks, its commit
    // marker) and commits them, the primary's first (its first written key: the holder key's
    // lock is handed to the client at the commit, so a written key leads), and reads every
    // key it wrote back at the commit's version (one `KvGet` each).
    let kv = |batch_get: u64, commit: u64, get: u64, prewrite: u64| {
        calls(&[
            ("KvBatchGet", batch_get),
            ("KvCommit", commit),
            ("KvGet", get),
            ("KvPrewrite", prewrite),
        ])
    };
    // One acknowledgement writes four keys (pending row deleted, completed row, event id,
    // marker). When the primary's region holds other keys, it is committed again with them.
    assert_eq!(counted[0], kv(3, 5, 4, 5), "{}", cases[0].name);
    // A replacement writes one key more (its pending row, due later).
    assert_eq!(counted[1], kv(3, 6, 5, 5), "{}", cases[1].name);
    // The owner key moves with it.
    assert_eq!(counted[2], kv(3, 6, 6, 6), "{}", cases[2].name);
    // Four outcomes cost one transaction, the same regions: three keys each and one marker.
    assert_eq!(counted[3], kv(3, 6, 13, 5), "{}", cases[3].name);
    // Two partitions: one more pending-row region to read and write, and the commit of the
    // primary's region again for its other keys.
    assert_eq!(counted[4], kv(4, 7, 13, 6), "{}", cases[4].name);
    // A transactional worker's attempt reads the lease and the row before it calls the
    // handler, so that read falls before the window measured here (the handler waits in it):
    // the same requests, the read counted earlier.
    let tx_kv = |commit: u64, get: u64, prewrite: u64| {
        calls(&[
            ("KvCommit", commit),
            ("KvGet", get),
            ("KvPrewrite", prewrite),
        ])
    };
    assert_eq!(counted[5], tx_kv(5, 4, 5), "{}", cases[5].name);
    // A batch child's end writes its end record, a key of its own (no read: one region more
    // to prewrite and commit, one key more read back); the fold that follows is a transaction
    // of its own (it scans the batch's end records and shards, reads the record, writes it and
    // deletes the end records it folded). Four children's ends cost one fold together.
    assert_eq!(counted[6], kv(3, 7, 8, 7), "{}", cases[6].name);
    assert_eq!(counted[7], kv(3, 9, 23, 7), "{}", cases[7].name);
    assert_eq!(counted[8], tx_kv(7, 8, 7), "{}", cases[8].name);
}

/// The writes a concurrency limit adds to one started event on TiKV: a worker's whole run over
/// one event (lease, start, outcome), with and without a per-key limit, counting the two-phase
/// commits (prewrite and commit requests; reads of the pause and limit records go on while the
/// worker idles, so reads are printed, not asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tikv_a_limited_start_costs_one_gate_and_one_release_commit() {
    use std::sync::Arc;
    use std::time::Duration;
    use tito::queue::{Limits, Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, WorkerConfig};

    let cluster = TestCluster::start().await.unwrap();
    let db = counted_handle(&cluster).await;
    let mut counted = Vec::new();
    for (topic, limits) in [
        ("plain", Limits::none()),
        ("limited", Limits::none().key_concurrency(1)),
        ("both", Limits::none().concurrency(4).key_concurrency(1)),
    ] {
        let queue = Arc::new(Queue::new(
            db.clone(),
            QueueConfig::new(1, Duration::from_secs(3600)).topic(topic),
        ));
        let now = chrono::Utc::now().timestamp() - 1;
        queue
            .publish(QueueEvent::new("k", 1u32, now))
            .await
            .unwrap();
        if !limits.is_none() {
            queue.set_limits(limits).await.unwrap();
        }
        let reads = ["KvScan", "KvGet", "KvBatchGet"];
        let before = quiet_except(&cluster, &reads).await;
        let all_before = cluster.all_calls();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let worker = tokio::spawn(tito::queue::run_worker(
            queue.clone(),
            WorkerConfig::new(0..1)
                .lease_duration(Duration::from_secs(600))
                .maintenance_interval(Duration::from_secs(600)),
            |_event: QueueEvent<u32>| async { Ok(QueueHandlerOutcome::Acknowledge) },
            stopped,
        ));
        while queue.stats().acknowledged < 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let writes = delta(&before, &quiet_except(&cluster, &reads).await);
        let all = delta(&all_before, &cluster.all_calls());
        stop.send(true).unwrap();
        worker.await.unwrap().unwrap();
        println!("{topic:<8} commits {writes:?}; all calls (reads include idle polls) {all:?}");
        counted.push(writes);
    }
    // A request that meets a lock left by an earlier transaction whose secondary keys are
    // still being committed (the client commits them after it answers) resolves the lock
    // (`KvCheckTxnStatus`, `KvResolveLock`). A prewrite that met it is sent again (one more
    // `KvPrewrite`); a read that met it is not. Either is the timing of the run, not a cost of
    // the limit: each resolved lock may account for one prewrite, no more.
    let prewrites_fit = |c: &BTreeMap<String, u64>, expected: u64| {
        let resolved = c.get("KvResolveLock").copied().unwrap_or(0);
        let sent = c.get("KvPrewrite").copied().unwrap_or(0);
        (expected..=expected + resolved).contains(&sent)
    };
    let commits = |c: &BTreeMap<String, u64>| c.get("KvCommit").copied();
    // Plain: three transactions that write, the lease (with the worker's heartbeat), the
    // worker's first report (one key, written as it starts and then every 10 s) and the
    // outcome. A limit adds two, the gate's and the release's, whatever the number of limits
    // (the gate resolves an unknown outcome, so it writes a commit marker beside its slots:
    // one more commit request for the secondaries).
    assert!(prewrites_fit(&counted[0], 3), "{counted:?}");
    assert_eq!(commits(&counted[0]), Some(5), "{counted:?}");
    assert!(prewrites_fit(&counted[1], 5), "{counted:?}");
    assert_eq!(commits(&counted[1]), Some(8), "{counted:?}");
    assert!(prewrites_fit(&counted[2], 5), "{counted:?}");
}

/// A handle whose requests are counted per operation: without nudges (a worker writes its
/// address every 5 s, not per invocation) and without the once-a-second read of the moved
/// marker (one `KvGet` a second per process, not per operation).
async fn counted_handle(cluster: &tito_tikv_test_server::TestCluster) -> TiKV {
    let db = TiKV::connect_with(
        cluster.pd_endpoints(),
        tito::backend::tikv::TiKVOptions::default().no_nudges(),
    )
    .await
    .unwrap();
    db.pause_moved_checks();
    db
}

/// Graph retention reads a page of records and skips those too young by the time each record
/// carries: a store of young workflows and batches costs one scan of each kind, however many
/// steps and children they have. An old finished one is then read whole and deleted.
#[tokio::test(flavor = "current_thread")]
async fn tikv_graph_retention_reads_nothing_of_young_graphs() {
    use std::time::Duration;
    use tito::queue::graph::{Batch, Graphs, StepName, Workflow};
    use tito::queue::{Queue, QueueConfig, QueueEvent};
    let cluster = TestCluster::start().await.unwrap();
    for split in ["batch:", "queue:", "workflow-step:", "workflow:"] {
        cluster.split(split);
    }
    let db = counted_handle(&cluster).await;
    let graphs = Graphs::new(db.clone());
    let queue = Queue::new(db.clone(), QueueConfig::new(2, Duration::from_secs(3600)));
    let later = chrono::Utc::now().timestamp() + 3600;
    for w in 0..3 {
        let mut wf = Workflow::new(format!("young-{w}"));
        for s in 0..20 {
            wf.step(
                &StepName::<()>::named(format!("s{s}")),
                &queue,
                QueueEvent::new(format!("k{s}"), s, later),
            );
        }
        graphs.publish_workflow(&wf).await.unwrap();
    }
    let children: Vec<QueueEvent<u32>> = (0..50)
        .map(|n| QueueEvent::new(format!("c{n}"), n, later))
        .collect();
    graphs
        .publish_batch(&Batch::new("young-batch"), &queue, &children)
        .await
        .unwrap();
    let before = quiet(&cluster).await;
    let expired = graphs.expire(Duration::from_secs(3600)).await.unwrap();
    let counted = delta(&before, &quiet(&cluster).await);
    println!("{:<45} {counted:?}", "retention over young graphs");
    assert_eq!((expired.workflows, expired.batches), (0, 0));
    assert_eq!(counted, calls(&[("KvScan", 2)]), "one page of each kind");
    // Old enough (no retention), a finished graph is read and deleted: an empty closed batch.
    graphs
        .publish_batch::<u32>(&Batch::new("ended"), &queue, &[])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let before = quiet(&cluster).await;
    let expired = graphs.expire(Duration::ZERO).await.unwrap();
    let counted = delta(&before, &quiet(&cluster).await);
    println!("{:<45} {counted:?}", "retention deleting one batch");
    assert_eq!((expired.workflows, expired.batches), (0, 1));
    assert!(counted.contains_key("KvPrewrite"), "{counted:?}");
}
