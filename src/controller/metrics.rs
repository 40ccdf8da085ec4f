//! Prometheus metrics of the controller (`/metrics`).
//!
//! | metric | type | labels | from |
//! | --- | --- | --- | --- |
//! | `agentrun_runs` | gauge | `phase` | the runs the leading replica's reconciler sees (its cache), at scrape time |
//! | `agentrun_steps_total` | counter | `kind` | step-log records the controller observes appended (each once) |
//! | `agentrun_step_duration_seconds` | histogram | `outcome` | step Jobs, start to completion or failure |
//! | `agentrun_approval_wait_seconds` | histogram | `verdict` | approval raised to decided ([`Metrics::observe_approval_wait`]) |
//! | `agentrun_approval_webhooks_total` | counter | `outcome` | approval notifications, each counted once: `sent` (possibly after retries), `failed` (after its last attempt; a Warning Event `ApprovalNotificationFailed` on the run), `refused` (egress policy), `dropped` (too many in flight) |
//! | `agentrun_model_tokens_total` | counter | `direction`, `model` | usage of observed `ModelCall`/`Summary` records |
//! | `agentrun_model_cost_usd_total` | counter | `model` | same, cost |
//! | `agentrun_model_attempts_total` | counter | `provider`, `outcome` | HTTP attempts of model calls, retries included, as the step recorded them in `ModelCall`/`Summary`/`Observation` records ([`crate::runlog::records::ModelAttempts`]) |
//! | `agentrun_store_append_duration_seconds` | histogram | `outcome` | the controller's own appends |
//! | `agentrun_dispatch_seconds` | histogram | `stage` | the record a first-attempt step Job follows stored → its reconcile started / the Job created ([`Metrics::observe_dispatch`]) |
//! | `agentrun_reconciliations_total`, `agentrun_reconcile_errors_total`, `agentrun_reconcile_duration_seconds` | | `reason` | the reconciler |
//!
//! Records and Jobs that ended before this process started are not counted:
//! the replica that led then counted them. So a record is counted at most
//! once across restarts and replicas, and these counters are this process's
//! (they start at zero with it, like any Prometheus counter); a record
//! appended while no controller ran is not counted by any.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::api::{AgentRun, Phase};
use crate::runlog::records::ModelAttempts;
use crate::store::{Record, StepKind};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabel {
    pub verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabel {
    pub direction: String,
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabel {
    pub provider: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    pub stage: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every phase, so that dashboards see zeros rather than missing series.
const PHASES: [Phase; 8] = [
    Phase::Pending,
    Phase::Running,
    Phase::AwaitingApproval,
    Phase::Succeeded,
    Phase::Failed,
    Phase::Cancelled,
    Phase::BudgetExceeded,
    Phase::DeadlineExceeded,
];

/// Metrics the reconciler updates.
pub struct Metrics {
    pub reconciliations: Counter,
    pub reconcile_errors: Family<ReasonLabel, Counter>,
    pub reconcile_duration: Histogram,
    pub steps: Family<KindLabel, Counter>,
    pub step_duration: HistogramFamily<OutcomeLabel>,
    pub approval_wait: HistogramFamily<VerdictLabel>,
    pub approval_webhooks: Family<OutcomeLabel, Counter>,
    pub model_tokens: Family<TokenLabel, Counter>,
    pub model_cost: Family<ModelLabel, Counter<f64, AtomicU64>>,
    /// HTTP attempts of model calls, from the records that carry them.
    pub model_attempts: Family<AttemptLabel, Counter>,
    pub store_append: HistogramFamily<OutcomeLabel>,
    /// From the record a step Job follows being stored to its reconcile
    /// starting and to its Job being created ([`Metrics::observe_dispatch`]).
    pub dispatch: HistogramFamily<StageLabel>,
    /// Runs stopped because their log did not verify or did not extend the anchored head.
    pub log_integrity_failures: Counter,
    /// Reads of step logs by the reconciler, records and payload bytes read.
    pub store_reads: Counter,
    pub store_read_records: Counter,
    pub store_read_bytes: Counter,
    /// Replays begun at a run's checkpoint rather than its first record.
    pub log_resumes: Counter,
    shared: Arc<Shared>,
    started: DateTime<Utc>,
}

/// What the scrape-time collector and the reconciler share.
#[derive(Default)]
struct Shared {
    /// The reconciler's cache of runs, once this replica leads.
    runs: RwLock<Option<Store<AgentRun>>>,
}

/// Per run: how much of its log and which Job were counted already. The
/// run's memory keeps it (`controller::memory`), until the run is deleted.
#[derive(Default, Debug)]
pub struct Counted {
    log_len: Option<usize>,
    last_job: Option<String>,
}

impl Counted {
    /// Whether nothing of the run was counted yet.
    pub fn is_empty(&self) -> bool {
        self.log_len.is_none() && self.last_job.is_none()
    }
}

fn step_buckets() -> Histogram {
    // 0.5 s .. about 68 min
    Histogram::new(exponential_buckets(0.5, 2.0, 14))
}

fn approval_buckets() -> Histogram {
    // 1 s .. about 6 days
    Histogram::new(exponential_buckets(1.0, 3.0, 13))
}

fn append_buckets() -> Histogram {
    // 0.5 ms .. about 8 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 15))
}

fn dispatch_buckets() -> Histogram {
    // 1 ms .. about 5 min, 1.5x apart: fine enough for a p50 and a p99.
    Histogram::new(exponential_buckets(0.001, 1.5, 32))
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            reconciliations: Counter::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            steps: Family::default(),
            step_duration: Family::new_with_constructor(step_buckets),
            approval_wait: Family::new_with_constructor(approval_buckets),
            approval_webhooks: Family::default(),
            model_tokens: Family::default(),
            model_cost: Family::default(),
            model_attempts: Family::default(),
            store_append: Family::new_with_constructor(append_buckets),
            dispatch: Family::new_with_constructor(dispatch_buckets),
            log_integrity_failures: Counter::default(),
            store_reads: Counter::default(),
            store_read_records: Counter::default(),
            store_read_bytes: Counter::default(),
            log_resumes: Counter::default(),
            shared: Arc::new(Shared::default()),
            started: Utc::now(),
        };
        m.register_reconciler(registry);
        m.register_steps(registry);
        m.register_model(registry);
        m.register_store(registry);
        registry.register_collector(Box::new(RunsByPhase(m.shared.clone())));
        m
    }

    /// The reconciler's own: how often it ran, how long, how it failed.
    fn register_reconciler(&self, registry: &mut Registry) {
        registry.register(
            "agentrun_reconciliations",
            "AgentRun reconciliations",
            self.reconciliations.clone(),
        );
        registry.register(
            "agentrun_reconcile_errors",
            "Failed AgentRun reconciliations by reason",
            self.reconcile_errors.clone(),
        );
        registry.register(
            "agentrun_log_integrity_failures",
            "Runs stopped because their step log failed verification against the anchored head",
            self.log_integrity_failures.clone(),
        );
        registry.register(
            "agentrun_reconcile_duration_seconds",
            "Duration of one AgentRun reconciliation",
            self.reconcile_duration.clone(),
        );
    }

    /// What the runs did: records appended, step Jobs, approvals.
    fn register_steps(&self, registry: &mut Registry) {
        registry.register(
            "agentrun_steps",
            "Step-log records the controller observed appended, by kind",
            self.steps.clone(),
        );
        registry.register(
            "agentrun_step_duration_seconds",
            "Duration of step Jobs, from start to completion or failure",
            self.step_duration.clone(),
        );
        registry.register(
            "agentrun_approval_wait_seconds",
            "Time from an approval being raised to its decision or expiry, by verdict",
            self.approval_wait.clone(),
        );
        registry.register(
            "agentrun_approval_webhooks",
            "Approval notifications, by outcome (sent, failed after retries, refused, dropped)",
            self.approval_webhooks.clone(),
        );
    }

    /// What the model calls recorded in step logs cost and how they went.
    fn register_model(&self, registry: &mut Registry) {
        registry.register(
            "agentrun_model_tokens",
            "Model tokens recorded in step logs, by direction (input, output) and model",
            self.model_tokens.clone(),
        );
        registry.register(
            "agentrun_model_cost_usd",
            "Model cost recorded in step logs, in the prices' currency (USD by convention)",
            self.model_cost.clone(),
        );
        registry.register(
            "agentrun_model_attempts",
            "HTTP attempts of model calls (retries inside a step included), by provider \
             (wire format) and outcome (ok, malformed, 3xx, 4xx, 429, 5xx, timeout, transport)",
            self.model_attempts.clone(),
        );
    }

    /// The step log in the store: appends, dispatch from a stored record, reads
    /// and resumed replays.
    fn register_store(&self, registry: &mut Registry) {
        registry.register(
            "agentrun_store_append_duration_seconds",
            "Latency of the controller's own step-log appends, by outcome",
            self.store_append.clone(),
        );
        registry.register(
            "agentrun_dispatch_seconds",
            "From the step-log record a new step Job follows being stored to the reconcile \
             that acts on it starting (stage reconcile_started) and to the Job being created \
             (stage job_created); first attempts only",
            self.dispatch.clone(),
        );
        registry.register(
            "agentrun_store_reads",
            "Step-log reads by the reconciler (a reconcile with the run's replayed log current reads none)",
            self.store_reads.clone(),
        );
        registry.register(
            "agentrun_store_read_records",
            "Step-log records the reconciler read (each once, past the head it had replayed)",
            self.store_read_records.clone(),
        );
        registry.register(
            "agentrun_store_read_bytes",
            "Payload bytes of the step-log records the reconciler read",
            self.store_read_bytes.clone(),
        );
        registry.register(
            "agentrun_log_resumes",
            "Replays of a run's log begun at its signed checkpoint (status.log.checkpoint) instead of its first record",
            self.log_resumes.clone(),
        );
    }

    /// Gives the scrape-time `agentrun_runs` gauge the reconciler's cache
    /// (called once this replica leads; a standby reports no runs).
    pub fn watch_runs(&self, runs: Store<AgentRun>) {
        *self.shared.runs.write().unwrap_or_else(|e| e.into_inner()) = Some(runs);
    }

    /// Counts the records of a run's log not counted yet: kinds, tokens, cost.
    pub fn observe_log(&self, counted: &mut Counted, records: &[Record]) {
        let first_sight = counted.log_len.is_none();
        let from = counted.log_len.unwrap_or(0);
        for r in records.iter().filter(|r| r.seq as usize >= from) {
            if first_sight && r.created_at.is_some_and(|t| t < self.started) {
                continue;
            }
            self.steps
                .get_or_create(&KindLabel {
                    kind: r.kind.as_str().into(),
                })
                .inc();
            let model = r.versions.model_id.clone().unwrap_or_default();
            for (direction, n) in [
                ("input", r.usage.input_tokens),
                ("output", r.usage.output_tokens),
            ] {
                if n > 0 {
                    self.model_tokens
                        .get_or_create(&TokenLabel {
                            direction: direction.into(),
                            model: model.clone(),
                        })
                        .inc_by(n);
                }
            }
            if r.usage.cost_micros > 0 {
                self.model_cost
                    .get_or_create(&ModelLabel { model })
                    .inc_by(r.usage.cost_micros as f64 / 1e6);
            }
            self.count_attempts(r);
        }
        let end = records.last().map_or(0, |r| r.seq as usize + 1);
        counted.log_len = Some(end.max(from));
    }

    /// The model attempts a record carries (only model-call records do; older
    /// ones carry none).
    fn count_attempts(&self, r: &Record) {
        if !matches!(
            r.kind,
            StepKind::ModelCall | StepKind::Summary | StepKind::Observation
        ) {
            return;
        }
        // Only this field is decoded: the rest of the payload is not needed here.
        let Some(attempts) = r
            .payload
            .get("attempts")
            .and_then(|a| serde_json::from_value::<ModelAttempts>(a.clone()).ok())
        else {
            return;
        };
        for outcome in attempts.outcomes {
            self.model_attempts
                .get_or_create(&AttemptLabel {
                    provider: attempts.provider.clone(),
                    outcome,
                })
                .inc();
        }
    }

    /// Observes the duration of a run's step Job once it has ended.
    pub fn observe_job(&self, counted: &mut Counted, job: Option<&Job>) {
        let Some((name, outcome, seconds, ended)) = job.and_then(job_duration) else {
            return;
        };
        if counted.last_job.as_ref() == Some(&name) {
            return;
        }
        let first_sight = counted.last_job.is_none();
        counted.last_job = Some(name);
        if first_sight && ended < self.started {
            return;
        }
        self.step_duration
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .observe(seconds);
    }

    /// A first-attempt step Job created after the record stored at `head_at`,
    /// by the reconcile that began at `began`.
    pub fn observe_dispatch(&self, head_at: DateTime<Utc>, began: DateTime<Utc>) {
        let secs =
            |t: DateTime<Utc>| (t - head_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6;
        for (stage, at) in [("reconcile_started", began), ("job_created", Utc::now())] {
            self.dispatch
                .get_or_create(&StageLabel { stage })
                .observe(secs(at));
        }
    }

    /// How long an approval waited, from raised to decided (`verdict`:
    /// `Approve`, `Reject`, `Edit`) or expired (`Expired`).
    pub fn observe_approval_wait(&self, wait: Duration, verdict: &str) {
        self.approval_wait
            .get_or_create(&VerdictLabel {
                verdict: verdict.into(),
            })
            .observe(wait.as_secs_f64());
    }

    /// An Approval (raised when it was created) decided or expired `now`.
    pub fn observe_approval_decided(
        &self,
        raised: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
        now: jiff::Timestamp,
        verdict: impl std::fmt::Debug,
    ) {
        if let Some(raised) = raised {
            let wait = Duration::try_from(now.duration_since(raised.0)).unwrap_or_default();
            self.observe_approval_wait(wait, &format!("{verdict:?}"));
        }
    }

    /// One read of a run's log past the head the reconciler had, returning `records`.
    pub fn observe_read(&self, records: &[Record]) {
        self.store_reads.inc();
        self.store_read_records.inc_by(records.len() as u64);
        let bytes: usize = records
            .iter()
            .map(|r| serde_json::to_vec(&r.payload).map_or(0, |b| b.len()))
            .sum();
        self.store_read_bytes.inc_by(bytes as u64);
    }

    /// Latency of one of the controller's own appends (`outcome`: `ok`,
    /// `conflict` or an error label).
    pub fn observe_append<T>(
        &self,
        elapsed: Duration,
        result: &Result<T, crate::store::StoreError>,
    ) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(crate::store::StoreError::Conflict { .. }) => "conflict",
            Err(e) => e.metric_label(),
        };
        self.store_append
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .observe(elapsed.as_secs_f64());
    }
}

