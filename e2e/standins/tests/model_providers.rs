//! The model clients against the scripted model stand-in (`agentrun-standins`),
//! over real HTTP in both wire formats: OpenAI chat completions and Anthropic
//! Messages. Every case runs for both providers.

use std::time::{Duration, Instant};

use agentrun::api::{ModelSpec, Provider};
use agentrun::model::{
    AttemptOutcome, ClientOptions, Message, ModelClient, ModelError, ModelRequest, RetryPolicy,
    ToolCall, ToolDef,
};
use serde_json::{Value, json};

/// The stand-in binary on a free port (see e2e/standins/fixture.rs).
struct Standin(agentrun_standins::Standins);

impl std::ops::Deref for Standin {
    type Target = agentrun_standins::Standins;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Standin {
    fn start() -> Self {
        Standin(agentrun_standins::Standins::start_exe(
            std::path::Path::new(env!("CARGO_BIN_EXE_agentrun-standins")),
        ))
    }

    async fn script(&self, id: &str, replies: Value) {
        let resp = self
            .http
            .put(format!("{}/scripts/{id}", self.base))
            .json(&json!({ "replies": replies }))
            .send()
            .await
            .expect("PUT script");
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        assert!(status.is_success(), "PUT script {id}: {status} {body}");
    }

    /// `(count, request bodies)` the stand-in received for script `id`.
    async fn calls(&self, id: &str) -> (u64, Vec<Value>) {
        let v: Value = self
            .http
            .get(format!("{}/scripts/{id}/calls", self.base))
            .send()
            .await
            .expect("GET calls")
            .json()
            .await
            .expect("calls JSON");
        let requests = v["requests"].as_array().cloned().unwrap_or_default();
        (v["count"].as_u64().expect("count"), requests)
    }

    fn spec(&self, provider: Provider, id: &str) -> ModelSpec {
        let endpoint = match provider {
            Provider::OpenAI => format!("{}/scripts/{id}/v1", self.base),
            Provider::Anthropic => format!("{}/scripts/{id}", self.base),
        };
        ModelSpec {
            provider,
            name: "configured-model".into(),
            endpoint: Some(endpoint),
            ..Default::default()
        }
    }

    fn client(&self, provider: Provider, id: &str, key: Option<&str>) -> ModelClient {
        ModelClient::with_options(&self.spec(provider, id), key.map(str::to_string), fast())
            .expect("model client")
    }
}

/// Short delays so the retry cases stay quick.
fn fast() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(10),
        retry: RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            max_retry_after: Duration::from_secs(5),
            max_total: Duration::from_secs(30),
        },
    }
}

const KEY: &str = "sk-test-0123456789";

