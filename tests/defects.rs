//! Regression tests for the defects found by adversarial use (one test per defect, named after
//! its number). Written once, run on every backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::inbox::{Inbox, InboxConfig, InboxModel, InboxOutcome};
use tito::kv::Kv;
use tito::model::{
    TitoEventConfig, TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait,
    TitoOperation, TitoOptions,
};
use tito::queue::{
    ClusterConfig, cluster_state, run_cluster_worker, run_transactional_worker, run_worker,
};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel,
    TitoTransaction, WorkerConfig,
};
use tokio::sync::watch;

use crate::support::{Ctx, now, pending_total, queue, read, wait_for};

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
                a_new_coordinator_runs_retention_at_once_and_counts_it,
                defect_6_an_event_id_is_published_once,
                defect_17_bad_worker_settings_are_refused,
                defect_17_a_far_future_event_does_not_stop_the_worker,
                defect_7_a_row_dependent_unique_condition_releases_its_claim,
                defect_8_tables_sharing_an_index_name_never_collide,
                defect_9_an_index_through_an_array_of_objects_finds_rows,
                defect_11_a_table_scan_with_reversed_bounds_is_refused,
                defect_12_a_set_aside_row_blocks_neither_claims_nor_scans,
                defect_13_without_locked_until_a_row_is_handed_out_once,
                defect_14_claims_reach_rows_behind_many_processed_rows,
                defect_15_timestamps_can_be_kept,
                defect_16_a_listing_that_stops_early_returns_a_cursor,
                defect_17_bad_inbox_kv_and_event_settings_are_refused,
                defect_18_oversized_keys_and_values_are_refused,
                defect_19_handler_errors_carry_their_source,
                defect_20_a_failing_handler_backs_off_without_holding_others,
            ]
        );
    };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Job {
    n: u32,
}

fn fast(partitions: std::ops::Range<u32>) -> WorkerConfig {
    WorkerConfig::new(partitions).max_idle_backoff(Duration::from_millis(20))
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

    /// Waits until `n` runs have started.
    async fn wait_started(&self, n: usize) {
        let runs = self.clone();
        wait_for("handler starts", Duration::from_secs(30), move || {
            let runs = runs.clone();
            async move { runs.started() == n }
        })
        .await;
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
    let (stop_a, a) = start_slow(
        &queue,
        fast(0..1).lease_duration(lease),
        &runs,
        Duration::from_millis(1200),
    );
    runs.wait_started(1).await;
    stop_a.send(true).unwrap();
    let (stop_b, b) = start_slow(
        &queue,
        fast(0..1).lease_duration(lease),
        &runs,
        Duration::from_millis(1200),
    );
    handed_over_once(&queue, &runs, a, stop_b, b).await;
    assert_eq!(queue.stats().outcome_failures, 0);
    assert_eq!(pending_total(&queue).await, 0);
}

type Worker = tokio::task::JoinHandle<tito::TitoResult<()>>;

/// Spawns a standalone worker whose handler runs for `length`, counted in `runs`; returns its
/// stop signal and task.
fn start_slow<E: TitoEngine>(
    queue: &Arc<Queue<E>>,
    config: WorkerConfig,
    runs: &Runs,
    length: Duration,
) -> (watch::Sender<bool>, Worker) {
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_worker(queue.clone(), config, slow(runs, length), rx));
    (stop, task)
}

/// Waits for the draining worker `a` (its outcome applied), lets `b` (which takes the
/// partition once `a` released it) look for work a moment, stops it, and checks that the
/// invocation ran once, never twice at a time.
async fn handed_over_once<E: TitoEngine>(
    queue: &Queue<E>,
    runs: &Runs,
    a: Worker,
    stop_b: watch::Sender<bool>,
    b: Worker,
) {
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
    assert_eq!(runs.peak(), 1);
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
    runs.wait_started(1).await;
    stop_a.send(true).unwrap();
    handed_over_once(&queue, &runs, a, stop_b, b).await;
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
/// completed rows at once; once the node has returned, the queue handle's `expired` counter
/// holds every row its maintenance deleted (a pass in progress at shutdown is finished and
/// counted, not cut short after its commit).
pub async fn a_new_coordinator_runs_retention_at_once_and_counts_it<E: TitoEngine>(ctx: Ctx<E>) {
    // The first handle keeps completed rows an hour, so its worker's maintenance deletes none
    // however late its pass runs; the second, on the same store, keeps them 1 ms.
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)),
    ));
    for n in 0..3 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    // Complete them with a standalone worker.
    let runs = Runs::default();
    let (stop, worker) = start_slow(
        &queue,
        fast(0..2).maintenance_interval(Duration::from_secs(3600)),
        &runs,
        Duration::ZERO,
    );
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
    assert_eq!(queue.completed_count().await.unwrap(), 3);
    // Past the 1 ms retention: without the pause an election that follows the last completion
    // within the same millisecond rightly keeps the rows it finds too young.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_millis(1)),
    ));
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
    assert_eq!(queue.stats().expired, 3);
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
    let (stop, worker) = start_slow(
        &queue,
        fast(0..4).maintenance_interval(Duration::from_secs(3600)),
        &runs,
        Duration::ZERO,
    );
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

