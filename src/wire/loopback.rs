//! The runner's server on its pod's loopback, as a container agent sees it:
//! the model endpoints of the three dialects, one MCP server per served
//! tool server, and the two paths the agent shim uses. It reads and answers
//! HTTP; what an answer is (from the log, or asked and recorded first) is
//! the runner's, behind [`Backend`] and [`super::mcp_server::Calls`].
//!
//! A model request is read in its dialect (a body it cannot read is a 400
//! in that dialect's error format, naming the field), identified
//! ([`Canonical`]) and handed over whole; the answer comes back rendered in
//! the dialect asked, plain or as the server-sent events of a stream, from
//! one recorded answer either way.
//!
//! Model endpoints take the pod's key as the SDKs send it (`Authorization:
//! Bearer`, or `x-api-key`); it is not the provider's key and opens nothing
//! else. The key is checked from the headers, before the body is read. The
//! MCP servers take none: MCP clients send no key unless their code is
//! changed, and only the pod itself reaches its loopback.
//!
//! No body longer than [`MAX_REQUEST_BYTES`] is kept: it is a 413, in the
//! dialect's error format for a model request and as a JSON-RPC error for
//! an MCP message, and the runner goes on serving.

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::canonical::Canonical;
use super::mcp_server::{self, Calls, ServedTool};
use super::{BadRequest, Dialect, chat_completions, messages, responses};
use crate::model::{ModelRequest, ModelResponse};

/// The longest request body read: far more than any model's context
/// holds as text, so only a runaway agent meets it.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024 * 1024;

/// How the agent ended, as the shim reports it to the runner.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AgentExit {
    /// Its exit code (128 + the signal when a signal ended it).
    pub code: i32,
    /// The result file's text, if the agent wrote one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Why the result file could not be read (too large, not UTF-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_unreadable: Option<String>,
}

/// The runner's paths the agent shim (`agentrun agent-shim`) uses.
pub const READY_PATH: &str = "/agentrun/ready";
pub const EXIT_PATH: &str = "/agentrun/exit";
/// Answers once the runner wants the agent stopped (a long poll).
pub const STOP_PATH: &str = "/agentrun/stop";

/// A model request as the runner receives it.
#[derive(Clone, Debug)]
pub struct Asked {
    pub dialect: Dialect,
    /// What identifies it, and what is recorded of it.
    pub canonical: Canonical,
    /// The same request, provider-neutral (for asking the model).
    pub request: ModelRequest,
}

/// The runner's answer to one model request.
#[derive(Clone, Debug)]
pub struct Answer {
    pub response: ModelResponse,
    /// Derived from the record (the same at every replay).
    pub id: String,
    /// Unix seconds of the record.
    pub created: i64,
}

/// Why the runner answers no model request (the run diverged, its budget
/// is used up, it ends): shown to the agent in its dialect's error format.
#[derive(Clone, Debug, PartialEq)]
pub struct Refused {
    pub status: u16,
    pub message: String,
}

/// The runner's side of the loopback server.
pub trait Backend: Send + Sync + 'static {
    fn model(&self, asked: Asked) -> BoxFuture<'static, Result<Answer, Refused>>;
    /// The agent ended (the shim's report).
    fn exited(&self, exit: AgentExit) -> BoxFuture<'static, ()>;
    /// Whether the runner serves yet (it has replayed the log).
    fn ready(&self) -> bool;
    /// Resolves once the step is over and the agent is to stop (the shim
    /// waits on it and stops the agent).
    fn stopped(&self) -> BoxFuture<'static, ()>;
}

/// What the loopback server serves.
pub struct Served {
    /// The pod's key (the agent's `OPENAI_API_KEY` and `ANTHROPIC_API_KEY`).
    pub key: String,
    pub backend: Arc<dyn Backend>,
    /// Each tool server's name and its pinned tools.
    pub tool_servers: Vec<(String, Vec<ServedTool>)>,
    pub calls: Arc<dyn Calls>,
    /// The host the runner listens on, which the agent names (its pod's
    /// address: `127.0.0.1` in a pod, another loopback address on a node
    /// that gives each pod one); loopback names are always accepted.
    pub listen_host: Option<String>,
}

