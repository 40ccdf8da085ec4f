//! What the approval suites share: a gated refund agent, waiting for an
//! Approval, deciding as a user, and reading a refusal.

use agentrun::api::{AgentRun, Approval, Phase};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::world::{TIMEOUT, World};

/// The agent of these tests: refunds over 100 need a finance approver.
pub fn gated_agent(w: &World, script: &str, rule: Value) -> Value {
    let mut agent = w.agent(script);
    let mut r = json!({
        "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
        "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m", "onExpiry": "Fail"
    });
    if let (Some(base), Some(extra)) = (r.as_object_mut(), rule.as_object()) {
        base.extend(extra.clone());
    }
    agent["approval"] = json!({"rules": [r]});
    agent
}

pub fn refund(amount: u64) -> Value {
    json!({"text": format!("The customer was charged twice; refunding {amount}."),
           "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": amount}}]})
}

/// Scripts the model's `replies` as script `run`, creates run `run` with
/// the gated refund agent, and returns the Approval it waits on.
pub async fn gated_refund_approval(w: &World, run: &str, replies: Value) -> Approval {
    w.standins.script(run, replies, json!([])).await;
    w.create_run(
        run,
        json!({"input": "Refund order 1042.", "agent": gated_agent(w, run, json!({}))}),
        json!({}),
    )
    .await;
    pending_approval(w, run).await
}

/// Waits for run `run` in `ns` to wait on an Approval; returns its name.
pub async fn awaited_approval(client: &kube::Client, ns: &str, run: &str) -> String {
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), ns);
    super::wait_for(&format!("{run} to await approval"), TIMEOUT, || async {
        let r = runs.get(run).await.map_err(|e| e.to_string())?;
        let s = r.status.clone().unwrap_or_default();
        match (s.phase, s.approval) {
            (Some(Phase::AwaitingApproval), Some(a)) => Ok(a.name),
            _ => Err(format!("{:?}", r.status)),
        }
    })
    .await
}

/// Waits for the run to wait on an Approval and returns it.
pub async fn pending_approval(w: &World, run: &str) -> Approval {
    let name = awaited_approval(&w.client, w.name(), run).await;
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    approvals.get(&name).await.expect("the Approval exists")
}

/// What a chart user does: binds the approver ClusterRole `role` to group
/// finance-approvers in `ns`; then alice, once she can read it, approves
/// `approval` for the arguments it shows.
pub async fn approve_as_alice_through_role(
    client: &kube::Client,
    ns: &str,
    role: &str,
    approval: &str,
    reason: &str,
) {
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "finance-approvers"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "finance-approvers"}]
    }))
    .unwrap();
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(client.clone(), ns)
        .create(&Default::default(), &binding)
        .await
        .expect("binding the approver role");
    let as_alice: Api<Approval> = Api::namespaced(super::client_as("alice").await, ns);
    let read = super::wait_for("alice to read the Approval", TIMEOUT, || async {
        as_alice.get(approval).await
    })
    .await;
    let decision: json_patch::Patch = serde_json::from_value(json!([{
        "op": "add", "path": "/spec/decisions/-",
        "value": entry("alice", "Approve", &read.spec.arguments_hash, reason)
    }]))
    .unwrap();
    as_alice
        .patch(
            approval,
            &PatchParams::default(),
            &Patch::<()>::Json(decision),
        )
        .await
        .expect("alice approves through the approver role");
}

/// Adds a decision to an Approval as `user` (what `kubectl agentrun approve` does).
pub async fn decide(
    w: &World,
    user: &str,
    approval: &str,
    entry: Value,
) -> Result<Approval, kube::Error> {
    decide_in(w.name(), user, approval, entry).await
}

/// [`decide`] in namespace `ns`.
pub async fn decide_in(
    ns: &str,
    user: &str,
    approval: &str,
    entry: Value,
) -> Result<Approval, kube::Error> {
    let api: Api<Approval> = Api::namespaced(super::client_as(user).await, ns);
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "add", "path": "/spec/decisions/-", "value": entry}]))
            .unwrap();
    api.patch(approval, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
}

pub fn entry(approver: &str, verdict: &str, hash: &str, reason: &str) -> Value {
    json!({"approver": approver, "verdict": verdict, "argumentsHash": hash, "reason": reason})
}

/// Lets alice, bob and carol read and decide approvals in the test namespace.
pub async fn grant_approver_role(w: &World) {
    grant_approver_role_in(&w.client, w.name()).await
}

/// [`grant_approver_role`] in namespace `ns`.
pub async fn grant_approver_role_in(client: &kube::Client, ns: &str) {
    let rb = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "approvers", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agentrun-approver"},
        "subjects": [
            {"kind": "Group", "name": "finance-approvers", "apiGroup": "rbac.authorization.k8s.io"},
            {"kind": "User", "name": "carol", "apiGroup": "rbac.authorization.k8s.io"}
        ]
    });
    let api: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(client.clone(), ns);
    api.create(&Default::default(), &serde_json::from_value(rb).unwrap())
        .await
        .expect("RoleBinding");
}

/// The API server's message for a request it refused (panics if it accepted).
pub fn refusal<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> String {
    match result {
        Ok(v) => panic!("the API server accepted what it must refuse: {v:?}"),
        Err(kube::Error::Api(e)) => e.message,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// Runs `kubectl agentrun ARGS` as `user` in the test namespace.
pub fn plugin(w: &World, user: &str, args: &[&str]) -> (bool, String) {
    let mut cmd = std::process::Command::new(super::binary("kubectl-agentrun"));
    cmd.args(["-n", w.name()]);
    if super::existing_cluster() {
        cmd.args(["--as", user]);
        if user != "carol" {
            cmd.args(["--as-group", "finance-approvers"]);
        }
    } else {
        cmd.args(["--context", user]);
    }
    let out = cmd.args(args).output().expect("running kubectl-agentrun");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Step pods of `run` in the world's namespace not yet ended.
pub async fn live_step_pods(w: &World, run: &str) -> usize {
    live_step_pods_in(&w.client, w.name(), run).await
}

/// [`live_step_pods`] in namespace `ns`.
pub async fn live_step_pods_in(client: &kube::Client, ns: &str, run: &str) -> usize {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&kube::api::ListParams::default().labels(&format!("agentrun.dev/run={run}")))
        .await
        .unwrap();
    list.items
        .iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .count()
}
