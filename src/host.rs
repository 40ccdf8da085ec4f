//! Which host a URL names, whatever its spelling (docs/endpoints.md). A
//! platform rule written for `127.0.0.1` must select calls spelled
//! `localhost`, `[::ffff:127.0.0.1]` or `2130706433`, and one written for a
//! Service must select every name a step pod reaches it by: hosts are
//! compared as the places they lead to, never as text.
//!
//! The URL parser (WHATWG) already lower-cases names, applies IDNA and reads
//! every IPv4 spelling (decimal, hex, octal, short forms, percent-encoded
//! dots). What it leaves is done here: IPv6 forms of an IPv4 address,
//! loopback in all its spellings, trailing dots, and the short names of a
//! Service as its namespace's pods resolve them. What DNS makes of a name
//! (a ClusterIP, an alias) is only known by looking it up: [`Network`]
//! carries what the lookups found, and a gate matches on those addresses too.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The cluster's DNS domain (kubelet `clusterDomain`), as Services are named
/// under it: `<svc>.<ns>.svc.cluster.local`.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// Where a host leads, as a rule compares it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Place {
    /// The step pod itself: every loopback and unspecified address (Linux
    /// connects `0.0.0.0` and `::` to the local host), `localhost` and the
    /// names under it (RFC 6761).
    Loopback,
    /// An address, as IPv4 when it carries one.
    Ip(IpAddr),
    /// A DNS name: lower case, without a trailing dot; a Service's by its
    /// full name.
    Name(String),
}

/// What the check knows of the network a call goes out on: the step pod's
/// namespace (the short names of its Services are relative to it) and what
/// names resolved to there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Network {
    pub namespace: String,
    /// Addresses each looked-up name resolved to (empty: it did not resolve).
    pub resolved: BTreeMap<String, Vec<IpAddr>>,
    /// Names were not looked up at all: any name may lead anywhere, so a
    /// gate that involves a name matches it (never an exemption).
    pub unresolved: bool,
}

/// No namespace and no lookups: hosts compared by their spellings alone.
pub static STATIC: Network = Network {
    namespace: String::new(),
    resolved: BTreeMap::new(),
    unresolved: false,
};

impl Network {
    /// The network of a step pod in `namespace`, nothing looked up yet.
    pub fn of(namespace: &str) -> Network {
        Network {
            namespace: namespace.to_string(),
            ..Network::default()
        }
    }

    /// A network whose lookups are unknown: every name may alias every
    /// address, so gates over-match (for a decision that cannot look up).
    pub fn unresolved(namespace: &str) -> Network {
        Network {
            unresolved: true,
            ..Network::of(namespace)
        }
    }

    /// Where `host` may lead: its spellings' places and, for names, the
    /// addresses they resolved to.
    fn reach(&self, host: &url::Host<String>) -> BTreeSet<Place> {
        let mut out: BTreeSet<Place> = places(host, &self.namespace).into_iter().collect();
        for name in lookups(host, &self.namespace) {
            let ips = self.resolved.get(&name).into_iter().flatten();
            out.extend(ips.map(|ip| address(*ip)));
        }
        out
    }
}

/// An IPv6 address that carries an IPv4 one (mapped `::ffff:a.b.c.d`,
/// compatible `::a.b.c.d`, NAT64 `64:ff9b::a.b.c.d`) as that IPv4 address;
/// other addresses unchanged.
pub fn unwrap_v4(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else { return ip };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    let s = v6.segments();
    let embedded = || {
        let [a, b] = s[6].to_be_bytes();
        let [c, d] = s[7].to_be_bytes();
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    };
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return embedded();
    }
    // `::` and `::1` are IPv6's own unspecified and loopback addresses.
    if s[..6] == [0; 6] && !v6.is_unspecified() && !v6.is_loopback() {
        return embedded();
    }
    ip
}

