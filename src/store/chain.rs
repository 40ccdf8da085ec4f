//! The hash chain: sealing a record onto a head, and checking that records
//! form an unbroken chain (from the start, past a verified head, up to an
//! anchor recorded earlier). Every store backend and every reader verifies
//! through these.

use super::StoreError;
use chrono::{DateTime, Utc};

use super::record::{Hash, Head, MAX_SAFE_INTEGER, Record, RecordDraft, StoredRecord, chain_hash};

impl Head {
    /// The head of a log whose last record (`seq`, `hash`) was read from a backend row.
    pub(crate) fn from_last(run: &str, seq: i64, hash: &[u8]) -> Result<Head, StoreError> {
        let hash = Hash::from_slice(hash).ok_or_else(|| StoreError::Corrupt {
            run: run.to_string(),
            seq: seq as u64,
            reason: "hash is not 32 bytes".into(),
        })?;
        Ok(Head {
            len: seq as u64 + 1,
            hash,
        })
    }
}

impl RecordDraft {
    /// The record that follows `head`: `seq = head.len`, `prev_hash =
    /// head.hash`, hash computed. Refuses payload integers beyond ±(2^53-1),
    /// which the canonical encoding cannot carry exactly.
    pub fn seal(self, head: &Head) -> Result<Record, StoreError> {
        check_safe_numbers(&self.payload, &mut String::from("payload"))?;
        let mut record = Record {
            format: self.format,
            seq: head.len,
            kind: self.kind,
            payload: self.payload,
            versions: self.versions,
            usage: self.usage,
            worker: self.worker,
            prev_hash: head.hash,
            hash: Hash::ZERO,
            created_at: None,
        };
        record.hash = record.compute_hash();
        Ok(record)
    }
}

