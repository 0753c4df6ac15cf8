// Several mistakes in one struct are all reported, each at its own token.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_email: emial")]
#[tito(index = "by_email: email")]
#[tito(event = "")]
#[tito(colour = "blue")]
struct User {
    id: String,
    email: String,
}

fn main() {}
