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
    /// Port of the step-log gateway, shared by the replicas of one namespace
    /// (as a Service fronts them in a cluster): a Job made by one replica
    /// keeps reaching the log after that replica stops.
    pub step_api_port: u16,
}

/// The gateway port of `namespace`'s replicas (chosen once per test process).
pub fn step_api_port(namespace: &str) -> u16 {
    static PORTS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, u16>>> =
        std::sync::OnceLock::new();
    *PORTS
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(namespace.to_string())
        .or_insert_with(super::ports::reserve)
}

/// The step-token key of this test process's controllers (replicas share it).
pub fn step_token_key() -> &'static str {
    static KEY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        format!("e2e-step-token-key-{}-{nanos:032}", std::process::id())
    })
}

/// The name of run `uid`'s step credential Secret, as a controller with the
/// e2e key makes it (one per key).
pub fn credential_secret(uid: &str) -> String {
    let key = agentrun::keys::step_token::TokenKey::new(step_token_key().as_bytes())
        .expect("the e2e key is long enough");
    agentrun::controller::reconciler::job::credential_secret(uid, key.record_signer().key_id())
}

impl ControllerProcess {
    /// Starts a replica watching `namespace`, electing through a Lease there,
    /// with the e2e step store.
    pub async fn start(namespace: &str, identity: &str) -> Self {
        Self::start_with(namespace, identity, &[]).await
    }

    /// Same, with extra controller flags.
    pub async fn start_with(namespace: &str, identity: &str, extra: &[&str]) -> Self {
        let store_url = super::store::e2e_store_url().await;
        Self::start_on(namespace, identity, extra, &store_url)
    }

    /// Same, on the step store at `store_url`.
    pub fn start_on(namespace: &str, identity: &str, extra: &[&str], store_url: &str) -> Self {
        Self::start_env(namespace, identity, extra, store_url, &[])
    }

    /// Same, with extra environment variables (a controller failpoint).
    pub fn start_env(
        namespace: &str,
        identity: &str,
        extra: &[&str],
        store_url: &str,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(
            &["--namespace", namespace],
            namespace,
            identity,
            extra,
            store_url,
            env,
        )
    }

    /// A replica watching every namespace but reconciling only the runs
    /// labelled `selector` (so other tests' runs are left to their own
    /// controllers), electing through a Lease in `lease_namespace`.
    pub async fn start_selecting(lease_namespace: &str, selector: &str, extra: &[&str]) -> Self {
        let store_url = super::store::e2e_store_url().await;
        let scope = [
            "--lease-namespace",
            lease_namespace,
            "--run-selector",
            selector,
        ];
        Self::spawn(&scope, lease_namespace, "ctrl", extra, &store_url, &[])
    }

    fn spawn(
        scope: &[&str],
        namespace: &str,
        identity: &str,
        extra: &[&str],
        store_url: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("controller.log");
        let out = std::fs::File::create(&log).expect("log file");
        let metrics_port = super::ports::reserve();
        let step_api_port = step_api_port(namespace);
        let child = Command::new(super::binary("agentrun"))
            .arg("controller")
            .args(scope)
            .args(["--identity", identity, "--lease-seconds", "6"])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--step-api-addr", &format!("127.0.0.1:{step_api_port}")])
            .arg("--allow-failpoints")
            .args(extra)
            .env("AGENTRUN_STORE_URL", store_url)
            .env("AGENTRUN_STEP_TOKEN_KEY", step_token_key())
            // The stand-ins (MCP servers, webhooks) listen on 127.0.0.1 only,
            // a loopback address the controller refuses unless allowed.
            .env("AGENTRUN_USER_URL_ALLOW", "127.0.0.1/32")
            .env("RUST_LOG", "info,agentrun=debug")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("starting agentrun controller");
        ControllerProcess {
            child: Some(child),
            log,
            _dir: dir,
            metrics_port,
            step_api_port,
        }
    }

    /// A replica of an earlier release's controller, binary `bin`, with the
    /// flags that release had (no step-log gateway: its step pods get the
    /// store URL) and its step Jobs' image `step_image`.
    pub fn start_release(
        bin: &std::path::Path,
        namespace: &str,
        identity: &str,
        store_url: &str,
        step_image: &str,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("controller.log");
        let out = std::fs::File::create(&log).expect("log file");
        let metrics_port = super::ports::reserve();
        let child = Command::new(bin)
            .args([
                "controller",
                "--namespace",
                namespace,
                "--identity",
                identity,
            ])
            .args(["--lease-seconds", "6", "--step-image", step_image])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .arg("--allow-failpoints")
            .env("AGENTRUN_STORE_URL", store_url)
            .env("RUST_LOG", "info,agentrun=debug")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        ControllerProcess {
            child: Some(child),
            log,
            _dir: dir,
            metrics_port,
            step_api_port: step_api_port(namespace),
        }
    }

    /// The replica's process id, while it runs (for /proc figures).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Where the replica logs (a temporary dir, removed when dropped).
    pub fn log_path(&self) -> &std::path::Path {
        &self.log
    }

    /// Everything the replica logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines the replica logged (read from the file's last
    /// 16 KiB: a debug log grows to megabytes and this is read in loops).
    pub fn tail(&self, n: usize) -> String {
        use std::io::{Read, Seek, SeekFrom};
        let mut end = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = f.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)));
            let _ = f.read_to_end(&mut end);
        }
        let end = String::from_utf8_lossy(&end);
        let lines: Vec<&str> = end.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Whether the process has exited (a crash at a failpoint).
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    }

    /// Kills the replica with SIGKILL: no hand-over, its Lease runs out.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
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

/// GETs a path of a local HTTP server; returns (status code, body).
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    http_request(port, "GET", path, "").await
}

/// The value of an unlabelled sample (`name` with its `_total` suffix for a
/// counter) on the controller's /metrics; `None` when it is not exported.
/// Also `None` while nothing listens on `port` yet (a controller starting).
pub async fn metric(port: u16, name: &str) -> Option<f64> {
    let (_, text) = try_http_request(port, "GET", "/metrics", "").await.ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .find_map(|v| v.trim().parse().ok())
}

/// Sends one HTTP/1.0 request to a local server; returns (status code, body).
pub async fn http_request(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    try_http_request(port, method, path, body)
        .await
        .unwrap_or_else(|e| panic!("{method} {path} on 127.0.0.1:{port}: {e}"))
}

/// [`http_request`], its connection's failure returned.
pub async fn try_http_request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}
