//! What of an agent's model request identifies it, how it is recorded, and
//! where two requests first differ.
//!
//! A request is identified by its dialect and its body as the agent sent
//! it, less how it is delivered (`stream`, `stream_options`): the same
//! question asked streaming or not gets the same recorded answer. Its
//! digest is sha256 over the canonical JSON (RFC 8785) of both, so key
//! order and number spelling do not matter and everything else does.
//!
//! Recorded, a request is a delta against the run's previous one: a
//! framework sends the whole conversation every time, so recording each
//! body whole would grow a run's log with the square of its length. Keys
//! whose value did not change are named, not repeated; of the conversation
//! only the items past those kept from the previous request are stored.
//! Restoring folds the deltas in log order and checks each digest, so a
//! record restored wrong is caught rather than matched.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::Dialect;

/// Fields of a request that say how the answer is delivered, not what is asked.
const DELIVERY: &[&str] = &["stream", "stream_options"];

/// A model request as the runner identifies it.
#[derive(Clone, Debug, PartialEq)]
pub struct Canonical {
    pub dialect: Dialect,
    /// The body less its delivery fields.
    pub body: Map<String, Value>,
}

impl Canonical {
    /// The request `body` came in as, in `dialect` (taken, not copied: a
    /// long conversation is the larger part of a request's cost); `None`
    /// when the body is not a JSON object.
    pub fn of(dialect: Dialect, body: Value) -> Option<Canonical> {
        let Value::Object(mut body) = body else {
            return None;
        };
        for key in DELIVERY {
            body.remove(*key);
        }
        Some(Canonical { dialect, body })
    }

    /// sha256 (hex) of the dialect and the body in canonical JSON.
    ///
    /// The bytes are those of `{"body": …, "dialect": …}` in canonical
    /// JSON (its keys in that order), hashed as they are written rather than
    /// built as one value: a long conversation is not copied to be hashed.
    pub fn digest(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(b"{\"body\":");
        crate::jcs::write_object(&self.body, &mut hash).expect("hashing cannot fail");
        hash.update(b",\"dialect\":");
        hash.update(canonical_json(&self.dialect));
        hash.update(b"}");
        hex::encode(hash.finalize())
    }

    fn conversation(&self) -> &[Value] {
        self.body
            .get(self.dialect.conversation_key())
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }
}

fn canonical_json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json_canonicalizer::to_vec(value).expect("JSON values are always canonicalizable")
}

/// The digest of a tool call: the Agent's tool name and the arguments, in
/// canonical JSON (what `ToolIntent` records, so the log needs no more).
pub fn tool_digest(tool: &str, arguments: &Value) -> String {
    let whole = serde_json::json!({"tool": tool, "arguments": arguments});
    let bytes = serde_json_canonicalizer::to_vec(&whole)
        .expect("a serde_json::Value is always canonicalizable");
    hex::encode(Sha256::digest(bytes))
}

/// A request as the log holds it: a delta against the run's previous
/// recorded request (see the module's comment).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedRequest {
    pub dialect: Dialect,
    /// [`Canonical::digest`] of the whole request.
    pub digest: String,
    /// Keys whose value is the previous request's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub same: Vec<String>,
    /// Items of the conversation that are the previous request's first ones.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept: usize,
    /// Every other key; of the conversation, the items past `kept`.
    pub body: Map<String, Value>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Why a recorded request cannot be restored.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RestoreError {
    #[error("it refers to a previous request, and there is none of its dialect")]
    NoPrevious,
    #[error("it keeps {kept} items of a previous conversation of {had}")]
    KeptTooMany { kept: usize, had: usize },
    #[error("restored, its digest is {restored}, not the recorded {recorded}")]
    Digest { recorded: String, restored: String },
}

/// How `request` is recorded after `previous` (the run's previous recorded
/// request, restored).
pub fn record(request: &Canonical, previous: Option<&Canonical>) -> RecordedRequest {
    record_digested(request, request.digest(), previous)
}

/// [`record`], with the request's digest already taken.
pub fn record_digested(
    request: &Canonical,
    digest: String,
    previous: Option<&Canonical>,
) -> RecordedRequest {
    let Some(previous) = previous.filter(|p| p.dialect == request.dialect) else {
        return RecordedRequest {
            dialect: request.dialect,
            digest,
            same: Vec::new(),
            kept: 0,
            body: request.body.clone(),
        };
    };
    let key = request.dialect.conversation_key();
    let mut same = Vec::new();
    let mut body = Map::new();
    for (k, v) in &request.body {
        if k != key && previous.body.get(k) == Some(v) {
            same.push(k.clone());
        } else {
            body.insert(k.clone(), v.clone());
        }
    }
    let kept = common_prefix(previous.conversation(), request.conversation());
    if let Some(Value::Array(items)) = body.get_mut(key) {
        items.drain(..kept);
    }
    RecordedRequest {
        dialect: request.dialect,
        digest,
        same,
        kept,
        body,
    }
}

