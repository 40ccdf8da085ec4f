//! Deciding without acting: the reconcile's judgements that read only what
//! was already read (the run, its Job as seen, the controller's settings)
//! and touch nothing: deadlines and requeues, whether a status write is
//! progress only, how a run ended, what a Job's pods said.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use kube::runtime::controller::Action;

use super::Acting;
use super::phase::{JobState, JobView};
use super::{checkpoint, phase, status};
use crate::api::{AgentRun, AgentRunStatus, AgentTemplate, Phase};
use crate::controller::approvals::Waiting;
use crate::controller::conditions::set_condition;
use crate::controller::context::{Context, Notice, notice};
use crate::controller::memory::{Asleep, Replayed};
use crate::runlog::records::{RunStarted, Versions};
use crate::store::{Head, sha256_hex};
use crate::tools::{McpCatalog, Toolbox};

/// Whether a waiting run still naming `job` lets go of it later, when it
/// ends (a failed Job is kept for good: nothing to wait for).
pub(super) fn lets_go_later(job: Option<&JobView>) -> bool {
    job.is_some_and(|j| !matches!(j.state, JobState::Failed { .. }))
}

/// How often a run waiting for an AgentPolicy looks again (policies do not
/// wake runs; a GitOps apply brings the policy within moments).
pub(super) const POLICY_RECHECK: Duration = Duration::from_secs(5);

/// "Look again at once": after a write of the controller's own (its status,
/// a record), long enough for the watch to bring the run's new version back
/// in the usual case (a few ms on a local API server), short enough not to
/// show in the time from a decision or a start to the next Job (it is on
/// both paths). The log, not the status, decides what comes next, so a
/// stale read costs a repeated write at most.
pub(super) const AT_ONCE: Duration = Duration::from_millis(10);

/// How long until the run's deadline (`MAX` without one): whatever a
/// reconcile waits for, the deadline acts on time.
pub(super) fn until_deadline(run: &AgentRun, now: Timestamp) -> Duration {
    phase::deadline(run).map_or(Duration::MAX, |d| {
        Duration::try_from(d.duration_since(now)).unwrap_or_default()
    })
}

/// The run's checkpoint to write with its status (signed; kept when the
/// log has not gone far enough past the previous one).
pub(super) fn next_checkpoint(
    run: &AgentRun,
    ctx: &Context,
    uid: &str,
    replayed: &Replayed,
) -> Option<crate::api::LogCheckpoint> {
    let previous = run
        .status
        .as_ref()
        .and_then(|s| s.log.as_ref())
        .and_then(|l| l.checkpoint.as_ref());
    checkpoint::make(
        &ctx.log.signer,
        uid,
        replayed,
        ctx.log.checkpoint_min,
        previous,
    )
}

/// The terminal phase the run reaches with this status, if it was not there.
pub(super) fn ends_now(
    run: &AgentRun,
    new: &crate::api::AgentRunStatus,
) -> Option<crate::api::Phase> {
    new.phase
        .filter(|p| p.is_terminal())
        .filter(|&p| run.status.as_ref().and_then(|s| s.phase) != Some(p))
}

/// The Event saying how the run ended, with its error or result.
pub(super) fn end_notice(
    outcome: crate::api::Phase,
    new: &crate::api::AgentRunStatus,
) -> crate::controller::context::Notice {
    let warn = outcome != crate::api::Phase::Succeeded;
    let msg = new.error.clone().or(new.result.clone()).unwrap_or_default();
    notice(warn, phase_reason(outcome), truncate(&msg, 900))
}

/// Whether the status is written from the log read again: only if this
/// reconcile appended or the head may have moved meanwhile (a waiting run
/// woken by a Job's deletion reads nothing).
pub(super) fn reads_again(acting: &Acting, requeue: Duration) -> bool {
    acting.concluded.is_none() && (requeue.is_zero() || acting.awaiting.is_some())
}

/// The status a reconcile writes, with the Events to publish with it.
pub(super) struct ToWrite {
    pub(super) status: AgentRunStatus,
    pub(super) notices: Vec<Notice>,
    /// The end the run reaches with this status, if it was not there.
    pub(super) ends_now: Option<Phase>,
}

