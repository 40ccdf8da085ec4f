//! `log RUN`, `log -f RUN` and `verify RUN`: a run's step log, read through
//! the log API with the user's own identity (or, for administrators, from
//! the store with `--store-url`), and verified here, whatever served it:
//! the chain recomputed from seq 0, the controller's signatures checked with
//! its published keys, the end compared with the run's `status.log`. A log
//! that does not verify is printed with its failing records marked `!` and
//! the command fails; it is never called verified.

mod api;
pub(crate) mod check;
mod follow;

use std::io::Write;

use super::approvals::{audit_line, visible};
use super::{ClientError, Kube};
use crate::refusal::Refusal;
use crate::store::{Record, RecordVerifier, StoreError};
pub use api::LogApiError;
use api::{Failure, LogApi, Retry};
pub use check::TrustError;
use check::{Pages, Trust, Verdict};

/// Why a run's log could not be read, or does not verify. What a person
/// is told of a log that does not verify (`NOT VERIFIED: ...`) carries the
/// refusal's words as they are; a failure below (the API server, the store,
/// a malformed head) is the source.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Reading the run as the person failed as the API server said.
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Api(#[from] LogApiError),
    /// Reading the store (administrators, `--store-url`).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Writing the output.
    #[error(transparent)]
    Write(#[from] std::io::Error),
    #[error("no run {run} in namespace {ns}")]
    NoRun { run: String, ns: String },
    #[error("reading run {run} in namespace {ns}")]
    ReadRun {
        run: String,
        ns: String,
        #[source]
        source: kube::Error,
    },
    /// The run's status records a head that is no hash.
    #[error("run {run}")]
    RunStatus {
        run: String,
        #[source]
        source: TrustError,
    },
    /// The log API reports a head that is no hash.
    #[error(transparent)]
    ServedStatus(TrustError),
    #[error("the log API sent no page, and {why}")]
    NoPage { why: Refusal },
    #[error("reading the log of run {run}: {why} (gave up after {tries} tries)")]
    PagesGaveUp {
        run: String,
        why: String,
        tries: u32,
    },
    #[error("NOT VERIFIED: reading the log of run {run}: {refusal}")]
    PageRefused { run: String, refusal: Refusal },
    /// A record the log API sent out of place (a repeat or a gap).
    #[error("{0}")]
    RecordOutOfPlace(Refusal),
    #[error("following run {run}: the log API sent a line that is not an event")]
    NotAnEvent {
        run: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("following run {run}: the log API sent an event that is not a RunLog")]
    NotARunLog {
        run: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("NOT VERIFIED: {0}")]
    RunReplaced(Refusal),
    #[error("NOT VERIFIED: following run: {0}")]
    FollowRefused(Refusal),
    #[error("following run {run}: the run is gone: {message}")]
    RunGone { run: String, message: String },
    #[error("following run {run}: the log API ended the stream ({code} {reason}): {message}")]
    StreamEnded {
        run: String,
        code: u16,
        reason: String,
        message: String,
    },
    #[error("following run {run}: {why}; gave up after {tries} tries to resume from seq {seq}")]
    FollowGaveUp {
        run: String,
        why: String,
        tries: u32,
        seq: u64,
    },
    /// `log`: the records and the problems were printed.
    #[error("the log of run {run} does not verify")]
    NotVerified { run: String },
    /// `verify`: the checks and the failures were printed.
    #[error("run {run} does not verify")]
    VerifyFailed { run: String },
}

/// Where the log is read from and what it is checked with.
pub struct Source<'a> {
    /// The store's URL (administrators), instead of the log API.
    pub store_url: Option<&'a str>,
    /// Namespace of the controller's published keys.
    pub controller_namespace: &'a str,
}

/// `log RUN` (`follow`: `log -f RUN`).
pub async fn log(
    k: &Kube,
    run: &str,
    source: &Source<'_>,
    follow: bool,
    out: &mut impl Write,
) -> Result<(), LogError> {
    match (source.store_url, follow) {
        (Some(url), false) => log_from_store(k, run, url, out).await,
        (store_url, true) => {
            if store_url.is_some() {
                // AGENTRUN_STORE_URL may sit in an administrator's
                // environment: following still works, through the API.
                eprintln!("note: log -f follows through the log API; --store-url is not used");
            }
            let api = LogApi::new(k.client.clone(), &k.ns, run);
            let trust = run_trust(k, run).await?;
            let keys = keys(k, source.controller_namespace).await;
            follow::follow(k, &api, run, trust, keys, Retry::follow(), out).await
        }
        (None, false) => {
            let read = read_api(k, run, source.controller_namespace).await?;
            print_log(run, &read.records, &read.verdict, out)
        }
    }
}