/// The request `recorded` holds, given the run's previous recorded request
/// (restored); its digest checked.
pub fn restore(
    recorded: &RecordedRequest,
    previous: Option<&Canonical>,
) -> Result<Canonical, RestoreError> {
    let mut body = recorded.body.clone();
    let key = recorded.dialect.conversation_key();
    if !recorded.same.is_empty() || recorded.kept > 0 {
        let previous = previous
            .filter(|p| p.dialect == recorded.dialect)
            .ok_or(RestoreError::NoPrevious)?;
        for k in &recorded.same {
            if let Some(v) = previous.body.get(k) {
                body.insert(k.clone(), v.clone());
            }
        }
        let had = previous.conversation();
        if recorded.kept > had.len() {
            return Err(RestoreError::KeptTooMany {
                kept: recorded.kept,
                had: had.len(),
            });
        }
        let mut items = had[..recorded.kept].to_vec();
        if let Some(Value::Array(added)) = body.remove(key) {
            items.extend(added);
        }
        body.insert(key.to_string(), Value::Array(items));
    }
    let restored = Canonical {
        dialect: recorded.dialect,
        body,
    };
    let digest = restored.digest();
    if digest != recorded.digest {
        return Err(RestoreError::Digest {
            recorded: recorded.digest.clone(),
            restored: digest,
        });
    }
    Ok(restored)
}

fn common_prefix(a: &[Value], b: &[Value]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Where two requests first differ: the JSON path, and what each holds
/// there (cut short).
#[derive(Clone, Debug, PartialEq)]
pub struct Difference {
    /// `messages[0].content`, `tools`, or `dialect`.
    pub path: String,
    pub recorded: String,
    pub new: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: recorded {}, now {}",
            self.path, self.recorded, self.new
        )
    }
}

/// How much of a differing value a [`Difference`] quotes.
const QUOTED: usize = 160;

/// The first place (keys in sorted order, items by index) where `new`
/// differs from `recorded`; `None` when they are the same request.
pub fn first_difference(recorded: &Canonical, new: &Canonical) -> Option<Difference> {
    if recorded.dialect != new.dialect {
        return Some(Difference {
            path: "dialect".into(),
            recorded: format!("{:?}", recorded.dialect),
            new: format!("{:?}", new.dialect),
        });
    }
    let (a, b) = (
        Value::Object(recorded.body.clone()),
        Value::Object(new.body.clone()),
    );
    differ(&a, &b, String::new())
}

fn differ(a: &Value, b: &Value, path: String) -> Option<Difference> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let at = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                presence(x.get(k), y.get(k), &at).or_else(|| {
                    differ(
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        at,
                    )
                })
            })
        }
        (Value::Array(x), Value::Array(y)) => (0..x.len().max(y.len())).find_map(|i| {
            let at = format!("{path}[{i}]");
            match (x.get(i), y.get(i)) {
                (Some(p), Some(q)) => differ(p, q, at),
                (p, q) => Some(Difference {
                    path: at,
                    recorded: quote(p),
                    new: quote(q),
                }),
            }
        }),
        _ if a == b => None,
        _ => Some(Difference {
            path: if path.is_empty() { "body".into() } else { path },
            recorded: quote(Some(a)),
            new: quote(Some(b)),
        }),
    }
}

/// A key present on one side only.
fn presence(a: Option<&Value>, b: Option<&Value>, path: &str) -> Option<Difference> {
    (a.is_some() != b.is_some()).then(|| Difference {
        path: path.to_string(),
        recorded: quote(a),
        new: quote(b),
    })
}

