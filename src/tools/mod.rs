//! Tools the agent calls (DESIGN.md sections 4 and 7): HTTP endpoints that
//! receive the arguments as JSON and an `Idempotency-Key` header, and tools of
//! MCP servers (streamable HTTP).
//!
//! Everything a tool call can go wrong with (unknown tool, arguments that do
//! not match the schema, a refusal, a non-JSON answer, an unreachable server)
//! comes back as [`ToolOutcome::Failed`] with an observation the model can act
//! on, never as a panic or an error that stops the runner. Only building a
//! [`Toolbox`] from a broken tool list, and MCP discovery, return [`ToolError`].
//!
//! Idempotency keys, request bodies and results are never logged.

mod http;
/// Reads a reply body up to a cap (shared with the step's dependency lookups).
pub(crate) use http::read_body;
mod key;
mod mcp;
mod schema;

use crate::refusal::Refusal;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::api::ToolSpec;

pub use key::{idempotency_key, schema_hash};
pub use mcp::{
    DiscoveryBounds, MAX_TOOLS_PER_SERVER, McpAnnotations, McpCatalog, McpToolInfo,
    discover_catalog, discover_catalog_with, discover_mcp,
};

use schema::ArgSchema;

/// Name of the built-in tool that ends the run with `{"result": string}`.
pub const FINISH_TOOL: &str = "finish";

/// Per-call timeout when a tool declares none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// `_meta` key carrying the idempotency key of an MCP `tools/call`.
pub const MCP_META_KEY: &str = "agentrun.dev/idempotencyKey";
/// `_meta` key carrying the run uid of an MCP `tools/call`.
pub const MCP_META_RUN: &str = "agentrun.dev/run";
/// `_meta` key carrying the step (seq of the `ToolIntent`) of an MCP `tools/call`.
pub const MCP_META_STEP: &str = "agentrun.dev/step";

/// Errors building a [`Toolbox`] or discovering an MCP server's tools.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// A tool definition cannot be used.
    #[error("tool {tool}: {reason}")]
    InvalidSpec { tool: String, reason: String },
    /// The HTTP client could not be built.
    #[error("HTTP client: {0}")]
    Client(String),
    /// An MCP server could not be reached or answered wrongly.
    #[error("MCP server {url}: {reason}")]
    Mcp { url: String, reason: String },
    /// An MCP server does not offer a tool an agent names.
    #[error("MCP server {url} has no tool named {tool}")]
    McpToolMissing { url: String, tool: String },
}

/// Where a call comes from: the run, the step that records it, and its key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallContext {
    /// Uid of the AgentRun.
    pub run_uid: String,
    /// Seq of the `ToolIntent` record of this call.
    pub seq: u64,
    /// Idempotency key ([`idempotency_key`]); the same on every attempt.
    pub key: String,
}

impl CallContext {
    /// A context for a call.
    pub fn new(run_uid: impl Into<String>, seq: u64, key: impl Into<String>) -> Self {
        Self {
            run_uid: run_uid.into(),
            seq,
            key: key.into(),
        }
    }
}

/// What a tool call produced, as recorded in `ToolResult`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToolOutcome {
    /// The tool's result.
    Ok(Value),
    /// The call failed; the observation tells the model what happened.
    Failed { observation: String },
}

impl ToolOutcome {
    fn failed(observation: impl Into<String>) -> Self {
        Self::Failed {
            observation: observation.into(),
        }
    }

    /// Whether the call succeeded.
    pub fn is_ok(&self) -> bool {
        matches!(self, Self::Ok(_))
    }

    /// The text the model is shown for this outcome.
    pub fn observation(&self) -> String {
        match self {
            Self::Ok(Value::String(text)) => text.clone(),
            Self::Ok(value) => value.to_string(),
            Self::Failed { observation } => observation.clone(),
        }
    }
}

