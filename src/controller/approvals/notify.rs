//! Approval notifications: the policy's `notifyWebhook` hears when an
//! Approval is raised, escalated, decided or expires, in the format the
//! policy chose (`notifyFormat`): the JSON event, a Slack incoming-webhook
//! message (Block Kit) or a Teams incoming-webhook message (an Adaptive
//! Card).
//!
//! A message informs; it never decides. It carries no credential and no
//! link that acts: a link to the approval's page in the console (the
//! platform's `--console-url`, when set) and the plugin command that shows
//! it, so the person decides with their own identity. Text a model wrote
//! (arguments, its reason) and text people wrote (decision reasons) is
//! escaped for the receiver's markup, and everything is cut to the
//! receiver's limits with a visible note.
//!
//! Delivery is best effort and never holds a run up: a spawned task tries
//! [`RETRY`]`.attempts` times with backoff (honouring `Retry-After` on 429),
//! within a bounded number of deliveries in flight; one that finally fails
//! becomes a Warning Event `ApprovalNotificationFailed` on the run.

use crate::refusal::Refusal;
use std::time::Duration;

use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde_json::{Map, Value, json};

use crate::api::AgentRun;
use crate::controller::context::Context;
use crate::controller::metrics::OutcomeLabel;
use crate::runlog::records::ApprovalRequested;
use crate::runlog::v1::{ApprovalKind, NotifyFormat};

/// What happened to an approval that its notification tells: sent as the
/// JSON event's `event` and named in the Warning Event, lowercase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NoticeKind {
    Raised,
    Escalated,
    Decided,
    Expired,
}

impl NoticeKind {
    /// The word on the wire and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            NoticeKind::Raised => "raised",
            NoticeKind::Escalated => "escalated",
            NoticeKind::Decided => "decided",
            NoticeKind::Expired => "expired",
        }
    }
}

impl std::fmt::Display for NoticeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reason of the Warning Event for a notification that never arrived.
pub const FAILED_REASON: &str = "ApprovalNotificationFailed";

/// Deliveries in flight, at most [`WEBHOOK_GLOBAL`] in all and
/// [`WEBHOOK_PER_NAMESPACE`] for one namespace's runs: a tenant whose
/// webhook hangs holds a few sockets (for its retries too), never the
/// controller's file descriptors, and never another namespace's share.
static WEBHOOK_SLOTS: std::sync::LazyLock<WebhookSlots> =
    std::sync::LazyLock::new(|| WebhookSlots::new(WEBHOOK_GLOBAL, WEBHOOK_PER_NAMESPACE));
const WEBHOOK_GLOBAL: usize = 64;
const WEBHOOK_PER_NAMESPACE: usize = 4;

/// Slots for webhook deliveries: global and per namespace.
struct WebhookSlots {
    global: std::sync::Arc<tokio::sync::Semaphore>,
    per_namespace: usize,
    namespaces:
        std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Semaphore>>>,
}

/// A delivery's slots, given back when it ends.
struct WebhookPermit {
    _global: tokio::sync::OwnedSemaphorePermit,
    _namespace: tokio::sync::OwnedSemaphorePermit,
}

impl WebhookSlots {
    fn new(global: usize, per_namespace: usize) -> WebhookSlots {
        WebhookSlots {
            global: std::sync::Arc::new(tokio::sync::Semaphore::new(global)),
            per_namespace,
            namespaces: Default::default(),
        }
    }

    /// Slots for one delivery of `namespace`'s, or `None` when either is full
    /// (notifications are best effort: dropped, never queued without bound).
    fn try_acquire(&self, namespace: &str) -> Option<WebhookPermit> {
        let ns = {
            let mut map = self.namespaces.lock().expect("not poisoned");
            // Namespaces with nothing in flight are forgotten.
            map.retain(|_, s| s.available_permits() < self.per_namespace);
            map.entry(namespace.to_string())
                .or_insert_with(|| {
                    std::sync::Arc::new(tokio::sync::Semaphore::new(self.per_namespace))
                })
                .clone()
        };
        let namespace = ns.try_acquire_owned().ok()?;
        let global = self.global.clone().try_acquire_owned().ok()?;
        Some(WebhookPermit {
            _global: global,
            _namespace: namespace,
        })
    }
}

/// How a delivery is tried.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    /// Attempts in all, the first included.
    pub attempts: u32,
    /// The wait after the first failed attempt, doubled after each.
    pub backoff: Duration,
    /// The longest `Retry-After` honoured on a 429 (longer waits this long).
    pub max_retry_after: Duration,
    /// Each attempt's timeout.
    pub timeout: Duration,
}

