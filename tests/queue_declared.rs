//! Queues declared once (`QueueSpec`): limits and pauses at first boot, the declared failure
//! policy and periodic jobs, handler state, an event's own attempts, and the testing helpers
//! (`drain`, `settled`). Written once, run on every backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::queue::testing::{Drained, Settled, drain, drain_transactional, drain_within, settled};
use tito::queue::{FailurePolicy, Limits, PeriodicJob, QueueSpec, Schedule, Topic};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel,
    WorkerConfig, Workers,
};

use crate::support::{Ctx, pending_total, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! queue_declared_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            queue_declared,
            [
                a_declared_queue_takes_limits_and_pauses_before_any_publication,
                a_declared_queue_refuses_another_partition_count,
                workers_on_a_declared_queue_use_its_failure_policy,
                declared_periodic_jobs_publish_on_their_topic,
                a_declared_queue_refuses_two_periodic_jobs_of_one_name,
                handler_state_is_handed_to_every_invocation,
                an_events_own_attempts_override_the_workers_policy,
                drain_runs_what_is_due_and_says_what_happened,
                a_drain_keeps_to_its_time_and_cuts_off_handlers_still_running,
                drain_and_settled_take_any_duration,
                a_drain_says_what_is_paused_instead_of_waiting_for_it,
                settled_says_an_invocation_was_set_aside,
                a_model_event_queue_takes_the_stores_partition_count,
                a_declared_queue_starts_its_worker_and_schedules_in_one_call,
                start_with_overrides_the_declared_worker,
                a_transactional_drain_commits_writes_with_outcomes,
                a_drain_runs_handlers_with_the_declared_workers_timeout,
                a_replayed_transactional_handler_is_counted,
                transactional_handlers_of_one_partition_never_conflict_on_its_lease,
                a_commit_that_keeps_conflicting_is_not_a_failed_attempt,
                a_cancel_during_a_transactional_handler_does_not_call_it_again,
            ]
        );
    };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum Mail {
    Reset { user: String },
    Newsletter { issue: u32 },
    Digest,
}

const MAIL: Topic<Mail> = Topic::new("mail");

fn spec() -> QueueSpec<Mail> {
    MAIL.spec(2, Duration::from_secs(3600))
}

fn fast() -> WorkerConfig {
    WorkerConfig::new(0..2).max_idle_backoff(Duration::from_millis(20))
}

fn quick_policy(attempts: u32) -> FailurePolicy {
    FailurePolicy::new(attempts).backoff(Duration::from_millis(1), Duration::from_millis(1))
}

pub async fn a_declared_queue_takes_limits_and_pauses_before_any_publication<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let limits = Limits::none().concurrency(3).key_concurrency(1);
    let mail = spec()
        .limits(limits.clone())
        .open(ctx.db.clone())
        .await
        .unwrap();
    // Nothing was published: the declaration stored the queue, its limits, and takes a pause.
    assert_eq!(mail.limits().await.unwrap(), limits);
    assert!(mail.pause(None, "first boot").await.unwrap());
    assert!(mail.paused().await.unwrap().queue.is_some());
    assert!(mail.resume(None).await.unwrap());
    // Opening again with the same limits changes nothing; other limits replace them.
    let again = spec()
        .limits(limits.clone())
        .open(ctx.db.clone())
        .await
        .unwrap();
    assert_eq!(again.limits().await.unwrap(), limits);
    let lower = Limits::none().concurrency(1);
    let again = spec()
        .limits(lower.clone())
        .open(ctx.db.clone())
        .await
        .unwrap();
    assert_eq!(again.limits().await.unwrap(), lower);
    // A spec without limits leaves the stored ones alone (an operator may have set them).
    let plain = spec().open(ctx.db.clone()).await.unwrap();
    assert_eq!(plain.limits().await.unwrap(), lower);
    // Bad settings are refused before anything is written.
    let err = spec()
        .limits(Limits::none().concurrency(0))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let err = spec()
        .failure_policy(FailurePolicy::new(0))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
}

pub async fn a_declared_queue_refuses_another_partition_count<E: TitoEngine>(ctx: Ctx<E>) {
    spec().open(ctx.db.clone()).await.unwrap();
    let err = MAIL
        .spec(8, Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("2 partitions"), "{err}");
}

