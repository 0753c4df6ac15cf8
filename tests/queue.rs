//! The queue: publication (alone, in a caller's transaction, from model writes), validation,
//! workers and outcomes, fairness, leases, shutdown, retention, owners, unknown commit outcomes.
//! Written once, run on every backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::model::{TitoEventConfig, TitoModelTrait, TitoOperation, TitoOptions};
use tito::queue::{ModelEvent, run_transactional_worker, run_worker};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueHandlerResult, QueueOwner,
    TitoEngine, TitoError, TitoModel, TitoTransaction, WorkerConfig,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::support::{Ctx, now, pending_total, queue, read, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! queue_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            queue,
            [
                the_seed_sample_works,
                a_backlog_in_one_partition_leaves_handlers_for_the_others,
                publication_joins_the_callers_transaction,
                model_writes_publish_their_events,
                declared_events_follow_the_write,
                typed_topics_carry_their_payload_type,
                bad_events_are_refused_before_writing,
                a_partition_count_mismatch_is_refused,
                reschedule_replaces_the_row_atomically,
                failures_leave_the_invocation_pending,
                a_failure_policy_counts_attempts_and_buries_the_last,
                future_events_wait_for_their_time,
                same_time_work_never_starves_later_buckets,
                scans_read_what_a_pull_wants_up_to_256_rows,
                overlapping_workers_never_share_a_partition,
                a_lost_lease_applies_no_outcome,
                a_takeover_fences_a_transactional_outcome_already_under_way,
                shutdown_drains_started_handlers,
                handlers_run_concurrently,
                completed_rows_expire,
                owners_move_with_their_rows_and_can_be_erased,
                unknown_acknowledgements_deliver_each_event_once,
                malformed_rows_are_counted_and_left_in_place,
                transactional_handlers_commit_with_their_outcome,
                a_set_of_workers_shares_one_shutdown,
                a_paused_queue_starts_nothing_until_resumed,
                advance_keeps_each_step_and_runs_the_next,
                cancellation_stops_pending_work_and_tells_running_handlers,
                periodic_ticks_are_published_once_however_many_run,
                a_periodic_runner_refuses_a_partition_count_mismatch_at_once,
                a_row_of_an_older_shape_is_deleted_and_its_event_carries_it,
                concurrency_limits_hold_over_every_worker,
                a_crashed_workers_slots_free_by_the_lease_rule,
                rate_limits_space_starts_and_move_what_waits,
                limits_are_checked_and_stored,
                unique_keys_hold_for_their_period_in_the_states_covered,
                priorities_run_first_and_lower_ones_age,
                a_keys_handlers_first_run_in_the_order_of_its_rows,
                publish_many_commits_in_bounded_transactions_and_resumes_after_a_failure,
                publish_many_honours_ids_unique_keys_owners_and_the_callers_transaction,
                a_published_list_starts_in_the_order_of_its_ids,
                results_are_kept_with_the_completion_and_awaited_from_any_handle,
                a_result_over_the_bound_is_a_failed_attempt_that_names_the_fix,
                a_transactional_handlers_result_commits_with_its_writes,
                null_and_deep_results_read_back_and_deeper_ones_are_refused,
            ]
        );
    };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Job {
    pub(crate) n: u32,
}

pub(crate) fn fast(partitions: std::ops::Range<u32>) -> WorkerConfig {
    WorkerConfig::new(partitions).max_idle_backoff(Duration::from_millis(50))
}

pub(crate) struct Running {
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) task: JoinHandle<tito::TitoResult<()>>,
}

impl Running {
    pub(crate) async fn stop(self) {
        self.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the worker stops")
            .unwrap()
            .expect("the worker's configuration is valid");
    }
}

pub(crate) fn start<E, F, Fut>(queue: &Arc<Queue<E>>, config: WorkerConfig, handler: F) -> Running
where
    E: TitoEngine,
    F: Fn(QueueEvent<Job>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = QueueHandlerResult<Job>> + Send + 'static,
{
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_worker(queue.clone(), config, handler, rx));
    Running { stop, task }
}

/// Every invocation a handler saw.
type Seen = Arc<Mutex<Vec<QueueEvent<Job>>>>;

/// A handler that records what it saw and acknowledges.
fn recorder() -> (
    Seen,
    impl Fn(QueueEvent<Job>) -> futures::future::BoxFuture<'static, QueueHandlerResult<Job>>
    + Send
    + Sync
    + 'static,
) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let handler = move |event: QueueEvent<Job>| {
        let log = log.clone();
        async move {
            log.lock().unwrap().push(event);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
        .boxed()
    };
    (seen, handler)
}

pub(crate) async fn drained<E: TitoEngine>(queue: &Arc<Queue<E>>, completed: usize) {
    let q = queue.clone();
    wait_for("the queue to drain", Duration::from_secs(30), move || {
        let q = q.clone();
        async move {
            pending_total(&q).await == 0 && q.completed_count().await.unwrap() == completed
        }
    })
    .await;
}

pub async fn the_seed_sample_works<E: TitoEngine>(ctx: Ctx<E>) {
    #[derive(Clone, Debug, Serialize, Deserialize)]
    struct UserCreated {
        id: String,
    }
    async fn handle_user_created(
        event: QueueEvent<UserCreated>,
        seen: Arc<Mutex<Vec<String>>>,
    ) -> Result<(), TitoError> {
        seen.lock().unwrap().push(event.payload.id);
        Ok(())
    }
    let db = ctx.db.clone();
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(3 * 24 * 60 * 60)),
    ));
    queue
        .publish(QueueEvent::new(
            "user:123",
            UserCreated { id: "123".into() },
            chrono::Utc::now().timestamp(),
        ))
        .await
        .unwrap();

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..4),
        move |event: QueueEvent<UserCreated>| {
            let log = log.clone();
            async move {
                handle_user_created(event, log).await?;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
            .boxed()
        },
        shutdown_rx,
    ));
    drained(&queue, 1).await;
    assert_eq!(*seen.lock().unwrap(), ["123"]);
    shutdown_tx.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(queue.stats().acknowledged, 1);
}

pub async fn publication_joins_the_callers_transaction<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 4);
    // Rolled back: neither the data nor the event exist.
    let tx = ctx.db.begin().await.unwrap();
    tx.put(ctx.key("order"), b"1".to_vec()).await.unwrap();
    queue
        .publish_in_tx(&QueueEvent::new("order:1", Job { n: 1 }, now()), &tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(pending_total(&queue).await, 0);

    // Committed: both.
    let q = queue.clone();
    let key = ctx.key("order");
    ctx.db
        .transaction(|tx| async move {
            tx.put(key, b"1".to_vec()).await?;
            q.publish_in_tx(&QueueEvent::new("order:1", Job { n: 1 }, now()), &tx)
                .await
        })
        .await
        .unwrap();
    assert_eq!(pending_total(&queue).await, 1);
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Account {
    id: String,
    email: String,
}

impl TitoModelTrait for Account {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        "account".into()
    }
    fn events(&self) -> Vec<TitoEventConfig> {
        vec![
            TitoEventConfig {
                name: "account".into(),
                timestamp: chrono::Utc::now().timestamp(),
            },
            TitoEventConfig {
                name: "account_later".into(),
                timestamp: chrono::Utc::now().timestamp() + 3600,
            },
        ]
    }
}

/// A derived model whose events limit the operations that publish them.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "ledger")]
#[tito(event = "ledger_all")]
#[tito(event = "ledger_gone", on = "delete")]
#[tito(event = "ledger_written", on = "insert, update")]
struct Ledger {
    id: String,
    amount: i64,
}

