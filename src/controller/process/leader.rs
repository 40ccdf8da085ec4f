//! Leader election through a coordination.k8s.io Lease, so that two replicas
//! never drive the same runs at once.

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Held while this replica leads.
pub struct Leadership {
    state: watch::Receiver<bool>,
    task: JoinHandle<kube_lease_manager::Result<LeaseManager>>,
}

/// Why this replica could not take part in the election.
#[derive(Debug, thiserror::Error)]
pub enum LeadershipError {
    #[error(transparent)]
    Lease(#[from] kube_lease_manager::LeaseManagerError),
    #[error(transparent)]
    Watch(#[from] tokio::sync::watch::error::RecvError),
}

/// Waits until this replica holds the Lease.
pub async fn acquire(
    client: Client,
    namespace: &str,
    lease: &str,
    identity: &str,
    seconds: u64,
) -> Result<Leadership, LeadershipError> {
    let manager = LeaseManagerBuilder::new(client, lease)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(seconds)
        .with_grace(seconds.div_ceil(3).max(1))
        .build()
        .await?;
    let (mut state, task) = manager.watch().await;
    while !*state.borrow_and_update() {
        state.changed().await?;
    }
    Ok(Leadership { state, task })
}

impl Leadership {
    /// A future that completes when the Lease is lost.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + Sync + 'static {
        let mut state = self.state.clone();
        async move {
            while *state.borrow_and_update() {
                if state.changed().await.is_err() {
                    return;
                }
            }
        }
    }

    /// Gives the Lease up so a standby replica takes over at once.
    pub async fn release(self) {
        drop(self.state);
        match self.task.await {
            Ok(Ok(manager)) => {
                if let Err(e) = manager.release().await {
                    tracing::warn!(error = %e, "releasing the leader lease failed");
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "leader lease task failed"),
            Err(e) => tracing::warn!(error = %e, "leader lease task panicked"),
        }
    }
}
