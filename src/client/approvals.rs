//! Approvals as a person sees and decides them: their state and time left,
//! the proposal beside its alternatives, the decision added with the hash
//! of what was shown, and records described in words.

use std::collections::BTreeMap;

use jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::{Kube, whoami};
use crate::api::{Approval, ApprovalState, Verdict};
use crate::replay::Entry;
use crate::runlog::records::ApprovalDecided;

/// Why a decision was not added.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("no approval named {name:?} in namespace {ns:?}")]
    NoApproval { name: String, ns: String },
    #[error("approval {name} is already {state:?}: no more decisions are taken")]
    Closed { name: String, state: ApprovalState },
    #[error("approval {name} expired at {at}")]
    Expired { name: String, at: Timestamp },
    #[error("{me} has already decided approval {name}")]
    AlreadyDecided { me: String, name: String },
    #[error("the API server refused the decision: {0}")]
    Refused(String),
    /// Reading the approval or asking who the caller is failed as the API server said.
    #[error(transparent)]
    Client(#[from] crate::client::ClientError),
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error(transparent)]
    Patch(#[from] serde_json::Error),
}

/// Why edited arguments were refused, in words for the person editing.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    #[error(transparent)]
    Read(#[from] std::io::Error),
    #[error("{path} is not JSON")]
    NotJson {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("edit needs --set KEY=VALUE or -f FILE")]
    Nothing,
    #[error("arguments must be a JSON object")]
    NotObject,
    #[error("--set {0}: expected KEY=VALUE")]
    BadSet(String),
}

pub(crate) fn state(a: &Approval) -> ApprovalState {
    a.status.as_ref().and_then(|s| s.state).unwrap_or_default()
}

pub(crate) async fn get(
    api: &Api<Approval>,
    name: &str,
    ns: &str,
) -> Result<Approval, DecideError> {
    api.get_opt(name)
        .await?
        .ok_or_else(|| DecideError::NoApproval {
            name: name.to_string(),
            ns: ns.to_string(),
        })
}

/// Adds the caller's own decision, quoting the hash of what they were shown.
pub(crate) async fn decide(
    k: &Kube,
    name: &str,
    verdict: Verdict,
    arguments: Option<Value>,
    reason: Option<String>,
) -> Result<Approval, DecideError> {
    let (api, client) = (&k.approvals, &k.client);
    let a = get(api, name, &k.ns).await?;
    let st = state(&a);
    if st != ApprovalState::Pending {
        return Err(DecideError::Closed {
            name: name.to_string(),
            state: st,
        });
    }
    if Timestamp::now() >= a.spec.expires_at.0 {
        return Err(DecideError::Expired {
            name: name.to_string(),
            at: a.spec.expires_at.0,
        });
    }
    let me = whoami(client).await?;
    if a.spec.decisions.iter().any(|d| d.approver == me) {
        return Err(DecideError::AlreadyDecided {
            me,
            name: name.to_string(),
        });
    }
    let mut entry =
        json!({"approver": me, "verdict": verdict, "argumentsHash": a.spec.arguments_hash});
    if let Some(args) = arguments {
        entry["arguments"] = args;
    }
    if let Some(r) = reason {
        entry["reason"] = json!(r);
    }
    let patch: json_patch::Patch = serde_json::from_value(json!([
        // Fails if someone decided in between: the list is not what we saw.
        {"op": "test", "path": "/spec/decisions", "value": a.spec.decisions},
        {"op": "add", "path": "/spec/decisions/-", "value": entry}
    ]))?;
    match api
        .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(a) => Ok(a),
        Err(kube::Error::Api(e)) => Err(DecideError::Refused(e.message)),
        Err(e) => Err(e.into()),
    }
}

/// Applies `--set key=value` (JSON values when they parse) or `-f file`.
pub fn edited_arguments(
    current: &Value,
    set: &[String],
    file: Option<&std::path::Path>,
) -> Result<Value, EditError> {
    let mut args = match file {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?).map_err(|source| {
            EditError::NotJson {
                path: path.display().to_string(),
                source,
            }
        })?,
        None => current.clone(),
    };
    if set.is_empty() && file.is_none() {
        return Err(EditError::Nothing);
    }
    let map = args.as_object_mut().ok_or(EditError::NotObject)?;
    for kv in set {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| EditError::BadSet(kv.clone()))?;
        let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()));
        map.insert(k.to_string(), value);
    }
    Ok(args)
}

