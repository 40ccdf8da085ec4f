//! `AgentPolicy` (namespaced) and `ClusterAgentPolicy` (cluster-scoped): what
//! platform owners decide for every run, whatever its Agent says. Only they
//! should be able to write these (grant no namespace user write access).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Approvers, DURATION_RULE, DefaultAction, Dependency, OnExpiry};

/// An AgentPolicy is the platform owner's word on the runs of its namespace:
/// approval rules that apply to every run whatever its Agent says, whether
/// runs may carry their agent inline, and which Secrets runs may hand to
/// their step pods (no other Secret ever reaches one). Pinned in a run's log
/// when it starts, like its agent.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "AgentPolicy",
    namespaced,
    shortname = "agp",
    category = "agentrun-all",
    printcolumn = r#"{"name":"Forbid-Inline","type":"boolean","jsonPath":".spec.forbidInlineAgents"}"#,
    printcolumn = r#"{"name":"Separation","type":"boolean","jsonPath":".spec.approval.separationOfDuties"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AgentPolicySpec {
    /// Approval rules checked before the agent's own, for every run here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<PlatformApproval>,
    /// Refuse runs that carry their agent inline (`spec.agent`): every run
    /// must name an Agent the platform can review.
    #[serde(default)]
    pub forbid_inline_agents: bool,
    /// Secrets of this namespace that runs may give their step pods (as the
    /// model's API key). A run naming any other Secret is refused.
    #[serde(default)]
    #[schemars(length(max = 64), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub allowed_secrets: Vec<AllowedSecret>,
}

/// A cluster-wide AgentPolicy: its approval rules and `forbidInlineAgents`
/// apply to the runs of every namespace (it lists no Secrets: those belong
/// to a namespace's AgentPolicy).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "ClusterAgentPolicy",
    shortname = "cagp",
    category = "agentrun-all",
    printcolumn = r#"{"name":"Forbid-Inline","type":"boolean","jsonPath":".spec.forbidInlineAgents"}"#,
    printcolumn = r#"{"name":"Separation","type":"boolean","jsonPath":".spec.approval.separationOfDuties"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterAgentPolicySpec {
    /// Approval rules checked before any namespace's and any agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<PlatformApproval>,
    /// Refuse runs that carry their agent inline, in every namespace.
    #[serde(default)]
    pub forbid_inline_agents: bool,
}

/// Approval rules a platform owner imposes. They select calls by what the
/// platform owner can see and trust, the endpoint a call reaches, never by
/// what the agent author calls the tool or says about it (DESIGN.md section 5).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlatformApproval {
    /// Rules, first match wins; checked before the agent's rules.
    #[serde(default)]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub rules: Vec<PlatformRule>,
    /// Calls no rule (platform or agent) matches: `RequireApprovalForMutating`
    /// here overrides an agent's `Allow`, and only the calls listed in
    /// `readOnly` count as read-only (an agent's own `readOnly` does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_action: Option<DefaultAction>,
    /// Approvers for calls caught by `defaultAction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_approvers: Option<Approvers>,
    /// The endpoints this platform owner knows modify nothing: the only calls
    /// `defaultAction: RequireApprovalForMutating` lets through unasked. A
    /// call's host must be a spelling of one listed here; what a name
    /// resolves to never widens this list (docs/endpoints.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<CallMatch>,
    /// The user who created a run may not approve its calls, whatever the agent says.
    #[serde(default)]
    pub separation_of_duties: bool,
}

/// A platform rule making matching calls wait for a human decision.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.onExpiry != 'Escalate' || has(self.escalateTo)",
     "message": "spec.approval.rules[].escalateTo is required when onExpiry is Escalate"}
]))]
pub struct PlatformRule {
    /// Rule name, shown on the Approvals it raises.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Deprecated: only `*` is accepted. Tool names are chosen by agent
    /// authors, so a platform rule cannot rely on them; select calls with
    /// `match`. A rule stored before this check with another name is applied
    /// to every call (fail closed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self == '*'",
        "message": "spec.approval.rules[].tool: a platform rule cannot select calls by tool name, which the agent author chooses; select them with match.endpoints or match.mcp (or use '*' for every call)"
    }]))]
    pub tool: Option<String>,
    /// The calls the rule applies to, by endpoint; every call when omitted.
    #[serde(rename = "match", default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<CallMatch>,
    /// Optional CEL condition over the call's arguments, e.g. `args.amount > 100`
    /// (at most 1024 bytes, 16 levels of nesting and 64 operators).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub when: Option<String>,
    /// Who may decide.
    pub approvers: Approvers,
    /// Distinct approvals needed (N of M); any reject rejects.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 10))]
    pub required_approvals: u32,
    /// How long an Approval waits for its decision.
    #[serde(default = "one_hour")]
    #[schemars(length(max = 32), extend("x-kubernetes-validations" = [{
        "rule": DURATION_RULE,
        "message": "spec.approval.rules[].expiresAfter must be a positive duration such as 30m or 2h"
    }]))]
    pub expires_after: String,
    /// What happens when nobody decides in time.
    #[serde(default)]
    pub on_expiry: OnExpiry,
    /// Approvers of the escalated Approval (required for `onExpiry: Escalate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate_to: Option<Approvers>,
    /// How many times a request may be escalated before it fails.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 10))]
    pub max_escalations: u32,
    /// Read-only lookups whose answers the call depends on; re-read before an
    /// approved call runs, and a changed answer voids the approval.
    #[serde(default)]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub dependencies: Vec<Dependency>,
}

