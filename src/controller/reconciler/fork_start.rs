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
    AgentRun, AgentTemplate, ForkOf, REQUESTER_ANNOTATION, REQUESTER_GROUPS_ANNOTATION, TestOf,
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

/// What begins with a copy of another run's log: a fork, or a replay
/// test (a fork at the parent's `RunStarted` onto the tested Agent, whose
/// calls are answered from the parent's, `crate::sandbox`).
#[derive(Clone, Copy)]
pub(super) enum Start<'a> {
    Fork(&'a ForkOf),
    Test(&'a TestOf),
}

impl Start<'_> {
    fn field(&self) -> &'static str {
        match self {
            Start::Fork(_) => "spec.forkOf",
            Start::Test(_) => "spec.testOf",
        }
    }

    fn parent(&self) -> &str {
        match self {
            Start::Fork(f) => &f.run,
            Start::Test(t) => &t.run,
        }
    }

    /// The parent's last record copied: a test starts from the task alone.
    fn seq(&self) -> u64 {
        match self {
            Start::Fork(f) => f.seq,
            Start::Test(_) => 0,
        }
    }

    /// What the fork's budgets count: a test's are its own from its start.
    fn budget(&self) -> crate::api::ForkBudget {
        match self {
            Start::Fork(f) => f.budget,
            Start::Test(_) => crate::api::ForkBudget::FromFork,
        }
    }

    fn replace(&self) -> Option<crate::api::ForkReplace> {
        match self {
            Start::Fork(f) => f.replace.clone(),
            Start::Test(_) => None,
        }
    }

    /// How many of the parent's records its read keeps: a fork only its
    /// prefix, a test every recorded call.
    fn keep(&self) -> usize {
        match self {
            Start::Fork(f) => crate::fork::through(f.seq),
            Start::Test(_) => usize::MAX,
        }
    }

    fn agent(&self) -> Option<&str> {
        match self {
            Start::Fork(f) => f.agent.as_deref(),
            Start::Test(t) => Some(&t.agent),
        }
    }
}

/// Copies the parent's prefix into the fork's empty log, or ends the fork
/// saying why it may not begin.
pub(super) async fn start_fork(
    run: &AgentRun,
    ctx: &Context,
    start: Start<'_>,
    template: &AgentTemplate,
    agent_generation: Option<i64>,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let ns = run.namespace().unwrap_or_default();
    let field = start.field();
    let (parent, requester) = match allowed(run, ctx, &ns, start).await? {
        Ok(found) => found,
        Err((reason, message)) => return Ok(refuse(run, acting, reason, message)),
    };
    let parent_uid = crate::api::RunUid::of(&parent).to_string();
    // One start at a time holds a parent's records, until its copy is written.
    let _one = STARTS.acquire().await.expect("never closed");
    let read = read_log(ctx, &parent, &parent_uid, start.keep(), START_MAX_BYTES).await?;
    let mut records = match read {
        Ok(records) => records,
        Err(unread) => {
            let (reason, message) = unread.refusal(start);
            return Ok(refuse(run, acting, reason, message));
        }
    };
    let test = match start {
        Start::Fork(_) => None,
        Start::Test(_) => match recorded_calls(&records) {
            Ok(sandbox) => Some(sandbox),
            Err(message) => return Ok(refuse(run, acting, "InvalidAgent", message.to_string())),
        },
    };
    // Only the prefix is copied (the whole log was verified to trust it).
    records.truncate(crate::fork::through(start.seq()));
    let agent = match start.agent() {
        None => match governed_again(run, ctx, &ns, &records).await? {
            Governed::Changed(changed) => Some(*changed),
            Governed::Refused(message) => {
                return Ok(refuse(run, acting, "PolicyRefused", message));
            }
            Governed::Awaits(awaited) => {
                acting.policy = Some((awaited.waiting_on, awaited.message));
                return Ok(super::decide::POLICY_RECHECK);
            }
        },
        Some(name) => {
            // The versions in force at the fork point (the last record copied).
            let from = versions_at(&records);
            match changed_to(run, ctx, template, agent_generation, name, from, field) {
                Ok(Some(changed)) => Some(changed),
                Ok(None) => return Ok(super::decide::DISCOVERY_RECHECK),
                Err(message) => {
                    return Ok(refuse(run, acting, "InvalidAgent", message.to_string()));
                }
            }
        }
    };
    match fork_point(start, parent_uid, requester, agent, test) {
        Ok(point) => copy(run, ctx, start, &records, &point, acting).await,
        Err(message) => Ok(refuse(run, acting, "InvalidAgent", message.to_string())),
    }
}

