//! Attacks on the servers the controller runs, before authentication (issue
//! 25, "every server the operator runs is bounded before authentication"),
//! played as anyone who can reach the step-log gateway (any pod of the
//! cluster) without a step token:
//!
//! - many requests announcing and sending 16 MiB bodies with a forged token
//!   are refused from their headers: the controller's peak memory grows by
//!   less than [`MEMORY_BOUND_MIB`] (it used to buffer and parse each body);
//! - about a thousand half-sent requests (a head that never ends), reopened
//!   as fast as they are closed, are each closed within the header timeout,
//!   while `/readyz` and `/healthz` keep answering and an ordinary run
//!   finishes (they used to hold the controller's file descriptors until
//!   neither the gateway nor `/readyz` answered).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentrun::api::Phase;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::common::{
    self,
    controller::try_http_request,
    world::{World, finish},
};

/// How much the controller's peak resident memory may grow under the body
/// attack (its hyper read buffers and replies; the bodies are 1 GiB in all).
const MEMORY_BOUND_MIB: u64 = 48;
/// The gateway's default header timeout (`--step-api-header-timeout-seconds`).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A `/proc/<pid>/status` figure in KiB (`VmHWM`, `VmRSS`).
fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// Resets the process's peak RSS to its current RSS (Linux `clear_refs` 5),
/// so `VmHWM` afterwards is the peak of what follows; false when refused.
fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

async fn probe(port: u16, path: &str) -> Option<u16> {
    match tokio::time::timeout(
        Duration::from_secs(5),
        try_http_request(port, "GET", path, ""),
    )
    .await
    {
        Ok(Ok((code, _))) => Some(code),
        _ => None,
    }
}

