//! `AgentPolicy` (namespaced) and `ClusterAgentPolicy` (cluster-scoped): what
//! platform owners decide for every run, whatever its Agent says. Only they
//! should be able to write these (grant no namespace user write access).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::agent::{ApprovalRule, DefaultAction};
use super::common::Approvers;

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

/// Approval rules a platform owner imposes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlatformApproval {
    /// Rules, first match wins; checked before the agent's rules.
    #[serde(default)]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub rules: Vec<ApprovalRule>,
    /// Calls no rule (platform or agent) matches: `RequireApprovalForMutating`
    /// here overrides an agent's `Allow`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_action: Option<DefaultAction>,
    /// Approvers for calls caught by `defaultAction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_approvers: Option<Approvers>,
    /// The user who created a run may not approve its calls, whatever the agent says.
    #[serde(default)]
    pub separation_of_duties: bool,
}

/// A Secret runs may use, and where its value may be sent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedSecret {
    /// Name of the Secret in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// URL prefixes the model endpoint must start with to receive it (e.g.
    /// `https://api.openai.com/`); any endpoint when empty.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub endpoints: Vec<String>,
}
