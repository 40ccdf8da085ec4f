//! An upgrade from an earlier release of this repository (issue 25,
//! "Upgrades"): runs started by that release's controller and step binary
//! wait for approval, run and finish; then the operator is upgraded (CRDs,
//! admission policies, store schema, controller) while they are in flight,
//! and every promise is checked: the waiting runs continue on the Approvals
//! people have in front of them (no second one beside them), nothing is
//! asked of the model twice, no tool effect happens twice, every log
//! verifies against its run's status.
//!
//! The earlier release is built by e2e/build-upgrade-from.sh (cached by
//! commit; e2e/test runs it as a stage and points the process node's
//! `agentrun:upgrade-from` image at its binaries, as a real node keeps the
//! image a Job's pod started with). Its dir is $AGENTRUN_UPGRADE_FROM_BIN.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use agentrun::api::{AgentRun, Approval, Phase};
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

use common::approvals::{decide, entry, grant_approver_role, refund};
use common::controller::ControllerProcess;
use common::world::{World, finish};

/// The image the earlier release's step Jobs use (e2e/test maps it to its binaries).
const OLD_STEP_IMAGE: &str = "agentrun:upgrade-from";

/// The earlier release's binaries: $AGENTRUN_UPGRADE_FROM_BIN, else built
/// (or found in the cache) by e2e/build-upgrade-from.sh.
fn old_release() -> PathBuf {
    if let Ok(dir) = std::env::var("AGENTRUN_UPGRADE_FROM_BIN") {
        return PathBuf::from(dir);
    }
    let script = common::root().join("e2e/build-upgrade-from.sh");
    let out = std::process::Command::new(script)
        .output()
        .expect("running e2e/build-upgrade-from.sh");
    assert!(
        out.status.success(),
        "e2e/build-upgrade-from.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A fresh database on the e2e PostgreSQL, migrated by the earlier release.
async fn old_store(old: &std::path::Path) -> String {
    use sqlx::Connection;
    let admin = common::store::pg_admin_url();
    let name = format!("agentrun_upgrade_{}", std::process::id());
    let mut conn = sqlx::PgConnection::connect(admin).await.unwrap();
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name}"
    )))
    .execute(&mut conn)
    .await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let mut url = url::Url::parse(admin).unwrap();
    url.set_path(&format!("/{name}"));
    let migrated = std::process::Command::new(old.join("agentrun"))
        .args(["store", "--store-url", url.as_str(), "migrate"])
        .output()
        .unwrap();
    assert!(
        migrated.status.success(),
        "the earlier release's migrate: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    url.to_string()
}

