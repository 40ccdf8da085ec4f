//! Trust attacks on the step log (issue 10 items 1 and 9), played as a
//! namespace user (carol) who may read Secrets and create pods in the run's
//! namespace, and as a database superuser who rewrites history:
//!
//! - no Secret in the namespace holds a store URL or a database password;
//! - one run's gateway token reads or writes no other run, appends no
//!   controller record (a forged `ApprovalDecided`) and opens nothing once
//!   its run finished;
//! - a log edited, cut short or extended with a forged (unsigned) decision in
//!   PostgreSQL stops the run (`LogIntact=False`,
//!   reason `LogTampered`, `status.error`, a Warning Event, the metric) and
//!   `status.log` never moves backwards.

use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use agentrun::store::{RecordDraft, RemoteStore, StepKind, StepStore};
use k8s_openapi::api::core::v1::{Event, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use sqlx::Connection;

use super::common::{self, world::World};

const TIMEOUT: Duration = common::world::TIMEOUT;

/// An agent whose refunds over 100 wait for a finance approver: a run stays
/// unfinished, holding no pod, until someone decides.
fn gated_agent(w: &World, script: &str) -> Value {
    let mut agent = w.agent(script);
    agent["approval"] = json!({"rules": [{
        "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
        "approvers": {"groups": ["finance-approvers"]}, "expiresAfter": "1h", "onExpiry": "Fail"
    }]});
    agent
}

fn refund(amount: u64) -> Value {
    json!({"text": format!("Refunding {amount}."),
           "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": amount}}]})
}

/// Starts a gated run and waits until it waits for its approval.
async fn awaiting_run(w: &World, name: &str) -> AgentRun {
    w.standins
        .script(
            name,
            json!([refund(500), common::world::finish("done")]),
            json!([]),
        )
        .await;
    w.create_run(
        name,
        json!({"input": "Refund order 1042.", "agent": gated_agent(w, name)}),
        json!({}),
    )
    .await;
    w.wait_phase(name, Phase::AwaitingApproval).await
}

/// Lets carol read Secrets and create pods in the namespace (and nothing of agentrun).
async fn namespace_user(w: &World) -> kube::Client {
    let api = |kind: &str| -> Api<kube::api::DynamicObject> {
        let (group, version) = ("rbac.authorization.k8s.io", "v1");
        let ar = kube::discovery::ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: format!("{group}/{version}"),
            kind: kind.into(),
            plural: format!("{}s", kind.to_lowercase()),
        };
        Api::namespaced_with(w.client.clone(), w.name(), &ar)
    };
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "namespace-user"},
        "rules": [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create"]}
        ]
    });
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "namespace-user"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "namespace-user"},
        "subjects": [{"kind": "User", "name": "carol", "apiGroup": "rbac.authorization.k8s.io"}]
    });
    for (kind, obj) in [("Role", role), ("RoleBinding", binding)] {
        api(kind)
            .create(&Default::default(), &serde_json::from_value(obj).unwrap())
            .await
            .unwrap_or_else(|e| panic!("creating carol's {kind}: {e}"));
    }
    common::client_as("carol").await
}

/// Every value of every Secret carol can read in the namespace.
async fn secret_values(carol: &kube::Client, ns: &str) -> Vec<(String, String, String)> {
    let secrets: Api<Secret> = Api::namespaced(carol.clone(), ns);
    let list = secrets
        .list(&ListParams::default())
        .await
        .expect("carol may list Secrets");
    let mut out = Vec::new();
    for s in list.items {
        let name = s.metadata.name.clone().unwrap_or_default();
        for (k, v) in s.data.unwrap_or_default() {
            out.push((name.clone(), k, String::from_utf8_lossy(&v.0).into_owned()));
        }
    }
    out
}

async fn run_token(carol: &kube::Client, ns: &str, uid: &str) -> String {
    let secrets: Api<Secret> = Api::namespaced(carol.clone(), ns);
    let s = secrets
        .get(&common::controller::credential_secret(uid))
        .await
        .expect("the run's step credential Secret");
    let owner = &s.metadata.owner_references.as_ref().expect("owned")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("AgentRun", uid),
        "the credential is owned by its run (collected with it)"
    );
    let data = s.data.expect("data");
    String::from_utf8(data["token"].0.clone()).unwrap()
}

