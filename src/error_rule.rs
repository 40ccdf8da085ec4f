//! Keeps the error rule of docs/architecture.md ("Errors"): `anyhow` only
//! at the binaries' edges, and no bare `String` as an error type (a
//! refusal whose words are the product is a `crate::refusal::Refusal`).
//! Test code (a file's inline `#[cfg(test)]` modules, and `tests.rs`
//! files) is free. A failure names the file and line.

use std::path::{Path, PathBuf};

/// Where `anyhow` may be used: where a process starts or a command's
/// output is printed.
const ANYHOW_EDGES: &[&str] = &["src/main.rs", "src/bin/", "src/exit.rs", "src/cli/"];

/// The functions `src/main.rs` calls to run a process: they hand it an
/// `anyhow::Error` (it prints it, and the step runner's is downcast for its
/// exit code: a `StepError` that says the lease was lost); their bodies
/// return typed errors through `?`.
const ENTRY_POINTS: &[(&str, &str)] = &[
    ("src/controller/process/mod.rs", "pub async fn run("),
    ("src/step/runner.rs", "pub async fn run("),
    ("src/store/admin.rs", "pub async fn main("),
    ("src/console/mod.rs", "pub async fn serve_in_cluster("),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, as a path relative to the crate.
fn rust_files(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path
                .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                .expect("under the crate");
            out.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// The lines of `file` that are not test code, numbered from 1.
fn production_lines(file: &str) -> Vec<(usize, String)> {
    if file.ends_with("/tests.rs") || file.contains("/tests/") || file == "src/error_rule.rs" {
        return Vec::new();
    }
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
        .expect("a source file is readable");
    let lines: Vec<&str> = text.lines().collect();
    let mut kept = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        // An inline `#[cfg(test)] mod … {`, to its closing brace (rustfmt's).
        if lines[i] == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|l| l.starts_with("mod ") || l.starts_with("pub mod "))
            && lines[i + 1].ends_with('{')
        {
            i += 2;
            while i < lines.len() && lines[i] != "}" {
                i += 1;
            }
        } else if !lines[i].trim_start().starts_with("//") {
            kept.push((i + 1, lines[i].to_string()));
        }
        i += 1;
    }
    kept
}

/// The type arguments of each `Result<…>` on `line`, split at top-level commas.
fn result_arguments(line: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for (at, _) in line.match_indices("Result<") {
        let preceded = line[..at].chars().last();
        if preceded.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let (mut depth, mut args, mut current) = (1, Vec::new(), String::new());
        for c in line[at + "Result<".len()..].chars() {
            match c {
                '<' => depth += 1,
                '>' => depth -= 1,
                ',' if depth == 1 => {
                    args.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            if depth == 0 {
                args.push(current);
                found.push(args.iter().map(|a| a.trim().to_string()).collect());
                break;
            }
            current.push(c);
        }
    }
    found
}

fn is_string_error(line: &str) -> bool {
    let bare = |t: &str| t == "String" || t == "Vec<String>";
    result_arguments(line)
        .iter()
        .any(|args| args.len() == 2 && bare(&args[1]))
        || line.trim() == "type Err = String;"
}

fn is_entry_point(file: &str, line: &str) -> bool {
    ENTRY_POINTS
        .iter()
        .any(|(f, signature)| *f == file && line.trim_start().starts_with(signature))
}

fn under(file: &str, prefixes: &[&str]) -> bool {
    prefixes
        .iter()
        .any(|p| file == *p || (p.ends_with('/') && file.starts_with(p)))
}

#[test]
fn anyhow_is_used_only_at_the_binaries_edges() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut found: Vec<String> = files
        .iter()
        .filter(|f| !under(f, ANYHOW_EDGES))
        .flat_map(|f| {
            production_lines(f)
                .into_iter()
                .filter(|(_, l)| l.contains("anyhow") && !is_entry_point(f, l))
                .map(move |(n, l)| format!("{f}:{n}: {}", l.trim()))
        })
        .collect();
    found.sort();
    assert!(
        found.is_empty(),
        "library code returns typed errors (thiserror), not anyhow:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_bare_string_is_an_error_type() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut found: Vec<String> = files
        .iter()
        .flat_map(|f| {
            production_lines(f)
                .into_iter()
                .filter(|(_, l)| is_string_error(l))
                .map(move |(n, l)| format!("{f}:{n}: {}", l.trim()))
        })
        .collect();
    found.sort();
    assert!(
        found.is_empty(),
        "an error is a thiserror enum, or a crate::refusal::Refusal when its words are the product:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_guard_reads_result_types() {
    assert!(is_string_error("fn f() -> Result<(), String> {"));
    assert!(is_string_error(") -> Result<Option<Value>, Vec<String>> {"));
    assert!(is_string_error("    Ready(Result<McpCatalog, String>),"));
    assert!(!is_string_error(
        ") -> Result<Option<String>, reqwest::Error> {"
    ));
    assert!(!is_string_error("fn f() -> anyhow::Result<String> {"));
    assert!(!is_string_error(
        "fn f() -> Result<(Vec<String>, Time), StoreError> {"
    ));
}
