//! Step store behaviour, against a real PostgreSQL (started by `e2e/postgres`)
//! and the embedded SQLite backend. The behavioural suite is written once
//! (`suite!`) and instantiated for both backends; PostgreSQL-only tests cover
//! roles, the append-only trigger and an outage.
//!
//! PostgreSQL must start: these tests fail loudly, never skip.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use agentrun::store::{
    self, Hash, Head, OpenOptions, Record, RecordDraft, StepKind, StepStore, StoreError, Usage,
    Worker,
};
use serde_json::json;
use sqlx::Connection;

// ---------------------------------------------------------------------------
// PostgreSQL instances (e2e/postgres)

const OUTAGE_INSTANCE: (&str, &str) = ("pg-outage-test", "25433");

fn e2e_postgres(instance: Option<(&str, &str)>, arg: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../postgres");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg(arg);
    if let Some((name, port)) = instance {
        cmd.env("AGENTRUN_PG_NAME", name)
            .env("AGENTRUN_PG_PORT", port);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "`e2e/postgres {arg}` failed ({}): PostgreSQL is required for these tests.\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Superuser URL of the shared test instance (started once per process).
fn pg_admin_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        e2e_postgres(None, "up");
        e2e_postgres(None, "url")
    })
}

fn with_db(url: &str, db: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_path(&format!("/{db}"));
    u.to_string()
}

fn with_user(url: &str, user: &str, password: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_username(user).unwrap();
    u.set_password(Some(password)).unwrap();
    u.to_string()
}

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 100_000_000;
    format!("{tag}_{}_{t}_{n}", std::process::id())
}

async fn admin_exec(url: &str, sql: &str) {
    let mut c = sqlx::PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {}: {e}", store::redact_url(url)));
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(&mut c)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    c.close().await.ok();
}

/// A fresh database on `admin` (superuser URL), migrated, plus a login user
/// that is a member of agentrun_writer. Returns (superuser URL of the new
/// database, writer URL, db name, writer user).
async fn pg_database(admin: &str, tag: &str) -> (String, String, String, String) {
    let db = unique(&format!("agentrun_t_{tag}"));
    admin_exec(admin, &format!("CREATE DATABASE {db}")).await;
    let db_admin = with_db(admin, &db);
    let su = store::open(&db_admin).await.expect("open as superuser");
    su.migrate().await.expect("migrate");
    su.migrate().await.expect("migrate is idempotent");
    su.close().await;
    let user = format!("w_{db}");
    let password = "writer-s3cret";
    admin_exec(
        &db_admin,
        &format!("CREATE ROLE {user} LOGIN PASSWORD '{password}' IN ROLE agentrun_writer"),
    )
    .await;
    let writer = with_user(&db_admin, &user, password);
    (db_admin, writer, db, user)
}

async fn pg_drop(admin: &str, db: &str, users: &[&str]) {
    admin_exec(admin, &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await;
    for u in users {
        admin_exec(admin, &format!("DROP ROLE IF EXISTS {u}")).await;
    }
}

// ---------------------------------------------------------------------------
// Backend-neutral test context

enum Kind {
    Pg {
        admin: String,
        db_admin: String,
        db: String,
        user: String,
    },
    Sqlite {
        path: PathBuf,
        _dir: tempfile::TempDir,
    },
}

struct Ctx {
    kind: Kind,
    /// URL the store was opened with (the writer login on PostgreSQL).
    url: String,
    store: Arc<dyn StepStore>,
}

async fn pg_ctx() -> Ctx {
    let admin = pg_admin_url().to_string();
    let (db_admin, writer, db, user) = pg_database(&admin, "suite").await;
    let store = store::open(&writer).await.expect("open as writer");
    assert_eq!(store.backend(), "postgres");
    Ctx {
        kind: Kind::Pg {
            admin,
            db_admin,
            db,
            user,
        },
        url: writer,
        store,
    }
}

async fn sqlite_ctx() -> Ctx {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("steps.db");
    let url = format!("sqlite://{}", path.display());
    let store = store::open(&url).await.expect("open sqlite");
    assert_eq!(store.backend(), "sqlite");
    Ctx {
        kind: Kind::Sqlite { path, _dir: dir },
        url,
        store,
    }
}

impl Ctx {
    /// Change the database behind the store's back, as a superuser would
    /// (triggers off for this session / dropped and recreated).
    async fn tamper(&self, sql: &str) {
        match &self.kind {
            Kind::Pg { db_admin, .. } => {
                admin_exec(
                    db_admin,
                    &format!("SET session_replication_role = replica; {sql}"),
                )
                .await
            }
            Kind::Sqlite { path, .. } => {
                let mut c =
                    sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
                        .await
                        .unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP TRIGGER agentrun_steps_no_update; DROP TRIGGER agentrun_steps_no_delete; {sql};
                     CREATE TRIGGER agentrun_steps_no_update BEFORE UPDATE ON agentrun_steps
                       BEGIN SELECT RAISE(ABORT, 'agentrun_steps is append-only: UPDATE refused'); END;
                     CREATE TRIGGER agentrun_steps_no_delete BEFORE DELETE ON agentrun_steps
                       BEGIN SELECT RAISE(ABORT, 'agentrun_steps is append-only: DELETE refused'); END;"
                )))
                .execute(&mut c)
                .await
                .unwrap();
                c.close().await.ok();
            }
        }
    }

    /// Try a statement with the store's own privileges (the writer role /
    /// the SQLite file with its triggers); returns the error text if refused.
    async fn try_as_writer(&self, sql: &str) -> Result<u64, String> {
        match &self.kind {
            Kind::Pg { .. } => {
                let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
                let r = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&mut c)
                    .await;
                c.close().await.ok();
                r.map(|r| r.rows_affected()).map_err(|e| e.to_string())
            }
            Kind::Sqlite { path, .. } => {
                let mut c =
                    sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
                        .await
                        .unwrap();
                let r = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&mut c)
                    .await;
                c.close().await.ok();
                r.map(|r| r.rows_affected()).map_err(|e| e.to_string())
            }
        }
    }

    async fn done(self) {
        self.store.close().await;
        if let Kind::Pg {
            admin, db, user, ..
        } = &self.kind
        {
            pg_drop(admin, db, &[user]).await;
        }
    }
}

