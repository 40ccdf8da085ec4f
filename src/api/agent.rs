//! `Agent`: a reusable template for runs (prompt, model, tools, policy, budgets).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    Approvers, DURATION_RULE, DefaultAction, Dependency, NotifyFormat, OnExpiry, SecretKeyRef,
};
use super::policy::{CallMatch, PlatformAdded, PlatformDefault};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// An Agent is a reusable template an AgentRun names in `spec.agentRef`:
/// system prompt, model, tools, approval policy, budgets and context settings.
/// A run snapshots it when it starts; later edits never change a running run
/// unless the run follows the latest version (`spec.versionPolicy: FollowLatest`).
///
/// The same template is what an AgentRun carries inline in `spec.agent`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "Agent",
    namespaced,
    status = "AgentStatus",
    shortname = "agent",
    category = "agentrun-all",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model.name"}"#,
    printcolumn = r#"{"name":"Prompt","type":"string","jsonPath":".spec.prompt.version"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.prompt) != has(self.container)", "message": "exactly one of prompt (the built-in agent loop) and container (an agent image of your own) must be set"},
    {"rule": "!has(self.container) || !has(self.context)", "message": "context: the built-in loop's context settings; a container agent builds its own context"}
]))]
pub struct AgentTemplate {
    /// The system prompt and its version label: the built-in agent loop.
    /// Exactly one of `prompt` and `container`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Prompt>,
    /// An agent of your own (LangGraph, the OpenAI Agents SDK, plain
    /// Python...), unmodified: its image runs beside agentrun's runner,
    /// which serves it the model and the tools below on the pod's loopback
    /// and records every answer (docs/container-agents.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<AgentContainer>,
    /// The model that drives the agent.
    pub model: ModelSpec,
    /// Tools the agent may call. A built-in `finish` tool is always available.
    #[serde(default)]
    #[schemars(length(max = 64), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub tools: Vec<ToolSpec>,
    /// Which tool calls need a human decision before they run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalPolicy>,
    /// Limits summed over the whole run, across every resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<Budgets>,
    /// How the model's context is built from the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextSettings>,
    /// How step Jobs are retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
}

/// How a step is retried. A pod lost to a disruption (evicted, preempted,
/// its node drained or gone) is no failure: Kubernetes replaces it inside
/// the same Job. An attempt that recorded anything new is progress and
/// starts the count again, so only a step that keeps failing without
/// recording anything fails the run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicy {
    /// Consecutive attempts of one step that record nothing new before the
    /// run fails (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_attempts_without_progress: Option<u32>,
    /// Wait before the second such attempt, in seconds; doubled for each
    /// further one (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub backoff_seconds: Option<u32>,
    /// Longest wait between attempts, in seconds (default 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub max_backoff_seconds: Option<u32>,
}

impl RetryPolicy {
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 4;

    pub fn max_attempts(&self) -> u32 {
        self.max_attempts_without_progress
            .unwrap_or(Self::DEFAULT_MAX_ATTEMPTS)
            .max(1)
    }

    /// The wait after failed attempt `attempt` (1-based) ended.
    pub fn backoff(&self, attempt: u32) -> std::time::Duration {
        let base = u64::from(self.backoff_seconds.unwrap_or(1));
        let cap = u64::from(self.max_backoff_seconds.unwrap_or(64));
        let doubled = base.saturating_mul(1u64 << attempt.saturating_sub(1).min(30));
        std::time::Duration::from_secs(doubled.min(cap))
    }
}

/// A container agent: the team's own image and how it starts.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentContainer {
    /// The agent's image.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// The command that starts the agent. Required: the runner starts it
    /// (the cluster cannot tell an image's entrypoint).
    #[schemars(length(min = 1, max = 64))]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub args: Vec<String>,
    /// Environment variables, literal values only: what the agent needs of
    /// Secrets reaches it through agentrun (the runner holds the model's key
    /// and the tools' credentials). The variables agentrun sets
    /// (`OPENAI_*`, `ANTHROPIC_*` base URLs and keys, `AGENTRUN_*`) cannot
    /// be set here: an agent pointed past the runner would go unrecorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub env: Vec<AgentEnvVar>,
    /// Requests and limits of the agent's container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "!has(self.claims)",
        "message": "spec.container.resources.claims: dynamic resource claims are not available to agents"
    }]))]
    pub resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    /// How a restarted agent's requests are matched to the recorded ones:
    /// `Exact` (default) or `ByPosition` (model requests by position only;
    /// tool calls always by content). See docs/container-agents.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matching: Option<ReplayMatching>,
}

