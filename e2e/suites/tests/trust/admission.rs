//! What the API server and the controller refuse a run creator, an agent
//! author or a namespace user: a forged or missing requester, a policy
//! changed under a running run, a condition that would crash the
//! controller, a Secret the platform did not opt in, an inline agent where
//! the platform forbids them, a metadata address, a name too long to label.

use agentrun::api::{Agent, AgentRun, Approval, Phase};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::approvals::refusal;
use super::common::world::{TIMEOUT, World, call, finish};
use super::common::{self, client_as, wait_for};

const REQUESTER: &str = "agentrun.dev/requester";

/// Lets `user` create, read and change runs in the test namespace.
async fn grant_run_creator(w: &World, user: &str) {
    let name = format!("{}-run-creator", w.name());
    let cr = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns", "agents"],
                   "verbs": ["create", "get", "list", "patch", "update"]}]});
    let crs: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(w.client.clone());
    crs.patch(
        &name,
        &PatchParams::apply("e2e").force(),
        &Patch::Apply(&cr),
    )
    .await
    .expect("run creator ClusterRole");
    let rb = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": format!("{user}-runs"), "namespace": w.name()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}]});
    let rbs: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(w.client.clone(), w.name());
    rbs.patch(
        &format!("{user}-runs"),
        &PatchParams::apply("e2e").force(),
        &Patch::Apply(&rb),
    )
    .await
    .expect("run creator RoleBinding");
}

fn run(name: &str, agent: Value, annotations: Value) -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"input": "Refund order 1042.", "agent": agent}
    }))
    .expect("run manifest")
}

/// The run's error once it failed, with no Job ever created for it.
async fn failed_without_a_job(w: &World, name: &str) -> String {
    let run = w.wait_phase(name, Phase::Failed).await;
    let jobs: Api<Job> = Api::namespaced(w.client.clone(), w.name());
    let mine = jobs
        .list(&ListParams::default().labels(&format!("agentrun.dev/run={name}")))
        .await
        .expect("jobs");
    assert!(mine.items.is_empty(), "a Job was created for {name}");
    run.status.and_then(|s| s.error).unwrap_or_default()
}

/// Why the run waits for the platform, once it does, with no Job created.
async fn waiting_without_a_job(w: &World, name: &str) -> String {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let why = common::wait_for(&format!("{name} to wait for a policy"), TIMEOUT, || async {
        let r = runs.get(name).await.map_err(|e| e.to_string())?;
        let s = r.status.unwrap_or_default();
        match s.conditions.iter().find(|c| c.type_ == "Allowed") {
            Some(c) if c.status == "False" && s.phase == Some(Phase::Pending) => {
                Ok(c.message.clone())
            }
            _ => Err(format!("{s:?}")),
        }
    })
    .await;
    let jobs: Api<Job> = Api::namespaced(w.client.clone(), w.name());
    let mine = jobs
        .list(&ListParams::default().labels(&format!("agentrun.dev/run={name}")))
        .await
        .expect("jobs");
    assert!(mine.items.is_empty(), "a Job was created for {name}");
    why
}

