// The previous shape's version is not lower than the model's.
use serde::{Deserialize, Serialize};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 3)]
struct UserV3 {
    id: String,
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 2, from = "UserV3")]
struct User {
    id: String,
}

impl From<UserV3> for User {
    fn from(v: UserV3) -> Self {
        User { id: v.id }
    }
}

fn main() {}
