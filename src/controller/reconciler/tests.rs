//! The reconciler against a mocked API server that checks each request in
//! order (method and path) and answers it, with a real (SQLite) step log:
//! what one reconcile reads and writes, and in which order, is part of the
//! contract (the log before the status; nothing read per reconcile that a
//! watch cache holds).

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use kube::client::Body;
use kube::runtime::events::Reporter;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use crate::api::AgentRun;
use crate::controller::context::Context;
use crate::controller::context::JobSettings;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

type Responder = tower_test::mock::SendResponse<Response<Body>>;

/// The next request, checked for its method and path, not answered yet:
/// the test can look at the store before it lets the reconcile go on.
async fn receive(handle: &mut Handle, method: &str, path: &str) -> (Value, Responder) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
        .expect("the client is alive");
    let seen = format!("{} {}", request.method(), request.uri().path());
    assert_eq!(seen, format!("{method} {path}"), "requests out of order");
    let body = request.into_body().collect_bytes().await.unwrap();
    let body = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap()
    };
    (body, send)
}

fn respond(send: Responder, code: u16, reply: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(reply).unwrap()))
            .unwrap(),
    );
}

/// Answers the next request after checking its method and path (with
/// `reply`, or the request's own body when that is `null`, as a create or an
/// apply returns the object); returns the request's body.
async fn expect(handle: &mut Handle, method: &str, path: &str, reply: Value) -> Value {
    let (body, send) = receive(handle, method, path).await;
    respond(send, 200, if reply.is_null() { &body } else { &reply });
    body
}

/// Answers the requests no test here asserts on (none expected): fails the
/// test if one comes.
async fn expect_nothing_more(handle: &mut Handle) {
    let next = tokio::time::timeout(std::time::Duration::from_millis(200), handle.next_request());
    if let Ok(Some((request, _))) = next.await {
        panic!(
            "unexpected request {} {}",
            request.method(),
            request.uri().path()
        );
    }
}

/// Answers the run's status apply with the run carrying that status.
async fn expect_status(handle: &mut Handle, run: &AgentRun) -> Value {
    let path = "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns/r1/status";
    let (request, send) = handle.next_request().await.expect("the client is alive");
    assert_eq!(
        format!("{} {}", request.method(), request.uri().path()),
        format!("PATCH {path}"),
        "requests out of order"
    );
    let body: Value =
        serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap()).unwrap();
    let mut reply = serde_json::to_value(run).unwrap();
    reply["status"] = body["status"].clone();
    send.send_response(
        Response::builder()
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap(),
    );
    body
}

/// The Events a reconcile posts, in order, by reason.
async fn expect_events(handle: &mut Handle, reasons: &[&str]) {
    for reason in reasons {
        let event = expect(
            handle,
            "POST",
            "/apis/events.k8s.io/v1/namespaces/ns/events",
            Value::Null,
        )
        .await;
        assert_eq!(event["reason"], *reason);
    }
}

/// The platform's policies, read before a run starts: one AgentPolicy that
/// lets runs use the Secret `model-key`.
async fn expect_policy_allowing_the_model_key(handle: &mut Handle) {
    expect(
        handle,
        "GET",
        "/apis/agentrun.dev/v1alpha1/clusteragentpolicies",
        list("ClusterAgentPolicy"),
    )
    .await;
    let mut policies = list("AgentPolicy");
    policies["items"] = json!([{
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "platform", "namespace": "ns"},
        "spec": {"allowedSecrets": [{"name": "model-key"}]}
    }]);
    expect(
        handle,
        "GET",
        "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentpolicies",
        policies,
    )
    .await;
}

/// Reconciles `run` against an API server whose one AgentPolicy allows the
/// model key; expects its status and then the Events `events`. Returns the status.
async fn reconcile_with_the_model_key_allowed(
    ctx: &Arc<Context>,
    mut handle: Handle,
    run: AgentRun,
    events: &'static [&'static str],
) -> Value {
    let sent = run.clone();
    let server = tokio::spawn(async move {
        expect_policy_allowing_the_model_key(&mut handle).await;
        let status = expect_status(&mut handle, &sent).await;
        expect_events(&mut handle, events).await;
        expect_nothing_more(&mut handle).await;
        status
    });
    crate::controller::reconciler::reconcile(Arc::new(run), ctx.clone())
        .await
        .unwrap();
    server.await.unwrap()
}

