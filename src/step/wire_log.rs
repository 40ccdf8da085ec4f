//! What a container agent's log recorded at the wire, as a new step pod
//! reads it: the requests the matcher replays, the last model request (the
//! base of the next one's delta), and any recorded request restored for a
//! divergence report.
//!
//! Model requests are recorded as deltas, so they are restored by folding
//! the log's `ModelCall`s in order, each digest checked: a log whose deltas
//! do not restore is refused, never matched. Only the last request is kept
//! (a long run's requests together are quadratic in its length); one
//! restored for a report is folded again from the start.

use crate::replay::Entry;
use crate::wire::canonical::{Canonical, RecordedRequest, RestoreError, restore, tool_digest};
use crate::wire::matcher::{Kind, Recorded};

/// Why a log's wire records cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("seq {seq}: the recorded model request does not restore: {source}")]
pub struct WireLogError {
    pub seq: u64,
    #[source]
    pub source: RestoreError,
}

/// The wire records of a log.
#[derive(Debug, Default)]
pub struct WireLog {
    /// Every recorded request, in log order.
    pub recorded: Vec<Recorded>,
    /// The last recorded model request, restored.
    pub last: Option<Canonical>,
}

/// A model call's recorded request, if it holds one.
fn model_request(entry: &Entry) -> Option<RecordedRequest> {
    match entry {
        Entry::ModelCall(c) => c.request.clone().map(Into::into),
        _ => None,
    }
}

impl WireLog {
    /// Reads `records` (seq and entry, in log order), restoring every model
    /// request on the way.
    pub fn read<'a>(
        records: impl IntoIterator<Item = (u64, &'a Entry)>,
    ) -> Result<WireLog, WireLogError> {
        let mut log = WireLog::default();
        for (seq, entry) in records {
            if let Some(request) = model_request(entry) {
                let restored = restore(&request, log.last.as_ref())
                    .map_err(|source| WireLogError { seq, source })?;
                log.recorded.push(Recorded {
                    seq,
                    kind: Kind::Model,
                    digest: request.digest,
                });
                log.last = Some(restored);
            } else if let Entry::ToolIntent(intent) = entry {
                let digest = intent
                    .requested
                    .clone()
                    .unwrap_or_else(|| tool_digest(&intent.tool, &intent.arguments));
                log.recorded.push(Recorded {
                    seq,
                    kind: Kind::Tool,
                    digest,
                });
            }
        }
        Ok(log)
    }

    /// The model request recorded at `seq`, restored (for saying where a
    /// new request differs from it).
    pub fn request_at<'a>(
        records: impl IntoIterator<Item = (u64, &'a Entry)>,
        seq: u64,
    ) -> Result<Option<Canonical>, WireLogError> {
        let mut last: Option<Canonical> = None;
        for (at, entry) in records {
            if at > seq {
                break;
            }
            if let Some(request) = model_request(entry) {
                let restored = restore(&request, last.as_ref())
                    .map_err(|source| WireLogError { seq: at, source })?;
                if at == seq {
                    return Ok(Some(restored));
                }
                last = Some(restored);
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runlog::records::{ContextInfo, ModelCall, ToolIntent};
    use crate::runlog::v1;
    use crate::wire::Dialect;
    use crate::wire::canonical::{first_difference, record};
    use crate::wire::matcher::{Decision, Matcher, Matching};
    use serde_json::{Value, json};

    fn chat(turns: usize) -> Canonical {
        let messages: Vec<Value> = (0..turns)
            .map(|i| json!({"role": "user", "content": format!("turn {i}")}))
            .collect();
        Canonical::of(
            Dialect::ChatCompletions,
            json!({"model": "m", "messages": messages}),
        )
        .unwrap()
    }

    fn call(request: RecordedRequest) -> Entry {
        Entry::ModelCall(ModelCall {
            request: Some(request.into()),
            response: v1::ModelResponse {
                text: Some("ok".into()),
                tool_calls: vec![],
                usage: v1::TokenUsage::default(),
                model_id: "m".into(),
                stop_reason: None,
            },
            cost_usd: 0.0,
            context: ContextInfo::default(),
            attempts: None,
        })
    }

    fn intent(tool: &str, arguments: Value, requested: Option<String>) -> Entry {
        Entry::ToolIntent(ToolIntent {
            model_call_seq: 0,
            call_index: 0,
            call_id: "c".into(),
            tool: tool.into(),
            arguments,
            key: "k".into(),
            requested,
            sandboxed: None,
        })
    }

    /// A log of three growing requests and two calls (one edited by an
    /// approver): read, it replays the same requests in full, and the
    /// edited call matches what the agent asked, not what was made.
    #[test]
    fn a_logs_wire_records_replay_the_requests_the_agent_sends_again() {
        let (r1, r2, r3) = (chat(1), chat(2), chat(3));
        let asked = json!({"order": "A-1", "amount": 500});
        let edited = json!({"order": "A-1", "amount": 300});
        let entries = [
            call(record(&r1, None)),
            intent("lookup", json!({"order": "A-1"}), None),
            call(record(&r2, Some(&r1))),
            intent("refund", edited, Some(tool_digest("refund", &asked))),
            call(record(&r3, Some(&r2))),
        ];
        let records = || entries.iter().enumerate().map(|(i, e)| (i as u64 + 1, e));
        let log = WireLog::read(records()).unwrap();
        assert_eq!(log.last.as_ref(), Some(&r3));
        let mut m = Matcher::new(log.recorded, Matching::Exact);
        assert_eq!(m.model(&r1.digest()), Decision::Replay { seq: 1 });
        assert_eq!(
            m.tool(&tool_digest("lookup", &json!({"order": "A-1"}))),
            Decision::Replay { seq: 2 }
        );
        assert_eq!(m.model(&r2.digest()), Decision::Replay { seq: 3 });
        assert_eq!(
            m.tool(&tool_digest("refund", &asked)),
            Decision::Replay { seq: 4 }
        );
        assert_eq!(m.model(&r3.digest()), Decision::Replay { seq: 5 });
        assert_eq!(m.model(&chat(4).digest()), Decision::Live);
        // A divergence report restores the request it replaced.
        let replaced = WireLog::request_at(records(), 3).unwrap().unwrap();
        let mut new = r2.clone();
        new.body["messages"][1]["content"] = json!("turn one, at 10:05");
        assert_eq!(
            first_difference(&replaced, &new).unwrap().path,
            "messages[1].content"
        );
    }

    #[test]
    fn a_delta_that_does_not_restore_is_refused_naming_its_seq() {
        let (r1, r2) = (chat(1), chat(2));
        let mut broken = record(&r2, Some(&r1));
        broken.kept = 5;
        let entries = [call(record(&r1, None)), call(broken)];
        let e = WireLog::read(entries.iter().enumerate().map(|(i, e)| (i as u64, e))).unwrap_err();
        assert_eq!(e.seq, 1);
        assert!(e.to_string().contains("keeps 5 items"), "{e}");
    }
}
