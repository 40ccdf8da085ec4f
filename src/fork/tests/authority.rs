//! Authority stays with its run (DESIGN.md §11): a decision copied into a
//! fork authorizes no effect that is new in the fork. Canned runs (an
//! approved, an edited and a rejected gated refund, reconciled calls, a
//! raised budget, and a fork's own approval copied into its fork) are
//! forked at every seq through the controller's copy (`plan`), and the
//! fork's `Next` is read as the runner and the controller read it.

use serde_json::{Value, json};

use super::*;
use crate::api::ForkBudget;
use crate::policy::{Classification, Network};
use crate::replay::tests::{decided, model_call, request};
use crate::replay::{Next, RunState};
use crate::runlog::records::{ApprovalRequested, Recovery, ToolIntent, ToolResult, Verdict};
use crate::runlog::v1::{self, ApprovalKind};
use crate::tools::idempotency_key;

const FORK: &str = "fork";

/// The canned agent: a lookup, a refund the policy gates above 100 (no
/// key, no lookup: its outcome is unknowable after a crash) and an email;
/// `budgets` as given.
fn agent(budgets: Option<Value>) -> v1::AgentTemplate {
    let mut agent = json!({
        "prompt": {"version": "v1", "system": "Refund what the order shows."},
        "model": {"provider": "OpenAI", "name": "m", "endpoint": "http://model.example/v1"},
        "tools": [
            {"name": "lookup", "http": {"url": "http://tools.example/lookup", "readOnly": true}},
            {"name": "refund", "http": {"url": "http://tools.example/refund"}},
            {"name": "email", "http": {"url": "http://tools.example/email"}},
        ],
        "approval": {"rules": [{
            "name": "large", "tool": "refund", "when": "args.amount > 100",
            "approvers": {"users": ["alice"]}}]},
    });
    if let Some(budgets) = budgets {
        agent["budgets"] = budgets;
    }
    serde_json::from_value(agent).unwrap()
}

/// A log being written, as a run's workers and controller write it.
struct Log {
    run: &'static str,
    entries: Vec<Entry>,
}

impl Log {
    fn started(budgets: Option<Value>) -> Log {
        let Entry::RunStarted(mut started) = crate::replay::tests::started().entries()[0].clone()
        else {
            unreachable!()
        };
        started.agent = agent(budgets);
        Log {
            run: PARENT,
            entries: vec![Entry::RunStarted(started)],
        }
    }

    fn push(&mut self, entry: Entry) -> u64 {
        self.entries.push(entry);
        self.entries.len() as u64 - 1
    }

    fn reply(&mut self, calls: &[(&str, Value)]) -> u64 {
        self.push(model_call(calls))
    }

    fn intent(&mut self, model_call_seq: u64, index: usize, tool: &str, args: Value) -> u64 {
        self.push(Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq,
            call_index: index,
            call_id: format!("c{index}"),
            tool: tool.into(),
            arguments: args,
            key: idempotency_key(self.run, model_call_seq, index),
            sandboxed: None,
        }))
    }

    fn result(&mut self, intent_seq: u64, recovery: Option<Recovery>) -> u64 {
        let Entry::ToolIntent(intent) = &self.entries[intent_seq as usize] else {
            panic!("{intent_seq} is no intent")
        };
        let (call_id, tool) = (intent.call_id.clone(), intent.tool.clone());
        self.push(Entry::ToolResult(ToolResult {
            intent_seq,
            call_id,
            tool,
            outcome: v1::ToolOutcome::Ok(json!({"done": intent_seq})),
            recovery,
        }))
    }

    fn call(&mut self, model_call_seq: u64, index: usize, tool: &str, args: Value) {
        let intent = self.intent(model_call_seq, index, tool, args);
        self.result(intent, None);
    }

    fn ask(&mut self, asked: ApprovalRequested) -> u64 {
        self.push(Entry::ApprovalRequested(asked))
    }

    fn decide(&mut self, request_seq: u64, verdict: Verdict, args: Option<Value>) -> u64 {
        self.decide_as("alice", request_seq, verdict, args)
    }

    /// `approver`'s decision, with the reason an edit gives.
    fn decide_as(
        &mut self,
        approver: &str,
        request_seq: u64,
        verdict: Verdict,
        args: Option<Value>,
    ) -> u64 {
        let Entry::ApprovalDecided(mut d) = decided(verdict, None, args.clone()) else {
            unreachable!()
        };
        d.request_seq = request_seq;
        d.decisions = vec![crate::runlog::records::RecordedDecision {
            approver: approver.into(),
            verdict: match verdict {
                Verdict::Edit => v1::Verdict::Edit,
                Verdict::Reject => v1::Verdict::Reject,
                _ => v1::Verdict::Approve,
            },
            arguments_hash: String::new(),
            reason: (verdict == Verdict::Edit).then(|| "partial refund".into()),
            arguments: args,
        }];
        self.push(Entry::ApprovalDecided(d))
    }
}

