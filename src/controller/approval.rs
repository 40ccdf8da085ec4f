//! Approvals on the controller's side: the Approval object raised from an
//! `ApprovalRequested` record, and the pure evaluation of its decisions.
//! Silence never approves: expiry leads to `onExpiry`, never to execution
//! of the requested call.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Resource, ResourceExt};

use crate::api::{
    AgentRun, Approval, ApprovalSpec, ApprovalState, Observations, ProposedCall, RunRef,
    Verdict as ApiVerdict,
};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use super::error::Error;
use super::reconcile::{Context, FIELD_MANAGER, append, notice};
use crate::step::records::{ApprovalRequested, RecordedDecision, RunFinished, Verdict};
use crate::step::replay::{RunState, Step};
use crate::store::Head;

/// Annotation naming the user who created a run, checked by the API server.
pub const REQUESTER_ANNOTATION: &str = "agentrun.dev/requester";

/// Name of the Approval for the request at `request_seq`.
pub fn approval_name(run: &AgentRun, request_seq: u64) -> String {
    let suffix = format!("-a{request_seq}");
    let name = run.name_any();
    let keep = 63usize.saturating_sub(suffix.len()).min(name.len());
    format!("{}{suffix}", name[..keep].trim_end_matches('-'))
}

/// The Approval object for a request, expiring `expires_after` from `now`.
pub fn build(
    run: &AgentRun,
    request_seq: u64,
    request: &ApprovalRequested,
    now: Timestamp,
) -> Approval {
    let expires_after = crate::api::parse_duration(&request.gate.expires_after)
        .ok()
        .and_then(|d| SignedDuration::try_from(d).ok())
        .unwrap_or(SignedDuration::from_hours(1));
    let expires_at = now.checked_add(expires_after).unwrap_or(now);
    let mut approval = Approval::new(
        &approval_name(run, request_seq),
        ApprovalSpec {
            run_ref: RunRef {
                name: run.name_any(),
                uid: run.uid(),
            },
            step: request_seq,
            kind: request.kind,
            rule: Some(request.gate.rule.clone()),
            tool: request.tool.clone(),
            arguments: request.arguments.clone(),
            arguments_hash: request.arguments_hash.clone(),
            observations: Observations {
                reason: request.reason.clone(),
                recent_results: request.observations.clone(),
            },
            dependencies: request.dependencies.clone(),
            approvers: request.gate.approvers.clone(),
            required_approvals: request.gate.required_approvals,
            requester: run.annotations().get(REQUESTER_ANNOTATION).cloned(),
            separation_of_duties: request.gate.separation_of_duties,
            expires_at: Time(expires_at),
            on_expiry: request.gate.on_expiry,
            escalate_to: request.gate.escalate_to.clone(),
            escalation: request.escalation,
            alternative: request.alternative.clone().map(|arguments| ProposedCall {
                tool: request.tool.clone(),
                arguments,
            }),
            decisions: Vec::new(),
        },
    );
    approval.metadata.namespace = run.namespace();
    approval.metadata.owner_references = run.controller_owner_ref(&()).map(|o| vec![o]);
    approval.metadata.labels = Some([("agentrun.dev/run".to_string(), run.name_any())].into());
    approval
}

/// Tells the policy's webhook about an approval event (`raised`, `escalated`,
/// `decided`, `expired`), best effort: a webhook never holds a run up.
pub fn notify(
    http: &reqwest::Client,
    run: &AgentRun,
    approval: &str,
    request: &ApprovalRequested,
    event: &str,
    detail: serde_json::Value,
) {
    let Some(url) = request.gate.notify_webhook.clone() else {
        return;
    };
    if let Err(e) = crate::egress::check_url(&url) {
        tracing::warn!(error = %e, "approval webhook refused");
        return;
    }
    let body = serde_json::json!({
        "event": event,
        "namespace": run.namespace(),
        "run": run.name_any(),
        "approval": approval,
        "tool": request.tool,
        "arguments": request.arguments,
        "argumentsHash": request.arguments_hash,
        "rule": request.gate.rule,
        "approvers": request.gate.approvers,
        "detail": detail,
    });
    let http = http.clone();
    tokio::spawn(async move {
        let sent = http
            .post(&url)
            .json(&body)
            .timeout(std::time::Duration::from_secs(5))
            .send()
            .await;
        match sent.map(|r| r.error_for_status()) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) | Err(e) => tracing::warn!(error = %e, "approval webhook failed"),
        }
    });
}

/// What the decisions on an Approval amount to now.
#[derive(Clone, Debug, PartialEq)]
pub enum Evaluation {
    /// Not enough decisions yet; look again at `expires_at` at the latest.
    Pending {
        expires_at: Timestamp,
        approvals: usize,
    },
    /// Decided: the verdict, the decisions that counted, the arguments to run.
    Decided {
        verdict: Verdict,
        decisions: Vec<RecordedDecision>,
        arguments: Option<serde_json::Value>,
    },
    /// Nobody decided in time.
    Expired,
}