/// An event due in the far future (a huge but valid timestamp) neither crashes the worker's
/// timers nor delays the runnable work beside it.
pub async fn defect_17_a_far_future_event_does_not_stop_the_worker<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 0 }, i64::MAX / 1000))
        .await
        .unwrap();
    let runs = Runs::default();
    let (stop, worker) = start_slow(
        &queue,
        fast(0..1).max_idle_backoff(Duration::from_millis(50)),
        &runs,
        Duration::ZERO,
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    runs.wait_started(1).await;
    stop.send(true).unwrap();
    worker.await.expect("the worker did not panic").unwrap();
    assert_eq!(pending_total(&queue).await, 1, "the far-future event waits");
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
        (fast(0..4).lease_duration(Duration::MAX), "lease_duration"),
        (
            fast(0..4).max_idle_backoff(Duration::MAX),
            "max_idle_backoff",
        ),
        (
            fast(0..4).maintenance_interval(Duration::MAX),
            "maintenance_interval",
        ),
        (fast(0..4).handler_timeout(Duration::MAX), "handler_timeout"),
        // An outcome window past a third of the lease (15 s by default), or absurd.
        (
            fast(0..4).outcome_delay(Duration::from_millis(5001)),
            "outcome_delay",
        ),
        (fast(0..4).outcome_delay(Duration::MAX), "outcome_delay"),
    ];
    assert!(
        fast(0..4)
            .outcome_delay(Duration::from_secs(5))
            .check(4)
            .is_ok(),
        "a window of a third of the lease is accepted"
    );
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
        (cluster("n", Duration::MAX), "node_ttl"),
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

/// An index over one field (a dotted path reaches into objects), for rows where `condition`.
fn index(name: &str, path: &str, kind: TitoIndexBlockType, condition: bool) -> TitoIndexConfig {
    TitoIndexConfig {
        condition,
        name: name.into(),
        fields: vec![TitoIndexField {
            name: path.into(),
            r#type: kind,
        }],
    }
}

/// A handle whose uniqueness only binds active accounts: the condition depends on the row.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Account {
    id: String,
    handle: String,
    active: bool,
}

impl TitoModelTrait for Account {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "account".into()
    }
    fn unique_indexes(&self) -> Vec<TitoIndexConfig> {
        vec![index(
            "by_handle",
            "handle",
            TitoIndexBlockType::String,
            self.active,
        )]
    }
}

fn account(id: &str, handle: &str, active: bool) -> Account {
    Account {
        id: id.into(),
        handle: handle.into(),
        active,
    }
}

