// Two events share a name.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "user")]
#[tito(event = "user")]
struct User {
    id: String,
}

fn main() {}
