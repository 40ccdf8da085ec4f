//! The main paths of a started run, one reconcile at a time against the
//! mocked API server: a step that finished, an approval raised and decided,
//! a lost worker (its lease lapsed, or its Job failed with its pod gone), a
//! crash, a cancel, a deadline and a running step's progress. Each asserts
//! the exact requests in order, what reached the log before each write, and
//! that nothing else was asked.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use kube::client::Body;
use serde_json::{Value, json};

use super::{
    Handle, answer_everything, expect, expect_events, expect_nothing_more, expect_policies, list,
    receive, respond,
};
use crate::api::AgentRun;
use crate::controller::context::Context;
use crate::replay::{Entry, RunState};
use crate::runlog::records::{ModelCall, Observation};
use crate::runlog::v1::{ModelResponse, TokenUsage, ToolCall};

pub(super) const UID: &str = "uid-r1";
pub(super) const JOBS: &str = "/apis/batch/v1/namespaces/ns/jobs";
pub(super) const STATUS: &str = "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns/r1/status";
pub(super) const APPROVALS: &str = "/apis/agentrun.dev/v1alpha1/namespaces/ns/approvals";
pub(super) const STEP_1: &str = "r1-951103-s1-a1";

/// Answers the next request, checked, with a 404.
async fn expect_not_found(handle: &mut Handle, method: &str, path: &str) {
    let (_, send) = receive(handle, method, path).await;
    let status = json!({"apiVersion": "v1", "kind": "Status", "metadata": {},
        "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
    respond(send, 404, &status);
}

/// Receives the run's status apply; answers it with `run` carrying it.
async fn receive_status(handle: &mut Handle) -> (Value, impl FnOnce(&AgentRun)) {
    let (body, send) = receive(handle, "PATCH", STATUS).await;
    let status = body["status"].clone();
    let answer = move |run: &AgentRun| {
        let mut reply = serde_json::to_value(run).unwrap();
        reply["status"] = status;
        respond(send, 200, &reply);
    };
    (body, answer)
}

/// The kinds of the run's log records, in order.
pub(super) async fn kinds(ctx: &Context) -> Vec<String> {
    let log = ctx.log.store.read_all(UID).await.unwrap();
    log.iter().map(|r| r.kind.as_str().to_string()).collect()
}

/// The payload of the log's last record.
pub(super) async fn last_payload(ctx: &Context) -> Value {
    let log = ctx.log.store.read_all(UID).await.unwrap();
    log.last().expect("a record").payload.clone()
}

/// The run's log replayed, as the controller would see it.
pub(super) async fn replayed(ctx: &Context) -> RunState {
    let log = ctx.log.store.read_all(UID).await.unwrap();
    RunState::replay(
        log.iter()
            .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
            .collect(),
    )
}

pub(super) fn job(name: &str, status: Value) -> Value {
    json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "ns",
            "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                "name": "r1", "uid": UID, "controller": true}]},
        "status": status})
}

pub(super) fn running() -> Value {
    json!({"active": 1, "ready": 1})
}

pub(super) fn complete() -> Value {
    json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
}

/// What a step pod does: takes the run's lease for `ttl`, appends `steps`
/// (unsigned, as a runner's records are) and, if `release`, gives the run
/// back. Returns the epoch it held.
pub(super) async fn step_pod(
    ctx: &Context,
    steps: Vec<Entry>,
    ttl: Duration,
    release: bool,
) -> u64 {
    let lease = step_pod_holding(ctx, steps, ttl).await;
    if release {
        ctx.log.store.release(&lease).await.unwrap();
    }
    lease.epoch
}

