//! The step log as a Kubernetes API (`log.agentrun.dev/v1alpha1`,
//! `runlogs`; DESIGN.md section 10), served read-only by every controller
//! replica on its HTTPS port behind the API server's aggregation layer.
//!
//! Every resource request is authenticated as the aggregation layer
//! defines it ([`front_proxy`]) and authorized with one SubjectAccessReview
//! ([`authorize`]); only then is the run read (through the API server, for
//! its uid and recorded head) and its records (from the store). The wire
//! types are [`crate::api::runlog`]; `get` pages are in [`pages`], the
//! watch/follow stream in [`follow`].

pub mod authorize;
pub mod discovery;
pub mod follow;
pub mod front_proxy;
pub mod pages;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kube::Api;
use serde_json::{Value, json};

use crate::api::AgentRun;
use crate::store::{HeadEvent, StepStore};
use authorize::{Answer, Authorizer, Question};
use front_proxy::{RequestHeaderConfig, User};

use super::tls::PeerCert;

/// What the handlers share.
#[derive(Clone)]
pub struct LogApi {
    store: Arc<dyn StepStore>,
    client: kube::Client,
    authorizer: Authorizer,
    /// The API server's front-proxy settings, refreshed in the background.
    request_headers: Arc<RwLock<Option<RequestHeaderConfig>>>,
    /// Serve only this namespace's runs (the controller's `--namespace`).
    namespace: Option<String>,
    /// Head events of the store, for followers (one listener for all).
    heads: tokio::sync::broadcast::Sender<HeadEvent>,
    /// Whether the store pushes head events; followers poll when it does not.
    pushes: bool,
}

impl LogApi {
    /// The log API over `store`, asking `client` about runs and access.
    pub async fn new(
        store: Arc<dyn StepStore>,
        client: kube::Client,
        namespace: Option<String>,
        authz_ttl: Duration,
    ) -> anyhow::Result<LogApi> {
        let (heads, _) = tokio::sync::broadcast::channel(1024);
        let events = store.head_events().await?;
        let pushes = events.is_some();
        if let Some(mut events) = events {
            let heads = heads.clone();
            tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    // No follower is no error: the event is for nobody.
                    let _ = heads.send(event);
                }
            });
        }
        Ok(LogApi {
            store,
            authorizer: Authorizer::new(client.clone(), authz_ttl),
            client,
            request_headers: Default::default(),
            namespace,
            heads,
            pushes,
        })
    }

    /// The front-proxy settings in force (the TLS layer's client CA comes
    /// from the same read).
    pub fn set_request_headers(&self, config: Option<RequestHeaderConfig>) {
        *self.request_headers.write().expect("not poisoned") = config;
    }

    fn request_headers(&self) -> Option<RequestHeaderConfig> {
        self.request_headers.read().expect("not poisoned").clone()
    }
}

/// The routes of the log API (merged into the HTTPS server's router).
pub fn router(api: LogApi) -> Router {
    const V: &str = "/apis/log.agentrun.dev/v1alpha1";
    Router::new()
        .route("/apis", get(apis))
        .route("/apis/log.agentrun.dev", get(group))
        .route(V, get(resources))
        .route(&format!("{V}/runlogs"), get(list_all))
        .route(&format!("{V}/namespaces/{{ns}}/runlogs"), get(list))
        .route(&format!("{V}/namespaces/{{ns}}/runlogs/{{name}}"), get(one))
        .route(
            &format!("{V}/watch/namespaces/{{ns}}/runlogs/{{name}}"),
            get(watch_one),
        )
        .with_state(api)
}

/// A `metav1.Status` failure, as every Kubernetes API answers errors.
pub fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    (code, axum::Json(status_body(code, reason, message))).into_response()
}

/// The body of [`status`] (also the object of a watch `ERROR` event).
pub fn status_body(code: StatusCode, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code.as_u16(),
    })
}

async fn apis(headers: HeaderMap) -> Response {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    match discovery::apis(accept) {
        Some(doc) => axum::Json(doc).into_response(),
        None => status(
            StatusCode::NOT_ACCEPTABLE,
            "NotAcceptable",
            "only the legacy discovery documents are served",
        ),
    }
}

