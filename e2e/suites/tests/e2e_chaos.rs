//! The fault harness (`e2e/chaos`): one scripted scenario that meets every
//! kind of boundary, run once without faults and then once per failpoint
//! boundary of the step runner and the controller, with a crash exactly
//! there; and a random mode (many runs, pods deleted, the process node
//! restarted, the controller SIGKILLed, the store restarted, reproducible
//! by seed).
//!
//! The scenario: an idempotent tool (`issue_refund`), a tool with only a
//! read-back lookup (`notify`), a tool with neither (`page_oncall`), a model
//! reply that cannot be read (an Observation fed back), a 2-of-3 approval
//! decided by two identical edits after its order changed once (the first
//! decision is void and asked again), a rejection the agent
//! adapts to, a compaction, and a `FollowLatest` version change while it
//! waits. Every faulted run must converge to the fault-free phase and
//! result with the same sequence of record kinds, a log that verifies, no
//! side effect twice at the tool server, and no recorded model answer asked
//! for again (the stand-in model answers by conversation turn, so a
//! repeated question is seen, and timed against the record).
//!
//! Prints one table line per boundary and `bench: chaos.boundaries <n>`,
//! `bench: chaos.converged <n>`; fails on any miss. Environment:
//! AGENTRUN_CHAOS_CONCURRENCY (boundaries at once, default 4),
//! AGENTRUN_CHAOS_SECONDS (random mode, default 40), AGENTRUN_CHAOS_SEED
//! (default 1), AGENTRUN_CHAOS_RUNS (random mode, default 4),
//! AGENTRUN_CHAOS_ONLY (only the boundaries whose name contains it).
//!
//! A second table runs a container agent (the plain `openai` loop of
//! e2e/agents, unmodified) through the boundaries its run meets.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun::api::{Agent, AgentRun, Approval, ApprovalKind, Phase};
use agentrun::failpoint;
use agentrun::store::StepKind;
use common::approvals::{decide, entry, grant_approver_role};
use common::store::PrivatePostgres;
use common::world::{World, call, finish};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const RESULT: &str = "refunded 300 on A-1, declined the 5000 refund, notified, paged";
/// Longest a scenario may take.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(120);
/// The harness's two tests load the machine: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The model's side of the scenario, one reply per turn; `p` names the
/// orders (runs of one world refund orders of their own).
fn replies(p: &str) -> Value {
    let pad = "Context that makes the history long enough to compact. ".repeat(20);
    json!([
        {"text": format!("Looking the order up. {pad}"),
         "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("{p}A-1")}}]},
        // A reply that is not JSON: recorded as an Observation and fed back
        // (its marker, echoed in the observation, moves the turn on).
        {"rawBody": "upstream glitch, not JSON [[turn 1]]"},
        {"text": format!("The customer was charged twice; refunding 500. {pad}"),
         "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": format!("{p}A-1"), "amount": 500}}]},
        {"text": format!("Also refunding the second order. {pad}"),
         "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": format!("{p}A-2"), "amount": 5000}}]},
        {"text": "That refund was declined; telling the customer.",
         "toolCalls": [{"name": "notify", "arguments": {"text": format!("{p}A-1 refunded 300; {p}A-2 declined")}}]},
        call("page_oncall", json!({"note": format!("{p}refunds")})),
        finish(RESULT)
    ])
}

fn agent_spec(w: &World, script: &str) -> Value {
    let mut agent = w.agent(script);
    let approvers = json!({"users": ["alice", "bob", "carol"]});
    // A refund depends on its order's record: a change voids the approval.
    let lookup = format!("{}/tools/{}/records/{{orderId}}", w.standins.base, w.name());
    agent["approval"] = json!({"rules": [{
        "name": "refunds", "tool": "issue_refund", "when": "args.amount > 100",
        "approvers": approvers, "requiredApprovals": 2,
        "expiresAfter": "10m", "onExpiry": "Fail",
        "dependencies": [{"name": "order", "lookup": lookup}]
    }],
    // Who answers for a call whose outcome cannot be known (a keyless tool
    // cut off mid-call): asked, never assumed.
    "defaultApprovers": approvers});
    agent["context"] = json!({"maxTokens": 900, "recentSteps": 3});
    agent
}

