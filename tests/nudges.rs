//! Waking workers in other processes (`tito::queue`, "Waking workers in other processes"): on
//! TiKV a commit in one process nudges the idle workers of another over UDP, so new work starts
//! there without waiting for a poll; nudges carry no data, and a flood of forged or malformed
//! ones costs bounded work and runs nothing twice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tito::backend::tikv::{TiKV, TiKVOptions};
use tito::{QueueEvent, QueueHandlerOutcome, TitoEngine, TitoTransaction, WorkerConfig, Workers};

use crate::support::test_server_ctx;

/// Another process's handle on the same cluster: its own client, socket and wake-ups.
async fn other_process(pd: Vec<String>) -> TiKV {
    TiKV::connect_with(pd, TiKVOptions::default())
        .await
        .unwrap()
}

/// A worker on `db` whose idle polls back off to 60 s, reporting each start's event id and time.
fn slow_polling_worker(
    db: &TiKV,
) -> (
    Workers,
    tokio::sync::mpsc::UnboundedReceiver<(u64, Instant)>,
) {
    let queue = crate::support::queue(db, 2);
    let (started, starts) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue,
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_secs(60)),
        move |event: QueueEvent<u64>| {
            let started = started.clone();
            async move {
                let _ = started.send((event.payload, Instant::now()));
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    (workers, starts)
}

/// Where the worker of `db` listens, once it registered.
async fn listening_address(db: &TiKV) -> std::net::SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let tx = db.begin().await.unwrap();
        let rows = tx.scan(b"queue:nudge:", b"queue:nudge;", 10).await.unwrap();
        let _ = tx.rollback().await;
        if let Some((_, value)) = rows.first() {
            let value: serde_json::Value = serde_json::from_slice(value).unwrap();
            return value["address"].as_str().unwrap().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the worker never wrote its nudge address"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes `count` events one at a time from `publisher`, each after the last one started,
/// and returns each one's time from its publication's commit to its start.
async fn round_trips(
    publisher: &TiKV,
    starts: &mut tokio::sync::mpsc::UnboundedReceiver<(u64, Instant)>,
    first: u64,
    count: u64,
) -> Vec<Duration> {
    let queue = crate::support::queue(publisher, 2);
    let mut took = Vec::new();
    for i in first..first + count {
        // Idle between events, as a worker waiting for work is.
        tokio::time::sleep(Duration::from_millis(20)).await;
        queue
            .publish(QueueEvent::now(format!("k{i}"), i))
            .await
            .unwrap();
        let committed = Instant::now();
        let (payload, at) = tokio::time::timeout(Duration::from_secs(30), starts.recv())
            .await
            .expect("the event started (its nudge was lost, and the next poll is 60 s away)")
            .unwrap();
        assert_eq!(payload, i, "events start once, in order");
        took.push(at.saturating_duration_since(committed));
    }
    took
}

/// A worker polling every 60 s at most starts 20 events published one at a time in another
/// process, each within the test's bound: the nudges woke it, as its socket's figures say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_one_process_starts_work_in_another_without_a_poll() {
    let ctx = test_server_ctx().await;
    let pd = ctx.cluster.as_ref().unwrap().pd_endpoints();
    let worker_side = other_process(pd.clone()).await;
    let (workers, mut starts) = slow_polling_worker(&worker_side);
    listening_address(&worker_side).await;
    // The worker's first polls are done; from now on only nudges wake it early.
    tokio::time::sleep(Duration::from_millis(300)).await;
    round_trips(&ctx.db, &mut starts, 0, 20).await;
    let received = tito::queue::nudge_figures(&worker_side);
    assert!(received.received >= 20, "{received:?}");
    // Datagrams: nudges queued together share one.
    assert!(tito::queue::nudge_figures(&ctx.db).sent > 0);
    workers.shutdown().await.unwrap();
    // A stopped worker takes its address out of the store.
    let tx = ctx.db.begin().await.unwrap();
    let rows = tx.scan(b"queue:nudge:", b"queue:nudge;", 10).await.unwrap();
    assert!(rows.is_empty(), "{rows:?}");
}

/// Forged, malformed and flooding datagrams: the receiver drops what is malformed or over its
/// rate, acts on at most its rate, and the queue still runs each event exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_flooding_nudges_cost_bounded_work_and_run_nothing_twice() {
    let ctx = test_server_ctx().await;
    let pd = ctx.cluster.as_ref().unwrap().pd_endpoints();
    let worker_side = other_process(pd.clone()).await;
    let (workers, mut starts) = slow_polling_worker(&worker_side);
    let address = listening_address(&worker_side).await;
    let attacker = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let flood_started = Instant::now();
    for i in 0..3000u32 {
        // Garbage, a wrong magic, a cut entry, then well-formed nudges for queues that exist
        // (the queue without a topic: its root hashed) and that do not.
        let datagrams: [Vec<u8>; 4] = [
            vec![0xff; (i % 700) as usize],
            b"XXXX0000000000000".to_vec(),
            b"TNu1\x00\x01".to_vec(),
            {
                let mut d = b"TNu1".to_vec();
                d.extend_from_slice(&tito::keys::fnv1a(b"queue").to_be_bytes());
                d.push(0);
                d.extend_from_slice(&(i % 2).to_be_bytes());
                d.extend_from_slice(&(i as u64).to_be_bytes());
                d.push(0);
                d.extend_from_slice(&7u32.to_be_bytes());
                d
            },
        ];
        for datagram in &datagrams {
            let _ = attacker.send_to(datagram, address);
        }
    }
    let flood = flood_started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let figures = tito::queue::nudge_figures(&worker_side);
    assert!(figures.dropped > 0, "{figures:?}");
    // The bucket holds RECEIVE_RATE entries and refills RECEIVE_RATE per second.
    let bound = tito::queue::RECEIVE_RATE as f64 * (1.0 + flood.as_secs_f64() + 0.3);
    assert!(
        (figures.received as f64) <= bound,
        "{figures:?} over {flood:?}"
    );
    // The queue still works, each event once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    round_trips(&ctx.db, &mut starts, 100, 5).await;
    workers.shutdown().await.unwrap();
    assert!(starts.try_recv().is_err(), "nothing ran twice");
}

