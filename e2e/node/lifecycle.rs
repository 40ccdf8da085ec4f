//! One pod from start to deletion: pod dir, identity, init containers in
//! order, app containers together, status after every change, and the final
//! confirmation of a graceful deletion.

use std::{
    collections::BTreeMap,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{
    NodeCtx, container,
    env::Env,
    identity::{self, Identity},
    image::image_name,
    loopback::{self, PodLoopback},
    rewrite::SpecRewrite,
    status::{ContainerStatus, Phase, PodStatus, State, now},
    supervision::{self, Event, Restart, Slot, Stop, StopReason, StopRx, next_stop},
    volumes,
};

/// The binaries' dir of `image`: the one given for its last path component
/// with its tag (`agentrun:391b983`, an earlier release's build), else for
/// its repository name (`agentrun`).
fn image_bin_dir<'a>(bins: &'a BTreeMap<String, PathBuf>, image: &str) -> Option<&'a PathBuf> {
    let image = image.split('@').next().unwrap_or(image);
    let tagged = image.rsplit('/').next().unwrap_or(image);
    bins.get(tagged).or_else(|| bins.get(image_name(image)))
}

/// Copies an image's binary into a world-readable dir of the node, keyed by
/// its modification time, so a non-root pod can run what was just built even
/// when the build dir is not readable by other users (e.g. under /root).
/// Falls back to the original dir if the copy fails.
/// An image whose dir holds no binary of its name (a dir of several
/// programs, as `agentrun-agents`'s) runs from its dir in place.
fn stage_binary(state_dir: &Path, dir: &Path, name: &str) -> PathBuf {
    let src = dir.join(name);
    if !src.is_file() {
        return dir.to_path_buf();
    }
    let stamp = std::fs::metadata(&src)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let staged_dir = state_dir.join("bin").join(format!("{name}-{stamp}"));
    let staged = staged_dir.join(name);
    if staged.exists() {
        return staged_dir;
    }
    let copy = || -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&staged_dir)?;
        for d in [state_dir, &state_dir.join("bin"), &staged_dir] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
        // Pods may start together: each copies to its own temporary file.
        static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = staged_dir.join(format!(".{name}.{}.{n}", std::process::id()));
        std::fs::copy(&src, &tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &staged)
    };
    match copy() {
        Ok(()) => staged_dir,
        Err(e) => {
            tracing::warn!(binary = %src.display(), error = %e, "staging the image binary failed; using it in place");
            dir.to_path_buf()
        }
    }
}

/// The phase of a pod whose containers all ended (`phase`, from their
/// states) as `stopped` leaves it, and why when the stop decided it: past
/// its deadline it failed; a failed pod on a stopping node was cut off.
fn final_phase(
    phase: Phase,
    stopped: Option<StopReason>,
) -> (Phase, Option<(&'static str, &'static str)>) {
    match stopped {
        Some(StopReason::DeadlineExceeded) => (
            Phase::Failed,
            Some((
                "DeadlineExceeded",
                "Pod was active on the node longer than the specified deadline",
            )),
        ),
        Some(StopReason::NodeShutdown) if phase == Phase::Failed => (
            phase,
            Some((
                "NodeShutdown",
                "Pod was terminated because the process node stopped",
            )),
        ),
        _ => (phase, None),
    }
}

struct PodRun {
    ctx: Arc<NodeCtx>,
    pod: Arc<Pod>,
    api: Api<Pod>,
    name: String,
    status: PodStatus,
    dir: PathBuf,
    identity: Option<Identity>,
    token: Option<identity::TokenVolume>,
    owner: Option<(u32, u32)>,
    /// The pod's own loopback address, held while it runs.
    loopback: loopback::Lease,
    events_tx: mpsc::UnboundedSender<Event>,
    stop_tx: watch::Sender<Option<Stop>>,
    tasks: JoinSet<()>,
    /// Set when the pod object no longer exists: nothing left to report.
    gone: bool,
}