/// Whether a call whose result was never recorded took effect (a crash
/// between `ToolIntent` and `ToolResult`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LookupOutcome {
    /// It happened; this is its result.
    Done(Value),
    /// It did not happen: it may be made now.
    NotDone,
    /// Nobody can tell; a human has to reconcile.
    Unknown { reason: String },
}

/// A tool as the model is shown it (one type for the model and the tools).
pub use crate::model::ToolDef;

/// Retries of calls that failed for a reason that may pass (5xx, 408, 429,
/// connection errors, timeouts). Every attempt carries the same key.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first included (at least 1).
    pub attempts: u32,
    /// Wait before the second attempt; doubled after each further attempt.
    pub initial_backoff: Duration,
    /// Upper bound of one wait.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(4),
        }
    }
}

impl RetryPolicy {
    /// The wait after failed attempt number `attempt` (1-based).
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32
            .checked_shl(attempt.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }

    fn attempts(&self) -> u32 {
        self.attempts.max(1)
    }
}

#[derive(Debug)]
struct HttpKind {
    url: String,
    idempotent: bool,
    lookup: Option<String>,
    read_only: bool,
    timeout: Duration,
}

#[derive(Debug)]
struct McpKind {
    url: String,
    /// The tool's name on the server.
    remote: String,
    /// Declared by the agent author: the server honours the key in `_meta`.
    idempotent: bool,
    hints: Option<McpAnnotations>,
    timeout: Duration,
}

#[derive(Debug)]
enum Kind {
    Http(HttpKind),
    Mcp(McpKind),
    Finish,
}

#[derive(Debug)]
struct Tool {
    def: ToolDef,
    schema: ArgSchema,
    kind: Kind,
}

/// The tools of one run: what the model is shown, and how each is called.
#[derive(Debug)]
pub struct Toolbox {
    /// In the order of the agent's list, `finish` last.
    tools: Vec<Tool>,
    by_name: HashMap<String, usize>,
    client: reqwest::Client,
    /// MCP sessions kept between calls.
    sessions: mcp::Sessions,
    retry: RetryPolicy,
}

/// The schema of the built-in `finish` tool.
pub fn finish_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "result": {"type": "string", "description": "The final answer or outcome of the task."}
        },
        "required": ["result"],
        "additionalProperties": false
    })
}

/// The `result` of a `finish` call, or the observation for a malformed one.
pub fn finish_result(args: &Value) -> Result<String, Refusal> {
    finish_checker().check(FINISH_TOOL, args)?;
    Ok(args["result"].as_str().unwrap_or_default().to_string())
}

fn finish_checker() -> &'static ArgSchema {
    static CHECKER: std::sync::OnceLock<ArgSchema> = std::sync::OnceLock::new();
    CHECKER
        .get_or_init(|| ArgSchema::compile(&finish_schema()).expect("the finish schema is valid"))
}

/// Installs the ring rustls provider when the process has none, so that a
/// client can be built (reqwest is built without a provider of its own).
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

pub(crate) fn build_client() -> Result<reqwest::Client, ToolError> {
    client_builder()
        .build()
        .map_err(|e| ToolError::Client(e.to_string()))
}

/// The client of a run's calls: it connects to the addresses `pins` hold
/// for a name, the ones the gate's check matched ([`crate::dns`]).
fn pinned_client(pins: crate::dns::Pins) -> Result<reqwest::Client, ToolError> {
    client_builder()
        .dns_resolver(Arc::new(pins))
        .build()
        .map_err(|e| ToolError::Client(e.to_string()))
}

fn client_builder() -> reqwest::ClientBuilder {
    ensure_crypto_provider();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        // A redirected POST would silently become another request; a 3xx is refused instead.
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("agentrun/", env!("CARGO_PKG_VERSION")))
}

fn invalid(tool: &str, reason: impl Into<String>) -> ToolError {
    ToolError::InvalidSpec {
        tool: tool.to_string(),
        reason: reason.into(),
    }
}

