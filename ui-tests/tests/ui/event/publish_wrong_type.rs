// A typed queue refuses a payload of another type.
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tito::queue::Topic;
use tito::{QueueConfig, QueueEvent, TitoEngine};

#[derive(Clone, Serialize, Deserialize)]
struct Email {
    to: String,
}

const EMAILS: Topic<Email> = Topic::new("emails");

async fn send<E: TitoEngine>(db: E) -> tito::TitoResult<()> {
    let emails = EMAILS.queue(db, QueueConfig::new(4, Duration::from_secs(60)))?;
    emails.publish(QueueEvent::new("ada", "ada@example.com".to_string(), 0)).await?;
    Ok(())
}

fn main() {
    let _ = send::<tito::Embedded>;
}
