//! Model providers (DESIGN.md section 7): OpenAI-compatible chat completions
//! and the Anthropic Messages API behind one provider-neutral interface.
//!
//! The types here are recorded in the step log as JSON (camelCase), so their
//! serialized shape is part of the log format: change it only compatibly.
//!
//! A malformed reply never crashes anything: tool-call arguments that are not
//! a JSON object come back as `Value::String(raw)` so the caller can record
//! them and tell the model; a body that is not the expected JSON at all is
//! [`ModelError::Malformed`]. The API key is never logged and never appears in
//! an error (a provider that echoes it has it redacted).

mod anthropic;
mod openai;

use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};

use crate::api::{ModelSpec, Prices, Provider};

/// Default public endpoint of OpenAI's API (chat completions live under it).
pub const OPENAI_DEFAULT_ENDPOINT: &str = "https://api.openai.com/v1";
/// Default public endpoint of Anthropic's API (`/v1/messages` is appended).
pub const ANTHROPIC_DEFAULT_ENDPOINT: &str = "https://api.anthropic.com";
/// `anthropic-version` header sent with every Messages request.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` sent to Anthropic (where it is required) when the spec sets none.
pub const ANTHROPIC_DEFAULT_MAX_TOKENS: u32 = 4096;

/// One model call, provider-neutral.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelRequest {
    /// System prompt (may be empty).
    pub system: String,
    /// Conversation so far, oldest first.
    pub messages: Vec<Message>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Vec<ToolDef>,
    /// Upper bound on output tokens; the spec's `maxOutputTokens` when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
}

/// One message of the conversation. Serialized with a `role` tag:
/// `user`, `assistant`, `toolResult`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(
    tag = "role",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Message {
    /// Text from the user side (the task, observations, summaries).
    User { text: String },
    /// A model turn: optional text and the tool calls it proposed.
    Assistant {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        #[serde(default)]
        tool_calls: Vec<ToolCall>,
    },
    /// The result of one tool call, answering the call with id `call_id`.
    ToolResult {
        call_id: String,
        name: String,
        content: String,
        #[serde(default)]
        is_error: bool,
    },
}

impl Message {
    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Message::User { text: text.into() }
    }
}

/// A tool call proposed by the model.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    /// Provider-assigned id; tool results quote it.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments: a JSON object, or `Value::String(raw)` when the model sent
    /// something that is not a JSON object (malformed reply).
    pub arguments: serde_json::Value,
}

impl ToolCall {
    /// True when the arguments are a JSON object (not a malformed reply).
    pub fn arguments_are_valid(&self) -> bool {
        self.arguments.is_object()
    }
}

/// A tool offered to the model.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments (`{"type":"object"}` is sent when null).
    pub input_schema: serde_json::Value,
}

/// Tokens used by one model call, as the provider reported them.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl TokenUsage {
    /// Input plus output tokens.
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// The model's answer, provider-neutral.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelResponse {
    /// Text of the answer, if any (empty text is `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Tool calls proposed, in the order the model gave them.
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    pub usage: TokenUsage,
    /// Model id as the provider reported it (may differ from the configured name).
    pub model_id: String,
    /// `finish_reason` (OpenAI) or `stop_reason` (Anthropic), verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
}

/// Why a 2xx reply is not the provider's response format: the wire modules
/// say what is wrong, the client turns it into [`ModelError::Malformed`] with
/// an excerpt of the body.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplyError {
    /// The body does not parse at all (an HTML error page, a cut-off reply).
    #[error("not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    /// The provider answered an error with a 2xx status (some compatible
    /// servers and proxies do); `kind` is the error's type where it has one.
    #[error("the provider reported an error{}: {message}", kind_suffix(.kind))]
    Reported {
        kind: Option<String>,
        message: String,
    },
    /// JSON, but a field the format requires is missing or of another type.
    #[error("{0}")]
    Shape(String),
}

impl From<&str> for ReplyError {
    fn from(what: &str) -> Self {
        ReplyError::Shape(what.to_string())
    }
}

fn kind_suffix(kind: &Option<String>) -> String {
    kind.as_ref().map(|k| format!(" ({k})")).unwrap_or_default()
}

/// Why a model call failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The client could not be built from the spec (bad endpoint...). Not retryable.
    #[error("model client configuration: {0}")]
    Config(String),
    /// The provider refused the request (4xx other than 408/429). Not retryable.
    #[error("model provider rejected the request (HTTP {status}): {message}")]
    Rejected { status: u16, message: String },
    /// The provider answered with something that is not the expected JSON. Not retryable.
    #[error("malformed model reply (HTTP {status}): {excerpt}")]
    Malformed { status: u16, excerpt: String },
    /// Every attempt failed with a transient error (429, 5xx, connect error,
    /// timeout). Retryable later: the caller may try the step again.
    #[error("model provider unavailable after {attempts} attempt(s): {last}")]
    Unavailable {
        attempts: u32,
        /// HTTP status of the last attempt, `None` for a transport error or timeout.
        status: Option<u16>,
        last: String,
    },
}

