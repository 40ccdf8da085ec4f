//! The promises a built-in agent's run keeps, kept for a container agent
//! too (issue 41), on the process node with the unmodified plain agent of
//! `e2e/agents/`: budgets summed from the log across a crash (asking, or
//! ending the run), cancel and the deadline stopping the agent, a frozen
//! pod that wakes after a takeover getting no answer and making no call, a
//! non-zero exit counted by the retry policy and quoted, and bad input from
//! the agent answered in its SDK's format while the run goes on. What is
//! checked is state: the log, the stand-ins' counters, the run's status.

mod common;

use std::time::Duration;

use agentrun::api::{AgentRun, ApprovalKind, Phase};
use agentrun::replay::Entry;
use agentrun::store::Record;
use common::approvals::{
    decide, entry, gated_agent, grant_approver_role, live_step_pods, pending_approval,
};
use common::container_agents::{answer, in_container, refund_call};
use common::world::{TIMEOUT, World, call, kinds};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

/// `n` order lookups, each its own reply of `tokens` (in, out), then the answer.
fn lookups(n: usize, tokens: (u64, u64)) -> Value {
    let mut replies: Vec<Value> = (0..n)
        .map(|i| {
            let mut r = call("lookup_order", json!({"orderId": format!("{}", 1040 + i)}));
            r["inputTokens"] = json!(tokens.0);
            r["outputTokens"] = json!(tokens.1);
            r
        })
        .collect();
    replies.push(answer("Looked every order up."));
    Value::Array(replies)
}

/// Slow lookups (the model answers each after `delay_ms`): an agent mid-run.
fn slow_lookups(n: usize, delay_ms: u64) -> Value {
    let replies: Vec<Value> = (0..n)
        .map(|i| {
            let mut r = call("lookup_order", json!({"orderId": format!("{i}")}));
            r["text"] = json!(format!("progress {i}"));
            r["delayMs"] = json!(delay_ms);
            r
        })
        .collect();
    Value::Array(replies)
}

async fn tool_requests(w: &World, tool: &str) -> usize {
    w.standins
        .tool_requests(w.name())
        .await
        .iter()
        .filter(|r| r["tool"] == tool)
        .count()
}

fn count(log: &[(Record, Entry)], kind: &str) -> usize {
    kinds(log).iter().filter(|k| **k == kind).count()
}

/// The run's step pods (ended ones too).
async fn step_pods(w: &World, run: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(w.client.clone(), w.name());
    pods.list(&ListParams::default().labels(&format!("agentrun.dev/run={run}")))
        .await
        .unwrap()
        .items
}

/// The process (group leader) the process node runs `container` of `pod` as.
fn container_pid(pod: &Pod, container: &str) -> Option<i32> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    let status = statuses.iter().find(|c| c.name == container)?;
    status.state.as_ref()?.running.as_ref()?;
    status
        .container_id
        .as_deref()?
        .strip_prefix("process://")?
        .parse()
        .ok()
}

/// The state letter of `pid` in `/proc/PID/stat` (`T` stopped), if it lives.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// Signals the whole process group `pid` leads (a container's processes).
fn signal_group(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) of a process group the process node started for a pod.
    assert_eq!(
        unsafe { libc::kill(-pid, signal) },
        0,
        "signal {signal} to group {pid}"
    );
}

async fn cancel(w: &World, run: &str) {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.patch(
        run,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .expect("cancelling");
}

/// Waits until run `run` has recorded at least `len` records.
async fn wait_log_length(w: &World, run: &str, len: u64) {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        &format!("{run} to record {len} records"),
        TIMEOUT,
        || async {
            let r = runs.get(run).await.ok()?;
            (r.status?.log?.length >= len).then_some(())
        },
    )
    .await;
}

/// The tool calls run `run` made (the tools see its uid on each).
async fn calls_of(w: &World, run: &str) -> usize {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let uid = runs.get(run).await.unwrap().metadata.uid.unwrap();
    w.standins
        .tool_requests(w.name())
        .await
        .iter()
        .filter(|r| r["run"] == uid.as_str())
        .count()
}

