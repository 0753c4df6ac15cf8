// An index's entries are copies of the row or keys; nothing else.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_team: team", entries = "rows")]
struct User {
    id: String,
    team: String,
}

fn main() {}
