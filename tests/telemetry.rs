//! Metrics and spans: a recorder and a subscriber installed for one scripted run (a conflict, an
//! unknown outcome, a model insert, kv calls, a queue run with a failure and a reschedule) see
//! the figures the run implies, under the names and labels `tito::telemetry` documents.
//!
//! Both take only this test's thread (`with_local_recorder`; a process-wide subscriber that
//! records spans of the capturing thread only) and the run is driven by a current-thread
//! runtime on that thread, so other tests running at the same time cannot add to the figures.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
    SharedString, Unit,
};
use serde::{Deserialize, Serialize};
use tito::backend::memory::Memory;
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::inbox::{Inbox, InboxConfig, InboxDelivery, InboxOutcome, run_inbox};
use tito::kv::Kv;
use tito::queue::run_worker;
use tito::telemetry::names;
use tito::{
    QueueConfig, QueueEvent, QueueHandlerOutcome, RetryPolicy, TitoEngine, TitoError, TitoModel,
    TitoTransaction, WorkerConfig,
};
use tokio::sync::watch;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};

/// One metric's state: a counter's total, a gauge's last and largest value, a histogram's
/// samples.
#[derive(Default)]
struct Cell {
    total: AtomicU64,
    gauge: Mutex<(f64, f64)>,
    samples: Mutex<Vec<f64>>,
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.total.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.total.fetch_max(value, Ordering::Relaxed);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        let mut g = self.gauge.lock().unwrap();
        g.0 += value;
        g.1 = g.1.max(g.0);
    }
    fn decrement(&self, value: f64) {
        self.gauge.lock().unwrap().0 -= value;
    }
    fn set(&self, value: f64) {
        let mut g = self.gauge.lock().unwrap();
        g.0 = value;
        g.1 = g.1.max(value);
    }
}

impl HistogramFn for Cell {
    fn record(&self, value: f64) {
        self.samples.lock().unwrap().push(value);
    }
}

/// A recorder that keeps every metric by `name{label=value,...}` (labels sorted).
#[derive(Default)]
struct Recorded {
    cells: Mutex<HashMap<String, Arc<Cell>>>,
}

fn key_text(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorded {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        self.cells
            .lock()
            .unwrap()
            .entry(key_text(key))
            .or_default()
            .clone()
    }

    fn get(&self, key: &str) -> Option<Arc<Cell>> {
        self.cells.lock().unwrap().get(key).cloned()
    }

    fn total(&self, key: &str) -> u64 {
        self.get(key).map_or(0, |c| c.total.load(Ordering::Relaxed))
    }

    fn samples(&self, key: &str) -> Vec<f64> {
        self.get(key)
            .map_or_else(Vec::new, |c| c.samples.lock().unwrap().clone())
    }

    /// Every key recorded under `name`.
    fn keys_of(&self, name: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cells
            .lock()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with(&format!("{name}{{")))
            .cloned()
            .collect();
        keys.sort();
        keys
    }
}

impl metrics::Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}

/// A span's fields, as text.
type SpanFields = BTreeMap<String, String>;

/// A subscriber that keeps every span's name and fields, in creation order.
#[derive(Clone, Default)]
struct Spans {
    spans: Arc<Mutex<Vec<(String, SpanFields)>>>,
}

struct Fields<'a>(&'a mut SpanFields);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl Spans {
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        spans.push((span.metadata().name().to_string(), fields));
        Id::from_u64(spans.len() as u64)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        if let Some(entry) = spans.get_mut(span.into_u64() as usize - 1) {
            values.record(&mut Fields(&mut entry.1));
        }
    }
}

thread_local! {
    /// The spans of the test running on this thread, while it captures.
    static CAPTURE: std::cell::RefCell<Option<Spans>> = const { std::cell::RefCell::new(None) };
}

/// The process's subscriber: it hands spans to the capture of the thread that creates them and
/// ignores every other thread. (A subscriber scoped to one thread with `with_default` misses
/// callsites that other tests' threads reach first: tracing caches their interest from those
/// threads' default, which has no subscriber.)
struct Forward;

impl tracing::Subscriber for Forward {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        CAPTURE.with(|c| c.borrow().is_some())
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        CAPTURE
            .with(|c| c.borrow().as_ref().map(|spans| spans.new_span(span)))
            .unwrap_or_else(|| Id::from_u64(u64::MAX))
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        CAPTURE.with(|c| {
            if let Some(spans) = c.borrow().as_ref() {
                spans.record(span, values);
            }
        });
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        CAPTURE.with(|c| {
            if let Some(spans) = c.borrow().as_ref() {
                let mut fields = BTreeMap::new();
                event.record(&mut Fields(&mut fields));
                let name = format!("event:{}", event.metadata().level());
                spans.spans.lock().unwrap().push((name, fields));
            }
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Spans {
    fn named(&self, name: &str) -> Vec<SpanFields> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| f.clone())
            .collect()
    }
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "telemetry_user")]
struct User {
    id: String,
    name: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    step: u32,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "telemetry_mail")]