fn draft(kind: StepKind, payload: serde_json::Value, pod: &str) -> RecordDraft {
    RecordDraft {
        format: agentrun::store::FORMAT_1,
        kind,
        payload,
        versions: Default::default(),
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            cost_micros: 7,
        },
        worker: Worker {
            pod: pod.to_string(),
            attempt: 1,
        },
    }
}

fn rec(head: &Head, i: u64, pod: &str) -> Record {
    draft(StepKind::Observation, json!({"i": i, "by": pod}), pod)
        .seal(head)
        .unwrap()
}

async fn append_n(store: &dyn StepStore, run: &str, epoch: u64, n: u64) -> Vec<Record> {
    let mut head = store.head(run).await.unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let r = rec(&head, i, "pod-a");
        let stored = store.append(run, epoch, &r).await.unwrap();
        head = stored.head();
        out.push(stored);
    }
    out
}

const TTL: Duration = Duration::from_secs(600);

// ---------------------------------------------------------------------------
// The behavioural suite, once, for both backends

async fn race_tasks(ctx: Ctx) {
    let store = ctx.store.clone();
    let run = unique("race-tasks");
    let lease = store.acquire(&run, "controller", TTL).await.unwrap();
    let mut head = Head::EMPTY;
    for round in 0..20u64 {
        let a = rec(&head, round, "pod-a");
        let b = rec(&head, round, "pod-b");
        assert_ne!(a.hash, b.hash);
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let spawn = |r: Record| {
            let (store, run, barrier) = (store.clone(), run.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.append(&run, lease.epoch, &r).await
            })
        };
        let (ta, tb) = (spawn(a.clone()), spawn(b.clone()));
        let (ra, rb) = (ta.await.unwrap(), tb.await.unwrap());
        let (winner, loser_result, loser) = match (&ra, &rb) {
            (Ok(w), Err(_)) => (w.clone(), rb, b),
            (Err(_), Ok(w)) => (w.clone(), ra, a),
            other => panic!("round {round}: expected exactly one winner, got {other:?}"),
        };
        // The loser gets a conflict carrying the recorded winner, and adopts it.
        match loser_result {
            Err(StoreError::Conflict { seq, recorded, .. }) => {
                assert_eq!(seq, round);
                assert!(recorded.same_as(&winner), "conflict must carry the winner");
                assert_eq!(recorded.created_at, winner.created_at);
            }
            other => panic!("round {round}: expected Conflict, got {other:?}"),
        }
        // Identical retries succeed and return the recorded record; the
        // loser retrying its own record still conflicts.
        let again = store.append(&run, lease.epoch, &winner).await.unwrap();
        assert!(again.same_as(&winner));
        assert_eq!(
            again.created_at, winner.created_at,
            "created_at is the first write's"
        );
        let e = store.append(&run, lease.epoch, &loser).await.unwrap_err();
        assert_eq!(e.metric_label(), "conflict");
        assert!(e.recorded().unwrap().same_as(&winner));
        head = winner.head();
    }
    let log = store.read_all(&run).await.unwrap();
    assert_eq!(log.len(), 20);
    assert_eq!(store.verify(&run, Some(&head.hash)).await.unwrap(), head);
    ctx.done().await;
}

/// Child side of `race_processes`: appends `rounds` records, adopting the
/// winner after each conflict, and prints one line per seq.
async fn race_child_main(url: String) {
    let run = std::env::var("AGENTRUN_STORE_RACE_RUN").unwrap();
    let epoch: u64 = std::env::var("AGENTRUN_STORE_RACE_EPOCH")
        .unwrap()
        .parse()
        .unwrap();
    let pod = std::env::var("AGENTRUN_STORE_RACE_POD").unwrap();
    let rounds: u64 = std::env::var("AGENTRUN_STORE_RACE_ROUNDS")
        .unwrap()
        .parse()
        .unwrap();
    let start_ms: u128 = std::env::var("AGENTRUN_STORE_RACE_START_MS")
        .unwrap()
        .parse()
        .unwrap();
    let store = store::open(&url).await.expect("child open");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    if start_ms > now_ms {
        tokio::time::sleep(Duration::from_millis((start_ms - now_ms) as u64)).await;
    }
    let mut head = Head::EMPTY;
    for i in 0..rounds {
        let r = rec(&head, i, &pod);
        match store.append(&run, epoch, &r).await {
            Ok(stored) => {
                println!("RESULT {i} won {}", stored.hash);
                head = stored.head();
            }
            Err(StoreError::Conflict { recorded, .. }) => {
                println!("RESULT {i} lost {}", recorded.hash);
                head = recorded.head();
            }
            Err(e) => panic!("child {pod}: append {i}: {e}"),
        }
    }
    store.close().await;
}

async fn race_processes(ctx: Ctx, this_test: &str) {
    let run = unique("race-procs");
    let lease = ctx.store.acquire(&run, "controller", TTL).await.unwrap();
    let rounds = 30u64;
    let start_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + 1500;
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = ["proc-a", "proc-b"]
        .iter()
        .map(|pod| {
            tokio::process::Command::new(&exe)
                .args(["--exact", this_test, "--nocapture", "--test-threads=1"])
                .env("AGENTRUN_STORE_RACE_URL", &ctx.url)
                .env("AGENTRUN_STORE_RACE_RUN", &run)
                .env("AGENTRUN_STORE_RACE_EPOCH", lease.epoch.to_string())
                .env("AGENTRUN_STORE_RACE_POD", pod)
                .env("AGENTRUN_STORE_RACE_ROUNDS", rounds.to_string())
                .env("AGENTRUN_STORE_RACE_START_MS", start_ms.to_string())
                .output()
        })
        .collect();
    let mut results = Vec::new();
    for (pod, child) in ["proc-a", "proc-b"].iter().zip(children) {
        let out = child.await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "child {pod} failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<(u64, bool, String)> = stdout
            .lines()
            .filter_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
            .map(|l| {
                let p: Vec<&str> = l.split(' ').collect();
                (p[0].parse().unwrap(), p[1] == "won", p[2].to_string())
            })
            .collect();
        assert_eq!(lines.len() as u64, rounds, "child {pod} output:\n{stdout}");
        results.push(lines);
    }
    let log = ctx.store.read_all(&run).await.unwrap();
    assert_eq!(log.len() as u64, rounds);
    let mut wins = [0, 0];
    for i in 0..rounds as usize {
        let (a, b) = (&results[0][i], &results[1][i]);
        assert!(
            a.1 ^ b.1,
            "seq {i}: exactly one process must win ({a:?} / {b:?})"
        );
        assert_eq!(
            a.2, b.2,
            "seq {i}: the loser must adopt the winner's record"
        );
        assert_eq!(
            a.2,
            log[i].hash.to_hex(),
            "seq {i}: the recorded record is the winner's"
        );
        let winner_pod = if a.1 { "proc-a" } else { "proc-b" };
        assert_eq!(log[i].worker.pod, winner_pod);
        wins[if a.1 { 0 } else { 1 }] += 1;
    }
    eprintln!("race_processes wins: proc-a {} proc-b {}", wins[0], wins[1]);
    ctx.store
        .verify(&run, Some(&log.last().unwrap().hash))
        .await
        .unwrap();
    ctx.done().await;
}

