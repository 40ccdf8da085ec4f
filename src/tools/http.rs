//! HTTP tools: arguments POSTed as JSON with an `Idempotency-Key` header.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;

use super::{CallContext, HttpKind, LookupOutcome, RetryPolicy, ToolOutcome, excerpt};

/// Largest response body accepted from a tool.
const MAX_BODY: usize = 4 * 1024 * 1024;
/// How much of an error body an observation quotes.
const QUOTED_BODY: usize = 500;

/// Headers of every tool request.
pub(crate) const HEADER_KEY: &str = "Idempotency-Key";
pub(crate) const HEADER_RUN: &str = "X-Agentrun-Run";
pub(crate) const HEADER_STEP: &str = "X-Agentrun-Step";

/// One attempt's answer.
enum Attempt {
    /// A 2xx with its body.
    Success(Vec<u8>, String),
    /// A definitive refusal (4xx other than 408 and 429).
    Refused(StatusCode, String),
    /// Worth another try. `sent` is false when the request certainly never
    /// reached the tool (connection refused), so repeating it is always safe.
    Transient { reason: String, sent: bool },
}

async fn attempt(request: reqwest::RequestBuilder) -> Attempt {
    let response = match request.send().await {
        Ok(response) => response,
        Err(e) => {
            return Attempt::Transient {
                reason: describe(&e),
                sent: !e.is_connect(),
            };
        }
    };
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("no content type")
        .to_string();
    let body = match read_body(response, MAX_BODY).await {
        Ok(body) => body,
        Err(e) => {
            return Attempt::Transient {
                reason: e.to_string(),
                sent: true,
            };
        }
    };
    if status.is_success() {
        Attempt::Success(body, content_type)
    } else if status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
    {
        Attempt::Transient {
            reason: format!("HTTP {status}{}", quoted(&body)),
            sent: true,
        }
    } else {
        Attempt::Refused(status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// Why a reply's body was not read whole.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    /// Past the reader's cap: read no further, nothing of it is used.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// The connection failed mid-body (in words without the URL's query).
    #[error("reading the response: {0}")]
    Read(String),
}

/// The body, or an error once it passes `cap` bytes (read no further).
pub(crate) async fn read_body(
    mut response: reqwest::Response,
    cap: usize,
) -> Result<Vec<u8>, BodyError> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > cap {
                    return Err(BodyError::TooLarge(cap));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => return Err(BodyError::Read(describe(&e))),
        }
    }
}

fn quoted(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    if text.trim().is_empty() {
        String::new()
    } else {
        format!(": {}", excerpt(&text, QUOTED_BODY))
    }
}

/// A reqwest error in words, without the URL's query (it may hold secrets).
fn describe(e: &reqwest::Error) -> String {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_body() || e.is_decode() {
        "broken response body"
    } else if e.is_request() {
        "request failed"
    } else {
        "error"
    };
    let mut source = std::error::Error::source(e);
    let mut detail = None;
    while let Some(s) = source {
        detail = Some(s.to_string());
        source = s.source();
    }
    match detail {
        Some(d) => format!("{what} ({d})"),
        None => what.to_string(),
    }
}

fn with_headers(
    request: reqwest::RequestBuilder,
    ctx: &CallContext,
    timeout: Duration,
) -> reqwest::RequestBuilder {
    request
        .timeout(timeout)
        .header(HEADER_KEY, &ctx.key)
        .header(HEADER_RUN, &ctx.run_uid)
        .header(HEADER_STEP, ctx.seq.to_string())
}