impl ModelError {
    /// True when trying again later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ModelError::Unavailable { .. })
    }

    /// HTTP status involved, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            ModelError::Config(_) => None,
            ModelError::Rejected { status, .. } | ModelError::Malformed { status, .. } => {
                Some(*status)
            }
            ModelError::Unavailable { status, .. } => *status,
        }
    }
}

/// The error of a model endpoint that answered with a redirect: not
/// followed, as the request carries the key (also within the same host,
/// where another path may be another service).
fn redirected(status: u16, headers: &reqwest::header::HeaderMap) -> ModelError {
    let to = headers
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(|l| format!(" to {:?}", excerpt(l, 200)))
        .unwrap_or_default();
    ModelError::Rejected {
        status,
        message: format!(
            "the endpoint redirected{to}; redirects are not followed, so the API key is only ever sent to the endpoint itself"
        ),
    }
}

/// Largest model reply read: a reply is recorded in the log and fed to later
/// requests, and a provider (or whoever answers at the endpoint) is untrusted.
pub const MAX_REPLY_BYTES: usize = 4 << 20;

/// The body as text, or `None` once it passes `cap` bytes (read no further).
async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<Option<String>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(String::from_utf8_lossy(&body).into_owned()))
}

/// How failed attempts are retried.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first one included (at least 1).
    pub max_attempts: u32,
    /// Delay before the second attempt; doubled for each further one.
    pub initial_backoff: Duration,
    /// Upper bound of the exponential delay.
    pub max_backoff: Duration,
    /// Upper bound of a provider's `Retry-After`.
    pub max_retry_after: Duration,
    /// Upper bound of the whole call, attempts and delays included.
    pub max_total: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(30),
            max_total: Duration::from_secs(300),
        }
    }
}

/// Options of a [`ModelClient`].
#[derive(Clone, Debug, PartialEq)]
pub struct ClientOptions {
    /// Timeout of one attempt (connect, send, whole body).
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Duration::from_secs(120),
            retry: RetryPolicy::default(),
        }
    }
}

/// A client for the model a [`ModelSpec`] names.
#[derive(Clone)]
pub struct ModelClient {
    provider: Provider,
    model: String,
    url: String,
    /// True when talking to OpenAI's own endpoint (not a compatible server).
    openai_official: bool,
    api_key: Option<String>,
    max_output_tokens: Option<u32>,
    options: ClientOptions,
    http: reqwest::Client,
}

impl std::fmt::Debug for ModelClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelClient")
            .field("provider", &self.provider)
            .field("model", &self.model)
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("max_output_tokens", &self.max_output_tokens)
            .field("options", &self.options)
            .finish()
    }
}

impl ModelClient {
    /// A client with the default timeout (120 s per attempt) and retries
    /// (5 attempts, at most 300 s in total).
    pub fn new(spec: &ModelSpec, api_key: Option<String>) -> Result<Self, ModelError> {
        Self::with_options(spec, api_key, ClientOptions::default())
    }

