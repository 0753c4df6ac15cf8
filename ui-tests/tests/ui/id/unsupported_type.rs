// An id must be a `String` or an integer; the error points at the field's type.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
struct Reading {
    #[tito(id)]
    id: f64,
}

fn main() {}
