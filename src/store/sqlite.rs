//! Embedded backend: one SQLite file in WAL mode, safe for several local
//! processes. Writes run in `BEGIN IMMEDIATE` transactions (the database's
//! write lock, waited for up to the busy timeout) through one writer
//! connection per process; reads use a pool. Same semantics as PostgreSQL;
//! times are the local clock.

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::Row;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::append::{
    adopt_or_conflict, check_prev_hash, decode_stored, gap, stale_epoch, stored_at, stored_row,
};
use super::chain::StoredChain;
use super::record::{Hash, Head, Record, StepKind, StoredRecord};
use super::{
    Lease, LeaseState, OpenOptions, StepStore, StoreError, check_record, redact_url, to_i64,
    ttl_micros,
};

/// A write transaction on the writer connection.
type WriteTx<'c> = sqlx::Transaction<'c, sqlx::Sqlite>;

const MIGRATIONS_TABLE: &str = "agentrun_store_migrations";
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

fn migrator() -> Migrator {
    let mut m = Migrator::with_migrations(vec![
        Migration::new(
            1,
            "step log".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!("migrations/sqlite/0001_step_log.sql")),
            false,
        ),
        Migration::new(
            2,
            "released leases".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!("migrations/sqlite/0002_released.sql")),
            false,
        ),
        Migration::new(
            3,
            "yield requests".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!("migrations/sqlite/0003_yield.sql")),
            false,
        ),
    ]);
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

/// The file path of a `sqlite://path`, `sqlite:path`, `file://path` or `file:path` URL.
pub(crate) fn sqlite_path(url: &str) -> Result<PathBuf, StoreError> {
    let rest = ["sqlite://", "sqlite:", "file://", "file:"]
        .iter()
        .find_map(|p| {
            url.get(..p.len())
                .filter(|s| s.eq_ignore_ascii_case(p))
                .map(|_| &url[p.len()..])
        })
        .ok_or_else(|| StoreError::InvalidUrl {
            url: redact_url(url),
            reason: "expected sqlite://path or file://path".into(),
        })?;
    let path = rest.split(['?', '#']).next().unwrap_or("");
    if path.is_empty() {
        return Err(StoreError::InvalidUrl {
            url: redact_url(url),
            reason: "no file path".into(),
        });
    }
    Ok(PathBuf::from(path))
}

fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

/// The embedded (SQLite) step store.
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    url: String,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("url", &self.url)
            .finish()
    }
}

impl SqliteStore {
    /// Open (creating the file if missing) and migrate.
    pub async fn open(url: &str, opts: &OpenOptions) -> Result<SqliteStore, StoreError> {
        let path = sqlite_path(url)?;
        let redacted = redact_url(url);
        let connect = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(false);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(opts.acquire_timeout.max(BUSY_TIMEOUT))
            .connect_lazy_with(connect.clone());
        let reader = SqlitePoolOptions::new()
            .max_connections(opts.max_connections.clamp(1, 8))
            .acquire_timeout(opts.acquire_timeout)
            .connect_lazy_with(connect);
        let store = SqliteStore {
            writer,
            reader,
            url: redacted,
        };
        store.migrate().await?;
        Ok(store)
    }

