//! Typed payloads of the step log's records (DESIGN.md section 3). The store
//! keeps them as JSON; these types are how the runner and the controller read
//! and write them. Field names are camelCase and stable: old logs must replay.
//! Everything a record embeds is a stored type of this module or of `v1`,
//! never an API, model or tools type (see `v1` for the rule).

use serde::{Deserialize, Serialize};

use super::v1;

/// Versions a run executes with; pinned in `RunStarted`, moved by `VersionChanged`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Versions {
    pub prompt_version: String,
    pub prompt_hash: String,
    pub model: String,
    pub tool_schema_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_generation: Option<i64>,
}

/// seq 0: the whole resolved agent, so replay never depends on today's Agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunStarted {
    pub run_name: String,
    pub namespace: String,
    pub input: String,
    pub agent: v1::AgentTemplate,
    /// Tool definitions as the model sees them (MCP schemas as discovered).
    pub tools: Vec<v1::ToolDef>,
    /// MCP tools as discovered at start: their schemas are pinned with the run.
    #[serde(default)]
    pub mcp: v1::McpCatalog,
    pub versions: Versions,
    /// A container agent's container (format 2): the agent is this image,
    /// `agent.prompt` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<super::v2::Container>,
}

impl RunStarted {
    /// The agent the run started with, its container (if any) in place.
    pub fn agent_template(&self) -> crate::api::AgentTemplate {
        with_container(self.agent.clone(), self.container.clone())
    }
}

/// A stored template with its stored container, as the API has them.
fn with_container(
    agent: v1::AgentTemplate,
    container: Option<super::v2::Container>,
) -> crate::api::AgentTemplate {
    let mut agent: crate::api::AgentTemplate = agent.into();
    agent.container = container.map(Into::into);
    agent
}

/// A later snapshot, for `versionPolicy: FollowLatest`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VersionChanged {
    pub agent: v1::AgentTemplate,
    pub tools: Vec<v1::ToolDef>,
    #[serde(default)]
    pub mcp: v1::McpCatalog,
    pub from: Versions,
    pub to: Versions,
    /// The container agent's container from now on (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<super::v2::Container>,
}

impl VersionChanged {
    /// The agent the run goes on with, its container (if any) in place.
    pub fn agent_template(&self) -> crate::api::AgentTemplate {
        with_container(self.agent.clone(), self.container.clone())
    }
}

/// What a model call was built from, so an auditor can tell what the model saw.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContextInfo {
    /// seq of the `Summary` the context started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary_seq: Option<u64>,
    /// Records from this seq on were sent verbatim.
    pub from_seq: u64,
    pub estimated_tokens: u64,
}

/// The HTTP attempts one model call took. The retries happen inside the
/// step process, which is gone before anything scrapes it: recorded with the
/// answer (or the failure), the controller counts them when it reads the log
/// (`agentrun_model_attempts_total`). Absent from records written before
/// attempts were recorded, and where no request was sent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ModelAttempts {
    /// The wire format asked: `OpenAI` or `Anthropic` (as in the agent's spec).
    pub provider: String,
    /// How each attempt ended, in order: `ok`, `malformed`, `3xx`, `4xx`,
    /// `429`, `5xx`, `timeout`, `transport`.
    pub outcomes: Vec<String>,
}

/// The model's answer, recorded before anything acts on it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelCall {
    pub response: v1::ModelResponse,
    pub cost_usd: f64,
    pub context: ContextInfo,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<ModelAttempts>,
    /// A container agent's request this answers (format 2; none for a
    /// built-in agent, whose request the log's own records make).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<super::v2::WireRequest>,
}

/// A tool call about to be made, with the key that makes repeating it safe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ToolIntent {
    pub model_call_seq: u64,
    pub call_index: usize,
    pub call_id: String,
    pub tool: String,
    pub arguments: serde_json::Value,
    pub key: String,
    /// A container agent's request this call answers: the digest of the
    /// tool and the arguments as the agent sent them (an approver's edit
    /// changes `arguments`, not what the agent asks again on replay).
    /// Format 2; none for a built-in agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<String>,
    /// A replay test's call (`crate::sandbox`): never made, answered from
    /// the recorded run's call this names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxed: Option<Sandboxed>,
}

/// Which recorded call answers a replay test's call, and whether the new
/// version's policy would have asked a human about it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Sandboxed {
    /// Its index in the `Forked` record's `test.calls`.
    pub recorded: usize,
    pub gated: bool,
}

/// How an intent found without a result was settled.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// An idempotent tool was called again with the same key.
    RetriedWithSameKey,
    /// A non-idempotent tool's lookup said the call had happened.
    LookupFoundResult,
    /// A non-idempotent tool's lookup said it had not happened; it was made now.
    LookupFoundNothing,
    /// The outcome could not be known; a human confirmed the call had happened.
    HumanConfirmedDone,
    /// The outcome could not be known; a human said it had not; it was made now.
    HumanConfirmedNotDone,
}

