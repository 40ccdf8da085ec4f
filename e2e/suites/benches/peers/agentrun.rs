//! agentrun's side of the comparison: the same workload as AgentRuns in a
//! namespace of the local control plane, driven by this project's
//! controller, timed by watches (this machine's clock, like the stand-ins').
//! Two places: the process node (the e2e controller process, each step pod
//! a process) and the real node (the chart as a user installs it: the
//! controller's Deployment, PostgreSQL and every step pod in containers).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentrun::api::{AgentRun, Approval, Phase};
use futures::{StreamExt as _, stream};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::common::approvals::{decide_in, entry, grant_approver_role_in};
use crate::common::chart::{self, Installed, expose_host_process, install_on_real_node};
use crate::common::realnode::{self, NODE};
use crate::common::standins::Standins;
use crate::common::world::World;
use crate::common::{TestNamespace, procs, test_namespace};
use crate::trace::now;

const RUN_LABEL: &str = "agentrun.dev/run";

/// What the watches saw of one run, its Jobs and its pods (unix seconds).
#[derive(Clone, Debug, Default)]
pub struct Seen {
    pub uid: String,
    pub phase: Option<Phase>,
    /// When each phase was first seen.
    pub phases: HashMap<String, f64>,
    /// The last Approval it waited on.
    pub approval: Option<String>,
    /// When it was first seen in a final phase.
    pub ended: Option<f64>,
    /// `status.deadlineAt`.
    pub deadline_at: Option<f64>,
    /// Why it ended as it did: its conditions' messages.
    pub why: String,
    pub jobs: Vec<JobSeen>,
    /// Its pods in the order they were first seen.
    pub pods: Vec<PodSeen>,
}

impl Seen {
    /// When each of its pods was first reported started (Running, or
    /// already ended), earliest first.
    pub fn pods_running(&self) -> Vec<f64> {
        let mut started: Vec<f64> = self.pods.iter().filter_map(|p| p.started).collect();
        started.sort_by(f64::total_cmp);
        started
    }
}

/// One of a run's step pods: when the watch first saw it, bound to a node,
/// started (Running, or already ended).
#[derive(Clone, Debug)]
pub struct PodSeen {
    pub name: String,
    pub created: f64,
    pub scheduled: Option<f64>,
    pub started: Option<f64>,
}

/// One of a run's step Jobs.
#[derive(Clone, Debug)]
pub struct JobSeen {
    pub seq: u64,
    pub attempt: u32,
    /// First seen by the watch.
    pub seen: f64,
    /// `status.startTime`, what its `activeDeadlineSeconds` counts from.
    pub started: Option<f64>,
    /// First seen with a failed pod counted.
    pub failed: Option<f64>,
}

#[derive(Clone, Default)]
pub struct Watched(Arc<Mutex<HashMap<String, Seen>>>);

impl Watched {
    pub fn get(&self, run: &str) -> Seen {
        self.0.lock().unwrap().get(run).cloned().unwrap_or_default()
    }

    fn with(&self, run: &str, f: impl FnOnce(&mut Seen)) {
        f(self.0.lock().unwrap().entry(run.to_string()).or_default())
    }

    /// How many of `runs` satisfy `pred`.
    pub fn count(&self, runs: &[String], pred: impl Fn(&Seen) -> bool) -> usize {
        let all = self.0.lock().unwrap();
        runs.iter()
            .filter(|r| all.get(*r).is_some_and(&pred))
            .count()
    }
}

/// Where agentrun runs the workload.
enum Place {
    /// The e2e controller process on the shared PostgreSQL, its stand-ins,
    /// step pods as processes of the process node.
    Process(World),
    /// The chart installed in a namespace of the real node's cluster.
    Real(RealNode),
}

/// Dropped in field order: the release uninstalled, then the namespace.
struct RealNode {
    _installed: Installed,
    standins: Standins,
    ns: TestNamespace,
}

