//! Trust attacks on approvals (issue 10, items 2, 4, 5, 6 and 11): an
//! Approval decides only the exact call it was raised for, by the people the
//! pinned policy names. Each attack is played as a real user (alice, bob:
//! group finance-approvers; carol: none; admin: system:masters) against the
//! local control plane, and each test asserts the refusal, that no tool side
//! effect happened (the stand-ins count effects by Idempotency-Key) and that
//! the run's log still verifies against its status.

use agentrun::api::{AgentRun, Approval, ApprovalState, Phase};
use agentrun::replay::Entry;
use agentrun::runlog::records::{Outcome, Verdict};
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::{
    self,
    approvals::{
        decide, entry, gated_agent, grant_approver_role, pending_approval, plugin, refund, refusal,
    },
    world::{TIMEOUT, World, finish},
};

fn edit(approver: &str, hash: &str, arguments: Value) -> Value {
    let mut e = entry(approver, "Edit", hash, "changed");
    e["arguments"] = arguments;
    e
}

/// Gives bob and carol every verb on Approvals in the namespace, as a careless
/// namespace admin might: what stops them then is the admission policy.
async fn grant_full_approval_access(w: &World) {
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "approval-admin", "namespace": w.name()},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["approvals"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]
    });
    let rb = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "approval-admin", "namespace": w.name()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "approval-admin"},
        "subjects": [
            {"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"},
            {"kind": "User", "name": "carol", "apiGroup": "rbac.authorization.k8s.io"}
        ]
    });
    let roles: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(w.client.clone(), w.name());
    roles
        .create(&Default::default(), &serde_json::from_value(role).unwrap())
        .await
        .expect("Role");
    let rbs: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(w.client.clone(), w.name());
    rbs.create(&Default::default(), &serde_json::from_value(rb).unwrap())
        .await
        .expect("RoleBinding");
}

/// Amounts of the refunds that really happened in this world.
async fn refunds(w: &World) -> Vec<Value> {
    w.standins
        .effects(w.name())
        .await
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .map(|e| e["args"]["amount"].clone())
        .collect()
}

/// The decoded log of a finished run (its chain verified against its status).
async fn verified_log(w: &World, run: &str) -> Vec<Entry> {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let run = runs.get(run).await.expect("the run");
    w.log(&run).await.into_iter().map(|(_, s)| s).collect()
}

/// Waits for a Warning Event with `reason` on `run` and returns its message.
async fn warning(w: &World, run: &str, reason: &str) -> String {
    let events: Api<Event> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(&format!("a {reason} Warning on {run}"), TIMEOUT, || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find_map(|e| {
            (e.reason.as_deref() == Some(reason)
                && e.type_.as_deref() == Some("Warning")
                && e.involved_object.name.as_deref() == Some(run))
            .then(|| e.message.unwrap_or_default())
        })
    })
    .await
}

