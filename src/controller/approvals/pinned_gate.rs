//! An `ApprovalRequested` record is written by a step pod (or whoever holds
//! its per-run credential), so the gate it carries is a claim, not a fact.
//! Before raising an Approval the controller recomputes the gate from the
//! policy pinned in the log (`RunStarted`/`VersionChanged`) and refuses a
//! request whose gate differs or whose call the policy would not gate.
//!
//! A platform rule matches a call by where its host leads, which the step
//! pod learned by looking names up (docs/endpoints.md). The controller
//! takes the pod's gate when the host's spelling alone gives it, and else
//! looks the same names up itself: a gate is accepted only as the policy
//! gives it on one of those two views, never on the pod's word.

use crate::refusal::Refusal;
use serde_json::Value;

use crate::api::AgentTemplate;
use crate::policy::split_alternative;
use crate::policy::{Call, Classification, Gate, Network, arguments_hash};
use crate::replay::{Entry, RunState};
use crate::runlog::budget::Limits;
use crate::runlog::records::{ApprovalRequested, Verdict};
use crate::runlog::v1::{ApprovalKind, OnExpiry};

/// The agent in force at `seq`: the latest `RunStarted` or `VersionChanged` before it.
pub fn pinned_agent(log: &RunState, seq: u64) -> Option<AgentTemplate> {
    log.agent_at(seq).cloned()
}

/// The namespace the run's step pods resolve names in.
fn namespace(log: &RunState) -> &str {
    log.snapshot.as_ref().map_or("", |s| s.namespace.as_str())
}

/// How the pinned agent classifies `tool` with `args` at `seq`, with no
/// lookups: any name may lead anywhere, so a gate that what a name resolves
/// to could trigger applies (what runs unasked on this answer is what no
/// lookup could have gated).
pub fn classify_at(log: &RunState, seq: u64, tool: &str, args: &Value) -> Classification {
    classify_on(log, seq, tool, args, &Network::unresolved(namespace(log)))
}

/// How the pinned agent classifies `tool` with `args` at `seq` on `network`.
fn classify_on(
    log: &RunState,
    seq: u64,
    tool: &str,
    args: &Value,
    network: &Network,
) -> Classification {
    log.classify_at(seq, tool, args, network)
}

/// The names the classification of the request at `request_seq` depends on.
fn lookups(log: &RunState, request_seq: u64) -> Vec<String> {
    let (Some(Entry::ApprovalRequested(request)), Some(agent)) =
        (log.entry(request_seq), pinned_agent(log, request_seq))
    else {
        return Vec::new();
    };
    let ns = namespace(log);
    let target = Call::of(&agent, &request.tool, &Network::of(ns)).target;
    crate::policy::lookups(agent.approval.as_ref(), &target, ns)
}

/// The request that follows `request` when it expires under `onExpiry: Escalate`.
pub fn escalated(request: &ApprovalRequested) -> ApprovalRequested {
    let mut next = request.clone();
    next.escalation += 1;
    if let Some(to) = &request.gate.escalate_to {
        next.gate.approvers = to.clone();
    }
    next
}

/// Checks the request at `request_seq` against the pinned policy and the log:
/// returns the request as the controller vouches for it (its gate the one
/// the pinned policy gives, worded by the controller, never the pod's prose);
/// on the host's spellings first, then, when that differs and names matter,
/// on what they resolve to now. `Err` says which field is wrong and why.
pub async fn check(log: &RunState, request_seq: u64) -> Result<ApprovalRequested, Refusal> {
    let ns = namespace(log);
    let spelled = check_on(log, request_seq, &Network::of(ns));
    let names = lookups(log, request_seq);
    if spelled.is_ok() || names.is_empty() {
        return spelled;
    }
    check_on(log, request_seq, &crate::dns::network(ns, names).await)
}

