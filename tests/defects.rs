//! Regression tests for the defects found by adversarial use (one test per defect, named after
//! its number). Written once, run on every backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::queue::{
    ClusterConfig, cluster_state, run_cluster_worker, run_transactional_worker, run_worker,
};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoTransaction,
    WorkerConfig,
};
use tokio::sync::watch;

use crate::support::{Ctx, read, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! defects_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            defects,
            [
                defect_1_a_draining_worker_keeps_its_leases,
                defect_1_a_draining_cluster_node_keeps_its_heartbeat,
                defect_2_a_long_transactional_handler_commits_at_once,
                defect_3_shutdown_before_start_starts_nothing,
                defect_3_shutdown_while_a_handler_finishes_starts_nothing_more,
                defect_4_a_new_coordinator_runs_retention_at_once,
                defect_6_an_event_id_is_published_once,
                defect_17_bad_worker_settings_are_refused,
            ]
        );
    };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Job {
    n: u32,
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn queue<E: TitoEngine>(db: &E, partitions: u32) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(partitions, Duration::from_secs(3600)),
    ))
}

fn fast(partitions: std::ops::Range<u32>) -> WorkerConfig {
    WorkerConfig::new(partitions).max_idle_backoff(Duration::from_millis(20))
}

async fn pending_total<E: TitoEngine>(queue: &Queue<E>) -> usize {
    let mut total = 0;
    for p in 0..queue.config().partitions {
        total += queue.pending_count(p).await.unwrap();
    }
    total
}

/// Counts handler runs and the most that ran at once.
#[derive(Clone, Default)]
struct Runs {
    started: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl Runs {
    fn enter(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

/// A handler that runs for `length` and acknowledges, counted in `runs`.
fn slow(
    runs: &Runs,
    length: Duration,
) -> impl Fn(QueueEvent<Job>) -> futures::future::BoxFuture<'static, tito::QueueHandlerResult<Job>>
+ Send
+ Sync
+ 'static {
    let runs = runs.clone();
    move |_event: QueueEvent<Job>| {
        let runs = runs.clone();
        Box::pin(async move {
            runs.enter();
            tokio::time::sleep(length).await;
            runs.leave();
            Ok(QueueHandlerOutcome::Acknowledge)
        })
    }
}

/// A worker with a 300 ms lease whose handler runs 1.2 s is told to stop while the handler
/// runs; a second worker on the same partition starts meanwhile. The draining worker keeps its
/// lease, so the second never runs the invocation, and the first one's outcome is applied.
pub async fn defect_1_a_draining_worker_keeps_its_leases<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let runs = Runs::default();
    let lease = Duration::from_millis(300);
    let (stop_a, rx) = watch::channel(false);
    let a = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..1).lease_duration(lease),
        slow(&runs, Duration::from_millis(1200)),
        rx,
    ));
    let r = runs.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let r = r.clone();
        async move { r.started() == 1 }
    })
    .await;
    stop_a.send(true).unwrap();
    let (stop_b, rx) = watch::channel(false);
    let b = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..1).lease_duration(lease),
        slow(&runs, Duration::from_millis(1200)),
        rx,
    ));
    a.await.unwrap().unwrap();
    assert_eq!(
        queue.completed_count().await.unwrap(),
        1,
        "a's outcome applied"
    );
    // b gets the partition once a released it, and finds nothing left to run.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_b.send(true).unwrap();
    b.await.unwrap().unwrap();
    assert_eq!(runs.started(), 1, "the invocation ran once");
    assert_eq!(runs.peak(), 1);
    assert_eq!(queue.stats().outcome_failures, 0);
    assert_eq!(pending_total(&queue).await, 0);
}

fn cluster(name: &str, ttl: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .node_id(name)
        .node_ttl(ttl)
        .coordinator_ttl(ttl)
        .drop_after(ttl)
}

/// The cluster twin of defect 1: a node told to stop while a handler runs longer than its node
/// TTL keeps heartbeating, so the node that stays never takes the partition early.
pub async fn defect_1_a_draining_cluster_node_keeps_its_heartbeat<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let runs = Runs::default();
    let ttl = Duration::from_millis(300);
    let config = || WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(20));
    let (stop_a, rx) = watch::channel(false);
    let a = tokio::spawn(run_cluster_worker(
        queue.clone(),
        config(),
        cluster("a", ttl),
        slow(&runs, Duration::from_millis(1200)),
        rx,
    ));
    let q = queue.clone();
    wait_for(
        "a to hold the partition",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move {
                cluster_state(&q)
                    .await
                    .unwrap()
                    .leases
                    .get(&0)
                    .map(String::as_str)
                    == Some("a")
            }
        },
    )
    .await;
    let (stop_b, rx) = watch::channel(false);
    let b = tokio::spawn(run_cluster_worker(
        queue.clone(),
        config(),
        cluster("b", ttl),
        slow(&runs, Duration::from_millis(1200)),
        rx,
    ));
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let r = runs.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let r = r.clone();
        async move { r.started() == 1 }
    })
    .await;
    stop_a.send(true).unwrap();
    a.await.unwrap().unwrap();
    assert_eq!(
        queue.completed_count().await.unwrap(),
        1,
        "a's outcome applied"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_b.send(true).unwrap();
    b.await.unwrap().unwrap();
    assert_eq!(runs.started(), 1, "the invocation ran once");
    assert_eq!(queue.stats().outcome_failures, 0);
}

