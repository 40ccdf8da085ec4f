//! Where requests go (issue 25): the controller reaches a user-chosen URL
//! only where the platform allows (the harness allows 127.0.0.1 alone), and
//! no reply body of such a request reaches a status or an Event.

use std::sync::{Arc, Mutex};

use agentrun::api::{AgentRun, Phase, REQUESTER_ANNOTATION};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::world::{TIMEOUT, World};
use super::common::{client_as, wait_for};

/// What a stand-in server saw: one entry per request, with its path and
/// the credential headers it carried.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    pub path: String,
    pub authorization: Option<String>,
    pub api_key: Option<String>,
}

/// A small HTTP server answering every request with `answer(path)`,
/// remembering what it saw.
pub struct Server {
    pub base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    pub async fn start<F>(addr: &str, answer: F) -> Server
    where
        F: Fn(&str) -> Response + Clone + Send + Sync + 'static,
    {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("binding");
        let base = format!("http://{}", listener.local_addr().unwrap());
        let seen: Arc<Mutex<Vec<Seen>>> = Default::default();
        let log = seen.clone();
        let app = axum::Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap| {
            let answer = answer.clone();
            let log = log.clone();
            async move {
                let text = |h: &str| {
                    headers
                        .get(h)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                log.lock().unwrap().push(Seen {
                    path: uri.path().to_string(),
                    authorization: text("authorization"),
                    api_key: text("x-api-key"),
                });
                answer(uri.path())
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Server { base, seen }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Lets `user` create and read runs in the test namespace.
async fn grant_run_creator(w: &World, user: &str) {
    let name = format!("{}-egress-creator", w.name());
    let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["agentrun.dev"], "resources": ["agentruns"],
                   "verbs": ["create", "get", "list"]}]});
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(w.client.clone());
    let apply = PatchParams::apply("e2e").force();
    roles
        .patch(&name, &apply, &Patch::Apply(&role))
        .await
        .expect("ClusterRole");
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": format!("{user}-egress"), "namespace": w.name()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}]});
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(w.client.clone(), w.name());
    bindings
        .patch(&format!("{user}-egress"), &apply, &Patch::Apply(&binding))
        .await
        .expect("RoleBinding");
}

/// Creates run `name` with an inline `agent` as `user`.
async fn create_as(w: &World, user: &str, name: &str, agent: Value) {
    let runs: Api<AgentRun> = Api::namespaced(client_as(user).await, w.name());
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": name, "annotations": {REQUESTER_ANNOTATION: user}},
        "spec": {"input": "x", "agent": agent}
    }))
    .expect("run manifest");
    runs.create(&PostParams::default(), &run)
        .await
        .expect("creating the run");
}

/// The agent of these tests with one MCP tool at `url`.
fn agent_with_mcp(w: &World, url: &str) -> Value {
    let mut agent = w.agent("egress");
    agent["tools"] = json!([{"name": "tickets", "description": "Opens tickets.",
        "mcp": {"url": url}}]);
    agent
}

/// Whether run `name` has no Job.
async fn no_job(w: &World, name: &str) -> bool {
    let jobs: Api<Job> = Api::namespaced(w.client.clone(), w.name());
    let mine = jobs
        .list(&ListParams::default().labels(&format!("agentrun.dev/run={name}")))
        .await
        .expect("jobs");
    mine.items.is_empty()
}

/// Waits for run `name` to fail, checks it made no Job, returns its status
/// and the texts of its Events.
async fn failed_without_a_job(w: &World, name: &str) -> (Value, Vec<String>) {
    let run = w.wait_phase(name, Phase::Failed).await;
    assert!(no_job(w, name).await, "a Job was created for {name}");
    (
        serde_json::to_value(&run.status).unwrap(),
        event_texts(w, name, "InvalidAgent").await,
    )
}

/// The texts (`reason message`) of run `name`'s Events, once one of
/// `reason` is among them (it is published with the status).
async fn event_texts(w: &World, name: &str, reason: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(w.client.clone(), w.name());
    let fields = format!("involvedObject.kind=AgentRun,involvedObject.name={name}");
    wait_for(&format!("{name}'s Events"), TIMEOUT, || async {
        let list = events
            .list(&ListParams::default().fields(&fields))
            .await
            .map_err(|e| e.to_string())?;
        let texts: Vec<String> = list
            .items
            .iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e.reason.clone().unwrap_or_default(),
                    e.message.clone().unwrap_or_default()
                )
            })
            .collect();
        if texts.iter().any(|t| t.starts_with(reason)) {
            Ok(texts)
        } else {
            Err(format!("{texts:?}"))
        }
    })
    .await
}

#[tokio::test]
async fn a_run_creators_mcp_url_on_an_internal_address_is_never_contacted() {
    let w = World::new("egress-internal", &[]).await;
    grant_run_creator(&w, "carol").await;
    // An internal service on a loopback address the platform did not allow
    // (the harness allows 127.0.0.1 only), and a private address.
    let internal = Server::start("127.0.0.2:0", |_| "password=hunter2".into_response()).await;
    for (name, url) in [
        ("loopback", format!("{}/mcp", internal.base)),
        ("private", "http://10.0.0.1:5432/".to_string()),
    ] {
        create_as(&w, "carol", name, agent_with_mcp(&w, &url)).await;
        let (status, events) = failed_without_a_job(&w, name).await;
        let error = status["error"].as_str().unwrap_or_default();
        assert!(
            error.starts_with("spec.agent.tools[0].mcp.url (tool \"tickets\"): "),
            "{error}"
        );
        assert!(
            error.contains("not on the platform's allow-list (--user-url-allow)"),
            "{error}"
        );
        assert!(
            events
                .iter()
                .any(|e| e.contains("not on the platform's allow-list")),
            "{events:?}"
        );
    }
    assert!(internal.seen().is_empty(), "{:?}", internal.seen());
}

