//! Scripted model server: answers OpenAI chat completions and Anthropic
//! Messages requests from per-test scripts, in the real wire formats.
//!
//! HTTP contract (every script is addressed by its id, so tests run in parallel):
//!
//! - `PUT /scripts/{id}` with `{"replies": [Reply, ...]}` creates or replaces
//!   script `id` and forgets its calls. A `Reply` (camelCase, unknown fields
//!   refused so a typo fails loudly):
//!   - `text`: answer text;
//!   - `toolCalls`: `[{"name", "arguments": {..}, "rawArguments": "<raw>", "id": "<optional>"}]`;
//!   - `rawArguments`: raw (typically invalid JSON) arguments of the first tool call;
//!   - `status` (+ optional `message`, `retryAfter` seconds): answer with this
//!     HTTP error in the provider's error format instead;
//!   - `rawBody`: send this body verbatim (with `status`, or 200);
//!   - `inputTokens`, `outputTokens`: usage to report (defaults: request
//!     bytes / 4, answer bytes / 4 + 1);
//!   - `stopReason`: override the finish/stop reason;
//!   - `delayMs`: wait this long before answering (to test timeouts).
//! - `POST /scripts/{id}/v1/chat/completions` (OpenAI) and
//!   `POST /scripts/{id}/v1/messages` (Anthropic): the n-th call (counting from
//!   0, whatever the API or the request says) gets `replies[n]`; past the end
//!   it gets the text `script exhausted`. Every call is counted and its body
//!   recorded, even one that is refused. The request must carry the key
//!   (`Authorization: Bearer K`, or `x-api-key` plus `anthropic-version`):
//!   missing, it is a 401 in the provider's format; a key starting with
//!   `invalid` is a 401 whose message echoes the key (as some providers do).
//!   The request is checked like the provider would (required fields, tool
//!   call / tool result pairing, argument encoding, role order) and refused
//!   with a 400 explaining what is wrong. The reported model is
//!   `scripted-{id}-2026-11`; tool-call ids are unique per call.
//!   An unknown script is a 404.
//!   With `"byTurn": true` in the script, a reply is chosen by the
//!   conversation instead, as a deterministic model would: every answer
//!   carries the marker `[[turn N]]` in its text, and a request is answered
//!   with `replies[K + 1]` where K is the highest marker in the request (0
//!   without one). Asking again with the same conversation gets the same
//!   answer. Toolless (compacting) requests then get `summaries[0]` (or a
//!   default) with the request's highest marker, so the turn survives a
//!   summary.
//! - `GET /scripts/{id}/calls`: `{"count": n, "requests": [bodies received],
//!   "receivedAt": [RFC 3339 time of each], "serviceMicros": [time this
//!   server spent on each, scripted delays included], "indexes": [each
//!   one's call number in the script]}`; with `?run=R` only
//!   the requests whose body carries the marker `[[run R]]` (many runs
//!   sharing a `byTurn` script, told apart by their task).
//! - `DELETE /scripts/{id}`: forgets the script.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::{
    Json, Router,
    body::Bytes,
    extract::{DefaultBodyLimit, Path, RawQuery, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use serde::Deserialize;
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Deserialize, Clone, Debug, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Reply {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ScriptedCall>,
    #[serde(default)]
    raw_arguments: Option<String>,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    retry_after: Option<u64>,
    #[serde(default)]
    raw_body: Option<String>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    delay_ms: Option<u64>,
}

#[derive(Deserialize, Clone, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ScriptedCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
    #[serde(default)]
    raw_arguments: Option<String>,
    #[serde(default)]
    id: Option<String>,
}