#[tokio::test]
async fn an_orphaned_approval_never_decides_a_run_recreated_under_its_name() {
    let w = World::new("tr-orphan", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script("first", json!([refund(500)]), json!([]))
        .await;
    w.standins
        .script(
            "second",
            json!([refund(500), finish("told the customer no")]),
            json!([]),
        )
        .await;
    let spec =
        |script: &str| json!({"input": "Refund.", "agent": gated_agent(&w, script, json!({}))});
    w.create_run("same", spec("first"), json!({})).await;
    let old = pending_approval(&w, "same").await;
    let old_name = old.metadata.name.clone().unwrap();

    // Delete the run but keep its Approval, then approve that Approval.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.delete("same", &DeleteParams::orphan()).await.unwrap();
    common::wait_for("the first run to be gone", TIMEOUT, || async {
        match runs.get_opt("same").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        "the garbage collector to orphan the old Approval",
        TIMEOUT,
        || async {
            let a = approvals.get(&old_name).await.map_err(|e| e.to_string())?;
            match a.metadata.owner_references.as_deref() {
                None | Some([]) => Ok(()),
                Some(o) => Err(format!("still owned: {o:?}")),
            }
        },
    )
    .await;
    decide(
        &w,
        "alice",
        &old_name,
        entry(
            "alice",
            "Approve",
            &old.spec.arguments_hash,
            "for the old run",
        ),
    )
    .await
    .expect("the orphaned Approval takes a decision (it decides nothing)");

    // The same name, the same call, the same arguments hash: a new run.
    w.create_run("same", spec("second"), json!({})).await;
    let new = pending_approval(&w, "same").await;
    let new_name = new.metadata.name.clone().unwrap();
    assert_ne!(new_name, old_name, "a new run gets an Approval of its own");
    assert_eq!(new.spec.arguments_hash, old.spec.arguments_hash);
    assert_eq!(
        new.spec.run_ref.uid,
        runs.get("same").await.unwrap().metadata.uid
    );
    assert!(refunds(&w).await.is_empty(), "the old approval ran nothing");

    // Only its own Approval decides it: bob rejects, the agent is told, nothing ran.
    decide(
        &w,
        "bob",
        &new_name,
        entry("bob", "Reject", &new.spec.arguments_hash, "not this one"),
    )
    .await
    .unwrap();
    w.wait_phase("same", Phase::Succeeded).await;
    assert!(refunds(&w).await.is_empty());
    let log = verified_log(&w, "same").await;
    let decided: Vec<_> = log
        .iter()
        .filter_map(|s| match s {
            Entry::ApprovalDecided(d) => Some(d.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(
        (decided[0].verdict, decided[0].approval.as_str()),
        (Verdict::Reject, new_name.as_str())
    );
}

#[tokio::test]
async fn long_run_names_sharing_a_prefix_get_approvals_of_their_own() {
    let w = World::new("tr-names", &[]).await;
    grant_approver_role(&w).await;
    let prefix = format!("r{}", "x".repeat(59));
    let (one, two) = (format!("{prefix}-a"), format!("{prefix}-b"));
    assert_eq!((one.len(), two.len()), (62, 62));
    w.standins
        .script("one", json!([refund(500), finish("refunded")]), json!([]))
        .await;
    w.standins
        .script("two", json!([refund(700), finish("declined")]), json!([]))
        .await;
    for (name, script) in [(&one, "one"), (&two, "two")] {
        w.create_run(
            name,
            json!({"input": "Refund.", "agent": gated_agent(&w, script, json!({}))}),
            json!({}),
        )
        .await;
    }
    let a1 = pending_approval(&w, &one).await;
    let a2 = pending_approval(&w, &two).await;
    assert_ne!(a1.metadata.name, a2.metadata.name);
    assert_eq!(a1.spec.arguments["amount"], 500);
    assert_eq!(a2.spec.arguments["amount"], 700);

    decide(
        &w,
        "alice",
        a1.metadata.name.as_deref().unwrap(),
        entry("alice", "Approve", &a1.spec.arguments_hash, "ok"),
    )
    .await
    .unwrap();
    w.wait_phase(&one, Phase::Succeeded).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    assert_eq!(
        runs.get(&two).await.unwrap().status.unwrap().phase,
        Some(Phase::AwaitingApproval),
        "the other run's approval decided nothing for it"
    );
    decide(
        &w,
        "bob",
        a2.metadata.name.as_deref().unwrap(),
        entry("bob", "Reject", &a2.spec.arguments_hash, "no"),
    )
    .await
    .unwrap();
    w.wait_phase(&two, Phase::Succeeded).await;
    assert_eq!(refunds(&w).await, vec![json!(500)]);
    verified_log(&w, &one).await;
    verified_log(&w, &two).await;
}

#[tokio::test]
async fn a_forged_approval_is_never_acted_on() {
    let w = World::new("tr-forged", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "victim",
            json!([refund(500), finish("unreachable")]),
            json!([]),
        )
        .await;
    w.standins
        .script(
            "donor",
            json!([refund(50_000), finish("unreachable")]),
            json!([]),
        )
        .await;
    for (name, script) in [("victim", "victim"), ("donor", "donor")] {
        w.create_run(
            name,
            json!({"input": "Refund.", "agent": gated_agent(&w, script, json!({}))}),
            json!({}),
        )
        .await;
    }
    let victim = pending_approval(&w, "victim").await;
    let donor = pending_approval(&w, "donor").await;
    let name = victim.metadata.name.clone().unwrap();

    // An admin (past every admission policy) rewrites the victim's Approval:
    // the donor run's uid, call and hash, already approved "by alice".
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let mut forged = approvals.get(&name).await.unwrap();
    forged.spec = donor.spec.clone();
    forged.spec.decisions = vec![
        serde_json::from_value(entry(
            "alice",
            "Approve",
            &donor.spec.arguments_hash,
            "forged",
        ))
        .unwrap(),
    ];
    approvals
        .replace(&name, &PostParams::default(), &forged)
        .await
        .expect("an admin may write anything");

    let message = warning(&w, "victim", "ApprovalMismatch").await;
    assert!(
        message.contains(&name)
            && message.contains("spec.runRef")
            && message.contains("spec.argumentsHash"),
        "{message}"
    );
    // Nothing was decided, nothing ran; the run is still waiting and stops only when cancelled.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    assert_eq!(
        runs.get("victim").await.unwrap().status.unwrap().phase,
        Some(Phase::AwaitingApproval)
    );
    assert!(refunds(&w).await.is_empty());
    let forged_now = approvals.get(&name).await.unwrap();
    assert_ne!(
        forged_now.status.and_then(|s| s.state),
        Some(ApprovalState::Approved),
        "the controller never marks a look-alike decided"
    );
    runs.patch(
        "victim",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();
    w.wait_phase("victim", Phase::Cancelled).await;
    let log = verified_log(&w, "victim").await;
    assert!(
        !log.iter().any(|s| matches!(s, Entry::ApprovalDecided(_))),
        "no decision was recorded"
    );
    assert!(refunds(&w).await.is_empty());
}

#[tokio::test]
async fn an_edit_needs_the_full_quorum_for_the_edited_arguments() {
    let w = World::new("tr-quorum", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script("q", json!([refund(500), finish("refunded 500")]), json!([]))
        .await;
    let rule = json!({"requiredApprovals": 2, "approvers": {"users": ["alice", "bob", "carol"]}});
    w.create_run(
        "q",
        json!({"input": "Refund.", "agent": gated_agent(&w, "q", rule)}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "q").await;
    let (name, hash) = (
        a.metadata.name.clone().unwrap(),
        a.spec.arguments_hash.clone(),
    );
    // alice edits to 99,999, bob approves 500: two decisions, but no set has two.
    decide(
        &w,
        "alice",
        &name,
        edit("alice", &hash, json!({"orderId": "1042", "amount": 99_999})),
    )
    .await
    .unwrap();
    decide(
        &w,
        "bob",
        &name,
        entry("bob", "Approve", &hash, "500 is right"),
    )
    .await
    .unwrap();
    // Had that counted as "2 of 2", 99,999 would have run and carol would be refused.
    decide(
        &w,
        "carol",
        &name,
        entry("carol", "Approve", &hash, "agreed"),
    )
    .await
    .expect("still pending after alice and bob disagreed");
    w.wait_phase("q", Phase::Succeeded).await;
    assert_eq!(refunds(&w).await, vec![json!(500)]);
    let log = verified_log(&w, "q").await;
    let decided = log
        .iter()
        .find_map(|s| match s {
            Entry::ApprovalDecided(d) => Some(d.clone()),
            _ => None,
        })
        .expect("a decision");
    let who: Vec<&str> = decided
        .decisions
        .iter()
        .map(|d| d.approver.as_str())
        .collect();
    assert_eq!(decided.verdict, Verdict::Approve);
    assert_eq!(
        who,
        vec!["bob", "carol"],
        "alice's edit did not count toward 500"
    );
}

#[tokio::test]
async fn a_gated_alternative_never_runs_on_expiry() {
    let w = World::new("tr-alt", &[]).await;
    grant_approver_role(&w).await;
    // A prompt-injected "safe" alternative of 50,000, with a reason that
    // tries to repaint the approver's terminal.
    let proposal = json!({"text": "Refund 500.\u{1b}[1A\u{1b}[2KRefund 5.",
        "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": 500,
                                                             "_alternative": {"orderId": "1042", "amount": 50_000}}}]});
    w.standins
        .script("alt", json!([proposal, finish("gave up")]), json!([]))
        .await;
    let rule = json!({"expiresAfter": "8s", "onExpiry": "Alternative"});
    w.create_run(
        "alt",
        json!({"input": "Refund.", "agent": gated_agent(&w, "alt", rule)}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "alt").await;
    let (ok, text) = plugin(&w, "alice", &["show", a.metadata.name.as_deref().unwrap()]);
    assert!(ok, "{text}");
    assert!(!text.contains('\u{1b}'), "raw escape in: {text:?}");
    assert!(text.contains("\\u{1b}[1A"), "{text}");
    let amount = text
        .lines()
        .find(|l| l.trim_start().starts_with("amount"))
        .unwrap_or_default();
    assert!(
        text.contains("alternative on expiry")
            && amount.contains("500")
            && amount.contains("50000 *"),
        "the alternative is shown beside the proposal: {text}"
    );

    // Nobody answers: the alternative is gated too, so nothing runs.
    w.wait_phase("alt", Phase::Succeeded).await;
    assert!(refunds(&w).await.is_empty(), "{:?}", refunds(&w).await);
    let log = verified_log(&w, "alt").await;
    let decided = log
        .iter()
        .find_map(|s| match s {
            Entry::ApprovalDecided(d) => Some(d.clone()),
            _ => None,
        })
        .expect("the expiry is recorded");
    assert_eq!(
        (decided.verdict, decided.arguments),
        (Verdict::Expired, None)
    );
    assert!(!log.iter().any(|s| matches!(s, Entry::ToolIntent(_))));
    let told = w
        .standins
        .model_requests("alt")
        .await
        .pop()
        .unwrap()
        .to_string();
    assert!(
        told.contains("Neither the call nor its alternative ran"),
        "{told}"
    );
    warning(&w, "alt", "AlternativeNeedsApproval").await;
}

#[tokio::test]
async fn an_expired_reconcile_approval_never_counts_as_did_not_happen() {
    let w = World::new("tr-reconcile", &[]).await;
    grant_approver_role(&w).await;
    let page = json!({"text": "Paging on-call.", "toolCalls": [{"name": "page_oncall", "arguments": {"why": "refund stuck"}}]});
    w.standins
        .script("rec", json!([page, finish("paged")]), json!([]))
        .await;
    let mut agent = w.agent("rec");
    agent["approval"] = json!({"rules": [{
        "name": "paging", "tool": "page_oncall", "approvers": {"groups": ["finance-approvers"]},
        "expiresAfter": "10s", "onExpiry": "ReturnToAgent"
    }]});
    // The worker dies after paging, before recording it: no key, no lookup.
    let fp = json!({"agentrun.dev/failpoint": "after-tool-call"});
    w.create_run("rec", json!({"input": "Page on-call.", "agent": agent}), fp)
        .await;
    let call = pending_approval(&w, "rec").await;
    assert_eq!(call.spec.kind, agentrun::api::ApprovalKind::Call);
    decide(
        &w,
        "bob",
        call.metadata.name.as_deref().unwrap(),
        entry("bob", "Approve", &call.spec.arguments_hash, "page them"),
    )
    .await
    .unwrap();

    // Did the page go out? Nobody answers in time.
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let reconcile = common::wait_for("the reconcile approval", TIMEOUT, || async {
        let list = approvals
            .list(&ListParams::default().labels("agentrun.dev/run=rec"))
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|a| a.spec.kind == agentrun::api::ApprovalKind::Reconcile)
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    assert_eq!(
        reconcile.spec.on_expiry,
        agentrun::api::OnExpiry::Fail,
        "silence is never an answer, whatever the rule says"
    );
    let run = w.wait_phase("rec", Phase::Failed).await;
    let error = run.status.unwrap().error.unwrap_or_default();
    assert!(
        error.contains("nobody confirmed whether page_oncall"),
        "{error}"
    );
    let pages = w
        .standins
        .effects(w.name())
        .await
        .iter()
        .filter(|e| e["tool"] == "page_oncall")
        .count();
    assert_eq!(pages, 1, "the page was not sent again");
    let log = verified_log(&w, "rec").await;
    match log.last() {
        Some(Entry::RunFinished(f)) => assert_eq!(f.outcome, Outcome::NeedsHuman),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        log.iter()
            .filter(|s| matches!(s, Entry::ToolIntent(_)))
            .count(),
        1
    );
    assert!(!log.iter().any(|s| matches!(s, Entry::ToolResult(_))));
}

#[tokio::test]
async fn approvals_cannot_be_deleted_or_rewired_and_come_back_with_their_expiry() {
    let w = World::new("tr-delete", &[]).await;
    grant_approver_role(&w).await;
    grant_full_approval_access(&w).await;
    w.standins
        .script("del", json!([refund(500), finish("refunded")]), json!([]))
        .await;
    w.create_run(
        "del",
        json!({"input": "Refund.", "agent": gated_agent(&w, "del", json!({}))}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "del").await;
    let name = a.metadata.name.clone().unwrap();
    for user in ["bob", "carol"] {
        let api: Api<Approval> = Api::namespaced(common::client_as(user).await, w.name());
        let msg = refusal(api.delete(&name, &DeleteParams::default()).await);
        assert!(msg.contains("Approvals cannot be deleted"), "{user}: {msg}");
        let unowned = json!({"metadata": {"ownerReferences": null}});
        let msg = refusal(
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&unowned))
                .await,
        );
        assert!(msg.contains("metadata.ownerReferences"), "{user}: {msg}");
        let held = json!({"metadata": {"finalizers": ["example.com/hold"]}});
        let msg = refusal(
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&held))
                .await,
        );
        assert!(msg.contains("metadata.finalizers"), "{user}: {msg}");
        let relabel = json!({"metadata": {"labels": {"agentrun.dev/run": "other"}}});
        let msg = refusal(
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&relabel))
                .await,
        );
        assert!(msg.contains("metadata.labels"), "{user}: {msg}");
    }

    // An admin deletes it anyway: it comes back with its original expiry.
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    approvals
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    let old_uid = a.metadata.uid.clone();
    let again = common::wait_for("the Approval to be raised again", TIMEOUT, || async {
        match approvals.get_opt(&name).await {
            Ok(Some(b)) if b.metadata.uid != old_uid => Ok(b),
            other => Err(format!("{:?}", other.map(|o| o.map(|b| b.metadata.uid)))),
        }
    })
    .await;
    assert_eq!(
        again.spec.expires_at, a.spec.expires_at,
        "not a fresh expiry"
    );
    assert_eq!(again.spec.arguments_hash, a.spec.arguments_hash);
    warning(&w, "del", "ApprovalRaisedAgain").await;
    decide(
        &w,
        "alice",
        &name,
        entry("alice", "Approve", &a.spec.arguments_hash, "ok"),
    )
    .await
    .unwrap();
    w.wait_phase("del", Phase::Succeeded).await;
    assert_eq!(refunds(&w).await, vec![json!(500)]);
    let log = verified_log(&w, "del").await;
    assert_eq!(
        log.iter()
            .filter(|s| matches!(s, Entry::ApprovalRequested(_)))
            .count(),
        1,
        "raising it again added no request"
    );

    // The garbage collector still takes it with its run.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.delete("del", &DeleteParams::background())
        .await
        .unwrap();
    common::wait_for("the Approval to go with its run", TIMEOUT, || async {
        match approvals.get_opt(&name).await {
            Ok(None) => Ok(()),
            other => Err(format!("{:?}", other.map(|o| o.is_some()))),
        }
    })
    .await;
}

#[tokio::test]
async fn no_decision_is_taken_once_the_controller_marked_the_approval_expired() {
    let w = World::new("tr-late", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "late",
            json!([refund(500), finish("unreachable")]),
            json!([]),
        )
        .await;
    let rule = json!({"expiresAfter": "4s", "onExpiry": "Fail"});
    w.create_run(
        "late",
        json!({"input": "Refund.", "agent": gated_agent(&w, "late", rule)}),
        json!({}),
    )
    .await;
    let a = pending_approval(&w, "late").await;
    let name = a.metadata.name.clone().unwrap();
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let expired = common::wait_for("the controller to mark it expired", TIMEOUT, || async {
        let b = approvals.get(&name).await.map_err(|e| e.to_string())?;
        match b.status.as_ref().and_then(|s| s.state) {
            Some(ApprovalState::Expired) => Ok(b),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // Promptly: marked within a few seconds of expiresAt.
    let marked = expired.status.unwrap().decided_at.unwrap().0;
    let late_by = marked.duration_since(a.spec.expires_at.0);
    assert!(
        late_by.as_secs() <= 5,
        "marked expired {late_by:?} after expiresAt"
    );
    let msg = refusal(
        decide(
            &w,
            "alice",
            &name,
            entry("alice", "Approve", &a.spec.arguments_hash, "sorry, late"),
        )
        .await,
    );
    assert!(msg.contains("already Expired"), "{msg}");
    w.wait_phase("late", Phase::Failed).await;
    assert!(refunds(&w).await.is_empty());
    let log = verified_log(&w, "late").await;
    assert!(
        log.iter()
            .any(|s| matches!(s, Entry::ApprovalDecided(d) if d.verdict == Verdict::Expired))
    );
}

/// Appends `step` to the run's log as whoever holds the run's store
/// credential could (a step pod, or a namespace user who read it).
async fn append_as_the_step_pod(uid: &str, step: Entry) {
    use agentrun::store::{RecordDraft, StepKind};
    let store = agentrun::store::open(&common::store::e2e_store_url().await)
        .await
        .unwrap();
    // The step pod that asked may still hold the run for a moment.
    let lease = common::wait_for("the run's lease to be free", TIMEOUT, || async {
        store
            .acquire(uid, "mallory", std::time::Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let head = store.head(uid).await.unwrap();
    let kind = StepKind::ALL
        .into_iter()
        .find(|k| k.as_str() == step.kind())
        .unwrap();
    let record = RecordDraft::new(kind, step.payload()).seal(&head).unwrap();
    store.append(uid, lease.epoch, &record).await.unwrap();
    store.release(&lease).await.unwrap();
}

#[tokio::test]
async fn a_request_whose_gate_the_pinned_policy_does_not_give_stops_the_run() {
    let w = World::new("tr-gate", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "gate",
            json!([refund(500), finish("unreachable")]),
            json!([]),
        )
        .await;
    let rule = json!({"requiredApprovals": 2, "approvers": {"users": ["alice", "bob"]}});
    w.create_run(
        "gate",
        json!({"input": "Refund.", "agent": gated_agent(&w, "gate", rule)}),
        json!({}),
    )
    .await;
    let honest = pending_approval(&w, "gate").await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let uid = runs.get("gate").await.unwrap().metadata.uid.unwrap();

    // The same call asked again, with a gate carol alone may pass.
    let mut weaker = match Entry::decode(
        honest.spec.step,
        "ApprovalRequested",
        &verified_log(&w, "gate").await[honest.spec.step as usize].payload(),
    )
    .unwrap()
    {
        Entry::ApprovalRequested(r) => r,
        other => panic!("{other:?}"),
    };
    weaker.gate.required_approvals = 1;
    weaker.gate.approvers = serde_json::from_value(json!({"users": ["carol"]})).unwrap();
    append_as_the_step_pod(&uid, Entry::ApprovalRequested(weaker)).await;
    // A waiting run is looked at again at its expiry or on any change: make one now.
    runs.patch(
        "gate",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"example.com/poke": "1"}}})),
    )
    .await
    .unwrap();

    let run = w.wait_phase("gate", Phase::Failed).await;
    let error = run.status.unwrap().error.unwrap_or_default();
    assert!(
        error.contains("gate.requiredApprovals is 1, the pinned policy says 2")
            && error.contains("gate.approvers"),
        "{error}"
    );
    warning(&w, "gate", "ApprovalRequestRefused").await;
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let raised = approvals
        .list(&ListParams::default().labels("agentrun.dev/run=gate"))
        .await
        .unwrap();
    assert_eq!(raised.items.len(), 1, "no Approval for the forged request");
    assert!(refunds(&w).await.is_empty());
    verified_log(&w, "gate").await;
}

/// A model reply within the reply cap (4 MiB) whose gated call carries 700 KiB
/// of arguments: its Approval would be over what an Approval may hold. The run
/// ends once, saying why and how large, with no Approval raised, no retry and
/// nothing done; the reply itself is kept in the verified log.
#[tokio::test]
async fn a_gated_call_too_large_for_an_approval_ends_the_run_once_naming_its_size() {
    let w = World::new("tr-huge", &[]).await;
    grant_approver_role(&w).await;
    let huge = "9".repeat(700 << 10);
    let reply = json!({"text": "Refunding.",
        "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": huge, "amount": 500}}]});
    w.standins
        .script("huge", json!([reply, finish("unreachable")]), json!([]))
        .await;
    w.create_run(
        "huge",
        json!({"input": "Refund.", "agent": gated_agent(&w, "huge", json!({}))}),
        json!({}),
    )
    .await;

    let run = w.wait_phase("huge", Phase::Failed).await;
    let error = run.status.clone().unwrap().error.unwrap_or_default();
    assert!(
        error.contains("over the limit of 524288 bytes an Approval may have"),
        "{error}"
    );
    assert!(
        error.len() <= 4096,
        "status.error is bounded: {} bytes",
        error.len()
    );
    warning(&w, "huge", "ApprovalRequestRefused").await;
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let raised = approvals
        .list(&ListParams::default().labels("agentrun.dev/run=huge"))
        .await
        .unwrap();
    assert!(raised.items.is_empty(), "no Approval was raised");
    assert_eq!(
        w.standins.model_requests("huge").await.len(),
        1,
        "the model was asked once"
    );
    assert!(w.standins.tool_requests(w.name()).await.is_empty());
    let log = verified_log(&w, "huge").await;
    let finished: Vec<_> = log
        .iter()
        .filter(|s| matches!(s, Entry::RunFinished(_)))
        .collect();
    assert_eq!(finished.len(), 1, "the run ended once: {finished:?}");
    let proposed = log.iter().find_map(|s| match s {
        Entry::ModelCall(c) => c.response.tool_calls.first().map(|t| t.arguments.clone()),
        _ => None,
    });
    assert_eq!(
        proposed.and_then(|a| a["orderId"].as_str().map(str::len)),
        Some(700 << 10),
        "the proposal is in the log, whole"
    );
}

