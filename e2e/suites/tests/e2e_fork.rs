//! Forks on a real cluster (docs/design.md §11): `spec.forkOf` through the
//! API server, the controller's copy of the parent's verified prefix, the
//! fork going on live with its own keys, and the SubjectAccessReview that
//! refuses a requester who may not read the parent's log.

mod common;

use agentrun::api::{AgentRun, Phase};
use agentrun::replay::Entry;
use common::world::{World, call, finish, refunded_run};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// A fork of `parent` at `seq`, as `kubectl agentrun fork` creates it.
fn fork_spec(parent: &str, seq: u64) -> Value {
    json!({"forkOf": {"run": parent, "seq": seq}, "input": "Refund order 1042."})
}

/// The seq of the first `ToolResult` of `tool` in the run's log.
fn result_of(log: &[(agentrun::store::Record, Entry)], tool: &str) -> u64 {
    log.iter()
        .find_map(|(r, e)| match e {
            Entry::ToolResult(t) if t.tool == tool => Some(r.seq),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result of {tool} in the log"))
}

#[tokio::test]
async fn a_fork_before_the_refund_makes_it_again_with_its_own_key_and_nothing_recorded_again() {
    let w = World::new("fork", &[]).await;
    // The parent asks replies 0..=2; the fork, going on after the lookup's
    // result, asks the model only from reply 3.
    let then = [
        call("issue_refund", json!({"orderId": "1042", "amount": 30})),
        finish("refunded 30"),
    ];
    let (parent, parent_log, at) = refunded_run(&w, "refund", "parent", &then).await;

    // dave forks: he may create AgentRuns and read runlogs here.
    let dave = forker(&w, "dave").await;
    let manifest: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "retry"},
        "spec": fork_spec("parent", at)
    }))
    .unwrap();
    Api::<AgentRun>::namespaced(dave, w.name())
        .create(&PostParams::default(), &manifest)
        .await
        .expect("dave may fork");
    let fork = w.wait_phase("retry", Phase::Succeeded).await;
    assert_eq!(
        fork.status.as_ref().unwrap().result.as_deref(),
        Some("refunded 30")
    );
    let forked = fork
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Forked")
        .expect("a Forked condition");
    assert_eq!(
        (forked.status.as_str(), forked.reason.as_str()),
        ("True", "Copied")
    );

    // The fork's log: the parent's records 0..=at, then Forked naming it.
    let fork_log = w.log(&fork).await;
    for ((mine, _), (theirs, _)) in fork_log.iter().zip(&parent_log[..=at as usize]) {
        assert_eq!(
            (mine.seq, mine.kind, &mine.versions),
            (theirs.seq, theirs.kind, &theirs.versions)
        );
    }
    match &fork_log[at as usize + 1].1 {
        Entry::Forked(f) => {
            assert_eq!(f.parent_uid, parent.metadata.uid.clone().unwrap());
            assert_eq!((f.parent_name.as_str(), f.seq), ("parent", at));
            assert_eq!(f.parent_hash, parent_log[at as usize].0.hash.to_hex());
            assert_eq!(
                f.requester.as_deref(),
                Some("dave"),
                "the stamped requester"
            );
        }
        other => panic!("record {} is {other:?}, not Forked", at + 1),
    }

    // Nothing recorded was asked or called again: the model was asked
    // twice by the fork, the lookup made once (by the parent), and the
    // refund once by each run with its own key.
    assert_eq!(w.standins.model_requests("refund").await.len(), 5);
    let requests = w.standins.tool_requests(w.name()).await;
    let of = |tool: &str| -> Vec<Value> {
        requests
            .iter()
            .filter(|r| r["tool"] == tool)
            .map(|r| r["key"].clone())
            .collect()
    };
    assert_eq!(of("lookup_order").len(), 1, "{requests:?}");
    let refunds = of("issue_refund");
    assert_eq!(refunds.len(), 2, "{requests:?}");
    assert_ne!(
        refunds[0], refunds[1],
        "the fork's refund has the fork's key"
    );

    // `kubectl agentrun verify` passes on both logs, and says where the fork begins.
    let store = common::store::e2e_store_url().await;
    for run in ["parent", "retry"] {
        let args = [
            "verify",
            run,
            "--store-url",
            &store,
            "--controller-namespace",
            w.name(),
        ];
        let (ok, text) = common::approvals::plugin(&w, "admin", &args);
        assert!(ok && text.contains("chain intact"), "{run}: {text}");
        if run == "retry" {
            let begins = format!("after the parent parent's seq {at}");
            assert!(text.contains(&begins), "{text}");
        }
    }

    // The parent is unchanged.
    let after = w.log(&parent).await;
    assert_eq!(after.len(), parent_log.len());
    assert_eq!(
        after.last().unwrap().0.hash,
        parent_log.last().unwrap().0.hash
    );
}