async fn group() -> Response {
    axum::Json(discovery::group()).into_response()
}

async fn resources() -> Response {
    axum::Json(discovery::resources()).into_response()
}

/// Who asks, and whether they may: the user, or the refusal to send.
async fn admit(
    api: &LogApi,
    cert: Option<&PeerCert>,
    headers: &HeaderMap,
    question: Question,
) -> Result<User, Response> {
    let config = api.request_headers();
    let user = front_proxy::authenticate(config.as_ref(), cert, headers)
        .map_err(|e| status(StatusCode::UNAUTHORIZED, "Unauthorized", e.to_string()))?;
    match api.authorizer.check(&user, &question).await {
        Ok(Answer::Allowed) => Ok(user),
        Ok(Answer::Denied(text)) => Err(status(StatusCode::FORBIDDEN, "Forbidden", text)),
        Err(e) => {
            tracing::warn!(error = %e, "authorizing a log API request");
            Err(status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("could not authorize the request: {e}"),
            ))
        }
    }
}

/// The query parameters every read understands.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub limit: Option<u64>,
    pub continue_token: Option<String>,
    pub from_seq: Option<u64>,
    pub follow: bool,
    pub watch: bool,
    pub field_name: Option<String>,
    pub resource_version: Option<String>,
}

impl Params {
    /// Parses a query string; an error names the parameter.
    pub fn parse(query: Option<&str>) -> Result<Params, String> {
        let mut p = Params::default();
        let number = |k: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{k}={v:?}: expected a non-negative integer"))
        };
        let flag = |v: &str| matches!(v, "true" | "1");
        for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match k.as_ref() {
                "limit" => p.limit = Some(number("limit", &v)?),
                "continue" if !v.is_empty() => p.continue_token = Some(v.into_owned()),
                "fromSeq" => p.from_seq = Some(number("fromSeq", &v)?),
                "follow" => p.follow = flag(&v),
                "watch" => p.watch = flag(&v),
                "resourceVersion" if !v.is_empty() => p.resource_version = Some(v.into_owned()),
                "fieldSelector" if !v.is_empty() => p.field_name = Some(name_selector(&v)?),
                _ => {}
            }
        }
        Ok(p)
    }
}

/// `metadata.name=NAME` (or `==`): the only field selector runlogs have.
fn name_selector(selector: &str) -> Result<String, String> {
    selector
        .strip_prefix("metadata.name==")
        .or_else(|| selector.strip_prefix("metadata.name="))
        .filter(|n| !n.is_empty() && !n.contains(','))
        .map(str::to_string)
        .ok_or_else(|| {
            format!("fieldSelector={selector:?}: only metadata.name=NAME is supported for runlogs")
        })
}

fn bad_request(message: String) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

/// The run `name` in `ns` as the API server has it, or the 404 to send.
async fn read_run(api: &LogApi, ns: &str, name: &str) -> Result<AgentRun, Response> {
    let not_found = || {
        status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!(
                "runlogs.log.agentrun.dev {name:?} not found: no AgentRun {name:?} in namespace {ns:?}"
            ),
        )
    };
    if api.namespace.as_deref().is_some_and(|served| served != ns) {
        return Err(not_found());
    }
    let runs: Api<AgentRun> = Api::namespaced(api.client.clone(), ns);
    match runs.get_opt(name).await {
        Ok(Some(run)) if run.metadata.uid.is_some() => Ok(run),
        Ok(_) => Err(not_found()),
        Err(e) => Err(status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("reading AgentRun {ns}/{name}: {e}"),
        )),
    }
}

async fn one(
    State(api): State<LogApi>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    cert: Option<axum::Extension<PeerCert>>,
    headers: HeaderMap,
) -> Response {
    let params = match Params::parse(query.as_deref()) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let streaming = params.follow || params.watch;
    let question = Question {
        verb: if streaming { "watch" } else { "get" },
        namespace: ns.clone(),
        name: Some(name.clone()),
    };
    if let Err(refused) = admit(&api, cert.as_deref(), &headers, question).await {
        return refused;
    }
    let run = match read_run(&api, &ns, &name).await {
        Ok(run) => run,
        Err(response) => return response,
    };
    if streaming {
        return follow::stream(api, run, params.from_seq.unwrap_or(0)).await;
    }
    pages::get(&api, &run, &params, &headers).await
}

