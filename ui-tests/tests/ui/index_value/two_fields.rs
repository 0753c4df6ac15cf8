// A struct of two fields is no newtype: index each field instead.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
struct Money(i64, String);

fn main() {}
