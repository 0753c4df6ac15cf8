// A workflow step whose event is not of its typed queue's payload type.
use serde::{Deserialize, Serialize};
use tito::queue::graph::{StepName, Workflow};
use tito::queue::TopicQueue;
use tito::QueueEvent;

#[derive(Clone, Serialize, Deserialize)]
struct Charge {
    cents: u64,
}

const CHARGE: StepName<()> = StepName::new("charge");

fn build<E: tito::TitoEngine>(charges: &TopicQueue<E, Charge>) -> Workflow {
    let mut workflow = Workflow::new("order-7");
    workflow.step(&CHARGE, charges, QueueEvent::now("order-7", "4200 cents"));
    workflow
}

fn main() {
    let _ = build::<tito::backend::memory::Memory>;
}
