// One layout per index.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(unique_index = "by_email: email", entries = "keys", entries = "copies")]
struct User {
    id: String,
    email: String,
}

fn main() {}
