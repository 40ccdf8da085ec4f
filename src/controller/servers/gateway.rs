//! The step-log gateway: the only way step pods reach the log. Served by
//! every controller replica on `--step-api-addr`; the client is
//! [`crate::store::RemoteStore`].
//!
//! Each request carries `Authorization: Bearer <token>` where the token is
//! the HMAC of the run uid in the path ([`crate::keys::step_token`]). The gateway
//! refuses:
//! - a missing or malformed token (401), another run's token (403);
//! - records only the controller writes (`RunStarted`, `VersionChanged`,
//!   `ApprovalDecided`, `RunFinished`, `Forked`) (403);
//! - reading, leasing or appending for a run whose log ends with
//!   `RunFinished`, or whose AgentRun was deleted (410): the credential does
//!   not outlive its run (renewing or releasing a lease reads no log: a
//!   lease alone opens nothing). A run the watch has not seen yet gets 503,
//!   which a step pod waits out like a store outage.
//!
//! It runs on its own runtime and threads ([`spawn`]), with its own database
//! pool, so heartbeats are never queued behind the reconciler's work.
//!
//! Before authentication a client gets nothing but a slot and a few seconds
//! ([`crate::bounded`]: connection limit, header, idle and body timeouts). The
//! token is checked from the headers before any body is read ([`gate`]), and
//! an authenticated body is read only within [`MAX_BODY`] and a byte budget
//! shared by all requests in flight ([`GatewayLimits::body_budget`]), so
//! neither an unauthenticated client nor a token holder makes the controller
//! buffer more than that budget at once.
//!
//! Everything else goes to the store as is: appends stay fenced by the lease
//! epoch, first-writer-wins, chained.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::controller::servers::own_runtime::StartError;
use crate::controller::servers::run_index::{RunIndex, RunPresence};
use crate::keys::step_token::{TokenCheck, TokenKey};
use crate::store::{
    AcquireBody, AppendBody, Lease, OpenOptions, Record, StepKind, StepStore, StoreError,
    StoredRecord, WireError,
};
use axum::extract::{DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

/// Largest request body (a model reply with its context can be large).
pub const MAX_BODY: usize = 16 << 20;
/// How long an authenticated request waits for room in the body budget
/// before it is told to retry (503).
const BUDGET_WAIT: Duration = Duration::from_secs(5);

/// The bounds of the gateway's server.
#[derive(Clone, Copy, Debug)]
pub struct GatewayLimits {
    /// Connections, timeouts (before authentication).
    pub server: crate::bounded::Limits,
    /// Body bytes all authenticated requests may hold at once.
    pub body_budget: usize,
}

impl Default for GatewayLimits {
    fn default() -> Self {
        GatewayLimits {
            server: crate::bounded::Limits {
                max_connections: 4096,
                header_timeout: Duration::from_secs(10),
                body_timeout: Duration::from_secs(60),
            },
            body_budget: 2 * MAX_BODY,
        }
    }
}
/// Longest lease a step pod may ask for.
const MAX_TTL: Duration = Duration::from_secs(300);

/// The kinds a step pod may append; everything else is the controller's.
pub fn runner_may_write(kind: StepKind) -> bool {
    matches!(
        kind,
        StepKind::ModelCall
            | StepKind::ToolIntent
            | StepKind::ToolResult
            | StepKind::ApprovalRequested
            | StepKind::ApprovalVoided
            | StepKind::Observation
            | StepKind::Summary
    )
}

/// What the handlers share.
#[derive(Clone)]
pub struct Gateway {
    store: Arc<dyn StepStore>,
    key: TokenKey,
    /// Which runs exist.
    runs: RunIndex,
    /// Runs seen finished (a finished run never reopens).
    finished: Arc<Mutex<HashSet<String>>>,
    /// Body bytes in flight, in KiB permits ([`GatewayLimits::body_budget`]).
    bodies: Arc<Semaphore>,
}

impl Gateway {
    pub fn new(store: Arc<dyn StepStore>, key: TokenKey, runs: RunIndex) -> Gateway {
        Gateway::with_budget(store, key, runs, GatewayLimits::default().body_budget)
    }

    /// A gateway whose requests in flight hold at most `body_budget` bytes of body.
    pub fn with_budget(
        store: Arc<dyn StepStore>,
        key: TokenKey,
        runs: RunIndex,
        body_budget: usize,
    ) -> Gateway {
        Gateway {
            store,
            key,
            runs,
            finished: Default::default(),
            bodies: Arc::new(Semaphore::new(kib(body_budget.max(MAX_BODY)))),
        }
    }

    /// Checks that `run` exists and is not finished (its token was checked
    /// by [`gate`]).
    async fn admit(&self, run: &str) -> Result<(), Refusal> {
        match self.runs.presence(run) {
            RunPresence::Live => {}
            RunPresence::Gone => {
                return Err(Refusal::new(
                    StatusCode::GONE,
                    "run_deleted",
                    format!("run {run} was deleted: its step token no longer opens it"),
                ));
            }
            presence @ (RunPresence::Unknown | RunPresence::NotSynced) => {
                return Err(Refusal::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    format!(
                        "run {run} is not known to this gateway ({}); retry",
                        if presence == RunPresence::NotSynced {
                            "it is still listing AgentRuns"
                        } else {
                            "no AgentRun with this uid has been seen"
                        }
                    ),
                ));
            }
        }
        if self.is_finished(run).await? {
            return Err(Refusal::new(
                StatusCode::GONE,
                "run_finished",
                format!(
                    "run {run} is finished (its log ends with RunFinished): its step token no longer opens it"
                ),
            ));
        }
        Ok(())
    }

    /// Checks the bearer token against `run` only.
    fn authenticate(&self, run: &str, headers: &HeaderMap) -> Result<(), Refusal> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                Refusal::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    format!(
                        "run {run}: no bearer token (Authorization: Bearer <the run's step token>)"
                    ),
                )
            })?;
        let check = self.key.check(run, token);
        let created = self.runs.created(run);
        if check.opens(created) {
            return Ok(());
        }
        Err(match (check, created) {
            // Not seen yet (or the watch did not say when it was created):
            // as for a run not known, retry rather than refuse for good.
            (TokenCheck::Retired { key, retired_at }, None) => Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!(
                    "run {run}: the token is of key {key}, retired at {retired_at}, and this \
                     gateway does not know yet when the run was created; retry"
                ),
            ),
            (TokenCheck::Retired { key, retired_at }, Some(created)) => Refusal::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "run {run}: the token is of key {key}, retired at {retired_at}, which opens \
                     only runs created by then; this run was created at {created}"
                ),
            ),
            _ => Refusal::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("run {run}: the token is not this run's step token"),
            ),
        })
    }

    async fn is_finished(&self, run: &str) -> Result<bool, Refusal> {
        if self.finished.lock().expect("not poisoned").contains(run) {
            return Ok(true);
        }
        let done =
            self.store.last_kind(run).await.map_err(Refusal::store)? == Some(StepKind::RunFinished);
        if done {
            self.finished
                .lock()
                .expect("not poisoned")
                .insert(run.to_string());
        }
        Ok(done)
    }
}

