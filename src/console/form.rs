//! The edit form, generated from a tool's JSON schema: one field per
//! argument with its type (text, number, a choice for enums, JSON for
//! objects and arrays), required fields marked `required`; and the same
//! schema checking what comes back, before anything is sent to the API
//! server.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::refusal::Refusal;

/// The prefix of argument fields' names (`arg.amount`).
pub const PREFIX: &str = "arg.";

/// What an argument's field takes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    String,
    Integer,
    Number,
    Boolean,
    /// One of the schema's `enum` values (shown as text; JSON for non-strings).
    Choice,
    /// Objects, arrays and anything else: JSON text.
    Json,
}

/// One field of the edit form.
#[derive(Clone, Debug, Serialize)]
pub struct Field {
    /// The argument's name.
    pub name: String,
    /// The form field's name (`arg.NAME`).
    pub input: String,
    pub kind: Kind,
    pub required: bool,
    /// For a choice: the values offered, as the field sends them.
    pub options: Vec<String>,
    /// The value shown (the current arguments').
    pub value: String,
    /// The schema's description of the argument.
    pub description: String,
    #[serde(skip)]
    choices: Vec<Value>,
}

/// The fields for `schema` (an object schema; `None` when the tool's schema
/// could not be read: the fields follow the current arguments' types),
/// filled with `current`. Arguments present but not in the schema get a
/// field too, so nothing is lost in an edit.
pub fn fields(schema: Option<&Value>, current: &Value) -> Vec<Field> {
    let empty = Map::new();
    let props = schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let current = current.as_object().unwrap_or(&empty);
    let mut out: Vec<Field> = props
        .iter()
        .map(|(name, prop)| {
            field(
                name,
                Some(prop),
                current.get(name),
                required.contains(&name.as_str()),
            )
        })
        .collect();
    for (name, value) in current {
        if !props.contains_key(name) {
            out.push(field(name, None, Some(value), false));
        }
    }
    out
}

