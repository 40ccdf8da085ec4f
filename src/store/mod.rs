//! The step log (DESIGN.md section 3): an external, append-only, hash-chained
//! log of every step of a run, with first-writer-wins appends and fenced run
//! leases.
//!
//! Backends, selected by URL ([`open`]):
//! - `postgres://…` / `postgresql://…`: [`PgStore`] (production). The schema
//!   and roles are created by [`StepStore::migrate`] (`agentrun store migrate`).
//! - `sqlite://path`, `sqlite:path`, `file://path`: [`SqliteStore`], embedded,
//!   WAL mode, safe for several local processes; migrated on open.
//! - `http://…` / `https://…`: [`RemoteStore`], the controller's step-log
//!   gateway, which step pods use with a token bound to their run
//!   ([`STORE_TOKEN_ENV`]); they hold no database credential.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agentrun::store::StoreError> {
//! use agentrun::store::{self, RecordDraft, StepKind};
//! let store = store::open("sqlite:///tmp/agentrun.db").await?;
//! let lease = store.acquire("run-uid", "pod-a", std::time::Duration::from_secs(30)).await?;
//! let head = store.head("run-uid").await?;
//! let record = RecordDraft::new(StepKind::RunStarted, serde_json::json!({"agent": {}})).seal(&head)?;
//! match store.append("run-uid", lease.epoch, &record).await {
//!     Ok(stored) => assert_eq!(stored.hash, record.hash),
//!     // Someone else recorded this seq first: adopt their record.
//!     Err(store::StoreError::Conflict { recorded, .. }) => drop(recorded),
//!     Err(e) => return Err(e),
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub mod admin;
mod append;
pub mod audit;
mod chain;
mod error;
mod pages;
mod postgres;
mod record;
mod remote;
mod signature;
mod sqlite;

pub use chain::{
    check_anchor, check_anchor_after, verify_chain, verify_extension, verify_stored,
    verify_stored_extension,
};
pub use error::{KeyError, StoreError};
pub use pages::{PAGE_HELD, PageTicket, Pages, ReadBudget};
pub use postgres::PgStore;
pub use record::{
    AnchorError, FORMAT, FORMAT_1, FORMAT_2, Hash, Head, MAX_SAFE_INTEGER, ParseHashError, Record,
    RecordDraft, StepKind, StoredRecord, UnreadableRecord, Usage, Versions, Worker, canonical_json,
    chain_hash, sha256_hex,
};
pub use remote::{
    AcquireBody, AppendBody, RemoteStore, RenewBody, STORE_TOKEN_ENV, STORED_FORM, WireError,
};
pub use signature::{
    KeyWindows, PublicKey, RecordSigner, RecordVerifier, SIGNATURE_FIELD, SignatureCheck,
    SignatureRules, controller_only, key_id,
};
pub use sqlite::SqliteStore;
#[cfg(test)]
pub(crate) use sqlite::testing;

/// Environment variable holding the store URL (`--store-url` overrides it).
/// The bytes of stored bodies one page of a log comes to at most (unless
/// its first record alone is larger): what every reader of whole logs asks
/// for at a time.
pub const PAGE_BYTES: usize = 4 << 20;

/// The records one page holds at most, whatever their sizes (a page query
/// looks at no more rows than this).
pub const PAGE_RECORDS: u64 = 5_000;

pub const STORE_URL_ENV: &str = "AGENTRUN_STORE_URL";

/// PostgreSQL role with INSERT + SELECT on the step table (and the lease table).
pub const WRITER_ROLE: &str = "agentrun_writer";
/// PostgreSQL role allowed (by the append-only trigger) to delete steps.
pub const RETENTION_ROLE: &str = "agentrun_retention";

/// A run lease: whoever holds the current epoch may append. Epochs only grow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub run: String,
    pub holder: String,
    pub epoch: u64,
    /// Store-clock expiry (PostgreSQL server time; local time for SQLite).
    pub expires_at: DateTime<Utc>,
    /// The controller asked the holder to stop at its next step boundary
    /// (the Agent of a FollowLatest run changed), as of the last renewal.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yield_requested: bool,
}

/// A run's lease as read by [`StepStore::lease`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    pub holder: String,
    pub epoch: u64,
    pub expires_at: DateTime<Utc>,
    /// Expired by the store's own clock (released leases count as expired).
    pub expired: bool,
    /// Given up by its holder (not merely lapsed): the worker is done with
    /// the run, so the next one may start at once.
    pub released: bool,
}

