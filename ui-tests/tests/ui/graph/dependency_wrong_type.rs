// A dependency's result read as another type than its step name declares.
use serde::{Deserialize, Serialize};
use tito::queue::graph::{Graphs, StepName};
use tito::queue::Finished;
use tito::QueueEvent;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
}

const CHARGE: StepName<Receipt> = StepName::new("charge");

async fn reserve<E: tito::TitoEngine>(
    graphs: &Graphs<E>,
    event: &QueueEvent<u32>,
) -> tito::TitoResult<()> {
    let charge: Finished<String> = graphs.dependency(event, &CHARGE).await?;
    let _ = charge;
    Ok(())
}

fn main() {
    let _ = reserve::<tito::backend::memory::Memory>;
}
