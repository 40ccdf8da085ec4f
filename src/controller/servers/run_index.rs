//! Which AgentRuns exist, by uid: an in-memory index fed by a metadata-only
//! watch. The step-log gateway consults it so a run's step token stops
//! opening the log once the run is deleted (or being deleted), even when the
//! run never reached `RunFinished`.
//!
//! A deleted run's uid is remembered as gone for [`GONE_KEPT`] (its step
//! pods hear "deleted", 410, while they are being stopped), then forgotten:
//! a uid neither live nor gone is refused too (503, never seen), so the
//! index holds the runs that exist and the recently deleted, not every run
//! the replica ever saw.
//!
//! It also keeps each live run's `metadata.creationTimestamp` (set by the
//! API server, which neither a run creator nor a database writer can move):
//! a step token of a key a rotation retired opens only runs created by the
//! time of its retirement.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use kube::api::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client};

use crate::api::AgentRun;

/// What the index knows of one uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunPresence {
    /// The run exists and is not being deleted.
    Live,
    /// Seen deleted, or carrying a deletion timestamp.
    Gone,
    /// Not seen (yet): created a moment ago, or deleted before this
    /// process started watching.
    Unknown,
    /// The first list has not completed.
    NotSynced,
}

#[derive(Default)]
struct Inner {
    synced: bool,
    /// Live runs, and when the API server created them.
    live: HashMap<String, Option<Timestamp>>,
    /// Deleted runs, and since when.
    gone: HashMap<String, Instant>,
    /// Live runs of a re-list in progress (swapped in at `InitDone`).
    relist: HashMap<String, Option<Timestamp>>,
    pruned_at: Option<Instant>,
}

/// Cheap to clone; every clone sees the same index.
#[derive(Clone, Default)]
pub struct RunIndex {
    inner: Arc<RwLock<Inner>>,
}

impl RunIndex {
    /// An index that already knows `live` (tests, and callers with their own source).
    pub fn with_live<I: IntoIterator<Item = String>>(live: I) -> RunIndex {
        RunIndex::with_created(live.into_iter().map(|uid| (uid, None)))
    }

    /// An index that knows `live` runs and when each was created.
    pub fn with_created<I>(live: I) -> RunIndex
    where
        I: IntoIterator<Item = (String, Option<Timestamp>)>,
    {
        let index = RunIndex::default();
        {
            let mut g = index.inner.write().expect("not poisoned");
            g.live = live.into_iter().collect();
            g.synced = true;
        }
        index
    }

    pub fn presence(&self, uid: &str) -> RunPresence {
        let g = self.inner.read().expect("not poisoned");
        if g.live.contains_key(uid) {
            RunPresence::Live
        } else if g.gone.contains_key(uid) {
            RunPresence::Gone
        } else if !g.synced {
            RunPresence::NotSynced
        } else {
            RunPresence::Unknown
        }
    }

    /// When live run `uid` was created (`None`: not live, or not said).
    pub fn created(&self, uid: &str) -> Option<Timestamp> {
        let g = self.inner.read().expect("not poisoned");
        g.live.get(uid).copied().flatten()
    }

    /// Marks `uid` deleted (also what a watch Delete does).
    pub fn forget(&self, uid: &str) {
        let mut g = self.inner.write().expect("not poisoned");
        g.live.remove(uid);
        g.gone.insert(uid.to_string(), Instant::now());
    }

    fn apply(&self, event: Event<PartialObjectMeta<AgentRun>>) {
        let mut g = self.inner.write().expect("not poisoned");
        prune(&mut g, Instant::now());
        match event {
            Event::Apply(m) => note(&mut g, &m, false),
            Event::Delete(m) => {
                if let Some(uid) = m.metadata.uid {
                    g.live.remove(&uid);
                    g.gone.insert(uid, Instant::now());
                }
            }
            Event::Init => g.relist.clear(),
            Event::InitApply(m) => note(&mut g, &m, true),
            Event::InitDone => {
                let relisted = std::mem::take(&mut g.relist);
                // What was live and is not any more was deleted meanwhile.
                let vanished: Vec<String> = g
                    .live
                    .keys()
                    .filter(|uid| !relisted.contains_key(*uid))
                    .cloned()
                    .collect();
                let now = Instant::now();
                g.gone.extend(vanished.into_iter().map(|u| (u, now)));
                g.live = relisted;
                g.synced = true;
            }
        }
    }

