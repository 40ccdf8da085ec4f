//! PostgreSQL backend.
//!
//! An append is one round trip: a single statement (a CTE) share-locks the
//! run's lease row at the given epoch, checks the previous hash, inserts with
//! `ON CONFLICT DO NOTHING`, and in the same result returns what is needed to
//! explain a refusal (current epoch, recorded row, length). Only when a
//! concurrent writer committed the same seq after the statement's snapshot is
//! a second (read-only) statement needed to fetch the winner.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::Row;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};

use super::append::{
    adopt_or_conflict, check_prev_hash, decode_stored, gap, stale_epoch, stored_at, stored_row,
};
use super::chain::StoredChain;
use super::record::{Hash, Head, Record, StepKind, StoredRecord};
use super::{
    HeadEvent, Lease, LeaseState, OpenOptions, StepStore, StoreError, check_record, redact_url,
    to_i64, ttl_micros,
};

const MIGRATIONS_TABLE: &str = "agentrun_store_migrations";

fn migrator() -> Migrator {
    let mut m = Migrator::with_migrations(vec![
        Migration::new(
            1,
            "step log".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!("migrations/postgres/0001_step_log.sql")),
            false,
        ),
        Migration::new(
            2,
            "released leases, head notifications".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!(
                "migrations/postgres/0002_released_and_notify.sql"
            )),
            false,
        ),
        Migration::new(
            3,
            "yield requests".into(),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(include_str!("migrations/postgres/0003_yield.sql")),
            false,
        ),
    ]);
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

const APPEND_SQL: &str = r#"
WITH lease AS (
    SELECT epoch FROM agentrun_leases
     WHERE run = $1 AND epoch = $2 AND expires_at > now()
     FOR SHARE
), ins AS (
    INSERT INTO agentrun_steps (run, seq, format, kind, prev_hash, hash, body, epoch)
    SELECT $1, $3, $4, $5, $6, $7, $8, $2
      FROM lease
     WHERE CASE WHEN $3 = 0 THEN $6 = $9
                ELSE EXISTS (SELECT 1 FROM agentrun_steps p
                              WHERE p.run = $1 AND p.seq = $3 - 1 AND p.hash = $6)
           END
    ON CONFLICT (run, seq) DO NOTHING
    RETURNING created_at
)
SELECT i.created_at AS inserted_at,
       l.ok AS lease_ok,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT epoch FROM agentrun_leases WHERE run = $1) END AS current_epoch,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT expires_at <= now() FROM agentrun_leases WHERE run = $1) END AS current_expired,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT body FROM agentrun_steps WHERE run = $1 AND seq = $3) END AS rec_body,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT hash FROM agentrun_steps WHERE run = $1 AND seq = $3) END AS rec_hash,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT created_at FROM agentrun_steps WHERE run = $1 AND seq = $3) END AS rec_created_at,
       CASE WHEN i.created_at IS NULL AND $3 > 0 THEN
           (SELECT hash FROM agentrun_steps WHERE run = $1 AND seq = $3 - 1) END AS prev_hash,
       CASE WHEN i.created_at IS NULL THEN
           (SELECT coalesce(max(seq) + 1, 0) FROM agentrun_steps WHERE run = $1) END AS len
  FROM (SELECT EXISTS (SELECT 1 FROM lease) AS ok) l
  LEFT JOIN ins i ON true
"#;

const RECORDED_SQL: &str =
    "SELECT body, hash, created_at FROM agentrun_steps WHERE run = $1 AND seq = $2";

const READ_SQL: &str = "SELECT seq, body, hash, created_at FROM agentrun_steps \
     WHERE run = $1 AND seq >= $2 AND seq < $3 ORDER BY seq";

/// One page by bytes: the running total of the bodies' sizes (the stored
/// lengths; no body is read to count it) cuts it, the first row always in.
const PAGE_SQL: &str = "SELECT seq, body, hash, created_at FROM (\
     SELECT seq, body, hash, created_at, \
     sum(octet_length(body)) OVER (ORDER BY seq) AS upto, \
     row_number() OVER (ORDER BY seq) AS n \
     FROM agentrun_steps WHERE run = $1 AND seq >= $2 AND seq < $3) page \
     WHERE n = 1 OR upto <= $4 ORDER BY seq";

const HEAD_SQL: &str =
    "SELECT seq, hash FROM agentrun_steps WHERE run = $1 ORDER BY seq DESC LIMIT 1";

