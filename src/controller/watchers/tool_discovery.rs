//! MCP discovery outside the reconcile: a reconcile asks for a run's catalog
//! and gets either the answer or "pending"; a worker task does the I/O and
//! wakes the run when it is done. So no reconcile ever waits on a URL a user
//! chose, and what discovery costs is bounded:
//!
//! - in time: each server gets `--discovery-server-timeout-seconds`, and a
//!   run's whole discovery `--discovery-deadline-seconds` (counted once it
//!   has its turn);
//! - in concurrency: `--discovery-concurrency` discoveries at once, of which
//!   one namespace holds `--discovery-namespace-concurrency` at most (a
//!   namespace queues for its own permits before the shared ones, so the
//!   shared queue never holds more than that many of one namespace);
//! - in count: [`MAX_MCP_SERVERS`] servers per agent (refused before any
//!   request, naming the field), [`crate::tools::MAX_TOOLS_PER_SERVER`]
//!   tools per server.
//!
//! A result (catalog or failure) is kept in the run's memory until the run
//! records it ([`Discovery::forget`]), finishes or is deleted: one discovery
//! per run and agent version at a time. A failure is asked again after a backoff ([`retry_after`]: 5 s,
//! doubling to 5 minutes), as a kubelet pulls an image again: the server
//! may be arriving in the same apply as the run (its run waits, saying
//! why, until its deadline). Only the controller's memory holds it; the
//! log keeps the catalog the run pinned (`RunStarted`, `VersionChanged`).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use tokio::sync::{Semaphore, mpsc};

use crate::api::{AgentRun, ToolSpec};
use crate::controller::memory::{Ask, AskState, RunMemory};
use crate::egress::Policy;
use crate::tools::{DiscoveryBounds, McpCatalog, discover_catalog_with};

/// Distinct MCP servers one agent may name.
pub const MAX_MCP_SERVERS: usize = 8;

/// The bounds of discovery (controller flags).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub per_server: Duration,
    pub deadline: Duration,
    pub concurrency: usize,
    pub namespace_concurrency: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_server: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            concurrency: 8,
            namespace_concurrency: 2,
        }
    }
}

/// What a reconcile gets when it asks for a catalog.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// The catalog, or why there is none (naming the field or the server).
    Ready(Result<McpCatalog, crate::refusal::Refusal>),
    /// Being discovered: the run is woken when the answer is there.
    Pending,
    /// Discovery failed (naming the server): asked again in `retry_in`.
    Failed { reason: String, retry_in: Duration },
}

/// How long after its `failures`-th failure in a row a discovery is asked
/// again: 5 s, doubling, at most 5 minutes.
pub fn retry_after(failures: u32) -> Duration {
    let doubled = 5u64.saturating_mul(1 << failures.saturating_sub(1).min(6));
    Duration::from_secs(doubled.min(300))
}

struct Shared {
    http: reqwest::Client,
    policy: Arc<Policy>,
    limits: Limits,
    global: Arc<Semaphore>,
    namespaces: Mutex<HashMap<String, Arc<Semaphore>>>,
    memory: Arc<RunMemory>,
    wake: mpsc::UnboundedSender<ObjectRef<AgentRun>>,
}

/// The discovery worker (cheap to clone).
#[derive(Clone)]
pub struct Discovery {
    shared: Arc<Shared>,
}

/// Why an agent names too many MCP servers, naming the field (`spec.tools`,
/// `spec.agent.tools`).
pub fn too_many(tools: &[ToolSpec], field: &str) -> Option<String> {
    let servers: BTreeSet<&str> = tools
        .iter()
        .filter_map(|t| t.mcp.as_ref().map(|m| m.url.as_str()))
        .collect();
    if servers.len() > MAX_MCP_SERVERS {
        return Some(format!(
            "{field}: {} distinct MCP servers (mcp.url), at most {MAX_MCP_SERVERS} per agent",
            servers.len()
        ));
    }
    None
}

/// Why an agent's MCP servers cannot be discovered before any request is
/// made: too many, or an address the platform does not allow.
pub fn refuse(tools: &[ToolSpec], field: &str, policy: &Policy) -> Option<String> {
    if let Some(why) = too_many(tools, field) {
        return Some(why);
    }
    for (i, tool) in tools.iter().enumerate() {
        if let Some(mcp) = &tool.mcp
            && let Err(e) = policy.check_url(&mcp.url)
        {
            return Some(format!("{field}[{i}].mcp.url (tool {:?}): {e}", tool.name));
        }
    }
    None
}