/// The outcome of a tool call.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ToolResult {
    pub intent_seq: u64,
    pub call_id: String,
    pub tool: String,
    pub outcome: v1::ToolOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
}

/// A compaction: the text replaces every record up to `through_seq` in later contexts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub text: String,
    pub through_seq: u64,
    pub response: v1::ModelResponse,
    pub cost_usd: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<ModelAttempts>,
}

/// Something the model must be told (a malformed reply, a refused call...),
/// or, with `stop`, why the step runner cannot go on: only the controller
/// records `RunFinished`, so the runner asks for the end it must report.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Observation {
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub about_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<RunFinished>,
    /// The model call this observes the failure of (a malformed reply, a
    /// refusal, an outage), when it is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<ModelAttempts>,
}

/// How a run ended.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    BudgetExceeded,
    DeadlineExceeded,
    Cancelled,
    /// A tool call's outcome cannot be known; a human must reconcile it.
    NeedsHuman,
    /// A container agent sent a request its log holds no answer for while
    /// recorded answers remained: it is not deterministic given its inputs
    /// (format 2: an earlier release does not read it).
    Diverged,
}

impl Outcome {
    /// The run's phase this outcome means (what its status shows, and what
    /// a reader of the log alone can tell).
    pub fn phase(self) -> crate::api::Phase {
        use crate::api::Phase;
        match self {
            Outcome::Succeeded => Phase::Succeeded,
            Outcome::Failed | Outcome::NeedsHuman | Outcome::Diverged => Phase::Failed,
            Outcome::BudgetExceeded => Phase::BudgetExceeded,
            Outcome::DeadlineExceeded => Phase::DeadlineExceeded,
            Outcome::Cancelled => Phase::Cancelled,
        }
    }
}

/// The last record of a run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunFinished {
    pub outcome: Outcome,
    /// The final answer, or the partial result when stopped early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A proposed call that a human must decide, with everything the approver sees.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRequested {
    pub model_call_seq: u64,
    pub call_index: usize,
    pub call_id: String,
    pub tool: String,
    /// Arguments exactly as they will execute.
    pub arguments: serde_json::Value,
    /// sha256 of the canonical JSON of `{"tool": ..., "arguments": ...}`.
    pub arguments_hash: String,
    /// The agent's stated reason (its words next to the call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Recent tool results the call may depend on.
    #[serde(default)]
    pub observations: Vec<v1::ObservedResult>,
    /// Versions of the declared dependencies, read now.
    #[serde(default)]
    pub dependencies: Vec<v1::DependencyVersion>,
    pub gate: Gate,
    /// 0 for the first request, n for the n-th escalation.
    #[serde(default)]
    pub escalation: u32,
    /// The safe alternative the agent proposed (`_alternative` in its arguments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alternative: Option<serde_json::Value>,
    /// `Call` (may it run?) or `Reconcile` (did the intent at `intentSeq` happen?).
    #[serde(default)]
    pub kind: v1::ApprovalKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent_seq: Option<u64>,
}

/// The verdict on a request.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Approve,
    Edit,
    Reject,
    /// Nobody decided in time (`onExpiry` says what follows).
    Expired,
}

/// One approver's decision, as the controller read it from the Approval.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedDecision {
    pub approver: String,
    pub verdict: v1::Verdict,
    pub arguments_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The decision on the request at `request_seq`, appended by the controller.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalDecided {
    pub request_seq: u64,
    /// The Approval object the decisions were read from.
    pub approval: String,
    pub verdict: Verdict,
    /// Every decision that counted, with who, what and which hash.
    pub decisions: Vec<RecordedDecision>,
    /// Arguments to execute (Approve: as requested; Edit: as edited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<serde_json::Value>,
    /// Hash of the observations the approvers were shown.
    pub observations_hash: String,
    /// For `Expired`: what the policy said to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_expiry: Option<v1::OnExpiry>,
}

impl ApprovalDecided {
    /// The call will never run and the agent is told so: rejected, or expired
    /// back to the agent (or to an alternative it did not give).
    pub fn settles_without_running(&self) -> bool {
        use v1::OnExpiry;
        match self.verdict {
            Verdict::Reject => true,
            Verdict::Expired => match self.on_expiry {
                Some(OnExpiry::ReturnToAgent) => true,
                Some(OnExpiry::Alternative) => self.arguments.is_none(),
                _ => false,
            },
            Verdict::Approve | Verdict::Edit => false,
        }
    }
}

/// An approval that no longer holds: a record it depended on changed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalVoided {
    pub request_seq: u64,
    pub reason: String,
    /// Dependency versions now (the request holds the old ones).
    #[serde(default)]
    pub dependencies: Vec<v1::DependencyVersion>,
}

