//! The run's state machine, in one place (DESIGN.md section 2, lifecycle):
//! from what was read (run, agent, log, Job, lease, clock) to what to do.
//! Pure, so every transition is unit-tested without a cluster or a store.

use std::time::Duration;

use jiff::Timestamp;

use crate::api::AgentRun;
use crate::replay::{Next, RunState};
use crate::runlog::records::{Outcome, RunFinished};

/// Attempts of one step that record nothing before the run fails, unless
/// the agent's `retry` says otherwise.
pub const MAX_ATTEMPTS: u32 = crate::api::RetryPolicy::DEFAULT_MAX_ATTEMPTS;
/// How often a running run is looked at when the store pushes no head
/// events (SQLite): the log and the lease are polled instead.
pub const RUNNING_REQUEUE: Duration = Duration::from_secs(3);

/// The step Job the run's status points to, as read.
#[derive(Clone, Debug, PartialEq)]
pub struct JobView {
    pub name: String,
    pub seq: u64,
    pub attempt: u32,
    pub state: JobState,
    /// Its pod runs (counted ready by the Job controller): only then can its
    /// worker be judged lost by the lease.
    pub running: bool,
    /// When the Job ended (for the retry backoff).
    pub ended_at: Option<Timestamp>,
    /// Attempts of this step before this Job that failed without recording
    /// anything (disruptions not counted).
    pub stalled: u32,
    /// A container agent's container as the kubelet reported it, read when
    /// its Job failed (its runner may have crashed after the agent ended).
    pub agent: Option<AgentState>,
}

/// Where a container agent's own container stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentState {
    Running,
    Exited(i32),
}

impl JobView {
    /// Lost rather than crashed: a vanished Job or a pod that never exited.
    pub fn disrupted(&self) -> bool {
        matches!(
            self.state,
            JobState::Missing
                | JobState::Failed {
                    disrupted: true,
                    ..
                }
        )
    }
}

/// The `stalled` count of the attempt after `job`: none after progress, the
/// same after a disruption, one more after a crash or a clean exit that
/// recorded nothing.
pub fn stalled_after(job: &JobView, progressed: bool) -> u32 {
    if progressed {
        0
    } else if job.disrupted() {
        job.stalled
    } else {
        job.stalled + 1
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum JobState {
    Active,
    Succeeded,
    Failed {
        reason: String,
        /// Its pod was lost, not crashed: deleted, evicted or gone with its
        /// node. Never counts toward the retry limit.
        disrupted: bool,
    },
    /// Status points to a Job that does not exist (deleted, or TTL-collected).
    Missing,
}

/// The run's lease in the store, as read.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseView {
    /// True when a worker holds it and renews it.
    pub live: bool,
    /// How long it has been seen free without a break (zero when live).
    pub free_for: Duration,
    /// Given back by its worker (not merely lapsed): the worker is done.
    pub released: bool,
}

/// A running step whose lease stays free this long has lost its worker: a live
/// worker renews every 2 s, a starting one takes the lease within a second.
pub const LOST_AFTER: Duration = Duration::from_secs(5);

/// Everything the decision needs.
pub struct Observed<'a> {
    pub run: &'a AgentRun,
    pub log: &'a RunState,
    /// Generation of the referenced Agent now, for `FollowLatest`.
    pub agent_generation: Option<i64>,
    pub job: Option<JobView>,
    pub lease: Option<LeaseView>,
    pub now: Timestamp,
}

/// One thing to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Act {
    /// Append `RunStarted` with the resolved agent.
    StartRun,
    /// Append `VersionChanged` to the Agent's current version.
    FollowAgent,
    CreateJob {
        seq: u64,
        attempt: u32,
    },
    DeleteJob {
        name: String,
    },
    /// Append `RunFinished` (the controller's own verdicts: deadline, cancel, retries).
    Finish(RunFinished),
    /// Set the final phase from the recorded `RunFinished`.
    Conclude(RunFinished),
    /// A call waits for a human (or its expiry's follow-up): raise or read the Approval.
    HandleApproval {
        request_seq: u64,
    },
    /// Nothing now; look again after this long.
    Wait(Duration),
    /// The run waits for something a later object can still give (an
    /// AgentPolicy allowance), with no Job: shown in `status.waitingOn`
    /// and the `Allowed` condition; its deadline still applies.
    AwaitPolicy {
        waiting_on: String,
        message: String,
    },
    /// Ask the worker to stop at its next step boundary (the Agent of a
    /// FollowLatest run changed under a running step), then as [`Act::Idle`].
    AskToYield,
    /// Nothing until something changes: the Job, the log's head, the lease
    /// (lapsed leases are found by one sweep of the store), the deadline.
    Idle,
}

