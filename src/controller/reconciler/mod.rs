//! Reconcile one AgentRun: read (run, agent, log, Job, lease) → decide (pure,
//! in `decide` and `phase`) → act → write status.

pub mod checkpoint;
pub mod job;
pub mod phase;
pub mod plan;
pub mod status;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::api::{Agent, AgentRun, AgentTemplate};
use crate::controller::FIELD_MANAGER;
use crate::controller::approvals::Waiting;
use crate::controller::context::{Context, append, notice};
use crate::controller::error::Error;
use crate::controller::memory::{Asleep, Replayed};
use crate::controller::metrics::ReasonLabel;
use crate::controller::watchers::tool_discovery::Answer;
use crate::failpoint;
use crate::replay::{Entry, RunState};
use crate::runlog::records::{RunFinished, RunStarted, VersionChanged, Versions};
use crate::store::{Head, Pages, StoreError, check_anchor_after, sha256_hex};
use crate::tools::{McpCatalog, Toolbox};
use phase::{Act, JobState, JobView, LeaseView, Observed};
use plan::{AgentLookup, plan};

/// What the controller read about a run's agent.
struct Resolved {
    lookup: AgentLookup,
    template: Option<AgentTemplate>,
}

/// Reconciles `run` in its turn ([`crate::controller::slots`]). The work is boxed: a
/// reconcile waiting for its slot is a small future.
/// A panic anywhere in it fails this run's reconcile, never the process
/// that reconciles every run (kube-runtime would carry it up through the
/// controller's own future).
pub async fn reconcile(run: Arc<AgentRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    crate::contain::contain(reconcile_in_turn(run, ctx))
        .await
        .unwrap_or_else(panicked)
}

/// A reconcile's panic as its error, logged (the hook logged where).
fn panicked(p: crate::contain::Panicked) -> Result<Action, Error> {
    tracing::error!(error = %p, "reconcile panicked; the run backs off");
    Err(p.into())
}

async fn reconcile_in_turn(run: Arc<AgentRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = run.namespace().unwrap_or_default();
    let _slot = ctx.slots.enter(&ns).await;
    // The run may have changed while this waited: read it as the watch has it now.
    let run = match ctx.run_cache.as_ref() {
        Some(cache) => match cache.get(&ObjectRef::from_obj(&*run)) {
            Some(now) => now,
            None => return Ok(Action::await_change()),
        },
        None => run,
    };
    Box::pin(reconcile_now(run, ctx)).await
}

#[tracing::instrument(name = "reconcile", skip_all, fields(run = %run.name_any(), namespace = run.namespace().unwrap_or_default(), step = tracing::field::Empty))]
async fn reconcile_now(run: Arc<AgentRun>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciliations.inc();
    // A panic in the work is recorded like any failure (a Stalled condition
    // and Event, then the error backoff).
    let result = crate::contain::contain(reconcile_inner(&run, &ctx))
        .await
        .unwrap_or_else(panicked);
    match &result {
        Err(e) => report_stalled(&run, &ctx, e).await,
        Ok(_) => {
            let uid = run.uid().unwrap_or_default();
            ctx.memory.succeeded(&uid);
        }
    }
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    result
}

async fn reconcile_inner(run: &AgentRun, ctx: &Context) -> Result<Action, Error> {
    let began = chrono::Utc::now();
    let ns = run.namespace().unwrap_or_default();
    let uid = run.uid().unwrap_or_default();

    // Read: the agent.
    let resolved = resolve_agent(run, ctx, &ns).await?;
    let mut plan = plan(run, &resolved.lookup, Timestamp::now());
    let Some(template) = resolved.template else {
        write_status(run, ctx, &plan.status, plan.notices).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    };
    let agent_generation = resolved.lookup.generation();

    // A waiting run with nothing to decide is not read (see `still_asleep`).
    let cached = ctx.memory.take(&uid);
    if cached.is_none()
        && plan.notices.is_empty()
        && let Some(wait) = still_asleep(run, ctx, &uid).await?
    {
        return Ok(Action::requeue(wait));
    }

    // Read: the log (the run's truth, verified against the anchored head;
    // only records past the replayed head are read), the step Job and, if
    // needed, the lease.
    let replayed = match replay(ctx, run, cached).await? {
        Ok(replayed) => replayed,
        Err(tampered) => return stop_tampered(run, ctx, &ns, tampered).await,
    };
    tracing::Span::current().record("step", replayed.head.len);
    let job = read_job(run, ctx, &ns).await?;
    let lease = read_lease(ctx, &uid, job.as_ref(), &replayed).await?;

    // Decide.
    let now = Timestamp::now();
    let act = phase::decide(&Observed {
        run,
        log: &replayed.state,
        agent_generation,
        job: job.clone(),
        lease: lease.clone(),
        now,
    });
    tracing::debug!(run = %run.name_any(), namespace = %ns, ?act, ?agent_generation, ?job, ?lease, "decided");

    // Act.
    let mut acting = Acting::new(run, std::mem::take(&mut plan.notices), began, now);
    let (act, template) = govern(run, ctx, &ns, act, template, &replayed.state).await?;
    acting.idle = act == Act::Idle;
    let observed = Seen {
        ns: &ns,
        uid: &uid,
        replayed: &replayed,
        template: &template,
        agent_generation,
        job: job.as_ref(),
        lease: lease.as_ref(),
        now,
    };
    let requeue = act_on(run, ctx, act, &observed, &mut acting).await?;

    // Record: the status, from the log as it is now.
    record(
        run,
        ctx,
        plan.status,
        replayed,
        job.as_ref(),
        acting,
        requeue,
    )
    .await
}

/// The lease, read when a live step Job may hold it (a Job whose worker
/// recorded something may have given the run back before its pod was ever
/// counted ready).
async fn read_lease(
    ctx: &Context,
    uid: &str,
    job: Option<&JobView>,
    replayed: &Replayed,
) -> Result<Option<LeaseView>, Error> {
    match job {
        Some(j) if j.state == JobState::Active && (j.running || replayed.head.len > j.seq) => {
            Ok(Some(probe_lease(ctx, uid).await?))
        }
        _ => {
            ctx.memory.lease_free_for(uid, false);
            Ok(None)
        }
    }
}

/// What a reconcile read, for acting on its decision.
struct Seen<'a> {
    ns: &'a str,
    uid: &'a str,
    replayed: &'a Replayed,
    template: &'a AgentTemplate,
    agent_generation: Option<i64>,
    job: Option<&'a JobView>,
    lease: Option<&'a LeaseView>,
    now: Timestamp,
}

