//! What the controller serves others, each listener bounded before
//! authentication ([`bounded`]): the step-log gateway (the only way step
//! pods reach the log; its client is [`crate::store::RemoteStore`]) with its
//! per-run tokens and its index of live runs, the probes and `/metrics`,
//! and the public keys auditors verify records with.

pub mod admission;
pub mod bounded;
pub mod gateway;
pub mod probes;
pub mod published_keys;
pub mod run_index;
pub mod step_token;