fn empty_object() -> Value {
    json!({})
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptBody {
    replies: Vec<Reply>,
    /// Replies to requests that offer no tools (the agent compacting its
    /// history), in order; they do not use up `replies`.
    #[serde(default)]
    summaries: Vec<Reply>,
    /// Choose replies by the turn markers in the request, not by call count.
    #[serde(default, rename = "byTurn")]
    by_turn: bool,
}

#[derive(Default)]
struct Script {
    replies: Vec<Reply>,
    summaries: Vec<Reply>,
    by_turn: bool,
    requests: Vec<Value>,
    /// When each request arrived (RFC 3339, microseconds).
    received_at: Vec<String>,
    /// How long each took to answer (0 until answered).
    service_micros: Vec<u64>,
    /// Answered requests that offered no tools.
    toolless: usize,
}

/// The highest `[[turn N]]` marker in a request body.
fn highest_turn(body: &str) -> Option<usize> {
    body.split("[[turn ")
        .skip(1)
        .filter_map(|rest| rest.split("]]").next()?.parse().ok())
        .max()
}

/// A request that offers the model no tools (both wire formats).
fn offers_no_tools(request: &Value) -> bool {
    request
        .get("tools")
        .and_then(Value::as_array)
        .is_none_or(|t| t.is_empty())
}

type Scripts = Arc<Mutex<HashMap<String, Script>>>;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    OpenAI,
    Anthropic,
}

/// The scripted model server's routes.
pub fn router() -> Router {
    Router::new()
        .route("/scripts/{id}", put(put_script).delete(delete_script))
        .route("/scripts/{id}/calls", get(get_calls))
        .route("/scripts/{id}/v1/chat/completions", post(openai))
        .route("/scripts/{id}/v1/messages", post(anthropic))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(Scripts::default())
}

async fn put_script(
    Path(id): Path<String>,
    State(scripts): State<Scripts>,
    body: Bytes,
) -> Response {
    let parsed: ScriptBody = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("bad script: {e}")})),
            )
                .into_response();
        }
    };
    for (i, r) in parsed.replies.iter().enumerate() {
        if r.raw_arguments.is_some() && r.tool_calls.is_empty() {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("replies[{i}]: rawArguments needs a tool call")})),
            )
                .into_response();
        }
    }
    let n = parsed.replies.len();
    scripts.lock().unwrap().insert(
        id.clone(),
        Script {
            replies: parsed.replies,
            summaries: parsed.summaries,
            by_turn: parsed.by_turn,
            ..Default::default()
        },
    );
    Json(json!({"id": id, "replies": n})).into_response()
}

async fn delete_script(Path(id): Path<String>, State(scripts): State<Scripts>) -> StatusCode {
    match scripts.lock().unwrap().remove(&id) {
        Some(_) => StatusCode::NO_CONTENT,
        None => StatusCode::NOT_FOUND,
    }
}

async fn get_calls(
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    State(scripts): State<Scripts>,
) -> Json<Value> {
    // `run=R`: run names are plain (no escapes to undo).
    let run = query
        .as_deref()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("run="));
    let scripts = scripts.lock().unwrap();
    let (mut requests, mut received_at, mut service, mut indexes) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if let Some(s) = scripts.get(&id) {
        let marker = run.map(|r| format!("[[run {r}]]"));
        for (i, request) in s.requests.iter().enumerate() {
            if marker
                .as_ref()
                .is_some_and(|m| !request.to_string().contains(m.as_str()))
            {
                continue;
            }
            requests.push(request.clone());
            received_at.push(s.received_at[i].clone());
            service.push(s.service_micros[i]);
            indexes.push(i);
        }
    }
    Json(
        json!({"count": requests.len(), "requests": requests, "receivedAt": received_at,
                "serviceMicros": service, "indexes": indexes}),
    )
}

/// Records how long the server spent on request `index` of script `id`
/// when the answer is ready (dropped with the handler's locals).
struct ServiceTimer {
    scripts: Scripts,
    id: String,
    index: usize,
    started: std::time::Instant,
}

impl Drop for ServiceTimer {
    fn drop(&mut self) {
        let micros = self.started.elapsed().as_micros() as u64;
        let mut scripts = self.scripts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = scripts
            .get_mut(&self.id)
            .and_then(|s| s.service_micros.get_mut(self.index))
        {
            *slot = micros;
        }
    }
}