/// Carries out the decision; returns when to look at the run again
/// (`Duration::ZERO`: at once, `Duration::MAX`: on a change only).
async fn act_on(
    run: &AgentRun,
    ctx: &Context,
    act: Act,
    seen: &Seen<'_>,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let Seen {
        ns,
        uid,
        replayed,
        template,
        agent_generation,
        job,
        lease,
        now,
    } = *seen;
    Ok(match act {
        Act::StartRun => start_run(run, ctx, replayed, template, agent_generation, acting).await?,
        Act::FollowAgent => {
            follow_agent(run, ctx, replayed, template, agent_generation, acting).await?
        }
        Act::CreateJob { seq, attempt } => {
            create_job(
                run, ctx, ns, replayed, template, job, seq, attempt, now, acting,
            )
            .await?
        }
        Act::DeleteJob { name } => delete_job(ctx, ns, uid, &name, acting).await?,
        Act::Finish(finished) => finish(ctx, uid, replayed, finished).await?,
        Act::Conclude(finished) => {
            acting.concluded = Some(finished);
            Duration::MAX
        }
        Act::HandleApproval { request_seq } => {
            let wait = handle_approval(run, ctx, replayed, request_seq, now, acting).await?;
            if acting.awaiting.is_some() {
                let_go_of_job(ctx, ns, job, lease, acting).await?;
            }
            wait
        }
        Act::Wait(d) => d,
        Act::AwaitPolicy {
            waiting_on,
            message,
        } => {
            acting.policy = Some((waiting_on, message));
            POLICY_RECHECK
        }
        Act::AskToYield => {
            ctx.store.request_yield(uid).await.map_err(Error::Store)?;
            idle_requeue(ctx, run, now)
        }
        Act::Idle => idle_requeue(ctx, run, now),
    })
}

/// Appends the run's `RunFinished`.
async fn finish(
    ctx: &Context,
    uid: &str,
    replayed: &Replayed,
    finished: RunFinished,
) -> Result<Duration, Error> {
    let step = Entry::RunFinished(finished);
    match append(ctx, uid, &replayed.head, step.clone()).await {
        Ok(()) => Ok(Duration::ZERO),
        // A worker still holds the run (the step runner that reached the
        // end, exiting; or one still at work when the run is stopped): the
        // run ends now, not when its lease lapses.
        Err(Error::Store(StoreError::LeaseHeld { .. })) => {
            fence_worker(ctx, uid).await?;
            append(ctx, uid, &replayed.head, step).await?;
            Ok(Duration::ZERO)
        }
        Err(e) => Err(e),
    }
}

/// Raises, follows or settles the run's Approval for the request at `request_seq`.
async fn handle_approval(
    run: &AgentRun,
    ctx: &Context,
    replayed: &Replayed,
    request_seq: u64,
    now: Timestamp,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let raised = crate::controller::approvals::handle(
        run,
        ctx,
        &replayed.state,
        &replayed.head,
        request_seq,
        now,
        &mut acting.notices,
    )
    .await?;
    Ok(match raised {
        Some(waiting) => {
            // Nothing but the decision (an event) or the expiry moves it.
            let wait = Duration::try_from(waiting.expires_at.duration_since(now))
                .unwrap_or_default()
                .max(Duration::from_millis(100));
            acting.awaiting = Some(waiting);
            wait
        }
        None => Duration::ZERO,
    })
}

/// A run waiting for a person holds no pod, not even an ended one: once
/// the Job that asked is done (it ended well, or its worker gave the run
/// back and is exiting, or it is gone), the run forgets it and Kubernetes
/// removes it with its pod as soon as it has ended, not 10 minutes later.
/// Deleting many waiting runs then leaves the node no pods to clean up at
/// once (a live run's next pod waited 30 s behind a thousand). A failed Job
/// is kept: its logs say why, and the next attempt fences its worker.
async fn let_go_of_job(
    ctx: &Context,
    ns: &str,
    job: Option<&JobView>,
    lease: Option<&LeaseView>,
    acting: &mut Acting,
) -> Result<(), Error> {
    let Some(job) = job else {
        return Ok(());
    };
    let done = match job.state {
        JobState::Succeeded | JobState::Missing => true,
        JobState::Active => lease.is_some_and(|l| l.released),
        JobState::Failed { .. } => false,
    };
    if !done {
        return Ok(());
    }
    if job.state != JobState::Missing {
        remove_when_ended(ctx, ns, &job.name).await?;
    }
    if let Some(step) = acting.step.as_mut() {
        step.job = None;
    }
    Ok(())
}

/// Whether a waiting run still naming `job` lets go of it later, when it
/// ends (a failed Job is kept for good: nothing to wait for).
fn lets_go_later(job: Option<&JobView>) -> bool {
    job.is_some_and(|j| !matches!(j.state, JobState::Failed { .. }))
}

/// Sets the Job's time to live after it ends to zero: the TTL controller
/// deletes it, and its pod, when it has ended (at once if it has).
async fn remove_when_ended(ctx: &Context, ns: &str, name: &str) -> Result<(), Error> {
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let patch = json!({"spec": {"ttlSecondsAfterFinished": 0}});
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    match jobs.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(Error::Write {
            what: "step Job",
            source,
        }),
    }
}

/// Writes the status from the log as it is after acting (read again only
/// if this reconcile appended or the head moved meanwhile: a waiting run
/// woken by a Job's deletion reads nothing), keeps the replayed log for the
/// next reconcile and says when that is.
async fn record(
    run: &AgentRun,
    ctx: &Context,
    planned: crate::api::AgentRunStatus,
    replayed: Replayed,
    job: Option<&JobView>,
    acting: Acting,
    requeue: Duration,
) -> Result<Action, Error> {
    let (idle, now) = (acting.idle, acting.now);
    let uid = run.uid().unwrap_or_default();
    let ns = run.namespace().unwrap_or_default();
    let reread = acting.concluded.is_none() && (requeue.is_zero() || acting.awaiting.is_some());
    let mut replayed = if reread {
        match replay(ctx, run, Some(replayed)).await? {
            Ok(replayed) => replayed,
            Err(tampered) => return stop_tampered(run, ctx, &ns, tampered).await,
        }
    } else {
        replayed
    };
    // Not while the run has more to do at once (its next Job follows an
    // appended decision): the reconcile that hands it over to a Job, a
    // human or its end does it.
    if replayed.resumed && !requeue.is_zero() {
        if let Err(tampered) = verify_whole(ctx, run, &uid).await? {
            return stop_tampered(run, ctx, &ns, tampered).await;
        }
        replayed.resumed = false;
    }
    if !replayed.resumed {
        ctx.memory.set_verified(&uid, replayed.head);
    }
    replayed.compact();
    let mut new_status = status::compose(
        run,
        planned,
        &replayed.state,
        &replayed.head,
        &ctx.store_name,
        acting.step,
        acting.concluded.as_ref(),
        job,
        acting
            .awaiting
            .as_ref()
            .map(|w| (w.name.clone(), w.expires_at))
            .as_ref(),
        ctx.signer.key_id(),
        now,
    );
    if let Some(log) = new_status.log.as_mut() {
        log.checkpoint = next_checkpoint(run, ctx, &uid, &replayed);
    }
    let mut notices = acting.notices;
    let awaited = acting
        .policy
        .as_ref()
        .map(|(w, m)| (w.as_str(), m.as_str()));
    if let Some((warn, reason, message)) =
        status::set_allowed(&mut new_status, awaited, run.metadata.generation, now)
    {
        notices.push(notice(warn, reason, message));
    }
    let failed = acting.discovery.as_deref();
    if let Some((warn, reason, message)) =
        status::set_discovered(&mut new_status, failed, run.metadata.generation, now)
    {
        notices.push(notice(warn, reason, message));
    }
    let ends_now = ends_now(run, &new_status);
    if let Some(outcome) = ends_now {
        notices.push(end_notice(outcome, &new_status));
    }
    let finished = new_status.phase.is_some_and(|p| p.is_terminal());
    // While a step runs, its log grows record by record: that progress
    // reaches the status at most every PROGRESS_EVERY (a write per record
    // would be most of the controller's API traffic at scale).
    let (requeue, version) = match idle && notices.is_empty() && only_progress(run, &new_status) {
        true => match progress_due(ctx, &uid) {
            None => (requeue, write_status(run, ctx, &new_status, notices).await?),
            Some(wait) => (requeue.min(wait), run.resource_version()),
        },
        false => (requeue, write_status(run, ctx, &new_status, notices).await?),
    };
    if ends_now.is_some() && ctx.memory.first_end(&uid) {
        report_run_span(run, &new_status);
    }
    // A waiting run whose step Job is not let go yet (its worker still
    // holds the run) keeps its replayed log: the Job's end wakes it to let
    // go, and that reconcile must not read the whole log again.
    let holds_job = new_status.step.as_ref().is_some_and(|s| s.job.is_some()) && lets_go_later(job);
    let asleep = acting
        .awaiting
        .as_ref()
        .filter(|_| !holds_job)
        .map(|w| asleep(run, replayed.head, replayed.generation(), w, version));
    keep_replayed(ctx, run, &uid, replayed, finished, asleep);
    let requeue = match finished {
        true => requeue,
        false => requeue.min(until_deadline(run, now)),
    };
    Ok(match requeue {
        Duration::MAX => Action::await_change(),
        d if d.is_zero() => Action::requeue(AT_ONCE),
        d => Action::requeue(d),
    })
}

