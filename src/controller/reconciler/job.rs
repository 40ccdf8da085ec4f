//! The Job that runs one step of a run (DESIGN.md section 4). Pure: built
//! from the run and the controller's settings, applied by the reconciler.
//! The pod's shape is `pod`'s; the Job adds what the runner is told of its
//! run (its environment), and how a failed pod counts.

use crate::controller::context::JobSettings;
use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    EnvVar, EnvVarSource, ObjectFieldSelector, PodTemplateSpec, SecretKeySelector,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};

use super::pod::{self, plain};
use crate::api::{AgentRun, AgentTemplate};
use crate::store::Head;

/// Label carrying the run's name on every Job and pod of the run.
pub const RUN_LABEL: &str = "agentrun.dev/run";

/// What the controller keeps of a step Job in its watch cache: metadata
/// (without field ownership) and status; the pod template is dropped.
pub fn slim(job: &mut Job) {
    job.metadata.managed_fields = None;
    job.metadata.annotations = None;
    if let Some(spec) = job.spec.as_mut() {
        spec.template = Default::default();
    }
}
/// Annotation switching a failpoint on for a run's first attempt (tests only).
pub const FAILPOINT_ANNOTATION: &str = "agentrun.dev/failpoint";
/// Key of the step token in a run's credential Secret ([`credential_secret`]).
pub const TOKEN_KEY: &str = "token";
/// Environment variable carrying the controller's public key (hex): the
/// runner accepts controller records only with its signature.
pub const CONTROLLER_KEY_ENV: &str = "AGENTRUN_CONTROLLER_KEY";
/// Environment variable carrying `status.log.signedFrom`: controller
/// records before it predate signing.
pub const SIGNED_FROM_ENV: &str = "AGENTRUN_SIGNED_FROM";
/// Environment variable carrying `status.log.boundFrom`: controller records
/// from there on must carry signatures bound to their run and seq.
pub const BOUND_FROM_ENV: &str = "AGENTRUN_BOUND_FROM";
/// Environment variable carrying where each controller key signs the run's
/// records (`<key id>:<from seq>,...`, `status.log.signingKeys`): a retired
/// key's signature counts only before the key after it took over.
pub const SIGNING_KEYS_ENV: &str = "AGENTRUN_SIGNING_KEYS";
/// Environment variable carrying the log head the controller anchored
/// (`<length>:<hash hex>`): the runner refuses a log that does not extend it.
pub const LOG_ANCHOR_ENV: &str = "AGENTRUN_LOG_ANCHOR";

/// Name of the Secret (in the run's namespace, owned by the run) that holds
/// the run's step-log gateway token minted with key `key_id`. From the uid:
/// a recreated run of the same name never meets an old credential; and
/// from the key: the controller only creates Secrets, so after a rotation a
/// run's next Job gets a new one holding a token of the new key (the
/// retired key's token opens only runs created before its retirement, and
/// once no Job holds it, the key can be pruned).
pub fn credential_secret(run_uid: &str, key_id: &str) -> String {
    format!("agentrun-step-{run_uid}-{key_id}")
}

/// Deterministic Job name: creating it twice is harmless, and a retry of the
/// same step is a different attempt. It carries a hash of the run's uid, so a
/// run deleted and created again under its name never meets the Jobs of the
/// one before (left behind by an orphaning delete, or not yet collected).
pub fn job_name(run: &AgentRun, seq: u64, attempt: u32) -> String {
    let uid = crate::api::RunUid::of(run);
    let of_run = hex::encode(&Sha256::digest(uid.as_bytes())[..3]);
    let suffix = format!("-{of_run}-s{seq}-a{attempt}");
    let name = run.name_any();
    if name.len() + suffix.len() <= 63 {
        return format!("{name}{suffix}");
    }
    let hash = hex::encode(&Sha256::digest(name.as_bytes())[..4]);
    let keep = 63 - suffix.len() - hash.len() - 1;
    format!("{}-{hash}{suffix}", name[..keep].trim_end_matches('-'))
}

