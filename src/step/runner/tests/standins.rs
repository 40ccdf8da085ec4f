//! A model provider and tool endpoints in process, on 127.0.0.1, scripted
//! from a canned history and counting what they are asked. The model speaks
//! OpenAI chat completions (what `model::openai` sends and parses) and
//! answers by the request's own history: a request carrying k assistant
//! turns gets the history's k-th `ModelCall`, so any worker resuming
//! anywhere is answered what the canned run was. The tools take POSTs with
//! an `Idempotency-Key` header (answered with the result the history
//! recorded for that key) and a lookup by key (`GET …/lookup`: 200 once the
//! call took effect, else 404).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::replay::Entry;
use crate::runlog::v1;

/// What the stand-ins were asked since the last [`Standins::reset`].
#[derive(Clone, Debug, Default)]
pub struct Counts {
    /// Chat-completion requests.
    pub model_requests: usize,
    /// Tool POSTs, per idempotency key.
    pub posts: HashMap<String, u32>,
    /// Lookups, per idempotency key.
    pub lookups: HashMap<String, u32>,
    /// Calls that took effect, per key: those before the reset (a crashed
    /// worker's) and every POST since.
    pub effects: HashMap<String, u32>,
}

/// One call the history recorded: what is sent, and what the tool answered.
#[derive(Clone, Debug)]
struct Call {
    tool: String,
    arguments: Value,
    result: Value,
}

#[derive(Default)]
struct Script {
    /// The recorded answers, in order, with how many tool results the
    /// request for each carries (the worker replayed them all).
    answers: Vec<(v1::ModelResponse, usize)>,
    /// The recorded calls by idempotency key.
    calls: HashMap<String, Call>,
    counts: Counts,
}

/// What a tool does, once it has answered and before the answer leaves.
type Hook = Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

#[derive(Default)]
struct Inner {
    script: Mutex<Script>,
    on_call: Mutex<Option<Hook>>,
}

type Shared = Arc<Inner>;

/// The running stand-ins; they stop with the test's runtime.
pub struct Standins {
    /// `http://127.0.0.1:<port>`: the model is at `{base}/v1`, tool `t` at
    /// `{base}/tools/t`, its lookup at `{base}/tools/t/lookup`.
    pub base: String,
    shared: Shared,
}

impl Standins {
    pub async fn start() -> Standins {
        let shared = Shared::default();
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/tools/{tool}", post(call))
            .route("/tools/{tool}/lookup", get(lookup))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Standins { base, shared }
    }

    /// Scripts the answers from `history`: its model calls and tool results.
    pub fn script(&self, history: &[Entry]) {
        let mut script = self.shared.script.lock().unwrap();
        let mut results = 0;
        for (seq, step) in history.iter().enumerate() {
            match step {
                Entry::ModelCall(m) => script.answers.push((m.response.clone(), results)),
                Entry::ToolResult(r) => {
                    results += 1;
                    let Some(Entry::ToolIntent(intent)) = history.get(r.intent_seq as usize) else {
                        panic!("result {seq} answers no intent");
                    };
                    let v1::ToolOutcome::Ok(result) = &r.outcome else {
                        panic!("the stand-in tools only succeed");
                    };
                    let call = Call {
                        tool: intent.tool.clone(),
                        arguments: intent.arguments.clone(),
                        result: result.clone(),
                    };
                    script.calls.insert(intent.key.clone(), call);
                }
                _ => {}
            }
        }
    }

    /// Zeroes the counts; the calls under `done` already took effect (a
    /// previous worker made them).
    pub fn reset(&self, done: impl IntoIterator<Item = String>) {
        let mut script = self.shared.script.lock().unwrap();
        script.counts = Counts::default();
        script.counts.effects = done.into_iter().map(|key| (key, 1)).collect();
    }

