//! A replay test run by the step runner (DESIGN.md §11): the model is
//! asked anew, no tool is called, each proposed call is answered from the
//! recorded run's, and the first that matches none ends the test.

use super::*;
use crate::runlog::records::{Forked, Sandbox};

/// The `Forked` record the controller starts a test of `recorded` with.
fn forked_for_test(recorded: &[Entry]) -> Entry {
    let sandbox = crate::sandbox::recorded_calls(&RunState::replay(recorded.to_vec()));
    Entry::Forked(Forked {
        parent_uid: "recorded-uid".into(),
        parent_name: "r1".into(),
        seq: 0,
        parent_hash: "00".repeat(32),
        requester: Some("dave".into()),
        test: Some(sandbox),
        budget: None,
        prefix_usage: None,
        replaced: None,
    })
}

/// The test's log as the controller starts it: the recorded run's task,
/// then `Forked` with its calls.
async fn test_log(dir: &std::path::Path, recorded: &[Entry]) -> (Arc<dyn StepStore>, Sandbox) {
    let forked = forked_for_test(recorded);
    let Entry::Forked(Forked {
        test: Some(sandbox),
        ..
    }) = &forked
    else {
        unreachable!()
    };
    let sandbox = sandbox.clone();
    (log_with(dir, &[recorded[0].clone(), forked]).await, sandbox)
}

fn tool_results(log: &[Entry]) -> Vec<&v1::ToolOutcome> {
    log.iter()
        .filter_map(|e| match e {
            Entry::ToolResult(r) => Some(&r.outcome),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_replay_test_answers_each_call_from_the_recorded_run_and_calls_no_tool() {
    let standins = Standins::start().await;
    let recorded = history(&standins.base);
    standins.script(&recorded);
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let (store, sandbox) = test_log(dir.path(), &recorded).await;
    assert_eq!(sandbox.calls.len(), 3);
    step_on(&store).await.unwrap();

    let log = read_log(&*store).await;
    let kinds = |l: &[Entry]| l.iter().map(Entry::kind).collect::<Vec<_>>();
    assert_eq!(
        kinds(&log[2..]),
        kinds(&recorded[1..]),
        "the same run, replayed"
    );
    assert_eq!(tool_results(&log), tool_results(&recorded));
    let answered: Vec<_> = log
        .iter()
        .filter_map(|e| match e {
            Entry::ToolIntent(i) => i.sandboxed,
            _ => None,
        })
        .map(|s| (s.recorded, s.gated))
        .collect();
    assert_eq!(answered, [(0, false), (1, false), (2, false)]);
    let counts = standins.counts();
    assert_eq!(counts.model_requests, 3, "the model is asked anew");
    assert!(
        counts.posts.is_empty(),
        "no tool was called: {:?}",
        counts.posts
    );
    assert!(counts.lookups.is_empty());
}

#[tokio::test]
async fn a_replay_test_ends_diverged_at_the_first_call_the_recorded_run_never_made() {
    let standins = Standins::start().await;
    let recorded = history(&standins.base);
    let mut turns = turns();
    turns[1].1[0].1 = json!({"refund": "R-9"});
    standins.script(&history_of(run_started(&standins.base), turns));
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = test_log(dir.path(), &recorded).await;
    step_on(&store).await.unwrap();

    let log = read_log(&*store).await;
    let stop = stop_of(&log).expect("the test stops");
    assert_eq!(stop.outcome, Outcome::Diverged);
    let error = stop.error.clone().unwrap();
    assert!(
        error.contains(r#"call 3 is search {"refund":"R-9"}"#)
            && error.contains(r#"was search {"refund":"R-1"}"#),
        "{error}"
    );
    // The controller ends the test as the runner asked.
    assert!(
        matches!(RunState::replay(log.clone()).next(), Next::Stop(f) if f.outcome == Outcome::Diverged)
    );
    // The first reply's two calls were answered; the diverging one was not.
    assert_eq!(tool_results(&log).len(), 2);
    let counts = standins.counts();
    assert_eq!(counts.model_requests, 2);
    assert!(
        counts.posts.is_empty(),
        "no tool was called: {:?}",
        counts.posts
    );
}

/// A test's log never holds an approval request; were one decided there
/// (a log written by hand), the runner reads and calls nothing for it.
#[tokio::test]
async fn a_decided_approval_in_a_tests_log_makes_no_call() {
    let standins = Standins::start().await;
    let recorded = history(&standins.base);
    standins.script(&recorded);
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let Entry::ModelCall(mut proposal) = recorded[1].clone() else {
        unreachable!()
    };
    proposal.response.tool_calls.remove(0);
    let Entry::ApprovalRequested(mut request) = crate::replay::tests::request() else {
        unreachable!()
    };
    (request.model_call_seq, request.call_index, request.call_id) = (2, 0, "c0".into());
    request.arguments = proposal.response.tool_calls[0].arguments.clone();
    request.tool = "refund".into();
    let approved = Some(request.arguments.clone());
    let Entry::ApprovalDecided(mut decided) =
        crate::replay::tests::decided(Verdict::Approve, None, approved)
    else {
        unreachable!()
    };
    decided.request_seq = 3;
    let forked = forked_for_test(&recorded);
    let prefix = [
        recorded[0].clone(),
        forked,
        Entry::ModelCall(proposal),
        Entry::ApprovalRequested(request),
        Entry::ApprovalDecided(decided),
    ];
    let store = log_with(dir.path(), &prefix).await;
    assert!(matches!(
        RunState::replay(prefix.to_vec()).next(),
        Next::Approved { .. }
    ));
    step_on(&store).await.unwrap();
    let log = read_log(&*store).await;
    let stop = stop_of(&log).expect("the test stops");
    assert_eq!(stop.outcome, Outcome::Failed);
    let counts = standins.counts();
    assert!(counts.posts.is_empty() && counts.lookups.is_empty());
    assert_eq!(counts.model_requests, 0);
}

/// The tested version gates the refund: nobody is asked, the recorded
/// result answers it, and the report's count says it would have been gated.
#[tokio::test]
async fn a_call_the_tested_policy_gates_is_answered_from_the_record_and_nobody_is_asked() {
    let standins = Standins::start().await;
    let recorded = history_of(super::gated_run_started(&standins.base, "refund"), turns());
    standins.script(&recorded);
    standins.reset([]);
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = test_log(dir.path(), &recorded).await;
    step_on(&store).await.unwrap();

    let log = read_log(&*store).await;
    let kinds = |l: &[Entry]| l.iter().map(Entry::kind).collect::<Vec<_>>();
    assert_eq!(kinds(&log[2..]), kinds(&recorded[1..]), "no approval asked");
    let gated: Vec<bool> = log
        .iter()
        .filter_map(|e| match e {
            Entry::ToolIntent(i) => i.sandboxed.map(|s| s.gated),
            _ => None,
        })
        .collect();
    assert_eq!(gated, [false, true, false], "the refund would be gated");
    assert!(matches!(
        RunState::replay(log).next(),
        Next::Finish {
            outcome: Outcome::Succeeded,
            ..
        }
    ));
    assert!(standins.counts().posts.is_empty());
}
