//! OpenAI Responses (`POST /v1/responses`) as the OpenAI Agents SDK sends it
//! with its default settings: the whole conversation in `input` on every
//! request (no `previous_response_id`: agentrun keeps no response state for
//! an agent). An agent's request body as a [`ModelRequest`], a recorded
//! [`ModelResponse`] back as a `response` object or its event stream.

use serde_json::{Map, Value, json};

use super::answer::{self, Finish};
use super::chat_completions::function_tool;
use super::fields::{self, Conversation, Keys, at, get, index, list, object, string};
use super::{BadRequest, sse};
use crate::model::{ModelRequest, ModelResponse, ToolCall, ToolDef, arguments_from_str};

/// The body's keys. Sampling settings are dropped (the Agent's spec decides
/// them), and so is `include`: it asks for extra output data (encrypted
/// reasoning, log probabilities) of kinds agentrun's answers never hold.
const BODY: Keys = Keys {
    carried: &[
        "input",
        "instructions",
        "tools",
        "max_output_tokens",
        "stream",
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
        "include",
        "stream_options",
    ],
    only: &[
        ("tool_choice", |v| v == "auto"),
        ("parallel_tool_calls", |v| v == &Value::Bool(true)),
        ("truncation", |v| v == "disabled"),
        ("background", |v| v == &Value::Bool(false)),
        ("text", plain_text),
        ("reasoning", no_summary),
        ("top_logprobs", |v| v == 0),
    ],
};

/// `text`: plain text out (`format` absent or `text`); `verbosity` is a
/// sampling setting, dropped (the Agents SDK sends `"low"` by default).
fn plain_text(v: &Value) -> bool {
    v.as_object().is_some_and(|o| {
        o.iter().all(|(k, v)| match k.as_str() {
            "format" => v.is_null() || v == &json!({"type": "text"}),
            "verbosity" => true,
            _ => false,
        })
    })
}

/// `reasoning`: its `effort` is a sampling setting, dropped (the Agents SDK
/// sends `"none"` by default); a summary would be output agentrun's
/// answers do not hold.
fn no_summary(v: &Value) -> bool {
    v.as_object().is_some_and(|o| {
        o.iter().all(|(k, v)| {
            k == "effort" || ((k == "summary" || k == "generate_summary") && v.is_null())
        })
    })
}

/// Text parts of an input message, whoever speaks.
const TEXT: &[&str] = &["input_text", "output_text"];

/// The request body as a [`ModelRequest`], or why it cannot be served.
pub fn request(body: &Value) -> Result<ModelRequest, BadRequest> {
    let o = object(body, "")?;
    BODY.check(o, "")?;
    let mut system = Vec::new();
    if let Some(i) = get(o, "instructions") {
        system.push(fields::text(i, "instructions", TEXT)?);
    }
    let mut conversation = Conversation::default();
    match get(o, "input") {
        None => return Err(BadRequest::new("input", "is required")),
        Some(Value::String(s)) => conversation.user(s.clone()),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(BadRequest::new("input", "must hold at least one item"));
        }
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(item, &index("input", i), &mut system, &mut conversation)?;
            }
        }
        Some(_) => {
            return Err(BadRequest::new(
                "input",
                "must be a string or a list of items",
            ));
        }
    }
    Ok(ModelRequest {
        system: fields::join_system(system),
        messages: conversation.messages,
        tools: tools(o)?,
        max_output_tokens: fields::max_tokens(o, &["max_output_tokens"])?,
    })
}

/// The `stream` flag.
pub fn streams(body: &Value) -> bool {
    fields::streams(body)
}

/// One item of `input`, at `path`.
fn input_item(
    item: &Value,
    path: &str,
    system: &mut Vec<String>,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    let o = object(item, path)?;
    match fields::opt_string(o, "type", path)?.unwrap_or("message") {
        "message" => message(o, path, system, conversation),
        "function_call" => {
            item_keys(&["call_id", "name", "arguments"]).check(o, path)?;
            conversation.call(ToolCall {
                id: string(o, "call_id", path)?.to_string(),
                name: string(o, "name", path)?.to_string(),
                arguments: arguments_from_str(
                    fields::opt_string(o, "arguments", path)?.unwrap_or(""),
                ),
            });
            Ok(())
        }
        "function_call_output" => {
            item_keys(&["call_id", "output"]).check(o, path)?;
            let call_id = string(o, "call_id", path)?;
            let output = match get(o, "output") {
                None => String::new(),
                Some(v) => fields::text(v, &at(path, "output"), TEXT)?,
            };
            conversation.tool_result(call_id, output, false, &at(path, "call_id"))
        }
        other => Err(BadRequest::new(
            at(path, "type"),
            format!("{other:?} input items are not supported"),
        )),
    }
}

