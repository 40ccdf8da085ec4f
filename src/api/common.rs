//! Types shared by several resources.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A reference to a key of a Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key inside the Secret whose value is used.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A reference to an object in the same namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalRef {
    /// Name of the object.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Who may decide an approval: users by name and members of groups.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.users) ? size(self.users) : 0) + (has(self.groups) ? size(self.groups) : 0) > 0",
    "message": "approvers must name at least one user or group"
}]))]
pub struct Approvers {
    /// User names (as the API server authenticates them) allowed to decide.
    #[serde(default)]
    #[schemars(length(max = 50))]
    pub users: Vec<String>,
    /// Groups whose members are allowed to decide.
    #[serde(default)]
    #[schemars(length(max = 50))]
    pub groups: Vec<String>,
}

/// Token and cost figures, summed from the step log.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Model input tokens used so far.
    #[serde(default)]
    pub input_tokens: u64,
    /// Model output tokens used so far.
    #[serde(default)]
    pub output_tokens: u64,
    /// Cost so far in US dollars, from the model's configured prices.
    #[serde(default, rename = "costUSD")]
    pub cost_usd: f64,
    /// Number of steps recorded in the log.
    #[serde(default)]
    pub steps: u64,
}

/// CEL rule for a Go-style duration (`90s`, `30m`, `1h30m`) that must be positive.
/// Each duration field carries it with a message naming that field.
pub const DURATION_RULE: &str =
    "self.matches('^([0-9]+(\\\\.[0-9]+)?(ms|s|m|h))+$') && duration(self) > duration('0s')";

/// Parses a Go-style duration such as `90s`, `30m` or `1h30m`.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// Schema of a free-form JSON object (tool arguments, JSON Schemas). Typed as
/// an object so CEL rules can test for its presence.
pub fn any_json(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

/// What happens to a risky call that nobody decides in time. There is no
/// approve-on-timeout: an absent reviewer is never consent.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum OnExpiry {
    /// Raise a new Approval to `escalateTo`, with a new expiry.
    Escalate,
    /// Stop the run with its partial result.
    #[default]
    Fail,
    /// Execute the safe alternative the agent proposed.
    Alternative,
    /// Tell the model the request expired and let it choose again.
    ReturnToAgent,
}

/// The message an approval webhook receives.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum NotifyFormat {
    /// The event as JSON (`event`, `namespace`, `run`, `approval`, `tool`,
    /// `arguments`, `argumentsHash`, `rule`, `approvers`, `detail`).
    #[default]
    Json,
    /// A Slack incoming-webhook message (Block Kit).
    Slack,
    /// A Microsoft Teams incoming-webhook message (an Adaptive Card).
    Teams,
}

/// What a tool call that matches no rule does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DefaultAction {
    /// Run it without asking.
    #[default]
    Allow,
    /// Ask for approval for every call that is not declared read-only.
    RequireApprovalForMutating,
}

/// A record the approved call depends on, read through a read-only lookup.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Dependency {
    /// Name of the dependency, shown to the approver.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// URL answering with the record's current version (GET; the call's arguments as query).
    #[schemars(length(min = 1))]
    pub lookup: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_style_durations_parse() {
        assert_eq!(parse_duration("90s").unwrap().as_secs(), 90);
        assert_eq!(parse_duration("1h30m").unwrap().as_secs(), 5400);
        assert_eq!(parse_duration("250ms").unwrap().as_millis(), 250);
        assert!(parse_duration("soon").is_err());
    }
}