/// The platform's policies, read (none) before a run starts or a Job is made.
async fn expect_policies(handle: &mut Handle) {
    for (path, kind) in [
        (
            "/apis/agentrun.dev/v1alpha1/clusteragentpolicies",
            "ClusterAgentPolicy",
        ),
        (
            "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentpolicies",
            "AgentPolicy",
        ),
    ] {
        expect(handle, "GET", path, list(kind)).await;
    }
}

fn list(kind: &str) -> Value {
    json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": format!("{kind}List"),
           "metadata": {"resourceVersion": "1"}, "items": []})
}

fn run() -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "r1", "namespace": "ns", "uid": "uid-r1", "generation": 1},
        "spec": {"input": "task", "agent": {
            "model": {"provider": "OpenAI", "name": "m", "endpoint": "http://127.0.0.1:9/v1"},
            "prompt": {"version": "v1", "system": "be careful"}
        }}
    }))
    .unwrap()
}

async fn context(client: kube::Client, dir: &std::path::Path) -> Context {
    let store = crate::store::open(&format!("sqlite://{}", dir.join("log.db").display()))
        .await
        .unwrap();
    let tokens =
        crate::keys::step_token::TokenKey::new(b"a key of the reconcile test, 32 bytes or more")
            .unwrap();
    let signer = tokens.record_signer();
    let mut registry = Registry::default();
    let memory = std::sync::Arc::new(crate::controller::memory::RunMemory::default());
    Context {
        reporter: Reporter {
            controller: "agentrun-controller".into(),
            instance: None,
        },
        client,
        metrics: crate::controller::metrics::Metrics::new(&mut registry),
        jobs: JobSettings {
            image: "agentrun:test".into(),
            store_url: "http://gateway:8081".into(),
            controller_key: signer.public_key_hex(),
            key_id: signer.key_id().to_string(),
            service_account: "default".into(),
            time_slice_seconds: 60,
            allow_failpoints: false,
            telemetry_env: Vec::new(),
        },
        log: crate::controller::context::LogAccess {
            store,
            store_name: "default".into(),
            pushes: false,
            tokens,
            verifier: signer.verifier(),
            signer,
            identity: "controller/test".into(),
            reads: crate::store::ReadBudget::new(32 << 20),
            checkpoint_min: crate::controller::reconciler::checkpoint::MIN_SEQ,
        },
        outbound: crate::controller::context::Outbound {
            http: reqwest::Client::new(),
            user_urls: Default::default(),
            console_url: None,
        },
        caches: Default::default(),
        memory: memory.clone(),
        discovery: crate::controller::watchers::tool_discovery::Discovery::new(
            reqwest::Client::new(),
            Default::default(),
            crate::controller::watchers::tool_discovery::Limits::default(),
            memory,
        )
        .0,
        slots: crate::controller::slots::Slots::new(0, 0),
    }
}

/// The status a server-side apply sent, applied to `run` (what the next
/// reconcile would see).
fn with_status(mut run: AgentRun, patch: &Value) -> AgentRun {
    run.status = Some(serde_json::from_value(patch["status"].clone()).unwrap());
    run
}

/// A context whose API server is the mock behind the returned handle, its
/// log an SQLite store in `dir`.
async fn mocked(dir: &std::path::Path) -> (Arc<Context>, Handle) {
    mocked_with(dir, |_| {}).await
}

/// [`mocked`], the context changed by `change` first.
async fn mocked_with(
    dir: &std::path::Path,
    change: impl FnOnce(&mut Context),
) -> (Arc<Context>, Handle) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut ctx = context(kube::Client::new(service, "ns"), dir).await;
    change(&mut ctx);
    (Arc::new(ctx), handle)
}

