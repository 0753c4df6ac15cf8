// A periodic job whose payload is not the declared queue's payload type.
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tito::queue::{PeriodicJob, Schedule, Topic};
use tito::{TitoEngine, Workers};

#[derive(Clone, Serialize, Deserialize)]
struct Digest {
    day: u32,
}

const DIGESTS: Topic<Digest> = Topic::new("digests");

async fn start<E: TitoEngine>(db: E) -> tito::TitoResult<()> {
    let digests = DIGESTS.spec(4, Duration::from_secs(60)).open(db).await?;
    let mut workers = Workers::new();
    let every_hour = Schedule::every("hourly", Duration::from_secs(3600))?;
    workers.spawn_periodic(&digests, vec![PeriodicJob::new(every_hour, 7u32)]);
    workers.shutdown().await
}

fn main() {
    let _ = start::<tito::Embedded>;
}
