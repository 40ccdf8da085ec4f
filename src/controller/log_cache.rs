//! Each run's replayed log, kept between reconciles: a reconcile reads only
//! the records past the head it was built from, and none at all while the
//! store's head events (PostgreSQL `LISTEN/NOTIFY`) say nothing changed.
//!
//! Runs waiting for a human keep theirs too, within [`WAITING_BUDGET`]
//! payload bytes for all of them (the least recently parked go first): a
//! long run that comes to wait is not read again whole at every wake, and
//! 10,000 waiting runs still hold a bounded amount.
//!
//! Trust: every record is verified once, when it is first read (its chain
//! link from the cached head, its hash, the controller's signature and the
//! anchored head). A controller restart starts cold and verifies whole
//! logs again; step runners verify the whole chain at every Job start.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kube::runtime::reflector::ObjectRef;

use crate::api::AgentRun;
use crate::runlog::replay::RunState;
use crate::store::{Head, HeadEvent};

/// A run's log replayed up to `head`.
pub struct Replayed {
    pub state: RunState,
    pub head: Head,
    /// Payload bytes of the records replayed (what the cache is charged).
    pub bytes: u64,
    /// When the head record was stored (the store's clock), if known.
    pub head_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The head-event generation it was read under (see [`LogCache::current`]).
    generation: u64,
}

impl Replayed {
    /// The empty log, to be read from the start.
    pub fn empty() -> Replayed {
        Replayed {
            state: RunState::default(),
            head: Head::EMPTY,
            bytes: 0,
            head_at: None,
            generation: 0,
        }
    }
}

/// Payload bytes of replayed logs kept for waiting runs, all together.
pub const WAITING_BUDGET: u64 = 32 << 20;

/// Waiting runs' entries in the order they were parked, and their bytes.
#[derive(Default)]
struct Parked {
    /// (uid, ticket): a position is stale once its uid was taken or parked again.
    order: VecDeque<(String, u64)>,
    /// uid → (bytes, ticket of its current position).
    held: HashMap<String, (u64, u64)>,
    total: u64,
    next_ticket: u64,
}

impl Parked {
    fn remove(&mut self, uid: &str) {
        if let Some((bytes, _)) = self.held.remove(uid) {
            self.total -= bytes;
        }
    }

    fn push(&mut self, uid: &str, bytes: u64) {
        self.remove(uid);
        self.next_ticket += 1;
        self.held.insert(uid.to_string(), (bytes, self.next_ticket));
        self.order.push_back((uid.to_string(), self.next_ticket));
        self.total += bytes;
    }

    /// The uid parked longest ago, no longer held.
    fn pop_oldest(&mut self) -> Option<String> {
        while let Some((uid, ticket)) = self.order.pop_front() {
            if self.held.get(&uid).is_some_and(|(_, t)| *t == ticket) {
                self.remove(&uid);
                return Some(uid);
            }
        }
        None
    }
}

/// Replayed logs by run uid, and what the head events said since.
#[derive(Default)]
pub struct LogCache {
    entries: Mutex<HashMap<String, Replayed>>,
    parked: Mutex<Parked>,
    /// Runs announced changed since their entry was read.
    dirty: Mutex<HashSet<String>>,
    /// Moves on whenever head events may have been missed; an entry read
    /// under an older generation is not known to be current.
    generation: AtomicU64,
    /// Whether head events arrive at all (only then can a read be skipped).
    pushed: AtomicBool,
    /// Unfinished runs by uid, for turning a head event into a reconcile.
    refs: Mutex<HashMap<String, ObjectRef<AgentRun>>>,
}

impl LogCache {
    /// Takes the run's entry out for the reconcile (kube-runtime never runs
    /// two reconciles of one run at once); [`LogCache::keep`] puts it back.
    pub fn take(&self, uid: &str) -> Option<Replayed> {
        self.parked.lock().expect("not poisoned").remove(uid);
        self.entries.lock().expect("not poisoned").remove(uid)
    }

    pub fn keep(&self, uid: &str, replayed: Replayed) {
        self.entries
            .lock()
            .expect("not poisoned")
            .insert(uid.to_string(), replayed);
    }

    /// Keeps a waiting run's entry within [`WAITING_BUDGET`], dropping the
    /// entries parked longest ago (they are read again whole when woken).
    pub fn park(&self, uid: &str, replayed: Replayed) {
        self.park_within(uid, replayed, WAITING_BUDGET);
    }

