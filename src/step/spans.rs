//! The step runner's OpenTelemetry spans, after the GenAI semantic
//! conventions: one `step` span per Job attempt (a child of the run's root
//! span), with a `chat` span for each model call and an `execute_tool` span
//! for each tool call it really makes. Records found in the log and replayed
//! are counted on the step span, never reported as calls; no idempotency key
//! goes on a span. Exported only when traces are configured
//! ([`crate::telemetry::trace`]).

use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::api::Provider;
use crate::model::{ModelClient, ModelError, ModelRequest, ModelResponse};
use crate::telemetry::trace::{self, TARGET};
use crate::tools::ToolOutcome;

/// The span of one step Job attempt, parented on the run's root span.
pub fn step(run_name: &str, run_uid: &str, attempt: u32, pod: &str) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "step",
        otel.name = %format!("step {run_name}"),
        otel.kind = "internal",
        otel.status_code = Empty,
        error.type = Empty,
        agentrun.run.name = %run_name,
        agentrun.run.uid = %run_uid,
        agentrun.step.attempt = i64::from(attempt),
        agentrun.pod = %pod,
        agentrun.log.replayed = Empty,
        agentrun.log.appended = Empty,
    );
    let _ = span.set_parent(trace::run_parent(run_uid));
    span
}

/// Records how many records the attempt found (replayed, not re-executed)
/// and how many it appended.
pub fn record_log(span: &Span, replayed: u64, appended: u64) {
    // As i64: tracing-opentelemetry reports other integers as text.
    span.record("agentrun.log.replayed", replayed as i64);
    span.record("agentrun.log.appended", appended as i64);
}

/// Marks the span failed with `kind` (a low-cardinality `error.type`).
pub fn record_error(span: &Span, kind: &str) {
    span.record("otel.status_code", "error");
    span.record("error.type", kind);
}

fn provider_name(p: Provider) -> &'static str {
    match p {
        Provider::OpenAI => "openai",
        Provider::Anthropic => "anthropic",
    }
}

/// The span of one model call, `chat {model}`.
pub fn chat(client: &ModelClient, request: &ModelRequest) -> Span {
    let server = url::Url::parse(client.url()).ok();
    let span = tracing::info_span!(
        target: TARGET,
        "chat",
        otel.name = %format!("chat {}", client.model_name()),
        otel.kind = "client",
        otel.status_code = Empty,
        error.type = Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = provider_name(client.provider()),
        gen_ai.request.model = %client.model_name(),
        gen_ai.response.model = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.system_instructions = Empty,
        gen_ai.input.messages = Empty,
        gen_ai.output.messages = Empty,
        server.address = server.as_ref().and_then(|u| u.host_str()).unwrap_or(""),
        server.port = server.as_ref().and_then(|u| u.port_or_known_default()).map_or(0, i64::from),
    );
    if trace::capture_content() {
        span.record("gen_ai.system_instructions", request.system.as_str());
        span.record(
            "gen_ai.input.messages",
            serde_json::to_string(&request.messages)
                .unwrap_or_default()
                .as_str(),
        );
    }
    span
}

/// What the model answered (or why not), on its `chat` span.
pub fn record_chat(span: &Span, result: &Result<ModelResponse, ModelError>) {
    match result {
        Ok(r) => {
            span.record("gen_ai.response.model", r.model_id.as_str());
            if let Some(reason) = &r.stop_reason {
                span.record(
                    "gen_ai.response.finish_reasons",
                    format!("[{:?}]", reason).as_str(),
                );
            }
            span.record("gen_ai.usage.input_tokens", r.usage.input_tokens as i64);
            span.record("gen_ai.usage.output_tokens", r.usage.output_tokens as i64);
            if trace::capture_content() {
                let output = serde_json::json!({"text": r.text, "toolCalls": r.tool_calls});
                span.record("gen_ai.output.messages", output.to_string().as_str());
            }
        }
        Err(e) => record_error(span, model_error_type(e)),
    }
}

fn model_error_type(e: &ModelError) -> &'static str {
    match e {
        ModelError::Malformed { .. } => "malformed_reply",
        e if e.is_retryable() => "unavailable",
        _ => "refused",
    }
}

/// The span of one tool call, `execute_tool {tool}`; `call_id` is the
/// model's id for the call (not the idempotency key).
pub fn execute_tool(tool: &str, call_id: &str, arguments: &serde_json::Value) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "execute_tool",
        otel.name = %format!("execute_tool {tool}"),
        otel.kind = "internal",
        otel.status_code = Empty,
        error.type = Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %tool,
        gen_ai.tool.type = "function",
        gen_ai.tool.call.id = %call_id,
        gen_ai.tool.call.arguments = Empty,
        gen_ai.tool.call.result = Empty,
    );
    if trace::capture_content() {
        span.record("gen_ai.tool.call.arguments", arguments.to_string().as_str());
    }
    span
}

