//! Human approval end to end, acting as alice, bob and carol on a real API
//! server: approve, reject, edit, quorum, expiry policies, and every spoof
//! refused by the API server itself.

mod common;

use std::time::Duration;

use agentrun::api::{AgentRun, Approval, Phase};
use agentrun::replay::Entry;
use common::approvals::{
    decide, entry, gated_agent, grant_approver_role, live_step_pods, pending_approval, plugin,
    refund, refusal,
};
use common::world::{TIMEOUT, World, finish, kinds};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

#[tokio::test]
async fn an_approved_call_runs_once_with_exactly_the_approved_arguments() {
    let w = World::new("approve", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "ok",
            json!([refund(500), finish("refunded 500")]),
            json!([]),
        )
        .await;
    // Approval events go to the policy's webhook (a stand-in endpoint of its own tenant).
    let hooks = format!("{}-hooks", w.name());
    let mut agent = gated_agent(&w, "ok", json!({}));
    agent["approval"]["notifyWebhook"] = json!(format!(
        "{}/tools/{hooks}/approval-webhook",
        w.standins.base
    ));
    w.create_run(
        "ok",
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;

    let approval = pending_approval(&w, "ok").await;
    assert_eq!(approval.spec.tool, "issue_refund");
    assert_eq!(
        approval.spec.arguments,
        json!({"orderId": "1042", "amount": 500})
    );
    assert_eq!(
        approval.spec.arguments_hash,
        agentrun::policy::arguments_hash("issue_refund", &approval.spec.arguments)
    );
    assert!(
        approval
            .spec
            .observations
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("charged twice")
    );
    // Waiting holds no pod and the call has not happened.
    common::wait_for("the step pod to exit", TIMEOUT, || async {
        (live_step_pods(&w, "ok").await == 0).then_some(())
    })
    .await;
    assert!(w.standins.effects(w.name()).await.is_empty());

    // carol is not an approver; alice may not speak for bob; a decision must quote the hash.
    let name = approval.metadata.name.clone().unwrap();
    let hash = approval.spec.arguments_hash.clone();
    let msg = refusal(decide(&w, "carol", &name, entry("carol", "Approve", &hash, "")).await);
    assert!(msg.contains("carol is not an approver"), "{msg}");
    let msg = refusal(decide(&w, "alice", &name, entry("bob", "Approve", &hash, "")).await);
    assert!(
        msg.contains("may only add a decision for themselves"),
        "{msg}"
    );
    let wrong = "0".repeat(64);
    let msg = refusal(decide(&w, "alice", &name, entry("alice", "Approve", &wrong, "")).await);
    assert!(
        msg.contains("argumentsHash must equal spec.argumentsHash"),
        "{msg}"
    );
    // Nobody but the controller changes what is approved.
    let api: Api<Approval> = Api::namespaced(common::client_as("alice").await, w.name());
    let tamper = json!({"spec": {"arguments": {"orderId": "1042", "amount": 5000}}});
    let msg = refusal(
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&tamper))
            .await,
    );
    assert!(msg.contains("only spec.decisions may be changed"), "{msg}");

    decide(
        &w,
        "alice",
        &name,
        entry("alice", "Approve", &hash, "duplicate charge confirmed"),
    )
    .await
    .expect("alice approves");
    let run = w.wait_phase("ok", Phase::Succeeded).await;
    let events: Vec<String> = w
        .standins
        .tool_requests(&hooks)
        .await
        .iter()
        .map(|r| r["args"]["event"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        events,
        vec!["raised".to_string(), "decided".to_string()],
        "webhook events"
    );
    let effects = w.standins.effects(w.name()).await;
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(
        effects[0]["args"],
        json!({"orderId": "1042", "amount": 500})
    );
    let log = w.log(&run).await;
    let decided = log.iter().find_map(|(_, s)| match s {
        Entry::ApprovalDecided(d) => Some(d.clone()),
        _ => None,
    });
    let decided = decided.expect("ApprovalDecided in the log");
    assert_eq!(decided.decisions[0].approver, "alice");
    assert_eq!(decided.decisions[0].arguments_hash, hash);

    // Decided: no more decisions, not even from an approver.
    let msg = refusal(decide(&w, "bob", &name, entry("bob", "Reject", &hash, "too late")).await);
    assert!(msg.contains("already Approved"), "{msg}");
    assert!(kinds(&log).contains(&"ApprovalRequested"));
}

