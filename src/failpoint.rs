//! Failpoints: the step runner can be made to die at every boundary between
//! acting and recording, to prove that resuming loses nothing and repeats no
//! side effect. Switched on by `AGENTRUN_FAILPOINT=<name>`: the process
//! aborts (no cleanup, lease left to expire) the first time it reaches it.
//! `AGENTRUN_FAILPOINT=hang:<name>` freezes the whole process there instead
//! (SIGSTOP): a worker that is alive but lost, which only its lease tells;
//! `panic:<name>` panics there (a bug in the runner, which must name itself).
//! The controller arms a run's failpoint for its first Job only, or for
//! every attempt with the prefix `every-attempt:` (a crash loop).
//!
//! The controller has failpoints too ([`controller_all`], named
//! `controller:...`), armed the same way in its own environment and only
//! with `--allow-failpoints`: a crash of the controller at that boundary.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The record kinds the runner appends, for the append failpoints.
pub const APPENDED_KINDS: &[&str] = &[
    "ModelCall",
    "ToolIntent",
    "ToolResult",
    "ApprovalRequested",
    "ApprovalVoided",
    "Observation",
    "Summary",
];

/// Every failpoint name, in the order a step meets them.
pub fn all() -> Vec<String> {
    let mut names = vec![
        "after-lease".to_string(),
        "before-model-call".into(),
        "after-model-call".into(),
    ];
    for kind in APPENDED_KINDS {
        names.push(format!("before-append:{kind}"));
        names.push(format!("after-append:{kind}"));
    }
    names.push("before-tool-call".into());
    names.push("after-tool-call".into());
    names
}

/// The controller's failpoints: around each record it appends, after it
/// creates a Job or an Approval, and between recording a decision and
/// updating the Approval's status.
pub fn controller_all() -> Vec<String> {
    let mut names = Vec::new();
    for kind in [
        "RunStarted",
        "VersionChanged",
        "ApprovalDecided",
        "RunFinished",
    ] {
        names.push(format!("controller:before-append:{kind}"));
        names.push(format!("controller:after-append:{kind}"));
    }
    names.push("controller:after-create:Job".into());
    names.push("controller:after-create:Approval".into());
    names
}

static ARMED: OnceLock<Option<String>> = OnceLock::new();

/// Switches failpoints off for this process whatever its environment says
/// (a controller started without `--allow-failpoints`).
pub fn disable() {
    let _ = ARMED.set(None);
}

fn armed() -> Option<&'static str> {
    ARMED
        .get_or_init(|| {
            std::env::var("AGENTRUN_FAILPOINT")
                .ok()
                .filter(|s| !s.is_empty())
        })
        .as_deref()
}

/// Dies (or freezes) here if this failpoint is armed (once per process).
pub fn hit(name: &str) {
    static FIRED: AtomicBool = AtomicBool::new(false);
    let Some(armed) = armed() else { return };
    let (hang, point) = match armed.strip_prefix("hang:") {
        Some(point) => (true, point),
        None => (false, armed),
    };
    let (panics, point) = match point.strip_prefix("panic:") {
        Some(point) => (true, point),
        None => (false, point),
    };
    if point != name || FIRED.swap(true, Ordering::SeqCst) {
        return;
    }
    if panics {
        panic!("failpoint {name} reached: panicking");
    }
    if hang {
        eprintln!("agentrun step: failpoint {name} reached: freezing");
        // SAFETY: raise(2) has no memory effects; the process stops until killed.
        unsafe { libc::raise(libc::SIGSTOP) };
    } else {
        eprintln!("agentrun step: failpoint {name} reached: aborting");
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_are_unique_and_cover_every_append() {
        let all = super::all();
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len());
        assert!(all.contains(&"after-tool-call".to_string()));
        assert!(all.contains(&"before-append:ToolResult".to_string()));
    }
}