/// (name, outcome, seconds, ended at) of a Job that has ended.
fn job_duration(job: &Job) -> Option<(String, &'static str, f64, DateTime<Utc>)> {
    let status = job.status.as_ref()?;
    let start = status.start_time.as_ref()?.0;
    let failed = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Failed" && c.status == "True")
        .and_then(|c| c.last_transition_time.as_ref());
    let (outcome, end) = match (&status.completion_time, failed) {
        (Some(t), _) => ("succeeded", t.0),
        (None, Some(t)) => ("failed", t.0),
        (None, None) => return None,
    };
    let seconds = end.duration_since(start).as_secs_f64().max(0.0);
    let ended = DateTime::<Utc>::from_timestamp(end.as_second(), end.subsec_nanosecond() as u32)?;
    Some((job.name_any(), outcome, seconds, ended))
}

/// `agentrun_runs{phase}`, computed from the reconciler's cache at scrape time.
struct RunsByPhase(Arc<Shared>);

impl std::fmt::Debug for RunsByPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunsByPhase")
    }
}

impl Collector for RunsByPhase {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let runs = self.0.runs.read().unwrap_or_else(|e| e.into_inner());
        let Some(runs) = runs.as_ref() else {
            return Ok(());
        };
        let family = Family::<PhaseLabel, Gauge>::default();
        for phase in PHASES {
            let _ = family.get_or_create(&PhaseLabel {
                phase: phase_name(phase),
            });
        }
        for run in runs.state() {
            let phase = run
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .unwrap_or_default();
            family
                .get_or_create(&PhaseLabel {
                    phase: phase_name(phase),
                })
                .inc();
        }
        let metric = encoder.encode_descriptor(
            "agentrun_runs",
            "AgentRuns by phase, as the leading controller's reconciler sees them",
            None,
            family.metric_type(),
        )?;
        family.encode(metric)
    }
}

