//! MCP tools over the streamable HTTP transport, through the official SDK (`rmcp`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ContentBlock,
    Implementation, PaginatedRequestParams, RequestMetaObject,
};
use rmcp::service::{RoleClient, RunningService, ServiceError, ServiceExt};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    CallContext, MCP_META_KEY, MCP_META_RUN, MCP_META_STEP, McpKind, RetryPolicy, ToolError,
    ToolOutcome, ToolSpec, excerpt,
};

/// Time allowed to connect to an MCP server and list its tools.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Tools taken from one server at most (`tools/list` pages are read until
/// this many are seen, then discovery stops with an error).
pub const MAX_TOOLS_PER_SERVER: usize = 256;

/// How far discovery goes: the time one server may take, the time all of
/// an agent's servers may take together, and how many tools one may list.
#[derive(Clone, Copy, Debug)]
pub struct DiscoveryBounds {
    pub per_server: Duration,
    pub total: Duration,
    pub max_tools: usize,
}

impl Default for DiscoveryBounds {
    fn default() -> Self {
        DiscoveryBounds {
            per_server: DISCOVERY_TIMEOUT,
            total: Duration::MAX,
            max_tools: MAX_TOOLS_PER_SERVER,
        }
    }
}
/// How much text of an error result an observation quotes.
const QUOTED_TEXT: usize = 2000;

/// What an MCP server says about a tool. Hints only: a server may lie.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpAnnotations {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destructive_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotent_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_world_hint: Option<bool>,
}

/// A tool an MCP server lists (`tools/list`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpToolInfo {
    /// The tool's name on the server.
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub input_schema: Value,
    #[serde(default)]
    pub annotations: McpAnnotations,
}

/// What discovery found for an agent's MCP tools, keyed by the agent's tool
/// name. Serializable, to be pinned in `RunStarted`.
pub type McpCatalog = BTreeMap<String, McpToolInfo>;

type Session = Arc<RunningService<RoleClient, ClientConfig>>;

fn client_config() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("agentrun", env!("CARGO_PKG_VERSION")),
    )
}

/// Why no MCP session could be opened for a call (the call's observation
/// quotes it; the tool was not called).
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("initialize failed: {0}")]
    Initialize(Box<rmcp::service::ClientInitializeError>),
    #[error("no answer to initialize within {0:?}")]
    Timeout(Duration),
}

async fn connect(client: &reqwest::Client, url: &str) -> Result<Session, SessionError> {
    open_session(client, url)
        .await
        .map_err(|e| SessionError::Initialize(Box::new(e)))
}

async fn open_session(
    client: &reqwest::Client,
    url: &str,
) -> Result<Session, rmcp::service::ClientInitializeError> {
    let transport = StreamableHttpClientTransport::with_client(
        client.clone(),
        StreamableHttpClientTransportConfig::with_uri(url.to_string()),
    );
    client_config().serve(transport).await.map(Arc::new)
}

/// What a failed discovery request says, without the server's words: the
/// controller writes it to the run's status and Events, and a user may
/// point discovery at any server the platform allows, so a reply body (or a
/// JSON-RPC error message, or a content type) could carry what that server
/// holds. Only a status code and a fixed reason are kept; the full error
/// goes to the controller's log at debug level, cut short.
fn plain_failure(stage: &str, e: &(dyn std::error::Error + 'static)) -> String {
    tracing::debug!(stage, error = %excerpt(&e.to_string(), 512), "MCP discovery failed");
    let why =
        describe(e).unwrap_or_else(|| "the server's answer was not a usable MCP reply".into());
    format!("{stage} failed: {why}")
}

/// The first failure along `e`'s sources that [`known_failure`] knows.
fn describe(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(why) = known_failure(e) {
            return Some(why);
        }
        next = e.source();
    }
    None
}

