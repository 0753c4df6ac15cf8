//! The queue end to end, beside the raw engine's transaction limit and a job table on SQLite.
//!
//! - throughput: publish N events (one transaction each), then run one worker until every
//!   event is completed; events per second for each phase and for both together;
//! - lateness: events due over the next seconds, time from due time to handler start (p50/p99);
//! - idle cost: storage scans per second of a worker holding 1024 empty partitions;
//! - commit to handler: from the end of a commit that published an event (a model write's, or a
//!   `publish`) to the start of its handler in an idle worker of the same process, idle and
//!   beside a steady load of other events; on the embedded (buffered) and memory engines.
//!
//! The peer is the job table applications hand-roll on SQLite through rusqlite (due index,
//! claim-and-complete in one transaction, polled by one task); apalis' SQLite backend pulls in
//! sqlx's own libsqlite3-sys, which cannot link beside rusqlite's in one build.
//!
//! `cargo bench --bench queue` (`TITO_BENCH_EVENTS` sets N, default 4000;
//! `TITO_BENCH_ONLY=latency` runs the commit-to-handler table alone, `TITO_BENCH_ONLY=limits`
//! the limits table alone,
//! `TITO_BENCH_LATENCY_SAMPLES` its events per cell, default 40).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::{Connection, params};
use serde::{Deserialize, Serialize};
use tito::backend::embedded::{Durability, Embedded, EmbeddedOptions};
use tito::queue::ModelEvent;
use tito::queue::{Limits, run_worker};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoModel, TitoTransaction,
    WorkerConfig,
};
use tokio::sync::{Mutex, watch};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    n: u64,
    body: String,
}

/// A row whose writes publish an event to queue `pings`.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(event = "pings")]
struct Ping {
    id: String,
}

/// The number in environment variable `name`, or `default`.
fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn events() -> u64 {
    env_number("TITO_BENCH_EVENTS", 4000)
}

