//! A run's log as the reconciler holds it between reconciles: the replayed
//! state up to a verified head, the hashes a checkpoint may name, and the
//! estimated bytes of what it holds (the memory's budget counts them).

use std::collections::BTreeMap;

use crate::replay::{Entry, RunState};
use crate::store::{Hash, Head, Record};

/// A run's log replayed up to `head`.
pub struct Replayed {
    pub state: RunState,
    pub head: Head,
    /// When the head record was stored (the store's clock), if known.
    pub head_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The head-event generation it was read under (see [`LogCache::current`]).
    pub(super) generation: u64,
    /// Resumed from the run's checkpoint: the records before it are still
    /// to be verified (once, by the first reconcile after the decision it
    /// was read for that does not go straight on to another).
    pub resumed: bool,
    /// Hashes of the records a checkpoint may name (see [`RunState::pinned_before`]).
    hashes: BTreeMap<u64, Hash>,
    /// The hash each record that may start a window chains from.
    links: BTreeMap<u64, Hash>,
    /// Estimated bytes of each record the state still holds.
    pub(super) sizes: BTreeMap<u64, usize>,
    /// Estimated bytes of the records read and let go since it was read
    /// (from the start or from a checkpoint).
    released: usize,
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
            released: 0,
        }
    }

    /// A log resumed at its checkpoint: read on from there, and verified
    /// whole once (`resumed`).
    /// (`state` up to `head`, with the `pinned` records it names.)
    pub fn resumed(state: RunState, head: Head, pinned: &[Record]) -> Replayed {
        let mut replayed = Replayed::at(state, head);
        replayed.resumed = true;
        replayed.hashes = pinned.iter().map(|r| (r.seq, r.hash)).collect();
        replayed.sizes = pinned.iter().map(|r| (r.seq, record_bytes(r))).collect();
        replayed.links.insert(head.len, head.hash);
        replayed
    }

    /// Folds in the next record (decoded as `step`), remembering the hashes
    /// a checkpoint may name.
    pub fn apply(&mut self, record: &Record, step: Entry) {
        self.sizes.insert(record.seq, record_bytes(record));
        match &step {
            Entry::RunStarted(_) | Entry::VersionChanged(_) | Entry::Summary(_) => {
                self.hashes.insert(record.seq, record.hash);
            }
            Entry::ModelCall(m) => {
                if m.response.text.as_ref().is_some_and(|t| !t.is_empty()) {
                    self.hashes.insert(record.seq, record.hash);
                }
                self.links.insert(record.seq, record.prev_hash);
            }
            Entry::ToolIntent(_) => {
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
        let mut released = 0;
        self.sizes.retain(|seq, size| {
            let keep = *seq >= base || pinned.contains(seq);
            released += if keep { 0 } else { *size };
            keep
        });
        self.released += released;
    }

    /// Estimated bytes of the records read and let go since it was read
    /// from the start or from its checkpoint.
    pub fn released(&self) -> usize {
        self.released
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
pub fn record_bytes(record: &Record) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

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