/// Makes an HTTP tool call, retrying transient failures with the same key.
///
/// A tool that is neither idempotent nor read-only is repeated after an
/// ambiguous failure (the request may have been processed: timeout, 5xx,
/// broken response) only when its lookup says the first attempt did not take
/// effect; when the lookup says it did, its recorded result is the outcome.
pub(crate) async fn call(
    client: &reqwest::Client,
    retry: &RetryPolicy,
    name: &str,
    tool: &HttpKind,
    args: &Value,
    ctx: &CallContext,
) -> ToolOutcome {
    let repeatable = tool.idempotent || tool.read_only;
    let mut attempt_no = 0u32;
    loop {
        attempt_no += 1;
        let request = with_headers(client.post(&tool.url), ctx, tool.timeout).json(args);
        let (reason, sent) = match attempt(request).await {
            Attempt::Success(body, content_type) => return success(name, &body, &content_type),
            Attempt::Refused(status, body) => {
                return ToolOutcome::failed(format!(
                    "{name}: the tool refused the call: HTTP {status}{}",
                    quoted(body.as_bytes())
                ));
            }
            Attempt::Transient { reason, sent } => (reason, sent),
        };
        tracing::debug!(tool = name, attempt = attempt_no, %reason, "tool call attempt failed");
        if attempt_no >= retry.attempts() {
            let note = if sent {
                " Whether it took effect is unknown."
            } else {
                " It did not reach the tool."
            };
            return ToolOutcome::failed(format!(
                "{name}: failed after {attempt_no} attempts: {reason}.{note}"
            ));
        }
        if sent && !repeatable {
            let Some(lookup_url) = &tool.lookup else {
                return ToolOutcome::failed(format!(
                    "{name}: {reason}. Whether it took effect is unknown, and the tool is not \
                     idempotent and has no lookup, so it was not repeated."
                ));
            };
            match lookup(client, retry, name, lookup_url, tool.timeout, ctx).await {
                LookupOutcome::Done(result) => return ToolOutcome::Ok(result),
                LookupOutcome::NotDone => {}
                LookupOutcome::Unknown { reason: why } => {
                    return ToolOutcome::failed(format!(
                        "{name}: {reason}. Whether it took effect is unknown ({why}), and the tool \
                         is not idempotent, so it was not repeated."
                    ));
                }
            }
        }
        tokio::time::sleep(retry.backoff(attempt_no)).await;
    }
}

fn success(name: &str, body: &[u8], content_type: &str) -> ToolOutcome {
    if body.iter().all(u8::is_ascii_whitespace) {
        return ToolOutcome::Ok(Value::Null);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => ToolOutcome::Ok(value),
        Err(_) => ToolOutcome::failed(format!(
            "{name}: the tool answered with a body that is not JSON ({content_type}){}. \
             It may have taken effect.",
            quoted(body)
        )),
    }
}

/// Asks a tool's lookup whether the call with `ctx.key` happened:
/// 200 with JSON = done (with its result), 404 = not done, anything else unknown.
pub(crate) async fn lookup(
    client: &reqwest::Client,
    retry: &RetryPolicy,
    name: &str,
    url: &str,
    timeout: Duration,
    ctx: &CallContext,
) -> LookupOutcome {
    let mut attempt_no = 0u32;
    loop {
        attempt_no += 1;
        let request = with_headers(client.get(url), ctx, timeout);
        let reason = match attempt(request).await {
            Attempt::Success(body, content_type) => {
                return match serde_json::from_slice::<Value>(&body) {
                    Ok(value) => LookupOutcome::Done(value),
                    Err(_) => LookupOutcome::Unknown {
                        reason: format!(
                            "{name}: the lookup answered with a body that is not JSON ({content_type})"
                        ),
                    },
                };
            }
            Attempt::Refused(StatusCode::NOT_FOUND, _) => return LookupOutcome::NotDone,
            Attempt::Refused(status, body) => {
                return LookupOutcome::Unknown {
                    reason: format!(
                        "{name}: the lookup answered HTTP {status}{}",
                        quoted(body.as_bytes())
                    ),
                };
            }
            Attempt::Transient { reason, .. } => reason,
        };
        if attempt_no >= retry.attempts() {
            return LookupOutcome::Unknown {
                reason: format!("{name}: the lookup failed after {attempt_no} attempts: {reason}"),
            };
        }
        tokio::time::sleep(retry.backoff(attempt_no)).await;
    }
}
