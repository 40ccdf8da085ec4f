//! Approvals on the controller's side: the Approval object raised from an
//! `ApprovalRequested` record, and the pure evaluation of its decisions.
//! Silence never approves: expiry leads to `onExpiry`, never to execution
//! of the requested call.
//!
//! Everything but the decisions is derived from the log: the controller
//! builds the Approval it expects (run uid, step, tool, arguments, hash, the
//! gate recomputed from the pinned policy, an expiry counted from the
//! request's recorded time) and takes decisions only from an object that is
//! exactly that, owned by the run. A deleted Approval is raised again with
//! the same expiry; a look-alike is never acted on.

mod decision;
mod duties;
pub mod notify;
pub mod pinned_gate;

pub use decision::{
    Evaluation, MAX_APPROVAL_BYTES, alternative_to_run, approval_name, build, evaluate,
    evaluate_as_recorded, expiry, fits_in_the_api, mismatches, state_of,
};
use decision::{RUN_LABEL, decided, judge, raised_for, refused};
pub use notify::{NoticeKind, notify};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Resource, ResourceExt};

use crate::api::{AgentRun, Approval, ApprovalState};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::controller::FIELD_MANAGER;
use crate::controller::context::{Context, notice};
use crate::controller::error::Error;
use crate::controller::log_writer::append;

use crate::replay::{Entry, RunState};
use crate::runlog::records::{ApprovalDecided, ApprovalRequested, RunFinished, Verdict};
use crate::runlog::v1;
use crate::store::Head;

pub use crate::api::REQUESTER_ANNOTATION;

/// When the request at `request_seq` was recorded (server time).
async fn requested_at(ctx: &Context, uid: &str, request_seq: u64) -> Result<Timestamp, Error> {
    let records = ctx
        .log
        .store
        .read_range(uid, request_seq, Some(request_seq + 1))
        .await
        .map_err(Error::Store)?;
    let at = records
        .first()
        .and_then(|r| r.created_at)
        .and_then(|t| Timestamp::from_second(t.timestamp()).ok());
    // A backend without server time: the raise is not repeatable, but never later than now.
    Ok(at.unwrap_or_else(Timestamp::now))
}

/// The Approval `name`, if it exists.
async fn get_approval(approvals: &Api<Approval>, name: &str) -> Result<Option<Approval>, Error> {
    approvals.get_opt(name).await.map_err(|source| Error::Read {
        what: "approval",
        source,
    })
}

/// An Approval still waited for.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    pub name: String,
    pub expires_at: Timestamp,
    /// Its `metadata.generation`: the decisions are spec, so it moves with each.
    pub generation: Option<i64>,
}

/// The Approval `name` of `run` as it is now, if the run still just waits
/// on it: owned by the run, its decisions short of a quorum and unexpired,
/// and its status showing that (so nothing is behind). Read without the log.
pub(super) async fn pending(
    run: &AgentRun,
    ctx: &Context,
    name: &str,
    now: Timestamp,
) -> Result<Option<Waiting>, Error> {
    let approvals: Api<Approval> =
        Api::namespaced(ctx.client.clone(), &run.namespace().unwrap_or_default());
    let Some(found) = get_approval(&approvals, name).await? else {
        return Ok(None);
    };
    let owned = found
        .owner_references()
        .iter()
        .any(|o| Some(&o.uid) == run.metadata.uid.as_ref());
    let shown = found.status.as_ref().and_then(|s| s.state) == Some(ApprovalState::Pending);
    let evaluation = evaluate(&found.spec, now);
    Ok(
        waiting(&evaluation, name.to_string(), found.metadata.generation)
            .filter(|_| owned && shown),
    )
}