async fn watch_one(
    State(api): State<LogApi>,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    cert: Option<axum::Extension<PeerCert>>,
    headers: HeaderMap,
) -> Response {
    let params = match Params::parse(query.as_deref()) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    watch_named(&api, &ns, &name, &params, cert.as_deref(), &headers).await
}

/// A watch of one run's log (the collection watch with a name selector, or
/// the `/watch/` path).
async fn watch_named(
    api: &LogApi,
    ns: &str,
    name: &str,
    params: &Params,
    cert: Option<&PeerCert>,
    headers: &HeaderMap,
) -> Response {
    let question = Question {
        verb: "watch",
        namespace: ns.to_string(),
        name: Some(name.to_string()),
    };
    if let Err(refused) = admit(api, cert, headers, question).await {
        return refused;
    }
    let run = match read_run(api, ns, name).await {
        Ok(run) => run,
        Err(response) => return response,
    };
    let from = match (params.from_seq, &params.resource_version) {
        (Some(seq), _) => seq,
        // A watch resumes after the resourceVersion it saw: the log's length.
        (None, Some(rv)) => match rv.parse::<u64>() {
            Ok(n) => n,
            Err(_) => return bad_request(format!("resourceVersion={rv:?}: expected a log length")),
        },
        (None, None) => 0,
    };
    follow::stream(api.clone(), run, from).await
}

async fn list(
    State(api): State<LogApi>,
    Path(ns): Path<String>,
    RawQuery(query): RawQuery,
    cert: Option<axum::Extension<PeerCert>>,
    headers: HeaderMap,
) -> Response {
    let params = match Params::parse(query.as_deref()) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    if params.watch {
        let Some(name) = params.field_name.clone() else {
            return bad_request(
                "watching runlogs needs fieldSelector=metadata.name=NAME: a watch follows one run's log"
                    .into(),
            );
        };
        return watch_named(&api, &ns, &name, &params, cert.as_deref(), &headers).await;
    }
    let question = Question {
        verb: "list",
        namespace: ns.clone(),
        name: None,
    };
    if let Err(refused) = admit(&api, cert.as_deref(), &headers, question).await {
        return refused;
    }
    pages::list(&api, Some(&ns), &params, &headers).await
}

async fn list_all(
    State(api): State<LogApi>,
    RawQuery(query): RawQuery,
    cert: Option<axum::Extension<PeerCert>>,
    headers: HeaderMap,
) -> Response {
    let params = match Params::parse(query.as_deref()) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    if params.watch {
        return bad_request(
            "watching runlogs needs a namespace and fieldSelector=metadata.name=NAME".into(),
        );
    }
    let question = Question {
        verb: "list",
        namespace: String::new(),
        name: None,
    };
    if let Err(refused) = admit(&api, cert.as_deref(), &headers, question).await {
        return refused;
    }
    pages::list(&api, None, &params, &headers).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_parameters_are_read_and_bad_ones_named() {
        let p = Params::parse(Some(
            "limit=10&continue=abc&fromSeq=3&watch=true&fieldSelector=metadata.name%3Dr1",
        ))
        .unwrap();
        assert_eq!(p.limit, Some(10));
        assert_eq!(p.continue_token.as_deref(), Some("abc"));
        assert_eq!(p.from_seq, Some(3));
        assert!(p.watch && !p.follow);
        assert_eq!(p.field_name.as_deref(), Some("r1"));
        let err = Params::parse(Some("limit=-1")).unwrap_err();
        assert!(err.starts_with("limit="), "{err}");
        let err = Params::parse(Some("fieldSelector=status.phase%3DRunning")).unwrap_err();
        assert!(err.contains("metadata.name"), "{err}");
    }
}
