//! A run's MCP discovery as the memory keeps it: asked for by a reconcile,
//! done by the discovery worker (`watchers::tool_discovery`), collected when
//! the run records its catalog. Dropping one in flight aborts its task, so
//! letting go of a run (finished, deleted, leadership lost) stops its
//! discovery too.

use std::time::Instant;

use crate::refusal::Refusal;
use crate::tools::McpCatalog;

/// One discovery asked for a run.
pub struct Ask {
    /// Which MCP tools were asked for (a changed agent asks anew).
    pub key: String,
    pub state: AskState,
    /// When it was asked for, or answered.
    pub since: Instant,
    /// Failures in a row before this one (the backoff).
    pub failures: u32,
}

pub enum AskState {
    Running(tokio::task::AbortHandle),
    Done(Result<McpCatalog, Refusal>),
}

impl Drop for Ask {
    fn drop(&mut self) {
        if let AskState::Running(task) = &self.state {
            task.abort();
        }
    }
}
