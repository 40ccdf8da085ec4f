//! The wire of a container agent (issue 41): an agent that is the platform
//! team's own program talks to agentrun's runner on its pod's loopback as it
//! would to a model provider or an MCP server, and the runner records every
//! answer before handing it over, replays recorded answers after a restart,
//! and stops a run whose agent asks what it never asked before.
//!
//! Rooms, bottom up:
//! - the dialects an agent's SDK speaks, each translating a request into the
//!   provider-neutral [`crate::model::ModelRequest`] and a
//!   [`crate::model::ModelResponse`] back into that dialect's JSON or its
//!   server-sent events: `chat_completions` (OpenAI Chat Completions),
//!   `responses` (OpenAI Responses, as the Agents SDK sends it), `messages`
//!   (Anthropic Messages); what they share: `fields` (reading a body,
//!   naming the path of what is refused), `answer` (how an answer ended, a
//!   call's arguments as text), `sse` (server-sent-event framing);
//! - `canonical`: what of a request identifies it (its digest), how it is
//!   recorded (a delta against the run's previous request), and where two
//!   requests first differ;
//! - `matcher`: which recorded answer a request gets on replay, when it may
//!   go out live, and when the run has diverged;
//! - `servers`: the tool servers an agent is served and their names;
//! - `mcp_server`: the MCP servers served to the agent, listing the pinned
//!   tools and handing each call to the runner;
//! - `loopback`: the runner's server on the pod's loopback, routing the
//!   three dialects, the MCP servers and the shim's paths to the runner.

mod answer;
pub mod canonical;
pub mod chat_completions;
mod fields;
pub mod loopback;
pub mod matcher;
pub mod mcp_server;
pub mod messages;
pub mod responses;
#[cfg(test)]
mod sdk_fixtures;
pub mod servers;
pub mod sse;

use serde::{Deserialize, Serialize};

/// The API dialect a request came in (and its answer goes back) in.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub enum Dialect {
    /// `POST /v1/chat/completions` (OpenAI and compatible servers).
    ChatCompletions,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages,
}

impl Dialect {
    /// The key of the conversation in the dialect's request body: the part
    /// that grows from one request to the next.
    pub fn conversation_key(self) -> &'static str {
        match self {
            Dialect::ChatCompletions | Dialect::Messages => "messages",
            Dialect::Responses => "input",
        }
    }
}

/// Why an agent's request cannot be served, naming the field: sent back to
/// the agent in its dialect's error format (HTTP 400), never a crash.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct BadRequest {
    /// The JSON path of the field (`messages[2].content`), or `body`.
    pub field: String,
    pub reason: String,
}

impl BadRequest {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        BadRequest {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