/// Decides the next act. The caller performs it and reconciles again.
///
/// Stage by stage, the first that has something to say wins: an ended run,
/// a run to stop (cancel, deadline), what the log asks for, then the step
/// Job.
pub fn decide(o: &Observed) -> Act {
    if let Some(act) = ended(o).or_else(|| to_stop(o)).or_else(|| from_log(o)) {
        return act;
    }
    match &o.job {
        None => next_job(o, 1),
        Some(job) => from_job(o, job),
    }
}

/// A run that ended: concluded from the recorded end, or left alone once
/// its phase is final.
fn ended(o: &Observed) -> Option<Act> {
    if let Some(finished) = &o.log.finished {
        // A worker that recorded the end exits by itself: leave its Job alone.
        return Some(Act::Conclude(finished.clone()));
    }
    let phase = o
        .run
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or_default();
    phase.is_terminal().then_some(Act::Wait(Duration::MAX))
}

/// A run cancelled through its spec, or past its deadline: stopped,
/// whatever its log or Job say.
fn to_stop(o: &Observed) -> Option<Act> {
    let partial = || o.log.last_text();
    if o.run.spec.cancel {
        let error = "cancelled through spec.cancel".into();
        return Some(stop(o, Outcome::Cancelled, partial(), error));
    }
    let deadline = deadline(o.run)?;
    if o.now < deadline {
        return None;
    }
    let limit = o.run.spec.deadline.clone().unwrap_or_default();
    let error = format!("spec.deadline of {limit} passed");
    Some(stop(o, Outcome::DeadlineExceeded, partial(), error))
}

/// What the log alone decides: start the run, handle its approval, or
/// record its end.
fn from_log(o: &Observed) -> Option<Act> {
    // A start cut short (a fork's or test's copy, the controller gone or
    // paused mid-way) is resumed by the start, never run by a Job.
    if !started(o) {
        return Some(Act::StartRun);
    }
    if let Some(act) = outside_the_test(o) {
        return Some(act);
    }
    // A run waiting for a human holds no Job: its worker exits after asking.
    if let Some((request_seq, _)) = o.log.pending_approval() {
        return Some(Act::HandleApproval { request_seq });
    }
    // Only the controller records the end: the agent's final answer, or the
    // end a step runner asked for (it cannot append RunFinished itself).
    match o.log.next() {
        Next::Finish {
            outcome,
            result,
            error,
        } => Some(Act::Finish(RunFinished {
            outcome,
            result,
            error,
        })),
        Next::Stop(finished)
            if finished.outcome == Outcome::Succeeded && o.log.runs_a_container() =>
        {
            Some(vouched_by_job(o, finished))
        }
        Next::Stop(finished) => Some(Act::Finish(finished)),
        _ => None,
    }
}

/// A replay test acts on nothing (DESIGN.md §11), whatever its log holds:
/// an approval request (which no test's runner writes) is never raised
/// for a person, and a container agent (whose runner answers no call from
/// the recorded run) gets no Job. Either ends the test `Failed`, saying why.
fn outside_the_test(o: &Observed) -> Option<Act> {
    o.log.sandbox()?;
    let why = if o.log.pending_approval().is_some() {
        "replay test: its log asks for an approval, which a test never raises: nobody is asked and nothing is called"
    } else if o.log.runs_a_container() {
        crate::sandbox::CONTAINER_AGENT
    } else {
        return None;
    };
    Some(Act::Finish(RunFinished {
        outcome: Outcome::Failed,
        result: o.log.last_text(),
        error: Some(why.into()),
    }))
}

/// Whether the run's start is written whole: `RunStarted`; for a fork the
/// parent's records `0..=seq`, `Forked` and the `VersionChanged` (to
/// `forkOf.agent`, or the parent's agent as the platform of today governs
/// it); for a test the recorded `RunStarted`, `Forked` and the
/// tested Agent's `VersionChanged` (`fork::plan`).
fn started(o: &Observed) -> bool {
    o.log.len() >= start_len(&o.run.spec)
}

/// How many records a run's start writes.
fn start_len(spec: &crate::api::AgentRunSpec) -> u64 {
    match (&spec.fork_of, &spec.test_of) {
        (Some(f), _) => f.seq.saturating_add(3),
        (None, Some(_)) => 3,
        (None, None) => 1,
    }
}

