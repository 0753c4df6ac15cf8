// A declared queue given a periodic job of another payload type.
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tito::queue::{PeriodicJob, QueueSpec, Schedule, Topic};

#[derive(Clone, Serialize, Deserialize)]
struct Digest {
    day: u32,
}

const DIGESTS: Topic<Digest> = Topic::new("digests");

fn spec() -> tito::TitoResult<QueueSpec<Digest>> {
    let every_hour = Schedule::every("hourly", Duration::from_secs(3600))?;
    Ok(DIGESTS.spec(4, Duration::from_secs(60)).periodic(PeriodicJob::new(every_hour, "digest")))
}

fn main() {
    let _ = spec;
}