/// What the fork records at its start: the parent and the point, who asked,
/// the agent it goes on with (a test's as [`tested`]) and a test's calls.
fn fork_point(
    start: Start<'_>,
    parent_uid: String,
    requester: String,
    agent: Option<VersionChanged>,
    test: Option<crate::runlog::records::Sandbox>,
) -> Result<ForkPoint, crate::refusal::Refusal> {
    let agent = match (start, agent) {
        (Start::Test(test_of), Some(changed)) => Some(tested(changed, test_of)?),
        (_, agent) => agent,
    };
    Ok(ForkPoint {
        parent_uid,
        parent_name: start.parent().to_string(),
        seq: start.seq(),
        requester: Some(requester),
        agent,
        test,
        budget: start.budget(),
        replace: start.replace(),
    })
}

/// Copies `records` into the fork's log at `point`, and tells how that went.
async fn copy(
    run: &AgentRun,
    ctx: &Context,
    start: Start<'_>,
    records: &[Record],
    point: &ForkPoint,
    acting: &mut Acting,
) -> Result<Duration, Error> {
    let uid = crate::api::RunUid::of(run);
    let copied = copy_prefix(
        ctx.log.store.as_ref(),
        &ctx.log.signer,
        &uid,
        records,
        point,
        &ctx.log.identity,
    )
    .await;
    ctx.memory.mark_changed(&uid);
    match copied
        .map(|_| copied_message(start, point))
        .map_err(refusal)
    {
        Ok(message) => {
            acting.fork = Some(condition(run, true, "Copied", &message));
            acting.notices.push(notice(false, "Forked", message));
            Ok(Duration::ZERO)
        }
        Err(Refused::Store(e)) => Err(Error::Store(e)),
        Err(Refused::Because(reason, message)) => Ok(refuse(run, acting, reason, message)),
    }
}

/// What the fork's condition and Event say of a start that copied.
fn copied_message(start: Start<'_>, point: &ForkPoint) -> String {
    match start {
        Start::Fork(_) => format!(
            "records 0..={} of {:?} copied; the fork goes on from there",
            point.seq,
            start.parent()
        ),
        Start::Test(_) => format!(
            "a replay test of {:?}: its task copied and its {} recorded calls to answer from; nothing is called",
            start.parent(),
            point.test.as_ref().map_or(0, |t| t.calls.len())
        ),
    }
}