#[derive(Clone)]
struct Shared {
    key: Arc<String>,
    backend: Arc<dyn Backend>,
}

/// The router: `/v1/chat/completions`, `/v1/responses`, `/v1/messages`,
/// `/mcp/{server}`, and the shim's `/agentrun/ready` and `/agentrun/exit`.
pub fn router(served: Served) -> axum::Router {
    let shared = Shared {
        key: Arc::new(served.key),
        backend: served.backend,
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(respond))
        .route("/v1/messages", post(message))
        .route(READY_PATH, get(ready))
        .route(EXIT_PATH, post(exited))
        .route(STOP_PATH, get(stop))
        .with_state(shared);
    let mut mcp = axum::Router::new();
    for (server, tools) in served.tool_servers {
        let service = mcp_server::service(
            &server,
            tools,
            served.calls.clone(),
            served.listen_host.as_deref(),
        );
        mcp = mcp.route_service(&format!("/mcp/{server}"), service);
    }
    app.merge(mcp.layer(axum::middleware::from_fn(bounded_mcp)))
}

/// The MCP services read whole bodies: they get one read here, bounded.
async fn bounded_mcp(request: Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = request.into_parts();
    match read_body(&parts.headers, body).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(refused) => {
            let code = StatusCode::from_u16(refused.status).unwrap_or(StatusCode::BAD_REQUEST);
            let error = serde_json::json!({
                "jsonrpc": "2.0", "id": null,
                "error": {"code": -32600, "message": refused.message}
            });
            (code, Json(error)).into_response()
        }
    }
}

/// The request's body, unless it is longer than [`MAX_REQUEST_BYTES`]. A
/// longer one is read to its end and dropped, never kept: a client still
/// sending when the 413 came would see a broken connection instead of the
/// answer (the body's deadline, `bounded`, still bounds the reading).
async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, Refused> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let mut over = declared.is_some_and(|n| n > MAX_REQUEST_BYTES);
    let mut read = Vec::with_capacity(declared.filter(|_| !over).unwrap_or(0));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Refused {
            status: 400,
            message: format!("agentrun: the request body could not be read: {e}"),
        })?;
        over = over || read.len() + chunk.len() > MAX_REQUEST_BYTES;
        match over {
            true => read = Vec::new(),
            false => read.extend_from_slice(&chunk),
        }
    }
    if over {
        return Err(Refused {
            status: 413,
            message: format!(
                "agentrun: the request body is larger than the runner reads ({MAX_REQUEST_BYTES} bytes)"
            ),
        });
    }
    Ok(Bytes::from(read))
}

async fn chat(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    model(s, headers, body, Dialect::ChatCompletions).await
}

async fn respond(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    model(s, headers, body, Dialect::Responses).await
}

async fn message(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    model(s, headers, body, Dialect::Messages).await
}

async fn ready(State(s): State<Shared>, headers: HeaderMap) -> StatusCode {
    if !authorized(&headers, &s.key) {
        StatusCode::UNAUTHORIZED
    } else if s.backend.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn exited(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(exit): Json<AgentExit>,
) -> StatusCode {
    if !authorized(&headers, &s.key) {
        return StatusCode::UNAUTHORIZED;
    }
    s.backend.exited(exit).await;
    StatusCode::NO_CONTENT
}

/// Waits until the runner wants the agent stopped.
async fn stop(State(s): State<Shared>, headers: HeaderMap) -> StatusCode {
    if !authorized(&headers, &s.key) {
        return StatusCode::UNAUTHORIZED;
    }
    s.backend.stopped().await;
    StatusCode::OK
}

/// The key as the OpenAI SDKs (`Authorization: Bearer`) or Anthropic's
/// (`x-api-key`) send it, compared in constant time.
fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    given.is_some_and(|g| {
        g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0, |d, (a, b)| d | (a ^ b)) == 0
    })
}