fn check_safe_numbers(v: &serde_json::Value, path: &mut String) -> Result<(), StoreError> {
    match v {
        serde_json::Value::Number(n) => {
            let ok = if let Some(u) = n.as_u64() {
                u <= MAX_SAFE_INTEGER
            } else if let Some(i) = n.as_i64() {
                i.unsigned_abs() <= MAX_SAFE_INTEGER
            } else {
                true
            };
            if ok {
                Ok(())
            } else {
                Err(StoreError::InvalidRecord {
                    reason: format!(
                        "{path}: integer {n} is beyond ±(2^53-1) and cannot be encoded canonically; send it as a string"
                    ),
                })
            }
        }
        serde_json::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                check_safe_numbers(item, path)?;
                path.truncate(len);
            }
            Ok(())
        }
        serde_json::Value::Object(map) => {
            for (k, item) in map {
                let len = path.len();
                path.push('.');
                path.push_str(k);
                check_safe_numbers(item, path)?;
                path.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Checks that a verified log (`records`, seq order from 0) extends
/// `anchor`, the head recorded earlier (e.g. in `status.log`): it is at least
/// that long and its record at `anchor.len - 1` carries `anchor.hash`. A log
/// that was truncated or rewritten before the anchor gives
/// [`StoreError::ChainBroken`].
pub fn check_anchor(run: &str, records: &[Record], anchor: &Head) -> Result<(), StoreError> {
    check_anchor_after(run, &Head::EMPTY, records, anchor)
}

/// [`check_anchor`] for `records` read past `base`, a head verified before
/// (an anchor inside the part verified before was checked then).
pub fn check_anchor_after(
    run: &str,
    base: &Head,
    records: &[Record],
    anchor: &Head,
) -> Result<(), StoreError> {
    if anchor.len == 0 || anchor.len < base.len {
        return Ok(());
    }
    if anchor.len == base.len {
        return match anchor.hash == base.hash {
            true => Ok(()),
            false => Err(StoreError::ChainBroken {
                run: run.to_string(),
                seq: base.len.saturating_sub(1),
                reason: format!(
                    "record {} has hash {} but the anchored head is {}: the log was rewritten",
                    base.len.saturating_sub(1),
                    base.hash,
                    anchor.hash
                ),
            }),
        };
    }
    let total = base.len + records.len() as u64;
    let broken = |seq: u64, reason: String| StoreError::ChainBroken {
        run: run.to_string(),
        seq,
        reason,
    };
    let Some(at) = records.get((anchor.len - base.len) as usize - 1) else {
        return Err(broken(
            total,
            format!(
                "the log has {total} records but {} were anchored (head {}): records were removed",
                anchor.len, anchor.hash
            ),
        ));
    };
    if at.hash != anchor.hash {
        return Err(broken(
            at.seq,
            format!(
                "record {} has hash {} but the anchored head is {}: the log was rewritten",
                at.seq, at.hash, anchor.hash
            ),
        ));
    }
    Ok(())
}

/// Check a whole log (records in seq order, starting at 0): every seq in
/// place, every `prev_hash` linking to the previous hash, every hash
/// recomputed. With `expected_head` (the run's recorded head hash), also check
/// that the log ends exactly there. Returns the head, or
/// [`StoreError::ChainBroken`] naming the first bad seq.
pub fn verify_chain(
    run: &str,
    records: &[Record],
    expected_head: Option<&Hash>,
) -> Result<Head, StoreError> {
    let head = verify_extension(run, &Head::EMPTY, records)?;
    check_expected_head(run, records, &head, expected_head)?;
    Ok(head)
}

/// Verifies `records` as the continuation of a log already verified up to
/// `base`: the first sits at `base.len` and links to `base.hash`, each hashes
/// right and links to its predecessor. Returns the new head.
pub fn verify_extension(run: &str, base: &Head, records: &[Record]) -> Result<Head, StoreError> {
    let mut head = *base;
    for (i, r) in records.iter().enumerate() {
        let seq = base.len + i as u64;
        let broken = |reason: String| StoreError::ChainBroken {
            run: run.to_string(),
            seq,
            reason,
        };
        if r.seq != seq {
            return Err(broken(format!(
                "record at position {seq} says seq {}",
                r.seq
            )));
        }
        if r.prev_hash != head.hash {
            return Err(broken(format!(
                "prev_hash {} does not link to the hash of seq {} ({})",
                r.prev_hash,
                seq as i64 - 1,
                head.hash
            )));
        }
        let computed = r.compute_hash();
        if computed != r.hash {
            return Err(broken(format!(
                "stored hash {} but the record hashes to {computed}: the record was altered",
                r.hash
            )));
        }
        head = r.head();
    }
    Ok(head)
}

/// Checks one stored record as the continuation of a log verified up to
/// `head`: it sits at `head.len`, its body decodes to a record of that seq
/// linking to `head.hash` and is exactly that record's canonical form, and
/// the body's bytes hash (after `head.hash`) to the stored hash. Returns
/// the record, or [`StoreError::ChainBroken`] naming its seq.
pub fn verify_stored(run: &str, head: &Head, stored: &StoredRecord) -> Result<Record, StoreError> {
    if stored.seq != head.len {
        return Err(StoreError::ChainBroken {
            run: run.to_string(),
            seq: head.len,
            reason: format!(
                "record at position {} is stored as seq {}",
                head.len, stored.seq
            ),
        });
    }
    check_stored(
        run,
        head,
        stored.body.as_bytes(),
        stored.hash,
        stored.created_at,
    )
}

/// [`verify_stored`] of each of `stored` in turn, from `base`: the head
/// reached, or the first record that does not verify.
pub fn verify_stored_extension(
    run: &str,
    base: &Head,
    stored: &[StoredRecord],
) -> Result<Head, StoreError> {
    let mut head = *base;
    for s in stored {
        head = verify_stored(run, &head, s)?.head();
    }
    Ok(head)
}

/// [`verify_stored`] of a body as read from a backend row.
fn check_stored(
    run: &str,
    head: &Head,
    body: &[u8],
    hash: Hash,
    created_at: Option<DateTime<Utc>>,
) -> Result<Record, StoreError> {
    let seq = head.len;
    let broken = |reason: String| StoreError::ChainBroken {
        run: run.to_string(),
        seq,
        reason,
    };
    let record =
        Record::from_canonical(body, hash, created_at).map_err(|e| broken(e.to_string()))?;
    if record.seq != seq {
        return Err(broken(format!(
            "record at position {seq} says seq {}",
            record.seq
        )));
    }
    if record.prev_hash != head.hash {
        return Err(broken(format!(
            "prev_hash {} does not link to the hash of seq {} ({})",
            record.prev_hash,
            seq as i64 - 1,
            head.hash
        )));
    }
    // The stored bytes, not a re-encoding of what they decode to.
    let computed = chain_hash(&head.hash, body);
    if computed != hash {
        return Err(broken(format!(
            "stored hash {hash} but the record hashes to {computed}: the record was altered"
        )));
    }
    Ok(record)
}

/// Verifies a log row by row as it is read from a store ([`verify_stored`]
/// of each row): the stored bytes are hashed and must be the canonical form
/// of the record they decode to.
pub(crate) struct StoredChain<'a> {
    run: &'a str,
    head: Head,
    records: Vec<Record>,
}

impl<'a> StoredChain<'a> {
    pub(crate) fn new(run: &'a str) -> Self {
        StoredChain::after(run, Head::EMPTY)
    }

    /// A chain whose first record must sit at `base.len` and link to `base.hash`
    /// (a log already verified up to `base`, read on from there).
    pub(crate) fn after(run: &'a str, base: Head) -> Self {
        StoredChain {
            run,
            head: base,
            records: Vec::new(),
        }
    }

    pub(crate) fn push(
        &mut self,
        body: &[u8],
        hash: &[u8],
        created_at: Option<DateTime<Utc>>,
    ) -> Result<(), StoreError> {
        let hash = Hash::from_slice(hash).ok_or_else(|| StoreError::ChainBroken {
            run: self.run.to_string(),
            seq: self.head.len,
            reason: "stored hash is not 32 bytes".into(),
        })?;
        let record = check_stored(self.run, &self.head, body, hash, created_at)?;
        self.head = record.head();
        self.records.push(record);
        Ok(())
    }

    pub(crate) fn finish(self, expected_head: Option<&Hash>) -> Result<Vec<Record>, StoreError> {
        check_expected_head(self.run, &self.records, &self.head, expected_head)?;
        Ok(self.records)
    }
}

pub(crate) fn check_expected_head(
    run: &str,
    records: &[Record],
    head: &Head,
    expected: Option<&Hash>,
) -> Result<(), StoreError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    if *expected == head.hash {
        return Ok(());
    }
    if expected.is_zero() {
        return Err(StoreError::ChainBroken {
            run: run.to_string(),
            seq: 0,
            reason: "the recorded head is the empty log but the log has records".into(),
        });
    }
    // Where does the recorded head appear, if at all?
    match records.iter().position(|r| r.hash == *expected) {
        Some(pos) => Err(StoreError::ChainBroken {
            run: run.to_string(),
            seq: pos as u64 + 1,
            reason: format!(
                "the recorded head {expected} is seq {pos}, but the log continues to seq {}",
                head.len - 1
            ),
        }),
        None => Err(StoreError::ChainBroken {
            run: run.to_string(),
            seq: head.len,
            reason: format!(
                "the log ends at {} (length {}) and never reaches the recorded head {expected}: records are missing",
                head.hash, head.len
            ),
        }),
    }
}