async fn fencing_and_takeover(ctx: Ctx) {
    let s = ctx.store.clone();
    let run = unique("fence");
    let short = Duration::from_millis(1200);
    let a = s.acquire(&run, "worker-a", short).await.unwrap();
    assert!(a.epoch >= 1);
    let r0 = rec(&Head::EMPTY, 0, "worker-a");
    s.append(&run, a.epoch, &r0).await.unwrap();

    // Held: another worker is refused while the lease is live.
    match s.acquire(&run, "worker-b", short).await {
        Err(StoreError::LeaseHeld { holder, epoch, .. }) => {
            assert_eq!(holder, "worker-a");
            assert_eq!(epoch, a.epoch);
        }
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    // Renew keeps the epoch.
    let a = s.renew(&a, short).await.unwrap();

    // An epoch that never existed is refused.
    let r1a = rec(&r0.head(), 1, "worker-a");
    match s.append(&run, a.epoch + 5, &r1a).await {
        Err(StoreError::StaleEpoch { epoch, current, .. }) => {
            assert_eq!(epoch, a.epoch + 5);
            assert_eq!(current, Some(a.epoch));
        }
        other => panic!("expected StaleEpoch, got {other:?}"),
    }

    // Expiry: the holder cannot append on a lapsed lease, even before
    // anyone takes over...
    tokio::time::sleep(short + Duration::from_millis(400)).await;
    match s.append(&run, a.epoch, &r1a).await {
        Err(StoreError::StaleEpoch { expired, .. }) => assert!(expired),
        other => panic!("expected StaleEpoch (expired), got {other:?}"),
    }
    // ...and the controller's read shows it lapsed, without moving it.
    let seen = s.lease(&run).await.unwrap().expect("leased");
    assert!(seen.expired && seen.epoch == a.epoch && seen.holder == "worker-a");
    // A late heartbeat revives a lapsed lease nobody took (same epoch).
    let a = s.renew(&a, short).await.unwrap();
    assert!(!s.lease(&run).await.unwrap().unwrap().expired);
    tokio::time::sleep(short + Duration::from_millis(400)).await;

    // Takeover with a higher epoch.
    let b = s.acquire(&run, "worker-b", TTL).await.unwrap();
    assert!(
        b.epoch > a.epoch,
        "epoch must grow: {} then {}",
        a.epoch,
        b.epoch
    );
    let e = s.append(&run, a.epoch, &r1a).await.unwrap_err();
    assert!(
        matches!(e, StoreError::StaleEpoch { current: Some(c), .. } if c == b.epoch),
        "{e:?}"
    );
    assert!(!e.is_retryable());
    // Even an identical retry of what the zombie wrote earlier is fenced.
    assert_eq!(
        s.append(&run, a.epoch, &r0)
            .await
            .unwrap_err()
            .metric_label(),
        "stale_epoch"
    );
    let r1b = rec(&r0.head(), 1, "worker-b");
    s.append(&run, b.epoch, &r1b).await.unwrap();
    assert_eq!(s.head(&run).await.unwrap(), r1b.head());
    // After a takeover the old holder's heartbeat is refused.
    assert_eq!(
        s.renew(&a, short).await.unwrap_err().metric_label(),
        "stale_epoch"
    );

    // The same holder re-acquiring gets a new epoch, fencing its previous incarnation.
    let b2 = s.acquire(&run, "worker-b", TTL).await.unwrap();
    assert!(b2.epoch > b.epoch);
    let r2 = rec(&r1b.head(), 2, "worker-b");
    assert_eq!(
        s.append(&run, b.epoch, &r2)
            .await
            .unwrap_err()
            .metric_label(),
        "stale_epoch"
    );

    // The controller takes a live lease over (a run it ends): the holder
    // is fenced at once, its append and heartbeat refused.
    assert!(matches!(
        s.acquire(&run, "controller", TTL).await,
        Err(StoreError::LeaseHeld { .. })
    ));
    let taken = s.take_over(&run, "controller", TTL).await.unwrap();
    assert!(taken.epoch > b2.epoch, "{} then {}", b2.epoch, taken.epoch);
    assert_eq!(
        s.append(&run, b2.epoch, &r2)
            .await
            .unwrap_err()
            .metric_label(),
        "stale_epoch"
    );
    assert_eq!(
        s.renew(&b2, TTL).await.unwrap_err().metric_label(),
        "stale_epoch"
    );
    s.release(&taken).await.unwrap();
    let b2 = s.acquire(&run, "worker-b", TTL).await.unwrap();

    // Release lets another holder in at once, with a higher epoch.
    s.release(&b2).await.unwrap();
    s.release(&b2).await.unwrap(); // releasing twice is harmless
    let c = s.acquire(&run, "worker-c", TTL).await.unwrap();
    assert!(c.epoch > b2.epoch);
    assert_eq!(
        s.append(&run, b2.epoch, &r2)
            .await
            .unwrap_err()
            .metric_label(),
        "stale_epoch"
    );
    s.append(&run, c.epoch, &r2).await.unwrap();
    // Releasing an old lease does not touch the current one.
    s.release(&b).await.unwrap();
    assert_eq!(s.renew(&c, TTL).await.unwrap().epoch, c.epoch);

    // Leases are per run.
    let other = s
        .acquire(&unique("fence-other"), "worker-a", TTL)
        .await
        .unwrap();
    assert_eq!(other.epoch, 1);
    assert_eq!(s.lease(&unique("never-leased")).await.unwrap(), None);
    assert_eq!(s.last_kind(&run).await.unwrap(), Some(r2.kind));
    assert_eq!(s.last_kind(&unique("empty")).await.unwrap(), None);
    assert_eq!(s.read_all(&run).await.unwrap().len(), 3);
    ctx.done().await;
}

async fn gaps_and_prev_hash(ctx: Ctx) {
    let s = ctx.store.clone();
    let run = unique("gaps");
    let lease = s.acquire(&run, "w", TTL).await.unwrap();

    // Seq 0 must link to the zero hash.
    let bogus_head = Head {
        len: 0,
        hash: Hash([9; 32]),
    };
    let bad0 = rec(&bogus_head, 0, "w");
    assert!(matches!(
        s.append(&run, lease.epoch, &bad0).await,
        Err(StoreError::PrevHashMismatch { seq: 0, .. })
    ));
    let log = append_n(s.as_ref(), &run, lease.epoch, 3).await;
    let head = log[2].head();

    // A gap.
    let ahead = rec(
        &Head {
            len: 5,
            hash: head.hash,
        },
        5,
        "w",
    );
    match s.append(&run, lease.epoch, &ahead).await {
        Err(StoreError::Gap { seq, len, .. }) => assert_eq!((seq, len), (5, 3)),
        other => panic!("expected Gap, got {other:?}"),
    }
    // The right seq, linked to the wrong record.
    let misl = rec(
        &Head {
            len: 3,
            hash: log[0].hash,
        },
        3,
        "w",
    );
    match s.append(&run, lease.epoch, &misl).await {
        Err(StoreError::PrevHashMismatch {
            seq, expected, got, ..
        }) => {
            assert_eq!(seq, 3);
            assert_eq!(expected, head.hash);
            assert_eq!(got, log[0].hash);
        }
        other => panic!("expected PrevHashMismatch, got {other:?}"),
    }
    // A record whose hash does not match its content.
    let mut forged = rec(&head, 3, "w");
    forged.payload = json!({"forged": true});
    assert_eq!(
        s.append(&run, lease.epoch, &forged)
            .await
            .unwrap_err()
            .metric_label(),
        "invalid_record"
    );
    // Nothing was written by any of them.
    assert_eq!(s.head(&run).await.unwrap(), head);

    // Ranges and heads.
    let mid = s.read_range(&run, 1, Some(2)).await.unwrap();
    assert_eq!(mid.len(), 1);
    assert!(mid[0].same_as(&log[1]));
    assert_eq!(s.read_range(&run, 2, None).await.unwrap().len(), 1);
    assert!(s.read_all(&unique("nothing")).await.unwrap().is_empty());
    assert_eq!(s.head(&unique("nothing")).await.unwrap(), Head::EMPTY);
    let all = s.read_all(&run).await.unwrap();
    for (a, b) in all.iter().zip(&log) {
        assert!(a.same_as(b));
        assert_eq!(a.created_at, b.created_at);
        assert!(a.created_at.is_some());
    }
    ctx.done().await;
}

async fn tamper_detection(ctx: Ctx) {
    let s = ctx.store.clone();
    let run = unique("tamper");
    let lease = s.acquire(&run, "w", TTL).await.unwrap();
    let log = append_n(s.as_ref(), &run, lease.epoch, 6).await;
    let head = log[5].head();
    assert_eq!(s.verify(&run, Some(&head.hash)).await.unwrap(), head);
    let replayed = s.read_verified(&run, Some(&head.hash)).await.unwrap();
    assert_eq!(replayed.len(), 6);
    for (a, b) in replayed.iter().zip(&log) {
        assert!(a.same_as(b));
        assert_eq!(a.created_at, b.created_at);
    }
    store::admin::run(
        &ctx.url,
        store::admin::StoreCommand::Verify {
            run: run.clone(),
            head: Some(head.hash.to_hex()),
        },
    )
    .await
    .expect("cli verify of an intact log");

    // The application's own credentials cannot change or remove a step.
    let e = ctx
        .try_as_writer(&format!(
            "UPDATE agentrun_steps SET body = replace(body, '\"i\":3', '\"i\":33') WHERE run = '{run}' AND seq = 3"
        ))
        .await
        .unwrap_err();
    assert!(
        e.contains("append-only") || e.contains("permission denied"),
        "{e}"
    );
    let e = ctx
        .try_as_writer(&format!(
            "DELETE FROM agentrun_steps WHERE run = '{run}' AND seq = 5"
        ))
        .await
        .unwrap_err();
    assert!(
        e.contains("append-only") || e.contains("permission denied"),
        "{e}"
    );
    assert_eq!(s.verify(&run, Some(&head.hash)).await.unwrap(), head);

    // A superuser alters seq 3 behind the triggers: verify names seq 3.
    ctx.tamper(&format!(
        "UPDATE agentrun_steps SET body = replace(body, '\"i\":3', '\"i\":33') WHERE run = '{run}' AND seq = 3"
    ))
    .await;
    match s.verify(&run, None).await {
        Err(StoreError::ChainBroken { seq, reason, .. }) => {
            assert_eq!(seq, 3, "{reason}");
            assert!(reason.contains("altered"), "{reason}");
        }
        other => panic!("expected ChainBroken at 3, got {other:?}"),
    }
    // Replay refuses it too, and re-encoding in memory agrees on the seq.
    assert!(matches!(
        s.read_verified(&run, None).await,
        Err(StoreError::ChainBroken { seq: 3, .. })
    ));
    let all = s.read_all(&run).await.unwrap();
    assert!(matches!(
        store::verify_chain(&run, &all, None),
        Err(StoreError::ChainBroken { seq: 3, .. })
    ));
    let cli = store::admin::run(
        &ctx.url,
        store::admin::StoreCommand::Verify {
            run: run.clone(),
            head: None,
        },
    )
    .await
    .unwrap_err();
    assert!(cli.to_string().contains("at seq 3"), "{cli}");

    // ... and re-hashes it to cover the trace: the next seq no longer links.
    let altered = s.read_range(&run, 3, Some(4)).await.unwrap().remove(0);
    let rehash = altered.compute_hash();
    let hex = rehash.to_hex();
    let set_hash = match &ctx.kind {
        Kind::Pg { .. } => format!("decode('{hex}', 'hex')"),
        Kind::Sqlite { .. } => format!("X'{hex}'"),
    };
    ctx.tamper(&format!(
        "UPDATE agentrun_steps SET hash = {set_hash} WHERE run = '{run}' AND seq = 3"
    ))
    .await;
    match s.verify(&run, None).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 4),
        other => panic!("expected ChainBroken at 4, got {other:?}"),
    }

    // A clean log with its last record removed: only the recorded head shows it.
    let run2 = unique("truncate");
    let lease2 = s.acquire(&run2, "w", TTL).await.unwrap();
    let log2 = append_n(s.as_ref(), &run2, lease2.epoch, 4).await;
    ctx.tamper(&format!(
        "DELETE FROM agentrun_steps WHERE run = '{run2}' AND seq = 3"
    ))
    .await;
    assert_eq!(s.verify(&run2, None).await.unwrap(), log2[2].head());
    match s.verify(&run2, Some(&log2[3].hash)).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 3),
        other => panic!("expected ChainBroken at 3, got {other:?}"),
    }
    // An unreadable body is reported at its seq too.
    ctx.tamper(&format!(
        "UPDATE agentrun_steps SET body = 'not json' WHERE run = '{run2}' AND seq = 1"
    ))
    .await;
    match s.verify(&run2, None).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 1),
        other => panic!("expected ChainBroken at 1, got {other:?}"),
    }
    assert_eq!(log.len(), 6);
    ctx.done().await;
}