/// The request for call `index` of the reply at `model_call_seq`, with the
/// gate the policy pinned in `state` gives it (what an honest runner asks).
fn asked(
    state: &RunState,
    model_call_seq: u64,
    index: usize,
    tool: &str,
    args: Value,
) -> ApprovalRequested {
    let Classification::RequireApproval(gate) =
        state.classify_at(state.len(), tool, &args, &Network::of("n"))
    else {
        panic!("{tool} {args} is not gated")
    };
    ApprovalRequested {
        model_call_seq,
        call_index: index,
        call_id: format!("c{index}"),
        tool: tool.into(),
        arguments_hash: crate::policy::arguments_hash(tool, &args),
        arguments: args,
        gate: *gate,
        ..request_of(ApprovalKind::Call)
    }
}

fn request_of(kind: ApprovalKind) -> ApprovalRequested {
    let Entry::ApprovalRequested(mut r) = request() else {
        unreachable!()
    };
    r.kind = kind;
    r
}

/// A lookup, then a refund of 500 the policy gates, decided `verdict` by
/// alice (an edit makes it 300); then an email, then the end.
fn gated(verdict: Verdict) -> Vec<Entry> {
    let mut log = Log::started(None);
    let mc = log.reply(&[
        ("lookup", json!({"order": "A-7"})),
        ("refund", json!({"amount": 500})),
    ]);
    log.call(mc, 0, "lookup", json!({"order": "A-7"}));
    let state = RunState::replay(log.entries.clone());
    let request = log.ask(asked(&state, mc, 1, "refund", json!({"amount": 500})));
    let made_with = match verdict {
        Verdict::Approve => Some(json!({"amount": 500})),
        Verdict::Edit => Some(json!({"amount": 300})),
        _ => None,
    };
    log.decide_as("bob", request, verdict, made_with.clone());
    if let Some(args) = made_with {
        log.call(mc, 1, "refund", args);
    }
    let mc = log.reply(&[("email", json!({"to": "customer"}))]);
    log.call(mc, 0, "email", json!({"to": "customer"}));
    log.reply(&[("finish", json!({"result": "done"}))]);
    log.entries
}

/// A refund of 50 (under the gate) whose worker died after its intent,
/// its outcome unknowable: a human said whether it `happened`, and the
/// run went on (made it, if it had not).
fn reconciled(happened: bool) -> Vec<Entry> {
    let mut log = Log::started(None);
    let args = json!({"amount": 50});
    let mc = log.reply(&[("refund", args.clone())]);
    let intent = log.intent(mc, 0, "refund", args.clone());
    let request = log.ask(ApprovalRequested {
        model_call_seq: mc,
        call_index: 0,
        call_id: "c0".into(),
        tool: "refund".into(),
        arguments_hash: crate::policy::arguments_hash("refund", &args),
        arguments: args.clone(),
        intent_seq: Some(intent),
        ..request_of(ApprovalKind::Reconcile)
    });
    let (verdict, recovery) = if happened {
        (Verdict::Approve, Recovery::HumanConfirmedDone)
    } else {
        (Verdict::Reject, Recovery::HumanConfirmedNotDone)
    };
    log.decide(request, verdict, happened.then_some(args));
    log.result(intent, Some(recovery));
    let mc = log.reply(&[("email", json!({"to": "customer"}))]);
    log.call(mc, 0, "email", json!({"to": "customer"}));
    log.reply(&[("finish", json!({"result": "done"}))]);
    log.entries
}

/// The agent's step budget (6, asking alice when used up).
const STEPS: u64 = 6;