/// Every pending invocation of the queue named `topic`, as (event id, payload), in key order.
async fn pending_of<E: TitoEngine>(db: &E, topic: &str) -> Vec<(String, serde_json::Value)> {
    let root = tito::keys::queue_root(Some(topic));
    let prefix = format!("{root}:pending:");
    let tx = db.begin().await.unwrap();
    let rows = tx
        .scan(
            prefix.as_bytes(),
            &tito::prefix_end_bytes(prefix.as_bytes()),
            1000,
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    rows.into_iter()
        .map(|(_, value)| {
            let row: serde_json::Value = serde_json::from_slice(&value).unwrap();
            (
                row["id"].as_str().unwrap().to_string(),
                row["payload"].clone(),
            )
        })
        .collect()
}

pub async fn model_writes_publish_their_events<E: TitoEngine>(ctx: Ctx<E>) {
    let accounts = ctx.db.clone().model::<Account>();
    let account = Account {
        id: "a1".into(),
        email: "a@x".into(),
    };
    // The seed's form: the operation stated, in a caller's transaction.
    let a = accounts.clone();
    let row = account.clone();
    ctx.db
        .transaction(|tx| async move {
            a.build_with_options(row, TitoOptions::with_events(TitoOperation::Insert), &tx)
                .await
        })
        .await
        .unwrap();
    // A plain write publishes too; one with events switched off does not.
    let second = Account {
        id: "a2".into(),
        email: "b@x".into(),
    };
    accounts.build(second.clone()).await.unwrap();
    let a = accounts.clone();
    ctx.db
        .transaction(|tx| async move {
            let third = Account {
                id: "a3".into(),
                email: "c@x".into(),
            };
            a.build_with_options(third, TitoOptions::without_events(), &tx)
                .await
        })
        .await
        .unwrap();

    let topic = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(ctx.db.partitions(), Duration::from_secs(60)).topic("account"),
    ));
    let later = Queue::new(
        ctx.db.clone(),
        QueueConfig::new(ctx.db.partitions(), Duration::from_secs(60)).topic("account_later"),
    );
    let seen: Arc<Mutex<Vec<QueueEvent<ModelEvent<Account>>>>> = Arc::default();
    let log = seen.clone();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        topic.clone(),
        fast(0..ctx.db.partitions()),
        move |event: QueueEvent<ModelEvent<Account>>| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(event);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    let s = seen.clone();
    wait_for("the model events", Duration::from_secs(30), move || {
        let s = s.clone();
        async move { s.lock().unwrap().len() >= 2 }
    })
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    let mut events = seen.lock().unwrap().clone();
    events.sort_by(|a, b| a.payload.id.cmp(&b.payload.id));
    let payloads: Vec<_> = events.iter().map(|e| e.payload.clone()).collect();
    assert_eq!(
        payloads,
        vec![
            ModelEvent {
                operation: TitoOperation::Insert,
                table: "account".into(),
                id: "a1".into(),
                row: account,
                shape: 1,
            },
            ModelEvent {
                operation: TitoOperation::Insert,
                table: "account".into(),
                id: "a2".into(),
                row: second,
                shape: 1,
            }
        ]
    );
    // The id names the row and the write: `{table}:{id}:{write version}`.
    for event in &events {
        let prefix = format!("account:{}:", event.payload.id);
        let version = event
            .id
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{}", event.id));
        assert!(version.parse::<u64>().is_ok(), "{}", event.id);
        assert_eq!(event.key, format!("account:{}", event.payload.id));
    }
    // The future event waits in its own queue: one per published write.
    let mut later_pending = 0;
    for p in 0..ctx.db.partitions() {
        later_pending += later.pending_count(p).await.unwrap();
    }
    assert_eq!(later_pending, 2);

    // A stated operation that contradicts the write is refused, and nothing is written.
    let a = accounts.clone();
    let refused = ctx
        .db
        .transaction(|tx| async move {
            let row = Account {
                id: "a1".into(),
                email: "new@x".into(),
            };
            a.update_with_options(row, TitoOptions::with_events(TitoOperation::Delete), &tx)
                .await
        })
        .await;
    match refused {
        Err(TitoError::InvalidArgument(message)) => {
            assert!(message.contains("is an update"), "{message}");
            assert!(message.contains("Delete"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(accounts.get("a1").await.unwrap().unwrap().email, "a@x");
    // A delete publishes the row as it was.
    let a = accounts.clone();
    ctx.db
        .transaction(|tx| async move {
            a.delete_by_id_with_options("a1", TitoOptions::with_events(TitoOperation::Delete), &tx)
                .await
        })
        .await
        .unwrap();
    let pending = pending_of(&ctx.db, "account").await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].1["operation"], "Delete");
    assert_eq!(pending[0].1["row"]["email"], "a@x");
}

/// Upserts report what they did; `on` limits the operations of an event; two writes of one row
/// in one transaction publish two events; ids are the same across a transaction's replays.
pub async fn declared_events_follow_the_write<E: TitoEngine>(ctx: Ctx<E>) {
    let ledgers = ctx.db.clone().model::<Ledger>();
    let row = |amount| Ledger {
        id: "l1".into(),
        amount,
    };
    ledgers.upsert(row(1)).await.unwrap(); // insert
    ledgers.upsert(row(2)).await.unwrap(); // update
    // Stated as `Upsert`, the events report `Upsert`; stated as what the upsert does, that.
    let l = ledgers.clone();
    ctx.db
        .transaction(|tx| async move {
            l.upsert_with_options(row(3), TitoOptions::with_events(TitoOperation::Upsert), &tx)
                .await?;
            l.upsert_with_options(row(4), TitoOptions::with_events(TitoOperation::Update), &tx)
                .await
        })
        .await
        .unwrap();
    // An upsert stated as an insert of a present row is refused.
    let l = ledgers.clone();
    let refused = ctx
        .db
        .transaction(|tx| async move {
            l.upsert_with_options(row(5), TitoOptions::with_events(TitoOperation::Insert), &tx)
                .await
        })
        .await;
    assert!(
        matches!(&refused, Err(TitoError::InvalidArgument(m)) if m.contains("upsert that updates")),
        "{refused:?}"
    );
    ledgers.delete_by_id("l1").await.unwrap();

    let operations = |events: Vec<(String, serde_json::Value)>| -> Vec<String> {
        events
            .iter()
            .map(|(_, payload)| payload["operation"].as_str().unwrap().to_string())
            .collect()
    };
    let mut all = pending_of(&ctx.db, "ledger_all").await;
    // Pending keys order by due time (the same second here, or later) and version; sort by
    // version, which orders these one-after-another writes.
    all.sort_by_key(|(id, _)| {
        let rest = id.strip_prefix("ledger:l1:").unwrap();
        let (version, n) = rest.split_once('.').unwrap_or((rest, "0"));
        (version.parse::<u64>().unwrap(), n.parse::<u32>().unwrap())
    });
    assert_eq!(
        operations(all.clone()),
        ["Insert", "Update", "Upsert", "Update", "Delete"]
    );
    // The two writes of one transaction: `{id}` and `{id}.1`.
    let (third, fourth) = (&all[2].0, &all[3].0);
    assert_eq!(fourth, &format!("{third}.1"));
    let amounts: Vec<i64> = all
        .iter()
        .map(|(_, p)| p["row"]["amount"].as_i64().unwrap())
        .collect();
    assert_eq!(amounts, [1, 2, 3, 4, 4]);
    // `on = "delete"` and `on = "insert, update"` (an upsert stated as `Upsert` counts).
    assert_eq!(
        operations(pending_of(&ctx.db, "ledger_gone").await),
        ["Delete"]
    );
    let mut written = operations(pending_of(&ctx.db, "ledger_written").await);
    written.sort();
    assert_eq!(written, ["Insert", "Update", "Update", "Upsert"]);

    // A conflict replays the transaction; its event keeps the id of the first attempt.
    ledgers.build(row(10)).await.unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let (l, db, counted) = (ledgers.clone(), ctx.db.clone(), attempts.clone());
    ctx.db
        .transaction(|tx| async move {
            let attempt = counted.fetch_add(1, Ordering::SeqCst);
            l.update_with_options(row(11), TitoOptions::default(), &tx)
                .await?;
            if attempt == 0 {
                // Another writer commits the row first: this attempt conflicts.
                db.clone().model::<Ledger>().update(row(12)).await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let ids: Vec<String> = pending_of(&ctx.db, "ledger_all")
        .await
        .into_iter()
        .filter(|(_, p)| p["row"]["amount"] == 11)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    // The first attempt's version: below the interloper's, whose write started inside it.
    let interloper: Vec<String> = pending_of(&ctx.db, "ledger_all")
        .await
        .into_iter()
        .filter(|(_, p)| p["row"]["amount"] == 12)
        .map(|(id, _)| id)
        .collect();
    let version = |id: &str| id.rsplit(':').next().unwrap().parse::<u64>().unwrap();
    assert!(
        version(&ids[0]) < version(&interloper[0]),
        "{ids:?} {interloper:?}"
    );
}

/// A model event's topic (the derive's constant) and a hand-declared topic: each opens a typed
/// queue whose worker and publications take its payload type; a config naming another topic is
/// refused.
pub async fn typed_topics_carry_their_payload_type<E: TitoEngine>(ctx: Ctx<E>) {
    const JOBS: tito::Topic<Job> = tito::Topic::new("typed_jobs");
    let config = || QueueConfig::new(ctx.db.partitions(), Duration::from_secs(60));
    let refused = JOBS.queue(ctx.db.clone(), config().topic("other"));
    assert!(
        matches!(&refused, Err(TitoError::InvalidArgument(m)) if m.contains("\"other\"")),
        "{refused:?}"
    );
    let jobs = JOBS.queue(ctx.db.clone(), config()).unwrap();
    assert_eq!(jobs.queue().config().topic.as_deref(), Some("typed_jobs"));
    jobs.publish(QueueEvent::new("k", Job { n: 7 }, now()))
        .await
        .unwrap();
    let ledgers = Ledger::LEDGER_ALL_EVENT
        .queue(ctx.db.clone(), config())
        .unwrap();
    ctx.db
        .clone()
        .model::<Ledger>()
        .build(Ledger {
            id: "t1".into(),
            amount: 5,
        })
        .await
        .unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = tito::Workers::new();
    let jobs_seen = tx.clone();
    // Neither handler names its type: the topic gives it.
    workers.spawn_worker(&jobs, fast(0..ctx.db.partitions()), move |event| {
        let seen = jobs_seen.clone();
        async move {
            seen.send(format!("job {}", event.payload.n)).unwrap();
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    workers.spawn_worker(ledgers, fast(0..ctx.db.partitions()), move |event| {
        let seen = tx.clone();
        async move {
            let ledger: Ledger = event.payload.row;
            seen.send(format!("ledger {} {}", ledger.id, ledger.amount))
                .unwrap();
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    let mut got = vec![
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .unwrap()
            .unwrap(),
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .unwrap()
            .unwrap(),
    ];
    got.sort();
    assert_eq!(got, ["job 7", "ledger t1 5"]);
    workers.shutdown().await.unwrap();
}

pub async fn bad_events_are_refused_before_writing<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 4);
    let invalid = |r: Result<tito::Published, TitoError>| {
        assert!(matches!(r, Err(TitoError::InvalidArgument(_))), "{r:?}")
    };
    invalid(queue.publish(QueueEvent::new("k", Job { n: 1 }, -1)).await);
    let huge = QueueEvent::new("k", "x".repeat(tito::queue::MAX_QUEUE_EVENT_BYTES), now());
    assert!(matches!(
        queue.publish(huge).await,
        Err(TitoError::InvalidArgument(_))
    ));
    invalid(
        queue
            .publish(QueueEvent::new("k", Job { n: 1 }, now()).with_owner(QueueOwner::new("", "1")))
            .await,
    );
    invalid(
        queue
            .publish(
                QueueEvent::new("k", Job { n: 1 }, now())
                    .with_owner(QueueOwner::new("u", "x".repeat(513))),
            )
            .await,
    );
    assert_eq!(pending_total(&queue).await, 0);
    // Not even the queue's metadata was written.
    let tx = ctx.db.begin().await.unwrap();
    assert!(tx.get(b"queue:meta").await.unwrap().is_none());
    tx.rollback().await.unwrap();
}

pub async fn a_partition_count_mismatch_is_refused<E: TitoEngine>(ctx: Ctx<E>) {
    queue(&ctx.db, 4)
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let other = queue(&ctx.db, 8);
    let err = other
        .publish(QueueEvent::new("k", Job { n: 2 }, now()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TitoError::InvalidArgument(m) if m.contains("queue \"default\" has 4 partitions")),
        "{err:?}"
    );
    assert_eq!(pending_total(&queue(&ctx.db, 4)).await, 1);
    // A named queue is named as written, never by its storage key.
    let named = |n| {
        tito::Queue::new(
            ctx.db.clone(),
            QueueConfig::new(n, Duration::from_secs(3600)).topic("mail:out"),
        )
    };
    named(4)
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let err = named(8)
        .publish(QueueEvent::new("k", Job { n: 2 }, now()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TitoError::InvalidArgument(m) if m.contains("queue \"mail:out\" has 4") && !m.contains("queue@")),
        "{err:?}"
    );
}

pub async fn reschedule_replaces_the_row_atomically<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 2);
    let event =
        QueueEvent::new("job:1", Job { n: 1 }, now()).with_owner(QueueOwner::new("user", "7"));
    let id = event.id.clone();
    queue.publish(event).await.unwrap();
    queue
        .publish(QueueEvent::new("job:2", Job { n: 2 }, now()))
        .await
        .unwrap();
    let worker = start(&queue, fast(0..2), |event: QueueEvent<Job>| async move {
        Ok(match event.payload.n {
            // A proper replacement, an hour later.
            1 => QueueHandlerOutcome::Reschedule(event.rescheduled(now() + 3600)),
            // A replacement with another payload is refused: the invocation stays pending.
            _ => QueueHandlerOutcome::Reschedule({
                let mut other = event;
                other.payload = Job { n: 99 };
                other
            }),
        })
    });
    let q = queue.clone();
    wait_for("the outcomes", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().rescheduled == 1 && q.stats().failed >= 1 }
    })
    .await;
    worker.stop().await;
    assert_eq!(queue.completed_count().await.unwrap(), 1);
    assert_eq!(
        pending_total(&queue).await,
        2,
        "the replacement and the refused one"
    );
    // The replacement kept the identity.
    let tx = ctx.db.begin().await.unwrap();
    let rows = tx
        .scan(b"queue:pending:", b"queue:pending;", 10)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let ids: Vec<String> = rows
        .iter()
        .map(|(_, v)| {
            serde_json::from_slice::<serde_json::Value>(v).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(ids.contains(&id), "{ids:?}");
}

pub async fn failures_leave_the_invocation_pending<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    for n in 0..3 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    let attempts: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
    let log = attempts.clone();
    let config = fast(0..1).handler_timeout(Duration::from_millis(200));
    let worker = start(&queue, config, move |event: QueueEvent<Job>| {
        let log = log.clone();
        async move {
            // Without a failure policy a failure changes nothing: every delivery is attempt 1.
            assert_eq!(event.attempt, 1);
            let attempt = {
                let mut map = log.lock().unwrap();
                let count = map.entry(event.payload.n).or_default();
                *count += 1;
                *count
            };
            if attempt == 1 {
                match event.payload.n {
                    0 => return Err(TitoError::invalid_argument("first attempt fails")),
                    1 => panic!("first attempt panics"),
                    _ => tokio::time::sleep(Duration::from_secs(5)).await,
                }
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    drained(&queue, 3).await;
    worker.stop().await;
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts, HashMap::from([(0, 2), (1, 2), (2, 2)]));
    assert_eq!(queue.stats().failed, 3);
}

/// Under a failure policy: attempts rise by one on each delivery, a failure waits out its
/// backoff, the last failure (or a fatal panic) moves the invocation to the dead state with its
/// error; dead invocations hold their id, and are retried (attempt 1 again) or discarded.
pub async fn a_failure_policy_counts_attempts_and_buries_the_last<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 2);
    let owner = QueueOwner::new("account", "7");
    // n = 0 always fails, 1 fails once, 2 always panics, 3 succeeds once allowed to.
    for n in 0..3 {
        let mut event = QueueEvent::new(format!("k{n}"), Job { n }, now()).with_id(format!("e{n}"));
        if n == 0 {
            event = event.with_owner(owner.clone());
        }
        queue.publish(event).await.unwrap();
    }
    let attempts: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (log, cured) = (attempts.clone(), healed.clone());
    let policy = tito::queue::FailurePolicy::new(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(1));
    let config = fast(0..2).failure_policy(policy);
    let worker = start(&queue, config, move |event: QueueEvent<Job>| {
        let (log, cured) = (log.clone(), cured.clone());
        async move {
            log.lock().unwrap().push((event.payload.n, event.attempt));
            match event.payload.n {
                0 if !cured.load(Ordering::SeqCst) => {
                    Err(TitoError::invalid_argument("n = 0 fails"))
                }
                1 if event.attempt == 1 => Err(TitoError::invalid_argument("n = 1 fails once")),
                2 => panic!("n = 2 panics"),
                _ => Ok(QueueHandlerOutcome::Acknowledge),
            }
        }
    });
    let q = queue.clone();
    wait_for(
        "two dead, one acknowledged",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.stats().dead == 2 && q.stats().acknowledged == 1 }
        },
    )
    .await;
    let mut seen = attempts.lock().unwrap().clone();
    seen.sort();
    assert_eq!(
        seen,
        [
            (0, 1),
            (0, 2),
            (0, 3),
            (1, 1),
            (1, 2),
            (2, 1),
            (2, 2),
            (2, 3)
        ]
    );
    let stats = queue.stats();
    assert_eq!((stats.failed, stats.retried, stats.dead), (7, 5, 2));
    assert_eq!(pending_total(&queue).await, 0);
    let dead = queue.dead(None, 10).await.unwrap();
    let summary: Vec<(String, u32)> = dead.iter().map(|d| (d.id.clone(), d.attempts)).collect();
    assert_eq!(summary, [("e0".to_string(), 3), ("e2".to_string(), 3)]);
    assert!(dead[0].error.contains("n = 0 fails"), "{}", dead[0].error);
    assert!(dead[1].error.contains("n = 2 panics"), "{}", dead[1].error);
    assert_eq!(dead[0].owner.as_ref(), Some(&owner));
    assert_eq!(dead[0].payload["n"], 0);
    assert!(dead[0].dead_at_ms > 0);
    // Paging by id.
    let rest = queue.dead(Some("e0"), 10).await.unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].id, "e2");
    assert!(matches!(
        queue.dead(None, 0).await,
        Err(TitoError::InvalidArgument(_))
    ));
    // A dead invocation holds its id.
    let again = queue
        .publish(QueueEvent::new("k0", Job { n: 0 }, now()).with_id("e0"))
        .await
        .unwrap();
    assert!(again.duplicate);
    // Discarded: gone, its id free.
    assert!(queue.discard_dead("e2").await.unwrap());
    assert!(!queue.discard_dead("e2").await.unwrap());
    assert!(!queue.retry_dead("missing").await.unwrap());
    // On a queue nothing ever used: not dead, whatever the store holds.
    assert!(
        !tito::queue::retry_dead(&ctx.db, Some("never-used"), "e0")
            .await
            .unwrap()
    );
    assert!(
        !tito::queue::discard_dead(&ctx.db, Some("never-used"), "e0")
            .await
            .unwrap()
    );
    assert!(
        tito::queue::dead(&ctx.db, Some("never-used"), None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    // Retried: pending again at attempt 1, and this time it succeeds.
    healed.store(true, Ordering::SeqCst);
    assert!(queue.retry_dead("e0").await.unwrap());
    let q = queue.clone();
    wait_for(
        "the retried invocation",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.stats().acknowledged == 2 }
        },
    )
    .await;
    worker.stop().await;
    assert_eq!(attempts.lock().unwrap().last(), Some(&(0, 1)));
    assert!(queue.dead(None, 10).await.unwrap().is_empty());
    let fresh = queue
        .publish(QueueEvent::new("k2", Job { n: 3 }, now()).with_id("e2"))
        .await
        .unwrap();
    assert!(!fresh.duplicate);
    // The owner's keys followed the row: pending, dead, pending again, completed.
    let erased = ctx
        .db
        .transaction(|tx| {
            let (queue, owner) = (queue.clone(), owner.clone());
            async move {
                queue
                    .delete_by_owner_matching_in_tx(&owner, |_: &QueueEvent<Job>| true, &tx)
                    .await
            }
        })
        .await
        .unwrap();
    assert_eq!(erased, 1);

    // A refused policy refuses the worker before it starts.
    let refused = run_worker(
        queue.clone(),
        fast(0..2).failure_policy(tito::queue::FailurePolicy::new(0)),
        |_: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        futures::future::ready(()).boxed(),
    )
    .await;
    assert!(
        matches!(&refused, Err(TitoError::InvalidArgument(m)) if m.contains("max_attempts")),
        "{refused:?}"
    );
}

pub async fn future_events_wait_for_their_time<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let due = now() + 2;
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, due))
        .await
        .unwrap();
    let (seen, handler) = recorder();
    let worker = start(&queue, fast(0..1), handler);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(seen.lock().unwrap().is_empty(), "not before its time");
    drained(&queue, 1).await;
    assert!(now() >= due);
    worker.stop().await;
}