/// Evaluates an Approval's decisions (pure). Decisions quoting another hash,
/// from the requester under separation of duties, or by someone not listed
/// as a user when no group is listed, do not count (the API server refuses
/// them first; this is the second line).
pub fn evaluate(spec: &ApprovalSpec, now: Timestamp) -> Evaluation {
    let counted: Vec<RecordedDecision> = spec
        .decisions
        .iter()
        .filter(|d| d.arguments_hash == spec.arguments_hash)
        .filter(|d| {
            !(spec.separation_of_duties && spec.requester.as_deref() == Some(d.approver.as_str()))
        })
        .filter(|d| !spec.approvers.groups.is_empty() || spec.approvers.users.contains(&d.approver))
        .map(|d| RecordedDecision {
            approver: d.approver.clone(),
            verdict: d.verdict,
            arguments_hash: d.arguments_hash.clone(),
            arguments: d.arguments.clone(),
            reason: d.reason.clone(),
        })
        .collect();
    // Decisions made after expiry never count: silence is not consent, and neither is lateness.
    if now >= spec.expires_at.0 {
        return Evaluation::Expired;
    }
    if let Some(reject) = counted.iter().find(|d| d.verdict == ApiVerdict::Reject) {
        return Evaluation::Decided {
            verdict: Verdict::Reject,
            decisions: vec![reject.clone()],
            arguments: None,
        };
    }
    let required = spec.required_approvals.max(1) as usize;
    if counted.len() < required {
        return Evaluation::Pending {
            expires_at: spec.expires_at.0,
            approvals: counted.len(),
        };
    }
    let edits: Vec<&RecordedDecision> = counted
        .iter()
        .filter(|d| d.verdict == ApiVerdict::Edit)
        .collect();
    match edits.as_slice() {
        [] => Evaluation::Decided {
            verdict: Verdict::Approve,
            decisions: counted.clone(),
            arguments: Some(spec.arguments.clone()),
        },
        [first, rest @ ..] if rest.iter().all(|e| e.arguments == first.arguments) => {
            Evaluation::Decided {
                verdict: Verdict::Edit,
                decisions: counted.clone(),
                arguments: first.arguments.clone(),
            }
        }
        _ => Evaluation::Decided {
            // Approvers edited the call differently: nothing runs, the agent is told.
            verdict: Verdict::Reject,
            decisions: counted
                .iter()
                .map(|d| RecordedDecision {
                    verdict: ApiVerdict::Reject,
                    reason: Some("approvers edited the call in conflicting ways".into()),
                    ..d.clone()
                })
                .collect(),
            arguments: None,
        },
    }
}

/// The Approval's state for its status.
pub fn state_of(evaluation: &Evaluation, on_expiry: crate::api::OnExpiry) -> ApprovalState {
    match evaluation {
        Evaluation::Pending { .. } => ApprovalState::Pending,
        Evaluation::Decided {
            verdict: Verdict::Approve,
            ..
        } => ApprovalState::Approved,
        Evaluation::Decided {
            verdict: Verdict::Edit,
            ..
        } => ApprovalState::Edited,
        Evaluation::Decided { .. } => ApprovalState::Rejected,
        Evaluation::Expired if on_expiry == crate::api::OnExpiry::Escalate => {
            ApprovalState::Escalated
        }
        Evaluation::Expired => ApprovalState::Expired,
    }
}