    /// Runs `hook` at every tool call, after the tool took effect and
    /// before its answer is sent.
    pub fn on_call(
        &self,
        hook: impl Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
    ) {
        *self.shared.on_call.lock().unwrap() = Some(Arc::new(hook));
    }

    pub fn counts(&self) -> Counts {
        self.shared.script.lock().unwrap().counts.clone()
    }
}

/// An OpenAI-style error reply (the client reads `error.message`).
fn refuse(status: StatusCode, message: String) -> (StatusCode, Json<Value>) {
    (status, Json(json!({"error": {"message": message}})))
}

async fn chat(State(shared): State<Shared>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let mut script = shared.script.lock().unwrap();
    script.counts.model_requests += 1;
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let turns = messages.iter().filter(|m| m["role"] == "assistant").count();
    let results = messages.iter().filter(|m| m["role"] == "tool").count();
    let Some((answer, expected_results)) = script.answers.get(turns) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!("no answer after {turns} turns"),
        );
    };
    if results != *expected_results {
        let why = format!("turn {turns} came with {results} tool results, not {expected_results}");
        return refuse(StatusCode::BAD_REQUEST, why);
    }
    (StatusCode::OK, Json(completion(answer)))
}

/// A recorded answer as a chat completion.
fn completion(answer: &v1::ModelResponse) -> Value {
    let calls: Vec<Value> = answer
        .tool_calls
        .iter()
        .map(|c| {
            json!({"id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments.to_string()}})
        })
        .collect();
    json!({
        "id": "chatcmpl-standin", "object": "chat.completion", "model": answer.model_id,
        "choices": [{"index": 0, "finish_reason": answer.stop_reason,
                     "message": {"role": "assistant", "content": answer.text, "tool_calls": calls}}],
        "usage": {"prompt_tokens": answer.usage.input_tokens,
                  "completion_tokens": answer.usage.output_tokens},
    })
}

fn key_of(headers: &HeaderMap) -> String {
    let key = headers.get("Idempotency-Key").and_then(|v| v.to_str().ok());
    key.unwrap_or_default().to_string()
}

async fn call(
    State(shared): State<Shared>,
    Path(tool): Path<String>,
    headers: HeaderMap,
    Json(arguments): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let answer = take_effect(&shared, &tool, key_of(&headers), &arguments);
    let hook = shared.on_call.lock().unwrap().clone();
    if let (Some(hook), (StatusCode::OK, _)) = (hook, &answer) {
        hook().await;
    }
    answer
}

/// Counts a call and answers it: its recorded result if it is the
/// recorded call of its key.
fn take_effect(
    shared: &Inner,
    tool: &str,
    key: String,
    arguments: &Value,
) -> (StatusCode, Json<Value>) {
    let mut script = shared.script.lock().unwrap();
    *script.counts.posts.entry(key.clone()).or_default() += 1;
    let Some(recorded) = script.calls.get(&key).cloned() else {
        return refuse(StatusCode::BAD_REQUEST, format!("no call has key {key:?}"));
    };
    if recorded.tool != tool || recorded.arguments != *arguments {
        let why = format!("key {key} was {recorded:?}, not {tool} {arguments}");
        return refuse(StatusCode::BAD_REQUEST, why);
    }
    *script.counts.effects.entry(key).or_default() += 1;
    (StatusCode::OK, Json(recorded.result))
}

async fn lookup(
    State(shared): State<Shared>,
    Path(tool): Path<String>,
    headers: HeaderMap,
) -> (StatusCode, Json<Value>) {
    let key = key_of(&headers);
    let mut script = shared.script.lock().unwrap();
    *script.counts.lookups.entry(key.clone()).or_default() += 1;
    let done = script.counts.effects.get(&key).is_some_and(|n| *n > 0);
    match script.calls.get(&key) {
        Some(recorded) if done && recorded.tool == tool => {
            (StatusCode::OK, Json(recorded.result.clone()))
        }
        _ => (StatusCode::NOT_FOUND, Json(json!({"found": false}))),
    }
}
