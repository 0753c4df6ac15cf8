//! `TitoEngine::transaction`: replay after conflicts, never after an unknown outcome, rollback
//! on error and on cancellation. Failures are injected with `FaultyEngine` around each backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tito::backend::embedded::Embedded;
use tito::engine::{Fault, FaultPoint, FaultRule, FaultyEngine};
use tito::{RetryPolicy, TitoEngine, TitoError, TitoTransaction};

use crate::support::{Ctx, read};

/// Runs every case of this suite on one backend.
#[macro_export]
macro_rules! transactions_suite {
    ($backend:ty) => {
        $crate::engine_suite!(
            $backend,
            transactions,
            [
                conflicts_are_replayed_until_the_commit_goes_through,
                exhausted_retries_say_how_many_attempts_ran,
                an_unknown_outcome_is_never_replayed,
                a_closure_error_rolls_back_and_comes_back_unchanged,
                a_non_retryable_commit_failure_is_returned_at_once,
                fault_rules_skip_and_filter_by_key,
                each_attempt_starts_from_the_captured_values,
                an_async_closure_borrows_its_surroundings_and_is_replayed,
                a_borrowing_transaction_runs_in_a_spawned_task_of_generic_code,
            ]
        );
    };
}

mod embedded {
    crate::transactions_suite!(crate::support::EmbeddedBackend);
}

mod tikv {
    crate::transactions_suite!(crate::support::TikvBackend);
}

mod tikv_tls {
    crate::transactions_suite!(crate::support::TikvTlsBackend);
}

mod tikv_keyspaces {
    crate::transactions_suite!(crate::support::TikvKeyspacesBackend);
}

fn faulty<E: TitoEngine>(ctx: &Ctx<E>) -> FaultyEngine<E> {
    FaultyEngine::new(ctx.db.clone())
}

/// Runs a transaction that counts its attempts and writes `key`.
async fn counted_write<E: TitoEngine>(
    db: &E,
    policy: RetryPolicy,
    key: Vec<u8>,
) -> (Result<(), TitoError>, u32) {
    let runs = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&runs);
    let result = db
        .transaction_with(policy, |tx| async move {
            counter.fetch_add(1, Ordering::SeqCst);
            tx.put(key, b"v".to_vec()).await
        })
        .await;
    (result, runs.load(Ordering::SeqCst))
}

pub async fn conflicts_are_replayed_until_the_commit_goes_through<E: TitoEngine>(ctx: Ctx<E>) {
    let db = faulty(&ctx);
    db.faults()
        .add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).times(3));
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("k")).await;
    result.unwrap();
    assert_eq!(runs, 4, "three injected conflicts mean three replays");
    assert_eq!(db.faults().calls(FaultPoint::Commit), 4);
    assert_eq!(read(&db, &ctx.key("k")).await.as_deref(), Some(&b"v"[..]));
}

pub async fn exhausted_retries_say_how_many_attempts_ran<E: TitoEngine>(ctx: Ctx<E>) {
    let db = faulty(&ctx);
    db.faults()
        .add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).always());
    let policy = RetryPolicy::default()
        .max_attempts(3)
        .initial_backoff(Duration::from_millis(1));
    let (result, runs) = counted_write(&db, policy, ctx.key("k")).await;
    let err = result.unwrap_err();
    assert!(
        matches!(err, TitoError::RetriesExhausted { attempts: 3, .. }),
        "got {err:?}"
    );
    assert!(err.to_string().contains("3 attempts"), "{err}");
    assert_eq!(runs, 3);
    assert_eq!(read(&db, &ctx.key("k")).await, None);
}

pub async fn an_unknown_outcome_is_never_replayed<E: TitoEngine>(ctx: Ctx<E>) {
    // The commit applied but its reply was lost.
    let db = faulty(&ctx);
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeCommitted,
    ));
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("applied")).await;
    assert!(
        matches!(result, Err(TitoError::CommitOutcomeUnknown { .. })),
        "got {result:?}"
    );
    assert_eq!(runs, 1);
    assert_eq!(
        read(&db, &ctx.key("applied")).await.as_deref(),
        Some(&b"v"[..])
    );

    // The commit request was lost.
    db.faults().add(FaultRule::new(
        FaultPoint::Commit,
        Fault::UnknownOutcomeNotCommitted,
    ));
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("lost")).await;
    assert!(
        matches!(result, Err(TitoError::CommitOutcomeUnknown { .. })),
        "got {result:?}"
    );
    assert!(!result.unwrap_err().is_retryable());
    assert_eq!(runs, 1);
    assert_eq!(read(&db, &ctx.key("lost")).await, None);
}

