//! Rebuilding a run's state from its log, and deciding the next step. Pure:
//! no model, no tool and no store is touched here, which is what makes
//! resuming after a crash the same code path as any other step.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::Budgets;
use crate::model::ToolCall;
use crate::refusal::Refusal;
use crate::runlog::budget::{self, Answer, BudgetQuestions};
use crate::runlog::records::*;
use crate::tools::FINISH_TOOL;

#[cfg(test)]
mod fuzz;

/// One decoded record.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    RunStarted(RunStarted),
    ModelCall(ModelCall),
    ToolIntent(ToolIntent),
    ToolResult(ToolResult),
    ApprovalRequested(ApprovalRequested),
    ApprovalDecided(ApprovalDecided),
    ApprovalVoided(ApprovalVoided),
    Observation(Observation),
    Summary(Summary),
    VersionChanged(VersionChanged),
    RunFinished(RunFinished),
    Forked(Forked),
}

/// A record whose payload does not decode: the log is from an unknown format
/// or was written by a bug. Replay stops rather than guess.
#[derive(Debug, thiserror::Error)]
#[error("record {seq} ({kind}) does not decode: {reason}")]
pub struct DecodeError {
    pub seq: u64,
    pub kind: String,
    pub reason: String,
}

impl Entry {
    /// Decodes a record's payload by its kind name.
    pub fn decode(seq: u64, kind: &str, payload: &Value) -> Result<Entry, DecodeError> {
        fn de<T: DeserializeOwned>(seq: u64, kind: &str, v: &Value) -> Result<T, DecodeError> {
            T::deserialize(v).map_err(|e| DecodeError {
                seq,
                kind: kind.into(),
                reason: e.to_string(),
            })
        }
        Ok(match kind {
            "RunStarted" => Entry::RunStarted(de(seq, kind, payload)?),
            "ModelCall" => Entry::ModelCall(de(seq, kind, payload)?),
            "ToolIntent" => Entry::ToolIntent(de(seq, kind, payload)?),
            "ToolResult" => Entry::ToolResult(de(seq, kind, payload)?),
            "ApprovalRequested" => Entry::ApprovalRequested(de(seq, kind, payload)?),
            "ApprovalDecided" => Entry::ApprovalDecided(de(seq, kind, payload)?),
            "ApprovalVoided" => Entry::ApprovalVoided(de(seq, kind, payload)?),
            "Observation" => Entry::Observation(de(seq, kind, payload)?),
            "Summary" => Entry::Summary(de(seq, kind, payload)?),
            "VersionChanged" => Entry::VersionChanged(de(seq, kind, payload)?),
            "RunFinished" => Entry::RunFinished(de(seq, kind, payload)?),
            "Forked" => Entry::Forked(de(seq, kind, payload)?),
            other => {
                return Err(DecodeError {
                    seq,
                    kind: other.into(),
                    reason: "unknown record kind".into(),
                });
            }
        })
    }

    /// The record kind name, as the store keeps it.
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::RunStarted(_) => "RunStarted",
            Entry::ModelCall(_) => "ModelCall",
            Entry::ToolIntent(_) => "ToolIntent",
            Entry::ToolResult(_) => "ToolResult",
            Entry::ApprovalRequested(_) => "ApprovalRequested",
            Entry::ApprovalDecided(_) => "ApprovalDecided",
            Entry::ApprovalVoided(_) => "ApprovalVoided",
            Entry::Observation(_) => "Observation",
            Entry::Summary(_) => "Summary",
            Entry::VersionChanged(_) => "VersionChanged",
            Entry::RunFinished(_) => "RunFinished",
            Entry::Forked(_) => "Forked",
        }
    }

    /// The record kind, as the store types it.
    pub fn store_kind(&self) -> crate::store::StepKind {
        let name = self.kind();
        crate::store::StepKind::ALL
            .into_iter()
            .find(|k| k.as_str() == name)
            .expect("every Entry kind is a StepKind")
    }

    /// The format its record is written in: format 2 when it holds what a
    /// container agent adds (`runlog::v2`), else format 1.
    pub fn format(&self) -> u32 {
        match self {
            Entry::ModelCall(c) if c.request.is_some() => crate::store::FORMAT_2,
            Entry::ToolIntent(i) if i.requested.is_some() => crate::store::FORMAT_2,
            Entry::RunStarted(s) if s.container.is_some() => crate::store::FORMAT_2,
            Entry::VersionChanged(v) if v.container.is_some() => crate::store::FORMAT_2,
            Entry::Observation(Observation {
                stop:
                    Some(RunFinished {
                        outcome: Outcome::Diverged,
                        ..
                    }),
                ..
            })
            | Entry::RunFinished(RunFinished {
                outcome: Outcome::Diverged,
                ..
            }) => crate::store::FORMAT_2,
            _ => crate::store::FORMAT_1,
        }
    }

    /// The draft of its record (kind, payload and format; the writer adds
    /// versions, usage and worker).
    pub fn draft(&self) -> crate::store::RecordDraft {
        crate::store::RecordDraft::new(self.store_kind(), self.payload()).in_format(self.format())
    }

    /// The payload as JSON.
    pub fn payload(&self) -> Value {
        let v = match self {
            Entry::RunStarted(p) => serde_json::to_value(p),
            Entry::ModelCall(p) => serde_json::to_value(p),
            Entry::ToolIntent(p) => serde_json::to_value(p),
            Entry::ToolResult(p) => serde_json::to_value(p),
            Entry::ApprovalRequested(p) => serde_json::to_value(p),
            Entry::ApprovalDecided(p) => serde_json::to_value(p),
            Entry::ApprovalVoided(p) => serde_json::to_value(p),
            Entry::Observation(p) => serde_json::to_value(p),
            Entry::Summary(p) => serde_json::to_value(p),
            Entry::VersionChanged(p) => serde_json::to_value(p),
            Entry::RunFinished(p) => serde_json::to_value(p),
            Entry::Forked(p) => serde_json::to_value(p),
        };
        v.expect("record payloads are plain data and always serialize")
    }
}

/// Totals summed from the log: every resume sees the same budget spent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Spent {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
}

impl Spent {
    /// Counts one record's spending (a `ModelCall`'s or a `Summary`'s).
    pub fn count(&mut self, step: &Entry) {
        match step {
            Entry::ModelCall(m) => self.add(&m.response.usage, m.cost_usd),
            Entry::Summary(s) => self.add(&s.response.usage, s.cost_usd),
            _ => {}
        }
    }

    /// What was spent since `before` was (a sum that went on from it).
    fn since(&self, before: &Spent) -> Spent {
        Spent {
            input_tokens: self.input_tokens.saturating_sub(before.input_tokens),
            output_tokens: self.output_tokens.saturating_sub(before.output_tokens),
            cost_usd: (self.cost_usd - before.cost_usd).max(0.0),
        }
    }

    /// Counts one model call. Its numbers come from the step pod's record
    /// (a model's own report): sums saturate rather than overflow, and a
    /// negative cost counts as none, so the total never goes down (nor
    /// becomes NaN, which no budget would stop).
    fn add(&mut self, usage: &crate::runlog::v1::TokenUsage, cost: f64) {
        self.input_tokens = self.input_tokens.saturating_add(usage.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(usage.output_tokens);
        self.cost_usd += cost.max(0.0);
    }
}

/// The agent a run executes now: `RunStarted`, or the latest `VersionChanged`,
/// converted from the stored types to the ones the runner and controller use.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub run_name: String,
    /// The run's namespace: where its step pods resolve names.
    pub namespace: String,
    pub input: String,
    pub agent: crate::api::AgentTemplate,
    pub tools: Vec<crate::model::ToolDef>,
    pub mcp: crate::tools::McpCatalog,
    pub versions: Versions,
}

/// A run rebuilt from its log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunState {
    /// Seq of `steps[0]`: the records before it were folded into the
    /// fields below and let go ([`RunState::compact`]); 0 for a whole log.
    base: u64,
    /// The records from `base` on, in order; `steps[i]` has seq `base + i`.
    steps: Vec<Entry>,
    pub snapshot: Option<Snapshot>,
    pub spent: Spent,
    pub finished: Option<RunFinished>,
    /// The latest summary and its seq.
    pub summary: Option<(u64, Summary)>,
    /// The agent in force from each seq on (`RunStarted`, then every
    /// `VersionChanged`): what the pinned policy was at any record.
    agents: Vec<(u64, crate::api::AgentTemplate)>,
    /// The latest non-empty text of a `ModelCall`, and its seq.
    last_text: Option<(u64, String)>,
    /// What the records before `base` spent, summed in order (so that it
    /// plus the rest, in order, is exactly `spent`).
    spent_before: Spent,
    /// The budget questions asked and the raises granted.
    budget: BudgetQuestions,
    /// Where a fork's budgets start counting: one per `Forked` record with
    /// `budget: FromFork` (a fork of a fork holds its parent's, copied).
    counted_from: Vec<CountFrom>,
    /// Every `Forked` record (a fork of a fork holds its parent's, copied,
    /// before its own): where the authority given before it stops
    /// ([`RunState::authority_from`]).
    forks: Vec<ForkMark>,
    /// A replay test's recorded calls, and the seq of the `Forked` record
    /// holding them (kept in force past a compaction or a checkpoint).
    test: Option<(u64, std::sync::Arc<crate::runlog::records::Sandbox>)>,
}