pub async fn same_time_work_never_starves_later_buckets<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let t0 = now() - 10;
    // n = 0..4 re-create themselves at the same due time forever; n = 100 is due later.
    for n in 0..4 {
        queue
            .publish(QueueEvent::new("k", Job { n }, t0))
            .await
            .unwrap();
    }
    queue
        .publish(QueueEvent::new("k", Job { n: 100 }, t0 + 5))
        .await
        .unwrap();
    let later_seen = Arc::new(AtomicUsize::new(0));
    let flag = later_seen.clone();
    let worker = start(
        &queue,
        fast(0..1).concurrency(2).page_size(2),
        move |event: QueueEvent<Job>| {
            let flag = flag.clone();
            async move {
                if event.payload.n == 100 {
                    flag.fetch_add(1, Ordering::SeqCst);
                    return Ok(QueueHandlerOutcome::Acknowledge);
                }
                let t = event.timestamp;
                Ok(QueueHandlerOutcome::Reschedule(event.rescheduled(t)))
            }
        },
    );
    let f = later_seen.clone();
    wait_for(
        "the later bucket to run",
        Duration::from_secs(30),
        move || {
            let f = f.clone();
            async move { f.load(Ordering::SeqCst) == 1 }
        },
    )
    .await;
    worker.stop().await;
    assert!(queue.stats().rescheduled >= 4);
}

pub async fn scans_read_what_a_pull_wants_up_to_256_rows<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let q = queue.clone();
    ctx.db
        .transaction(|tx| async move {
            for n in 0..300 {
                q.publish_in_tx(&QueueEvent::new("k", Job { n }, now() - 1), &tx)
                    .await?;
            }
            Ok::<_, TitoError>(())
        })
        .await
        .unwrap();
    // Every handler waits until all 300 started, so one pull started them all; the scans are
    // counted when the last one starts.
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let scans_at_last = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let all = Arc::new(tokio::sync::Notify::new());
    let (s, at, q, all2) = (
        started.clone(),
        scans_at_last.clone(),
        queue.clone(),
        all.clone(),
    );
    let worker = start(
        &queue,
        fast(0..1).concurrency(300).page_size(300),
        move |_event: QueueEvent<Job>| {
            let (s, at, q, all) = (s.clone(), at.clone(), q.clone(), all2.clone());
            async move {
                let notified = all.notified();
                if s.fetch_add(1, Ordering::SeqCst) + 1 == 300 {
                    at.store(q.stats().scans, Ordering::SeqCst);
                    all.notify_waiters();
                } else {
                    notified.await;
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    drained(&queue, 300).await;
    worker.stop().await;
    assert_eq!(started.load(Ordering::SeqCst), 300);
    // The pull that wanted 300 rows read them in scans of at most 256: two (a third when it
    // also read the front); scans of 16 would have taken at least nineteen.
    let scans = scans_at_last.load(Ordering::SeqCst);
    assert!((2..=3).contains(&scans), "{scans} scans");
}

pub async fn overlapping_workers_never_share_a_partition<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 4);
    for n in 0..40 {
        queue
            .publish(QueueEvent::new(format!("key-{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    let owners: Arc<Mutex<HashMap<u32, String>>> = Arc::default();
    let seen: Arc<Mutex<Vec<u32>>> = Arc::default();
    let mut workers = Vec::new();
    for name in ["a", "b"] {
        let (owners, seen) = (owners.clone(), seen.clone());
        let partitions = 4;
        workers.push(start(
            &queue,
            fast(0..4).worker_id(name),
            move |event: QueueEvent<Job>| {
                let (owners, seen) = (owners.clone(), seen.clone());
                async move {
                    let partition = tito::queue::partition_for(&event.key, partitions);
                    let owner = owners
                        .lock()
                        .unwrap()
                        .entry(partition)
                        .or_insert(name.to_string())
                        .clone();
                    assert_eq!(owner, name, "partition {partition} ran on two workers");
                    seen.lock().unwrap().push(event.payload.n);
                    Ok(QueueHandlerOutcome::Acknowledge)
                }
            },
        ));
    }
    drained(&queue, 40).await;
    for worker in workers {
        worker.stop().await;
    }
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..40).collect::<Vec<_>>(), "each event exactly once");
}

pub async fn a_lost_lease_applies_no_outcome<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let (release_tx, release_rx) = watch::channel(false);
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let worker = start(
        &queue,
        fast(0..1).lease_duration(Duration::from_secs(60)),
        move |_event: QueueEvent<Job>| {
            let mut release = release_rx.clone();
            let s = s.clone();
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                let _ = release.wait_for(|go| *go).await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let s = started.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // Another worker takes the partition (a new generation) while the handler runs.
    let stolen = br#"{"owner":"thief","generation":99,"expires":18446744073709551615}"#.to_vec();
    ctx.db
        .transaction(|tx| async move { tx.put(b"queue:lease:0000".to_vec(), stolen).await })
        .await
        .unwrap();
    release_tx.send(true).unwrap();
    let q = queue.clone();
    wait_for("the refused outcome", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().outcome_failures >= 1 }
    })
    .await;
    worker.stop().await;
    // The first run's outcome applied nothing. The invocation stays pending while the other
    // holder's lease is live (TiKV); a store held by one process (embedded, SQLite) knows a
    // lease its open did not write is stale, and the worker, told by the refused outcome that
    // it lost the lease, takes the partition back at once and runs the invocation again.
    let (pending, completed) = (
        pending_total(&queue).await,
        queue.completed_count().await.unwrap(),
    );
    assert_eq!(
        pending + completed,
        1,
        "pending {pending}, completed {completed}"
    );
    if completed == 1 {
        assert_eq!(
            started.load(Ordering::SeqCst),
            2,
            "completed by a second run"
        );
    }
}

pub async fn shutdown_drains_started_handlers<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let worker = start(&queue, fast(0..1), move |_event: QueueEvent<Job>| {
        let s = s.clone();
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    let s = started.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 1 }
    })
    .await;
    worker.stop().await;
    // The handler finished and its outcome was applied before the worker returned.
    assert_eq!(queue.completed_count().await.unwrap(), 1);
    assert_eq!(pending_total(&queue).await, 0);
    // The lease was released: no owner, the generation kept for the next holder.
    let tx = ctx.db.begin().await.unwrap();
    let lease: serde_json::Value =
        serde_json::from_slice(&tx.get(b"queue:lease:0000").await.unwrap().unwrap()).unwrap();
    assert_eq!(lease["owner"], "", "{lease}");
    assert!(lease["generation"].as_u64().unwrap() >= 1);
    tx.rollback().await.unwrap();
}

pub async fn a_set_of_workers_shares_one_shutdown<E: TitoEngine>(ctx: Ctx<E>) {
    let mails = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)).topic("mails"),
    ));
    let bills = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)).topic("bills"),
    ));
    let started = Arc::new(AtomicUsize::new(0));
    let handler = |started: Arc<AtomicUsize>| {
        move |_event: QueueEvent<Job>| {
            let started = started.clone();
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                // Still running when the shutdown comes: the drain must wait for it.
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    let mut workers = tito::Workers::new();
    workers
        .spawn_worker(mails.clone(), fast(0..1), handler(started.clone()))
        .spawn_worker(bills.clone(), fast(0..1), handler(started.clone()));
    assert_eq!(workers.len(), 2);
    mails
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    bills
        .publish(QueueEvent::new("k", Job { n: 2 }, now()))
        .await
        .unwrap();
    let s = started.clone();
    wait_for(
        "both handlers to start",
        Duration::from_secs(30),
        move || {
            let s = s.clone();
            async move { s.load(Ordering::SeqCst) == 2 }
        },
    )
    .await;
    tokio::time::timeout(Duration::from_secs(30), workers.shutdown())
        .await
        .expect("the set drains")
        .expect("both configurations are valid");
    // Both handlers finished and both outcomes were applied before shutdown returned.
    assert_eq!(mails.completed_count().await.unwrap(), 1);
    assert_eq!(bills.completed_count().await.unwrap(), 1);

    // A worker that refuses its configuration: the others still drain, then its error returns.
    let mut workers = tito::Workers::new();
    workers
        .spawn_worker(mails.clone(), fast(0..1), handler(started.clone()))
        .spawn_worker(
            bills.clone(),
            fast(0..1).lease_duration(Duration::ZERO),
            handler(started.clone()),
        );
    let err = workers.shutdown().await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");

    // Dropping the set stops its workers (without waiting): the lease is released soon after.
    let mut workers = tito::Workers::new();
    workers.spawn_worker(mails.clone(), fast(0..1), handler(started.clone()));
    let db = ctx.db.clone();
    wait_for(
        "the worker to take its lease",
        Duration::from_secs(30),
        || {
            let db = db.clone();
            async move { lease_owner(&db, "mails").await.is_some() }
        },
    )
    .await;
    drop(workers);
    wait_for(
        "the dropped set's worker to release its lease",
        Duration::from_secs(30),
        || {
            let db = db.clone();
            async move { lease_owner(&db, "mails").await.is_none() }
        },
    )
    .await;
}

/// The holder of partition 0's lease of queue `topic`, if any.
async fn lease_owner<E: TitoEngine>(db: &E, topic: &str) -> Option<String> {
    let overview = tito::inspect::queue_overview(db, Some(topic))
        .await
        .unwrap();
    overview.partitions[0]
        .lease
        .as_ref()
        .map(|l| l.holder.clone())
}

pub async fn handlers_run_concurrently<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    for n in 0..8 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (r, p) = (running.clone(), peak.clone());
    let worker = start(
        &queue,
        fast(0..1).concurrency(8),
        move |_event: QueueEvent<Job>| {
            let (r, p) = (r.clone(), p.clone());
            async move {
                let now_running = r.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now_running, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                r.fetch_sub(1, Ordering::SeqCst);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    drained(&queue, 8).await;
    worker.stop().await;
    assert!(
        peak.load(Ordering::SeqCst) >= 2,
        "peak {}",
        peak.load(Ordering::SeqCst)
    );
}

pub async fn completed_rows_expire<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(1, Duration::from_millis(1)),
    ));
    for n in 0..3 {
        let event = QueueEvent::new("k", Job { n }, now()).with_owner(QueueOwner::new("user", "1"));
        queue.publish(event).await.unwrap();
    }
    let (_seen, handler) = recorder();
    let worker = start(
        &queue,
        fast(0..1).maintenance_interval(Duration::from_millis(50)),
        handler,
    );
    let q = queue.clone();
    wait_for(
        "completed rows to expire",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            // Counted too: the deletion is visible to readers while its transaction still
            // reads its writes back (TiKV), so stopping at the first sight of it could abort
            // the maintenance pass before it counts.
            async move {
                let stats = q.stats();
                stats.acknowledged == 3
                    && stats.expired >= 3
                    && q.completed_count().await.unwrap() == 0
            }
        },
    )
    .await;
    worker.stop().await;
    // Their owner keys went with them.
    let tx = ctx.db.begin().await.unwrap();
    assert!(
        tx.scan(b"queue:owner:", b"queue:owner;", 10)
            .await
            .unwrap()
            .is_empty()
    );
    tx.rollback().await.unwrap();
}

