//! The step runner (`agentrun step`, DESIGN.md section 4): replay the log,
//! work out the next step, execute it, record it before moving on.

pub mod agent_shim;
pub mod approval_request;
pub mod prompt;
pub mod runner;
pub mod spans;
pub mod wire_log;
