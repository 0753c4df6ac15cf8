//! The queue's features where they meet: priorities with a backlog and with limits, cancels
//! against the limits' gate, failure policies and the handler's own errors, limits changed
//! while work waits or runs, long keys under per-key limits, owner erasure in a caller's
//! transaction that fails part way. Each case pins a promise of `docs/guarantees.md`. Written
//! once, run on every backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::queue::{FailurePolicy, Limits, Rate, run_transactional_worker, run_worker};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, QueueHandlerResult, QueueOwner,
    TitoEngine, TitoError, TitoTransaction,
};
use tokio::sync::watch;

use crate::queue::{Job, Running, drained, fast, start};
use crate::support::{Ctx, now, pending_total, queue, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! queue_composed_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            queue_composed,
            [
                a_handlers_own_not_found_counts_as_a_failed_attempt,
                a_transactional_handlers_own_not_found_counts_as_a_failed_attempt,
                a_high_priority_published_into_a_backlog_runs_at_the_next_pull,
                an_urgent_row_in_a_second_the_pass_served_runs_at_the_next_pull,
                priorities_hold_under_queue_and_key_concurrency_limits,
                priorities_order_due_times_near_the_epoch,
                a_cancel_committed_during_the_gate_is_never_started,
                lifting_a_rate_limit_releases_the_rows_it_moved,
                raising_a_rate_limit_brings_moved_rows_back,
                a_concurrency_limit_set_while_handlers_run_counts_them,
                a_long_business_key_under_key_limits_runs_and_holds_up_nothing,
                a_pending_key_near_the_key_limit_can_be_set_aside,
                an_owner_erasure_that_fails_part_way_leaves_nothing_half_done,
                a_reschedule_replacement_keeps_its_priority,
                slot_reads_shrink_when_a_limit_is_lowered_or_lifted,
                a_high_priority_takes_its_keys_next_slot_behind_a_long_wait,
                cancel_owner_gets_through_a_busy_worker,
                a_cancelled_invocation_is_never_first_called_after_the_cancel_returned,
                a_refused_partition_count_is_what_the_sets_shutdown_returns,
                an_outcome_window_holds_its_limit_slot_and_reports_nothing_before_its_commit,
                a_cancel_or_a_pause_inside_an_outcome_window_is_never_overtaken,
                failure_policies_and_advance_commit_through_an_outcome_window,
                a_crash_inside_an_outcome_window_runs_the_handler_again_and_completes_once,
            ]
        );
    };
}

/// The order handlers started in (payload numbers).
type Order = Arc<Mutex<Vec<u32>>>;

/// A handler that records the start order, runs `ms` milliseconds and acknowledges.
fn ordered(
    ms: u64,
) -> (
    Order,
    impl Fn(QueueEvent<Job>) -> futures::future::BoxFuture<'static, QueueHandlerResult<Job>>
    + Send
    + Sync
    + 'static,
) {
    let order: Order = Arc::default();
    let log = order.clone();
    let handler = move |event: QueueEvent<Job>| {
        log.lock().unwrap().push(event.payload.n);
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
        .boxed()
    };
    (order, handler)
}

/// Waits until at least `n` handlers started.
async fn wait_starts(order: &Order, n: usize, bound: Duration) {
    let seen = order.clone();
    wait_for(&format!("{n} starts"), bound, move || {
        let started = seen.lock().unwrap().len();
        async move { started >= n }
    })
    .await;
}

/// Waits until the handler of job `job` started.
async fn wait_started(order: &Order, job: u32, bound: Duration) {
    let seen = order.clone();
    wait_for(&format!("job {job} to start"), bound, move || {
        let started = seen.lock().unwrap().contains(&job);
        async move { started }
    })
    .await;
}

/// Promise Q-FAIL-2: an error a handler returns is a failed attempt, whatever its kind.
pub async fn a_handlers_own_not_found_counts_as_a_failed_attempt<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let log = attempts.clone();
    let policy = FailurePolicy::new(2).backoff(Duration::from_millis(1), Duration::from_millis(1));
    let worker = start(
        &queue,
        fast(0..1).failure_policy(policy),
        move |event: QueueEvent<Job>| {
            log.lock().unwrap().push(event.attempt);
            // The classic poison message: the row it names was deleted.
            async move { Err(TitoError::NotFound("posting 7 is gone".into())) }
        },
    );
    let q = queue.clone();
    wait_for(
        "the invocation to die",
        Duration::from_secs(20),
        move || {
            let q = q.clone();
            async move { q.dead(None, 10).await.unwrap().len() == 1 }
        },
    )
    .await;
    worker.stop().await;
    assert_eq!(*attempts.lock().unwrap(), vec![1, 2]);
    let dead = queue.dead(None, 10).await.unwrap();
    assert_eq!(dead[0].attempts, 2);
    assert!(dead[0].error.contains("posting 7 is gone"), "{dead:?}");
}

