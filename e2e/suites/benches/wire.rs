//! A container agent's cost at the wire (run by `bash e2e/bench wire`, or
//! `cargo bench -p agentrun-suites --bench wire`).
//!
//! Prints one line per figure: `bench: wire.<name> <value> <unit>`.
//!
//! One agent program, written here the way framework agents talk (Chat
//! Completions, its tool through the official MCP client), makes CALLS
//! model requests, each answered with one `create_ticket` call it makes
//! through MCP. It runs twice against the same stand-ins (the model and the
//! MCP server of `agentrun-standins`):
//!
//! - **direct**: the agent talks to the stand-ins itself;
//! - **runner**: the agent talks to `agentrun step` serving it on loopback,
//!   which records every answer in the step log (SQLite in a temporary
//!   directory, the runner's own append path) before returning it, and
//!   calls the stand-ins itself.
//!
//! Figures: `wire.model.{direct,runner}.p50_ms` and `wire.model.overhead.p50_ms`
//! (runner minus direct: what agentrun adds to a model call, its recording
//! included), the same for `wire.tool` (an MCP tool call: classified,
//! intended with its key, made, recorded), and `wire.replay.answers_per_s`:
//! a new step of the same run, the agent started over, every answer served
//! from the log (the rate from the agent's first request to its exit);
//! `wire.replay.served_per_s`, the same answers per second the agent
//! waited for them (the runner's pace, the agent's own work left out), and
//! `wire.direct.answers_per_s`, the agent's pace straight to the stand-ins
//! (a bound on the wall rate, whatever serves it).
//!
//! Environment: AGENTRUN_WIRE_BENCH_CALLS (200). Without `--bench` (`cargo
//! test`, which `e2e/test` runs): check mode, 20 calls, and the promises
//! behind the figures asserted (every answer recorded once, the model asked
//! once per answer, nothing asked or called on replay).

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun::replay::Entry;
use agentrun::runlog::records::{Outcome, RunStarted, Versions};
use agentrun::step::runner::{LEASE_TTL, StepArgs, run_on};
use agentrun::store::{self, Head, StepStore};
use agentrun::wire::loopback::{AgentExit, EXIT_PATH, READY_PATH};
use agentrun_standins::Standins;
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::{Value, json};

// The operator binary's allocator: the runner measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RUN: &str = "wire-bench-run";
const KEY: &str = "pod-key";
const MODEL_KEY: &str = "model-key";

fn figure(name: &str, value: f64, unit: &str) {
    let v = if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    };
    println!("bench: wire.{name} {v} {unit}");
}

/// Seconds from the agent's first request to its end.
fn wall(t: &Timings) -> f64 {
    (t.ended.unwrap() - t.started.unwrap()).as_secs_f64()
}

/// Seconds the agent waited for answers (model and tool).
fn waited(t: &Timings) -> f64 {
    t.model
        .iter()
        .chain(&t.tool)
        .sum::<Duration>()
        .as_secs_f64()
}

