//! The MCP servers the runner serves a container agent on its pod's
//! loopback (streamable HTTP, built on the official SDK): one per tool
//! server the Agent declares, and one more for its HTTP tools. Each lists
//! the tools pinned for the run, the same at every replay whatever the real
//! server lists now, and hands every call to the runner ([`Calls`]), which
//! matches it against the log, gates, keys, records and makes it.
//!
//! The agent is told nothing the Agent did not declare: a tool it asks for
//! by another name is refused naming the tools this server has, and its
//! `_meta` is not passed on (the runner sets the idempotency key itself).

use std::sync::Arc;

use futures::future::BoxFuture;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Map, Value};

use crate::tools::{McpAnnotations, ToolOutcome};

/// A tool as one served server lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServedTool {
    /// The Agent's name for the tool (what its approval rules name).
    pub name: String,
    pub description: String,
    /// JSON Schema of its arguments (`{"type": "object"}` when none).
    pub input_schema: Value,
    pub annotations: McpAnnotations,
}

/// One call the agent made, for the runner to answer.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentCall {
    /// The served server's name (its path segment).
    pub server: String,
    pub tool: String,
    pub arguments: Map<String, Value>,
}

/// The runner's side: answers a call (from the log, or made and recorded).
pub trait Calls: Send + Sync + 'static {
    fn call(&self, call: AgentCall) -> BoxFuture<'static, ToolOutcome>;
}

/// One served server.
#[derive(Clone)]
struct Served {
    server: String,
    tools: Arc<Vec<ServedTool>>,
    calls: Arc<dyn Calls>,
}

/// The `tools/list` entry of a served tool.
fn listed(tool: &ServedTool) -> Result<Tool, serde_json::Error> {
    let schema = match &tool.input_schema {
        Value::Object(_) => tool.input_schema.clone(),
        _ => serde_json::json!({"type": "object"}),
    };
    serde_json::from_value(serde_json::json!({
        "name": tool.name,
        "description": tool.description,
        "inputSchema": schema,
        "annotations": tool.annotations,
    }))
}

/// What the agent receives for an outcome: a result's text (and the value
/// itself as `structuredContent` when it is an object), or an error result
/// with what the model is to be told.
pub fn result_of(outcome: &ToolOutcome) -> CallToolResult {
    match outcome {
        ToolOutcome::Ok(value @ Value::Object(_)) => {
            let mut result = CallToolResult::structured(value.clone());
            result.content = vec![ContentBlock::text(value.to_string())];
            result
        }
        ToolOutcome::Ok(_) => {
            CallToolResult::success(vec![ContentBlock::text(outcome.observation())])
        }
        ToolOutcome::Failed { observation } => {
            CallToolResult::error(vec![ContentBlock::text(observation.clone())])
        }
    }
}

impl ServerHandler for Served {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let tools = self
            .tools
            .iter()
            .map(listed)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ErrorData::internal_error(format!("a pinned tool: {e}"), None))?;
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        if !self.tools.iter().any(|t| t.name == name) {
            let have: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            return Err(ErrorData::invalid_params(
                format!(
                    "params.name: unknown tool {name:?}; this server has {}",
                    have.join(", ")
                ),
                None,
            ));
        }
        let call = AgentCall {
            server: self.server.clone(),
            tool: name,
            arguments: request.arguments.unwrap_or_default(),
        };
        let outcome = self.calls.call(call).await;
        Ok(result_of(&outcome).into())
    }
}

/// The streamable-HTTP service of one served server (mount it at
/// `/mcp/{server}`): stateless, JSON responses. Requests must name a
/// loopback host, or `listen_host` (the address the runner serves on, which
/// is the pod's own): the SDK's guard against DNS rebinding.
pub fn service(
    server: &str,
    tools: Vec<ServedTool>,
    calls: Arc<dyn Calls>,
    listen_host: Option<&str>,
) -> StreamableHttpService<impl ServerHandler, LocalSessionManager> {
    let served = Served {
        server: server.to_string(),
        tools: Arc::new(tools),
        calls,
    };
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
    hosts.extend(listen_host.map(str::to_string));
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None);
    StreamableHttpService::new(move || Ok(served.clone()), Default::default(), config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use rmcp::ServiceExt;
    use rmcp::transport::StreamableHttpClientTransport;
    use serde_json::json;

    /// A runner that answers every call from a table and notes it.
    #[derive(Default)]
    struct Table {
        seen: Mutex<Vec<AgentCall>>,
    }

    impl Calls for Table {
        fn call(&self, call: AgentCall) -> BoxFuture<'static, ToolOutcome> {
            let outcome = match call.tool.as_str() {
                "lookup" => {
                    ToolOutcome::Ok(json!({"order": call.arguments["order"], "total": 900}))
                }
                _ => ToolOutcome::Failed {
                    observation: "refund refused: alice rejected it (over the limit)".into(),
                },
            };
            self.seen.lock().unwrap().push(call);
            Box::pin(async move { outcome })
        }
    }

    fn pinned() -> Vec<ServedTool> {
        ["lookup", "refund"]
            .map(|name| ServedTool {
                name: name.into(),
                description: format!("{name} an order"),
                input_schema: json!({"type": "object", "properties": {"order": {"type": "string"}}}),
                annotations: McpAnnotations::default(),
            })
            .to_vec()
    }

    /// Served on loopback, read through the official SDK's client as an
    /// agent's framework would.
    #[tokio::test]
    async fn an_agent_lists_the_pinned_tools_and_its_calls_reach_the_runner() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let table = Arc::new(Table::default());
        let app = axum::Router::new()
            .route_service("/mcp/shop", service("shop", pinned(), table.clone(), None));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp/shop", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });

        let client = ().serve(StreamableHttpClientTransport::from_uri(url)).await.unwrap();
        let tools = client.list_all_tools().await.unwrap();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, ["lookup", "refund"]);

        let args = json!({"order": "A-1"}).as_object().cloned();
        let ok = client
            .call_tool(CallToolRequestParams::new("lookup").with_arguments(args.clone().unwrap()))
            .await
            .unwrap();
        assert_eq!(ok.is_error, Some(false));
        assert_eq!(
            ok.structured_content,
            Some(json!({"order": "A-1", "total": 900}))
        );

        let refused = client
            .call_tool(CallToolRequestParams::new("refund").with_arguments(args.clone().unwrap()))
            .await
            .unwrap();
        assert_eq!(refused.is_error, Some(true));
        let text = serde_json::to_string(&refused.content).unwrap();
        assert!(text.contains("alice rejected it"), "{text}");

        let unknown = client
            .call_tool(CallToolRequestParams::new("delete_everything"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            unknown.contains("unknown tool \"delete_everything\"; this server has lookup, refund"),
            "{unknown}"
        );

        let seen = table.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "the unknown tool never reached the runner");
        assert_eq!(seen[0].server, "shop");
        assert_eq!(
            Value::Object(seen[0].arguments.clone()),
            json!({"order": "A-1"})
        );
        client.cancel().await.unwrap();
    }
}
