//! Acting on step Jobs and what they hold: creating a run's Job after
//! fencing the one before it, reading and deleting Jobs, the pods' exit
//! reports, the run's store lease, and its step-log credential Secret.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::decide::{
    controlled_by, failed_jobs_before, held_by_a_pod_of, idle_requeue, job_ended_at,
    termination_message,
};
use super::phase::{JobState, JobView, LeaseView};
use super::{Acting, cached_or_get, job, phase};
use crate::api::{AgentRun, AgentTemplate};
use crate::controller::FIELD_MANAGER;
use crate::controller::context::{Context, notice};
use crate::controller::error::Error;
use crate::controller::memory::Replayed;
use crate::failpoint;

/// A run waiting for a person holds no pod, not even an ended one: once
/// the Job that asked is done (it ended well, or its worker gave the run
/// back and is exiting, or it is gone), the run forgets it and Kubernetes
/// removes it with its pod as soon as it has ended, not 10 minutes later.
/// Deleting many waiting runs then leaves the node no pods to clean up at
/// once (a live run's next pod waited 30 s behind a thousand). A failed Job
/// is kept: its logs say why, and the next attempt fences its worker.
pub(super) async fn let_go_of_job(
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

/// Sets the Job's time to live after it ends to zero: the TTL controller
/// deletes it, and its pod, when it has ended (at once if it has).
pub(super) async fn remove_when_ended(ctx: &Context, ns: &str, name: &str) -> Result<(), Error> {
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

/// Creates the Job of step `seq` (and, once, the run's step credential).
#[allow(clippy::too_many_arguments)]
pub(super) async fn create_job(
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
    let uid = crate::api::RunUid::of(run);
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
pub(super) async fn fence_previous(
    ctx: &Context,
    uid: &str,
    previous: Option<&JobView>,
    next: &str,
) -> Result<(), Error> {
    if !previous.is_some_and(|j| matches!(j.state, JobState::Failed { .. } | JobState::Missing)) {
        return Ok(());
    }
    let lease = ctx.log.store.lease(uid).await.map_err(Error::Store)?;
    match held_by_a_pod_of(lease.as_ref().map(|l| l.holder.as_str()), next) {
        true => Ok(()),
        false => fence_worker(ctx, uid).await,
    }
}

/// Creates the step Job; false when it existed already. Deterministic
/// names make a repeated create harmless (a reconcile that saw the run
/// before its last status write): it is said once only.
pub(super) async fn create_step_job(ctx: &Context, ns: &str, job: &Job) -> Result<bool, Error> {
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
pub(super) async fn delete_job(
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

pub(super) async fn delete_step_job(ctx: &Context, ns: &str, name: &str) -> Result<(), Error> {
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

pub(super) async fn read_job(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
) -> Result<Option<JobView>, Error> {
    let Some(step) = run.status.as_ref().and_then(|s| s.step.clone()) else {
        return Ok(None);
    };
    let Some(name) = step.job.clone() else {
        return Ok(None);
    };
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let job = cached_or_get(ctx.caches.jobs.as_ref(), &jobs, ns, &name)
        .await
        .map_err(|source| Error::Read {
            what: "step Job",
            source,
        })?;
    let uid = crate::api::RunUid::of(run);
    let job = job.filter(|j| controlled_by(j, &uid, &name));
    ctx.memory
        .counted(&uid, |c| ctx.metrics.observe_job(c, job.as_ref()));
    let ended_at = job.as_ref().and_then(job_ended_at);
    let running = job
        .as_ref()
        .and_then(|j| j.status.as_ref())
        .and_then(|s| s.ready)
        .unwrap_or(0)
        > 0;
    let (state, agent) = match job {
        None => (JobState::Missing, None),
        // A Job being deleted is gone as far as the run is concerned.
        Some(j) if j.metadata.deletion_timestamp.is_some() => (JobState::Missing, None),
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
        agent,
    }))
}

/// The `agent` container of `pods`, as the kubelet reported it: exited 0
/// if any pod's agent did, else running if any still runs (a built-in
/// agent's pods have none).
fn agent_state(pods: &[k8s_openapi::api::core::v1::Pod]) -> Option<super::phase::AgentState> {
    use super::phase::AgentState;
    let states = pods.iter().filter_map(|p| {
        let statuses = p.status.as_ref()?.container_statuses.as_ref()?;
        let agent = statuses.iter().find(|c| c.name == "agent")?;
        let state = agent.state.as_ref()?;
        Some(match &state.terminated {
            Some(t) => AgentState::Exited(t.exit_code),
            None => AgentState::Running,
        })
    });
    states.min_by_key(|s| match s {
        AgentState::Exited(0) => 0,
        AgentState::Running => 1,
        AgentState::Exited(_) => 2,
    })
}

/// The state of a Job that exists and is not being deleted, and for a
/// failed one its container agent's end (read from its pods: the Job in
/// the watch cache holds no pod template).
pub(super) async fn job_state(
    ctx: &Context,
    ns: &str,
    name: &str,
    job: Job,
) -> Result<(JobState, Option<super::phase::AgentState>), Error> {
    let conds = job.status.and_then(|s| s.conditions).unwrap_or_default();
    let is = |t: &str| conds.iter().find(|c| c.type_ == t && c.status == "True");
    if is("Complete").is_some() {
        return Ok((JobState::Succeeded, None));
    }
    // FailureTarget: the Job controller decided the Job fails (its deadline
    // passed) and is terminating its pods; Failed follows once they are gone.
    let Some(c) = is("Failed").or_else(|| is("FailureTarget")) else {
        return Ok((JobState::Active, None));
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
    let state = JobState::Failed {
        disrupted: pods.lost,
        reason,
    };
    Ok((state, pods.agent))
}

/// What the pods of a failed Job tell.
#[derive(Default)]
pub(super) struct FailedPods {
    /// Lost rather than crashed: none is left (deleted, or collected with a
    /// lost node), or each carries a deletion timestamp or a
    /// `DisruptionTarget` condition. A pod that failed in place (an exit
    /// code, OOM-killed in its own limit) crashed.
    lost: bool,
    /// The step container's termination message (the runner's last error,
    /// or its log's last lines), escaped, its end kept.
    message: Option<String>,
    /// A container agent's own container.
    agent: Option<super::phase::AgentState>,
}

/// The pods of step Job `job`.
async fn job_pods(
    ctx: &Context,
    ns: &str,
    job: &str,
) -> Result<kube::core::ObjectList<k8s_openapi::api::core::v1::Pod>, Error> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(ctx.client.clone(), ns);
    pods.list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await
        .map_err(|source| Error::Read {
            what: "step pods",
            source,
        })
}

pub(super) async fn failed_pods(ctx: &Context, ns: &str, job: &str) -> Result<FailedPods, Error> {
    let list = job_pods(ctx, ns, job).await?;
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
    let agent = agent_state(&list.items);
    Ok(FailedPods {
        lost,
        message,
        agent,
    })
}

/// Is a worker holding the run's lease, and since when has it been free?
/// Read only: a worker whose heartbeat comes late under load keeps its
/// lease (renewing revives a lapsed one nobody took), so only a worker
/// judged lost is fenced ([`fence_worker`]).
pub(super) async fn probe_lease(ctx: &Context, uid: &str) -> Result<LeaseView, Error> {
    let lease = ctx.log.store.lease(uid).await.map_err(Error::Store)?;
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
pub(super) async fn fence_worker(ctx: &Context, uid: &str) -> Result<(), Error> {
    let lease = ctx
        .log
        .store
        .take_over(uid, &ctx.log.identity, Duration::from_secs(2))
        .await
        .map_err(Error::Store)?;
    let _ = ctx.log.store.release(&lease).await;
    Ok(())
}

/// The run's step-log credential: a Secret owned by the run (collected with
/// it) holding the gateway token bound to the run's uid, minted with the
/// current key. Created once per key, never patched, so the controller
/// needs no write access to other Secrets.
pub(super) async fn ensure_credential(
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
        "stringData": { job::TOKEN_KEY: ctx.log.tokens.mint(uid) },
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
