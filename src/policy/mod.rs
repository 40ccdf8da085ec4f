//! Which tool calls need a human decision (DESIGN.md section 5). Decided by
//! agentrun's code from the policy pinned in `RunStarted`, never by the
//! model; a condition that cannot be evaluated asks for approval (fail closed).

pub mod condition;
pub mod endpoint;
pub mod host;

use serde_json::Value;

use crate::api::{ApprovalPolicy, ApprovalRule, CallMatch, DefaultAction};
pub use crate::runlog::records::Gate;
use crate::runlog::v1;
pub use endpoint::Reading;
pub use host::Network;

/// What a call needs before it may run.
#[derive(Clone, Debug, PartialEq)]
pub enum Classification {
    Allow,
    RequireApproval(Box<Gate>),
}

/// A proposed call as the policy sees it: the name the model used, where
/// the call goes (from the pinned agent's tool declaration), what the
/// agent author claims about it, and the network it goes out on (where its
/// host's spellings and names lead).
#[derive(Clone, Debug, PartialEq)]
pub struct Call<'a> {
    pub name: &'a str,
    pub target: Target,
    /// The author's `readOnly`: honoured by the agent's own default only.
    pub author_read_only: bool,
    pub network: &'a Network,
}

/// Where a call goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// An HTTP tool's URL.
    Http(String),
    /// An MCP server and the tool name it is asked to run.
    Mcp { server: String, tool: String },
    /// No tool of that name (the call fails without reaching anything).
    Unknown,
}

impl<'a> Call<'a> {
    /// The call of `tool` as the agent declares it, made on `network`.
    pub fn of(agent: &crate::api::AgentTemplate, tool: &'a str, network: &'a Network) -> Call<'a> {
        let spec = agent.tools.iter().find(|t| t.name == tool);
        let target = match spec.map(|t| (&t.http, &t.mcp)) {
            Some((Some(h), _)) => Target::Http(h.url.clone()),
            Some((None, Some(m))) => Target::Mcp {
                server: m.url.clone(),
                tool: m.tool.clone().unwrap_or_else(|| tool.to_string()),
            },
            _ => Target::Unknown,
        };
        Call {
            name: tool,
            target,
            author_read_only: declared_read_only(agent, tool),
            network,
        }
    }

    /// A call to `name` known by name only (unit tests, unknown tools).
    pub fn named(name: &'a str, author_read_only: bool) -> Call<'a> {
        Call {
            name,
            target: Target::Unknown,
            author_read_only,
            network: &host::STATIC,
        }
    }
}

impl Target {
    /// The URL whose host the call reaches.
    fn url(&self) -> Option<&str> {
        match self {
            Target::Http(url) => Some(url),
            Target::Mcp { server, .. } => Some(server),
            Target::Unknown => None,
        }
    }
}

/// Does `m` select calls to `target` on `net`? `reading` says how doubtful
/// spellings count: `Any` for gates (over-match), `Every` for exemptions.
pub fn selects(m: &CallMatch, target: &Target, reading: Reading, net: &Network) -> bool {
    match target {
        Target::Http(url) => m
            .endpoints
            .iter()
            .any(|e| endpoint::within(url, &e.url, reading, net)),
        Target::Mcp { server, tool } => m.mcp.iter().any(|e| {
            endpoint::within(server, &e.server, reading, net)
                && e.tool
                    .as_deref()
                    .is_none_or(|t| endpoint::same_tool(tool, t, reading))
        }),
        Target::Unknown => false,
    }
}

