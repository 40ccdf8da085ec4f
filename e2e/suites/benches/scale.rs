//! The controller at scale (run by `bash e2e/bench scale`, which brings up
//! PostgreSQL and the local control plane and sets the environment).
//!
//! Prints one line per figure: `bench: scale.<name> <value> <unit>`.
//!
//! - `scale.dispatch.*`: controller overhead between two step Jobs of a run:
//!   the Job of seq S+1 seen ADDED by this harness's Job watch (local clock)
//!   minus `created_at` of record S, the last record the previous Job
//!   appended (PostgreSQL's clock, same machine). The controller runs with
//!   `--time-slice-seconds 0`, so every step is one Job: a model call, or a
//!   tool call with its intent. `active1` from runs started one after the
//!   other; `heldN` from the same, while N other runs are active (each
//!   holds a step Job: a running pod with the run's lease, heartbeating, in
//!   a tool call answered after hours), the controller's overhead of N
//!   active runs apart from the API server's queueing; `activeN` from N
//!   runs started together (N = ACTIVE), which is that queueing.
//!   `*.controller.{reconcile_started,job_created}.*` are the controller's
//!   own view (`agentrun_dispatch_seconds`): record S stored → the reconcile
//!   acting on it began / its Job create returned, without this harness's
//!   watch; quantiles interpolated within the histogram's buckets (1.5x apart).
//! - `scale.held.*`: the N held runs: pods running, controller CPU and RSS,
//!   API requests while the probes ran; all cancelled afterwards.
//! - `scale.burst.*`: those N runs of 5 steps (5 Jobs) each, started
//!   together: time to all Succeeded, steps/s, controller CPU and peak RSS.
//! - `scale.approval.*`: with W runs waiting for approval (W = WAITING), a
//!   decision patched on a sample of their Approvals, one at a time: patch
//!   returned → the run's next Job ADDED in the watch.
//! - `scale.idle.*`: the W runs waiting and nothing else happening, over a
//!   window: pods, controller RSS and CPU, store reads (PostgreSQL table
//!   statistics and the controller's own counters) and API writes (watch
//!   events on AgentRuns, Approvals, Jobs, Pods and Events of the namespace;
//!   the leader-election Lease's renewals are by design and not counted).
//! - `scale.long.*`: one run of L records (many cheap tool steps, the
//!   default time slice) until it waits for approval at the end: wall time,
//!   the controller's store bytes read per reconcile (first vs last 10% of
//!   the log), the AgentRun object's size.
//! - `scale.restart.*`: the controller restarted while that run waits with
//!   its full log; its Approval is decided as the new process starts:
//!   process start → the run's next Job ADDED.
//!
//! Environment: AGENTRUN_SCALE_ACTIVE (1000; 0: no burst),
//! AGENTRUN_SCALE_HELD (as ACTIVE), AGENTRUN_SCALE_WAITING
//! (10000), AGENTRUN_SCALE_LONG_STEPS (100000), AGENTRUN_SCALE_IDLE_SECONDS
//! (60), AGENTRUN_SCALE_APPROVALS (30), AGENTRUN_SCALE_BASELINE_RUNS (10);
//! AGENTRUN_SCALE_SHORT=1 or `--short`: 50 active, 200 waiting, 2,000-record
//! long run, 20 s idle window. AGENTRUN_SCALE_ONLY=active,waiting,long runs
//! a subset; AGENTRUN_SCALE_CONTROLLER_FLAGS adds controller flags and
//! AGENTRUN_SCALE_CONTROLLER_ENV (`NAME=VALUE ...`) its environment. Controller
//! logs (AGENTRUN_SCALE_CONTROLLER_LOG: their RUST_LOG, default info), each
//! Job's dispatch time and the long run's samples go to AGENTRUN_SCALE_OUT
//! (default `$AGENTRUN_STATE_DIR/bench-scale`, `/tmp/agentrun-state/bench-scale`).
//!
//! Without `--bench` (`cargo test`, which `e2e/test` runs on its cluster with
//! real step processes): check mode, 3 active, 5 waiting, a 120-record long
//! run, a 5 s idle window, and the promises behind the figures asserted
//! (`check_figures`); a `cargo test` name filter other than `scale` skips it.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentrun::api::{AgentRun, Approval, Phase};
use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod, Secret};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, Resource, ResourceExt as _};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use common::controller::ControllerProcess;
use common::procs;
use common::standins::Standins;

const CONTROLLER: &str = "bench-ctrl";

// --- configuration and output ------------------------------------------------

struct Config {
    short: bool,
    /// Run by `cargo test` (no `--bench`): tiny sizes, and the promises the
    /// figures stand for are asserted ([`check_figures`]).
    check: bool,
    active: usize,
    waiting: usize,
    long_steps: u64,
    idle: Duration,
    approvals: usize,
    baseline_runs: usize,
    /// Runs holding their step (a tool call that answers after an hour)
    /// while the probe runs go through theirs: the concurrently active runs
    /// of the dispatch figure (`dispatch.held<N>`).
    held: usize,
    /// A second idle window once every step Job is gone (their TTL is 600 s).
    quiet: bool,
    /// Runs that made no progress for this long are reported as stuck.
    stall: Duration,
    /// Model turns per run of the active phase: 3 is 5 steps (Jobs).
    turns: usize,
    create_concurrency: usize,
    controller_flags: Vec<String>,
    only: Option<HashSet<String>>,
    out: PathBuf,
}

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        _ => default,
    }
}

impl Config {
    fn from_env() -> Config {
        let short = std::env::args().any(|a| a == "--short")
            || std::env::var("AGENTRUN_SCALE_SHORT").is_ok_and(|v| v == "1" || v == "true");
        let check = !std::env::args().any(|a| a == "--bench");
        let (active, waiting, long, idle, approvals) = if check {
            (3, 5, 120, 5, 2)
        } else if short {
            (50, 200, 2_000, 20, 10)
        } else {
            (1_000, 10_000, 100_000, 60, 30)
        };
        let state =
            std::env::var("AGENTRUN_STATE_DIR").unwrap_or_else(|_| "/tmp/agentrun-state".into());
        Config {
            short,
            check,
            active: env_num("AGENTRUN_SCALE_ACTIVE", active),
            waiting: env_num("AGENTRUN_SCALE_WAITING", waiting),
            long_steps: env_num("AGENTRUN_SCALE_LONG_STEPS", long),
            idle: Duration::from_secs(env_num("AGENTRUN_SCALE_IDLE_SECONDS", idle)),
            approvals: env_num("AGENTRUN_SCALE_APPROVALS", approvals),
            baseline_runs: env_num(
                "AGENTRUN_SCALE_BASELINE_RUNS",
                match (check, short) {
                    (true, _) => 2,
                    (_, true) => 5,
                    _ => 10,
                },
            ),
            held: env_num("AGENTRUN_SCALE_HELD", active),
            turns: 3,
            stall: Duration::from_secs(env_num("AGENTRUN_SCALE_STALL_SECONDS", 120)),
            quiet: env_num("AGENTRUN_SCALE_QUIET", u8::from(!short && !check)) == 1,
            create_concurrency: env_num("AGENTRUN_SCALE_CREATE_CONCURRENCY", 16),
            controller_flags: std::env::var("AGENTRUN_SCALE_CONTROLLER_FLAGS")
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect(),
            only: std::env::var("AGENTRUN_SCALE_ONLY")
                .ok()
                .filter(|v| !v.is_empty())
                .map(|v| v.split(',').map(|s| s.trim().to_string()).collect()),
            out: std::env::var("AGENTRUN_SCALE_OUT")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(state).join("bench-scale")),
        }
    }

    fn runs(&self, part: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.contains(part))
    }
}

fn figure(name: &str, value: f64, unit: &str) {
    let v = if (value.fract() == 0.0 && value.abs() < 1e15) || value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    };
    println!("bench: scale.{name} {v} {unit}");
    FIGURES.lock().unwrap().push((name.to_string(), value));
}

/// Every figure printed, for [`check_figures`].
static FIGURES: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

