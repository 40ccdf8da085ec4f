//! A test world for runs: a namespace with its own controller, stand-ins
//! and model key, plus helpers to script, create and await runs.

use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use agentrun::replay::Entry;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::controller::ControllerProcess;
use super::standins::Standins;

pub const TIMEOUT: Duration = Duration::from_secs(120);

/// A namespace with its own controller, stand-ins and model key.
pub struct World {
    pub client: kube::Client,
    pub ns: super::TestNamespace,
    pub standins: Standins,
    controller: ControllerProcess,
    controller_flags: Vec<String>,
    store_url: String,
}

impl World {
    pub async fn new(prefix: &str, controller_flags: &[&str]) -> World {
        let store_url = super::store::e2e_store_url().await;
        World::on_store(prefix, controller_flags, &store_url).await
    }

    /// A world whose controller uses the (migrated) step store at `store_url`.
    pub async fn on_store(prefix: &str, controller_flags: &[&str], store_url: &str) -> World {
        World::build(prefix, controller_flags, store_url, &[]).await
    }

    /// A world whose first controller gets extra environment variables
    /// (replicas started later do not).
    pub async fn with_controller_env(
        prefix: &str,
        controller_flags: &[&str],
        env: &[(&str, &str)],
    ) -> World {
        let store_url = super::store::e2e_store_url().await;
        World::build(prefix, controller_flags, &store_url, env).await
    }

    /// A world on the store at `store_url` whose first controller is
    /// `start(namespace)` (an earlier release's); later ones are this one's.
    pub async fn with_first_controller(
        prefix: &str,
        store_url: &str,
        start: impl FnOnce(&str) -> ControllerProcess,
    ) -> World {
        World::build_with(prefix, &[], store_url, |ns| start(ns)).await
    }

    async fn build(
        prefix: &str,
        controller_flags: &[&str],
        store_url: &str,
        env: &[(&str, &str)],
    ) -> World {
        World::build_with(prefix, controller_flags, store_url, |ns| {
            ControllerProcess::start_env(ns, "ctrl", controller_flags, store_url, env)
        })
        .await
    }