/// The bytes stored are the evidence (issue 39): a body respelled behind
/// the store's back (a field added, keys reordered, spacing) is an altered
/// record at its seq for every reader, even where the superuser hashed the
/// new bytes (the log's tail, past every anchor), and the bytes are handed
/// on exactly as stored.
async fn respelled_bodies(ctx: Ctx) {
    let s = ctx.store.clone();
    let respell = [
        (
            "a field added",
            "substr(body, 1, 1) || '\"tampered\":true,' || substr(body, 2)",
        ),
        (
            "keys reordered",
            "replace(body, '{\"format\":1,\"kind\":\"Observation\",', '{\"kind\":\"Observation\",\"format\":1,')",
        ),
        ("spacing", "replace(body, ',', ', ')"),
    ];
    for (how, sql) in respell {
        for rehashed in [false, true] {
            let run = unique("respelled");
            let lease = s.acquire(&run, "w", TTL).await.unwrap();
            let log = append_n(s.as_ref(), &run, lease.epoch, 4).await;
            // The last record (nothing links to it), as the superuser.
            ctx.tamper(&format!(
                "UPDATE agentrun_steps SET body = {sql} WHERE run = '{run}' AND seq = 3"
            ))
            .await;
            let stored = s.read_stored(&run, 3, None).await.unwrap().remove(0);
            assert_ne!(
                stored.body.as_bytes(),
                log[3].canonical_bytes(),
                "{how}: the body was respelled"
            );
            if rehashed {
                let hex = store::chain_hash(&log[2].hash, stored.body.as_bytes()).to_hex();
                let set_hash = match &ctx.kind {
                    Kind::Pg { .. } => format!("decode('{hex}', 'hex')"),
                    Kind::Sqlite { .. } => format!("X'{hex}'"),
                };
                ctx.tamper(&format!(
                    "UPDATE agentrun_steps SET hash = {set_hash} WHERE run = '{run}' AND seq = 3"
                ))
                .await;
            }
            let what = format!("{how} (hash recomputed: {rehashed})");
            match s.read_verified(&run, None).await {
                Err(StoreError::ChainBroken { seq: 3, reason, .. }) => {
                    assert!(reason.contains("altered"), "{what}: {reason}")
                }
                other => panic!("{what}: expected ChainBroken at 3, got {other:?}"),
            }
            match s.read_verified_after(&run, &log[1].head()).await {
                Err(StoreError::ChainBroken { seq: 3, .. }) => {}
                other => panic!("{what}: read on from seq 2: {other:?}"),
            }
            if !rehashed {
                // Decoded, the bytes are refused whatever their hash.
                match s.read_range(&run, 0, None).await {
                    Err(StoreError::Corrupt { seq: 3, reason, .. }) => {
                        assert!(
                            reason.contains("not the canonical form"),
                            "{what}: {reason}"
                        )
                    }
                    other => panic!("{what}: read_range: {other:?}"),
                }
            }
            // As stored: byte for byte, for readers who verify them.
            let again = s.read_stored(&run, 0, None).await.unwrap();
            assert_eq!(again.len(), 4, "{what}");
            assert_eq!(again[3].body, stored.body, "{what}");
            for (a, b) in again[..3].iter().zip(&log) {
                assert_eq!(a.body.as_bytes(), b.canonical_bytes(), "{what}");
            }
        }
    }
    ctx.done().await;
}

