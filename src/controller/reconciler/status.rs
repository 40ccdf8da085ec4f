//! Composing the run's status from its log: only what `kubectl get` and a
//! controller restart need, the same size whatever the log's length.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::{
    AgentRun, AgentRunStatus, CurrentStep, LogRef, PendingApproval, Phase, PinnedVersions,
    SigningKey, Usage,
};
use crate::controller::conditions::{condition, set_condition};
use crate::controller::reconciler::phase::{JobState, JobView, deadline};
use crate::replay::RunState;
use crate::runlog::records::{Outcome, RunFinished};
use crate::store::Head;

pub use crate::api::signing::{bound_from, key_windows, signature_rules, signed_from, windows_of};

/// Longest `status.result` / `status.error`: a run's status stays small
/// (etcd objects are limited, and every watcher receives it) whatever the
/// agent wrote.
pub const MAX_TEXT_BYTES: usize = 4096;

/// `text`, or its first `MAX_TEXT_BYTES` with a note saying where the rest is.
pub fn excerpt(text: &str) -> String {
    if text.len() <= MAX_TEXT_BYTES {
        return text.to_string();
    }
    format!(
        "{}… [{} bytes in all; the full text is in the step log's RunFinished record: kubectl agentrun log]",
        crate::text::prefix(text, MAX_TEXT_BYTES),
        text.len()
    )
}

/// Condition type that is True while the controller cannot reconcile the run
/// (kstatus reads it), with the error as its message.
pub const STALLED: &str = "Stalled";

/// Condition type that is True once a run succeeded, False once it ended otherwise.
pub const SUCCEEDED: &str = "Succeeded";

/// [`signed_from`], for a run not fixed yet the head `len` it continues
/// from (what a new step Job of this release is given).
pub fn signed_from_at(run: &AgentRun, len: u64) -> u64 {
    match signed_from(run) {
        u64::MAX => len,
        n => n,
    }
}

/// The `signedFrom` a status written now records: kept once set; for a run
/// an earlier release began, the head once no step Job runs (a running one
/// is the earlier release's worker, or this release's first, and both have
/// ended before the next status fixes it).
fn signed_from_to_write(run: &AgentRun, head: &Head, job: Option<&JobView>) -> Option<u64> {
    match run.status.as_ref().and_then(|s| s.log.as_ref()) {
        None => Some(0),
        Some(log) => log.signed_from.or_else(|| {
            let working = job.is_some_and(|j| j.state == JobState::Active);
            (!working).then_some(head.len)
        }),
    }
}

/// [`bound_from`] for a new step Job continuing from head `len`.
pub fn bound_from_at(run: &AgentRun, len: u64) -> u64 {
    match bound_from(run) {
        u64::MAX => len,
        n => n,
    }
}

/// The `boundFrom` a status written now records: as [`signed_from_to_write`].
fn bound_from_to_write(run: &AgentRun, head: &Head, job: Option<&JobView>) -> Option<u64> {
    match run.status.as_ref().and_then(|s| s.log.as_ref()) {
        None => Some(0),
        Some(log) => log.bound_from.or_else(|| {
            let working = job.is_some_and(|j| j.state == JobState::Active);
            (!working).then_some(head.len)
        }),
    }
}

/// The `signingKeys` a status written now records, by a controller signing
/// with key `current` at head `len`: those recorded, and `current` from
/// `len` on when another key was the last one (a rotation: the key before
/// it signs nothing from there on), or from seq 0 for a run with no status
/// yet. The same for a new step Job, so its runner applies the windows
/// before the status is written.
pub fn signing_keys_to_write(run: &AgentRun, len: u64, current: &str) -> Vec<SigningKey> {
    let log = run.status.as_ref().and_then(|s| s.log.as_ref());
    let mut keys = log.and_then(|l| l.signing_keys.clone()).unwrap_or_default();
    if keys.last().is_some_and(|k| k.key == current) {
        return keys;
    }
    // Never before a key recorded already (heads do not move backwards).
    let from = match log {
        None => 0,
        Some(_) => len.max(keys.last().map_or(0, |k| k.from)),
    };
    keys.push(SigningKey {
        key: current.to_string(),
        from,
    });
    keys
}