    /// A write transaction that takes SQLite's write lock at once, so
    /// concurrent writers queue (busy timeout) instead of failing mid-way.
    async fn begin_write(&self) -> Result<WriteTx<'_>, StoreError> {
        self.writer
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| self.err(e))
    }

    /// The writer must hold the run's lease at `epoch`, unexpired at `now`.
    async fn check_lease(
        &self,
        tx: &mut WriteTx<'_>,
        run: &str,
        epoch: u64,
        now: i64,
    ) -> Result<(), StoreError> {
        let epoch_i = to_i64("epoch", epoch)?;
        let lease = sqlx::query("SELECT epoch, expires_at FROM agentrun_leases WHERE run = ?1")
            .bind(run)
            .fetch_optional(&mut **tx)
            .await
            .map_err(|e| self.err(e))?;
        let (current, expires): (Option<i64>, i64) = match &lease {
            Some(row) => (
                Some(row.try_get(0).map_err(|e| self.err(e))?),
                row.try_get(1).map_err(|e| self.err(e))?,
            ),
            None => (None, 0),
        };
        if current != Some(epoch_i) || expires <= now {
            return Err(stale_epoch(run, epoch, current, current == Some(epoch_i)));
        }
        Ok(())
    }

    /// The record already at `seq`, with its body as stored (a retry is
    /// adopted only if it is byte for byte the same).
    async fn recorded(
        &self,
        tx: &mut WriteTx<'_>,
        run: &str,
        seq: u64,
    ) -> Result<Option<(Record, String)>, StoreError> {
        let seq_i = to_i64("seq", seq)?;
        let existing = sqlx::query(
            "SELECT body, hash, created_at FROM agentrun_steps WHERE run = ?1 AND seq = ?2",
        )
        .bind(run)
        .bind(seq_i)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| self.err(e))?;
        let Some(row) = existing else {
            return Ok(None);
        };
        let rec_body: String = row.try_get(0).map_err(|e| self.err(e))?;
        let rec_hash: Vec<u8> = row.try_get(1).map_err(|e| self.err(e))?;
        let at: i64 = row.try_get(2).map_err(|e| self.err(e))?;
        let recorded = decode_row(run, seq_i, &rec_body, &rec_hash, at)?;
        Ok(Some((recorded, rec_body)))
    }

    /// The run's head as the write transaction sees it.
    async fn head_in(&self, tx: &mut WriteTx<'_>, run: &str) -> Result<Head, StoreError> {
        let last = sqlx::query(
            "SELECT seq, hash FROM agentrun_steps WHERE run = ?1 ORDER BY seq DESC LIMIT 1",
        )
        .bind(run)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| self.err(e))?;
        Ok(match last {
            Some(row) => {
                let s: i64 = row.try_get(0).map_err(|e| self.err(e))?;
                let h: Vec<u8> = row.try_get(1).map_err(|e| self.err(e))?;
                Head {
                    len: s as u64 + 1,
                    hash: Hash::from_slice(&h).unwrap_or(Hash::ZERO),
                }
            }
            None => Head::EMPTY,
        })
    }

    /// Insert the checked record, stamped with `now`.
    async fn insert(
        &self,
        tx: &mut WriteTx<'_>,
        run: &str,
        epoch: u64,
        record: &Record,
        body: &[u8],
        now: i64,
    ) -> Result<(), StoreError> {
        let body_str = std::str::from_utf8(body).expect("canonical JSON is UTF-8");
        sqlx::query(
            "INSERT INTO agentrun_steps (run, seq, format, kind, prev_hash, hash, body, epoch, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )
        .bind(run)
        .bind(to_i64("seq", record.seq)?)
        .bind(record.format as i64)
        .bind(record.kind.as_str())
        .bind(&record.prev_hash.0[..])
        .bind(&record.hash.0[..])
        .bind(body_str)
        .bind(to_i64("epoch", epoch)?)
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::from_sqlx(&self.url, e)
    }

    /// The records a query of `(seq, body, hash, created_at)` rows finds, as stored.
    async fn stored(
        &self,
        run: &str,
        query: sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let mut rows = query.fetch(&self.reader);
        let mut out = Vec::new();
        while let Some(row) = rows.try_next().await.map_err(|e| self.err(e))? {
            let seq: i64 = row.try_get(0).map_err(|e| self.err(e))?;
            let body: String = row.try_get(1).map_err(|e| self.err(e))?;
            let hash: &[u8] = row.try_get(2).map_err(|e| self.err(e))?;
            let at: i64 = row.try_get(3).map_err(|e| self.err(e))?;
            out.push(stored_row(run, seq as u64, body, hash, from_micros(at))?);
        }
        Ok(out)
    }

    /// The writer pool (one connection; for administration and tests).
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
    }
}

fn decode_row(
    run: &str,
    seq: i64,
    body: &str,
    hash: &[u8],
    created_at: i64,
) -> Result<Record, StoreError> {
    decode_stored(run, seq as u64, body, hash, from_micros(created_at))
}

