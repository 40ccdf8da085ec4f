//! Replay tests (DESIGN.md §11): a new agent version run against a
//! recorded run without touching the world. The test's log begins as a
//! fork of the recorded run at its `RunStarted`, with the recorded run's
//! calls in its `Forked` record ([`Sandbox`]). The model is asked anew;
//! no tool is called and no approval raised: a proposed call that matches
//! a recorded one (the same tool and arguments, the k-th alike proposal
//! getting the k-th alike recorded call) is answered with what the
//! recorded run's model was told, and the first that matches none ends
//! the test `Diverged` there.

use std::collections::HashMap;

use serde_json::Value;

pub mod report;

use crate::replay::{Entry, RunState};
use crate::runlog::records::{
    ApprovalDecided, ApprovalRequested, RecordedCall, Sandbox, ToolIntent, Verdict,
};
use crate::runlog::v1::{ApprovalKind, ToolOutcome};

/// Why a replay test whose agent in force is a container agent ends
/// without running it (the controller and the runner both say it).
pub const CONTAINER_AGENT: &str = "replay test: the agent in force is a container agent, whose calls a test cannot answer from the recorded run: nothing is run";

/// The calls the recorded run's model proposed and that were settled (a
/// result, or a decision that it never runs), in the order proposed. A
/// call the run never settled (it ended or waits there) is left out: a
/// test reaching it diverges, as nothing says what it would have returned.
/// Linear in the log: its settlements are indexed in one pass first.
pub fn recorded_calls(parent: &RunState) -> Sandbox {
    let settlements = Settlements::of(parent);
    let mut calls = Vec::new();
    for (seq, entry) in parent.records() {
        let Entry::ModelCall(m) = entry else { continue };
        for (index, proposed) in m.response.tool_calls.iter().enumerate() {
            let (tool, arguments) = (&proposed.name, &proposed.arguments);
            if let Some(call) = settlements.settled(seq, index, tool, arguments) {
                calls.push(call);
            }
        }
    }
    Sandbox { calls }
}

/// A call: the seq of the ModelCall that proposed it, and its index there.
type CallAt = (u64, usize);

/// How the calls of a log were settled, by the call (or request, intent)
/// each record names; only records after the one they name count.
#[derive(Default)]
struct Settlements<'a> {
    /// The last approval request of each call (a voided one is asked again).
    requests: HashMap<CallAt, (u64, &'a ApprovalRequested)>,
    /// The first decision on each request.
    decisions: HashMap<u64, &'a ApprovalDecided>,
    /// The first intent of each call.
    intents: HashMap<CallAt, (u64, &'a ToolIntent)>,
    /// The first result of each intent.
    results: HashMap<u64, &'a ToolOutcome>,
}

impl<'a> Settlements<'a> {
    fn of(log: &'a RunState) -> Settlements<'a> {
        let mut s = Settlements::default();
        for (seq, entry) in log.records() {
            match entry {
                Entry::ApprovalRequested(r)
                    if r.kind == ApprovalKind::Call && seq > r.model_call_seq =>
                {
                    s.requests
                        .insert((r.model_call_seq, r.call_index), (seq, r));
                }
                Entry::ApprovalDecided(d) if seq > d.request_seq => {
                    s.decisions.entry(d.request_seq).or_insert(d);
                }
                Entry::ToolIntent(i) if seq > i.model_call_seq => {
                    let call = (i.model_call_seq, i.call_index);
                    s.intents.entry(call).or_insert((seq, i));
                }
                Entry::ToolResult(r) if seq > r.intent_seq => {
                    s.results.entry(r.intent_seq).or_insert(&r.outcome);
                }
                _ => {}
            }
        }
        s
    }

    /// How call `index` of the ModelCall at `model_call_seq` was settled.
    fn settled(
        &self,
        model_call_seq: u64,
        index: usize,
        tool: &str,
        arguments: &Value,
    ) -> Option<RecordedCall> {
        let call = (model_call_seq, index);
        let decided = self.requests.get(&call).and_then(|(request_seq, r)| {
            let d = self.decisions.get(request_seq)?;
            Some((*r, *d))
        });
        let (made_with, outcome) = match (self.intents.get(&call), decided) {
            (Some((intent_seq, i)), _) => (
                (i.arguments != *arguments).then(|| i.arguments.clone()),
                (*self.results.get(intent_seq)?).clone(),
            ),
            (None, Some((r, d))) if d.settles_without_running() => (
                None,
                ToolOutcome::Failed {
                    observation: crate::runlog::records::not_run_note(r, d),
                },
            ),
            _ => return None,
        };
        Some(RecordedCall {
            model_call_seq,
            call_index: index,
            tool: tool.to_string(),
            arguments: arguments.clone(),
            made_with,
            outcome,
            decision: decided.map(|(_, d)| d.verdict),
        })
    }
}

/// What a replay test does with a call its model proposes.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<'a> {
    /// Answered as recorded call `index`.
    Recorded {
        index: usize,
        call: &'a RecordedCall,
    },
    /// No recorded call is left for it: the test ends here. `position`:
    /// how many calls were answered before it; `instead`: the recorded
    /// call at that position, if the run made one.
    Diverged {
        position: usize,
        instead: Option<&'a RecordedCall>,
    },
}

/// The answer to call `call_index` of the test's ModelCall at
/// `model_call_seq`, from the test's log up to there: the k-th proposal of
/// this tool and arguments gets the k-th recorded one, so calls a model
/// proposes in another order still match. Counted again from the log each
/// time, so a resumed step answers as the first did.
pub fn answer<'a>(
    test: &RunState,
    sandbox: &'a Sandbox,
    model_call_seq: u64,
    call_index: usize,
) -> Option<Answer<'a>> {
    let mut taken = vec![false; sandbox.calls.len()];
    let mut answered = 0;
    let earlier = answered_proposals(test).filter(|at| *at < (model_call_seq, call_index));
    for (m, i) in earlier {
        if let Some(index) = proposal(test, m, i).and_then(|p| next_alike(sandbox, &taken, p)) {
            taken[index] = true;
            answered += 1;
        }
    }
    let proposal = proposal(test, model_call_seq, call_index)?;
    Some(match next_alike(sandbox, &taken, proposal) {
        Some(index) => Answer::Recorded {
            index,
            call: &sandbox.calls[index],
        },
        None => Answer::Diverged {
            position: answered,
            instead: sandbox.calls.get(answered),
        },
    })
}

