//! `log`, `log -f` and `verify` on logs built here: chained and signed as
//! the controller does, then altered the ways a store, a replica or the
//! network could; and against a tiny log API on loopback.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

use super::api::{Retry, not_found, refused};
use super::check::{Checker, Pages, Trust};
use super::follow::{Follow, Next};
use super::*;
use crate::api::AgentRun;
use crate::api::runlog::{Page, RunLog, RunState, VERIFIED, Verification, WatchEvent};
use crate::store::{Head, Record, RecordDraft, RecordSigner, StepKind, StoredRecord};

const UID: &str = "6f1c3a52-0000-4000-8000-000000000001";

fn signer() -> RecordSigner {
    RecordSigner::from_seed(&[7; 32])
}

/// A finished run's log of `n` records (n >= 2): RunStarted, model calls
/// (one with a reply that tries to repaint the terminal), RunFinished;
/// chained, the controller's records signed for run [`UID`].
fn chain(n: u64) -> Vec<Record> {
    let s = signer();
    let mut head = Head::EMPTY;
    let mut out = Vec::new();
    for seq in 0..n {
        let (kind, payload) = match seq {
            0 => (StepKind::RunStarted, json!({"agent": "refunds"})),
            s if s == n - 1 => (
                StepKind::RunFinished,
                json!({"outcome": "Succeeded", "result": "done"}),
            ),
            // A tool name a model chose, trying to repaint the terminal.
            1 => (
                StepKind::ToolIntent,
                json!({"modelCallSeq": 0, "callIndex": 0, "callId": "c", "arguments": {},
                       "tool": "ok\u{1b}[2K\rrefund", "key": "k"}),
            ),
            s => (StepKind::Observation, json!({"text": format!("step {s}")})),
        };
        let mut draft = RecordDraft::new(kind, payload);
        draft.worker.pod = "r-step-0".into();
        let r = s.seal(UID, draft, &head).unwrap();
        head = r.head();
        out.push(r);
    }
    out
}

/// Records as a store holds them (their canonical form).
fn stored(records: &[Record]) -> Vec<StoredRecord> {
    records.iter().map(StoredRecord::of).collect()
}

/// [`check::judge`] of records stored as they are.
fn judge(
    uid: &str,
    records: &[Record],
    keys: Result<crate::store::RecordVerifier, crate::refusal::Refusal>,
    trust: &Trust,
) -> Result<check::Verdict, crate::refusal::Refusal> {
    check::judge(uid, &stored(records), keys, trust).map(|(_, v)| v)
}

fn keys() -> Result<crate::store::RecordVerifier, crate::refusal::Refusal> {
    Ok(signer().verifier())
}

/// The AgentRun as its status stands: `length` records, head at the
/// record before, `phase`.
fn agent_run(records: &[Record], length: u64, phase: &str) -> AgentRun {
    let head = (length > 0).then(|| records[length as usize - 1].hash.to_hex());
    agent_run_at(head, length, phase)
}

/// The AgentRun whose status records `length` records ending at `head`.
fn agent_run_at(head: Option<String>, length: u64, phase: &str) -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "r", "namespace": "ns", "uid": UID},
        "spec": {"input": "Refund order 1042."},
        "status": {"phase": phase, "log": {
            "store": "default", "runKey": UID, "length": length, "headHash": head,
            "signedFrom": 0, "boundFrom": 0}}
    }))
    .unwrap()
}

fn trust(records: &[Record], length: u64, phase: &str) -> Trust {
    Trust::of_run(&agent_run(records, length, phase)).unwrap()
}

/// A page of the log API.
fn page(records: &[Record], from: u64, token: Option<&str>) -> RunLog {
    stored_page(stored(records), from, token)
}

/// A page of the log API holding records as stored.
fn stored_page(records: Vec<StoredRecord>, from: u64, token: Option<&str>) -> RunLog {
    let n = records.len() as u64;
    let mut log = stored_run_log(records, false, n);
    log.page = Some(Page {
        from_seq: from,
        next_seq: from + n,
        r#continue: token.map(str::to_string),
    });
    log
}

fn run_log(records: Vec<Record>, finished: bool, length: u64) -> RunLog {
    stored_run_log(stored(&records), finished, length)
}

fn stored_run_log(records: Vec<StoredRecord>, finished: bool, length: u64) -> RunLog {
    let mut log = RunLog::new(
        ObjectMeta {
            name: Some("r".into()),
            namespace: Some("ns".into()),
            uid: Some(UID.into()),
            ..Default::default()
        },
        RunState {
            phase: Some(if finished { "Succeeded" } else { "Running" }.into()),
            finished,
            length,
        },
    );
    log.records = records;
    log
}

fn event(kind: &str, object: impl serde::Serialize) -> String {
    serde_json::to_string(&WatchEvent {
        kind: kind.into(),
        object: serde_json::to_value(object).unwrap(),
    })
    .unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8(out.to_vec()).unwrap()
}

