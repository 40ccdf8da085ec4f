//! Deciding what an Approval is and what its decisions come to, touching
//! nothing: the Approval the log implies (its name, expiry and spec), a
//! found object checked against it, the decisions evaluated (quorum,
//! rejection, expiry), and the record a decision becomes. The I/O around
//! it (raising, reading, recording) is in the module above.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Resource, ResourceExt};

use crate::api::{
    AgentRun, Approval, ApprovalSpec, ApprovalState, Observations, OnExpiry, ProposedCall, RunRef,
    Verdict as ApiVerdict,
};
use serde_json::Value;

use crate::api::REQUESTER_ANNOTATION;
use crate::controller::context::notice;

use crate::policy::Classification;
use crate::replay::{Entry, RunState};
use crate::runlog::records::{
    ApprovalDecided, ApprovalRequested, RecordedDecision, RunFinished, Verdict,
};
use crate::runlog::v1;

/// Name of the Approval for the request at `request_seq` of the run with
/// `uid`: `<run>-a<seq>-<8 hex of sha256(uid)>`, at most 63 characters. The
/// uid part keeps runs that share a name (re-created after an orphaning
/// delete) or a long prefix from ever meeting each other's Approvals.
pub fn approval_name(run_name: &str, uid: &str, request_seq: u64) -> String {
    let digest = crate::store::sha256_hex(uid.as_bytes());
    let suffix = format!("-a{request_seq}-{}", &digest[..8]);
    let keep = 63usize.saturating_sub(suffix.len());
    let kept = crate::text::prefix(run_name, keep);
    format!("{}{suffix}", kept.trim_end_matches(['-', '.']))
}

/// When the request raised at `requested_at` expires: the same instant
/// however often its Approval is raised again (whole seconds, as the API
/// server stores it; rounded up, so an approver never gets less time).
pub fn expiry(request: &ApprovalRequested, requested_at: Timestamp) -> Timestamp {
    let expires_after = crate::api::parse_duration(&request.gate.expires_after)
        .ok()
        .and_then(|d| SignedDuration::try_from(d).ok())
        .unwrap_or(SignedDuration::from_hours(1));
    let at = requested_at
        .checked_add(expires_after)
        .unwrap_or(requested_at);
    let whole = at.as_second() + i64::from(at.subsec_nanosecond() > 0);
    Timestamp::from_second(whole).unwrap_or(at)
}

