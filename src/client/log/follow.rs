//! `log -f RUN`: the run's records printed as they are appended, each
//! checked against the one before as it arrives, until the run finishes
//! (its final phase is the last line). A dropped stream (a replica
//! restarting, a connection reset, a 503) is resumed from the next seq
//! wanted, so no record is printed twice or skipped; the log API's own end
//! of the stream (the run deleted, ...) ends the command with its reason.

use std::io::Write;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kube::core::Status;

use super::api::{Failure, LogApi, Retry, transient};
use super::check::{Checker, Trust, same_run};
use super::{Kube, LogError, marked_line, print_verdict, run_trust, unreadable_line};
use crate::api::runlog::{ADDED, ERROR, MODIFIED, RunLog, WatchEvent};
use crate::client::approvals::visible;
use crate::refusal::Refusal;
use crate::runlog::records::RunFinished;
use crate::store::RecordVerifier;
use crate::store::StepKind;

/// A stream open this long made progress even without records (a run
/// waiting for a person appends nothing for hours): its drop starts the
/// count of tries again.
const QUIET_PROGRESS: Duration = Duration::from_secs(30);

/// What one line of the stream means.
#[derive(Debug)]
pub enum Next {
    /// Records were printed (or nothing happened); read on.
    More { records: usize },
    /// The run finished: the log is complete.
    Finished(Box<RunLog>),
    /// The stream stopped but may be resumed.
    Resume(String),
}

/// What is followed: what was received and checked so far.
pub struct Follow {
    run: String,
    keys: Result<RecordVerifier, Refusal>,
    /// The run's status read at the start, or why it could not be.
    trust: Result<Trust, Refusal>,
    /// Set up at the first event when the run could not be read.
    checker: Option<Checker>,
    /// The first event's log (which run the stream is of).
    first: Option<RunLog>,
    /// The phase the log's own verified RunFinished record gives: the
    /// log API's view of the status may still show the run running when
    /// the stream ends with that record.
    recorded_phase: Option<String>,
}

impl Follow {
    pub fn new(
        run: &str,
        trust: Result<Trust, Refusal>,
        keys: Result<RecordVerifier, Refusal>,
    ) -> Follow {
        let mut f = Follow {
            run: run.to_string(),
            keys,
            trust,
            checker: None,
            first: None,
            recorded_phase: None,
        };
        if let Ok(t) = &f.trust
            && let Some(uid) = &t.uid
        {
            f.checker = Some(Checker::new(uid, f.keys.clone(), t));
        }
        f
    }

    /// The seq the next record must have (where a reconnect resumes).
    pub fn next_seq(&self) -> u64 {
        self.checker.as_ref().map_or(0, Checker::next_seq)
    }

    /// Handles one line of the stream, printing the records it brings.
    /// An error is final (the stream refused, the server's end of it).
    pub fn line(&mut self, line: &str, out: &mut impl Write) -> Result<Next, LogError> {
        if line.trim().is_empty() {
            return Ok(Next::More { records: 0 });
        }
        let event: WatchEvent =
            serde_json::from_str(line).map_err(|source| LogError::NotAnEvent {
                run: self.run.clone(),
                source,
            })?;
        match event.kind.as_str() {
            ADDED | MODIFIED => {
                let log: RunLog = serde_json::from_value(event.object).map_err(|source| {
                    LogError::NotARunLog {
                        run: self.run.clone(),
                        source,
                    }
                })?;
                let records = self.records(&log, out)?;
                Ok(if log.run.finished {
                    Next::Finished(Box::new(log))
                } else {
                    Next::More { records }
                })
            }
            ERROR => {
                let status: Status = serde_json::from_value(event.object).unwrap_or_default();
                stopped(&self.run, &status)
            }
            // BOOKMARK and types to come: nothing to print.
            _ => Ok(Next::More { records: 0 }),
        }
    }

    /// Checks and prints the records of one event.
    fn records(&mut self, log: &RunLog, out: &mut impl Write) -> Result<usize, LogError> {
        match &self.first {
            Some(first) => same_run(first, log).map_err(LogError::RunReplaced)?,
            None => self.first = Some(log.clone()),
        }
        let mut recorded = None;
        let checker = self.checker_for(log)?;
        for s in &log.records {
            let taken = checker.take(s).map_err(LogError::FollowRefused)?;
            let ok = taken.wrong.is_empty();
            let Some(r) = taken.record else {
                writeln!(out, "!{}", unreadable_line(s.seq))?;
                continue;
            };
            writeln!(out, "{}", marked_line(&r, !ok))?;
            if ok
                && r.kind == StepKind::RunFinished
                && let Ok(f) = serde_json::from_value::<RunFinished>(r.payload.clone())
            {
                recorded = Some(format!("{:?}", f.outcome.phase()));
            }
        }
        if recorded.is_some() {
            self.recorded_phase = recorded;
        }
        out.flush()?;
        Ok(log.records.len())
    }

    /// The checker, set up from the first event when the run could not be
    /// read (its uid and head are then the log API's word).
    fn checker_for(&mut self, log: &RunLog) -> Result<&mut Checker, LogError> {
        if self.checker.is_none() {
            let trust = match &self.trust {
                Ok(t) => t.clone(),
                Err(why) => Trust::of_log(log, why).map_err(LogError::ServedStatus)?,
            };
            let uid = trust.uid.clone().unwrap_or_default();
            let mut checker = Checker::new(&uid, self.keys.clone(), &trust);
            if uid.is_empty() {
                checker.fail("the log API did not name the run's uid".into());
            }
            self.checker = Some(checker);
        }
        Ok(self.checker.as_mut().expect("set above"))
    }

