//! OpenAI-compatible chat completions wire format.

use serde_json::{Value, json};

use super::{
    Message, ModelRequest, ModelResponse, TokenUsage, ToolCall, arguments_from_str,
    schema_or_object,
};

/// Prefix put before the content of a failed tool's result (the format has no
/// error flag).
pub(crate) const ERROR_PREFIX: &str = "ERROR: ";

/// The request body. `official` selects `max_completion_tokens` (what OpenAI's
/// own API expects) over `max_tokens` (what compatible servers understand).
pub(crate) fn request_body(
    model: &str,
    req: &ModelRequest,
    max_output_tokens: Option<u32>,
    official: bool,
) -> Value {
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if !req.system.is_empty() {
        messages.push(json!({"role": "system", "content": req.system}));
    }
    for m in &req.messages {
        messages.push(match m {
            Message::User { text } => json!({"role": "user", "content": text}),
            Message::Assistant { text, tool_calls }
                if tool_calls.is_empty() && text.as_deref().is_none_or(str::is_empty) =>
            {
                // Content is required without tool calls; an empty turn says nothing.
                continue;
            }
            Message::Assistant { text, tool_calls } => {
                let mut msg = json!({
                    "role": "assistant",
                    "content": text.as_deref().filter(|t| !t.is_empty()),
                });
                if !tool_calls.is_empty() {
                    msg["tool_calls"] = tool_calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.name, "arguments": arguments_string(&c.arguments)},
                            })
                        })
                        .collect();
                }
                msg
            }
            Message::ToolResult {
                call_id,
                content,
                is_error,
                ..
            } => {
                let content = if *is_error {
                    format!("{ERROR_PREFIX}{content}")
                } else {
                    content.clone()
                };
                json!({"role": "tool", "tool_call_id": call_id, "content": content})
            }
        });
    }
    let mut body = json!({"model": model, "messages": messages});
    if !req.tools.is_empty() {
        body["tools"] = req
            .tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": schema_or_object(&t.input_schema),
                    },
                })
            })
            .collect();
    }
    if let Some(max) = max_output_tokens {
        let field = if official {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        body[field] = json!(max);
    }
    body
}

/// Arguments as the JSON string the format carries; raw (malformed) arguments
/// are sent back exactly as the model produced them.
fn arguments_string(v: &Value) -> String {
    match v {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    }
}