/// Raises the Approval for the request at `request_seq`, or acts on its
/// decisions or expiry. Returns the Approval still waiting, with its expiry.
pub(super) async fn handle(
    run: &AgentRun,
    ctx: &Context,
    log: &RunState,
    head: &Head,
    request_seq: u64,
    now: Timestamp,
    notices: &mut Vec<super::decide::Notice>,
) -> Result<Option<(String, Timestamp)>, Error> {
    use crate::step::records::{ApprovalDecided, Outcome, Verdict};
    let ns = run.namespace().unwrap_or_default();
    let uid = run.uid().unwrap_or_default();
    let Some(Step::ApprovalRequested(request)) = log.steps.get(request_seq as usize).cloned()
    else {
        return Ok(None);
    };
    let name = approval_name(run, request_seq);
    let decided = log.steps.iter().find_map(|s| match s {
        Step::ApprovalDecided(d) if d.request_seq == request_seq => Some(d.clone()),
        _ => None,
    });
    if let Some(d) = decided {
        // Expired, and the policy says what follows: escalate, or stop the run.
        let escalate = d.on_expiry == Some(crate::api::OnExpiry::Escalate);
        let step = if escalate && request.escalation < request.gate.max_escalations {
            let mut next = request.clone();
            next.escalation += 1;
            if let Some(to) = &request.gate.escalate_to {
                next.gate.approvers = to.clone();
            }
            notices.push(notice(
                true,
                "ApprovalEscalated",
                format!(
                    "{name} expired; escalated ({} of {})",
                    next.escalation, request.gate.max_escalations
                ),
            ));
            notify(
                &ctx.http,
                run,
                &name,
                &next,
                "escalated",
                json!({"escalation": next.escalation}),
            );
            Step::ApprovalRequested(next)
        } else {
            Step::RunFinished(RunFinished {
                outcome: Outcome::Failed,
                result: log.last_text(),
                error: Some(format!(
                    "approval {name} for {} expired without a decision{}; the call was not made",
                    request.tool,
                    if escalate {
                        " after every escalation"
                    } else {
                        ""
                    }
                )),
            })
        };
        append(ctx, &uid, head, step).await?;
        return Ok(None);
    }

    let approvals: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    let approval = match approvals
        .get_opt(&name)
        .await
        .map_err(|source| Error::Read {
            what: "approval",
            source,
        })? {
        Some(a) => a,
        None => {
            let fresh = build(run, request_seq, &request, now);
            let created = match approvals
                .create(
                    &PostParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..Default::default()
                    },
                    &fresh,
                )
                .await
            {
                Ok(a) => a,
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    approvals.get(&name).await.map_err(|source| Error::Read {
                        what: "approval",
                        source,
                    })?
                }
                Err(source) => {
                    return Err(Error::Write {
                        what: "approval",
                        source,
                    });
                }
            };
            notify(
                &ctx.http,
                run,
                &name,
                &request,
                "raised",
                json!({"expiresAt": created.spec.expires_at}),
            );
            notices.push(notice(
                false,
                "ApprovalRequested",
                format!(
                    "{} needs approval ({}): kubectl agentrun show {name}",
                    request.tool, request.gate.because
                ),
            ));
            created
        }
    };
    let evaluation = evaluate(&approval.spec, now);
    let state = state_of(&evaluation, approval.spec.on_expiry);
    if approval.status.as_ref().and_then(|s| s.state) != Some(state) {
        let decided_by: Vec<String> = match &evaluation {
            Evaluation::Decided { decisions, .. } => {
                decisions.iter().map(|d| d.approver.clone()).collect()
            }
            _ => Vec::new(),
        };
        let status = crate::api::ApprovalStatus {
            state: Some(state),
            decided_at: (state != crate::api::ApprovalState::Pending).then_some(Time(now)),
            decided_by,
            conditions: Vec::new(),
        };
        let body = json!({"apiVersion": Approval::api_version(&()), "kind": Approval::kind(&()), "status": status});
        approvals
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(Error::Status)?;
    }
    let observations_hash = crate::store::sha256_hex(&crate::store::canonical_json(
        &serde_json::to_value(&approval.spec.observations).unwrap_or_default(),
    ));
    let record = match evaluation {
        Evaluation::Pending { expires_at, .. } => return Ok(Some((name, expires_at))),
        Evaluation::Decided {
            verdict,
            decisions,
            arguments,
        } => {
            let who: Vec<&str> = decisions.iter().map(|d| d.approver.as_str()).collect();
            notices.push(notice(
                verdict == Verdict::Reject,
                "ApprovalDecided",
                format!("{name}: {verdict:?} by {}", who.join(", ")),
            ));
            ApprovalDecided {
                request_seq,
                approval: name,
                verdict,
                decisions,
                arguments,
                observations_hash,
                on_expiry: None,
            }
        }
        Evaluation::Expired => {
            let on_expiry = approval.spec.on_expiry;
            notices.push(notice(
                true,
                "ApprovalExpired",
                format!("{name} expired without a decision; onExpiry: {on_expiry:?}"),
            ));
            let arguments = match on_expiry {
                crate::api::OnExpiry::Alternative => approval
                    .spec
                    .alternative
                    .as_ref()
                    .map(|a| a.arguments.clone()),
                _ => None,
            };
            ApprovalDecided {
                request_seq,
                approval: name,
                verdict: Verdict::Expired,
                decisions: Vec::new(),
                arguments,
                observations_hash,
                on_expiry: Some(on_expiry),
            }
        }
    };
    let raised = approval.metadata.creation_timestamp.as_ref();
    ctx.metrics
        .observe_approval_decided(raised, now, record.verdict);
    let event = if record.verdict == Verdict::Expired {
        "expired"
    } else {
        "decided"
    };
    let detail = json!({"verdict": record.verdict, "decisions": record.decisions});
    let approval_name = record.approval.clone();
    append(ctx, &uid, head, Step::ApprovalDecided(record)).await?;
    notify(&ctx.http, run, &approval_name, &request, event, detail);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn conflicting_edits_run_nothing() {
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
        assert!(matches!(
            evaluate(&s, t(1)),
            Evaluation::Decided {
                verdict: Verdict::Reject,
                arguments: None,
                ..
            }
        ));
    }
}
