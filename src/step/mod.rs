//! The step runner (`agentrun step`, DESIGN.md section 4): replay the log,
//! work out the next step, execute it, record it before moving on.

pub mod approval;
pub mod context;
pub mod failpoint;
pub mod runner;
pub mod spans;