/// `verify RUN`: one line per controller record, then `ok: ...` or the
/// `FAILED: ...` lines (and the command fails).
pub async fn verify(
    k: &Kube,
    run: &str,
    source: &Source<'_>,
    out: &mut impl Write,
) -> Result<(), LogError> {
    let read = read_verified(k, run, source).await?;
    print_verify(run, &read.verdict, out)?;
    verify_parents(&Live { k, source }, run, read.records, out).await
}

/// Where `verify` reads a fork's parent: a run of the namespace, its uid
/// and its log, verified.
pub(crate) trait Parents {
    async fn read(&self, name: &str) -> Result<(String, Read), LogError>;
}

/// The parent as the cluster has it (the run, then its log from the
/// store or the log API).
struct Live<'a, 'b> {
    k: &'a Kube,
    source: &'a Source<'b>,
}

impl Parents for Live<'_, '_> {
    async fn read(&self, name: &str) -> Result<(String, Read), LogError> {
        let uid = crate::api::RunUid::of(&self.k.run(name).await?).to_string();
        Ok((uid, read_verified(self.k, name, self.source).await?))
    }
}

/// A run's log read and verified from the store or the log API.
pub(crate) async fn read_verified(
    k: &Kube,
    run: &str,
    source: &Source<'_>,
) -> Result<Read, LogError> {
    match source.store_url {
        Some(url) => verify_store(k, run, url, source.controller_namespace).await,
        None => read_api(k, run, source.controller_namespace).await,
    }
}

/// How many forks of forks `verify` walks back (a loop of names cannot
/// hold it forever).
const MAX_FORK_DEPTH: usize = 64;

/// `verify` of a fork: its copied prefix against its parent's verified
/// log, and so on back to a run that is no fork (DESIGN.md "Forks").
pub(crate) async fn verify_parents(
    parents: &impl Parents,
    run: &str,
    mut records: Vec<Record>,
    out: &mut impl Write,
) -> Result<(), LogError> {
    let mut child = run.to_string();
    for _ in 0..MAX_FORK_DEPTH {
        let failed = |out: &mut dyn Write, why: String| -> Result<(), LogError> {
            writeln!(out, "FAILED: {}", visible(&why))?;
            Err(LogError::VerifyFailed {
                run: run.to_string(),
            })
        };
        let origin = match crate::fork::origin(&records) {
            Ok(Some(origin)) => origin,
            Ok(None) => return Ok(()),
            Err(e) => return failed(out, format!("run {child}: {e}")),
        };
        let f = &origin.forked;
        writeln!(
            out,
            "fork: {child} begins at seq {} after the parent {}'s seq {}, forked by {}",
            origin.at,
            visible(&f.parent_name),
            f.seq,
            visible(f.requester.as_deref().unwrap_or("(unknown)"))
        )?;
        if let Some(r) = &f.replaced {
            writeln!(
                out,
                "replaced: {child}'s record {} is not the parent's (hash {}): replaced by {}, because {}",
                r.seq,
                visible(&r.parent_hash),
                visible(r.by.as_deref().unwrap_or("(unknown)")),
                visible(&r.reason)
            )?;
        }
        let (uid, read) = parents.read(&f.parent_name).await?;
        if uid != f.parent_uid {
            return failed(
                out,
                format!(
                    "run {child} was forked from {} uid {}, but the run of that name now has uid {uid}: the parent is gone",
                    f.parent_name, f.parent_uid
                ),
            );
        }
        if !read.verdict.ok() {
            return failed(
                out,
                format!(
                    "the parent {}'s log does not verify (run `verify {}`)",
                    f.parent_name, f.parent_name
                ),
            );
        }
        if let Err(e) = crate::fork::check_prefix(&records, &origin, &read.records) {
            return failed(out, format!("run {child}'s copied prefix: {e}"));
        }
        writeln!(
            out,
            "ok: {child}'s records 0..={} are {}'s, whose hash at seq {} is {}",
            f.seq, f.parent_name, f.seq, f.parent_hash
        )?;
        child = f.parent_name.clone();
        records = read.records;
    }
    writeln!(
        out,
        "note: stopped after {MAX_FORK_DEPTH} forks of forks; the rest is not checked"
    )?;
    Ok(())
}

/// The audit trail straight from the store, as administrators read it.
async fn log_from_store(
    k: &Kube,
    run: &str,
    store_url: &str,
    out: &mut impl Write,
) -> Result<(), LogError> {
    let r = k.run(run).await?;
    let store = crate::store::open(store_url).await?;
    for record in store.read_all(&r.metadata.uid.unwrap_or_default()).await? {
        writeln!(out, "{}", audit_line(&record))?;
    }
    Ok(())
}