#[test]
fn an_intact_finished_log_verifies_and_prints_one_escaped_line_per_record() {
    let log = chain(5);
    let verdict = judge(UID, &log, keys(), &trust(&log, 5, "Succeeded")).unwrap();
    assert!(verdict.ok(), "{verdict:?}");
    let mut out = Vec::new();
    print_log("r", &log, &verdict, &mut out).unwrap();
    let out = text(&out);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    assert!(!out.contains('\u{1b}') && !out.contains('\r'), "{out:?}");
    assert!(
        lines[1].contains(r"calling ok\u{1b}[2K\u{d}refund({})"),
        "{out}"
    );
    assert!(lines.iter().all(|l| !l.starts_with('!')), "{out}");
    assert_eq!(
        lines[5],
        format!(
            "verified: 5 records, chain intact, ends at the recorded head {}, 2 controller records signed",
            log[4].hash
        )
    );
}

#[test]
fn a_record_altered_after_hashing_is_marked_and_never_called_verified() {
    let mut log = chain(5);
    // A rewritten observation: its stored hash kept, so the next record
    // still links to it. Only seq 2 is at fault.
    log[2].payload = json!({"text": "step 2, refund 50000"});
    let verdict = judge(UID, &log, keys(), &trust(&log, 5, "Succeeded")).unwrap();
    assert!(!verdict.ok());
    assert_eq!(verdict.marked.keys().copied().collect::<Vec<_>>(), [2]);
    let mut out = Vec::new();
    let e = print_log("r", &log, &verdict, &mut out).unwrap_err();
    let out = text(&out);
    assert!(e.to_string().contains("does not verify"), "{e}");
    let marked: Vec<&str> = out.lines().filter(|l| l.starts_with('!')).collect();
    assert!(marked[0].starts_with("!   2 Observation"), "{out}");
    assert!(
        out.contains("! seq 2: stored hash") && out.contains("the record was altered"),
        "{out}"
    );
    assert!(
        out.lines()
            .last()
            .unwrap()
            .starts_with("NOT VERIFIED: record 2 marked !"),
        "{out}"
    );
    assert!(!out.contains("verified:"), "{out}");

    // `verify` says the same.
    let mut out = Vec::new();
    assert!(print_verify("r", &verdict, &mut out).is_err());
    let out = text(&out);
    assert!(
        out.contains("FAILED: seq 2: stored hash") && !out.contains("ok:"),
        "{out}"
    );
}

#[test]
fn a_rehashed_rewrite_is_caught_by_the_recorded_head() {
    // Rewritten and every hash after it recomputed: the chain is intact,
    // but no longer ends at the head the run's status recorded.
    let mut log = chain(4);
    let status = trust(&log, 4, "Succeeded");
    log[1].payload = json!({"text": "step 1, rewritten"});
    let mut head = Head::EMPTY;
    for r in log.iter_mut() {
        r.prev_hash = head.hash;
        r.hash = r.compute_hash();
        head = r.head();
    }
    let verdict = judge(UID, &log, keys(), &status).unwrap();
    assert!(!verdict.ok());
    let problems = verdict.problems().join("\n");
    assert!(problems.contains("the log was rewritten"), "{problems}");
    // The controller's RunFinished signed what was there before.
    assert!(
        verdict.refused().iter().any(|s| s.contains("RunFinished")),
        "{problems}"
    );
}

#[test]
fn a_running_log_reaches_its_recorded_head_and_a_finished_one_ends_there() {
    let log = chain(6);
    // Running: the status lags the log by two records.
    let verdict = judge(UID, &log, keys(), &trust(&log, 4, "Running")).unwrap();
    assert!(verdict.ok(), "{verdict:?}");
    assert!(
        verdict.anchored.contains("seq 4..5 were appended since"),
        "{}",
        verdict.anchored
    );
    // Finished at 4 records, yet the log goes on: not its log.
    let verdict = judge(UID, &log, keys(), &trust(&log, 4, "Succeeded")).unwrap();
    assert_eq!(verdict.marked.keys().copied().collect::<Vec<_>>(), [4, 5]);
    // Records removed at the end: nothing to mark, the log as a whole fails.
    let verdict = judge(UID, &log[..3], keys(), &trust(&log, 6, "Succeeded")).unwrap();
    assert!(verdict.marked.is_empty());
    assert!(
        verdict.global[0].contains("records are missing"),
        "{verdict:?}"
    );
}

#[test]
fn a_controller_record_signed_for_another_run_is_refused() {
    let log = chain(3);
    let verdict = judge("another-uid", &log, keys(), &trust(&log, 3, "Succeeded")).unwrap();
    assert_eq!(
        verdict.refused(),
        ["seq 0 (RunStarted)", "seq 2 (RunFinished)"]
    );
    let mut out = Vec::new();
    assert!(print_verify("r", &verdict, &mut out).is_err());
    let out = text(&out);
    assert!(
        out.contains("seq 0 RunStarted: signature INVALID")
            && out.contains(
                "FAILED: controller signatures refused at seq 0 (RunStarted), seq 2 (RunFinished)"
            ),
        "{out}"
    );
}

#[test]
fn unread_keys_leave_the_log_unverified() {
    let log = chain(3);
    let verdict = judge(
        UID,
        &log,
        Err("no ConfigMap agentrun-system/agentrun-controller-keys".into()),
        &trust(&log, 3, "Succeeded"),
    )
    .unwrap();
    assert!(!verdict.ok());
    assert!(
        verdict.global[0].contains("signatures were not checked"),
        "{verdict:?}"
    );
}