fn tools() -> Vec<ToolDef> {
    vec![
        ToolDef {
            name: "lookup_order".into(),
            description: "Find an order by number".into(),
            input_schema: json!({"type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]}),
        },
        ToolDef {
            name: "refund".into(),
            description: "Refund an amount".into(),
            input_schema: json!({"type": "object", "properties": {"amount": {"type": "number"}}}),
        },
    ]
}

fn simple_request() -> ModelRequest {
    ModelRequest {
        system: "You are a support agent.".into(),
        messages: vec![Message::user("Refund order 42")],
        tools: tools(),
        max_output_tokens: None,
    }
}

fn expected_model(id: &str) -> String {
    format!("scripted-{id}-2026-11")
}

macro_rules! both_providers {
    ($($name:ident => $case:ident;)*) => {$(
        mod $name {
            #[tokio::test]
            async fn openai() {
                super::$case(agentrun::api::Provider::OpenAI).await
            }
            #[tokio::test]
            async fn anthropic() {
                super::$case(agentrun::api::Provider::Anthropic).await
            }
        }
    )*};
}

both_providers! {
    tool_call_round_trip => case_tool_call_round_trip;
    answers_by_call_count => case_answers_by_call_count;
    history_in_wire_shape => case_history_in_wire_shape;
    orphan_tool_result_is_refused => case_orphan_tool_result_is_refused;
    server_error_then_success_is_retried => case_server_error_then_success_is_retried;
    rate_limit_honours_retry_after => case_rate_limit_honours_retry_after;
    bad_request_is_not_retried => case_bad_request_is_not_retried;
    retries_are_bounded => case_retries_are_bounded;
    timeout_is_retried => case_timeout_is_retried;
    malformed_arguments_kept_raw => case_malformed_arguments_kept_raw;
    malformed_body_is_typed_error => case_malformed_body_is_typed_error;
    missing_key_is_unauthorized => case_missing_key_is_unauthorized;
    echoed_key_is_redacted => case_echoed_key_is_redacted;
    oversized_reply_is_refused => case_oversized_reply_is_refused;
}

async fn case_tool_call_round_trip(p: Provider) {
    let s = Standin::start();
    let id = "roundtrip";
    s.script(
        id,
        json!([{
            "text": "Checking the order first.",
            "toolCalls": [
                {"name": "lookup_order", "arguments": {"order": 42, "note": "größer"}},
                {"name": "refund", "arguments": {"amount": 5.5}}
            ],
            "inputTokens": 123,
            "outputTokens": 45
        }]),
    )
    .await;
    let client = s.client(p, id, Some(KEY));
    let r = client.complete(&simple_request()).await.expect("complete");

    assert_eq!(r.text.as_deref(), Some("Checking the order first."));
    assert_eq!(r.tool_calls.len(), 2);
    assert_eq!(r.tool_calls[0].name, "lookup_order");
    assert_eq!(
        r.tool_calls[0].arguments,
        json!({"order": 42, "note": "größer"})
    );
    assert_eq!(r.tool_calls[1].name, "refund");
    assert_eq!(r.tool_calls[1].arguments, json!({"amount": 5.5}));
    assert!(!r.tool_calls[0].id.is_empty());
    assert_ne!(r.tool_calls[0].id, r.tool_calls[1].id);
    assert_eq!(r.usage.input_tokens, 123);
    assert_eq!(r.usage.output_tokens, 45);
    assert_eq!(r.model_id, expected_model(id));
    let stop = match p {
        Provider::OpenAI => "tool_calls",
        Provider::Anthropic => "tool_use",
    };
    assert_eq!(r.stop_reason.as_deref(), Some(stop));

    let (count, requests) = s.calls(id).await;
    assert_eq!(count, 1);
    let req = &requests[0];
    assert_eq!(req["model"], "configured-model");
    match p {
        Provider::OpenAI => {
            assert_eq!(
                req["messages"][0],
                json!({"role": "system", "content": "You are a support agent."})
            );
            assert_eq!(
                req["messages"][1],
                json!({"role": "user", "content": "Refund order 42"})
            );
            assert_eq!(req["tools"][0]["type"], "function");
            assert_eq!(req["tools"][0]["function"]["name"], "lookup_order");
            assert_eq!(
                req["tools"][0]["function"]["parameters"]["required"],
                json!(["order"])
            );
            assert!(req.get("max_tokens").is_none());
        }
        Provider::Anthropic => {
            assert_eq!(req["system"], "You are a support agent.");
            assert_eq!(
                req["messages"],
                json!([{"role": "user", "content": [{"type": "text", "text": "Refund order 42"}]}])
            );
            assert_eq!(req["tools"][1]["name"], "refund");
            assert_eq!(req["tools"][1]["input_schema"]["type"], "object");
            assert_eq!(req["max_tokens"], 4096);
        }
    }
}

async fn case_answers_by_call_count(p: Provider) {
    let s = Standin::start();
    let id = "bycount";
    s.script(
        id,
        json!([{"text": "first answer"}, {"text": "second answer"}]),
    )
    .await;
    let client = s.client(p, id, Some(KEY));
    let req = simple_request();
    let a = client.complete(&req).await.expect("first");
    let b = client.complete(&req).await.expect("second");
    let c = client.complete(&req).await.expect("third");
    assert_eq!(a.text.as_deref(), Some("first answer"));
    assert_eq!(b.text.as_deref(), Some("second answer"));
    assert_eq!(c.text.as_deref(), Some("script exhausted"));
    assert!(a.tool_calls.is_empty());
    let stop = match p {
        Provider::OpenAI => "stop",
        Provider::Anthropic => "end_turn",
    };
    assert_eq!(a.stop_reason.as_deref(), Some(stop));
    assert_eq!(s.calls(id).await.0, 3);
}

/// A conversation with a tool round: the assistant turn with two calls (one
/// with arguments the model botched), both results (one an error), then an
/// observation.
fn history() -> ModelRequest {
    ModelRequest {
        system: "You are a support agent.".into(),
        messages: vec![
            Message::user("Refund order 42"),
            Message::Assistant {
                text: Some("Let me look.".into()),
                tool_calls: vec![
                    ToolCall {
                        id: "call-1".into(),
                        name: "lookup_order".into(),
                        arguments: json!({"order": 42}),
                    },
                    ToolCall {
                        id: "call-2".into(),
                        name: "refund".into(),
                        arguments: Value::String("{\"amount\": 5".into()),
                    },
                ],
            },
            Message::ToolResult {
                call_id: "call-1".into(),
                name: "lookup_order".into(),
                content: "{\"order\":42,\"total\":10}".into(),
                is_error: false,
            },
            Message::ToolResult {
                call_id: "call-2".into(),
                name: "refund".into(),
                content: "arguments are not valid JSON".into(),
                is_error: true,
            },
            Message::user("refund rejected by alice: amount exceeds policy"),
        ],
        tools: tools(),
        max_output_tokens: None,
    }
}

async fn case_history_in_wire_shape(p: Provider) {
    let s = Standin::start();
    let id = "history";
    s.script(id, json!([{"text": "Understood."}])).await;
    let mut spec = s.spec(p, id);
    spec.max_output_tokens = Some(512);
    let client = ModelClient::with_options(&spec, Some(KEY.into()), fast()).unwrap();
    let r = client
        .complete(&history())
        .await
        .expect("the stand-in accepts the history");
    assert_eq!(r.text.as_deref(), Some("Understood."));

    let (count, requests) = s.calls(id).await;
    assert_eq!(count, 1);
    let req = &requests[0];
    match p {
        Provider::OpenAI => {
            assert_eq!(req["max_tokens"], 512);
            let m = req["messages"].as_array().unwrap();
            assert_eq!(m.len(), 6, "{m:?}");
            assert_eq!(m[0]["role"], "system");
            assert_eq!(m[2]["role"], "assistant");
            assert_eq!(m[2]["content"], "Let me look.");
            let calls = m[2]["tool_calls"].as_array().unwrap();
            assert_eq!(calls[0]["id"], "call-1");
            assert_eq!(calls[0]["type"], "function");
            assert_eq!(calls[0]["function"]["name"], "lookup_order");
            // Arguments travel as a JSON string.
            let args = calls[0]["function"]["arguments"].as_str().expect("string");
            assert_eq!(
                serde_json::from_str::<Value>(args).unwrap(),
                json!({"order": 42})
            );
            // Cut-off arguments go back as a JSON string holding the model's text.
            let cut = calls[1]["function"]["arguments"].as_str().expect("string");
            assert_eq!(
                serde_json::from_str::<Value>(cut).unwrap(),
                json!("{\"amount\": 5")
            );
            assert_eq!(
                m[3],
                json!({"role": "tool", "tool_call_id": "call-1", "content": "{\"order\":42,\"total\":10}"})
            );
            assert_eq!(m[4]["role"], "tool");
            assert_eq!(m[4]["tool_call_id"], "call-2");
            assert!(
                m[4]["content"]
                    .as_str()
                    .unwrap()
                    .contains("arguments are not valid JSON"),
                "{}",
                m[4]
            );
            assert_eq!(
                m[5],
                json!({"role": "user", "content": "refund rejected by alice: amount exceeds policy"})
            );
        }
        Provider::Anthropic => {
            assert_eq!(req["max_tokens"], 512);
            assert_eq!(req["system"], "You are a support agent.");
            let m = req["messages"].as_array().unwrap();
            assert_eq!(m.len(), 3, "{m:?}");
            assert_eq!(
                m[1],
                json!({"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "call-1", "name": "lookup_order", "input": {"order": 42}},
                    {"type": "tool_use", "id": "call-2", "name": "refund", "input": {}}
                ]})
            );
            // Both results of that turn in one user message, before the observation.
            assert_eq!(
                m[2],
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call-1", "content": "{\"order\":42,\"total\":10}", "is_error": false},
                    {"type": "tool_result", "tool_use_id": "call-2", "content": "arguments are not valid JSON", "is_error": true},
                    {"type": "text", "text": "refund rejected by alice: amount exceeds policy"}
                ]})
            );
        }
    }
}