/// A fixed description of `e`, if it is one of the failures the MCP client
/// reports (the others are looked for in its source).
fn known_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    use rmcp::service::ClientInitializeError as Init;
    use rmcp::transport::streamable_http_client::StreamableHttpError as Http;
    if let Some(refused) = e.downcast_ref::<crate::egress::Refused>() {
        return Some(refused.to_string());
    }
    if let Some(e) = e.downcast_ref::<reqwest::Error>() {
        return Some(match () {
            _ if e.is_timeout() => "no answer in time".into(),
            _ if e.is_connect() => refusal_in(e).unwrap_or_else(|| "could not connect".into()),
            _ => match e.status() {
                Some(status) => format!("HTTP {}", status.as_u16()),
                None => "the connection failed".into(),
            },
        });
    }
    if let Some(e) = e.downcast_ref::<Http<reqwest::Error>>() {
        return match e {
            Http::HttpStatus(s) => Some(format!("HTTP {}", s.status)),
            // rmcp writes `HTTP <status>: <body>`: the status is kept, the body not.
            Http::UnexpectedServerResponse(text) => Some(
                leading_status(text)
                    .map_or("an unexpected reply".into(), |code| format!("HTTP {code}")),
            ),
            Http::UnexpectedContentType(_) => {
                Some("a reply that is neither JSON nor an event stream".into())
            }
            Http::Deserialize(_) => Some("a reply that is not JSON-RPC".into()),
            Http::ResponseBodyTooLarge { max_size } => {
                Some(format!("a reply larger than {max_size} bytes"))
            }
            Http::Client(e) => describe(e),
            Http::Io(_) | Http::Sse(_) => Some("the connection failed".into()),
            _ => Some("a transport error".into()),
        };
    }
    if let Some(e) = e.downcast_ref::<Init>() {
        return match e {
            Init::JsonRpcError(data) => Some(format!("JSON-RPC error {}", data.code.0)),
            // Not marked as its source: followed by hand.
            Init::TransportError { error, .. } => describe(&*error.error),
            _ => Some("an unexpected reply to initialize".into()),
        };
    }
    if let Some(e) = e.downcast_ref::<ServiceError>() {
        return match e {
            ServiceError::McpError(data) => Some(format!("JSON-RPC error {}", data.code.0)),
            ServiceError::TransportSend(_) => None,
            ServiceError::Timeout { .. } => Some("no answer in time".into()),
            _ => Some("the session ended unexpectedly".into()),
        };
    }
    None
}

/// The egress guard's refusal among `e`'s sources, in its own words.
fn refusal_in(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = e.source();
    while let Some(e) = next {
        if let Some(refused) = e.downcast_ref::<crate::egress::Refused>() {
            return Some(refused.to_string());
        }
        next = e.source();
    }
    None
}

/// The status code at the start of `HTTP 403 Forbidden: ...`.
fn leading_status(text: &str) -> Option<u16> {
    let code = text.strip_prefix("HTTP ")?.get(..3)?;
    code.parse().ok().filter(|c| (100..600).contains(c))
}

/// Lists the tools of the MCP server at `url` (`initialize` + `tools/list`).
pub async fn discover_mcp(url: &str) -> Result<Vec<McpToolInfo>, ToolError> {
    let client = super::build_client()?;
    discover_with(&client, url, DiscoveryBounds::default()).await
}

/// Every page of the server's `tools/list`, stopping once more than
/// `max_tools` were listed (a server paging forever is cut there, or by the
/// caller's timeout).
/// Why discovery's `tools/list` gave no usable list.
#[derive(Debug, thiserror::Error)]
enum ListError {
    /// The request failed; the text is [`plain_failure`]'s (no server words).
    #[error("{0}")]
    Failed(String),
    #[error("it lists more than {0} tools, the most discovery takes from one server")]
    TooMany(usize),
}

