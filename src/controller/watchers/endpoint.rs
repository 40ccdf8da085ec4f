//! Whether a model endpoint lies within an endpoint an opted-in Secret may
//! be sent to (`allowedSecrets[].endpoints`), compared after normalizing
//! both: the check must see the place the request really goes, whatever
//! spelling the agent author chose.
//!
//! The URL parser already resolves `.` and `..` segments (also as `%2e`),
//! lower-cases the scheme and host, decodes IPv4 spellings and drops a
//! default port. Hosts are compared as the places they name
//! ([`crate::policy::host`]: `localhost` is `127.0.0.1`, a Service's short
//! names are its full name in the run's namespace), and an endpoint is
//! allowed only when every place its host may name is one the allowed
//! prefix names; what names resolve to never widens an allowance. What the
//! parser keeps, and a server may still read differently, is refused: an
//! encoded `/` or `\` or a dot segment or `%` left after decoding a segment
//! (`..%2F`, `%252e`), an empty segment (`//`), user information, a query
//! or a fragment.

use crate::policy::host::{self, Network};
use crate::refusal::Refusal;

/// A URL as the check compares it.
#[derive(Debug, PartialEq, Eq)]
pub struct Normalized {
    scheme: String,
    host: url::Host<String>,
    port: Option<u16>,
    /// The path's segments, percent-decoded, without a trailing empty one.
    segments: Vec<String>,
}

/// `url` normalized, or why it is too ambiguous to be checked.
pub fn normalize(url: &str) -> Result<Normalized, Refusal> {
    let parsed = url::Url::parse(url.trim()).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(format!("{url:?} carries a user name or password").into());
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("{url:?} has a query or fragment").into());
    }
    let Some(host) = parsed.host().map(|h| h.to_owned()) else {
        return Err(format!("{url:?} names no host").into());
    };
    let mut raw: Vec<&str> = parsed.path().split('/').skip(1).collect();
    if raw.last() == Some(&"") {
        raw.pop();
    }
    let mut segments = Vec::with_capacity(raw.len());
    for segment in raw {
        segments.push(decode_segment(url, segment)?);
    }
    Ok(Normalized {
        scheme: parsed.scheme().to_string(),
        host,
        port: parsed.port_or_known_default(),
        segments,
    })
}

fn decode_segment(url: &str, segment: &str) -> Result<String, Refusal> {
    if segment.is_empty() {
        return Err(format!("{url:?} has an empty path segment (//)").into());
    }
    let decoded = percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .map_err(|_| format!("{url:?} has a path segment that is not UTF-8 once decoded"))?;
    if decoded.contains(['/', '\\', '%']) || decoded == "." || decoded == ".." {
        return Err(format!(
            "{url:?} has an encoded slash, backslash, percent sign or dot segment in its path"
        )
        .into());
    }
    Ok(decoded.into_owned())
}

/// Is `endpoint` at or below `allowed`, for a step pod in `namespace`: same
/// scheme and port, a host that is a spelling of `allowed`'s, and
/// `allowed`'s path segments are the first of `endpoint`'s. A URL that does
/// not normalize is within nothing.
pub fn within(endpoint: &str, allowed: &str, namespace: &str) -> bool {
    let (Ok(e), Ok(a)) = (normalize(endpoint), normalize(allowed)) else {
        return false;
    };
    e.scheme == a.scheme
        && e.port == a.port
        && e.segments.starts_with(&a.segments)
        && host::same_host(&e.host, &a.host, false, &Network::of(namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

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
