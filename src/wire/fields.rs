//! Reading an agent's request body: typed access that names the JSON path
//! of whatever is wrong, and the rules every dialect shares (which keys are
//! carried, dropped or refused; how a tool result finds its tool's name).

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::BadRequest;
use crate::model::{Message, ToolCall};

/// `path.key`, or `key` at the top of the body.
pub(crate) fn at(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// `path[i]`.
pub(crate) fn index(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

/// `v` as an object.
pub(crate) fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, BadRequest> {
    v.as_object()
        .ok_or_else(|| BadRequest::new(body_path(path), "must be an object"))
}

fn body_path(path: &str) -> &str {
    if path.is_empty() { "body" } else { path }
}

/// A key that is absent or `null` counts as not given, as the APIs treat it.
pub(crate) fn get<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

/// A required string.
pub(crate) fn string<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a str, BadRequest> {
    opt_string(o, key, path)?
        .ok_or_else(|| BadRequest::new(at(path, key), "is required (a string)"))
}

/// An optional string.
pub(crate) fn opt_string<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a str>, BadRequest> {
    match get(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(BadRequest::new(at(path, key), "must be a string")),
    }
}

/// An optional list (`[]` when not given).
pub(crate) fn list<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a [Value], BadRequest> {
    match get(o, key) {
        None => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(BadRequest::new(at(path, key), "must be a list")),
    }
}

/// An optional boolean.
pub(crate) fn flag(o: &Map<String, Value>, key: &str, path: &str) -> Result<bool, BadRequest> {
    match get(o, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(BadRequest::new(at(path, key), "must be true or false")),
    }
}

/// The body's `stream` flag (anything but `true` is a plain request).
pub(crate) fn streams(body: &Value) -> bool {
    body.get("stream").and_then(Value::as_bool) == Some(true)
}

/// The first of `keys` given, as the output token bound.
pub(crate) fn max_tokens(o: &Map<String, Value>, keys: &[&str]) -> Result<Option<u32>, BadRequest> {
    for key in keys {
        if let Some(v) = get(o, key) {
            let n = v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| BadRequest::new(*key, "must be a positive integer"))?;
            return Ok(Some(n));
        }
    }
    Ok(None)
}

/// Whether a key's value asks only for what agentrun carries.
pub(crate) type Accepts = fn(&Value) -> bool;

/// What a dialect does with the keys of one object of the body: keys it
/// translates, keys it drops (they do not change what is asked, or are the
/// platform's choice: the model, its sampling), and keys it accepts only
/// with the value that asks nothing beyond what it carries. Any other key
/// is refused: the answer could not be what the agent asked for.
pub(crate) struct Keys<'a> {
    pub carried: &'a [&'a str],
    pub dropped: &'a [&'a str],
    /// `(key, accepts)`: the key is refused unless `accepts(value)`.
    pub only: &'a [(&'a str, Accepts)],
}

impl Keys<'_> {
    pub(crate) fn check(&self, o: &Map<String, Value>, path: &str) -> Result<(), BadRequest> {
        // Keys held to a value first: they say more than an unknown key
        // beside them (`type: "custom"` before the `custom` it brings).
        for (key, accepts) in self.only {
            if let Some(v) = get(o, key).filter(|v| !accepts(v)) {
                return Err(BadRequest::new(
                    at(path, key),
                    format!("agentrun cannot honour {v} here"),
                ));
            }
        }
        let known = |k: &str| {
            self.carried.contains(&k)
                || self.dropped.contains(&k)
                || self.only.iter().any(|(name, _)| *name == k)
        };
        match o.iter().find(|(k, v)| !v.is_null() && !known(k)) {
            Some((k, _)) => Err(BadRequest::new(
                at(path, k),
                "not supported: agentrun cannot carry this field to the model",
            )),
            None => Ok(()),
        }
    }
}

/// Text given as a string or as a list of parts: the parts of `text_types`
/// joined by a line break; any other part is refused naming it.
pub(crate) fn text(v: &Value, path: &str, text_types: &[&str]) -> Result<String, BadRequest> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                texts.push(text_part(part, &index(path, i), text_types)?);
            }
            Ok(texts.join("\n"))
        }
        _ => Err(BadRequest::new(
            path,
            "must be a string or a list of text parts",
        )),
    }
}

