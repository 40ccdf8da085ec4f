//! `AgentRun`: one durable execution of an agent on a task.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::agent::AgentTemplate;
use super::common::{DURATION_RULE, LocalRef, Usage};

/// An AgentRun is one durable execution of an agent on a task. Its steps are
/// recorded in an external append-only log; the controller drives it with one
/// short-lived Job per step and pauses it for a human when a tool call is risky.
/// The controller never writes `spec`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "AgentRun",
    namespaced,
    status = "AgentRunStatus",
    shortname = "ar",
    category = "agentrun-all",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Step","type":"integer","jsonPath":".status.log.length"}"#,
    printcolumn = r#"{"name":"Waiting-On","type":"string","jsonPath":".status.waitingOn"}"#,
    printcolumn = r#"{"name":"Agent","type":"string","priority":1,"jsonPath":".spec.agentRef.name"}"#,
    printcolumn = r#"{"name":"Test-Of","type":"string","jsonPath":".spec.testOf.run"}"#,
    printcolumn = r#"{"name":"Cost","type":"number","priority":1,"jsonPath":".status.usage.costUSD"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.forkOf) || has(self.testOf) ? !has(self.agentRef) && !has(self.agent) : has(self.agentRef) != has(self.agent)",
     "message": "exactly one of spec.agentRef and spec.agent must be set, or neither on a fork (spec.forkOf: its agent is the parent's or spec.forkOf.agent) or a replay test (spec.testOf.agent)"},
    {"rule": "!(has(self.forkOf) && has(self.testOf))",
     "message": "spec.forkOf and spec.testOf cannot both be set: a replay test is not a fork that goes on live"},
    {"rule": "has(self.testOf) == has(oldSelf.testOf) && (!has(self.testOf) || self.testOf == oldSelf.testOf)",
     "message": "spec.testOf is immutable"},
    {"rule": "!has(self.forkOf) || !has(self.forkOf.replace) || self.forkOf.replace.seq <= self.forkOf.seq",
     "message": "spec.forkOf.replace.seq must be at or before spec.forkOf.seq: only a copied record can be replaced"},
    {"rule": "has(self.forkOf) == has(oldSelf.forkOf) && (!has(self.forkOf) || self.forkOf == oldSelf.forkOf)",
     "message": "spec.forkOf is immutable: a fork never moves to another parent or seq"},
    {"rule": "self.input == oldSelf.input",
     "message": "spec.input is immutable: start a new AgentRun for a new task"},
    {"rule": "has(self.agentRef) == has(oldSelf.agentRef) && (!has(self.agentRef) || self.agentRef == oldSelf.agentRef)",
     "message": "spec.agentRef is immutable: a run never moves to another Agent (and its policy) under way"},
    {"rule": "has(self.agent) == has(oldSelf.agent) && (!has(self.agent) || self.agent == oldSelf.agent)",
     "message": "spec.agent is immutable: the creator of a run cannot rewrite the agent (and its policy) under way"},
    {"rule": "has(self.versionPolicy) == has(oldSelf.versionPolicy) && (!has(self.versionPolicy) || self.versionPolicy == oldSelf.versionPolicy)",
     "message": "spec.versionPolicy is immutable"}
]))]
pub struct AgentRunSpec {
    /// The Agent (same namespace) this run executes. Exactly one of
    /// `agentRef` and `agent` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_ref: Option<LocalRef>,
    /// An inline agent definition, instead of `agentRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentTemplate>,
    /// Begin with another run's recorded steps (DESIGN.md §11): set
    /// instead of `agentRef` and `agent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<ForkOf>,
    /// Run another agent version against a recorded run without touching
    /// the world (DESIGN.md §11, `kubectl agentrun replay-test`): set
    /// instead of `agentRef`, `agent` and `forkOf`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_of: Option<TestOf>,
    /// The task, given to the model as the first user message. A fork's
    /// task is its parent's (recorded in the copied log); any text is
    /// kept but unused.
    #[schemars(length(min = 1))]
    pub input: String,
    /// Wall-clock limit of the whole run, counted from its creation,
    /// waiting for approvals included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), extend("x-kubernetes-validations" = [{
        "rule": DURATION_RULE,
        "message": "spec.deadline must be a positive duration such as 30m or 2h"
    }]))]
    pub deadline: Option<String>,
    /// Limit of one step's Job (its `activeDeadlineSeconds`).
    #[serde(default = "default_step_timeout")]
    #[schemars(length(max = 32), extend("x-kubernetes-validations" = [{
        "rule": DURATION_RULE,
        "message": "spec.stepTimeout must be a positive duration such as 90s or 10m"
    }]))]
    pub step_timeout: String,
    /// Whether a run keeps the agent version it started with (`Pinned`) or
    /// moves to the Agent's current version at the next step (`FollowLatest`).
    #[serde(default)]
    pub version_policy: VersionPolicy,
    /// Name of the step-log store to use; the controller's default when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// Set to true to cancel the run; it stops at the next step boundary.
    #[serde(default)]
    pub cancel: bool,
}

