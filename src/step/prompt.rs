//! Building what the model sees: system prompt + task + latest summary +
//! recent steps. The full log is always kept; only the context is compacted.

use crate::model::{Message, ModelRequest, estimate_tokens};
use crate::replay::{Entry, RunState, Snapshot};
use crate::runlog::records::{ContextInfo, Summary, Verdict, not_run_note};
use crate::runlog::v1::{self, ToolOutcome};

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
        system: system_prompt(snap).to_string(),
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
        (keep_from..len).find(|&seq| matches!(state.entry(seq), Some(Entry::ModelCall(_))))?;
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
            system_prompt(snap)
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
    for (seq, step) in state.records_from(from) {
        if seq > through {
            break;
        }
        match step {
            Entry::ModelCall(m) => {
                // The model sees each call as it ran: edited arguments, not the proposal.
                let mut tool_calls: Vec<crate::model::ToolCall> = m
                    .response
                    .tool_calls
                    .iter()
                    .cloned()
                    .map(Into::into)
                    .collect();
                for (index, call) in tool_calls.iter_mut().enumerate() {
                    if let Some(args) = executed_arguments(state, seq, index) {
                        call.arguments = args;
                    }
                }
                messages.push(Message::Assistant {
                    text: m.response.text.clone(),
                    tool_calls,
                });
            }
            Entry::ToolResult(r) => {
                let (mut content, is_error) = outcome_for_model(&r.outcome);
                if let Some(note) = edit_note(state, r.intent_seq) {
                    content = format!("{note}\nResult: {content}");
                }
                messages.push(Message::ToolResult {
                    call_id: r.call_id.clone(),
                    name: r.tool.clone(),
                    content,
                    is_error,
                });
            }
            // A call that never ran still gets its answer: why it did not.
            Entry::ApprovalDecided(d) if d.settles_without_running() => {
                if let Some(Entry::ApprovalRequested(r)) = state.entry(d.request_seq) {
                    messages.push(Message::ToolResult {
                        call_id: r.call_id.clone(),
                        name: r.tool.clone(),
                        content: not_run_note(r, d),
                        is_error: true,
                    });
                }
            }
            Entry::Observation(o) => messages.push(Message::User {
                text: o.text.clone(),
            }),
            _ => {}
        }
    }
}

/// The arguments call `index` of the ModelCall at `model_call_seq` ran with.
fn executed_arguments(
    state: &RunState,
    model_call_seq: u64,
    index: usize,
) -> Option<serde_json::Value> {
    state
        .records_from(model_call_seq + 1)
        .find_map(|(_, s)| match s {
            Entry::ToolIntent(i) if i.model_call_seq == model_call_seq && i.call_index == index => {
                Some(i.arguments.clone())
            }
            _ => None,
        })
}

/// "bob changed amount from 500 to 300: partial refund", for an edited call.
pub(super) fn edit_note(state: &RunState, intent_seq: u64) -> Option<String> {
    let Some(Entry::ToolIntent(intent)) = state.entry(intent_seq) else {
        return None;
    };
    // A fork that decided the call again (its own request after its
    // `Forked`): an edit copied from the parent is not what it ran with.
    let from = state.authority_from(intent_seq);
    let asked_again = from > 0
        && state
            .records_from(from)
            .take_while(|(seq, _)| *seq < intent_seq)
            .any(|(_, s)| {
                matches!(s, Entry::ApprovalRequested(r)
                    if r.kind == v1::ApprovalKind::Call
                        && r.model_call_seq == intent.model_call_seq
                        && r.call_index == intent.call_index)
            });
    let (request, decided) = state
        .records()
        .take_while(|(seq, _)| *seq < intent_seq)
        .filter(|(seq, _)| !asked_again || *seq >= from)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .find_map(|(_, s)| match s {
            Entry::ApprovalDecided(d) if d.verdict == Verdict::Edit => {
                match state.entry(d.request_seq) {
                    Some(Entry::ApprovalRequested(r))
                        if r.model_call_seq == intent.model_call_seq
                            && r.call_index == intent.call_index =>
                    {
                        Some((r, d))
                    }
                    _ => None,
                }
            }
            _ => None,
        })?;
    let editor = decided
        .decisions
        .iter()
        .find(|d| d.verdict == v1::Verdict::Edit)?;
    let mut changes = Vec::new();
    if let (Some(old), Some(new)) = (request.arguments.as_object(), intent.arguments.as_object()) {
        for (k, v) in new {
            match old.get(k) {
                Some(o) if o == v => {}
                Some(o) => changes.push(format!("{k} from {o} to {v}")),
                None => changes.push(format!("{k} to {v}")),
            }
        }
        for k in old.keys().filter(|k| !new.contains_key(*k)) {
            changes.push(format!("removed {k}"));
        }
    }
    let what = if changes.is_empty() {
        "nothing".to_string()
    } else {
        changes.join(", ")
    };
    let why = editor
        .reason
        .as_deref()
        .map(|r| format!(": {r}"))
        .unwrap_or_default();
    Some(format!("{} changed {what}{why}", editor.approver))
}

/// A tool outcome as the model reads it.
fn outcome_for_model(outcome: &ToolOutcome) -> (String, bool) {
    match outcome {
        ToolOutcome::Ok(value) => (value.to_string(), false),
        ToolOutcome::Failed { observation } => (observation.clone(), true),
    }
}

/// The built-in loop's system prompt (a container agent has none here).
fn system_prompt(snap: &Snapshot) -> &str {
    snap.agent.prompt.as_ref().map_or("", |p| p.system.as_str())
}