/// The Approval the controller expects for a request recorded at `requested_at`.
pub fn build(
    run: &AgentRun,
    request_seq: u64,
    request: &ApprovalRequested,
    requested_at: Timestamp,
) -> Approval {
    let uid = run.uid().unwrap_or_default();
    let mut approval = Approval::new(
        &approval_name(&run.name_any(), &uid, request_seq),
        ApprovalSpec {
            run_ref: RunRef {
                name: run.name_any(),
                uid: run.uid(),
            },
            step: request_seq,
            kind: request.kind.into(),
            rule: Some(request.gate.rule.clone()),
            tool: request.tool.clone(),
            arguments: request.arguments.clone(),
            arguments_hash: request.arguments_hash.clone(),
            observations: Observations {
                reason: request.reason.clone(),
                recent_results: request
                    .observations
                    .iter()
                    .cloned()
                    .map(Into::into)
                    .collect(),
            },
            dependencies: request
                .dependencies
                .iter()
                .cloned()
                .map(Into::into)
                .collect(),
            approvers: request.gate.approvers.clone().into(),
            required_approvals: request.gate.required_approvals,
            requester: run.annotations().get(REQUESTER_ANNOTATION).cloned(),
            separation_of_duties: request.gate.separation_of_duties,
            expires_at: Time(expiry(request, requested_at)),
            on_expiry: request.gate.on_expiry.into(),
            escalate_to: request.gate.escalate_to.clone().map(Into::into),
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
    approval.metadata.labels = Some([(RUN_LABEL.to_string(), run.name_any())].into());
    approval
}

/// Why `found` is not the Approval the controller expects (empty: it is).
/// Decisions are the one thing approvers write, so they are not compared.
pub fn mismatches(expected: &Approval, found: &Approval) -> Vec<String> {
    let mut out = Vec::new();
    let owner = |a: &Approval| {
        a.owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .map(|o| (o.kind.clone(), o.name.clone(), o.uid.clone()))
    };
    if owner(found) != owner(expected) {
        out.push(format!(
            "metadata.ownerReferences: its controller is {:?}, not the run {:?}",
            owner(found),
            owner(expected)
        ));
    }
    let recomputed = crate::policy::arguments_hash(&found.spec.tool, &found.spec.arguments);
    if found.spec.arguments_hash != recomputed {
        out.push(format!(
            "spec.argumentsHash {} is not the hash of spec.tool and spec.arguments ({recomputed})",
            found.spec.arguments_hash
        ));
    }
    let as_map = |spec: &ApprovalSpec| {
        let mut v = serde_json::to_value(spec).unwrap_or_default();
        if let Some(m) = v.as_object_mut() {
            m.remove("decisions");
        }
        v.as_object().cloned().unwrap_or_default()
    };
    let (f, e) = (as_map(&found.spec), as_map(&expected.spec));
    let mut keys: Vec<&String> = f.keys().chain(e.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        if f.get(k) != e.get(k) {
            let show = |v: Option<&Value>| {
                v.map_or("absent".to_string(), |v| abbreviate(&v.to_string(), 120))
            };
            out.push(format!(
                "spec.{k} is {}, the request in the log says {}",
                show(f.get(k)),
                show(e.get(k))
            ));
        }
    }
    out
}

pub(super) fn abbreviate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// What the decisions on an Approval amount to now.
#[derive(Clone, Debug, PartialEq)]
pub enum Evaluation {
    /// No set of arguments has its quorum yet; look again at `expires_at` at
    /// the latest. `approvals`: the most distinct approvers agreeing to one set.
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
/// them first; this is the second line). Any reject rejects. Otherwise the
/// counted decisions are grouped by the arguments they agree to (Approve:
/// the requested ones; Edit: its own), and a set is decided only when
/// `requiredApprovals` distinct approvers agree to exactly it: an edit needs
/// the full quorum for the edited arguments.
pub fn evaluate(spec: &ApprovalSpec, now: Timestamp) -> Evaluation {
    // Decisions made after expiry never count: silence is not consent, and neither is lateness.
    if now >= spec.expires_at.0 {
        return Evaluation::Expired;
    }
    let counted: Vec<RecordedDecision> = spec
        .decisions
        .iter()
        .filter(|d| d.arguments_hash == spec.arguments_hash)
        .filter(|d| {
            !(spec.separation_of_duties && spec.requester.as_deref() == Some(d.approver.as_str()))
        })
        .filter(|d| !spec.approvers.groups.is_empty() || spec.approvers.users.contains(&d.approver))
        // An Edit without arguments agrees to nothing in particular.
        .filter(|d| d.verdict != ApiVerdict::Edit || d.arguments.is_some())
        // Nor does a budget edit whose limits do not read.
        .filter(|d| spec.kind != crate::api::ApprovalKind::Budget || budget_edit_reads(d))
        .map(|d| RecordedDecision {
            approver: d.approver.clone(),
            verdict: d.verdict.into(),
            arguments_hash: d.arguments_hash.clone(),
            arguments: d.arguments.clone(),
            reason: d.reason.clone(),
        })
        .collect();
    if let Some(reject) = counted.iter().find(|d| d.verdict == v1::Verdict::Reject) {
        return Evaluation::Decided {
            verdict: Verdict::Reject,
            decisions: vec![reject.clone()],
            arguments: None,
        };
    }
    // Group by the exact arguments each decision agrees to, in decision order.
    let mut groups: Vec<(Value, Vec<RecordedDecision>)> = Vec::new();
    for d in counted {
        let agreed = match d.verdict {
            v1::Verdict::Edit => d.arguments.clone().unwrap_or_default(),
            _ => spec.arguments.clone(),
        };
        match groups.iter_mut().find(|(args, _)| *args == agreed) {
            Some((_, members)) if !members.iter().any(|m| m.approver == d.approver) => {
                members.push(d)
            }
            Some(_) => {}
            None => groups.push((agreed, vec![d])),
        }
    }
    let required = spec.required_approvals.max(1) as usize;
    let most = groups.iter().map(|(_, m)| m.len()).max().unwrap_or(0);
    match groups.into_iter().find(|(_, m)| m.len() >= required) {
        Some((arguments, decisions)) => Evaluation::Decided {
            verdict: if arguments == spec.arguments {
                Verdict::Approve
            } else {
                Verdict::Edit
            },
            decisions,
            arguments: Some(arguments),
        },
        None => Evaluation::Pending {
            expires_at: spec.expires_at.0,
            approvals: most,
        },
    }
}

/// Whether a decision on a budget question gives limits that read (or
/// is no edit at all).
pub(super) fn budget_edit_reads(d: &crate::api::Decision) -> bool {
    d.verdict != ApiVerdict::Edit
        || d.arguments
            .as_ref()
            .is_some_and(|a| crate::runlog::budget::Limits::parse(a).is_ok())
}

/// The Approval's state for its status.
pub fn state_of(evaluation: &Evaluation, on_expiry: OnExpiry) -> ApprovalState {
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
        Evaluation::Expired if on_expiry == OnExpiry::Escalate => ApprovalState::Escalated,
        Evaluation::Expired => ApprovalState::Expired,
    }
}

/// The arguments an expired request's `onExpiry: Alternative` may run: the
/// agent's alternative, classified by the pinned policy like any call. A
/// gated alternative never runs unapproved: the request settles back to the
/// agent (`None`), which may propose it as a call of its own, gated then.
pub fn alternative_to_run(
    log: &RunState,
    request_seq: u64,
    request: &ApprovalRequested,
) -> Result<Option<Value>, String> {
    let Some(alternative) = &request.alternative else {
        return Ok(None);
    };
    // An alternative carries no alternative of its own.
    let (arguments, _) = crate::policy::split_alternative(alternative);
    match super::pinned_gate::classify_at(log, request_seq, &request.tool, &arguments) {
        Classification::Allow => Ok(Some(arguments)),
        Classification::RequireApproval(gate) => Err(format!(
            "the alternative {} {arguments} needs approval itself ({}); it was not run",
            request.tool, gate.because
        )),
    }
}

/// The decision recorded for the request at `request_seq`, if any.
pub(super) fn decided(log: &RunState, request_seq: u64) -> Option<ApprovalDecided> {
    log.records_from(request_seq).find_map(|(_, s)| match s {
        Entry::ApprovalDecided(d) if d.request_seq == request_seq => Some(d.clone()),
        _ => None,
    })
}

/// The end of a run whose approval request does not match the pinned policy.
pub(super) fn refused(
    request: &ApprovalRequested,
    request_seq: u64,
    reason: &str,
    log: &RunState,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> RunFinished {
    let error = format!(
        "the approval request at log record {request_seq} ({}) was refused: {reason}; the call was not made",
        request.tool
    );
    notices.push(notice(true, "ApprovalRequestRefused", error.clone()));
    RunFinished {
        outcome: crate::runlog::records::Outcome::Failed,
        result: log.last_text(),
        error: Some(error),
    }
}

/// Largest Approval the controller raises, as JSON: a third of the API
/// server's 1.5 MiB object limit, leaving room for approvers' decisions
/// (an edit repeats the arguments) and the status.
pub const MAX_APPROVAL_BYTES: usize = 512 << 10;

/// Whether `approval` is small enough to raise; the error names its size.
pub fn fits_in_the_api(approval: &Approval) -> Result<(), String> {
    let size = serde_json::to_vec(approval).map_or(usize::MAX, |v| v.len());
    if size <= MAX_APPROVAL_BYTES {
        return Ok(());
    }
    Err(format!(
        "its Approval would be {size} bytes (arguments {} bytes), over the limit of {MAX_APPROVAL_BYTES} bytes an Approval may have",
        serde_json::to_vec(&approval.spec.arguments).map_or(0, |v| v.len())
    ))
}

/// Label an Approval carries with its run's name (every release has set it).
pub(super) const RUN_LABEL: &str = "agentrun.dev/run";

/// Whether `a` was raised by the run with `uid` for the request at
/// `request_seq`: controlled by that run, for that step and exactly that
/// call. Whether its decisions count is judged after, as for any Approval.
pub(super) fn raised_for(
    a: &Approval,
    uid: &str,
    request_seq: u64,
    request: &ApprovalRequested,
) -> bool {
    let controlled = a
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == uid);
    controlled
        && a.spec.run_ref.uid.as_deref() == Some(uid)
        && a.spec.step == request_seq
        && a.spec.tool == request.tool
        && a.spec.arguments_hash == request.arguments_hash
}

/// What the Approval as found says, judged (pure).
pub(super) struct Judged {
    pub(super) evaluation: Evaluation,
    pub(super) state: ApprovalState,
    /// The Approval's status does not show `state` yet.
    pub(super) status_behind: bool,
    /// The decision to record, if the approval is decided or expired.
    pub(super) record: Option<ApprovalDecided>,
}

/// Judges the Approval found against the one the request implies: only the
/// exact Approval of this request, owned by this run, decides, as of the
/// time the API server recorded its decisions.
#[allow(clippy::too_many_arguments)]
pub(super) fn judge(
    expected: &Approval,
    found: &Approval,
    request: &ApprovalRequested,
    log: &RunState,
    request_seq: u64,
    name: &str,
    now: Timestamp,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> Judged {
    let wrong = mismatches(expected, found);
    let bound = wrong.is_empty();
    if !bound {
        notices.push(notice(
            true,
            "ApprovalMismatch",
            format!(
                "{name} is not the Approval of the request at log record {request_seq}; its decisions are not acted on: {}",
                wrong.join("; ")
            ),
        ));
    }
    let mut spec = expected.spec.clone();
    if bound {
        spec.decisions = found.spec.decisions.clone();
    }
    let evaluation = evaluate_as_recorded(&spec, bound.then_some(found), now);
    let state = state_of(&evaluation, spec.on_expiry);
    let status_behind = bound && found.status.as_ref().and_then(|s| s.state) != Some(state);
    let record = decision_record(&evaluation, &spec, request, log, request_seq, name, notices);
    Judged {
        evaluation,
        state,
        status_behind,
        record,
    }
}

/// Judges the decisions at the time the API server recorded them: a
/// quorum complete before `expiresAt` is honoured even if the controller
/// (down, or slow) only looks after it. The write time is the latest
/// `managedFields` entry owning `spec.decisions`, which the API server
/// stamps; later decisions move it past the expiry and are judged now.
pub fn evaluate_as_recorded(
    spec: &ApprovalSpec,
    found: Option<&Approval>,
    now: Timestamp,
) -> Evaluation {
    let written = found.and_then(decisions_written_at);
    match written {
        Some(at) if at < now => match evaluate(spec, at) {
            decided @ Evaluation::Decided { .. } => decided,
            _ => evaluate(spec, now),
        },
        _ => evaluate(spec, now),
    }
}

/// When the API server last recorded a change to `spec.decisions`.
pub(super) fn decisions_written_at(approval: &Approval) -> Option<Timestamp> {
    approval
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.pointer("/f:spec/f:decisions").is_some())
        })
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
}