/// A step pod that appends `steps` and still holds the run: its lease.
pub(super) async fn step_pod_holding(
    ctx: &Context,
    steps: Vec<Entry>,
    ttl: Duration,
) -> crate::store::Lease {
    use crate::store::RecordDraft;
    let lease = ctx.log.store.acquire(UID, "r1-pod", ttl).await.unwrap();
    let mut head = ctx.log.store.head(UID).await.unwrap();
    for step in steps {
        let record = RecordDraft::new(step.store_kind(), step.payload())
            .seal(&head)
            .unwrap();
        head = ctx
            .log
            .store
            .append(UID, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    lease
}

/// Whether the worker that held the lease at `epoch` is fenced: the lease
/// was taken since, so that worker can neither renew nor append.
async fn fenced(ctx: &Context, epoch: u64) -> bool {
    let lease = ctx.log.store.lease(UID).await.unwrap().expect("leased");
    lease.epoch > epoch
}

pub(super) fn observation(text: &str) -> Entry {
    Entry::Observation(Observation {
        text: text.into(),
        about_seq: None,
        stop: None,
        attempts: None,
    })
}

pub(super) fn model_call(text: Option<&str>, calls: Vec<ToolCall>) -> Entry {
    Entry::ModelCall(ModelCall {
        request: None,
        response: ModelResponse {
            text: text.map(Into::into),
            tool_calls: calls,
            usage: TokenUsage::default(),
            model_id: "m".into(),
            stop_reason: None,
        },
        cost_usd: 0.0,
        context: Default::default(),
        attempts: None,
    })
}

/// A run started and its first step's Job created (the order of those two
/// reconciles is asserted by `reconcile_starts_a_run_then_creates_its_first_job_in_order`),
/// with the run as its last status write left it.
pub(super) async fn started(
    dir: &std::path::Path,
    run: AgentRun,
) -> (Arc<Context>, Handle, AgentRun) {
    let (ctx, handle) = super::mocked(dir).await;
    start(ctx, handle, run).await
}

/// [`started`] with a context of one's own.
pub(super) async fn start(
    ctx: Arc<Context>,
    mut handle: Handle,
    mut run: AgentRun,
) -> (Arc<Context>, Handle, AgentRun) {
    for _ in 0..2 {
        let (h, seen) = super::reconcile_recorded(&ctx, handle, &run, Value::Null).await;
        handle = h;
        let (_, status) = seen
            .iter()
            .rev()
            .find(|(w, _)| w.ends_with("/status"))
            .expect("a status write");
        run = super::with_status(run, status);
    }
    let step = &run.status.as_ref().unwrap().step;
    assert_eq!(step.as_ref().unwrap().job.as_deref(), Some(STEP_1));
    (ctx, handle, run)
}

/// One reconcile of `run` while `server` answers; returns what it returned.
async fn reconcile_against<T: std::marker::Send + 'static>(
    ctx: &Arc<Context>,
    run: &AgentRun,
    server: impl std::future::Future<Output = T> + std::marker::Send + 'static,
) -> T {
    let server = tokio::spawn(server);
    // A request the script does not answer would wait for ever: fail instead.
    let reconcile = crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone());
    tokio::time::timeout(Duration::from_secs(60), reconcile)
        .await
        .expect("the reconcile ended (a request the script did not answer?)")
        .unwrap();
    server.await.unwrap()
}

#[tokio::test]
async fn a_finished_step_starts_the_next_job_and_a_final_answer_finishes_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), super::run()).await;

    // Step 1's pod recorded an observation, gave the run back and exited.
    step_pod(
        &ctx,
        vec![observation("looked it up")],
        Duration::from_secs(30),
        true,
    )
    .await;
    let sent = run.clone();
    let (handle, status) = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        let path = format!("{JOBS}/{STEP_1}");
        expect(&mut handle, "GET", &path, job(STEP_1, complete())).await;
        expect_policies(&mut handle).await;
        let next = expect(&mut handle, "POST", JOBS, Value::Null).await;
        assert_eq!(next["metadata"]["name"], "r1-951103-s2-a1");
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["StepStarted"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, status)
    })
    .await;
    let step = &status["status"]["step"];
    assert_eq!(
        (&step["seq"], &step["job"], &step["attempt"]),
        (&json!(2), &json!("r1-951103-s2-a1"), &json!(1)),
        "{status}"
    );
    assert_eq!(status["status"]["log"]["length"], 2, "{status}");
    assert_eq!(
        kinds(&ctx).await,
        ["RunStarted", "Observation"],
        "nothing appended"
    );

    // Step 2's pod recorded the model's final answer; its Job completed.
    let run = super::with_status(run, &status);
    step_pod(
        &ctx,
        vec![model_call(Some("refunded 500"), vec![])],
        Duration::from_secs(30),
        true,
    )
    .await;
    let (sent, store) = (run.clone(), ctx.clone());
    let status = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        let path = format!("{JOBS}/r1-951103-s2-a1");
        expect(
            &mut handle,
            "GET",
            &path,
            job("r1-951103-s2-a1", complete()),
        )
        .await;
        let (status, answer) = receive_status(&mut handle).await;
        // The end is in the log before the status says so.
        assert_eq!(
            kinds(&store).await,
            ["RunStarted", "Observation", "ModelCall", "RunFinished"]
        );
        answer(&sent);
        expect_events(&mut handle, &["RunSucceeded"]).await;
        expect_nothing_more(&mut handle).await;
        status
    })
    .await;
    let finished = last_payload(&ctx).await;
    assert_eq!(
        (&finished["outcome"], &finished["result"]),
        (&json!("Succeeded"), &json!("refunded 500")),
        "{finished}"
    );
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["result"], &s["log"]["length"]),
        (&json!("Succeeded"), &json!("refunded 500"), &json!(4)),
        "{status}"
    );
}

