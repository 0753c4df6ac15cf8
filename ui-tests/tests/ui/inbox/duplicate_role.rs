// Each inbox role belongs to one field.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(inbox)]
struct Job {
    id: String,
    #[tito(priority)]
    urgency: i64,
    #[tito(priority)]
    rank: i64,
}

fn main() {}