/// Parses a 2xx body. `Err` explains why it is not a chat completion.
pub(crate) fn parse_response(body: &str, configured_model: &str) -> Result<ModelResponse, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))?;
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or("no choices[0]")?;
    let message = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or("no choices[0].message")?;
    let text = match message.get("content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        // Some compatible servers send content parts.
        Some(Value::Array(parts)) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        ),
        Some(_) => return Err("choices[0].message.content is neither text nor parts".into()),
    }
    .or_else(|| {
        message
            .get("refusal")
            .and_then(Value::as_str)
            .map(str::to_string)
    })
    .filter(|t| !t.is_empty());
    let mut tool_calls = Vec::new();
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (i, c) in calls.iter().enumerate() {
                let f = c
                    .get("function")
                    .ok_or_else(|| format!("tool_calls[{i}] has no function"))?;
                let name = f
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("tool_calls[{i}].function has no name"))?;
                let arguments = match f.get("arguments") {
                    None | Some(Value::Null) => Value::Object(Default::default()),
                    Some(Value::String(raw)) => arguments_from_str(raw),
                    // Lenient servers send the object itself.
                    Some(o @ Value::Object(_)) => o.clone(),
                    Some(other) => Value::String(other.to_string()),
                };
                let id = c
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("call_{i}"));
                tool_calls.push(ToolCall {
                    id,
                    name: name.to_string(),
                    arguments,
                });
            }
        }
        Some(_) => return Err("choices[0].message.tool_calls is not a list".into()),
    }
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
            input_tokens: tokens("prompt_tokens"),
            output_tokens: tokens("completion_tokens"),
        },
        model_id: v
            .get("model")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or(configured_model)
            .to_string(),
        stop_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ToolDef;

    fn history() -> ModelRequest {
        ModelRequest {
            system: "You are careful.".into(),
            messages: vec![
                Message::user("Refund order 42"),
                Message::Assistant {
                    text: Some("Looking it up.".into()),
                    tool_calls: vec![
                        ToolCall {
                            id: "call_a".into(),
                            name: "lookup".into(),
                            arguments: json!({"order": 42}),
                        },
                        ToolCall {
                            id: "call_b".into(),
                            name: "lookup".into(),
                            arguments: Value::String("{\"order\": 4".into()),
                        },
                    ],
                },
                Message::ToolResult {
                    call_id: "call_a".into(),
                    name: "lookup".into(),
                    content: "{\"total\": 10}".into(),
                    is_error: false,
                },
                Message::ToolResult {
                    call_id: "call_b".into(),
                    name: "lookup".into(),
                    content: "arguments are not valid JSON".into(),
                    is_error: true,
                },
                Message::Assistant {
                    text: None,
                    tool_calls: vec![],
                },
            ],
            tools: vec![ToolDef {
                name: "lookup".into(),
                description: "Find an order".into(),
                input_schema: json!({"type": "object", "properties": {"order": {"type": "integer"}}}),
            }],
            max_output_tokens: None,
        }
    }

    #[test]
    fn request_maps_history() {
        let body = request_body("gpt-x", &history(), Some(300), false);
        assert_eq!(
            body,
            json!({
                "model": "gpt-x",
                "messages": [
                    {"role": "system", "content": "You are careful."},
                    {"role": "user", "content": "Refund order 42"},
                    {"role": "assistant", "content": "Looking it up.", "tool_calls": [
                        {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": "{\"order\":42}"}},
                        {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": "{\"order\": 4"}}
                    ]},
                    {"role": "tool", "tool_call_id": "call_a", "content": "{\"total\": 10}"},
                    {"role": "tool", "tool_call_id": "call_b", "content": "ERROR: arguments are not valid JSON"}
                ],
                "tools": [{"type": "function", "function": {
                    "name": "lookup", "description": "Find an order",
                    "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}}
                }}],
                "max_tokens": 300
            })
        );
        let official = request_body("gpt-x", &history(), Some(300), true);
        assert_eq!(official["max_completion_tokens"], json!(300));
        assert!(official.get("max_tokens").is_none());
        let bare = request_body(
            "m",
            &ModelRequest {
                system: String::new(),
                messages: vec![Message::user("hi")],
                tools: vec![],
                max_output_tokens: None,
            },
            None,
            true,
        );
        assert_eq!(
            bare,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        );
    }

    #[test]
    fn response_with_tool_calls() {
        let body = r#"{
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-x-2026-01-01",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "refund", "arguments": "{\"amount\": 5}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "refund", "arguments": "{\"amount\": "}}
                ]}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150}
        }"#;
        let r = parse_response(body, "gpt-x").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: None,
                tool_calls: vec![
                    ToolCall {
                        id: "call_1".into(),
                        name: "refund".into(),
                        arguments: json!({"amount": 5})
                    },
                    ToolCall {
                        id: "call_2".into(),
                        name: "refund".into(),
                        arguments: Value::String("{\"amount\": ".into())
                    },
                ],
                usage: TokenUsage {
                    input_tokens: 120,
                    output_tokens: 30
                },
                model_id: "gpt-x-2026-01-01".into(),
                stop_reason: Some("tool_calls".into()),
            }
        );
    }

    #[test]
    fn response_with_text_only_and_missing_fields() {
        let r = parse_response(
            r#"{"choices":[{"message":{"role":"assistant","content":"done"},"finish_reason":"stop"}]}"#,
            "local-model",
        )
        .unwrap();
        assert_eq!(r.text.as_deref(), Some("done"));
        assert!(r.tool_calls.is_empty());
        assert_eq!(r.usage, TokenUsage::default());
        assert_eq!(r.model_id, "local-model");
        assert_eq!(r.stop_reason.as_deref(), Some("stop"));
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(parse_response("<html>502</html>", "m").is_err());
        assert!(parse_response(r#"{"choices": []}"#, "m").is_err());
        assert!(parse_response(r#"{"choices": [{"message": "hi"}]}"#, "m").is_err());
        assert!(
            parse_response(
                r#"{"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}"#,
                "m"
            )
            .is_err()
        );
    }
}
