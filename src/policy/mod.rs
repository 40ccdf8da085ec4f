//! Which tool calls need a human decision (DESIGN.md section 5). Decided by
//! agentrun's code from the policy pinned in `RunStarted`, never by the
//! model; a condition that cannot be evaluated asks for approval (fail closed).

pub mod condition;

use serde_json::Value;

use crate::api::{ApprovalPolicy, ApprovalRule, DefaultAction};
pub use crate::runlog::records::Gate;
use crate::runlog::v1;

/// What a call needs before it may run.
#[derive(Clone, Debug, PartialEq)]
pub enum Classification {
    Allow,
    RequireApproval(Box<Gate>),
}

/// Classifies a proposed call. `read_only` is the tool's declaration (never a hint).
pub fn classify(
    policy: Option<&ApprovalPolicy>,
    tool: &str,
    args: &Value,
    read_only: bool,
) -> Classification {
    let Some(policy) = policy else {
        return Classification::Allow;
    };
    if tool == crate::runlog::replay::FINISH_TOOL {
        return Classification::Allow;
    }
    for rule in &policy.rules {
        if rule.tool != tool && rule.tool != "*" {
            continue;
        }
        let because = match &rule.when {
            None => format!("rule {} applies to every {tool} call", rule.name),
            Some(expr) => match evaluate(expr, args) {
                Ok(true) => format!("rule {}: {expr}", rule.name),
                Ok(false) => continue,
                Err(e) => format!(
                    "rule {}: condition {expr:?} could not be evaluated ({e}); asking to be safe",
                    rule.name
                ),
            },
        };
        return Classification::RequireApproval(Box::new(gate(policy, rule, because)));
    }
    if policy.default_action == DefaultAction::RequireApprovalForMutating && !read_only {
        let rule = ApprovalRule {
            name: "default".into(),
            tool: tool.into(),
            approvers: policy.default_approvers.clone().unwrap_or_default(),
            required_approvals: 1,
            expires_after: "1h".into(),
            ..Default::default()
        };
        let because = format!(
            "{tool} is not declared read-only and the policy asks for approval of every such call"
        );
        return Classification::RequireApproval(Box::new(gate(policy, &rule, because)));
    }
    Classification::Allow
}

/// Who may say whether a call with an unknowable outcome happened: the gate
/// the policy puts on the call, else its default approvers (`None`: nobody is
/// named, and the run stops for a human). Nobody answering is never taken as
/// either answer, so the gate always fails on expiry.
pub fn reconcile_gate(policy: Option<&ApprovalPolicy>, tool: &str, args: &Value) -> Option<Gate> {
    let mut gate = match classify(policy, tool, args, false) {
        Classification::RequireApproval(gate) => *gate,
        Classification::Allow => {
            let p = policy?;
            Gate {
                rule: "reconcile".into(),
                because: String::new(),
                approvers: p.default_approvers.clone()?.into(),
                required_approvals: 1,
                expires_after: "1h".into(),
                on_expiry: v1::OnExpiry::Fail,
                escalate_to: None,
                max_escalations: 1,
                dependencies: Vec::new(),
                separation_of_duties: p.separation_of_duties,
                notify_webhook: p.notify_webhook.clone(),
            }
        }
    };
    gate.on_expiry = v1::OnExpiry::Fail;
    Some(gate)
}

/// Whether the agent declares `tool` read-only (only HTTP tools can).
pub fn declared_read_only(agent: &crate::api::AgentTemplate, tool: &str) -> bool {
    agent
        .tools
        .iter()
        .find(|t| t.name == tool)
        .and_then(|t| t.http.as_ref())
        .is_some_and(|h| h.read_only)
}

fn gate(policy: &ApprovalPolicy, rule: &ApprovalRule, because: String) -> Gate {
    Gate {
        rule: rule.name.clone(),
        because,
        approvers: rule.approvers.clone().into(),
        required_approvals: rule.required_approvals.max(1),
        expires_after: rule.expires_after.clone(),
        on_expiry: rule.on_expiry.into(),
        escalate_to: rule.escalate_to.clone().map(Into::into),
        max_escalations: rule.max_escalations,
        dependencies: rule.dependencies.iter().cloned().map(Into::into).collect(),
        separation_of_duties: policy.separation_of_duties,
        notify_webhook: policy.notify_webhook.clone(),
    }
}

