//! A container agent's step (docs/container-agents.md): the runner serves
//! the agent on its pod's loopback instead of running the built-in loop.
//!
//! Before it serves, the runner does what the log alone decides (an
//! approved call is intended and made, an open intent is made, a budget
//! question or an approval ends the step), as a built-in agent's runner
//! does. Then every request the agent sends is matched against the log
//! ([`Matcher`]): a recorded one is answered from its record, a new one is
//! asked or called, recorded, and only then answered. One request at a
//! time: the log is one sequence, and an answer is served only once its
//! record is in it.
//!
//! The step ends when the agent exits (its shim reports the code), when a
//! call needs a human (the approval is recorded and the agent stopped: a
//! waiting run holds no pod), when the run diverges, or when the log says
//! the run is at its end. Whatever ends it, nothing is answered after.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::sync::{Mutex, watch};

use super::{AbortOnDrop, Flow, Runner, StepError, classification};
use crate::model::{ModelClient, cost_usd};
use crate::policy::Classification;
use crate::replay::{CallState, Entry, Next};
use crate::runlog::records::not_run_note;
use crate::runlog::records::*;
use crate::step::prompt::edit_note;
use crate::step::wire_log::WireLog;
use crate::tools::ToolOutcome;
use crate::wire::canonical::{self, Canonical, first_difference, tool_digest};
use crate::wire::loopback::{self, AgentExit, Answer, Asked, Backend, Refused};
use crate::wire::matcher::{Decision, Matcher, Matching};
use crate::wire::mcp_server::{AgentCall, Calls, ServedTool};
use crate::wire::servers::tool_servers;

/// How long the agent is given to stop once the step is over (its shim
/// is told at once; the kubelet kills what is left with the pod).
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The loopback server's bounds: one agent on its own pod's loopback.
const LIMITS: crate::bounded::Limits = crate::bounded::Limits {
    max_connections: 64,
    header_timeout: Duration::from_secs(30),
    body_timeout: Duration::from_secs(60),
};

/// Where the container step stands once it is over.
#[derive(Clone, Debug, PartialEq)]
enum End {
    /// The log says what comes next is the controller's (an approval, the
    /// run's end, a budget question, the next version): why.
    Controller(String),
    /// The agent exited with this code.
    Exited(i32),
    /// Another worker took the run over: this one answers nothing more and
    /// leaves as a fenced worker does ([`super::LEASE_LOST_EXIT_CODE`]).
    LeaseLost,
}

/// Where the runner serves and the key that opens it (set by the controller
/// on the `step` container: `AGENTRUN_LOOPBACK_ADDR`, `AGENTRUN_RUNNER_KEY`).
#[derive(Debug)]
pub struct Loopback {
    pub addr: String,
    /// Bound to `addr` when the step started.
    pub listener: tokio::net::TcpListener,
    pub key: String,
}

/// Serves the agent until the step is over.
pub(super) async fn drive(mut runner: Runner, loopback: Loopback) -> Result<(), StepError> {
    // Nothing for the agent: it is still told to stop, so its container
    // ends with the pod rather than wait for a runner that never serves.
    let over = match settle(&mut runner).await? {
        true => None,
        false => Some(End::Controller(
            "the log leaves the agent nothing to do".into(),
        )),
    };
    let snap = runner.snapshot()?;
    let wire = WireLog::read(runner.state.records()).map_err(StepError::WireLog)?;
    let matching = match snap.agent.container.as_ref().and_then(|c| c.matching) {
        Some(crate::api::ReplayMatching::ByPosition) => Matching::ByPosition,
        _ => Matching::Exact,
    };
    let (end_tx, mut end_rx) = watch::channel(over);
    let (exit_tx, mut exit_rx) = watch::channel(None);
    let driver = Arc::new(Driver {
        inner: Mutex::new(Inner {
            matcher: Matcher::new(wire.recorded, matching),
            last: wire.last,
            proposals: HashMap::new(),
            client: None,
            runner,
        }),
        end: end_tx,
        exit: exit_tx,
    });
    let served = loopback::Served {
        key: loopback.key,
        backend: Arc::new(Handle(driver.clone())),
        tool_servers: served_tools(&snap),
        calls: Arc::new(Handle(driver.clone())),
        listen_host: loopback
            .addr
            .rsplit_once(':')
            .map(|(host, _)| host.to_string()),
    };
    let listener = loopback.listener;
    tracing::info!(addr = %loopback.addr, "serving the agent");
    let _server = AbortOnDrop(tokio::spawn(crate::bounded::serve(
        listener,
        loopback::router(served),
        LIMITS,
    )));
    let end = loop {
        if let Some(end) = end_rx.borrow_and_update().clone() {
            break end;
        }
        if end_rx.changed().await.is_err() {
            unreachable!("the driver holds the sender while it serves");
        }
    };
    tracing::info!(?end, "the container step is over");
    match end {
        End::Exited(0) => Ok(()),
        End::Exited(code) => Err(StepError::AgentFailed { code }),
        End::LeaseLost => Err(super::LeaseLost.into()),
        End::Controller(_) => {
            // The shim stops the agent and reports; the pod ends with both.
            let _ = tokio::time::timeout(STOP_GRACE, exit_rx.wait_for(Option::is_some)).await;
            Ok(())
        }
    }
}