pub async fn a_closure_error_rolls_back_and_comes_back_unchanged<E: TitoEngine>(ctx: Ctx<E>) {
    #[derive(Debug)]
    enum AppError {
        OutOfStock(u32),
        Store(TitoError),
    }
    impl From<TitoError> for AppError {
        fn from(err: TitoError) -> Self {
            AppError::Store(err)
        }
    }

    let db = faulty(&ctx);
    let runs = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&runs);
    let key = ctx.key("reserved");
    let result = db
        .transaction(|tx| async move {
            counter.fetch_add(1, Ordering::SeqCst);
            tx.put(key, b"1".to_vec()).await?;
            Err::<(), _>(AppError::OutOfStock(7))
        })
        .await;
    assert!(
        matches!(result, Err(AppError::OutOfStock(7))),
        "got {result:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a closure error is not retried"
    );
    assert_eq!(db.faults().calls(FaultPoint::Commit), 0);
    assert_eq!(read(&db, &ctx.key("reserved")).await, None);

    // A store error inside the closure arrives through From<TitoError>.
    db.faults()
        .add(FaultRule::new(FaultPoint::Put, Fault::Storage));
    let key = ctx.key("x");
    let result = db
        .transaction(|tx| async move { tx.put(key, b"1".to_vec()).await.map_err(AppError::from) })
        .await;
    assert!(
        matches!(result, Err(AppError::Store(TitoError::Storage { .. }))),
        "got {result:?}"
    );
}

pub async fn a_non_retryable_commit_failure_is_returned_at_once<E: TitoEngine>(ctx: Ctx<E>) {
    let db = faulty(&ctx);
    db.faults()
        .add(FaultRule::new(FaultPoint::Commit, Fault::Storage));
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("k")).await;
    assert!(
        matches!(result, Err(TitoError::Storage { .. })),
        "got {result:?}"
    );
    assert_eq!(runs, 1);
    assert_eq!(read(&db, &ctx.key("k")).await, None);
}

pub async fn fault_rules_skip_and_filter_by_key<E: TitoEngine>(ctx: Ctx<E>) {
    let db = faulty(&ctx);
    // Only the second commit that writes a `queue:` key conflicts.
    db.faults().add(
        FaultRule::new(FaultPoint::Commit, Fault::Conflict)
            .skip(1)
            .when_key_starts_with(ctx.key("queue:")),
    );
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("table:a")).await;
    result.unwrap();
    assert_eq!(runs, 1);
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("queue:a")).await;
    result.unwrap();
    assert_eq!(runs, 1, "the first matching commit is skipped");
    let (result, runs) = counted_write(&db, RetryPolicy::default(), ctx.key("queue:b")).await;
    result.unwrap();
    assert_eq!(runs, 2, "the second matching commit conflicts once");
    assert_eq!(db.faults().injected(), 1);
}

pub async fn each_attempt_starts_from_the_captured_values<E: TitoEngine>(ctx: Ctx<E>) {
    // The closure is cloned per attempt: a value moved into the async block is the original on
    // every attempt (this is what lets `build_with_options(user, ..)` be replayed).
    let db = faulty(&ctx);
    db.faults()
        .add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).times(2));
    let mut payload = vec![1u8, 2, 3];
    payload.push(4);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let key = ctx.key("p");
    db.transaction(|tx| async move {
        let mut payload = payload;
        log.lock().unwrap().push(payload.clone());
        payload.push(9);
        tx.put(key, payload).await
    })
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![vec![1, 2, 3, 4]; 3]);
    assert_eq!(read(&db, &ctx.key("p")).await, Some(vec![1, 2, 3, 4, 9]));
}

#[tokio::test(flavor = "current_thread")]
async fn embedded_transactions_work_on_a_current_thread_runtime() {
    let db = Embedded::temporary().await.unwrap();
    db.transaction(|tx| async move { tx.put(b"k".to_vec(), b"v".to_vec()).await })
        .await
        .unwrap();
    assert_eq!(read(&db, b"k").await.as_deref(), Some(&b"v"[..]));
}