/// Sets order `id`'s record at the tool server (what a refund depends on).
async fn put_order(w: &World, id: &str, data: Value) {
    let url = format!("{}/tools/{}/records/{id}", w.standins.base, w.name());
    let resp = w
        .standins
        .http
        .put(url)
        .json(&json!({ "data": data }))
        .send()
        .await
        .expect("PUT record");
    assert!(resp.status().is_success(), "PUT record: {}", resp.status());
}

/// The orders of the run whose order ids start with `p`, as first seen.
async fn put_orders(w: &World, p: &str) {
    for order in ["A-1", "A-2"] {
        put_order(w, &format!("{p}{order}"), json!({"charged": 2})).await;
    }
}

/// What a scenario ended with.
#[derive(Debug, Default)]
struct Outcome {
    phase: Option<Phase>,
    result: Option<String>,
    error: Option<String>,
    kinds: Vec<String>,
    effects: Vec<Value>,
    /// The failpoint fired (a Job failed, or the controller crashed).
    fired: bool,
    misses: Vec<String>,
}

/// Runs the scenario in a world of its own, with `fault` armed (a runner
/// failpoint through the run's annotation, a `controller:` one in the
/// controller's environment). Humans decide as they would; a controller
/// that crashed is started again.
async fn scenario(id: &str, fault: Option<&str>) -> Outcome {
    let (env, annotations) = armed(fault);
    let mut w = World::with_controller_env(&format!("chaos-{id}"), &[], &env).await;
    grant_approver_role(&w).await;
    w.standins
        .script_by_turn(
            "chaos",
            replies(""),
            json!([{"text": "Summary: order A-1 looked up."}]),
        )
        .await;
    put_orders(&w, "").await;
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "chaos"}, "spec": agent_spec(&w, "chaos")
    }))
    .unwrap();
    agents.create(&PostParams::default(), &agent).await.unwrap();
    w.create_run(
        "chaos",
        json!({"input": "Sort out the customer's refunds.", "agentRef": {"name": "chaos"},
               "versionPolicy": "FollowLatest"}),
        annotations,
    )
    .await;
    outcome(&mut w, "chaos").await
}

/// The controller's environment and the run's annotations that arm `fault`
/// (a runner failpoint through the run, a `controller:` one in the
/// controller's environment).
fn armed(fault: Option<&str>) -> (Vec<(&str, &str)>, Value) {
    match fault {
        Some(f) if f.starts_with("controller:") => (vec![("AGENTRUN_FAILPOINT", f)], json!({})),
        Some(f) => (vec![], json!({"agentrun.dev/failpoint": f})),
        None => (vec![], json!({})),
    }
}

/// Plays the humans until run `run` (model script of the same name) ends,
/// and reads what it left; the fault fired if the controller crashed, a
/// Job failed before the next (counted in the run's status), or the last
/// Job failed (a crash after the run's end was recorded leaves no next Job).
async fn outcome(w: &mut World, run: &str) -> Outcome {
    let mut crashed = false;
    let ended = drive(w, run, &mut crashed).await;
    let mut out = collect(w, &ended, run).await;
    let failed_jobs = ended
        .status
        .as_ref()
        .and_then(|s| s.step.as_ref())
        .map_or(0, |s| s.failed_jobs);
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), w.name());
    let a_job_failed = jobs
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .iter()
        .any(|j| {
            let conditions = j.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.status == "True" && (c.type_ == "Failed" || c.type_ == "FailureTarget")
                })
            })
        });
    out.fired = crashed || failed_jobs > 0 || a_job_failed;
    out
}