/// The status a run should have now.
#[allow(clippy::too_many_arguments)]
pub fn compose(
    run: &AgentRun,
    base: AgentRunStatus,
    log: &RunState,
    head: &Head,
    store: &str,
    step: Option<CurrentStep>,
    concluded: Option<&RunFinished>,
    job: Option<&JobView>,
    awaiting: Option<&(String, Timestamp)>,
    signing_key: &str,
    now: Timestamp,
) -> AgentRunStatus {
    let mut s = base;
    let generation = run.metadata.generation;
    s.log = Some(log_ref(run, head, store, job, signing_key));
    s.usage = Some(usage(log, head));
    s.pinned = pinned(log);
    s.step = step;
    if awaiting.is_none() {
        s.approval = None;
    }
    if !log.is_empty() && s.started_at.is_none() {
        s.started_at = Some(Time(now));
    }
    s.deadline_at = deadline_at(run, &s);
    // Reaching here, this reconcile made progress: a stall is over.
    end_stall(&mut s, generation, now);
    match (log.finished.as_ref().or(concluded), awaiting) {
        (Some(f), _) => set_finished(&mut s, f, generation, now),
        (None, _) if log.is_empty() => {}
        (None, Some((name, expires_at))) => {
            set_awaiting(&mut s, name, *expires_at, generation, now)
        }
        (None, None) => set_running(&mut s, job, generation, now),
    }
    s
}

/// Where the run's log is and how far it reaches, with the signature rules
/// its readers apply (`signing_key`: the id of the key this controller signs with).
fn log_ref(
    run: &AgentRun,
    head: &Head,
    store: &str,
    job: Option<&JobView>,
    signing_key: &str,
) -> LogRef {
    LogRef {
        store: store.to_string(),
        run_key: crate::api::RunUid::of(run).into(),
        length: head.len,
        head_hash: (!head.hash.is_zero()).then(|| head.hash.to_hex()),
        signed_from: signed_from_to_write(run, head, job),
        bound_from: bound_from_to_write(run, head, job),
        signing_keys: Some(signing_keys_to_write(run, head.len, signing_key)),
        // Set by the reconcile, which holds the signing key.
        checkpoint: None,
    }
}

/// What the run spent so far, as its log records it (cost to the micro-dollar).
fn usage(log: &RunState, head: &Head) -> Usage {
    Usage {
        input_tokens: log.spent.input_tokens,
        output_tokens: log.spent.output_tokens,
        cost_usd: (log.spent.cost_usd * 1e6).round() / 1e6,
        steps: head.len,
    }
}

/// The versions the run pinned when it started (none before).
fn pinned(log: &RunState) -> Option<PinnedVersions> {
    log.snapshot.as_ref().map(|snap| PinnedVersions {
        prompt_version: snap.versions.prompt_version.clone(),
        prompt_hash: snap.versions.prompt_hash.clone(),
        model: snap.versions.model.clone(),
        tool_schema_hash: snap.versions.tool_schema_hash.clone(),
        agent_generation: snap.versions.agent_generation,
    })
}

/// The deadline of the run with status `s` (it counts from `startedAt`,
/// which `s` may have just set).
fn deadline_at(run: &AgentRun, s: &AgentRunStatus) -> Option<Time> {
    let mut probe = run.clone();
    probe.status = Some(s.clone());
    deadline(&probe).map(Time)
}

/// Turns a True `Stalled` condition False, and drops the error it put in
/// the status.
fn end_stall(s: &mut AgentRunStatus, generation: Option<i64>, now: Timestamp) {
    if !s
        .conditions
        .iter()
        .any(|c| c.type_ == STALLED && c.status == "True")
    {
        return;
    }
    s.error = None;
    set_condition(
        &mut s.conditions,
        condition(
            STALLED,
            false,
            "Reconciled",
            "the controller reconciles the run again",
            generation,
            now,
        ),
    );
}

/// A run that ended as `f` records: its final phase, its result or error,
/// when it finished, and whether it succeeded.
fn set_finished(s: &mut AgentRunStatus, f: &RunFinished, generation: Option<i64>, now: Timestamp) {
    let phase = f.outcome.phase();
    s.phase = Some(phase);
    // Model-written text of any size: the status keeps an excerpt,
    // the log keeps all of it.
    s.result = f.result.as_deref().map(excerpt);
    s.error = f.error.as_deref().map(excerpt);
    s.waiting_on = None;
    if s.finished_at.is_none() {
        s.finished_at = Some(Time(now));
    }
    let (ok, reason, message) = match f.outcome {
        Outcome::Succeeded => (true, "Succeeded", "the agent finished".to_string()),
        // Failed, and why: the agent is not deterministic given its inputs.
        Outcome::Diverged => (false, "Diverged", f.error.clone().unwrap_or_default()),
        _ => (
            false,
            phase_name(phase),
            f.error.clone().unwrap_or_default(),
        ),
    };
    set_condition(
        &mut s.conditions,
        condition(SUCCEEDED, ok, reason, &message, generation, now),
    );
}