#[tokio::test(flavor = "current_thread")]
async fn tikv_transactions_work_on_a_current_thread_runtime() {
    let ctx = crate::support::test_server_ctx().await;
    ctx.db
        .transaction(|tx| async move { tx.put(b"t:k".to_vec(), b"v".to_vec()).await })
        .await
        .unwrap();
    assert_eq!(read(&ctx.db, b"t:k").await.as_deref(), Some(&b"v"[..]));
}

#[derive(
    tito::TitoModel, Default, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize,
)]
#[tito(table = "tx_account")]
#[tito(index = "tx_account_by_owner: owner")]
pub struct Account {
    pub id: String,
    pub owner: String,
    pub cents: i64,
}

/// Moves `cents` from one account to another, borrowing the model handle, the ids and an
/// attempt counter from the caller: no clone by hand.
async fn transfer<E: TitoEngine>(
    db: &E,
    accounts: &tito::TitoModel<E, Account>,
    from: &str,
    to: &str,
    cents: i64,
    attempts: &AtomicU32,
) -> Result<i64, TitoError> {
    db.transaction(async |tx| {
        attempts.fetch_add(1, Ordering::SeqCst);
        let mut a = accounts.find_by_id_in_tx(from, &tx).await?;
        let mut b = accounts.find_by_id_in_tx(to, &tx).await?;
        a.cents -= cents;
        b.cents += cents;
        let left = a.cents;
        accounts
            .update_with_options(a, tito::TitoOptions::default(), &tx)
            .await?;
        accounts
            .update_with_options(b, tito::TitoOptions::default(), &tx)
            .await?;
        Ok(left)
    })
    .await
}

pub async fn an_async_closure_borrows_its_surroundings_and_is_replayed<E: TitoEngine>(ctx: Ctx<E>) {
    let db = faulty(&ctx);
    let accounts = db.clone().model::<Account>();
    let (from, to) = (format!("a-{}", ctx.key("x").len()), "b".to_string());
    for (id, cents) in [(&from, 100), (&to, 0)] {
        accounts
            .build(Account {
                id: id.clone(),
                owner: "o".into(),
                cents,
            })
            .await
            .unwrap();
    }
    // Two conflicting commits: the closure runs three times, each from the borrowed values and
    // the store as it is, and the transfer applies once.
    db.faults()
        .add(FaultRule::new(FaultPoint::Commit, Fault::Conflict).times(2));
    let attempts = AtomicU32::new(0);
    let left = transfer(&db, &accounts, &from, &to, 30, &attempts)
        .await
        .unwrap();
    assert_eq!((left, attempts.load(Ordering::SeqCst)), (70, 3));
    let b = accounts.find_by_id(&to, vec![]).await.unwrap();
    assert_eq!(b.cents, 30);
    // An error from the closure rolls back and comes back as it was.
    let err = transfer(&db, &accounts, &from, "missing", 30, &attempts)
        .await
        .unwrap_err();
    assert!(matches!(err, TitoError::NotFound(_)), "{err:?}");
    assert_eq!(accounts.find_by_id(&from, vec![]).await.unwrap().cents, 70);
}

pub async fn a_borrowing_transaction_runs_in_a_spawned_task_of_generic_code<E: TitoEngine>(
    ctx: Ctx<E>,
) {
    // Generic code over `E` spawning a task whose transaction borrows the task's locals: the
    // future must be `Send` for `tokio::spawn`, which rustc proves for the boxed future.
    let db = ctx.db.clone();
    let task = tokio::spawn(async move {
        let accounts = db.clone().model::<Account>();
        let id = format!("spawned-{}", QueueEventId::next());
        accounts
            .build(Account {
                id: id.clone(),
                owner: "s".into(),
                cents: 5,
            })
            .await?;
        let attempts = AtomicU32::new(0);
        let doubled = db
            .transaction(async |tx| {
                attempts.fetch_add(1, Ordering::SeqCst);
                let mut a = accounts.find_by_id_in_tx(&id, &tx).await?;
                a.cents *= 2;
                let cents = a.cents;
                accounts
                    .update_with_options(a, tito::TitoOptions::default(), &tx)
                    .await?;
                Ok::<_, TitoError>(cents)
            })
            .await?;
        Ok::<_, TitoError>((doubled, attempts.load(Ordering::SeqCst)))
    });
    assert_eq!(task.await.unwrap().unwrap(), (10, 1));
}

/// A fresh id per call.
struct QueueEventId;

impl QueueEventId {
    fn next() -> String {
        tito::QueueEvent::now("k", ()).id
    }
}