#[tokio::test]
async fn a_rejection_goes_back_to_the_agent_and_an_edit_runs_the_edited_call() {
    let w = World::new("rejedit", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "rej",
            json!([refund(500), finish("told the customer no")]),
            json!([]),
        )
        .await;
    w.standins
        .script(
            "edit",
            json!([refund(500), finish("refunded 300")]),
            json!([]),
        )
        .await;
    w.create_run(
        "rej",
        json!({"input": "Refund.", "agent": gated_agent(&w, "rej", json!({}))}),
        json!({}),
    )
    .await;
    w.create_run(
        "edit",
        json!({"input": "Refund.", "agent": gated_agent(&w, "edit", json!({}))}),
        json!({}),
    )
    .await;

    let a = pending_approval(&w, "rej").await;
    let hash = a.spec.arguments_hash.clone();
    decide(
        &w,
        "alice",
        &a.metadata.name.clone().unwrap(),
        entry("alice", "Reject", &hash, "amount exceeds policy"),
    )
    .await
    .unwrap();
    w.wait_phase("rej", Phase::Succeeded).await;
    let last = w
        .standins
        .model_requests("rej")
        .await
        .pop()
        .unwrap()
        .to_string();
    assert!(
        last.contains("issue_refund rejected by alice: amount exceeds policy"),
        "{last}"
    );

    let a = pending_approval(&w, "edit").await;
    let mut e = entry("bob", "Edit", &a.spec.arguments_hash, "partial refund");
    e["arguments"] = json!({"orderId": "1042", "amount": 300});
    decide(&w, "bob", &a.metadata.name.clone().unwrap(), e)
        .await
        .expect("bob edits");
    w.wait_phase("edit", Phase::Succeeded).await;

    let effects = w.standins.effects(w.name()).await;
    let refunds: Vec<_> = effects
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .collect();
    assert_eq!(
        refunds.len(),
        1,
        "only the edited call ran, once: {effects:?}"
    );
    assert_eq!(refunds[0]["args"]["amount"], 300);
    let last = w
        .standins
        .model_requests("edit")
        .await
        .pop()
        .unwrap()
        .to_string();
    assert!(
        last.contains("bob changed amount from 500 to 300: partial refund"),
        "{last}"
    );
    assert!(
        !last.contains("\\\"amount\\\":500"),
        "the model sees the edited call, not the proposal: {last}"
    );
}