#[tokio::test]
async fn reconcile_starts_a_run_then_creates_its_first_job_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, mut handle) = mocked(dir.path()).await;
    let run = run();

    // First reconcile: the platform's policies, then (after RunStarted is in
    // the log) the status, then the Event.
    let sent = run.clone();
    let server = tokio::spawn(async move {
        expect_policies(&mut handle).await;
        let status = expect_status(&mut handle, &sent).await;
        expect_events(&mut handle, &["AgentResolved", "RunStarted"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, status)
    });
    crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    let (mut handle, status) = server.await.unwrap();
    assert_eq!(status["status"]["log"]["length"], 1, "{status}");
    let log = ctx.log.store.read_all("uid-r1").await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].kind.as_str(), "RunStarted");

    // Second: policies judge the Job; the credential, the Job, the status, the Event.
    let run = with_status(run, &status);
    let sent = run.clone();
    let server = tokio::spawn(async move {
        expect_policies(&mut handle).await;
        let secret = expect(
            &mut handle,
            "POST",
            "/api/v1/namespaces/ns/secrets",
            Value::Null,
        )
        .await;
        assert_eq!(secret["metadata"]["ownerReferences"][0]["uid"], "uid-r1");
        let job = expect(
            &mut handle,
            "POST",
            "/apis/batch/v1/namespaces/ns/jobs",
            Value::Null,
        )
        .await;
        assert_eq!(job["metadata"]["name"], "r1-951103-s1-a1");
        let status = expect_status(&mut handle, &sent).await;
        assert_eq!(status["status"]["step"]["job"], "r1-951103-s1-a1");
        expect_events(&mut handle, &["StepStarted"]).await;
        expect_nothing_more(&mut handle).await;
        (handle, status)
    });
    crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    let (mut handle, status) = server.await.unwrap();

    // Third, with the Job running (it comes from the watch cache when there
    // is one; here from a GET) and nothing new in the log: no write at all.
    let run = with_status(run, &status);
    let server = tokio::spawn(async move {
        let job = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "r1-951103-s1-a1", "namespace": "ns",
                "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                    "name": "r1", "uid": "uid-r1", "controller": true}]},
            "status": {"active": 1, "ready": 1}});
        expect(
            &mut handle,
            "GET",
            "/apis/batch/v1/namespaces/ns/jobs/r1-951103-s1-a1",
            job,
        )
        .await;
        expect_nothing_more(&mut handle).await;
        handle
    });
    crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    let mut handle = server.await.unwrap();

    // Fourth: the Job failed (its pod could not mount the credential, which
    // someone deleted, until the Job's deadline passed): the retry makes
    // sure the credential exists again before its Job, although this
    // process created it before.
    let sent = run.clone();
    let server = tokio::spawn(async move {
        let job = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "r1-951103-s1-a1", "namespace": "ns",
                "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                    "name": "r1", "uid": "uid-r1", "controller": true}]},
            "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True",
                "reason": "DeadlineExceeded", "message": "Job was active longer than specified deadline"}]}});
        expect(
            &mut handle,
            "GET",
            "/apis/batch/v1/namespaces/ns/jobs/r1-951103-s1-a1",
            job,
        )
        .await;
        expect_policies(&mut handle).await;
        expect(
            &mut handle,
            "POST",
            "/api/v1/namespaces/ns/secrets",
            Value::Null,
        )
        .await;
        let job = expect(
            &mut handle,
            "POST",
            "/apis/batch/v1/namespaces/ns/jobs",
            Value::Null,
        )
        .await;
        assert_eq!(job["metadata"]["name"], "r1-951103-s1-a2");
        expect_status(&mut handle, &sent).await;
    });
    crate::controller::reconciler::reconcile(Arc::new(run), ctx.clone())
        .await
        .unwrap();
    server.await.unwrap();
}

/// Answers every request with its own body until none comes for a moment.
async fn answer_everything(handle: &mut Handle) {
    loop {
        let next =
            tokio::time::timeout(std::time::Duration::from_millis(300), handle.next_request());
        let Ok(Some((request, send))) = next.await else {
            return;
        };
        let body = request.into_body().collect_bytes().await.unwrap();
        let body = if body.is_empty() {
            b"{}".to_vec()
        } else {
            body.to_vec()
        };
        send.send_response(Response::builder().body(Body::from(body)).unwrap());
    }
}