/// Waits until none of the run's step pods runs, then checks for a while
/// that the model and the tools hear nothing more of it.
async fn stopped_for_good(w: &World, run: &str) {
    common::wait_for(&format!("{run}'s step pods to end"), TIMEOUT, || async {
        (live_step_pods(w, run).await == 0).then_some(())
    })
    .await;
    let asked = w.standins.model_requests(run).await.len();
    let called = calls_of(w, run).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        w.standins.model_requests(run).await.len(),
        asked,
        "{run}: the model is asked nothing once the run ended"
    );
    assert_eq!(
        calls_of(w, run).await,
        called,
        "{run}: no tool is called once the run ended"
    );
}

/// A token budget that asks and a cost budget that fails, each with the
/// first step pod killed right after the first model answer: what the
/// killed pod spent counts (summed from the log), the question is raised
/// when the cap is reached (the model not asked beyond it), a raise lets
/// the run go on, and the cost budget ends the run `BudgetExceeded`.
#[tokio::test]
async fn budgets_count_across_a_kill_then_ask_or_end_the_run() {
    let w = World::new("cbudget", &[]).await;
    grant_approver_role(&w).await;
    let kill = json!({"agentrun.dev/failpoint": "after-append:ModelCall"});
    // 150 tokens and $0.0003 per answer (prices: $1 in, $4 out per million).
    w.standins
        .script("tokens", lookups(4, (100, 50)), json!([]))
        .await;
    w.standins
        .script("cost", lookups(4, (100, 50)), json!([]))
        .await;
    let mut tokens = in_container(w.agent("tokens"), "plain-agent");
    tokens["budgets"] = json!({
        "maxTokens": 400, "onExhausted": "Ask",
        "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"
    });
    let mut cost = in_container(w.agent("cost"), "plain-agent");
    cost["budgets"] = json!({"maxCostUSD": 0.0005});
    for (name, agent) in [("tokens", tokens), ("cost", cost)] {
        w.create_run(
            name,
            json!({"input": "Look the orders up.", "agent": agent}),
            kill.clone(),
        )
        .await;
    }

    // Three answers (450 tokens): the fourth request meets the cap. Had the
    // killed pod's answer not counted, the model would have been asked again.
    let approval = pending_approval(&w, "tokens").await;
    assert_eq!(approval.spec.kind, ApprovalKind::Budget);
    let reason = approval
        .spec
        .observations
        .reason
        .clone()
        .unwrap_or_default();
    assert!(
        reason.contains("token budget used up: 450 of 400 tokens"),
        "{reason}"
    );
    assert_eq!(approval.spec.arguments, json!({"maxTokens": 800}));
    common::wait_for("the tokens run's pod to exit", TIMEOUT, || async {
        (live_step_pods(&w, "tokens").await == 0).then_some(())
    })
    .await;
    assert_eq!(
        w.standins.model_requests("tokens").await.len(),
        3,
        "the model is not asked beyond the budget"
    );

    let run = w.wait_phase("cost", Phase::BudgetExceeded).await;
    let status = run.status.clone().unwrap();
    let error = status.error.unwrap_or_default();
    assert!(error.contains("cost budget used up"), "{error}");
    assert_eq!(
        w.standins.model_requests("cost").await.len(),
        2,
        "$0.0006 spent over two pods: the third answer is never asked"
    );
    let log = w.log(&run).await;
    let pods: std::collections::HashSet<&str> =
        log.iter().map(|(r, _)| r.worker.pod.as_str()).collect();
    assert!(pods.len() >= 2, "a second pod went on: {:?}", kinds(&log));
    stopped_for_good(&w, "cost").await;

    // Approved as proposed: the run goes on within the raised cap.
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    decide(
        &w,
        "alice",
        &name,
        entry("alice", "Approve", &hash, "worth it"),
    )
    .await
    .expect("alice raises the budget");
    let run = w.wait_phase("tokens", Phase::Succeeded).await;
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("Looked every order up.")
    );
    assert_eq!(w.standins.model_requests("tokens").await.len(), 5);
    assert_eq!(tool_requests(&w, "lookup_order").await, 4 + 2);
}

