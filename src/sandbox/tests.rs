use serde_json::json;

use super::*;
use crate::replay::tests::{decided, model_call, request, started};
use crate::runlog::records::{Forked, RecordedDecision, ToolIntent, ToolResult};
use crate::runlog::v1;

fn intent(model_call_seq: u64, call_index: usize, tool: &str, arguments: Value) -> Entry {
    Entry::ToolIntent(ToolIntent {
        model_call_seq,
        call_index,
        call_id: format!("c{call_index}"),
        tool: tool.into(),
        arguments,
        key: "k".into(),
        requested: None,
        sandboxed: None,
    })
}

fn result(intent_seq: u64, tool: &str, value: Value) -> Entry {
    Entry::ToolResult(ToolResult {
        intent_seq,
        call_id: "c".into(),
        tool: tool.into(),
        outcome: v1::ToolOutcome::Ok(value),
        recovery: None,
    })
}

/// A request for call `call_index` of the ModelCall at `model_call_seq`.
fn asked(model_call_seq: u64, call_index: usize, arguments: Value) -> Entry {
    let Entry::ApprovalRequested(mut r) = request() else {
        unreachable!()
    };
    (r.model_call_seq, r.call_index, r.arguments) = (model_call_seq, call_index, arguments);
    Entry::ApprovalRequested(r)
}

fn decided_at(request_seq: u64, verdict: Verdict, by: &str, args: Option<Value>) -> Entry {
    let Entry::ApprovalDecided(mut d) = decided(verdict, None, args) else {
        unreachable!()
    };
    d.request_seq = request_seq;
    let v = match verdict {
        Verdict::Reject => v1::Verdict::Reject,
        Verdict::Edit => v1::Verdict::Edit,
        _ => v1::Verdict::Approve,
    };
    d.decisions = vec![RecordedDecision {
        approver: by.into(),
        verdict: v,
        arguments_hash: "h".into(),
        arguments: None,
        reason: Some("too much".into()),
    }];
    Entry::ApprovalDecided(d)
}

/// A recorded run: a lookup and a refund edited to 300 (seq 1), a refund
/// of 70 rejected (seq 9), then a lookup the run never settled (seq 12).
fn recorded() -> RunState {
    let mut log: Vec<Entry> = started().records().map(|(_, e)| e.clone()).collect();
    log.extend([
        model_call(&[
            ("lookup", json!({"id": 1})),
            ("refund", json!({"amount": 500})),
        ]),
        intent(1, 0, "lookup", json!({"id": 1})),
        result(2, "lookup", json!({"total": 500})),
        asked(1, 1, json!({"amount": 500})),
        decided_at(4, Verdict::Edit, "bob", Some(json!({"amount": 300}))),
        intent(1, 1, "refund", json!({"amount": 300})),
        result(6, "refund", json!({"refund": "R-1"})),
        Entry::Observation(crate::runlog::records::Observation {
            text: "go on".into(),
            about_seq: None,
            stop: None,
            attempts: None,
        }),
        // seq 9
        model_call(&[("refund", json!({"amount": 70}))]),
        asked(9, 0, json!({"amount": 70})),
        decided_at(10, Verdict::Reject, "carol", None),
        model_call(&[("lookup", json!({"id": 1}))]),
    ]);
    RunState::replay(log)
}

#[test]
fn the_recorded_calls_are_what_the_model_was_told_in_the_order_proposed() {
    let calls = recorded_calls(&recorded()).calls;
    assert_eq!(
        calls.len(),
        3,
        "the unsettled lookup is left out: {calls:?}"
    );
    assert_eq!(
        (calls[0].tool.as_str(), calls[0].decision),
        ("lookup", None)
    );
    assert_eq!(calls[0].outcome, v1::ToolOutcome::Ok(json!({"total": 500})));
    assert_eq!(calls[1].arguments, json!({"amount": 500}), "as proposed");
    assert_eq!(calls[1].made_with, Some(json!({"amount": 300})));
    assert_eq!(calls[1].decision, Some(Verdict::Edit));
    assert_eq!(
        calls[1].outcome,
        v1::ToolOutcome::Ok(json!({"refund": "R-1"}))
    );
    assert_eq!(calls[2].decision, Some(Verdict::Reject));
    let v1::ToolOutcome::Failed { observation } = &calls[2].outcome else {
        panic!("a rejected call is an error to the model");
    };
    assert!(
        observation.contains("rejected by carol: too much"),
        "{observation}"
    );
    assert!(was_gated(&calls[1]) && !was_gated(&calls[0]));
}