/// An item's keys: its `type`, `carried`, and the bookkeeping of an item
/// that was once an output (`id`, `status`).
fn item_keys<'a>(carried: &'a [&'a str]) -> Keys<'a> {
    Keys {
        carried,
        dropped: &["type", "id", "status"],
        only: &[],
    }
}

/// A `message` item (also written without `type`, as `{role, content}`).
fn message(
    o: &Map<String, Value>,
    path: &str,
    system: &mut Vec<String>,
    conversation: &mut Conversation,
) -> Result<(), BadRequest> {
    item_keys(&["role", "content"]).check(o, path)?;
    let text = match get(o, "content") {
        None => String::new(),
        Some(c) => fields::text(c, &at(path, "content"), TEXT)?,
    };
    match string(o, "role", path)? {
        "system" | "developer" => system.push(text),
        "user" => conversation.user(text),
        "assistant" => conversation.assistant(Some(text)),
        other => {
            return Err(BadRequest::new(
                at(path, "role"),
                format!("{other:?} messages are not supported"),
            ));
        }
    }
    Ok(())
}

/// The function tools offered; built-in tools (web search, file search,
/// code interpreter...) are the provider's own and refused.
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
        defs.push(function_tool(t, &path)?);
    }
    Ok(defs)
}

/// The answer as a `response` object.
pub fn response(answer: &ModelResponse, model: &str, id: &str, created: i64) -> Value {
    let mut r = snapshot(model, id, created);
    let limit = answer::finish(answer) == Finish::Limit;
    r["status"] = json!(if limit { "incomplete" } else { "completed" });
    if limit {
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    r["output"] = output_items(answer, id).into_iter().collect();
    r["usage"] = usage(answer);
    r
}

/// The response before its output: what `response.created` carries.
fn snapshot(model: &str, id: &str, created: i64) -> Value {
    json!({
        "id": format!("resp_{id}"),
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": null,
        "incomplete_details": null,
        "instructions": null,
        "max_output_tokens": null,
        "model": model,
        "output": [],
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "store": false,
        "temperature": null,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": null,
        "truncation": "disabled",
        "usage": null,
        "user": null,
        "metadata": {},
    })
}

/// The output items: the text as one `message`, then each call.
fn output_items(answer: &ModelResponse, id: &str) -> Vec<Value> {
    let mut items = Vec::new();
    if let Some(t) = answer::text(answer) {
        items.push(message_item(id, "completed", vec![text_part(t)]));
    }
    for (k, c) in answer.tool_calls.iter().enumerate() {
        items.push(call_item(
            id,
            k,
            c,
            "completed",
            &answer::arguments_text(&c.arguments),
        ));
    }
    items
}

fn message_item(id: &str, status: &str, content: Vec<Value>) -> Value {
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A `function_call` item: its `call_id` is the recorded call's id, which
/// the agent quotes in the call's `function_call_output`.
fn call_item(id: &str, k: usize, c: &ToolCall, status: &str, arguments: &str) -> Value {
    json!({
        "id": format!("fc_{id}_{k}"),
        "type": "function_call",
        "status": status,
        "call_id": c.id,
        "name": c.name,
        "arguments": arguments,
    })
}

fn usage(answer: &ModelResponse) -> Value {
    let u = &answer.usage;
    json!({
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total(),
    })
}

/// Events numbered as they are added (`sequence_number`).
struct Events(Vec<String>);

impl Events {
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.0.len());
        self.0.push(sse::event(Some(kind), &data));
    }
}

/// The answer as the events of a `stream: true` request: the response
/// created and in progress, each output item added, its content streamed
/// and done, then the response completed (or incomplete, when cut off).
pub fn stream(answer: &ModelResponse, model: &str, id: &str, created: i64) -> Vec<String> {
    let mut events = Events(Vec::new());
    let start = snapshot(model, id, created);
    events.push("response.created", json!({"response": start}));
    events.push("response.in_progress", json!({"response": start}));
    let mut output_index = 0;
    if let Some(t) = answer::text(answer) {
        text_events(&mut events, id, output_index, t);
        output_index += 1;
    }
    for (k, c) in answer.tool_calls.iter().enumerate() {
        call_events(&mut events, id, output_index, k, c);
        output_index += 1;
    }
    let done = response(answer, model, id, created);
    let last = if done["status"] == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    events.push(last, json!({"response": done}));
    events.0
}