/// A transactional handler running 700 ms under a 900 ms lease (renewed every 300 ms) commits
/// on its first attempt: renewals do not touch the key its outcome transaction locks.
pub async fn defect_2_a_long_transactional_handler_commits_at_once<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1).lease_duration(Duration::from_millis(900)),
        move |_event: QueueEvent<Job>, _tx: E::Transaction| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(700)).await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    let q = queue.clone();
    wait_for("the acknowledgement", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().acknowledged == 1 }
    })
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one run, committed at once");
    assert_eq!(queue.stats().failed, 0);
    assert_eq!(queue.completed_count().await.unwrap(), 1);
}

/// Shutdown signalled before the worker starts: no lease taken, no pull, no handler.
pub async fn defect_3_shutdown_before_start_starts_nothing<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let runs = Runs::default();
    for cluster_mode in [false, true] {
        let (stop, rx) = watch::channel(false);
        stop.send(true).unwrap();
        let worker = if cluster_mode {
            run_cluster_worker(
                queue.clone(),
                fast(0..1),
                cluster("n", Duration::from_millis(300)),
                slow(&runs, Duration::ZERO),
                rx,
            )
        } else {
            run_worker(queue.clone(), fast(0..1), slow(&runs, Duration::ZERO), rx)
        };
        worker.await.unwrap();
        assert_eq!(runs.started(), 0);
        assert_eq!(queue.stats().delivered, 0);
        assert_eq!(
            read(&ctx.db, b"queue:lease:0000").await,
            None,
            "no lease taken"
        );
        assert_eq!(pending_total(&queue).await, 1);
    }
}

/// A handler that signals shutdown as it finishes: its outcome is applied and no other
/// invocation starts, although one is runnable and a slot is free.
pub async fn defect_3_shutdown_while_a_handler_finishes_starts_nothing_more<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    for n in 0..3 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    let started = Arc::new(AtomicUsize::new(0));
    let (stop, rx) = watch::channel(false);
    let stop = Arc::new(Mutex::new(Some(stop)));
    let (s, signal) = (started.clone(), stop.clone());
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..1).concurrency(1).page_size(1),
        move |_event: QueueEvent<Job>| {
            let (s, signal) = (s.clone(), signal.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                if let Some(stop) = signal.lock().unwrap().as_ref() {
                    stop.send(true).unwrap();
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    worker.await.unwrap().unwrap();
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "nothing started after shutdown"
    );
    assert_eq!(queue.completed_count().await.unwrap(), 1);
    assert_eq!(pending_total(&queue).await, 2);
}

/// A cluster node with a one-hour maintenance interval becomes coordinator and deletes expired
/// completed rows at once.
pub async fn defect_4_a_new_coordinator_runs_retention_at_once<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_millis(1)),
    ));
    for n in 0..3 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    // Complete them with a standalone worker whose only maintenance pass ran at its start.
    let runs = Runs::default();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..2).maintenance_interval(Duration::from_secs(3600)),
        slow(&runs, Duration::ZERO),
        rx,
    ));
    let q = queue.clone();
    wait_for(
        "three acknowledgements",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.stats().acknowledged == 3 }
        },
    )
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(queue.completed_count().await.unwrap(), 3);
    // A cluster node with the same hour-long interval is elected and runs retention at once.
    let (stop, rx) = watch::channel(false);
    let node = tokio::spawn(run_cluster_worker(
        queue.clone(),
        fast(0..2).maintenance_interval(Duration::from_secs(3600)),
        cluster("n", Duration::from_millis(300)),
        slow(&runs, Duration::ZERO),
        rx,
    ));
    let q = queue.clone();
    wait_for(
        "retention by the new coordinator",
        Duration::from_secs(10),
        move || {
            let q = q.clone();
            async move { q.completed_count().await.unwrap() == 0 }
        },
    )
    .await;
    stop.send(true).unwrap();
    node.await.unwrap().unwrap();
    assert!(queue.stats().expired >= 3);
}