/// Four attempts, 1 s, 2 s and 4 s apart, each within 5 s.
pub const RETRY: Retry = Retry {
    attempts: 4,
    backoff: Duration::from_secs(1),
    max_retry_after: Duration::from_secs(30),
    timeout: Duration::from_secs(5),
};

/// Tells the policy's webhook about an approval event (`raised`, `escalated`,
/// `decided`, `expired`), best effort: a webhook never holds a run up. Each
/// notification is counted once by outcome (`sent`, `failed` after its
/// retries, `refused` by the egress policy, `dropped` beyond the in-flight
/// slots); a failed or refused one becomes a Warning Event on the run.
pub fn notify(
    ctx: &Context,
    run: &AgentRun,
    approval: &str,
    request: &ApprovalRequested,
    event: NoticeKind,
    detail: Value,
) {
    let Some(url) = request.gate.notify_webhook.clone() else {
        return;
    };
    let count = counter(ctx);
    let failed = FailedEvent {
        recorder: ctx.recorder(),
        run: run.object_ref(&()),
        run_name: run.name_any(),
        approval: approval.to_string(),
        event,
    };
    if let Err(e) = ctx.outbound.user_urls.check_url(&url) {
        tracing::warn!(error = %e, approval, %event, "approval webhook refused");
        count("refused");
        tokio::spawn(failed.publish("refused by the controller's egress policy".into()));
        return;
    }
    let format = request.gate.notify_format.unwrap_or_default();
    // A bug the model's text reaches fails this notification, never the
    // reconcile that raised it (nor the process).
    let body = crate::contain::contain_sync(|| {
        body(
            format,
            run,
            approval,
            request,
            event,
            &detail,
            ctx.outbound.console_url.as_deref(),
        )
    });
    let body = match body {
        Ok(body) => body,
        Err(panicked) => {
            tracing::error!(error = %panicked, approval, %event, "formatting the approval notification panicked");
            count("failed");
            tokio::spawn(failed.publish("the message could not be formatted (a bug)".into()));
            return;
        }
    };
    let Some(permit) = WEBHOOK_SLOTS.try_acquire(&run.namespace().unwrap_or_default()) else {
        tracing::warn!(
            approval,
            %event,
            "approval webhook dropped: too many deliveries in flight"
        );
        count("dropped");
        return;
    };
    let delivery = Delivery {
        http: ctx.outbound.http.clone(),
        url,
        body,
        failed,
    };
    tokio::spawn(delivery.run(permit, count));
}

/// Counts a notification by its outcome.
fn counter(ctx: &Context) -> impl Fn(&str) + Send + 'static {
    let counted = ctx.metrics.approval_webhooks.clone();
    move |outcome: &str| {
        counted
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }
}

/// One notification on its way, and the Warning Event if it never arrives.
struct Delivery {
    http: reqwest::Client,
    url: String,
    body: Value,
    failed: FailedEvent,
}

impl Delivery {
    /// Delivers with [`RETRY`], holding its slots until it is done.
    async fn run(self, permit: WebhookPermit, count: impl Fn(&str)) {
        let _permit = permit;
        match deliver(&self.http, &self.url, &self.body, RETRY).await {
            Ok(_) => count("sent"),
            Err((failure, attempts)) => {
                let failed = self.failed;
                tracing::warn!(approval = %failed.approval, event = %failed.event, %failure, attempts,
                    "approval webhook failed");
                count("failed");
                failed.publish(undelivered(&failure, attempts)).await;
            }
        }
    }
}

/// Why a notification did not arrive, as its Warning Event says it.
fn undelivered(failure: &Failure, attempts: u32) -> String {
    if attempts > 1 {
        format!("{failure} after {attempts} attempts")
    } else {
        failure.to_string()
    }
}

/// The message in the policy's `notifyFormat`.
fn body(
    format: NotifyFormat,
    run: &AgentRun,
    approval: &str,
    request: &ApprovalRequested,
    event: NoticeKind,
    detail: &Value,
    console_url: Option<&str>,
) -> Value {
    match format {
        NotifyFormat::Json => json_body(run, approval, request, event, detail),
        NotifyFormat::Slack | NotifyFormat::Teams => {
            let message = Message::of(run, approval, request, event, detail, console_url);
            if format == NotifyFormat::Slack {
                slack(&message)
            } else {
                teams(&message)
            }
        }
    }
}