/// Promise Q-FAIL-2, for handlers that run inside the outcome's transaction.
pub async fn a_transactional_handlers_own_not_found_counts_as_a_failed_attempt<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let count = calls.clone();
    let policy = FailurePolicy::new(2).backoff(Duration::from_millis(1), Duration::from_millis(1));
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_transactional_worker(
        queue.clone(),
        fast(0..1).failure_policy(policy),
        move |_event: QueueEvent<Job>, tx: E::Transaction| {
            count.fetch_add(1, Ordering::SeqCst);
            async move {
                let missing = tx.get(&b"no-such-row"[..]).await?;
                match missing {
                    Some(_) => Ok(QueueHandlerOutcome::Acknowledge),
                    None => Err(TitoError::NotFound("row no-such-row".into())),
                }
            }
        },
        rx,
    ));
    let q = queue.clone();
    wait_for(
        "the invocation to die",
        Duration::from_secs(20),
        move || {
            let q = q.clone();
            async move { q.dead(None, 10).await.unwrap().len() == 1 }
        },
    )
    .await;
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "two attempts, then dead");
}

/// Publishes a backlog of urgency-0 rows (row `n` due at `dues[n]`) into a one-partition
/// queue, starts one handler of `handler_ms` per row, and once three rows started publishes
/// row 900 of urgency 9 due at `due`; drains the queue. Returns the order rows started in, how
/// many had started when the urgent publication returned, and where the urgent row started.
async fn urgent_into_backlog<E: TitoEngine>(
    db: &E,
    dues: &[i64],
    due: i64,
    handler_ms: u64,
) -> (Vec<u32>, usize, usize) {
    let queue = queue(db, 1);
    for (n, at) in (0u32..).zip(dues) {
        queue
            .publish(QueueEvent::new("k", Job { n }, *at))
            .await
            .unwrap();
    }
    let (order, handler) = ordered(handler_ms);
    let worker = start(&queue, fast(0..1).concurrency(1), handler);
    wait_starts(&order, 3, Duration::from_secs(20)).await;
    queue
        .publish(QueueEvent::new("k", Job { n: 900 }, due).with_urgency(9))
        .await
        .unwrap();
    let started_before = order.lock().unwrap().len();
    drained(&queue, dues.len() + 1).await;
    worker.stop().await;
    let order = order.lock().unwrap().clone();
    let at = order.iter().position(|n| *n == 900).unwrap();
    (order, started_before, at)
}

/// Promise Q-PRIO-2: a higher priority published while a backlog runs is seen at the next pull.
pub async fn a_high_priority_published_into_a_backlog_runs_at_the_next_pull<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let t = now();
    let (order, started_before, at) = urgent_into_backlog(&ctx.db, &[t; 30], t, 20).await;
    // The one running when it was published finishes; a pull already reading when the
    // publish committed may start one more row; the start after is the priority.
    assert!(
        at <= started_before + 1,
        "published after {started_before} starts, ran {}th: {order:?}",
        at + 1
    );
}

/// Promises Q-PRIO-7 and Q-PRIO-10 together (round-six defect 5): an urgent row whose ordering
/// second is one the pass already served (its due time less its urgency's boost falls on the
/// backlog's) still runs at the next pull: the fairness rule holds back only rows of no higher
/// urgency than what the pass served there.
pub async fn an_urgent_row_in_a_second_the_pass_served_runs_at_the_next_pull<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let t = now();
    let boost = 9 * tito::queue::URGENCY_STEP.as_secs() as i64;
    // Thirty rows in the urgent row's ordering second, thirty in the seconds after it.
    let dues: Vec<i64> = (0..60)
        .map(|n| t - boost + if n < 30 { 0 } else { n - 29 })
        .collect();
    let (order, started_before, at) = urgent_into_backlog(&ctx.db, &dues, t, 10).await;
    // Its ordering time equals the first thirty rows' (its urgency's boost is their lateness):
    // it runs after them (first in, first out among equals) and before every row of a later
    // second, but for one a pull already reading may have started.
    // (Rows of later seconds started before the publication returned are the machine's
    // speed, not the order: only those started after it count.)
    let later_before = order[started_before.min(at)..at]
        .iter()
        .filter(|n| **n >= 30)
        .count();
    assert!(
        later_before <= 1,
        "published after {started_before} starts, ran {}th of 61: {order:?}",
        at + 1
    );
    // Among equals, the backlog kept its order.
    let rest: Vec<u32> = order.iter().copied().filter(|n| *n != 900).collect();
    assert_eq!(rest, (0..60).collect::<Vec<u32>>());
}