/// [`check`] on `network`.
pub fn check_on(
    log: &RunState,
    request_seq: u64,
    network: &Network,
) -> Result<ApprovalRequested, Refusal> {
    let Some(Entry::ApprovalRequested(request)) = log.entry(request_seq) else {
        return Err(format!("record {request_seq} is not an ApprovalRequested").into());
    };
    let hash = arguments_hash(&request.tool, &request.arguments);
    if request.arguments_hash != hash {
        return Err(format!(
            "argumentsHash {} is not the hash of its tool and arguments ({hash})",
            request.arguments_hash
        )
        .into());
    }
    if request.escalation > 0 {
        return check_escalation(log, request_seq, request, network);
    }
    let expected = match request.kind {
        ApprovalKind::Call => expected_call_gate(log, request_seq, request, network)?,
        ApprovalKind::Reconcile => expected_reconcile_gate(log, request_seq, request, network)?,
        ApprovalKind::Budget => expected_budget_gate(log, request_seq, request)?,
    };
    // `because` is prose, not policy: the step pod's wording is not
    // compared (it may change between versions without failing the runs
    // waiting on an approval), and not shown either: the controller's is.
    let mut compared = expected.clone();
    compared.because = request.gate.because.clone();
    let differences = gate_differences(&request.gate, &compared);
    if !differences.is_empty() {
        return Err(format!(
            "its gate is not the one the pinned policy gives {}: {}",
            request.tool,
            differences.join("; ")
        )
        .into());
    }
    Ok(ApprovalRequested {
        gate: expected,
        ..request.clone()
    })
}

/// A call's gate: the model proposed exactly this call, and the policy gates it.
fn expected_call_gate(
    log: &RunState,
    request_seq: u64,
    request: &ApprovalRequested,
    network: &Network,
) -> Result<Gate, Refusal> {
    let proposed = match log.entry(request.model_call_seq) {
        Some(Entry::ModelCall(m)) if request.model_call_seq < request_seq => {
            m.response.tool_calls.get(request.call_index)
        }
        _ => None,
    };
    let Some(proposed) = proposed else {
        return Err(format!(
            "modelCallSeq {} / callIndex {} name no call the model proposed",
            request.model_call_seq, request.call_index
        )
        .into());
    };
    let (arguments, alternative) = split_alternative(&proposed.arguments);
    if proposed.name != request.tool
        || proposed.id != request.call_id
        || arguments != request.arguments
        || alternative != request.alternative
    {
        return Err(format!(
            "tool and arguments are not the call the model proposed at record {} ({})",
            request.model_call_seq, proposed.name
        )
        .into());
    }
    match classify_on(log, request_seq, &request.tool, &request.arguments, network) {
        Classification::RequireApproval(gate) => Ok(*gate),
        Classification::Allow => Err(format!(
            "the pinned policy does not gate this {} call: nothing asked for an approval",
            request.tool
        )
        .into()),
    }
}

/// A budget request's gate: the pinned agent asks when its budget runs
/// out, the log shows one used up where the question was recorded, and
/// the limits asked for are the ones the agent's `onExhausted: Ask`
/// proposes there (a question is the step pod's word; what was spent is
/// the log's). The gate says, in the controller's words, what is used up.
fn expected_budget_gate(
    log: &RunState,
    request_seq: u64,
    request: &ApprovalRequested,
) -> Result<Gate, Refusal> {
    if request.tool != crate::api::BUDGET_TOOL {
        return Err(format!(
            "a budget question names tool {}, not {}",
            request.tool,
            crate::api::BUDGET_TOOL
        )
        .into());
    }
    let asked = Limits::parse(&request.arguments)?;
    let agent = pinned_agent(log, request_seq).unwrap_or_default();
    let mut gate = crate::policy::budget_gate(&agent).ok_or_else(|| {
        "the pinned agent does not ask when its budget runs out (budgets.onExhausted is not Ask)"
            .to_string()
    })?;
    let (why, proposal) = log.budget_question_due(request_seq)?;
    let due = Limits::parse(&proposal)?;
    if asked != due {
        return Err(format!(
            "arguments {} are not the limits the pinned budgets propose at record {request_seq} ({proposal})",
            request.arguments
        ).into());
    }
    gate.because = why;
    Ok(gate)
}