    fn park_within(&self, uid: &str, replayed: Replayed, budget: u64) {
        let mut parked = self.parked.lock().expect("not poisoned");
        let mut entries = self.entries.lock().expect("not poisoned");
        parked.push(uid, replayed.bytes);
        entries.insert(uid.to_string(), replayed);
        while parked.total > budget {
            match parked.pop_oldest() {
                Some(oldest) => entries.remove(&oldest),
                None => break,
            };
        }
        // Stale positions of runs taken since go once they outnumber the held.
        if parked.order.len() > 2 * parked.held.len() + 64 {
            let Parked { order, held, .. } = &mut *parked;
            order.retain(|(u, t)| held.get(u).is_some_and(|(_, ticket)| ticket == t));
        }
    }

    /// Payload bytes held for waiting runs.
    pub fn parked_bytes(&self) -> u64 {
        self.parked.lock().expect("not poisoned").total
    }

    /// Whether `replayed` is known to be the run's whole log: head events
    /// arrive, none was missed since it was read and none named this run.
    pub fn current(&self, uid: &str, replayed: &Replayed) -> bool {
        self.pushed.load(Ordering::Acquire)
            && replayed.generation == self.generation.load(Ordering::Acquire)
            && !self.dirty.lock().expect("not poisoned").contains(uid)
    }

    /// The run's head moved (the controller appended): its entry is no
    /// longer known to be current.
    pub fn mark_changed(&self, uid: &str) {
        self.dirty
            .lock()
            .expect("not poisoned")
            .insert(uid.to_string());
    }

    /// Called right before reading the store for `uid`: an event arriving
    /// during the read marks it dirty again. Returns the generation to stamp
    /// the result with.
    pub fn begin_read(&self, uid: &str) -> u64 {
        let generation = self.generation.load(Ordering::Acquire);
        self.dirty.lock().expect("not poisoned").remove(uid);
        generation
    }

    pub fn stamp(&self, state: RunState, head: Head, generation: u64) -> Replayed {
        Replayed {
            state,
            head,
            bytes: 0,
            head_at: None,
            generation,
        }
    }

    /// Remembers how to reconcile the run when its head moves (unfinished
    /// runs only: a finished run's log no longer matters to the controller).
    pub fn follow(&self, uid: &str, run: ObjectRef<AgentRun>) {
        self.refs
            .lock()
            .expect("not poisoned")
            .insert(uid.to_string(), run);
    }

    /// Drops everything about a run (finished, deleted, or its log broken).
    pub fn forget(&self, uid: &str) {
        self.parked.lock().expect("not poisoned").remove(uid);
        self.entries.lock().expect("not poisoned").remove(uid);
        self.refs.lock().expect("not poisoned").remove(uid);
        self.dirty.lock().expect("not poisoned").remove(uid);
    }

    /// Keeps only the runs `exists` still knows (runs deleted while unfinished).
    pub fn retain(&self, exists: impl Fn(&ObjectRef<AgentRun>) -> bool) {
        let mut refs = self.refs.lock().expect("not poisoned");
        refs.retain(|_, r| exists(r));
        let mut parked = self.parked.lock().expect("not poisoned");
        self.entries
            .lock()
            .expect("not poisoned")
            .retain(|uid, _| refs.contains_key(uid));
        let gone: Vec<String> = parked
            .held
            .keys()
            .filter(|u| !refs.contains_key(*u))
            .cloned()
            .collect();
        for uid in gone {
            parked.remove(&uid);
        }
    }

    /// Head events arrive from now on.
    pub fn set_pushed(&self) {
        self.pushed.store(true, Ordering::Release);
    }

    /// Folds in one head event; returns the runs to reconcile.
    pub fn on_event(&self, event: HeadEvent) -> Vec<ObjectRef<AgentRun>> {
        match event {
            HeadEvent::Changed(uid) => {
                let run = self.refs.lock().expect("not poisoned").get(&uid).cloned();
                self.dirty.lock().expect("not poisoned").insert(uid);
                run.into_iter().collect()
            }
            HeadEvent::Resync => {
                self.generation.fetch_add(1, Ordering::AcqRel);
                self.refs
                    .lock()
                    .expect("not poisoned")
                    .values()
                    .cloned()
                    .collect()
            }
        }
    }

