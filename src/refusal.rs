//! A refusal whose words are the product: what a model reads back as a
//! tool's answer, or a person reads in a reply, naming the field and the
//! reason. It is an error with no cause below it; anything with a cause
//! is a `thiserror` enum of its module (docs/architecture.md, "Errors").

/// Why an input was refused, in words meant for whoever sent it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(String);

impl Refusal {
    pub fn new(words: impl Into<String>) -> Refusal {
        Refusal(words.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The same words with `context` before them (`context: words`).
    pub fn within(self, context: impl std::fmt::Display) -> Refusal {
        Refusal(format!("{context}: {}", self.0))
    }
}

/// Read as the text it is (`&refusal` where a `&str` is asked for).
impl std::ops::Deref for Refusal {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Refusal {
    fn from(words: String) -> Refusal {
        Refusal(words)
    }
}

impl From<&str> for Refusal {
    fn from(words: &str) -> Refusal {
        Refusal(words.to_string())
    }
}

/// The words, for callers that carry them on as text (a record's `error`,
/// a tool's answer to the model).
impl From<Refusal> for String {
    fn from(refusal: Refusal) -> String {
        refusal.0
    }
}