#[tokio::test]
async fn a_fork_of_a_waiting_run_waits_on_its_own_approval_and_deciding_it_leaves_the_parents() {
    use common::approvals::{
        entry, gated_refund_approval, grant_approver_role, pending_approval, plugin, refund,
    };
    let w = World::new("forkwait", &[]).await;
    grant_approver_role(&w).await;
    let theirs =
        gated_refund_approval(&w, "waiting", json!([refund(500), finish("refunded 500")])).await;
    let parent: AgentRun = Api::namespaced(w.client.clone(), w.name())
        .get("waiting")
        .await
        .unwrap();
    let parent_log = w.log(&parent).await;
    let (request, _) = parent_log
        .iter()
        .rev()
        .find(|(_, e)| matches!(e, Entry::ApprovalRequested(_)))
        .expect("the parent asked for approval");
    let at = request.seq.to_string();

    // Through the plugin, as dave (who may read the parent's log).
    forker(&w, "dave").await;
    let (ok, out) = plugin(
        &w,
        "dave",
        &["fork", "waiting", "--at", &at, "--name", "waitfork"],
    );
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "waitfork");
    let mine = pending_approval(&w, "waitfork").await;
    assert_ne!(mine.metadata.name, theirs.metadata.name);
    assert_eq!(mine.spec.arguments, theirs.spec.arguments);
    let name = mine.metadata.name.clone().unwrap();
    common::approvals::decide(
        &w,
        "alice",
        &name,
        entry("alice", "Approve", &mine.spec.arguments_hash, "fork only"),
    )
    .await
    .expect("alice approves the fork's call");
    let fork = w.wait_phase("waitfork", Phase::Succeeded).await;
    assert_eq!(fork.status.unwrap().result.as_deref(), Some("refunded 500"));

    // The parent still waits, its Approval undecided; the refund was made once, by the fork.
    let approvals: Api<agentrun::api::Approval> = Api::namespaced(w.client.clone(), w.name());
    let still = approvals
        .get(theirs.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert!(
        still.spec.decisions.is_empty(),
        "{:?}",
        still.spec.decisions
    );
    let parent = w.wait_phase("waiting", Phase::AwaitingApproval).await;
    assert_eq!(w.log(&parent).await.len(), parent_log.len());
    let effects = w.standins.effects(w.name()).await;
    assert_eq!(
        effects
            .iter()
            .filter(|e| e["tool"] == "issue_refund")
            .count(),
        1,
        "{effects:?}"
    );
}

