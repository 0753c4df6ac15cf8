// Two event names that make the same topic constant.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "user.created")]
#[tito(event = "user-created")]
struct User {
    id: String,
}

fn main() {}
