//! The start of a fork (DESIGN.md §11): instead of `RunStarted`, the
//! parent's verified records `0..=seq`, then `Forked` (and the
//! `VersionChanged` to `spec.forkOf.agent`). After it the fork goes on like
//! a resumed run. A refusal ends the fork before anything is copied, with a
//! `Forked=False` condition naming the reason.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::Api;
use kube::{Resource, ResourceExt};

use super::Acting;
use super::decide::{anchored_head, snapshot};
use super::log_read::checked_page;
use super::status::signature_rules;
use crate::api::{
    AgentRun, AgentTemplate, ForkOf, REQUESTER_ANNOTATION, REQUESTER_GROUPS_ANNOTATION,
};
use crate::controller::context::{Context, notice};
use crate::controller::error::Error;
use crate::controller::servers::log_api::authorize::{Answer, Authorizer, Question};
use crate::controller::servers::log_api::front_proxy::User;
use crate::controller::watchers::tool_discovery::Answer as Discovered;
use crate::fork::{ForkError, ForkPoint, copy_prefix};
use crate::runlog::records::{Outcome, RunFinished, VersionChanged};
use crate::store::{Head, Pages, Record};

/// Condition type: whether the fork's prefix was copied.
pub const FORKED: &str = "Forked";

/// Copies the parent's prefix into the fork's empty log, or ends the fork
/// saying why it may not begin.
pub(super) async fn start_fork(
    run: &AgentRun,
    ctx: &Context,
    fork_of: &ForkOf,
    template: &AgentTemplate,
    agent_generation: Option<i64>,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let ns = run.namespace().unwrap_or_default();
    let (parent, requester) = match allowed(run, ctx, &ns, fork_of).await? {
        Ok(found) => found,
        Err((reason, message)) => return Ok(refuse(run, acting, reason, message)),
    };
    let parent_uid = crate::api::RunUid::of(&parent).to_string();
    let records = match read_prefix(ctx, &parent, &parent_uid, fork_of.seq).await? {
        Ok(records) => records,
        Err(tampered) => {
            let message = format!(
                "spec.forkOf.run: the parent {:?}'s log does not verify, so nothing of it is copied: {tampered}",
                fork_of.run
            );
            return Ok(refuse(run, acting, "ParentTampered", message));
        }
    };
    let agent = match &fork_of.agent {
        None => None,
        Some(name) => {
            // The versions in force at the fork point (the last record copied).
            let from = versions_at(&records);
            match changed_to(run, ctx, template, agent_generation, name, from) {
                Ok(Some(changed)) => Some(changed),
                Ok(None) => return Ok(super::decide::DISCOVERY_RECHECK),
                Err(message) => {
                    return Ok(refuse(run, acting, "InvalidAgent", message.to_string()));
                }
            }
        }
    };
    let point = ForkPoint {
        parent_uid,
        parent_name: fork_of.run.clone(),
        seq: fork_of.seq,
        requester: Some(requester),
        agent,
        budget: fork_of.budget,
        replace: fork_of.replace.clone(),
    };
    let uid = crate::api::RunUid::of(run);
    let copied = copy_prefix(
        ctx.log.store.as_ref(),
        &ctx.log.signer,
        &uid,
        &records,
        &point,
        &ctx.log.identity,
    )
    .await;
    ctx.memory.mark_changed(&uid);
    match copied {
        Ok(_) => {
            let message = format!(
                "records 0..={} of {:?} copied; the fork goes on from there",
                fork_of.seq, fork_of.run
            );
            acting.fork = Some(condition(run, true, "Copied", &message));
            acting.notices.push(notice(false, "Forked", message));
            Ok(Duration::ZERO)
        }
        Err(ForkError::Store(e)) => Err(Error::Store(e)),
        Err(e @ ForkError::ParentUnverified(_)) => {
            Ok(refuse(run, acting, "ParentTampered", e.to_string()))
        }
        Err(e @ ForkError::Replace(_)) => {
            Ok(refuse(run, acting, "InvalidReplacement", e.to_string()))
        }
        Err(e) => Ok(refuse(run, acting, "InvalidForkPoint", e.to_string())),
    }
}

