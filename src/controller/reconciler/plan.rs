//! The pure part of reconciliation: given what was read, what should the
//! run's status be and what should a user be told. No I/O here, so every
//! branch is unit-tested without a cluster.

use jiff::Timestamp;

use crate::api::{AgentRun, AgentRunStatus, AgentTemplate, Phase};
use crate::controller::conditions::{condition, set_condition};
use crate::controller::context::Notice;

/// Condition type telling whether the run's agent could be resolved.
pub const AGENT_RESOLVED: &str = "AgentResolved";

/// What reading the cluster found about the run's agent.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentLookup {
    /// `spec.agent` is inline.
    Inline,
    /// `spec.agentRef` names an Agent that exists, with this generation.
    Found { generation: Option<i64> },
    /// `spec.agentRef` names an Agent that does not exist.
    NotFound { name: String },
    /// A fork without `forkOf.agent` whose parent's Agent is gone: it runs
    /// on the agent its log pins, and reads no Agent.
    Pinned,
}

impl AgentLookup {
    /// The generation of the Agent found, if one was.
    pub fn generation(&self) -> Option<i64> {
        match self {
            AgentLookup::Found { generation } => *generation,
            _ => None,
        }
    }
}

/// The outcome of deciding: the desired status and what to tell the user.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub status: AgentRunStatus,
    pub notices: Vec<Notice>,
}

/// Decides the desired status of `run`.
pub fn plan(run: &AgentRun, agent: &AgentLookup, now: Timestamp) -> Plan {
    let old = run.status.clone().unwrap_or_default();
    let mut status = old.clone();
    let mut notices = Vec::new();
    let generation = run.metadata.generation;

    let resolved = match agent {
        AgentLookup::Inline => condition(
            AGENT_RESOLVED,
            true,
            "Inline",
            "the run defines its agent inline in spec.agent",
            generation,
            now,
        ),
        AgentLookup::Found { .. } => {
            let name = run
                .spec
                .agent_ref
                .as_ref()
                .map(|r| r.name.as_str())
                .unwrap_or_default();
            condition(
                AGENT_RESOLVED,
                true,
                "Found",
                &format!("Agent {name:?} resolved"),
                generation,
                now,
            )
        }
        AgentLookup::Pinned => condition(
            AGENT_RESOLVED,
            true,
            "Pinned",
            "the fork goes on with the agent its log pins (its parent's at the fork point); its parent's Agent is not needed",
            generation,
            now,
        ),
        AgentLookup::NotFound { name } => condition(
            AGENT_RESOLVED,
            false,
            "AgentNotFound",
            &format!(
                "spec.agentRef.name: Agent {name:?} does not exist in namespace {:?}; create it or fix the reference",
                run.metadata.namespace.as_deref().unwrap_or_default()
            ),
            generation,
            now,
        ),
    };
    let was = old.conditions.iter().find(|c| c.type_ == AGENT_RESOLVED);
    if was.is_none_or(|c| c.status != resolved.status || c.reason != resolved.reason) {
        notices.push(Notice {
            warning: resolved.status != "True",
            reason: if resolved.status == "True" {
                "AgentResolved"
            } else {
                "AgentNotFound"
            },
            message: resolved.message.clone(),
        });
    }
    set_condition(&mut status.conditions, resolved);

    if status.phase.is_none() {
        status.phase = Some(Phase::Pending);
    }
    if status.phase == Some(Phase::Pending) {
        status.waiting_on = match agent {
            AgentLookup::NotFound { name } => Some(format!("agent/{name}")),
            _ => None,
        };
    }
    status.observed_generation = generation;
    Plan { status, notices }
}

/// The agent template the run executes, when it can be known without I/O.
pub fn inline_agent(run: &AgentRun) -> Option<&AgentTemplate> {
    run.spec.agent.as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AgentRunSpec, LocalRef};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn run(agent_ref: Option<&str>) -> AgentRun {
        let mut run = AgentRun::new(
            "r",
            AgentRunSpec {
                agent_ref: agent_ref.map(|n| LocalRef { name: n.into() }),
                agent: agent_ref.is_none().then(AgentTemplate::default),
                input: "refund order 42".into(),
                ..Default::default()
            },
        );
        run.metadata.namespace = Some("shop".into());
        run.metadata.generation = Some(3);
        run
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn missing_agent_is_reported_with_field_and_namespace() {
        let plan = plan(
            &run(Some("refunds")),
            &AgentLookup::NotFound {
                name: "refunds".into(),
            },
            t(10),
        );
        let c = &plan.status.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (AGENT_RESOLVED, "False", "AgentNotFound")
        );
        assert!(
            c.message.contains("spec.agentRef.name")
                && c.message.contains("\"refunds\"")
                && c.message.contains("\"shop\""),
            "{}",
            c.message
        );
        assert_eq!(plan.status.phase, Some(Phase::Pending));
        assert_eq!(plan.status.waiting_on.as_deref(), Some("agent/refunds"));
        assert_eq!(plan.status.observed_generation, Some(3));
        assert_eq!(plan.notices.len(), 1);
        assert!(plan.notices[0].warning);
    }

    #[test]
    fn found_agent_resolves_and_clears_waiting() {
        let mut r = run(Some("refunds"));
        r.status = Some(
            plan(
                &r,
                &AgentLookup::NotFound {
                    name: "refunds".into(),
                },
                t(10),
            )
            .status,
        );
        let plan = plan(
            &r,
            &AgentLookup::Found {
                generation: Some(1),
            },
            t(20),
        );
        let c = &plan.status.conditions[0];
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Found"));
        assert_eq!(c.last_transition_time, Time(t(20)));
        assert_eq!(plan.status.waiting_on, None);
        assert_eq!(
            plan.notices,
            vec![Notice {
                warning: false,
                reason: "AgentResolved",
                message: "Agent \"refunds\" resolved".into()
            }]
        );
    }

    #[test]
    fn inline_agent_resolves() {
        let plan = plan(&run(None), &AgentLookup::Inline, t(5));
        assert_eq!(plan.status.conditions[0].reason, "Inline");
        assert!(inline_agent(&run(None)).is_some());
    }

    #[test]
    fn unchanged_decision_is_idempotent_and_silent() {
        let mut r = run(Some("a"));
        let first = plan(&r, &AgentLookup::Found { generation: None }, t(10));
        r.status = Some(first.status.clone());
        let second = plan(&r, &AgentLookup::Found { generation: None }, t(99));
        assert_eq!(
            second.status, first.status,
            "a repeat reconcile must not move lastTransitionTime"
        );
        assert!(second.notices.is_empty());
    }

    #[test]
    fn a_later_phase_is_kept() {
        let mut r = run(None);
        r.status = Some(AgentRunStatus {
            phase: Some(Phase::Running),
            waiting_on: Some("job/x".into()),
            ..Default::default()
        });
        let plan = plan(&r, &AgentLookup::Inline, t(1));
        assert_eq!(plan.status.phase, Some(Phase::Running));
        assert_eq!(plan.status.waiting_on.as_deref(), Some("job/x"));
    }

    #[test]
    fn set_condition_replaces_by_type() {
        let mut cs = vec![condition("A", true, "R", "m", None, t(1))];
        set_condition(&mut cs, condition("B", true, "R", "m", None, t(2)));
        set_condition(&mut cs, condition("A", false, "X", "n", None, t(3)));
        assert_eq!(cs.len(), 2);
        assert_eq!(
            (cs[0].status.as_str(), cs[0].last_transition_time.clone()),
            ("False", Time(t(3)))
        );
    }
}