/// Promise Q-PRIO-3: priorities and FIFO among equals hold under queue-wide plus per-key
/// concurrency limits.
pub async fn priorities_hold_under_queue_and_key_concurrency_limits<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let t = now();
    for n in 1..=4 {
        queue
            .publish(QueueEvent::new("user-1", Job { n }, t))
            .await
            .unwrap();
    }
    for n in [101, 102] {
        queue
            .publish(QueueEvent::new("user-1", Job { n }, t).with_urgency(9))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().concurrency(4).key_concurrency(1))
        .await
        .unwrap();
    let (order, handler) = ordered(30);
    let worker = start(&queue, fast(0..1).concurrency(4), handler);
    drained(&queue, 6).await;
    worker.stop().await;
    assert_eq!(*order.lock().unwrap(), vec![101, 102, 1, 2, 3, 4]);
}

/// Promise Q-PRIO-4: priorities order rows whatever their due time, also due times near the
/// Unix epoch (a "due long ago" timestamp such as 0).
pub async fn priorities_order_due_times_near_the_epoch<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    let plan = [(1, 0, 0), (2, 9, 0), (3, 0, 100), (4, 9, 200), (5, 5, 0)];
    for (n, priority, due) in plan {
        queue
            .publish(QueueEvent::new("k", Job { n }, due).with_urgency(priority))
            .await
            .unwrap();
    }
    let (order, handler) = ordered(0);
    let worker = start(&queue, fast(0..1).concurrency(1).page_size(1), handler);
    drained(&queue, 5).await;
    worker.stop().await;
    assert_eq!(*order.lock().unwrap(), vec![2, 4, 5, 1, 3]);
}

/// Promise Q-CANCEL-3: a cancel that commits while the limits' gate decides is never started.
pub async fn a_cancel_committed_during_the_gate_is_never_started<E: TitoEngine>(ctx: Ctx<E>) {
    let db = FaultyEngine::new(ctx.db.clone());
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)),
    ));
    let doomed = QueueEvent::new("a", Job { n: 1 }, now());
    let doomed_id = doomed.id.clone();
    queue.publish(doomed).await.unwrap();
    queue
        .publish(QueueEvent::new("b", Job { n: 2 }, now()))
        .await
        .unwrap();
    queue
        .set_limits(Limits::none().concurrency(8))
        .await
        .unwrap();
    // The gate's commit (it writes the slots) waits, long enough to cancel meanwhile.
    db.faults().add(
        FaultRule::new(
            FaultPoint::Commit,
            Fault::Delay(Duration::from_millis(1500)),
        )
        .when_key_starts_with(b"queue:running:".to_vec()),
    );
    let (order, handler) = ordered(0);
    let worker = start(&queue, fast(0..1), handler);
    let faults = db.clone();
    wait_for("the gate to commit", Duration::from_secs(20), move || {
        let injected = faults.faults().injected();
        async move { injected >= 1 }
    })
    .await;
    assert!(queue.cancel(&doomed_id, "no longer wanted").await.unwrap());
    wait_started(&order, 2, Duration::from_secs(20)).await;
    drained(&queue, 2).await;
    worker.stop().await;
    assert_eq!(
        *order.lock().unwrap(),
        vec![2],
        "the cancelled one never started"
    );
}

async fn publish_three_and_let_a_rate_move_them<E: TitoEngine>(
    queue: &Arc<Queue<E>>,
) -> (Order, Running) {
    for n in 1..=4 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().rate(Rate::new(1, Duration::from_secs(3600))))
        .await
        .unwrap();
    let (order, handler) = ordered(0);
    let worker = start(queue, fast(0..1), handler);
    let q = queue.clone();
    wait_for(
        "one start and three moves",
        Duration::from_secs(20),
        move || {
            let q = q.clone();
            async move { q.stats().rate_limited >= 3 && q.completed_count().await.unwrap() == 1 }
        },
    )
    .await;
    (order, worker)
}

/// Promise Q-LIMIT-6: what a rate limit moved follows the limit when it is lifted.
pub async fn lifting_a_rate_limit_releases_the_rows_it_moved<E: TitoEngine>(ctx: Ctx<E>) {
    the_moved_rows_run_under(&ctx.db, Limits::none()).await;
}

/// Promise Q-LIMIT-6: what a rate limit moved follows the limit when it is raised.
pub async fn raising_a_rate_limit_brings_moved_rows_back<E: TitoEngine>(ctx: Ctx<E>) {
    let raised = Limits::none().rate(Rate::new(100, Duration::from_secs(1)));
    the_moved_rows_run_under(&ctx.db, raised).await;
}