/// The store's records of `run`, judged against its status.
async fn verify_store(
    k: &Kube,
    run: &str,
    store_url: &str,
    controller_namespace: &str,
) -> Result<Read, LogError> {
    let r = k.run(run).await?;
    let trust = Trust::of_run(&r).map_err(|source| LogError::RunStatus {
        run: run.to_string(),
        source,
    })?;
    let keys = keys(k, controller_namespace).await;
    let store = crate::store::open(store_url).await?;
    let uid = crate::api::RunUid::of(&r);
    // As stored: the bytes are what is verified, whatever they decode to.
    let stored = store.read_stored(&uid, 0, None).await?;
    let (records, verdict) =
        check::judge(&uid, &stored, keys, &trust).map_err(LogError::RecordOutOfPlace)?;
    Ok(Read { records, verdict })
}

/// A whole log read through the API, and its verdict.
pub(crate) struct Read {
    pub(crate) records: Vec<Record>,
    pub(crate) verdict: Verdict,
}

/// Reads run `run`'s whole log through the log API as `k`'s user and
/// verifies it (chain, signatures, the run's status).
pub(crate) async fn read_api(
    k: &Kube,
    run: &str,
    controller_namespace: &str,
) -> Result<Read, LogError> {
    let trust = run_trust(k, run).await?;
    let api = LogApi::new(k.client.clone(), &k.ns, run);
    let pages = read_pages(&api, run, Retry::pages()).await?;
    let keys = keys(k, controller_namespace).await;
    let (records, verdict) = judge_pages(&pages, trust, keys)?;
    Ok(Read { records, verdict })
}