const LAST_KIND_SQL: &str =
    "SELECT kind FROM agentrun_steps WHERE run = $1 ORDER BY seq DESC LIMIT 1";

/// Takes a run's lease with the next epoch where `$cond` allows it.
macro_rules! lease_upsert {
    ($cond:literal) => {
        concat!(
            "INSERT INTO agentrun_leases AS l (run, holder, epoch, expires_at, acquired_at, renewed_at, released) \
             VALUES ($1, $2, 1, now() + $3 * interval '1 microsecond', now(), now(), false) \
             ON CONFLICT (run) DO UPDATE \
                SET holder = excluded.holder, epoch = l.epoch + 1, expires_at = excluded.expires_at, \
                    acquired_at = now(), renewed_at = now(), released = false, yield_requested = false ",
            $cond,
            " RETURNING epoch, expires_at"
        )
    };
}

/// When free, lapsed or the holder's own.
const ACQUIRE_SQL: &str =
    lease_upsert!("WHERE l.expires_at <= now() OR l.holder = excluded.holder");

/// Whoever holds it.
const TAKE_OVER_SQL: &str = lease_upsert!("");

const LEASE_SQL: &str = "SELECT holder, epoch, expires_at, expires_at <= now() AS expired, released \
     FROM agentrun_leases WHERE run = $1";

const LAPSED_SQL: &str = "SELECT run, now() FROM agentrun_leases \
     WHERE NOT released AND expires_at > $1 AND expires_at <= now()";

const YIELD_SQL: &str = "UPDATE agentrun_leases SET yield_requested = true \
     WHERE run = $1 AND NOT yield_requested";

/// The channel head changes are announced on (migration 0002).
const HEADS_CHANNEL: &str = "agentrun_heads";

const RENEW_SQL: &str = r#"
UPDATE agentrun_leases
   SET expires_at = now() + $4 * interval '1 microsecond', renewed_at = now(), released = false
 WHERE run = $1 AND epoch = $2 AND holder = $3
RETURNING expires_at, yield_requested
"#;

const RELEASE_SQL: &str = r#"
UPDATE agentrun_leases SET expires_at = now(), released = true
 WHERE run = $1 AND epoch = $2 AND holder = $3 AND expires_at > now()
"#;