    /// A client with explicit timeout and retry policy.
    pub fn with_options(
        spec: &ModelSpec,
        api_key: Option<String>,
        options: ClientOptions,
    ) -> Result<Self, ModelError> {
        if spec.name.trim().is_empty() {
            return Err(ModelError::Config("model name is empty".into()));
        }
        let (base, openai_official) = match (&spec.endpoint, spec.provider) {
            (Some(e), _) => (e.trim().to_string(), false),
            (None, Provider::OpenAI) => (OPENAI_DEFAULT_ENDPOINT.to_string(), true),
            (None, Provider::Anthropic) => (ANTHROPIC_DEFAULT_ENDPOINT.to_string(), false),
        };
        let parsed = url::Url::parse(&base).map_err(|e| {
            ModelError::Config(format!("model endpoint {base:?} is not a URL: {e}"))
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ModelError::Config(format!(
                "model endpoint {base:?} must be an http:// or https:// URL"
            )));
        }
        let base = base.trim_end_matches('/');
        let url = match spec.provider {
            Provider::OpenAI => format!("{base}/chat/completions"),
            Provider::Anthropic => format!("{base}/v1/messages"),
        };
        let api_key = api_key
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty());
        if let Some(k) = &api_key
            && HeaderValue::from_str(k).is_err()
        {
            return Err(ModelError::Config(
                "API key contains characters not allowed in an HTTP header".into(),
            ));
        }
        // The binaries install the provider at start; this makes the client
        // usable from anywhere else too (a second install is a harmless no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(options.timeout.min(Duration::from_secs(30)))
            // The key goes to the endpoint the platform allowed, never to
            // where a reply points: a 3xx is the provider's error.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ModelError::Config(format!("building the HTTP client: {e}")))?;
        Ok(ModelClient {
            provider: spec.provider,
            model: spec.name.clone(),
            url,
            openai_official,
            api_key,
            max_output_tokens: spec.max_output_tokens,
            options,
            http,
        })
    }

    /// The provider flavour.
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// The configured model name (what is sent; the reply reports its own id).
    pub fn model_name(&self) -> &str {
        &self.model
    }

    /// The URL requests are POSTed to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Who answered, for a person reading an error: the wire format, the
    /// endpoint (without query or credentials) and the model asked.
    pub fn describe(&self) -> String {
        let format = match self.provider {
            Provider::OpenAI => "OpenAI-format",
            Provider::Anthropic => "Anthropic-format",
        };
        let endpoint = match url::Url::parse(&self.url) {
            Ok(u) => {
                format!(
                    "{}://{}{}",
                    u.scheme(),
                    u.host_str().unwrap_or(""),
                    u.port().map(|p| format!(":{p}")).unwrap_or_default()
                ) + u.path()
            }
            Err(_) => "(unparsable endpoint)".into(),
        };
        format!("{format} model server {endpoint} (model {})", self.model)
    }

    /// The same client with each attempt and all retries cut at `deadline`
    /// (the step's own timeout): the answer, or why there is none, is then
    /// recorded before the pod's deadline kills it.
    pub fn within(mut self, deadline: Instant) -> Self {
        let left = deadline.saturating_duration_since(Instant::now());
        self.options.timeout = self.options.timeout.min(left).max(Duration::from_millis(1));
        self.options.retry.max_total = self.options.retry.max_total.min(left);
        self
    }

    /// The JSON body this client sends for `req` (the provider's wire format).
    /// Its output tokens are the fewer of what the request asks (a container
    /// agent's) and the Agent's `maxOutputTokens`: a request never raises
    /// the Agent's bound.
    pub fn request_body(&self, req: &ModelRequest) -> serde_json::Value {
        let max = match (req.max_output_tokens, self.max_output_tokens) {
            (Some(asked), Some(bound)) => Some(asked.min(bound)),
            (asked, bound) => asked.or(bound),
        };
        match self.provider {
            Provider::OpenAI => openai::request_body(&self.model, req, max, self.openai_official),
            Provider::Anthropic => anthropic::request_body(&self.model, req, max),
        }
    }

    fn headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        match self.provider {
            Provider::OpenAI => {
                if let Some(k) = &self.api_key
                    && let Ok(mut v) = HeaderValue::from_str(&format!("Bearer {k}"))
                {
                    v.set_sensitive(true);
                    h.insert(reqwest::header::AUTHORIZATION, v);
                }
            }
            Provider::Anthropic => {
                h.insert(
                    "anthropic-version",
                    HeaderValue::from_static(ANTHROPIC_VERSION),
                );
                if let Some(k) = &self.api_key
                    && let Ok(mut v) = HeaderValue::from_str(k)
                {
                    v.set_sensitive(true);
                    h.insert("x-api-key", v);
                }
            }
        }
        h
    }

    /// Calls the model once (retrying transient failures per the policy).
    pub async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ModelError> {
        self.complete_counted(req).await.0
    }

    /// [`ModelClient::complete`], with how each HTTP attempt ended, in order
    /// (empty when no request was sent). The retries happen here, inside a
    /// short-lived step process: the caller records these so that the
    /// controller can count them ([`AttemptOutcome`]).
    pub async fn complete_counted(
        &self,
        req: &ModelRequest,
    ) -> (Result<ModelResponse, ModelError>, Vec<AttemptOutcome>) {
        let mut attempts = Vec::new();
        let result = self.call_with_retries(req, &mut attempts).await;
        (result, attempts)
    }

    async fn call_with_retries(
        &self,
        req: &ModelRequest,
        attempts: &mut Vec<AttemptOutcome>,
    ) -> Result<ModelResponse, ModelError> {
        let body = serde_json::to_vec(&self.request_body(req))
            .map_err(|e| ModelError::Config(format!("encoding the request: {e}")))?;
        let policy = &self.options.retry;
        let max_attempts = policy.max_attempts.max(1);
        let start = Instant::now();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let remaining = policy.max_total.saturating_sub(start.elapsed());
            let timeout = self
                .options
                .timeout
                .min(remaining)
                .max(Duration::from_millis(1));
            let result = self.attempt(&body, timeout).await;
            attempts.push(AttemptOutcome::of(&result));
            let failure = match result {
                Ok(resp) => return Ok(resp),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Transient {
                    status,
                    message,
                    retry_after,
                    ..
                }) => (status, message, retry_after),
            };
            let (status, message, retry_after) = failure;
            let delay = match retry_after {
                Some(d) => d.min(policy.max_retry_after),
                None => backoff(policy, attempt),
            };
            let out_of_time = start.elapsed() + delay >= policy.max_total;
            if attempt >= max_attempts || out_of_time {
                tracing::warn!(
                    provider = ?self.provider, model = %self.model, attempt, status,
                    error = %message, "model call failed, giving up"
                );
                return Err(ModelError::Unavailable {
                    attempts: attempt,
                    status,
                    last: message,
                });
            }
            tracing::warn!(
                provider = ?self.provider, model = %self.model, attempt, status,
                delay_ms = delay.as_millis() as u64, error = %message,
                "model call failed, retrying"
            );
            tokio::time::sleep(delay).await;
        }
    }

    async fn attempt(&self, body: &[u8], timeout: Duration) -> Result<ModelResponse, Attempt> {
        let sent = self
            .http
            .post(&self.url)
            .headers(self.headers())
            .timeout(timeout)
            .body(body.to_vec())
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) => return Err(self.transport_error(e)),
        };
        let status = resp.status().as_u16();
        if (300..400).contains(&status) {
            return Err(Attempt::Fatal(redirected(status, resp.headers())));
        }
        let retry_after = retry_after(resp.headers());
        let text = match read_capped(resp, MAX_REPLY_BYTES).await {
            Ok(Some(t)) => t,
            Ok(None) => {
                return Err(Attempt::Fatal(ModelError::Malformed {
                    status,
                    excerpt: format!(
                        "the reply is larger than {MAX_REPLY_BYTES} bytes; nothing of it was used"
                    ),
                }));
            }
            Err(e) => return Err(self.transport_error(e)),
        };
        if (200..300).contains(&status) {
            let parsed = match self.provider {
                Provider::OpenAI => openai::parse_response(&text, &self.model),
                Provider::Anthropic => anthropic::parse_response(&text, &self.model),
            };
            return parsed.map_err(|why| {
                Attempt::Fatal(ModelError::Malformed {
                    status,
                    excerpt: self.redact(&format!("{why}; body: {}", excerpt(&text, 300))),
                })
            });
        }
        let message = self.redact(&error_message(&text));
        if status == 429 || status == 408 || status >= 500 {
            Err(Attempt::Transient {
                status: Some(status),
                timed_out: false,
                message: format!("HTTP {status}: {message}"),
                retry_after,
            })
        } else {
            Err(Attempt::Fatal(ModelError::Rejected { status, message }))
        }
    }

    fn transport_error(&self, e: reqwest::Error) -> Attempt {
        let kind = if e.is_timeout() {
            "timed out"
        } else if e.is_connect() {
            "connect error"
        } else {
            "transport error"
        };
        // Every transport failure (timeouts, refused or reset connections,
        // truncated bodies) is worth another attempt; a request that could not
        // even be built would fail the same way again, but cannot happen here.
        Attempt::Transient {
            status: None,
            timed_out: e.is_timeout(),
            message: self.redact(&format!("{kind}: {}", error_chain(&e))),
            retry_after: None,
        }
    }

    /// Removes the API key from text that may end up in a log or an error.
    fn redact(&self, s: &str) -> String {
        match &self.api_key {
            Some(k) if k.len() >= 4 => s.replace(k.as_str(), "[redacted]"),
            _ => s.to_string(),
        }
    }
}