/// How often a run waiting for an AgentPolicy looks again (policies do not
/// wake runs; a GitOps apply brings the policy within moments).
const POLICY_RECHECK: Duration = Duration::from_secs(5);

/// "Look again at once": after a write of the controller's own (its status,
/// a record), long enough for the watch to bring the run's new version back
/// in the usual case (a few ms on a local API server), short enough not to
/// show in the time from a decision or a start to the next Job (it is on
/// both paths). The log, not the status, decides what comes next, so a
/// stale read costs a repeated write at most.
const AT_ONCE: Duration = Duration::from_millis(10);

/// How long until the run's deadline (`MAX` without one): whatever a
/// reconcile waits for, the deadline acts on time.
fn until_deadline(run: &AgentRun, now: Timestamp) -> Duration {
    phase::deadline(run).map_or(Duration::MAX, |d| {
        Duration::try_from(d.duration_since(now)).unwrap_or_default()
    })
}

/// The run's checkpoint to write with its status (signed; kept when the
/// log has not gone far enough past the previous one).
fn next_checkpoint(
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
    checkpoint::make(&ctx.signer, uid, replayed, ctx.checkpoint_min, previous)
}

/// The terminal phase the run reaches with this status, if it was not there.
fn ends_now(run: &AgentRun, new: &crate::api::AgentRunStatus) -> Option<crate::api::Phase> {
    new.phase
        .filter(|p| p.is_terminal())
        .filter(|&p| run.status.as_ref().and_then(|s| s.phase) != Some(p))
}

/// The Event saying how the run ended, with its error or result.
fn end_notice(
    outcome: crate::api::Phase,
    new: &crate::api::AgentRunStatus,
) -> crate::controller::context::Notice {
    let warn = outcome != crate::api::Phase::Succeeded;
    let msg = new.error.clone().or(new.result.clone()).unwrap_or_default();
    notice(warn, phase_reason(outcome), truncate(&msg, 900))
}

