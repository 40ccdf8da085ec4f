//! The chart installed on the real node as a user installs it: the operator
//! image built from the project's Dockerfile, `helm install` with the
//! in-chart PostgreSQL on a host volume, the controller as its Deployment in
//! containers, step Jobs as containers. Shared by the chart's real-node test
//! and the peers benchmark's real-node side.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use agentrun::api::{AgentRun, Phase};

use k8s_openapi::api::core::v1::{PersistentVolume, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::realnode::NODE;

/// The release name every install here uses.
pub const RELEASE: &str = "agentrun";

/// How long a real-node step waits (pods start in containers).
pub const TIMEOUT: Duration = Duration::from_secs(240);

/// `SCRIPT paths` of an e2e/realnode image script: its `KEY=value` lines.
pub fn image_paths(script: &str) -> Vec<(String, String)> {
    let path = super::root().join("e2e/realnode").join(script);
    let out = Command::new("bash")
        .arg(&path)
        .arg("paths")
        .output()
        .unwrap_or_else(|e| panic!("running {} paths: {e}", path.display()));
    assert!(out.status.success(), "{} paths failed", path.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn path_value(paths: &[(String, String)], key: &str) -> String {
    paths
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in {paths:?}"))
}

pub fn split_image(image: &str) -> (String, String) {
    let (repo, tag) = image.rsplit_once(':').expect("IMAGE:TAG");
    (repo.to_string(), tag.to_string())
}

/// Runs `cmd`: whether it succeeded, and its stdout and stderr.
pub fn run_cmd(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// What the namespace holds, for a failure message.
pub fn diagnose(ns: &str) -> String {
    let (_, pods) = run_cmd(Command::new("kubectl").args([
        "get",
        "pods,pvc,jobs,agentruns",
        "-n",
        ns,
        "-o",
        "wide",
    ]));
    let (_, events) = run_cmd(Command::new("kubectl").args([
        "get",
        "events",
        "-n",
        ns,
        "--sort-by=.lastTimestamp",
    ]));
    format!("{pods}\n{events}")
}

/// A selector-less Service `name` whose one endpoint is a process on the
/// host at `ip:port`: pods reach it by name through kube-proxy.
pub async fn expose_host_process(client: &kube::Client, ns: &str, name: &str, ip: &str, port: u16) {
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &service)
        .await
        .expect("the stand-ins' Service");
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-host"), "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}]
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &slice)
        .await
        .expect("the stand-ins' EndpointSlice");
}

/// A hostPath PersistentVolume on the real node, bound in advance to the
/// claim of the chart's PostgreSQL StatefulSet (the cluster has no
/// provisioner); deleted, with its directory, when dropped.
pub struct HostVolume {
    name: String,
    pub dir: PathBuf,
}

impl HostVolume {
    pub async fn for_claim(client: &kube::Client, ns: &str, claim: &str) -> HostVolume {
        let dir = std::env::temp_dir().join(format!("agentrun-e2e-pv-{ns}"));
        std::fs::create_dir_all(&dir).unwrap();
        // The image's postgres user (the chart's runAsUser); fsGroup does
        // not apply to hostPath volumes.
        std::os::unix::fs::chown(&dir, Some(999), Some(999)).expect("chown the volume's dir");
        let name = format!("{ns}-postgresql");
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": ns, "name": claim},
                "hostPath": {"path": dir.to_str().unwrap(), "type": "Directory"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE]}]}]}}
            }
        }))
        .unwrap();
        Api::<PersistentVolume>::all(client.clone())
            .create(&PostParams::default(), &pv)
            .await
            .expect("the PostgreSQL volume");
        HostVolume { name, dir }
    }
}

