//! The controller's keys and what it publishes of them, below everything
//! that uses them (the controller, the plugin, the console): the step-token
//! key that mints each run's gateway token and signs the controller's
//! records ([`step_token`]), and the public keys auditors verify records
//! with ([`published`]).

pub mod published;
pub mod step_token;