/// Does what the log decides before the agent's turn; false when the step
/// ends there (the next move is the controller's). An approved call, or
/// one intended and not seen through, waits for the agent to make it
/// again: an agent that diverges before it gets there makes no call.
async fn settle(runner: &mut Runner) -> Result<bool, StepError> {
    loop {
        let next = runner.state.next();
        if matches!(
            next,
            Next::AgentTurn | Next::Approved { .. } | Next::ExecuteTool { .. }
        ) {
            return Ok(true);
        }
        if let Flow::Exit = runner.take_step(next).await? {
            return Ok(false);
        }
    }
}

/// The tool servers the agent is served, each with its pinned tools.
fn served_tools(snap: &crate::replay::Snapshot) -> Vec<(String, Vec<ServedTool>)> {
    tool_servers(&snap.agent.tools)
        .into_iter()
        .map(|server| {
            let tools = server
                .tools
                .iter()
                .filter_map(|name| served_tool(snap, name))
                .collect();
            (server.name, tools)
        })
        .collect()
}

fn served_tool(snap: &crate::replay::Snapshot, name: &str) -> Option<ServedTool> {
    let spec = snap.agent.tools.iter().find(|t| t.name == name)?;
    let mcp = snap.mcp.get(name);
    // What the run pinned for the model; else the declaration itself.
    let (description, input_schema) = match snap.tools.iter().find(|t| t.name == name) {
        Some(def) => (def.description.clone(), def.input_schema.clone()),
        None => (
            spec.description.clone(),
            spec.input_schema
                .clone()
                .or_else(|| mcp.map(|m| m.input_schema.clone()))
                .unwrap_or(Value::Null),
        ),
    };
    let annotations = match (&spec.http, mcp) {
        (_, Some(info)) => info.annotations.clone(),
        (Some(http), None) => crate::tools::McpAnnotations {
            read_only_hint: Some(http.read_only),
            idempotent_hint: Some(http.idempotent),
            ..Default::default()
        },
        (None, None) => Default::default(),
    };
    Some(ServedTool {
        name: name.to_string(),
        description,
        input_schema,
        annotations,
    })
}

/// The runner's side of the loopback server.
struct Driver {
    inner: Mutex<Inner>,
    /// Set once: why the step is over.
    end: watch::Sender<Option<End>>,
    /// The shim's report, once it came.
    exit: watch::Sender<Option<AgentExit>>,
}

struct Inner {
    runner: Runner,
    matcher: Matcher,
    /// The last model request recorded (the base of the next one's delta).
    last: Option<Canonical>,
    /// Calls proposed by answers served here, by digest: the model call
    /// and the index each is, in the order served.
    proposals: HashMap<String, VecDeque<(u64, usize)>>,
    /// The model client, made at the first live request.
    client: Option<ModelClient>,
}

/// What a request gets once the step is over.
fn over(end: &End) -> Refused {
    let why = match end {
        End::Controller(why) => why.clone(),
        End::Exited(code) => format!("the agent exited with code {code}"),
        End::LeaseLost => "another worker took the run over".into(),
    };
    Refused {
        status: 503,
        message: format!("agentrun: this step is over ({why}); nothing more is answered"),
    }
}

