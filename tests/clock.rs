//! Due times and the store's clock: a delay is counted on the clock workers compare due times
//! with, so an event never starts before its delay has passed, also when the store's clock runs
//! ahead of the host's (as a local store's does for up to three seconds after a crash).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tito::backend::memory::{Memory, MemoryClock, MemoryOptions};
use tito::{QueueEvent, QueueHandlerOutcome, TitoEngine, WorkerConfig, Workers};

use crate::support::{queue, wait_for};

/// A store whose clock is `ahead` of the host's.
fn store_ahead(ahead: Duration) -> Memory {
    let host_ms = chrono::Utc::now().timestamp_millis() as u64;
    Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime {
        epoch_ms: host_ms + ahead.as_millis() as u64,
    }))
    .unwrap()
}

type Starts = Arc<Mutex<Vec<(String, u32, Instant)>>>;

/// Runs a worker over partition 0 of `queue` that records each start (payload, attempt, when)
/// and reschedules attempt 1 of `"retry"` one second on with `retried_after`.
fn record_starts(queue: Arc<tito::Queue<Memory>>) -> (Workers, Starts) {
    let starts: Starts = Arc::default();
    let sink = starts.clone();
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue,
        WorkerConfig::new(0..1),
        move |event: QueueEvent<String>| {
            let sink = sink.clone();
            async move {
                let first = !sink
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|(p, _, _)| *p == event.payload);
                sink.lock()
                    .unwrap()
                    .push((event.payload.clone(), event.attempt, Instant::now()));
                if event.payload == "retry" && first {
                    return Ok(QueueHandlerOutcome::Reschedule(
                        event.retried_after(Duration::from_secs(1)),
                    ));
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    (workers, starts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_waits_on_the_stores_clock_when_it_runs_ahead_of_the_hosts() {
    let db = store_ahead(Duration::from_millis(3_500));
    let queue = queue(&db, 1);
    let published = Instant::now();
    queue
        .publish(QueueEvent::after(
            "k",
            "later".to_string(),
            Duration::from_secs(2),
        ))
        .await
        .unwrap();
    // Inside a caller's transaction too.
    let in_tx = queue.clone();
    db.transaction(|tx| {
        let queue = in_tx.clone();
        async move {
            queue
                .publish_in_tx(
                    &QueueEvent::after("k", "later in tx".to_string(), Duration::from_secs(2)),
                    &tx,
                )
                .await
        }
    })
    .await
    .unwrap();
    queue
        .publish(QueueEvent::now("k", "now".to_string()))
        .await
        .unwrap();
    queue
        .publish(QueueEvent::now("k", "retry".to_string()))
        .await
        .unwrap();
    let (workers, starts) = record_starts(queue.clone());
    wait_for("every start", Duration::from_secs(30), || {
        let starts = starts.clone();
        async move { starts.lock().unwrap().len() == 5 }
    })
    .await;
    workers.shutdown().await.unwrap();
    let starts = starts.lock().unwrap().clone();
    let at = |payload: &str, nth: usize| {
        starts
            .iter()
            .filter(|(p, _, _)| p == payload)
            .nth(nth)
            .map(|(_, _, at)| *at)
            .unwrap()
    };
    for payload in ["later", "later in tx"] {
        let waited = at(payload, 0) - published;
        assert!(
            waited >= Duration::from_secs(2),
            "{payload:?}, due 2 s after its publication, started after {waited:?}"
        );
    }
    // "now" is due at once on the store's clock, before the delayed ones.
    assert!(at("now", 0) < at("later", 0));
    // A handler's own retry waits its backoff on the store's clock too.
    let backoff = at("retry", 1) - at("retry", 0);
    assert!(
        backoff >= Duration::from_millis(900),
        "a retry due a second after its outcome started after {backoff:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_time_set_by_hand_after_a_delay_is_the_due_time() {
    let db = store_ahead(Duration::ZERO);
    let queue = queue(&db, 1);
    // The caller moved the due time of an event made with a delay into the past: the time it
    // set is the due time, not the delay.
    let mut event = QueueEvent::after("k", "moved".to_string(), Duration::from_secs(3600));
    event.timestamp = 1;
    queue.publish(event).await.unwrap();
    let (workers, starts) = record_starts(queue.clone());
    wait_for("the moved event's start", Duration::from_secs(30), || {
        let starts = starts.clone();
        async move { !starts.lock().unwrap().is_empty() }
    })
    .await;
    workers.shutdown().await.unwrap();
}

/// A resume in this process wakes its workers at once, every time: under paused time, with the
/// idle pause an hour, each of four resumes (at four moments of the worker's `PAUSE_CHECK`
/// period) starts the waiting invocation with no (virtual) time passing. A worker that kept its
/// view of the pauses until it was `PAUSE_CHECK` old would start it only when time jumped
/// there.
#[tokio::test(start_paused = true)]
async fn a_resume_wakes_this_processs_workers_at_once_every_time() {
    use tito::queue::PAUSE_CHECK;
    let db = Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime {
        epoch_ms: 1_700_000_000_000,
    }))
    .unwrap();
    let queue = queue(&db, 1);
    queue
        .publish(QueueEvent::now("k", "first".to_string()))
        .await
        .unwrap();
    let (sender, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.spawn_worker(
        queue.clone(),
        WorkerConfig::new(0..1).max_idle_backoff(Duration::from_secs(3600)),
        move |event: QueueEvent<String>| {
            let sender = sender.clone();
            async move {
                sender.send(event.payload).unwrap();
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    assert_eq!(started.recv().await.unwrap(), "first");
    for cycle in 0..4 {
        assert!(queue.pause(None, "deploy").await.unwrap());
        // The worker sees the pause (its view is read again within PAUSE_CHECK).
        tokio::time::sleep(PAUSE_CHECK * 2).await;
        queue
            .publish(QueueEvent::now("k", format!("cycle {cycle}")))
            .await
            .unwrap();
        // Each cycle resumes at another moment of the worker's PAUSE_CHECK period.
        tokio::time::sleep(PAUSE_CHECK * 3 + PAUSE_CHECK * cycle / 4).await;
        assert!(started.try_recv().is_err(), "nothing starts while paused");
        let resumed = tokio::time::Instant::now();
        assert!(queue.resume(None).await.unwrap());
        assert_eq!(started.recv().await.unwrap(), format!("cycle {cycle}"));
        let waited = resumed.elapsed();
        assert!(
            waited < Duration::from_millis(20),
            "cycle {cycle}: the resumed invocation started {waited:?} after the resume"
        );
    }
    workers.shutdown().await.unwrap();
}