/// The namespace agentrun's runs live in: its controller, the stand-ins
/// every system shares, approvers, and the watches.
pub struct Agentrun {
    pub client: Client,
    place: Place,
    /// The stand-ins' base URL as step pods reach it.
    pod_base: String,
    pub seen: Watched,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Agentrun {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The workload's task: `[[run NAME]]` is how the stand-ins tell runs apart.
pub fn task(run: &str) -> String {
    format!("Handle the refunds of the queue. [[run {run}]]")
}

/// Whether the cluster runs the real node (`e2e/cluster up --node=real`).
pub async fn real_node_cluster(client: &Client) -> bool {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    matches!(nodes.get_opt(NODE).await, Ok(Some(_)))
}

impl Agentrun {
    /// On whichever node the cluster has.
    pub async fn new() -> Agentrun {
        let admin = crate::common::admin().await;
        match real_node_cluster(&admin).await {
            true => Agentrun::on_real_node(admin).await,
            false => Agentrun::on_process_node().await,
        }
    }

    async fn on_process_node() -> Agentrun {
        let w = World::new("peers", &[]).await;
        let pod_base = w.standins.base.clone();
        Agentrun::watching(w.client.clone(), Place::Process(w), pod_base).await
    }

    async fn on_real_node(client: Client) -> Agentrun {
        let node_ip = realnode::node_ip(&client).await.to_string();
        let ns = test_namespace(&client, "peers").await;
        let name = ns.name().to_string();
        let standins = Standins::start_on(&format!("{node_ip}:0"));
        let port: u16 = standins.base.rsplit(':').next().unwrap().parse().unwrap();
        expose_host_process(&client, &name, "standins", &node_ip, port).await;
        // By the Service's cluster IP, not its name: once in a quick run,
        // 10 step pods starting together got EAI_AGAIN from the test
        // node's resolver for seconds; the figures are the engine's, not
        // the resolver's (the chart's test covers reaching it by name).
        let svc: k8s_openapi::api::core::v1::Service = Api::namespaced(client.clone(), &name)
            .get("standins")
            .await
            .expect("the stand-ins' Service");
        let ip = svc
            .spec
            .and_then(|s| s.cluster_ip)
            .expect("the stand-ins' cluster IP");
        let pod_base = format!("http://{ip}:{port}");
        // The chart's defaults, as a user gets them.
        let installed = install_on_real_node(&client, &name, json!({})).await;
        let secret =
            json!({"metadata": {"name": "model-key"}, "stringData": {"apiKey": "sk-bench"}});
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), &name)
            .create(
                &PostParams::default(),
                &serde_json::from_value(secret).unwrap(),
            )
            .await
            .expect("the model's Secret");
        // The platform owner's opt-in for it (the chart's controller hands
        // step pods only Secrets an AgentPolicy lists).
        let policy = json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
            "metadata": {"name": "platform"},
            "spec": {"allowedSecrets": [{"name": "model-key"}]}
        });
        Api::<agentrun::api::AgentPolicy>::namespaced(client.clone(), &name)
            .create(
                &PostParams::default(),
                &serde_json::from_value(policy).unwrap(),
            )
            .await
            .expect("the AgentPolicy");
        let real = RealNode {
            _installed: installed,
            standins,
            ns,
        };
        Agentrun::watching(client, Place::Real(real), pod_base).await
    }

    async fn watching(client: Client, place: Place, pod_base: String) -> Agentrun {
        let seen = Watched::default();
        let mut a = Agentrun {
            client,
            place,
            pod_base,
            seen,
            tasks: Vec::new(),
        };
        grant_approver_role_in(&a.client, a.name()).await;
        a.tasks = vec![
            watch_runs(&a.client, a.name(), a.seen.clone()),
            watch_jobs(&a.client, a.name(), a.seen.clone()),
            watch_pods(&a.client, a.name(), a.seen.clone()),
        ];
        a
    }

    /// The system's name in the figures.
    pub fn label(&self) -> &'static str {
        match self.place {
            Place::Process(_) => "agentrun",
            Place::Real(_) => "agentrun_real",
        }
    }

    /// The namespace.
    pub fn name(&self) -> &str {
        match &self.place {
            Place::Process(w) => w.name(),
            Place::Real(r) => r.ns.name(),
        }
    }

    pub fn standins(&self) -> &Standins {
        match &self.place {
            Place::Process(w) => &w.standins,
            Place::Real(r) => &r.standins,
        }
    }

    /// What the stand-ins answer on, for the peers (host processes).
    pub fn standins_base(&self) -> String {
        self.standins().base.clone()
    }

    /// The engine's processes: the controller (process node), or every
    /// container of the controller's pods (real node).
    pub async fn engine_pids(&self) -> Vec<u32> {
        match &self.place {
            Place::Process(w) => w.controller_pid().into_iter().collect(),
            Place::Real(_) => {
                self.pods_pids("app.kubernetes.io/component=controller")
                    .await
            }
        }
    }

    /// The store's processes: the machine's PostgreSQL (process node), or
    /// the chart's PostgreSQL pod (real node).
    pub async fn database_pids(&self) -> Vec<u32> {
        match &self.place {
            Place::Process(_) => procs::postgres_pids(),
            Place::Real(_) => {
                self.pods_pids("app.kubernetes.io/component=postgresql")
                    .await
            }
        }
    }

    async fn pods_pids(&self, selector: &str) -> Vec<u32> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), self.name());
        let listed = pods
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap_or_else(|e| panic!("listing pods {selector}: {e}"));
        let pids: Vec<u32> = listed
            .items
            .iter()
            .flat_map(|p| procs::pod_pids(&p.uid().unwrap_or_default()))
            .collect();
        assert!(!pids.is_empty(), "no processes of the pods {selector}");
        pids
    }

    /// The step store's URL as this process reaches it: the shared
    /// PostgreSQL, or the chart's at its pod's address (the host routes to
    /// the node's pod network).
    pub async fn store_url(&self) -> String {
        match &self.place {
            Place::Process(_) => crate::common::store::e2e_store_url().await,
            Place::Real(_) => {
                let secrets: Api<k8s_openapi::api::core::v1::Secret> =
                    Api::namespaced(self.client.clone(), self.name());
                let secret = secrets
                    .get(&format!("{}-store", chart::RELEASE))
                    .await
                    .expect("the chart's store Secret");
                let url = secret
                    .data
                    .and_then(|d| d.get("url").cloned())
                    .map(|b| String::from_utf8(b.0).expect("a UTF-8 URL"))
                    .expect("the store Secret's url");
                let pod: Pod = Api::namespaced(self.client.clone(), self.name())
                    .get(&format!("{}-postgresql-0", chart::RELEASE))
                    .await
                    .expect("the chart's PostgreSQL pod");
                let ip = pod
                    .status
                    .and_then(|s| s.pod_ip)
                    .expect("PostgreSQL's pod IP");
                let host = format!("{}-postgresql.{}.svc", chart::RELEASE, self.name());
                url.replace(&host, &ip)
            }
        }
    }

    /// The controller's last lines, for a failure message.
    pub fn controller_log(&self) -> String {
        match &self.place {
            Place::Process(w) => w.controller_log(),
            Place::Real(r) => {
                let (_, out) = chart::run_cmd(std::process::Command::new("kubectl").args([
                    "logs",
                    "-n",
                    r.ns.name(),
                    "-l",
                    "app.kubernetes.io/component=controller",
                    "--tail=30",
                ]));
                format!("{out}\n{}", chart::diagnose(r.ns.name()))
            }
        }
    }

    /// Agent `name`: the model on script `script`, the two tools on tenant
    /// `tenant`, every refund gated; `extra` merged into its spec.
    pub async fn agent(&self, name: &str, script: &str, tenant: &str, extra: Value) {
        let base = &self.pod_base;
        let mut spec = json!({
            "prompt": {"version": "v1", "system": "You are a careful refund agent."},
            "model": {
                "provider": "OpenAI", "name": "gpt-bench",
                "endpoint": format!("{base}/scripts/{script}/v1"),
                "secretRef": {"name": "model-key", "key": "apiKey"}
            },
            "tools": [
                {"name": "lookup_order", "description": "Looks an order up.",
                 "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
                 "http": {"url": format!("{base}/tools/{tenant}/lookup_order"), "idempotent": true, "readOnly": true}},
                {"name": "issue_refund", "description": "Refunds an amount.",
                 "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                                 "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}}},
                 "http": {"url": format!("{base}/tools/{tenant}/issue_refund"), "idempotent": true}}
            ],
            "approval": {"rules": [{
                "name": "refund", "tool": "issue_refund", "when": "true",
                "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "24h", "onExpiry": "Fail"
            }]}
        });
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            s.extend(e.clone());
        }
        let agents: Api<agentrun::api::Agent> = Api::namespaced(self.client.clone(), self.name());
        let agent = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
            "metadata": {"name": name}, "spec": spec
        }))
        .expect("Agent manifest");
        agents
            .create(&PostParams::default(), &agent)
            .await
            .unwrap_or_else(|e| panic!("creating Agent {name}: {e}"));
    }

    /// Creates the runs of Agent `agent` (16 at a time); when each create
    /// was sent.
    pub async fn create_runs(
        &self,
        agent: &str,
        names: &[String],
        extra: Value,
    ) -> HashMap<String, f64> {
        let runs: Api<AgentRun> = Api::namespaced(self.client.clone(), self.name());
        stream::iter(names.iter().cloned())
            .map(|name| {
                let runs = runs.clone();
                let mut spec = json!({"input": task(&name), "agentRef": {"name": agent}});
                if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
                    s.extend(e.clone());
                }
                async move {
                    let run: AgentRun = serde_json::from_value(json!({
                        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                        "metadata": {"name": name}, "spec": spec
                    }))
                    .expect("run manifest");
                    let sent = now();
                    runs.create(&PostParams::default(), &run)
                        .await
                        .unwrap_or_else(|e| panic!("creating run {name}: {e}"));
                    (name, sent)
                }
            })
            .buffer_unordered(16)
            .collect()
            .await
    }

    /// Waits (up to `timeout`) until every run of `names` satisfies `pred`.
    pub async fn wait_all(
        &self,
        what: &str,
        names: &[String],
        timeout: Duration,
        pred: impl Fn(&Seen) -> bool,
    ) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let n = self.seen.count(names, &pred);
            if n == names.len() {
                return;
            }
            if tokio::time::Instant::now() > deadline {
                let late: Vec<String> = names
                    .iter()
                    .filter(|r| !pred(&self.seen.get(r)))
                    .take(5)
                    .map(|r| format!("{r}: {:?}", self.seen.get(r).phase))
                    .collect();
                panic!(
                    "agentrun: {n} of {} runs {what} after {timeout:?}; e.g. {late:?}\n{}",
                    names.len(),
                    self.controller_log()
                        .lines()
                        .rev()
                        .take(30)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn wait_succeeded(&self, names: &[String], timeout: Duration) {
        self.wait_all("succeeded", names, timeout, |s| {
            if s.phase
                .is_some_and(|p| p.is_terminal() && p != Phase::Succeeded)
            {
                panic!("a run ended {:?} instead of Succeeded: {}", s.phase, s.why);
            }
            s.phase == Some(Phase::Succeeded)
        })
        .await
    }

    /// Approves run `run`'s Approval as bob (what `kubectl agentrun approve`
    /// writes); when the patch was sent.
    pub async fn approve(&self, run: &str) -> f64 {
        let name = self
            .seen
            .get(run)
            .approval
            .expect("the run awaits an Approval");
        let approvals: Api<Approval> = Api::namespaced(self.client.clone(), self.name());
        let a = approvals.get(&name).await.expect("the Approval");
        let hash = a.spec.arguments_hash.clone();
        let sent = now();
        decide_in(
            self.name(),
            "bob",
            &name,
            entry("bob", "Approve", &hash, "bench"),
        )
        .await
        .unwrap_or_else(|e| panic!("approving {name}: {e}"));
        sent
    }

    /// Deletes the runs (their Approvals and Jobs go with them).
    pub async fn delete_runs(&self, names: &[String]) {
        let runs: Api<AgentRun> = Api::namespaced(self.client.clone(), self.name());
        stream::iter(names.iter().cloned())
            .for_each_concurrent(16, |name| {
                let runs = runs.clone();
                async move {
                    let _ = runs.delete(&name, &DeleteParams::background()).await;
                }
            })
            .await;
    }

    /// The step process of run `uid` (its pod's container on the process
    /// node, found by the run in its environment), if one runs.
    pub fn step_process(&self, uid: &str) -> Option<i32> {
        let wanted = format!("AGENTRUN_RUN_UID={uid}");
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .find(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == wanted.as_bytes()))
            })
    }

    /// The JSON size of the namespace's AgentRuns and Approvals, as the API
    /// server stores them.
    pub async fn api_bytes(&self) -> usize {
        let runs: Api<AgentRun> = Api::namespaced(self.client.clone(), self.name());
        let approvals: Api<Approval> = Api::namespaced(self.client.clone(), self.name());
        let r = runs
            .list(&ListParams::default())
            .await
            .expect("listing runs");
        let a = approvals
            .list(&ListParams::default())
            .await
            .expect("listing approvals");
        r.items.iter().map(json_len).sum::<usize>() + a.items.iter().map(json_len).sum::<usize>()
    }

    /// Step pods of the namespace still running (finished ones stay until
    /// their Job's TTL, holding nothing).
    /// How many step pods of `runs` still run, and Jobs of theirs are let
    /// go but not yet removed (`ttlSecondsAfterFinished: 0`). An earlier
    /// step's ended Job, left behind before its run came to wait, keeps its
    /// usual time to live and is not counted.
    pub async fn not_yet_let_go(&self, runs: &[String]) -> usize {
        let ns = self.name();
        let of_runs = |labels: Option<&std::collections::BTreeMap<String, String>>| {
            labels
                .and_then(|l| l.get(RUN_LABEL))
                .is_some_and(|r| runs.contains(r))
        };
        let lp = ListParams::default().labels(RUN_LABEL);
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), ns);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let let_go =
            |j: &Job| j.spec.as_ref().and_then(|s| s.ttl_seconds_after_finished) == Some(0);
        let running = |p: &Pod| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        };
        let jobs = jobs.list(&lp).await.map_or(usize::MAX / 2, |l| {
            l.items
                .iter()
                .filter(|j| of_runs(j.metadata.labels.as_ref()) && let_go(j))
                .count()
        });
        let pods = pods.list(&lp).await.map_or(usize::MAX / 2, |l| {
            l.items
                .iter()
                .filter(|p| of_runs(p.metadata.labels.as_ref()) && running(p))
                .count()
        });
        jobs + pods
    }

    /// How many step Jobs of `runs` exist, in any state.
    pub async fn jobs_of(&self, runs: &[String]) -> usize {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), self.name());
        jobs.list(&ListParams::default().labels(RUN_LABEL))
            .await
            .map_or(0, |l| {
                l.items
                    .iter()
                    .filter(|j| j.labels().get(RUN_LABEL).is_some_and(|r| runs.contains(r)))
                    .count()
            })
    }
}