async fn model(s: Shared, headers: HeaderMap, body: Body, dialect: Dialect) -> Response {
    let codec = Codec::of(dialect);
    if !authorized(&headers, &s.key) {
        let why =
            "the pod's key (OPENAI_API_KEY or ANTHROPIC_API_KEY as agentrun set it) is required";
        return codec.refuse(401, why);
    }
    let body = match read_body(&headers, body).await {
        Ok(body) => body,
        Err(refused) => return codec.refuse(refused.status, &refused.message),
    };
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return codec.bad(&BadRequest::new("body", format!("not JSON: {e}"))),
    };
    let request = match (codec.request)(&body) {
        Ok(r) => r,
        Err(bad) => return codec.bad(&bad),
    };
    let delivery = codec.delivery(&body);
    let Some(canonical) = Canonical::of(dialect, body) else {
        return codec.bad(&BadRequest::new("body", "not a JSON object"));
    };
    let asked = Asked {
        dialect,
        canonical,
        request,
    };
    match s.backend.model(asked).await {
        Ok(answer) => codec.render(&answer, &delivery),
        Err(refused) => codec.refuse(refused.status, &refused.message),
    }
}

/// What of a request says how its answer is delivered (read before the
/// body is taken into its [`Canonical`]).
struct Delivery {
    /// The model the agent named (answered when the provider names none).
    model: String,
    stream: bool,
    /// Chat Completions: a stream ends with a usage chunk.
    include_usage: bool,
}

/// One dialect's translations.
struct Codec {
    request: fn(&Value) -> Result<ModelRequest, BadRequest>,
    streams: fn(&Value) -> bool,
    response: fn(&ModelResponse, &str, &str, i64) -> Value,
    error: fn(u16, &str) -> Value,
    bad_request: fn(&BadRequest) -> Value,
    dialect: Dialect,
}

impl Codec {
    fn of(dialect: Dialect) -> Codec {
        match dialect {
            Dialect::ChatCompletions => Codec {
                request: chat_completions::request,
                streams: chat_completions::streams,
                response: chat_completions::response,
                error: chat_completions::error,
                bad_request: chat_completions::bad_request,
                dialect,
            },
            Dialect::Responses => Codec {
                request: responses::request,
                streams: responses::streams,
                response: responses::response,
                error: responses::error,
                bad_request: responses::bad_request,
                dialect,
            },
            Dialect::Messages => Codec {
                request: messages::request,
                streams: messages::streams,
                response: messages::response,
                error: messages::error,
                bad_request: messages::bad_request,
                dialect,
            },
        }
    }

    fn delivery(&self, body: &Value) -> Delivery {
        let model = body.get("model").and_then(Value::as_str);
        Delivery {
            model: model.unwrap_or_default().to_string(),
            stream: (self.streams)(body),
            include_usage: self.dialect == Dialect::ChatCompletions
                && chat_completions::include_usage(body),
        }
    }

    fn events(&self, answer: &Answer, model: &str, delivery: &Delivery) -> Vec<String> {
        let (r, id, at) = (&answer.response, answer.id.as_str(), answer.created);
        match self.dialect {
            Dialect::ChatCompletions => {
                chat_completions::stream(r, model, id, at, delivery.include_usage)
            }
            Dialect::Responses => responses::stream(r, model, id, at),
            Dialect::Messages => messages::stream(r, model, id, at),
        }
    }

    /// The answer, streamed if the request asked for a stream.
    fn render(&self, answer: &Answer, delivery: &Delivery) -> Response {
        let model = match answer.response.model_id.as_str() {
            "" => delivery.model.as_str(),
            id => id,
        };
        if delivery.stream {
            let events = self.events(answer, model, delivery).concat();
            return ([(header::CONTENT_TYPE, "text/event-stream")], events).into_response();
        }
        Json((self.response)(
            &answer.response,
            model,
            &answer.id,
            answer.created,
        ))
        .into_response()
    }

