//! The runner in process, replaying canned histories (as Temporal's
//! sdk-core replay tests do): a real SQLite step log holding a prefix of a
//! recorded run, and in-process stand-ins for the model and the tools
//! ([`standins`]). A worker that resumes after any record must ask only for
//! what the log lacks and finish the same run.

mod container;
mod fork;
mod sandbox;
mod standins;

use std::collections::HashMap;

use serde_json::{Value, json};

use super::*;
use crate::runlog::v1;
use standins::Standins;

const RUN: &str = "run-uid-1";

fn step_args() -> StepArgs {
    StepArgs {
        run_uid: RUN.into(),
        run_name: "r1".into(),
        // Unused: the tests hand the runner its store.
        store_url: String::new(),
        log_anchor: None,
        controller_key: None,
        signed_from: 0,
        bound_from: Default::default(),
        signing_keys: None,
        model_api_key: None,
        worker: "w".into(),
        attempt: 1,
        time_slice_seconds: 60,
        step_timeout_seconds: None,
        loopback_addr: None,
        runner_key: None,
    }
}

#[test]
fn model_calls_end_before_the_step_timeout() {
    let mut args = step_args();
    let t0 = Instant::now();
    assert_eq!(args.model_deadline(t0), None);
    args.step_timeout_seconds = Some(300);
    assert_eq!(args.model_deadline(t0), Some(t0 + Duration::from_secs(295)));
    args.step_timeout_seconds = Some(4);
    assert_eq!(args.model_deadline(t0), Some(t0 + Duration::from_secs(2)));
}

/// The agent of the canned run: an OpenAI-style model and two HTTP tools
/// at the stand-ins. `search` is read-only (repeating it is harmless);
/// `refund` is neither idempotent nor read-only, and declares a lookup.
fn run_started(base: &str) -> Entry {
    let agent: v1::AgentTemplate = serde_json::from_value(json!({
        "prompt": {"version": "v1", "system": "Refund what the order shows, no more."},
        "model": {"provider": "OpenAI", "name": "stand-in", "endpoint": format!("{base}/v1")},
        "tools": [
            {"name": "search", "http": {"url": format!("{base}/tools/search"), "readOnly": true}},
            {"name": "refund", "http": {"url": format!("{base}/tools/refund"),
                                        "lookup": format!("{base}/tools/refund/lookup")}},
        ],
    }))
    .unwrap();
    Entry::RunStarted(RunStarted {
        container: None,
        run_name: "r1".into(),
        namespace: "ns".into(),
        input: "Refund order A-7.".into(),
        agent,
        tools: vec![],
        mcp: Default::default(),
        versions: Versions::default(),
    })
}

/// One model reply of the canned run: its text, and its calls with the
/// result each got (none for `finish`, which ends the run).
type Turn = (Option<&'static str>, Vec<(&'static str, Value, Value)>);

fn turns() -> Vec<Turn> {
    vec![
        (
            Some("Looking the order up, then refunding it."),
            vec![
                (
                    "search",
                    json!({"order": "A-7"}),
                    json!({"order": "A-7", "total": 25}),
                ),
                (
                    "refund",
                    json!({"order": "A-7", "amount": 25}),
                    json!({"refund": "R-1"}),
                ),
            ],
        ),
        (
            None,
            vec![(
                "search",
                json!({"refund": "R-1"}),
                json!({"status": "settled"}),
            )],
        ),
        (
            Some("Done."),
            vec![(
                "finish",
                json!({"result": "Refunded 25 on A-7 (R-1)."}),
                Value::Null,
            )],
        ),
    ]
}

/// The canned history: a whole run as a worker records it, up to the
/// `finish` call after which the controller appends `RunFinished`.
fn history(base: &str) -> Vec<Entry> {
    history_of(run_started(base), turns())
}