/// How often a running step's progress (log length and head, usage) is
/// written to its run's status.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Whether `new` differs from the run's status in its progress only.
fn only_progress(run: &AgentRun, new: &crate::api::AgentRunStatus) -> bool {
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

/// `None` when the run's progress may be written now (and notes it was);
/// otherwise how long until it may.
fn progress_due(ctx: &Context, uid: &str) -> Option<Duration> {
    ctx.memory.progress_due(uid, PROGRESS_EVERY)
}

/// What acting on a decision adds to the status.
struct Acting {
    notices: Vec<crate::controller::context::Notice>,
    step: Option<crate::api::CurrentStep>,
    concluded: Option<RunFinished>,
    awaiting: Option<Waiting>,
    /// When the reconcile began (for `agentrun_dispatch_seconds`).
    began: chrono::DateTime<chrono::Utc>,
    /// The decision was to do nothing (only progress may be written).
    idle: bool,
    /// The time the decision was made for.
    now: Timestamp,
    /// What the run waits for from the platform (waitingOn, why), if anything.
    policy: Option<(String, String)>,
    /// Why its MCP discovery failed, while it is asked again.
    discovery: Option<String>,
}

impl Acting {
    fn new(
        run: &AgentRun,
        notices: Vec<crate::controller::context::Notice>,
        began: chrono::DateTime<chrono::Utc>,
        now: Timestamp,
    ) -> Acting {
        Acting {
            notices,
            step: run.status.as_ref().and_then(|s| s.step.clone()),
            concluded: None,
            awaiting: None,
            began,
            idle: false,
            now,
            policy: None,
            discovery: None,
        }
    }
}

/// The platform's policies judge starting, following and every Job: a
/// refused act becomes the run's end; the template is the governed one.
async fn govern(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    act: Act,
    template: AgentTemplate,
    log: &RunState,
) -> Result<(Act, AgentTemplate), Error> {
    if !matches!(
        act,
        Act::StartRun | Act::FollowAgent | Act::CreateJob { .. }
    ) {
        return Ok((act, template));
    }
    use crate::controller::watchers::platform::{self, Platform};
    // What a later object can still give is waited for; only what none can
    // fix ends the run.
    let judge = |platform: &Platform| {
        let governed = platform.govern(&template);
        let awaited = platform.awaited(&template);
        let refused = platform
            .forbidden_inline(run)
            .or_else(|| {
                awaited
                    .is_none()
                    .then(|| platform.refusal(run, &template))?
            })
            .or_else(|| Platform::unjudgeable(run, &governed));
        (governed, refused, awaited)
    };
    let cached = platform::read(&ctx.client, ctx.policy_cache.as_ref(), ns).await?;
    let (mut governed, mut refused, mut awaited) = judge(&cached);
    if (refused.is_some() || awaited.is_some()) && ctx.policy_cache.is_some() {
        // The watch cache may not have seen a policy created together with
        // the run yet: the API server's own policies decide it.
        let platform = platform::read(&ctx.client, None, ns).await?;
        (governed, refused, awaited) = judge(&platform);
    }
    let template = governed;
    let failed = |result, reason| RunFinished {
        outcome: crate::runlog::records::Outcome::Failed,
        result,
        error: Some(reason),
    };
    let act = match (act, refused, awaited) {
        (Act::StartRun, Some(reason), _) => Act::Conclude(failed(None, reason)),
        (Act::FollowAgent | Act::CreateJob { .. }, Some(reason), _) => {
            Act::Finish(failed(log.last_text(), reason))
        }
        (_, None, Some(a)) => Act::AwaitPolicy {
            waiting_on: a.waiting_on,
            message: a.message,
        },
        (act, _, _) => act,
    };
    Ok((act, template))
}

/// Appends `RunStarted` with the resolved agent, or concludes the run when
/// the agent cannot be resolved.
async fn start_run(
    run: &AgentRun,
    ctx: &Context,
    replayed: &Replayed,
    template: &AgentTemplate,
    agent_generation: Option<i64>,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let uid = run.uid().unwrap_or_default();
    let mcp = match discovered(run, ctx, template) {
        Answer::Pending => return Ok(DISCOVERY_RECHECK),
        Answer::Failed { reason, retry_in } => return Ok(rediscover(acting, reason, retry_in)),
        Answer::Ready(mcp) => mcp,
    };
    match mcp.and_then(|mcp| snapshot(run, template, agent_generation, mcp)) {
        Ok(started) => {
            append(ctx, &uid, &replayed.head, Entry::RunStarted(started)).await?;
            ctx.discovery.forget(&uid);
            acting.notices.push(notice(
                false,
                "RunStarted",
                "the run's agent is pinned in the log; starting".into(),
            ));
            Ok(Duration::ZERO)
        }
        Err(reason) => {
            ctx.discovery.forget(&uid);
            acting
                .notices
                .push(notice(true, "InvalidAgent", reason.clone()));
            acting.concluded = Some(RunFinished {
                outcome: crate::runlog::records::Outcome::Failed,
                result: None,
                error: Some(reason),
            });
            Ok(Duration::MAX)
        }
    }
}

/// How long a run whose catalog is being discovered waits before it is
/// looked at again, should the worker's wake-up be missed.
const DISCOVERY_RECHECK: Duration = Duration::from_secs(60);

/// A run whose MCP discovery failed waits, saying why, and is looked at
/// again when the discovery may be asked again: a server applied with the
/// run may not answer yet, and the run's deadline still ends the wait.
fn rediscover(acting: &mut Acting, reason: String, retry_in: Duration) -> Duration {
    acting.discovery = Some(reason);
    retry_in.min(DISCOVERY_RECHECK)
}

/// The MCP catalog of the run's agent, from the discovery worker (never
/// discovered here: see [`crate::controller::watchers::tool_discovery`]).
fn discovered(run: &AgentRun, ctx: &Context, template: &AgentTemplate) -> Answer {
    let field = match (&run.spec.agent, &run.spec.agent_ref) {
        (None, Some(r)) => format!("Agent {}: spec.tools", r.name),
        _ => "spec.agent.tools".to_string(),
    };
    ctx.discovery.catalog(run, &template.tools, &field)
}

/// Appends `VersionChanged` to the Agent's current version (FollowLatest).
async fn follow_agent(
    run: &AgentRun,
    ctx: &Context,
    replayed: &Replayed,
    template: &AgentTemplate,
    agent_generation: Option<i64>,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let uid = run.uid().unwrap_or_default();
    let from = replayed
        .state
        .snapshot
        .as_ref()
        .map(|s| s.versions.clone())
        .unwrap_or_default();
    let mcp = match discovered(run, ctx, template) {
        Answer::Pending => return Ok(DISCOVERY_RECHECK),
        Answer::Failed { reason, retry_in } => return Ok(rediscover(acting, reason, retry_in)),
        Answer::Ready(mcp) => mcp,
    };
    match mcp.and_then(|mcp| snapshot(run, template, agent_generation, mcp)) {
        Ok(now_agent) => {
            let msg = format!(
                "following the Agent from generation {:?} to {:?}",
                from.agent_generation, now_agent.versions.agent_generation
            );
            let changed = VersionChanged {
                agent: now_agent.agent,
                tools: now_agent.tools,
                mcp: now_agent.mcp,
                from,
                to: now_agent.versions,
            };
            append(ctx, &uid, &replayed.head, Entry::VersionChanged(changed)).await?;
            ctx.discovery.forget(&uid);
            acting.notices.push(notice(false, "VersionChanged", msg));
            Ok(Duration::ZERO)
        }
        // The run follows the Agent and cannot: it ends, once (asking again
        // would discover again at every reconcile).
        Err(reason) => {
            let reason = format!(
                "following the Agent from generation {:?} to {agent_generation:?}: {reason}",
                from.agent_generation
            );
            acting
                .notices
                .push(notice(true, "InvalidAgent", reason.clone()));
            let failed = RunFinished {
                outcome: crate::runlog::records::Outcome::Failed,
                result: replayed.state.last_text(),
                error: Some(reason),
            };
            let next = finish(ctx, &uid, replayed, failed).await?;
            ctx.discovery.forget(&uid);
            Ok(next)
        }
    }
}

/// Creates the Job of step `seq` (and, once, the run's step credential).
#[allow(clippy::too_many_arguments)]
async fn create_job(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    replayed: &Replayed,
    template: &AgentTemplate,
    previous: Option<&JobView>,
    seq: u64,
    attempt: u32,
    now: Timestamp,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let uid = run.uid().unwrap_or_default();
    if attempt > 1 {
        // A failed attempt may have been a pod that could not mount the
        // credential (someone deleted the Secret): make sure it is there.
        ctx.memory.set_credential(&uid, false);
    }
    ensure_credential(run, ctx, ns, &uid).await?;
    let timeout = crate::api::parse_duration(&run.spec.step_timeout)
        .map_or(600, |d| d.as_secs().max(1) as i64);
    let failed_jobs = failed_jobs_before(run, previous);
    let stalled = previous.map_or(0, |j| phase::stalled_after(j, seq > j.seq));
    let job = job::build(
        run,
        template,
        seq,
        attempt,
        failed_jobs,
        timeout,
        &replayed.head,
        &ctx.jobs,
    );
    let name = job.name_any();
    fence_previous(ctx, &uid, previous, &name).await?;
    let created = create_step_job(ctx, ns, &job).await?;
    if let Some(at) = replayed
        .head_at
        .filter(|_| created && attempt == 1 && seq > 0)
    {
        ctx.metrics.observe_dispatch(at, acting.began);
    }
    if created {
        let (reason, warn) = if attempt > 1 {
            ("StepRetried", true)
        } else {
            ("StepStarted", false)
        };
        acting.notices.push(notice(
            warn,
            reason,
            format!("step {seq} attempt {attempt}: Job {name}"),
        ));
    }
    acting.step = Some(crate::api::CurrentStep {
        seq,
        job: Some(name),
        attempt,
        failed_jobs,
        stalled,
        started_at: Some(Time(now)),
        token_key: Some(ctx.jobs.key_id.clone()),
    });
    Ok(idle_requeue(ctx, run, now))
}

/// The worker of a failed or vanished Job (timed out, killed) may still
/// hold the run's lease: fenced before the next Job, which then need not
/// wait for it. Not when a pod of that next Job holds it already: a
/// reconcile that saw the run before its last status write creates that Job
/// again (harmlessly) and must not stop its worker.
async fn fence_previous(
    ctx: &Context,
    uid: &str,
    previous: Option<&JobView>,
    next: &str,
) -> Result<(), Error> {
    if !previous.is_some_and(|j| matches!(j.state, JobState::Failed { .. } | JobState::Missing)) {
        return Ok(());
    }
    let lease = ctx.store.lease(uid).await.map_err(Error::Store)?;
    match held_by_a_pod_of(lease.as_ref().map(|l| l.holder.as_str()), next) {
        true => Ok(()),
        false => fence_worker(ctx, uid).await,
    }
}

/// Whether the lease's holder is a pod of Job `job` (pods are named
/// `<job>-<suffix>`; a Job whose name merely starts with `job` is another).
fn held_by_a_pod_of(holder: Option<&str>, job: &str) -> bool {
    holder.is_some_and(|h| {
        h.strip_prefix(job)
            .is_some_and(|pod| pod.starts_with('-') && pod.len() > 1)
    })
}

/// Creates the step Job; false when it existed already. Deterministic
/// names make a repeated create harmless (a reconcile that saw the run
/// before its last status write): it is said once only.
async fn create_step_job(ctx: &Context, ns: &str, job: &Job) -> Result<bool, Error> {
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    match jobs.create(&params, job).await {
        Ok(_) => {
            failpoint::hit("controller:after-create:Job");
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(source) => Err(Error::Write {
            what: "step Job",
            source,
        }),
    }
}

/// Deletes the run's step Job after fencing its worker.
async fn delete_job(
    ctx: &Context,
    ns: &str,
    uid: &str,
    name: &str,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    fence_worker(ctx, uid).await?;
    delete_step_job(ctx, ns, name).await?;
    acting
        .notices
        .push(notice(true, "StepStopped", format!("deleted Job {name}")));
    // What follows (the run's end, the next attempt) need not wait for the
    // Job to go: its worker is fenced.
    Ok(Duration::ZERO)
}

async fn delete_step_job(ctx: &Context, ns: &str, name: &str) -> Result<(), Error> {
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    match jobs.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(Error::Write {
            what: "step Job",
            source,
        }),
    }
}

/// When to look at a run again that waits on events alone (its Job, its
/// log's head, its lease): at its deadline, and otherwise only as a safety
/// net, or every few seconds when the store pushes no head events.
fn idle_requeue(ctx: &Context, run: &AgentRun, now: Timestamp) -> Duration {
    let idle = if ctx.store_pushes {
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
fn signs_with_another_key(run: &AgentRun, ctx: &Context) -> bool {
    let keys = run
        .status
        .as_ref()
        .and_then(|s| s.log.as_ref())
        .and_then(|l| l.signing_keys.as_ref());
    keys.and_then(|k| k.last())
        .is_some_and(|k| k.key != ctx.signer.key_id())
}

/// A waiting run with nothing to decide: how long it may sleep (to its
/// Approval's expiry or its deadline), its log left unread. It has nothing
/// to decide when its token ([`Asleep`]) finds the run, its Approval's
/// decisions and its head unchanged, or, seen for the first time by this
/// process, when its status says it waits on a pending Approval with the
/// head where the status anchors it. `None`: read the log the ordinary way
/// (whole, and verified, for a waiting run).
async fn still_asleep(run: &AgentRun, ctx: &Context, uid: &str) -> Result<Option<Duration>, Error> {
    // A rotated key ends the retired one's window at once, not at the run's
    // next decision: a run whose status does not yet record the key this
    // controller signs with is reconciled, and its status records it.
    if signs_with_another_key(run, ctx) {
        return Ok(None);
    }
    // Its step Job, still named, is let go once done (`let_go_of_job`):
    // the Job's end wakes it for that (after a restart: a running
    // controller kept its log for it, see `record`).
    let ns = run.namespace().unwrap_or_default();
    if lets_go_later(read_job(run, ctx, &ns).await?.as_ref()) {
        return Ok(None);
    }
    let now = Timestamp::now();
    let known = match ctx.memory.take_asleep(uid) {
        Some(t) if t.run_version == run.resource_version() && now < t.wake_at => Some(t),
        Some(_) => return Ok(None),
        None if !ctx.memory.follows(uid) && waits_as_left(run) => None,
        None => return Ok(None),
    };
    let deadline = phase::deadline(run);
    if deadline.is_some_and(|d| d <= now) {
        return Ok(None);
    }
    let (head, generation) = match &known {
        Some(t) if ctx.memory.unchanged_since(uid, t.generation) => (t.head, t.generation),
        _ => {
            let generation = ctx.memory.begin_read(uid);
            let head = ctx.store.head(uid).await.map_err(Error::Store)?;
            ctx.metrics.observe_read(&[]);
            (head, generation)
        }
    };
    let (expected_head, name) = match &known {
        Some(t) => (t.head, t.approval.clone()),
        None => match run.status.as_ref().and_then(|s| s.approval.as_ref()) {
            Some(a) => (anchored_head(run), a.name.clone()),
            None => return Ok(None),
        },
    };
    if head != expected_head {
        return Ok(None);
    }
    let Some(waiting) = crate::controller::approvals::pending(run, ctx, &name, now).await? else {
        return Ok(None);
    };
    if known.is_some_and(|t| t.approval_generation != waiting.generation) {
        return Ok(None);
    }
    let asleep = asleep(run, head, generation, &waiting, run.resource_version());
    let wait = Duration::try_from(asleep.wake_at.duration_since(now)).unwrap_or_default();
    ctx.memory.follow(uid, ObjectRef::from_obj(run));
    ctx.memory.put_asleep(uid, asleep);
    Ok(Some(wait.max(Duration::from_millis(100))))
}

/// Whether the run's status says it waits on an Approval, for the spec it
/// has now, with a log: how the controller left it.
fn waits_as_left(run: &AgentRun) -> bool {
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
fn asleep(
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
const IDLE_REQUEUE: Duration = Duration::from_secs(300);

/// The run's log replayed: `cached` extended by the records past its head
/// (none read when head events and the controller's own appends say it is
/// current). The inner error is a log that failed verification (the run
/// must stop); the outer one a store that could not be read (retried).
async fn replay(
    ctx: &Context,
    run: &AgentRun,
    cached: Option<Replayed>,
) -> Result<Result<Replayed, StoreError>, Error> {
    let uid = run.uid().unwrap_or_default();
    if cached.as_ref().is_some_and(|c| ctx.memory.current(&uid, c)) {
        return Ok(Ok(cached.expect("checked above")));
    }
    let generation = ctx.memory.begin_read(&uid);
    let mut replayed = match cached {
        Some(cached) => cached,
        None => match resume(ctx, run, &uid).await? {
            Ok(resumed) => resumed.unwrap_or_else(Replayed::empty),
            Err(tampered) => return Ok(Err(tampered)),
        },
    };
    let (anchor, rules) = (anchored_head(run), status::signature_rules(run));
    // A log resumed at its checkpoint that reaches a head this process
    // verified whole (a run too large to hold between reconciles) is that
    // log: it is not verified whole again.
    let verified = ctx.memory.verified(&uid).filter(|_| replayed.resumed);
    if verified == Some(replayed.head) {
        replayed.resumed = false;
    }
    // A page at a time, compacted after each: what a reconcile holds of a
    // log is its window and one page, however large the records.
    let mut pages = Pages::after(ctx.store.as_ref(), &ctx.reads, &uid, replayed.head);
    loop {
        let (records, _ticket) = match checked_page(ctx, &uid, &mut pages, &anchor, &rules).await? {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(tampered) => return Ok(Err(tampered)),
        };
        ctx.metrics.observe_log(&uid, &records);
        for r in &records {
            if verified.is_some_and(|v| v == r.head()) {
                replayed.resumed = false;
            }
            replayed.apply(
                r,
                Entry::decode(r.seq, r.kind.as_str(), &r.payload).map_err(Error::Decode)?,
            );
        }
        replayed.head_at = records
            .last()
            .and_then(|r| r.created_at)
            .or(replayed.head_at);
        replayed.compact();
    }
    if let Err(tampered) = check_anchor_after(&uid, &replayed.head, &[], &anchor) {
        return Ok(Err(tampered));
    }
    Ok(Ok(ctx.memory.stamp(replayed, generation)))
}

/// The anchor check of one page read past `base`, where the page reaches
/// the anchored head (a later page, or the end of the log, checks it
/// otherwise).
fn check_anchor_within(
    uid: &str,
    base: &Head,
    page: &[crate::store::Record],
    anchor: &Head,
) -> Result<(), StoreError> {
    match anchor.len <= base.len + page.len() as u64 {
        true => check_anchor_after(uid, base, page, anchor),
        false => Ok(()),
    }
}

/// The run's log resumed at its checkpoint (`Ok(None)`: none this
/// controller signed, so it is read whole); `Err`: a record the checkpoint
/// names was rewritten.
async fn resume(
    ctx: &Context,
    run: &AgentRun,
    uid: &str,
) -> Result<Result<Option<Replayed>, StoreError>, Error> {
    let Some(cp) = run
        .status
        .as_ref()
        .and_then(|s| s.log.as_ref())
        .and_then(|l| l.checkpoint.as_ref())
    else {
        return Ok(Ok(None));
    };
    if !checkpoint::trusted(&ctx.verifier, uid, cp, &anchored_head(run)) {
        tracing::warn!(run = %run.name_any(), "status.log.checkpoint is not this controller's: reading the log whole");
        return Ok(Ok(None));
    }
    match checkpoint::resume(
        ctx.store.as_ref(),
        &ctx.verifier,
        uid,
        cp,
        &status::signature_rules(run),
    )
    .await
    {
        Ok(Some(resumed)) => {
            ctx.metrics.observe_read(&resumed.records);
            ctx.metrics.log_resumes.inc();
            Ok(Ok(Some(Replayed::resumed(
                resumed.state,
                resumed.head,
                &resumed.records,
            ))))
        }
        Ok(None) => Ok(Ok(None)),
        Err(e @ StoreError::ChainBroken { .. }) => Ok(Err(e)),
        Err(e) => Err(Error::Store(e)),
    }
}

/// Verifies a resumed run's whole log, once, after the decision it was
/// resumed for (that decision was made on verified records: the window
/// chained from the checkpoint, the pinned ones by their signed hashes).
async fn verify_whole(
    ctx: &Context,
    run: &AgentRun,
    uid: &str,
) -> Result<Result<(), StoreError>, Error> {
    let (anchor, rules) = (anchored_head(run), status::signature_rules(run));
    let mut pages = Pages::after(ctx.store.as_ref(), &ctx.reads, uid, Head::EMPTY);
    loop {
        match checked_page(ctx, uid, &mut pages, &anchor, &rules).await? {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(tampered) => return Ok(Err(tampered)),
        }
    }
    Ok(check_anchor_after(uid, &pages.head(), &[], &anchor))
}

/// The next page of `pages`, verified: its chain, the anchored head where
/// it holds it, and the controller's signatures. The inner error is a log
/// that failed verification; the outer one a store that could not be read.
async fn checked_page(
    ctx: &Context,
    uid: &str,
    pages: &mut Pages<'_>,
    anchor: &Head,
    rules: &crate::store::SignatureRules,
) -> Result<Result<Option<(Vec<crate::store::Record>, crate::store::PageTicket)>, StoreError>, Error>
{
    let base = pages.head();
    let (records, ticket) = match pages.next().await {
        Ok(Some(page)) => page,
        Ok(None) => return Ok(Ok(None)),
        Err(e @ StoreError::ChainBroken { .. }) => return Ok(Err(e)),
        Err(e) => return Err(Error::Store(e)),
    };
    ctx.metrics.observe_read(&records);
    let checked = check_anchor_within(uid, &base, &records, anchor)
        .and_then(|()| ctx.verifier.check(uid, &records, rules));
    Ok(checked.map(|()| Some((records, ticket))))
}

/// Keeps the run's replayed log for its next reconcile, or forgets it: a
/// finished run's for good, a run waiting for a human's until it is woken
/// (it is read once then: thousands of waiting runs hold no logs in memory,
/// only their tokens).
fn keep_replayed(
    ctx: &Context,
    run: &AgentRun,
    uid: &str,
    replayed: Replayed,
    finished: bool,
    asleep: Option<Asleep>,
) {
    if finished {
        ctx.memory.forget(uid);
        return;
    }
    ctx.memory.follow(uid, ObjectRef::from_obj(run));
    // A waiting run's log is read and verified whole when it wakes: a log
    // rewritten in the database while it waited is caught then (parking it
    // within a budget saved those reads but missed that).
    match asleep {
        Some(asleep) => ctx.memory.put_asleep(uid, asleep),
        None => ctx.memory.keep(uid, replayed),
    }
}

/// A run the controller cannot move says so where its user looks: the
/// `Stalled` condition, `status.error` and a Warning Event (once per
/// distinct error), not only the controller's log. Best effort; the next
/// successful reconcile clears both (`status::compose`).
async fn report_stalled(run: &AgentRun, ctx: &Context, error: &Error) {
    let old = run.status.clone().unwrap_or_default();
    if old.phase.is_some_and(|p| p.is_terminal()) {
        return;
    }
    let message = truncate(&error.to_string(), 900);
    let already = old
        .conditions
        .iter()
        .any(|c| c.type_ == status::STALLED && c.status == "True" && c.message == message);
    if already {
        return;
    }
    // The status as this reconcile read it, plus the stall, applied by the
    // one field manager (so the next successful apply clears both).
    let mut status = old;
    status.error = Some(message.clone());
    crate::controller::conditions::set_condition(
        &mut status.conditions,
        crate::controller::conditions::condition(
            status::STALLED,
            true,
            "ReconcileFailed",
            &message,
            run.metadata.generation,
            Timestamp::now(),
        ),
    );
    if let Err(e) = write_status(run, ctx, &status, Vec::new()).await {
        tracing::warn!(run = %run.name_any(), error = %e, "recording the stalled condition failed");
        return;
    }
    let event = Event {
        type_: EventType::Warning,
        reason: "Stalled".into(),
        note: Some(crate::text::cut(
            &message,
            crate::text::EVENT_NOTE_MAX_BYTES,
        )),
        action: "Reconcile".into(),
        secondary: None,
    };
    let _ = ctx.recorder().publish(&event, &run.object_ref(&())).await;
}

pub fn error_policy(run: Arc<AgentRun>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(run = %run.name_any(), namespace = ?run.namespace(), %error, "reconcile failed");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ReasonLabel {
            reason: error.metric_label().into(),
        })
        .inc();
    let uid = run.uid().unwrap_or_default();
    Action::requeue(error_backoff(ctx.memory.failed(&uid)))
}

/// 1 s after the first failure in a row, doubling up to 5 minutes.
fn error_backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(9);
    Duration::from_secs(1 << exp).min(Duration::from_secs(300))
}

/// `name` as the watch's cache has it, else as the API server has it: a
/// cache that lags (an object created a moment ago) never makes an
/// object look gone.
async fn cached_or_get<K>(
    cache: Option<&kube::runtime::reflector::Store<K>>,
    api: &Api<K>,
    ns: &str,
    name: &str,
) -> Result<Option<K>, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if let Some(found) = cache.and_then(|c| c.get(&ObjectRef::new(name).within(ns))) {
        return Ok(Some((*found).clone()));
    }
    api.get_opt(name).await
}

async fn resolve_agent(run: &AgentRun, ctx: &Context, ns: &str) -> Result<Resolved, Error> {
    Ok(match (&run.spec.agent_ref, &run.spec.agent) {
        (_, Some(inline)) => Resolved {
            lookup: AgentLookup::Inline,
            template: Some(inline.clone()),
        },
        (Some(r), None) => {
            let agents: Api<Agent> = Api::namespaced(ctx.client.clone(), ns);
            match cached_or_get(ctx.agent_cache.as_ref(), &agents, ns, &r.name)
                .await
                .map_err(|source| Error::Read {
                    what: "agent",
                    source,
                })? {
                Some(a) => Resolved {
                    lookup: AgentLookup::Found {
                        generation: a.metadata.generation,
                    },
                    template: Some(a.spec),
                },
                None => Resolved {
                    lookup: AgentLookup::NotFound {
                        name: r.name.clone(),
                    },
                    template: None,
                },
            }
        }
        (None, None) => Resolved {
            lookup: AgentLookup::NotFound {
                name: String::new(),
            },
            template: None,
        },
    })
}

async fn read_job(run: &AgentRun, ctx: &Context, ns: &str) -> Result<Option<JobView>, Error> {
    let Some(step) = run.status.as_ref().and_then(|s| s.step.clone()) else {
        return Ok(None);
    };
    let Some(name) = step.job.clone() else {
        return Ok(None);
    };
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let job = cached_or_get(ctx.job_cache.as_ref(), &jobs, ns, &name)
        .await
        .map_err(|source| Error::Read {
            what: "step Job",
            source,
        })?;
    let uid = run.uid().unwrap_or_default();
    let job = job.filter(|j| controlled_by(j, &uid, &name));
    ctx.metrics.observe_job(&uid, job.as_ref());
    let ended_at = job.as_ref().and_then(job_ended_at);
    let running = job
        .as_ref()
        .and_then(|j| j.status.as_ref())
        .and_then(|s| s.ready)
        .unwrap_or(0)
        > 0;
    let state = match job {
        None => JobState::Missing,
        // A Job being deleted is gone as far as the run is concerned.
        Some(j) if j.metadata.deletion_timestamp.is_some() => JobState::Missing,
        Some(j) => job_state(ctx, ns, &name, j).await?,
    };
    Ok(Some(JobView {
        name,
        seq: step.seq,
        attempt: step.attempt,
        state,
        running,
        ended_at: ended_at.map(|t| t.0),
        stalled: step.stalled,
    }))
}

/// A Job of the step's name that this run does not control was made by
/// someone else: it is no Job of the run's, and its state is never acted
/// on (the run takes its next attempt under another name).
fn controlled_by(job: &Job, uid: &str, name: &str) -> bool {
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
fn job_ended_at(job: &Job) -> Option<Time> {
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

/// The state of a Job that exists and is not being deleted.
async fn job_state(ctx: &Context, ns: &str, name: &str, job: Job) -> Result<JobState, Error> {
    let conds = job.status.and_then(|s| s.conditions).unwrap_or_default();
    let is = |t: &str| conds.iter().find(|c| c.type_ == t && c.status == "True");
    if is("Complete").is_some() {
        return Ok(JobState::Succeeded);
    }
    // FailureTarget: the Job controller decided the Job fails (its deadline
    // passed) and is terminating its pods; Failed follows once they are gone.
    let Some(c) = is("Failed").or_else(|| is("FailureTarget")) else {
        return Ok(JobState::Active);
    };
    let reason = c.reason.clone().unwrap_or_default();
    // A timeout is the step's own; otherwise a pod that is gone or was
    // deleted was lost, not crashed.
    let pods = match reason.as_str() {
        "DeadlineExceeded" => FailedPods::default(),
        _ => failed_pods(ctx, ns, name).await?,
    };
    let mut reason = format!("{reason}: {}", c.message.clone().unwrap_or_default());
    if let Some(said) = &pods.message {
        reason.push_str("; the step said: ");
        reason.push_str(said);
    }
    Ok(JobState::Failed {
        disrupted: pods.lost,
        reason,
    })
}

/// What the pods of a failed Job tell.
#[derive(Default)]
struct FailedPods {
    /// Lost rather than crashed: none is left (deleted, or collected with a
    /// lost node), or each carries a deletion timestamp or a
    /// `DisruptionTarget` condition. A pod that failed in place (an exit
    /// code, OOM-killed in its own limit) crashed.
    lost: bool,
    /// The step container's termination message (the runner's last error,
    /// or its log's last lines), escaped, its end kept.
    message: Option<String>,
}

/// Longest termination message quoted in a run's status.
const MAX_QUOTED_BYTES: usize = 1024;

async fn failed_pods(ctx: &Context, ns: &str, job: &str) -> Result<FailedPods, Error> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await
        .map_err(|source| Error::Read {
            what: "step pods",
            source,
        })?;
    let lost = list.items.iter().all(|p| {
        p.metadata.deletion_timestamp.is_some()
            || p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "DisruptionTarget" && c.status == "True")
                })
    });
    let message = list.items.iter().find_map(termination_message);
    Ok(FailedPods { lost, message })
}

