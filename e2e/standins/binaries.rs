//! The workspace's binaries as tests start them. Cargo builds a package's
//! own binaries for its tests (`CARGO_BIN_EXE_*`), not another package's: the
//! suites (e2e/suites) start the operator, the plugin and the stand-ins that
//! `e2e/build-binaries` built, the ones the local cluster runs too. They are
//! in the running test's profile directory (`debug/` under `cargo test`,
//! `release/` under `cargo bench`), and one older than a source it is
//! compiled from is refused: a test never runs yesterday's code.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The path of the workspace's binary `name`; panics, saying what to run,
/// when it is missing or stale.
pub fn built(name: &str) -> PathBuf {
    let dir = profile_dir();
    let build = match dir.file_name().and_then(|n| n.to_str()) {
        Some("release") => "e2e/build-binaries --release",
        _ => "e2e/build-binaries",
    };
    let bin = dir.join(name);
    let built_at = modified(&bin)
        .unwrap_or_else(|e| panic!("{}: {e}: build it with `{build}`", bin.display()));
    if let Some(source) = newer_source(&bin, built_at) {
        panic!(
            "{} is older than {}, which it is compiled from: build it again with `{build}`",
            bin.display(),
            source.display()
        );
    }
    bin
}

/// `target/<profile>`: test and bench executables run from its `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe.parent().expect("the test's directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("the profile directory")
    } else {
        dir
    };
    dir.to_path_buf()
}

/// A source named in the binary's dep-info (`NAME.d`, which cargo writes
/// beside it) changed since it was built.
fn newer_source(bin: &Path, built_at: SystemTime) -> Option<PathBuf> {
    let dep_info = bin.with_extension("d");
    let text = std::fs::read_to_string(&dep_info).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (cargo writes it beside the binary)",
            dep_info.display()
        )
    });
    let (_, inputs) = text.lines().next()?.split_once(": ")?;
    dep_paths(inputs)
        .into_iter()
        .find(|source| modified(source).is_ok_and(|t| t > built_at))
}

/// The paths of a dep-info rule's inputs: separated by spaces, a space
/// inside a path escaped as `\ ` (make's syntax, which cargo writes).
fn dep_paths(inputs: &str) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    let mut path = String::new();
    let mut chars = inputs.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => path.push(chars.next().unwrap_or(' ')),
            c if c.is_whitespace() => {
                if !path.is_empty() {
                    paths.push(PathBuf::from(std::mem::take(&mut path)));
                }
            }
            c => path.push(c),
        }
    }
    if !path.is_empty() {
        paths.push(PathBuf::from(path));
    }
    paths
}

fn modified(path: &Path) -> std::io::Result<SystemTime> {
    std::fs::metadata(path)?.modified()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dep_info_paths_keep_escaped_spaces() {
        assert_eq!(
            dep_paths("/a/b.rs /my\\ dir/c.rs  d.rs"),
            [
                PathBuf::from("/a/b.rs"),
                PathBuf::from("/my dir/c.rs"),
                PathBuf::from("d.rs")
            ]
        );
    }
}