/// The test's log: the task, `Forked` with the recorded calls, then the
/// new version's replies (each answered call with its intent).
fn test_run(sandbox: &Sandbox, replies: Vec<Entry>) -> RunState {
    let mut log: Vec<Entry> = started().records().map(|(_, e)| e.clone()).collect();
    log.push(Entry::Forked(Forked {
        parent_uid: "p".into(),
        parent_name: "p".into(),
        seq: 0,
        parent_hash: "00".repeat(32),
        requester: None,
        test: Some(sandbox.clone()),
        budget: None,
        prefix_usage: None,
        replaced: None,
    }));
    log.extend(replies);
    RunState::replay(log)
}

#[test]
fn a_proposal_gets_the_recorded_call_alike_in_any_order_and_each_once() {
    let sandbox = recorded_calls(&recorded());
    // The refund first, then the lookup: each finds its own.
    let state = test_run(
        &sandbox,
        vec![model_call(&[
            ("refund", json!({"amount": 500})),
            ("lookup", json!({"id": 1})),
        ])],
    );
    assert_eq!(state.sandbox(), Some(&sandbox));
    let Some(Answer::Recorded { index: 1, call }) = answer(&state, &sandbox, 2, 0) else {
        panic!("the refund matches the recorded refund");
    };
    assert_eq!(call.made_with, Some(json!({"amount": 300})));
    assert!(matches!(
        answer(&state, &sandbox, 2, 1),
        Some(Answer::Recorded { index: 0, .. })
    ));

    // The same lookup twice: the recorded run made it once.
    let state = test_run(
        &sandbox,
        vec![
            model_call(&[("lookup", json!({"id": 1})), ("lookup", json!({"id": 1}))]),
            intent(2, 0, "lookup", json!({"id": 1})),
        ],
    );
    assert!(matches!(
        answer(&state, &sandbox, 2, 0),
        Some(Answer::Recorded { index: 0, .. })
    ));
    let Some(Answer::Diverged { position, instead }) = answer(&state, &sandbox, 2, 1) else {
        panic!("a second lookup was never recorded");
    };
    assert_eq!(position, 1);
    assert_eq!(instead.map(|c| c.tool.as_str()), Some("refund"));
}