fn refused(
    result: Result<impl std::fmt::Debug, agentrun::store::StoreError>,
    what: &str,
) -> String {
    match result {
        Ok(v) => panic!("{what}: the gateway allowed it: {v:?}"),
        Err(e) => {
            assert_eq!(e.metric_label(), "permission_denied", "{what}: {e}");
            e.to_string()
        }
    }
}

#[tokio::test]
async fn store_a_namespace_user_gets_one_runs_token_and_nothing_more() {
    let w = World::new("trust-store", &[]).await;
    let carol = namespace_user(&w).await;
    let a = awaiting_run(&w, "run-a").await;
    let b = awaiting_run(&w, "run-b").await;
    let (uid_a, uid_b) = (
        a.metadata.uid.clone().unwrap(),
        b.metadata.uid.clone().unwrap(),
    );

    // No Secret in the namespace names the database or its password.
    let admin = url::Url::parse(common::store::pg_admin_url()).unwrap();
    let password = admin.password().unwrap_or_default().to_string();
    let values = secret_values(&carol, w.name()).await;
    assert!(!values.is_empty(), "carol sees the run credentials");
    for (name, key, value) in &values {
        let lower = value.to_ascii_lowercase();
        assert!(
            !lower.contains("postgres") && !lower.contains("sqlite") && !lower.contains("://"),
            "Secret {name} key {key} holds a store URL"
        );
        assert!(
            password.is_empty() || !value.contains(&password),
            "Secret {name} key {key} holds the database password"
        );
    }
    let secrets: Api<Secret> = Api::namespaced(carol.clone(), w.name());
    assert!(
        secrets
            .get_opt("agentrun-step-store")
            .await
            .unwrap()
            .is_none(),
        "no shared store Secret"
    );

    // With run-a's token: run-a's own log reads; run-b's is closed.
    let token_a = run_token(&carol, w.name(), &uid_a).await;
    let gw = RemoteStore::new(&w.step_api_url(), &token_a, Duration::from_secs(10)).unwrap();
    let log_a = gw
        .read_all(&uid_a)
        .await
        .expect("a run's token reads its own log");
    assert!(log_a.len() >= 3, "{log_a:?}");
    let msg = refused(gw.read_all(&uid_b).await, "reading another run");
    assert!(msg.contains("not this run's step token"), "{msg}");
    refused(gw.head(&uid_b).await, "reading another run's head");
    refused(
        gw.acquire(&uid_b, "carol", Duration::from_secs(5)).await,
        "leasing another run",
    );
    let head_b = agentrun::store::open(&common::store::e2e_store_url().await)
        .await
        .unwrap()
        .head(&uid_b)
        .await
        .unwrap();
    let obs = RecordDraft::new(StepKind::Observation, json!({"text": "forged"}))
        .seal(&head_b)
        .unwrap();
    refused(gw.append(&uid_b, 1, &obs).await, "appending to another run");
    // No token, or a made-up one.
    let anon = RemoteStore::new(&w.step_api_url(), "", Duration::from_secs(10)).unwrap();
    refused(anon.read_all(&uid_a).await, "reading without a token");
    let guess =
        RemoteStore::new(&w.step_api_url(), &"ab".repeat(32), Duration::from_secs(10)).unwrap();
    refused(guess.read_all(&uid_a).await, "reading with a guessed token");

    // A forged decision on run-a, under a lease it really holds: refused by kind.
    let lease = gw
        .acquire(&uid_a, "carol", Duration::from_secs(5))
        .await
        .expect("the run's token may take its lease while no step runs");
    let head_a = gw.head(&uid_a).await.unwrap();
    let request_seq = head_a.len - 1;
    let forged = RecordDraft::new(
        StepKind::ApprovalDecided,
        json!({"requestSeq": request_seq, "verdict": "Approve", "approver": "alice",
               "argumentsHash": "0".repeat(64), "reason": "forged"}),
    )
    .seal(&head_a)
    .unwrap();
    let msg = refused(
        gw.append(&uid_a, lease.epoch, &forged).await,
        "forging ApprovalDecided",
    );
    assert!(msg.contains("may not append ApprovalDecided"), "{msg}");
    for kind in [
        StepKind::RunStarted,
        StepKind::VersionChanged,
        StepKind::RunFinished,
    ] {
        let r = RecordDraft::new(kind, json!({})).seal(&head_a).unwrap();
        refused(gw.append(&uid_a, lease.epoch, &r).await, kind.as_str());
    }
    gw.release(&lease).await.unwrap();
    assert_eq!(
        gw.head(&uid_a).await.unwrap(),
        head_a,
        "nothing was appended"
    );
    assert!(
        w.standins.effects(w.name()).await.is_empty(),
        "no refund happened"
    );

    // Once run-a is finished (cancelled: the controller records RunFinished), its token opens nothing.
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.patch(
        "run-a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"cancel": true}})),
    )
    .await
    .unwrap();
    let done = w.wait_phase("run-a", Phase::Cancelled).await;
    let msg = refused(gw.read_all(&uid_a).await, "reading a finished run");
    assert!(msg.contains("is finished"), "{msg}");
    refused(
        gw.acquire(&uid_a, "carol", Duration::from_secs(5)).await,
        "leasing a finished run",
    );
    let log = w.log(&done).await;
    assert_eq!(
        common::world::kinds(&log).last(),
        Some(&"RunFinished"),
        "the log verifies and ends with the controller's record"
    );
    assert!(w.standins.effects(w.name()).await.is_empty());
}