fn job(n: u64) -> Job {
    Job {
        n,
        body: format!("send the welcome email to user {n}"),
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

async fn open(dir: &std::path::Path, durability: Durability) -> Embedded {
    Embedded::open_with(dir, EmbeddedOptions::new().durability(durability))
        .await
        .unwrap()
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Raw engine: one-key write transactions per second (the limit a queue row write meets).
async fn raw_limit(db: &Embedded, n: u64) -> f64 {
    let start = Instant::now();
    for i in 0..n {
        let tx = db.begin().await.unwrap();
        tx.put(
            format!("raw:{i:012}").into_bytes(),
            serde_json::to_vec(&job(i)).unwrap(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

struct Throughput {
    publish: f64,
    drain: f64,
    end_to_end: f64,
}

async fn tito_throughput(db: &Embedded, n: u64) -> Throughput {
    let run = Run {
        partitions: 4,
        concurrency: 64,
        many: false,
        delay: Duration::ZERO,
    };
    queue_run(db, "throughput", n, run).await
}

async fn tito_lateness(db: &Embedded) -> (i64, i64) {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(16, Duration::from_secs(3600)).topic("lateness"),
    ));
    let lateness: Arc<Mutex<Vec<i64>>> = Arc::default();
    let log = lateness.clone();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..16),
        move |event: QueueEvent<Job>| {
            let log = log.clone();
            async move {
                log.lock().await.push(now_ms() - event.timestamp * 1000);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    let base = chrono::Utc::now().timestamp() + 1;
    let count = 300;
    for i in 0..count {
        queue
            .publish(QueueEvent::new(
                format!("user:{i}"),
                job(i),
                base + (i % 3) as i64,
            ))
            .await
            .unwrap();
    }
    while lateness.lock().await.len() < count as usize {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    let mut values = lateness.lock().await.clone();
    values.sort_unstable();
    if std::env::var("TITO_BENCH_DEBUG").is_ok() {
        eprintln!("lateness {:?}", &values[values.len().saturating_sub(12)..]);
        eprintln!("lateness low {:?}", &values[..12.min(values.len())]);
    }
    (percentile(&values, 0.5), percentile(&values, 0.99))
}

async fn tito_idle_scans(db: &Embedded) -> f64 {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1024, Duration::from_secs(3600)).topic("idle"),
    ));
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..1024),
        |_event: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    // Let it take its leases and settle into its idle backoff, then count.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = queue.stats().scans;
    let window = Duration::from_secs(5);
    tokio::time::sleep(window).await;
    let scans = queue.stats().scans - before;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    scans as f64 / window.as_secs_f64()
}

/// What publishes the measured events.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    /// `build(row)`: the model's declared event, published by the write.
    ModelWrite,
    /// `Queue::publish`, in a transaction of its own.
    Publish,
    /// `Queue::publish_in_tx` in a caller's transaction that also writes a key.
    PublishInTx,
}

/// Commit-to-handler-start latency (ms) of `samples` events, each published after the worker
/// went idle for 250 ms; with `load`, another task publishes 200 events/s to the same queue
/// meanwhile. Returns the sorted latencies in microseconds.
async fn commit_to_handler<E: TitoEngine>(
    db: &E,
    source: Source,
    load: bool,
    samples: usize,
    window: Duration,
) -> Vec<i64> {
    let topic = if source == Source::ModelWrite {
        "pings"
    } else {
        "published"
    };
    let queue = Arc::new(Queue::new(
        db.clone(),
        // Model events go to a queue with the store's partition count.
        QueueConfig::new(db.partitions(), Duration::from_secs(3600)).topic(topic),
    ));
    let started: Arc<std::sync::Mutex<Vec<(String, Instant)>>> = Arc::default();
    let log = started.clone();
    let (stop, rx) = watch::channel(false);
    let worker = if source == Source::ModelWrite {
        tokio::spawn(run_worker(
            queue.clone(),
            WorkerConfig::new(0..db.partitions()).outcome_delay(window),
            move |event: QueueEvent<ModelEvent<Ping>>| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push((event.payload.id, Instant::now()));
                    Ok(QueueHandlerOutcome::Acknowledge)
                }
            },
            rx,
        ))
    } else {
        tokio::spawn(run_worker(
            queue.clone(),
            WorkerConfig::new(0..db.partitions()).outcome_delay(window),
            move |event: QueueEvent<Ping>| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push((event.payload.id, Instant::now()));
                    Ok(QueueHandlerOutcome::Acknowledge)
                }
            },
            rx,
        ))
    };
    // Ids unique across the cells that share a store.
    static CELL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let cell = CELL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (load_stop, load_rx) = watch::channel(false);
    let loader = load.then(|| {
        let (db, queue) = (db.clone(), queue.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !*load_rx.borrow() {
                let id = format!("{cell}-load-{n}");
                publish(&db, &queue, source, id).await;
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    });
    // The worker takes its leases and goes idle first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let id = format!("{cell}-measured-{i}");
        publish(db, &queue, source, id.clone()).await;
        let committed = Instant::now();
        let start = loop {
            let found = started
                .lock()
                .unwrap()
                .iter()
                .find(|(s, _)| *s == id)
                .map(|(_, at)| *at);
            if let Some(at) = found {
                break at;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        // A handler that started before the publishing task resumed counts as 0.
        latencies.push(start.saturating_duration_since(committed).as_micros() as i64);
    }
    load_stop.send(true).ok();
    if let Some(loader) = loader {
        loader.await.unwrap();
    }
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    latencies.sort_unstable();
    latencies
}

async fn publish<E: TitoEngine>(db: &E, queue: &Queue<E>, source: Source, id: String) {
    match source {
        Source::ModelWrite => {
            db.clone().model::<Ping>().build(Ping { id }).await.unwrap();
        }
        Source::PublishInTx => {
            db.transaction(|tx| {
                let id = id.clone();
                async move {
                    tx.put(format!("bench:{id}").into_bytes(), b"1".to_vec())
                        .await?;
                    queue
                        .publish_in_tx(&QueueEvent::new(id.clone(), Ping { id }, 0), &tx)
                        .await
                }
            })
            .await
            .unwrap();
        }
        Source::Publish => {
            queue
                .publish(QueueEvent::new(id.clone(), Ping { id }, 0))
                .await
                .unwrap();
        }
    }
}

/// One row of the commit-to-handler table: p50, p99 and max of sorted latencies (µs) in ms.
fn latency_row(engine: &str, source: &str, load: &str, sorted: &[i64]) {
    println!(
        "  {engine:<9} {source:<20} {load:<6} {:>8} {:>8} {:>8}",
        ms(percentile(sorted, 0.5)),
        ms(percentile(sorted, 0.99)),
        ms(sorted.last().copied().unwrap_or(0))
    );
}

fn ms(micros: i64) -> String {
    format!("{:.2}", micros as f64 / 1000.0)
}

fn sqlite(dir: &std::path::Path, durable: bool) -> Connection {
    let conn = Connection::open(dir.join("jobs.sqlite")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", if durable { "FULL" } else { "OFF" })
        .unwrap();
    conn.execute_batch(
        "CREATE TABLE job (id INTEGER PRIMARY KEY, run_at INTEGER NOT NULL, payload TEXT NOT NULL, done_at INTEGER);
         CREATE INDEX job_due ON job (run_at) WHERE done_at IS NULL;",
    )
    .unwrap();
    conn
}

/// Claims and completes up to `batch` due jobs in one transaction; returns how many, with the
/// due times of the ones it ran.
fn sqlite_run_batch(conn: &Connection, batch: usize, now_s: i64, due: &mut Vec<i64>) -> usize {
    let tx = conn.unchecked_transaction().unwrap();
    let rows: Vec<(i64, i64, String)> = tx
        .prepare_cached("SELECT id, run_at, payload FROM job WHERE done_at IS NULL AND run_at <= ?1 ORDER BY run_at LIMIT ?2")
        .unwrap()
        .query_map(params![now_s, batch as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for (id, run_at, payload) in &rows {
        let _job: Job = serde_json::from_str(payload).unwrap();
        due.push(*run_at);
        tx.prepare_cached("UPDATE job SET done_at = ?1 WHERE id = ?2")
            .unwrap()
            .execute(params![now_s, id])
            .unwrap();
    }
    tx.commit().unwrap();
    rows.len()
}

fn sqlite_throughput(dir: &std::path::Path, durable: bool, n: u64) -> Throughput {
    let conn = sqlite(dir, durable);
    let due_s = chrono::Utc::now().timestamp();
    let start = Instant::now();
    for i in 0..n {
        conn.prepare_cached("INSERT INTO job (run_at, payload) VALUES (?1, ?2)")
            .unwrap()
            .execute(params![due_s, serde_json::to_string(&job(i)).unwrap()])
            .unwrap();
    }
    let published = start.elapsed();
    let drain_start = Instant::now();
    let mut done = 0;
    let mut due = Vec::new();
    while done < n as usize {
        done += sqlite_run_batch(&conn, 64, chrono::Utc::now().timestamp(), &mut due);
    }
    let drained = drain_start.elapsed();
    Throughput {
        publish: n as f64 / published.as_secs_f64(),
        drain: n as f64 / drained.as_secs_f64(),
        end_to_end: n as f64 / (published + drained).as_secs_f64(),
    }
}

/// The SQLite job table polled every 50 ms (what a hand-rolled poller does).
fn sqlite_lateness(dir: &std::path::Path) -> (i64, i64) {
    let conn = sqlite(dir, false);
    let base = chrono::Utc::now().timestamp() + 1;
    let count = 300;
    for i in 0..count {
        conn.execute(
            "INSERT INTO job (run_at, payload) VALUES (?1, ?2)",
            params![
                base + (i % 3) as i64,
                serde_json::to_string(&job(i)).unwrap()
            ],
        )
        .unwrap();
    }
    let mut lateness = Vec::new();
    while lateness.len() < count as usize {
        let mut due = Vec::new();
        sqlite_run_batch(&conn, 64, chrono::Utc::now().timestamp(), &mut due);
        let now = now_ms();
        lateness.extend(due.into_iter().map(|d| now - d * 1000));
        std::thread::sleep(Duration::from_millis(50));
    }
    lateness.sort_unstable();
    (percentile(&lateness, 0.5), percentile(&lateness, 0.99))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    match std::env::var("TITO_BENCH_ONLY").as_deref() {
        Ok("latency") => commit_to_handler_table().await,
        Ok("limits") => limits_table().await,
        Ok("batching") => batching_table().await,
        Ok("tikv") => tikv_table().await,
        Ok("await") => await_table().await,
        Ok("graphs") => graphs_table().await,
        _ => {
            throughput_lateness_idle().await;
            batching_table().await;
            limits_table().await;
            tikv_table().await;
            commit_to_handler_table().await;
            await_table().await;
            graphs_table().await;
        }
    }
}

/// Drain rate of `n` events over 1,000 business keys under `limits` (embedded, buffered; one
/// worker, 4 partitions, 64 handlers in flight; the handler sleeps 1 ms so that limits bind).
async fn limited_drain(
    db: &Embedded,
    topic: &str,
    n: u64,
    limits: Limits,
    priorities: bool,
) -> (f64, u64) {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic(topic),
    ));
    let due = chrono::Utc::now().timestamp();
    for i in 0..n {
        queue
            .publish(
                QueueEvent::new(format!("customer:{}", i % 1000), job(i), due)
                    .with_urgency(if priorities { (i * 7 % 10) as u8 } else { 0 }),
            )
            .await
            .unwrap();
    }
    if !limits.is_none() {
        queue.set_limits(limits).await.unwrap();
    }
    let (stop, rx) = watch::channel(false);
    let start = Instant::now();
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..4)
            .concurrency(64)
            .page_size(64)
            .max_idle_backoff(Duration::from_millis(50)),
        |_event: QueueEvent<Job>| async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        },
        rx,
    ));
    while queue.stats().acknowledged < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    (rate, queue.stats().limited)
}