impl Driver {
    fn ended(&self) -> Option<End> {
        self.end.borrow().clone()
    }

    fn finish(&self, end: End) {
        self.end.send_if_modified(|e| {
            let first = e.is_none();
            if first {
                *e = Some(end);
            }
            first
        });
    }

    async fn answer_model(&self, asked: Asked) -> Result<Answer, Refused> {
        let mut inner = self.inner.lock().await;
        if let Some(end) = self.ended() {
            return Err(over(&end));
        }
        let result = inner.model(asked).await;
        match result {
            Ok(answer) => Ok(answer),
            Err(Failure::Ends(end, refused)) => {
                self.finish(end);
                Err(refused)
            }
            Err(Failure::Step(e)) => {
                let refused = step_failed(&e);
                self.finish(step_end(&e));
                Err(refused)
            }
            Err(Failure::Refused(refused)) => Err(refused),
            Err(Failure::Diverges(_)) => unreachable!("Inner::model records a divergence"),
        }
    }

    async fn answer_call(&self, call: AgentCall) -> ToolOutcome {
        let mut inner = self.inner.lock().await;
        if let Some(end) = self.ended() {
            return failed(over(&end).message);
        }
        match inner.call(call).await {
            Ok(outcome) => outcome,
            Err(Failure::Ends(end, refused)) => {
                let waits = matches!(&end, End::Controller(_)) && refused.status == 202;
                self.finish(end);
                drop(inner);
                if waits {
                    // The call waits for a human: the agent gets no answer
                    // (it is stopped; it asks again after the decision).
                    futures::future::pending::<()>().await;
                }
                failed(refused.message)
            }
            Err(Failure::Step(e)) => {
                let refused = step_failed(&e);
                self.finish(step_end(&e));
                failed(refused.message)
            }
            Err(Failure::Refused(refused)) => failed(refused.message),
            Err(Failure::Diverges(_)) => unreachable!("Inner::call records a divergence"),
        }
    }

    async fn agent_exited(&self, exit: AgentExit) {
        let mut inner = self.inner.lock().await;
        self.exit.send_replace(Some(exit.clone()));
        if self.ended().is_some() {
            return;
        }
        if exit.code != 0 {
            tracing::warn!(code = exit.code, "the agent exited with an error");
            self.finish(End::Exited(exit.code));
            return;
        }
        match inner.exited_well(exit).await {
            Ok(()) => self.finish(End::Exited(0)),
            Err(e) => {
                tracing::error!(error = %e, "recording the agent's end failed");
                self.finish(step_end(&e));
            }
        }
    }
}

fn failed(observation: String) -> ToolOutcome {
    ToolOutcome::Failed { observation }
}

/// How the step ends when the runner failed: a lost lease as a fenced
/// worker's, anything else for the controller to decide from the log.
fn step_end(e: &StepError) -> End {
    match e.lease_lost() {
        true => End::LeaseLost,
        false => End::Controller(e.to_string()),
    }
}

fn step_failed(e: &StepError) -> Refused {
    if e.lease_lost() {
        return over(&End::LeaseLost);
    }
    Refused {
        status: 503,
        message: format!("agentrun: the runner stopped: {e}"),
    }
}

/// Why a request got no answer.
enum Failure {
    /// The step ends (the agent is stopped): its end, and what the agent is told.
    Ends(End, Refused),
    /// The runner failed (the store, the lease): the step ends with it.
    Step(StepError),
    /// This request only (it changes nothing in the run).
    Refused(Refused),
    /// The agent took another path than its log records: the run is to
    /// stop Diverged, for this reason.
    Diverges(String),
}

impl From<StepError> for Failure {
    fn from(e: StepError) -> Failure {
        Failure::Step(e)
    }
}

impl Inner {
    /// A model request: answered from its record, or asked and recorded.
    async fn model(&mut self, asked: Asked) -> Result<Answer, Failure> {
        match self.model_once(asked).await {
            Err(Failure::Diverges(why)) => Err(self.diverge(why).await?),
            other => other,
        }
    }