/// A copied decision authorizes nothing new (issue 50): dave, who may read
/// the parent's log but approves nothing, forks it right after alice's
/// approval of the refund, before its intent. The fork makes no refund on
/// alice's word: it waits on its own Approval, and only that decision
/// lets it refund, with its own key.
#[tokio::test]
async fn a_fork_after_the_parents_approval_makes_no_refund_until_its_own_approver_decides() {
    use common::approvals::{entry, gated_refund_approval, grant_approver_role, pending_approval};
    let w = World::new("forkauth", &[]).await;
    grant_approver_role(&w).await;
    let replies = json!([
        common::approvals::refund(500),
        finish("refunded 500"),
        finish("the fork refunded 500")
    ]);
    let theirs = gated_refund_approval(&w, "approved", replies).await;
    let hash = theirs.spec.arguments_hash.clone();
    let name = theirs.metadata.name.clone().unwrap();
    common::approvals::decide(&w, "alice", &name, entry("alice", "Approve", &hash, "ok"))
        .await
        .expect("alice approves the parent's refund");
    let parent = w.wait_phase("approved", Phase::Succeeded).await;
    let decided = w
        .log(&parent)
        .await
        .iter()
        .find_map(|(r, e)| matches!(e, Entry::ApprovalDecided(_)).then_some(r.seq))
        .expect("the decision is recorded");
    let refunds = |effects: Vec<Value>| -> Vec<Value> {
        let made = effects.into_iter().filter(|e| e["tool"] == "issue_refund");
        made.map(|e| e["key"].clone()).collect()
    };
    assert_eq!(refunds(w.standins.effects(w.name()).await).len(), 1);

    forker(&w, "dave").await;
    let (ok, out) = common::approvals::plugin(
        &w,
        "dave",
        &[
            "fork",
            "approved",
            "--at",
            &decided.to_string(),
            "--name",
            "again",
        ],
    );
    assert!(ok, "{out}");
    let mine = pending_approval(&w, "again").await;
    assert_ne!(mine.metadata.name, theirs.metadata.name);
    assert_eq!(mine.spec.arguments, theirs.spec.arguments);
    assert_eq!(mine.spec.requester.as_deref(), Some("dave"));
    let made = refunds(w.standins.effects(w.name()).await);
    assert_eq!(
        made.len(),
        1,
        "no refund on the parent's approval: {made:?}"
    );

    let name = mine.metadata.name.clone().unwrap();
    let hash = mine.spec.arguments_hash.clone();
    common::approvals::decide(&w, "alice", &name, entry("alice", "Approve", &hash, "fork"))
        .await
        .expect("alice approves the fork's own refund");
    w.wait_phase("again", Phase::Succeeded).await;
    let made = refunds(w.standins.effects(w.name()).await);
    assert_eq!(made.len(), 2, "{made:?}");
    assert_ne!(made[0], made[1], "the fork's refund has the fork's key");
}

#[tokio::test]
async fn a_fork_by_someone_who_cannot_read_the_parents_log_is_refused_and_copies_nothing() {
    let w = World::new("forkdeny", &[]).await;
    w.standins
        .script("short", json!([finish("done")]), json!([]))
        .await;
    w.create_run(
        "parent",
        json!({"input": "Refund order 1042.", "agent": w.agent("short")}),
        json!({}),
    )
    .await;
    w.wait_phase("parent", Phase::Succeeded).await;

    // mallory may create AgentRuns here, but not read runlogs.
    grant_run_creation(&w.client, w.name(), "mallory").await;
    let mallory = common::client_impersonating("mallory", vec![]).await;
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "peek"},
        "spec": fork_spec("parent", 1)
    }))
    .unwrap();
    // The API server refuses a fork point before the first record is the run's own.
    let mut at_zero = run.clone();
    at_zero.spec.fork_of.as_mut().unwrap().seq = 0;
    let refusal = common::approvals::refusal(
        Api::<AgentRun>::namespaced(w.client.clone(), w.name())
            .create(&PostParams::default(), &at_zero)
            .await,
    );
    assert!(refusal.contains("spec.forkOf.seq"), "{refusal}");
    Api::<AgentRun>::namespaced(mallory, w.name())
        .create(&PostParams::default(), &run)
        .await
        .expect("mallory may create AgentRuns");
    let refused = w.wait_phase("peek", Phase::Failed).await;
    let status = refused.status.unwrap();
    let forked = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Forked")
        .expect("a Forked condition");
    assert_eq!(
        (forked.status.as_str(), forked.reason.as_str()),
        ("False", "Forbidden")
    );
    assert!(
        forked.message.contains("mallory") && forked.message.contains("runlogs"),
        "{}",
        forked.message
    );
    let uid = refused.metadata.uid.unwrap();
    let copied = w.store().await.read_all(&uid).await.unwrap();
    assert!(copied.is_empty(), "nothing copied: {copied:?}");
}

