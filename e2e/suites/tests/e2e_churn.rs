//! Runs survive churn: a controller SIGKILLed mid-run, the step store down
//! for 30 s under running runs, a decision the controller sees only after
//! its expiry. Every case ends in the same phase and result as without the
//! fault, with its log verified, no side effect done twice and no recorded
//! model answer asked again. (Deleted step pods and zombie workers are in
//! `e2e_runs`; the failpoint boundaries in `e2e/chaos`.)

mod common;

use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use agentrun::store::StepKind;
use common::approvals::{gated_agent, grant_approver_role, pending_approval, plugin, refund};
use common::store::PrivatePostgres;
use common::world::{TIMEOUT, World, call, finish};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::{Value, json};

/// `n` refunds of distinct orders (`<prefix>-<i>`), then a final answer.
fn refunds(prefix: &str, n: usize) -> Vec<Value> {
    let mut replies: Vec<Value> = (0..n)
        .map(|i| {
            call(
                "issue_refund",
                json!({"orderId": format!("{prefix}-{i}"), "amount": 10 + i}),
            )
        })
        .collect();
    replies.push(finish(&format!("refunded {n} orders")));
    replies
}

/// Waits until run `name`'s log holds at least `n` records of `kind`.
async fn wait_records(w: &World, name: &str, kind: StepKind, n: usize) {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    let store = w.store().await;
    common::wait_for(&format!("{name} to record {n} {kind}"), TIMEOUT, || async {
        let uid = runs
            .get(name)
            .await
            .map_err(|e| e.to_string())?
            .metadata
            .uid
            .unwrap_or_default();
        let have = store
            .read_all(&uid)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .filter(|r| r.kind == kind)
            .count();
        if have >= n {
            Ok(())
        } else {
            Err(format!("{have} {kind} records"))
        }
    })
    .await;
}

/// Each effect at the tool server happened once: no two share their
/// arguments (each refund is of its own order) or their key.
async fn assert_no_effect_twice(w: &World, expected: usize) {
    let effects = w.standins.effects(w.name()).await;
    let args: std::collections::HashSet<String> =
        effects.iter().map(|e| e["args"].to_string()).collect();
    let keys: std::collections::HashSet<String> =
        effects.iter().map(|e| e["key"].to_string()).collect();
    assert_eq!(
        args.len(),
        effects.len(),
        "an effect happened twice: {effects:?}"
    );
    assert_eq!(
        keys.len(),
        effects.len(),
        "a key was used twice: {effects:?}"
    );
    assert_eq!(effects.len(), expected, "{effects:?}");
}

#[tokio::test]
async fn a_sigkilled_leader_is_replaced_by_its_standby_and_nothing_happens_twice() {
    // Short time slices: the run needs new Jobs after the kill.
    let mut w = World::new("sigkill", &["--time-slice-seconds", "2"]).await;
    let _standby = w.replica("standby");
    let replies = refunds("k", 5);
    w.standins
        .script("sigkill", Value::Array(replies.clone()), json!([]))
        .await;
    w.standins
        .configure_tools(w.name(), json!({"delayMs": {"issue_refund": 1000}}))
        .await;
    w.create_run(
        "sigkill",
        json!({"input": "Refund the five orders.", "agent": w.agent("sigkill")}),
        json!({}),
    )
    .await;
    wait_records(&w, "sigkill", StepKind::ToolResult, 1).await;
    // No graceful hand-over: the Lease runs out and the standby takes it.
    w.kill_controller();
    let leases: Api<Lease> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for("the standby to lead", TIMEOUT, || async {
        let holder = leases
            .get_opt("agentrun-controller")
            .await
            .map_err(|e| e.to_string())?
            .and_then(|l| l.spec?.holder_identity);
        if holder.as_deref() == Some("standby") {
            Ok(())
        } else {
            Err(format!("held by {holder:?}"))
        }
    })
    .await;
    let run = w.wait_phase("sigkill", Phase::Succeeded).await;
    assert_eq!(
        run.status.as_ref().and_then(|s| s.result.as_deref()),
        Some("refunded 5 orders")
    );
    let log = w.log(&run).await; // verified against status.log
    assert_eq!(
        log.iter()
            .filter(|(r, _)| r.kind == StepKind::ToolResult)
            .count(),
        5
    );
    assert_eq!(
        w.standins.model_requests("sigkill").await.len(),
        replies.len(),
        "no recorded model answer was asked again"
    );
    assert_no_effect_twice(&w, 5).await;
}

