//! Quickstart: a derived model with a unique and a composite index, typed index queries, and an
//! event that every write publishes in its own transaction, handled by a worker typed by the
//! event.
//!
//! `cargo run --example quickstart` runs on an embedded store; with `TITO_PD_ENDPOINTS` set
//! (e.g. `127.0.0.1:2379`), the same program runs on TiKV.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tito::backend::{embedded::Embedded, tikv::TiKV};
use tito::{QueueHandlerOutcome, TitoEngine, TitoError, TitoModel, WorkerConfig, Workers};

#[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
#[tito(unique_index = "by_email: email")]
#[tito(index = "by_team_created: team, created_at")]
#[tito(event = "member")] // every write publishes a ModelEvent<Member> to queue "member"
struct Member {
    id: String,
    email: String,
    team: String,
    created_at: i64, // set from the transaction's time on insert
}

#[tokio::main]
async fn main() -> Result<(), TitoError> {
    match std::env::var("TITO_PD_ENDPOINTS") {
        Ok(pd) => run(TiKV::connect(pd.split(',').map(str::to_string).collect()).await?).await,
        Err(_) => run(Embedded::temporary().await?).await,
    }
}

async fn run<E: TitoEngine>(db: E) -> Result<(), TitoError> {
    let members = db.clone().model::<Member>();
    for (id, email) in [("1", "ada@example.com"), ("2", "grace@example.com")] {
        let member = Member {
            id: id.into(),
            email: email.into(),
            team: "core".into(),
            created_at: 0,
        };
        // The row, its index entries and its event commit together, or not at all.
        members.upsert(member).await?;
    }

    // Typed queries, one method per index: wrong types do not compile.
    let ada = members.by_email("ada@example.com").execute().await?;
    println!("by email: {:?}", ada.items.first().map(|u| &u.id));
    let newest = members
        .by_team_created("core")
        .reverse(true)
        .limit(Some(10))
        .execute()
        .await?;
    println!(
        "newest in core: {:?}",
        newest.items.iter().map(|u| &u.email).collect::<Vec<_>>()
    );

    // A worker on the event's queue: the derive's `Member::MEMBER_EVENT` names the queue and
    // types the handler (a `QueueEvent<ModelEvent<Member>>`; any other type does not compile).
    // Declared once (partitions, completed-row retention; limits, a failure policy and periodic
    // jobs would go here too), opened on the store.
    let queue = Member::MEMBER_EVENT
        .spec(db.partitions(), Duration::from_secs(3600))
        .open(db.clone())
        .await?;
    let (done, mut welcomed) = tokio::sync::mpsc::unbounded_channel();
    let mut workers = Workers::new();
    workers.spawn_worker(
        &queue,
        WorkerConfig::new(0..db.partitions()),
        move |event| {
            let done = done.clone();
            async move {
                println!("welcome mail to {}", event.payload.row.email);
                done.send(()).ok();
                Ok(QueueHandlerOutcome::Acknowledge)
            }
        },
    );
    for _ in 0..2 {
        welcomed.recv().await;
    }
    // Drains the set: started handlers finish and their outcomes commit, leases are released.
    workers.shutdown().await
}