impl SqliteStore {
    /// Takes the lease: when free, lapsed or `holder`'s own, or whoever
    /// holds it with `take_over`.
    async fn lease_for(
        &self,
        run: &str,
        holder: &str,
        ttl: Duration,
        take_over: bool,
    ) -> Result<Lease, StoreError> {
        let mut tx = self.begin_write().await?;
        let now = micros(Utc::now());
        let expires = now.saturating_add(ttl_micros(ttl));
        let cur =
            sqlx::query("SELECT holder, epoch, expires_at FROM agentrun_leases WHERE run = ?1")
                .bind(run)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
        let epoch = match cur {
            None => {
                sqlx::query(
                    "INSERT INTO agentrun_leases (run, holder, epoch, expires_at, acquired_at, renewed_at, released) \
                     VALUES (?1, ?2, 1, ?3, ?4, ?4, 0)",
                )
                .bind(run)
                .bind(holder)
                .bind(expires)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
                1
            }
            Some(row) => {
                let cur_holder: String = row.try_get(0).map_err(|e| self.err(e))?;
                let cur_epoch: i64 = row.try_get(1).map_err(|e| self.err(e))?;
                let cur_expires: i64 = row.try_get(2).map_err(|e| self.err(e))?;
                if !take_over && cur_expires > now && cur_holder != holder {
                    return Err(StoreError::LeaseHeld {
                        run: run.to_string(),
                        holder: cur_holder,
                        epoch: cur_epoch as u64,
                        expires_at: from_micros(cur_expires),
                    });
                }
                sqlx::query(
                    "UPDATE agentrun_leases SET holder = ?2, epoch = ?3, expires_at = ?4, \
                     acquired_at = ?5, renewed_at = ?5, released = 0, yield_requested = 0 WHERE run = ?1",
                )
                .bind(run)
                .bind(holder)
                .bind(cur_epoch + 1)
                .bind(expires)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
                cur_epoch + 1
            }
        };
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(Lease {
            run: run.to_string(),
            holder: holder.to_string(),
            epoch: epoch as u64,
            expires_at: from_micros(expires),
            yield_requested: false,
        })
    }
}

