// Condition versions count from 1: zero is not a version.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "active_by_team: team", condition = "is_active", condition_version = 0)]
struct User {
    id: String,
    team: String,
    active: bool,
}

impl User {
    fn is_active(&self) -> bool {
        self.active
    }
}

fn main() {}