async fn openai(
    Path(id): Path<String>,
    State(scripts): State<Scripts>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(Api::OpenAI, id, scripts, headers, body).await
}

async fn anthropic(
    Path(id): Path<String>,
    State(scripts): State<Scripts>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(Api::Anthropic, id, scripts, headers, body).await
}

async fn answer(
    api: Api,
    id: String,
    scripts: Scripts,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = std::time::Instant::now();
    let parsed: Result<Value, _> = serde_json::from_slice(&body);
    let recorded = match &parsed {
        Ok(v) => v.clone(),
        Err(_) => Value::String(String::from_utf8_lossy(&body).into_owned()),
    };
    // Count and record the call, and take its reply, in one step.
    let taken = scripts
        .lock()
        .unwrap()
        .get_mut(&id)
        .map(|script| script.take(recorded));
    let Some((index, n, reply)) = taken else {
        return error(
            api,
            StatusCode::NOT_FOUND,
            &format!("no script {id:?}: PUT /scripts/{id} first"),
        );
    };
    let _timer = ServiceTimer {
        scripts: scripts.clone(),
        id: id.clone(),
        index,
        started,
    };
    tracing::info!(script = %id, call = n, api = ?api, "scripted model call");

    if let Err((status, message)) = check_auth(api, &headers) {
        return error(api, status, &message);
    }
    let request = match parsed {
        Ok(v) => v,
        Err(e) => {
            return error(
                api,
                StatusCode::BAD_REQUEST,
                &format!("request body is not valid JSON: {e}"),
            );
        }
    };
    let checked = match api {
        Api::OpenAI => check_openai(&request),
        Api::Anthropic => check_anthropic(&request),
    };
    if let Err(why) = checked {
        return error(api, StatusCode::BAD_REQUEST, &why);
    }

    let reply = reply.unwrap_or_else(|| Reply {
        text: Some("script exhausted".into()),
        ..Reply::default()
    });
    if let Some(ms) = reply.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(scripted) = scripted_failure(api, &reply) {
        return scripted;
    }
    let answer = Answered::of(api, &id, n, &reply, body.len());
    let body = match api {
        Api::OpenAI => openai_body(&answer),
        Api::Anthropic => anthropic_body(&answer),
    };
    Json(body).into_response()
}

impl Script {
    /// Records a request and takes its reply: by the request's turn marker
    /// (`byTurn`), else the next summary for a toolless request, else the
    /// next reply. Returns the request's index, its call number in the
    /// script, and the reply (`None`: the script is exhausted).
    fn take(&mut self, recorded: Value) -> (usize, usize, Option<Reply>) {
        let toolless = !self.summaries.is_empty() && offers_no_tools(&recorded);
        self.received_at
            .push(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
        let turn = self.by_turn.then(|| highest_turn(&recorded.to_string()));
        self.requests.push(recorded);
        self.service_micros.push(0);
        let index = self.requests.len() - 1;
        match turn {
            Some(turn) => (index, index, self.by_turn(turn, toolless)),
            None if toolless => {
                self.toolless += 1;
                (index, index, self.summaries.get(self.toolless - 1).cloned())
            }
            None => {
                let n = index - self.toolless;
                (index, n, self.replies.get(n).cloned())
            }
        }
    }

    /// The reply to a conversation whose highest marker is `turn`, marked
    /// with the turn it answers (a summary keeps the turn it summarizes).
    fn by_turn(&self, turn: Option<usize>, toolless: bool) -> Option<Reply> {
        if toolless {
            let mut r = self.summaries.first().cloned().unwrap_or_default();
            let text = r
                .text
                .take()
                .unwrap_or_else(|| "Summary of the work so far.".into());
            r.text = Some(format!("{text} [[turn {}]]", turn.unwrap_or(0)));
            return Some(r);
        }
        let k = turn.map_or(0, |t| t + 1);
        self.replies.get(k).cloned().map(|mut r| {
            r.text = Some(match r.text.take() {
                Some(t) => format!("[[turn {k}]] {t}"),
                None => format!("[[turn {k}]]"),
            });
            r
        })
    }
}

/// A reply scripted to fail: its raw body, or its HTTP error in the
/// provider's format.
fn scripted_failure(api: Api, reply: &Reply) -> Option<Response> {
    if let Some(raw) = &reply.raw_body {
        let status = reply
            .status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::OK);
        let raw = raw.clone();
        return Some((status, [(header::CONTENT_TYPE, "application/json")], raw).into_response());
    }
    let status = reply.status?;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let message = reply
        .message
        .clone()
        .unwrap_or_else(|| format!("scripted error {}", status.as_u16()));
    let mut resp = error(api, status, &message);
    if let Some(secs) = reply.retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    Some(resp)
}