/// What [`StepStore::head_events`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadEvent {
    /// The run's log grew, or its lease was released.
    Changed(String),
    /// Events may have been missed (the listening connection was lost and
    /// is back): whatever was known of any head may be stale.
    Resync,
}

/// The step log contract (DESIGN.md section 3). Held as `Arc<dyn StepStore>`.
///
/// Every method is atomic: on error nothing was written.
#[async_trait]
pub trait StepStore: Send + Sync + fmt::Debug {
    /// `"postgres"` or `"sqlite"` (for metrics and logs).
    fn backend(&self) -> &'static str;

    /// The store URL with any password elided.
    fn url(&self) -> &str;

    /// Create or upgrade the schema (and, on PostgreSQL, the roles). Idempotent.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Append `record` (seq `record.seq`) to `run`, carrying the lease `epoch`.
    ///
    /// First-writer-wins: if that seq is already recorded, returns the
    /// recorded record when it is byte-identical (an identical retry
    /// succeeds) and [`StoreError::Conflict`] carrying the recorded record
    /// otherwise. A stale or expired epoch gives [`StoreError::StaleEpoch`];
    /// `seq` must be the log's length ([`StoreError::Gap`]) and `prev_hash`
    /// the hash of seq - 1 ([`StoreError::PrevHashMismatch`]); the record's
    /// own hash must be right ([`StoreError::InvalidRecord`]). Returns the
    /// stored record (with `created_at`).
    async fn append(&self, run: &str, epoch: u64, record: &Record) -> Result<Record, StoreError>;

    /// Records with `from <= seq < to` (`to = None`: to the end), in seq
    /// order, as stored: their bodies byte for byte, unchecked. What is
    /// handed on to readers who verify for themselves (the log API, a step
    /// pod through the gateway).
    async fn read_stored(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
    ) -> Result<Vec<StoredRecord>, StoreError>;

    /// The first records of [`StepStore::read_stored`]`(run, from, to)`
    /// whose bodies come to at most `max_bytes` (the first one whatever its
    /// size): one page of a log read by bytes, so that no reader holds more
    /// of a log than it asked for, however large its records are. An empty
    /// page is the end.
    async fn read_stored_page(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
        max_bytes: usize,
    ) -> Result<Vec<StoredRecord>, StoreError>;

    /// Records with `from <= seq < to` (`to = None`: to the end), in seq
    /// order, decoded. A stored body that does not decode, or is not exactly
    /// the canonical form of the record it decodes to, is
    /// [`StoreError::Corrupt`] at its seq. Hashes are not checked here
    /// (see [`StepStore::read_verified`]).
    async fn read_range(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
    ) -> Result<Vec<Record>, StoreError> {
        let stored = self.read_stored(run, from, to).await?;
        stored.iter().map(|s| decode_stored(run, s)).collect()
    }

    /// The whole log of `run` (empty if the run has none).
    async fn read_all(&self, run: &str) -> Result<Vec<Record>, StoreError> {
        self.read_range(run, 0, None).await
    }

    /// Length and head hash of the log ([`Head::EMPTY`] for none).
    async fn head(&self, run: &str) -> Result<Head, StoreError>;

    /// The kind of the log's last record (`None` for an empty log): whether
    /// a run is finished, in one read.
    async fn last_kind(&self, run: &str) -> Result<Option<StepKind>, StoreError> {
        let head = self.head(run).await?;
        if head.len == 0 {
            return Ok(None);
        }
        let last = self.read_range(run, head.len - 1, None).await?;
        Ok(last.last().map(|r| r.kind))
    }