/// A long log's checkpoint (here from its first model call) lets a
/// controller without the replayed log start reading at the window; the
/// records before it that stay in force are checked against the hashes the
/// controller signed, so a rewritten run start stops the run all the same.
#[tokio::test]
async fn store_a_record_rewritten_before_the_checkpoint_stops_the_run() {
    let w = World::new("trust-ckpt", &["--checkpoint-min-records", "1"]).await;
    let before = awaiting_run(&w, "pinned").await;
    let checkpoint = before
        .status
        .as_ref()
        .and_then(|s| s.log.as_ref())
        .and_then(|l| l.checkpoint.clone())
        .expect("the waiting run has a checkpoint");
    assert!(
        checkpoint.seq >= 1 && checkpoint.pinned.iter().any(|p| p.seq == 0),
        "{checkpoint:?}"
    );
    let uid = before.metadata.uid.clone().unwrap();
    let touched = rewrite_body(
        &uid,
        "RunStarted",
        "Refund order 1042.",
        "Refund order 1043.",
    )
    .await;
    assert_eq!(touched, 1, "the RunStarted was edited");
    let after = wait_tampered(&w, "pinned").await;
    let now = after.status.as_ref().unwrap();
    assert_eq!(now.phase, Some(Phase::Failed), "{now:?}");
    let error = now.error.clone().unwrap_or_default();
    assert!(
        error.contains("the hash the checkpoint signed")
            && error.contains("the record was altered"),
        "status.error {error:?}"
    );
    assert!(w.standins.effects(w.name()).await.is_empty());
}

/// Replaces `from` by `to` in the bodies of the run's `kind` records as the
/// database superuser, with the append-only trigger off; returns how many
/// records it touched.
async fn rewrite_body(uid: &str, kind: &str, from: &str, to: &str) -> u64 {
    let update = format!(
        "UPDATE agentrun_steps SET body = replace(body, '{from}', '{to}') WHERE run = $1 AND kind = '{kind}'"
    );
    as_superuser(
        &[
            "SET session_replication_role = replica",
            &update,
            "SET session_replication_role = DEFAULT",
        ],
        uid,
    )
    .await
}

/// Runs `sql` (with `$1` = the run uid) as the database superuser, on one
/// connection; returns how many rows the statements naming the run touched.
async fn as_superuser(sql: &[&str], uid: &str) -> u64 {
    let mut url = url::Url::parse(common::store::pg_admin_url()).unwrap();
    url.set_path("/agentrun_e2e");
    let mut conn = sqlx::PgConnection::connect(url.as_str())
        .await
        .expect("connecting as the superuser");
    let mut touched = 0;
    for &q in sql {
        let query = sqlx::query(sqlx::AssertSqlSafe(q.to_string()));
        let query = if q.contains("$1") {
            query.bind(uid)
        } else {
            query
        };
        let done = query
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{q} for run {uid}: {e}"));
        if q.contains("$1") {
            touched += done.rows_affected();
        }
    }
    touched
}