#[tokio::test]
async fn a_quorum_needs_two_distinct_approvers_and_the_requester_is_not_one() {
    let w = World::new("quorum", &[]).await;
    grant_approver_role(&w).await;
    // alice may create runs here; as the requester she may not approve her own.
    let cr_name = format!("{}-runs", w.name());
    let cr = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": cr_name},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"], "verbs": ["create", "get"]}]});
    let crs: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(w.client.clone());
    crs.patch(
        &cr_name,
        &PatchParams::apply("e2e").force(),
        &Patch::Apply(&cr),
    )
    .await
    .unwrap();
    let rb = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "alice-runs", "namespace": w.name()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cr_name},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]
    });
    let rbs: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(w.client.clone(), w.name());
    rbs.create(&Default::default(), &serde_json::from_value(rb).unwrap())
        .await
        .unwrap();

    w.standins
        .script("q", json!([refund(900), finish("refunded 900")]), json!([]))
        .await;
    let rule = json!({"requiredApprovals": 2, "approvers": {"users": ["alice", "bob", "carol"]}});
    let mut agent = gated_agent(&w, "q", rule);
    agent["approval"]["separationOfDuties"] = json!(true);
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "q", "annotations": {"agentrun.dev/requester": "alice"}},
        "spec": {"input": "Refund 900.", "agent": agent}
    }))
    .unwrap();
    let as_alice: Api<AgentRun> = Api::namespaced(common::client_as("alice").await, w.name());
    // Nobody can name someone else as the requester.
    let mut forged = run.clone();
    forged.metadata.name = Some("forged".into());
    forged.metadata.annotations =
        Some([("agentrun.dev/requester".to_string(), "bob".to_string())].into());
    match as_alice.create(&Default::default(), &forged).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("must be your own user name"),
            "{}",
            e.message
        ),
        other => panic!("a forged requester was accepted: {other:?}"),
    }
    as_alice
        .create(&Default::default(), &run)
        .await
        .expect("alice requests the run");

    let a = pending_approval(&w, "q").await;
    assert_eq!(
        (a.spec.required_approvals, a.spec.requester.as_deref()),
        (2, Some("alice"))
    );
    let name = a.metadata.name.clone().unwrap();
    let hash = a.spec.arguments_hash.clone();
    let msg = refusal(decide(&w, "alice", &name, entry("alice", "Approve", &hash, "mine")).await);
    assert!(msg.contains("separation of duties"), "{msg}");
    decide(&w, "bob", &name, entry("bob", "Approve", &hash, "ok"))
        .await
        .unwrap();
    // One of two: still waiting, nothing ran, and bob cannot count twice.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    assert_eq!(
        runs.get("q").await.unwrap().status.unwrap().phase,
        Some(Phase::AwaitingApproval)
    );
    assert!(w.standins.effects(w.name()).await.is_empty());
    let msg = refusal(decide(&w, "bob", &name, entry("bob", "Approve", &hash, "again")).await);
    assert!(
        msg.contains("existing entries") || msg.contains("Duplicate"),
        "{msg}"
    );
    decide(
        &w,
        "carol",
        &name,
        entry("carol", "Approve", &hash, "second pair of eyes"),
    )
    .await
    .expect("carol approves");
    w.wait_phase("q", Phase::Succeeded).await;
    assert_eq!(w.standins.effects(w.name()).await.len(), 1);
    crs.delete(&cr_name, &Default::default()).await.ok();
}