/// Builds the Job for step `seq`, attempt `attempt`, whose log the
/// controller verified up to `anchor`; `failed_jobs` of the run failed before.
#[allow(clippy::too_many_arguments)]
pub fn build(
    run: &AgentRun,
    agent: &AgentTemplate,
    seq: u64,
    attempt: u32,
    failed_jobs: u32,
    step_timeout_seconds: i64,
    anchor: &Head,
    settings: &JobSettings,
) -> Job {
    let labels = labels(run, seq, attempt);
    let mut env = run_env(run, attempt, step_timeout_seconds, anchor, settings);
    env.extend(agent_env(agent, settings));
    env.extend(failpoint_env(run, failed_jobs, settings));
    let mut pod = pod::step_pod(settings, env);
    if let Some(container) = &agent.container {
        let servers = crate::wire::servers::tool_servers(&agent.tools);
        let key = pod::loopback_key(&job_name(run, seq, attempt));
        let input = &run.spec.input;
        pod::add_agent(&mut pod, container, &servers, &settings.image, &key, input);
    }
    Job {
        metadata: ObjectMeta {
            name: Some(job_name(run, seq, attempt)),
            namespace: run.namespace(),
            labels: Some(labels.clone()),
            owner_references: run.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0), // the controller retries, with a new attempt and the same log
            pod_failure_policy: Some(failure_policy()),
            active_deadline_seconds: Some(step_timeout_seconds),
            ttl_seconds_after_finished: Some(600),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Labels of the Job and its pod: the reconciler finds a run's Jobs by
/// [`RUN_LABEL`], and a step and attempt by the other two.
fn labels(run: &AgentRun, seq: u64, attempt: u32) -> BTreeMap<String, String> {
    BTreeMap::from([
        (RUN_LABEL.to_string(), run.name_any()),
        ("agentrun.dev/seq".to_string(), seq.to_string()),
        ("agentrun.dev/attempt".to_string(), attempt.to_string()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "agentrun".to_string(),
        ),
    ])
}

/// What the runner needs to know of its run and of the controller: which
/// run and attempt it is, how long it may take, where its log lives and
/// which of the log's records it must trust.
fn run_env(
    run: &AgentRun,
    attempt: u32,
    step_timeout_seconds: i64,
    anchor: &Head,
    settings: &JobSettings,
) -> Vec<EnvVar> {
    vec![
        plain("AGENTRUN_RUN_UID", crate::api::RunUid::of(run)),
        plain("AGENTRUN_RUN_NAME", run.name_any()),
        plain("AGENTRUN_NAMESPACE", run.namespace().unwrap_or_default()),
        plain("AGENTRUN_ATTEMPT", attempt.to_string()),
        plain(
            "AGENTRUN_TIME_SLICE_SECONDS",
            settings.time_slice_seconds.to_string(),
        ),
        plain(
            "AGENTRUN_STEP_TIMEOUT_SECONDS",
            step_timeout_seconds.to_string(),
        ),
        // The gateway, not a database: the pod's only store credential is its run's token.
        plain(crate::store::STORE_URL_ENV, settings.store_url.clone()),
        secret(
            crate::store::STORE_TOKEN_ENV,
            &credential_secret(&crate::api::RunUid::of(run), &settings.key_id),
            TOKEN_KEY,
        ),
        plain(LOG_ANCHOR_ENV, format!("{}:{}", anchor.len, anchor.hash)),
        plain(CONTROLLER_KEY_ENV, settings.controller_key.clone()),
        plain(
            SIGNED_FROM_ENV,
            crate::controller::reconciler::status::signed_from_at(run, anchor.len).to_string(),
        ),
        plain(
            BOUND_FROM_ENV,
            crate::controller::reconciler::status::bound_from_at(run, anchor.len).to_string(),
        ),
        plain(
            SIGNING_KEYS_ENV,
            signing_keys_env(run, anchor.len, &settings.key_id),
        ),
        pod_name_env(),
    ]
}

/// [`SIGNING_KEYS_ENV`]: the windows the run's next status records.
fn signing_keys_env(run: &AgentRun, len: u64, key_id: &str) -> String {
    let keys = crate::controller::reconciler::status::signing_keys_to_write(run, len, key_id);
    crate::controller::reconciler::status::windows_of(&keys)
        .to_text()
        .unwrap_or_default()
}

/// `POD_NAME`, from the downward API: the runner's worker identity, which
/// the pod is.
fn pod_name_env() -> EnvVar {
    EnvVar {
        name: "POD_NAME".into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The model's API key (from its Secret, never inline) and the controller's
/// telemetry settings, so step pods report traces where the controller does.
fn agent_env(agent: &AgentTemplate, settings: &JobSettings) -> Vec<EnvVar> {
    let key = agent
        .model
        .secret_ref
        .iter()
        .map(|key| secret("AGENTRUN_MODEL_API_KEY", &key.name, &key.key));
    let telemetry = settings
        .telemetry_env
        .iter()
        .map(|(k, v)| plain(k, v.clone()));
    key.chain(telemetry).collect()
}

/// A failpoint kills one Job per run, so the next one shows the resume;
/// `every-attempt:` arms it for each (a crash loop). Only a controller that
/// allows failpoints (tests) reads the annotation.
fn failpoint_env(run: &AgentRun, failed_jobs: u32, settings: &JobSettings) -> Option<EnvVar> {
    if !settings.allow_failpoints {
        return None;
    }
    let fp = run.annotations().get(FAILPOINT_ANNOTATION)?;
    match fp.strip_prefix("every-attempt:") {
        Some(every) => Some(plain("AGENTRUN_FAILPOINT", every)),
        None if failed_jobs == 0 => Some(plain("AGENTRUN_FAILPOINT", fp.clone())),
        None => None,
    }
}

/// A pod evicted, preempted or lost with its node is no failed attempt: the
/// Job replaces it, and the new pod replays the log. A crash (any exit code
/// but 0) fails the Job by rule, with reason PodFailurePolicy. Whether a
/// failed Job's pod crashed or was lost (deleted, its node gone) the
/// controller reads from the pod itself.
fn failure_policy() -> PodFailurePolicy {
    PodFailurePolicy {
        rules: vec![
            PodFailurePolicyRule {
                action: "Ignore".into(),
                on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                    type_: "DisruptionTarget".into(),
                    status: "True".into(),
                }]),
                on_exit_codes: None,
            },
            PodFailurePolicyRule {
                action: "FailJob".into(),
                on_pod_conditions: None,
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some("step".into()),
                    operator: "NotIn".into(),
                    values: vec![0],
                }),
            },
        ],
    }
}