    /// Take the run's lease for `ttl`: succeeds when there is none, it
    /// expired, or `holder` already holds it; always returns a new, higher
    /// epoch (so a previous incarnation of the same holder is fenced too).
    /// Otherwise [`StoreError::LeaseHeld`].
    async fn acquire(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError>;

    /// Take the run's lease for `holder` whoever holds it, with a new,
    /// higher epoch: the holder is fenced at once (its next append or
    /// renewal is refused) instead of when its lease would lapse. Only the
    /// controller does this, to end a run or replace a worker it has
    /// stopped; the step-log gateway offers no way to it.
    async fn take_over(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        let _ = (holder, ttl);
        Err(StoreError::Database {
            url: self.url().to_string(),
            reason: format!("taking over the lease of run {run}: not offered by this store"),
        })
    }

    /// Extend the lease to now + `ttl` (same epoch). A lease that lapsed
    /// without anyone taking it over is still this holder's (fencing is by
    /// epoch: only a new `acquire` moves it), so a heartbeat that comes late
    /// under load revives it; a lease taken over gives
    /// [`StoreError::StaleEpoch`].
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Lease, StoreError>;

    /// The run's lease as it stands, read without writing (how the
    /// controller judges a worker). `None` when the run was never leased.
    async fn lease(&self, run: &str) -> Result<Option<LeaseState>, StoreError>;

    /// Ask whoever holds the run's lease to stop at its next step boundary
    /// (it learns when it next renews); a new holder starts without the ask.
    async fn request_yield(&self, run: &str) -> Result<(), StoreError>;

    /// Give the lease up (it expires now; the epoch is kept, so the next
    /// holder gets a higher one). Releasing a lease that is no longer current
    /// does nothing.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError>;

    /// The whole log of `run`, verified while it is read (what replay
    /// uses): every stored record hashes to its stored hash, sits at its seq
    /// and links to its predecessor; with `expected_head` (the run's recorded
    /// head hash) the log must end exactly there. Otherwise
    /// [`StoreError::ChainBroken`] naming the first bad seq.
    async fn read_verified(
        &self,
        run: &str,
        expected_head: Option<&Hash>,
    ) -> Result<Vec<Record>, StoreError> {
        paged_chain(self, run, Head::EMPTY)
            .await?
            .finish(expected_head)
    }

    /// The records of `run` after `base` (a head already verified),
    /// verified as its continuation, from their stored bytes
    /// ([`verify_stored`]): what an incremental replay reads.
    async fn read_verified_after(&self, run: &str, base: &Head) -> Result<Vec<Record>, StoreError> {
        paged_chain(self, run, *base).await?.finish(None)
    }

    /// Runs whose lease lapsed (expired without being released) after
    /// `since` and up to the store's now, with that now: one query, however
    /// many runs there are, so a hung worker is noticed without looking at
    /// each run.
    async fn lapsed_leases(
        &self,
        since: DateTime<Utc>,
    ) -> Result<(Vec<String>, DateTime<Utc>), StoreError>;

    /// A stream of changed heads, where the backend can push them
    /// (PostgreSQL `LISTEN/NOTIFY`); `None` where it cannot, and the caller
    /// polls.
    async fn head_events(
        &self,
    ) -> Result<Option<tokio::sync::mpsc::Receiver<HeadEvent>>, StoreError> {
        Ok(None)
    }

    /// Recompute the whole chain of `run`; with `expected_head` (the run's
    /// recorded head hash) also check that the log ends exactly there.
    /// Returns the head, or [`StoreError::ChainBroken`] naming the first bad seq.
    async fn verify(&self, run: &str, expected_head: Option<&Hash>) -> Result<Head, StoreError> {
        let records = self.read_verified(run, expected_head).await?;
        Ok(records.last().map(Record::head).unwrap_or(Head::EMPTY))
    }

    /// Close the connections (pending operations finish first).
    async fn close(&self);
}

/// Connection settings for [`open_with`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Pool size (PostgreSQL; SQLite uses it for readers, writes go through one connection).
    pub max_connections: u32,
    /// How long an operation waits for a connection before failing with
    /// [`StoreError::Unavailable`].
    pub acquire_timeout: Duration,
    /// Connect at open (and fail now when unreachable) rather than at first use.
    pub connect_eagerly: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
            connect_eagerly: true,
        }
    }
}

/// Open the store named by `url` with default options.
pub async fn open(url: &str) -> Result<Arc<dyn StepStore>, StoreError> {
    open_with(url, &OpenOptions::default()).await
}

/// Open the store named by `url`: `postgres://` / `postgresql://` (not
/// migrated: run [`StepStore::migrate`] once, with an owner's credentials),
/// or `sqlite://path`, `sqlite:path`, `file://path` (migrated on open).
pub async fn open_with(url: &str, opts: &OpenOptions) -> Result<Arc<dyn StepStore>, StoreError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => Ok(Arc::new(PgStore::connect(url, opts).await?)),
        Some("sqlite" | "file") => Ok(Arc::new(SqliteStore::open(url, opts).await?)),
        // The controller's step-log gateway (step pods), token from AGENTRUN_STORE_TOKEN.
        Some("http" | "https") => Ok(Arc::new(RemoteStore::from_env(
            url,
            opts.acquire_timeout + Duration::from_secs(20),
        )?)),
        _ => Err(StoreError::InvalidUrl {
            url: redact_url(url),
            reason: "expected postgres://, postgresql://, sqlite://, file:// or http(s):// (the step-log gateway)".into(),
        }),
    }
}