#[test]
fn verify_prints_each_controller_record_and_the_summary() {
    let log = chain(3);
    let verdict = judge(UID, &log, keys(), &trust(&log, 3, "Succeeded")).unwrap();
    let mut out = Vec::new();
    print_verify("r", &verdict, &mut out).unwrap();
    let out = text(&out);
    assert!(
        out.contains("seq 0 RunStarted: signature valid (key"),
        "{out}"
    );
    assert!(
        out.lines()
            .last()
            .unwrap()
            .starts_with("ok: 3 records, chain intact, ends at the recorded head"),
        "{out}"
    );
}

#[test]
fn a_page_that_repeats_or_skips_a_seq_is_refused() {
    let log = chain(6);
    let mut pages = Pages::default();
    assert_eq!(
        pages
            .push(page(&log[0..2], 0, Some("t2")))
            .unwrap()
            .as_deref(),
        Some("t2")
    );
    let repeat = Pages::push(&mut clone(&pages), page(&log[1..3], 1, Some("t3"))).unwrap_err();
    assert!(
        repeat.contains("repeats seq 1 where seq 2 was due"),
        "{repeat}"
    );
    let skip = Pages::push(&mut clone(&pages), page(&log[3..4], 3, None)).unwrap_err();
    assert!(
        skip.contains("skips to seq 3 where seq 2 was due"),
        "{skip}"
    );
    // Records in place, but the page claims to end further than it does.
    let mut short = page(&log[2..4], 2, None);
    short.page.as_mut().unwrap().next_seq = 6;
    let e = Pages::push(&mut clone(&pages), short).unwrap_err();
    assert!(e.contains("refusing it"), "{e}");
    // No progress, yet a next page: refused rather than looped on.
    let e = Pages::push(&mut clone(&pages), page(&[], 2, Some("t2"))).unwrap_err();
    assert!(e.contains("empty page"), "{e}");
    // Another run under the same name.
    let mut other = page(&log[2..4], 2, None);
    other.metadata.uid = Some("someone-else".into());
    let e = Pages::push(&mut clone(&pages), other).unwrap_err();
    assert!(e.contains("switched runs"), "{e}");
    assert_eq!(pages.push(page(&log[2..6], 2, None)).unwrap(), None);
    assert_eq!(pages.records, stored(&log));
}

fn clone(p: &Pages) -> Pages {
    Pages {
        records: p.records.clone(),
        last: p.last.clone(),
        failed: p.failed.clone(),
    }
}

#[test]
fn a_record_the_server_could_not_send_leaves_the_log_unverified_with_its_reason() {
    // The store could not decode record 2: the server sends the page
    // before it, then an empty last page saying why.
    let log = chain(4);
    let mut pages = Pages::default();
    pages.push(page(&log[0..2], 0, Some("t2"))).unwrap();
    let mut empty = page(&[], 2, None);
    empty.verification = Some(Verification {
        head_hash: Some(log[3].hash.to_hex()),
        head_length: 4,
        result: crate::api::runlog::FAILED.into(),
        message: "record 2 cannot be read as a record".into(),
        signing_keys: None,
    });
    assert_eq!(pages.push(empty).unwrap(), None);
    let (_, verdict) = judge_pages(&pages, Ok(trust(&log, 4, "Succeeded")), keys()).unwrap();
    assert!(!verdict.ok());
    assert!(
        verdict.global[0].contains("records are missing"),
        "{verdict:?}"
    );
    assert!(
        verdict.notes[0].contains("Failed: record 2 cannot be read as a record"),
        "{verdict:?}"
    );
}

