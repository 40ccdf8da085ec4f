//! Durable execution end to end on a real cluster: the controller drives runs
//! with step Jobs (run by the process node as local processes), the runner
//! talks to the stand-in model and tools, and every step lands in the
//! PostgreSQL step log before the run moves on.

mod common;

use agentrun::api::{AgentRun, Phase};
use agentrun::replay::Entry;
use common::world::{TIMEOUT, World, call, finish, kinds};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use std::time::Duration;

#[tokio::test]
async fn a_twenty_step_run_succeeds_with_every_step_in_the_log() {
    let w = World::new("twenty", &[]).await;
    let mut replies = Vec::new();
    for i in 0..19 {
        replies.push(match i % 3 {
            0 => call("lookup_order", json!({"orderId": format!("o-{i}")})),
            1 => call(
                "issue_refund",
                json!({"orderId": format!("o-{i}"), "amount": i}),
            ),
            _ if i % 2 == 0 => call(
                "create_ticket",
                json!({"title": format!("ticket {i}"), "priority": "low"}),
            ),
            _ => call("notify", json!({"text": format!("update {i}")})),
        });
    }
    replies.push(finish("19 tool steps done"));
    w.standins
        .script("twenty", Value::Array(replies), json!([]))
        .await;
    w.create_run(
        "twenty",
        json!({"input": "Handle the refund queue.", "agent": w.agent("twenty")}),
        json!({}),
    )
    .await;

    let run = w.wait_phase("twenty", Phase::Succeeded).await;
    let status = run.status.clone().unwrap();
    assert_eq!(status.result.as_deref(), Some("19 tool steps done"));
    let log = w.log(&run).await;
    let mut expected = vec!["RunStarted"];
    for _ in 0..19 {
        expected.extend(["ModelCall", "ToolIntent", "ToolResult"]);
    }
    expected.extend(["ModelCall", "RunFinished"]);
    assert_eq!(kinds(&log), expected);
    assert_eq!(status.usage.as_ref().unwrap().steps, 60);
    assert!(status.usage.as_ref().unwrap().cost_usd > 0.0);
    assert_eq!(
        w.standins.model_requests("twenty").await.len(),
        20,
        "one model call per recorded ModelCall"
    );
    let http_effects = w.standins.effects(w.name()).await.len();
    let mcp: Value = w.standins.get(&format!("/mcp-effects/{}", w.name())).await;
    let tickets = mcp["tickets"].as_array().map_or(0, Vec::len);
    assert!(tickets > 0, "the MCP tool was called: {mcp}");
    assert_eq!(http_effects + tickets, 19, "one side effect per tool call");
    // The MCP tool's schema, as discovered, is pinned in RunStarted.
    match &log[0].1 {
        Entry::RunStarted(s) => assert!(
            s.mcp.0.contains_key("create_ticket")
                && s.tools.iter().any(|t| t.name == "create_ticket")
        ),
        other => panic!("seq 0 is {other:?}"),
    }
    let table = common::kubectl(&["get", "ar", "twenty", "-n", w.name()]);
    assert!(
        table.contains("Succeeded") && table.contains(" 60 "),
        "{table}"
    );
}

