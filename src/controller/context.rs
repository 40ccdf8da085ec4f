//! What every part of the reconciler shares: the clients, caches and keys
//! of one controller process ([`Context`]), and the controller's own writes
//! to the log and to Events' wording. Depends on no other reconciler module.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::runtime::events::{Recorder, Reporter};

use crate::api::Agent;
use crate::controller::error::Error;
use crate::controller::metrics::Metrics;
use crate::failpoint;
use crate::replay::Entry;
use crate::store::{Head, RecordDraft, StepStore, StoreError};

/// Shared state of the reconciler.
pub struct Context {
    pub client: kube::Client,
    /// Who publishes the run's Events (see [`Context::recorder`]).
    pub reporter: Reporter,
    pub metrics: Metrics,
    pub store: Arc<dyn StepStore>,
    /// Name of the store in `status.log.store`.
    pub store_name: String,
    /// Mints each run's step-log gateway token (handed over in a per-run Secret).
    pub tokens: crate::keys::step_token::TokenKey,
    /// Signs the controller's own records; the verifier checks them on every read.
    pub signer: crate::store::RecordSigner,
    pub verifier: crate::store::RecordVerifier,
    pub jobs: JobSettings,
    /// Identity used for the controller's own appends.
    pub identity: String,
    /// For user-chosen addresses (approval webhooks, MCP discovery): egress-guarded.
    pub http: reqwest::Client,
    /// Which addresses `http` may reach (`--user-url-allow`): check a URL
    /// with it first, as IP literals bypass the client's resolver.
    pub user_urls: Arc<crate::egress::Policy>,
    /// What the reconciler remembers about each run between reconciles
    /// (its replayed log among it), forgotten in one place.
    pub memory: crate::controller::memory::RunMemory,
    /// Pages of logs the reconciles read and hold at once (`--log-read-mib`).
    pub reads: crate::store::ReadBudget,
    /// Whether the store pushes head events (else running runs are polled).
    pub store_pushes: bool,
    /// Step Jobs and Agents as the controller's watches last saw them (a
    /// name missing there is read from the API server before it counts as gone).
    pub job_cache: Option<kube::runtime::reflector::Store<Job>>,
    pub agent_cache: Option<kube::runtime::reflector::Store<Agent>>,
    pub policy_cache: Option<crate::controller::watchers::platform::PolicyCache>,
    /// Logs whose window starts earlier get no checkpoint (`--checkpoint-min-records`).
    pub checkpoint_min: u64,
    /// MCP discovery, done outside the reconciles.
    pub discovery: crate::controller::watchers::tool_discovery::Discovery,
    /// Reconcile slots, shared fairly between namespaces.
    pub slots: crate::controller::slots::Slots,
    /// The runs as the controller's watch has them (a reconcile that waited
    /// for its slot reads its run again from here).
    pub run_cache: Option<kube::runtime::reflector::Store<crate::api::AgentRun>>,
    /// The console's base URL (`--console-url`), for the links in approval
    /// notifications; none without it.
    pub console_url: Option<String>,
}

impl Context {
    /// A recorder for one reconcile's Events. Not kept: kube's recorder
    /// remembers every Event it published for six minutes and scans them all
    /// at each publish, dropping old ones only then (thousands of waiting
    /// runs would keep theirs for good, and every publish would scan them).
    pub fn recorder(&self) -> Recorder {
        Recorder::new(self.client.clone(), self.reporter.clone())
    }
}

/// Appends one record as the controller (RunStarted, VersionChanged, its own
/// RunFinished), under the run's lease like any worker.
pub(crate) async fn append(
    ctx: &Context,
    uid: &str,
    head: &Head,
    step: Entry,
) -> Result<(), Error> {
    let lease = ctx
        .store
        .acquire(uid, &ctx.identity, Duration::from_secs(10))
        .await
        .map_err(Error::Store)?;
    let kind = step.store_kind();
    failpoint::hit(&format!("controller:before-append:{kind}"));
    let mut draft = RecordDraft::new(kind, step.payload());
    draft.worker = crate::store::Worker {
        pod: ctx.identity.clone(),
        attempt: 0,
    };
    let started = Instant::now();
    let result = match ctx.signer.seal(uid, draft, head) {
        Ok(record) => ctx
            .store
            .append(uid, lease.epoch, &record)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    ctx.metrics.observe_append(started.elapsed(), &result);
    if result.is_ok() {
        failpoint::hit(&format!("controller:after-append:{kind}"));
    }
    let _ = ctx.store.release(&lease).await;
    if matches!(result, Ok(()) | Err(StoreError::Conflict { .. })) {
        // The head moved under the run's cached log: read past it next time.
        ctx.memory.mark_changed(uid);
    }
    match result {
        // Someone recorded that seq first: reconcile again from the new head.
        Ok(()) | Err(StoreError::Conflict { .. }) => Ok(()),
        Err(e) => Err(Error::Store(e)),
    }
}

/// A Kubernetes Event to publish on the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

pub(crate) fn notice(warning: bool, reason: &'static str, message: String) -> Notice {
    Notice {
        warning,
        reason,
        message,
    }
}

/// Controller settings that shape step Jobs.
#[derive(Clone, Debug)]
pub struct JobSettings {
    pub image: String,
    /// The step-log gateway's URL, as step pods reach it.
    pub store_url: String,
    /// The controller's record-signing public keys (hex, the current one first).
    pub controller_key: String,
    /// The id of the controller's current key (its signing key's id, which
    /// also names the step tokens it mints: a run's credential Secret is
    /// per key, so a rotation gives new Jobs a token of the new key).
    pub key_id: String,
    pub service_account: String,
    /// How long one Job may keep taking further steps before it exits.
    pub time_slice_seconds: u64,
    /// Honour the failpoint annotation (tests only; off in production).
    pub allow_failpoints: bool,
    /// Log format and OpenTelemetry settings handed to step pods
    /// (`telemetry::step_env`).
    pub telemetry_env: Vec<(String, String)>,
}
