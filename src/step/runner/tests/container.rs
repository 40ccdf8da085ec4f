//! A container agent's step in process: the runner serves an agent written
//! here the way framework agents behave (Chat Completions, its tools
//! through the official MCP client), with the stand-in model and tools
//! behind it. A run recorded once is resumed after each of its records:
//! the agent starts over, every recorded answer is served from the log and
//! nothing recorded is asked or called again. Gates, edits and
//! divergence are checked the same way.

use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;

use super::*;
use crate::runlog::v2;
use crate::wire::loopback::{AgentExit, EXIT_PATH, READY_PATH, STOP_PATH};

const KEY: &str = "pod-key";
const SYSTEM: &str = "You refund orders. Look the order up first.";

/// The canned agent as a container agent: no prompt, an image.
fn container_started(started: Entry) -> Entry {
    let Entry::RunStarted(mut started) = started else {
        unreachable!()
    };
    started.container = Some(v2::Container {
        image: "team/refunds:1".into(),
        command: vec!["refund-agent".into()],
        args: vec![],
        env: vec![],
        resources: None,
        matching: None,
    });
    Entry::RunStarted(started)
}

/// The canned turns, the last a plain answer (a container agent ends by
/// exiting, not by a `finish` call).
fn container_turns() -> Vec<Turn> {
    let mut turns = turns();
    *turns.last_mut().unwrap() = (Some("Refunded 25 on A-7 (R-1)."), vec![]);
    turns
}

/// A free port on a loopback address other than 127.0.0.1 (as a node that
/// gives each pod an address of its own does; the runner binds it right
/// after), so the agent names a host the MCP servers must accept.
fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn container_args(addr: &str) -> StepArgs {
    StepArgs {
        loopback_addr: Some(addr.into()),
        runner_key: Some(KEY.into()),
        ..step_args()
    }
}

/// What the agent saw: the tool results it got, and how it ended.
#[derive(Debug, Default)]
struct Seen {
    results: Vec<String>,
    refused: Option<(u16, String)>,
}

/// The agent: asks the model through the runner with its own system
/// prompt, makes each proposed call through MCP, and exits once the model
/// answers without calls (reporting as the shim would).
async fn agent(url: String, system: String) -> Seen {
    let http = reqwest::Client::new();
    let mut seen = Seen::default();
    for _ in 0..400 {
        let ready = http
            .get(format!("{url}{READY_PATH}"))
            .bearer_auth(KEY)
            .send()
            .await;
        if ready.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mcp = ()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "{url}/mcp/tools"
        )))
        .await
        .unwrap();
    let tools: Vec<Value> = mcp
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| json!({"type": "function", "function": {"name": t.name, "parameters": *t.input_schema}}))
        .collect();
    let input = "Refund order A-7.";
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": input}),
    ];
    loop {
        let reply = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&json!({"model": "gpt-4o-mini", "messages": messages, "tools": tools}))
            .send()
            .await
            .unwrap();
        let status = reply.status().as_u16();
        let body: Value = reply.json().await.unwrap();
        if status != 200 {
            seen.refused = Some((status, body["error"]["message"].to_string()));
            return seen;
        }
        let message = body["choices"][0]["message"].clone();
        messages.push(message.clone());
        let calls = message["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if calls.is_empty() {
            let exit = AgentExit {
                code: 0,
                result: message["content"].as_str().map(str::to_string),
                result_unreadable: None,
            };
            let _ = http
                .post(format!("{url}{EXIT_PATH}"))
                .bearer_auth(KEY)
                .json(&exit)
                .send()
                .await;
            return seen;
        }
        for call in calls {
            let name = call["function"]["name"].as_str().unwrap().to_string();
            let arguments: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            let params = CallToolRequestParams::new(name)
                .with_arguments(arguments.as_object().unwrap().clone());
            let result = match mcp.call_tool(params).await {
                Ok(result) => result,
                // The runner is gone (a fenced runner leaves at once).
                Err(e) => {
                    seen.refused = Some((0, e.to_string()));
                    return seen;
                }
            };
            let text = result
                .content
                .iter()
                .filter_map(|c| c.as_text().map(|t| t.text.clone()))
                .collect::<Vec<_>>()
                .join("");
            seen.results.push(text.clone());
            messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": text}));
        }
    }
}