/// What the controller reads to scale: a lease released is told apart
/// from one that lapsed, lapsed leases are listed in one query, and a log
/// is read on from a verified head (a wrong base is refused).
async fn released_lapsed_and_incremental(ctx: Ctx) {
    let s = &*ctx.store;
    let run = unique("scale");
    let lease = s.acquire(&run, "pod-a", TTL).await.unwrap();
    let all = append_n(s, &run, lease.epoch, 5).await;
    let base = all[2].head();
    let after = s.read_verified_after(&run, &base).await.unwrap();
    assert_eq!(
        after.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![3, 4],
        "only the records past the base"
    );
    let end = all[4].head();
    assert!(s.read_verified_after(&run, &end).await.unwrap().is_empty());
    // A base that is not the log's (another hash at that length) is refused.
    let forged = Head {
        len: 3,
        hash: all[0].hash,
    };
    match s.read_verified_after(&run, &forged).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 3),
        other => panic!("expected ChainBroken at 3, got {other:?}"),
    }

    // Released: expired and released. Lapsed: expired, not released, and listed.
    s.release(&lease).await.unwrap();
    let state = s.lease(&run).await.unwrap().unwrap();
    assert!(state.expired && state.released, "{state:?}");
    let other = unique("scale-lapsed");
    let since = chrono::Utc::now() - chrono::Duration::seconds(5);
    let short = s
        .acquire(&other, "pod-b", Duration::from_millis(200))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let state = s.lease(&other).await.unwrap().unwrap();
    assert!(state.expired && !state.released, "{state:?}");
    let (lapsed, now) = s.lapsed_leases(since).await.unwrap();
    assert!(lapsed.contains(&other), "{lapsed:?}");
    assert!(
        !lapsed.contains(&run),
        "a released lease is not lapsed: {lapsed:?}"
    );
    // Listed once: the next sweep starts where this one ended.
    let (again, _) = s.lapsed_leases(now).await.unwrap();
    assert!(!again.contains(&other), "{again:?}");
    // A late heartbeat revives it, a new holder clears `released`.
    s.renew(&short, TTL).await.unwrap();
    assert!(!s.lease(&other).await.unwrap().unwrap().expired);
    let next = s.acquire(&run, "pod-c", TTL).await.unwrap();
    let state = s.lease(&run).await.unwrap().unwrap();
    assert!(!state.expired && !state.released && state.epoch == next.epoch);
    ctx.done().await;
}