/// The first recorded call not yet taken with the proposal's tool and arguments.
fn next_alike(
    sandbox: &Sandbox,
    taken: &[bool],
    proposal: &crate::runlog::v1::ToolCall,
) -> Option<usize> {
    sandbox
        .calls
        .iter()
        .enumerate()
        .find(|(index, c)| {
            !taken[*index] && c.tool == proposal.name && c.arguments == proposal.arguments
        })
        .map(|(index, _)| index)
}

/// The test's proposals that were answered (have an intent), in order.
fn answered_proposals(test: &RunState) -> impl Iterator<Item = (u64, usize)> + '_ {
    test.records().filter_map(|(_, e)| match e {
        Entry::ToolIntent(i) => Some((i.model_call_seq, i.call_index)),
        _ => None,
    })
}

fn proposal(
    test: &RunState,
    model_call_seq: u64,
    call_index: usize,
) -> Option<&crate::runlog::v1::ToolCall> {
    match test.entry(model_call_seq)? {
        Entry::ModelCall(m) => m.response.tool_calls.get(call_index),
        _ => None,
    }
}

/// Whether the recorded run's policy asked a human about this call.
pub fn was_gated(call: &RecordedCall) -> bool {
    call.decision.is_some()
}

/// Why the test ended, as its stop record says: both calls side by side.
pub fn divergence(
    tool: &str,
    arguments: &Value,
    position: usize,
    instead: Option<&RecordedCall>,
) -> String {
    let recorded = match instead {
        Some(c) => format!(
            "the recorded run's call {} was {} {} (proposed at its seq {})",
            position + 1,
            c.tool,
            c.arguments,
            c.model_call_seq
        ),
        None => format!("the recorded run made only {position} calls"),
    };
    format!(
        "replay test diverged: the new version's call {} is {tool} {arguments}, which the recorded run never made; \
         {recorded}. Nothing was called.",
        position + 1
    )
}

/// A recorded decision as a report states it.
pub fn verdict_word(v: Verdict) -> &'static str {
    match v {
        Verdict::Approve => "approved",
        Verdict::Edit => "edited",
        Verdict::Reject => "rejected",
        Verdict::Expired => "expired",
    }
}

#[cfg(test)]
mod tests;