/// The tool's outcome on its `execute_tool` span.
pub fn record_tool(span: &Span, outcome: &ToolOutcome) {
    match outcome {
        ToolOutcome::Ok(value) if trace::capture_content() => {
            span.record("gen_ai.tool.call.result", value.to_string().as_str());
        }
        ToolOutcome::Ok(_) => {}
        ToolOutcome::Failed { .. } => record_error(span, "tool_error"),
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanKind, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::FilterFn;
    use tracing_subscriber::prelude::*;

    use super::*;
    use crate::api::ModelSpec;
    use crate::model::{TokenUsage, ToolCall};

    /// Runs `f` with spans exported to memory, as `telemetry::init` would.
    fn exported(f: impl FnOnce()) -> Vec<SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("test"))
            .with_filter(FilterFn::new(|m| m.target() == TARGET));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, f);
        provider.force_flush().unwrap();
        exporter.get_finished_spans().unwrap()
    }

    fn attr(span: &SpanData, key: &str) -> Option<String> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    }

    #[test]
    fn a_model_call_is_a_chat_span_in_the_steps_span_in_the_runs_trace() {
        let uid = "2b1f6c1e-8d5a-4c4e-9a53-0e6f1d2c3b4a";
        let client = ModelClient::new(
            &ModelSpec {
                name: "gemma-3-270m".into(),
                endpoint: Some("http://127.0.0.1:18080/v1".into()),
                ..Default::default()
            },
            None,
        )
        .unwrap();
        let spans = exported(|| {
            let step = step("refund", uid, 2, "refund-s3-a2");
            let _in_step = step.enter();
            // Something the runner logs under its own spans is not exported.
            tracing::info_span!("model_step").in_scope(|| {
                let chat = chat(&client, &ModelRequest::default());
                record_chat(
                    &chat,
                    &Ok(ModelResponse {
                        text: None,
                        tool_calls: vec![ToolCall {
                            id: "call_1".into(),
                            name: "lookup_order".into(),
                            arguments: serde_json::json!({"orderId": "1042"}),
                        }],
                        usage: TokenUsage {
                            input_tokens: 120,
                            output_tokens: 9,
                        },
                        model_id: "gemma-3-270m-it".into(),
                        stop_reason: Some("tool_calls".into()),
                    }),
                );
            });
            let tool = execute_tool("lookup_order", "call_1", &serde_json::json!({}));
            record_tool(
                &tool,
                &ToolOutcome::Failed {
                    observation: "no such order".into(),
                },
            );
            drop(tool);
            record_log(&step, 4, 2);
        });
        let by_name = |n: &str| {
            spans
                .iter()
                .find(|s| s.name == n)
                .unwrap_or_else(|| panic!("no span {n} in {spans:?}"))
        };
        assert_eq!(spans.len(), 3, "only the GenAI spans are exported");
        let step = by_name("step refund");
        let chat = by_name("chat gemma-3-270m");
        let tool = by_name("execute_tool lookup_order");
        let trace = trace::run_trace_id(uid);
        assert!(spans.iter().all(|s| s.span_context.trace_id() == trace));
        assert_eq!(step.parent_span_id, trace::run_root_span_id(uid));
        assert_eq!(chat.parent_span_id, step.span_context.span_id());
        assert_eq!(tool.parent_span_id, step.span_context.span_id());
        assert_eq!(chat.span_kind, SpanKind::Client);
        assert_eq!(attr(chat, "gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(
            attr(chat, "gen_ai.provider.name").as_deref(),
            Some("openai")
        );
        assert_eq!(
            attr(chat, "gen_ai.request.model").as_deref(),
            Some("gemma-3-270m")
        );
        assert_eq!(
            attr(chat, "gen_ai.response.model").as_deref(),
            Some("gemma-3-270m-it")
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.input_tokens").as_deref(),
            Some("120")
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.output_tokens").as_deref(),
            Some("9")
        );
        assert_eq!(attr(chat, "server.port").as_deref(), Some("18080"));
        assert_eq!(
            attr(tool, "gen_ai.operation.name").as_deref(),
            Some("execute_tool")
        );
        assert_eq!(
            attr(tool, "gen_ai.tool.name").as_deref(),
            Some("lookup_order")
        );
        assert_eq!(attr(tool, "error.type").as_deref(), Some("tool_error"));
        assert_eq!(attr(step, "agentrun.log.replayed").as_deref(), Some("4"));
        assert_eq!(attr(step, "agentrun.log.appended").as_deref(), Some("2"));
        // Content is opt-in: by default no prompt, reply or arguments.
        for s in &spans {
            for kv in &s.attributes {
                let k = kv.key.as_str();
                assert!(
                    !k.contains("messages") && !k.contains("arguments") && !k.contains("result"),
                    "{k} recorded without the opt-in"
                );
            }
        }
    }
}
