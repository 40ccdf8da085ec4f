//! Whether a model endpoint lies within an endpoint an opted-in Secret may
//! be sent to (`allowedSecrets[].endpoints`), compared after normalizing
//! both: the check must see the place the request really goes, whatever
//! spelling the agent author chose.
//!
//! The URL parser already resolves `.` and `..` segments (also as `%2e`),
//! lower-cases the scheme and host, decodes IPv4 spellings and drops a
//! default port. What it keeps, and a server may still read differently,
//! is refused: an encoded `/` or `\` or a dot segment or `%` left after
//! decoding a segment (`..%2F`, `%252e`), an empty segment (`//`), user
//! information, a query or a fragment.

/// A URL as the check compares it.
#[derive(Debug, PartialEq, Eq)]
pub struct Normalized {
    scheme: String,
    host: String,
    port: Option<u16>,
    /// The path's segments, percent-decoded, without a trailing empty one.
    segments: Vec<String>,
}

/// `url` normalized, or why it is too ambiguous to be checked.
pub fn normalize(url: &str) -> Result<Normalized, String> {
    let parsed = url::Url::parse(url.trim()).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(format!("{url:?} carries a user name or password"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("{url:?} has a query or fragment"));
    }
    let host = match parsed.host() {
        Some(url::Host::Domain(d)) => d.trim_end_matches('.').to_string(),
        Some(host) => host.to_string(),
        None => return Err(format!("{url:?} names no host")),
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

fn decode_segment(url: &str, segment: &str) -> Result<String, String> {
    if segment.is_empty() {
        return Err(format!("{url:?} has an empty path segment (//)"));
    }
    let decoded = percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .map_err(|_| format!("{url:?} has a path segment that is not UTF-8 once decoded"))?;
    if decoded.contains(['/', '\\', '%']) || decoded == "." || decoded == ".." {
        return Err(format!(
            "{url:?} has an encoded slash, backslash, percent sign or dot segment in its path"
        ));
    }
    Ok(decoded.into_owned())
}

/// Is `endpoint` at or below `allowed`: same scheme, host and port, and
/// `allowed`'s path segments are the first of `endpoint`'s. A URL that does
/// not normalize is within nothing.
pub fn within(endpoint: &str, allowed: &str) -> bool {
    let (Ok(e), Ok(a)) = (normalize(endpoint), normalize(allowed)) else {
        return false;
    };
    e.scheme == a.scheme
        && e.host == a.host
        && e.port == a.port
        && e.segments.starts_with(&a.segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOWED: &str = "https://models.example.com/openai/";

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
            assert!(within(good, ALLOWED), "{good} refused");
        }
        assert!(within("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"));
        assert!(within(
            "http://2130706433:8080/v1",
            "http://127.0.0.1:8080/"
        ));
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
            assert!(!within(bad, ALLOWED), "{bad} passed");
        }
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
