//! The log API (`log.agentrun.dev/v1alpha1` `runlogs`) as the plugin reads
//! it: through the user's own kube client, so the API server authenticates
//! the person and the serving replica authorizes them (DESIGN.md section
//! 10). What fails is told in the user's terms: which right is missing,
//! whether the API is installed, whether the run exists.

use std::pin::Pin;
use std::time::Duration;

use futures::{AsyncBufReadExt as _, Stream};
use kube::core::Status;

use crate::api::runlog::{LOG_GROUP, LOG_VERSION, MAX_PAGE, RUNLOGS, RunLog};
use crate::refusal::Refusal;

/// Lines of a follow stream (each a `WatchEvent`); an error is a dropped
/// connection.
pub type Lines = Pin<Box<dyn Stream<Item = std::io::Result<String>> + Send>>;

/// Why a request failed.
#[derive(Debug)]
pub enum Failure {
    /// Worth another try: the connection failed or dropped, or the server
    /// was briefly unavailable (a replica restarting: 503, 429...).
    Transient(String),
    /// Final: refused, not found, not installed, not understood.
    Final(LogApiError),
}

/// A request to the log API that will not succeed when asked again.
#[derive(Debug, thiserror::Error)]
pub enum LogApiError {
    /// A 404, in the user's terms: the log API is not installed, or there
    /// is no such run ([`not_found`]).
    #[error("{0}")]
    NotFound(Refusal),
    /// Any other refusal, in the user's terms: the right that is missing,
    /// the credentials, the server's failure ([`refused`]).
    #[error("{0}")]
    Refused(Refusal),
    #[error("reading the log of run {run} in namespace {ns} through the log API")]
    Request {
        run: String,
        ns: String,
        #[source]
        source: kube::Error,
    },
    #[error("building the request for {path}")]
    Build {
        path: String,
        #[source]
        source: hyper::http::Error,
    },
}

/// One run's log, through the API.
pub struct LogApi {
    client: kube::Client,
    ns: String,
    run: String,
}

impl LogApi {
    pub fn new(client: kube::Client, ns: &str, run: &str) -> LogApi {
        LogApi {
            client,
            ns: ns.to_string(),
            run: run.to_string(),
        }
    }

    /// `/apis/log.agentrun.dev/v1alpha1/namespaces/NS/runlogs/NAME`.
    pub fn path(&self) -> String {
        format!(
            "{}/namespaces/{}/{RUNLOGS}/{}",
            group_path(),
            segment(&self.ns),
            segment(&self.run)
        )
    }

    /// The path of the page after `token` (the first without one).
    pub fn page_path(&self, token: Option<&str>) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        // The largest page the server gives: a long log in few round trips.
        q.append_pair("limit", &MAX_PAGE.to_string());
        if let Some(t) = token {
            q.append_pair("continue", t);
        }
        format!("{}?{}", self.path(), q.finish())
    }

    /// The path of the one-record page at `seq` (what the server checked
    /// there: the head it compares with).
    pub fn record_path(&self, seq: u64) -> String {
        format!("{}?limit=1&fromSeq={seq}", self.path())
    }

    /// The path of a follow stream from `from_seq` on: the collection's
    /// watch of this one run, which the API server knows as a long-running
    /// request (verb `watch`). The named `?follow=true` form is an ordinary
    /// `get` to it, cut at its request timeout (60 s by default), which
    /// would make a run waiting for a person reconnect every minute.
    pub fn follow_path(&self, from_seq: u64) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        q.append_pair("watch", "true");
        q.append_pair("fieldSelector", &format!("metadata.name={}", self.run));
        q.append_pair("fromSeq", &from_seq.to_string());
        format!(
            "{}/namespaces/{}/{RUNLOGS}?{}",
            group_path(),
            segment(&self.ns),
            q.finish()
        )
    }

    /// One page of the log.
    pub async fn page(&self, token: Option<&str>) -> Result<RunLog, Failure> {
        let request = get(&self.page_path(token))?;
        match self.client.request::<RunLog>(request).await {
            Ok(page) => Ok(page),
            Err(e) => Err(self.failure(e, "get").await),
        }
    }

    /// The one-record page at `seq`.
    pub async fn record(&self, seq: u64) -> Result<RunLog, Failure> {
        let request = get(&self.record_path(seq))?;
        match self.client.request::<RunLog>(request).await {
            Ok(page) => Ok(page),
            Err(e) => Err(self.failure(e, "get").await),
        }
    }

    /// Opens a follow stream from `from_seq` on.
    pub async fn follow(&self, from_seq: u64) -> Result<Lines, Failure> {
        let mut request = get(&self.follow_path(from_seq))?;
        // One JSON document per line, read as it comes: no compression.
        request.headers_mut().insert(
            hyper::header::ACCEPT_ENCODING,
            hyper::header::HeaderValue::from_static("identity"),
        );
        match self.client.request_stream(request).await {
            Ok(body) => Ok(Box::pin(body.lines())),
            Err(e) => Err(self.failure(e, "watch").await),
        }
    }

    /// What a failed request means for the user (`verb` is the right it
    /// needed).
    async fn failure(&self, e: kube::Error, verb: &str) -> Failure {
        match e {
            kube::Error::Api(s) if s.code == 404 => {
                let served = self.group_served().await;
                Failure::Final(LogApiError::NotFound(Refusal::new(not_found(
                    &s, &self.ns, &self.run, served,
                ))))
            }
            kube::Error::Api(s) => match transient(&s) {
                true => Failure::Transient(format!(
                    "the log API answered {} {}",
                    s.code,
                    crate::client::approvals::visible(&s.message)
                )),
                false => Failure::Final(LogApiError::Refused(Refusal::new(refused(
                    &s, verb, &self.ns,
                )))),
            },
            kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => {
                Failure::Transient(format!("connecting to the API server: {e}"))
            }
            source => Failure::Final(LogApiError::Request {
                run: self.run.clone(),
                ns: self.ns.clone(),
                source,
            }),
        }
    }

    /// Whether the API server serves the log API's group at all (`None`:
    /// could not tell).
    async fn group_served(&self) -> Option<bool> {
        let request = get(&group_path()).ok()?;
        match self.client.request_text(request).await {
            Ok(_) => Some(true),
            Err(kube::Error::Api(s)) if s.code == 404 => Some(false),
            Err(_) => None,
        }
    }
}