#[tokio::test]
async fn a_runs_requester_is_its_authenticated_creator_and_never_changes() {
    let w = World::new("requester", &[]).await;
    grant_run_creator(&w, "carol").await;
    let as_carol: Api<AgentRun> = Api::namespaced(client_as("carol").await, w.name());
    let agent = w.agent("requester");

    // Naming someone else is refused, whoever asks.
    let msg = refusal(
        as_carol
            .create(
                &PostParams::default(),
                &run("forged", agent.clone(), json!({REQUESTER: "alice"})),
            )
            .await,
    );
    assert!(msg.contains("must be your own user name (carol)"), "{msg}");

    // Omitting it: stamped from the request where the API server can mutate,
    // refused with a clear message where it cannot.
    let created = as_carol
        .create(
            &PostParams::default(),
            &run("plain", agent.clone(), json!({})),
        )
        .await;
    if common::serves_mutating_policies(&w.client).await {
        let created = created.expect("a run without a requester is accepted and stamped");
        assert_eq!(
            created.annotations().get(REQUESTER).map(String::as_str),
            Some("carol")
        );
    } else {
        let msg = refusal(created);
        assert!(msg.contains("is required"), "{msg}");
        // Her own name and groups (one a line), as the API server sees them.
        use k8s_openapi::api::authentication::v1::SelfSubjectReview;
        let review = Api::<SelfSubjectReview>::all(client_as("carol").await)
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
            .expect("carol asks who she is");
        let groups = review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.groups)
            .unwrap_or_default()
            .join("\n");
        let own = json!({REQUESTER: "carol", agentrun::api::REQUESTER_GROUPS_ANNOTATION: groups});
        as_carol
            .create(&PostParams::default(), &run("plain", agent.clone(), own))
            .await
            .expect("carol's own run");
    }

    // It never changes: neither to someone else nor away.
    let msg = refusal(
        as_carol
            .patch(
                "plain",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {REQUESTER: "alice"}}})),
            )
            .await,
    );
    assert!(msg.contains("cannot change"), "{msg}");
    let _ = as_carol
        .patch(
            "plain",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {REQUESTER: null}}})),
        )
        .await;
    let now = as_carol.get("plain").await.expect("the run");
    assert_eq!(
        now.annotations().get(REQUESTER).map(String::as_str),
        Some("carol")
    );

    // Nor does the agent (and its policy) under a running run.
    let msg = refusal(as_carol
            .patch(
                "plain",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"agent": {"approval": null, "prompt": {"version": "v2", "system": "x"}}}})),
            )
            .await);
    assert!(msg.contains("spec.agent is immutable"), "{msg}");
    let msg = refusal(
        as_carol
            .patch(
                "plain",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"agent": null, "agentRef": {"name": "other"}}})),
            )
            .await,
    );
    assert!(msg.contains("immutable"), "{msg}");

    // A name too long for the label it becomes is refused up front.
    let long = "r".repeat(64);
    let msg = refusal(
        as_carol
            .create(&PostParams::default(), &run(&long, agent, json!({})))
            .await,
    );
    assert!(msg.contains("metadata.name must be at most 63"), "{msg}");
}

#[tokio::test]
async fn an_agent_authors_condition_can_neither_crash_nor_stall_the_controller() {
    let w = World::new("cel-bomb", &[]).await;
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let with_condition = |name: &str, when: String| -> Agent {
        let mut spec = w.agent("cel");
        spec["approval"] = json!({"rules": [{"name": "r", "tool": "issue_refund", "when": when,
            "approvers": {"users": ["alice"]}}]});
        serde_json::from_value(
            json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
            "metadata": {"name": name}, "spec": spec}),
        )
        .expect("agent")
    };
    // Too long: the API server refuses it.
    let huge = format!("{}true{}", "(".repeat(3000), ")".repeat(3000));
    let msg = refusal(
        agents
            .create(&PostParams::default(), &with_condition("huge", huge))
            .await,
    );
    assert!(msg.contains("spec.approval.rules[0].when"), "{msg}");
    // Within the length but nested past the bound: the Agent says why, the
    // controller lives on.
    let deep = format!("{}args.amount > 1{}", "(".repeat(400), ")".repeat(400));
    agents
        .create(
            &PostParams::default(),
            &with_condition("deep", deep.clone()),
        )
        .await
        .expect("a deep condition within the length limit is stored");
    wait_for("the deep Agent to be not Ready", TIMEOUT, || async {
        let a = agents.get("deep").await.map_err(|e| e.to_string())?;
        let ready = a
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready").cloned());
        match ready {
            Some(c) if c.status == "False" && c.message.contains("spec.approval.rules[0].when") => {
                Ok(c)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // A run whose call meets the condition: judged fail-closed (it asks), never crashes.
    w.standins
        .script(
            "cel",
            json!([
                call("issue_refund", json!({"orderId": "1042", "amount": 5})),
                finish("done")
            ]),
            json!([]),
        )
        .await;
    let mut spec = w.agent("cel");
    spec["approval"] = json!({"rules": [{"name": "r", "tool": "issue_refund", "when": deep,
        "approvers": {"users": ["alice"]}, "expiresAfter": "10m"}]});
    w.create_run(
        "bomb",
        json!({"input": "Refund.", "agent": spec}),
        json!({}),
    )
    .await;
    w.wait_phase("bomb", Phase::AwaitingApproval).await;
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "the gated call ran"
    );
    assert_eq!(w.controller_healthz().await, 200, "the controller is down");
}

#[tokio::test]
async fn secrets_reach_a_step_pod_only_when_the_platform_opted_them_in() {
    let w = World::new("secrets", &[]).await;
    let secrets: Api<Secret> = Api::namespaced(w.client.clone(), w.name());
    for name in ["db-password", "restricted-key"] {
        let s: Secret = serde_json::from_value(json!({"metadata": {"name": name},
            "stringData": {"apiKey": "s3cret"}}))
        .expect("secret");
        secrets
            .create(&PostParams::default(), &s)
            .await
            .expect("secret");
    }
    // restricted-key may only go to the real provider.
    let policies: Api<agentrun::api::AgentPolicy> = Api::namespaced(w.client.clone(), w.name());
    let restricted: agentrun::api::AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "restricted"},
        "spec": {"allowedSecrets": [{"name": "restricted-key", "endpoints": ["https://api.openai.com/"]}]}
    }))
    .expect("policy");
    policies
        .create(&PostParams::default(), &restricted)
        .await
        .expect("policy");
    w.standins
        .script("exfil", json!([finish("never")]), json!([]))
        .await;

    let mut borrow = w.agent("exfil");
    borrow["model"]["secretRef"] = json!({"name": "db-password", "key": "apiKey"});
    w.create_run("borrow", json!({"input": "x", "agent": borrow}), json!({}))
        .await;
    // Not listed (yet): the run waits for a policy that lists it, with no
    // Job (a later AgentPolicy could still allow it; only the platform
    // owner can write one).
    let why = waiting_without_a_job(&w, "borrow").await;
    assert!(why.starts_with("spec.model.secretRef"), "{why}");
    assert!(why.contains("db-password"), "{why}");

    let mut elsewhere = w.agent("exfil");
    elsewhere["model"]["secretRef"] = json!({"name": "restricted-key", "key": "apiKey"});
    w.create_run(
        "elsewhere",
        json!({"input": "x", "agent": elsewhere}),
        json!({}),
    )
    .await;
    let err = failed_without_a_job(&w, "elsewhere").await;
    assert!(err.starts_with("spec.model.endpoint"), "{err}");

    assert!(
        w.standins.model_requests("exfil").await.is_empty(),
        "a refused run reached the model endpoint"
    );
}