/// The `step` container's termination message, if it left one.
fn termination_message(pod: &k8s_openapi::api::core::v1::Pod) -> Option<String> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    let step = statuses.iter().find(|c| c.name == "step")?;
    let text = step
        .state
        .as_ref()?
        .terminated
        .as_ref()?
        .message
        .as_deref()?;
    let text = text.trim();
    (!text.is_empty())
        .then(|| crate::text::tail(&crate::text::escape_controls(text), MAX_QUOTED_BYTES))
}

/// The run's failed step Jobs so far, counting `previous` if it failed or vanished.
fn failed_jobs_before(run: &AgentRun, previous: Option<&JobView>) -> u32 {
    let before = run
        .status
        .as_ref()
        .and_then(|s| s.step.as_ref())
        .map_or(0, |s| s.failed_jobs);
    let failed =
        previous.is_some_and(|j| matches!(j.state, JobState::Failed { .. } | JobState::Missing));
    before + u32::from(failed)
}

/// Is a worker holding the run's lease, and since when has it been free?
/// Read only: a worker whose heartbeat comes late under load keeps its
/// lease (renewing revives a lapsed one nobody took), so only a worker
/// judged lost is fenced ([`fence_worker`]).
async fn probe_lease(ctx: &Context, uid: &str) -> Result<LeaseView, Error> {
    let lease = ctx.store.lease(uid).await.map_err(Error::Store)?;
    let live = lease.as_ref().is_some_and(|l| !l.expired);
    let released = lease.as_ref().is_some_and(|l| l.released);
    let free_for = ctx.memory.lease_free_for(uid, !live);
    Ok(LeaseView {
        live,
        free_for,
        released,
    })
}

