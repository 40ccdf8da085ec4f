//! What the controller remembers about each run between reconciles, in one
//! place: one [`Remembered`] per run uid, created when a reconcile first
//! needs it. A new thing to remember is a field here, never another map
//! with its own forgetting rule. The rule has two parts:
//!
//! - **What drives a run** (its replayed log, its sleep token, how to
//!   reconcile it, its lease, credential, progress and failure notes, its
//!   MCP discovery in flight) is let go in one call when the run finishes
//!   or its log is found broken ([`RunMemory::finished`]), and for every run
//!   when this process stops leading ([`RunMemory::clear`]): whoever drives
//!   it next reads it again.
//! - **What must not happen twice** while the run exists (the records and
//!   Jobs the metrics counted, its end and its broken log reported) stays a
//!   few words per run until the run leaves the watch cache
//!   ([`RunMemory::retain`]), the one place a run leaves whole. A finished
//!   run reconciled again replays its log; with its count forgotten, its
//!   records would be counted twice.
//!
//! The largest part is each run's replayed log: a reconcile reads only the
//! records past the head it was built from, and none at all while the
//! store's head events (PostgreSQL `LISTEN/NOTIFY`) say nothing changed.
//!
//! Runs waiting for a human hold no log: they are read and verified whole
//! when woken, which also catches a log rewritten in the database while
//! they waited. They hold an [`Asleep`] token instead, of what would wake
//! them: a reconcile that finds the run, its Approval's decisions and its
//! head as they were (woken by a Job's deletion, or by the controller's own
//! writes) reads nothing. A controller start is not a wake either: a run
//! found waiting then, its head where the status anchors it, gets a token
//! without its log being read.
//!
//! Memory: the logs held come to at most the budget of record bytes
//! (payload sizes, estimated), and one run's to at most a quarter of it; a
//! run over that keeps no log, and keeping one lets go of the logs used
//! longest ago until it fits. A run without a log is read again from the
//! store (or its checkpoint), as after a restart: bounded memory costs
//! reads, never correctness.
//!
//! Trust: every record is verified once, when it is first read (its chain
//! link from the cached head, its hash, the controller's signature and the
//! anchored head). A controller restart starts cold and verifies whole
//! logs again; step runners verify the whole chain at every Job start.

mod asks;
mod replayed;

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;

pub use asks::{Ask, AskState};
pub use replayed::{Replayed, record_bytes};

use crate::api::AgentRun;
use crate::controller::metrics::Counted;
use crate::store::{Head, HeadEvent};

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

/// Everything the reconciler keeps about one run between reconciles.
#[derive(Default)]
struct Remembered {
    /// How to reconcile the run when its head moves; set once this process
    /// has reconciled it unfinished.
    run: Option<ObjectRef<AgentRun>>,
    /// Its replayed log, unless taken out by a reconcile or let go.
    log: Option<Held>,
    /// What it waits on, while it waits for a human.
    asleep: Option<Asleep>,
    /// Announced changed since its log was read.
    dirty: bool,
    /// Since when its worker's lease has been seen free while its step runs.
    lease_free_since: Option<Instant>,
    /// Its step credential Secret was created or found by this process.
    credential: bool,
    /// When its progress was last written to its status.
    progress_written: Option<Instant>,
    /// Failed reconciles in a row (the error backoff).
    failures: u32,
    /// Reported with a broken log (counted once, however many reconciles
    /// see the break before the status says so): kept until it is deleted.
    tampered: bool,
    /// The head up to which this process verified the whole log, kept when
    /// the log itself is too large to hold: a log resumed at its checkpoint
    /// that reaches this head needs no whole verification again.
    verified: Option<Head>,
    /// Its MCP discovery asked for or answered, until the run records it.
    discovery: Option<Ask>,
    // What must not happen twice: kept until the run is deleted.
    /// How much of its log and which Job the metrics counted.
    counted: Counted,
    /// Its end was reported (a reconcile that read the run before the end's
    /// status write came back decides the same end again).
    ended: bool,
}

impl Remembered {
    /// Lets go of what drives the run, keeping what must not happen twice.
    /// (Dropping a discovery in flight aborts it.)
    fn let_go(&mut self) {
        *self = Remembered {
            counted: std::mem::take(&mut self.counted),
            ended: self.ended,
            tampered: self.tampered,
            ..Remembered::default()
        };
    }
}

