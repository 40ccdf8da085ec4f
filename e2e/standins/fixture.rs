//! The stand-ins as a test fixture: the model, tool and MCP servers
//! (`agentrun-standins`, this package's binary) started as one process per
//! test, killed when dropped; and where tests find the workspace's binaries
//! ([`binaries`]). The in-process tests (tests/) and the cluster suites
//! (e2e/suites) share this one copy.

#[cfg(feature = "built-binaries")]
pub mod binaries;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

use serde_json::{Value, json};

pub struct Standins {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    /// `http://IP:PORT`
    pub base: String,
    pub http: reqwest::Client,
}

impl Standins {
    /// The binary `e2e/build-binaries` built (the suites, which belong to
    /// another package).
    #[cfg(feature = "built-binaries")]
    pub fn start() -> Standins {
        Self::start_on("127.0.0.1:0")
    }

    /// The binary cargo built for this package's own tests
    /// (`env!("CARGO_BIN_EXE_agentrun-standins")`): a bare `cargo test` on a
    /// fresh clone needs nothing a script built.
    pub fn start_exe(exe: &Path) -> Standins {
        Self::spawn(exe, "127.0.0.1:0")
    }

    /// Listening on `addr` (`IP:0` takes a free port): on the real node's
    /// address, pods reach it.
    #[cfg(feature = "built-binaries")]
    pub fn start_on(addr: &str) -> Standins {
        Self::spawn(&binaries::built("agentrun-standins"), addr)
    }

    fn spawn(exe: &Path, addr: &str) -> Standins {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut child = Command::new(exe)
            .args(["--addr", addr])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting agentrun-standins");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("reading the stand-in's first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the stand-in: {line:?}"))
            .to_string();
        Standins {
            child,
            _stdout: stdout,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
        }
    }

    /// Creates model script `id`: replies answered by call count, and
    /// `summaries` for requests that offer no tools.
    pub async fn script(&self, id: &str, replies: Value, summaries: Value) {
        self.put_script(id, json!({ "replies": replies, "summaries": summaries }))
            .await;
    }

    /// Creates model script `id` that answers by conversation turn (the
    /// stand-in's `byTurn` mode): asking again gets the same answer.
    pub async fn script_by_turn(&self, id: &str, replies: Value, summaries: Value) {
        self.put_script(
            id,
            json!({ "replies": replies, "summaries": summaries, "byTurn": true }),
        )
        .await;
    }

    /// The chart tests' model scripts: `refund-demo` (the sample run: a
    /// lookup, a 40.00 refund, the answer) and `refund-big` (a 150.00 refund
    /// of order 1043, which needs a finance approver, then the answer).
    pub async fn script_refund_samples(&self) {
        self.script(
            "refund-demo",
            json!([
                {"text": "Let me look the order up first.", "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "1042"}}]},
                {"text": "Refunding the damaged item.", "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 40}}]},
                {"toolCalls": [{"name": "finish", "arguments": {"result": "Refunded 40.00 for order 1042."}}]}
            ]),
            json!([]),
        )
        .await;
        self.script(
            "refund-big",
            json!([
                {"text": "Refunding the whole order.", "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1043", "amount": 150}}]},
                {"toolCalls": [{"name": "finish", "arguments": {"result": "Refunded 150.00 for order 1043."}}]}
            ]),
            json!([]),
        )
        .await;
    }

    async fn put_script(&self, id: &str, body: Value) {
        let resp = self
            .http
            .put(format!("{}/scripts/{id}", self.base))
            .json(&body)
            .send()
            .await
            .expect("PUT script");
        assert!(
            resp.status().is_success(),
            "PUT script: {}",
            resp.text().await.unwrap_or_default()
        );
    }

    /// Failure injection and delays for tenant `t`'s tools (`PUT _config`).
    pub async fn configure_tools(&self, tenant: &str, config: Value) {
        let resp = self
            .http
            .put(format!("{}/tools/{tenant}/_config", self.base))
            .json(&config)
            .send()
            .await
            .expect("PUT _config");
        assert!(resp.status().is_success(), "PUT _config: {}", resp.status());
    }

    /// The request bodies script `id` received.
    pub async fn model_requests(&self, id: &str) -> Vec<Value> {
        let v: Value = self.get(&format!("/scripts/{id}/calls")).await;
        v["requests"].as_array().cloned().unwrap_or_default()
    }

    /// Real side effects of tenant `t`'s tools.
    pub async fn effects(&self, tenant: &str) -> Vec<Value> {
        self.get::<Value>(&format!("/tools/{tenant}/_effects"))
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Every request tenant `t`'s tools received, failed ones too.
    pub async fn tool_requests(&self, tenant: &str) -> Vec<Value> {
        self.get::<Value>(&format!("/tools/{tenant}/_requests"))
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    pub async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }
}

impl Drop for Standins {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