/// Takes over and gives back the lease of a run whose worker the
/// controller stops (judged lost, timed out, or its run cancelled or past
/// its deadline): the epoch moves on at once, live holder or not, so that
/// worker can neither renew nor append, and what comes next (the run's
/// end, the next attempt) need not wait for its lease to lapse.
async fn fence_worker(ctx: &Context, uid: &str) -> Result<(), Error> {
    let lease = ctx
        .store
        .take_over(uid, &ctx.identity, Duration::from_secs(2))
        .await
        .map_err(Error::Store)?;
    let _ = ctx.store.release(&lease).await;
    Ok(())
}

/// Resolves everything the run will execute with, for `RunStarted`, from
/// the catalog discovery found.
fn snapshot(
    run: &AgentRun,
    template: &AgentTemplate,
    generation: Option<i64>,
    mcp: McpCatalog,
) -> Result<RunStarted, String> {
    let toolbox = Toolbox::new(&template.tools, &mcp).map_err(|e| format!("spec.tools: {e}"))?;
    let prompt = serde_json::to_value(&template.prompt).unwrap_or_default();
    Ok(RunStarted {
        run_name: run.name_any(),
        namespace: run.namespace().unwrap_or_default(),
        input: run.spec.input.clone(),
        agent: template.clone().into(),
        tools: toolbox.defs().into_iter().map(Into::into).collect(),
        mcp: mcp.into(),
        versions: Versions {
            prompt_version: template.prompt.version.clone(),
            prompt_hash: sha256_hex(&crate::store::canonical_json(&prompt)),
            model: template.model.name.clone(),
            tool_schema_hash: toolbox.schema_hash(),
            agent_generation: generation,
        },
    })
}

