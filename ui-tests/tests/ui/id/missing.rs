// No field is marked `#[tito(id)]` and none is named `id`.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
struct User {
    email: String,
}

fn main() {}
