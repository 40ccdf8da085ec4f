//! Upgrades and the watches an upgraded controller depends on (issue 25,
//! "Upgrades"): a watch whose list the API server refuses is reported (its
//! error logged, counted and named by `/readyz`) and recovers by itself once
//! allowed, never a silent wait. The upgrade from an earlier release, with
//! runs waiting, running and finished, is tests/e2e_upgrade.rs.

use std::time::Duration;

use agentrun::api::{AgentRun, Approval, Phase};
use agentrun::replay::Entry;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::{
    self,
    approvals::{decide, entry, gated_agent, grant_approver_role, pending_approval, refund},
    controller::http_get,
    world::{World, finish},
};

/// The controller's rules from the chart (charts/agentrun/templates/rbac.yaml),
/// without `agentpolicies`: what a chart whose RBAC lags the controller, or
/// a cluster admin's edit, leaves it with.
fn rules_without_agent_policies() -> Value {
    json!([
        {"apiGroups": ["agentrun.dev"], "resources": ["agentruns"], "verbs": ["list", "watch"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["agentruns/status"], "verbs": ["patch"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["agents"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["clusteragentpolicies"], "verbs": ["list", "watch"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["agents/status"], "verbs": ["patch"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["approvals"], "verbs": ["get", "list", "watch", "create"]},
        {"apiGroups": ["agentrun.dev"], "resources": ["approvals/status"], "verbs": ["patch"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    ])
}

/// A kubeconfig (JSON, which is YAML) acting as `user` through the admin's
/// credentials: the controller runs as that user and RBAC judges it.
fn kubeconfig_as(user: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let mut kc = kube::config::Kubeconfig::read().expect("KUBECONFIG");
    if kc.contexts.iter().any(|c| c.name == "admin") {
        kc.current_context = Some("admin".into());
    }
    for auth in &mut kc.auth_infos {
        if let Some(info) = auth.auth_info.as_mut() {
            info.impersonate = Some(user.to_string());
        }
    }
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_json::to_vec(&kc).unwrap()).unwrap();
    path
}

/// `/readyz` of the controller on `port`: (status, body); 0 while it does not answer.
async fn readyz(port: u16) -> (u16, String) {
    common::controller::try_http_request(port, "GET", "/readyz", "")
        .await
        .unwrap_or((0, String::new()))
}

/// `agentrun_watch_errors_total{watch="<watch>"}` on the controller's /metrics.
async fn watch_errors(port: u16, watch: &str) -> f64 {
    let (_, text) = http_get(port, "/metrics").await;
    let prefix = format!("agentrun_watch_errors_total{{watch=\"{watch}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `agentrun_watch_listed{watch="<watch>"}` on the controller's /metrics.
async fn listed(port: u16, watch: &str) -> Option<f64> {
    let (_, text) = http_get(port, "/metrics").await;
    let prefix = format!("agentrun_watch_listed{{watch=\"{watch}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

#[tokio::test]
async fn a_policy_watch_refused_by_rbac_says_why_and_recovers_when_allowed() {
    let admin = common::admin().await;
    let user = common::unique_name("agentrun-e2e-controller");
    // Cluster-wide rules for the controller's own user (unique per test).
    let roles: Api<ClusterRole> = Api::all(admin.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    roles
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": user}, "rules": rules_without_agent_policies()
            }))
            .unwrap(),
        )
        .await
        .expect("ClusterRole");
    bindings
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": user},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
                "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}]
            }))
            .unwrap(),
        )
        .await
        .expect("ClusterRoleBinding");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig_as(&user, dir.path());
    let w = World::with_controller_env(
        "tr-watch",
        &[],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    )
    .await;
    let port = w.metrics_port();

    // The platform's policies cannot be listed: /readyz says so, soon.
    let why = common::wait_for(
        "/readyz to name the refused policy watch",
        Duration::from_secs(10),
        || async {
            let (code, body) = readyz(port).await;
            (code == 503
                && body.contains("agentpolicies: not listed yet")
                && body.contains("forbidden"))
            .then_some(body.clone())
            .ok_or(format!("{code} {body}"))
        },
    )
    .await;
    assert!(
        why.contains(&user),
        "the reason names who was refused: {why}"
    );
    assert!(
        watch_errors(port, "agentpolicies").await >= 1.0,
        "the refused list is counted"
    );
    // The namespace admin grants the missing rule: the watch lists.
    let ns = w.name();
    let ns_roles: Api<Role> = Api::namespaced(admin.clone(), ns);
    ns_roles
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "read-policies"},
                "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentpolicies"], "verbs": ["list", "watch"]}]
            }))
            .unwrap(),
        )
        .await
        .expect("Role");
    let ns_bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), ns);
    ns_bindings
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "read-policies"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-policies"},
                "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}]
            }))
            .unwrap(),
        )
        .await
        .expect("RoleBinding");
    // Within the watch's backoff (at most 30 s between retries).
    // Its watches listed, the controller acts (its status writes are the
    // chart's identity's only, so this test's user stops here).
    common::wait_for("/readyz to recover", Duration::from_secs(60), || async {
        let (code, body) = readyz(port).await;
        let runs = listed(port, "agentruns").await;
        (code == 200 && runs == Some(1.0))
            .then_some(())
            .ok_or(format!("{code} {body}; agentruns listed: {runs:?}"))
    })
    .await;
    assert_eq!(listed(port, "agentpolicies").await, Some(1.0));

    let _ = bindings.delete(&user, &DeleteParams::default()).await;
    let _ = roles.delete(&user, &DeleteParams::default()).await;
}

