//! What every backend's append decides the same way, whatever its SQL: how a
//! stored row reads back, when a retry is adopted, and the errors that
//! explain a refusal. One place, so the backends cannot drift apart in what
//! a writer is told.

use chrono::{DateTime, Utc};

use super::StoreError;
use super::record::{Hash, Record, StoredRecord};

/// A stored row read back as a record; a row that does not decode is
/// corruption of the log, reported with the run and seq it sits at.
pub(crate) fn decode_stored(
    run: &str,
    seq: u64,
    body: &str,
    hash: &[u8],
    created_at: DateTime<Utc>,
) -> Result<Record, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        run: run.to_string(),
        seq,
        reason,
    };
    let hash = Hash::from_slice(hash).ok_or_else(|| corrupt("hash is not 32 bytes".into()))?;
    Record::from_canonical(body.as_bytes(), hash, Some(created_at))
        .map_err(|e| corrupt(e.to_string()))
}

/// A stored row as it is handed on (unchecked but for its hash's length,
/// which no reader could compare).
pub(crate) fn stored_row(
    run: &str,
    seq: u64,
    body: String,
    hash: &[u8],
    created_at: DateTime<Utc>,
) -> Result<StoredRecord, StoreError> {
    let hash = Hash::from_slice(hash).ok_or_else(|| StoreError::Corrupt {
        run: run.to_string(),
        seq,
        reason: "hash is not 32 bytes".into(),
    })?;
    Ok(StoredRecord {
        seq,
        body,
        hash,
        created_at: Some(created_at),
    })
}

/// Decide between "identical retry" and "conflict" for a recorded seq.
pub(crate) fn adopt_or_conflict(
    run: &str,
    record: &Record,
    body: &[u8],
    recorded: Record,
    recorded_body: &[u8],
) -> Result<Record, StoreError> {
    if recorded.hash == record.hash && recorded_body == body {
        Ok(recorded)
    } else {
        Err(StoreError::Conflict {
            run: run.to_string(),
            seq: record.seq,
            recorded: Box::new(recorded),
        })
    }
}

/// The record as stored: the writer's record with the store's timestamp.
pub(crate) fn stored_at(record: &Record, at: DateTime<Utc>) -> Record {
    let mut stored = record.clone();
    stored.created_at = Some(at);
    stored
}

/// The writer's epoch is not (or no longer) the run's lease: `current` is the
/// lease's epoch if there is one, `expired` whether the writer's own lease
/// merely lapsed (it may acquire again) rather than was taken over.
pub(crate) fn stale_epoch(
    run: &str,
    epoch: u64,
    current: Option<i64>,
    expired: bool,
) -> StoreError {
    StoreError::StaleEpoch {
        run: run.to_string(),
        epoch,
        current: current.map(|e| e as u64),
        expired,
    }
}

/// The record would leave a hole: the log is only `len` records long.
pub(crate) fn gap(run: &str, record: &Record, len: u64) -> StoreError {
    StoreError::Gap {
        run: run.to_string(),
        seq: record.seq,
        len,
    }
}

/// The record must name the hash of the record before it (`expected`, zero
/// for the first): otherwise it was written against another history.
pub(crate) fn check_prev_hash(
    run: &str,
    record: &Record,
    expected: Hash,
) -> Result<(), StoreError> {
    if expected == record.prev_hash {
        return Ok(());
    }
    Err(StoreError::PrevHashMismatch {
        run: run.to_string(),
        seq: record.seq,
        expected,
        got: record.prev_hash,
    })
}
