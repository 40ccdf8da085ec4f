//! The pod status as the node reports it through `pods/status`.
//!
//! Sent as a strategic merge patch: conditions merge by type (so conditions
//! other controllers add, like DisruptionTarget, survive) while the container
//! status lists are atomic and always sent whole.

use std::collections::BTreeMap;

use serde_json::{Value, json};

pub const NODE_IP: &str = "127.0.0.1";

pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

pub fn container_id(pid: u32) -> String {
    format!("process://{pid}")
}

#[derive(Debug, Clone, PartialEq)]
pub struct Terminated {
    pub exit_code: i32,
    pub reason: String,
    pub message: Option<String>,
    pub started_at: Option<String>,
    pub finished_at: String,
    pub pid: Option<u32>,
}

impl Terminated {
    /// "Completed" for exit 0, "Error" otherwise, as container runtimes say.
    pub fn exited(exit_code: i32, started_at: String, pid: u32) -> Self {
        Self {
            exit_code,
            reason: if exit_code == 0 { "Completed" } else { "Error" }.into(),
            message: None,
            started_at: Some(started_at),
            finished_at: now(),
            pid: Some(pid),
        }
    }

    fn to_json(&self) -> Value {
        let mut t = json!({
            "exitCode": self.exit_code,
            "reason": self.reason,
            "finishedAt": self.finished_at,
        });
        if let Some(m) = &self.message {
            t["message"] = json!(m);
        }
        if let Some(s) = &self.started_at {
            t["startedAt"] = json!(s);
        }
        if let Some(pid) = self.pid {
            t["containerID"] = json!(container_id(pid));
        }
        json!({ "terminated": t })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: String,
        pid: u32,
    },
    Terminated(Terminated),
}