/// A run waiting for approval `name`, which expires at `expires_at`: not
/// succeeded yet, nor failed.
fn set_awaiting(
    s: &mut AgentRunStatus,
    name: &str,
    expires_at: Timestamp,
    generation: Option<i64>,
    now: Timestamp,
) {
    s.phase = Some(Phase::AwaitingApproval);
    s.waiting_on = Some(format!("approval/{name}"));
    s.approval = Some(PendingApproval {
        name: name.to_string(),
        expires_at: Some(Time(expires_at)),
    });
    let message = format!("waiting for approval {name}");
    let mut c = condition(
        SUCCEEDED,
        false,
        "AwaitingApproval",
        &message,
        generation,
        now,
    );
    c.status = "Unknown".into();
    set_condition(&mut s.conditions, c);
}

/// A running run: it waits on its step's Job, and its condition says which
/// step runs, or why the last attempt failed.
fn set_running(
    s: &mut AgentRunStatus,
    job: Option<&JobView>,
    generation: Option<i64>,
    now: Timestamp,
) {
    s.phase = Some(Phase::Running);
    s.waiting_on = s
        .step
        .as_ref()
        .and_then(|st| st.job.as_ref())
        .map(|j| format!("job/{j}"));
    let message = match job.map(|j| &j.state) {
        Some(JobState::Failed { reason, .. }) => {
            format!("last step attempt failed: {reason}")
        }
        // Nothing that moves with each record (the log's length is in
        // `status.log`): progress alone stays a progress-only change.
        _ => match &s.step {
            Some(st) => format!("step {} attempt {} runs", st.seq, st.attempt),
            None => "the run is starting".to_string(),
        },
    };
    let mut c = condition(SUCCEEDED, false, "Running", &message, generation, now);
    c.status = "Unknown".into();
    set_condition(&mut s.conditions, c);
}

/// Condition type: whether the platform's policies let the run go on.
pub const ALLOWED: &str = "Allowed";

/// Sets `Allowed` for a run that waits for a policy (`awaited`: what and
/// why) or no longer does; returns the Event to publish when it changed
/// (warning, reason, message). A run never held back gets no condition.
pub fn set_allowed(
    s: &mut AgentRunStatus,
    awaited: Option<(&str, &str)>,
    generation: Option<i64>,
    now: Timestamp,
) -> Option<(bool, &'static str, String)> {
    let was = s.conditions.iter().find(|c| c.type_ == ALLOWED);
    let was_waiting = was.is_some_and(|c| c.status == "False");
    match awaited {
        Some((waiting_on, message)) => {
            s.waiting_on = Some(waiting_on.to_string());
            let changed = was.is_none_or(|c| c.status != "False" || c.message != message);
            let c = condition(ALLOWED, false, "WaitingForPolicy", message, generation, now);
            set_condition(&mut s.conditions, c);
            changed.then(|| (true, "WaitingForPolicy", message.to_string()))
        }
        None if was_waiting => {
            let message = "the platform's policies allow the run";
            let c = condition(ALLOWED, true, "Allowed", message, generation, now);
            set_condition(&mut s.conditions, c);
            Some((false, "PolicyAllowed", message.to_string()))
        }
        None => None,
    }
}

/// Condition type: whether the MCP tools of the run's agent were discovered.
pub const TOOLS_DISCOVERED: &str = "ToolsDiscovered";

/// What `status.waitingOn` says while discovery fails.
pub const WAITING_ON_DISCOVERY: &str = "mcp/discovery";

