//! An inbox: the service's own `email_job` rows are its queue. Urgent mail goes first, a
//! delayed job waits for its time, a bouncing address is retried with a delay and lands in the
//! `email-dead` group after three attempts, and each sent job keeps its row with `processed_at`.
//!
//! `cargo run --example inbox` (embedded), or with `TITO_PD_ENDPOINTS` set, on TiKV.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::inbox::{DeadLetter, Inbox, InboxConfig, InboxDelivery, InboxOutcome, run_inbox};
use tito::{TitoEngine, TitoError, TitoModel};

#[derive(Default, Clone, Debug, Serialize, Deserialize)]
struct Email {
    to: String,
    subject: String,
}

/// The service's table; the roles tell the inbox how to read it.
#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(inbox)]
#[tito(index = "email_job_by_recipient: recipient")]
struct EmailJob {
    id: String,
    recipient: String,
    #[tito(group)]
    queue: String,
    #[tito(priority)]
    priority: i64,
    #[tito(retry_after)]
    retry_after: i64,
    #[tito(attempt)]
    attempt: i64,
    #[tito(processed_at)]
    processed_at: Option<i64>,
    #[tito(locked_until)]
    locked_until: Option<i64>,
    #[tito(headers)]
    headers: BTreeMap<String, String>,
    #[tito(payload)]
    email: Email,
}

fn job(id: &str, to: &str, priority: i64, delay_ms: i64) -> EmailJob {
    EmailJob {
        id: id.into(),
        recipient: to.into(),
        queue: "email".into(),
        priority,
        retry_after: if delay_ms > 0 {
            chrono::Utc::now().timestamp_millis() + delay_ms
        } else {
            0
        },
        headers: BTreeMap::from([("campaign".to_string(), "welcome".to_string())]),
        email: Email {
            to: to.into(),
            subject: format!("hello {to}"),
        },
        ..Default::default()
    }
}

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
    let jobs = db.clone().model::<EmailJob>();
    // The service writes its rows as it always does.
    jobs.build(job("1", "ada@example.com", 5, 0)).await?;
    jobs.build(job("2", "urgent@example.com", 0, 0)).await?;
    jobs.build(job("3", "bounce@example.com", 5, 0)).await?;
    jobs.build(job("4", "later@example.com", 0, 800)).await?;

    let inbox = Arc::new(Inbox::<E, EmailJob>::new(db.clone())?);
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let config = InboxConfig::new("email")
        .concurrency(1)
        .max_attempts(3)
        .dead_letter(DeadLetter::Group("email-dead".into()))
        .max_idle(Duration::from_millis(50));
    let subscription = {
        let sent = sent.clone();
        tokio::spawn(run_inbox(
            inbox.clone(),
            config,
            move |delivery: InboxDelivery<Email>| {
                let sent = sent.clone();
                async move {
                    if delivery.payload.to.starts_with("bounce") {
                        println!(
                            "attempt {} to {} bounced; retrying in 100 ms",
                            delivery.attempt, delivery.payload.to
                        );
                        return Ok(InboxOutcome::RetryAfter(Duration::from_millis(100)));
                    }
                    println!(
                        "sent '{}' to {} (campaign {})",
                        delivery.payload.subject,
                        delivery.payload.to,
                        delivery
                            .headers
                            .get("campaign")
                            .map(String::as_str)
                            .unwrap_or("-")
                    );
                    sent.lock().unwrap().push(delivery.id);
                    Ok(InboxOutcome::Ack)
                }
            },
            shutdown_rx,
        ))
    };

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let dead = jobs.find_by_id("3", vec![]).await?.queue == "email-dead";
        if sent.lock().unwrap().len() == 3 && dead {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the inbox did not drain in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown_tx.send(true).ok();
    subscription.await.expect("the subscription task")?;

    println!("sent in order: {:?}", sent.lock().unwrap());
    let bounced = jobs.find_by_id("3", vec![]).await?;
    println!(
        "job 3 is in group '{}' after {} attempts",
        bounced.queue, bounced.attempt
    );
    let ada = jobs.find_by_id("1", vec![]).await?;
    println!(
        "job 1 processed at {:?} (its row stays, with its own index)",
        ada.processed_at
    );
    Ok(())
}