pub async fn owners_move_with_their_rows_and_can_be_erased<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 2);
    let ada = QueueOwner::new("user", "ada");
    let bob = QueueOwner::new("user", "bob");
    for n in 0..3 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()).with_owner(ada.clone()))
            .await
            .unwrap();
    }
    queue
        .publish(QueueEvent::new("k", Job { n: 10 }, now()).with_owner(bob.clone()))
        .await
        .unwrap();
    // Ada's n = 0 completes first; its owner key moves to completed.
    let worker = start(&queue, fast(0..2), |event: QueueEvent<Job>| async move {
        if event.payload.n == 0 {
            Ok(QueueHandlerOutcome::Acknowledge)
        } else {
            Err(TitoError::invalid_argument("not now"))
        }
    });
    let q = queue.clone();
    wait_for(
        "the first acknowledgement",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.stats().acknowledged == 1 }
        },
    )
    .await;
    worker.stop().await;
    let owner_keys = |prefix: &'static str| {
        let db = ctx.db.clone();
        async move {
            let tx = db.begin().await.unwrap();
            let end = tito::prefix_end(prefix.to_string());
            let rows = tx
                .scan(prefix.as_bytes(), end.as_bytes(), 100)
                .await
                .unwrap();
            tx.rollback().await.unwrap();
            rows.into_iter()
                .map(|(k, _)| String::from_utf8(k).unwrap())
                .collect::<Vec<_>>()
        }
    };
    let ada_prefix = "queue:owner:dXNlcg:YWRh:";
    let keys = owner_keys(ada_prefix).await;
    assert_eq!(
        keys.iter().filter(|k| k.contains(":pending:")).count(),
        2,
        "{keys:?}"
    );
    assert_eq!(
        keys.iter().filter(|k| k.contains(":completed:")).count(),
        1,
        "{keys:?}"
    );

    // Erase Ada's work except n = 2; Bob is untouched.
    let q = queue.clone();
    let owner = ada.clone();
    let deleted = ctx
        .db
        .transaction(|tx| async move {
            q.delete_by_owner_matching_in_tx(
                &owner,
                |event: &QueueEvent<Job>| event.payload.n != 2,
                &tx,
            )
            .await
        })
        .await
        .unwrap();
    assert_eq!(deleted, 2);
    assert_eq!(owner_keys(ada_prefix).await.len(), 1);
    assert_eq!(pending_total(&queue).await, 2, "Ada's n = 2 and Bob's");
    assert_eq!(queue.completed_count().await.unwrap(), 0);
}

pub async fn unknown_acknowledgements_deliver_each_event_once<E: TitoEngine>(ctx: Ctx<E>) {
    let faulty = FaultyEngine::new(ctx.db.clone());
    let queue = Arc::new(Queue::new(
        faulty.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)),
    ));
    let (seen, handler) = recorder();
    // One outcome per commit (a commit runs beside the next handler, which could join it).
    let config = fast(0..1).page_size(1).concurrency(1).outcome_batch(1);
    let worker = start(&queue, config, handler);

    // Every acknowledgement applies but its reply is lost: each resolves as committed.
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeCommitted)
            .when_key_starts_with("queue:completed")
            .always(),
    );
    for n in 0..6 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    drained(&queue, 6).await;
    assert_eq!(
        faulty.faults().injected(),
        6,
        "every acknowledgement was hit"
    );

    // Every acknowledgement's first commit is lost before it applies (every other outcome
    // commit, and outcomes commit one at a time here): each is fenced and replayed once.
    faulty.faults().clear();
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeNotCommitted)
            .when_key_starts_with("queue:completed")
            .every(2)
            .always(),
    );
    for n in 6..12 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    drained(&queue, 12).await;
    worker.stop().await;
    assert_eq!(faulty.faults().injected(), 12);

    let mut ns: Vec<u32> = seen.lock().unwrap().iter().map(|e| e.payload.n).collect();
    ns.sort_unstable();
    assert_eq!(
        ns,
        (0..12).collect::<Vec<_>>(),
        "each event was delivered exactly once"
    );
    let stats = queue.stats();
    assert_eq!(stats.acknowledged, 12);
    assert_eq!(stats.outcome_failures, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_futures_spawn_with_a_concrete_engine() {
    let db = tito::backend::embedded::Embedded::temporary()
        .await
        .unwrap();
    let queue = queue(&db, 2);
    let q = queue.clone();
    tokio::spawn(async move { q.publish(QueueEvent::new("k", Job { n: 1 }, now())).await })
        .await
        .unwrap()
        .unwrap();
    let q = queue.clone();
    let count =
        tokio::spawn(async move { q.pending_count(tito::queue::partition_for("k", 2)).await })
            .await
            .unwrap()
            .unwrap();
    assert_eq!(count, 1);
    let q = queue.clone();
    tokio::spawn(async move { q.expire_completed().await })
        .await
        .unwrap()
        .unwrap();
    // Operator calls too (each spawned: a future that is not `Send` does not compile here).
    use tito::queue::{Limits, Rate};
    let q = queue.clone();
    tokio::spawn(async move {
        q.set_limits(Limits::none().rate(Rate::new(5, Duration::from_secs(1))))
            .await?;
        q.set_limits(Limits::none()).await?;
        q.limit_usage().await?;
        q.pause(None, "spawned").await?;
        q.resume(None).await?;
        q.cancel("no-such-id", "spawned").await?;
        q.cancel_owner(&QueueOwner::new("user", "1"), "spawned")
            .await?;
        q.dead(None, 10).await?;
        q.retry_dead("no-such-id").await?;
        q.discard_dead("no-such-id").await?;
        q.sweep_undecodable().await?;
        q.declare().await
    })
    .await
    .unwrap()
    .unwrap();
}

pub async fn malformed_rows_are_counted_and_left_in_place<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(1, Duration::from_millis(1)),
    ));
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now() - 5))
        .await
        .unwrap();
    // Before and after the good row: a value that is not an invocation, a key that is not a
    // pending key, and an invocation whose payload is not a Job.
    let stamp = now() - 10;
    let rows: Vec<(String, Vec<u8>)> = vec![
        (
            format!("queue:pending:0000:{stamp:020}:00000000000000000001:bad"),
            b"{not json".to_vec(),
        ),
        (
            format!("queue:pending:0000:{stamp:020}:notaversion:x"),
            b"{}".to_vec(),
        ),
        (
            format!(
                "queue:pending:0000:{:020}:00000000000000000002:other",
                now() - 1
            ),
            br#"{"id":"other","key":"k","timestamp":0,"payload":"a string"}"#.to_vec(),
        ),
        // An expired completed row that is not an invocation: retention deletes it anyway.
        (
            "queue:completed:00000000000000000001:00000000000000000001:junk".to_string(),
            b"junk".to_vec(),
        ),
    ];
    ctx.db
        .transaction(|tx| {
            let rows = rows.clone();
            async move {
                for (key, value) in rows {
                    tx.put(key.into_bytes(), value).await?;
                }
                Ok::<_, TitoError>(())
            }
        })
        .await
        .unwrap();
    let (seen, handler) = recorder();
    let worker = start(
        &queue,
        fast(0..1).maintenance_interval(Duration::from_millis(50)),
        handler,
    );
    let q = queue.clone();
    wait_for(
        "the good row and the malformed count",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.stats().acknowledged == 1 && q.stats().malformed >= 3 }
        },
    )
    .await;
    let q = queue.clone();
    wait_for(
        "the expired junk to go",
        Duration::from_secs(30),
        move || {
            let q = q.clone();
            async move { q.completed_count().await.unwrap() == 0 }
        },
    )
    .await;
    worker.stop().await;
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(
        queue.pending_count(0).await.unwrap(),
        3,
        "malformed rows stay where they are"
    );
}

pub async fn transactional_handlers_commit_with_their_outcome<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    for n in 0..3 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    let attempts = Arc::new(AtomicUsize::new(0));
    let a = attempts.clone();
    let prefix = ctx.key("effect:");
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1),
        move |event: QueueEvent<Job>, tx: E::Transaction| {
            let (a, prefix) = (a.clone(), prefix.clone());
            async move {
                let mut key = prefix;
                key.extend_from_slice(event.payload.n.to_string().as_bytes());
                tx.put(key, b"done".to_vec()).await?;
                // The first attempt of n = 1 fails after writing its effect: both roll back.
                if event.payload.n == 1 && a.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(TitoError::invalid_argument("fails after the effect"));
                }
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    drained(&queue, 3).await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(queue.stats().failed, 1);
    assert_eq!(queue.stats().acknowledged, 3);
    let tx = ctx.db.begin().await.unwrap();
    let start = ctx.key("effect:");
    let end = tito::keys::prefix_end_bytes(&start);
    assert_eq!(tx.scan(&start, &end, 10).await.unwrap().len(), 3);
    tx.rollback().await.unwrap();
}

/// Keys whose events land in partition `p` of 2.
fn key_in(p: u32, tag: &str) -> String {
    (0..)
        .map(|i| format!("{tag}{i}"))
        .find(|k| tito::queue::partition_for(k, 2) == p)
        .unwrap()
}

pub async fn a_paused_queue_starts_nothing_until_resumed<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::PAUSE_CHECK;
    let queue = queue(&ctx.db, 2);
    // Nothing published yet: no queue to pause.
    let err = queue.pause(None, "early").await.unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
    queue
        .publish(QueueEvent::new(key_in(0, "a"), Job { n: 0 }, now()))
        .await
        .unwrap();
    // A handler held at a gate, running when the pause commits: it finishes, its outcome
    // applies.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let log = Seen::default();
    let (held, record) = (gate.clone(), log.clone());
    let worker = start(
        &queue,
        fast(0..2).concurrency(4),
        move |event: QueueEvent<Job>| {
            let (held, record) = (held.clone(), record.clone());
            async move {
                if event.payload.n == 0 {
                    held.acquire().await.unwrap().forget();
                }
                record.lock().unwrap().push(event);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let q = queue.clone();
    wait_for(
        "the first handler to start",
        Duration::from_secs(10),
        move || {
            let q = q.clone();
            async move { q.stats().delivered == 1 }
        },
    )
    .await;
    assert!(queue.pause(None, "deploy in progress").await.unwrap());
    assert!(!queue.pause(None, "again").await.unwrap(), "already paused");
    let paused = queue.paused().await.unwrap();
    assert_eq!(paused.queue.as_ref().unwrap().why, "deploy in progress");
    gate.add_permits(1);
    drained(&queue, 1).await;
    // Seen by the worker within PAUSE_CHECK: nothing published after that starts.
    tokio::time::sleep(PAUSE_CHECK + Duration::from_millis(100)).await;
    for (n, p) in [(1, 0), (2, 1), (3, 1)] {
        queue
            .publish(QueueEvent::new(
                key_in(p, &format!("k{n}-")),
                Job { n },
                now(),
            ))
            .await
            .unwrap();
    }
    tokio::time::sleep(PAUSE_CHECK * 3).await;
    assert_eq!(log.lock().unwrap().len(), 1, "nothing starts while paused");
    assert_eq!(queue.stats().delivered, 1);
    let overview = tito::inspect::queue_overview(&ctx.db, None).await.unwrap();
    assert_eq!(overview.paused, paused);
    // Partition 1 paused on its own, then the queue resumed: partition 0's event runs,
    // partition 1's two wait.
    assert!(queue.pause(Some(1), "partition 1 only").await.unwrap());
    assert!(queue.resume(None).await.unwrap());
    assert!(!queue.resume(None).await.unwrap(), "not paused any more");
    let l = log.clone();
    wait_for("partition 0's event", Duration::from_secs(10), move || {
        let l = l.clone();
        async move { l.lock().unwrap().len() == 2 }
    })
    .await;
    tokio::time::sleep(PAUSE_CHECK * 2).await;
    assert_eq!(log.lock().unwrap().len(), 2, "partition 1 still paused");
    assert!(queue.resume(Some(1)).await.unwrap());
    drained(&queue, 4).await;
    assert!(queue.paused().await.unwrap().is_empty());
    // Mistakes: a partition the queue does not have, a reason too long.
    let err = queue.pause(Some(2), "no such").await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let err = queue.pause(None, &"x".repeat(1025)).await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    assert!(queue.paused().await.unwrap().is_empty(), "nothing written");
    worker.stop().await;
}

pub async fn advance_keeps_each_step_and_runs_the_next<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::inspect::{QueueState, queue_scan};
    let queue = queue(&ctx.db, 1);
    let owner = QueueOwner::new("user", "u1");
    let first = QueueEvent::new("job-1", Job { n: 1 }, now()).with_owner(owner.clone());
    let id = first.id.clone();
    queue.publish(first).await.unwrap();
    // Steps 1 -> 2 -> 3 by a plain worker; a step that changes the key is refused.
    let log = Seen::default();
    let record = log.clone();
    let worker = start(&queue, fast(0..1), move |event: QueueEvent<Job>| {
        let record = record.clone();
        async move {
            record.lock().unwrap().push(event.clone());
            let n = event.payload.n;
            Ok(match n {
                1 | 2 => {
                    let due = event.timestamp;
                    QueueHandlerOutcome::Advance(event.advanced(Job { n: n + 1 }, due))
                }
                _ => QueueHandlerOutcome::Acknowledge,
            })
        }
    });
    drained(&queue, 3).await;
    worker.stop().await;
    let steps: Vec<(String, String, u32, u32, Option<QueueOwner>)> = log
        .lock()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e.id.clone(),
                e.key.clone(),
                e.payload.n,
                e.attempt,
                e.owner.clone(),
            )
        })
        .collect();
    let expected: Vec<_> = (1..=3)
        .map(|n| (id.clone(), "job-1".to_string(), n, 1, Some(owner.clone())))
        .collect();
    assert_eq!(
        steps, expected,
        "one id, key and owner; new payloads; attempt 1 each"
    );
    // Each step kept as completed history, newest first.
    let history = queue_scan(&ctx.db, None, QueueState::Completed, None, 10)
        .await
        .unwrap();
    let payloads: Vec<serde_json::Value> = history
        .items
        .iter()
        .map(|r| r.event.as_ref().unwrap().payload["n"].clone())
        .collect();
    assert_eq!(payloads, [3, 2, 1].map(serde_json::Value::from));
    assert_eq!(
        queue.stats().rescheduled,
        2,
        "steps count as completed with a successor"
    );

    // A step that changes the key: refused, the invocation stays pending (a failed handler).
    queue
        .publish(QueueEvent::new("job-2", Job { n: 10 }, now()))
        .await
        .unwrap();
    let tries = Arc::new(AtomicUsize::new(0));
    let counted = tries.clone();
    let worker = start(&queue, fast(0..1), move |event: QueueEvent<Job>| {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            let mut next = event.clone().advanced(Job { n: 11 }, event.timestamp);
            next.key = "elsewhere".into();
            Ok(QueueHandlerOutcome::Advance(next))
        }
    });
    let t = tries.clone();
    wait_for("the refused step", Duration::from_secs(10), move || {
        let t = t.clone();
        async move { t.load(Ordering::SeqCst) >= 2 }
    })
    .await;
    worker.stop().await;
    assert!(queue.stats().failed >= 1);
    assert_eq!(pending_total(&queue).await, 1, "still pending");

    // The transactional worker advances in the handler's transaction.
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1),
        move |event: QueueEvent<Job>, _tx: E::Transaction| async move {
            Ok(if event.payload.n == 10 {
                let due = event.timestamp;
                QueueHandlerOutcome::Advance(event.advanced(Job { n: 11 }, due))
            } else {
                QueueHandlerOutcome::Acknowledge
            })
        },
        rx,
    ));
    drained(&queue, 5).await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
}

