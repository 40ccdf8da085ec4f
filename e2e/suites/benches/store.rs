//! Step store benchmarks (run by `bash e2e/bench`, or `cargo bench --bench store`).
//!
//! Prints one line per figure: `bench: <name> <value> <unit>`.
//! - store.<backend>.append.c<N>: appends/s with N runs appending concurrently
//!   (each run: its own lease, a sequential hash chain), and .p50/.p99 latency;
//! - store.<backend>.replay.<size>: read + decode + verify (`read_verified`) of one run's log, steps/s;
//! - store.verify_chain_reencode.100k: `verify_chain` in memory (re-encodes every record canonically);
//! - store.gateway.append.c<N>: the same appends through the step-log gateway
//!   (PostgreSQL behind it), each run with its own token, and the ratio to
//!   direct appends measured in the same run;
//! - store.gateway.renew.under_load.p50/.p99: a heartbeat's latency through
//!   the gateway while 64 runs append through it.
//!
//! PostgreSQL comes from `e2e/postgres` (started if needed). Environment:
//! AGENTRUN_BENCH_SECONDS (per append figure, default 4), AGENTRUN_BENCH_POOL
//! (PostgreSQL pool size, default 8: two cores here).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun::store::{
    self, Head, OpenOptions, Record, RecordDraft, StepKind, StepStore, Usage, Versions, Worker,
    verify_chain,
};
use serde_json::json;
use sqlx::Connection;

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn e2e_postgres(arg: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../postgres");
    let out = Command::new("bash")
        .arg(&script)
        .arg(arg)
        .output()
        .expect("run e2e/postgres");
    assert!(
        out.status.success(),
        "e2e/postgres {arg} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn figure(name: &str, value: f64, unit: &str) {
    let v = if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    };
    println!("bench: {name} {v} {unit}");
}

fn draft(i: u64, pod: &str) -> RecordDraft {
    RecordDraft {
        format: agentrun::store::FORMAT_1,
        kind: if i.is_multiple_of(2) {
            StepKind::ModelCall
        } else {
            StepKind::ToolResult
        },
        payload: json!({
            "response": {"text": "Looking up the order before deciding on a refund.",
                         "toolCalls": [{"name": "lookup_order", "arguments": {"orderId": format!("ord-{i}"), "include": ["items", "payments"]}}]},
            "stopReason": "tool_use",
            "step": i
        }),
        versions: Versions {
            prompt_version: Some("v7".into()),
            prompt_hash: Some("3f2a9c".into()),
            model_id: Some("model-2025-01-01".into()),
            tool_schema_hash: Some("9ab1e0".into()),
        },
        usage: Usage {
            input_tokens: 1200 + i % 100,
            output_tokens: 80,
            cost_micros: 3100,
        },
        worker: Worker {
            pod: pod.to_string(),
            attempt: 1,
        },
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx].as_secs_f64() * 1000.0
}