/// The status composed from the log as it is after acting, with what
/// acting found (a fork's start, a policy awaited, a discovery failing),
/// and the Events of what changed and of the run's end. Its checkpoint is
/// the caller's to sign.
pub(super) fn to_write(
    run: &AgentRun,
    planned: AgentRunStatus,
    replayed: &Replayed,
    job: Option<&JobView>,
    acting: &Acting,
    store: &str,
    key_id: &str,
) -> ToWrite {
    let now = acting.now;
    let awaiting = acting
        .awaiting
        .as_ref()
        .map(|w| (w.name.clone(), w.expires_at));
    let mut status = status::compose(
        run,
        planned,
        &replayed.state,
        &replayed.head,
        store,
        acting.step.clone(),
        acting.concluded.as_ref(),
        job,
        awaiting.as_ref(),
        key_id,
        now,
    );
    if let Some(forked) = acting.fork.clone() {
        set_condition(&mut status.conditions, forked);
    }
    let generation = run.metadata.generation;
    let awaited = acting
        .policy
        .as_ref()
        .map(|(w, m)| (w.as_str(), m.as_str()));
    let allowed = status::set_allowed(&mut status, awaited, generation, now);
    let failed = acting.discovery.as_deref();
    let discovered = status::set_discovered(&mut status, failed, generation, now);
    let mut notices = acting.notices.clone();
    notices.extend(
        allowed
            .into_iter()
            .chain(discovered)
            .map(|(warn, reason, message)| notice(warn, reason, message)),
    );
    let ends_now = ends_now(run, &status);
    notices.extend(ends_now.map(|outcome| end_notice(outcome, &status)));
    ToWrite {
        status,
        notices,
        ends_now,
    }
}

/// When to look at the run again, as the reconcile answers it: `requeue`
/// (`MAX`: on a change only; zero: at once), but never past the deadline
/// of a run not finished.
pub(super) fn next_action(
    run: &AgentRun,
    requeue: Duration,
    finished: bool,
    now: Timestamp,
) -> Action {
    let requeue = match finished {
        true => requeue,
        false => requeue.min(until_deadline(run, now)),
    };
    match requeue {
        Duration::MAX => Action::await_change(),
        d if d.is_zero() => Action::requeue(AT_ONCE),
        d => Action::requeue(d),
    }
}

/// How often a running step's progress (log length and head, usage) is
/// written to its run's status.
pub(super) const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Whether `new` differs from the run's status in its progress only.
pub(super) fn only_progress(run: &AgentRun, new: &crate::api::AgentRunStatus) -> bool {
    let Some(old) = run.status.as_ref() else {
        return false;
    };
    let mut old = old.clone();
    if old.log.is_none() {
        return false;
    }
    // A key taking over is no progress: the key before it must stop
    // counting at once.
    if old.log.as_ref().map(|l| &l.signing_keys) != new.log.as_ref().map(|l| &l.signing_keys) {
        return false;
    }
    old.log.clone_from(&new.log);
    old.usage.clone_from(&new.usage);
    old == *new
}

/// How long a run whose catalog is being discovered waits before it is
/// looked at again, should the worker's wake-up be missed.
pub(super) const DISCOVERY_RECHECK: Duration = Duration::from_secs(60);

/// Whether the lease's holder is a pod of Job `job` (pods are named
/// `<job>-<suffix>`; a Job whose name merely starts with `job` is another).
pub(super) fn held_by_a_pod_of(holder: Option<&str>, job: &str) -> bool {
    holder.is_some_and(|h| {
        h.strip_prefix(job)
            .is_some_and(|pod| pod.starts_with('-') && pod.len() > 1)
    })
}

/// When to look at a run again that waits on events alone (its Job, its
/// log's head, its lease): at its deadline, and otherwise only as a safety
/// net, or every few seconds when the store pushes no head events.
pub(super) fn idle_requeue(ctx: &Context, run: &AgentRun, now: Timestamp) -> Duration {
    let idle = if ctx.log.pushes {
        IDLE_REQUEUE
    } else {
        phase::RUNNING_REQUEUE
    };
    match phase::deadline(run) {
        Some(deadline) => Duration::try_from(deadline.duration_since(now))
            .unwrap_or_default()
            .clamp(Duration::from_millis(100), idle),
        None => idle,
    }
}

/// Whether the run's status records another key than the one this
/// controller signs with as its last (a rotation it has not recorded yet).
pub(super) fn signs_with_another_key(run: &AgentRun, ctx: &Context) -> bool {
    let keys = run
        .status
        .as_ref()
        .and_then(|s| s.log.as_ref())
        .and_then(|l| l.signing_keys.as_ref());
    keys.and_then(|k| k.last())
        .is_some_and(|k| k.key != ctx.log.signer.key_id())
}