/// A reconcile request's gate: about an intent recorded for this very call.
fn expected_reconcile_gate(
    log: &RunState,
    request_seq: u64,
    request: &ApprovalRequested,
    network: &Network,
) -> Result<Gate, Refusal> {
    let intent = match request.intent_seq {
        Some(i) if i < request_seq => match log.entry(i) {
            Some(Entry::ToolIntent(intent)) => Some(intent),
            _ => None,
        },
        _ => None,
    };
    let Some(intent) = intent.filter(|i| {
        i.tool == request.tool
            && i.arguments == request.arguments
            && i.model_call_seq == request.model_call_seq
            && i.call_index == request.call_index
    }) else {
        return Err(format!(
            "intentSeq {:?} names no recorded intent to call {} with these arguments",
            request.intent_seq, request.tool
        )
        .into());
    };
    let intent_seq = request.intent_seq.unwrap_or_default();
    // Whether a call the policy gates happened is asked only of one it let run.
    if let Some(why) = log.unapproved_intent(intent_seq, intent) {
        return Err(why.into());
    }
    let agent = pinned_agent(log, request_seq).unwrap_or_default();
    let call = Call::of(&agent, &intent.tool, network);
    let mut gate = crate::policy::reconcile_gate(agent.approval.as_ref(), &call, &intent.arguments)
        .ok_or_else(|| {
            "the pinned policy names nobody who could reconcile this call".to_string()
        })?;
    gate.because = format!(
        "the outcome of the {} call intended at record {intent_seq} cannot be checked",
        intent.tool
    );
    Ok(gate)
}

/// An escalation is exactly the expired request, passed on, within its limit.
fn check_escalation(
    log: &RunState,
    request_seq: u64,
    request: &ApprovalRequested,
    network: &Network,
) -> Result<ApprovalRequested, Refusal> {
    let previous = log
        .records()
        .take_while(|(seq, _)| *seq < request_seq)
        .filter_map(|(seq, s)| match s {
            Entry::ApprovalRequested(r)
                if r.model_call_seq == request.model_call_seq
                    && r.call_index == request.call_index
                    && r.kind == request.kind =>
            {
                Some((seq, r))
            }
            _ => None,
        })
        .last();
    let Some((prev_seq, prev)) = previous else {
        return Err(format!(
            "escalation {} follows no earlier request for this call",
            request.escalation
        )
        .into());
    };
    let expired_into_escalation = log
        .records_from(prev_seq)
        .take_while(|(seq, _)| *seq < request_seq)
        .any(|(_, s)| {
            matches!(s, Entry::ApprovalDecided(d) if d.request_seq == prev_seq
                && d.verdict == Verdict::Expired
                && d.on_expiry == Some(OnExpiry::Escalate))
        });
    if !expired_into_escalation {
        return Err(format!(
            "escalation {}: the request at record {prev_seq} did not expire into an escalation",
            request.escalation
        )
        .into());
    }
    if prev.escalation >= prev.gate.max_escalations {
        return Err(format!(
            "escalation {} exceeds maxEscalations {}",
            request.escalation, prev.gate.max_escalations
        )
        .into());
    }
    if *request != escalated(prev) {
        return Err(format!(
            "escalation {} is not the request at record {prev_seq} passed on to escalateTo",
            request.escalation
        )
        .into());
    }
    check_on(log, prev_seq, network).map(|vouched| escalated(&vouched))
}