/// An environment variable of a container agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!(self.name in ['OPENAI_BASE_URL', 'OPENAI_API_KEY', 'ANTHROPIC_BASE_URL', 'ANTHROPIC_API_KEY']) && !self.name.startsWith('AGENTRUN_')",
    "message": "spec.container.env[].name: OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY and AGENTRUN_* are set by agentrun"
}]))]
pub struct AgentEnvVar {
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[A-Za-z_][A-Za-z0-9_]*$")
    )]
    pub name: String,
    #[serde(default)]
    #[schemars(length(max = 32768))]
    pub value: String,
}

/// How a restarted container agent's requests are matched to the recorded ones.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ReplayMatching {
    /// A request gets a recorded answer only to the same request.
    #[default]
    Exact,
    /// The k-th model request gets the k-th recorded model answer whatever
    /// it asks (tool calls still by content): for agents whose prompts are
    /// not deterministic, at the risk of answers to other questions.
    ByPosition,
}

/// The system prompt.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Prompt {
    /// Version label of the prompt (e.g. `v3`); recorded with every step so a
    /// run's behaviour can be traced to the prompt that produced it.
    #[schemars(length(min = 1, max = 63))]
    pub version: String,
    /// The system prompt text.
    #[schemars(length(min = 1))]
    pub system: String,
}

/// The model API a run talks to.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Provider {
    /// OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, LiteLLM...).
    #[default]
    OpenAI,
    /// The Anthropic Messages API.
    Anthropic,
}

/// Model configuration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// API flavour: `OpenAI` (chat completions) or `Anthropic` (Messages).
    pub provider: Provider,
    /// Model name sent to the provider (e.g. `gpt-4o-mini`, `claude-sonnet-4-5`).
    #[schemars(length(min = 1))]
    pub name: String,
    /// Base URL of the API; the provider's public endpoint when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048), extend("x-kubernetes-validations" = [{
        "rule": "self.startsWith('http://') || self.startsWith('https://')",
        "message": "spec.model.endpoint must be an http:// or https:// URL"
    }]))]
    pub endpoint: Option<String>,
    /// Secret key holding the API key. Never logged, never given to tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// Prices used to compute each step's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<Prices>,
    /// Upper bound on output tokens per model call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_output_tokens: Option<u32>,
}

/// Prices in US dollars per million tokens.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Prices {
    /// Dollars per million input tokens.
    #[schemars(range(min = 0.0))]
    pub input_per_million: f64,
    /// Dollars per million output tokens.
    #[schemars(range(min = 0.0))]
    pub output_per_million: f64,
}

/// A tool the agent may call: an HTTP endpoint or an MCP server's tool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.http) != has(self.mcp)", "message": "spec.tools[]: exactly one of http and mcp must be set"},
    {"rule": "self.name != 'finish'", "message": "spec.tools[].name: 'finish' is reserved for the built-in tool that ends the run"}
]))]
pub struct ToolSpec {
    /// Name the model calls the tool by.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[a-zA-Z0-9_-]+$"))]
    pub name: String,
    /// What the tool does, as the model sees it.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments; calls are validated against it before they run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::api::common::any_json")]
    pub input_schema: Option<serde_json::Value>,
    /// An HTTP tool: arguments are POSTed as JSON with an `Idempotency-Key` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpTool>,
    /// A tool served by an MCP server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<McpTool>,
}

/// An HTTP tool endpoint.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpTool {
    /// URL the arguments are POSTed to.
    #[schemars(length(max = 2048), extend("x-kubernetes-validations" = [{
        "rule": "self.startsWith('http://') || self.startsWith('https://')",
        "message": "spec.tools[].http.url must be an http:// or https:// URL"
    }]))]
    pub url: String,
    /// The endpoint honours `Idempotency-Key`: repeating a call with the same
    /// key has no further effect, so a crashed call may simply be repeated.
    #[serde(default)]
    pub idempotent: bool,
    /// For a tool that is not idempotent: a URL that answers whether the call
    /// with a given key already happened (GET with `Idempotency-Key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup: Option<String>,
    /// The call modifies nothing: the agent's own `defaultAction` lets it
    /// through. A platform policy never takes the author's word for it.
    #[serde(default)]
    pub read_only: bool,
    /// Per-call timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), extend("x-kubernetes-validations" = [{
        "rule": DURATION_RULE,
        "message": "spec.tools[].http.timeout must be a positive duration such as 30s or 2m"
    }]))]
    pub timeout: Option<String>,
}

