//! The inbox: a model whose rows are the queue. Claim order and readiness, outcomes, dead
//! letters, leases, one subscription per group, bad rows, roles that are absent. Written once,
//! run on every backend.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::inbox::{
    DeadLetter, Inbox, InboxClock, InboxConfig, InboxDelivery, InboxModel, InboxOutcome, run_inbox,
};
use tito::{TitoEngine, TitoError, TitoModel, TitoTransaction};
use tokio::sync::watch;

use crate::support::{Ctx, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! inbox_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            inbox,
            [
                claims_follow_priority_then_retry_after_then_id,
                outcomes_do_what_they_say,
                attempts_run_out_into_a_dead_letter_group,
                failed_deliveries_are_released_to_their_retry_time,
                dead_letters_can_go_to_another_model,
                concurrent_claimers_never_share_a_row,
                a_lost_lease_applies_no_outcome,
                one_subscription_per_group,
                bad_rows_are_set_aside_without_blocking,
                roles_that_are_absent_are_not_needed,
                unknown_outcomes_deliver_each_row_once,
            ]
        );
    };
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Email {
    pub to: String,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "email_job")]
pub struct EmailJob {
    pub id: String,
    #[tito(group)]
    pub queue: String,
    #[tito(priority)]
    pub priority: i64,
    #[tito(retry_after)]
    pub retry_after: i64,
    #[tito(attempt)]
    pub attempt: i64,
    #[tito(processed_at)]
    pub processed_at: Option<i64>,
    #[tito(locked_until)]
    pub locked_until: Option<i64>,
    #[tito(headers)]
    pub headers: BTreeMap<String, String>,
    #[tito(partition_key)]
    pub tenant: String,
    #[tito(payload)]
    pub payload: Email,
}

/// The same table read loosely, to write rows the strict model cannot read.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "email_job")]
pub struct LooseJob {
    pub id: String,
    #[tito(group)]
    pub queue: String,
    #[tito(priority)]
    pub priority: i64,
    #[tito(retry_after)]
    pub retry_after: i64,
    #[tito(processed_at)]
    pub processed_at: Option<i64>,
    pub payload: serde_json::Value,
}

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
pub struct FailedEmail {
    pub id: String,
    pub to: String,
}

fn job(id: &str, priority: i64, retry_after: i64) -> EmailJob {
    EmailJob {
        id: id.into(),
        queue: "mail".into(),
        priority,
        retry_after,
        headers: BTreeMap::from([("trace".to_string(), format!("t-{id}"))]),
        tenant: "acme".into(),
        payload: Email {
            to: format!("{id}@example.com"),
        },
        ..Default::default()
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

type Log = Arc<Mutex<Vec<InboxDelivery<Email>>>>;

struct Running {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), TitoError>>,
}

impl Running {
    async fn stop(self) {
        self.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the subscription stops")
            .unwrap()
            .unwrap();
    }
}

fn subscribe<E: TitoEngine>(
    inbox: &Arc<Inbox<E, EmailJob>>,
    config: InboxConfig<E, EmailJob>,
    log: &Log,
    outcome: impl Fn(&InboxDelivery<Email>) -> InboxOutcome + Send + Sync + 'static,
) -> Running {
    let (stop, rx) = watch::channel(false);
    let log = log.clone();
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        config.max_idle(Duration::from_millis(20)),
        move |delivery: InboxDelivery<Email>| {
            let result = outcome(&delivery);
            log.lock().unwrap().push(delivery);
            async move { Ok(result) }
        },
        rx,
    ));
    Running { stop, task }
}

async fn settle(what: &str, check: impl Fn() -> bool + Send + Sync + 'static) {
    let check = Arc::new(check);
    wait_for(what, Duration::from_secs(30), move || {
        let check = check.clone();
        async move { check() }
    })
    .await;
}