async fn limits_table() {
    let n = events();
    println!(
        "limits: {n} events over 1,000 keys, one worker (4 partitions, 64 in flight), 1 ms handler, embedded buffered"
    );
    println!(
        "{:<34} {:>12} {:>10} {:>14}",
        "limits / priorities", "events/s", "vs plain", "waits (slots)"
    );
    let dir = tempfile::tempdir().unwrap();
    let db = open(dir.path(), Durability::Buffered).await;
    let mut plain = 0.0;
    for (i, (name, limits)) in [
        ("none", Limits::none()),
        ("1 per key", Limits::none().key_concurrency(1)),
        ("4 per key", Limits::none().key_concurrency(4)),
        ("16 in the queue", Limits::none().concurrency(16)),
        (
            "16 in the queue, 1 per key",
            Limits::none().concurrency(16).key_concurrency(1),
        ),
        ("priorities 0-9 mixed, no limit", Limits::none()),
    ]
    .into_iter()
    .enumerate()
    {
        let priorities = name.starts_with("priorities");
        let topic = format!("limits-{i}");
        let (rate, waits) = limited_drain(&db, &topic, n, limits, priorities).await;
        if i == 0 {
            plain = rate;
        }
        println!("{name:<34} {rate:>12.0} {:>10.2} {waits:>14}", rate / plain);
    }
    db.close().await.unwrap();
}