/// `sha256` of the canonical JSON of tool name plus arguments: what every
/// decision must quote, so a decision is about these exact arguments.
pub fn arguments_hash(tool: &str, args: &Value) -> String {
    let doc = serde_json::json!({"tool": tool, "arguments": args});
    crate::store::sha256_hex(&crate::store::canonical_json(&doc))
}

/// Evaluates a rule condition with the call's arguments bound to `args`.
/// Bounded in shape and evaluated off the caller's stack (see `condition`).
pub fn evaluate(expr: &str, args: &Value) -> Result<bool, String> {
    condition::evaluate(expr, args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Approvers, OnExpiry};
    use serde_json::json;

    fn policy(when: Option<&str>) -> ApprovalPolicy {
        ApprovalPolicy {
            rules: vec![ApprovalRule {
                name: "large-refund".into(),
                tool: "issue_refund".into(),
                when: when.map(str::to_string),
                approvers: Approvers {
                    users: vec![],
                    groups: vec!["finance-approvers".into()],
                },
                required_approvals: 2,
                expires_after: "30m".into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_condition_over_the_arguments_decides() {
        let p = policy(Some("args.amount > 100"));
        assert_eq!(
            classify(Some(&p), "issue_refund", &json!({"amount": 40}), false),
            Classification::Allow
        );
        match classify(Some(&p), "issue_refund", &json!({"amount": 500}), false) {
            Classification::RequireApproval(g) => {
                assert_eq!((g.rule.as_str(), g.required_approvals), ("large-refund", 2));
                assert!(g.because.contains("args.amount > 100"));
            }
            other => panic!("{other:?}"),
        }
        // Floats and ints compare alike.
        assert!(matches!(
            classify(Some(&p), "issue_refund", &json!({"amount": 100.5}), false),
            Classification::RequireApproval(_)
        ));
    }

    #[test]
    fn other_tools_and_finish_pass_and_no_policy_allows() {
        let p = policy(None);
        assert_eq!(
            classify(Some(&p), "lookup_order", &json!({}), false),
            Classification::Allow
        );
        assert_eq!(
            classify(Some(&p), "finish", &json!({}), false),
            Classification::Allow
        );
        assert_eq!(
            classify(None, "issue_refund", &json!({"amount": 1e9}), false),
            Classification::Allow
        );
        assert!(matches!(
            classify(Some(&p), "issue_refund", &json!({}), false),
            Classification::RequireApproval(_)
        ));
    }

    #[test]
    fn a_condition_that_cannot_be_evaluated_asks() {
        let p = policy(Some("args.amount > 100"));
        match classify(Some(&p), "issue_refund", &json!({"orderId": "1"}), false) {
            Classification::RequireApproval(g) => assert!(
                g.because.contains("could not be evaluated"),
                "{}",
                g.because
            ),
            other => panic!("a missing field must not let the call through: {other:?}"),
        }
        let broken = policy(Some("args.amount >"));
        assert!(matches!(
            classify(Some(&broken), "issue_refund", &json!({"amount": 1}), false),
            Classification::RequireApproval(_)
        ));
    }

    #[test]
    fn the_default_action_gates_mutating_calls_only() {
        let p = ApprovalPolicy {
            default_action: DefaultAction::RequireApprovalForMutating,
            ..Default::default()
        };
        assert_eq!(
            classify(Some(&p), "lookup_order", &json!({}), true),
            Classification::Allow
        );
        assert!(
            matches!(classify(Some(&p), "delete_account", &json!({}), false), Classification::RequireApproval(g) if g.rule == "default")
        );
    }

    #[test]
    fn a_reconcile_gate_always_fails_on_expiry_and_needs_someone_named() {
        let mut p = policy(None);
        p.rules[0].on_expiry = OnExpiry::Alternative;
        let g = reconcile_gate(Some(&p), "issue_refund", &json!({})).unwrap();
        assert_eq!(
            (g.rule.as_str(), g.on_expiry),
            ("large-refund", v1::OnExpiry::Fail)
        );
        assert_eq!(reconcile_gate(Some(&p), "page", &json!({})), None);
        p.default_approvers = Some(Approvers {
            users: vec!["oncall".into()],
            groups: vec![],
        });
        let g = reconcile_gate(Some(&p), "page", &json!({})).unwrap();
        assert_eq!(
            (g.rule.as_str(), g.on_expiry),
            ("reconcile", v1::OnExpiry::Fail)
        );
        assert_eq!(reconcile_gate(None, "page", &json!({})), None);
    }
}