#[tokio::test]
async fn a_failing_mcp_servers_reply_never_reaches_status_or_events() {
    let w = World::new("egress-reply", &[]).await;
    grant_run_creator(&w, "carol").await;
    // An allowed server that fails, putting what it holds in its replies.
    let leaky = Server::start("127.0.0.1:0", |path| match path {
        "/forbidden" => (StatusCode::FORBIDDEN, "password=hunter2").into_response(),
        "/text" => (
            [(header::CONTENT_TYPE, "text/password=hunter2")],
            "password=hunter2",
        )
            .into_response(),
        _ => axum::Json(json!({"jsonrpc": "2.0", "id": 0,
            "error": {"code": -32000, "message": "password=hunter2"}}))
        .into_response(),
    })
    .await;
    for (name, path, reason) in [
        ("forbidden", "/forbidden", "HTTP 403"),
        ("text", "/text", "neither JSON nor an event stream"),
        ("rpc", "/rpc", "JSON-RPC error -32000"),
    ] {
        let url = format!("{}{path}", leaky.base);
        create_as(&w, "carol", name, agent_with_mcp(&w, &url)).await;
        // The run waits (the server may be fixed), saying why in words of
        // the controller's own.
        let run = w.wait_discovery_failing(name, &[reason]).await;
        let status = serde_json::to_value(&run.status).unwrap();
        let events = event_texts(&w, name, "DiscoveryFailed").await;
        assert!(no_job(&w, name).await, "a Job was created for {name}");
        let everything = format!("{status} {events:?}");
        assert!(!everything.contains("hunter2"), "{name}: {everything}");
    }
    // The allowed server was asked, at the URLs given, with no credential.
    let seen = leaky.seen();
    assert!(!seen.is_empty());
    for s in &seen {
        assert!(
            ["/forbidden", "/text", "/rpc"].contains(&s.path.as_str()),
            "{s:?}"
        );
        assert!(s.authorization.is_none() && s.api_key.is_none(), "{s:?}");
    }
}

/// Lets the World's model key go only to endpoints below `prefix`.
async fn allow_key_only_below(w: &World, prefix: &str) {
    let api: Api<agentrun::api::AgentPolicy> = Api::namespaced(w.client.clone(), w.name());
    let policy = json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentPolicy",
        "metadata": {"name": "e2e-secrets"},
        "spec": {"allowedSecrets": [{"name": "model-key", "endpoints": [prefix]}]}});
    api.patch(
        "e2e-secrets",
        &PatchParams::apply("agentrun-e2e").force(),
        &Patch::Apply(&policy),
    )
    .await
    .expect("AgentPolicy");
}

#[tokio::test]
async fn a_model_key_never_follows_a_redirect_off_its_allowed_endpoint() {
    let w = World::new("egress-redirect", &[]).await;
    grant_run_creator(&w, "carol").await;
    // Where a hostile endpoint would send the key: another host...
    let elsewhere = Server::start("127.0.0.2:0", |_| {
        axum::Json(json!({"error": "not a model"})).into_response()
    })
    .await;
    let steal = format!("{}/steal", elsewhere.base);
    // ...and a path of the allowed host outside the allowed prefix.
    let allowed = Server::start("127.0.0.1:0", move |path| {
        let to = if path.contains("/host/") {
            steal.clone()
        } else if path.contains("/path/") {
            "/outside/steal".to_string()
        } else {
            return axum::Json(json!({"error": "not a model"})).into_response();
        };
        (StatusCode::TEMPORARY_REDIRECT, [(header::LOCATION, to)]).into_response()
    })
    .await;
    allow_key_only_below(&w, &format!("{}/allowed/", allowed.base)).await;
    let cases = [
        ("openai-host", "OpenAI", "host"),
        ("openai-path", "OpenAI", "path"),
        ("anthropic-host", "Anthropic", "host"),
        ("anthropic-path", "Anthropic", "path"),
    ];
    for (name, provider, to) in cases {
        let mut agent = w.agent("redirect");
        agent["model"]["provider"] = json!(provider);
        agent["model"]["endpoint"] = json!(format!("{}/allowed/{to}/{name}", allowed.base));
        create_as(&w, "carol", name, agent).await;
    }
    for (name, _, _) in cases {
        let run = w.wait_phase(name, Phase::Failed).await;
        let error = run.status.and_then(|s| s.error).unwrap_or_default();
        assert!(error.contains("HTTP 307"), "{name}: {error}");
        assert!(
            error.contains("redirects are not followed"),
            "{name}: {error}"
        );
    }
    // The key reached the allowed endpoint, in both wire formats...
    let seen = allowed.seen();
    let key = "sk-e2e-not-a-real-key";
    assert!(
        seen.iter()
            .any(|s| s.authorization.as_deref() == Some(&format!("Bearer {key}"))),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|s| s.api_key.as_deref() == Some(key)),
        "{seen:?}"
    );
    // ...and nothing else: no request outside the prefix, none elsewhere.
    for s in &seen {
        assert!(s.path.starts_with("/allowed/"), "{s:?}");
    }
    assert!(elsewhere.seen().is_empty(), "{:?}", elsewhere.seen());
}
