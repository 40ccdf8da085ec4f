//! Agents nobody here wrote, unmodified, as durable runs (issue 41): a
//! LangGraph ReAct agent, an OpenAI Agents SDK agent and a plain `openai`
//! streaming loop, installed from the package index (`e2e/agents/`), each
//! run as a container agent on the process node, its image mapped to the
//! programs' directory. The runner beside each serves its model calls and
//! its MCP tools; the stand-in model and tools count what reaches them.

mod common;

use agentrun::api::Phase;
use agentrun::replay::Entry;
use agentrun::runlog::records::Outcome;
use common::approvals::{
    decide, entry, gated_agent, grant_approver_role, live_step_pods, pending_approval, plugin,
};
use common::container_agent::in_container;
use common::world::{World, call, kinds};
use serde_json::{Value, json};

/// The three agents of the proof, by program.
const AGENTS: [&str; 3] = ["langgraph-agent", "agents-sdk-agent", "plain-agent"];

fn answer(text: &str) -> Value {
    json!({"text": text})
}

fn refund_call(amount: u64) -> Value {
    json!({"text": "The customer was charged twice; refunding.",
           "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": amount}}]})
}

fn model_calls(log: &[(agentrun::store::Record, Entry)]) -> usize {
    log.iter()
        .filter(|(_, e)| matches!(e, Entry::ModelCall(_)))
        .count()
}

/// Each agent looks the order up through its MCP tools and answers: the
/// run Succeeds with the agent's answer, every request is recorded (with
/// the agent's own request), each model answer asked once.
#[tokio::test]
async fn each_unmodified_agent_runs_to_success_with_every_answer_recorded() {
    let w = World::new("cagents", &[]).await;
    for program in AGENTS {
        let script = program.replace("-agent", "");
        w.standins
            .script(
                &script,
                json!([
                    call("lookup_order", json!({"orderId": "1042"})),
                    answer("Order 1042 was charged twice and can be refunded.")
                ]),
                json!([]),
            )
            .await;
        let agent = in_container(w.agent(&script), program);
        w.create_run(
            &script,
            json!({"input": "Can order 1042 be refunded?", "agent": agent}),
            json!({}),
        )
        .await;
    }
    for program in AGENTS {
        let script = program.replace("-agent", "");
        let run = w.wait_phase(&script, Phase::Succeeded).await;
        let result = run.status.as_ref().and_then(|s| s.result.clone());
        assert_eq!(
            result.as_deref(),
            Some("Order 1042 was charged twice and can be refunded."),
            "{program}"
        );
        let log = w.log(&run).await;
        assert_eq!(model_calls(&log), 2, "{program}: {:?}", kinds(&log));
        for (record, entry) in &log {
            match entry {
                Entry::ModelCall(m) => {
                    assert!(
                        m.request.is_some(),
                        "{program}: the agent's request is recorded"
                    );
                    assert_eq!(record.format, 2);
                }
                Entry::ToolIntent(i) => assert_eq!(i.tool, "lookup_order", "{program}"),
                _ => {}
            }
        }
        assert_eq!(
            w.standins.model_requests(&script).await.len(),
            2,
            "{program}: each answer asked once"
        );
    }
    let lookups = w
        .standins
        .tool_requests(w.name())
        .await
        .into_iter()
        .filter(|r| r["tool"] == "lookup_order")
        .count();
    assert_eq!(lookups, AGENTS.len(), "one lookup per agent");
}

/// The runner killed right after each kind of record (a model answer, a
/// call's intent, a result) and after a refund reached its tool: the agent
/// starts over in a new pod, is answered from the log, and each answer is
/// asked once and the refund made once.
#[tokio::test]
async fn a_step_pod_killed_at_each_boundary_resumes_by_replay_asking_and_refunding_once() {
    let w = World::new("ckill", &[]).await;
    let points = [
        "after-append:ModelCall",
        "after-append:ToolIntent",
        "after-tool-call",
        "after-append:ToolResult",
    ];
    for (i, point) in points.iter().enumerate() {
        let program = AGENTS[i % AGENTS.len()];
        let name = format!("k{i}");
        w.standins
            .script(
                &name,
                json!([refund_call(40), answer("Refunded 40.")]),
                json!([]),
            )
            .await;
        let agent = in_container(w.agent(&name), program);
        w.create_run(
            &name,
            json!({"input": format!("Refund order 1042 ({point})."), "agent": agent}),
            json!({"agentrun.dev/failpoint": point}),
        )
        .await;
    }
    for (i, point) in points.iter().enumerate() {
        let name = format!("k{i}");
        let run = w.wait_phase(&name, Phase::Succeeded).await;
        let log = w.log(&run).await;
        let pods: std::collections::HashSet<&str> =
            log.iter().map(|(r, _)| r.worker.pod.as_str()).collect();
        assert!(
            pods.len() >= 2,
            "{point}: a second pod wrote part of the log"
        );
        assert_eq!(
            w.standins.model_requests(&name).await.len(),
            2,
            "{point}: a recorded answer is never asked again"
        );
    }
    let refunds = w.standins.effects(w.name()).await;
    assert_eq!(
        refunds.len(),
        points.len(),
        "one refund per run: {refunds:?}"
    );
}