impl AgentRunSpec {
    /// Whether the run names Agent `name` (same namespace): as `agentRef`,
    /// or as the agent a fork or a replay test goes on with. A change to
    /// that Agent is the run's to see at once.
    pub fn names_agent(&self, name: &str) -> bool {
        let fork = self.fork_of.as_ref().and_then(|f| f.agent.as_deref());
        let test = self.test_of.as_ref().map(|t| t.agent.as_str());
        self.agent_ref.as_ref().map(|r| r.name.as_str()) == Some(name)
            || fork == Some(name)
            || test == Some(name)
    }
}

/// Where a fork begins: its parent (by name, in the fork's namespace: a
/// fork into another namespace cannot be named) and the seq of the
/// parent's last record it keeps.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkOf {
    /// The parent AgentRun's name, in this namespace.
    #[schemars(length(min = 1, max = 253), extend("x-kubernetes-validations" = [{
        "rule": "!self.contains('/')",
        "message": "spec.forkOf.run names a run in the fork's own namespace: a fork into another namespace is refused"
    }]))]
    pub run: String,
    /// The seq of the parent's last record copied (`kubectl agentrun log`).
    #[schemars(range(min = 1, max = MAX_FORK_SEQ))]
    pub seq: u64,
    /// An Agent (same namespace) to go on with after the fork point,
    /// recorded as a `VersionChanged`; the parent's agent when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub agent: Option<String>,
    /// One recorded tool result or model answer at or before `seq` to
    /// replace in the fork's copy ("what if the tool had said this"),
    /// recorded in the fork's `Forked` record with who replaced it and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace: Option<ForkReplace>,
    /// What the fork's budgets count: `FromFork` (the default) what the
    /// fork spends after its fork point only, `Inherit` the copied
    /// prefix's spending too, as the parent counted it.
    #[serde(default)]
    pub budget: ForkBudget,
}

/// A replay test: the recorded run, the Agent to try on it, and the
/// test's own budget. The model is asked anew; no tool is called and no
/// approval raised (each proposed call is answered from the recorded
/// run's calls, and the first that matches none ends the test `Diverged`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TestOf {
    /// The recorded AgentRun's name, in this namespace.
    #[schemars(length(min = 1, max = 253), extend("x-kubernetes-validations" = [{
        "rule": "!self.contains('/')",
        "message": "spec.testOf.run names a run in the test's own namespace"
    }]))]
    pub run: String,
    /// The Agent (same namespace) to try.
    #[schemars(length(min = 1, max = 253))]
    pub agent: String,
    /// The test's spending limits, in place of the Agent's budgets (a test
    /// asks nobody to raise them: used up, it ends `BudgetExceeded`). The
    /// Agent's limits when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<TestBudgets>,
}

