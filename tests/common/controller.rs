//! Runs `agentrun controller` as a child process scoped to one test namespace.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A controller replica; killed when dropped.
pub struct ControllerProcess {
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
    pub metrics_port: u16,
}

impl ControllerProcess {
    /// Starts a replica watching `namespace`, electing through a Lease there.
    pub fn start(namespace: &str, identity: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("controller.log");
        let out = std::fs::File::create(&log).expect("log file");
        let metrics_port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_agentrun"))
            .args([
                "controller",
                "--namespace",
                namespace,
                "--identity",
                identity,
                "--lease-seconds",
                "6",
            ])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .env("RUST_LOG", "info,agentrun=debug")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("starting agentrun controller");
        ControllerProcess {
            child: Some(child),
            log,
            _dir: dir,
            metrics_port,
        }
    }

    /// Everything the replica logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the replica with SIGTERM (graceful: it releases its Lease) and waits.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid has no memory effects.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            for _ in 0..100 {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "controller did not stop within 10 s of SIGTERM:\n{}",
                self.log()
            );
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