#[tokio::test]
async fn a_user_granted_the_parents_log_through_a_group_may_fork_and_cannot_forge_groups() {
    let w = World::new("forkgroup", &[]).await;
    w.standins
        .script("short", json!([finish("done")]), json!([]))
        .await;
    w.create_run(
        "parent",
        json!({"input": "Refund order 1042.", "agent": w.agent("short")}),
        json!({}),
    )
    .await;
    w.wait_phase("parent", Phase::Succeeded).await;

    // erin may create AgentRuns by name, and read runlogs only as a member
    // of fork-readers.
    grant_run_creation(&w.client, w.name(), "erin").await;
    grant_runlogs_to_group(&w.client, w.name(), "fork-readers").await;
    let erin = common::client_impersonating("erin", vec!["fork-readers".into()]).await;
    let runs = Api::<AgentRun>::namespaced(erin, w.name());

    // A groups stamp she writes herself is refused by the API server.
    let mut forged: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "forged", "annotations": {
            "agentrun.dev/requester-groups": "system:masters"
        }},
        "spec": fork_spec("parent", 1)
    }))
    .unwrap();
    let refusal = common::approvals::refusal(runs.create(&PostParams::default(), &forged).await);
    assert!(
        refusal.contains("agentrun.dev/requester-groups"),
        "{refusal}"
    );

    forged.metadata.name = Some("bygroup".into());
    forged.metadata.annotations = None;
    let created = runs
        .create(&PostParams::default(), &forged)
        .await
        .expect("erin may create AgentRuns");
    let stamped = created
        .metadata
        .annotations
        .unwrap_or_default()
        .get("agentrun.dev/requester-groups")
        .cloned()
        .unwrap_or_default();
    assert!(
        stamped.lines().any(|g| g == "fork-readers"),
        "the stamp holds her groups: {stamped:?}"
    );
    let fork = w.wait_phase("bygroup", Phase::Succeeded).await;
    let forked = fork
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Forked")
        .expect("a Forked condition");
    assert_eq!(
        (forked.status.as_str(), forked.reason.as_str()),
        ("True", "Copied"),
        "{}",
        forked.message
    );
}

#[tokio::test]
async fn a_fork_keeps_the_parents_pinned_agent_after_its_agent_is_deleted() {
    use agentrun::api::Agent;
    let w = World::new("forkpinned", &[]).await;
    w.standins
        .script(
            "pinned",
            json!([
                call("lookup_order", json!({"orderId": "1042"})),
                finish("looked up"),
                finish("looked up again")
            ]),
            json!([]),
        )
        .await;
    let agents: Api<Agent> = Api::namespaced(w.client.clone(), w.name());
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "refunds"},
        "spec": w.agent("pinned")
    }))
    .unwrap();
    agents
        .create(&PostParams::default(), &agent)
        .await
        .expect("creating the Agent");
    w.create_run(
        "parent",
        json!({"input": "Refund order 1042.", "agentRef": {"name": "refunds"}}),
        json!({}),
    )
    .await;
    let parent = w.wait_phase("parent", Phase::Succeeded).await;
    let at = result_of(&w.log(&parent).await, "lookup_order");
    agents
        .delete("refunds", &Default::default())
        .await
        .expect("deleting the Agent");

    let dave = forker(&w, "dave").await;
    let manifest: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "orphan"},
        "spec": fork_spec("parent", at)
    }))
    .unwrap();
    Api::<AgentRun>::namespaced(dave, w.name())
        .create(&PostParams::default(), &manifest)
        .await
        .expect("dave may fork");
    let fork = w.wait_phase("orphan", Phase::Succeeded).await;
    let status = fork.status.as_ref().unwrap();
    assert_eq!(status.result.as_deref(), Some("looked up again"));
    let resolved = status
        .conditions
        .iter()
        .find(|c| c.type_ == "AgentResolved")
        .expect("an AgentResolved condition");
    assert_eq!(
        (resolved.status.as_str(), resolved.reason.as_str()),
        ("True", "Pinned"),
        "{}",
        resolved.message
    );
    // The lookup was made once, by the parent.
    let requests = w.standins.tool_requests(w.name()).await;
    assert_eq!(
        requests
            .iter()
            .filter(|r| r["tool"] == "lookup_order")
            .count(),
        1,
        "{requests:?}"
    );
}