    /// Follows every AgentRun in the cluster until the process ends.
    pub async fn follow(self, client: Client) {
        // Metadata only: uids and deletion timestamps are all it needs.
        let runs: Api<PartialObjectMeta<AgentRun>> = Api::all(client);
        // With backoff: a list refused (RBAC) is retried, not hammered.
        let mut events = watcher(runs, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(e) => self.apply(e),
                // The watcher re-lists by itself; keep what is known meanwhile.
                Err(e) => tracing::warn!(error = %e, "watching AgentRuns for the step-log gateway"),
            }
        }
    }
}

/// How long a deleted run's uid is remembered as gone.
pub const GONE_KEPT: Duration = Duration::from_secs(15 * 60);

/// Forgets the runs deleted more than [`GONE_KEPT`] before `now` (looked
/// at once a minute at most: the index is written on every run event).
fn prune(g: &mut Inner, now: Instant) {
    if g.pruned_at
        .is_some_and(|at| now.duration_since(at) < Duration::from_secs(60))
    {
        return;
    }
    g.pruned_at = Some(now);
    g.gone.retain(|_, at| now.duration_since(*at) < GONE_KEPT);
}

fn note(g: &mut Inner, m: &PartialObjectMeta<AgentRun>, relist: bool) {
    let Some(uid) = m.metadata.uid.clone() else {
        return;
    };
    if m.metadata.deletion_timestamp.is_some() {
        g.live.remove(&uid);
        g.gone.insert(uid, Instant::now());
    } else {
        let created = m.metadata.creation_timestamp.as_ref().map(|t| t.0);
        match relist {
            true => g.relist.insert(uid, created),
            false => g.live.insert(uid, created),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn meta(uid: &str, deleting: bool) -> PartialObjectMeta<AgentRun> {
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                deletion_timestamp: deleting.then(|| Time(jiff::Timestamp::now())),
                ..Default::default()
            },
            _phantom: Default::default(),
        }
    }

    #[test]
    fn run_index_follows_creation_deletion_and_relists() {
        let index = RunIndex::default();
        assert_eq!(index.presence("a"), RunPresence::NotSynced);
        index.apply(Event::Init);
        index.apply(Event::InitApply(meta("a", false)));
        index.apply(Event::InitApply(meta("b", true)));
        index.apply(Event::InitDone);
        assert_eq!(index.presence("a"), RunPresence::Live);
        assert_eq!(index.presence("b"), RunPresence::Gone);
        assert_eq!(index.presence("c"), RunPresence::Unknown);
        let mut created = meta("c", false);
        let at: jiff::Timestamp = "2026-12-05T12:00:00Z".parse().unwrap();
        created.metadata.creation_timestamp = Some(Time(at));
        index.apply(Event::Apply(created));
        assert_eq!(index.presence("c"), RunPresence::Live);
        assert_eq!(
            index.created("c"),
            Some(at),
            "when the API server created it"
        );
        assert_eq!(index.created("a"), None, "not said");
        index.apply(Event::Delete(meta("c", false)));
        assert_eq!(index.presence("c"), RunPresence::Gone);
        assert_eq!(
            index.created("c"),
            None,
            "a deleted run opens to no retired key"
        );
        // A re-list that no longer holds `a`: it was deleted while the watch was down.
        index.apply(Event::Init);
        index.apply(Event::InitDone);
        assert_eq!(index.presence("a"), RunPresence::Gone);
    }

    #[test]
    fn a_deleted_run_is_gone_for_a_while_then_forgotten() {
        let index = RunIndex::with_live(["a".to_string(), "b".to_string()]);
        index.forget("a");
        index.apply(Event::Delete(meta("b", false)));
        assert_eq!(index.presence("a"), RunPresence::Gone);
        let mut g = index.inner.write().unwrap();
        let later = Instant::now() + GONE_KEPT + Duration::from_secs(1);
        prune(&mut g, later);
        assert!(g.gone.is_empty(), "nothing deleted long ago is kept");
        drop(g);
        // Still refused: never seen is not live.
        assert_eq!(index.presence("a"), RunPresence::Unknown);
        assert_eq!(index.presence("b"), RunPresence::Unknown);
    }
}