/// Forwards the `agentrun_heads` notifications to `tx` until its receiver
/// is dropped. A (re)established listening connection sends
/// [`HeadEvent::Resync`] first: whatever was announced meanwhile is lost.
async fn announce_heads(pool: PgPool, tx: tokio::sync::mpsc::Sender<HeadEvent>) {
    while !tx.is_closed() {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "listening for step-log heads failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(HEADS_CHANNEL).await {
            tracing::warn!(error = %e, "listening for step-log heads failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        if tx.send(HeadEvent::Resync).await.is_err() {
            return;
        }
        loop {
            let event = match listener.try_recv().await {
                Ok(Some(n)) => HeadEvent::Changed(n.payload().to_string()),
                // Lost and re-established (eagerly): notifications in between are gone.
                Ok(None) => HeadEvent::Resync,
                Err(e) => {
                    tracing::warn!(error = %e, "the step-log head listener failed; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            };
            if tx.send(event).await.is_err() {
                return;
            }
        }
    }
}

/// The PostgreSQL step store.
pub struct PgStore {
    pool: PgPool,
    url: String,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").field("url", &self.url).finish()
    }
}

impl PgStore {
    /// Connect (see [`super::open_with`]). Does not migrate.
    pub async fn connect(url: &str, opts: &OpenOptions) -> Result<PgStore, StoreError> {
        let redacted = redact_url(url);
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::InvalidUrl {
                url: redacted.clone(),
                reason: e.to_string(),
            })?
            .application_name("agentrun");
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections.max(1))
            .min_connections(0)
            .acquire_timeout(opts.acquire_timeout)
            // A ping per acquire would double the round trips of an append;
            // a dead connection surfaces as a retryable error instead.
            .test_before_acquire(false)
            .idle_timeout(Some(Duration::from_secs(300)))
            .connect_lazy_with(connect);
        let store = PgStore {
            pool,
            url: redacted,
        };
        if opts.connect_eagerly {
            sqlx::query("SELECT 1")
                .execute(&store.pool)
                .await
                .map_err(|e| store.err(e))?;
        }
        Ok(store)
    }

    /// The connection pool (for administration and tests).
    /// The records after `base`, verified as they are read.
    async fn read_chain<'a>(
        &self,
        run: &'a str,
        base: Head,
    ) -> Result<StoredChain<'a>, StoreError> {
        let mut rows = sqlx::query(READ_SQL)
            .bind(run)
            .bind(to_i64("seq", base.len)?)
            .bind(i64::MAX)
            .fetch(&self.pool);
        let mut chain = StoredChain::after(run, base);
        while let Some(row) = rows.try_next().await.map_err(|e| self.err(e))? {
            let body: &str = row.try_get(1).map_err(|e| self.err(e))?;
            let hash: &[u8] = row.try_get(2).map_err(|e| self.err(e))?;
            let at: DateTime<Utc> = row.try_get(3).map_err(|e| self.err(e))?;
            chain.push(body.as_bytes(), hash, Some(at))?;
        }
        Ok(chain)
    }

    /// The records a query of `(seq, body, hash, created_at)` rows finds, as stored.
    async fn stored(
        &self,
        run: &str,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let mut rows = query.fetch(&self.pool);
        let mut out = Vec::new();
        while let Some(row) = rows.try_next().await.map_err(|e| self.err(e))? {
            let seq: i64 = row.try_get(0).map_err(|e| self.err(e))?;
            let body: String = row.try_get(1).map_err(|e| self.err(e))?;
            let hash: &[u8] = row.try_get(2).map_err(|e| self.err(e))?;
            let at: DateTime<Utc> = row.try_get(3).map_err(|e| self.err(e))?;
            out.push(stored_row(run, seq as u64, body, hash, at)?);
        }
        Ok(out)
    }

    /// The lease `holder` took, from the row an upsert returned.
    fn taken(
        &self,
        run: &str,
        holder: &str,
        row: &sqlx::postgres::PgRow,
    ) -> Result<Lease, StoreError> {
        let epoch: i64 = row.try_get(0).map_err(|e| self.err(e))?;
        Ok(Lease {
            run: run.to_string(),
            holder: holder.to_string(),
            epoch: epoch as u64,
            expires_at: row.try_get(1).map_err(|e| self.err(e))?,
            yield_requested: false,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::from_sqlx(&self.url, e)
    }

    /// Run the one-statement append (see [`APPEND_SQL`]): it inserts, or
    /// returns what explains why it did not.
    async fn append_row(
        &self,
        run: &str,
        epoch: u64,
        record: &Record,
        body: &[u8],
    ) -> Result<PgRow, StoreError> {
        let body_str = std::str::from_utf8(body).expect("canonical JSON is UTF-8");
        let seq = to_i64("seq", record.seq)?;
        sqlx::query(APPEND_SQL)
            .bind(run)
            .bind(to_i64("epoch", epoch)?)
            .bind(seq)
            .bind(record.format as i32)
            .bind(record.kind.as_str())
            .bind(&record.prev_hash.0[..])
            .bind(&record.hash.0[..])
            .bind(body_str)
            .bind(&Hash::ZERO.0[..])
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))
    }

    /// Refuse a writer whose lease the append's row found missing, taken
    /// over, or lapsed.
    fn check_lease_row(&self, row: &PgRow, run: &str, epoch: u64) -> Result<(), StoreError> {
        let get_err = |e| StoreError::from_sqlx(&self.url, e);
        let lease_ok: bool = row.try_get("lease_ok").map_err(get_err)?;
        if lease_ok {
            return Ok(());
        }
        let current: Option<i64> = row.try_get("current_epoch").map_err(get_err)?;
        let expired: Option<bool> = row.try_get("current_expired").map_err(get_err)?;
        let own_lapsed = current == Some(epoch as i64) && expired.unwrap_or(true);
        Err(stale_epoch(run, epoch, current, own_lapsed))
    }

    /// Refuse a record that does not extend the chain the append's row saw:
    /// a hole before it, or a previous hash other than its predecessor's.
    fn check_chain_row(&self, row: &PgRow, run: &str, record: &Record) -> Result<(), StoreError> {
        let get_err = |e| StoreError::from_sqlx(&self.url, e);
        let len: i64 = row
            .try_get::<Option<i64>, _>("len")
            .map_err(get_err)?
            .unwrap_or(0);
        if len < to_i64("seq", record.seq)? {
            return Err(gap(run, record, len as u64));
        }
        let expected = if record.seq > 0 {
            let prev: Option<Vec<u8>> = row.try_get("prev_hash").map_err(get_err)?;
            prev.as_deref()
                .and_then(Hash::from_slice)
                .unwrap_or(Hash::ZERO)
        } else {
            Hash::ZERO
        };
        check_prev_hash(run, record, expected)
    }

    /// Lease fine, predecessor fine, nothing visible at seq, yet nothing
    /// inserted: the seq was taken by a writer that committed concurrently,
    /// after the statement's snapshot. Its record decides, as for a retry.
    async fn adopt_concurrent(
        &self,
        run: &str,
        record: &Record,
        body: &[u8],
    ) -> Result<Record, StoreError> {
        match self.fetch_recorded(run, record.seq).await? {
            Some(recorded) => {
                let recorded_body = recorded.canonical_bytes();
                adopt_or_conflict(run, record, body, recorded, &recorded_body)
            }
            None => Err(StoreError::Database {
                url: self.url.clone(),
                reason: format!(
                    "append of run {run} seq {} inserted nothing and no record is there",
                    record.seq
                ),
            }),
        }
    }

    async fn fetch_recorded(&self, run: &str, seq: u64) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(RECORDED_SQL)
            .bind(run)
            .bind(to_i64("seq", seq)?)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        match row {
            None => Ok(None),
            Some(row) => {
                let body: String = row.try_get("body").map_err(|e| self.err(e))?;
                let hash: Vec<u8> = row.try_get("hash").map_err(|e| self.err(e))?;
                let at: DateTime<Utc> = row.try_get("created_at").map_err(|e| self.err(e))?;
                Ok(Some(decode_stored(run, seq, &body, &hash, at)?))
            }
        }
    }
}