fn text_events(events: &mut Events, id: &str, output_index: usize, text: &str) {
    let item_id = format!("msg_{id}");
    let at = json!({"item_id": item_id, "output_index": output_index, "content_index": 0});
    let with = |extra: Value| merged(&at, extra);
    events.push(
        "response.output_item.added",
        json!({"output_index": output_index, "item": message_item(id, "in_progress", vec![])}),
    );
    events.push(
        "response.content_part.added",
        with(json!({"part": text_part("")})),
    );
    events.push(
        "response.output_text.delta",
        with(json!({"delta": text, "logprobs": []})),
    );
    events.push(
        "response.output_text.done",
        with(json!({"text": text, "logprobs": []})),
    );
    events.push(
        "response.content_part.done",
        with(json!({"part": text_part(text)})),
    );
    events.push(
        "response.output_item.done",
        json!({"output_index": output_index, "item": message_item(id, "completed", vec![text_part(text)])}),
    );
}

fn call_events(events: &mut Events, id: &str, output_index: usize, k: usize, c: &ToolCall) {
    let arguments = answer::arguments_text(&c.arguments);
    let at = json!({"item_id": format!("fc_{id}_{k}"), "output_index": output_index});
    events.push(
        "response.output_item.added",
        json!({"output_index": output_index, "item": call_item(id, k, c, "in_progress", "")}),
    );
    events.push(
        "response.function_call_arguments.delta",
        merged(&at, json!({"delta": arguments})),
    );
    events.push(
        "response.function_call_arguments.done",
        merged(&at, json!({"arguments": arguments})),
    );
    events.push(
        "response.output_item.done",
        json!({"output_index": output_index, "item": call_item(id, k, c, "completed", &arguments)}),
    );
}

/// `base`'s keys and `extra`'s (both objects).
fn merged(base: &Value, extra: Value) -> Value {
    let mut out = base.clone();
    if let (Some(o), Value::Object(e)) = (out.as_object_mut(), extra) {
        o.extend(e);
    }
    out
}

/// OpenAI's error body (the Responses API shares Chat Completions').
pub fn error(status: u16, message: &str) -> Value {
    super::chat_completions::error(status, message)
}