/// Four invocations under one start an hour (one runs, three are moved up to three hours
/// ahead), then `limits`: all four run within 5 s.
async fn the_moved_rows_run_under<E: TitoEngine>(db: &E, limits: Limits) {
    let queue = queue(db, 1);
    let (order, worker) = publish_three_and_let_a_rate_move_them(&queue).await;
    queue.set_limits(limits).await.unwrap();
    let q = queue.clone();
    wait_for("the moved rows to run", Duration::from_secs(5), move || {
        let q = q.clone();
        async move { q.completed_count().await.unwrap() == 4 }
    })
    .await;
    worker.stop().await;
    assert_eq!(order.lock().unwrap().len(), 4);
}

/// Promise Q-LIMIT-7: a concurrency limit set while handlers run counts them once workers have
/// read it: nothing more starts until they finish.
pub async fn a_concurrency_limit_set_while_handlers_run_counts_them<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    for n in 1..=4 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let (r, m, gate, s) = (
        running.clone(),
        most.clone(),
        release.clone(),
        started.clone(),
    );
    let worker = start(&queue, fast(0..1).concurrency(16), move |_event| {
        let (r, m, gate, s) = (r.clone(), m.clone(), gate.clone(), s.clone());
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            let now_running = r.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now_running, Ordering::SeqCst);
            gate.acquire().await.unwrap().forget();
            r.fetch_sub(1, Ordering::SeqCst);
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    let r = running.clone();
    wait_for(
        "four handlers running",
        Duration::from_secs(20),
        move || {
            let n = r.load(Ordering::SeqCst);
            async move { n == 4 }
        },
    )
    .await;
    queue
        .set_limits(Limits::none().concurrency(2))
        .await
        .unwrap();
    let q = queue.clone();
    wait_for(
        "the running handlers to be counted",
        Duration::from_secs(10),
        move || {
            let q = q.clone();
            async move { q.limit_usage().await.unwrap().running >= 4 }
        },
    )
    .await;
    for n in 5..=6 {
        queue
            .publish(QueueEvent::new(format!("k{n}"), Job { n }, now()))
            .await
            .unwrap();
    }
    // Several pulls' worth: nothing more may start while four run under a limit of two.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        started.load(Ordering::SeqCst),
        4,
        "nothing started over the limit"
    );
    release.add_permits(100);
    drained(&queue, 6).await;
    worker.stop().await;
    assert_eq!(most.load(Ordering::SeqCst), 4);
}

/// Promise Q-KEYS-1: every key derived from an accepted publication fits the key limit, and a
/// row that cannot be started holds up no other.
pub async fn a_long_business_key_under_key_limits_runs_and_holds_up_nothing<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    let long = "k".repeat(5000);
    queue
        .publish(QueueEvent::new(long.clone(), Job { n: 1 }, now()))
        .await
        .unwrap();
    queue
        .publish(QueueEvent::new("short", Job { n: 2 }, now()))
        .await
        .unwrap();
    queue
        .set_limits(
            Limits::none()
                .key_concurrency(1)
                .key_rate(Rate::new(10, Duration::from_secs(1))),
        )
        .await
        .unwrap();
    let (order, handler) = ordered(0);
    let worker = start(&queue, fast(0..1), handler);
    drained(&queue, 2).await;
    worker.stop().await;
    let mut order = order.lock().unwrap().clone();
    order.sort();
    assert_eq!(order, vec![1, 2]);
}