fn quote(v: Option<&Value>) -> String {
    match v {
        None => "nothing".into(),
        Some(v) => crate::text::excerpt(&v.to_string(), QUOTED),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(messages: Value) -> Canonical {
        Canonical::of(Dialect::ChatCompletions, json!({"model": "m", "messages": messages, "tools": [{"type": "function", "function": {"name": "lookup"}}], "stream": true}),
        )
        .unwrap()
    }

    fn conversation(n: usize) -> Value {
        Value::Array(
            (0..n)
                .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("turn {i}")}))
                .collect(),
        )
    }

    #[test]
    fn a_tool_calls_digest_is_its_tool_and_arguments_whatever_their_key_order() {
        let a = tool_digest("refund", &json!({"order": "A-1", "amount": 300}));
        let b: Value = serde_json::from_str(r#"{"amount": 300, "order": "A-1"}"#).unwrap();
        assert_eq!(a, tool_digest("refund", &b));
        assert_ne!(
            a,
            tool_digest("refund", &json!({"order": "A-1", "amount": 500}))
        );
        assert_ne!(a, tool_digest("lookup", &b));
    }

    #[test]
    fn delivery_does_not_change_what_is_asked() {
        let streamed = chat(conversation(1));
        let mut plain = streamed.clone();
        plain.body.insert("stream".into(), json!(false));
        let plain = Canonical::of(Dialect::ChatCompletions, Value::Object(plain.body)).unwrap();
        assert_eq!(streamed.digest(), plain.digest());
        let responses = Canonical::of(Dialect::Responses, Value::Object(streamed.body.clone()));
        assert_ne!(
            streamed.digest(),
            responses.unwrap().digest(),
            "the dialect counts"
        );
    }

    /// The digest hashes the canonical JSON of `{"dialect", "body"}` as one
    /// value: the digests recorded in logs stay what they were.
    #[test]
    fn the_digest_is_the_canonical_json_of_dialect_and_body_as_one_value() {
        let request = chat(conversation(5));
        let whole = json!({"dialect": request.dialect, "body": request.body});
        let bytes = serde_json_canonicalizer::to_vec(&whole).unwrap();
        assert_eq!(request.digest(), hex::encode(Sha256::digest(bytes)));
    }

    #[test]
    fn key_order_and_number_spelling_do_not_change_the_digest() {
        let a = Canonical::of(Dialect::Messages, json!({"a": 1, "b": 1.0})).unwrap();
        let b: Value = serde_json::from_str(r#"{"b": 1.0, "a": 1}"#).unwrap();
        assert_eq!(
            a.digest(),
            Canonical::of(Dialect::Messages, b).unwrap().digest()
        );
    }

    /// A conversation of growing requests, recorded one after the other,
    /// restores request by request, and stores each turn's new items only.
    #[test]
    fn a_growing_conversation_is_recorded_as_deltas_and_restores_at_every_prefix() {
        let requests: Vec<Canonical> = (1..=9).map(|n| chat(conversation(n))).collect();
        let mut previous: Option<&Canonical> = None;
        let mut recorded = Vec::new();
        for r in &requests {
            let rec = record(r, previous);
            recorded.push(rec);
            previous = Some(r);
        }
        let last = recorded.last().unwrap();
        assert_eq!(last.kept, 8);
        assert_eq!(last.same, ["model", "tools"]);
        assert_eq!(last.body["messages"].as_array().unwrap().len(), 1);
        // Restored in log order from the records alone.
        let mut restored: Option<Canonical> = None;
        for (rec, want) in recorded.iter().zip(&requests) {
            let r = restore(rec, restored.as_ref()).unwrap();
            assert_eq!(&r, want);
            restored = Some(r);
        }
    }

    #[test]
    fn a_conversation_that_starts_over_is_recorded_whole() {
        let first = chat(conversation(4));
        let other = chat(json!([{"role": "user", "content": "another task"}]));
        let rec = record(&other, Some(&first));
        assert_eq!(rec.kept, 0);
        assert_eq!(restore(&rec, Some(&first)).unwrap(), other);
        // Another dialect shares nothing.
        let anthropic = Canonical::of(Dialect::Messages, json!({"messages": []})).unwrap();
        let rec = record(&anthropic, Some(&first));
        assert!(rec.same.is_empty() && rec.kept == 0);
        assert_eq!(restore(&rec, None).unwrap(), anthropic);
    }

    #[test]
    fn a_delta_restored_on_the_wrong_previous_request_is_caught() {
        let a = chat(conversation(2));
        let b = chat(conversation(3));
        let rec = record(&b, Some(&a));
        assert_eq!(restore(&rec, None), Err(RestoreError::NoPrevious));
        let short = chat(conversation(1));
        assert_eq!(
            restore(&rec, Some(&short)),
            Err(RestoreError::KeptTooMany { kept: 2, had: 1 })
        );
        let other =
            chat(json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]));
        assert!(matches!(
            restore(&rec, Some(&other)),
            Err(RestoreError::Digest { .. })
        ));
    }

    #[test]
    fn the_first_difference_names_the_field_and_quotes_both_sides() {
        let recorded = chat(
            json!([{"role": "system", "content": "It is 10:00."}, {"role": "user", "content": "refund"}]),
        );
        let new = chat(
            json!([{"role": "system", "content": "It is 10:05."}, {"role": "user", "content": "refund"}]),
        );
        let d = first_difference(&recorded, &new).unwrap();
        assert_eq!(d.path, "messages[0].content");
        assert_eq!(d.recorded, "\"It is 10:00.\"");
        assert_eq!(d.new, "\"It is 10:05.\"");
        assert_eq!(first_difference(&recorded, &recorded), None);
        // A message more, a key less.
        let longer = chat(
            json!([{"role": "system", "content": "It is 10:00."}, {"role": "user", "content": "refund"}, {"role": "user", "content": "now"}]),
        );
        assert_eq!(
            first_difference(&recorded, &longer).unwrap().path,
            "messages[2]"
        );
        let mut fewer = recorded.clone();
        fewer.body.remove("tools");
        let d = first_difference(&recorded, &fewer).unwrap();
        assert_eq!((d.path.as_str(), d.new.as_str()), ("tools", "nothing"));
    }
}
