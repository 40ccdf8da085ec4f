//! The step pod a step Job runs (DESIGN.md section 4): its shape only, so
//! the Job's builder (`job`) uses it and it uses nothing of the Job's.
//!
//! A built-in agent's pod is the `step` container alone, running the
//! runner. A container agent's (docs/container-agents.md) has beside it the
//! `agent` container running the team's image, its command wrapped by the
//! agent shim that an init container copies from the operator's image.
//! Plain app containers, no native sidecars: every kubelet runs it alike.
//!
//! What the agent's container gets: the variables the SDKs read by
//! themselves pointing at the runner on the pod's loopback, the pod's key
//! (not the provider's: that stays with the runner), one variable per tool
//! server, the result file, the run's task (`AGENTRUN_INPUT`: `spec.input`); set before the Agent's own variables so those
//! may refer to them (`$(AGENTRUN_MCP_SHOP_URL)`). No Secret, no
//! service-account token (the pod mounts none), non-root on a read-only
//! root with a writable `/tmp`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, PodSecurityContext, PodSpec,
    ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use sha2::{Digest, Sha256};

use crate::api::AgentContainer;
use crate::controller::context::JobSettings;
use crate::wire::servers::ToolServer;

/// The runner's port on the pod's loopback.
pub const LOOPBACK_PORT: u16 = 8790;
/// Where the shim is copied to, in both the init and the agent container.
const SHIM_DIR: &str = "/agentrun/bin";
/// Where the agent may write its result.
const OUT_DIR: &str = "/agentrun/out";
const SHIM_VOLUME: &str = "agentrun-shim";
const OUT_VOLUME: &str = "agentrun-out";
const TMP_VOLUME: &str = "agentrun-tmp";

/// The step pod: runs once (the controller retries, not the kubelet), as
/// a non-root user under the runtime's seccomp profile.
pub(super) fn step_pod(settings: &JobSettings, env: Vec<EnvVar>) -> PodSpec {
    PodSpec {
        restart_policy: Some("Never".into()),
        service_account_name: Some(settings.service_account.clone()),
        // Step pods never talk to the Kubernetes API.
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        containers: vec![step_container(settings, env)],
        ..Default::default()
    }
}

/// The `step` container (the failure policy names it): `agentrun step` on a
/// read-only root, with no privileges to gain and small fixed resources.
fn step_container(settings: &JobSettings, env: Vec<EnvVar>) -> Container {
    Container {
        name: "step".into(),
        image: Some(settings.image.clone()),
        command: Some(vec!["agentrun".into(), "step".into()]),
        env: Some(env),
        // The runner writes its last error there; a crash
        // that could not is told by the log's last lines.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        security_context: Some(container_security_context()),
        resources: Some(step_resources()),
        ..Default::default()
    }
}

/// The container may write nowhere but its volumes, and holds no capability.
fn container_security_context() -> SecurityContext {
    SecurityContext {
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A step mostly waits on its model: little CPU, and a memory limit that
/// keeps a runaway step from starving its node.
fn step_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".into(), Quantity("50m".into())),
            ("memory".into(), Quantity("64Mi".into())),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".into(),
            Quantity("256Mi".into()),
        )])),
        ..Default::default()
    }
}

/// An environment variable with its value in the pod spec, as written:
/// the kubelet expands `$(NAME)` in a value to another variable's (the
/// pod's key, say) and reads `$$` as `$`, so every `$` is doubled. A run's
/// task is the run creator's text; no value the controller writes refers
/// to another variable.
pub(super) fn plain(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into().replace('$', "$$")),
        ..Default::default()
    }
}

