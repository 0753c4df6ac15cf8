// A condition names a method the struct does not have.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "active_by_team: team", condition = "is_active")]
struct User {
    id: String,
    team: String,
}

fn main() {}