/// A replayed log held, its estimated bytes, and when it was last kept.
struct Held {
    replayed: Replayed,
    bytes: usize,
    used: u64,
}

/// The runs remembered, and the logs held by when they were last kept.
#[derive(Default)]
struct Runs {
    map: HashMap<String, Remembered>,
    /// Held logs by their `used` tick: the oldest is let go first.
    by_use: BTreeMap<u64, String>,
    bytes: usize,
    tick: u64,
}

impl Runs {
    fn entry(&mut self, uid: &str) -> &mut Remembered {
        self.map.entry(uid.to_string()).or_default()
    }

    /// Takes the run's log out, keeping the rest of what is remembered.
    fn take_log(&mut self, uid: &str) -> Option<Replayed> {
        let held = self.map.get_mut(uid)?.log.take()?;
        self.by_use.remove(&held.used);
        self.bytes -= held.bytes;
        Some(held.replayed)
    }

    fn remove(&mut self, uid: &str) {
        self.take_log(uid);
        self.map.remove(uid);
    }

    fn let_go(&mut self, uid: &str) {
        self.take_log(uid);
        if let Some(r) = self.map.get_mut(uid) {
            r.let_go();
        }
    }
}

/// What the controller remembers about every run, and what the head events
/// said since.
#[derive(Default)]
pub struct RunMemory {
    runs: Mutex<Runs>,
    /// Bytes of records all held logs may come to; 0: unbounded.
    budget: usize,
    /// Moves on whenever head events may have been missed; a log read
    /// under an older generation is not known to be current.
    generation: AtomicU64,
    /// Whether head events arrive at all (only then can a read be skipped).
    pushed: AtomicBool,
}