fn phase_name(phase: Phase) -> String {
    serde_json::to_value(phase)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{phase:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Hash, Usage, Versions, Worker};
    use serde_json::json;

    fn record(
        seq: u64,
        kind: StepKind,
        tokens: (u64, u64),
        micros: u64,
        at: DateTime<Utc>,
    ) -> Record {
        Record {
            format: 1,
            seq,
            kind,
            payload: json!({}),
            versions: Versions {
                model_id: Some("m1".into()),
                ..Default::default()
            },
            usage: Usage {
                cost_micros: micros,
                input_tokens: tokens.0,
                output_tokens: tokens.1,
            },
            worker: Worker::default(),
            prev_hash: Hash::default(),
            hash: Hash::default(),
            created_at: Some(at),
        }
    }

    fn text(registry: &Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, registry).unwrap();
        s
    }

    #[test]
    fn counts_each_record_once_and_skips_what_was_there_before_start() {
        let mut counted = Counted::default();
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        let before = m.started - chrono::Duration::seconds(60);
        let after = m.started + chrono::Duration::seconds(1);
        let mut log = vec![
            record(0, StepKind::RunStarted, (0, 0), 0, before),
            record(1, StepKind::ModelCall, (100, 20), 1500, before),
            record(2, StepKind::ModelCall, (10, 5), 250, after),
        ];
        m.observe_log(&mut counted, &log);
        m.observe_log(&mut counted, &log);
        log.push(record(3, StepKind::ToolIntent, (0, 0), 0, after));
        log.push(record(4, StepKind::ToolResult, (0, 0), 0, after));
        m.observe_log(&mut counted, &log);
        let t = text(&registry);
        assert!(
            t.contains(r#"agentrun_steps_total{kind="ModelCall"} 1"#),
            "{t}"
        );
        assert!(
            t.contains(r#"agentrun_steps_total{kind="ToolIntent"} 1"#),
            "{t}"
        );
        assert!(!t.contains(r#"kind="RunStarted""#), "{t}");
        assert!(
            t.contains(r#"agentrun_model_tokens_total{direction="input",model="m1"} 10"#),
            "{t}"
        );
        assert!(
            t.contains(r#"agentrun_model_cost_usd_total{model="m1"} 0.00025"#),
            "{t}"
        );
    }

    #[test]
    fn counts_the_model_attempts_records_carry_once_each() {
        let mut counted = Counted::default();
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        let before = m.started - chrono::Duration::seconds(60);
        let after = m.started + chrono::Duration::seconds(1);
        let with = |seq, kind, outcomes: serde_json::Value, at| {
            let mut r = record(seq, kind, (0, 0), 0, at);
            r.payload = json!({"attempts": {"provider": "OpenAI", "outcomes": outcomes}});
            r
        };
        let mut log = vec![
            record(0, StepKind::RunStarted, (0, 0), 0, before),
            // Counted by the controller that ran then.
            with(1, StepKind::ModelCall, json!(["5xx", "ok"]), before),
            // Written before attempts were recorded: nothing to count.
            record(2, StepKind::ModelCall, (1, 1), 0, after),
            with(3, StepKind::ModelCall, json!(["5xx", "5xx", "ok"]), after),
        ];
        m.observe_log(&mut counted, &log);
        m.observe_log(&mut counted, &log);
        log.push(with(4, StepKind::Observation, json!(["4xx"]), after));
        // Only model-call records carry attempts.
        log.push(with(5, StepKind::ToolResult, json!(["ok"]), after));
        m.observe_log(&mut counted, &log);
        let t = text(&registry);
        for (outcome, n) in [("5xx", 2), ("ok", 1), ("4xx", 1)] {
            let sample = format!(
                r#"agentrun_model_attempts_total{{provider="OpenAI",outcome="{outcome}"}} {n}"#
            );
            assert!(t.contains(&sample), "{sample} in {t}");
        }
    }

    #[test]
    fn observes_a_job_once_when_it_ends() {
        let mut counted = Counted::default();
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        let start = jiff::Timestamp::now();
        let mut job: Job = serde_json::from_value(json!({
            "metadata": {"name": "r-s1-a1"},
            "status": {"startTime": start.to_string()}
        }))
        .unwrap();
        m.observe_job(&mut counted, Some(&job));
        assert!(!text(&registry).contains("agentrun_step_duration_seconds_count"));
        let end = start + jiff::SignedDuration::from_secs(3);
        job.status.as_mut().unwrap().completion_time =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(end));
        m.observe_job(&mut counted, Some(&job));
        m.observe_job(&mut counted, Some(&job));
        let t = text(&registry);
        assert!(
            t.contains(r#"agentrun_step_duration_seconds_count{outcome="succeeded"} 1"#),
            "{t}"
        );
        assert!(
            t.contains(r#"agentrun_step_duration_seconds_sum{outcome="succeeded"} 3.0"#),
            "{t}"
        );
    }

    #[test]
    fn approval_wait_and_append_latency_are_histograms() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.observe_approval_wait(Duration::from_secs(90), "Approve");
        m.observe_append::<()>(Duration::from_millis(3), &Ok(()));
        let t = text(&registry);
        assert!(
            t.contains(r#"agentrun_approval_wait_seconds_count{verdict="Approve"} 1"#),
            "{t}"
        );
        assert!(
            t.contains(r#"agentrun_store_append_duration_seconds_count{outcome="ok"} 1"#),
            "{t}"
        );
        // No cache yet (a standby replica): no runs gauge.
        assert!(!t.contains("agentrun_runs{"), "{t}");
    }

    #[test]
    fn dispatch_is_measured_from_the_stored_record_to_each_stage() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        let stored = Utc::now() - chrono::Duration::milliseconds(40);
        m.observe_dispatch(stored, stored + chrono::Duration::milliseconds(10));
        let t = text(&registry);
        assert!(
            t.contains(r#"agentrun_dispatch_seconds_sum{stage="reconcile_started"} 0.01"#),
            "{t}"
        );
        let created: f64 = t
            .lines()
            .find_map(|l| l.strip_prefix(r#"agentrun_dispatch_seconds_sum{stage="job_created"} "#))
            .expect("job_created observed")
            .parse()
            .unwrap();
        assert!((0.04..1.0).contains(&created), "{created}");
    }
}
