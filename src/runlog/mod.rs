//! The run's log as agentrun reads it: the records' payloads (`records`),
//! the stored types they embed (`v1`, format 1) and the budgets a log's
//! approvals raise (`budget`). The controller, the step runner, the plugin,
//! approval policy and replay all depend on this module; it depends on none
//! of them (only on the store, and on the API, model and tools types its
//! stored types convert to), so the meaning of a record has one definition.
//! What a whole log replays to is `crate::replay`, one floor up: it asks
//! approval policy what the pinned agent gates.

pub mod budget;
pub mod records;
pub mod v1;
pub mod v2;
