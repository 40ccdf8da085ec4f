//! What every dialect reads the same way from a recorded answer: why it
//! ended, and a tool call's arguments as text.

use serde_json::Value;

use crate::model::ModelResponse;

/// Why the answer ended, in the terms every dialect has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// It calls tools.
    ToolCalls,
    /// It ran into the output token bound.
    Limit,
    /// It is complete.
    Done,
}

/// The recorded stop reason (OpenAI's `finish_reason` or Anthropic's
/// `stop_reason`, verbatim) and the calls say it. A cut-off answer is said
/// to be cut off even when it holds calls: those may be cut off too.
pub(crate) fn finish(answer: &ModelResponse) -> Finish {
    let limit = matches!(
        answer.stop_reason.as_deref(),
        Some("length" | "max_tokens" | "max_output_tokens")
    );
    if limit {
        Finish::Limit
    } else if answer.tool_calls.is_empty() {
        Finish::Done
    } else {
        Finish::ToolCalls
    }
}

/// The answer's text, `None` when empty.
pub(crate) fn text(answer: &ModelResponse) -> Option<&str> {
    answer.text.as_deref().filter(|t| !t.is_empty())
}

/// Arguments as the JSON text OpenAI's formats carry: an object as JSON,
/// raw arguments (a model's malformed reply) exactly as the model wrote them.
pub(crate) fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    }
}
