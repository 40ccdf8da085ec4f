//! Server-sent-event framing of a streamed answer: each string one complete
//! event, ready to be written to the agent as it is.

use serde_json::Value;

/// One event carrying `data` as compact JSON, under `event: <name>` when the
/// dialect names its events (Responses, Messages; Chat Completions does not).
pub fn event(name: Option<&str>, data: &Value) -> String {
    match name {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// Chat Completions' end of stream.
pub fn done() -> String {
    "data: [DONE]\n\n".to_string()
}

/// The `data` payloads of `events`, parsed, in order (`[DONE]` left out):
/// what a client reads back, for tests.
#[cfg(test)]
pub(crate) fn payloads(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event data is JSON"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_named_and_unnamed_events() {
        let data = json!({"type": "ping", "text": "a\nb"});
        let named = event(Some("ping"), &data);
        assert!(named.starts_with("event: ping\ndata: {"), "{named}");
        assert!(
            named.ends_with("}\n\n") && named.lines().count() == 3,
            "{named:?}"
        );
        assert_eq!(payloads(&[named]), vec![data.clone()]);
        assert_eq!(event(None, &json!(1)), "data: 1\n\n");
        assert_eq!(payloads(&[event(None, &data), done()]), vec![data]);
    }
}