fn unix_ts(t: &jiff::Timestamp) -> f64 {
    t.as_microsecond() as f64 / 1e6
}

fn json_len<T: serde::Serialize>(v: &T) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

fn watch_runs(client: &Client, ns: &str, seen: Watched) -> JoinHandle<()> {
    let api: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let Ok(watcher::Event::Apply(run) | watcher::Event::InitApply(run)) = event else {
                continue;
            };
            let t = now();
            let status = run.status.clone().unwrap_or_default();
            seen.with(&run.name_any(), |s| {
                s.uid = run.uid().unwrap_or_default();
                s.phase = status.phase;
                if let Some(p) = status.phase {
                    s.phases.entry(format!("{p:?}")).or_insert(t);
                }
                // Kept once the run is past it (the status drops it).
                if let Some(a) = status.approval {
                    s.approval = Some(a.name);
                }
                if status.phase.is_some_and(|p| p.is_terminal()) {
                    s.ended = s.ended.or(Some(t));
                }
                s.deadline_at = status.deadline_at.map(|d| unix_ts(&d.0));
                s.why = status
                    .conditions
                    .iter()
                    .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                    .collect::<Vec<_>>()
                    .join("; ");
            });
        }
    })
}

fn watch_jobs(client: &Client, ns: &str, seen: Watched) -> JoinHandle<()> {
    let api: Api<Job> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let Ok(watcher::Event::Apply(job) | watcher::Event::InitApply(job)) = event else {
                continue;
            };
            let t = now();
            let label = |k: &str| job.labels().get(k).cloned().unwrap_or_default();
            let (seq, attempt) = (
                label("agentrun.dev/seq").parse().unwrap_or(0),
                label("agentrun.dev/attempt").parse().unwrap_or(0),
            );
            let status = job.status.clone().unwrap_or_default();
            let started = status.start_time.as_ref().map(|t| unix_ts(&t.0));
            let failed = (status.failed.unwrap_or(0) > 0).then_some(t);
            seen.with(&label(RUN_LABEL), |s| {
                match s
                    .jobs
                    .iter_mut()
                    .find(|j| j.seq == seq && j.attempt == attempt)
                {
                    Some(j) => {
                        j.started = j.started.or(started);
                        j.failed = j.failed.or(failed);
                    }
                    None => s.jobs.push(JobSeen {
                        seq,
                        attempt,
                        seen: t,
                        started,
                        failed,
                    }),
                }
            });
        }
    })
}

fn watch_pods(client: &Client, ns: &str, seen: Watched) -> JoinHandle<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
                continue;
            };
            let t = now();
            // A short pod on the real node may be reported Succeeded with
            // no Running report in between (the kubelet batches its status
            // writes): its first report of a started container counts.
            let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
            let started = matches!(phase.as_deref(), Some("Running" | "Succeeded" | "Failed"));
            let scheduled = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
            let run = pod.labels().get(RUN_LABEL).cloned().unwrap_or_default();
            let name = pod.name_any();
            seen.with(&run, |s| {
                let i = match s.pods.iter().position(|p| p.name == name) {
                    Some(i) => i,
                    None => {
                        s.pods.push(PodSeen {
                            name,
                            created: t,
                            scheduled: None,
                            started: None,
                        });
                        s.pods.len() - 1
                    }
                };
                let p = &mut s.pods[i];
                if scheduled && p.scheduled.is_none() {
                    p.scheduled = Some(t);
                }
                if started && p.started.is_none() {
                    p.started = Some(t);
                }
            });
        }
    })
}