/// What `cargo test` asserts from a check-mode run's figures: every run
/// ended as it should, waiting runs hold no pod and cause no periodic writes
/// or store reads, the long run's object stays small and each of its
/// records is read about once. Timings are not asserted (benchmark only).
fn check_figures() {
    let figures = FIGURES.lock().unwrap().clone();
    let mut failed = Vec::new();
    let mut expect = |what: &str, pred: &dyn Fn(&str) -> bool, ok: &dyn Fn(&str, f64) -> bool| {
        let found: Vec<&(String, f64)> = figures.iter().filter(|(n, _)| pred(n)).collect();
        if found.is_empty() {
            failed.push(format!("{what}: no figure"));
        }
        for (name, v) in found.into_iter().filter(|(n, v)| !ok(n, *v)) {
            failed.push(format!("{what}: {name} = {v}"));
        }
    };
    // `<prefix><N>.<figure>` is N.
    let is_n = |prefix: &'static str| {
        move |n: &str, v: f64| {
            n[prefix.len()..]
                .split('.')
                .next()
                .and_then(|c| c.parse().ok())
                == Some(v)
        }
    };
    // `burst.runs<N>.succeeded` is N.
    expect(
        "every run of the burst succeeded",
        &|n| n.starts_with("burst.runs") && n.ends_with(".succeeded"),
        &is_n("burst.runs"),
    );
    expect(
        "every held run held its step while the probes ran",
        &|n| n.starts_with("held.runs") && n.ends_with(".holding"),
        &is_n("held.runs"),
    );
    expect(
        "every held run was cancelled",
        &|n| n.starts_with("held.runs") && n.ends_with(".cancelled"),
        &is_n("held.runs"),
    );
    expect(
        "every probe run succeeded while the others held",
        &|n| n.starts_with("held.runs") && n.ends_with(".probes_not_succeeded"),
        &|_, v| v == 0.0,
    );
    expect(
        "the probe runs' Jobs were dispatched while the others held",
        &|n| n.starts_with("dispatch.held") && n.ends_with(".samples"),
        &|_, v| v > 0.0,
    );
    expect(
        "waiting runs hold no pod",
        &|n| n.starts_with("idle.") && n.ends_with(".pods"),
        &|_, v| v == 0.0,
    );
    for what in [
        ".reconciles_per_min",
        ".store_reads_per_min",
        ".api_writes_per_min.agentruns",
        ".api_writes_per_min.approvals",
    ] {
        expect(
            &format!("nothing periodic while runs wait ({what})"),
            &|n| n.starts_with("idle.") && n.ends_with(what),
            &|_, v| v == 0.0,
        );
    }
    expect(
        "the long run's AgentRun stays under 4 KB",
        &|n| n.starts_with("long.") && n.contains(".agentrun_object"),
        &|_, v| v <= 4096.0,
    );
    expect(
        "each of the long run's records is read about once while it runs",
        &|n| n.starts_with("long.") && n.ends_with(".read_records_per_record_running"),
        &|_, v| v <= 1.5,
    );
    expect(
        "the restarted controller resumed the long run at its checkpoint",
        &|n| n.starts_with("restart.") && n.ends_with(".resumed_at_checkpoint"),
        &|_, v| v >= 1.0,
    );
    expect(
        "the long run succeeded after the controller restart",
        &|n| n.starts_with("restart.") && n.ends_with(".succeeded"),
        &|_, v| v == 1.0,
    );
    assert!(
        failed.is_empty(),
        "scale check failed:\n{}",
        failed.join("\n")
    );
}

fn note(msg: &str) {
    eprintln!("[scale] {msg}");
}

/// Nearest-rank percentile of unsorted values (0 when empty).
fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn latency_figures(name: &str, ms: &[f64]) {
    figure(&format!("{name}.p50"), percentile(ms, 0.50), "ms");
    figure(&format!("{name}.p99"), percentile(ms, 0.99), "ms");
    figure(&format!("{name}.max"), percentile(ms, 1.0), "ms");
    figure(&format!("{name}.samples"), ms.len() as f64, "samples");
}

// --- waiting with a deadline --------------------------------------------------

/// Polls `probe` every 100 ms until it returns Ok; panics after `timeout`
/// with what it last saw; says what it waits for every 30 s.
async fn wait_until<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    let mut told = Instant::now();
    loop {
        match probe() {
            Ok(v) => return v,
            Err(seen) => {
                if start.elapsed() > timeout {
                    panic!("timed out after {timeout:?} waiting for {what}; last saw: {seen}");
                }
                if told.elapsed() > Duration::from_secs(30) {
                    note(&format!(
                        "waiting for {what} ({:.0} s): {seen}",
                        start.elapsed().as_secs_f64()
                    ));
                    told = Instant::now();
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `probe` reports all `total` there; gives up on the rest when
/// nothing changed for `stall` (stuck: reported, not waited for forever)
/// and panics after `timeout`. Returns how many got there and when the
/// last of them did.
async fn wait_settled(
    what: &str,
    total: usize,
    timeout: Duration,
    stall: Duration,
    mut probe: impl FnMut() -> (usize, String),
) -> (usize, Instant) {
    let every = Duration::from_millis(100);
    wait_settled_every(what, total, timeout, stall, every, || {
        std::future::ready(probe())
    })
    .await
}

/// [`wait_settled`] with a probe that has to await (a request to a peer),
/// polled `every` so often.
async fn wait_settled_every<F, Fut>(
    what: &str,
    total: usize,
    timeout: Duration,
    stall: Duration,
    every: Duration,
    mut probe: F,
) -> (usize, Instant)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (usize, String)>,
{
    let start = Instant::now();
    let (mut last_n, mut last_change, mut told) = (usize::MAX, Instant::now(), Instant::now());
    loop {
        let (n, seen) = probe().await;
        if n != last_n {
            (last_n, last_change) = (n, Instant::now());
        }
        if n >= total {
            return (n, last_change);
        }
        if last_change.elapsed() > stall {
            note(&format!(
                "{what}: {n} of {total} after {:.0} s, nothing changed for {} s; going on without the rest: {seen}",
                start.elapsed().as_secs_f64(),
                stall.as_secs()
            ));
            return (n, last_change);
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}; last saw: {n} of {total}: {seen}"
        );
        if told.elapsed() > Duration::from_secs(30) {
            note(&format!(
                "waiting for {what} ({:.0} s): {n} of {total}: {seen}",
                start.elapsed().as_secs_f64()
            ));
            told = Instant::now();
        }
        tokio::time::sleep(every).await;
    }
}

/// Names of `runs` the probe says are stuck, with their phase, for a note.
fn stuck(ns: &Ns, runs: &[String], ok: impl Fn(&RunSeen) -> bool) -> Vec<String> {
    runs.iter()
        .filter(|n| !ns.runs.get(n).is_some_and(|r| ok(&r)))
        .map(|n| format!("{n} ({:?})", ns.runs.get(n).and_then(|r| r.phase)))
        .collect()
}

// --- what the harness watches -------------------------------------------------

#[derive(Clone, Debug)]
struct JobSeen {
    deleted: bool,
    run: String,
    seq: u64,
    attempt: u32,
    /// When this harness's watch first saw the Job (wall clock, and monotonic).
    added: DateTime<Utc>,
    at: Instant,
}

/// Every Job of a namespace, by name, as first seen by a watch.
#[derive(Clone, Default)]
struct Jobs(Arc<Mutex<HashMap<String, JobSeen>>>);

impl Jobs {
    fn of_run(&self, run: &str) -> Vec<JobSeen> {
        let jobs = self.0.lock().unwrap();
        let mut v: Vec<JobSeen> = jobs.values().filter(|j| j.run == run).cloned().collect();
        v.sort_by_key(|j| (j.seq, j.attempt));
        v
    }
    fn all(&self) -> Vec<JobSeen> {
        self.0.lock().unwrap().values().cloned().collect()
    }
    /// Jobs not deleted yet.
    fn live(&self) -> usize {
        self.0
            .lock()
            .unwrap()
            .values()
            .filter(|j| !j.deleted)
            .count()
    }
}

#[derive(Clone, Debug, Default)]
struct RunSeen {
    uid: String,
    phase: Option<Phase>,
    approval: Option<String>,
    log_len: u64,
    resource_version: String,
    /// When a new resourceVersion of the run was last seen.
    changed_at: Option<Instant>,
    done_at: Option<Instant>,
    awaiting_at: Option<Instant>,
}

/// Every AgentRun of a namespace, by name.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, RunSeen>>>);

impl Runs {
    fn get(&self, name: &str) -> Option<RunSeen> {
        self.0.lock().unwrap().get(name).cloned()
    }
    /// When any run last changed.
    fn last_change(&self) -> Option<Instant> {
        self.0
            .lock()
            .unwrap()
            .values()
            .filter_map(|r| r.changed_at)
            .max()
    }
    /// How many of `names` satisfy `pred`, and a phase summary of all of them.
    fn count(&self, names: &[String], pred: impl Fn(&RunSeen) -> bool) -> (usize, String) {
        let runs = self.0.lock().unwrap();
        let mut by_phase: BTreeMap<String, usize> = BTreeMap::new();
        let mut n = 0;
        for name in names {
            match runs.get(name) {
                Some(r) => {
                    *by_phase.entry(format!("{:?}", r.phase)).or_default() += 1;
                    n += usize::from(pred(r));
                }
                None => *by_phase.entry("unseen".into()).or_default() += 1,
            }
        }
        (n, format!("{by_phase:?}"))
    }
}

/// Non-terminal pods of a namespace.
#[derive(Clone, Default)]
struct Pods(Arc<Mutex<HashMap<String, bool>>>);

impl Pods {
    fn active(&self) -> usize {
        self.0.lock().unwrap().values().filter(|a| **a).count()
    }
}

fn label(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, key: &str) -> String {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(key))
        .cloned()
        .unwrap_or_default()
}

fn watch_jobs(client: &Client, ns: &str, jobs: Jobs) -> JoinHandle<()> {
    let api: Api<Job> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = stream.next().await {
            let job = match event {
                Ok(watcher::Event::Apply(j) | watcher::Event::InitApply(j)) => j,
                Ok(watcher::Event::Delete(j)) => {
                    if let Some(seen) = jobs.0.lock().unwrap().get_mut(&j.name_any()) {
                        seen.deleted = true;
                    }
                    continue;
                }
                Ok(_) => continue,
                Err(e) => {
                    note(&format!("Job watch: {e}"));
                    continue;
                }
            };
            let (now, at) = (Utc::now(), Instant::now());
            let name = job.name_any();
            jobs.0
                .lock()
                .unwrap()
                .entry(name)
                .or_insert_with(|| JobSeen {
                    deleted: false,
                    run: label(&job.metadata, "agentrun.dev/run"),
                    seq: label(&job.metadata, "agentrun.dev/seq")
                        .parse()
                        .unwrap_or(0),
                    attempt: label(&job.metadata, "agentrun.dev/attempt")
                        .parse()
                        .unwrap_or(0),
                    added: now,
                    at,
                });
        }
    })
}