/// Whether the run's status says it waits on an Approval, for the spec it
/// has now, with a log: how the controller left it.
pub(super) fn waits_as_left(run: &AgentRun) -> bool {
    let Some(s) = run.status.as_ref() else {
        return false;
    };
    s.phase == Some(crate::api::Phase::AwaitingApproval)
        && s.approval.is_some()
        && s.observed_generation == run.metadata.generation
        && !run.spec.cancel
        && run.metadata.deletion_timestamp.is_none()
        && anchored_head(run).len > 0
}

/// The token of a run waiting on `waiting` with its log at `head`.
pub(super) fn asleep(
    run: &AgentRun,
    head: Head,
    generation: u64,
    waiting: &Waiting,
    run_version: Option<String>,
) -> Asleep {
    let wake_at = phase::deadline(run).map_or(waiting.expires_at, |d| d.min(waiting.expires_at));
    Asleep {
        head,
        generation,
        run_version,
        approval: waiting.name.clone(),
        approval_generation: waiting.generation,
        wake_at,
    }
}

/// The safety-net requeue of a run waiting on events.
pub(super) const IDLE_REQUEUE: Duration = Duration::from_secs(300);

/// 1 s after the first failure in a row, doubling up to 5 minutes.
pub(super) fn error_backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(9);
    Duration::from_secs(1 << exp).min(Duration::from_secs(300))
}

/// A Job of the step's name that this run does not control was made by
/// someone else: it is no Job of the run's, and its state is never acted
/// on (the run takes its next attempt under another name).
pub(super) fn controlled_by(job: &Job, uid: &str, name: &str) -> bool {
    let ours = job
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == uid);
    if !ours {
        tracing::warn!(job = %name, "a Job of the step's name is not this run's; ignored");
    }
    ours
}

/// When the Job completed, or when it was marked failed.
pub(super) fn job_ended_at(job: &Job) -> Option<Time> {
    let s = job.status.as_ref()?;
    let failed = s
        .conditions
        .iter()
        .flatten()
        .find(|c| (c.type_ == "Failed" || c.type_ == "FailureTarget") && c.status == "True");
    s.completion_time
        .clone()
        .or_else(|| failed.and_then(|c| c.last_transition_time.clone()))
}

/// Longest termination message quoted in a run's status.
pub(super) const MAX_QUOTED_BYTES: usize = 1024;

/// The `step` container's termination message, if it left one, and a
/// container agent's own when it failed (its log's end, or what it wrote
/// to its termination log).
pub(super) fn termination_message(pod: &k8s_openapi::api::core::v1::Pod) -> Option<String> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    let said = |name: &str, failed_only: bool| {
        let c = statuses.iter().find(|c| c.name == name)?;
        let ended = c.state.as_ref()?.terminated.as_ref()?;
        if failed_only && ended.exit_code == 0 {
            return None;
        }
        let text = ended.message.as_deref()?.trim();
        (!text.is_empty()).then(|| text.to_string())
    };
    let text = match (said("step", false), said("agent", true)) {
        (None, None) => return None,
        (Some(step), None) => step,
        (None, Some(agent)) => format!("the agent said: {agent}"),
        (Some(step), Some(agent)) => format!("{step}; the agent said: {agent}"),
    };
    Some(crate::text::tail(
        &crate::text::escape_controls(&text),
        MAX_QUOTED_BYTES,
    ))
}

/// The run's failed step Jobs so far, counting `previous` if it failed or vanished.
pub(super) fn failed_jobs_before(run: &AgentRun, previous: Option<&JobView>) -> u32 {
    let before = run
        .status
        .as_ref()
        .and_then(|s| s.step.as_ref())
        .map_or(0, |s| s.failed_jobs);
    let failed =
        previous.is_some_and(|j| matches!(j.state, JobState::Failed { .. } | JobState::Missing));
    before + u32::from(failed)
}

/// Resolves everything the run will execute with, for `RunStarted`, from
/// the catalog discovery found.
pub(super) fn snapshot(
    run: &AgentRun,
    template: &AgentTemplate,
    generation: Option<i64>,
    mcp: McpCatalog,
) -> Result<RunStarted, crate::refusal::Refusal> {
    let toolbox = Toolbox::new(&template.tools, &mcp).map_err(|e| format!("spec.tools: {e}"))?;
    let prompt = serde_json::to_value(&template.prompt).unwrap_or_default();
    let version = template.prompt.as_ref().map(|p| p.version.clone());
    Ok(RunStarted {
        run_name: run.name_any(),
        namespace: run.namespace().unwrap_or_default(),
        input: run.spec.input.clone(),
        agent: template.clone().into(),
        tools: toolbox.defs().into_iter().map(Into::into).collect(),
        mcp: mcp.into(),
        versions: Versions {
            prompt_version: version.unwrap_or_default(),
            prompt_hash: sha256_hex(&crate::store::canonical_json(&prompt)),
            model: template.model.name.clone(),
            tool_schema_hash: toolbox.schema_hash(),
            agent_generation: generation,
        },
        container: template.container.clone().map(Into::into),
    })
}

