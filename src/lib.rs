//! agentrun: a Kubernetes operator that runs LLM agent tasks as durable
//! executions recorded in an append-only step log, pausing for human approval
//! of risky steps. See DESIGN.md for the contract.

pub mod api;
pub mod bounded;
pub mod cli;
pub mod client;
pub mod console;
pub mod contain;
pub mod controller;
pub mod dns;
pub mod egress;
pub mod exit;
pub mod failpoint;
pub mod fork;
pub mod host;
pub mod jcs;
pub mod keys;
pub mod model;
pub mod policy;
pub mod refusal;
pub mod replay;
pub mod runlog;
pub mod sandbox;
pub mod step;
pub mod store;
pub mod telemetry;
pub mod text;
pub mod tools;
pub mod wire;

#[cfg(test)]
mod error_rule;