pub async fn cancellation_stops_pending_work_and_tells_running_handlers<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::inspect::{QueueState, queue_scan};
    let queue = queue(&ctx.db, 1);
    let later = now() + 3600;
    let owner = QueueOwner::new("account", "a1");
    let e1 = QueueEvent::new("k1", Job { n: 1 }, later);
    let id1 = e1.id.clone();
    queue.publish(e1.clone()).await.unwrap();
    for n in [2, 3] {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, later).with_owner(owner.clone()))
            .await
            .unwrap();
    }
    // By id: completed as cancelled, the id held (publishing it again is a duplicate).
    assert!(queue.cancel(&id1, "published by mistake").await.unwrap());
    assert!(
        !queue.cancel(&id1, "again").await.unwrap(),
        "no longer pending"
    );
    assert!(!queue.cancel("no-such-id", "typo").await.unwrap());
    assert!(queue.publish(e1).await.unwrap().duplicate);
    let history = queue_scan(&ctx.db, None, QueueState::Completed, None, 10)
        .await
        .unwrap();
    let view = history.items[0].event.as_ref().unwrap();
    assert_eq!(
        (view.id.as_str(), view.cancelled.as_deref()),
        (id1.as_str(), Some("published by mistake"))
    );
    // By owner, through the owner index.
    assert_eq!(
        queue.cancel_owner(&owner, "account closed").await.unwrap(),
        2
    );
    assert_eq!(
        queue.cancel_owner(&owner, "account closed").await.unwrap(),
        0
    );
    assert_eq!(pending_total(&queue).await, 0);
    // Mistakes.
    let err = queue.cancel(&id1, &"x".repeat(1025)).await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let err = queue.cancel("", "empty").await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");

    // A running handler is told, and its outcome is not applied; a transactional handler's
    // writes roll back.
    for transactional in [false, true] {
        let n = if transactional { 5 } else { 4 };
        let event = QueueEvent::new(format!("run{n}"), Job { n }, now());
        let id = event.id.clone();
        queue.publish(event).await.unwrap();
        let told = Arc::new(AtomicUsize::new(0));
        // Set by the handler itself: the worker counts a delivery when it pulls the row, before
        // the handler's first call, and a cancel committed in between rightly keeps the handler
        // from ever being called (then there is nobody to tell).
        let started = Arc::new(AtomicUsize::new(0));
        let effect = ctx.key(&format!("effect:{n}"));
        let (stop, rx) = watch::channel(false);
        let (t, s) = (told.clone(), started.clone());
        let wait_to_be_told = move || {
            let (t, s) = (t.clone(), s.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                let cancel = tito::queue::cancellation();
                let heard = tokio::time::timeout(Duration::from_secs(20), cancel.cancelled()).await;
                if heard.is_ok() && cancel.is_cancelled() {
                    t.fetch_add(1, Ordering::SeqCst);
                }
            }
        };
        let worker = if transactional {
            let effect = effect.clone();
            tokio::spawn(run_transactional_worker(
                queue.clone(),
                fast(0..1),
                move |_event: QueueEvent<Job>, tx: E::Transaction| {
                    let (wait, effect) = (wait_to_be_told.clone(), effect.clone());
                    async move {
                        tx.put(effect, b"done".to_vec()).await?;
                        wait().await;
                        Ok(QueueHandlerOutcome::Acknowledge)
                    }
                },
                rx,
            ))
        } else {
            tokio::spawn(run_worker(
                queue.clone(),
                fast(0..1),
                move |_event: QueueEvent<Job>| {
                    let wait = wait_to_be_told.clone();
                    async move {
                        wait().await;
                        Ok(QueueHandlerOutcome::Acknowledge)
                    }
                },
                rx,
            ))
        };
        let s = started.clone();
        wait_for("the handler to start", Duration::from_secs(10), move || {
            let s = s.clone();
            async move { s.load(Ordering::SeqCst) >= 1 }
        })
        .await;
        let acknowledged = queue.stats().acknowledged;
        assert!(queue.cancel(&id, "operator").await.unwrap());
        let t = told.clone();
        wait_for(
            "the handler to be told",
            Duration::from_secs(10),
            move || {
                let t = t.clone();
                async move { t.load(Ordering::SeqCst) >= 1 }
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.send(true).unwrap();
        worker.await.unwrap().unwrap();
        assert_eq!(
            queue.stats().acknowledged,
            acknowledged,
            "no outcome applied"
        );
        let tx = ctx.db.begin().await.unwrap();
        assert_eq!(
            tx.get(&effect).await.unwrap(),
            None,
            "the handler's writes rolled back"
        );
        tx.rollback().await.unwrap();
        let rows = queue_scan(&ctx.db, None, QueueState::Completed, None, 20)
            .await
            .unwrap();
        let of_it: Vec<_> = rows
            .items
            .iter()
            .filter_map(|r| r.event.as_ref())
            .filter(|e| e.id == id)
            .collect();
        assert_eq!(of_it.len(), 1, "one completed row: the cancelled one");
        assert_eq!(of_it[0].cancelled.as_deref(), Some("operator"));
    }
}

/// The ticks of `schedule` pending in `queue`, in order.
async fn ticks<E: TitoEngine>(queue: &Arc<Queue<E>>, schedule: &str) -> Vec<i64> {
    use tito::inspect::{QueueState, queue_scan};
    let mut ticks = Vec::new();
    for p in 0..queue.config().partitions {
        let page = queue_scan(queue.engine(), None, QueueState::Pending(p), None, 100)
            .await
            .unwrap();
        for row in page.items {
            let event = row.event.unwrap();
            let prefix = format!("periodic:{schedule}:");
            if let Some(tick) = event.id.strip_prefix(&prefix) {
                assert_eq!(event.key, schedule);
                assert_eq!(event.timestamp.to_string(), tick, "due at its tick");
                ticks.push(tick.parse().unwrap());
            }
        }
    }
    ticks.sort_unstable();
    ticks
}

pub async fn periodic_ticks_are_published_once_however_many_run<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{PeriodicJob, Schedule, run_periodic};
    let queue = queue(&ctx.db, 2);
    // The queue exists once anything was published to it.
    queue
        .publish(QueueEvent::new("seed", Job { n: 0 }, now() + 3600))
        .await
        .unwrap();
    let job = || {
        vec![PeriodicJob::new(
            Schedule::every("beat", Duration::from_secs(1)).unwrap(),
            Job { n: 7 },
        )]
    };
    // Three runners at once (three processes would do the same): each second's tick once (a
    // runtime stalled for a whole second skips the missed one on purpose, as a restart does).
    let (stop, rx) = watch::channel(false);
    let runners: Vec<_> = (0..3)
        .map(|_| tokio::spawn(run_periodic(queue.clone(), job(), rx.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    stop.send(true).unwrap();
    for runner in runners {
        runner.await.unwrap().unwrap();
    }
    let seen = ticks(&queue, "beat").await;
    assert!(seen.len() >= 2, "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[1] > w[0]),
        "each tick once, in order: {seen:?}"
    );
    // Down for three seconds: on restart only the latest missed tick is published.
    let last = *seen.last().unwrap();
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let restarted = now();
    let (stop, rx) = watch::channel(false);
    let runner = tokio::spawn(run_periodic(queue.clone(), job(), rx));
    let (q, before) = (queue.clone(), seen.len());
    wait_for("the catch-up tick", Duration::from_secs(10), move || {
        let q = q.clone();
        async move { ticks(&q, "beat").await.len() > before }
    })
    .await;
    stop.send(true).unwrap();
    runner.await.unwrap().unwrap();
    let after = ticks(&queue, "beat").await;
    let new: Vec<i64> = after.iter().copied().filter(|t| *t > last).collect();
    assert!(
        new[0] >= restarted - 1,
        "the latest tick, not the first missed: {new:?} (restarted at {restarted}, last {last})"
    );
    assert!(new[0] >= last + 3, "{new:?} after {last}");
    let stored = tito::queue::schedules(&ctx.db, None).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        (stored[0].name.as_str(), stored[0].last_tick),
        ("beat", *after.last().unwrap())
    );
    // Mistakes: two jobs of one name.
    let (_stop, rx) = watch::channel(false);
    let twice = [job(), job()].concat();
    let err = run_periodic(queue.clone(), twice, rx).await.unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
}

/// A runner given a queue handle whose partition count contradicts the queue's stored one
/// ends at once with `InvalidArgument`, as a worker does, and writes no cursor.
pub async fn a_periodic_runner_refuses_a_partition_count_mismatch_at_once<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::queue::{PeriodicJob, Schedule, run_periodic};
    let config =
        |partitions| QueueConfig::new(partitions, Duration::from_secs(3600)).topic("mismatch");
    Queue::new(ctx.db.clone(), config(2))
        .publish(QueueEvent::new("seed", Job { n: 0 }, now() + 3600))
        .await
        .unwrap();
    let wrong = Arc::new(Queue::new(ctx.db.clone(), config(4)));
    let jobs = vec![PeriodicJob::new(
        Schedule::every("beat", Duration::from_secs(1)).unwrap(),
        Job { n: 7 },
    )];
    let (_stop, rx) = watch::channel(false);
    let ended = tokio::time::timeout(Duration::from_secs(5), run_periodic(wrong, jobs, rx))
        .await
        .expect("the runner ends at once instead of retrying every tick");
    match ended {
        Err(TitoError::InvalidArgument(message)) => {
            assert!(message.contains('4') && message.contains('2'), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let stored = tito::queue::schedules(&ctx.db, Some("mismatch"))
        .await
        .unwrap();
    assert!(stored.is_empty(), "nothing written: {stored:?}");
}

/// The shape a row of `shaped` was written in before its model changed: `amount` was a text.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "shaped")]
#[tito(index = "shaped_by_region: region")]
struct ShapedBefore {
    id: String,
    region: String,
    amount: String,
}

/// The model as it is now, with events.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "shaped")]
#[tito(index = "shaped_by_region: region")]
#[tito(event = "shaped_all")]
#[tito(event = "shaped_gone", on = "delete")]
struct Shaped {
    id: String,
    region: String,
    amount: i64,
}

/// A row written in an older shape of a model with events can still be deleted: its index
/// entries (from its manifest) go with it, and the delete's events carry the row as stored.
pub async fn a_row_of_an_older_shape_is_deleted_and_its_event_carries_it<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let before = ctx.db.clone().model::<ShapedBefore>();
    before
        .build(ShapedBefore {
            id: "s1".into(),
            region: "north".into(),
            amount: "twelve".into(),
        })
        .await
        .unwrap();
    let shaped = ctx.db.clone().model::<Shaped>();
    assert!(matches!(
        shaped.find_by_id("s1", vec![]).await,
        Err(TitoError::Integrity(_))
    ));
    shaped
        .delete_by_id("s1")
        .await
        .expect("a row that does not decode is deleted anyway");
    let (row, manifest) = (
        tito::keys::row_key("shaped", "s1"),
        tito::keys::manifest_key("shaped", "s1"),
    );
    assert!(read(&ctx.db, row.as_bytes()).await.is_none());
    assert!(read(&ctx.db, manifest.as_bytes()).await.is_none());
    let found = shaped
        .query_by_index("shaped_by_region")
        .value("north")
        .execute()
        .await
        .unwrap();
    assert!(found.items.is_empty(), "its index entry went with it");
    for topic in ["shaped_all", "shaped_gone"] {
        let pending = pending_of(&ctx.db, topic).await;
        assert_eq!(pending.len(), 1, "{topic}: {pending:?}");
        let payload = &pending[0].1;
        assert_eq!(payload["operation"], "Delete");
        assert_eq!(payload["table"], "shaped");
        assert_eq!(payload["id"], "s1");
        assert_eq!(
            payload["row"],
            serde_json::json!({"id": "s1", "region": "north", "amount": "twelve"}),
            "the row as stored"
        );
    }
}

/// Running handlers, in all and per business key, with the most seen at once.
#[derive(Default)]
struct Occupancy {
    now: HashMap<String, usize>,
    total: usize,
    most_total: usize,
    most_per_key: usize,
}

impl Occupancy {
    fn enter(this: &Mutex<Occupancy>, key: &str) {
        let mut o = this.lock().unwrap();
        o.total += 1;
        o.most_total = o.most_total.max(o.total);
        let n = o.now.entry(key.to_string()).or_default();
        *n += 1;
        let n = *n;
        o.most_per_key = o.most_per_key.max(n);
    }

    fn leave(this: &Mutex<Occupancy>, key: &str) {
        let mut o = this.lock().unwrap();
        o.total -= 1;
        *o.now.get_mut(key).unwrap() -= 1;
    }
}

pub async fn concurrency_limits_hold_over_every_worker<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::Limits;
    let queue = queue(&ctx.db, 4);
    for n in 0..12u32 {
        let key = format!("customer-{}", n % 4);
        queue
            .publish(QueueEvent::new(key, Job { n }, now()))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().concurrency(3).key_concurrency(1))
        .await
        .unwrap();
    let occupancy = Arc::new(Mutex::new(Occupancy::default()));
    let handler = {
        let occupancy = occupancy.clone();
        move |event: QueueEvent<Job>| {
            let occupancy = occupancy.clone();
            async move {
                Occupancy::enter(&occupancy, &event.key);
                tokio::time::sleep(Duration::from_millis(100)).await;
                Occupancy::leave(&occupancy, &event.key);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    // Two workers over every partition, each allowed 8 handlers: the stored limits bind.
    let a = start(&queue, fast(0..4).concurrency(8), handler.clone());
    let b = start(&queue, fast(0..4).concurrency(8), handler);
    drained(&queue, 12).await;
    a.stop().await;
    b.stop().await;
    let (most_total, most_per_key) = {
        let o = occupancy.lock().unwrap();
        (o.most_total, o.most_per_key)
    };
    assert!(most_total <= 3, "at most 3 at once; saw {most_total}");
    assert_eq!(most_per_key, 1, "one per customer at a time");
    assert!(most_total >= 2, "the limit is not a lock: {most_total}");
    assert!(queue.stats().limited > 0, "some waited for a slot");
    let usage = queue.limit_usage().await.unwrap();
    assert_eq!(
        (usage.running, usage.running_by_key.len()),
        (0, 0),
        "every slot released"
    );
    assert_eq!(usage.limits.concurrency, Some(3));
}

pub async fn a_crashed_workers_slots_free_by_the_lease_rule<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::Limits;
    let queue = queue(&ctx.db, 1);
    for n in 0..2u32 {
        queue
            .publish(QueueEvent::new("k", Job { n }, now()))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().concurrency(1))
        .await
        .unwrap();
    // A worker whose first handler never returns, then is gone without a word (its task is
    // dropped mid-handler, as in a crash): its slot stays held until its heartbeat expires.
    let lease = Duration::from_millis(600);
    let hung = start(
        &queue,
        fast(0..1).lease_duration(lease),
        |_event: QueueEvent<Job>| async move {
            futures::future::pending::<()>().await;
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let q = queue.clone();
    wait_for("the first handler", Duration::from_secs(10), move || {
        let q = q.clone();
        async move { q.stats().delivered == 1 }
    })
    .await;
    // Counted while its heartbeat is fresh (renewed every 200 ms; a stalled loop can let it
    // lapse for a moment, so wait for it rather than read once).
    let q = queue.clone();
    wait_for("the slot counted", Duration::from_secs(10), move || {
        let q = q.clone();
        async move { q.limit_usage().await.unwrap().running == 1 }
    })
    .await;
    hung.task.abort();
    let _ = hung.task.await;
    let (seen, handler) = recorder();
    let next = start(&queue, fast(0..1).lease_duration(lease), handler);
    drained(&queue, 2).await;
    next.stop().await;
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "both ran once the slot was free"
    );
    assert_eq!(queue.limit_usage().await.unwrap().running, 0);
}

pub async fn rate_limits_space_starts_and_move_what_waits<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{Limits, Rate};
    let queue = queue(&ctx.db, 2);
    for n in 0..5u32 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    let per = Duration::from_secs(1);
    queue
        .set_limits(Limits::none().rate(Rate::new(2, per)))
        .await
        .unwrap();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let record = starts.clone();
    let worker = start(
        &queue,
        fast(0..2).concurrency(8),
        move |_event: QueueEvent<Job>| {
            record.lock().unwrap().push(std::time::Instant::now());
            async move { Ok(QueueHandlerOutcome::Acknowledge) }
        },
    );
    drained(&queue, 5).await;
    worker.stop().await;
    let mut starts = starts.lock().unwrap().clone();
    starts.sort();
    assert_eq!(starts.len(), 5);
    // Any three starts span at least the interval, less a margin: the gate admits by the
    // engine's time when its transaction starts, the handler sees its start after the admit's
    // commit and its task's scheduling, which on a loaded machine is most late for the first.
    // Without the limit all five start within milliseconds.
    for three in starts.windows(3) {
        let span = three[2] - three[0];
        assert!(
            span >= per - Duration::from_millis(400),
            "3 starts in {span:?}"
        );
    }
    assert!(queue.stats().rate_limited > 0, "what waited was moved");
    let usage = queue.limit_usage().await.unwrap();
    assert!(usage.recent_starts <= 2, "{usage:?}");
}

pub async fn limits_are_checked_and_stored<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{Limits, Rate};
    let queue = queue(&ctx.db, 1);
    // Nothing published: a mistyped queue has no limits to set.
    let err = queue
        .set_limits(Limits::none().concurrency(1))
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
    queue
        .publish(QueueEvent::new("k", Job { n: 0 }, now()))
        .await
        .unwrap();
    let secs = Duration::from_secs;
    for bad in [
        Limits::none().concurrency(0),
        Limits::none().key_concurrency(1025),
        Limits::none().rate(Rate::new(0, secs(1))),
        Limits::none().rate(Rate::new(1001, secs(1))),
        Limits::none().key_rate(Rate::new(1, Duration::from_millis(999))),
        Limits::none().key_rate(Rate::new(1, secs(86_401))),
    ] {
        let err = queue.set_limits(bad.clone()).await.unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{bad:?}: {err:?}"
        );
    }
    assert!(queue.limits().await.unwrap().is_none(), "nothing stored");
    let set = Limits::none()
        .concurrency(1024)
        .key_rate(Rate::new(1000, secs(86_400)));
    queue.set_limits(set.clone()).await.unwrap();
    assert_eq!(queue.limits().await.unwrap(), set);
    let topic = tito::queue::limits(&ctx.db, None).await.unwrap();
    assert_eq!(topic, set, "the tool functions read the same record");
    queue.set_limits(Limits::none()).await.unwrap();
    assert!(queue.limits().await.unwrap().is_none());
}

pub async fn unique_keys_hold_for_their_period_in_the_states_covered<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::{Unique, UniqueStates};
    let queue = queue(&ctx.db, 2);
    let hour = Duration::from_secs(3600);
    // By an explicit key: the second publication collides and names the first.
    let first = QueueEvent::new("u1", Job { n: 1 }, now());
    let by_user = Unique::key("reminder:u1", hour);
    let published = queue.publish_unique(first.clone(), &by_user).await.unwrap();
    assert!(!published.duplicate);
    let again = queue
        .publish_unique(QueueEvent::new("u1", Job { n: 2 }, now()), &by_user)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.key, published.key, "the invocation it collided with");
    assert_eq!(again.collided_id.as_deref(), Some(first.id.as_str()));
    // The answer's id is the invocation's to await: the holder's.
    assert_eq!(published.id, first.id);
    assert_eq!(again.id, first.id);
    // The same id again is a duplicate by id (nothing collided by key).
    let same_id = queue.publish_unique(first.clone(), &by_user).await.unwrap();
    assert!(same_id.duplicate && same_id.collided_id.is_none());
    assert_eq!(same_id.id, first.id);
    // By payload fields: equal `n`, same job; another `n`, another job.
    let by_n = Unique::fields(["n"], hour);
    let five = queue
        .publish_unique(QueueEvent::new("a", Job { n: 5 }, now()), &by_n)
        .await
        .unwrap();
    assert!(!five.duplicate);
    let five_again = queue
        .publish_unique(QueueEvent::new("b", Job { n: 5 }, now()), &by_n)
        .await
        .unwrap();
    assert_eq!((five_again.duplicate, five_again.key), (true, five.key));
    let six = queue
        .publish_unique(QueueEvent::new("a", Job { n: 6 }, now()), &by_n)
        .await
        .unwrap();
    assert!(!six.duplicate);
    // Racing publications of one key: exactly one is written.
    let racing = Unique::key("race", hour);
    let results = futures::future::join_all((0..6).map(|n| {
        let (queue, racing) = (queue.clone(), racing.clone());
        async move {
            queue
                .publish_unique(
                    QueueEvent::new(format!("r{n}"), Job { n: 100 + n }, now()),
                    &racing,
                )
                .await
                .unwrap()
        }
    }))
    .await;
    assert_eq!(
        results.iter().filter(|p| !p.duplicate).count(),
        1,
        "{results:?}"
    );
    // Run everything: `Pending` frees the key once its holder completed, `Any` does not.
    let pending_only = Unique::key("p", hour);
    let any = Unique::key("a", hour).covering(UniqueStates::Any);
    for rule in [&pending_only, &any] {
        let p = queue
            .publish_unique(QueueEvent::new("x", Job { n: 50 }, now()), rule)
            .await
            .unwrap();
        assert!(!p.duplicate);
    }
    let (_seen, handler) = recorder();
    let worker = start(&queue, fast(0..2), handler);
    // u1, n=5, n=6, the race's one, p and a.
    drained(&queue, 6).await;
    worker.stop().await;
    let after = queue
        .publish_unique(QueueEvent::new("x", Job { n: 51 }, now()), &pending_only)
        .await
        .unwrap();
    assert!(!after.duplicate, "a completed holder frees a Pending key");
    let after = queue
        .publish_unique(QueueEvent::new("x", Job { n: 52 }, now()), &any)
        .await
        .unwrap();
    assert!(after.duplicate, "an Any key holds past completion");
    assert!(after.key.contains(":completed:"), "{}", after.key);
    // A short period ends: the key is free again though its holder is still pending, and
    // maintenance deletes the expired record.
    let short = Unique::key("short", Duration::from_secs(1));
    let held = queue
        .publish_unique(QueueEvent::new("s", Job { n: 60 }, now() + 3600), &short)
        .await
        .unwrap();
    assert!(!held.duplicate);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let free = queue
        .publish_unique(QueueEvent::new("s", Job { n: 61 }, now() + 3600), &short)
        .await
        .unwrap();
    assert!(!free.duplicate, "the period ended");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The second took the key over (the first's expiry entry went with it): one record to
    // delete, and it is gone.
    assert_eq!(queue.sweep_unique().await.unwrap(), 1);
    assert_eq!(queue.sweep_unique().await.unwrap(), 0);
    let tx = ctx.db.begin().await.unwrap();
    let record = tito::keys::unique_key("queue", "short");
    assert_eq!(tx.get(record.as_bytes()).await.unwrap(), None);
    let kept = tito::keys::unique_key("queue", "reminder:u1");
    assert!(
        tx.get(kept.as_bytes()).await.unwrap().is_some(),
        "an hour's key stays"
    );
    tx.rollback().await.unwrap();
    // Mistakes, refused before anything is written.
    let bad = [
        Unique::fields(["missing"], hour),
        Unique::fields(Vec::<String>::new(), hour),
        Unique::key("", hour),
        Unique::key("k".repeat(1025), hour),
        Unique::key("k", Duration::ZERO),
        Unique::key("k", Duration::from_secs(31 * 24 * 3600)),
    ];
    for rule in &bad {
        let err = queue
            .publish_unique(QueueEvent::new("m", Job { n: 70 }, now()), rule)
            .await
            .unwrap_err();
        assert!(
            matches!(err, TitoError::InvalidArgument(_)),
            "{rule:?}: {err:?}"
        );
    }
    let scalar = tito::Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)),
    );
    let err = scalar
        .publish_unique(
            QueueEvent::new("m", 7u32, now()),
            &Unique::fields(["n"], hour),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("JSON object"), "{err}");
}