/// A fork's budgets count from the record after its `Forked` record (at
/// `forked`), and not what the records before it spent.
#[derive(Clone, Debug, Default, PartialEq)]
struct CountFrom {
    forked: u64,
    spent: Spent,
}

/// A `Forked` record, as far as authority goes: what was decided before it
/// was decided for another run (the parent), and authorizes no effect that
/// is new after it (DESIGN.md §11, "Authority stays with its run").
#[derive(Clone, Debug, PartialEq)]
struct ForkMark {
    seq: u64,
    /// A replay test's (`Forked.test`): its calls get the recorded decision
    /// by design and make none, so it cuts no decision off.
    test: bool,
    /// Whether it says what its budgets count (`Forked.budget`; a record
    /// written before the field carries its parent's raises, as it did).
    budget: bool,
}

/// Where one proposed tool call stands.
#[derive(Clone, Debug, PartialEq)]
pub enum CallState {
    /// Nothing recorded yet (or its approval was voided).
    Open,
    /// Waiting for the decision on the request at this seq.
    Pending(u64),
    /// Approved (request seq, arguments to run), not yet intended.
    Approved(u64, serde_json::Value),
    /// An intent is recorded: the call runs (or ran).
    Intended,
    /// Rejected, or expired back to the agent: it never runs.
    Settled,
}

/// What the runner should do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// The log has no `RunStarted`: the controller has not started the run.
    NotStarted,
    /// Ask the model (after the budget and compaction checks).
    CallModel,
    /// Record the intent to make call `call_index` of the ModelCall at `model_call_seq`.
    RecordIntent {
        model_call_seq: u64,
        call_index: usize,
        call: ToolCall,
    },
    /// Execute the tool call recorded at `intent_seq`, which has no result yet.
    ExecuteTool { intent_seq: u64, intent: ToolIntent },
    /// A human said whether the call at `intent_seq` (outcome unknowable) happened.
    Reconciled {
        intent_seq: u64,
        intent: ToolIntent,
        happened: bool,
        decided_seq: u64,
    },
    /// A request for approval waits for its decision: the controller's turn.
    AwaitApproval { request_seq: u64 },
    /// Approved (perhaps with edited arguments): re-check what it depends on,
    /// then record the intent to make it with `arguments`.
    Approved {
        request_seq: u64,
        request: Box<ApprovalRequested>,
        arguments: serde_json::Value,
    },
    /// A budget is used up and the agent asks (`onExhausted: Ask`): record
    /// a budget question, whose limits to go on with are `arguments`.
    AskBudget { reason: String, arguments: Value },
    /// The agent is done: append `RunFinished`.
    Finish {
        outcome: Outcome,
        result: Option<String>,
        /// Why the run ends early, when it does.
        error: Option<String>,
    },
    /// The runner recorded why it cannot go on (an `Observation` with
    /// `stop`): the controller appends this `RunFinished`.
    Stop(RunFinished),
    /// A container agent's turn: its step pod runs (or starts again and
    /// replays) until the agent ends, a gate, or a budget stops it.
    AgentTurn,
    /// `RunFinished` is recorded.
    Done,
}

impl RunState {
    /// Rebuilds the state from decoded records, in seq order.
    pub fn replay(steps: Vec<Entry>) -> RunState {
        let mut state = RunState::default();
        for step in steps {
            state.apply(step);
        }
        state
    }

    /// A state that starts at record `base`: the records before it are not
    /// held, only what they add up to (`spent`) and the few that stay in
    /// force (`pinned`: `RunStarted`, the latest `VersionChanged`, `Summary`
    /// and `ModelCall` with text before `base`, each with its seq), as a
    /// checkpoint keeps them. Fold the records from `base` on with `apply`.
    pub fn resume_at(base: u64, pinned: Vec<(u64, Entry)>, spent: Spent) -> RunState {
        let mut state = RunState::default();
        for (seq, step) in pinned {
            state.fold(seq, &step);
        }
        state.base = base;
        state.spent_before = spent.clone();
        state.spent = spent;
        state
    }

    /// Folds one more record into the state (used after each append, too).
    pub fn apply(&mut self, step: Entry) {
        let seq = self.len();
        self.fold(seq, &step);
        self.steps.push(step);
    }

    /// What record `seq` changes beyond being held.
    fn fold(&mut self, seq: u64, step: &Entry) {
        match step {
            Entry::RunStarted(s) => {
                self.agents = vec![(seq, s.agent_template())];
                self.snapshot = Some(Snapshot {
                    run_name: s.run_name.clone(),
                    namespace: s.namespace.clone(),
                    input: s.input.clone(),
                    agent: s.agent_template(),
                    tools: s.tools.iter().cloned().map(Into::into).collect(),
                    mcp: s.mcp.clone().into(),
                    versions: s.versions.clone(),
                })
            }
            Entry::VersionChanged(v) => {
                self.agents.push((seq, v.agent_template()));
                if let Some(snap) = &mut self.snapshot {
                    snap.agent = v.agent_template();
                    snap.tools = v.tools.iter().cloned().map(Into::into).collect();
                    snap.mcp = v.mcp.clone().into();
                    snap.versions = v.to.clone();
                }
            }
            Entry::ModelCall(m) => {
                self.spent.add(&m.response.usage, m.cost_usd);
                if let Some(text) = m.response.text.as_ref().filter(|t| !t.is_empty()) {
                    self.last_text = Some((seq, text.clone()));
                }
            }
            Entry::Summary(s) => {
                self.spent.add(&s.response.usage, s.cost_usd);
                self.summary = Some((seq, s.clone()));
            }
            Entry::RunFinished(f) => self.finished = Some(f.clone()),
            Entry::Forked(f) => self.forked(seq, f),
            Entry::ApprovalRequested(r) => self.budget.requested(seq, r),
            Entry::ApprovalDecided(d) => self.budget.decided(seq, d),
            _ => {}
        }
    }

    /// A fork's start: where its budgets count from, and whether it is a
    /// replay test (the last `Forked` of a log is its own: a fork of a test
    /// is no test).
    fn forked(&mut self, seq: u64, f: &Forked) {
        self.test = f.test.clone().map(|t| (seq, std::sync::Arc::new(t)));
        self.forks.push(ForkMark {
            seq,
            test: f.test.is_some(),
            budget: f.budget.is_some(),
        });
        if f.budget == Some(crate::api::ForkBudget::FromFork) {
            // The recorded sum: a state resumed from a checkpoint past
            // this record holds no prefix to sum (verify checks it).
            let spent = f.prefix_usage.as_ref().map_or_else(
                || self.spent.clone(),
                |u| Spent {
                    input_tokens: u.input_tokens,
                    output_tokens: u.output_tokens,
                    cost_usd: u.cost_usd,
                },
            );
            self.counted_from.push(CountFrom { forked: seq, spent });
        }
    }

    /// Seq of the first record held (0 unless compacted or resumed).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The records held, from [`RunState::base`] on.
    pub fn entries(&self) -> &[Entry] {
        &self.steps
    }

    /// Record `seq`, if held.
    pub fn entry(&self, seq: u64) -> Option<&Entry> {
        self.steps
            .get(usize::try_from(seq.checked_sub(self.base)?).ok()?)
    }

    /// The records held with their seqs.
    pub fn records(&self) -> impl DoubleEndedIterator<Item = (u64, &Entry)> {
        let base = self.base;
        self.steps
            .iter()
            .enumerate()
            .map(move |(i, s)| (base + i as u64, s))
    }

    /// The records held from seq `from` on, with their seqs.
    pub fn records_from(&self, from: u64) -> impl DoubleEndedIterator<Item = (u64, &Entry)> {
        let skip = (from.saturating_sub(self.base) as usize).min(self.steps.len());
        let first = self.base + skip as u64;
        self.steps[skip..]
            .iter()
            .enumerate()
            .map(move |(i, s)| (first + i as u64, s))
    }

    /// The agent in force at `seq`: the latest `RunStarted` or
    /// `VersionChanged` before it.
    pub fn agent_at(&self, seq: u64) -> Option<&crate::api::AgentTemplate> {
        self.agents
            .iter()
            .rev()
            .find(|(at, _)| *at < seq)
            .map(|(_, a)| a)
    }

    /// The first record the next step can depend on: the latest `ModelCall`
    /// (every call it proposed, their intents, requests, decisions and
    /// results follow it), or an earlier intent still without a result.
    /// Everything before it is folded into the state's other fields.
    pub fn window_start(&self) -> u64 {
        let Some((model_call_seq, _)) = self.last_model_call() else {
            return self.base;
        };
        match self.open_intent() {
            Some((intent_seq, _)) => intent_seq.min(model_call_seq),
            None => model_call_seq,
        }
    }