enum Attempt {
    Fatal(ModelError),
    Transient {
        status: Option<u16>,
        /// No status: the attempt's timeout passed (else the connection failed).
        timed_out: bool,
        message: String,
        retry_after: Option<Duration>,
    },
}

/// How one HTTP attempt of a model call ended, by class: few enough values
/// for a metric label (`agentrun_model_attempts_total{outcome}`), and what
/// an operator tells apart (throttled, the server failing, the request refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// A 2xx reply that was read.
    Ok,
    /// A reply that is not the expected JSON (or too large).
    Malformed,
    /// 3xx: not followed.
    Redirect,
    /// 4xx other than 429 (408 included: retried, but the client's side).
    ClientError,
    /// 429.
    RateLimited,
    /// 5xx.
    ServerError,
    /// No answer within the attempt's timeout.
    Timeout,
    /// The connection failed (refused, reset, a truncated body).
    Transport,
}

impl AttemptOutcome {
    /// The label value: `ok`, `malformed`, `3xx`, `4xx`, `429`, `5xx`,
    /// `timeout`, `transport`.
    pub fn label(self) -> &'static str {
        match self {
            AttemptOutcome::Ok => "ok",
            AttemptOutcome::Malformed => "malformed",
            AttemptOutcome::Redirect => "3xx",
            AttemptOutcome::ClientError => "4xx",
            AttemptOutcome::RateLimited => "429",
            AttemptOutcome::ServerError => "5xx",
            AttemptOutcome::Timeout => "timeout",
            AttemptOutcome::Transport => "transport",
        }
    }

    fn of(result: &Result<ModelResponse, Attempt>) -> Self {
        match result {
            Ok(_) => AttemptOutcome::Ok,
            Err(Attempt::Fatal(ModelError::Malformed { .. })) => AttemptOutcome::Malformed,
            Err(Attempt::Fatal(e)) => Self::of_status(e.status()),
            Err(Attempt::Transient {
                status: Some(s), ..
            }) => Self::of_status(Some(*s)),
            Err(Attempt::Transient { timed_out, .. }) => {
                if *timed_out {
                    AttemptOutcome::Timeout
                } else {
                    AttemptOutcome::Transport
                }
            }
        }
    }

    fn of_status(status: Option<u16>) -> Self {
        match status {
            Some(429) => AttemptOutcome::RateLimited,
            Some(s) if (300..400).contains(&s) => AttemptOutcome::Redirect,
            Some(s) if s >= 500 => AttemptOutcome::ServerError,
            // Fatal errors without a status are not HTTP attempts' (a config
            // error happens before any); a 1xx is nobody's.
            _ => AttemptOutcome::ClientError,
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// Exponential backoff with a little jitter: initial * 2^(attempt-1), capped.
fn backoff(policy: &RetryPolicy, attempt: u32) -> Duration {
    let exp = policy
        .initial_backoff
        .saturating_mul(1u32 << (attempt.saturating_sub(1)).min(16));
    let base = exp.min(policy.max_backoff);
    // Up to +20% jitter so that many workers do not retry in lockstep.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let jitter = base.mul_f64(f64::from(nanos % 1000) / 5000.0);
    base + jitter
}

/// `Retry-After` (seconds) or `retry-after-ms`, when present.
fn retry_after(h: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = h
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    h.get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(86_400.0)))
}

