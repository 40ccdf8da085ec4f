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
        ("tool_choice", |v| {
            v == &json!({"type": "auto"})
                || v == &json!({"type": "auto", "disable_parallel_tool_use": false})
        }),
        ("stop_sequences", |v| v == &json!([])),
        ("thinking", |v| v == &json!({"type": "disabled"})),
    ],
};

const TEXT: &[&str] = &["text"];

/// The request body as a [`ModelRequest`], or why it cannot be served.
pub fn request(body: &Value) -> Result<ModelRequest, BadRequest> {
    let o = object(body, "")?;
    BODY.check(o, "")?;
    let system = system(o)?;
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

/// `system`: a string, or text blocks, each a part of the system prompt
/// (joined by a blank line, as system messages are in the other dialects).
fn system(o: &Map<String, Value>) -> Result<String, BadRequest> {
    match get(o, "system") {
        None => Ok(String::new()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                parts.push(fields::text_part(b, &index("system", i), TEXT)?.to_string());
            }
            Ok(fields::join_system(parts))
        }
        Some(s) => fields::text(s, "system", TEXT),
    }
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

/// The 400 body of a request that cannot be served (the message names the
/// field: Anthropic's errors have no field of their own for it).
pub fn bad_request(e: &BadRequest) -> Value {
    error(400, &e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Message;
    use crate::wire::sdk_fixtures::{CREATED, ID, MODEL, answer, answers, captured, second_turn};

    #[test]
    fn anthropic_sdk_requests_parse() {
        let first = request(&captured("anthropic_sdk-1")).unwrap();
        assert_eq!(first.system, "You are careful.");
        assert_eq!(
            first.messages,
            vec![Message::user("What about orders 42 and 43?")]
        );
        assert_eq!(first.max_output_tokens, Some(1024));
        let lookup = ToolDef {
            name: "lookup".into(),
            description: "Find an order".into(),
            input_schema: json!({"type": "object", "properties": {"order": {"type": "integer"}}}),
        };
        assert_eq!(first.tools, vec![lookup]);
        let second = request(&captured("anthropic_sdk-2")).unwrap();
        assert_eq!(
            second.messages,
            second_turn([json!({"order": 42}), json!({"order": 43})])
        );
    }

    #[test]
    fn system_blocks_mixed_turns_and_errors() {
        let body = json!({
            "max_tokens": 10,
            "system": [{"type": "text", "text": "A.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B."}],
            "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, {"type": "tool_use", "id": "t1", "name": "x", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": [{"type": "text", "text": "boom"}]},
                    {"type": "text", "text": "try again"},
                ]},
            ],
        });
        let r = request(&body).unwrap();
        assert_eq!(r.system, "A.\n\nB.");
        assert_eq!(
            r.messages[2],
            Message::ToolResult {
                call_id: "t1".into(),
                name: "x".into(),
                content: "boom".into(),
                is_error: true
            }
        );
        assert_eq!(r.messages[3], Message::user("try again"));
    }

    #[test]
    fn malformed_requests_are_refused_naming_the_field() {
        let user = |content: Value| json!({"max_tokens": 5, "messages": [{"role": "user", "content": content}]});
        let cases = [
            (json!({"max_tokens": 5}), "messages"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "text", "text": "a"}, {"type": "image"}]}),
                "system[1].type",
            ),
            (
                user(json!([{"type": "image", "source": {}}])),
                "messages[0].content[0].type",
            ),
            (
                user(json!([{"type": "tool_result", "tool_use_id": "nope", "content": "x"}])),
                "messages[0].content[0].tool_use_id",
            ),
            (user(json!(null)), "messages[0].content"),
            (
                json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
                "messages[2].content[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": ""}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": "{}"}]}]}),
                "messages[0].content[0].input",
            ),
            (
                json!({"messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "thinking",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}),
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "mcp_servers": []}),
                "mcp_servers",
            ),
        ];
        for (body, field) in cases {
            let err = request(&body).expect_err(&body.to_string());
            assert_eq!(err.field, field, "{body}: {err}");
        }
    }

    #[test]
    fn responses_have_the_answers_fields() {
        for (name, a) in answers() {
            let m = response(&a, MODEL, ID, CREATED);
            assert_eq!(
                (m["type"].as_str(), m["id"].as_str()),
                (Some("message"), Some("msg_0d2c6f1e"))
            );
            let stop = match name {
                "text" => "end_turn",
                "limit" => "max_tokens",
                _ => "tool_use",
            };
            assert_eq!(m["stop_reason"], stop, "{name}");
            assert_eq!(
                (
                    m["usage"]["input_tokens"].as_u64(),
                    m["usage"]["output_tokens"].as_u64()
                ),
                (Some(120), Some(12))
            );
            assert_eq!(m["content"], Value::Array(content_blocks(&a)));
            let uses: Vec<_> = m["content"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .map(|b| (b["id"].as_str().unwrap().to_string(), b["input"].clone()))
                .collect();
            let recorded: Vec<_> = a
                .tool_calls
                .iter()
                .map(|c| (c.id.clone(), c.arguments.clone()))
                .collect();
            assert_eq!(uses, recorded, "{name}");
        }
        let raw = ModelResponse {
            tool_calls: vec![ToolCall {
                id: "t".into(),
                name: "x".into(),
                arguments: json!("{\"cut"),
            }],
            ..answer("tools")
        };
        assert_eq!(
            response(&raw, MODEL, ID, CREATED)["content"][0]["input"],
            json!({})
        );
    }

    #[test]
    fn streams_rebuild_the_answer() {
        for (name, a) in answers() {
            let payloads = sse::payloads(&stream(&a, MODEL, ID, CREATED));
            let kinds: Vec<&str> = payloads
                .iter()
                .map(|p| p["type"].as_str().unwrap())
                .collect();
            assert_eq!(kinds[0], "message_start");
            assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
            // What the SDK's accumulator does: blocks started, deltas applied.
            let mut message = payloads[0]["message"].clone();
            let mut json_parts: Vec<String> = Vec::new();
            for p in &payloads[1..] {
                let i = p["index"].as_u64().unwrap_or(0) as usize;
                match p["type"].as_str().unwrap() {
                    "content_block_start" => {
                        message["content"]
                            .as_array_mut()
                            .unwrap()
                            .push(p["content_block"].clone());
                        json_parts.push(String::new());
                    }
                    "content_block_delta" if p["delta"]["type"] == "text_delta" => {
                        let t = message["content"][i]["text"].as_str().unwrap().to_string()
                            + p["delta"]["text"].as_str().unwrap();
                        message["content"][i]["text"] = json!(t);
                    }
                    "content_block_delta" => {
                        json_parts[i] += p["delta"]["partial_json"].as_str().unwrap()
                    }
                    "content_block_stop" if message["content"][i]["type"] == "tool_use" => {
                        message["content"][i]["input"] =
                            serde_json::from_str(&json_parts[i]).unwrap();
                    }
                    "message_delta" => {
                        message["stop_reason"] = p["delta"]["stop_reason"].clone();
                        message["usage"]["output_tokens"] = p["usage"]["output_tokens"].clone();
                    }
                    _ => {}
                }
            }
            assert_eq!(message, response(&a, MODEL, ID, CREATED), "{name}");
        }
    }

    #[test]
    fn an_answer_sent_back_as_history_reads_as_recorded() {
        for (name, a) in answers() {
            let content = response(&a, MODEL, ID, CREATED)["content"].clone();
            let body = json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]});
            let expected = Message::Assistant {
                text: a.text.clone(),
                tool_calls: a.tool_calls.clone(),
            };
            assert_eq!(request(&body).unwrap().messages[1], expected, "{name}");
        }
    }

    #[test]
    fn errors_take_their_type_from_the_status() {
        assert_eq!(
            error(400, "m"),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "m"}})
        );
        let kinds: Vec<_> = [401, 403, 404, 413, 429, 500, 529]
            .iter()
            .map(|s| error(*s, "m")["error"]["type"].clone())
            .collect();
        assert_eq!(
            kinds,
            [
                "authentication_error",
                "permission_error",
                "not_found_error",
                "request_too_large",
                "rate_limit_error",
                "api_error",
                "overloaded_error"
            ]
        );
    }
}
