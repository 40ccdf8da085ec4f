//! What every part of the reconciler shares: the handles of one controller
//! process ([`Context`]: the API client, the step log's access, the Job
//! settings, outbound requests, the watches' caches, the memory of each run)
//! and Events' wording. The controller's own appends are in `log_writer`.
//! Depends on no other reconciler module.

use std::sync::Arc;

use k8s_openapi::api::batch::v1::Job;
use kube::runtime::events::{Recorder, Reporter};

use crate::api::Agent;
use crate::controller::metrics::Metrics;
use crate::store::StepStore;

/// What every reconcile works with: handles, each grouping what one
/// concern needs.
pub struct Context {
    pub client: kube::Client,
    /// Who publishes the run's Events (see [`Context::recorder`]).
    pub reporter: Reporter,
    pub metrics: Metrics,
    /// The step log: its store, the keys that sign and check it, what reads may hold.
    pub log: LogAccess,
    /// Controller settings that shape step Jobs.
    pub jobs: JobSettings,
    /// What the controller reaches at addresses users chose.
    pub outbound: Outbound,
    /// Objects as the controller's watches last saw them.
    pub caches: Caches,
    /// What the reconciler remembers about each run between reconciles
    /// (its replayed log among it), forgotten in one place.
    pub memory: std::sync::Arc<crate::controller::memory::RunMemory>,
    /// MCP discovery, done outside the reconciles.
    pub discovery: crate::controller::watchers::tool_discovery::Discovery,
    /// Reconcile slots, shared fairly between namespaces.
    pub slots: crate::controller::slots::Slots,
}

/// The step log as the controller reads, appends to and hands it out.
pub struct LogAccess {
    pub store: Arc<dyn StepStore>,
    /// Name of the store in `status.log.store`.
    pub store_name: String,
    /// Whether the store pushes head events (else running runs are polled).
    pub pushes: bool,
    /// Signs the controller's own records; the verifier checks them on every read.
    pub signer: crate::store::RecordSigner,
    pub verifier: crate::store::RecordVerifier,
    /// Mints each run's step-log gateway token (handed over in a per-run Secret).
    pub tokens: crate::keys::step_token::TokenKey,
    /// Identity used for the controller's own appends.
    pub identity: String,
    /// Pages of logs the reconciles read and hold at once (`--log-read-mib`).
    pub reads: crate::store::ReadBudget,
    /// Logs whose window starts earlier get no checkpoint (`--checkpoint-min-records`).
    pub checkpoint_min: u64,
}

/// Requests to addresses users chose (approval webhooks, MCP discovery).
pub struct Outbound {
    /// Egress-guarded client.
    pub http: reqwest::Client,
    /// Which addresses `http` may reach (`--user-url-allow`): check a URL
    /// with it first, as IP literals bypass the client's resolver.
    pub user_urls: Arc<crate::egress::Policy>,
    /// The console's base URL (`--console-url`), for the links in approval
    /// notifications; none without it.
    pub console_url: Option<String>,
}

/// Step Jobs, Agents, platform policies and runs as the controller's watches
/// last saw them (a name missing there is read from the API server before it
/// counts as gone). None in tests that run without watches.
#[derive(Default)]
pub struct Caches {
    pub jobs: Option<kube::runtime::reflector::Store<Job>>,
    pub agents: Option<kube::runtime::reflector::Store<Agent>>,
    pub policies: Option<crate::controller::watchers::platform::PolicyCache>,
    /// The runs (a reconcile that waited for its slot reads its run again from here).
    pub runs: Option<kube::runtime::reflector::Store<crate::api::AgentRun>>,
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
