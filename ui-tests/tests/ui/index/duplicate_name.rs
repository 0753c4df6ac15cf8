// Two indexes share a name (an index and a unique index included).
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_email: email")]
#[tito(unique_index = "by_email: email")]
struct User {
    id: String,
    email: String,
}

fn main() {}