/// The records of `turns` after `started`, each call made and answered.
fn history_of(started: Entry, turns: Vec<Turn>) -> Vec<Entry> {
    let mut log = vec![started];
    for (text, calls) in turns {
        let model_call_seq = log.len() as u64;
        let tool_calls = calls
            .iter()
            .enumerate()
            .map(|(index, (tool, args, _))| v1::ToolCall {
                id: format!("call_{model_call_seq}_{index}"),
                name: tool.to_string(),
                arguments: args.clone(),
            });
        log.push(Entry::ModelCall(ModelCall {
            request: None,
            response: v1::ModelResponse {
                text: text.map(str::to_string),
                tool_calls: tool_calls.collect(),
                usage: v1::TokenUsage {
                    input_tokens: 100,
                    output_tokens: 20,
                },
                model_id: "stand-in-2026".into(),
                stop_reason: Some("tool_calls".into()),
            },
            cost_usd: 0.0,
            context: ContextInfo::default(),
            attempts: None,
        }));
        for (index, (tool, arguments, result)) in calls.into_iter().enumerate() {
            if tool == crate::tools::FINISH_TOOL {
                continue;
            }
            let intent_seq = log.len() as u64;
            let call_id = format!("call_{model_call_seq}_{index}");
            log.push(Entry::ToolIntent(ToolIntent {
                requested: None,
                model_call_seq,
                call_index: index,
                call_id: call_id.clone(),
                tool: tool.into(),
                arguments,
                key: idempotency_key(RUN, model_call_seq, index),
                sandboxed: None,
            }));
            log.push(Entry::ToolResult(ToolResult {
                intent_seq,
                call_id,
                tool: tool.into(),
                outcome: v1::ToolOutcome::Ok(result),
                recovery: None,
            }));
        }
    }
    log
}

/// A step log holding `prefix`, as a worker that died after its last
/// record left it. (Its lease is released: a dead worker's would expire,
/// which the runner waits out, slowly.)
async fn log_with(dir: &std::path::Path, prefix: &[Entry]) -> Arc<dyn StepStore> {
    // The binaries install it at start; the runner's clients need one.
    crate::tools::ensure_crypto_provider();
    let url = format!("sqlite://{}", dir.join("log.db").display());
    let store = store::open(&url).await.unwrap();
    let lease = store.acquire(RUN, "crashed", LEASE_TTL).await.unwrap();
    let mut head = Head::EMPTY;
    for step in prefix {
        let record = step.draft().seal(&head).unwrap();
        head = store
            .append(RUN, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    store
}

async fn read_log(store: &dyn StepStore) -> Vec<Entry> {
    let records = store.read_verified(RUN, None).await.unwrap();
    let decoded = records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload));
    decoded.collect::<Result<_, _>>().unwrap()
}

/// The canned run scripted at `standins`, and a log holding only its start.
async fn fresh_run(standins: &Standins, dir: &std::path::Path) -> (Vec<Entry>, Arc<dyn StepStore>) {
    let history = history(&standins.base);
    standins.script(&history);
    standins.reset([]);
    let store = log_with(dir, &history[..1]).await;
    (history, store)
}

/// Another worker takes the run over at every tool call, after the call
/// took effect (the controller replacing a pod it believes gone).
fn take_over_at_each_call(standins: &Standins, store: &Arc<dyn StepStore>) {
    let taker = store.clone();
    standins.on_call(move || {
        let store = taker.clone();
        Box::pin(async move {
            store.take_over(RUN, "new-pod", LEASE_TTL).await.unwrap();
        })
    });
}

/// The end the runner asked for, when the log ends with one.
fn stop_of(log: &[Entry]) -> Option<RunFinished> {
    match log.last() {
        Some(Entry::Observation(Observation { stop, .. })) => stop.clone(),
        _ => None,
    }
}

/// Runs one step on `store` as worker `w`, within 30 s.
async fn step_on(store: &Arc<dyn StepStore>) -> Result<(), StepError> {
    tokio::time::timeout(Duration::from_secs(30), run_on(step_args(), store.clone()))
        .await
        .expect("the step ends within 30 s")
}