#[tokio::test]
async fn a_fork_with_a_replaced_lookup_result_decides_the_refund_again_and_says_who_replaced_it() {
    let w = World::new("forkreplace", &[]).await;
    // The parent asks replies 0..=2; the fork, after the (replaced)
    // lookup's result, asks from reply 3: a smaller refund.
    let then = [
        call("issue_refund", json!({"orderId": "1042", "amount": 25})),
        finish("refunded 25"),
    ];
    let (_, _, at) = refunded_run(&w, "refund", "parent", &then).await;
    let asked_by_parent = w.standins.model_requests("refund").await.len();

    // dave forks through the plugin, the lookup's result replaced.
    forker(&w, "dave").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lookup.json");
    std::fs::write(
        &file,
        r#"{"orderId": "1042", "paid": 25, "note": "REPLACED-PAID-25"}"#,
    )
    .unwrap();
    let replace = format!("{at}=@{}", file.display());
    let (ok, out) = common::approvals::plugin(
        &w,
        "dave",
        &[
            "fork",
            "parent",
            "--at",
            &at.to_string(),
            "--name",
            "whatif",
            "--replace",
            &replace,
            "--reason",
            "the customer paid 25, not 40",
        ],
    );
    assert!(ok, "{out}");
    let fork = w.wait_phase("whatif", Phase::Succeeded).await;
    assert_eq!(
        fork.status.as_ref().unwrap().result.as_deref(),
        Some("refunded 25")
    );

    // The fork's one new model request saw the replaced result; the parent's
    // recorded calls were never made again.
    let requests = w.standins.model_requests("refund").await;
    assert_eq!(requests.len(), asked_by_parent + 2, "{requests:?}");
    let first_of_fork = requests[asked_by_parent].to_string();
    assert!(
        first_of_fork.contains("REPLACED-PAID-25"),
        "{first_of_fork}"
    );
    let tools = w.standins.tool_requests(w.name()).await;
    let keys = |tool: &str| -> Vec<Value> {
        tools
            .iter()
            .filter(|r| r["tool"] == tool)
            .map(|r| r["key"].clone())
            .collect()
    };
    assert_eq!(keys("lookup_order").len(), 1, "{tools:?}");
    let refunds = keys("issue_refund");
    assert_eq!(refunds.len(), 2, "{tools:?}");
    assert_ne!(
        refunds[0], refunds[1],
        "the fork's refund has the fork's key"
    );

    // verify: the prefix checks against the parent, and names the
    // replaced record, who replaced it and why.
    let store = common::store::e2e_store_url().await;
    let args = [
        "verify",
        "whatif",
        "--store-url",
        &store,
        "--controller-namespace",
        w.name(),
    ];
    let (ok, text) = common::approvals::plugin(&w, "admin", &args);
    assert!(ok && text.contains("chain intact"), "{text}");
    let named = format!("replaced: whatif's record {at} is not the parent's");
    assert!(text.contains(&named), "{text}");
    assert!(
        text.contains("replaced by dave, because the customer paid 25, not 40"),
        "{text}"
    );
}

