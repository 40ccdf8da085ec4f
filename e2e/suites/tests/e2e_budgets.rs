//! Budgets that ask (`budgets.onExhausted: Ask`) on a real API server: a
//! run whose step budget runs out waits on an Approval of kind `Budget`
//! with no pod, goes on when an approver raises the cap, ends
//! `BudgetExceeded` when rejected, and keeps a raise across a crash.

mod common;

use agentrun::api::{Approval, ApprovalKind, Phase};
use agentrun::replay::Entry;
use common::approvals::{decide, entry, grant_approver_role, pending_approval, refusal};
use common::world::{TIMEOUT, World, call, finish};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

/// A refund agent whose budget is `max_steps` records and asks finance.
fn asking_agent(w: &World, script: &str, max_steps: u64) -> Value {
    let mut agent = w.agent(script);
    agent["budgets"] = json!({
        "maxSteps": max_steps, "onExhausted": "Ask",
        "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"
    });
    agent
}

/// `n` order lookups, each its own reply, then the final answer.
fn lookups_then_finish(n: usize) -> Value {
    let mut replies: Vec<Value> = (0..n)
        .map(|i| call("lookup_order", json!({"orderId": format!("{}", 1040 + i)})))
        .collect();
    replies.push(finish("looked everything up"));
    Value::Array(replies)
}

async fn running_step_pods(w: &World, run: &str) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(w.client.clone(), w.name());
    let list = pods
        .list(&ListParams::default().labels(&format!("agentrun.dev/run={run}")))
        .await
        .unwrap();
    list.items
        .into_iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// Waits for the run to wait on a budget question with no pod; returns it.
async fn budget_question(w: &World, run: &str) -> Approval {
    let approval = pending_approval(w, run).await;
    assert_eq!(approval.spec.kind, ApprovalKind::Budget);
    assert_eq!(approval.spec.tool, agentrun::api::BUDGET_TOOL);
    common::wait_for("the step pod to exit", TIMEOUT, || async {
        running_step_pods(w, run).await.is_empty().then_some(())
    })
    .await;
    approval
}

/// Run `b` of `lookups` lookups under a step budget of `max_steps` that
/// asks: the budget question it waits on.
async fn asked(w: &World, lookups: usize, max_steps: u64, annotations: Value) -> Approval {
    w.standins
        .script("b", lookups_then_finish(lookups), json!([]))
        .await;
    w.create_run(
        "b",
        json!({"input": "Look orders up.", "agent": asking_agent(w, "b", max_steps)}),
        annotations,
    )
    .await;
    budget_question(w, "b").await
}

fn edit(approver: &str, hash: &str, arguments: Value) -> Value {
    let mut e = entry(approver, "Edit", hash, "five more steps");
    e["arguments"] = arguments;
    e
}

