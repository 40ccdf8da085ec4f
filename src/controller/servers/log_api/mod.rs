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

use crate::refusal::Refusal;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kube::Api;
use serde_json::{Value, json};

use crate::api::AgentRun;
use crate::store::{HeadEvent, StepStore};
use authorize::{Answer, Authorizer, Question};
use front_proxy::{RequestHeaderConfig, User};

use crate::bounded::tls::PeerCert;

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
    /// Pages of logs its responses read and hold at once, over all
    /// requests and followers, until their bytes are sent.
    reads: crate::store::ReadBudget,
}

/// How long a request waits for a page of the read budget before it is
/// answered busy (429, to try again).
pub const READ_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The bytes of records one page of the log API holds at most (or one
/// larger record): the default and the cap of `limitBytes`.
pub const PAGE_BYTES: usize = crate::store::PAGE_BYTES;

impl LogApi {
    /// The log API over `store`, asking `client` about runs and access.
    pub async fn new(
        store: Arc<dyn StepStore>,
        client: kube::Client,
        namespace: Option<String>,
        authz_ttl: Duration,
    ) -> Result<LogApi, crate::store::StoreError> {
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
            reads: crate::store::ReadBudget::new(LOG_API_READ_BYTES),
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

/// The bytes of pages the log API holds at once (four pages).
pub const LOG_API_READ_BYTES: usize = 4 * crate::store::PAGE_HELD;

/// The query parameters every read understands.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub limit: Option<u64>,
    /// Bytes of record bodies a page holds at most (capped at [`PAGE_BYTES`]).
    pub limit_bytes: Option<u64>,
    pub continue_token: Option<String>,
    pub from_seq: Option<u64>,
    pub follow: bool,
    pub watch: bool,
    pub field_name: Option<String>,
    pub resource_version: Option<String>,
}

impl Params {
    /// Parses a query string; an error names the parameter.
    pub fn parse(query: Option<&str>) -> Result<Params, Refusal> {
        let mut p = Params::default();
        let number = |k: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{k}={v:?}: expected a non-negative integer"))
        };
        let flag = |v: &str| matches!(v, "true" | "1");
        for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match k.as_ref() {
                "limit" => p.limit = Some(number("limit", &v)?),
                "limitBytes" => p.limit_bytes = Some(number("limitBytes", &v)?),
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
fn name_selector(selector: &str) -> Result<String, Refusal> {
    selector
        .strip_prefix("metadata.name==")
        .or_else(|| selector.strip_prefix("metadata.name="))
        .filter(|n| !n.is_empty() && !n.contains(','))
        .map(str::to_string)
        .ok_or_else(|| {
            Refusal::new(format!(
                "fieldSelector={selector:?}: only metadata.name=NAME is supported for runlogs"
            ))
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

/// What every resource request brings: its parameters (parsed, or the
/// 400 answered for them), the client's certificate and its headers.
struct Asked {
    params: Params,
    cert: Option<PeerCert>,
    headers: HeaderMap,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Asked {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Asked, Response> {
        let params = Params::parse(parts.uri.query()).map_err(|e| bad_request(e.into()))?;
        Ok(Asked {
            params,
            cert: parts.extensions.get::<PeerCert>().cloned(),
            headers: parts.headers.clone(),
        })
    }
}

impl Asked {
    /// The run `ns/name`, once the caller may `verb` its log.
    async fn run(
        &self,
        api: &LogApi,
        verb: &'static str,
        ns: &str,
        name: &str,
    ) -> Result<(AgentRun, follow::Access), Response> {
        let question = Question {
            verb,
            namespace: ns.to_string(),
            name: Some(name.to_string()),
        };
        let user = admit(api, self.cert.as_ref(), &self.headers, question.clone()).await?;
        let run = read_run(api, ns, name).await?;
        Ok((run, follow::Access { user, question }))
    }

    /// Whether the caller may list runlogs in `ns` (all namespaces: "").
    async fn may_list(&self, api: &LogApi, ns: &str) -> Result<(), Response> {
        let question = Question {
            verb: "list",
            namespace: ns.to_string(),
            name: None,
        };
        admit(api, self.cert.as_ref(), &self.headers, question)
            .await
            .map(|_| ())
    }

    /// Where a watch starts: `fromSeq`, else the resourceVersion it saw
    /// (the log's length), else the beginning.
    fn watch_from(&self) -> Result<u64, Refusal> {
        match (self.params.from_seq, &self.params.resource_version) {
            (Some(seq), _) => Ok(seq),
            (None, Some(rv)) => rv.parse::<u64>().map_err(|_| {
                Refusal::new(format!("resourceVersion={rv:?}: expected a log length"))
            }),
            (None, None) => Ok(0),
        }
    }
}

async fn one(
    State(api): State<LogApi>,
    Path((ns, name)): Path<(String, String)>,
    asked: Asked,
) -> Response {
    let streaming = asked.params.follow || asked.params.watch;
    let verb = if streaming { "watch" } else { "get" };
    let (run, access) = match asked.run(&api, verb, &ns, &name).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    if streaming {
        let from = asked.params.from_seq.unwrap_or(0);
        return follow::stream(api, run, from, access).await;
    }
    pages::get(&api, &run, &asked.params, &asked.headers).await
}

async fn watch_one(
    State(api): State<LogApi>,
    Path((ns, name)): Path<(String, String)>,
    asked: Asked,
) -> Response {
    watch_named(&api, &ns, &name, &asked).await
}

/// A watch of one run's log (the collection watch with a name selector, or
/// the `/watch/` path).
async fn watch_named(api: &LogApi, ns: &str, name: &str, asked: &Asked) -> Response {
    let from = match asked.watch_from() {
        Ok(from) => from,
        Err(bad) => return bad_request(bad.into()),
    };
    match asked.run(api, "watch", ns, name).await {
        Ok((run, access)) => follow::stream(api.clone(), run, from, access).await,
        Err(refused) => refused,
    }
}

async fn list(State(api): State<LogApi>, Path(ns): Path<String>, asked: Asked) -> Response {
    if asked.params.watch {
        let Some(name) = asked.params.field_name.clone() else {
            return bad_request(
                "watching runlogs needs fieldSelector=metadata.name=NAME: a watch follows one run's log"
                    .into(),
            );
        };
        return watch_named(&api, &ns, &name, &asked).await;
    }
    if let Err(refused) = asked.may_list(&api, &ns).await {
        return refused;
    }
    pages::list(&api, Some(&ns), &asked.params, &asked.headers).await
}

async fn list_all(State(api): State<LogApi>, asked: Asked) -> Response {
    if asked.params.watch {
        return bad_request(
            "watching runlogs needs a namespace and fieldSelector=metadata.name=NAME".into(),
        );
    }
    if let Err(refused) = asked.may_list(&api, "").await {
        return refused;
    }
    pages::list(&api, None, &asked.params, &asked.headers).await
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
