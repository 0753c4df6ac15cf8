// `at` names neither a field nor a method.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "reminder", at = "remind_at")]
struct User {
    id: String,
}

fn main() {}
