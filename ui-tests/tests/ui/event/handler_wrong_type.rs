// A worker on a model event's topic with a handler typed by the model instead of its event.
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tito::{QueueConfig, QueueEvent, QueueHandlerOutcome, TitoEngine, TitoModel, WorkerConfig, Workers};

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "user_created")]
struct User {
    id: String,
}

async fn start<E: TitoEngine>(db: E) -> tito::TitoResult<()> {
    let queue = User::USER_CREATED_EVENT.queue(db, QueueConfig::new(4, Duration::from_secs(60)))?;
    let mut workers = Workers::new();
    workers.spawn_worker(queue, WorkerConfig::new(0..4), |event: QueueEvent<User>| async move {
        let _ = event;
        Ok(QueueHandlerOutcome::Acknowledge)
    });
    workers.shutdown().await
}

fn main() {
    let _ = start::<tito::Embedded>;
}