/// Plays the humans (see [`drive_once`]) until the run ends, starting the
/// controller again whenever it crashed.
async fn drive(w: &mut World, run: &str, crashed: &mut bool) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let mut decided: HashSet<String> = HashSet::new();
    let started = Instant::now();
    loop {
        *crashed |= w.revive_controller();
        let seen = runs.get(run).await.ok();
        if let Some(r) = &seen
            && r.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| p.is_terminal())
        {
            return r.clone();
        }
        if started.elapsed() > SCENARIO_TIMEOUT {
            let uid = seen
                .as_ref()
                .and_then(|r| r.metadata.uid.clone())
                .unwrap_or_default();
            let records = w.store().await.read_all(&uid).await.unwrap_or_default();
            let kinds: Vec<String> = records
                .iter()
                .map(|r| {
                    let turn = highest_turn(&r.payload.to_string());
                    format!(
                        "{}{}",
                        r.kind,
                        turn.map_or(String::new(), |t| format!("@{t}"))
                    )
                })
                .collect();
            panic!(
                "{}: run {run} did not end within {SCENARIO_TIMEOUT:?}; status {:?}; log {kinds:?}",
                w.name(),
                seen.and_then(|r| r.status)
            );
        }
        drive_once(w, &mut decided).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The highest `[[turn N]]` marker in `text`.
fn highest_turn(text: &str) -> Option<usize> {
    text.split("[[turn ")
        .skip(1)
        .filter_map(|rest| rest.split("]]").next()?.parse().ok())
        .max()
}

/// Reads what a finished run left: status, verified log, effects, and
/// whether a recorded model answer was asked for again.
async fn collect(w: &World, run: &AgentRun, script: &str) -> Outcome {
    let status = run.status.clone().unwrap_or_default();
    let mut out = Outcome {
        phase: status.phase,
        result: status.result.clone(),
        error: status.error.clone(),
        ..Outcome::default()
    };
    let log = w.log(run).await; // panics unless the chain verifies against status.log
    out.kinds = log
        .iter()
        .map(|(r, _)| r.kind.as_str().to_string())
        .collect();
    out.effects = w.standins.effects(w.name()).await;
    let mut seen = HashSet::new();
    for e in &out.effects {
        if !seen.insert((e["tool"].to_string(), e["args"].to_string())) {
            out.misses.push(format!("effect twice: {e}"));
        }
    }
    // When each turn's answer was recorded.
    let mut recorded: BTreeMap<usize, chrono::DateTime<chrono::Utc>> = BTreeMap::new();
    for (r, _) in &log {
        if r.kind == StepKind::ModelCall
            && let (Some(turn), Some(at)) = (highest_turn(&r.payload.to_string()), r.created_at)
        {
            recorded.entry(turn).or_insert(at);
        }
    }
    let calls: Value = w.standins.get(&format!("/scripts/{script}/calls")).await;
    let requests = calls["requests"].as_array().cloned().unwrap_or_default();
    let received = calls["receivedAt"].as_array().cloned().unwrap_or_default();
    for (req, at) in requests.iter().zip(received) {
        let offers_tools = req["tools"].as_array().is_some_and(|t| !t.is_empty());
        if !offers_tools {
            continue;
        }
        let asks = highest_turn(&req.to_string()).map_or(0, |t| t + 1);
        let at: chrono::DateTime<chrono::Utc> = at.as_str().unwrap_or_default().parse().unwrap();
        if let Some(rec) = recorded.get(&asks)
            && at > *rec
        {
            out.misses.push(format!(
                "turn {asks} was asked again at {at} after its answer was recorded at {rec}"
            ));
        }
    }
    out
}