#[tokio::test]
async fn expiry_follows_on_expiry_and_never_runs_the_requested_call() {
    let w = World::new("expiry", &[]).await;
    grant_approver_role(&w).await;
    let quick = |on_expiry: &str| json!({"expiresAfter": "3s", "onExpiry": on_expiry});
    w.standins
        .script(
            "fail",
            json!([refund(500), finish("unreachable")]),
            json!([]),
        )
        .await;
    w.standins
        .script(
            "back",
            json!([refund(500), finish("asked the customer to wait")]),
            json!([]),
        )
        .await;
    let with_alternative = json!({"text": "Refunding in full, or 100 if nobody answers.",
        "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 500,
                                                             "_alternative": {"orderId": "1042", "amount": 100}}}]});
    w.standins
        .script(
            "alt",
            json!([with_alternative, finish("refunded 100")]),
            json!([]),
        )
        .await;
    w.standins
        .script(
            "esc",
            json!([refund(500), finish("refunded after escalation")]),
            json!([]),
        )
        .await;
    // The escalated Approval must outlast two plugin calls on a busy machine.
    let esc = json!({"expiresAfter": "6s", "onExpiry": "Escalate", "escalateTo": {"users": ["bob"]}, "maxEscalations": 1,
                     "approvers": {"users": ["alice"]}});
    for (name, rule) in [
        ("fail", quick("Fail")),
        ("back", quick("ReturnToAgent")),
        ("alt", quick("Alternative")),
        ("esc", esc),
    ] {
        w.create_run(
            name,
            json!({"input": "Refund.", "agent": gated_agent(&w, name, rule)}),
            json!({}),
        )
        .await;
    }

    let failed = w.wait_phase("fail", Phase::Failed).await;
    assert!(
        failed
            .status
            .unwrap()
            .error
            .unwrap()
            .contains("expired without a decision")
    );
    // No decision is taken after expiry.
    let api: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let mut listed = api
        .list(&ListParams::default().labels("agentrun.dev/run=fail"))
        .await
        .unwrap();
    let expired = listed.items.remove(0);
    let late = entry(
        "alice",
        "Approve",
        &expired.spec.arguments_hash,
        "sorry, late",
    );
    let msg = refusal(decide(&w, "alice", &expired.metadata.name.clone().unwrap(), late).await);
    assert!(msg.contains("already Expired"), "{msg}");
    w.wait_phase("back", Phase::Succeeded).await;
    let last = w
        .standins
        .model_requests("back")
        .await
        .pop()
        .unwrap()
        .to_string();
    assert!(last.contains("was not approved in time"), "{last}");
    w.wait_phase("alt", Phase::Succeeded).await;

    // Escalated to bob, with a fresh expiry; alice's turn is over.
    let escalated = common::wait_for("the escalated approval", TIMEOUT, || async {
        let api: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
        let list = api
            .list(&ListParams::default().labels("agentrun.dev/run=esc"))
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|a| a.spec.escalation == 1)
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    assert_eq!(escalated.spec.approvers.users, vec!["bob".to_string()]);
    let name = escalated.metadata.name.clone().unwrap();
    let (ok, text) = plugin(&w, "alice", &["approve", &name, "-m", "me too"]);
    assert!(!ok && text.contains("alice is not an approver"), "{text}");
    let (ok, text) = plugin(
        &w,
        "bob",
        &["approve", &name, "-m", "escalated to me; fine"],
    );
    assert!(ok, "{text}");
    w.wait_phase("esc", Phase::Succeeded).await;

    let effects = w.standins.effects(w.name()).await;
    let amounts: Vec<_> = effects
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .map(|e| e["args"]["amount"].clone())
        .collect();
    // Only the agent's safe alternative (100) and bob's approved call (500, once) ran; no expiry ran a 500 refund.
    assert_eq!(
        amounts.iter().filter(|a| **a == 100).count(),
        1,
        "{effects:?}"
    );
    assert_eq!(
        amounts.iter().filter(|a| **a == 500).count(),
        1,
        "{effects:?}"
    );
    assert_eq!(amounts.len(), 2, "{effects:?}");
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let esc_run = runs.get("esc").await.unwrap();
    let esc_log = w.log(&esc_run).await;
    assert_eq!(
        kinds(&esc_log)
            .iter()
            .filter(|k| **k == "ApprovalRequested")
            .count(),
        2
    );
}