pub async fn defect_7_a_row_dependent_unique_condition_releases_its_claim<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let accounts = ctx.db.clone().model::<Account>();
    accounts.build(account("a", "ada", true)).await.unwrap();
    assert!(matches!(
        accounts.build(account("b", "ada", true)).await,
        Err(TitoError::UniqueViolation { .. })
    ));
    // Deleting the holder releases the claim (the condition is not evaluated on a default row).
    accounts.delete_by_id("a").await.unwrap();
    accounts.build(account("b", "ada", true)).await.unwrap();
    // Updating the holder so the condition turns false releases it too.
    accounts.update(account("b", "ada", false)).await.unwrap();
    accounts.build(account("c", "ada", true)).await.unwrap();
    // And back: b now collides with c, the holder.
    assert!(matches!(
        accounts.update(account("b", "ada", true)).await,
        Err(TitoError::UniqueViolation { owner, .. }) if owner == "c"
    ));
    let page = accounts
        .query_by_index("by_handle")
        .value("ada")
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items, vec![account("c", "ada", true)]);
    // Nothing is left behind once every row is gone.
    accounts.delete_by_id("b").await.unwrap();
    accounts.delete_by_id("c").await.unwrap();
    let tx = ctx.db.begin().await.unwrap();
    assert!(
        tx.scan(b"unique:", b"unique;", 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(tx.scan(b"index:", b"index;", 10).await.unwrap().is_empty());
    tx.rollback().await.unwrap();
}

/// Two tables that both declare `by_email` (unique) and `by_team`.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Member {
    id: String,
    email: String,
    team: String,
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Guest {
    id: String,
    email: String,
    team: String,
}

macro_rules! shared_names {
    ($model:ty, $table:literal) => {
        impl TitoModelTrait for $model {
            fn id(&self) -> String {
                self.id.clone()
            }
            fn table(&self) -> String {
                $table.into()
            }
            fn indexes(&self) -> Vec<TitoIndexConfig> {
                vec![index("by_team", "team", TitoIndexBlockType::String, true)]
            }
            fn unique_indexes(&self) -> Vec<TitoIndexConfig> {
                vec![index("by_email", "email", TitoIndexBlockType::String, true)]
            }
        }
    };
}
shared_names!(Member, "member");
shared_names!(Guest, "guest");

pub async fn defect_8_tables_sharing_an_index_name_never_collide<E: TitoEngine>(ctx: Ctx<E>) {
    let members: TitoModel<E, Member> = ctx.db.clone().model::<Member>();
    let guests: TitoModel<E, Guest> = ctx.db.clone().model::<Guest>();
    let member = |id: &str| Member {
        id: id.into(),
        email: "e@x".into(),
        team: "core".into(),
    };
    let guest = |id: &str| Guest {
        id: id.into(),
        email: "e@x".into(),
        team: "core".into(),
    };
    members.build(member("m1")).await.unwrap();
    // The same email in another table is another claim.
    guests.build(guest("g1")).await.unwrap();
    // Releasing the member's claim never frees the guest's, nor lets a guest take it twice.
    members.delete_by_id("m1").await.unwrap();
    assert!(matches!(
        guests.build(guest("g2")).await,
        Err(TitoError::UniqueViolation { owner, .. }) if owner == "g1"
    ));
    members.build(member("m2")).await.unwrap();
    // Each table's index holds its own rows only.
    let page = members
        .query_by_index("by_team")
        .value("core")
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items, vec![member("m2")]);
    let page = guests
        .query_by_index("by_email")
        .value("e@x")
        .execute()
        .await
        .unwrap();
    assert_eq!(page.items, vec![guest("g1")]);
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Comment {
    author_id: i64,
    text: String,
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Post {
    id: String,
    comments: Vec<Comment>,
}

impl TitoModelTrait for Post {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "post".into()
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![index(
            "by_commenter",
            "comments.author_id",
            TitoIndexBlockType::Integer,
            true,
        )]
    }
}

pub async fn defect_9_an_index_through_an_array_of_objects_finds_rows<E: TitoEngine>(ctx: Ctx<E>) {
    let posts = ctx.db.clone().model::<Post>();
    let comment = |author_id: i64| Comment {
        author_id,
        text: "hi".into(),
    };
    posts
        .build(Post {
            id: "p1".into(),
            comments: vec![comment(1), comment(2), comment(1)],
        })
        .await
        .unwrap();
    posts
        .build(Post {
            id: "p2".into(),
            comments: vec![comment(2)],
        })
        .await
        .unwrap();
    let by = |author: i64| {
        let posts = posts.clone();
        async move {
            let page = posts
                .query_by_index("by_commenter")
                .value(&author)
                .execute()
                .await
                .unwrap();
            page.items.into_iter().map(|p| p.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(by(1).await, ["p1"]);
    assert_eq!(by(2).await, ["p1", "p2"]);
    assert!(by(3).await.is_empty());
    // An update that drops the author's comments drops the entry.
    posts
        .update(Post {
            id: "p1".into(),
            comments: vec![comment(3)],
        })
        .await
        .unwrap();
    assert!(by(1).await.is_empty());
    assert_eq!(by(3).await, ["p1"]);
}

pub async fn defect_11_a_table_scan_with_reversed_bounds_is_refused<E: TitoEngine>(ctx: Ctx<E>) {
    let accounts = ctx.db.clone().model::<Account>();
    accounts.build(account("a", "ada", true)).await.unwrap();
    let result = accounts.find().start("m").end("b").execute().await;
    assert!(
        matches!(&result, Err(TitoError::InvalidArgument(m)) if m.contains("start")),
        "{result:?}"
    );
    let equal = accounts.find().start("b").end("b").execute().await;
    assert!(matches!(equal, Err(TitoError::InvalidArgument(_))));
    assert_eq!(
        accounts
            .find()
            .start("a")
            .end("b")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

/// An inbox without ordering roles (claims walk the table) and without a lease role.
#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "task")]
struct Task {
    id: String,
    #[tito(processed_at)]
    processed_at: Option<i64>,
    #[tito(payload)]
    body: serde_json::Value,
}

fn task(id: &str, body: serde_json::Value) -> Task {
    Task {
        id: id.into(),
        processed_at: None,
        body,
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
struct Body {
    n: u32,
}

pub async fn defect_12_a_set_aside_row_blocks_neither_claims_nor_scans<E: TitoEngine>(ctx: Ctx<E>) {
    let tasks = ctx.db.clone().model::<Task>();
    // A row the model reads, whose payload is not a `Body`: set aside at its first claim.
    tasks
        .build(task("a", serde_json::json!("oops")))
        .await
        .unwrap();
    tasks
        .build(task("b", serde_json::json!({"n": 1})))
        .await
        .unwrap();
    let inbox = Inbox::<E, Task>::new(ctx.db.clone()).unwrap();
    let config = InboxConfig::new("");
    let claimed = inbox.claim::<Body>(&config, 10).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].1.payload, Body { n: 1 });
    assert_eq!(inbox.bad_rows().await.unwrap(), ["a"]);
    // The marker is not in the table: scans and later claims work.
    let page = tasks.find().execute().await.unwrap();
    assert_eq!(page.items.len(), 2);
    tasks
        .build(task("c", serde_json::json!({"n": 2})))
        .await
        .unwrap();
    let claimed = inbox.claim::<Body>(&config, 10).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    assert_eq!(claimed[0].1.id, "c");
}

pub async fn defect_13_without_locked_until_a_row_is_handed_out_once<E: TitoEngine>(ctx: Ctx<E>) {
    assert!(Task::inbox_spec().locked_until.is_none());
    let tasks = ctx.db.clone().model::<Task>();
    tasks
        .build(task("a", serde_json::json!({"n": 1})))
        .await
        .unwrap();
    let inbox = Arc::new(Inbox::<E, Task>::new(ctx.db.clone()).unwrap());
    let config = Arc::new(InboxConfig::new("").lease(Duration::from_millis(400)));
    // Racing claims: one wins.
    let racers: Vec<_> = (0..4)
        .map(|_| {
            let (inbox, config) = (inbox.clone(), config.clone());
            tokio::spawn(async move { inbox.claim::<Body>(&config, 1).await.unwrap().len() })
        })
        .collect();
    let mut total = 0;
    for racer in racers {
        total += racer.await.unwrap();
    }
    assert_eq!(total, 1);
    // While the claim lives, nobody else gets the row.
    assert!(inbox.claim::<Body>(&config, 1).await.unwrap().is_empty());
    // After it lapses, it is claimable again; the stale claim's outcome is refused.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let again = inbox.claim::<Body>(&config, 1).await.unwrap();
    assert_eq!(again.len(), 1);
    let (claim, _) = &again[0];
    assert!(
        inbox
            .complete(&config, claim, InboxOutcome::Ack)
            .await
            .unwrap()
    );
    assert!(
        tasks
            .find_by_id("a", vec![])
            .await
            .unwrap()
            .processed_at
            .is_some()
    );
    let tx = ctx.db.begin().await.unwrap();
    assert!(
        tx.scan(b"inbox-lease:", b"inbox-lease;", 10)
            .await
            .unwrap()
            .is_empty(),
        "the lease key goes with the outcome"
    );
    tx.rollback().await.unwrap();
}

pub async fn defect_14_claims_reach_rows_behind_many_processed_rows<E: TitoEngine>(ctx: Ctx<E>) {
    let tasks = ctx.db.clone().model::<Task>();
    // More processed rows than one claim may read, all before the ready one in table order.
    let processed = tito::inbox::CLAIM_SCANS * tito::inbox::CLAIM_SCAN_ROWS + 40;
    for chunk in (0..processed).collect::<Vec<_>>().chunks(200) {
        let (tasks, chunk) = (tasks.clone(), chunk.to_vec());
        ctx.db
            .transaction(|tx| {
                let (tasks, chunk) = (tasks.clone(), chunk.clone());
                async move {
                    for n in chunk {
                        let mut done = task(&format!("a{n:05}"), serde_json::json!({"n": 0}));
                        done.processed_at = Some(1);
                        tasks
                            .build_with_options(done, TitoOptions::default(), &tx)
                            .await?;
                    }
                    Ok::<_, TitoError>(())
                }
            })
            .await
            .unwrap();
    }
    tasks
        .build(task("z", serde_json::json!({"n": 9})))
        .await
        .unwrap();
    let inbox = Inbox::<E, Task>::new(ctx.db.clone()).unwrap();
    let config = InboxConfig::new("");
    let mut found = None;
    for _ in 0..4 {
        if let Some((_, delivery)) = inbox.claim::<Body>(&config, 1).await.unwrap().pop() {
            found = Some(delivery.id);
            break;
        }
    }
    assert_eq!(found.as_deref(), Some("z"));
}

/// Times the model serializes, kept as given only when asked.
#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "imported")]
#[tito(manual_timestamps)]
struct Imported {
    id: String,
    created_at: i64,
    updated_at: i64,
}

#[derive(tito::TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "stamped")]
struct Stamped {
    id: String,
    created_at: i64,
    updated_at: i64,
}

pub async fn defect_15_timestamps_can_be_kept<E: TitoEngine>(ctx: Ctx<E>) {
    let old = 1_000_000_000;
    // Per model: never set.
    let imported = ctx.db.clone().model::<Imported>();
    let row = Imported {
        id: "i".into(),
        created_at: old,
        updated_at: old + 1,
    };
    assert_eq!(imported.build(row.clone()).await.unwrap(), row);
    assert_eq!(imported.find_by_id("i", vec![]).await.unwrap(), row);
    // Per write: kept for this write only.
    let stamped = ctx.db.clone().model::<Stamped>();
    let given = Stamped {
        id: "s".into(),
        created_at: old,
        updated_at: old + 1,
    };
    let kept = ctx
        .db
        .transaction(|tx| {
            let (stamped, given) = (stamped.clone(), given.clone());
            async move {
                stamped
                    .build_with_options(given, TitoOptions::default().keeping_timestamps(), &tx)
                    .await
            }
        })
        .await
        .unwrap();
    assert_eq!(kept, given);
    assert_eq!(stamped.find_by_id("s", vec![]).await.unwrap(), given);
    // Without the option, an update stamps `updated_at` and keeps the stored `created_at`.
    let updated = stamped.update(given.clone()).await.unwrap();
    assert_eq!(updated.created_at, old);
    assert!(updated.updated_at > old + 1);
}

pub async fn defect_16_a_listing_that_stops_early_returns_a_cursor<E: TitoEngine>(ctx: Ctx<E>) {
    let kv = Kv::new(ctx.db.clone());
    let ns = "defect16";
    for n in 0..40 {
        kv.put(
            ns,
            &format!("a{n:03}"),
            &n,
            None,
            Some(Duration::from_millis(1)),
        )
        .await
        .unwrap();
    }
    kv.put(ns, "z", &"live", None, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut cursor: Option<String> = None;
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let page = kv.list(ns, "", 1, cursor.as_deref()).await.unwrap();
        pages += 1;
        seen.extend(page.entries.into_iter().map(|e| e.key));
        cursor = page.cursor;
        if cursor.is_none() {
            break;
        }
        assert!(pages < 100, "the listing makes progress");
    }
    assert_eq!(seen, ["z"], "after {pages} pages");
    assert!(pages > 1, "the expired keys took more than one page");
}

/// A model whose event names no queue.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Unnamed {
    id: String,
}

impl TitoModelTrait for Unnamed {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "unnamed".into()
    }
    fn events(&self) -> Vec<TitoEventConfig> {
        vec![TitoEventConfig {
            name: String::new(),
            timestamp: 0,
        }]
    }
}

pub async fn defect_17_bad_inbox_kv_and_event_settings_are_refused<E: TitoEngine>(ctx: Ctx<E>) {
    // Inbox leases.
    let tasks = ctx.db.clone().model::<Task>();
    tasks
        .build(task("a", serde_json::json!({"n": 1})))
        .await
        .unwrap();
    let inbox = Inbox::<E, Task>::new(ctx.db.clone()).unwrap();
    for config in [
        InboxConfig::new("").lease(Duration::ZERO),
        InboxConfig::new("").lease(Duration::from_millis(2)),
        InboxConfig::new("").max_idle(Duration::ZERO),
        InboxConfig::new("").lease(Duration::MAX),
        InboxConfig::new("").max_idle(Duration::MAX),
    ] {
        let result = inbox.claim::<Body>(&config, 1).await;
        assert!(
            matches!(result, Err(TitoError::InvalidArgument(_))),
            "{result:?}"
        );
    }
    // A huge retry delay saturates: the row is not claimable again, nothing overflows.
    let config = InboxConfig::new("");
    let (claim, _) = inbox
        .claim::<Body>(&config, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    // (Task has no retry_after role: a delay is refused, not turned into a retry at once.)
    assert!(matches!(
        inbox
            .complete(&config, &claim, InboxOutcome::RetryAfter(Duration::MAX))
            .await,
        Err(TitoError::InvalidArgument(_))
    ));
    assert!(
        inbox
            .complete(&config, &claim, InboxOutcome::Retry)
            .await
            .unwrap()
    );
    assert_eq!(inbox.claim::<Body>(&config, 1).await.unwrap().len(), 1);

    // Kv TTLs under one millisecond.
    let kv = Kv::new(ctx.db.clone());
    for ttl in [Duration::ZERO, Duration::from_micros(500)] {
        let result = kv.put_if_absent("d17", "k", &1, Some(ttl)).await;
        assert!(
            matches!(result, Err(TitoError::InvalidArgument(_))),
            "{result:?}"
        );
    }
    assert!(kv.get("d17", "k").await.unwrap().is_none());

    // A model event with an empty queue name: refused before anything is written.
    let unnamed = ctx.db.clone().model::<Unnamed>();
    let result = ctx
        .db
        .transaction(|tx| {
            let unnamed = unnamed.clone();
            async move {
                unnamed
                    .build_with_options(
                        Unnamed { id: "u".into() },
                        TitoOptions::with_events(TitoOperation::Insert),
                        &tx,
                    )
                    .await
            }
        })
        .await;
    assert!(
        matches!(&result, Err(TitoError::InvalidArgument(m)) if m.contains("empty queue name")),
        "{result:?}"
    );
    assert!(matches!(
        unnamed.find_by_id("u", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
}

/// A model with a free-form indexed field, to make keys and values too big.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Blob {
    id: String,
    tag: String,
    data: String,
}

impl TitoModelTrait for Blob {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "blob".into()
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![index("by_tag", "tag", TitoIndexBlockType::String, true)]
    }
}

pub async fn defect_18_oversized_keys_and_values_are_refused<E: TitoEngine>(ctx: Ctx<E>) {
    let blobs = ctx.db.clone().model::<Blob>();
    let big_key = "k".repeat(tito::engine::MAX_KEY_BYTES);
    let cases = [
        (
            Blob {
                id: big_key.clone(),
                ..Default::default()
            },
            "MAX_KEY_BYTES",
        ),
        (
            Blob {
                id: "t".into(),
                tag: big_key.clone(),
                ..Default::default()
            },
            "MAX_KEY_BYTES",
        ),
        (
            Blob {
                id: "v".into(),
                data: "x".repeat(tito::engine::MAX_VALUE_BYTES),
                ..Default::default()
            },
            "MAX_VALUE_BYTES",
        ),
    ];
    for (blob, limit) in cases {
        let result = blobs.build(blob).await;
        assert!(
            matches!(&result, Err(TitoError::InvalidArgument(m)) if m.contains(limit)),
            "{result:?}"
        );
    }
    // The tag's prefix is named in the error; nothing was written.
    let tx = ctx.db.begin().await.unwrap();
    assert!(tx.scan(b"table:", b"table;", 10).await.unwrap().is_empty());
    assert!(tx.scan(b"index:", b"index;", 10).await.unwrap().is_empty());
    // The raw engine refuses the same, at `put`.
    let result = tx
        .put(vec![b'k'; tito::engine::MAX_KEY_BYTES + 1], Vec::new())
        .await;
    assert!(matches!(result, Err(TitoError::InvalidArgument(_))));
    let result = tx.put(Vec::new(), Vec::new()).await;
    assert!(matches!(result, Err(TitoError::InvalidArgument(_))));
    tx.rollback().await.unwrap();
    // At the limits, it works.
    blobs
        .build(Blob {
            id: "ok".into(),
            tag: "t".repeat(1000),
            data: "x".repeat(1024 * 1024),
        })
        .await
        .unwrap();
}

#[derive(Debug)]
struct MailDown;

impl std::fmt::Display for MailDown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mail server unavailable")
    }
}

impl std::error::Error for MailDown {}

fn send_mail() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    Err(Box::new(MailDown))
}

pub async fn defect_19_handler_errors_carry_their_source<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..1),
        |_event: QueueEvent<Job>| async move {
            // `?` on an application's boxed error, and `TitoError::handler` on any other.
            send_mail()?;
            Err::<QueueHandlerOutcome<Job>, _>(TitoError::handler(MailDown))
        },
        rx,
    ));
    let q = queue.clone();
    wait_for("a failed handler", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().failed >= 1 }
    })
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    // The stats are a snapshot of plain numbers (defect 20).
    let stats: tito::QueueStats = queue.stats();
    assert!(stats.failed >= 1 && stats.delivered >= 1 && stats.acknowledged == 0);
    assert_eq!(pending_total(&queue).await, 1);
    let err = TitoError::from(send_mail().unwrap_err());
    assert!(matches!(err, TitoError::Handler { .. }));
    assert_eq!(
        std::error::Error::source(&err).map(ToString::to_string),
        Some("mail server unavailable".to_string())
    );
}