fn watch_runs(client: &Client, ns: &str, runs: Runs) -> JoinHandle<()> {
    let api: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = stream.next().await {
            let run = match event {
                Ok(watcher::Event::Apply(r) | watcher::Event::InitApply(r)) => r,
                Ok(_) => continue,
                Err(e) => {
                    note(&format!("AgentRun watch: {e}"));
                    continue;
                }
            };
            let now = Instant::now();
            let status = run.status.clone().unwrap_or_default();
            let mut runs = runs.0.lock().unwrap();
            let seen = runs.entry(run.name_any()).or_default();
            let rv = run.resource_version().unwrap_or_default();
            if seen.resource_version != rv {
                seen.resource_version = rv;
                seen.changed_at = Some(now);
            }
            seen.uid = run.uid().unwrap_or_default();
            seen.phase = status.phase;
            seen.approval = status.approval.map(|a| a.name);
            seen.log_len = status.log.map_or(0, |l| l.length);
            if seen.phase.is_some_and(|p| p.is_terminal()) && seen.done_at.is_none() {
                seen.done_at = Some(now);
            }
            if seen.phase == Some(Phase::AwaitingApproval) && seen.awaiting_at.is_none() {
                seen.awaiting_at = Some(now);
            }
        }
    })
}

fn watch_pods(client: &Client, ns: &str, pods: Pods) -> JoinHandle<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                    let active = !matches!(phase, Some("Succeeded" | "Failed"));
                    pods.0.lock().unwrap().insert(p.name_any(), active);
                }
                Ok(watcher::Event::Delete(p)) => {
                    pods.0.lock().unwrap().remove(&p.name_any());
                }
                Ok(_) => {}
                Err(e) => note(&format!("Pod watch: {e}")),
            }
        }
    })
}

// --- the controller process from outside ---------------------------------------

/// CPU seconds used so far by each part of the machine's work: the control
/// plane's components, the process node (step pods included when they run
/// in process), the controller, PostgreSQL (backends that exited are in the
/// postmaster's children times), this harness, and the whole machine busy.
fn cpu_by_component(controller: u32) -> BTreeMap<&'static str, f64> {
    let tck = procs::clock_ticks();
    let mut out = BTreeMap::new();
    for (name, file) in [
        ("etcd", "etcd"),
        ("apiserver", "apiserver"),
        ("kube_controller_manager", "controller-manager"),
        ("scheduler", "scheduler"),
        ("process_node", "node"),
    ] {
        if let Some(pid) = procs::cluster_pid(file) {
            let t = procs::proc_times(pid);
            // The node's children are pod processes, reaped by it.
            out.insert(name, (t[0] + t[1] + t[2] + t[3]) / tck);
        }
    }
    let t = procs::proc_times(controller);
    out.insert("controller", (t[0] + t[1]) / tck);
    let t = procs::proc_times(std::process::id());
    out.insert("harness", (t[0] + t[1]) / tck);
    // PostgreSQL: the postmaster (with its reaped backends) and live backends.
    out.insert("postgres", procs::cpu_seconds(&procs::postgres_pids()));
    // The machine: every CPU's non-idle time.
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    if let Some(line) = stat.lines().next() {
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        if v.len() >= 5 {
            let total: f64 = v.iter().take(8).sum();
            out.insert("machine_busy", (total - v[3] - v[4]) / tck);
        }
    }
    out
}

/// The API server's request counts so far, by verb, resource and subresource.
async fn api_requests(client: &Client) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(req) = axum::http::Request::get("/metrics").body(Vec::new()) else {
        return out;
    };
    let Ok(text) = client.request_text(req).await else {
        return out;
    };
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let label = |key: &str| {
            series
                .split(&format!("{key}=\""))
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or("")
                .to_string()
        };
        let mut key = format!("{} {}", label("verb"), label("resource"));
        let sub = label("subresource");
        if !sub.is_empty() {
            key = format!("{key}/{sub}");
        }
        *out.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// API requests between two [`api_requests`] readings: the total rate as a
/// figure, the busiest kinds as notes.
fn api_figures(prefix: &str, a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>, secs: f64) {
    let mut deltas: Vec<(f64, &String)> = b
        .iter()
        .map(|(k, v)| (v - a.get(k).copied().unwrap_or(0.0), k))
        .filter(|(d, _)| *d > 0.0)
        .collect();
    deltas.sort_by(|x, y| y.0.total_cmp(&x.0));
    let total: f64 = deltas.iter().map(|(d, _)| d).sum();
    figure(
        &format!("{prefix}.api_requests_per_s"),
        total / secs,
        "requests/s",
    );
    let top: Vec<String> = deltas
        .iter()
        .take(12)
        .map(|(d, k)| format!("{k} {d:.0}"))
        .collect();
    note(&format!(
        "{prefix}: API requests (all clients): {}",
        top.join(", ")
    ));
}

/// Per-component CPU between two [`cpu_by_component`] readings, as figures.
fn cpu_figures(
    prefix: &str,
    a: &BTreeMap<&'static str, f64>,
    b: &BTreeMap<&'static str, f64>,
    secs: f64,
) {
    let mut parts = 0.0;
    for (name, after) in b {
        let d = after - a.get(name).copied().unwrap_or(0.0);
        figure(&format!("{prefix}.cpu.{name}"), 100.0 * d / secs, "%core");
        if *name != "machine_busy" {
            parts += d;
        }
    }
    // What else ran on the machine meanwhile (builds, other tests): noise.
    if let (Some(x), Some(y)) = (a.get("machine_busy"), b.get("machine_busy")) {
        figure(
            &format!("{prefix}.cpu.not_the_benchmark"),
            (100.0 * (y - x - parts) / secs).max(0.0),
            "%core",
        );
    }
}

/// Sums every sample of `name` (all label sets) in a Prometheus exposition.
fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let base = series.split('{').next().unwrap_or(series);
        if base == name
            && let Ok(v) = value.parse::<f64>()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// The cumulative buckets `(le, count)` of the series of a histogram that
/// carries `label` (`stage="job_created"`), in any label order.
fn histogram(text: &str, name: &str, label: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .filter_map(|rest| {
            let (labels, count) = rest.split_once("} ")?;
            let labels: Vec<&str> = labels.split(',').collect();
            if !labels.contains(&label) {
                return None;
            }
            let le = labels
                .iter()
                .find_map(|l| l.strip_prefix("le="))?
                .trim_matches('"');
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.parse().ok()?))
        })
        .collect()
}

/// The `q` quantile of the observations between two scrapes of a histogram,
/// interpolated within its bucket as Prometheus's `histogram_quantile` does.
fn histogram_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let counts: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, c)| *c);
            (*le, n - was)
        })
        .collect();
    let total = counts.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (le, n) in counts {
        if n >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let within = if n > below {
                (rank - below) / (n - below)
            } else {
                1.0
            };
            return Some(lower + (le - lower) * within);
        }
        (lower, below) = (le, n);
    }
    None
}

/// The controller's own view of dispatch (`agentrun_dispatch_seconds`)
/// between two scrapes, by stage, as p50/p99 in ms.
fn controller_dispatch_figures(name: &str, before: &str, after: &str) {
    const METRIC: &str = "agentrun_dispatch_seconds";
    for stage in ["reconcile_started", "job_created"] {
        let labels = format!("stage=\"{stage}\"");
        let (b, a) = (
            histogram(before, METRIC, &labels),
            histogram(after, METRIC, &labels),
        );
        for (q, tag) in [(0.5, "p50"), (0.99, "p99")] {
            if let Some(secs) = histogram_quantile(&b, &a, q) {
                figure(
                    &format!("{name}.controller.{stage}.{tag}"),
                    secs * 1000.0,
                    "ms",
                );
            }
        }
    }
}

