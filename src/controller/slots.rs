//! Reconcile slots shared fairly between namespaces: at most
//! `--reconcile-concurrency` reconciles run at once, and at most
//! `--reconcile-namespace-concurrency` of them for one namespace. A
//! reconcile first queues for its namespace's slot, then for a shared one
//! (both queues first come, first served), so the shared queue never holds
//! more than that many reconciles of one namespace: however many runs one
//! tenant creates, another tenant's run waits behind at most that many of
//! theirs, not all of them.
//!
//! kube-runtime's own limit is not used: it would hold a slot while the
//! reconcile waits for its namespace. A waiting reconcile costs a small
//! future and no slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The slots (0 in a limit: unbounded).
pub struct Slots {
    global: Option<Arc<Semaphore>>,
    per_namespace: usize,
    namespaces: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// Held while a reconcile runs.
pub struct Slot {
    _own: Option<OwnedSemaphorePermit>,
    _shared: Option<OwnedSemaphorePermit>,
}

impl Slots {
    pub fn new(global: usize, per_namespace: usize) -> Slots {
        Slots {
            global: (global > 0).then(|| Arc::new(Semaphore::new(global))),
            per_namespace,
            namespaces: Mutex::default(),
        }
    }

    /// Waits for a slot of `ns`, then for a shared one.
    pub async fn enter(&self, ns: &str) -> Slot {
        let own = match self.per_namespace {
            0 => None,
            n => {
                let queue = {
                    let mut namespaces = self.namespaces.lock().expect("not poisoned");
                    if namespaces.len() > 1024 {
                        // Namespaces nobody waits in are dropped.
                        namespaces.retain(|_, s| Arc::strong_count(s) > 1);
                    }
                    namespaces
                        .entry(ns.to_string())
                        .or_insert_with(|| Arc::new(Semaphore::new(n)))
                        .clone()
                };
                Some(queue.acquire_owned().await.expect("never closed"))
            }
        };
        let shared = match &self.global {
            None => None,
            Some(g) => Some(g.clone().acquire_owned().await.expect("never closed")),
        };
        Slot {
            _own: own,
            _shared: shared,
        }
    }

    /// Shared slots free now (for tests).
    #[cfg(test)]
    fn free(&self) -> usize {
        self.global.as_ref().map_or(0, |g| g.available_permits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_busy_namespace_leaves_the_other_slots_to_the_others() {
        let slots = Arc::new(Slots::new(4, 2));
        let (release, held) = tokio::sync::watch::channel(false);
        for _ in 0..50 {
            let (slots, mut held) = (slots.clone(), held.clone());
            tokio::spawn(async move {
                let _slot = slots.enter("noisy").await;
                let _ = held.wait_for(|r| *r).await;
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(slots.free(), 2, "the noisy namespace holds two slots");
        let entered = tokio::time::timeout(Duration::from_millis(100), slots.enter("quiet")).await;
        assert!(entered.is_ok(), "another namespace gets a slot at once");
        let _ = release.send(true);
    }

    #[tokio::test]
    async fn no_limits_means_no_waiting() {
        let slots = Slots::new(0, 0);
        let _a = slots.enter("a").await;
        let _b = slots.enter("a").await;
    }
}