/// Why a copy failed: the fork's refusal (reason, message), or the store's
/// failure, which the reconcile retries.
#[derive(Debug)]
enum Refused {
    Because(&'static str, String),
    Store(crate::store::StoreError),
}

fn refusal(e: ForkError) -> Refused {
    match e {
        ForkError::Store(e) => Refused::Store(e),
        e @ ForkError::ParentUnverified(_) => Refused::Because("ParentTampered", e.to_string()),
        e @ ForkError::Replace(_) => Refused::Because("InvalidReplacement", e.to_string()),
        e => Refused::Because("InvalidForkPoint", e.to_string()),
    }
}

/// The recorded run's settled calls, for a test to answer from. A
/// container agent's run is refused: its test would need the agent's own
/// requests matched (not built).
fn recorded_calls(
    records: &[Record],
) -> Result<crate::runlog::records::Sandbox, crate::refusal::Refusal> {
    let state = state_of(records);
    if state.runs_a_container() {
        return Err(
            "spec.testOf.run: the recorded run has a container agent; replay tests of container agents are not supported"
                .into(),
        );
    }
    Ok(crate::sandbox::recorded_calls(&state))
}

/// The tested version as the test runs it: a built-in agent, with the
/// test's budgets (or the Agent's), which never ask anyone.
fn tested(
    mut changed: VersionChanged,
    test_of: &TestOf,
) -> Result<VersionChanged, crate::refusal::Refusal> {
    if changed.container.is_some() {
        return Err(format!(
            "spec.testOf.agent: Agent {} is a container agent; replay tests of container agents are not supported",
            test_of.agent
        )
        .into());
    }
    let mut budgets = changed.agent.budgets.take().unwrap_or_default();
    if let Some(b) = &test_of.budgets {
        budgets.max_tokens = b.max_tokens;
        budgets.max_cost_usd = b.max_cost_usd;
    }
    budgets.on_exhausted = Some(crate::runlog::v1::OnExhausted::Fail);
    budgets.approvers = None;
    changed.agent.budgets = Some(budgets);
    Ok(changed)
}

/// The parent, and the fork's requester, when the requester may read the
/// parent's log; otherwise the refusal's reason and message.
async fn allowed(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    start: Start<'_>,
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
        name: Some(start.parent().to_string()),
    };
    let authorizer = Authorizer::new(ctx.client.clone(), Duration::ZERO);
    match authorizer.check(&user, &question).await {
        Ok(Answer::Allowed) => {}
        Ok(Answer::Denied(why)) => {
            let message = format!(
                "{}.run: {requester} may not read the parent's log: {why}",
                start.field()
            );
            return Ok(Err(("Forbidden", message)));
        }
        Err(e) => return Err(Error::Review(e)),
    }
    let runs: Api<AgentRun> = Api::namespaced(ctx.client.clone(), ns);
    let parent = runs
        .get_opt(start.parent())
        .await
        .map_err(|source| Error::Read {
            what: "the fork's parent run",
            source,
        })?;
    Ok(match parent {
        Some(parent) if parent.meta().uid == run.meta().uid => Err((
            "InvalidForkPoint",
            format!("{}.run: a run cannot fork or test itself", start.field()),
        )),
        Some(parent) => Ok((parent, requester)),
        None => Err((
            "ParentNotFound",
            format!(
                "{}.run: no AgentRun {:?} in namespace {ns:?}",
                start.field(),
                start.parent()
            ),
        )),
    })
}

/// The most of a parent's log a fork's or test's start holds: the records
/// it keeps (a fork's prefix; every record of a test's recorded run, whose
/// calls it answers from), estimated as the log cache does. A larger start
/// is refused, naming the bound. One start at a time holds them
/// ([`STARTS`]), so starts add at most this, and its sealed copy, to the
/// controller's bound (docs/memory.md).
pub const START_MAX_BYTES: usize = 16 << 20;

/// The starts holding a parent's records: one at a time.
static STARTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// Why a parent's log was not read for a start.
#[derive(Debug)]
pub(crate) enum Unread {
    /// It does not verify.
    Tampered(crate::store::StoreError),
    /// What the start would keep of it is over `bound` bytes.
    TooLarge { bound: usize },
}

impl Unread {
    /// The fork's refusal: its reason and message.
    fn refusal(&self, start: Start<'_>) -> (&'static str, String) {
        let (field, parent) = (start.field(), start.parent());
        match self {
            Unread::Tampered(tampered) => (
                "ParentTampered",
                format!(
                    "{field}.run: the parent {parent:?}'s log does not verify, so nothing of it is copied: {tampered}"
                ),
            ),
            Unread::TooLarge { bound } => {
                let what = match start {
                    Start::Fork(f) => format!("its records 0..={}", f.seq),
                    Start::Test(_) => {
                        "the whole log (a test answers from every recorded call)".into()
                    }
                };
                let mib = bound >> 20;
                (
                    "TooLarge",
                    format!(
                        "{field}: the parent {parent:?}'s log is too large to start from: {what} come to more than \
                         {mib} MiB, the most a start holds (docs/memory.md); nothing is copied"
                    ),
                )
            }
        }
    }
}

