//! Text that reaches people (a status, an Event, a terminal) from places
//! that are not ours: cut on character boundaries, control characters
//! escaped.

/// The longest prefix of `text` of at most `max` bytes that ends on a
/// character boundary.
/// An error and its causes on one line, `what: why: why`, as people read
/// them in a log line or a Warning.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

pub fn prefix(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text`, or its first `max` bytes (on a character boundary) and "…".
pub fn excerpt(text: &str, max: usize) -> String {
    match prefix(text, max) {
        whole if whole.len() == text.len() => whole.to_string(),
        cut => format!("{cut}…"),
    }
}

/// What the API server accepts of an Event's note (events.k8s.io/v1
/// `note`, `NoteLengthLimit` in its validation), in bytes: a longer note
/// is refused and the Event is lost.
pub const EVENT_NOTE_MAX_BYTES: usize = 1024;

/// What a condition's message may hold (metav1.Condition's `message`), in
/// bytes.
pub const CONDITION_MESSAGE_MAX_BYTES: usize = 32_768;

/// `text`, or as much of it as fits in `max` bytes together with a closing
/// "…" (on a character boundary): never longer than `max` bytes.
pub fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    const MORE: &str = "…";
    match max.checked_sub(MORE.len()) {
        Some(room) => format!("{}{MORE}", prefix(text, room)),
        None => prefix(text, max).to_string(),
    }
}

/// `text`, or "…" and its last `max` bytes (on a character boundary): for
/// logs and messages whose end says the most.
pub fn tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// `text` with control characters (newlines, escape sequences) escaped as
/// Rust writes them (`\n`, `\u{1b}`): one line, no terminal codes.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_on_character_boundaries() {
        // "é" is 2 bytes, "😀" 4, "界" 3: every cut inside them backs off.
        assert_eq!(prefix("aé", 2), "a");
        assert_eq!(prefix("😀x", 3), "");
        assert_eq!(prefix("界界", 4), "界");
        assert_eq!(prefix("short", 10), "short");
        assert_eq!(excerpt("界界界", 7), "界界…");
        assert_eq!(excerpt("界", 3), "界");
        assert_eq!(tail("界界", 4), "…界");
        assert_eq!(tail("ab😀", 4), "…😀");
        assert_eq!(tail("a😀b", 2), "…b");
        assert_eq!(tail("ab", 5), "ab");
    }

    #[test]
    fn a_cut_never_passes_its_bytes() {
        assert_eq!(cut("short", 5), "short");
        assert_eq!(cut("界界界", 7), "界…");
        assert_eq!(cut("abc", 2), "ab");
        assert_eq!(cut("界", 2), "");
        for max in 0..20 {
            for text in ["", "ascii text here!", "界界界界界界", "😀a😀b😀c"] {
                let got = cut(text, max);
                assert!(got.len() <= max, "{text:?} {max}: {got:?}");
            }
        }
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            escape_controls("HTTP 500: bad\n\u{1b}[31mred\u{7} ünïcode"),
            "HTTP 500: bad\\n\\u{1b}[31mred\\u{7} ünïcode"
        );
    }
}