#[test]
fn a_follow_reconnect_resumes_from_the_next_seq_and_prints_each_record_once() {
    let log = chain(5);
    let mut f = Follow::new("r", Ok(trust(&log, 2, "Running")), keys());
    let mut out = Vec::new();
    // First connection: records 0..=2, then it drops.
    for line in [
        event("ADDED", run_log(log[0..2].to_vec(), false, 2)),
        event("ADDED", run_log(log[2..3].to_vec(), false, 3)),
    ] {
        assert!(matches!(
            f.line(&line, &mut out).unwrap(),
            Next::More { .. }
        ));
    }
    assert_eq!(f.next_seq(), 3, "the reconnect asks for seq 3 on");
    // A replica restarting says so in the stream: resumed, not final.
    let unavailable = event(
        "ERROR",
        json!({"kind": "Status", "status": "Failure", "code": 503, "reason": "ServiceUnavailable", "message": "replica stopping"}),
    );
    assert!(matches!(
        f.line(&unavailable, &mut out).unwrap(),
        Next::Resume(_)
    ));
    // Second connection, from seq 3.
    f.line("", &mut out).unwrap();
    f.line(
        &event("ADDED", run_log(log[3..5].to_vec(), false, 5)),
        &mut out,
    )
    .unwrap();
    let Next::Finished(last) = f
        .line(&event("MODIFIED", run_log(vec![], true, 5)), &mut out)
        .unwrap()
    else {
        panic!("the MODIFIED event ends it")
    };
    f.finish(&last, Ok(trust(&log, 5, "Succeeded")), &mut out)
        .unwrap();
    let out = text(&out);
    let seqs: Vec<u64> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(seqs, [0, 1, 2, 3, 4], "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[5].starts_with("verified: 5 records"), "{out}");
    assert_eq!(lines[6], "run r finished: Succeeded");
}

#[test]
fn a_follow_stream_that_repeats_a_record_after_a_reconnect_is_refused() {
    let log = chain(4);
    let mut f = Follow::new("r", Ok(trust(&log, 0, "Running")), keys());
    let mut out = Vec::new();
    f.line(
        &event("ADDED", run_log(log[0..2].to_vec(), false, 2)),
        &mut out,
    )
    .unwrap();
    let e = f
        .line(
            &event("ADDED", run_log(log[1..3].to_vec(), false, 3)),
            &mut out,
        )
        .unwrap_err();
    assert!(e.to_string().contains("repeats seq 1"), "{e}");
    assert_eq!(text(&out).lines().count(), 2, "nothing printed twice");
}

#[test]
fn following_marks_a_bad_record_as_it_arrives_and_fails_at_the_end() {
    let mut log = chain(4);
    log[1].payload = json!({"text": "rewritten"});
    let mut f = Follow::new("r", Ok(trust(&log, 0, "Running")), keys());
    let mut out = Vec::new();
    f.line(&event("ADDED", run_log(log.clone(), false, 4)), &mut out)
        .unwrap();
    assert!(
        text(&out).lines().nth(1).unwrap().starts_with("!   1"),
        "{}",
        text(&out)
    );
    let Next::Finished(last) = f
        .line(&event("MODIFIED", run_log(vec![], true, 4)), &mut out)
        .unwrap()
    else {
        panic!()
    };
    assert!(
        f.finish(&last, Ok(trust(&log, 4, "Succeeded")), &mut out)
            .is_err()
    );
    let out = text(&out);
    assert!(out.contains("run r finished: Succeeded"), "{out}");
    assert!(
        out.lines().last().unwrap().starts_with("NOT VERIFIED"),
        "{out}"
    );
}

#[test]
fn a_follow_that_ends_short_of_the_reported_length_is_not_verified() {
    let log = chain(4);
    let mut f = Follow::new("r", Ok(trust(&log, 0, "Running")), keys());
    let mut out = Vec::new();
    f.line(
        &event("ADDED", run_log(log[..2].to_vec(), false, 2)),
        &mut out,
    )
    .unwrap();
    let Next::Finished(last) = f
        .line(&event("MODIFIED", run_log(vec![], true, 4)), &mut out)
        .unwrap()
    else {
        panic!()
    };
    let fin = Trust {
        terminal: false,
        ..trust(&log, 2, "Running")
    };
    assert!(f.finish(&last, Ok(fin), &mut out).is_err());
    assert!(
        text(&out).contains("reported 4 records at the end but sent 2"),
        "{}",
        text(&out)
    );
}

#[test]
fn an_error_event_for_a_deleted_run_ends_the_follow_with_its_message() {
    let mut f = Follow::new("r", Ok(trust(&chain(2), 0, "Running")), keys());
    let gone = event(
        "ERROR",
        json!({"kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound",
               "message": "agentrun r was deleted\u{1b}[2K"}),
    );
    let e = f.line(&gone, &mut Vec::new()).unwrap_err().to_string();
    assert!(
        e.contains("the run is gone: agentrun r was deleted\\u{1b}[2K"),
        "{e}"
    );
}

#[test]
fn a_reader_who_may_not_get_the_run_checks_against_the_log_apis_head_and_is_told_so() {
    let log = chain(3);
    let mut last = run_log(vec![], true, 3);
    last.verification = Some(Verification {
        head_hash: Some(log[2].hash.to_hex()),
        head_length: 3,
        result: VERIFIED.into(),
        message: String::new(),
        signing_keys: None,
    });
    let t = Trust::of_log(&last, "you may not get agentruns in namespace ns").unwrap();
    assert!(t.terminal && t.uid.as_deref() == Some(UID));
    let verdict = judge(UID, &log, keys(), &t).unwrap();
    assert!(verdict.ok(), "{verdict:?}");
    assert!(
        verdict.notes[0].contains("the log API's word"),
        "{:?}",
        verdict.notes
    );
    // Without a head from the server, a finished phase does not claim where
    // the log ends.
    last.verification = None;
    assert!(!Trust::of_log(&last, "-").unwrap().terminal);
}

#[test]
fn a_follow_that_ends_before_the_status_does_names_the_phase_its_verified_log_records() {
    // The reader may not get the run; the stream ends with the RunFinished
    // record while the log API still reads the status as Running (the
    // controller writes the phase just after appending that record).
    let log = chain(3);
    let why = "you may not get agentruns in namespace ns";
    let mut f = Follow::new("r", Err(why.into()), keys());
    let mut out = Vec::new();
    let mut end = run_log(log.clone(), true, 3);
    end.run.phase = Some("Running".into());
    let Next::Finished(last) = f.line(&event("ADDED", end), &mut out).unwrap() else {
        panic!("a finished event ends it")
    };
    let fin = Ok(Trust::of_log(&last, why).unwrap());
    f.finish(&last, fin, &mut out).unwrap();
    let out = text(&out);
    assert_eq!(
        out.lines().last(),
        Some("run r finished: Succeeded"),
        "{out}"
    );
}

#[test]
fn refusals_name_the_missing_right_and_the_alternative() {
    let status = |code: u16, message: &str| kube::core::Status {
        code,
        message: message.into(),
        ..Default::default()
    };
    let forbidden = refused(
        &status(403, "carol cannot get runlogs.log.agentrun.dev in ns"),
        "get",
        "ns",
    );
    assert_eq!(
        forbidden,
        "you may not get runlogs in namespace ns (ask for the agentrun-log-reader role): carol cannot get runlogs.log.agentrun.dev in ns"
    );
    let missing = not_found(&status(404, "not found"), "ns", "r", Some(false));
    assert!(
        missing.contains("log API (log.agentrun.dev/v1alpha1) is not installed")
            && missing.contains("--store-url"),
        "{missing}"
    );
    let no_run = not_found(
        &status(404, "runlogs \"r\" not found"),
        "ns",
        "r",
        Some(true),
    );
    assert!(no_run.starts_with("no run r in namespace ns"), "{no_run}");
}

#[test]
fn following_retries_thirty_times_over_about_a_minute() {
    let mut retry = Retry::follow();
    let pauses: Vec<Duration> = std::iter::from_fn(|| retry.next_pause()).collect();
    assert_eq!(pauses.len(), 30);
    let total: Duration = pauses.iter().sum();
    assert!(
        (Duration::from_secs(45)..=Duration::from_secs(75)).contains(&total),
        "{total:?}"
    );
    retry.reset();
    assert!(retry.next_pause().is_some());
}

#[test]
fn the_checker_refuses_a_record_out_of_place() {
    let log = chain(3);
    let mut c = Checker::new(UID, keys(), &trust(&log, 0, "Running"));
    let log = stored(&log);
    c.take(&log[0]).unwrap();
    assert!(c.take(&log[2]).unwrap_err().contains("skips to seq 2"));
    assert!(c.take(&log[1]).unwrap().wrong.is_empty());
}

// --- Against a log API on loopback -------------------------------------

/// What the loopback API serves, and the `fromSeq` of each follow request.
#[derive(Clone)]
struct Served {
    log: Vec<StoredRecord>,
    run: Value,
    keys: Value,
    follows: Arc<Mutex<Vec<u64>>>,
}

async fn serve(served: Served) -> kube::Client {
    use axum::extract::{Request, State};
    async fn handle(State(s): State<Served>, req: Request) -> axum::response::Response {
        let path = req.uri().path().to_string();
        let query: BTreeMap<String, String> =
            url::form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
                .into_owned()
                .collect();
        respond(&s, &path, &query)
    }
    let app = axum::Router::new().fallback(handle).with_state(served);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let config = kube::Config::new(url.parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

fn json_response(code: u16, body: Value) -> axum::response::Response {
    axum::response::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "code": code, "reason": reason, "message": message})
}

fn respond(s: &Served, path: &str, query: &BTreeMap<String, String>) -> axum::response::Response {
    const RUNLOGS: &str = "/apis/log.agentrun.dev/v1alpha1/namespaces/ns/runlogs/";
    match path {
        "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns/r" => {
            json_response(200, s.run.clone())
        }
        "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns/secret" => {
            json_response(403, status(403, "Forbidden", "carol cannot get agentruns"))
        }
        "/api/v1/namespaces/agentrun-system/configmaps/agentrun-controller-keys" => {
            json_response(200, s.keys.clone())
        }
        "/apis/log.agentrun.dev/v1alpha1" => json_response(200, json!({"kind": "APIResourceList"})),
        // A run whose log the reader may read, but not the run itself.
        "/apis/agentrun.dev/v1alpha1/namespaces/ns/agentruns/hidden" => {
            json_response(403, status(403, "Forbidden", "alice cannot get agentruns"))
        }
        // The follow stream: the collection's watch of one run.
        "/apis/log.agentrun.dev/v1alpha1/namespaces/ns/runlogs"
            if query.get("watch").is_some_and(|w| w == "true")
                && ["metadata.name=r", "metadata.name=hidden"]
                    .contains(&query["fieldSelector"].as_str()) =>
        {
            follow_response(s, query["fromSeq"].parse().unwrap())
        }
        p if [format!("{RUNLOGS}r"), format!("{RUNLOGS}hidden")].contains(&p.to_string()) => {
            // Pages of two records (or `limit`); the token is the next seq.
            let from: usize = match (query.get("continue"), query.get("fromSeq")) {
                (Some(t), _) | (None, Some(t)) => t.parse().unwrap(),
                (None, None) => 0,
            };
            let limit: usize = query.get("limit").map_or(2, |l| l.parse().unwrap()).min(2);
            let to = (from + limit).min(s.log.len());
            let token = (to < s.log.len()).then(|| to.to_string());
            let mut p = stored_page(s.log[from..to].to_vec(), from as u64, token.as_deref());
            p.run.phase = Some("Succeeded".into());
            let head = s.log.last().unwrap();
            p.verification = Some(Verification {
                head_hash: Some(head.hash.to_hex()),
                head_length: head.seq + 1,
                result: VERIFIED.into(),
                message: String::new(),
                signing_keys: None,
            });
            json_response(200, serde_json::to_value(p).unwrap())
        }
        p if p == format!("{RUNLOGS}secret") => json_response(
            403,
            status(
                403,
                "Forbidden",
                "carol cannot get runlogs.log.agentrun.dev in ns",
            ),
        ),
        _ => json_response(
            404,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        ),
    }
}

/// Follow requests, in order: the first sends three records and breaks
/// off mid-stream; the second finds the API unavailable (503); the third
/// gets an in-stream 503 event; the fourth, from the same seq, gets the
/// rest and the end.
fn follow_response(s: &Served, from: u64) -> axum::response::Response {
    let n = {
        let mut follows = s.follows.lock().unwrap();
        follows.push(from);
        follows.len()
    };
    let line = |kind: &str, object: Value| format!("{}\n", event(kind, object));
    let records = |a: usize, b: usize| {
        serde_json::to_value(stored_run_log(s.log[a..b].to_vec(), false, b as u64)).unwrap()
    };
    let chunks: Vec<Result<String, std::io::Error>> = match n {
        1 => vec![
            Ok(line("ADDED", records(0, 2))),
            Ok(line("ADDED", records(2, 3))),
            Err(std::io::Error::other("replica killed")),
        ],
        2 => {
            return json_response(
                503,
                status(503, "ServiceUnavailable", "service unavailable"),
            );
        }
        3 => vec![Ok(line(
            "ERROR",
            status(503, "ServiceUnavailable", "replica stopping"),
        ))],
        _ => vec![
            Ok(line("ADDED", records(from as usize, s.log.len()))),
            Ok(line(
                "MODIFIED",
                serde_json::to_value(run_log(vec![], true, s.log.len() as u64)).unwrap(),
            )),
        ],
    };
    // Each event on the wire before the next (as a live log sends them),
    // so a break comes after what was sent.
    let paced = futures::StreamExt::then(futures::stream::iter(chunks), |c| async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        c
    });
    axum::response::Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(paced))
        .unwrap()
}