#[tokio::test]
async fn reconcile_reads_no_log_of_a_waiting_run_until_it_is_woken() {
    use crate::store::{RecordDraft, StepKind};
    let dir = tempfile::tempdir().unwrap();
    let (ctx, mut handle) = mocked(dir.path()).await;

    // A log left by an earlier process, the run's status anchoring its head.
    let lease = ctx
        .log
        .store
        .acquire("uid-r1", "test", std::time::Duration::from_secs(5))
        .await
        .unwrap();
    let mut head = crate::store::Head::EMPTY;
    for n in 0..3 {
        let record = RecordDraft::new(StepKind::Observation, json!({"n": n}))
            .seal(&head)
            .unwrap();
        head = ctx
            .log
            .store
            .append("uid-r1", lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    let approval = "r1-a2-0a1b2c3d";
    let mut run = run();
    run.metadata.resource_version = Some("7".into());
    run.status = Some(
        serde_json::from_value(json!({
            "phase": "AwaitingApproval", "observedGeneration": 1,
            "approval": {"name": approval},
            "log": {"store": "default", "runKey": "uid-r1", "length": head.len,
                    "headHash": head.hash.to_string()},
            "conditions": [{"type": "AgentResolved", "status": "True", "reason": "Inline",
                "message": "the run defines its agent inline in spec.agent",
                "lastTransitionTime": "2026-12-01T00:00:00Z", "observedGeneration": 1}]
        }))
        .unwrap(),
    );
    let found = |generation: i64| {
        json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
            "metadata": {"name": approval, "namespace": "ns", "generation": generation,
                "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                    "name": "r1", "uid": "uid-r1"}]},
            "spec": {"runRef": {"name": "r1", "uid": "uid-r1"}, "step": 2,
                "tool": "refund", "arguments": {"amount": 500},
                "argumentsHash": "0".repeat(64), "expiresAt": "2099-01-01T00:00:00Z",
                "approvers": {"users": ["alice"]}},
            "status": {"state": "Pending"}})
    };
    let path = format!("/apis/agentrun.dev/v1alpha1/namespaces/ns/approvals/{approval}");
    let reads = |ctx: &Context| {
        (
            ctx.metrics.store_reads.get(),
            ctx.metrics.store_read_records.get(),
        )
    };

    // Seen first by this process (a restart): its head and its Approval, no log.
    // Then woken by something that changed neither (a Job's deletion): the same.
    for wake in ["start", "a Job's deletion"] {
        let (p, reply) = (path.clone(), found(1));
        let server = tokio::spawn(async move {
            expect(&mut handle, "GET", &p, reply).await;
            expect_nothing_more(&mut handle).await;
            handle
        });
        let action = crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
            .await
            .unwrap();
        handle = server.await.unwrap();
        assert_ne!(
            action,
            kube::runtime::controller::Action::await_change(),
            "{wake}"
        );
    }
    assert_eq!(reads(&ctx), (2, 0), "two head reads, no record read");

    // Someone changed the run: it is read whole.
    run.metadata.resource_version = Some("8".into());
    let server = tokio::spawn(async move { answer_everything(&mut handle).await });
    let _ = crate::controller::reconciler::reconcile(Arc::new(run), ctx.clone()).await;
    server.await.unwrap();
    assert_eq!(reads(&ctx), (3, head.len), "the whole log read once more");
}

/// Answers every request (a GET of a Job with `job`, the rest with its own
/// body) until none comes for a moment; returns what came, in order.
async fn answer_recording(
    handle: &mut Handle,
    run: &AgentRun,
    job: &Value,
    mut reconciled: tokio::sync::oneshot::Receiver<()>,
) -> Vec<(String, Value)> {
    let mut seen = Vec::new();
    let mut done = false;
    loop {
        // Every request is answered while the reconcile runs, however slow
        // a loaded machine makes it (a silence then is no end: a request
        // nobody answers would hang it); after it, what follows at once.
        let request = if done {
            tokio::time::timeout(Duration::from_millis(300), handle.next_request())
                .await
                .ok()
                .flatten()
        } else {
            tokio::select! {
                r = handle.next_request() => r,
                _ = &mut reconciled => {
                    done = true;
                    continue;
                }
            }
        };
        let Some((request, send)) = request else {
            return seen;
        };
        let what = format!("{} {}", request.method(), request.uri().path());
        let body = request.into_body().collect_bytes().await.unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let reply = if what.ends_with("/clusteragentpolicies") {
            list("ClusterAgentPolicy")
        } else if what.ends_with("/agentpolicies") {
            list("AgentPolicy")
        } else if what.starts_with("GET /apis/batch/v1/") {
            job.clone()
        } else if what.starts_with("GET /api/v1/namespaces/ns/pods") {
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []})
        } else if what.ends_with("/agentruns/r1/status") {
            let mut reply = serde_json::to_value(run).unwrap();
            reply["status"] = body["status"].clone();
            reply
        } else if body.is_null() {
            json!({})
        } else {
            body.clone()
        };
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap(),
        );
        seen.push((what, body));
    }
}