#[tokio::test]
async fn a_changed_dependency_voids_the_approval_and_asks_again() {
    let w = World::new("stale", &[]).await;
    grant_approver_role(&w).await;
    let base = w.standins.base.clone();
    let record = format!("{base}/tools/{}/records/1042", w.name());
    let put = |data: Value| {
        let (http, url) = (w.standins.http.clone(), record.clone());
        async move {
            http.put(url)
                .json(&json!({"data": data}))
                .send()
                .await
                .unwrap()
        }
    };
    put(json!({"balance": 500})).await;
    w.standins
        .script("stale", json!([refund(500), finish("refunded")]), json!([]))
        .await;
    let rule = json!({"dependencies": [{"name": "order-1042", "lookup": format!("{base}/tools/{}/records/{{orderId}}", w.name())}]});
    w.create_run(
        "stale",
        json!({"input": "Refund.", "agent": gated_agent(&w, "stale", rule)}),
        json!({}),
    )
    .await;

    let first = pending_approval(&w, "stale").await;
    assert_eq!(first.spec.dependencies[0].name, "order-1042");
    let seen = first.spec.dependencies[0].version.clone();
    // The order changes after the approver looked at it.
    put(json!({"balance": 0, "refunded": true})).await;
    let name = first.metadata.name.clone().unwrap();
    let (ok, text) = plugin(&w, "alice", &["show", &name]);
    assert!(
        ok && text.contains("order-1042 at version") && text.contains("charged twice"),
        "{text}"
    );
    let (ok, text) = plugin(&w, "alice", &["approve", &name, "-m", "looks right"]);
    assert!(ok, "{text}");

    // The approval is void; a fresh request shows the new version.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let second = common::wait_for("a fresh approval", TIMEOUT, || async {
        let r = runs.get("stale").await.map_err(|e| e.to_string())?;
        let a = r.status.and_then(|s| s.approval).ok_or("no approval")?;
        if a.name == name {
            Err("still the first".to_string())
        } else {
            Ok(a.name)
        }
    })
    .await;
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "nothing ran on the stale approval"
    );
    let api: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let fresh = api.get(&second).await.unwrap();
    assert_ne!(fresh.spec.dependencies[0].version, seen);
    let (ok, text) = plugin(
        &w,
        "bob",
        &["approve", &second, "-m", "checked the new state"],
    );
    assert!(ok, "{text}");
    let run = w.wait_phase("stale", Phase::Succeeded).await;
    assert_eq!(w.standins.effects(w.name()).await.len(), 1);
    let log = w.log(&run).await;
    assert!(kinds(&log).contains(&"ApprovalVoided"), "{:?}", kinds(&log));

    // The audit trail, readable, and the chain checked against the run's status.
    let store = common::store::e2e_store_url().await;
    let (ok, text) = plugin(&w, "alice", &["log", "stale", "--store-url", &store]);
    assert!(
        ok && text.contains("approval voided: order-1042 changed")
            && text.contains("bob Approve (checked the new state)"),
        "{text}"
    );
    let (ok, text) = plugin(
        &w,
        "alice",
        &[
            "verify",
            "stale",
            "--store-url",
            &store,
            "--controller-namespace",
            w.name(),
        ],
    );
    assert!(
        ok && text.contains("chain intact") && text.contains("ApprovalDecided: signature valid"),
        "{text}"
    );
}