async fn throughput_lateness_idle() {
    let n = events();
    println!("queue: {n} events, one worker (4 partitions, 64 handlers in flight), no-op handler");
    println!(
        "{:<10} {:<28} {:>12} {:>12} {:>10}",
        "durability", "events/s", "tito", "sqlite jobs", "tito/sqlite"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let (dir, raw_dir, sql_dir) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let db = open(dir.path(), durability).await;
        let tito = tito_throughput(&db, n).await;
        let raw_db = open(raw_dir.path(), durability).await;
        let raw = raw_limit(&raw_db, n.min(2000)).await;
        let sql = sqlite_throughput(sql_dir.path(), durability == Durability::Immediate, n);
        for (name, t, s) in [
            ("publish (1 tx each)", tito.publish, sql.publish),
            ("drain (handle + complete)", tito.drain, sql.drain),
            ("end to end", tito.end_to_end, sql.end_to_end),
        ] {
            println!("{label:<10} {name:<28} {t:>12.0} {s:>12.0} {:>10.2}", t / s);
        }
        println!(
            "{label:<10} {:<28} {raw:>12.0}   (publish is {:.2} of it; each event is 2 transactions end to end)",
            "raw engine 1-key tx/s",
            tito.publish / raw
        );
        db.close().await.unwrap();
        raw_db.close().await.unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let db = open(dir.path(), Durability::Buffered).await;
    let (p50, p99) = tito_lateness(&db).await;
    let sql_dir = tempfile::tempdir().unwrap();
    let (s50, s99) = sqlite_lateness(sql_dir.path());
    println!("lateness, due time to handler start (ms; due times are whole seconds):");
    println!("  tito   p50 {p50:>5}  p99 {p99:>5}");
    println!("  sqlite p50 {s50:>5}  p99 {s99:>5}  (polled every 50 ms)");
    let scans = tito_idle_scans(&db).await;
    println!(
        "idle cost: 1024 empty partitions, {scans:.0} scans/s (limit: 1024 partitions at the 2 s idle backoff = 512/s; sqlite's poller: 20 queries/s)"
    );
    db.close().await.unwrap();
}

async fn commit_to_handler_table() {
    let samples: usize = env_number("TITO_BENCH_LATENCY_SAMPLES", 40);
    println!(
        "commit to handler start (ms), an idle worker in the same process, {samples} events each (goal: p99 within 10 ms):"
    );
    println!(
        "  {:<9} {:<20} {:<6} {:>8} {:>8} {:>8}",
        "engine", "published by", "load", "p50", "p99", "max"
    );
    let dir = tempfile::tempdir().unwrap();
    let embedded = open(dir.path(), Durability::Buffered).await;
    let memory = tito::backend::memory::Memory::new();
    for (source, name) in [
        (Source::ModelWrite, "model write"),
        (Source::Publish, "publish"),
        (Source::PublishInTx, "publish_in_tx"),
    ] {
        for load in [false, true] {
            let load_name = if load { "200/s" } else { "none" };
            let l = commit_to_handler(&embedded, source, load, samples, Duration::ZERO).await;
            latency_row("embedded", name, load_name, &l);
            let l = commit_to_handler(&memory, source, load, samples, Duration::ZERO).await;
            latency_row("memory", name, load_name, &l);
        }
    }
    // A worker holding its outcomes in a 2 ms window: starts do not wait for it.
    for load in [false, true] {
        let load_name = if load { "200/s" } else { "none" };
        let window = Duration::from_millis(2);
        let l = commit_to_handler(&embedded, Source::Publish, load, samples, window).await;
        latency_row("embedded", "publish, 2ms window", load_name, &l);
    }
    embedded.close().await.unwrap();
}

/// How one batching run publishes and runs its events.
#[derive(Clone, Copy)]
struct Run {
    partitions: u32,
    concurrency: usize,
    /// `publish_many` (bounded transactions of 1,000) instead of one `publish` per event.
    many: bool,
    /// The worker's outcome window.
    delay: Duration,
}

/// Publishes `n` events as `run` says, then drains them with one worker; the phases' rates.
async fn queue_run<E: TitoEngine>(db: &E, topic: &str, n: u64, run: Run) -> Throughput {
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(run.partitions, Duration::from_secs(3600)).topic(topic),
    ));
    let due = chrono::Utc::now().timestamp();
    let events: Vec<QueueEvent<Job>> = (0..n)
        .map(|i| QueueEvent::new(format!("user:{i}"), job(i), due))
        .collect();
    let start = Instant::now();
    if run.many {
        queue.publish_many(&events).await.unwrap();
    } else {
        for event in events {
            queue.publish(event).await.unwrap();
        }
    }
    let published = start.elapsed();
    let (stop, rx) = watch::channel(false);
    let drain_start = Instant::now();
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..run.partitions)
            .concurrency(run.concurrency)
            .page_size(run.concurrency)
            .outcome_delay(run.delay),
        |_event: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    while queue.stats().acknowledged < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let drained = drain_start.elapsed();
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    Throughput {
        publish: n as f64 / published.as_secs_f64(),
        drain: n as f64 / drained.as_secs_f64(),
        end_to_end: n as f64 / (published + drained).as_secs_f64(),
    }
}

