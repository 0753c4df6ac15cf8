// An index names a field the struct does not have.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_email: emial")]
struct User {
    id: String,
    email: String,
}

fn main() {}