pub async fn claims_follow_priority_then_retry_after_then_id<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    let now = now_ms();
    for job in [
        job("c", 1, 0),
        job("b", 1, 0),
        job("a", 2, 0),
        job("d", 0, now - 10),
        job("e", 0, now - 1000),
        job("late", 0, now + 1500),
    ] {
        jobs.build(job).await.unwrap();
    }
    let mut other = job("x", 0, 0);
    other.queue = "sms".into();
    jobs.build(other).await.unwrap();

    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let log: Log = Arc::default();
    let running = subscribe(
        &inbox,
        InboxConfig::new("mail").concurrency(1),
        &log,
        |_| InboxOutcome::Ack,
    );
    let l = log.clone();
    settle("five ready jobs", move || l.lock().unwrap().len() == 5).await;
    let order: Vec<String> = log.lock().unwrap().iter().map(|d| d.id.clone()).collect();
    assert_eq!(
        order,
        ["e", "d", "b", "c", "a"],
        "priority, then retry_after, then id"
    );
    // The delayed job comes when its time does; the other group's never does.
    let l = log.clone();
    settle("the delayed job", move || l.lock().unwrap().len() == 6).await;
    assert!(now_ms() >= now + 1500);
    running.stop().await;
    let delivered = log.lock().unwrap().clone();
    assert_eq!(delivered[5].id, "late");
    assert_eq!(
        delivered[0].headers.get("trace").map(String::as_str),
        Some("t-e")
    );
    assert_eq!(
        delivered[0].payload,
        Email {
            to: "e@example.com".into()
        }
    );
    assert_eq!(
        (delivered[0].attempt, delivered[0].partition_key.as_deref()),
        (1, Some("acme"))
    );
    assert!(
        jobs.find_by_id("x", vec![])
            .await
            .unwrap()
            .processed_at
            .is_none()
    );
}