    /// The end: checks the log against the run's final status (`fin`) and
    /// the length the server reported, prints the verdict and the final
    /// phase line.
    pub fn finish(
        mut self,
        last: &RunLog,
        fin: Result<Trust, Refusal>,
        out: &mut impl Write,
    ) -> Result<(), LogError> {
        let fin = match fin {
            Ok(t) => t,
            Err(why) => Trust::of_log(last, &why).map_err(LogError::ServedStatus)?,
        };
        let checker = self.checker_for(last)?;
        checker.expect(&fin);
        if let Some(uid) = &fin.uid
            && let Some(served) = last.metadata.uid.as_deref()
            && served != uid
        {
            checker.fail(format!(
                "the log API served the log of run uid {}, but the run is uid {uid}",
                visible(served)
            ));
        }
        let received = checker.next_seq();
        if last.run.length > received {
            checker.fail(format!(
                "the log API reported {} records at the end but sent {received}: records are missing",
                last.run.length
            ));
        }
        let verdict = checker.verdict();
        // The run's status when the reader may read it, else what the
        // verified log says, else the log API's word.
        let phase = fin
            .phase
            .clone()
            .filter(|_| fin.terminal)
            .or_else(|| self.recorded_phase.clone())
            .or_else(|| fin.phase.clone())
            .or_else(|| last.run.phase.clone())
            .unwrap_or_else(|| "finished".into());
        let finished = format!("run {} finished: {}", self.run, visible(&phase));
        if verdict.ok() {
            print_verdict(&self.run, &verdict, out)?;
            writeln!(out, "{finished}")?;
            return Ok(());
        }
        writeln!(out, "{finished}")?;
        print_verdict(&self.run, &verdict, out)
    }
}

/// What an `ERROR` event means: a server that is briefly unavailable is
/// asked again; any other reason ends the command with it.
fn stopped(run: &str, status: &Status) -> Result<Next, LogError> {
    let message = visible(&status.message);
    if transient(status) {
        return Ok(Next::Resume(format!(
            "the log API stopped the stream ({} {message})",
            status.code
        )));
    }
    match status.code {
        404 | 410 => Err(LogError::RunGone {
            run: run.to_string(),
            message,
        }),
        _ => Err(LogError::StreamEnded {
            run: run.to_string(),
            code: status.code,
            reason: visible(&status.reason),
            message,
        }),
    }
}

/// Follows `run` until it finishes, reconnecting within `retry`.
pub async fn follow(
    k: &Kube,
    api: &LogApi,
    run: &str,
    trust: Result<Trust, Refusal>,
    keys: Result<RecordVerifier, Refusal>,
    mut retry: Retry,
    out: &mut impl Write,
) -> Result<(), LogError> {
    let mut state = Follow::new(run, trust, keys);
    loop {
        let why = match api.follow(state.next_seq()).await {
            Err(Failure::Final(e)) => return Err(e.into()),
            Err(Failure::Transient(why)) => why,
            Ok(lines) => match read_stream(&mut state, lines, &mut retry, out).await? {
                Ended::Finished(last) => {
                    let fin = final_trust(k, run).await?;
                    let last = with_server_head(api, &state, *last, &fin).await;
                    return state.finish(&last, fin, out);
                }
                Ended::Dropped(why) => why,
            },
        };
        let Some(pause) = retry.next_pause() else {
            return Err(LogError::FollowGaveUp {
                run: run.to_string(),
                why,
                tries: retry.count().1,
                seq: state.next_seq(),
            });
        };
        let (used, of) = retry.count();
        eprintln!(
            "following run {run}: {why}; resuming from seq {} in {pause:?} (try {used} of {of})",
            state.next_seq()
        );
        tokio::time::sleep(pause).await;
    }
}

/// How one stream ended.
enum Ended {
    Finished(Box<RunLog>),
    Dropped(String),
}

/// Reads one stream until the run finishes or the stream drops.
async fn read_stream(
    state: &mut Follow,
    mut lines: super::api::Lines,
    retry: &mut Retry,
    out: &mut impl Write,
) -> Result<Ended, LogError> {
    let opened = Instant::now();
    let why = loop {
        match lines.next().await {
            None => break "the stream ended before the run finished".to_string(),
            Some(Err(e)) => break format!("the connection dropped ({e})"),
            Some(Ok(line)) => match state.line(&line, out)? {
                Next::More { records } => {
                    if records > 0 {
                        retry.reset();
                    }
                }
                Next::Finished(last) => return Ok(Ended::Finished(last)),
                Next::Resume(why) => break why,
            },
        }
    };
    if opened.elapsed() >= QUIET_PROGRESS {
        retry.reset();
    }
    Ok(Ended::Dropped(why))
}

/// For a reader who may not get the run: the head the log API checked the
/// last record against (its stream events carry none), from the one-record
/// page at the last seq. Without it the log is checked without a head (and
/// says so).
async fn with_server_head(
    api: &LogApi,
    state: &Follow,
    mut last: RunLog,
    fin: &Result<Trust, Refusal>,
) -> RunLog {
    if fin.is_ok() || last.verification.is_some() || state.next_seq() == 0 {
        return last;
    }
    if let Ok(page) = api.record(state.next_seq() - 1).await {
        last.verification = page.verification;
        last.run.phase = page.run.phase.or(last.run.phase);
    }
    last
}

/// The run's status once finished: its phase is written with (or just
/// after) the log's last record, so a status still showing a running phase
/// is read again for a few seconds.
async fn final_trust(k: &Kube, run: &str) -> Result<Result<Trust, Refusal>, LogError> {
    let mut trust = run_trust(k, run).await?;
    for _ in 0..10 {
        match &trust {
            Ok(t) if !t.terminal => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                trust = run_trust(k, run).await?;
            }
            _ => break,
        }
    }
    Ok(trust)
}