/// What an answer says, in either format.
struct Answered {
    /// The script's id, kept to what ids may carry.
    tag: String,
    /// The call's number in the script.
    n: usize,
    model: String,
    text: Option<String>,
    /// Each tool call: its id, name and arguments (a string: raw).
    calls: Vec<(String, String, Value)>,
    input_tokens: u64,
    output_tokens: u64,
    stop_reason: Option<String>,
}

impl Answered {
    /// Call `n` of script `id` answered with `reply`, to a request of
    /// `request_bytes`.
    fn of(api: Api, id: &str, n: usize, reply: &Reply, request_bytes: usize) -> Answered {
        let tag: String = id
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(24)
            .collect();
        let calls = scripted_calls(api, &tag, n, reply);
        let output_tokens = reply.output_tokens.unwrap_or_else(|| {
            let len = reply.text.as_deref().map_or(0, str::len)
                + calls
                    .iter()
                    .map(|(_, name, a)| name.len() + a.to_string().len())
                    .sum::<usize>();
            len as u64 / 4 + 1
        });
        Answered {
            model: format!("scripted-{id}-2026-11"),
            text: reply.text.clone().filter(|t| !t.is_empty()),
            input_tokens: reply
                .input_tokens
                .unwrap_or((request_bytes as u64 / 4).max(1)),
            output_tokens,
            stop_reason: reply.stop_reason.clone(),
            tag,
            n,
            calls,
        }
    }
}

/// The reply's tool calls with their ids (scripted, or unique per call)
/// and arguments (raw where the script says so).
fn scripted_calls(api: Api, tag: &str, n: usize, reply: &Reply) -> Vec<(String, String, Value)> {
    reply
        .tool_calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let id = c.id.clone().unwrap_or_else(|| match api {
                Api::OpenAI => format!("call_{tag}_{n}_{i}"),
                Api::Anthropic => format!("toolu_{tag}_{n}_{i}"),
            });
            let raw = c
                .raw_arguments
                .clone()
                .or_else(|| (i == 0).then(|| reply.raw_arguments.clone()).flatten());
            let args = match raw {
                Some(raw) => Value::String(raw),
                None => c.arguments.clone(),
            };
            (id, c.name.clone(), args)
        })
        .collect()
}