/// The gate fields that differ, each naming the recorded and the pinned value.
pub fn gate_differences(recorded: &Gate, expected: &Gate) -> Vec<String> {
    let (Value::Object(r), Value::Object(e)) = (
        serde_json::to_value(recorded).unwrap_or_default(),
        serde_json::to_value(expected).unwrap_or_default(),
    ) else {
        return vec!["the gate does not serialize".into()];
    };
    let mut keys: Vec<&String> = r.keys().chain(e.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| r.get(*k) != e.get(*k))
        .map(|k| {
            let show = |v: Option<&Value>| v.map_or("absent".to_string(), Value::to_string);
            format!(
                "gate.{k} is {}, the pinned policy says {}",
                show(r.get(k)),
                show(e.get(k))
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`super::check_on`] of a whole log, on the host's spellings.
    fn check(steps: &[Entry], request_seq: u64) -> Result<(), Refusal> {
        super::check_on(
            &RunState::replay(steps.to_vec()),
            request_seq,
            &Network::of("n"),
        )
        .map(|_| ())
    }

    /// [`super::classify_at`] in a whole log.
    fn classify_at(steps: &[Entry], seq: u64, tool: &str, args: &Value) -> Classification {
        super::classify_at(&RunState::replay(steps.to_vec()), seq, tool, args)
    }
    use crate::api::{ApprovalPolicy, ApprovalRule, Approvers};
    use crate::runlog::records::{ApprovalDecided, ModelCall, RunStarted, ToolIntent};
    use crate::runlog::v1::{ModelResponse, TokenUsage, ToolCall};
    use serde_json::json;

    fn agent() -> AgentTemplate {
        AgentTemplate {
            approval: Some(ApprovalPolicy {
                rules: vec![ApprovalRule {
                    name: "large-refund".into(),
                    tool: "issue_refund".into(),
                    when: Some("args.amount > 100".into()),
                    approvers: Approvers {
                        users: vec![],
                        groups: vec!["finance".into()],
                    },
                    required_approvals: 2,
                    expires_after: "10m".into(),
                    on_expiry: crate::api::OnExpiry::Escalate,
                    escalate_to: Some(Approvers {
                        users: vec!["boss".into()],
                        groups: vec![],
                    }),
                    max_escalations: 1,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn log(args: Value) -> Vec<Entry> {
        log_of(agent(), args)
    }

    fn log_of(agent: AgentTemplate, args: Value) -> Vec<Entry> {
        vec![
            Entry::RunStarted(RunStarted {
                container: None,
                run_name: "r".into(),
                namespace: "n".into(),
                input: "i".into(),
                agent: agent.into(),
                tools: vec![],
                mcp: Default::default(),
                versions: Default::default(),
            }),
            Entry::ModelCall(ModelCall {
                request: None,
                response: ModelResponse {
                    text: None,
                    tool_calls: vec![ToolCall {
                        id: "c0".into(),
                        name: "issue_refund".into(),
                        arguments: args,
                    }],
                    usage: TokenUsage::default(),
                    model_id: "m".into(),
                    stop_reason: None,
                },
                cost_usd: 0.0,
                context: Default::default(),
                attempts: None,
            }),
        ]
    }

    fn honest_request(steps: &[Entry], args: Value) -> ApprovalRequested {
        let Classification::RequireApproval(gate) = classify_at(steps, 2, "issue_refund", &args)
        else {
            panic!("gated")
        };
        ApprovalRequested {
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "issue_refund".into(),
            arguments_hash: arguments_hash("issue_refund", &args),
            arguments: args,
            reason: None,
            observations: vec![],
            dependencies: vec![],
            gate: *gate,
            escalation: 0,
            alternative: None,
            kind: ApprovalKind::Call,
            intent_seq: None,
        }
    }

    fn with(mut steps: Vec<Entry>, request: ApprovalRequested) -> Vec<Entry> {
        steps.push(Entry::ApprovalRequested(request));
        steps
    }

    #[test]
    fn an_honest_request_passes() {
        let steps = log(json!({"amount": 500}));
        let r = honest_request(&steps, json!({"amount": 500}));
        assert_eq!(check(&with(steps, r), 2), Ok(()));
    }

    #[test]
    fn a_weakened_gate_is_refused_naming_the_field() {
        let steps = log(json!({"amount": 500}));
        let mut r = honest_request(&steps, json!({"amount": 500}));
        r.gate.required_approvals = 1;
        r.gate.approvers.users = vec!["mallory".into()];
        let err = check(&with(steps, r), 2).unwrap_err();
        assert!(
            err.contains("gate.requiredApprovals is 1, the pinned policy says 2")
                && err.contains("gate.approvers"),
            "{err}"
        );
    }

    #[test]
    fn a_call_the_policy_does_not_gate_or_the_model_did_not_propose_is_refused() {
        let steps = log(json!({"amount": 50}));
        let mut r = honest_request(&log(json!({"amount": 500})), json!({"amount": 500}));
        r.arguments = json!({"amount": 50});
        r.arguments_hash = arguments_hash("issue_refund", &r.arguments);
        let err = check(&with(steps, r), 2).unwrap_err();
        assert!(err.contains("does not gate"), "{err}");

        let steps = log(json!({"amount": 500}));
        let r = honest_request(&steps, json!({"amount": 900}));
        let err = check(&with(steps, r), 2).unwrap_err();
        assert!(err.contains("not the call the model proposed"), "{err}");
    }

    #[test]
    fn a_hash_of_other_arguments_is_refused() {
        let steps = log(json!({"amount": 500}));
        let mut r = honest_request(&steps, json!({"amount": 500}));
        r.arguments_hash = "0".repeat(64);
        let err = check(&with(steps, r), 2).unwrap_err();
        assert!(err.contains("argumentsHash"), "{err}");
    }

    #[test]
    fn an_escalation_must_follow_an_expiry_and_stay_within_its_limit() {
        let steps = log(json!({"amount": 500}));
        let first = honest_request(&steps, json!({"amount": 500}));
        let steps = with(steps, first.clone());
        // Not expired: an escalation is a forgery.
        let err = check(&with(steps.clone(), escalated(&first)), 3).unwrap_err();
        assert!(err.contains("did not expire"), "{err}");
        let mut expired = steps.clone();
        expired.push(Entry::ApprovalDecided(ApprovalDecided {
            request_seq: 2,
            approval: "a".into(),
            verdict: Verdict::Expired,
            decisions: vec![],
            arguments: None,
            observations_hash: "o".into(),
            on_expiry: Some(OnExpiry::Escalate),
        }));
        let second = escalated(&first);
        assert_eq!(second.gate.approvers.users, vec!["boss".to_string()]);
        assert_eq!(check(&with(expired.clone(), second.clone()), 4), Ok(()));
        let mut forged = second.clone();
        forged.gate.approvers.users = vec!["mallory".into()];
        assert!(check(&with(expired.clone(), forged), 4).is_err());
        // maxEscalations is 1: a second escalation is refused.
        let mut twice = with(expired, second.clone());
        twice.push(Entry::ApprovalDecided(ApprovalDecided {
            request_seq: 4,
            approval: "b".into(),
            verdict: Verdict::Expired,
            decisions: vec![],
            arguments: None,
            observations_hash: "o".into(),
            on_expiry: Some(OnExpiry::Escalate),
        }));
        let err = check(&with(twice, escalated(&second)), 6).unwrap_err();
        assert!(err.contains("maxEscalations"), "{err}");
    }

    /// The refund of 500, approved by a decision of the controller's:
    /// records 2 (request) and 3 (decision).
    fn approved(steps: Vec<Entry>) -> Vec<Entry> {
        let request = honest_request(&steps, json!({"amount": 500}));
        let mut steps = with(steps, request);
        steps.push(Entry::ApprovalDecided(ApprovalDecided {
            request_seq: 2,
            approval: "a".into(),
            verdict: Verdict::Approve,
            decisions: vec![],
            arguments: Some(json!({"amount": 500})),
            observations_hash: "o".into(),
            on_expiry: None,
        }));
        steps
    }

    fn refund_intent() -> Entry {
        Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "issue_refund".into(),
            arguments: json!({"amount": 500}),
            key: "k".into(),
            sandboxed: None,
        })
    }

    #[test]
    fn a_reconcile_request_must_name_its_intent_and_fail_on_expiry() {
        let mut steps = approved(log(json!({"amount": 500})));
        steps.push(refund_intent());
        let mut r = honest_request(&steps, json!({"amount": 500}));
        r.kind = ApprovalKind::Reconcile;
        r.intent_seq = Some(4);
        r.gate.on_expiry = OnExpiry::Fail;
        r.gate.because = "unknown".into();
        let vouched = super::check_on(
            &RunState::replay(with(steps.clone(), r.clone())),
            5,
            &Network::of("n"),
        )
        .unwrap();
        assert!(
            vouched.gate.because.contains("record 4 cannot be checked"),
            "the controller's words, not the pod's: {:?}",
            vouched.gate.because
        );
        let mut lenient = r.clone();
        lenient.gate.on_expiry = OnExpiry::ReturnToAgent;
        assert!(check(&with(steps.clone(), lenient), 5).is_err());
        let mut nowhere = r;
        nowhere.intent_seq = Some(1);
        let err = check(&with(steps, nowhere), 5).unwrap_err();
        assert!(err.contains("intentSeq"), "{err}");
    }

    /// mallory (the run's step credential) records an intent to make the
    /// gated refund no one approved, then asks whether it happened: a "no"
    /// would make it now. The question is refused.
    #[test]
    fn a_reconcile_request_about_an_intent_no_one_approved_is_refused() {
        let mut steps = log(json!({"amount": 500}));
        steps.push(refund_intent());
        let mut r = honest_request(&steps, json!({"amount": 500}));
        r.kind = ApprovalKind::Reconcile;
        r.intent_seq = Some(2);
        r.gate.on_expiry = OnExpiry::Fail;
        let err = check(&with(steps, r), 3).unwrap_err();
        assert!(
            err.contains("record 2") && err.contains("no approval of exactly that call"),
            "{err}"
        );
    }

    /// A run that asks when its 100 steps are used up, 7 records in: a
    /// budget question is due only once they are, for what the pinned
    /// budgets propose (issue 39: mallory asked for 1,000,000 steps and
    /// $100,000 with 93 steps left).
    fn asking_run(records: u64) -> Vec<Entry> {
        let mut agent = agent();
        agent.budgets = Some(crate::api::Budgets {
            max_steps: Some(100),
            max_cost_usd: Some(5.0),
            on_exhausted: crate::api::OnExhausted::Ask,
            approvers: Some(Approvers {
                users: vec![],
                groups: vec!["finance".into()],
            }),
            ..Default::default()
        });
        let mut steps = log(json!({"amount": 50}));
        let Entry::RunStarted(started) = &mut steps[0] else {
            unreachable!()
        };
        started.agent = agent.into();
        while (steps.len() as u64) < records {
            steps.push(Entry::Observation(crate::runlog::records::Observation {
                text: "looked".into(),
                about_seq: None,
                stop: None,
                attempts: None,
            }));
        }
        steps
    }

    fn budget_question(steps: &[Entry], arguments: Value) -> ApprovalRequested {
        let agent: AgentTemplate = match &steps[0] {
            Entry::RunStarted(s) => s.agent.clone().into(),
            _ => unreachable!(),
        };
        let mut r = honest_request(&log(json!({"amount": 500})), json!({"amount": 500}));
        r.kind = ApprovalKind::Budget;
        r.tool = crate::api::BUDGET_TOOL.into();
        r.arguments_hash = arguments_hash(&r.tool, &arguments);
        r.arguments = arguments;
        r.gate = crate::policy::budget_gate(&agent).unwrap();
        r.gate.because = "the agent's own words".into();
        r.reason = Some("Approve this, it is urgent.".into());
        r
    }

    #[test]
    fn a_budget_question_with_budget_left_is_refused() {
        let steps = asking_run(7);
        let forged = budget_question(
            &steps,
            json!({"maxSteps": 1_000_000, "maxCostUSD": 100_000}),
        );
        let err = check(&with(steps.clone(), forged), 7).unwrap_err();
        assert!(
            err.contains("no budget is used up at record 7") && err.contains("7 of 100 steps"),
            "{err}"
        );
        // The limits an honest runner would propose are refused as well: nothing is used up.
        let modest = budget_question(&steps, json!({"maxSteps": 200}));
        assert!(check(&with(steps, modest), 7).is_err());
    }

    #[test]
    fn a_budget_question_is_raised_only_for_the_limits_the_log_implies() {
        let steps = asking_run(100);
        let honest = budget_question(&steps, json!({"maxSteps": 200}));
        let vouched = super::check_on(
            &RunState::replay(with(steps.clone(), honest)),
            100,
            &Network::of("n"),
        )
        .unwrap();
        assert_eq!(
            vouched.gate.because, "step budget used up: 100 of 100 steps",
            "the controller's words, not the pod's"
        );
        for greedy in [
            json!({"maxSteps": 1_000_000}),
            json!({"maxSteps": 200, "maxCostUSD": 100_000}),
        ] {
            let r = budget_question(&steps, greedy.clone());
            let err = check(&with(steps.clone(), r), 100).unwrap_err();
            assert!(
                err.contains("not the limits the pinned budgets propose") && err.contains("200"),
                "{greedy}: {err}"
            );
        }
    }

    /// The agent of a platform gate on `gated`, its refund tool at `url`.
    fn gated_agent(gated: &str, url: &str) -> AgentTemplate {
        serde_json::from_value(json!({
            "prompt": {"version": "v1", "system": "s"},
            "model": {"provider": "OpenAI", "name": "m"},
            "tools": [{"name": "issue_refund", "http": {"url": url}}],
            "approval": {"rules": [{
                "name": "AgentPolicy/finance/refunds", "tool": "*",
                "match": {"endpoints": [{"url": gated}]},
                "approvers": {"groups": ["finance"]}
            }]}
        }))
        .expect("agent")
    }

    /// The request a step pod that saw `network` writes.
    fn request_on(steps: &[Entry], network: &Network) -> ApprovalRequested {
        let args = json!({"amount": 5000});
        let Classification::RequireApproval(gate) = super::classify_on(
            &RunState::replay(steps.to_vec()),
            2,
            "issue_refund",
            &args,
            network,
        ) else {
            panic!("the pod's view gates the call")
        };
        ApprovalRequested {
            gate: *gate,
            ..honest_request(&log(args.clone()), args)
        }
    }

    #[test]
    fn a_gate_the_hosts_spelling_gives_is_accepted_without_lookups() {
        let steps = log_of(
            gated_agent(
                "http://127.0.0.1:9/refund",
                "http://[::ffff:127.0.0.1]:9/refund",
            ),
            json!({"amount": 5000}),
        );
        let request = request_on(&steps, &Network::of("n"));
        assert_eq!(check(&with(steps, request), 2), Ok(()));
    }

    #[test]
    fn a_gate_a_lookup_gives_is_accepted_only_on_the_same_lookup() {
        let steps = log_of(
            gated_agent(
                "http://10.96.0.12:9/refund",
                "http://alias.example:9/refund",
            ),
            json!({"amount": 5000}),
        );
        let mut pods_view = Network::of("n");
        pods_view
            .resolved
            .insert("alias.example".into(), vec!["10.96.0.12".parse().unwrap()]);
        let logged = RunState::replay(with(steps.clone(), request_on(&steps, &pods_view)));
        assert_eq!(super::check_on(&logged, 2, &pods_view).map(|_| ()), Ok(()));
        // Spelled, the host is not the gated address: the pod's word alone
        // raises nothing.
        let err = super::check_on(&logged, 2, &Network::of("n")).unwrap_err();
        assert!(err.contains("does not gate"), "{err}");
        // The names whose lookups decide: the tool's, the rule's is an address.
        assert_eq!(
            super::lookups(&logged, 2),
            vec!["alias.example", "alias.example.svc.cluster.local"]
        );
        // With no lookups, an alternative to the same call is gated: a name
        // may lead to the gated address.
        assert!(matches!(
            super::classify_at(&logged, 3, "issue_refund", &json!({"amount": 1})),
            Classification::RequireApproval(g) if g.rule == "AgentPolicy/finance/refunds"
        ));
    }

    /// The controller looks the names up itself when the spelling does not
    /// give the pod's gate (here the machine's own name, from its hosts file).
    #[tokio::test]
    async fn the_controller_looks_names_up_when_the_spelling_does_not_tell() {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let Some(ip) = crate::dns::lookup(&name).await.first().copied() else {
            eprintln!("this machine's name {name:?} does not resolve: nothing to look up");
            return;
        };
        let gated = format!("http://{}/refund", std::net::SocketAddr::new(ip, 9));
        let steps = log_of(
            gated_agent(&gated, &format!("http://{name}:9/refund")),
            json!({"amount": 5000}),
        );
        let agent = gated_agent(&gated, &format!("http://{name}:9/refund"));
        let target = Call::of(&agent, "issue_refund", &Network::of("n")).target;
        let names = crate::policy::lookups(agent.approval.as_ref(), &target, "n");
        let pods_view = crate::dns::network("n", names).await;
        let logged = RunState::replay(with(steps.clone(), request_on(&steps, &pods_view)));
        assert_eq!(super::check(&logged, 2).await.map(|_| ()), Ok(()));
    }
}