#[tokio::test]
async fn the_platform_policy_judges_every_run_and_can_forbid_inline_agents() {
    let w = World::new("platform", &[]).await;
    let policies: Api<agentrun::api::AgentPolicy> = Api::namespaced(w.client.clone(), w.name());
    let refunds = format!("{}/tools/{}/issue_refund", w.standins.base, w.name());
    let gate: agentrun::api::AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "finance"},
        "spec": {"approval": {"separationOfDuties": true, "rules": [{"name": "every-refund",
            "match": {"endpoints": [{"url": refunds}]},
            "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"}]}}
    }))
    .expect("policy");
    policies
        .create(&PostParams::default(), &gate)
        .await
        .expect("policy");
    w.standins
        .script(
            "small",
            json!([
                call("issue_refund", json!({"orderId": "1042", "amount": 5})),
                finish("done")
            ]),
            json!([]),
        )
        .await;
    // The agent gates nothing; the platform gates every refund.
    w.create_run(
        "small",
        json!({"input": "Refund 5.", "agent": w.agent("small")}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("small", Phase::AwaitingApproval).await;
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let name = run
        .status
        .and_then(|s| s.approval)
        .expect("pending approval")
        .name;
    let approval = approvals.get(&name).await.expect("approval");
    assert_eq!(
        approval.spec.rule.as_deref(),
        Some("AgentPolicy/finance/every-refund")
    );
    assert!(approval.spec.separation_of_duties);
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "the refund ran unapproved"
    );

    // Inline agents, once forbidden, never start.
    let strict: agentrun::api::AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "strict"}, "spec": {"forbidInlineAgents": true}
    }))
    .expect("policy");
    policies
        .create(&PostParams::default(), &strict)
        .await
        .expect("policy");
    w.create_run(
        "inline",
        json!({"input": "x", "agent": w.agent("small")}),
        json!({}),
    )
    .await;
    let err = failed_without_a_job(&w, "inline").await;
    assert!(
        err.starts_with("spec.agent: inline agents are forbidden"),
        "{err}"
    );
    assert!(err.contains("AgentPolicy/strict"), "{err}");
}

