// The index string is `name: field, field`; here the colon is missing.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_email email")]
struct User {
    id: String,
    email: String,
}

fn main() {}