fn served(log: Vec<Record>) -> Served {
    served_stored(stored(&log))
}

/// Serves records as stored (whatever their bytes), with a status that
/// records their stored head.
fn served_stored(log: Vec<StoredRecord>) -> Served {
    let head = log.last().map(|r| r.hash.to_hex());
    let run = serde_json::to_value(agent_run_at(head, log.len() as u64, "Succeeded")).unwrap();
    let data = crate::keys::published::data(&signer().verifier());
    Served {
        log,
        run,
        keys: json!({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": "agentrun-controller-keys", "namespace": "agentrun-system"},
                     "data": data}),
        follows: Arc::default(),
    }
}

fn kube_for(client: kube::Client) -> Kube {
    Kube {
        approvals: kube::Api::namespaced(client.clone(), "ns"),
        runs: kube::Api::namespaced(client.clone(), "ns"),
        client,
        ns: "ns".into(),
    }
}

const SOURCE: Source<'static> = Source {
    store_url: None,
    controller_namespace: "agentrun-system",
};

#[tokio::test]
async fn log_reads_every_page_through_the_api_and_verifies_it() {
    let k = kube_for(serve(served(chain(5))).await);
    let mut out = Vec::new();
    log(&k, "r", &SOURCE, false, &mut out).await.unwrap();
    let out = text(&out);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    assert!(
        lines[5].starts_with("verified: 5 records, chain intact"),
        "{out}"
    );
    let mut out = Vec::new();
    verify(&k, "r", &SOURCE, &mut out).await.unwrap();
    assert!(
        text(&out).contains("ok: 5 records, chain intact"),
        "{}",
        text(&out)
    );
}