impl RunMemory {
    /// A memory holding logs of at most `budget` bytes of records (0: unbounded).
    pub fn with_budget(budget: usize) -> RunMemory {
        RunMemory {
            budget,
            ..Default::default()
        }
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, Runs> {
        self.runs.lock().expect("not poisoned")
    }

    /// Estimated bytes of the logs held.
    pub fn bytes(&self) -> usize {
        self.runs().bytes
    }

    /// How many runs are remembered at all.
    pub fn len(&self) -> usize {
        self.runs().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether anything at all is remembered about the run.
    pub fn remembers(&self, uid: &str) -> bool {
        self.runs().map.contains_key(uid)
    }

    /// How many replayed logs are held.
    pub fn logs_held(&self) -> usize {
        self.runs().by_use.len()
    }

    /// Takes the run's log out for the reconcile (kube-runtime never runs
    /// two reconciles of one run at once); [`RunMemory::keep`] puts it back.
    pub fn take(&self, uid: &str) -> Option<Replayed> {
        self.runs().take_log(uid)
    }

    /// Puts the run's log back, within the budget: a run over a quarter of
    /// it keeps none; the logs used longest ago are let go until it fits.
    pub fn keep(&self, uid: &str, replayed: Replayed) {
        let bytes = replayed.bytes();
        let mut runs = self.runs();
        runs.take_log(uid);
        if self.budget > 0 {
            if bytes > self.budget / 4 {
                return;
            }
            while runs.bytes + bytes > self.budget {
                let Some(oldest) = runs.by_use.first_key_value().map(|(_, u)| u.clone()) else {
                    break;
                };
                runs.take_log(&oldest);
            }
        }
        runs.tick += 1;
        let used = runs.tick;
        runs.bytes += bytes;
        runs.by_use.insert(used, uid.to_string());
        runs.entry(uid).log = Some(Held {
            replayed,
            bytes,
            used,
        });
    }

    /// Whether `replayed` is known to be the run's whole log: head events
    /// arrive, none was missed since it was read and none named this run.
    pub fn current(&self, uid: &str, replayed: &Replayed) -> bool {
        self.unchanged_since(uid, replayed.generation())
    }

    /// Whether the run's head is known not to have moved since it was read
    /// under head-event `generation`.
    pub fn unchanged_since(&self, uid: &str, generation: u64) -> bool {
        self.pushed.load(Ordering::Acquire)
            && generation == self.generation.load(Ordering::Acquire)
            && self.runs().map.get(uid).is_some_and(|r| !r.dirty)
    }

    /// Takes the run's token out (it is put back while the run still waits).
    pub fn take_asleep(&self, uid: &str) -> Option<Asleep> {
        self.runs().map.get_mut(uid)?.asleep.take()
    }

    /// The run waits for a human: its log is read and verified whole when
    /// it wakes (a log rewritten while it waited is caught then).
    pub fn put_asleep(&self, uid: &str, asleep: Asleep) {
        let mut runs = self.runs();
        let run = runs.entry(uid);
        run.asleep = Some(asleep);
        run.verified = None;
    }

    /// This process verified the run's whole log up to `head`.
    pub fn set_verified(&self, uid: &str, head: Head) {
        self.runs().entry(uid).verified = Some(head);
    }

    /// The head up to which this process verified the run's whole log.
    pub fn verified(&self, uid: &str) -> Option<Head> {
        self.runs().map.get(uid)?.verified
    }

    /// The run's head moved (the controller appended): its log is no longer
    /// known to be current.
    pub fn mark_changed(&self, uid: &str) {
        if let Some(r) = self.runs().map.get_mut(uid) {
            r.dirty = true;
        }
    }

    /// Called right before reading the store for `uid`: an event arriving
    /// during the read marks it dirty again. Returns the generation to stamp
    /// the result with.
    pub fn begin_read(&self, uid: &str) -> u64 {
        let generation = self.generation.load(Ordering::Acquire);
        self.runs().entry(uid).dirty = false;
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
        self.runs().entry(uid).run = Some(run);
    }

    /// Whether this process has reconciled the run since it started (and
    /// not forgotten it): a run it has not is seen for the first time.
    pub fn follows(&self, uid: &str) -> bool {
        self.runs().map.get(uid).is_some_and(|r| r.run.is_some())
    }

    /// Notes that this process reports the run's end: `true` the first
    /// time, `false` when it did already (a stale read of the run).
    pub fn first_end(&self, uid: &str) -> bool {
        !std::mem::replace(&mut self.runs().entry(uid).ended, true)
    }

    /// Lets go of what drives a run that finished, or whose broken log its
    /// status now reports (see the module's forgetting rule).
    pub fn finished(&self, uid: &str) {
        self.runs().let_go(uid);
    }

    /// The run's counts of what the metrics counted already (see
    /// [`crate::controller::metrics::Metrics::observe_log`]).
    pub fn counted<R>(&self, uid: &str, count: impl FnOnce(&mut Counted) -> R) -> R {
        count(&mut self.runs().entry(uid).counted)
    }

    /// The run's MCP discovery, asked for or answered (the reconcile asks).
    pub fn ask<R>(&self, uid: &str, f: impl FnOnce(&mut Option<Ask>) -> R) -> R {
        f(&mut self.runs().entry(uid).discovery)
    }

    /// The run's MCP discovery if the run is still remembered (the worker
    /// answers: a run let go of meanwhile gets no entry back).
    pub fn answer(&self, uid: &str, f: impl FnOnce(&mut Ask)) {
        if let Some(ask) = self
            .runs()
            .map
            .get_mut(uid)
            .and_then(|r| r.discovery.as_mut())
        {
            f(ask);
        }
    }

    /// Keeps only the runs that still exist (`exists` of their uid): a
    /// deleted run, finished or not, leaves nothing behind.
    pub fn retain(&self, exists: impl Fn(&str) -> bool) {
        let mut runs = self.runs();
        let gone: Vec<String> = runs.map.keys().filter(|u| !exists(u)).cloned().collect();
        for uid in gone {
            runs.remove(&uid);
        }
    }

    /// Lets go of what drives every run (leadership lost: another replica
    /// drives them now).
    pub fn clear(&self) {
        let mut runs = self.runs();
        let uids: Vec<String> = runs.map.keys().cloned().collect();
        for uid in uids {
            runs.let_go(&uid);
        }
    }

    /// Head events arrive from now on.
    pub fn set_pushed(&self) {
        self.pushed.store(true, Ordering::Release);
    }

    /// Folds in one head event; returns the runs to reconcile.
    pub fn on_event(&self, event: HeadEvent) -> Vec<ObjectRef<AgentRun>> {
        let mut runs = self.runs();
        match event {
            HeadEvent::Changed(uid) => {
                let Some(r) = runs.map.get_mut(&uid) else {
                    return vec![];
                };
                r.dirty = true;
                r.run.clone().into_iter().collect()
            }
            HeadEvent::Resync => {
                self.generation.fetch_add(1, Ordering::AcqRel);
                runs.map.values().filter_map(|r| r.run.clone()).collect()
            }
        }
    }

    /// The followed runs among `uids` (for lapsed leases).
    pub fn refs_of(&self, uids: &[String]) -> Vec<ObjectRef<AgentRun>> {
        let runs = self.runs();
        uids.iter()
            .filter_map(|u| runs.map.get(u).and_then(|r| r.run.clone()))
            .collect()
    }

    /// How long the run's worker lease has been seen free (`free`), from
    /// the first time it was; a held lease starts the count again.
    pub fn lease_free_for(&self, uid: &str, free: bool) -> Duration {
        let mut runs = self.runs();
        if !free {
            if let Some(r) = runs.map.get_mut(uid) {
                r.lease_free_since = None;
            }
            return Duration::ZERO;
        }
        runs.entry(uid)
            .lease_free_since
            .get_or_insert_with(Instant::now)
            .elapsed()
    }

    /// Whether the run's step credential Secret is known to exist.
    pub fn has_credential(&self, uid: &str) -> bool {
        self.runs().map.get(uid).is_some_and(|r| r.credential)
    }

    pub fn set_credential(&self, uid: &str, known: bool) {
        let mut runs = self.runs();
        match runs.map.get_mut(uid) {
            Some(r) => r.credential = known,
            None if known => runs.entry(uid).credential = true,
            None => {}
        }
    }

    /// `None` when the run's progress may be written now (and notes that it
    /// is), else how long until it may: at most one write per `every`.
    pub fn progress_due(&self, uid: &str, every: Duration) -> Option<Duration> {
        let mut runs = self.runs();
        let r = runs.entry(uid);
        let now = Instant::now();
        match r.progress_written {
            Some(at) if now.duration_since(at) < every => Some(every - now.duration_since(at)),
            _ => {
                r.progress_written = Some(now);
                None
            }
        }
    }

    /// One more failed reconcile in a row; returns how many.
    pub fn failed(&self, uid: &str) -> u32 {
        let mut runs = self.runs();
        let r = runs.entry(uid);
        r.failures = r.failures.saturating_add(1);
        r.failures
    }

    /// A reconcile succeeded: the next failure is the first in a row.
    pub fn succeeded(&self, uid: &str) {
        if let Some(r) = self.runs().map.get_mut(uid) {
            r.failures = 0;
        }
    }

    /// Notes the run's log as broken; true the first time.
    pub fn first_tamper(&self, uid: &str) -> bool {
        !std::mem::replace(&mut self.runs().entry(uid).tampered, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str) -> ObjectRef<AgentRun> {
        ObjectRef::new(name).within("ns")
    }

    #[test]
    fn a_runs_end_is_first_once_until_the_run_is_deleted() {
        let memory = RunMemory::default();
        assert!(memory.first_end("u1"));
        assert!(!memory.first_end("u1"), "a stale read ends nothing twice");
        memory.finished("u1");
        memory.clear();
        assert!(!memory.first_end("u1"), "kept while the run exists");
        memory.retain(|_| false);
        assert!(memory.first_end("u1"), "a deleted run leaves nothing");
    }

    #[test]
    fn log_cache_entry_is_current_until_an_event_names_its_run() {
        let cache = RunMemory::default();
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
        let cache = RunMemory::default();
        cache.set_pushed();
        let entry = cache.stamp(Replayed::empty(), cache.begin_read("u1"));
        assert!(cache.current("u1", &entry));
        cache.mark_changed("u1");
        assert!(!cache.current("u1", &entry));
    }

    #[test]
    fn log_cache_resync_invalidates_every_entry_and_wakes_every_run() {
        let cache = RunMemory::default();
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
    fn memory_forgets_deleted_runs() {
        let cache = RunMemory::default();
        cache.follow("u1", run("r1"));
        cache.follow("u2", run("r2"));
        cache.keep("u1", Replayed::empty());
        cache.keep("u2", Replayed::empty());
        cache.retain(|uid| uid == "u2");
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
        let cache = RunMemory::with_budget(1000);
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
        cache.finished("more-9");
        assert_eq!(cache.bytes(), held - 250);
    }

    #[test]
    fn memory_lets_go_of_the_log_used_longest_ago_first() {
        let memory = RunMemory::with_budget(1000);
        memory.keep("old", holding(250));
        memory.keep("mid", holding(250));
        memory.keep("new", holding(250));
        // "old" is used again: now "mid" is the one used longest ago.
        let again = memory.take("old").unwrap();
        memory.keep("old", again);
        memory.keep("more", holding(250));
        memory.keep("most", holding(250));
        assert!(
            memory.take("mid").is_none(),
            "the least recently kept went first"
        );
        for uid in ["old", "new", "more", "most"] {
            assert!(memory.take(uid).is_some(), "{uid} still held");
        }
    }

    /// Every field a reconcile may set, for one run.
    fn remember_everything(memory: &RunMemory, uid: &str) {
        memory.follow(uid, run(uid));
        memory.keep(uid, holding(10));
        memory.put_asleep(
            uid,
            Asleep {
                head: Head::EMPTY,
                generation: 0,
                run_version: None,
                approval: "a".into(),
                approval_generation: None,
                wake_at: jiff::Timestamp::UNIX_EPOCH,
            },
        );
        memory.mark_changed(uid);
        memory.lease_free_for(uid, true);
        memory.set_credential(uid, true);
        memory.progress_due(uid, Duration::from_secs(5));
        memory.failed(uid);
        memory.ask(uid, |ask| {
            *ask = Some(Ask {
                key: "k".into(),
                state: AskState::Done(Ok(Default::default())),
                since: Instant::now(),
                failures: 0,
            })
        });
        let metrics = crate::controller::metrics::Metrics::new(&mut Default::default());
        memory.counted(uid, |c| metrics.observe_log(c, &[]));
        memory.first_end(uid);
        memory.first_tamper(uid);
    }

    /// Nothing of what drives the run is left.
    fn drives_nothing(memory: &RunMemory, uid: &str) {
        assert!(memory.take(uid).is_none() && memory.take_asleep(uid).is_none());
        assert!(!memory.follows(uid) && !memory.has_credential(uid));
        assert!(memory.refs_of(&[uid.into()]).is_empty());
        let mut asked = false;
        memory.answer(uid, |_| asked = true);
        assert!(!asked, "{uid}: its discovery was let go");
        assert_eq!(memory.failed(uid), 1, "{uid}: failures count afresh");
        assert_eq!(memory.lease_free_for(uid, false), Duration::ZERO);
    }

    #[test]
    fn a_finished_run_keeps_only_what_must_not_happen_twice_and_a_deleted_one_nothing() {
        let memory = RunMemory::with_budget(1 << 20);
        remember_everything(&memory, "finished");
        remember_everything(&memory, "deleted");
        remember_everything(&memory, "running");
        memory.finished("finished");
        memory.retain(|uid| uid != "deleted");
        drives_nothing(&memory, "finished");
        assert!(
            !memory.counted("finished", |c| c.is_empty()),
            "its counts stay"
        );
        assert!(!memory.first_end("finished") && !memory.first_tamper("finished"));
        assert!(!memory.remembers("deleted"));
        assert!(memory.counted("deleted", |c| c.is_empty()));
        assert!(memory.first_end("deleted") && memory.first_tamper("deleted"));
        assert_eq!(memory.logs_held(), 1);
        assert_eq!(memory.bytes(), 10);
        // Leadership lost: nothing drives any run; the counts stay.
        memory.clear();
        drives_nothing(&memory, "running");
        assert!(memory.bytes() == 0 && memory.logs_held() == 0);
        assert!(!memory.counted("running", |c| c.is_empty()));
    }

    #[test]
    fn failures_and_credentials_are_remembered_per_run() {
        let memory = RunMemory::default();
        assert_eq!((memory.failed("u"), memory.failed("u")), (1, 2));
        memory.succeeded("u");
        assert_eq!(memory.failed("u"), 1);
        assert!(!memory.has_credential("u"));
        memory.set_credential("u", true);
        assert!(memory.has_credential("u"));
        memory.set_credential("u", false);
        assert!(!memory.has_credential("u"));
        // Nothing is created by clearing what was never there.
        memory.set_credential("v", false);
        memory.succeeded("v");
        assert!(!memory.remembers("v"));
        assert_eq!(memory.lease_free_for("u", false), Duration::ZERO);
        assert!(memory.first_tamper("u") && !memory.first_tamper("u"));
    }
}
