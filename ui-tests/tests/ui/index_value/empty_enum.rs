// An enum without variants has no value to index.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
enum Never {}

fn main() {}