impl State {
    pub fn waiting(reason: &str, message: Option<String>) -> Self {
        Self::Waiting {
            reason: reason.into(),
            message,
        }
    }
    fn to_json(&self) -> Value {
        match self {
            Self::Waiting { reason, message } => {
                let mut w = json!({ "reason": reason });
                if let Some(m) = message {
                    w["message"] = json!(m);
                }
                json!({ "waiting": w })
            }
            Self::Running { started_at, .. } => json!({ "running": { "startedAt": started_at } }),
            Self::Terminated(t) => t.to_json(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ContainerStatus {
    pub name: String,
    pub image: String,
    pub state: State,
    pub last: Option<Terminated>,
    pub restart_count: i32,
}

impl ContainerStatus {
    pub fn new(name: &str, image: &str, reason: &str) -> Self {
        Self {
            name: name.into(),
            image: image.into(),
            state: State::waiting(reason, None),
            last: None,
            restart_count: 0,
        }
    }

    pub fn succeeded(&self) -> bool {
        matches!(&self.state, State::Terminated(t) if t.exit_code == 0)
    }

    pub fn running(&self) -> bool {
        matches!(self.state, State::Running { .. })
    }

    fn pid(&self) -> Option<u32> {
        match &self.state {
            State::Running { pid, .. } => Some(*pid),
            State::Terminated(t) => t.pid,
            State::Waiting { .. } => self.last.as_ref().and_then(|t| t.pid),
        }
    }

    /// `ready` means running for app containers, completed for init ones.
    fn to_json(&self, init: bool) -> Value {
        let ready = if init {
            self.succeeded()
        } else {
            self.running()
        };
        let mut s = json!({
            "name": self.name,
            "image": self.image,
            "imageID": format!("process://{}", self.image),
            "ready": ready,
            "started": self.running(),
            "restartCount": self.restart_count,
            "state": self.state.to_json(),
            "lastState": self.last.as_ref().map_or_else(|| json!({}), Terminated::to_json),
        });
        if let Some(pid) = self.pid() {
            s["containerID"] = json!(container_id(pid));
        }
        s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
        }
    }
    pub fn terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

/// Everything the node knows about one pod's status.
#[derive(Debug)]
pub struct PodStatus {
    pub phase: Phase,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub start_time: Option<String>,
    pub sandbox_ready: bool,
    pub init: Vec<ContainerStatus>,
    pub main: Vec<ContainerStatus>,
    /// Last reported status of each condition and when it last changed.
    transitions: BTreeMap<&'static str, (bool, String)>,
}

impl PodStatus {
    pub fn new(init: Vec<ContainerStatus>, main: Vec<ContainerStatus>) -> Self {
        Self {
            phase: Phase::Pending,
            reason: None,
            message: None,
            start_time: None,
            sandbox_ready: false,
            init,
            main,
            transitions: BTreeMap::new(),
        }
    }

    pub fn initialized(&self) -> bool {
        self.init.iter().all(ContainerStatus::succeeded)
    }

    fn condition(&mut self, type_: &'static str, ok: bool, reason: Option<&str>) -> Value {
        let now = now();
        let entry = self.transitions.entry(type_).or_insert((ok, now.clone()));
        if entry.0 != ok {
            *entry = (ok, now);
        }
        let mut c = json!({
            "type": type_,
            "status": if ok { "True" } else { "False" },
            "lastTransitionTime": entry.1,
        });
        if let Some(r) = reason.filter(|_| !ok) {
            c["reason"] = json!(r);
        }
        c
    }

    /// The strategic merge patch for `pods/status`.
    pub fn patch(&mut self) -> Value {
        let initialized = self.initialized();
        let ready = self.phase == Phase::Running && self.main.iter().all(ContainerStatus::running);
        let not_ready = if self.phase.terminal() {
            "PodCompleted"
        } else {
            "ContainersNotReady"
        };
        let conditions = vec![
            self.condition("PodScheduled", true, None),
            self.condition("PodReadyToStartContainers", self.sandbox_ready, None),
            self.condition("Initialized", initialized, Some("ContainersNotInitialized")),
            self.condition("ContainersReady", ready, Some(not_ready)),
            self.condition("Ready", ready, Some(not_ready)),
        ];
        let mut status = json!({
            "phase": self.phase.as_str(),
            "conditions": conditions,
            "hostIP": NODE_IP,
            "hostIPs": [{ "ip": NODE_IP }],
            "podIP": NODE_IP,
            "podIPs": [{ "ip": NODE_IP }],
            "containerStatuses": self.main.iter().map(|c| c.to_json(false)).collect::<Vec<_>>(),
            "reason": self.reason,
            "message": self.message,
        });
        if !self.init.is_empty() {
            status["initContainerStatuses"] = json!(
                self.init
                    .iter()
                    .map(|c| c.to_json(true))
                    .collect::<Vec<_>>()
            );
        }
        if let Some(t) = &self.start_time {
            status["startTime"] = json!(t);
        }
        json!({ "status": status })
    }

    /// Succeeded when every app container exited 0, Failed otherwise.
    pub fn final_phase(&self) -> Phase {
        if self.initialized() && self.main.iter().all(ContainerStatus::succeeded) {
            Phase::Succeeded
        } else {
            Phase::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_exit_codes_and_phase() {
        let mut s = PodStatus::new(
            vec![],
            vec![ContainerStatus::new("main", "busybox", "ContainerCreating")],
        );
        s.phase = Phase::Running;
        s.main[0].state = State::Running {
            started_at: now(),
            pid: 42,
        };
        let p = s.patch();
        assert_eq!(
            p["status"]["containerStatuses"][0]["containerID"],
            "process://42"
        );
        assert_eq!(p["status"]["conditions"][4]["status"], "True");

        s.main[0].state = State::Terminated(Terminated::exited(3, now(), 42));
        assert_eq!(s.final_phase(), Phase::Failed);
        s.phase = s.final_phase();
        let p = s.patch();
        let t = &p["status"]["containerStatuses"][0]["state"]["terminated"];
        assert_eq!(t["exitCode"], 3);
        assert_eq!(t["reason"], "Error");
        assert_eq!(p["status"]["conditions"][4]["reason"], "PodCompleted");
    }

    /// A container agent's pod: the controller reads the `agent`
    /// container's own exit code, and the pod succeeds only if all did.
    #[test]
    fn each_app_container_reports_its_own_exit_code() {
        let mut s = PodStatus::new(
            vec![ContainerStatus::new(
                "install-shim",
                "agentrun",
                "PodInitializing",
            )],
            vec![
                ContainerStatus::new("step", "agentrun", "PodInitializing"),
                ContainerStatus::new("agent", "agentrun-agents:1", "PodInitializing"),
            ],
        );
        s.init[0].state = State::Terminated(Terminated::exited(0, now(), 7));
        s.main[0].state = State::Terminated(Terminated::exited(0, now(), 8));
        s.main[1].state = State::Terminated(Terminated::exited(2, now(), 9));
        assert_eq!(s.final_phase(), Phase::Failed);
        s.phase = s.final_phase();
        let p = s.patch();
        let statuses = &p["status"]["containerStatuses"];
        assert_eq!(statuses[0]["name"], "step");
        assert_eq!(statuses[0]["state"]["terminated"]["exitCode"], 0);
        assert_eq!(statuses[1]["name"], "agent");
        assert_eq!(statuses[1]["state"]["terminated"]["exitCode"], 2);
        assert_eq!(
            p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"],
            0
        );

        s.main[1].state = State::Terminated(Terminated::exited(0, now(), 9));
        assert_eq!(s.final_phase(), Phase::Succeeded);
        // An init container that failed fails the pod, whatever ran after.
        s.init[0].state = State::Terminated(Terminated::exited(1, now(), 7));
        assert_eq!(s.final_phase(), Phase::Failed);
    }
}