struct Mail {
    id: String,
    #[tito(group)]
    queue: String,
    #[tito(processed_at)]
    processed_at: Option<i64>,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "telemetry_member")]
struct MemberV1 {
    id: String,
    name: String,
}

/// The next deploy of `MemberV1`: it adds an index over rows that exist.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(table = "telemetry_member")]
#[tito(index = "member_by_name: name")]
struct MemberV2 {
    id: String,
    name: String,
}

/// Runs `script` on a current-thread runtime with the recorder installed and the spans captured
/// for this thread.
fn observed<F: std::future::Future<Output = ()>>(
    script: impl FnOnce(Arc<Recorded>) -> F,
) -> (Arc<Recorded>, Spans) {
    let recorder = Arc::new(Recorded::default());
    let script = script(recorder.clone());
    let spans = Spans::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| tracing::subscriber::set_global_default(Forward).unwrap());
    CAPTURE.with(|c| *c.borrow_mut() = Some(spans.clone()));
    metrics::with_local_recorder(recorder.as_ref(), || runtime.block_on(script));
    CAPTURE.with(|c| *c.borrow_mut() = None);
    (recorder, spans)
}

#[test]
fn a_scripted_run_reports_its_figures_to_the_recorder_and_the_subscriber() {
    let (m, spans) = observed(|m| async move {
        let db = FaultyEngine::new(Memory::new());
        // One conflict, then a commit.
        db.faults()
            .add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).times(1));
        db.transaction(|tx| async move { tx.put(b"n".to_vec(), b"1".to_vec()).await })
            .await
            .unwrap();
        // One commit whose reply is lost, resolved as applied through its marker.
        db.faults()
            .add(FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeCommitted).times(1));
        db.transaction_with(
            RetryPolicy::default().resolve_unknown_outcomes(),
            |tx| async move { tx.put(b"m".to_vec(), b"1".to_vec()).await },
        )
        .await
        .unwrap();
        // And one with the default policy, which reports it.
        db.faults()
            .add(FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeNotCommitted).times(1));
        let unresolved = db
            .transaction(|tx| async move { tx.put(b"o".to_vec(), b"1".to_vec()).await })
            .await;
        assert!(matches!(
            unresolved,
            Err(TitoError::CommitOutcomeUnknown { .. })
        ));

        // Transactions: 4 attempts begun, 2 committed (one through its marker), 1 conflict
        // replayed, 2 unknown outcomes (one resolved, one reported).
        let total = |name: &str| m.total(&format!("{name}{{}}"));
        assert_eq!(total(names::TRANSACTIONS_BEGUN), 4);
        assert_eq!(total(names::TRANSACTIONS_COMMITTED), 2);
        assert_eq!(total(names::TRANSACTIONS_CONFLICTED), 1);
        assert_eq!(total(names::TRANSACTIONS_REPLAYED), 1);
        assert_eq!(
            m.keys_of(names::TRANSACTIONS_UNKNOWN),
            vec![
                format!("{}{{resolution=committed}}", names::TRANSACTIONS_UNKNOWN),
                format!("{}{{resolution=unresolved}}", names::TRANSACTIONS_UNKNOWN),
            ]
        );
        for key in m.keys_of(names::TRANSACTIONS_UNKNOWN) {
            assert_eq!(m.total(&key), 1, "{key}");
        }
        let commits = m.samples(&format!("{}{{}}", names::COMMIT_SECONDS));
        assert_eq!(commits.len(), 4, "one commit time per commit call");
        assert!(
            commits.iter().all(|s| (0.0..5.0).contains(s)),
            "{commits:?}"
        );

        let db = db.inner().clone();
        db.clone()
            .model::<User>()
            .build(User {
                id: "u1".into(),
                name: "Ada".into(),
            })
            .await
            .unwrap();

        let kv = Kv::new(db.clone());
        kv.put("sessions", "s1", &1, None, None).await.unwrap();
        kv.get("sessions", "s1").await.unwrap();
        kv.incr("sessions", "hits", 2, None).await.unwrap();
        kv.list("sessions", "", 10, None).await.unwrap();
        kv.delete("sessions", "s1", None).await.unwrap();

        // A queue run: a (acknowledged), b (fails once, then acknowledged), c (rescheduled
        // once, then acknowledged). All three were due 10 s ago.
        let queue = Arc::new(tito::Queue::new(
            db.clone(),
            QueueConfig::new(2, Duration::from_secs(3600)).topic("telemetry"),
        ));
        let due = chrono::Utc::now().timestamp() - 10;
        for id in ["a", "b", "c"] {
            // b's key is a model event's (`{table}:{id}`): log lines show it as written.
            let key = if id == "b" { "posting:p1-179" } else { id };
            let event = QueueEvent::new(key, Job { step: 0 }, due).with_id(id);
            queue.publish(event).await.unwrap();
        }
        let (failed_once, rescheduled_once) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let handler = move |event: QueueEvent<Job>| {
            let (failed_once, rescheduled_once) = (failed_once.clone(), rescheduled_once.clone());
            async move {
                if event.id == "b" && !failed_once.swap(true, Ordering::SeqCst) {
                    return Err(TitoError::handler("b fails once"));
                }
                if event.id == "c" && !rescheduled_once.swap(true, Ordering::SeqCst) {
                    let next = event.rescheduled(due);
                    return Ok(QueueHandlerOutcome::Reschedule(next));
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        };
        let (stop, shutdown) = watch::channel(false);
        let config = WorkerConfig::new(0..2)
            .max_idle_backoff(Duration::from_millis(20))
            .worker_id("telemetry-worker");
        let worker = tokio::spawn(run_worker(queue.clone(), config, handler, shutdown));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while queue.completed_count().await.unwrap() < 4 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the queue run did not finish: {:?}, {} completed",
                queue.stats(),
                queue.completed_count().await.unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.send(true).unwrap();
        worker.await.unwrap().unwrap();
        assert_eq!(queue.completed_count().await.unwrap(), 4);

        // An inbox: two rows of group `tele`, claimed and acknowledged.
        for id in ["m1", "m2"] {
            db.clone()
                .model::<Mail>()
                .build(Mail {
                    id: id.into(),
                    queue: "tele".into(),
                    processed_at: None,
                })
                .await
                .unwrap();
        }
        let inbox = Arc::new(Inbox::<_, Mail>::new(db.clone()).unwrap());
        let (stop, shutdown) = watch::channel(false);
        let config = InboxConfig::new("tele").max_idle(Duration::from_millis(20));
        let handler = |_: InboxDelivery<serde_json::Value>| async { Ok(InboxOutcome::Ack) };
        let subscription = tokio::spawn(run_inbox(inbox.clone(), config, handler, shutdown));
        while inbox.stats().completed < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the inbox run did not finish"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.send(true).unwrap();
        subscription.await.unwrap().unwrap();

        // An index build: three rows of one deploy, an index added by the next.
        tito::schema::set_write_grace(&db, Duration::from_millis(50)).unwrap();
        for (id, name) in [("1", "ada"), ("2", "bob"), ("3", "cy")] {
            db.clone()
                .model::<MemberV1>()
                .build(MemberV1 {
                    id: id.into(),
                    name: name.into(),
                })
                .await
                .unwrap();
        }
        db.clone()
            .model::<MemberV2>()
            .build_indexes(|_| {})
            .await
            .unwrap();
    });

    // Kv: one per call.
    for operation in ["put", "get", "incr", "list", "delete"] {
        let key = format!("{}{{operation={operation}}}", names::KV_OPERATIONS);
        assert_eq!(m.total(&key), 1, "{key}");
    }

    // The queue.
    let q = |name: &str| format!("{name}{{queue=telemetry}}");
    assert_eq!(m.total(&q(names::QUEUE_PUBLISHED)), 3);
    assert_eq!(
        m.total(&q(names::QUEUE_DELIVERED)),
        5,
        "a, b twice, c twice"
    );
    assert_eq!(m.total(&q(names::QUEUE_ACKNOWLEDGED)), 3);
    assert_eq!(m.total(&q(names::QUEUE_RESCHEDULED)), 1);
    assert_eq!(m.total(&q(names::QUEUE_FAILED)), 1);
    assert_eq!(m.total(&q(names::QUEUE_OUTCOME_FAILURES)), 0);
    assert_eq!(m.samples(&q(names::QUEUE_HANDLER_SECONDS)).len(), 5);
    let lateness = m.samples(&q(names::QUEUE_LATENESS_SECONDS));
    assert_eq!(lateness.len(), 5);
    assert!(
        lateness.iter().all(|s| (9.0..60.0).contains(s)),
        "every delivery was about 10 s late: {lateness:?}"
    );
    let batches = m.samples(&q(names::QUEUE_OUTCOME_BATCH));
    assert_eq!(batches.iter().sum::<f64>(), 4.0, "4 outcomes: {batches:?}");
    let held = m
        .get(&format!(
            "{}{{queue=telemetry,worker=telemetry-worker}}",
            names::QUEUE_LEASES_HELD
        ))
        .expect("the worker reported its leases");
    let (now, peak) = *held.gauge.lock().unwrap();
    assert_eq!((now, peak), (0.0, 2.0), "both leases held, then released");

    // The inbox and the index build.
    let mail = "table=telemetry_mail";
    assert_eq!(
        m.total(&format!("{}{{group=tele,{mail}}}", names::INBOX_CLAIMED)),
        2
    );
    assert_eq!(
        m.keys_of(names::INBOX_OUTCOMES),
        vec![format!(
            "{}{{group=tele,outcome=ack,{mail}}}",
            names::INBOX_OUTCOMES
        )]
    );
    assert_eq!(
        m.total(&format!(
            "{}{{group=tele,outcome=ack,{mail}}}",
            names::INBOX_OUTCOMES
        )),
        2
    );
    let build = "index=member_by_name,table=telemetry_member,work=build";
    assert_eq!(m.total(&format!("{}{{{build}}}", names::SCHEMA_ROWS)), 3);
    assert_eq!(
        m.total(&format!("{}{{{build}}}", names::SCHEMA_FINISHED)),
        1
    );

    // Spans.
    let deliveries = spans.named("tito.inbox.delivery");
    let mut delivered: Vec<&str> = deliveries.iter().map(|f| f["id"].as_str()).collect();
    delivered.sort_unstable();
    assert_eq!(delivered, ["m1", "m2"]);
    assert!(
        deliveries
            .iter()
            .all(|f| f["table"] == "telemetry_mail" && f["group"] == "tele")
    );
    let attempts = spans.named("tito.transaction");
    assert_eq!(attempts[0]["attempt"], "1");
    assert_eq!(attempts[0]["outcome"], "conflict");
    assert_eq!(attempts[1]["attempt"], "2");
    assert_eq!(attempts[1]["outcome"], "committed");
    assert_eq!(attempts[2]["outcome"], "unknown");
    assert!(
        attempts.iter().all(|a| a.contains_key("outcome")),
        "every attempt ends with an outcome"
    );
    let models = spans.named("tito.model");
    assert!(
        models.iter().any(|f| f["table"] == "telemetry_user"
            && f["operation"] == "insert"
            && f["id"] == "u1"),
        "{models:?}"
    );
    let handlers = spans.named("tito.queue.handler");
    let mut ids: Vec<&str> = handlers.iter().map(|f| f["event_id"].as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["a", "b", "b", "c", "c"]);
    assert!(handlers.iter().all(|f| f["queue"] == "telemetry"
        && f["partition"].parse::<u32>().is_ok_and(|p| p < 2)
        && f["due"].parse::<i64>().is_ok()));
    assert!(
        spans
            .named("tito.maintenance")
            .iter()
            .any(|f| f["queue"] == "telemetry")
    );
    // Log lines name the queue, the event id and the key as the user wrote them, never the
    // escaped storage key.
    let warnings = spans.named("event:WARN");
    let failed: Vec<_> = warnings
        .iter()
        .filter(|f| {
            f.get("message")
                .is_some_and(|m| m.starts_with("handler failed"))
        })
        .collect();
    assert_eq!(failed.len(), 1, "{warnings:?}");
    assert_eq!(failed[0]["queue"], "telemetry");
    assert_eq!(failed[0]["event_id"], "b");
    assert_eq!(failed[0]["key"], "posting:p1-179");
    assert!(handlers.iter().any(|f| f["key"] == "posting:p1-179"));
    for (name, fields) in spans.spans.lock().unwrap().iter() {
        for value in fields.values() {
            assert!(
                !value.contains(";<") && !value.contains("telemetry:pending:"),
                "{name} holds a storage key: {fields:?}"
            );
        }
    }
}

#[test]
fn every_documented_name_is_a_prometheus_name() {
    for name in names::ALL {
        assert!(name.starts_with("tito_"), "{name}");
        assert!(
            name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
            "{name}"
        );
    }
    let docs = include_str!("../tito/src/telemetry.rs");
    for name in names::ALL {
        assert!(
            docs.contains(&format!("| `{name}` |")),
            "{name} is in the table"
        );
    }
}