    /// Lets go of the records before [`RunState::window_start`]: what the
    /// controller keeps of a long run between reconciles.
    pub fn compact(&mut self) {
        let start = self.window_start();
        // The run's start (its snapshot's input), the agent in force at the
        // window's start and later ones: not every version in between.
        if let Some(first) = self.agents.iter().rposition(|(at, _)| *at < start)
            && first > 1
        {
            self.agents.drain(1..first);
        }
        if start > self.base {
            for step in self.steps.drain(..(start - self.base) as usize) {
                match &step {
                    Entry::ModelCall(m) => self.spent_before.add(&m.response.usage, m.cost_usd),
                    Entry::Summary(s) => self.spent_before.add(&s.response.usage, s.cost_usd),
                    _ => {}
                }
            }
            self.base = start;
        }
    }

    /// The seqs of the records before the window that the state keeps in
    /// force (what [`RunState::resume_at`] needs back): `RunStarted`, the
    /// latest `VersionChanged`, the latest `Summary` and the latest
    /// `ModelCall` with text.
    pub fn pinned_before(&self, start: u64) -> Vec<u64> {
        let mut seqs: Vec<u64> = Vec::new();
        if let Some((seq, _)) = self.agents.first() {
            seqs.push(*seq);
        }
        if let Some((seq, _)) = self.agents.iter().rev().find(|(at, _)| *at < start)
            && self.agents.len() > 1
        {
            seqs.push(*seq);
        }
        if let Some((seq, _)) = self.summary {
            seqs.push(seq);
        }
        if let Some((seq, _)) = self.last_text {
            seqs.push(seq);
        }
        seqs.extend(self.budget.pinned_before(start));
        seqs.extend(self.counted_from.iter().map(|c| c.forked));
        seqs.extend(self.forks.iter().map(|f| f.seq));
        seqs.extend(self.test.as_ref().map(|(seq, _)| *seq));
        seqs.retain(|s| *s < start);
        seqs.sort_unstable();
        seqs.dedup();
        seqs
    }

    /// What the records before [`RunState::base`] spent.
    pub fn spent_before_base(&self) -> &Spent {
        &self.spent_before
    }