/// Publishing one event id twice writes one invocation and runs the handler once; the id can
/// be published again once retention deleted its completed row.
pub async fn defect_6_an_event_id_is_published_once<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(4, Duration::from_millis(1)),
    ));
    let event = || QueueEvent::new("k", Job { n: 1 }, now()).with_id("order-7");
    let first = queue.publish(event()).await.unwrap();
    assert!(!first.duplicate);
    let second = queue.publish(event()).await.unwrap();
    assert!(second.duplicate);
    assert_eq!(second.key, first.key);
    // Inside a caller's transaction too, and a different key does not make it new.
    let tx = ctx.db.begin().await.unwrap();
    let third = queue
        .publish_in_tx(&event().rescheduled(now() + 60), &tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(third.duplicate);
    // Racing publications of a new id: one wins, the others are duplicates.
    let racers: Vec<_> = (0..4)
        .map(|_| {
            let q = queue.clone();
            tokio::spawn(async move {
                q.publish(QueueEvent::new("k", Job { n: 2 }, now()).with_id("race"))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut fresh = 0;
    for racer in racers {
        fresh += usize::from(!racer.await.unwrap().duplicate);
    }
    assert_eq!(fresh, 1);
    assert_eq!(pending_total(&queue).await, 2);
    assert_eq!(queue.stats().duplicates, 5);

    let runs = Runs::default();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..4).maintenance_interval(Duration::from_secs(3600)),
        slow(&runs, Duration::ZERO),
        rx,
    ));
    let q = queue.clone();
    wait_for("both events", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().acknowledged == 2 }
    })
    .await;
    // Completed and kept: still a duplicate.
    assert!(queue.publish(event()).await.unwrap().duplicate);
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(runs.started(), 2);
    // Retention deletes the completed rows and frees the ids.
    tokio::time::sleep(Duration::from_millis(5)).await;
    while queue.expire_completed().await.unwrap() > 0 {}
    assert!(!queue.publish(event()).await.unwrap().duplicate);
    assert_eq!(pending_total(&queue).await, 1);
}

/// Zero or absurd worker and cluster settings are refused before anything is written.
pub async fn defect_17_bad_worker_settings_are_refused<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 4);
    let runs = Runs::default();
    let cases: Vec<(WorkerConfig, &str)> = vec![
        (fast(0..4).lease_duration(Duration::ZERO), "lease_duration"),
        (
            fast(0..4).lease_duration(Duration::from_millis(1)),
            "lease_duration",
        ),
        (
            fast(0..4).handler_timeout(Duration::ZERO),
            "handler_timeout",
        ),
        (
            fast(0..4).maintenance_interval(Duration::ZERO),
            "maintenance_interval",
        ),
        (
            fast(0..4).max_idle_backoff(Duration::ZERO),
            "max_idle_backoff",
        ),
        (fast(0..0), "partitions"),
        (fast(4..8), "partitions"),
        (fast(0..4).worker_id(""), "worker_id"),
    ];
    for (config, name) in cases {
        let (_stop, rx) = watch::channel(false);
        let result = run_worker(queue.clone(), config, slow(&runs, Duration::ZERO), rx).await;
        match result {
            Err(TitoError::InvalidArgument(message)) => {
                assert!(message.contains(name), "{message} names {name}")
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    let mut zero = fast(0..4);
    zero.concurrency = 0;
    let (_stop, rx) = watch::channel(false);
    assert!(matches!(
        run_worker(queue.clone(), zero, slow(&runs, Duration::ZERO), rx).await,
        Err(TitoError::InvalidArgument(m)) if m.contains("concurrency")
    ));
    for (config, name) in [
        (cluster("n", Duration::ZERO), "node_ttl"),
        (
            cluster("n", Duration::from_secs(1)).coordinator_ttl(Duration::ZERO),
            "coordinator_ttl",
        ),
        (cluster("", Duration::from_secs(1)), "node_id"),
    ] {
        let (_stop, rx) = watch::channel(false);
        let result = run_cluster_worker(
            queue.clone(),
            fast(0..4),
            config,
            slow(&runs, Duration::ZERO),
            rx,
        )
        .await;
        assert!(
            matches!(&result, Err(TitoError::InvalidArgument(m)) if m.contains(name)),
            "{name}: {result:?}"
        );
    }
    assert_eq!(runs.started(), 0);
    let tx = ctx.db.begin().await.unwrap();
    assert!(
        tx.scan(b"queue", b"queue~", 10).await.unwrap().is_empty(),
        "nothing written"
    );
    tx.rollback().await.unwrap();
}