/// A refused or failed request, as a [`WireError`] body.
#[derive(Debug)]
pub struct Refusal {
    status: StatusCode,
    body: Box<WireError>,
}

impl Refusal {
    fn new(status: StatusCode, code: &str, message: String) -> Refusal {
        Refusal {
            status,
            body: Box::new(WireError::refusal(code, message)),
        }
    }

    fn store(e: StoreError) -> Refusal {
        let status = match &e {
            StoreError::Conflict { .. }
            | StoreError::StaleEpoch { .. }
            | StoreError::Gap { .. }
            | StoreError::PrevHashMismatch { .. } => StatusCode::CONFLICT,
            StoreError::LeaseHeld { .. } => StatusCode::LOCKED,
            StoreError::InvalidRecord { .. } => StatusCode::BAD_REQUEST,
            StoreError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status.is_server_error() {
            tracing::warn!(error = %e, "step-log gateway: store operation failed");
        }
        Refusal {
            status,
            body: Box::new(WireError::from_store(&e)),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        if self.status == StatusCode::FORBIDDEN || self.status == StatusCode::UNAUTHORIZED {
            tracing::warn!(code = %self.body.code, message = %self.body.message, "step-log gateway refused a request");
        }
        (self.status, Json(*self.body)).into_response()
    }
}

type Reply<T> = Result<Json<T>, Refusal>;

/// Every `/v1/runs/{run}/…` route is behind [`gate`]: no handler (and no
/// extractor reading a body) runs for a request without the run's token.
pub fn router(gateway: Gateway) -> Router {
    Router::new()
        .route("/v1/runs/{run}/records", get(read).post(append))
        .route("/v1/runs/{run}/head", get(head))
        .route("/v1/runs/{run}/lease", post(acquire))
        .route("/v1/runs/{run}/lease/renew", post(renew))
        .route("/v1/runs/{run}/lease/release", post(release))
        .route_layer(axum::middleware::from_fn_with_state(gateway.clone(), gate))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(gateway)
}

/// Authenticates a request from its headers alone, then reserves room for
/// the body it announces in the body budget and holds it until the reply.
/// A body announced over [`MAX_BODY`] is refused unread (413); one without a
/// length reserves [`MAX_BODY`] (the router's limit cuts it there).
async fn gate(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    req: Request,
    next: Next,
) -> Response {
    if let Err(refusal) = g.authenticate(&run, req.headers()) {
        return refusal.into_response();
    }
    let announced = match announced_body(req.headers()) {
        Ok(n) => n,
        Err(refusal) => return refusal.into_response(),
    };
    let _room = match announced {
        0 => None,
        n => match tokio::time::timeout(
            BUDGET_WAIT,
            g.bodies.clone().acquire_many_owned(kib(n) as u32),
        )
        .await
        {
            Ok(Ok(permit)) => Some(permit),
            _ => {
                return Refusal::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    format!("run {run}: the gateway is reading other bodies; retry"),
                )
                .into_response();
            }
        },
    };
    next.run(req).await
}

/// The body size a request announces: its `Content-Length`, [`MAX_BODY`]
/// for a chunked body, 0 for none.
fn announced_body(headers: &HeaderMap) -> Result<usize, Refusal> {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let n = match length {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None if headers.contains_key(header::TRANSFER_ENCODING) => MAX_BODY,
        None => 0,
    };
    if n > MAX_BODY {
        return Err(Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request",
            format!("a request body of {n} bytes is over the gateway's limit of {MAX_BODY}"),
        ));
    }
    Ok(n)
}