/// The run's step-log credential: a Secret owned by the run (collected with
/// it) holding the gateway token bound to the run's uid, minted with the
/// current key. Created once per key, never patched, so the controller
/// needs no write access to other Secrets.
async fn ensure_credential(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    uid: &str,
) -> Result<(), Error> {
    if ctx.memory.has_credential(uid) {
        return Ok(());
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let name = job::credential_secret(uid, &ctx.jobs.key_id);
    let body: Secret = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/managed-by": "agentrun",
                job::RUN_LABEL: run.name_any(),
            },
            "ownerReferences": run.controller_owner_ref(&()).map(|o| vec![o]),
        },
        "type": "Opaque",
        "stringData": { job::TOKEN_KEY: ctx.tokens.mint(uid) },
    }))?;
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    match secrets.create(&params, &body).await {
        Ok(_) => {}
        // Created by an earlier step of this run (its name is the run's uid).
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(source) => {
            return Err(Error::Write {
                what: "step credential Secret",
                source,
            });
        }
    }
    ctx.memory.set_credential(uid, true);
    Ok(())
}

/// The log head the controller recorded in `status.log` (never moves backwards).
fn anchored_head(run: &AgentRun) -> Head {
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

/// Condition type that is False once the run's log failed verification.
pub const LOG_INTACT: &str = "LogIntact";

/// Stops a run whose log does not verify: Failed with the reason in a
/// condition, `status.error`, a Warning Event and a metric. `status.log`
/// keeps the last verified head; the step Job (if any) is deleted.
async fn stop_tampered(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    tampered: StoreError,
) -> Result<Action, Error> {
    let already = run.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == LOG_INTACT && c.status == "False")
    });
    if already {
        // Its status says so: nothing more to remember about it.
        ctx.memory.forget(&run.uid().unwrap_or_default());
        return Ok(Action::await_change());
    }
    tracing::error!(run = %run.name_any(), namespace = %ns, error = %tampered, "step log failed verification; stopping the run");
    // A reconcile that starts before this one's status write is seen finds
    // the same break: one run, one count.
    let uid = run.uid().unwrap_or_default();
    if ctx.memory.first_tamper(&uid) {
        ctx.metrics.log_integrity_failures.inc();
    }
    let now = Timestamp::now();
    let message = format!("the step log failed verification: {tampered}");
    let generation = run.metadata.generation;
    let mut status = run.status.clone().unwrap_or_default();
    let mut conditions = vec![LOG_INTACT];
    // A run that already ended keeps its outcome; the condition says its evidence broke.
    if !status.phase.is_some_and(|p| p.is_terminal()) {
        status.phase = Some(crate::api::Phase::Failed);
        status.error = Some(message.clone());
        status.waiting_on = None;
        status.approval = None;
        status.finished_at.get_or_insert(Time(now));
        conditions.push(status::SUCCEEDED);
    }
    for type_ in conditions {
        crate::controller::conditions::set_condition(
            &mut status.conditions,
            crate::controller::conditions::condition(
                type_,
                false,
                "LogTampered",
                &message,
                generation,
                now,
            ),
        );
    }
    if let Some(name) = status.step.as_ref().and_then(|s| s.job.clone()) {
        delete_step_job(ctx, ns, &name).await?;
    }
    // Its broken log is let go; that it was counted is kept until its
    // status says so (then it is forgotten whole).
    drop((ctx.memory.take(&uid), ctx.memory.take_asleep(&uid)));
    let notice = notice(true, "LogTampered", truncate(&message, 900));
    write_status(run, ctx, &status, vec![notice]).await?;
    Ok(Action::await_change())
}

