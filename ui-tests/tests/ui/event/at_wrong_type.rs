// `at` names a field that cannot tell time.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(event = "reminder", at = "remind_at")]
struct User {
    id: String,
    remind_at: String,
}

fn main() {}
