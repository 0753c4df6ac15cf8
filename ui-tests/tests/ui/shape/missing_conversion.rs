// `from` names a previous shape, but nothing converts it into the model.
use serde::{Deserialize, Serialize};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct UserV1 {
    id: String,
    name: String,
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 2, from = "UserV1")]
struct User {
    id: String,
    first: String,
}

fn main() {}