pub async fn priorities_run_first_and_lower_ones_age<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let t = now();
    // Published in this order; run (one at a time) in priority order, except that a priority
    // counts as a minute of waiting per step: the low one due ten minutes ago goes first.
    let plan = [
        (1, 0, t - 30),  // low, due 30 s ago
        (2, 9, t),       // high, due now
        (3, 0, t - 30),  // low
        (4, 9, t),       // high
        (5, 0, t - 600), // low, waited longer than nine minutes
        (6, 9, t + 2),   // high, not due yet: never runs early
        (7, 4, t),       // middle
    ];
    for (n, priority, due) in plan {
        queue
            .publish(QueueEvent::new("k", Job { n }, due).with_urgency(priority))
            .await
            .unwrap();
    }
    let err = queue
        .publish(QueueEvent::new("k", Job { n: 99 }, t).with_urgency(10))
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let order = Arc::new(Mutex::new(Vec::new()));
    let record = order.clone();
    let worker = start(
        &queue,
        fast(0..1).concurrency(1).page_size(1),
        move |event: QueueEvent<Job>| {
            let at = chrono::Utc::now().timestamp_millis();
            record
                .lock()
                .unwrap()
                .push((event.payload.n, event.urgency, at, event.timestamp));
            async move { Ok(QueueHandlerOutcome::Acknowledge) }
        },
    );
    drained(&queue, 7).await;
    worker.stop().await;
    let order = order.lock().unwrap().clone();
    // The future one may run before the last of the others on a slow machine (once due, its
    // priority puts it ahead of 7, 1 and 3): the others' order is checked without it, and it
    // never starts before its due time.
    let ran: Vec<u32> = order.iter().map(|(n, ..)| *n).filter(|n| *n != 6).collect();
    assert_eq!(ran, [5, 2, 4, 7, 1, 3], "{order:?}");
    let &(_, priority, at, due) = order.iter().find(|(n, ..)| *n == 6).unwrap();
    assert_eq!(priority, 9, "its priority kept");
    assert!(at >= due * 1000 - 100, "started at {at} ms, due at {due} s");
}

