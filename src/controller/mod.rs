//! The controller (`agentrun controller`): a kube-runtime `Controller` on
//! AgentRun, owning Jobs and Approvals, active on one replica at a time.
//!
//! Its rooms, by role (each depends only on those listed before it, and on
//! the shared `context`, `error` and `metrics`):
//!
//! - [`servers`]: what the controller serves others: the step-log gateway
//!   with its per-run tokens (its client is [`crate::store::RemoteStore`]),
//!   the probes and `/metrics`, publishing its public keys (the keys and
//!   tokens themselves are [`crate::keys`], below the controller: the
//!   plugin and the console use them too).
//! - [`watchers`]: the Agent status controller, the platform's policies,
//!   MCP discovery, and the health of every watch.
//! - [`approvals`]: raising an Approval from a step's request, judging its
//!   decisions, the pinned gate, the webhooks.
//! - [`reconciler`]: the AgentRun reconciler (read, decide, act, record):
//!   its state machine, status, Jobs, checkpoints and its memory of each run.
//! - [`process`]: the wiring of one controller process (`run`).

pub mod approvals;
mod conditions;
mod context;
mod error;
mod log_writer;
pub mod memory;
pub mod metrics;
mod process;
pub mod reconciler;
pub mod servers;
mod slots;
pub mod watchers;

/// The one field manager every write of the controller uses.
pub use crate::api::FIELD_MANAGER;

pub use error::Error;
pub use process::{Options, run};