/// A replay test's spending limits.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TestBudgets {
    /// Maximum input plus output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_tokens: Option<u64>,
    /// Maximum cost in US dollars.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "maxCostUSD"
    )]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self > 0.0", "message": "spec.testOf.budgets.maxCostUSD must be greater than 0"
    }]))]
    pub max_cost_usd: Option<f64>,
}

/// A record of the fork's copy replaced (`kubectl agentrun fork --replace`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkReplace {
    /// The seq of the parent's `ToolResult` or `ModelCall` to replace, at
    /// or before `spec.forkOf.seq`.
    #[schemars(range(min = 1, max = MAX_FORK_SEQ))]
    pub seq: u64,
    /// The replacement: a tool result's value (the tool's JSON answer), or
    /// a model answer (`{"text": ..., "toolCalls": [...], "usage": {...}}`).
    #[schemars(schema_with = "crate::api::common::any_json")]
    pub with: serde_json::Value,
    /// Why (recorded in the fork's log, shown by `verify`).
    #[schemars(length(min = 1, max = 1024))]
    pub reason: String,
}

/// What a fork's budgets count (DESIGN.md §11).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ForkBudget {
    /// Steps, tokens and cost from the fork point on, against the agent's
    /// budgets as they stand (raises granted to the parent do not carry).
    #[default]
    FromFork,
    /// Go on counting where the parent stood at the fork point (its
    /// spending; the raises granted to the parent do not carry either: a
    /// fork that runs out asks its own approvers).
    Inherit,
}

/// The largest `spec.forkOf.seq`: the largest integer a JSON number carries
/// exactly (a CRD's `maximum` is a float), far past any log's length (the
/// store's seqs stop at `i64::MAX`). A user-written seq is never trusted to
/// fit arithmetic all the same: the fork's code adds to it checked.
pub const MAX_FORK_SEQ: u64 = (1 << 53) - 1;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn default_step_timeout() -> String {
    "10m".into()
}

/// Version pinning of a run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum VersionPolicy {
    /// Resume on the prompt, model and tools the run started with.
    #[default]
    Pinned,
    /// Move to the Agent's current version at the next step boundary,
    /// recorded in the log as `VersionChanged`.
    FollowLatest,
}

/// Where a run is in its lifecycle.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Accepted, not yet started.
    #[default]
    Pending,
    /// A step is being worked on.
    Running,
    /// A risky call waits for a human decision; no pod is held.
    AwaitingApproval,
    /// The agent finished with a result.
    Succeeded,
    /// The run stopped with an error.
    Failed,
    /// Cancelled through `spec.cancel`.
    Cancelled,
    /// A token, cost or step budget was used up.
    BudgetExceeded,
    /// `spec.deadline` passed.
    DeadlineExceeded,
}

impl Phase {
    /// A final phase: the run never moves again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Phase::Succeeded
                | Phase::Failed
                | Phase::Cancelled
                | Phase::BudgetExceeded
                | Phase::DeadlineExceeded
        )
    }
}

/// Observed state of an AgentRun: only what `kubectl get` and a controller
/// restart need. The log itself lives in the external store.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentRunStatus {
    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// What the run waits on, for `kubectl get`: `job/NAME`, `approval/NAME`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_on: Option<String>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions: `AgentResolved`, `Ready`, `Succeeded`, ...
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Reference to the run's step log in the external store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<LogRef>,
    /// The step in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<CurrentStep>,
    /// The Approval the run waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<PendingApproval>,
    /// Versions pinned when the run started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<PinnedVersions>,
    /// Tokens, cost and steps so far, summed from the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// When the run started and, once final, when it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// When `spec.deadline` passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<Time>,
    /// The agent's final answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Why the run failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where a run's log is.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LogRef {
    /// Store name.
    pub store: String,
    /// Key of the run in the store (the run's uid).
    pub run_key: String,
    /// Number of records.
    pub length: u64,
    /// Hash of the last record; `kubectl agentrun verify` checks the chain ends here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_hash: Option<String>,
    /// First record that must carry the controller's signature where its
    /// kind is the controller's. 0 for runs started by a signing release;
    /// for a run started before, the length its log had when a signing
    /// controller first saw it (those records are kept as they were).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_from: Option<u64>,
    /// First record whose controller signature must bind it to this run and
    /// seq (signature scheme v2). 0 for runs started by a binding release;
    /// for a run started before, the length its log had when a binding
    /// controller first saw it: the legacy (v1) signatures before it are
    /// accepted as they were, none after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_from: Option<u64>,
    /// Which of the controller's keys signs the run's controller records
    /// from which seq, in the order they took over: the key of the
    /// controller that wrote this status last. A rotation appends the new
    /// key at the log's length when its controller first wrote the status,
    /// and a key a rotation retired counts only before the seq where the
    /// key after it took over (for a run it never signed for: nowhere).
    /// Absent on a run no release recording keys has written yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_keys: Option<Vec<SigningKey>>,
    /// Where a controller that does not hold the replayed log resumes
    /// reading it (long logs only), signed by the controller. The log is
    /// still verified whole right after that controller's first decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<LogCheckpoint>,
}

