//! Contention in a service written as the guide tells a user, with its defaults everywhere: a
//! document-intake app whose workers run in 1, 2 and 4 OS processes on one store.
//!
//! The service:
//!
//! - a `Document` model; an upload is ONE transaction that writes the row and publishes a
//!   four-step workflow (`Graphs::publish_workflow_in_tx`): extract, then classify and
//!   thumbnail, then index after both. All four steps go to queue `pipeline` (a `Topic` with an
//!   enum payload, 4 partitions, keyed by the document) run by `Workers::start_transactional`
//!   with the declared (default) config, 16 handlers; each step reads the document in the
//!   handler's transaction, sets its state to the step's name (`indexed` for the last) and
//!   writes it back;
//! - a nightly batch of N children to queue `rows` (4 partitions, `Workers::start`, the handler
//!   acknowledges) with an `on_complete` callback to queue `reports`, published with
//!   `Graphs::publish_batch` while the workers of `rows` run and the uploads go on. A
//!   publication that fails is published again, as the guide says (the batch is
//!   `numbered()`), up to 5 times;
//! - D uploads published by 4 concurrent publisher tasks.
//!
//! On TiKV (the tikv-test-server, started in this process on a local port, with 0, 0.5 and 2 ms
//! added to every request) the workers run in P child processes (this benchmark started again
//! with `TITO_CONTENTION_WORKER` set to the PD address): each opens the store, starts the
//! workers of the three queues, and at the end (its standard input closed) stops them and
//! prints its counters as one JSON line. On the embedded store (exclusive to its process)
//! everything runs in this process, P = 1. Each run has a fresh store. A run ends when every
//! uploaded document is indexed and the batch's callback was handled, or at the time limit.
//!
//! Columns, one row per (store, latency, processes):
//!
//! - `runs/s`: invocations completed (acknowledged, all three queues) per second, from the
//!   first publication to the end of the run; `xP1` the same over the run with 1 process;
//! - `failed`: failed attempts (`QueueStats::failed`, every process); `confl`: those whose
//!   logged error mentions a conflict; `tito`: those whose error names one of Tito's own keys
//!   as the key written in conflict (a partition lease `queue@..:lease:..`, a queue's rows, a
//!   batch's or workflow's records), not the application's `table:document:..` row;
//! - `repl/job`: transactional handler replays (`QueueStats::replayed`) per pipeline
//!   invocation completed; `dead`: dead invocations of `pipeline` and `rows` in the store;
//! - `indexed`: documents in state `indexed` over D;
//! - `batch pub`, `pub s`: the first `publish_batch`'s result and seconds; `tries`: the calls
//!   it took (`!`: none succeeded, so no callback); `cb s`: seconds from the first publication
//!   to the callback handled;
//! - `p99 p0..p3`: p99 of pipeline start delays per partition, in ms: handler start minus
//!   the step's due time, taken as the later of `event.timestamp` (whole seconds) and a
//!   millisecond time when there is one (the upload's start for extract, the write time of
//!   the dependencies' handlers, read from the document, for the others). Later steps' delays
//!   include their dependencies' commits.
//!
//! Below the table, each run's logged errors by text (digits as `#`), failed uploads and the
//! batch's counts.
//!
//! `cargo bench --bench contention`; `TITO_CONTENTION_DOCS` sets D (300),
//! `TITO_CONTENTION_BATCH` N (5000), `TITO_CONTENTION_LATENCIES` the TiKV latencies in ms
//! ("0,0.5,2"), `TITO_CONTENTION_PROCESSES` the process counts ("1,2,4"),
//! `TITO_CONTENTION_TIMEOUT_S` each run's time limit (300), `TITO_CONTENTION_EMBEDDED=0` leaves
//! the embedded store out.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::queue::graph::{Batch, BatchCounts, BatchDone, Graphs, StepName, Workflow};
use tito::queue::{QueueSpec, QueueStats, Topic, TopicQueue, partition_for};
use tito::{
    QueueEvent, QueueHandlerOutcome, QueueHandlerResult, TitoEngine, TitoError, TitoModel,
    TitoOptions, TitoResult, Workers,
};
use tito_tikv_test_server::TestCluster;
use tokio::sync::mpsc;

/// Set in a worker process: the PD address of the store to open.
const WORKER_VAR: &str = "TITO_CONTENTION_WORKER";

/// Partitions of `pipeline` and `rows`.
const PARTITIONS: u32 = 4;
/// Completed rows kept a day, as in the guide.
const RETENTION: Duration = Duration::from_secs(86_400);
/// Concurrent upload publishers.
const PUBLISHERS: usize = 4;
/// `publish_batch` calls at most, the first included.
const BATCH_ATTEMPTS: u32 = 5;
/// The batch's id.
const BATCH_ID: &str = "nightly";

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
struct Document {
    id: String,
    title: String,
    state: String,
    /// When each step's handler wrote the row (Unix ms), by step name.
    done_ms: BTreeMap<String, i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Step {
    Extract { doc: String, uploaded_ms: i64 },
    Classify { doc: String },
    Thumbnail { doc: String },
    Index { doc: String },
}

/// A child of the nightly batch.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Row {
    n: u32,
    /// When its publication started (Unix ms).
    published_ms: i64,
}