pub(crate) fn approvers(a: &Approval) -> String {
    let mut v: Vec<String> = a.spec.approvers.users.clone();
    v.extend(a.spec.approvers.groups.iter().map(|g| format!("group:{g}")));
    format!("{} of {}", a.spec.required_approvals, v.join(","))
}

pub(crate) fn time_left(a: &Approval) -> String {
    let left = a
        .spec
        .expires_at
        .0
        .duration_since(Timestamp::now())
        .as_secs();
    if left <= 0 {
        "expired".into()
    } else {
        format!("{}m{}s", left / 60, left % 60)
    }
}

pub(crate) fn abbreviate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!(
            "{}…",
            s.chars().take(n.saturating_sub(1)).collect::<String>()
        )
    }
}

/// Model-written text made safe for a terminal: control characters (ESC,
/// CSI, carriage returns, newlines...) and invisible direction overrides are
/// shown as `\u{1b}`-style escapes, so a reply cannot repaint what the
/// approver sees.
pub fn visible(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let hidden = c.is_control()
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{feff}');
        if hidden {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// A JSON value on one line, safe for a terminal.
pub(crate) fn visible_json(v: &Value) -> String {
    visible(&v.to_string())
}

/// Proposed, alternative and edited arguments side by side, one row per
/// argument; `*` marks a value that differs from the proposed one.
pub fn side_by_side(columns: &[(String, &Value)]) -> String {
    let Some((_, proposed)) = columns.first() else {
        return String::new();
    };
    let mut keys: Vec<String> = Vec::new();
    for (_, v) in columns {
        match v.as_object() {
            Some(m) => {
                for k in m.keys() {
                    if !keys.contains(k) {
                        keys.push(k.clone());
                    }
                }
            }
            None => {
                if !keys.iter().any(|k| k.is_empty()) {
                    keys.push(String::new());
                }
            }
        }
    }
    let cell = |v: &Value, k: &str| -> Option<Value> {
        if k.is_empty() {
            (!v.is_object()).then(|| v.clone())
        } else {
            v.get(k).cloned()
        }
    };
    let mut rows: Vec<Vec<String>> = vec![
        std::iter::once("argument".to_string())
            .chain(columns.iter().map(|(h, _)| abbreviate(&visible(h), 40)))
            .collect(),
    ];
    for k in &keys {
        let base = cell(proposed, k);
        // A key is the model's text too: cut like a value, so one long key
        // does not pad every row of the table to its width.
        let mut row = vec![if k.is_empty() {
            "(whole)".to_string()
        } else {
            abbreviate(&visible(k), 40)
        }];
        for (i, (_, v)) in columns.iter().enumerate() {
            let c = cell(v, k);
            let text = c.as_ref().map_or("-".to_string(), visible_json);
            let mark = if i > 0 && c != base { " *" } else { "" };
            row.push(format!("{}{mark}", abbreviate(&text, 40)));
        }
        rows.push(row);
    }
    let widths: Vec<usize> = (0..=columns.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        out.push_str(&format!("  {}\n", line.join("  ").trim_end()));
    }
    out
}

/// The `show` text. Every string that a model, a tool or a user wrote is
/// escaped with [`visible`].
pub fn describe(a: &Approval) -> String {
    let mut out = String::new();
    describe_call(a, &mut out);
    let columns = alternatives(&a.spec);
    if columns.len() > 1 {
        out.push_str("Compare:\n");
        out.push_str(&side_by_side(&columns));
    }
    describe_context(a, &mut out);
    describe_decisions(a, &mut out);
    out
}

/// One `show` line: the label in a fixed column, then the value.
fn push_line(out: &mut String, k: &str, v: String) {
    out.push_str(&format!("{k:<14} {v}\n"));
}

/// What is asked: the approval, its run, the call and its arguments.
fn describe_call(a: &Approval, out: &mut String) {
    let s = &a.spec;
    let mut line = |k: &str, v: String| push_line(out, k, v);
    line(
        "Approval:",
        visible(&a.metadata.name.clone().unwrap_or_default()),
    );
    line(
        "Run:",
        format!("{} (log record {})", visible(&s.run_ref.name), s.step),
    );
    line("State:", format!("{:?}", state(a)));
    if s.kind == crate::api::ApprovalKind::Reconcile {
        line(
            "Asks:",
            "did this call already happen? Approve: it did (not repeated). Reject: it did not (made now)."
                .into(),
        );
    }
    line("Rule:", visible(&s.rule.clone().unwrap_or_default()));
    line("Tool:", visible(&s.tool));
    line(
        "Arguments:",
        serde_json::to_string_pretty(&s.arguments)
            .unwrap_or_default()
            .lines()
            .map(visible)
            .collect::<Vec<_>>()
            .join("\n               "),
    );
    line("Hash:", visible(&s.arguments_hash));
}

/// Everything that could run instead of the proposal, next to it: the
/// alternative on expiry and every approver's edit.
pub(crate) fn alternatives(s: &crate::api::ApprovalSpec) -> Vec<(String, &Value)> {
    let mut columns: Vec<(String, &Value)> = vec![("proposed".into(), &s.arguments)];
    if let Some(alt) = &s.alternative {
        columns.push((
            format!("alternative on expiry ({:?})", s.on_expiry),
            &alt.arguments,
        ));
    }
    for d in &s.decisions {
        if let Some(edited) = &d.arguments {
            columns.push((format!("{}'s edit", d.approver), edited));
        }
    }
    columns
}

/// What the decision may rest on: the agent's reason, recent results and
/// dependency versions; then who decides and by when.
fn describe_context(a: &Approval, out: &mut String) {
    let s = &a.spec;
    let mut line = |k: &str, v: String| push_line(out, k, v);
    // The step pod's words: shown as the agent's, never as the controller's.
    line(
        "Agent says:",
        match s.observations.reason.as_deref() {
            Some(reason) => format!("{} (its own words, unchecked)", visible(reason)),
            None => "(no reason given)".into(),
        },
    );
    for r in &s.observations.recent_results {
        line(
            "Observed:",
            format!("[{}] {}: {}", r.seq, visible(&r.tool), visible(&r.summary)),
        );
    }
    for d in &s.dependencies {
        line(
            "Depends on:",
            format!("{} at version {}", visible(&d.name), visible(&d.version)),
        );
    }
    line("Approvers:", visible(&approvers(a)));
    if let Some(req) = &s.requester {
        line(
            "Requester:",
            format!(
                "{}{}",
                visible(req),
                if s.separation_of_duties {
                    " (may not decide)"
                } else {
                    ""
                }
            ),
        );
    }
    line(
        "Expires:",
        format!(
            "{} ({}), then {:?}",
            s.expires_at.0,
            time_left(a),
            s.on_expiry
        ),
    );
}

/// The decisions so far, one line per approver (the last one counts).
fn describe_decisions(a: &Approval, out: &mut String) {
    let by: BTreeMap<_, _> = a
        .spec
        .decisions
        .iter()
        .map(|d| (d.approver.clone(), d))
        .collect();
    for (who, d) in by {
        push_line(
            out,
            "Decision:",
            format!(
                "{}: {:?}{}{}",
                visible(&who),
                d.verdict,
                d.arguments
                    .as_ref()
                    .map(|args| format!(" to {}", visible_json(args)))
                    .unwrap_or_default(),
                d.reason
                    .as_deref()
                    .map(|r| format!(" ({})", visible(r)))
                    .unwrap_or_default()
            ),
        );
    }
}

/// One readable line of the audit trail. The payload is read through the
/// log's record types, so the trail means what replay means; a payload that
/// does not decode is shown raw (abbreviated), as a kind this code does not
/// describe.
pub fn audit_line(r: &crate::store::Record) -> String {
    let what = match Entry::decode(r.seq, r.kind.as_str(), &r.payload) {
        Ok(step) => describe_entry(&step),
        Err(_) => None,
    }
    .unwrap_or_else(|| abbreviate(&r.payload.to_string(), 100));
    format!(
        "{:>4} {:<18} {:<28} {}",
        r.seq,
        r.kind.as_str(),
        visible(&format!("{}#{}", r.worker.pod, r.worker.attempt)),
        visible(&what)
    )
}

/// What a step did, in a few words; `None` for kinds shown as their payload.
pub(crate) fn describe_entry(step: &Entry) -> Option<String> {
    Some(match step {
        Entry::ModelCall(c) => {
            let calls: Vec<String> = c
                .response
                .tool_calls
                .iter()
                .map(|c| format!("{}({})", c.name, c.arguments))
                .collect();
            format!(
                "model {} proposed {}",
                c.response.model_id,
                if calls.is_empty() {
                    "an answer".into()
                } else {
                    calls.join(", ")
                }
            )
        }
        Entry::ToolIntent(i) => format!(
            "calling {}({}) key {}",
            i.tool,
            i.arguments,
            i.key.chars().take(12).collect::<String>()
        ),
        Entry::ToolResult(t) => format!(
            "{} returned {}",
            t.tool,
            abbreviate(&json_text(&t.outcome), 100)
        ),
        Entry::ApprovalRequested(a) => format!(
            "approval requested for {}({}) by rule {}",
            a.tool, a.arguments, a.gate.rule
        ),
        Entry::ApprovalDecided(d) => decided_text(d),
        Entry::ApprovalVoided(v) => format!("approval voided: {}", v.reason),
        Entry::Forked(f) => format!(
            "forked from {} ({}) after its seq {} (hash {}) by {}{}",
            f.parent_name,
            f.parent_uid,
            f.seq,
            f.parent_hash.chars().take(12).collect::<String>(),
            f.requester.as_deref().unwrap_or("(unknown)"),
            f.replaced
                .as_ref()
                .map(|r| format!("; record {} replaced: {}", r.seq, r.reason))
                .unwrap_or_default()
        ),
        Entry::RunFinished(f) => format!(
            "{}: {}",
            name_of(&f.outcome),
            f.result.as_deref().or(f.error.as_deref()).unwrap_or("")
        ),
        _ => return None,
    })
}

/// `approval verdict: approver verdict (reason); ...`
fn decided_text(d: &ApprovalDecided) -> String {
    let who: Vec<String> = d
        .decisions
        .iter()
        .map(|d| {
            format!(
                "{} {} ({})",
                d.approver,
                name_of(&d.verdict),
                d.reason.as_deref().unwrap_or("")
            )
        })
        .collect();
    format!("{} {}: {}", d.approval, name_of(&d.verdict), who.join("; "))
}

/// A stored value as the JSON text the log holds (keys sorted, as in the
/// payload it was read from).
fn json_text(v: &impl serde::Serialize) -> String {
    serde_json::to_value(v).map_or_else(|_| "?".into(), |v| v.to_string())
}

/// An enum's name as the log spells it (`Approve`, `Succeeded`...).
fn name_of(v: &impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "?".into(),
    }
}

#[cfg(test)]
mod tests {
    /// The notification attack in the terminal: a key of 30,000 characters
    /// in a side-by-side comparison is cut like a value, not a column 30,000
    /// wide that pads every row.
    #[test]
    fn a_long_argument_key_is_cut_in_the_side_by_side_table() {
        let key = "&".repeat(30_000);
        let proposed = serde_json::json!({ key.clone(): 1, "amount": 500 });
        let edited = serde_json::json!({ key: 2, "amount": 200 });
        let table = super::side_by_side(&[
            ("proposed".into(), &proposed),
            ("edited by alice".into(), &edited),
        ]);
        for line in table.lines() {
            assert!(
                line.chars().count() <= 200,
                "{} characters",
                line.chars().count()
            );
        }
        assert!(table.contains("&&&…"), "{table}");
    }

    use super::*;
    use crate::store::{Hash, Head, Record, RecordDraft, StepKind};

    #[test]
    fn cut_texts_end_on_a_character_boundary() {
        // A key and an outcome a token holder wrote, multi-byte at the cut.
        let key = "ab🦀🦀🦀🦀🦀🦀🦀🦀🦀🦀🦀";
        let intent = crate::store::RecordDraft::new(
            crate::store::StepKind::ToolIntent,
            // A whole ToolIntent: the trail reads records through their types.
            json!({"modelCallSeq": 1, "callIndex": 0, "callId": "c", "tool": "t", "arguments": {}, "key": key}),
        )
        .seal(&crate::store::Head::EMPTY)
        .unwrap();
        let line = audit_line(&intent);
        assert!(line.contains("key ab🦀🦀🦀🦀🦀🦀🦀🦀🦀🦀"), "{line}");
        assert!(!line.contains(key), "{line}");
        let cjk = "退款".repeat(100);
        let cut = abbreviate(&cjk, 7);
        assert_eq!(cut, "退款退款退款…", "seven characters in all");
        assert_eq!(abbreviate("🦀🦀", 0), "…");
    }

    #[test]
    fn edits_set_json_values_and_strings() {
        let args = json!({"orderId": "1042", "amount": 500});
        let edited = edited_arguments(
            &args,
            &["amount=300".into(), "note=partial refund".into()],
            None,
        )
        .unwrap();
        assert_eq!(
            edited,
            json!({"orderId": "1042", "amount": 300, "note": "partial refund"})
        );
        assert!(edited_arguments(&args, &[], None).is_err());
        assert!(
            edited_arguments(&args, &["amount".into()], None)
                .unwrap_err()
                .to_string()
                .contains("KEY=VALUE")
        );
    }

    #[test]
    fn model_written_text_cannot_reach_the_terminal_raw() {
        assert_eq!(
            visible("ok\u{1b}[2K\rrefund 5"),
            "ok\\u{1b}[2K\\u{d}refund 5"
        );
        assert_eq!(
            visible("a\u{9b}31mb\u{202e}c\nd"),
            "a\\u{9b}31mb\\u{202e}c\\u{a}d"
        );
        assert_eq!(visible("plain, ünïcode €"), "plain, ünïcode €");
    }

    fn approval(arguments: Value) -> Approval {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
            "metadata": {"name": "r-a4-12345678"},
            "spec": {
                "runRef": {"name": "r"}, "step": 4, "tool": "issue_refund",
                "arguments": arguments, "argumentsHash": "1".repeat(64),
                "approvers": {"users": ["alice", "bob"]}, "requiredApprovals": 2,
                "expiresAt": "2030-01-01T00:00:00Z", "onExpiry": "Alternative",
                "observations": {"reason": "Refund \u{1b}[1A\u{1b}[2Kamount: 5",
                                 "recentResults": [{"seq": 2, "tool": "lookup_order", "summary": "paid\u{7}"}]},
                "alternative": {"tool": "issue_refund", "arguments": {"orderId": "1042", "amount": 50000}},
                "decisions": [{"approver": "bob", "verdict": "Edit", "argumentsHash": "1".repeat(64),
                               "arguments": {"orderId": "1042", "amount": 300}, "reason": "partial\u{1b}]0;x"}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn show_escapes_everything_and_sets_alternative_and_edits_beside_the_proposal() {
        let text = describe(&approval(json!({"orderId": "1042", "amount": 500})));
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(
            text.contains("Refund \\u{1b}[1A\\u{1b}[2Kamount: 5"),
            "{text}"
        );
        let compare: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("Compare:"))
            .skip(1)
            .take(3)
            .collect();
        assert!(
            compare[0].contains("proposed")
                && compare[0].contains("alternative on expiry (Alternative)")
                && compare[0].contains("bob's edit"),
            "{text}"
        );
        let amount = compare.iter().find(|l| l.contains("amount")).unwrap();
        assert!(
            amount.contains("500") && amount.contains("50000 *") && amount.contains("300 *"),
            "{amount}"
        );
        let order = compare.iter().find(|l| l.contains("orderId")).unwrap();
        assert!(!order.contains('*'), "{order}");
    }

    /// A stored record of `kind` carrying `payload`, written by pod `p-0`.
    fn stored(seq: u64, kind: StepKind, payload: Value) -> Record {
        let mut draft = RecordDraft::new(kind, payload);
        draft.worker.pod = "p-0".into();
        draft.worker.attempt = 2;
        let head = Head {
            len: seq,
            hash: Hash::ZERO,
        };
        draft.seal(&head).unwrap()
    }

    fn typed(v: impl serde::Serialize) -> Value {
        serde_json::to_value(v).unwrap()
    }

    fn audit_records() -> Vec<Record> {
        use crate::runlog::records::*;
        use crate::runlog::v1;
        let response = v1::ModelResponse {
            text: None,
            tool_calls: vec![v1::ToolCall {
                id: "c1".into(),
                name: "issue_refund".into(),
                arguments: json!({"orderId": "1042", "amount": 500}),
            }],
            usage: v1::TokenUsage::default(),
            model_id: "gpt-x".into(),
            stop_reason: None,
        };
        let model_call = ModelCall {
            request: None,
            response: response.clone(),
            cost_usd: 0.0,
            context: ContextInfo::default(),
            attempts: None,
        };
        let answer = ModelCall {
            request: None,
            response: v1::ModelResponse {
                tool_calls: vec![],
                text: Some("done".into()),
                ..response
            },
            ..model_call.clone()
        };
        let requested = ApprovalRequested {
            model_call_seq: 1,
            call_index: 0,
            call_id: "c1".into(),
            tool: "issue_refund".into(),
            arguments: json!({"amount": 500}),
            arguments_hash: "h".into(),
            reason: None,
            observations: vec![],
            dependencies: vec![],
            gate: Gate {
                rule: "big-refunds".into(),
                ..Gate::default()
            },
            escalation: 0,
            alternative: None,
            kind: v1::ApprovalKind::Call,
            intent_seq: None,
        };
        let decided = ApprovalDecided {
            request_seq: 2,
            approval: "r-a2".into(),
            verdict: Verdict::Approve,
            decisions: vec![
                RecordedDecision {
                    approver: "bob".into(),
                    verdict: v1::Verdict::Approve,
                    arguments_hash: "h".into(),
                    arguments: None,
                    reason: Some("checked \u{1b}[2K".into()),
                },
                RecordedDecision {
                    approver: "carol".into(),
                    verdict: v1::Verdict::Edit,
                    arguments_hash: "h".into(),
                    arguments: Some(json!({"amount": 300})),
                    reason: None,
                },
            ],
            arguments: None,
            observations_hash: "o".into(),
            on_expiry: None,
        };
        let intent = ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: "c1".into(),
            tool: "issue_refund".into(),
            arguments: json!({"amount": 300}),
            key: "0123456789abcdef".into(),
            sandboxed: None,
        };
        let result = ToolResult {
            intent_seq: 4,
            call_id: "c1".into(),
            tool: "issue_refund".into(),
            outcome: v1::ToolOutcome::Ok(json!({"refunded": 300, "id": "rf-1"})),
            recovery: None,
        };
        let failed = ToolResult {
            outcome: v1::ToolOutcome::Failed {
                observation: "x".repeat(200),
            },
            ..result.clone()
        };
        let voided = ApprovalVoided {
            request_seq: 2,
            reason: "order-1042 changed".into(),
            dependencies: vec![],
        };
        let observation = Observation {
            text: "malformed reply".into(),
            about_seq: Some(1),
            stop: None,
            attempts: None,
        };
        let finished = RunFinished {
            outcome: Outcome::Succeeded,
            result: None,
            error: Some("no result".into()),
        };
        vec![
            stored(1, StepKind::ModelCall, typed(&model_call)),
            stored(2, StepKind::ApprovalRequested, typed(&requested)),
            stored(3, StepKind::ApprovalDecided, typed(&decided)),
            stored(4, StepKind::ToolIntent, typed(&intent)),
            stored(5, StepKind::ToolResult, typed(&result)),
            stored(6, StepKind::ToolResult, typed(&failed)),
            stored(7, StepKind::ApprovalVoided, typed(&voided)),
            stored(8, StepKind::Observation, typed(&observation)),
            stored(9, StepKind::ModelCall, typed(&answer)),
            stored(10, StepKind::RunFinished, typed(&finished)),
            // Not a ModelCall's payload: shown raw rather than guessed at.
            stored(11, StepKind::ModelCall, json!({"response": "cut"})),
        ]
    }

    #[test]
    fn audit_lines_describe_typed_records_and_show_the_rest_raw() {
        let lines: Vec<String> = audit_records().iter().map(audit_line).collect();
        let what: Vec<&str> = lines.iter().map(|l| &l[53..]).collect();
        assert_eq!(
            lines[0],
            format!(
                "{:>4} {:<18} {:<28} {}",
                1,
                "ModelCall",
                "p-0#2",
                r#"model gpt-x proposed issue_refund({"amount":500,"orderId":"1042"})"#
            )
        );
        assert_eq!(
            what,
            [
                r#"model gpt-x proposed issue_refund({"amount":500,"orderId":"1042"})"#,
                r#"approval requested for issue_refund({"amount":500}) by rule big-refunds"#,
                r"r-a2 Approve: bob Approve (checked \u{1b}[2K); carol Edit ()",
                r#"calling issue_refund({"amount":300}) key 0123456789ab"#,
                r#"issue_refund returned {"Ok":{"id":"rf-1","refunded":300}}"#,
                &format!(
                    r#"issue_refund returned {{"Failed":{{"observation":"{}…"#,
                    "x".repeat(73)
                ),
                "approval voided: order-1042 changed",
                r#"{"aboutSeq":1,"text":"malformed reply"}"#,
                "model gpt-x proposed an answer",
                "Succeeded: no result",
                r#"{"response":"cut"}"#,
            ]
        );
    }
}