/// `/apis/log.agentrun.dev/v1alpha1`.
fn group_path() -> String {
    format!("/apis/{LOG_GROUP}/{LOG_VERSION}")
}

/// A name as one path segment (names are DNS labels; anything else a user
/// typed cannot reach another path).
fn segment(s: &str) -> String {
    // RFC 3986 unreserved characters stay as they are.
    const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    match s {
        // Not a name, a step up or in place: kept from resolving.
        "." | ".." => s.replace('.', "%2E"),
        _ => percent_encoding::utf8_percent_encode(s, SEGMENT).to_string(),
    }
}

fn get(path: &str) -> Result<hyper::Request<Vec<u8>>, Failure> {
    hyper::Request::get(path)
        .header(hyper::header::ACCEPT, "application/json")
        .body(Vec::new())
        .map_err(|source| {
            Failure::Final(LogApiError::Build {
                path: path.to_string(),
                source,
            })
        })
}

/// Whether a failed answer may succeed when asked again: the server or a
/// replica behind the aggregator was unavailable, overloaded or cut off
/// (429, 502, 503, 504). A 500 is the server's final word (the log API
/// answers one for a log that does not verify).
pub fn transient(s: &Status) -> bool {
    matches!(s.code, 429 | 502 | 503 | 504)
}

/// The message of a 404: the log API is not installed, or the run does
/// not exist.
pub fn not_found(s: &Status, ns: &str, run: &str, group_served: Option<bool>) -> String {
    match group_served {
        Some(false) => format!(
            "the log API ({LOG_GROUP}/{LOG_VERSION}) is not installed in this cluster: \
             the agentrun chart installs it with the controller; \
             administrators can read the store directly with --store-url"
        ),
        _ => format!(
            "no run {run} in namespace {ns} (the log API: {})",
            crate::client::approvals::visible(&s.message)
        ),
    }
}

/// The message of any other refusal (403 first: the missing right).
pub fn refused(s: &Status, verb: &str, ns: &str) -> String {
    let message = crate::client::approvals::visible(&s.message);
    match s.code {
        403 => format!(
            "you may not {verb} runlogs in namespace {ns} (ask for the agentrun-log-reader role): {message}"
        ),
        401 => format!("the API server did not accept your credentials: {message}"),
        code if code >= 500 => format!(
            "the log API failed ({code} {}): {message}",
            crate::client::approvals::visible(&s.reason)
        ),
        code => format!(
            "the log API refused the request ({code} {}): {message}",
            crate::client::approvals::visible(&s.reason)
        ),
    }
}

/// Bounded retries with a growing pause: a replica restarting is waited
/// for, a cluster that is gone is not waited for forever.
#[derive(Clone, Debug)]
pub struct Retry {
    attempts: u32,
    used: u32,
    first: Duration,
    cap: Duration,
}

impl Retry {
    /// `attempts` tries, pausing `first`, doubling up to `cap`.
    pub fn new(attempts: u32, first: Duration, cap: Duration) -> Retry {
        Retry {
            attempts,
            used: 0,
            first,
            cap,
        }
    }

    /// Following: 30 tries over about a minute.
    pub fn follow() -> Retry {
        Retry::new(30, Duration::from_millis(250), Duration::from_secs(2))
    }

    /// Reading pages: a few seconds.
    pub fn pages() -> Retry {
        Retry::new(5, Duration::from_millis(250), Duration::from_secs(2))
    }

    /// Progress was made: the next failure starts the count again.
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The pause before the next try, or `None` when none is left.
    pub fn next_pause(&mut self) -> Option<Duration> {
        if self.used >= self.attempts {
            return None;
        }
        let pause = self
            .first
            .saturating_mul(1u32 << self.used.min(16))
            .min(self.cap);
        self.used += 1;
        Some(pause)
    }

    /// Tries used since the last progress, and how many there are.
    pub fn count(&self) -> (u32, u32) {
        (self.used, self.attempts)
    }
}