fn p50(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

/// Where the agent's model and tools are.
struct Endpoints {
    /// The OpenAI base URL (ending in `/v1`).
    model: String,
    model_key: String,
    mcp: String,
    /// The runner's loopback (to report the exit to), if behind one.
    runner: Option<String>,
}

/// What the agent measured.
#[derive(Default)]
struct Timings {
    model: Vec<Duration>,
    tool: Vec<Duration>,
    started: Option<Instant>,
    ended: Option<Instant>,
}

/// The agent: the model proposes one ticket per turn; it makes each call
/// through MCP and asks again, until a plain answer.
async fn agent(at: Endpoints) -> Timings {
    let http = reqwest::Client::new();
    let mut t = Timings::default();
    if let Some(runner) = &at.runner {
        loop {
            let ready = http
                .get(format!("{runner}{READY_PATH}"))
                .bearer_auth(KEY)
                .send()
                .await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    t.started = Some(Instant::now());
    let mcp =
        ().serve(StreamableHttpClientTransport::from_uri(at.mcp.clone()))
            .await
            .expect("MCP session");
    let tools: Vec<Value> = mcp
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": *t.input_schema}}))
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": "You open tickets."}),
        json!({"role": "user", "content": "Open the tickets."}),
    ];
    loop {
        let asked = Instant::now();
        let reply = http
            .post(format!("{}/chat/completions", at.model))
            .bearer_auth(&at.model_key)
            .json(&json!({"model": "gpt-4o-mini", "messages": messages, "tools": tools}))
            .send()
            .await
            .expect("model request");
        let status = reply.status();
        let body: Value = reply.json().await.expect("model answer");
        t.model.push(asked.elapsed());
        assert!(status.is_success(), "model: {status} {body}");
        let message = body["choices"][0]["message"].clone();
        messages.push(message.clone());
        let calls = message["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if calls.is_empty() {
            break;
        }
        for call in calls {
            let arguments: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            let params =
                CallToolRequestParams::new(call["function"]["name"].as_str().unwrap().to_string())
                    .with_arguments(arguments.as_object().unwrap().clone());
            let called = Instant::now();
            let result = mcp.call_tool(params).await.expect("tools/call");
            t.tool.push(called.elapsed());
            let text: String = result
                .content
                .iter()
                .filter_map(|c| c.as_text().map(|t| t.text.clone()))
                .collect();
            messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": text}));
        }
    }
    t.ended = Some(Instant::now());
    let _ = mcp.cancel().await;
    if let Some(runner) = &at.runner {
        let exit = AgentExit {
            code: 0,
            result: None,
            result_unreadable: None,
        };
        http.post(format!("{runner}{EXIT_PATH}"))
            .bearer_auth(KEY)
            .json(&exit)
            .send()
            .await
            .expect("exit report");
    }
    t
}

/// CALLS turns each proposing one ticket, then a plain answer.
fn replies(calls: usize) -> Value {
    let mut r: Vec<Value> = (0..calls)
        .map(|i| {
            json!({"text": format!("Ticket {i}."), "toolCalls": [
                {"name": "create_ticket", "arguments": {"title": format!("ticket {i}"), "priority": "low"}}]})
        })
        .collect();
    r.push(json!({"text": "All tickets are open."}));
    Value::Array(r)
}

/// The run's start: a container agent whose model and MCP tool are the
/// stand-ins' (the tool's listing pinned, as discovery pins it).
fn run_started(base: &str, script: &str, tenant: &str) -> Entry {
    let agent = serde_json::from_value(json!({
        "prompt": {"version": "v1", "system": ""},
        "model": {"provider": "OpenAI", "name": "gpt-bench", "endpoint": format!("{base}/scripts/{script}/v1")},
        "tools": [{"name": "create_ticket", "mcp": {"url": format!("{base}/mcp/{tenant}")}}],
    }))
    .expect("agent");
    let catalog: agentrun::tools::McpCatalog = serde_json::from_value(json!({
        "create_ticket": {"name": "create_ticket", "description": "Opens a ticket.",
                          "inputSchema": {"type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "string"}}},
                          "annotations": {"destructiveHint": true}}
    }))
    .expect("catalog");
    let container = serde_json::from_value(json!({"image": "bench/agent:1", "command": ["agent"]}))
        .expect("container");
    Entry::RunStarted(RunStarted {
        container: Some(container),
        run_name: "wire-bench".into(),
        namespace: "bench".into(),
        input: "Open the tickets.".into(),
        agent,
        tools: vec![],
        mcp: catalog.into(),
        versions: Versions::default(),
    })
}

async fn store_with(dir: &std::path::Path, log: &[Entry]) -> Arc<dyn StepStore> {
    let url = format!("sqlite://{}", dir.join("log.db").display());
    let store = store::open(&url).await.expect("SQLite store");
    let lease = store.acquire(RUN, "bench", LEASE_TTL).await.unwrap();
    let mut head = Head::EMPTY;
    for entry in log {
        let record = entry.draft().seal(&head).unwrap();
        head = store
            .append(RUN, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    store
}

async fn read(store: &dyn StepStore) -> Vec<Entry> {
    store
        .read_verified(RUN, None)
        .await
        .unwrap()
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect()
}

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// One step of the run in `store` with the agent behind the runner.
async fn through_runner(store: Arc<dyn StepStore>) -> Timings {
    let addr = free_addr();
    let url = format!("http://{addr}");
    let args = StepArgs {
        run_uid: RUN.into(),
        run_name: "wire-bench".into(),
        store_url: String::new(),
        log_anchor: None,
        controller_key: None,
        signed_from: 0,
        bound_from: 0,
        signing_keys: None,
        model_api_key: Some(MODEL_KEY.into()),
        worker: "bench".into(),
        attempt: 1,
        time_slice_seconds: 60,
        step_timeout_seconds: None,
        loopback_addr: Some(addr),
        runner_key: Some(KEY.into()),
    };
    let agent = tokio::spawn(agent(Endpoints {
        model: format!("{url}/v1"),
        model_key: KEY.into(),
        mcp: format!("{url}/mcp/{}", mcp_server_name()),
        runner: Some(url),
    }));
    run_on(args, store).await.expect("the step");
    agent.await.expect("the agent")
}

/// The served MCP server's name: the stand-ins' host label (`127`).
fn mcp_server_name() -> String {
    let spec: agentrun::api::ToolSpec = serde_json::from_value(
        json!({"name": "create_ticket", "mcp": {"url": "http://127.0.0.1:1/mcp/x"}}),
    )
    .unwrap();
    agentrun::wire::servers::tool_servers(&[spec])[0]
        .name
        .clone()
}

#[tokio::main]
async fn main() {
    let check = !std::env::args().any(|a| a == "--bench");
    if check
        && std::env::args()
            .skip(1)
            .any(|a| !a.starts_with('-') && !"wire".contains(a.as_str()))
    {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let calls: usize = match check {
        true => 20,
        false => std::env::var("AGENTRUN_WIRE_BENCH_CALLS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200),
    };
    let standins = Standins::start();
    let base = standins.base.clone();

    // Direct: the agent talks to the stand-ins.
    standins.script("direct", replies(calls), json!([])).await;
    let direct = agent(Endpoints {
        model: format!("{base}/scripts/direct/v1"),
        model_key: MODEL_KEY.into(),
        mcp: format!("{base}/mcp/wire-direct"),
        runner: None,
    })
    .await;

    // Through the runner, recording: a run from its start.
    standins.script("runner", replies(calls), json!([])).await;
    let dir = tempfile::tempdir().unwrap();
    let started = run_started(&base, "runner", "wire-runner");
    let store = store_with(dir.path(), std::slice::from_ref(&started)).await;
    let live = through_runner(store.clone()).await;
    let log = read(&*store).await;
    let asked = standins.model_requests("runner").await.len();

    // Replay: the same run, the agent started over, its end not yet recorded.
    let dir2 = tempfile::tempdir().unwrap();
    let replay_store = store_with(dir2.path(), &log[..log.len() - 1]).await;
    let replayed = through_runner(replay_store.clone()).await;
    let served = replayed.model.len() + replayed.tool.len();
    let replay_secs = wall(&replayed);

    let model = (p50(direct.model.clone()), p50(live.model.clone()));
    let tool = (p50(direct.tool.clone()), p50(live.tool.clone()));
    figure("model.direct.p50_ms", model.0, "ms");
    figure("model.runner.p50_ms", model.1, "ms");
    figure("model.overhead.p50_ms", model.1 - model.0, "ms");
    figure("tool.direct.p50_ms", tool.0, "ms");
    figure("tool.runner.p50_ms", tool.1, "ms");
    figure("tool.overhead.p50_ms", tool.1 - tool.0, "ms");
    figure(
        "replay.answers_per_s",
        served as f64 / replay_secs,
        "answers/s",
    );
    // The runner's side of replay: answers per second of waiting for them
    // (the agent's own work between requests left out), and, for
    // reference, the agent's pace straight to the stand-ins (a bound on
    // the wall rate whatever serves it).
    figure(
        "replay.served_per_s",
        served as f64 / waited(&replayed),
        "answers/s",
    );
    figure(
        "direct.answers_per_s",
        (direct.model.len() + direct.tool.len()) as f64 / wall(&direct),
        "answers/s",
    );

    let model_calls = log
        .iter()
        .filter(|e| matches!(e, Entry::ModelCall(_)))
        .count();
    assert_eq!(model_calls, calls + 1, "every model answer recorded once");
    assert_eq!(asked, calls + 1, "the model asked once per answer");
    let Some(Entry::Observation(o)) = log.last() else {
        panic!("the run's end is recorded")
    };
    assert_eq!(o.stop.as_ref().map(|s| s.outcome), Some(Outcome::Succeeded));
    assert_eq!(
        standins.model_requests("runner").await.len(),
        asked,
        "nothing asked on replay"
    );
    let tickets = standins.get::<Value>("/mcp-effects/wire-runner").await;
    assert_eq!(
        tickets["tickets"].as_array().map(Vec::len),
        Some(calls),
        "each ticket opened once"
    );
    assert_eq!(read(&*replay_store).await.len(), log.len());
}
