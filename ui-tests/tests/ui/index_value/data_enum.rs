// Only unit enums are index values: a variant with fields is named.
use serde::{Deserialize, Serialize};

#[derive(tito::IndexValue, Clone, Serialize, Deserialize)]
enum Payment {
    Card,
    Transfer { iban: String },
}

fn main() {}
