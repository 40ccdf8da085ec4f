//! A small MCP server (streamable HTTP, stateless, JSON responses) built on
//! the official SDK, at `POST /mcp/{tenant}`. Two tools:
//!
//! - `get_weather {city}` (readOnlyHint): `structuredContent`
//!   `{"city", "forecast", "temperatureC"}`; the city `Atlantis` gives an
//!   `isError` result ("unknown city: Atlantis").
//! - `create_ticket {title, priority}` (destructiveHint): opens a ticket;
//!   honours `_meta["agentrun.dev/idempotencyKey"]`: one ticket per key, a
//!   repeat returns the same ticket. The result is a text block holding
//!   `{"id", "title", "priority"}` as JSON.
//!
//! `GET /mcp-effects/{tenant}` returns `{"tickets": [...], "calls": [...]}`:
//! every ticket really created, and every `tools/call` seen with its `_meta`
//! key, run and step.
//!
//! Bad servers, for discovery's bounds, by query parameters of the MCP URL:
//! `?delayMs=N` answers every request N ms late, `?hang=1` never answers,
//! `?extraTools=N&pad=K` lists N more tools with K-character descriptions.
//! `GET /mcp-requests/{tenant}` returns `{"requests": n}`: every HTTP
//! request the tenant's MCP URL received, answered or not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::get;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Value, json};

const META_KEY: &str = "agentrun.dev/idempotencyKey";
const META_RUN: &str = "agentrun.dev/run";
const META_STEP: &str = "agentrun.dev/step";

#[derive(Default)]
struct Tenant {
    tickets: Vec<Value>,
    by_key: HashMap<String, Value>,
    calls: Vec<Value>,
}

type Tenants = Arc<Mutex<HashMap<String, Tenant>>>;
type Requests = Arc<Mutex<HashMap<String, u64>>>;

/// The query parameter `name` of a request's URI.
fn query(uri: &axum::http::Uri, name: &str) -> Option<u64> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

/// Counts the request, then answers it late or never when asked to.
async fn misbehave(State(requests): State<Requests>, request: Request, next: Next) -> Response {
    let tenant = request
        .uri()
        .path()
        .strip_prefix("/mcp/")
        .unwrap_or_default()
        .to_string();
    *requests
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(tenant)
        .or_default() += 1;
    if query(request.uri(), "hang").is_some() {
        std::future::pending::<()>().await;
    }
    if let Some(ms) = query(request.uri(), "delayMs") {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    next.run(request).await
}

async fn requests(State(requests): State<Requests>, Path(tenant): Path<String>) -> Json<Value> {
    let n = requests
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&tenant)
        .copied()
        .unwrap_or_default();
    Json(json!({ "requests": n }))
}

fn with_tenant<R>(tenants: &Tenants, tenant: &str, f: impl FnOnce(&mut Tenant) -> R) -> R {
    let mut all = tenants.lock().unwrap_or_else(|e| e.into_inner());
    f(all.entry(tenant.to_string()).or_default())
}

#[derive(Clone)]
struct Standin {
    tenants: Tenants,
}

fn tools() -> Value {
    json!([
        {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "inputSchema": {
                "type": "object",
                "properties": {"city": {"type": "string", "minLength": 1}},
                "required": ["city"]
            },
            "annotations": {"readOnlyHint": true, "openWorldHint": false}
        },
        {
            "name": "create_ticket",
            "description": "Open a support ticket.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "minLength": 1},
                    "priority": {"type": "string", "enum": ["low", "medium", "high"]}
                },
                "required": ["title", "priority"]
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true}
        }
    ])
}

/// The tenant is the path segment after `/mcp/`.
fn tenant_of(ctx: &RequestContext<RoleServer>) -> String {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.uri.path().strip_prefix("/mcp/").map(str::to_string))
        .unwrap_or_else(|| "default".to_string())
}

fn text_error(message: String) -> CallToolResponse {
    CallToolResult::error(vec![ContentBlock::text(message)]).into()
}

