//! The answers each dialect renders, kept as files under
//! `testdata/rendered/` for the check by the providers' own SDKs (see
//! `testdata/README.md`): the test fails when the files are not what the
//! code renders now, and rewrites them when `WIRE_UPDATE_FIXTURES=1`.

use std::path::PathBuf;

use serde_json::json;

use super::{chat_completions, messages, responses};
use crate::model::{ModelResponse, TokenUsage, ToolCall};

pub(crate) const MODEL: &str = "gpt-test";
pub(crate) const ID: &str = "0d2c6f1e";
pub(crate) const CREATED: i64 = 1_764_900_000;

fn call(id: &str, name: &str, arguments: serde_json::Value) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments,
    }
}

/// The answers rendered: text only, two parallel calls, text and a call,
/// and a text cut off at the token bound.
pub(crate) fn answers() -> Vec<(&'static str, ModelResponse)> {
    let usage = TokenUsage {
        input_tokens: 120,
        output_tokens: 12,
    };
    let answer = |text: Option<&str>, tool_calls: Vec<ToolCall>, stop: &str| ModelResponse {
        text: text.map(str::to_string),
        tool_calls,
        usage,
        model_id: MODEL.into(),
        stop_reason: Some(stop.into()),
    };
    vec![
        (
            "text",
            answer(Some("Order 42 was refunded."), vec![], "stop"),
        ),
        (
            "tools",
            answer(
                None,
                vec![
                    call("call_a1", "lookup", json!({"order": 42})),
                    call("call_b2", "lookup", json!({"order": 43})),
                ],
                "tool_calls",
            ),
        ),
        (
            "both",
            answer(
                Some("Refunding 300 of order 42."),
                vec![call(
                    "call_c3",
                    "refund",
                    json!({"order": 42, "amount": 300}),
                )],
                "tool_use",
            ),
        ),
        (
            "limit",
            answer(Some("The order history begins"), vec![], "length"),
        ),
    ]
}

/// Every rendered file: name and content.
fn rendered() -> Vec<(String, String)> {
    let mut files = Vec::new();
    for (name, a) in answers() {
        let pretty = |v: serde_json::Value| serde_json::to_string_pretty(&v).unwrap() + "\n";
        let chat = chat_completions::response(&a, MODEL, ID, CREATED);
        files.push((format!("chat_completions-{name}.json"), pretty(chat)));
        let chat_stream = chat_completions::stream(&a, MODEL, ID, CREATED, true);
        files.push((format!("chat_completions-{name}.sse"), chat_stream.concat()));
        let bare = chat_completions::stream(&a, MODEL, ID, CREATED, false);
        files.push((
            format!("chat_completions-{name}-nousage.sse"),
            bare.concat(),
        ));
        let resp = responses::response(&a, MODEL, ID, CREATED);
        files.push((format!("responses-{name}.json"), pretty(resp)));
        let resp_stream = responses::stream(&a, MODEL, ID, CREATED);
        files.push((format!("responses-{name}.sse"), resp_stream.concat()));
        let msg = messages::response(&a, MODEL, ID, CREATED);
        files.push((format!("messages-{name}.json"), pretty(msg)));
        let msg_stream = messages::stream(&a, MODEL, ID, CREATED);
        files.push((format!("messages-{name}.sse"), msg_stream.concat()));
    }
    for (status, name) in [(400, "400"), (401, "401"), (429, "429"), (500, "500")] {
        let text = "messages[1].content[0].type: \"image_url\" content is not supported";
        let openai = serde_json::to_string(&chat_completions::error(status, text)).unwrap();
        files.push((format!("openai-error-{name}.json"), openai + "\n"));
        let anthropic = serde_json::to_string(&messages::error(status, text)).unwrap();
        files.push((format!("anthropic-error-{name}.json"), anthropic + "\n"));
    }
    files
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/wire/testdata/rendered")
}

#[test]
fn rendered_fixtures_are_what_the_code_renders() {
    let update = std::env::var("WIRE_UPDATE_FIXTURES").as_deref() == Ok("1");
    let mut stale = Vec::new();
    for (name, content) in rendered() {
        let path = dir().join(&name);
        if update {
            std::fs::write(&path, &content).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(content.as_str()) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "stale under src/wire/testdata/rendered (rerun with WIRE_UPDATE_FIXTURES=1, then the SDK check of testdata/README.md): {stale:?}"
    );
}

/// A request body an SDK sent, kept under `testdata/requests/`.
pub(crate) fn captured(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/wire/testdata/requests")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// The answer named `name` of [`answers`].
pub(crate) fn answer(name: &str) -> ModelResponse {
    answers()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, a)| a)
        .unwrap()
}

/// The conversation every captured agent run had by its second request: a
/// question, two parallel `lookup` calls, their results.
pub(crate) fn second_turn(arguments: [serde_json::Value; 2]) -> Vec<crate::model::Message> {
    use crate::model::Message;
    let [a, b] = arguments;
    let result = |id: &str, order: u32| Message::ToolResult {
        call_id: id.into(),
        name: "lookup".into(),
        content: format!("order {order}: paid"),
        is_error: false,
    };
    vec![
        Message::user("What about orders 42 and 43?"),
        Message::Assistant {
            text: None,
            tool_calls: vec![call("call_a1", "lookup", a), call("call_b2", "lookup", b)],
        },
        result("call_a1", 42),
        result("call_b2", 43),
    ]
}