    /// Number of records.
    pub fn len(&self) -> u64 {
        self.base + self.steps.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next thing to do, from the log alone.
    pub fn next(&self) -> Next {
        if self.finished.is_some() {
            return Next::Done;
        }
        if self.snapshot.is_none() {
            return Next::NotStarted;
        }
        // A fork's `Forked` record changes nothing: the record before it
        // decides, as it did in the parent.
        if let Some((
            seq,
            Entry::Observation(Observation {
                stop: Some(stop), ..
            }),
        )) = self
            .records()
            .rev()
            .find(|(_, e)| !matches!(e, Entry::Forked(_)))
        {
            return Next::Stop(self.vouched_stop(seq, stop));
        }
        // An intent without a result comes first: it may already have acted.
        if let Some((intent_seq, intent)) = self.open_intent() {
            // Unless it is no call the policy lets run: then nothing of it is made.
            if let Some(error) = self.unapproved_intent(intent_seq, intent) {
                return Next::Finish {
                    outcome: Outcome::Failed,
                    result: self.last_text(),
                    error: Some(error),
                };
            }
            // Unless a human was asked whether it happened (its outcome was unknowable).
            if let Some((request_seq, decision)) = self.reconcile_for(intent_seq) {
                return match decision {
                    None => Next::AwaitApproval { request_seq },
                    Some(happened) => Next::Reconciled {
                        intent_seq,
                        intent: intent.clone(),
                        happened,
                        decided_seq: request_seq,
                    },
                };
            }
            return Next::ExecuteTool {
                intent_seq,
                intent: intent.clone(),
            };
        }
        let Some((model_call_seq, call)) = self.last_model_call() else {
            return self.call_model();
        };
        self.next_of_reply(model_call_seq, call)
    }

    /// Ask the model, unless a budget question stands in the way (a
    /// container agent asks it itself: its turn).
    fn call_model(&self) -> Next {
        let turn = if self.runs_a_container() {
            Next::AgentTurn
        } else {
            Next::CallModel
        };
        self.budget_answer().unwrap_or(turn)
    }

    /// A replay test's recorded calls (its `Forked` record's `test`): the
    /// run calls no tool and raises no approval (`crate::sandbox`).
    pub fn sandbox(&self) -> Option<&crate::runlog::records::Sandbox> {
        self.test.as_ref().map(|(_, t)| t.as_ref())
    }

    /// [`RunState::sandbox`], shared: the runner holds it across an await
    /// without copying every recorded result per call.
    pub fn sandbox_shared(&self) -> Option<std::sync::Arc<crate::runlog::records::Sandbox>> {
        self.test.as_ref().map(|(_, t)| t.clone())
    }

    /// Whether the agent in force is a container agent.
    pub fn runs_a_container(&self) -> bool {
        self.snapshot
            .as_ref()
            .is_some_and(|s| s.agent.container.is_some())
    }

    /// What the latest budget question says: wait for it, or end the run.
    fn budget_answer(&self) -> Option<Next> {
        Some(match self.budget.next()? {
            Answer::Waiting { request_seq } => Next::AwaitApproval { request_seq },
            Answer::End { outcome, error } => Next::Finish {
                outcome,
                result: self.last_text(),
                error: Some(error),
            },
        })
    }

    /// What the latest model reply (at `model_call_seq`) asks for next: the
    /// end of the run for a plain answer, else its first call not yet
    /// intended or settled, or the model again once every call is.
    fn next_of_reply(&self, model_call_seq: u64, call: &ModelCall) -> Next {
        if self.runs_a_container() {
            return self.next_of_agents_reply(model_call_seq, call);
        }
        let calls = &call.response.tool_calls;
        if calls.is_empty() {
            // A plain answer with no tool call is the agent's final answer.
            return Next::Finish {
                outcome: Outcome::Succeeded,
                result: call.response.text.clone(),
                error: None,
            };
        }
        for (index, tc) in calls.iter().enumerate() {
            match self.call_state(model_call_seq, index) {
                CallState::Intended | CallState::Settled => continue,
                CallState::Pending(request_seq) => return Next::AwaitApproval { request_seq },
                CallState::Approved(request_seq, arguments) => {
                    return self.approved(request_seq, arguments);
                }
                CallState::Open => {}
            }
            if tc.name == FINISH_TOOL {
                return Next::Finish {
                    outcome: Outcome::Succeeded,
                    result: Some(finish_result(&tc.arguments)),
                    error: None,
                };
            }
            // A reply with many calls must not run past the step budget.
            if let Some(next) = self.budget_answer() {
                return next;
            }
            if let Some(next) = self.steps_used_up() {
                return next;
            }
            return Next::RecordIntent {
                model_call_seq,
                call_index: index,
                call: tc.clone().into(),
            };
        }
        self.call_model()
    }

    /// A container agent's reply: a plain answer is not the end (the agent
    /// ends the run by exiting) and a proposed call is the agent's to make;
    /// what the log decides is still decided here: a call waiting for its
    /// approval, or approved, and the budgets.
    fn next_of_agents_reply(&self, model_call_seq: u64, call: &ModelCall) -> Next {
        for index in 0..call.response.tool_calls.len() {
            match self.call_state(model_call_seq, index) {
                CallState::Pending(request_seq) => return Next::AwaitApproval { request_seq },
                CallState::Approved(request_seq, arguments) => {
                    return self.approved(request_seq, arguments);
                }
                CallState::Open | CallState::Intended | CallState::Settled => {}
            }
        }
        self.call_model()
    }

    /// The approved call asked at `request_seq`, to run with `arguments`.
    fn approved(&self, request_seq: u64, arguments: Value) -> Next {
        let Some(Entry::ApprovalRequested(request)) = self.entry(request_seq) else {
            unreachable!("call_state returns the seq of an ApprovalRequested")
        };
        Next::Approved {
            request_seq,
            request: Box::new(request.clone()),
            arguments,
        }
    }

    /// Where call `index` of the ModelCall at `model_call_seq` stands.
    pub fn call_state(&self, model_call_seq: u64, index: usize) -> CallState {
        self.call_state_before(model_call_seq, index, u64::MAX)
    }

    /// Where call `index` of the ModelCall at `model_call_seq` stood just
    /// before record `until`.
    fn call_state_before(&self, model_call_seq: u64, index: usize, until: u64) -> CallState {
        let mut state = CallState::Open;
        let records = self
            .records_from(model_call_seq.saturating_add(1))
            .take_while(|(seq, _)| *seq < until);
        for (seq, step) in records {
            match step {
                Entry::ToolIntent(i)
                    if i.model_call_seq == model_call_seq && i.call_index == index =>
                {
                    return CallState::Intended;
                }
                Entry::ApprovalRequested(r)
                    if r.model_call_seq == model_call_seq
                        && r.call_index == index
                        && r.kind != crate::runlog::v1::ApprovalKind::Budget =>
                {
                    state = CallState::Pending(seq);
                }
                Entry::ApprovalVoided(v) if matches!(&state, CallState::Pending(r) | CallState::Approved(r, _) if *r == v.request_seq) =>
                {
                    state = CallState::Open;
                }
                Entry::ApprovalDecided(d) if state == CallState::Pending(d.request_seq) => {
                    state = match (&d.arguments, d.settles_without_running()) {
                        (_, true) => CallState::Settled,
                        (Some(args), false) => CallState::Approved(d.request_seq, args.clone()),
                        // Expired into escalation or failure: the controller follows up.
                        (None, false) => CallState::Pending(d.request_seq),
                    };
                }
                // A fork's start: an approval (or edit) given to the parent
                // lets the parent make the call, not the fork. The call is
                // decided again, by the fork's own approvers, when the fork
                // proposes it to its gate, under the fork's own policy (the
                // platform of its day). So is a request still undecided: it
                // was raised under the parent's. A rejection stands: it
                // makes nothing.
                Entry::Forked(f) if f.test.is_none() => {
                    if let CallState::Approved(..) | CallState::Pending(_) = state {
                        state = CallState::Open;
                    }
                }
                _ => {}
            }
        }
        state
    }

    /// The first seq whose decisions may authorize an effect made at `at`:
    /// the one after the latest `Forked` record before `at` (a replay
    /// test's `Forked` cuts nothing off), else 0. A decision recorded
    /// before a fork's own `Forked` was given to the run it was copied
    /// from: in the fork it authorizes no effect that is new (DESIGN.md §11).
    pub fn authority_from(&self, at: u64) -> u64 {
        self.forks
            .iter()
            .rev()
            .find(|f| !f.test && f.seq < at)
            .map_or(0, |f| f.seq + 1)
    }

    /// The first seq whose budget raises count at record `at`: the one after
    /// the latest `Forked` record before `at` that says what its budgets
    /// count (with `FromFork` or `Inherit` alike: a raise was granted for
    /// the parent's spending), else 0 (a `Forked` written before the
    /// setting carries its parent's raises, as it did).
    fn raises_from(&self, at: u64) -> u64 {
        self.forks
            .iter()
            .rev()
            .find(|f| f.budget && f.seq < at)
            .map_or(0, |f| f.seq + 1)
    }

    /// Where the call that the request at `request_seq` is about stands.
    pub fn call_state_of(&self, request_seq: u64) -> Option<CallState> {
        match self.entry(request_seq)? {
            Entry::ApprovalRequested(r) => Some(self.call_state(r.model_call_seq, r.call_index)),
            _ => None,
        }
    }

    /// The request currently waiting for a decision, if any.
    pub fn pending_approval(&self) -> Option<(u64, &ApprovalRequested)> {
        match self.next() {
            Next::AwaitApproval { request_seq } => match self.entry(request_seq) {
                Some(Entry::ApprovalRequested(r)) => Some((request_seq, r)),
                _ => None,
            },
            _ => None,
        }
    }

    /// The reconcile request about the intent at `intent_seq`, and whether a
    /// human said the call happened (`None` while undecided).
    fn reconcile_for(&self, intent_seq: u64) -> Option<(u64, Option<bool>)> {
        let mut found = None;
        let mut decided_at = 0;
        for (seq, step) in self.records_from(intent_seq + 1) {
            match step {
                Entry::ApprovalRequested(r) if r.intent_seq == Some(intent_seq) => {
                    found = Some((seq, None))
                }
                Entry::ApprovalDecided(d) if found.is_some_and(|(r, _)| r == d.request_seq) => {
                    // Only a human answers "did it happen?". An expiry is no
                    // answer: the request stays open for the controller,
                    // which escalates or stops the run, never calls again.
                    let happened = match d.verdict {
                        Verdict::Approve | Verdict::Edit => Some(true),
                        Verdict::Reject => Some(false),
                        Verdict::Expired => None,
                    };
                    found = Some((d.request_seq, happened));
                    decided_at = seq;
                }
                _ => {}
            }
        }
        // "It did not happen", copied into a fork, was said of the parent's
        // call before the parent went on and made it (with this very key):
        // acting on it in the fork would make the call a second time on a
        // word given to the parent. The fork recovers the intent as a fork
        // at the intent does: its lookup, or its own question. "It
        // happened" stands: it makes nothing.
        if let Some((_, Some(false))) = found
            && decided_at < self.authority_from(u64::MAX)
        {
            return None;
        }
        found
    }

    fn open_intent(&self) -> Option<(u64, &ToolIntent)> {
        let answered: std::collections::HashSet<u64> = self
            .steps
            .iter()
            .filter_map(|s| match s {
                Entry::ToolResult(r) => Some(r.intent_seq),
                _ => None,
            })
            .collect();
        self.records().find_map(|(seq, s)| match s {
            Entry::ToolIntent(i) if !answered.contains(&seq) => Some((seq, i)),
            _ => None,
        })
    }

    fn last_model_call(&self) -> Option<(u64, &ModelCall)> {
        self.records().rev().find_map(|(seq, s)| match s {
            Entry::ModelCall(m) => Some((seq, m)),
            _ => None,
        })
    }

    /// The step budget is used up before another call of the same reply:
    /// the run ends, or asks.
    fn steps_used_up(&self) -> Option<Next> {
        let budgets = self.budgets()?;
        let max = budgets.max_steps?;
        if self.len() < max {
            return None;
        }
        let reason = format!(
            "step budget used up: {} of {max} steps, inside one model reply",
            self.len()
        );
        if budget::asks(Some(&budgets)) {
            let arguments = self.budget_proposal(&budgets);
            return Some(Next::AskBudget { reason, arguments });
        }
        Some(Next::Finish {
            outcome: Outcome::BudgetExceeded,
            result: self.last_text(),
            error: Some(format!("{reason}; its remaining tool calls were not made")),
        })
    }

    /// The budgets in force: the agent's, with every raise granted so far
    /// (in a fork, so far in the fork: [`RunState::raises_from`]).
    pub fn budgets(&self) -> Option<Budgets> {
        let agent = self.snapshot.as_ref()?.agent.budgets.as_ref();
        self.budget
            .effective_between(agent, self.raises_from(self.len()), u64::MAX)
    }

    fn fork_count(&self, at: u64) -> Option<&CountFrom> {
        self.counted_from.iter().rev().find(|c| c.forked < at)
    }

    /// What a budget counts as used by the `at` records before `at`, which
    /// spent `spent`: all of it, or a fork's (`FromFork`) since its fork.
    fn counted(&self, at: u64, spent: &Spent) -> budget::Used {
        match self.fork_count(at) {
            None => used(at, spent),
            Some(c) => used(at - (c.forked + 1).min(at), &spent.since(&c.spent)),
        }
    }

    /// The limits a budget question proposes, for `budgets` in force now.
    pub fn budget_proposal(&self, budgets: &Budgets) -> Value {
        let agent = self
            .snapshot
            .as_ref()
            .and_then(|s| s.agent.budgets.as_ref());
        budget::proposal(agent, budgets, self.counted(self.len(), &self.spent))
    }

    /// Why the budget forbids another model call, if it does.
    pub fn budget_exceeded(&self, budgets: Option<&Budgets>) -> Option<String> {
        budget::exhausted(budgets?, self.counted(self.len(), &self.spent))
    }

    /// What the records before `seq` spent, summed in the order the log
    /// holds them (as [`RunState::spent`] is, so the sums agree exactly);
    /// `None` when they are not all held or folded.
    fn spent_before(&self, seq: u64) -> Option<Spent> {
        if seq < self.base || seq > self.len() {
            return None;
        }
        let mut spent = self.spent_before.clone();
        for (_, step) in self.records().take_while(|(at, _)| *at < seq) {
            match step {
                Entry::ModelCall(m) => spent.add(&m.response.usage, m.cost_usd),
                Entry::Summary(s) => spent.add(&s.response.usage, s.cost_usd),
                _ => {}
            }
        }
        Some(spent)
    }

    /// Why a budget is used up at record `seq`, by the records before it
    /// (the budgets in force there and what was spent): `Err` says what was
    /// used of each when none is, or why it cannot be told.
    fn exhausted_before(
        &self,
        seq: u64,
    ) -> Result<(String, Budgets, budget::Used), crate::refusal::Refusal> {
        let pinned = self
            .agent_at(seq)
            .ok_or_else(|| format!("no agent is pinned before record {seq}"))?
            .budgets
            .as_ref();
        let budgets = self
            .budget
            .effective_between(pinned, self.raises_from(seq), seq)
            .ok_or("the pinned agent has no budgets")?;
        let spent = self
            .spent_before(seq)
            .ok_or_else(|| Refusal::new(format!("the records before {seq} are not held")))?;
        let used = self.counted(seq, &spent);
        match budget::exhausted(&budgets, used) {
            Some(why) => Ok((why, budgets, used)),
            None => Err(Refusal::new(format!(
                "no budget is used up at record {seq} ({})",
                budget::usage(&budgets, used)
            ))),
        }
    }

    /// The end the step pod's `Observation` at `seq` asks for, as it may
    /// be recorded: a runner ends a run as Failed or NeedsHuman, or as
    /// BudgetExceeded where a budget is used up. The agent's success and
    /// the controller's own verdicts (cancel, deadline) are not a step
    /// pod's to claim: such a stop, or BudgetExceeded with budget left,
    /// ends the run Failed, saying what was claimed. A container agent's
    /// runner also reports that the agent exited 0 (Succeeded, which the
    /// controller records only once the pod's status shows that exit) and
    /// that the agent diverged.
    fn vouched_stop(&self, seq: u64, stop: &RunFinished) -> RunFinished {
        let container = self.runs_a_container();
        let refused = match stop.outcome {
            Outcome::Failed | Outcome::NeedsHuman => None,
            Outcome::Succeeded | Outcome::Diverged if container => None,
            // A replay test's runner ends it where the tested version left
            // the recorded calls (the report finds the call again in the log).
            Outcome::Diverged if self.sandbox().is_some() => None,
            Outcome::BudgetExceeded => self.exhausted_before(seq).err(),
            other => Some(Refusal::new(format!(
                "only the controller ends a run {other:?}"
            ))),
        };
        match refused {
            None => stop.clone(),
            Some(why) => RunFinished {
                outcome: Outcome::Failed,
                result: self.last_text(),
                error: Some(format!(
                    "the step pod's record {seq} asked to end the run {:?}, which was refused: {why}",
                    stop.outcome
                )),
            },
        }
    }

    /// What a budget question recorded at `seq` must be, by the log before
    /// it: why a budget is used up there (in the controller's words) and
    /// the limits the agent's `onExhausted: Ask` proposes then. `Err` says
    /// why no budget question belongs there.
    pub fn budget_question_due(
        &self,
        seq: u64,
    ) -> Result<(String, Value), crate::refusal::Refusal> {
        let (why, budgets, used) = self.exhausted_before(seq)?;
        let pinned = self.agent_at(seq).and_then(|a| a.budgets.as_ref());
        Ok((why, budget::proposal(pinned, &budgets, used)))
    }

    /// How the agent pinned at `seq` classes a call of `tool` with `args`
    /// (no pinned agent: nothing may run without a human).
    pub fn classify_at(
        &self,
        seq: u64,
        tool: &str,
        args: &Value,
        network: &crate::policy::Network,
    ) -> crate::policy::Classification {
        match self.agent_at(seq) {
            Some(agent) => crate::policy::classify(
                agent.approval.as_ref(),
                &crate::policy::Call::of(agent, tool, network),
                args,
            ),
            None => crate::policy::Classification::RequireApproval(Box::default()),
        }
    }

    /// The network the run's step pods resolve names in, with no lookups.
    fn network(&self) -> crate::policy::Network {
        let ns = self.snapshot.as_ref().map_or("", |s| s.namespace.as_str());
        crate::policy::Network::of(ns)
    }

    /// Why the intent recorded at `intent_seq` may not be executed, if it
    /// may not: the agent pinned there gates its call, and no approval of
    /// exactly that call (its request about this very call, decided by the
    /// controller, with these arguments, not voided, and given to this run:
    /// in a fork, decided after its own `Forked` unless the intent was
    /// copied too) precedes it. An intent is the step pod's word; the gate
    /// is the pinned policy's.
    pub fn unapproved_intent(&self, intent_seq: u64, intent: &ToolIntent) -> Option<String> {
        // A replay test (its controller-signed `Forked` says so) makes no
        // call: each intent is answered from a recorded call, gated or not.
        if self.sandbox().is_some() {
            return None;
        }
        let (arguments, _) = crate::policy::split_alternative(&intent.arguments);
        // Arguments that are no object never reach a tool (as the runner classes them).
        if !arguments.is_object() {
            return None;
        }
        let crate::policy::Classification::RequireApproval(gate) =
            // By the host's spellings: a call a lookup gated was approved
            // through its request, which this finds all the same.
            self.classify_at(intent_seq, &intent.tool, &arguments, &self.network())
        else {
            return None;
        };
        let state = self.call_state_before(intent.model_call_seq, intent.call_index, intent_seq);
        let approved = match &state {
            CallState::Approved(request_seq, args) => {
                *args == intent.arguments
                    && matches!(self.entry(*request_seq),
                        Some(Entry::ApprovalRequested(r)) if r.tool == intent.tool)
            }
            _ => false,
        };
        (!approved).then(|| {
            format!(
                "record {intent_seq} intends a call of {} that the pinned policy gates (rule {}), \
                 and no approval of exactly that call precedes it: it is not made",
                intent.tool, gate.rule
            )
        })
    }

    /// The latest thing the agent said: the partial result of a run stopped early.
    pub fn last_text(&self) -> Option<String> {
        self.last_text.as_ref().map(|(_, t)| t.clone())
    }
}

/// What has been used once `steps` records spent `spent`.
fn used(steps: u64, spent: &Spent) -> budget::Used {
    budget::Used {
        steps,
        tokens: spent.input_tokens.saturating_add(spent.output_tokens),
        cost_usd: spent.cost_usd,
    }
}

/// The `result` argument of a `finish` call (the whole arguments if malformed).
fn finish_result(args: &Value) -> String {
    match args.get("result") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => args.to_string(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::runlog::v1::{self, AgentTemplate, ModelResponse, OnExpiry, TokenUsage};
    use serde_json::json;

    pub(crate) fn started() -> RunState {
        RunState::replay(vec![Entry::RunStarted(RunStarted {
            container: None,
            run_name: "r".into(),
            namespace: "n".into(),
            input: "task".into(),
            agent: AgentTemplate::default(),
            tools: vec![],
            mcp: Default::default(),
            versions: Versions::default(),
        })])
    }

    /// Only what a container agent adds makes a record format 2: an earlier
    /// release refuses those records, and reads every other as before.
    #[test]
    fn a_model_call_holding_a_wire_request_is_drafted_as_format_2_and_others_as_format_1() {
        let plain = model_call(&[("lookup", json!({"id": 1}))]);
        assert_eq!(plain.draft().format, crate::store::FORMAT_1);
        let Entry::ModelCall(mut call) = plain else {
            unreachable!()
        };
        let request = crate::wire::canonical::Canonical::of(
            crate::wire::Dialect::ChatCompletions,
            json!({"messages": [{"role": "user", "content": "refund"}]}),
        )
        .unwrap();
        call.request = Some(crate::wire::canonical::record(&request, None).into());
        let draft = Entry::ModelCall(call).draft();
        assert_eq!(draft.format, crate::store::FORMAT_2);
        assert_eq!(draft.payload["request"]["dialect"], "chatCompletions");
        for entry in started().entries() {
            assert_eq!(entry.draft().format, crate::store::FORMAT_1);
        }
    }

    pub(crate) fn model_call(calls: &[(&str, serde_json::Value)]) -> Entry {
        Entry::ModelCall(ModelCall {
            request: None,
            response: ModelResponse {
                text: Some("thinking".into()),
                tool_calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, (n, a))| v1::ToolCall {
                        id: format!("c{i}"),
                        name: n.to_string(),
                        arguments: a.clone(),
                    })
                    .collect(),
                usage: TokenUsage {
                    input_tokens: 10,
                    output_tokens: 5,
                },
                model_id: "m".into(),
                stop_reason: None,
            },
            cost_usd: 0.5,
            context: ContextInfo::default(),
            attempts: None,
        })
    }

