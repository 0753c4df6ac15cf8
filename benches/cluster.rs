//! Queue cluster mode: balance and partitions moved per join and leave (the stored balanced,
//! sticky assignment beside rendezvous hashing alone and contiguous ranges over sorted node
//! ids), time from a node's crash to its partitions running elsewhere, and events per second
//! with 4 nodes beside 1 node on one embedded store.
//!
//! `cargo bench --bench cluster`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::queue::cluster::{balanced_assignment, rendezvous_owner};
use tito::queue::{ClusterConfig, cluster_state, run_cluster_worker};
use tito::{Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, WorkerConfig};
use tokio::sync::watch;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    n: u64,
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("pod-{i:02}-7f3a")).collect()
}

/// Contiguous ranges over the sorted node ids: node i gets partitions [i*P/n, (i+1)*P/n).
fn contiguous_owner(nodes: &[String], partitions: u32, partition: u32) -> String {
    let mut sorted = nodes.to_vec();
    sorted.sort();
    let index = (u64::from(partition) * sorted.len() as u64 / u64::from(partitions)) as usize;
    sorted[index].clone()
}

fn moved(before: &[String], after: &[String], partitions: u32, rendezvous: bool) -> usize {
    (0..partitions)
        .filter(|p| {
            if rendezvous {
                rendezvous_owner(before, *p) != rendezvous_owner(after, *p)
            } else {
                contiguous_owner(before, partitions, *p) != contiguous_owner(after, partitions, *p)
            }
        })
        .count()
}

/// The fewest and most partitions one node holds.
fn spread(owners: &[Option<String>], nodes: &[String]) -> (usize, usize) {
    let counts: Vec<usize> = nodes
        .iter()
        .map(|n| owners.iter().filter(|o| o.as_ref() == Some(n)).count())
        .collect();
    (
        counts.iter().copied().min().unwrap_or(0),
        counts.iter().copied().max().unwrap_or(0),
    )
}

fn changed(before: &[Option<String>], after: &[Option<String>]) -> usize {
    before.iter().zip(after).filter(|(a, b)| a != b).count()
}

/// Balance and moves of the three schemes for one partition count, nodes joining one by one
/// from 1 to 16, then the middle node leaving.
fn assignment_table(partitions: u32) {
    println!(
        "P = {partitions}: min-max partitions per node, and partitions moved by the join of the n-th node / the leave of a middle one"
    );
    println!(
        "{:>3} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11} {:>12}",
        "n",
        "sticky",
        "join",
        "leave",
        "rendezv.",
        "join",
        "leave",
        "ranges",
        "join",
        "leave",
        "ceil(P/n)"
    );
    let mut sticky: Vec<Option<String>> = Vec::new();
    for n in 2..=16usize {
        let before = names(n - 1);
        let after = names(n);
        if sticky.is_empty() {
            sticky = balanced_assignment(&before, partitions, &[]);
        }
        let joined = balanced_assignment(&after, partitions, &sticky);
        let mut without = after.clone();
        without.remove(n / 2);
        let left = balanced_assignment(&without, partitions, &joined);
        let rendezvous = |nodes: &[String]| -> Vec<Option<String>> {
            (0..partitions)
                .map(|p| rendezvous_owner(nodes, p).cloned())
                .collect()
        };
        let ranges = |nodes: &[String]| -> Vec<Option<String>> {
            (0..partitions)
                .map(|p| Some(contiguous_owner(nodes, partitions, p)))
                .collect()
        };
        let (lo, hi) = spread(&joined, &after);
        let (rlo, rhi) = spread(&rendezvous(&after), &after);
        let (clo, chi) = spread(&ranges(&after), &after);
        println!(
            "{n:>3} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11} {:>12}",
            format!("{lo}-{hi}"),
            changed(&sticky, &joined),
            changed(&joined, &left),
            format!("{rlo}-{rhi}"),
            moved(&before, &after, partitions, true),
            moved(&after, &without, partitions, true),
            format!("{clo}-{chi}"),
            moved(&before, &after, partitions, false),
            moved(&after, &without, partitions, false),
            (partitions as usize).div_ceil(n),
        );
        sticky = joined;
    }
}

fn node_config(name: &str, ttl: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .node_id(name)
        .node_ttl(ttl)
        .coordinator_ttl(ttl)
        .drop_after(ttl)
}

struct Running {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<tito::TitoResult<()>>,
}

fn start(queue: &Arc<Queue<Embedded>>, name: &str, ttl: Duration) -> Running {
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_cluster_worker(
        queue.clone(),
        WorkerConfig::new(0..0).concurrency(32).page_size(32),
        node_config(name, ttl),
        |_event: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    Running { stop, task }
}

async fn settled(queue: &Arc<Queue<Embedded>>, members: usize) {
    loop {
        let state = cluster_state(queue).await.unwrap();
        if state.members.len() == members
            && state.assignment.len() == queue.config().partitions as usize
            && state.leases == state.assignment
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn open() -> (tempfile::TempDir, Embedded) {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open_with(
        dir.path(),
        EmbeddedOptions::new().durability(Durability::Buffered),
    )
    .await
    .unwrap();
    (dir, db)
}

async fn throughput(nodes: usize, events: u64) -> f64 {
    let (_dir, db) = open().await;
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(64, Duration::from_secs(3600)),
    ));
    let ttl = Duration::from_secs(3);
    let running: Vec<Running> = (0..nodes)
        .map(|i| start(&queue, &format!("n{i}"), ttl))
        .collect();
    settled(&queue, nodes).await;
    let due = chrono::Utc::now().timestamp();
    let started = Instant::now();
    let publishers: Vec<_> = (0..4)
        .map(|t| {
            let queue = queue.clone();
            tokio::spawn(async move {
                for n in (t..events).step_by(4) {
                    queue
                        .publish(QueueEvent::new(format!("k{n}"), Job { n }, due))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for p in publishers {
        p.await.unwrap();
    }
    while queue.stats().acknowledged < events {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    for node in running {
        node.stop.send(true).unwrap();
        node.task.await.unwrap().unwrap();
    }
    db.close().await.unwrap();
    rate
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    for partitions in [4, 16, 1024] {
        assignment_table(partitions);
        println!();
    }

    // Crash to takeover.
    let ttl = Duration::from_secs(2);
    let (_dir, db) = open().await;
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(64, Duration::from_secs(3600)),
    ));
    let a = start(&queue, "a", ttl);
    let b = start(&queue, "b", ttl);
    settled(&queue, 2).await;
    let crashed = Instant::now();
    b.task.abort();
    settled(&queue, 1).await;
    println!(
        "crash to takeover: {:.2} s with a node TTL of {:.1} s (ticks every TTL/3)",
        crashed.elapsed().as_secs_f64(),
        ttl.as_secs_f64()
    );
    a.stop.send(true).unwrap();
    a.task.await.unwrap().unwrap();
    drop(b.stop);
    db.close().await.unwrap();

    let events = 4000;
    let one = throughput(1, events).await;
    let four = throughput(4, events).await;
    println!("end to end, {events} events, 64 partitions, one embedded store, 2 cores:");
    println!("  1 node  {one:>8.0} events/s");
    println!("  4 nodes {four:>8.0} events/s ({:.2}x)", four / one);
}