async fn metrics_text(port: u16) -> String {
    match tokio::time::timeout(
        Duration::from_secs(10),
        common::controller::http_get(port, "/metrics"),
    )
    .await
    {
        Ok((200, body)) => body,
        _ => String::new(),
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct StoreCounters {
    reconciliations: f64,
    in_flight: f64,
    reads: Option<f64>,
    read_records: Option<f64>,
    read_bytes: Option<f64>,
}

async fn store_counters(port: u16) -> StoreCounters {
    let text = metrics_text(port).await;
    // Reconciles started but not finished: a hung one holds its run forever.
    let finished = metric_sum(&text, "agentrun_reconcile_duration_seconds_count");
    StoreCounters {
        in_flight: metric_sum(&text, "agentrun_reconciliations_total")
            .zip(finished)
            .map_or(0.0, |(s, f)| s - f),
        reconciliations: metric_sum(&text, "agentrun_reconciliations_total").unwrap_or(0.0),
        reads: metric_sum(&text, "agentrun_store_reads_total"),
        read_records: metric_sum(&text, "agentrun_store_read_records_total"),
        read_bytes: metric_sum(&text, "agentrun_store_read_bytes_total"),
    }
}

// --- the bench world -------------------------------------------------------------

struct Bench {
    cfg: Config,
    client: Client,
    alice: Client,
    standins: Standins,
    store_url: String,
    pg: sqlx::PgPool,
}

/// One namespace with its controller and the harness's watches.
struct Ns {
    name: String,
    _guard: common::TestNamespace,
    controller: ControllerProcess,
    flags: Vec<String>,
    jobs: Jobs,
    runs: Runs,
    pods: Pods,
    tasks: Vec<JoinHandle<()>>,
    part: String,
}

impl Drop for Ns {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Ns {
    fn pid(&self) -> u32 {
        self.controller.pid().expect("the controller runs")
    }

    /// Keeps the controller's log (its own file goes with the process), and
    /// says how many of its reconciles are still running.
    async fn save_log(&self, bench: &Bench, suffix: &str) {
        let m = store_counters(self.controller.metrics_port).await;
        if m.in_flight > 0.0 {
            note(&format!(
                "{}: {} reconciles started and not finished (agentrun_reconciliations_total - agentrun_reconcile_duration_seconds_count)",
                self.part, m.in_flight
            ));
        }
        let _ = std::fs::create_dir_all(&bench.cfg.out);
        let path = bench
            .cfg
            .out
            .join(format!("{}{suffix}-controller.log", self.part));
        if std::fs::copy(self.controller.log_path(), &path).is_ok() {
            note(&format!("controller log: {}", path.display()));
        }
    }

    async fn wait_controller_up(&self) {
        let port = self.controller.metrics_port;
        let start = Instant::now();
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                let (code, _) = common::controller::http_get(port, "/healthz").await;
                if code == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the controller did not answer /healthz within 60 s:\n{}",
                self.controller.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn start_controller(
        name: &str,
        identity: &str,
        flags: &[String],
        store_url: &str,
    ) -> ControllerProcess {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        // info, not the tests' debug: logging is part of what a replica costs.
        let log = std::env::var("AGENTRUN_SCALE_CONTROLLER_LOG").unwrap_or_else(|_| "info".into());
        let extra = std::env::var("AGENTRUN_SCALE_CONTROLLER_ENV").unwrap_or_default();
        let env: Vec<(&str, &str)> = std::iter::once(("RUST_LOG", log.as_str()))
            .chain(extra.split_whitespace().filter_map(|kv| kv.split_once('=')))
            .collect();
        ControllerProcess::start_env(name, identity, &flags, store_url, &env)
    }

    async fn create_runs(&self, bench: &Bench, names: &[String], input: &str) -> Duration {
        self.create_runs_with(
            bench,
            names,
            json!({"input": input, "agentRef": {"name": "bench"}}),
        )
        .await
    }

    /// Creates runs `names` with `spec`, `create_concurrency` at a time.
    async fn create_runs_with(&self, bench: &Bench, names: &[String], spec: Value) -> Duration {
        let api: Api<AgentRun> = Api::namespaced(bench.client.clone(), &self.name);
        let start = Instant::now();
        futures::stream::iter(names.iter().cloned())
            .map(|name| {
                let (api, spec) = (api.clone(), spec.clone());
                async move {
                    let run: AgentRun = serde_json::from_value(json!({
                        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                        "metadata": {"name": name},
                        "spec": spec
                    }))
                    .expect("run manifest");
                    let mut tries = 0;
                    loop {
                        match api.create(&PostParams::default(), &run).await {
                            Ok(_) => break,
                            Err(kube::Error::Api(e)) if e.code == 409 => break,
                            Err(e) if tries < 20 => {
                                tries += 1;
                                note(&format!("creating {name}: {e}; retrying"));
                                tokio::time::sleep(Duration::from_millis(500)).await;
                            }
                            Err(e) => panic!("creating run {name}: {e}"),
                        }
                    }
                }
            })
            .buffer_unordered(bench.cfg.create_concurrency)
            .collect::<Vec<()>>()
            .await;
        start.elapsed()
    }
}

impl Bench {
    async fn new(cfg: Config) -> Bench {
        let client = common::admin().await;
        common::install_crds(&client).await;
        let store_url = common::store::migrated_database_url("agentrun_bench").await;
        let pg = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&store_url)
            .await
            .expect("connecting to the bench database");
        Bench {
            alice: common::client_as("alice").await,
            standins: Standins::start(),
            cfg,
            client,
            store_url,
            pg,
        }
    }

    fn agent(&self, ns: &str, script: &str, context: Option<Value>) -> Value {
        let base = &self.standins.base;
        let mut agent = json!({
            "prompt": {"version": "v1", "system": "You are a careful refund agent."},
            "model": {
                "provider": "OpenAI", "name": "gpt-bench",
                "endpoint": format!("{base}/scripts/{script}/v1"),
                "secretRef": {"name": "model-key", "key": "apiKey"},
                "prices": {"inputPerMillion": 1.0, "outputPerMillion": 4.0}
            },
            "tools": [
                {"name": "lookup_order", "description": "Looks an order up.",
                 "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
                 "http": {"url": format!("{base}/tools/{ns}/lookup_order"), "idempotent": true, "readOnly": true}},
                {"name": "issue_refund", "description": "Refunds an amount.",
                 "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                                 "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}}},
                 "http": {"url": format!("{base}/tools/{ns}/issue_refund"), "idempotent": true}}
            ],
            "approval": {"rules": [{
                "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
                "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "24h", "onExpiry": "Fail"
            }]}
        });
        if let Some(c) = context {
            agent["context"] = c;
        }
        agent
    }

    /// A namespace with the model key, the Agent `bench`, approvers, the
    /// harness's watches and a controller with `flags`.
    async fn namespace(
        &self,
        part: &str,
        flags: &[&str],
        replies: Value,
        context: Option<Value>,
    ) -> Ns {
        let guard = common::test_namespace(&self.client, &format!("scale-{part}")).await;
        let name = guard.name().to_string();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &name);
        secrets
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "model-key"},
                    "stringData": {"apiKey": "sk-bench-not-a-real-key"}
                }))
                .unwrap(),
            )
            .await
            .expect("model key Secret");
        common::allow_secrets(&self.client, &name, &["model-key"]).await;
        let bindings: Api<RoleBinding> = Api::namespaced(self.client.clone(), &name);
        bindings
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "approvers"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agentrun-approver"},
                    "subjects": [{"kind": "Group", "name": "finance-approvers", "apiGroup": "rbac.authorization.k8s.io"}]
                }))
                .unwrap(),
            )
            .await
            .expect("approvers RoleBinding");
        self.standins
            .script_by_turn(
                &name,
                replies,
                json!([{"text": "Summary of the lookups so far."}]),
            )
            .await;
        let agents: Api<agentrun::api::Agent> = Api::namespaced(self.client.clone(), &name);
        agents
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
                    "metadata": {"name": "bench"},
                    "spec": self.agent(&name, &name, context)
                }))
                .expect("Agent manifest"),
            )
            .await
            .expect("creating the Agent");

        let (jobs, runs, pods) = (Jobs::default(), Runs::default(), Pods::default());
        let tasks = vec![
            watch_jobs(&self.client, &name, jobs.clone()),
            watch_runs(&self.client, &name, runs.clone()),
            watch_pods(&self.client, &name, pods.clone()),
        ];
        let mut flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        flags.extend(self.cfg.controller_flags.iter().cloned());
        let controller = Ns::start_controller(&name, CONTROLLER, &flags, &self.store_url);
        let ns = Ns {
            name,
            _guard: guard,
            controller,
            flags,
            jobs,
            runs,
            pods,
            tasks,
            part: part.to_string(),
        };
        ns.wait_controller_up().await;
        ns
    }

    /// For each Job (first attempt) whose previous record a step pod wrote:
    /// Job ADDED (watch) minus that record's `created_at`, in ms.
    /// Each sample with the time of the record it follows.
    async fn dispatch_ms(&self, ns: &Ns, runs: &[String], csv: &str) -> Vec<(DateTime<Utc>, f64)> {
        let mut uids: HashMap<String, String> = HashMap::new();
        for name in runs {
            if let Some(r) = ns.runs.get(name) {
                uids.insert(r.uid, name.clone());
            }
        }
        let keys: Vec<String> = uids.keys().cloned().collect();
        let rows: Vec<(String, i64, DateTime<Utc>, Option<String>)> = sqlx::query_as(
            "SELECT run, seq, created_at, (body::jsonb)->'worker'->>'attempt' \
             FROM agentrun_steps WHERE run = ANY($1)",
        )
        .bind(&keys)
        .fetch_all(&self.pg)
        .await
        .expect("reading record times");
        // (run name, seq) → (created_at, written by a step pod)
        let mut records: HashMap<(String, u64), (DateTime<Utc>, bool)> = HashMap::new();
        for (uid, seq, at, attempt) in rows {
            let by_worker = attempt.and_then(|a| a.parse::<u32>().ok()).unwrap_or(0) > 0;
            records.insert((uids[&uid].clone(), seq as u64), (at, by_worker));
        }
        let wanted: HashSet<&String> = runs.iter().collect();
        let mut ms = Vec::new();
        let mut negative = 0;
        let mut lines = vec!["run,seq,record_created_at,job_added_at,ms".to_string()];
        for job in ns.jobs.all() {
            if job.attempt != 1 || job.seq == 0 || !wanted.contains(&job.run) {
                continue;
            }
            if let Some((at, true)) = records.get(&(job.run.clone(), job.seq - 1)) {
                let d = (job.added - *at).num_microseconds().unwrap_or(0) as f64 / 1000.0;
                if d < 0.0 {
                    negative += 1;
                }
                lines.push(format!(
                    "{},{},{},{},{d:.1}",
                    job.run,
                    job.seq,
                    at.format("%H:%M:%S%.6f"),
                    job.added.format("%H:%M:%S%.6f")
                ));
                ms.push((*at, d));
            }
        }
        lines.sort();
        let _ = std::fs::create_dir_all(&self.cfg.out);
        let _ = std::fs::write(self.cfg.out.join(csv), lines.join("\n") + "\n");
        if negative > 0 {
            note(&format!(
                "{negative} Jobs were seen before the record they follow (clock or label mismatch)"
            ));
        }
        ms
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:05}")).collect()
}

fn lookups(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("{}", 1000 + i)}}]}))
        .collect()
}

fn finish(text: &str) -> Value {
    json!({"toolCalls": [{"name": "finish", "arguments": {"result": text}}]})
}

fn refund(amount: u64) -> Value {
    json!({"text": format!("The customer was charged twice; refunding {amount}."),
           "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": amount}}]})
}

// --- figures 1 and 4: dispatch overhead and a burst of runs -------------------

