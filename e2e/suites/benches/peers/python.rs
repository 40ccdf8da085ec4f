//! The peers' programs (`e2e/peers/*_peer.py`): each command starts its
//! engine and worker, does one figure's work and prints one JSON object on
//! its last line.

use std::path::PathBuf;
use std::process::Stdio;

use serde_json::Value;

use crate::common::scripts::root;

/// A peer system as the harness drives it.
pub struct Peer {
    pub name: &'static str,
    python: PathBuf,
    standins: String,
    database_url: Option<String>,
    work_dir: PathBuf,
}

/// The peers' Python (the venv `e2e/peers/install.sh` keeps under
/// `~/.cache`): AGENTRUN_PEERS_PYTHON when `e2e/bench` set it, else the
/// installer is run here (it does nothing when the venv is there).
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("AGENTRUN_PEERS_PYTHON") {
        return PathBuf::from(p);
    }
    let out = std::process::Command::new("bash")
        .arg(root().join("e2e/peers/install.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("running e2e/peers/install.sh");
    assert!(
        out.status.success(),
        "e2e/peers/install.sh failed: the peers' Python packages are needed"
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Peer {
    pub fn new(
        name: &'static str,
        python: PathBuf,
        standins: &str,
        database_url: Option<String>,
    ) -> Peer {
        let work_dir =
            std::env::temp_dir().join(format!("agentrun-peers-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&work_dir).expect("the peer's work directory");
        Peer {
            name,
            python,
            standins: standins.to_string(),
            database_url,
            work_dir,
        }
    }

    /// Runs `command` with `args` against model script `script` and tool
    /// tenant `tenant`; its JSON result.
    pub async fn run(&self, script: &str, tenant: &str, command: &str, args: &[String]) -> Value {
        let program = root().join(format!("e2e/peers/{}_peer.py", self.name));
        let mut cmd = tokio::process::Command::new(&self.python);
        cmd.arg(&program)
            .args([
                "--standins",
                &self.standins,
                "--script",
                script,
                "--tenant",
                tenant,
            ])
            .arg("--work-dir")
            .arg(&self.work_dir);
        if let Some(url) = &self.database_url {
            cmd.args(["--database-url", url]);
        }
        cmd.arg(command).args(args);
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let out = cmd
            .output()
            .await
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{} {command} failed ({}):\n{stdout}",
            self.name,
            out.status
        );
        let last = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        serde_json::from_str(last).unwrap_or_else(|e| {
            panic!(
                "{} {command}: last line is not JSON ({e}): {last}",
                self.name
            )
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

/// `["--runs", "a,b,c"]`.
pub fn list_arg(flag: &str, ids: &[String]) -> Vec<String> {
    vec![flag.to_string(), ids.join(",")]
}