/// Waits for the run to be stopped for a tampered log; returns it.
async fn wait_tampered(w: &World, name: &str) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    // Any change to the run makes the controller read its log again.
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"test/poke": "1"}}})),
    )
    .await
    .unwrap();
    common::wait_for(
        &format!("{name} to stop for its tampered log"),
        TIMEOUT,
        || async {
            let r = runs.get(name).await.map_err(|e| e.to_string())?;
            let s = r.status.clone().unwrap_or_default();
            let intact = s.conditions.iter().find(|c| c.type_ == "LogIntact");
            match intact {
                Some(c) if c.status == "False" && c.reason == "LogTampered" => Ok(r),
                _ => Err(format!("{:?}", r.status)),
            }
        },
    )
    .await
}

async fn warning_events(w: &World, name: &str, reason: &str) -> usize {
    let events: Api<Event> = Api::namespaced(w.client.clone(), w.name());
    events
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|e| e.type_.as_deref() == Some("Warning") && e.reason.as_deref() == Some(reason))
        .count()
}

#[tokio::test]
async fn store_a_log_rewritten_in_the_database_stops_the_run() {
    let w = World::new("trust-tamper", &[]).await;
    let edited = awaiting_run(&w, "edited").await;
    let cut = awaiting_run(&w, "cut").await;
    let forged = awaiting_run(&w, "forged").await;

    // 1. History edited by the superuser with the append-only trigger off:
    //    the model's proposed refund becomes 50 (under the approval threshold).
    let uid = edited.metadata.uid.clone().unwrap();
    let touched = rewrite_body(&uid, "ModelCall", "\"amount\":500", "\"amount\":50").await;
    assert_eq!(touched, 1, "the ModelCall was edited");
    // 2. The tail deleted as the retention role (the chain that is left verifies).
    let uid_cut = cut.metadata.uid.clone().unwrap();
    let touched = as_superuser(
        &[
            "SET ROLE agentrun_retention",
            "DELETE FROM agentrun_steps WHERE run = $1 AND seq = (SELECT max(seq) FROM agentrun_steps WHERE run = $1)",
            "RESET ROLE",
        ],
        &uid_cut,
    )
    .await;
    assert_eq!(touched, 1, "the last record was deleted");

    // 3. A decision appended with a database credential: a correct chain that
    //    extends the anchor, but no controller signature.
    let uid_forged = forged.metadata.uid.clone().unwrap();
    let db = agentrun::store::open(&common::store::e2e_store_url().await)
        .await
        .unwrap();
    let lease = db
        .acquire(&uid_forged, "mallory", Duration::from_secs(5))
        .await
        .unwrap();
    let head = db.head(&uid_forged).await.unwrap();
    let decision = RecordDraft::new(
        StepKind::ApprovalDecided,
        json!({"requestSeq": head.len - 1, "approval": "forged", "verdict": "Approve",
               "decisions": [{"approver": "alice", "verdict": "Approve", "argumentsHash": "0".repeat(64)}],
               "observationsHash": "0".repeat(64)}),
    )
    .seal(&head)
    .unwrap();
    db.append(&uid_forged, lease.epoch, &decision)
        .await
        .unwrap();
    db.release(&lease).await.unwrap();

    for (before, how) in [
        (&edited, "the record was altered"),
        (&cut, "records were removed"),
        (&forged, "not signed by the controller"),
    ] {
        let name = before.metadata.name.clone().unwrap();
        let after = wait_tampered(&w, &name).await;
        let (was, now) = (
            before.status.as_ref().unwrap(),
            after.status.as_ref().unwrap(),
        );
        assert_eq!(now.phase, Some(Phase::Failed), "{name}: {now:?}");
        let error = now.error.clone().unwrap_or_default();
        assert!(error.contains(how), "{name}: status.error {error:?}");
        let (log_was, log_now) = (was.log.as_ref().unwrap(), now.log.as_ref().unwrap());
        assert_eq!(
            (log_now.length, &log_now.head_hash),
            (log_was.length, &log_was.head_hash),
            "{name}: status.log never moves backwards"
        );
        common::wait_for(
            &format!("a LogTampered Warning on {name}"),
            TIMEOUT,
            || async { (warning_events(&w, &name, "LogTampered").await > 0).then_some(()) },
        )
        .await;
    }
    let failures =
        common::controller::metric(w.metrics_port(), "agentrun_log_integrity_failures_total").await;
    assert_eq!(failures, Some(3.0));
    // Nothing ran on the strength of the edited record.
    assert!(w.standins.effects(w.name()).await.is_empty());

    // A step runner given the anchor refuses the shortened log too, before
    // acting on it (the chain that is left verifies on its own).
    let was = cut.status.as_ref().unwrap().log.clone().unwrap();
    let secrets: Api<Secret> = Api::namespaced(w.client.clone(), w.name());
    let token = secrets
        .get(&common::controller::credential_secret(&uid_cut))
        .await
        .unwrap()
        .data
        .unwrap()["token"]
        .0
        .clone();
    let out = tokio::process::Command::new(common::binary("agentrun"))
        .arg("step")
        .env("AGENTRUN_RUN_UID", &uid_cut)
        .env("AGENTRUN_STORE_URL", w.step_api_url())
        .env("AGENTRUN_STORE_TOKEN", String::from_utf8(token).unwrap())
        .env(
            "AGENTRUN_LOG_ANCHOR",
            format!("{}:{}", was.length, was.head_hash.unwrap()),
        )
        .env("POD_NAME", "anchor-check")
        .output()
        .await
        .expect("running agentrun step");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the runner went on: {stderr}");
    assert!(
        stderr.contains("checking the step log against the controller's anchor")
            && stderr.contains("records were removed"),
        "{stderr}"
    );
    assert!(w.standins.effects(w.name()).await.is_empty());
}

