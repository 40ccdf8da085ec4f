//! What the controller serves others, each listener bounded before
//! authentication ([`crate::bounded`]): the step-log gateway (the only way step
//! pods reach the log; its client is [`crate::store::RemoteStore`]) with its
//! per-run tokens and its index of live runs, the probes and `/metrics`,
//! the public keys auditors verify records with, and the HTTPS port the API
//! server calls ([`https`]): the log API ([`log_api`], behind the
//! aggregation layer, with [`tls`]) and the requester-stamping webhook.

pub mod admission;
pub mod gateway;
pub mod https;
pub mod log_api;
pub mod own_runtime;
pub mod probes;
pub mod run_index;
pub mod serving_cert;
