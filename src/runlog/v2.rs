//! Format 2 of the step log's stored types: what a container agent adds to
//! format 1 (docs/container-agents.md). Format 1's types are unchanged; a
//! record that holds any type of this module is written as format 2
//! (`RecordDraft::format`), so that an earlier release, which reads format 1
//! only, refuses it instead of decoding it without what it cannot see.
//!
//! The same rule as format 1: a stored type never changes; these copy the
//! serde shape of the types they are converted from and depend on none.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{api, wire};

/// The API dialect a container agent's request came in.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Dialect {
    ChatCompletions,
    Responses,
    Messages,
}

/// A container agent's model request, as its `ModelCall` holds it: a delta
/// against the run's previous recorded request (`wire::canonical`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WireRequest {
    pub dialect: Dialect,
    pub digest: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub same: Vec<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept: usize,
    pub body: Map<String, Value>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A container agent's image and how it starts (`api::AgentContainer`),
/// stored beside the format-1 agent template of `RunStarted` and
/// `VersionChanged`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub image: String,
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Kubernetes' `ResourceRequirements` (core/v1, a stable shape) as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matching: Option<ReplayMatching>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EnvVar {
    pub name: String,
    #[serde(default)]
    pub value: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayMatching {
    Exact,
    ByPosition,
}

impl From<api::AgentContainer> for Container {
    fn from(c: api::AgentContainer) -> Self {
        let api::AgentContainer {
            image,
            command,
            args,
            env,
            resources,
            matching,
        } = c;
        Container {
            image,
            command,
            args,
            env: env
                .into_iter()
                .map(|api::AgentEnvVar { name, value }| EnvVar { name, value })
                .collect(),
            resources: resources.and_then(|r| serde_json::to_value(r).ok()),
            matching: matching.map(|m| match m {
                api::ReplayMatching::Exact => ReplayMatching::Exact,
                api::ReplayMatching::ByPosition => ReplayMatching::ByPosition,
            }),
        }
    }
}

impl From<Container> for api::AgentContainer {
    fn from(c: Container) -> Self {
        let Container {
            image,
            command,
            args,
            env,
            resources,
            matching,
        } = c;
        api::AgentContainer {
            image,
            command,
            args,
            env: env
                .into_iter()
                .map(|EnvVar { name, value }| api::AgentEnvVar { name, value })
                .collect(),
            resources: resources.and_then(|r| serde_json::from_value(r).ok()),
            matching: matching.map(|m| match m {
                ReplayMatching::Exact => api::ReplayMatching::Exact,
                ReplayMatching::ByPosition => api::ReplayMatching::ByPosition,
            }),
        }
    }
}

impl From<wire::Dialect> for Dialect {
    fn from(d: wire::Dialect) -> Self {
        match d {
            wire::Dialect::ChatCompletions => Dialect::ChatCompletions,
            wire::Dialect::Responses => Dialect::Responses,
            wire::Dialect::Messages => Dialect::Messages,
        }
    }
}

impl From<Dialect> for wire::Dialect {
    fn from(d: Dialect) -> Self {
        match d {
            Dialect::ChatCompletions => wire::Dialect::ChatCompletions,
            Dialect::Responses => wire::Dialect::Responses,
            Dialect::Messages => wire::Dialect::Messages,
        }
    }
}

impl From<wire::canonical::RecordedRequest> for WireRequest {
    fn from(r: wire::canonical::RecordedRequest) -> Self {
        let wire::canonical::RecordedRequest {
            dialect,
            digest,
            same,
            kept,
            body,
        } = r;
        WireRequest {
            dialect: dialect.into(),
            digest,
            same,
            kept,
            body,
        }
    }
}

impl From<WireRequest> for wire::canonical::RecordedRequest {
    fn from(r: WireRequest) -> Self {
        let WireRequest {
            dialect,
            digest,
            same,
            kept,
            body,
        } = r;
        wire::canonical::RecordedRequest {
            dialect: dialect.into(),
            digest,
            same,
            kept,
            body,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::canonical::{Canonical, record};

    /// The stored shape, pinned: changing it changes the bytes of every
    /// format-2 log.
    #[test]
    fn a_wire_request_is_stored_in_its_pinned_shape_and_converts_both_ways() {
        let request = Canonical::of(
            wire::Dialect::Responses,
            serde_json::json!({"model": "m", "input": [{"role": "user", "content": "refund A-1"}]}),
        )
        .unwrap();
        let recorded = record(&request, None);
        let stored = WireRequest::from(recorded.clone());
        let json = serde_json::to_value(&stored).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "dialect": "responses",
                "digest": request.digest(),
                "body": {"model": "m", "input": [{"role": "user", "content": "refund A-1"}]}
            })
        );
        let back: WireRequest = serde_json::from_value(json).unwrap();
        assert_eq!(wire::canonical::RecordedRequest::from(back), recorded);
    }

    /// A container agent's template stores its container beside the
    /// format-1 template (whose prompt is empty) and reads back whole; a
    /// built-in agent's stores none.
    #[test]
    fn a_container_agent_is_stored_beside_its_template_and_reads_back_whole() {
        let agent: api::AgentTemplate = serde_json::from_value(serde_json::json!({
            "container": {
                "image": "team/agent:1", "command": ["python", "agent.py"],
                "env": [{"name": "SHOP_MCP", "value": "$(AGENTRUN_MCP_SHOP_URL)"}],
                "resources": {"limits": {"memory": "512Mi"}},
                "matching": "ByPosition"
            },
            "model": {"provider": "OpenAI", "name": "m"}
        }))
        .unwrap();
        let stored = crate::runlog::records::RunStarted {
            run_name: "r".into(),
            namespace: "n".into(),
            input: "x".into(),
            agent: agent.clone().into(),
            tools: vec![],
            mcp: Default::default(),
            versions: Default::default(),
            container: agent.container.clone().map(Into::into),
        };
        assert_eq!(stored.agent.prompt, crate::runlog::v1::Prompt::default());
        let json = serde_json::to_value(&stored).unwrap();
        assert_eq!(json["container"]["resources"]["limits"]["memory"], "512Mi");
        let back: crate::runlog::records::RunStarted = serde_json::from_value(json).unwrap();
        assert_eq!(back.agent_template(), agent);
        let mut builtin = agent;
        builtin.container = None;
        builtin.prompt = Some(api::Prompt {
            version: "v1".into(),
            system: "s".into(),
        });
        let stored = crate::runlog::records::RunStarted {
            agent: builtin.clone().into(),
            container: None,
            ..back
        };
        assert_eq!(stored.agent_template(), builtin);
        assert!(
            serde_json::to_value(&stored)
                .unwrap()
                .get("container")
                .is_none()
        );
    }
}
