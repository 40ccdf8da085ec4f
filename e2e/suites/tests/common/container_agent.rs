//! The agents of e2e/agents/ (installed from the package index, unmodified)
//! as container agents on the process node, which maps their image to the
//! programs' directory.

use serde_json::{Value, json};

/// The image the process node maps to the agents' programs.
pub const IMAGE: &str = "agentrun-agents:1";

/// `agent` (the world's refund agent, or the gated one) with its prompt
/// replaced by the container running `program`, its tools handed to it by
/// their MCP URL as a manifest does.
pub fn in_container(mut agent: Value, program: &str) -> Value {
    agent.as_object_mut().unwrap().remove("prompt");
    agent["container"] = json!({
        "image": IMAGE,
        "command": [program],
        "env": [
            {"name": "MCP_URLS", "value": "$(AGENTRUN_MCP_TOOLS_URL)"},
            {"name": "OPENAI_AGENTS_DISABLE_TRACING", "value": "1"}
        ]
    });
    agent
}