/// The Warning Event for a notification that did not arrive.
struct FailedEvent {
    recorder: Recorder,
    run: k8s_openapi::api::core::v1::ObjectReference,
    run_name: String,
    approval: String,
    event: NoticeKind,
}

impl FailedEvent {
    /// Publishes it, saying why (never the receiver's reply: only its
    /// status or the class of error). The run goes on either way.
    async fn publish(self, why: String) {
        let note = format!(
            "the {} notification of approval {} was not delivered to the policy's notifyWebhook: {why}; \
             the run goes on (kubectl agentrun show {} -n {})",
            self.event,
            self.approval,
            self.approval,
            self.run.namespace.as_deref().unwrap_or_default(),
        );
        let event = Event {
            type_: EventType::Warning,
            reason: FAILED_REASON.into(),
            note: Some(crate::text::cut(&note, crate::text::EVENT_NOTE_MAX_BYTES)),
            action: "Notify".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &self.run).await {
            tracing::warn!(run = %self.run_name, error = %e, "publishing event failed");
        }
    }
}

/// Why a delivery failed: the receiver's HTTP status, or the class of
/// error (never the reply body, nor the URL, which may hold a secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    Status(u16),
    Error(&'static str),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(s) => write!(f, "HTTP {s}"),
            Failure::Error(class) => f.write_str(class),
        }
    }
}

fn error_class(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connection failed"
    } else if e.is_redirect() {
        "too many redirects"
    } else if e.is_body() || e.is_decode() {
        "reply unreadable"
    } else {
        "request failed"
    }
}

/// POSTs `body` to `url` until it is accepted (2xx), at most
/// `retry.attempts` times: again after a 408, a 429 (after its
/// `Retry-After`, at most `retry.max_retry_after`), a 5xx or an error of
/// the connection; never after another status. `Ok` has the attempts made,
/// `Err` the last failure and the attempts made.
pub async fn deliver(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    retry: Retry,
) -> Result<u32, (Failure, u32)> {
    let mut backoff = retry.backoff;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let sent = http
            .post(url)
            .json(body)
            .timeout(retry.timeout)
            .send()
            .await;
        let (failure, wait) = match sent {
            Ok(r) if r.status().is_success() => return Ok(attempt),
            Ok(r) => {
                let status = r.status();
                let failure = Failure::Status(status.as_u16());
                let again = status.is_server_error()
                    || status == reqwest::StatusCode::REQUEST_TIMEOUT
                    || status == reqwest::StatusCode::TOO_MANY_REQUESTS;
                if !again {
                    return Err((failure, attempt));
                }
                let after = (status == reqwest::StatusCode::TOO_MANY_REQUESTS)
                    .then(|| retry_after(r.headers(), jiff::Timestamp::now()))
                    .flatten()
                    .map(|d| d.min(retry.max_retry_after));
                (failure, after)
            }
            Err(e) => (Failure::Error(error_class(&e)), None),
        };
        if attempt >= retry.attempts {
            return Err((failure, attempt));
        }
        tokio::time::sleep(wait.unwrap_or(backoff)).await;
        backoff = backoff.saturating_mul(2);
    }
}

/// A `Retry-After` header: seconds, or an HTTP date (its distance from `now`).
pub fn retry_after(headers: &reqwest::header::HeaderMap, now: jiff::Timestamp) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = jiff::fmt::rfc2822::parse(value).ok()?.timestamp();
    let wait = at.duration_since(now);
    Some(Duration::try_from(wait).unwrap_or(Duration::ZERO))
}

/// The JSON event (`notifyFormat: Json`), as it always was.
fn json_body(
    run: &AgentRun,
    approval: &str,
    request: &ApprovalRequested,
    event: NoticeKind,
    detail: &Value,
) -> Value {
    json!({
        "event": event,
        "namespace": run.namespace(),
        "run": run.name_any(),
        "approval": approval,
        "tool": request.tool,
        "arguments": request.arguments,
        "argumentsHash": request.arguments_hash,
        "rule": request.gate.rule,
        "approvers": request.gate.approvers,
        "detail": detail,
    })
}

