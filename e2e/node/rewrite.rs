//! What the strings of a container's spec become on this node: paths inside
//! its emptyDir mounts (`volumes.rs`) and its pod's loopback ports
//! (`loopback.rs`). Applied once to every string taken from the pod's spec
//! (command and args elements, env values, values from ConfigMaps, Secrets
//! and the downward API, workingDir) before `$(VAR)` expansion: a reference
//! then splices in a value rewritten where it was defined, and no value is
//! rewritten twice (which, after expansion, would move a path again when the
//! node's state dir lies under a mount path, e.g. /tmp).

use crate::{loopback::PodLoopback, volumes::Mounts};

#[derive(Debug, Clone, Default)]
pub struct SpecRewrite {
    pub mounts: Mounts,
    pub loopback: Option<PodLoopback>,
}

impl SpecRewrite {
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
    use std::{path::Path, sync::Arc};

    use k8s_openapi::api::core::v1::{
        Container, EmptyDirVolumeSource, PodSpec, Volume, VolumeMount,
    };

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
        // Once is all: a rewritten path is not inside the mount again.
        assert_eq!(
            SpecRewrite::default().apply("/agentrun/out"),
            "/agentrun/out"
        );
    }
}