/// The approval a call needs: who, how many, for how long, and what then.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Gate {
    /// The rule that matched (`default` for `defaultAction`).
    pub rule: String,
    /// Why the rule matched, for the approver.
    pub because: String,
    pub approvers: v1::Approvers,
    pub required_approvals: u32,
    pub expires_after: String,
    pub on_expiry: v1::OnExpiry,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate_to: Option<v1::Approvers>,
    pub max_escalations: u32,
    #[serde(default)]
    pub dependencies: Vec<v1::Dependency>,
    #[serde(default)]
    pub separation_of_duties: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_webhook: Option<String>,
    /// What `notify_webhook` receives (added within format 1, omitted when
    /// absent: the JSON event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_format: Option<v1::NotifyFormat>,
}

/// Written by the controller right after a fork's copied prefix (at
/// `seq + 1`): the records before it are the parent's `0..=seq`, copied
/// with their payloads unchanged and sealed again for the fork (DESIGN.md
/// "Forks"). Replay reads it as nothing to do: the fork goes on where the
/// parent stood at `seq`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Forked {
    /// The parent run's uid (its log's key).
    pub parent_uid: String,
    /// The parent run's name, in the fork's namespace.
    pub parent_name: String,
    /// The parent's last record copied.
    pub seq: u64,
    /// The parent's record hash at `seq`, as its chain holds it.
    pub parent_hash: String,
    /// Who forked (the fork's own requester, never the parent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<String>,
    /// What the fork's budgets count (`spec.forkOf.budget`). Absent in
    /// logs written before it existed: those count the copied prefix too
    /// (`Inherit`), so they replay as they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::api::ForkBudget>,
    /// What the copied prefix spent (with `FromFork`: what the fork's
    /// budgets do not count). Replay of the whole log sums it itself; a
    /// controller resuming from a checkpoint past this record holds no
    /// prefix to sum, so it is recorded (and `verify` checks it against
    /// the parent's records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_usage: Option<PrefixUsage>,
    /// The copied record replaced in the fork (`spec.forkOf.replace`):
    /// every other copied record is the parent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced: Option<Replaced>,
    /// Set on a replay test (`spec.testOf`, DESIGN.md §11): the run calls
    /// no tool and raises no approval; each call it proposes is answered
    /// from these, the parent's calls, or ends the test as diverged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test: Option<Sandbox>,
}

#[cfg(test)]
impl Forked {
    /// A fork's start after the parent's record `seq`, forked by carol; a
    /// replay test's with `test` (its recorded calls).
    pub(crate) fn after(seq: u64, test: Option<Sandbox>) -> Forked {
        Forked {
            parent_uid: "recorded".into(),
            parent_name: "refund-1".into(),
            seq,
            parent_hash: "00".into(),
            requester: Some("carol".into()),
            budget: None,
            prefix_usage: None,
            replaced: None,
            test,
        }
    }
}

/// Which copied record of a fork was replaced, by whom and why.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Replaced {
    pub seq: u64,
    /// The parent's record hash at `seq` (what was replaced).
    pub parent_hash: String,
    /// The fork's requester.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    pub reason: String,
}

/// Tokens and cost summed over a fork's copied prefix.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrefixUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(rename = "costUSD")]
    pub cost_usd: f64,
}

/// What a replay test answers calls from: the recorded run's calls, in the
/// order the model proposed them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub calls: Vec<RecordedCall>,
}

/// One call the recorded run's model proposed, and how it was settled.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedCall {
    /// The parent's ModelCall that proposed it, and the call's index there.
    pub model_call_seq: u64,
    pub call_index: usize,
    pub tool: String,
    /// As the model proposed them (what a new proposal is matched against).
    pub arguments: serde_json::Value,
    /// As made, when an approver edited them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made_with: Option<serde_json::Value>,
    /// What the model was told: the tool's result, or why it did not run.
    pub outcome: v1::ToolOutcome,
    /// Whether the recorded run's policy asked a human, and the verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Verdict>,
}

/// Why a call that needed approval did not run, as the model is told.
pub fn not_run_note(request: &ApprovalRequested, decided: &ApprovalDecided) -> String {
    match decided.verdict {
        Verdict::Reject => {
            let who: Vec<String> = decided
                .decisions
                .iter()
                .filter(|d| d.verdict == v1::Verdict::Reject)
                .map(|d| match &d.reason {
                    Some(r) => format!("{}: {r}", d.approver),
                    None => d.approver.clone(),
                })
                .collect();
            format!(
                "{} rejected by {}. The call did not run.",
                request.tool,
                who.join("; ")
            )
        }
        _ if decided.on_expiry == Some(v1::OnExpiry::Alternative)
            && request.alternative.is_some() =>
        {
            format!(
                "{} was not approved in time (the approval expired). Neither the call nor its alternative ran: \
                 the alternative needs approval too; propose it as a call of its own if it is still wanted.",
                request.tool
            )
        }
        _ => format!(
            "{} was not approved in time (the approval expired). The call did not run; choose another way.",
            request.tool
        ),
    }
}
