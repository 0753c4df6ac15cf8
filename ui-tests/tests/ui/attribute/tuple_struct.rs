// A tuple struct has no field names to index.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
struct User(String);

fn main() {}
