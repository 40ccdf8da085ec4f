//! Where a call goes, and whether that lies under an endpoint a platform
//! policy names. The platform owner writes a URL prefix; the agent author
//! writes the tool's URL and may spell the same endpoint many ways
//! (`%72efunds`, `x/../refunds`, `refunds/`, `PAY.example.`, `localhost`
//! for `127.0.0.1`, a Service's short name or its ClusterIP). Both are
//! reduced to the host they lead to ([`super::host`]), a port and path
//! segments before they are compared, and since a server may read a path in
//! more than one way (is `%2F` a separator? are empty segments dropped? is
//! the path case-sensitive?), every reading is considered: a gate applies
//! when ANY reading lies under its prefix, an exemption only when EVERY
//! reading does.

use percent_encoding::percent_decode_str;

use super::host::{self, Network};

/// How a rule and a call are compared: a gate over-matches when in doubt,
/// an exemption under-matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// Applies when some reading of the URL lies under the prefix (segments
    /// compared without regard to ASCII case), on a host either may lead to
    /// (what names resolved to included), on the same port whatever the
    /// scheme (one socket).
    Any,
    /// Applies only when every reading lies under it (exact segments), on
    /// the same scheme and port, and the URL's host is a spelling of the
    /// prefix's.
    Every,
}

/// Is `url` at or below `prefix` under `reading`, seen from `net`? An URL
/// that does not parse (or is not http/https) lies under nothing.
pub fn within(url: &str, prefix: &str, reading: Reading, net: &Network) -> bool {
    let (Some(target), Some(base)) = (Parsed::new(url), Parsed::new(prefix)) else {
        return false;
    };
    target.path_under(&base, reading)
        && host::same_host(&target.host, &base.host, reading == Reading::Any, net)
}

/// The names to look up before deciding whether `url` lies under the gate
/// `prefix` ([`Reading::Any`]): none when its port or path already tell.
pub fn lookups(url: &str, prefix: &str, namespace: &str) -> Vec<String> {
    let (Some(target), Some(base)) = (Parsed::new(url), Parsed::new(prefix)) else {
        return Vec::new();
    };
    if !target.path_under(&base, Reading::Any) {
        return Vec::new();
    }
    let mut names = host::lookups(&target.host, namespace);
    names.extend(host::lookups(&base.host, namespace));
    names
}

/// Are two MCP tool names the same tool, under `reading`?
pub fn same_tool(a: &str, b: &str, reading: Reading) -> bool {
    match reading {
        Reading::Any => a.eq_ignore_ascii_case(b),
        Reading::Every => a == b,
    }
}