/// A reply of four lookups under a budget of 6 steps that asks: the third
/// would pass it, so the run asked, alice raised it to 20, and the reply
/// went on.
fn raised() -> Vec<Entry> {
    let mut log = Log::started(Some(json!({
        "maxSteps": STEPS, "onExhausted": "Ask", "approvers": {"users": ["alice"]}
    })));
    let calls: Vec<(&str, Value)> = (0..4).map(|i| ("lookup", json!({"id": i}))).collect();
    let mc = log.reply(&calls);
    for i in 0..2 {
        log.call(mc, i, "lookup", json!({"id": i}));
    }
    let state = RunState::replay(log.entries.clone());
    let Next::AskBudget { arguments, .. } = state.next() else {
        panic!("the budget is used up: {:?}", state.next())
    };
    let request = log.ask(ApprovalRequested {
        model_call_seq: mc,
        tool: crate::api::BUDGET_TOOL.into(),
        arguments_hash: crate::policy::arguments_hash(crate::api::BUDGET_TOOL, &arguments),
        arguments,
        ..request_of(ApprovalKind::Budget)
    });
    log.decide(request, Verdict::Edit, Some(json!({"maxSteps": 20})));
    for i in 2..4 {
        log.call(mc, i, "lookup", json!({"id": i}));
    }
    log.reply(&[("finish", json!({"result": "done"}))]);
    log.entries
}

/// `log` sealed as run `uid`'s records (the controller's signed).
fn sealed(uid: &str, log: &[Entry]) -> Vec<Record> {
    let mut head = Head::EMPTY;
    log.iter()
        .map(|entry| {
            let record = signer().seal(uid, entry.draft(), &head).unwrap();
            head = record.head();
            record
        })
        .collect()
}

/// The fork's log after `seq` of `parent` (run `parent_uid`), as the
/// controller copies it.
fn forked_at(parent_uid: &str, parent: &[Record], seq: u64, budget: ForkBudget) -> Vec<Entry> {
    let mut at = point(parent_uid, seq);
    at.budget = budget;
    decode(&plan(&signer(), FORK, parent, &at, CONTROLLER).unwrap())
}

/// The state a controller keeps of `log`: compacted after every record.
fn compacted(log: &[Entry]) -> RunState {
    let mut state = RunState::default();
    for entry in log {
        state.apply(entry.clone());
        state.compact();
    }
    state
}

/// What every fork of `log` (run `uid`) at every seq must show: no call is
/// made on a decision copied from the parent; an intent copied without
/// its result is recovered with its recorded (the parent's) key; a call the
/// parent was approved to make goes to the fork's gate again, waits for
/// the fork's own approval (which the controller raises) and then runs as
/// the fork's approver decided; anything else is the parent's `Next`.
/// Returns the seqs where the parent held an approval the fork does not.
fn check_every_fork(uid: &str, log: &[Entry]) -> Vec<u64> {
    let records = sealed(uid, log);
    let mut asked_again = Vec::new();
    for seq in 0..log.len() as u64 {
        let fork = forked_at(uid, &records, seq, ForkBudget::FromFork);
        let state = RunState::replay(fork.clone());
        let parent = RunState::replay(log[..=seq as usize].to_vec());
        let next = state.next();
        assert_eq!(compacted(&fork).next(), next, "compacted, at seq {seq}");
        match &next {
            Next::Approved { request_seq, .. } => {
                assert!(
                    *request_seq > seq,
                    "at seq {seq}: the fork runs a call on the parent's approval {request_seq}"
                )
            }
            Next::Reconciled {
                happened: false,
                decided_seq,
                ..
            } => assert!(
                *decided_seq > seq,
                "at seq {seq}: the fork makes a call on the parent's word that it did not happen"
            ),
            Next::ExecuteTool { intent_seq, intent } => {
                let Entry::ToolIntent(recorded) = &log[*intent_seq as usize] else {
                    panic!("at seq {seq}: {intent_seq} is no intent")
                };
                assert!(*intent_seq <= seq, "at seq {seq}");
                assert_eq!(intent.key, recorded.key, "at seq {seq}: the parent's key");
                assert_ne!(
                    intent.key,
                    idempotency_key(FORK, intent.model_call_seq, intent.call_index)
                );
            }
            _ => {}
        }
        match parent.next() {
            Next::Approved { request, .. } => {
                asked_again.push(seq);
                the_forks_gate_asks_again(&state, seq, next, &request);
            }
            Next::Reconciled {
                intent_seq,
                intent,
                happened: false,
                ..
            } => {
                asked_again.push(seq);
                assert_eq!(
                    next,
                    Next::ExecuteTool { intent_seq, intent },
                    "at seq {seq}"
                );
            }
            // A request the parent waited on was raised under the
            // parent's policy: the fork's gate asks again under its own.
            Next::AwaitApproval { request_seq } => match parent.entry(request_seq) {
                Some(Entry::ApprovalRequested(request)) if request.kind == ApprovalKind::Call => {
                    the_forks_gate_asks_again(&state, seq, next, request);
                }
                _ => assert_eq!(next, parent.next(), "at seq {seq}"),
            },
            theirs => assert_eq!(next, theirs, "at seq {seq}"),
        }
    }
    asked_again
}

