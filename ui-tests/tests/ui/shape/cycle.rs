// Two previous shapes that come from each other: one of them goes up a version.
use serde::{Deserialize, Serialize};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 2, from = "UserB")]
struct UserA {
    id: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 3, from = "UserA")]
struct UserB {
    id: String,
}

impl From<UserB> for UserA {
    fn from(v: UserB) -> Self {
        UserA { id: v.id }
    }
}

impl From<UserA> for UserB {
    fn from(v: UserA) -> Self {
        UserB { id: v.id }
    }
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 4, from = "UserB")]
struct User {
    id: String,
}

impl From<UserB> for User {
    fn from(v: UserB) -> Self {
        User { id: v.id }
    }
}

fn main() {}
