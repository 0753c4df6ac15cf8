// A type of the user's own is checked through the `IndexField` bound; the error names the type.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(Default, Clone, Serialize, Deserialize)]
struct Address {
    city: String,
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_address: address")]
struct User {
    id: String,
    address: Address,
}

fn main() {}
