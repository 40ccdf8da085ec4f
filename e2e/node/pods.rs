//! Watches the pods bound to this node and keeps one lifecycle task per pod.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    ResourceExt as _,
    api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions},
    runtime::{WatchStreamExt as _, watcher},
};
use serde_json::json;
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tracing::{info, warn};

use crate::{
    NodeCtx, lifecycle,
    status::{NODE_IP, now},
    supervision::{Stop, StopReason},
};

enum Tracked {
    /// Running (or finished and waiting for deletion) under this node.
    Active {
        stop: watch::Sender<Option<Stop>>,
        task: JoinHandle<()>,
    },
    /// Not ours to run (finished before, or lost by a restart); at most one
    /// deletion confirmation is sent for it.
    Ignored { delete_sent: bool },
}

struct Manager {
    ctx: Arc<NodeCtx>,
    pods: HashMap<String, Tracked>,
    /// Until the first full list, unknown running pods are leftovers of a
    /// previous run of this node.
    synced: bool,
    listed: HashSet<String>,
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn terminal(pod: &Pod) -> bool {
    matches!(phase(pod), "Succeeded" | "Failed")
}

/// A pod some earlier run of this node started (it has a start time or
/// container states); a pod that only got bound while the node was down never
/// ran and is simply started.
fn was_started(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|s| {
        s.start_time.is_some() || s.container_statuses.as_ref().is_some_and(|c| !c.is_empty())
    })
}

/// Runs the pod watch until `shutdown`, then stops every pod.
pub async fn run(ctx: Arc<NodeCtx>, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node_name));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut manager = Manager {
        ctx,
        pods: HashMap::new(),
        synced: false,
        listed: HashSet::new(),
    };
    loop {
        tokio::select! {
            () = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                manager.shutdown().await;
                return Ok(());
            }
            event = stream.next() => match event {
                Some(Ok(event)) => manager.handle(event).await,
                Some(Err(e)) => warn!(error = %e, "pod watch error"),
                None => anyhow::bail!("pod watch ended"),
            },
        }
    }
}

impl Manager {
    async fn handle(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => self.listed.clear(),
            watcher::Event::InitApply(pod) => {
                self.listed.insert(pod.uid().unwrap_or_default());
                self.apply(pod, !self.synced).await;
            }
            watcher::Event::InitDone => {
                self.synced = true;
                // Pods missed while the watch was down: deleted meanwhile.
                let missing: Vec<String> = self
                    .pods
                    .keys()
                    .filter(|uid| !self.listed.contains(*uid))
                    .cloned()
                    .collect();
                for uid in missing {
                    self.forget(&uid);
                }
            }
            watcher::Event::Apply(pod) => self.apply(pod, false).await,
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.uid() {
                    self.forget(&uid);
                }
            }
        }
    }

    /// The pod object is gone: kill whatever still runs for it.
    fn forget(&mut self, uid: &str) {
        if let Some(Tracked::Active { stop, .. }) = self.pods.remove(uid) {
            stop.send_if_modified(|s| {
                if s.is_some() {
                    return false;
                }
                *s = Some(Stop {
                    reason: StopReason::Gone,
                    deadline: Instant::now() + Duration::from_secs(1),
                });
                true
            });
        }
    }

    async fn apply(&mut self, pod: Pod, initial: bool) {
        let Some(uid) = pod.uid() else { return };
        let deleting = pod.metadata.deletion_timestamp.is_some();
        match self.pods.get_mut(&uid) {
            Some(Tracked::Active { stop, .. }) => {
                if deleting {
                    let deadline = Instant::now() + lifecycle::grace(&pod);
                    // Only the first deletion notice counts.
                    stop.send_if_modified(|s| {
                        if s.is_some() {
                            return false;
                        }
                        *s = Some(Stop {
                            reason: StopReason::Deleted,
                            deadline,
                        });
                        true
                    });
                }
            }
            Some(Tracked::Ignored { delete_sent }) => {
                if deleting && !*delete_sent {
                    *delete_sent = true;
                    confirm_deletion(&self.ctx, &pod).await;
                }
            }
            None => {
                if terminal(&pod) || deleting || (initial && was_started(&pod)) {
                    if !terminal(&pod) && was_started(&pod) {
                        mark_node_restarted(&self.ctx, &pod).await;
                    }
                    if deleting {
                        confirm_deletion(&self.ctx, &pod).await;
                    }
                    self.pods.insert(
                        uid,
                        Tracked::Ignored {
                            delete_sent: deleting,
                        },
                    );
                    return;
                }
                let (stop, stop_rx) = watch::channel(None);
                let task = tokio::spawn(lifecycle::run(self.ctx.clone(), pod, stop_rx));
                self.pods.insert(uid, Tracked::Active { stop, task });
            }
        }
    }

    /// Stops every pod within ~2 s (the node gets 5 s after SIGTERM).
    async fn shutdown(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut tasks = Vec::new();
        for (_, tracked) in self.pods.drain() {
            if let Tracked::Active { stop, task } = tracked {
                stop.send_if_modified(|s| {
                    if s.is_some() {
                        return false;
                    }
                    *s = Some(Stop {
                        reason: StopReason::NodeShutdown,
                        deadline,
                    });
                    true
                });
                tasks.push(task);
            }
        }
        info!(pods = tasks.len(), "waiting for pods to stop");
        futures::future::join_all(tasks).await;
    }
}