/// One of the controller's signing keys and the first seq it signs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SigningKey {
    /// The key's id (the first 8 bytes of the sha256 of its public key, hex,
    /// as the controller publishes it).
    pub key: String,
    /// The first seq this key signs.
    pub from: u64,
}

/// What the records before `seq` add up to, for resuming a long log's
/// replay there: a few records read by seq and the rest from `seq` on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LogCheckpoint {
    /// First record read on resuming.
    pub seq: u64,
    /// Hash of record `seq - 1`, where the chain read on resuming starts.
    pub hash: String,
    /// The records before `seq` that stay in force (the run's start, its
    /// latest version change, summary and model text), by seq and hash.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pinned: Vec<PinnedRecord>,
    /// Tokens and cost of the records before `seq`.
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
    /// The controller's Ed25519 signature over the run's uid and the fields above (hex).
    pub signature: String,
}

/// One record by seq and hash.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PinnedRecord {
    pub seq: u64,
    pub hash: String,
}

/// The step being worked on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentStep {
    /// Sequence number the step will append at.
    pub seq: u64,
    /// Job running it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Attempt number of this step (1 for the first); an attempt that
    /// recorded something new is followed by a first attempt of the next.
    #[serde(default)]
    pub attempt: u32,
    /// Step Jobs of this run that failed or vanished before this one, over
    /// all steps (disruptions after progress included).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_jobs: u32,
    /// Attempts of this step before this one that failed without recording
    /// anything; pods lost to disruptions are not counted.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stalled: u32,
    /// When the Job was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// The id of the controller key whose step token the Job's credential
    /// holds (`kubectl agentrun rotate-key --prune` keeps a retired key
    /// while a Job holds its token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_key: Option<String>,
}

/// The Approval a run waits for.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingApproval {
    /// Approval name.
    pub name: String,
    /// When it expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
}

/// Versions a run started with.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PinnedVersions {
    /// Prompt version label.
    pub prompt_version: String,
    /// sha256 of the prompt text.
    pub prompt_hash: String,
    /// Model name as configured.
    pub model: String,
    /// sha256 of the tool schemas.
    pub tool_schema_hash: String,
    /// Generation of the Agent snapshotted, for `agentRef` runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_generation: Option<i64>,
}

/// A run's uid: the key of its log, of what the controller remembers about
/// it and of its Approvals' and Secrets' names, where its name would let a
/// re-created run meet an earlier one's. The API server sets it when the run
/// is created, so every run a reconcile reads has one; an object never
/// stored has none, and gets the empty uid, which names no log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunUid(String);

impl RunUid {
    /// The uid of `run` as the API server set it.
    pub fn of(run: &AgentRun) -> RunUid {
        RunUid(run.metadata.uid.clone().unwrap_or_default())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for RunUid {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RunUid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<RunUid> for String {
    fn from(uid: RunUid) -> String {
        uid.0
    }
}