    fn refuse(&self, status: u16, message: &str) -> Response {
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, Json((self.error)(status, message))).into_response()
    }

    fn bad(&self, bad: &BadRequest) -> Response {
        (StatusCode::BAD_REQUEST, Json((self.bad_request)(bad))).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use crate::model::{TokenUsage, ToolCall};
    use crate::tools::ToolOutcome;
    use serde_json::json;

    /// A runner that answers every model request with one recorded answer
    /// and notes what it was asked.
    #[derive(Default)]
    struct OneAnswer {
        asked: Mutex<Vec<Asked>>,
        exits: Mutex<Vec<AgentExit>>,
    }

    fn answer() -> ModelResponse {
        ModelResponse {
            text: Some("Looking it up.".into()),
            tool_calls: vec![ToolCall {
                id: "call_7".into(),
                name: "lookup".into(),
                arguments: json!({"order": "A-1"}),
            }],
            usage: TokenUsage {
                input_tokens: 12,
                output_tokens: 5,
            },
            model_id: "gemma-3".into(),
            stop_reason: Some("tool_calls".into()),
        }
    }

    impl Backend for OneAnswer {
        fn model(&self, asked: Asked) -> BoxFuture<'static, Result<Answer, Refused>> {
            let diverged = asked.request.system.contains("10:05");
            self.asked.lock().unwrap().push(asked);
            Box::pin(async move {
                if diverged {
                    return Err(Refused {
                        status: 409,
                        message: "the run diverged at messages[0].content".into(),
                    });
                }
                Ok(Answer {
                    response: answer(),
                    id: "run-1-3".into(),
                    created: 1_780_000_000,
                })
            })
        }

        fn exited(&self, exit: AgentExit) -> BoxFuture<'static, ()> {
            self.exits.lock().unwrap().push(exit);
            Box::pin(async {})
        }

        fn ready(&self) -> bool {
            true
        }

        fn stopped(&self) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
    }

    struct NoCalls;
    impl Calls for NoCalls {
        fn call(&self, _: mcp_server::AgentCall) -> BoxFuture<'static, ToolOutcome> {
            Box::pin(async { ToolOutcome::Ok(json!("ok")) })
        }
    }

    async fn serve(backend: Arc<OneAnswer>) -> String {
        let app = router(Served {
            key: "pod-key".into(),
            backend,
            tool_servers: vec![("shop".into(), vec![])],
            calls: Arc::new(NoCalls),
            listen_host: None,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn captured(name: &str) -> Value {
        let path = format!(
            "{}/src/wire/testdata/requests/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn client() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    /// Posts `body` to `path` with the key in `header` (`authorization`
    /// takes a bearer token); the status and the JSON answered.
    async fn post(
        url: &str,
        path: &str,
        (header, key): (&str, &str),
        body: &Value,
    ) -> (u16, Value) {
        let key = match header {
            "authorization" => format!("Bearer {key}"),
            _ => key.to_string(),
        };
        let reply = client()
            .post(format!("{url}{path}"))
            .header(header, key)
            .json(body)
            .send()
            .await
            .unwrap();
        (reply.status().as_u16(), reply.json().await.unwrap())
    }

    /// What the real frameworks sent (captured), each answered in its own
    /// dialect, plain or streamed as it asked, from the same answer.
    #[tokio::test]
    async fn each_frameworks_request_gets_the_answer_in_its_dialect() {
        let backend = Arc::new(OneAnswer::default());
        let url = serve(backend.clone()).await;
        let http = client();
        for (file, path, auth) in [
            ("langgraph-1.json", "/v1/chat/completions", "authorization"),
            (
                "langgraph_streaming-1.json",
                "/v1/chat/completions",
                "authorization",
            ),
            ("agents_sdk-1.json", "/v1/responses", "authorization"),
            (
                "agents_sdk_streamed-1.json",
                "/v1/responses",
                "authorization",
            ),
            ("anthropic_sdk-1.json", "/v1/messages", "x-api-key"),
        ] {
            let body = captured(file);
            let value = if auth == "authorization" {
                "Bearer pod-key"
            } else {
                "pod-key"
            };
            let reply = http
                .post(format!("{url}{path}"))
                .header(auth, value)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(reply.status(), 200, "{file}");
            let streamed = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
            let kind = reply.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .to_string();
            let text = reply.text().await.unwrap();
            assert_eq!(
                kind.starts_with("text/event-stream"),
                streamed,
                "{file}: {kind}"
            );
            assert!(
                text.contains("call_7") && text.contains("Looking it up."),
                "{file}: {text}"
            );
        }
        let asked = backend.asked.lock().unwrap();
        let dialects: Vec<Dialect> = asked.iter().map(|a| a.dialect).collect();
        assert_eq!(
            dialects,
            [
                Dialect::ChatCompletions,
                Dialect::ChatCompletions,
                Dialect::Responses,
                Dialect::Responses,
                Dialect::Messages
            ]
        );
        assert!(
            asked
                .iter()
                .all(|a| !a.canonical.body.contains_key("stream"))
        );
    }

    #[tokio::test]
    async fn a_request_without_the_pods_key_or_unreadable_is_refused_in_its_dialect() {
        let url = serve(Arc::new(OneAnswer::default())).await;
        let body = captured("langgraph-1.json");
        let wrong_key = ("authorization", "the-providers-real-key");
        let (status, error) = post(&url, "/v1/chat/completions", wrong_key, &body).await;
        assert_eq!(status, 401);
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("pod's key"), "{message}");

        let image = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
        let (status, error) = post(&url, "/v1/messages", ("x-api-key", "pod-key"), &image).await;
        assert_eq!(status, 400);
        assert_eq!(error["type"], "error");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("messages[0].content[0]"), "{error}");
    }

    /// A body over the limit, declared or streamed without a length, is a
    /// 413 in the dialect's format (an MCP message's as JSON-RPC), a wrong
    /// key is refused before the body is read, and the runner serves on.
    #[tokio::test]
    async fn an_oversized_body_is_refused_in_its_format_and_the_runner_serves_on() {
        let backend = Arc::new(OneAnswer::default());
        let url = serve(backend.clone()).await;
        let huge = "x".repeat(MAX_REQUEST_BYTES);
        let body = json!({"model": "m", "messages": [{"role": "user", "content": huge}]});
        let (status, error) = post(
            &url,
            "/v1/chat/completions",
            ("authorization", "pod-key"),
            &body,
        )
        .await;
        assert_eq!(status, 413);
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("larger than the runner reads"), "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");

        let (status, error) = post(&url, "/v1/messages", ("x-api-key", "wrong"), &body).await;
        assert_eq!(status, 401, "the key comes first: {error}");

        // Streamed without a length: cut once it passes the limit.
        let chunk = Bytes::from(huge.clone());
        let chunks = [Ok::<_, std::io::Error>(chunk.clone()), Ok(chunk)];
        let streamed = Body::from_stream(futures::stream::iter(chunks));
        let refused = read_body(&HeaderMap::new(), streamed).await.unwrap_err();
        assert_eq!(refused.status, 413);

        let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "lookup", "arguments": {"note": huge}}});
        let reply = client()
            .post(format!("{url}/mcp/shop"))
            .header("accept", "application/json, text/event-stream")
            .json(&call)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 413);
        let error: Value = reply.json().await.unwrap();
        assert_eq!(error["error"]["code"], -32600, "{error}");
        assert!(
            backend.asked.lock().unwrap().is_empty(),
            "nothing reached the runner"
        );

        let small = json!({"model": "m", "messages": [{"role": "user", "content": "refund"}]});
        let (status, _) = post(
            &url,
            "/v1/chat/completions",
            ("authorization", "pod-key"),
            &small,
        )
        .await;
        assert_eq!(status, 200, "the runner serves on");
    }

    #[tokio::test]
    async fn a_refusal_reaches_the_agent_as_its_sdks_error_and_the_shims_paths_answer() {
        let backend = Arc::new(OneAnswer::default());
        let url = serve(backend.clone()).await;
        let http = client();
        let body = json!({"model": "m", "messages": [{"role": "system", "content": "It is 10:05."}, {"role": "user", "content": "refund"}]});
        let key = ("authorization", "pod-key");
        let (status, error) = post(&url, "/v1/chat/completions", key, &body).await;
        assert_eq!(status, 409);
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("diverged"), "{message}");

        let ready = http
            .get(format!("{url}{READY_PATH}"))
            .bearer_auth("pod-key")
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), 200);
        let exit = AgentExit {
            code: 0,
            result: Some("done".into()),
            result_unreadable: None,
        };
        let reply = http
            .post(format!("{url}{EXIT_PATH}"))
            .bearer_auth("pod-key")
            .json(&exit)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 204);
        let wrong = http
            .post(format!("{url}{EXIT_PATH}"))
            .bearer_auth("nope")
            .json(&exit)
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status(), 401);
        assert_eq!(*backend.exits.lock().unwrap(), [exit]);
    }
}
