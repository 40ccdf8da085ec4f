//! What every part of the reconciler shares: the clients, caches and keys
//! of one controller process ([`Context`]), and the controller's own writes
//! to the log and to Events' wording. Depends on no other reconciler module.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use kube::runtime::events::{Recorder, Reporter};

use super::error::Error;
use super::job::JobSettings;
use super::metrics::Metrics;
use crate::api::Agent;
use crate::runlog::replay::Step;
use crate::step::failpoint;
use crate::store::{Head, RecordDraft, StepStore, StoreError};

/// The one field manager every write of the controller uses.
pub const FIELD_MANAGER: &str = "agentrun-controller";

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
    pub tokens: super::step_token::TokenKey,
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
    /// Each run's replayed log, extended by what its head events announce.
    pub logs: super::log_cache::LogCache,
    /// Whether the store pushes head events (else running runs are polled).
    pub store_pushes: bool,
    /// Since when each run's lease has been seen free while its step runs.
    pub lease_free_since: std::sync::Mutex<std::collections::HashMap<String, Instant>>,
    /// Step Jobs and Agents as the controller's watches last saw them (a
    /// name missing there is read from the API server before it counts as gone).
    pub job_cache: Option<kube::runtime::reflector::Store<Job>>,
    pub agent_cache: Option<kube::runtime::reflector::Store<Agent>>,
    pub policy_cache: Option<super::platform::PolicyCache>,
    /// Runs whose step credential Secret this process created or found.
    pub credentials: std::sync::Mutex<std::collections::HashSet<String>>,
    /// When each running run's progress was last written to its status.
    pub progress_written: std::sync::Mutex<std::collections::HashMap<String, Instant>>,
    /// Failed reconciles in a row, per run uid (the error backoff).
    pub failures: std::sync::Mutex<std::collections::HashMap<String, u32>>,
    /// Logs whose window starts earlier get no checkpoint (`--checkpoint-min-records`).
    pub checkpoint_min: u64,
    /// Runs this process has reported with a broken log (counted once,
    /// however many reconciles see the break before the status says so).
    pub tampered: std::sync::Mutex<std::collections::HashSet<String>>,
    /// MCP discovery, done outside the reconciles.
    pub discovery: super::discovery::Discovery,
    /// Reconcile slots, shared fairly between namespaces.
    pub slots: super::slots::Slots,
    /// The runs as the controller's watch has them (a reconcile that waited
    /// for its slot reads its run again from here).
    pub run_cache: Option<kube::runtime::reflector::Store<crate::api::AgentRun>>,
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
pub(super) async fn append(ctx: &Context, uid: &str, head: &Head, step: Step) -> Result<(), Error> {
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
        ctx.logs.mark_changed(uid);
    }
    match result {
        // Someone recorded that seq first: reconcile again from the new head.
        Ok(()) | Err(StoreError::Conflict { .. }) => Ok(()),
        Err(e) => Err(Error::Store(e)),
    }
}

pub(super) fn notice(
    warning: bool,
    reason: &'static str,
    message: String,
) -> super::decide::Notice {
    super::decide::Notice {
        warning,
        reason,
        message,
    }
}