/// The 400 body of a request that cannot be served, `param` naming the field.
pub fn bad_request(e: &BadRequest) -> Value {
    super::chat_completions::bad_request(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Message;
    use crate::wire::sdk_fixtures::{CREATED, ID, MODEL, answers, captured, second_turn};

    #[test]
    fn agents_sdk_requests_parse() {
        let first = request(&captured("agents_sdk-1")).unwrap();
        assert_eq!(first.system, "You are careful.");
        assert_eq!(
            first.messages,
            vec![Message::user("What about orders 42 and 43?")]
        );
        assert_eq!(first.tools.len(), 1);
        assert_eq!(first.tools[0].name, "lookup");
        assert_eq!(first.tools[0].description, "Find an order.");
        assert_eq!(first.tools[0].input_schema["required"], json!(["order"]));
        let second = request(&captured("agents_sdk-2")).unwrap();
        assert_eq!(
            second.messages,
            second_turn([json!({"order": 42}), json!({"order": 43})])
        );
        assert!(!streams(&captured("agents_sdk-2")));
        let streamed = captured("agents_sdk_streamed-2");
        assert!(streams(&streamed));
        assert_eq!(request(&streamed).unwrap(), second);
    }

    #[test]
    fn instructions_system_items_and_string_input() {
        let body = json!({
            "instructions": "A.", "input": "hi", "max_output_tokens": 9,
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "reasoning": {"effort": "low", "summary": null},
        });
        let r = request(&body).unwrap();
        assert_eq!(
            (r.system.as_str(), r.messages, r.max_output_tokens),
            ("A.", vec![Message::user("hi")], Some(9))
        );
        let body = json!({"instructions": "A.", "input": [
            {"role": "developer", "content": "B."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]},
        ]});
        let r = request(&body).unwrap();
        assert_eq!(
            (r.system.as_str(), r.messages),
            ("A.\n\nB.", vec![Message::user("x\ny")])
        );
    }

    #[test]
    fn malformed_requests_are_refused_naming_the_field() {
        let with = |extra: Value| {
            let mut b = json!({"input": "hi"});
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            b
        };
        let cases = [
            (json!({"model": "x"}), "input"),
            (json!({"input": 3}), "input"),
            (json!({"input": []}), "input"),
            (
                with(json!({"tools": [{"type": "web_search"}]})),
                "tools[0].type",
            ),
            (
                with(json!({"previous_response_id": "resp_1"})),
                "previous_response_id",
            ),
            (with(json!({"tool_choice": "required"})), "tool_choice"),
            (
                with(
                    json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
                ),
                "text",
            ),
            (
                with(json!({"reasoning": {"effort": "high", "summary": "auto"}})),
                "reasoning",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}]}),
                "input[1].type",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}),
                "input[0].name",
            ),
            (
                json!({"input": [{"role": "tool", "content": "x"}]}),
                "input[0].role",
            ),
        ];
        for (body, field) in cases {
            let err = request(&body).expect_err(&body.to_string());
            assert_eq!(err.field, field, "{body}: {err}");
        }
    }

    /// The output items as (type, text or call id, arguments).
    fn items(output: &Value) -> Vec<(String, String, Value)> {
        output
            .as_array()
            .unwrap()
            .iter()
            .map(|o| match o["type"].as_str().unwrap() {
                "message" => (
                    "message".into(),
                    o["content"][0]["text"].as_str().unwrap().into(),
                    Value::Null,
                ),
                kind => {
                    let args = serde_json::from_str(o["arguments"].as_str().unwrap()).unwrap();
                    (kind.into(), o["call_id"].as_str().unwrap().into(), args)
                }
            })
            .collect()
    }

    fn expected_items(a: &ModelResponse) -> Vec<(String, String, Value)> {
        let text = a
            .text
            .iter()
            .map(|t| ("message".into(), t.clone(), Value::Null));
        let calls = a
            .tool_calls
            .iter()
            .map(|c| ("function_call".into(), c.id.clone(), c.arguments.clone()));
        text.chain(calls).collect()
    }

    #[test]
    fn responses_have_the_answers_fields() {
        for (name, a) in answers() {
            let r = response(&a, MODEL, ID, CREATED);
            assert_eq!(
                (r["object"].as_str(), r["id"].as_str()),
                (Some("response"), Some("resp_0d2c6f1e"))
            );
            let status = if name == "limit" {
                "incomplete"
            } else {
                "completed"
            };
            assert_eq!(r["status"], status, "{name}");
            assert_eq!(items(&r["output"]), expected_items(&a), "{name}");
            assert_eq!(r["usage"]["total_tokens"], 132);
        }
    }

    #[test]
    fn streams_rebuild_the_answer() {
        for (name, a) in answers() {
            let events = stream(&a, MODEL, ID, CREATED);
            let payloads = sse::payloads(&events);
            for (n, (e, p)) in events.iter().zip(&payloads).enumerate() {
                assert_eq!(p["sequence_number"], n, "{name}");
                assert!(e.starts_with(&format!("event: {}\ndata: ", p["type"].as_str().unwrap())));
            }
            let kinds: Vec<&str> = payloads
                .iter()
                .map(|p| p["type"].as_str().unwrap())
                .collect();
            assert_eq!(kinds[..2], ["response.created", "response.in_progress"]);
            let plain = response(&a, MODEL, ID, CREATED);
            let last = payloads.last().unwrap();
            assert_eq!(last["response"], plain, "{name}");
            let (mut text, mut args, mut done_items) = (String::new(), Vec::new(), Vec::new());
            for p in &payloads {
                match p["type"].as_str().unwrap() {
                    "response.output_text.delta" => text += p["delta"].as_str().unwrap(),
                    "response.function_call_arguments.delta" => {
                        args.push(p["delta"].as_str().unwrap().to_string())
                    }
                    "response.output_item.done" => done_items.push(p["item"].clone()),
                    _ => {}
                }
            }
            assert_eq!(text, a.text.clone().unwrap_or_default());
            let recorded: Vec<String> = a
                .tool_calls
                .iter()
                .map(|c| c.arguments.to_string())
                .collect();
            assert_eq!(args, recorded);
            assert_eq!(Value::Array(done_items), plain["output"]);
        }
    }

    #[test]
    fn an_answer_sent_back_as_history_reads_as_recorded() {
        for (name, a) in answers() {
            let mut input = vec![json!({"role": "user", "content": "q"})];
            input.extend(
                response(&a, MODEL, ID, CREATED)["output"]
                    .as_array()
                    .unwrap()
                    .clone(),
            );
            let r = request(&json!({"input": input})).unwrap();
            let expected = Message::Assistant {
                text: a.text.clone(),
                tool_calls: a.tool_calls.clone(),
            };
            assert_eq!(r.messages[1..], [expected], "{name}");
        }
    }
}
