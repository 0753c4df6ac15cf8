// A field serde never writes cannot be indexed: the index would always be empty.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_secret: secret")]
struct User {
    id: String,
    #[serde(skip)]
    secret: String,
}

fn main() {}