/// Compares a faulted outcome with the fault-free one.
fn judge(base: &Outcome, got: &Outcome) -> Vec<String> {
    let mut misses = got.misses.clone();
    if !got.fired {
        misses.push("the failpoint never fired".into());
    }
    if got.phase != base.phase || got.result != base.result {
        misses.push(format!(
            "ended {:?} {:?} (error {:?}), not {:?} {:?}",
            got.phase, got.result, got.error, base.phase, base.result
        ));
    }
    if got.kinds != base.kinds {
        misses.push(format!(
            "record kinds {:?}, not {:?}",
            got.kinds, base.kinds
        ));
    }
    let effects = |o: &Outcome| {
        let mut e: Vec<String> = o
            .effects
            .iter()
            .map(|e| format!("{} {}", e["tool"], e["args"]))
            .collect();
        e.sort();
        e
    };
    if effects(got) != effects(base) {
        misses.push(format!(
            "effects {:?}, not {:?}",
            effects(got),
            effects(base)
        ));
    }
    misses
}

/// Every boundary of the runner and the controller (those containing
/// AGENTRUN_CHAOS_ONLY when it is set: one boundary, by hand).
fn boundaries() -> Vec<String> {
    let only = std::env::var("AGENTRUN_CHAOS_ONLY").unwrap_or_default();
    failpoint::all()
        .into_iter()
        .chain(failpoint::controller_all())
        .filter(|b| b.contains(&only))
        .collect()
}

#[tokio::test]
async fn every_failpoint_boundary_converges_to_the_fault_free_outcome() {
    let _one = ONE_AT_A_TIME.lock().await;
    let base = scenario("base", None).await;
    assert!(
        base.misses.is_empty(),
        "the fault-free run: {:?}",
        base.misses
    );
    assert_eq!(base.phase, Some(Phase::Succeeded));
    assert_eq!(base.result.as_deref(), Some(RESULT));
    for kind in [
        "Summary",
        "VersionChanged",
        "ApprovalDecided",
        "ApprovalVoided",
        "ToolResult",
        "Observation",
    ] {
        assert!(
            base.kinds.iter().any(|k| k == kind),
            "the scenario meets a {kind}: {:?}",
            base.kinds
        );
    }
    let tools: HashSet<String> = base
        .effects
        .iter()
        .map(|e| e["tool"].as_str().unwrap_or_default().to_string())
        .collect();
    for tool in ["issue_refund", "notify", "page_oncall"] {
        assert!(tools.contains(tool), "{tool} ran: {:?}", base.effects);
    }

    let limit = Arc::new(tokio::sync::Semaphore::new(
        env_num("AGENTRUN_CHAOS_CONCURRENCY", 4) as usize,
    ));
    let base = Arc::new(base);
    // Concurrent within this task (the cluster helpers are not Send).
    let runs = boundaries().into_iter().enumerate().map(|(i, boundary)| {
        let limit = limit.clone();
        let base = base.clone();
        async move {
            let _slot = limit.acquire().await.unwrap();
            let got = scenario(&format!("b{i}"), Some(&boundary)).await;
            let misses = judge(&base, &got);
            if misses.is_empty() {
                println!("chaos: {boundary:<42} converged");
            } else {
                println!("chaos: {boundary:<42} MISS: {}", misses.join("; "));
            }
            (boundary, misses)
        }
    });
    let results = futures::future::join_all(runs).await;
    let total = results.len();
    let missed: Vec<String> = results
        .into_iter()
        .filter(|(_, m)| !m.is_empty())
        .map(|(b, _)| b)
        .collect();
    println!("bench: chaos.boundaries {total} boundaries");
    println!("bench: chaos.converged {} boundaries", total - missed.len());
    assert!(missed.is_empty(), "boundaries that missed: {missed:?}");
}

/// The container scenario's answer (the agent's last model answer).
const CONTAINER_RESULT: &str = "Refunded 400 on A-1, declined the 5000 refund, notified, paged.";