    async fn model_once(&mut self, asked: Asked) -> Result<Answer, Failure> {
        let digest = asked.canonical.digest();
        match self.matcher.model(&digest) {
            Decision::Replay { seq } => self.recorded_answer(seq),
            Decision::Diverged { replaced } => Err(self.diverged_model(replaced, &asked).await?),
            Decision::Live => self.ask(asked, digest).await,
        }
    }

    /// The answer recorded at `seq`; its proposed calls become the agent's to make.
    fn recorded_answer(&mut self, seq: u64) -> Result<Answer, Failure> {
        let Some(Entry::ModelCall(call)) = self.runner.state.entry(seq) else {
            unreachable!("the matcher replays model requests from ModelCall records");
        };
        let response: crate::model::ModelResponse = call.response.clone().into();
        self.propose(seq, &response);
        Ok(self.answer(seq, response))
    }

    fn answer(&self, seq: u64, response: crate::model::ModelResponse) -> Answer {
        Answer {
            response,
            id: format!("agentrun-{}-{seq}", self.runner.args.run_uid),
            created: chrono::Utc::now().timestamp(),
        }
    }

    fn propose(&mut self, seq: u64, response: &crate::model::ModelResponse) {
        let digests: Vec<String> = response
            .tool_calls
            .iter()
            .map(|c| tool_digest(&c.name, &c.arguments))
            .collect();
        for (index, digest) in digests.iter().enumerate() {
            self.proposals
                .entry(digest.clone())
                .or_default()
                .push_back((seq, index));
        }
        self.matcher.propose(digests);
    }

    /// A model request nothing recorded answers: asked, recorded, answered.
    async fn ask(&mut self, asked: Asked, digest: String) -> Result<Answer, Failure> {
        if let Some(end) = self.controllers_turn() {
            return Err(end);
        }
        let snap = self.runner.snapshot()?;
        let budgets = self.runner.state.budgets();
        if self
            .runner
            .state
            .budget_exceeded(budgets.as_ref())
            .is_some()
        {
            // The same question or end a built-in agent's runner records.
            self.runner.model_step().await?;
            return Err(self.ends_for_controller("a budget is used up"));
        }
        // One client for the step: its connections are kept (the agent's
        // model does not change within a step; a new version ends it).
        let mut client = match &self.client {
            Some(client) => client.clone(),
            None => {
                let key = self.runner.args.model_api_key.clone();
                let client = ModelClient::new(&snap.agent.model, key).map_err(StepError::from)?;
                self.client.insert(client).clone()
            }
        };
        if let Some(deadline) = self.runner.args.model_deadline(self.runner.started) {
            client = client.within(deadline);
        }
        let Some((response, attempts)) = self.runner.ask(&client, &asked.request).await? else {
            let why = match self.runner.yielding {
                true => "the agent changed; the next step pod runs its new version",
                false => "the model's answer could not be used (recorded)",
            };
            return Err(self.ends_for_controller(why));
        };
        let cost = cost_usd(snap.agent.model.prices.as_ref(), &response.usage);
        let model_id = response.model_id.clone();
        let request = canonical::record_digested(&asked.canonical, digest, self.last.as_ref());
        let call = ModelCall {
            request: Some(request.into()),
            response: response.clone().into(),
            cost_usd: cost,
            context: ContextInfo {
                summary_seq: None,
                from_seq: 0,
                estimated_tokens: 0,
            },
            attempts: Some(attempts),
        };
        let seq = self
            .runner
            .append(Entry::ModelCall(call), Some(model_id))
            .await?;
        self.last = Some(asked.canonical);
        self.propose(seq, &response);
        Ok(self.answer(seq, response))
    }

    /// Whether what comes next is the controller's (the agent's turn is
    /// over). An agent asking the model anew while a call it made before is
    /// approved or intended and not made has taken another path: diverged.
    fn controllers_turn(&self) -> Option<Failure> {
        match self.runner.state.next() {
            Next::AgentTurn => None,
            Next::Approved { request, .. } => Some(Failure::Diverges(format!(
                "the agent went on without making the approved call {} (record {})",
                request.tool, request.model_call_seq
            ))),
            Next::ExecuteTool { intent, intent_seq } => Some(Failure::Diverges(format!(
                "the agent went on without making the call {} recorded at seq {intent_seq}",
                intent.tool
            ))),
            next => Some(self.ends_for_controller(&format!("the run's log says next: {next:?}"))),
        }
    }