#[tokio::test]
async fn a_used_up_budget_asks_and_a_raise_by_five_steps_lets_the_run_succeed() {
    let w = World::new("budget-raise", &[]).await;
    grant_approver_role(&w).await;
    // 10 records: the start, three replies with a lookup each; the fourth
    // model call would be the 11th record.
    let approval = asked(&w, 3, 10, json!({})).await;
    assert_eq!(approval.spec.step, 10);
    assert_eq!(approval.spec.arguments, json!({"maxSteps": 20}));
    let reason = approval
        .spec
        .observations
        .reason
        .clone()
        .unwrap_or_default();
    assert!(
        reason.contains("step budget used up: 10 of 10 steps"),
        "{reason}"
    );
    assert!(
        reason.contains("3 model calls, lookup_order ×3"),
        "on what: {reason}"
    );
    assert_eq!(approval.spec.observations.recent_results.len(), 3);
    assert_eq!(
        w.standins.model_requests("b").await.len(),
        3,
        "the model is not asked while waiting"
    );

    // An edit that gives no limit is refused by the API server, naming the field.
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    for bad in [
        json!({"maxSteps": "lots"}),
        json!({"maxSteps": 0}),
        json!({"deadline": "1h"}),
        json!({}),
    ] {
        let msg = refusal(decide(&w, "alice", &name, edit("alice", &hash, bad.clone())).await);
        assert!(
            msg.contains("spec.decisions[].arguments of a Budget approval"),
            "{bad}: {msg}"
        );
    }
    // bob raises it by five steps through an edit.
    decide(
        &w,
        "bob",
        &name,
        edit("bob", &hash, json!({"maxSteps": 15})),
    )
    .await
    .expect("bob raises the budget");
    let run = w.wait_phase("b", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let raise = log.iter().find_map(|(_, s)| match s {
        Entry::ApprovalDecided(d) if d.request_seq == 10 => Some(d.clone()),
        _ => None,
    });
    let raise = raise.expect("the raise is recorded in the log");
    assert_eq!(raise.arguments, Some(json!({"maxSteps": 15})));
    assert_eq!(raise.decisions[0].approver, "bob");
    assert_eq!(log.len(), 14, "the final answer within the raised cap");
}

#[tokio::test]
async fn a_rejected_budget_question_ends_the_run_budget_exceeded_with_its_partial_result() {
    let w = World::new("budget-reject", &[]).await;
    grant_approver_role(&w).await;
    let approval = asked(&w, 3, 4, json!({})).await;
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    decide(
        &w,
        "alice",
        &name,
        entry("alice", "Reject", &hash, "enough"),
    )
    .await
    .expect("alice rejects");
    let run = w.wait_phase("b", Phase::BudgetExceeded).await;
    let error = run.status.unwrap_or_default().error.unwrap_or_default();
    assert!(error.contains("was rejected"), "{error}");
    assert_eq!(
        w.standins.model_requests("b").await.len(),
        1,
        "the model is not asked again"
    );
}

#[tokio::test]
async fn a_run_killed_right_after_the_raise_resumes_with_the_raised_cap_not_a_fresh_budget() {
    let mut w = World::new("budget-kill", &[]).await;
    grant_approver_role(&w).await;
    // Every step Job dies (SIGABRT, its lease left behind) right after it
    // records a model call: the first one after the raise too.
    let crash = json!({"agentrun.dev/failpoint": "every-attempt:after-append:ModelCall"});
    let approval = asked(&w, 8, 10, crash).await;
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    decide(
        &w,
        "bob",
        &name,
        edit("bob", &hash, json!({"maxSteps": 15})),
    )
    .await
    .expect("bob raises the budget");
    // Right after the raise is recorded the controller is SIGKILLed too.
    let uid = approval.spec.run_ref.uid.clone().unwrap();
    let store = w.store().await;
    common::wait_for("the raise to be recorded", TIMEOUT, || async {
        let records = store.read_all(&uid).await.unwrap_or_default();
        records
            .iter()
            .any(|r| {
                matches!(Entry::decode(r.seq, r.kind.as_str(), &r.payload),
                         Ok(Entry::ApprovalDecided(d)) if d.request_seq == 10)
            })
            .then_some(())
    })
    .await;
    w.kill_controller();
    w.revive_controller();

    // It asks again at 15 records in all: the cap raised, counted from the
    // run's start (a fresh budget would have allowed ten more).
    let second = common::wait_for("a second budget question", TIMEOUT, || async {
        let a = pending_approval(&w, "b").await;
        (a.metadata.name.as_deref() != Some(name.as_str())).then_some(a)
    })
    .await;
    assert_eq!(second.spec.kind, ApprovalKind::Budget);
    assert_eq!(second.spec.step, 15);
    let reason = second.spec.observations.reason.clone().unwrap_or_default();
    assert!(reason.contains("15 of 15 steps"), "{reason}");
    assert_eq!(second.spec.arguments, json!({"maxSteps": 25}));
    // The worker that recorded the first model call after the raise (12)
    // died there: the next record is another worker's.
    let records = store.read_all(&uid).await.unwrap();
    let worker = |seq: usize| records[seq].worker.pod.clone();
    assert_eq!(records[12].kind.as_str(), "ModelCall");
    assert_ne!(worker(12), worker(13), "a crash right after the raise");
}
