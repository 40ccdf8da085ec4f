//! Where a call goes, and whether that lies under an endpoint a platform
//! policy names. The platform owner writes a URL prefix; the agent author
//! writes the tool's URL and may spell the same endpoint many ways
//! (`%72efunds`, `x/../refunds`, `refunds/`, `PAY.example.`). Both are
//! reduced to an origin and path segments before they are compared, and
//! since a server may read a path in more than one way (is `%2F` a
//! separator? are empty segments dropped? is the path case-sensitive?),
//! every reading is considered: a gate applies when ANY reading lies under
//! its prefix, an exemption only when EVERY reading does.

use percent_encoding::percent_decode_str;

/// How a rule and a call are compared: a gate over-matches when in doubt,
/// an exemption under-matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// Applies when some reading of the URL lies under the prefix (segments
    /// compared without regard to ASCII case).
    Any,
    /// Applies only when every reading lies under it (exact segments).
    Every,
}

/// Is `url` at or below `prefix` under `reading`? An URL that does not parse
/// (or is not http/https) lies under nothing.
pub fn within(url: &str, prefix: &str, reading: Reading) -> bool {
    let (Some(target), Some(base)) = (Parsed::new(url), Parsed::new(prefix)) else {
        return false;
    };
    if target.origin != base.origin {
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
        Reading::Any => target.readings.iter().any(under),
        Reading::Every => target.readings.iter().all(under),
    }
}

/// Are two MCP tool names the same tool, under `reading`?
pub fn same_tool(a: &str, b: &str, reading: Reading) -> bool {
    match reading {
        Reading::Any => a.eq_ignore_ascii_case(b),
        Reading::Every => a == b,
    }
}

#[derive(Debug)]
struct Parsed {
    /// Scheme, host (lowercased, without a trailing dot) and port.
    origin: (String, String, u16),
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
        let host = url.host_str()?.trim_end_matches('.').to_ascii_lowercase();
        let origin = (url.scheme().to_string(), host, url.port_or_known_default()?);
        let decoded: Vec<String> = url
            .path_segments()
            .map(|s| s.map(decode).collect())
            .unwrap_or_default();
        // Decoded once, `%2F` and `\` may be separators and `..` may appear.
        let resplit = resolve_dots(decoded.join("/").split(['/', '\\']));
        Some(Parsed {
            origin,
            readings: vec![decoded, resplit],
        })
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
            assert!(within(url, RULE, Reading::Any), "{url} escaped the rule");
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
            assert!(!within(url, RULE, Reading::Any), "{url} matched the rule");
        }
        assert!(within(
            "https://pay.example/anything",
            "https://pay.example/",
            Reading::Any
        ));
    }

    #[test]
    fn an_exemption_holds_only_when_every_reading_agrees() {
        let ro = "https://pay.example/lookup";
        assert!(within("https://pay.example/lookup/42", ro, Reading::Every));
        assert!(within("https://pay.example/%6Cookup", ro, Reading::Every));
        for url in [
            // A server that treats %2F as a separator reaches /refunds.
            "https://pay.example/lookup/..%2Frefunds",
            "https://pay.example/lookup%2F..%2F..%2Frefunds",
            "https://pay.example/LOOKUP",
            "https://pay.example/lookupx",
        ] {
            assert!(
                !within(url, ro, Reading::Every),
                "{url} passed as read-only"
            );
        }
    }
}
