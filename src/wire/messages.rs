//! Anthropic Messages (`POST /v1/messages`), served: an agent's request body
//! as a [`ModelRequest`], a recorded [`ModelResponse`] back as a `message`
//! object or its event stream, and Anthropic's error body.

use serde_json::{Map, Value, json};

use super::answer::{self, Finish};
use super::fields::{self, Conversation, Keys, at, get, index, list, object, string};
use super::{BadRequest, sse};
use crate::model::{ModelRequest, ModelResponse, ToolCall, ToolDef};

/// The body's keys. Sampling settings are dropped: the Agent's spec decides
/// them.
const BODY: Keys = Keys {
    carried: &["messages", "system", "tools", "max_tokens", "stream"],
    dropped: &[
        "model",
        "metadata",
        "service_tier",
        "temperature",
        "top_p",
        "top_k",
    ],
    only: &[
        ("tool_choice", |v| v == &json!({"type": "auto"})),
        ("stop_sequences", |v| v == &json!([])),
        ("thinking", |v| v == &json!({"type": "disabled"})),
    ],
};

const TEXT: &[&str] = &["text"];

/// The request body as a [`ModelRequest`], or why it cannot be served.
pub fn request(body: &Value) -> Result<ModelRequest, BadRequest> {
    let o = object(body, "")?;
    BODY.check(o, "")?;
    let system = match get(o, "system") {
        None => String::new(),
        Some(s) => fields::text(s, "system", TEXT)?,
    };
    let messages = list(o, "messages", "")?;
    if messages.is_empty() {
        return Err(BadRequest::new(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut conversation = Conversation::default();
    for (i, m) in messages.iter().enumerate() {
        message(m, &index("messages", i), &mut conversation)?;
    }
    Ok(ModelRequest {
        system,
        messages: conversation.messages,
        tools: tools(o)?,
        max_output_tokens: fields::max_tokens(o, &["max_tokens"])?,
    })
}

/// The `stream` flag.
pub fn streams(body: &Value) -> bool {
    fields::streams(body)
}

/// One turn of `messages`, at `path`.
fn message(m: &Value, path: &str, conversation: &mut Conversation) -> Result<(), BadRequest> {
    let o = object(m, path)?;
    Keys {
        carried: &["role", "content"],
        dropped: &[],
        only: &[],
    }
    .check(o, path)?;
    let content_path = at(path, "content");
    let blocks = match get(o, "content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(blocks)) => blocks.clone(),
        _ => {
            return Err(BadRequest::new(
                content_path,
                "must be a string or a list of blocks",
            ));
        }
    };
    match string(o, "role", path)? {
        "user" => user_turn(&blocks, &content_path, conversation),
        "assistant" => assistant_turn(&blocks, &content_path, conversation),
        other => Err(BadRequest::new(
            at(path, "role"),
            format!("{other:?}: a turn is the user's or the assistant's"),
        )),
    }
}

/// A block's `type`, its keys checked: `carried` and the prompt cache mark.
fn block<'a>(
    b: &'a Value,
    path: &str,
    carried: &[&str],
) -> Result<(&'a str, &'a Map<String, Value>), BadRequest> {
    let o = object(b, path)?;
    Keys {
        carried,
        dropped: &["type", "cache_control"],
        only: &[("citations", |v| v == &json!([]))],
    }
    .check(o, path)?;
    Ok((string(o, "type", path)?, o))
}

fn unsupported(kind: &str, path: &str) -> BadRequest {
    BadRequest::new(
        at(path, "type"),
        format!(
            "{kind:?} blocks are not supported here: agentrun carries text, tool_use and tool_result"
        ),
    )
}

/// A user turn: tool results and text, in order (consecutive text blocks are
/// one user message).
fn user_turn(
    blocks: &[Value],
    path: &str,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    let mut texts: Vec<String> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let b_path = index(path, j);
        let kind = b.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "text" => {
                let (_, o) = block(b, &b_path, &["text"])?;
                texts.push(string(o, "text", &b_path)?.to_string());
            }
            "tool_result" => {
                if !texts.is_empty() {
                    conversation.user(texts.join("\n"));
                    texts.clear();
                }
                tool_result(b, &b_path, conversation)?;
            }
            other => return Err(unsupported(other, &b_path)),
        }
    }
    if !texts.is_empty() {
        conversation.user(texts.join("\n"));
    }
    Ok(())
}

/// A `tool_result` block: its content a string or text blocks.
fn tool_result(b: &Value, path: &str, conversation: &mut Conversation) -> Result<(), BadRequest> {
    let (_, o) = block(b, path, &["tool_use_id", "content", "is_error"])?;
    let call_id = string(o, "tool_use_id", path)?;
    let content = match get(o, "content") {
        None => String::new(),
        Some(c) => fields::text(c, &at(path, "content"), TEXT)?,
    };
    let is_error = fields::flag(o, "is_error", path)?;
    conversation.tool_result(call_id, content, is_error, &at(path, "tool_use_id"))
}