/// One reconcile of `run` against [`answer_recording`].
async fn reconcile_recorded(
    ctx: &Arc<Context>,
    mut handle: Handle,
    run: &AgentRun,
    job: Value,
) -> (Handle, Vec<(String, Value)>) {
    let sent = run.clone();
    let (reconciled, done) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let seen = answer_recording(&mut handle, &sent, &job, done).await;
        (handle, seen)
    });
    crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    let _ = reconciled.send(());
    server.await.unwrap()
}

#[tokio::test]
async fn a_job_of_the_steps_name_made_by_someone_else_is_never_taken_for_the_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, mut handle) = mocked(dir.path()).await;
    let mut run = run();
    let mut status = Value::Null;
    // (`handle` goes to each reconcile's answering task and comes back.)
    // Start the run and create its first Job, recording the status sent.
    for _ in 0..2 {
        let (h, seen) = reconcile_recorded(&ctx, handle, &run, Value::Null).await;
        handle = h;
        if let Some((_, s)) = seen.iter().rev().find(|(w, _)| w.ends_with("/status")) {
            status = s.clone();
        }
        run = with_status(run, &status);
    }
    assert_eq!(status["status"]["step"]["job"], "r1-951103-s1-a1");

    // A Job of that name, Complete, controlled by another run (or by nobody).
    for owner in [
        json!([{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                          "name": "r1", "uid": "uid-of-another-r1", "controller": true}]),
        json!(null),
    ] {
        let foreign = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "r1-951103-s1-a1", "namespace": "ns", "ownerReferences": owner},
            "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}});
        let (h, seen) = reconcile_recorded(&ctx, handle, &run, foreign).await;
        handle = h;
        let created: Vec<&Value> = seen
            .iter()
            .filter(|(w, _)| w == "POST /apis/batch/v1/namespaces/ns/jobs")
            .map(|(_, b)| b)
            .collect();
        assert_eq!(created.len(), 1, "the run takes its next attempt: {seen:?}");
        assert_eq!(created[0]["metadata"]["name"], "r1-951103-s1-a2");
        // Taken for the run's, a Complete Job that recorded nothing would
        // count against the retry budget; a Job that is not the run's is
        // lost to it, which never counts (`stalled`).
        let st = seen
            .iter()
            .rev()
            .find(|(w, _)| w.ends_with("/status"))
            .map(|(_, s)| s.clone())
            .expect("a status write");
        assert_eq!(st["status"]["step"]["job"], "r1-951103-s1-a2");
        let stalled = st["status"]["step"]["stalled"].as_u64().unwrap_or(0);
        assert_eq!(stalled, 0, "{st}");
    }
}

/// A policy cache whose watches have listed `local` (and no cluster policy),
/// with the writers that keep it ready.
fn listed_policies(
    local: Vec<crate::api::AgentPolicy>,
) -> (
    crate::controller::watchers::platform::PolicyCache,
    impl Sized, // the writers
) {
    use kube::runtime::{reflector, watcher::Event};
    let (cluster, mut cluster_writer) = reflector::store::<crate::api::ClusterAgentPolicy>();
    let (local_store, mut local_writer) = reflector::store::<crate::api::AgentPolicy>();
    cluster_writer.apply_watcher_event(&Event::Init);
    cluster_writer.apply_watcher_event(&Event::InitDone);
    local_writer.apply_watcher_event(&Event::Init);
    for p in local {
        local_writer.apply_watcher_event(&Event::InitApply(p));
    }
    local_writer.apply_watcher_event(&Event::InitDone);
    let cache = crate::controller::watchers::platform::PolicyCache {
        cluster,
        local: local_store,
    };
    (cache, (cluster_writer, local_writer))
}