/// A key's invocations, due at one second and stored in order, first run in that order at the
/// default concurrency (many handlers at once), for plain and transactional handlers alike,
/// whatever order the runtime polls their tasks in.
pub async fn a_keys_handlers_first_run_in_the_order_of_its_rows<E: TitoEngine>(ctx: Ctx<E>) {
    const KEYS: u32 = 6;
    const PER_KEY: u32 = 8;
    for transactional in [false, true] {
        let queue = Arc::new(Queue::new(
            ctx.db.clone(),
            QueueConfig::new(2, Duration::from_secs(3600)).topic(if transactional {
                "ordered_tx"
            } else {
                "ordered"
            }),
        ));
        let due = now();
        for n in 0..PER_KEY {
            for key in 0..KEYS {
                queue
                    .publish(QueueEvent::new(format!("row:{key}"), Job { n }, due))
                    .await
                    .unwrap();
            }
        }
        let seen: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
        let (stop, rx) = watch::channel(false);
        let sink = seen.clone();
        let task = if transactional {
            tokio::spawn(run_transactional_worker(
                queue.clone(),
                fast(0..2),
                move |event: QueueEvent<Job>, _tx| {
                    let sink = sink.clone();
                    async move {
                        sink.lock().unwrap().push((event.key, event.payload.n));
                        Ok(QueueHandlerOutcome::Acknowledge)
                    }
                },
                rx,
            ))
        } else {
            tokio::spawn(run_worker(
                queue.clone(),
                fast(0..2),
                move |event: QueueEvent<Job>| {
                    let sink = sink.clone();
                    async move {
                        sink.lock().unwrap().push((event.key, event.payload.n));
                        Ok(QueueHandlerOutcome::Acknowledge)
                    }
                },
                rx,
            ))
        };
        let watched = seen.clone();
        wait_for("every start", Duration::from_secs(60), move || {
            let watched = watched.clone();
            async move {
                // A transactional handler runs again when its transaction replays: count each
                // invocation once.
                let distinct: std::collections::HashSet<(String, u32)> =
                    watched.lock().unwrap().iter().cloned().collect();
                distinct.len() as u32 >= KEYS * PER_KEY
            }
        })
        .await;
        stop.send(true).unwrap();
        task.await.unwrap().unwrap();
        let seen = seen.lock().unwrap().clone();
        for key in 0..KEYS {
            // Each invocation's first run, in the order they happened.
            let mut order: Vec<u32> = Vec::new();
            for (_, n) in seen.iter().filter(|(k, _)| *k == format!("row:{key}")) {
                if !order.contains(n) {
                    order.push(*n);
                }
            }
            assert_eq!(
                order,
                (0..PER_KEY).collect::<Vec<_>>(),
                "row:{key}, transactional: {transactional}"
            );
        }
    }
}

/// Every pending row's payload `n`, over every partition (read in pages).
async fn pending_ns<E: TitoEngine>(db: &E, topic: Option<&str>) -> Vec<u32> {
    let root = tito::keys::queue_root(topic);
    let prefix = format!("{root}:pending:");
    let end = tito::prefix_end_bytes(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut ns = Vec::new();
    loop {
        let tx = db.begin().await.unwrap();
        let rows = tx.scan(&from, &end, 1000).await.unwrap();
        tx.rollback().await.unwrap();
        let Some((last, _)) = rows.last() else {
            break;
        };
        from = [last.as_slice(), &[0]].concat();
        for (_, value) in &rows {
            let row: serde_json::Value = serde_json::from_slice(value).unwrap();
            ns.push(row["payload"]["n"].as_u64().unwrap() as u32);
        }
    }
    ns.sort_unstable();
    ns
}

pub async fn publish_many_commits_in_bounded_transactions_and_resumes_after_a_failure<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let faulty = FaultyEngine::new(ctx.db.clone());
    let queue = Arc::new(Queue::new(
        faulty.clone(),
        QueueConfig::new(4, Duration::from_secs(3600)).topic("many"),
    ));
    let at = now();
    // One event of the list is published already; two of the list share an id.
    let mut events: Vec<QueueEvent<Job>> = (0..2_500)
        .map(|n| QueueEvent::new(format!("k{}", n % 97), Job { n }, at))
        .collect();
    events[11] = events[10].clone();
    let before = queue.publish(events[0].clone()).await.unwrap();
    // The second of three transactions (1,000 + 1,000 + 500 events) fails.
    let commits = faulty.faults().calls(FaultPoint::Commit);
    faulty.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::Storage)
            .skip(1)
            .times(1),
    );
    let err = queue.publish_many(&events).await.unwrap_err();
    match &err {
        TitoError::PartiallyPublished {
            published, total, ..
        } => assert_eq!((*published, *total), (1_000, 2_500), "{err}"),
        other => panic!("expected PartiallyPublished, got {other:?}"),
    }
    assert!(
        err.to_string().contains("publishing the same events again"),
        "{err}"
    );
    assert_eq!(faulty.faults().calls(FaultPoint::Commit) - commits, 2);
    // The first transaction's events, less the two duplicates: the one published before and
    // the second of the shared id.
    let first: Vec<u32> = (0..1_000).filter(|n| *n != 11).collect();
    assert_eq!(pending_ns(&ctx.db, Some("many")).await, first);

    // Published again, whole: the first thousand answer as duplicates, the rest are new, in
    // three transactions of one batched read each.
    faulty.faults().clear();
    let (commits, reads) = (
        faulty.faults().calls(FaultPoint::Commit),
        faulty.faults().calls(FaultPoint::Get),
    );
    let answers = queue.publish_many(&events).await.unwrap();
    assert_eq!(faulty.faults().calls(FaultPoint::Commit) - commits, 3);
    assert_eq!(faulty.faults().calls(FaultPoint::Get) - reads, 3);
    assert_eq!(answers.len(), 2_500);
    assert!(answers[..1_000].iter().all(|a| a.duplicate));
    assert!(answers[1_000..].iter().all(|a| !a.duplicate));
    assert_eq!(answers[0].key, before.key);
    assert_eq!(answers[11].key, answers[10].key);
    let all: Vec<u32> = (0..2_500).filter(|n| *n != 11).collect();
    assert_eq!(pending_ns(&ctx.db, Some("many")).await, all);
    // Every answer names its own event's row (the duplicates the first one's).
    let distinct: std::collections::HashSet<&str> =
        answers.iter().map(|a| a.key.as_str()).collect();
    assert_eq!(distinct.len(), 2_499);

    // Nothing is written when one event is bad, and the error names it.
    let mut bad = vec![QueueEvent::new("fine", Job { n: 9_000 }, at)];
    bad.push(QueueEvent::new("bad", Job { n: 9_001 }, at).with_max_attempts(0));
    let err = queue.publish_many(&bad).await.unwrap_err();
    assert!(
        matches!(&err, TitoError::InvalidArgument(why) if why.contains("event 1 of 2") && why.contains("nothing was published")),
        "{err}"
    );
    assert_eq!(pending_ns(&ctx.db, Some("many")).await.len(), 2_499);
    // An empty list publishes nothing and costs nothing.
    let commits = faulty.faults().calls(FaultPoint::Commit);
    assert!(queue.publish_many::<Job>(&[]).await.unwrap().is_empty());
    assert_eq!(faulty.faults().calls(FaultPoint::Commit), commits);
}

pub async fn publish_many_honours_ids_unique_keys_owners_and_the_callers_transaction<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    #[derive(Clone, Debug, Serialize, Deserialize)]
    struct Mail {
        user: String,
        n: u32,
    }
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)).topic("many-unique"),
    ));
    let at = now();
    let mail = |user: &str, n: u32| {
        QueueEvent::new(
            user.to_string(),
            Mail {
                user: user.into(),
                n,
            },
            at,
        )
    };
    let rule = tito::queue::Unique::fields(["user"], Duration::from_secs(3600));
    let held = queue.publish_unique(mail("d", 0), &rule).await.unwrap();
    let owner = QueueOwner::new("account", "acc-1");
    let events = vec![
        mail("a", 1),
        mail("b", 2),
        mail("a", 3),
        mail("c", 4).with_owner(owner.clone()),
        mail("d", 5),
        mail("e", 6).with_owner(owner.clone()),
    ];
    let answers = queue.publish_many_unique(&events, &rule).await.unwrap();
    let duplicate: Vec<bool> = answers.iter().map(|a| a.duplicate).collect();
    assert_eq!(duplicate, [false, false, true, false, true, false]);
    // The second "a" collided with the first of the list, "d" with the one published before.
    assert_eq!(answers[2].key, answers[0].key);
    assert_eq!(
        answers[2].collided_id.as_deref(),
        Some(events[0].id.as_str())
    );
    assert_eq!(answers[4].key, held.key);
    // The same rule one by one agrees with the list: every key is held now.
    for user in ["a", "b", "c", "d", "e"] {
        let again = queue.publish_unique(mail(user, 9), &rule).await.unwrap();
        assert!(again.duplicate, "{user}");
    }
    // Owners move with their rows: cancelling the owner takes exactly its two.
    assert_eq!(queue.cancel_owner(&owner, "closed").await.unwrap(), 2);

    // In the caller's transaction: with its data, or not at all.
    let later: Vec<QueueEvent<Mail>> = (10..20).map(|n| mail(&format!("u{n}"), n)).collect();
    let failed: Result<(), TitoError> = ctx
        .db
        .transaction(|tx| {
            let (queue, later) = (queue.clone(), later.clone());
            async move {
                queue.publish_many_in_tx(&later, &tx).await?;
                tx.put(b"many:row".to_vec(), b"1".to_vec()).await?;
                Err(TitoError::invalid_argument("the caller changed its mind"))
            }
        })
        .await;
    assert!(failed.is_err());
    assert!(read(&ctx.db, b"many:row").await.is_none());
    let answers = ctx
        .db
        .transaction(|tx| {
            let (queue, later) = (queue.clone(), later.clone());
            async move {
                let answers = queue.publish_many_in_tx(&later, &tx).await?;
                tx.put(b"many:row".to_vec(), b"1".to_vec()).await?;
                Ok::<_, TitoError>(answers)
            }
        })
        .await
        .unwrap();
    assert!(answers.iter().all(|a| !a.duplicate));
    assert!(read(&ctx.db, b"many:row").await.is_some());
    // Each published once: 10 of the later ones, a, b, d (held before) from the list.
    assert_eq!(pending_total(&queue).await, 13);

    // More than a caller's transaction takes is refused, naming the call that takes it.
    let huge: Vec<QueueEvent<Mail>> = (0..tito::queue::MAX_PUBLISH_IN_TX as u32 + 1)
        .map(|n| mail("h", n))
        .collect();
    let tx = ctx.db.begin().await.unwrap();
    let err = queue.publish_many_in_tx(&huge, &tx).await.unwrap_err();
    tx.rollback().await.unwrap();
    assert!(
        matches!(&err, TitoError::InvalidArgument(why) if why.contains("publish_many")),
        "{err}"
    );
}

pub async fn a_published_list_starts_in_the_order_of_its_ids<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let due = now();
    // Default ids, made in the list's order: the list's order.
    let made: Vec<QueueEvent<Job>> = (0..30)
        .map(|n| QueueEvent::new("k", Job { n }, due))
        .collect();
    // Ids of one's own that sort against the list: their order.
    let own: Vec<QueueEvent<Job>> = (30..60)
        .map(|n| QueueEvent::new("k", Job { n }, due).with_id(format!("z{:03}", 999 - n)))
        .collect();
    queue.publish_many(&made).await.unwrap();
    queue.publish_many(&own).await.unwrap();
    let (seen, handler) = recorder();
    let worker = start(&queue, fast(0..1).concurrency(1).page_size(1), handler);
    drained(&queue, 60).await;
    worker.stop().await;
    let order: Vec<u32> = seen.lock().unwrap().iter().map(|e| e.payload.n).collect();
    let mut expected: Vec<u32> = (0..30).collect();
    expected.extend((30..60).rev());
    assert_eq!(order, expected);
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    n: u32,
    note: String,
}

