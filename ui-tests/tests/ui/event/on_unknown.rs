// `on` names an operation that does not exist, and `upsert` (which publishes as insert or update).
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "audit", on = "insert, remove")]
#[tito(event = "changes", on = "upsert")]
#[tito(event = "twice", on = "delete, delete")]
#[tito(event = "none", on = "")]
struct User {
    id: String,
}

fn main() {}