/// A policy created together with its run can reach the controller's watch
/// after the run: a refusal by the cache is checked against the API server
/// before it ends the run, which then starts.
#[tokio::test]
async fn a_secret_refused_by_a_policy_cache_that_lags_is_judged_again_by_the_api_server() {
    let dir = tempfile::tempdir().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut ctx = context(kube::Client::new(service, "ns"), dir.path()).await;
    let (cache, _writers) = listed_policies(Vec::new());
    ctx.caches.policies = Some(cache);
    let ctx = Arc::new(ctx);
    let mut run = run();
    run.spec.agent.as_mut().unwrap().model.secret_ref =
        Some(serde_json::from_value(json!({"name": "model-key", "key": "apiKey"})).unwrap());

    let status =
        reconcile_with_the_model_key_allowed(&ctx, handle, run, &["AgentResolved", "RunStarted"])
            .await;
    assert_ne!(status["status"]["phase"], "Failed", "{status}");
    let log = ctx.log.store.read_all("uid-r1").await.unwrap();
    let kinds: Vec<_> = log.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(kinds, ["RunStarted"], "the run started, not concluded");
}

/// A GitOps apply may bring the run before the AgentPolicy that lets it
/// use its Secret: the run waits, Pending, saying what for (no record, no
/// Job), and starts once the policy is there, never failing on the way.
#[tokio::test]
async fn a_run_whose_secret_no_policy_lists_yet_waits_for_the_policy_then_starts() {
    let dir = tempfile::tempdir().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Arc::new(context(kube::Client::new(service, "ns"), dir.path()).await);
    let mut run = run();
    run.spec.agent.as_mut().unwrap().model.secret_ref =
        Some(serde_json::from_value(json!({"name": "model-key", "key": "apiKey"})).unwrap());

    // No policy yet: the run waits.
    let sent = run.clone();
    let server = tokio::spawn(async move {
        expect_policies(&mut handle).await;
        let status = expect_status(&mut handle, &sent).await;
        expect_events(&mut handle, &["AgentResolved", "WaitingForPolicy"]).await;
        expect_nothing_more(&mut handle).await;
        (status, handle)
    });
    let action = crate::controller::reconciler::reconcile(Arc::new(run.clone()), ctx.clone())
        .await
        .unwrap();
    let (status, handle) = server.await.unwrap();
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(std::time::Duration::from_secs(5))
    );
    let st = &status["status"];
    assert_eq!(st["phase"], "Pending", "{status}");
    assert_eq!(st["waitingOn"], "agentpolicy/allowedSecrets/model-key");
    let allowed = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Allowed")
        .expect("an Allowed condition");
    assert_eq!(
        (&allowed["status"], &allowed["reason"]),
        (&json!("False"), &json!("WaitingForPolicy"))
    );
    assert!(
        allowed["message"]
            .as_str()
            .unwrap()
            .contains("spec.model.secretRef")
    );
    assert!(
        ctx.log.store.read_all("uid-r1").await.unwrap().is_empty(),
        "nothing recorded"
    );

    // The policy arrives: the same run (with the status it wrote) starts.
    let run = with_status(run, &status);
    let status =
        reconcile_with_the_model_key_allowed(&ctx, handle, run, &["RunStarted", "PolicyAllowed"])
            .await;
    assert_ne!(status["status"]["phase"], "Failed", "{status}");
    let log = ctx.log.store.read_all("uid-r1").await.unwrap();
    let kinds: Vec<_> = log.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["RunStarted"],
        "the run started once the policy came"
    );
}

mod bytes;
mod claims;
mod paths;

