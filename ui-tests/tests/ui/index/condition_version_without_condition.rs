// A condition version versions a condition: an index without one has nothing to version.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_team: team", condition_version = 2)]
struct User {
    id: String,
    team: String,
}

fn main() {}