/// The agent both releases understand: a lookup and a refund over 100
/// that needs a finance approver.
fn agent(w: &World, script: &str) -> Value {
    let base = &w.standins.base;
    let t = w.name();
    json!({
        "prompt": {"version": "v1", "system": "You are a careful refund agent."},
        "model": {
            "provider": "OpenAI", "name": "gpt-e2e",
            "endpoint": format!("{base}/scripts/{script}/v1"),
            "secretRef": {"name": "model-key", "key": "apiKey"}
        },
        "tools": [
            {"name": "lookup_order", "description": "Looks an order up.",
             "inputSchema": {"type": "object", "required": ["orderId"], "properties": {"orderId": {"type": "string"}}},
             "http": {"url": format!("{base}/tools/{t}/lookup_order"), "idempotent": true, "readOnly": true}},
            {"name": "issue_refund", "description": "Refunds an amount.",
             "inputSchema": {"type": "object", "required": ["orderId", "amount"],
                             "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}}},
             "http": {"url": format!("{base}/tools/{t}/issue_refund"), "idempotent": true}}
        ],
        "approval": {"rules": [{
            "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
            "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "30m", "onExpiry": "Fail"
        }]}
    })
}

/// The run's status as the API server has it.
async fn status(w: &World, run: &str) -> agentrun::api::AgentRunStatus {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.get(run).await.unwrap().status.unwrap_or_default()
}

/// Names of the Approvals of `run`.
async fn approvals_of(w: &World, run: &str) -> Vec<String> {
    let api: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
    api.list(&ListParams::default().labels(&format!("agentrun.dev/run={run}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|a| a.metadata.name)
        .collect()
}

#[tokio::test]
async fn runs_waiting_running_and_finished_survive_an_upgrade_from_an_earlier_release() {
    if common::existing_cluster() {
        println!(
            "skipped: the earlier release's step image is the local process node's \
             (agentrun:upgrade-from, see e2e/test)"
        );
        return;
    }
    let old = old_release();
    let store_url = old_store(&old).await;
    let mut w = World::with_first_controller("upgrade", &store_url, |ns| {
        ControllerProcess::start_release(
            &old.join("agentrun"),
            ns,
            "old",
            &store_url,
            OLD_STEP_IMAGE,
        )
    })
    .await;
    // The earlier release's CRDs and admission policies, as it was installed.
    let old_src = old.join("../../src");
    common::apply_crds(&w.client, old_src.join("crds/crds.yaml").to_str().unwrap()).await;
    common::apply_manifests(
        &w.client,
        old_src.join("crds/admission.yaml").to_str().unwrap(),
    )
    .await;
    grant_approver_role(&w).await;

    let scripts = [
        ("approve", json!([refund(500), finish("refunded")])),
        ("reject", json!([refund(700), finish("declined")])),
        // The model answers slowly: the step is in flight across the upgrade.
        (
            "running",
            json!([
                {"delayMs": 15000, "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": "7"}}]},
                finish("looked up")
            ]),
        ),
        ("finished", json!([finish("done")])),
    ];
    for (name, replies) in &scripts {
        w.standins.script(name, replies.clone(), json!([])).await;
        w.create_run(
            name,
            json!({"input": "Help the customer.", "agent": agent(&w, name)}),
            json!({}),
        )
        .await;
    }
    // As the earlier release leaves them.
    w.wait_phase("finished", Phase::Succeeded).await;
    let mut raised = Vec::new();
    for run in ["approve", "reject"] {
        let name = common::approvals::awaited_approval(&w.client, w.name(), run).await;
        let api: Api<Approval> = Api::namespaced(w.client.clone(), w.name());
        raised.push((run, api.get(&name).await.unwrap()));
    }
    common::wait_for(
        "the slow step to be in flight",
        Duration::from_secs(60),
        || async {
            let n = w.standins.model_requests("running").await.len();
            (n == 1).then_some(()).ok_or(format!("{n} model calls"))
        },
    )
    .await;

    // The upgrade: controller down, CRDs, admission and schema, new controller.
    w.stop_controller();
    common::install_crds(&w.client).await;
    w.store()
        .await
        .migrate()
        .await
        .expect("migrating the store");
    w.restart_controller().await;

    // The approvers decide on the Approvals they have in front of them.
    for ((run, approval), verdict) in raised.iter().zip(["Approve", "Reject"]) {
        let name = approval.metadata.name.clone().unwrap();
        decide(
            &w,
            "alice",
            &name,
            entry("alice", verdict, &approval.spec.arguments_hash, "ok"),
        )
        .await
        .unwrap_or_else(|e| panic!("alice decides {name} of {run}: {e}"));
    }
    for run in ["approve", "reject", "running", "finished"] {
        let done = w.wait_phase(run, Phase::Succeeded).await;
        // Every log verifies against its run's status.
        w.log(&done).await;
    }

    // No second Approval beside the one raised before the upgrade.
    for (run, approval) in &raised {
        assert_eq!(
            approvals_of(&w, run).await,
            vec![approval.metadata.name.clone().unwrap()],
            "{run}: one Approval, the earlier release's"
        );
    }
    for run in ["running", "finished"] {
        assert!(approvals_of(&w, run).await.is_empty(), "{run}: no Approval");
    }
    // Nothing asked twice: one model call per scripted reply.
    for (name, replies) in &scripts {
        let asked = w.standins.model_requests(name).await.len();
        assert_eq!(
            asked,
            replies.as_array().unwrap().len(),
            "{name}: model calls"
        );
    }
    // Nothing done twice: the approved refund once, the rejected one never.
    let effects = w.standins.effects(w.name()).await;
    let refunds: Vec<&Value> = effects
        .iter()
        .filter(|e| e["tool"] == "issue_refund")
        .map(|e| &e["args"]["amount"])
        .collect();
    assert_eq!(refunds, vec![&json!(500)], "refunds: {effects:?}");
    let lookups = effects
        .iter()
        .filter(|e| e["tool"] == "lookup_order")
        .count();
    assert!(lookups <= 1, "the lookup ran {lookups} times: {effects:?}");
    assert_eq!(
        status(&w, "reject").await.result.as_deref(),
        Some("declined")
    );
}