/// Runs one step of the container run in `store` with the agent beside
/// it; the step's result and what the agent saw (`None`: the agent was
/// left waiting, as a gated call leaves it until the pod is stopped).
async fn container_step(
    store: Arc<dyn StepStore>,
    system: &str,
) -> (Result<(), StepError>, Option<Seen>) {
    container_step_of(RUN, store, system).await
}

/// [`container_step`] of run `run_uid`.
async fn container_step_of(
    run_uid: &str,
    store: Arc<dyn StepStore>,
    system: &str,
) -> (Result<(), StepError>, Option<Seen>) {
    let addr = free_addr();
    let agent = tokio::spawn(agent(format!("http://{addr}"), system.to_string()));
    // As the shim does: once the runner says the step is over, the agent
    // is stopped and its end reported.
    let url = format!("http://{addr}");
    let shim = AbortOnDrop(tokio::spawn(async move {
        let http = reqwest::Client::new();
        loop {
            let asked = http
                .get(format!("{url}{STOP_PATH}"))
                .bearer_auth(KEY)
                .send()
                .await;
            if asked.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let exit = AgentExit {
            code: 143,
            result: None,
            result_unreadable: None,
        };
        let _ = http
            .post(format!("{url}{EXIT_PATH}"))
            .bearer_auth(KEY)
            .json(&exit)
            .send()
            .await;
    }));
    let step = tokio::time::timeout(
        Duration::from_secs(60),
        run_on(
            StepArgs {
                run_uid: run_uid.into(),
                ..container_args(&addr)
            },
            store,
        ),
    )
    .await
    .expect("the step ends within 60 s");
    drop(shim);
    let seen = match tokio::time::timeout(Duration::from_secs(5), agent).await {
        Ok(seen) => Some(seen.unwrap()),
        Err(_) => None,
    };
    (step, seen)
}

/// A replay test's log whose agent in force is a container agent (a test
/// that followed its Agent into one, or a forged start): the runner ends it
/// before the agent starts; the model is never asked, no tool reached.
#[tokio::test]
async fn a_container_agent_on_a_replay_tests_log_is_never_run_and_nothing_is_asked_or_called() {
    let standins = Standins::start().await;
    let started = container_started(run_started(&standins.base));
    standins.script(&history_of(started.clone(), container_turns()));
    standins.reset([]);
    let forked = Entry::Forked(crate::runlog::records::Forked::after(
        0,
        Some(crate::runlog::records::Sandbox { calls: vec![] }),
    ));
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), &[started, forked]).await;
    let (step, _) = container_step(store.clone(), SYSTEM).await;
    step.unwrap();
    let log = read_log(&*store).await;
    let stop = stop_of(&log).expect("the runner ends the test");
    assert_eq!(stop.outcome, Outcome::Failed);
    assert!(stop.error.unwrap().contains("container agent"));
    let counts = standins.counts();
    assert_eq!(counts.model_requests, 0, "the model is never asked");
    assert!(
        counts.posts.is_empty(),
        "no tool is reached: {:?}",
        counts.posts
    );
}