#[tokio::test]
async fn a_step_killed_after_recording_the_model_call_resumes_without_asking_again() {
    let w = World::new("killmodel", &[]).await;
    let replies = json!([
        call("lookup_order", json!({"orderId": "1042"})),
        call("issue_refund", json!({"orderId": "1042", "amount": 40})),
        finish("refunded 40")
    ]);
    w.standins.script("km", replies, json!([])).await;
    let fp = json!({"agentrun.dev/failpoint": "after-append:ModelCall"});
    w.create_run(
        "km",
        json!({"input": "Refund order 1042.", "agent": w.agent("km")}),
        fp,
    )
    .await;

    let run = w.wait_phase("km", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let model_calls = log
        .iter()
        .filter(|(_, s)| matches!(s, Entry::ModelCall(_)))
        .count();
    assert_eq!(model_calls, 3);
    assert_eq!(
        w.standins.model_requests("km").await.len(),
        3,
        "a recorded model answer is never asked for again"
    );
    let pods: std::collections::HashSet<&str> =
        log.iter().map(|(r, _)| r.worker.pod.as_str()).collect();
    assert!(
        pods.len() >= 2,
        "a second step pod wrote part of the log: {pods:?}"
    );
    assert_eq!(w.standins.effects(w.name()).await.len(), 2);
}

#[tokio::test]
async fn a_step_killed_after_the_tool_call_repeats_it_safely_exactly_once() {
    let w = World::new("killtool", &[]).await;
    // Idempotent tool: called again with the same key, the server does it once.
    w.standins
        .script(
            "idem",
            json!([
                call("issue_refund", json!({"orderId": "7", "amount": 70})),
                finish("ok")
            ]),
            json!([]),
        )
        .await;
    // Not idempotent: the runner asks the lookup instead of calling again.
    w.standins
        .script(
            "nokey",
            json!([call("notify", json!({"text": "refund sent"})), finish("ok")]),
            json!([]),
        )
        .await;
    let fp = json!({"agentrun.dev/failpoint": "after-tool-call"});
    w.create_run(
        "idem",
        json!({"input": "Refund order 7.", "agent": w.agent("idem")}),
        fp.clone(),
    )
    .await;
    w.create_run(
        "nokey",
        json!({"input": "Tell the customer.", "agent": w.agent("nokey")}),
        fp,
    )
    .await;

    // Neither idempotent nor readable back: a human must say whether it happened.
    let page = json!([
        call("page_oncall", json!({"why": "refund stuck"})),
        finish("ok")
    ]);
    w.standins.script("blind", page, json!([])).await;
    let fp = json!({"agentrun.dev/failpoint": "after-tool-call"});
    w.create_run(
        "blind",
        json!({"input": "Page.", "agent": w.agent("blind")}),
        fp,
    )
    .await;

    let idem = w.wait_phase("idem", Phase::Succeeded).await;
    let nokey = w.wait_phase("nokey", Phase::Succeeded).await;

    let effects = w.standins.effects(w.name()).await;
    let of = |tool: &str| effects.iter().filter(|e| e["tool"] == tool).count();
    assert_eq!(
        (of("issue_refund"), of("notify")),
        (1, 1),
        "each side effect happened exactly once: {effects:?}"
    );

    let requests = w.standins.tool_requests(w.name()).await;
    let refund_keys: Vec<_> = requests
        .iter()
        .filter(|r| r["tool"] == "issue_refund")
        .map(|r| r["key"].clone())
        .collect();
    assert_eq!(
        refund_keys.len(),
        2,
        "the refund was sent twice (before and after the crash): {requests:?}"
    );
    assert_eq!(
        refund_keys[0], refund_keys[1],
        "with the same idempotency key"
    );

    let recovery = |log: &[(agentrun::store::Record, Entry)]| {
        log.iter().find_map(|(_, s)| match s {
            Entry::ToolResult(r) => r.recovery,
            _ => None,
        })
    };
    use agentrun::runlog::records::Recovery;
    assert_eq!(
        recovery(&w.log(&idem).await),
        Some(Recovery::RetriedWithSameKey)
    );
    assert_eq!(
        recovery(&w.log(&nokey).await),
        Some(Recovery::LookupFoundResult)
    );
    assert_eq!(w.standins.model_requests("idem").await.len(), 2);

    let blind = w.wait_phase("blind", Phase::Failed).await;
    let error = blind.status.clone().unwrap().error.unwrap_or_default();
    assert!(
        error.contains("page_oncall") && error.contains("a human must reconcile"),
        "{error}"
    );
    let effects = w.standins.effects(w.name()).await;
    let pages = effects
        .iter()
        .filter(|e| e["tool"] == "page_oncall")
        .count();
    assert_eq!(
        pages, 1,
        "the call whose outcome is unknown was not repeated"
    );
    match &w.log(&blind).await.last().unwrap().1 {
        Entry::RunFinished(f) => {
            assert_eq!(f.outcome, agentrun::runlog::records::Outcome::NeedsHuman)
        }
        other => panic!("last record is {other:?}"),
    }
}

#[tokio::test]
async fn budgets_deadlines_and_cancel_end_runs_with_their_partial_result() {
    let w = World::new("limits", &[]).await;
    let busy = |n: usize, delay: u64| {
        Value::Array(
            (0..n)
                .map(|i| {
                    json!({"text": format!("progress {i}"), "delayMs": delay,
                           "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("{i}")}}]})
                })
                .collect(),
        )
    };
    w.standins.script("budget", busy(20, 0), json!([])).await;
    w.standins
        .script("deadline", busy(20, 1500), json!([]))
        .await;
    w.standins.script("cancel", busy(20, 1500), json!([])).await;

    let mut budget_agent = w.agent("budget");
    budget_agent["budgets"] = json!({"maxSteps": 7});
    w.create_run(
        "budget",
        json!({"input": "Loop.", "agent": budget_agent}),
        json!({}),
    )
    .await;
    w.create_run(
        "deadline",
        json!({"input": "Loop.", "agent": w.agent("deadline"), "deadline": "5s"}),
        json!({}),
    )
    .await;
    w.create_run(
        "cancel",
        json!({"input": "Loop.", "agent": w.agent("cancel")}),
        json!({}),
    )
    .await;

    let run = w.wait_phase("budget", Phase::BudgetExceeded).await;
    let s = run.status.unwrap();
    assert_eq!(
        s.result.as_deref(),
        Some("progress 1"),
        "the partial result is the agent's latest words"
    );
    assert!(s.error.unwrap().contains("step budget"));
    assert_eq!(
        w.standins.model_requests("budget").await.len(),
        2,
        "no model call past the budget"
    );

    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for("the cancel run to record a model call", TIMEOUT, || async {
        let r = runs.get("cancel").await.ok()?;
        (r.status?.log?.length >= 2).then_some(())
    })
    .await;
    runs.patch(
        "cancel",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .expect("cancelling");
    let cancelled = w.wait_phase("cancel", Phase::Cancelled).await;
    assert!(
        cancelled
            .status
            .unwrap()
            .result
            .unwrap_or_default()
            .starts_with("progress")
    );

    let run = w.wait_phase("deadline", Phase::DeadlineExceeded).await;
    let s = run.status.unwrap();
    assert!(s.error.unwrap().contains("5s"));
    let log = w.log(&runs.get("deadline").await.unwrap()).await;
    assert_eq!(kinds(&log).last(), Some(&"RunFinished"));
}

/// FollowLatest moves at the next step boundary, not the next Job: with
/// the default 60 s time slice one Job would take every step, and the
/// controller asks its worker to yield when the Agent changes.
#[tokio::test]
async fn editing_the_agent_mid_run_moves_only_follow_latest_runs() {
    let w = World::new("versions", &[]).await;
    let slow_then_done = |id: &str| {
        json!([
            {"delayMs": 4000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": id}}]},
            call("lookup_order", json!({"orderId": "again"})),
            finish("done")
        ])
    };
    w.standins
        .script("pinned", slow_then_done("p"), json!([]))
        .await;
    w.standins
        .script("follow", slow_then_done("f"), json!([]))
        .await;
    let agents: Api<agentrun::api::Agent> = Api::namespaced(w.client.clone(), w.name());
    for id in ["pinned", "follow"] {
        let agent: agentrun::api::Agent = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
            "metadata": {"name": id}, "spec": w.agent(id)
        }))
        .unwrap();
        agents.create(&PostParams::default(), &agent).await.unwrap();
    }
    w.create_run(
        "pinned",
        json!({"input": "x", "agentRef": {"name": "pinned"}}),
        json!({}),
    )
    .await;
    w.create_run(
        "follow",
        json!({"input": "x", "agentRef": {"name": "follow"}, "versionPolicy": "FollowLatest"}),
        json!({}),
    )
    .await;
    // While the first model call is in flight, the prompt changes.
    for id in ["pinned", "follow"] {
        // The first model call is in flight (the stand-in answers it after 4 s).
        common::wait_for("the first model call", TIMEOUT, || async {
            (!w.standins.model_requests(id).await.is_empty()).then_some(())
        })
        .await;
        let patch = json!({"spec": {"prompt": {"version": "v2", "system": "NEW PROMPT v2"}}});
        agents
            .patch(id, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }
    let pinned = w.wait_phase("pinned", Phase::Succeeded).await;
    let follow = w.wait_phase("follow", Phase::Succeeded).await;

    let system = |r: &Value| {
        r["messages"][0]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let pinned_systems: Vec<_> = w
        .standins
        .model_requests("pinned")
        .await
        .iter()
        .map(system)
        .collect();
    assert!(
        pinned_systems
            .iter()
            .all(|s| s.contains("careful refund agent")),
        "{pinned_systems:?}"
    );
    assert!(!kinds(&w.log(&pinned).await).contains(&"VersionChanged"));
    assert_eq!(pinned.status.unwrap().pinned.unwrap().prompt_version, "v1");

    let follow_log = w.log(&follow).await;
    assert!(
        kinds(&follow_log).contains(&"VersionChanged"),
        "{:?}\n{}",
        kinds(&follow_log),
        w.controller_log()
    );
    let follow_systems: Vec<_> = w
        .standins
        .model_requests("follow")
        .await
        .iter()
        .map(system)
        .collect();
    assert!(
        follow_systems
            .first()
            .unwrap()
            .contains("careful refund agent")
    );
    assert!(
        follow_systems[1..]
            .iter()
            .all(|s| s.contains("NEW PROMPT v2")),
        "every model call after the change asked with the new prompt: {follow_systems:?}"
    );
    let moved = follow_log
        .iter()
        .position(|(r, _)| r.kind.as_str() == "VersionChanged")
        .unwrap();
    assert!(
        follow_log[..moved]
            .iter()
            .filter(|(r, _)| r.kind.as_str() == "ModelCall")
            .count()
            == 1,
        "the run moved right after the step in flight: {:?}",
        kinds(&follow_log)
    );
    assert_eq!(follow.status.unwrap().pinned.unwrap().prompt_version, "v2");
}

#[tokio::test]
async fn a_small_context_budget_compacts_into_a_summary() {
    let w = World::new("compact", &[]).await;
    let pad = "x".repeat(600);
    let mut replies = vec![json!({"text": format!("FIRST-MARKER {pad}"),
                                  "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "first"}}]})];
    for i in 0..6 {
        replies.push(json!({"text": format!("step {i} {pad}"),
                            "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("{i}")}}]}));
    }
    replies.push(finish("compacted and done"));
    let summaries: Vec<Value> = (0..5)
        .map(|i| json!({"text": format!("SUMMARY-{i}: orders looked up so far")}))
        .collect();
    w.standins
        .script("compact", Value::Array(replies), Value::Array(summaries))
        .await;
    let mut agent = w.agent("compact");
    agent["context"] = json!({"maxTokens": 900, "recentSteps": 3});
    w.create_run(
        "compact",
        json!({"input": "Look orders up.", "agent": agent}),
        json!({}),
    )
    .await;

    let run = w.wait_phase("compact", Phase::Succeeded).await;
    let log = w.log(&run).await;
    assert!(kinds(&log).contains(&"Summary"), "{:?}", kinds(&log));
    let requests = w.standins.model_requests("compact").await;
    let toolless = |r: &Value| {
        r.get("tools")
            .and_then(Value::as_array)
            .is_none_or(|t| t.is_empty())
    };
    let summarizing: Vec<_> = requests.iter().filter(|r| toolless(r)).collect();
    assert!(
        !summarizing.is_empty(),
        "compaction asks the model without tools"
    );
    // After the first summary, step requests carry the summary, not the early steps.
    let first_summary = requests.iter().position(toolless).unwrap();
    let later = requests[first_summary + 1..]
        .iter()
        .rfind(|r| !toolless(r))
        .unwrap();
    let body = later.to_string();
    assert!(
        body.contains("SUMMARY-"),
        "a later request carries the summary"
    );
    assert!(
        !body.contains("FIRST-MARKER"),
        "a later request no longer carries the first step"
    );
    // The full log keeps everything.
    assert!(
        log.iter()
            .any(|(r, _)| r.payload.to_string().contains("FIRST-MARKER"))
    );
}

#[tokio::test]
async fn a_lost_worker_is_noticed_by_its_lease_and_replaced() {
    let w = World::new("lost", &[]).await;
    let replies = json!([
        call("lookup_order", json!({"orderId": "9"})),
        call("issue_refund", json!({"orderId": "9", "amount": 9})),
        finish("refunded 9")
    ]);
    w.standins.script("lost", replies, json!([])).await;
    // The worker freezes (alive, holding its Job, renewing nothing) after recording its first model call.
    let fp = json!({"agentrun.dev/failpoint": "hang:after-append:ModelCall"});
    w.create_run(
        "lost",
        json!({"input": "Refund order 9.", "agent": w.agent("lost")}),
        fp,
    )
    .await;

    let run = w.wait_phase("lost", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let (first, _) = &log[1];
    let (next, _) = &log[2];
    assert_eq!(
        (first.kind.as_str(), first.worker.attempt),
        ("ModelCall", 1)
    );
    assert_ne!(
        next.worker.pod, first.worker.pod,
        "a second worker took over"
    );
    let gap = (next.created_at.unwrap() - first.created_at.unwrap()).num_seconds();
    assert!(
        gap >= 8,
        "the takeover waited for the frozen worker's lease to expire (gap {gap} s)"
    );
    assert!(
        gap <= 40,
        "the lost worker was noticed promptly (gap {gap} s)"
    );
    assert_eq!(
        w.standins.model_requests("lost").await.len(),
        3,
        "the recorded model call was not asked again"
    );
    let events = common::kubectl(&[
        "get",
        "events",
        "-n",
        w.name(),
        "--field-selector",
        "reason=StepStopped",
    ]);
    assert!(events.contains("StepStopped"), "{events}");
}

/// Step pods deleted again and again, each after its attempt recorded
/// something, never fail the run: progress resets the attempt count (more
/// deletions here than the attempts a step may fail without progress).
#[tokio::test]
async fn step_pods_deleted_after_progress_never_fail_the_run() {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{DeleteParams, ListParams};
    const DELETIONS: usize = agentrun::controller::reconciler::phase::MAX_ATTEMPTS as usize + 2;
    let w = World::new("disrupt", &[]).await;
    let mut replies: Vec<Value> = (0..DELETIONS + 1)
        .map(|i| call("lookup_order", json!({"orderId": format!("{i}")})))
        .collect();
    replies.push(finish("looked everything up"));
    w.standins
        .script("disrupt", Value::Array(replies.clone()), json!([]))
        .await;
    // Each lookup takes a while: the pod is deleted while one is in flight,
    // after its attempt recorded the model's answer and the intent.
    w.standins
        .configure_tools(w.name(), json!({"delayMs": {"lookup_order": 2500}}))
        .await;
    w.create_run(
        "disrupt",
        json!({"input": "Look up every order.", "agent": w.agent("disrupt")}),
        json!({}),
    )
    .await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let pods: Api<Pod> = Api::namespaced(w.client.clone(), w.name());
    let store = agentrun::store::open(&common::store::e2e_store_url().await)
        .await
        .unwrap();
    let mut deleted: Vec<String> = Vec::new();
    for n in 1..=DELETIONS {
        // A running step pod not deleted before, whose run has recorded its n-th intent.
        let victim = common::wait_for(
            &format!("step pod {n} to be mid tool call"),
            TIMEOUT,
            || async {
                let run = runs.get("disrupt").await.map_err(|e| e.to_string())?;
                let intents = store
                    .read_all(&run.metadata.uid.unwrap_or_default())
                    .await
                    .map_err(|e| e.to_string())?
                    .iter()
                    .filter(|r| r.kind == agentrun::store::StepKind::ToolIntent)
                    .count();
                if intents < n {
                    return Err(format!("{intents} intents recorded"));
                }
                let list = pods
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .into_iter()
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .map(|p| p.metadata.name.unwrap_or_default())
                    .find(|name| !deleted.contains(name))
                    .ok_or_else(|| "no new running step pod".to_string())
            },
        )
        .await;
        pods.delete(
            &victim,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await
        .expect("force-deleting the step pod");
        deleted.push(victim);
    }
    let run = w.wait_phase("disrupt", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let attempts: Vec<u32> = log.iter().map(|(r, _)| r.worker.attempt).collect();
    assert!(
        attempts.iter().all(|&a| a <= 1),
        "every deletion came after progress, so no attempt counted as failed (0: the controller's records): {attempts:?}"
    );
    let failed_jobs = run
        .status
        .as_ref()
        .and_then(|s| s.step.as_ref())
        .map(|s| s.failed_jobs);
    assert!(
        failed_jobs.is_some_and(|n| n as usize >= DELETIONS),
        "the deleted Jobs are counted as failed Jobs of the run: {failed_jobs:?}"
    );
    assert_eq!(
        w.standins.model_requests("disrupt").await.len(),
        replies.len(),
        "no recorded model answer was asked for again"
    );
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("looked everything up")
    );
}

/// A worker that froze right after recording a tool intent, was judged lost
/// and replaced (its lease taken over), then wakes: it neither calls the
/// tool nor appends. Run as a local `agentrun step` process against the
/// e2e store, so it survives its "replacement" as a partitioned pod would.
#[tokio::test]
async fn a_zombie_worker_that_wakes_after_a_takeover_neither_calls_nor_appends() {
    use agentrun::runlog::records::{RunStarted, Versions};
    use agentrun::store::{Head, RecordDraft, StepKind};
    use agentrun::tools::{McpCatalog, Toolbox};
    let w = World::new("zombie", &[]).await;
    w.standins
        .script(
            "zombie",
            json!([
                call("issue_refund", json!({"orderId": "7", "amount": 7})),
                finish("done")
            ]),
            json!([]),
        )
        .await;
    // The agent without its MCP tool (nothing to discover outside a cluster).
    let mut agent = w.agent("zombie");
    agent["tools"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t.get("mcp").is_none());
    let template: agentrun::api::AgentTemplate = serde_json::from_value(agent).unwrap();
    let toolbox = Toolbox::new(&template.tools, &McpCatalog::new()).unwrap();
    let started = Entry::RunStarted(RunStarted {
        container: None,
        run_name: "zombie".into(),
        namespace: w.name().into(),
        input: "Refund order 7.".into(),
        agent: template.clone().into(),
        tools: toolbox.defs().into_iter().map(Into::into).collect(),
        mcp: Default::default(),
        versions: Versions {
            prompt_version: "v1".into(),
            model: template.model.name.clone(),
            tool_schema_hash: toolbox.schema_hash(),
            ..Default::default()
        },
    });
    let url = common::store::e2e_store_url().await;
    let store = agentrun::store::open(&url).await.unwrap();
    let uid = format!("zombie-{}", std::process::id());
    let lease = store
        .acquire(&uid, "controller", Duration::from_secs(5))
        .await
        .unwrap();
    let record = RecordDraft::new(StepKind::RunStarted, started.payload())
        .seal(&Head::EMPTY)
        .unwrap();
    store.append(&uid, lease.epoch, &record).await.unwrap();
    store.release(&lease).await.unwrap();

    // The worker freezes (SIGSTOP) right after recording the intent.
    let zombie = std::process::Command::new(common::binary("agentrun"))
        .args(["step"])
        .env("AGENTRUN_RUN_UID", &uid)
        .env("AGENTRUN_STORE_URL", &url)
        .env("AGENTRUN_MODEL_API_KEY", "sk-e2e")
        .env("POD_NAME", "zombie-pod")
        .env("AGENTRUN_FAILPOINT", "hang:after-append:ToolIntent")
        .spawn()
        .expect("starting agentrun step");
    let pid = zombie.id() as i32;
    common::wait_for("the worker to freeze", TIMEOUT, || async {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        if state == Some("T") {
            Ok(())
        } else {
            Err(format!("state {state:?}"))
        }
    })
    .await;
    let frozen_log = store.read_all(&uid).await.unwrap();
    assert_eq!(
        frozen_log.last().map(|r| r.kind),
        Some(StepKind::ToolIntent),
        "froze after the intent"
    );

    // What the controller does to a lost worker: wait out its lease, take it.
    let takeover = common::wait_for("the frozen worker's lease to lapse", TIMEOUT, || async {
        store
            .acquire(&uid, "replacement", Duration::from_secs(60))
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    // SAFETY: kill(2) of the child we spawned.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let zombie = std::sync::Mutex::new(zombie);
    let exit = common::wait_for("the zombie to give up", TIMEOUT, || async {
        zombie
            .lock()
            .unwrap()
            .try_wait()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "still running".to_string())
    })
    .await;
    assert!(
        !exit.success(),
        "the zombie must fail, not finish: {exit:?}"
    );
    assert!(
        w.standins.tool_requests(w.name()).await.is_empty(),
        "the zombie called the tool after losing its lease"
    );
    assert_eq!(
        store.read_all(&uid).await.unwrap().len(),
        frozen_log.len(),
        "the zombie appended after losing its lease"
    );
    // The replacement holds the current epoch and can go on.
    assert!(store.renew(&takeover, Duration::from_secs(5)).await.is_ok());
}

/// A step that keeps failing without recording anything (here: a runner
/// that panics before every model call) fails the run after the Agent's
/// `retry.maxAttemptsWithoutProgress` attempts, with the reason and the
/// panic's message (the container's termination message), so nobody needs
/// the pod's log.
#[tokio::test]
async fn a_step_failing_without_progress_ends_the_run_by_its_retry_policy() {
    let w = World::new("crashloop", &[]).await;
    w.standins
        .script("crashloop", json!([finish("unreachable")]), json!([]))
        .await;
    let mut agent = w.agent("crashloop");
    agent["retry"] = json!({"maxAttemptsWithoutProgress": 2, "backoffSeconds": 0});
    w.create_run(
        "crashloop",
        json!({"input": "Anything.", "agent": agent}),
        json!({"agentrun.dev/failpoint": "every-attempt:panic:before-model-call"}),
    )
    .await;
    let run = w.wait_phase("crashloop", Phase::Failed).await;
    let status = run.status.unwrap();
    let error = status.error.unwrap_or_default();
    assert!(
        error.contains("failed 2 times in a row without recording anything"),
        "{error}"
    );
    assert!(
        error.contains("PodFailurePolicy"),
        "a crash is told apart from a disruption by the Job's pod failure policy: {error}"
    );
    assert!(
        error.contains("failpoint before-model-call reached: panicking"),
        "the run's status quotes the step's own last words: {error}"
    );
    assert_eq!(status.step.map(|s| s.attempt), Some(2));
    assert!(w.standins.model_requests("crashloop").await.is_empty());
}

/// A transient provider failure is retried inside the step: one recorded
/// answer, no pod crash, no second attempt.
#[tokio::test]
async fn a_provider_answering_500_twice_then_200_is_one_answer_without_a_crash() {
    let w = World::new("flaky", &[]).await;
    let busy = json!({"status": 500, "message": "busy"});
    w.standins
        .script("flaky", json!([busy, busy, finish("done")]), json!([]))
        .await;
    let agent = w.agent("flaky");
    w.create_run(
        "flaky",
        json!({"input": "Anything.", "agent": agent}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("flaky", Phase::Succeeded).await;
    assert_eq!(
        run.status
            .as_ref()
            .and_then(|s| s.step.as_ref())
            .map(|s| s.attempt),
        Some(1),
        "no pod crashed"
    );
    assert_eq!(w.standins.model_requests("flaky").await.len(), 3);
    let log = w.log(&run).await;
    let calls = log
        .iter()
        .filter(|(_, s)| matches!(s, Entry::ModelCall(_)))
        .count();
    assert_eq!(calls, 1, "{:?}", kinds(&log));
    // The step pod that retried is gone: the controller counts the attempts
    // from the record, and a scrape of its /metrics shows all three.
    let port = w.metrics_port();
    let attempts = |outcome: &'static str| {
        let name =
            format!(r#"agentrun_model_attempts_total{{provider="OpenAI",outcome="{outcome}"}}"#);
        async move { common::controller::metric(port, &name).await }
    };
    common::wait_for(
        "the controller to count the model attempts",
        Duration::from_secs(30),
        || async {
            let (failed, ok) = (attempts("5xx").await, attempts("ok").await);
            (failed == Some(2.0) && ok == Some(1.0))
                .then_some(())
                .ok_or_else(|| format!("5xx {failed:?}, ok {ok:?}"))
        },
    )
    .await;
}

/// A provider's refusal (llama-cpp-python's validation error, here as a
/// 400) ends the run at once with who said what: in `status.error`, a
/// Warning Event and the log; never a crash loop.
#[tokio::test]
async fn a_provider_refusing_the_request_stops_the_run_with_its_message() {
    let w = World::new("refused", &[]).await;
    let refusal = json!({"status": 400, "message": "messages[2].content: Input should be a valid string\u{1b}[31m"});
    w.standins
        .script("refused", json!([refusal]), json!([]))
        .await;
    let agent = w.agent("refused");
    w.create_run(
        "refused",
        json!({"input": "Anything.", "agent": agent}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("refused", Phase::Failed).await;
    let status = run.status.clone().unwrap();
    let error = status.error.unwrap_or_default();
    for part in [
        "OpenAI-format model server http://127.0.0.1",
        "refused the request",
        "HTTP 400",
        "messages[2].content: Input should be a valid string",
    ] {
        assert!(error.contains(part), "{part:?} missing from {error}");
    }
    assert!(
        !error.contains('\u{1b}'),
        "control characters are escaped: {error:?}"
    );
    assert_eq!(status.step.map(|s| s.attempt), Some(1), "no pod crashed");
    assert_eq!(
        w.standins.model_requests("refused").await.len(),
        1,
        "not asked again"
    );
    let log = w.log(&run).await;
    let tail: Vec<_> = kinds(&log).into_iter().rev().take(2).collect();
    assert_eq!(tail, vec!["RunFinished", "Observation"]);
    match &log[log.len() - 2].1 {
        Entry::Observation(o) => assert!(o.text.contains("HTTP 400"), "{}", o.text),
        other => panic!("{other:?}"),
    }
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(w.client.clone(), w.name());
    let warned = common::wait_for(
        "a RunFailed Warning naming the provider",
        TIMEOUT,
        || async {
            let list = events.list(&Default::default()).await.ok()?;
            list.items.into_iter().find(|e| {
                e.type_.as_deref() == Some("Warning")
                    && e.involved_object.name.as_deref() == Some("refused")
                    && e.message.as_deref().is_some_and(|m| m.contains("HTTP 400"))
            })
        },
    )
    .await;
    assert_eq!(warned.reason.as_deref(), Some("RunFailed"));
}

/// A model server that never answers is cut by the step's own timeout,
/// early enough to record why: the run fails with that, not with a killed pod.
#[tokio::test]
async fn a_model_server_that_hangs_is_cut_by_the_step_timeout() {
    let w = World::new("hung", &[]).await;
    let hang = json!({"delayMs": 600_000, "text": "too late"});
    w.standins.script("hung", json!([hang]), json!([])).await;
    let agent = w.agent("hung");
    w.create_run(
        "hung",
        json!({"input": "Anything.", "agent": agent, "stepTimeout": "12s"}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("hung", Phase::Failed).await;
    let status = run.status.clone().unwrap();
    let error = status.error.unwrap_or_default();
    assert!(error.contains("did not answer in time"), "{error}");
    assert!(error.contains("timed out"), "{error}");
    assert_eq!(
        status.step.map(|s| s.attempt),
        Some(1),
        "the pod was not killed"
    );
}
