//! Replay tests on a real cluster (docs/design.md §11): `kubectl agentrun
//! replay-test` runs a new Agent version against recorded runs. The model
//! is asked anew, no tool call reaches the tools, no Approval is raised,
//! and the report says which runs went the same way and where one diverged.

mod common;

use agentrun::api::{Agent, AgentRun, Approval, Phase};
use agentrun::replay::Entry;
use common::approvals::{
    decide, entry, gated_agent, grant_approver_role, pending_approval, refund,
};
use common::world::{World, call, finish};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

fn lookup() -> Value {
    call("lookup_order", json!({"orderId": "1042"}))
}

/// Records run `name` with model script `name` answering `replies`
/// (refunds over 100 need finance's approval: alice approves).
async fn record(w: &World, name: &str, replies: Value, result: &str) {
    w.standins.script(name, replies, json!([])).await;
    w.create_run(
        name,
        json!({"input": format!("Refund order 1042 ({name})."),
               "agent": gated_agent(w, name, json!({}))}),
        json!({}),
    )
    .await;
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let ended = common::wait_for(
        &format!("{name} to end or wait"),
        common::world::TIMEOUT,
        || async {
            let phase = runs.get(name).await.ok()?.status?.phase?;
            matches!(phase, Phase::Succeeded | Phase::AwaitingApproval).then_some(phase)
        },
    )
    .await;
    if ended == Phase::AwaitingApproval {
        let a = pending_approval(w, name).await;
        let hash = a.spec.arguments_hash.clone();
        decide(
            w,
            "alice",
            a.metadata.name.as_deref().unwrap(),
            entry("alice", "Approve", &hash, "ok"),
        )
        .await
        .expect("alice approves");
    }
    let run = w.wait_phase(name, Phase::Succeeded).await;
    assert_eq!(run.status.unwrap().result.as_deref(), Some(result));
}

#[tokio::test]
async fn a_new_prompt_replayed_on_three_runs_two_the_same_one_diverged_and_nothing_called() {
    let w = World::new("rtest", &[]).await;
    grant_approver_role(&w).await;
    // Two runs refunded 150 (gated, approved); one refunded 90.
    let big = json!([lookup(), refund(150), finish("Refunded 150.")]);
    record(&w, "one", big.clone(), "Refunded 150.").await;
    record(&w, "two", big, "Refunded 150.").await;
    record(
        &w,
        "three",
        json!([lookup(), refund(90), finish("Refunded 90.")]),
        "Refunded 90.",
    )
    .await;

    // The new version: another prompt, whose model (a deterministic
    // script, by conversation turn) always looks up, then refunds 150.
    let mut v2 = gated_agent(&w, "v2", json!({}));
    v2["prompt"] = json!({"version": "v2", "system": "Refund the full order total."});
    w.standins
        .script_by_turn(
            "v2",
            json!([lookup(), refund(150), finish("Refunded 150.")]),
            json!([]),
        )
        .await;
    let agent: Agent = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "Agent",
        "metadata": {"name": "refunds-v2"}, "spec": v2
    }))
    .unwrap();
    Api::<Agent>::namespaced(w.client.clone(), w.name())
        .create(&PostParams::default(), &agent)
        .await
        .unwrap();

    // The tester may read the recorded runs' logs (by name: the review
    // asks for the stamped requester).
    common::log_api::grant_verbs(&w.client, w.name(), "admin", &["get"]).await;
    let tools_before = w.standins.tool_requests(w.name()).await.len();
    let approvals: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    let approvals_before = approvals
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    let store = common::store::e2e_store_url().await;
    let (ok, text) = common::approvals::plugin(
        &w,
        "admin",
        &[
            "replay-test",
            "one",
            "two",
            "three",
            "--agent",
            "refunds-v2",
            "-o",
            "json",
            "--timeout",
            "4m",
            "--store-url",
            &store,
            "--controller-namespace",
            w.name(),
        ],
    );
    assert!(!ok, "a diverged run fails the command: {text}");
    assert!(text.contains("1 of 3 runs diverged"), "{text}");
    let report: Value = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .next()
        .expect("the JSON report first")
        .unwrap_or_else(|e| panic!("{e}: {text}"));
    let by_run = |name: &str| -> Value {
        report["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["run"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no report of {name}: {report}"))
    };
    for name in ["one", "two"] {
        let r = by_run(name);
        assert_eq!(r["outcome"], "Succeeded", "{r}");
        assert_eq!(r["sameAnswer"], true, "{r}");
        assert!(r.get("diverged").is_none(), "{r}");
        // The refund of 150 was put to a human, and would be again.
        assert_eq!(
            (
                r["recorded"]["gatedCalls"].clone(),
                r["new"]["gatedCalls"].clone()
            ),
            (json!(1), json!(1))
        );
        assert!(r["new"]["tokens"].as_u64().unwrap() > 0);
    }
    let three = by_run("three");
    assert_eq!(three["outcome"], "Diverged", "{three}");
    assert_eq!(three["sameAnswer"], false);
    let d = &three["diverged"];
    assert_eq!(d["call"], 2, "at its second call: {three}");
    assert_eq!(
        d["recorded"]["arguments"],
        json!({"orderId": "1042", "amount": 90})
    );
    assert_eq!(
        d["new"]["arguments"],
        json!({"orderId": "1042", "amount": 150})
    );
    assert_eq!(report["total"]["diverged"], 1);
    assert_eq!(report["total"]["sameAnswer"], 2);

    // No tool call reached the tools; no Approval was raised; the model
    // was asked anew (3 + 3 + 2 answers).
    assert_eq!(w.standins.tool_requests(w.name()).await.len(), tools_before);
    assert_eq!(
        approvals
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        approvals_before
    );
    assert_eq!(w.standins.model_requests("v2").await.len(), 8);

    // The tests are runs of their own, marked as tests, with verified logs
    // that begin with the recorded run's task and name it.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let tests: Vec<AgentRun> = runs
        .list(&ListParams::default().labels("agentrun.dev/replay-test"))
        .await
        .unwrap()
        .items;
    assert_eq!(tests.len(), 3);
    for t in &tests {
        let of = t.spec.test_of.clone().expect("spec.testOf");
        assert_eq!(of.agent, "refunds-v2");
        let log = w.log(t).await;
        match &log[1].1 {
            Entry::Forked(f) => {
                assert_eq!((f.parent_name.as_str(), f.seq), (of.run.as_str(), 0));
                assert!(f.test.is_some());
            }
            other => panic!("{other:?}"),
        }
        let name = t.metadata.name.clone().unwrap();
        let (ok, text) = common::approvals::plugin(
            &w,
            "admin",
            &[
                "verify",
                &name,
                "--store-url",
                &store,
                "--controller-namespace",
                w.name(),
            ],
        );
        assert!(ok && text.contains("chain intact"), "{name}: {text}");
    }
}