fn run_as(pod: &Pod, c: &Container) -> (Option<u32>, Option<u32>) {
    let pod_sc = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let c_sc = c.security_context.as_ref();
    let to_u32 = |v: Option<i64>| v.and_then(|v| u32::try_from(v).ok());
    let uid = c_sc
        .and_then(|s| s.run_as_user)
        .or_else(|| pod_sc.and_then(|s| s.run_as_user));
    let gid = c_sc
        .and_then(|s| s.run_as_group)
        .or_else(|| pod_sc.and_then(|s| s.run_as_group));
    (to_u32(uid), to_u32(gid))
}

fn restart_policy(pod: &Pod) -> Restart {
    match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
        Some("Never") => Restart::Never,
        Some("OnFailure") => Restart::OnFailure,
        _ => Restart::Always,
    }
}

/// Grace period of a deletion, capped: the e2e tests should not wait 30 s.
pub fn grace(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| {
            pod.spec
                .as_ref()
                .and_then(|s| s.termination_grace_period_seconds)
        })
        .unwrap_or(30)
        .clamp(0, 10);
    Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

/// Runs `pod` until it is deleted, gone, or the node stops.
pub async fn run(ctx: Arc<NodeCtx>, pod: Pod, stop: StopRx) {
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let image = |c: &Container| c.image.clone().unwrap_or_default();
    let init_reason = if spec.init_containers.as_ref().is_some_and(|v| !v.is_empty()) {
        "PodInitializing"
    } else {
        "ContainerCreating"
    };
    let status = PodStatus::new(
        spec.init_containers
            .iter()
            .flatten()
            .map(|c| ContainerStatus::new(&c.name, &image(c), "PodInitializing"))
            .collect(),
        spec.containers
            .iter()
            .map(|c| ContainerStatus::new(&c.name, &image(c), init_reason))
            .collect(),
    );
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (stop_tx, _) = watch::channel(None);
    let owner = std::iter::once(run_as(&pod, &Container::default()))
        .chain(spec.containers.iter().map(|c| run_as(&pod, c)))
        .find_map(|(uid, gid)| uid.map(|u| (u, gid.unwrap_or(0))));
    let mut run = PodRun {
        api: Api::namespaced(ctx.client.clone(), &namespace),
        dir: ctx.pods_dir().join(format!("{namespace}_{name}_{uid}")),
        token: identity::token_volume(&pod),
        loopback: ctx.loopbacks.lease(),
        pod: Arc::new(pod),
        ctx,
        name,
        status,
        identity: None,
        owner,
        events_tx,
        stop_tx,
        tasks: JoinSet::new(),
        gone: false,
    };
    run.lifecycle(events_rx, stop).await;
}