/// A fork is judged by the platform of today, as a new run of its agent
/// would be (issue 50): after the parent ran ungated, the platform gated
/// refunds for finance with separation of duties; a fork before the refund
/// waits for finance, the Approval saying so, and makes no refund. Once the
/// platform forbids inline agents, a fork of the parent (whose agent is
/// inline) is refused and copies nothing.
#[tokio::test]
async fn a_fork_is_judged_by_the_platform_of_today_not_by_its_parents_pin() {
    use agentrun::api::AgentPolicy;
    let w = World::new("forkgov", &[]).await;
    let then = [
        call("issue_refund", json!({"orderId": "1042", "amount": 900})),
        finish("refunded 900"),
    ];
    let (_, _, at) = refunded_run(&w, "refund", "parent", &then).await;
    let (base, t) = (&w.standins.base, w.name());
    let policy: AgentPolicy = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "finance"},
        "spec": {"approval": {
            "rules": [{"name": "refunds",
                "match": {"endpoints": [{"url": format!("{base}/tools/{t}/issue_refund")}]},
                "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "10m"}],
            "separationOfDuties": true
        }}
    }))
    .unwrap();
    let policies = Api::<AgentPolicy>::namespaced(w.client.clone(), w.name());
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();

    let dave = Api::<AgentRun>::namespaced(forker(&w, "dave").await, w.name());
    let fork = |name: &str| -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": name}, "spec": fork_spec("parent", at)
        }))
        .unwrap()
    };
    dave.create(&PostParams::default(), &fork("again"))
        .await
        .unwrap();
    let approval = common::approvals::pending_approval(&w, "again").await;
    assert_eq!(
        approval.spec.rule.as_deref(),
        Some("AgentPolicy/finance/refunds")
    );
    assert!(
        approval.spec.separation_of_duties,
        "today's separation of duties"
    );
    assert_eq!(approval.spec.requester.as_deref(), Some("dave"));
    let refunds = w.standins.effects(w.name()).await;
    let made = refunds
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .count();
    assert_eq!(made, 1, "the parent's refund only: {refunds:?}");
    // The fork's start records the parent's agent as today's platform
    // governs it, right after `Forked`, its versions unchanged.
    let again = w.wait_phase("again", Phase::AwaitingApproval).await;
    let log = w.log(&again).await;
    let Entry::VersionChanged(changed) = &log[at as usize + 2].1 else {
        panic!("record {} is {:?}", at + 2, log[at as usize + 2].1)
    };
    assert_eq!(changed.from, changed.to);
    let governed = changed.agent.approval.as_ref().expect("a policy");
    assert_eq!(governed.rules[0].name, "AgentPolicy/finance/refunds");
    assert!(governed.separation_of_duties);

    // The platform now forbids inline agents: a fork of the inline parent is refused.
    let patch = json!({"spec": {"forbidInlineAgents": true}});
    let merge = kube::api::Patch::Merge(&patch);
    policies
        .patch("finance", &kube::api::PatchParams::default(), &merge)
        .await
        .unwrap();
    dave.create(&PostParams::default(), &fork("inline"))
        .await
        .unwrap();
    let refused = w.wait_phase("inline", Phase::Failed).await;
    let status = refused.status.as_ref().unwrap();
    let forked = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Forked")
        .unwrap();
    assert_eq!(
        (forked.status.as_str(), forked.reason.as_str()),
        ("False", "PolicyRefused")
    );
    assert!(
        forked
            .message
            .contains("forbidden here by AgentPolicy/finance"),
        "{}",
        forked.message
    );
    let uid = refused.metadata.uid.clone().unwrap();
    let copied = w.store().await.read_all(&uid).await.unwrap();
    assert!(copied.is_empty(), "nothing copied: {copied:?}");
}

/// A finished refund run (`parent`: lookup, refund 40, done) on `script`,
/// with replies for a fork after the lookup; its log and the lookup's seq.
async fn refund_parent(w: &World, script: &str) -> (AgentRun, u64) {
    w.standins
        .script(
            script,
            json!([
                call("lookup_order", json!({"orderId": "1042"})),
                call("issue_refund", json!({"orderId": "1042", "amount": 40})),
                finish("refunded 40"),
                call("issue_refund", json!({"orderId": "1042", "amount": 30})),
                finish("refunded 30")
            ]),
            json!([]),
        )
        .await;
    w.create_run(
        "parent",
        json!({"input": "Refund order 1042.", "agent": w.agent(script)}),
        json!({}),
    )
    .await;
    let parent = w.wait_phase("parent", Phase::Succeeded).await;
    let at = result_of(&w.log(&parent).await, "lookup_order");
    (parent, at)
}

#[tokio::test]
async fn a_fork_of_a_parent_tampered_before_the_fork_point_refuses_to_start_and_copies_nothing() {
    let w = World::new("forktamper", &[]).await;
    let (parent, at) = refund_parent(&w, "refund").await;
    // A database superuser rewrites the parent's first model answer (before
    // the fork point), bypassing the append-only trigger.
    let uid = parent.metadata.uid.clone().unwrap();
    let touched = rewrite_body(
        &uid,
        "ModelCall",
        "\"orderId\":\"1042\"",
        "\"orderId\":\"9999\"",
    )
    .await;
    assert!(touched >= 1, "the parent's ModelCall was rewritten");

    let dave = forker(&w, "dave").await;
    let manifest: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "fromtampered"},
        "spec": fork_spec("parent", at)
    }))
    .unwrap();
    Api::<AgentRun>::namespaced(dave, w.name())
        .create(&PostParams::default(), &manifest)
        .await
        .expect("dave may create the fork");
    let refused = w.wait_phase("fromtampered", Phase::Failed).await;
    let status = refused.status.unwrap();
    let forked = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Forked")
        .expect("a Forked condition");
    assert_eq!(
        (forked.status.as_str(), forked.reason.as_str()),
        ("False", "ParentTampered"),
        "{}",
        forked.message
    );
    let copied = w
        .store()
        .await
        .read_all(refused.metadata.uid.as_deref().unwrap())
        .await
        .unwrap();
    assert!(copied.is_empty(), "nothing copied: {copied:?}");
}

