//! The inspection calls operator tools read through: bounded counts, pages with cursors,
//! malformed rows returned raw, refusals of bad arguments.

use std::time::Duration;

use tito::backend::memory::Memory;
use tito::inspect::{self, QueueState};
use tito::keys;
use tito::kv::Kv;
use tito::{Queue, QueueConfig, QueueEvent, TitoEngine, TitoError, TitoTransaction};

async fn put(db: &Memory, key: &str, value: &[u8]) {
    let tx = db.begin().await.unwrap();
    tx.put(key.as_bytes().to_vec(), value.to_vec())
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn queues_are_listed_and_overviewed_with_bounded_counts() {
    let db = Memory::new();
    let mail = Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("mail:out"),
    );
    let default = Queue::new(db.clone(), QueueConfig::new(3, Duration::from_secs(3600)));
    let now = chrono::Utc::now().timestamp();
    for i in 0..5 {
        mail.publish(QueueEvent::new(format!("k{i}"), i, now - 30))
            .await
            .unwrap();
    }
    for i in 0..3 {
        mail.publish(QueueEvent::new(format!("k{i}"), i, now + 3600))
            .await
            .unwrap();
    }
    default.publish(QueueEvent::new("x", 0, 0)).await.unwrap();

    let queues = inspect::queues(&db, 10).await.unwrap();
    let labels: Vec<(&str, Option<u32>)> = queues
        .iter()
        .map(|q| (q.label.as_str(), q.partitions))
        .collect();
    assert_eq!(labels, [("default", Some(3)), ("mail:out", Some(2))]);
    assert_eq!(inspect::queues(&db, 1).await.unwrap().len(), 1);

    let overview = inspect::queue_overview(&db, Some("mail:out"))
        .await
        .unwrap();
    assert_eq!(overview.partitions.len(), 2);
    assert_eq!(overview.due_now.value, 5);
    assert_eq!(overview.future.value, 3);
    assert!(!overview.due_now.more);
    assert_eq!(overview.oldest_due, Some((now - 30) as u64));
    let late = overview
        .partitions
        .iter()
        .filter(|p| p.due_now.value > 0)
        .map(|p| p.oldest_late_s)
        .max()
        .unwrap();
    assert!((29..120).contains(&late), "about 30 s late: {late}");
    assert_eq!(overview.completed.value, 0);
    assert_eq!(
        overview.completed_per_minute.len() as u64,
        inspect::THROUGHPUT_MINUTES
    );
    assert!(overview.partitions.iter().all(|p| p.lease.is_none()));

    // Every pending row of both partitions, paged two at a time.
    let mut seen = 0;
    for partition in 0..2 {
        let mut cursor = None;
        loop {
            let page = inspect::queue_scan(
                &db,
                Some("mail:out"),
                QueueState::Pending(partition),
                cursor.as_deref(),
                2,
            )
            .await
            .unwrap();
            for row in &page.items {
                assert_eq!(row.partition, Some(partition));
                assert!(row.malformed.is_none(), "{row:?}");
                assert!(row.event.is_some());
            }
            seen += page.items.len();
            match page.cursor {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
    }
    assert_eq!(seen, 8);
}

#[tokio::test]
async fn malformed_queue_rows_come_back_raw() {
    let db = Memory::new();
    let queue = Queue::new(db.clone(), QueueConfig::new(1, Duration::from_secs(3600)));
    queue.publish(QueueEvent::new("a", 1, 0)).await.unwrap();
    let root = keys::queue_root(None);
    // A row whose value is not an invocation, and one whose key does not parse.
    put(
        &db,
        &keys::pending_key(&root, 0, 5, 1, "bad"),
        b"\xffnot json",
    )
    .await;
    put(&db, &format!("{root}:pending:0000:oops"), b"{}").await;
    let page = inspect::queue_scan(&db, None, QueueState::Pending(0), None, 10)
        .await
        .unwrap();
    assert_eq!(page.items.len(), 3);
    let bad: Vec<_> = page
        .items
        .iter()
        .filter(|r| r.malformed.is_some())
        .collect();
    assert_eq!(bad.len(), 2, "{:?}", page.items);
    assert!(
        bad.iter()
            .any(|r| r.raw.as_deref().is_some_and(|raw| raw.contains("not json")))
    );
    assert!(bad.iter().any(|r| r.key.ends_with(":oops")));
    // The overview still counts them (they are pending keys).
    let overview = inspect::queue_overview(&db, None).await.unwrap();
    assert_eq!(overview.due_now.value + overview.future.value, 3);
}

#[tokio::test]
async fn counts_stop_at_their_bound_and_say_so() {
    let db = Memory::new();
    let tx = db.begin().await.unwrap();
    for i in 0..25 {
        tx.put(format!("table:t:{i:03}").into_bytes(), b"{}".to_vec())
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let exact = inspect::count_prefix(&db, "table:t:", 25).await.unwrap();
    assert_eq!((exact.value, exact.more), (25, false));
    let bounded = inspect::count_prefix(&db, "table:t:", 24).await.unwrap();
    assert_eq!((bounded.value, bounded.more), (24, true));
    assert_eq!(bounded.to_string(), "24+");
    let one = inspect::count_prefix(&db, "table:t:", 1).await.unwrap();
    assert_eq!((one.value, one.more), (1, true));
    for bad in [0, 10_000_001] {
        assert!(matches!(
            inspect::count_prefix(&db, "table:t:", bad).await,
            Err(TitoError::InvalidArgument(_))
        ));
    }
    assert_eq!(inspect::table_count(&db, "t").await.unwrap().value, 25);
}

#[tokio::test]
async fn tables_rows_and_namespaces_are_listed_raw() {
    let db = Memory::new();
    put(&db, &keys::row_key("user", "a"), br#"{"id":"a"}"#).await;
    put(&db, &keys::row_key("user", "b:2"), b"not json").await;
    put(&db, &keys::row_key("user:x", "c"), br#"{"id":"c"}"#).await;
    put(&db, &keys::row_key("order", "1"), br#"{"id":"1"}"#).await;
    assert_eq!(
        inspect::tables(&db, 10).await.unwrap(),
        ["order", "user", "user:x"]
    );
    let first = inspect::table_rows(&db, "user", None, 1).await.unwrap();
    assert_eq!(first.items[0].id.as_deref(), Some("a"));
    assert!(first.items[0].value.is_some());
    let second = inspect::table_rows(&db, "user", first.cursor.as_deref(), 1)
        .await
        .unwrap();
    assert_eq!(second.items[0].id.as_deref(), Some("b:2"));
    assert_eq!(second.items[0].raw.as_deref(), Some("not json"));
    assert!(second.cursor.is_none(), "user:x is another table");
    // A cursor of another table is refused.
    let other = inspect::table_rows(&db, "order", first.cursor.as_deref(), 1).await;
    assert!(matches!(other, Err(TitoError::InvalidArgument(_))));
    for limit in [0, tito::model::MAX_PAGE_LIMIT + 1] {
        assert!(matches!(
            inspect::table_rows(&db, "user", None, limit).await,
            Err(TitoError::InvalidArgument(_))
        ));
    }
    assert!(
        inspect::table_row(&db, "user", "zz")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        inspect::table_row(&db, "user", "a")
            .await
            .unwrap()
            .unwrap()
            .value
            .unwrap()["id"],
        "a"
    );

    let kv = Kv::new(db.clone());
    kv.put("sessions", "s1", &1, None, None).await.unwrap();
    kv.put("rate:limits", "r", &1, None, None).await.unwrap();
    assert_eq!(
        inspect::kv_namespaces(&db, 10).await.unwrap(),
        ["rate:limits", "sessions"]
    );
    assert_eq!(inspect::kv_count(&db, "sessions").await.unwrap().value, 1);

    assert_eq!(
        inspect::key_segments(keys::row_key("user", "b:2").as_bytes()).unwrap(),
        ["table", "user", "b:2"]
    );
    // A key that is not UTF-8 text (no key Tito writes): its segments, those that are not
    // text in the quoted form keys print in, given raw or printed.
    assert_eq!(
        inspect::key_segments(b"t:\xff").unwrap(),
        ["t", r#""\xff""#]
    );
    assert_eq!(
        inspect::key_segments(br#""t:\xff""#).unwrap(),
        ["t", r#""\xff""#]
    );
}

/// Two workers run one queue at once, one handler in four failing: each worker's report names
/// its process and counts its own runs, the overview sums them, and a report nobody wrote for
/// longer than `REPORT_KEPT` is deleted when a worker starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_report_their_host_age_and_handler_figures() {
    use tito::queue::FailurePolicy;
    use tito::{QueueHandlerOutcome, WorkerConfig, Workers};
    let db = tito::Embedded::temporary().await.unwrap();
    let queue = std::sync::Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("reports"),
    ));
    let root = keys::queue_root(Some("reports"));
    // A report of a worker gone for two hours, and one that does not parse (kept for an operator).
    let stale = serde_json::json!({
        "worker": "gone", "runner": "pid 1 on elsewhere", "started_ms": 1, "written_ms": 1,
        "stopped": false, "minutes": []
    });
    let tx = db.begin().await.unwrap();
    tx.put(
        format!("{root}:report:gone").into_bytes(),
        serde_json::to_vec(&stale).unwrap(),
    )
    .await
    .unwrap();
    tx.put(
        format!("{root}:report:odd").into_bytes(),
        b"not json".to_vec(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    for n in 0..20u32 {
        queue
            .publish(QueueEvent::now(format!("k{n}"), n))
            .await
            .unwrap();
    }
    let mut workers = Workers::new();
    for (id, parts) in [("left", 0..2), ("right", 2..4)] {
        let config = WorkerConfig::new(parts)
            .worker_id(id)
            .failure_policy(FailurePolicy::new(1))
            .max_idle_backoff(Duration::from_millis(20));
        workers.spawn_worker(queue.clone(), config, |event: QueueEvent<u32>| async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if event.payload.is_multiple_of(4) {
                return Err(TitoError::InvalidArgument("one in four fails".into()));
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        });
    }
    let settled = || async {
        let o = inspect::queue_overview(&db, Some("reports")).await.unwrap();
        o.completed.value + o.dead.value == 20
    };
    crate::support::wait_for("every row settled", Duration::from_secs(30), settled).await;
    workers.shutdown().await.unwrap();

    let o = inspect::queue_overview(&db, Some("reports")).await.unwrap();
    let mut names: Vec<&str> = o.workers.iter().map(|w| w.worker.as_str()).collect();
    names.sort();
    assert_eq!(names, ["left", "right"], "the stale report was swept");
    let this = format!("pid {} on ", std::process::id());
    for w in &o.workers {
        assert!(w.runner.starts_with(&this), "{}", w.runner);
        assert!(
            w.stopped,
            "{} wrote its last report as it stopped",
            w.worker
        );
        assert!(w.started_ms <= w.written_ms && w.written_ms <= o.now_ms);
    }
    let runs: u64 = o.workers.iter().map(|w| w.since(0).runs).sum();
    assert_eq!(runs, 20, "each run counted once, by the worker that ran it");
    assert_eq!((o.handlers.runs, o.handlers.failed), (20, 5));
    assert!(o.handlers.max_ms >= 2 && o.handlers.mean_ms().unwrap() >= 2);
    // The one that does not parse is left for an operator.
    let odd = crate::support::read(&db, format!("{root}:report:odd").as_bytes()).await;
    assert!(odd.is_some());
    db.close().await.unwrap();
}

/// A worker's report carries an hour of figures per partition and a depth sample of the
/// partitions it holds; the overview's hour sums every report, so a worker stopped and another
/// started add up, and each partition's hour adds up to the queue's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_chart_each_partitions_hour_across_a_restart() {
    use tito::queue::FailurePolicy;
    use tito::{QueueHandlerOutcome, WorkerConfig, Workers};
    let dir = tempfile::tempdir().unwrap();
    let db = tito::Embedded::open(dir.path()).await.unwrap();
    let queue = std::sync::Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("hour"),
    ));
    for n in 0..40u32 {
        queue
            .publish(QueueEvent::now(format!("k{n}"), n))
            .await
            .unwrap();
    }
    // The first handler waits at a gate: the forty rows stay due while the worker samples.
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let handler = |gate: std::sync::Arc<tokio::sync::Semaphore>| {
        move |event: QueueEvent<u32>| {
            let gate = gate.clone();
            async move {
                drop(gate.acquire().await.unwrap());
                if event.payload.is_multiple_of(5) {
                    return Err(TitoError::InvalidArgument("one in five fails".into()));
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    let config = |id: &str| {
        WorkerConfig::new(0..4)
            .worker_id(id)
            .concurrency(1)
            .failure_policy(FailurePolicy::new(1))
            .max_idle_backoff(Duration::from_millis(20))
    };
    let mut workers = Workers::new();
    workers.spawn_worker(queue.clone(), config("a"), handler(gate.clone()));
    let sampled = || async {
        let o = inspect::queue_overview(&db, Some("hour")).await.unwrap();
        o.workers.iter().any(|w| {
            w.minutes
                .iter()
                .any(|m| m.depth.len() == 4 && m.depth.iter().map(|d| d.due).sum::<u64>() == 40)
        })
    };
    crate::support::wait_for(
        "a depth sample of all four partitions",
        Duration::from_secs(30),
        sampled,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.add_permits(1_000);
    let settled = |n: u64| {
        let db = db.clone();
        move || {
            let db = db.clone();
            async move {
                let o = inspect::queue_overview(&db, Some("hour")).await.unwrap();
                o.completed.value + o.dead.value == n
            }
        }
    };
    crate::support::wait_for(
        "the first forty settled",
        Duration::from_secs(30),
        settled(40),
    )
    .await;
    workers.shutdown().await.unwrap();

    // Another worker, after the first stopped, runs ten more.
    for n in 40..50u32 {
        queue
            .publish(QueueEvent::now(format!("k{n}"), n))
            .await
            .unwrap();
    }
    let mut workers = Workers::new();
    workers.spawn_worker(queue.clone(), config("b"), handler(gate.clone()));
    crate::support::wait_for("all fifty settled", Duration::from_secs(30), settled(50)).await;
    workers.shutdown().await.unwrap();

    let o = inspect::queue_overview(&db, Some("hour")).await.unwrap();
    assert_eq!(o.hour.len(), 60);
    assert!(o.hour.windows(2).all(|w| w[1].minute == w[0].minute + 1));
    assert_eq!(o.hour.last().unwrap().minute, o.now_ms / 60_000);
    let runs: u64 = o.hour.iter().map(|m| m.runs).sum();
    let failed: u64 = o.hour.iter().map(|m| m.failed).sum();
    assert_eq!((runs, failed), (50, 10), "both workers' runs, each once");
    let late_max = o.hour.iter().map(|m| m.late_max_ms).max().unwrap();
    assert!(late_max >= 300, "rows waited at the gate: {late_max} ms");
    // Each partition's hour adds up to the queue's, minute by minute.
    assert_eq!(o.partition_hours.len(), 4);
    for (at, minute) in o.hour.iter().enumerate() {
        let (mut runs, mut failed) = (0, 0);
        for p in 0..4 {
            let of_p = &o.hour_of(Some(p))[at];
            assert_eq!(of_p.minute, minute.minute);
            runs += of_p.runs;
            failed += of_p.failed;
        }
        assert_eq!((runs, failed), (minute.runs, minute.failed), "minute {at}");
    }
    let handled: u64 = o.partition_hours.iter().map(|p| p.total.handled()).sum();
    assert_eq!(handled, 40);
    for p in &o.partition_hours {
        assert_eq!(p.handled.len(), 60);
        assert_eq!(p.handled.iter().sum::<u64>(), p.total.handled());
        // This minute's depth is the overview's own count: nothing is due.
        assert_eq!(p.total.due, Some(0));
    }
    // The sample the first worker took, in a past minute or this one's report.
    let forty = o
        .workers
        .iter()
        .flat_map(|w| &w.minutes)
        .any(|m| m.depth.iter().map(|d| d.due).sum::<u64>() == 40);
    assert!(forty, "{:?}", o.workers);
    db.close().await.unwrap();
}

/// A worker started again under its id (a fixed `worker_id`) carries its earlier runs' hour on:
/// three runs of one id, the store reopened between the second and the third, count every
/// handler run once, in one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_under_its_id_keeps_its_hour() {
    use tito::{QueueHandlerOutcome, WorkerConfig, Workers};
    let dir = tempfile::tempdir().unwrap();
    let mut db = tito::Embedded::open(dir.path()).await.unwrap();
    for life in 1..=3u64 {
        if life == 3 {
            db.close().await.unwrap();
            db = tito::Embedded::open(dir.path()).await.unwrap();
        }
        let queue = std::sync::Arc::new(Queue::new(
            db.clone(),
            QueueConfig::new(2, Duration::from_secs(3600)).topic("lives"),
        ));
        for n in 0..5 {
            queue
                .publish(QueueEvent::now(format!("k{life}-{n}"), n))
                .await
                .unwrap();
        }
        let mut workers = Workers::new();
        workers.spawn_worker(
            queue.clone(),
            WorkerConfig::new(0..2)
                .worker_id("fixed")
                .max_idle_backoff(Duration::from_millis(20)),
            |_: QueueEvent<u32>| async move { Ok(QueueHandlerOutcome::Acknowledge) },
        );
        let db2 = db.clone();
        crate::support::wait_for("this run's five", Duration::from_secs(30), move || {
            let db = db2.clone();
            async move {
                let o = inspect::queue_overview(&db, Some("lives")).await.unwrap();
                o.completed.value == 5 * life
            }
        })
        .await;
        workers.shutdown().await.unwrap();
        let o = inspect::queue_overview(&db, Some("lives")).await.unwrap();
        let runs: u64 = o.hour.iter().map(|m| m.runs).sum();
        assert_eq!(
            runs,
            5 * life,
            "run {life}: every run's handlers, each once"
        );
        let by_partition: u64 = o.partition_hours.iter().map(|p| p.total.runs).sum();
        assert_eq!(by_partition, 5 * life, "run {life}");
        assert_eq!(
            o.handlers.runs,
            5 * life,
            "run {life}: the last minutes too"
        );
        let rows: Vec<_> = o.workers.iter().filter(|w| w.worker == "fixed").collect();
        assert_eq!(rows.len(), 1, "one row for the id");
        assert!(rows[0].stopped, "run {life}");
        let since = o.now_ms / 60_000 - 60;
        assert_eq!(rows[0].since(since).runs, 5 * life, "run {life}");
    }
    db.close().await.unwrap();
}

/// A worker that holds more partitions than it samples a minute counts them in turn: a minute's
/// depth sums each partition's last count at or before it, across workers, and the current
/// minute is the overview's own count.
#[tokio::test]
async fn a_partition_counted_in_turn_keeps_its_last_depth() {
    use tito::queue::{DepthSample, MinuteFigures, WorkerReport};
    let db = Memory::new();
    let queue = Queue::new(
        db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("turns"),
    );
    queue.publish(QueueEvent::now("a", 1u32)).await.unwrap();
    queue.publish(QueueEvent::now("b", 2u32)).await.unwrap();
    let root = keys::queue_root(Some("turns"));
    let now_min = chrono::Utc::now().timestamp() as u64 / 60;
    let sampled = |minute: u64, partition: u32, due: u64| MinuteFigures {
        minute,
        depth: vec![DepthSample {
            partition,
            due,
            more: false,
            oldest_late_s: due,
            at_ms: minute * 60_000 + 1_000,
        }],
        ..MinuteFigures::default()
    };
    let report = |worker: &str, minutes: Vec<MinuteFigures>| WorkerReport {
        worker: worker.into(),
        runner: "pid 1 on h".into(),
        started_ms: (now_min - 30) * 60_000,
        written_ms: now_min * 60_000,
        stopped: true,
        minutes,
    };
    let (m5, m4, m3, m2, m1) = (
        now_min - 5,
        now_min - 4,
        now_min - 3,
        now_min - 2,
        now_min - 1,
    );
    let tx = db.begin().await.unwrap();
    for (worker, minutes) in [
        ("one", vec![sampled(m3, 1, 4), sampled(m5, 0, 7)]),
        ("two", vec![sampled(m2, 0, 1)]),
    ] {
        tx.put(
            format!("{root}:report:{worker}").into_bytes(),
            serde_json::to_vec(&report(worker, minutes)).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let o = inspect::queue_overview(&db, Some("turns")).await.unwrap();
    let at = |minute: u64| {
        let m = o.hour.iter().find(|m| m.minute == minute).unwrap();
        (m.due, m.sampled, m.oldest_late_s)
    };
    assert_eq!(at(m5 - 1), (None, 0, None), "nothing counted yet");
    assert_eq!(at(m5), (Some(7), 1, Some(7)));
    assert_eq!(at(m4), (Some(7), 1, Some(7)), "partition 0 keeps its count");
    assert_eq!(at(m3), (Some(11), 2, Some(7)));
    assert_eq!(
        at(m2),
        (Some(5), 2, Some(4)),
        "another worker's later count of 0"
    );
    assert_eq!(at(m1), (Some(5), 2, Some(4)));
    let current = o.hour.last().unwrap();
    assert_eq!(
        (current.due, current.sampled),
        (Some(2), 2),
        "this minute: counted now"
    );
    // One partition's hour: its own counts only.
    let zero = o.hour_of(Some(0));
    let of = |minute: u64| zero.iter().find(|m| m.minute == minute).unwrap().due;
    assert_eq!((of(m5), of(m3), of(m2)), (Some(7), Some(7), Some(1)));
}

/// The search finds an owner's invocations (written `kind:id`), pending and completed, in
/// every partition, besides ids and business keys.
#[tokio::test]
async fn a_search_finds_an_owners_invocations_in_every_partition() {
    let db = Memory::new();
    let queue = Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("owned"),
    );
    let owner = tito::QueueOwner::new("account", "7");
    let mut ids = Vec::new();
    for n in 0..6u32 {
        let event = QueueEvent::now(format!("key-{n}"), n).with_owner(owner.clone());
        ids.push(event.id.clone());
        queue.publish(event).await.unwrap();
    }
    queue
        .publish(QueueEvent::now("other", 99u32).with_owner(tito::QueueOwner::new("account", "8")))
        .await
        .unwrap();
    let found = inspect::queue_find(&db, Some("owned"), "account:7", 100)
        .await
        .unwrap();
    let mut got: Vec<String> = found
        .iter()
        .map(|r| r.event.as_ref().unwrap().id.clone())
        .collect();
    got.sort();
    ids.sort();
    assert_eq!(got, ids);
    let partitions: std::collections::HashSet<_> = found.iter().map(|r| r.partition).collect();
    assert!(
        partitions.len() > 1,
        "rows of several partitions: {partitions:?}"
    );
    // Bounded by the limit; an owner with nothing, or half an owner, finds nothing.
    let two = inspect::queue_find(&db, Some("owned"), "account:7", 2)
        .await
        .unwrap();
    assert_eq!(two.len(), 2);
    for none in ["account:9", "account:", ":7"] {
        assert!(
            inspect::queue_find(&db, Some("owned"), none, 100)
                .await
                .unwrap()
                .is_empty()
        );
    }
}

/// A queue's page (overview, pending rows, completed rows) is one snapshot: a write that lands
/// while the page is being read is in all three parts or in none. The second transaction the
/// page opens is held for a second while another writer publishes; read in several
/// transactions, the pending rows would show the new invocation beside an overview that does
/// not count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_page_is_read_in_one_snapshot() {
    use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
    let db = FaultyEngine::new(Memory::new());
    let config = QueueConfig::new(1, Duration::from_secs(3600)).topic("snap");
    let queue = Queue::new(db.inner().clone(), config.clone());
    queue.publish(QueueEvent::now("a", 1)).await.unwrap();
    db.faults().add(
        FaultRule::new(FaultPoint::Begin, Fault::Delay(Duration::from_secs(1)))
            .skip(1)
            .times(1),
    );
    let begins = db.faults().calls(FaultPoint::Begin);
    let writer = {
        let faults = db.faults().clone();
        tokio::spawn(async move {
            while faults.calls(FaultPoint::Begin) < begins + 2 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            queue.publish(QueueEvent::now("b", 2)).await.unwrap();
        })
    };
    let view = inspect::queue_view(&db, Some("snap"), None, None, None, 10)
        .await
        .unwrap();
    writer.await.unwrap();
    assert_eq!(
        db.faults().injected(),
        1,
        "the page's second begin was held"
    );
    assert_eq!(view.partition, 0);
    assert_eq!(view.overview.due_now.value, 1);
    assert_eq!(view.pending.items.len(), 1, "{:?}", view.pending.items);
    // Read again, both parts see the second invocation.
    let view = inspect::queue_view(&db, Some("snap"), Some(0), None, None, 10)
        .await
        .unwrap();
    assert_eq!(view.overview.due_now.value, 2);
    assert_eq!(view.pending.items.len(), 2);
    assert!(view.completed.items.is_empty());
    // A page of one row continues from its cursor.
    let first = inspect::queue_view(&db, Some("snap"), None, None, None, 1)
        .await
        .unwrap();
    let cursor = first.pending.cursor.expect("a second page");
    let second = inspect::queue_view(&db, Some("snap"), None, Some(&cursor), None, 1)
        .await
        .unwrap();
    assert_eq!(second.pending.items.len(), 1);
    assert_ne!(first.pending.items[0].key, second.pending.items[0].key);
    // Refusals: a queue the store does not hold, a partition it does not have, a limit of 0.
    let absent = inspect::queue_view(&db, Some("nobody"), None, None, None, 10).await;
    assert!(matches!(absent, Err(TitoError::NotFound(_))), "{absent:?}");
    let err = inspect::queue_view(&db, Some("snap"), Some(1), None, None, 10)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("queue \"snap\" has 1 partition (0 to 0): no partition 1"),
        "{err}"
    );
    assert!(
        inspect::queue_view(&db, Some("snap"), None, None, None, 0)
            .await
            .is_err()
    );
}

/// A worker whose process was killed (no report for longer than `REPORT_GONE_AFTER`, never
/// stopped) reads as gone, not as a worker that reported a while ago; a recent one runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_report_reads_as_gone() {
    let db = tito::backend::memory::Memory::new();
    let root = keys::queue_root(Some("killed"));
    let now_ms = tito::engine::version_millis(db.current_version().await.unwrap());
    let gone_ms = tito::queue::REPORT_GONE_AFTER.as_millis() as u64;
    let tx = db.begin().await.unwrap();
    for (worker, ago, stopped) in [
        ("killed", gone_ms + 5_000, false),
        ("alive", 2_000, false),
        ("stopped", gone_ms + 5_000, true),
    ] {
        let report = serde_json::json!({
            "worker": worker, "runner": "pid 1 on host", "started_ms": now_ms - ago - 1,
            "written_ms": now_ms - ago, "stopped": stopped, "minutes": []
        });
        tx.put(
            format!("{root}:report:{worker}").into_bytes(),
            serde_json::to_vec(&report).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let o = inspect::queue_overview(&db, Some("killed")).await.unwrap();
    let state = |name: &str| {
        let w = o.workers.iter().find(|w| w.worker == name).unwrap();
        (
            w.gone(o.now_ms),
            w.running(o.now_ms),
            w.state_note(o.now_ms),
        )
    };
    let (gone, running, note) = state("killed");
    assert!(
        gone && !running && note.starts_with(" (gone: no report for "),
        "{note}"
    );
    assert_eq!(state("alive"), (false, true, String::new()));
    assert_eq!(state("stopped"), (false, false, " (stopped)".to_string()));
}