/// A gated refund run of an agent that asks when its 100 steps are used up,
/// waiting on the refund's Approval (records: RunStarted, ModelCall,
/// ApprovalRequested); its uid and its pinned agent.
async fn waiting_asking_run(
    w: &World,
    name: &str,
) -> (String, agentrun::api::AgentTemplate, Approval) {
    grant_approver_role(w).await;
    w.standins
        .script(name, json!([refund(500), finish("unreachable")]), json!([]))
        .await;
    let mut agent = gated_agent(w, name, json!({}));
    agent["budgets"] = json!({"maxSteps": 100, "onExhausted": "Ask",
        "approvers": {"groups": ["finance-approvers"]}});
    w.create_run(
        name,
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;
    let honest = pending_approval(w, name).await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let uid = runs.get(name).await.unwrap().metadata.uid.unwrap();
    let pinned = match &verified_log(w, name).await[0] {
        Entry::RunStarted(s) => s.agent.clone().into(),
        other => panic!("{other:?}"),
    };
    (uid, pinned, honest)
}

/// Makes the controller look at a waiting run now (it would at its expiry).
async fn poke(w: &World, name: &str) {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"example.com/poke": "1"}}})),
    )
    .await
    .unwrap();
}

/// As mallory: while the refund of 500 waits for its approval, she records
/// the intent to make it, with no decision in the log. The controller
/// starts no step to make it, the run ends Failed naming the intent, and
/// nothing is refunded.
#[tokio::test]
async fn an_intent_for_a_gated_call_with_no_decision_is_never_made() {
    use agentrun::runlog::records::ToolIntent;
    let w = World::new("tr-intent", &[]).await;
    let (uid, _, honest) = waiting_asking_run(&w, "intent").await;
    append_as_the_step_pod(
        &uid,
        Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: String::new(),
            tool: "issue_refund".into(),
            arguments: honest.spec.arguments.clone(),
            key: "mallory".into(),
            sandboxed: None,
        }),
    )
    .await;
    poke(&w, "intent").await;

    let run = w.wait_phase("intent", Phase::Failed).await;
    let error = run.status.unwrap().error.unwrap_or_default();
    assert!(
        error.contains("record 3") && error.contains("no approval of exactly that call"),
        "{error}"
    );
    assert!(refunds(&w).await.is_empty());
    assert!(w.standins.tool_requests(w.name()).await.is_empty());
}