/// The log head the controller recorded in `status.log` (never moves backwards).
pub(super) fn anchored_head(run: &AgentRun) -> Head {
    let Some(log) = run.status.as_ref().and_then(|s| s.log.as_ref()) else {
        return Head::EMPTY;
    };
    match log.head_hash.as_deref().map(str::parse) {
        Some(Ok(hash)) => Head {
            len: log.length,
            hash,
        },
        _ => Head::EMPTY,
    }
}

pub(super) fn phase_reason(phase: crate::api::Phase) -> &'static str {
    use crate::api::Phase::*;
    match phase {
        Succeeded => "RunSucceeded",
        Failed => "RunFailed",
        Cancelled => "RunCancelled",
        BudgetExceeded => "BudgetExceeded",
        DeadlineExceeded => "DeadlineExceeded",
        Pending | Running | AwaitingApproval => "RunProgressing",
    }
}

pub(super) fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod fence_tests {
    use super::held_by_a_pod_of;

    #[test]
    fn only_a_pod_of_the_next_job_keeps_the_previous_worker_unfenced() {
        // A reconcile on a stale status re-creates Job r-s5-2 whose pod
        // already holds the lease: its worker must not be stopped.
        assert!(held_by_a_pod_of(Some("r-s5-2-x7k2p"), "r-s5-2"));
        // The failed attempt's worker, another Job sharing the prefix, a
        // bare Job name, no lease: fenced.
        assert!(!held_by_a_pod_of(Some("r-s5-1-abcde"), "r-s5-2"));
        assert!(!held_by_a_pod_of(Some("r-s5-20-abcde"), "r-s5-2"));
        assert!(!held_by_a_pod_of(Some("r-s5-2-"), "r-s5-2"));
        assert!(!held_by_a_pod_of(Some("r-s5-2"), "r-s5-2"));
        assert!(!held_by_a_pod_of(None, "r-s5-2"));
    }
}

#[cfg(test)]
mod snapshot_tests {
    use super::snapshot;
    use crate::api::{AgentRun, AgentTemplate};

    fn run() -> AgentRun {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r", "namespace": "n", "uid": "u"},
            "spec": {"input": "x", "agentRef": {"name": "a"}}
        }))
        .unwrap()
    }

    fn template(agent: serde_json::Value) -> AgentTemplate {
        serde_json::from_value(agent).unwrap()
    }

    /// A container agent's start pins its container (format 2, so an
    /// earlier release never runs it as a built-in agent with no prompt);
    /// a built-in one pins its prompt and no container.
    #[test]
    fn a_container_agent_pins_its_container_and_a_built_in_one_its_prompt() {
        let container = template(serde_json::json!({
            "container": {"image": "team/agent:1", "command": ["python", "agent.py"]},
            "model": {"provider": "OpenAI", "name": "m"}
        }));
        let started = snapshot(&run(), &container, None, Default::default()).unwrap();
        assert_eq!(started.agent_template(), container);
        let entry = crate::replay::Entry::RunStarted(started);
        assert_eq!(entry.format(), crate::store::FORMAT_2);
        let builtin = template(serde_json::json!({
            "prompt": {"version": "v3", "system": "s"},
            "model": {"provider": "OpenAI", "name": "m"}
        }));
        let started = snapshot(&run(), &builtin, None, Default::default()).unwrap();
        assert_eq!(started.versions.prompt_version, "v3");
        assert_eq!(started.container, None);
        assert_eq!(started.agent_template(), builtin);
    }
}

#[cfg(test)]
mod record_tests {
    use std::time::Duration;

    use jiff::Timestamp;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::runtime::controller::Action;

    use super::{AT_ONCE, next_action, reads_again, to_write};
    use crate::api::{AgentRun, AgentRunStatus, Phase};
    use crate::controller::approvals::Waiting;
    use crate::controller::conditions::condition;
    use crate::controller::memory::Replayed;
    use crate::controller::reconciler::Acting;
    use crate::runlog::records::{Outcome, RunFinished};