/// The run recorded once from its start, then resumed after each of its
/// records: the same log, the agent's same results, every recorded answer
/// asked once and every effect made once.
#[tokio::test]
async fn a_container_run_resumed_after_any_record_asks_and_calls_nothing_twice() {
    let standins = Standins::start().await;
    let started = container_started(run_started(&standins.base));
    standins.script(&history_of(started.clone(), container_turns()));
    standins.reset([]);

    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    let (step, seen) = container_step(store.clone(), SYSTEM).await;
    step.unwrap();
    let whole = read_log(&*store).await;
    let first = seen.expect("the agent ended");
    assert_eq!(first.refused, None);
    let stop = stop_of(&whole).expect("the agent's end is recorded");
    assert_eq!(stop.outcome, Outcome::Succeeded);
    assert_eq!(stop.result.as_deref(), Some("Refunded 25 on A-7 (R-1)."));
    let expected = history_of(started, container_turns());
    let kinds = |l: &[Entry]| l.iter().map(Entry::kind).collect::<Vec<_>>();
    assert_eq!(kinds(&whole[..whole.len() - 1]), kinds(&expected));
    for entry in &whole {
        match entry {
            Entry::ModelCall(m) => assert!(m.request.is_some(), "the request is recorded"),
            Entry::ToolIntent(i) => assert!(i.requested.is_some()),
            _ => {}
        }
    }
    assert_eq!(standins.counts().model_requests, model_calls(&whole));

    for n in 1..whole.len() {
        let prefix = &whole[..n];
        let done = prefix.iter().enumerate().filter_map(|(seq, s)| match s {
            Entry::ToolIntent(i) if seq + 1 < n => Some(i.key.clone()),
            _ => None,
        });
        standins.reset(done);
        let dir = tempfile::tempdir().unwrap();
        let store = log_with(dir.path(), prefix).await;
        let (step, seen) = container_step(store.clone(), SYSTEM).await;
        step.unwrap_or_else(|e| panic!("resumed after {n} records: {e}"));
        let seen = seen.unwrap_or_else(|| panic!("resumed after {n}: the agent did not end"));
        let log = read_log(&*store).await;
        assert_eq!(&log[..n], prefix, "resumed after {n}: the prefix changed");
        assert_eq!(
            log.iter().map(essence).collect::<Vec<_>>(),
            whole.iter().map(essence).collect::<Vec<_>>(),
            "resumed after {n}"
        );
        assert_eq!(seen.results, first.results, "resumed after {n}: results");
        let counts = standins.counts();
        assert_eq!(
            counts.model_requests,
            model_calls(&whole) - model_calls(prefix),
            "resumed after {n}: model requests"
        );
        for (seq, entry) in whole.iter().enumerate() {
            let Entry::ToolIntent(intent) = entry else {
                continue;
            };
            let posts = counts.posts.get(&intent.key).copied().unwrap_or(0);
            let recorded = seq + 1 < n;
            // A result in the log is served from it; an intent the log
            // ends with is made again only where its tool allows.
            let most = u32::from(!recorded);
            assert!(
                posts <= most,
                "resumed after {n}: call {seq} POSTed {posts}"
            );
            if intent.tool == "refund" {
                assert_eq!(
                    counts.effects.get(&intent.key),
                    Some(&1),
                    "resumed after {n}"
                );
            }
        }
    }
}

/// The refund is gated: the step records the request and ends with the
/// agent left waiting; after an approver's edit, the agent starts over,
/// replays to the call, and gets the edited call's result with the edit
/// stated. The tool saw one refund, with the edited amount.
#[tokio::test]
async fn a_gated_call_waits_with_no_answer_then_runs_as_edited_and_says_so() {
    let standins = Standins::start().await;
    let started = container_started(gated_run_started(&standins.base, "refund"));
    let mut edited = history_of(started.clone(), container_turns());
    for entry in &mut edited {
        if let Entry::ToolIntent(i) = entry
            && i.tool == "refund"
        {
            i.arguments = json!({"order": "A-7", "amount": 20});
        }
    }
    standins.script(&edited);
    standins.reset([]);

    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    let (step, seen) = container_step(store.clone(), SYSTEM).await;
    step.unwrap();
    assert!(seen.is_none(), "the agent gets no answer for a gated call");
    let log = read_log(&*store).await;
    let Some(Entry::ApprovalRequested(request)) = log.last() else {
        panic!("the step ends with the approval request: {:?}", log.last());
    };
    let request_seq = log.len() as u64 - 1;
    assert_eq!(request.arguments, json!({"order": "A-7", "amount": 25}));
    let refund_key = idempotency_key(RUN, request.model_call_seq, request.call_index);
    assert_eq!(
        standins.counts().effects.get(&refund_key),
        None,
        "nothing refunded yet"
    );

    // The controller records alice's edit (signatures are not checked here).
    let amount_20 = json!({"order": "A-7", "amount": 20});
    let decided = Entry::ApprovalDecided(crate::runlog::records::ApprovalDecided {
        request_seq,
        approval: "a".into(),
        verdict: crate::runlog::records::Verdict::Edit,
        decisions: vec![crate::runlog::records::RecordedDecision {
            approver: "alice".into(),
            verdict: v1::Verdict::Edit,
            arguments_hash: crate::policy::arguments_hash("refund", &amount_20),
            arguments: Some(amount_20.clone()),
            reason: Some("partial refund".into()),
        }],
        arguments: Some(amount_20.clone()),
        observations_hash: "o".into(),
        on_expiry: None,
    });
    let mut decided_log = log.clone();
    decided_log.push(decided);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), &decided_log).await;
    let (step, seen) = container_step(store.clone(), SYSTEM).await;
    step.unwrap();
    let seen = seen.expect("the agent ended");
    let refund = &seen.results[1];
    assert!(
        refund.starts_with("alice changed amount from 25 to 20: partial refund"),
        "{refund}"
    );
    let log = read_log(&*store).await;
    let intent = log
        .iter()
        .find_map(|e| match e {
            Entry::ToolIntent(i) if i.tool == "refund" => Some(i.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(intent.arguments, amount_20);
    assert_eq!(
        intent.requested,
        Some(crate::wire::canonical::tool_digest(
            "refund",
            &json!({"order": "A-7", "amount": 25})
        ))
    );
    assert_eq!(standins.counts().effects.get(&intent.key), Some(&1));
    assert_eq!(stop_of(&log).unwrap().outcome, Outcome::Succeeded);
}

/// An agent whose prompt changed since its answers were recorded (a time
/// in it) is stopped at its first request: the run ends Diverged naming
/// the recorded request and the field, and the model is not asked.
#[tokio::test]
async fn an_agent_that_asks_otherwise_on_replay_diverges_and_nothing_is_asked() {
    let standins = Standins::start().await;
    let started = container_started(run_started(&standins.base));
    standins.script(&history_of(started.clone(), container_turns()));
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    container_step(store.clone(), SYSTEM).await.0.unwrap();
    let whole = read_log(&*store).await;

    let prefix = &whole[..4];
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), prefix).await;
    let (step, seen) = container_step(store.clone(), "It is 10:05. You refund orders.").await;
    step.unwrap();
    let (status, message) = seen.unwrap().refused.expect("the agent is refused");
    assert_eq!(status, 409);
    assert!(message.contains("Diverged"), "{message}");
    let log = read_log(&*store).await;
    assert_eq!(log.len(), prefix.len() + 1, "only the end is recorded");
    let stop = stop_of(&log).unwrap();
    assert_eq!(stop.outcome, Outcome::Diverged);
    let error = stop.error.unwrap();
    assert!(
        error.contains("recorded at seq 1") && error.contains("messages[0].content"),
        "{error}"
    );
    assert_eq!(standins.counts().model_requests, 0);
    assert!(standins.counts().posts.is_empty());
}