    fn ends_for_controller(&self, why: &str) -> Failure {
        Failure::Ends(
            End::Controller(why.to_string()),
            Refused {
                status: 503,
                message: format!("agentrun: {why}; this step is over"),
            },
        )
    }

    /// A tool call: its recorded result, or made (gated, keyed, recorded).
    async fn call(&mut self, call: AgentCall) -> Result<ToolOutcome, Failure> {
        match self.call_once(call).await {
            Err(Failure::Diverges(why)) => Err(self.diverge(why).await?),
            other => other,
        }
    }

    async fn call_once(&mut self, call: AgentCall) -> Result<ToolOutcome, Failure> {
        let arguments = Value::Object(call.arguments);
        let digest = tool_digest(&call.tool, &arguments);
        let proposal = self.take_proposal(&digest);
        match self.matcher.tool(&digest) {
            Decision::Replay { seq } => self.intended(seq).await,
            Decision::Diverged { replaced } => {
                Err(self.diverged_call(replaced, &call.tool, &arguments).await?)
            }
            Decision::Live => match proposal {
                Some((model_call_seq, index)) => {
                    self.proposed(model_call_seq, index, digest, arguments)
                        .await
                }
                None => Err(Failure::Refused(Refused {
                    status: 400,
                    message: format!(
                        "agentrun: {} was called with arguments no model answer in this run proposed; \
                         agentrun records, keys and gates the calls the model proposes",
                        call.tool
                    ),
                })),
            },
        }
    }

    fn take_proposal(&mut self, digest: &str) -> Option<(u64, usize)> {
        let queue = self.proposals.get_mut(digest)?;
        let first = queue.pop_front();
        if queue.is_empty() {
            self.proposals.remove(digest);
        }
        first
    }

    /// The call recorded at `intent_seq`: its result, made now if the log
    /// holds none (an intent the last pod did not see through).
    async fn intended(&mut self, intent_seq: u64) -> Result<ToolOutcome, Failure> {
        if self.result_of(intent_seq).is_none() {
            let Some(Entry::ToolIntent(intent)) = self.runner.state.entry(intent_seq).cloned()
            else {
                unreachable!("the matcher replays tool calls from ToolIntent records");
            };
            self.runner.tool_step(intent_seq, intent).await?;
        }
        match self.result_of(intent_seq) {
            Some(outcome) => Ok(outcome),
            // The call's outcome is unknowable: a human is asked (the agent
            // gets no answer, as for a gate), or the run ends.
            None => Err(Failure::Ends(
                End::Controller("a call's outcome must be reconciled by a human".into()),
                Refused {
                    status: 202,
                    message: "agentrun: whether the call happened waits for a human".into(),
                },
            )),
        }
    }

    /// What the agent receives for the call at `intent_seq`, if it has a
    /// result: the result, with an approver's edit stated.
    fn result_of(&self, intent_seq: u64) -> Option<ToolOutcome> {
        let state = &self.runner.state;
        let result = state
            .records_from(intent_seq + 1)
            .find_map(|(_, e)| match e {
                Entry::ToolResult(r) if r.intent_seq == intent_seq => Some(r.outcome.clone()),
                _ => None,
            })?;
        let outcome: ToolOutcome = result.into();
        Some(match edit_note(state, intent_seq) {
            None => outcome,
            Some(note) => match outcome {
                ToolOutcome::Ok(value) => {
                    ToolOutcome::Ok(Value::String(format!("{note}\nResult: {value}")))
                }
                ToolOutcome::Failed { observation } => ToolOutcome::Failed {
                    observation: format!("{note}\nResult: {observation}"),
                },
            },
        })
    }

