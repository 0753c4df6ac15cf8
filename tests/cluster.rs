//! Queue cluster mode with several nodes in one process: join, leave, crash, coordinator
//! failover, a rebalance under load, and injected lease conflicts and unknown outcomes.
//! Written once, run on every backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::queue::{ClusterConfig, cluster_state, run_cluster_worker};
use tito::{Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, WorkerConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::{Ctx, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! cluster_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            cluster,
            [
                nodes_join_and_leave_moving_only_their_partitions,
                a_crashed_node_is_replaced_within_its_ttl,
                the_coordinator_fails_over,
                a_rebalance_under_load_loses_and_repeats_nothing,
                lease_conflicts_and_unknown_outcomes_converge,
            ]
        );
    };
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    n: u32,
}

const PARTITIONS: u32 = 16;

/// Short enough that a crash is noticed within seconds, long enough that a runtime stalled for
/// a moment on a loaded machine (the whole suite runs at once) does not drop a live node.
fn cluster_config(name: &str) -> ClusterConfig {
    ClusterConfig::new()
        .node_id(name)
        .node_ttl(Duration::from_secs(2))
        .coordinator_ttl(Duration::from_secs(2))
        .drop_after(Duration::from_millis(600))
}

struct Node {
    stop: watch::Sender<bool>,
    task: JoinHandle<tito::TitoResult<()>>,
}

impl Node {
    async fn leave(self) {
        self.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the node stops")
            .unwrap()
            .expect("the node's configuration is valid");
    }

    /// Stops without releasing anything or saying goodbye.
    fn crash(self) {
        self.task.abort();
    }
}

type Handled = Arc<Mutex<HashMap<u32, usize>>>;

fn start<E: TitoEngine>(queue: &Arc<Queue<E>>, name: &str, handled: &Handled) -> Node {
    start_windowed(queue, name, handled, Duration::ZERO)
}

/// A node whose outcomes wait up to `window` to commit together.
fn start_windowed<E: TitoEngine>(
    queue: &Arc<Queue<E>>,
    name: &str,
    handled: &Handled,
    window: Duration,
) -> Node {
    let (stop, rx) = watch::channel(false);
    let handled = handled.clone();
    let task = tokio::spawn(run_cluster_worker(
        queue.clone(),
        WorkerConfig::new(0..0)
            .max_idle_backoff(Duration::from_millis(50))
            .outcome_delay(window),
        cluster_config(name),
        move |event: QueueEvent<Job>| {
            let handled = handled.clone();
            async move {
                *handled.lock().unwrap().entry(event.payload.n).or_default() += 1;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    Node { stop, task }
}

fn queue<E: TitoEngine>(db: &E) -> Arc<Queue<E>> {
    Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(PARTITIONS, Duration::from_secs(3600)),
    ))
}

/// Waits until the published members are `members` and every partition is leased to its
/// assigned member.
async fn settled<E: TitoEngine>(queue: &Arc<Queue<E>>, members: &[&str]) {
    let q = queue.clone();
    let want: Vec<String> = members.iter().map(|m| m.to_string()).collect();
    wait_for(
        &format!("the cluster to settle on {want:?}"),
        Duration::from_secs(30),
        move || {
            let (q, want) = (q.clone(), want.clone());
            async move {
                let state = cluster_state(&q).await.unwrap();
                state.members == want
                    && state.assignment.len() == PARTITIONS as usize
                    && state.leases == state.assignment
            }
        },
    )
    .await;
}

pub async fn nodes_join_and_leave_moving_only_their_partitions<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db);
    let handled: Handled = Arc::default();
    let a = start(&queue, "a", &handled);
    settled(&queue, &["a"]).await;
    let b = start(&queue, "b", &handled);
    settled(&queue, &["a", "b"]).await;
    let state = cluster_state(&queue).await.unwrap();
    // Defect 5: the join moved half the partitions to b (balanced: floor or ceil of P/2), and
    // exactly the ones the stored sticky assignment names; a kept all the others.
    let to_b: Vec<u32> = state
        .assignment
        .iter()
        .filter(|(_, m)| *m == "b")
        .map(|(p, _)| *p)
        .collect();
    let previous = vec![Some("a".to_string()); PARTITIONS as usize];
    let expected: Vec<u32> = tito::queue::cluster::balanced_assignment(
        &["a".to_string(), "b".to_string()],
        PARTITIONS,
        &previous,
    )
    .iter()
    .enumerate()
    .filter(|(_, m)| m.as_deref() == Some("b"))
    .map(|(p, _)| p as u32)
    .collect();
    assert_eq!(to_b, expected);
    assert!(
        to_b.len() == PARTITIONS as usize / 2 || to_b.len() == (PARTITIONS as usize).div_ceil(2),
        "{to_b:?}"
    );

    // Work runs on both.
    for n in 0..40 {
        queue
            .publish(QueueEvent::new(
                format!("key-{n}"),
                Job { n },
                chrono::Utc::now().timestamp(),
            ))
            .await
            .unwrap();
    }
    let h = handled.clone();
    wait_for("all events", Duration::from_secs(30), move || {
        let h = h.clone();
        async move { h.lock().unwrap().len() == 40 }
    })
    .await;

    b.leave().await;
    settled(&queue, &["a"]).await;
    a.leave().await;
    assert!(handled.lock().unwrap().values().all(|count| *count == 1));
}

