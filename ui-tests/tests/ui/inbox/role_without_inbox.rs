// A field role means nothing unless the struct is an inbox.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
struct Job {
    id: String,
    #[tito(group)]
    queue: String,
}

fn main() {}
