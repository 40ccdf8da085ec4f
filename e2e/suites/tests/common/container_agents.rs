//! What the container agents' suites share: the agents of `e2e/agents/` as
//! a container agent names them, and the model replies they are given.

use serde_json::{Value, json};

/// The image the process node maps to the agents' programs.
pub const IMAGE: &str = "agentrun-agents:1";

/// `agent` (the world's refund agent, or a gated one) with its prompt
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

/// A model reply of plain text (no tool call).
pub fn answer(text: &str) -> Value {
    json!({"text": text})
}

/// A model reply refunding `amount` on order 1042.
pub fn refund_call(amount: u64) -> Value {
    json!({"text": "The customer was charged twice; refunding.",
           "toolCalls": [{"name": "issue_refund", "arguments": {"orderId": "1042", "amount": amount}}]})
}