/// Publication one at a time and in bulk, outcome windows, concurrency 4 and 16, on the
/// embedded engine beside the SQLite job table; commits per event counted at the engine.
async fn batching_table() {
    let n = events();
    println!(
        "batching: {n} events, one worker (4 partitions), no-op handler; commits per event counted at the engine (publication included)"
    );
    println!(
        "{:<9} {:<10} {:>4} {:>7} {:>11} {:>11} {:>11} {:>9} {:>11} {:>8}",
        "durable",
        "publish",
        "conc",
        "window",
        "publish/s",
        "drain/s",
        "end to end",
        "commits",
        "sqlite e2e",
        "ratio"
    );
    for (label, durability) in [
        ("buffered", Durability::Buffered),
        ("durable", Durability::Immediate),
    ] {
        let sql_dir = tempfile::tempdir().unwrap();
        let sql = sqlite_throughput(sql_dir.path(), durability == Durability::Immediate, n);
        let dir = tempfile::tempdir().unwrap();
        let db = tito::engine::FaultyEngine::new(open(dir.path(), durability).await);
        let mut cell = 0;
        for many in [false, true] {
            for concurrency in [4, 16] {
                for delay in [Duration::ZERO, Duration::from_millis(2)] {
                    if !many && delay > Duration::ZERO {
                        continue;
                    }
                    cell += 1;
                    let before = db.faults().calls(tito::engine::FaultPoint::Commit);
                    let run = Run {
                        partitions: 4,
                        concurrency,
                        many,
                        delay,
                    };
                    let t = queue_run(&db, &format!("batching-{cell}"), n, run).await;
                    let commits = db.faults().calls(tito::engine::FaultPoint::Commit) - before;
                    println!(
                        "{label:<9} {:<10} {concurrency:>4} {:>5}ms {:>11.0} {:>11.0} {:>11.0} {:>9.3} {:>11.0} {:>8.2}",
                        if many { "many" } else { "one by one" },
                        delay.as_millis(),
                        t.publish,
                        t.drain,
                        t.end_to_end,
                        commits as f64 / n as f64,
                        sql.end_to_end,
                        t.end_to_end / sql.end_to_end
                    );
                }
            }
        }
        db.inner().close().await.unwrap();
    }
}