/// A tool of an MCP server (streamable HTTP transport).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct McpTool {
    /// URL of the MCP server.
    #[schemars(length(min = 1))]
    pub url: String,
    /// Tool name on that server, when it differs from `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The server honours the idempotency key agentrun sends in `_meta`
    /// (`agentrun.dev/idempotencyKey`): a call cut by a crash is made again
    /// with the same key instead of stopping the run for a human. Used for
    /// crash recovery only; no approval rule reads it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idempotent: bool,
}

/// Which tool calls are risky and who decides them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalPolicy {
    /// Rules, first match wins.
    #[serde(default)]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub rules: Vec<ApprovalRule>,
    /// What calls that match no rule do.
    #[serde(default)]
    pub default_action: DefaultAction,
    /// Approvers for calls caught by `defaultAction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_approvers: Option<Approvers>,
    /// The user who created a run may not approve its calls.
    #[serde(default)]
    pub separation_of_duties: bool,
    /// URL that receives a message when an Approval is raised, escalated,
    /// decided or expires (in `notifyFormat`). It carries no credential and
    /// no decision power: a link to the console and the plugin command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_webhook: Option<String>,
    /// What `notifyWebhook` receives: `Json` (the default: the event as
    /// JSON), `Slack` (a Block Kit message for a Slack incoming webhook) or
    /// `Teams` (an Adaptive Card for a Teams incoming webhook).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_format: Option<NotifyFormat>,
    /// The platform's default, set by the controller when it pins the run
    /// (not part of the Agent's schema: the API server prunes it there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub platform_default: Option<PlatformDefault>,
    /// What the platform added when the controller pinned the run (not
    /// part of the Agent's schema either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub platform_added: Option<PlatformAdded>,
}

/// A rule making matching tool calls wait for a human decision.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.onExpiry != 'Escalate' || has(self.escalateTo)",
     "message": "spec.approval.rules[].escalateTo is required when onExpiry is Escalate"}
]))]
pub struct ApprovalRule {
    /// Rule name, shown on the Approvals it raises.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Tool name the rule applies to (`*` for every tool).
    #[schemars(length(min = 1))]
    pub tool: String,
    /// The endpoints a platform rule selects, set by the controller when it
    /// pins the run (not part of the Agent's schema).
    #[serde(rename = "match", default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
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

/// Budgets, summed from the log over the whole run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.onExhausted) || self.onExhausted != 'Ask' || has(self.approvers)",
     "message": "spec.budgets.approvers is required when onExhausted is Ask"}
]))]
pub struct Budgets {
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
        "rule": "self > 0.0", "message": "spec.budgets.maxCostUSD must be greater than 0"
    }]))]
    pub max_cost_usd: Option<f64>,
    /// Maximum number of steps (records in the log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_steps: Option<u64>,
    /// What the run does when the next step would pass a budget: `Fail`
    /// (end `BudgetExceeded`) or `Ask` (wait on an Approval of kind `Budget`
    /// whose approvers may raise the limits).
    #[serde(default, skip_serializing_if = "OnExhausted::is_fail")]
    pub on_exhausted: OnExhausted,
    /// Who may raise an exhausted budget (required for `onExhausted: Ask`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvers: Option<Approvers>,
    /// Distinct approvals a raise needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10))]
    pub required_approvals: Option<u32>,
    /// How long a budget question waits; expiry ends the run `BudgetExceeded`
    /// (it never raises a budget). One hour when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), extend("x-kubernetes-validations" = [{
        "rule": DURATION_RULE,
        "message": "spec.budgets.expiresAfter must be a positive duration such as 30m or 2h"
    }]))]
    pub expires_after: Option<String>,
}

/// What a run does when a budget runs out.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum OnExhausted {
    /// End the run `BudgetExceeded` with its partial result.
    #[default]
    Fail,
    /// Ask the budget's approvers whether to raise it.
    Ask,
}

impl OnExhausted {
    fn is_fail(&self) -> bool {
        *self == OnExhausted::Fail
    }
}

/// How the model's context is built: system prompt + task + latest summary +
/// recent steps. The full log is always kept.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextSettings {
    /// Token budget of one model call's context; passing it triggers compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 256))]
    pub max_tokens: Option<u64>,
    /// Number of most recent steps always sent verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub recent_steps: Option<u32>,
}

/// Observed state of an Agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// sha256 of the canonical prompt; what runs pin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_hash: Option<String>,
    /// Number of tools, built-in `finish` excluded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_count: Option<u32>,
    /// Conditions (`Ready`).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