/// A page holds the records whose bodies come to at most the bytes asked
/// for (the first one whatever its size), so a log of large records is
/// read a few at a time; a whole log read through pages is the log.
async fn pages_by_bytes(ctx: Ctx) {
    let s = &*ctx.store;
    let run = unique("pages");
    let lease = s.acquire(&run, "pod-a", TTL).await.unwrap();
    let mb = 1 << 20;
    let mut head = Head::EMPTY;
    for (i, size) in [mb, mb, 3 * mb, mb, 10].into_iter().enumerate() {
        let r = draft(
            StepKind::ToolResult,
            json!({"i": i, "text": "é".repeat(size / 2)}),
            "pod-a",
        )
        .seal(&head)
        .unwrap();
        head = s.append(&run, lease.epoch, &r).await.unwrap().head();
    }
    let seqs =
        |page: Vec<agentrun::store::StoredRecord>| page.iter().map(|r| r.seq).collect::<Vec<_>>();
    // Bytes, not characters: two records of 1 MiB of two-byte characters.
    let page = s
        .read_stored_page(&run, 0, None, 2 * mb + 4096)
        .await
        .unwrap();
    assert_eq!(seqs(page), [0, 1]);
    let page = s.read_stored_page(&run, 2, None, 2 * mb).await.unwrap();
    assert_eq!(
        seqs(page),
        [2],
        "one record over the page is a page of its own"
    );
    let page = s.read_stored_page(&run, 3, None, 2 * mb).await.unwrap();
    assert_eq!(seqs(page), [3, 4]);
    let page = s.read_stored_page(&run, 3, Some(4), 2 * mb).await.unwrap();
    assert_eq!(seqs(page), [3]);
    assert!(
        s.read_stored_page(&run, 5, None, mb)
            .await
            .unwrap()
            .is_empty()
    );
    let whole = s.read_verified(&run, Some(&head.hash)).await.unwrap();
    assert_eq!(whole.len(), 5);
    ctx.done().await;
}