    /// Call `index` of the answer at `model_call_seq`, as the agent made it
    /// now: gated, intended with its key, made, recorded.
    async fn proposed(
        &mut self,
        model_call_seq: u64,
        index: usize,
        digest: String,
        arguments: Value,
    ) -> Result<ToolOutcome, Failure> {
        if let Some(outcome) = self.decided_before(model_call_seq, index).await? {
            return Ok(outcome);
        }
        if let Some(end) = self.controllers_turn() {
            return Err(end);
        }
        let Some(Entry::ModelCall(answer)) = self.runner.state.entry(model_call_seq) else {
            unreachable!("proposals come from ModelCall records");
        };
        let mut call: crate::model::ToolCall = answer.response.tool_calls[index].clone().into();
        call.arguments = arguments;
        let snap = self.runner.snapshot()?;
        let (checked, alternative) = crate::policy::split_alternative(&call.arguments);
        let network = self.runner.network(&snap, &call.name).await;
        match classification(&snap, &call, &checked, &network) {
            Classification::Allow => {
                let intent_seq = self
                    .runner
                    .intend(
                        (model_call_seq, index),
                        &call.id,
                        &call.name,
                        call.arguments.clone(),
                        Some(digest),
                        None,
                    )
                    .await?;
                self.intended(intent_seq).await
            }
            Classification::RequireApproval(gate) => {
                let proposed = (model_call_seq, index);
                Err(self
                    .request_approval(proposed, &call, checked, alternative, *gate)
                    .await?)
            }
        }
    }

    /// What the log already decided of call `index` of the answer at
    /// `model_call_seq`: its outcome if it was settled, or approved (made
    /// now if not yet); `None` while it is open for the agent to make.
    async fn decided_before(
        &mut self,
        model_call_seq: u64,
        index: usize,
    ) -> Result<Option<ToolOutcome>, Failure> {
        loop {
            match self.runner.state.call_state(model_call_seq, index) {
                CallState::Open => return Ok(None),
                CallState::Settled => return Ok(Some(failed(self.not_run(model_call_seq, index)))),
                CallState::Approved(request_seq, approved) => {
                    let Some(Entry::ApprovalRequested(request)) =
                        self.runner.state.entry(request_seq).cloned()
                    else {
                        unreachable!("an approval's state names its request");
                    };
                    // Voided (what the approver saw changed): decided again.
                    if let Flow::Again =
                        self.runner.approved(request_seq, request, approved).await?
                    {
                        continue;
                    }
                    let intent_seq = self.runner.head.len - 1;
                    return self.intended(intent_seq).await.map(Some);
                }
                state => {
                    let why =
                        format!("call {index} of record {model_call_seq} stands at {state:?}");
                    return Err(self.ends_for_controller(&why));
                }
            }
        }
    }

    /// Records the request for a gated call; the agent's turn ends there,
    /// waiting for the decision.
    async fn request_approval(
        &mut self,
        (model_call_seq, index): (u64, usize),
        call: &crate::model::ToolCall,
        checked: Value,
        alternative: Option<Value>,
        gate: crate::runlog::records::Gate,
    ) -> Result<Failure, StepError> {
        let request = crate::step::approval_request::request(
            &self.runner.state,
            model_call_seq,
            index,
            call,
            checked,
            alternative,
            gate,
            &self.runner.http,
        )
        .await;
        tracing::info!(tool = %call.name, rule = %request.gate.rule, "call needs approval; stopping the agent");
        self.runner
            .append(Entry::ApprovalRequested(request), None)
            .await?;
        Ok(Failure::Ends(
            End::Controller(format!("{} waits for approval", call.name)),
            Refused {
                status: 202,
                message: format!("agentrun: {} waits for approval", call.name),
            },
        ))
    }

    /// Why call `index` of the answer at `model_call_seq` did not run.
    fn not_run(&self, model_call_seq: u64, index: usize) -> String {
        let state = &self.runner.state;
        let decided = state
            .records_from(model_call_seq + 1)
            .rev()
            .find_map(|(_, e)| {
                let Entry::ApprovalDecided(d) = e else {
                    return None;
                };
                match state.entry(d.request_seq) {
                    Some(Entry::ApprovalRequested(r))
                        if r.model_call_seq == model_call_seq
                            && r.call_index == index
                            && d.settles_without_running() =>
                    {
                        Some(not_run_note(r, d))
                    }
                    _ => None,
                }
            });
        decided.unwrap_or_else(|| "the call did not run".to_string())
    }