/// A fork at `seq` of a parent whose approval (or request) covered the
/// call `request` is about: the fork's next step takes that call to its
/// own gate, and its own approval decides it.
fn the_forks_gate_asks_again(state: &RunState, seq: u64, next: Next, request: &ApprovalRequested) {
    let (mc, index) = (request.model_call_seq, request.call_index);
    let Next::RecordIntent {
        model_call_seq,
        call_index,
        call,
    } = next
    else {
        panic!("at seq {seq}: the parent's approval or request was taken: {next:?}")
    };
    assert_eq!((model_call_seq, call_index), (mc, index), "at seq {seq}");
    the_forks_own_approval_decides(state, seq, mc, index, &call, request);
}

/// The fork's gate asks its own approvers about the call the parent's
/// approval covered: the controller takes the request (the gate is the
/// pinned policy's), the fork waits on it; an intent written without it
/// ends the fork unmade; the fork's decision is what runs.
fn the_forks_own_approval_decides(
    state: &RunState,
    seq: u64,
    mc: u64,
    index: usize,
    call: &crate::model::ToolCall,
    parents: &ApprovalRequested,
) {
    let mut fork = state.clone();
    // A step pod of the fork that writes the intent on the copied approval.
    let mut forged = fork.clone();
    forged.apply(Entry::ToolIntent(ToolIntent {
        requested: None,
        model_call_seq: mc,
        call_index: index,
        call_id: call.id.clone(),
        tool: call.name.clone(),
        arguments: parents.arguments.clone(),
        key: idempotency_key(FORK, mc, index),
        sandboxed: None,
    }));
    match forged.next() {
        Next::Finish {
            outcome: crate::runlog::records::Outcome::Failed,
            error: Some(error),
            ..
        } => assert!(
            error.contains("no approval of exactly that call"),
            "at seq {seq}: {error}"
        ),
        other => panic!("at seq {seq}: an intent on the copied approval: {other:?}"),
    }
    // The runner's request, after the fork's `Forked`.
    let own = asked(&fork, mc, index, &call.name, call.arguments.clone());
    let own_seq = fork.len();
    fork.apply(Entry::ApprovalRequested(own));
    assert_eq!(
        fork.next(),
        Next::AwaitApproval {
            request_seq: own_seq
        },
        "at seq {seq}"
    );
    assert!(own_seq > seq + 1);
    crate::controller::approvals::pinned_gate::check_on(&fork, own_seq, &Network::of("n"))
        .unwrap_or_else(|e| panic!("at seq {seq}: the controller refuses the fork's request: {e}"));
    // The fork's approver decides (here: 120, whatever the parent's said).
    let Entry::ApprovalDecided(mut d) = decided(Verdict::Edit, None, Some(json!({"amount": 120})))
    else {
        unreachable!()
    };
    d.request_seq = own_seq;
    fork.apply(Entry::ApprovalDecided(d));
    match fork.next() {
        Next::Approved {
            request_seq,
            arguments,
            ..
        } => {
            assert_eq!(request_seq, own_seq, "at seq {seq}");
            assert_eq!(arguments, json!({"amount": 120}), "at seq {seq}");
        }
        other => panic!("at seq {seq}: the fork's approval: {other:?}"),
    }
}

#[test]
fn every_fork_of_an_approved_refund_asks_its_own_approvers_before_the_refund() {
    let log = gated(Verdict::Approve);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    assert_eq!(check_every_fork(PARENT, &log), vec![decided_at]);
}