pub async fn a_crashed_node_is_replaced_within_its_ttl<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db);
    let handled: Handled = Arc::default();
    let a = start(&queue, "a", &handled);
    let b = start(&queue, "b", &handled);
    settled(&queue, &["a", "b"]).await;
    b.crash();
    let started = tokio::time::Instant::now();
    settled(&queue, &["a"]).await;
    // Node TTL 2 s, ticks every 667 ms: well within a few seconds.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // The dead node's record is dropped after `drop_after`.
    let q = queue.clone();
    wait_for(
        "the dead record to go",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move {
                cluster_state(&q)
                    .await
                    .unwrap()
                    .nodes
                    .iter()
                    .all(|n| n.id != "b")
            }
        },
    )
    .await;
    a.leave().await;
}

pub async fn the_coordinator_fails_over<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db);
    let handled: Handled = Arc::default();
    let a = start(&queue, "a", &handled);
    settled(&queue, &["a"]).await;
    assert_eq!(
        cluster_state(&queue).await.unwrap().coordinator.as_deref(),
        Some("a")
    );
    let b = start(&queue, "b", &handled);
    settled(&queue, &["a", "b"]).await;
    a.crash();
    let q = queue.clone();
    wait_for("b to coordinate", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { cluster_state(&q).await.unwrap().coordinator.as_deref() == Some("b") }
    })
    .await;
    settled(&queue, &["b"]).await;
    b.leave().await;
}

pub async fn a_rebalance_under_load_loses_and_repeats_nothing<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db);
    let handled: Handled = Arc::default();
    let published = Arc::new(AtomicUsize::new(0));
    let publisher = {
        let (queue, published) = (queue.clone(), published.clone());
        tokio::spawn(async move {
            for n in 0..300u32 {
                queue
                    .publish(QueueEvent::new(
                        format!("key-{n}"),
                        Job { n },
                        chrono::Utc::now().timestamp(),
                    ))
                    .await
                    .unwrap();
                published.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    // b and c hold their outcomes in windows: b's leave commits what it holds, c's crash loses
    // what it holds (those handlers run again elsewhere).
    let a = start(&queue, "a", &handled);
    let b = start_windowed(&queue, "b", &handled, Duration::from_millis(50));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = start_windowed(&queue, "c", &handled, Duration::from_millis(200));
    tokio::time::sleep(Duration::from_millis(400)).await;
    b.leave().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.crash();
    publisher.await.unwrap();
    let q = queue.clone();
    wait_for(
        "every event completed",
        Duration::from_secs(60),
        move || {
            let q = q.clone();
            async move { q.completed_count().await.unwrap() == 300 }
        },
    )
    .await;
    a.leave().await;
    // Every event completed exactly once (a second completion of one invocation is impossible:
    // its pending row is gone), none is left, and every one reached a handler.
    let mut pending = 0;
    for p in 0..PARTITIONS {
        pending += queue.pending_count(p).await.unwrap();
    }
    assert_eq!(pending, 0);
    assert_eq!(queue.completed_count().await.unwrap(), 300);
    assert_eq!(handled.lock().unwrap().len(), 300);
    assert_eq!(published.load(Ordering::SeqCst), 300);
}

pub async fn lease_conflicts_and_unknown_outcomes_converge<E: TitoEngine>(ctx: Ctx<E>) {
    let faulty = FaultyEngine::new(ctx.db.clone());
    // Lease writes conflict (replayed), and some heartbeats come back with an unknown outcome.
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::Conflict)
            .when_key_starts_with("queue:lease")
            .times(5),
    );
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeCommitted)
            .when_key_starts_with("queue:node")
            .times(2),
    );
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeNotCommitted)
            .when_key_starts_with("queue:node")
            .skip(3)
            .times(2),
    );
    let queue = queue(&faulty);
    let handled: Handled = Arc::default();
    let a = start(&queue, "a", &handled);
    let b = start(&queue, "b", &handled);
    settled(&queue, &["a", "b"]).await;
    for n in 0..30 {
        queue
            .publish(QueueEvent::new(
                format!("key-{n}"),
                Job { n },
                chrono::Utc::now().timestamp(),
            ))
            .await
            .unwrap();
    }
    let q = queue.clone();
    wait_for(
        "every event completed",
        Duration::from_secs(60),
        move || {
            let q = q.clone();
            async move { q.completed_count().await.unwrap() == 30 }
        },
    )
    .await;
    a.leave().await;
    b.leave().await;
    assert!(faulty.faults().injected() >= 5);
    assert_eq!(handled.lock().unwrap().len(), 30);
}
