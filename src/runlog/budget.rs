//! Budgets that ask (`budgets.onExhausted: Ask`): when the next step would
//! pass a budget, the run records a question (`ApprovalRequested` of kind
//! `Budget`, tool `budget`, arguments = the limits to go on with) and waits.
//! An approval raises the limits from then on; they are read back from the
//! log like the spending they cap, so a raise holds across every resume.
//! A reject, or silence until expiry, ends the run `BudgetExceeded`: expiry
//! never raises a budget.

use crate::refusal::Refusal;
use serde_json::{Map, Value};

use super::records::{ApprovalDecided, ApprovalRequested, Outcome, Verdict};
use super::v1::ApprovalKind;
use crate::api::{BUDGET_TOOL, Budgets, OnExhausted};

/// The budget questions of a run, folded from its log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BudgetQuestions {
    /// The latest question: its seq and, once decided, the verdict.
    latest: Option<(u64, Option<Verdict>)>,
    /// Every raise granted, in order (kept in force across compaction:
    /// [`BudgetQuestions::pinned_before`]).
    granted: Vec<Grant>,
}

/// A question granted: its seq, its decision's seq, the limits given.
#[derive(Clone, Debug, PartialEq)]
struct Grant {
    request: u64,
    decision: u64,
    limits: Limits,
}

/// Limits given by an approver; `None` leaves the agent's in force.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Limits {
    pub max_steps: Option<u64>,
    pub max_tokens: Option<u64>,
    pub max_cost_usd: Option<f64>,
}

impl Limits {
    /// Reads the limits an approver gave: `maxSteps`/`maxTokens` positive
    /// integers, `maxCostUSD` a positive number. `Err` names the field.
    pub fn parse(arguments: &Value) -> Result<Limits, Refusal> {
        let Value::Object(map) = arguments else {
            return Err("arguments: must be an object of limits".into());
        };
        if map.is_empty() {
            return Err(
                "arguments: give at least one limit (maxSteps, maxTokens or maxCostUSD)".into(),
            );
        }
        let mut limits = Limits::default();
        for (key, value) in map {
            match key.as_str() {
                "maxSteps" => limits.max_steps = Some(positive_int(key, value)?),
                "maxTokens" => limits.max_tokens = Some(positive_int(key, value)?),
                "maxCostUSD" => match value.as_f64() {
                    Some(v) if v > 0.0 && v.is_finite() => limits.max_cost_usd = Some(v),
                    _ => {
                        return Err(
                            format!("arguments.{key}: must be a number greater than 0").into()
                        );
                    }
                },
                other => {
                    return Err(format!(
                        "arguments.{other}: not a budget (maxSteps, maxTokens or maxCostUSD)"
                    )
                    .into());
                }
            }
        }
        Ok(limits)
    }

    fn to_json(&self) -> Value {
        let mut map = Map::new();
        if let Some(v) = self.max_steps {
            map.insert("maxSteps".into(), v.into());
        }
        if let Some(v) = self.max_tokens {
            map.insert("maxTokens".into(), v.into());
        }
        if let Some(v) = self.max_cost_usd {
            map.insert("maxCostUSD".into(), v.into());
        }
        Value::Object(map)
    }

    fn merge(&mut self, other: Limits) {
        self.max_steps = other.max_steps.or(self.max_steps);
        self.max_tokens = other.max_tokens.or(self.max_tokens);
        self.max_cost_usd = other.max_cost_usd.or(self.max_cost_usd);
    }
}

fn positive_int(key: &str, value: &Value) -> Result<u64, Refusal> {
    value.as_u64().filter(|v| *v > 0).ok_or_else(|| {
        Refusal::new(format!(
            "arguments.{key}: must be an integer greater than 0"
        ))
    })
}

impl BudgetQuestions {
    /// Folds a request (`seq`): a new budget question.
    pub fn requested(&mut self, seq: u64, request: &ApprovalRequested) {
        if request.kind == ApprovalKind::Budget {
            self.latest = Some((seq, None));
        }
    }

    /// Folds a decision (`seq`): an approval of the latest question raises
    /// the limits it gives (limits that do not read are no raise).
    pub fn decided(&mut self, seq: u64, decided: &ApprovalDecided) {
        let Some((request_seq, verdict)) = &mut self.latest else {
            return;
        };
        if *request_seq != decided.request_seq || verdict.is_some() {
            return;
        }
        *verdict = Some(decided.verdict);
        if matches!(decided.verdict, Verdict::Approve | Verdict::Edit)
            && let Some(Ok(limits)) = decided.arguments.as_ref().map(Limits::parse)
        {
            self.granted.push(Grant {
                request: *request_seq,
                decision: seq,
                limits,
            });
        }
    }

    /// The budgets in force: the agent's, with every raise applied.
    pub fn effective(&self, budgets: Option<&Budgets>) -> Option<Budgets> {
        self.effective_before(budgets, u64::MAX)
    }

    /// The budgets in force at record `seq`: the agent's, with the raises
    /// decided before it.
    pub fn effective_before(&self, budgets: Option<&Budgets>, seq: u64) -> Option<Budgets> {
        self.effective_between(budgets, 0, seq)
    }

    /// The budgets in force at record `seq` with only the raises decided
    /// at or after `from` (a fork counting from its start: the parent's
    /// raises were for the parent's spending, which the fork does not count).
    pub fn effective_between(
        &self,
        budgets: Option<&Budgets>,
        from: u64,
        seq: u64,
    ) -> Option<Budgets> {
        let mut raised = Limits::default();
        for grant in self
            .granted
            .iter()
            .filter(|g| g.decision >= from && g.decision < seq)
        {
            raised.merge(grant.limits.clone());
        }
        let mut b = budgets?.clone();
        if let Some(v) = raised.max_steps {
            b.max_steps = Some(v);
        }
        if let Some(v) = raised.max_tokens {
            b.max_tokens = Some(v);
        }
        if let Some(v) = raised.max_cost_usd {
            b.max_cost_usd = Some(v);
        }
        Some(b)
    }