impl Drop for HostVolume {
    fn drop(&mut self) {
        let _ = Command::new("kubectl")
            .args(["delete", "pv", &self.name, "--wait=false"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `helm uninstall` when dropped.
pub struct Release {
    namespace: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = Command::new(super::scripts::helm())
            .args([
                "uninstall",
                RELEASE,
                "--namespace",
                &self.namespace,
                "--wait",
            ])
            .args(["--timeout", "120s"])
            .output();
    }
}

/// What an earlier install on the same cluster left: the chart keeps its
/// CRDs and admission policies on uninstall, owned by a release whose
/// namespace (an e2e one) is gone, and helm refuses to adopt them. Deleted,
/// so every install is one on a fresh cluster.
fn forget_earlier_releases(ns: &str) {
    let kinds = "customresourcedefinitions,validatingadmissionpolicies,validatingadmissionpolicybindings,\
                 clusterroles,clusterrolebindings,apiservices,mutatingwebhookconfigurations";
    // (MutatingAdmissionPolicy is off on the real node: not listed, or the
    // get would fail on a kind the API server does not serve.)
    let listed: Value =
        serde_json::from_str(&super::kubectl(&["get", kinds, "-o", "json"])).unwrap();
    for item in listed["items"].as_array().unwrap() {
        let annotations = &item["metadata"]["annotations"];
        let owner = annotations["meta.helm.sh/release-namespace"]
            .as_str()
            .unwrap_or("");
        if annotations["meta.helm.sh/release-name"] == RELEASE
            && owner.starts_with("e2e-")
            && owner != ns
        {
            let kind = item["kind"].as_str().unwrap().to_lowercase();
            let name = item["metadata"]["name"].as_str().unwrap();
            super::kubectl(&["delete", &kind, name, "--ignore-not-found"]);
        }
    }
}

/// An install: uninstalled, then its volume deleted, when dropped.
pub struct Installed {
    _release: Release,
    pub volume: HostVolume,
}

/// `helm install` of the chart into `ns` with the images the e2e/realnode
/// scripts built (never pulled), the in-chart PostgreSQL on a host volume,
/// and `values` merged over that (top-level keys replace).
pub async fn install_on_real_node(client: &kube::Client, ns: &str, values: Value) -> Installed {
    let operator = path_value(&image_paths("build-operator-image.sh"), "OPERATOR_IMAGE");
    let (repo, tag) = split_image(&operator);
    let pg = image_paths("build-postgres-image.sh");
    let (pg_repo, pg_tag) = (
        path_value(&pg, "POSTGRES_IMAGE_REPOSITORY"),
        path_value(&pg, "POSTGRES_IMAGE_TAG"),
    );
    let volume = HostVolume::for_claim(client, ns, &format!("data-{RELEASE}-postgresql-0")).await;
    forget_earlier_releases(ns);
    let mut all = json!({
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "postgresql": {
            "enabled": true,
            "image": {"repository": pg_repo, "tag": pg_tag, "pullPolicy": "Never"},
            "persistence": {"enabled": true, "size": "1Gi"}
        },
        "modelSecrets": [{"name": "model-api-key", "stringData": {"apiKey": "sk-e2e-not-a-real-key"}}]
    });
    if let (Some(a), Some(v)) = (all.as_object_mut(), values.as_object()) {
        a.extend(v.clone());
    }
    let values_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(values_file.path(), all.to_string()).unwrap();
    let release = Release {
        namespace: ns.to_string(),
    };
    let started = std::time::Instant::now();
    let (ok, out) = run_cmd(
        Command::new(super::scripts::helm())
            .current_dir(super::root())
            .args(["install", RELEASE, "charts/agentrun", "--namespace", ns])
            .arg("--values")
            .arg(values_file.path())
            .args(["--wait", "--timeout", "300s"]),
    );
    assert!(ok, "helm install failed: {out}\n{}", diagnose(ns));
    eprintln!(
        "real node: helm install --wait in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Installed {
        _release: release,
        volume,
    }
}

/// Waits for run `name` in `ns` to reach phase `want`; panics, with what
/// the namespace holds, when it ends otherwise or not within [`TIMEOUT`].
pub async fn wait_phase(runs: &Api<AgentRun>, ns: &str, name: &str, want: Phase) -> AgentRun {
    // Ok(Err(..)): ended in another phase, no use waiting on.
    let found = super::wait_for(&format!("{name} to be {want:?}"), TIMEOUT, || async {
        let r = runs.get(name).await.map_err(|e| e.to_string())?;
        match r.status.as_ref().and_then(|s| s.phase) {
            Some(p) if p == want => Ok(Ok(r)),
            Some(p @ (Phase::Failed | Phase::Cancelled | Phase::Succeeded)) => {
                Ok(Err(format!("{name} ended {p:?}: {:?}", r.status)))
            }
            _ => Err(format!("{:?}", r.status)),
        }
    })
    .await;
    found.unwrap_or_else(|e| panic!("{e}\n{}", diagnose(ns)))
}