/// A gated refund: the run waits with no pod; approved as alice with the
/// plugin, the agent starts over, replays to the call, and the refund is
/// made once with the approved arguments. An edit makes the edited call
/// and tells the agent; a rejection reaches the agent's model with its reason.
#[tokio::test]
async fn a_gated_refund_is_approved_edited_or_rejected_and_the_agent_is_told() {
    let w = World::new("cgate", &[]).await;
    grant_approver_role(&w).await;
    let cases = [
        ("approve", "langgraph-agent"),
        ("edit", "agents-sdk-agent"),
        ("reject", "plain-agent"),
    ];
    for (case, program) in cases {
        w.standins
            .script(
                case,
                json!([refund_call(500), answer("Done with order 1042.")]),
                json!([]),
            )
            .await;
        let agent = in_container(gated_agent(&w, case, json!({})), program);
        w.create_run(
            case,
            json!({"input": "Refund order 1042.", "agent": agent}),
            json!({}),
        )
        .await;
    }
    for (case, program) in cases {
        let approval = pending_approval(&w, case).await;
        assert_eq!(
            approval.spec.arguments,
            json!({"orderId": "1042", "amount": 500}),
            "{program}"
        );
        common::wait_for("the step pod to exit", common::world::TIMEOUT, || async {
            (live_step_pods(&w, case).await == 0).then_some(())
        })
        .await;
        let name = approval.metadata.name.clone().unwrap();
        let hash = approval.spec.arguments_hash.clone();
        match case {
            "approve" => {
                let (ok, out) = plugin(&w, "alice", &["approve", &name, "--reason", "confirmed"]);
                assert!(ok, "{out}");
            }
            "edit" => {
                let mut e = entry("alice", "Edit", &hash, "partial refund");
                e["arguments"] = json!({"orderId": "1042", "amount": 300});
                decide(&w, "alice", &name, e).await.expect("alice edits");
            }
            _ => {
                let e = entry("alice", "Reject", &hash, "not a duplicate");
                decide(&w, "alice", &name, e).await.expect("alice rejects");
            }
        }
    }
    for (case, program) in cases {
        let run = w.wait_phase(case, Phase::Succeeded).await;
        let requests = w.standins.model_requests(case).await;
        assert_eq!(requests.len(), 2, "{program}: each answer asked once");
        let last = requests[1].to_string();
        match case {
            "edit" => assert!(
                last.contains("alice changed amount from 500 to 300: partial refund"),
                "{program}: the agent's model is told of the edit: {last}"
            ),
            "reject" => assert!(
                last.contains("rejected by alice: not a duplicate"),
                "{program}: the agent's model is told why: {last}"
            ),
            _ => {}
        }
        let log = w.log(&run).await;
        assert!(kinds(&log).contains(&"ApprovalDecided"), "{program}");
    }
    let amounts: Vec<Value> = w
        .standins
        .effects(w.name())
        .await
        .iter()
        .map(|e| e["args"]["amount"].clone())
        .collect();
    let mut amounts: Vec<u64> = amounts.iter().filter_map(Value::as_u64).collect();
    amounts.sort();
    assert_eq!(
        amounts,
        [300, 500],
        "the approved and the edited refund, once each"
    );
}

/// An agent with the time in its prompt: after the approval its new pod
/// asks something the log never recorded, and the run ends Diverged,
/// naming the recorded request; the model is not asked again.
#[tokio::test]
async fn a_non_deterministic_agent_ends_diverged_and_the_model_is_not_asked_again() {
    let w = World::new("cdiverge", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "clock",
            json!([refund_call(500), answer("Done.")]),
            json!([]),
        )
        .await;
    let agent = in_container(gated_agent(&w, "clock", json!({})), "clock-agent");
    w.create_run(
        "clock",
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;
    let approval = pending_approval(&w, "clock").await;
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    decide(&w, "alice", &name, entry("alice", "Approve", &hash, "ok"))
        .await
        .expect("alice approves");
    let run = w.wait_phase("clock", Phase::Failed).await;
    let status = run.status.clone().unwrap();
    let error = status.error.unwrap_or_default();
    assert!(
        error.contains("Diverged") && error.contains("recorded at seq"),
        "{error}"
    );
    let reason = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .map(|c| c.reason.clone());
    assert_eq!(reason.as_deref(), Some("Diverged"));
    let log = w.log(&run).await;
    let stop = log.iter().find_map(|(_, e)| match e {
        Entry::RunFinished(f) => Some(f.outcome),
        _ => None,
    });
    assert_eq!(stop, Some(Outcome::Diverged));
    assert_eq!(w.standins.model_requests("clock").await.len(), 1);
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "nothing refunded"
    );
}