/// A container agent's success, as its runner reported the agent's exit,
/// is recorded only once the kubelet says so: the step Job completed
/// (every container of its pod exited 0), or it failed with the agent's
/// container terminated with exit code 0 (the runner crashed after
/// recording the end).
fn vouched_by_job(o: &Observed, finished: RunFinished) -> Act {
    let failed = |why: String| {
        Act::Finish(RunFinished {
            outcome: Outcome::Failed,
            result: finished.result.clone(),
            error: Some(format!(
                "the runner reported that the agent exited 0, but {why}"
            )),
        })
    };
    let agent = o.job.as_ref().and_then(|j| j.agent);
    match o.job.as_ref().map(|j| &j.state) {
        Some(JobState::Succeeded) => Act::Finish(finished.clone()),
        // Its pod is ending; the Job's completion wakes the run.
        Some(JobState::Active) => Act::Idle,
        // The runner failed after recording the agent's end: the agent's
        // own container says how it ended, once it has.
        Some(JobState::Failed { .. }) if agent == Some(AgentState::Exited(0)) => {
            Act::Finish(finished.clone())
        }
        // Still running, or its status not read yet: look again shortly
        // (for a while: a pod that is gone says nothing more).
        Some(JobState::Failed { .. })
            if agent == Some(AgentState::Running) || (agent.is_none() && recently_ended(o)) =>
        {
            Act::Wait(Duration::from_secs(2))
        }
        Some(JobState::Failed { reason, .. }) => failed(format!(
            "its step Job failed ({reason}) and its agent container's end was {agent:?}"
        )),
        Some(JobState::Missing) | None => {
            failed("its step Job is gone, so the agent's exit cannot be checked".into())
        }
    }
}

/// The Job for the log's next step, as attempt `attempt`; a FollowLatest
/// run whose Agent changed first follows it (the Job runs the new version).
fn next_job(o: &Observed, attempt: u32) -> Act {
    follow_agent(o).unwrap_or(Act::CreateJob {
        seq: o.log.len(),
        attempt,
    })
}

/// What the run's step Job, as read, calls for.
fn from_job(o: &Observed, job: &JobView) -> Act {
    match &job.state {
        JobState::Active => while_active(o, job),
        // An attempt that recorded something new made progress, however it
        // ended (a clean exit, a deleted or crashed pod): the next one starts
        // the count afresh, so a run that keeps appending never fails by
        // retries. Replay means the work recorded is never redone.
        _ if o.log.len() > job.seq => next_job(o, 1),
        _ => after_stall(o, job),
    }
}

/// A running Job: its worker is done, lost, or still at work.
fn while_active(o: &Observed, job: &JobView) -> Act {
    let lease = o.lease.as_ref();
    // Its worker recorded its work and gave the run back: the next
    // step starts now; the pod exits by itself and its Job is left to end.
    if o.log.len() > job.seq && lease.is_some_and(|l| l.released) {
        return next_job(o, 1);
    }
    // A worker that stopped renewing its lease is gone: replace it.
    let lapsed = lease.filter(|l| !l.live && !l.released);
    match lapsed {
        Some(l) if job.running && l.free_for >= LOST_AFTER => Act::DeleteJob {
            name: job.name.clone(),
        },
        // Look again when it would count as lost.
        Some(l) if job.running => Act::Wait(LOST_AFTER - l.free_for),
        // FollowLatest moves at the next step boundary, not the next Job.
        _ if follow_agent(o).is_some() => Act::AskToYield,
        _ => Act::Idle,
    }
}

/// An attempt that ended without recording anything counts, so a crash
/// loop stops (a disruption does not); back off before the next.
fn after_stall(o: &Observed, job: &JobView) -> Act {
    let stalled = stalled_after(job, false);
    if stalled >= retry(o).max_attempts() {
        return give_up(o, job, stalled);
    }
    match backoff_left(o, job) {
        Some(wait) => Act::Wait(wait),
        None => next_job(o, job.attempt + 1),
    }
}

/// The run fails: step `job.seq` ended `stalled` times in a row without
/// recording anything.
fn give_up(o: &Observed, job: &JobView, stalled: u32) -> Act {
    let reason = match &job.state {
        JobState::Failed { reason, .. } => reason.clone(),
        JobState::Missing => "its Job disappeared".into(),
        _ => "it exited without recording anything".into(),
    };
    Act::Finish(RunFinished {
        outcome: Outcome::Failed,
        result: o.log.last_text(),
        error: Some(format!(
            "step {} failed {stalled} times in a row without recording anything; last: {reason}",
            job.seq
        )),
    })
}

/// Whether the run's Job ended less than half a minute ago.
fn recently_ended(o: &Observed) -> bool {
    let Some(ended) = o.job.as_ref().and_then(|j| j.ended_at) else {
        return true;
    };
    let since = Duration::try_from(o.now.duration_since(ended)).unwrap_or_default();
    since < Duration::from_secs(30)
}

/// Stops an unfinished run: first its Job, then the record.
fn stop(o: &Observed, outcome: Outcome, result: Option<String>, error: String) -> Act {
    if let Some(job) = o.job.as_ref().filter(|j| j.state == JobState::Active) {
        return Act::DeleteJob {
            name: job.name.clone(),
        };
    }
    if !started(o) {
        // Nothing of the run's own was recorded: there is no log to close.
        return Act::Conclude(RunFinished {
            outcome,
            result,
            error: Some(error),
        });
    }
    Act::Finish(RunFinished {
        outcome,
        result,
        error: Some(error),
    })
}

/// The pinned agent's retry policy (defaults before the run started).
fn retry(o: &Observed) -> crate::api::RetryPolicy {
    o.log
        .snapshot
        .as_ref()
        .and_then(|s| s.agent.retry.clone())
        .unwrap_or_default()
}