#[tokio::test]
async fn log_marks_a_record_altered_between_the_store_and_the_screen() {
    let mut log_records = chain(5);
    log_records[3].payload = json!({"text": "approved by nobody"});
    let k = kube_for(serve(served(log_records)).await);
    let mut out = Vec::new();
    let e = log(&k, "r", &SOURCE, false, &mut out).await.unwrap_err();
    let out = text(&out);
    assert!(e.to_string().contains("does not verify"), "{e}");
    assert!(
        out.lines().any(|l| l.starts_with("!   3 Observation")),
        "{out}"
    );
    assert!(
        out.lines().last().unwrap().starts_with("NOT VERIFIED"),
        "{out}"
    );
    // The server's claim does not make it verified; it is told beside.
    assert!(
        out.contains("note: the log API's own check passed"),
        "{out}"
    );
    assert!(!out.contains("verified:"), "{out}");
}

/// A database superuser's respellings of record 2's stored body (issue 39):
/// it decodes to the same record, so a check of what it decodes to passes.
fn respelled(log: &[Record]) -> Vec<(&'static str, Vec<StoredRecord>)> {
    let as_stored = stored(log);
    let body = &as_stored[2].body;
    [
        (
            "a field added",
            body.replacen('{', "{\"tampered\":true,", 1),
        ),
        (
            "keys reordered",
            body.replacen(
                "{\"format\":1,\"kind\":\"Observation\",",
                "{\"kind\":\"Observation\",\"format\":1,",
                1,
            ),
        ),
        ("extra whitespace", body.replace(',', " ,\n ")),
    ]
    .into_iter()
    .map(|(how, respelled)| {
        assert_ne!(&respelled, body, "{how}");
        let mut altered = as_stored.clone();
        altered[2].body = respelled;
        (how, altered)
    })
    .collect()
}

