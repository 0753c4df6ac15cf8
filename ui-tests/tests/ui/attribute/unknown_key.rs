// `tito` attributes have a fixed set of keys.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(tabel = "user")]
struct User {
    #[tito(primary)]
    id: String,
}

fn main() {}