/// One text part (`{"type": "text", "text": ...}`); metadata that does not
/// change the text (prompt caching, annotations) is not looked at.
pub(crate) fn text_part<'a>(
    part: &'a Value,
    path: &str,
    text_types: &[&str],
) -> Result<&'a str, BadRequest> {
    let o = object(part, path)?;
    let kind = string(o, "type", path)?;
    if !text_types.contains(&kind) {
        return Err(BadRequest::new(
            at(path, "type"),
            format!("{kind:?} content is not supported: agentrun carries text only"),
        ));
    }
    string(o, "text", path)
}

/// The conversation as it is read, message by message: remembers each tool
/// call's name so that a tool result, which quotes only the call's id, is
/// recorded with the name of the tool it answers.
#[derive(Default)]
pub(crate) struct Conversation {
    pub messages: Vec<Message>,
    names: HashMap<String, String>,
}

impl Conversation {
    pub(crate) fn user(&mut self, text: String) {
        self.messages.push(Message::User { text });
    }

    /// A new assistant turn (empty text is no text, as in an answer).
    pub(crate) fn assistant(&mut self, text: Option<String>) {
        self.messages.push(Message::Assistant {
            text: text.filter(|t| !t.is_empty()),
            tool_calls: Vec::new(),
        });
    }

    /// A call of the assistant turn in progress (a new turn if the last
    /// message is not the assistant's).
    pub(crate) fn call(&mut self, call: ToolCall) {
        if !matches!(self.messages.last(), Some(Message::Assistant { .. })) {
            self.assistant(None);
        }
        self.names.insert(call.id.clone(), call.name.clone());
        if let Some(Message::Assistant { tool_calls, .. }) = self.messages.last_mut() {
            tool_calls.push(call);
        }
    }

    /// The result of the call `call_id` (given at `path`), which an earlier
    /// assistant turn must have made.
    pub(crate) fn tool_result(
        &mut self,
        call_id: &str,
        content: String,
        is_error: bool,
        path: &str,
    ) -> Result<(), BadRequest> {
        let name = self.names.get(call_id).cloned().ok_or_else(|| {
            BadRequest::new(
                path,
                format!("no earlier tool call in the conversation has id {call_id:?}"),
            )
        })?;
        self.messages.push(Message::ToolResult {
            call_id: call_id.to_string(),
            name,
            content,
            is_error,
        });
        Ok(())
    }
}

/// System prompts given in several places, joined by a blank line.
pub(crate) fn join_system(parts: Vec<String>) -> String {
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_joins_parts_and_names_a_refused_one() {
        let parts = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(text(&parts, "m", &["text"]).unwrap(), "a\nb");
        let image = json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]);
        let err = text(&image, "messages[1].content", &["text"]).unwrap_err();
        assert_eq!(err.field, "messages[1].content[1].type");
        assert_eq!(text(&json!(3), "x", &["text"]).unwrap_err().field, "x");
    }

    #[test]
    fn a_tool_result_takes_its_calls_name() {
        let mut c = Conversation::default();
        c.call(ToolCall {
            id: "c1".into(),
            name: "lookup".into(),
            arguments: json!({}),
        });
        c.tool_result("c1", "ok".into(), false, "m[1]").unwrap();
        let err = c
            .tool_result("c9", "x".into(), false, "m[2].id")
            .unwrap_err();
        assert_eq!(err.field, "m[2].id");
        assert!(matches!(&c.messages[1], Message::ToolResult { name, .. } if name == "lookup"));
    }

    #[test]
    fn keys_refuse_the_unknown_and_the_unhonourable() {
        let keys = Keys {
            carried: &["messages"],
            dropped: &["user"],
            only: &[("n", |v| v == &json!(1))],
        };
        let ok = json!({"messages": [], "user": "u", "n": 1, "seed": null});
        keys.check(ok.as_object().unwrap(), "").unwrap();
        let n2 = json!({"n": 2});
        assert_eq!(
            keys.check(n2.as_object().unwrap(), "").unwrap_err().field,
            "n"
        );
        let odd = json!({"logit_bias": {}});
        let err = keys.check(odd.as_object().unwrap(), "x").unwrap_err();
        assert_eq!(err.field, "x.logit_bias");
    }
}
