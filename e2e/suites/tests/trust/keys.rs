//! Signatures bind their place (issue 25): a controller record copied from
//! one run's log into another's, or moved to another seq of its own run,
//! with a database credential, is refused by the controller, by the step
//! runner replaying the log, and by `kubectl agentrun verify`, which checks
//! every controller signature with the public keys the controller publishes.
//! Played as the holder of the step log's writer credential (mallory).

use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use agentrun::keys::step_token::TokenKey;
use agentrun::store::{Record, RecordDraft, RemoteStore, StepKind, StepStore};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::common::{
    self,
    approvals::{
        decide, entry, gated_agent, grant_approver_role, pending_approval, plugin, refund,
    },
    world::{TIMEOUT, World, finish},
};

/// A run whose refund of 500 waits for finance; scripted under `script`.
async fn gated_run(w: &World, name: &str, script: &str) -> AgentRun {
    w.create_run(
        name,
        json!({"input": "Refund order 1042.", "agent": gated_agent(w, script, json!({}))}),
        json!({}),
    )
    .await
}

async fn script(w: &World, name: &str) {
    w.standins
        .script(name, json!([refund(500), finish("done")]), json!([]))
        .await;
}

/// alice (finance) approves `approval` as shown.
async fn alice_approves(w: &World, approval: &agentrun::api::Approval) {
    decide(
        w,
        "alice",
        &approval.metadata.name.clone().unwrap(),
        entry("alice", "Approve", &approval.spec.arguments_hash, "ok"),
    )
    .await
    .expect("alice approves");
}

/// Appends `records` to run `uid`'s log as mallory, with the writer credential.
async fn append_as_mallory(store: &dyn StepStore, uid: &str, records: &[Record]) {
    let lease = store
        .acquire(uid, "mallory", Duration::from_secs(10))
        .await
        .expect("the writer credential takes any run's lease");
    for r in records {
        store
            .append(uid, lease.epoch, r)
            .await
            .unwrap_or_else(|e| panic!("appending seq {} to {uid}: {e}", r.seq));
    }
    store.release(&lease).await.unwrap();
}

/// Waits until the controller stops run `name` for its log; returns it.
async fn wait_tampered(w: &World, name: &str) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"test/poke": "1"}}})),
    )
    .await
    .unwrap();
    common::wait_for(&format!("{name} to stop for its log"), TIMEOUT, || async {
        let r = runs.get(name).await.map_err(|e| e.to_string())?;
        let s = r.status.clone().unwrap_or_default();
        match s.conditions.iter().find(|c| c.type_ == "LogIntact") {
            Some(c) if c.status == "False" && c.reason == "LogTampered" => Ok(r),
            _ => Err(format!("{:?}", r.status)),
        }
    })
    .await
}

/// `kubectl agentrun verify` as alice (an approver, no store role of the
/// controller's), with the keys the world's controller published.
fn verify(w: &World, run: &str, store: &str) -> (bool, String) {
    plugin(
        w,
        "alice",
        &[
            "verify",
            run,
            "--store-url",
            store,
            "--controller-namespace",
            w.name(),
        ],
    )
}

/// Runs one step of run `uid` as its Job would (its own gateway token,
/// the controller's published keys), outside any Job.
async fn replay_as_step(w: &World, uid: &str, keys: &str) -> (bool, String) {
    let token = TokenKey::new(common::controller::step_token_key().as_bytes())
        .unwrap()
        .mint(uid);
    replay_with(w, uid, &token, keys, None).await
}