#[async_trait]
impl StepStore for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn url(&self) -> &str {
        &self.url
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        // Several processes may open a new file at once; SQLite has no
        // advisory lock for the migrator, so a loser simply tries again and
        // then finds the migration applied.
        let mut last = None;
        for attempt in 0..10u64 {
            match migrator().run(&self.writer).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(20 * (attempt + 1))).await;
                }
            }
        }
        let e = last.expect("at least one attempt");
        Err(match e {
            sqlx::migrate::MigrateError::Execute(inner) => self.err(inner),
            other => StoreError::Schema {
                url: self.url.clone(),
                reason: other.to_string(),
            },
        })
    }

    async fn append(&self, run: &str, epoch: u64, record: &Record) -> Result<Record, StoreError> {
        let body = check_record(record)?;
        // Out-of-range numbers are refused before the write lock is taken.
        to_i64("seq", record.seq)?;
        to_i64("epoch", epoch)?;
        let mut tx = self.begin_write().await?;
        let now = micros(Utc::now());
        // All checks and the insert share one write transaction, so no other
        // writer can slip in between them.
        self.check_lease(&mut tx, run, epoch, now).await?;
        if let Some((recorded, recorded_body)) = self.recorded(&mut tx, run, record.seq).await? {
            return adopt_or_conflict(run, record, &body, recorded, recorded_body.as_bytes());
        }
        let head = self.head_in(&mut tx, run).await?;
        if head.len != record.seq {
            return Err(gap(run, record, head.len));
        }
        check_prev_hash(run, record, head.hash)?;
        self.insert(&mut tx, run, epoch, record, &body, now).await?;
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(stored_at(record, from_micros(now)))
    }

    async fn read_stored(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let from_i = to_i64("seq", from)?;
        let to_i = match to {
            Some(t) => to_i64("seq", t)?,
            None => i64::MAX,
        };
        let query = sqlx::query(
            "SELECT seq, body, hash, created_at FROM agentrun_steps \
             WHERE run = ?1 AND seq >= ?2 AND seq < ?3 ORDER BY seq",
        )
        .bind(run)
        .bind(from_i)
        .bind(to_i);
        self.stored(run, query).await
    }

    async fn read_stored_page(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
        max_bytes: usize,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let to = super::page_end(from, to);
        let query = sqlx::query(
            "SELECT seq, body, hash, created_at FROM (\
             SELECT seq, body, hash, created_at, \
             sum(length(CAST(body AS BLOB))) OVER (ORDER BY seq) AS upto, \
             row_number() OVER (ORDER BY seq) AS n \
             FROM agentrun_steps WHERE run = ?1 AND seq >= ?2 AND seq < ?3) \
             WHERE n = 1 OR upto <= ?4 ORDER BY seq",
        )
        .bind(run)
        .bind(to_i64("seq", from)?)
        .bind(to_i64("seq", to)?)
        .bind(i64::try_from(max_bytes).unwrap_or(i64::MAX));
        self.stored(run, query).await
    }

    async fn read_verified(
        &self,
        run: &str,
        expected_head: Option<&Hash>,
    ) -> Result<Vec<Record>, StoreError> {
        let mut rows = sqlx::query(
            "SELECT seq, body, hash, created_at FROM agentrun_steps WHERE run = ?1 ORDER BY seq",
        )
        .bind(run)
        .fetch(&self.reader);
        let mut chain = StoredChain::new(run);
        while let Some(row) = rows.try_next().await.map_err(|e| self.err(e))? {
            let body: &str = row.try_get(1).map_err(|e| self.err(e))?;
            let hash: &[u8] = row.try_get(2).map_err(|e| self.err(e))?;
            let at: i64 = row.try_get(3).map_err(|e| self.err(e))?;
            chain.push(body.as_bytes(), hash, Some(from_micros(at)))?;
        }
        chain.finish(expected_head)
    }

    async fn head(&self, run: &str) -> Result<Head, StoreError> {
        let row = sqlx::query(
            "SELECT seq, hash FROM agentrun_steps WHERE run = ?1 ORDER BY seq DESC LIMIT 1",
        )
        .bind(run)
        .fetch_optional(&self.reader)
        .await
        .map_err(|e| self.err(e))?;
        match row {
            None => Ok(Head::EMPTY),
            Some(row) => {
                let seq: i64 = row.try_get(0).map_err(|e| self.err(e))?;
                let hash: Vec<u8> = row.try_get(1).map_err(|e| self.err(e))?;
                Head::from_last(run, seq, &hash)
            }
        }
    }

    /// From the row's `kind` column, as PostgreSQL does: whether the run is
    /// finished, without decoding (a body that does not verify is refused
    /// where it is read, at its seq).
    async fn last_kind(&self, run: &str) -> Result<Option<StepKind>, StoreError> {
        let kind: Option<String> = sqlx::query_scalar(
            "SELECT kind FROM agentrun_steps WHERE run = ?1 ORDER BY seq DESC LIMIT 1",
        )
        .bind(run)
        .fetch_optional(&self.reader)
        .await
        .map_err(|e| self.err(e))?;
        Ok(kind.and_then(|k| StepKind::ALL.into_iter().find(|s| s.as_str() == k)))
    }

    async fn acquire(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        self.lease_for(run, holder, ttl, false).await
    }

    async fn take_over(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        self.lease_for(run, holder, ttl, true).await
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Lease, StoreError> {
        let mut tx = self.begin_write().await?;
        let now = micros(Utc::now());
        let expires = now.saturating_add(ttl_micros(ttl));
        let epoch = to_i64("epoch", lease.epoch)?;
        let cur = sqlx::query(
            "SELECT holder, epoch, expires_at, yield_requested FROM agentrun_leases WHERE run = ?1",
        )
        .bind(&lease.run)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| self.err(e))?;
        let (holder, current, cur_expires, yield_requested): (
            Option<String>,
            Option<i64>,
            i64,
            bool,
        ) = match cur {
            Some(row) => (
                Some(row.try_get(0).map_err(|e| self.err(e))?),
                Some(row.try_get(1).map_err(|e| self.err(e))?),
                row.try_get(2).map_err(|e| self.err(e))?,
                row.try_get(3).map_err(|e| self.err(e))?,
            ),
            None => (None, None, 0, false),
        };
        if current != Some(epoch) || holder.as_deref() != Some(&lease.holder) {
            return Err(StoreError::StaleEpoch {
                run: lease.run.clone(),
                epoch: lease.epoch,
                current: current.map(|e| e as u64),
                expired: current == Some(epoch) && cur_expires <= now,
            });
        }
        sqlx::query(
            "UPDATE agentrun_leases SET expires_at = ?2, renewed_at = ?3, released = 0 WHERE run = ?1",
        )
            .bind(&lease.run)
            .bind(expires)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(Lease {
            expires_at: from_micros(expires),
            yield_requested,
            ..lease.clone()
        })
    }

    async fn lease(&self, run: &str) -> Result<Option<LeaseState>, StoreError> {
        let row = sqlx::query(
            "SELECT holder, epoch, expires_at, released FROM agentrun_leases WHERE run = ?1",
        )
        .bind(run)
        .fetch_optional(&self.reader)
        .await
        .map_err(|e| self.err(e))?;
        let Some(row) = row else { return Ok(None) };
        let expires: i64 = row.try_get(2).map_err(|e| self.err(e))?;
        let expired = expires <= micros(Utc::now());
        let released: bool = row.try_get(3).map_err(|e| self.err(e))?;
        Ok(Some(LeaseState {
            holder: row.try_get(0).map_err(|e| self.err(e))?,
            epoch: row.try_get::<i64, _>(1).map_err(|e| self.err(e))? as u64,
            expires_at: from_micros(expires),
            expired,
            released: expired && released,
        }))
    }

    async fn request_yield(&self, run: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE agentrun_leases SET yield_requested = 1 WHERE run = ?1")
            .bind(run)
            .execute(&self.writer)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let now = micros(Utc::now());
        sqlx::query(
            "UPDATE agentrun_leases SET expires_at = ?4, released = 1 \
             WHERE run = ?1 AND epoch = ?2 AND holder = ?3 AND expires_at > ?4",
        )
        .bind(&lease.run)
        .bind(to_i64("epoch", lease.epoch)?)
        .bind(&lease.holder)
        .bind(now)
        .execute(&self.writer)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn read_verified_after(&self, run: &str, base: &Head) -> Result<Vec<Record>, StoreError> {
        let mut rows = sqlx::query(
            "SELECT seq, body, hash, created_at FROM agentrun_steps \
             WHERE run = ?1 AND seq >= ?2 ORDER BY seq",
        )
        .bind(run)
        .bind(to_i64("seq", base.len)?)
        .fetch(&self.reader);
        let mut chain = StoredChain::after(run, *base);
        while let Some(row) = rows.try_next().await.map_err(|e| self.err(e))? {
            let body: &str = row.try_get(1).map_err(|e| self.err(e))?;
            let hash: &[u8] = row.try_get(2).map_err(|e| self.err(e))?;
            let at: i64 = row.try_get(3).map_err(|e| self.err(e))?;
            chain.push(body.as_bytes(), hash, Some(from_micros(at)))?;
        }
        chain.finish(None)
    }

    async fn lapsed_leases(
        &self,
        since: DateTime<Utc>,
    ) -> Result<(Vec<String>, DateTime<Utc>), StoreError> {
        let now = micros(Utc::now());
        let runs = sqlx::query_scalar(
            "SELECT run FROM agentrun_leases \
             WHERE released = 0 AND expires_at > ?1 AND expires_at <= ?2",
        )
        .bind(micros(since))
        .bind(now)
        .fetch_all(&self.reader)
        .await
        .map_err(|e| self.err(e))?;
        Ok((runs, from_micros(now)))
    }

    async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }
}

