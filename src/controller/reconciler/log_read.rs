//! Reading a run's log for a reconcile: replayed from memory and the
//! records past its head, resumed at a checkpoint, verified whole by pages
//! within the read budget, and a run whose log does not verify stopped.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;

use super::decide::{
    anchored_head, asleep, lets_go_later, signs_with_another_key, truncate, waits_as_left,
};
use super::job_io::{delete_step_job, read_job};
use super::{checkpoint, phase, status, write_status};
use crate::api::AgentRun;
use crate::controller::context::{Context, notice};
use crate::controller::error::Error;
use crate::controller::memory::{Asleep, Replayed};
use crate::replay::Entry;
use crate::store::{Head, Pages, StoreError, check_anchor_after};

/// A waiting run with nothing to decide: how long it may sleep (to its
/// Approval's expiry or its deadline), its log left unread. It has nothing
/// to decide when its token ([`Asleep`]) finds the run, its Approval's
/// decisions and its head unchanged, or, seen for the first time by this
/// process, when its status says it waits on a pending Approval with the
/// head where the status anchors it. `None`: read the log the ordinary way
/// (whole, and verified, for a waiting run).
pub(super) async fn still_asleep(
    run: &AgentRun,
    ctx: &Context,
    uid: &str,
) -> Result<Option<Duration>, Error> {
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
            let head = ctx.log.store.head(uid).await.map_err(Error::Store)?;
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

/// The run's log replayed: `cached` extended by the records past its head
/// (none read when head events and the controller's own appends say it is
/// current). The inner error is a log that failed verification (the run
/// must stop); the outer one a store that could not be read (retried).
pub(super) async fn replay(
    ctx: &Context,
    run: &AgentRun,
    cached: Option<Replayed>,
) -> Result<Result<Replayed, StoreError>, Error> {
    let uid = crate::api::RunUid::of(run);
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
    let mut pages = Pages::after(ctx.log.store.as_ref(), &ctx.log.reads, &uid, replayed.head);
    loop {
        let (records, _ticket) = match checked_page(ctx, &uid, &mut pages, &anchor, &rules).await? {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(tampered) => return Ok(Err(tampered)),
        };
        ctx.memory
            .counted(&uid, |c| ctx.metrics.observe_log(c, &records));
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
pub(super) fn check_anchor_within(
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
pub(super) async fn resume(
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
    if !checkpoint::trusted(&ctx.log.verifier, uid, cp, &anchored_head(run)) {
        tracing::warn!(run = %run.name_any(), "status.log.checkpoint is not this controller's: reading the log whole");
        return Ok(Ok(None));
    }
    match checkpoint::resume(
        ctx.log.store.as_ref(),
        &ctx.log.verifier,
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
pub(super) async fn verify_whole(
    ctx: &Context,
    run: &AgentRun,
    uid: &str,
) -> Result<Result<(), StoreError>, Error> {
    let (anchor, rules) = (anchored_head(run), status::signature_rules(run));
    let mut pages = Pages::after(ctx.log.store.as_ref(), &ctx.log.reads, uid, Head::EMPTY);
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
pub(super) async fn checked_page(
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
        .and_then(|()| ctx.log.verifier.check(uid, &records, rules));
    Ok(checked.map(|()| Some((records, ticket))))
}

/// Keeps the run's replayed log for its next reconcile, or forgets it: a
/// finished run's for good, a run waiting for a human's until it is woken
/// (it is read once then: thousands of waiting runs hold no logs in memory,
/// only their tokens).
pub(super) fn keep_replayed(
    ctx: &Context,
    run: &AgentRun,
    uid: &str,
    replayed: Replayed,
    finished: bool,
    asleep: Option<Asleep>,
) {
    if finished {
        ctx.memory.finished(uid);
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

/// Condition type that is False once the run's log failed verification.
pub const LOG_INTACT: &str = "LogIntact";

/// Stops a run whose log does not verify: Failed with the reason in a
/// condition, `status.error`, a Warning Event and a metric. `status.log`
/// keeps the last verified head; the step Job (if any) is deleted.
pub(super) async fn stop_tampered(
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
        ctx.memory.finished(&crate::api::RunUid::of(run));
        return Ok(Action::await_change());
    }
    tracing::error!(run = %run.name_any(), namespace = %ns, error = %tampered, "step log failed verification; stopping the run");
    // A reconcile that starts before this one's status write is seen finds
    // the same break: one run, one count.
    let uid = crate::api::RunUid::of(run);
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
