// `processed_at` is an `Option<i64>` of Unix milliseconds.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(inbox)]
struct Job {
    id: String,
    #[tito(processed_at)]
    done: bool,
}

fn main() {}
