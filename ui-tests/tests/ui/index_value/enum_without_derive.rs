// An enum index field without the derive: the error says to add it.
use serde::{Deserialize, Serialize};
use tito::TitoModel;

#[derive(Default, Clone, Serialize, Deserialize)]
enum Status {
    #[default]
    Open,
    Closed,
}

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_status: status")]
struct Ticket {
    id: String,
    status: Status,
}

fn main() {}