pub async fn workers_on_a_declared_queue_use_its_failure_policy<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec()
        .failure_policy(quick_policy(2))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let event = QueueEvent::now("ada", Mail::Reset { user: "ada".into() });
    let id = event.id.clone();
    mail.publish(event).await.unwrap();
    let mut workers = Workers::new();
    workers.spawn_worker(&mail, fast(), |_event: QueueEvent<Mail>| async {
        Err(TitoError::handler("smtp down"))
    });
    let outcome = settled(&mail, &id, Duration::from_secs(20)).await.unwrap();
    workers.shutdown().await.unwrap();
    assert!(
        matches!(outcome, Settled::Dead { attempts: 2, .. }),
        "{outcome:?}"
    );
}

pub async fn declared_periodic_jobs_publish_on_their_topic<E: TitoEngine>(ctx: Ctx<E>) {
    let every = Schedule::every("digest", Duration::from_secs(1)).unwrap();
    let mail = spec()
        .periodic(PeriodicJob::new(every, Mail::Digest))
        .open(ctx.db.clone())
        .await
        .unwrap();
    assert_eq!(mail.periodic_jobs().len(), 1);
    let seen = Arc::new(AtomicUsize::new(0));
    let mut workers = Workers::new();
    workers.spawn_periodic(&mail, mail.periodic_jobs());
    workers.spawn_worker_with(
        &mail,
        fast(),
        seen.clone(),
        |seen, event: QueueEvent<Mail>| async move {
            assert_eq!(event.payload, Mail::Digest);
            seen.fetch_add(1, Ordering::SeqCst);
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let count = seen.clone();
    wait_for("a digest tick to run", Duration::from_secs(20), move || {
        let n = count.load(Ordering::SeqCst);
        async move { n >= 1 }
    })
    .await;
    workers.shutdown().await.unwrap();
    // Operators see what the schedule is, its next tick and which runner wrote it.
    let views = tito::queue::schedules(&ctx.db, Some(mail.topic().name()))
        .await
        .unwrap();
    assert_eq!(views.len(), 1, "{views:?}");
    let view = &views[0];
    assert_eq!(view.name, "digest");
    assert_eq!(view.schedule.as_deref(), Some("every 1 s"));
    assert_eq!(view.next_tick, Some(view.last_tick + 1));
    let runner = format!("pid {} on ", std::process::id());
    assert!(
        view.runner
            .as_deref()
            .is_some_and(|r| r.starts_with(&runner)),
        "{view:?}"
    );
}

pub async fn a_declared_queue_refuses_two_periodic_jobs_of_one_name<E: TitoEngine>(ctx: Ctx<E>) {
    let hourly = Schedule::every("digest", Duration::from_secs(3600)).unwrap();
    let daily = Schedule::cron("digest", "0 9 * * *").unwrap();
    let twice = spec()
        .periodic(PeriodicJob::new(hourly, Mail::Digest))
        .periodic(PeriodicJob::new(daily, Mail::Newsletter { issue: 1 }));
    // Refused at open, naming the name, rather than by the runner once workers are started.
    match twice.open(ctx.db.clone()).await {
        Err(TitoError::InvalidArgument(why)) => {
            assert!(why.contains("two periodic jobs named \"digest\""), "{why}");
            assert!(why.contains("\"mail\""), "{why}");
        }
        other => panic!("two jobs of one name are refused at open: {other:?}"),
    }
    // Nothing was written: the store takes another partition count for the queue.
    let mail = MAIL
        .spec(3, Duration::from_secs(3600))
        .open(ctx.db.clone())
        .await
        .unwrap();
    assert_eq!(mail.config().partitions, 3);
    let views = tito::queue::schedules(&ctx.db, Some(MAIL.name()))
        .await
        .unwrap();
    assert!(views.is_empty(), "{views:?}");
}

pub async fn handler_state_is_handed_to_every_invocation<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    for issue in 0..5 {
        mail.publish(QueueEvent::now(
            format!("u{issue}"),
            Mail::Newsletter { issue },
        ))
        .await
        .unwrap();
    }
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut workers = Workers::new();
    workers.spawn_worker_with(
        &mail,
        fast(),
        sent.clone(),
        |sent, event: QueueEvent<Mail>| async move {
            if let Mail::Newsletter { issue } = event.payload {
                sent.lock().unwrap().push(issue);
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        },
    );
    let log = sent.clone();
    wait_for("five newsletters", Duration::from_secs(20), move || {
        let n = log.lock().unwrap().len();
        async move { n == 5 }
    })
    .await;
    workers.shutdown().await.unwrap();
    let mut sent = sent.lock().unwrap().clone();
    sent.sort();
    assert_eq!(sent, vec![0, 1, 2, 3, 4]);
}

pub async fn an_events_own_attempts_override_the_workers_policy<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    // On a worker without a policy: an event's own attempts make one (the default backoff);
    // an event without them stays pending, unchanged, as always.
    let reset = QueueEvent::now("ada", Mail::Reset { user: "ada".into() }).with_max_attempts(2);
    let letter = QueueEvent::now("bob", Mail::Newsletter { issue: 1 }).with_max_attempts(1);
    let plain = QueueEvent::now("cy", Mail::Digest);
    let ids = [reset.id.clone(), letter.id.clone(), plain.id.clone()];
    for event in [reset, letter, plain] {
        mail.publish(event).await.unwrap();
    }
    let err = mail
        .publish(QueueEvent::now("dee", Mail::Digest).with_max_attempts(0))
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    let drained = tito::queue::testing::drain_within(
        mail.clone(),
        |_event: QueueEvent<Mail>| async { Err(TitoError::handler("always fails")) },
        // The plain event stays due, so the drain runs all of it: long enough for the reset's
        // second attempt (due up to 2 s after its first) on a loaded machine.
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!((drained.dead, drained.still_due), (2, 1), "{drained:?}");
    for (id, attempts) in [(&ids[0], 2), (&ids[1], 1)] {
        let outcome = settled(&mail, id, Duration::from_secs(1)).await.unwrap();
        assert!(
            matches!(outcome, Settled::Dead { attempts: a, .. } if a == attempts),
            "{id}: {outcome:?}"
        );
    }
    // With the declared policy (three attempts) the plain one dies after three, and an event
    // of one attempt after one.
    let with_policy = spec()
        .failure_policy(quick_policy(3))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let once = QueueEvent::now("eve", Mail::Newsletter { issue: 2 }).with_max_attempts(1);
    let once_id = once.id.clone();
    with_policy.publish(once).await.unwrap();
    let drained = drain(&with_policy, |_event: QueueEvent<Mail>| async {
        Err(TitoError::handler("always fails"))
    })
    .await
    .unwrap();
    assert_eq!((drained.dead, drained.still_due), (2, 0), "{drained:?}");
    for (id, attempts) in [(&ids[2], 3), (&once_id, 1)] {
        let outcome = settled(&with_policy, id, Duration::from_secs(1))
            .await
            .unwrap();
        assert!(
            matches!(outcome, Settled::Dead { attempts: a, .. } if a == attempts),
            "{id}: {outcome:?}"
        );
    }
}

pub async fn drain_runs_what_is_due_and_says_what_happened<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    let first = QueueEvent::now("ada", Mail::Newsletter { issue: 1 });
    let first_id = first.id.clone();
    mail.publish(first).await.unwrap();
    mail.publish(QueueEvent::now("bob", Mail::Newsletter { issue: 2 }))
        .await
        .unwrap();
    let later = QueueEvent::after("cy", Mail::Digest, Duration::from_secs(3600));
    let later_id = later.id.clone();
    mail.publish(later).await.unwrap();
    // Issue 1 is rescheduled for now once (the drain runs it again), issue 2 acknowledged.
    let drained = drain(&mail, |event: QueueEvent<Mail>| async move {
        match event.payload {
            Mail::Newsletter { issue: 1 } if event.timestamp > 0 => {
                let next = event.clone().advanced(Mail::Newsletter { issue: 11 }, 0);
                Ok(QueueHandlerOutcome::Advance(next))
            }
            _ => Ok(QueueHandlerOutcome::Acknowledge),
        }
    })
    .await
    .unwrap();
    assert_eq!(
        (
            drained.delivered,
            drained.acknowledged,
            drained.rescheduled,
            drained.still_due
        ),
        (3, 2, 1, 0),
        "{drained:?}"
    );
    assert_eq!(
        pending_total(&mail).await,
        1,
        "the one due in an hour waits"
    );
    let outcome = settled(&mail, &first_id, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(outcome, Settled::Completed { cancelled: None });
    assert_eq!(
        settled(&mail, &later_id, Duration::from_millis(50))
            .await
            .unwrap(),
        Settled::Pending
    );
    assert!(mail.cancel(&later_id, "not needed").await.unwrap());
    assert_eq!(
        settled(&mail, &later_id, Duration::from_secs(1))
            .await
            .unwrap(),
        Settled::Completed {
            cancelled: Some("not needed".into())
        }
    );
    let err = settled(&mail, "no-such-id", Duration::from_millis(10))
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
}

pub async fn a_drain_keeps_to_its_time_and_cuts_off_handlers_still_running<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    // A 15 s handler in a 2 s drain: cut off when the 2 s are over, not waited for.
    let (slow_id, drained, took) = drain_a_slow_handler(&mail, 15, 2).await;
    assert!(took < Duration::from_secs(7), "a 2 s drain took {took:?}");
    assert_eq!(
        (
            drained.delivered,
            drained.cut_off,
            drained.failed,
            drained.acknowledged,
            drained.still_due
        ),
        (1, 1, 1, 0, 1),
        "{drained:?}"
    );
    // A handler that never ends is cut off too.
    let started = std::time::Instant::now();
    let drained = drain_within(
        &mail,
        |_event: QueueEvent<Mail>| std::future::pending(),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(6), "a 1 s drain took {took:?}");
    assert_eq!((drained.cut_off, drained.still_due), (1, 1), "{drained:?}");
    // The invocation stayed pending and the drains let go of their leases: the next drain
    // runs it at once.
    assert_eq!(
        settled(&mail, &slow_id, Duration::ZERO).await.unwrap(),
        Settled::Pending
    );
    let drained = drain(&mail, |_event: QueueEvent<Mail>| async {
        Ok(QueueHandlerOutcome::Acknowledge)
    })
    .await
    .unwrap();
    assert_eq!(
        (drained.acknowledged, drained.cut_off, drained.still_due),
        (1, 0, 0),
        "{drained:?}"
    );
}

pub async fn drain_and_settled_take_any_duration<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    let acknowledge = |_event: QueueEvent<Mail>| async { Ok(QueueHandlerOutcome::Acknowledge) };
    // An empty queue: nothing to wait for, whatever the bound.
    let drained = drain_within(&mail, acknowledge, Duration::MAX)
        .await
        .unwrap();
    assert_eq!(drained, Drained::default());
    let event = QueueEvent::now("ada", Mail::Digest);
    let id = event.id.clone();
    mail.publish(event).await.unwrap();
    let drained = drain_within(&mail, acknowledge, Duration::MAX)
        .await
        .unwrap();
    assert_eq!(
        (drained.acknowledged, drained.still_due),
        (1, 0),
        "{drained:?}"
    );
    assert_eq!(
        settled(&mail, &id, Duration::MAX).await.unwrap(),
        Settled::Completed { cancelled: None }
    );
    let err = settled(&mail, "no-such-id", Duration::MAX)
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
}