/// What tests do to a store behind its back.
#[cfg(test)]
pub(crate) mod testing {
    use sqlx::Connection;

    use crate::store::{StepStore, chain_hash};

    /// Respells the stored body of record `seq` (> 0) of `run` in the SQLite
    /// store at `path` with `respell`, as a database superuser would (the
    /// append-only trigger dropped), and stores the hash of the new bytes:
    /// the chain still links, and every anchor taken before it still holds.
    pub(crate) async fn respell_as_superuser(
        path: &std::path::Path,
        store: &dyn StepStore,
        run: &str,
        seq: u64,
        respell: impl Fn(&str) -> String,
    ) {
        let before = store
            .read_stored(run, seq - 1, Some(seq + 1))
            .await
            .unwrap();
        let body = respell(&before[1].body);
        assert_ne!(body, before[1].body, "the body was respelled");
        let hash = chain_hash(&before[0].hash, body.as_bytes());
        let url = format!("sqlite://{}", path.display());
        let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::raw_sql("DROP TRIGGER IF EXISTS agentrun_steps_no_update")
            .execute(&mut c)
            .await
            .unwrap();
        sqlx::query("UPDATE agentrun_steps SET body = ?1, hash = ?2 WHERE run = ?3 AND seq = ?4")
            .bind(&body)
            .bind(&hash.0[..])
            .bind(run)
            .bind(seq as i64)
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_sqlite_url_forms() {
        assert_eq!(
            sqlite_path("sqlite:///tmp/a.db").unwrap(),
            PathBuf::from("/tmp/a.db")
        );
        assert_eq!(
            sqlite_path("sqlite://rel/a.db").unwrap(),
            PathBuf::from("rel/a.db")
        );
        assert_eq!(
            sqlite_path("sqlite:a.db?mode=rwc").unwrap(),
            PathBuf::from("a.db")
        );
        assert_eq!(
            sqlite_path("file:///var/x.db").unwrap(),
            PathBuf::from("/var/x.db")
        );
        assert!(sqlite_path("sqlite://").is_err());
        assert!(sqlite_path("postgres://x").is_err());
    }
}
