// A list of lists is not an index field: each entry is one value.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_tags: tags")]
struct Doc {
    id: String,
    tags: Vec<Vec<String>>,
}

fn main() {}
