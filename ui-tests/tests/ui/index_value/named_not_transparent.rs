// A one-field struct with a named field serializes as an object unless it is transparent.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
struct OrderId {
    value: String,
}

fn main() {}