/// What a Slack or Teams message says, before its markup: the facts as
/// plain text (escaped and cut by each format).
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub event: NoticeKind,
    /// A short title (no model-written text).
    pub title: String,
    /// What happened, one sentence (no model-written text).
    pub summary: String,
    pub namespace: String,
    pub run: String,
    pub approval: String,
    pub tool: String,
    /// Whoever created the run (its requester annotation).
    pub requester: Option<String>,
    /// The rule that matched, and why.
    pub rule: String,
    pub expires_at: Option<String>,
    /// How many decide, and who may.
    pub quorum: String,
    /// The call's arguments, top-level keys each with its JSON value
    /// (written by the model: untrusted).
    pub arguments: Vec<(String, String)>,
    /// The agent's stated reason (untrusted).
    pub reason: Option<String>,
    /// The decisions, for `decided`: approver, verdict, reason (people's words).
    pub decisions: Vec<(String, String, Option<String>)>,
    /// The console's page for this approval, when the platform set `--console-url`.
    pub link: Option<String>,
    /// The plugin command that shows the approval.
    pub command: String,
}

impl Message {
    pub fn of(
        run: &AgentRun,
        approval: &str,
        request: &ApprovalRequested,
        event: NoticeKind,
        detail: &Value,
        console_url: Option<&str>,
    ) -> Message {
        let namespace = run.namespace().unwrap_or_default();
        let (title, summary) = headline(run, approval, request, event, detail);
        Message {
            event,
            title,
            summary,
            link: console_url.map(|base| {
                format!(
                    "{}/approvals/{namespace}/{approval}",
                    base.trim_end_matches('/')
                )
            }),
            command: format!("kubectl agentrun show {approval} -n {namespace}"),
            requester: run
                .annotations()
                .get(crate::api::REQUESTER_ANNOTATION)
                .cloned(),
            namespace,
            run: run.name_any(),
            approval: approval.to_string(),
            tool: request.tool.clone(),
            rule: rule(&request.gate),
            expires_at: detail["expiresAt"].as_str().map(str::to_string),
            quorum: quorum(&request.gate),
            arguments: arguments(&request.arguments),
            reason: request.reason.clone().filter(|r| !r.trim().is_empty()),
            decisions: decisions(detail),
        }
    }

    /// The facts every format shows, by title.
    fn facts(&self) -> Vec<(&'static str, String)> {
        let mut facts = vec![
            ("Run", self.run.clone()),
            ("Namespace", self.namespace.clone()),
            ("Tool", self.tool.clone()),
            (
                "Requester",
                self.requester.clone().unwrap_or_else(|| "unknown".into()),
            ),
            ("Rule", self.rule.clone()),
        ];
        if let Some(at) = &self.expires_at {
            facts.push(("Expires", at.clone()));
        }
        facts.push(("Quorum", self.quorum.clone()));
        facts
    }
}

/// A message's title and what happened, by event (no model-written text).
fn headline(
    run: &AgentRun,
    approval: &str,
    request: &ApprovalRequested,
    event: NoticeKind,
    detail: &Value,
) -> (String, String) {
    let namespace = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let tool = &request.tool;
    match event {
        NoticeKind::Raised => (
            format!("Approval needed: {tool}"),
            match request.kind {
                ApprovalKind::Reconcile => format!(
                    "Run {name} in {namespace} was cut off around a call to {tool}: \
                     someone must confirm whether it happened."
                ),
                ApprovalKind::Budget => format!(
                    "Run {name} in {namespace} used up a budget and asks to go on \
                     with the limits shown."
                ),
                ApprovalKind::Call => {
                    format!("Run {name} in {namespace} waits for approval to call {tool}.")
                }
            },
        ),
        NoticeKind::Escalated => (
            format!("Approval escalated: {tool}"),
            format!(
                "Nobody decided {approval} in time: escalated to {} (escalation {} of {}). \
                 Run {name} in {namespace} still waits.",
                approvers(&request.gate.approvers),
                detail["escalation"]
                    .as_u64()
                    .unwrap_or(request.escalation.into()),
                request.gate.max_escalations
            ),
        ),
        NoticeKind::Decided => {
            let verdict = match detail["verdict"].as_str() {
                Some("Approve") => "approved",
                Some("Reject") => "rejected",
                Some("Edit") => "approved with edited arguments",
                _ => "decided",
            };
            (
                format!("Approval {verdict}: {tool}"),
                format!("{approval} of run {name} in {namespace} was {verdict}."),
            )
        }
        NoticeKind::Expired => (
            format!("Approval expired: {tool}"),
            format!(
                "Nobody decided {approval} of run {name} in {namespace} in time; \
                 the call was not made."
            ),
        ),
    }
}

