// A worker on a declared queue whose handler takes another payload type.
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tito::queue::Topic;
use tito::{QueueEvent, QueueHandlerOutcome, TitoEngine, WorkerConfig, Workers};

#[derive(Clone, Serialize, Deserialize)]
struct Email {
    to: String,
}

const EMAILS: Topic<Email> = Topic::new("emails");

async fn start<E: TitoEngine>(db: E) -> tito::TitoResult<()> {
    let emails = EMAILS.spec(4, Duration::from_secs(60)).open(db).await?;
    let mut workers = Workers::new();
    workers.spawn_worker_with(&emails, WorkerConfig::new(0..4), 7u32, |_state, event: QueueEvent<String>| async move {
        let _ = event;
        Ok(QueueHandlerOutcome::Acknowledge)
    });
    workers.shutdown().await
}

fn main() {
    let _ = start::<tito::Embedded>;
}