pub async fn outcomes_do_what_they_say<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    for id in ["ack", "drop", "retry", "later"] {
        jobs.build(job(id, 0, 0)).await.unwrap();
    }
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let log: Log = Arc::default();
    let running = subscribe(
        &inbox,
        InboxConfig::new("mail").clock(InboxClock::Engine),
        &log,
        |d| match (d.id.as_str(), d.attempt) {
            ("ack", _) => InboxOutcome::Ack,
            ("drop", _) => InboxOutcome::Drop,
            ("retry", 1) => InboxOutcome::Retry,
            ("later", 1) => InboxOutcome::RetryAfter(Duration::from_millis(500)),
            _ => InboxOutcome::Ack,
        },
    );
    let l = log.clone();
    settle("every outcome", move || l.lock().unwrap().len() == 6).await;
    running.stop().await;
    let ack = jobs.find_by_id("ack", vec![]).await.unwrap();
    assert!(ack.processed_at.is_some() && ack.locked_until.is_none());
    assert!(matches!(
        jobs.find_by_id("drop", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
    let retried = jobs.find_by_id("retry", vec![]).await.unwrap();
    assert_eq!(retried.attempt, 2, "attempt counts claims");
    let log = log.lock().unwrap().clone();
    let later: Vec<u64> = log
        .iter()
        .filter(|d| d.id == "later")
        .map(|d| d.attempt)
        .collect();
    assert_eq!(later, [1, 2]);
    // Processed rows leave the claim index.
    let inbox_keys = {
        let tx = ctx.db.begin().await.unwrap();
        let rows = tx
            .scan(
                b"index:email_job:email_job_inbox_claim:",
                b"index:email_job:email_job_inbox_claim;",
                100,
            )
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        rows.len()
    };
    assert_eq!(inbox_keys, 0);
}

pub async fn unknown_outcomes_deliver_each_row_once<E: TitoEngine>(ctx: Ctx<E>) {
    use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
    let faulty = FaultyEngine::new(ctx.db.clone());
    let jobs = faulty.clone().model::<EmailJob>();
    let inbox = Arc::new(Inbox::<_, EmailJob>::new(faulty.clone()).unwrap());
    for (phase, fault) in [
        // Claims and acknowledgements apply, but their replies are lost.
        (
            0,
            FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeCommitted).always(),
        ),
        // Every other claim or acknowledgement is lost before it applies.
        (
            1,
            FaultRule::new(FaultPoint::Commit, Fault::UnknownOutcomeNotCommitted)
                .every(2)
                .always(),
        ),
    ] {
        let ids: Vec<String> = (0..5).map(|n| format!("p{phase}-{n}")).collect();
        for id in &ids {
            jobs.build(job(id, 0, 0)).await.unwrap();
        }
        faulty
            .faults()
            .add(fault.when_key_starts_with("table:email_job:"));
        let injected = faulty.faults().injected();
        let log: Log = Arc::default();
        let running = subscribe(
            &inbox,
            InboxConfig::new("mail").clock(InboxClock::Engine),
            &log,
            |_| InboxOutcome::Ack,
        );
        let (check, expected) = (jobs.clone(), ids.clone());
        wait_for("every row processed", Duration::from_secs(30), move || {
            let (jobs, ids) = (check.clone(), expected.clone());
            async move {
                for id in &ids {
                    match jobs.find_by_id(id, vec![]).await {
                        Ok(row) if row.processed_at.is_some() => {}
                        _ => return false,
                    }
                }
                true
            }
        })
        .await;
        running.stop().await;
        faulty.faults().clear();
        assert!(faulty.faults().injected() >= injected + 5, "phase {phase}");
        let mut delivered: Vec<String> = log.lock().unwrap().iter().map(|d| d.id.clone()).collect();
        delivered.sort();
        assert_eq!(
            delivered, ids,
            "phase {phase}: each row delivered exactly once"
        );
    }
}

pub async fn attempts_run_out_into_a_dead_letter_group<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    jobs.build(job("flaky", 0, 0)).await.unwrap();
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let log: Log = Arc::default();
    let config = InboxConfig::new("mail")
        .max_attempts(3)
        .dead_letter(DeadLetter::Group("mail-dead".into()));
    let running = subscribe(&inbox, config, &log, |_| InboxOutcome::Retry);
    let j = jobs.clone();
    wait_for("the dead letter", Duration::from_secs(30), move || {
        let j = j.clone();
        async move { j.find_by_id("flaky", vec![]).await.unwrap().queue == "mail-dead" }
    })
    .await;
    running.stop().await;
    assert_eq!(
        log.lock().unwrap().len(),
        3,
        "three claims, then the dead letter"
    );
    assert_eq!(inbox.stats().dead_lettered, 1);
}

/// A handler's `Err` releases the row to a retry time after the policy's backoff (not the rest
/// of a long lease); attempts rise by one; the last failure dead-letters it, and a fatal panic
/// at once.
pub async fn failed_deliveries_are_released_to_their_retry_time<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    jobs.build(job("fails", 0, 0)).await.unwrap();
    jobs.build(job("panics", 1, 0)).await.unwrap();
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let seen: Arc<Mutex<Vec<(String, u64, std::time::Instant)>>> = Arc::default();
    let log = seen.clone();
    let policy = tito::queue::FailurePolicy::new(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(100))
        .panics_are_fatal();
    // A lease of a minute: a failure that held the row for its lease would stall the test.
    let config = InboxConfig::new("mail")
        .lease(Duration::from_secs(60))
        .failure_policy(policy)
        .dead_letter(DeadLetter::Group("mail-dead".into()))
        .max_idle(Duration::from_millis(20));
    assert_eq!(config.max_attempts, 3);
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        config,
        move |delivery: InboxDelivery<Email>| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push((
                    delivery.id.clone(),
                    delivery.attempt,
                    std::time::Instant::now(),
                ));
                if delivery.id == "panics" {
                    panic!("a fatal panic");
                }
                Err(TitoError::handler("the mail server said no"))
            }
        },
        rx,
    ));
    let j = jobs.clone();
    wait_for("both dead letters", Duration::from_secs(30), move || {
        let j = j.clone();
        async move {
            let fails = j.find_by_id("fails", vec![]).await.unwrap();
            let panics = j.find_by_id("panics", vec![]).await.unwrap();
            fails.queue == "mail-dead" && panics.queue == "mail-dead"
        }
    })
    .await;
    let running = Running { stop, task };
    running.stop().await;
    let seen = seen.lock().unwrap().clone();
    let attempts = |id: &str| -> Vec<u64> {
        seen.iter()
            .filter(|(i, _, _)| i == id)
            .map(|(_, a, _)| *a)
            .collect()
    };
    assert_eq!(attempts("fails"), [1, 2, 3]);
    assert_eq!(
        attempts("panics"),
        [1],
        "a fatal panic dead-letters at once"
    );
    // Released to its retry time: the next claim came after the backoff, long before the lease.
    let times: Vec<std::time::Instant> = seen
        .iter()
        .filter(|(i, _, _)| i == "fails")
        .map(|(_, _, t)| *t)
        .collect();
    for pair in times.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= Duration::from_millis(50),
            "{gap:?}: before the backoff"
        );
        assert!(gap < Duration::from_secs(30), "{gap:?}: held for the lease");
    }
    assert_eq!(inbox.stats().dead_lettered, 2);
    assert_eq!(inbox.stats().failed, 4);
    // A refused policy refuses the subscription before it claims.
    let bad =
        InboxConfig::<E, EmailJob>::new("mail").failure_policy(tito::queue::FailurePolicy::new(0));
    assert!(matches!(bad.check(), Err(TitoError::InvalidArgument(_))));
}

