//! agentrun side by side with Temporal and DBOS on the same agent workload
//! (run by `bash e2e/bench peers`, which brings up PostgreSQL, the local
//! control plane and the peers' Python packages, and sets the environment).
//!
//! Every system talks to the same stand-in model and tool server (one
//! process, answering at once, recording when each request arrived and how
//! long it took to answer), and every figure is computed from those records
//! the same way. Prints `bench: peers.<figure>.<system> <value> <unit>` and
//! `bench: peers.<figure>.agentrun_vs_<peer> <ratio>` (agentrun's value over
//! the peer's, from the same run).
//!
//! - `steps.c1.*`, `steps.cN.*`: a run of STEPS model calls, each followed by
//!   one tool call; one run alone, then N runs at once. `overhead_p50/p99`:
//!   the engine's time per step (from the model's answer to the tool
//!   request, plus from the tool's answer to the next model request: wall
//!   time minus the stand-ins' time); `first_call`: submitting the run to
//!   its first model request; `throughput`: tool steps per second of the N.
//! - `resume.*`: W runs wait for a person; D of them are approved one at a
//!   time: the decision sent (agentrun: the Approval patch; Temporal: the
//!   signal; DBOS: the send) to the approved tool call reaching the tool.
//! - `waiting.*`: those W + D runs waiting, over an idle window: memory
//!   (PSS: shared pages split among their users) and CPU of what each system keeps running for them (engine,
//!   workers, database) and bytes stored per waiting run. agentrun's
//!   control plane (API server, etcd) is reported apart: a cluster runs it
//!   anyway, but it holds the runs' objects.
//! - `kill.*`: K runs, one after another, each with its worker SIGKILLed
//!   at a random point (agentrun: the step pod's process): time from the
//!   kill to the run's next request (`recovery_p50`, `recovery_max`), model
//!   answers the run had recorded asked again and tool effects done twice
//!   (both must be 0).
//! - `clocks.*` (agentrun): how late the run deadline, the step timeout and
//!   an approval's expiry act after their time (status `deadlineAt`, the
//!   Job's start plus the timeout, the Approval's `expiresAt`).
//! - `profile.*` (agentrun): where its time goes in the two latencies:
//!   run created / decision sent → step Job seen → its pod Running → the
//!   first request reaching a stand-in.
//!
//! agentrun runs on whichever node the cluster has: the process node
//! (`agentrun`: the e2e controller process, each step pod a process) or the
//! real node (`agentrun_real`: the chart as a user installs it, controller,
//! PostgreSQL and step pods in containers, pod starts included; the peers
//! are not run again there, their figures come from the process node's
//! phase through AGENTRUN_PEERS_FIGURES, so `agentrun_real_vs_<peer>` is
//! within one `e2e/bench peers`).
//!
//! Sizes: `--bench` full (STEPS 50, N 50, W 1000, D 50, K 20); `--quick`
//! (and check mode, `cargo test` without `--bench`, what CI runs): STEPS 10,
//! N 10, W 50, D 5, K 2. AGENTRUN_PEERS_SYSTEMS=agentrun,temporal,dbos picks
//! systems, AGENTRUN_PEERS_ONLY=steps,waiting,kill,clocks figures. Check mode and `--quick` assert the promises behind the figures
//! (every run done, nothing asked or done twice, the clocks within 1 s), not
//! how fast anything was.

#[path = "peers/agentrun.rs"]
mod agentrun_side;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "peers/python.rs"]
mod python;
#[path = "peers/trace.rs"]
mod trace;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::{Value, json};

use agentrun_side::{Agentrun, Seen};
use python::{Peer, list_arg};
use trace::{Trace, effects_twice, quantile, tool_calls};

struct Config {
    /// Assert the promises (check mode and `--quick`).
    check: bool,
    steps: usize,
    concurrent: usize,
    waiting: usize,
    decisions: usize,
    idle: u64,
    kills: usize,
    kill_turns: usize,
    kill_tool_delay_ms: u64,
    systems: Vec<String>,
    /// AGENTRUN_PEERS_ONLY: the figures to run (steps, waiting, kill, clocks).
    only: Option<Vec<String>>,
}

impl Config {
    fn from_args() -> Config {
        let args: Vec<String> = std::env::args().collect();
        let bench = args.iter().any(|a| a == "--bench");
        let quick = !bench || args.iter().any(|a| a == "--quick");
        let systems = std::env::var("AGENTRUN_PEERS_SYSTEMS")
            .unwrap_or_else(|_| "agentrun,temporal,dbos".into())
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let only = std::env::var("AGENTRUN_PEERS_ONLY")
            .ok()
            .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
        match quick {
            true => Config {
                check: true,
                steps: 10,
                concurrent: 10,
                waiting: 50,
                decisions: 5,
                idle: 5,
                kills: 2,
                kill_turns: 6,
                kill_tool_delay_ms: 300,
                systems,
                only,
            },
            false => Config {
                check: false,
                steps: 50,
                concurrent: 50,
                waiting: 1000,
                decisions: 50,
                idle: 30,
                kills: 20,
                kill_turns: 8,
                kill_tool_delay_ms: 300,
                systems,
                only,
            },
        }
    }