fn secret(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AgentRunSpec, SecretKeyRef};
    use k8s_openapi::api::core::v1::Container;

    fn run(name: &str) -> AgentRun {
        let mut r = AgentRun::new(
            name,
            AgentRunSpec {
                input: "x".into(),
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ns".into());
        r.metadata.uid = Some("uid-1".into());
        r
    }

    fn settings() -> JobSettings {
        JobSettings {
            image: "agentrun:dev".into(),
            store_url: "http://gw:8081".into(),
            controller_key: "ab".repeat(32),
            key_id: "00112233aabbccdd".into(),
            service_account: "default".into(),
            time_slice_seconds: 30,
            allow_failpoints: true,
            telemetry_env: Vec::new(),
        }
    }

    #[test]
    fn names_are_deterministic_short_and_distinct_per_attempt() {
        let r = run("refund-order-1042");
        let of_run = hex::encode(&Sha256::digest(r.uid().unwrap().as_bytes())[..3]);
        assert_eq!(
            job_name(&r, 7, 1),
            format!("refund-order-1042-{of_run}-s7-a1")
        );
        assert_ne!(job_name(&r, 7, 1), job_name(&r, 7, 2));
        // A run created again under the same name has Jobs of its own.
        let mut again = run("refund-order-1042");
        again.metadata.uid = Some("another-uid".into());
        assert_ne!(job_name(&r, 7, 1), job_name(&again, 7, 1));
        let long = run(&"x".repeat(200));
        let n = job_name(&long, 123456, 3);
        assert!(n.len() <= 63 && n.ends_with("-s123456-a3"), "{n}");
        assert_eq!(n, job_name(&long, 123456, 3));
    }

    /// A container agent's pod: the runner beside the agent, the agent
    /// told where the runner is and given the pod's key, never the
    /// provider's key, a Secret or a token; its own variables last, so they
    /// may name agentrun's.
    #[test]
    fn a_container_agents_pod_runs_the_agent_beside_the_runner_without_its_credentials() {
        let agent: AgentTemplate = serde_json::from_value(serde_json::json!({
            "container": {
                "image": "team/refund-agent:7", "command": ["python", "agent.py"], "args": ["--fast"],
                "env": [{"name": "SHOP_MCP", "value": "$(AGENTRUN_MCP_SHOP_URL)"}]
            },
            "model": {"provider": "OpenAI", "name": "m", "secretRef": {"name": "openai", "key": "key"}},
            "tools": [
                {"name": "lookup", "mcp": {"url": "http://shop.tools.svc/mcp"}},
                {"name": "refund", "http": {"url": "http://refunds/x"}}
            ]
        }))
        .unwrap();
        let job = build(&run("r"), &agent, 3, 1, 0, 300, &Head::EMPTY, &settings());
        let pod = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["step", "agent"]);
        let init = &pod.init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some("agentrun:dev"));
        let (step, agent_c) = (&pod.containers[0], &pod.containers[1]);
        let env = |c: &Container| -> Vec<(String, Option<String>)> {
            c.env
                .clone()
                .unwrap()
                .into_iter()
                .map(|e| (e.name, e.value))
                .collect()
        };
        let key = pod::loopback_key(&job.metadata.name.clone().unwrap());
        let agent_env = env(agent_c);
        let value = |name: &str| {
            agent_env
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.clone())
        };
        assert_eq!(
            value("OPENAI_BASE_URL").as_deref(),
            Some("http://127.0.0.1:8790/v1")
        );
        assert_eq!(
            value("ANTHROPIC_BASE_URL").as_deref(),
            Some("http://127.0.0.1:8790")
        );
        assert_eq!(value("OPENAI_API_KEY"), Some(key.clone()));
        assert_eq!(
            value("AGENTRUN_MCP_SHOP_URL").as_deref(),
            Some("http://127.0.0.1:8790/mcp/shop")
        );
        assert_eq!(
            value("AGENTRUN_MCP_TOOLS_URL").as_deref(),
            Some("http://127.0.0.1:8790/mcp/tools")
        );
        assert_eq!(
            agent_env.last().unwrap().0,
            "SHOP_MCP",
            "the Agent's own variables come last"
        );
        assert!(
            agent_c
                .env
                .as_ref()
                .unwrap()
                .iter()
                .all(|e| e.value_from.is_none()),
            "no Secret and no field of the pod reaches the agent"
        );
        assert!(
            env(step)
                .iter()
                .any(|(n, v)| n == "AGENTRUN_RUNNER_KEY" && v.as_deref() == Some(key.as_str()))
        );
        assert!(
            step.env
                .as_ref()
                .unwrap()
                .iter()
                .any(|e| e.name == "AGENTRUN_MODEL_API_KEY")
        );
        assert_eq!(
            agent_c.command.clone().unwrap(),
            [
                "/agentrun/bin/agentrun",
                "agent-shim",
                "--",
                "python",
                "agent.py"
            ]
        );
        assert_eq!(agent_c.args.clone().unwrap(), ["--fast"]);
        let security = agent_c.security_context.clone().unwrap();
        assert_eq!(security.read_only_root_filesystem, Some(true));
        assert_eq!(security.allow_privilege_escalation, Some(false));
        let mounts = agent_c.volume_mounts.clone().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m.mount_path == "/agentrun/bin" && m.read_only == Some(true))
        );
        // A built-in agent's pod is as before: one container, no volumes.
        let builtin = build(
            &run("r"),
            &AgentTemplate::default(),
            3,
            1,
            0,
            300,
            &Head::EMPTY,
            &settings(),
        );
        let pod = builtin.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.containers.len(), 1);
        assert!(pod.init_containers.is_none() && pod.volumes.is_none());
    }

    #[test]
    fn step_pods_report_traces_where_the_controller_does() {
        let settings = JobSettings {
            telemetry_env: vec![(
                "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
                "http://collector:4318".into(),
            )],
            ..settings()
        };
        let job = build(
            &run("r"),
            &AgentTemplate::default(),
            1,
            1,
            0,
            300,
            &Head::EMPTY,
            &settings,
        );
        let env = job.spec.unwrap().template.spec.unwrap().containers[0]
            .env
            .clone()
            .unwrap();
        let otlp = env
            .iter()
            .find(|e| e.name == "OTEL_EXPORTER_OTLP_ENDPOINT")
            .expect("the endpoint is handed on");
        assert_eq!(otlp.value.as_deref(), Some("http://collector:4318"));
    }

    #[test]
    fn step_pods_are_locked_down() {
        let mut agent = AgentTemplate::default();
        agent.model.secret_ref = Some(SecretKeyRef {
            name: "k".into(),
            key: "apiKey".into(),
        });
        let job = build(&run("r"), &agent, 3, 1, 0, 300, &Head::EMPTY, &settings());
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(300));
        assert_eq!(spec.backoff_limit, Some(0));
        // Disruptions are no failed attempt: the Job replaces the pod.
        let rule = &spec.pod_failure_policy.as_ref().unwrap().rules[0];
        assert_eq!(rule.action, "Ignore");
        assert_eq!(
            rule.on_pod_conditions.as_ref().unwrap()[0].type_,
            "DisruptionTarget"
        );
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(
            pod.security_context.as_ref().unwrap().run_as_non_root,
            Some(true)
        );
        let c = &pod.containers[0];
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(
            (sc.read_only_root_filesystem, sc.allow_privilege_escalation),
            (Some(true), Some(false))
        );
        let env = c.env.as_ref().unwrap();
        let key = env
            .iter()
            .find(|e| e.name == "AGENTRUN_MODEL_API_KEY")
            .unwrap();
        assert_eq!(
            key.value, None,
            "the key comes from the Secret, never inline"
        );
        assert_eq!(
            key.value_from
                .as_ref()
                .unwrap()
                .secret_key_ref
                .as_ref()
                .unwrap()
                .name,
            "k"
        );
        // The gateway's URL in plain sight, the run's token from its own Secret.
        let url = env.iter().find(|e| e.name == "AGENTRUN_STORE_URL").unwrap();
        assert_eq!(url.value.as_deref(), Some("http://gw:8081"));
        let token = env
            .iter()
            .find(|e| e.name == "AGENTRUN_STORE_TOKEN")
            .unwrap();
        let from = token
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        // The Secret of the current key's token (a rotation gives new Jobs a new one).
        assert_eq!(
            (from.name.as_str(), from.key.as_str()),
            ("agentrun-step-uid-1-00112233aabbccdd", "token")
        );
        // The key windows the run's next status records: the current key,
        // from seq 0 for a run with no status yet.
        let windows = env.iter().find(|e| e.name == SIGNING_KEYS_ENV).unwrap();
        assert_eq!(windows.value.as_deref(), Some("00112233aabbccdd:0"));
        let anchor = env
            .iter()
            .find(|e| e.name == "AGENTRUN_LOG_ANCHOR")
            .unwrap();
        assert_eq!(
            anchor.value.as_deref(),
            Some(format!("0:{}", crate::store::Hash::ZERO).as_str())
        );
        let owner = &job.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("AgentRun", Some(true))
        );
    }

    #[test]
    fn failpoints_apply_to_the_first_attempt_only() {
        let mut r = run("r");
        r.metadata.annotations = Some(BTreeMap::from([(
            FAILPOINT_ANNOTATION.into(),
            "after-model-call".into(),
        )]));
        let has_fp = |job: &Job| {
            job.spec
                .as_ref()
                .unwrap()
                .template
                .spec
                .as_ref()
                .unwrap()
                .containers[0]
                .env
                .as_ref()
                .unwrap()
                .iter()
                .any(|e| e.name == "AGENTRUN_FAILPOINT")
        };
        assert!(has_fp(&build(
            &r,
            &AgentTemplate::default(),
            1,
            1,
            0,
            60,
            &Head::EMPTY,
            &settings()
        )));
        // Once a Job of the run failed, no further Job is armed.
        assert!(!has_fp(&build(
            &r,
            &AgentTemplate::default(),
            1,
            1,
            1,
            60,
            &Head::EMPTY,
            &settings()
        )));
        // A production controller ignores the annotation.
        let production = JobSettings {
            allow_failpoints: false,
            ..settings()
        };
        assert!(!has_fp(&build(
            &r,
            &AgentTemplate::default(),
            1,
            1,
            0,
            60,
            &Head::EMPTY,
            &production
        )));
    }
}
