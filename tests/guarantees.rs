//! The promise ledger, `docs/guarantees.md`, against the tests it names: every test a promise
//! lists exists, every promise outside "Untested promises" lists one, and no id is used twice.
//!
//! The page's tables have one row per promise, `| id | promise | stated in | tests |`; the tests
//! cell lists `` `path::fn_name` `` references, each a file of the workspace that defines
//! `fn fn_name(` or `fn fn_name<`. Rows under the heading "Untested promises" have, in place of
//! tests, what a test would need to do.

use std::collections::BTreeMap;
use std::path::Path;

/// The heading of the section for promises no test tries to break yet.
const UNTESTED: &str = "Untested promises";

/// One promise row of the ledger.
struct Promise {
    id: String,
    /// The row's line in the page, for messages.
    line: usize,
    /// Whether the row is under "Untested promises".
    untested: bool,
    /// The row's last cell: its tests, or what a test would need to do.
    last: String,
}

fn ledger_text() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/guarantees.md");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()))
}

/// Whether a table's first cell is a promise id: upper-case segments joined by `-`, the last
/// one a number (`Q-PRIO-1`).
fn is_id(cell: &str) -> bool {
    let mut parts = cell.split('-').peekable();
    let mut segments = 0;
    while let Some(part) = parts.next() {
        segments += 1;
        let fits = if parts.peek().is_none() {
            !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
        } else {
            !part.is_empty() && part.bytes().all(|b| b.is_ascii_uppercase())
        };
        if !fits {
            return false;
        }
    }
    segments >= 2
}

/// Every promise row of the page, in order. A table row whose first cell is an id but which
/// does not have exactly four cells is reported as a mistake (a `|` inside a cell).
fn promises(text: &str) -> (Vec<Promise>, Vec<String>) {
    let mut promises = Vec::new();
    let mut mistakes = Vec::new();
    let mut untested = false;
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        if let Some(heading) = line.strip_prefix("## ") {
            untested = heading.trim() == UNTESTED;
            continue;
        }
        let Some(row) = line.trim().strip_prefix('|') else {
            continue;
        };
        let row = row.strip_suffix('|').unwrap_or(row);
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if !is_id(cells[0]) {
            continue;
        }
        if cells.len() != 4 {
            mistakes.push(format!(
                "line {line_no} ({}): {} cells instead of 4 (a `|` inside a cell?)",
                cells[0],
                cells.len()
            ));
            continue;
        }
        promises.push(Promise {
            id: cells[0].to_string(),
            line: line_no,
            untested,
            last: cells[3].to_string(),
        });
    }
    (promises, mistakes)
}

/// The backticked spans of a cell.
fn backticked(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The `(path, fn_name)` test references of a tests cell: its backticked spans that hold `::`.
fn references(cell: &str) -> Vec<(&str, &str)> {
    backticked(cell)
        .into_iter()
        .filter_map(|span| span.rsplit_once("::"))
        .collect()
}

/// Whether `source` defines a function named `name`.
fn defines(source: &str, name: &str) -> bool {
    ["(", "<"]
        .iter()
        .any(|after| source.contains(&format!("fn {name}{after}")))
}

#[test]
fn every_listed_test_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (promises, mistakes) = promises(&ledger_text());
    assert!(
        mistakes.is_empty(),
        "malformed rows:\n{}",
        mistakes.join("\n")
    );
    let mut sources: BTreeMap<&str, Option<String>> = BTreeMap::new();
    let mut missing = Vec::new();
    let mut checked = 0;
    for promise in promises.iter().filter(|p| !p.untested) {
        for (path, name) in references(&promise.last) {
            let source = sources
                .entry(path)
                .or_insert_with(|| std::fs::read_to_string(root.join(path)).ok());
            checked += 1;
            match source {
                None => missing.push(format!("{}: `{path}` does not exist", promise.id)),
                Some(text) if !defines(text, name) => {
                    missing.push(format!("{}: `{path}` defines no `fn {name}`", promise.id))
                }
                Some(_) => {}
            }
        }
    }
    assert!(
        checked > 0,
        "no test references found in docs/guarantees.md"
    );
    assert!(
        missing.is_empty(),
        "docs/guarantees.md names tests that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_promise_names_a_test_or_is_listed_untested() {
    let (promises, mistakes) = promises(&ledger_text());
    assert!(
        mistakes.is_empty(),
        "malformed rows:\n{}",
        mistakes.join("\n")
    );
    assert!(
        !promises.is_empty(),
        "no promises found in docs/guarantees.md"
    );
    let mut wrong = Vec::new();
    for promise in &promises {
        let refs = references(&promise.last);
        if promise.untested && promise.last.is_empty() {
            wrong.push(format!(
                "{} (line {}): untested, but says nothing of what a test would need to do",
                promise.id, promise.line
            ));
        } else if !promise.untested && refs.is_empty() {
            wrong.push(format!(
                "{} (line {}): names no test; name one, or move it to \"{UNTESTED}\"",
                promise.id, promise.line
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn promise_ids_are_unique() {
    let (promises, _) = promises(&ledger_text());
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    let mut twice = Vec::new();
    for promise in &promises {
        if let Some(first) = seen.insert(&promise.id, promise.line) {
            twice.push(format!(
                "{} on lines {first} and {}",
                promise.id, promise.line
            ));
        }
    }
    assert!(twice.is_empty(), "ids used twice:\n{}", twice.join("\n"));
}

#[test]
fn the_parser_reads_ids_and_references() {
    assert!(is_id("Q-PRIO-1") && is_id("KV-10") && !is_id("id") && !is_id("Q-PRIO"));
    assert!(!is_id("q-prio-1") && !is_id("1") && !is_id("---"));
    let cell = "`tests/queue.rs::a_b`, `tito/src/x.rs::c`, `not a reference`";
    assert_eq!(
        references(cell),
        [("tests/queue.rs", "a_b"), ("tito/src/x.rs", "c")]
    );
    assert!(defines("pub async fn a_b<E>(ctx: E) {}", "a_b"));
    assert!(defines("fn c() {}", "c"));
    assert!(!defines("fn c_d() {}", "c"));
}
