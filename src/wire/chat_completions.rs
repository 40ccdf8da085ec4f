//! OpenAI Chat Completions (`POST /v1/chat/completions`), served: an
//! agent's request body as a [`ModelRequest`], a recorded [`ModelResponse`]
//! back as a `chat.completion` object or its `chat.completion.chunk` stream.
//! Also OpenAI's error body, which the Responses API shares.

use serde_json::{Map, Value, json};

use super::answer::{self, Finish};
use super::fields::{self, Conversation, Keys, at, get, index, list, object, string};
use super::{BadRequest, sse};
use crate::model::{ModelRequest, ModelResponse, ToolCall, ToolDef, arguments_from_str};

/// The body's keys. Sampling settings are dropped: the model and how it is
/// sampled are the Agent's spec, not the agent's code.
const BODY: Keys = Keys {
    carried: &[
        "messages",
        "tools",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
    ],
    dropped: &[
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "temperature",
        "top_p",
        "seed",
        "frequency_penalty",
        "presence_penalty",
    ],
    only: &[
        ("tool_choice", |v| v == "auto"),
        ("parallel_tool_calls", |v| v == &Value::Bool(true)),
        ("n", |v| v == 1),
        ("logprobs", |v| v == &Value::Bool(false)),
        ("response_format", |v| v == &json!({"type": "text"})),
        ("modalities", |v| v == &json!(["text"])),
        ("stop", |v| v == &json!([])),
    ],
};

/// The request body as a [`ModelRequest`], or why it cannot be served.
pub fn request(body: &Value) -> Result<ModelRequest, BadRequest> {
    let o = object(body, "")?;
    BODY.check(o, "")?;
    let messages = list(o, "messages", "")?;
    if messages.is_empty() {
        return Err(BadRequest::new(
            "messages",
            "must hold at least one message",
        ));
    }
    let mut system = Vec::new();
    let mut conversation = Conversation::default();
    for (i, m) in messages.iter().enumerate() {
        message(m, &index("messages", i), &mut system, &mut conversation)?;
    }
    Ok(ModelRequest {
        system: fields::join_system(system),
        messages: conversation.messages,
        tools: tools(o)?,
        max_output_tokens: fields::max_tokens(o, &["max_completion_tokens", "max_tokens"])?,
    })
}

/// The `stream` flag.
pub fn streams(body: &Value) -> bool {
    fields::streams(body)
}

/// Whether a stream ends with a usage chunk (`stream_options.include_usage`).
pub fn include_usage(body: &Value) -> bool {
    body.pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true)
}

const TEXT: &[&str] = &["text"];

/// One message of `messages`, at `path`.
fn message(
    m: &Value,
    path: &str,
    system: &mut Vec<String>,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    let o = object(m, path)?;
    let content = || content(o, path);
    match string(o, "role", path)? {
        "system" | "developer" => {
            plain_keys(&["content"]).check(o, path)?;
            system.push(content()?);
        }
        "user" => {
            plain_keys(&["content"]).check(o, path)?;
            conversation.user(content()?);
        }
        "assistant" => assistant(o, path, conversation)?,
        "tool" => {
            plain_keys(&["content", "tool_call_id"]).check(o, path)?;
            let call_id = string(o, "tool_call_id", path)?;
            let field = at(path, "tool_call_id");
            conversation.tool_result(call_id, content()?, false, &field)?;
        }
        other => {
            return Err(BadRequest::new(
                at(path, "role"),
                format!("{other:?} messages are not supported"),
            ));
        }
    }
    Ok(())
}