async fn active(bench: &Bench) {
    let cfg = &bench.cfg;
    let mut replies = lookups(cfg.turns - 1);
    replies.push(finish("looked it up"));
    let ns = bench
        .namespace(
            "active",
            &["--time-slice-seconds", "0"],
            Value::Array(replies),
            None,
        )
        .await;
    let steps_per_run = 2 * cfg.turns - 1;
    note(&format!(
        "active: {} baseline runs one at a time, then {} together; {steps_per_run} steps (Jobs) each, namespace {}",
        cfg.baseline_runs, cfg.active, ns.name
    ));

    // One active run at a time.
    let metrics0 = metrics_text(ns.controller.metrics_port).await;
    let baseline = names("base", cfg.baseline_runs);
    let base_ms = one_at_a_time(bench, &ns, &baseline, "dispatch-active1.csv").await;
    let metrics1 = metrics_text(ns.controller.metrics_port).await;
    controller_dispatch_figures("dispatch.active1", &metrics0, &metrics1);
    latency_figures("dispatch.active1", &base_ms);

    // The same, while N other runs are active (each holding its step).
    held(bench, &ns, &base_ms).await;

    // N runs started together (AGENTRUN_SCALE_ACTIVE=0: none, the held part only).
    if cfg.active == 0 {
        ns.save_log(bench, "").await;
        return;
    }
    let metrics1 = metrics_text(ns.controller.metrics_port).await;
    let burst = names("run", cfg.active);
    let pid = ns.pid();
    let cpu0 = procs::cpu_seconds(&[pid]);
    let peak = Arc::new(Mutex::new(procs::status_kb(pid, "VmRSS")));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                let rss = procs::status_kb(pid, "VmRSS");
                {
                    let mut p = peak.lock().unwrap();
                    *p = (*p).max(rss);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let cpu_parts0 = cpu_by_component(pid);
    let api0 = api_requests(&bench.client).await;
    let t0 = Instant::now();
    let created_in = ns.create_runs(bench, &burst, "Look the order up.").await;
    let timeout = Duration::from_secs(600 + 2 * cfg.active as u64);
    let (ended, last) = wait_settled(
        &format!("{} runs to end", burst.len()),
        burst.len(),
        timeout,
        cfg.stall,
        || ns.runs.count(&burst, |r| r.done_at.is_some()),
    )
    .await;
    let wall = last.duration_since(t0).as_secs_f64();
    if ended < burst.len() {
        let stuck = stuck(&ns, &burst, |r| r.done_at.is_some());
        figure(
            &format!("burst.runs{}.stuck", cfg.active),
            stuck.len() as f64,
            "runs",
        );
        note(&format!("runs that never ended: {}", stuck.join(", ")));
    }
    sampler.abort();
    let metrics2 = metrics_text(ns.controller.metrics_port).await;
    controller_dispatch_figures(
        &format!("dispatch.active{}", cfg.active),
        &metrics1,
        &metrics2,
    );
    let cpu = procs::cpu_seconds(&[pid]) - cpu0;
    let cpu_parts1 = cpu_by_component(pid);
    let api1 = api_requests(&bench.client).await;
    let (succeeded, phases) = ns.runs.count(&burst, |r| r.phase == Some(Phase::Succeeded));
    if succeeded < burst.len() {
        note(&format!("not every run succeeded: {phases}"));
    }
    let burst_samples = bench
        .dispatch_ms(&ns, &burst, &format!("dispatch-active{}.csv", cfg.active))
        .await;
    let burst_ms: Vec<f64> = burst_samples.iter().map(|(_, ms)| *ms).collect();
    let burst_set: HashSet<&String> = burst.iter().collect();
    let jobs: Vec<JobSeen> = ns
        .jobs
        .all()
        .into_iter()
        .filter(|j| burst_set.contains(&j.run))
        .collect();
    // Once every run has its first Job: the start-up wave of N runs is over.
    let all_started = jobs.iter().filter(|j| j.seq <= 1).map(|j| j.added).max();
    let steady_ms: Vec<f64> = burst_samples
        .iter()
        .filter(|(at, _)| all_started.is_some_and(|t| *at > t))
        .map(|(_, ms)| *ms)
        .collect();
    let retries = jobs.iter().filter(|j| j.attempt > 1).count();

    latency_figures(&format!("dispatch.active{}", cfg.active), &burst_ms);
    latency_figures(
        &format!("dispatch.active{}.after_all_started", cfg.active),
        &steady_ms,
    );
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    figure(
        &format!("dispatch.ratio_{}_vs_1.p50", cfg.active),
        ratio(percentile(&burst_ms, 0.5), percentile(&base_ms, 0.5)),
        "x",
    );
    figure(
        &format!("dispatch.ratio_{}_vs_1.p99", cfg.active),
        ratio(percentile(&burst_ms, 0.99), percentile(&base_ms, 0.99)),
        "x",
    );
    let n = cfg.active;
    figure(
        &format!("burst.runs{n}.succeeded"),
        succeeded as f64,
        "runs",
    );
    figure(
        &format!("burst.runs{n}.create_rate"),
        n as f64 / created_in.as_secs_f64(),
        "runs/s",
    );
    figure(&format!("burst.runs{n}.wall"), wall, "s");
    figure(&format!("burst.runs{n}.jobs"), jobs.len() as f64, "jobs");
    figure(
        &format!("burst.runs{n}.job_retries"),
        retries as f64,
        "jobs",
    );
    figure(
        &format!("burst.runs{n}.steps_per_s"),
        jobs.len() as f64 / wall,
        "steps/s",
    );
    figure(&format!("burst.runs{n}.controller_cpu"), cpu, "s");
    figure(
        &format!("burst.runs{n}.controller_cpu_per_step"),
        1000.0 * cpu / jobs.len().max(1) as f64,
        "ms",
    );
    figure(
        &format!("burst.runs{n}.controller_peak_rss"),
        *peak.lock().unwrap() as f64 / 1024.0,
        "MiB",
    );
    cpu_figures(&format!("burst.runs{n}"), &cpu_parts0, &cpu_parts1, wall);
    api_figures(&format!("burst.runs{n}"), &api0, &api1, wall);
    ns.save_log(bench, "").await;
}

/// Runs `names` one after the other, each to its end; returns the dispatch
/// samples of their Jobs (ms).
async fn one_at_a_time(bench: &Bench, ns: &Ns, names: &[String], csv: &str) -> Vec<f64> {
    for name in names {
        ns.create_runs(bench, std::slice::from_ref(name), "Look the order up.")
            .await;
        wait_until(
            &format!("run {name} to end"),
            Duration::from_secs(180),
            || match ns.runs.get(name) {
                Some(r) if r.done_at.is_some() => Ok(()),
                other => Err(format!("{:?}", other.map(|r| r.phase))),
            },
        )
        .await;
    }
    bench
        .dispatch_ms(ns, names, csv)
        .await
        .into_iter()
        .map(|(_, ms)| ms)
        .collect()
}

/// How long a held run's tool call takes to answer: longer than any bench.
const HOLD: Duration = Duration::from_secs(3 * 3600);

/// Figure 1 with N runs concurrently active: N runs each hold a step Job
/// (a running pod with the run's lease, heartbeating, in a tool call the
/// stand-in answers after [`HOLD`]), and meanwhile probe runs go through
/// their steps one at a time, as the baseline's did. Their dispatch against
/// the baseline's is the controller's overhead of N active runs, apart from
/// the API server's queueing under a burst (the burst figures below).
async fn held(bench: &Bench, ns: &Ns, base_ms: &[f64]) {
    let cfg = &bench.cfg;
    let n = cfg.held;
    if n == 0 {
        return;
    }
    let tenant = format!("{}-held", ns.name);
    bench
        .standins
        .script_by_turn(
            &tenant,
            json!([{"toolCalls": [{"name": "hold", "arguments": {"what": "the line"}}]}]),
            json!([{"text": "Held."}]),
        )
        .await;
    bench
        .standins
        .configure_tools(
            &tenant,
            json!({"delayMs": {"hold": HOLD.as_millis() as u64}}),
        )
        .await;
    let mut spec = bench.agent(&tenant, &tenant, None);
    spec["tools"].as_array_mut().expect("tools").push(json!({
        "name": "hold", "description": "Holds the line.",
        "inputSchema": {"type": "object"},
        "http": {"url": format!("{}/tools/{tenant}/hold", bench.standins.base),
                 "idempotent": true, "readOnly": true,
                 "timeout": format!("{}s", HOLD.as_secs() + 600)}
    }));
    let agents: Api<agentrun::api::Agent> = Api::namespaced(bench.client.clone(), &ns.name);
    agents
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
                "metadata": {"name": "held"}, "spec": spec
            }))
            .expect("Agent manifest"),
        )
        .await
        .expect("creating the held Agent");

    let held_runs = names("held", n);
    let step_timeout = format!("{}s", HOLD.as_secs() + 1200);
    ns.create_runs_with(
        bench,
        &held_runs,
        json!({"input": "Hold the line.", "agentRef": {"name": "held"},
               "stepTimeout": step_timeout}),
    )
    .await;
    // Held: the stand-in received the run's call (the step Job is in it).
    let (holding, _) = wait_settled_every(
        &format!("{n} runs to hold their step"),
        n,
        Duration::from_secs(600 + 2 * n as u64),
        cfg.stall,
        Duration::from_secs(1),
        || async {
            let calls: HashSet<String> = bench
                .standins
                .tool_requests(&tenant)
                .await
                .iter()
                .filter_map(|r| r["run"].as_str().map(str::to_string))
                .collect();
            let seen = ns.runs.count(&held_runs, |r| r.done_at.is_some()).1;
            (calls.len(), seen)
        },
    )
    .await;
    wait_quiet(ns, Duration::from_secs(6), Duration::from_secs(120)).await;
    let pods_running = ns.pods.active();
    note(&format!(
        "held: {holding} runs hold their step ({pods_running} pods running); probes one at a time"
    ));

    let pid = ns.pid();
    let metrics0 = metrics_text(ns.controller.metrics_port).await;
    let (cpu0, cpu_parts0, api0) = (
        procs::cpu_seconds(&[pid]),
        cpu_by_component(pid),
        api_requests(&bench.client).await,
    );
    let t0 = Instant::now();
    let probes = names("probe", cfg.baseline_runs);
    let probe_ms = one_at_a_time(bench, ns, &probes, &format!("dispatch-held{n}.csv")).await;
    let secs = t0.elapsed().as_secs_f64();
    let metrics1 = metrics_text(ns.controller.metrics_port).await;
    let cpu = procs::cpu_seconds(&[pid]) - cpu0;
    let (cpu_parts1, api1) = (cpu_by_component(pid), api_requests(&bench.client).await);
    let still = ns.pods.active();

    figure(&format!("held.runs{n}.holding"), holding as f64, "runs");
    figure(
        &format!("held.runs{n}.pods_running"),
        pods_running as f64,
        "pods",
    );
    figure(
        &format!("held.runs{n}.pods_running_after"),
        still as f64,
        "pods",
    );
    latency_figures(&format!("dispatch.held{n}"), &probe_ms);
    controller_dispatch_figures(&format!("dispatch.held{n}"), &metrics0, &metrics1);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
        figure(
            &format!("dispatch.ratio_held{n}_vs_1.{label}"),
            ratio(percentile(&probe_ms, q), percentile(base_ms, q)),
            "x",
        );
    }
    figure(
        &format!("held.runs{n}.controller_cpu"),
        100.0 * cpu / secs,
        "% of a core",
    );
    figure(
        &format!("held.runs{n}.controller_rss"),
        procs::status_kb(pid, "VmRSS") as f64 / 1024.0,
        "MiB",
    );
    cpu_figures(&format!("held.runs{n}"), &cpu_parts0, &cpu_parts1, secs);
    api_figures(&format!("held.runs{n}"), &api0, &api1, secs);
    let (probes_ok, phases) = ns
        .runs
        .count(&probes, |r| r.phase == Some(Phase::Succeeded));
    if probes_ok < probes.len() {
        note(&format!("not every probe run succeeded: {phases}"));
    }
    figure(
        &format!("held.runs{n}.probes_not_succeeded"),
        (probes.len() - probes_ok) as f64,
        "runs",
    );

    // Let them go: cancelled, each ends with its partial result.
    let api: Api<AgentRun> = Api::namespaced(bench.client.clone(), &ns.name);
    futures::stream::iter(held_runs.iter().cloned())
        .map(|name| {
            let api = api.clone();
            async move {
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"cancel": true}})),
                )
                .await
                .unwrap_or_else(|e| panic!("cancelling {name}: {e}"));
            }
        })
        .buffer_unordered(cfg.create_concurrency)
        .collect::<Vec<()>>()
        .await;
    let (cancelled, _) = wait_settled(
        &format!("{n} held runs to be cancelled"),
        n,
        Duration::from_secs(600 + n as u64),
        cfg.stall,
        || {
            ns.runs
                .count(&held_runs, |r| r.phase == Some(Phase::Cancelled))
        },
    )
    .await;
    figure(&format!("held.runs{n}.cancelled"), cancelled as f64, "runs");
}