async fn controller_ready(w: &World) {
    let port = w.metrics_port();
    common::wait_for(
        "the controller's /readyz",
        common::world::TIMEOUT,
        || async {
            match probe(port, "/readyz").await {
                Some(200) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

fn gateway_port(w: &World) -> u16 {
    common::controller::step_api_port(w.name())
}

/// One request with a forged token announcing and sending `body`; the
/// status it got (0 when the connection was closed before a reply).
async fn forged_upload(port: u16, run: String, body: Arc<Vec<u8>>) -> u16 {
    let Ok(stream) = TcpStream::connect(("127.0.0.1", port)).await else {
        return 0;
    };
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST /v1/runs/{run}/records HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer forged\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let send = async move {
        if wr.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        for chunk in body.chunks(1 << 20) {
            if wr.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    let receive = async move {
        let mut reply = Vec::new();
        let _ = rd.read_to_end(&mut reply).await;
        let reply = String::from_utf8_lossy(&reply).into_owned();
        reply
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    };
    let ((), code) = tokio::join!(send, receive);
    code
}

#[tokio::test]
async fn unauthenticated_16_mib_bodies_are_refused_unread() {
    let w = World::new("srv-body", &[]).await;
    controller_ready(&w).await;
    let pid = w.controller_pid().expect("controller running");
    let port = gateway_port(&w);
    // A body the old gateway accepted (under its 16 MiB limit) and parsed.
    let mut body = b"{\"epoch\":1,\"record\":\"".to_vec();
    body.resize((16 << 20) - 64, b'x');
    body.extend_from_slice(b"\"}");
    let body = Arc::new(body);

    let rss_before = proc_status_kib(pid, "VmRSS");
    let peak_reset = reset_peak(pid);
    let hwm_before = proc_status_kib(pid, "VmHWM");
    let started = Instant::now();
    let mut codes = Vec::new();
    for _wave in 0..4 {
        let uploads: Vec<_> = (0..16)
            .map(|i| {
                let run = format!("00000000-0000-4000-8000-{i:012}");
                tokio::spawn(forged_upload(port, run, body.clone()))
            })
            .collect();
        for u in uploads {
            codes.push(u.await.unwrap());
        }
    }
    let hwm_after = proc_status_kib(pid, "VmHWM");
    let base = if peak_reset { rss_before } else { hwm_before };
    let growth_mib = hwm_after.saturating_sub(base) / 1024;
    eprintln!(
        "bench: 64 unauthenticated requests of 16 MiB bodies refused in {:?}: controller peak RSS +{growth_mib} MiB \
         (bound {MEMORY_BOUND_MIB} MiB; RSS before {} MiB)",
        started.elapsed(),
        rss_before / 1024
    );
    assert!(
        codes.iter().all(|c| *c == 403 || *c == 0),
        "every forged upload is refused (403) or cut, none read: {codes:?}"
    );
    assert!(
        codes.contains(&403),
        "the refusals were sent before the bodies: {codes:?}"
    );
    assert!(
        growth_mib < MEMORY_BOUND_MIB,
        "the controller's peak memory grew by {growth_mib} MiB under unauthenticated bodies (bound {MEMORY_BOUND_MIB} MiB)"
    );
    assert_eq!(probe(w.metrics_port(), "/readyz").await, Some(200));
}

/// Lowers `pid`'s open-files limit (soft and hard) to `n`, as a container
/// runtime with a small default would set it.
fn limit_open_files(pid: u32, n: u64) {
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: prlimit reads the struct we pass and writes nothing back (null).
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit on the controller");
}

/// Lets this test process open the attack's connections.
fn raise_own_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write only the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// One attacker: opens a connection, sends half a request head, waits until
/// the gateway closes it, and again, until `stop`. Records the longest time
/// a connection stayed open in `longest_ms`.
async fn half_sender(port: u16, stop: Arc<AtomicBool>, longest_ms: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let opened = Instant::now();
        if s.write_all(b"POST /v1/runs/x/records HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
            .await
            .is_ok()
        {
            let mut sink = [0u8; 256];
            // Until closed (EOF or a reset), or the test ends.
            loop {
                tokio::select! {
                    r = s.read(&mut sink) => if !matches!(r, Ok(n) if n > 0) { break },
                    () = tokio::time::sleep(Duration::from_millis(500)) => {
                        if stop.load(Ordering::Relaxed) { break; }
                    }
                }
            }
        }
        longest_ms.fetch_max(opened.elapsed().as_millis() as u64, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test]
async fn half_sent_requests_are_closed_while_probes_and_runs_still_answer() {
    // A controller in a container allowed 1024 open files, its gateway
    // given the slots that fit there (what it computes itself at start).
    let w = World::new("srv-slow", &["--step-api-max-connections", "512"]).await;
    controller_ready(&w).await;
    let pid = w.controller_pid().expect("controller running");
    limit_open_files(pid, 1024);
    raise_own_open_files();
    let port = gateway_port(&w);

    let stop = Arc::new(AtomicBool::new(false));
    let longest_ms = Arc::new(AtomicU64::new(0));
    let attackers: Vec<_> = (0..1000)
        .map(|_| tokio::spawn(half_sender(port, stop.clone(), longest_ms.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Under attack: an ordinary run, and the probes.
    w.standins
        .script("plain", json!([finish("done")]), json!([]))
        .await;
    let started = Instant::now();
    w.create_run(
        "plain",
        json!({"input": "Say done.", "agent": w.agent("plain")}),
        json!({}),
    )
    .await;
    let metrics = w.metrics_port();
    let mut slowest_probe = Duration::ZERO;
    let mut most_files = 0;
    let runs: kube::Api<agentrun::api::AgentRun> =
        kube::Api::namespaced(w.client.clone(), w.name());
    loop {
        for path in ["/readyz", "/healthz"] {
            let asked = Instant::now();
            let code = probe(metrics, path).await;
            assert_eq!(
                code,
                Some(200),
                "{path} under attack after {:?}; controller log:\n{}",
                started.elapsed(),
                w.controller_log()
            );
            slowest_probe = slowest_probe.max(asked.elapsed());
        }
        most_files = most_files.max(open_files(pid));
        let run = runs.get("plain").await.unwrap();
        let phase = run.status.as_ref().and_then(|s| s.phase);
        if phase == Some(Phase::Succeeded) {
            break;
        }
        assert!(
            !phase.is_some_and(|p| p.is_terminal()),
            "the run ended {phase:?}: {:?}",
            run.status
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the run did not finish under attack within 60 s: {:?}",
            run.status
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let finished_in = started.elapsed();
    // Let every connection opened so far reach its close.
    tokio::time::sleep(HEADER_TIMEOUT + Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = a.await;
    }
    let longest = Duration::from_millis(longest_ms.load(Ordering::Relaxed));
    eprintln!(
        "bench: 1000 half-sent connections against 512 gateway slots: a run finished in {finished_in:?}, \
         slowest probe {slowest_probe:?}, longest-held connection {longest:?}, controller open files <= {most_files} of 1024"
    );
    assert!(
        longest <= HEADER_TIMEOUT + Duration::from_secs(3),
        "a half-sent request was held {longest:?} (header timeout {HEADER_TIMEOUT:?})"
    );
    assert!(most_files < 1024, "the controller ran out of files");
}