    async fn build_with(
        prefix: &str,
        controller_flags: &[&str],
        store_url: &str,
        start: impl FnOnce(&str) -> ControllerProcess,
    ) -> World {
        let client = super::admin().await;
        super::install_crds(&client).await;
        let ns = super::test_namespace(&client, prefix).await;
        let secrets: Api<Secret> = Api::namespaced(client.clone(), ns.name());
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "model-key"},
            "stringData": {"apiKey": "sk-e2e-not-a-real-key"}
        }))
        .unwrap();
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .expect("model key Secret");
        super::allow_secrets(&client, ns.name(), &["model-key"]).await;
        super::publish_keys_to_everyone(&client, ns.name()).await;
        let controller = start(ns.name());
        World {
            client,
            ns,
            standins: Standins::start(),
            controller,
            controller_flags: controller_flags.iter().map(|f| f.to_string()).collect(),
            store_url: store_url.to_string(),
        }
    }

    /// Stops the controller (SIGTERM) and starts a new one.
    pub async fn restart_controller(&mut self) {
        self.controller.stop();
        self.controller = self.replica("ctrl-2");
    }

    /// Stops the controller (SIGTERM) and starts one with extra environment
    /// variables (a rotated key), as a rollout would.
    pub fn restart_controller_env(&mut self, env: &[(&str, &str)]) {
        self.controller.stop();
        let flags: Vec<&str> = self.controller_flags.iter().map(String::as_str).collect();
        self.controller =
            ControllerProcess::start_env(self.ns.name(), "ctrl-2", &flags, &self.store_url, env);
    }

    /// Another replica of this world's controller (same flags and store),
    /// electing through the same Lease.
    pub fn replica(&self, identity: &str) -> ControllerProcess {
        let flags: Vec<&str> = self.controller_flags.iter().map(String::as_str).collect();
        ControllerProcess::start_on(self.ns.name(), identity, &flags, &self.store_url)
    }

    /// Starts a new controller if the current one exited (crashed at a
    /// failpoint); returns whether it had to.
    pub fn revive_controller(&mut self) -> bool {
        if !self.controller.exited() {
            return false;
        }
        self.controller = self.replica("ctrl-revived");
        true
    }

    /// SIGKILLs the world's first controller (no graceful hand-over).
    pub fn kill_controller(&mut self) {
        self.controller.kill();
    }

    /// Stops the world's first controller (SIGTERM) without starting another.
    pub fn stop_controller(&mut self) {
        self.controller.stop();
    }

    /// The step store this world's controller uses.
    pub async fn store(&self) -> std::sync::Arc<dyn agentrun::store::StepStore> {
        agentrun::store::open(&self.store_url).await.unwrap()
    }

    /// The controller's log so far (for a failing test's message).
    pub fn controller_log(&self) -> String {
        self.controller.log()
    }

    pub fn name(&self) -> &str {
        self.ns.name()
    }

    /// The status code of the controller's /healthz (0 when it does not answer).
    pub async fn controller_healthz(&self) -> u16 {
        let port = self.controller.metrics_port;
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            return 0;
        }
        match tokio::time::timeout(
            Duration::from_secs(5),
            super::controller::http_get(port, "/healthz"),
        )
        .await
        {
            Ok((code, _)) => code,
            Err(_) => 0,
        }
    }

    /// The process id of the world's first controller, while it runs.
    pub fn controller_pid(&self) -> Option<u32> {
        self.controller.pid()
    }

    /// Port of the running controller's /metrics.
    pub fn metrics_port(&self) -> u16 {
        self.controller.metrics_port
    }

    /// URL of the step-log gateway of this namespace's controllers.
    pub fn step_api_url(&self) -> String {
        format!(
            "http://127.0.0.1:{}",
            super::controller::step_api_port(self.name())
        )
    }

    /// The inline agent of these tests: an order lookup, an idempotent refund,
    /// and a notification tool that is not idempotent but has a lookup.
    pub fn agent(&self, script: &str) -> Value {
        let base = &self.standins.base;
        let t = self.name();
        json!({
            "prompt": {"version": "v1", "system": "You are a careful refund agent."},
            "model": {
                "provider": "OpenAI", "name": "gpt-e2e",
                "endpoint": format!("{base}/scripts/{script}/v1"),
                "secretRef": {"name": "model-key", "key": "apiKey"},
                "prices": {"inputPerMillion": 1.0, "outputPerMillion": 4.0}
            },
            "tools": [
                {"name": "lookup_order", "description": "Looks an order up.",
                 "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
                 "http": {"url": format!("{base}/tools/{t}/lookup_order"), "idempotent": true, "readOnly": true}},
                {"name": "issue_refund", "description": "Refunds an amount.",
                 "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                                 "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}}},
                 "http": {"url": format!("{base}/tools/{t}/issue_refund"), "idempotent": true}},
                {"name": "notify", "description": "Sends the customer a message.",
                 "inputSchema": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
                 "http": {"url": format!("{base}/tools/{t}/nokey/notify"), "idempotent": false,
                          "lookup": format!("{base}/tools/{t}/lookup/notify")}},
                {"name": "page_oncall", "description": "Pages the on-call engineer (no key, no lookup).",
                 "http": {"url": format!("{base}/tools/{t}/nokey/page_oncall")}},
                {"name": "create_ticket", "description": "Opens a ticket (MCP).",
                 "mcp": {"url": format!("{base}/mcp/{t}")}}
            ]
        })
    }

    pub async fn create_run(&self, name: &str, spec: Value, annotations: Value) -> AgentRun {
        let runs: Api<AgentRun> = Api::namespaced(self.client.clone(), self.name());
        let run: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": name, "annotations": annotations},
            "spec": spec
        }))
        .expect("run manifest");
        runs.create(&PostParams::default(), &run)
            .await
            .expect("creating the run")
    }

    pub async fn wait_phase(&self, name: &str, phase: Phase) -> AgentRun {
        let runs: Api<AgentRun> = Api::namespaced(self.client.clone(), self.name());
        super::wait_for(
            &format!("run {name} to reach {phase:?}"),
            TIMEOUT,
            || async {
                let run = runs.get(name).await.map_err(|e| e.to_string())?;
                let now = run.status.as_ref().and_then(|s| s.phase);
                if now.is_some_and(|p| p.is_terminal()) && now != Some(phase) {
                    panic!(
                        "run {name} ended {now:?} instead of {phase:?}: {:?}",
                        run.status
                    );
                }
                match (now, &run.status) {
                    (Some(p), _) if p == phase => Ok(run),
                    // Never looked at: say what the controller said last.
                    (_, None) => Err(format!(
                        "no status; the controller's log ends with:\n{}",
                        self.controller.tail(5)
                    )),
                    (_, status) => Err(format!("{status:?}")),
                }
            },
        )
        .await
    }

    /// Waits until run `name` waits on its MCP discovery saying why (see
    /// [`waiting_on_discovery`]).
    pub async fn wait_discovery_failing(&self, name: &str, says: &[&str]) -> AgentRun {
        waiting_on_discovery(&self.client, self.name(), name, says).await
    }

    /// The run's log, decoded, after checking its hash chain ends at the
    /// head hash recorded in the run's status.
    pub async fn log(&self, run: &AgentRun) -> Vec<(agentrun::store::Record, Entry)> {
        let store = self.store().await;
        let uid = run.metadata.uid.clone().unwrap();
        let status_log = run
            .status
            .as_ref()
            .and_then(|s| s.log.clone())
            .expect("status.log");
        let head: agentrun::store::Hash = status_log.head_hash.expect("head hash").parse().unwrap();
        let verified = store
            .verify(&uid, Some(&head))
            .await
            .expect("the log's chain verifies against status");
        assert_eq!(verified.len, status_log.length);
        store
            .read_all(&uid)
            .await
            .unwrap()
            .into_iter()
            .map(|r| {
                let step = Entry::decode(r.seq, r.kind.as_str(), &r.payload).expect("decodes");
                (r, step)
            })
            .collect()
    }
}

