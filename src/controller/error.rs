//! Reconcile errors; each maps to a metric label.

/// What can go wrong while reconciling a run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {what}: {source}")]
    Read {
        what: &'static str,
        source: kube::Error,
    },
    #[error("writing {what}: {source}")]
    Write {
        what: &'static str,
        source: kube::Error,
    },
    #[error("writing status: {0}")]
    Status(#[source] kube::Error),
    #[error("encoding status: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("step store: {0}")]
    Store(#[source] crate::store::StoreError),
    #[error("step log: {0}")]
    Decode(#[source] crate::replay::DecodeError),
    /// The API server did not answer a SubjectAccessReview (a fork's
    /// requester on its parent's log): asked again, never taken as a yes.
    #[error("{0}")]
    Review(#[source] crate::controller::servers::log_api::authorize::ReviewError),
    /// A bug that this run's input reached: the reconcile failed, the
    /// process goes on (see [`crate::contain`]).
    #[error("reconcile {0}")]
    Panicked(#[from] crate::contain::Panicked),
}

impl Error {
    /// Label for `agentrun_reconcile_errors_total{reason=...}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Read { .. } => "read",
            Error::Write { .. } => "write",
            Error::Status(_) => "status",
            Error::Encode(_) => "encode",
            Error::Store(e) => e.metric_label(),
            Error::Decode(_) => "decode",
            Error::Review(_) => "review",
            Error::Panicked(_) => "panic",
        }
    }
}