/// A record without what depends on the worker that wrote it (its context
/// estimate, the attempts it took, how it recovered a call): what any
/// worker must record the same.
fn essence(step: &Entry) -> Entry {
    let mut step = step.clone();
    match &mut step {
        Entry::ModelCall(m) => {
            m.context = ContextInfo::default();
            m.attempts = None;
        }
        Entry::ToolResult(r) => r.recovery = None,
        _ => {}
    }
    step
}

fn model_calls(log: &[Entry]) -> usize {
    log.iter()
        .filter(|s| matches!(s, Entry::ModelCall(_)))
        .count()
}

/// What a resumed worker must do about one recorded call: its POSTs, its
/// lookups, and the recovery its result names.
fn expected_call(
    prefix: &[Entry],
    intent_seq: usize,
    took_effect: bool,
) -> (u32, u32, Option<Recovery>) {
    let Some(Entry::ToolIntent(intent)) = prefix.get(intent_seq) else {
        // Not yet intended: this worker makes the call, once.
        return (1, 0, None);
    };
    if intent_seq + 1 < prefix.len() {
        // Its result is recorded: nothing is asked again.
        return (0, 0, None);
    }
    // The intent is the last record: the call may have happened.
    match intent.tool.as_str() {
        // Read-only: made again with the same key.
        "search" => (1, 0, Some(Recovery::RetriedWithSameKey)),
        // The lookup tells: made only if it had not taken effect.
        _ if took_effect => (0, 1, Some(Recovery::LookupFoundResult)),
        _ => (1, 1, Some(Recovery::LookupFoundNothing)),
    }
}

/// Resumes the canned run after each of its records in turn. `took_effect`:
/// whether a call whose intent is the last record had reached its tool
/// before the worker died.
async fn resume_after_every_record(took_effect: bool) {
    let standins = Standins::start().await;
    let history = history(&standins.base);
    standins.script(&history);
    for n in 1..=history.len() {
        let prefix = &history[..n];
        // What the dead worker's calls did: those with a recorded result took
        // effect, and the one whose intent ends the log did if `took_effect`.
        let done = prefix.iter().enumerate().filter_map(|(seq, s)| match s {
            Entry::ToolIntent(i) if seq + 1 < n || took_effect => Some(i.key.clone()),
            _ => None,
        });
        standins.reset(done);
        let dir = tempfile::tempdir().unwrap();
        let store = log_with(dir.path(), prefix).await;
        tokio::time::timeout(Duration::from_secs(30), run_on(step_args(), store.clone()))
            .await
            .unwrap_or_else(|_| panic!("resumed after {n} records: no end in 30 s"))
            .unwrap_or_else(|e| panic!("resumed after {n} records: {e:#}"));

        let log = read_log(&*store).await;
        let kinds = |l: &[Entry]| l.iter().map(Entry::kind).collect::<Vec<_>>();
        assert_eq!(kinds(&log), kinds(&history), "resumed after {n} records");
        let same: Vec<Entry> = log.iter().map(essence).collect();
        assert_eq!(
            same,
            history.iter().map(essence).collect::<Vec<_>>(),
            "resumed after {n}"
        );
        assert_eq!(
            &log[..n],
            prefix,
            "resumed after {n} records: the prefix changed"
        );

        let counts = standins.counts();
        assert_eq!(
            counts.model_requests,
            model_calls(&history) - model_calls(prefix),
            "resumed after {n} records: model requests"
        );
        check_calls(&history, prefix, &log, &counts, took_effect);
    }
}

