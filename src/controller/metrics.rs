//! Prometheus metrics of the controller.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// Metrics the reconciler updates.
pub struct Metrics {
    pub reconciliations: Counter,
    pub reconcile_errors: Family<ReasonLabel, Counter>,
    pub reconcile_duration: Histogram,
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            reconciliations: Counter::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
        };
        registry.register(
            "agentrun_reconciliations",
            "AgentRun reconciliations",
            m.reconciliations.clone(),
        );
        registry.register(
            "agentrun_reconcile_errors",
            "Failed AgentRun reconciliations by reason",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "agentrun_reconcile_duration_seconds",
            "Duration of one AgentRun reconciliation",
            m.reconcile_duration.clone(),
        );
        m
    }
}