/// The run of [`super::run`] whose agent gates refunds over 100 on alice.
pub(super) fn gated_run() -> AgentRun {
    let mut run = super::run();
    run.spec.agent.as_mut().unwrap().approval = Some(
        serde_json::from_value(json!({"rules": [{
            "name": "large-refund", "tool": "issue_refund", "when": "args.amount > 100",
            "approvers": {"users": ["alice"]}}]}))
        .unwrap(),
    );
    run
}

/// The request a step pod records for the call at `model_call_seq` (the
/// gate the pinned policy gives it, as the runner computes it).
pub(super) fn approval_request(
    log: &RunState,
    request_seq: u64,
    model_call_seq: u64,
    arguments: Value,
) -> Entry {
    use crate::controller::approvals::pinned_gate::classify_at;
    let crate::policy::Classification::RequireApproval(gate) =
        classify_at(log, request_seq, "issue_refund", &arguments)
    else {
        panic!("the pinned policy gates the refund")
    };
    Entry::ApprovalRequested(crate::runlog::records::ApprovalRequested {
        model_call_seq,
        call_index: 0,
        call_id: "c0".into(),
        tool: "issue_refund".into(),
        arguments_hash: crate::policy::arguments_hash("issue_refund", &arguments),
        arguments,
        reason: None,
        observations: vec![],
        dependencies: vec![],
        gate: *gate,
        escalation: 0,
        alternative: None,
        kind: crate::runlog::v1::ApprovalKind::Call,
        intent_seq: None,
    })
}

/// Step 1's first pod: the model proposes a refund of 500 (record 1) and
/// the pod gives the run back. The approval request the step's next pod
/// appends (record 2), and the arguments.
pub(super) async fn refund_proposed(ctx: &Context) -> (Entry, Value) {
    let args = json!({"amount": 500});
    let call = ToolCall {
        id: "c0".into(),
        name: "issue_refund".into(),
        arguments: args.clone(),
    };
    step_pod(
        ctx,
        vec![model_call(None, vec![call])],
        Duration::from_secs(30),
        true,
    )
    .await;
    let request = approval_request(&replayed(ctx).await, 2, 1, args.clone());
    (request, args)
}

/// The Approval at `path` looked for (by its name, then by the run's
/// label), raised and its status set Pending: the Approval raised.
async fn expect_raised(handle: &mut Handle, path: &str) -> Value {
    expect_not_found(handle, "GET", path).await;
    expect(handle, "GET", APPROVALS, list("Approval")).await;
    let raised = expect(handle, "POST", APPROVALS, Value::Null).await;
    let (shown, send) = receive(handle, "PATCH", &format!("{path}/status")).await;
    let mut now = raised.clone();
    now["status"] = shown["status"].clone();
    respond(send, 200, &now);
    assert_eq!(shown["status"]["state"], "Pending", "{shown}");
    raised
}

