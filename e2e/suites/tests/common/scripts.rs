//! The project's own e2e scripts, run from tests: helm (built by
//! `e2e/build-helm.sh`) and the services a test starts itself (`e2e/jaeger`,
//! `e2e/llama`, `e2e/postgres`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

pub use super::root;

/// Runs `e2e/SCRIPT ARG` with extra environment and returns its stdout
/// (trimmed); fails loudly, saying that `needed_for` needs it.
pub fn e2e_script(script: &str, arg: &str, env: &[(&str, &str)], needed_for: &str) -> String {
    let path = root().join("e2e").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .arg(arg)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "`e2e/{script} {arg}` failed ({}): {needed_for}.\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

/// `e2e/build-helm.sh ARG` (`path`, `lua-path`...): the tool's path.
pub fn helm_tool(arg: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(root().join("e2e/build-helm.sh"))
        .arg(arg)
        .stderr(Stdio::inherit())
        .output()
        .expect("running e2e/build-helm.sh");
    assert!(
        out.status.success(),
        "e2e/build-helm.sh {arg} failed: helm and the Lua runner are built from their Go modules \
         (Go and the module proxy are needed once; they are cached in ~/.cache/agentrun)"
    );
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(
        path.is_file(),
        "e2e/build-helm.sh {arg}: nothing at {}",
        path.display()
    );
    path
}

pub fn helm() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| helm_tool("path"))
}

/// `helm ARGS...` in the project root: (success, stdout, stderr).
pub fn helm_run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(helm())
        .args(args)
        .current_dir(root())
        .output()
        .expect("running helm");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `helm lint --strict charts/agentrun` with `values`: (success, stdout, stderr).
pub fn helm_lint(values: &serde_json::Value) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).unwrap();
    helm_run(&[
        "lint",
        "--strict",
        "charts/agentrun",
        "--values",
        file.to_str().unwrap(),
    ])
}