pub async fn dead_letters_can_go_to_another_model<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    let failed = ctx.db.clone().model::<FailedEmail>();
    let mut spent = job("spent", 0, 0);
    spent.attempt = 2;
    jobs.build(spent).await.unwrap();
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let f = failed.clone();
    let dead = DeadLetter::Model(Arc::new(move |job: EmailJob, tx: E::Transaction| {
        let f = f.clone();
        Box::pin(async move {
            f.build_with_options(
                FailedEmail {
                    id: job.id,
                    to: job.payload.to,
                },
                Default::default(),
                &tx,
            )
            .await
            .map(drop)
        }) as futures::future::BoxFuture<'static, _>
    }));
    let log: Log = Arc::default();
    let running = subscribe(
        &inbox,
        InboxConfig::new("mail").max_attempts(2).dead_letter(dead),
        &log,
        |_| InboxOutcome::Ack,
    );
    let fe = failed.clone();
    wait_for("the dead letter row", Duration::from_secs(30), move || {
        let fe = fe.clone();
        async move { fe.find_by_id("spent", vec![]).await.is_ok() }
    })
    .await;
    running.stop().await;
    assert!(
        log.lock().unwrap().is_empty(),
        "a row out of attempts is not delivered"
    );
    assert!(matches!(
        jobs.find_by_id("spent", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
}

pub async fn concurrent_claimers_never_share_a_row<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    for n in 0..30 {
        jobs.build(job(&format!("j{n:02}"), n % 3, 0))
            .await
            .unwrap();
    }
    // Several claimers at once (as several processes would be), each taking batches.
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let inbox = inbox.clone();
        tasks.push(tokio::spawn(async move {
            let config = InboxConfig::<E, EmailJob>::new("mail");
            let mut mine = Vec::new();
            loop {
                let claims = inbox.claim::<Email>(&config, 4).await.unwrap();
                if claims.is_empty() {
                    return mine;
                }
                for (claim, delivery) in claims {
                    assert!(
                        inbox
                            .complete(&config, &claim, InboxOutcome::Ack)
                            .await
                            .unwrap()
                    );
                    mine.push(delivery.id);
                }
            }
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let unique: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), 30, "{all:?}");
    assert_eq!(unique.len(), 30);
}

pub async fn a_lost_lease_applies_no_outcome<E: TitoEngine>(ctx: Ctx<E>) {
    let jobs = ctx.db.clone().model::<EmailJob>();
    jobs.build(job("slow", 0, 0)).await.unwrap();
    let inbox = Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap();
    let short = InboxConfig::<E, EmailJob>::new("mail").lease(Duration::from_millis(50));
    let (first, _) = inbox
        .claim::<Email>(&short, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    // While it holds the lease nobody else gets the row.
    assert!(inbox.claim::<Email>(&short, 1).await.unwrap().is_empty());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The lease ran out: another claimer takes it, and the first cannot apply an outcome.
    let (second, delivery) = inbox
        .claim::<Email>(&short, 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(delivery.attempt, 2);
    assert!(
        !inbox
            .complete(&short, &first, InboxOutcome::Ack)
            .await
            .unwrap()
    );
    assert!(inbox.extend(&short, &first).await.unwrap().is_none());
    assert!(
        inbox
            .complete(&short, &second, InboxOutcome::Ack)
            .await
            .unwrap()
    );
    assert!(
        jobs.find_by_id("slow", vec![])
            .await
            .unwrap()
            .processed_at
            .is_some()
    );
}

pub async fn one_subscription_per_group<E: TitoEngine>(ctx: Ctx<E>) {
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let log: Log = Arc::default();
    let first = subscribe(&inbox, InboxConfig::new("solo"), &log, |_| {
        InboxOutcome::Ack
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_stop, rx) = watch::channel(false);
    let second = run_inbox(
        inbox.clone(),
        InboxConfig::new("solo"),
        |_delivery: InboxDelivery<Email>| async { Ok(InboxOutcome::Ack) },
        rx,
    )
    .await;
    assert!(
        matches!(second, Err(TitoError::AlreadySubscribed(_))),
        "{second:?}"
    );
    // Another group is fine.
    let other = subscribe(&inbox, InboxConfig::new("solo-other"), &log, |_| {
        InboxOutcome::Ack
    });
    first.stop().await;
    other.stop().await;
    // Free again once the first one stopped.
    let again = subscribe(&inbox, InboxConfig::new("solo"), &log, |_| {
        InboxOutcome::Ack
    });
    again.stop().await;
}

pub async fn bad_rows_are_set_aside_without_blocking<E: TitoEngine>(ctx: Ctx<E>) {
    let loose = ctx.db.clone().model::<LooseJob>();
    // First in claim order, and unreadable as an EmailJob (its payload is a string).
    loose
        .build(LooseJob {
            id: "bad".into(),
            queue: "mail".into(),
            priority: -1,
            payload: serde_json::json!("oops"),
            ..Default::default()
        })
        .await
        .unwrap();
    let jobs = ctx.db.clone().model::<EmailJob>();
    jobs.build(job("good", 0, 0)).await.unwrap();
    let inbox = Arc::new(Inbox::<E, EmailJob>::new(ctx.db.clone()).unwrap());
    let log: Log = Arc::default();
    let running = subscribe(&inbox, InboxConfig::new("mail"), &log, |_| {
        InboxOutcome::Ack
    });
    let l = log.clone();
    settle("the good row", move || l.lock().unwrap().len() == 1).await;
    running.stop().await;
    assert_eq!(log.lock().unwrap()[0].id, "good");
    assert_eq!(inbox.bad_rows().await.unwrap(), ["bad"]);
    assert_eq!(inbox.stats().bad, 1, "reported once, then skipped");
}

/// A minimal inbox: only a group and an id. Ack deletes the row (no processed_at); no lease
/// role, so a claim is the delete itself.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(inbox)]
pub struct Webhook {
    pub id: String,
    #[tito(group)]
    pub endpoint: String,
    pub body: String,
}

pub async fn roles_that_are_absent_are_not_needed<E: TitoEngine>(ctx: Ctx<E>) {
    assert!(Webhook::inbox_spec().processed_at.is_none());
    let hooks = ctx.db.clone().model::<Webhook>();
    for n in 0..3 {
        hooks
            .build(Webhook {
                id: format!("h{n}"),
                endpoint: "shop".into(),
                body: "{}".into(),
            })
            .await
            .unwrap();
    }
    let inbox = Arc::new(Inbox::<E, Webhook>::new(ctx.db.clone()).unwrap());
    let seen: Arc<Mutex<Vec<Webhook>>> = Arc::default();
    let s = seen.clone();
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        InboxConfig::new("shop").max_idle(Duration::from_millis(20)),
        move |delivery: InboxDelivery<Webhook>| {
            s.lock().unwrap().push(delivery.payload);
            async { Ok(InboxOutcome::Ack) }
        },
        rx,
    ));
    let s = seen.clone();
    settle("three webhooks", move || s.lock().unwrap().len() >= 3).await;
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(
        hooks.find().execute().await.unwrap().items.len(),
        0,
        "ack deletes without processed_at"
    );
}

/// An inbox model whose claim index is declared as holding keys (by hand: the derive never
/// does): claims read rows from those entries, so the inbox refuses it.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct KeyedClaims(LooseJob);

impl tito::model::TitoModelTrait for KeyedClaims {
    fn id(&self) -> String {
        self.0.id()
    }
    fn table(&self) -> String {
        self.0.table()
    }
    fn indexes(&self) -> Vec<tito::model::TitoIndexConfig> {
        self.0.indexes()
    }
    fn conditions(&self) -> Vec<tito::model::TitoCondition> {
        self.0.conditions()
    }
    fn key_only_indexes(&self) -> Vec<String> {
        vec![tito::inbox::InboxSpec::claim_index_name("email_job")]
    }
}

impl tito::inbox::InboxModel for KeyedClaims {
    fn inbox_spec() -> tito::inbox::InboxSpec {
        LooseJob::inbox_spec()
    }
}

#[test]
fn an_inbox_claim_index_of_keys_is_refused() {
    let db = tito::backend::memory::Memory::new();
    match Inbox::<_, KeyedClaims>::new(db) {
        Err(TitoError::InvalidArgument(message)) => {
            assert!(message.contains("email_job_inbox_claim"), "{message}");
            assert!(message.contains("copies"), "{message}");
        }
        Err(other) => panic!("expected InvalidArgument, got {other:?}"),
        Ok(_) => panic!("an inbox whose claim index holds keys was accepted"),
    }
}

/// A row inserted in this process wakes an idle subscription of its table after the commit:
/// under paused time, with the subscription's idle pause grown to an hour, the row is handled
/// before a minute of (virtual) time passes. Without the wake-up, time would jump to the idle
/// pause's end, past the minute.
#[tokio::test(start_paused = true)]
async fn a_new_row_wakes_an_idle_subscription() {
    use tito::backend::memory::{Memory, MemoryClock, MemoryOptions};
    let db = Memory::with_options(MemoryOptions::new().clock(MemoryClock::Runtime {
        epoch_ms: 1_700_000_000_000,
    }))
    .unwrap();
    let jobs = db.clone().model::<EmailJob>();
    let inbox = Arc::new(Inbox::<Memory, EmailJob>::new(db.clone()).unwrap());
    let (handled, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let (stop, rx) = watch::channel(false);
    let config = InboxConfig::new("mail")
        .max_idle(Duration::from_secs(3600))
        .clock(InboxClock::Engine);
    let task = tokio::spawn(run_inbox(
        inbox.clone(),
        config,
        move |delivery: InboxDelivery<Email>| {
            let handled = handled.clone();
            async move {
                handled.send(delivery.id).unwrap();
                Ok(InboxOutcome::Ack)
            }
        },
        rx,
    ));
    // Idle long enough for the pause between claims to reach its hour.
    tokio::time::sleep(Duration::from_secs(4 * 3600)).await;
    let started = tokio::time::Instant::now();
    jobs.build(job("woken", 0, 0)).await.unwrap();
    let id = tokio::time::timeout(Duration::from_secs(60), seen.recv())
        .await
        .expect("the new row was handled before its subscription's next idle claim")
        .unwrap();
    assert_eq!(id, "woken");
    assert!(started.elapsed() < Duration::from_secs(60));
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
}
