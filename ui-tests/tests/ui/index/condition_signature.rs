// A condition must be `fn(&self) -> bool`.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "active_by_team: team", condition = "status")]
struct User {
    id: String,
    team: String,
}

impl User {
    fn status(&self) -> String {
        String::new()
    }
}

fn main() {}
