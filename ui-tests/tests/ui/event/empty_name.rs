// An event needs a name.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "")]
struct User {
    id: String,
}

fn main() {}
