// Indexing by number needs the enum's integer type.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
#[tito(index_as = "number")]
enum Priority {
    Low = 1,
    High = 2,
}

fn main() {}
