// An index must name at least one field.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_nothing:")]
struct User {
    id: String,
}

fn main() {}