/// Appends/s with `c` runs appending concurrently for `seconds`, each run
/// through the store `store_for(run)` gives; (appends/s, sorted latencies).
async fn appends<F>(store_for: &F, prefix: &str, c: usize, seconds: f64) -> (f64, Vec<Duration>)
where
    F: Fn(&str) -> Arc<dyn StepStore>,
{
    let warmup = Duration::from_millis(500);
    let measure = Duration::from_secs_f64(seconds);
    let start = Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for t in 0..c {
        let run = format!("{prefix}-{t}");
        let store = store_for(&run);
        tasks.push(tokio::spawn(async move {
            let lease = store
                .acquire(&run, "bench", Duration::from_secs(300))
                .await
                .expect("acquire");
            tokio::time::sleep_until(start.into()).await;
            let measure_from = start + warmup;
            let end = measure_from + measure;
            let mut head = Head::EMPTY;
            let mut lat = Vec::new();
            let mut i = 0u64;
            loop {
                let rec = draft(i, "bench-pod").seal(&head).expect("seal");
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let stored = store.append(&run, lease.epoch, &rec).await.expect("append");
                let t1 = Instant::now();
                if t0 >= measure_from {
                    lat.push(t1 - t0);
                }
                head = stored.head();
                i += 1;
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    (all.len() as f64 / measure.as_secs_f64(), all)
}

/// The gateway in front of `url`, over HTTP on a local port, and a client
/// store per run (each with that run's own token).
async fn gateway_figures(url: &str, seconds: f64, direct: &[(usize, f64)]) {
    use agentrun::controller::servers::gateway::{Gateway, serve};
    use agentrun::controller::servers::run_index::RunIndex;
    use agentrun::keys::step_token::TokenKey;
    let behind = store::open_with(
        url,
        &OpenOptions {
            max_connections: 8,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let key = TokenKey::new(&[7u8; 32]).unwrap();
    let prefix = format!("bench-{}-gw", std::process::id());
    let mut live: Vec<String> = (0..64)
        .flat_map(|t| ["c1", "c8", "c64", "load"].map(|c| format!("{prefix}-{c}-{t}")))
        .collect();
    live.push(format!("{prefix}-hb"));
    let gw = Gateway::new(behind, key.clone(), RunIndex::with_live(live));
    let minting = key.clone();
    let limits = agentrun::controller::servers::gateway::GatewayLimits::default().server;
    let addr = serve("127.0.0.1:0".parse().unwrap(), gw, limits)
        .await
        .unwrap();
    let store_for = move |run: &str| -> Arc<dyn StepStore> {
        Arc::new(
            store::RemoteStore::new(
                &format!("http://{addr}"),
                &minting.mint(run),
                Duration::from_secs(30),
            )
            .unwrap(),
        )
    };
    for &(c, direct_rate) in direct {
        let (rate, lat) = appends(&store_for, &format!("{prefix}-c{c}"), c, seconds).await;
        figure(&format!("store.gateway.append.c{c}"), rate, "appends/s");
        figure(
            &format!("store.gateway.append.c{c}.p50"),
            pct(&lat, 0.50),
            "ms",
        );
        figure(
            &format!("store.gateway.append.c{c}.p99"),
            pct(&lat, 0.99),
            "ms",
        );
        figure(
            &format!("store.gateway.append.c{c}.vs_direct"),
            rate / direct_rate,
            "ratio",
        );
    }
    // Heartbeats while 64 runs append through the same gateway.
    let hb_run = format!("{prefix}-hb");
    let hb = store_for(&hb_run);
    let load = tokio::spawn({
        let prefix = format!("{prefix}-load");
        let store_for = store_for.clone();
        async move { appends(&store_for, &prefix, 64, seconds).await }
    });
    let mut lease = hb
        .acquire(&hb_run, "bench", Duration::from_secs(300))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut lat = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        let t0 = Instant::now();
        lease = hb.renew(&lease, Duration::from_secs(300)).await.unwrap();
        lat.push(t0.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    load.await.unwrap();
    lat.sort();
    figure("store.gateway.renew.under_load.p50", pct(&lat, 0.50), "ms");
    figure("store.gateway.renew.under_load.p99", pct(&lat, 0.99), "ms");
}

async fn append_figures(
    store: Arc<dyn StepStore>,
    backend: &str,
    seconds: f64,
) -> Vec<(usize, f64)> {
    let mut rates = Vec::new();
    for c in [1usize, 8, 64] {
        let prefix = format!("bench-{}-{backend}-c{c}", std::process::id());
        let (rate, all) = appends(&|_: &str| store.clone(), &prefix, c, seconds).await;
        rates.push((c, rate));
        figure(&format!("store.{backend}.append.c{c}"), rate, "appends/s");
        figure(
            &format!("store.{backend}.append.c{c}.p50"),
            pct(&all, 0.50),
            "ms",
        );
        figure(
            &format!("store.{backend}.append.c{c}.p99"),
            pct(&all, 0.99),
            "ms",
        );
    }
    rates
}

/// A valid chain of `n` records, generated in memory.
fn chain(n: u64) -> Vec<Record> {
    let mut head = Head::EMPTY;
    (0..n)
        .map(|i| {
            let r = draft(i, "bench-pod").seal(&head).unwrap();
            head = r.head();
            r
        })
        .collect()
}

async fn replay_figures(store: &dyn StepStore, backend: &str, runs: &[(&str, String)]) {
    for (size, run) in runs {
        let mut rates = Vec::new();
        for _ in 0..3 {
            let t0 = Instant::now();
            let records = store
                .read_verified(run, None)
                .await
                .expect("read and verify");
            let dt = t0.elapsed().as_secs_f64();
            assert!(records.len() >= 10_000);
            rates.push(records.len() as f64 / dt);
        }
        rates.sort_by(|a, b| a.partial_cmp(b).unwrap());
        figure(
            &format!("store.{backend}.replay.{size}"),
            rates[1],
            "steps/s",
        );
    }
}

/// Load a run's log directly (the bench measures replay, not loading).
async fn pg_load(url: &str, run: &str, records: &[Record]) {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    for chunk in records.chunks(5000) {
        let seqs: Vec<i64> = chunk.iter().map(|r| r.seq as i64).collect();
        let kinds: Vec<&str> = chunk.iter().map(|r| r.kind.as_str()).collect();
        let prevs: Vec<Vec<u8>> = chunk.iter().map(|r| r.prev_hash.0.to_vec()).collect();
        let hashes: Vec<Vec<u8>> = chunk.iter().map(|r| r.hash.0.to_vec()).collect();
        let bodies: Vec<String> = chunk
            .iter()
            .map(|r| String::from_utf8(r.canonical_bytes()).unwrap())
            .collect();
        sqlx::query(
            "INSERT INTO agentrun_steps (run, seq, format, kind, prev_hash, hash, body, epoch) \
             SELECT $1, s, 1, k, p, h, b, 1 FROM unnest($2::bigint[], $3::text[], $4::bytea[], $5::bytea[], $6::text[]) AS t(s, k, p, h, b)",
        )
        .bind(run)
        .bind(&seqs)
        .bind(&kinds)
        .bind(&prevs)
        .bind(&hashes)
        .bind(&bodies)
        .execute(&mut c)
        .await
        .unwrap();
    }
    sqlx::query("ANALYZE agentrun_steps")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.ok();
}

async fn sqlite_load(path: &Path, run: &str, records: &[Record]) {
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    for chunk in records.chunks(5000) {
        let mut tx = c.begin().await.unwrap();
        for r in chunk {
            sqlx::query(
                "INSERT INTO agentrun_steps (run, seq, format, kind, prev_hash, hash, body, epoch, created_at) \
                 VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, 1, 0)",
            )
            .bind(run)
            .bind(r.seq as i64)
            .bind(r.kind.as_str())
            .bind(&r.prev_hash.0[..])
            .bind(&r.hash.0[..])
            .bind(String::from_utf8(r.canonical_bytes()).unwrap())
            .execute(&mut *tx)
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    c.close().await.ok();
}

async fn bench() {
    let seconds: f64 = env_num("AGENTRUN_BENCH_SECONDS", 4.0);
    let pool: u32 = env_num("AGENTRUN_BENCH_POOL", 8);
    let t_start = Instant::now();
    let big = chain(100_000);
    let small = chain(10_000);

    // PostgreSQL
    e2e_postgres("up");
    let admin = e2e_postgres("url");
    let db = format!("agentrun_bench_{}", std::process::id());
    {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.ok();
    }
    let mut u = url::Url::parse(&admin).unwrap();
    u.set_path(&format!("/{db}"));
    let url = u.to_string();
    let opts = OpenOptions {
        max_connections: pool,
        ..Default::default()
    };
    let pg = store::open_with(&url, &opts).await.unwrap();
    pg.migrate().await.unwrap();
    let direct = append_figures(pg.clone(), "postgres", seconds).await;
    gateway_figures(&url, seconds, &direct).await;
    pg_load(&url, "replay-10k", &small).await;
    pg_load(&url, "replay-100k", &big).await;
    replay_figures(
        pg.as_ref(),
        "postgres",
        &[("10k", "replay-10k".into()), ("100k", "replay-100k".into())],
    )
    .await;
    pg.close().await;
    {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {db} WITH (FORCE)"
        )))
        .execute(&mut c)
        .await
        .unwrap();
        c.close().await.ok();
    }

    // SQLite
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.db");
    let sq = store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    append_figures(sq.clone(), "sqlite", seconds).await;
    sqlite_load(&path, "replay-10k", &small).await;
    sqlite_load(&path, "replay-100k", &big).await;
    replay_figures(
        sq.as_ref(),
        "sqlite",
        &[("10k", "replay-10k".into()), ("100k", "replay-100k".into())],
    )
    .await;
    sq.close().await;

    // In memory, re-encoding every record canonically (no database), for reference.
    let t0 = Instant::now();
    verify_chain("mem", &big, None).unwrap();
    figure(
        "store.verify_chain_reencode.100k",
        big.len() as f64 / t0.elapsed().as_secs_f64(),
        "steps/s",
    );
    eprintln!("bench: done in {:.1}s", t_start.elapsed().as_secs_f64());
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` would run us too: only run for real under --bench.
    if !std::env::args().any(|a| a == "--bench") {
        println!("store bench: pass --bench (cargo bench --bench store) to run");
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}