    fn measures(&self, figure: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|f| f == figure))
    }

    fn runs(&self, system: &str) -> bool {
        self.systems.iter().any(|s| s == system)
    }
}

/// The figures of one run, by figure then system.
#[derive(Default)]
struct Figures(BTreeMap<String, BTreeMap<String, (f64, String)>>);

impl Figures {
    fn put(&mut self, figure: &str, system: &str, value: f64, unit: &'static str) {
        let shown = if value.abs() >= 100.0 {
            format!("{value:.0}")
        } else {
            format!("{value:.3}")
        };
        println!("bench: peers.{figure}.{system} {shown} {unit}");
        self.0
            .entry(figure.to_string())
            .or_default()
            .insert(system.to_string(), (value, unit.to_string()));
    }

    /// Each agentrun place's value over each peer's, for every figure both
    /// have.
    fn ratios(&self) {
        let ours = |s: &String| s.starts_with("agentrun");
        for (figure, by_system) in &self.0 {
            for (place, (v, _)) in by_system.iter().filter(|(s, _)| ours(s)) {
                for (peer, (theirs, _)) in by_system.iter().filter(|(s, _)| !ours(s)) {
                    if *theirs != 0.0 && theirs.is_finite() && v.is_finite() {
                        println!(
                            "bench: peers.{figure}.{place}_vs_{peer} {:.3} ratio",
                            v / theirs
                        );
                    }
                }
            }
        }
    }

    /// AGENTRUN_PEERS_FIGURES: a file carrying the figures from one phase of
    /// `e2e/bench peers` to the next (the process node's run, with the
    /// peers, then the real node's): the systems this run did not measure
    /// are taken from it, so the ratios are within one bench; then it is
    /// rewritten with everything.
    fn carry(&mut self) {
        let Ok(path) = std::env::var("AGENTRUN_PEERS_FIGURES") else {
            return;
        };
        let earlier: BTreeMap<String, BTreeMap<String, (f64, String)>> = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        for (figure, by_system) in earlier {
            let here = self.0.entry(figure).or_default();
            for (system, v) in by_system {
                here.entry(system).or_insert(v);
            }
        }
        let json = serde_json::to_vec_pretty(&self.0).expect("figures as JSON");
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}

fn note(msg: &str) {
    println!("peers: {msg}");
}

// --- the workload --------------------------------------------------------------

fn lookups(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("{}", 1000 + i)}}]}))
        .collect()
}

fn steps_script(n: usize) -> Value {
    let mut r = lookups(n);
    r.push(json!({"text": "All refunds handled."}));
    Value::Array(r)
}

fn gated_script() -> Value {
    json!([
        {"toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 500}}]},
        {"text": "Refunded 500 on order 1042."}
    ])
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:04}")).collect()
}

/// The traces of `runs` on `script`, their tool requests told apart by the
/// run key the system sends (agentrun: the run's uid; the peers: its id).
async fn traces(
    standins: &common::standins::Standins,
    script: &str,
    tenant: &str,
    runs: &[String],
    key: impl Fn(&str) -> String,
) -> Vec<(String, Trace)> {
    let mut tools = tool_calls(standins, tenant).await;
    let mut out = Vec::new();
    for run in runs {
        let own = tools.remove(&key(run)).unwrap_or_default();
        out.push((run.clone(), trace::trace(standins, script, run, own).await));
    }
    out
}

/// Where a system runs the workload: agentrun, or a peer's program.
enum System<'a> {
    Agentrun(&'a Agentrun),
    Peer(&'a Peer),
}

impl System<'_> {
    fn name(&self) -> &'static str {
        match self {
            System::Agentrun(a) => a.label(),
            System::Peer(p) => p.name,
        }
    }

    /// The name as part of object names (DNS labels: no `_`).
    fn slug(&self) -> String {
        self.name().replace('_', "-")
    }

    fn run_key(&self, run: &str) -> String {
        match self {
            System::Agentrun(a) => a.seen.get(run).uid,
            System::Peer(_) => run.to_string(),
        }
    }
}

/// The figures' work; `a` is agentrun's namespace, whose stand-ins every
/// system shares.
struct Bench {
    cfg: Config,
    figures: Figures,
}