/// The run's root span, once its final phase is written (a controller that
/// dies before the write reports it after its restart instead).
fn report_run_span(run: &AgentRun, status: &crate::api::AgentRunStatus) {
    let time = |t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
        t.map(|t| std::time::SystemTime::from(t.0))
    };
    let finished = time(status.finished_at.as_ref()).unwrap_or_else(std::time::SystemTime::now);
    let started = time(status.started_at.as_ref())
        .or(time(run.metadata.creation_timestamp.as_ref()))
        .unwrap_or(finished);
    let usage = status.usage.clone().unwrap_or_default();
    let name = run.name_any();
    let agent = run
        .spec
        .agent_ref
        .as_ref()
        .map_or(name.as_str(), |a| a.name.as_str());
    let phase = status.phase.map(|p| format!("{p:?}")).unwrap_or_default();
    crate::telemetry::trace::report_finished_run(&crate::telemetry::trace::FinishedRun {
        uid: &run.uid().unwrap_or_default(),
        name: &name,
        namespace: &run.namespace().unwrap_or_default(),
        agent,
        model: status.pinned.as_ref().map_or("", |p| p.model.as_str()),
        phase: &phase,
        failed: status.phase != Some(crate::api::Phase::Succeeded),
        started,
        finished,
        input_tokens: usage.input_tokens,
        output_tokens: usage.output_tokens,
        steps: usage.steps,
    });
}

async fn write_status(
    run: &AgentRun,
    ctx: &Context,
    status: &crate::api::AgentRunStatus,
    notices: Vec<crate::controller::context::Notice>,
) -> Result<Option<String>, Error> {
    let ns = run.namespace().unwrap_or_default();
    let mut version = run.resource_version();
    if run.status.as_ref() != Some(status) {
        let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), &ns);
        let body = json!({
            "apiVersion": AgentRun::api_version(&()),
            "kind": AgentRun::kind(&()),
            "status": serde_json::to_value(status)?,
        });
        let written = runs
            .patch_status(
                &run.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(Error::Status)?;
        version = written.resource_version();
    }
    let reference = run.object_ref(&());
    let recorder = ctx.recorder();
    for n in notices {
        let event = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.into(),
            // Cut where it lands: the API server refuses a longer note.
            note: Some(crate::text::cut(
                &n.message,
                crate::text::EVENT_NOTE_MAX_BYTES,
            )),
            action: "Reconcile".into(),
            secondary: None,
        };
        // An event is for people; failing to publish one must not stall the run.
        if let Err(e) = recorder.publish(&event, &reference).await {
            tracing::warn!(run = %run.name_any(), namespace = %ns, error = %e, "publishing event failed");
        }
    }
    Ok(version)
}

fn phase_reason(phase: crate::api::Phase) -> &'static str {
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

fn truncate(s: &str, max: usize) -> String {
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