/// Runs one step of run `uid` with gateway token `token`, the controller's
/// public keys `keys` and, when given, the run's key windows (what a step
/// Job of the run gets in `AGENTRUN_SIGNING_KEYS`).
async fn replay_with(
    w: &World,
    uid: &str,
    token: &str,
    keys: &str,
    windows: Option<&str>,
) -> (bool, String) {
    let mut cmd = tokio::process::Command::new(super::common::binary("agentrun"));
    cmd.arg("step")
        .env("AGENTRUN_RUN_UID", uid)
        .env("AGENTRUN_STORE_URL", w.step_api_url())
        .env("AGENTRUN_STORE_TOKEN", token)
        .env("AGENTRUN_CONTROLLER_KEY", keys)
        .env("AGENTRUN_MODEL_API_KEY", "sk-e2e-not-a-real-key")
        .env("AGENTRUN_TIME_SLICE_SECONDS", "20")
        .env("POD_NAME", "replay-check");
    if let Some(windows) = windows {
        cmd.env("AGENTRUN_SIGNING_KEYS", windows);
    }
    let out = cmd.output().await.expect("running agentrun step");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The controller's keys as its step Jobs get them.
async fn published_keys(w: &World) -> String {
    let keys = common::wait_for("the controller's published keys", TIMEOUT, || async {
        agentrun::keys::published::read(&w.client, w.name())
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    keys.to_hex()
}

#[tokio::test]
async fn keys_a_decision_copied_into_another_runs_log_is_refused() {
    let mut w = World::new("trust-keys-copy", &[]).await;
    grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    let db = agentrun::store::open(&store_url).await.unwrap();

    // Run 1 is approved by alice and refunds once.
    script(&w, "first").await;
    gated_run(&w, "first", "first").await;
    let approval = pending_approval(&w, "first").await;
    alice_approves(&w, &approval).await;
    let first = w.wait_phase("first", Phase::Succeeded).await;
    assert_eq!(w.standins.effects(w.name()).await.len(), 1);
    let log1: Vec<Record> = w.log(&first).await.into_iter().map(|(r, _)| r).collect();
    let decided = log1
        .iter()
        .position(|r| r.kind == StepKind::ApprovalDecided)
        .expect("run 1 was decided");
    let (ok, text) = verify(&w, "first", &store_url);
    assert!(
        ok && text.contains(&format!("seq {decided} ApprovalDecided: signature valid")),
        "{text}"
    );

    // Run 2 is created while no controller runs; mallory fills its log with
    // run 1's history up to and including the signed decision: a chain that
    // verifies by itself, byte for byte what the controller once signed.
    w.stop_controller();
    script(&w, "second").await;
    let second = gated_run(&w, "second", "second").await;
    let uid2 = second.metadata.uid.clone().unwrap();
    append_as_mallory(db.as_ref(), &uid2, &log1[..=decided]).await;
    w.restart_controller().await;

    // The controller stops run 2: its first controller record is run 1's.
    let after = wait_tampered(&w, "second").await;
    let error = after
        .status
        .as_ref()
        .and_then(|s| s.error.clone())
        .unwrap_or_default();
    assert!(
        error.contains("broken at seq 0") && error.contains("signed for another run"),
        "status.error {error:?}"
    );

    // A step runner replaying run 2's log refuses it before acting.
    let keys = published_keys(&w).await;
    let (ran, stderr) = replay_as_step(&w, &uid2, &keys).await;
    assert!(!ran, "the runner went on: {stderr}");
    assert!(
        stderr.contains("checking the controller's signatures in the step log")
            && stderr.contains("signed for another run"),
        "{stderr}"
    );
    assert_eq!(
        w.standins.effects(w.name()).await.len(),
        1,
        "no second refund under run 2's key"
    );

    // The auditor's verify names the copied decision (and every other
    // controller record of run 1).
    let (ok, text) = verify(&w, "second", &store_url);
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!("seq {decided} ApprovalDecided: signature INVALID"))
            && text.contains("seq 0 RunStarted: signature INVALID")
            && text.contains(&format!("seq {decided} (ApprovalDecided)")),
        "{text}"
    );
    // Run 1's own log still verifies.
    let (ok, text) = verify(&w, "first", &store_url);
    assert!(ok, "{text}");
}

#[tokio::test]
async fn keys_a_record_moved_to_another_seq_of_its_run_is_refused() {
    let w = World::new("trust-keys-move", &[]).await;
    grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    let db = agentrun::store::open(&store_url).await.unwrap();
    script(&w, "moved").await;
    let run = gated_run(&w, "moved", "moved").await;
    pending_approval(&w, "moved").await;
    let uid = run.metadata.uid.clone().unwrap();

    // Mallory re-appends the run's own signed RunStarted at the end (a fresh
    // start on top of the history), its signature kept, the chain re-linked.
    let log = db.read_all(&uid).await.unwrap();
    let head = log.last().unwrap().head();
    let started = &log[0];
    let mut draft = RecordDraft::new(started.kind, started.payload.clone());
    draft.versions = started.versions.clone();
    draft.worker = started.worker.clone();
    let moved = draft.seal(&head).unwrap();
    append_as_mallory(db.as_ref(), &uid, std::slice::from_ref(&moved)).await;

    let after = wait_tampered(&w, "moved").await;
    let error = after
        .status
        .as_ref()
        .and_then(|s| s.error.clone())
        .unwrap_or_default();
    assert!(
        error.contains(&format!("broken at seq {}", moved.seq)),
        "status.error {error:?}"
    );
    assert_eq!(
        after.status.as_ref().unwrap().phase,
        Some(Phase::Failed),
        "{:?}",
        after.status
    );
    let (ok, text) = verify(&w, "moved", &store_url);
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!("seq {} RunStarted: signature INVALID", moved.seq))
            && text.contains("seq 0 RunStarted: signature valid"),
        "{text}"
    );
    assert!(w.standins.effects(w.name()).await.is_empty());
}

