//! OpenAI-compatible chat completions wire format.

use serde_json::{Value, json};

use super::{
    Message, ModelRequest, ModelResponse, ReplyError, TokenUsage, ToolCall, ToolDef,
    arguments_from_str, reply_model, schema_or_object, usage_count,
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
    messages.extend(req.messages.iter().filter_map(message_json));
    let mut body = json!({"model": model, "messages": messages});
    if !req.tools.is_empty() {
        body["tools"] = req.tools.iter().map(tool_json).collect();
        // `auto` is what OpenAI assumes whenever tools are present, so saying
        // it changes nothing there; llama-cpp-python's server
        // (`chatml-function-calling`) ignores `tools` unless it is said.
        body["tool_choice"] = json!("auto");
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

/// One history message on the wire; `None` for an assistant turn that says
/// nothing (content is required without tool calls, and would be empty).
fn message_json(m: &Message) -> Option<Value> {
    Some(match m {
        Message::User { text } => json!({"role": "user", "content": text}),
        Message::Assistant { text, tool_calls }
            if tool_calls.is_empty() && text.as_deref().is_none_or(str::is_empty) =>
        {
            return None;
        }
        Message::Assistant { text, tool_calls } => assistant_json(text.as_deref(), tool_calls),
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
    })
}

/// An assistant turn, with the calls it made.
fn assistant_json(text: Option<&str>, tool_calls: &[ToolCall]) -> Value {
    // A string, never null: OpenAI allows null beside tool calls,
    // but llama-cpp-python's server (content: NotRequired[str])
    // refuses it with 500; "" is a string every server takes.
    let mut msg = json!({
        "role": "assistant",
        "content": text.unwrap_or(""),
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

/// A tool offered to the model, as a `function` tool.
fn tool_json(t: &ToolDef) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": t.name,
            "description": t.description,
            "parameters": schema_or_object(&t.input_schema),
        },
    })
}

/// Arguments as the JSON string the format carries; raw (malformed) arguments
/// are sent back exactly as the model produced them.
/// `function.arguments` for a recorded call. Raw arguments the model sent
/// that are not JSON (a reply cut off mid-call) go back as a JSON string
/// holding them: llama.cpp's server refuses a history whose arguments do not
/// parse (HTTP 500), and the text stays what the model wrote.
fn arguments_string(v: &Value) -> String {
    match v {
        Value::String(raw) if serde_json::from_str::<Value>(raw).is_ok() => raw.clone(),
        other => other.to_string(),
    }
}

/// One call from a `function` object (`{"name", "arguments"}`). `id` is the
/// call's own id; without one (some compatible servers, the legacy
/// `function_call`) the id is derived from the response id and the call's
/// position, so the same reply always yields the same id (recorded replies
/// are replayed) and calls of different replies do not share one.
fn function_to_call(
    f: &Value,
    id: Option<&Value>,
    response_id: Option<&str>,
    index: usize,
    what: &str,
) -> Result<ToolCall, ReplyError> {
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ReplyError::Shape(format!("{what} has no name")))?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(raw)) => arguments_from_str(raw),
        // Lenient servers (Ollama-style) send the object itself.
        Some(o @ Value::Object(_)) => o.clone(),
        Some(other) => Value::String(other.to_string()),
    };
    let id = id
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| match response_id {
            Some(r) => format!("call_{r}_{index}"),
            None => format!("call_{index}"),
        });
    Ok(ToolCall {
        id,
        name: name.to_string(),
        arguments,
    })
}