const PIPELINE: Topic<Step> = Topic::new("pipeline");
const ROWS: Topic<Row> = Topic::new("rows");
const REPORTS: Topic<BatchDone<String>> = Topic::new("reports");

const EXTRACT: StepName<()> = StepName::new("extract");
const CLASSIFY: StepName<()> = StepName::new("classify");
const THUMBNAIL: StepName<()> = StepName::new("thumbnail");
const INDEX: StepName<()> = StepName::new("index");

fn pipeline_spec() -> QueueSpec<Step> {
    PIPELINE.spec(PARTITIONS, RETENTION)
}

fn rows_spec() -> QueueSpec<Row> {
    ROWS.spec(PARTITIONS, RETENTION)
}

fn reports_spec() -> QueueSpec<BatchDone<String>> {
    REPORTS.spec(1, RETENTION)
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

fn env_list<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    let text = std::env::var(name).unwrap_or_else(|_| default.to_string());
    text.split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn percentile(values: &[i64], p: f64) -> Option<i64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    Some(sorted[((sorted.len() - 1) as f64 * p).round() as usize])
}

// ---------------------------------------------------------------------------------------------
// What Tito logs: a subscriber that keeps every warning and error by its text.

/// Warnings and errors logged in this process, by normalized text.
static LOGGED: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// Digits as `#` (ids, partitions, versions), cut at 300 characters: texts that differ only
/// in numbers count together.
fn normalize(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('#') {
                out.push('#');
            }
        } else {
            out.push(c);
        }
        if out.len() >= 300 {
            out.push('…');
            break;
        }
    }
    out
}