pub async fn a_drain_says_what_is_paused_instead_of_waiting_for_it<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    // One row in each of the two partitions.
    let keys: Vec<String> = [0, 1]
        .into_iter()
        .map(|partition| {
            (0..)
                .map(|n| format!("user{n}"))
                .find(|key| tito::queue::partition_for(key, 2) == partition)
                .unwrap()
        })
        .collect();
    for key in &keys {
        mail.publish(QueueEvent::now(key.clone(), Mail::Digest))
            .await
            .unwrap();
    }
    let acknowledge = |_event: QueueEvent<Mail>| async { Ok(QueueHandlerOutcome::Acknowledge) };
    // The whole queue paused: the drain runs nothing, says why, and does not wait its 10 s.
    mail.pause(None, "smtp maintenance").await.unwrap();
    let started = std::time::Instant::now();
    let drained = drain(&mail, acknowledge).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        (drained.delivered, drained.still_due),
        (0, 2),
        "{drained:?}"
    );
    assert_eq!(
        drained.paused.queue.map(|record| record.why).as_deref(),
        Some("smtp maintenance")
    );
    // One partition paused: the other one's row runs, the paused one's waits.
    mail.resume(None).await.unwrap();
    mail.pause(Some(1), "a poison row").await.unwrap();
    let started = std::time::Instant::now();
    let drained = drain(&mail, acknowledge).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        (drained.acknowledged, drained.still_due),
        (1, 1),
        "{drained:?}"
    );
    assert_eq!(
        drained
            .paused
            .partitions
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        [1]
    );
    assert!(drained.paused.queue.is_none(), "{drained:?}");
}

