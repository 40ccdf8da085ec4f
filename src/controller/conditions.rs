//! Kubernetes conditions on the controller's objects (AgentRun, Agent):
//! built and set as the API conventions say.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Builds a condition stamped `now`; its message (which may quote a model's,
/// a tool's or a user's text) is cut to what a condition holds.
pub fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    Condition {
        type_: type_.to_string(),
        status: if ok { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message: crate::text::cut(message, crate::text::CONDITION_MESSAGE_MAX_BYTES),
        observed_generation: generation,
        last_transition_time: Time(now),
    }
}

/// Inserts or replaces a condition by type, keeping `lastTransitionTime` when
/// the status did not change (Kubernetes convention).
pub fn set_condition(conditions: &mut Vec<Condition>, mut new: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(existing) => {
            if existing.status == new.status {
                new.last_transition_time = existing.last_transition_time.clone();
            }
            *existing = new;
        }
        None => conditions.push(new),
    }
}