/// The host names whose addresses can decide how `policy` classifies a
/// call to `target` from `namespace`: the call's own and those of the
/// rules' endpoints it could lie under (same port and path). The step pod
/// looks them up once, matches on what they resolved to and connects to
/// exactly those addresses.
pub fn lookups(policy: Option<&ApprovalPolicy>, target: &Target, namespace: &str) -> Vec<String> {
    let (Some(policy), Some(url)) = (policy, target.url()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = Vec::new();
    let entries = policy.rules.iter().filter_map(|r| r.selector.as_ref());
    for m in entries {
        let prefixes = match target {
            Target::Http(_) => m
                .endpoints
                .iter()
                .map(|e| e.url.as_str())
                .collect::<Vec<_>>(),
            _ => m.mcp.iter().map(|e| e.server.as_str()).collect(),
        };
        for prefix in prefixes {
            for name in endpoint::lookups(url, prefix, namespace) {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
    }
    names
}

/// Classifies a proposed call. Rules select by name and, for platform
/// rules, by endpoint; the defaults decide what no rule matched.
pub fn classify(policy: Option<&ApprovalPolicy>, call: &Call<'_>, args: &Value) -> Classification {
    let Some(policy) = policy else {
        return Classification::Allow;
    };
    let tool = call.name;
    if tool == crate::tools::FINISH_TOOL {
        return Classification::Allow;
    }
    for rule in &policy.rules {
        if rule.tool != tool && rule.tool != "*" {
            continue;
        }
        if let Some(m) = &rule.selector
            && !selects(m, &call.target, Reading::Any, call.network)
        {
            continue;
        }
        let because = match &rule.when {
            None => every_call(rule, call),
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
    match default_gate(policy, call) {
        Some((rule, because)) => {
            let rule = ApprovalRule {
                name: rule,
                tool: tool.into(),
                approvers: policy.default_approvers.clone().unwrap_or_default(),
                required_approvals: 1,
                expires_after: "1h".into(),
                ..Default::default()
            };
            Classification::RequireApproval(Box::new(gate(policy, &rule, because)))
        }
        None => Classification::Allow,
    }
}

/// Why a rule without a condition gates the call, for the approver.
fn every_call(rule: &ApprovalRule, call: &Call<'_>) -> String {
    let reaches = match &call.target {
        Target::Http(url) => format!(" (it reaches {url})"),
        Target::Mcp { server, tool } => format!(" (it runs {tool} on {server})"),
        Target::Unknown => String::new(),
    };
    match (&rule.selector, rule.tool.as_str()) {
        (Some(_), _) => format!(
            "rule {} applies to every call to the endpoints it names{reaches}",
            rule.name
        ),
        (None, "*") => format!("rule {} applies to every call", rule.name),
        (None, tool) => format!("rule {} applies to every {tool} call", rule.name),
    }
}

/// Whether a default action gates a call no rule matched: (rule name, why).
/// A platform's default believes only the platform's own `readOnly` list;
/// the agent's own default believes the agent's `readOnly`.
fn default_gate(policy: &ApprovalPolicy, call: &Call<'_>) -> Option<(String, String)> {
    let tool = call.name;
    let agent_action = match &policy.platform_default {
        Some(platform) => {
            let unlisted = platform.by.iter().find(|p| {
                !p.read_only
                    .as_ref()
                    .is_some_and(|m| selects(m, &call.target, Reading::Every, call.network))
            });
            if let Some(p) = unlisted {
                return Some((
                    format!("{}/default", p.policy),
                    format!(
                        "{tool} reaches an endpoint {} does not list as read-only, and it asks for approval \
                         of every other call (the agent's own readOnly does not count)",
                        p.policy
                    ),
                ));
            }
            platform.agent_action
        }
        None => policy.default_action,
    };
    (agent_action == DefaultAction::RequireApprovalForMutating && !call.author_read_only).then(
        || {
            (
                "default".into(),
                format!(
                    "{tool} is not declared read-only and the policy asks for approval of every such call"
                ),
            )
        },
    )
}

/// Who may say whether a call with an unknowable outcome happened: the gate
/// the policy puts on the call, else its default approvers (`None`: nobody is
/// named, and the run stops for a human). Nobody answering is never taken as
/// either answer, so the gate always fails on expiry.
pub fn reconcile_gate(
    policy: Option<&ApprovalPolicy>,
    call: &Call<'_>,
    args: &Value,
) -> Option<Gate> {
    let call = Call {
        author_read_only: false,
        ..call.clone()
    };
    let mut gate = match classify(policy, &call, args) {
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
                notify_format: p.notify_format.map(Into::into),
            }
        }
    };
    gate.on_expiry = v1::OnExpiry::Fail;
    Some(gate)
}

/// The gate of a budget question (`budgets.onExhausted: Ask`): the
/// budget's approvers and quorum, the agent's separation of duties and
/// webhook. Expiry ends the run (it never raises a budget).
pub fn budget_gate(agent: &crate::api::AgentTemplate) -> Option<Gate> {
    let budgets = agent
        .budgets
        .as_ref()
        .filter(|b| b.on_exhausted == crate::api::OnExhausted::Ask)?;
    let policy = agent.approval.as_ref();
    Some(Gate {
        rule: "budgets".into(),
        because: "a budget is used up and the agent asks before going on".into(),
        approvers: budgets.approvers.clone()?.into(),
        required_approvals: budgets.required_approvals.unwrap_or(1).max(1),
        expires_after: budgets.expires_after.clone().unwrap_or_else(|| "1h".into()),
        on_expiry: v1::OnExpiry::Fail,
        escalate_to: None,
        max_escalations: 1,
        dependencies: Vec::new(),
        separation_of_duties: policy.is_some_and(|p| p.separation_of_duties),
        notify_webhook: policy.and_then(|p| p.notify_webhook.clone()),
        notify_format: policy.and_then(|p| p.notify_format.map(Into::into)),
    })
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
        notify_format: policy.notify_format.map(Into::into),
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

/// Key under which an agent may propose a safe alternative next to a risky call.
pub const ALTERNATIVE_KEY: &str = "_alternative";
/// Splits the agent's proposed alternative off the call's arguments.
pub fn split_alternative(args: &Value) -> (Value, Option<Value>) {
    match args {
        Value::Object(map) if map.contains_key(ALTERNATIVE_KEY) => {
            let mut map = map.clone();
            let alternative = map.remove(ALTERNATIVE_KEY);
            (Value::Object(map), alternative)
        }
        other => (other.clone(), None),
    }
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
            classify(
                Some(&p),
                &Call::named("issue_refund", false),
                &json!({"amount": 40})
            ),
            Classification::Allow
        );
        match classify(
            Some(&p),
            &Call::named("issue_refund", false),
            &json!({"amount": 500}),
        ) {
            Classification::RequireApproval(g) => {
                assert_eq!((g.rule.as_str(), g.required_approvals), ("large-refund", 2));
                assert!(g.because.contains("args.amount > 100"));
            }
            other => panic!("{other:?}"),
        }
        // Floats and ints compare alike.
        assert!(matches!(
            classify(
                Some(&p),
                &Call::named("issue_refund", false),
                &json!({"amount": 100.5})
            ),
            Classification::RequireApproval(_)
        ));
    }

    #[test]
    fn other_tools_and_finish_pass_and_no_policy_allows() {
        let p = policy(None);
        assert_eq!(
            classify(Some(&p), &Call::named("lookup_order", false), &json!({})),
            Classification::Allow
        );
        assert_eq!(
            classify(Some(&p), &Call::named("finish", false), &json!({})),
            Classification::Allow
        );
        assert_eq!(
            classify(
                None,
                &Call::named("issue_refund", false),
                &json!({"amount": 1e9})
            ),
            Classification::Allow
        );
        assert!(matches!(
            classify(Some(&p), &Call::named("issue_refund", false), &json!({})),
            Classification::RequireApproval(_)
        ));
    }

    #[test]
    fn a_condition_that_cannot_be_evaluated_asks() {
        let p = policy(Some("args.amount > 100"));
        match classify(
            Some(&p),
            &Call::named("issue_refund", false),
            &json!({"orderId": "1"}),
        ) {
            Classification::RequireApproval(g) => assert!(
                g.because.contains("could not be evaluated"),
                "{}",
                g.because
            ),
            other => panic!("a missing field must not let the call through: {other:?}"),
        }
        let broken = policy(Some("args.amount >"));
        assert!(matches!(
            classify(
                Some(&broken),
                &Call::named("issue_refund", false),
                &json!({"amount": 1})
            ),
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
            classify(Some(&p), &Call::named("lookup_order", true), &json!({})),
            Classification::Allow
        );
        assert!(
            matches!(classify(Some(&p), &Call::named("delete_account", false), &json!({})), Classification::RequireApproval(g) if g.rule == "default")
        );
    }

    #[test]
    fn a_reconcile_gate_always_fails_on_expiry_and_needs_someone_named() {
        let mut p = policy(None);
        p.rules[0].on_expiry = OnExpiry::Alternative;
        let g = reconcile_gate(Some(&p), &Call::named("issue_refund", false), &json!({})).unwrap();
        assert_eq!(
            (g.rule.as_str(), g.on_expiry),
            ("large-refund", v1::OnExpiry::Fail)
        );
        assert_eq!(
            reconcile_gate(Some(&p), &Call::named("page", false), &json!({})),
            None
        );
        p.default_approvers = Some(Approvers {
            users: vec!["oncall".into()],
            groups: vec![],
        });
        let g = reconcile_gate(Some(&p), &Call::named("page", false), &json!({})).unwrap();
        assert_eq!(
            (g.rule.as_str(), g.on_expiry),
            ("reconcile", v1::OnExpiry::Fail)
        );
        assert_eq!(
            reconcile_gate(None, &Call::named("page", false), &json!({})),
            None
        );
    }
}