async fn list_tools(
    session: &Session,
    max_tools: usize,
) -> Result<Vec<rmcp::model::Tool>, ListError> {
    let mut tools = Vec::new();
    let mut cursor = None;
    loop {
        let params = PaginatedRequestParams::default().with_cursor(cursor);
        let page = session
            .list_tools(Some(params))
            .await
            .map_err(|e| ListError::Failed(plain_failure("tools/list", &e)))?;
        tools.extend(page.tools);
        if tools.len() > max_tools {
            return Err(ListError::TooMany(max_tools));
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(tools),
        }
    }
}

async fn discover_with(
    client: &reqwest::Client,
    url: &str,
    bounds: DiscoveryBounds,
) -> Result<Vec<McpToolInfo>, ToolError> {
    let err = |reason: String| ToolError::Mcp {
        url: url.to_string(),
        reason,
    };
    let work = async {
        let session = open_session(client, url)
            .await
            .map_err(|e| err(plain_failure("initialize", &e)))?;
        let tools = list_tools(&session, bounds.max_tools)
            .await
            .map_err(|e| err(e.to_string()))?;
        if let Ok(session) = Arc::try_unwrap(session) {
            let _ = session.cancel().await;
        }
        Ok::<_, ToolError>(tools)
    };
    let limit = bounds.per_server.min(bounds.total);
    let tools = tokio::time::timeout(limit, work).await.map_err(|_| {
        err(match limit < bounds.per_server {
            true => {
                format!("no answer within {limit:?}, the rest of the agent's discovery deadline")
            }
            false => format!("no answer within {limit:?}"),
        })
    })??;
    Ok(tools
        .into_iter()
        .map(|tool| {
            let annotations = tool
                .annotations
                .as_ref()
                .map(|a| McpAnnotations {
                    read_only_hint: a.read_only_hint,
                    destructive_hint: a.destructive_hint,
                    idempotent_hint: a.idempotent_hint,
                    open_world_hint: a.open_world_hint,
                })
                .unwrap_or_default();
            McpToolInfo {
                name: tool.name.to_string(),
                description: tool.description.as_deref().unwrap_or_default().to_string(),
                input_schema: Value::Object((*tool.input_schema).clone()),
                annotations,
            }
        })
        .collect())
}

/// Discovers every MCP tool an agent names (one `tools/list` per server) and
/// returns them keyed by the agent's tool name. A tool missing from its server
/// is an error.
pub async fn discover_catalog(specs: &[ToolSpec]) -> Result<McpCatalog, ToolError> {
    discover_catalog_with(&super::build_client()?, specs, DiscoveryBounds::default()).await
}

/// The same with the caller's client (the controller's guards its egress)
/// and bounds.
pub async fn discover_catalog_with(
    client: &reqwest::Client,
    specs: &[ToolSpec],
    bounds: DiscoveryBounds,
) -> Result<McpCatalog, ToolError> {
    let mut servers: HashMap<&str, Vec<McpToolInfo>> = HashMap::new();
    let mut catalog = McpCatalog::new();
    let started = tokio::time::Instant::now();
    for spec in specs {
        let Some(mcp) = &spec.mcp else { continue };
        if !servers.contains_key(mcp.url.as_str()) {
            // Each server gets what is left of the total, so a deadline
            // passed names the server that was being asked.
            let left = bounds.total.saturating_sub(started.elapsed());
            let bounds = DiscoveryBounds {
                total: left,
                ..bounds
            };
            let tools = discover_with(client, &mcp.url, bounds).await?;
            servers.insert(mcp.url.as_str(), tools);
        }
        let remote = mcp.tool.as_deref().unwrap_or(&spec.name);
        let info = servers[mcp.url.as_str()]
            .iter()
            .find(|t| t.name == remote)
            .ok_or_else(|| ToolError::McpToolMissing {
                url: mcp.url.clone(),
                tool: remote.to_string(),
            })?;
        catalog.insert(spec.name.clone(), info.clone());
    }
    Ok(catalog)
}

