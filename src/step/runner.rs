//! `agentrun step`: what one step Job runs. Takes the run's lease, replays
//! the log, and executes steps, recording each before acting on it, until
//! its time slice ends or the run needs the controller.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument as _;

use super::approval_request;
use super::prompt::{ContextPlan, plan};
use super::spans;
use crate::failpoint;
use crate::model::{AttemptOutcome, ModelClient, ModelError, ModelResponse, cost_usd};
use crate::policy::{Classification, classify};
use crate::refusal::Refusal;
use crate::replay::DecodeError;
use crate::replay::{Entry, Next, RunState, Snapshot};
use crate::runlog::budget;
use crate::runlog::records::*;
use crate::sandbox;
use crate::store::{self, AnchorError, Head, KeyError, Lease, StepStore, StoreError};
use crate::telemetry::trace;
use crate::tools::{CallContext, LookupOutcome, ToolError, ToolOutcome, Toolbox, idempotency_key};

/// How long a lease lives without a heartbeat; the controller notices a lost
/// worker once it expires.
pub const LEASE_TTL: Duration = Duration::from_secs(8);
/// How long after the store accepted a write of this worker's epoch it may
/// call out without renewing first (see [`Runner::hold_lease`]).
const LEASE_PROOF_FRESH: Duration = Duration::from_millis(50);
const HEARTBEAT: Duration = Duration::from_secs(2);

/// What the step Job passes in (environment variables set by the controller).
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// The run's uid: its key in the store.
    #[arg(long, env = "AGENTRUN_RUN_UID")]
    pub run_uid: String,
    #[arg(long, env = "AGENTRUN_RUN_NAME", default_value = "")]
    pub run_name: String,
    /// The step-log gateway (`http://…`, token in `AGENTRUN_STORE_TOKEN`), or
    /// a database URL when run outside a cluster.
    #[arg(long, env = "AGENTRUN_STORE_URL", hide_env_values = true)]
    pub store_url: String,
    /// The log head the controller verified (`<length>:<hash>`): the log
    /// read here must extend it.
    #[arg(long, env = "AGENTRUN_LOG_ANCHOR")]
    pub log_anchor: Option<String>,
    /// The controller's public keys (hex, comma-separated, the current one
    /// first): controller records (decisions among them) are acted on only
    /// with a signature by one of them, bound to this run and seq.
    #[arg(long, env = "AGENTRUN_CONTROLLER_KEY")]
    pub controller_key: Option<String>,
    /// Controller records before this seq predate signing (`status.log.signedFrom`).
    #[arg(long, env = "AGENTRUN_SIGNED_FROM", default_value_t = 0)]
    pub signed_from: u64,
    /// Controller records from this seq on must be signed for this run and
    /// seq (`status.log.boundFrom`); before it legacy signatures count.
    #[arg(long, env = "AGENTRUN_BOUND_FROM", default_value_t = 0)]
    pub bound_from: u64,
    /// Where each controller key signs this run's records
    /// (`<key id>:<from seq>,...`, `status.log.signingKeys`): a retired
    /// key's signature counts only before the key after it took over.
    /// Unset: none recorded (an earlier release's controller).
    #[arg(long, env = "AGENTRUN_SIGNING_KEYS")]
    pub signing_keys: Option<String>,
    #[arg(long, env = "AGENTRUN_MODEL_API_KEY", hide_env_values = true)]
    pub model_api_key: Option<String>,
    /// Worker identity (the pod's name).
    #[arg(long, env = "POD_NAME", default_value = "local")]
    pub worker: String,
    #[arg(long, env = "AGENTRUN_ATTEMPT", default_value_t = 1)]
    pub attempt: u32,
    /// Keep taking further steps for this long, then exit.
    #[arg(long, env = "AGENTRUN_TIME_SLICE_SECONDS", default_value_t = 60)]
    pub time_slice_seconds: u64,
    /// The Job's deadline (the agent's step timeout): a model call and its
    /// retries end early enough to record why before the pod is killed.
    #[arg(long, env = "AGENTRUN_STEP_TIMEOUT_SECONDS")]
    pub step_timeout_seconds: Option<u64>,
    /// A container agent's step: where to serve the agent on the pod's loopback.
    #[arg(long, env = "AGENTRUN_LOOPBACK_ADDR")]
    pub loopback_addr: Option<String>,
    /// The pod's loopback key (the agent's `OPENAI_API_KEY`).
    #[arg(long, env = "AGENTRUN_RUNNER_KEY", hide_env_values = true)]
    pub runner_key: Option<String>,
}

/// Time kept back from the step timeout to record a failed model call.
const RECORD_MARGIN: Duration = Duration::from_secs(5);

impl StepArgs {
    /// The signature rules the controller passed for this run's log.
    fn signature_rules(&self) -> Result<store::SignatureRules, StepError> {
        let keys = match &self.signing_keys {
            Some(text) => store::KeyWindows::parse(text).map_err(StepError::SigningKeys)?,
            None => store::KeyWindows::Unrecorded,
        };
        Ok(store::SignatureRules {
            signed_from: self.signed_from,
            bound_from: self.bound_from,
            keys,
        })
    }

    /// When model calls must have ended, counted from `started`.
    fn model_deadline(&self, started: Instant) -> Option<Instant> {
        let timeout = Duration::from_secs(self.step_timeout_seconds?);
        // A short timeout keeps at least half of itself for the call.
        let margin = RECORD_MARGIN.min(timeout / 2);
        Some(started + timeout - margin)
    }
}

/// The worker lost the run's lease while it ran (its heartbeat was refused:
/// another worker took the run over). The runner stops at once, leaving the
/// lease to its new holder; the `step` subcommand exits with
/// [`LEASE_LOST_EXIT_CODE`].
#[derive(Debug, thiserror::Error)]
#[error("lost the run lease: another worker took the run over; stopped")]
pub struct LeaseLost;

