// An index value takes no other `tito` attribute.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
#[tito(table = "status")]
enum Status {
    Open,
}

fn main() {}
