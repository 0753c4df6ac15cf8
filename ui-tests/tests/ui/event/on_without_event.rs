// `on` belongs to an event.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_name: name", on = "insert")]
struct User {
    id: String,
    name: String,
}

fn main() {}