#[tokio::test]
async fn the_controller_never_connects_to_a_metadata_address() {
    let w = World::new("ssrf", &[]).await;
    let mut agent = w.agent("ssrf");
    agent["tools"] = json!([{"name": "creds", "description": "x",
        "mcp": {"url": "http://169.254.169.254/latest/meta-data/iam"}}]);
    w.create_run("ssrf", json!({"input": "x", "agent": agent}), json!({}))
        .await;
    let err = failed_without_a_job(&w, "ssrf").await;
    assert!(
        err.contains("169.254.169.254") && err.contains("link-local"),
        "{err}"
    );
}

#[tokio::test]
async fn kubectl_get_agentrun_names_the_resource_not_a_category() {
    let w = World::new("category", &[]).await;
    w.standins
        .script("cat", json!([finish("ok")]), json!([]))
        .await;
    w.create_run(
        "one",
        json!({"input": "x", "agent": w.agent("cat")}),
        json!({}),
    )
    .await;
    let out = common::kubectl(&["get", "agentrun", "one", "-n", w.name(), "-o", "name"]);
    assert_eq!(out.trim(), "agentrun.agentrun.dev/one");
    let all = common::kubectl(&["get", "agentrun-all", "-n", w.name(), "-o", "name"]);
    assert!(all.contains("agentrun.agentrun.dev/one"), "{all}");
}

#[tokio::test]
async fn a_run_that_cannot_progress_says_so_where_its_user_looks() {
    let w = World::new("stalled", &[]).await;
    // An admission policy refuses Jobs in the namespace: the controller
    // cannot start a step (as with an exhausted quota or a webhook outage).
    let name = format!("{}-no-jobs", w.name());
    let policy = json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": ["batch"], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["jobs"]}]},
            "validations": [{"expression": "false", "message": "jobs are paused in this namespace"}]}});
    let binding = json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": w.name()}}}}});
    let mut guards = Vec::new();
    for (obj, plural) in [
        (policy, "validatingadmissionpolicies"),
        (binding, "validatingadmissionpolicybindings"),
    ] {
        let dynamic: kube::api::DynamicObject = serde_json::from_value(obj).expect("object");
        let gvk = kube::core::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            &dynamic.types.as_ref().expect("kind").kind,
        );
        let resource = kube::discovery::ApiResource::from_gvk_with_plural(&gvk, plural);
        let api: Api<kube::api::DynamicObject> = Api::all_with(w.client.clone(), &resource);
        api.create(&PostParams::default(), &dynamic)
            .await
            .expect("paused-jobs policy");
        guards.push(common::DeleteOnDrop {
            resource,
            name: name.clone(),
        });
    }
    let jobs: Api<Job> = Api::namespaced(w.client.clone(), w.name());
    let probe: Job = serde_json::from_value(json!({"metadata": {"name": "probe"},
        "spec": {"template": {"spec": {"restartPolicy": "Never",
            "containers": [{"name": "c", "image": "agentrun"}]}}}}))
    .expect("job");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait_for("the paused-jobs policy to take effect", TIMEOUT, || async {
        match jobs.create(&dry, &probe).await {
            Err(kube::Error::Api(e)) if e.message.contains("paused") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    w.standins
        .script("stall", json!([finish("done")]), json!([]))
        .await;
    w.create_run(
        "stuck",
        json!({"input": "x", "agent": w.agent("stall")}),
        json!({}),
    )
    .await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let stalled = wait_for("the run to report it is stalled", TIMEOUT, || async {
        let r = runs.get("stuck").await.map_err(|e| e.to_string())?;
        let s = r.status.clone().unwrap_or_default();
        match s.conditions.iter().find(|c| c.type_ == "Stalled") {
            Some(c) if c.status == "True" => Ok(s),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let error = stalled.error.unwrap_or_default();
    assert!(
        error.contains("step Job") && error.contains("paused"),
        "{error}"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(w.client.clone(), w.name());
    wait_for("a Warning event Stalled on the run", TIMEOUT, || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("Stalled")
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("stuck")
            })
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    // Once the cause is gone, the run moves on and the stall is cleared.
    drop(guards);
    let done = w.wait_phase("stuck", Phase::Succeeded).await;
    let s = done.status.expect("status");
    assert_eq!(s.error, None);
    assert!(
        s.conditions
            .iter()
            .any(|c| c.type_ == "Stalled" && c.status == "False"),
        "{:?}",
        s.conditions
    );
}
