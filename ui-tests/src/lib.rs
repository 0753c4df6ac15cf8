//! UI tests for `#[derive(TitoModel)]` live here.
