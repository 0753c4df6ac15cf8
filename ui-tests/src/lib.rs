//! Compile-fail tests of `#[derive(TitoModel)]`, run with trybuild: `tests/ui/` holds one
//! program per mistake with the compiler's expected output beside it (`.stderr`). Regenerate the
//! expected output deliberately with `TRYBUILD=overwrite cargo test -p tito-ui-tests` after a
//! compiler upgrade (they were blessed with rustc 1.95.0), then read the diff.
//!
//! This library holds the programs that must compile (`tests/forms/` of the workspace, whose
//! tests run them there): built here as a library that denies missing docs, so every public
//! item the derives generate is documented. (trybuild builds only with `cargo check` and runs
//! every case in one build when it has no passing programs to run.)
#![deny(missing_docs)]
// The programs' tests (and what only they use) are compiled in the workspace's test binary.
#![allow(unused_imports, dead_code)]

/// Every attribute form of `#[derive(TitoModel)]`.
#[path = "../../tests/forms/every_attribute_form.rs"]
pub mod every_attribute_form;
/// An inbox model with every role.
#[path = "../../tests/forms/inbox_model.rs"]
pub mod inbox_model;
/// Index values of the application's own types.
#[path = "../../tests/forms/index_values.rs"]
pub mod index_values;
/// A model with two previous shapes.
#[path = "../../tests/forms/shapes.rs"]
pub mod shapes;
/// Models and index values named like the derives' generic parameters.
#[path = "../../tests/forms/short_names.rs"]
pub mod short_names;
