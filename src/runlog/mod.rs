//! The run's log as agentrun reads it: the records' payloads (`records`),
//! the stored types they embed (`v1`, format 1) and the state a log replays
//! to (`replay`: what happened, what comes next; `budget`: budgets that ask). The controller, the step
//! runner, the CLI and approval policy all depend on this module; it depends
//! on none of them (only on the store, and on the API, model and tools types
//! its stored types convert to), so the meaning of a log has one definition.

pub mod budget;
#[cfg(test)]
mod fuzz;
pub mod records;
pub mod replay;
pub mod v1;
