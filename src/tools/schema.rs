//! Argument validation against a tool's JSON Schema, with messages a model can act on.

use crate::refusal::Refusal;
use serde_json::Value;

/// How many schema violations one observation lists at most.
const MAX_REPORTED_ERRORS: usize = 5;

/// A compiled argument schema.
pub(crate) struct ArgSchema {
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for ArgSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ArgSchema")
    }
}

impl ArgSchema {
    /// Compiles a schema; the error says what is wrong with it.
    pub(crate) fn compile(schema: &Value) -> Result<Self, Refusal> {
        // Only local references: a schema never makes the runner fetch anything.
        jsonschema::validator_for(schema)
            .map(|validator| Self { validator })
            .map_err(|e| Refusal::new(e.to_string()))
    }

    /// Checks `args` for a call of `tool`. The error is the observation the
    /// model gets, e.g. `issue_refund: arguments invalid: amount: -5 is less
    /// than the minimum of 0`.
    pub(crate) fn check(&self, tool: &str, args: &Value) -> Result<(), Refusal> {
        check_object(tool, args)?;
        let mut problems: Vec<String> = Vec::new();
        let mut total = 0usize;
        for error in self.validator.iter_errors(args) {
            total += 1;
            if problems.len() < MAX_REPORTED_ERRORS {
                let path = dotted_path(error.instance_path().as_str());
                problems.push(if path.is_empty() {
                    error.to_string()
                } else {
                    format!("{path}: {error}")
                });
            }
        }
        if total == 0 {
            return Ok(());
        }
        let mut message = format!("{tool}: arguments invalid: {}", problems.join("; "));
        if total > problems.len() {
            message.push_str(&format!(" (and {} more)", total - problems.len()));
        }
        Err(message.into())
    }
}

/// Arguments must be a JSON object; a model reply that could not be parsed
/// arrives as the raw string.
pub(crate) fn check_object(tool: &str, args: &Value) -> Result<(), Refusal> {
    let kind = match args {
        Value::Object(_) => return Ok(()),
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string (malformed JSON?)",
        Value::Array(_) => "an array",
    };
    let shown = crate::text::excerpt(&args.to_string(), 200);
    Err(format!("{tool}: arguments invalid: expected a JSON object, got {kind}: {shown}").into())
}

/// `/items/0/sku` -> `items.0.sku` (JSON pointer unescaped).
fn dotted_path(pointer: &str) -> String {
    pointer
        .split('/')
        .skip(1)
        .map(|segment| segment.replace("~1", "/").replace("~0", "~"))
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refund_schema() -> ArgSchema {
        ArgSchema::compile(&json!({
            "type": "object",
            "properties": {
                "order": {"type": "string"},
                "amount": {"type": "number", "minimum": 0},
                "lines": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}}}}
            },
            "required": ["order", "amount"],
            "additionalProperties": false
        }))
        .unwrap()
    }

    #[test]
    fn valid_arguments_pass() {
        refund_schema()
            .check("issue_refund", &json!({"order": "A-1", "amount": 5}))
            .unwrap();
    }

    #[test]
    fn messages_name_the_tool_and_the_field() {
        let err = refund_schema()
            .check("issue_refund", &json!({"order": "A-1", "amount": -5}))
            .unwrap_err();
        assert_eq!(
            err,
            "issue_refund: arguments invalid: amount: -5 is less than the minimum of 0".into()
        );
        let err = refund_schema()
            .check("issue_refund", &json!({"amount": 1}))
            .unwrap_err();
        assert!(
            err.starts_with("issue_refund: arguments invalid: "),
            "{err}"
        );
        assert!(err.contains("\"order\" is a required property"), "{err}");
        let err = refund_schema()
            .check(
                "issue_refund",
                &json!({"order": "A", "amount": 1, "lines": [{"sku": 7}]}),
            )
            .unwrap_err();
        assert!(
            err.contains("lines.0.sku: 7 is not of type \"string\""),
            "{err}"
        );
    }

    #[test]
    fn several_problems_are_all_reported() {
        let err = refund_schema()
            .check(
                "issue_refund",
                &json!({"order": 1, "amount": "x", "extra": true}),
            )
            .unwrap_err();
        assert!(err.contains("order:"), "{err}");
        assert!(err.contains("amount:"), "{err}");
        assert!(err.contains("extra"), "{err}");
    }

    #[test]
    fn non_objects_are_refused_with_their_kind() {
        let schema = refund_schema();
        let err = schema
            .check("issue_refund", &json!("{\"order\": \"A-1\", amount: }"))
            .unwrap_err();
        assert!(
            err.starts_with(
                "issue_refund: arguments invalid: expected a JSON object, got a string"
            ),
            "{err}"
        );
        assert!(
            schema
                .check("issue_refund", &json!([1]))
                .unwrap_err()
                .contains("an array")
        );
        assert!(
            schema
                .check("issue_refund", &Value::Null)
                .unwrap_err()
                .contains("null")
        );
    }

    #[test]
    fn broken_schemas_do_not_compile() {
        assert!(ArgSchema::compile(&json!({"type": "no-such-type"})).is_err());
        assert!(ArgSchema::compile(&json!({"minimum": "zero"})).is_err());
    }

    #[test]
    fn pointers_become_dotted_paths() {
        assert_eq!(dotted_path(""), "");
        assert_eq!(dotted_path("/a/0/b~1c~0d"), "a.0.b/c~d");
    }
}