/// Nudges off: no socket, and workers still run what other processes publish, at their polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nudges_work_waits_for_the_next_poll() {
    let ctx = test_server_ctx().await;
    let pd = ctx.cluster.as_ref().unwrap().pd_endpoints();
    let quiet = TiKV::connect_with(pd, TiKVOptions::default().no_nudges())
        .await
        .unwrap();
    let queue = crate::support::queue(&quiet, 2);
    let (started, mut starts) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue,
        WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(200)),
        move |event: QueueEvent<u64>| {
            let started = started.clone();
            async move {
                let _ = started.send(event.payload);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    crate::support::queue(&ctx.db, 2)
        .publish(QueueEvent::now("k", 7u64))
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(30), starts.recv())
        .await
        .unwrap();
    assert_eq!(got, Some(7));
    assert_eq!(tito::queue::nudge_figures(&quiet), Default::default());
    workers.shutdown().await.unwrap();
    let _ = Arc::new(());
}

/// `cargo test --release --test tito nudges::cross_process_wake_latency -- --ignored
/// --nocapture`: the time from a publication's commit to its start at an idle worker of
/// another handle (its own client and socket, as another process has), with nudges, beside
/// the same in one handle; p50 and p99 of 500 events each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it with --ignored --nocapture"]
async fn cross_process_wake_latency() {
    let ctx = test_server_ctx().await;
    let pd = ctx.cluster.as_ref().unwrap().pd_endpoints();
    let worker_side = other_process(pd.clone()).await;
    let (workers, mut starts) = slow_polling_worker(&worker_side);
    listening_address(&worker_side).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let across = round_trips(&ctx.db, &mut starts, 0, 500).await;
    let within = round_trips(&worker_side, &mut starts, 1000, 500).await;
    workers.shutdown().await.unwrap();
    let show = |name: &str, mut took: Vec<Duration>| {
        took.sort();
        let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
        println!(
            "{name}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} events; idle polls back off \
             to 60 s)",
            at(0.5).as_secs_f64() * 1e3,
            at(0.99).as_secs_f64() * 1e3,
            took.last().unwrap().as_secs_f64() * 1e3,
            took.len()
        );
    };
    show("another process's handle (nudged)", across);
    show("the same handle (woken in process)", within);
}
