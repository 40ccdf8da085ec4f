//! Where names lead, looked up once. A platform rule matches a call on the
//! addresses its host resolves to (docs/endpoints.md), so the addresses the
//! check saw must be the ones the call connects to: the step pod pins each
//! name at its first lookup ([`Pins`]), classifies with what was pinned, and
//! its tool client resolves through the same pins. A name that resolves
//! elsewhere a moment later (DNS rebinding, a short TTL) changes nothing for
//! the rest of the pod's life.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;

use crate::host::{self, Network, Place};

/// How long one lookup may take; a name that does not answer in time
/// resolves to nothing (and a call to it cannot connect).
pub const TIMEOUT: Duration = Duration::from_secs(3);
/// Lookups made at once.
const PARALLEL: usize = 8;

/// What `name` resolves to from this process (none when it does not
/// resolve in time), without duplicates, in the resolver's order.
pub async fn lookup(name: &str) -> Vec<IpAddr> {
    let Ok(Ok(found)) = tokio::time::timeout(TIMEOUT, tokio::net::lookup_host((name, 0))).await
    else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = Vec::new();
    for ip in found.map(|a| a.ip()) {
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

/// Looks up each of `names` (a few at a time): what each resolved to.
pub async fn resolve(names: Vec<String>) -> BTreeMap<String, Vec<IpAddr>> {
    futures::stream::iter(names)
        .map(|name| async move {
            let ips = lookup(&name).await;
            (name, ips)
        })
        .buffer_unordered(PARALLEL)
        .collect()
        .await
}

/// The network of a run in `namespace` with `names` looked up now: for a
/// check made after the step pod's (the controller's), which the pod's
/// lookups should agree with.
pub async fn network(namespace: &str, names: Vec<String>) -> Network {
    Network {
        resolved: resolve(names).await,
        ..Network::of(namespace)
    }
}

/// The addresses names were pinned to in this process: a name is looked up
/// the first time it is asked for, and never again.
#[derive(Clone, Debug, Default)]
pub struct Pins(Arc<Mutex<BTreeMap<String, Vec<IpAddr>>>>);

impl Pins {
    /// Looks up those of `names` not pinned yet, and pins what they resolved
    /// to (nothing, when they did not).
    pub async fn pin(&self, names: &[String]) {
        let missing: Vec<String> = {
            let pinned = self.lock();
            names
                .iter()
                .filter(|n| !pinned.contains_key(n.as_str()))
                .cloned()
                .collect()
        };
        if missing.is_empty() {
            return;
        }
        let found = resolve(missing).await;
        let mut pinned = self.lock();
        for (name, ips) in found {
            // A concurrent lookup that pinned the name first stays.
            pinned.entry(name).or_insert(ips);
        }
    }

    /// Pins `name` to `ips` as if a lookup had found them (tests).
    #[cfg(test)]
    pub(crate) fn set(&self, name: &str, ips: Vec<IpAddr>) {
        self.lock().insert(name.to_string(), ips);
    }

    /// What `name` was pinned to, if it was looked up.
    pub fn pinned(&self, name: &str) -> Option<Vec<IpAddr>> {
        self.lock().get(name).cloned()
    }

    /// The network a check in `namespace` sees: the pinned addresses.
    pub fn network(&self, namespace: &str) -> Network {
        Network {
            resolved: self.lock().clone(),
            ..Network::of(namespace)
        }
    }

    /// Where a connection to `name` goes: loopback for a loopback name,
    /// else the pinned addresses (looked up now if the name was not yet).
    async fn connect_to(&self, name: &str) -> Vec<IpAddr> {
        let as_host = url::Host::Domain(name.to_string());
        if host::places(&as_host, "") == [Place::Loopback] {
            return host::loopback_addresses();
        }
        self.pin(&[name.to_string()]).await;
        self.pinned(name).unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<IpAddr>>> {
        // A panic while holding the lock leaves a map that is still whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A name that resolved to nothing when it was pinned.
#[derive(Debug, thiserror::Error)]
#[error("{0} did not resolve when it was looked up for this step; not connecting")]
pub struct Unresolved(String);

impl reqwest::dns::Resolve for Pins {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let pins = self.clone();
        Box::pin(async move {
            let name = name.as_str().to_string();
            let ips = pins.connect_to(&name).await;
            if ips.is_empty() {
                return Err(Box::new(Unresolved(name)) as Box<dyn std::error::Error + Send + Sync>);
            }
            let addrs = ips.into_iter().map(|ip| SocketAddr::new(ip, 0));
            Ok(Box::new(addrs.collect::<Vec<_>>().into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::Resolve as _;

    #[tokio::test]
    async fn a_name_is_looked_up_once_and_connected_to_where_it_was_pinned() {
        let pins = Pins::default();
        // What a check saw (here: set by hand, as if the name had resolved
        // to a harmless address then).
        pins.set("tool.example", vec!["192.0.2.7".parse().unwrap()]);
        pins.pin(&["tool.example".to_string()]).await;
        let addrs: Vec<SocketAddr> = pins
            .resolve("tool.example".parse().unwrap())
            .await
            .expect("pinned")
            .collect();
        assert_eq!(addrs, vec!["192.0.2.7:0".parse::<SocketAddr>().unwrap()]);
        let net = pins.network("shop");
        assert_eq!(
            net.resolved.get("tool.example"),
            Some(&vec!["192.0.2.7".parse::<IpAddr>().unwrap()])
        );
    }

    #[tokio::test]
    async fn loopback_names_connect_to_loopback_and_unresolved_names_nowhere() {
        let pins = Pins::default();
        for name in ["localhost", "refunds.localhost"] {
            let addrs: Vec<IpAddr> = pins
                .resolve(name.parse().unwrap())
                .await
                .expect("loopback")
                .map(|a| a.ip())
                .collect();
            assert!(addrs.iter().all(IpAddr::is_loopback), "{name}: {addrs:?}");
        }
        pins.set("gone.example", Vec::new());
        let err = pins
            .resolve("gone.example".parse().unwrap())
            .await
            .err()
            .expect("nothing to connect to");
        assert!(err.to_string().contains("did not resolve"), "{err}");
    }
}