impl Discovery {
    /// The worker, and the stream of runs whose answer became ready (for
    /// the controller's `reconcile_on`).
    pub fn new(
        http: reqwest::Client,
        policy: Arc<Policy>,
        limits: Limits,
        memory: Arc<RunMemory>,
    ) -> (Discovery, mpsc::UnboundedReceiver<ObjectRef<AgentRun>>) {
        let (wake, woken) = mpsc::unbounded_channel();
        let shared = Shared {
            http,
            policy,
            limits,
            global: Arc::new(Semaphore::new(limits.concurrency.max(1))),
            namespaces: Mutex::default(),
            memory,
            wake,
        };
        (
            Discovery {
                shared: Arc::new(shared),
            },
            woken,
        )
    }

    /// The catalog of `tools` for `run`: at once when no MCP server is
    /// named or the tools are refused, else once discovered.
    pub fn catalog(&self, run: &AgentRun, tools: &[ToolSpec], field: &str) -> Answer {
        if tools.iter().all(|t| t.mcp.is_none()) {
            return Answer::Ready(Ok(McpCatalog::new()));
        }
        if let Some(refused) = refuse(tools, field, &self.shared.policy) {
            return Answer::Ready(Err(refused.into()));
        }
        let uid = String::from(crate::api::RunUid::of(run));
        let key = ask_key(tools);
        self.shared
            .memory
            .ask(&uid, |ask| self.answer_or_ask(ask, run, &uid, key, tools))
    }

    /// The answer `ask` holds for `key`, or a new discovery in its place
    /// (dropping one asked for other tools aborts it: the agent changed).
    fn answer_or_ask(
        &self,
        ask: &mut Option<Ask>,
        run: &AgentRun,
        uid: &str,
        key: String,
        tools: &[ToolSpec],
    ) -> Answer {
        let mut failures = 0;
        if let Some(ask) = ask.as_ref().filter(|a| a.key == key) {
            match &ask.state {
                AskState::Done(Ok(catalog)) => return Answer::Ready(Ok(catalog.clone())),
                AskState::Running(_) => return Answer::Pending,
                AskState::Done(Err(reason)) => {
                    let wait = retry_after(ask.failures + 1);
                    if let Some(retry_in) = wait.checked_sub(ask.since.elapsed())
                        && !retry_in.is_zero()
                    {
                        return Answer::Failed {
                            reason: reason.to_string(),
                            retry_in,
                        };
                    }
                    failures = ask.failures + 1;
                }
            }
        }
        let task = tokio::spawn(self.clone().discover(
            ObjectRef::from_obj(run),
            uid.to_string(),
            key.clone(),
            tools.to_vec(),
        ));
        *ask = Some(Ask {
            key,
            state: AskState::Running(task.abort_handle()),
            since: Instant::now(),
            failures,
        });
        Answer::Pending
    }

    /// Drops the run's answer once the run recorded it.
    pub fn forget(&self, uid: &str) {
        self.shared.memory.ask(uid, |ask| *ask = None);
    }

    /// Runs one discovery in its turn and wakes the run with the answer.
    async fn discover(
        self,
        run: ObjectRef<AgentRun>,
        uid: String,
        key: String,
        tools: Vec<ToolSpec>,
    ) {
        let ns = run.namespace.clone().unwrap_or_default();
        let _turn = self.turn(&ns).await;
        let limits = self.shared.limits;
        let bounds = DiscoveryBounds {
            per_server: limits.per_server,
            total: limits.deadline,
            ..Default::default()
        };
        let work = discover_catalog_with(&self.shared.http, &tools, bounds);
        // A backstop: each server's own timeout ends within the deadline.
        let backstop = limits.deadline.saturating_add(Duration::from_secs(1));
        let result = match tokio::time::timeout(backstop, work).await {
            Ok(Ok(catalog)) => Ok(catalog),
            Ok(Err(e)) => Err(format!("discovering MCP tools: {e}")),
            Err(_) => Err(format!(
                "discovering MCP tools: not done within {:?} (--discovery-deadline-seconds)",
                limits.deadline
            )),
        };
        self.shared.memory.answer(&uid, |ask| {
            if ask.key == key {
                ask.state = AskState::Done(result.map_err(crate::refusal::Refusal::from));
                ask.since = Instant::now();
            }
        });
        let _ = self.shared.wake.send(run);
    }

