//! `Approval`: a risky tool call waiting for a human decision.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::Approvers;
use super::common::OnExpiry;

/// An Approval holds a proposed tool call, exactly as it will execute, until
/// enough approvers decide or it expires. The controller creates it (owned by
/// its AgentRun); approvers only add their own entry to `spec.decisions`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "Approval",
    namespaced,
    status = "ApprovalStatus",
    shortname = "apr",
    category = "agentrun-all",
    printcolumn = r#"{"name":"Run","type":"string","jsonPath":".spec.runRef.name"}"#,
    printcolumn = r#"{"name":"Tool","type":"string","jsonPath":".spec.tool"}"#,
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Expires","type":"date","jsonPath":".spec.expiresAt"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.onExpiry != 'Escalate' || has(self.escalateTo)",
     "message": "spec.escalateTo is required when spec.onExpiry is Escalate"},
    {"rule": "self.requiredApprovals <= 1 || (has(self.approvers.groups) && size(self.approvers.groups) > 0) || (has(self.approvers.users) && self.requiredApprovals <= size(self.approvers.users))",
     "message": "spec.requiredApprovals cannot exceed the number of listed approvers"}
]))]
pub struct ApprovalSpec {
    /// The run that proposed the call.
    pub run_ref: RunRef,
    /// Sequence number of the `ApprovalRequested` record in the run's log.
    #[schemars(range(min = 0))]
    pub step: u64,
    /// Kind of decision asked for.
    #[serde(default)]
    pub kind: ApprovalKind,
    /// Name of the policy rule that raised it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Tool to be called.
    #[schemars(length(min = 1))]
    pub tool: String,
    /// Arguments exactly as they will be executed.
    #[schemars(schema_with = "crate::api::common::any_json")]
    pub arguments: serde_json::Value,
    /// sha256 of the canonical JSON of tool name plus arguments; every
    /// decision must quote it.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub arguments_hash: String,
    /// What the approver needs to judge the call.
    #[serde(default)]
    pub observations: Observations,
    /// Versions of the records the call depends on, read when it was raised.
    #[serde(default)]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub dependencies: Vec<DependencyVersion>,
    /// Who may decide.
    pub approvers: Approvers,
    /// Distinct approvals needed (N of M); any reject rejects.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 10))]
    pub required_approvals: u32,
    /// The user who created the run; with `separationOfDuties` they may not decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<String>,
    /// The requester may not approve their own run.
    #[serde(default)]
    pub separation_of_duties: bool,
    /// When the request expires. Expiry never approves.
    pub expires_at: Time,
    /// What happens at expiry.
    #[serde(default)]
    pub on_expiry: OnExpiry,
    /// Approvers of the escalated request (for `onExpiry: Escalate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate_to: Option<Approvers>,
    /// How many times this request was escalated before (0 for the first request).
    #[serde(default)]
    pub escalation: u32,
    /// The safe alternative the agent proposed (for `onExpiry: Alternative`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alternative: Option<ProposedCall>,
    /// Decisions, one per approver. The only field approvers write.
    #[serde(default)]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["approver"],
        "maxItems" = 20
    ))]
    pub decisions: Vec<Decision>,
}

fn one() -> u32 {
    1
}

/// The run an Approval belongs to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunRef {
    /// AgentRun name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// AgentRun uid: the key of its log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// What an approval asks for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ApprovalKind {
    /// May this call run?
    #[default]
    Call,
    /// A call crashed with an unknown outcome: did it happen?
    Reconcile,
    /// A budget is used up (`budgets.onExhausted: Ask`): may the run go on
    /// with the limits in `arguments`? `tool` is `budget`; an edit gives
    /// other limits, a reject ends the run `BudgetExceeded`.
    Budget,
}

/// The `tool` of an Approval of kind `Budget`.
pub const BUDGET_TOOL: &str = "budget";

/// The JSON schema of a `Budget` Approval's arguments: the limits the run
/// goes on with (each at least the one exhausted; absent = unchanged).
pub fn budget_arguments_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "maxSteps": {"type": "integer", "minimum": 1,
                         "description": "Maximum number of steps (records in the log)"},
            "maxTokens": {"type": "integer", "minimum": 1,
                          "description": "Maximum input plus output tokens"},
            "maxCostUSD": {"type": "number", "exclusiveMinimum": 0,
                           "description": "Maximum cost in US dollars"}
        }
    })
}

/// A tool call as proposed by the agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProposedCall {
    /// Tool name.
    pub tool: String,
    /// Arguments.
    #[schemars(schema_with = "crate::api::common::any_json")]
    pub arguments: serde_json::Value,
}

/// What the approver sees besides the call itself.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Observations {
    /// Why the agent asks, in its own words: written by the run's step
    /// pod and not checked by the controller (what the controller checked
    /// is the rest of this spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Recent tool results the call depends on.
    #[serde(default)]
    #[schemars(length(max = 10))]
    pub recent_results: Vec<ObservedResult>,
}

/// A tool result shown to the approver.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObservedResult {
    /// Log sequence number of the result.
    pub seq: u64,
    /// Tool that produced it.
    pub tool: String,
    /// The result, abbreviated if long.
    pub summary: String,
}

/// Version of a record the call depends on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DependencyVersion {
    /// Dependency name from the policy rule.
    pub name: String,
    /// Version read when the request was raised.
    pub version: String,
}

/// An approver's verdict.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Verdict {
    /// Run the call as proposed.
    Approve,
    /// Do not run it; the reason goes back to the agent.
    Reject,
    /// Run it with the arguments given in the decision.
    Edit,
}

/// One approver's decision.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.verdict != 'Edit' || has(self.arguments)",
     "message": "spec.decisions[].arguments is required when verdict is Edit"},
    {"rule": "self.verdict == 'Edit' || !has(self.arguments)",
     "message": "spec.decisions[].arguments is only allowed when verdict is Edit"}
]))]
pub struct Decision {
    /// The deciding user; must be the user making the request.
    #[schemars(length(min = 1))]
    pub approver: String,
    /// `Approve`, `Reject` or `Edit`.
    pub verdict: Verdict,
    /// Must equal `spec.argumentsHash`: the decision is about these exact arguments.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub arguments_hash: String,
    /// Replacement arguments, for `Edit` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::api::common::any_json")]
    pub arguments: Option<serde_json::Value>,
    /// Why; shown to the agent on reject and edit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2000))]
    pub reason: Option<String>,
}

/// State of an Approval.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ApprovalState {
    /// Waiting for decisions.
    #[default]
    Pending,
    /// Enough approvals.
    Approved,
    /// Approved with edited arguments.
    Edited,
    /// Someone rejected.
    Rejected,
    /// Nobody decided in time.
    Expired,
    /// Expired and passed on to `escalateTo`.
    Escalated,
    /// The records it depended on changed before the call ran.
    Voided,
}

/// Observed state of an Approval.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalStatus {
    /// Decision state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ApprovalState>,
    /// Approvers whose decisions counted.
    #[serde(default)]
    pub decided_by: Vec<String>,
    /// When the decision became final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<Time>,
    /// Conditions (`Decided`).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