/// Every call of the run, as the stand-in tools counted it after a resume.
fn check_calls(
    history: &[Entry],
    prefix: &[Entry],
    log: &[Entry],
    counts: &standins::Counts,
    took_effect: bool,
) {
    let n = prefix.len();
    let mut keys = HashMap::new();
    for (seq, step) in history.iter().enumerate() {
        let Entry::ToolIntent(intent) = step else {
            continue;
        };
        let (posts, lookups, recovery) = expected_call(prefix, seq, took_effect);
        let key = &intent.key;
        let at = format!("resumed after {n} records, call at {seq} ({})", intent.tool);
        assert_eq!(
            counts.posts.get(key).copied().unwrap_or(0),
            posts,
            "{at}: POSTs"
        );
        assert_eq!(
            counts.lookups.get(key).copied().unwrap_or(0),
            lookups,
            "{at}: lookups"
        );
        let Some(Entry::ToolResult(result)) = log.get(seq + 1) else {
            panic!("{at}: no result after the intent");
        };
        assert_eq!(result.recovery, recovery, "{at}: recovery");
        if intent.tool == "refund" {
            // Not repeatable: it took effect exactly once, whoever made it.
            assert_eq!(counts.effects.get(key).copied(), Some(1), "{at}: effects");
        }
        keys.insert(key.clone(), seq);
    }
    // Every request carried the key of a call of this run.
    for key in counts.posts.keys().chain(counts.lookups.keys()) {
        assert!(
            keys.contains_key(key),
            "resumed after {n} records: unknown key {key}"
        );
    }
}

#[tokio::test]
async fn resumed_after_any_record_it_asks_only_for_what_the_log_lacks() {
    resume_after_every_record(false).await;
}

#[tokio::test]
async fn resumed_after_a_call_took_effect_it_looks_the_call_up_not_makes_it_again() {
    resume_after_every_record(true).await;
}

#[tokio::test]
async fn a_log_without_run_started_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), &[]).await;
    let err = run_on(step_args(), store.clone()).await.unwrap_err();
    assert!(
        err.to_string().contains("has no RunStarted record"),
        "{err:#}"
    );
    assert!(read_log(&*store).await.is_empty());
}

/// A log whose agent has one platform rule, gating every call to
/// `gated` (pinned in `RunStarted` as the run's first rule), and the tools
/// `refund_customer` at `refund` and `search` at `search`, and whose model
/// proposed a search then a refund of 5000.
fn gated_run(standins: &Standins, gated: &str, refund: &str, search: &str) -> Vec<Entry> {
    let agent: v1::AgentTemplate = serde_json::from_value(json!({
        "prompt": {"version": "v1", "system": "Refund what the order shows."},
        "model": {"provider": "OpenAI", "name": "stand-in", "endpoint": format!("{}/v1", standins.base)},
        "tools": [
            {"name": "refund_customer", "http": {"url": refund}},
            {"name": "search", "http": {"url": search}}
        ],
        "approval": {"rules": [{
            "name": "AgentPolicy/finance/refunds", "tool": "*",
            "match": {"endpoints": [{"url": gated}]},
            "approvers": {"groups": ["finance"]}, "expiresAfter": "10m"
        }]}
    }))
    .unwrap();
    let Entry::RunStarted(mut started) = run_started(&standins.base) else {
        unreachable!("run_started is a RunStarted")
    };
    started.agent = agent;
    let call = |index: usize, name: &str, arguments: Value| v1::ToolCall {
        id: format!("call_1_{index}"),
        name: name.into(),
        arguments,
    };
    let proposal = Entry::ModelCall(ModelCall {
        request: None,
        response: v1::ModelResponse {
            text: Some("Looking it up, then refunding 5000.".into()),
            tool_calls: vec![
                call(0, "search", json!({"order": "A-7"})),
                call(
                    1,
                    "refund_customer",
                    json!({"order": "A-7", "amount": 5000}),
                ),
            ],
            usage: v1::TokenUsage::default(),
            model_id: "stand-in-2026".into(),
            stop_reason: Some("tool_calls".into()),
        },
        cost_usd: 0.0,
        context: ContextInfo::default(),
        attempts: None,
    });
    vec![Entry::RunStarted(started), proposal]
}