#[tokio::test]
async fn an_approval_is_raised_then_its_decision_is_logged_before_any_status() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), gated_run()).await;

    // Step 1's pod: the model proposes a refund of 500, the pod asks for
    // approval (records 1 and 2), gives the run back and exits.
    let (request, args) = refund_proposed(&ctx).await;
    step_pod(&ctx, vec![request], Duration::from_secs(30), true).await;
    let name = crate::controller::approvals::approval_name("r1", UID, 2);
    let approval_path = format!("{APPROVALS}/{name}");

    // The Approval is looked for (by its name, then by the run's label),
    // raised, its status set, then the run's status says it waits on it.
    let (sent, p) = (run.clone(), approval_path.clone());
    let (handle, raised, status) = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        let path = format!("{JOBS}/{STEP_1}");
        expect(&mut handle, "GET", &path, job(STEP_1, complete())).await;
        let raised = expect_raised(&mut handle, &p).await;
        // The Job that asked has ended: it goes, with its pod, at once.
        let ttl = expect(&mut handle, "PATCH", &path, job(STEP_1, complete())).await;
        assert_eq!(ttl, json!({"spec": {"ttlSecondsAfterFinished": 0}}));
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["ApprovalRequested"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, raised, status)
    })
    .await;
    let spec = &raised["spec"];
    assert_eq!(
        (
            &raised["metadata"]["name"],
            &spec["tool"],
            &spec["step"],
            &spec["arguments"]
        ),
        (&json!(name), &json!("issue_refund"), &json!(2), &args),
        "{raised}"
    );
    assert_eq!(spec["runRef"]["uid"], UID);
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["approval"]["name"]),
        (&json!("AwaitingApproval"), &json!(name)),
        "{status}"
    );
    assert_eq!(
        s["step"]["job"],
        Value::Null,
        "a waiting run names no Job: {status}"
    );
    assert_eq!(
        kinds(&ctx).await.len(),
        3,
        "nothing appended while it waits"
    );

    // alice approves the exact arguments.
    let mut decided = raised.clone();
    decided["metadata"]["generation"] = json!(2);
    decided["spec"]["decisions"] = json!([{"approver": "alice", "verdict": "Approve",
        "argumentsHash": spec["argumentsHash"]}]);
    decided["status"] = json!({"state": "Pending"});
    let run = super::with_status(run, &status);
    let (sent, store) = (run.clone(), ctx.clone());
    let (handle, status) = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        // The waiting run's Approval is read before its log: it changed.
        expect(&mut handle, "GET", &approval_path, decided.clone()).await;
        expect(&mut handle, "GET", &approval_path, decided.clone()).await;
        // The decision is in the log before the Approval's status shows it.
        let (shown, send) = receive(&mut handle, "PATCH", &format!("{approval_path}/status")).await;
        assert_eq!(kinds(&store).await.last().unwrap(), "ApprovalDecided");
        let mut now = decided.clone();
        now["status"] = shown["status"].clone();
        respond(send, 200, &now);
        let s = &shown["status"];
        assert_eq!(
            (&s["state"], &s["decidedBy"]),
            (&json!("Approved"), &json!(["alice"])),
            "{shown}"
        );
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["ApprovalDecided"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, status)
    })
    .await;
    let recorded = last_payload(&ctx).await;
    assert_eq!(
        (
            &recorded["verdict"],
            &recorded["requestSeq"],
            &recorded["approval"]
        ),
        (&json!("Approve"), &json!(2), &json!(name)),
        "{recorded}"
    );
    assert_eq!(recorded["decisions"][0]["approver"], "alice");
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["approval"], &s["log"]["length"]),
        (&json!("Running"), &Value::Null, &json!(4)),
        "{status}"
    );

    // The approved call is the next step's: its Job (the Approval is not read again).
    let run = super::with_status(run, &status);
    let sent = run.clone();
    let status = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect_policies(&mut handle).await;
        let next = expect(&mut handle, "POST", JOBS, Value::Null).await;
        assert_eq!(next["metadata"]["name"], "r1-951103-s4-a1");
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["StepStarted"]).await;
        expect_nothing_more(&mut handle).await;
        status
    })
    .await;
    assert_eq!(status["status"]["step"]["seq"], 4, "{status}");
}