/// A model script and a tool tenant of its own for `figure` on `system`.
async fn new_script(a: &Agentrun, figure: &str, system: &str, replies: Value) -> (String, String) {
    let id = format!("{figure}-{system}-{}", a.name());
    a.standins().script_by_turn(&id, replies, json!([])).await;
    (id.clone(), id)
}

impl Bench {
    // --- steps ------------------------------------------------------------------

    async fn steps(&mut self, a: &Agentrun, sys: &System<'_>) {
        let name = sys.name();
        let (script, tenant) = new_script(a, "steps", name, steps_script(self.cfg.steps)).await;
        if let System::Agentrun(a) = sys {
            a.agent(
                &format!("steps-{}", sys.slug()),
                &script,
                &tenant,
                json!({}),
            )
            .await;
        }
        for (label, n) in [
            ("c1", 1),
            (&*format!("c{}", self.cfg.concurrent), self.cfg.concurrent),
        ] {
            let runs = names(&format!("{}-steps-{label}", sys.slug()), n);
            let submitted = self.submit_steps(sys, &script, &tenant, &runs).await;
            let traces = traces(a.standins(), &script, &tenant, &runs, |r| sys.run_key(r)).await;
            let mut overheads = Vec::new();
            let mut first_calls = Vec::new();
            let mut tools = 0;
            let mut end: f64 = 0.0;
            for (run, t) in &traces {
                if self.cfg.check {
                    assert_eq!(
                        t.tool_count(),
                        self.cfg.steps,
                        "{name} {run}: one tool call per step"
                    );
                    assert_eq!(t.recorded_answers_asked_again(), 0, "{name} {run}");
                }
                overheads.extend(t.step_overheads());
                if let (Some(first), Some(sent)) = (t.first(), submitted.get(run)) {
                    first_calls.push(first - sent);
                }
                tools += t.tool_count();
                end = end.max(t.last_end().unwrap_or(0.0));
            }
            let start = submitted.values().copied().fold(f64::INFINITY, f64::min);
            let ms: Vec<f64> = overheads.iter().map(|s| s * 1e3).collect();
            let f = &mut self.figures;
            f.put(
                &format!("steps.{label}.overhead_p50"),
                name,
                quantile(&ms, 0.5),
                "ms",
            );
            f.put(
                &format!("steps.{label}.overhead_p99"),
                name,
                quantile(&ms, 0.99),
                "ms",
            );
            let first_ms: Vec<f64> = first_calls.iter().map(|s| s * 1e3).collect();
            f.put(
                &format!("steps.{label}.first_call"),
                name,
                quantile(&first_ms, 0.5),
                "ms",
            );
            f.put(
                &format!("steps.{label}.throughput"),
                name,
                tools as f64 / (end - start),
                "steps/s",
            );
            if label == "c1"
                && let System::Agentrun(a) = sys
            {
                self.profile_start(a, &runs[0], &submitted, &traces[0].1);
            }
        }
    }

    /// Runs `runs` to their end; when each was submitted.
    async fn submit_steps(
        &self,
        sys: &System<'_>,
        script: &str,
        tenant: &str,
        runs: &[String],
    ) -> HashMap<String, f64> {
        match sys {
            System::Agentrun(a) => {
                let sent = a
                    .create_runs(&format!("steps-{}", sys.slug()), runs, json!({}))
                    .await;
                a.wait_succeeded(runs, Duration::from_secs(600)).await;
                sent
            }
            System::Peer(p) => {
                let out = p
                    .run(script, tenant, "steps", &list_arg("--runs", runs))
                    .await;
                record_versions(p.name, &out);
                started(&out)
            }
        }
    }

    /// agentrun's first step, by stage: created → Job → pod Running → the
    /// first model request.
    fn profile_start(&mut self, a: &Agentrun, run: &str, sent: &HashMap<String, f64>, t: &Trace) {
        let seen = a.seen.get(run);
        let (created, job, running, first) = (
            sent.get(run).copied(),
            seen.jobs.first().map(|j| j.seen),
            seen.pods_running().first().copied(),
            t.first(),
        );
        let (Some(created), Some(job), Some(first)) = (created, job, first) else {
            note(&format!(
                "profile of the first step: not seen: created {created:?}, Job {job:?}, \
                 first model request {first:?}"
            ));
            return;
        };
        let ours = a.label();
        let f = &mut self.figures;
        let ms = |from: f64, to: f64| (to - from) * 1e3;
        f.put("profile.start.created_to_job", ours, ms(created, job), "ms");
        // Whole, for the real node: its kubelet may report the pod started
        // after the pod's first request (status writes are batched).
        f.put(
            "profile.start.job_to_model_call",
            ours,
            ms(job, first),
            "ms",
        );
        let Some(running) = running else {
            note("profile of the first step: its pod was never reported started");
            return;
        };
        f.put(
            "profile.start.job_to_pod_running",
            ours,
            ms(job, running),
            "ms",
        );
        f.put(
            "profile.start.pod_running_to_model_call",
            ours,
            ms(running, first),
            "ms",
        );
    }