    /// What the latest question says about going on: wait for it, or end
    /// the run (rejected or expired); `None` once granted (or never asked).
    pub fn next(&self) -> Option<Answer> {
        let (request_seq, verdict) = self.latest?;
        match verdict {
            None => Some(Answer::Waiting { request_seq }),
            Some(Verdict::Approve | Verdict::Edit) => None,
            Some(Verdict::Reject) => Some(Answer::End {
                outcome: Outcome::BudgetExceeded,
                error: format!(
                    "the budget was not raised: the budget question at log record {request_seq} was rejected"
                ),
            }),
            Some(Verdict::Expired) => Some(Answer::End {
                outcome: Outcome::BudgetExceeded,
                error: format!(
                    "the budget question at log record {request_seq} expired; expiry never raises a budget"
                ),
            }),
        }
    }

    /// The seqs before `start` that must stay in force for the raises to
    /// hold: every granted question and its decision.
    pub fn pinned_before(&self, start: u64) -> impl Iterator<Item = u64> + '_ {
        self.granted
            .iter()
            .flat_map(|g| [g.request, g.decision])
            .filter(move |seq| *seq < start)
    }
}

/// What a budget question says about going on.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Waiting { request_seq: u64 },
    End { outcome: Outcome, error: String },
}

/// Whether the agent asks, rather than fails, when a budget runs out.
pub fn asks(budgets: Option<&Budgets>) -> bool {
    budgets.is_some_and(|b| b.on_exhausted == OnExhausted::Ask)
}

/// The limits proposed to an approver: each budget used up gets its
/// original size again on top of its limit now; the others stay as they are.
pub fn proposal(agent: Option<&Budgets>, now: &Budgets, spent: Used) -> Value {
    let original = agent.cloned().unwrap_or_default();
    let mut limits = Limits::default();
    if let Some(max) = now.max_steps.filter(|max| spent.steps >= *max) {
        limits.max_steps = Some(max.saturating_add(original.max_steps.unwrap_or(max)));
    }
    if let Some(max) = now.max_tokens.filter(|max| spent.tokens >= *max) {
        limits.max_tokens = Some(max.saturating_add(original.max_tokens.unwrap_or(max)));
    }
    if let Some(max) = now.max_cost_usd.filter(|max| spent.cost_usd >= *max) {
        limits.max_cost_usd = Some(max + original.max_cost_usd.unwrap_or(max));
    }
    limits.to_json()
}

/// What a run has used of its budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Used {
    pub steps: u64,
    pub tokens: u64,
    pub cost_usd: f64,
}

/// Which budget `used` has used up, in words (`None`: none is): what the
/// runner checks before another model call, and the controller before it
/// raises a budget question.
pub fn exhausted(b: &Budgets, used: Used) -> Option<String> {
    if let Some(max) = b.max_tokens.filter(|max| used.tokens >= *max) {
        return Some(format!(
            "token budget used up: {} of {max} tokens",
            used.tokens
        ));
    }
    if let Some(max) = b.max_cost_usd.filter(|max| used.cost_usd >= *max) {
        return Some(format!(
            "cost budget used up: ${:.4} of ${max}",
            used.cost_usd
        ));
    }
    if let Some(max) = b.max_steps.filter(|max| used.steps >= *max) {
        return Some(format!(
            "step budget used up: {} of {max} steps",
            used.steps
        ));
    }
    None
}

/// What was used of each budget there is, in words.
pub fn usage(b: &Budgets, used: Used) -> String {
    let mut parts = Vec::new();
    if let Some(max) = b.max_steps {
        parts.push(format!("{} of {max} steps", used.steps));
    }
    if let Some(max) = b.max_tokens {
        parts.push(format!("{} of {max} tokens", used.tokens));
    }
    if let Some(max) = b.max_cost_usd {
        parts.push(format!("${:.4} of ${max}", used.cost_usd));
    }
    if parts.is_empty() {
        "no budget is set".into()
    } else {
        parts.join(", ")
    }
}

/// The tool a budget question names.
pub fn is_budget_tool(tool: &str) -> bool {
    tool == BUDGET_TOOL
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn limits_name_the_field_that_does_not_read() {
        assert_eq!(
            Limits::parse(&json!({"maxSteps": 15})).unwrap().max_steps,
            Some(15)
        );
        for (bad, field) in [
            (json!({"maxSteps": 0}), "arguments.maxSteps"),
            (json!({"maxSteps": "lots"}), "arguments.maxSteps"),
            (json!({"maxCostUSD": -1}), "arguments.maxCostUSD"),
            (json!({"deadline": "1h"}), "arguments.deadline"),
            (json!([1]), "arguments"),
            (json!({}), "arguments"),
        ] {
            let e = Limits::parse(&bad).unwrap_err();
            assert!(e.starts_with(field), "{bad}: {e}");
        }
    }

    #[test]
    fn a_proposal_raises_only_what_is_used_up_by_its_original_size() {
        let agent = Budgets {
            max_steps: Some(10),
            max_tokens: Some(1000),
            ..Default::default()
        };
        let now = Budgets {
            max_steps: Some(15),
            ..agent.clone()
        };
        let spent = Used {
            steps: 15,
            tokens: 200,
            cost_usd: 0.0,
        };
        assert_eq!(proposal(Some(&agent), &now, spent), json!({"maxSteps": 25}));
    }
}
