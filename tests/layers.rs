//! The shape of the `tito` crate: which of its modules import which, read from the source.
//!
//! Between the children of one module (the crate's top-level modules, or the files of one
//! folder), imports must not go round in a circle: data flows down the layers and never back up.
//! Any circle fails this test, which prints each module's imports (`--nocapture`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path: `[]` is the crate root.
type ModPath = Vec<String>;

fn module_of(src: &Path, file: &Path) -> ModPath {
    let relative = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    match last.as_str() {
        "lib.rs" | "mod.rs" => {}
        // Declared as `#[path = "private.rs"] pub mod __private`.
        "private.rs" if parts.is_empty() => parts.push("__private".into()),
        name => parts.push(name.trim_end_matches(".rs").to_string()),
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without its `#[cfg(test)]` module.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = match line.find("//") {
            // A `//` inside a string (a URL) is rare in this crate; good enough for imports.
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn ident_path(text: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut rest = text;
    loop {
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        parts.push(rest[..len].to_string());
        rest = &rest[len..];
        match rest.strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    parts
}

/// The module a path names: its longest prefix that is a module. A name the crate root
/// re-exports (`crate::TitoModel`) names the module it comes from, so a re-export is no way
/// around the layers.
fn resolve(
    modules: &BTreeSet<ModPath>,
    root_names: &BTreeMap<String, ModPath>,
    path: &[String],
) -> ModPath {
    let found = (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
        .unwrap_or_default();
    match (found.is_empty(), path.first()) {
        (true, Some(name)) => root_names.get(name).cloned().unwrap_or_default(),
        _ => found,
    }
}

/// The names `lib.rs` re-exports from the crate's modules (`pub use model::{TitoModel, ..};`),
/// each with the module it comes from.
fn root_reexports(lib: &str, modules: &BTreeSet<ModPath>) -> BTreeMap<String, ModPath> {
    let mut names = BTreeMap::new();
    let code = code_of(lib);
    for (at, _) in code.match_indices("pub use ") {
        let statement = &code[at + "pub use ".len()..];
        let statement = &statement[..statement.find(';').unwrap_or(statement.len())];
        let (path, items) = match statement.find("::{") {
            Some(brace) => (
                &statement[..brace],
                statement[brace + 3..].trim_end_matches('}').to_string(),
            ),
            None => match statement.rfind("::") {
                Some(sep) => (&statement[..sep], statement[sep + 2..].to_string()),
                None => continue,
            },
        };
        let module: ModPath = path
            .trim_start_matches("crate::")
            .split("::")
            .map(str::to_string)
            .collect();
        if !modules.contains(&module) {
            continue; // another crate (`tito_derive`)
        }
        for item in items.split(',') {
            let name = item.split(" as ").last().unwrap_or("").trim();
            if !name.is_empty() {
                names.insert(name.to_string(), module.clone());
            }
        }
    }
    names
}

/// Every module the code of `module` names, through `crate::` and `super::` paths.
fn references(code: &str, module: &ModPath) -> Vec<ModPath> {
    let mut out = Vec::new();
    // `super` is the parent of the module (of the folder, in a folder's `mod.rs`).
    let parent: ModPath = module[..module.len().saturating_sub(1)].to_vec();
    for (at, _) in code.match_indices("crate::") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        out.push(ident_path(&code[at + "crate::".len()..]));
    }
    for (at, _) in code.match_indices("super::") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        if at >= 2 && &code[at - 2..at] == "::" {
            continue; // the second `super` of `super::super::`, counted below
        }
        let mut base = parent.clone();
        let mut rest = &code[at + "super::".len()..];
        while let Some(next) = rest.strip_prefix("super::") {
            base.pop();
            rest = next;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let mut path = base.clone();
                path.extend(ident_path(item.trim()));
                out.push(path);
            }
        } else {
            let mut path = base;
            path.extend(ident_path(rest));
            out.push(path);
        }
    }
    out
}

/// Strongly connected components of more than one node, each in name order.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges
        .keys()
        .chain(edges.values().flat_map(|s| s.iter()))
        .collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(node) = stack.pop() {
            for next in edges.get(&node).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: BTreeSet<Vec<String>> = BTreeSet::new();
    for node in &nodes {
        let mut component: Vec<String> = nodes
            .iter()
            .filter(|other| reached[node].contains(**other) && reached[**other].contains(*node))
            .map(|n| (*n).clone())
            .collect();
        if component.len() > 1 {
            component.sort();
            out.insert(component);
        }
    }
    out.into_iter().collect()
}

#[test]
fn the_runtime_has_no_import_circles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tito/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<ModPath> = files.iter().map(|f| module_of(&src, f)).collect();
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let root_names = root_reexports(&lib, &modules);
    assert!(
        root_names.get("TitoModel") == Some(&vec!["model".to_string()]),
        "lib.rs's re-exports are read: {root_names:?}"
    );
    // Edges between the children of each module: `a::b::c -> a::d` is `a::b -> a::d`.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap();
        for path in references(&code_of(&text), &module) {
            let target = resolve(&modules, &root_names, &path);
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            // A module using its own ancestor or descendant is not an edge between siblings.
            if common == module.len() || common == target.len() {
                continue;
            }
            let from = module[..=common].join("::");
            let to = target[..=common].join("::");
            edges.entry(from).or_default().insert(to);
        }
    }
    for (from, to) in &edges {
        let to: Vec<&str> = to.iter().map(String::as_str).collect();
        println!("{from} -> {}", to.join(", "));
    }
    let found = circles(&edges);
    assert!(
        found.is_empty(),
        "import circles (data must flow down the layers): {found:?}; edges: {edges:#?}"
    );
}