impl PodRun {
    async fn lifecycle(&mut self, events: mpsc::UnboundedReceiver<Event>, mut stop: StopRx) {
        let namespace = self.pod.metadata.namespace.as_deref().unwrap_or("");
        info!(pod = %self.name, namespace, "starting pod");
        self.warn_of_ignored_volumes();
        self.report().await;

        let setup_failed = match self.prepare(&mut stop).await {
            Ok(()) => false,
            Err(e) => {
                warn!(pod = %self.name, error = %format!("{e:#}"), "pod could not be set up");
                self.status.reason = Some("PodSetupError".into());
                self.status.message = Some(format!("{e:#}"));
                true
            }
        };
        self.run_containers(events, &mut stop, setup_failed).await;

        let reason = self.stop_tx.borrow().as_ref().map(|s| s.reason);
        let (phase, why) = final_phase(self.status.final_phase(), reason);
        self.status.phase = phase;
        if let Some((reason, message)) = why {
            self.status.reason = Some(reason.into());
            self.status.message = Some(message.into());
        }
        info!(pod = %self.name, phase = self.status.phase.as_str(), "pod finished");
        self.report().await;
        self.identity = None; // stop renewing the token

        // A completed pod stays until it is deleted; then confirm the deletion.
        let reason = match reason {
            Some(r) => r,
            None => next_stop(&mut stop).await.reason,
        };
        if reason == StopReason::Deleted && !self.gone {
            self.confirm_deletion().await;
        }
        // Logs stay in the logs dir; the pod's own dir goes with the pod.
        if matches!(reason, StopReason::Deleted | StopReason::Gone)
            && let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(pod = %self.name, error = %e, "removing the pod dir failed");
        }
    }

    /// Processes share the host filesystem: the token volume and emptyDirs
    /// (`volumes.rs`) are all that mean something.
    fn warn_of_ignored_volumes(&self) {
        for v in self
            .pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
        {
            let token = self.token.as_ref().is_some_and(|t| t.volume == v.name);
            if !token && v.empty_dir.is_none() {
                warn!(pod = %self.name, volume = %v.name, "volume ignored by the process node");
            }
        }
    }

    /// Runs the containers until every one has ended: init containers one
    /// after another, then app containers together; stopped when the pod
    /// is, or at its deadline.
    async fn run_containers(
        &mut self,
        mut events: mpsc::UnboundedReceiver<Event>,
        stop: &mut StopRx,
        setup_failed: bool,
    ) {
        let deadline = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.active_deadline_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(|s| Instant::now() + Duration::from_secs(s));
        let init_count = self.status.init.len();
        let mut next_init = 0;
        let mut active = 0;
        if !self.is_stopping() && !setup_failed {
            if init_count > 0 {
                active += usize::from(self.start(Slot {
                    init: true,
                    index: 0,
                }));
                next_init = 1;
            } else {
                active += self.start_main();
            }
        }
        // What was started reports itself (a container's first event); a
        // pod that started nothing ends at once and reports after.

        while active > 0 {
            tokio::select! {
                Some(event) = events.recv() => {
                    let mut batch = vec![event];
                    while let Ok(e) = events.try_recv() {
                        batch.push(e);
                    }
                    for event in batch {
                        let Event::Done(slot) = event else {
                            self.apply(event);
                            continue;
                        };
                        active -= 1;
                        // An init container that succeeded lets the next step start.
                        let ok = self.status.init.get(slot.index).is_some_and(ContainerStatus::succeeded);
                        if slot.init && ok && !self.is_stopping() {
                            if next_init < init_count {
                                active += usize::from(self.start(Slot { init: true, index: next_init }));
                                next_init += 1;
                            } else {
                                active += self.start_main();
                            }
                        }
                    }
                    // The pod's last change is reported once, with its final phase, after.
                    if active > 0 {
                        self.report().await;
                    }
                }
                s = next_stop(stop), if !self.is_stopping() => self.stop(s),
                () = sleep_until(deadline), if !self.is_stopping() => {
                    let deadline = Instant::now() + grace(&self.pod);
                    self.stop(Stop { reason: StopReason::DeadlineExceeded, deadline });
                }
            }
        }
        while self.tasks.join_next().await.is_some() {}
    }

    fn is_stopping(&self) -> bool {
        self.stop_tx.borrow().is_some()
    }

    fn stop(&mut self, stop: Stop) {
        info!(pod = %self.name, reason = ?stop.reason, "stopping pod");
        if stop.reason == StopReason::Gone {
            self.gone = true;
        }
        self.stop_tx.send_replace(Some(stop));
    }

    /// Pod dir and identity; retried like the kubelet until they work or the pod stops.
    async fn prepare(&mut self, stop: &mut StopRx) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        if let Some((uid, gid)) = self.owner {
            std::os::unix::fs::chown(&self.dir, Some(uid), Some(gid))?;
        } else {
            std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o755))?;
        }
        if let Some(spec) = &self.pod.spec {
            volumes::create(&self.dir, spec)?;
        }
        if let Some(token) = self.token.clone() {
            loop {
                match identity::provision(
                    self.ctx.clone(),
                    &self.pod,
                    token.clone(),
                    &self.dir,
                    self.owner,
                )
                .await
                {
                    Ok(id) => {
                        self.identity = Some(id);
                        break;
                    }
                    Err(e) => {
                        let message = format!("service-account token: {e:#}");
                        warn!(pod = %self.name, error = %message, "retrying");
                        for c in self
                            .status
                            .init
                            .iter_mut()
                            .chain(self.status.main.iter_mut())
                        {
                            c.state =
                                State::waiting("CreateContainerConfigError", Some(message.clone()));
                        }
                        self.report().await;
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                            s = next_stop(stop) => {
                                self.stop(s);
                                return Ok(());
                            }
                        }
                    }
                }
            }
        }
        self.status.sandbox_ready = true;
        self.status.start_time = Some(now());
        Ok(())
    }

    /// Starts every app container; returns how many were started.
    fn start_main(&mut self) -> usize {
        self.status.phase = Phase::Running;
        (0..self.status.main.len())
            .filter(|&index| self.start(Slot { init: false, index }))
            .count()
    }

    fn container(&self, slot: Slot) -> Option<&Container> {
        let spec = self.pod.spec.as_ref()?;
        if slot.init {
            spec.init_containers.as_ref()?.get(slot.index)
        } else {
            spec.containers.get(slot.index)
        }
    }

    /// Spawns the container's supervisor; false if the pod has no such container.
    fn start(&mut self, slot: Slot) -> bool {
        let Some(container) = self.container(slot).cloned() else {
            return false;
        };
        let namespace = self.pod.metadata.namespace.as_deref().unwrap_or("default");
        let image = container.image.clone().unwrap_or_default();
        let image_dir = image_bin_dir(&self.ctx.image_bins, &image)
            .map(|dir| stage_binary(&self.ctx.state_dir, dir, image_name(&image)));

        let mut base = Env::default();
        let path = match &image_dir {
            Some(dir) => format!("{}:{}", dir.display(), self.ctx.host_path),
            None => self.ctx.host_path.clone(),
        };
        base.set("PATH", path);
        base.set("HOME", self.dir.display().to_string());
        let mounts_token = self
            .token
            .as_ref()
            .is_some_and(|t| identity::mounts(&container, t));
        if let (true, Some(id)) = (mounts_token, &self.identity) {
            base.set("KUBECONFIG", id.kubeconfig.display().to_string());
        }
        let rewrite = self.rewrite(&container);
        let cwd = container
            .working_dir
            .as_deref()
            .map(|d| PathBuf::from(rewrite.apply(d)))
            .filter(|d| d.is_dir())
            .unwrap_or_else(|| self.dir.clone());
        let (uid, gid) = run_as(&self.pod, &container);
        let restart = match (slot.init, restart_policy(&self.pod)) {
            // Init containers must succeed once; they are retried unless Never.
            (true, Restart::Always) => Restart::OnFailure,
            (_, r) => r,
        };
        let spec = supervision::Spec {
            rewrite,
            entrypoint: image_dir.map(|d| d.join(image_name(&image))),
            log: self
                .ctx
                .logs_dir()
                .join(format!("{namespace}_{}_{}.log", self.name, container.name)),
            ctx: self.ctx.clone(),
            pod: self.pod.clone(),
            container,
            slot,
            restart,
            base_env: base,
            cwd,
            uid,
            gid,
        };
        self.tasks.spawn(container::supervise(
            spec,
            self.events_tx.clone(),
            self.stop_tx.subscribe(),
        ));
        true
    }

    /// How the container's spec strings read on this node.
    fn rewrite(&self, container: &Container) -> SpecRewrite {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let loopback = PodLoopback {
            addr: self.loopback.addr,
            ports: self.ctx.pod_loopback_ports.clone(),
        };
        SpecRewrite::of(&self.dir, &spec, container, loopback)
    }

    fn apply(&mut self, event: Event) {
        let slot = match &event {
            Event::State(s, _) | Event::Exited(s, _, _) | Event::Done(s) => *s,
        };
        let list = if slot.init {
            &mut self.status.init
        } else {
            &mut self.status.main
        };
        let Some(c) = list.get_mut(slot.index) else {
            return;
        };
        match event {
            Event::State(_, state) => c.state = state,
            Event::Exited(_, t, true) => {
                c.restart_count += 1;
                c.state = State::waiting(
                    "CrashLoopBackOff",
                    Some(format!("back-off restarting container {}", c.name)),
                );
                c.last = Some(t);
            }
            Event::Exited(_, t, false) => c.state = State::Terminated(t),
            Event::Done(_) => {}
        }
    }

    /// Patches `pods/status`; a 404 means the pod is gone and must stop.
    async fn report(&mut self) {
        if self.gone {
            return;
        }
        let patch = self.status.patch();
        match self
            .api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {
                self.stop(Stop {
                    reason: StopReason::Gone,
                    deadline: Instant::now() + Duration::from_secs(1),
                });
            }
            Err(e) => warn!(pod = %self.name, error = %e, "status update failed"),
        }
    }

    /// Processes are dead: let the API server remove the object (finalizers
    /// of other controllers still hold it until they are done).
    async fn confirm_deletion(&self) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: self.pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.api.delete(&self.name, &params).await {
            Ok(_) => info!(pod = %self.name, "pod deletion confirmed"),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => warn!(pod = %self.name, error = %e, "confirming pod deletion failed"),
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::{Phase, StopReason, final_phase, image_bin_dir, image_name};

    #[test]
    fn a_stop_decides_the_phase_only_past_the_deadline_or_on_a_stopping_node() {
        let past = final_phase(Phase::Succeeded, Some(StopReason::DeadlineExceeded));
        assert_eq!(past.0, Phase::Failed);
        assert_eq!(past.1.map(|(reason, _)| reason), Some("DeadlineExceeded"));
        let cut = final_phase(Phase::Failed, Some(StopReason::NodeShutdown));
        assert_eq!(cut.0, Phase::Failed);
        assert_eq!(cut.1.map(|(reason, _)| reason), Some("NodeShutdown"));
        // A pod that succeeded before the node stopped, or was deleted, or
        // was not stopped at all, keeps what its containers say.
        for stopped in [
            Some(StopReason::NodeShutdown),
            Some(StopReason::Deleted),
            None,
        ] {
            assert_eq!(
                final_phase(Phase::Succeeded, stopped),
                (Phase::Succeeded, None)
            );
        }
        assert_eq!(
            final_phase(Phase::Failed, Some(StopReason::Gone)),
            (Phase::Failed, None)
        );
    }

    #[test]
    fn image_names_ignore_registry_and_tag() {
        assert_eq!(image_name("agentrun"), "agentrun");
        assert_eq!(image_name("registry.example/x/agentrun:0.1"), "agentrun");
        assert_eq!(image_name("localhost:5000/agentrun"), "agentrun");
        assert_eq!(image_name("busybox:1.36"), "busybox");
        assert_eq!(image_name("x/agentrun@sha256:abc"), "agentrun");
    }

    #[test]
    fn a_tagged_image_bin_is_chosen_before_the_untagged_one() {
        let bins = [("agentrun", "/new"), ("agentrun:391b983", "/old")]
            .map(|(n, d)| (n.to_string(), std::path::PathBuf::from(d)))
            .into();
        let dir = |image| image_bin_dir(&bins, image).map(|d| d.to_str().unwrap());
        assert_eq!(dir("agentrun:391b983"), Some("/old"));
        assert_eq!(dir("registry.example/agentrun:391b983"), Some("/old"));
        assert_eq!(dir("agentrun:dev"), Some("/new"));
        assert_eq!(dir("busybox"), None);
    }
}
