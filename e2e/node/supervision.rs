//! What a container's supervisor ([`crate::container`]) and the runners it
//! hands a container to (a process, or [`crate::in_process`]) share: the
//! container's spec, the events they report and the pod's stop signal. Its
//! own module so that both sides depend on it, not on each other.

use std::{path::PathBuf, sync::Arc};

use k8s_openapi::api::core::v1::{Container, Pod};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::{
    NodeCtx,
    env::Env,
    rewrite::SpecRewrite,
    status::{State, Terminated},
};

/// Why and by when a pod's processes must stop.
#[derive(Debug, Clone)]
pub struct Stop {
    pub reason: StopReason,
    /// SIGKILL after this instant.
    pub deadline: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The pod has a deletionTimestamp: kill, then confirm the deletion.
    Deleted,
    /// The pod object is gone already.
    Gone,
    /// The pod ran past `activeDeadlineSeconds`.
    DeadlineExceeded,
    /// The node itself is stopping.
    NodeShutdown,
}

pub type StopRx = watch::Receiver<Option<Stop>>;

/// Which container of the pod an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub init: bool,
    pub index: usize,
}

#[derive(Debug)]
pub enum Event {
    State(Slot, State),
    /// The container exited; `restarting` if it will be started again.
    Exited(Slot, Terminated, bool),
    /// The supervisor is done: the container will not run again.
    Done(Slot),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    Never,
    OnFailure,
    Always,
}

impl Restart {
    /// Whether a container that exited with `exit_code` is started again.
    pub fn wants(self, exit_code: i32) -> bool {
        match self {
            Self::Never => false,
            Self::OnFailure => exit_code != 0,
            Self::Always => true,
        }
    }
}

/// What does not change between restarts of one container.
pub struct Spec {
    pub ctx: Arc<NodeCtx>,
    pub pod: Arc<Pod>,
    pub container: Container,
    pub slot: Slot,
    pub restart: Restart,
    /// PATH, HOME and (if the container mounts a token) KUBECONFIG.
    pub base_env: Env,
    /// Its emptyDir paths and its pod's loopback ports, as they are here.
    pub rewrite: SpecRewrite,
    pub entrypoint: Option<PathBuf>,
    pub cwd: PathBuf,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub log: PathBuf,
}

/// Waits until the pod is told to stop; a dropped sender means "gone".
pub async fn next_stop(stop: &mut StopRx) -> Stop {
    match stop.wait_for(Option::is_some).await {
        Ok(s) => s.clone(),
        Err(_) => None,
    }
    .unwrap_or_else(|| Stop {
        reason: StopReason::Gone,
        deadline: Instant::now(),
    })
}
