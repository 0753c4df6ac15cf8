//! Exactly-once effects from an at-least-once queue: a transactional handler records an
//! idempotency marker in the key/value store, credits a wallet (a model) and acknowledges the
//! event, all in one transaction. A payment published twice with one event id (the queue keeps
//! one invocation), published again under a new event id (the marker, keyed by the payment,
//! stops the second credit), and a handler that fails after its effect all end with one credit
//! each.
//!
//! `cargo run --example idempotent` (embedded), or with `TITO_PD_ENDPOINTS` set, on TiKV.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::kv::Kv;
use tito::model::TitoOptions;
use tito::queue::run_transactional_worker;
use tito::{
    Queue, QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoError, TitoModel,
    WorkerConfig,
};

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
struct Wallet {
    id: String,
    balance_cents: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Payment {
    /// The business id the idempotency marker is keyed by.
    payment: String,
    wallet: String,
    cents: i64,
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
    let wallets = db.clone().model::<Wallet>();
    wallets
        .build(Wallet {
            id: "ada".into(),
            balance_cents: 0,
        })
        .await?;
    let payments = Arc::new(Queue::new(
        db.clone(),
        QueueConfig::new(4, Duration::from_secs(24 * 60 * 60)).topic("payments"),
    ));

    let now = chrono::Utc::now().timestamp();
    let payment = |payment: &str, cents: i64| Payment {
        payment: payment.into(),
        wallet: "ada".into(),
        cents,
    };
    let first = QueueEvent::new("wallet:ada", payment("p-1", 1_000), now).with_id("evt-p-1");
    payments.publish(first.clone()).await?;
    // The producer retried with the same event id: the queue keeps one invocation.
    let again = payments.publish(first.clone()).await?;
    println!("published evt-p-1 again: duplicate = {}", again.duplicate);
    // A producer that lost the event id publishes the same payment under a new one.
    payments
        .publish(QueueEvent::new("wallet:ada", payment("p-1", 1_000), now).with_id("evt-p-1b"))
        .await?;
    payments
        .publish(QueueEvent::new("wallet:ada", payment("p-2", 250), now).with_id("evt-p-2"))
        .await?;

    let kv = Kv::new(db.clone());
    let crash_once = Arc::new(AtomicBool::new(true));
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let worker = {
        let (wallets, kv, crash_once) = (wallets.clone(), kv.clone(), crash_once.clone());
        tokio::spawn(run_transactional_worker(
            payments.clone(),
            // One at a time so the printed story is in order; with more, a conflict replays
            // a transaction and its handler (its storage effects still apply once).
            WorkerConfig::new(0..4)
                .concurrency(1)
                .max_idle_backoff(Duration::from_millis(100)),
            move |event: QueueEvent<Payment>, tx: E::Transaction| {
                let (wallets, kv, crash_once) = (wallets.clone(), kv.clone(), crash_once.clone());
                async move {
                    // The marker, the credit and the acknowledgement commit together.
                    let marker = kv
                        .put_if_absent_in_tx(
                            "payments-applied",
                            &event.payload.payment,
                            &event.payload,
                            None,
                            &tx,
                        )
                        .await?;
                    if marker.is_none() {
                        println!(
                            "{}: payment {} seen before, acknowledged without effect",
                            event.id, event.payload.payment
                        );
                        return Ok(QueueHandlerOutcome::Acknowledge);
                    }
                    let mut wallet = wallets.find_by_id_in_tx(&event.payload.wallet, &tx).await?;
                    wallet.balance_cents += event.payload.cents;
                    wallets
                        .update_with_options(wallet, TitoOptions::default(), &tx)
                        .await?;
                    if event.payload.cents == 250 && crash_once.swap(false, Ordering::SeqCst) {
                        // Fails after its effect: the credit and the marker roll back with it.
                        println!(
                            "{}: payment {} failed after crediting: rolled back, stays pending",
                            event.id, event.payload.payment
                        );
                        return Err(TitoError::handler("downstream receipt service unavailable"));
                    }
                    println!(
                        "{}: payment {} credited {} cents",
                        event.id, event.payload.payment, event.payload.cents
                    );
                    Ok(QueueHandlerOutcome::Acknowledge)
                }
            },
            shutdown_rx,
        ))
    };

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while payments.completed_count().await? < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the payments did not complete in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown_tx.send(true).ok();
    worker.await.expect("the worker task")?;

    let balance = wallets.find_by_id("ada", vec![]).await?.balance_cents;
    println!("ada's balance: {balance} cents (1000 + 250, each once)");
    assert_eq!(balance, 1_250);
    Ok(())
}
