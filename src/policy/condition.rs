//! CEL conditions written by agent authors (`spec.approval.rules[].when`).
//! Bounded in length, nesting and operators before they are parsed, and
//! compiled and evaluated on a thread of their own with a large stack and a
//! deadline: no condition can overflow the stack of the controller or the
//! runner (a crash there stops every run), or hang them.

use crate::refusal::Refusal;
use std::time::Duration;

use serde_json::Value;

/// Longest condition accepted (the CRD refuses longer ones too).
pub const MAX_LEN: usize = 1024;
/// Deepest nesting of brackets and unary operators accepted.
pub const MAX_DEPTH: usize = 16;
/// Most operators accepted in one condition.
pub const MAX_OPERATORS: usize = 64;
/// Stack of the evaluating thread: far above what the bounds above need.
const STACK_BYTES: usize = 32 << 20;
/// How long an evaluation may take before it counts as failed (fail closed).
const DEADLINE: Duration = Duration::from_secs(2);

/// Why a condition's shape is refused, or `Ok` (pure, no parsing).
pub fn check(expr: &str) -> Result<(), Refusal> {
    if expr.len() > MAX_LEN {
        return Err(format!(
            "is {} bytes long; a condition may have at most {MAX_LEN}",
            expr.len()
        )
        .into());
    }
    let shape = shape_of(expr);
    if shape.depth > MAX_DEPTH {
        return Err(format!(
            "nests {} levels deep (brackets and unary operators); at most {MAX_DEPTH}",
            shape.depth
        )
        .into());
    }
    if shape.operators > MAX_OPERATORS {
        return Err(format!("has {} operators; at most {MAX_OPERATORS}", shape.operators).into());
    }
    Ok(())
}

/// Checks the shape, then compiles the condition (on the bounded thread).
pub fn compile(expr: &str) -> Result<(), Refusal> {
    check(expr)?;
    let expr = expr.to_string();
    on_bounded_thread(move || {
        cel::Program::compile(&expr)
            .map(|_| ())
            .map_err(|e| Refusal::new(e.to_string()))
    })
}

/// Evaluates the condition with the call's arguments bound to `args`.
pub fn evaluate(expr: &str, args: &Value) -> Result<bool, Refusal> {
    check(expr)?;
    evaluate_unchecked(expr.to_string(), args.clone())
}

fn evaluate_unchecked(expr: String, args: Value) -> Result<bool, Refusal> {
    on_bounded_thread(move || {
        let program = cel::Program::compile(&expr).map_err(|e| e.to_string())?;
        let mut ctx = cel::Context::default();
        let value = cel::to_value(&args).map_err(|e| e.to_string())?;
        ctx.add_variable_from_value("args", value);
        match program.execute(&ctx).map_err(|e| e.to_string())? {
            cel::Value::Bool(b) => Ok(b),
            other => Err(format!("the condition gave {other:?}, not a boolean").into()),
        }
    })
}

/// Runs `f` on a fresh thread with a large stack; an error if it panics or
/// passes the deadline (the thread is then left to finish on its own).
fn on_bounded_thread<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("cel".into())
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|_| Err("evaluating the condition panicked".into()));
            let _ = tx.send(result);
        })
        .map_err(|e| format!("starting the condition's thread: {e}"))?;
    match rx.recv_timeout(DEADLINE) {
        Ok(result) => result,
        Err(_) => Err(format!("the condition took longer than {} s", DEADLINE.as_secs()).into()),
    }
}

#[derive(Debug, Default, PartialEq)]
struct Shape {
    depth: usize,
    operators: usize,
}

/// Nesting and operator count, outside string literals.
fn shape_of(expr: &str) -> Shape {
    let mut shape = Shape::default();
    let mut brackets = 0usize;
    let mut unary_run = 0usize;
    let mut chars = expr.chars().peekable();
    let mut prev_significant: Option<char> = None;
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' => {
                skip_string(c, &mut chars);
                unary_run = 0;
            }
            '(' | '[' | '{' => brackets += 1,
            ')' | ']' | '}' => brackets = brackets.saturating_sub(1),
            '!' if chars.peek() != Some(&'=') => {
                unary_run += 1;
                shape.operators += 1;
            }
            '-' if prev_significant.is_none_or(|p| "([{,!-+*/%<>=&|?:".contains(p)) => {
                unary_run += 1;
                shape.operators += 1;
            }
            '&' | '|' | '=' | '<' | '>' | '!' | '+' | '-' | '*' | '/' | '%' | '?' => {
                // Two-character operators count once.
                if matches!(chars.peek(), Some('&' | '|' | '=')) {
                    chars.next();
                }
                shape.operators += 1;
                unary_run = 0;
            }
            c if c.is_whitespace() => {}
            _ => unary_run = 0,
        }
        if !c.is_whitespace() {
            prev_significant = Some(c);
        }
        shape.depth = shape.depth.max(brackets + unary_run);
    }
    shape
}

fn skip_string(quote: char, chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            c if c == quote => return,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ordinary_conditions_pass_and_decide() {
        let expr = "args.amount > 100 && !(args.currency in ['EUR', 'USD']) || args.note == '(((('";
        assert_eq!(check(expr), Ok(()));
        assert_eq!(
            evaluate(expr, &json!({"amount": 500, "currency": "GBP", "note": ""})),
            Ok(true)
        );
        assert_eq!(evaluate("-1 < args.x", &json!({"x": 5})), Ok(true));
    }

    #[test]
    fn long_deep_or_operator_heavy_conditions_are_refused_by_shape() {
        let long = format!("args.a == '{}'", "x".repeat(MAX_LEN));
        assert!(check(&long).unwrap_err().contains("bytes long"));
        let deep = format!("{}args.a{}", "(".repeat(40), ")".repeat(40));
        assert!(check(&deep).unwrap_err().contains("nests 40 levels"));
        let nots = format!("{}true", "!".repeat(30));
        assert!(check(&nots).unwrap_err().contains("nests"));
        let negs = format!("{}1 < 0", "-".repeat(30));
        assert!(check(&negs).unwrap_err().contains("nests"));
        let chain = vec!["args.a"; 100].join(" + ");
        assert!(check(&chain).unwrap_err().contains("operators"));
        assert!(compile(&deep).is_err() && evaluate(&deep, &json!({"a": 1})).is_err());
    }

    #[test]
    fn a_condition_past_the_bounds_still_cannot_crash_the_process() {
        // Without the shape check, a nesting that overflows a 2 MiB stack in
        // the parser runs on the bounded thread and ends as an error or a value.
        let deep = format!("{}true{}", "(".repeat(400), ")".repeat(400));
        let result = evaluate_unchecked(deep, json!({}));
        assert!(matches!(result, Ok(true) | Err(_)), "{result:?}");
    }
}