/// Approval webhooks are counted by outcome: one the egress policy refuses
/// never leaves, one allowed reaches its server once.
#[tokio::test]
async fn approval_webhooks_are_counted_by_outcome() {
    use crate::controller::metrics::OutcomeLabel;
    let dir = tempfile::tempdir().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (service, _handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let mut ctx = context(kube::Client::new(service, "ns"), dir.path()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    let (got_tx, mut got) = tokio::sync::mpsc::unbounded_channel::<()>();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let _ = got_tx.send(());
            async { "ok" }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let count = |ctx: &Context, outcome: &str| {
        ctx.metrics
            .approval_webhooks
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .get()
    };
    let request = crate::runlog::records::ApprovalRequested {
        model_call_seq: 1,
        call_index: 0,
        call_id: "c0".into(),
        tool: "issue_refund".into(),
        arguments_hash: "h".into(),
        arguments: json!({"amount": 500}),
        reason: None,
        observations: vec![],
        dependencies: vec![],
        gate: crate::policy::Gate {
            notify_webhook: Some(hook.clone()),
            ..Default::default()
        },
        escalation: 0,
        alternative: None,
        kind: crate::runlog::v1::ApprovalKind::Call,
        intent_seq: None,
    };
    let run = run();
    // The test context allows no user address at all.
    crate::controller::approvals::notify(
        &ctx,
        &run,
        "a",
        &request,
        crate::controller::approvals::notify::NoticeKind::Raised,
        json!({}),
    );
    assert_eq!(count(&ctx, "refused"), 1);
    assert!(got.try_recv().is_err(), "a refused webhook never leaves");

    ctx.outbound.user_urls = Arc::new(crate::egress::Policy::new(
        vec!["127.0.0.1/32".parse().unwrap()],
        vec![],
        false,
    ));
    ctx.outbound.http = crate::egress::client(ctx.outbound.user_urls.clone()).unwrap();
    crate::controller::approvals::notify(
        &ctx,
        &run,
        "a",
        &request,
        crate::controller::approvals::notify::NoticeKind::Raised,
        json!({}),
    );
    tokio::time::timeout(Duration::from_secs(10), got.recv())
        .await
        .expect("the webhook was delivered")
        .unwrap();
    // Counted once the delivery's reply is read, just after the server saw it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count(&ctx, "sent") != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the delivery was never counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!((count(&ctx, "failed"), count(&ctx, "dropped")), (0, 0));
}

/// A panic in one reconcile (a bug that some run's input reaches) fails that
/// reconcile only: the run is marked Stalled with a Warning Event, the error
/// is counted as `panic` and backed off, and the same process reconciles on.
/// (kube-runtime polls reconciles inside the controller's own future: the
/// panic used to end the process, and every tenant's runs with it.)
#[tokio::test]
async fn a_panic_in_one_reconcile_fails_that_run_and_the_process_goes_on() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::controller::Error;
    use crate::controller::metrics::ReasonLabel;
    use crate::controller::reconciler::{error_policy, reconcile};
    let dir = tempfile::tempdir().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The API server's first answer meets the bug: a panic, in the reconcile's task.
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let armed = Arc::new(AtomicBool::new(true));
    let service = tower::ServiceExt::map_response(mock, move |r: Response<Body>| {
        if armed.swap(false, Ordering::SeqCst) {
            panic!("a bug this run's input reached");
        }
        r
    });
    let ctx = Arc::new(context(kube::Client::new(service, "ns"), dir.path()).await);
    let run = run();

    let sent = run.clone();
    let mut handle = handle;
    let (reconciled, done) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let seen = answer_recording(&mut handle, &sent, &Value::Null, done).await;
        (handle, seen)
    });
    let result = reconcile(Arc::new(run.clone()), ctx.clone()).await;
    let _ = reconciled.send(());
    let (handle, seen) = server.await.unwrap();
    let error = result.expect_err("the reconcile fails");
    assert!(matches!(error, Error::Panicked(_)), "{error}");

    // Recorded on the run: the Stalled condition, then its Warning Event.
    let status = seen
        .iter()
        .find(|(what, _)| what.ends_with("/agentruns/r1/status"))
        .map(|(_, body)| body)
        .expect("the stall is written to the status");
    let stalled = status["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Stalled")
        .expect("a Stalled condition");
    assert_eq!(stalled["status"], "True", "{stalled}");
    let message = stalled["message"].as_str().unwrap();
    assert!(
        message.contains("panicked") && message.contains("a bug this run's input reached"),
        "{message}"
    );
    let event = seen
        .iter()
        .find(|(what, _)| what.ends_with("/events"))
        .map(|(_, body)| body)
        .expect("a Warning Event");
    assert_eq!(
        (&event["reason"], &event["type"]),
        (&json!("Stalled"), &json!("Warning"))
    );

    // Backed off like any failed reconcile, and counted by its reason.
    let action = error_policy(Arc::new(run.clone()), &error, ctx.clone());
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(Duration::from_secs(1))
    );
    let panics = ctx
        .metrics
        .reconcile_errors
        .get_or_create(&ReasonLabel {
            reason: "panic".into(),
        })
        .get();
    assert_eq!(panics, 1);

    // The process goes on: the next reconcile starts the run.
    reconcile_recorded(&ctx, handle, &run, Value::Null).await;
    let log = ctx.log.store.read_all("uid-r1").await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].kind.as_str(), "RunStarted");
}

