//! Regression tests for the defects found where users meet the library: a caller's transaction
//! that goes on after an error, the first deploy of an index, restarts, payloads a worker cannot
//! decode, handlers that panic before their future exists. Written once, run on every backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::inbox::{Inbox, InboxConfig, InboxDelivery, InboxOutcome, run_inbox};
use tito::model::TitoOptions;
use tito::model::{TitoIndexBlockType, TitoIndexConfig, TitoIndexField, TitoModelTrait};
use tito::queue::{ClusterConfig, run_cluster_worker, run_transactional_worker, run_worker};
use tito::schema::IndexState;
use tito::{
    QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel, TitoTransaction,
    WorkerConfig,
};
use tokio::sync::watch;

use crate::support::{Ctx, now, pending_total, queue, wait_for};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! boundary_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            boundary,
            [
                an_index_added_to_an_empty_table_keeps_rows_of_racing_old_writers,
                errors_name_the_table_and_the_id_as_written,
                a_handler_that_panics_before_its_future_is_run_again,
                a_refused_write_in_a_callers_transaction_leaves_nothing,
                a_failure_after_buffering_aborts_the_callers_transaction,
                every_inbox_outcome_against_every_combination_of_roles,
                a_worker_of_the_wrong_type_costs_one_attempt_per_row,
            ]
        );
    };
}

/// A row of table `race{N}` as the first deploy writes it: no index.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RaceOld<const N: u8> {
    pub id: String,
    pub team: String,
}

/// The same table as the next deploy writes it: an index by team.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RaceNew<const N: u8> {
    pub id: String,
    pub team: String,
}

impl<const N: u8> TitoModelTrait for RaceOld<N> {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        format!("race{N}")
    }
}

impl<const N: u8> TitoModelTrait for RaceNew<N> {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        format!("race{N}")
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        vec![TitoIndexConfig {
            condition: true,
            name: "by_team".into(),
            fields: vec![TitoIndexField {
                name: "team".into(),
                r#type: TitoIndexBlockType::String,
            }],
        }]
    }
}

/// Item 1: the first deploy registered the table (its catalog exists, with no row yet); the next
/// deploy adds an index while old instances insert. The index waits for the write grace and a
/// build pass like on any table, so every row the old code wrote meanwhile is in it.
async fn race_once<E: TitoEngine, const N: u8>(db: &E) {
    let old = db.clone().model::<RaceOld<N>>();
    // The first deploy's first use: the catalog is registered, the table is empty.
    old.schema().await.unwrap();
    let new = db.clone().model::<RaceNew<N>>();
    let writers: Vec<_> = (0..3)
        .map(|i| {
            let old = old.clone();
            tokio::spawn(async move {
                old.build(RaceOld {
                    id: format!("r{i}"),
                    team: "core".into(),
                })
                .await
            })
        })
        .collect();
    let registered = new.schema().await.unwrap();
    for writer in writers {
        writer.await.unwrap().unwrap();
    }
    // Registered on an existing catalog: building, never ready at once.
    let state = registered
        .indexes
        .iter()
        .find(|i| i.name == "by_team")
        .map(|i| i.state);
    assert_eq!(state, Some(IndexState::Building), "table race{N}");
    assert!(matches!(
        new.query_by_index("by_team").value("core").execute().await,
        Err(TitoError::IndexNotReady { .. })
    ));
    let built = new.build_indexes(|_| {}).await.unwrap();
    assert_eq!(built.indexes[0].state, IndexState::Ready);
    let page = new
        .query_by_index("by_team")
        .value("core")
        .execute()
        .await
        .unwrap();
    assert_eq!(
        page.items.len(),
        3,
        "table race{N}: every racing row is indexed"
    );
    let report = new.audit(|_| {}).await.unwrap();
    assert!(report.is_clean(), "table race{N}: {report:?}");
}

pub async fn an_index_added_to_an_empty_table_keeps_rows_of_racing_old_writers<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    tito::schema::set_write_grace(&ctx.db, Duration::from_millis(50)).unwrap();
    race_once::<E, 0>(&ctx.db).await;
    race_once::<E, 1>(&ctx.db).await;
    race_once::<E, 2>(&ctx.db).await;
    race_once::<E, 3>(&ctx.db).await;

    // The very first registration of a table with no rows is ready at once: no writer can have
    // read an older catalog.
    let fresh = ctx.db.clone().model::<RaceNew<9>>();
    let schema = fresh.schema().await.unwrap();
    assert_eq!(schema.indexes[0].state, IndexState::Ready);
}

