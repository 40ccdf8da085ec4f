//! Trust attacks on the time of a decision (issue 25): the controller judges
//! a quorum at the time the API server recorded it (the `managedFields`
//! entries owning `spec.decisions`), so an approver who decided after the
//! expiry must not be able to move that time, nor anyone else to write the
//! state the controller reports. Played as alice (group finance-approvers)
//! and as a namespace admin with every verb on Approvals and runs.

use agentrun::api::{AgentRun, Approval, Phase};
use agentrun::replay::Entry;
use agentrun::runlog::records::Verdict;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::common::{
    self,
    approvals::{
        decide, entry, gated_agent, grant_approver_role, pending_approval, refund, refusal,
    },
    world::{TIMEOUT, World, finish},
};

/// Waits until the wall clock is past `at` (plus a second, the precision of
/// the API server's timestamps).
async fn wait_until_past(at: std::time::SystemTime) {
    let past = at + std::time::Duration::from_secs(1);
    common::wait_for("the expiry to pass", TIMEOUT, || async {
        let now = std::time::SystemTime::now();
        (now > past).then_some(())
    })
    .await
}

#[tokio::test]
async fn a_late_decision_cannot_be_back_dated_through_managed_fields() {
    let mut w = World::new("tr-backdate", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "backdate",
            json!([refund(500), finish("refunded")]),
            json!([]),
        )
        .await;
    let rule = json!({"expiresAfter": "5s", "onExpiry": "Fail"});
    w.create_run(
        "backdate",
        json!({"input": "Refund.", "agent": gated_agent(&w, "backdate", rule)}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "backdate").await;
    let name = a.metadata.name.clone().unwrap();
    let created = a.metadata.creation_timestamp.clone().unwrap();

    // The controller is down (an upgrade, a crash): nobody marks the
    // Approval expired, so the policy still takes a decision after expiry.
    w.stop_controller();
    wait_until_past(a.spec.expires_at.0.into()).await;
    decide(
        &w,
        "alice",
        &name,
        entry("alice", "Approve", &a.spec.arguments_hash, "late, but..."),
    )
    .await
    .expect("a decision on a Pending Approval is taken; its time says it is late");

    // alice rewrites the time (and the manager) of her decision's entry.
    let as_alice: Api<Approval> = Api::namespaced(common::client_as("alice").await, w.name());
    let decided = as_alice.get(&name).await.unwrap();
    let mut fields =
        serde_json::to_value(decided.metadata.managed_fields.clone().unwrap()).unwrap();
    for m in fields.as_array_mut().unwrap() {
        if m.pointer("/fieldsV1/f:spec/f:decisions").is_some() {
            m["time"] = json!(created.0.to_string());
            m["manager"] = json!("agentrun-controller");
        }
    }
    let backdate = json!({"metadata": {"managedFields": fields}});
    let msg = refusal(
        as_alice
            .patch(&name, &PatchParams::default(), &Patch::Merge(&backdate))
            .await,
    );
    assert!(msg.contains("metadata.managedFields"), "{msg}");
    // Nor can they be reset (an empty entry list makes the server forget
    // every owner, and with them the time of every decision).
    let reset = json!({"metadata": {"managedFields": [{}]}});
    let msg = refusal(
        as_alice
            .patch(&name, &PatchParams::default(), &Patch::Merge(&reset))
            .await,
    );
    assert!(msg.contains("metadata.managedFields"), "{msg}");

    // The controller comes back and judges the decision at its real time.
    w.restart_controller().await;
    let run = w.wait_phase("backdate", Phase::Failed).await;
    let error = run.status.and_then(|s| s.error).unwrap_or_default();
    assert!(error.contains("expired"), "{error}");
    let refunds = w
        .standins
        .effects(w.name())
        .await
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .count();
    assert_eq!(refunds, 0, "a late approval refunded");
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let log = w.log(&runs.get("backdate").await.unwrap()).await;
    assert!(
        log.iter()
            .any(|(_, s)| matches!(s, Entry::ApprovalDecided(d) if d.verdict == Verdict::Expired)),
        "{:?}",
        super::common::world::kinds(&log)
    );
}

#[tokio::test]
async fn only_the_controller_writes_the_status_of_runs_and_approvals() {
    let w = World::new("tr-status", &[]).await;
    grant_approver_role(&w).await;
    // A careless namespace admin: every verb on every agentrun.dev resource,
    // subresources included.
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "agentrun-admin", "namespace": w.name()},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["*", "*/status"], "verbs": ["*"]}]
    });
    let rb = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "agentrun-admin", "namespace": w.name()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "agentrun-admin"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]
    });
    Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(w.client.clone(), w.name())
        .create(&Default::default(), &serde_json::from_value(role).unwrap())
        .await
        .unwrap();
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(w.client.clone(), w.name())
        .create(&Default::default(), &serde_json::from_value(rb).unwrap())
        .await
        .unwrap();
    w.standins
        .script("st", json!([refund(500), finish("refunded")]), json!([]))
        .await;
    w.create_run(
        "st",
        json!({"input": "Refund.", "agent": gated_agent(&w, "st", json!({}))}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "st").await;
    let name = a.metadata.name.clone().unwrap();

    let client = common::client_as("alice").await;
    let approvals: Api<Approval> = Api::namespaced(client.clone(), w.name());
    // RBAC lets alice read the status subresource: what stops her is the policy.
    let msg = refusal(
        approvals
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"state": "Approved"}})),
            )
            .await,
    );
    assert!(
        msg.contains("written by the agentrun controller only"),
        "{msg}"
    );
    let runs: Api<AgentRun> = Api::namespaced(client, w.name());
    let msg = refusal(
        runs.patch_status(
            "st",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"phase": "Succeeded"}})),
        )
        .await,
    );
    assert!(
        msg.contains("written by the agentrun controller only"),
        "{msg}"
    );

    // The run still waits, on the same Approval, and goes on when decided.
    let admin_runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let run = admin_runs.get("st").await.unwrap();
    assert_eq!(run.status.unwrap().phase, Some(Phase::AwaitingApproval));
    decide(
        &w,
        "bob",
        &name,
        entry("bob", "Approve", &a.spec.arguments_hash, "ok"),
    )
    .await
    .unwrap();
    w.wait_phase("st", Phase::Succeeded).await;
}
