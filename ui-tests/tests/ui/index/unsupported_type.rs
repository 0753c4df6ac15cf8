// A map cannot be an index field; the error points at the field's type.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_labels: labels")]
struct User {
    id: String,
    labels: HashMap<String, String>,
}

fn main() {}
