//! Building what the model sees: system prompt + task + latest summary +
//! recent steps. The full log is always kept; only the context is compacted.

use super::records::{ContextInfo, Summary};
use super::replay::{RunState, Snapshot, Step};
use crate::model::{Message, ModelRequest, estimate_tokens};
use crate::tools::ToolOutcome;

/// Steps sent verbatim after a summary when the Agent does not say.
pub const DEFAULT_RECENT_STEPS: u32 = 12;

/// What the context needs next.
#[derive(Clone, Debug, PartialEq)]
pub enum ContextPlan {
    /// Send this request.
    Call(ModelRequest, ContextInfo),
    /// The context would pass its budget: summarize records up to `through_seq` first.
    Compact {
        request: ModelRequest,
        through_seq: u64,
    },
}

/// Builds the next model request, or the summarization request that must come first.
pub fn plan(state: &RunState, snap: &Snapshot) -> ContextPlan {
    let (request, info) = request_for_step(state, snap);
    let settings = snap.agent.context.clone().unwrap_or_default();
    if let Some(max) = settings.max_tokens
        && info.estimated_tokens > max
        && let Some(through_seq) =
            compaction_boundary(state, settings.recent_steps.unwrap_or(DEFAULT_RECENT_STEPS))
    {
        return ContextPlan::Compact {
            request: summarization_request(state, snap, through_seq),
            through_seq,
        };
    }
    ContextPlan::Call(request, info)
}

/// The request of an ordinary step: everything after the latest summary.
pub fn request_for_step(state: &RunState, snap: &Snapshot) -> (ModelRequest, ContextInfo) {
    let mut messages = vec![Message::User {
        text: snap.input.clone(),
    }];
    let mut from_seq = 0;
    let mut summary_seq = None;
    if let Some((seq, summary)) = &state.summary {
        messages.push(summary_message(summary));
        from_seq = summary.through_seq + 1;
        summary_seq = Some(*seq);
    }
    push_records(&mut messages, state, from_seq, u64::MAX);
    let request = ModelRequest {
        system: snap.agent.prompt.system.clone(),
        messages,
        tools: snap.tools.clone(),
        max_output_tokens: snap.agent.model.max_output_tokens,
    };
    let info = ContextInfo {
        summary_seq,
        from_seq,
        estimated_tokens: estimate_tokens(&request),
    };
    (request, info)
}

/// Where to cut: just before the ModelCall that starts the most recent
/// `recent` records, so a call and its results always stay together.
/// `None` when there is nothing older than the recent steps to compact.
pub fn compaction_boundary(state: &RunState, recent: u32) -> Option<u64> {
    let after = state.summary.as_ref().map_or(0, |(_, s)| s.through_seq + 1);
    let len = state.len();
    let keep_from = len.saturating_sub(recent as u64);
    // The first ModelCall at or after keep_from starts the kept part.
    let cut =
        (keep_from..len).find(|&seq| matches!(state.steps[seq as usize], Step::ModelCall(_)))?;
    // Compacting only pays if something between the last summary and the cut is a step.
    let through = cut.checked_sub(1)?;
    (through > after).then_some(through)
}

/// The request that asks the model to summarize records up to `through_seq`.
pub fn summarization_request(state: &RunState, snap: &Snapshot, through_seq: u64) -> ModelRequest {
    let mut messages = vec![Message::User {
        text: snap.input.clone(),
    }];
    let mut from = 0;
    if let Some((_, summary)) = &state.summary {
        messages.push(summary_message(summary));
        from = summary.through_seq + 1;
    }
    push_records(&mut messages, state, from, through_seq);
    messages.push(Message::User {
        text: "Summarize the work so far for your own later use: the facts learned, every action \
               taken with its result (keep ids and amounts exact), and what remains to do. \
               Reply with the summary only."
            .into(),
    });
    ModelRequest {
        system: format!(
            "{}\n\nYou are now compacting your own history; do not call tools.",
            snap.agent.prompt.system
        ),
        messages,
        tools: Vec::new(),
        max_output_tokens: snap.agent.model.max_output_tokens,
    }
}

fn summary_message(summary: &Summary) -> Message {
    Message::User {
        text: format!(
            "Summary of the run so far (log records 0 to {}):\n{}",
            summary.through_seq, summary.text
        ),
    }
}

/// Appends the messages of records `from..=through`.
fn push_records(messages: &mut Vec<Message>, state: &RunState, from: u64, through: u64) {
    for (seq, step) in state.steps.iter().enumerate() {
        let seq = seq as u64;
        if seq < from || seq > through {
            continue;
        }
        match step {
            Step::ModelCall(m) => messages.push(Message::Assistant {
                text: m.response.text.clone(),
                tool_calls: m.response.tool_calls.clone(),
            }),
            Step::ToolResult(r) => {
                let (content, is_error) = outcome_for_model(&r.outcome);
                messages.push(Message::ToolResult {
                    call_id: r.call_id.clone(),
                    name: r.tool.clone(),
                    content,
                    is_error,
                });
            }
            Step::Observation(o) => messages.push(Message::User {
                text: o.text.clone(),
            }),
            _ => {}
        }
    }
}

/// A tool outcome as the model reads it.
fn outcome_for_model(outcome: &ToolOutcome) -> (String, bool) {
    match outcome {
        ToolOutcome::Ok(value) => (value.to_string(), false),
        ToolOutcome::Failed { observation } => (observation.clone(), true),
    }
}