fn request(tool: &McpKind, args: &Value, ctx: &CallContext) -> CallToolRequestParams {
    let mut meta = RequestMetaObject::new();
    meta.0
        .0
        .insert(MCP_META_KEY.into(), Value::String(ctx.key.clone()));
    meta.0
        .0
        .insert(MCP_META_RUN.into(), Value::String(ctx.run_uid.clone()));
    meta.0.0.insert(MCP_META_STEP.into(), Value::from(ctx.seq));
    let mut params = CallToolRequestParams::new(tool.remote.clone())
        .with_arguments(args.as_object().cloned().unwrap_or_default());
    params.meta = Some(meta);
    params
}

/// The MCP sessions of one toolbox, one per server URL, kept between calls
/// (a step pod makes many calls to the same servers: a session each would
/// cost three more round trips per call).
#[derive(Default)]
pub(crate) struct Sessions(tokio::sync::Mutex<HashMap<String, Session>>);

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sessions")
    }
}

impl Sessions {
    /// The open session to `url`, if one is kept.
    async fn take(&self, url: &str) -> Option<Session> {
        let session = self.0.lock().await.remove(url)?;
        (!session.is_closed()).then_some(session)
    }

    async fn keep(&self, url: &str, session: Session) {
        self.0.lock().await.insert(url.to_string(), session);
    }
}

/// Makes an MCP `tools/call` with the key in `_meta`.
///
/// The call goes on the session kept for its server, or on one opened now
/// (`initialize`): a failure to open it is retried, as nothing was called
/// yet. A session the server expired is opened again by the SDK (a 404
/// means the request was not handled). A failure after `tools/call` was
/// sent is not retried: MCP tools declare no idempotency that could be
/// trusted, so the observation says the outcome is unknown, and that
/// session is not kept.
pub(crate) async fn call(
    client: &reqwest::Client,
    sessions: &Sessions,
    retry: &RetryPolicy,
    name: &str,
    tool: &McpKind,
    args: &Value,
    ctx: &CallContext,
) -> ToolOutcome {
    let kept = sessions.take(&tool.url).await;
    let reused = kept.is_some();
    let mut session = match kept {
        Some(session) => session,
        None => match open_for_call(client, retry, name, tool).await {
            Ok(session) => session,
            Err(outcome) => return outcome,
        },
    };
    let mut answer = send(&session, tool, args, ctx).await;
    if reused && matches!(&answer, Ok(Err(e)) if never_sent(e)) {
        // The kept session's server could not be reached: nothing was
        // sent. A new session, as for a first call.
        close(session).await;
        session = match open_for_call(client, retry, name, tool).await {
            Ok(session) => session,
            Err(outcome) => return outcome,
        };
        answer = send(&session, tool, args, ctx).await;
    }
    match &answer {
        Ok(Ok(_)) | Ok(Err(ServiceError::McpError(_))) => sessions.keep(&tool.url, session).await,
        _ => close(session).await,
    }
    match answer {
        Ok(Ok(result)) => outcome(name, result),
        Ok(Err(ServiceError::McpError(e))) => ToolOutcome::failed(format!(
            "{name}: the MCP server refused the call: {} (code {})",
            excerpt(&e.message, QUOTED_TEXT),
            e.code.0
        )),
        Ok(Err(e)) => ToolOutcome::failed(format!(
            "{name}: the MCP call failed: {}. Whether it took effect is unknown.",
            excerpt(&e.to_string(), QUOTED_TEXT)
        )),
        Err(_) => ToolOutcome::failed(format!(
            "{name}: no answer from the MCP server within {:?}. Whether it took effect is unknown.",
            tool.timeout
        )),
    }
}

/// `tools/call` on `session`, within the tool's timeout.
async fn send(
    session: &Session,
    tool: &McpKind,
    args: &Value,
    ctx: &CallContext,
) -> Result<Result<CallToolResult, ServiceError>, tokio::time::error::Elapsed> {
    tokio::time::timeout(tool.timeout, session.call_tool(request(tool, args, ctx))).await
}