#[test]
fn verify_names_a_stored_body_respelled_after_it_was_hashed() {
    let log = chain(5);
    for (how, altered) in respelled(&log) {
        let (shown, verdict) =
            check::judge(UID, &altered, keys(), &trust(&log, 5, "Succeeded")).unwrap();
        assert!(!verdict.ok(), "{how}: {verdict:?}");
        assert_eq!(
            verdict.marked.keys().copied().collect::<Vec<_>>(),
            [2],
            "{how}: record 2 alone is named: {verdict:?}"
        );
        assert!(
            verdict.marked[&2].iter().any(|p| p.contains("altered")),
            "{how}: {verdict:?}"
        );
        // Shown as what it now says, marked.
        assert_eq!(shown.len(), 5, "{how}");
    }
    // The tail past the head the status anchored (a run still going),
    // respelled and hashed again: it links, yet it is not what was written.
    let mut tail = stored(&log);
    tail[4].body = tail[4].body.replacen('{', "{\"tampered\":true,", 1);
    tail[4].hash = crate::store::chain_hash(&tail[3].hash, tail[4].body.as_bytes());
    let (_, verdict) = check::judge(UID, &tail, keys(), &trust(&log, 4, "Running")).unwrap();
    assert_eq!(
        verdict.marked.keys().copied().collect::<Vec<_>>(),
        [4],
        "{verdict:?}"
    );
    assert!(
        verdict.marked[&4][0].contains("not the canonical form"),
        "{verdict:?}"
    );
}

#[tokio::test]
async fn verify_and_log_through_the_api_report_a_respelled_stored_body_as_altered() {
    for (how, altered) in respelled(&chain(5)) {
        let k = kube_for(serve(served_stored(altered)).await);
        let mut out = Vec::new();
        let e = verify(&k, "r", &SOURCE, &mut out).await.unwrap_err();
        let out = text(&out);
        assert!(e.to_string().contains("does not verify"), "{how}: {e}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("FAILED: seq 2:") && l.contains("altered")),
            "{how}: {out}"
        );
        assert!(!out.contains("ok:"), "{how}: {out}");
        let mut out = Vec::new();
        log(&k, "r", &SOURCE, false, &mut out).await.unwrap_err();
        let out = text(&out);
        assert!(
            out.lines().any(|l| l.starts_with("!   2 Observation")),
            "{how}: {out}"
        );
        assert!(!out.contains("verified:"), "{how}: {out}");
    }
}

#[tokio::test]
async fn log_f_resumes_after_a_drop_and_a_503_from_the_next_seq() {
    let s = served(chain(6));
    let follows = s.follows.clone();
    let k = kube_for(serve(s).await);
    let api = api::LogApi::new(k.client.clone(), "ns", "r");
    let trust = run_trust(&k, "r").await.unwrap();
    let mut out = Vec::new();
    let fast = Retry::new(5, Duration::from_millis(10), Duration::from_millis(20));
    follow::follow(&k, &api, "r", trust, keys(), fast, &mut out)
        .await
        .unwrap();
    assert_eq!(*follows.lock().unwrap(), [0, 3, 3, 3]);
    let out = text(&out);
    let seqs: Vec<u64> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(seqs, [0, 1, 2, 3, 4, 5], "{out}");
    assert!(out.contains("verified: 6 records"), "{out}");
    assert_eq!(out.lines().last().unwrap(), "run r finished: Succeeded");
}

#[tokio::test]
async fn a_reader_of_runlogs_only_is_verified_against_the_log_apis_head() {
    let mut altered = chain(4);
    altered[2].payload = json!({"text": "rewritten"});
    for (records, ok) in [(chain(4), true), (altered, false)] {
        let s = served(records);
        let k = kube_for(serve(s).await);
        let mut out = Vec::new();
        let got = log(&k, "hidden", &SOURCE, false, &mut out).await;
        let out = text(&out);
        assert_eq!(got.is_ok(), ok, "{out}");
        assert!(
            out.contains("note: the head checked is the log API's word"),
            "{out}"
        );
        if ok {
            assert!(
                out.contains("verified: 4 records, chain intact, ends at the recorded head"),
                "{out}"
            );
        } else {
            assert!(out.lines().any(|l| l.starts_with("!   2")), "{out}");
        }
    }
    // Following: the head comes from the last record's page at the end.
    let k = kube_for(serve(served(chain(5))).await);
    let api = api::LogApi::new(k.client.clone(), "ns", "hidden");
    let trust = run_trust(&k, "hidden").await.unwrap();
    assert!(trust.is_err(), "the run itself is refused");
    let mut out = Vec::new();
    let fast = Retry::new(5, Duration::from_millis(10), Duration::from_millis(20));
    follow::follow(&k, &api, "hidden", trust, keys(), fast, &mut out)
        .await
        .unwrap();
    let out = text(&out);
    assert!(
        out.contains("verified: 5 records, chain intact, ends at the recorded head"),
        "{out}"
    );
    assert_eq!(
        out.lines().last().unwrap(),
        "run hidden finished: Succeeded"
    );
}

