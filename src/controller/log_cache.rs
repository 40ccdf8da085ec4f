//! Each run's replayed log, kept between reconciles: a reconcile reads only
//! the records past the head it was built from, and none at all while the
//! store's head events (PostgreSQL `LISTEN/NOTIFY`) say nothing changed.
//!
//! Runs waiting for a human hold none: they are read and verified whole
//! when woken, which also catches a log rewritten in the database while
//! they waited. They hold an [`Asleep`] token instead, of what would wake
//! them: a reconcile that finds the run, its Approval's decisions and its
//! head as they were (woken by a Job's deletion, or by the controller's own
//! writes) reads nothing. A controller start is not a wake either: a run
//! found waiting then, its head where the status anchors it, gets a token
//! without its log being read.
//!
//! Memory: the cache holds at most its budget of record bytes (payload
//! sizes, estimated), and one run at most a quarter of it; a run over that
//! is not kept, and keeping one evicts others until it fits. A run without
//! an entry is read again from the store (or its checkpoint), as after a
//! restart: bounded memory costs reads, never correctness.
//!
//! Trust: every record is verified once, when it is first read (its chain
//! link from the cached head, its hash, the controller's signature and the
//! anchored head). A controller restart starts cold and verifies whole
//! logs again; step runners verify the whole chain at every Job start.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kube::runtime::reflector::ObjectRef;

use crate::api::AgentRun;
use crate::runlog::replay::{RunState, Step};
use crate::store::{Hash, Head, HeadEvent, Record};

/// A run's log replayed up to `head`.
pub struct Replayed {
    pub state: RunState,
    pub head: Head,
    /// When the head record was stored (the store's clock), if known.
    pub head_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The head-event generation it was read under (see [`LogCache::current`]).
    generation: u64,
    /// Resumed from the run's checkpoint: the records before it are still
    /// to be verified (once, by the first reconcile after the decision it
    /// was read for that does not go straight on to another).
    pub resumed: bool,
    /// Hashes of the records a checkpoint may name (see [`RunState::pinned_before`]).
    hashes: BTreeMap<u64, Hash>,
    /// The hash each record that may start a window chains from.
    links: BTreeMap<u64, Hash>,
    /// Estimated bytes of each record the state still holds.
    sizes: BTreeMap<u64, usize>,
}

impl Replayed {
    /// The head-event generation it was read under.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The empty log, to be read from the start.
    pub fn empty() -> Replayed {
        Replayed::at(RunState::default(), Head::EMPTY)
    }

    /// `state`, replayed up to `head`, read on from there.
    pub fn at(state: RunState, head: Head) -> Replayed {
        Replayed {
            state,
            head,
            head_at: None,
            generation: 0,
            resumed: false,
            hashes: BTreeMap::new(),
            links: BTreeMap::new(),
            sizes: BTreeMap::new(),
        }
    }

    /// A log resumed at its checkpoint: read on from there, and verified
    /// whole once (`resumed`).
    pub fn resumed(r: super::checkpoint::Resumed) -> Replayed {
        let mut replayed = Replayed::at(r.state, r.head);
        replayed.resumed = true;
        replayed.hashes = r.records.iter().map(|r| (r.seq, r.hash)).collect();
        replayed.sizes = r.records.iter().map(|r| (r.seq, record_bytes(r))).collect();
        replayed.links.insert(r.head.len, r.head.hash);
        replayed
    }

    /// Folds in the next record (decoded as `step`), remembering the hashes
    /// a checkpoint may name.
    pub fn apply(&mut self, record: &Record, step: Step) {
        self.sizes.insert(record.seq, record_bytes(record));
        match &step {
            Step::RunStarted(_) | Step::VersionChanged(_) | Step::Summary(_) => {
                self.hashes.insert(record.seq, record.hash);
            }
            Step::ModelCall(m) => {
                if m.response.text.as_ref().is_some_and(|t| !t.is_empty()) {
                    self.hashes.insert(record.seq, record.hash);
                }
                self.links.insert(record.seq, record.prev_hash);
            }
            Step::ToolIntent(_) => {
                self.links.insert(record.seq, record.prev_hash);
            }
            _ => {}
        }
        self.state.apply(step);
        self.head = record.head();
    }

    /// Lets go of the records before the state's window and of the hashes
    /// no checkpoint can name any more.
    pub fn compact(&mut self) {
        self.state.compact();
        let base = self.state.base();
        let pinned = self.state.pinned_before(base);
        self.hashes
            .retain(|seq, _| *seq >= base || pinned.contains(seq));
        self.links.retain(|seq, _| *seq >= base);
        self.sizes
            .retain(|seq, _| *seq >= base || pinned.contains(seq));
    }