/// The queue on the TiKV test server with a delay added to every request (none, 0.5 ms as
/// within a LAN, 2 ms as between zones): events per second and requests per event, counted by
/// the server per gRPC method (timestamps from PD's stream counted once).
async fn tikv_table() {
    use tito::backend::tikv::TiKV;
    use tito_tikv_test_server::TestCluster;
    let n: u64 = env_number("TITO_BENCH_TIKV_EVENTS", 1000);
    println!(
        "tikv (test server, every request delayed): {n} events, one worker, 64 handlers in flight, no-op handler; requests and commits per event over both phases"
    );
    println!(
        "{:>7} {:<10} {:>5} {:>7} {:>10} {:>10} {:>10} {:>12} {:>9} {:>9}",
        "latency",
        "publish",
        "parts",
        "window",
        "publish/s",
        "drain/s",
        "end to end",
        "per part/s",
        "requests",
        "commits"
    );
    for latency in [
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_millis(2),
    ] {
        let cluster = TestCluster::start().await.unwrap();
        cluster.set_latency(latency);
        let db = TiKV::connect(cluster.pd_endpoints()).await.unwrap();
        let mut cell = 0;
        for (many, partitions, delay) in [
            (false, 4, Duration::ZERO),
            (true, 1, Duration::ZERO),
            (true, 4, Duration::ZERO),
            (true, 4, Duration::from_millis(5)),
        ] {
            cell += 1;
            let count = |calls: &std::collections::BTreeMap<String, u64>| {
                let requests: u64 = calls
                    .iter()
                    .filter(|(m, _)| m.starts_with("Kv"))
                    .map(|(_, n)| n)
                    .sum();
                let commits = calls.get("KvCommit").copied().unwrap_or(0);
                (requests, commits)
            };
            let (r0, c0) = count(&cluster.all_calls());
            let run = Run {
                partitions,
                concurrency: 64,
                many,
                delay,
            };
            let calls_before = cluster.all_calls();
            let t = queue_run(&db, &format!("tikv-{cell}"), n, run).await;
            let calls_after = cluster.all_calls();
            if std::env::var("TITO_BENCH_DEBUG").is_ok() {
                for (method, count) in &calls_after {
                    let delta = count - calls_before.get(method).copied().unwrap_or(0);
                    if delta > 0 {
                        eprintln!("  {method}: {delta}");
                    }
                }
            }
            let (r1, c1) = count(&calls_after);
            println!(
                "{:>5.1}ms {:<10} {partitions:>5} {:>5}ms {:>10.0} {:>10.0} {:>10.0} {:>12.0} {:>9.2} {:>9.2}",
                latency.as_secs_f64() * 1000.0,
                if many { "many" } else { "one by one" },
                delay.as_millis(),
                t.publish,
                t.drain,
                t.end_to_end,
                t.drain / partitions as f64,
                (r1 - r0) as f64 / n as f64,
                (c1 - c0) as f64 / n as f64
            );
        }
    }
}

