// `index_as` is "name" or "number".
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
#[tito(index_as = "ordinal")]
enum Status {
    Open,
    Closed,
}

fn main() {}