/// The place an address is.
pub fn address(ip: IpAddr) -> Place {
    let ip = unwrap_v4(ip);
    if ip.is_loopback() || ip.is_unspecified() {
        Place::Loopback
    } else {
        Place::Ip(ip)
    }
}

/// The addresses a loopback name is pinned to.
pub fn loopback_addresses() -> Vec<IpAddr> {
    vec![
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ]
}

/// Is `name` (lower case) `localhost` or under it?
fn is_localhost(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

/// The places `host` names by its spelling alone, in `namespace`. A name
/// with a trailing dot is absolute (no search list applies); without one,
/// a step pod's resolver tries its namespace's Services first, so:
///
/// - `svc` is `svc.<namespace>.svc.cluster.local`;
/// - `svc.ns` is both `svc.ns.svc.cluster.local` and the name `svc.ns`
///   (a public host like `pay.example` has that shape too);
/// - `svc.ns.svc` is `svc.ns.svc.cluster.local`;
/// - any other name is itself.
pub fn places(host: &url::Host<String>, namespace: &str) -> Vec<Place> {
    let name = match host {
        url::Host::Ipv4(ip) => return vec![address(IpAddr::V4(*ip))],
        url::Host::Ipv6(ip) => return vec![address(IpAddr::V6(*ip))],
        url::Host::Domain(name) => name.as_str(),
    };
    let absolute = name.ends_with('.');
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    if is_localhost(&name) {
        return vec![Place::Loopback];
    }
    let service = |n: &str| Place::Name(format!("{n}.svc.{CLUSTER_DOMAIN}"));
    if absolute || name.ends_with(&format!(".svc.{CLUSTER_DOMAIN}")) {
        return vec![Place::Name(name)];
    }
    let labels: Vec<&str> = name.split('.').collect();
    match labels.as_slice() {
        [svc] if !namespace.is_empty() => vec![service(&format!("{svc}.{namespace}"))],
        [_, _] => vec![service(&name), Place::Name(name)],
        [_, _, "svc"] => vec![Place::Name(format!("{name}.{CLUSTER_DOMAIN}"))],
        _ => vec![Place::Name(name)],
    }
}

/// The names to look up to learn where `host` leads: its spelling (what the
/// step pod's own resolver is asked) and each name it stands for. None for
/// addresses and loopback names.
pub fn lookups(host: &url::Host<String>, namespace: &str) -> Vec<String> {
    let url::Host::Domain(spelled) = host else {
        return Vec::new();
    };
    let mut out = vec![spelled.clone()];
    for place in places(host, namespace) {
        match place {
            Place::Name(name) if !out.contains(&name) => out.push(name),
            Place::Name(_) => {}
            // Loopback is known without a lookup (and pinned as such).
            Place::Loopback | Place::Ip(_) => return Vec::new(),
        }
    }
    out
}

/// Does a call to `call` reach the host a rule names as `rule`? `any`: a
/// gate's reading, which matches when some place either may lead to is
/// shared (lookups included, and with names unresolved any name may lead
/// anywhere); otherwise an exemption's, which holds only when every place
/// the call's spelling names is one the rule's names (lookups never widen it).
pub fn same_host(
    call: &url::Host<String>,
    rule: &url::Host<String>,
    any: bool,
    net: &Network,
) -> bool {
    if !any {
        let named: BTreeSet<Place> = places(rule, &net.namespace).into_iter().collect();
        return places(call, &net.namespace)
            .iter()
            .all(|p| named.contains(p));
    }
    let involves_name = |h: &url::Host<String>| {
        places(h, &net.namespace)
            .iter()
            .any(|p| matches!(p, Place::Name(_)))
    };
    if net.unresolved && (involves_name(call) || involves_name(rule)) {
        return true;
    }
    !net.reach(call).is_disjoint(&net.reach(rule))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(url: &str) -> url::Host<String> {
        url::Url::parse(url)
            .expect("a URL")
            .host()
            .expect("a host")
            .to_owned()
    }

    fn place(url: &str) -> Vec<Place> {
        places(&host(url), "shop")
    }

    #[test]
    fn every_spelling_of_loopback_is_loopback() {
        for url in [
            "http://127.0.0.1/",
            "http://127.0.0.2:8080/",
            "http://127.1/",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://0x7f000001/",
            "http://0177.0.0.1/",
            "http://017700000001/",
            "http://127%2e0%2e0%2e1/",
            "http://0/",
            "http://0.0.0.0/",
            "http://[::1]/",
            "http://[::]/",
            "http://[0:0:0:0:0:0:0:1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:7f00:1]/",
            "http://[::127.0.0.1]/",
            "http://[64:ff9b::7f00:1]/",
            "http://localhost/",
            "http://LOCALHOST./",
            "http://localhost../",
            "http://api.localhost/",
            "http://a.b.LocalHost./",
            "http://user:pw@localhost/",
        ] {
            assert_eq!(place(url), vec![Place::Loopback], "{url}");
        }
    }

    #[test]
    fn names_that_only_look_like_loopback_are_names() {
        for (url, name) in [
            ("http://127.0.0.1.evil.com/", "127.0.0.1.evil.com"),
            ("http://localhost.evil.com/", "localhost.evil.com"),
            ("http://localhostx/", "localhostx.shop.svc.cluster.local"),
            ("http://evil-localhost.com/", "evil-localhost.com"),
            ("http://127.0.0.1@evil.com/", "evil.com"),
            ("http://localhost@evil.com/", "evil.com"),
            ("http://127.0.0.1:80@evil.com/", "evil.com"),
        ] {
            let places = place(url);
            assert!(!places.contains(&Place::Loopback), "{url}: {places:?}");
            assert!(
                places.contains(&Place::Name(name.into())),
                "{url}: {places:?}"
            );
        }
    }

    #[test]
    fn ipv6_forms_of_an_ipv4_address_are_that_address() {
        let v4 = Place::Ip("10.96.0.12".parse().unwrap());
        for url in [
            "http://10.96.0.12/",
            "http://[::ffff:10.96.0.12]/",
            "http://[::ffff:a60:c]/",
            "http://[::10.96.0.12]/",
            "http://[64:ff9b::10.96.0.12]/",
            "http://174063628/",
            "http://0xa.0x60.0.014/",
            "http://10.96.12/",
        ] {
            assert_eq!(place(url), vec![v4.clone()], "{url}");
        }
        assert_eq!(
            place("http://[2001:db8::1]/"),
            vec![Place::Ip("2001:db8::1".parse().unwrap())]
        );
    }

    #[test]
    fn a_services_names_are_one_name_in_its_namespace() {
        let full = Place::Name("pay.shop.svc.cluster.local".into());
        for url in [
            "http://pay/",
            "http://PAY/",
            "http://pay.shop.svc/",
            "http://pay.shop.svc.cluster.local/",
            "http://pay.shop.svc.cluster.local./",
            "http://Pay.Shop.SVC.Cluster.Local./",
        ] {
            assert_eq!(place(url), vec![full.clone()], "{url}");
        }
        // Two labels: the Service of that namespace, or a public name.
        assert_eq!(
            place("http://pay.shop/"),
            vec![full.clone(), Place::Name("pay.shop".into())]
        );
        // Absolute short names skip the search list: not the Service.
        assert_eq!(
            place("http://pay.shop./"),
            vec![Place::Name("pay.shop".into())]
        );
        assert_eq!(place("http://pay./"), vec![Place::Name("pay".into())]);
        // In another namespace, a bare name is another Service.
        assert_eq!(
            places(&host("http://pay/"), "other"),
            vec![Place::Name("pay.other.svc.cluster.local".into())]
        );
        assert_eq!(
            place("http://pay.example.com./"),
            vec![Place::Name("pay.example.com".into())]
        );
    }

    #[test]
    fn a_gate_matches_every_spelling_and_what_names_resolve_to() {
        let net = Network::of("shop");
        let gate =
            |call: &str, rule: &str, net: &Network| same_host(&host(call), &host(rule), true, net);
        assert!(gate("http://localhost/", "http://127.0.0.1/", &net));
        assert!(gate(
            "http://[::ffff:127.0.0.1]/",
            "http://localhost./",
            &net
        ));
        assert!(gate("http://pay/", "http://pay.shop/", &net));
        assert!(gate("http://pay.shop./", "http://pay.shop/", &net));
        assert!(!gate("http://pay.shop./", "http://pay.shop.svc/", &net));
        assert!(!gate("http://10.96.0.12/", "http://pay.shop/", &net));
        assert!(!gate("http://alias.example/", "http://10.96.0.12/", &net));
        // What lookups found: the rule's name leads to the ClusterIP, an
        // alias of the caller's choosing to the same address.
        let mut looked = net.clone();
        for name in ["pay.shop.svc.cluster.local", "alias.example"] {
            looked
                .resolved
                .insert(name.into(), vec!["10.96.0.12".parse().unwrap()]);
        }
        looked.resolved.insert(
            "rebind.example".into(),
            vec!["::ffff:127.0.0.1".parse().unwrap()],
        );
        assert!(gate("http://10.96.0.12/", "http://pay.shop/", &looked));
        assert!(gate("http://alias.example/", "http://pay/", &looked));
        assert!(gate("http://alias.example/", "http://10.96.0.12/", &looked));
        assert!(gate("http://rebind.example/", "http://127.0.0.1/", &looked));
        assert!(!gate(
            "http://other.example/",
            "http://10.96.0.12/",
            &looked
        ));
        // Unresolved, a name may lead anywhere; two addresses are known.
        let unknown = Network::unresolved("shop");
        assert!(gate(
            "http://other.example/",
            "http://10.96.0.12/",
            &unknown
        ));
        assert!(!gate("http://10.96.0.13/", "http://10.96.0.12/", &unknown));
    }

    #[test]
    fn an_exemption_holds_only_for_spellings_of_the_names_it_lists() {
        let mut net = Network::of("shop");
        net.resolved
            .insert("alias.example".into(), vec!["10.96.0.12".parse().unwrap()]);
        let exempt = |call: &str, rule: &str| same_host(&host(call), &host(rule), false, &net);
        assert!(exempt("http://localhost/", "http://127.0.0.1/"));
        assert!(exempt(
            "http://lookup/",
            "http://lookup.shop.svc.cluster.local/"
        ));
        assert!(exempt("http://lookup.shop/", "http://lookup.shop/"));
        assert!(exempt("http://lookup/", "http://lookup.shop/"));
        // `lookup.shop` may be a public host: a full name does not cover it.
        assert!(!exempt(
            "http://lookup.shop/",
            "http://lookup.shop.svc.cluster.local/"
        ));
        // What a name resolves to never widens an exemption.
        assert!(!exempt("http://alias.example/", "http://10.96.0.12/"));
        assert!(!exempt("http://10.96.0.12/", "http://alias.example/"));
    }

    #[test]
    fn lookups_ask_for_the_spelling_and_the_names_it_stands_for() {
        assert_eq!(
            lookups(&host("http://pay/"), "shop"),
            vec!["pay", "pay.shop.svc.cluster.local"]
        );
        assert_eq!(
            lookups(&host("http://pay.shop/"), "shop"),
            vec!["pay.shop", "pay.shop.svc.cluster.local"]
        );
        assert_eq!(
            lookups(&host("http://pay.example.com./"), "shop"),
            vec!["pay.example.com.", "pay.example.com"]
        );
        assert!(lookups(&host("http://localhost/"), "shop").is_empty());
        assert!(lookups(&host("http://10.0.0.1/"), "shop").is_empty());
    }
}
