//! Runs the UI tests: every program in `tests/ui/` must fail to compile with exactly the
//! committed `.stderr`; every program in `tests/ui-pass/` must compile and run.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/**/*.rs");
    cases.pass("tests/ui-pass/*.rs");
}