    // --- waiting and resume -----------------------------------------------------

    async fn waiting(&mut self, a: &Agentrun, sys: &System<'_>) {
        let name = sys.name();
        let (script, tenant) = new_script(a, "gated", name, gated_script()).await;
        let waiting = names(&format!("{}-wait", sys.slug()), self.cfg.waiting);
        let decided = names(&format!("{}-decide", sys.slug()), self.cfg.decisions);
        let (sent, cost) = match sys {
            System::Agentrun(a) => {
                self.agentrun_waiting(a, &script, &tenant, &waiting, &decided)
                    .await
            }
            System::Peer(p) => {
                let mut args = list_arg("--runs", &waiting);
                args.extend(list_arg("--decide", &decided));
                args.extend(["--idle-seconds".to_string(), self.cfg.idle.to_string()]);
                let out = p.run(&script, &tenant, "waiting", &args).await;
                let sent: HashMap<String, f64> = out["decided"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(f64::NAN)))
                            .collect()
                    })
                    .unwrap_or_default();
                (sent, Cost::from_peer(&out))
            }
        };
        let traces = traces(a.standins(), &script, &tenant, &decided, |r| sys.run_key(r)).await;
        let mut ms = Vec::new();
        for (run, t) in &traces {
            let at = sent.get(run).copied().unwrap_or(f64::NAN);
            match t.next_tool_after(at) {
                Some(tool) => ms.push((tool - at) * 1e3),
                None => panic!("{name}: run {run} approved at {at} never called the tool"),
            }
        }
        let w = self.cfg.waiting;
        let f = &mut self.figures;
        f.put(&format!("resume.w{w}.p50"), name, quantile(&ms, 0.5), "ms");
        f.put(&format!("resume.w{w}.p99"), name, quantile(&ms, 0.99), "ms");
        cost.report(
            f,
            name,
            self.cfg.idle as f64,
            self.cfg.waiting + self.cfg.decisions,
        );
    }

    async fn agentrun_waiting(
        &mut self,
        a: &Agentrun,
        script: &str,
        tenant: &str,
        waiting: &[String],
        decided: &[String],
    ) -> (HashMap<String, f64>, Cost) {
        a.agent("gated", script, tenant, json!({})).await;
        let api_before = a.api_bytes().await;
        let all: Vec<String> = waiting.iter().chain(decided).cloned().collect();
        a.create_runs("gated", &all, json!({})).await;
        let timeout = Duration::from_secs(60 + all.len() as u64);
        a.wait_all("awaiting approval", &all, timeout, |s| s.approval.is_some())
            .await;
        // Their step pods exited after asking, and each run let go of the
        // Job that asked: the window starts once Kubernetes has removed
        // those, so that it measures waiting, not the clean-up.
        common::wait_for(
            "the waiting runs' step pods to end and the Jobs they let go to be gone",
            Duration::from_secs(300),
            || async {
                match a.not_yet_let_go(&all).await {
                    0 => Ok(()),
                    n => Err(format!("{n} pods running or Jobs let go")),
                }
            },
        )
        .await;
        // Jobs an earlier step left before its run came to wait (kept for
        // their usual time to live).
        let kept = a.jobs_of(&all).await;
        note(&format!(
            "{}: {kept} step Jobs kept by {} waiting runs",
            a.label(),
            all.len()
        ));
        let mut cost = Cost::measure(
            self.cfg.idle,
            a.engine_pids().await,
            a.database_pids().await,
        )
        .await;
        let uids: Vec<String> = all.iter().map(|r| a.seen.get(r).uid).collect();
        cost.stored = Pg::connect(&a.store_url().await).await.bytes(&uids).await as f64;
        cost.api_stored = (a.api_bytes().await.saturating_sub(api_before)) as f64;
        let mut sent = HashMap::new();
        let mut stages: Vec<[Option<f64>; 4]> = Vec::new();
        for run in decided {
            let at = a.approve(run).await;
            sent.insert(run.clone(), at);
            a.wait_succeeded(std::slice::from_ref(run), Duration::from_secs(120))
                .await;
            // A real node's kubelet may report the pod started after the
            // run's end: its report is waited for a little.
            let pod = pod_started_after(a, run, at).await;
            let seen = a.seen.get(run);
            let job = seen.jobs.iter().map(|j| j.seen).find(|t| *t > at);
            let tool = tool_calls(a.standins(), tenant)
                .await
                .remove(&seen.uid)
                .and_then(|c| c.iter().map(|c| c.at).find(|t| *t > at));
            let between = |from: Option<f64>, to: Option<f64>| Some(to? - from?);
            stages.push([
                between(Some(at), job),
                between(job, pod),
                between(pod, tool),
                between(job, tool),
            ]);
        }
        for (i, stage) in [
            "decision_to_job",
            "job_to_pod_running",
            "pod_running_to_tool_call",
            // Whole, as for the first step (the pod's report may come late).
            "job_to_tool_call",
        ]
        .iter()
        .enumerate()
        {
            let ms: Vec<f64> = stages
                .iter()
                .filter_map(|s| s[i])
                .map(|s| s * 1e3)
                .collect();
            self.figures.put(
                &format!("profile.resume.{stage}"),
                a.label(),
                quantile(&ms, 0.5),
                "ms",
            );
        }
        a.delete_runs(waiting).await;
        (sent, cost)
    }

    // --- a worker killed mid-step -------------------------------------------------

    async fn kill(&mut self, a: &Agentrun, sys: &System<'_>, seed: u64) {
        let name = sys.name();
        let (script, tenant) = new_script(a, "kill", name, steps_script(self.cfg.kill_turns)).await;
        a.standins()
            .configure_tools(
                &tenant,
                json!({"delayMs": {"lookup_order": self.cfg.kill_tool_delay_ms}}),
            )
            .await;
        let runs = names(&format!("{}-kill", sys.slug()), self.cfg.kills);
        // Lands within the run's tool calls, whichever.
        let max_delay_ms = (self.cfg.kill_turns as u64 - 1) * self.cfg.kill_tool_delay_ms;
        let kills: HashMap<String, f64> = match sys {
            System::Agentrun(a) => {
                a.agent("kill", &script, &tenant, json!({})).await;
                let mut rng = seed;
                let mut kills = HashMap::new();
                for run in &runs {
                    a.create_runs("kill", std::slice::from_ref(run), json!({}))
                        .await;
                    // From its worker's start, as for the peers (whose
                    // workers are up before their runs start).
                    kill_agentrun_worker(a, run, 0).await;
                    let delay = 1 + next_random(&mut rng) % max_delay_ms;
                    kills.insert(run.clone(), kill_agentrun_worker(a, run, delay).await);
                    a.wait_succeeded(std::slice::from_ref(run), Duration::from_secs(180))
                        .await;
                }
                kills
            }
            System::Peer(p) => {
                let mut args = list_arg("--runs", &runs);
                args.extend([
                    "--seed".into(),
                    seed.to_string(),
                    "--max-delay-ms".into(),
                    max_delay_ms.to_string(),
                ]);
                let out = p.run(&script, &tenant, "kill", &args).await;
                out["kills"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(f64::NAN)))
                            .collect()
                    })
                    .unwrap_or_default()
            }
        };
        let traces = traces(a.standins(), &script, &tenant, &runs, |r| sys.run_key(r)).await;
        let mut recovery = Vec::new();
        let mut asked_again = 0;
        let mut stages = Vec::new();
        for (run, t) in &traces {
            let at = kills.get(run).copied().unwrap_or(f64::NAN);
            match t.next_after(at) {
                Some(c) => {
                    recovery.push(c.at - at);
                    if let System::Agentrun(a) = sys {
                        stages.push((c.at - at, kill_stages(&a.seen.get(run), at, c.at)));
                    }
                }
                None => panic!("{name}: run {run} made no request after its worker was killed"),
            }
            asked_again += t.recorded_answers_asked_again();
        }
        if let System::Agentrun(a) = sys {
            self.profile_kill(a.label(), &stages);
        }
        let twice = effects_twice(a.standins(), &tenant).await;
        let f = &mut self.figures;
        f.put("kill.recovery_p50", name, quantile(&recovery, 0.5), "s");
        f.put("kill.recovery_max", name, quantile(&recovery, 1.0), "s");
        f.put(
            "kill.model_asked_again",
            name,
            asked_again as f64,
            "answers",
        );
        f.put("kill.effects_twice", name, twice as f64, "effects");
        assert_eq!(
            asked_again, 0,
            "{name}: recorded model answers asked again after a kill"
        );
        assert_eq!(twice, 0, "{name}: tool effects done twice after a kill");
    }

    /// agentrun's recovery after a kill, by stage (medians), and the
    /// slowest recovery's stages whole.
    fn profile_kill(&mut self, ours: &str, kills: &[(f64, Vec<(&'static str, f64)>)]) {
        let mut by_stage: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for (_, stages) in kills {
            for (stage, secs) in stages {
                by_stage.entry(stage).or_default().push(secs * 1e3);
            }
        }
        for (stage, ms) in &by_stage {
            let figure = format!("profile.kill.{stage}");
            self.figures.put(&figure, ours, quantile(ms, 0.5), "ms");
        }
        if let Some((total, stages)) = kills.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
            let shown: Vec<String> = stages
                .iter()
                .map(|(stage, secs)| format!("{stage} {:.0} ms", secs * 1e3))
                .collect();
            note(&format!(
                "{ours}: the slowest recovery after a kill ({total:.1} s): {}",
                shown.join(", ")
            ));
        }
    }

    // --- the three clocks ---------------------------------------------------------

    async fn clocks(&mut self, a: &Agentrun) {
        let (script, tenant) = new_script(a, "clocks", a.label(), steps_script(3)).await;
        // The tool never answers in time: the clocks, not the work, end these runs.
        a.standins()
            .configure_tools(&tenant, json!({"delayMs": {"lookup_order": 600_000}}))
            .await;
        a.agent(
            "clock",
            &script,
            &tenant,
            json!({"retry": {"maxAttemptsWithoutProgress": 1}}),
        )
        .await;
        let (gscript, gtenant) = new_script(a, "expiry", a.label(), gated_script()).await;
        let mut expiring = json!({"name": "refund", "tool": "issue_refund", "when": "true",
            "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "3s", "onExpiry": "Fail"});
        expiring["escalateTo"] = Value::Null;
        a.agent(
            "expiring",
            &gscript,
            &gtenant,
            json!({"approval": {"rules": [expiring]}}),
        )
        .await;
        let deadline = ["clock-deadline".to_string()];
        let timeout = ["clock-step-timeout".to_string()];
        let expiry = ["clock-expiry".to_string()];
        a.create_runs("clock", &deadline, json!({"deadline": "4s"}))
            .await;
        a.create_runs("clock", &timeout, json!({"stepTimeout": "3s"}))
            .await;
        a.create_runs("expiring", &expiry, json!({})).await;
        let ended = |s: &agentrun_side::Seen| s.phase.is_some_and(|p| p.is_terminal());
        a.wait_all(
            "ended by a clock",
            &deadline,
            Duration::from_secs(60),
            ended,
        )
        .await;
        a.wait_all("ended by a clock", &expiry, Duration::from_secs(60), ended)
            .await;
        a.wait_all(
            "on a second attempt",
            &timeout,
            Duration::from_secs(60),
            |s| s.jobs.len() >= 2,
        )
        .await;

        let d = a.seen.get(&deadline[0]);
        let d_late = d
            .phases
            .get("DeadlineExceeded")
            .copied()
            .unwrap_or(f64::NAN)
            - d.deadline_at.unwrap_or(f64::NAN);
        let t = a.seen.get(&timeout[0]);
        let first = t.jobs.iter().find(|j| j.attempt == 1 || t.jobs.len() == 2);
        let second = t.jobs.iter().map(|j| j.seen).fold(f64::NAN, f64::max);
        let t_late = second - first.and_then(|j| j.started).unwrap_or(f64::NAN) - 3.0;
        let e = a.seen.get(&expiry[0]);
        let approvals: kube::Api<agentrun::api::Approval> =
            kube::Api::namespaced(a.client.clone(), a.name());
        let expires_at = match &e.approval {
            Some(name) => approvals.get(name).await.map_or(f64::NAN, |ap| {
                ap.spec.expires_at.0.as_microsecond() as f64 / 1e6
            }),
            None => f64::NAN,
        };
        let e_late = e.ended.unwrap_or(f64::NAN) - expires_at;
        let ours = a.label();
        let f = &mut self.figures;
        f.put("clocks.deadline_late", ours, d_late * 1e3, "ms");
        f.put("clocks.step_timeout_late", ours, t_late * 1e3, "ms");
        f.put("clocks.approval_expiry_late", ours, e_late * 1e3, "ms");
        if self.cfg.check {
            for (clock, late) in [
                ("deadline", d_late),
                ("step timeout", t_late),
                ("approval expiry", e_late),
            ] {
                assert!(
                    late.is_finite() && late < 1.0,
                    "the {clock} acted {late:.3} s after its time (must be within 1 s)"
                );
            }
        }
        a.delete_runs(&[deadline[0].clone(), timeout[0].clone(), expiry[0].clone()])
            .await;
    }
}

/// Waits for run `run`'s step process, then `delay_ms`, then SIGKILLs it
/// (0: only waits for it); when it was killed.
async fn kill_agentrun_worker(a: &Agentrun, run: &str, delay_ms: u64) -> f64 {
    for _ in 0..400 {
        let uid = a.seen.get(run).uid;
        if !uid.is_empty() && a.step_process(&uid).is_some() {
            if delay_ms == 0 {
                return trace::now();
            }
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            if let Some(pid) = a.step_process(&uid) {
                // SAFETY: kill(2) on a pid read from /proc; no memory effects.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                return trace::now();
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("agentrun: no step process of run {run} to kill within 10 s");
}

/// When a pod of run `run` was first reported started after `at`, waited
/// for up to 10 s (the kubelet writes pod statuses in batches); `None` if
/// it never was.
async fn pod_started_after(a: &Agentrun, run: &str, at: f64) -> Option<f64> {
    for _ in 0..400 {
        if let Some(t) = a.seen.get(run).pods_running().into_iter().find(|t| *t > at) {
            return Some(t);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

/// Where a run's time went from its worker's kill (`at`) to its next
/// request (`next`): the killed Job reported failed, the next Job seen, its
/// pod seen, bound to the node, started, and the request. A stage not seen
/// is left out.
fn kill_stages(seen: &Seen, at: f64, next: f64) -> Vec<(&'static str, f64)> {
    let failed = seen.jobs.iter().filter_map(|j| j.failed).find(|t| *t > at);
    let job = seen.jobs.iter().map(|j| j.seen).find(|t| *t > at);
    let pod = job.and_then(|job| seen.pods.iter().find(|p| p.created >= job));
    let mut stages = Vec::new();
    if let Some(failed) = failed {
        stages.push(("kill_to_job_failed", failed - at));
    }
    let Some(job) = job else {
        return stages;
    };
    stages.push(("kill_to_next_job", job - at));
    let Some(pod) = pod else {
        return stages;
    };
    stages.push(("next_job_to_pod_created", pod.created - job));
    if let Some(scheduled) = pod.scheduled {
        stages.push(("pod_created_to_scheduled", scheduled - pod.created));
    }
    if let Some(started) = pod.started {
        stages.push(("pod_created_to_started", started - pod.created));
    }
    stages.push(("pod_created_to_request", next - pod.created));
    stages
}

/// xorshift64: the kill points, the same for every system with one seed.
fn next_random(state: &mut u64) -> u64 {
    let mut x = (*state).max(1);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

fn started(out: &Value) -> HashMap<String, f64> {
    out["runs"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v["start"].as_f64().unwrap_or(f64::NAN)))
                .collect()
        })
        .unwrap_or_default()
}

fn record_versions(system: &str, out: &Value) {
    if let Some(v) = out.get("versions") {
        note(&format!("{system} versions: {v}"));
    }
}

/// What a system keeps running for its waiting runs, over an idle window.
#[derive(Default)]
struct Cost {
    /// Proportional memory (PSS: shared pages split among their users) and
    /// CPU seconds by part (engine, worker, database).
    memory: BTreeMap<String, f64>,
    cpu: BTreeMap<String, f64>,
    /// Bytes stored for them (agentrun: in its step store).
    stored: f64,
    /// agentrun: the AgentRun and Approval objects in the API server.
    api_stored: f64,
    /// agentrun: the control plane's memory and CPU seconds.
    control_plane: Option<(f64, f64)>,
}

impl Cost {
    fn from_peer(out: &Value) -> Cost {
        let parts = |key: &str| -> BTreeMap<String, f64> {
            out["idle"][key]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(0.0)))
                        .collect()
                })
                .unwrap_or_default()
        };
        Cost {
            memory: parts("pss_bytes"),
            cpu: parts("cpu_seconds"),
            // What the waiting runs added to the engine's storage.
            stored: out["stored_bytes"].as_f64().unwrap_or(0.0),
            ..Default::default()
        }
    }

    /// agentrun's: the controller (engine), its step pods (none while runs
    /// wait), PostgreSQL (database); the API server and etcd apart.
    async fn measure(seconds: u64, engine: Vec<u32>, database: Vec<u32>) -> Cost {
        assert!(!engine.is_empty(), "the controller runs");
        let parts: Vec<(&str, Vec<u32>)> = vec![
            ("engine", engine),
            ("database", database),
            (
                "control_plane",
                ["apiserver", "etcd"]
                    .into_iter()
                    .filter_map(common::procs::cluster_pid)
                    .collect(),
            ),
        ];
        let before: Vec<f64> = parts
            .iter()
            .map(|(_, p)| common::procs::cpu_seconds(p))
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let mut cost = Cost::default();
        for (i, (part, pids)) in parts.iter().enumerate() {
            let cpu = common::procs::cpu_seconds(pids) - before[i];
            let memory = common::procs::pss_bytes(pids);
            if *part == "control_plane" {
                cost.control_plane = Some((memory, cpu));
            } else {
                cost.memory.insert(part.to_string(), memory);
                cost.cpu.insert(part.to_string(), cpu);
            }
        }
        cost.memory.insert("worker".into(), 0.0);
        cost.cpu.insert("worker".into(), 0.0);
        cost
    }

    fn report(&self, f: &mut Figures, system: &str, seconds: f64, runs: usize) {
        let memory: f64 = self.memory.values().sum();
        let cpu: f64 = self.cpu.values().sum();
        f.put("waiting.memory", system, memory / 1e6, "MB");
        f.put("waiting.cpu", system, 100.0 * cpu / seconds, "%core");
        f.put(
            "waiting.stored_per_run",
            system,
            (self.stored + self.api_stored) / runs as f64,
            "bytes",
        );
        for (part, v) in &self.memory {
            println!(
                "bench: peers.waiting.memory.{part}.{system} {:.1} MB",
                v / 1e6
            );
        }
        for (part, v) in &self.cpu {
            println!(
                "bench: peers.waiting.cpu.{part}.{system} {:.2} %core",
                100.0 * v / seconds
            );
        }
        if self.api_stored > 0.0 {
            println!(
                "bench: peers.waiting.stored_per_run.store.{system} {:.0} bytes",
                self.stored / runs as f64
            );
            println!(
                "bench: peers.waiting.stored_per_run.api_objects.{system} {:.0} bytes",
                self.api_stored / runs as f64
            );
        }
        if let Some((memory, cpu)) = self.control_plane {
            println!(
                "bench: peers.waiting.memory.control_plane.{system} {:.1} MB",
                memory / 1e6
            );
            println!(
                "bench: peers.waiting.cpu.control_plane.{system} {:.2} %core",
                100.0 * cpu / seconds
            );
        }
    }
}

/// The step store, for the bytes the waiting runs took (their rows: a
/// table's size moves by whole pages, and reuses what deleted runs left).
struct Pg(sqlx::PgPool);

impl Pg {
    async fn connect(url: &str) -> Pg {
        Pg(sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .expect("connecting to the step store"))
    }

    /// The bytes of the rows (records and leases) of the runs `uids`.
    async fn bytes(&self, uids: &[String]) -> i64 {
        sqlx::query_scalar(
            "SELECT (SELECT coalesce(sum(pg_column_size(s.*)), 0) FROM agentrun_steps s WHERE run = ANY($1)) \
                  + (SELECT coalesce(sum(pg_column_size(l.*)), 0) FROM agentrun_leases l WHERE run = ANY($1))",
        )
        .bind(uids)
        .fetch_one(&self.0)
        .await
        .expect("row sizes")
    }
}

fn main() {
    let cfg = Config::from_args();
    common::bench_main("peers", cfg.check, async move {
        println!(
            "peers: {} mode; steps {}, {} at once, {} waiting, {} decisions, {} kills; systems {:?}",
            if cfg.check {
                "quick (promises asserted)"
            } else {
                "full"
            },
            cfg.steps,
            cfg.concurrent,
            cfg.waiting,
            cfg.decisions,
            cfg.kills,
            cfg.systems
        );
        if cfg.check {
            trace::self_check();
        }
        let agentrun = Agentrun::new().await;
        let base = agentrun.standins_base();
        let mut cfg = cfg;
        if agentrun.label() != "agentrun" && std::env::var("AGENTRUN_PEERS_SYSTEMS").is_err() {
            // The peers do not run on a node: measured once, with the
            // process node's run (their figures come through carry()).
            cfg.systems = vec!["agentrun".into()];
        }
        println!("peers: agentrun as {}", agentrun.label());
        let mut bench = Bench {
            cfg,
            figures: Figures::default(),
        };
        let python = (bench.cfg.runs("temporal") || bench.cfg.runs("dbos")).then(python::python);
        let pg_url = common::scripts::e2e_script(
            "postgres",
            "url",
            &[],
            "DBOS keeps its state in PostgreSQL",
        );
        let peers: Vec<Peer> = ["temporal", "dbos"]
            .into_iter()
            .filter(|p| bench.cfg.runs(p))
            .map(|p| {
                let db = (p == "dbos").then(|| pg_url.clone());
                Peer::new(p, python.clone().expect("python"), &base, db)
            })
            .collect();
        let mut systems: Vec<System> = Vec::new();
        if bench.cfg.runs("agentrun") {
            systems.push(System::Agentrun(&agentrun));
        }
        systems.extend(peers.iter().map(System::Peer));
        let seed = 20261203;
        // One figure at a time for every system, so the machine's state is
        // as alike as can be for each.
        let steps = bench.cfg.measures("steps");
        for sys in systems.iter().filter(|_| steps) {
            bench.steps(&agentrun, sys).await;
        }
        let waiting = bench.cfg.measures("waiting");
        for sys in systems.iter().filter(|_| waiting) {
            bench.waiting(&agentrun, sys).await;
        }
        let kill = bench.cfg.measures("kill");
        for sys in systems.iter().filter(|_| kill) {
            bench.kill(&agentrun, sys, seed).await;
        }
        if bench.cfg.runs("agentrun") && bench.cfg.measures("clocks") {
            bench.clocks(&agentrun).await;
        }
        bench.figures.carry();
        bench.figures.ratios();
    });
}