#[tokio::test]
async fn refusals_and_unknown_runs_say_what_is_missing() {
    let k = kube_for(serve(served(chain(3))).await);
    // May read neither the run nor its log.
    let e = log(&k, "secret", &SOURCE, false, &mut Vec::new())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "you may not get runlogs in namespace ns (ask for the agentrun-log-reader role)"
        ),
        "{e}"
    );
    // The run read from the API server does not exist.
    let e = log(&k, "nope", &SOURCE, false, &mut Vec::new())
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(e, "no run nope in namespace ns");
    // The API itself answers 404 for the group: not installed.
    let api = api::LogApi::new(k.client.clone(), "ns", "nope");
    let Err(api::Failure::Final(e)) = api.page(None).await else {
        panic!("a 404 is final")
    };
    assert!(
        e.to_string().starts_with("no run nope in namespace ns"),
        "{e}"
    );
}

#[tokio::test]
async fn a_missing_log_api_points_to_store_url() {
    // A server that serves nothing: the group is not installed.
    async fn nothing() -> axum::response::Response {
        json_response(
            404,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        )
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().fallback(nothing)).await });
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let api = api::LogApi::new(client, "ns", "r");
    let Err(api::Failure::Final(e)) = api.page(None).await else {
        panic!("a 404 is final")
    };
    assert!(
        e.to_string().contains("is not installed") && e.to_string().contains("--store-url"),
        "{e}"
    );
}

#[tokio::test]
async fn requests_name_the_run_and_where_to_resume() {
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
    let api = api::LogApi::new(client, "team-a", "refund-1042");
    assert_eq!(
        api.page_path(Some("eyJz+/=")),
        "/apis/log.agentrun.dev/v1alpha1/namespaces/team-a/runlogs/refund-1042?limit=5000&continue=eyJz%2B%2F%3D"
    );
    assert_eq!(
        api.follow_path(17),
        "/apis/log.agentrun.dev/v1alpha1/namespaces/team-a/runlogs?watch=true&fieldSelector=metadata.name%3Drefund-1042&fromSeq=17"
    );
    assert!(
        api.record_path(4)
            .ends_with("/runlogs/refund-1042?limit=1&fromSeq=4")
    );
    // A name typed with a path in it stays one segment.
    let odd = api::LogApi::new(api_client(), "ns", "../../x?y");
    assert!(
        odd.path().ends_with("/runlogs/..%2F..%2Fx%3Fy"),
        "{}",
        odd.path()
    );
}

fn api_client() -> kube::Client {
    kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap()
}

/// The plugin's and the console's verification after a rotation: the log
/// was signed by the key now retired, and the run's status records that the
/// new key signs from seq 2. The retired key's records before seq 2 verify;
/// its `RunFinished` at seq 3 (what mallory, holding the leaked key and a
/// database credential, would append) is refused, whether the windows come
/// from the run or, for a reader who may not read the run, from the log API.
#[test]
fn verify_refuses_a_retired_keys_signature_after_the_switch() {
    let log = chain(4);
    let (old, new) = (signer(), RecordSigner::from_seed(&[8; 32]));
    let ring =
        Ok(
            crate::store::RecordVerifier::new(vec![new.public_key(false), old.public_key(true)])
                .unwrap(),
        );
    let windows = json!([{"key": old.key_id(), "from": 0}, {"key": new.key_id(), "from": 2}]);
    let mut run = serde_json::to_value(agent_run(&log, 4, "Succeeded")).unwrap();
    run["status"]["log"]["signingKeys"] = windows.clone();
    let run: AgentRun = serde_json::from_value(run).unwrap();
    let verdict = judge(UID, &log, ring.clone(), &Trust::of_run(&run).unwrap()).unwrap();
    assert!(!verdict.ok());
    assert_eq!(verdict.refused(), ["seq 3 (RunFinished)"]);
    assert!(
        verdict.marked[&3].iter().any(|p| p.contains("retired")),
        "{:?}",
        verdict.marked
    );
    // Before the rotation recorded anything, the same log verifies.
    let verdict = judge(UID, &log, ring.clone(), &trust(&log, 4, "Succeeded")).unwrap();
    assert!(verdict.ok(), "{:?}", verdict.problems());

    // The log API's word, for a reader who may not read the run.
    let mut last = run_log(Vec::new(), true, 4);
    last.verification = Some(Verification {
        head_hash: Some(log[3].hash.to_hex()),
        head_length: 4,
        result: VERIFIED.into(),
        message: String::new(),
        signing_keys: Some(serde_json::from_value(windows).unwrap()),
    });
    let t = Trust::of_log(&last, "you may not get agentruns in namespace ns").unwrap();
    let verdict = judge(UID, &log, ring.clone(), &t).unwrap();
    assert_eq!(verdict.refused(), ["seq 3 (RunFinished)"]);
    // Without the server's windows no retired key's signature counts.
    last.verification.as_mut().unwrap().signing_keys = None;
    let t = Trust::of_log(&last, "you may not get agentruns in namespace ns").unwrap();
    let verdict = judge(UID, &log, ring, &t).unwrap();
    assert_eq!(
        verdict.refused(),
        ["seq 0 (RunStarted)", "seq 3 (RunFinished)"]
    );
}

mod forks;