/// The signing key id of step-token key `key`.
fn signing_key_id(key: &str) -> String {
    TokenKey::new(key.as_bytes())
        .unwrap()
        .record_signer()
        .key_id()
        .to_string()
}

/// Restarts the world's controller with key `new`, `old` retired now (as
/// `kubectl agentrun rotate-key` and a rollout do it).
fn rotate(w: &mut World, old: &str, new: &str) {
    let retired = format!("{old} {}\n", jiff::Timestamp::now());
    w.restart_controller_env(&[
        ("AGENTRUN_STEP_TOKEN_KEY", new),
        ("AGENTRUN_STEP_TOKEN_RETIRED_KEYS", &retired),
    ]);
}

/// A key rotated on purpose (the Secret's `key` replaced, the old one in
/// `retired`, the controller restarted): a run waiting for approval and a
/// run whose step pod is mid-call at the rotation both finish on their old
/// tokens, nothing is asked or done twice, and every record verifies: the
/// ones signed before by the retired key, the ones after by the new key,
/// both published.
#[tokio::test]
async fn keys_a_rotation_keeps_waiting_and_running_runs_and_old_signatures() {
    let mut w = World::new("trust-keys-rotate", &[]).await;
    grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    let old = common::controller::step_token_key();
    let new = format!("rotated-{old}");
    let (old_id, new_id) = (signing_key_id(old), signing_key_id(&new));

    // "waiting" waits for finance under the old key.
    script(&w, "waiting").await;
    gated_run(&w, "waiting", "waiting").await;
    let approval = pending_approval(&w, "waiting").await;
    // "running" has a step pod in a slow model call when the key rotates.
    let mut slow = finish("done");
    slow["delayMs"] = json!(8000);
    w.standins.script("running", json!([slow]), json!([])).await;
    w.create_run(
        "running",
        json!({"input": "Say done.", "agent": w.agent("running")}),
        json!({}),
    )
    .await;
    common::wait_for("the running run's model call", TIMEOUT, || async {
        match w.standins.model_requests("running").await.len() {
            0 => Err("no request yet".to_string()),
            _ => Ok(()),
        }
    })
    .await;

    // The rotation, as `kubectl agentrun rotate-key` and a rollout do it.
    rotate(&mut w, old, &new);
    let running = w.wait_phase("running", Phase::Succeeded).await;
    alice_approves(&w, &approval).await;
    let waiting = w.wait_phase("waiting", Phase::Succeeded).await;
    assert_eq!(w.standins.effects(w.name()).await.len(), 1, "one refund");
    assert_eq!(
        w.standins.model_requests("running").await.len(),
        1,
        "the mid-call answer was recorded, not asked again"
    );

    // Both keys are published, the old one as retired.
    let published = common::wait_for("both keys published", TIMEOUT, || async {
        let keys = agentrun::keys::published::read(&w.client, w.name())
            .await
            .map_err(|e| e.to_string())?;
        let ids: Vec<(String, bool)> = keys
            .keys()
            .iter()
            .map(|k| (k.id.clone(), k.retired))
            .collect();
        if ids.len() == 2 {
            Ok(ids)
        } else {
            Err(format!("{ids:?}"))
        }
    })
    .await;
    assert_eq!(
        published,
        vec![(new_id.clone(), false), (old_id.clone(), true)]
    );

    // Every record verifies for the auditor; the waiting run's holds both.
    for run in [&running, &waiting] {
        let name = run.metadata.name.clone().unwrap();
        let (ok, text) = verify(&w, &name, &store_url);
        assert!(ok, "{name}: {text}");
    }
    let (_, text) = verify(&w, "waiting", &store_url);
    assert!(
        text.contains(&format!("signature valid (retired key {old_id})"))
            && text.contains(&format!("signature valid (key {new_id})")),
        "records before and after the rotation: {text}"
    );
}