/// Promise Q-KEYS-1: a pending row whose key is within a few bytes of the key limit can be set
/// aside (and noted as undecodable) like any other.
pub async fn a_pending_key_near_the_key_limit_can_be_set_aside<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    // `queue:pending:0000:{due:020}:{version:020}:` is 61 bytes: the key is 2 bytes short of
    // the limit.
    let id = "i".repeat(tito::engine::MAX_KEY_BYTES - 61 - 2);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()).with_id(id.clone()))
        .await
        .unwrap();
    // A worker of another type notes it as undecodable.
    let (stop, rx) = watch::channel(false);
    let other = tokio::spawn(run_worker(
        queue.clone(),
        fast(0..1),
        |_event: QueueEvent<String>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    let q = queue.clone();
    wait_for("the row to be noted", Duration::from_secs(20), move || {
        let q = q.clone();
        async move { q.stats().malformed >= 1 }
    })
    .await;
    stop.send(true).unwrap();
    other.await.unwrap().unwrap();
    let page = tito::inspect::queue_scan(
        queue.engine(),
        None,
        tito::inspect::QueueState::Pending(0),
        None,
        10,
    )
    .await
    .unwrap();
    let row = &page.items[0];
    assert_eq!(row.key.len(), tito::engine::MAX_KEY_BYTES - 2);
    assert!(row.undecodable.is_some(), "the note is kept: {row:?}");
    assert!(queue.set_aside(&row.key, "wrong type").await.unwrap());
    assert_eq!(pending_total(&queue).await, 0);
    let aside = tito::inspect::queue_aside(queue.engine(), None, None, 10)
        .await
        .unwrap();
    assert_eq!(aside.items.len(), 1);
}

/// Promise T-PLAN-1: an owner erasure that fails part way in a caller's transaction leaves
/// nothing half done: the transaction refuses to commit.
pub async fn an_owner_erasure_that_fails_part_way_leaves_nothing_half_done<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let db = FaultyEngine::new(ctx.db.clone());
    let queue = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(1, Duration::from_secs(3600)),
    ));
    let owner = QueueOwner::new("user", "42");
    let event = QueueEvent::new("k", Job { n: 1 }, now() + 3600).with_owner(owner.clone());
    let id = event.id.clone();
    queue.publish(event).await.unwrap();
    // The second delete fails.
    db.faults()
        .add(FaultRule::new(FaultPoint::Delete, Fault::Storage).skip(1));
    let tx = db.begin().await.unwrap();
    let erased = queue
        .delete_by_owner_matching_in_tx::<Job, _>(&owner, |_| true, &tx)
        .await;
    assert!(erased.is_err(), "{erased:?}");
    let committed = tx.commit().await;
    assert!(
        committed.is_err(),
        "a transaction with a failed erasure commits: {committed:?}"
    );
    db.faults().clear();
    assert_eq!(pending_total(&queue).await, 1, "the row is still pending");
    let again = queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()).with_id(id))
        .await
        .unwrap();
    assert!(again.duplicate, "the id still names its live invocation");
    // Erased for real now: everything goes together.
    let tx = db.begin().await.unwrap();
    let erased = queue
        .delete_by_owner_matching_in_tx::<Job, _>(&owner, |_| true, &tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(erased, 1);
    assert_eq!(pending_total(&queue).await, 0);
}

/// Promise Q-PRIO-5: a `Reschedule` replacement keeps the invocation's priority, however it was
/// built.
pub async fn a_reschedule_replacement_keeps_its_priority<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()).with_urgency(7))
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let worker = start(&queue, fast(0..1), move |event: QueueEvent<Job>| {
        let first = {
            let mut seen = log.lock().unwrap();
            seen.push(event.urgency);
            seen.len() == 1
        };
        async move {
            if first {
                // Built from scratch, not with `rescheduled`: the priority is not repeated.
                let again = QueueEvent::new(event.key.clone(), event.payload.clone(), now())
                    .with_id(event.id.clone());
                Ok(QueueHandlerOutcome::Reschedule(again))
            } else {
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    });
    drained(&queue, 2).await;
    worker.stop().await;
    assert_eq!(*seen.lock().unwrap(), vec![7, 7]);
}

/// The stored limits record (raw JSON).
async fn limits_record<E: TitoEngine>(db: &E) -> serde_json::Value {
    let bytes = crate::support::read(db, b"queue:limits").await.unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// Promise Q-LIMIT-8: a lowered or lifted concurrency limit stops counting (and reading) the
/// slots above it once nobody holds them.
pub async fn slot_reads_shrink_when_a_limit_is_lowered_or_lifted<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    queue
        .set_limits(Limits::none().concurrency(1024).key_concurrency(1024))
        .await
        .unwrap();
    queue
        .set_limits(Limits::none().concurrency(2).key_concurrency(1))
        .await
        .unwrap();
    let record = limits_record(&ctx.db).await;
    assert_eq!(record["queue_slots_seen"], 2, "{record}");
    assert_eq!(record["key_slots_seen"], 1, "{record}");
    queue
        .set_limits(Limits::none().key_concurrency(1024))
        .await
        .unwrap();
    queue.set_limits(Limits::none()).await.unwrap();
    queue
        .set_limits(Limits::none().key_concurrency(3))
        .await
        .unwrap();
    let record = limits_record(&ctx.db).await;
    assert_eq!(record["key_slots_seen"], 3, "{record}");
    // The limit still works after it shrank.
    let (order, handler) = ordered(0);
    let worker = start(&queue, fast(0..1), handler);
    drained(&queue, 1).await;
    worker.stop().await;
    assert_eq!(*order.lock().unwrap(), vec![1]);
}

/// Promise Q-PRIO-8: a priority-9 row of a key whose backlog waits for its one slot takes the
/// key's next slot, though the worker may run more handlers than the key's limit.
pub async fn a_high_priority_takes_its_keys_next_slot_behind_a_long_wait<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    let t = now();
    for n in 0..150 {
        queue
            .publish(QueueEvent::new("k0", Job { n }, t))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().key_concurrency(1))
        .await
        .unwrap();
    let (order, handler) = ordered(5);
    let worker = start(&queue, fast(0..1).concurrency(4), handler);
    wait_starts(&order, 20, Duration::from_secs(30)).await;
    queue
        .publish(QueueEvent::new("k0", Job { n: 900 }, t).with_urgency(9))
        .await
        .unwrap();
    let started_before = order.lock().unwrap().len();
    wait_started(&order, 900, Duration::from_secs(30)).await;
    worker.stop().await;
    let order = order.lock().unwrap().clone();
    let at = order.iter().position(|n| *n == 900).unwrap();
    // The one running when it was published, perhaps one admitted meanwhile, then it.
    assert!(
        at <= started_before + 2,
        "published after {started_before} starts, ran {}th",
        at + 1
    );
    // And the rest of the key in order.
    let rest: Vec<u32> = order.iter().copied().filter(|n| *n != 900).collect();
    let mut sorted = rest.clone();
    sorted.sort();
    assert_eq!(rest, sorted, "FIFO within the key");
}