    pub(crate) fn request() -> Entry {
        Entry::ApprovalRequested(ApprovalRequested {
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "refund".into(),
            arguments: json!({"amount": 500}),
            arguments_hash: "h".into(),
            reason: None,
            observations: vec![],
            dependencies: vec![],
            gate: crate::runlog::records::Gate {
                rule: "r".into(),
                because: "b".into(),
                approvers: Default::default(),
                required_approvals: 1,
                expires_after: "1h".into(),
                on_expiry: OnExpiry::Fail,
                escalate_to: None,
                max_escalations: 1,
                dependencies: vec![],
                separation_of_duties: false,
                notify_webhook: None,
                notify_format: None,
            },
            escalation: 0,
            alternative: None,
            kind: Default::default(),
            intent_seq: None,
        })
    }

    pub(crate) fn decided(
        verdict: Verdict,
        on_expiry: Option<OnExpiry>,
        args: Option<serde_json::Value>,
    ) -> Entry {
        Entry::ApprovalDecided(ApprovalDecided {
            request_seq: 2,
            approval: "a".into(),
            verdict,
            decisions: vec![],
            arguments: args,
            observations_hash: "o".into(),
            on_expiry,
        })
    }

    /// Several turns: a lookup and a gated refund per reply (approved, or
    /// edited), a summary, replies without text, and the final answer.
    pub(crate) fn long_log(turns: u64) -> Vec<Entry> {
        let mut v = started().steps;
        for turn in 0..turns {
            let mc = v.len() as u64;
            let mut call = model_call(&[
                ("lookup", json!({"id": turn})),
                ("refund", json!({"amount": 500 + turn})),
            ]);
            if turn == 2
                && let Entry::ModelCall(m) = &mut call
            {
                m.response.text = None;
            }
            v.push(call);
            for (index, tool, args) in [
                (0, "lookup", json!({"id": turn})),
                (1, "refund", json!({"amount": 500 + turn})),
            ] {
                if index == 1 {
                    let req = v.len() as u64;
                    let Entry::ApprovalRequested(mut r) = request() else {
                        unreachable!()
                    };
                    (r.model_call_seq, r.call_index, r.call_id) = (mc, 1, "c1".into());
                    v.push(Entry::ApprovalRequested(r));
                    let Entry::ApprovalDecided(mut d) =
                        decided(Verdict::Edit, None, Some(json!({"amount": 300})))
                    else {
                        unreachable!()
                    };
                    d.request_seq = req;
                    v.push(Entry::ApprovalDecided(d));
                }
                let intent = v.len() as u64;
                v.push(Entry::ToolIntent(ToolIntent {
                    requested: None,
                    model_call_seq: mc,
                    call_index: index,
                    call_id: format!("c{index}"),
                    tool: tool.into(),
                    arguments: args,
                    key: format!("k{intent}"),
                    sandboxed: None,
                }));
                v.push(Entry::ToolResult(ToolResult {
                    intent_seq: intent,
                    call_id: format!("c{index}"),
                    tool: tool.into(),
                    outcome: v1::ToolOutcome::Ok(json!({"turn": turn})),
                    recovery: None,
                }));
            }
            if turn % 2 == 0 {
                // FollowLatest: a new agent version at a step boundary.
                let mut agent = AgentTemplate::default();
                agent.prompt.version = format!("v{turn}");
                v.push(Entry::VersionChanged(VersionChanged {
                    container: None,
                    agent,
                    tools: vec![],
                    mcp: Default::default(),
                    from: Versions::default(),
                    to: Versions::default(),
                }));
            }
            if turn == 1 {
                let Entry::ModelCall(m) = model_call(&[]) else {
                    unreachable!()
                };
                v.push(Entry::Summary(Summary {
                    text: "so far".into(),
                    through_seq: v.len() as u64 - 1,
                    response: m.response,
                    cost_usd: 0.25,
                    attempts: None,
                }));
            }
        }
        v.push(model_call(&[("finish", json!({"result": "done"}))]));
        v
    }

