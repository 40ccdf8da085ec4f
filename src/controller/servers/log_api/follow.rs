//! Following a run's log: records are sent as they are appended, woken by
//! the store's head events (PostgreSQL `LISTEN/NOTIFY`, one listener for
//! every follower of this replica), not by polling; the stream ends when the
//! log ends with `RunFinished`, or with an `ERROR` event saying why it
//! stopped (the run was deleted, the log does not verify, the store is
//! unreachable). A client resumes with `fromSeq`: every record is sent
//! once, in order, and checked as the continuation of the one before.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::mpsc;

use super::authorize::{Answer, Question};
use super::front_proxy::User;
use super::pages::{ends_the_log, meta};
use super::{LogApi, status, status_body};
use crate::api::AgentRun;
use crate::api::runlog::{ADDED, ERROR, MODIFIED, RunLog, RunState, WatchEvent};
use crate::store::{Head, PageTicket, StoreError, StoredRecord};

/// How often a follower looks at the store when nothing woke it: seldom
/// where head events are pushed (a safety net), often where they are not.
const POLL_PUSHED: Duration = Duration::from_secs(30);
const POLL_UNPUSHED: Duration = Duration::from_secs(1);

/// Who follows, and the question their access was granted for: asked
/// again while the stream lasts, so a removed RoleBinding ends it.
pub struct Access {
    pub user: User,
    pub question: Question,
}

/// The stream response for `run`'s log from seq `from` on, or the error
/// to answer instead (a `from` past the log's end, an unreachable store).
pub async fn stream(api: LogApi, run: AgentRun, from: u64, access: Access) -> Response {
    let uid = crate::api::RunUid::of(&run);
    let base = match base_of(&api, &uid, from).await {
        Ok(Some(base)) => base,
        Ok(None) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("fromSeq={from} is past the end of the log"),
            );
        }
        Err(e) => {
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("reading the step log: {e}"),
            );
        }
    };
    // Each page travels with its ticket of the read budget, let go once
    // the body has handed its bytes on (the next poll).
    let (tx, rx) = mpsc::channel::<(Bytes, Option<PageTicket>)>(2);
    let follower = Follower {
        api,
        run,
        uid: uid.into(),
        tx,
        access,
    };
    tokio::spawn(follower.run(base));
    let body = futures::stream::unfold((rx, None), |(mut rx, held)| async move {
        drop(held);
        let (bytes, ticket) = rx.recv().await?;
        Some((Ok::<_, Infallible>(bytes), (rx, ticket)))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

/// Where following from `from` starts: the head of the records before it
/// (and whether the log already ended there); `None` when `from` is past
/// the end.
async fn base_of(api: &LogApi, uid: &str, from: u64) -> Result<Option<(Head, bool)>, StoreError> {
    if from == 0 {
        return Ok(Some((Head::EMPTY, false)));
    }
    let before = api.store.read_stored(uid, from - 1, Some(from)).await?;
    Ok(before.first().map(|r| {
        let head = Head {
            len: from,
            hash: r.hash,
        };
        (head, ends_the_log(r))
    }))
}

/// One follower: its run and the stream it writes to.
struct Follower {
    api: LogApi,
    run: AgentRun,
    uid: String,
    tx: mpsc::Sender<(Bytes, Option<PageTicket>)>,
    access: Access,
}

/// Why following ended.
enum End {
    /// The log ended with `RunFinished` (its outcome).
    Finished(Option<String>),
    /// An `ERROR` event to send.
    Error(StatusCode, &'static str, String),
    /// The client went away.
    Closed,
}

impl Follower {
    async fn run(self, (mut base, finished): (Head, bool)) {
        let mut heads = self.api.heads.subscribe();
        let gone = run_gone(&self.api, &self.run);
        tokio::pin!(gone);
        let poll = if self.api.pushes {
            POLL_PUSHED
        } else {
            POLL_UNPUSHED
        };
        // Access is asked again as often as an answer is remembered, so a
        // revocation ends the stream within twice the authorizer's TTL.
        let recheck = self.api.authorizer.ttl().max(Duration::from_secs(1));
        let mut rechecks = tokio::time::interval_at(tokio::time::Instant::now() + recheck, recheck);
        let end = if finished {
            End::Finished(None)
        } else {
            loop {
                match self.send_new(&mut base).await {
                    Ok(Some(end)) => break end,
                    Ok(None) => {}
                    Err(end) => break end,
                }
                tokio::select! {
                    () = self.woken(&mut heads) => {}
                    () = tokio::time::sleep(poll) => {}
                    () = &mut gone => break self.deleted(base),
                    () = self.tx.closed() => break End::Closed,
                    _ = rechecks.tick() => if let Some(end) = self.revoked(base).await {
                        break end;
                    },
                }
            }
        };
        self.finish(end, base).await;
    }

    /// Sends the records after `base` (a page at a time) and moves it on;
    /// `Some` when the log ended with them.
    async fn send_new(&self, base: &mut Head) -> Result<Option<End>, End> {
        loop {
            let Some(ticket) = self.api.reads.page_within(super::READ_WAIT).await else {
                // Not now: the next wake or poll tries again.
                return Ok(None);
            };
            let mut records = self
                .api
                .store
                .read_stored_page(&self.uid, base.len, None, super::PAGE_BYTES)
                .await
                .map_err(read_failed)?;
            if records.is_empty() {
                return Ok(None);
            }
            if let Err(e) = crate::store::verify_stored_extension(&self.uid, base, &records) {
                // Sent as stored up to the one that fails, so that the
                // client names it too; the stream stops there.
                let bad = match &e {
                    StoreError::ChainBroken { seq, .. } => *seq,
                    _ => base.len,
                };
                records.retain(|r| r.seq <= bad);
                self.send_page(self.page(*base, records), ticket).await?;
                return Err(End::Error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    format!("the log does not verify: {e}"),
                ));
            }
            let last = records.last().expect("not empty").clone();
            let next = Head {
                len: last.seq + 1,
                hash: last.hash,
            };
            *base = next;
            self.send_page(self.page(next, records), ticket).await?;
            if ends_the_log(&last) {
                return Ok(Some(End::Finished(outcome(&last))));
            }
        }
    }

    /// An `ADDED` event of a page, sent with the page's ticket.
    async fn send_page(&self, object: serde_json::Value, ticket: PageTicket) -> Result<(), End> {
        self.send_held(ADDED, object, Some(ticket)).await
    }

    /// A RunLog event object holding `records`.
    fn page(&self, head: Head, records: Vec<StoredRecord>) -> serde_json::Value {
        let mut log = RunLog::new(
            meta(&self.run, head.len),
            RunState {
                phase: None,
                finished: false,
                length: head.len,
            },
        );
        log.records = records;
        serde_json::to_value(log).expect("serializes")
    }

    /// Waits for a head event that concerns this run (or may: a resync, a
    /// lag); forever when the store pushes none.
    async fn woken(&self, heads: &mut tokio::sync::broadcast::Receiver<crate::store::HeadEvent>) {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            match heads.recv().await {
                Ok(crate::store::HeadEvent::Changed(run)) if run == self.uid => return,
                Ok(crate::store::HeadEvent::Changed(_)) => {}
                Ok(crate::store::HeadEvent::Resync) | Err(RecvError::Lagged(_)) => return,
                Err(RecvError::Closed) => std::future::pending::<()>().await,
            }
        }
    }

    /// Why following must stop, if the follower may no longer watch (or
    /// the API server cannot say whether they may: never a yes).
    async fn revoked(&self, base: Head) -> Option<End> {
        let Access { user, question } = &self.access;
        match self.api.authorizer.check(user, question).await {
            Ok(Answer::Allowed) => None,
            Ok(Answer::Denied(text)) => Some(End::Error(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "{text} (access ended while following; {} records were sent)",
                    base.len
                ),
            )),
            Err(e) => Some(End::Error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!(
                    "could not authorize following any longer: {e}; resume with fromSeq={}",
                    base.len
                ),
            )),
        }
    }

    fn deleted(&self, base: Head) -> End {
        let name = self.run.metadata.name.clone().unwrap_or_default();
        let ns = self.run.metadata.namespace.clone().unwrap_or_default();
        End::Error(
            StatusCode::GONE,
            "Gone",
            format!(
                "the AgentRun {ns}/{name} was deleted while its log was followed; {} records were sent",
                base.len
            ),
        )
    }

    async fn finish(&self, end: End, base: Head) {
        let (kind, object) = match end {
            End::Closed => return,
            End::Finished(outcome) => {
                let mut log = RunLog::new(
                    meta(&self.run, base.len),
                    RunState {
                        phase: outcome,
                        finished: true,
                        length: base.len,
                    },
                );
                log.records.clear();
                (MODIFIED, serde_json::to_value(log).expect("serializes"))
            }
            End::Error(code, reason, message) => (ERROR, status_body(code, reason, message)),
        };
        let _ = self.send(kind, object).await;
    }

    async fn send(&self, kind: &str, object: serde_json::Value) -> Result<(), End> {
        self.send_held(kind, object, None).await
    }

    async fn send_held(
        &self,
        kind: &str,
        object: serde_json::Value,
        ticket: Option<PageTicket>,
    ) -> Result<(), End> {
        let event = WatchEvent {
            kind: kind.into(),
            object,
        };
        let mut line = serde_json::to_vec(&event).expect("serializes");
        line.push(b'\n');
        self.tx
            .send((Bytes::from(line), ticket))
            .await
            .map_err(|_| End::Closed)
    }
}