/// Bytes as KiB permits, rounded up.
fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024)
}

/// Serves the gateway from a runtime of its own (two threads), with its own
/// store pool, API client and run index: a reconciler busy replaying logs
/// never delays a step pod's heartbeat. Returns the bound address.
pub async fn spawn(
    addr: SocketAddr,
    store_url: String,
    pool: OpenOptions,
    key: TokenKey,
    limits: GatewayLimits,
) -> Result<SocketAddr, StartError> {
    super::own_runtime::spawn("step-gateway", move || async move {
        start(addr, &store_url, &pool, key, limits).await
    })
    .await
}

async fn start(
    addr: SocketAddr,
    store_url: &str,
    pool: &OpenOptions,
    key: TokenKey,
    limits: GatewayLimits,
) -> Result<SocketAddr, StartError> {
    let store = crate::store::open_with(store_url, pool).await?;
    let client = kube::Client::try_default().await?;
    let runs = RunIndex::default();
    tokio::spawn(runs.clone().follow(client));
    let gateway = Gateway::with_budget(store, key, runs, limits.body_budget);
    Ok(serve(addr, gateway, limits.server).await?)
}

/// Binds `addr` with SO_REUSEPORT (replicas sharing one host's network, as
/// on the e2e process node, can all serve) and serves until the process ends.
pub async fn serve(
    addr: SocketAddr,
    gateway: Gateway,
    limits: crate::bounded::Limits,
) -> std::io::Result<SocketAddr> {
    let listener = super::own_runtime::bind_shared(addr)?;
    let local = listener.local_addr()?;
    tokio::spawn(crate::bounded::serve(listener, router(gateway), limits));
    Ok(local)
}

/// What `GET …/records?from=N&to=M[&form=stored][&maxBytes=B]` asks for.
struct Range {
    from: u64,
    to: Option<u64>,
    /// The records as stored (their bodies byte for byte), not decoded.
    stored: bool,
    /// One page of at most this many bytes of bodies (capped at
    /// [`crate::store::PAGE_BYTES`]); without it the whole range, streamed
    /// page by page (what runners of earlier releases ask for).
    max_bytes: Option<usize>,
}

