// A generic type cannot derive IndexValue.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
struct Id<T>(T);

fn main() {}
