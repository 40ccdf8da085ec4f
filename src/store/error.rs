//! Typed store errors. Nothing is ever half-written: every error leaves the
//! log as it was (an append either inserted its one row or nothing).

use chrono::{DateTime, Utc};

use super::record::{Hash, Record};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or the connection broke (the outcome of
    /// an in-flight append is then unknown: retrying the same record is safe,
    /// first-writer-wins makes it succeed exactly once). Retryable.
    #[error("step store {url} is unavailable: {reason}")]
    Unavailable { url: String, reason: String },

    /// Another record is already recorded at this seq. The loser adopts `recorded`.
    #[error("conflict appending run {run} seq {seq}: a different record (hash {}) is already recorded", .recorded.hash)]
    Conflict {
        run: String,
        seq: u64,
        recorded: Box<Record>,
    },

    /// The append (or renew) carried an epoch that is not the run's current
    /// lease, or the lease expired: this worker was fenced off.
    #[error("stale lease epoch {epoch} for run {run} (current epoch: {}, lease {})", current.map(|e| e.to_string()).unwrap_or_else(|| "none".into()), if *.expired { "expired" } else { "live" })]
    StaleEpoch {
        run: String,
        epoch: u64,
        current: Option<u64>,
        expired: bool,
    },

    /// The run's lease is held by another holder until `expires_at`.
    #[error("run {run} is leased by {holder} (epoch {epoch}) until {expires_at}")]
    LeaseHeld {
        run: String,
        holder: String,
        epoch: u64,
        expires_at: DateTime<Utc>,
    },

    /// Seq is not the current length of the log (appends have no gaps).
    #[error("gap appending run {run}: seq {seq} but the log has length {len}")]
    Gap { run: String, seq: u64, len: u64 },

    /// The record's prev_hash is not the hash of seq - 1.
    #[error(
        "prev_hash mismatch appending run {run} seq {seq}: record links to {got}, the log has {expected}"
    )]
    PrevHashMismatch {
        run: String,
        seq: u64,
        expected: Hash,
        got: Hash,
    },

    /// The hash chain is broken: the first bad seq is named.
    #[error("hash chain of run {run} broken at seq {seq}: {reason}")]
    ChainBroken {
        run: String,
        seq: u64,
        reason: String,
    },

    /// A stored row could not be decoded (reading; `verify` reports it as ChainBroken).
    #[error("run {run} seq {seq} is unreadable: {reason}")]
    Corrupt {
        run: String,
        seq: u64,
        reason: String,
    },

    /// The record given to append is malformed (wrong hash, unsafe number, ...).
    #[error("invalid record: {reason}")]
    InvalidRecord { reason: String },

    /// The store URL is not one we can open.
    #[error("invalid step store URL {url}: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// The database refused the operation for lack of privilege (e.g. the
    /// writer role trying to UPDATE a step, or a missing grant).
    #[error("step store {url} refused the operation: {reason}")]
    PermissionDenied { url: String, reason: String },

    /// The schema is missing or could not be migrated.
    #[error("step store {url} schema: {reason}")]
    Schema { url: String, reason: String },

    /// Any other database error.
    #[error("step store {url}: {reason}")]
    Database { url: String, reason: String },
}

impl StoreError {
    /// Whether the same operation may succeed if retried later (with backoff).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. } | StoreError::LeaseHeld { .. }
        )
    }

    /// A stable, low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Conflict { .. } => "conflict",
            StoreError::StaleEpoch { .. } => "stale_epoch",
            StoreError::LeaseHeld { .. } => "lease_held",
            StoreError::Gap { .. } => "gap",
            StoreError::PrevHashMismatch { .. } => "prev_hash_mismatch",
            StoreError::ChainBroken { .. } => "chain_broken",
            StoreError::Corrupt { .. } => "corrupt",
            StoreError::InvalidRecord { .. } => "invalid_record",
            StoreError::InvalidUrl { .. } => "invalid_url",
            StoreError::PermissionDenied { .. } => "permission_denied",
            StoreError::Schema { .. } => "schema",
            StoreError::Database { .. } => "database",
        }
    }

    /// A record that could not be read as one is, to whoever verifies the
    /// log, a break of its chain at that seq (the run is stopped, not the
    /// read retried).
    pub fn corrupt_as_broken(self) -> StoreError {
        match self {
            StoreError::Corrupt { run, seq, reason } => {
                StoreError::ChainBroken { run, seq, reason }
            }
            other => other,
        }
    }

    /// The recorded record of a conflict (the loser adopts it).
    pub fn recorded(&self) -> Option<&Record> {
        match self {
            StoreError::Conflict { recorded, .. } => Some(recorded),
            _ => None,
        }
    }

    /// Map a driver error, keeping the (password-elided) URL.
    pub(crate) fn from_sqlx(url: &str, e: sqlx::Error) -> StoreError {
        let url = url.to_string();
        match &e {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_)
            | sqlx::Error::BeginFailed => StoreError::Unavailable {
                url,
                reason: e.to_string(),
            },
            sqlx::Error::Database(db) => {
                let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
                let reason = match &code {
                    c if !c.is_empty() => format!("{} (SQLSTATE/code {c})", db.message()),
                    _ => db.message().to_string(),
                };
                if is_retryable_code(&code) {
                    StoreError::Unavailable { url, reason }
                } else if code == "42501" || code == "28000" || code == "28P01" {
                    StoreError::PermissionDenied { url, reason }
                } else if code == "42P01" || reason.contains("no such table") {
                    StoreError::Schema {
                        url,
                        reason: format!("{reason}; run `agentrun store migrate`"),
                    }
                } else {
                    StoreError::Database { url, reason }
                }
            }
            sqlx::Error::Migrate(m) => StoreError::Schema {
                url,
                reason: m.to_string(),
            },
            _ => StoreError::Database {
                url,
                reason: e.to_string(),
            },
        }
    }
}

/// PostgreSQL SQLSTATEs (and SQLite result codes) worth retrying.
fn is_retryable_code(code: &str) -> bool {
    // Class 08: connection exception; 57P01..57P05: shutdown / cannot connect now;
    // 40001 serialization failure; 40P01 deadlock; 53xxx insufficient resources.
    code.starts_with("08")
        || code.starts_with("57P")
        || code.starts_with("53")
        || code == "40001"
        || code == "40P01"
        // SQLite: SQLITE_BUSY (5), SQLITE_LOCKED (6) and their extended codes.
        // (SQLSTATEs are always 5 characters; SQLite codes are shorter numbers.)
        || (code.len() < 5 && code.parse::<u32>().is_ok_and(|c| c & 0xff == 5 || c & 0xff == 6))
}

/// Controller public keys that cannot be used to verify signatures.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("controller public key: {0}")]
    Hex(#[from] hex::FromHexError),
    #[error("controller public key: {0} bytes, an Ed25519 key has 32")]
    Length(usize),
    #[error("no controller public key")]
    NoKey,
}
