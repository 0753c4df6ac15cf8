//! The `#[derive(TitoModel)]` procedural macro for Tito.