fn uid(run: &AgentRun) -> String {
    run.metadata.uid.clone().unwrap()
}

/// The gateway as a step pod with `token` reaches it.
fn gateway(w: &World, token: &str) -> RemoteStore {
    RemoteStore::new(&w.step_api_url(), token, Duration::from_secs(10)).unwrap()
}

/// A decision approving everything, signed by `key`'s signing key for run
/// `uid` at its log's head: what mallory makes with a leaked key.
async fn decision_signed_by(key: &TokenKey, store: &dyn StepStore, uid: &str) -> Record {
    let head = store.head(uid).await.unwrap();
    key.record_signer()
        .seal(
            uid,
            RecordDraft::new(
                StepKind::ApprovalDecided,
                json!({"verdict": "Approve", "approver": "mallory", "reason": "ok"}),
            ),
            &head,
        )
        .unwrap()
}

/// Waits until run `name`'s status records that key `id` signs it now
/// (the controller with the new key has written its status); returns it.
async fn wait_signed_by(w: &World, name: &str, id: &str) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        &format!("{name}'s status to record key {id}"),
        TIMEOUT,
        || async {
            let r = runs.get(name).await.map_err(|e| e.to_string())?;
            let keys = r
                .status
                .as_ref()
                .and_then(|s| s.log.as_ref())
                .and_then(|l| l.signing_keys.clone())
                .unwrap_or_default();
            match keys.last() {
                Some(k) if k.key == id => Ok(r),
                _ => Err(format!("{keys:?}")),
            }
        },
    )
    .await
}

/// What a step Job of `run` gets in `AGENTRUN_SIGNING_KEYS`.
fn windows_of(run: &AgentRun) -> String {
    agentrun::controller::reconciler::status::key_windows(run)
        .to_text()
        .expect("recorded")
}