fn one() -> u32 {
    1
}

fn one_hour() -> String {
    "1h".into()
}

/// Calls selected by where they go: an HTTP tool's URL, or an MCP server and
/// the tool name that server is asked to run. URLs are compared normalized:
/// the host by the place it leads to (every loopback spelling is one host; a
/// Service's short names, full name and ClusterIP are one; a rule also
/// matches a name the step pod resolves to its address), the port exactly,
/// the path segment by segment with `.`, `..` and percent-encoding resolved
/// first, so no spelling of the same endpoint escapes a rule. What to write
/// for an in-cluster Service: docs/endpoints.md.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.endpoints) && size(self.endpoints) > 0) || (has(self.mcp) && size(self.mcp) > 0)",
    "message": "match must list at least one entry in endpoints or mcp"
}]))]
pub struct CallMatch {
    /// HTTP tools whose URL is at or below one of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub endpoints: Vec<EndpointMatch>,
    /// MCP tools of these servers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub mcp: Vec<McpMatch>,
}

/// An HTTP endpoint, with every path below it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointMatch {
    /// URL prefix, e.g. `https://pay.example/refunds` (scheme, host, port and
    /// path; no query or fragment). For an in-cluster Service write
    /// `http://<svc>.<ns>:<port>/<path>` or its full name
    /// `<svc>.<ns>.svc.cluster.local`; which spellings, addresses and aliases
    /// then match, in a rule and in `readOnly`: docs/endpoints.md.
    #[schemars(length(min = 1, max = 2048), extend("x-kubernetes-validations" = [{
        "rule": "(self.startsWith('http://') || self.startsWith('https://')) && !self.contains('?') && !self.contains('#')",
        "message": "match.endpoints[].url must be an http:// or https:// URL without query or fragment"
    }]))]
    pub url: String,
}

/// Tools of an MCP server.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct McpMatch {
    /// URL of the MCP server (matched like `endpoints[].url`, docs/endpoints.md).
    #[schemars(length(min = 1, max = 2048), extend("x-kubernetes-validations" = [{
        "rule": "(self.startsWith('http://') || self.startsWith('https://')) && !self.contains('?') && !self.contains('#')",
        "message": "match.mcp[].server must be an http:// or https:// URL without query or fragment"
    }]))]
    pub server: String,
    /// The tool name the server is asked to run (its own name, not the
    /// agent's local name for it); every tool of the server when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub tool: Option<String>,
}

/// A Secret runs may use, and where its value may be sent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedSecret {
    /// Name of the Secret in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// URL prefixes the model endpoint must start with to receive it (e.g.
    /// `https://api.openai.com/`); any endpoint when empty. The host matches
    /// its spellings only (`localhost` for `127.0.0.1`, a Service's short
    /// names for its full name), never addresses it resolves to
    /// (docs/endpoints.md).
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub endpoints: Vec<String>,
}

/// What a run pins of the platform's `defaultAction: RequireApprovalForMutating`
/// (set by the controller only, never part of an Agent): who imposed it and
/// what each of them lists as read-only. Kept apart from the agent's own
/// default, which may trust the agent's `readOnly`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlatformDefault {
    /// The agent's own `defaultAction` (the pinned `defaultAction` is the
    /// stricter of both, so an older reader of the log still gates).
    pub agent_action: DefaultAction,
    /// Each platform policy that asks for approval of every mutating call.
    pub by: Vec<PlatformReadOnly>,
}

/// What the platform added to an agent's approval policy when the controller
/// pinned it (set by the controller only, never part of an Agent): a fork,
/// judged by the platform of its own day, takes exactly this off again
/// before today's platform is put on (DESIGN.md §11).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlatformAdded {
    /// How many of the pinned rules, first, are the platform's.
    pub rules: u32,
    /// The agent's own `separationOfDuties`.
    pub separation_of_duties: bool,
    /// The agent's own `defaultApprovers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_approvers: Option<Approvers>,
}

/// One platform policy's default and the calls it lets through as read-only.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlatformReadOnly {
    /// `AgentPolicy/<name>` or `ClusterAgentPolicy/<name>`.
    pub policy: String,
    /// Its `approval.readOnly`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<CallMatch>,
}