/// Parses a 2xx body. `Err` explains why it is not a chat completion.
pub(crate) fn parse_response(
    body: &str,
    configured_model: &str,
) -> Result<ModelResponse, ReplyError> {
    let v: Value = serde_json::from_str(body)?;
    if v.get("choices").is_none()
        && let Some(err) = v.get("error").filter(|e| !e.is_null())
    {
        return Err(reported_error(err));
    }
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or("no choices[0]")?;
    let message = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or("no choices[0].message")?;
    let text = message_text(message)?;
    let response_id = v
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    let tool_calls = message_tool_calls(message, response_id)?;
    Ok(ModelResponse {
        text,
        tool_calls,
        usage: usage(&v),
        model_id: reply_model(&v, configured_model),
        stop_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// An error object (or string) some compatible servers and proxies answer
/// with a 2xx status.
fn reported_error(err: &Value) -> ReplyError {
    let message = match err {
        Value::String(s) => s.as_str(),
        _ => err
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("(no message)"),
    };
    ReplyError::Reported {
        kind: None,
        message: message.to_string(),
    }
}

/// The message's text: its content, else a refusal; `None` when empty.
fn message_text(message: &Value) -> Result<Option<String>, ReplyError> {
    let content = match message.get("content") {
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
    };
    Ok(content
        .or_else(|| {
            message
                .get("refusal")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .filter(|t| !t.is_empty()))
}

/// The calls the message makes: `tool_calls`, else the legacy single
/// `function_call`.
fn message_tool_calls(
    message: &Value,
    response_id: Option<&str>,
) -> Result<Vec<ToolCall>, ReplyError> {
    let mut tool_calls = Vec::new();
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (i, c) in calls.iter().enumerate() {
                let f = c
                    .get("function")
                    .filter(|f| f.is_object())
                    .ok_or_else(|| ReplyError::Shape(format!("tool_calls[{i}] has no function")))?;
                tool_calls.push(function_to_call(
                    f,
                    c.get("id"),
                    response_id,
                    i,
                    &format!("tool_calls[{i}].function"),
                )?);
            }
        }
        Some(_) => return Err("choices[0].message.tool_calls is not a list".into()),
    }
    // The legacy single `function_call` (deprecated by `tool_calls`; still
    // sent by older servers, and by llama-cpp-python beside `tool_calls`,
    // where it repeats the one call): used only when there is no tool call,
    // and only when it names a function (anything else was ignored before).
    if tool_calls.is_empty()
        && let Some(f) = message
            .get("function_call")
            .filter(|f| f.get("name").is_some_and(Value::is_string))
    {
        tool_calls.push(function_to_call(f, None, response_id, 0, "function_call")?);
    }
    Ok(tool_calls)
}

/// Token counts; a server that reports none counts as zero.
fn usage(v: &Value) -> TokenUsage {
    let tokens = |k: &str| usage_count(v, k);
    TokenUsage {
        input_tokens: tokens("prompt_tokens"),
        output_tokens: tokens("completion_tokens"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ToolDef;

    #[test]
    fn arguments_cut_off_mid_call_go_back_as_valid_json_llama_cpp() {
        // llama-server answers 500 to a history whose arguments do not parse.
        let cut = r#"{"orderId": "1042""#;
        let sent = arguments_string(&Value::String(cut.into()));
        let parsed: Value = serde_json::from_str(&sent).expect("valid JSON");
        assert_eq!(parsed, Value::String(cut.into()), "the model's text, kept");
        // Raw text that is JSON (a model's own formatting) goes back as it came.
        let pretty = "{\n  \"orderId\": \"1042\"\n}";
        assert_eq!(arguments_string(&Value::String(pretty.into())), pretty);
        assert_eq!(arguments_string(&json!({"a": 1})), r#"{"a":1}"#);
    }

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
                        {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": "\"{\\\"order\\\": 4\""}}
                    ]},
                    {"role": "tool", "tool_call_id": "call_a", "content": "{\"total\": 10}"},
                    {"role": "tool", "tool_call_id": "call_b", "content": "ERROR: arguments are not valid JSON"}
                ],
                "tools": [{"type": "function", "function": {
                    "name": "lookup", "description": "Find an order",
                    "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}}
                }}],
                "tool_choice": "auto",
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

    // ---- Golden fixtures: OpenAI's published API reference (testdata/README.md).

    const DOC_TOOL_CALL_REQUEST: &str = include_str!("testdata/openai-chat-tool-call.request.json");
    const DOC_TOOL_CALL_RESPONSE: &str =
        include_str!("testdata/openai-chat-tool-call.response.json");
    const DOC_TOOL_RESULT_REQUEST: &str =
        include_str!("testdata/openai-chat-tool-result.request.json");
    const DOC_FUNCTION_CALL_RESPONSE: &str =
        include_str!("testdata/openai-chat-function-call.response.json");
    const LLAMA_CPP_PYTHON_RESPONSE: &str =
        include_str!("testdata/llama-cpp-python-chatml-function-calling.response.json");

    fn doc(text: &str) -> Value {
        serde_json::from_str(text).expect("fixture is JSON")
    }

    /// The client OpenAI's own endpoint gets (no `endpoint` in the spec).
    fn official_client(model: &str) -> crate::model::ModelClient {
        let spec = crate::api::ModelSpec {
            provider: crate::api::Provider::OpenAI,
            name: model.into(),
            ..Default::default()
        };
        crate::model::ModelClient::new(&spec, None).unwrap()
    }

    /// The documented tool, as our `ToolDef`.
    fn doc_weather_tool() -> ToolDef {
        let req = doc(DOC_TOOL_CALL_REQUEST);
        let f = &req["tools"][0]["function"];
        ToolDef {
            name: f["name"].as_str().unwrap().into(),
            description: f["description"].as_str().unwrap().into(),
            input_schema: f["parameters"].clone(),
        }
    }

    fn doc_user_question() -> Message {
        Message::user(
            doc(DOC_TOOL_CALL_REQUEST)["messages"][0]["content"]
                .as_str()
                .unwrap(),
        )
    }

    #[test]
    fn golden_request_with_tools_matches_the_reference() {
        let req = ModelRequest {
            system: String::new(),
            messages: vec![doc_user_question()],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let ours = official_client("gpt-4o").request_body(&req);
        crate::model::wire_compare::assert_matches(
            &doc(DOC_TOOL_CALL_REQUEST),
            &ours,
            &Default::default(),
        );
        // Streaming is off: the client never asks for it.
        assert!(ours.get("stream").is_none());
    }

    #[test]
    fn golden_tool_call_response_parses() {
        let r = parse_response(DOC_TOOL_CALL_RESPONSE, "gpt-4o").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: None,
                tool_calls: vec![ToolCall {
                    id: "call_abc123".into(),
                    name: "get_current_weather".into(),
                    arguments: json!({"location": "Boston, MA"}),
                }],
                usage: TokenUsage {
                    input_tokens: 82,
                    output_tokens: 17
                },
                model_id: "gpt-4o-mini".into(),
                stop_reason: Some("tool_calls".into()),
            }
        );
    }

    #[test]
    fn golden_follow_up_request_links_the_tool_result() {
        // The conversation of the reference: the question, the model's call
        // exactly as parsed from the documented response, then its result.
        let answer = parse_response(DOC_TOOL_CALL_RESPONSE, "gpt-4o").unwrap();
        let fixture = doc(DOC_TOOL_RESULT_REQUEST);
        let result = &fixture["messages"][2];
        let req = ModelRequest {
            system: String::new(),
            messages: vec![
                doc_user_question(),
                Message::Assistant {
                    text: answer.text.clone(),
                    tool_calls: answer.tool_calls.clone(),
                },
                Message::ToolResult {
                    call_id: answer.tool_calls[0].id.clone(),
                    name: answer.tool_calls[0].name.clone(),
                    content: result["content"].as_str().unwrap().into(),
                    is_error: false,
                },
            ],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let ours = official_client("gpt-4o").request_body(&req);
        // The reference sends the answer's `content: null` back; we send ""
        // (the schema's "string", which llama-cpp-python requires).
        let allow = crate::model::wire_compare::Allow {
            null_sent_as: &[("content", json!(""))],
            ..Default::default()
        };
        crate::model::wire_compare::assert_matches(&fixture, &ours, &allow);
        assert_eq!(
            ours["messages"][2]["tool_call_id"],
            ours["messages"][1]["tool_calls"][0]["id"]
        );
    }

    #[test]
    fn golden_legacy_function_call_response_becomes_one_call() {
        // Earlier revision of the reference: `function_call`, no `tool_calls`,
        // and no response id at all.
        let r = parse_response(DOC_FUNCTION_CALL_RESPONSE, "gpt-3.5-turbo").unwrap();
        assert_eq!(
            r,
            ModelResponse {
                text: None,
                tool_calls: vec![ToolCall {
                    id: "call_0".into(),
                    name: "get_current_weather".into(),
                    arguments: json!({"location": "Boston, MA"}),
                }],
                usage: TokenUsage {
                    input_tokens: 82,
                    output_tokens: 18
                },
                model_id: "gpt-3.5-turbo-0613".into(),
                stop_reason: Some("function_call".into()),
            }
        );
    }

    #[test]
    fn wire_compare_reports_what_differs() {
        let d = crate::model::wire_compare::diff(
            &json!({"a": {"arguments": "{\"x\": 1}", "b": [1, 2]}, "gone": 1}),
            &json!({"a": {"arguments": "{\"x\":1}", "b": [1, 3]}, "extra": true}),
            &Default::default(),
        );
        assert_eq!(
            d,
            vec![
                "$.a.b[1]: documented 2, sent 3",
                "$.gone: documented, not sent",
                "$.extra: sent (true), not documented",
            ]
        );
    }

    // ---- OpenAI-compatible servers as they behave.

    #[test]
    fn llama_cpp_python_gets_tool_choice_auto_with_tools_only() {
        // llama-cpp-python (`--chat_format chatml-function-calling`) renders
        // the tools into the prompt only when `tool_choice` is given.
        let with_tools = ModelRequest {
            system: String::new(),
            messages: vec![Message::user("hi")],
            tools: vec![doc_weather_tool()],
            max_output_tokens: None,
        };
        let body = request_body("local", &with_tools, None, false);
        assert_eq!(body["tool_choice"], "auto");
        let without = ModelRequest {
            tools: vec![],
            ..with_tools
        };
        let body = request_body("local", &without, None, false);
        assert!(body.get("tool_choice").is_none());
        assert!(body.get("tools").is_none());
    }

    #[test]
    fn llama_cpp_python_tool_calls_beside_function_call_count_once() {
        let r = parse_response(LLAMA_CPP_PYTHON_RESPONSE, "local").unwrap();
        assert_eq!(
            r.tool_calls,
            vec![ToolCall {
                id: "call__0_get_current_weather_cmpl-5f2b7c1e-8d0a-4c4e-9b7a-3e1f0c9d2a11".into(),
                name: "get_current_weather".into(),
                arguments: json!({"location": "Boston, MA"}),
            }]
        );
        assert_eq!(r.text, None);
        assert_eq!(r.stop_reason.as_deref(), Some("tool_calls"));
        assert_eq!(
            r.usage,
            TokenUsage {
                input_tokens: 151,
                output_tokens: 12
            }
        );
        assert_eq!(r.model_id, "./models/qwen2.5-7b-instruct-q4_k_m.gguf");
    }

    #[test]
    fn tool_calls_win_over_a_different_function_call() {
        let r = parse_response(
            r#"{"id": "x", "choices": [{"message": {"content": null,
                "tool_calls": [{"id": "call_t", "type": "function", "function": {"name": "a", "arguments": "{}"}}],
                "function_call": {"name": "b", "arguments": "{}"}}}]}"#,
            "m",
        )
        .unwrap();
        assert_eq!(r.tool_calls.len(), 1);
        assert_eq!(r.tool_calls[0].name, "a");
    }

    #[test]
    fn ollama_style_arguments_as_an_object() {
        // Ollama's OpenAI endpoint and other lenient servers may send the
        // arguments object itself instead of its JSON text.
        let body = r#"{"id": "chatcmpl-42", "object": "chat.completion", "model": "llama3.1:8b",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "",
                "tool_calls": [{"id": "call_x1", "index": 0, "type": "function",
                    "function": {"name": "get_current_weather", "arguments": {"location": "Paris", "unit": "celsius"}}}]}}],
            "usage": {"prompt_tokens": 90, "completion_tokens": 21, "total_tokens": 111}}"#;
        let r = parse_response(body, "llama3.1").unwrap();
        assert_eq!(r.text, None, "empty content is no text");
        assert_eq!(
            r.tool_calls,
            vec![ToolCall {
                id: "call_x1".into(),
                name: "get_current_weather".into(),
                arguments: json!({"location": "Paris", "unit": "celsius"}),
            }]
        );
        assert!(r.tool_calls[0].arguments_are_valid());
        // Sent back as the JSON text the format carries.
        let req = ModelRequest {
            system: String::new(),
            messages: vec![Message::Assistant {
                text: None,
                tool_calls: r.tool_calls.clone(),
            }],
            tools: vec![],
            max_output_tokens: None,
        };
        let sent = &request_body("m", &req, None, false)["messages"][0];
        assert_eq!(
            sent["content"],
            json!(""),
            "a tool-call turn without text sends a string, not null"
        );
        let args = &sent["tool_calls"][0]["function"]["arguments"];
        assert_eq!(
            serde_json::from_str::<Value>(args.as_str().unwrap()).unwrap(),
            json!({"location": "Paris", "unit": "celsius"})
        );
    }

    #[test]
    fn calls_without_id_or_type_get_stable_ids() {
        // Some local servers leave out `id` (or send "") and `type`.
        let body = r#"{"id": "chatcmpl-7", "choices": [{"finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null,
            "tool_calls": [
                {"function": {"name": "a", "arguments": "{\"n\": 1}"}},
                {"id": "", "function": {"name": "b", "arguments": "{\"n\": 2}"}},
                {"id": "call_own", "function": {"name": "c"}}
            ]}}]}"#;
        let r = parse_response(body, "m").unwrap();
        let ids: Vec<&str> = r.tool_calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call_chatcmpl-7_0", "call_chatcmpl-7_1", "call_own"]);
        assert_eq!(r.tool_calls[2].arguments, json!({}));
        // Deterministic: a replayed reply yields the same ids.
        assert_eq!(parse_response(body, "m").unwrap(), r);
        // Without a response id either: the call's position.
        let r = parse_response(
            r#"{"choices": [{"message": {"tool_calls": [{"function": {"name": "a"}}]}}]}"#,
            "m",
        )
        .unwrap();
        assert_eq!(r.tool_calls[0].id, "call_0");
    }

    #[test]
    fn vllm_finish_reason_stop_with_tool_calls() {
        // vLLM may report "stop" (or "tool_calls") for a turn with tool calls:
        // the calls count either way, the reason is kept verbatim.
        for reason in ["stop", "tool_calls"] {
            let body = format!(
                r#"{{"id": "chatcmpl-v", "object": "chat.completion", "model": "Qwen/Qwen2.5-7B-Instruct",
                "choices": [{{"index": 0, "finish_reason": "{reason}", "stop_reason": null, "logprobs": null,
                    "message": {{"role": "assistant", "content": null, "reasoning_content": null,
                        "tool_calls": [{{"id": "chatcmpl-tool-1a2b", "type": "function",
                            "function": {{"name": "get_current_weather", "arguments": "{{\"location\": \"Boston, MA\"}}"}}}}]}}}}],
                "usage": {{"prompt_tokens": 300, "total_tokens": 320, "completion_tokens": 20, "prompt_tokens_details": null}}}}"#
            );
            let r = parse_response(&body, "qwen").unwrap();
            assert_eq!(r.stop_reason.as_deref(), Some(reason));
            assert_eq!(r.tool_calls.len(), 1);
            assert_eq!(r.tool_calls[0].id, "chatcmpl-tool-1a2b");
            assert_eq!(r.tool_calls[0].arguments, json!({"location": "Boston, MA"}));
            assert_eq!(
                r.usage,
                TokenUsage {
                    input_tokens: 300,
                    output_tokens: 20
                }
            );
        }
    }

    #[test]
    fn usage_missing_or_with_extra_fields() {
        let none = parse_response(
            r#"{"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}"#,
            "m",
        )
        .unwrap();
        assert_eq!(none.usage, TokenUsage::default());
        let null = parse_response(
            r#"{"choices": [{"message": {"content": "hi"}}], "usage": null}"#,
            "m",
        )
        .unwrap();
        assert_eq!(null.usage, TokenUsage::default());
        let extra = parse_response(
            r#"{"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 5,
                "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2},
                "completion_tokens_details": {"reasoning_tokens": 3}, "queue_time": 0.01}}"#,
            "m",
        )
        .unwrap();
        assert_eq!(
            extra.usage,
            TokenUsage {
                input_tokens: 5,
                output_tokens: 7
            }
        );
    }

    #[test]
    fn error_object_with_a_2xx_status_is_reported_with_its_message() {
        let err = parse_response(
            r#"{"error": {"message": "model 'x' not found", "type": "invalid_request_error", "param": null, "code": null}}"#,
            "m",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("model 'x' not found"), "{err}");
        let err = parse_response(r#"{"error": "backend crashed"}"#, "m")
            .unwrap_err()
            .to_string();
        assert!(err.contains("backend crashed"), "{err}");
    }
}