/// Runs one step over `prefix`: the search is made (and reaches the
/// stand-in, wherever its URL's host was pinned), and the refund must wait
/// for the platform's Approval without reaching the tool.
async fn assert_refund_held(standins: &Standins, prefix: &[Entry], spelling: &str) {
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let store = log_with(dir.path(), prefix).await;
    tokio::time::timeout(Duration::from_secs(30), run_on(step_args(), store.clone()))
        .await
        .expect("the step ends")
        .unwrap_or_else(|e| panic!("{spelling}: {e:#}"));
    let log = read_log(&*store).await;
    let kinds: Vec<&str> = log.iter().map(Entry::kind).collect();
    match log.last() {
        Some(Entry::ApprovalRequested(r)) => {
            assert_eq!(r.gate.rule, "AgentPolicy/finance/refunds", "{spelling}");
            assert_eq!(r.tool, "refund_customer", "{spelling}");
        }
        _ => panic!("{spelling}: the refund was not held for approval: {kinds:?}"),
    }
    let posts = standins.counts().posts;
    let refund_key = idempotency_key(RUN, 1, 1);
    assert!(
        !posts.contains_key(&refund_key),
        "{spelling}: the refund reached the tool with no approval"
    );
    assert_eq!(
        posts.get(&idempotency_key(RUN, 1, 0)),
        Some(&1),
        "{spelling}: the ungated search did not reach its tool once"
    );
}

/// The review's attack on the platform's gate, in process: the platform
/// gates every call to the refund endpoint of the server on 127.0.0.1; the
/// agent author declares the same server as `localhost`,
/// `[::ffff:127.0.0.1]` and in decimal. Each run asks for an Approval and
/// nothing reaches the refund tool.
#[tokio::test]
async fn a_platform_gate_on_loopback_holds_for_every_spelling_of_the_server() {
    let standins = Standins::start().await;
    let port = standins
        .base
        .rsplit(':')
        .next()
        .expect("a port")
        .to_string();
    let gated = format!("{}/tools/refund", standins.base);
    for host in [
        "localhost",
        "[::ffff:127.0.0.1]",
        "2130706433",
        "LocalHost.",
        "0x7f.1",
    ] {
        let base = format!("http://{host}:{port}");
        let prefix = gated_run(
            &standins,
            &gated,
            &format!("{base}/tools/refund"),
            &format!("{base}/tools/search"),
        );
        assert_refund_held(&standins, &prefix, host).await;
    }
}

/// A rule naming an address holds for a name the step pod resolves to it
/// (here the machine's own name, from its hosts file): the runner looks
/// the name up, matches on the address, and connects only there.
#[tokio::test]
async fn a_platform_gate_on_an_address_holds_for_a_name_that_resolves_to_it() {
    let standins = Standins::start().await;
    let port = standins
        .base
        .rsplit(':')
        .next()
        .expect("a port")
        .to_string();
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some(ip) = crate::dns::lookup(&name).await.first().copied() else {
        panic!(
            "this machine's name {name:?} does not resolve (its hosts file names it on \
             Debian): the test needs a name for the stand-ins' address"
        );
    };
    let gated = format!(
        "http://{}/tools/refund",
        std::net::SocketAddr::new(ip, port.parse().unwrap())
    );
    let search = format!("{}/tools/search", standins.base);
    let prefix = gated_run(
        &standins,
        &gated,
        &format!("http://{name}:{port}/tools/refund"),
        &search,
    );
    assert_refund_held(&standins, &prefix, &name).await;
}