/// The answer as a chat completion.
fn openai_body(a: &Answered) -> Value {
    let mut message = json!({"role": "assistant", "content": a.text});
    if !a.calls.is_empty() {
        message["tool_calls"] = a
            .calls
            .iter()
            .map(|(id, name, args)| {
                let arguments = match args {
                    Value::String(raw) => raw.clone(),
                    other => other.to_string(),
                };
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
    }
    let finish = a.stop_reason.clone().unwrap_or_else(|| {
        if a.calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        }
        .into()
    });
    json!({
        "id": format!("chatcmpl-{}-{}", a.tag, a.n),
        "object": "chat.completion",
        "created": unix_now(),
        "model": a.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": null}],
        "usage": {
            "prompt_tokens": a.input_tokens,
            "completion_tokens": a.output_tokens,
            "total_tokens": a.input_tokens + a.output_tokens
        },
    })
}

/// The answer as a Messages response.
fn anthropic_body(a: &Answered) -> Value {
    let mut content = Vec::new();
    if let Some(t) = &a.text {
        content.push(json!({"type": "text", "text": t}));
    }
    for (id, name, args) in &a.calls {
        content.push(json!({"type": "tool_use", "id": id, "name": name, "input": args}));
    }
    let stop = a.stop_reason.clone().unwrap_or_else(|| {
        if a.calls.is_empty() {
            "end_turn"
        } else {
            "tool_use"
        }
        .into()
    });
    json!({
        "id": format!("msg_{}_{}", a.tag, a.n),
        "type": "message",
        "role": "assistant",
        "model": a.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": {"input_tokens": a.input_tokens, "output_tokens": a.output_tokens},
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// An error in the provider's own format.
fn error(api: Api, status: StatusCode, message: &str) -> Response {
    let code = status.as_u16();
    let body = match api {
        Api::OpenAI => {
            let (kind, code_name) = match code {
                401 => ("invalid_request_error", Some("invalid_api_key")),
                404 => ("invalid_request_error", Some("not_found")),
                429 => ("requests", Some("rate_limit_exceeded")),
                400..=499 => ("invalid_request_error", None),
                _ => ("server_error", None),
            };
            json!({"error": {"message": message, "type": kind, "param": null, "code": code_name}})
        }
        Api::Anthropic => {
            let kind = match code {
                400 => "invalid_request_error",
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    };
    (status, Json(body)).into_response()
}

/// The key (and version header) a provider requires: `Err((status, message))`.
fn check_auth(api: Api, headers: &HeaderMap) -> Result<(), (StatusCode, String)> {
    let header_str = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let key = match api {
        Api::OpenAI => header_str("authorization")
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty()),
        Api::Anthropic => header_str("x-api-key"),
    };
    let Some(key) = key else {
        let message = match api {
            Api::OpenAI => {
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            }
            Api::Anthropic => "x-api-key header is required",
        };
        return Err((StatusCode::UNAUTHORIZED, message.to_string()));
    };
    if key.starts_with("invalid") {
        return Err((
            StatusCode::UNAUTHORIZED,
            format!("Incorrect API key provided: {key}."),
        ));
    }
    if api == Api::Anthropic && header_str("anthropic-version").is_none() {
        return Err((
            StatusCode::BAD_REQUEST,
            "anthropic-version: header is required".to_string(),
        ));
    }
    Ok(())
}

fn str_field<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a str, String> {
    v.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{at}.{key}: a string is required"))
}

fn positive_int(v: &Value, key: &str) -> Result<(), String> {
    match v.get(key) {
        None => Ok(()),
        Some(n) if n.as_u64().is_some_and(|n| n >= 1) => Ok(()),
        Some(_) => Err(format!("{key}: must be a positive integer")),
    }
}

/// Checks a chat completions request like the provider would.
fn check_openai(req: &Value) -> Result<(), String> {
    let model = str_field(req, "model", "body")?;
    if model.is_empty() {
        return Err("model: must not be empty".into());
    }
    positive_int(req, "max_tokens")?;
    positive_int(req, "max_completion_tokens")?;
    let messages = req
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or("messages: a non-empty list is required")?;
    // Ids of the last assistant turn's tool calls still waiting for a tool message.
    let mut pending: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        check_openai_message(m, &format!("messages[{i}]"), &mut pending)?;
    }
    if !pending.is_empty() {
        return Err(format!(
            "tool_call_ids without response messages: {}",
            pending.join(", ")
        ));
    }
    if let Some(tools) = req.get("tools") {
        let tools = tools.as_array().ok_or("tools: must be a list")?;
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            if str_field(t, "type", &at)? != "function" {
                return Err(format!("{at}.type: must be 'function'"));
            }
            let f = t
                .get("function")
                .ok_or_else(|| format!("{at}.function: required"))?;
            str_field(f, "name", &format!("{at}.function"))?;
            if f.get("parameters").is_some_and(|p| !p.is_object()) {
                return Err(format!("{at}.function.parameters: must be an object"));
            }
        }
    }
    Ok(())
}

/// One chat message `at`, in its place: `pending` holds the tool calls
/// still to be answered, each by a tool message right after them.
fn check_openai_message(m: &Value, at: &str, pending: &mut Vec<String>) -> Result<(), String> {
    let role = str_field(m, "role", at)?;
    if role != "tool" && !pending.is_empty() {
        return Err(format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
            pending.join(", ")
        ));
    }
    match role {
        "system" | "developer" | "user" => {
            if !m
                .get("content")
                .is_some_and(|c| c.is_string() || c.is_array())
            {
                return Err(format!("{at}.content: required for role {role}"));
            }
        }
        "assistant" => pending.extend(check_openai_assistant(m, at)?),
        "tool" => {
            let id = str_field(m, "tool_call_id", at)?;
            if !m
                .get("content")
                .is_some_and(|c| c.is_string() || c.is_array())
            {
                return Err(format!("{at}.content: required"));
            }
            match pending.iter().position(|p| p == id) {
                Some(k) => {
                    pending.remove(k);
                }
                None => {
                    return Err(format!(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls' ({at}: unknown tool_call_id {id:?})"
                    ));
                }
            }
        }
        other => return Err(format!("{at}.role: unknown role {other:?}")),
    }
    Ok(())
}

/// An assistant message `at`: its text, or its tool calls, whose ids it
/// returns (each to be answered).
fn check_openai_assistant(m: &Value, at: &str) -> Result<Vec<String>, String> {
    let content = m.get("content");
    if !content.is_some_and(|c| c.is_null() || c.is_string() || c.is_array()) {
        return Err(format!("{at}.content: must be present (text or null)"));
    }
    let calls = match m.get("tool_calls") {
        None if content.is_some_and(|c| c.is_string()) => return Ok(Vec::new()),
        None => {
            return Err(format!(
                "{at}: content is required when there are no tool_calls"
            ));
        }
        Some(Value::Array(calls)) if !calls.is_empty() => calls,
        Some(_) => return Err(format!("{at}.tool_calls: must be a non-empty list")),
    };
    let mut ids = Vec::new();
    for (j, c) in calls.iter().enumerate() {
        let at = format!("{at}.tool_calls[{j}]");
        let id = str_field(c, "id", &at)?;
        if str_field(c, "type", &at)? != "function" {
            return Err(format!("{at}.type: must be 'function'"));
        }
        let f = c
            .get("function")
            .ok_or_else(|| format!("{at}.function: required"))?;
        str_field(f, "name", &format!("{at}.function"))?;
        // The format carries arguments as a JSON string.
        str_field(f, "arguments", &format!("{at}.function"))?;
        ids.push(id.to_string());
    }
    Ok(ids)
}

/// Checks a Messages request like the provider would.
fn check_anthropic(req: &Value) -> Result<(), String> {
    let model = str_field(req, "model", "body")?;
    if model.is_empty() {
        return Err("model: must not be empty".into());
    }
    if req.get("max_tokens").is_none() {
        return Err("max_tokens: Field required".into());
    }
    positive_int(req, "max_tokens")?;
    if let Some(system) = req.get("system")
        && !(system.is_string() || system.is_array())
    {
        return Err("system: must be a string or a list of text blocks".into());
    }
    let messages = req
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or("messages: a non-empty list is required")?;
    let mut previous_role = "";
    // tool_use ids of the previous assistant turn, to be answered now.
    let mut pending: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = str_field(m, "role", &at)?;
        if !matches!(role, "user" | "assistant") {
            return Err(format!("{at}.role: must be user or assistant"));
        }
        if i == 0 && role != "user" {
            return Err("messages: the first message must use the user role".into());
        }
        if role == previous_role {
            return Err(format!(
                "messages: roles must alternate between user and assistant ({at} repeats {role})"
            ));
        }
        let (answered, uses) = check_anthropic_blocks(m, role, &at, &pending)?;
        if role == "user" {
            let missing: Vec<&String> = pending.iter().filter(|p| !answered.contains(p)).collect();
            if !missing.is_empty() {
                return Err(format!(
                    "{at}: `tool_use` ids were found without `tool_result` blocks immediately after: {}",
                    missing
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            pending.clear();
        } else {
            pending = uses;
        }
        previous_role = role;
    }
    if !pending.is_empty() {
        return Err(format!(
            "messages: `tool_use` ids were found without `tool_result` blocks immediately after: {}",
            pending.join(", ")
        ));
    }
    if let Some(tools) = req.get("tools") {
        let tools = tools.as_array().ok_or("tools: must be a list")?;
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            str_field(t, "name", &at)?;
            if !t.get("input_schema").is_some_and(Value::is_object) {
                return Err(format!("{at}.input_schema: Field required (an object)"));
            }
        }
    }
    Ok(())
}

/// The content blocks of message `at` (of `role`): returns the tool uses
/// it answers (of those `pending`) and the tool uses it makes.
fn check_anthropic_blocks(
    m: &Value,
    role: &str,
    at: &str,
    pending: &[String],
) -> Result<(Vec<String>, Vec<String>), String> {
    let blocks: Vec<Value> = match m.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(b)) if !b.is_empty() => b.clone(),
        _ => {
            return Err(format!(
                "{at}.content: a string or a non-empty list of blocks is required"
            ));
        }
    };
    let mut answered: Vec<String> = Vec::new();
    let mut seen_other = false;
    let mut uses: Vec<String> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        match str_field(b, "type", &bat)? {
            "text" => {
                let t = str_field(b, "text", &bat)?;
                if t.trim().is_empty() {
                    return Err(format!(
                        "{bat}: text content blocks must contain non-whitespace text"
                    ));
                }
                seen_other = true;
            }
            "image" | "document" => seen_other = true,
            "tool_use" => {
                if role != "assistant" {
                    return Err(format!(
                        "{bat}: tool_use blocks are only allowed in assistant messages"
                    ));
                }
                let id = str_field(b, "id", &bat)?;
                str_field(b, "name", &bat)?;
                if !b.get("input").is_some_and(Value::is_object) {
                    return Err(format!("{bat}.input: Input should be a valid dictionary"));
                }
                uses.push(id.to_string());
            }
            "tool_result" => answered.push(check_tool_result(b, role, &bat, seen_other, pending)?),
            other => return Err(format!("{bat}.type: unknown block type {other:?}")),
        }
    }
    Ok((answered, uses))
}

/// A `tool_result` block `bat`: first in a user message, answering a
/// pending tool use, whose id it returns.
fn check_tool_result(
    b: &Value,
    role: &str,
    bat: &str,
    seen_other: bool,
    pending: &[String],
) -> Result<String, String> {
    if role != "user" {
        return Err(format!(
            "{bat}: tool_result blocks are only allowed in user messages"
        ));
    }
    if seen_other {
        return Err(format!(
            "{bat}: tool_result blocks must come first in the content, before any other block"
        ));
    }
    let id = str_field(b, "tool_use_id", bat)?;
    if !pending.iter().any(|p| p == id) {
        return Err(format!(
            "{bat}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
        ));
    }
    if let Some(c) = b.get("content")
        && !(c.is_string() || c.is_array())
    {
        return Err(format!(
            "{bat}.content: must be a string or a list of blocks"
        ));
    }
    if let Some(e) = b.get("is_error")
        && !e.is_boolean()
    {
        return Err(format!("{bat}.is_error: must be a boolean"));
    }
    Ok(id.to_string())
}
