//! Compile-fail and pass tests of `#[derive(TitoModel)]`, run with trybuild: `tests/ui/` holds one
//! program per mistake with the compiler's expected output beside it (`.stderr`), `tests/ui-pass/`
//! programs that must compile. Regenerate the expected output deliberately with
//! `TRYBUILD=overwrite cargo test -p tito-ui-tests` after a compiler upgrade (they were
//! blessed with rustc 1.95.0), then read the diff.
