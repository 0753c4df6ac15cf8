// A model is a struct with named fields.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Clone, Serialize, Deserialize)]
enum User {
    Active,
}

fn main() {}