/// One of the Agent's own variables, as its author wrote it: it may refer
/// to the ones agentrun sets (`$(AGENTRUN_MCP_SHOP_URL)`), as documented
/// (docs/container-agents.md); the author's agent runs with them anyway.
fn authored(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// The pod's loopback key: derived from the Job's name, so the Job is
/// built the same every time. It opens only this pod's loopback, which
/// nothing outside the pod reaches; it is no secret of anyone's.
pub fn loopback_key(job_name: &str) -> String {
    let digest = Sha256::digest(format!("agentrun loopback key\n{job_name}").as_bytes());
    format!("agentrun-pod-{}", hex::encode(&digest[..16]))
}

/// Turns a built-in step pod into a container agent's: the runner told
/// where to serve, the shim's init container, the agent's container.
pub fn add_agent(
    spec: &mut PodSpec,
    agent: &AgentContainer,
    servers: &[ToolServer],
    operator_image: &str,
    key: &str,
    input: &str,
) {
    if let Some(step) = spec.containers.first_mut() {
        let env = step.env.get_or_insert_with(Vec::new);
        env.push(plain("AGENTRUN_RUNNER_KEY", key));
        env.push(plain(
            "AGENTRUN_LOOPBACK_ADDR",
            format!("127.0.0.1:{LOOPBACK_PORT}"),
        ));
    }
    spec.init_containers = Some(vec![shim_installer(operator_image)]);
    spec.containers
        .push(agent_container(agent, servers, key, input));
    let empty = |name: &str| Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    };
    spec.volumes = Some(vec![
        empty(SHIM_VOLUME),
        empty(OUT_VOLUME),
        empty(TMP_VOLUME),
    ]);
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..Default::default()
    }
}

/// Copies the shim (the operator's binary) where the agent's container runs it.
fn shim_installer(operator_image: &str) -> Container {
    Container {
        name: "install-shim".into(),
        image: Some(operator_image.into()),
        command: Some(vec![
            "agentrun".into(),
            "agent-shim-install".into(),
            SHIM_DIR.into(),
        ]),
        volume_mounts: Some(vec![mount(SHIM_VOLUME, SHIM_DIR, false)]),
        security_context: Some(container_security_context()),
        ..Default::default()
    }
}

fn agent_container(
    agent: &AgentContainer,
    servers: &[ToolServer],
    key: &str,
    input: &str,
) -> Container {
    let mut command = vec![
        format!("{SHIM_DIR}/agentrun"),
        "agent-shim".into(),
        "--".into(),
    ];
    command.extend(agent.command.iter().cloned());
    let mut env = wire_env(servers, key);
    env.push(plain("AGENTRUN_INPUT", input));
    env.extend(agent.env.iter().map(|v| authored(&v.name, &v.value)));
    Container {
        name: "agent".into(),
        image: Some(agent.image.clone()),
        command: Some(command),
        args: (!agent.args.is_empty()).then(|| agent.args.clone()),
        env: Some(env),
        resources: agent.resources.clone(),
        volume_mounts: Some(vec![
            mount(SHIM_VOLUME, SHIM_DIR, true),
            mount(OUT_VOLUME, OUT_DIR, false),
            mount(TMP_VOLUME, "/tmp", false),
        ]),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        security_context: Some(container_security_context()),
        ..Default::default()
    }
}

/// What agentrun sets in the agent's container.
fn wire_env(servers: &[ToolServer], key: &str) -> Vec<EnvVar> {
    let base = format!("http://127.0.0.1:{LOOPBACK_PORT}");
    let mut env = vec![
        plain("OPENAI_BASE_URL", format!("{base}/v1")),
        plain("OPENAI_API_KEY", key),
        plain("ANTHROPIC_BASE_URL", base.clone()),
        plain("ANTHROPIC_API_KEY", key),
        plain("AGENTRUN_RUNNER_URL", base),
        plain("AGENTRUN_RUNNER_KEY", key),
        plain("AGENTRUN_RESULT_FILE", format!("{OUT_DIR}/result")),
    ];
    env.extend(
        servers
            .iter()
            .map(|s| plain(&s.env_name(), s.local_url(LOOPBACK_PORT))),
    );
    env
}

#[cfg(test)]
mod tests {
    use super::plain;