/// The rule that matched, and why.
fn rule(gate: &crate::runlog::records::Gate) -> String {
    if gate.because.is_empty() {
        gate.rule.clone()
    } else {
        format!("{} ({})", gate.rule, gate.because)
    }
}

/// How many decide, and who may: "1 of groups finance, not the requester".
fn quorum(gate: &crate::runlog::records::Gate) -> String {
    format!(
        "{} of {}{}",
        gate.required_approvals.max(1),
        approvers(&gate.approvers),
        if gate.separation_of_duties {
            ", not the requester"
        } else {
            ""
        }
    )
}

/// The call's arguments, top-level keys each with its JSON value.
fn arguments(arguments: &Value) -> Vec<(String, String)> {
    match arguments {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
        Value::Null => Vec::new(),
        other => vec![("arguments".to_string(), other.to_string())],
    }
}

/// The decisions a `decided` event's detail lists: approver, verdict, reason.
fn decisions(detail: &Value) -> Vec<(String, String, Option<String>)> {
    detail["decisions"]
        .as_array()
        .map(|ds| {
            ds.iter()
                .map(|d| {
                    (
                        d["approver"].as_str().unwrap_or_default().to_string(),
                        d["verdict"].as_str().unwrap_or_default().to_string(),
                        d["reason"].as_str().map(str::to_string),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// "users alice, bob; groups finance".
fn approvers(a: &crate::runlog::v1::Approvers) -> String {
    let mut parts = Vec::new();
    if !a.users.is_empty() {
        let s = if a.users.len() == 1 { "" } else { "s" };
        parts.push(format!("user{s} {}", a.users.join(", ")));
    }
    if !a.groups.is_empty() {
        let s = if a.groups.len() == 1 { "" } else { "s" };
        parts.push(format!("group{s} {}", a.groups.join(", ")));
    }
    if parts.is_empty() {
        "nobody named".into()
    } else {
        parts.join("; ")
    }
}

/// Slack's limits (Block Kit reference): a header's text, a section's
/// text, a section's fields and each field's text, blocks in a message.
pub const SLACK_HEADER_MAX: usize = 150;
pub const SLACK_SECTION_MAX: usize = 3000;
pub const SLACK_FIELDS_MAX: usize = 10;
pub const SLACK_FIELD_MAX: usize = 2000;
pub const SLACK_BLOCKS_MAX: usize = 50;

/// What a Teams incoming webhook accepts in all (about 28 KB).
pub const TEAMS_MAX_BYTES: usize = 28_000;

/// Escapes text for Slack's mrkdwn: `&`, `<` and `>` become entities (the
/// control characters of links, mentions and `<!channel>`), and a backtick
/// becomes a look-alike so text shown in a code span stays in it.
pub fn slack_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '`' => out.push('\u{2035}'),
            c => out.push(c),
        }
    }
    out
}

/// Escapes text for an Adaptive Card's markdown (TextBlock, Fact): the
/// characters of link syntax `[x](y)`, bold and code get a backslash
/// (CommonMark's escape), so no text of a model's becomes a link with a
/// name of its choosing; even a renderer without escapes never sees `]`
/// meet `(`. (A bare URL stays what it says it is.)
pub fn teams_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '\\' | '[' | ']' | '(' | ')' | '*' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// How long a text is as Slack and Teams count it: in UTF-16 code units
/// (a JavaScript string's length), never fewer than its characters, so a
/// text cut to a limit in these keeps to it whichever of the two the
/// receiver counts.
pub fn units(s: &str) -> usize {
    s.encode_utf16().count()
}

/// `s` escaped by `escape`, cut so that it and the note saying so fit in
/// `max` ([`units`]): "… cut, N more bytes; see kubectl agentrun show" (N
/// counts the bytes of `s` left out). Where even the note does not fit,
/// "…" alone marks the cut; the result is never longer than `max`.
pub fn fit(s: &str, max: usize, escape: fn(&str) -> String) -> String {
    let whole = escape(s);
    if units(&whole) <= max {
        return whole;
    }
    let note = |left: usize| {
        escape(&format!(
            "… cut, {left} more bytes; see kubectl agentrun show"
        ))
    };
    // Room for the note with the longest count this text can have, else
    // for "…" alone, else for nothing.
    let longest = units(&note(s.len()));
    let with_note = longest <= max;
    let short = Some(escape("…"))
        .filter(|m| units(m) <= max)
        .unwrap_or_default();
    let room = max.saturating_sub(if with_note { longest } else { units(&short) });
    let mut kept = String::new();
    let mut used: usize = 0;
    let mut end = 0;
    for (i, c) in s.char_indices() {
        let e = escape(c.encode_utf8(&mut [0; 4]));
        let n = units(&e);
        if used.saturating_add(n) > room {
            break;
        }
        used += n;
        kept.push_str(&e);
        end = i + c.len_utf8();
    }
    if with_note {
        kept.push_str(&note(s.len().saturating_sub(end)));
    } else {
        kept.push_str(&short);
    }
    kept
}

/// At most `max` ([`units`]) of `s`: the last guard of a text whose parts
/// were each cut to their share (it never cuts one that was built right).
fn at_most(s: String, max: usize) -> String {
    let mut used: usize = 0;
    for (i, c) in s.char_indices() {
        used += c.len_utf16();
        if used > max {
            return s[..i].to_string();
        }
    }
    s
}

/// The most characters of a title over a value (a fact's, or an
/// argument's key, which the model wrote) and of a name in a line.
const TITLE_MAX: usize = 100;
/// The most characters of a person's or an object's name in a line (a
/// Kubernetes name has at most 253).
const NAME_MAX: usize = 253;
/// The most characters of the summary (names in it are the run's, the
/// tool's, the approvers').
const SUMMARY_MAX: usize = 1000;
/// The most characters of one decision's reason in the summary.
const DECISION_REASON_MAX: usize = 500;
/// The most characters of the plugin command (an approval's and a
/// namespace's names).
const COMMAND_MAX: usize = 400;
/// The longest console link shown, escaped: a longer one (which
/// `--console-url` does not allow) is left out rather than cut wrong.
const LINK_MAX: usize = 1500;

/// The arguments as (key, value) pairs, at most `max` of them: when there
/// are more, the last says how many more there are.
fn argument_fields(m: &Message, max: usize) -> Vec<(String, String)> {
    if m.arguments.len() <= max {
        return m.arguments.clone();
    }
    let shown_count = max.saturating_sub(1);
    let mut shown: Vec<(String, String)> = m.arguments[..shown_count].to_vec();
    shown.push((
        "…".into(),
        format!(
            "{} more arguments; see {}",
            m.arguments.len().saturating_sub(shown_count),
            m.command
        ),
    ));
    shown
}

/// The console link, escaped by `escape`, when it is one to show: short,
/// and nothing in it that would end a Slack link (`|`, `>`, spaces).
fn shown_link(m: &Message, escape: fn(&str) -> String) -> Option<(&str, String)> {
    let link = m.link.as_deref()?;
    let escaped = escape(link);
    let plain = !link.contains(|c: char| c == '|' || c.is_whitespace() || c.is_control());
    (plain && units(&escaped) <= LINK_MAX).then_some((link, escaped))
}

fn plain(text: String) -> Value {
    json!({"type": "plain_text", "text": text, "emoji": true})
}

fn mrkdwn(text: String, max: usize) -> Value {
    json!({"type": "mrkdwn", "text": at_most(text, max)})
}

/// A Slack incoming-webhook message (Block Kit): a header, what happened,
/// the facts as a section's fields, the arguments as another's, the agent's
/// reason, the decisions, and the console link with the plugin command;
/// `text` is the notification's fallback. Every text is escaped and cut to
/// the limit of the place it lands.
pub fn slack(m: &Message) -> Value {
    let e = slack_escape;
    let mut blocks = vec![json!({
        "type": "header",
        "text": plain(fit(&m.title, SLACK_HEADER_MAX, |s| s.to_string())),
    })];
    blocks.push(json!({
        "type": "section",
        "text": mrkdwn(slack_summary(m), SLACK_SECTION_MAX),
    }));
    let facts: Vec<Value> = m
        .facts()
        .iter()
        .take(SLACK_FIELDS_MAX)
        .map(|(t, v)| slack_field(t, v, false))
        .collect();
    blocks.push(json!({"type": "section", "fields": facts}));
    if !m.arguments.is_empty() {
        let fields: Vec<Value> = argument_fields(m, SLACK_FIELDS_MAX)
            .iter()
            .map(|(k, v)| slack_field(k, v, true))
            .collect();
        blocks.push(json!({
            "type": "section",
            "text": mrkdwn("*Arguments*".into(), SLACK_SECTION_MAX),
            "fields": fields,
        }));
    }
    if let Some(reason) = &m.reason {
        let head = "*The agent's reason*\n";
        let room = SLACK_SECTION_MAX.saturating_sub(units(head));
        blocks.push(json!({
            "type": "section",
            "text": mrkdwn(format!("{head}{}", fit(reason, room, e)), SLACK_SECTION_MAX),
        }));
    }
    let mut open = String::new();
    if let Some((_, link)) = shown_link(m, e) {
        // The platform's URL (validated at start: no `|`), a namespace and
        // a DNS name; escaped like all text (Slack decodes `&amp;` in links).
        open.push_str(&format!(
            "<{link}|Open {} in the console>\n",
            fit(&m.approval, NAME_MAX, e)
        ));
    }
    open.push_str(&format!("`{}`", fit(&m.command, COMMAND_MAX, e)));
    blocks.push(json!({"type": "section", "text": mrkdwn(open, SLACK_SECTION_MAX)}));
    blocks.truncate(SLACK_BLOCKS_MAX);
    json!({
        "text": fit(&format!("{}: run {} in {}", m.title, m.run, m.namespace), SLACK_SECTION_MAX, e),
        "blocks": blocks,
    })
}

/// What happened, then each decision (who, verdict, their reason) while
/// they fit in a section; a last line says how many more there are.
fn slack_summary(m: &Message) -> String {
    let e = slack_escape;
    let mut text = fit(&m.summary, SUMMARY_MAX, e);
    let command = fit(&m.command, COMMAND_MAX, e);
    let more = |left: usize| format!("\n… {left} more decisions; see `{command}`");
    let reserve = units(&more(m.decisions.len()));
    for (shown, (who, verdict, reason)) in m.decisions.iter().enumerate() {
        let mut line = format!(
            "\n• *{}*: {}",
            fit(who, NAME_MAX, e),
            fit(verdict, TITLE_MAX, e)
        );
        if let Some(r) = reason.as_deref().filter(|r| !r.is_empty()) {
            line.push_str(&format!(" ({})", fit(r, DECISION_REASON_MAX, e)));
        }
        let after = units(&text).saturating_add(units(&line));
        let last = shown + 1 == m.decisions.len();
        if after.saturating_add(if last { 0 } else { reserve }) > SLACK_SECTION_MAX {
            text.push_str(&more(m.decisions.len() - shown));
            break;
        }
        text.push_str(&line);
    }
    text
}

/// A field: a title (bold) over a value, in a code span if `code`; both
/// escaped and cut so the field fits its limit.
fn slack_field(title: &str, value: &str, code: bool) -> Value {
    let head = format!("*{}*\n", fit(title, TITLE_MAX, slack_escape));
    let tick = if code { "`" } else { "" };
    let room = SLACK_FIELD_MAX.saturating_sub(units(&head) + 2 * tick.len());
    mrkdwn(
        format!("{head}{tick}{}{tick}", fit(value, room, slack_escape)),
        SLACK_FIELD_MAX,
    )
}

/// The caps a Teams card tries, each text of the model's or people's cut to
/// it, largest first, until the card fits [`TEAMS_MAX_BYTES`].
const TEAMS_CAPS: [usize; 6] = [3000, 1500, 750, 375, 180, 90];

/// A Teams incoming-webhook message: an Adaptive Card (1.4) attachment with
/// the title, what happened, the facts and the arguments as FactSets, the
/// agent's reason, the decisions, the plugin command, and an
/// `Action.OpenUrl` to the console. Always within [`TEAMS_MAX_BYTES`]: its
/// texts are cut shorter until it fits, and when even the shortest do not
/// (thousands of decisions), it is the card that says only what happened
/// and where to see the rest.
pub fn teams(m: &Message) -> Value {
    TEAMS_CAPS
        .iter()
        .map(|cap| teams_card(m, *cap))
        .find(fits_teams)
        .unwrap_or_else(|| teams_minimal(m))
}

fn fits_teams(card: &Value) -> bool {
    serde_json::to_vec(card).is_ok_and(|b| b.len() <= TEAMS_MAX_BYTES)
}

/// The Teams message with each text of the model's or people's cut to `cap` characters.
fn teams_card(m: &Message, cap: usize) -> Value {
    let e = |s: &str| fit(s, cap, teams_escape);
    let title = |s: &str| fit(s, cap.min(TITLE_MAX), teams_escape);
    let fact = |t: &str, value: &str| json!({"title": title(t), "value": e(value)});
    let mut body = vec![
        json!({"type": "TextBlock", "text": e(&m.title), "size": "Large", "weight": "Bolder", "wrap": true}),
        json!({"type": "TextBlock", "text": e(&m.summary), "wrap": true}),
    ];
    for (who, verdict, reason) in &m.decisions {
        let name = fit(who, cap.min(NAME_MAX), teams_escape);
        let mut line = format!("**{name}**: {}", title(verdict));
        if let Some(r) = reason.as_deref().filter(|r| !r.is_empty()) {
            line.push_str(&format!(" \\({}\\)", e(r)));
        }
        body.push(json!({"type": "TextBlock", "text": line, "wrap": true, "spacing": "None"}));
    }
    let facts: Vec<Value> = m.facts().iter().map(|(t, v)| fact(t, v)).collect();
    body.push(json!({"type": "FactSet", "facts": facts}));
    if !m.arguments.is_empty() {
        body.push(
            json!({"type": "TextBlock", "text": "Arguments", "weight": "Bolder", "wrap": true}),
        );
        let facts: Vec<Value> = argument_fields(m, SLACK_FIELDS_MAX)
            .iter()
            .map(|(k, v)| fact(k, v))
            .collect();
        body.push(json!({"type": "FactSet", "facts": facts}));
    }
    if let Some(reason) = &m.reason {
        body.push(json!({"type": "TextBlock", "text": "The agent's reason", "weight": "Bolder", "wrap": true}));
        body.push(json!({"type": "TextBlock", "text": e(reason), "wrap": true}));
    }
    body.push(json!({"type": "TextBlock", "text": fit(&m.command, cap.min(COMMAND_MAX), teams_escape), "fontType": "Monospace", "wrap": true}));
    adaptive_card(m, body)
}

/// The last resort: the title, what happened and where to see the rest,
/// each cut short enough that the card fits whatever they hold (at most
/// six bytes of JSON a character, the link at most [`LINK_MAX`]).
fn teams_minimal(m: &Message) -> Value {
    let body = vec![
        json!({"type": "TextBlock", "text": fit(&m.title, TITLE_MAX, teams_escape), "size": "Large", "weight": "Bolder", "wrap": true}),
        json!({"type": "TextBlock", "text": fit(&m.summary, SUMMARY_MAX, teams_escape), "wrap": true}),
        json!({"type": "TextBlock", "text": "Too much to show here; the command shows it all:", "wrap": true}),
        json!({"type": "TextBlock", "text": fit(&m.command, COMMAND_MAX, teams_escape), "fontType": "Monospace", "wrap": true}),
    ];
    adaptive_card(m, body)
}

/// The message around a card's `body`, with the console link as its action.
fn adaptive_card(m: &Message, body: Vec<Value>) -> Value {
    let mut card = Map::new();
    card.insert(
        "$schema".into(),
        json!("http://adaptivecards.io/schemas/adaptive-card.json"),
    );
    card.insert("type".into(), json!("AdaptiveCard"));
    card.insert("version".into(), json!("1.4"));
    card.insert("body".into(), Value::Array(body));
    if let Some((link, _)) = shown_link(m, |s| s.to_string()) {
        card.insert(
            "actions".into(),
            json!([{"type": "Action.OpenUrl", "title": "Open in the console", "url": link}]),
        );
    }
    json!({
        "type": "message",
        "attachments": [{
            "contentType": "application/vnd.microsoft.card.adaptive",
            "contentUrl": null,
            "content": Value::Object(card),
        }],
    })
}

/// Checks the console's base URL (`--console-url`): absolute http(s), a
/// host, no credentials, query or fragment. Returns it without a trailing `/`.
pub fn console_url(s: &str) -> Result<String, Refusal> {
    let u = url::Url::parse(s).map_err(|e| format!("--console-url {s:?}: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("--console-url {s:?}: must be http or https").into());
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(format!("--console-url {s:?}: has no host").into());
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err("--console-url: must not carry credentials (messages carry no secret)".into());
    }
    if s.contains(['|', '<', '>', '"', ' ']) {
        return Err(
            format!("--console-url {s:?}: must not contain |, <, >, quotes or spaces").into(),
        );
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(format!("--console-url {s:?}: must have no query or fragment").into());
    }
    if s.len() > 1000 {
        return Err("--console-url: longer than 1000 characters".into());
    }
    Ok(u.as_str().trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests;