/// The provider's error message (`error.message` in both formats), or an
/// excerpt of the body.
fn error_message(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        let err = v.get("error")?;
        match err {
            serde_json::Value::String(s) => Some(s.clone()),
            _ => err
                .get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string),
        }
    });
    match msg {
        Some(m) => excerpt(&m, 500),
        None if body.trim().is_empty() => "(empty body)".into(),
        None => excerpt(body, 300),
    }
}

/// At most `max` bytes of `s`, cut on a character boundary.
fn excerpt(s: &str, max: usize) -> String {
    crate::text::excerpt(s, max)
}

/// Tool-call arguments as received in a JSON string (OpenAI): an object when
/// they parse to one, `{}` when empty, the raw string otherwise.
pub(crate) fn arguments_from_str(raw: &str) -> serde_json::Value {
    if raw.trim().is_empty() {
        return serde_json::Value::Object(Default::default());
    }
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        _ => serde_json::Value::String(raw.to_string()),
    }
}

/// The model a reply names, else the configured one: some compatible
/// servers name none, and the log must still say which model answered.
pub(crate) fn reply_model(reply: &serde_json::Value, configured: &str) -> String {
    reply
        .get("model")
        .and_then(serde_json::Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or(configured)
        .to_string()
}

/// One of a reply's `usage` counts; a server that reports none counts zero.
pub(crate) fn usage_count(reply: &serde_json::Value, key: &str) -> u64 {
    reply
        .get("usage")
        .and_then(|u| u.get(key))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// The schema sent for a tool (an object schema when none is given).
pub(crate) fn schema_or_object(schema: &serde_json::Value) -> serde_json::Value {
    if schema.is_null() {
        serde_json::json!({"type": "object", "properties": {}})
    } else {
        schema.clone()
    }
}

/// Cost in US dollars of `usage` at `prices` (0 without prices).
pub fn cost_usd(prices: Option<&Prices>, usage: &TokenUsage) -> f64 {
    match prices {
        Some(p) => {
            (usage.input_tokens as f64 * p.input_per_million
                + usage.output_tokens as f64 * p.output_per_million)
                / 1_000_000.0
        }
        None => 0.0,
    }
}

/// A cheap estimate of the input tokens `req` will cost (about 4 characters
/// per token plus a small per-message overhead). Used to decide compaction,
/// never to bill.
pub fn estimate_tokens(req: &ModelRequest) -> u64 {
    const PER_MESSAGE: u64 = 4;
    let mut chars = req.system.chars().count() as u64;
    let mut overhead = PER_MESSAGE;
    for m in &req.messages {
        overhead += PER_MESSAGE;
        chars += match m {
            Message::User { text } => text.chars().count() as u64,
            Message::Assistant { text, tool_calls } => {
                text.as_deref().map_or(0, |t| t.chars().count() as u64)
                    + tool_calls
                        .iter()
                        .map(|c| (c.id.len() + c.name.len() + json_len(&c.arguments)) as u64)
                        .sum::<u64>()
            }
            Message::ToolResult {
                call_id,
                name,
                content,
                ..
            } => (call_id.len() + name.len() + content.chars().count()) as u64,
        };
    }
    for t in &req.tools {
        overhead += PER_MESSAGE;
        chars += (t.name.len() + t.description.chars().count() + json_len(&t.input_schema)) as u64;
    }
    chars.div_ceil(4) + overhead
}

fn json_len(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(s) => s.chars().count(),
        other => other.to_string().len(),
    }
}

/// Comparing request bodies with documented ones (the golden fixtures under
/// `src/model/testdata/`, see its README).
#[cfg(test)]
pub(crate) mod wire_compare {
    use serde_json::Value;

    /// Where `ours` may differ from a documented body `doc`.
    #[derive(Default)]
    pub(crate) struct Allow<'a> {
        /// Keys the documentation shows and the client does not send.
        pub doc_only: &'a [&'a str],
        /// Keys the client sends that the documentation leaves out, with the
        /// value that makes that harmless (the documented default).
        pub ours_default: &'a [(&'a str, Value)],
        /// Keys the documentation shows as `null` and the client sends as
        /// this value, equivalent for the provider (and taken by servers
        /// that refuse the null).
        pub null_sent_as: &'a [(&'a str, Value)],
    }

    /// Every difference between `doc` and `ours`, as `path: what`. Objects
    /// compare key by key, lists element by element; strings under
    /// `arguments` compare as the JSON they hold (the text of a model's
    /// arguments is not ours to keep byte for byte, their value is).
    pub(crate) fn diff(doc: &Value, ours: &Value, allow: &Allow) -> Vec<String> {
        let mut out = Vec::new();
        walk("$", None, doc, ours, allow, &mut out);
        out
    }

    /// Panics with the differences, if any.
    pub(crate) fn assert_matches(doc: &Value, ours: &Value, allow: &Allow) {
        let d = diff(doc, ours, allow);
        assert!(
            d.is_empty(),
            "request differs from the documented one:\n  {}\nours: {}",
            d.join("\n  "),
            serde_json::to_string_pretty(ours).unwrap_or_default()
        );
    }

    fn walk(
        path: &str,
        key: Option<&str>,
        doc: &Value,
        ours: &Value,
        allow: &Allow,
        out: &mut Vec<String>,
    ) {
        match (doc, ours) {
            (Value::Null, o)
                if allow
                    .null_sent_as
                    .iter()
                    .any(|(name, v)| key == Some(*name) && v == o) => {}
            (Value::Object(d), Value::Object(o)) => {
                for (k, dv) in d {
                    let p = format!("{path}.{k}");
                    match o.get(k) {
                        Some(ov) => walk(&p, Some(k), dv, ov, allow, out),
                        None if allow.doc_only.contains(&k.as_str()) => {}
                        None => out.push(format!("{p}: documented, not sent")),
                    }
                }
                for (k, ov) in o {
                    if d.contains_key(k) {
                        continue;
                    }
                    let p = format!("{path}.{k}");
                    match allow.ours_default.iter().find(|(name, _)| name == k) {
                        Some((_, default)) if default == ov => {}
                        _ => out.push(format!("{p}: sent ({ov}), not documented")),
                    }
                }
            }
            (Value::Array(d), Value::Array(o)) => {
                if d.len() != o.len() {
                    out.push(format!("{path}: {} documented, {} sent", d.len(), o.len()));
                }
                for (i, (dv, ov)) in d.iter().zip(o).enumerate() {
                    walk(&format!("{path}[{i}]"), None, dv, ov, allow, out);
                }
            }
            (Value::String(d), Value::String(o)) if key == Some("arguments") => {
                let parsed = (
                    serde_json::from_str::<Value>(d),
                    serde_json::from_str::<Value>(o),
                );
                match parsed {
                    (Ok(dv), Ok(ov)) if dv == ov => {}
                    _ if d == o => {}
                    _ => out.push(format!("{path}: documented {d:?}, sent {o:?}")),
                }
            }
            _ if doc == ours => {}
            _ => out.push(format!("{path}: documented {doc}, sent {ours}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cost_from_prices() {
        let prices = Prices {
            input_per_million: 3.0,
            output_per_million: 15.0,
        };
        let usage = TokenUsage {
            input_tokens: 1_000_000,
            output_tokens: 2_000,
        };
        let c = cost_usd(Some(&prices), &usage);
        assert!((c - 3.03).abs() < 1e-9, "{c}");
        assert_eq!(cost_usd(None, &usage), 0.0);
        assert_eq!(cost_usd(Some(&prices), &TokenUsage::default()), 0.0);
        let small = cost_usd(
            Some(&prices),
            &TokenUsage {
                input_tokens: 1234,
                output_tokens: 56,
            },
        );
        assert!((small - (1234.0 * 3.0 + 56.0 * 15.0) / 1e6).abs() < 1e-12);
    }

    #[test]
    fn estimate_grows_with_content() {
        let small = ModelRequest {
            system: "be brief".into(),
            messages: vec![Message::user("hi")],
            tools: vec![],
            max_output_tokens: None,
        };
        let mut big = small.clone();
        big.messages.push(Message::ToolResult {
            call_id: "c1".into(),
            name: "search".into(),
            content: "x".repeat(4000),
            is_error: false,
        });
        let (s, b) = (estimate_tokens(&small), estimate_tokens(&big));
        assert!(s > 0 && s < 20, "{s}");
        assert!(b >= s + 1000, "{s} {b}");
        assert!(b < s + 1100, "{s} {b}");
    }

    #[test]
    fn types_serialize_camel_case_and_round_trip() {
        let req = ModelRequest {
            system: "sys".into(),
            messages: vec![
                Message::user("task"),
                Message::Assistant {
                    text: None,
                    tool_calls: vec![ToolCall {
                        id: "c1".into(),
                        name: "refund".into(),
                        arguments: json!({"amount": 5}),
                    }],
                },
                Message::ToolResult {
                    call_id: "c1".into(),
                    name: "refund".into(),
                    content: "ok".into(),
                    is_error: false,
                },
            ],
            tools: vec![ToolDef {
                name: "refund".into(),
                description: "refunds".into(),
                input_schema: json!({"type": "object"}),
            }],
            max_output_tokens: Some(100),
        };
        let v = serde_json::to_value(&req).unwrap();
        assert_eq!(
            v,
            json!({
                "system": "sys",
                "messages": [
                    {"role": "user", "text": "task"},
                    {"role": "assistant", "toolCalls": [{"id": "c1", "name": "refund", "arguments": {"amount": 5}}]},
                    {"role": "toolResult", "callId": "c1", "name": "refund", "content": "ok", "isError": false}
                ],
                "tools": [{"name": "refund", "description": "refunds", "inputSchema": {"type": "object"}}],
                "maxOutputTokens": 100
            })
        );
        let back: ModelRequest = serde_json::from_value(v).unwrap();
        assert_eq!(back, req);
        let resp = ModelResponse {
            text: Some("hi".into()),
            tool_calls: vec![],
            usage: TokenUsage {
                input_tokens: 1,
                output_tokens: 2,
            },
            model_id: "m-1".into(),
            stop_reason: Some("stop".into()),
        };
        let v = serde_json::to_value(&resp).unwrap();
        assert_eq!(
            v,
            json!({"text": "hi", "toolCalls": [], "usage": {"inputTokens": 1, "outputTokens": 2}, "modelId": "m-1", "stopReason": "stop"})
        );
        assert_eq!(serde_json::from_value::<ModelResponse>(v).unwrap(), resp);
    }

    #[test]
    fn arguments_parsing_keeps_malformed_raw() {
        assert_eq!(arguments_from_str(r#"{"a":1}"#), json!({"a": 1}));
        assert_eq!(arguments_from_str("  "), json!({}));
        assert_eq!(
            arguments_from_str(r#"{"a":1"#),
            serde_json::Value::String(r#"{"a":1"#.into())
        );
        assert_eq!(
            arguments_from_str("[1]"),
            serde_json::Value::String("[1]".into())
        );
    }

    #[test]
    fn error_messages_and_retry_after() {
        assert_eq!(
            error_message(r#"{"error":{"message":"bad model","type":"invalid_request_error"}}"#),
            "bad model"
        );
        assert_eq!(
            error_message(
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: required"}}"#
            ),
            "max_tokens: required"
        );
        assert_eq!(error_message("<html>oops</html>"), "<html>oops</html>");
        assert_eq!(error_message(""), "(empty body)");
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(250)));
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn backoff_is_exponential_and_capped() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            ..RetryPolicy::default()
        };
        let b1 = backoff(&p, 1);
        let b3 = backoff(&p, 3);
        let b9 = backoff(&p, 9);
        assert!(b1 >= Duration::from_millis(100) && b1 <= Duration::from_millis(120));
        assert!(b3 >= Duration::from_millis(400) && b3 <= Duration::from_millis(480));
        assert!(b9 >= Duration::from_millis(500) && b9 <= Duration::from_millis(600));
    }

    /// A container agent asks for a million output tokens; the Agent says
    /// 64: the provider is asked for 64, in either wire format (issue 51).
    #[test]
    fn a_request_never_raises_the_agents_output_token_bound() {
        let max_tokens = |provider: Provider, bound: Option<u32>, asked: Option<u32>| {
            let spec = ModelSpec {
                provider,
                name: "m".into(),
                max_output_tokens: bound,
                ..Default::default()
            };
            let c = ModelClient::new(&spec, None).unwrap();
            let req = ModelRequest {
                system: "s".into(),
                messages: vec![Message::User { text: "t".into() }],
                tools: vec![],
                max_output_tokens: asked,
            };
            let body = c.request_body(&req);
            let field = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
                .into_iter()
                .find_map(|f| body[f].as_u64());
            field.map(|n| n as u32)
        };
        for provider in [Provider::OpenAI, Provider::Anthropic] {
            assert_eq!(max_tokens(provider, Some(64), Some(1_000_000)), Some(64));
            assert_eq!(max_tokens(provider, Some(64), Some(10)), Some(10));
            assert_eq!(max_tokens(provider, Some(64), None), Some(64));
        }
        assert_eq!(max_tokens(Provider::OpenAI, None, Some(500)), Some(500));
    }

    #[test]
    fn client_never_shows_the_key() {
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "claude".into(),
            ..Default::default()
        };
        let c = ModelClient::new(&spec, Some("sk-very-secret".into())).unwrap();
        assert!(!format!("{c:?}").contains("sk-very-secret"));
        assert_eq!(c.url(), "https://api.anthropic.com/v1/messages");
        assert_eq!(
            c.redact("Incorrect API key provided: sk-very-secret."),
            "Incorrect API key provided: [redacted]."
        );
        let spec = ModelSpec {
            provider: Provider::OpenAI,
            name: "gpt".into(),
            endpoint: Some("http://127.0.0.1:1/v1/".into()),
            ..Default::default()
        };
        let c = ModelClient::new(&spec, None).unwrap();
        assert_eq!(c.url(), "http://127.0.0.1:1/v1/chat/completions");
        let bad = ModelSpec {
            endpoint: Some("ftp://x".into()),
            ..spec
        };
        assert!(matches!(
            ModelClient::new(&bad, None),
            Err(ModelError::Config(_))
        ));
    }

    /// Answers one HTTP request on a local port with `status` and `body`.
    async fn answer_once(status: &'static str, body: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            // Headers, then as many body bytes as Content-Length says.
            loop {
                let n = sock.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&seen).to_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if seen.len() >= end + 4 + len {
                        break;
                    }
                }
            }
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            sock.write_all(reply.as_bytes()).await.unwrap();
            sock.shutdown().await.ok();
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_redirect_is_a_providers_error_never_followed() {
        for provider in [Provider::OpenAI, Provider::Anthropic] {
            let endpoint = answer_once(
                "307 Temporary Redirect\r\nlocation: http://127.0.0.1:1/steal",
                "{}",
            )
            .await;
            let spec = ModelSpec {
                provider,
                name: "m".into(),
                endpoint: Some(endpoint),
                ..Default::default()
            };
            let c = ModelClient::new(&spec, Some("sk-test".into())).unwrap();
            let err = c
                .complete(&ModelRequest {
                    system: String::new(),
                    messages: vec![Message::user("hi")],
                    tools: vec![],
                    max_output_tokens: None,
                })
                .await
                .unwrap_err();
            match &err {
                ModelError::Rejected { status, message } => {
                    assert_eq!(*status, 307);
                    assert!(message.contains("redirects are not followed"), "{message}");
                    assert!(message.contains("127.0.0.1:1/steal"), "{message}");
                }
                other => panic!("{provider:?}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn anthropic_error_body_is_reported_with_its_message() {
        let endpoint = answer_once(
            "404 Not Found",
            include_str!("testdata/anthropic-error.response.json"),
        )
        .await;
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "claude-x".into(),
            endpoint: Some(endpoint),
            ..Default::default()
        };
        let c = ModelClient::new(&spec, Some("sk-test".into())).unwrap();
        let err = c
            .complete(&ModelRequest {
                system: String::new(),
                messages: vec![Message::user("hi")],
                tools: vec![],
                max_output_tokens: None,
            })
            .await
            .unwrap_err();
        match &err {
            ModelError::Rejected { status, message } => {
                assert_eq!(*status, 404);
                assert_eq!(message, "The requested resource could not be found.");
            }
            other => panic!("expected Rejected, got {other:?}"),
        }
        assert!(!err.is_retryable());
    }

    #[tokio::test]
    async fn documented_tool_use_reply_parses_end_to_end() {
        let endpoint = answer_once(
            "200 OK",
            include_str!("testdata/anthropic-messages-tool-use.response.json"),
        )
        .await;
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "claude-x".into(),
            endpoint: Some(endpoint),
            ..Default::default()
        };
        let r = ModelClient::new(&spec, None)
            .unwrap()
            .complete(&ModelRequest {
                system: String::new(),
                messages: vec![Message::user("What's the weather like in San Francisco?")],
                tools: vec![],
                max_output_tokens: None,
            })
            .await
            .unwrap();
        assert_eq!(r.tool_calls[0].id, "toolu_01A09q90qw90lq917835lq9");
        assert_eq!(r.stop_reason.as_deref(), Some("tool_use"));
    }
}
