//! Ports for the processes a test starts and tells where to listen.
//!
//! A port the kernel hands out for `bind(IP:0)` is free only until it is
//! closed: between that and the child's own bind, another test's server (a
//! `bind(0)` of its own) or an outgoing connection may take it, and the child
//! fails to start (a controller that cannot bind its metrics port exits, and
//! its runs never get a status). So the harness hands out ports below the
//! kernel's ephemeral range (`ip_local_port_range`, 32768 and up by default)
//! and above the fixed ports of `e2e/` (PostgreSQL 25432/25433, etcd 23790),
//! each once per test process, checked free when handed out.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The harness's range: no `bind(0)` nor `connect` ever picks these.
const FIRST: u32 = 26_000;
const COUNT: u32 = 4_000;

/// The next offset to try; each process starts at its own place, so two
/// test processes at once (cargo runs test binaries one after another, but
/// a person may run two) rarely meet.
static NEXT: LazyLock<AtomicU32> = LazyLock::new(|| AtomicU32::new(std::process::id()));

/// A port free on `addr` now that this process never handed out before (the
/// child binds it next).
pub fn reserve_on(addr: &str) -> u16 {
    let mut last = None;
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT) as u16;
        match std::net::TcpListener::bind((addr, port)) {
            Ok(_) => return port,
            Err(e) => last = Some(e),
        }
    }
    panic!(
        "no free port in {FIRST}..{} on {addr} (last: {last:?}): is {addr} an address of this host?",
        FIRST + COUNT
    )
}

/// A port free on 127.0.0.1 (see [`reserve_on`]).
pub fn reserve() -> u16 {
    reserve_on("127.0.0.1")
}