pub fn kinds(log: &[(agentrun::store::Record, Entry)]) -> Vec<&'static str> {
    log.iter().map(|(_, s)| s.kind()).collect()
}

pub fn call(name: &str, args: Value) -> Value {
    json!({"toolCalls": [{"name": name, "arguments": args}]})
}

pub fn finish(result: &str) -> Value {
    call("finish", json!({"result": result}))
}

/// A refund run `run` that finished (model script `script`): a lookup of
/// order 1042, a refund of 40, "refunded 40"; the script's later replies
/// are `then` (what a fork after the lookup's result is answered). The
/// run, its log and the seq of the lookup's result.
#[allow(dead_code)]
pub async fn refunded_run(
    w: &World,
    script: &str,
    run: &str,
    then: &[Value],
) -> (AgentRun, Vec<(agentrun::store::Record, Entry)>, u64) {
    let mut replies = vec![
        call("lookup_order", json!({"orderId": "1042"})),
        call("issue_refund", json!({"orderId": "1042", "amount": 40})),
        finish("refunded 40"),
    ];
    replies.extend_from_slice(then);
    w.standins.script(script, json!(replies), json!([])).await;
    w.create_run(
        run,
        json!({"input": "Refund order 1042.", "agent": w.agent(script)}),
        json!({}),
    )
    .await;
    let parent = w.wait_phase(run, Phase::Succeeded).await;
    let log = w.log(&parent).await;
    let at = log
        .iter()
        .find_map(|(r, e)| {
            matches!(e, Entry::ToolResult(t) if t.tool == "lookup_order").then_some(r.seq)
        })
        .expect("the lookup's result");
    (parent, log, at)
}

/// The agent of the real-model tests (Gemma 3 270M behind `endpoint`, in
/// `provider`'s wire format): one read-only, idempotent lookup tool, at most
/// `max_steps` records (a base model may call its tool over and over).
pub fn local_model_agent(w: &World, provider: &str, endpoint: &str, max_steps: u32) -> Value {
    let base = &w.standins.base;
    let t = w.name();
    json!({
        "prompt": {"version": "v1", "system": "You are a support agent."},
        "model": {
            "provider": provider, "name": "gemma-3-270m", "endpoint": endpoint,
            "secretRef": {"name": "model-key", "key": "apiKey"},
            "prices": {"inputPerMillion": 1.0, "outputPerMillion": 4.0},
            "maxOutputTokens": 128
        },
        "tools": [
            {"name": "lookup_order", "description": "Looks an order up by id.",
             "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
             "http": {"url": format!("{base}/tools/{t}/lookup_order"), "idempotent": true, "readOnly": true}}
        ],
        "budgets": {"maxSteps": max_steps}
    })
}

/// Waits until run `name` of `ns` waits on its MCP discovery (not ended,
/// `status.waitingOn` `mcp/discovery`, condition `ToolsDiscovered=False`
/// whose message contains each of `says`): what a run shows while a server
/// it names does not answer yet.
pub async fn waiting_on_discovery(
    client: &kube::Client,
    ns: &str,
    name: &str,
    says: &[&str],
) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    super::wait_for(
        &format!("run {name} to wait on its MCP discovery"),
        TIMEOUT,
        || async {
            let run = runs.get(name).await.map_err(|e| e.to_string())?;
            let status = run.status.clone().unwrap_or_default();
            if status.phase.is_some_and(|p| p.is_terminal()) {
                panic!("run {name} ended instead of waiting: {status:?}");
            }
            let condition = status
                .conditions
                .iter()
                .find(|c| c.type_ == "ToolsDiscovered" && c.status == "False");
            match condition {
                Some(c)
                    if status.waiting_on.as_deref() == Some("mcp/discovery")
                        && says.iter().all(|s| c.message.contains(s)) =>
                {
                    Ok(run)
                }
                _ => Err(format!("{status:?}")),
            }
        },
    )
    .await
}
