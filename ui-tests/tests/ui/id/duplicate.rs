// Two fields are marked as the id.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
struct User {
    #[tito(id)]
    id: String,
    #[tito(id)]
    email: String,
}

fn main() {}