fn range(query: Option<&str>) -> Result<Range, Refusal> {
    let mut range = Range {
        from: 0,
        to: None,
        stored: false,
        max_bytes: None,
    };
    let stored = crate::store::STORED_FORM.split_once('=');
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if Some((k.as_ref(), v.as_ref())) == stored {
            range.stored = true;
            continue;
        }
        let n = || {
            v.parse::<u64>().map_err(|_| {
                Refusal::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!("query parameter {k}={v:?} is not a record number"),
                )
            })
        };
        match k.as_ref() {
            "from" => range.from = n()?,
            "to" => range.to = Some(n()?),
            "maxBytes" => {
                let max = usize::try_from(n()?).unwrap_or(usize::MAX);
                range.max_bytes = Some(max.clamp(1, crate::store::PAGE_BYTES));
            }
            _ => {}
        }
    }
    Ok(range)
}

/// The run's records: as stored, for a runner that verifies their bytes;
/// decoded, for a runner of an earlier release.
async fn read(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Refusal> {
    g.admit(&run).await?;
    let range = range(query.as_deref())?;
    let Some(max) = range.max_bytes else {
        return Ok(streamed(g, run, range));
    };
    let page = g
        .store
        .read_stored_page(&run, range.from, range.to, max)
        .await;
    let page = page.map_err(Refusal::store)?;
    Ok(match range.stored {
        true => Json(page).into_response(),
        false => Json(decoded(&run, &page).map_err(Refusal::store)?).into_response(),
    })
}

/// The records of `page` decoded, as a runner of an earlier release reads them.
fn decoded(run: &str, page: &[StoredRecord]) -> Result<Vec<Record>, StoreError> {
    page.iter().map(|s| s.decode_for(run)).collect()
}

/// The whole range as one JSON array, read and sent a page of
/// [`crate::store::PAGE_BYTES`] at a time: the gateway holds one page
/// however long the log. A store error midway ends the body short (the
/// reader's JSON does not parse, and it reads again).
fn streamed(g: Gateway, run: String, range: Range) -> Response {
    struct Cursor {
        g: Gateway,
        run: String,
        from: u64,
        to: Option<u64>,
        stored: bool,
        /// `[` is sent.
        opened: bool,
        /// No record is sent yet.
        first: bool,
        done: bool,
    }
    let cursor = Cursor {
        g,
        run,
        from: range.from,
        to: range.to,
        stored: range.stored,
        opened: false,
        first: true,
        done: false,
    };
    let chunks = futures::stream::unfold(cursor, |mut c| async move {
        if c.done {
            return None;
        }
        let page =
            c.g.store
                .read_stored_page(&c.run, c.from, c.to, crate::store::PAGE_BYTES)
                .await;
        let page = match page {
            Ok(page) => page,
            Err(e) => return Some((Err(std::io::Error::other(e.to_string())), c)),
        };
        let mut chunk = Vec::new();
        if !std::mem::replace(&mut c.opened, true) {
            chunk.push(b'[');
        }
        let Some(last) = page.last() else {
            chunk.push(b']');
            c.done = true;
            return Some((Ok(chunk), c));
        };
        c.from = last.seq + 1;
        let items = match c.stored {
            true => page
                .iter()
                .map(serde_json::to_vec)
                .collect::<Result<Vec<_>, _>>(),
            false => match decoded(&c.run, &page) {
                Ok(records) => records.iter().map(serde_json::to_vec).collect(),
                Err(e) => return Some((Err(std::io::Error::other(e.to_string())), c)),
            },
        };
        let items = match items {
            Ok(items) => items,
            Err(e) => return Some((Err(std::io::Error::other(e)), c)),
        };
        for item in items {
            if !std::mem::replace(&mut c.first, false) {
                chunk.push(b',');
            }
            chunk.extend(item);
        }
        Some((Ok(chunk), c))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(chunks),
    )
        .into_response()
}

async fn head(State(g): State<Gateway>, Path(run): Path<String>) -> Reply<crate::store::Head> {
    g.admit(&run).await?;
    Ok(Json(g.store.head(&run).await.map_err(Refusal::store)?))
}

async fn append(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    Json(body): Json<AppendBody>,
) -> Reply<crate::store::Record> {
    g.admit(&run).await?;
    let kind = body.record.kind;
    if !runner_may_write(kind) {
        return Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "run {run} seq {}: a step pod may not append {kind} records (only the controller writes them)",
                body.record.seq
            ),
        ));
    }
    let stored = g
        .store
        .append(&run, body.epoch, &body.record)
        .await
        .map_err(Refusal::store)?;
    Ok(Json(stored))
}