/// Every page of the log, in order.
async fn read_pages(api: &LogApi, run: &str, mut retry: Retry) -> Result<Pages, LogError> {
    let mut pages = Pages::default();
    let mut token: Option<String> = None;
    loop {
        let page = match api.page(token.as_deref()).await {
            Ok(page) => page,
            Err(Failure::Final(e)) => return Err(e.into()),
            Err(Failure::Transient(why)) => {
                let Some(pause) = retry.next_pause() else {
                    return Err(LogError::PagesGaveUp {
                        run: run.to_string(),
                        why,
                        tries: retry.count().1,
                    });
                };
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        retry.reset();
        token = pages.push(page).map_err(|refusal| LogError::PageRefused {
            run: run.to_string(),
            refusal,
        })?;
        if token.is_none() {
            return Ok(pages);
        }
    }
}

/// The records the pages hold (decoded, to show) and the verdict on them:
/// against the run's status when the user may read the run, else against
/// the head the log API reported.
fn judge_pages(
    pages: &Pages,
    trust: Result<Trust, Refusal>,
    keys: Result<RecordVerifier, Refusal>,
) -> Result<(Vec<Record>, Verdict), LogError> {
    let last = pages.last.as_ref();
    let served_uid = last.and_then(|l| l.metadata.uid.clone());
    let trust = match (trust, last) {
        (Ok(t), _) => t,
        (Err(why), Some(l)) => Trust::of_log(l, &why).map_err(LogError::ServedStatus)?,
        (Err(why), None) => return Err(LogError::NoPage { why }),
    };
    let uid = trust.uid.clone().or(served_uid.clone()).unwrap_or_default();
    let (records, mut verdict) =
        check::judge(&uid, &pages.records, keys, &trust).map_err(LogError::RecordOutOfPlace)?;
    if let Some(problem) = other_run(&uid, served_uid.as_deref()) {
        verdict.global.push(problem);
    }
    let server = pages
        .failed
        .as_ref()
        .or(last.and_then(|l| l.verification.as_ref()));
    if let Some(note) = check::server_said(server, &verdict) {
        verdict.notes.push(note);
    }
    Ok((records, verdict))
}

/// A log the API says is another run's than the one read from the API server.
fn other_run(uid: &str, served: Option<&str>) -> Option<String> {
    match served {
        Some(s) if s != uid => Some(format!(
            "the log API served the log of run uid {}, but the run is uid {uid}",
            visible(s)
        )),
        None if uid.is_empty() => Some("the log API did not name the run's uid".into()),
        _ => None,
    }
}

/// What to check the log against: the run's status, or (`Err`) why the
/// user may not read the run (the log API's word is used then).
async fn run_trust(k: &Kube, run: &str) -> Result<Result<Trust, Refusal>, LogError> {
    match k.runs.get(run).await {
        Ok(r) => Ok(Ok(Trust::of_run(&r).map_err(|source| {
            LogError::RunStatus {
                run: run.to_string(),
                source,
            }
        })?)),
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(Err(Refusal::new(format!(
            "you may not get agentruns in namespace {}",
            k.ns
        )))),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(LogError::NoRun {
            run: run.to_string(),
            ns: k.ns.clone(),
        }),
        Err(source) => Err(LogError::ReadRun {
            run: run.to_string(),
            ns: k.ns.clone(),
            source,
        }),
    }
}

/// The controller's published public keys, or why they could not be read
/// (the log is then not verified, but still shown).
async fn keys(k: &Kube, controller_namespace: &str) -> Result<RecordVerifier, Refusal> {
    crate::keys::published::read(&k.client, controller_namespace)
        .await
        .map_err(|e| {
            Refusal::new(format!(
                "{} (is --controller-namespace right?)",
                crate::text::chain(&e)
            ))
        })
}

/// A record's trail line, marked `!` when it failed.
pub fn marked_line(r: &Record, marked: bool) -> String {
    let line = audit_line(r);
    if marked { format!("!{line}") } else { line }
}

/// The line of a stored record whose bytes are no record at all.
pub fn unreadable_line(seq: u64) -> String {
    format!("{seq:>4}  (stored bytes that are not a record; see the problems below)")
}

/// The records, then the verdict; fails when the log does not verify. A
/// marked seq with no record to show (its bytes are no record) gets a line
/// of its own, in place.
fn print_log(
    run: &str,
    records: &[Record],
    verdict: &Verdict,
    out: &mut impl Write,
) -> Result<(), LogError> {
    // Every received seq has a line: the ones missing between records shown
    // (and after the last) are the received ones that decode to nothing.
    let mut next = 0;
    for r in records {
        for seq in next..r.seq {
            writeln!(out, "!{}", unreadable_line(seq))?;
        }
        writeln!(out, "{}", marked_line(r, verdict.marks(r.seq)))?;
        next = r.seq + 1;
    }
    for seq in next..verdict.head.len {
        writeln!(out, "!{}", unreadable_line(seq))?;
    }
    print_verdict(run, verdict, out)
}

/// The verdict lines of `log`: `verified: ...`, or every problem and a
/// final `NOT VERIFIED: ...` (and the command fails).
fn print_verdict(run: &str, verdict: &Verdict, out: &mut impl Write) -> Result<(), LogError> {
    if print_notes_and_ok("verified", verdict, out)? {
        return Ok(());
    }
    for p in verdict.problems() {
        writeln!(out, "! {}", visible(&p))?;
    }
    writeln!(out, "NOT VERIFIED: {}", summary(verdict))?;
    Err(LogError::NotVerified {
        run: run.to_string(),
    })
}

/// The verdict's notes, then, when it verifies, the line saying so
/// (`WORD: N records, chain intact, ...`); whether it verifies.
fn print_notes_and_ok(
    word: &str,
    verdict: &Verdict,
    out: &mut impl Write,
) -> Result<bool, LogError> {
    for note in &verdict.notes {
        writeln!(out, "note: {}", visible(note))?;
    }
    if verdict.ok() {
        writeln!(
            out,
            "{word}: {} records, chain intact, {}, {} controller records signed",
            verdict.head.len,
            verdict.anchored,
            verdict.signed.len()
        )?;
    }
    Ok(verdict.ok())
}

/// What failed, in a few words.
pub(crate) fn summary(verdict: &Verdict) -> String {
    let seqs: Vec<String> = verdict.marked.keys().map(u64::to_string).collect();
    match (seqs.is_empty(), verdict.global.first()) {
        (false, _) => format!(
            "record{} {} marked ! failed (see above){}",
            if seqs.len() == 1 { "" } else { "s" },
            seqs.join(", "),
            if verdict.global.is_empty() {
                ""
            } else {
                ", and the log as a whole"
            }
        ),
        (true, Some(first)) => visible(first),
        (true, None) => "the log does not verify".into(),
    }
}

/// `verify`'s lines (as they were when it read the store only).
fn print_verify(run: &str, verdict: &Verdict, out: &mut impl Write) -> Result<(), LogError> {
    for s in &verdict.signed {
        writeln!(out, "seq {} {}: {}", s.seq, s.kind, s.check)?;
    }
    if print_notes_and_ok("ok", verdict, out)? {
        return Ok(());
    }
    for p in verdict.problems() {
        writeln!(out, "FAILED: {}", visible(&p))?;
    }
    let refused = verdict.refused();
    if !refused.is_empty() {
        writeln!(
            out,
            "FAILED: controller signatures refused at {}",
            refused.join(", ")
        )?;
    }
    Err(LogError::VerifyFailed {
        run: run.to_string(),
    })
}

#[cfg(test)]
mod tests;