/// The run is taken over while the agent's first tool call is made (the
/// controller replacing a pod it believes gone). The runner records
/// nothing more, answers nothing more, and leaves as a fenced worker
/// (`LeaseLost`, not a finished step the controller would read as one).
#[tokio::test]
async fn a_container_step_fenced_during_a_call_records_nothing_more_and_leaves_as_lease_lost() {
    let standins = Standins::start().await;
    let started = container_started(run_started(&standins.base));
    standins.script(&history_of(started.clone(), container_turns()));
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    take_over_at_each_call(&standins, &store);
    let (step, seen) = container_step(store.clone(), SYSTEM).await;
    let e = step.expect_err("the fenced step fails");
    assert!(e.lease_lost(), "{e}");
    let log = read_log(&*store).await;
    assert!(
        matches!(log.last(), Some(Entry::ToolIntent(_))),
        "nothing after the intent: {:?}",
        log.iter().map(Entry::kind).collect::<Vec<_>>()
    );
    assert_eq!(standins.counts().posts.values().sum::<u32>(), 1);
    // Told the step is over, not the tool's answer (or no answer at all,
    // the runner gone).
    let seen = seen.expect("the agent ended");
    assert!(
        seen.results
            .iter()
            .all(|r| r.contains("another worker took the run over")),
        "{:?}",
        seen.results
    );
}