#[tokio::test]
async fn a_waiting_run_lets_go_of_its_job_when_its_worker_ends_without_reading_its_log_again() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), gated_run()).await;

    // Step 1's pod asks for approval and still holds the run when the
    // controller raises the Approval.
    let (request, _) = refund_proposed(&ctx).await;
    let lease = step_pod_holding(&ctx, vec![request], Duration::from_secs(30)).await;
    let name = crate::controller::approvals::approval_name("r1", UID, 2);
    let approval_path = format!("{APPROVALS}/{name}");
    let job_path = format!("{JOBS}/{STEP_1}");

    let (sent, p, path) = (run.clone(), approval_path.clone(), job_path.clone());
    let (handle, raised, status) = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect(&mut handle, "GET", &path, job(STEP_1, running())).await;
        let raised = expect_raised(&mut handle, &p).await;
        // Its worker holds the run: the Job is not let go yet.
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["ApprovalRequested"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, raised, status)
    })
    .await;
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["step"]["job"]),
        (&json!("AwaitingApproval"), &json!(STEP_1)),
        "{status}"
    );

    // The worker gives the run back and its Job completes: the run lets go
    // of the Job without reading its log again (it kept it for this).
    ctx.log.store.release(&lease).await.unwrap();
    let read_before = ctx.metrics.store_read_records.get();
    let mut pending = raised.clone();
    pending["status"] = json!({"state": "Pending"});
    let run = super::with_status(run, &status);
    let sent = run.clone();
    let status = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect(&mut handle, "GET", &job_path, job(STEP_1, complete())).await;
        expect(&mut handle, "GET", &approval_path, pending).await;
        let ttl = expect(&mut handle, "PATCH", &job_path, job(STEP_1, complete())).await;
        assert_eq!(ttl, json!({"spec": {"ttlSecondsAfterFinished": 0}}));
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_nothing_more(&mut handle).await;
        status
    })
    .await;
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["step"]["job"]),
        (&json!("AwaitingApproval"), &Value::Null),
        "{status}"
    );
    assert_eq!(
        ctx.metrics.store_read_records.get(),
        read_before,
        "no record read again"
    );
}

/// A running step whose pod took the lease for a moment and never renewed
/// it (or was killed): returns the epoch it held, lapsed now.
async fn lapsed_pod(ctx: &Context, steps: Vec<Entry>) -> u64 {
    // Appends under a lease long enough for a loaded machine, then lets it
    // lapse at once (a short lease could lapse mid-append: CI saw that).
    let lease = step_pod_holding(ctx, steps, Duration::from_secs(30)).await;
    ctx.log
        .store
        .renew(&lease, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    lease.epoch
}

#[tokio::test]
async fn a_lost_worker_is_fenced_its_job_deleted_and_its_step_retried() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), super::run()).await;
    let epoch = lapsed_pod(&ctx, vec![]).await;
    let path = format!("{JOBS}/{STEP_1}");

    // The lease is seen free for the first time: it may be a worker still
    // starting; nothing is done, nothing written.
    let p = path.clone();
    let handle = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect(&mut handle, "GET", &p, job(STEP_1, running())).await;
        expect_nothing_more(&mut handle).await;
        handle
    })
    .await;
    let lease = ctx.log.store.lease(UID).await.unwrap().unwrap();
    assert_eq!(lease.epoch, epoch, "the worker is not fenced yet");

    // Free for LOST_AFTER: the worker is fenced, then its Job deleted.
    tokio::time::sleep(crate::controller::reconciler::phase::LOST_AFTER).await;
    let (p, store) = (path.clone(), ctx.clone());
    let handle = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect(&mut handle, "GET", &p, job(STEP_1, running())).await;
        let (_, send) = receive(&mut handle, "DELETE", &p).await;
        assert!(fenced(&store, epoch).await, "fenced before the delete");
        respond(send, 200, &job(STEP_1, running()));
        expect_events(&mut handle, &["StepStopped"]).await;
        expect_nothing_more(&mut handle).await;
        handle
    })
    .await;

    // The Job is gone: the step's next attempt, its credential first.
    let sent = run.clone();
    let status = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect_not_found(&mut handle, "GET", &path).await;
        expect_policies(&mut handle).await;
        expect(
            &mut handle,
            "POST",
            "/api/v1/namespaces/ns/secrets",
            Value::Null,
        )
        .await;
        let next = expect(&mut handle, "POST", JOBS, Value::Null).await;
        assert_eq!(next["metadata"]["name"], "r1-951103-s1-a2");
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["StepRetried"]).await;
        expect_nothing_more(&mut handle).await;
        status
    })
    .await;
    // A lost pod is a disruption: counted as a failed Job, never as a stall.
    let step = &status["status"]["step"];
    assert_eq!(
        (
            &step["seq"],
            &step["job"],
            &step["attempt"],
            &step["failedJobs"]
        ),
        (&json!(1), &json!("r1-951103-s1-a2"), &json!(2), &json!(1)),
        "{status}"
    );
    assert_eq!(step["stalled"].as_u64().unwrap_or(0), 0, "{status}");
    assert_eq!(kinds(&ctx).await, ["RunStarted"], "nothing recorded");
}