pub async fn results_are_kept_with_the_completion_and_awaited_from_any_handle<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::queue::{FailurePolicy, Finished, InvocationState};
    let queue = queue(&ctx.db, 2);
    // Another handle on the same store and queue: what another process sees.
    let other = self::queue(&ctx.db, 2);
    // By n % 4: 0 returns a receipt; 1 acknowledges plainly; 2 fails its only attempt (dead);
    // 3 advances once, and the step returns a receipt.
    let events: Vec<QueueEvent<Job>> = (0..12)
        .map(|n| QueueEvent::new(format!("k{n}"), Job { n }, now()))
        .collect();
    let ids: Vec<String> = events.iter().map(|e| e.id.clone()).collect();
    let later = QueueEvent::new("later", Job { n: 99 }, now() + 3600);
    let later_id = later.id.clone();
    let cancelled = QueueEvent::new("cancelled", Job { n: 98 }, now() + 3600);
    let cancelled_id = cancelled.id.clone();
    queue.publish_many(&events).await.unwrap();
    queue.publish_many(&[later, cancelled]).await.unwrap();
    assert_eq!(
        other.invocation_state::<Receipt>(&ids[0]).await.unwrap(),
        InvocationState::Pending { attempt: 1 }
    );
    assert!(queue.cancel(&cancelled_id, "not needed").await.unwrap());
    let worker = start(
        &queue,
        fast(0..2)
            .failure_policy(FailurePolicy::new(1))
            .outcome_delay(Duration::from_millis(20)),
        |event: QueueEvent<Job>| async move {
            let n = event.payload.n;
            if n >= 100 {
                return QueueHandlerOutcome::acknowledge_with(&Receipt {
                    n,
                    note: "step two".into(),
                });
            }
            match n % 4 {
                0 => QueueHandlerOutcome::acknowledge_with(&Receipt {
                    n,
                    note: format!("receipt {n}"),
                }),
                1 => Ok(QueueHandlerOutcome::Acknowledge),
                2 => Err(TitoError::handler(format!("job {n} cannot run"))),
                _ => {
                    let due = event.timestamp;
                    Ok(QueueHandlerOutcome::Advance(
                        event.advanced(Job { n: n + 100 }, due),
                    ))
                }
            }
        },
    );
    for (n, id) in ids.iter().enumerate() {
        let n = n as u32;
        let finished = other
            .await_result::<Receipt>(id, Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("event {n} did not finish"));
        let expected = match n % 4 {
            0 => Finished::Completed(Some(Receipt {
                n,
                note: format!("receipt {n}"),
            })),
            1 => Finished::Completed(None),
            2 => Finished::Dead {
                error: format!("handler error: job {n} cannot run"),
                attempts: 1,
            },
            _ => Finished::Completed(Some(Receipt {
                n: n + 100,
                note: "step two".into(),
            })),
        };
        match (&finished, &expected) {
            // The dead letter's error is the handler's, however the error type prints it.
            (Finished::Dead { error, attempts }, Finished::Dead { .. }) => {
                assert!(error.contains(&format!("job {n} cannot run")), "{error}");
                assert_eq!(*attempts, 1);
            }
            _ => assert_eq!(finished, expected, "event {n}"),
        }
    }
    assert_eq!(
        other
            .await_result::<Receipt>(&cancelled_id, Duration::ZERO)
            .await
            .unwrap(),
        Some(Finished::Cancelled("not needed".into()))
    );
    // Still pending when the timeout passes.
    assert_eq!(
        other
            .await_result::<Receipt>(&later_id, Duration::from_millis(50))
            .await
            .unwrap(),
        None
    );
    // An id nobody published.
    assert!(matches!(
        other
            .await_result::<Receipt>("nobody", Duration::from_millis(10))
            .await,
        Err(TitoError::NotFound(_))
    ));
    assert_eq!(
        other.invocation_state::<Receipt>("nobody").await.unwrap(),
        InvocationState::Unknown
    );
    // A result read as another type says so.
    assert!(matches!(
        other.invocation_state::<u64>(&ids[0]).await,
        Err(TitoError::Serialization { .. })
    ));
    // Read untyped, whatever it is.
    match other
        .invocation_state::<serde_json::Value>(&ids[0])
        .await
        .unwrap()
    {
        InvocationState::Finished(Finished::Completed(Some(value))) => {
            assert_eq!(value["note"], "receipt 0")
        }
        other => panic!("{other:?}"),
    }
    worker.stop().await;
}

pub async fn a_result_over_the_bound_is_a_failed_attempt_that_names_the_fix<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::queue::{FailurePolicy, Finished, MAX_RESULT_BYTES};
    let queue = queue(&ctx.db, 1);
    let big = QueueEvent::new("k", Job { n: 1 }, now());
    let id = big.id.clone();
    queue.publish(big).await.unwrap();
    let worker = start(
        &queue,
        fast(0..1).failure_policy(FailurePolicy::new(1)),
        |_event: QueueEvent<Job>| async move {
            QueueHandlerOutcome::acknowledge_with(&"x".repeat(MAX_RESULT_BYTES))
        },
    );
    let finished = queue
        .await_result::<String>(&id, Duration::from_secs(30))
        .await
        .unwrap();
    worker.stop().await;
    match finished {
        Some(Finished::Dead { error, .. }) => {
            assert!(error.contains("at most 65536"), "{error}");
            assert!(error.contains("store a large result"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    // At the bound, accepted (a JSON string of n characters takes n + 2 bytes).
    assert!(
        QueueHandlerOutcome::<Job>::acknowledge_with(&"x".repeat(MAX_RESULT_BYTES - 2)).is_ok()
    );
}

pub async fn a_transactional_handlers_result_commits_with_its_writes<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::queue::Finished;
    let queue = queue(&ctx.db, 1);
    let event = QueueEvent::new("k", Job { n: 3 }, now());
    let id = event.id.clone();
    queue.publish(event).await.unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let a = attempts.clone();
    let effect = ctx.key("effect");
    let written = effect.clone();
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1),
        move |event: QueueEvent<Job>, tx: E::Transaction| {
            let (a, effect) = (a.clone(), written.clone());
            async move {
                tx.put(effect, b"charged".to_vec()).await?;
                // The first attempt fails after its write and its result: neither is kept.
                if a.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(TitoError::invalid_argument("fails after the effect"));
                }
                QueueHandlerOutcome::acknowledge_with(&Receipt {
                    n: event.payload.n,
                    note: format!("attempt {}", a.load(Ordering::SeqCst)),
                })
            }
        },
        rx,
    ));
    let finished = queue
        .await_result::<Receipt>(&id, Duration::from_secs(30))
        .await
        .unwrap();
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(
        finished,
        Some(Finished::Completed(Some(Receipt {
            n: 3,
            note: "attempt 2".into()
        })))
    );
    assert_eq!(read(&ctx.db, &effect).await, Some(b"charged".to_vec()));
}

/// A JSON value nested `depth` levels of arrays around `1`.
fn nested(depth: usize) -> serde_json::Value {
    let mut value = serde_json::json!(1);
    for _ in 0..depth {
        value = serde_json::json!([value]);
    }
    value
}

pub async fn null_and_deep_results_read_back_and_deeper_ones_are_refused<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::queue::{Finished, MAX_JSON_DEPTH};
    let queue = queue(&ctx.db, 1);
    // n: 0 returns (), 1 returns None, 2 the deepest result kept, 3 one level deeper.
    let events: Vec<QueueEvent<Job>> = (0..4)
        .map(|n| QueueEvent::new(format!("k{n}"), Job { n }, now()))
        .collect();
    let ids: Vec<String> = queue
        .publish_many(&events)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    let refused = Arc::new(Mutex::new(None));
    let seen = refused.clone();
    let worker = start(&queue, fast(0..1), move |event: QueueEvent<Job>| {
        let seen = seen.clone();
        async move {
            match event.payload.n {
                0 => QueueHandlerOutcome::acknowledge_with(&()),
                1 => QueueHandlerOutcome::acknowledge_with(&None::<u32>),
                2 => QueueHandlerOutcome::acknowledge_with(&nested(MAX_JSON_DEPTH)),
                _ => {
                    match QueueHandlerOutcome::<Job>::acknowledge_with(&nested(MAX_JSON_DEPTH + 1))
                    {
                        Err(err) => {
                            *seen.lock().unwrap() = Some(err.to_string());
                            Ok(QueueHandlerOutcome::Acknowledge)
                        }
                        Ok(_) => panic!("a result deeper than the bound was accepted"),
                    }
                }
            }
        }
    });
    let wait = Duration::from_secs(30);
    // A null result is a result, not the absence of one.
    assert_eq!(
        queue.await_result::<()>(&ids[0], wait).await.unwrap(),
        Some(Finished::Completed(Some(())))
    );
    assert_eq!(
        queue
            .await_result::<Option<u32>>(&ids[1], wait)
            .await
            .unwrap(),
        Some(Finished::Completed(Some(None)))
    );
    assert_eq!(
        queue
            .await_result::<serde_json::Value>(&ids[2], wait)
            .await
            .unwrap(),
        Some(Finished::Completed(Some(nested(MAX_JSON_DEPTH))))
    );
    assert_eq!(
        queue.await_result::<()>(&ids[3], wait).await.unwrap(),
        Some(Finished::Completed(None))
    );
    let message = refused.lock().unwrap().clone().unwrap();
    assert!(
        message.contains("at most 64") && message.contains("flatten"),
        "{message}"
    );
    // No limit: an answer at once for what finished, no overflow.
    assert_eq!(
        queue
            .await_result::<()>(&ids[0], Duration::MAX)
            .await
            .unwrap(),
        Some(Finished::Completed(Some(())))
    );
    worker.stop().await;
    // A payload nested deeper than the bound is refused when published, naming the fix.
    let deep = QueueEvent::new("deep", nested(MAX_JSON_DEPTH + 1), now());
    match queue.publish(deep).await {
        Err(TitoError::InvalidArgument(message)) => {
            assert!(message.contains("flatten"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        queue
            .publish(QueueEvent::new(
                "deep",
                nested(MAX_JSON_DEPTH),
                now() + 3600
            ))
            .await
            .is_ok()
    );
}

/// Promise Q-WRK-41: a worker shares its handlers among its due partitions and begins each
/// round of pulls with another one, so a partition holding 100 times the others' rows does
/// not keep them waiting: every row of the light partitions starts within the first rounds
/// (one per due partition per round at least, while as many handlers are free), not after
/// the backlog.
pub async fn a_backlog_in_one_partition_leaves_handlers_for_the_others<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 4);
    let key_in = |partition: u32, n: u32| {
        (0..)
            .map(|i| format!("p{partition}-{n}-{i}"))
            .find(|key| tito::queue::partition_for(key, 4) == partition)
            .unwrap()
    };
    // One partition holds 100 times the rows of each other one.
    let t = now();
    let mut events = Vec::new();
    for n in 0..600 {
        events.push(QueueEvent::new(key_in(0, n), Job { n }, t));
    }
    for partition in 1..4 {
        for n in 0..6 {
            events.push(QueueEvent::new(
                key_in(partition, n),
                Job {
                    n: 1000 * partition + n,
                },
                t,
            ));
        }
    }
    queue.publish_many(&events).await.unwrap();
    let order: Arc<Mutex<Vec<u32>>> = Arc::default();
    let log = order.clone();
    let worker = start(
        &queue,
        fast(0..4).concurrency(4),
        move |event: QueueEvent<Job>| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(event.payload.n);
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    drained(&queue, 618).await;
    worker.stop().await;
    let order = order.lock().unwrap().clone();
    let last_light = order.iter().rposition(|n| *n >= 1000).unwrap();
    // Six rows in each light partition: with a share per due partition per round (four
    // handlers, four due partitions: one each), each light row starts within one round per
    // due partition of the row before it, so the last within about 6 rounds of 4 starts (a
    // margin of two rounds for handlers that free up one at a time). Before handlers were
    // shared, the backlog took every handler and the light rows started last.
    assert!(
        last_light < 32,
        "the light partitions' last row started {}th of 618: {order:?}",
        last_light + 1
    );
}

/// Issue 60: a transactional handler's transaction locks a fence slot of its partition, not
/// the holder key; a takeover committed while that transaction is under way (after it began,
/// before it commits) writes every slot of the old holder, so the handler's writes and its
/// outcome never commit, and the attempt is not counted against the invocation.
pub async fn a_takeover_fences_a_transactional_outcome_already_under_way<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    let published = queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let (release_tx, release_rx) = watch::channel(false);
    let started = Arc::new(AtomicUsize::new(0));
    let (s, effect) = (started.clone(), ctx.key("fenced-effect"));
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1).lease_duration(Duration::from_secs(60)),
        move |_event: QueueEvent<Job>, tx: E::Transaction| {
            let (mut release, s, effect) = (release_rx.clone(), s.clone(), effect.clone());
            async move {
                // Reads (so the transaction has begun on every engine), then waits.
                let _ = tx.get(&effect).await?;
                tx.put(effect, b"written".to_vec()).await?;
                s.fetch_add(1, Ordering::SeqCst);
                let _ = release.wait_for(|go| *go).await;
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
        rx,
    ));
    let s = started.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // The worker's holder record names its fence slots (one per handler, one for its batch).
    let holder = crate::support::read(&ctx.db, b"queue:lease:0000")
        .await
        .unwrap();
    let holder: tito::queue::lease::Lease = serde_json::from_slice(&holder).unwrap();
    assert_eq!(holder.fences, Some(17), "{holder:?}");
    // Another worker takes the partition the way workers do, as if this one had stalled past
    // its expiry (the expiry is set in the past first; a renewal in between is tried again).
    let mut taken = false;
    for _ in 0..5 {
        ctx.db
            .transaction(|tx| async move {
                tx.put(b"queue:lease-expiry:0000".to_vec(), b"0".to_vec())
                    .await
            })
            .await
            .unwrap();
        let held = tito::queue::lease::acquire(&ctx.db, "queue", &[0], "thief", 60_000, true, 4)
            .await
            .unwrap();
        if held.get(&0).is_some_and(|l| l.owner == "thief") {
            taken = true;
            break;
        }
    }
    assert!(taken, "the thief took the lease");
    release_tx.send(true).unwrap();
    let q = queue.clone();
    wait_for("the fenced attempt", Duration::from_secs(30), move || {
        let q = q.clone();
        async move { q.stats().failed >= 1 }
    })
    .await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    // Nothing of the handler's transaction committed; the invocation is still pending, with no
    // failed attempt recorded on it, for the thief to run.
    assert_eq!(
        crate::support::read(&ctx.db, &ctx.key("fenced-effect")).await,
        None
    );
    assert_eq!(queue.stats().acknowledged, 0);
    assert_eq!(pending_total(&queue).await, 1);
    let state = queue
        .invocation_state::<serde_json::Value>(&published.id)
        .await
        .unwrap();
    assert_eq!(state, tito::queue::InvocationState::Pending { attempt: 1 });
    // The attempt replayed after the fence found the lease lost before calling the handler
    // again: one call, not two.
    assert_eq!(started.load(Ordering::SeqCst), 1);
}