    /// What the controller and the runner read off a state.
    pub(crate) fn seen(s: &RunState) -> impl PartialEq + std::fmt::Debug {
        (
            s.next(),
            s.len(),
            s.spent.clone(),
            s.last_text(),
            s.summary.clone(),
            s.snapshot.clone(),
            s.pending_approval().map(|(seq, r)| (seq, r.clone())),
            s.agent_at(s.len()).cloned(),
        )
    }

    #[test]
    fn a_compacted_state_decides_as_the_whole_log_at_every_record() {
        let log = long_log(5);
        let mut compacted = RunState::default();
        for n in 0..log.len() {
            compacted.apply(log[n].clone());
            compacted.compact();
            let whole = RunState::replay(log[..=n].to_vec());
            assert_eq!(seen(&compacted), seen(&whole), "after record {n}");
            assert!(
                compacted.entries().len() <= 8,
                "holds {} records",
                compacted.entries().len()
            );
            assert_eq!(
                compacted.spent_before_base(),
                &RunState::replay(log[..compacted.base() as usize].to_vec()).spent
            );
        }
        assert!(compacted.base() > 20);
    }

    #[test]
    fn a_state_resumed_at_its_window_decides_as_the_whole_log() {
        let log = long_log(5);
        for n in 1..=log.len() {
            let whole = RunState::replay(log[..n].to_vec());
            let start = whole.window_start();
            let pinned = whole
                .pinned_before(start)
                .into_iter()
                .map(|seq| (seq, log[seq as usize].clone()))
                .collect();
            let before = RunState::replay(log[..start as usize].to_vec()).spent;
            let mut resumed = RunState::resume_at(start, pinned, before);
            for step in &log[start as usize..n] {
                resumed.apply(step.clone());
            }
            assert_eq!(
                seen(&resumed),
                seen(&whole),
                "log of {n} records resumed at {start}"
            );
        }
    }

