//! An HTTP tool server for tests. State is in memory and namespaced by a
//! test-chosen tenant (the first path segment after `/tools`), so tests run
//! in parallel against one server.
//!
//! - `POST /tools/{tenant}/{tool}`: a side-effecting tool that honours
//!   `Idempotency-Key`: the effect happens once per key; a repeat returns the
//!   recorded result. Answers `{"ok": true, "tool", "echo": args, "effect": n}`,
//!   n = real effects so far for this tenant and tool.
//! - `POST /tools/{tenant}/nokey/{tool}`: the same tool without idempotency:
//!   every call is an effect. It remembers the key it was sent, for the lookup.
//! - `GET /tools/{tenant}/lookup/{tool}` with `Idempotency-Key`: 200 and the
//!   recorded result of the no-key call made with that key, else 404.
//! - `GET|PUT /tools/{tenant}/records/{id}`: `{"id", "version", "data"}`; PUT
//!   sets the data (body `{"data": ...}` or any JSON) and bumps the version.
//! - `PUT /tools/{tenant}/_config`: failure injection (see [`Config`]).
//! - `GET /tools/{tenant}/_effects`: every real side effect, in order.
//! - `GET /tools/{tenant}/_requests`: every tool request received, failed
//!   ones included, with its key, run and step headers, when it arrived
//!   (`receivedAt`, RFC 3339 with microseconds) and how long this server
//!   spent on it (`serviceMicros`, delays included; 0 while unanswered).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Failure injection for one tenant, replaced as a whole by `PUT _config`.
///
/// ```json
/// {"failNext": {"tool": "x", "times": 2, "status": 503},
///  "failAfterEffect": [{"tool": "y", "times": 1, "status": 502}],
///  "delayMs": {"x": 1500},
///  "nonJson": ["z"]}
/// ```
/// `failNext` answers `status` before doing anything; `failAfterEffect` does
/// the effect and then answers `status` (a lost answer). Both take one rule or
/// a list. `delayMs` delays every call of a tool; `nonJson` tools answer
/// 200 with a plain-text body (after the effect).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Config {
    fail_next: OneOrMany<FailRule>,
    fail_after_effect: OneOrMany<FailRule>,
    delay_ms: HashMap<String, u64>,
    non_json: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FailRule {
    tool: String,
    #[serde(default = "one")]
    times: u32,
    #[serde(default = "service_unavailable")]
    status: u16,
}

fn one() -> u32 {
    1
}

fn service_unavailable() -> u16 {
    503
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> Default for OneOrMany<T> {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl<T> OneOrMany<T> {
    fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Self::One(one) => std::slice::from_mut(one),
            Self::Many(many) => many,
        }
    }
}

/// Takes one failure from the first matching rule that has some left.
fn take_failure(rules: &mut OneOrMany<FailRule>, tool: &str) -> Option<u16> {
    rules
        .as_mut_slice()
        .iter_mut()
        .find(|r| r.tool == tool && r.times > 0)
        .map(|r| {
            r.times -= 1;
            r.status
        })
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Effect {
    tool: String,
    args: Value,
    key: Option<String>,
    effect: u64,
    idempotent: bool,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct RequestSeen {
    tool: String,
    path: String,
    key: Option<String>,
    run: Option<String>,
    step: Option<String>,
    args: Value,
    received_at: String,
    service_micros: u64,
}

#[derive(Clone, Debug, Serialize)]
struct Record {
    id: String,
    version: u64,
    data: Value,
}

#[derive(Default)]
struct Tenant {
    config: Config,
    effects: Vec<Effect>,
    requests: Vec<RequestSeen>,
    /// Effects per tool.
    counts: HashMap<String, u64>,
    /// Results of keyed calls, by (tool, key).
    keyed: HashMap<(String, String), Value>,
    /// Results of no-key calls, by (tool, key sent).
    nokey: HashMap<(String, String), Value>,
    records: HashMap<String, Record>,
}

type Tenants = Arc<Mutex<HashMap<String, Tenant>>>;

fn with_tenant<R>(tenants: &Tenants, tenant: &str, f: impl FnOnce(&mut Tenant) -> R) -> R {
    let mut all = tenants.lock().unwrap_or_else(|e| e.into_inner());
    f(all.entry(tenant.to_string()).or_default())
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The tool server's routes.
pub fn router() -> axum::Router {
    let tenants: Tenants = Arc::default();
    axum::Router::new()
        .route("/tools/{tenant}/_config", put(put_config).get(get_config))
        .route("/tools/{tenant}/_effects", get(effects))
        .route("/tools/{tenant}/_requests", get(requests))
        .route("/tools/{tenant}/{tool}", post(keyed_tool))
        .route("/tools/{tenant}/nokey/{tool}", post(nokey_tool))
        .route("/tools/{tenant}/lookup/{tool}", get(lookup))
        .route(
            "/tools/{tenant}/records/{id}",
            get(get_record).put(put_record),
        )
        .with_state(tenants)
}

async fn put_config(
    State(tenants): State<Tenants>,
    Path(tenant): Path<String>,
    Json(config): Json<Config>,
) -> StatusCode {
    with_tenant(&tenants, &tenant, |t| t.config = config);
    StatusCode::NO_CONTENT
}

async fn get_config(State(tenants): State<Tenants>, Path(tenant): Path<String>) -> Json<Config> {
    Json(with_tenant(&tenants, &tenant, |t| t.config.clone()))
}

async fn effects(State(tenants): State<Tenants>, Path(tenant): Path<String>) -> Json<Value> {
    Json(with_tenant(&tenants, &tenant, |t| json!(t.effects)))
}

async fn requests(State(tenants): State<Tenants>, Path(tenant): Path<String>) -> Json<Value> {
    Json(with_tenant(&tenants, &tenant, |t| json!(t.requests)))
}

async fn keyed_tool(
    State(tenants): State<Tenants>,
    Path((tenant, tool)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    run_tool(&tenants, &tenant, &tool, &headers, &body, true).await
}

async fn nokey_tool(
    State(tenants): State<Tenants>,
    Path((tenant, tool)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    run_tool(&tenants, &tenant, &tool, &headers, &body, false).await
}

async fn run_tool(
    tenants: &Tenants,
    tenant: &str,
    tool: &str,
    headers: &HeaderMap,
    body: &[u8],
    idempotent: bool,
) -> Response {
    let key = header(headers, "idempotency-key");
    let args: Value = match serde_json::from_slice(body) {
        Ok(args) => args,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("body is not JSON: {e}")})),
            )
                .into_response();
        }
    };
    let started = std::time::Instant::now();
    let seen = RequestSeen {
        tool: tool.to_string(),
        path: if idempotent {
            tool.to_string()
        } else {
            format!("nokey/{tool}")
        },
        key: key.clone(),
        run: header(headers, "x-agentrun-run"),
        step: header(headers, "x-agentrun-step"),
        args: args.clone(),
        received_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        service_micros: 0,
    };
    let (index, delay) = with_tenant(tenants, tenant, |t| {
        t.requests.push(seen);
        (t.requests.len() - 1, t.config.delay_ms.get(tool).copied())
    });
    let _timer = ServiceTimer {
        tenants: tenants.clone(),
        tenant: tenant.to_string(),
        index,
        started,
    };
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let (status, result, non_json) =
        with_tenant(tenants, tenant, |t| t.call(tool, &key, &args, idempotent));
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if non_json {
        return (status, "OK, done (this is not JSON)").into_response();
    }
    (status, Json(result)).into_response()
}

