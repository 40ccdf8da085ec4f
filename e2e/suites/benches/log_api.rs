//! The log API under load (run by `bash e2e/bench log-api`, which brings up
//! PostgreSQL and the local control plane and sets the environment).
//!
//! Prints one line per figure: `bench: log_api.<name> <value> <unit>`.
//!
//! - `log_api.get.aggregated.records_per_s`: a run's whole log of
//!   RECORDS records read page by page (`limit` = the page maximum) through
//!   the API server, as a person does (authentication, the aggregator's
//!   proxy, a SubjectAccessReview, the store, the server's check).
//! - `log_api.get.direct.records_per_s`: the same straight from the
//!   replica's port with the front-proxy certificate (what the aggregator
//!   adds is the ratio `log_api.get.aggregated_vs_direct`).
//! - `log_api.follow.cF.append_to_follower.{p50,p99}`: F followers of one
//!   run's log (watches through the API server) while APPENDS records are
//!   appended one at a time: the time from an append returning (the record
//!   is durable, its head event sent) to each follower receiving it.
//!
//! Environment: AGENTRUN_LOG_API_BENCH_RECORDS (100000),
//! AGENTRUN_LOG_API_BENCH_FOLLOWERS (100), AGENTRUN_LOG_API_BENCH_APPENDS
//! (200), AGENTRUN_LOG_API_BENCH_APPEND_GAP_MS (20).
//!
//! Without `--bench` (`cargo test`, which `e2e/test` runs on its cluster):
//! check mode, 2,000 records, 10 followers, 30 appends, and the promises
//! behind the figures asserted (every record served once and in order to
//! the reader and to every follower); a `cargo test` name filter other than
//! `log_api` skips it.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentrun::api::runlog::{ADDED, MAX_PAGE, RunLog, WatchEvent};
use agentrun::api::{AgentRun, Phase};
use agentrun::store::{Head, RecordDraft, StepKind, StepStore};
use common::log_api::{self, ClientIdentity, LogApiWorld, continue_query, get_runlog, uid_of};
use common::world::finish;
use futures::{AsyncBufReadExt as _, StreamExt as _};
use serde_json::json;

struct Config {
    check: bool,
    records: u64,
    followers: usize,
    appends: u64,
    gap: Duration,
}

impl Config {
    fn from_env() -> Config {
        let check = !std::env::args().any(|a| a == "--bench");
        let num = |name: &str, default: u64, check_default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(if check { check_default } else { default })
        };
        Config {
            check,
            records: num("AGENTRUN_LOG_API_BENCH_RECORDS", 100_000, 2_000),
            followers: num("AGENTRUN_LOG_API_BENCH_FOLLOWERS", 100, 10) as usize,
            appends: num("AGENTRUN_LOG_API_BENCH_APPENDS", 200, 30),
            gap: Duration::from_millis(num("AGENTRUN_LOG_API_BENCH_APPEND_GAP_MS", 20, 20)),
        }
    }
}

fn figure(name: &str, value: f64, unit: &str) {
    let v = if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    };
    println!("bench: log_api.{name} {v} {unit}");
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

async fn store() -> Arc<dyn StepStore> {
    agentrun::store::open(&common::store::e2e_store_url().await)
        .await
        .expect("opening the e2e store")
}

/// A run that Succeeded, its log then grown to `records` records.
async fn long_log(api: &LogApiWorld, records: u64) -> AgentRun {
    let w = &api.world;
    w.standins
        .script("long", json!([finish("done")]), json!([]))
        .await;
    w.create_run(
        "long",
        json!({"input": "Say done.", "agent": w.agent("long")}),
        json!({}),
    )
    .await;
    let run = w.wait_phase("long", Phase::Succeeded).await;
    let uid = uid_of(&run);
    let have = store().await.head(&uid).await.expect("head").len;
    let started = Instant::now();
    log_api::append_observations(&uid, records.saturating_sub(have)).await;
    println!(
        "log_api: {} records appended to {uid} in {:.1} s",
        records.saturating_sub(have),
        started.elapsed().as_secs_f64()
    );
    run
}

/// Reads the whole log through the API server; returns records/s.
async fn get_aggregated(api: &LogApiWorld, run: &AgentRun, expected: u64) -> f64 {
    let client = common::admin().await;
    let name = run.metadata.name.clone().unwrap();
    let started = Instant::now();
    let (mut query, mut next, mut pages) = (format!("limit={MAX_PAGE}"), 0u64, 0);
    loop {
        let page: RunLog = get_runlog(&client, api.ns(), &name, &query)
            .await
            .unwrap_or_else(|e| panic!("GET page {pages} ({query}): {e}"));
        for r in &page.records {
            assert_eq!(r.seq, next, "records served in order, each once");
            next += 1;
        }
        pages += 1;
        match page.page.and_then(|p| p.r#continue) {
            Some(token) => query = format!("limit={MAX_PAGE}&{}", continue_query(&token)),
            None => break,
        }
    }
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(next, expected, "the whole log was served");
    next as f64 / secs
}

