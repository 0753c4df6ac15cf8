// `index_as` is for unit enums.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
#[tito(index_as = "number")]
struct Cents(i64);

fn main() {}
