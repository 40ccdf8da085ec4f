//! What the controller watches besides runs: Agents (their status: what a
//! run would pin, and whether the template is usable), the platform's
//! policies, the MCP servers agents name (discovery, outside any
//! reconcile), and the health of every watch (`/readyz`).

pub mod agent_status;
pub mod health;
pub mod platform;
pub mod tool_discovery;