/// A container run forked after its lookup's result: the agent starts
/// over and is served the copied answers from the fork's log, then goes on
/// live: the model is asked only after the fork point, no call of the
/// parent is made again, and the refund is made once, with the fork's key.
#[tokio::test]
async fn a_fork_of_a_container_run_replays_the_copied_prefix_and_goes_on_live() {
    let standins = Standins::start().await;
    let started = container_started(run_started(&standins.base));
    standins.script(&history_of(started.clone(), container_turns()));
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    let (step, first) = container_step(store.clone(), SYSTEM).await;
    step.unwrap();
    let whole = read_log(&*store).await;
    // The parent's log as the controller ends it (the agent's end is the
    // runner's stop), forked after the first result.
    let seq = whole
        .iter()
        .position(|e| matches!(e, Entry::ToolResult(_)))
        .unwrap() as u64;
    let parent_keys: Vec<String> = whole
        .iter()
        .filter_map(|e| match e {
            Entry::ToolIntent(i) => Some(i.key.clone()),
            _ => None,
        })
        .collect();
    standins.reset(parent_keys.clone());
    let fork_dir = tempfile::tempdir().unwrap();
    let fork = super::fork::forked_log(fork_dir.path(), &whole, seq).await;
    // The tools know the fork's calls by the fork's keys.
    let copied = fork.read_verified(super::fork::FORK, None).await.unwrap();
    let forked = &copied[seq as usize + 1];
    let forked = Entry::decode(forked.seq, forked.kind.as_str(), &forked.payload).unwrap();
    standins.script(&super::fork::fork_history(&whole, seq, forked));

    let (step, seen) = container_step_of(super::fork::FORK, fork.clone(), SYSTEM).await;
    step.unwrap_or_else(|e| panic!("the fork's step: {e:#}"));
    let seen = seen.expect("the agent ended");
    assert_eq!(
        seen.results,
        first.unwrap().results,
        "the same results, replayed then live"
    );
    let records = fork.read_verified(super::fork::FORK, None).await.unwrap();
    let log: Vec<Entry> = records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect();
    assert_eq!(stop_of(&log).map(|s| s.outcome), Some(Outcome::Succeeded));
    let counts = standins.counts();
    assert_eq!(
        counts.model_requests,
        model_calls(&whole) - model_calls(&whole[..=seq as usize]),
        "only the answers after the fork point are asked"
    );
    for key in &parent_keys {
        assert_eq!(
            counts.posts.get(key),
            None,
            "a parent's call was made again"
        );
    }
    let made: Vec<&ToolIntent> = log[seq as usize + 1..]
        .iter()
        .filter_map(|e| match e {
            Entry::ToolIntent(i) => Some(i),
            _ => None,
        })
        .collect();
    assert!(!made.is_empty());
    for intent in made {
        assert!(!parent_keys.contains(&intent.key), "the fork's own key");
        assert_eq!(counts.posts.get(&intent.key), Some(&1));
    }
}