/// The parent, and the fork's requester, when the requester may read the
/// parent's log; otherwise the refusal's reason and message.
async fn allowed(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    fork_of: &ForkOf,
) -> Result<Result<(AgentRun, String), (&'static str, String)>, Error> {
    let Some(requester) = run.annotations().get(REQUESTER_ANNOTATION).cloned() else {
        let message = format!(
            "metadata.annotations[{REQUESTER_ANNOTATION:?}] is not set: who may read the parent's log cannot be checked (the admission webhook stamps it)"
        );
        return Ok(Err(("NoRequester", message)));
    };
    // The groups stamped at creation (the policies check them against the
    // creator's own, as the name): a grant through a group counts. A run
    // created before the groups were stamped is asked about by name only.
    let groups = run
        .annotations()
        .get(REQUESTER_GROUPS_ANNOTATION)
        .map(|g| crate::api::parse_requester_groups(g))
        .unwrap_or_default();
    let user = User {
        name: requester.clone(),
        uid: None,
        groups,
        extra: Default::default(),
    };
    let question = Question {
        verb: "get",
        namespace: ns.to_string(),
        name: Some(fork_of.run.clone()),
    };
    let authorizer = Authorizer::new(ctx.client.clone(), Duration::ZERO);
    match authorizer.check(&user, &question).await {
        Ok(Answer::Allowed) => {}
        Ok(Answer::Denied(why)) => {
            let message =
                format!("spec.forkOf.run: {requester} may not read the parent's log: {why}");
            return Ok(Err(("Forbidden", message)));
        }
        Err(e) => return Err(Error::Review(e)),
    }
    let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), ns);
    let parent = runs
        .get_opt(&fork_of.run)
        .await
        .map_err(|source| Error::Read {
            what: "the fork's parent run",
            source,
        })?;
    Ok(match parent {
        Some(parent) if parent.meta().uid == run.meta().uid => Err((
            "InvalidForkPoint",
            "spec.forkOf.run: a run cannot fork itself".to_string(),
        )),
        Some(parent) => Ok((parent, requester)),
        None => Err((
            "ParentNotFound",
            format!(
                "spec.forkOf.run: no AgentRun {:?} in namespace {ns:?}",
                fork_of.run
            ),
        )),
    })
}

/// The parent's records `0..=seq`, its whole log verified page by page
/// (chain, anchored head, signatures under its rules) and only the prefix
/// kept. The inner error: the parent's log does not verify.
async fn read_prefix(
    ctx: &Context,
    parent: &AgentRun,
    parent_uid: &str,
    seq: u64,
) -> Result<Result<Vec<Record>, crate::store::StoreError>, Error> {
    let (anchor, rules) = (anchored_head(parent), signature_rules(parent));
    let mut pages = Pages::after(
        ctx.log.store.as_ref(),
        &ctx.log.reads,
        parent_uid,
        Head::EMPTY,
    );
    let mut kept = Vec::new();
    loop {
        match checked_page(ctx, parent_uid, &mut pages, &anchor, &rules).await? {
            Ok(Some((records, _ticket))) => {
                let room = crate::fork::through(seq).saturating_sub(kept.len());
                kept.extend(records.into_iter().take(room));
            }
            Ok(None) => break,
            Err(tampered) => return Ok(Err(tampered)),
        }
    }
    Ok(crate::store::check_anchor_after(parent_uid, &pages.head(), &[], &anchor).map(|()| kept))
}

/// The `VersionChanged` to `spec.forkOf.agent` (resolved as the run's
/// template); `None` while its MCP tools are being discovered.
fn changed_to(
    run: &AgentRun,
    ctx: &Context,
    template: &AgentTemplate,
    agent_generation: Option<i64>,
    name: &str,
    from: crate::runlog::records::Versions,
) -> Result<Option<VersionChanged>, crate::refusal::Refusal> {
    let field = format!("spec.forkOf.agent: Agent {name}: spec.tools");
    let mcp = match ctx.discovery.catalog(run, &template.tools, &field) {
        Discovered::Pending | Discovered::Failed { .. } => return Ok(None),
        Discovered::Ready(mcp) => mcp,
    };
    let started = mcp
        .and_then(|mcp| snapshot(run, template, agent_generation, mcp))
        .map_err(|e| crate::refusal::Refusal::from(format!("spec.forkOf.agent: {e}")))?;
    Ok(Some(VersionChanged {
        agent: started.agent,
        tools: started.tools,
        mcp: started.mcp,
        from,
        to: started.versions,
        container: started.container,
    }))
}

/// The agent's versions in force at the end of `records` (the fork point).
fn versions_at(records: &[Record]) -> crate::runlog::records::Versions {
    let entries = records
        .iter()
        .filter_map(|r| crate::replay::Entry::decode(r.seq, r.kind.as_str(), &r.payload).ok())
        .collect();
    crate::replay::RunState::replay(entries)
        .snapshot
        .map(|s| s.versions)
        .unwrap_or_default()
}

/// Ends the fork before anything is copied.
fn refuse(run: &AgentRun, acting: &mut Acting, reason: &'static str, message: String) -> Duration {
    acting.fork = Some(condition(run, false, reason, &message));
    acting.notices.push(notice(true, reason, message.clone()));
    acting.concluded = Some(RunFinished {
        outcome: Outcome::Failed,
        result: None,
        error: Some(message),
    });
    Duration::MAX
}

fn condition(run: &AgentRun, ok: bool, reason: &str, message: &str) -> Condition {
    crate::controller::conditions::condition(
        FORKED,
        ok,
        reason,
        message,
        run.metadata.generation,
        jiff::Timestamp::now(),
    )
}
