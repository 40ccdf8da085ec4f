//! Reconcile one AgentRun: read → decide (pure, in `decide`) → apply.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::decide::{AgentLookup, decide};
use super::error::Error;
use super::metrics::{Metrics, ReasonLabel};
use crate::api::{Agent, AgentRun};

/// The one field manager every status write uses.
pub const FIELD_MANAGER: &str = "agentrun-controller";

/// Shared state of the reconciler.
pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub metrics: Metrics,
}

pub async fn reconcile(run: Arc<AgentRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciliations.inc();
    let ns = run.namespace().unwrap_or_default();
    let name = run.name_any();

    // Read.
    let lookup = match &run.spec.agent_ref {
        None => AgentLookup::Inline,
        Some(r) => {
            let agents: Api<Agent> = Api::namespaced(ctx.client.clone(), &ns);
            match agents
                .get_opt(&r.name)
                .await
                .map_err(|source| Error::Read {
                    what: "agent",
                    source,
                })? {
                Some(a) => AgentLookup::Found {
                    generation: a.metadata.generation,
                },
                None => AgentLookup::NotFound {
                    name: r.name.clone(),
                },
            }
        }
    };

    // Decide.
    let plan = decide(&run, &lookup, Timestamp::now());

    // Apply.
    if run.status.as_ref() != Some(&plan.status) {
        let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), &ns);
        let body = json!({
            "apiVersion": AgentRun::api_version(&()),
            "kind": AgentRun::kind(&()),
            "status": serde_json::to_value(&plan.status)?,
        });
        runs.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(Error::Status)?;
    }
    let reference = run.object_ref(&());
    for notice in plan.notices {
        let event = Event {
            type_: if notice.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: notice.reason.into(),
            note: Some(notice.message),
            action: "Reconcile".into(),
            secondary: None,
        };
        // An event is for people; failing to publish one must not stall the run.
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(run = %name, namespace = %ns, error = %e, "publishing event failed");
        }
    }
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    Ok(Action::requeue(Duration::from_secs(300)))
}

pub fn error_policy(run: Arc<AgentRun>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(run = %run.name_any(), namespace = ?run.namespace(), %error, "reconcile failed");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ReasonLabel {
            reason: error.metric_label().into(),
        })
        .inc();
    Action::requeue(Duration::from_secs(5))
}
