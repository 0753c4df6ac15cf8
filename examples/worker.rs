//! A queue worker: signups write a user and publish a welcome email in the same transaction; a
//! worker sends each email (the first attempt of one of them fails, and the worker's failure
//! policy retries it after a backoff as attempt 2), reschedules a follow-up a second later, and
//! shuts down cleanly once everything is done.
//!
//! `cargo run --example worker` (embedded), or with `TITO_PD_ENDPOINTS` set, on TiKV.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::model::{TitoOperation, TitoOptions};
use tito::queue::{FailurePolicy, ModelEvent, run_worker};
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel,
    WorkerConfig,
};

/// A user; every write publishes a `ModelEvent<User>` to the queue named `signup` (here stated
/// as the seed's samples do, `TitoOptions::with_events(TitoOperation::Insert)`).
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(index = "user_by_email: email")]
#[tito(event = "signup")]
struct User {
    id: String,
    email: String,
}

/// What the signup queue carries: the model event of a user write.
type Signup = ModelEvent<User>;

#[tokio::main]
async fn main() -> Result<(), TitoError> {
    match std::env::var("TITO_PD_ENDPOINTS") {
        Ok(endpoints) => {
            let endpoints: Vec<String> = endpoints.split(',').map(str::to_string).collect();
            run(TiKV::connect(endpoints).await?).await
        }
        Err(_) => run(Embedded::temporary().await?).await,
    }
}

async fn run<E: TitoEngine>(db: E) -> Result<(), TitoError> {
    let users = db.clone().model::<User>();
    for (id, email) in [
        ("1", "ada@example.com"),
        ("2", "grace@example.com"),
        ("3", "edsger@example.com"),
    ] {
        let users = users.clone();
        let user = User {
            id: id.into(),
            email: email.into(),
        };
        // The user row and its `signup` event commit together, or neither does.
        db.transaction(|tx| async move {
            users
                .build_with_options(user, TitoOptions::with_events(TitoOperation::Insert), &tx)
                .await
        })
        .await?;
    }

    let signups = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(db.partitions(), Duration::from_secs(24 * 60 * 60)).topic("signup"),
    ));
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let failed_once: Arc<Mutex<HashSet<String>>> = Arc::default();
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let worker = {
        let (sent, failed_once) = (sent.clone(), failed_once.clone());
        tokio::spawn(run_worker(
            signups.clone(),
            WorkerConfig::new(0..db.partitions())
                .max_idle_backoff(Duration::from_millis(200))
                // Three attempts, backing off from 200 ms (due times are whole seconds: the
                // retry runs at the next second), then the dead state.
                .failure_policy(
                    FailurePolicy::new(3)
                        .backoff(Duration::from_millis(200), Duration::from_secs(5)),
                ),
            move |event: QueueEvent<Signup>| {
                let (sent, failed_once) = (sent.clone(), failed_once.clone());
                async move {
                    let email = event.payload.row.email.clone();
                    // Pretend the mail server refuses Grace's first message: the policy
                    // retries it after its backoff, as attempt 2.
                    if email.starts_with("grace")
                        && failed_once.lock().unwrap().insert(email.clone())
                    {
                        println!(
                            "sending to {email} failed at attempt {}; retried after a backoff",
                            event.attempt
                        );
                        return Err(TitoError::handler("mail server unavailable"));
                    }
                    // The first delivery is the welcome mail; the rescheduled one is the follow-up.
                    let follow_up = !sent.lock().unwrap().iter().any(|s| s == &email);
                    sent.lock().unwrap().push(email.clone());
                    if follow_up {
                        println!("welcome mail sent to {email}; follow-up scheduled in a second");
                        let at = chrono::Utc::now().timestamp() + 1;
                        Ok(QueueHandlerOutcome::Reschedule(event.rescheduled(at)))
                    } else {
                        println!("follow-up mail sent to {email}");
                        Ok(QueueHandlerOutcome::Acknowledge)
                    }
                }
                .boxed()
            },
            shutdown_rx,
        ))
    };

    // Three welcome mails and three follow-ups.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sent.lock().unwrap().len() < 6 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker did not finish in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown_tx.send(true).ok();
    worker.await.expect("the worker task")?;

    let stats = signups.stats();
    println!(
        "delivered {}, acknowledged {}, rescheduled {}, failed {}, completed rows kept {}",
        stats.delivered,
        stats.acknowledged,
        stats.rescheduled,
        stats.failed,
        signups.completed_count().await?
    );
    Ok(())
}