/// The stored bytes are the evidence (issue 39). The database superuser
/// respells a waiting run's `ModelCall` body without changing what it says:
/// a field added (`"tampered":true`), keys reordered, spacing. Each decodes
/// to the record that was hashed and signed, yet the run stops as tampered
/// naming that record, and `kubectl agentrun verify` (reading the store as
/// its administrator would) names it as altered.
#[tokio::test]
async fn store_a_stored_body_respelled_by_the_superuser_stops_the_run_and_fails_verify() {
    let w = World::new("trust-respell", &[]).await;
    common::approvals::grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    let db = agentrun::store::open(&store_url).await.unwrap();
    let respellings = [
        (
            "added",
            "{\"format\":1,",
            "{\"format\":1,\"tampered\":true,",
        ),
        (
            "reordered",
            "{\"format\":1,\"kind\":\"ModelCall\",",
            "{\"kind\":\"ModelCall\",\"format\":1,",
        ),
        ("spaced", ",\"payload\":", ", \"payload\": "),
    ];
    let mut runs = Vec::new();
    for (name, _, _) in &respellings {
        runs.push(awaiting_run(&w, name).await);
    }
    for ((name, from, to), before) in respellings.iter().zip(&runs) {
        let uid = before.metadata.uid.clone().unwrap();
        let touched = rewrite_body(&uid, "ModelCall", from, to).await;
        assert_eq!(touched, 1, "{name}: the ModelCall was respelled");
        match db.read_range(&uid, 0, None).await {
            Err(agentrun::store::StoreError::Corrupt { seq: 1, .. }) => {}
            other => panic!("{name}: record 1 reads as altered: {other:?}"),
        }
    }
    for ((name, _, _), before) in respellings.iter().zip(&runs) {
        let after = wait_tampered(&w, name).await;
        let now = after.status.as_ref().unwrap();
        assert_eq!(now.phase, Some(Phase::Failed), "{name}: {now:?}");
        let error = now.error.clone().unwrap_or_default();
        assert!(
            error.contains("seq 1") && error.contains("not the canonical form"),
            "{name}: status.error {error:?}"
        );
        let was = before.status.as_ref().unwrap().log.clone().unwrap();
        let log_now = now.log.clone().unwrap();
        assert_eq!(
            (log_now.length, log_now.head_hash),
            (was.length, was.head_hash),
            "{name}: status.log never moves backwards"
        );
        let (ok, text) = common::approvals::plugin(
            &w,
            "alice",
            &[
                "verify",
                name,
                "--store-url",
                &store_url,
                "--controller-namespace",
                w.name(),
            ],
        );
        assert!(!ok, "{name}: verify passed:\n{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("FAILED: seq 1:") && l.contains("altered")),
            "{name}: verify names record 1 as altered:\n{text}"
        );
        assert!(!text.contains("chain intact"), "{name}:\n{text}");
    }
    assert!(w.standins.effects(w.name()).await.is_empty());
}