/// Item 9: a missing or duplicate row is named by its table and its id as the caller wrote it,
/// not by its storage key alone (the key follows, for operators).
pub async fn errors_name_the_table_and_the_id_as_written<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<RaceOld<20>>();
    let row = |id: &str| RaceOld::<20> {
        id: id.into(),
        team: "core".into(),
    };
    let err = users.find_by_id("zzz-1", vec![]).await.unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)));
    assert!(
        err.to_string()
            .contains(r#"table "race20" has no row with id "zzz-1""#),
        "{err}"
    );
    let err = users.update(row("zzz-1")).await.unwrap_err();
    assert!(
        err.to_string().contains(r#"no row with id "zzz-1""#),
        "{err}"
    );
    let err = users.delete_by_id("zzz-1").await.unwrap_err();
    assert!(
        err.to_string().contains(r#"no row with id "zzz-1""#),
        "{err}"
    );
    users.build(row("bulk00000")).await.unwrap();
    let err = users.build(row("bulk00000")).await.unwrap_err();
    assert!(matches!(err, TitoError::AlreadyExists(_)));
    assert!(
        err.to_string()
            .contains(r#"table "race20" already has a row with id "bulk00000""#),
        "{err}"
    );
}

#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub n: u32,
}

/// An inbox row with only a payload: every other role absent.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(table = "boundary_task")]
pub struct Task {
    pub id: String,
    #[tito(payload)]
    pub payload: Job,
}

/// Counts calls; the first call panics before it returns a future.
#[derive(Clone, Default)]
struct PanicsFirst(Arc<AtomicUsize>);

impl PanicsFirst {
    /// Counts a call; panics on the first.
    fn call(&self) {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a handler that panics before it builds its future");
        }
    }
    fn calls(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A queue of one partition under `topic`, holding one event `Job { n }` due now.
async fn queue_with_one<E: TitoEngine>(db: &E, topic: &str, n: u32) -> Arc<tito::Queue<E>> {
    let queue = Arc::new(tito::Queue::new(
        db.clone(),
        tito::QueueConfig::new(1, Duration::from_secs(3600)).topic(topic),
    ));
    queue
        .publish(QueueEvent::new("k", Job { n }, now()))
        .await
        .unwrap();
    queue
}

async fn drained<E: TitoEngine>(queue: &Arc<tito::Queue<E>>, what: &str) {
    let q = queue.clone();
    wait_for(what, Duration::from_secs(20), move || {
        let q = q.clone();
        async move { pending_total(&q).await == 0 }
    })
    .await;
}

/// Item 11: the call that builds a handler's future is supervised like the future: a panic in
/// it is a failed attempt, and the invocation is run again (every kind of worker, and inboxes).
pub async fn a_handler_that_panics_before_its_future_is_run_again<E: TitoEngine>(ctx: Ctx<E>) {
    let fast = || WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(20));

    // run_worker
    let plain = queue(&ctx.db, 1);
    plain
        .publish(QueueEvent::new("k", Job { n: 1 }, now()))
        .await
        .unwrap();
    let calls = PanicsFirst::default();
    let (stop, rx) = watch::channel(false);
    let handler = {
        let calls = calls.clone();
        move |_event: QueueEvent<Job>| {
            calls.call();
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        }
    };
    let worker = tokio::spawn(run_worker(plain.clone(), fast(), handler, rx));
    drained(&plain, "run_worker to run the invocation again").await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(calls.calls(), 2);
    assert!(plain.stats().failed >= 1);

    // run_transactional_worker
    let transactional = queue_with_one(&ctx.db, "boundary-tx", 2).await;
    let calls = PanicsFirst::default();
    let (stop, rx) = watch::channel(false);
    let handler = {
        let calls = calls.clone();
        move |_event: QueueEvent<Job>, _tx: E::Transaction| {
            calls.call();
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        }
    };
    let worker = tokio::spawn(run_transactional_worker(
        transactional.clone(),
        fast(),
        handler,
        rx,
    ));
    drained(&transactional, "run_transactional_worker to run it again").await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(calls.calls(), 2);

    // run_cluster_worker
    let clustered = queue_with_one(&ctx.db, "boundary-cluster", 3).await;
    let calls = PanicsFirst::default();
    let (stop, rx) = watch::channel(false);
    let handler = {
        let calls = calls.clone();
        move |_event: QueueEvent<Job>| {
            calls.call();
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        }
    };
    let ttl = Duration::from_millis(500);
    let node = ClusterConfig::new()
        .node_id("boundary-node")
        .node_ttl(ttl)
        .coordinator_ttl(ttl)
        .drop_after(ttl);
    let worker = tokio::spawn(run_cluster_worker(
        clustered.clone(),
        fast(),
        node,
        handler,
        rx,
    ));
    drained(&clustered, "run_cluster_worker to run it again").await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    assert_eq!(calls.calls(), 2);

    // run_inbox: the panicked delivery's row is claimable again once its lease ends.
    let tasks = ctx.db.clone().model::<Task>();
    tasks
        .build(Task {
            id: "t1".into(),
            payload: Job { n: 4 },
        })
        .await
        .unwrap();
    let inbox = Arc::new(Inbox::<E, Task>::new(ctx.db.clone()).unwrap());
    let calls = PanicsFirst::default();
    let delivered = Arc::new(AtomicUsize::new(0));
    let (stop, rx) = watch::channel(false);
    let handler = {
        let (calls, delivered) = (calls.clone(), delivered.clone());
        move |delivery: InboxDelivery<Job>| {
            calls.call();
            assert_eq!(delivery.payload.n, 4);
            delivered.fetch_add(1, Ordering::SeqCst);
            async { Ok(InboxOutcome::Drop) }
        }
    };
    let config = InboxConfig::new("tasks")
        .lease(Duration::from_millis(200))
        .max_idle(Duration::from_millis(20));
    let running = tokio::spawn(run_inbox(inbox.clone(), config, handler, rx));
    let seen = delivered.clone();
    wait_for(
        "the inbox to deliver again",
        Duration::from_secs(20),
        move || {
            let seen = seen.clone();
            async move { seen.load(Ordering::SeqCst) == 1 }
        },
    )
    .await;
    let tasks2 = tasks.clone();
    wait_for(
        "the dropped row to go",
        Duration::from_secs(20),
        move || {
            let tasks = tasks2.clone();
            async move { tasks.find_by_id("t1", vec![]).await.is_err() }
        },
    )
    .await;
    stop.send(true).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(calls.calls(), 2);
}

/// A sign-up: two unique indexes and a copied index, and an event per write.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(table = "signup")]
#[tito(unique_index = "by_email: email")]
#[tito(unique_index = "by_handle: handle")]
#[tito(index = "by_team: team")]
#[tito(event = "signup")]
pub struct Signup {
    pub id: String,
    pub email: String,
    pub handle: String,
    pub team: String,
    pub bio: String,
}

fn signup(id: &str, email: &str, handle: &str) -> Signup {
    Signup {
        id: id.into(),
        email: email.into(),
        handle: handle.into(),
        team: "core".into(),
        bio: String::new(),
    }
}

/// Runs `write` in a caller's transaction that also writes a key of its own, handles the
/// write's error and commits anyway; returns the write's error.
async fn commit_after_error<E, F, Fut>(db: &E, write: F) -> TitoError
where
    E: TitoEngine,
    F: FnOnce(E::Transaction) -> Fut + Clone + Send,
    Fut: std::future::Future<Output = Result<(), TitoError>> + Send,
{
    db.transaction(|tx| async move {
        tx.put(b"boundary:other".to_vec(), b"kept".to_vec()).await?;
        let err = write(tx.clone()).await.expect_err("the write is refused");
        Ok::<_, TitoError>(err)
    })
    .await
    .expect("the caller's other writes commit")
}

/// Item 2: a write refused in a caller's transaction (a unique value taken by another row, a
/// key or value over its limit, on insert and on update) buffers nothing; the caller commits
/// its other writes and the table stays consistent.
pub async fn a_refused_write_in_a_callers_transaction_leaves_nothing<E: TitoEngine>(ctx: Ctx<E>) {
    let users = ctx.db.clone().model::<Signup>();
    users.build(signup("ada", "ada@x", "ada")).await.unwrap();

    // The email is free, the handle taken: the email's claim (checked first) is not left.
    let u = users.clone();
    let err = commit_after_error(&ctx.db, |tx| async move {
        u.build_with_options(signup("bob", "bob@x", "ada"), TitoOptions::default(), &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::UniqueViolation { .. }), "{err}");
    assert_eq!(
        crate::support::read(&ctx.db, b"boundary:other")
            .await
            .as_deref(),
        Some(&b"kept"[..])
    );
    // Nobody owns bob@x: another row can take it.
    users.build(signup("bob", "bob@x", "bob")).await.unwrap();

    // A row over MAX_VALUE_BYTES: refused before its claims and entries are buffered.
    let mut huge = signup("cy", "cy@x", "cy");
    huge.bio = "x".repeat(tito::engine::MAX_VALUE_BYTES + 1);
    let (u, row) = (users.clone(), huge.clone());
    let err = commit_after_error(&ctx.db, |tx| async move {
        u.build_with_options(row, TitoOptions::default(), &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    users.build(signup("cy", "cy@x", "cy")).await.unwrap();

    // A refused update keeps the old row's claims and entries (they used to be deleted first).
    let mut grown = signup("ada", "ada2@x", "ada2");
    grown.bio = "y".repeat(tito::engine::MAX_VALUE_BYTES + 1);
    let u = users.clone();
    let err = commit_after_error(&ctx.db, |tx| async move {
        u.update_with_options(grown, TitoOptions::default(), &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    let found = users
        .query_by_index("by_email")
        .value("ada@x")
        .execute()
        .await
        .unwrap();
    assert_eq!(found.items.len(), 1, "ada is still found by her email");
    let team = users
        .query_by_index("by_team")
        .value("core")
        .execute()
        .await
        .unwrap();
    assert_eq!(team.items.len(), 3);
    // An id whose row key is over MAX_KEY_BYTES: refused before anything.
    let long = "i".repeat(tito::engine::MAX_KEY_BYTES);
    let u = users.clone();
    let err = commit_after_error(&ctx.db, |tx| async move {
        u.build_with_options(signup(&long, "long@x", "long"), TitoOptions::default(), &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    users.build(signup("dee", "long@x", "long")).await.unwrap();

    // Delete with events of a missing row, and a kv value over the limit: nothing buffered.
    let kv = tito::kv::Kv::new(ctx.db.clone());
    kv.put("limits", "k", &1, None, Some(Duration::from_secs(600)))
        .await
        .unwrap();
    let big = "z".repeat(tito::engine::MAX_VALUE_BYTES + 1);
    let k = kv.clone();
    let err = commit_after_error(&ctx.db, |tx| async move {
        k.put_in_tx("limits", "k", &big, None, None, &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    let entry = kv.get("limits", "k").await.unwrap().expect("the old value");
    assert_eq!(entry.value, serde_json::json!(1));
    let expiry = tito::keys::kv_expiry_key(entry.expires_ms.unwrap(), "limits", "k");
    assert!(
        crate::support::read(&ctx.db, expiry.as_bytes())
            .await
            .is_some(),
        "its expiry entry is intact"
    );

    // A publication refused in a caller's transaction (a handle configured with another
    // partition count than the queue's): nothing of it is committed with the caller's writes.
    let one = queue_with_one(&ctx.db, "refused", 1).await;
    let two = Arc::new(tito::Queue::new(
        ctx.db.clone(),
        tito::QueueConfig::new(2, Duration::from_secs(3600)).topic("refused"),
    ));
    let err = commit_after_error(&ctx.db, |tx| async move {
        two.publish_in_tx(&QueueEvent::new("k", Job { n: 2 }, now()), &tx)
            .await
            .map(|_| ())
    })
    .await;
    assert!(matches!(err, TitoError::InvalidArgument(_)), "{err}");
    assert_eq!(pending_total(&one).await, 1);

    let report = users.audit(|_| {}).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// Item 2's backstop: a failure after part of a write was buffered (here a storage error on
/// the third put) marks the caller's transaction failed; committing it is refused with an
/// error naming the first failure, and nothing of it is stored.
pub async fn a_failure_after_buffering_aborts_the_callers_transaction<E: TitoEngine>(ctx: Ctx<E>) {
    let db = FaultyEngine::new(ctx.db.clone());
    let users = db.clone().model::<Signup>();
    users.build(signup("ada", "ada@x", "ada")).await.unwrap();
    db.faults()
        .add(FaultRule::new(FaultPoint::Put, Fault::Storage).skip(2));
    let u = users.clone();
    let result = db
        .transaction(|tx| async move {
            tx.put(b"boundary:aborted".to_vec(), b"x".to_vec()).await?;
            let err = u
                .build_with_options(signup("bob", "bob@x", "bob"), TitoOptions::default(), &tx)
                .await
                .expect_err("the injected put fails");
            assert!(matches!(err, TitoError::Storage { .. }), "{err}");
            Ok::<_, TitoError>(())
        })
        .await;
    match result {
        Err(TitoError::TransactionAborted(first)) => {
            assert!(
                first.contains("injected"),
                "names the first failure: {first}"
            )
        }
        other => panic!("expected TransactionAborted, got {other:?}"),
    }
    assert_eq!(
        crate::support::read(&ctx.db, b"boundary:aborted").await,
        None
    );
    assert!(matches!(
        users.find_by_id("bob", vec![]).await,
        Err(TitoError::NotFound(_))
    ));
    users.build(signup("bob", "bob@x", "bob")).await.unwrap();
    let report = users.audit(|_| {}).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// An inbox row whose optional roles are chosen by the bits of `R`: 1 `processed_at`,
/// 2 `retry_after`, 4 `attempt`, 8 `locked_until`. The fields exist either way; only the
/// declared ones play their role.
#[derive(Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Matrix<const R: u8> {
    pub id: String,
    pub processed_at: Option<i64>,
    pub retry_after: i64,
    pub attempt: i64,
    pub locked_until: Option<i64>,
    pub payload: Job,
}

const PROCESSED_AT: u8 = 1;
const RETRY_AFTER: u8 = 2;
const ATTEMPT: u8 = 4;
const LOCKED_UNTIL: u8 = 8;

impl<const R: u8> TitoModelTrait for Matrix<R> {
    fn id(&self) -> String {
        self.id.clone()
    }
    fn table(&self) -> String {
        format!("matrix{R}")
    }
    fn indexes(&self) -> Vec<TitoIndexConfig> {
        let processed = R & PROCESSED_AT != 0 && self.processed_at.is_some();
        <Self as tito::inbox::InboxModel>::inbox_spec()
            .claim_index(&self.table(), processed)
            .into_iter()
            .collect()
    }
    fn conditions(&self) -> Vec<tito::model::TitoCondition> {
        let spec = <Self as tito::inbox::InboxModel>::inbox_spec();
        spec.claim_index(&self.table(), false)
            .map(|index| tito::model::TitoCondition {
                index: index.name,
                name: "inbox_unprocessed".into(),
                version: 1,
            })
            .into_iter()
            .collect()
    }
}

impl<const R: u8> tito::inbox::InboxModel for Matrix<R> {
    fn inbox_spec() -> tito::inbox::InboxSpec {
        let mut spec = tito::inbox::InboxSpec::new().payload("payload");
        if R & PROCESSED_AT != 0 {
            spec = spec.processed_at("processed_at");
        }
        if R & RETRY_AFTER != 0 {
            spec = spec.retry_after("retry_after");
        }
        if R & ATTEMPT != 0 {
            spec = spec.attempt("attempt");
        }
        if R & LOCKED_UNTIL != 0 {
            spec = spec.locked_until("locked_until");
        }
        spec
    }
}

/// Item 12: each outcome (Ack, Drop, Retry, RetryAfter) on a model with each combination of
/// the optional roles does what its documentation says, and a delay the model cannot carry
/// out (no `retry_after` role) is refused and changes nothing.
async fn outcome_matrix<E: TitoEngine, const R: u8>(db: &E) {
    let rows = db.clone().model::<Matrix<R>>();
    let inbox = Inbox::<E, Matrix<R>>::new(db.clone()).unwrap();
    let config = InboxConfig::<E, Matrix<R>>::new("m").lease(Duration::from_secs(600));
    let outcomes = [
        InboxOutcome::Ack,
        InboxOutcome::Drop,
        InboxOutcome::Retry,
        InboxOutcome::RetryAfter(Duration::from_secs(3600)),
    ];
    for (n, outcome) in outcomes.into_iter().enumerate() {
        let id = format!("row{n}");
        rows.build(Matrix::<R> {
            id: id.clone(),
            payload: Job { n: n as u32 },
            ..Default::default()
        })
        .await
        .unwrap();
        let claims = inbox.claim::<Job>(&config, 1).await.unwrap();
        assert_eq!(
            claims.len(),
            1,
            "roles {R}: {outcome:?}: the row is claimed"
        );
        let (claim, delivery) = claims.into_iter().next().unwrap();
        assert_eq!(delivery.id, id);
        let what = format!("roles {R:04b}, {outcome:?}");
        let applied = inbox.complete(&config, &claim, outcome).await;
        let stored = rows.find_by_id(&id, vec![]).await.ok();
        match outcome {
            InboxOutcome::Ack if R & PROCESSED_AT != 0 => {
                assert!(applied.unwrap(), "{what}");
                let row = stored.expect("an acknowledged row stays, processed");
                assert!(row.processed_at.is_some(), "{what}");
            }
            InboxOutcome::Ack | InboxOutcome::Drop => {
                assert!(applied.unwrap(), "{what}");
                assert!(stored.is_none(), "{what}: the row is deleted");
            }
            InboxOutcome::Retry => {
                assert!(applied.unwrap(), "{what}");
                assert!(stored.is_some(), "{what}");
                let again = inbox.claim::<Job>(&config, 1).await.unwrap();
                assert_eq!(again.len(), 1, "{what}: ready again at once");
                let (claim, delivery) = again.into_iter().next().unwrap();
                if R & ATTEMPT != 0 {
                    assert_eq!(delivery.attempt, 2, "{what}: the second attempt");
                }
                assert!(
                    inbox
                        .complete(&config, &claim, InboxOutcome::Drop)
                        .await
                        .unwrap()
                );
            }
            InboxOutcome::RetryAfter(_) if R & RETRY_AFTER != 0 => {
                assert!(applied.unwrap(), "{what}");
                let row = stored.expect("the row stays");
                let wait = row.retry_after - chrono::Utc::now().timestamp_millis();
                assert!(
                    (3_500_000..=3_600_000).contains(&wait),
                    "{what}: due in about an hour, not {wait} ms"
                );
                let again = inbox.claim::<Job>(&config, 1).await.unwrap();
                assert!(again.is_empty(), "{what}: not ready before its time");
                rows.delete_by_id(&id).await.unwrap();
            }
            InboxOutcome::RetryAfter(_) => {
                let err = applied.expect_err("a delay without a retry_after role is refused");
                assert!(
                    matches!(err, TitoError::InvalidArgument(_)),
                    "{what}: {err}"
                );
                assert!(err.to_string().contains("retry_after"), "{what}: {err}");
                assert!(stored.is_some(), "{what}: nothing changed");
                // Still leased: not handed out again before its lease ends.
                let again = inbox.claim::<Job>(&config, 1).await.unwrap();
                assert!(again.is_empty(), "{what}: still leased");
                // A zero delay is a plain retry, on every model.
                assert!(
                    inbox
                        .complete(&config, &claim, InboxOutcome::RetryAfter(Duration::ZERO))
                        .await
                        .unwrap(),
                    "{what}"
                );
                let again = inbox.claim::<Job>(&config, 1).await.unwrap();
                assert_eq!(again.len(), 1, "{what}: RetryAfter(0) is ready at once");
                let (claim, _) = again.into_iter().next().unwrap();
                assert!(
                    inbox
                        .complete(&config, &claim, InboxOutcome::Drop)
                        .await
                        .unwrap()
                );
            }
        }
    }
}

pub async fn every_inbox_outcome_against_every_combination_of_roles<E: TitoEngine>(ctx: Ctx<E>) {
    let db = &ctx.db;
    outcome_matrix::<E, 0>(db).await;
    outcome_matrix::<E, 1>(db).await;
    outcome_matrix::<E, 2>(db).await;
    outcome_matrix::<E, 3>(db).await;
    outcome_matrix::<E, 4>(db).await;
    outcome_matrix::<E, 5>(db).await;
    outcome_matrix::<E, 6>(db).await;
    outcome_matrix::<E, 7>(db).await;
    outcome_matrix::<E, 8>(db).await;
    outcome_matrix::<E, 9>(db).await;
    outcome_matrix::<E, 10>(db).await;
    outcome_matrix::<E, 11>(db).await;
    outcome_matrix::<E, 12>(db).await;
    outcome_matrix::<E, 13>(db).await;
    outcome_matrix::<E, 14>(db).await;
    outcome_matrix::<E, 15>(db).await;
}

/// What a worker of the wrong type expects: a field the stored events lack.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Other {
    pub name: String,
}

/// Item 4: a worker whose handler type does not match the stored events tries each row once,
/// counts and logs it once, leaves a note operators can see, and does not spin; a row can be
/// moved aside; a worker of the right type then runs the rest and the notes are swept.
pub async fn a_worker_of_the_wrong_type_costs_one_attempt_per_row<E: TitoEngine>(ctx: Ctx<E>) {
    let queue = Arc::new(tito::Queue::new(
        ctx.db.clone(),
        tito::QueueConfig::new(1, Duration::from_secs(3600)).topic("mismatch"),
    ));
    let mut keys = Vec::new();
    for n in 0..3 {
        let published = queue
            .publish(QueueEvent::new("k", Job { n }, now()).with_id(format!("job-{n}")))
            .await
            .unwrap();
        keys.push(published.key);
    }
    let called = Arc::new(AtomicUsize::new(0));
    let (stop, rx) = watch::channel(false);
    let handler = {
        let called = called.clone();
        move |_event: QueueEvent<Other>| {
            called.fetch_add(1, Ordering::SeqCst);
            async { Ok(QueueHandlerOutcome::Acknowledge) }
        }
    };
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..1),
        handler,
        rx,
    ));
    let q = queue.clone();
    wait_for("the three rows noted", Duration::from_secs(20), move || {
        let q = q.clone();
        async move { q.stats().malformed == 3 }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    let stats = queue.stats();
    assert_eq!(called.load(Ordering::SeqCst), 0);
    assert_eq!(stats.malformed, 3, "one attempt per row, not one per poll");
    // Idle polls only: a handful of scans a second, where it used to be over a thousand.
    assert!(stats.scans < 200, "{} scans", stats.scans);
    assert_eq!(pending_total(&queue).await, 3, "the rows stay pending");

    // Operators see which rows a worker could not decode, and as what.
    let page = tito::inspect::queue_scan(
        &ctx.db,
        Some("mismatch"),
        tito::inspect::QueueState::Pending(0),
        None,
        10,
    )
    .await
    .unwrap();
    assert_eq!(page.items.len(), 3);
    for row in &page.items {
        let note = row.undecodable.as_ref().expect("a note on every row");
        assert!(note.type_name.ends_with("Other"), "{}", note.type_name);
        assert!(note.error.contains("name"), "{}", note.error);
    }

    // One is moved aside: it leaves the partition, its id is free, and it is listed aside.
    assert!(queue.set_aside(&keys[0], "wrong type").await.unwrap());
    assert!(!queue.set_aside(&keys[0], "again").await.unwrap());
    assert!(matches!(
        queue.set_aside("queue:pending:nonsense", "x").await,
        Err(TitoError::InvalidArgument(_))
    ));
    assert_eq!(pending_total(&queue).await, 2);
    let aside = tito::inspect::queue_aside(&ctx.db, Some("mismatch"), None, 10)
        .await
        .unwrap();
    assert_eq!(aside.items.len(), 1);
    let record = aside.items[0].record.as_ref().unwrap();
    assert_eq!(record.why, "wrong type");
    assert_eq!(record.row["id"], "job-0");
    let again = queue
        .publish(QueueEvent::new("k", Job { n: 0 }, now()).with_id("job-0"))
        .await
        .unwrap();
    assert!(
        !again.duplicate,
        "the id of a row set aside may be published again"
    );

    // A worker of the right type runs the rest; the notes of rows that are gone are swept.
    let (stop, rx) = watch::channel(false);
    let worker = tokio::spawn(run_worker(
        queue.clone(),
        WorkerConfig::new(0..1).max_idle_backoff(Duration::from_millis(20)),
        |_event: QueueEvent<Job>| async { Ok(QueueHandlerOutcome::Acknowledge) },
        rx,
    ));
    drained(&queue, "the right worker to run the rest").await;
    stop.send(true).unwrap();
    worker.await.unwrap().unwrap();
    // The worker's maintenance sweeps notes too; whatever it left, a sweep takes.
    let swept = queue.sweep_undecodable().await.unwrap();
    assert!(swept <= 2, "{swept} notes swept, only two rows ran");
    assert_eq!(queue.sweep_undecodable().await.unwrap(), 0);
    let root = tito::keys::queue_root(Some("mismatch"));
    let prefix = tito::keys::undecodable_prefix(&root);
    let tx = ctx.db.begin().await.unwrap();
    let notes = tx
        .scan(
            prefix.as_bytes(),
            tito::keys::prefix_end(prefix.clone()).as_bytes(),
            10,
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(notes.is_empty(), "notes left: {notes:?}");
}

// ---------------------------------------------------------------------------------------------
// Two stores in one process share nothing: each has its own schema catalog state and its own
// inbox subscriptions (they live on the store's handle, not in process statics).
// ---------------------------------------------------------------------------------------------

async fn two_stores_share_nothing<E: TitoEngine>(a: E, b: E) {
    tito::schema::set_write_grace(&a, Duration::from_millis(50)).unwrap();
    // The write grace is the store's: b keeps the default, a wrapper of a sees a's.
    assert_eq!(
        tito::schema::write_grace(&b),
        tito::schema::DEFAULT_WRITE_GRACE
    );
    assert_eq!(
        tito::schema::write_grace(&FaultyEngine::new(a.clone())),
        Duration::from_millis(50)
    );
    // Store a: the first deploy writes a row, the next one adds an index: building there.
    let old = a.clone().model::<RaceOld<40>>();
    old.build(RaceOld {
        id: "1".into(),
        team: "core".into(),
    })
    .await
    .unwrap();
    let on_a = a.clone().model::<RaceNew<40>>();
    assert_eq!(
        on_a.schema().await.unwrap().indexes[0].state,
        IndexState::Building
    );
    // Store b: the same model's first registration on an empty table: ready, from its own
    // catalog (a's cached handle and catalog are not reused).
    let on_b = b.clone().model::<RaceNew<40>>();
    assert_eq!(
        on_b.schema().await.unwrap().indexes[0].state,
        IndexState::Ready
    );
    assert_eq!(
        on_b.query_by_index("by_team")
            .value("core")
            .execute()
            .await
            .unwrap()
            .items
            .len(),
        0
    );
    assert!(matches!(
        on_a.query_by_index("by_team").value("core").execute().await,
        Err(TitoError::IndexNotReady { .. })
    ));

    // One subscription per (model, group) per store: the same group on both stores runs; a
    // second one on store a (also through a wrapper of it) is refused.
    let subscribe = |db: E| {
        let (stop, rx) = watch::channel(false);
        let inbox = Arc::new(Inbox::<E, Task>::new(db).unwrap());
        let task = tokio::spawn(run_inbox(
            inbox,
            InboxConfig::new("g").max_idle(Duration::from_millis(20)),
            |_d: InboxDelivery<Job>| async { Ok(InboxOutcome::Ack) },
            rx,
        ));
        (stop, task)
    };
    let (stop_a, task_a) = subscribe(a.clone());
    let (stop_b, task_b) = subscribe(b.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!task_a.is_finished() && !task_b.is_finished(), "both run");
    let faulty = FaultyEngine::new(a.clone());
    let inbox = Arc::new(Inbox::<_, Task>::new(faulty).unwrap());
    let (_stop, rx) = watch::channel(false);
    let again = run_inbox(
        inbox,
        InboxConfig::new("g"),
        |_d: InboxDelivery<Job>| async { Ok(InboxOutcome::Ack) },
        rx,
    )
    .await;
    assert!(
        matches!(again, Err(TitoError::AlreadySubscribed(_))),
        "{again:?}"
    );
    stop_a.send(true).unwrap();
    stop_b.send(true).unwrap();
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_embedded_stores_share_nothing() {
    let a = tito::backend::embedded::Embedded::temporary()
        .await
        .unwrap();
    let b = tito::backend::embedded::Embedded::temporary()
        .await
        .unwrap();
    two_stores_share_nothing(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_memory_stores_share_nothing() {
    two_stores_share_nothing(
        tito::backend::memory::Memory::new(),
        tito::backend::memory::Memory::new(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tikv_stores_share_nothing() {
    let a = crate::support::test_server_ctx().await;
    let b = crate::support::test_server_ctx().await;
    two_stores_share_nothing(a.db.clone(), b.db.clone()).await;
}