pub async fn settled_says_an_invocation_was_set_aside<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    let event = QueueEvent::now("ada", Mail::Digest);
    let id = event.id.clone();
    let published = mail.publish(event).await.unwrap();
    assert!(mail.set_aside(&published.key, "wrong type").await.unwrap());
    assert_eq!(
        settled(&mail, &id, Duration::from_secs(1)).await.unwrap(),
        Settled::SetAside {
            why: "wrong type".into()
        }
    );
    let err = settled(&mail, "no-such-id", Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
}

/// A model whose writes publish to queue `signup`.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(event = "signup")]
pub struct Signup {
    pub id: String,
    pub email: String,
}

/// A model whose writes publish to queue `invite`.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(event = "invite")]
pub struct Invite {
    pub id: String,
}

pub async fn a_model_event_queue_takes_the_stores_partition_count<E: TitoEngine>(ctx: Ctx<E>) {
    let store = ctx.db.partitions();
    let other = if store == 4 { 8 } else { 4 };
    let hour = Duration::from_secs(3600);
    assert!(Signup::SIGNUP_EVENT.receives_model_events());
    assert!(!MAIL.receives_model_events());
    // Another count is refused at open, the message leading with the fix.
    let refusals = [
        (
            Signup::SIGNUP_EVENT
                .spec(other, hour)
                .open(ctx.db.clone())
                .await
                .err(),
            "spec",
        ),
        (
            Signup::SIGNUP_EVENT
                .queue(ctx.db.clone(), QueueConfig::new(other, hour))
                .err(),
            "QueueConfig::new",
        ),
    ];
    for (refused, form) in refusals {
        match refused {
            Some(TitoError::InvalidArgument(why)) => {
                let fix = format!("declare queue \"signup\" with {form}(db.partitions(), ..)");
                assert!(why.starts_with(&fix), "{why}");
                assert!(why.contains(&format!("({store})")), "{why}");
                assert!(why.contains(&format!("not {other}")), "{why}");
            }
            other => panic!("another partition count is refused at open: {other:?}"),
        }
    }
    // Nothing was stored: writes publish, and the store's count opens the queue.
    let signups = ctx.db.clone().model::<Signup>();
    signups
        .build(Signup {
            id: "1".into(),
            email: "ada@example.com".into(),
        })
        .await
        .unwrap();
    let queue = Signup::SIGNUP_EVENT
        .spec(store, hour)
        .open(ctx.db.clone())
        .await
        .unwrap();
    assert_eq!(pending_total(&queue).await, 1);
    // A queue an untyped handle created with another count: a write's error leads with what
    // to change (the write itself chose no count).
    Queue::new(
        ctx.db.clone(),
        QueueConfig::new(other, hour).topic("invite"),
    )
    .declare()
    .await
    .unwrap();
    let err = ctx
        .db
        .clone()
        .model::<Invite>()
        .build(Invite { id: "1".into() })
        .await
        .unwrap_err();
    match err {
        TitoError::InvalidArgument(why) => {
            let fix = format!("open the store with {other} partitions");
            assert!(why.starts_with(&fix), "{why}");
            assert!(
                why.contains(&format!("({store}, db.partitions())")),
                "{why}"
            );
        }
        other => panic!("the write is refused: {other:?}"),
    }
}