#[test]
fn every_fork_of_an_edited_refund_asks_its_own_approvers_before_the_refund() {
    let log = gated(Verdict::Edit);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    assert_eq!(check_every_fork(PARENT, &log), vec![decided_at]);
    // The call is the model's again, not the parent's edit.
    let fork = forked_at(
        PARENT,
        &sealed(PARENT, &log),
        decided_at,
        ForkBudget::FromFork,
    );
    match RunState::replay(fork).next() {
        Next::RecordIntent { call, .. } => assert_eq!(call.arguments, json!({"amount": 500})),
        other => panic!("{other:?}"),
    }
}

/// What the model is told of a call the fork decided again is the fork's
/// decision: never the parent's edit, which did not make it.
#[test]
fn the_model_of_a_fork_is_told_the_forks_decision_not_the_parents_edit() {
    let log = gated(Verdict::Edit);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    let told = |entries: &[Entry]| {
        let state = RunState::replay(entries.to_vec());
        assert_eq!(state.next(), Next::CallModel);
        let (request, _) =
            crate::step::prompt::request_for_step(&state, state.snapshot.as_ref().unwrap());
        serde_json::to_string(&request).unwrap()
    };
    // The parent's model is told bob's edit.
    let parent = told(&log[..decided_at as usize + 3]);
    assert!(
        parent.contains("bob changed amount from 500 to 300: partial refund"),
        "{parent}"
    );
    let copy = forked_at(
        PARENT,
        &sealed(PARENT, &log),
        decided_at,
        ForkBudget::FromFork,
    );
    // The fork's approver decides (carol approves the call as proposed,
    // or edits it herself); the fork makes it and asks its model.
    for (verdict, made_with, note) in [
        (Verdict::Approve, json!({"amount": 500}), None),
        (
            Verdict::Edit,
            json!({"amount": 120}),
            Some("carol changed amount from 500 to 120: partial refund"),
        ),
    ] {
        let mut fork = Log {
            run: FORK,
            entries: copy.clone(),
        };
        let state = RunState::replay(fork.entries.clone());
        let own = fork.ask(asked(&state, 1, 1, "refund", json!({"amount": 500})));
        fork.decide_as("carol", own, verdict, Some(made_with.clone()));
        fork.call(1, 1, "refund", made_with);
        let sent = told(&fork.entries);
        assert!(!sent.contains("bob changed"), "{verdict:?}: {sent}");
        match note {
            Some(note) => assert!(sent.contains(note), "{verdict:?}: {sent}"),
            None => assert!(!sent.contains(" changed "), "{verdict:?}: {sent}"),
        }
    }
}

#[test]
fn every_fork_of_a_rejected_refund_keeps_the_rejection_and_makes_nothing() {
    let log = gated(Verdict::Reject);
    assert_eq!(check_every_fork(PARENT, &log), Vec::<u64>::new());
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    let fork = forked_at(
        PARENT,
        &sealed(PARENT, &log),
        decided_at,
        ForkBudget::FromFork,
    );
    let state = RunState::replay(fork);
    assert_eq!(
        state.next(),
        Next::CallModel,
        "the model is told it was rejected"
    );
    assert_eq!(
        state.call_state(1, 1),
        crate::replay::CallState::Settled,
        "the copied rejection stands"
    );
}