/// From the end of a publication to `await_result` returning its handler's result, 40 events
/// one after another, awaited on the publishing handle and on another handle of the same store
/// (what another process does: both read the store); an idle worker in the same process.
async fn await_table() {
    println!("publish to awaited result (ms), 40 events one after another, idle worker:");
    println!(
        "  {:<9} {:<20} {:<6} {:>8} {:>8} {:>8}",
        "engine", "awaited on", "worker", "p50", "p99", "max"
    );
    let dir = tempfile::tempdir().unwrap();
    let embedded = open(dir.path(), Durability::Buffered).await;
    let memory = tito::backend::memory::Memory::new();
    for other in [false, true] {
        let name = if other {
            "another handle"
        } else {
            "the same handle"
        };
        let l = await_latency(&embedded, other).await;
        latency_row("embedded", name, "idle", &l);
        let l = await_latency(&memory, other).await;
        latency_row("memory", name, "idle", &l);
    }
    embedded.close().await.unwrap();
}

async fn await_latency<E: TitoEngine>(db: &E, other: bool) -> Vec<i64> {
    static CELL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let topic = format!(
        "await-{}",
        CELL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let config = QueueConfig::new(4, Duration::from_secs(3600)).topic(topic);
    let queue = Arc::new(Queue::new(db.clone(), config.clone()));
    let reader = if other {
        Arc::new(Queue::new(db.clone(), config))
    } else {
        queue.clone()
    };
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..4),
        |event: QueueEvent<Job>| async move { QueueHandlerOutcome::acknowledge_with(&event.payload.n) },
        rx,
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::new();
    for i in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let published = queue
            .publish(QueueEvent::new(format!("k{i}"), job(i), 0))
            .await
            .unwrap();
        let start = Instant::now();
        let done = reader
            .await_result::<u64>(&published.id, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(done, Some(tito::queue::Finished::Completed(Some(i))));
        latencies.push(start.elapsed().as_micros() as i64);
    }
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    latencies.sort_unstable();
    latencies
}

