//! The inbox: rows claimed and acknowledged per second, beside the raw engine's transaction
//! limit and the event queue draining the same number of events, on one embedded store.
//!
//! `cargo bench --bench inbox` (`TITO_BENCH_EVENTS` sets N, default 2000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::inbox::{Inbox, InboxConfig, InboxDelivery, InboxOutcome, run_inbox};
use tito::queue::run_worker;
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoModel, TitoTransaction,
    WorkerConfig,
};
use tokio::sync::watch;

#[derive(Default, Clone, Debug, Serialize, Deserialize)]
struct Email {
    to: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
struct EmailJob {
    id: String,
    #[tito(group)]
    queue: String,
    #[tito(priority)]
    priority: i64,
    #[tito(retry_after)]
    retry_after: i64,
    #[tito(attempt)]
    attempt: i64,
    #[tito(processed_at)]
    processed_at: Option<i64>,
    #[tito(locked_until)]
    locked_until: Option<i64>,
    #[tito(payload)]
    payload: Email,
}

fn events() -> u64 {
    std::env::var("TITO_BENCH_EVENTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

async fn open(durability: Durability) -> (tempfile::TempDir, Embedded) {
    let dir = tempfile::tempdir().unwrap();
    let db = Embedded::open_with(dir.path(), EmbeddedOptions::new().durability(durability))
        .await
        .unwrap();
    (dir, db)
}

async fn inbox_rate(db: &Embedded, n: u64) -> f64 {
    let jobs = db.clone().model::<EmailJob>();
    for i in 0..n {
        let job = EmailJob {
            id: format!("{i:08}"),
            queue: "email".into(),
            priority: (i % 3) as i64,
            payload: Email {
                to: format!("user{i}@example.com"),
            },
            ..Default::default()
        };
        jobs.build(job).await.unwrap();
    }
    let inbox = Arc::new(Inbox::<Embedded, EmailJob>::new(db.clone()).unwrap());
    let (stop, rx) = watch::channel(false);
    let started = Instant::now();
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        InboxConfig::new("email")
            .concurrency(64)
            .max_idle(Duration::from_millis(5)),
        |_delivery: InboxDelivery<Email>| async { Ok(InboxOutcome::Ack) },
        rx,
    ));
    while inbox.stats().completed < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    rate
}

async fn queue_rate(db: &Embedded, n: u64) -> f64 {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)),
    ));
    let due = chrono::Utc::now().timestamp();
    for i in 0..n {
        queue
            .publish(QueueEvent::new(
                format!("k{i}"),
                Email {
                    to: format!("user{i}@example.com"),
                },
                due,
            ))
            .await
            .unwrap();
    }
    let (stop, rx) = watch::channel(false);
    let started = Instant::now();
    let task = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..4).concurrency(64).page_size(64),
        |_event: QueueEvent<Email>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    while queue.stats().acknowledged < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    rate
}

async fn raw_limit(db: &Embedded, n: u64) -> f64 {
    let started = Instant::now();
    for i in 0..n {
        let tx = db.begin().await.unwrap();
        let key = format!("raw:{i:08}").into_bytes();
        let _ = tx.get(&key).await.unwrap();
        tx.put(key, br#"{"to":"user@example.com"}"#.to_vec())
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    n as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = events();
    println!("inbox: {n} rows claimed and acknowledged, 64 in flight, no-op handler");
    println!(
        "{:<10} {:>14} {:>16} {:>16} {:>10} {:>12}",
        "durability",
        "inbox rows/s",
        "queue events/s",
        "raw 1-key tx/s",
        "inbox/raw",
        "inbox/queue"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let (_a, db) = open(durability).await;
        let inbox = inbox_rate(&db, n).await;
        let (_b, qdb) = open(durability).await;
        let queue = queue_rate(&qdb, n).await;
        let (_c, rdb) = open(durability).await;
        let raw = raw_limit(&rdb, n.min(2000)).await;
        println!(
            "{label:<10} {inbox:>14.0} {queue:>16.0} {raw:>16.0} {:>10.2} {:>12.2}",
            inbox / raw,
            inbox / queue
        );
        for db in [db, qdb, rdb] {
            db.close().await.unwrap();
        }
    }
    println!(
        "(each inbox row costs two transactions, claim and outcome, each a model update with index upkeep)"
    );
}