/// The parent's whole log verified page by page (chain, anchored head,
/// signatures under its rules), its first `keep` records kept while they
/// come to at most `bound` bytes.
pub(crate) async fn read_log(
    ctx: &Context,
    parent: &AgentRun,
    parent_uid: &str,
    keep: usize,
    bound: usize,
) -> Result<Result<Vec<Record>, Unread>, Error> {
    let (anchor, rules) = (anchored_head(parent), signature_rules(parent));
    let mut pages = Pages::after(
        ctx.log.store.as_ref(),
        &ctx.log.reads,
        parent_uid,
        Head::EMPTY,
    );
    let (mut all, mut held) = (Vec::new(), 0usize);
    loop {
        match checked_page(ctx, parent_uid, &mut pages, &anchor, &rules).await? {
            Ok(Some((records, _ticket))) => {
                let room = keep.saturating_sub(all.len());
                for record in records.into_iter().take(room) {
                    held = held.saturating_add(crate::controller::memory::record_bytes(&record));
                    if held > bound {
                        return Ok(Err(Unread::TooLarge { bound }));
                    }
                    all.push(record);
                }
            }
            Ok(None) => break,
            Err(tampered) => return Ok(Err(Unread::Tampered(tampered))),
        }
    }
    let anchored = crate::store::check_anchor_after(parent_uid, &pages.head(), &[], &anchor);
    Ok(anchored.map(|()| all).map_err(Unread::Tampered))
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
    field: &str,
) -> Result<Option<VersionChanged>, crate::refusal::Refusal> {
    let start_field = field;
    let field = format!("{start_field}.agent: Agent {name}: spec.tools");
    let mcp = match ctx.discovery.catalog(run, &template.tools, &field) {
        Discovered::Pending | Discovered::Failed { .. } => return Ok(None),
        Discovered::Ready(mcp) => mcp,
    };
    let started = mcp
        .and_then(|mcp| snapshot(run, template, agent_generation, mcp))
        .map_err(|e| crate::refusal::Refusal::from(format!("{start_field}.agent: {e}")))?;
    Ok(Some(VersionChanged {
        agent: started.agent,
        tools: started.tools,
        mcp: started.mcp,
        from,
        to: started.versions,
        container: started.container,
    }))
}

/// The parent's agent, as the platform of today governs it, or why it
/// may not go on.
enum Governed {
    Changed(Box<VersionChanged>),
    Refused(String),
    Awaits(crate::controller::watchers::platform::Awaited),
}