    #[test]
    fn a_tool_step_is_intent_then_execution_then_the_model_again() {
        let mut s = started();
        assert_eq!(s.next(), Next::CallModel);
        s.apply(model_call(&[("lookup", json!({"id": 1}))]));
        assert!(matches!(
            s.next(),
            Next::RecordIntent {
                model_call_seq: 1,
                call_index: 0,
                ..
            }
        ));
        s.apply(Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "lookup".into(),
            arguments: json!({"id": 1}),
            key: "k".into(),
            sandboxed: None,
        }));
        assert!(matches!(s.next(), Next::ExecuteTool { intent_seq: 2, .. }));
        s.apply(Entry::ToolResult(ToolResult {
            intent_seq: 2,
            call_id: "c0".into(),
            tool: "lookup".into(),
            outcome: v1::ToolOutcome::Ok(json!({})),
            recovery: None,
        }));
        assert_eq!(s.next(), Next::CallModel);
        assert_eq!((s.spent.input_tokens, s.spent.output_tokens), (10, 5));
    }

    #[test]
    fn finish_and_plain_answers_end_the_run() {
        let mut s = started();
        s.apply(model_call(&[("finish", json!({"result": "done"}))]));
        assert_eq!(
            s.next(),
            Next::Finish {
                outcome: Outcome::Succeeded,
                result: Some("done".into()),
                error: None,
            }
        );
        let mut s = started();
        s.apply(model_call(&[]));
        assert_eq!(
            s.next(),
            Next::Finish {
                outcome: Outcome::Succeeded,
                result: Some("thinking".into()),
                error: None,
            }
        );
    }

    /// A container agent's run, at every prefix of its log: the agent's
    /// turn after a plain answer and after proposed calls (never the end,
    /// never an intent to record for it), the approval's wait and its
    /// decision, an open intent first, and a stop the runner asked for.
    #[test]
    fn a_container_agents_run_is_its_turn_until_the_log_decides_otherwise() {
        let mut log = started().steps;
        let Entry::RunStarted(s) = &mut log[0] else {
            unreachable!()
        };
        s.container = Some(crate::runlog::v2::Container {
            image: "team/agent:1".into(),
            command: vec!["python".into(), "agent.py".into()],
            args: vec![],
            env: vec![],
            resources: None,
            matching: None,
        });
        let intent = |args| {
            Entry::ToolIntent(ToolIntent {
                model_call_seq: 1,
                call_index: 0,
                call_id: "c0".into(),
                tool: "refund".into(),
                arguments: args,
                key: "k".into(),
                requested: None,
                sandboxed: None,
            })
        };
        log.extend([
            model_call(&[("refund", json!({"amount": 500}))]),
            request(),
            decided(Verdict::Edit, None, Some(json!({"amount": 300}))),
            intent(json!({"amount": 300})),
            Entry::ToolResult(ToolResult {
                intent_seq: 4,
                call_id: "c0".into(),
                tool: "refund".into(),
                outcome: v1::ToolOutcome::Ok(json!("refunded 300")),
                recovery: None,
            }),
            model_call(&[]),
        ]);
        let expected = |n: usize| -> &'static str {
            [
                "AgentTurn",
                "AgentTurn",
                "AwaitApproval",
                "Approved",
                "ExecuteTool",
                "AgentTurn",
                "AgentTurn",
            ][n - 1]
        };
        for n in 1..=log.len() {
            let state = RunState::replay(log[..n].to_vec());
            assert!(state.runs_a_container());
            let next = format!("{:?}", state.next());
            assert!(next.starts_with(expected(n)), "prefix {n}: {next}");
        }
        let mut stopped = RunState::replay(log.clone());
        stopped.apply(Entry::Observation(Observation {
            text: "the agent exited with 3".into(),
            about_seq: None,
            stop: Some(RunFinished {
                outcome: Outcome::Failed,
                result: None,
                error: Some("the agent exited with 3".into()),
            }),
            attempts: None,
        }));
        assert!(matches!(stopped.next(), Next::Stop(_)));
        // The same log of a built-in agent ends at its plain answer.
        let mut builtin = log;
        builtin[0] = started().steps.remove(0);
        assert!(matches!(
            RunState::replay(builtin).next(),
            Next::Finish { .. }
        ));
    }

    #[test]
    fn approvals_wait_then_run_void_or_settle() {
        let base = || {
            let mut s = started();
            s.apply(model_call(&[("refund", json!({"amount": 500}))]));
            s.apply(request());
            s
        };
        let s = base();
        assert_eq!(s.next(), Next::AwaitApproval { request_seq: 2 });
        assert!(s.pending_approval().is_some());

        let mut s = base();
        s.apply(decided(Verdict::Edit, None, Some(json!({"amount": 300}))));
        match s.next() {
            Next::Approved {
                request_seq: 2,
                arguments,
                ..
            } => assert_eq!(arguments, json!({"amount": 300})),
            other => panic!("{other:?}"),
        }
        // A voided approval asks again instead of running.
        s.apply(Entry::ApprovalVoided(ApprovalVoided {
            request_seq: 2,
            reason: "changed".into(),
            dependencies: vec![],
        }));
        assert!(matches!(
            s.next(),
            Next::RecordIntent {
                model_call_seq: 1,
                call_index: 0,
                ..
            }
        ));

        let mut s = base();
        s.apply(decided(Verdict::Reject, None, None));
        assert_eq!(
            s.next(),
            Next::CallModel,
            "a rejected call is settled; the model is told"
        );

        let mut s = base();
        s.apply(decided(
            Verdict::Expired,
            Some(OnExpiry::ReturnToAgent),
            None,
        ));
        assert_eq!(s.next(), Next::CallModel);

        let mut s = base();
        s.apply(decided(Verdict::Expired, Some(OnExpiry::Escalate), None));
        assert_eq!(
            s.next(),
            Next::AwaitApproval { request_seq: 2 },
            "the controller escalates"
        );
    }

    #[test]
    fn budgets_count_everything_recorded() {
        let mut s = started();
        s.apply(model_call(&[("x", json!({}))]));
        let b = crate::api::Budgets {
            max_tokens: Some(15),
            ..Default::default()
        };
        assert!(s.budget_exceeded(Some(&b)).unwrap().contains("15"));
        let b = crate::api::Budgets {
            max_cost_usd: Some(1.0),
            max_steps: Some(3),
            ..Default::default()
        };
        assert_eq!(s.budget_exceeded(Some(&b)), None);
        s.apply(model_call(&[]));
        assert!(s.budget_exceeded(Some(&b)).unwrap().contains("cost"));
    }

    /// A fork of a run that spent 30 tokens and 1.0 in two model calls,
    /// its `Forked` record saying `budget`, then one model call of its own.
    fn forked_after_two_calls(budget: Option<crate::api::ForkBudget>) -> RunState {
        let mut s = started();
        s.apply(model_call(&[]));
        s.apply(model_call(&[]));
        let prefix_usage =
            (budget == Some(crate::api::ForkBudget::FromFork)).then_some(PrefixUsage {
                input_tokens: s.spent.input_tokens,
                output_tokens: s.spent.output_tokens,
                cost_usd: s.spent.cost_usd,
            });
        s.apply(Entry::Forked(Forked {
            parent_uid: "p".into(),
            parent_name: "parent".into(),
            seq: 2,
            parent_hash: "00".repeat(32),
            requester: Some("alice".into()),
            budget,
            prefix_usage,
            replaced: None,
            test: None,
        }));
        s.apply(model_call(&[]));
        s
    }

    #[test]
    fn a_forks_budgets_count_from_its_start_unless_it_inherits_or_predates_the_setting() {
        use crate::api::ForkBudget;
        let tokens = crate::api::Budgets {
            max_tokens: Some(20),
            ..Default::default()
        };
        let steps = crate::api::Budgets {
            max_steps: Some(2),
            ..Default::default()
        };
        let cost = crate::api::Budgets {
            max_cost_usd: Some(0.75),
            ..Default::default()
        };
        let from_fork = forked_after_two_calls(Some(ForkBudget::FromFork));
        // 15 tokens, 0.5 and one step since the fork: under every limit.
        for b in [&tokens, &steps, &cost] {
            assert_eq!(from_fork.budget_exceeded(Some(b)), None, "{b:?}");
        }
        // The whole log spent 45 tokens, 1.5 and 5 steps: an inheriting fork,
        // and one whose Forked record predates the setting, count it all.
        for old in [Some(ForkBudget::Inherit), None] {
            let s = forked_after_two_calls(old);
            for b in [&tokens, &steps, &cost] {
                assert!(s.budget_exceeded(Some(b)).is_some(), "{old:?} {b:?}");
            }
        }
        // Spending is still the whole log's (the status shows it all).
        assert_eq!(
            from_fork.spent.input_tokens + from_fork.spent.output_tokens,
            45
        );
    }

    #[test]
    fn a_fork_resumed_from_a_checkpoint_past_its_start_counts_as_replayed_whole() {
        let whole = forked_after_two_calls(Some(crate::api::ForkBudget::FromFork));
        let start = whole.len();
        let pinned: Vec<(u64, Entry)> = whole
            .pinned_before(start)
            .into_iter()
            .map(|seq| (seq, whole.entries()[seq as usize].clone()))
            .collect();
        assert!(pinned.iter().any(|(_, e)| matches!(e, Entry::Forked(_))));
        let mut resumed = RunState::resume_at(start, pinned, whole.spent.clone());
        resumed.apply(model_call(&[]));
        let mut whole = whole;
        whole.apply(model_call(&[]));
        let b = crate::api::Budgets {
            max_tokens: Some(31),
            ..Default::default()
        };
        assert_eq!(resumed.budget_exceeded(Some(&b)), None);
        assert_eq!(
            resumed.budget_exceeded(Some(&b)),
            whole.budget_exceeded(Some(&b))
        );
        let b = crate::api::Budgets {
            max_tokens: Some(30),
            ..Default::default()
        };
        assert!(resumed.budget_exceeded(Some(&b)).is_some());
        assert_eq!(
            resumed.budget_exceeded(Some(&b)),
            whole.budget_exceeded(Some(&b))
        );
    }

    #[test]
    fn a_reply_with_more_calls_than_steps_left_stops_at_the_budget() {
        let mut s = started();
        if let Some(snap) = &mut s.snapshot {
            snap.agent.budgets = Some(crate::api::Budgets {
                max_steps: Some(4),
                ..Default::default()
            });
        }
        let calls: Vec<(&str, serde_json::Value)> = (0..10).map(|_| ("x", json!({}))).collect();
        s.apply(model_call(&calls));
        assert!(matches!(s.next(), Next::RecordIntent { call_index: 0, .. }));
        s.apply(Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "x".into(),
            arguments: json!({}),
            key: "k".into(),
            sandboxed: None,
        }));
        s.apply(Entry::ToolResult(ToolResult {
            intent_seq: 2,
            call_id: "c0".into(),
            tool: "x".into(),
            outcome: v1::ToolOutcome::Ok(json!({})),
            recovery: None,
        }));
        match s.next() {
            Next::Finish { outcome, error, .. } => {
                assert_eq!(outcome, Outcome::BudgetExceeded);
                assert!(error.unwrap().contains("4 of 4 steps"));
            }
            other => panic!("the budget let call 1 of 10 through: {other:?}"),
        }
    }

    #[test]
    fn an_expired_reconcile_never_counts_as_did_not_happen() {
        let mut s = started();
        s.apply(model_call(&[("page", json!({"why": "x"}))]));
        s.apply(Entry::ToolIntent(ToolIntent {
            requested: None,
            model_call_seq: 1,
            call_index: 0,
            call_id: "c0".into(),
            tool: "page".into(),
            arguments: json!({"why": "x"}),
            key: "k".into(),
            sandboxed: None,
        }));
        let Entry::ApprovalRequested(mut r) = request() else {
            unreachable!()
        };
        r.kind = v1::ApprovalKind::Reconcile;
        r.intent_seq = Some(2);
        s.apply(Entry::ApprovalRequested(r));
        let mut expired = decided(Verdict::Expired, Some(OnExpiry::Fail), None);
        if let Entry::ApprovalDecided(d) = &mut expired {
            d.request_seq = 3;
        }
        s.apply(expired);
        assert_eq!(
            s.next(),
            Next::AwaitApproval { request_seq: 3 },
            "nobody said it did not happen: the controller stops the run, the call is not made again"
        );
        let mut rejected = decided(Verdict::Reject, None, None);
        if let Entry::ApprovalDecided(d) = &mut rejected {
            d.request_seq = 3;
        }
        s.apply(rejected);
        assert!(matches!(
            s.next(),
            Next::Reconciled {
                happened: false,
                ..
            }
        ));
    }

    /// A run whose agent asks when its `max` steps are used up.
    fn asking(max: u64) -> Vec<Entry> {
        let agent = AgentTemplate {
            budgets: Some(v1::Budgets {
                max_steps: Some(max),
                on_exhausted: Some(v1::OnExhausted::Ask),
                approvers: Some(v1::Approvers {
                    users: vec!["alice".into()],
                    groups: vec![],
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let Entry::RunStarted(mut s) = started().steps.remove(0) else {
            unreachable!()
        };
        s.agent = agent;
        let mut v = vec![Entry::RunStarted(s)];
        let lookups: Vec<(&str, serde_json::Value)> =
            (0..6).map(|i| ("lookup", json!({"id": i}))).collect();
        v.push(model_call(&lookups));
        for index in 0..2 {
            let intent = v.len() as u64;
            v.push(Entry::ToolIntent(ToolIntent {
                requested: None,
                model_call_seq: 1,
                call_index: index,
                call_id: format!("c{index}"),
                tool: "lookup".into(),
                arguments: json!({"id": index}),
                key: format!("k{intent}"),
                sandboxed: None,
            }));
            v.push(Entry::ToolResult(ToolResult {
                intent_seq: intent,
                call_id: format!("c{index}"),
                tool: "lookup".into(),
                outcome: v1::ToolOutcome::Ok(json!({})),
                recovery: None,
            }));
        }
        v
    }

    fn budget_question(seq_of_model_call: u64, arguments: serde_json::Value) -> Entry {
        let Entry::ApprovalRequested(mut r) = request() else {
            unreachable!()
        };
        r.kind = v1::ApprovalKind::Budget;
        r.tool = crate::api::BUDGET_TOOL.into();
        r.model_call_seq = seq_of_model_call;
        r.arguments = arguments;
        Entry::ApprovalRequested(r)
    }

    fn budget_decided(
        request_seq: u64,
        verdict: Verdict,
        args: Option<serde_json::Value>,
    ) -> Entry {
        let Entry::ApprovalDecided(mut d) = decided(verdict, None, args) else {
            unreachable!()
        };
        d.request_seq = request_seq;
        Entry::ApprovalDecided(d)
    }

    #[test]
    fn a_used_up_budget_that_asks_waits_for_its_question_and_goes_on_with_the_raise() {
        // 6 records with max 6: the reply's third call would pass the budget.
        let mut log = asking(6);
        let state = RunState::replay(log.clone());
        let Next::AskBudget { reason, arguments } = state.next() else {
            panic!("{:?}", state.next())
        };
        assert!(reason.contains("6 of 6 steps"), "{reason}");
        assert_eq!(
            arguments,
            json!({"maxSteps": 12}),
            "its original size again"
        );
        // The question waits; no call of the reply is intended meanwhile.
        log.push(budget_question(1, arguments));
        let state = RunState::replay(log.clone());
        assert_eq!(state.next(), Next::AwaitApproval { request_seq: 6 });
        assert_eq!(state.pending_approval().map(|(seq, _)| seq), Some(6));
        // Raised by 5 through an edit: the reply goes on up to 11.
        log.push(budget_decided(
            6,
            Verdict::Edit,
            Some(json!({"maxSteps": 11})),
        ));
        let state = RunState::replay(log.clone());
        assert_eq!(state.budgets().and_then(|b| b.max_steps), Some(11));
        assert!(matches!(
            state.next(),
            Next::RecordIntent { call_index: 2, .. }
        ));
    }

    /// What the controller requires of a budget question is exactly what
    /// an honest runner asks, at the first question and after a raise, on
    /// the whole log, a compacted state and one resumed at its window.
    #[test]
    fn an_honest_budget_question_is_the_one_the_log_implies() {
        let mut log = asking(6);
        for (raise, turn) in [(None, 0), (Some(10), 1)] {
            if let Some(max) = raise {
                let request_seq = log.len() as u64 - 1;
                log.push(budget_decided(
                    request_seq,
                    Verdict::Approve,
                    Some(json!({"maxSteps": max})),
                ));
                // The reply goes on until the raised budget is used up.
                let mut index = 2;
                while (log.len() as u64) < max {
                    let intent = log.len() as u64;
                    log.push(Entry::ToolIntent(ToolIntent {
                        requested: None,
                        model_call_seq: 1,
                        call_index: index,
                        call_id: format!("c{index}"),
                        tool: "lookup".into(),
                        arguments: json!({"id": index}),
                        key: format!("k{intent}"),
                        sandboxed: None,
                    }));
                    log.push(Entry::ToolResult(ToolResult {
                        intent_seq: intent,
                        call_id: format!("c{index}"),
                        tool: "lookup".into(),
                        outcome: v1::ToolOutcome::Ok(json!({})),
                        recovery: None,
                    }));
                    index += 1;
                }
            }
            let whole = RunState::replay(log.clone());
            let Next::AskBudget { arguments, .. } = whole.next() else {
                panic!("turn {turn}: {:?}", whole.next())
            };
            let seq = whole.len();
            let mut compacted = whole.clone();
            compacted.compact();
            for state in [&whole, &compacted] {
                let (why, due) = state.budget_question_due(seq).unwrap();
                assert_eq!(due, arguments, "turn {turn}");
                assert!(why.contains(&format!("{seq} of")), "turn {turn}: {why}");
            }
            log.push(budget_question(1, arguments));
            // Once asked, the question is judged at its own seq, whatever follows.
            let later = RunState::replay(log.clone());
            assert!(later.budget_question_due(seq).is_ok(), "turn {turn}");
            assert!(
                later
                    .budget_question_due(seq - 1)
                    .unwrap_err()
                    .contains("no budget is used up"),
                "turn {turn}"
            );
        }
    }

    /// A step pod may ask to end a run Failed or NeedsHuman, or
    /// BudgetExceeded once a budget is used up; any other end it claims is
    /// recorded Failed.
    #[test]
    fn a_stop_is_taken_only_for_the_ends_a_step_pod_may_claim() {
        let stop = |outcome| {
            Entry::Observation(Observation {
                text: "stop".into(),
                about_seq: None,
                stop: Some(RunFinished {
                    outcome,
                    result: None,
                    error: Some("why".into()),
                }),
                attempts: None,
            })
        };
        let ended = |log: &[Entry], outcome| {
            let mut log = log.to_vec();
            log.push(stop(outcome));
            match RunState::replay(log).next() {
                Next::Stop(f) => f,
                other => panic!("{other:?}"),
            }
        };
        let fresh = asking(100);
        for outcome in [Outcome::Failed, Outcome::NeedsHuman] {
            assert_eq!(ended(&fresh, outcome).outcome, outcome);
        }
        for outcome in [
            Outcome::Succeeded,
            Outcome::Cancelled,
            Outcome::DeadlineExceeded,
            Outcome::BudgetExceeded,
        ] {
            let f = ended(&fresh, outcome);
            assert_eq!(f.outcome, Outcome::Failed, "{outcome:?}");
            assert!(
                f.error.unwrap().contains("which was refused"),
                "{outcome:?}"
            );
        }
        // With the budget used up, BudgetExceeded is the runner's to record.
        assert_eq!(
            ended(&asking(6), Outcome::BudgetExceeded).outcome,
            Outcome::BudgetExceeded
        );
    }

    #[test]
    fn a_budget_question_rejected_or_expired_ends_the_run_budget_exceeded() {
        for verdict in [Verdict::Reject, Verdict::Expired] {
            let mut log = asking(6);
            log.push(budget_question(1, json!({"maxSteps": 12})));
            log.push(budget_decided(6, verdict, None));
            let state = RunState::replay(log);
            let Next::Finish { outcome, error, .. } = state.next() else {
                panic!("{verdict:?}: {:?}", state.next())
            };
            assert_eq!(outcome, Outcome::BudgetExceeded, "{verdict:?}");
            assert!(error.unwrap().contains("record 6"), "{verdict:?}");
            assert_eq!(state.budgets().and_then(|b| b.max_steps), Some(6));
        }
    }

    #[test]
    fn a_budget_that_fails_ends_inside_the_reply_without_asking() {
        let mut log = asking(6);
        let Entry::RunStarted(s) = &mut log[0] else {
            unreachable!()
        };
        s.agent.budgets.as_mut().unwrap().on_exhausted = None;
        let state = RunState::replay(log);
        assert!(matches!(
            state.next(),
            Next::Finish {
                outcome: Outcome::BudgetExceeded,
                ..
            }
        ));
    }

    #[test]
    fn a_raise_holds_across_compaction_and_a_resume_from_a_checkpoint() {
        let mut log = asking(6);
        log.push(budget_question(1, json!({"maxSteps": 12})));
        log.push(budget_decided(
            6,
            Verdict::Approve,
            Some(json!({"maxSteps": 12})),
        ));
        // The reply goes on; then a new reply, so the window moves past the raise.
        let mc = log.len() as u64;
        log.push(model_call(&[("lookup", json!({"id": 9}))]));
        let whole = RunState::replay(log.clone());
        let start = whole.window_start();
        assert_eq!(start, mc);
        let pinned: Vec<(u64, Entry)> = whole
            .pinned_before(start)
            .into_iter()
            .map(|seq| (seq, log[seq as usize].clone()))
            .collect();
        assert!(pinned.iter().any(|(seq, _)| *seq == 6) && pinned.iter().any(|(seq, _)| *seq == 7));
        let mut resumed = RunState::resume_at(start, pinned, whole.spent.clone());
        for step in log[start as usize..].iter().cloned() {
            resumed.apply(step);
        }
        assert_eq!(resumed.budgets().and_then(|b| b.max_steps), Some(12));
        let mut compacted = whole.clone();
        compacted.compact();
        assert_eq!(compacted.budgets().and_then(|b| b.max_steps), Some(12));
        assert_eq!(resumed.next(), whole.next());
    }
}