/// The container scenario: an unmodified agent (the plain `openai` loop of
/// e2e/agents) meets an idempotent tool, a gated refund approved, one
/// rejected, a lookup-only tool and a keyless one; its model answers by
/// turn, so a question asked again is seen.
fn container_replies() -> Value {
    json!([
        {"text": "Looking the order up.",
         "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "A-1"}}]},
        {"text": "Charged twice; refunding 400.",
         "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "A-1", "amount": 400}}]},
        {"text": "Also refunding the second order.",
         "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "A-2", "amount": 5000}}]},
        {"text": "That one was declined; telling the customer.",
         "toolCalls": [{"name": "notify", "arguments": {"text": "A-1 refunded 400; A-2 declined"}}]},
        call("page_oncall", json!({"note": "refunds"})),
        {"text": CONTAINER_RESULT}
    ])
}

fn container_agent_spec(w: &World, script: &str) -> Value {
    let mut agent = common::container_agents::in_container(w.agent(script), "plain-agent");
    let approvers = json!({"users": ["alice", "bob", "carol"]});
    agent["approval"] = json!({"rules": [{
        "name": "refunds", "tool": "issue_refund", "when": "args.amount > 100",
        "approvers": approvers, "expiresAfter": "10m", "onExpiry": "Fail"
    }], "defaultApprovers": approvers});
    agent
}

/// The container scenario in a world of its own, with `fault` armed.
async fn container_scenario(id: &str, fault: Option<&str>) -> Outcome {
    let (env, annotations) = armed(fault);
    let mut w = World::with_controller_env(&format!("chaosc-{id}"), &[], &env).await;
    grant_approver_role(&w).await;
    w.standins
        .script_by_turn("chaosc", container_replies(), json!([]))
        .await;
    w.create_run(
        "chaosc",
        json!({"input": "Sort out the customer's refunds.",
               "agent": container_agent_spec(&w, "chaosc")}),
        annotations,
    )
    .await;
    outcome(&mut w, "chaosc").await
}

/// The boundaries a container agent's run meets: every one but those of
/// compaction, a voided approval and a version change, which its scenario
/// has not (a container agent has no context to compact).
fn container_boundaries() -> Vec<String> {
    boundaries()
        .into_iter()
        .filter(|b| {
            !["Summary", "ApprovalVoided", "VersionChanged"]
                .iter()
                .any(|k| b.ends_with(k))
        })
        .collect()
}

#[tokio::test]
async fn every_failpoint_boundary_converges_for_an_unmodified_container_agent_too() {
    let _one = ONE_AT_A_TIME.lock().await;
    let base = container_scenario("base", None).await;
    assert!(
        base.misses.is_empty(),
        "the fault-free run: {:?}",
        base.misses
    );
    assert_eq!(base.phase, Some(Phase::Succeeded), "{:?}", base.error);
    // The stand-in marks each answer with its turn; the agent's result is
    // its last answer.
    let result = base.result.clone().unwrap_or_default();
    assert!(result.ends_with(CONTAINER_RESULT), "{result}");
    for kind in ["ApprovalDecided", "ToolResult", "Observation"] {
        assert!(
            base.kinds.iter().any(|k| k == kind),
            "meets a {kind}: {:?}",
            base.kinds
        );
    }
    let limit = Arc::new(tokio::sync::Semaphore::new(
        env_num("AGENTRUN_CHAOS_CONCURRENCY", 4) as usize,
    ));
    let base = Arc::new(base);
    let runs = container_boundaries()
        .into_iter()
        .enumerate()
        .map(|(i, boundary)| {
            let limit = limit.clone();
            let base = base.clone();
            async move {
                let _slot = limit.acquire().await.unwrap();
                let got = container_scenario(&format!("b{i}"), Some(&boundary)).await;
                let misses = judge(&base, &got);
                if misses.is_empty() {
                    println!("chaos: container {boundary:<42} converged");
                } else {
                    println!(
                        "chaos: container {boundary:<42} MISS: {}",
                        misses.join("; ")
                    );
                }
                (boundary, misses)
            }
        });
    let results = futures::future::join_all(runs).await;
    let total = results.len();
    let missed: Vec<String> = results
        .into_iter()
        .filter(|(_, m)| !m.is_empty())
        .map(|(b, _)| b)
        .collect();
    println!("bench: chaos.container.boundaries {total} boundaries");
    println!(
        "bench: chaos.container.converged {} boundaries",
        total - missed.len()
    );
    assert!(missed.is_empty(), "boundaries that missed: {missed:?}");
}

/// A small deterministic generator (xorshift), so a seed replays the same faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Creates run `name` of the scenario, with its own script and Agent.
async fn start_random_run(w: &World, name: &str) {
    w.standins
        .script_by_turn(
            name,
            replies(&format!("{name}-")),
            json!([{"text": "Summary: order A-1 looked up."}]),
        )
        .await;
    put_orders(w, &format!("{name}-")).await;
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": name}, "spec": agent_spec(w, name)
    }))
    .unwrap();
    agents.create(&PostParams::default(), &agent).await.unwrap();
    w.create_run(
        name,
        json!({"input": "Sort out the customer's refunds.",
               "agentRef": {"name": name}, "versionPolicy": "FollowLatest"}),
        json!({}),
    )
    .await;
}