    fn now() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }

    fn run(deadline: Option<&str>) -> AgentRun {
        let mut run: AgentRun = serde_json::from_value(serde_json::json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r", "namespace": "n", "uid": "u"},
            "spec": {"input": "x", "agentRef": {"name": "a"}, "deadline": deadline}
        }))
        .unwrap();
        run.metadata.creation_timestamp = Some(Time(now()));
        run
    }

    fn acting(run: &AgentRun) -> Acting {
        Acting::new(run, Vec::new(), chrono::Utc::now(), now())
    }

    fn failed(error: &str) -> RunFinished {
        RunFinished {
            outcome: Outcome::Failed,
            result: None,
            error: Some(error.into()),
        }
    }

    #[test]
    fn a_reconcile_looks_again_at_once_on_a_change_or_by_the_deadline() {
        let open = run(None);
        let secs = Duration::from_secs;
        assert_eq!(
            next_action(&open, Duration::MAX, false, now()),
            Action::await_change()
        );
        assert_eq!(
            next_action(&open, Duration::ZERO, false, now()),
            Action::requeue(AT_ONCE)
        );
        assert_eq!(
            next_action(&open, secs(7), false, now()),
            Action::requeue(secs(7))
        );
        // A deadline in a minute cuts a longer wait, unless the run is over.
        let due = run(Some("60s"));
        assert_eq!(
            next_action(&due, Duration::MAX, false, now()),
            Action::requeue(secs(60))
        );
        assert_eq!(
            next_action(&due, secs(7), false, now()),
            Action::requeue(secs(7))
        );
        assert_eq!(
            next_action(&due, Duration::MAX, true, now()),
            Action::await_change()
        );
    }

    #[test]
    fn the_log_is_read_again_only_after_an_append_or_while_waiting() {
        let r = run(None);
        let mut acting = acting(&r);
        assert!(reads_again(&acting, Duration::ZERO));
        assert!(!reads_again(&acting, Duration::from_secs(5)));
        acting.awaiting = Some(Waiting {
            name: "r-approval".into(),
            expires_at: now(),
            generation: None,
        });
        assert!(reads_again(&acting, Duration::from_secs(5)));
        // A run concluded without its log has nothing new in it.
        acting.concluded = Some(failed("spec.tools: bad"));
        assert!(!reads_again(&acting, Duration::ZERO));
    }

    #[test]
    fn a_concluded_run_ends_with_its_event_once() {
        let r = run(None);
        let mut acting = acting(&r);
        acting.concluded = Some(failed("spec.tools: bad"));
        let empty = Replayed::empty();
        let written = to_write(
            &r,
            AgentRunStatus::default(),
            &empty,
            None,
            &acting,
            "s",
            "k",
        );
        assert_eq!(written.ends_now, Some(Phase::Failed));
        assert_eq!(written.status.phase, Some(Phase::Failed));
        let end = written.notices.last().unwrap();
        assert_eq!(
            (end.warning, end.reason, end.message.as_str()),
            (true, "RunFailed", "spec.tools: bad")
        );
        // Its status says so already: no second end, no second Event.
        let mut ended = r.clone();
        ended.status = Some(written.status.clone());
        let again = to_write(&ended, written.status, &empty, None, &acting, "s", "k");
        assert_eq!(again.ends_now, None);
        assert!(again.notices.is_empty(), "{:?}", again.notices);
    }

    #[test]
    fn a_wait_for_a_policy_is_told_once_and_a_forks_start_kept() {
        let r = run(None);
        let mut acting = acting(&r);
        acting.policy = Some(("policy/egress".into(), "no policy allows it yet".into()));
        acting.fork = Some(condition("Forked", true, "Copied", "copied", None, now()));
        let empty = Replayed::empty();
        let written = to_write(
            &r,
            AgentRunStatus::default(),
            &empty,
            None,
            &acting,
            "s",
            "k",
        );
        assert_eq!(written.status.waiting_on.as_deref(), Some("policy/egress"));
        assert!(
            written
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "Forked")
        );
        let reasons: Vec<_> = written.notices.iter().map(|n| n.reason).collect();
        assert_eq!(reasons, ["WaitingForPolicy"]);
        assert_eq!(written.ends_now, None);
        // The same wait, already in the status, is no news.
        let again = to_write(&r, written.status, &empty, None, &acting, "s", "k");
        assert!(again.notices.is_empty(), "{:?}", again.notices);
    }
}
