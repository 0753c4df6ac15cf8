//! Runs the UI tests: every program in `tests/ui/` must fail to compile with exactly the
//! committed `.stderr`. (The programs that must compile are this crate's library.)

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/**/*.rs");
}