#[derive(Default)]
struct Fields {
    message: String,
    queue: String,
    error: String,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        match field.name() {
            "message" => self.message = text,
            "queue" => self.queue = text,
            "error" => self.error = text,
            _ => {}
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
}

struct Capture;

impl tracing::Subscriber for Capture {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if self.enabled(metadata) {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::WARN)
    }
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let queue = if fields.queue.is_empty() {
            String::new()
        } else {
            format!("[{}] ", fields.queue)
        };
        let text = normalize(&format!("{queue}{}: {}", fields.message, fields.error));
        *LOGGED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(text)
            .or_default() += 1;
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn take_logged() -> BTreeMap<String, u64> {
    std::mem::take(&mut *LOGGED.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A logged handler failure's error names a conflict.
fn is_conflict(text: &str) -> bool {
    text.contains("conflict")
}

/// The keys an error says a write conflicted on (`write conflict on key "..."`).
fn conflict_keys(text: &str) -> Vec<&str> {
    text.split("conflict on key \"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect()
}

/// Whether a key is one of Tito's own (a queue's lease, rows or event ids, a batch's or a
/// workflow's records), not the application's (`table:document:..`).
fn is_tito_key(key: &str) -> bool {
    ["queue", "batch", "workflow", "waiting"]
        .iter()
        .any(|prefix| key.starts_with(prefix))
}

/// A logged handler failure's error names one of Tito's own keys: a conflict on one, or a
/// lease (lost, or its key) when it names no conflicting key.
fn names_tito_key(text: &str) -> bool {
    let keys = conflict_keys(text);
    if keys.is_empty() {
        text.contains("lease") || text.contains("queue@")
    } else {
        keys.iter().any(|key| is_tito_key(key))
    }
}

// ---------------------------------------------------------------------------------------------
// The service's workers, as a worker process (or this one, on the embedded store) runs them.

/// A queue handle's counters, as a child reports them.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct Figures {
    delivered: u64,
    acknowledged: u64,
    failed: u64,
    replayed: u64,
    outcome_failures: u64,
    leases_lost: u64,
}

impl Figures {
    fn of(stats: QueueStats) -> Figures {
        Figures {
            delivered: stats.delivered,
            acknowledged: stats.acknowledged,
            failed: stats.failed,
            replayed: stats.replayed,
            outcome_failures: stats.outcome_failures,
            leases_lost: stats.leases_lost,
        }
    }

    fn add(&mut self, other: &Figures) {
        self.delivered += other.delivered;
        self.acknowledged += other.acknowledged;
        self.failed += other.failed;
        self.replayed += other.replayed;
        self.outcome_failures += other.outcome_failures;
        self.leases_lost += other.leases_lost;
    }
}

/// What a worker process counted: its one JSON line.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Counts {
    /// Handler calls per queue (replays included).
    calls: BTreeMap<String, u64>,
    /// The queue handles' counters per queue.
    stats: BTreeMap<String, Figures>,
    /// Warnings and errors logged, by normalized text.
    logged: BTreeMap<String, u64>,
    /// Pipeline start delays (ms) per partition, the first start of each invocation.
    pipeline_delays: Vec<Vec<i64>>,
    /// Batch children's start delays (ms).
    row_delays: Vec<i64>,
}

impl Counts {
    fn merge(&mut self, other: Counts) {
        for (queue, calls) in other.calls {
            *self.calls.entry(queue).or_default() += calls;
        }
        for (queue, figures) in other.stats {
            self.stats.entry(queue).or_default().add(&figures);
        }
        for (text, n) in other.logged {
            *self.logged.entry(text).or_default() += n;
        }
        if self.pipeline_delays.len() < other.pipeline_delays.len() {
            self.pipeline_delays
                .resize(other.pipeline_delays.len(), Vec::new());
        }
        for (mine, theirs) in self.pipeline_delays.iter_mut().zip(other.pipeline_delays) {
            mine.extend(theirs);
        }
        self.row_delays.extend(other.row_delays);
    }

    fn total(&self, field: fn(&Figures) -> u64) -> u64 {
        self.stats.values().map(field).sum()
    }

    fn figures(&self, queue: &str) -> Figures {
        self.stats.get(queue).copied().unwrap_or_default()
    }

    /// Logged handler failures whose text passes `filter`.
    fn failures(&self, filter: fn(&str) -> bool) -> u64 {
        self.logged
            .iter()
            .filter(|(text, _)| text.contains("handler failed") && filter(text))
            .map(|(_, n)| n)
            .sum()
    }
}

/// What the handlers record.
#[derive(Default)]
struct Probe {
    pipeline_calls: AtomicU64,
    row_calls: AtomicU64,
    report_calls: AtomicU64,
    /// Invocations started at least once (their first start is the one timed).
    started: Mutex<HashSet<String>>,
    pipeline_delays: Mutex<Vec<Vec<i64>>>,
    row_delays: Mutex<Vec<i64>>,
}

impl Probe {
    fn first_start(&self, id: &str) -> bool {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string())
    }
}

/// The service's workers on one store.
struct Service<E: TitoEngine> {
    workers: Workers,
    pipeline: TopicQueue<E, Step>,
    rows: TopicQueue<E, Row>,
    reports: TopicQueue<E, BatchDone<String>>,
    probe: Arc<Probe>,
}

/// Opens the queues and starts their workers, as the service's start-up does.
async fn start_service<E: TitoEngine>(db: E) -> TitoResult<Service<E>> {
    let pipeline = pipeline_spec().open(db.clone()).await?;
    let rows = rows_spec().open(db.clone()).await?;
    let reports = reports_spec().open(db.clone()).await?;
    let documents = db.clone().model::<Document>();
    let probe = Arc::new(Probe {
        pipeline_delays: Mutex::new(vec![Vec::new(); PARTITIONS as usize]),
        ..Probe::default()
    });
    let mut workers = Workers::new();
    let step_probe = probe.clone();
    workers.start_transactional(&pipeline, move |event: QueueEvent<Step>, tx| {
        let (probe, documents) = (step_probe.clone(), documents.clone());
        async move { run_step(&probe, &documents, event, &tx).await }
    });
    let row_probe = probe.clone();
    workers.start(&rows, move |event: QueueEvent<Row>| {
        let probe = row_probe.clone();
        async move {
            let started = now_ms();
            probe.row_calls.fetch_add(1, Ordering::Relaxed);
            if probe.first_start(&event.id) {
                let due = (event.timestamp * 1000).max(event.payload.published_ms);
                probe
                    .row_delays
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(started - due);
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    let report_probe = probe.clone();
    workers.start(&reports, move |_event: QueueEvent<BatchDone<String>>| {
        let probe = report_probe.clone();
        async move {
            probe.report_calls.fetch_add(1, Ordering::Relaxed);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    Ok(Service {
        workers,
        pipeline,
        rows,
        reports,
        probe,
    })
}

/// One pipeline step, inside the handler's transaction: the document read, its state set to
/// the step's name, written back.
async fn run_step<E: TitoEngine>(
    probe: &Probe,
    documents: &tito::model::TitoModel<E, Document>,
    event: QueueEvent<Step>,
    tx: &E::Transaction,
) -> QueueHandlerResult<Step> {
    let started = now_ms();
    probe.pipeline_calls.fetch_add(1, Ordering::Relaxed);
    let (doc, step, state) = match &event.payload {
        Step::Extract { doc, .. } => (doc, "extract", "extract"),
        Step::Classify { doc } => (doc, "classify", "classify"),
        Step::Thumbnail { doc } => (doc, "thumbnail", "thumbnail"),
        Step::Index { doc } => (doc, "index", "indexed"),
    };
    let Some(mut document) = documents.get_in_tx(doc, tx).await? else {
        return Err(TitoError::handler(format!("document {doc} is missing")));
    };
    if probe.first_start(&event.id) {
        let done = |step: &StepName<()>| document.done_ms.get(step.name()).copied();
        let known_ms = match &event.payload {
            Step::Extract { uploaded_ms, .. } => Some(*uploaded_ms),
            Step::Classify { .. } | Step::Thumbnail { .. } => done(&EXTRACT),
            Step::Index { .. } => done(&CLASSIFY).max(done(&THUMBNAIL)),
        };
        let due = (event.timestamp * 1000).max(known_ms.unwrap_or(0));
        let partition = partition_for(&event.key, PARTITIONS) as usize;
        probe
            .pipeline_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())[partition]
            .push(started - due);
    }
    document.state = state.to_string();
    document.done_ms.insert(step.to_string(), now_ms());
    documents
        .update_with_options(document, TitoOptions::default(), tx)
        .await?;
    Ok(QueueHandlerOutcome::Acknowledge)
}

impl<E: TitoEngine> Service<E> {
    /// Stops the workers (started handlers finish) and counts.
    async fn stop(self) -> Counts {
        match tokio::time::timeout(Duration::from_secs(60), self.workers.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => eprintln!("workers ended with an error: {err}"),
            Err(_) => eprintln!("the workers' shutdown took over 60 s; counted anyway"),
        }
        let probe = &self.probe;
        let calls = [
            ("pipeline", &probe.pipeline_calls),
            ("rows", &probe.row_calls),
            ("reports", &probe.report_calls),
        ]
        .into_iter()
        .map(|(queue, n)| (queue.to_string(), n.load(Ordering::Relaxed)))
        .collect();
        let stats = [
            ("pipeline", self.pipeline.stats()),
            ("rows", self.rows.stats()),
            ("reports", self.reports.stats()),
        ]
        .into_iter()
        .map(|(queue, stats)| (queue.to_string(), Figures::of(stats)))
        .collect();
        Counts {
            calls,
            stats,
            logged: take_logged(),
            pipeline_delays: std::mem::take(
                &mut *probe
                    .pipeline_delays
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            ),
            row_delays: std::mem::take(
                &mut *probe.row_delays.lock().unwrap_or_else(|e| e.into_inner()),
            ),
        }
    }
}

/// A worker process: opens the store at `pd`, runs the service until its standard input
/// closes, then prints its counts as one JSON line.
async fn worker_process(pd: String) {
    let db = TiKV::connect(vec![pd])
        .await
        .expect("connect to the test server");
    let service = start_service(db).await.expect("start the workers");
    println!("ready");
    std::io::stdout().flush().ok();
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
    })
    .await;
    let counts = service.stop().await;
    println!(
        "{}",
        serde_json::to_string(&counts).expect("counts as JSON")
    );
    std::io::stdout().flush().ok();
}

// ---------------------------------------------------------------------------------------------
// The publishers and the run.

struct Settings {
    docs: usize,
    batch: u32,
    latencies: Vec<f64>,
    processes: Vec<usize>,
    timeout: Duration,
    embedded: bool,
}

impl Settings {
    fn from_env() -> Settings {
        Settings {
            docs: env_number("TITO_CONTENTION_DOCS", 300),
            batch: env_number("TITO_CONTENTION_BATCH", 5000),
            latencies: env_list("TITO_CONTENTION_LATENCIES", "0,0.5,2"),
            processes: env_list("TITO_CONTENTION_PROCESSES", "1,2,4"),
            timeout: Duration::from_secs(env_number("TITO_CONTENTION_TIMEOUT_S", 300)),
            embedded: std::env::var("TITO_CONTENTION_EMBEDDED").map_or(true, |v| v != "0"),
        }
    }
}

fn doc_id(n: usize) -> String {
    format!("doc-{n:05}")
}

/// One upload: the document and its workflow in one transaction.
async fn upload<E: TitoEngine>(
    db: &E,
    graphs: &Graphs<E>,
    pipeline: &TopicQueue<E, Step>,
    n: usize,
) -> TitoResult<()> {
    let documents = db.clone().model::<Document>();
    let id = doc_id(n);
    let document = Document {
        id: id.clone(),
        title: format!("Scanned letter {n}"),
        state: "uploaded".into(),
        done_ms: BTreeMap::new(),
    };
    let uploaded_ms = now_ms();
    let doc = id.clone();
    let mut workflow = Workflow::new(format!("intake-{id}"));
    workflow.step(
        &EXTRACT,
        pipeline,
        QueueEvent::now(id.clone(), Step::Extract { doc, uploaded_ms }),
    );
    let doc = id.clone();
    workflow
        .step(
            &CLASSIFY,
            pipeline,
            QueueEvent::now(id.clone(), Step::Classify { doc }),
        )
        .after([&EXTRACT]);
    let doc = id.clone();
    workflow
        .step(
            &THUMBNAIL,
            pipeline,
            QueueEvent::now(id.clone(), Step::Thumbnail { doc }),
        )
        .after([&EXTRACT]);
    let doc = id.clone();
    workflow
        .step(
            &INDEX,
            pipeline,
            QueueEvent::now(id.clone(), Step::Index { doc }),
        )
        .after([CLASSIFY.name(), THUMBNAIL.name()]);
    db.transaction(async |tx| {
        documents
            .build_with_options(document.clone(), TitoOptions::default(), &tx)
            .await?;
        graphs.publish_workflow_in_tx(&workflow, &tx).await?;
        Ok::<_, TitoError>(())
    })
    .await
}

/// The nightly batch's publication.
#[derive(Clone, Debug, Default)]
struct BatchRun {
    /// The first `publish_batch`'s error, if it failed.
    first_error: Option<String>,
    first_s: f64,
    /// `publish_batch` calls made.
    attempts: u32,
    /// Whether one of them succeeded.
    published: bool,
    /// The errors of the calls after the first.
    later_errors: Vec<String>,
}

async fn publish_nightly<E: TitoEngine>(
    graphs: &Graphs<E>,
    rows: &TopicQueue<E, Row>,
    reports: &TopicQueue<E, BatchDone<String>>,
    children: u32,
) -> BatchRun {
    let batch = Batch::new(BATCH_ID).numbered().on_complete(
        reports,
        QueueEvent::now("nightly", "nightly import".to_string()),
    );
    let published_ms = now_ms();
    let events: Vec<QueueEvent<Row>> = (0..children)
        .map(|n| QueueEvent::now(format!("row-{n}"), Row { n, published_ms }))
        .collect();
    let mut run = BatchRun::default();
    let started = Instant::now();
    while run.attempts < BATCH_ATTEMPTS {
        run.attempts += 1;
        let result = graphs.publish_batch(&batch, rows, &events).await;
        if run.attempts == 1 {
            run.first_s = started.elapsed().as_secs_f64();
        }
        match result {
            Ok(_) => {
                run.published = true;
                break;
            }
            Err(err) if run.attempts == 1 => run.first_error = Some(err.to_string()),
            Err(err) => run.later_errors.push(err.to_string()),
        }
    }
    run
}

/// What one run measured.
struct RunResult {
    store: String,
    latency_ms: Option<f64>,
    processes: usize,
    elapsed_s: f64,
    /// Everything ended before the time limit.
    finished: bool,
    counts: Counts,
    /// Logged in this process (publishers, reads) on TiKV.
    parent_logged: BTreeMap<String, u64>,
    upload_errors: BTreeMap<String, u64>,
    indexed: usize,
    /// Documents by state at the end.
    states: BTreeMap<String, usize>,
    dead: usize,
    batch: BatchRun,
    /// Seconds from the batch's publication to its callback handled.
    callback_s: Option<f64>,
    batch_counts: Option<BatchCounts>,
    problems: Vec<String>,
}

/// Documents by state (missing ones under `missing`).
async fn document_states<E: TitoEngine>(
    db: &E,
    docs: usize,
) -> TitoResult<BTreeMap<String, usize>> {
    let documents = db.clone().model::<Document>();
    let ids: Vec<String> = (0..docs).map(doc_id).collect();
    let mut states = BTreeMap::new();
    for chunk in ids.chunks(500) {
        for row in documents.find_by_ids(chunk).await? {
            let state = row.map_or_else(|| "missing".to_string(), |d| d.state);
            *states.entry(state).or_default() += 1;
        }
    }
    Ok(states)
}

async fn dead_count<E: TitoEngine>(queue: &tito::Queue<E>) -> TitoResult<usize> {
    let mut after: Option<String> = None;
    let mut count = 0;
    loop {
        let page = queue.dead(after.as_deref(), 1000).await?;
        count += page.len();
        if page.len() < 1000 {
            return Ok(count);
        }
        after = page.last().map(|d| d.id.clone());
    }
}

/// Whether the batch's callback fired and its invocation was handled.
async fn callback_handled<E: TitoEngine>(
    graphs: &Graphs<E>,
    reports: &TopicQueue<E, BatchDone<String>>,
) -> TitoResult<bool> {
    let fired = graphs
        .batch(BATCH_ID)
        .await?
        .is_some_and(|state| state.callbacks.iter().any(|(_, fired)| *fired));
    Ok(fired && reports.pending_count(0).await? == 0)
}

/// What the publishers and the watcher saw while the workers ran.
struct Load {
    elapsed_s: f64,
    finished: bool,
    upload_errors: BTreeMap<String, u64>,
    batch: BatchRun,
    callback_s: Option<f64>,
    problems: Vec<String>,
}

/// Publishes the uploads and the batch while the workers run, and waits until every uploaded
/// document is indexed and the batch's callback was handled, or the time limit.
async fn load<E: TitoEngine>(db: &E, settings: &Settings) -> TitoResult<Load> {
    let pipeline = pipeline_spec().open(db.clone()).await?;
    let rows = rows_spec().open(db.clone()).await?;
    let reports = reports_spec().open(db.clone()).await?;
    let graphs = Graphs::new(db.clone());
    let started = Instant::now();
    let deadline = started + settings.timeout;
    let docs = settings.docs;
    let mut publishers = Vec::new();
    for first in 0..PUBLISHERS {
        let (db, graphs, pipeline) = (db.clone(), graphs.clone(), pipeline.clone());
        publishers.push(tokio::spawn(async move {
            let mut uploaded = Vec::new();
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            for n in (first..docs).step_by(PUBLISHERS) {
                match upload(&db, &graphs, &pipeline, n).await {
                    Ok(()) => uploaded.push(doc_id(n)),
                    Err(err) => *errors.entry(normalize(&err.to_string())).or_default() += 1,
                }
            }
            (uploaded, errors)
        }));
    }
    let mut batch_task = {
        let (graphs, rows, reports) = (graphs.clone(), rows.clone(), reports.clone());
        let children = settings.batch;
        tokio::spawn(async move { publish_nightly(&graphs, &rows, &reports, children).await })
    };
    let documents = db.clone().model::<Document>();
    let mut uploaded: Vec<String> = Vec::new();
    let mut upload_errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut uploads_done = false;
    let mut batch: Option<BatchRun> = None;
    let mut callback_s = None;
    let mut problems = Vec::new();
    let mut indexed_all = false;
    loop {
        if !uploads_done && publishers.iter().all(|p| p.is_finished()) {
            for publisher in publishers.drain(..) {
                let (ids, errors) = publisher.await.expect("a publisher panicked");
                uploaded.extend(ids);
                for (text, n) in errors {
                    *upload_errors.entry(text).or_default() += n;
                }
            }
            uploads_done = true;
        }
        if batch.is_none() && batch_task.is_finished() {
            batch = Some(
                (&mut batch_task)
                    .await
                    .expect("the batch publication panicked"),
            );
        }
        if uploads_done && !indexed_all {
            let mut indexed = 0;
            for chunk in uploaded.chunks(500) {
                match documents.find_by_ids(chunk).await {
                    Ok(rows) => {
                        indexed += rows
                            .iter()
                            .filter(|r| r.as_ref().is_some_and(|d| d.state == "indexed"))
                            .count();
                    }
                    Err(err) => problems.push(format!("reading documents: {err}")),
                }
            }
            indexed_all = indexed == uploaded.len();
        }
        if batch.as_ref().is_some_and(|b| b.published) && callback_s.is_none() {
            match callback_handled(&graphs, &reports).await {
                Ok(true) => callback_s = Some(started.elapsed().as_secs_f64()),
                Ok(false) => {}
                Err(err) => problems.push(format!("reading the batch: {err}")),
            }
        }
        let batch_settled = batch.as_ref().is_some_and(|b| !b.published) || callback_s.is_some();
        if uploads_done && indexed_all && batch_settled {
            return Ok(Load {
                elapsed_s: started.elapsed().as_secs_f64(),
                finished: true,
                upload_errors,
                batch: batch.unwrap_or_default(),
                callback_s,
                problems,
            });
        }
        if Instant::now() >= deadline {
            for publisher in publishers {
                publisher.abort();
            }
            if batch.is_none() {
                batch_task.abort();
                problems.push("the batch publication had not returned".to_string());
            }
            problems.push(format!(
                "time limit: uploads {}, all indexed {indexed_all}, callback {}",
                if uploads_done {
                    "done"
                } else {
                    "still running"
                },
                callback_s.is_some()
            ));
            return Ok(Load {
                elapsed_s: started.elapsed().as_secs_f64(),
                finished: false,
                upload_errors,
                batch: batch.unwrap_or_default(),
                callback_s,
                problems,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads the store after the workers stopped.
async fn read_store<E: TitoEngine>(
    db: &E,
    settings: &Settings,
    load: Load,
    counts: Counts,
    run: (&str, Option<f64>, usize),
) -> RunResult {
    let mut problems = load.problems;
    let states = document_states(db, settings.docs)
        .await
        .unwrap_or_else(|err| {
            problems.push(format!("reading documents: {err}"));
            BTreeMap::new()
        });
    let mut dead = 0;
    match pipeline_spec().open(db.clone()).await {
        Ok(queue) => match dead_count(&queue).await {
            Ok(n) => dead += n,
            Err(err) => problems.push(format!("reading dead pipeline invocations: {err}")),
        },
        Err(err) => problems.push(format!("opening pipeline: {err}")),
    }
    match rows_spec().open(db.clone()).await {
        Ok(queue) => match dead_count(&queue).await {
            Ok(n) => dead += n,
            Err(err) => problems.push(format!("reading dead rows: {err}")),
        },
        Err(err) => problems.push(format!("opening rows: {err}")),
    }
    let batch_counts = match Graphs::new(db.clone()).batch(BATCH_ID).await {
        Ok(state) => state.map(|s| s.counts),
        Err(err) => {
            problems.push(format!("reading the batch: {err}"));
            None
        }
    };
    RunResult {
        store: run.0.to_string(),
        latency_ms: run.1,
        processes: run.2,
        elapsed_s: load.elapsed_s,
        finished: load.finished,
        counts,
        parent_logged: BTreeMap::new(),
        upload_errors: load.upload_errors,
        indexed: states.get("indexed").copied().unwrap_or(0),
        states,
        dead,
        batch: load.batch,
        callback_s: load.callback_s,
        batch_counts,
        problems,
    }
}

/// A worker process, killed if it is still running when dropped.
struct WorkerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn spawn_worker(pd: &str) -> std::io::Result<WorkerProcess> {
    let mut child = Command::new(std::env::current_exe()?)
        .env(WORKER_VAR, pd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("a piped stdout");
    let (tell, lines) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tell.send(line).is_err() {
                break;
            }
        }
    });
    Ok(WorkerProcess {
        child,
        stdin,
        lines,
    })
}

impl WorkerProcess {
    async fn ready(&mut self) -> Result<(), String> {
        match tokio::time::timeout(Duration::from_secs(60), self.lines.recv()).await {
            Ok(Some(line)) if line == "ready" => Ok(()),
            Ok(Some(line)) => Err(format!("a worker process said {line:?} first")),
            Ok(None) => Err("a worker process ended before it was ready".to_string()),
            Err(_) => Err("a worker process was not ready within 60 s".to_string()),
        }
    }

    /// Closes its standard input and reads its counts.
    async fn stop(mut self) -> Result<Counts, String> {
        drop(self.stdin.take());
        let read = async {
            while let Some(line) = self.lines.recv().await {
                if let Ok(counts) = serde_json::from_str::<Counts>(&line) {
                    return Ok(counts);
                }
            }
            Err("a worker process ended without its counts".to_string())
        };
        let counts = tokio::time::timeout(Duration::from_secs(120), read)
            .await
            .unwrap_or_else(|_| Err("a worker process gave no counts within 120 s".to_string()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Ok(None) = self.child.try_wait() {
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        counts
    }
}

async fn run_tikv(settings: &Settings, latency_ms: f64, processes: usize) -> RunResult {
    let run = ("tikv", Some(latency_ms), processes);
    let cluster = TestCluster::start().await.expect("start the test server");
    cluster.set_latency(Duration::from_secs_f64(latency_ms / 1000.0));
    let pd = cluster.pd_endpoints()[0].clone();
    let db = TiKV::connect(vec![pd.clone()]).await.expect("connect");
    // Declared before the workers start, as a deploy's first boot does.
    pipeline_spec().open(db.clone()).await.expect("declare");
    rows_spec().open(db.clone()).await.expect("declare");
    reports_spec().open(db.clone()).await.expect("declare");
    take_logged();
    let mut workers = Vec::new();
    let mut problems = Vec::new();
    for _ in 0..processes {
        match spawn_worker(&pd) {
            Ok(worker) => workers.push(worker),
            Err(err) => problems.push(format!("starting a worker process: {err}")),
        }
    }
    for worker in &mut workers {
        if let Err(err) = worker.ready().await {
            problems.push(err);
        }
    }
    let load = match load(&db, settings).await {
        Ok(load) => load,
        Err(err) => panic!("opening the queues: {err}"),
    };
    let mut counts = Counts::default();
    for worker in workers {
        match worker.stop().await {
            Ok(theirs) => counts.merge(theirs),
            Err(err) => problems.push(err),
        }
    }
    let mut result = read_store(&db, settings, load, counts, run).await;
    result.problems.extend(problems);
    result.parent_logged = take_logged();
    drop(db);
    cluster.kill();
    result
}

async fn run_embedded(settings: &Settings) -> RunResult {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let db = Embedded::open(dir.path()).await.expect("open the store");
    take_logged();
    let service = start_service(db.clone()).await.expect("start the workers");
    let load = load(&db, settings).await.expect("opening the queues");
    let counts = service.stop().await;
    let result = read_store(&db, settings, load, counts, ("embedded", None, 1)).await;
    if let Err(err) = db.close().await {
        eprintln!("closing the store: {err}");
    }
    result
}

// ---------------------------------------------------------------------------------------------
// The table.

fn short_error(text: &str) -> String {
    let kind = if text.contains("still conflicted") || text.contains("conflict") {
        "conflict"
    } else if text.contains("timed out") || text.contains("deadline") {
        "timeout"
    } else {
        text.split(':').next().unwrap_or(text)
    };
    let mut kind = kind.to_string();
    kind.truncate(12);
    kind
}

fn print_table(settings: &Settings, results: &[RunResult]) {
    println!();
    println!(
        "document intake under contention: D = {} uploads (4-step workflow each, transactional \
         handlers, 16 per worker), N = {} batch children; TiKV test server latencies {:?} ms, \
         processes {:?}; time limit {} s; {} cores",
        settings.docs,
        settings.batch,
        settings.latencies,
        settings.processes,
        settings.timeout.as_secs(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "{:<9} {:>6} {:>2} {:>8} {:>5} {:>7} {:>6} {:>6} {:>8} {:>5} {:>9} {:>12} {:>6} {:>5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>5}",
        "store",
        "lat ms",
        "P",
        "runs/s",
        "xP1",
        "failed",
        "confl",
        "tito",
        "repl/job",
        "dead",
        "indexed",
        "batch pub",
        "pub s",
        "tries",
        "cb s",
        "p99 p0",
        "p1",
        "p2",
        "p3",
        "end"
    );
    for result in results {
        let counts = &result.counts;
        let acknowledged = counts.total(|f| f.acknowledged);
        let rate = acknowledged as f64 / result.elapsed_s.max(1e-9);
        let one = results.iter().find(|r| {
            r.store == result.store && r.latency_ms == result.latency_ms && r.processes == 1
        });
        let scale = one.map_or("-".to_string(), |one| {
            let base = one.counts.total(|f| f.acknowledged) as f64 / one.elapsed_s.max(1e-9);
            format!("{:.2}", rate / base.max(1e-9))
        });
        let pipeline = counts.figures("pipeline");
        let replays = pipeline.replayed as f64 / pipeline.acknowledged.max(1) as f64;
        let publication = match &result.batch.first_error {
            None if result.batch.attempts == 0 => "none".to_string(),
            None => "ok".to_string(),
            Some(err) => format!("err:{}", short_error(err)),
        };
        let p99 = |partition: usize| {
            counts
                .pipeline_delays
                .get(partition)
                .and_then(|d| percentile(d, 0.99))
                .map_or("-".to_string(), |v| v.to_string())
        };
        println!(
            "{:<9} {:>6} {:>2} {:>8.1} {:>5} {:>7} {:>6} {:>6} {:>8.2} {:>5} {:>9} {:>12} {:>6.2} {:>5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>5}",
            result.store,
            result.latency_ms.map_or("-".to_string(), |l| l.to_string()),
            result.processes,
            rate,
            scale,
            counts.total(|f| f.failed),
            counts.failures(is_conflict),
            counts.failures(names_tito_key),
            replays,
            result.dead,
            format!("{}/{}", result.indexed, settings.docs),
            publication,
            result.batch.first_s,
            format!(
                "{}{}",
                result.batch.attempts,
                if result.batch.published { "" } else { "!" }
            ),
            result
                .callback_s
                .map_or("-".to_string(), |s| format!("{s:.1}")),
            p99(0),
            p99(1),
            p99(2),
            p99(3),
            if result.finished { "done" } else { "limit" },
        );
    }
    println!();
    println!(
        "runs/s: invocations acknowledged per second (pipeline, rows, reports) from the first \
         publication to the end; failed: failed attempts (QueueStats::failed); confl / tito: \
         logged handler failures naming a conflict / one of Tito's keys (lease, queue, batch, \
         workflow); repl/job: replays per pipeline invocation; batch pub: the first \
         publish_batch's result, pub s its seconds, tries the calls made (! when none \
         succeeded: no callback); cb s: seconds to the \
         callback handled; p99 pN: pipeline start delay p99 per partition (ms)."
    );
    for result in results {
        print_details(result);
    }
}

fn print_details(result: &RunResult) {
    let counts = &result.counts;
    println!();
    println!(
        "{} {} ms, {} process(es): {:.1} s{}",
        result.store,
        result.latency_ms.map_or("-".to_string(), |l| l.to_string()),
        result.processes,
        result.elapsed_s,
        if result.finished { "" } else { " (time limit)" }
    );
    for (queue, figures) in &counts.stats {
        println!(
            "  {queue:<9} calls {:>6}  delivered {:>6}  acknowledged {:>6}  failed {:>5}  replayed {:>5}  outcome failures {:>4}  leases lost {:>3}",
            counts.calls.get(queue).copied().unwrap_or(0),
            figures.delivered,
            figures.acknowledged,
            figures.failed,
            figures.replayed,
            figures.outcome_failures,
            figures.leases_lost,
        );
    }
    println!("  documents by state: {:?}", result.states);
    if let Some(p99) = percentile(&counts.row_delays, 0.99) {
        println!(
            "  batch children start delay: p50 {} ms, p99 {p99} ms",
            percentile(&counts.row_delays, 0.5).unwrap_or(0)
        );
    }
    let batch = &result.batch;
    match &batch.first_error {
        Some(err) => println!(
            "  batch publication failed after {:.2} s: {err}",
            batch.first_s
        ),
        None => println!("  batch publication returned after {:.2} s", batch.first_s),
    }
    for err in &batch.later_errors {
        println!("  batch publication again: {err}");
    }
    if !batch.published && batch.attempts > 0 {
        println!(
            "  the batch was never published whole ({} calls): no callback",
            batch.attempts
        );
    }
    if let Some(c) = &result.batch_counts {
        println!(
            "  batch counts: added {}, completed {}, cancelled {}, dead {}",
            c.added, c.completed, c.cancelled, c.dead
        );
    }
    for (text, n) in &result.upload_errors {
        println!("  upload failed x{n}: {text}");
    }
    let mut keys: BTreeMap<&str, u64> = BTreeMap::new();
    for (text, n) in &counts.logged {
        if text.contains("handler failed") {
            for key in conflict_keys(text) {
                *keys.entry(key).or_default() += n;
            }
        }
    }
    if !keys.is_empty() {
        println!("  failed handlers' conflicts by key: {keys:?}");
    }
    let mut logged: Vec<(&String, &u64)> = counts.logged.iter().collect();
    logged.sort_by(|a, b| b.1.cmp(a.1));
    for (text, n) in logged.iter().take(8) {
        println!("  logged x{n}: {text}");
    }
    if logged.len() > 8 {
        println!("  ({} more logged texts)", logged.len() - 8);
    }
    for (text, n) in &result.parent_logged {
        println!("  logged by the publishing process x{n}: {text}");
    }
    for problem in &result.problems {
        println!("  note: {problem}");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    tracing::subscriber::set_global_default(Capture).expect("the only subscriber");
    if let Ok(pd) = std::env::var(WORKER_VAR) {
        worker_process(pd).await;
        return;
    }
    let settings = Settings::from_env();
    let mut results = Vec::new();
    for &latency in &settings.latencies {
        for &processes in &settings.processes {
            eprintln!("tikv, {latency} ms, {processes} process(es)...");
            results.push(run_tikv(&settings, latency, processes).await);
        }
    }
    if settings.embedded {
        eprintln!("embedded, 1 process...");
        results.push(run_embedded(&settings).await);
    }
    print_table(&settings, &results);
}