    /// The agent's model request matches nothing recorded while recorded
    /// requests remain: the run stops, naming the one it most likely replaced.
    async fn diverged_model(&mut self, replaced: u64, asked: &Asked) -> Result<Failure, StepError> {
        let recorded = WireLog::request_at(self.runner.state.records(), replaced)
            .map_err(StepError::WireLog)?;
        let difference = recorded
            .as_ref()
            .and_then(|r| first_difference(r, &asked.canonical))
            .map(|d| format!("; first difference at {d}"))
            .unwrap_or_default();
        let why = format!(
            "the agent's model request does not match the request recorded at seq {replaced}{difference}"
        );
        self.diverge(why).await
    }

    async fn diverged_call(
        &mut self,
        replaced: u64,
        tool: &str,
        arguments: &Value,
    ) -> Result<Failure, StepError> {
        let recorded = match self.runner.state.entry(replaced) {
            Some(Entry::ToolIntent(i)) => format!("{} {}", i.tool, i.arguments),
            _ => "another call".into(),
        };
        let why = format!(
            "the agent called {tool} {} where the log recorded at seq {replaced} {}",
            crate::text::excerpt(&arguments.to_string(), 160),
            crate::text::excerpt(&recorded, 160),
        );
        self.diverge(why).await
    }

    /// Records the divergence as the run's end; nothing is asked or called.
    async fn diverge(&mut self, why: String) -> Result<Failure, StepError> {
        let why = crate::text::escape_controls(&format!(
            "Diverged: {why}. The agent is not deterministic given its recorded inputs \
             (a time or a random id in a prompt, another image, reads of the outside world); \
             nothing was asked or called"
        ));
        tracing::warn!(%why, "the run diverged");
        let finished = RunFinished {
            outcome: Outcome::Diverged,
            result: self.runner.state.last_text(),
            error: Some(why.clone()),
        };
        self.runner.stop(finished).await?;
        Ok(Failure::Ends(
            End::Controller("the run diverged".into()),
            Refused {
                status: 409,
                message: format!("agentrun: {why}"),
            },
        ))
    }

    /// The agent exited 0: its result recorded as the end it asks for (the
    /// controller vouches for it with the pod's status).
    async fn exited_well(&mut self, exit: AgentExit) -> Result<(), StepError> {
        let finished = match (exit.result, exit.result_unreadable) {
            (_, Some(why)) => RunFinished {
                outcome: Outcome::Failed,
                result: self.runner.state.last_text(),
                error: Some(format!(
                    "the agent exited 0 but its result file cannot be read: {why}"
                )),
            },
            (result, None) => RunFinished {
                outcome: Outcome::Succeeded,
                result: result.or_else(|| self.runner.state.last_text()),
                error: None,
            },
        };
        let text = match &finished.error {
            Some(error) => error.clone(),
            None => "the agent exited 0".into(),
        };
        let stop = Entry::Observation(Observation {
            text,
            about_seq: None,
            stop: Some(finished),
            attempts: None,
        });
        self.runner.append(stop, None).await?;
        Ok(())
    }
}

/// The driver as the loopback server holds it.
#[derive(Clone)]
struct Handle(Arc<Driver>);

impl Backend for Handle {
    fn model(&self, asked: Asked) -> BoxFuture<'static, Result<Answer, Refused>> {
        let driver = self.0.clone();
        Box::pin(async move { driver.answer_model(asked).await })
    }

    fn exited(&self, exit: AgentExit) -> BoxFuture<'static, ()> {
        let driver = self.0.clone();
        Box::pin(async move { driver.agent_exited(exit).await })
    }

    fn ready(&self) -> bool {
        true
    }

    fn stopped(&self) -> BoxFuture<'static, ()> {
        let mut end = self.0.end.subscribe();
        Box::pin(async move {
            let _ = end.wait_for(Option::is_some).await;
        })
    }
}

impl Calls for Handle {
    fn call(&self, call: AgentCall) -> BoxFuture<'static, ToolOutcome> {
        let driver = self.0.clone();
        Box::pin(async move { driver.answer_call(call).await })
    }
}
