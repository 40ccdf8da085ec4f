//! A run against llama-cpp-python's OpenAI-compatible server
//! (`python -m llama_cpp.server --chat_format chatml-function-calling`,
//! Gemma 3 270M on the CPU; `e2e/llama-python`), a model server nobody here
//! wrote that validates requests with its own schema: an assistant turn's
//! `content` must be a string (llama_cpp/llama_types.py), where OpenAI's
//! reference allows null. It offers OpenAI's chat completions only (no
//! Anthropic `/v1/messages`), so that is the format tested here.
//!
//! The second model request replays the first answer's tool call beside its
//! result: the request that server refused (HTTP 500, "Input should be a
//! valid string") while the history sent `content: null`.

mod common;

use std::time::Duration;

use agentrun::api::{AgentRun, Phase};
use agentrun::replay::Entry;
use agentrun::runlog::records::{ModelAttempts, ModelCall};
use common::world::{World, kinds};
use kube::api::Api;
use serde_json::{Value, json};

fn e2e_llama_python(arg: &str) -> String {
    common::scripts::e2e_script(
        "llama-python",
        arg,
        &[],
        "llama-cpp-python's server is required for this test",
    )
}

/// Chat completions the server answered with 200 so far, by its access log
/// (uvicorn's): it keeps no counter of its own.
fn answered(log: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("reading the server's log {log}: {e}"))
        .lines()
        .filter(|l| l.contains("\"POST /v1/chat/completions HTTP/1.1\" 200"))
        .count()
}

/// The server's template does not show the model tool results, so it may
/// call its tool again and again: seven records (start, call, intent,
/// result, call, intent, result) and the budget ends the run before a third
/// model call, after the two this test needs.
fn agent(w: &World, endpoint: &str) -> Value {
    common::world::local_model_agent(w, "OpenAI", endpoint, 7)
}

/// The run once it has ended, whichever way (a model call takes seconds on
/// 2 cores, and a refused one is retried with backoff first).
async fn wait_ended(w: &World, name: &str) -> AgentRun {
    let runs: Api<AgentRun> = Api::namespaced(w.client.clone(), w.name());
    common::wait_for(
        &format!("run {name} to end"),
        Duration::from_secs(300),
        || async {
            let run = runs.get(name).await.map_err(|e| e.to_string())?;
            let phase = run.status.as_ref().and_then(|s| s.phase);
            if phase.is_some_and(|p| p.is_terminal()) {
                Ok(run)
            } else {
                Err(format!("{:?}", run.status))
            }
        },
    )
    .await
}

#[tokio::test]
async fn a_run_through_llama_cpp_python_gets_past_its_second_model_call() {
    e2e_llama_python("up");
    let url = e2e_llama_python("url");
    let server_log = e2e_llama_python("log");
    let w = World::new("llamapy", &[]).await;
    let before = answered(&server_log);
    w.create_run(
        "lookup",
        json!({"input": "Look up order 1042.", "agent": agent(&w, &format!("{url}/v1"))}),
        json!({}),
    )
    .await;
    let run = wait_ended(&w, "lookup").await;
    let status = run.status.clone().unwrap_or_default();
    let log = w.log(&run).await;
    assert!(
        matches!(status.phase, Some(Phase::Succeeded | Phase::BudgetExceeded)),
        "the run ends by its answer or its budget, not by the server refusing it: {:?} {:?}, records {:?}",
        status.phase,
        status.error,
        kinds(&log)
    );

    let calls: Vec<(usize, &ModelCall)> = log
        .iter()
        .enumerate()
        .filter_map(|(i, (_, s))| match s {
            Entry::ModelCall(c) => Some((i, c)),
            _ => None,
        })
        .collect();
    assert!(
        calls.len() >= 2,
        "at least two model calls: {:?}",
        kinds(&log)
    );
    let (first, second) = (calls[0], calls[1]);
    assert!(
        !first.1.response.tool_calls.is_empty(),
        "the first answer is a tool call (chatml-function-calling under its grammar): {:?}",
        first.1.response
    );
    assert!(
        log[first.0..second.0]
            .iter()
            .any(|(_, s)| matches!(s, Entry::ToolResult(_))),
        "a tool result between the two calls: {:?}",
        kinds(&log)
    );
    // The second request, which replays the first answer's tool call, was
    // accepted as sent: one attempt, answered.
    assert_eq!(
        second.1.attempts,
        Some(ModelAttempts {
            provider: "OpenAI".into(),
            outcomes: vec!["ok".into()],
        }),
        "the request replaying a tool call was accepted at once"
    );
    for (_, c) in &calls {
        assert_eq!(c.response.model_id, "gemma-3-270m", "the server's model id");
        assert!(c.response.usage.output_tokens > 0, "usage recorded");
    }
    // Every answer the server gave this run is a recorded model call.
    assert_eq!(
        answered(&server_log) - before,
        calls.len(),
        "answers the server gave = model calls recorded"
    );
    eprintln!(
        "llama-cpp-python: {:?} after {} model calls: {:?}",
        status.phase,
        calls.len(),
        kinds(&log)
    );
}
