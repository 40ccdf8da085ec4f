//! What the strings of a container's spec become on this node: paths inside
//! its emptyDir mounts (`volumes.rs`) and its pod's loopback ports
//! (`loopback.rs`). Applied once to every string taken from the pod's spec
//! (command and args elements, env values, values from ConfigMaps, Secrets
//! and the downward API, workingDir) before `$(VAR)` expansion: a reference
//! then splices in a value rewritten where it was defined, and no value is
//! rewritten twice (which, after expansion, would move a path again when the
//! node's state dir lies under a mount path, e.g. /tmp).

use std::path::Path;

use k8s_openapi::api::core::v1::{Container, PodSpec};

use crate::{loopback::PodLoopback, volumes::Mounts};

#[derive(Debug, Clone, Default)]
pub struct SpecRewrite {
    pub mounts: Mounts,
    pub loopback: Option<PodLoopback>,
}

impl SpecRewrite {
    /// `container`'s, in the pod of `spec` running in `pod_dir` on `loopback`.
    pub fn of(
        pod_dir: &Path,
        spec: &PodSpec,
        container: &Container,
        loopback: PodLoopback,
    ) -> Self {
        Self {
            mounts: Mounts::of(pod_dir, spec, container),
            loopback: Some(loopback),
        }
    }

    pub fn apply(&self, s: &str) -> String {
        let s = self.mounts.rewrite(s).unwrap_or_else(|| s.to_string());
        match &self.loopback {
            Some(l) => l.rewrite(&s).unwrap_or(s),
            None => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Volume, VolumeMount};

    use super::*;

    #[test]
    fn paths_and_loopback_ports_both_move() {
        let spec = PodSpec {
            volumes: Some(vec![Volume {
                name: "out".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            }]),
            ..Default::default()
        };
        let container = Container {
            volume_mounts: Some(vec![VolumeMount {
                name: "out".into(),
                mount_path: "/agentrun/out".into(),
                ..Default::default()
            }]),
            ..Default::default()
        };
        let r = SpecRewrite {
            mounts: Mounts::of(Path::new("/tmp/node/pods/p"), &spec, &container),
            loopback: Some(PodLoopback {
                addr: [127, 3, 2, 1].into(),
                ports: Arc::new([8790].into()),
            }),
        };
        assert_eq!(
            r.apply("/agentrun/out/result"),
            "/tmp/node/pods/p/volumes/out/result"
        );
        assert_eq!(
            r.apply("http://127.0.0.1:8790/v1"),
            "http://127.3.2.1:8790/v1"
        );
        assert_eq!(r.apply("/tmp/x"), "/tmp/x");
    }

    /// The step pod of a container agent, as the controller builds it
    /// (src/controller/reconciler/pod.rs): what each container runs.
    #[test]
    fn a_container_agents_pod_finds_its_shim_runner_and_result_file() {
        let pod: PodSpec = serde_json::from_value(serde_json::json!({
            "volumes": [
                {"name": "agentrun-shim", "emptyDir": {}},
                {"name": "agentrun-out", "emptyDir": {}},
                {"name": "agentrun-tmp", "emptyDir": {}},
            ],
            "initContainers": [{
                "name": "install-shim", "image": "agentrun:dev",
                "command": ["agentrun", "agent-shim-install", "/agentrun/bin"],
                "volumeMounts": [{"name": "agentrun-shim", "mountPath": "/agentrun/bin"}],
            }],
            "containers": [{
                "name": "step", "image": "agentrun:dev", "command": ["agentrun", "step"],
                "env": [
                    {"name": "AGENTRUN_STORE_URL", "value": "http://127.0.0.1:38211"},
                    {"name": "AGENTRUN_LOOPBACK_ADDR", "value": "127.0.0.1:8790"},
                ],
            }, {
                "name": "agent", "image": "agentrun-agents:1",
                "command": ["/agentrun/bin/agentrun", "agent-shim", "--", "plain-agent"],
                "env": [
                    {"name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:8790/v1"},
                    {"name": "AGENTRUN_RUNNER_URL", "value": "http://127.0.0.1:8790"},
                    {"name": "AGENTRUN_RESULT_FILE", "value": "/agentrun/out/result"},
                    {"name": "AGENTRUN_MCP_TOOLS_URL", "value": "http://127.0.0.1:8790/mcp/tools"},
                    {"name": "MCP_URLS", "value": "$(AGENTRUN_MCP_TOOLS_URL)"},
                ],
                "volumeMounts": [
                    {"name": "agentrun-shim", "mountPath": "/agentrun/bin", "readOnly": true},
                    {"name": "agentrun-out", "mountPath": "/agentrun/out"},
                    {"name": "agentrun-tmp", "mountPath": "/tmp"},
                ],
            }],
        }))
        .unwrap();
        let dir = Path::new("/tmp/node/pods/ns_p_uid");
        let loopback = PodLoopback {
            addr: [127, 1, 2, 3].into(),
            ports: Arc::new([8790].into()),
        };
        let of = |c: &Container| SpecRewrite::of(dir, &pod, c, loopback.clone());
        // What a container sees: its env as `env::resolve` builds it.
        let env = |c: &Container| {
            let r = of(c);
            let mut env = crate::env::Env::default();
            for v in c.env.iter().flatten() {
                let value = crate::env::expand(&r.apply(v.value.as_deref().unwrap()), &env);
                env.set(&v.name, value);
            }
            env
        };
        let init = &pod.init_containers.as_ref().unwrap()[0];
        let [step, agent] = &pod.containers[..] else {
            panic!("two app containers")
        };

        let shim = "/tmp/node/pods/ns_p_uid/volumes/agentrun-shim";
        assert_eq!(of(init).apply("/agentrun/bin"), shim);
        assert_eq!(
            of(agent).apply("/agentrun/bin/agentrun"),
            format!("{shim}/agentrun")
        );
        assert_eq!(of(agent).apply("plain-agent"), "plain-agent");

        let step_env = env(step);
        assert_eq!(
            step_env.get("AGENTRUN_LOOPBACK_ADDR"),
            Some("127.1.2.3:8790")
        );
        assert_eq!(
            step_env.get("AGENTRUN_STORE_URL"),
            Some("http://127.0.0.1:38211")
        );
        let agent_env = env(agent);
        assert_eq!(
            agent_env.get("OPENAI_BASE_URL"),
            Some("http://127.1.2.3:8790/v1")
        );
        assert_eq!(
            agent_env.get("AGENTRUN_RUNNER_URL"),
            Some("http://127.1.2.3:8790")
        );
        assert_eq!(
            agent_env.get("MCP_URLS"),
            Some("http://127.1.2.3:8790/mcp/tools")
        );
        let result = "/tmp/node/pods/ns_p_uid/volumes/agentrun-out/result";
        assert_eq!(agent_env.get("AGENTRUN_RESULT_FILE"), Some(result));
        // The pod dir lies under the agent's /tmp mount here: a second
        // rewrite would move the path again, which is why values are
        // rewritten once, before expansion.
        assert_ne!(of(agent).apply(result), result);
    }
}