/// One of the agent's tools. What the agent says of its schema and
/// description wins over what MCP discovery found; with neither, any object
/// is accepted and the description is empty.
fn agent_tool(spec: &ToolSpec, catalog: &McpCatalog) -> Result<Tool, ToolError> {
    let name = spec.name.as_str();
    let (kind, discovered) = match (&spec.http, &spec.mcp) {
        (Some(h), None) => (Kind::Http(http_kind(name, h)?), None),
        (None, Some(m)) => {
            let info = catalog.get(name);
            let kind = Kind::Mcp(McpKind {
                url: m.url.clone(),
                remote: m.tool.clone().unwrap_or_else(|| name.to_string()),
                idempotent: m.idempotent,
                hints: info.map(|i| i.annotations.clone()),
                timeout: DEFAULT_TIMEOUT,
            });
            (kind, info)
        }
        _ => return Err(invalid(name, "exactly one of http and mcp must be set")),
    };
    let input_schema = spec
        .input_schema
        .clone()
        .or_else(|| discovered.map(|d| d.input_schema.clone()))
        .unwrap_or_else(|| json!({"type": "object"}));
    let schema = ArgSchema::compile(&input_schema)
        .map_err(|e| invalid(name, format!("inputSchema is not a valid JSON Schema: {e}")))?;
    let description = if spec.description.is_empty() {
        discovered
            .map(|d| d.description.clone())
            .unwrap_or_default()
    } else {
        spec.description.clone()
    };
    Ok(Tool {
        def: ToolDef {
            name: name.to_string(),
            description,
            input_schema,
        },
        schema,
        kind,
    })
}

/// An HTTP tool's call settings; its timeout must parse and be positive.
fn http_kind(name: &str, h: &crate::api::HttpTool) -> Result<HttpKind, ToolError> {
    let timeout = match &h.timeout {
        Some(t) => crate::api::parse_duration(t)
            .map_err(|e| invalid(name, format!("timeout {t:?}: {e}")))?,
        None => DEFAULT_TIMEOUT,
    };
    if timeout.is_zero() {
        return Err(invalid(name, "timeout must be positive"));
    }
    Ok(HttpKind {
        url: h.url.clone(),
        idempotent: h.idempotent,
        lookup: h.lookup.clone(),
        read_only: h.read_only,
        timeout,
    })
}

/// The built-in `finish` tool, always offered last.
fn finish_tool() -> Tool {
    Tool {
        def: ToolDef {
            name: FINISH_TOOL.to_string(),
            description: "End the run. Call it once the task is done (or cannot be done), \
                          with the final answer in `result`."
                .to_string(),
            input_schema: finish_schema(),
        },
        schema: ArgSchema::compile(&finish_schema()).expect("the finish schema is valid"),
        kind: Kind::Finish,
    }
}

impl Toolbox {
    /// Builds the toolbox of a run from the agent's tools and, for MCP tools,
    /// what discovery found ([`discover_catalog`], keyed by the agent's tool
    /// name; pinned in `RunStarted`). An MCP tool's own `inputSchema` and
    /// `description` in the agent take precedence over the discovered ones.
    pub fn new(specs: &[ToolSpec], catalog: &McpCatalog) -> Result<Self, ToolError> {
        Self::pinned(specs, catalog, crate::dns::Pins::default())
    }

    /// [`Self::new`], its calls connecting where `pins` say: the addresses
    /// the runner's classification of each call looked at.
    pub fn pinned(
        specs: &[ToolSpec],
        catalog: &McpCatalog,
        pins: crate::dns::Pins,
    ) -> Result<Self, ToolError> {
        let mut tools = Vec::with_capacity(specs.len() + 1);
        let mut by_name = HashMap::new();
        for spec in specs {
            let name = spec.name.as_str();
            if name == FINISH_TOOL {
                return Err(invalid(
                    name,
                    "the name 'finish' is reserved for the built-in tool",
                ));
            }
            if by_name.insert(name.to_string(), tools.len()).is_some() {
                return Err(invalid(name, "defined twice"));
            }
            tools.push(agent_tool(spec, catalog)?);
        }
        by_name.insert(FINISH_TOOL.to_string(), tools.len());
        tools.push(finish_tool());
        Ok(Self {
            tools,
            by_name,
            client: pinned_client(pins)?,
            sessions: mcp::Sessions::default(),
            retry: RetryPolicy::default(),
        })
    }