/// Mallory kept the key a rotation retired (it leaked before) and holds the
/// step log's writer credential. After the rotation her tokens of the
/// retired key open no run created since (neither its log nor its lease),
/// only the runs from before; a decision she signs with it is refused
/// wherever it lands after the rotation, in a new run's log and in an old
/// one's, by the controller, by a step runner replaying the log and by the
/// auditor's verify. No refund runs.
#[tokio::test]
async fn keys_a_retired_key_opens_and_signs_nothing_after_its_retirement() {
    let mut w = World::new("trust-keys-window", &[]).await;
    grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    let db = agentrun::store::open(&store_url).await.unwrap();
    let old = common::controller::step_token_key();
    let new = format!("window-{old}");
    let leaked = TokenKey::new(old.as_bytes()).unwrap();
    let new_key = TokenKey::new(new.as_bytes()).unwrap();

    script(&w, "before").await;
    let before = gated_run(&w, "before", "before").await;
    pending_approval(&w, "before").await;
    rotate(&mut w, old, &new);
    // Creation times are whole seconds: "after" is created in a later one.
    let rotated = jiff::Timestamp::now().as_second();
    common::wait_for("the second after the rotation", TIMEOUT, || async {
        (jiff::Timestamp::now().as_second() > rotated).then_some(())
    })
    .await;
    script(&w, "after").await;
    let after = gated_run(&w, "after", "after").await;
    pending_approval(&w, "after").await;
    let (uid_before, uid_after) = (uid(&before), uid(&after));

    // Her token of the retired key: refused for the run created after the
    // rotation, its log and its lease; the run from before still opens.
    let e = gateway(&w, &leaked.mint(&uid_after))
        .read_all(&uid_after)
        .await
        .unwrap_err();
    assert_eq!(e.metric_label(), "permission_denied", "{e}");
    assert!(
        e.to_string().contains("opens only runs created by then"),
        "{e}"
    );
    let e = gateway(&w, &leaked.mint(&uid_after))
        .acquire(&uid_after, "mallory", Duration::from_secs(10))
        .await
        .unwrap_err();
    assert_eq!(e.metric_label(), "permission_denied", "{e}");
    let read = gateway(&w, &leaked.mint(&uid_before))
        .read_all(&uid_before)
        .await
        .expect("a run created before the rotation opens to its old token");
    assert!(!read.is_empty());

    // A decision signed with the retired key, in the new run's log.
    let forged = decision_signed_by(&leaked, db.as_ref(), &uid_after).await;
    append_as_mallory(db.as_ref(), &uid_after, std::slice::from_ref(&forged)).await;
    let stopped = wait_tampered(&w, "after").await;
    let error = stopped
        .status
        .as_ref()
        .and_then(|s| s.error.clone())
        .unwrap_or_default();
    assert!(
        error.contains(&format!("broken at seq {}", forged.seq)) && error.contains("retired"),
        "status.error {error:?}"
    );
    // A step runner replaying it (the run's own token, its key windows).
    let keys = published_keys(&w).await;
    let (ran, stderr) = replay_with(
        &w,
        &uid_after,
        &new_key.mint(&uid_after),
        &keys,
        Some(&windows_of(&stopped)),
    )
    .await;
    assert!(!ran, "the runner went on: {stderr}");
    assert!(
        stderr.contains("checking the controller's signatures in the step log")
            && stderr.contains("retired"),
        "{stderr}"
    );
    let (ok, text) = verify(&w, "after", &store_url);
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "seq {} ApprovalDecided: signature INVALID",
            forged.seq
        )) && text.contains("retired"),
        "{text}"
    );

    // In the run from before, once its status records the new key: the
    // same decision, after the switch, is refused too.
    wait_signed_by(&w, "before", &signing_key_id(&new)).await;
    let forged = decision_signed_by(&leaked, db.as_ref(), &uid_before).await;
    append_as_mallory(db.as_ref(), &uid_before, std::slice::from_ref(&forged)).await;
    wait_tampered(&w, "before").await;
    let (ok, text) = verify(&w, "before", &store_url);
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "seq {} ApprovalDecided: signature INVALID",
            forged.seq
        )) && text.contains("seq 0 RunStarted: signature valid (retired key"),
        "the records from before the rotation still verify: {text}"
    );
    assert!(w.standins.effects(w.name()).await.is_empty(), "no refund");
}

