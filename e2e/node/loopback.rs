//! A loopback of each pod's own, as far as the process node can give one.
//!
//! The containers of a pod share a network namespace and its 127.0.0.1;
//! different pods do not. Processes on one host all share the host's, so two
//! pods serving on `127.0.0.1:8790` would collide. Linux routes all of
//! 127.0.0.0/8 to `lo`: binding and connecting to `127.A.B.C` works with no
//! setup. So each pod gets an address of its own there
//! (`127.A.B.C`, A ≥ 1, never 127.0.0.1 nor 127.0.1.1, unique among the
//! node's live pods), and in its containers' command, args and env values,
//! `127.0.0.1:PORT` and `localhost:PORT` become `127.A.B.C:PORT`.
//!
//! Only for the ports given to the node as pods' own (`--pod-loopback-port`,
//! e.g. the runner's 8790): every other `127.0.0.1` in a pod's spec is how
//! the fixture's pods reach what a real cluster gives them at a Service or
//! pod IP (the API server, the step-log gateway, the stand-ins, other pods:
//! the node reports every pod IP as 127.0.0.1), and must stay the host's.
//! A host is rewritten only as a whole word followed by `:PORT` literally
//! (`http://127.0.0.1:8790/v1`, `127.0.0.1:8790`), never inside a longer
//! name or address (`127.0.0.10:8790`, `mylocalhost:8790`).

use std::{
    collections::{BTreeSet, HashSet},
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

/// Octet values used: 1..=254 (no network or broadcast look-alikes).
const SPAN: u32 = 254;

/// The node's loopback addresses: which are held by live pods.
#[derive(Debug, Default)]
pub struct Pool {
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    next: u32,
    live: HashSet<u32>,
}

/// The address of the `n`th slot: `127.(1+..).(1+..).(1+..)`, so never in
/// 127.0.0.0/16 (127.0.0.1, 127.0.1.1: the host's own names).
fn address(n: u32) -> Ipv4Addr {
    let octet = |k: u32| u8::try_from(1 + k % SPAN).unwrap_or(1);
    Ipv4Addr::new(127, octet(n / (SPAN * SPAN)), octet(n / SPAN), octet(n))
}

impl Pool {
    /// Takes the next address no live pod holds; it is free again when the
    /// lease is dropped.
    pub fn lease(self: &Arc<Self>) -> Lease {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let slots = SPAN * SPAN * SPAN;
        let mut n = s.next % slots;
        while s.live.contains(&n) {
            n = (n + 1) % slots;
        }
        s.live.insert(n);
        s.next = n + 1;
        Lease {
            pool: self.clone(),
            slot: n,
            addr: address(n),
        }
    }
}

/// A pod's own loopback address, held until the pod's run ends.
#[derive(Debug)]
pub struct Lease {
    pool: Arc<Pool>,
    slot: u32,
    pub addr: Ipv4Addr,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut s = self.pool.state.lock().unwrap_or_else(|e| e.into_inner());
        s.live.remove(&self.slot);
    }
}

/// What a pod's spec strings get rewritten to.
#[derive(Debug, Clone)]
pub struct PodLoopback {
    pub addr: Ipv4Addr,
    pub ports: Arc<BTreeSet<u16>>,
}

const HOSTS: [&str; 2] = ["127.0.0.1", "localhost"];

/// Part of a host name or address: a host next to one is not a whole word.
fn is_host_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')
}

impl PodLoopback {
    /// `s` with every `127.0.0.1:PORT`/`localhost:PORT` of the pod's ports
    /// moved to its address; `None` if there is none.
    pub fn rewrite(&self, s: &str) -> Option<String> {
        let mut out = String::new();
        let mut done = 0; // bytes of `s` already in `out`
        let mut i = 0;
        while i < s.len() {
            let found = HOSTS.iter().find(|h| s[i..].starts_with(*h));
            match found {
                Some(host) if self.own_port_at(s, i, host.len()) => {
                    out.push_str(&s[done..i]);
                    out.push_str(&self.addr.to_string());
                    i += host.len();
                    done = i;
                }
                _ => i += s[i..].chars().next().map_or(1, char::len_utf8),
            }
        }
        (done > 0).then(|| out + &s[done..])
    }

    /// Whether the host at `s[at..at + len]` is a whole word followed by
    /// `:PORT` with one of the pod's ports.
    fn own_port_at(&self, s: &str, at: usize, len: usize) -> bool {
        if s[..at].chars().next_back().is_some_and(is_host_char) {
            return false;
        }
        let Some(rest) = s[at + len..].strip_prefix(':') else {
            return false;
        };
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..digits]
            .parse::<u16>()
            .is_ok_and(|port| self.ports.contains(&port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(addr: [u8; 4], ports: &[u16]) -> PodLoopback {
        PodLoopback {
            addr: addr.into(),
            ports: Arc::new(ports.iter().copied().collect()),
        }
    }

    #[test]
    fn the_pods_ports_on_loopback_move_to_its_address() {
        let p = pod([127, 1, 1, 7], &[8790]);
        let r = |s| p.rewrite(s);
        assert_eq!(r("127.0.0.1:8790").as_deref(), Some("127.1.1.7:8790"));
        assert_eq!(
            r("http://127.0.0.1:8790/v1").as_deref(),
            Some("http://127.1.1.7:8790/v1")
        );
        assert_eq!(
            r("http://localhost:8790/mcp/shop").as_deref(),
            Some("http://127.1.1.7:8790/mcp/shop")
        );
        assert_eq!(
            r("a=127.0.0.1:8790,b=localhost:8790").as_deref(),
            Some("a=127.1.1.7:8790,b=127.1.1.7:8790")
        );
    }

    #[test]
    fn other_ports_hosts_and_words_stay() {
        let p = pod([127, 1, 1, 7], &[8790]);
        for s in [
            "http://127.0.0.1:38211",        // the gateway on the host
            "http://127.0.0.1:87901",        // a longer port
            "http://127.0.0.1/v1",           // no port
            "http://127.0.0.10:8790",        // another address
            "http://10.127.0.0.1:8790",      // inside a longer one
            "http://mylocalhost:8790",       // inside a longer name
            "http://localhost.example:8790", // a longer name
            "127.0.0.1",
            "localhost",
            "see localhost: it is nice",
        ] {
            assert_eq!(p.rewrite(s), None, "{s}");
        }
        assert_eq!(pod([127, 1, 1, 7], &[]).rewrite("127.0.0.1:8790"), None);
    }

    #[test]
    fn live_pods_hold_distinct_addresses_off_the_hosts_own() {
        let pool = Arc::new(Pool::default());
        let a = pool.lease();
        let b = pool.lease();
        assert_ne!(a.addr, b.addr);
        for lease in [&a, &b] {
            let [n, x, _, _] = lease.addr.octets();
            assert!(n == 127 && x >= 1, "{}", lease.addr);
        }
        // Wrapping around skips the address still held.
        pool.state.lock().unwrap().next = a.slot;
        let c = pool.lease();
        assert_ne!(c.addr, a.addr);
        assert_ne!(c.addr, b.addr);
        let held = a.addr;
        drop(a);
        pool.state.lock().unwrap().next = 0;
        assert_eq!(pool.lease().addr, held);
        assert_eq!(
            address(SPAN * SPAN * SPAN - 1),
            Ipv4Addr::new(127, 254, 254, 254)
        );
        assert_eq!(address(0), Ipv4Addr::new(127, 1, 1, 1));
    }
}