/// Issue 50 for a container agent: its run forked at alice's edit of the
/// refund, before the refund's intent. The agent of the fork replays to
/// the refund and gets no answer: the fork asks its own approvers (the
/// parent's edit authorizes nothing in the fork), and no refund is made.
/// Once carol approves it as proposed, the refund is made once, with the
/// fork's key and the amount carol approved, and the agent is not told of
/// alice's edit.
#[tokio::test]
async fn a_fork_of_a_container_run_at_the_parents_edit_waits_for_its_own_approval() {
    let standins = Standins::start().await;
    let started = container_started(gated_run_started(&standins.base, "refund"));
    let amount = |n: u64| json!({"order": "A-7", "amount": n});
    let mut edited = history_of(started.clone(), container_turns());
    for entry in &mut edited {
        if let Entry::ToolIntent(i) = entry
            && i.tool == "refund"
        {
            i.arguments = amount(20);
        }
    }
    standins.script(&edited);
    standins.reset([]);
    // The parent: asked, edited by alice, made, ended.
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), std::slice::from_ref(&started)).await;
    container_step(store.clone(), SYSTEM).await.0.unwrap();
    let mut log = read_log(&*store).await;
    let request_seq = log.len() as u64 - 1;
    log.push(Entry::ApprovalDecided(
        crate::runlog::records::ApprovalDecided {
            request_seq,
            approval: "a".into(),
            verdict: crate::runlog::records::Verdict::Edit,
            decisions: vec![crate::runlog::records::RecordedDecision {
                approver: "alice".into(),
                verdict: v1::Verdict::Edit,
                arguments_hash: crate::policy::arguments_hash("refund", &amount(20)),
                arguments: Some(amount(20)),
                reason: Some("partial refund".into()),
            }],
            arguments: Some(amount(20)),
            observations_hash: "o".into(),
            on_expiry: None,
        },
    ));
    // The tools know the parent's later calls by the seqs after the decision.
    let asked = log[request_seq as usize..].to_vec();
    standins.script(&super::fork::shifted(&edited, request_seq - 1, asked, RUN));
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), &log).await;
    container_step(store.clone(), SYSTEM).await.0.unwrap();
    let whole = read_log(&*store).await;
    assert_eq!(stop_of(&whole).unwrap().outcome, Outcome::Succeeded);
    let parent_keys: Vec<String> = whole
        .iter()
        .filter_map(|e| match e {
            Entry::ToolIntent(i) => Some(i.key.clone()),
            _ => None,
        })
        .collect();

    // Forked at alice's edit.
    let seq = request_seq + 1;
    standins.reset(parent_keys.clone());
    let fork_dir = tempfile::tempdir().unwrap();
    let fork = super::fork::forked_log(fork_dir.path(), &whole, seq).await;
    let (step, seen) = container_step_of(super::fork::FORK, fork.clone(), SYSTEM).await;
    step.unwrap_or_else(|e| panic!("the fork's step: {e:#}"));
    assert!(
        seen.is_none(),
        "the fork's agent gets no answer for the refund"
    );
    let records = fork.read_verified(super::fork::FORK, None).await.unwrap();
    let forked: Vec<Entry> = records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect();
    assert_eq!(
        forked.len() as u64,
        seq + 3,
        "the copy, Forked, the request"
    );
    let Some(Entry::ApprovalRequested(own)) = forked.last() else {
        panic!(
            "the fork did not ask its own approvers: {:?}",
            forked.last()
        )
    };
    assert_eq!(own.arguments, amount(25), "the call as the agent made it");
    let own_seq = seq + 2;
    assert!(standins.counts().posts.is_empty(), "a call was made");

    // Carol, the fork's approver, approves it as proposed.
    let decided = Entry::ApprovalDecided(crate::runlog::records::ApprovalDecided {
        request_seq: own_seq,
        approval: "fork-a".into(),
        verdict: crate::runlog::records::Verdict::Approve,
        decisions: vec![crate::runlog::records::RecordedDecision {
            approver: "carol".into(),
            verdict: v1::Verdict::Approve,
            arguments_hash: own.arguments_hash.clone(),
            arguments: None,
            reason: None,
        }],
        arguments: Some(amount(25)),
        observations_hash: "o".into(),
        on_expiry: None,
    });
    let lease = fork
        .acquire(super::fork::FORK, "controller", LEASE_TTL)
        .await
        .unwrap();
    let record = crate::store::RecordSigner::from_seed(&[3; 32])
        .seal(
            super::fork::FORK,
            decided.draft(),
            &records.last().unwrap().head(),
        )
        .unwrap();
    fork.append(super::fork::FORK, lease.epoch, &record)
        .await
        .unwrap();
    fork.release(&lease).await.unwrap();
    // The tools know the fork's calls by the fork's keys (the refund as
    // carol approved it).
    let mut expected = super::fork::shifted(
        &whole,
        seq,
        vec![
            forked[seq as usize + 1].clone(),
            Entry::ApprovalRequested(own.clone()),
            decided,
        ],
        super::fork::FORK,
    );
    for entry in &mut expected {
        if let Entry::ToolIntent(i) = entry
            && i.tool == "refund"
        {
            i.arguments = amount(25);
        }
    }
    standins.script(&expected);

    let (step, seen) = container_step_of(super::fork::FORK, fork.clone(), SYSTEM).await;
    step.unwrap_or_else(|e| panic!("the fork's second step: {e:#}"));
    let seen = seen.expect("the agent ended");
    assert!(!seen.results[1].contains("changed"), "{}", seen.results[1]);
    let log: Vec<Entry> = fork
        .read_verified(super::fork::FORK, None)
        .await
        .unwrap()
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect();
    assert_eq!(stop_of(&log).map(|s| s.outcome), Some(Outcome::Succeeded));
    let counts = standins.counts();
    let refund = log[seq as usize + 1..]
        .iter()
        .find_map(|e| match e {
            Entry::ToolIntent(i) if i.tool == "refund" => Some(i.clone()),
            _ => None,
        })
        .expect("the fork's refund");
    assert_eq!(refund.key, idempotency_key(super::fork::FORK, 1, 1));
    assert_eq!(refund.arguments, amount(25));
    assert_eq!(counts.effects.get(&refund.key), Some(&1));
    for key in &parent_keys {
        assert_eq!(
            counts.posts.get(key),
            None,
            "a parent's call was made again"
        );
    }
}