    /// Waits for a permit of the namespace, then for a shared one.
    async fn turn(
        &self,
        ns: &str,
    ) -> (
        tokio::sync::OwnedSemaphorePermit,
        tokio::sync::OwnedSemaphorePermit,
    ) {
        let own = {
            let mut namespaces = self.shared.namespaces.lock().expect("not poisoned");
            // Namespaces nobody waits in are dropped (the map stays small).
            namespaces.retain(|_, s| Arc::strong_count(s) > 1);
            namespaces
                .entry(ns.to_string())
                .or_insert_with(|| {
                    Arc::new(Semaphore::new(
                        self.shared.limits.namespace_concurrency.max(1),
                    ))
                })
                .clone()
        };
        let own = own.acquire_owned().await.expect("never closed");
        let shared = self
            .shared
            .global
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        (own, shared)
    }
}

/// What identifies a request for discovery: the MCP tools asked for.
fn ask_key(tools: &[ToolSpec]) -> String {
    let wanted: Vec<_> = tools
        .iter()
        .filter_map(|t| t.mcp.as_ref().map(|m| (&t.name, &m.url, &m.tool)))
        .collect();
    serde_json::to_string(&wanted).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mcp(name: &str, url: &str) -> ToolSpec {
        serde_json::from_value(serde_json::json!({"name": name, "mcp": {"url": url}})).unwrap()
    }

    fn http() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    /// The test servers' address, allowed as `--user-url-allow` would.
    fn loopback() -> Arc<Policy> {
        let allow = vec!["127.0.0.1/32".parse().unwrap()];
        Arc::new(Policy::new(allow, Vec::new(), true))
    }

    fn run(uid: &str, ns: &str) -> AgentRun {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": uid, "namespace": ns, "uid": uid},
            "spec": {"input": "x", "agentRef": {"name": "a"}}
        }))
        .unwrap()
    }

    #[test]
    fn too_many_servers_are_refused_naming_the_field() {
        let tools: Vec<_> = (0..=MAX_MCP_SERVERS)
            .map(|i| mcp(&format!("t{i}"), &format!("http://10.0.0.{i}/mcp")))
            .collect();
        let why = too_many(&tools, "spec.agent.tools").unwrap();
        assert!(
            why.starts_with("spec.agent.tools: 9 distinct MCP servers"),
            "{why}"
        );
        // Many tools of one server are one server.
        let same: Vec<_> = (0..20)
            .map(|i| mcp(&format!("t{i}"), "http://h/mcp"))
            .collect();
        assert_eq!(too_many(&same, "spec.tools"), None);
        let metadata = [mcp("t", "http://169.254.169.254/mcp")];
        let why = refuse(&metadata, "spec.tools", &Policy::default()).unwrap();
        assert!(why.starts_with("spec.tools[0].mcp.url"), "{why}");
    }

    /// A server that accepts connections and never answers.
    async fn hanging_server() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = seen.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(conn);
            }
        });
        (format!("http://{addr}/mcp"), seen)
    }

    #[tokio::test]
    async fn a_hanging_server_ends_in_one_recorded_failure_and_the_run_is_woken() {
        let (url, seen) = hanging_server().await;
        let limits = Limits {
            per_server: Duration::from_millis(200),
            deadline: Duration::from_secs(5),
            ..Default::default()
        };
        let (d, mut woken) = Discovery::new(http(), loopback(), limits, Arc::default());
        let r = run("u1", "a");
        let tools = [mcp("t", &url)];
        assert_eq!(d.catalog(&r, &tools, "spec.tools"), Answer::Pending);
        assert_eq!(d.catalog(&r, &tools, "spec.tools"), Answer::Pending);
        let woke = tokio::time::timeout(Duration::from_secs(5), woken.recv()).await;
        assert_eq!(woke.unwrap().unwrap().name, "u1");
        let Answer::Failed { reason, retry_in } = d.catalog(&r, &tools, "spec.tools") else {
            panic!("no failure recorded");
        };
        assert!(
            reason.contains(&url) && reason.contains("no answer within"),
            "{reason}"
        );
        assert!(retry_in <= retry_after(1), "{retry_in:?}");
        // Asking again within the backoff gives the same answer, without
        // another request.
        assert!(matches!(
            d.catalog(&r, &tools, "spec.tools"),
            Answer::Failed { .. }
        ));
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_discovery_is_asked_again_after_a_doubling_backoff() {
        let waits: Vec<u64> = (1..=9).map(|n| retry_after(n).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
    }

    /// A server that is not there yet (a GitOps apply brings it with the
    /// run): the run's discovery fails, is asked again once its backoff is
    /// over, and succeeds once the server answers.
    #[tokio::test]
    async fn a_server_arriving_after_the_run_is_discovered_on_a_later_ask() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let url = format!("http://{addr}/mcp");
        let (d, mut woken) = Discovery::new(http(), loopback(), Limits::default(), Arc::default());
        let r = run("u1", "a");
        let tools = [mcp("lookup", &url)];
        assert_eq!(d.catalog(&r, &tools, "spec.tools"), Answer::Pending);
        tokio::time::timeout(Duration::from_secs(5), woken.recv())
            .await
            .unwrap();
        let Answer::Failed { reason, .. } = d.catalog(&r, &tools, "spec.tools") else {
            panic!("the refused connection is a failure");
        };
        assert!(reason.contains(&url), "{reason}");
        // The backoff over (as time passes), the next ask discovers again.
        d.shared.memory.answer("u1", |a| a.since -= retry_after(1));
        assert_eq!(d.catalog(&r, &tools, "spec.tools"), Answer::Pending);
        let mut failures = 0;
        d.shared.memory.answer("u1", |a| failures = a.failures);
        assert_eq!(failures, 1);
    }

    /// A run let go of (finished, or leadership lost) stops its discovery:
    /// the task in flight is aborted, its permits return, and no answer is
    /// kept for it.
    #[tokio::test]
    async fn a_run_let_go_of_stops_its_discovery() {
        let (url, _) = hanging_server().await;
        let (d, _woken) = Discovery::new(http(), loopback(), Limits::default(), Arc::default());
        let all = Limits::default().concurrency;
        assert_eq!(
            d.catalog(&run("u1", "a"), &[mcp("t", &url)], "spec.tools"),
            Answer::Pending
        );
        let wait = |want| {
            let d = d.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(5), async {
                    while d.shared.global.available_permits() != want {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("the permits as expected")
            }
        };
        wait(all - 1).await;
        d.shared.memory.finished("u1");
        wait(all).await;
        let mut kept = false;
        d.shared.memory.answer("u1", |_| kept = true);
        assert!(!kept);
    }

    #[tokio::test]
    async fn one_namespace_holds_at_most_its_share_of_the_permits() {
        let (url, _) = hanging_server().await;
        let limits = Limits {
            per_server: Duration::from_secs(30),
            deadline: Duration::from_secs(30),
            concurrency: 3,
            namespace_concurrency: 2,
        };
        let (d, _woken) = Discovery::new(http(), loopback(), limits, Arc::default());
        for i in 0..10 {
            d.catalog(&run(&format!("a{i}"), "a"), &[mcp("t", &url)], "spec.tools");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Ten runs of one namespace wait; one shared permit is left for others.
        assert_eq!(d.shared.global.available_permits(), 1);
        let (b, _) = hanging_server().await;
        d.catalog(&run("b", "b"), &[mcp("t", &b)], "spec.tools");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(d.shared.global.available_permits(), 0);
    }

    #[tokio::test]
    async fn an_agent_without_mcp_servers_gets_its_empty_catalog_at_once() {
        let (d, _woken) = Discovery::new(http(), loopback(), Limits::default(), Arc::default());
        let http: ToolSpec =
            serde_json::from_value(serde_json::json!({"name": "h", "http": {"url": "http://h/x"}}))
                .unwrap();
        assert_eq!(
            d.catalog(&run("u", "a"), &[http], "spec.tools"),
            Answer::Ready(Ok(McpCatalog::new()))
        );
    }
}