/// Waits until no run of the namespace changed and no Job was added for
/// `quiet` (the start-up wave's status writes are over), at most `timeout`.
async fn wait_quiet(ns: &Ns, quiet: Duration, timeout: Duration) {
    let start = Instant::now();
    loop {
        let last_run = ns.runs.last_change();
        let last_job = ns.jobs.all().iter().map(|j| j.at).max();
        let last = [last_run, last_job].into_iter().flatten().max();
        if last.is_none_or(|t| t.elapsed() >= quiet) {
            return;
        }
        if start.elapsed() > timeout {
            note(&format!(
                "the namespace did not go quiet for {} s within {} s; measuring anyway",
                quiet.as_secs(),
                timeout.as_secs()
            ));
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// --- figures 2 and 3: many runs waiting for approval ----------------------------

/// Adds alice's approval to `approval` (what `kubectl agentrun approve` does).
async fn approve(bench: &Bench, ns: &str, approval: &str) -> Result<(), String> {
    let admin: Api<Approval> = Api::namespaced(bench.client.clone(), ns);
    let a = admin.get(approval).await.map_err(|e| e.to_string())?;
    let api: Api<Approval> = Api::namespaced(bench.alice.clone(), ns);
    let patch: json_patch::Patch = serde_json::from_value(json!([{
        "op": "add", "path": "/spec/decisions/-",
        "value": {"approver": "alice", "verdict": "Approve",
                  "argumentsHash": a.spec.arguments_hash, "reason": "bench"}
    }]))
    .unwrap();
    api.patch(approval, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Counts watch events (resourceVersion changes) of one kind in a namespace
/// until `until`: (added, modified, deleted).
async fn count_writes<K>(api: Api<K>, until: tokio::time::Instant) -> [u64; 3]
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut counts = [0u64; 3];
    let mut rv = match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(l) => l.metadata.resource_version.unwrap_or_default(),
        Err(e) => {
            note(&format!("listing for a write count: {e}"));
            return counts;
        }
    };
    while tokio::time::Instant::now() < until {
        let params = WatchParams::default().timeout(290);
        let mut stream = match api.watch(&params, &rv).await {
            Ok(s) => s.boxed(),
            Err(e) => {
                note(&format!("watch for a write count: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let event = tokio::select! {
                e = stream.next() => e,
                () = tokio::time::sleep_until(until) => return counts,
            };
            let Some(event) = event else { break };
            match event {
                Ok(WatchEvent::Added(o)) => {
                    counts[0] += 1;
                    rv = o.resource_version().unwrap_or(rv);
                }
                Ok(WatchEvent::Modified(o)) => {
                    counts[1] += 1;
                    rv = o.resource_version().unwrap_or(rv);
                }
                Ok(WatchEvent::Deleted(o)) => {
                    counts[2] += 1;
                    rv = o.resource_version().unwrap_or(rv);
                }
                Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                Ok(WatchEvent::Error(e)) => {
                    note(&format!("write count watch: {e:?}"));
                    break;
                }
                Err(e) => {
                    note(&format!("write count watch: {e}"));
                    break;
                }
            }
        }
    }
    counts
}

async fn table_reads(pg: &sqlx::PgPool) -> BTreeMap<String, i64> {
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pg)
        .await;
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::bigint \
         FROM pg_stat_user_tables WHERE relname LIKE 'agentrun%' AND relname NOT LIKE '%migrations'",
    )
    .fetch_all(pg)
    .await
    .expect("reading table statistics");
    rows.into_iter().collect()
}

async fn waiting(bench: &Bench) {
    let cfg = &bench.cfg;
    let ns = bench
        .namespace(
            "waiting",
            &[],
            json!([refund(500), finish("refunded 500")]),
            None,
        )
        .await;
    let w = cfg.waiting;
    note(&format!(
        "waiting: {w} runs to AwaitingApproval, namespace {}",
        ns.name
    ));
    let runs = names("wait", w);
    let cpu_parts0 = cpu_by_component(ns.pid());
    let t0 = Instant::now();
    let created_in = ns.create_runs(bench, &runs, "Refund order 1042.").await;
    note(&format!(
        "created {w} runs in {:.0} s ({:.1} runs/s)",
        created_in.as_secs_f64(),
        w as f64 / created_in.as_secs_f64()
    ));
    let timeout = Duration::from_secs(900 + w as u64 / 2);
    let awaiting = |r: &RunSeen| r.phase == Some(Phase::AwaitingApproval);
    let (n, last) = wait_settled(
        &format!("{w} runs to await approval"),
        w,
        timeout,
        cfg.stall,
        || ns.runs.count(&runs, awaiting),
    )
    .await;
    let ready = last.duration_since(t0).as_secs_f64();
    if n < w {
        let stuck = stuck(&ns, &runs, awaiting);
        figure(
            &format!("waiting.runs{w}.stuck"),
            stuck.len() as f64,
            "runs",
        );
        note(&format!(
            "runs that never came to await approval: {}",
            stuck.join(", ")
        ));
    }
    let runs: Vec<String> = runs
        .into_iter()
        .filter(|r| ns.runs.get(r).is_some_and(|r| awaiting(&r)))
        .collect();
    cpu_figures(
        &format!("waiting.runs{w}"),
        &cpu_parts0,
        &cpu_by_component(ns.pid()),
        ready,
    );
    figure(
        &format!("waiting.runs{w}.create_rate"),
        w as f64 / created_in.as_secs_f64(),
        "runs/s",
    );
    figure(&format!("waiting.runs{w}.to_awaiting"), ready, "s");
    figure(
        &format!("waiting.runs{w}.to_awaiting_rate"),
        w as f64 / ready,
        "runs/s",
    );
    wait_until(
        "no step pod left running",
        Duration::from_secs(300),
        || match ns.pods.active() {
            0 => Ok(()),
            n => Err(format!("{n} pods not finished")),
        },
    )
    .await;

    // Figure 2: decisions on a sample, one at a time.
    let mut ms = Vec::new();
    let sample: Vec<String> = runs
        .iter()
        .step_by((runs.len() / cfg.approvals.max(1)).max(1))
        .take(cfg.approvals)
        .cloned()
        .collect();
    for name in &sample {
        let seen = ns.runs.get(name).expect("run seen");
        let approval = seen.approval.clone().expect("waiting on an Approval");
        let before: HashSet<(u64, u32)> = ns
            .jobs
            .of_run(name)
            .iter()
            .map(|j| (j.seq, j.attempt))
            .collect();
        approve(bench, &ns.name, &approval)
            .await
            .unwrap_or_else(|e| panic!("approving {approval}: {e}"));
        let patched = Instant::now();
        let job = wait_until(
            &format!("the next Job of {name} after its approval"),
            Duration::from_secs(60),
            || {
                ns.jobs
                    .of_run(name)
                    .into_iter()
                    .find(|j| !before.contains(&(j.seq, j.attempt)))
                    .ok_or_else(|| "no new Job yet".to_string())
            },
        )
        .await;
        ms.push(job.at.saturating_duration_since(patched).as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    latency_figures(&format!("approval.waiting{w}"), &ms);
    wait_until(
        "the approved runs to succeed",
        Duration::from_secs(300),
        || {
            let (n, seen) = ns
                .runs
                .count(&sample, |r| r.phase == Some(Phase::Succeeded));
            if n == sample.len() {
                Ok(())
            } else {
                Err(format!("{n} succeeded: {seen}"))
            }
        },
    )
    .await;
    wait_until(
        "no step pod left running",
        Duration::from_secs(120),
        || match ns.pods.active() {
            0 => Ok(()),
            n => Err(format!("{n} pods not finished")),
        },
    )
    .await;
    // Let the last status writes and Events of the approved runs land.
    tokio::time::sleep(Duration::from_secs(5)).await;

    // Figure 3: nothing happening (finished step Jobs still go, by their TTL).
    idle_window(bench, &ns, &runs, "idle").await;
    // And once every step Job is gone: nothing at all.
    if cfg.quiet {
        let timeout = Duration::from_secs(900);
        note("waiting for every step Job to be deleted (ttlSecondsAfterFinished)");
        wait_until("every step Job deleted", timeout, || match ns.jobs.live() {
            0 => Ok(()),
            n => Err(format!("{n} Jobs left")),
        })
        .await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        idle_window(bench, &ns, &runs, "quiet").await;
    }
    ns.save_log(bench, "").await;
}

/// One window with the runs waiting: pods, the controller's RSS and CPU,
/// store reads (table statistics and its counters), API writes by kind.
async fn idle_window(bench: &Bench, ns: &Ns, runs: &[String], label: &str) {
    let cfg = &bench.cfg;
    let window = cfg.idle;
    let waiting_now = ns
        .runs
        .count(runs, |r| r.phase == Some(Phase::AwaitingApproval))
        .0;
    note(&format!(
        "{label} window of {} s with {waiting_now} runs waiting",
        window.as_secs()
    ));
    let until = tokio::time::Instant::now() + window + Duration::from_millis(500);
    let c = &bench.client;
    let n = ns.name.as_str();
    let writes = tokio::spawn({
        let (c, n) = (c.clone(), n.to_string());
        async move {
            let (runs, approvals, jobs, pods, events) = tokio::join!(
                count_writes(Api::<AgentRun>::namespaced(c.clone(), &n), until),
                count_writes(Api::<Approval>::namespaced(c.clone(), &n), until),
                count_writes(Api::<Job>::namespaced(c.clone(), &n), until),
                count_writes(Api::<Pod>::namespaced(c.clone(), &n), until),
                count_writes(Api::<CoreEvent>::namespaced(c.clone(), &n), until),
            );
            [runs, approvals, jobs, pods, events]
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // the watches are open
    let pid = ns.pid();
    let (cpu0, pg0, m0, active0) = (
        procs::cpu_seconds(&[pid]),
        table_reads(&bench.pg).await,
        store_counters(ns.controller.metrics_port).await,
        ns.pods.active(),
    );
    let cpu_parts0 = cpu_by_component(pid);
    let t_idle = Instant::now();
    tokio::time::sleep(window).await;
    let secs = t_idle.elapsed().as_secs_f64();
    let cpu_parts1 = cpu_by_component(pid);
    let (cpu1, m1, active1) = (
        procs::cpu_seconds(&[pid]),
        store_counters(ns.controller.metrics_port).await,
        ns.pods.active(),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await; // backends flush their statistics
    let pg1 = table_reads(&bench.pg).await;
    let writes = writes.await.expect("write counters");
    let per_min = |x: f64| x * 60.0 / secs;
    let w = waiting_now;
    figure(
        &format!("{label}.waiting{w}.pods"),
        active0.max(active1) as f64,
        "pods",
    );
    figure(
        &format!("{label}.waiting{w}.controller_rss"),
        procs::status_kb(pid, "VmRSS") as f64 / 1024.0,
        "MiB",
    );
    figure(
        &format!("{label}.waiting{w}.controller_cpu"),
        100.0 * (cpu1 - cpu0) / secs,
        "%core",
    );
    let mut total_reads = 0;
    for (table, after) in &pg1 {
        let d = after - pg0.get(table).copied().unwrap_or(0);
        total_reads += d;
        figure(
            &format!("{label}.waiting{w}.pg_scans_per_min.{table}"),
            per_min(d as f64),
            "scans/min",
        );
    }
    figure(
        &format!("{label}.waiting{w}.pg_scans_per_min"),
        per_min(total_reads as f64),
        "scans/min",
    );
    figure(
        &format!("{label}.waiting{w}.reconciles_per_min"),
        per_min(m1.reconciliations - m0.reconciliations),
        "reconciles/min",
    );
    match (m0.reads, m1.reads) {
        (Some(a), Some(b)) => figure(
            &format!("{label}.waiting{w}.store_reads_per_min"),
            per_min(b - a),
            "reads/min",
        ),
        _ => note("the controller exposes no agentrun_store_reads_total"),
    }
    if let (Some(a), Some(b)) = (m0.read_bytes, m1.read_bytes) {
        figure(
            &format!("{label}.waiting{w}.store_read_bytes_per_min"),
            per_min(b - a),
            "bytes/min",
        );
    }
    let kinds = ["agentruns", "approvals", "jobs", "pods", "events"];
    let mut total = 0;
    for (kind, [a, m, d]) in kinds.iter().zip(writes) {
        total += a + m + d;
        figure(
            &format!("{label}.waiting{w}.api_writes_per_min.{kind}"),
            per_min((a + m + d) as f64),
            "writes/min",
        );
        if d > 0 {
            note(&format!(
                "{kind}: {d} deletions in the window (finished Jobs' TTL, garbage collection)"
            ));
        }
    }
    figure(
        &format!("{label}.waiting{w}.api_writes_per_min"),
        per_min(total as f64),
        "writes/min",
    );
    cpu_figures(
        &format!("{label}.waiting{w}"),
        &cpu_parts0,
        &cpu_parts1,
        secs,
    );
}

// --- figures 5 and 6: one long run, and a controller restart -------------------

#[derive(Clone, Copy, Debug)]
struct Sample {
    secs: f64,
    log_len: u64,
    m: StoreCounters,
}

async fn long(bench: &Bench) {
    let cfg = &bench.cfg;
    // RunStarted, then 3 records per lookup (call, intent, result), then the
    // gated refund (call, request); summaries come on top.
    let lookups_n = (cfg.long_steps.saturating_sub(3) / 3).max(1) as usize;
    let mut replies = lookups(lookups_n);
    replies.push(refund(500));
    replies.push(finish("looked everything up and refunded"));
    // Check mode's log is short: checkpoints from 50 records, so that the
    // restart resumes at one as a long log's would.
    let flags: &[&str] = match cfg.check {
        true => &["--checkpoint-min-records", "50"],
        false => &[],
    };
    let mut ns = bench
        .namespace(
            "long",
            flags,
            Value::Array(replies),
            Some(json!({"maxTokens": 2000, "recentSteps": 6})),
        )
        .await;
    note(&format!(
        "long: one run of about {} records ({lookups_n} lookups), namespace {}",
        cfg.long_steps, ns.name
    ));
    let name = "long".to_string();
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let cpu_parts0 = cpu_by_component(ns.pid());
    let t0 = Instant::now();
    let sampler = {
        let (samples, runs, port, name) = (
            samples.clone(),
            ns.runs.clone(),
            ns.controller.metrics_port,
            name.clone(),
        );
        tokio::spawn(async move {
            loop {
                let m = store_counters(port).await;
                let log_len = runs.get(&name).map_or(0, |r| r.log_len);
                samples.lock().unwrap().push(Sample {
                    secs: t0.elapsed().as_secs_f64(),
                    log_len,
                    m,
                });
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    ns.create_runs(
        bench,
        std::slice::from_ref(&name),
        "Look every order up, then refund order 1042.",
    )
    .await;
    let timeout = Duration::from_secs(900 + cfg.long_steps / 20);
    let awaiting = wait_until(
        "the long run to await approval at the end of its log",
        timeout,
        || match ns.runs.get(&name) {
            Some(r) if r.phase == Some(Phase::AwaitingApproval) => Ok(r),
            Some(r) if r.done_at.is_some() => panic!("the long run ended {:?}", r.phase),
            other => Err(format!("{:?}", other.map(|r| (r.phase, r.log_len)))),
        },
    )
    .await;
    let wall = t0.elapsed().as_secs_f64();
    cpu_figures(
        &format!("long.records{}", awaiting.log_len),
        &cpu_parts0,
        &cpu_by_component(ns.pid()),
        wall,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    sampler.abort();
    let samples = samples.lock().unwrap().clone();
    let last = store_counters(ns.controller.metrics_port).await;
    let records = awaiting.log_len;
    let jobs = ns.jobs.of_run(&name).len();

    // The object as kubectl shows it.
    let json = common::kubectl(&["get", "agentrun", &name, "-n", &ns.name, "-o", "json"]);
    figure(
        &format!("long.records{records}.records"),
        records as f64,
        "records",
    );
    figure(&format!("long.records{records}.wall"), wall, "s");
    figure(
        &format!("long.records{records}.records_per_s"),
        records as f64 / wall,
        "records/s",
    );
    figure(&format!("long.records{records}.jobs"), jobs as f64, "jobs");
    figure(
        &format!("long.records{records}.agentrun_object"),
        json.len() as f64,
        "bytes",
    );

    let _ = std::fs::create_dir_all(&cfg.out);
    let csv: String =
        std::iter::once("secs,log_len,reconciliations,reads,read_records,read_bytes\n".to_string())
            .chain(samples.iter().map(|s| {
                format!(
                    "{:.1},{},{},{},{},{}\n",
                    s.secs,
                    s.log_len,
                    s.m.reconciliations,
                    s.m.reads.unwrap_or(-1.0),
                    s.m.read_records.unwrap_or(-1.0),
                    s.m.read_bytes.unwrap_or(-1.0)
                )
            }))
            .collect();
    let csv_path = cfg.out.join("long-samples.csv");
    if std::fs::write(&csv_path, csv).is_ok() {
        note(&format!("long run samples: {}", csv_path.display()));
    }
    match (samples.first(), last.read_bytes) {
        (Some(first), Some(bytes)) if first.m.read_bytes.is_some() => {
            let end = Sample {
                secs: wall,
                log_len: records,
                m: last,
            };
            let per = |a: &Sample, b: &Sample| {
                let bytes = b.m.read_bytes.unwrap_or(0.0) - a.m.read_bytes.unwrap_or(0.0);
                let rec = (b.m.reconciliations - a.m.reconciliations).max(1.0);
                let new = (b.log_len.saturating_sub(a.log_len)).max(1) as f64;
                (
                    bytes / rec,
                    bytes / new,
                    b.m.reconciliations - a.m.reconciliations,
                )
            };
            let (per_rec, per_new, reconciles) = per(first, &end);
            let _ = bytes;
            // Records the reconciler read, against the log's length: 1 when
            // each record is read once. Those read once the log had its final
            // length are the run coming to wait (the Approval raised).
            let read = |s: &Sample| s.m.read_records.unwrap_or(0.0);
            // A sample's length is the status's, which a running run writes
            // at most every few seconds: it may lag the records already read,
            // which would make this negative. Nothing is read "beyond" then,
            // so it counts as 0 and the running figure below becomes every
            // read over the log's length (an upper bound, never flattering).
            let at_end = samples
                .iter()
                .rev()
                .find(|s| s.log_len < records)
                .map_or(0.0, |s| read(&end) - read(s) - (records - s.log_len) as f64)
                .max(0.0);
            figure(
                &format!("long.records{records}.read_records"),
                read(&end) - read(first),
                "records",
            );
            figure(
                &format!("long.records{records}.read_records_per_record"),
                (read(&end) - read(first)) / records.max(1) as f64,
                "x",
            );
            figure(
                &format!("long.records{records}.read_records_per_record_running"),
                (read(&end) - read(first) - at_end) / records.max(1) as f64,
                "x",
            );
            figure(
                &format!("long.records{records}.read_records_beyond_new_at_wait"),
                at_end,
                "records",
            );
            figure(
                &format!("long.records{records}.reconciles"),
                reconciles,
                "reconciles",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_reconcile"),
                per_rec,
                "bytes",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_new_record"),
                per_new,
                "bytes",
            );
            // First 10% of the log and last 10%.
            let tenth = records / 10;
            let a_end = samples
                .iter()
                .find(|s| s.log_len >= tenth)
                .copied()
                .unwrap_or(end);
            let b_start = samples
                .iter()
                .rev()
                .find(|s| s.log_len <= records - tenth)
                .copied()
                .unwrap_or(*first);
            let (f_rec, f_new, _) = per(first, &a_end);
            let (l_rec, l_new, _) = per(&b_start, &end);
            figure(
                &format!("long.records{records}.read_bytes_per_reconcile.first10pct"),
                f_rec,
                "bytes",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_reconcile.last10pct"),
                l_rec,
                "bytes",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_new_record.first10pct"),
                f_new,
                "bytes",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_new_record.last10pct"),
                l_new,
                "bytes",
            );
            figure(
                &format!("long.records{records}.read_bytes_per_new_record.ratio_last_vs_first"),
                if f_new > 0.0 { l_new / f_new } else { 0.0 },
                "x",
            );
        }
        _ => note("the controller exposes no agentrun_store_read_bytes_total: no read figures"),
    }

    // Figure 6: restart while the run waits with its full log, decided as
    // the new process starts.
    let waiting: AgentRun = Api::namespaced(bench.client.clone(), &ns.name)
        .get(&name)
        .await
        .expect("the long run");
    let checkpoint = waiting
        .status
        .and_then(|s| s.log)
        .and_then(|l| l.checkpoint)
        .map_or(0, |c| c.seq);
    figure(
        &format!("long.records{records}.checkpoint_seq"),
        checkpoint as f64,
        "records",
    );
    ns.save_log(bench, "-1").await;
    let approval = awaiting.approval.clone().expect("waiting on an Approval");
    let before: HashSet<(u64, u32)> = ns
        .jobs
        .of_run(&name)
        .iter()
        .map(|j| (j.seq, j.attempt))
        .collect();
    ns.controller.stop();
    let started = Instant::now();
    ns.controller = Ns::start_controller(&ns.name, "bench-ctrl-2", &ns.flags, &bench.store_url);
    approve(bench, &ns.name, &approval)
        .await
        .unwrap_or_else(|e| panic!("approving {approval}: {e}"));
    let approved = started.elapsed().as_secs_f64() * 1000.0;
    let job = wait_until(
        "the long run's next Job after the restart",
        Duration::from_secs(300),
        || {
            ns.jobs
                .of_run(&name)
                .into_iter()
                .find(|j| !before.contains(&(j.seq, j.attempt)))
                .ok_or_else(|| "no new Job yet".to_string())
        },
    )
    .await;
    let resumes = metric_sum(
        &metrics_text(ns.controller.metrics_port).await,
        "agentrun_log_resumes_total",
    );
    figure(
        &format!("restart.records{records}.resumed_at_checkpoint"),
        resumes.unwrap_or(0.0),
        "replays",
    );
    let first_write = ns
        .runs
        .get(&name)
        .and_then(|r| r.changed_at)
        .filter(|t| *t > started)
        .map(|t| t.duration_since(started).as_secs_f64() * 1000.0);
    figure(
        &format!("restart.records{records}.decided_after_start"),
        approved,
        "ms",
    );
    figure(
        &format!("restart.records{records}.start_to_next_job"),
        job.at.saturating_duration_since(started).as_secs_f64() * 1000.0,
        "ms",
    );
    if let Some(ms) = first_write {
        figure(
            &format!("restart.records{records}.start_to_first_status_write"),
            ms,
            "ms",
        );
    }
    let done = wait_until(
        "the long run to succeed after its approval",
        Duration::from_secs(900),
        || match ns.runs.get(&name) {
            Some(r) if r.done_at.is_some() => Ok(r),
            other => Err(format!("{:?}", other.map(|r| (r.phase, r.log_len)))),
        },
    )
    .await;
    if done.phase != Some(Phase::Succeeded) {
        note(&format!("the long run ended {:?}", done.phase));
    }
    figure(
        &format!("restart.records{records}.succeeded"),
        f64::from(u8::from(done.phase == Some(Phase::Succeeded))),
        "runs",
    );
    figure(
        &format!("restart.records{records}.start_to_succeeded"),
        started.elapsed().as_secs_f64(),
        "s",
    );
    let json = common::kubectl(&["get", "agentrun", &name, "-n", &ns.name, "-o", "json"]);
    figure(
        &format!("long.records{records}.agentrun_object_succeeded"),
        json.len() as f64,
        "bytes",
    );
    ns.save_log(bench, "-2").await;
}

// --- main ------------------------------------------------------------------------

/// How step pods run on this cluster (the process node's flag).
fn pod_mode() -> &'static str {
    if common::existing_cluster() {
        return "as real pods of an existing cluster";
    }
    let cmdline = std::env::var("AGENTRUN_CLUSTER_DIR")
        .ok()
        .and_then(|d| std::fs::read_to_string(format!("{d}/pids/node")).ok())
        .and_then(|pid| std::fs::read(format!("/proc/{}/cmdline", pid.trim())).ok())
        .unwrap_or_default();
    if String::from_utf8_lossy(&cmdline).contains("--in-process-steps") {
        "in process (the process node's --in-process-steps: the real runner code, through the same \
         step-log gateway with each pod's token; only the process/pod boundary is simulated, because \
         1,000 step processes do not fit this machine)"
    } else {
        "as local processes (the process node's default mode)"
    }
}

fn main() {
    let cfg = Config::from_env();
    common::bench_main("scale", cfg.check, async move {
        let started = Instant::now();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "scale: {} mode; active {}, waiting {}, long run {} records, idle window {} s; step pods run {}",
            match (cfg.check, cfg.short) {
                (true, _) => "check (cargo test)",
                (_, true) => "short",
                _ => "default",
            },
            cfg.active,
            cfg.waiting,
            cfg.long_steps,
            cfg.idle.as_secs(),
            pod_mode()
        );
        figure("machine.cores", cores as f64, "cores");
        let bench = Bench::new(cfg).await;
        if bench.cfg.runs("active") {
            active(&bench).await;
        }
        if bench.cfg.runs("waiting") {
            waiting(&bench).await;
        }
        if bench.cfg.runs("long") {
            long(&bench).await;
        }
        figure("total_wall", started.elapsed().as_secs_f64(), "s");
        if bench.cfg.check {
            check_figures();
        }
    });
}
