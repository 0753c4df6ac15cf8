// A newtype is an index value only over an index value: the wrapped type is named.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
struct Tags(HashMap<String, String>);

fn main() {}
