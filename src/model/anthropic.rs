//! Anthropic Messages wire format.

use serde_json::{Value, json};

use super::{
    ANTHROPIC_DEFAULT_MAX_TOKENS, Message, ModelRequest, ModelResponse, ReplyError, TokenUsage,
    ToolCall, reply_model, schema_or_object, usage_count,
};

/// The request body. Consecutive messages of one role are merged into one
/// turn (tool results of one assistant turn share a user message); in a user
/// turn the `tool_result` blocks come first, as the API requires.
pub(crate) fn request_body(
    model: &str,
    req: &ModelRequest,
    max_output_tokens: Option<u32>,
) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": max_output_tokens.unwrap_or(ANTHROPIC_DEFAULT_MAX_TOKENS),
        "messages": turns(&req.messages),
    });
    if !req.system.is_empty() {
        body["system"] = json!(req.system);
    }
    if !req.tools.is_empty() {
        body["tools"] = req
            .tools
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "description": t.description,
                    "input_schema": schema_or_object(&t.input_schema),
                })
            })
            .collect();
    }
    body
}

/// The history as alternating turns: consecutive messages of one role merged,
/// empty ones dropped, tool results first in a user turn.
fn turns(history: &[Message]) -> Vec<Value> {
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in history {
        let (role, blocks) = blocks_of(m);
        if blocks.is_empty() {
            // An empty turn is refused by the API; it carries nothing anyway.
            continue;
        }
        match turns.last_mut() {
            Some((r, existing)) if *r == role => existing.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    turns
        .into_iter()
        .map(|(role, mut blocks)| {
            if role == "user" {
                // Stable: tool results first, everything else after, in order.
                blocks.sort_by_key(|b| b["type"] != "tool_result");
            }
            json!({"role": role, "content": blocks})
        })
        .collect()
}

/// The role a message speaks in and its content blocks.
fn blocks_of(m: &Message) -> (&'static str, Vec<Value>) {
    match m {
        Message::User { text } => ("user", vec![json!({"type": "text", "text": text})]),
        Message::Assistant { text, tool_calls } => {
            let mut blocks = Vec::new();
            if let Some(t) = text.as_deref().filter(|t| !t.trim().is_empty()) {
                blocks.push(json!({"type": "text", "text": t}));
            }
            for c in tool_calls {
                blocks.push(json!({
                    "type": "tool_use",
                    "id": c.id,
                    "name": c.name,
                    "input": tool_input(&c.arguments),
                }));
            }
            ("assistant", blocks)
        }
        Message::ToolResult {
            call_id,
            content,
            is_error,
            ..
        } => (
            "user",
            vec![json!({
                "type": "tool_result",
                "tool_use_id": call_id,
                "content": content,
                "is_error": is_error,
            })],
        ),
    }
}

/// `tool_use.input` must be an object: malformed (raw) arguments are sent as
/// an empty object; the matching tool result tells the model what was wrong.
fn tool_input(v: &Value) -> Value {
    if v.is_object() { v.clone() } else { json!({}) }
}

/// Parses a 2xx body. `Err` explains why it is not a Messages response.
pub(crate) fn parse_response(
    body: &str,
    configured_model: &str,
) -> Result<ModelResponse, ReplyError> {
    let v: Value = serde_json::from_str(body)?;
    if v.get("type").and_then(Value::as_str) == Some("error") {
        // The documented error shape, should it ever come with a 2xx status.
        return Err(reported_error(v.get("error")));
    }
    let content = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or("no content list")?;
    let mut texts = Vec::new();
    let mut tool_calls = Vec::new();
    for (i, block) in content.iter().enumerate() {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(t) = block.get("text").and_then(Value::as_str) {
                    texts.push(t);
                }
            }
            Some("tool_use") => tool_calls.push(tool_use(block, i)?),
            // thinking, redacted_thinking, server tool blocks...: not ours.
            _ => {}
        }
    }
    Ok(ModelResponse {
        text: Some(texts.join("\n")).filter(|t| !t.is_empty()),
        tool_calls,
        usage: usage(&v),
        model_id: reply_model(&v, configured_model),
        stop_reason: v
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// The documented `{"type": "error", "error": {type, message}}`.
fn reported_error(err: Option<&Value>) -> ReplyError {
    let kind = err
        .and_then(|e| e.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("error");
    let message = err
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .unwrap_or("(no message)");
    ReplyError::Reported {
        kind: Some(kind.to_string()),
        message: message.to_string(),
    }
}

/// A `tool_use` block (content index `i`) as a call. Without an id one is
/// derived from the position, so the same reply always yields the same id.
fn tool_use(block: &Value, i: usize) -> Result<ToolCall, ReplyError> {
    let name = block
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ReplyError::Shape(format!("content[{i}] tool_use has no name")))?;
    let id = block
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| format!("toolu_{i}"));
    let arguments = match block.get("input") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(o @ Value::Object(_)) => o.clone(),
        // Not an object: keep it raw for the caller to report.
        Some(Value::String(raw)) => Value::String(raw.clone()),
        Some(other) => Value::String(other.to_string()),
    };
    Ok(ToolCall {
        id,
        name: name.to_string(),
        arguments,
    })
}

/// Token counts; cached input is still input the run consumed.
fn usage(v: &Value) -> TokenUsage {
    let tokens = |k: &str| usage_count(v, k);
    TokenUsage {
        input_tokens: tokens("input_tokens")
            + tokens("cache_creation_input_tokens")
            + tokens("cache_read_input_tokens"),
        output_tokens: tokens("output_tokens"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ToolDef;

    #[test]
    fn request_maps_history() {
        let req = ModelRequest {
            system: "You are careful.".into(),
            messages: vec![
                Message::user("Refund order 42"),
                Message::Assistant {
                    text: Some("Looking it up.".into()),
                    tool_calls: vec![
                        ToolCall {
                            id: "toolu_a".into(),
                            name: "lookup".into(),
                            arguments: json!({"order": 42}),
                        },
                        ToolCall {
                            id: "toolu_b".into(),
                            name: "lookup".into(),
                            arguments: Value::String("{\"order\": 4".into()),
                        },
                    ],
                },
                Message::ToolResult {
                    call_id: "toolu_a".into(),
                    name: "lookup".into(),
                    content: "{\"total\": 10}".into(),
                    is_error: false,
                },
                Message::ToolResult {
                    call_id: "toolu_b".into(),
                    name: "lookup".into(),
                    content: "arguments are not valid JSON".into(),
                    is_error: true,
                },
                Message::user("bob changed amount from 500 to 300"),
                Message::Assistant {
                    text: None,
                    tool_calls: vec![],
                },
                Message::Assistant {
                    text: Some("Done.".into()),
                    tool_calls: vec![],
                },
            ],
            tools: vec![ToolDef {
                name: "lookup".into(),
                description: "Find an order".into(),
                input_schema: Value::Null,
            }],
            max_output_tokens: None,
        };
        assert_eq!(
            request_body("claude-x", &req, None),
            json!({
                "model": "claude-x",
                "max_tokens": 4096,
                "system": "You are careful.",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Refund order 42"}]},
                    {"role": "assistant", "content": [
                        {"type": "text", "text": "Looking it up."},
                        {"type": "tool_use", "id": "toolu_a", "name": "lookup", "input": {"order": 42}},
                        {"type": "tool_use", "id": "toolu_b", "name": "lookup", "input": {}}
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "{\"total\": 10}", "is_error": false},
                        {"type": "tool_result", "tool_use_id": "toolu_b", "content": "arguments are not valid JSON", "is_error": true},
                        {"type": "text", "text": "bob changed amount from 500 to 300"}
                    ]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}
                ],
                "tools": [{"name": "lookup", "description": "Find an order",
                           "input_schema": {"type": "object", "properties": {}}}]
            })
        );
        assert_eq!(request_body("c", &req, Some(77))["max_tokens"], json!(77));
    }

    #[test]
    fn tool_results_go_before_text_in_a_user_turn() {
        let req = ModelRequest {
            system: String::new(),
            messages: vec![
                Message::Assistant {
                    text: None,
                    tool_calls: vec![ToolCall {
                        id: "t1".into(),
                        name: "x".into(),
                        arguments: json!({}),
                    }],
                },
                Message::user("note"),
                Message::ToolResult {
                    call_id: "t1".into(),
                    name: "x".into(),
                    content: "r".into(),
                    is_error: false,
                },
            ],
            tools: vec![],
            max_output_tokens: None,
        };
        let body = request_body("c", &req, None);
        assert!(body.get("system").is_none());
        assert!(body.get("tools").is_none());
        assert_eq!(body["messages"][1]["content"][0]["type"], "tool_result");
        assert_eq!(body["messages"][1]["content"][1]["text"], "note");
    }

    #[test]
    fn response_with_tool_use() {
        let body = r#"{
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x-20261101",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "I will refund."},
                {"type": "tool_use", "id": "toolu_1", "name": "refund", "input": {"amount": 5}},
                {"type": "tool_use", "id": "toolu_2", "name": "refund", "input": "{\"amount\": "}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 100, "cache_read_input_tokens": 20, "output_tokens": 40}
        }"#;
        let r = parse_response(body, "claude-x").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: Some("I will refund.".into()),
                tool_calls: vec![
                    ToolCall {
                        id: "toolu_1".into(),
                        name: "refund".into(),
                        arguments: json!({"amount": 5})
                    },
                    ToolCall {
                        id: "toolu_2".into(),
                        name: "refund".into(),
                        arguments: Value::String("{\"amount\": ".into())
                    },
                ],
                usage: TokenUsage {
                    input_tokens: 120,
                    output_tokens: 40
                },
                model_id: "claude-x-20261101".into(),
                stop_reason: Some("tool_use".into()),
            }
        );
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(parse_response("not json", "m").is_err());
        assert!(parse_response(r#"{"type": "message"}"#, "m").is_err());
        assert!(parse_response(r#"{"content": [{"type": "tool_use", "id": "x"}]}"#, "m").is_err());
        let empty = parse_response(r#"{"content": [], "stop_reason": "end_turn"}"#, "m").unwrap();
        assert_eq!(empty.text, None);
        assert_eq!(empty.model_id, "m");
    }

    // ---- Golden fixtures: Anthropic's published docs (testdata/README.md).

    const DOC_TOOL_USE_REQUEST: &str =
        include_str!("testdata/anthropic-messages-tool-use.request.json");
    const DOC_TOOL_USE_RESPONSE: &str =
        include_str!("testdata/anthropic-messages-tool-use.response.json");
    const DOC_TOOL_RESULT_REQUEST: &str =
        include_str!("testdata/anthropic-messages-tool-result.request.json");
    const DOC_TOOL_ERROR_MESSAGE: &str =
        include_str!("testdata/anthropic-messages-tool-error.message.json");
    const DOC_END_TURN_RESPONSE: &str =
        include_str!("testdata/anthropic-messages-end-turn.response.json");
    const DOC_ERROR_RESPONSE: &str = include_str!("testdata/anthropic-error.response.json");

    fn doc(text: &str) -> Value {
        serde_json::from_str(text).expect("fixture is JSON")
    }

    /// A message's `content` string is documented shorthand for one `text`
    /// block, which is what the client always sends: compare in block form.
    fn blocks_form(mut body: Value) -> Value {
        if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
            for m in messages {
                if let Some(text) = m.get("content").and_then(Value::as_str) {
                    m["content"] = json!([{"type": "text", "text": text}]);
                }
            }
        }
        body
    }

    fn client(model: &str, max_output_tokens: u32) -> crate::model::ModelClient {
        let spec = crate::api::ModelSpec {
            provider: crate::api::Provider::Anthropic,
            name: model.into(),
            max_output_tokens: Some(max_output_tokens),
            ..Default::default()
        };
        crate::model::ModelClient::new(&spec, None).unwrap()
    }

    fn doc_weather_tool() -> ToolDef {
        let t = &doc(DOC_TOOL_USE_REQUEST)["tools"][0];
        ToolDef {
            name: t["name"].as_str().unwrap().into(),
            description: t["description"].as_str().unwrap().into(),
            input_schema: t["input_schema"].clone(),
        }
    }

    fn doc_question() -> Message {
        Message::user(
            doc(DOC_TOOL_USE_REQUEST)["messages"][0]["content"]
                .as_str()
                .unwrap(),
        )
    }

    /// `is_error: false` is the documented default of a `tool_result`; the
    /// client states it, the docs' examples leave it out.
    fn allow_is_error_false() -> Vec<(&'static str, Value)> {
        vec![("is_error", json!(false))]
    }

    #[test]
    fn golden_request_with_tools_matches_the_docs() {
        let req = ModelRequest {
            system: String::new(),
            messages: vec![doc_question()],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let ours = client("claude-opus-4-6", 1024).request_body(&req);
        crate::model::wire_compare::assert_matches(
            &blocks_form(doc(DOC_TOOL_USE_REQUEST)),
            &ours,
            &Default::default(),
        );
    }

    #[test]
    fn golden_tool_use_response_parses() {
        let r = parse_response(DOC_TOOL_USE_RESPONSE, "claude").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: Some("I'll check the current weather in San Francisco for you.".into()),
                tool_calls: vec![ToolCall {
                    id: "toolu_01A09q90qw90lq917835lq9".into(),
                    name: "get_weather".into(),
                    arguments: json!({"location": "San Francisco, CA", "unit": "celsius"}),
                }],
                // The documented example shows no usage.
                usage: TokenUsage::default(),
                model_id: "claude-opus-4-6".into(),
                stop_reason: Some("tool_use".into()),
            }
        );
    }

    #[test]
    fn golden_follow_up_request_links_the_tool_result() {
        let answer = parse_response(DOC_TOOL_USE_RESPONSE, "claude").unwrap();
        let fixture = doc(DOC_TOOL_RESULT_REQUEST);
        let req = ModelRequest {
            system: String::new(),
            messages: vec![
                doc_question(),
                Message::Assistant {
                    text: answer.text.clone(),
                    tool_calls: answer.tool_calls.clone(),
                },
                Message::ToolResult {
                    call_id: answer.tool_calls[0].id.clone(),
                    name: answer.tool_calls[0].name.clone(),
                    content: "15 degrees".into(),
                    is_error: false,
                },
            ],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let ours = client("claude-opus-4-6", 1024).request_body(&req);
        crate::model::wire_compare::assert_matches(
            &blocks_form(fixture),
            &ours,
            &crate::model::wire_compare::Allow {
                ours_default: &allow_is_error_false(),
                ..Default::default()
            },
        );
        assert_eq!(
            ours["messages"][2]["content"][0]["tool_use_id"],
            ours["messages"][1]["content"][1]["id"]
        );
    }

    #[test]
    fn golden_tool_error_result_matches_the_docs() {
        let req = ModelRequest {
            system: String::new(),
            messages: vec![
                doc_question(),
                Message::Assistant {
                    text: None,
                    tool_calls: vec![ToolCall {
                        id: "toolu_01A09q90qw90lq917835lq9".into(),
                        name: "get_weather".into(),
                        arguments: json!({"location": "San Francisco, CA"}),
                    }],
                },
                Message::ToolResult {
                    call_id: "toolu_01A09q90qw90lq917835lq9".into(),
                    name: "get_weather".into(),
                    content: "ConnectionError: the weather service API is not available (HTTP 500)"
                        .into(),
                    is_error: true,
                },
            ],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let ours = request_body("claude-opus-4-6", &req, Some(1024));
        crate::model::wire_compare::assert_matches(
            &doc(DOC_TOOL_ERROR_MESSAGE),
            &ours["messages"][2],
            &Default::default(),
        );
    }

    #[test]
    fn golden_end_turn_response_parses_with_usage() {
        let r = parse_response(DOC_END_TURN_RESPONSE, "claude-configured").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: Some("Here's the answer to your question...".into()),
                tool_calls: vec![],
                usage: TokenUsage {
                    input_tokens: 100,
                    output_tokens: 50
                },
                // The example has no `model`: the configured name stands in.
                model_id: "claude-configured".into(),
                stop_reason: Some("end_turn".into()),
            }
        );
    }

    #[test]
    fn golden_error_body_is_reported_with_its_message() {
        assert_eq!(
            crate::model::error_message(DOC_ERROR_RESPONSE),
            "The requested resource could not be found."
        );
        // And should it come with a 2xx status, it is no empty reply.
        let err = parse_response(DOC_ERROR_RESPONSE, "m")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not_found_error") && err.contains("could not be found"),
            "{err}"
        );
    }

    #[test]
    fn only_tool_use_and_several_of_them() {
        let r = parse_response(
            r#"{"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-x",
                "content": [
                    {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"location": "Paris"}},
                    {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {"timezone": "Europe/Paris"}}
                ],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 400, "output_tokens": 90}}"#,
            "claude",
        )
        .unwrap();
        assert_eq!(r.text, None);
        let calls: Vec<(&str, &str)> = r
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str()))
            .collect();
        assert_eq!(calls, [("toolu_a", "get_weather"), ("toolu_b", "get_time")]);
        assert_eq!(
            r.tool_calls[1].arguments,
            json!({"timezone": "Europe/Paris"})
        );
        assert_eq!(r.stop_reason.as_deref(), Some("tool_use"));
        // Both results go back in one user turn, in order, before any text.
        let req = ModelRequest {
            system: String::new(),
            messages: vec![
                Message::Assistant {
                    text: None,
                    tool_calls: r.tool_calls.clone(),
                },
                Message::ToolResult {
                    call_id: "toolu_a".into(),
                    name: "get_weather".into(),
                    content: "12C".into(),
                    is_error: false,
                },
                Message::ToolResult {
                    call_id: "toolu_b".into(),
                    name: "get_time".into(),
                    content: "10:00".into(),
                    is_error: false,
                },
            ],
            tools: vec![],
            max_output_tokens: None,
        };
        let body = request_body("c", &req, None);
        let turn = &body["messages"][1];
        assert_eq!(turn["role"], "user");
        assert_eq!(turn["content"][0]["tool_use_id"], "toolu_a");
        assert_eq!(turn["content"][1]["tool_use_id"], "toolu_b");
    }

    #[test]
    fn end_turn_and_max_tokens_stop_reasons() {
        for reason in ["end_turn", "max_tokens"] {
            let body = format!(
                r#"{{"id": "msg_3", "type": "message", "role": "assistant", "model": "claude-x",
                    "content": [{{"type": "text", "text": "partial answer"}}],
                    "stop_reason": "{reason}", "stop_sequence": null,
                    "usage": {{"input_tokens": 10, "output_tokens": 1024}}}}"#
            );
            let r = parse_response(&body, "claude").unwrap();
            assert_eq!(r.stop_reason.as_deref(), Some(reason));
            assert_eq!(r.text.as_deref(), Some("partial answer"));
            assert!(r.tool_calls.is_empty());
        }
        // Cut off in the middle of a tool call: the block is still whole JSON.
        let r = parse_response(
            r#"{"content": [{"type": "tool_use", "id": "toolu_c", "name": "write", "input": {}}],
                "stop_reason": "max_tokens"}"#,
            "claude",
        )
        .unwrap();
        assert_eq!(r.stop_reason.as_deref(), Some("max_tokens"));
        assert_eq!(r.tool_calls[0].arguments, json!({}));
    }
}
