//! The Node object: registration, Ready heartbeat and the node Lease.
//!
//! The node lifecycle controller marks a node NotReady (and taints it, which
//! evicts its pods) when neither the Lease nor the Ready condition is renewed
//! for 40 s, so both are renewed every 10 s.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tracing::{debug, warn};

use crate::NodeCtx;

const LEASE_NAMESPACE: &str = "kube-node-lease";
const LEASE_SECONDS: i32 = 40;
const RENEW_EVERY: Duration = Duration::from_secs(10);
pub const KUBELET_VERSION: &str = "v1.34.4-agentrun-process";

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn now_micro() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

fn labels(node_name: &str) -> serde_json::Value {
    json!({
        "kubernetes.io/hostname": node_name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch(),
        "type": "agentrun-process",
    })
}

/// Kubernetes spells architectures the Go way.
fn arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Creates the Node, or takes over an existing one of the same name.
pub async fn register(ctx: &NodeCtx) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": ctx.node_name, "labels": labels(&ctx.node_name) },
        "spec": {},
    }))?;
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // A previous run registered it: refresh labels, drop stale taints.
            let patch = json!({
                "metadata": { "labels": labels(&ctx.node_name) },
                "spec": { "taints": null, "unschedulable": null },
            });
            nodes
                .patch(
                    &ctx.node_name,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .context("updating the existing Node")?;
        }
        Err(e) => return Err(e).context("creating the Node"),
    }
    let transition = now();
    patch_status(ctx, &transition, true).await?;
    renew_lease(ctx).await
}

/// Renews the Ready condition and the Lease until the task is aborted.
pub async fn heartbeat(ctx: std::sync::Arc<NodeCtx>) {
    let transition = now();
    let mut tick = tokio::time::interval(RENEW_EVERY);
    tick.tick().await; // register() has just done the first round
    loop {
        tick.tick().await;
        if let Err(e) = patch_status(&ctx, &transition, false).await {
            warn!(error = %format!("{e:#}"), "node status heartbeat failed");
        }
        if let Err(e) = renew_lease(&ctx).await {
            warn!(error = %format!("{e:#}"), "node lease renewal failed");
        }
        debug!("heartbeat");
    }
}

async fn patch_status(ctx: &NodeCtx, transition: &str, full: bool) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let heartbeat = now();
    let condition = |type_: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": type_, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": heartbeat, "lastTransitionTime": transition,
        })
    };
    let mut status = json!({
        "conditions": [
            condition("Ready", "True", "KubeletReady", "process node is posting ready status"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure"),
        ],
    });
    if full {
        let resources = capacity(ctx.max_pods);
        status["addresses"] = json!([
            { "type": "InternalIP", "address": "127.0.0.1" },
            { "type": "Hostname", "address": ctx.node_name },
        ]);
        status["capacity"] = resources.clone();
        status["allocatable"] = resources;
        status["daemonEndpoints"] = json!({ "kubeletEndpoint": { "Port": 0 } });
        status["nodeInfo"] = json!({
            "architecture": arch(),
            "operatingSystem": "linux",
            "osImage": "agentrun process node",
            "kernelVersion": kernel_version(),
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "containerRuntimeVersion": "process://0.1",
            "machineID": "", "systemUUID": "", "bootID": "",
        });
    }
    nodes
        .patch_status(
            &ctx.node_name,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "status": status })),
        )
        .await
        .context("patching Node status")?;
    Ok(())
}

/// What the node advertises: 8 CPUs and 16Gi (110 pods, the kubelet's
/// default), or enough for `max_pods` step pods (50m CPU, 64Mi requested
/// each) when that is more.
fn capacity(max_pods: u32) -> serde_json::Value {
    let cpu = 8.max(max_pods.div_ceil(16));
    let memory_gi = 16.max(max_pods.div_ceil(12));
    json!({
        "cpu": cpu.to_string(),
        "memory": format!("{memory_gi}Gi"),
        "pods": max_pods.to_string(),
        "ephemeral-storage": "100Gi",
    })
}

fn kernel_version() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

async fn renew_lease(ctx: &NodeCtx) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), LEASE_NAMESPACE);
    let spec = json!({
        "holderIdentity": ctx.node_name,
        "leaseDurationSeconds": LEASE_SECONDS,
        "renewTime": now_micro(),
    });
    let patched = leases
        .patch(
            &ctx.node_name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await;
    match patched {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            // Owned by the Node so that deleting the Node garbage-collects it.
            let nodes: Api<Node> = Api::all(ctx.client.clone());
            let uid = nodes
                .get(&ctx.node_name)
                .await?
                .metadata
                .uid
                .unwrap_or_default();
            let lease: Lease = serde_json::from_value(json!({
                "metadata": {
                    "name": ctx.node_name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [{
                        "apiVersion": "v1", "kind": "Node", "name": ctx.node_name, "uid": uid,
                    }],
                },
                "spec": spec,
            }))?;
            leases
                .create(&PostParams::default(), &lease)
                .await
                .context("creating the node Lease")?;
            Ok(())
        }
        Err(e) => Err(e).context("renewing the node Lease"),
    }
}