pub async fn a_declared_queue_starts_its_worker_and_schedules_in_one_call<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // Declared: three partitions, a failure policy, a periodic digest, and how its workers
    // run. `start` runs all of it: every partition is served, the digest ticks, and a failing
    // event dies after the declared attempts.
    let every = Schedule::every("digest", Duration::from_secs(1)).unwrap();
    let mail = MAIL
        .spec(3, Duration::from_secs(3600))
        .failure_policy(quick_policy(2))
        .periodic(PeriodicJob::new(every, Mail::Digest))
        .worker(
            WorkerConfig::new(0..3)
                .concurrency(2)
                .max_idle_backoff(Duration::from_millis(20)),
        )
        .open(ctx.db.clone())
        .await
        .unwrap();
    let keys: Vec<String> = (0..30).map(|n| format!("user{n}")).collect();
    let partitions: std::collections::BTreeSet<u32> = keys
        .iter()
        .map(|k| tito::queue::partition_for(k, 3))
        .collect();
    assert_eq!(partitions.len(), 3);
    for key in &keys {
        mail.publish(QueueEvent::now(key, Mail::Reset { user: key.clone() }))
            .await
            .unwrap();
    }
    let doomed = QueueEvent::now("bad", Mail::Newsletter { issue: 0 });
    let doomed_id = doomed.id.clone();
    mail.publish(doomed).await.unwrap();
    let (resets, digests) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, d) = (resets.clone(), digests.clone());
    let mut workers = Workers::new();
    workers.start(&mail, move |event: QueueEvent<Mail>| {
        let (r, d) = (r.clone(), d.clone());
        async move {
            match event.payload {
                Mail::Reset { .. } => r.fetch_add(1, Ordering::SeqCst),
                Mail::Digest => d.fetch_add(1, Ordering::SeqCst),
                Mail::Newsletter { .. } => return Err(TitoError::handler("no such issue")),
            };
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    assert_eq!(workers.len(), 2, "a worker and the periodic runner");
    let (r, d) = (resets.clone(), digests.clone());
    wait_for(
        "every reset and a digest",
        Duration::from_secs(30),
        move || {
            let done = r.load(Ordering::SeqCst) == 30 && d.load(Ordering::SeqCst) >= 1;
            async move { done }
        },
    )
    .await;
    let outcome = settled(&mail, &doomed_id, Duration::from_secs(20))
        .await
        .unwrap();
    workers.shutdown().await.unwrap();
    assert!(
        matches!(outcome, Settled::Dead { attempts: 2, .. }),
        "{outcome:?}"
    );
    // A declared worker config the queue cannot run is refused at open.
    let err = MAIL
        .spec(3, Duration::from_secs(3600))
        .worker(WorkerConfig::new(3..5))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err:?}");
    // So is one that reaches past the queue's partitions (a count changed in one place only).
    let err = MAIL
        .spec(3, Duration::from_secs(3600))
        .worker(WorkerConfig::new(0..8))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("runs partitions 0..8, but the queue has partitions 0..3"),
        "{err}"
    );
    // A fixed worker id in the declaration would be every process's: refused.
    let err = MAIL
        .spec(3, Duration::from_secs(3600))
        .worker(WorkerConfig::new(0..3).worker_id("web"))
        .open(ctx.db.clone())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("leave worker_id unset"), "{err}");
}

