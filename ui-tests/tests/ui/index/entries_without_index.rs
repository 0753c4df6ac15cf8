// `entries` describes the index of its own attribute: alone it describes nothing.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(table = "users", entries = "keys")]
#[tito(index = "by_team: team")]
struct User {
    id: String,
    team: String,
}

fn main() {}