/// Promise Q-CANCEL-5: `cancel_owner` cancels an owner's pending work while a worker is busy
/// with it (with and without limits): it never loses every race to the worker's commits.
pub async fn cancel_owner_gets_through_a_busy_worker<E: TitoEngine>(ctx: Ctx<E>) {
    for limited in [false, true] {
        let queue = Arc::new(Queue::new(
            ctx.db.clone(),
            QueueConfig::new(4, Duration::from_secs(3600)).topic(format!("owners{limited}")),
        ));
        let owner = QueueOwner::new("account", "7");
        for n in 0..200 {
            queue
                .publish(
                    QueueEvent::new(format!("k{}", n % 7), Job { n }, now())
                        .with_owner(owner.clone()),
                )
                .await
                .unwrap();
        }
        if limited {
            queue
                .set_limits(Limits::none().concurrency(2).key_concurrency(1))
                .await
                .unwrap();
        }
        let (order, handler) = ordered(20);
        let worker = start(&queue, fast(0..4), handler);
        wait_starts(&order, 10, Duration::from_secs(30)).await;
        let cancelled = queue.cancel_owner(&owner, "account closed").await.unwrap();
        let started_at_cancel = order.lock().unwrap().len();
        drained(&queue, 200).await;
        worker.stop().await;
        let started = order.lock().unwrap().len();
        // Everything not started (or running) when the cancel returned was cancelled.
        assert!(
            cancelled + started >= 200 && cancelled + started_at_cancel + 20 >= 200,
            "limited {limited}: cancelled {cancelled}, {started_at_cancel} started at the \
             cancel, {started} in all"
        );
    }
}