/// A log of run_started then a `RunFinished`, both signed by `signer`.
async fn signed_log(dir: &std::path::Path, signer: &store::RecordSigner) -> Arc<dyn StepStore> {
    crate::tools::ensure_crypto_provider();
    let url = format!("sqlite://{}", dir.join("log.db").display());
    let store = store::open(&url).await.unwrap();
    let lease = store.acquire(RUN, "mallory", LEASE_TTL).await.unwrap();
    let started = run_started("http://127.0.0.1:9");
    let mut head = Head::EMPTY;
    for (kind, payload) in [
        (started.store_kind(), started.payload()),
        (
            store::StepKind::RunFinished,
            json!({"outcome": "Succeeded", "result": "forged"}),
        ),
    ] {
        let record = signer
            .seal(RUN, crate::store::RecordDraft::new(kind, payload), &head)
            .unwrap();
        head = store
            .append(RUN, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    store
}

/// The runner replays a log whose seq 1 the retired key signed after the
/// run's status recorded the new key in charge from seq 1 (mallory holds the
/// leaked retired key and a database credential): it refuses to go on.
#[tokio::test]
async fn the_runner_refuses_a_record_the_retired_key_signed_after_the_switch() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (
        store::RecordSigner::from_seed(&[1; 32]),
        store::RecordSigner::from_seed(&[2; 32]),
    );
    let store = signed_log(dir.path(), &old).await;
    let keys = store::RecordVerifier::new(vec![new.public_key(false), old.public_key(true)])
        .unwrap()
        .to_hex();
    let mut args = step_args();
    args.controller_key = Some(keys);
    args.signing_keys = Some(format!("{}:0,{}:1", old.key_id(), new.key_id()));
    let err = run_on(args, store.clone()).await.unwrap_err();
    let err = crate::text::chain(&err);
    assert!(
        err.contains("checking the controller's signatures") && err.contains("retired"),
        "{err}"
    );
    assert_eq!(read_log(&*store).await.len(), 2, "nothing appended");
}

/// The canned agent with `tool` gated above an amount of 10 (issue 39),
/// `refund` declared idempotent: both `search` (read-only) and `refund`
/// would be made again, with their key, when found intended without a
/// result.
pub(super) fn gated_run_started(base: &str, tool: &str) -> Entry {
    let Entry::RunStarted(mut started) = run_started(base) else {
        unreachable!()
    };
    started.agent.tools[1].http.as_mut().unwrap().idempotent = true;
    started.agent.approval = Some(
        serde_json::from_value(json!({"rules": [{
            "name": "large", "tool": tool, "when": "args.amount > 10",
            "approvers": {"users": ["alice"]}}]}))
        .unwrap(),
    );
    Entry::RunStarted(started)
}

/// A log where the model proposed `tool` with an amount of 25 (record 1)
/// and an intent to make it follows: with `decided`, after the request and
/// the controller's approval of exactly that call; without, straight away
/// (what the holder of the run's step credential can append).
fn intended(base: &str, tool: &str, decided: bool) -> Vec<Entry> {
    let args = json!({"order": "A-7", "amount": 25});
    let mut log = vec![gated_run_started(base, tool)];
    log.push(Entry::ModelCall(ModelCall {
        request: None,
        response: v1::ModelResponse {
            text: Some("Refunding A-7.".into()),
            tool_calls: vec![v1::ToolCall {
                id: "call_1_0".into(),
                name: tool.into(),
                arguments: args.clone(),
            }],
            usage: Default::default(),
            model_id: "stand-in-2026".into(),
            stop_reason: None,
        },
        cost_usd: 0.0,
        context: ContextInfo::default(),
        attempts: None,
    }));
    if decided {
        let state = RunState::replay(log.clone());
        let crate::policy::Classification::RequireApproval(gate) =
            state.classify_at(2, tool, &args, &crate::policy::Network::of(""))
        else {
            panic!("{tool} is gated")
        };
        log.push(Entry::ApprovalRequested(ApprovalRequested {
            model_call_seq: 1,
            call_index: 0,
            call_id: "call_1_0".into(),
            tool: tool.into(),
            arguments_hash: crate::policy::arguments_hash(tool, &args),
            arguments: args.clone(),
            reason: None,
            observations: vec![],
            dependencies: vec![],
            gate: *gate,
            escalation: 0,
            alternative: None,
            kind: Default::default(),
            intent_seq: None,
        }));
        log.push(Entry::ApprovalDecided(
            crate::runlog::records::ApprovalDecided {
                request_seq: 2,
                approval: "a".into(),
                verdict: crate::runlog::records::Verdict::Approve,
                decisions: vec![],
                arguments: Some(args.clone()),
                observations_hash: "o".into(),
                on_expiry: None,
            },
        ));
    }
    log.push(Entry::ToolIntent(ToolIntent {
        requested: None,
        model_call_seq: 1,
        call_index: 0,
        call_id: "call_1_0".into(),
        tool: tool.into(),
        arguments: args,
        key: idempotency_key(RUN, 1, 0),
        sandboxed: None,
    }));
    log
}

/// An intent the step credential's holder appended for a gated call, with
/// no decision before it, is never made: not for a read-only tool, not for
/// an idempotent one. The runner appends nothing and leaves the end to the
/// controller, which records why. With the approval in the log, the same
/// intent is made.
#[tokio::test]
async fn an_intent_for_a_gated_call_with_no_approval_in_the_log_is_not_executed() {
    let standins = Standins::start().await;
    for tool in ["refund", "search"] {
        for decided in [false, true] {
            let prefix = intended(&standins.base, tool, decided);
            let mut history = prefix.clone();
            let intent_seq = prefix.len() as u64 - 1;
            history.push(Entry::ToolResult(ToolResult {
                intent_seq,
                call_id: "call_1_0".into(),
                tool: tool.into(),
                outcome: v1::ToolOutcome::Ok(json!({"refund": "R-1"})),
                recovery: None,
            }));
            standins.script(&history);
            standins.reset([]);
            let dir = tempfile::tempdir().unwrap();
            let store = log_with(dir.path(), &prefix).await;
            // One step's worth: the runner stops where the controller decides.
            let _ =
                tokio::time::timeout(Duration::from_secs(30), run_on(step_args(), store.clone()))
                    .await
                    .unwrap_or_else(|_| panic!("{tool}: no end in 30 s"));
            let key = idempotency_key(RUN, 1, 0);
            let posts = standins.counts().posts.get(&key).copied().unwrap_or(0);
            let log = read_log(&*store).await;
            if decided {
                assert_eq!(posts, 1, "{tool}: the approved call is made");
                assert!(matches!(log.get(prefix.len()), Some(Entry::ToolResult(_))));
                continue;
            }
            assert_eq!(posts, 0, "{tool}: the unapproved call was made");
            assert_eq!(log, prefix, "{tool}: the runner appended nothing");
            match RunState::replay(log).next() {
                Next::Finish {
                    outcome: Outcome::Failed,
                    error: Some(error),
                    ..
                } => assert!(
                    error.contains(&format!("record {intent_seq}"))
                        && error.contains("no approval of exactly that call"),
                    "{tool}: {error}"
                ),
                other => panic!("{tool}: {other:?}"),
            }
        }
    }
}

/// The controller asks the worker to yield (a FollowLatest run's Agent
/// changed) while a tool call is in flight. The worker records the calls
/// of that model turn and leaves before its next model call, however fresh
/// its lease proof is: the old prompt is never asked again.
#[tokio::test]
async fn a_yield_asked_during_a_tool_call_ends_the_step_before_the_next_model_call() {
    let standins = Standins::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (history, store) = fresh_run(&standins, dir.path()).await;
    let asker = store.clone();
    standins.on_call(move || {
        let store = asker.clone();
        Box::pin(async move { store.request_yield(RUN).await.unwrap() })
    });
    step_on(&store).await.unwrap();

    let log = read_log(&*store).await;
    let first_turn = history
        .iter()
        .skip(2)
        .position(|e| matches!(e, Entry::ModelCall(_)))
        .map(|i| i + 2)
        .unwrap();
    let kinds = |l: &[Entry]| l.iter().map(Entry::kind).collect::<Vec<_>>();
    assert_eq!(kinds(&log), kinds(&history[..first_turn]));
    assert_eq!(standins.counts().model_requests, 1);
}

/// A built-in agent's step taken over while its tool call is made: the
/// result's append is refused for its stale epoch, which is a lost lease
/// (the worker exits as fenced), whether or not the heartbeat saw it first.
#[tokio::test]
async fn a_step_fenced_during_a_call_leaves_as_lease_lost() {
    let standins = Standins::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_, store) = fresh_run(&standins, dir.path()).await;
    take_over_at_each_call(&standins, &store);
    let e = step_on(&store).await.expect_err("the fenced step fails");
    assert!(e.lease_lost(), "{e}");
    let log = read_log(&*store).await;
    assert!(matches!(log.last(), Some(Entry::ToolIntent(_))));
    assert_eq!(standins.counts().posts.values().sum::<u32>(), 1);
}
