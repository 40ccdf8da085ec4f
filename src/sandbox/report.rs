//! What a replay test found, from the two logs alone: the recorded run's
//! and the test's (`kubectl agentrun replay-test` prints it).

use serde::Serialize;
use serde_json::Value;

use super::{Answer, answer};
use crate::replay::{Entry, RunState};
use crate::runlog::records::{Outcome, RunFinished};
use crate::runlog::v1::ApprovalKind;

/// One recorded run against the tested version.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunReport {
    /// The recorded run.
    pub run: String,
    /// The test run.
    pub test: String,
    /// How the test ended (`None`: it has not).
    pub outcome: Option<Outcome>,
    /// Both runs succeeded with the same final answer.
    pub same_answer: bool,
    pub recorded_answer: Option<String>,
    pub new_answer: Option<String>,
    /// Where the new version first proposed a call the recorded run never made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diverged: Option<Divergence>,
    /// Why the test ended otherwise than it should (a budget, an error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub recorded: Spending,
    pub new: Spending,
}

/// The first call of the new version no recorded call answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Divergence {
    /// The test's record that proposed it.
    pub seq: u64,
    /// Its position among the run's calls, from 1.
    pub call: usize,
    pub new: Call,
    /// The recorded run's call at that position, if it made one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Call>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Call {
    pub tool: String,
    pub arguments: Value,
}

/// What a run spent and how many of its calls its policy gated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spending {
    pub tokens: u64,
    #[serde(rename = "costUSD")]
    pub cost_usd: f64,
    /// Calls a human was (recorded) or would have been (new) asked about.
    pub gated_calls: usize,
}

impl RunReport {
    pub fn diverged(&self) -> bool {
        self.diverged.is_some() || self.outcome == Some(Outcome::Diverged)
    }
}

/// The report of test `test` of recorded run `run`.
pub fn report(run: &str, test: &str, recorded: &[Entry], tested: &[Entry]) -> RunReport {
    let recorded_end = finished(recorded);
    let tested_end = finished(tested);
    let answer_of = |end: Option<&RunFinished>| {
        end.filter(|f| f.outcome == Outcome::Succeeded)
            .and_then(|f| f.result.clone())
    };
    let (recorded_answer, new_answer) = (answer_of(recorded_end), answer_of(tested_end));
    let same_answer = recorded_answer.is_some()
        && recorded_answer.as_deref().map(str::trim) == new_answer.as_deref().map(str::trim);
    let state = RunState::replay(tested.to_vec());
    let diverged = tested_end
        .filter(|f| f.outcome == Outcome::Diverged)
        .and_then(|_| divergence(&state));
    let error = tested_end
        .filter(|f| !matches!(f.outcome, Outcome::Succeeded | Outcome::Diverged))
        .and_then(|f| f.error.clone());
    RunReport {
        run: run.to_string(),
        test: test.to_string(),
        outcome: tested_end.map(|f| f.outcome),
        same_answer,
        recorded_answer,
        new_answer,
        diverged,
        error,
        recorded: spending(recorded, recorded_gated(recorded)),
        new: spending(after_fork(tested), new_gated(tested)),
    }
}

fn finished(log: &[Entry]) -> Option<&RunFinished> {
    log.iter().rev().find_map(|e| match e {
        Entry::RunFinished(f) => Some(f),
        _ => None,
    })
}

/// The test's own records (the copied task before `Forked` spent nothing
/// of the test's).
fn after_fork(log: &[Entry]) -> &[Entry] {
    let at = log
        .iter()
        .position(|e| matches!(e, Entry::Forked(_)))
        .map_or(0, |i| i + 1);
    &log[at..]
}

fn spending(log: &[Entry], gated_calls: usize) -> Spending {
    let mut s = Spending {
        gated_calls,
        ..Spending::default()
    };
    for e in log {
        let (usage, cost) = match e {
            Entry::ModelCall(m) => (&m.response.usage, m.cost_usd),
            Entry::Summary(m) => (&m.response.usage, m.cost_usd),
            _ => continue,
        };
        s.tokens += usage.input_tokens + usage.output_tokens;
        s.cost_usd += cost;
    }
    s
}

/// Calls the recorded run asked a human about (each once, however often asked).
fn recorded_gated(log: &[Entry]) -> usize {
    let mut calls: Vec<(u64, usize)> = log
        .iter()
        .filter_map(|e| match e {
            Entry::ApprovalRequested(r) if r.kind == ApprovalKind::Call => {
                Some((r.model_call_seq, r.call_index))
            }
            _ => None,
        })
        .collect();
    calls.sort_unstable();
    calls.dedup();
    calls.len()
}

/// Calls of the test the tested version's policy would have gated.
fn new_gated(log: &[Entry]) -> usize {
    log.iter()
        .filter(|e| matches!(e, Entry::ToolIntent(i) if i.sandboxed.is_some_and(|s| s.gated)))
        .count()
}

/// The first proposal of the test no recorded call answered.
fn divergence(state: &RunState) -> Option<Divergence> {
    let sandbox = state.sandbox()?;
    let answered: Vec<(u64, usize)> = state
        .records()
        .filter_map(|(_, e)| match e {
            Entry::ToolIntent(i) => Some((i.model_call_seq, i.call_index)),
            _ => None,
        })
        .collect();
    for (seq, e) in state.records() {
        let Entry::ModelCall(m) = e else { continue };
        for (index, call) in m.response.tool_calls.iter().enumerate() {
            if call.name == crate::tools::FINISH_TOOL || answered.contains(&(seq, index)) {
                continue;
            }
            let Some(Answer::Diverged { position, instead }) = answer(state, sandbox, seq, index)
            else {
                continue;
            };
            return Some(Divergence {
                seq,
                call: position + 1,
                new: Call {
                    tool: call.name.clone(),
                    arguments: call.arguments.clone(),
                },
                recorded: instead.map(|c| Call {
                    tool: c.tool.clone(),
                    arguments: c.arguments.clone(),
                }),
            });
        }
    }
    None
}