async fn close(session: Session) {
    if let Ok(session) = Arc::try_unwrap(session) {
        let _ = session.cancel().await;
    }
}

/// Whether a call failed before its request left: the server's address
/// refused or could not be reached (a connection that failed later may
/// have carried it).
fn never_sent(e: &ServiceError) -> bool {
    type HttpError = rmcp::transport::streamable_http_client::StreamableHttpError<reqwest::Error>;
    let ServiceError::TransportSend(e) = e else {
        return false;
    };
    matches!(e.error.downcast_ref::<HttpError>(), Some(HttpError::Client(e)) if e.is_connect())
}

/// A new session for a call, retried by `retry` (nothing was called yet);
/// the observation when none could be opened.
async fn open_for_call(
    client: &reqwest::Client,
    retry: &RetryPolicy,
    name: &str,
    tool: &McpKind,
) -> Result<Session, ToolOutcome> {
    let mut attempt_no = 0u32;
    loop {
        attempt_no += 1;
        let opened = tokio::time::timeout(tool.timeout, connect(client, &tool.url))
            .await
            .unwrap_or_else(|_| Err(SessionError::Timeout(tool.timeout)));
        match opened {
            Ok(session) => return Ok(session),
            Err(reason) => {
                tracing::debug!(tool = name, attempt = attempt_no, %reason, "MCP session failed");
                if attempt_no >= retry.attempts() {
                    return Err(ToolOutcome::failed(format!(
                        "{name}: the MCP server could not be reached after {attempt_no} attempts: \
                         {reason}. The tool was not called."
                    )));
                }
                tokio::time::sleep(retry.backoff(attempt_no)).await;
            }
        }
    }
}

/// Maps a `tools/call` result: `isError` becomes `Failed` with its text;
/// otherwise `structuredContent`, or the text content (parsed when it is JSON).
pub(crate) fn outcome(name: &str, result: CallToolResult) -> ToolOutcome {
    let text = content_text(&result.content);
    if result.is_error == Some(true) {
        let detail = if text.trim().is_empty() {
            result
                .structured_content
                .as_ref()
                .map(Value::to_string)
                .unwrap_or_else(|| "no details".into())
        } else {
            text
        };
        return ToolOutcome::failed(format!("{name}: {}", excerpt(&detail, QUOTED_TEXT)));
    }
    if let Some(structured) = result.structured_content {
        return ToolOutcome::Ok(structured);
    }
    match (
        result.content.as_slice(),
        serde_json::from_str::<Value>(&text),
    ) {
        ([ContentBlock::Text(_)], Ok(value)) => ToolOutcome::Ok(value),
        ([], _) => ToolOutcome::Ok(Value::Null),
        _ => ToolOutcome::Ok(Value::String(text)),
    }
}

