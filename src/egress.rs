//! Requests the controller makes to addresses users chose (MCP discovery
//! when a run starts, approval webhooks): never to link-local or cloud
//! metadata addresses, where a node's credentials live. Enforced after DNS
//! resolution (a name that resolves there is refused too) and for IP
//! literals, which reqwest does not resolve.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// Why `ip` may not be reached from the controller, if it may not.
pub fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => forbidden_v4(v4),
            None => forbidden_v6(v6),
        },
    }
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

/// Refuses a URL whose host is a forbidden IP literal (names are checked
/// when they resolve, by `Resolver`).
pub fn check_url(url: &str) -> Result<(), String> {
    let parsed = url::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    let ip = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
        _ => return Ok(()),
    };
    match forbidden(ip) {
        Some(why) => Err(format!(
            "{url}: {ip} is {why}; the controller never connects there"
        )),
        None => Ok(()),
    }
}

/// A DNS resolver for reqwest that drops forbidden addresses.
#[derive(Debug, Default, Clone)]
pub struct Resolver;

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_string();
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = all
                .iter()
                .copied()
                .filter(|a| forbidden(a.ip()).is_none())
                .collect();
            if allowed.is_empty() && !all.is_empty() {
                let why = forbidden(all[0].ip()).unwrap_or("forbidden");
                return Err(format!(
                    "{host} resolves to {}, which is {why}; the controller never connects there",
                    all[0].ip()
                )
                .into());
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The client for user-chosen addresses: guarded resolver, no redirects (a
/// redirect could point anywhere), short timeouts.
pub fn client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .dns_resolver(Arc::new(Resolver))
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(std::time::Duration::from_secs(5))
        .user_agent(concat!("agentrun/", env!("CARGO_PKG_VERSION")))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_link_local_addresses_are_refused_ordinary_ones_pass() {
        for bad in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fe80::1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://[fd00:ec2::254]/",
            "http://100.100.100.200/",
            "http://0.0.0.0:80/",
        ] {
            assert!(check_url(bad).is_err(), "{bad} passed");
        }
        for good in [
            "http://127.0.0.1:8080/mcp",
            "https://mcp.example.com/",
            "http://10.0.0.7/hook",
        ] {
            assert_eq!(check_url(good), Ok(()), "{good}");
        }
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_a_forbidden_address_is_refused() {
        use reqwest::dns::Resolve;
        // `localhost` resolves to loopback: allowed.
        let name: reqwest::dns::Name = "localhost".parse().expect("a name");
        assert!(Resolver.resolve(name).await.is_ok());
        // A literal link-local name resolves to itself.
        let name: reqwest::dns::Name = "169.254.169.254".parse().expect("a name");
        let err = Resolver.resolve(name).await.err().expect("refused");
        assert!(err.to_string().contains("link-local"), "{err}");
    }
}