/// A cancel that returned `true` is never followed by the first call of the invocation's handler
/// in this process, under a queue-wide concurrency limit: invocations are cancelled while a
/// worker starts them, and each handler's first line looks for its id among the cancels that
/// already returned.
pub async fn a_cancelled_invocation_is_never_first_called_after_the_cancel_returned<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    const JOBS: u32 = 300;
    let queue = Arc::new(Queue::new(
        ctx.db.clone(),
        QueueConfig::new(2, Duration::from_secs(3600)),
    ));
    let mut ids = Vec::new();
    for n in 0..JOBS {
        let event = QueueEvent::new(format!("k{n}"), Job { n }, now());
        ids.push(event.id.clone());
        queue.publish(event).await.unwrap();
    }
    queue
        .set_limits(Limits::none().concurrency(4))
        .await
        .unwrap();
    let returned: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let (late, started) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (seen, late_starts, starts) = (returned.clone(), late.clone(), started.clone());
    let worker = start(&queue, fast(0..2), move |event: QueueEvent<Job>| {
        if seen.lock().unwrap().contains(&event.id) {
            late_starts.fetch_add(1, Ordering::SeqCst);
        }
        starts.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    // Every other invocation, cancelled while the worker runs.
    let mut cancelled = 0;
    for id in ids.iter().step_by(2) {
        if queue.cancel(id, "racing the worker").await.unwrap() {
            returned.lock().unwrap().insert(id.clone());
            cancelled += 1;
        }
    }
    let q = queue.clone();
    wait_for(
        "every invocation settled",
        Duration::from_secs(120),
        move || {
            let q = q.clone();
            async move { pending_total(&q).await == 0 }
        },
    )
    .await;
    worker.stop().await;
    assert!(cancelled > 0, "no cancel found its invocation pending");
    assert_eq!(
        late.load(Ordering::SeqCst),
        0,
        "{} of {cancelled} cancelled invocations were first called after their cancel returned",
        late.load(Ordering::SeqCst)
    );
    assert!(started.load(Ordering::SeqCst) as u32 >= JOBS - cancelled);
}

/// A worker of a handle configured with another partition count than the stored queue's ends
/// with the refusal, and the set's shutdown returns it: after the worker ran a while, and when
/// the shutdown comes before the worker's task first ran.
pub async fn a_refused_partition_count_is_what_the_sets_shutdown_returns<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let stored = queue(&ctx.db, 2);
    stored
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    for shut_at_once in [false, true] {
        let other = Arc::new(Queue::new(
            ctx.db.clone(),
            QueueConfig::new(4, Duration::from_secs(3600)),
        ));
        let mut workers = tito::Workers::new();
        workers.spawn_worker(
            other,
            tito::WorkerConfig::new(0..4),
            |_event: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        );
        if !shut_at_once {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let err = workers.shutdown().await.unwrap_err();
        assert!(
            matches!(&err, TitoError::InvalidArgument(m) if m.contains("partitions")),
            "shut down at once: {shut_at_once}: {err:?}"
        );
    }
}

/// Start and end of each handler run (payload number).
type Spans = Arc<Mutex<Vec<(u32, tokio::time::Instant, tokio::time::Instant)>>>;

pub async fn an_outcome_window_holds_its_limit_slot_and_reports_nothing_before_its_commit<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    for n in 0..2 {
        queue
            .publish(QueueEvent::new("serial", Job { n }, now()))
            .await
            .unwrap();
    }
    queue
        .set_limits(Limits::none().key_concurrency(1))
        .await
        .unwrap();
    let spans: Spans = Arc::default();
    let log = spans.clone();
    let window = Duration::from_secs(1);
    let worker = start(
        &queue,
        fast(0..1).outcome_delay(window),
        move |event: QueueEvent<Job>| {
            let log = log.clone();
            async move {
                let at = tokio::time::Instant::now();
                log.lock().unwrap().push((event.payload.n, at, at));
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let s = spans.clone();
    wait_for("the first handler", Duration::from_secs(10), move || {
        let s = s.clone();
        async move { !s.lock().unwrap().is_empty() }
    })
    .await;
    // Inside the window: the outcome is held, so it is neither counted nor stored.
    let (first, ended, _) = spans.lock().unwrap()[0];
    if ended.elapsed() < window / 2 {
        assert_eq!(queue.stats().acknowledged, 0, "counted before its commit");
        assert_eq!(
            pending_total(&queue).await,
            2,
            "applied before the window ended"
        );
    }
    drained(&queue, 2).await;
    worker.stop().await;
    let spans = spans.lock().unwrap().clone();
    assert_eq!(spans.len(), 2, "{spans:?}");
    let (second, started, _) = spans[1];
    assert_ne!(first, second);
    // The key's one slot was held until the first outcome committed, a window after the
    // handler ended (less a timer's tick).
    assert!(
        started.duration_since(ended) >= window - Duration::from_millis(50),
        "the second run started {:?} after the first ended",
        started.duration_since(ended)
    );
}

pub async fn a_cancel_or_a_pause_inside_an_outcome_window_is_never_overtaken<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    let cancelled = QueueEvent::new("a", Job { n: 0 }, now());
    let cancelled_id = cancelled.id.clone();
    queue.publish(cancelled).await.unwrap();
    queue
        .publish(QueueEvent::new("b", Job { n: 1 }, now()))
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<u32>>> = Arc::default();
    let log = seen.clone();
    let worker = start(
        &queue,
        fast(0..1).outcome_delay(Duration::from_secs(1)),
        move |event: QueueEvent<Job>| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(event.payload.n);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    let s = seen.clone();
    wait_for("both handlers", Duration::from_secs(10), move || {
        let s = s.clone();
        async move { s.lock().unwrap().len() == 2 }
    })
    .await;
    // Both outcomes wait in the window (or committed already, when this task was slow: then
    // the cancel finds nothing pending and says so).
    let cancel_won = queue
        .cancel(&cancelled_id, "changed our mind")
        .await
        .unwrap();
    assert!(queue.pause(None, "maintenance").await.unwrap());
    // Once every worker has read the pause, publish one more: it must wait for the resume.
    tokio::time::sleep(tito::queue::PAUSE_CHECK + Duration::from_millis(100)).await;
    queue
        .publish(QueueEvent::new("c", Job { n: 2 }, now()))
        .await
        .unwrap();
    // The held outcomes commit while the queue is paused (a pause stops starts, not outcomes).
    let q = queue.clone();
    let expected = if cancel_won { 1 } else { 2 };
    wait_for("the held outcomes", Duration::from_secs(10), move || {
        let q = q.clone();
        async move { q.stats().acknowledged == expected }
    })
    .await;
    assert_eq!(queue.completed_count().await.unwrap(), 2);
    assert_eq!(pending_total(&queue).await, 1, "the paused one waits");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ran = seen.lock().unwrap().clone();
    ran.sort_unstable();
    assert_eq!(ran, vec![0, 1], "nothing ran while paused");
    assert!(queue.resume(None).await.unwrap());
    drained(&queue, 3).await;
    worker.stop().await;
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_unstable();
    assert_eq!(seen, vec![0, 1, 2], "the cancelled one never ran again");
    assert_eq!(queue.stats().acknowledged, expected + 1);
}

pub async fn failure_policies_and_advance_commit_through_an_outcome_window<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 2);
    let n = 12u32;
    let events: Vec<QueueEvent<Job>> = (0..n)
        .map(|i| QueueEvent::new(format!("k{i}"), Job { n: i }, now()))
        .collect();
    queue.publish_many(&events).await.unwrap();
    // By n % 4: 0 acknowledges; 1 fails its first attempt; 2 always fails (dead after two);
    // 3 advances to a step (n + 100) that acknowledges.
    let runs: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let log = runs.clone();
    let policy =
        FailurePolicy::new(2).backoff(Duration::from_millis(10), Duration::from_millis(10));
    let worker = start(
        &queue,
        fast(0..2)
            .outcome_delay(Duration::from_millis(200))
            .outcome_batch(4)
            .failure_policy(policy),
        move |event: QueueEvent<Job>| {
            let log = log.clone();
            async move {
                let n = event.payload.n;
                log.lock().unwrap().push((n, event.attempt));
                if n >= 100 {
                    return Ok(QueueHandlerOutcome::Acknowledge);
                }
                match n % 4 {
                    1 if event.attempt == 1 => Err(TitoError::invalid_argument("first try")),
                    2 => Err(TitoError::invalid_argument("always")),
                    3 => {
                        let due = event.timestamp;
                        Ok(QueueHandlerOutcome::Advance(
                            event.advanced(Job { n: n + 100 }, due),
                        ))
                    }
                    _ => Ok(QueueHandlerOutcome::Acknowledge),
                }
            }
        },
    );
    let dead = (0..n).filter(|i| i % 4 == 2).count();
    let q = queue.clone();
    wait_for("every invocation settled", Duration::from_secs(30), move || {
        let q = q.clone();
        async move {
            q.dead(None, 100).await.unwrap().len() == dead && pending_total(&q).await == 0
        }
    })
    .await;
    worker.stop().await;
    let mut runs = runs.lock().unwrap().clone();
    runs.sort_unstable();
    let mut expected = Vec::new();
    for i in 0..n {
        match i % 4 {
            0 => expected.push((i, 1)),
            1 | 2 => expected.extend([(i, 1), (i, 2)]),
            _ => expected.extend([(i, 1), (i + 100, 1)]),
        }
    }
    expected.sort_unstable();
    assert_eq!(runs, expected, "each attempt and step ran once");
    let stats = queue.stats();
    assert_eq!(stats.dead, dead as u64);
    assert_eq!(stats.retried, 2 * (n / 4) as u64);
}

pub async fn a_crash_inside_an_outcome_window_runs_the_handler_again_and_completes_once<
    E: TitoEngine,
>(
    ctx: Ctx<E>,
) {
    let queue = queue(&ctx.db, 1);
    queue
        .publish(QueueEvent::new("k", Job { n: 7 }, now()))
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |runs: Arc<AtomicUsize>| {
        move |_event: QueueEvent<Job>| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        }
    };
    let lease = Duration::from_millis(900);
    let crashed = start(
        &queue,
        fast(0..1)
            .lease_duration(lease)
            .outcome_delay(Duration::from_millis(300)),
        handler(runs.clone()),
    );
    let r = runs.clone();
    wait_for("the first run", Duration::from_secs(10), move || {
        let r = r.clone();
        async move { r.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // Gone inside the window, without a word: the held outcome is lost with it.
    crashed.task.abort();
    let _ = crashed.task.await;
    let outcome_committed = queue.stats().acknowledged == 1;
    let next = start(
        &queue,
        fast(0..1).lease_duration(lease),
        handler(runs.clone()),
    );
    drained(&queue, 1).await;
    next.stop().await;
    assert_eq!(queue.completed_count().await.unwrap(), 1, "completed once");
    if !outcome_committed {
        assert_eq!(runs.load(Ordering::SeqCst), 2, "the handler ran again");
    }
    assert_eq!(pending_total(&queue).await, 0);
}
