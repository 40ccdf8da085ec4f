//! emptyDir volumes, as the process node stands in for mounts.
//!
//! A container process sees the host's filesystem: nothing can be mounted
//! at `/agentrun/bin` for it. So each emptyDir volume of a pod is a
//! directory of the pod's own (`<pod dir>/volumes/<volume>`, mode 0777 as a
//! kubelet makes it), and every string of a container's spec that names a
//! path inside one of its mounts (equal to the mount path, or starting with
//! `<mountPath>/`) is rewritten to the same path inside that directory:
//! command, args, env values and workingDir. Only whole strings that start
//! with the path are rewritten (`/agentrun/out/result`, not
//! `--out=/agentrun/out`): a program that builds such paths itself, or
//! relies on files of the image at those paths, sees the host's.
//! `readOnly` is not enforced. Other volume kinds are not emptyDirs: the
//! token volume is `identity.rs`; the rest are ignored, as before.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, PodSpec};

/// The directory of the pod's emptyDir volume `name`.
fn volume_dir(pod_dir: &Path, name: &str) -> PathBuf {
    pod_dir.join("volumes").join(name)
}

/// The pod's emptyDir volume names.
pub fn empty_dirs(spec: &PodSpec) -> impl Iterator<Item = &str> {
    spec.volumes
        .iter()
        .flatten()
        .filter(|v| v.empty_dir.is_some())
        .map(|v| v.name.as_str())
}

/// Creates the directory of every emptyDir volume of the pod, writable by
/// any user (the pod's containers may run as different ones).
pub fn create(pod_dir: &Path, spec: &PodSpec) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    for name in empty_dirs(spec) {
        let dir = volume_dir(pod_dir, name);
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(
            pod_dir.join("volumes"),
            std::fs::Permissions::from_mode(0o755),
        )?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    }
    Ok(())
}

/// A container's emptyDir mounts: mount path → host directory, the longest
/// mount path first (a mount inside another wins).
#[derive(Debug, Clone, Default)]
pub struct Mounts(Vec<(String, PathBuf)>);

impl Mounts {
    pub fn of(pod_dir: &Path, spec: &PodSpec, container: &Container) -> Self {
        let empty: Vec<&str> = empty_dirs(spec).collect();
        let mut mounts: Vec<(String, PathBuf)> = container
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| empty.contains(&m.name.as_str()))
            .map(|m| {
                let mut dir = volume_dir(pod_dir, &m.name);
                if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                    dir = dir.join(sub);
                }
                let path = m.mount_path.trim_end_matches('/');
                let path = if path.is_empty() { "/" } else { path };
                (path.to_string(), dir)
            })
            .collect();
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        Self(mounts)
    }

    /// `s` with a leading mount path replaced by the volume's directory.
    pub fn rewrite(&self, s: &str) -> Option<String> {
        self.0.iter().find_map(|(path, dir)| {
            let rest = s.strip_prefix(path.as_str())?;
            let dir = dir.display();
            match rest {
                "" => Some(dir.to_string()),
                _ if path == "/" => Some(format!("{dir}/{rest}")),
                _ => rest.strip_prefix('/').map(|_| format!("{dir}{rest}")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Volume, VolumeMount};

    fn pod(volumes: &[(&str, bool)]) -> PodSpec {
        PodSpec {
            volumes: Some(
                volumes
                    .iter()
                    .map(|(name, empty)| Volume {
                        name: (*name).into(),
                        empty_dir: empty.then(EmptyDirVolumeSource::default),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn container(mounts: &[(&str, &str, Option<&str>)]) -> Container {
        Container {
            volume_mounts: Some(
                mounts
                    .iter()
                    .map(|(name, path, sub)| VolumeMount {
                        name: (*name).into(),
                        mount_path: (*path).into(),
                        sub_path: sub.map(Into::into),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn paths_inside_an_empty_dir_mount_move_to_its_directory() {
        let spec = pod(&[("shim", true), ("out", true), ("tok", false)]);
        let c = container(&[
            ("shim", "/agentrun/bin", None),
            ("out", "/agentrun/out/", None),
            ("tok", "/var/run/secrets/token", None),
        ]);
        let m = Mounts::of(Path::new("/s/pods/p"), &spec, &c);
        let r = |s| m.rewrite(s);
        assert_eq!(
            r("/agentrun/bin/agentrun").as_deref(),
            Some("/s/pods/p/volumes/shim/agentrun")
        );
        assert_eq!(
            r("/agentrun/bin").as_deref(),
            Some("/s/pods/p/volumes/shim")
        );
        assert_eq!(
            r("/agentrun/out/result").as_deref(),
            Some("/s/pods/p/volumes/out/result")
        );
        // Not inside a mount: a longer name, a flag, another kind of volume.
        assert_eq!(r("/agentrun/binary"), None);
        assert_eq!(r("--out=/agentrun/out/result"), None);
        assert_eq!(r("/var/run/secrets/token/token"), None);
        assert_eq!(r("agentrun"), None);
    }

    #[test]
    fn the_innermost_mount_and_its_sub_path_win() {
        let spec = pod(&[("tmp", true), ("cache", true)]);
        let c = container(&[("tmp", "/tmp", None), ("cache", "/tmp/cache", Some("v1"))]);
        let m = Mounts::of(Path::new("/p"), &spec, &c);
        assert_eq!(
            m.rewrite("/tmp/cache/x").as_deref(),
            Some("/p/volumes/cache/v1/x")
        );
        assert_eq!(m.rewrite("/tmp/x").as_deref(), Some("/p/volumes/tmp/x"));
        // Mounts of other containers do not count.
        let other = Mounts::of(Path::new("/p"), &spec, &container(&[]));
        assert_eq!(other.rewrite("/tmp/x"), None);
    }
}