/// Cancel while the agent is mid-run and while it waits for an approval,
/// and a deadline reached while it runs: each run ends as a built-in
/// agent's does, no step pod is left (the agent's processes are gone), and
/// nothing more reaches the model or the tools.
#[tokio::test]
async fn cancel_and_the_deadline_stop_the_agent_and_nothing_more_is_called() {
    let w = World::new("cstop", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script("cancel", slow_lookups(20, 1500), json!([]))
        .await;
    w.standins
        .script("deadline", slow_lookups(20, 1500), json!([]))
        .await;
    w.standins
        .script(
            "waiting",
            json!([refund_call(500), answer("Done.")]),
            json!([]),
        )
        .await;
    let agent = |script: &str| in_container(w.agent(script), "plain-agent");
    w.create_run(
        "cancel",
        json!({"input": "Look orders up.", "agent": agent("cancel")}),
        json!({}),
    )
    .await;
    w.create_run(
        "deadline",
        json!({"input": "Look orders up.", "agent": agent("deadline"), "deadline": "20s"}),
        json!({}),
    )
    .await;
    let gated = in_container(gated_agent(&w, "waiting", json!({})), "plain-agent");
    w.create_run(
        "waiting",
        json!({"input": "Refund order 1042.", "agent": gated}),
        json!({}),
    )
    .await;

    // Mid-run: a model answer and a lookup recorded, the agent at work.
    wait_log_length(&w, "cancel", 4).await;
    let pids: Vec<i32> = step_pods(&w, "cancel")
        .await
        .iter()
        .flat_map(|p| [container_pid(p, "step"), container_pid(p, "agent")])
        .flatten()
        .collect();
    assert_eq!(pids.len(), 2, "the runner and the agent run");
    cancel(&w, "cancel").await;
    let run = w.wait_phase("cancel", Phase::Cancelled).await;
    assert!(
        run.status
            .unwrap()
            .result
            .unwrap_or_default()
            .starts_with("progress"),
        "the partial result is the agent's latest words"
    );
    stopped_for_good(&w, "cancel").await;
    for pid in pids {
        assert_eq!(proc_state(pid), None, "process {pid} of the pod is gone");
    }

    // While it waits for approval it holds no pod; cancelled, it stays so.
    pending_approval(&w, "waiting").await;
    common::wait_for("the waiting run's pod to exit", TIMEOUT, || async {
        (live_step_pods(&w, "waiting").await == 0).then_some(())
    })
    .await;
    cancel(&w, "waiting").await;
    w.wait_phase("waiting", Phase::Cancelled).await;
    stopped_for_good(&w, "waiting").await;
    assert_eq!(w.standins.model_requests("waiting").await.len(), 1);
    assert_eq!(
        tool_requests(&w, "issue_refund").await,
        0,
        "nothing refunded"
    );

    let run = w.wait_phase("deadline", Phase::DeadlineExceeded).await;
    let error = run.status.clone().unwrap().error.unwrap_or_default();
    assert!(error.contains("20s"), "{error}");
    let log = w.log(&run).await;
    assert_eq!(kinds(&log).last(), Some(&"RunFinished"));
    assert!(count(&log, "ModelCall") >= 2, "it ran: {:?}", kinds(&log));
    stopped_for_good(&w, "deadline").await;
    assert!(
        w.standins.model_requests("deadline").await.len() < 20,
        "the deadline cut the agent short"
    );
}

/// The step pod freezes right after recording a refund's intent (its
/// runner at a failpoint, its agent stopped by SIGSTOP) and is cut off
/// from its Job, as a partitioned node's pod is: the lease passes to a new
/// pod, which makes the refund and ends the run. Woken, the old pod
/// records nothing and its refund never reaches the tool.
#[tokio::test]
async fn a_frozen_pod_that_wakes_after_a_takeover_gets_no_answer_and_makes_no_call() {
    let w = World::new("cfrozen", &[]).await;
    w.standins
        .script(
            "frozen",
            json!([refund_call(40), answer("Refunded 40.")]),
            json!([]),
        )
        .await;
    w.create_run(
        "frozen",
        json!({"input": "Refund order 1042.", "agent": in_container(w.agent("frozen"), "plain-agent")}),
        json!({"agentrun.dev/failpoint": "hang:after-append:ToolIntent"}),
    )
    .await;
    let (pod, step, agent) = common::wait_for("the runner to freeze", TIMEOUT, || async {
        let pods = step_pods(&w, "frozen").await;
        let pod = pods.first().ok_or("no pod yet")?;
        let step = container_pid(pod, "step").ok_or("no runner yet")?;
        let agent = container_pid(pod, "agent").ok_or("no agent yet")?;
        match proc_state(step) {
            Some('T') => Ok((pod.metadata.name.clone().unwrap(), step, agent)),
            state => Err(format!("runner {step} in state {state:?}")),
        }
    })
    .await;
    signal_group(agent, libc::SIGSTOP);
    // Cut off from its Job (no owner, no Job labels, no Job finalizer): its
    // deletion never reaches it, so it wakes as a partitioned pod would.
    let pods: Api<Pod> = Api::namespaced(w.client.clone(), w.name());
    pods.patch(
        &pod,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {
            "ownerReferences": null, "finalizers": null,
            "labels": {"batch.kubernetes.io/controller-uid": null, "controller-uid": null,
                       "batch.kubernetes.io/job-name": null, "job-name": null}
        }})),
    )
    .await
    .expect("detaching the frozen pod");

    let run = w.wait_phase("frozen", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let intent = log
        .iter()
        .position(|(_, e)| matches!(e, Entry::ToolIntent(_)))
        .expect("the refund's intent");
    assert_eq!(
        log[intent].0.worker.pod, pod,
        "the frozen pod recorded the intent"
    );
    assert!(
        log[intent + 1..].iter().all(|(r, _)| r.worker.pod != pod),
        "another pod took over after the intent"
    );
    assert_eq!(tool_requests(&w, "issue_refund").await, 1);

    signal_group(step, libc::SIGCONT);
    signal_group(agent, libc::SIGCONT);
    common::wait_for("the woken pod to end", TIMEOUT, || async {
        let state = (proc_state(step), proc_state(agent));
        matches!(state, (None | Some('Z'), None | Some('Z')))
            .then_some(())
            .ok_or(format!("{state:?}"))
    })
    .await;
    // Its runner woke, found its lease taken, and stopped (not killed).
    let code = common::wait_for("the woken runner's exit code", TIMEOUT, || async {
        let pod = pods.get(&pod).await.ok()?;
        let statuses = pod.status?.container_statuses?;
        let step = statuses.into_iter().find(|c| c.name == "step")?;
        Some(step.state?.terminated?.exit_code)
    })
    .await;
    assert_eq!(code, agentrun::step::runner::LEASE_LOST_EXIT_CODE);
    let store = w.store().await;
    let uid = run.metadata.uid.clone().unwrap();
    let after = store.read_all(&uid).await.unwrap();
    assert_eq!(after.len(), log.len(), "the woken pod recorded nothing");
    assert_eq!(
        tool_requests(&w, "issue_refund").await,
        1,
        "the woken pod's refund never reached the tool"
    );
    assert_eq!(w.standins.effects(w.name()).await.len(), 1, "refunded once");
    assert_eq!(w.standins.model_requests("frozen").await.len(), 2);
}

