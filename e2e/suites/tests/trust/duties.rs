//! Separation of duties by person, not by name (issue 39): under
//! `separationOfDuties`, whoever could act as the run's requester may not
//! decide its approvals. alice administers her namespace (she may start pods
//! and mint ServiceAccount tokens there): a run created by its pipeline
//! ServiceAccount is hers to create, so not hers to approve. bob may
//! impersonate dave: dave's run is not bob's to approve. Played as each
//! user against the API server's admission policy.

use agentrun::api::{AgentRun, Phase};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::common::{
    self,
    approvals::{
        decide, entry, gated_agent, grant_approver_role, pending_approval, refund, refusal,
    },
    world::{World, finish},
};

/// Creates `kind` objects (RBAC, ServiceAccounts) from JSON as the admin.
async fn apply(w: &World, manifest: Value) {
    let path = std::env::temp_dir().join(format!(
        "duties-{}-{}.json",
        w.name(),
        manifest["metadata"]["name"].as_str().unwrap()
    ));
    std::fs::write(&path, manifest.to_string()).unwrap();
    common::kubectl(&["apply", "-n", w.name(), "-f", path.to_str().unwrap()]);
}

/// Lets `subject` create and read AgentRuns in the world's namespace.
async fn may_create_runs(w: &World, name: &str, subject: Value) {
    apply(
        w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "run-creator"},
               "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"],
                          "verbs": ["create", "get", "list", "watch"]}]}),
    )
    .await;
    apply(
        w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "run-creator"},
               "subjects": [subject]}),
    )
    .await;
}

/// Creates run `name` (a refund of 500 that waits for finance, separation
/// of duties on) as `creator`.
async fn gated_run_as(w: &World, creator: kube::Client, name: &str) {
    w.standins
        .script(name, json!([refund(500), finish("done")]), json!([]))
        .await;
    let mut agent = gated_agent(w, name, json!({}));
    agent["approval"]["separationOfDuties"] = json!(true);
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name},
        "spec": {"input": "Refund order 1042.", "agent": agent}
    }))
    .unwrap();
    Api::<AgentRun>::namespaced(creator, w.name())
        .create(&PostParams::default(), &run)
        .await
        .unwrap_or_else(|e| panic!("creating run {name}: {e}"));
}

#[tokio::test]
async fn whoever_could_act_as_the_requester_may_not_approve_under_separation_of_duties() {
    let w = World::new("trust-duties", &[]).await;
    grant_approver_role(&w).await;
    let ns = w.name().to_string();
    // alice administers the namespace (she may start pods there: what the
    // built-in admin and edit roles allow; written out, since the
    // aggregated roles are filled by a controller a cluster may not run);
    // the pipeline ServiceAccount creates runs.
    apply(
        &w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "workloads"},
               "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list"]}]}),
    )
    .await;
    apply(
        &w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "alice-admin"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "workloads"},
               "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]}),
    )
    .await;
    apply(
        &w,
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "pipeline"}}),
    )
    .await;
    may_create_runs(
        &w,
        "pipeline-runs",
        json!({"kind": "ServiceAccount", "name": "pipeline", "namespace": ns}),
    )
    .await;
    let pipeline = format!("system:serviceaccount:{ns}:pipeline");
    gated_run_as(
        &w,
        common::client_impersonating(&pipeline, Vec::new()).await,
        "by-pipeline",
    )
    .await;
    let a = pending_approval(&w, "by-pipeline").await;
    assert_eq!(a.spec.requester.as_deref(), Some(pipeline.as_str()));
    let (name, hash) = (
        a.metadata.name.clone().unwrap(),
        a.spec.arguments_hash.clone(),
    );
    let msg = refusal(decide(&w, "alice", &name, entry("alice", "Approve", &hash, "mine")).await);
    assert!(
        msg.contains("separation of duties") && msg.contains("starting a pod"),
        "{msg}"
    );
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "the refund ran on alice's word"
    );
    // bob cannot act as the pipeline: his approval counts.
    decide(&w, "bob", &name, entry("bob", "Approve", &hash, "ok"))
        .await
        .expect("bob approves");
    w.wait_phase("by-pipeline", Phase::Succeeded).await;

    // bob may impersonate dave: dave's run is not bob's to approve.
    apply(
        &w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": format!("{ns}-impersonate-dave")},
               "rules": [{"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"],
                          "resourceNames": ["dave"]}]}),
    )
    .await;
    apply(
        &w,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": format!("{ns}-bob-as-dave")},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": format!("{ns}-impersonate-dave")},
               "subjects": [{"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}]}),
    )
    .await;
    may_create_runs(
        &w,
        "dave-runs",
        json!({"kind": "User", "name": "dave", "apiGroup": "rbac.authorization.k8s.io"}),
    )
    .await;
    gated_run_as(
        &w,
        common::client_impersonating("dave", Vec::new()).await,
        "by-dave",
    )
    .await;
    let a = pending_approval(&w, "by-dave").await;
    assert_eq!(a.spec.requester.as_deref(), Some("dave"));
    let (name, hash) = (
        a.metadata.name.clone().unwrap(),
        a.spec.arguments_hash.clone(),
    );
    let msg = refusal(decide(&w, "bob", &name, entry("bob", "Approve", &hash, "for dave")).await);
    assert!(msg.contains("separation of duties"), "{msg}");
    // alice administers the namespace but cannot act as dave.
    decide(&w, "alice", &name, entry("alice", "Approve", &hash, "ok"))
        .await
        .expect("alice approves dave's run");
    w.wait_phase("by-dave", Phase::Succeeded).await;
    common::kubectl(&["delete", "clusterrolebinding", &format!("{ns}-bob-as-dave")]);
    common::kubectl(&["delete", "clusterrole", &format!("{ns}-impersonate-dave")]);
}
