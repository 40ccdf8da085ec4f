//! Reconcile one AgentRun: read (run, agent, log, Job, lease) → decide (pure,
//! in `decide` and `phase`) → act → write status.

pub mod checkpoint;
mod decide;
pub mod fork_start;
pub mod job;
mod job_io;
mod log_read;
pub mod phase;
pub mod plan;
mod pod;
pub mod status;
#[cfg(test)]
mod tests;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::api::{Agent, AgentRun, AgentTemplate};
use crate::controller::FIELD_MANAGER;
use crate::controller::approvals::Waiting;
use crate::controller::context::{Context, notice};
use crate::controller::error::Error;
use crate::controller::log_writer::append;
use crate::controller::memory::Replayed;
use crate::controller::metrics::ReasonLabel;
use crate::controller::watchers::tool_discovery::Answer;
use crate::replay::{Entry, RunState};
use crate::runlog::records::{RunFinished, VersionChanged};
use crate::store::StoreError;
use decide::{
    DISCOVERY_RECHECK, POLICY_RECHECK, PROGRESS_EVERY, ToWrite, asleep, error_backoff,
    idle_requeue, lets_go_later, next_action, next_checkpoint, only_progress, reads_again,
    snapshot, to_write, truncate,
};
use job_io::{create_job, delete_job, fence_worker, let_go_of_job, probe_lease, read_job};
use log_read::{keep_replayed, replay, still_asleep, stop_tampered, verify_whole};
use phase::{Act, JobState, JobView, LeaseView, Observed};
use plan::{AgentLookup, Plan, plan};

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
    let run = match ctx.caches.runs.as_ref() {
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
            let uid = crate::api::RunUid::of(&run);
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
    let uid = crate::api::RunUid::of(run);

    // Read.
    let Read {
        mut plan,
        template,
        agent_generation,
        replayed,
        job,
        lease,
    } = match read(run, ctx, &ns, &uid).await? {
        ControlFlow::Continue(read) => read,
        ControlFlow::Break(action) => return Ok(action),
    };

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
    let acted = async {
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
        act_on(run, ctx, act, &observed, &mut acting).await
    };
    let requeue = match acted.await {
        Ok(requeue) => requeue,
        Err(e) => return Err(keep_read(ctx, &uid, replayed, e)),
    };

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

/// What a reconcile read for its decision.
struct Read {
    /// The status and Events the run and its agent alone decide.
    plan: Plan,
    template: AgentTemplate,
    agent_generation: Option<i64>,
    replayed: Replayed,
    job: Option<JobView>,
    lease: Option<LeaseView>,
}

/// Reads the run's agent, log, step Job and lease; or ends the reconcile
/// early (`Break`): a run without its agent (its status says so), a waiting
/// run with nothing to decide, a tampered log.
async fn read(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    uid: &str,
) -> Result<ControlFlow<Action, Read>, Error> {
    // The agent.
    let resolved = keep_pinned(run, resolve_agent(run, ctx, ns).await?);
    let plan = plan(run, &resolved.lookup, Timestamp::now());
    let template = match resolved.template {
        Some(template) => Some(template),
        None if resolved.lookup == AgentLookup::Pinned => None,
        None => {
            write_status(run, ctx, &plan.status, plan.notices).await?;
            return Ok(ControlFlow::Break(Action::requeue(Duration::from_secs(
                300,
            ))));
        }
    };
    let agent_generation = resolved.lookup.generation();

    // A waiting run with nothing to decide is not read (see `still_asleep`).
    let cached = ctx.memory.take(uid);
    if cached.is_none()
        && plan.notices.is_empty()
        && let Some(wait) = still_asleep(run, ctx, uid).await?
    {
        return Ok(ControlFlow::Break(Action::requeue(wait)));
    }

    // The log (the run's truth, verified against the anchored head; only
    // records past the replayed head are read), the step Job and, if
    // needed, the lease.
    let replayed = match replay(ctx, run, cached).await? {
        Ok(replayed) => replayed,
        Err(tampered) => {
            return stop_tampered(run, ctx, ns, tampered)
                .await
                .map(ControlFlow::Break);
        }
    };
    tracing::Span::current().record("step", replayed.head.len);
    // A fork keeping its pinned agent runs on what its log pins; before
    // its copy nothing reads the template (the fork's start needs none
    // without `forkOf.agent`).
    let template = template.unwrap_or_else(|| {
        replayed
            .state
            .snapshot
            .as_ref()
            .map(|s| s.agent.clone())
            .unwrap_or_default()
    });
    let job_and_lease = async {
        let job = read_job(run, ctx, ns).await?;
        let lease = read_lease(ctx, uid, job.as_ref(), &replayed).await?;
        Ok((job, lease))
    };
    let (job, lease) = match job_and_lease.await {
        Ok(read) => read,
        Err(e) => return Err(keep_read(ctx, uid, replayed, e)),
    };
    Ok(ControlFlow::Continue(Read {
        plan,
        template,
        agent_generation,
        replayed,
        job,
        lease,
    }))
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
        Act::StartRun => match (&run.spec.fork_of, &run.spec.test_of) {
            (Some(fork_of), _) => {
                let start = fork_start::Start::Fork(fork_of);
                fork_start::start_fork(run, ctx, start, template, agent_generation, acting).await?
            }
            (None, Some(test_of)) => {
                let start = fork_start::Start::Test(test_of);
                fork_start::start_fork(run, ctx, start, template, agent_generation, acting).await?
            }
            (None, None) => {
                start_run(run, ctx, replayed, template, agent_generation, acting).await?
            }
        },
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
            ctx.log
                .store
                .request_yield(uid)
                .await
                .map_err(Error::Store)?;
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

/// A failed reconcile keeps the log it read: a log only grows, so what was
/// read stays a verified prefix of it, and the retry reads only past it
/// (dropping it would make the retry resume from the checkpoint and verify
/// the whole log again). Returns `error`.
fn keep_read(ctx: &Context, uid: &str, replayed: Replayed, error: Error) -> Error {
    ctx.memory.keep(uid, replayed);
    error
}

/// Writes the status from the log as it is after acting, keeps the
/// replayed log for the next reconcile and says when that is.
async fn record(
    run: &AgentRun,
    ctx: &Context,
    planned: crate::api::AgentRunStatus,
    replayed: Replayed,
    job: Option<&JobView>,
    acting: Acting,
    requeue: Duration,
) -> Result<Action, Error> {
    let uid = crate::api::RunUid::of(run);
    let reread = reads_again(&acting, requeue);
    let replayed = match settle_log(run, ctx, &uid, replayed, reread, requeue).await? {
        Ok(replayed) => replayed,
        Err(tampered) => {
            let ns = run.namespace().unwrap_or_default();
            return stop_tampered(run, ctx, &ns, tampered).await;
        }
    };
    let (store, key_id) = (&ctx.log.store_name, ctx.log.signer.key_id());
    let ToWrite {
        mut status,
        notices,
        ends_now,
    } = to_write(run, planned, &replayed, job, &acting, store, key_id);
    if let Some(log) = status.log.as_mut() {
        log.checkpoint = next_checkpoint(run, ctx, &uid, &replayed);
    }
    let finished = status.phase.is_some_and(|p| p.is_terminal());
    let written = write_progress(run, ctx, &uid, &status, notices, acting.idle, requeue).await;
    let (requeue, version) = match written {
        Ok(written) => written,
        Err(e) => return Err(keep_read(ctx, &uid, replayed, e)),
    };
    if ends_now.is_some() && ctx.memory.first_end(&uid) {
        report_run_span(run, &status);
    }
    // A waiting run whose step Job is not let go yet (its worker still
    // holds the run) keeps its replayed log: the Job's end wakes it to let
    // go, and that reconcile must not read the whole log again.
    let holds_job = status.step.as_ref().is_some_and(|s| s.job.is_some()) && lets_go_later(job);
    let asleep = acting
        .awaiting
        .as_ref()
        .filter(|_| !holds_job)
        .map(|w| asleep(run, replayed.head, replayed.generation(), w, version));
    keep_replayed(ctx, run, &uid, replayed, finished, asleep);
    Ok(next_action(run, requeue, finished, acting.now))
}

/// The log as it is after acting: read again if `reread` (see
/// [`reads_again`]), verified whole once a resumed run does not go straight
/// on (`Err`: tampered), compacted for keeping.
async fn settle_log(
    run: &AgentRun,
    ctx: &Context,
    uid: &str,
    replayed: Replayed,
    reread: bool,
    requeue: Duration,
) -> Result<Result<Replayed, StoreError>, Error> {
    let mut replayed = match reread {
        true => match replay(ctx, run, Some(replayed)).await? {
            Ok(replayed) => replayed,
            Err(tampered) => return Ok(Err(tampered)),
        },
        false => replayed,
    };
    // Not while the run has more to do at once (its next Job follows an
    // appended decision): the reconcile that hands it over to a Job, a
    // human or its end does it.
    if replayed.resumed && !requeue.is_zero() {
        if let Err(tampered) = verify_whole(ctx, run, uid).await? {
            return Ok(Err(tampered));
        }
        replayed.resumed = false;
    }
    if !replayed.resumed {
        ctx.memory.set_verified(uid, replayed.head);
    }
    replayed.compact();
    Ok(Ok(replayed))
}

/// Writes the status and publishes its Events; returns when to look again
/// and the run's version. While a step runs, its log grows record by record:
/// that progress reaches the status at most every PROGRESS_EVERY (a write
/// per record would be most of the controller's API traffic at scale).
async fn write_progress(
    run: &AgentRun,
    ctx: &Context,
    uid: &str,
    status: &crate::api::AgentRunStatus,
    notices: Vec<crate::controller::context::Notice>,
    idle: bool,
    requeue: Duration,
) -> Result<(Duration, Option<String>), Error> {
    if idle
        && notices.is_empty()
        && only_progress(run, status)
        && let Some(wait) = progress_due(ctx, uid)
    {
        return Ok((requeue.min(wait), run.resource_version()));
    }
    Ok((requeue, write_status(run, ctx, status, notices).await?))
}

/// `None` when the run's progress may be written now (and notes it was);
/// otherwise how long until it may.
fn progress_due(ctx: &Context, uid: &str) -> Option<Duration> {
    ctx.memory.progress_due(uid, PROGRESS_EVERY)
}

/// What acting on a decision adds to the status.
pub(super) struct Acting {
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
    /// A fork's `Forked` condition, once its start copied or refused.
    fork: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
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
            fork: None,
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
    let (template, refused, awaited) = platform_judges(ctx, ns, |platform| {
        let governed = platform.govern(&template);
        let (refused, awaited) = platform.judge(run, &governed);
        (governed, refused, awaited)
    })
    .await?;
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

/// What `judge` says under the platform's policies of now: from the watch
/// cache, or from the API server when the cache's answer is a refusal or a
/// wait (the cache may not have seen a policy created with the run yet).
pub(super) async fn platform_judges<T>(
    ctx: &Context,
    ns: &str,
    judge: impl Fn(&crate::controller::watchers::platform::Platform) -> Judged<T>,
) -> Result<Judged<T>, Error> {
    use crate::controller::watchers::platform;
    let cached = platform::read(&ctx.client, ctx.caches.policies.as_ref(), ns).await?;
    let judged = judge(&cached);
    if (judged.1.is_none() && judged.2.is_none()) || ctx.caches.policies.is_none() {
        return Ok(judged);
    }
    Ok(judge(&platform::read(&ctx.client, None, ns).await?))
}

/// What the platform made of an agent: the agent governed, why it is
/// refused, what it waits for.
pub(super) type Judged<T> = (
    T,
    Option<String>,
    Option<crate::controller::watchers::platform::Awaited>,
);

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
    let uid = crate::api::RunUid::of(run);
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
                .push(notice(true, "InvalidAgent", reason.to_string()));
            acting.concluded = Some(RunFinished {
                outcome: crate::runlog::records::Outcome::Failed,
                result: None,
                error: Some(reason.into()),
            });
            Ok(Duration::MAX)
        }
    }
}

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
    let uid = crate::api::RunUid::of(run);
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
                container: now_agent.container,
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
    let uid = crate::api::RunUid::of(&run);
    Action::requeue(error_backoff(ctx.memory.failed(&uid)))
}