/// An assistant turn: its text blocks joined, its `tool_use` blocks as calls.
fn assistant_turn(
    blocks: &[Value],
    path: &str,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let b_path = index(path, j);
        let kind = b.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "text" => {
                let (_, o) = block(b, &b_path, &["text"])?;
                texts.push(string(o, "text", &b_path)?.to_string());
            }
            "tool_use" => calls.push(tool_use(b, &b_path)?),
            other => return Err(unsupported(other, &b_path)),
        }
    }
    conversation.assistant(Some(texts.join("\n")));
    for c in calls {
        conversation.call(c);
    }
    Ok(())
}

fn tool_use(b: &Value, path: &str) -> Result<ToolCall, BadRequest> {
    let (_, o) = block(b, path, &["id", "name", "input"])?;
    let input = get(o, "input").cloned().unwrap_or_else(|| json!({}));
    if !input.is_object() {
        return Err(BadRequest::new(at(path, "input"), "must be an object"));
    }
    Ok(ToolCall {
        id: string(o, "id", path)?.to_string(),
        name: string(o, "name", path)?.to_string(),
        arguments: input,
    })
}

/// The client tools offered; server tools (web search, code execution,
/// computer use...) are Anthropic's own and refused.
fn tools(o: &Map<String, Value>) -> Result<Vec<ToolDef>, BadRequest> {
    let mut defs = Vec::new();
    for (i, t) in list(o, "tools", "")?.iter().enumerate() {
        let path = index("tools", i);
        let t = object(t, &path)?;
        Keys {
            carried: &["name", "description", "input_schema"],
            dropped: &["cache_control", "strict"],
            only: &[("type", |v| v == "custom")],
        }
        .check(t, &path)?;
        defs.push(ToolDef {
            name: string(t, "name", &path)?.to_string(),
            description: fields::opt_string(t, "description", &path)?
                .unwrap_or("")
                .to_string(),
            input_schema: get(t, "input_schema").cloned().unwrap_or(Value::Null),
        });
    }
    Ok(defs)
}

/// The answer as a `message` object.
pub fn response(answer: &ModelResponse, model: &str, id: &str, _created: i64) -> Value {
    let mut m = start(answer, model, id);
    m["content"] = content_blocks(answer).into_iter().collect();
    m["stop_reason"] = json!(stop_reason(answer));
    m["usage"]["output_tokens"] = json!(answer.usage.output_tokens);
    m
}

/// The message before its content: what `message_start` carries.
fn start(answer: &ModelResponse, model: &str, id: &str) -> Value {
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": null,
        "stop_sequence": null,
        "usage": {
            "input_tokens": answer.usage.input_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    })
}

/// The text block, then a `tool_use` block per call. Raw arguments (a
/// model's malformed reply) cannot be an `input`, which is an object: `{}`
/// goes out, and the tool's own schema check tells the agent.
fn content_blocks(answer: &ModelResponse) -> Vec<Value> {
    let mut blocks = Vec::new();
    if let Some(t) = answer::text(answer) {
        blocks.push(json!({"type": "text", "text": t}));
    }
    for c in &answer.tool_calls {
        blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input(c)}));
    }
    blocks
}

fn input(c: &ToolCall) -> Value {
    if c.arguments.is_object() {
        c.arguments.clone()
    } else {
        json!({})
    }
}

fn stop_reason(answer: &ModelResponse) -> &'static str {
    match answer::finish(answer) {
        Finish::ToolCalls => "tool_use",
        Finish::Limit => "max_tokens",
        Finish::Done => "end_turn",
    }
}

/// The answer as the events of a `stream: true` request: `message_start`,
/// each block started, its one delta, stopped, then `message_delta` with
/// the stop reason and usage, and `message_stop`.
pub fn stream(answer: &ModelResponse, model: &str, id: &str, _created: i64) -> Vec<String> {
    let mut events = Vec::new();
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        events.push(sse::event(Some(kind), &data));
    };
    push(
        "message_start",
        json!({"message": start(answer, model, id)}),
    );
    for (i, b) in content_blocks(answer).into_iter().enumerate() {
        let (empty, delta) = if b["type"] == "text" {
            let delta = json!({"type": "text_delta", "text": b["text"]});
            (json!({"type": "text", "text": ""}), delta)
        } else {
            let delta = json!({"type": "input_json_delta", "partial_json": b["input"].to_string()});
            let mut empty = b.clone();
            empty["input"] = json!({});
            (empty, delta)
        };
        push(
            "content_block_start",
            json!({"index": i, "content_block": empty}),
        );
        push("content_block_delta", json!({"index": i, "delta": delta}));
        push("content_block_stop", json!({"index": i}));
    }
    let usage = json!({
        "input_tokens": answer.usage.input_tokens,
        "output_tokens": answer.usage.output_tokens,
    });
    push(
        "message_delta",
        json!({"delta": {"stop_reason": stop_reason(answer), "stop_sequence": null}, "usage": usage}),
    );
    push("message_stop", json!({}));
    events
}

/// Anthropic's error body, its `type` chosen from the status as Anthropic's
/// API documents it.
pub fn error(status: u16, message: &str) -> Value {
    let kind = match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}