/// `kubectl agentrun` as the cluster's administrator (the `admin` context
/// when the kubeconfig has one).
fn plugin_as_admin(w: &World, args: &[&str]) -> (bool, String) {
    let mut cmd = std::process::Command::new(super::common::binary("kubectl-agentrun"));
    cmd.args(["-n", w.name()]);
    if !common::existing_cluster() {
        cmd.args(["--context", "admin"]);
    }
    let out = cmd.args(args).output().expect("running kubectl-agentrun");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The operator's administrator rotates with `rotate-key` while a run's
/// step pod is mid-call on a token of the old key: `--prune` keeps the old
/// key, naming that run, and fails; once the run has finished its step,
/// `--prune` cuts the key down to its public half: its tokens open nothing
/// (not even the run from before), what it signed still verifies.
#[tokio::test]
async fn keys_prune_waits_for_the_runs_holding_a_retired_keys_token() {
    use k8s_openapi::api::core::v1::Secret;
    let mut w = World::new("trust-keys-prune", &[]).await;
    grant_approver_role(&w).await;
    let store_url = common::store::e2e_store_url().await;
    // A key of this world's own: no other test's run holds its tokens.
    let old = format!(
        "prune-{}-{}",
        w.name(),
        common::controller::step_token_key()
    );
    w.restart_controller_env(&[("AGENTRUN_STEP_TOKEN_KEY", &old)]);
    let secrets: Api<Secret> = Api::namespaced(w.client.clone(), w.name());
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "step-token-key"},
        "stringData": {"key": old},
    }))
    .unwrap();
    secrets
        .create(&Default::default(), &secret)
        .await
        .expect("the key's Secret");

    // "running" is in a slow model call on a token of the old key.
    let mut slow = finish("done");
    slow["delayMs"] = json!(8000);
    w.standins.script("running", json!([slow]), json!([])).await;
    let running = w
        .create_run(
            "running",
            json!({"input": "Say done.", "agent": w.agent("running")}),
            json!({}),
        )
        .await;
    common::wait_for("the running run's model call", TIMEOUT, || async {
        match w.standins.model_requests("running").await.len() {
            0 => Err("no request yet".to_string()),
            _ => Ok(()),
        }
    })
    .await;

    let ns = w.name().to_string();
    let args = [
        "rotate-key",
        "--controller-namespace",
        &ns,
        "--secret",
        "step-token-key",
    ];
    let (ok, text) = plugin_as_admin(&w, &args);
    assert!(ok, "{text}");
    let data = secrets.get("step-token-key").await.unwrap().data.unwrap();
    let (new, retired) = (
        String::from_utf8(data["key"].0.clone()).unwrap(),
        String::from_utf8(data["retired"].0.clone()).unwrap(),
    );
    w.restart_controller_env(&[
        ("AGENTRUN_STEP_TOKEN_KEY", &new),
        ("AGENTRUN_STEP_TOKEN_RETIRED_KEYS", &retired),
    ]);

    let prune = [args.as_slice(), &["--prune"]].concat();
    let (ok, text) = plugin_as_admin(&w, &prune);
    assert!(!ok, "pruned while a step Job holds the key's token: {text}");
    assert!(
        text.contains(&format!("kept key {}", signing_key_id(&old)))
            && text.contains(&format!("{}/running (step Job", w.name())),
        "{text}"
    );
    let unchanged = secrets.get("step-token-key").await.unwrap().data.unwrap();
    assert_eq!(unchanged["retired"].0, retired.as_bytes(), "nothing pruned");

    w.wait_phase("running", Phase::Succeeded).await;
    let (ok, text) = plugin_as_admin(&w, &prune);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("pruned key {}", signing_key_id(&old))),
        "{text}"
    );
    let pruned = secrets.get("step-token-key").await.unwrap().data.unwrap();
    let pruned = String::from_utf8(pruned["retired"].0.clone()).unwrap();
    assert!(pruned.starts_with("ed25519:"), "{pruned}");

    // The controller restarted on the pruned Secret: the old key's token
    // opens nothing, what it signed still verifies.
    w.restart_controller_env(&[
        ("AGENTRUN_STEP_TOKEN_KEY", &new),
        ("AGENTRUN_STEP_TOKEN_RETIRED_KEYS", &pruned),
    ]);
    let uid = uid(&running);
    let old_token = TokenKey::new(old.as_bytes()).unwrap().mint(&uid);
    let e = common::wait_for("the gateway to refuse the pruned key", TIMEOUT, || async {
        match gateway(&w, &old_token).head(&uid).await {
            Err(e) if e.metric_label() == "permission_denied" => Ok(e),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(e.to_string().contains("not this run's step token"), "{e}");
    let (ok, text) = verify(&w, "running", &store_url);
    assert!(ok, "{text}");
}
