//! Raw transactions: an embedded store, a transaction with replay on conflict, point reads and
//! a range scan over plain byte keys (the storage contract models and queues are built on). Run
//! it with `cargo run --example transactions`.
//!
//! Point `TITO_PD_ENDPOINTS` at a PD cluster (e.g. `127.0.0.1:2379`) to run the same program on
//! TiKV instead.

use tito::backend::embedded::Embedded;
use tito::backend::tikv::TiKV;
use tito::{TitoEngine, TitoError, TitoTransaction};

#[tokio::main]
async fn main() -> Result<(), TitoError> {
    match std::env::var("TITO_PD_ENDPOINTS") {
        Ok(endpoints) => {
            let endpoints: Vec<String> = endpoints.split(',').map(str::to_string).collect();
            println!("running on TiKV at {endpoints:?}");
            run(TiKV::connect(endpoints).await?).await
        }
        Err(_) => {
            let db = Embedded::temporary().await?;
            println!("running on an embedded store in {}", db.path().display());
            run(db).await
        }
    }
}

async fn run(db: impl TitoEngine) -> Result<(), TitoError> {
    // Write three accounts atomically. The closure may run again if another transaction
    // conflicts with it; it never runs again once a commit may have happened.
    db.transaction(|tx| async move {
        for (id, balance) in [("alice", 100), ("bob", 50), ("carol", 75)] {
            tx.put(
                format!("account:{id}").into_bytes(),
                balance.to_string().into_bytes(),
            )
            .await?;
        }
        Ok::<_, TitoError>(())
    })
    .await?;

    // Move 30 from alice to bob: read, check, write, all in one snapshot.
    let moved = db
        .transaction(|tx| async move {
            let alice = balance(&tx, "alice").await?;
            if alice < 30 {
                return Ok(false);
            }
            let bob = balance(&tx, "bob").await?;
            tx.put(
                b"account:alice".to_vec(),
                (alice - 30).to_string().into_bytes(),
            )
            .await?;
            tx.put(b"account:bob".to_vec(), (bob + 30).to_string().into_bytes())
                .await?;
            Ok::<_, TitoError>(true)
        })
        .await?;
    println!("transfer applied: {moved}");

    // Scan every account in key order, in one read transaction.
    let tx = db.begin().await?;
    let end = tito::prefix_end("account:".to_string());
    for (key, value) in tx.scan(b"account:", end.as_bytes(), 100).await? {
        println!(
            "{} = {}",
            String::from_utf8_lossy(&key),
            String::from_utf8_lossy(&value)
        );
    }
    println!("read at version {}", tx.start_version());
    tx.rollback().await?;
    Ok(())
}

async fn balance(tx: &impl TitoTransaction, id: &str) -> Result<i64, TitoError> {
    let raw = tx
        .get(format!("account:{id}").as_bytes())
        .await?
        .ok_or_else(|| TitoError::invalid_argument(format!("no account {id}")))?;
    String::from_utf8_lossy(&raw)
        .parse()
        .map_err(|_| TitoError::Integrity(format!("account {id} holds a malformed balance")))
}
