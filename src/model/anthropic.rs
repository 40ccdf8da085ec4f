//! Anthropic Messages wire format.

use serde_json::{Value, json};

use super::{
    ANTHROPIC_DEFAULT_MAX_TOKENS, Message, ModelRequest, ModelResponse, TokenUsage, ToolCall,
    schema_or_object,
};

/// The request body. Consecutive messages of one role are merged into one
/// turn (tool results of one assistant turn share a user message); in a user
/// turn the `tool_result` blocks come first, as the API requires.
pub(crate) fn request_body(
    model: &str,
    req: &ModelRequest,
    max_output_tokens: Option<u32>,
) -> Value {
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in &req.messages {
        let (role, blocks) = match m {
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
        };
        if blocks.is_empty() {
            // An empty turn is refused by the API; it carries nothing anyway.
            continue;
        }
        match turns.last_mut() {
            Some((r, existing)) if *r == role => existing.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let messages: Vec<Value> = turns
        .into_iter()
        .map(|(role, mut blocks)| {
            if role == "user" {
                // Stable: tool results first, everything else after, in order.
                blocks.sort_by_key(|b| b["type"] != "tool_result");
            }
            json!({"role": role, "content": blocks})
        })
        .collect();
    let mut body = json!({
        "model": model,
        "max_tokens": max_output_tokens.unwrap_or(ANTHROPIC_DEFAULT_MAX_TOKENS),
        "messages": messages,
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

/// `tool_use.input` must be an object: malformed (raw) arguments are sent as
/// an empty object; the matching tool result tells the model what was wrong.
fn tool_input(v: &Value) -> Value {
    if v.is_object() { v.clone() } else { json!({}) }
}

/// Parses a 2xx body. `Err` explains why it is not a Messages response.
pub(crate) fn parse_response(body: &str, configured_model: &str) -> Result<ModelResponse, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))?;
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
            Some("tool_use") => {
                let name = block
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("content[{i}] tool_use has no name"))?;
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
                tool_calls.push(ToolCall {
                    id,
                    name: name.to_string(),
                    arguments,
                });
            }
            // thinking, redacted_thinking, server tool blocks...: not ours.
            _ => {}
        }
    }
    let text = Some(texts.join("\n")).filter(|t| !t.is_empty());
    let usage = v.get("usage");
    let tokens = |k: &str| {
        usage
            .and_then(|u| u.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    Ok(ModelResponse {
        text,
        tool_calls,
        usage: TokenUsage {
            // Cached input is still input the run consumed.
            input_tokens: tokens("input_tokens")
                + tokens("cache_creation_input_tokens")
                + tokens("cache_read_input_tokens"),
            output_tokens: tokens("output_tokens"),
        },
        model_id: v
            .get("model")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or(configured_model)
            .to_string(),
        stop_reason: v
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
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
}