#[async_trait]
impl StepStore for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn url(&self) -> &str {
        &self.url
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        migrator().run(&self.pool).await.map_err(|e| match e {
            sqlx::migrate::MigrateError::Execute(inner) => self.err(inner),
            other => StoreError::Schema {
                url: self.url.clone(),
                reason: other.to_string(),
            },
        })
    }

    async fn append(&self, run: &str, epoch: u64, record: &Record) -> Result<Record, StoreError> {
        let body = check_record(record)?;
        let row = self.append_row(run, epoch, record, &body).await?;
        let get_err = |e| StoreError::from_sqlx(&self.url, e);
        if let Some(at) = row
            .try_get::<Option<DateTime<Utc>>, _>("inserted_at")
            .map_err(get_err)?
        {
            return Ok(stored_at(record, at));
        }
        // Nothing inserted: the same row says why, checked in the order a
        // writer can act on (lease first, then what is at seq, then the chain).
        self.check_lease_row(&row, run, epoch)?;
        if let Some(rec_body) = row
            .try_get::<Option<String>, _>("rec_body")
            .map_err(get_err)?
        {
            let rec_hash: Vec<u8> = row.try_get("rec_hash").map_err(get_err)?;
            let at: DateTime<Utc> = row.try_get("rec_created_at").map_err(get_err)?;
            let recorded = decode_stored(run, record.seq, &rec_body, &rec_hash, at)?;
            return adopt_or_conflict(run, record, &body, recorded, rec_body.as_bytes());
        }
        self.check_chain_row(&row, run, record)?;
        self.adopt_concurrent(run, record, &body).await
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
        let query = sqlx::query(READ_SQL).bind(run).bind(from_i).bind(to_i);
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
        let query = sqlx::query(PAGE_SQL)
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
        self.read_chain(run, Head::EMPTY)
            .await?
            .finish(expected_head)
    }

    async fn read_verified_after(&self, run: &str, base: &Head) -> Result<Vec<Record>, StoreError> {
        self.read_chain(run, *base).await?.finish(None)
    }

    async fn lapsed_leases(
        &self,
        since: DateTime<Utc>,
    ) -> Result<(Vec<String>, DateTime<Utc>), StoreError> {
        let rows = sqlx::query(LAPSED_SQL)
            .bind(since)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        let mut runs = Vec::with_capacity(rows.len());
        for row in &rows {
            runs.push(row.try_get(0).map_err(|e| self.err(e))?);
        }
        let now = match rows.first() {
            Some(row) => row.try_get(1).map_err(|e| self.err(e))?,
            None => sqlx::query_scalar("SELECT now()")
                .fetch_one(&self.pool)
                .await
                .map_err(|e| self.err(e))?,
        };
        Ok((runs, now))
    }

    async fn head_events(
        &self,
    ) -> Result<Option<tokio::sync::mpsc::Receiver<HeadEvent>>, StoreError> {
        let (tx, rx) = tokio::sync::mpsc::channel(4096);
        tokio::spawn(announce_heads(self.pool.clone(), tx));
        Ok(Some(rx))
    }

    async fn head(&self, run: &str) -> Result<Head, StoreError> {
        let row = sqlx::query(HEAD_SQL)
            .bind(run)
            .fetch_optional(&self.pool)
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

    async fn last_kind(&self, run: &str) -> Result<Option<StepKind>, StoreError> {
        let kind: Option<String> = sqlx::query_scalar(LAST_KIND_SQL)
            .bind(run)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(kind.and_then(|k| StepKind::ALL.into_iter().find(|s| s.as_str() == k)))
    }

    async fn acquire(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        // Retried once: the lease may be released between the refused
        // upsert and the look-up that explains the refusal.
        for _ in 0..3 {
            let row = sqlx::query(ACQUIRE_SQL)
                .bind(run)
                .bind(holder)
                .bind(ttl_micros(ttl) as f64)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
            if let Some(row) = row {
                return self.taken(run, holder, &row);
            }
            let cur = sqlx::query(LEASE_SQL)
                .bind(run)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
            if let Some(cur) = cur {
                let expired: bool = cur.try_get(3).map_err(|e| self.err(e))?;
                if !expired {
                    return Err(StoreError::LeaseHeld {
                        run: run.to_string(),
                        holder: cur.try_get(0).map_err(|e| self.err(e))?,
                        epoch: cur.try_get::<i64, _>(1).map_err(|e| self.err(e))? as u64,
                        expires_at: cur.try_get(2).map_err(|e| self.err(e))?,
                    });
                }
            }
        }
        Err(StoreError::Database {
            url: self.url.clone(),
            reason: format!("could not acquire the lease of run {run}: it keeps changing hands"),
        })
    }

    async fn take_over(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        let row = sqlx::query(TAKE_OVER_SQL)
            .bind(run)
            .bind(holder)
            .bind(ttl_micros(ttl) as f64)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        self.taken(run, holder, &row)
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Lease, StoreError> {
        let epoch = to_i64("epoch", lease.epoch)?;
        let row = sqlx::query(RENEW_SQL)
            .bind(&lease.run)
            .bind(epoch)
            .bind(&lease.holder)
            .bind(ttl_micros(ttl) as f64)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        if let Some(row) = row {
            let expires_at: DateTime<Utc> = row.try_get(0).map_err(|e| self.err(e))?;
            return Ok(Lease {
                expires_at,
                yield_requested: row.try_get(1).map_err(|e| self.err(e))?,
                ..lease.clone()
            });
        }
        let cur = sqlx::query(LEASE_SQL)
            .bind(&lease.run)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        let (current, expired) = match cur {
            Some(cur) => (
                Some(cur.try_get::<i64, _>(1).map_err(|e| self.err(e))? as u64),
                cur.try_get::<bool, _>(3).map_err(|e| self.err(e))?,
            ),
            None => (None, false),
        };
        Err(StoreError::StaleEpoch {
            run: lease.run.clone(),
            epoch: lease.epoch,
            current,
            expired: current == Some(lease.epoch) && expired,
        })
    }

    async fn lease(&self, run: &str) -> Result<Option<LeaseState>, StoreError> {
        let Some(row) = sqlx::query(LEASE_SQL)
            .bind(run)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?
        else {
            return Ok(None);
        };
        Ok(Some(LeaseState {
            holder: row.try_get(0).map_err(|e| self.err(e))?,
            epoch: row.try_get::<i64, _>(1).map_err(|e| self.err(e))? as u64,
            expires_at: row.try_get(2).map_err(|e| self.err(e))?,
            expired: row.try_get(3).map_err(|e| self.err(e))?,
            released: row.try_get::<bool, _>(3).map_err(|e| self.err(e))?
                && row.try_get::<bool, _>(4).map_err(|e| self.err(e))?,
        }))
    }

    async fn request_yield(&self, run: &str) -> Result<(), StoreError> {
        sqlx::query(YIELD_SQL)
            .bind(run)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        sqlx::query(RELEASE_SQL)
            .bind(&lease.run)
            .bind(to_i64("epoch", lease.epoch)?)
            .bind(&lease.holder)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}