impl Tenant {
    /// A call as the tool answers it: a failure injected before, the result
    /// its key already got (keyed calls), or a new effect; then perhaps a
    /// failure injected after the effect. The status, the result, and
    /// whether the answer is to be no JSON.
    fn call(
        &mut self,
        tool: &str,
        key: &Option<String>,
        args: &Value,
        idempotent: bool,
    ) -> (u16, Value, bool) {
        if let Some(status) = take_failure(&mut self.config.fail_next, tool) {
            return (status, json!({"error": "injected failure"}), false);
        }
        let replay = if idempotent {
            key.as_ref()
                .and_then(|k| self.keyed.get(&(tool.to_string(), k.clone())).cloned())
        } else {
            None
        };
        let result = match replay {
            Some(result) => result,
            None => self.effect(tool, key, args, idempotent),
        };
        if let Some(status) = take_failure(&mut self.config.fail_after_effect, tool) {
            return (
                status,
                json!({"error": "injected failure after the effect"}),
                false,
            );
        }
        (200, result, self.config.non_json.iter().any(|n| n == tool))
    }

    /// The tool's effect, once more: counted, recorded, its result kept
    /// under the call's key.
    fn effect(
        &mut self,
        tool: &str,
        key: &Option<String>,
        args: &Value,
        idempotent: bool,
    ) -> Value {
        let count = self.counts.entry(tool.to_string()).or_default();
        *count += 1;
        let n = *count;
        let result = json!({"ok": true, "tool": tool, "echo": args, "effect": n});
        self.effects.push(Effect {
            tool: tool.to_string(),
            args: args.clone(),
            key: key.clone(),
            effect: n,
            idempotent,
        });
        if let Some(k) = key {
            let map = if idempotent {
                &mut self.keyed
            } else {
                &mut self.nokey
            };
            map.insert((tool.to_string(), k.clone()), result.clone());
        }
        result
    }
}

/// Records how long the server spent on request `index` of `tenant` when
/// the answer is ready (dropped with the handler's locals).
struct ServiceTimer {
    tenants: Tenants,
    tenant: String,
    index: usize,
    started: std::time::Instant,
}

impl Drop for ServiceTimer {
    fn drop(&mut self) {
        let micros = self.started.elapsed().as_micros() as u64;
        with_tenant(&self.tenants, &self.tenant, |t| {
            if let Some(r) = t.requests.get_mut(self.index) {
                r.service_micros = micros;
            }
        });
    }
}

async fn lookup(
    State(tenants): State<Tenants>,
    Path((tenant, tool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let Some(key) = header(&headers, "idempotency-key") else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "Idempotency-Key header required"})),
        )
            .into_response();
    };
    match with_tenant(&tenants, &tenant, |t| t.nokey.get(&(tool, key)).cloned()) {
        Some(result) => Json(result).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no call with this key"})),
        )
            .into_response(),
    }
}

async fn get_record(
    State(tenants): State<Tenants>,
    Path((tenant, id)): Path<(String, String)>,
) -> Response {
    match with_tenant(&tenants, &tenant, |t| t.records.get(&id).cloned()) {
        Some(record) => Json(record).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such record"})),
        )
            .into_response(),
    }
}

async fn put_record(
    State(tenants): State<Tenants>,
    Path((tenant, id)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Json<Record> {
    let data = match body {
        Value::Object(mut map) if map.len() == 1 && map.contains_key("data") => {
            map.remove("data").unwrap_or_default()
        }
        other => other,
    };
    Json(with_tenant(&tenants, &tenant, |t| {
        let record = t.records.entry(id.clone()).or_insert(Record {
            id,
            version: 0,
            data: Value::Null,
        });
        record.version += 1;
        record.data = data;
        record.clone()
    }))
}
