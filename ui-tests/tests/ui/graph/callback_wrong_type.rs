// A batch callback sent to a typed queue that does not take its BatchDone payload.
use serde::{Deserialize, Serialize};
use tito::queue::graph::Batch;
use tito::queue::TopicQueue;
use tito::QueueEvent;

#[derive(Clone, Serialize, Deserialize)]
struct Email {
    to: String,
}

fn build<E: tito::TitoEngine>(emails: &TopicQueue<E, Email>) -> Batch {
    Batch::new("import-7").on_complete(emails, QueueEvent::now("import-7", "done".to_string()))
}

fn main() {
    let _ = build::<tito::backend::memory::Memory>;
}