/// What an earlier release left of a run waiting for approval: its Approval
/// under that release's name (its spec, owner and label as raised), and the
/// run's status pointing to it. Played with the controller stopped.
async fn as_an_earlier_release_named_it(w: &World, run: &str, approval: &Approval, old: &str) {
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let name = approval.metadata.name.clone().unwrap();
    approvals
        .delete(&name, &DeleteParams::default())
        .await
        .expect("deleting the Approval");
    let mut earlier = Approval::new(old, approval.spec.clone());
    earlier.metadata.namespace = approval.metadata.namespace.clone();
    earlier.metadata.labels = approval.metadata.labels.clone();
    earlier.metadata.owner_references = approval.metadata.owner_references.clone();
    approvals
        .create(&PostParams::default(), &earlier)
        .await
        .expect("the earlier release's Approval");
    let status = json!({"status": {"state": "Pending"}});
    approvals
        .patch_status(old, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("its status");
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let pointer = json!({"status": {"approval": {"name": old}}});
    runs.patch_status(run, &PatchParams::default(), &Patch::Merge(&pointer))
        .await
        .expect("the run's status points to it");
}

#[tokio::test]
async fn a_waiting_run_continues_on_the_approval_an_earlier_release_raised() {
    let mut w = World::new("tr-adopt", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script("adopt", json!([refund(500), finish("refunded")]), json!([]))
        .await;
    let run = "waits-across-upgrade";
    w.create_run(
        run,
        json!({"input": "Refund.", "agent": gated_agent(&w, "adopt", json!({}))}),
        json!({}),
    )
    .await;
    let raised = pending_approval(&w, run).await;
    w.stop_controller();
    let old = format!("{run}-approval-{}", raised.spec.step);
    as_an_earlier_release_named_it(&w, run, &raised, &old).await;

    // The upgraded controller starts; the approver decides on the Approval
    // in front of her, the earlier release's.
    w.restart_controller().await;
    decide(
        &w,
        "alice",
        &old,
        entry("alice", "Approve", &raised.spec.arguments_hash, "ok"),
    )
    .await
    .expect("alice approves");
    let done = w.wait_phase(run, Phase::Succeeded).await;

    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let names: Vec<String> = approvals
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|a| a.metadata.name)
        .collect();
    assert_eq!(names, vec![old.clone()], "no second Approval beside it");
    let decided = approvals.get(&old).await.unwrap();
    assert_eq!(
        decided.status.and_then(|s| s.state),
        Some(agentrun::api::ApprovalState::Approved)
    );
    let log: Vec<Entry> = w.log(&done).await.into_iter().map(|(_, s)| s).collect();
    let decisions: Vec<&str> = log
        .iter()
        .filter_map(|s| match s {
            Entry::ApprovalDecided(d) => Some(d.approval.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        decisions,
        vec![old.as_str()],
        "the log names the Approval decided"
    );
    let refunds: Vec<Value> = w
        .standins
        .effects(w.name())
        .await
        .into_iter()
        .filter(|e| e["tool"] == "issue_refund")
        .map(|e| e["args"]["amount"].clone())
        .collect();
    assert_eq!(refunds, vec![json!(500)], "refunded once");
}