/// The URL with its password (in the userinfo or a `password=` query
/// parameter) replaced by `***`, for errors and logs.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            if u.query_pairs()
                .any(|(k, _)| k.eq_ignore_ascii_case("password"))
            {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if k.eq_ignore_ascii_case("password") {
                            "***".to_string()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        // Unparseable: keep the scheme only, never risk printing a secret.
        Err(_) => match url.split_once("://") {
            Some((scheme, _)) => format!("{scheme}://***"),
            None => "***".to_string(),
        },
    }
}

/// The records of `run` after `base`, read a page at a time and verified
/// as its continuation from their stored bytes.
async fn paged_chain<'a, S: StepStore + ?Sized>(
    store: &S,
    run: &'a str,
    base: Head,
) -> Result<chain::StoredChain<'a>, StoreError> {
    let mut chain = chain::StoredChain::after(run, base);
    let mut from = base.len;
    loop {
        let page = store.read_stored_page(run, from, None, PAGE_BYTES).await?;
        let Some(last) = page.last() else {
            return Ok(chain);
        };
        from = last.seq + 1;
        for s in page {
            chain.push(s.body.as_bytes(), &s.hash.0, s.created_at)?;
        }
    }
}

/// Where a page from `from` ends at the latest: `to`, or [`PAGE_RECORDS`]
/// on (capped at the largest seq a database holds).
pub(crate) fn page_end(from: u64, to: Option<u64>) -> u64 {
    let end = from.saturating_add(PAGE_RECORDS).min(i64::MAX as u64);
    to.map_or(end, |to| to.min(end))
}

pub(crate) fn to_i64(what: &str, v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::InvalidRecord {
        reason: format!("{what} {v} is out of range"),
    })
}

pub(crate) fn ttl_micros(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX / 2)
}

/// A stored record decoded, or [`StoreError::Corrupt`] at its seq: it does
/// not decode, or is not exactly the canonical form of what it decodes to.
fn decode_stored(run: &str, s: &StoredRecord) -> Result<Record, StoreError> {
    s.decode_for(run)
}

impl StoredRecord {
    /// The record of run `run` it stores; one that does not decode, or is
    /// not exactly the canonical form of what it decodes to, is
    /// [`StoreError::Corrupt`] at its seq.
    pub fn decode_for(&self, run: &str) -> Result<Record, StoreError> {
        self.decode().map_err(|e| StoreError::Corrupt {
            run: run.to_string(),
            seq: self.seq,
            reason: e.to_string(),
        })
    }
}

/// Check what the store can check without the database: the record's hash.
pub(crate) fn check_record(record: &Record) -> Result<Vec<u8>, StoreError> {
    if record.format == 0 || record.format > FORMAT {
        return Err(StoreError::InvalidRecord {
            reason: format!(
                "record format {} is not one this code writes",
                record.format
            ),
        });
    }
    let body = record.canonical_bytes();
    let computed = chain_hash(&record.prev_hash, &body);
    if computed != record.hash {
        return Err(StoreError::InvalidRecord {
            reason: format!(
                "record seq {} carries hash {} but hashes to {computed}",
                record.seq, record.hash
            ),
        });
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_redact_url_elides_passwords() {
        assert_eq!(
            redact_url("postgres://writer:s3cret@db.local:5432/agentrun?sslmode=require"),
            "postgres://writer:***@db.local:5432/agentrun?sslmode=require"
        );
        let r = redact_url("postgres://db.local/agentrun?user=w&password=s3cret");
        assert!(!r.contains("s3cret") && r.contains("password=***"), "{r}");
        assert_eq!(redact_url("postgres://db.local/x"), "postgres://db.local/x");
        assert!(!redact_url("postgres://a:s3cret@[bad").contains("s3cret"));
    }

    #[test]
    fn store_error_labels_and_retryability() {
        let e = StoreError::Unavailable {
            url: "postgres://u:***@h/db".into(),
            reason: "connection refused".into(),
        };
        assert!(e.is_retryable());
        assert_eq!(e.metric_label(), "unavailable");
        let e = StoreError::Gap {
            run: "r".into(),
            seq: 3,
            len: 1,
        };
        assert!(!e.is_retryable());
        assert_eq!(e.metric_label(), "gap");
    }

    #[tokio::test]
    async fn store_open_refuses_unknown_scheme() {
        let e = open("mysql://u:pw@h/db").await.unwrap_err();
        assert_eq!(e.metric_label(), "invalid_url");
        assert!(!e.to_string().contains("pw@"), "{e}");
    }
}
