// `upgrade` names a function that does not take the previous shape.
use serde::{Deserialize, Serialize};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct UserV1 {
    id: String,
}

fn upgrade(id: String) -> Result<User, String> {
    Ok(User { id })
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 2, from = "UserV1", upgrade = "upgrade")]
struct User {
    id: String,
}

fn main() {}