fn content_text(content: &[ContentBlock]) -> String {
    content
        .iter()
        .map(|block| match block {
            ContentBlock::Text(t) => t.text.clone(),
            ContentBlock::Image(_) => "[image omitted]".into(),
            ContentBlock::Audio(_) => "[audio omitted]".into(),
            ContentBlock::Resource(_) => "[embedded resource omitted]".into(),
            ContentBlock::ResourceLink(r) => format!("[resource {}]", r.uri),
            _ => "[content omitted]".into(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(value: Value) -> CallToolResult {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn error_results_become_failed_with_their_text() {
        let out = outcome(
            "get_weather",
            result(
                json!({"content": [{"type": "text", "text": "unknown city: Atlantis"}], "isError": true}),
            ),
        );
        assert_eq!(
            out,
            ToolOutcome::Failed {
                observation: "get_weather: unknown city: Atlantis".into()
            }
        );
    }

    #[test]
    fn structured_content_wins_over_text() {
        let out = outcome(
            "t",
            result(
                json!({"content": [{"type": "text", "text": "sunny"}], "structuredContent": {"sky": "sunny"}}),
            ),
        );
        assert_eq!(out, ToolOutcome::Ok(json!({"sky": "sunny"})));
    }

    #[test]
    fn text_content_is_parsed_when_it_is_json() {
        let out = outcome(
            "t",
            result(json!({"content": [{"type": "text", "text": "{\"id\": 7}"}]})),
        );
        assert_eq!(out, ToolOutcome::Ok(json!({"id": 7})));
        let out = outcome(
            "t",
            result(json!({"content": [{"type": "text", "text": "done"}]})),
        );
        assert_eq!(out, ToolOutcome::Ok(json!("done")));
        let out = outcome(
            "t",
            result(
                json!({"content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]}),
            ),
        );
        assert_eq!(out, ToolOutcome::Ok(json!("1\n2")));
        let out = outcome("t", result(json!({"content": []})));
        assert_eq!(out, ToolOutcome::Ok(Value::Null));
    }

    #[test]
    fn calls_carry_the_key_run_and_step_in_meta() {
        let tool = McpKind {
            url: "http://127.0.0.1:9/mcp".into(),
            remote: "create_ticket".into(),
            idempotent: false,
            hints: None,
            timeout: Duration::from_secs(1),
        };
        let ctx = CallContext::new("run-9", 12, "k".repeat(64));
        let params = serde_json::to_value(request(&tool, &json!({"title": "x"}), &ctx)).unwrap();
        assert_eq!(params["name"], "create_ticket");
        assert_eq!(params["arguments"], json!({"title": "x"}));
        assert_eq!(params["_meta"][MCP_META_KEY], json!("k".repeat(64)));
        assert_eq!(params["_meta"][MCP_META_RUN], "run-9");
        assert_eq!(params["_meta"][MCP_META_STEP], 12);
    }
}

#[cfg(test)]
mod discovery_failures {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that answers every request with `reply` (a raw HTTP response).
    async fn answering(reply: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = vec![0u8; 16 * 1024];
                let _ = conn.read(&mut buf).await;
                let _ = conn.write_all(reply.as_bytes()).await;
                let _ = conn.shutdown().await;
            }
        });
        format!("http://{addr}/mcp")
    }

    fn http(status: &str, content_type: &str, body: &str) -> &'static str {
        Box::leak(
            format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        )
    }

    #[tokio::test]
    async fn no_reply_text_reaches_the_error_only_a_status_and_a_fixed_reason() {
        let secret = "password=hunter2";
        let rpc_error =
            format!(r#"{{"jsonrpc":"2.0","id":0,"error":{{"code":-32000,"message":"{secret}"}}}}"#);
        let cases = [
            (http("403 Forbidden", "text/plain", secret), "HTTP 403"),
            (
                http("500 Internal Server Error", "text/plain", secret),
                "HTTP 500",
            ),
            (
                http("200 OK", &format!("text/{secret}"), secret),
                "neither JSON",
            ),
            (
                http("200 OK", "application/json", &format!("{{{secret}")),
                "an unexpected reply",
            ),
            (
                http("200 OK", "application/json", &rpc_error),
                "JSON-RPC error -32000",
            ),
        ];
        let policy = Arc::new(crate::egress::Policy::new(
            vec!["127.0.0.1".parse().unwrap()],
            vec![],
            true,
        ));
        let client = crate::egress::client(policy).unwrap();
        for (reply, want) in cases {
            let url = answering(reply).await;
            let err = discover_with(&client, &url, DiscoveryBounds::default())
                .await
                .expect_err("fails")
                .to_string();
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[tokio::test]
    async fn a_name_the_guard_refuses_is_reported_in_its_words() {
        let client = crate::egress::client(Default::default()).unwrap();
        let err = discover_with(
            &client,
            "http://localhost:9/mcp",
            DiscoveryBounds::default(),
        )
        .await
        .expect_err("refused")
        .to_string();
        assert!(err.contains("not on the platform's allow-list"), "{err}");
    }
}
