//! Upgrades and the watches an upgraded controller depends on (issue 25,
//! "Upgrades"): a watch whose list the API server refuses is reported (its
//! error logged, counted and named by `/readyz`) and recovers by itself once
//! allowed, never a silent wait. The upgrade from an earlier release, with
//! runs waiting, running and finished, is tests/e2e_upgrade.rs.

use std::time::Duration;

use agentrun::api::Phase;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams};
use serde_json::{Value, json};

use super::common::{
    self,
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
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "delete"]},
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
    // A run created meanwhile waits: nothing runs unjudged by the platform.
    w.standins
        .script("watch", json!([finish("done")]), json!([]))
        .await;
    w.create_run(
        "while-refused",
        json!({"input": "Say done.", "agent": w.agent("watch")}),
        json!({}),
    )
    .await;

    // The namespace admin grants the missing rule: the watch lists, the run runs.
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
    common::wait_for("/readyz to recover", Duration::from_secs(60), || async {
        let (code, body) = readyz(port).await;
        (code == 200).then_some(()).ok_or(format!("{code} {body}"))
    })
    .await;
    w.wait_phase("while-refused", Phase::Succeeded).await;

    let _ = bindings.delete(&user, &DeleteParams::default()).await;
    let _ = roles.delete(&user, &DeleteParams::default()).await;
}