/// Job graphs on the embedded engine (buffered): a batch of N children (default 10,000,
/// `TITO_BENCH_GRAPH_CHILDREN`) to its callback beside N independent jobs, and a 1,000-step
/// workflow (wide: one step, 998 after it, one after all of those; deep: a chain) beside 1,000
/// independent jobs; one worker (4 partitions) at 1, 4 and 16 handlers; commits per child or
/// step counted at the engine, publication included.
async fn graphs_table() {
    use tito::queue::graph::{Batch, BatchDone, Graphs, StepName, Workflow};
    let n: u64 = env_number("TITO_BENCH_GRAPH_CHILDREN", 10_000);
    let steps: u64 = env_number("TITO_BENCH_GRAPH_STEPS", 1_000);
    println!(
        "graphs: embedded (buffered), one worker (4 partitions), no-op handlers; time from publication to the callback or last step; commits per child or step counted at the engine"
    );
    println!(
        "{:<22} {:>4} {:>10} {:>10} {:>9} {:>12} {:>8}",
        "shape", "conc", "items", "ms", "commits", "jobs ms", "ratio"
    );
    let dir = tempfile::tempdir().unwrap();
    let db = tito::engine::FaultyEngine::new(open(dir.path(), Durability::Buffered).await);
    let graphs = Graphs::new(db.clone());
    let mut cell = 0;
    for concurrency in [1usize, 4, 16] {
        let config = || {
            WorkerConfig::new(0..4)
                .concurrency(concurrency)
                .page_size(concurrency)
                .max_idle_backoff(Duration::from_millis(20))
        };
        cell += 1;
        let jobs_n = independent_jobs(&db, &format!("graphs-jobs-{cell}"), n, concurrency).await;
        // The batch.
        cell += 1;
        let children = Arc::new(Queue::new(
            db.clone(),
            QueueConfig::new(4, Duration::from_secs(3600)).topic(format!("graphs-children-{cell}")),
        ));
        let callbacks = Arc::new(Queue::new(
            db.clone(),
            QueueConfig::new(1, Duration::from_secs(3600))
                .topic(format!("graphs-callbacks-{cell}")),
        ));
        let events: Vec<QueueEvent<Job>> = (0..n)
            .map(|i| QueueEvent::now(format!("user:{i}"), job(i)))
            .collect();
        let before = db.faults().calls(tito::engine::FaultPoint::Commit);
        let start = Instant::now();
        let batch =
            Batch::new(format!("bench-{cell}")).on_complete(&callbacks, QueueEvent::now("cb", ()));
        graphs
            .publish_batch(&batch, &children, &events)
            .await
            .unwrap()
            .unwrap();
        let published = start.elapsed();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut workers = tito::queue::Workers::new();
        workers.spawn_worker(children.clone(), config(), |_: QueueEvent<Job>| async {
            Ok(QueueHandlerOutcome::Acknowledge)
        });
        workers.spawn_worker(
            callbacks.clone(),
            WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(20)),
            move |_: QueueEvent<BatchDone<()>>| {
                let done_tx = done_tx.clone();
                async move {
                    let _ = done_tx.send(());
                    Ok(QueueHandlerOutcome::Acknowledge)
                }
            },
        );
        done_rx.recv().await.unwrap();
        let batch_time = start.elapsed();
        let commits = db.faults().calls(tito::engine::FaultPoint::Commit) - before;
        workers.shutdown().await.unwrap();
        println!(
            "{:<22} {concurrency:>4} {n:>10} {:>10.0} {:>9.3} {:>12.0} {:>8.2}  (published in {:.0} ms)",
            "batch to callback",
            batch_time.as_secs_f64() * 1000.0,
            commits as f64 / n as f64,
            jobs_n.as_secs_f64() * 1000.0,
            batch_time.as_secs_f64() / jobs_n.as_secs_f64(),
            published.as_secs_f64() * 1000.0
        );
        // Workflows, wide and deep.
        cell += 1;
        let jobs_steps =
            independent_jobs(&db, &format!("graphs-jobs-{cell}"), steps, concurrency).await;
        for shape in ["workflow wide", "workflow deep"] {
            cell += 1;
            let queue = Arc::new(Queue::new(
                db.clone(),
                QueueConfig::new(4, Duration::from_secs(3600))
                    .topic(format!("graphs-steps-{cell}")),
            ));
            let mut workflow = Workflow::new(format!("bench-{cell}"));
            let name = |i: u64| StepName::<()>::named(format!("s{i}"));
            for i in 0..steps {
                let event = QueueEvent::now(format!("user:{i}"), job(i));
                let step = workflow.step(&name(i), &queue, event);
                match (shape, i) {
                    (_, 0) => {}
                    ("workflow wide", i) if i == steps - 1 => {
                        step.after((1..steps - 1).map(|d| format!("s{d}")));
                    }
                    ("workflow wide", _) => {
                        step.after(["s0"]);
                    }
                    _ => {
                        step.after([format!("s{}", i - 1)]);
                    }
                }
            }
            let before = db.faults().calls(tito::engine::FaultPoint::Commit);
            let start = Instant::now();
            let published = graphs.publish_workflow(&workflow).await.unwrap();
            let last = published
                .step_id(format!("s{}", steps - 1))
                .unwrap()
                .to_string();
            let mut workers = tito::queue::Workers::new();
            workers.spawn_worker(queue.clone(), config(), |_: QueueEvent<Job>| async {
                Ok(QueueHandlerOutcome::Acknowledge)
            });
            queue
                .await_result::<()>(&last, Duration::from_secs(600))
                .await
                .unwrap()
                .unwrap();
            let took = start.elapsed();
            let commits = db.faults().calls(tito::engine::FaultPoint::Commit) - before;
            workers.shutdown().await.unwrap();
            println!(
                "{shape:<22} {concurrency:>4} {steps:>10} {:>10.0} {:>9.3} {:>12.0} {:>8.2}",
                took.as_secs_f64() * 1000.0,
                commits as f64 / steps as f64,
                jobs_steps.as_secs_f64() * 1000.0,
                took.as_secs_f64() / jobs_steps.as_secs_f64()
            );
        }
    }
    db.inner().close().await.unwrap();
}

/// Time to publish (`publish_many`) and drain `count` independent jobs: the peer of a graph.
async fn independent_jobs<E: TitoEngine>(
    db: &E,
    topic: &str,
    count: u64,
    concurrency: usize,
) -> Duration {
    let run = Run {
        partitions: 4,
        concurrency,
        many: true,
        delay: Duration::ZERO,
    };
    let start = Instant::now();
    queue_run(db, topic, count, run).await;
    start.elapsed()
}