#[tokio::test]
async fn random_faults_by_seed_keep_every_invariant() {
    let _one = ONE_AT_A_TIME.lock().await;
    let seconds = env_num("AGENTRUN_CHAOS_SECONDS", 40);
    let seed = env_num("AGENTRUN_CHAOS_SEED", 1);
    let concurrent = env_num("AGENTRUN_CHAOS_RUNS", 4) as usize;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (pg, url) = PrivatePostgres::up("pg-chaos", 25435).await;
    let mut w = World::on_store("chaos-random", &["--time-slice-seconds", "3"], &url).await;
    grant_approver_role(&w).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(w.client.clone(), w.name());
    // `concurrent` runs at all times until the deadline: a run that ends is
    // followed by a new one. Faults, chosen by the seed, hit whatever runs.
    let mut active: Vec<String> = Vec::new();
    let mut started = 0usize;
    let mut decided = HashSet::new();
    let mut faults = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < deadline {
        w.revive_controller();
        let mut still = Vec::new();
        for name in active.drain(..) {
            let ended = runs
                .get(&name)
                .await
                .ok()
                .and_then(|r| r.status?.phase)
                .is_some_and(|p| p.is_terminal());
            if !ended {
                still.push(name);
            }
        }
        active = still;
        while active.len() < concurrent {
            let name = format!("r{started}");
            start_random_run(&w, &name).await;
            active.push(name);
            started += 1;
        }
        drive_once(&w, &mut decided).await;
        tokio::time::sleep(Duration::from_millis(300 + rng.below(1200))).await;
        match rng.below(12) {
            // Mostly pod deletions, sometimes the controller, rarely the store.
            0..=6 => {
                let mut running: Vec<String> = pods
                    .list(&ListParams::default())
                    .await
                    .map(|l| l.items)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .filter_map(|p| p.metadata.name)
                    .collect();
                running.sort();
                if !running.is_empty() {
                    let victim = running[rng.below(running.len() as u64) as usize].clone();
                    let force = DeleteParams {
                        grace_period_seconds: Some(0),
                        ..DeleteParams::default()
                    };
                    let _ = pods.delete(&victim, &force).await;
                    faults.push(format!("deleted pod {victim}"));
                }
            }
            7..=9 => {
                w.kill_controller();
                w.revive_controller();
                faults.push("SIGKILLed the controller".to_string());
            }
            10 if rng.below(2) == 0 && !common::existing_cluster() => {
                let script = common::root().join("e2e/cluster");
                let out = std::process::Command::new("bash")
                    .arg(&script)
                    .arg("restart-node")
                    .output()
                    .expect("running e2e/cluster restart-node");
                assert!(
                    out.status.success(),
                    "e2e/cluster restart-node: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                faults.push("restarted the process node".to_string());
            }
            10 => {
                pg.run("stop");
                tokio::time::sleep(Duration::from_secs(1 + rng.below(8))).await;
                pg.run("start");
                faults.push("restarted PostgreSQL".to_string());
            }
            _ => {}
        }
    }
    println!("chaos: seed {seed}, {} faults: {faults:?}", faults.len());
    // Then every run finishes without faults, and each must have kept every invariant.
    let mut missed = Vec::new();
    for i in 0..started {
        let name = format!("r{i}");
        let mut crashed = false;
        let run = drive(&mut w, &name, &mut crashed).await;
        let got = collect(&w, &run, &name).await;
        let mut misses = got.misses.clone();
        if got.phase != Some(Phase::Succeeded) || got.result.as_deref() != Some(RESULT) {
            misses.push(format!("ended {:?}: {:?}", got.phase, got.error));
        }
        if misses.is_empty() {
            println!("chaos: random run {name} converged");
        } else {
            println!("chaos: random run {name} MISS: {}", misses.join("; "));
            missed.push(name);
        }
    }
    println!("bench: chaos.random.faults {} faults", faults.len());
    println!("bench: chaos.random.runs {started} runs");
    println!(
        "bench: chaos.random.converged {} runs",
        started - missed.len()
    );
    assert!(
        missed.is_empty(),
        "seed {seed}: runs that missed: {missed:?}"
    );
}

/// One pass of the humans over every pending Approval of the world: the
/// first refund (500) is edited to 300 by alice and bob, after the run's
/// Agent (named like the run) moved on to a new prompt; the second (5000)
/// is rejected by carol; a reconcile question is answered by alice.
async fn drive_once(w: &World, decided: &mut HashSet<String>) {
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let pending = approvals
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for a in pending {
        let name = a.metadata.name.clone().unwrap_or_default();
        let waiting = a
            .status
            .as_ref()
            .and_then(|s| s.state)
            .is_none_or(|s| s == agentrun::api::ApprovalState::Pending);
        if !waiting || decided.contains(&name) {
            continue;
        }
        let hash = a.spec.arguments_hash.clone();
        let amount = a.spec.arguments.get("amount").and_then(Value::as_u64);
        let votes: Vec<(&str, Value)> = if a.spec.kind == ApprovalKind::Reconcile {
            vec![("alice", entry("alice", "Approve", &hash, "it did happen"))]
        } else if amount == Some(500) {
            // The order changes once while the approvers look at its first
            // request: that decision is void, and the request asked again.
            let order = a.spec.arguments["orderId"].as_str().unwrap_or_default();
            if decided.insert(format!("changed {order}")) {
                put_order(
                    w,
                    order,
                    json!({"charged": 2, "note": "the customer called"}),
                )
                .await;
            }
            let patch = json!({"spec": {"prompt": {"version": "v2",
                "system": "You are a careful refund agent (v2)."}}});
            agents
                .patch(
                    &a.spec.run_ref.name,
                    &PatchParams::default(),
                    &Patch::Merge(patch),
                )
                .await
                .expect("editing the run's Agent");
            let mut edited = a.spec.arguments.clone();
            edited["amount"] = json!(300);
            ["alice", "bob"]
                .into_iter()
                .map(|who| {
                    let mut e = entry(who, "Edit", &hash, "partial refund");
                    e["arguments"] = edited.clone();
                    (who, e)
                })
                .collect()
        } else if amount == Some(5000) {
            vec![("carol", entry("carol", "Reject", &hash, "too large"))]
        } else {
            vec![("alice", entry("alice", "Approve", &hash, "fine"))]
        };
        for (who, vote) in votes {
            // A refused vote (already there) is fine: the decision stands.
            let _ = decide(w, who, &name, vote).await;
        }
        decided.insert(name);
    }
}