/// A message's keys: `role`, `carried`, and a participant `name`, which
/// agentrun does not carry (providers use it at most as a hint).
fn plain_keys<'a>(carried: &'a [&'a str]) -> Keys<'a> {
    Keys {
        carried,
        dropped: &["role", "name"],
        only: &[],
    }
}

/// A message's text content (string or text parts), `""` when absent.
fn content(o: &Map<String, Value>, path: &str) -> Result<String, BadRequest> {
    match get(o, "content") {
        None => Ok(String::new()),
        Some(c) => fields::text(c, &at(path, "content"), TEXT),
    }
}

/// An assistant turn: its text and the calls it made.
fn assistant(
    o: &Map<String, Value>,
    path: &str,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    // `annotations` are a provider's citations of its own web search:
    // nothing to carry (the SDK's message objects hold `[]`).
    Keys {
        carried: &["content", "tool_calls"],
        dropped: &["role", "name", "annotations"],
        only: &[],
    }
    .check(o, path)?;
    conversation.assistant(Some(content(o, path)?));
    let calls_path = at(path, "tool_calls");
    for (j, c) in list(o, "tool_calls", path)?.iter().enumerate() {
        conversation.call(tool_call(c, &index(&calls_path, j))?);
    }
    Ok(())
}

/// One of an assistant turn's `tool_calls`.
fn tool_call(c: &Value, path: &str) -> Result<ToolCall, BadRequest> {
    let o = object(c, path)?;
    Keys {
        carried: &["id", "function"],
        dropped: &[],
        only: &[("type", |v| v == "function")],
    }
    .check(o, path)?;
    let f_path = at(path, "function");
    let f = object(o.get("function").unwrap_or(&Value::Null), &f_path)?;
    Ok(ToolCall {
        id: string(o, "id", path)?.to_string(),
        name: string(f, "name", &f_path)?.to_string(),
        arguments: arguments_from_str(fields::opt_string(f, "arguments", &f_path)?.unwrap_or("")),
    })
}

/// The function tools offered (`tools[].function`).
fn tools(o: &Map<String, Value>) -> Result<Vec<ToolDef>, BadRequest> {
    let mut defs = Vec::new();
    for (i, t) in list(o, "tools", "")?.iter().enumerate() {
        let path = index("tools", i);
        let t = object(t, &path)?;
        let kind = string(t, "type", &path)?;
        if kind != "function" {
            return Err(BadRequest::new(
                at(&path, "type"),
                format!("{kind:?} tools are not supported: agentrun serves function tools"),
            ));
        }
        let f_path = at(&path, "function");
        let f = object(t.get("function").unwrap_or(&Value::Null), &f_path)?;
        defs.push(function_tool(f, &f_path)?);
    }
    Ok(defs)
}

/// A function's `name`, `description` and `parameters` (`strict` is
/// dropped: the model is asked for the same schema, not held to it).
pub(crate) fn function_tool(f: &Map<String, Value>, path: &str) -> Result<ToolDef, BadRequest> {
    Keys {
        carried: &["name", "description", "parameters"],
        dropped: &["strict", "type"],
        only: &[],
    }
    .check(f, path)?;
    Ok(ToolDef {
        name: string(f, "name", path)?.to_string(),
        description: fields::opt_string(f, "description", path)?
            .unwrap_or("")
            .to_string(),
        input_schema: get(f, "parameters").cloned().unwrap_or(Value::Null),
    })
}

/// The answer as a `chat.completion` object.
pub fn response(answer: &ModelResponse, model: &str, id: &str, created: i64) -> Value {
    let mut message = json!({
        "role": "assistant",
        "content": content_of(answer),
        "refusal": null,
        "annotations": [],
    });
    if !answer.tool_calls.is_empty() {
        message["tool_calls"] = answer.tool_calls.iter().map(call_json).collect();
    }
    json!({
        "id": completion_id(id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(answer),
        }],
        "usage": usage(answer),
        "system_fingerprint": null,
    })
}

fn completion_id(id: &str) -> String {
    format!("chatcmpl-{id}")
}

/// `content`: the text; `null` beside tool calls without text, `""` for an
/// answer that says nothing at all.
fn content_of(answer: &ModelResponse) -> Value {
    match answer::text(answer) {
        Some(t) => json!(t),
        None if answer.tool_calls.is_empty() => json!(""),
        None => Value::Null,
    }
}

fn call_json(c: &ToolCall) -> Value {
    json!({
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": answer::arguments_text(&c.arguments)},
    })
}

fn finish_reason(answer: &ModelResponse) -> &'static str {
    match answer::finish(answer) {
        Finish::ToolCalls => "tool_calls",
        Finish::Limit => "length",
        Finish::Done => "stop",
    }
}