/// A handler that fails every time used to be started again at once, thousands of times a
/// second (its invocation stays due). The worker now waits before starting it again (50 ms,
/// doubling up to `max_idle_backoff`), and the wait holds only that invocation: another one
/// published meanwhile runs at once. Once the handler succeeds the invocation completes.
pub async fn defect_20_a_failing_handler_backs_off_without_holding_others<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 0 }, now()).with_id("poison"))
        .await
        .unwrap();
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let poison_runs = Arc::new(AtomicUsize::new(0));
    let other_done = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (failing, poison_runs, other_done) =
            (failing.clone(), poison_runs.clone(), other_done.clone());
        move |event: QueueEvent<Job>| {
            let (failing, poison_runs, other_done) =
                (failing.clone(), poison_runs.clone(), other_done.clone());
            async move {
                if event.id == "poison" {
                    poison_runs.fetch_add(1, Ordering::SeqCst);
                    if failing.load(Ordering::SeqCst) {
                        return Err(tito::TitoError::handler("always fails"));
                    }
                } else {
                    other_done.fetch_add(1, Ordering::SeqCst);
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    let (stop, rx) = watch::channel(false);
    let config = WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(100));
    let worker = tokio::spawn(run_worker(queue.clone(), config, handler, rx));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another invocation is not held back by the failing one's pause.
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()).with_id("fine"))
        .await
        .unwrap();
    let done = other_done.clone();
    wait_for("the other invocation", Duration::from_secs(10), move || {
        let done = done.clone();
        async move { done.load(Ordering::SeqCst) == 1 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs = poison_runs.load(Ordering::SeqCst);
    // About 600 ms of failing at 50, 100, 100... ms apart: a handful, never thousands.
    assert!(
        (2..=20).contains(&runs),
        "the failing handler ran {runs} times in 600 ms"
    );
    failing.store(false, Ordering::SeqCst);
    let q = queue.clone();
    wait_for(
        "the invocation to complete",
        Duration::from_secs(10),
        move || {
            let q = q.clone();
            async move { pending_total(&q).await == 0 }
        },
    )
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert!(queue.stats().failed as usize >= runs - 1);
}
