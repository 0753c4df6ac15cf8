// Every mistake in a shape's attributes, reported together.
use serde::{Deserialize, Serialize};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct UserV1 {
    id: String,
}

// A version of 0, and `upgrade` without `from`.
#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 0, upgrade = "nothing")]
struct Zero {
    id: String,
}

// `from` without a version of 2 or more.
#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(from = "UserV1")]
struct NoVersion {
    id: String,
}

// `from` that is not a type, a version twice.
#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 2, version = 3, from = "not a type")]
struct Twice {
    id: String,
}

// `downgrade` without `from`.
#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 2, downgrade = "nothing")]
struct DownOnly {
    id: String,
}

// A shape without a version.
#[derive(TitoShape, Serialize, Deserialize)]
struct Unversioned {
    id: String,
}

// A shape with a model's attribute.
#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1, table = "users")]
struct WithTable {
    id: String,
}

// A version over the highest, one that does not fit a u32, and one that is not a number.
#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(version = 1000001)]
struct TooHigh {
    id: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 4294967296)]
struct Overflow {
    id: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = "2")]
struct Quoted {
    id: String,
}

fn main() {}