/// A fork that keeps its parent's agent is judged by the platform of
/// today, as a new run of that agent would be (DESIGN.md §11): the parent's
/// pin at the fork point, with what the platform of its day added taken off
/// and today's put on, is recorded in a `VersionChanged` after `Forked`
/// (its versions unchanged); refused wherever a new run would be.
async fn governed_again(
    run: &AgentRun,
    ctx: &Context,
    ns: &str,
    records: &[Record],
) -> Result<Governed, Error> {
    let Some(pinned) = state_of(records).snapshot else {
        let message = "spec.forkOf.seq: the parent's log pins no agent at that point";
        return Ok(Governed::Refused(message.into()));
    };
    // Only an inline agent is pinned without an Agent's generation.
    let inline = pinned.versions.agent_generation.is_none();
    let (governed, refused, awaited) = super::platform_judges(ctx, ns, |platform| {
        let governed = platform.govern_again(&pinned.agent);
        let (refused, awaited) = platform.judge(run, &governed);
        let inline = platform.forbids_inline().filter(|_| inline).map(|by| {
            format!(
                "spec.forkOf: the parent's agent is written inline in the parent run, and inline agents \
                 are forbidden here by {by}; fork onto an Agent with spec.forkOf.agent"
            )
        });
        (governed, inline.or(refused), awaited)
    })
    .await?;
    if let Some(message) = refused {
        return Ok(Governed::Refused(message));
    }
    if let Some(awaited) = awaited {
        return Ok(Governed::Awaits(awaited));
    }
    let generation = pinned.versions.agent_generation;
    let mcp = pinned.mcp.clone();
    let started = snapshot(run, &governed, generation, mcp)
        .map_err(|e| format!("spec.forkOf: the parent's agent: {e}"));
    Ok(match started {
        Ok(started) => Governed::Changed(Box::new(VersionChanged {
            agent: started.agent,
            tools: started.tools,
            mcp: started.mcp,
            from: pinned.versions,
            to: started.versions,
            container: started.container,
        })),
        Err(message) => Governed::Refused(message),
    })
}

/// The agent's versions in force at the end of `records` (the fork point).
fn versions_at(records: &[Record]) -> crate::runlog::records::Versions {
    state_of(records)
        .snapshot
        .map(|s| s.versions)
        .unwrap_or_default()
}