/// Confirms a graceful deletion of a pod this node does not run.
async fn confirm_deletion(ctx: &NodeCtx, pod: &Pod) {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&pod.name_any(), &params).await {
        Ok(_) => info!(pod = %pod.name_any(), "deletion confirmed"),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(e) => warn!(pod = %pod.name_any(), error = %e, "confirming deletion failed"),
    }
}

/// A pod that a previous run of this node started: its processes are lost
/// with the node that ran them, so it fails instead of hanging as Running.
async fn mark_node_restarted(ctx: &NodeCtx, pod: &Pod) {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
    let lost = |statuses: Option<&Vec<k8s_openapi::api::core::v1::ContainerStatus>>| {
        statuses
            .into_iter()
            .flatten()
            .map(|cs| {
                let mut v = serde_json::to_value(cs).unwrap_or_else(|_| json!({ "name": cs.name }));
                let done = cs.state.as_ref().is_some_and(|s| s.terminated.is_some());
                if !done {
                    v["state"] = json!({ "terminated": {
                        "exitCode": 137,
                        "reason": "ContainerStatusUnknown",
                        "message": "The container could not be located when the pod was terminated",
                        "finishedAt": now(),
                    }});
                    v["ready"] = json!(false);
                    v["started"] = json!(false);
                }
                v
            })
            .collect::<Vec<_>>()
    };
    let status = pod.status.as_ref();
    let not_ready = |t: &str| json!({ "type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": now() });
    let patch = json!({ "status": {
        "phase": "Failed",
        "reason": "NodeRestarted",
        "message": "The process node restarted and lost this pod's processes",
        "hostIP": NODE_IP,
        "podIP": NODE_IP,
        "conditions": [not_ready("Ready"), not_ready("ContainersReady")],
        "containerStatuses": lost(status.and_then(|s| s.container_statuses.as_ref())),
        "initContainerStatuses": lost(status.and_then(|s| s.init_container_statuses.as_ref())),
    }});
    match api
        .patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(patch),
        )
        .await
    {
        Ok(_) => info!(pod = %pod.name_any(), "marked Failed: NodeRestarted"),
        Err(e) => warn!(pod = %pod.name_any(), error = %e, "marking lost pod failed"),
    }
}

/// Fallback scheduler: binds pending pods that have no node to this one.
pub async fn bind_unscheduled(ctx: Arc<NodeCtx>) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().fields("spec.nodeName=");
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        let pod = match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => pod,
            Ok(_) => continue,
            Err(e) => {
                warn!(error = %e, "unscheduled pod watch error");
                continue;
            }
        };
        let unbound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_none());
        if !unbound || pod.metadata.deletion_timestamp.is_some() || terminal(&pod) {
            continue;
        }
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": { "name": name, "namespace": ns, "uid": pod.uid() },
            "target": { "apiVersion": "v1", "kind": "Node", "name": ctx.node_name },
        });
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        match pods
            .create_subresource::<_, serde_json::Value>(
                "binding",
                &name,
                &PostParams::default(),
                &binding,
            )
            .await
        {
            Ok(_) => info!(pod = %name, namespace = %ns, "bound pod to this node"),
            // The scheduler (or a previous event) bound it first.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => warn!(pod = %name, error = %e, "binding pod failed"),
        }
    }
}