    /// Replaces the retry policy (tests use short waits).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// What the model is shown: every tool, then `finish`.
    pub fn defs(&self) -> Vec<ToolDef> {
        self.tools.iter().map(|t| t.def.clone()).collect()
    }

    /// [`schema_hash`] of [`Self::defs`].
    pub fn schema_hash(&self) -> String {
        schema_hash(&self.defs())
    }

    /// Whether a tool of this name exists (`finish` included).
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn tool(&self, name: &str) -> Option<&Tool> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    /// The tool honours idempotency keys, so a call whose result was not
    /// recorded may be made again with the same key: the agent author's
    /// declaration (`http.idempotent`, `mcp.idempotent`, which sends the key
    /// in `_meta`), for crash recovery only. An MCP server's own
    /// `idempotentHint` is a hint and is not trusted for this.
    pub fn is_idempotent(&self, name: &str) -> bool {
        match self.tool(name).map(|t| &t.kind) {
            Some(Kind::Http(h)) => h.idempotent,
            Some(Kind::Mcp(m)) => m.idempotent,
            Some(Kind::Finish) => true,
            _ => false,
        }
    }

    /// The tool is declared to modify nothing. Only HTTP tools can declare
    /// it; MCP annotations are hints ([`Self::mcp_hints`]) and do not count.
    pub fn is_read_only(&self, name: &str) -> bool {
        match self.tool(name).map(|t| &t.kind) {
            Some(Kind::Http(h)) => h.read_only,
            _ => false,
        }
    }

    /// Whether the tool declares a lookup for calls whose outcome is unknown.
    pub fn has_lookup(&self, name: &str) -> bool {
        matches!(self.tool(name).map(|t| &t.kind), Some(Kind::Http(h)) if h.lookup.is_some())
    }

    /// The annotations an MCP server reported for this tool: hints for
    /// defaults and display, never a safety decision.
    pub fn mcp_hints(&self, name: &str) -> Option<&McpAnnotations> {
        match self.tool(name).map(|t| &t.kind) {
            Some(Kind::Mcp(m)) => m.hints.as_ref(),
            _ => None,
        }
    }

    /// Checks a call's arguments without making it; the error is the
    /// observation the model gets.
    pub fn validate(&self, name: &str, args: &Value) -> Result<(), Refusal> {
        match self.tool(name) {
            Some(tool) => tool.schema.check(name, args),
            None => Err(self.unknown_tool(name).into()),
        }
    }

    fn unknown_tool(&self, name: &str) -> String {
        let known: Vec<&str> = self.tools.iter().map(|t| t.def.name.as_str()).collect();
        format!(
            "{name}: no such tool; available tools: {}",
            known.join(", ")
        )
    }

    /// Makes a call. Arguments are validated first: nothing is sent for an
    /// invalid call. `finish` is only validated (the runner ends the run):
    /// its outcome is the arguments.
    pub async fn call(&self, name: &str, args: &Value, ctx: &CallContext) -> ToolOutcome {
        let Some(tool) = self.tool(name) else {
            return ToolOutcome::failed(self.unknown_tool(name));
        };
        if let Err(observation) = tool.schema.check(name, args) {
            return ToolOutcome::failed(observation);
        }
        tracing::debug!(tool = name, run = %ctx.run_uid, step = ctx.seq, "calling tool");
        let outcome = match &tool.kind {
            Kind::Http(h) => http::call(&self.client, &self.retry, name, h, args, ctx).await,
            Kind::Mcp(m) => {
                mcp::call(
                    &self.client,
                    &self.sessions,
                    &self.retry,
                    name,
                    m,
                    args,
                    ctx,
                )
                .await
            }
            Kind::Finish => ToolOutcome::Ok(args.clone()),
        };
        tracing::debug!(tool = name, run = %ctx.run_uid, step = ctx.seq, ok = outcome.is_ok(), "tool call done");
        outcome
    }