/// Raises the Approval for the request at `request_seq`, or acts on its
/// decisions or expiry. Returns the Approval still waited for.
pub(super) async fn handle(
    run: &AgentRun,
    ctx: &Context,
    log: &RunState,
    head: &Head,
    request_seq: u64,
    now: Timestamp,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> Result<Option<Waiting>, Error> {
    let ns = run.namespace().unwrap_or_default();
    let uid = crate::api::RunUid::of(run);
    let Some(Entry::ApprovalRequested(recorded)) = log.entry(request_seq) else {
        return Ok(None);
    };

    // The request is the step pod's word: check it against the pinned policy
    // first, and go on with what the controller vouches for (its gate, in
    // its own words), never the pod's prose as if it were the policy's.
    let request = match pinned_gate::check(log, request_seq).await {
        Ok(vouched) => vouched,
        Err(reason) => {
            let finished = refused(recorded, request_seq, &reason, log, notices);
            return settle(ctx, &uid, head, Entry::RunFinished(finished)).await;
        }
    };
    let approvals: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    let existing = existing(&approvals, run, request_seq, &request).await?;
    let name = existing.as_ref().map_or_else(
        || approval_name(&run.name_any(), &uid, request_seq),
        ResourceExt::name_any,
    );
    // Expired already: what the policy says follows is recorded.
    if let Some(expired) = decided(log, request_seq) {
        let next = after_expiry(run, ctx, &request, &expired, &name, log, notices);
        return settle(ctx, &uid, head, next).await;
    }

    // Read (raising it when missing), judge, then act: the log first, the
    // Approval's status after, so the status never runs ahead of the log.
    let expected = build(
        run,
        request_seq,
        &request,
        requested_at(ctx, &uid, request_seq).await?,
    );
    if existing.is_none()
        && let Err(reason) = fits_in_the_api(&expected)
    {
        // Creating it would be refused every time: the run ends instead.
        let finished = refused(&request, request_seq, &reason, log, notices);
        return settle(ctx, &uid, head, Entry::RunFinished(finished)).await;
    }
    let found = match existing {
        Some(found) => found,
        None => raise_missing(run, ctx, &approvals, &expected, &name, &request, notices).await?,
    };
    let found = duties::without_stand_ins(&ctx.client, found).await?;
    let judged = judge(
        &expected,
        &found,
        &request,
        log,
        request_seq,
        &name,
        now,
        notices,
    );
    if let Some(record) = judged.record {
        let raised = found.metadata.creation_timestamp.as_ref();
        record_decision(run, ctx, head, (&name, raised), &request, record, now).await?;
    }
    if judged.status_behind {
        write_approval_status(&approvals, &name, &judged.evaluation, judged.state, now).await?;
    }
    Ok(waiting(&judged.evaluation, name, found.metadata.generation))
}

/// Appends what settles the request without an Approval to wait for: the
/// run's end, or the escalated request after an expiry.
async fn settle(
    ctx: &Context,
    uid: &str,
    head: &Head,
    entry: Entry,
) -> Result<Option<Waiting>, Error> {
    append(ctx, uid, head, entry).await?;
    Ok(None)
}

/// The Approval `name` still waited for, if its decisions leave it pending.
fn waiting(evaluation: &Evaluation, name: String, generation: Option<i64>) -> Option<Waiting> {
    match evaluation {
        Evaluation::Pending { expires_at, .. } => Some(Waiting {
            name,
            expires_at: *expires_at,
            generation,
        }),
        _ => None,
    }
}

/// Records a decision (or the expiry) in the log, then tells the webhook.
async fn record_decision(
    run: &AgentRun,
    ctx: &Context,
    head: &Head,
    (name, raised): (&str, Option<&Time>),
    request: &ApprovalRequested,
    record: ApprovalDecided,
    now: Timestamp,
) -> Result<(), Error> {
    ctx.metrics
        .observe_approval_decided(raised, now, record.verdict);
    let event = if record.verdict == Verdict::Expired {
        NoticeKind::Expired
    } else {
        NoticeKind::Decided
    };
    let detail = json!({"verdict": record.verdict, "decisions": record.decisions});
    let uid = crate::api::RunUid::of(run);
    append(ctx, &uid, head, Entry::ApprovalDecided(record)).await?;
    notify(ctx, run, name, request, event, detail);
    Ok(())
}

/// The Approval already raised for the request at `request_seq` of `run`,
/// under whatever name the release that raised it gave it: the one this
/// release names, else the one the run's status points to, else one
/// labelled with the run that its controlling owner (the run's uid), its
/// step and the exact call (tool and arguments hash) tie to the request.
/// An upgraded controller thus continues on the Approval people have in
/// front of them, and never raises a second one beside it.
async fn existing(
    approvals: &Api<Approval>,
    run: &AgentRun,
    request_seq: u64,
    request: &ApprovalRequested,
) -> Result<Option<Approval>, Error> {
    let uid = crate::api::RunUid::of(run);
    let named = approval_name(&run.name_any(), &uid, request_seq);
    if let Some(found) = get_approval(approvals, &named).await? {
        return Ok(Some(found));
    }
    let shown = run.status.as_ref().and_then(|s| s.approval.as_ref());
    if let Some(shown) = shown.filter(|a| a.name != named)
        && let Some(found) = get_approval(approvals, &shown.name).await?
        && raised_for(&found, &uid, request_seq, request)
    {
        return Ok(Some(found));
    }
    // A label value has at most 63 characters: a longer run name never got one.
    if run.name_any().len() > 63 {
        return Ok(None);
    }
    let labelled = approvals
        .list(&ListParams::default().labels(&format!("{RUN_LABEL}={}", run.name_any())))
        .await
        .map_err(|source| Error::Read {
            what: "approvals",
            source,
        })?;
    let mut tied: Vec<Approval> = labelled
        .items
        .into_iter()
        .filter(|a| raised_for(a, &uid, request_seq, request))
        .collect();
    // Two would be one release's bug; the oldest is the one people saw first.
    tied.sort_by_key(|a| (a.metadata.creation_timestamp.clone(), a.name_any()));
    Ok(tied.into_iter().next())
}

/// Raises the run's Approval for the request, none being there (again, with
/// its original expiry, if someone deleted it).
async fn raise_missing(
    run: &AgentRun,
    ctx: &Context,
    approvals: &Api<Approval>,
    expected: &Approval,
    name: &str,
    request: &ApprovalRequested,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> Result<Approval, Error> {
    let raised = raise(approvals, expected, name).await?;
    // The run already waited on it: someone deleted it.
    let again = run
        .status
        .as_ref()
        .and_then(|s| s.approval.as_ref())
        .is_some_and(|a| a.name == name);
    if again {
        notices.push(notice(
            true,
            "ApprovalRaisedAgain",
            format!(
                "{name} had disappeared; raised again with its original expiry {}",
                expected.spec.expires_at.0
            ),
        ));
    } else {
        notify(
            ctx,
            run,
            name,
            request,
            NoticeKind::Raised,
            json!({"expiresAt": raised.spec.expires_at}),
        );
        notices.push(notice(
            false,
            "ApprovalRequested",
            format!(
                "{} needs approval ({}): kubectl agentrun show {name}",
                request.tool, request.gate.because
            ),
        ));
    }
    Ok(raised)
}

async fn write_approval_status(
    approvals: &Api<Approval>,
    name: &str,
    evaluation: &Evaluation,
    state: ApprovalState,
    now: Timestamp,
) -> Result<(), Error> {
    let decided_by: Vec<String> = match evaluation {
        Evaluation::Decided { decisions, .. } => {
            decisions.iter().map(|d| d.approver.clone()).collect()
        }
        _ => Vec::new(),
    };
    let status = crate::api::ApprovalStatus {
        state: Some(state),
        decided_at: (state != ApprovalState::Pending).then_some(Time(now)),
        decided_by,
        conditions: Vec::new(),
    };
    let body = json!({"apiVersion": Approval::api_version(&()), "kind": Approval::kind(&()), "status": status});
    approvals
        .patch_status(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(Error::Status)?;
    Ok(())
}

/// Creates the expected Approval; one already there (a race) is read back.
async fn raise(api: &Api<Approval>, expected: &Approval, name: &str) -> Result<Approval, Error> {
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    match api.create(&params, expected).await {
        Ok(a) => {
            crate::failpoint::hit("controller:after-create:Approval");
            Ok(a)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            api.get(name).await.map_err(|source| Error::Read {
                what: "approval",
                source,
            })
        }
        Err(source) => Err(Error::Write {
            what: "approval",
            source,
        }),
    }
}

/// What follows an expired approval, by its policy: an escalated request,
/// or the run's end (a human must reconcile an unknowable outcome).
fn after_expiry(
    run: &AgentRun,
    ctx: &Context,
    request: &ApprovalRequested,
    expired: &ApprovalDecided,
    name: &str,
    log: &RunState,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> Entry {
    use crate::runlog::records::Outcome;
    let escalate = expired.on_expiry == Some(v1::OnExpiry::Escalate);
    if escalate && request.escalation < request.gate.max_escalations {
        let next = pinned_gate::escalated(request);
        notices.push(notice(
            true,
            "ApprovalEscalated",
            format!(
                "{name} expired; escalated ({} of {})",
                next.escalation, request.gate.max_escalations
            ),
        ));
        notify(
            ctx,
            run,
            name,
            &next,
            NoticeKind::Escalated,
            json!({"escalation": next.escalation}),
        );
        return Entry::ApprovalRequested(next);
    }
    let (outcome, error) = if request.kind == v1::ApprovalKind::Budget {
        (
            Outcome::BudgetExceeded,
            format!(
                "approval {name} to raise the budget expired without a decision; expiry never raises a budget"
            ),
        )
    } else if request.kind == v1::ApprovalKind::Reconcile {
        // Nobody said whether the call happened: it is never made again on silence.
        (
            Outcome::NeedsHuman,
            format!(
                "approval {name} expired: nobody confirmed whether {} (log record {}) happened; \
                 it was not made again and a human must reconcile it",
                request.tool,
                request.intent_seq.unwrap_or_default()
            ),
        )
    } else {
        let after = if escalate {
            " after every escalation"
        } else {
            ""
        };
        (
            Outcome::Failed,
            format!(
                "approval {name} for {} expired without a decision{after}; the call was not made",
                request.tool
            ),
        )
    };
    Entry::RunFinished(RunFinished {
        outcome,
        result: log.last_text(),
        error: Some(error),
    })
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::api::{ApprovalSpec, Observations, RunRef, Verdict as ApiVerdict};
    use crate::api::{Approvers, Decision, OnExpiry};
    use serde_json::json;

    const HASH: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const OTHER: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn spec(required: u32, decisions: Vec<Decision>) -> ApprovalSpec {
        ApprovalSpec {
            run_ref: RunRef {
                name: "r".into(),
                uid: None,
            },
            step: 4,
            kind: crate::api::ApprovalKind::Call,
            rule: None,
            tool: "issue_refund".into(),
            arguments: json!({"amount": 500}),
            arguments_hash: HASH.into(),
            observations: Observations::default(),
            dependencies: vec![],
            approvers: Approvers {
                users: vec!["alice".into(), "bob".into()],
                groups: vec![],
            },
            required_approvals: required,
            requester: Some("carol".into()),
            separation_of_duties: true,
            expires_at: Time(t(100)),
            on_expiry: OnExpiry::Fail,
            escalate_to: None,
            escalation: 0,
            alternative: None,
            decisions,
        }
    }

    fn d(who: &str, verdict: ApiVerdict, hash: &str, args: Option<serde_json::Value>) -> Decision {
        Decision {
            approver: who.into(),
            verdict,
            arguments_hash: hash.into(),
            arguments: args,
            reason: Some("r".into()),
        }
    }

    #[test]
    fn one_approval_of_one_decides_with_the_requested_arguments() {
        match evaluate(
            &spec(1, vec![d("alice", ApiVerdict::Approve, HASH, None)]),
            t(1),
        ) {
            Evaluation::Decided {
                verdict,
                arguments,
                decisions,
            } => {
                assert_eq!(
                    (verdict, arguments),
                    (Verdict::Approve, Some(json!({"amount": 500})))
                );
                assert_eq!(decisions[0].approver, "alice");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_quorum_needs_distinct_approvers_and_any_reject_rejects() {
        let one = spec(2, vec![d("alice", ApiVerdict::Approve, HASH, None)]);
        assert_eq!(
            evaluate(&one, t(1)),
            Evaluation::Pending {
                expires_at: t(100),
                approvals: 1
            }
        );
        let two = spec(
            2,
            vec![
                d("alice", ApiVerdict::Approve, HASH, None),
                d("bob", ApiVerdict::Approve, HASH, None),
            ],
        );
        assert!(matches!(
            evaluate(&two, t(1)),
            Evaluation::Decided {
                verdict: Verdict::Approve,
                ..
            }
        ));
        let veto = spec(
            2,
            vec![
                d("alice", ApiVerdict::Approve, HASH, None),
                d("bob", ApiVerdict::Reject, HASH, None),
            ],
        );
        assert!(matches!(
            evaluate(&veto, t(1)),
            Evaluation::Decided {
                verdict: Verdict::Reject,
                ..
            }
        ));
    }

    #[test]
    fn an_edit_runs_the_edited_arguments() {
        let s = spec(
            1,
            vec![d(
                "bob",
                ApiVerdict::Edit,
                HASH,
                Some(json!({"amount": 300})),
            )],
        );
        match evaluate(&s, t(1)) {
            Evaluation::Decided {
                verdict: Verdict::Edit,
                arguments,
                ..
            } => assert_eq!(arguments, Some(json!({"amount": 300}))),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_hashes_the_requester_and_strangers_do_not_count() {
        assert!(matches!(
            evaluate(
                &spec(1, vec![d("alice", ApiVerdict::Approve, OTHER, None)]),
                t(1)
            ),
            Evaluation::Pending { .. }
        ));
        assert!(matches!(
            evaluate(
                &spec(1, vec![d("carol", ApiVerdict::Approve, HASH, None)]),
                t(1)
            ),
            Evaluation::Pending { .. }
        ));
        assert!(matches!(
            evaluate(
                &spec(1, vec![d("mallory", ApiVerdict::Approve, HASH, None)]),
                t(1)
            ),
            Evaluation::Pending { .. }
        ));
    }

    #[test]
    fn expiry_never_approves() {
        let approved_late = spec(1, vec![d("alice", ApiVerdict::Approve, HASH, None)]);
        assert_eq!(evaluate(&approved_late, t(100)), Evaluation::Expired);
        assert_eq!(evaluate(&spec(1, vec![]), t(500)), Evaluation::Expired);
        assert_eq!(
            state_of(&Evaluation::Expired, OnExpiry::Escalate),
            ApprovalState::Escalated
        );
        assert_eq!(
            state_of(&Evaluation::Expired, OnExpiry::Fail),
            ApprovalState::Expired
        );
    }

    #[test]
    fn only_a_pending_approval_is_waited_for_until_it_expires() {
        let pending = evaluate(&spec(2, vec![]), t(1));
        let expires_at = match pending {
            Evaluation::Pending { expires_at, .. } => expires_at,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            waiting(&pending, "a".into(), Some(3)),
            Some(Waiting {
                name: "a".into(),
                expires_at,
                generation: Some(3),
            })
        );
        assert_eq!(waiting(&Evaluation::Expired, "a".into(), Some(3)), None);
        let approved = spec(1, vec![d("alice", ApiVerdict::Approve, HASH, None)]);
        assert_eq!(waiting(&evaluate(&approved, t(1)), "a".into(), None), None);
    }

    /// An Approval whose `spec.decisions` the API server last recorded at `at`.
    fn written_at(spec: &ApprovalSpec, at: i64) -> Approval {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
        let mut a = Approval::new("a", spec.clone());
        a.metadata.managed_fields = Some(vec![
            ManagedFieldsEntry {
                manager: Some("agentrun-controller".into()),
                fields_v1: Some(FieldsV1(json!({"f:spec": {"f:tool": {}}}))),
                time: Some(Time(t(1))),
                ..Default::default()
            },
            ManagedFieldsEntry {
                manager: Some("kubectl-agentrun".into()),
                fields_v1: Some(FieldsV1(json!({"f:spec": {"f:decisions": {}}}))),
                time: Some(Time(t(at))),
                ..Default::default()
            },
        ]);
        a
    }

    #[test]
    fn a_quorum_recorded_before_expiry_is_honoured_when_seen_after_it() {
        let approved = spec(1, vec![d("alice", ApiVerdict::Approve, HASH, None)]);
        // Recorded at 90, expiry at 100, the controller looks at 150.
        let on_time = written_at(&approved, 90);
        assert!(matches!(
            evaluate_as_recorded(&approved, Some(&on_time), t(150)),
            Evaluation::Decided {
                verdict: Verdict::Approve,
                ..
            }
        ));
        // Recorded at 120: too late, whatever the controller's clock says.
        let late = written_at(&approved, 120);
        assert_eq!(
            evaluate_as_recorded(&approved, Some(&late), t(150)),
            Evaluation::Expired
        );
        // No quorum by the time of the last write: expired.
        let none = spec(2, vec![d("alice", ApiVerdict::Approve, HASH, None)]);
        assert_eq!(
            evaluate_as_recorded(&none, Some(&written_at(&none, 90)), t(150)),
            Evaluation::Expired
        );
        // Unbound (no Approval to read): judged now.
        assert_eq!(
            evaluate_as_recorded(&approved, None, t(150)),
            Evaluation::Expired
        );
    }

    #[test]
    fn conflicting_edits_run_nothing_and_wait_for_a_quorum() {
        let s = spec(
            2,
            vec![
                d(
                    "alice",
                    ApiVerdict::Edit,
                    HASH,
                    Some(json!({"amount": 100})),
                ),
                d("bob", ApiVerdict::Edit, HASH, Some(json!({"amount": 200}))),
            ],
        );
        assert_eq!(
            evaluate(&s, t(1)),
            Evaluation::Pending {
                expires_at: t(100),
                approvals: 1
            }
        );
    }

    #[test]
    fn an_edit_does_not_borrow_the_quorum_of_the_original_arguments() {
        // bob agrees to 500, alice to 99,999: nobody's set has two approvers.
        let s = spec(
            2,
            vec![
                d("bob", ApiVerdict::Approve, HASH, None),
                d(
                    "alice",
                    ApiVerdict::Edit,
                    HASH,
                    Some(json!({"amount": 99_999})),
                ),
            ],
        );
        assert!(
            matches!(evaluate(&s, t(1)), Evaluation::Pending { approvals: 1, .. }),
            "{:?}",
            evaluate(&s, t(1))
        );
    }

    #[test]
    fn two_identical_edits_decide_the_edit() {
        let s = spec(
            2,
            vec![
                d(
                    "alice",
                    ApiVerdict::Edit,
                    HASH,
                    Some(json!({"amount": 300})),
                ),
                d("bob", ApiVerdict::Edit, HASH, Some(json!({"amount": 300}))),
            ],
        );
        match evaluate(&s, t(1)) {
            Evaluation::Decided {
                verdict: Verdict::Edit,
                arguments,
                decisions,
            } => {
                assert_eq!(arguments, Some(json!({"amount": 300})));
                assert_eq!(decisions.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        // An edit back to the requested arguments agrees with an approval.
        let same = spec(
            2,
            vec![
                d("alice", ApiVerdict::Approve, HASH, None),
                d("bob", ApiVerdict::Edit, HASH, Some(json!({"amount": 500}))),
            ],
        );
        assert!(matches!(
            evaluate(&same, t(1)),
            Evaluation::Decided {
                verdict: Verdict::Approve,
                ..
            }
        ));
    }

    fn run(name: &str, uid: &str) -> AgentRun {
        let mut r = AgentRun::new(name, Default::default());
        r.metadata.namespace = Some("shop".into());
        r.metadata.uid = Some(uid.into());
        r
    }

    #[test]
    fn an_approval_too_large_for_the_api_server_is_refused_with_its_size() {
        let small = build(&run("r", "u"), 3, &request(json!({"a": 1})), t(0));
        assert!(fits_in_the_api(&small).is_ok());
        let huge = "x".repeat(MAX_APPROVAL_BYTES);
        let big = build(&run("r", "u"), 3, &request(json!({"a": huge})), t(0));
        let why = fits_in_the_api(&big).unwrap_err();
        assert!(
            why.contains(&format!("limit of {MAX_APPROVAL_BYTES} bytes")),
            "{why}"
        );
    }

    #[test]
    fn approval_names_carry_the_run_uid_and_never_collide() {
        let a = approval_name("refund", "uid-1", 4);
        assert!(
            a.starts_with("refund-a4-") && a.len() == "refund-a4-".len() + 8,
            "{a}"
        );
        assert_ne!(a, approval_name("refund", "uid-2", 4), "re-created run");
        let prefix = "x".repeat(60);
        let (one, two) = (format!("{prefix}-aa"), format!("{prefix}-bb"));
        let (n1, n2) = (approval_name(&one, "u1", 12), approval_name(&two, "u2", 12));
        assert_ne!(n1, n2);
        assert!(n1.len() <= 63 && n2.len() <= 63, "{n1} {n2}");
        assert!(!approval_name(&format!("{}-", "y".repeat(50)), "u", 1).contains("--"));
    }

    fn request(args: serde_json::Value) -> ApprovalRequested {
        ApprovalRequested {
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "issue_refund".into(),
            arguments_hash: crate::policy::arguments_hash("issue_refund", &args),
            arguments: args,
            reason: None,
            observations: vec![],
            dependencies: vec![],
            gate: crate::policy::Gate {
                approvers: v1::Approvers {
                    users: vec!["alice".into()],
                    groups: vec![],
                },
                required_approvals: 1,
                expires_after: "10m".into(),
                ..Default::default()
            },
            escalation: 0,
            alternative: None,
            kind: v1::ApprovalKind::Call,
            intent_seq: None,
        }
    }

    #[test]
    fn the_expiry_counts_from_the_request_and_is_the_same_when_raised_again() {
        let r = request(json!({"amount": 500}));
        let requested = Timestamp::from_millisecond(1_799_999_999_300).unwrap();
        let first = build(&run("refund", "u1"), 2, &r, requested);
        let again = build(&run("refund", "u1"), 2, &r, requested);
        assert_eq!(first.spec.expires_at, again.spec.expires_at);
        assert_eq!(first.spec.expires_at.0, t(600), "whole seconds, rounded up");
        assert!(mismatches(&first, &again).is_empty());
    }

    #[test]
    fn an_approval_of_an_earlier_release_is_found_by_its_run_step_and_call() {
        let r = request(json!({"amount": 500}));
        let mut earlier = build(&run("refund", "u1"), 2, &r, t(0));
        earlier.metadata.name = Some("refund-approval-2".into());
        assert!(raised_for(&earlier, "u1", 2, &r));
        // Not another run's, step's or call's, whatever its name.
        assert!(!raised_for(&earlier, "u2", 2, &r));
        assert!(!raised_for(&earlier, "u1", 3, &r));
        assert!(!raised_for(
            &earlier,
            "u1",
            2,
            &request(json!({"amount": 50_000}))
        ));
        // Only its controlling owner ties it to a run.
        let mut borrowed = earlier.clone();
        for o in borrowed.metadata.owner_references.iter_mut().flatten() {
            o.controller = Some(false);
        }
        assert!(!raised_for(&borrowed, "u1", 2, &r));
    }

    #[test]
    fn a_look_alike_approval_is_named_for_what_differs() {
        let r = request(json!({"amount": 500}));
        let requested = t(0);
        let expected = build(&run("refund", "u1"), 2, &r, requested);
        // Another run's Approval under this name: its uid, arguments and hash.
        let mut forged = build(
            &run("other", "u2"),
            2,
            &request(json!({"amount": 50_000})),
            requested,
        );
        forged.metadata.name = expected.metadata.name.clone();
        let wrong = mismatches(&expected, &forged).join("\n");
        for field in [
            "metadata.ownerReferences",
            "spec.runRef",
            "spec.arguments ",
            "spec.argumentsHash",
        ] {
            assert!(wrong.contains(field), "{field} missing in:\n{wrong}");
        }
        // A hash that is not the hash of its own arguments is named as such.
        let mut bad_hash = expected.clone();
        bad_hash.spec.arguments = json!({"amount": 5});
        assert!(
            mismatches(&expected, &bad_hash)
                .iter()
                .any(|m| m.contains("is not the hash of spec.tool and spec.arguments"))
        );
        // Decisions are the approvers' part: they never make a mismatch.
        let mut decided = expected.clone();
        decided.spec.decisions = vec![d("alice", ApiVerdict::Approve, &r.arguments_hash, None)];
        assert!(mismatches(&expected, &decided).is_empty());
    }

    fn pinned(policy: crate::api::ApprovalPolicy) -> Vec<Entry> {
        vec![Entry::RunStarted(crate::runlog::records::RunStarted {
            container: None,
            run_name: "r".into(),
            namespace: "n".into(),
            input: "i".into(),
            agent: crate::api::AgentTemplate {
                approval: Some(policy),
                ..Default::default()
            }
            .into(),
            tools: vec![],
            mcp: Default::default(),
            versions: Default::default(),
        })]
    }

    #[test]
    fn a_gated_alternative_never_runs_on_expiry() {
        let policy = crate::api::ApprovalPolicy {
            rules: vec![crate::api::ApprovalRule {
                name: "large-refund".into(),
                tool: "issue_refund".into(),
                when: Some("args.amount > 100".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        let steps = RunState::replay(pinned(policy));
        let mut r = request(json!({"amount": 500}));
        r.alternative = Some(json!({"amount": 50_000}));
        let why = alternative_to_run(&steps, 1, &r).unwrap_err();
        assert!(why.contains("needs approval itself"), "{why}");
        r.alternative = Some(json!({"amount": 100, "_alternative": {"amount": 9}}));
        assert_eq!(
            alternative_to_run(&steps, 1, &r),
            Ok(Some(json!({"amount": 100})))
        );
        r.alternative = None;
        assert_eq!(alternative_to_run(&steps, 1, &r), Ok(None));
    }
}