fn read_failed(e: StoreError) -> End {
    match e {
        StoreError::Corrupt { seq, reason, .. } => End::Error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            format!("the log does not verify: record {seq} cannot be read as a record: {reason}"),
        ),
        e => End::Error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("reading the step log: {e}"),
        ),
    }
}

/// The outcome a stored `RunFinished` record names.
fn outcome(r: &StoredRecord) -> Option<String> {
    r.decode()
        .ok()?
        .payload
        .get("outcome")
        .and_then(|o| o.as_str())
        .map(str::to_string)
}

/// Resolves once the run is gone: deleted, or replaced by another of its
/// name (another uid). A watch on the one AgentRun, not a poll.
async fn run_gone(api: &LogApi, run: &AgentRun) {
    let ns = run.metadata.namespace.clone().unwrap_or_default();
    let name = run.metadata.name.clone().unwrap_or_default();
    let uid = run.metadata.uid.clone();
    let runs: Api<AgentRun> = Api::namespaced(api.client.clone(), &ns);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(runs, config).default_backoff().boxed();
    let mut seen = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Delete(r)) if r.metadata.uid == uid => return,
            Ok(Event::Apply(r)) | Ok(Event::InitApply(r)) => {
                if r.metadata.uid != uid {
                    return;
                }
                seen = true;
            }
            Ok(Event::Init) => seen = false,
            Ok(Event::InitDone) if !seen => return,
            _ => {}
        }
    }
    std::future::pending::<()>().await
}