/// Sets `ToolsDiscovered` for a run whose MCP discovery failed (`failed`:
/// why, naming the server; it is asked again) or no longer does; returns
/// the Event to publish when it changed. A run never held back gets none.
pub fn set_discovered(
    s: &mut AgentRunStatus,
    failed: Option<&str>,
    generation: Option<i64>,
    now: Timestamp,
) -> Option<(bool, &'static str, String)> {
    let was = s.conditions.iter().find(|c| c.type_ == TOOLS_DISCOVERED);
    let was_failing = was.is_some_and(|c| c.status == "False");
    match failed {
        Some(reason) => {
            s.waiting_on = Some(WAITING_ON_DISCOVERY.to_string());
            let message = format!("{reason} (asked again with a backoff until the run's deadline)");
            let changed = was.is_none_or(|c| c.status != "False" || c.message != message);
            let c = condition(
                TOOLS_DISCOVERED,
                false,
                "DiscoveryFailed",
                &message,
                generation,
                now,
            );
            set_condition(&mut s.conditions, c);
            changed.then_some((true, "DiscoveryFailed", message))
        }
        None if was_failing => {
            let message = "the agent's MCP tools were discovered";
            let c = condition(
                TOOLS_DISCOVERED,
                true,
                "Discovered",
                message,
                generation,
                now,
            );
            set_condition(&mut s.conditions, c);
            Some((false, "ToolsDiscovered", message.to_string()))
        }
        None => None,
    }
}

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Pending => "Pending",
        Phase::Running => "Running",
        Phase::AwaitingApproval => "AwaitingApproval",
        Phase::Succeeded => "Succeeded",
        Phase::Failed => "Failed",
        Phase::Cancelled => "Cancelled",
        Phase::BudgetExceeded => "BudgetExceeded",
        Phase::DeadlineExceeded => "DeadlineExceeded",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::KeyWindows;

    /// A run whose status records `keys` (`None`: a status without them,
    /// as an earlier release wrote it; no status at all for `Err`).
    fn run_with(keys: Result<Option<Vec<(&str, u64)>>, ()>) -> AgentRun {
        let mut run = AgentRun::new("r", Default::default());
        if let Ok(keys) = keys {
            run.status = Some(AgentRunStatus {
                log: Some(LogRef {
                    length: 5,
                    signing_keys: keys.map(|k| {
                        k.into_iter()
                            .map(|(key, from)| SigningKey {
                                key: key.into(),
                                from,
                            })
                            .collect()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        run
    }

    fn keys(list: &[SigningKey]) -> Vec<(&str, u64)> {
        list.iter().map(|k| (k.key.as_str(), k.from)).collect()
    }

    #[test]
    fn a_status_records_which_key_signs_from_which_seq() {
        // A new run: the current key from seq 0; no retired key counts.
        let new = run_with(Err(()));
        assert_eq!(keys(&signing_keys_to_write(&new, 1, "b")), [("b", 0)]);
        assert_eq!(key_windows(&new), KeyWindows::Recorded(vec![]));
        // Signed by the same key: unchanged.
        let same = run_with(Ok(Some(vec![("b", 0)])));
        assert_eq!(keys(&signing_keys_to_write(&same, 9, "b")), [("b", 0)]);
        // A rotation: the new key from the head this status records.
        let rotated = run_with(Ok(Some(vec![("a", 0)])));
        assert_eq!(
            keys(&signing_keys_to_write(&rotated, 9, "b")),
            [("a", 0), ("b", 9)]
        );
        // Never before a key already recorded.
        let ahead = run_with(Ok(Some(vec![("a", 0), ("b", 12)])));
        assert_eq!(
            keys(&signing_keys_to_write(&ahead, 9, "c")),
            [("a", 0), ("b", 12), ("c", 12)]
        );
        // An earlier release's run: unbounded until this status records the
        // current key from its head (what was before keeps verifying).
        let earlier = run_with(Ok(None));
        assert_eq!(key_windows(&earlier), KeyWindows::Unrecorded);
        assert_eq!(keys(&signing_keys_to_write(&earlier, 5, "b")), [("b", 5)]);
        assert_eq!(
            key_windows(&rotated),
            KeyWindows::Recorded(vec![("a".into(), 0)])
        );
    }

    #[test]
    fn long_answers_keep_a_bounded_excerpt_that_says_where_the_rest_is() {
        assert_eq!(excerpt("short"), "short");
        let long = "é".repeat(MAX_TEXT_BYTES);
        let cut = excerpt(&long);
        assert!(cut.len() < MAX_TEXT_BYTES + 200, "{}", cut.len());
        assert!(cut.contains(&format!("{} bytes in all", long.len())));
        assert!(cut.contains("kubectl agentrun log"));
    }
}
