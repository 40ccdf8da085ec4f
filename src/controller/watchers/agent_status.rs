//! Agent status: what a run would pin (prompt hash, tools) and whether the
//! template is usable. Checks the API server cannot do (CEL conditions of the
//! approval policy, tool input schemas) surface here, naming the field,
//! before any run uses the Agent.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::{Controller, WatchStreamExt, reflector, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::api::{Agent, AgentStatus, AgentTemplate};
use crate::controller::FIELD_MANAGER;
use crate::controller::conditions::{condition, set_condition};

/// Why a template cannot be used, naming the field; `None` when it can.
pub fn check(t: &AgentTemplate) -> Option<String> {
    for (i, rule) in t.approval.iter().flat_map(|p| p.rules.iter()).enumerate() {
        if let Some(expr) = &rule.when
            && let Err(e) = crate::policy::condition::compile(expr)
        {
            return Some(format!(
                "spec.approval.rules[{i}].when: not a usable CEL condition: {e}"
            ));
        }
    }
    if let Some(refused) =
        crate::controller::watchers::tool_discovery::too_many(&t.tools, "spec.tools")
    {
        return Some(refused);
    }
    for (i, tool) in t.tools.iter().enumerate() {
        if let Some(schema) = &tool.input_schema
            && let Err(e) = jsonschema::validator_for(schema)
        {
            return Some(format!(
                "spec.tools[{i}].inputSchema ({}): not a valid JSON Schema: {e}",
                tool.name
            ));
        }
    }
    None
}

/// The status an Agent should have (pure).
pub fn status(agent: &Agent, now: Timestamp) -> AgentStatus {
    let mut s = agent.status.clone().unwrap_or_default();
    let generation = agent.metadata.generation;
    let prompt = serde_json::to_value(&agent.spec.prompt).unwrap_or_default();
    s.observed_generation = generation;
    s.prompt_hash = Some(crate::store::sha256_hex(&crate::store::canonical_json(
        &prompt,
    )));
    s.tool_count = Some(agent.spec.tools.len() as u32);
    let ready = match check(&agent.spec) {
        None => condition(
            "Ready",
            true,
            "Valid",
            "the agent can be used by runs",
            generation,
            now,
        ),
        Some(problem) => condition("Ready", false, "InvalidSpec", &problem, generation, now),
    };
    set_condition(&mut s.conditions, ready);
    s
}

/// Why an Agent's status was not written.
#[derive(Debug, thiserror::Error)]
enum StatusError {
    #[error("{0}")]
    Write(#[from] kube::Error),
    /// A bug an Agent's spec reached (its CEL, its schemas): that Agent's
    /// status waits, every other Agent's and run's goes on.
    #[error("checking the agent {0}")]
    Panicked(#[from] crate::contain::Panicked),
}

async fn reconcile_contained(
    agent: Arc<Agent>,
    client: Arc<kube::Client>,
) -> Result<Action, StatusError> {
    Ok(crate::contain::contain(reconcile(agent, client)).await??)
}

async fn reconcile(agent: Arc<Agent>, client: Arc<kube::Client>) -> Result<Action, kube::Error> {
    let desired = status(&agent, Timestamp::now());
    if agent.status.as_ref() != Some(&desired) {
        let api: Api<Agent> =
            Api::namespaced((*client).clone(), &agent.namespace().unwrap_or_default());
        let body = json!({"apiVersion": Agent::api_version(&()), "kind": Agent::kind(&()), "status": desired});
        api.patch_status(
            &agent.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    }
    Ok(Action::await_change())
}

/// Runs the Agent status controller until `stop` completes; its watch
/// reports to `watches`.
pub async fn run(
    agents: Api<Agent>,
    client: kube::Client,
    watches: &crate::controller::watchers::health::Watches,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (cache, writer) = reflector::store();
    let events = watches
        .follow(
            "agents (status)",
            watcher(agents, watcher::Config::default()),
        )
        .default_backoff()
        .reflect(writer)
        .applied_objects();
    Controller::for_stream(events, cache)
        .graceful_shutdown_on(stop)
        .run(
            reconcile_contained,
            |agent, error, _| {
                tracing::warn!(agent = %agent.name_any(), %error, "writing agent status failed");
                Action::requeue(Duration::from_secs(5))
            },
            Arc::new(client),
        )
        .for_each(|_| async {})
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApprovalPolicy, ApprovalRule, HttpTool, ToolSpec};

    #[test]
    fn a_broken_condition_or_schema_is_named() {
        let mut t = AgentTemplate::default();
        assert_eq!(check(&t), None);
        t.approval = Some(ApprovalPolicy {
            rules: vec![ApprovalRule {
                name: "r".into(),
                tool: "x".into(),
                when: Some("args.amount >".into()),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert!(
            check(&t)
                .unwrap()
                .starts_with("spec.approval.rules[0].when")
        );
        t.approval = None;
        t.tools = vec![ToolSpec {
            name: "pay".into(),
            input_schema: Some(json!({"type": "no-such-type"})),
            http: Some(HttpTool {
                url: "http://x".into(),
                ..Default::default()
            }),
            ..Default::default()
        }];
        assert!(
            check(&t)
                .unwrap()
                .starts_with("spec.tools[0].inputSchema (pay)")
        );
    }

    #[test]
    fn status_pins_the_prompt_and_reports_readiness() {
        let mut a = Agent::new("a", AgentTemplate::default());
        a.metadata.generation = Some(2);
        let s = status(&a, Timestamp::from_second(1_800_000_000).unwrap());
        assert_eq!((s.observed_generation, s.tool_count), (Some(2), Some(0)));
        assert_eq!(s.prompt_hash.as_ref().map(String::len), Some(64));
        assert_eq!(s.conditions[0].status, "True");
    }
}
