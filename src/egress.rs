//! Requests the controller makes to addresses users chose (MCP discovery
//! when a run starts, approval webhooks). The controller sits inside the
//! cluster, so such a request could read what only the cluster may reach (a
//! database admin page, another tenant's service, a node's metadata) on a
//! run creator's behalf. Only what the platform allows is reached:
//!
//! - link-local and cloud metadata addresses: never (a node's credentials live there);
//! - `--user-url-deny` ranges (e.g. the cluster's Service CIDR): never;
//! - `--user-url-allow` entries (CIDRs, or `host[:port]` names): yes;
//! - cluster-internal ranges (RFC 1918, loopback, CGNAT, unique-local): no;
//! - other (public) addresses: yes, unless `--user-url-public=false`.
//!
//! Enforced after DNS resolution (a name that resolves inward is refused
//! too, by [`Resolver`]) and for IP literals, which reqwest does not
//! resolve (by [`Policy::check_url`], which callers run first).

use crate::refusal::Refusal;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use ipnet::IpNet;

/// Why `ip` may never be reached from the controller, allowed or not.
pub fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match canonical(ip) {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// An IPv6 address that carries an IPv4 one is judged as that IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    crate::host::unwrap_v4(ip)
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    if ip.is_link_local() {
        Some("a link-local address (cloud metadata lives at 169.254.169.254)")
    } else if ip == Ipv4Addr::new(100, 100, 100, 200) {
        Some("a cloud metadata address")
    } else if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
        Some("not a unicast address")
    } else {
        None
    }
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if ip.is_unicast_link_local() {
        Some("a link-local address")
    } else if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        Some("a cloud metadata address")
    } else if ip.is_unspecified() || ip.is_multicast() {
        Some("not a unicast address")
    } else {
        None
    }
}

/// The ranges that are the cluster's inside by default (and what they are).
const INTERNAL: &[(&str, &str)] = &[
    ("10.0.0.0/8", "a private address (10.0.0.0/8)"),
    ("172.16.0.0/12", "a private address (172.16.0.0/12)"),
    ("192.168.0.0/16", "a private address (192.168.0.0/16)"),
    ("127.0.0.0/8", "a loopback address"),
    ("100.64.0.0/10", "a shared (CGNAT) address (100.64.0.0/10)"),
    ("0.0.0.0/8", "a this-network address (0.0.0.0/8)"),
    ("::1/128", "a loopback address"),
    ("fc00::/7", "a unique-local address (fc00::/7)"),
];

/// Why `ip` counts as cluster-internal, if it does.
pub fn internal(ip: IpAddr) -> Option<&'static str> {
    let ip = canonical(ip);
    INTERNAL.iter().find_map(|(net, why)| {
        let net: IpNet = net.parse().expect("a valid built-in range");
        net.contains(&ip).then_some(*why)
    })
}

/// One `--user-url-allow` entry: a range of addresses, or a host name
/// (`*.example.com` for its subdomains) with an optional port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Net(IpNet),
    Host { host: String, port: Option<u16> },
}

impl FromStr for Entry {
    type Err = Refusal;

    fn from_str(s: &str) -> Result<Self, Refusal> {
        let s = s.trim();
        if s.contains('/') {
            return s
                .parse::<IpNet>()
                .map(|n| Entry::Net(n.trunc()))
                .map_err(|e| Refusal::new(format!("{s:?} is not a CIDR range: {e}")));
        }
        let bare = s.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(Entry::Net(IpNet::from(ip)));
        }
        // host[:port], parsed as a URL authority so that the name is
        // normalized (case, IDNA) exactly as the URLs it is matched against.
        let (pattern, wild) = match s.strip_prefix("*.") {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        // The port by hand: the URL parser forgets a port that is its scheme's default.
        let (pattern, port) = match pattern.rsplit_once(':') {
            Some((host, port)) => {
                let port = port
                    .parse::<u16>()
                    .map_err(|_| format!("{s:?} is not host[:port]: {port:?} is not a port"))?;
                (host, Some(port))
            }
            None => (pattern, None),
        };
        let url = url::Url::parse(&format!("http://{pattern}/"))
            .map_err(|e| format!("{s:?} is neither a CIDR range nor host[:port]: {e}"))?;
        let bad = |why: &str| Err(Refusal::new(format!("{s:?} is not host[:port]: {why}")));
        if !url.username().is_empty()
            || url.password().is_some()
            || url.path() != "/"
            || url.port().is_some()
        {
            return bad("only a host name and a port");
        }
        let Some(url::Host::Domain(host)) = url.host() else {
            return bad("an IP address with a port is not supported, list it as a CIDR");
        };
        let host = if wild {
            format!("*.{host}")
        } else {
            host.to_string()
        };
        Ok(Entry::Host { host, port })
    }
}

impl Entry {
    fn matches_host(&self, host: &str, port: Option<u16>) -> bool {
        let Entry::Host {
            host: want,
            port: want_port,
        } = self
        else {
            return false;
        };
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let name_ok = match want.strip_prefix("*.") {
            Some(suffix) => host.ends_with(&format!(".{suffix}")),
            None => host == *want,
        };
        name_ok && (want_port.is_none() || port.is_none() || *want_port == port)
    }
}