fn state_of(records: &[Record]) -> crate::replay::RunState {
    let entries = records
        .iter()
        .filter_map(|r| crate::replay::Entry::decode(r.seq, r.kind.as_str(), &r.payload).ok())
        .collect();
    crate::replay::RunState::replay(entries)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ForkBudget, TestBudgets};
    use crate::runlog::records::Sandbox;

    fn fork_of(seq: u64) -> ForkOf {
        ForkOf {
            run: "parent".into(),
            seq,
            agent: None,
            replace: None,
            budget: ForkBudget::Inherit,
        }
    }

    fn test_of(budgets: Option<TestBudgets>) -> TestOf {
        TestOf {
            run: "parent".into(),
            agent: "candidate".into(),
            budgets,
        }
    }

    /// The Agent a fork or test goes on with, as `changed_to` makes it:
    /// its budgets ask bob.
    fn changed(container: bool) -> VersionChanged {
        let mut agent = serde_json::json!({
            "model": {"provider": "OpenAI", "name": "m"},
            "budgets": {"maxTokens": 1000, "onExhausted": "Ask", "approvers": {"users": ["bob"]}}
        });
        if container {
            agent["container"] = serde_json::json!({"image": "team/agent:1", "command": ["agent"]});
        }
        let template: AgentTemplate = serde_json::from_value(agent).unwrap();
        VersionChanged {
            agent: template.clone().into(),
            tools: Vec::new(),
            mcp: Default::default(),
            from: Default::default(),
            to: Default::default(),
            container: template.container.map(Into::into),
        }
    }

    #[test]
    fn a_fork_keeps_its_prefix_and_a_test_every_recorded_call() {
        let fork = fork_of(4);
        assert_eq!(Start::Fork(&fork).keep(), crate::fork::through(4));
        assert_eq!(Start::Test(&test_of(None)).keep(), usize::MAX);
        assert_eq!(Start::Test(&test_of(None)).seq(), 0);
    }

    #[test]
    fn a_start_too_large_is_refused_naming_what_it_would_hold_and_the_bound() {
        let too_large = Unread::TooLarge {
            bound: START_MAX_BYTES,
        };
        let fork = fork_of(5);
        let (reason, message) = too_large.refusal(Start::Fork(&fork));
        assert_eq!(reason, "TooLarge");
        for part in [
            "spec.forkOf",
            "\"parent\"",
            "records 0..=5",
            "16 MiB",
            "nothing is copied",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        let test = test_of(None);
        let (_, message) = too_large.refusal(Start::Test(&test));
        assert!(
            message.starts_with("spec.testOf") && message.contains("whole log"),
            "{message}"
        );
    }

    #[test]
    fn a_forks_point_is_its_parent_at_its_seq_with_its_budget() {
        let fork = fork_of(4);
        let point = fork_point(
            Start::Fork(&fork),
            "uid-p".into(),
            "alice".into(),
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            (
                point.parent_name.as_str(),
                point.parent_uid.as_str(),
                point.seq
            ),
            ("parent", "uid-p", 4)
        );
        assert_eq!(point.requester.as_deref(), Some("alice"));
        assert_eq!(point.budget, ForkBudget::Inherit);
        assert!(point.agent.is_none() && point.test.is_none());
        // A fork's Agent is taken as it is: its budgets may still ask.
        let agent = Some(changed(false));
        let point = fork_point(Start::Fork(&fork), "u".into(), "a".into(), agent, None).unwrap();
        let budgets = point.agent.unwrap().agent.budgets.unwrap();
        assert!(budgets.approvers.is_some());
    }

    #[test]
    fn a_test_runs_its_agent_on_its_own_budgets_asking_no_one() {
        let test = test_of(Some(TestBudgets {
            max_tokens: Some(50),
            max_cost_usd: None,
        }));
        let calls = Some(Sandbox::default());
        let agent = Some(changed(false));
        let point = fork_point(Start::Test(&test), "u".into(), "a".into(), agent, calls).unwrap();
        assert_eq!(point.seq, 0);
        assert_eq!(point.budget, ForkBudget::FromFork);
        assert!(point.test.is_some());
        let budgets = point.agent.unwrap().agent.budgets.unwrap();
        assert_eq!(budgets.max_tokens, Some(50));
        assert_eq!(
            budgets.on_exhausted,
            Some(crate::runlog::v1::OnExhausted::Fail)
        );
        assert_eq!(budgets.approvers, None);
        // A container agent cannot be tested.
        let agent = Some(changed(true));
        let refused = fork_point(Start::Test(&test), "u".into(), "a".into(), agent, None);
        assert!(refused.unwrap_err().to_string().contains("container agent"));
    }

    #[test]
    fn a_failed_copy_is_refused_by_its_reason_but_a_stores_failure_retried() {
        let reason = |e: ForkError| match refusal(e) {
            Refused::Because(reason, _) => reason,
            Refused::Store(e) => panic!("retried: {e}"),
        };
        assert_eq!(
            reason(ForkError::PastEnd { seq: 9, last: 3 }),
            "InvalidForkPoint"
        );
        assert_eq!(reason(ForkError::AtEnd { seq: 3 }), "InvalidForkPoint");
        assert_eq!(reason(ForkError::Occupied { seq: 1 }), "InvalidForkPoint");
        assert_eq!(
            reason(ForkError::Replace("no".into())),
            "InvalidReplacement"
        );
        let unverified = crate::store::StoreError::InvalidRecord {
            reason: "seq 2".into(),
        };
        assert_eq!(
            reason(ForkError::ParentUnverified(unverified)),
            "ParentTampered"
        );
        let down = crate::store::StoreError::Unavailable {
            url: "s".into(),
            reason: "down".into(),
        };
        assert!(matches!(refusal(ForkError::Store(down)), Refused::Store(_)));
    }

    #[test]
    fn a_copy_says_what_it_copied() {
        let fork = fork_of(4);
        let point = fork_point(Start::Fork(&fork), "u".into(), "a".into(), None, None).unwrap();
        assert_eq!(
            copied_message(Start::Fork(&fork), &point),
            "records 0..=4 of \"parent\" copied; the fork goes on from there"
        );
        let test = test_of(None);
        let point = fork_point(Start::Test(&test), "u".into(), "a".into(), None, None).unwrap();
        assert!(copied_message(Start::Test(&test), &point).contains("its 0 recorded calls"));
    }
}