/// Two reconciles of a run that must stop while its step runs (its pod's
/// lease lapsed at `epoch`, as a killed pod's does): the worker fenced and
/// the Job deleted; then, the Job gone, the end recorded before the status
/// says it. Returns that status.
async fn stopped(ctx: &Arc<Context>, handle: Handle, run: AgentRun, epoch: u64) -> Value {
    let path = format!("{JOBS}/{STEP_1}");
    let (p, store, sent) = (path.clone(), ctx.clone(), run.clone());
    let (handle, status) = reconcile_against(ctx, &run, async move {
        let mut handle = handle;
        expect(&mut handle, "GET", &p, job(STEP_1, running())).await;
        let (_, send) = receive(&mut handle, "DELETE", &p).await;
        assert!(fenced(&store, epoch).await, "fenced before the delete");
        respond(send, 200, &job(STEP_1, running()));
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_events(&mut handle, &["StepStopped"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, status)
    })
    .await;
    assert_ne!(kinds(ctx).await.last().unwrap(), "RunFinished", "not yet");

    let run = super::with_status(run, &status);
    let (store, sent) = (ctx.clone(), run.clone());
    reconcile_against(ctx, &run, async move {
        let mut handle = handle;
        expect_not_found(&mut handle, "GET", &path).await;
        let (status, answer) = receive_status(&mut handle).await;
        assert_eq!(
            kinds(&store).await.last().unwrap(),
            "RunFinished",
            "the log first"
        );
        answer(&sent);
        let phase = status["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let reason = match phase.as_str() {
            "Cancelled" => "RunCancelled",
            other => other,
        };
        expect_events(&mut handle, &[reason]).await;
        expect_nothing_more(&mut handle).await;
        status
    })
    .await
}

#[tokio::test]
async fn cancel_deletes_the_job_then_records_the_end_before_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, mut run) = started(dir.path(), super::run()).await;
    let look = ToolCall {
        id: "c0".into(),
        name: "lookup".into(),
        arguments: json!({}),
    };
    let said = model_call(Some("halfway there"), vec![look]);
    let epoch = lapsed_pod(&ctx, vec![said]).await;
    run.spec.cancel = true;
    run.metadata.generation = Some(2);

    let status = stopped(&ctx, handle, run, epoch).await;
    let finished = last_payload(&ctx).await;
    assert_eq!(
        (
            &finished["outcome"],
            &finished["error"],
            &finished["result"]
        ),
        (
            &json!("Cancelled"),
            &json!("cancelled through spec.cancel"),
            &json!("halfway there")
        ),
        "{finished}"
    );
    assert_eq!(status["status"]["phase"], "Cancelled", "{status}");
    assert_eq!(
        kinds(&ctx).await,
        ["RunStarted", "ModelCall", "RunFinished"]
    );
}

#[tokio::test]
async fn a_run_past_its_deadline_stops_with_the_deadline_as_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = super::run();
    run.spec.deadline = Some("1m".into());
    let (ctx, handle, mut run) = started(dir.path(), run).await;
    let epoch = lapsed_pod(&ctx, vec![]).await;
    // Started two minutes ago.
    let status = run.status.as_mut().unwrap();
    let ago = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(120);
    status.started_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ago));

    let status = stopped(&ctx, handle, run, epoch).await;
    let finished = last_payload(&ctx).await;
    assert_eq!(finished["outcome"], "DeadlineExceeded", "{finished}");
    assert_eq!(
        finished["error"], "spec.deadline of 1m passed",
        "{finished}"
    );
    let s = &status["status"];
    assert_eq!(s["phase"], "DeadlineExceeded", "{status}");
    assert_eq!(kinds(&ctx).await, ["RunStarted", "RunFinished"]);
}

