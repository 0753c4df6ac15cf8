//! The `#[derive(TitoModel)]` procedural macro for Tito.

#![warn(missing_docs)]
