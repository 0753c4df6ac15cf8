// A newtype over a list is several values: derive for the element instead.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
struct Tags(Vec<String>);

fn main() {}