fn field(name: &str, prop: Option<&Value>, value: Option<&Value>, required: bool) -> Field {
    let choices: Vec<Value> = prop
        .and_then(|p| p.get("enum"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let kind = if !choices.is_empty() {
        Kind::Choice
    } else {
        match prop.map(type_of) {
            Some(t) => kind_of(t.as_deref()),
            None => match value {
                Some(Value::String(_)) => Kind::String,
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Kind::Integer,
                Some(Value::Number(_)) => Kind::Number,
                Some(Value::Bool(_)) => Kind::Boolean,
                _ => Kind::Json,
            },
        }
    };
    let text = |v: &Value| match v {
        Value::String(s) if kind != Kind::Json => s.clone(),
        other => other.to_string(),
    };
    Field {
        name: name.to_string(),
        input: format!("{PREFIX}{name}"),
        required,
        options: choices.iter().map(text).collect(),
        value: value.map(text).unwrap_or_default(),
        description: prop
            .and_then(|p| p.get("description"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        kind,
        choices,
    }
}

/// The schema's `type` (the first that is not `null` of a list).
fn type_of(prop: &Value) -> Option<String> {
    match prop.get("type")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(a) => a
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .map(str::to_string),
        _ => None,
    }
}

fn kind_of(t: Option<&str>) -> Kind {
    match t {
        Some("string") => Kind::String,
        Some("integer") => Kind::Integer,
        Some("number") => Kind::Number,
        Some("boolean") => Kind::Boolean,
        _ => Kind::Json,
    }
}

/// The arguments a submitted form gives, checked field by field (required,
/// type, choice) and then against the whole `schema`; every problem in
/// words when they do not hold.
pub fn parse(
    schema: Option<&Value>,
    current: &Value,
    form: &[(String, String)],
) -> Result<Value, Vec<Refusal>> {
    let mut args = Map::new();
    let mut problems = Vec::new();
    for f in fields(schema, current) {
        let raw = form
            .iter()
            .find(|(k, _)| *k == f.input)
            .map(|(_, v)| v.as_str())
            .unwrap_or("");
        if raw.trim().is_empty() && f.kind != Kind::String {
            if f.required {
                problems.push(Refusal::new(format!("{} is required", f.name)));
            }
            continue;
        }
        if raw.is_empty() {
            if f.required {
                problems.push(Refusal::new(format!("{} is required", f.name)));
            }
            continue;
        }
        let raw = if f.kind == Kind::String {
            raw
        } else {
            raw.trim()
        };
        match value_of(&f, raw) {
            Ok(v) => {
                args.insert(f.name.clone(), v);
            }
            Err(why) => problems.push(why.within(&f.name)),
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let args = Value::Object(args);
    if let Some(schema) = schema {
        match jsonschema::validator_for(schema) {
            Ok(v) => {
                let found: Vec<Refusal> = v
                    .iter_errors(&args)
                    .map(|e| {
                        let path = e
                            .instance_path()
                            .as_str()
                            .trim_start_matches('/')
                            .replace('/', ".");
                        Refusal::new(if path.is_empty() {
                            e.to_string()
                        } else {
                            format!("{path}: {e}")
                        })
                    })
                    .collect();
                if !found.is_empty() {
                    return Err(found);
                }
            }
            Err(e) => {
                return Err(vec![Refusal::new(format!(
                    "the tool's schema does not compile: {e}"
                ))]);
            }
        }
    }
    Ok(args)
}

fn value_of(f: &Field, raw: &str) -> Result<Value, Refusal> {
    match f.kind {
        Kind::String => Ok(Value::String(raw.to_string())),
        Kind::Integer => match serde_json::from_str::<Value>(raw) {
            Ok(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(Value::Number(n)),
            Ok(Value::Number(n))
                if n.as_f64()
                    .is_some_and(|x| x.fract() == 0.0 && x.abs() < 9e15) =>
            {
                Ok(Value::from(n.as_f64().unwrap_or_default() as i64))
            }
            _ => Err(Refusal::new(format!("{raw:?} is not a whole number"))),
        },
        Kind::Number => match serde_json::from_str::<Value>(raw) {
            Ok(Value::Number(n)) => Ok(Value::Number(n)),
            _ => Err(Refusal::new(format!("{raw:?} is not a number"))),
        },
        Kind::Boolean => match raw {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            _ => Err(Refusal::new(format!("{raw:?} is not true or false"))),
        },
        Kind::Choice => f
            .options
            .iter()
            .position(|o| o == raw)
            .map(|i| f.choices[i].clone())
            .ok_or_else(|| Refusal::new(format!("{raw:?} is not one of {}", f.options.join(", ")))),
        Kind::Json => serde_json::from_str(raw).map_err(|e| Refusal::new(format!("not JSON: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "required": ["orderId", "amount"],
        "properties": {
            "orderId": {"type": "string", "description": "The order"},
            "amount": {"type": "number", "minimum": 0},
            "count": {"type": "integer"},
            "notify": {"type": "boolean"},
            "reason": {"enum": ["duplicate", "damaged", 3]},
            "meta": {"type": "object"}
        }})
    }

    fn form(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (format!("{PREFIX}{k}"), v.to_string()))
            .collect()
    }

    #[test]
    fn fields_follow_the_schema_types_required_and_enums() {
        let f = fields(
            Some(&schema()),
            &json!({"orderId": "1042", "amount": 500, "extra": true}),
        );
        let by = |n: &str| f.iter().find(|x| x.name == n).unwrap().clone();
        assert_eq!(by("orderId").kind, Kind::String);
        assert!(by("orderId").required && by("amount").required);
        assert!(!by("count").required);
        assert_eq!(by("amount").kind, Kind::Number);
        assert_eq!(by("amount").value, "500");
        assert_eq!(by("count").kind, Kind::Integer);
        assert_eq!(by("notify").kind, Kind::Boolean);
        assert_eq!(by("reason").kind, Kind::Choice);
        assert_eq!(by("reason").options, ["duplicate", "damaged", "3"]);
        assert_eq!(by("meta").kind, Kind::Json);
        assert_eq!(by("orderId").description, "The order");
        // An argument the schema does not name keeps a field of its type.
        assert_eq!(by("extra").kind, Kind::Boolean);
        assert_eq!(by("extra").input, "arg.extra");
    }

    #[test]
    fn without_a_schema_fields_follow_the_arguments() {
        let f = fields(None, &json!({"a": "x", "n": 3, "x": 1.5, "o": {"k": 1}}));
        let kinds: Vec<_> = f
            .iter()
            .map(|f| (f.name.as_str(), f.kind.clone()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("a", Kind::String),
                ("n", Kind::Integer),
                ("o", Kind::Json),
                ("x", Kind::Number)
            ]
        );
        assert_eq!(f[2].value, r#"{"k":1}"#);
    }

    #[test]
    fn a_form_is_checked_for_types_required_fields_and_choices() {
        let s = schema();
        let cur = json!({"orderId": "1042", "amount": 500});
        let ok = parse(
            Some(&s),
            &cur,
            &form(&[
                ("orderId", "1042"),
                ("amount", "300"),
                ("count", "2"),
                ("notify", "true"),
                ("reason", "3"),
                ("meta", r#"{"a": [1]}"#),
            ]),
        )
        .unwrap();
        assert_eq!(
            ok,
            json!({"orderId": "1042", "amount": 300, "count": 2, "notify": true, "reason": 3, "meta": {"a": [1]}})
        );
        let e = parse(Some(&s), &cur, &form(&[("orderId", "1042")])).unwrap_err();
        assert_eq!(e, [Refusal::new("amount is required")]);
        let e = parse(
            Some(&s),
            &cur,
            &form(&[
                ("orderId", "1"),
                ("amount", "lots"),
                ("count", "1.5"),
                ("notify", "yes"),
                ("reason", "other"),
                ("meta", "{"),
            ]),
        )
        .unwrap_err();
        assert_eq!(e.len(), 5, "{e:?}");
        assert!(
            e[0].starts_with("amount: \"lots\" is not a number"),
            "{e:?}"
        );
        assert!(e[1].contains("not a whole number"), "{e:?}");
        assert!(e[2].starts_with("meta: not JSON"), "{e:?}");
        assert!(e[3].contains("not true or false"), "{e:?}");
        assert!(
            e[4].contains("is not one of duplicate, damaged, 3"),
            "{e:?}"
        );
        // The whole schema still applies (minimum).
        let e = parse(Some(&s), &cur, &form(&[("orderId", "1"), ("amount", "-5")])).unwrap_err();
        assert!(e[0].starts_with("amount: -5"), "{e:?}");
    }

    #[test]
    fn the_budget_schema_makes_number_fields_and_checks_them() {
        let s = crate::api::budget_arguments_schema();
        let f = fields(Some(&s), &json!({"maxSteps": 10}));
        assert!(
            f.iter()
                .any(|f| f.name == "maxSteps" && f.kind == Kind::Integer)
        );
        assert!(
            f.iter()
                .any(|f| f.name == "maxCostUSD" && f.kind == Kind::Number)
        );
        let ok = parse(
            Some(&s),
            &json!({}),
            &form(&[("maxSteps", "20"), ("maxCostUSD", "")]),
        )
        .unwrap();
        assert_eq!(ok, json!({"maxSteps": 20}));
        assert!(parse(Some(&s), &json!({}), &form(&[("maxSteps", "0")])).is_err());
    }
}