/// Retries wait 1, 2, 4... seconds (the agent's `retry`) after the failed
/// attempt ended, by the count of failures without progress (a run of
/// disruptions waits the first step each time).
fn backoff_left(o: &Observed, job: &JobView) -> Option<Duration> {
    let ended = job.ended_at?;
    let backoff = retry(o).backoff(stalled_after(job, false).max(1));
    let elapsed = Duration::try_from(o.now.duration_since(ended)).unwrap_or_default();
    backoff.checked_sub(elapsed).filter(|d| !d.is_zero())
}

fn follow_agent(o: &Observed) -> Option<Act> {
    // A replay test runs the version its start pinned, whatever its spec
    // says: the test fixes it (its folded log says it is a test).
    if o.run.spec.version_policy != crate::api::VersionPolicy::FollowLatest
        || o.log.sandbox().is_some()
    {
        return None;
    }
    let pinned = o.log.snapshot.as_ref()?.versions.agent_generation;
    (o.agent_generation.is_some() && o.agent_generation != pinned).then_some(Act::FollowAgent)
}

/// When the run's deadline passes, if it has one: counted from the run's
/// creation (the API server's clock, which no one can set), so time spent
/// before its first step counts too; `startedAt` only for a run without one.
pub fn deadline(run: &AgentRun) -> Option<Timestamp> {
    let limit = crate::api::parse_duration(run.spec.deadline.as_deref()?).ok()?;
    let start = match run.metadata.creation_timestamp.as_ref() {
        Some(created) => created.0,
        None => run.status.as_ref()?.started_at.as_ref()?.0,
    };
    start
        .checked_add(jiff::SignedDuration::try_from(limit).ok()?)
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AgentRunSpec, AgentRunStatus, CurrentStep, Phase, VersionPolicy};
    use crate::replay::Entry;
    use crate::runlog::records::{RunStarted, Versions};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn run() -> AgentRun {
        let mut r = AgentRun::new(
            "r",
            AgentRunSpec {
                input: "task".into(),
                ..Default::default()
            },
        );
        r.status = Some(AgentRunStatus {
            started_at: Some(Time(t(0))),
            ..Default::default()
        });
        r
    }

    fn started(generation: Option<i64>) -> RunState {
        RunState::replay(vec![Entry::RunStarted(RunStarted {
            container: None,
            run_name: "r".into(),
            namespace: "ns".into(),
            input: "task".into(),
            agent: Default::default(),
            tools: vec![],
            mcp: Default::default(),
            versions: Versions {
                agent_generation: generation,
                ..Default::default()
            },
        })])
    }

    fn job(seq: u64, attempt: u32, state: JobState, ended: Option<i64>) -> Option<JobView> {
        Some(JobView {
            name: format!("r-s{seq}-a{attempt}"),
            seq,
            attempt,
            running: state == JobState::Active,
            state,
            ended_at: ended.map(t),
            stalled: attempt.saturating_sub(1),
            agent: None,
        })
    }

    fn decide_at(
        run: &AgentRun,
        log: &RunState,
        job: Option<JobView>,
        lease: Option<bool>,
        now: i64,
    ) -> Act {
        decide(&Observed {
            run,
            log,
            agent_generation: Some(1),
            job,
            // A free lease counts as free for as long as the test's clock says.
            lease: lease.map(|live| LeaseView {
                live,
                free_for: if live {
                    Duration::ZERO
                } else {
                    Duration::from_secs(now.max(0) as u64)
                },
                released: false,
            }),
            now: t(now),
        })
    }

    #[test]
    fn an_empty_log_is_started_by_the_controller() {
        assert_eq!(
            decide_at(&run(), &RunState::default(), None, None, 1),
            Act::StartRun
        );
    }

    /// A fork at `seq` onto another agent (or a test, `seq` 0 onto its
    /// tested agent), its log cut after `len` records of its start: the
    /// parent's records, then `Forked`, then the `VersionChanged`.
    fn cut_start(seq: u64, len: usize) -> RunState {
        let forked = Entry::Forked(crate::runlog::records::Forked::after(seq, None));
        let changed = Entry::VersionChanged(crate::runlog::records::VersionChanged {
            agent: Default::default(),
            tools: vec![],
            mcp: Default::default(),
            from: Versions::default(),
            to: Versions::default(),
            container: None,
        });
        let parent = crate::replay::tests::long_log(3);
        let start = parent[..=seq as usize]
            .iter()
            .cloned()
            .chain([forked, changed]);
        RunState::replay(start.take(len).collect())
    }

    #[test]
    fn a_fork_or_test_whose_start_was_cut_short_resumes_the_start_and_never_gets_a_job() {
        let fork = |seq: u64| {
            let mut r = run();
            r.spec.fork_of = Some(crate::api::ForkOf {
                run: "parent".into(),
                seq,
                agent: Some("stricter".into()),
                ..Default::default()
            });
            r
        };
        let mut test = run();
        test.spec.test_of = Some(crate::api::TestOf {
            run: "parent".into(),
            agent: "stricter".into(),
            ..Default::default()
        });
        let mut cases = vec![(test, 0)];
        cases.extend((0..6).map(|seq| (fork(seq), seq)));
        for (run, seq) in cases {
            let whole = seq as usize + 3;
            for len in 0..whole {
                let log = cut_start(seq, len);
                assert_eq!(
                    decide_at(&run, &log, None, None, 1),
                    Act::StartRun,
                    "a start of {whole} records cut after {len}: the copy goes on, no Job"
                );
                // Stopped mid-start: concluded, nothing appended after the copy.
                let mut cancelled = run.clone();
                cancelled.spec.cancel = true;
                assert!(matches!(
                    decide_at(&cancelled, &log, None, None, 1),
                    Act::Conclude(_)
                ));
            }
            let log = cut_start(seq, whole);
            assert_ne!(
                decide_at(&run, &log, None, None, 1),
                Act::StartRun,
                "once whole, the run goes on from its log"
            );
        }
    }

    /// A replay test's log: the recorded `RunStarted`, its `Forked` with
    /// the recorded calls, the `VersionChanged` to the tested agent (a
    /// container agent with `container`), then `more`.
    fn a_test(container: bool, more: Vec<Entry>) -> RunState {
        let mut log = crate::replay::tests::started().entries().to_vec();
        log.push(Entry::Forked(crate::runlog::records::Forked::after(
            0,
            Some(crate::runlog::records::Sandbox { calls: vec![] }),
        )));
        log.push(Entry::VersionChanged(
            crate::runlog::records::VersionChanged {
                agent: Default::default(),
                tools: vec![],
                mcp: Default::default(),
                from: Versions::default(),
                to: Versions::default(),
                container: container.then(|| crate::runlog::v2::Container {
                    image: "agents:1".into(),
                    command: vec!["agent".into()],
                    args: vec![],
                    env: vec![],
                    resources: None,
                    matching: None,
                }),
            },
        ));
        log.extend(more);
        RunState::replay(log)
    }

    fn test_run() -> AgentRun {
        let mut r = run();
        r.spec.test_of = Some(crate::api::TestOf {
            run: "parent".into(),
            agent: "stricter".into(),
            ..Default::default()
        });
        r
    }

    #[test]
    fn a_replay_test_never_follows_its_agent_whatever_its_version_policy() {
        let mut r = test_run();
        r.spec.version_policy = VersionPolicy::FollowLatest;
        // The Agent is at generation 1 and the log pins none: a run would follow.
        let mut plain = run();
        plain.spec.version_policy = VersionPolicy::FollowLatest;
        assert_eq!(
            decide_at(&plain, &started(None), None, None, 1),
            Act::FollowAgent
        );
        assert_eq!(
            decide_at(&r, &a_test(false, vec![]), None, None, 1),
            Act::CreateJob { seq: 3, attempt: 1 }
        );
    }

    #[test]
    fn a_replay_tests_log_that_asks_for_an_approval_ends_the_test_and_raises_none() {
        let Entry::ApprovalRequested(mut asked) = crate::replay::tests::request() else {
            unreachable!()
        };
        asked.model_call_seq = 3;
        let call =
            crate::replay::tests::model_call(&[("refund", serde_json::json!({"amount": 500}))]);
        let log = a_test(false, vec![call, Entry::ApprovalRequested(asked)]);
        assert!(log.pending_approval().is_some());
        let act = decide_at(&test_run(), &log, None, None, 1);
        let Act::Finish(finished) = act else {
            panic!("a test's approval request is never raised: {act:?}")
        };
        assert_eq!(finished.outcome, Outcome::Failed);
        assert!(finished.error.unwrap().contains("never raises"));
    }

    #[test]
    fn a_replay_test_whose_agent_is_a_container_gets_no_job_and_ends() {
        let act = decide_at(&test_run(), &a_test(true, vec![]), None, None, 1);
        let Act::Finish(finished) = act else {
            panic!("no Job for a container agent in a test: {act:?}")
        };
        assert_eq!(finished.outcome, Outcome::Failed);
        assert!(finished.error.unwrap().contains("container agent"));
    }

    #[test]
    fn the_first_step_job_follows_run_started() {
        assert_eq!(
            decide_at(&run(), &started(Some(1)), None, None, 1),
            Act::CreateJob { seq: 1, attempt: 1 }
        );
    }

    #[test]
    fn a_recorded_end_concludes_without_touching_the_job() {
        let mut log = started(None);
        let fin = RunFinished {
            outcome: Outcome::Succeeded,
            result: Some("done".into()),
            error: None,
        };
        log.apply(Entry::RunFinished(fin.clone()));
        assert_eq!(
            decide_at(
                &run(),
                &log,
                job(1, 1, JobState::Active, None),
                Some(true),
                5
            ),
            Act::Conclude(fin)
        );
    }

    #[test]
    fn the_controller_records_the_end_the_log_asks_for() {
        let mut log = started(None);
        log.apply(Entry::Observation(crate::runlog::records::Observation {
            text: "the model refused the request".into(),
            about_seq: None,
            attempts: None,
            stop: Some(RunFinished {
                outcome: Outcome::Failed,
                result: None,
                error: Some("refused".into()),
            }),
        }));
        let act = decide_at(
            &run(),
            &log,
            job(1, 1, JobState::Succeeded, Some(0)),
            None,
            1,
        );
        assert_eq!(
            act,
            Act::Finish(RunFinished {
                outcome: Outcome::Failed,
                result: None,
                error: Some("refused".into()),
            })
        );
    }

    #[test]
    fn progress_schedules_the_next_seq_as_a_first_attempt() {
        let mut log = started(None);
        log.apply(Entry::Observation(crate::runlog::records::Observation {
            text: "x".into(),
            about_seq: None,
            stop: None,
            attempts: None,
        }));
        let act = decide_at(
            &run(),
            &log,
            job(1, 2, JobState::Succeeded, Some(3)),
            None,
            4,
        );
        assert_eq!(act, Act::CreateJob { seq: 2, attempt: 1 });
        // A failed Job that still recorded something made progress: the
        // next step starts as a first attempt (the count of failed Jobs,
        // which arms failpoints, is the reconciler's).
        let act = decide_at(
            &run(),
            &log,
            job(
                1,
                3,
                JobState::Failed {
                    reason: "x".into(),
                    disrupted: false,
                },
                Some(3),
            ),
            None,
            4,
        );
        assert_eq!(act, Act::CreateJob { seq: 2, attempt: 1 });
    }

    #[test]
    fn a_failed_step_is_retried_with_backoff_then_fails_the_run() {
        let log = started(None);
        let failed = |attempt| {
            job(
                1,
                attempt,
                JobState::Failed {
                    reason: "OOMKilled".into(),
                    disrupted: false,
                },
                Some(10),
            )
        };
        assert_eq!(
            decide_at(&run(), &log, failed(2), None, 10),
            Act::Wait(Duration::from_secs(2))
        );
        assert_eq!(
            decide_at(&run(), &log, failed(2), None, 12),
            Act::CreateJob { seq: 1, attempt: 3 }
        );
        match decide_at(&run(), &log, failed(MAX_ATTEMPTS), None, 100) {
            Act::Finish(f) => {
                assert_eq!(f.outcome, Outcome::Failed);
                assert!(f.error.unwrap().contains("OOMKilled"));
            }
            other => panic!("expected Finish, got {other:?}"),
        }
        // A vanished Job counts as a failed attempt too.
        assert_eq!(
            decide_at(&run(), &log, job(1, 1, JobState::Missing, None), None, 1),
            Act::CreateJob { seq: 1, attempt: 2 }
        );
    }

    #[test]
    fn a_failed_attempt_that_recorded_something_starts_the_count_afresh() {
        // The Job of attempt 4 started at seq 0 and the log has 1 record now:
        // it made progress before its pod was deleted.
        let log = started(None);
        let deleted = job(0, MAX_ATTEMPTS, JobState::Missing, Some(10));
        assert_eq!(
            decide_at(&run(), &log, deleted, None, 10),
            Act::CreateJob { seq: 1, attempt: 1 }
        );
        let failed = job(
            0,
            MAX_ATTEMPTS + 7,
            JobState::Failed {
                reason: "BackoffLimitExceeded".into(),
                disrupted: false,
            },
            Some(10),
        );
        assert_eq!(
            decide_at(&run(), &log, failed, None, 10),
            Act::CreateJob { seq: 1, attempt: 1 }
        );
    }

    #[test]
    fn disruptions_without_progress_never_count_toward_the_limit() {
        // The log has 1 record; the Job started at seq 1 recorded nothing.
        let log = started(None);
        let mut lost = job(
            1,
            9,
            JobState::Failed {
                reason: "BackoffLimitExceeded: Job has reached the specified backoff limit".into(),
                disrupted: true,
            },
            Some(10),
        )
        .unwrap();
        lost.stalled = MAX_ATTEMPTS - 1;
        assert_eq!(
            decide_at(&run(), &log, Some(lost.clone()), None, 100),
            Act::CreateJob {
                seq: 1,
                attempt: 10
            }
        );
        assert_eq!(stalled_after(&lost, false), MAX_ATTEMPTS - 1);
        // The same attempt crashing is the last straw.
        let mut crashed = lost.clone();
        crashed.state = JobState::Failed {
            reason: "PodFailurePolicy: exit code 101".into(),
            disrupted: false,
        };
        assert!(matches!(
            decide_at(&run(), &log, Some(crashed), None, 100),
            Act::Finish(_)
        ));
        // A vanished Job is a disruption too.
        lost.state = JobState::Missing;
        assert!(lost.disrupted());
    }

    #[test]
    fn the_agents_retry_policy_sets_attempts_and_backoff() {
        let mut log = started(None);
        if let Some(s) = log.snapshot.as_mut() {
            s.agent.retry = Some(crate::api::RetryPolicy {
                max_attempts_without_progress: Some(2),
                backoff_seconds: Some(5),
                max_backoff_seconds: Some(7),
            });
        }
        let failed = |attempt| {
            job(
                1,
                attempt,
                JobState::Failed {
                    reason: "Error".into(),
                    disrupted: false,
                },
                Some(10),
            )
        };
        // 5 s after the first, capped at 7 s after later ones.
        assert_eq!(
            decide_at(&run(), &log, failed(1), None, 12),
            Act::Wait(Duration::from_secs(3))
        );
        assert!(matches!(
            decide_at(&run(), &log, failed(2), None, 100),
            Act::Finish(f) if f.error.as_deref().is_some_and(|e| e.contains("2 times in a row without recording anything"))
        ));
        let policy = crate::api::RetryPolicy {
            max_attempts_without_progress: None,
            backoff_seconds: Some(5),
            max_backoff_seconds: Some(7),
        };
        assert_eq!(policy.backoff(3), Duration::from_secs(7));
        assert_eq!(policy.max_attempts(), MAX_ATTEMPTS);
    }

    #[test]
    fn a_live_worker_is_left_alone_and_a_lost_one_replaced() {
        let mut r = run();
        r.status.as_mut().unwrap().step = Some(CurrentStep {
            seq: 1,
            job: Some("r-s1-a1".into()),
            attempt: 1,
            failed_jobs: 0,
            stalled: 0,
            started_at: Some(Time(t(0))),
            token_key: None,
        });
        let log = started(None);
        let active = || job(1, 1, JobState::Active, None);
        assert_eq!(decide_at(&r, &log, active(), Some(true), 60), Act::Idle);
        // A lease free only briefly may be a worker still starting: look
        // again when it would count as lost.
        assert_eq!(
            decide_at(&r, &log, active(), Some(false), 3),
            Act::Wait(LOST_AFTER - Duration::from_secs(3))
        );
        // A Job whose pod does not run yet (a busy node) is never judged by the lease.
        let mut pending = active().unwrap();
        pending.running = false;
        assert_eq!(
            decide_at(&r, &log, Some(pending), Some(false), 600),
            Act::Idle
        );
        assert_eq!(
            decide_at(&r, &log, active(), Some(false), 60),
            Act::DeleteJob {
                name: "r-s1-a1".into()
            }
        );
    }

    /// A container agent's success, as its runner reported it, is
    /// recorded once its step Job completed (the kubelet saw every
    /// container exit 0); a failed or vanished Job makes it a failure.
    #[test]
    fn a_container_agents_success_waits_for_its_job_to_complete() {
        let mut log = started(None);
        let Some(Entry::RunStarted(mut s)) = log.entry(0).cloned() else {
            unreachable!()
        };
        s.container = Some(crate::runlog::v2::Container {
            image: "team/agent:1".into(),
            command: vec!["agent".into()],
            args: vec![],
            env: vec![],
            resources: None,
            matching: None,
        });
        log = RunState::replay(vec![Entry::RunStarted(s)]);
        log.apply(Entry::Observation(crate::runlog::records::Observation {
            text: String::new(),
            about_seq: None,
            stop: Some(RunFinished {
                outcome: Outcome::Succeeded,
                result: Some("refunded".into()),
                error: None,
            }),
            attempts: None,
        }));
        let at = |state| decide_at(&run(), &log, job(1, 1, state, Some(1)), Some(false), 2);
        assert_eq!(at(JobState::Active), Act::Idle);
        match at(JobState::Succeeded) {
            Act::Finish(f) => assert_eq!(
                (f.outcome, f.result.as_deref()),
                (Outcome::Succeeded, Some("refunded"))
            ),
            other => panic!("expected Finish, got {other:?}"),
        }
        let failed = JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            disrupted: false,
        };
        let mut ran = job(1, 1, failed.clone(), Some(1));
        ran.as_mut().unwrap().agent = Some(AgentState::Exited(0));
        match decide_at(&run(), &log, ran, Some(false), 2) {
            Act::Finish(f) => assert_eq!(f.outcome, Outcome::Succeeded),
            other => panic!("the agent's exit 0 in a failed Job: {other:?}"),
        }
        let mut ending = job(1, 1, failed.clone(), Some(1));
        ending.as_mut().unwrap().agent = Some(AgentState::Running);
        assert!(matches!(
            decide_at(&run(), &log, ending, Some(false), 2),
            Act::Wait(_)
        ));
        // Failed with nothing read of its agent: looked at again for a
        // while, then a failure.
        assert!(matches!(at(failed.clone()), Act::Wait(_)));
        for state in [failed, JobState::Missing] {
            match decide_at(&run(), &log, job(1, 1, state, Some(1)), Some(false), 60) {
                Act::Finish(f) => {
                    assert_eq!(f.outcome, Outcome::Failed);
                    let error = f.error.unwrap();
                    assert!(
                        error.contains("reported that the agent exited 0"),
                        "{error}"
                    );
                }
                other => panic!("expected Finish, got {other:?}"),
            }
        }
    }

    #[test]
    fn cancel_stops_the_job_then_records_the_end() {
        let mut r = run();
        r.spec.cancel = true;
        let mut log = started(None);
        log.apply(Entry::Observation(crate::runlog::records::Observation {
            text: "x".into(),
            about_seq: None,
            stop: None,
            attempts: None,
        }));
        assert_eq!(
            decide_at(&r, &log, job(1, 1, JobState::Active, None), Some(true), 1),
            Act::DeleteJob {
                name: "r-s1-a1".into()
            }
        );
        match decide_at(&r, &log, job(1, 1, JobState::Missing, None), None, 2) {
            Act::Finish(f) => assert_eq!(f.outcome, Outcome::Cancelled),
            other => panic!("expected Finish, got {other:?}"),
        }
    }

    #[test]
    fn the_deadline_applies_while_running() {
        let mut r = run();
        r.spec.deadline = Some("1m".into());
        let log = started(None);
        assert_eq!(
            decide_at(&r, &log, job(1, 1, JobState::Active, None), Some(true), 59),
            Act::Idle
        );
        assert_eq!(
            decide_at(&r, &log, job(1, 1, JobState::Active, None), Some(true), 61),
            Act::DeleteJob {
                name: "r-s1-a1".into()
            }
        );
        match decide_at(&r, &log, None, None, 62) {
            Act::Finish(f) => assert_eq!(
                (f.outcome, f.error.unwrap().contains("1m")),
                (Outcome::DeadlineExceeded, true)
            ),
            other => panic!("expected Finish, got {other:?}"),
        }
    }

    #[test]
    fn follow_latest_moves_at_a_step_boundary_and_pinned_never_does() {
        let mut r = run();
        let log = started(Some(1));
        let gen2 = |r: &AgentRun| {
            decide(&Observed {
                run: r,
                log: &log,
                agent_generation: Some(2),
                job: job(1, 1, JobState::Succeeded, Some(0)),
                lease: None,
                now: t(1),
            })
        };
        assert_eq!(gen2(&r), Act::CreateJob { seq: 1, attempt: 2 });
        r.spec.version_policy = VersionPolicy::FollowLatest;
        assert_eq!(gen2(&r), Act::FollowAgent);
        // A running step is asked to yield at its next boundary.
        let act = decide(&Observed {
            run: &r,
            log: &log,
            agent_generation: Some(2),
            job: job(1, 1, JobState::Active, None),
            lease: Some(LeaseView {
                live: true,
                free_for: Duration::ZERO,
                released: false,
            }),
            now: t(1),
        });
        assert_eq!(act, Act::AskToYield);
    }

    #[test]
    fn a_released_lease_after_progress_starts_the_next_step_at_once() {
        let mut r = run();
        r.status.as_mut().unwrap().step = Some(CurrentStep {
            seq: 1,
            job: Some("r-s1-a1".into()),
            attempt: 1,
            failed_jobs: 0,
            stalled: 0,
            started_at: Some(Time(t(0))),
            token_key: None,
        });
        let mut log = started(None);
        let observed = |log: &RunState, released: bool, running: bool| {
            let mut active = job(1, 1, JobState::Active, None).unwrap();
            active.running = running;
            decide(&Observed {
                run: &r,
                log,
                agent_generation: Some(1),
                job: Some(active),
                lease: Some(LeaseView {
                    live: false,
                    free_for: Duration::ZERO,
                    released,
                }),
                now: t(1),
            })
        };
        // Released without recording anything: the Job's own end decides.
        assert_eq!(observed(&log, true, true), Act::Idle);
        log.apply(Entry::Observation(crate::runlog::records::Observation {
            text: "x".into(),
            about_seq: None,
            stop: None,
            attempts: None,
        }));
        // Recorded and released: the next step starts though the pod has
        // not exited (or was never counted ready).
        assert_eq!(
            observed(&log, true, false),
            Act::CreateJob { seq: 2, attempt: 1 }
        );
        // Recorded but lapsed, not released: the worker may still be at
        // work; it is judged lost only after LOST_AFTER.
        assert_eq!(observed(&log, false, true), Act::Wait(LOST_AFTER));
    }

    #[test]
    fn final_phases_map_from_outcomes() {
        assert_eq!(Outcome::NeedsHuman.phase(), Phase::Failed);
        assert_eq!(Outcome::BudgetExceeded.phase(), Phase::BudgetExceeded);
    }
}