/// Which addresses the controller may reach for users.
#[derive(Debug, Clone)]
pub struct Policy {
    allow: Vec<Entry>,
    deny: Vec<IpNet>,
    public: bool,
}

impl Default for Policy {
    /// Public addresses only.
    fn default() -> Self {
        Policy::new(Vec::new(), Vec::new(), true)
    }
}

impl Policy {
    pub fn new(allow: Vec<Entry>, deny: Vec<IpNet>, public: bool) -> Self {
        Policy {
            allow,
            deny: deny.into_iter().map(|n| n.trunc()).collect(),
            public,
        }
    }

    /// Whether the platform allows `host` by name (`port`: the URL's, or
    /// `None` when the resolver asks, which knows no port; the URL's port
    /// was checked by [`Policy::check_url`] before).
    fn host_allowed(&self, host: &str, port: Option<u16>) -> bool {
        self.allow.iter().any(|e| e.matches_host(host, port))
    }

    /// Why `ip` may not be reached (`by_name`: its host name is allowed).
    pub fn refusal(&self, ip: IpAddr, by_name: bool) -> Option<String> {
        if let Some(why) = forbidden(ip) {
            return Some(why.to_string());
        }
        let ip = canonical(ip);
        if let Some(net) = self.deny.iter().find(|n| n.contains(&ip)) {
            return Some(format!(
                "in {net}, which the platform refuses (--user-url-deny)"
            ));
        }
        if by_name
            || self
                .allow
                .iter()
                .any(|e| matches!(e, Entry::Net(n) if n.contains(&ip)))
        {
            return None;
        }
        if let Some(why) = internal(ip) {
            return Some(format!(
                "{why}, not on the platform's allow-list (--user-url-allow)"
            ));
        }
        (!self.public).then(|| {
            "not on the platform's allow-list (--user-url-allow; public addresses are refused)"
                .to_string()
        })
    }

    /// Refuses a URL the controller may not reach: not http(s), with
    /// credentials in it, or on an IP literal the platform does not allow
    /// (names are checked when they resolve, by [`Resolver`]).
    pub fn check_url(&self, url: &str) -> Result<(), Refusal> {
        let parsed = url::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!("{url}: only http and https URLs are allowed").into());
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(format!("{url}: a URL may not carry a user name or password").into());
        }
        let port = parsed.port_or_known_default();
        let ip = match parsed.host() {
            Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
            Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
            Some(url::Host::Domain(host)) => {
                // The resolver allows a listed name on any port: the port is checked here.
                if self.host_allowed(host, None) && !self.host_allowed(host, port) {
                    return Err(format!(
                        "{url}: {host} is on the platform's allow-list (--user-url-allow) on other ports only; the controller never connects there"
                    ).into());
                }
                return Ok(());
            }
            None => return Err(format!("{url}: the URL names no host").into()),
        };
        match self.refusal(ip, false) {
            Some(why) => {
                Err(format!("{url}: {ip} is {why}; the controller never connects there").into())
            }
            None => Ok(()),
        }
    }
}

/// The resolver's refusal (found again in a failed request's error chain,
/// to be reported in its own words).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(String);

/// A DNS resolver for reqwest that drops the addresses its policy refuses.
#[derive(Debug, Default, Clone)]
pub struct Resolver {
    policy: Arc<Policy>,
}