/// A fork's copy against the backend (DESIGN.md "Forks"): the parent's
/// verified prefix and `Forked` under the fork's lease with the writer's
/// own credentials, written once however often it is asked, and nothing
/// copied from a parent altered behind the store.
async fn forks(ctx: Ctx) {
    use agentrun::fork::{ForkError, ForkPoint, check_prefix, copy_prefix, origin, read_parent};
    use agentrun::store::{RecordSigner, SignatureRules};
    let s = ctx.store.clone();
    let signer = RecordSigner::from_seed(&[5; 32]);
    let parent = unique("parent");
    let lease = s.acquire(&parent, "controller", TTL).await.unwrap();
    let mut head = Head::EMPTY;
    for i in 0..6 {
        let kind = if i == 0 {
            StepKind::RunStarted
        } else {
            StepKind::Observation
        };
        let record = signer
            .seal(&parent, draft(kind, json!({"i": i}), "pod-a"), &head)
            .unwrap();
        head = s
            .append(&parent, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    s.release(&lease).await.unwrap();
    let copy = |fork: String| {
        let (s, parent) = (s.clone(), parent.clone());
        async move {
            let signer = RecordSigner::from_seed(&[5; 32]);
            let records = read_parent(
                s.as_ref(),
                &signer.verifier(),
                &parent,
                Some(&head),
                &SignatureRules::STRICT,
            )
            .await?;
            let point = ForkPoint {
                parent_uid: parent.clone(),
                parent_name: "refund-1".into(),
                seq: 3,
                requester: Some("alice".into()),
                agent: None,
                test: None,
                budget: Default::default(),
                replace: None,
            };
            copy_prefix(s.as_ref(), &signer, &fork, &records, &point, "controller").await
        }
    };
    let fork = unique("fork");
    let forked = copy(fork.clone()).await.unwrap();
    assert_eq!(forked.len, 5, "seqs 0..=3 and Forked");
    assert_eq!(copy(fork.clone()).await.unwrap(), forked, "copied once");
    let records = s.read_verified(&fork, Some(&forked.hash)).await.unwrap();
    signer
        .verifier()
        .check(&fork, &records, &SignatureRules::STRICT)
        .unwrap();
    let at = origin(&records)
        .unwrap()
        .expect("the fork names its parent");
    assert_eq!(at.at, 4);
    let parent_log = s.read_verified(&parent, None).await.unwrap();
    check_prefix(&records, &at, &parent_log).unwrap();
    assert_eq!(
        s.head(&parent).await.unwrap(),
        head,
        "the parent is unchanged"
    );

    // A superuser alters the parent's seq 2: no second fork is made of it.
    ctx.tamper(&format!(
        "UPDATE agentrun_steps SET body = replace(body, '\"i\":2', '\"i\":22') WHERE run = '{parent}' AND seq = 2"
    ))
    .await;
    let refused = unique("fork");
    match copy(refused.clone()).await {
        Err(ForkError::ParentUnverified(StoreError::ChainBroken { seq, .. })) => assert_eq!(seq, 2),
        other => panic!("a fork of an altered parent: {other:?}"),
    }
    assert!(
        s.read_all(&refused).await.unwrap().is_empty(),
        "nothing copied"
    );
    ctx.done().await;
}

macro_rules! suite {
    ($module:ident, $ctx:ident) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn race_tasks_first_writer_wins() {
                race_tasks($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn race_processes_first_writer_wins() {
                // The two racing processes are this same test, re-run as children.
                if let Ok(url) = std::env::var("AGENTRUN_STORE_RACE_URL") {
                    return race_child_main(url).await;
                }
                let this = concat!(stringify!($module), "::race_processes_first_writer_wins");
                race_processes($ctx().await, this).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fencing_and_takeover() {
                super::fencing_and_takeover($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn gaps_and_prev_hash() {
                super::gaps_and_prev_hash($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tamper_detection() {
                super::tamper_detection($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn respelled_bodies() {
                super::respelled_bodies($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pages_by_bytes() {
                super::pages_by_bytes($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn forks() {
                super::forks($ctx().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn released_lapsed_and_incremental() {
                super::released_lapsed_and_incremental($ctx().await).await;
            }
        }
    };
}

suite!(store_postgres, pg_ctx);
suite!(store_sqlite, sqlite_ctx);

// ---------------------------------------------------------------------------
// PostgreSQL only: roles, trigger, migrations, outage

/// Appends and releases are announced to a listener (PostgreSQL
/// `LISTEN/NOTIFY`), by whichever login wrote them; the first event is a
/// resync (nothing before the listener is known), renewals say nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_postgres_announces_heads() {
    use agentrun::store::HeadEvent;
    let ctx = pg_ctx().await;
    let s = &*ctx.store;
    let mut events = s
        .head_events()
        .await
        .unwrap()
        .expect("PostgreSQL pushes heads");
    async fn next(events: &mut tokio::sync::mpsc::Receiver<HeadEvent>) -> HeadEvent {
        tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("an event within 10 s")
            .expect("the listener runs")
    }
    assert_eq!(next(&mut events).await, HeadEvent::Resync);
    let run = unique("announce");
    let lease = s.acquire(&run, "pod-a", TTL).await.unwrap();
    s.renew(&lease, TTL).await.unwrap();
    append_n(s, &run, lease.epoch, 2).await;
    assert_eq!(next(&mut events).await, HeadEvent::Changed(run.clone()));
    assert_eq!(next(&mut events).await, HeadEvent::Changed(run.clone()));
    s.release(&lease).await.unwrap();
    assert_eq!(next(&mut events).await, HeadEvent::Changed(run.clone()));
    // Nothing else was announced (the acquire and the renewal were not).
    assert!(
        tokio::time::timeout(Duration::from_millis(300), events.recv())
            .await
            .is_err()
    );
    drop(events);
    ctx.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_postgres_roles_and_trigger() {
    let admin = pg_admin_url().to_string();
    let (db_admin, writer_url, db, writer_user) = pg_database(&admin, "roles").await;
    let retention_user = format!("r_{db}");
    admin_exec(
        &db_admin,
        &format!("CREATE ROLE {retention_user} LOGIN PASSWORD 'ret' IN ROLE agentrun_retention"),
    )
    .await;
    let retention_url = with_user(&db_admin, &retention_user, "ret");

    let writer = store::open(&writer_url).await.unwrap();
    let run = unique("roles");
    let lease = writer.acquire(&run, "w", TTL).await.unwrap();
    let log = append_n(writer.as_ref(), &run, lease.epoch, 3).await;

    // Privileges as granted: the writer has INSERT and SELECT only.
    let mut su = sqlx::PgConnection::connect(&db_admin).await.unwrap();
    let privs: Vec<(String, bool)> = sqlx::query_as(
        "SELECT p, has_table_privilege($1, 'agentrun_steps', p) \
         FROM unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE']) p",
    )
    .bind(&writer_user)
    .fetch_all(&mut su)
    .await
    .unwrap();
    let granted: Vec<&str> = privs.iter().filter(|p| p.1).map(|p| p.0.as_str()).collect();
    assert_eq!(granted, ["SELECT", "INSERT"]);

    // The writer login cannot UPDATE, DELETE or TRUNCATE a step.
    let mut w = sqlx::PgConnection::connect(&writer_url).await.unwrap();
    for sql in [
        format!("UPDATE agentrun_steps SET kind = 'Summary' WHERE run = '{run}'"),
        format!("DELETE FROM agentrun_steps WHERE run = '{run}'"),
        "TRUNCATE agentrun_steps".to_string(),
    ] {
        let e = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut w)
            .await
            .unwrap_err();
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.to_string());
        assert_eq!(code.as_deref(), Some("42501"), "{sql}: {e}");
    }
    w.close().await.ok();

    // Not even a superuser, while the trigger is on.
    for sql in [
        format!("UPDATE agentrun_steps SET kind = 'Summary' WHERE run = '{run}'"),
        format!("DELETE FROM agentrun_steps WHERE run = '{run}' AND seq = 2"),
        "TRUNCATE agentrun_steps".to_string(),
    ] {
        let e = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut su)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("append-only"), "{sql}: {e}");
    }
    assert_eq!(writer.read_all(&run).await.unwrap().len(), 3);

    // The retention role may delete (whole runs, by policy).
    let mut r = sqlx::PgConnection::connect(&retention_url).await.unwrap();
    let deleted = sqlx::query("DELETE FROM agentrun_steps WHERE run = $1 AND seq = 2")
        .bind(&run)
        .execute(&mut r)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    // ... but not rewrite.
    assert!(
        sqlx::query("UPDATE agentrun_steps SET kind = 'Summary' WHERE run = $1")
            .bind(&run)
            .execute(&mut r)
            .await
            .is_err()
    );
    r.close().await.ok();
    match writer.verify(&run, Some(&log[2].hash)).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 2),
        other => panic!("expected ChainBroken at 2, got {other:?}"),
    }

    // A superuser rewriting a row with the trigger disabled is caught at that seq.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE agentrun_steps DISABLE TRIGGER agentrun_steps_append_only;
         UPDATE agentrun_steps SET body = replace(body, '\"i\":1', '\"i\":100') WHERE run = '{run}' AND seq = 1;
         ALTER TABLE agentrun_steps ENABLE TRIGGER agentrun_steps_append_only;"
    )))
    .execute(&mut su)
    .await
    .unwrap();
    match writer.verify(&run, None).await {
        Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 1),
        other => panic!("expected ChainBroken at 1, got {other:?}"),
    }
    // The writer cannot migrate (create roles / tables).
    let e = writer.migrate().await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    su.close().await.ok();
    writer.close().await;
    pg_drop(&admin, &db, &[&writer_user, &retention_user]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_postgres_migrate_concurrently_and_idempotently() {
    let admin = pg_admin_url().to_string();
    let dbs: Vec<String> = (0..3).map(|_| unique("agentrun_t_mig")).collect();
    for db in &dbs {
        admin_exec(&admin, &format!("CREATE DATABASE {db}")).await;
    }
    // Three databases (roles are cluster-wide: created once, raced) and the
    // same database twice at once (advisory lock).
    let mut tasks = Vec::new();
    for db in dbs.iter().chain(dbs.iter().take(1)) {
        let url = with_db(&admin, db);
        tasks.push(tokio::spawn(async move {
            let s = store::open(&url).await.unwrap();
            s.migrate().await.unwrap();
            s.migrate().await.unwrap();
            s.close().await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut c = sqlx::PgConnection::connect(&with_db(&admin, &dbs[0]))
        .await
        .unwrap();
    let (applied,): (i64,) = sqlx::query_as("SELECT count(*) FROM agentrun_store_migrations")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(applied, 3, "each of the 3 migrations recorded once");
    let (roles,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_roles WHERE rolname IN ('agentrun_writer', 'agentrun_retention') AND NOT rolcanlogin",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(roles, 2);
    c.close().await.ok();
    for db in &dbs {
        pg_drop(&admin, db, &[]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_postgres_unreachable_is_retryable_with_redacted_url() {
    // Nothing listens on this port.
    let url = "postgres://writer:very-s3cret@127.0.0.1:1/agentrun";
    let opts = OpenOptions {
        acquire_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let e = store::open_with(url, &opts).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    assert_eq!(e.metric_label(), "unavailable");
    let msg = e.to_string();
    assert!(
        msg.contains("postgres://writer:***@127.0.0.1:1/agentrun"),
        "{msg}"
    );
    assert!(
        !msg.contains("very-s3cret") && !format!("{e:?}").contains("very-s3cret"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_postgres_outage_then_exactly_once() {
    // Its own instance: stopping it does not disturb the other tests.
    let inst = Some(OUTAGE_INSTANCE);
    e2e_postgres(inst, "up");
    let admin = e2e_postgres(inst, "url");
    let (db_admin, _, db, user) = pg_database(&admin, "outage").await;
    let password = "outage-pa55word";
    admin_exec(
        &db_admin,
        &format!("ALTER ROLE {user} PASSWORD '{password}'"),
    )
    .await;
    let url = with_user(&db_admin, &user, password);
    let opts = OpenOptions {
        acquire_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let s = store::open_with(&url, &opts).await.unwrap();
    let run = unique("outage");
    let lease = s.acquire(&run, "w", TTL).await.unwrap();
    let r0 = rec(&Head::EMPTY, 0, "w");
    s.append(&run, lease.epoch, &r0).await.unwrap();
    let r1 = rec(&r0.head(), 1, "w");

    e2e_postgres(inst, "stop");
    for attempt in 0..2 {
        let e = s.append(&run, lease.epoch, &r1).await.unwrap_err();
        assert!(e.is_retryable(), "attempt {attempt}: {e:?}");
        assert_eq!(e.metric_label(), "unavailable");
        let msg = e.to_string();
        assert!(msg.contains(&store::redact_url(&url)), "{msg}");
        assert!(msg.contains(":***@127.0.0.1:25433/"), "{msg}");
        assert!(
            !msg.contains(password) && !format!("{e:?}").contains(password),
            "{msg}"
        );
    }
    assert!(s.head(&run).await.unwrap_err().is_retryable());

    e2e_postgres(inst, "start");
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        match s.append(&run, lease.epoch, &r1).await {
            Ok(r) => break r,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("append after restart: {e:?}"),
        }
    };
    assert!(stored.same_as(&r1));
    // Exactly once: one record at seq 1, and a further retry returns it unchanged.
    let again = s.append(&run, lease.epoch, &r1).await.unwrap();
    assert_eq!(again.created_at, stored.created_at);
    let log = s.read_all(&run).await.unwrap();
    assert_eq!(log.len(), 2);
    assert!(log[1].same_as(&r1));
    assert_eq!(log[1].created_at, stored.created_at);
    s.verify(&run, Some(&r1.hash)).await.unwrap();
    s.close().await;
    pg_drop(&admin, &db, &[&user]).await;
    e2e_postgres(inst, "down");
}

// ---------------------------------------------------------------------------
// Embedded backend specifics

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_sqlite_file_url_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.db");
    let s = store::open(&format!("file://{}", path.display()))
        .await
        .unwrap();
    let run = unique("reopen");
    let lease = s.acquire(&run, "w", TTL).await.unwrap();
    let log = append_n(s.as_ref(), &run, lease.epoch, 3).await;
    s.close().await;
    // Reopened under the other URL form: same log, same lease, migrate again harmless.
    let s = store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    s.migrate().await.unwrap();
    assert_eq!(
        s.verify(&run, Some(&log[2].hash)).await.unwrap(),
        log[2].head()
    );
    let r3 = rec(&log[2].head(), 3, "w");
    s.append(&run, lease.epoch, &r3).await.unwrap();
    assert_eq!(s.head(&run).await.unwrap(), r3.head());
    s.close().await;
}