#[test]
fn other_arguments_diverge_and_the_reason_shows_both_calls() {
    let sandbox = recorded_calls(&recorded());
    let state = test_run(&sandbox, vec![model_call(&[("lookup", json!({"id": 2}))])]);
    let Some(Answer::Diverged { position, instead }) = answer(&state, &sandbox, 2, 0) else {
        panic!("another order's lookup was never recorded");
    };
    assert_eq!(position, 0);
    let why = divergence("lookup", &json!({"id": 2}), position, instead);
    assert!(
        why.contains(r#"call 1 is lookup {"id":2}"#) && why.contains(r#"was lookup {"id":1}"#),
        "{why}"
    );
    let past = divergence("lookup", &json!({"id": 2}), 3, None);
    assert!(past.contains("made only 3 calls"), "{past}");
}

fn ended(outcome: crate::runlog::records::Outcome, result: Option<&str>) -> Entry {
    Entry::RunFinished(crate::runlog::records::RunFinished {
        outcome,
        result: result.map(str::to_string),
        error: None,
    })
}

fn entries(state: &RunState) -> Vec<Entry> {
    state.records().map(|(_, e)| e.clone()).collect()
}

#[test]
fn the_report_says_where_a_test_diverged_and_what_each_side_spent() {
    use crate::runlog::records::Outcome;
    let mut recorded = entries(&recorded());
    recorded.push(ended(Outcome::Succeeded, Some("done")));
    let sandbox = recorded_calls(&RunState::replay(recorded.clone()));
    let mut tested = entries(&test_run(
        &sandbox,
        vec![model_call(&[("lookup", json!({"id": 2}))])],
    ));
    tested.push(ended(Outcome::Diverged, None));

    let r = report::report("r1", "r1-test-x", &recorded, &tested);
    assert!(r.diverged() && !r.same_answer);
    let d = r.diverged.clone().unwrap();
    assert_eq!((d.seq, d.call), (2, 1));
    assert_eq!(d.new.arguments, json!({"id": 2}));
    assert_eq!(d.recorded.map(|c| c.arguments), Some(json!({"id": 1})));
    // Three answers of 15 tokens ($0.50 each) against one; two calls were
    // put to a human in the recorded run.
    assert_eq!((r.recorded.tokens, r.new.tokens), (45, 15));
    assert_eq!((r.recorded.cost_usd, r.new.cost_usd), (1.5, 0.5));
    assert_eq!((r.recorded.gated_calls, r.new.gated_calls), (2, 0));
    assert_eq!(r.recorded_answer.as_deref(), Some("done"));

    let mut same = entries(&test_run(&sandbox, vec![]));
    same.push(ended(Outcome::Succeeded, Some("done ")));
    let r = report::report("r1", "r1-test-y", &recorded, &same);
    assert!(r.same_answer && !r.diverged(), "{r:?}");
}

/// A controller holds a long run's state from a checkpoint: the test's
/// `Forked` record stays in force, so the test stays a test.
#[test]
fn a_test_stays_a_test_past_a_checkpoint_and_a_fork_of_it_is_none() {
    let sandbox = recorded_calls(&recorded());
    let state = test_run(&sandbox, vec![model_call(&[("lookup", json!({"id": 1}))])]);
    let start = state.len();
    let pinned: Vec<(u64, Entry)> = state
        .pinned_before(start)
        .into_iter()
        .map(|seq| (seq, state.entry(seq).unwrap().clone()))
        .collect();
    let resumed = RunState::resume_at(start, pinned, state.spent.clone());
    assert_eq!(resumed.sandbox(), Some(&sandbox));

    let mut fork = entries(&state);
    fork.push(Entry::Forked(Forked {
        parent_uid: "t".into(),
        parent_name: "t".into(),
        seq: 2,
        parent_hash: "00".repeat(32),
        requester: None,
        budget: None,
        prefix_usage: None,
        replaced: None,
        test: None,
    }));
    assert_eq!(RunState::replay(fork).sandbox(), None);
}

/// How a call was settled, found by searching the log after its ModelCall
/// for each record in turn (the matching before the index): the oracle
/// the one-pass index must agree with.
fn settled_by_search(log: &RunState, model_call_seq: u64, index: usize) -> Option<RecordedCall> {
    let later = || log.records_from(model_call_seq + 1);
    let request = later().rev().find_map(|(seq, e)| match e {
        Entry::ApprovalRequested(r)
            if r.kind == v1::ApprovalKind::Call
                && (r.model_call_seq, r.call_index) == (model_call_seq, index) =>
        {
            Some((seq, r))
        }
        _ => None,
    });
    let decided = request.and_then(|(request_seq, r)| {
        later().find_map(|(_, e)| match e {
            Entry::ApprovalDecided(d) if d.request_seq == request_seq => Some((r, d)),
            _ => None,
        })
    });
    let intent = later().find_map(|(seq, e)| match e {
        Entry::ToolIntent(i) if (i.model_call_seq, i.call_index) == (model_call_seq, index) => {
            Some((seq, i))
        }
        _ => None,
    });
    let Some(Entry::ModelCall(m)) = log.entry(model_call_seq) else {
        return None;
    };
    let proposed = &m.response.tool_calls[index];
    let (made_with, outcome) = match (intent, decided) {
        (Some((intent_seq, i)), _) => (
            (i.arguments != proposed.arguments).then(|| i.arguments.clone()),
            later().find_map(|(_, e)| match e {
                Entry::ToolResult(r) if r.intent_seq == intent_seq => Some(r.outcome.clone()),
                _ => None,
            })?,
        ),
        (None, Some((r, d))) if d.settles_without_running() => (
            None,
            v1::ToolOutcome::Failed {
                observation: crate::runlog::records::not_run_note(r, d),
            },
        ),
        _ => return None,
    };
    Some(RecordedCall {
        model_call_seq,
        call_index: index,
        tool: proposed.name.clone(),
        arguments: proposed.arguments.clone(),
        made_with,
        outcome,
        decision: decided.map(|(_, d)| d.verdict),
    })
}

/// The one-pass index settles every call of a canned run as a search of
/// the log does, at every prefix of the run (a call settled later, or
/// never, included).
#[test]
fn the_recorded_calls_are_the_searched_ones_at_every_prefix() {
    let whole: Vec<Entry> = recorded().records().map(|(_, e)| e.clone()).collect();
    let mut compared = 0;
    for len in 1..=whole.len() {
        let log = RunState::replay(whole[..len].to_vec());
        let searched: Vec<RecordedCall> = log
            .records()
            .filter_map(|(seq, e)| match e {
                Entry::ModelCall(m) => Some((seq, m.response.tool_calls.len())),
                _ => None,
            })
            .flat_map(|(seq, n)| (0..n).map(move |i| (seq, i)))
            .filter_map(|(seq, i)| settled_by_search(&log, seq, i))
            .collect();
        compared += searched.len();
        assert_eq!(recorded_calls(&log).calls, searched, "after {len} records");
    }
    assert!(compared > 10, "the prefixes settle calls: {compared}");
}