/// The `ApprovalDecided` an evaluation amounts to (`None` while pending),
/// with its notices.
pub(super) fn decision_record(
    evaluation: &Evaluation,
    spec: &ApprovalSpec,
    request: &ApprovalRequested,
    log: &RunState,
    request_seq: u64,
    name: &str,
    notices: &mut Vec<crate::controller::context::Notice>,
) -> Option<crate::runlog::records::ApprovalDecided> {
    use crate::runlog::records::ApprovalDecided;
    let observations_hash = crate::store::sha256_hex(&crate::store::canonical_json(
        &serde_json::to_value(&spec.observations).unwrap_or_default(),
    ));
    Some(match evaluation.clone() {
        Evaluation::Pending { .. } => return None,
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
                approval: name.to_string(),
                verdict,
                decisions,
                arguments,
                observations_hash,
                on_expiry: None,
            }
        }
        Evaluation::Expired => {
            let on_expiry = spec.on_expiry;
            notices.push(notice(
                true,
                "ApprovalExpired",
                format!("{name} expired without a decision; onExpiry: {on_expiry:?}"),
            ));
            let arguments = match on_expiry {
                OnExpiry::Alternative => match alternative_to_run(log, request_seq, request) {
                    Ok(args) => args,
                    Err(why) => {
                        notices.push(notice(true, "AlternativeNeedsApproval", why));
                        None
                    }
                },
                _ => None,
            };
            ApprovalDecided {
                request_seq,
                approval: name.to_string(),
                verdict: Verdict::Expired,
                decisions: Vec::new(),
                arguments,
                observations_hash,
                on_expiry: Some(on_expiry.into()),
            }
        }
    })
}