#[test]
fn every_fork_of_a_reconciled_call_recovers_it_with_the_parents_key() {
    // "It did not happen", copied: the fork recovers the parent's intent
    // by its key (its lookup, or its own question), never makes it on the
    // parent's word.
    let log = reconciled(false);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    assert_eq!(check_every_fork(PARENT, &log), vec![decided_at]);
    let records = sealed(PARENT, &log);
    let mut fork = RunState::replay(forked_at(
        PARENT,
        &records,
        decided_at,
        ForkBudget::FromFork,
    ));
    let Next::ExecuteTool { intent_seq, intent } = fork.next() else {
        panic!("{:?}", fork.next())
    };
    // The runner's lookup cannot tell: the fork asks its own question.
    let own_seq = fork.len();
    fork.apply(Entry::ApprovalRequested(ApprovalRequested {
        intent_seq: Some(intent_seq),
        model_call_seq: intent.model_call_seq,
        call_index: intent.call_index,
        call_id: intent.call_id.clone(),
        tool: intent.tool.clone(),
        arguments_hash: crate::policy::arguments_hash(&intent.tool, &intent.arguments),
        arguments: intent.arguments.clone(),
        ..request_of(ApprovalKind::Reconcile)
    }));
    assert_eq!(
        fork.next(),
        Next::AwaitApproval {
            request_seq: own_seq
        }
    );
    let Entry::ApprovalDecided(mut d) = decided(Verdict::Reject, None, None) else {
        unreachable!()
    };
    d.request_seq = own_seq;
    fork.apply(Entry::ApprovalDecided(d));
    match fork.next() {
        Next::Reconciled {
            happened: false,
            decided_seq,
            intent: made,
            ..
        } => {
            assert_eq!(decided_seq, own_seq);
            assert_eq!(made.key, intent.key, "the parent's call, by its key");
        }
        other => panic!("{other:?}"),
    }

    // "It happened", copied: it stands (it makes nothing).
    let log = reconciled(true);
    assert_eq!(check_every_fork(PARENT, &log), Vec::<u64>::new());
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    let fork = forked_at(
        PARENT,
        &sealed(PARENT, &log),
        decided_at,
        ForkBudget::FromFork,
    );
    assert!(matches!(
        RunState::replay(fork).next(),
        Next::Reconciled { happened: true, .. }
    ));
}

#[test]
fn every_fork_of_a_raised_budget_counts_no_raise_of_the_parents_inheriting_or_not() {
    let log = raised();
    let records = sealed(PARENT, &log);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    for seq in 0..log.len() as u64 {
        let parent = RunState::replay(log[..=seq as usize].to_vec());
        for budget in [ForkBudget::FromFork, ForkBudget::Inherit] {
            let fork = forked_at(PARENT, &records, seq, budget);
            let state = RunState::replay(fork.clone());
            let at = format!("{budget:?} at seq {seq}");
            assert_eq!(
                state.budgets().and_then(|b| b.max_steps),
                Some(STEPS),
                "{at}: the parent's raise carried"
            );
            assert_eq!(compacted(&fork).budgets(), state.budgets(), "{at}");
            assert_eq!(compacted(&fork).next(), state.next(), "{at}");
            if seq >= decided_at {
                assert_eq!(parent.budgets().and_then(|b| b.max_steps), Some(20), "{at}");
            }
            if budget == ForkBudget::FromFork {
                continue;
            }
            // Inheriting the parent's spending (past 6 steps), not its raise:
            // the fork asks its own approvers before any call of its own.
            match state.next() {
                Next::ExecuteTool { intent, .. } => {
                    let Entry::ToolIntent(recorded) = &log[seq as usize] else {
                        panic!("{at}")
                    };
                    assert_eq!(
                        intent.key, recorded.key,
                        "{at}: recovered by the parent's key"
                    );
                }
                Next::AskBudget { arguments, .. } if seq + 2 >= STEPS => {
                    // What the controller requires of the question is what
                    // the runner asks.
                    let (_, due) = state.budget_question_due(state.len()).unwrap();
                    assert_eq!(arguments, due, "{at}");
                }
                Next::AwaitApproval { request_seq } if request_seq < decided_at => {
                    assert_eq!(seq + 1, decided_at, "{at}: the question still undecided");
                }
                Next::RecordIntent { .. } | Next::CallModel if seq + 2 < STEPS => {}
                // The runner asks before the model is (`model_step`).
                Next::CallModel => {
                    let budgets = state.budgets();
                    assert!(state.budget_exceeded(budgets.as_ref()).is_some(), "{at}");
                }
                Next::Finish { .. } if seq + 1 == log.len() as u64 => {}
                other => panic!("{at}: {other:?}"),
            }
        }
    }
}

/// `log` as a controller resumed from a checkpoint at its window holds it.
fn resumed_at_its_window(log: &[Entry]) -> RunState {
    let whole = RunState::replay(log.to_vec());
    let start = whole.window_start();
    let pinned: Vec<(u64, Entry)> = whole
        .pinned_before(start)
        .into_iter()
        .map(|seq| (seq, log[seq as usize].clone()))
        .collect();
    let before = RunState::replay(log[..start as usize].to_vec()).spent;
    let mut resumed = RunState::resume_at(start, pinned, before);
    for entry in &log[start as usize..] {
        resumed.apply(entry.clone());
    }
    resumed
}