    /// Estimated bytes of the records it holds.
    pub fn bytes(&self) -> usize {
        self.sizes.values().sum()
    }

    /// The hash of record `seq`, if it is one a checkpoint may name.
    pub fn hash_of(&self, seq: u64) -> Option<Hash> {
        self.hashes.get(&seq).copied()
    }

    /// The hash of record `seq - 1`, if `seq` may start a window.
    pub fn link_into(&self, seq: u64) -> Option<Hash> {
        self.links.get(&seq).copied()
    }
}

/// A record's estimated size in memory: its payload's strings and numbers,
/// plus a fixed cost per record and per JSON node.
fn record_bytes(record: &Record) -> usize {
    fn walk(v: &serde_json::Value) -> usize {
        use serde_json::Value::*;
        16 + match v {
            String(s) => s.len(),
            Array(a) => a.iter().map(walk).sum(),
            Object(o) => o.iter().map(|(k, v)| k.len() + walk(v)).sum(),
            Null | Bool(_) | Number(_) => 0,
        }
    }
    256 + walk(&record.payload)
}

/// What a waiting run was last found waiting on. While none of it changes
/// and `wake_at` has not come, there is nothing to decide for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Asleep {
    /// The verified (or anchored and read) head of its log.
    pub head: Head,
    /// The head-event generation `head` was read under.
    pub generation: u64,
    /// The run's `resourceVersion` (after the controller's own status write).
    pub run_version: Option<String>,
    /// The Approval's name and `metadata.generation` (its decisions are spec).
    pub approval: String,
    pub approval_generation: Option<i64>,
    /// Its expiry, or the run's deadline if that comes first.
    pub wake_at: jiff::Timestamp,
}

/// Replayed logs by run uid, and what the head events said since.
#[derive(Default)]
pub struct LogCache {
    entries: Mutex<Entries>,
    /// Bytes of records all entries may hold; 0: unbounded.
    budget: usize,
    asleep: Mutex<HashMap<String, Asleep>>,
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

/// The replayed logs and the bytes they hold.
#[derive(Default)]
struct Entries {
    map: HashMap<String, (Replayed, usize)>,
    bytes: usize,
}

impl Entries {
    fn remove(&mut self, uid: &str) -> Option<Replayed> {
        let (replayed, bytes) = self.map.remove(uid)?;
        self.bytes -= bytes;
        Some(replayed)
    }
}

impl LogCache {
    /// A cache holding at most `budget` bytes of records (0: unbounded).
    pub fn with_budget(budget: usize) -> LogCache {
        LogCache {
            budget,
            ..Default::default()
        }
    }

    /// Estimated bytes of records held.
    pub fn bytes(&self) -> usize {
        self.entries.lock().expect("not poisoned").bytes
    }

    /// Takes the run's entry out for the reconcile (kube-runtime never runs
    /// two reconciles of one run at once); [`LogCache::keep`] puts it back.
    pub fn take(&self, uid: &str) -> Option<Replayed> {
        self.entries.lock().expect("not poisoned").remove(uid)
    }

    /// Puts the run's entry back, within the budget: a run over a quarter
    /// of it is not kept; others are evicted until it fits.
    pub fn keep(&self, uid: &str, replayed: Replayed) {
        let bytes = replayed.bytes();
        let mut entries = self.entries.lock().expect("not poisoned");
        entries.remove(uid);
        if self.budget > 0 {
            if bytes > self.budget / 4 {
                return;
            }
            while entries.bytes + bytes > self.budget {
                let Some(victim) = entries.map.keys().next().cloned() else {
                    break;
                };
                entries.remove(&victim);
            }
        }
        entries.bytes += bytes;
        entries.map.insert(uid.to_string(), (replayed, bytes));
    }

    /// Whether `replayed` is known to be the run's whole log: head events
    /// arrive, none was missed since it was read and none named this run.
    pub fn current(&self, uid: &str, replayed: &Replayed) -> bool {
        self.unchanged_since(uid, replayed.generation)
    }

    /// Whether the run's head is known not to have moved since it was read
    /// under head-event `generation`.
    pub fn unchanged_since(&self, uid: &str, generation: u64) -> bool {
        self.pushed.load(Ordering::Acquire)
            && generation == self.generation.load(Ordering::Acquire)
            && !self.dirty.lock().expect("not poisoned").contains(uid)
    }