/// Why `url` is too ambiguous to be allowed anything, if it is: what the
/// URL parser keeps and a server may still read differently. An encoded
/// `/` or `\` or a dot segment or `%` left after decoding a segment
/// (`..%2F`, `%252e`), an empty segment (`//`), user information, a query or
/// a fragment. A gate needs no such check (it applies when any reading lies
/// under it); an allowance does (`allowedSecrets[].endpoints`).
pub fn ambiguity(url: &str) -> Option<String> {
    let parsed = match url::Url::parse(url.trim()) {
        Ok(parsed) => parsed,
        Err(e) => return Some(format!("{url:?} is not a URL: {e}")),
    };
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Some(format!("{url:?} carries a user name or password"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Some(format!("{url:?} has a query or fragment"));
    }
    if parsed.host().is_none() {
        return Some(format!("{url:?} names no host"));
    }
    let mut raw: Vec<&str> = parsed.path().split('/').skip(1).collect();
    if raw.last() == Some(&"") {
        raw.pop();
    }
    raw.into_iter()
        .find_map(|segment| segment_ambiguity(url, segment))
}

fn segment_ambiguity(url: &str, segment: &str) -> Option<String> {
    if segment.is_empty() {
        return Some(format!("{url:?} has an empty path segment (//)"));
    }
    let Ok(decoded) = percent_decode_str(segment).decode_utf8() else {
        return Some(format!(
            "{url:?} has a path segment that is not UTF-8 once decoded"
        ));
    };
    (decoded.contains(['/', '\\', '%']) || decoded == "." || decoded == "..").then(|| {
        format!("{url:?} has an encoded slash, backslash, percent sign or dot segment in its path")
    })
}

/// Does the allowance `allowed` let a request go to `endpoint`, from a step
/// pod in `namespace`? Neither may be ambiguous, and `endpoint` lies under
/// `allowed` in every reading ([`Reading::Every`]): same scheme and port, a
/// host that is a spelling of `allowed`'s (what names resolve to never
/// widens an allowance), `allowed`'s path segments the first of
/// `endpoint`'s.
pub fn allows(endpoint: &str, allowed: &str, namespace: &str) -> bool {
    ambiguity(endpoint).is_none()
        && ambiguity(allowed).is_none()
        && within(endpoint, allowed, Reading::Every, &Network::of(namespace))
}

#[derive(Debug)]
struct Parsed {
    scheme: String,
    host: url::Host<String>,
    port: u16,
    /// The path's segments as a server might read them.
    readings: Vec<Vec<String>>,
}

impl Parsed {
    fn new(raw: &str) -> Option<Parsed> {
        // The URL standard's parser: lowercases the host, normalizes IP
        // literals, and removes `.`/`..` segments (`%2e` spellings included).
        let url = url::Url::parse(raw.trim()).ok()?;
        if !matches!(url.scheme(), "http" | "https") {
            return None;
        }
        let decoded: Vec<String> = url
            .path_segments()
            .map(|s| s.map(decode).collect())
            .unwrap_or_default();
        // Decoded once, `%2F` and `\` may be separators and `..` may appear.
        let resplit = resolve_dots(decoded.join("/").split(['/', '\\']));
        Some(Parsed {
            scheme: url.scheme().to_string(),
            host: url.host()?.to_owned(),
            port: url.port_or_known_default()?,
            readings: vec![decoded, resplit],
        })
    }

    /// Same port (and scheme, for an exemption), and the path under `base`'s
    /// in the readings `reading` asks for. Hosts are compared apart.
    fn path_under(&self, base: &Parsed, reading: Reading) -> bool {
        if self.port != base.port || (reading == Reading::Every && self.scheme != base.scheme) {
            return false;
        }
        let Some(base_path) = base.readings.first() else {
            return false;
        };
        let base_path: Vec<&String> = base_path.iter().filter(|s| !s.is_empty()).collect();
        let under = |path: &Vec<String>| {
            let path: Vec<&String> = match reading {
                // Trailing and doubled slashes say nothing about the endpoint.
                Reading::Any => path.iter().filter(|s| !s.is_empty()).collect(),
                Reading::Every => path.iter().collect(),
            };
            path.len() >= base_path.len()
                && path.iter().zip(&base_path).all(|(p, b)| match reading {
                    Reading::Any => p.eq_ignore_ascii_case(b),
                    Reading::Every => p == b,
                })
        };
        match reading {
            Reading::Any => self.readings.iter().any(under),
            Reading::Every => self.readings.iter().all(under),
        }
    }
}

fn decode(segment: &str) -> String {
    percent_decode_str(segment).decode_utf8_lossy().into_owned()
}

/// RFC 3986 dot-segment removal over already split segments.
fn resolve_dots<'a>(segments: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for segment in segments {
        match segment {
            "." => {}
            ".." => {
                out.pop();
            }
            other => out.push(other.to_string()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: &str = "https://pay.example/refunds";
    static NET: std::sync::LazyLock<Network> = std::sync::LazyLock::new(|| Network::of("shop"));

    #[test]
    fn every_spelling_of_the_endpoint_is_under_a_gate() {
        for url in [
            "https://pay.example/refunds",
            "https://pay.example/refunds/",
            "https://pay.example/refunds/42?x=1",
            "https://PAY.Example./refunds",
            "https://pay.example:443/refunds",
            "https://pay.example/%72efunds",
            "https://pay.example/REFUNDS",
            "https://pay.example//refunds",
            "https://pay.example/x/../refunds",
            "https://pay.example/x/%2e%2e/refunds",
            "https://pay.example/x/..%2Frefunds",
            "https://pay.example/x%2F..%2Frefunds",
            "https://pay.example/x\\..\\refunds",
            "https://someone@pay.example/refunds",
        ] {
            assert!(
                within(url, RULE, Reading::Any, &NET),
                "{url} escaped the rule"
            );
        }
    }

    #[test]
    fn other_endpoints_are_not_under_a_gate() {
        for url in [
            "https://pay.example/refundsx",
            "https://pay.example/lookup",
            "http://pay.example/refunds",
            "https://pay.example:8443/refunds",
            "https://pay.example.evil/refunds",
            "https://pay.example@evil.example/refunds",
            "not a url",
            "file:///refunds",
        ] {
            assert!(
                !within(url, RULE, Reading::Any, &NET),
                "{url} matched the rule"
            );
        }
        assert!(within(
            "https://pay.example/anything",
            "https://pay.example/",
            Reading::Any,
            &NET
        ));
    }

    #[test]
    fn an_exemption_holds_only_when_every_reading_agrees() {
        let ro = "https://pay.example/lookup";
        assert!(within(
            "https://pay.example/lookup/42",
            ro,
            Reading::Every,
            &NET
        ));
        assert!(within(
            "https://pay.example/%6Cookup",
            ro,
            Reading::Every,
            &NET
        ));
        for url in [
            // A server that treats %2F as a separator reaches /refunds.
            "https://pay.example/lookup/..%2Frefunds",
            "https://pay.example/lookup%2F..%2F..%2Frefunds",
            "https://pay.example/LOOKUP",
            "https://pay.example/lookupx",
        ] {
            assert!(
                !within(url, ro, Reading::Every, &NET),
                "{url} passed as read-only"
            );
        }
    }

    #[test]
    fn a_gate_on_loopback_catches_every_loopback_spelling_of_the_server() {
        let rule = "http://127.0.0.1:8080/tools/refund";
        for url in [
            "http://localhost:8080/tools/refund",
            "http://LocalHost.:8080/tools/refund",
            "http://[::ffff:127.0.0.1]:8080/tools/refund",
            "http://[::1]:8080/tools/refund",
            "http://2130706433:8080/tools/refund",
            "http://0x7f.1:8080/tools/refund",
            "http://0177.0.0.1:8080/tools/refund",
            "http://127.1:8080/tools/refund",
            "http://0.0.0.0:8080/tools/refund",
            "https://localhost:8080/tools/refund",
            "http://refunds.localhost:8080/tools/refund/42",
        ] {
            assert!(
                within(url, rule, Reading::Any, &NET),
                "{url} escaped the rule"
            );
        }
        for url in [
            "http://localhost:8081/tools/refund",
            "http://127.0.0.1.evil.com:8080/tools/refund",
            "http://localhost.evil.com:8080/tools/refund",
            "http://127.0.0.1@evil.example:8080/tools/refund",
            "http://localhost:8080/tools/lookup",
        ] {
            assert!(
                !within(url, rule, Reading::Any, &NET),
                "{url} matched the rule"
            );
        }
    }

    #[test]
    fn a_gate_on_a_service_catches_its_names_and_its_cluster_ip() {
        let mut net = Network::of("shop");
        net.resolved.insert(
            "pay.shop.svc.cluster.local".into(),
            vec!["10.96.0.12".parse().unwrap()],
        );
        for rule in [
            "http://pay.shop/refunds",
            "http://pay.shop.svc.cluster.local/refunds",
            "http://pay/refunds",
        ] {
            for url in [
                "http://pay/refunds",
                "http://pay.shop/refunds",
                "http://pay.shop.svc/refunds",
                "http://pay.shop.svc.cluster.local./refunds",
                "http://10.96.0.12/refunds",
                "http://[::ffff:10.96.0.12]:80/refunds",
            ] {
                assert!(
                    within(url, rule, Reading::Any, &net),
                    "{url} escaped {rule}"
                );
            }
        }
        // The names to look up to know: the call's and the rule's, when the
        // port and path do not already tell.
        assert_eq!(
            lookups("http://alias.example/refunds", "http://pay/refunds", "shop"),
            vec![
                "alias.example",
                "alias.example.svc.cluster.local",
                "pay",
                "pay.shop.svc.cluster.local"
            ]
        );
        assert!(lookups("http://alias.example/other", "http://pay/refunds", "shop").is_empty());
        assert!(
            lookups(
                "http://alias.example:81/refunds",
                "http://pay/refunds",
                "shop"
            )
            .is_empty()
        );
    }
}

#[cfg(test)]
mod allowance_tests {
    use super::*;
    fn within(endpoint: &str, allowed: &str, namespace: &str) -> bool {
        allows(endpoint, allowed, namespace)
    }
    fn normalize(url: &str) -> Result<(), String> {
        ambiguity(url).map_or(Ok(()), Err)
    }

    const ALLOWED: &str = "https://models.example.com/openai/";
    /// The run's namespace.
    const NS: &str = "ai";

    #[test]
    fn endpoints_below_the_prefix_pass_in_any_plain_spelling() {
        for good in [
            "https://models.example.com/openai",
            "https://models.example.com/openai/",
            "https://models.example.com/openai/v1",
            "HTTPS://Models.Example.COM/openai/v1",
            "https://models.example.com:443/openai/v1",
            "https://models.example.com./openai/v1",
            "https://models.example.com/openai/x/../v1",
            "https://models.example.com/openai/%2e/v1",
            "https://models.example.com/%6Fpenai/v1", // an encoded `o`
        ] {
            assert!(within(good, ALLOWED, NS), "{good} refused");
        }
        for spelling in [
            "http://127.0.0.1:8080/v1",
            "http://2130706433:8080/v1",
            "http://localhost:8080/v1",
            "http://[::ffff:127.0.0.1]:8080/v1",
        ] {
            assert!(within(spelling, "http://127.0.0.1:8080", NS), "{spelling}");
        }
        // A Service by any of its names in the run's namespace.
        for spelling in [
            "http://llm/v1",
            "http://llm.ai/v1",
            "http://llm.ai.svc/v1",
            "http://llm.ai.svc.cluster.local./v1",
        ] {
            assert!(within(spelling, "http://llm.ai/", NS), "{spelling}");
            // `llm.ai` may also be a public host: the short name is not it.
            let public = spelling == "http://llm.ai/v1";
            assert_eq!(within(spelling, "http://llm/", NS), !public, "{spelling}");
        }
    }

    #[test]
    fn every_trick_to_leave_the_prefix_is_refused() {
        for bad in [
            // `..` and `.`, plain and percent-encoded: resolved, then outside.
            "https://models.example.com/openai/../admin",
            "https://models.example.com/openai/%2e%2e/admin",
            "https://models.example.com/openai/.%2E/admin",
            "https://models.example.com/openai/..",
            // An encoded slash or backslash a server may decode before routing.
            "https://models.example.com/openai/..%2Fadmin",
            "https://models.example.com/openai/..%2fadmin",
            "https://models.example.com/openai/..%5Cadmin",
            "https://models.example.com/openai\\..\\admin",
            // Double encoding.
            "https://models.example.com/openai/%252e%252e/admin",
            // Double slashes.
            "https://models.example.com//openai/v1",
            "https://models.example.com/openai//v1",
            // Another port, scheme or host.
            "https://models.example.com:8443/openai/v1",
            "http://models.example.com/openai/v1",
            "https://models.example.com.evil.example/openai/v1",
            "https://evil.example/openai/v1",
            // A prefix of a segment is not the segment.
            "https://models.example.com/openai-admin/v1",
            // User information, query, fragment.
            "https://models.example.com@evil.example/openai/v1",
            "https://user@models.example.com/openai/v1",
            "https://:pw@models.example.com/openai/v1",
            "https://models.example.com/openai/v1?x=1",
            "https://models.example.com/openai/v1#x",
            "not a url",
        ] {
            assert!(!within(bad, ALLOWED, NS), "{bad} passed");
        }
        // A name that may be a public host is not the Service's full name,
        // and what a name resolves to never counts for an allowance.
        assert!(!within(
            "http://llm.ai/v1",
            "http://llm.ai.svc.cluster.local/",
            NS
        ));
        assert!(!within("http://10.96.0.9/v1", "http://llm.ai/", NS));
        assert!(!within(
            "http://localhost.evil.example/v1",
            "http://localhost/",
            NS
        ));
    }

    #[test]
    fn an_ambiguous_endpoint_says_why() {
        let err = normalize("https://models.example.com/openai/..%2Fadmin").unwrap_err();
        assert!(err.contains("encoded slash"), "{err}");
        let err = normalize("https://u@models.example.com/").unwrap_err();
        assert!(err.contains("user name"), "{err}");
        let err = normalize("https://models.example.com//v1").unwrap_err();
        assert!(err.contains("empty path segment"), "{err}");
    }
}