pub async fn start_with_overrides_the_declared_worker<E: TitoEngine>(ctx: Ctx<E>) {
    // No periodic job declared: `start_with` runs the worker alone, on the partitions given.
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    let first = "k-first".to_string();
    let p1 = tito::queue::partition_for(&first, 2);
    let second = (0..)
        .map(|n| format!("k-{n}"))
        .find(|k| tito::queue::partition_for(k, 2) != p1)
        .unwrap();
    let (first, second) = (first.as_str(), second.as_str());
    for key in [first, second] {
        mail.publish(QueueEvent::now(key, Mail::Digest))
            .await
            .unwrap();
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let mut workers = Workers::new();
    workers.start_with(
        &mail,
        WorkerConfig::new(p1..p1 + 1).max_idle_backoff(Duration::from_millis(20)),
        move |event: QueueEvent<Mail>| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(event.key);
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    assert_eq!(workers.len(), 1);
    let watch = seen.clone();
    wait_for(
        "the first partition's event",
        Duration::from_secs(20),
        move || {
            let done = !watch.lock().unwrap().is_empty();
            async move { done }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    workers.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap().clone(), vec![first.to_string()]);
    assert_eq!(pending_total(mail.queue()).await, 1);
}

pub async fn a_transactional_drain_commits_writes_with_outcomes<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::TitoTransaction;
    let mail = spec()
        .failure_policy(quick_policy(2))
        .open(ctx.db.clone())
        .await
        .unwrap();
    for issue in 1..=4 {
        mail.publish(QueueEvent::now(
            format!("k{issue}"),
            Mail::Newsletter { issue },
        ))
        .await
        .unwrap();
    }
    let prefix = String::from_utf8(ctx.key("")).unwrap();
    let marker = {
        let prefix = prefix.clone();
        move |issue: u32| format!("{prefix}sent:{issue}")
    };
    // Issue 4 writes its marker and then fails: its write rolls back with the attempt.
    let drained = drain_transactional(&mail, move |event: QueueEvent<Mail>, tx| {
        let prefix = prefix.clone();
        async move {
            let Mail::Newsletter { issue } = event.payload else {
                return Ok(QueueHandlerOutcome::Acknowledge);
            };
            tx.put(format!("{prefix}sent:{issue}").into_bytes(), b"1".to_vec())
                .await?;
            if issue == 4 {
                return Err(TitoError::handler("bounced"));
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(
        (drained.acknowledged, drained.dead, drained.still_due),
        (3, 1, 0),
        "{drained:?}"
    );
    for issue in 1..=3 {
        assert!(
            crate::support::read(&ctx.db, marker(issue).as_bytes())
                .await
                .is_some()
        );
    }
    assert!(
        crate::support::read(&ctx.db, marker(4).as_bytes())
            .await
            .is_none()
    );
}

/// Publishes one event to `mail` and drains it for `within_s` seconds with a handler that
/// sleeps `sleeps_s` seconds; returns the event's id, the drain's answer and how long it took.
async fn drain_a_slow_handler<E: TitoEngine>(
    mail: &tito::queue::TopicQueue<E, Mail>,
    sleeps_s: u64,
    within_s: u64,
) -> (String, Drained, Duration) {
    let slow = QueueEvent::now("ada", Mail::Digest);
    let slow_id = slow.id.clone();
    mail.publish(slow).await.unwrap();
    let started = std::time::Instant::now();
    let drained = drain_within(
        mail,
        move |_event: QueueEvent<Mail>| async move {
            tokio::time::sleep(Duration::from_secs(sleeps_s)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        },
        Duration::from_secs(within_s),
    )
    .await
    .unwrap();
    (slow_id, drained, started.elapsed())
}

/// Round-six defect 9: a drain runs its handlers with the declared worker's settings, its
/// handler timeout above all (a handler over it is a failed attempt, as under `Workers::start`).
pub async fn a_drain_runs_handlers_with_the_declared_workers_timeout<E: TitoEngine>(ctx: Ctx<E>) {
    let mail = spec()
        .failure_policy(quick_policy(1))
        .worker(WorkerConfig::new(0..2).handler_timeout(Duration::from_millis(100)))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let (slow_id, drained, took) = drain_a_slow_handler(&mail, 30, 20).await;
    assert_eq!(
        (drained.failed, drained.dead, drained.cut_off),
        (1, 1, 0),
        "timed out by the declared 100 ms, not cut off by the drain: {drained:?}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
    let outcome = settled(&mail, &slow_id, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(matches!(outcome, Settled::Dead { .. }), "{outcome:?}");
}

/// Issue 60: a transactional handler whose transaction conflicts is called again (a replay),
/// and the replay is counted (`Drained::replayed`, `QueueStats::replayed`); its writes commit
/// once, with the outcome.
pub async fn a_replayed_transactional_handler_is_counted<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::TitoTransaction;
    let mail = spec().open(ctx.db.clone()).await.unwrap();
    mail.publish(QueueEvent::now("k", Mail::Digest))
        .await
        .unwrap();
    let key = ctx.key("replayed:counter");
    let calls = Arc::new(AtomicUsize::new(0));
    let (db, seen) = (ctx.db.clone(), calls.clone());
    let drained = drain_transactional(&mail, move |_event: QueueEvent<Mail>, tx| {
        let (db, key, seen) = (db.clone(), key.clone(), seen.clone());
        async move {
            let before = tx.get(&key).await?;
            tx.put(key.clone(), b"handler".to_vec()).await?;
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                // Another transaction writes the key this one read and wrote, and commits
                // first: this one conflicts at its commit and the handler runs again.
                let other = key.clone();
                db.transaction(|other_tx| {
                    let other = other.clone();
                    async move { other_tx.put(other, b"other".to_vec()).await }
                })
                .await?;
            }
            let _ = before;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{drained:?}");
    assert_eq!(
        (drained.acknowledged, drained.replayed),
        (1, 1),
        "{drained:?}"
    );
    assert_eq!(mail.queue().stats().replayed, 1);
    let stored = crate::support::read(&ctx.db, &ctx.key("replayed:counter")).await;
    assert_eq!(stored.as_deref(), Some(&b"handler"[..]));
}

/// Issue 60: sixteen transactional handlers of one partition, whose transactions all overlap,
/// commit without a conflict among them: each locks a fence slot of its own, not the lease's
/// holder key. Under a one-attempt failure policy a conflict counted as a failure would kill a
/// job; none is replayed, none dies.
pub async fn transactional_handlers_of_one_partition_never_conflict_on_its_lease<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::TitoTransaction;
    const ONE: Topic<u32> = Topic::new("one-partition");
    let jobs = ONE
        .spec(1, Duration::from_secs(3600))
        .failure_policy(FailurePolicy::new(1))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let events: Vec<QueueEvent<u32>> = (0..48)
        .map(|n| QueueEvent::now(format!("k{n}"), n))
        .collect();
    jobs.publish_many(&events).await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (seen, prefix) = (calls.clone(), ctx.key("fenced:"));
    let drained = drain_transactional(&jobs, move |event: QueueEvent<u32>, tx| {
        let (seen, mut key) = (seen.clone(), prefix.clone());
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            key.extend_from_slice(event.payload.to_string().as_bytes());
            tx.put(key, b"done".to_vec()).await?;
            // Long enough that the sixteen handlers' transactions overlap.
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(
        (
            drained.acknowledged,
            drained.replayed,
            drained.dead,
            drained.failed
        ),
        (48, 0, 0, 0),
        "{drained:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 48);
    for n in 0..48 {
        let key = [ctx.key("fenced:"), n.to_string().into_bytes()].concat();
        assert!(
            crate::support::read(&ctx.db, &key).await.is_some(),
            "row {n}"
        );
    }
}

/// Issue 60: a transactional handler whose commit still conflicts after its transaction's
/// replays (another writer keeps writing the key it writes) did nothing wrong: the invocation
/// stays pending and runs again, without a failed attempt counted, so a one-attempt failure
/// policy does not kill it.
pub async fn a_commit_that_keeps_conflicting_is_not_a_failed_attempt<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::TitoTransaction;
    const HOT: Topic<u32> = Topic::new("hot-key");
    let jobs = HOT
        .spec(1, Duration::from_secs(3600))
        .failure_policy(FailurePolicy::new(1))
        .open(ctx.db.clone())
        .await
        .unwrap();
    jobs.publish(QueueEvent::now("k", 1)).await.unwrap();
    let key = ctx.key("contended:hot");
    let calls = Arc::new(AtomicUsize::new(0));
    let (db, seen) = (ctx.db.clone(), calls.clone());
    // The default retry policy runs a transaction 10 times; the other writer wins 12 times.
    let drained = drain_transactional(&jobs, move |_event: QueueEvent<u32>, tx| {
        let (db, key, seen) = (db.clone(), key.clone(), seen.clone());
        async move {
            tx.put(key.clone(), b"handler".to_vec()).await?;
            if seen.fetch_add(1, Ordering::SeqCst) < 12 {
                let other = key.clone();
                db.transaction(|other_tx| {
                    let other = other.clone();
                    async move { other_tx.put(other, b"other".to_vec()).await }
                })
                .await?;
            }
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    })
    .await
    .unwrap();
    assert_eq!(
        (drained.acknowledged, drained.dead, drained.retried),
        (1, 0, 0),
        "{drained:?}"
    );
    assert!(drained.failed >= 1, "{drained:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 13, "{drained:?}");
    // Ten calls in the first attempt (nine replays), three in the second (two).
    assert_eq!(drained.replayed, 11, "{drained:?}");
    let stored = crate::support::read(&ctx.db, &ctx.key("contended:hot")).await;
    assert_eq!(stored.as_deref(), Some(&b"handler"[..]));
}

/// Issue 60: a cancel that commits while a transactional handler runs makes its commit
/// conflict; the attempt replayed after it finds the row gone before calling the handler
/// again, so nothing starts after the cancel returned, and the handler's write never commits.
pub async fn a_cancel_during_a_transactional_handler_does_not_call_it_again<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    use tito::TitoTransaction;
    const CANCELLED: Topic<u32> = Topic::new("cancelled-mid-run");
    let jobs = CANCELLED
        .spec(1, Duration::from_secs(3600))
        .failure_policy(FailurePolicy::new(3))
        .open(ctx.db.clone())
        .await
        .unwrap();
    let id = jobs.publish(QueueEvent::now("k", 1)).await.unwrap().id;
    let calls = Arc::new(AtomicUsize::new(0));
    let (seen, receipt) = (calls.clone(), ctx.key("cancelled-mid-run:receipt"));
    let mut workers = Workers::new();
    workers.start_transactional(&jobs, move |_event: QueueEvent<u32>, tx| {
        let (seen, receipt) = (seen.clone(), receipt.clone());
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            tx.put(receipt, b"sent".to_vec()).await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(QueueHandlerOutcome::Acknowledge)
        }
    });
    let started = calls.clone();
    wait_for("the handler to start", Duration::from_secs(30), move || {
        let started = started.clone();
        async move { started.load(Ordering::SeqCst) >= 1 }
    })
    .await;
    assert!(jobs.queue().cancel(&id, "not needed").await.unwrap());
    // Past the handler's end, when a replay would have called it again.
    tokio::time::sleep(Duration::from_millis(900)).await;
    workers.shutdown().await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let receipt = crate::support::read(&ctx.db, &ctx.key("cancelled-mid-run:receipt")).await;
    assert_eq!(receipt, None);
}
