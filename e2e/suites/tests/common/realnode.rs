//! The real node of `e2e/cluster up --node=real`: its name, its address,
//! the test image it has, and its containers as the host sees them
//! (containerd's client and `/proc`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;

pub const NODE: &str = "agentrun-real";

/// The test image `e2e/realnode/images.sh` builds and `e2e/cluster up
/// --node=real` imports (a static busybox with its applets on PATH).
pub fn test_image() -> String {
    if let Some(image) = std::env::var("AGENTRUN_REALNODE_TEST_IMAGE")
        .ok()
        .filter(|v| !v.is_empty())
    {
        return image;
    }
    let path = super::root().join("e2e/realnode/images.sh");
    let script = path.display();
    let out = Command::new(&path)
        .arg("paths")
        .output()
        .unwrap_or_else(|e| panic!("running {script} paths: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("TEST_IMAGE=").map(str::to_string))
        .unwrap_or_else(|| panic!("{script} paths names no TEST_IMAGE"))
}

/// The real node's InternalIP (the bridge's address), once it is Ready.
pub async fn node_ip(client: &kube::Client) -> IpAddr {
    let nodes: Api<Node> = Api::all(client.clone());
    super::wait_for(
        &format!("node {NODE} Ready with an InternalIP"),
        Duration::from_secs(60),
        || async {
            let node = match nodes.get_opt(NODE).await {
                Ok(Some(n)) => n,
                Ok(None) => {
                    return Err(format!(
                        "no node {NODE}: is the cluster up with --node=real?"
                    ));
                }
                Err(e) => return Err(e.to_string()),
            };
            let status = node.status.unwrap_or_default();
            let ready = status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let ip = status
                .addresses
                .unwrap_or_default()
                .into_iter()
                .find(|a| a.type_ == "InternalIP")
                .and_then(|a| a.address.parse::<IpAddr>().ok());
            match (ready, ip) {
                (true, Some(ip)) => Ok(ip),
                (ready, ip) => Err(format!("Ready {ready}, InternalIP {ip:?}")),
            }
        },
    )
    .await
}

/// The real node's containerd socket (`e2e/cluster env` exports it).
pub fn containerd_socket() -> PathBuf {
    if let Some(s) = std::env::var_os("AGENTRUN_CONTAINERD_SOCK").filter(|s| !s.is_empty()) {
        return PathBuf::from(s);
    }
    let state =
        std::env::var("AGENTRUN_STATE_DIR").unwrap_or_else(|_| "/tmp/agentrun-state".into());
    Path::new(&state).join("cluster/realnode/containerd/containerd.sock")
}

/// `ctr --namespace k8s.io ARGS` against the real node's containerd: its stdout.
pub fn ctr(args: &[&str]) -> String {
    let sock = containerd_socket();
    let out = Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .args(["--namespace", "k8s.io"])
        .args(args)
        .output()
        .expect("running ctr (containerd's client, installed with the real node)");
    assert!(
        out.status.success(),
        "ctr {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The step pods of run `run` among `pods`.
pub fn step_pods_of(pods: &[Pod], run: &str) -> Vec<Pod> {
    pods.iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("agentrun.dev/run"))
                .is_some_and(|r| r == run)
        })
        .cloned()
        .collect()
}

/// The host PID of a running container (`ctr tasks ls`).
pub fn container_pid(container_id: &str) -> u32 {
    ctr(&["tasks", "ls"])
        .lines()
        .find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.first() == Some(&container_id)).then(|| cols[1].parse().ok())?
        })
        .unwrap_or_else(|| panic!("no running task {container_id} in ctr tasks ls"))
}

/// What the kernel says about a step container's process, read from the
/// host: its uid, effective capabilities, whether its root is read-only,
/// and whether a service-account token is mounted.
pub struct Confinement {
    pub uid: String,
    pub cap_eff: String,
    pub root_read_only: bool,
    pub token_mounted: bool,
}

pub fn confinement(pid: u32) -> Confinement {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root_read_only = mountinfo.lines().any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.get(4) == Some(&"/") && cols.get(5).is_some_and(|o| o.split(',').any(|x| x == "ro"))
    });
    Confinement {
        uid: field("Uid"),
        cap_eff: field("CapEff"),
        root_read_only,
        token_mounted: mountinfo.contains("/var/run/secrets/kubernetes.io/serviceaccount"),
    }
}

/// A process's command line, its arguments joined by spaces.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// The children of process `pid` (its threads' children).
pub fn children(pid: u32) -> Vec<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}