/// Exit code of `agentrun step` when the worker lost its lease ([`LeaseLost`]).
pub const LEASE_LOST_EXIT_CODE: i32 = 3;

/// Why a step Job stopped short. Each variant names what was being done;
/// the store's, model's or tools' error below it says why. Where the
/// message always quoted its cause (a malformed environment variable), the
/// cause is a plain field, so the line never says it twice.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("opening the step store")]
    OpenStore(#[source] StoreError),
    #[error("taking the run lease")]
    TakeLease(#[source] StoreError),
    #[error(transparent)]
    LeaseLost(#[from] LeaseLost),
    #[error("AGENTRUN_LOG_ANCHOR: {0}")]
    LogAnchor(AnchorError),
    #[error("AGENTRUN_CONTROLLER_KEY: {0}")]
    ControllerKey(KeyError),
    #[error("AGENTRUN_SIGNING_KEYS: {0}")]
    SigningKeys(Refusal),
    #[error("reading and verifying the step log")]
    ReadLog(#[source] StoreError),
    #[error("checking the step log against the controller's anchor")]
    CheckAnchor(#[source] StoreError),
    #[error("checking the controller's signatures in the step log")]
    CheckSignatures(#[source] StoreError),
    /// A record the log holds that is no step of this release.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The client dependency lookups are made with.
    #[error(transparent)]
    LookupClient(#[from] reqwest::Error),
    #[error("the log of run {run} has no RunStarted record")]
    NoRunStarted { run: String },
    #[error("run has no snapshot")]
    NoSnapshot,
    #[error("budgets.onExhausted is Ask but the agent names no budget approvers")]
    NoBudgetApprovers,
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tools(#[from] ToolError),
    #[error("lost the run lease: another worker took the run over; not calling out")]
    HoldLease(#[source] StoreError),
    /// The next record could not be sealed onto the head.
    #[error(transparent)]
    Seal(StoreError),
    #[error("reviving the lapsed run lease")]
    ReviveLease(#[source] StoreError),
    #[error("appending to the step log")]
    Append(#[source] StoreError),
    /// A container agent's log whose recorded requests do not restore.
    #[error("reading the agent's recorded requests")]
    WireLog(#[source] super::wire_log::WireLogError),
    #[error("serving the agent on {addr}")]
    Loopback {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent exited with code {code}")]
    AgentFailed { code: i32 },
    #[error("a container agent's step needs AGENTRUN_LOOPBACK_ADDR and AGENTRUN_RUNNER_KEY")]
    NoLoopback,
}

impl StepError {
    /// Whether the worker stopped because another took the run over (the
    /// `step` subcommand then exits with [`LEASE_LOST_EXIT_CODE`]).
    ///
    /// The heartbeat is not the only one to learn it: an append, a renewal
    /// before a call or a revival refused for a stale epoch says the same,
    /// whichever comes first.
    pub fn lease_lost(&self) -> bool {
        match self {
            StepError::LeaseLost(_) => true,
            StepError::HoldLease(e) | StepError::ReviveLease(e) | StepError::Append(e) => {
                matches!(e, StoreError::StaleEpoch { .. })
            }
            _ => false,
        }
    }
}

/// Runs steps until the slice ends or the run is done.
pub async fn run(args: StepArgs) -> anyhow::Result<()> {
    let store = store::open(&args.store_url)
        .await
        .map_err(StepError::OpenStore)?;
    Ok(run_on(args, store).await?)
}

/// [`run`] on a store opened by the caller (the e2e process node runs step
/// pods in process, with each pod's gateway token, not the process's env).
#[tracing::instrument(name = "step_job", skip_all, fields(run = %args.run_name, run_uid = %args.run_uid, attempt = args.attempt, pod = %args.worker))]
pub async fn run_on(args: StepArgs, store: Arc<dyn StepStore>) -> Result<(), StepError> {
    let span = spans::step(&args.run_name, &args.run_uid, args.attempt, &args.worker);
    let started = Instant::now();
    let result = attempt(args, store, &span, started)
        .instrument(span.clone())
        .await;
    if let Err(e) = &result {
        let kind = match e.lease_lost() {
            true => "lease_lost",
            false => "step_failed",
        };
        spans::record_error(&span, kind);
    }
    result
}

async fn attempt(
    args: StepArgs,
    store: Arc<dyn StepStore>,
    span: &tracing::Span,
    started: Instant,
) -> Result<(), StepError> {
    // A container agent's shim knows the runner is up once it connects,
    // and gone once it is refused: the listener comes first (requests wait
    // in its queue until the agent is served).
    let listener = match &args.loopback_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StepError::Loopback {
                    addr: addr.clone(),
                    source,
                })?,
        ),
        None => None,
    };
    let lease = acquire(&*store, &args).await?;
    failpoint::hit("after-lease");
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    // Stops with this future, however it ends: dropped (its task aborted),
    // the heartbeat must not hold the lease for a runner that is gone.
    let heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
        store.clone(),
        lease.clone(),
        lost_tx,
    )));

    let work = async {
        let mut runner = Runner::load(store.clone(), &args, lease.clone(), started).await?;
        let replayed = runner.head.len;
        if runner.state.runs_a_container() && runner.state.sandbox().is_some() {
            // A replay test answers calls only where this runner proposes
            // them; a container agent's would reach its tools' servers.
            let finished = RunFinished {
                outcome: Outcome::Failed,
                result: None,
                error: Some(sandbox::CONTAINER_AGENT.into()),
            };
            return runner.stop(finished).await;
        }
        if runner.state.runs_a_container() {
            // No time slice: a new pod would start the agent over.
            let loopback = match (&args.loopback_addr, listener, &args.runner_key) {
                (Some(addr), Some(listener), Some(key)) => container::Loopback {
                    addr: addr.clone(),
                    listener,
                    key: key.clone(),
                },
                _ => return Err(StepError::NoLoopback),
            };
            return container::drive(runner, loopback).await;
        }
        let driven = runner
            .drive(Duration::from_secs(args.time_slice_seconds))
            .await;
        spans::record_log(span, replayed, runner.head.len - replayed);
        driven
    };
    let result = tokio::select! {
        result = work => result,
        // Someone else owns the run now: stop wherever the work is (our
        // appends would be refused anyway) and leave the lease alone.
        Ok(()) = lost_rx => return Err(LeaseLost.into()),
    };
    drop(heartbeat);
    if let Err(e) = store.release(&lease).await {
        tracing::warn!(error = %e, "releasing the run lease failed; it will expire");
    }
    result
}

/// Takes the lease, waiting out a previous worker's lease if it is still
/// live, and a store (or gateway) outage as long as appends would.
async fn acquire(store: &dyn StepStore, args: &StepArgs) -> Result<Lease, StepError> {
    let started = Instant::now();
    loop {
        let waited = started.elapsed();
        match store.acquire(&args.run_uid, &args.worker, LEASE_TTL).await {
            Ok(lease) => {
                tracing::info!(run = %args.run_uid, epoch = lease.epoch, "took the run lease");
                return Ok(lease);
            }
            Err(e @ StoreError::LeaseHeld { .. }) if waited < LEASE_TTL * 3 => {
                tracing::info!(error = %e, "waiting for the run lease");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e @ StoreError::Unavailable { .. }) if waited < Duration::from_secs(120) => {
                tracing::info!(error = %e, "waiting for the run lease");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(StepError::TakeLease(e)),
        }
    }
}

/// A task aborted when this handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews the lease every [`HEARTBEAT`]; reports a takeover on `lost` and ends.
async fn heartbeat(
    store: Arc<dyn StepStore>,
    mut lease: Lease,
    lost: tokio::sync::oneshot::Sender<()>,
) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        match store.renew(&lease, LEASE_TTL).await {
            Ok(l) => lease = l,
            Err(StoreError::StaleEpoch { .. }) => {
                tracing::error!("lost the run lease; stopping");
                let _ = lost.send(());
                return;
            }
            Err(e) => tracing::warn!(error = %e, "renewing the run lease failed; retrying"),
        }
    }
}

/// Whether [`Runner::drive`] goes on after [`Runner::take_step`].
enum Flow {
    /// A step was taken: go on unless this is where to leave.
    Stepped,
    /// Nothing that counts as a step was taken: decide again at once.
    Again,
    /// The run needs the controller (or is at its end): leave.
    Exit,
}

struct Runner {
    store: Arc<dyn StepStore>,
    args: StepArgs,
    lease: Lease,
    head: Head,
    state: RunState,
    /// Intents this process recorded itself (so executing them is not a recovery).
    own_intents: HashSet<u64>,
    tools: Option<(String, Toolbox)>,
    /// Where the names of this pod's calls lead, looked up once: what a
    /// call's classification matched is what its tool client connects to.
    pins: crate::dns::Pins,
    /// For dependency lookups.
    http: reqwest::Client,
    /// The controller asked this worker to stop at the next step boundary.
    yielding: bool,
    /// When this process started (its pod's deadline counts from about then).
    started: Instant,
    /// When the store last accepted a write of this worker at its epoch
    /// (an append or a renewal), as of sending it: the lease was this
    /// worker's then.
    proven: Option<Instant>,
}

impl Runner {
    async fn load(
        store: Arc<dyn StepStore>,
        args: &StepArgs,
        lease: Lease,
        started: Instant,
    ) -> Result<Runner, StepError> {
        // The whole chain is verified, and it must extend what the controller anchored.
        let anchor = match &args.log_anchor {
            Some(a) => Head::parse_anchor(a).map_err(StepError::LogAnchor)?,
            None => Head::EMPTY,
        };
        let records = with_store_retry(|| store.read_verified(&args.run_uid, None))
            .await
            .map_err(StepError::ReadLog)?;
        store::check_anchor(&args.run_uid, &records, &anchor).map_err(StepError::CheckAnchor)?;
        if let Some(key) = &args.controller_key {
            store::RecordVerifier::from_hex(key)
                .map_err(StepError::ControllerKey)?
                .check(&args.run_uid, &records, &args.signature_rules()?)
                .map_err(StepError::CheckSignatures)?;
        }
        let mut steps = Vec::with_capacity(records.len());
        for r in &records {
            steps.push(Entry::decode(r.seq, r.kind.as_str(), &r.payload)?);
        }
        let head = records.last().map(|r| r.head()).unwrap_or(Head::EMPTY);
        let state = RunState::replay(steps);
        tracing::info!(run = %args.run_uid, records = head.len, "replayed the log");
        Ok(Runner {
            store,
            args: args.clone(),
            lease,
            head,
            state,
            own_intents: HashSet::new(),
            tools: None,
            pins: crate::dns::Pins::default(),
            http: approval_request::lookup_client()?,
            yielding: false,
            started,
            proven: None,
        })
    }

    /// Takes steps until one needs the controller, the agent changes, or the
    /// time slice is over.
    async fn drive(&mut self, slice: Duration) -> Result<(), StepError> {
        let until = Instant::now() + slice;
        loop {
            match self.take_step(self.state.next()).await? {
                Flow::Exit => return Ok(()),
                Flow::Again => {}
                Flow::Stepped if self.at_exit_boundary(until) => return Ok(()),
                Flow::Stepped => {}
            }
        }
    }

    /// Does what the log says comes next, and says whether to go on.
    async fn take_step(&mut self, next: Next) -> Result<Flow, StepError> {
        if self.state.sandbox().is_some()
            && matches!(next, Next::Approved { .. } | Next::Reconciled { .. })
        {
            // A test writes no approval request; should its log hold a
            // decided one, nothing is read or called for it either.
            let finished = RunFinished {
                outcome: Outcome::Failed,
                result: self.state.last_text(),
                error: Some(
                    "replay test: its log holds a decided approval, which a test never asks for"
                        .into(),
                ),
            };
            self.stop(finished).await?;
            return Ok(Flow::Exit);
        }
        match next {
            // A container agent's runner is another driver; this one has
            // nothing to do for it.
            Next::Done | Next::AgentTurn => return Ok(Flow::Exit),
            Next::NotStarted => {
                return Err(StepError::NoRunStarted {
                    run: self.args.run_uid.clone(),
                });
            }
            Next::CallModel => self.model_step().await?,
            Next::RecordIntent {
                model_call_seq,
                call_index,
                call,
            } => return self.record_intent(model_call_seq, call_index, call).await,
            Next::Reconciled {
                intent_seq,
                intent,
                happened,
                decided_seq,
            } => {
                self.reconciled(intent_seq, intent, happened, decided_seq)
                    .await?
            }
            Next::AwaitApproval { request_seq } => {
                tracing::info!(request_seq, "waiting for an approval decision; exiting");
                return Ok(Flow::Exit);
            }
            Next::Approved {
                request_seq,
                request,
                arguments,
            } => return self.approved(request_seq, *request, arguments).await,
            Next::ExecuteTool { intent_seq, intent } => self.tool_step(intent_seq, intent).await?,
            Next::AskBudget { reason, arguments } => {
                return self.ask_budget(&reason, arguments).await;
            }
            Next::Finish { .. } | Next::Stop(_) => {
                tracing::info!("the run is at its end; the controller records it");
                return Ok(Flow::Exit);
            }
        }
        Ok(Flow::Stepped)
    }

    /// Whether to leave after a step: the agent changed (the next Job runs
    /// its new version), or the slice is over. A slice never ends between an
    /// intent and its call, so that the next Job does not start with a recovery.
    fn at_exit_boundary(&self, until: Instant) -> bool {
        if self.yielding {
            tracing::info!(
                records = self.state.len(),
                "the agent changed; yielding at this step boundary for the next Job"
            );
            return true;
        }
        if Instant::now() >= until && !matches!(self.state.next(), Next::ExecuteTool { .. }) {
            tracing::info!(
                records = self.state.len(),
                "time slice over; exiting for the next Job"
            );
            return true;
        }
        false
    }

    /// Records the intent to make the model's next call, or, when the
    /// pinned policy gates it, asks for approval and exits: the decision is
    /// the controller's, and a later Job goes on from it.
    async fn record_intent(
        &mut self,
        model_call_seq: u64,
        call_index: usize,
        call: crate::model::ToolCall,
    ) -> Result<Flow, StepError> {
        if let Some(sandbox) = self.state.sandbox_shared() {
            return self
                .sandboxed_intent(model_call_seq, call_index, call, &sandbox)
                .await;
        }
        let snap = self.snapshot()?;
        let (arguments, alternative) = crate::policy::split_alternative(&call.arguments);
        let network = self.network(&snap, &call.name).await;
        match classification(&snap, &call, &arguments, &network) {
            Classification::Allow => {
                let arguments = call.arguments.clone();
                self.intend(
                    (model_call_seq, call_index),
                    &call.id,
                    &call.name,
                    arguments,
                    None,
                    None,
                )
                .await?;
                Ok(Flow::Stepped)
            }
            Classification::RequireApproval(gate) => {
                let request = approval_request::request(
                    &self.state,
                    model_call_seq,
                    call_index,
                    &call,
                    arguments,
                    alternative,
                    *gate,
                    &self.http,
                )
                .await;
                tracing::info!(tool = %call.name, rule = %request.gate.rule, "call needs approval; stopping");
                self.append(Entry::ApprovalRequested(request), None).await?;
                Ok(Flow::Exit)
            }
        }
    }

    /// A replay test's call: answered by the recorded call it matches (with
    /// the arguments it was made with), never gated; or, matching none,
    /// the test ends `Diverged` with both calls side by side.
    async fn sandboxed_intent(
        &mut self,
        model_call_seq: u64,
        call_index: usize,
        call: crate::model::ToolCall,
        sandbox: &Sandbox,
    ) -> Result<Flow, StepError> {
        let (index, made_with) =
            match sandbox::answer(&self.state, sandbox, model_call_seq, call_index) {
                Some(sandbox::Answer::Recorded { index, call: rec }) => {
                    (index, rec.made_with.clone())
                }
                Some(sandbox::Answer::Diverged { position, instead }) => {
                    let error = sandbox::divergence(&call.name, &call.arguments, position, instead);
                    self.stop(RunFinished {
                        outcome: Outcome::Diverged,
                        result: self.state.last_text(),
                        error: Some(error),
                    })
                    .await?;
                    return Ok(Flow::Exit);
                }
                None => unreachable!("the call to intend is the log's own proposal"),
            };
        // Whether the new version's policy would have asked a human: the
        // report counts it; nobody is asked. A test resolves no name (it
        // reads nothing of the world): the policy's network is unpinned.
        let snap = self.snapshot()?;
        let (arguments, _) = crate::policy::split_alternative(&call.arguments);
        let network = crate::policy::Network::of(&snap.namespace);
        let gated = matches!(
            classification(&snap, &call, &arguments, &network),
            Classification::RequireApproval(_)
        );
        let arguments = made_with.unwrap_or_else(|| call.arguments.clone());
        let sandboxed = Sandboxed {
            recorded: index,
            gated,
        };
        self.intend(
            (model_call_seq, call_index),
            &call.id,
            &call.name,
            arguments,
            None,
            Some(sandboxed),
        )
        .await?;
        Ok(Flow::Stepped)
    }

    /// A replay test's call is never made: its result is the recorded one.
    /// An intent of a test that names no recorded call (none this runner
    /// writes) gets an error, and nothing is called either.
    async fn sandboxed_result(
        &mut self,
        intent_seq: u64,
        intent: ToolIntent,
        sandbox: &Sandbox,
    ) -> Result<(), StepError> {
        let recorded = intent.sandboxed.and_then(|s| sandbox.calls.get(s.recorded));
        let outcome = match recorded {
            Some(call) => call.outcome.clone(),
            None => crate::runlog::v1::ToolOutcome::Failed {
                observation: "replay test: this call names no recorded call; nothing was called"
                    .into(),
            },
        };
        let result = ToolResult {
            intent_seq,
            call_id: intent.call_id,
            tool: intent.tool,
            outcome,
            recovery: None,
        };
        self.append(Entry::ToolResult(result), None).await?;
        Ok(())
    }

    /// A budget is used up and the agent asks: records the question for
    /// the budget's approvers and exits (the controller raises the Approval).
    async fn ask_budget(
        &mut self,
        reason: &str,
        arguments: serde_json::Value,
    ) -> Result<Flow, StepError> {
        if self.state.sandbox().is_some() {
            // A replay test asks nobody: its budget ends it.
            let finished = RunFinished {
                outcome: Outcome::BudgetExceeded,
                result: self.state.last_text(),
                error: Some(reason.to_string()),
            };
            self.stop(finished).await?;
            return Ok(Flow::Exit);
        }
        let snap = self.snapshot()?;
        let Some(gate) = crate::policy::budget_gate(&snap.agent) else {
            return Err(StepError::NoBudgetApprovers);
        };
        let request = approval_request::budget_request(&self.state, reason, arguments, gate);
        tracing::info!(%reason, "budget used up; asking its approvers and stopping");
        self.append(Entry::ApprovalRequested(request), None).await?;
        Ok(Flow::Exit)
    }

    /// A human said whether a call of unknowable outcome happened: recorded
    /// as its result if it did, made now (with its key) if it did not.
    async fn reconciled(
        &mut self,
        intent_seq: u64,
        intent: ToolIntent,
        happened: bool,
        decided_seq: u64,
    ) -> Result<(), StepError> {
        let (outcome, recovery) = if happened {
            let note =
                format!("a human confirmed the call happened (decision at record {decided_seq})");
            (
                ToolOutcome::Ok(serde_json::json!({ "reconciled": note })),
                Recovery::HumanConfirmedDone,
            )
        } else {
            let ctx = CallContext::new(self.args.run_uid.clone(), intent_seq, intent.key.clone());
            let (stamp, tools) = self.take_toolbox()?;
            self.hold_lease("before-tool-call").await?;
            let outcome = tools.call(&intent.tool, &intent.arguments, &ctx).await;
            failpoint::hit("after-tool-call");
            self.tools = Some((stamp, tools));
            (outcome, Recovery::HumanConfirmedNotDone)
        };
        let result = ToolResult {
            intent_seq,
            call_id: intent.call_id,
            tool: intent.tool,
            outcome: outcome.into(),
            recovery: Some(recovery),
        };
        self.append(Entry::ToolResult(result), None).await?;
        Ok(())
    }

    /// An approved call runs only if what the approver saw is still true
    /// (its dependencies' versions): else the approval is voided, which is
    /// no step, and the call is decided again at once.
    async fn approved(
        &mut self,
        request_seq: u64,
        request: ApprovalRequested,
        arguments: serde_json::Value,
    ) -> Result<Flow, StepError> {
        let now =
            approval_request::read_dependencies(&request.gate.dependencies, &arguments, &self.http)
                .await;
        if let Some(reason) = approval_request::changed(&request.dependencies, &now) {
            tracing::info!(request_seq, %reason, "approval voided");
            let voided = ApprovalVoided {
                request_seq,
                reason,
                dependencies: now,
            };
            self.append(Entry::ApprovalVoided(voided), None).await?;
            return Ok(Flow::Again);
        }
        let requested = self.requested(request.model_call_seq, request.call_index);
        self.intend(
            (request.model_call_seq, request.call_index),
            &request.call_id,
            &request.tool,
            arguments,
            requested,
            None,
        )
        .await?;
        Ok(Flow::Stepped)
    }

    /// Records the intent to make a call, with its idempotency key.
    /// `at`: the ModelCall that proposed it and the call's index there.
    async fn intend(
        &mut self,
        at: (u64, usize),
        call_id: &str,
        tool: &str,
        arguments: serde_json::Value,
        requested: Option<String>,
        sandboxed: Option<Sandboxed>,
    ) -> Result<u64, StepError> {
        let (model_call_seq, call_index) = at;
        let intent = ToolIntent {
            requested,
            model_call_seq,
            call_index,
            call_id: call_id.to_string(),
            tool: tool.to_string(),
            arguments,
            key: idempotency_key(&self.args.run_uid, model_call_seq, call_index),
            sandboxed,
        };
        let seq = self.append(Entry::ToolIntent(intent), None).await?;
        self.own_intents.insert(seq);
        Ok(seq)
    }

    /// The digest of call `call_index` of the answer at `model_call_seq` as
    /// proposed, which a container agent sends: recorded with its intent so
    /// replay matches the agent's call after an approver's edit.
    fn requested(&self, model_call_seq: u64, call_index: usize) -> Option<String> {
        if !self.state.runs_a_container() {
            return None;
        }
        match self.state.entry(model_call_seq) {
            Some(Entry::ModelCall(m)) => m
                .response
                .tool_calls
                .get(call_index)
                .map(|c| crate::wire::canonical::tool_digest(&c.name, &c.arguments)),
            _ => None,
        }
    }

    fn snapshot(&self) -> Result<Snapshot, StepError> {
        self.state.snapshot.clone().ok_or(StepError::NoSnapshot)
    }

    #[tracing::instrument(name = "model_step", skip_all, fields(step = self.head.len))]
    async fn model_step(&mut self) -> Result<(), StepError> {
        let snap = self.snapshot()?;
        let budgets = self.state.budgets();
        if let Some(reason) = self.state.budget_exceeded(budgets.as_ref()) {
            if let Some(b) = budgets.as_ref().filter(|b| budget::asks(Some(b))) {
                let arguments = self.state.budget_proposal(b);
                self.ask_budget(&reason, arguments).await?;
                return Ok(());
            }
            let finished = RunFinished {
                outcome: Outcome::BudgetExceeded,
                result: self.state.last_text(),
                error: Some(reason),
            };
            self.stop(finished).await?;
            return Ok(());
        }
        let mut client = ModelClient::new(&snap.agent.model, self.args.model_api_key.clone())?;
        if let Some(deadline) = self.args.model_deadline(self.started) {
            client = client.within(deadline);
        }
        match plan(&self.state, &snap) {
            ContextPlan::Compact {
                request,
                through_seq,
            } => {
                let Some((response, attempts)) = self.ask(&client, &request).await? else {
                    return Ok(());
                };
                let cost = cost_usd(snap.agent.model.prices.as_ref(), &response.usage);
                let text = response.text.clone().unwrap_or_default();
                let summary = Summary {
                    text,
                    through_seq,
                    response: response.into(),
                    cost_usd: cost,
                    attempts: Some(attempts),
                };
                self.append(Entry::Summary(summary), None).await?;
            }
            ContextPlan::Call(request, context) => {
                let Some((response, attempts)) = self.ask(&client, &request).await? else {
                    return Ok(());
                };
                let cost = cost_usd(snap.agent.model.prices.as_ref(), &response.usage);
                let model_id = response.model_id.clone();
                self.append(
                    Entry::ModelCall(ModelCall {
                        request: None,
                        response: response.into(),
                        cost_usd: cost,
                        context,
                        attempts: Some(attempts),
                    }),
                    Some(model_id),
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Calls the model: its answer, with the attempts it took (for the record
    /// the caller appends). A reply that cannot be read is recorded and told to
    /// the model; a refusal (bad request, bad key) or an outage that outlasted
    /// the retries is recorded and ends the run.
    async fn ask(
        &mut self,
        client: &ModelClient,
        request: &crate::model::ModelRequest,
    ) -> Result<Option<(ModelResponse, ModelAttempts)>, StepError> {
        // Always renewed, however fresh the proof: the renewal is how this
        // worker learns that the controller asks it to yield.
        self.renew_lease("before-model-call").await?;
        // A model call starts a step: where a FollowLatest run moves to its
        // Agent's new version, never with the old prompt asked once more.
        if self.lease.yield_requested {
            self.yielding = true;
            return Ok(None);
        }
        let span = spans::chat(client, request);
        let (answer, outcomes) = client
            .complete_counted(request)
            .instrument(span.clone())
            .await;
        let attempts = recorded_attempts(client, &outcomes);
        spans::record_chat(&span, &answer);
        // The span ends before the answer is recorded, and leaves before
        // then too: a crash after the record loses no span, and a call the
        // log lacks is asked again and reported again, as it happened again.
        drop(span);
        trace::flush().await;
        match answer {
            Ok(response) => {
                failpoint::hit("after-model-call");
                Ok(Some((response, attempts)))
            }
            Err(e @ ModelError::Malformed { .. }) => {
                // Recorded and fed back: the model sees what went wrong on its next turn.
                let text = format!(
                    "Your previous reply could not be read ({e}). Reply again, with valid tool calls."
                );
                self.append(
                    Entry::Observation(Observation {
                        text,
                        about_seq: None,
                        stop: None,
                        attempts: Some(attempts),
                    }),
                    None,
                )
                .await?;
                Ok(None)
            }
            Err(e) => {
                self.provider_failed(client, &e, attempts).await?;
                Ok(None)
            }
        }
    }

    /// A provider's refusal, or an outage that outlasted the retries (and the
    /// step's time): recorded with who answered what, and the run stops. A
    /// pod crash would say nothing, and asking again would get the same.
    async fn provider_failed(
        &mut self,
        client: &ModelClient,
        e: &ModelError,
        attempts: ModelAttempts,
    ) -> Result<(), StepError> {
        let why = match e {
            ModelError::Unavailable { .. } => "did not answer in time",
            ModelError::Config(_) => "could not be called",
            _ => "refused the request",
        };
        let text = crate::text::escape_controls(&format!("the {} {why}: {e}", client.describe()));
        self.append(
            Entry::Observation(Observation {
                text: text.clone(),
                about_seq: None,
                stop: None,
                // A configuration error sent nothing: no attempts to count.
                attempts: (!attempts.outcomes.is_empty()).then_some(attempts),
            }),
            None,
        )
        .await?;
        let finished = RunFinished {
            outcome: Outcome::Failed,
            result: self.state.last_text(),
            error: Some(text),
        };
        self.stop(finished).await
    }

    /// The toolbox of the current snapshot, taken out of `self` while in use
    /// (put it back with `self.tools = Some(..)`); rebuilt when versions change.
    fn take_toolbox(&mut self) -> Result<(String, Toolbox), StepError> {
        let snap = self.snapshot()?;
        let stamp = snap.versions.tool_schema_hash.clone();
        match self.tools.take() {
            Some((s, tools)) if s == stamp => Ok((s, tools)),
            _ => Ok((
                stamp,
                Toolbox::pinned(&snap.agent.tools, &snap.mcp, self.pins.clone())?,
            )),
        }
    }

    /// The network a call of `tool` goes out on: the names its policy
    /// decision depends on are pinned first (looked up once in this pod;
    /// the tool client connects to the same addresses).
    async fn network(&self, snap: &Snapshot, tool: &str) -> crate::policy::Network {
        let unpinned = crate::policy::Network::of(&snap.namespace);
        let target = crate::policy::Call::of(&snap.agent, tool, &unpinned).target;
        let names = crate::policy::lookups(snap.agent.approval.as_ref(), &target, &snap.namespace);
        self.pins.pin(&names).await;
        self.pins.network(&snap.namespace)
    }

    #[tracing::instrument(name = "tool_step", skip_all, fields(step = self.head.len, intent = intent_seq, tool = %intent.tool))]
    async fn tool_step(&mut self, intent_seq: u64, intent: ToolIntent) -> Result<(), StepError> {
        if let Some(sandbox) = self.state.sandbox_shared() {
            return self.sandboxed_result(intent_seq, intent, &sandbox).await;
        }
        let recovering = !self.own_intents.contains(&intent_seq);
        let ctx = CallContext::new(self.args.run_uid.clone(), intent_seq, intent.key.clone());
        let (stamp, tools) = self.take_toolbox()?;
        let repeat_safe = tools.is_idempotent(&intent.tool)
            || tools.is_read_only(&intent.tool)
            || !tools.contains(&intent.tool);
        let (outcome, recovery) = if !recovering || repeat_safe {
            self.hold_lease("before-tool-call").await?;
            let outcome = call_tool(&tools, &intent, &ctx).await;
            failpoint::hit("after-tool-call");
            (outcome, recovering.then_some(Recovery::RetriedWithSameKey))
        } else {
            // The call may have happened: never assume it did not. Ask the tool.
            match tools.lookup(&intent.tool, &intent.arguments, &ctx).await {
                LookupOutcome::Done(value) => {
                    (ToolOutcome::Ok(value), Some(Recovery::LookupFoundResult))
                }
                LookupOutcome::NotDone => {
                    self.hold_lease("before-tool-call").await?;
                    let outcome = call_tool(&tools, &intent, &ctx).await;
                    failpoint::hit("after-tool-call");
                    (outcome, Some(Recovery::LookupFoundNothing))
                }
                LookupOutcome::Unknown { reason } => {
                    self.tools = Some((stamp, tools));
                    let snap = self.snapshot()?;
                    let network = self.network(&snap, &intent.tool).await;
                    // Who can say whether it happened: the approvers the policy names for this tool.
                    let gate = crate::policy::reconcile_gate(
                        snap.agent.approval.as_ref(),
                        &crate::policy::Call::of(&snap.agent, &intent.tool, &network),
                        &intent.arguments,
                    );
                    let step = match gate {
                        Some(gate) => {
                            Entry::ApprovalRequested(approval_request::reconcile_request(
                                &self.state,
                                intent_seq,
                                &intent,
                                gate,
                                &reason,
                            ))
                        }
                        None => stop_step(RunFinished {
                            outcome: Outcome::NeedsHuman,
                            result: self.state.last_text(),
                            error: Some(format!(
                                "call {intent_seq} of {} (idempotency key {}) may or may not have happened and \
                                 cannot be checked: {reason}; a human must reconcile it",
                                intent.tool, intent.key
                            )),
                        }),
                    };
                    self.append(step, None).await?;
                    return Ok(());
                }
            }
        };
        self.tools = Some((stamp, tools));
        let result = ToolResult {
            intent_seq,
            call_id: intent.call_id,
            tool: intent.tool,
            outcome: outcome.into(),
            recovery,
        };
        self.append(Entry::ToolResult(result), None).await?;
        Ok(())
    }

    /// Records why the run cannot go on, for the controller to end it.
    async fn stop(&mut self, finished: RunFinished) -> Result<(), StepError> {
        self.append(stop_step(finished), None).await.map(|_| ())
    }

    /// Proves this worker still holds the run's lease right before it calls
    /// out (a renew succeeds only for the current epoch), so a worker that
    /// froze and was replaced never makes a call after waking. Then the
    /// failpoint of that boundary.
    ///
    /// A proof younger than [`LEASE_PROOF_FRESH`] stands (the intent a tool
    /// call follows was just appended at this epoch, and a takeover fences
    /// an append as it fences a renewal): a round trip saved per call. A
    /// worker that froze wakes with an old proof and renews. Not before a
    /// model call: see [`Runner::renew_lease`].
    async fn hold_lease(&mut self, failpoint_name: &str) -> Result<(), StepError> {
        if self
            .proven
            .is_none_or(|at| at.elapsed() >= LEASE_PROOF_FRESH)
        {
            self.renew().await?;
        }
        failpoint::hit(failpoint_name);
        Ok(())
    }

    /// [`Runner::hold_lease`] that renews whatever the proof's age: before a
    /// model call, where the renewal's answer says whether the controller
    /// asked this worker to yield (a FollowLatest run's Agent changed), and
    /// an append carries no such answer.
    async fn renew_lease(&mut self, failpoint_name: &str) -> Result<(), StepError> {
        self.renew().await?;
        failpoint::hit(failpoint_name);
        Ok(())
    }

    async fn renew(&mut self) -> Result<(), StepError> {
        let sent = Instant::now();
        let renewed = with_store_retry(|| self.store.renew(&self.lease, LEASE_TTL))
            .await
            .map_err(StepError::HoldLease)?;
        self.lease = renewed;
        self.proven = Some(sent);
        Ok(())
    }

    /// Appends a record at the head, adopting the recorded one if another
    /// worker won that seq. Returns the seq. Store outages are waited out.
    #[tracing::instrument(name = "append", skip_all, fields(step = self.head.len, kind = step.kind()))]
    async fn append(&mut self, step: Entry, model_id: Option<String>) -> Result<u64, StepError> {
        let kind = step.kind();
        failpoint::hit(&format!("before-append:{kind}"));
        let mut draft = step.draft();
        if let Some(snap) = &self.state.snapshot {
            draft.versions = store::Versions {
                prompt_version: Some(snap.versions.prompt_version.clone()),
                prompt_hash: Some(snap.versions.prompt_hash.clone()),
                model_id: model_id.or(Some(snap.versions.model.clone())),
                tool_schema_hash: Some(snap.versions.tool_schema_hash.clone()),
            };
        }
        if let Entry::ModelCall(ModelCall {
            response, cost_usd, ..
        })
        | Entry::Summary(Summary {
            response, cost_usd, ..
        }) = &step
        {
            draft.usage = store::Usage {
                input_tokens: response.usage.input_tokens,
                output_tokens: response.usage.output_tokens,
                cost_micros: (cost_usd * 1e6).round() as u64,
            };
        }
        draft.worker = store::Worker {
            pod: self.args.worker.clone(),
            attempt: self.args.attempt,
        };
        let record = draft.seal(&self.head).map_err(StepError::Seal)?;
        let seq = record.seq;
        let sent = Instant::now();
        let mut outcome = with_store_retry(|| {
            self.store
                .append(&self.args.run_uid, self.lease.epoch, &record)
        })
        .await;
        if let Err(StoreError::StaleEpoch { expired: true, .. }) = outcome {
            // Our lease lapsed (a late heartbeat) but nobody took it over:
            // revive it and append once more; a takeover fails the renew.
            self.lease = self
                .store
                .renew(&self.lease, LEASE_TTL)
                .await
                .map_err(StepError::ReviveLease)?;
            outcome = with_store_retry(|| {
                self.store
                    .append(&self.args.run_uid, self.lease.epoch, &record)
            })
            .await;
        }
        match outcome {
            Ok(stored) => {
                self.head = stored.head();
                self.state.apply(step);
                self.proven = Some(sent);
            }
            Err(StoreError::Conflict { recorded, .. }) => {
                tracing::warn!(
                    seq,
                    "another worker recorded this step first; adopting its record"
                );
                self.head = recorded.head();
                self.state.apply(Entry::decode(
                    recorded.seq,
                    recorded.kind.as_str(),
                    &recorded.payload,
                )?);
            }
            Err(e) => return Err(StepError::Append(e)),
        }
        failpoint::hit(&format!("after-append:{kind}"));
        Ok(seq)
    }
}

/// How the pinned policy classes a call. Our code classifies it; the model
/// has no say. What the call is comes from the pinned tool declaration (its
/// endpoint, and where that leads on `network`), never from the name the
/// model used alone. Arguments that are not a JSON object never reach a
/// tool (its own check refuses them before any request, and the model is
/// told): no Approval is raised for them.
fn classification(
    snap: &Snapshot,
    call: &crate::model::ToolCall,
    arguments: &serde_json::Value,
    network: &crate::policy::Network,
) -> Classification {
    if !call.arguments_are_valid() {
        return Classification::Allow;
    }
    classify(
        snap.agent.approval.as_ref(),
        &crate::policy::Call::of(&snap.agent, &call.name, network),
        arguments,
    )
}

/// Calls the tool in its `execute_tool` span, which has left before the
/// result is recorded (as a model call's span has).
async fn call_tool(tools: &Toolbox, intent: &ToolIntent, ctx: &CallContext) -> ToolOutcome {
    let span = spans::execute_tool(&intent.tool, &intent.call_id, &intent.arguments);
    let outcome = tools
        .call(&intent.tool, &intent.arguments, ctx)
        .instrument(span.clone())
        .await;
    spans::record_tool(&span, &outcome);
    drop(span);
    trace::flush().await;
    outcome
}

/// The `Observation` asking the controller to end the run with `finished`.
fn stop_step(finished: RunFinished) -> Entry {
    Entry::Observation(Observation {
        text: finished.error.clone().unwrap_or_default(),
        about_seq: None,
        stop: Some(finished),
        attempts: None,
    })
}

/// The attempts of one model call as the log records them.
fn recorded_attempts(client: &ModelClient, outcomes: &[AttemptOutcome]) -> ModelAttempts {
    let provider = match client.provider() {
        crate::api::Provider::OpenAI => "OpenAI",
        crate::api::Provider::Anthropic => "Anthropic",
    };
    ModelAttempts {
        provider: provider.into(),
        outcomes: outcomes.iter().map(|o| o.label().to_string()).collect(),
    }
}

/// Retries an operation while the store is unreachable (a store outage stalls
/// the run; it resumes when the store is back). Gives up after two minutes.
async fn with_store_retry<T, F, Fut>(mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let give_up = Instant::now() + Duration::from_secs(120);
    let mut wait = Duration::from_millis(200);
    loop {
        match op().await {
            Err(e) if e.is_retryable() && Instant::now() < give_up => {
                tracing::warn!(error = %e, "step store unavailable; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

mod container;
#[cfg(test)]
mod tests;