/// A context whose step Jobs come from a watch cache (never a GET), with
/// the writer that fills it.
async fn mocked_with_job_cache(
    dir: &std::path::Path,
) -> (
    Arc<Context>,
    Handle,
    kube::runtime::reflector::store::Writer<k8s_openapi::api::batch::v1::Job>,
) {
    use kube::runtime::{reflector, watcher::Event};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (service, handle) = tower_test::mock::pair::<http::Request<Body>, Response<Body>>();
    let mut ctx = super::context(kube::Client::new(service, "ns"), dir).await;
    let (jobs, mut writer) = reflector::store();
    writer.apply_watcher_event(&Event::Init);
    writer.apply_watcher_event(&Event::InitDone);
    ctx.caches.jobs = Some(jobs);
    (Arc::new(ctx), handle, writer)
}

/// A running step's log grows record by record: the status says so at most
/// every `PROGRESS_EVERY` (the Running condition's message does not count
/// records, so growth alone is a progress-only change).
#[tokio::test]
async fn a_running_steps_progress_is_written_at_most_every_few_seconds() {
    use kube::runtime::watcher::Event;
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, mut jobs) = mocked_with_job_cache(dir.path()).await;
    let (ctx, handle, run) = start(ctx, handle, super::run()).await;
    let running = serde_json::from_value(job(STEP_1, running())).unwrap();
    jobs.apply_watcher_event(&Event::Apply(running));

    // Step 1's pod holds the lease and has recorded two records: the
    // progress is written (the Job from the cache, the lease from the store).
    let pod = Duration::from_secs(30);
    step_pod(
        &ctx,
        vec![observation("one"), observation("two")],
        pod,
        false,
    )
    .await;
    let sent = run.clone();
    let (handle, status) = reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        let (status, answer) = receive_status(&mut handle).await;
        answer(&sent);
        expect_nothing_more(&mut handle).await;
        (handle, status)
    })
    .await;
    let head = ctx.log.store.head(UID).await.unwrap();
    let s = &status["status"];
    assert_eq!(
        (&s["phase"], &s["step"]["job"], &s["log"]["length"]),
        (&json!("Running"), &json!(STEP_1), &json!(3)),
        "{status}"
    );
    assert_eq!(s["log"]["headHash"], head.hash.to_string());

    // A record more at once: its progress waits for PROGRESS_EVERY.
    let run = super::with_status(run, &status);
    step_pod(&ctx, vec![observation("three")], pod, false).await;
    reconcile_against(&ctx, &run, async move {
        let mut handle = handle;
        expect_nothing_more(&mut handle).await;
    })
    .await;
    assert_eq!(
        kinds(&ctx).await.len(),
        4,
        "the controller appended nothing"
    );
}

/// A reconcile that fails (here its status write) keeps the log it read:
/// the retry reads only the records appended since, not the whole log from
/// its checkpoint again (the scale check's reads per record stay 1).
#[tokio::test]
async fn a_failed_reconcile_keeps_the_log_it_read_so_its_retry_reads_only_whats_new() {
    use kube::runtime::watcher::Event;
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, mut jobs) = mocked_with_job_cache(dir.path()).await;
    let (ctx, mut handle, run) = start(ctx, handle, super::run()).await;
    let running = serde_json::from_value(job(STEP_1, running())).unwrap();
    jobs.apply_watcher_event(&Event::Apply(running));
    let pod = Duration::from_secs(30);
    let steps = (0..5).map(|i| observation(&format!("{i}"))).collect();
    step_pod(&ctx, steps, pod, false).await;

    // The status write fails: the reconcile fails (and says so).
    let read_before = ctx.metrics.store_read_records.get();
    let server = tokio::spawn(async move {
        let (_, send) = receive(&mut handle, "PATCH", STATUS).await;
        let gone = json!({"apiVersion": "v1", "kind": "Status", "metadata": {},
            "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcd timeout"});
        respond(send, 500, &gone);
        answer_everything(&mut handle).await;
        handle
    });
    let failed = crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone()).await;
    assert!(failed.is_err(), "the reconcile failed: {failed:?}");
    let mut handle = server.await.unwrap();
    assert_eq!(ctx.metrics.store_read_records.get() - read_before, 5);

    // Two records more; the retry reads those two only.
    step_pod(&ctx, vec![observation("5"), observation("6")], pod, false).await;
    let read_before = ctx.metrics.store_read_records.get();
    let server = tokio::spawn(async move {
        answer_everything(&mut handle).await;
    });
    crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    server.await.unwrap();
    assert_eq!(
        ctx.metrics.store_read_records.get() - read_before,
        2,
        "the retry read the new records only"
    );
}