#[test]
fn an_inheriting_fork_resumed_from_a_checkpoint_past_its_start_carries_no_raise_either() {
    let log = raised();
    let records = sealed(PARENT, &log);
    let seq = log.len() as u64 - 2;
    let mut fork = forked_at(PARENT, &records, seq, ForkBudget::Inherit);
    let forked = seq + 1;
    // The budget is used up (the parent's spending, not its raise): the
    // fork asks its own approvers, who raise it to 40.
    let state = RunState::replay(fork.clone());
    let budgets = state.budgets().unwrap();
    assert_eq!(budgets.max_steps, Some(STEPS));
    assert!(state.budget_exceeded(Some(&budgets)).is_some());
    let arguments = state.budget_proposal(&budgets);
    let without_own = fork.clone();
    let own = fork.len() as u64;
    fork.push(Entry::ApprovalRequested(ApprovalRequested {
        model_call_seq: 1,
        tool: crate::api::BUDGET_TOOL.into(),
        arguments_hash: crate::policy::arguments_hash(crate::api::BUDGET_TOOL, &arguments),
        arguments,
        ..request_of(ApprovalKind::Budget)
    }));
    let Entry::ApprovalDecided(mut d) = decided(Verdict::Edit, None, Some(json!({"maxSteps": 40})))
    else {
        unreachable!()
    };
    d.request_seq = own;
    fork.push(Entry::ApprovalDecided(d));
    // Replies of its own, so the window starts past `Forked`.
    for (log, max) in [(fork, 40), (without_own, STEPS)] {
        let mut log = log;
        log.push(model_call(&[("lookup", json!({"id": 9}))]));
        let whole = RunState::replay(log.clone());
        assert!(whole.window_start() > forked);
        assert!(whole.pinned_before(whole.window_start()).contains(&forked));
        let resumed = resumed_at_its_window(&log);
        assert_eq!(whole.budgets().and_then(|b| b.max_steps), Some(max));
        assert_eq!(resumed.budgets(), whole.budgets(), "{max}");
        assert_eq!(resumed.next(), whole.next(), "{max}");
    }
}

/// A fork's own approval, copied into a fork of it, is the child's: the
/// grandchild asks again too.
#[test]
fn a_forks_own_approval_copied_into_its_fork_authorizes_nothing_there() {
    let parent = gated(Verdict::Approve);
    let decided_at = parent
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    // The child, forked at the parent's decision, asks and is approved,
    // then runs on like the parent.
    let child_copy = forked_at(
        PARENT,
        &sealed(PARENT, &parent),
        decided_at,
        ForkBudget::FromFork,
    );
    let mut child = Log {
        run: "child",
        entries: child_copy,
    };
    let state = RunState::replay(child.entries.clone());
    let request = child.ask(asked(&state, 1, 1, "refund", json!({"amount": 500})));
    child.decide(request, Verdict::Approve, Some(json!({"amount": 500})));
    child.call(1, 1, "refund", json!({"amount": 500}));
    let mc = child.reply(&[("email", json!({"to": "customer"}))]);
    child.call(mc, 0, "email", json!({"to": "customer"}));
    child.reply(&[("finish", json!({"result": "done"}))]);
    // Its every seq as a fork point: the parent's decision and its own
    // are each copied where the grandchild would run the refund on them.
    let asked_again = check_every_fork("child", &child.entries);
    assert_eq!(asked_again, vec![decided_at, request + 1]);
}

/// A replay test's `Forked` (`test` set) cuts no decision off: its gated
/// calls are answered from the recorded run, by design, and make none.
#[test]
fn a_replay_tests_forked_record_cuts_no_decision_off() {
    let log = gated(Verdict::Approve);
    let decided_at = log
        .iter()
        .position(|e| matches!(e, Entry::ApprovalDecided(_)))
        .unwrap();
    let mut test = log[..=decided_at].to_vec();
    test.push(Entry::Forked(Forked {
        parent_uid: PARENT.into(),
        parent_name: "refund-1".into(),
        seq: decided_at as u64,
        parent_hash: "00".repeat(32),
        requester: Some("alice".into()),
        test: Some(Default::default()),
        budget: Some(ForkBudget::FromFork),
        prefix_usage: None,
        replaced: None,
    }));
    let state = RunState::replay(test);
    assert_eq!(state.authority_from(state.len()), 0);
    assert!(matches!(
        state.call_state(1, 1),
        crate::replay::CallState::Approved(..)
    ));
}