#[tokio::test]
async fn a_fork_with_another_agent_asks_the_model_with_its_prompt_after_the_fork_point() {
    use agentrun::api::Agent;
    let w = World::new("forkagent", &[]).await;
    let (_, at) = refund_parent(&w, "refund").await;
    let asked_by_parent = w.standins.model_requests("refund").await;
    let mut v2 = w.agent("refund");
    v2["prompt"] = json!({"version": "v2", "system": "You are a frugal refund agent (V2-PROMPT)."});
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "refunds-v2"},
        "spec": v2
    }))
    .unwrap();
    Api::<Agent>::namespaced(w.client.clone(), w.name())
        .create(&PostParams::default(), &agent)
        .await
        .expect("creating the v2 Agent");

    forker(&w, "dave").await;
    let (ok, out) = common::approvals::plugin(
        &w,
        "dave",
        &[
            "fork",
            "parent",
            "--at",
            &at.to_string(),
            "--agent",
            "refunds-v2",
            "--name",
            "onv2",
        ],
    );
    assert!(ok, "{out}");
    let fork = w.wait_phase("onv2", Phase::Succeeded).await;
    let log = w.log(&fork).await;
    match &log[at as usize + 2].1 {
        Entry::VersionChanged(v) => assert_eq!(v.agent.prompt.version, "v2"),
        other => panic!("record {} is {other:?}, not VersionChanged", at + 2),
    }
    // The parent's requests carried the v1 prompt; every request of the
    // fork (after its fork point) carries v2's.
    let requests = w.standins.model_requests("refund").await;
    assert!(
        asked_by_parent
            .iter()
            .all(|r| !r.to_string().contains("V2-PROMPT"))
    );
    let of_fork = &requests[asked_by_parent.len()..];
    assert_eq!(of_fork.len(), 2, "{requests:?}");
    for r in of_fork {
        assert!(r.to_string().contains("V2-PROMPT"), "{r}");
    }
}

/// Rewrites `from` to `to` in the stored bodies of the run's `kind`
/// records as the database superuser (the append-only trigger off, as an
/// administrator could); returns the rows touched.
async fn rewrite_body(uid: &str, kind: &str, from: &str, to: &str) -> u64 {
    use sqlx::Connection as _;
    let mut url = url::Url::parse(common::store::pg_admin_url()).unwrap();
    url.set_path("/agentrun_e2e");
    let mut conn = sqlx::PgConnection::connect(url.as_str())
        .await
        .expect("connecting as the superuser");
    let update = format!(
        "UPDATE agentrun_steps SET body = replace(body, '{from}', '{to}') WHERE run = $1 AND kind = '{kind}'"
    );
    let mut touched = 0;
    for q in [
        "SET session_replication_role = replica",
        update.as_str(),
        "SET session_replication_role = DEFAULT",
    ] {
        let query = sqlx::query(sqlx::AssertSqlSafe(q.to_string()));
        let query = if q.contains("$1") {
            query.bind(uid)
        } else {
            query
        };
        touched += query
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{q}: {e}"))
            .rows_affected();
    }
    touched
}

/// A Role letting members of `group` read runlogs in `ns`.
async fn grant_runlogs_to_group(client: &kube::Client, ns: &str, group: &str) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let name = format!("{group}-runlogs");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": [agentrun::api::runlog::LOG_GROUP], "resources": [agentrun::api::runlog::RUNLOGS], "verbs": ["get"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("creating the Role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding the Role");
}

/// `user` may fork here: create AgentRuns and read runlogs (granted to
/// the user by name).
async fn forker(w: &World, user: &str) -> kube::Client {
    grant_run_creation(&w.client, w.name(), user).await;
    common::log_api::grant_verbs(&w.client, w.name(), user, &["get"]).await;
    common::client_as(user).await
}

/// A Role letting `user` create and read AgentRuns in `ns` (no runlogs).
async fn grant_run_creation(client: &kube::Client, ns: &str, user: &str) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let name = format!("{user}-agentruns");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"],
                   "verbs": ["create", "get", "list", "watch"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("creating the Role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding the Role");
}