fn usage(answer: &ModelResponse) -> Value {
    let u = &answer.usage;
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.total(),
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

/// The answer as the server-sent events of a `stream: true` request: a role
/// chunk, the text, each call (its id and name, then its arguments), the
/// finish reason, the usage chunk when `include_usage` was asked, `[DONE]`.
pub fn stream(
    answer: &ModelResponse,
    model: &str,
    id: &str,
    created: i64,
    include_usage: bool,
) -> Vec<String> {
    let chunk = |choices: Value| {
        let mut c = json!({
            "id": completion_id(id),
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let mut events: Vec<String> = deltas(answer)
        .into_iter()
        .map(|(delta, finish)| {
            let choice =
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish});
            sse::event(None, &chunk(json!([choice])))
        })
        .collect();
    if include_usage {
        let mut last = chunk(json!([]));
        last["usage"] = usage(answer);
        events.push(sse::event(None, &last));
    }
    events.push(sse::done());
    events
}

/// Each chunk's `delta` and `finish_reason`, in order.
fn deltas(answer: &ModelResponse) -> Vec<(Value, Option<&'static str>)> {
    let text = answer::text(answer);
    let mut out = vec![(
        json!({"role": "assistant", "content": text.map(|_| ""), "refusal": null}),
        None,
    )];
    if let Some(t) = text {
        out.push((json!({"content": t}), None));
    }
    for (k, c) in answer.tool_calls.iter().enumerate() {
        let head = json!({"index": k, "id": c.id, "type": "function",
                          "function": {"name": c.name, "arguments": ""}});
        let args =
            json!({"index": k, "function": {"arguments": answer::arguments_text(&c.arguments)}});
        out.push((json!({"tool_calls": [head]}), None));
        out.push((json!({"tool_calls": [args]}), None));
    }
    out.push((json!({}), Some(finish_reason(answer))));
    out
}

/// OpenAI's error body, its `type` (and `code`, where OpenAI gives one)
/// chosen from the status as OpenAI's API does.
pub fn error(status: u16, message: &str) -> Value {
    let (kind, code) = match status {
        401 => ("invalid_request_error", Some("invalid_api_key")),
        403 => ("permission_error", None),
        404 => ("invalid_request_error", Some("not_found")),
        429 => ("rate_limit_error", Some("rate_limit_exceeded")),
        400..=499 => ("invalid_request_error", None),
        _ => ("server_error", None),
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// The 400 body of a request that cannot be served, `param` naming the field.
pub fn bad_request(e: &BadRequest) -> Value {
    let mut body = error(400, &e.to_string());
    body["error"]["param"] = json!(e.field);
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Message;
    use crate::wire::sdk_fixtures::{CREATED, ID, MODEL, answer, answers, captured, second_turn};

    #[test]
    fn langgraph_requests_parse() {
        let first = request(&captured("langgraph-1")).unwrap();
        assert_eq!(first.system, "You are careful.");
        assert_eq!(
            first.messages,
            vec![Message::user("What about orders 42 and 43?")]
        );
        assert_eq!(first.max_output_tokens, None);
        let lookup = ToolDef {
            name: "lookup".into(),
            description: "Find an order.".into(),
            input_schema: json!({"properties": {"order": {"type": "integer"}},
                                 "required": ["order"], "type": "object"}),
        };
        assert_eq!(first.tools, vec![lookup]);
        let second = request(&captured("langgraph-2")).unwrap();
        assert_eq!(
            second.messages,
            second_turn([json!({"order": 42}), json!({"order": 43})])
        );
        assert_eq!(second.tools, first.tools);
        assert!(!streams(&captured("langgraph-2")));
        let streaming = captured("langgraph_streaming-2");
        assert!(streams(&streaming));
        assert!(!include_usage(&streaming));
        assert_eq!(request(&streaming).unwrap(), second);
        // A plain agent appending the SDK's own message object to its history.
        let plain = captured("openai_sdk-2");
        assert!(include_usage(&plain));
        let plain = request(&plain).unwrap();
        assert_eq!(plain.messages, second.messages);
        assert_eq!(plain.system, "You are careful.");
    }

    #[test]
    fn system_parts_and_bounds() {
        let body = json!({
            "model": "x", "temperature": 0, "n": 1, "tool_choice": "auto",
            "stream_options": {"include_usage": true},
            "max_tokens": 50, "max_completion_tokens": 70,
            "messages": [
                {"role": "system", "content": "A."},
                {"role": "developer", "content": [{"type": "text", "text": "B."}]},
                {"role": "user", "name": "bob", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": "Sure.", "refusal": null},
            ],
        });
        let r = request(&body).unwrap();
        assert_eq!(r.system, "A.\n\nB.");
        let said = Message::Assistant {
            text: Some("Sure.".into()),
            tool_calls: vec![],
        };
        assert_eq!(r.messages, vec![Message::user("one\ntwo"), said]);
        assert_eq!(r.max_output_tokens, Some(70));
        assert!(include_usage(&body));
    }

    #[test]
    fn malformed_requests_are_refused_naming_the_field() {
        let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
        let cases = [
            (json!([]), "body"),
            (json!({"model": "x"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                user(json!([{"type": "image_url", "image_url": {"url": "u"}}])),
                "messages[0].content[0].type",
            ),
            (user(json!(7)), "messages[0].content"),
            (
                json!({"messages": [{"role": "function", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}),
                "messages[0].tool_call_id",
            ),
            (
                json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]}),
                "messages[0].tool_calls[0].function.name",
            ),
            (
                json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]}),
                "messages[0].tool_calls[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "audio": {}}]}),
                "messages[0].audio",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "custom": {"name": "x"}}]}),
                "tools[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 2}}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
                "max_tokens",
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
            let r = response(&a, MODEL, ID, CREATED);
            assert_eq!(r["object"], "chat.completion");
            assert_eq!(r["id"], format!("chatcmpl-{ID}"));
            assert_eq!(r["usage"]["total_tokens"], 132, "{name}");
            let m = &r["choices"][0]["message"];
            let expected = match name {
                "text" => ("stop", json!("Order 42 was refunded.")),
                "tools" => ("tool_calls", Value::Null),
                "both" => ("tool_calls", json!("Refunding 300 of order 42.")),
                _ => ("length", json!("The order history begins")),
            };
            assert_eq!(
                (
                    r["choices"][0]["finish_reason"].as_str().unwrap(),
                    m["content"].clone()
                ),
                expected
            );
            let calls: Vec<(String, String, Value)> = m["tool_calls"]
                .as_array()
                .map(|c| {
                    c.iter()
                        .map(|c| {
                            let args =
                                serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
                                    .unwrap();
                            (
                                c["id"].as_str().unwrap().into(),
                                c["function"]["name"].as_str().unwrap().into(),
                                args,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let recorded: Vec<_> = a
                .tool_calls
                .iter()
                .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone()))
                .collect();
            assert_eq!(calls, recorded, "{name}");
        }
    }

    /// What a client rebuilds from the chunks: text, calls (id, name,
    /// arguments), finish reason, usage.
    #[derive(Default)]
    struct Rebuilt {
        text: String,
        calls: Vec<(String, String, String)>,
        finish: String,
        usage: Option<Value>,
    }

    fn accumulate(events: &[String]) -> Rebuilt {
        let mut r = Rebuilt::default();
        for chunk in sse::payloads(events) {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            if !chunk["usage"].is_null() {
                r.usage = Some(chunk["usage"].clone());
            }
            let Some(choice) = chunk["choices"].get(0) else {
                continue;
            };
            r.text += choice["delta"]["content"].as_str().unwrap_or("");
            for d in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let k = d["index"].as_u64().unwrap() as usize;
                if k == r.calls.len() {
                    r.calls.push((
                        d["id"].as_str().unwrap().into(),
                        d["function"]["name"].as_str().unwrap().into(),
                        String::new(),
                    ));
                }
                r.calls[k].2 += d["function"]["arguments"].as_str().unwrap_or("");
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                r.finish = f.into();
            }
        }
        r
    }

    #[test]
    fn streams_rebuild_the_answer() {
        for (name, a) in answers() {
            let events = stream(&a, MODEL, ID, CREATED, true);
            assert_eq!(events.last().unwrap(), "data: [DONE]\n\n");
            assert!(
                events
                    .iter()
                    .all(|e| e.starts_with("data: ") && e.ends_with("\n\n"))
            );
            let Rebuilt {
                text,
                calls,
                finish,
                usage,
            } = accumulate(&events);
            let plain = response(&a, MODEL, ID, CREATED);
            assert_eq!(
                text,
                plain["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or(""),
                "{name}"
            );
            assert_eq!(finish, plain["choices"][0]["finish_reason"], "{name}");
            let expected: Vec<_> = a
                .tool_calls
                .iter()
                .map(|c| (c.id.clone(), c.name.clone(), c.arguments.to_string()))
                .collect();
            assert_eq!(calls, expected, "{name}");
            assert_eq!(usage, Some(plain["usage"].clone()));
            let bare = accumulate(&stream(&a, MODEL, ID, CREATED, false));
            assert_eq!(bare.usage, None);
        }
    }

    #[test]
    fn an_answer_sent_back_as_history_reads_as_recorded() {
        for (name, a) in answers() {
            let said = response(&a, MODEL, ID, CREATED)["choices"][0]["message"].clone();
            let body = json!({"messages": [{"role": "user", "content": "q"}, said]});
            let r = request(&body).unwrap();
            let expected = Message::Assistant {
                text: a.text.clone(),
                tool_calls: a.tool_calls.clone(),
            };
            assert_eq!(r.messages[1], expected, "{name}");
        }
        let raw = ModelResponse {
            tool_calls: vec![ToolCall {
                id: "c".into(),
                name: "x".into(),
                arguments: json!("{\"cut"),
            }],
            ..answer("tools")
        };
        let args = &response(&raw, MODEL, ID, CREATED)["choices"][0]["message"]["tool_calls"][0]["function"]
            ["arguments"];
        assert_eq!(
            args, "{\"cut",
            "malformed arguments go back as the model wrote them"
        );
    }

    #[test]
    fn errors_take_their_type_from_the_status() {
        let e = error(400, "messages: is required");
        assert_eq!(
            e,
            json!({"error": {"message": "messages: is required", "type": "invalid_request_error", "param": null, "code": null}})
        );
        assert_eq!(error(401, "x")["error"]["code"], "invalid_api_key");
        let refused = bad_request(&BadRequest::new("n", "agentrun cannot honour 2 here"));
        assert_eq!(refused["error"]["param"], "n");
        assert_eq!(
            refused["error"]["message"],
            "n: agentrun cannot honour 2 here"
        );
        assert_eq!(error(429, "x")["error"]["type"], "rate_limit_error");
        assert_eq!(error(503, "x")["error"]["type"], "server_error");
    }
}
