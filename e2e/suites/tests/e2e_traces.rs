//! OpenTelemetry traces end to end, in a real tracing backend: Jaeger built
//! from its Go module (`e2e/jaeger`), fed over OTLP/HTTP by the controller
//! and the step pods, read back through Jaeger's query API.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use agentrun::api::Phase;
use agentrun::replay::Entry;
use common::world::{World, call, finish};
use kube::ResourceExt as _;
use serde_json::{Value, json};

/// Runs `e2e/jaeger ARG` (starting Jaeger, building it first if needed) and
/// returns its stdout; fails loudly.
fn e2e_jaeger(arg: &str) -> String {
    common::scripts::e2e_script("jaeger", arg, &[], "Jaeger is required for this test")
}

/// One span as Jaeger's query API gives it.
#[derive(Debug)]
struct JSpan {
    id: String,
    parent: Option<String>,
    name: String,
    service: String,
    tags: HashMap<String, Value>,
}

impl JSpan {
    fn tag(&self, key: &str) -> Option<String> {
        self.tags.get(key).map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

/// The spans of trace `trace_id` (none while Jaeger has not seen it).
async fn trace_spans(query: &str, trace_id: &str) -> Vec<JSpan> {
    let resp = reqwest::get(format!("{query}/api/traces/{trace_id}"))
        .await
        .expect("querying Jaeger");
    if resp.status() == 404 {
        return Vec::new();
    }
    let body: Value = resp.json().await.expect("Jaeger's answer is JSON");
    let Some(trace) = body["data"].get(0) else {
        return Vec::new();
    };
    let services: HashMap<&str, &str> = trace["processes"]
        .as_object()
        .map(|p| {
            p.iter()
                .map(|(k, v)| (k.as_str(), v["serviceName"].as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    trace["spans"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| JSpan {
            id: s["spanID"].as_str().unwrap_or("").to_string(),
            parent: s["references"]
                .as_array()
                .and_then(|r| r.iter().find(|r| r["refType"] == "CHILD_OF"))
                .and_then(|r| r["spanID"].as_str())
                .map(str::to_string),
            name: s["operationName"].as_str().unwrap_or("").to_string(),
            service: services
                .get(s["processID"].as_str().unwrap_or(""))
                .copied()
                .unwrap_or("")
                .to_string(),
            tags: s["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| {
                    (
                        t["key"].as_str().unwrap_or("").to_string(),
                        t["value"].clone(),
                    )
                })
                .collect(),
        })
        .collect()
}

#[tokio::test]
async fn a_run_killed_mid_step_is_one_trace_with_each_call_reported_once() {
    e2e_jaeger("up");
    let otlp = e2e_jaeger("otlp-endpoint");
    let query = e2e_jaeger("query-url");
    let w = World::with_controller_env(
        "traces",
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ],
    )
    .await;
    let replies = json!([
        call("lookup_order", json!({"orderId": "1042"})),
        call("issue_refund", json!({"orderId": "1042", "amount": 40})),
        finish("refunded 40")
    ]);
    w.standins.script("tr", replies, json!([])).await;
    // The first step pod dies right after recording its first model answer.
    w.create_run(
        "tr",
        json!({"input": "Refund order 1042.", "agent": w.agent("tr")}),
        json!({"agentrun.dev/failpoint": "after-append:ModelCall"}),
    )
    .await;
    let run = w.wait_phase("tr", Phase::Succeeded).await;
    let log = w.log(&run).await;
    let model_calls = log
        .iter()
        .filter(|(_, s)| matches!(s, Entry::ModelCall(_)))
        .count();
    let tool_results = log
        .iter()
        .filter(|(_, s)| matches!(s, Entry::ToolResult(_)))
        .count();
    let keys: Vec<String> = log
        .iter()
        .filter_map(|(_, s)| match s {
            Entry::ToolIntent(i) => Some(i.key.clone()),
            _ => None,
        })
        .collect();
    assert_eq!((model_calls, tool_results, keys.len()), (3, 2, 2));

    // The trace is the run's uid; wait until its root span has arrived.
    let trace_id = run.uid().unwrap().replace('-', "");
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = trace_spans(&query, &trace_id).await;
        if spans.iter().any(|s| s.name.starts_with("invoke_agent")) {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "no invoke_agent span in trace {trace_id} after 60 s; spans so far: {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let named = |prefix: &str| -> Vec<&JSpan> {
        spans
            .iter()
            .filter(|s| s.name.starts_with(prefix))
            .collect()
    };

    // One root: the run, reported by the controller.
    let roots = named("invoke_agent");
    assert_eq!(roots.len(), 1, "{roots:#?}");
    let root = roots[0];
    assert_eq!(root.name, "invoke_agent tr");
    assert_eq!(root.parent, None);
    assert_eq!(root.service, "agentrun-controller");
    assert_eq!(
        root.tag("gen_ai.operation.name").as_deref(),
        Some("invoke_agent")
    );
    assert_eq!(root.tag("gen_ai.request.model").as_deref(), Some("gpt-e2e"));
    assert_eq!(root.tag("agentrun.run.phase").as_deref(), Some("Succeeded"));
    let usage = run.status.as_ref().and_then(|s| s.usage.clone()).unwrap();
    assert_eq!(
        root.tag("gen_ai.usage.input_tokens"),
        Some(usage.input_tokens.to_string())
    );

    // Steps: children of the root, from the step pods. The killed attempt
    // never ended its span; the one after it replayed, and says so.
    let steps = named("step ");
    assert!(!steps.is_empty());
    for s in &steps {
        assert_eq!(s.parent.as_deref(), Some(root.id.as_str()), "{s:#?}");
        assert_eq!(s.service, "agentrun-step");
    }
    // The first attempt to end found RunStarted and the recorded ModelCall.
    let resumed = steps
        .iter()
        .filter_map(|s| Some((s.tags.get("agentrun.log.replayed")?.as_i64()?, s)))
        .min_by_key(|(replayed, _)| *replayed)
        .unwrap_or_else(|| panic!("no step span counts its replay: {steps:#?}"));
    assert_eq!(resumed.0, 2, "{:#?}", resumed.1);

    // Every model call and tool call was made once, and reported once: the
    // answer recorded before the kill is replayed, not reported again.
    let chats = named("chat ");
    assert_eq!(
        chats.len(),
        model_calls,
        "one chat span per recorded model call: {chats:#?}"
    );
    assert_eq!(w.standins.model_requests("tr").await.len(), model_calls);
    for c in &chats {
        assert_eq!(c.name, "chat gpt-e2e");
        assert_eq!(c.tag("gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(c.tag("gen_ai.provider.name").as_deref(), Some("openai"));
        assert_eq!(c.tag("span.kind").as_deref(), Some("client"));
        assert!(c.tag("gen_ai.usage.output_tokens").is_some(), "{c:#?}");
    }
    let tools = named("execute_tool ");
    assert_eq!(tools.len(), tool_results, "{tools:#?}");
    let tool_names: HashSet<String> = tools
        .iter()
        .filter_map(|t| t.tag("gen_ai.tool.name"))
        .collect();
    assert_eq!(
        tool_names,
        HashSet::from(["lookup_order".to_string(), "issue_refund".to_string()])
    );
    // Calls hang under step spans: those of the attempt killed before its
    // span ended point at a span Jaeger never got, the others at theirs.
    let step_ids: HashSet<&str> = steps.iter().map(|s| s.id.as_str()).collect();
    let orphans = chats
        .iter()
        .chain(&tools)
        .filter(|c| !step_ids.contains(c.parent.as_deref().unwrap_or("")))
        .count();
    assert!(
        orphans <= 1,
        "only the killed attempt's call lacks its step span"
    );

    // No idempotency key on any span, nor any text without the opt-in.
    for s in &spans {
        for (k, v) in &s.tags {
            let v = v.to_string();
            assert!(
                !keys.iter().any(|key| v.contains(key.as_str())),
                "span {} carries an idempotency key in {k}",
                s.name
            );
            assert!(
                !k.starts_with("gen_ai.input") && !k.starts_with("gen_ai.output"),
                "span {} carries {k} without the opt-in",
                s.name
            );
        }
    }
}