/// `name` as the watch's cache has it, else as the API server has it: a
/// cache that lags (an object created a moment ago) never makes an
/// object look gone.
pub(super) async fn cached_or_get<K>(
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

/// A fork without `forkOf.agent` whose parent's Agent (or parent) is gone
/// still goes on: it keeps the agent its log pins (the parent's at the
/// fork point, copied in `RunStarted` and any `VersionChanged`), so no
/// Agent needs to exist. The lookup says so instead of `AgentNotFound`.
fn keep_pinned(run: &AgentRun, resolved: Resolved) -> Resolved {
    let keeps = run.spec.fork_of.as_ref().is_some_and(|f| f.agent.is_none())
        && run.spec.version_policy == crate::api::VersionPolicy::Pinned;
    match resolved {
        Resolved { template: None, .. } if keeps => Resolved {
            lookup: AgentLookup::Pinned,
            template: None,
        },
        resolved => resolved,
    }
}

/// A fork's agent is `spec.forkOf.agent`, else its parent's (followed up
/// through forks of forks); the log's pinned snapshot still decides what runs.
async fn resolve_agent(run: &AgentRun, ctx: &Context, ns: &str) -> Result<Resolved, Error> {
    let Some(source) = agent_source(run, ctx, ns).await? else {
        return Ok(Resolved {
            lookup: AgentLookup::NotFound {
                name: run
                    .spec
                    .fork_of
                    .as_ref()
                    .map(|f| format!("(the agent of the fork's parent run {:?})", f.run))
                    .unwrap_or_default(),
            },
            template: None,
        });
    };
    resolve_spec(&source, ctx, ns).await
}

/// The spec naming the run's agent: its own, or for a fork the named Agent
/// or the parent's (`None`: the parent is gone).
async fn agent_source(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
) -> Result<Option<crate::api::AgentRunSpec>, Error> {
    let mut spec = run.spec.clone();
    let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), ns);
    // Bounded: a chain of forks naming each other in a cycle ends here.
    // A replay test runs the Agent it names.
    if let Some(test_of) = spec.test_of.take() {
        spec.agent_ref = Some(crate::api::LocalRef {
            name: test_of.agent,
        });
        return Ok(Some(spec));
    }
    for _ in 0..16 {
        let Some(fork_of) = spec.fork_of.clone() else {
            return Ok(Some(spec));
        };
        if let Some(agent) = fork_of.agent {
            spec.agent_ref = Some(crate::api::LocalRef { name: agent });
            spec.fork_of = None;
            return Ok(Some(spec));
        }
        let parent = cached_or_get(ctx.caches.runs.as_ref(), &runs, ns, &fork_of.run)
            .await
            .map_err(|source| Error::Read {
                what: "the fork's parent run",
                source,
            })?;
        match parent {
            Some(parent) => spec = parent.spec,
            None => return Ok(None),
        }
    }
    Ok(None)
}

async fn resolve_spec(
    spec: &crate::api::AgentRunSpec,
    ctx: &Context,
    ns: &str,
) -> Result<Resolved, Error> {
    Ok(match (&spec.agent_ref, &spec.agent) {
        (_, Some(inline)) => Resolved {
            lookup: AgentLookup::Inline,
            template: Some(inline.clone()),
        },
        (Some(r), None) => {
            let agents: Api<Agent> = Api::namespaced(ctx.client.clone(), ns);
            match cached_or_get(ctx.caches.agents.as_ref(), &agents, ns, &r.name)
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
        uid: &crate::api::RunUid::of(run),
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

pub(super) async fn write_status(
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