impl Resolver {
    pub fn new(policy: Arc<Policy>) -> Self {
        Resolver { policy }
    }
}

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            let by_name = policy.host_allowed(&host, None);
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = all
                .iter()
                .copied()
                .filter(|a| policy.refusal(a.ip(), by_name).is_none())
                .collect();
            if allowed.is_empty() && !all.is_empty() {
                let ip = all[0].ip();
                let why = policy.refusal(ip, by_name).unwrap_or_default();
                return Err(Box::new(Refused(format!(
                    "{host} resolves to {ip}, which is {why}; the controller never connects there"
                )))
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The client for user-chosen addresses: the policy's resolver, no
/// redirects (a redirect could point anywhere), short timeouts.
pub fn client(policy: Arc<Policy>) -> reqwest::Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .dns_resolver(Arc::new(Resolver::new(policy)))
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(std::time::Duration::from_secs(5))
        .user_agent(concat!("agentrun/", env!("CARGO_PKG_VERSION")))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str], public: bool) -> Policy {
        Policy::new(
            allow.iter().map(|e| e.parse().expect("an entry")).collect(),
            deny.iter().map(|n| n.parse().expect("a range")).collect(),
            public,
        )
    }

    #[test]
    fn metadata_and_link_local_addresses_are_refused_even_when_allowed() {
        let everything = policy(&["0.0.0.0/0", "::/0"], &[], true);
        for bad in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fe80::1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://[64:ff9b::a9fe:a9fe]/",
            "http://[fd00:ec2::254]/",
            "http://100.100.100.200/",
            "http://0.0.0.0:80/",
        ] {
            assert!(everything.check_url(bad).is_err(), "{bad} passed");
            assert!(Policy::default().check_url(bad).is_err(), "{bad} passed");
        }
    }

    #[test]
    fn cluster_internal_addresses_are_refused_by_default_in_every_spelling() {
        let default = Policy::default();
        for bad in [
            "http://10.0.0.7/hook",
            "http://10.96.0.1:443/",
            "http://172.16.3.4/",
            "http://172.31.255.255/",
            "http://192.168.1.1/",
            "http://127.0.0.1:8080/mcp",
            "http://127.0.0.2/",
            "http://2130706433/", // 127.0.0.1 as one decimal number
            "http://0x7f.1/",     // 127.0.0.1 in hex shorthand
            "http://0177.0.0.1/", // 127.0.0.1 in octal
            "http://100.64.0.1/",
            "http://[::1]/",
            "http://[fd12:3456::1]/",
            "http://[::ffff:10.0.0.1]/",
            "http://[64:ff9b::a00:1]/", // NAT64 form of 10.0.0.1
        ] {
            let err = default.check_url(bad).expect_err(bad);
            assert!(
                err.contains("not on the platform's allow-list"),
                "{bad}: {err}"
            );
        }
        for good in [
            "https://mcp.example.com/",
            "http://8.8.8.8/",
            "http://172.32.0.1/",
        ] {
            assert_eq!(default.check_url(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn the_allow_list_opens_ranges_and_names_and_the_deny_list_wins() {
        let p = policy(
            &[
                "127.0.0.1",
                "10.1.0.0/16",
                "mcp.tools.svc:8443",
                "*.hooks.example",
            ],
            &["10.1.2.0/24"],
            true,
        );
        assert_eq!(p.check_url("http://127.0.0.1:9/mcp"), Ok(()));
        assert!(p.check_url("http://127.0.0.2:9/mcp").is_err());
        assert_eq!(p.check_url("http://10.1.9.9/"), Ok(()));
        let err = p.check_url("http://10.1.2.3/").expect_err("denied");
        assert!(err.contains("--user-url-deny"), "{err}");
        assert_eq!(p.check_url("https://MCP.tools.svc:8443/x"), Ok(()));
        let err = p
            .check_url("https://mcp.tools.svc/x")
            .expect_err("other port");
        assert!(err.contains("other ports only"), "{err}");
        assert!(p.host_allowed("a.hooks.example", Some(443)));
        assert!(!p.host_allowed("hooks.example.evil", Some(443)));
        assert!(!p.host_allowed("evilhooks.example", Some(443)));
        assert!(
            p.refusal("10.1.2.3".parse().unwrap(), true).is_some(),
            "deny wins over a name"
        );
    }

    #[test]
    fn without_public_addresses_only_the_listed_ones_pass() {
        let p = policy(&["203.0.113.0/24"], &[], false);
        assert_eq!(p.check_url("http://203.0.113.9/"), Ok(()));
        assert!(p.check_url("http://8.8.8.8/").is_err());
    }

    #[test]
    fn urls_with_credentials_or_other_schemes_are_refused() {
        let p = Policy::default();
        assert!(p.check_url("http://user:pw@mcp.example.com/").is_err());
        assert!(p.check_url("file:///etc/passwd").is_err());
        assert!(p.check_url("not a url").is_err());
    }

    #[test]
    fn entries_parse_or_say_why_not() {
        assert_eq!(
            "10.0.0.0/8".parse::<Entry>(),
            Ok(Entry::Net("10.0.0.0/8".parse().unwrap()))
        );
        assert_eq!(
            "[::1]".parse::<Entry>(),
            Ok(Entry::Net("::1/128".parse().unwrap()))
        );
        assert_eq!(
            "Svc.NS:80".parse::<Entry>(),
            Ok(Entry::Host {
                host: "svc.ns".into(),
                port: Some(80)
            })
        );
        for bad in ["10.0.0.0/33", "127.0.0.1:80", "user@host", "host/path", ""] {
            assert!(bad.parse::<Entry>().is_err(), "{bad:?} parsed");
        }
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_a_refused_address_is_refused() {
        use reqwest::dns::Resolve;
        let name = |n: &str| -> reqwest::dns::Name { n.parse().expect("a name") };
        // `localhost` resolves to loopback: refused by default...
        let err = Resolver::default()
            .resolve(name("localhost"))
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("loopback"), "{err}");
        // ...allowed by range or by name.
        let by_range = Resolver::new(Arc::new(policy(&["127.0.0.0/8", "::1"], &[], true)));
        assert!(by_range.resolve(name("localhost")).await.is_ok());
        let by_name = Resolver::new(Arc::new(policy(&["localhost"], &[], true)));
        assert!(by_name.resolve(name("localhost")).await.is_ok());
        // A literal link-local name resolves to itself, and is never allowed.
        let everything = Resolver::new(Arc::new(policy(&["0.0.0.0/0"], &[], true)));
        let err = everything
            .resolve(name("169.254.169.254"))
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("link-local"), "{err}");
    }
}