/// The context of a controller whose key was rotated: `new` current, the
/// test context's key retired.
fn rotated(mut ctx: Context, new: &[u8]) -> Context {
    use crate::keys::step_token::TokenKey;
    let retired = [
        b"a key of the reconcile test, 32 bytes or more".as_slice(),
        b" 2026-12-05T12:00:00Z",
    ]
    .concat();
    let tokens = TokenKey::new(new).unwrap().with_retired(&retired).unwrap();
    ctx.log.signer = tokens.record_signer();
    ctx.log.verifier = tokens.record_verifier();
    ctx.jobs.controller_key = ctx.log.verifier.to_hex();
    ctx.jobs.key_id = ctx.log.signer.key_id().to_string();
    ctx.log.tokens = tokens;
    ctx
}

/// The status a reconcile wrote, from what [`answer_recording`] saw.
fn written_status(seen: &[(String, Value)]) -> Value {
    seen.iter()
        .rev()
        .find(|(what, _)| what.ends_with("/agentruns/r1/status"))
        .map(|(_, body)| body.clone())
        .expect("a status write")
}

/// After a rotation the controller records, in the run's status, the seq
/// from which the new key signs; mallory (a database writer holding the
/// leaked retired key) then appends a `RunFinished` she signed with it: the
/// controller stops the run as tampered instead of finishing it.
#[tokio::test]
async fn reconcile_refuses_a_record_the_retired_key_signed_after_the_switch() {
    use crate::store::{RecordDraft, StepKind};
    let dir = tempfile::tempdir().unwrap();
    let idle_job = json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "r1-951103-s1-a1", "namespace": "ns"}, "status": {"active": 1}});

    // The run starts under the old key.
    let (old, handle) = mocked(dir.path()).await;
    let (_, seen) = reconcile_recorded(&old, handle, &run(), idle_job.clone()).await;
    let status = written_status(&seen);
    let old_id = old.log.signer.key_id().to_string();
    assert_eq!(
        status["status"]["log"]["signingKeys"],
        json!([{"key": old_id, "from": 0}])
    );

    // The rotated controller's first status of the run records the switch.
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let new = Arc::new(rotated(
        context(kube::Client::new(service, "ns"), dir.path()).await,
        b"the rotated key of the reconcile test, 32 bytes",
    ));
    let r = with_status(run(), &status);
    let (handle, seen) = reconcile_recorded(&new, handle, &r, idle_job.clone()).await;
    let status = written_status(&seen);
    let len = new.log.store.head("uid-r1").await.unwrap().len;
    assert_eq!(
        status["status"]["log"]["signingKeys"],
        json!([{"key": old_id, "from": 0}, {"key": new.log.signer.key_id(), "from": len}])
    );
    assert_ne!(status["status"]["phase"], "Failed", "{status}");

    // Mallory's RunFinished, signed with the retired key, after the switch.
    let head = new.log.store.head("uid-r1").await.unwrap();
    let forged = old
        .log
        .signer
        .seal(
            "uid-r1",
            RecordDraft::new(
                StepKind::RunFinished,
                json!({"outcome": "Succeeded", "result": "forged"}),
            ),
            &head,
        )
        .unwrap();
    let lease = new
        .log
        .store
        .acquire("uid-r1", "mallory", Duration::from_secs(10))
        .await
        .unwrap();
    new.log
        .store
        .append("uid-r1", lease.epoch, &forged)
        .await
        .unwrap();
    new.log.store.release(&lease).await.unwrap();
    let r = with_status(r, &status);
    let (_, seen) = reconcile_recorded(&new, handle, &r, idle_job).await;
    let status = written_status(&seen);
    assert_eq!(status["status"]["phase"], "Failed", "{status}");
    let error = status["status"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!("broken at seq {}", forged.seq)) && error.contains("retired"),
        "{error}"
    );
    assert_ne!(status["status"]["result"], "forged");
}