    /// Learns whether a call whose result was never recorded took effect,
    /// through the tool's declared lookup (`GET` with the call's key).
    pub async fn lookup(&self, name: &str, args: &Value, ctx: &CallContext) -> LookupOutcome {
        let _ = args; // Lookups are by key; the arguments are kept for lookups that need them.
        match self.tool(name).map(|t| &t.kind) {
            None => LookupOutcome::Unknown {
                reason: format!("{name}: no such tool"),
            },
            Some(Kind::Http(h)) => match &h.lookup {
                Some(url) => {
                    http::lookup(&self.client, &self.retry, name, url, h.timeout, ctx).await
                }
                None => LookupOutcome::Unknown {
                    reason: format!("{name} declares no lookup"),
                },
            },
            Some(Kind::Mcp(_)) => LookupOutcome::Unknown {
                reason: format!("{name} is an MCP tool; MCP tools have no lookup"),
            },
            Some(Kind::Finish) => LookupOutcome::NotDone,
        }
    }
}

/// Cuts a text for an observation.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    crate::text::excerpt(text.trim(), max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{HttpTool, McpTool};

    fn http_spec(name: &str, schema: Option<Value>) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: format!("{name} things"),
            input_schema: schema,
            http: Some(HttpTool {
                url: "http://127.0.0.1:9/tools".into(),
                idempotent: true,
                read_only: false,
                lookup: None,
                timeout: Some("2s".into()),
            }),
            mcp: None,
        }
    }

    fn toolbox(specs: &[ToolSpec]) -> Toolbox {
        Toolbox::new(specs, &McpCatalog::new()).unwrap()
    }

    fn ctx() -> CallContext {
        CallContext::new("run-1", 4, idempotency_key("run-1", 3, 0))
    }

    #[test]
    fn defs_list_tools_in_order_then_finish() {
        let tb = toolbox(&[
            http_spec("b_tool", None),
            http_spec(
                "a_tool",
                Some(json!({"type": "object", "properties": {"x": {"type": "integer"}}})),
            ),
        ]);
        let defs = tb.defs();
        let names: Vec<&str> = defs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["b_tool", "a_tool", "finish"]);
        assert_eq!(defs[0].input_schema, json!({"type": "object"}));
        assert_eq!(defs[1].input_schema["properties"]["x"]["type"], "integer");
        assert_eq!(defs[2].input_schema["required"], json!(["result"]));
        assert_eq!(tb.schema_hash(), schema_hash(&defs));
    }

    #[test]
    fn broken_tool_lists_are_refused() {
        let catalog = McpCatalog::new();
        let err = Toolbox::new(&[http_spec("finish", None)], &catalog).unwrap_err();
        assert!(err.to_string().contains("reserved"), "{err}");
        let err =
            Toolbox::new(&[http_spec("a", None), http_spec("a", None)], &catalog).unwrap_err();
        assert!(err.to_string().contains("defined twice"), "{err}");
        let mut both = http_spec("a", None);
        both.mcp = Some(McpTool {
            url: "http://127.0.0.1:9/mcp".into(),
            tool: None,
            idempotent: false,
        });
        assert!(Toolbox::new(&[both], &catalog).is_err());
        let mut bad_timeout = http_spec("a", None);
        bad_timeout.http.as_mut().unwrap().timeout = Some("soon".into());
        assert!(Toolbox::new(&[bad_timeout], &catalog).is_err());
        let err = Toolbox::new(&[http_spec("a", Some(json!({"type": 5})))], &catalog).unwrap_err();
        assert!(err.to_string().contains("not a valid JSON Schema"), "{err}");
    }

    #[tokio::test]
    async fn unknown_tools_and_bad_arguments_fail_without_a_request() {
        // The URL is unreachable: an attempted request would produce another message.
        let tb = toolbox(&[http_spec(
            "issue_refund",
            Some(
                json!({"type": "object", "properties": {"amount": {"type": "number", "minimum": 0}}, "required": ["amount"]}),
            ),
        )]);
        let out = tb.call("issue_refnd", &json!({}), &ctx()).await;
        assert_eq!(
            out,
            ToolOutcome::failed("issue_refnd: no such tool; available tools: issue_refund, finish")
        );
        let out = tb
            .call("issue_refund", &json!({"amount": -5}), &ctx())
            .await;
        assert_eq!(
            out,
            ToolOutcome::failed(
                "issue_refund: arguments invalid: amount: -5 is less than the minimum of 0"
            )
        );
        let out = tb.call("issue_refund", &json!("{amount: 5"), &ctx()).await;
        assert!(
            out.observation()
                .contains("expected a JSON object, got a string"),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn finish_is_validated_not_sent() {
        let tb = toolbox(&[]);
        assert_eq!(
            tb.call("finish", &json!({"result": "done"}), &ctx()).await,
            ToolOutcome::Ok(json!({"result": "done"}))
        );
        let out = tb.call("finish", &json!({"answer": "done"}), &ctx()).await;
        assert!(
            out.observation().starts_with("finish: arguments invalid: "),
            "{out:?}"
        );
        assert_eq!(
            finish_result(&json!({"result": "42"})),
            Ok("42".to_string())
        );
        assert!(
            finish_result(&json!({"result": 42}))
                .unwrap_err()
                .contains("result: 42 is not of type")
        );
    }

    #[test]
    fn declarations_and_hints() {
        let mut ro = http_spec("read", None);
        ro.http.as_mut().unwrap().read_only = true;
        ro.http.as_mut().unwrap().idempotent = false;
        ro.http.as_mut().unwrap().lookup = Some("http://127.0.0.1:9/lookup".into());
        let mcp = ToolSpec {
            name: "weather".into(),
            mcp: Some(McpTool {
                url: "http://127.0.0.1:9/mcp".into(),
                tool: Some("get_weather".into()),
                idempotent: false,
            }),
            ..Default::default()
        };
        // The author says the server honours the key in `_meta`.
        let keyed = ToolSpec {
            name: "ticket".into(),
            mcp: Some(McpTool {
                url: "http://127.0.0.1:9/mcp".into(),
                tool: Some("create_ticket".into()),
                idempotent: true,
            }),
            ..Default::default()
        };
        let mut catalog = McpCatalog::new();
        catalog.insert(
            "ticket".into(),
            McpToolInfo {
                name: "create_ticket".into(),
                description: "Opens a ticket".into(),
                input_schema: json!({"type": "object"}),
                annotations: McpAnnotations::default(),
            },
        );
        catalog.insert(
            "weather".into(),
            McpToolInfo {
                name: "get_weather".into(),
                description: "Weather of a city".into(),
                input_schema: json!({"type": "object", "required": ["city"]}),
                annotations: McpAnnotations {
                    read_only_hint: Some(true),
                    idempotent_hint: Some(true),
                    ..Default::default()
                },
            },
        );
        let tb = Toolbox::new(&[http_spec("write", None), ro, mcp, keyed], &catalog).unwrap();
        assert!(tb.is_idempotent("ticket") && !tb.is_read_only("ticket"));
        assert!(tb.is_idempotent("write") && !tb.is_read_only("write") && !tb.has_lookup("write"));
        assert!(!tb.is_idempotent("read") && tb.is_read_only("read") && tb.has_lookup("read"));
        // Hints are exposed but not trusted.
        assert!(!tb.is_idempotent("weather") && !tb.is_read_only("weather"));
        assert_eq!(tb.mcp_hints("weather").unwrap().read_only_hint, Some(true));
        let weather = &tb.defs()[2];
        assert_eq!(weather.description, "Weather of a city");
        assert_eq!(weather.input_schema["required"], json!(["city"]));
        assert!(
            tb.validate("weather", &json!({}))
                .unwrap_err()
                .contains("\"city\" is a required property")
        );
        assert!(!tb.is_idempotent("nope") && !tb.is_read_only("nope"));
    }

    #[tokio::test]
    async fn lookups_without_a_declared_lookup_are_unknown() {
        let tb = toolbox(&[http_spec("write", None)]);
        assert!(matches!(
            tb.lookup("write", &json!({}), &ctx()).await,
            LookupOutcome::Unknown { reason } if reason.contains("declares no lookup")
        ));
        assert!(matches!(
            tb.lookup("nope", &json!({}), &ctx()).await,
            LookupOutcome::Unknown { .. }
        ));
    }

    #[test]
    fn outcomes_serialize_for_the_log() {
        let ok = ToolOutcome::Ok(json!({"id": 1}));
        assert_eq!(serde_json::to_value(&ok).unwrap(), json!({"Ok": {"id": 1}}));
        let failed = ToolOutcome::failed("x: HTTP 400");
        assert_eq!(
            serde_json::to_value(&failed).unwrap(),
            json!({"Failed": {"observation": "x: HTTP 400"}})
        );
        for outcome in [ok, failed] {
            let back: ToolOutcome =
                serde_json::from_value(serde_json::to_value(&outcome).unwrap()).unwrap();
            assert_eq!(back, outcome);
        }
        let done = LookupOutcome::Done(json!(3));
        assert_eq!(serde_json::to_value(&done).unwrap(), json!({"Done": 3}));
        assert_eq!(
            serde_json::to_value(LookupOutcome::NotDone).unwrap(),
            json!("NotDone")
        );
    }

    #[test]
    fn toolbox_is_shareable_and_its_futures_are_send() {
        fn send_sync<T: Send + Sync>(_: &T) {}
        fn send<T: Send>(_: T) {}
        let tb = toolbox(&[]);
        send_sync(&tb);
        let (args, c) = (json!({}), ctx());
        send(tb.call("finish", &args, &c));
        send(tb.lookup("finish", &args, &c));
        send(discover_mcp("http://127.0.0.1:9/mcp"));
        send(discover_catalog(&[]));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let retry = RetryPolicy {
            attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
        };
        assert_eq!(retry.backoff(1), Duration::from_millis(100));
        assert_eq!(retry.backoff(2), Duration::from_millis(200));
        assert_eq!(retry.backoff(3), Duration::from_millis(400));
        assert_eq!(retry.backoff(4), Duration::from_millis(500));
        assert_eq!(retry.backoff(60), Duration::from_millis(500));
    }

    #[test]
    fn excerpts_cut_on_char_boundaries() {
        assert_eq!(excerpt("  short ", 10), "short");
        assert_eq!(excerpt("ééééé", 3), "é…");
    }

    /// The tool client goes where the runner's check looked: a name pinned
    /// to an address is connected there, and never looked up again (here a
    /// `.invalid` name, which no resolver answers).
    #[tokio::test]
    async fn a_call_connects_to_the_address_its_name_was_pinned_to() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = axum::Router::new().route(
            "/tools",
            axum::routing::post(|| async { axum::Json(json!({"refund": "R-1"})) }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        let mut spec = http_spec("refund", None);
        spec.http.as_mut().unwrap().url = format!("http://refunds.invalid:{port}/tools");
        let pins = crate::dns::Pins::default();
        pins.set("refunds.invalid", vec!["127.0.0.1".parse().unwrap()]);
        let tb = Toolbox::pinned(std::slice::from_ref(&spec), &McpCatalog::new(), pins).unwrap();
        assert_eq!(
            tb.call("refund", &json!({}), &ctx()).await,
            ToolOutcome::Ok(json!({"refund": "R-1"}))
        );
        // Unpinned, the same name leads nowhere.
        let unpinned = toolbox(&[spec]);
        assert!(matches!(
            unpinned.call("refund", &json!({}), &ctx()).await,
            ToolOutcome::Failed { .. }
        ));
    }
}