#[tokio::test]
async fn two_hundred_waiting_runs_hold_no_pod_and_survive_a_controller_restart() {
    let mut w = World::new("waiting", &[]).await;
    grant_approver_role(&w).await;
    const RUNS: usize = 200;
    // Every run's first model call proposes the same risky refund; the last run finishes after approval.
    let mut replies: Vec<Value> = (0..RUNS).map(|_| refund(500)).collect();
    replies.push(finish("refunded after the restart"));
    w.standins
        .script("many", Value::Array(replies), json!([]))
        .await;
    let agent = gated_agent(&w, "many", json!({}));
    for i in 0..RUNS {
        w.create_run(
            &format!("wait-{i:03}"),
            json!({"input": "Refund.", "agent": agent}),
            json!({}),
        )
        .await;
    }
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        "every run to await approval",
        Duration::from_secs(300),
        || async {
            let list = runs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let waiting = list
                .items
                .iter()
                .filter(|r| {
                    r.status.as_ref().and_then(|s| s.phase) == Some(Phase::AwaitingApproval)
                })
                .count();
            if waiting == RUNS {
                Ok(list)
            } else {
                Err(format!("{waiting} of {RUNS} waiting"))
            }
        },
    )
    .await;
    // No pod is held, not even an ended one: every step Job is removed with
    // its pod, and no run names a Job any more.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(w.client.clone(), w.name());
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        "no step Job, pod or Job name left",
        Duration::from_secs(120),
        || async {
            let all = ListParams::default();
            let pods = pods
                .list(&all)
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            let jobs = jobs
                .list(&all)
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            let named = runs
                .list(&all)
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .filter(|r| {
                    let step = r.status.as_ref().and_then(|s| s.step.as_ref());
                    step.is_some_and(|s| s.job.is_some())
                })
                .count();
            if pods + jobs + named == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{pods} pods, {jobs} Jobs, {named} runs naming a Job"
                ))
            }
        },
    )
    .await;
    // Objects stay small: a waiting run and its Approval are a few kilobytes.
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let all = approvals.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), RUNS);
    let biggest_approval = all
        .items
        .iter()
        .map(|a| serde_json::to_vec(a).unwrap().len())
        .max()
        .unwrap();
    let biggest_run = runs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|r| serde_json::to_vec(r).unwrap().len())
        .max()
        .unwrap();
    assert!(
        biggest_approval < 8 * 1024 && biggest_run < 12 * 1024,
        "approval {biggest_approval} B, run {biggest_run} B"
    );

    // The controller restarts while everything waits; a decision afterwards resumes the run.
    w.restart_controller().await;
    // A start is not a wake: every waiting run is looked at (one head read
    // each) and none of their logs is read until a decision wakes it.
    let port = w.metrics_port();
    let reads = |name| common::controller::metric(port, name);
    common::wait_for(
        "the new controller to read every waiting run's head",
        Duration::from_secs(120),
        || async {
            let heads = reads("agentrun_store_reads_total").await;
            heads
                .filter(|n| *n >= RUNS as f64)
                .ok_or_else(|| format!("{heads:?} store reads"))
        },
    )
    .await;
    assert_eq!(reads("agentrun_store_read_records_total").await, Some(0.0));
    assert_eq!(reads("agentrun_store_reads_total").await, Some(RUNS as f64));
    let last = format!("wait-{:03}", RUNS - 1);
    let a = pending_approval(&w, &last).await;
    let (ok, text) = plugin(
        &w,
        "alice",
        &[
            "approve",
            &a.metadata.name.clone().unwrap(),
            "-m",
            "after the restart",
        ],
    );
    assert!(ok, "{text}");
    let run = w.wait_phase(&last, Phase::Succeeded).await;
    assert_eq!(
        run.status.unwrap().result.as_deref(),
        Some("refunded after the restart")
    );
    assert_eq!(w.standins.effects(w.name()).await.len(), 1);
}

#[tokio::test]
async fn an_unknowable_outcome_asks_a_human_to_reconcile() {
    let w = World::new("reconcile", &[]).await;
    grant_approver_role(&w).await;
    let page = json!({"text": "Paging on-call.", "toolCalls": [{"name": "page_oncall", "arguments": {"why": "refund stuck"}}]});
    w.standins
        .script("rec", json!([page, finish("paged once")]), json!([]))
        .await;
    let mut agent = w.agent("rec");
    agent["approval"] = json!({"defaultApprovers": {"groups": ["finance-approvers"]}});
    // The worker dies after paging, before recording it: no key, no lookup, nobody can tell.
    let fp = json!({"agentrun.dev/failpoint": "after-tool-call"});
    w.create_run("rec", json!({"input": "Page on-call.", "agent": agent}), fp)
        .await;

    let a = pending_approval(&w, "rec").await;
    assert_eq!(a.spec.kind, agentrun::api::ApprovalKind::Reconcile);
    assert!(
        a.spec
            .observations
            .reason
            .clone()
            .unwrap_or_default()
            .contains("cannot be checked")
    );
    let (ok, text) = plugin(
        &w,
        "bob",
        &[
            "approve",
            &a.metadata.name.clone().unwrap(),
            "-m",
            "I got the page",
        ],
    );
    assert!(ok, "{text}");
    let run = w.wait_phase("rec", Phase::Succeeded).await;
    let pages = w
        .standins
        .effects(w.name())
        .await
        .iter()
        .filter(|e| e["tool"] == "page_oncall")
        .count();
    assert_eq!(pages, 1, "confirmed as done, the page was not sent again");
    let recovered = w.log(&run).await.iter().find_map(|(_, s)| match s {
        Entry::ToolResult(r) => r.recovery,
        _ => None,
    });
    assert_eq!(
        recovered,
        Some(agentrun::runlog::records::Recovery::HumanConfirmedDone)
    );
}