fn failed(reason: &str) -> Value {
    json!({"failed": 1, "conditions": [{"type": "Failed", "status": "True",
        "reason": reason, "message": "Job has reached the specified backoff limit"}]})
}

fn pods(pod_status: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
        "items": [{"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns"}, "status": pod_status}]})
}

/// A failed Job's pods are read to tell a lost pod from a crash: both are
/// retried (the credential first), only the crash counts against the
/// retry budget, and the step's last words reach the status.
#[tokio::test]
async fn a_failed_jobs_pods_tell_a_lost_worker_from_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), super::run()).await;
    let retried = |handle: Handle, run: AgentRun, name: &str, pod: Value, next: &str| {
        let (path, name, next, sent) = (
            format!("{JOBS}/{name}"),
            name.to_string(),
            next.to_string(),
            run.clone(),
        );
        let ctx = ctx.clone();
        async move {
            reconcile_against(&ctx, &run, async move {
                let mut handle = handle;
                let failed = job(&name, failed("BackoffLimitExceeded"));
                expect(&mut handle, "GET", &path, failed).await;
                expect(&mut handle, "GET", "/api/v1/namespaces/ns/pods", pods(pod)).await;
                expect_policies(&mut handle).await;
                expect(
                    &mut handle,
                    "POST",
                    "/api/v1/namespaces/ns/secrets",
                    Value::Null,
                )
                .await;
                let created = expect(&mut handle, "POST", JOBS, Value::Null).await;
                assert_eq!(created["metadata"]["name"], json!(next));
                let (status, answer) = receive_status(&mut handle).await;
                answer(&sent);
                expect_events(&mut handle, &["StepRetried"]).await;
                expect_nothing_more(&mut handle).await;
                (handle, status)
            })
            .await
        }
    };

    // Evicted (a DisruptionTarget condition): lost, not counted.
    let evicted = json!({"phase": "Failed", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]});
    let (handle, status) = retried(handle, run.clone(), STEP_1, evicted, "r1-951103-s1-a2").await;
    let step = &status["status"]["step"];
    assert_eq!(
        (&step["attempt"], &step["failedJobs"]),
        (&json!(2), &json!(1)),
        "{status}"
    );
    assert_eq!(step["stalled"].as_u64().unwrap_or(0), 0, "{status}");

    // Crashed in place, its last words in the termination message: counted.
    let run = super::with_status(run, &status);
    let crashed = json!({"phase": "Failed", "containerStatuses": [{"name": "step",
        "image": "agentrun:test", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 101, "message": "panic: boom"}}}]});
    let (_, status) = retried(handle, run, "r1-951103-s1-a2", crashed, "r1-951103-s1-a3").await;
    let step = &status["status"]["step"];
    assert_eq!(
        (&step["attempt"], &step["failedJobs"], &step["stalled"]),
        (&json!(3), &json!(2), &json!(1)),
        "{status}"
    );
    let said = status["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Succeeded")
        .map(|c| c["message"].to_string())
        .unwrap_or_default();
    assert!(said.contains("the step said: panic: boom"), "{status}");
    assert_eq!(kinds(&ctx).await, ["RunStarted"], "nothing recorded");
}

/// A final answer of any size (here 2,000 three-byte characters) ends the
/// run with an Event the API server takes: its note is cut to the 1024
/// bytes of an Event's note, not to 900 characters (2,700 bytes here: the
/// Event was refused and lost).
#[tokio::test]
async fn a_long_final_answer_ends_the_run_with_an_event_note_the_api_server_takes() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle, run) = started(dir.path(), super::run()).await;
    let answer = "界".repeat(2000);
    step_pod(
        &ctx,
        vec![model_call(Some(&answer), vec![])],
        Duration::from_secs(30),
        true,
    )
    .await;
    let (_, seen) = super::reconcile_recorded(&ctx, handle, &run, job(STEP_1, complete())).await;
    let event = seen
        .iter()
        .find(|(what, body)| what.ends_with("/events") && body["reason"] == "RunSucceeded")
        .map(|(_, body)| body)
        .expect("the run's end is an Event");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.len() <= crate::text::EVENT_NOTE_MAX_BYTES,
        "{} bytes",
        note.len()
    );
    assert!(note.starts_with("界界界") && note.ends_with('…'), "{note}");
}