/// The stand-in checks tool results against their calls, as the providers
/// do: the accepted history above is not accepted by default.
async fn case_orphan_tool_result_is_refused(p: Provider) {
    let s = Standin::start();
    let id = "orphan";
    s.script(id, json!([{"text": "never"}])).await;
    let mut req = history();
    req.messages.remove(1); // the assistant turn that made the calls
    let err = s
        .client(p, id, Some(KEY))
        .complete(&req)
        .await
        .expect_err("a tool result without its call is refused");
    match &err {
        ModelError::Rejected { status, message } => {
            assert_eq!(*status, 400);
            assert!(message.contains("tool"), "{message}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_server_error_then_success_is_retried(p: Provider) {
    let s = Standin::start();
    let id = "retry500";
    s.script(
        id,
        json!([{"status": 500}, {"text": "recovered", "inputTokens": 7, "outputTokens": 3}]),
    )
    .await;
    let (r, attempts) = s
        .client(p, id, Some(KEY))
        .complete_counted(&simple_request())
        .await;
    let r = r.expect("retried to success");
    assert_eq!(
        attempts,
        [AttemptOutcome::ServerError, AttemptOutcome::Ok],
        "each attempt is told, by class"
    );
    assert_eq!(r.text.as_deref(), Some("recovered"));
    assert_eq!((r.usage.input_tokens, r.usage.output_tokens), (7, 3));
    let (count, requests) = s.calls(id).await;
    assert_eq!(count, 2);
    assert_eq!(requests[0], requests[1], "a retry sends the same request");
}

async fn case_rate_limit_honours_retry_after(p: Provider) {
    let s = Standin::start();
    let id = "ratelimit";
    s.script(
        id,
        json!([{"status": 429, "retryAfter": 1}, {"text": "after the wait"}]),
    )
    .await;
    let start = Instant::now();
    let (r, attempts) = s
        .client(p, id, Some(KEY))
        .complete_counted(&simple_request())
        .await;
    let r = r.expect("retried after Retry-After");
    let waited = start.elapsed();
    assert_eq!(attempts, [AttemptOutcome::RateLimited, AttemptOutcome::Ok]);
    assert_eq!(r.text.as_deref(), Some("after the wait"));
    // The policy's own backoff is 20 ms: only Retry-After explains a 1 s wait.
    assert!(waited >= Duration::from_millis(950), "{waited:?}");
    assert_eq!(s.calls(id).await.0, 2);
}

async fn case_bad_request_is_not_retried(p: Provider) {
    let s = Standin::start();
    let id = "bad400";
    s.script(
        id,
        json!([{"status": 400, "message": "prompt is too long"}, {"text": "must not be reached"}]),
    )
    .await;
    let (err, attempts) = s
        .client(p, id, Some(KEY))
        .complete_counted(&simple_request())
        .await;
    let err = err.expect_err("400 fails");
    assert_eq!(attempts, [AttemptOutcome::ClientError]);
    match &err {
        ModelError::Rejected { status, message } => {
            assert_eq!(*status, 400);
            assert_eq!(message, "prompt is too long");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_retries_are_bounded(p: Provider) {
    let s = Standin::start();
    let id = "down";
    s.script(id, json!([{"status": 503}, {"status": 502}, {"status": 529}, {"status": 503}, {"text": "too late"}]))
        .await;
    let err = s
        .client(p, id, Some(KEY))
        .complete(&simple_request())
        .await
        .expect_err("gives up");
    match &err {
        ModelError::Unavailable {
            attempts, status, ..
        } => {
            assert_eq!(*attempts, 4);
            assert_eq!(*status, Some(503));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(err.is_retryable());
    assert_eq!(s.calls(id).await.0, 4);
}

async fn case_timeout_is_retried(p: Provider) {
    let s = Standin::start();
    let id = "slow";
    s.script(
        id,
        json!([{"text": "too slow", "delayMs": 3000}, {"text": "quick"}]),
    )
    .await;
    let mut opts = fast();
    opts.timeout = Duration::from_millis(400);
    let client = ModelClient::with_options(&s.spec(p, id), Some(KEY.into()), opts).unwrap();
    let start = Instant::now();
    let (r, attempts) = client.complete_counted(&simple_request()).await;
    let r = r.expect("second attempt answers");
    assert_eq!(attempts, [AttemptOutcome::Timeout, AttemptOutcome::Ok]);
    assert_eq!(r.text.as_deref(), Some("quick"));
    assert!(start.elapsed() < Duration::from_millis(2500));
    assert_eq!(s.calls(id).await.0, 2);
}

async fn case_malformed_arguments_kept_raw(p: Provider) {
    let s = Standin::start();
    let id = "badargs";
    s.script(
        id,
        json!([{
            "toolCalls": [{"name": "refund"}, {"name": "lookup_order", "arguments": {"order": 1}}],
            "rawArguments": "{\"amount\": 5, oops"
        }]),
    )
    .await;
    let r = s
        .client(p, id, Some(KEY))
        .complete(&simple_request())
        .await
        .expect("a malformed call is still a reply");
    assert_eq!(r.tool_calls.len(), 2);
    assert_eq!(r.tool_calls[0].name, "refund");
    assert_eq!(
        r.tool_calls[0].arguments,
        Value::String("{\"amount\": 5, oops".into())
    );
    assert!(!r.tool_calls[0].arguments_are_valid());
    assert_eq!(r.tool_calls[1].arguments, json!({"order": 1}));
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_malformed_body_is_typed_error(p: Provider) {
    let s = Standin::start();
    let id = "garbage";
    s.script(
        id,
        json!([{"rawBody": "<html><body>upstream says hi</body></html>"}, {"text": "must not be reached"}]),
    )
    .await;
    let err = s
        .client(p, id, Some(KEY))
        .complete(&simple_request())
        .await
        .expect_err("not a reply");
    match &err {
        ModelError::Malformed { status, excerpt } => {
            assert_eq!(*status, 200);
            assert!(excerpt.contains("upstream says hi"), "{excerpt}");
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_oversized_reply_is_refused(p: Provider) {
    let s = Standin::start();
    let id = "huge";
    let big = "x".repeat(agentrun::model::MAX_REPLY_BYTES + 1);
    s.script(id, json!([{"text": big}, {"text": "must not be reached"}]))
        .await;
    let err = s
        .client(p, id, Some(KEY))
        .complete(&simple_request())
        .await
        .expect_err("a reply past the cap is not a reply");
    match &err {
        ModelError::Malformed { excerpt, .. } => {
            assert!(excerpt.contains("larger than"), "{excerpt}")
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_missing_key_is_unauthorized(p: Provider) {
    let s = Standin::start();
    let id = "nokey";
    s.script(id, json!([{"text": "must not be reached"}])).await;
    let err = s
        .client(p, id, None)
        .complete(&simple_request())
        .await
        .expect_err("no key, no answer");
    match &err {
        ModelError::Rejected { status, .. } => assert_eq!(*status, 401),
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(s.calls(id).await.0, 1);
}

async fn case_echoed_key_is_redacted(p: Provider) {
    let s = Standin::start();
    let id = "badkey";
    s.script(id, json!([{"text": "must not be reached"}])).await;
    let key = "invalid-sk-TOPSECRET-4242";
    let client = s.client(p, id, Some(key));
    assert!(!format!("{client:?}").contains("TOPSECRET"));
    let err = client
        .complete(&simple_request())
        .await
        .expect_err("a wrong key is refused");
    match &err {
        // The stand-in echoed the key; the client redacted it.
        ModelError::Rejected { status, message } => {
            assert_eq!(*status, 401);
            assert!(message.contains("Incorrect API key provided"), "{message}");
            assert!(message.contains("[redacted]"), "{message}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert!(!err.to_string().contains("TOPSECRET"), "{err}");
    assert!(!format!("{err:?}").contains("TOPSECRET"), "{err:?}");
    assert_eq!(s.calls(id).await.0, 1);
}