#[tokio::test]
async fn a_store_outage_pauses_running_runs_and_they_go_on() {
    let (pg, url) = PrivatePostgres::up("pg-churn", 25434).await;
    let w = World::on_store("outage", &["--time-slice-seconds", "2"], &url).await;
    let runs = ["outage-a", "outage-b"];
    let mut scripts = Vec::new();
    for (i, name) in runs.iter().enumerate() {
        let replies = refunds(&format!("o{i}"), 4);
        w.standins
            .script(name, Value::Array(replies.clone()), json!([]))
            .await;
        scripts.push(replies.len());
        w.create_run(
            name,
            json!({"input": "Refund the four orders.", "agent": w.agent(name)}),
            json!({}),
        )
        .await;
    }
    w.standins
        .configure_tools(w.name(), json!({"delayMs": {"issue_refund": 1000}}))
        .await;
    for name in runs {
        wait_records(&w, name, StepKind::ToolResult, 1).await;
    }
    // The outage lasts 30 s (the fault itself, not a wait for a condition).
    pg.run("stop");
    tokio::time::sleep(Duration::from_secs(30)).await;
    pg.run("start");
    for (name, replies) in runs.iter().zip(scripts) {
        // wait_phase fails at once if a run ends any other way.
        let run = w.wait_phase(name, Phase::Succeeded).await;
        assert_eq!(
            run.status.as_ref().and_then(|s| s.result.as_deref()),
            Some("refunded 4 orders")
        );
        w.log(&run).await;
        assert_eq!(
            w.standins.model_requests(name).await.len(),
            replies,
            "{name}: no recorded model answer was asked again"
        );
    }
    assert_no_effect_twice(&w, 8).await;
}

#[tokio::test]
async fn an_approval_given_before_expiry_counts_though_the_controller_saw_it_late() {
    let mut w = World::new("late", &[]).await;
    grant_approver_role(&w).await;
    w.standins
        .script(
            "late",
            json!([refund(500), finish("refunded 500")]),
            json!([]),
        )
        .await;
    let agent = gated_agent(
        &w,
        "late",
        json!({"expiresAfter": "20s", "onExpiry": "Fail"}),
    );
    w.create_run(
        "late",
        json!({"input": "Refund order 1042.", "agent": agent}),
        json!({}),
    )
    .await;
    let approval = pending_approval(&w, "late").await;
    let name = approval.metadata.name.clone().unwrap();
    // The controller is down when alice approves, in time.
    w.stop_controller();
    let (ok, text) = plugin(&w, "alice", &["approve", &name, "-m", "in time"]);
    assert!(ok, "{text}");
    // It comes back only after the expiry.
    let expires = approval.spec.expires_at.0;
    common::wait_for("the Approval's expiry to pass", TIMEOUT, || async {
        if jiff::Timestamp::now() > expires + jiff::SignedDuration::from_secs(2) {
            Ok(())
        } else {
            Err(format!("expires at {expires}"))
        }
    })
    .await;
    let _back = w.replica("ctrl-back");
    let run = w.wait_phase("late", Phase::Succeeded).await;
    assert_eq!(
        run.status.as_ref().and_then(|s| s.result.as_deref()),
        Some("refunded 500")
    );
    assert_no_effect_twice(&w, 1).await;
}