impl ServerHandler for Standin {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut tools = tools();
        let uri = ctx
            .extensions
            .get::<axum::http::request::Parts>()
            .map(|p| p.uri.clone())
            .unwrap_or_default();
        let pad = "x".repeat(query(&uri, "pad").unwrap_or(0) as usize);
        for i in 0..query(&uri, "extraTools").unwrap_or(0) {
            tools.as_array_mut().expect("a list").push(json!({
                "name": format!("bulk_{i}"), "description": pad,
                "inputSchema": {"type": "object"}
            }));
        }
        serde_json::from_value(json!({ "tools": tools }))
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let tenant = tenant_of(&ctx);
        // The SDK moves the request's `_meta` into the context; read both.
        let meta = |field: &str| -> Value {
            request
                .meta
                .as_ref()
                .and_then(|m| m.0.0.get(field))
                .or_else(|| ctx.meta.0.0.get(field))
                .cloned()
                .unwrap_or(Value::Null)
        };
        let key = meta(META_KEY).as_str().map(str::to_string);
        let args = Value::Object(request.arguments.clone().unwrap_or_default());
        with_tenant(&self.tenants, &tenant, |t| {
            t.calls.push(json!({
                "tool": request.name, "args": args, "key": key, "run": meta(META_RUN), "step": meta(META_STEP)
            }))
        });
        let text = |field: &str| {
            args.get(field)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        match request.name.as_ref() {
            "get_weather" => {
                let city = text("city");
                if city.is_empty() {
                    return Ok(text_error("city is required".into()));
                }
                if city == "Atlantis" {
                    return Ok(text_error(format!("unknown city: {city}")));
                }
                let report = json!({"city": city, "forecast": "sunny", "temperatureC": 21});
                Ok(CallToolResult::structured(report).into())
            }
            "create_ticket" => {
                let (title, priority) = (text("title"), text("priority"));
                if title.is_empty() {
                    return Ok(text_error("title is required".into()));
                }
                if !["low", "medium", "high"].contains(&priority.as_str()) {
                    return Ok(text_error(format!(
                        "priority must be low, medium or high, not {priority:?}"
                    )));
                }
                let ticket = with_tenant(&self.tenants, &tenant, |t| {
                    if let Some(existing) = key.as_ref().and_then(|k| t.by_key.get(k)) {
                        return existing.clone();
                    }
                    let ticket = json!({
                        "id": format!("T-{}", t.tickets.len() + 1), "title": title, "priority": priority, "key": key
                    });
                    t.tickets.push(ticket.clone());
                    if let Some(k) = &key {
                        t.by_key.insert(k.clone(), ticket.clone());
                    }
                    ticket
                });
                let shown = json!({"id": ticket["id"], "title": ticket["title"], "priority": ticket["priority"]});
                Ok(CallToolResult::success(vec![ContentBlock::text(shown.to_string())]).into())
            }
            other => Err(ErrorData::invalid_params(
                format!("unknown tool: {other}"),
                None,
            )),
        }
    }
}

async fn effects(State(tenants): State<Tenants>, Path(tenant): Path<String>) -> Json<Value> {
    Json(with_tenant(
        &tenants,
        &tenant,
        |t| json!({"tickets": t.tickets, "calls": t.calls}),
    ))
}

/// The MCP server's routes.
pub fn router() -> axum::Router {
    let tenants: Tenants = Arc::default();
    let handler = Standin {
        tenants: tenants.clone(),
    };
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        // A test server on a test address: any Host header (a test may use a name).
        .disable_allowed_hosts();
    let service: StreamableHttpService<Standin, LocalSessionManager> =
        StreamableHttpService::new(move || Ok(handler.clone()), Default::default(), config);
    let counted = Requests::default();
    axum::Router::new()
        .route_service("/mcp/{tenant}", service)
        .route_layer(axum::middleware::from_fn_with_state(
            counted.clone(),
            misbehave,
        ))
        .route("/mcp-effects/{tenant}", get(effects).with_state(tenants))
        .route("/mcp-requests/{tenant}", get(requests).with_state(counted))
}