/// An agent that exits 3 after its first answer: each exit is a crash; the
/// first attempt made progress (its answer is recorded), the next ones
/// replay it and record nothing, and once the retry policy's attempts
/// are used the run fails quoting what the agent said on stderr.
#[tokio::test]
async fn a_non_zero_exit_is_a_crash_counted_by_the_retry_policy_and_quoted() {
    let w = World::new("cexit", &[]).await;
    w.standins
        .script(
            "exit",
            json!([answer("The order service is down.")]),
            json!([]),
        )
        .await;
    let mut agent = in_container(w.agent("exit"), "failing-agent");
    agent["retry"] = json!({"maxAttemptsWithoutProgress": 2, "backoffSeconds": 0});
    w.create_run(
        "exit",
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("exit", Phase::Failed).await;
    let status = run.status.clone().unwrap();
    let error = status.error.unwrap_or_default();
    assert!(
        error.contains("failed 2 times in a row without recording anything"),
        "{error}"
    );
    assert!(
        error.contains("the agent said: failing-agent: cannot go on: The order service is down."),
        "the run's error quotes the agent: {error}"
    );
    assert_eq!(
        w.standins.model_requests("exit").await.len(),
        1,
        "the recorded answer is replayed to each attempt"
    );
    let log = w.log(&run).await;
    assert_eq!(count(&log, "ModelCall"), 1, "{:?}", kinds(&log));
    assert_eq!(live_step_pods(&w, "exit").await, 0);
}

/// An agent that sends an oversized request, a call to a tool no server
/// has, and a call whose arguments fail the tool's schema: each gets a
/// clear error as its SDK shows it, which reaches its model, and the run
/// goes on to success. Only the schema failure changes the run: its
/// intent and failed result are recorded, nothing reaches the tool.
#[tokio::test]
async fn bad_input_from_the_agent_gets_a_clear_error_and_the_run_goes_on() {
    let w = World::new("cbad", &[]).await;
    w.standins
        .script(
            "bad",
            json!([
                call("no_such_tool", json!({"orderId": "1042"})),
                call("lookup_order", json!({"orderId": 1042})),
                answer("I could not look order 1042 up.")
            ]),
            json!([]),
        )
        .await;
    w.create_run(
        "bad",
        json!({"input": "Look order 1042 up.", "agent": in_container(w.agent("bad"), "blind-agent")}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("bad", Phase::Succeeded).await;
    assert_eq!(
        run.status.clone().unwrap().result.as_deref(),
        Some("I could not look order 1042 up.")
    );
    let requests: Vec<String> = w
        .standins
        .model_requests("bad")
        .await
        .iter()
        .map(Value::to_string)
        .collect();
    assert_eq!(
        requests.len(),
        3,
        "the oversized request never reached the model"
    );
    assert!(
        requests[0].contains("an oversized request got 413")
            && requests[0].contains("larger than the runner reads"),
        "the agent was told why its request was refused: {}",
        requests[0]
    );
    assert!(
        requests[1].contains(r#"unknown tool \"no_such_tool\""#),
        "the model sees the unknown tool's error: {}",
        requests[1]
    );
    assert!(
        requests[2].contains("lookup_order: arguments invalid: orderId: 1042 is not of type"),
        "the model sees the schema's complaint: {}",
        requests[2]
    );
    let log = w.log(&run).await;
    assert_eq!(count(&log, "ModelCall"), 3, "{:?}", kinds(&log));
    let intents: Vec<&str> = log
        .iter()
        .filter_map(|(_, e)| match e {
            Entry::ToolIntent(i) => Some(i.tool.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        intents,
        ["lookup_order"],
        "the unknown tool is not recorded"
    );
    let failed = log.iter().any(|(_, e)| {
        matches!(e, Entry::ToolResult(r)
            if matches!(r.outcome, agentrun::runlog::v1::ToolOutcome::Failed { .. }))
    });
    assert!(failed, "the schema failure is the call's recorded result");
    assert!(
        w.standins.tool_requests(w.name()).await.is_empty(),
        "nothing reached the tools"
    );
}