fn ttl(millis: u64) -> Duration {
    Duration::from_millis(millis).min(MAX_TTL)
}

async fn acquire(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    Json(body): Json<AcquireBody>,
) -> Reply<Lease> {
    g.admit(&run).await?;
    let lease = g
        .store
        .acquire(&run, &body.holder, ttl(body.ttl_millis))
        .await
        .map_err(Refusal::store)?;
    Ok(Json(lease))
}

fn same_run(run: &str, lease: &Lease) -> Result<(), Refusal> {
    if lease.run == run {
        return Ok(());
    }
    Err(Refusal::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!("lease.run {} is not the run {run} of the path", lease.run),
    ))
}

async fn renew(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    Json(body): Json<crate::store::RenewBody>,
) -> Reply<Lease> {
    // Heartbeats are the bulk of the traffic: no log read. A lease on a
    // finished run opens nothing (reads and appends check).
    same_run(&run, &body.lease)?;
    let lease = g
        .store
        .renew(&body.lease, ttl(body.ttl_millis))
        .await
        .map_err(Refusal::store)?;
    Ok(Json(lease))
}

async fn release(
    State(g): State<Gateway>,
    Path(run): Path<String>,
    Json(lease): Json<Lease>,
) -> Reply<serde_json::Value> {
    same_run(&run, &lease)?;
    g.store.release(&lease).await.map_err(Refusal::store)?;
    Ok(Json(serde_json::json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{RecordDraft, RemoteStore};

    /// A gateway on a fresh SQLite store whose index knows the runs `live`.
    async fn gateway_with(
        live: &[&str],
    ) -> (
        SocketAddr,
        TokenKey,
        Arc<dyn StepStore>,
        RunIndex,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("log.db").display());
        let store = crate::store::open(&url).await.unwrap();
        let key = TokenKey::new(&[b'k'; 32]).unwrap();
        let runs = RunIndex::with_live(live.iter().map(|r| r.to_string()));
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            Gateway::new(store.clone(), key.clone(), runs.clone()),
            GatewayLimits::default().server,
        )
        .await
        .unwrap();
        (addr, key, store, runs, dir)
    }

    async fn gateway() -> (SocketAddr, TokenKey, tempfile::TempDir) {
        let (addr, key, _, _, dir) = gateway_with(&["run-a", "run-b"]).await;
        (addr, key, dir)
    }

    fn client(addr: SocketAddr, token: &str) -> RemoteStore {
        RemoteStore::new(&format!("http://{addr}"), token, Duration::from_secs(5)).unwrap()
    }

    /// A step pod reads its log as stored and verifies those bytes: a
    /// record respelled in the database (its hash recomputed) is refused at
    /// its seq, by the runner as by the gateway's own decoding.
    #[tokio::test]
    async fn a_runner_verifies_the_stored_bytes_the_gateway_hands_on() {
        let (addr, key, store, _, dir) = gateway_with(&["run-a"]).await;
        let lease = store
            .acquire("run-a", "pod", Duration::from_secs(5))
            .await
            .unwrap();
        let mut head = crate::store::Head::EMPTY;
        for n in 0..3 {
            let r = RecordDraft::new(StepKind::Observation, serde_json::json!({"n": n}))
                .seal(&head)
                .unwrap();
            head = store.append("run-a", lease.epoch, &r).await.unwrap().head();
        }
        let a = client(addr, &key.mint("run-a"));
        assert_eq!(a.read_verified("run-a", None).await.unwrap().len(), 3);
        let db = dir.path().join("log.db");
        crate::store::testing::respell_as_superuser(&db, store.as_ref(), "run-a", 2, |b| {
            b.replacen('{', "{\"tampered\":true,", 1)
        })
        .await;
        let stored = a.read_stored("run-a", 2, None).await.unwrap();
        assert!(
            stored[0].body.starts_with("{\"tampered\":true,"),
            "as stored"
        );
        for e in [
            a.read_verified("run-a", None).await.unwrap_err(),
            a.read_range("run-a", 0, None).await.unwrap_err(),
        ] {
            let (StoreError::ChainBroken { seq, reason, .. }
            | StoreError::Corrupt { seq, reason, .. }) = &e
            else {
                panic!("{e:?}")
            };
            assert!(
                *seq == 2 && reason.contains("not the canonical form"),
                "{e}"
            );
        }
    }

    /// A log of large records is read by pages of at most 4 MiB (a
    /// runner's read asks for them), and a reader of an earlier release,
    /// which asks for the whole range at once, gets it whole, streamed a
    /// page at a time.
    #[tokio::test]
    async fn a_log_is_read_by_pages_of_bytes_and_whole_only_as_a_stream() {
        let (addr, key, store, _, _dir) = gateway_with(&["run-a"]).await;
        let lease = store
            .acquire("run-a", "pod", Duration::from_secs(5))
            .await
            .unwrap();
        let mut head = crate::store::Head::EMPTY;
        for n in 0..5 {
            let text = format!("{n}{}", "x".repeat(3 << 19));
            let r = RecordDraft::new(StepKind::Observation, serde_json::json!({"text": text}))
                .seal(&head)
                .unwrap();
            head = store.append("run-a", lease.epoch, &r).await.unwrap().head();
        }
        let token = key.mint("run-a");
        let a = client(addr, &token);
        let page = a
            .read_stored_page("run-a", 0, None, usize::MAX)
            .await
            .unwrap();
        assert_eq!(page.len(), 2, "1.5 MiB records, pages of at most 4 MiB");
        let whole = a.read_verified("run-a", Some(&head.hash)).await.unwrap();
        assert_eq!(whole.len(), 5, "the runner reads page after page");

        // As an earlier runner asks: no maxBytes, every record in one body.
        let url = format!("http://{addr}/v1/runs/run-a/records?from=1");
        for form in ["", "&form=stored"] {
            let reply = reqwest::Client::new()
                .get(format!("{url}{form}"))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap();
            assert_eq!(reply.status(), 200);
            let records: Vec<serde_json::Value> = reply.json().await.unwrap();
            let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
            assert_eq!(seqs, [1, 2, 3, 4], "form {form:?}");
        }
    }

    #[tokio::test]
    async fn gateway_serves_a_runs_own_log_and_refuses_the_rest() {
        let (addr, key, _dir) = gateway().await;
        let a = client(addr, &key.mint("run-a"));
        // Its own run: lease, append a runner kind, read back.
        let lease = a
            .acquire("run-a", "pod", Duration::from_secs(5))
            .await
            .unwrap();
        let head = a.head("run-a").await.unwrap();
        let r = RecordDraft::new(StepKind::Observation, serde_json::json!({"text": "x"}))
            .seal(&head)
            .unwrap();
        a.append("run-a", lease.epoch, &r).await.unwrap();
        assert_eq!(a.read_all("run-a").await.unwrap().len(), 1);
        // Fencing still applies.
        let r2 = RecordDraft::new(StepKind::Observation, serde_json::json!({"text": "y"}))
            .seal(&r.head())
            .unwrap();
        let e = a.append("run-a", lease.epoch + 5, &r2).await.unwrap_err();
        assert_eq!(e.metric_label(), "stale_epoch", "{e}");
        // Another run with run-a's token.
        let e = a.read_all("run-b").await.unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
        assert!(e.to_string().contains("not this run's step token"), "{e}");
        // A controller kind.
        let forged = RecordDraft::new(StepKind::ApprovalDecided, serde_json::json!({}))
            .seal(&r.head())
            .unwrap();
        let e = a.append("run-a", lease.epoch, &forged).await.unwrap_err();
        assert!(
            e.to_string().contains("may not append ApprovalDecided"),
            "{e}"
        );
        // No token at all.
        let e = client(addr, "").head("run-a").await.unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
    }

    /// Sends a request head only; returns the status of the reply.
    async fn status_of_head(addr: SocketAddr, head: String) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut reply = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut reply))
            .await
            .expect("a reply without the body")
            .unwrap();
        let reply = String::from_utf8_lossy(&reply[..n]).into_owned();
        reply.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[tokio::test]
    async fn gateway_refuses_from_the_headers_before_reading_a_body() {
        let (addr, key, _dir) = gateway().await;
        let post = |token: &str, length: usize| {
            format!(
                "POST /v1/runs/run-a/records HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {token}\r\n\
                 Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            )
        };
        // No body byte is sent: the replies come from the headers alone.
        assert_eq!(status_of_head(addr, post("forged", MAX_BODY)).await, 403);
        let token = key.mint("run-a");
        assert_eq!(status_of_head(addr, post(&token, MAX_BODY + 1)).await, 413);
        assert_eq!(status_of_head(addr, post(&token, 1 << 40)).await, 413);
    }

    #[tokio::test]
    async fn gateway_closes_a_finished_run() {
        let (addr, key, store, _, _dir) = gateway_with(&["run-f"]).await;
        // The controller (directly on the store) ends the run.
        let lease = store
            .acquire("run-f", "ctrl", Duration::from_secs(5))
            .await
            .unwrap();
        let done = RecordDraft::new(StepKind::RunFinished, serde_json::json!({}))
            .seal(&crate::store::Head::EMPTY)
            .unwrap();
        store.append("run-f", lease.epoch, &done).await.unwrap();
        store.release(&lease).await.unwrap();
        let c = client(addr, &key.mint("run-f"));
        let e = c.read_all("run-f").await.unwrap_err();
        assert!(e.to_string().contains("is finished"), "{e}");
        let e = c
            .acquire("run-f", "pod", Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
    }

    #[tokio::test]
    async fn gateway_refuses_a_deleted_run_and_holds_off_an_unknown_one() {
        let (addr, key, _, runs, _dir) = gateway_with(&["run-d"]).await;
        let d = client(addr, &key.mint("run-d"));
        let lease = d
            .acquire("run-d", "pod", Duration::from_secs(5))
            .await
            .unwrap();
        runs.forget("run-d");
        let e = d.read_all("run-d").await.unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
        assert!(e.to_string().contains("was deleted"), "{e}");
        let head = crate::store::Head::EMPTY;
        let r = RecordDraft::new(StepKind::Observation, serde_json::json!({"text": "x"}))
            .seal(&head)
            .unwrap();
        let e = d.append("run-d", lease.epoch, &r).await.unwrap_err();
        assert!(e.to_string().contains("was deleted"), "{e}");
        // A run not seen yet: a retryable outage, not a refusal.
        let u = client(addr, &key.mint("run-u"));
        let e = u.head("run-u").await.unwrap_err();
        assert!(e.is_retryable(), "{e}");
    }

    /// After a rotation (key `k` retired at noon, key `n` current), mallory
    /// mints tokens with the leaked retired key: the run created after noon
    /// refuses her (its log, its lease), the run created before it still
    /// opens to its old token, and a run whose creation the gateway does
    /// not know yet is held off.
    #[tokio::test]
    async fn gateway_opens_a_run_to_a_retired_keys_token_only_if_created_before_the_retirement() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("log.db").display());
        let store = crate::store::open(&url).await.unwrap();
        let old = TokenKey::new(&[b'k'; 32]).unwrap();
        let retired = [[b'k'; 32].as_slice(), b" 2026-12-05T12:00:00Z"].concat();
        let key = TokenKey::new(&[b'n'; 32])
            .unwrap()
            .with_retired(&retired)
            .unwrap();
        let at = |t: &str| Some(t.parse::<jiff::Timestamp>().unwrap());
        let runs = RunIndex::with_created([
            ("before".to_string(), at("2026-12-05T11:59:59Z")),
            ("after".to_string(), at("2026-12-05T12:00:01Z")),
            ("unsaid".to_string(), None),
        ]);
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            Gateway::new(store, key.clone(), runs),
            GatewayLimits::default().server,
        )
        .await
        .unwrap();
        let mallory = client(addr, &old.mint("after"));
        let e = mallory.read_all("after").await.unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
        assert!(
            e.to_string().contains("opens only runs created by then"),
            "{e}"
        );
        let e = mallory
            .acquire("after", "mallory", Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(e.metric_label(), "permission_denied", "{e}");
        // The new key's token opens it.
        let own = client(addr, &key.mint("after"));
        assert!(own.read_all("after").await.unwrap().is_empty());
        // The run from before the rotation keeps working on its old token.
        let before = client(addr, &old.mint("before"));
        before
            .acquire("before", "pod", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(before.read_all("before").await.unwrap().is_empty());
        // When the run was created is not known: retry, not opened.
        let e = client(addr, &old.mint("unsaid"))
            .head("unsaid")
            .await
            .unwrap_err();
        assert!(e.is_retryable(), "{e}");
    }
}