/// Reads the whole log straight from the replica's port; returns records/s.
async fn get_direct(api: &LogApiWorld, run: &AgentRun, expected: u64) -> f64 {
    let (cert, key) = log_api::front_proxy_client();
    let name = run.metadata.name.clone().unwrap();
    let started = Instant::now();
    let mut next = 0u64;
    loop {
        let path = log_api::runlog_path(
            api.ns(),
            Some(&name),
            &format!("limit={MAX_PAGE}&fromSeq={next}"),
        );
        let (code, body) = log_api::direct_get(
            &api.addr,
            api.port,
            &api.cert.dns_name,
            &api.cert.ca_pem,
            Some(ClientIdentity {
                cert: &cert,
                key: &key,
            }),
            &[
                ("X-Remote-User", "admin"),
                ("X-Remote-Group", "system:masters"),
            ],
            &path,
        )
        .await
        .unwrap_or_else(|e| panic!("GET {path} from the replica: {e}"));
        assert_eq!(code, 200, "GET {path}: {body}");
        let page: RunLog = serde_json::from_str(&body).expect("a RunLog");
        for r in &page.records {
            assert_eq!(r.seq, next, "records served in order, each once");
            next += 1;
        }
        if page.page.and_then(|p| p.r#continue).is_none() {
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(next, expected, "the whole log was served");
    next as f64 / secs
}

/// A run the controller never starts (its Agent does not exist): its log
/// is the benchmark's to append to.
async fn idle_run(api: &LogApiWorld) -> AgentRun {
    api.world
        .create_run(
            "followed",
            json!({"input": "x", "agentRef": {"name": "no-such-agent"}}),
            json!({}),
        )
        .await
}

/// One follower: a watch through the API server; returns, per record
/// received (seq order), when it arrived.
async fn follower(
    client: kube::Client,
    ns: String,
    name: String,
    from: u64,
    count: u64,
    opened: tokio::sync::mpsc::Sender<()>,
) -> Vec<(u64, Instant)> {
    let path = format!(
        "{}?watch=true&fieldSelector=metadata.name%3D{name}&fromSeq={from}",
        log_api::runlog_path(&ns, None, "")
    );
    let request = http::Request::get(&path)
        .header("Accept", "application/json")
        .body(Vec::new())
        .unwrap();
    let body = client
        .request_stream(request)
        .await
        .unwrap_or_else(|e| panic!("watch {path}: {e}"));
    let _ = opened.send(()).await;
    let mut lines = Box::pin(body.lines());
    let mut got = Vec::new();
    while (got.len() as u64) < count {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next())
            .await
            .unwrap_or_else(|_| panic!("a follower waited 60 s for record {}", got.len()))
            .expect("the stream ended early")
            .expect("reading the stream");
        let at = Instant::now();
        let event: WatchEvent = serde_json::from_str(&line).expect("a watch event");
        assert_eq!(event.kind, ADDED, "unexpected event {line}");
        let log: RunLog = serde_json::from_value(event.object).expect("a RunLog");
        got.extend(log.records.iter().map(|r| (r.seq, at)));
    }
    got
}

/// Followers on an idle run while records are appended; returns the
/// latencies (ms) of every record at every follower.
async fn follow(api: &LogApiWorld, cfg: &Config) -> Vec<f64> {
    let run = idle_run(api).await;
    let uid = uid_of(&run);
    let name = run.metadata.name.clone().unwrap();
    let client = common::admin().await;
    let (opened, mut open) = tokio::sync::mpsc::channel(cfg.followers.max(1));
    let followers: Vec<_> = (0..cfg.followers)
        .map(|_| {
            tokio::spawn(follower(
                client.clone(),
                api.ns().to_string(),
                name.clone(),
                0,
                cfg.appends,
                opened.clone(),
            ))
        })
        .collect();
    // Appends start once every follower's stream is open (the server
    // answered: its follower is reading from seq 0 on).
    for _ in 0..cfg.followers {
        open.recv().await.expect("a follower opened its stream");
    }
    let store = store().await;
    let lease = store
        .acquire(&uid, "bench-log-api", Duration::from_secs(600))
        .await
        .expect("a lease");
    let mut head = Head::EMPTY;
    let mut appended = Vec::new();
    for i in 0..cfg.appends {
        let record = RecordDraft::new(StepKind::Observation, json!({"text": format!("f{i}")}))
            .seal(&head)
            .expect("sealing");
        head = store
            .append(&uid, lease.epoch, &record)
            .await
            .expect("append")
            .head();
        appended.push(Instant::now());
        tokio::time::sleep(cfg.gap).await;
    }
    store.release(&lease).await.expect("release");
    let mut latencies = Vec::new();
    for f in followers {
        let got = f.await.expect("a follower");
        let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            seqs,
            (0..cfg.appends).collect::<Vec<_>>(),
            "every follower got every record once, in order"
        );
        for (seq, at) in got {
            let sent = appended[seq as usize];
            latencies.push(at.saturating_duration_since(sent).as_secs_f64() * 1000.0);
        }
    }
    latencies.sort_by(f64::total_cmp);
    latencies
}

fn main() {
    let cfg = Config::from_env();
    common::bench_main("log_api", cfg.check, async move {
        println!(
            "log_api: {} mode; {} records, {} followers, {} appends",
            if cfg.check {
                "check (cargo test)"
            } else {
                "bench"
            },
            cfg.records,
            cfg.followers,
            cfg.appends
        );
        let api = LogApiWorld::start("bench-logapi").await;
        let run = long_log(&api, cfg.records).await;
        let aggregated = get_aggregated(&api, &run, cfg.records).await;
        let direct = get_direct(&api, &run, cfg.records).await;
        figure("get.aggregated.records_per_s", aggregated, "records/s");
        figure("get.direct.records_per_s", direct, "records/s");
        figure("get.aggregated_vs_direct", aggregated / direct, "ratio");
        let latencies = follow(&api, &cfg).await;
        let c = cfg.followers;
        figure(
            &format!("follow.c{c}.append_to_follower.p50"),
            quantile(&latencies, 0.5),
            "ms",
        );
        figure(
            &format!("follow.c{c}.append_to_follower.p99"),
            quantile(&latencies, 0.99),
            "ms",
        );
    });
}