    /// The unfinished runs among `uids` (for lapsed leases).
    pub fn refs_of(&self, uids: &[String]) -> Vec<ObjectRef<AgentRun>> {
        let refs = self.refs.lock().expect("not poisoned");
        uids.iter().filter_map(|u| refs.get(u).cloned()).collect()
    }

    /// How many replayed logs are held (for tests and the scale benchmark).
    pub fn len(&self) -> usize {
        self.entries.lock().expect("not poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str) -> ObjectRef<AgentRun> {
        ObjectRef::new(name).within("ns")
    }

    #[test]
    fn log_cache_entry_is_current_until_an_event_names_its_run() {
        let cache = LogCache::default();
        cache.follow("u1", run("r1"));
        let generation = cache.begin_read("u1");
        let entry = cache.stamp(RunState::default(), Head::EMPTY, generation);
        // Without head events nothing is known to be current.
        assert!(!cache.current("u1", &entry));
        cache.set_pushed();
        assert!(cache.current("u1", &entry));
        // Another run's head moving changes nothing for this one.
        assert!(cache.on_event(HeadEvent::Changed("u2".into())).is_empty());
        assert!(cache.current("u1", &entry));
        // Its own head moving: reconcile it, and read before trusting the entry.
        assert_eq!(
            cache.on_event(HeadEvent::Changed("u1".into())),
            vec![run("r1")]
        );
        assert!(!cache.current("u1", &entry));
        let generation = cache.begin_read("u1");
        let entry = cache.stamp(RunState::default(), Head::EMPTY, generation);
        assert!(cache.current("u1", &entry));
    }

    #[test]
    fn log_cache_entry_is_not_current_after_the_controller_appends() {
        let cache = LogCache::default();
        cache.set_pushed();
        let entry = cache.stamp(RunState::default(), Head::EMPTY, cache.begin_read("u1"));
        assert!(cache.current("u1", &entry));
        cache.mark_changed("u1");
        assert!(!cache.current("u1", &entry));
    }

    #[test]
    fn log_cache_resync_invalidates_every_entry_and_wakes_every_run() {
        let cache = LogCache::default();
        cache.set_pushed();
        cache.follow("u1", run("r1"));
        cache.follow("u2", run("r2"));
        let entry = cache.stamp(RunState::default(), Head::EMPTY, cache.begin_read("u1"));
        let mut woken = cache.on_event(HeadEvent::Resync);
        woken.sort_by_key(|r| r.name.clone());
        assert_eq!(woken, vec![run("r1"), run("r2")]);
        assert!(!cache.current("u1", &entry));
    }

    #[test]
    fn log_cache_forgets_deleted_runs() {
        let cache = LogCache::default();
        cache.follow("u1", run("r1"));
        cache.follow("u2", run("r2"));
        cache.keep("u1", Replayed::empty());
        cache.keep("u2", Replayed::empty());
        cache.retain(|r| r.name == "r2");
        assert_eq!(cache.len(), 1);
        assert!(cache.take("u1").is_none());
        assert!(cache.refs_of(&["u1".into(), "u2".into()]) == vec![run("r2")]);
    }

    fn sized(bytes: u64) -> Replayed {
        let mut r = Replayed::empty();
        r.bytes = bytes;
        r
    }

    #[test]
    fn waiting_runs_keep_their_logs_within_the_budget_oldest_parked_dropped_first() {
        let cache = LogCache::default();
        cache.park_within("u1", sized(40), 100);
        cache.park_within("u2", sized(40), 100);
        // u1 woken and parked again: now the most recent.
        let woken = cache.take("u1").unwrap();
        cache.park_within("u1", woken, 100);
        cache.park_within("u3", sized(40), 100);
        // 120 > 100: u2, parked longest ago, goes; u1 and u3 stay.
        assert!(cache.take("u2").is_none());
        assert_eq!(cache.parked_bytes(), 80);
        assert!(cache.take("u1").is_some());
        assert_eq!(cache.parked_bytes(), 40);
        // A running run's entry is not charged and never dropped for the budget.
        cache.keep("u4", sized(1000));
        cache.park_within("u5", sized(90), 100);
        assert!(cache.take("u3").is_none());
        assert!(cache.take("u4").is_some());
        assert!(cache.take("u5").is_some());
        assert_eq!(cache.parked_bytes(), 0);
    }
}