    /// The kubelet's expansion of an env value (Kubernetes, "Define
    /// dependent environment variables"; its `expansion` package): `$$` is
    /// `$`; `$(NAME)` of a variable defined before it is that variable's
    /// value, of any other name itself; any other `$` stays.
    fn kubelet_expands(value: &str, env: &[(&str, &str)]) -> String {
        let mut out = String::new();
        let mut rest = value;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            if let Some(tail) = after.strip_prefix('$') {
                out.push('$');
                rest = tail;
            } else if let Some(close) = after.strip_prefix('(').and_then(|t| t.find(')')) {
                let name = &after[1..=close];
                match env.iter().find(|(n, _)| *n == name) {
                    Some((_, v)) => out.push_str(v),
                    None => out.push_str(&format!("$({name})")),
                }
                rest = &after[close + 2..];
            } else {
                out.push('$');
                rest = after;
            }
        }
        out.push_str(rest);
        out
    }

    #[test]
    fn the_reference_expansion_is_the_kubelets() {
        // Cases of the Kubernetes expansion package's own tests.
        let env = [("VAR_A", "A"), ("VAR_B", "B")];
        for (value, expanded) in [
            ("$(VAR_A)", "A"),
            ("___$(VAR_B)___", "___B___"),
            ("$(VAR_A)-$(VAR_A)", "A-A"),
            ("$$(VAR_B)", "$(VAR_B)"),
            ("$$$$$$(VAR_A)", "$$$(VAR_A)"),
            ("$(VAR_DNE)", "$(VAR_DNE)"),
            ("$(VAR_A", "$(VAR_A"),
            ("f000-$$VAR_A", "f000-$VAR_A"),
            ("$", "$"),
            ("foo$", "foo$"),
        ] {
            assert_eq!(kubelet_expands(value, &env), expanded, "{value}");
        }
    }

    /// A run's task reaches the agent as written: never the pod's key
    /// spliced in, never `$$` halved (issue 51). The Agent's own variables
    /// keep their documented references to agentrun's.
    #[test]
    fn user_text_reaches_the_agent_as_written_never_expanded_by_the_kubelet() {
        let env = [("AGENTRUN_RUNNER_KEY", "the-pods-key"), ("HOME", "/root")];
        for text in [
            "refund $(AGENTRUN_RUNNER_KEY) now",
            "$$(HOME)",
            "$(HOME",
            "cost: $5, $$ or $",
            "$$$(HOME)$",
        ] {
            let var = plain("AGENTRUN_INPUT", text);
            let value = var.value.as_deref().unwrap();
            assert_eq!(kubelet_expands(value, &env), text);
        }
        // Through the agent's container: each value expanded as the kubelet
        // does, with the variables defined before it.
        let agent: crate::api::AgentContainer = serde_json::from_value(serde_json::json!({
            "image": "agent:1", "command": ["agent"],
            "env": [{"name": "SHOP", "value": "$(AGENTRUN_MCP_SHOP_URL)"}]
        }))
        .unwrap();
        let shop = crate::wire::servers::ToolServer {
            name: "shop".into(),
            url: Some("http://shop/mcp".into()),
            tools: vec!["lookup".into()],
        };
        let task = "refund $(AGENTRUN_RUNNER_KEY) and $$(HOME)";
        let container = super::agent_container(&agent, &[shop], "the-pods-key", task);
        let mut seen: Vec<(String, String)> = Vec::new();
        for var in container.env.unwrap() {
            let defined: Vec<(&str, &str)> =
                seen.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            let value = kubelet_expands(var.value.as_deref().unwrap_or(""), &defined);
            seen.push((var.name, value));
        }
        let of = |name: &str| seen.iter().find(|(n, _)| n == name).unwrap().1.clone();
        assert_eq!(of("AGENTRUN_INPUT"), task);
        assert_eq!(of("AGENTRUN_RUNNER_KEY"), "the-pods-key");
        assert_eq!(
            of("SHOP"),
            of("AGENTRUN_MCP_SHOP_URL"),
            "the author's reference"
        );
        assert!(
            of("SHOP").starts_with("http://127.0.0.1:"),
            "{}",
            of("SHOP")
        );
    }
}