    /// Takes the run's token out (it is put back while the run still waits).
    pub fn take_asleep(&self, uid: &str) -> Option<Asleep> {
        self.asleep.lock().expect("not poisoned").remove(uid)
    }

    pub fn put_asleep(&self, uid: &str, asleep: Asleep) {
        self.asleep
            .lock()
            .expect("not poisoned")
            .insert(uid.to_string(), asleep);
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

    /// Stamps `replayed` as read under head-event `generation`.
    pub fn stamp(&self, mut replayed: Replayed, generation: u64) -> Replayed {
        replayed.generation = generation;
        replayed
    }

    /// Remembers how to reconcile the run when its head moves (unfinished
    /// runs only: a finished run's log no longer matters to the controller).
    pub fn follow(&self, uid: &str, run: ObjectRef<AgentRun>) {
        self.refs
            .lock()
            .expect("not poisoned")
            .insert(uid.to_string(), run);
    }

    /// Whether this process has reconciled the run since it started (and
    /// not forgotten it): a run it has not is seen for the first time.
    pub fn follows(&self, uid: &str) -> bool {
        self.refs.lock().expect("not poisoned").contains_key(uid)
    }

    /// Drops everything about a run (finished, deleted, or its log broken).
    pub fn forget(&self, uid: &str) {
        self.entries.lock().expect("not poisoned").remove(uid);
        self.asleep.lock().expect("not poisoned").remove(uid);
        self.refs.lock().expect("not poisoned").remove(uid);
        self.dirty.lock().expect("not poisoned").remove(uid);
    }

    /// Keeps only the runs `exists` still knows (runs deleted while unfinished).
    pub fn retain(&self, exists: impl Fn(&ObjectRef<AgentRun>) -> bool) {
        let mut refs = self.refs.lock().expect("not poisoned");
        refs.retain(|_, r| exists(r));
        let mut entries = self.entries.lock().expect("not poisoned");
        let gone: Vec<String> = entries
            .map
            .keys()
            .filter(|uid| !refs.contains_key(*uid))
            .cloned()
            .collect();
        for uid in gone {
            entries.remove(&uid);
        }
        drop(entries);
        self.asleep
            .lock()
            .expect("not poisoned")
            .retain(|uid, _| refs.contains_key(uid));
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
        self.entries.lock().expect("not poisoned").map.len()
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
        let entry = cache.stamp(Replayed::empty(), generation);
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
        let entry = cache.stamp(Replayed::empty(), generation);
        assert!(cache.current("u1", &entry));
    }

    #[test]
    fn log_cache_entry_is_not_current_after_the_controller_appends() {
        let cache = LogCache::default();
        cache.set_pushed();
        let entry = cache.stamp(Replayed::empty(), cache.begin_read("u1"));
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
        let entry = cache.stamp(Replayed::empty(), cache.begin_read("u1"));
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

    fn holding(bytes: usize) -> Replayed {
        let mut r = Replayed::empty();
        r.sizes.insert(0, bytes);
        r
    }

    #[test]
    fn log_cache_holds_at_most_its_budget_in_bytes() {
        let cache = LogCache::with_budget(1000);
        cache.keep("u1", holding(200));
        cache.keep("u2", holding(200));
        assert_eq!(cache.bytes(), 400);
        // A run over a quarter of the budget is read again, never held.
        cache.keep("big", holding(251));
        assert!(cache.take("big").is_none());
        assert_eq!(cache.bytes(), 400);
        // Keeping more evicts others until it fits.
        for i in 0..10 {
            cache.keep(&format!("more-{i}"), holding(250));
            assert!(cache.bytes() <= 1000, "{} bytes held", cache.bytes());
        }
        assert!(cache.bytes() > 750, "evicted only what was needed");
        // Taking, keeping again and forgetting keep the count exact.
        let held = cache.bytes();
        let r = cache.take("more-9").expect("the last one kept");
        assert_eq!(cache.bytes(), held - 250);
        cache.keep("more-9", r);
        assert_eq!(cache.bytes(), held);
        cache.forget("more-9");
        assert_eq!(cache.bytes(), held - 250);
    }

    #[test]
    fn a_records_size_grows_with_its_payload() {
        let record = |text: &str| {
            crate::store::RecordDraft::new(
                crate::store::StepKind::Observation,
                serde_json::json!({"text": text}),
            )
            .seal(&Head::EMPTY)
            .unwrap()
        };
        let small = record_bytes(&record("x"));
        let big = record_bytes(&record(&"x".repeat(1 << 20)));
        assert!(big - small >= (1 << 20) - 1, "{small} {big}");
    }
}
