//! OpenTelemetry traces: OTLP export (HTTP/protobuf) from the controller and
//! the step runner, off unless an OTLP endpoint is configured with the
//! standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none` turn it off again).
//!
//! One trace per run, whatever process reports into it: its id is the run's
//! uid (a UUID is 128 bits, as a trace id), and the run's root span
//! (`invoke_agent`, reported by the controller when the run ends) has an id
//! derived from the uid. Step runners parent their spans on it from the uid
//! alone, so the trace continues across step Jobs and controller restarts
//! without carrying a context anywhere.
//!
//! Only spans of target [`TARGET`] are exported, named and attributed after
//! the OpenTelemetry GenAI semantic conventions; the log lines and the other
//! spans stay in the logs. A replayed record is never reported as a new
//! execution (the step span counts them instead), and no idempotency key is
//! put on a span. Prompt and completion text only with
//! [`CAPTURE_CONTENT_ENV`]`=true`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator, RandomIdGenerator, SdkTracerProvider,
};
use sha2::{Digest, Sha256};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{FilterFn, Filtered};
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` target of spans exported as OpenTelemetry spans.
pub const TARGET: &str = "gen_ai";

/// The GenAI conventions' opt-in for prompt, completion, tool argument and
/// tool result text on spans.
pub const CAPTURE_CONTENT_ENV: &str = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT";

/// What the controller hands on to step Jobs, so that runners report where it
/// does. Not `OTEL_EXPORTER_OTLP_HEADERS`: it may hold the backend's
/// credential, and a Job's spec is readable by whoever can read Jobs in the
/// run's namespace.
pub const PASSED_TO_STEPS: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    CAPTURE_CONTENT_ENV,
];

/// How long a step runner waits for its spans to leave after a model or tool
/// call (when the endpoint did not set a timeout of its own).
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(2);

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();
/// Set once a flush failed: the backend is away, and runs must not wait on it.
static FLUSH_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether the environment asks for trace export.
pub fn configured() -> bool {
    configured_in(|name| std::env::var(name).ok())
}

fn configured_in(get: impl Fn(&str) -> Option<String>) -> bool {
    let set = |name: &str| get(name).is_some_and(|v| !v.trim().is_empty());
    let is =
        |name: &str, value: &str| get(name).is_some_and(|v| v.trim().eq_ignore_ascii_case(value));
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !is("OTEL_SDK_DISABLED", "true")
        && !is("OTEL_TRACES_EXPORTER", "none")
}

/// Whether prompt and completion text may go on spans.
pub fn capture_content() -> bool {
    std::env::var(CAPTURE_CONTENT_ENV).is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// The variables of [`PASSED_TO_STEPS`] set in this process, for step Jobs.
pub fn step_env() -> Vec<(String, String)> {
    PASSED_TO_STEPS
        .iter()
        .filter_map(|name| Some((name.to_string(), std::env::var(name).ok()?)))
        .filter(|(_, v)| !v.is_empty())
        .collect()
}

/// The `tracing` layer exporting [`TARGET`] spans, when [`configured`];
/// `service` is the default `service.name` (`OTEL_SERVICE_NAME` wins).
pub fn layer<S>(
    service: &str,
) -> Option<
    Filtered<
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
        FilterFn,
        S,
    >,
>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    if !configured() {
        return None;
    }
    let provider = match provider(service) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("agentrun: traces are not exported: {e}");
            return None;
        }
    };
    let tracer = provider.tracer("agentrun");
    let _ = PROVIDER.set(provider);
    let only_ours: FilterFn = FilterFn::new(|meta| meta.target() == TARGET);
    Some(
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_threads(false)
            .with_location(false)
            .with_tracked_inactivity(false)
            .with_filter(only_ours),
    )
}

/// Why traces cannot be exported (the process runs on without them).
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error(
        "{var}={protocol}: only http/protobuf is built in (point the endpoint at the collector's OTLP/HTTP port)"
    )]
    Protocol { var: &'static str, protocol: String },
    #[error("building the OTLP exporter: {0}")]
    Build(opentelemetry_otlp::ExporterBuildError),
}

fn provider(service: &str) -> Result<SdkTracerProvider, ExportError> {
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Ok(p) = std::env::var(var)
            && !p.is_empty()
        {
            if p != "http/protobuf" {
                return Err(ExportError::Protocol { var, protocol: p });
            }
            break;
        }
    }
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http();
    let timeout_set = [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|t| !t.is_empty()));
    if !timeout_set {
        use opentelemetry_otlp::WithExportConfig as _;
        exporter = exporter.with_timeout(DEFAULT_EXPORT_TIMEOUT);
    }
    let exporter = exporter.build().map_err(ExportError::Build)?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(500))
                .build(),
        )
        .build();
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| service.to_string());
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_id_generator(RunIds::default())
        .with_resource(Resource::builder().with_service_name(service).build())
        .build())
}

/// Waits until the spans ended so far have left (a step runner calls this
/// after each model and tool call, so that a crash right after the call's
/// record loses no span). Gives up for good after one failure: a tracing
/// backend that is away must not slow the runs down.
pub async fn flush() {
    let Some(provider) = PROVIDER.get() else {
        return;
    };
    if FLUSH_FAILED.load(Ordering::Relaxed) {
        return;
    }
    let provider = provider.clone();
    let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await;
    if !matches!(flushed, Ok(Ok(()))) {
        FLUSH_FAILED.store(true, Ordering::Relaxed);
        tracing::warn!(result = ?flushed, "exporting traces failed; spans go on in the background");
    }
}

/// Exports what is left and stops the exporter (at the end of a process).
pub async fn shutdown() {
    if let Some(provider) = PROVIDER.get() {
        let provider = provider.clone();
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
}

/// The trace id of a run: its uid's 128 bits (or, for a uid that is not a
/// UUID, the first 16 bytes of its sha256).
pub fn run_trace_id(uid: &str) -> TraceId {
    let hex: String = uid.chars().filter(|c| *c != '-').collect();
    if hex.len() == 32
        && let Ok(bits) = u128::from_str_radix(&hex, 16)
        && bits != 0
    {
        return TraceId::from_bytes(bits.to_be_bytes());
    }
    let digest = Sha256::digest(format!("agentrun.trace:{uid}").as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    TraceId::from_bytes(bytes)
}

/// The span id of a run's root span (`invoke_agent`).
pub fn run_root_span_id(uid: &str) -> SpanId {
    let digest = Sha256::digest(format!("agentrun.root:{uid}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    if bytes == [0; 8] {
        bytes[7] = 1;
    }
    SpanId::from_bytes(bytes)
}

/// The run's root span as a remote parent, for spans of its steps.
pub fn run_parent(uid: &str) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(
        run_trace_id(uid),
        run_root_span_id(uid),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    ))
}

/// A finished run, for its root span.
pub struct FinishedRun<'a> {
    pub uid: &'a str,
    pub name: &'a str,
    pub namespace: &'a str,
    pub agent: &'a str,
    pub model: &'a str,
    pub phase: &'a str,
    /// Not Succeeded. The run's error text stays off the span: it may quote
    /// an idempotency key (a call a human must reconcile).
    pub failed: bool,
    pub started: SystemTime,
    pub finished: SystemTime,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub steps: u64,
}

/// Reports the run's root span, `invoke_agent {agent}`, from its start to its
/// end (the controller, once, when the run reaches a final phase).
pub fn report_finished_run(run: &FinishedRun<'_>) {
    let Some(provider) = PROVIDER.get() else {
        return;
    };
    let tracer = provider.tracer("agentrun");
    let mut attributes = vec![
        KeyValue::new("gen_ai.operation.name", "invoke_agent"),
        KeyValue::new("gen_ai.agent.name", run.agent.to_string()),
        KeyValue::new("gen_ai.request.model", run.model.to_string()),
        KeyValue::new("gen_ai.usage.input_tokens", run.input_tokens as i64),
        KeyValue::new("gen_ai.usage.output_tokens", run.output_tokens as i64),
        KeyValue::new("agentrun.run.name", run.name.to_string()),
        KeyValue::new("agentrun.run.namespace", run.namespace.to_string()),
        KeyValue::new("agentrun.run.uid", run.uid.to_string()),
        KeyValue::new("agentrun.run.phase", run.phase.to_string()),
        KeyValue::new("agentrun.log.records", run.steps as i64),
    ];
    if run.failed {
        attributes.push(KeyValue::new("error.type", run.phase.to_string()));
    }
    let builder = tracer
        .span_builder(format!("invoke_agent {}", run.agent))
        .with_kind(SpanKind::Internal)
        .with_start_time(run.started)
        .with_attributes(attributes);
    let mut span = RunIds::with_root(run.uid, || {
        builder.start_with_context(&tracer, &Context::new())
    });
    if run.failed {
        span.set_status(Status::error(format!("the run ended {}", run.phase)));
    }
    span.end_with_timestamp(run.finished.max(run.started));
}

thread_local! {
    static ROOT_IDS: std::cell::Cell<Option<(TraceId, SpanId)>> = const { std::cell::Cell::new(None) };
}

/// Random ids, except for a run's root span, whose ids are the run's: the
/// SDK's span builder takes no ids of its own, so [`RunIds::with_root`]
/// hands them to the generator for the one span started on this thread.
#[derive(Debug, Default)]
struct RunIds(RandomIdGenerator);

impl RunIds {
    fn with_root<T>(uid: &str, start: impl FnOnce() -> T) -> T {
        ROOT_IDS.with(|ids| ids.set(Some((run_trace_id(uid), run_root_span_id(uid)))));
        let started = start();
        ROOT_IDS.with(|ids| ids.set(None));
        started
    }
}

impl IdGenerator for RunIds {
    fn new_trace_id(&self) -> TraceId {
        match ROOT_IDS.with(|ids| ids.get()) {
            Some((trace, _)) => trace,
            None => self.0.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        match ROOT_IDS.with(|ids| ids.get()) {
            Some((_, span)) => span,
            None => self.0.new_span_id(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_trace_id_is_its_uid() {
        let id = run_trace_id("2b1f6c1e-8d5a-4c4e-9a53-0e6f1d2c3b4a");
        assert_eq!(id.to_string(), "2b1f6c1e8d5a4c4e9a530e6f1d2c3b4a");
        // Not a UUID: still one stable id per run.
        assert_eq!(run_trace_id("run-1"), run_trace_id("run-1"));
        assert_ne!(run_trace_id("run-1"), run_trace_id("run-2"));
        assert_ne!(run_trace_id("run-1"), TraceId::INVALID);
    }

    #[test]
    fn steps_parent_on_the_runs_root_span() {
        let uid = "2b1f6c1e-8d5a-4c4e-9a53-0e6f1d2c3b4a";
        let cx = run_parent(uid);
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_id(), run_trace_id(uid));
        assert_eq!(sc.span_id(), run_root_span_id(uid));
        assert_ne!(run_root_span_id(uid), run_root_span_id("other"));
    }

    #[test]
    fn export_is_off_unless_an_endpoint_is_set() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!configured_in(env(&[])));
        assert!(!configured_in(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])));
        assert!(configured_in(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://collector:4318"
        )])));
        assert!(configured_in(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://collector:4318/v1/traces"
        )])));
        assert!(!configured_in(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_SDK_DISABLED", "true")
        ])));
        assert!(!configured_in(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
    }

    #[test]
    fn no_credential_header_is_handed_to_step_jobs() {
        assert!(!PASSED_TO_STEPS.iter().any(|v| v.contains("HEADERS")));
    }
}
