//! `get` (one run's records, a page at a time, with what the server checked
//! of them) and `list` (the runs whose logs there are, without records).

use crate::refusal::Refusal;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ListMeta, ObjectMeta};
use kube::api::{Api, ListParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{LogApi, Params, status};
use crate::api::AgentRun;
use crate::api::runlog::{
    DEFAULT_PAGE, FAILED, LOG_API_VERSION, MAX_PAGE, Page, RunLog, RunLogList, RunState, VERIFIED,
    Verification,
};
use crate::store::{Hash, Head, StepKind, StoreError, StoredRecord};

/// What a continue token carries: the run it is for and where to go on.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Continue {
    uid: String,
    seq: u64,
}

fn encode_continue(uid: &str, seq: u64) -> String {
    let json = serde_json::to_vec(&Continue {
        uid: uid.into(),
        seq,
    })
    .expect("serializes");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// The seq a token says to go on from; an error says why it is refused.
fn decode_continue(token: &str, uid: &str) -> Result<u64, Refusal> {
    let c: Continue = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| "continue: not a token this API issued".to_string())?;
    if c.uid != uid {
        return Err("continue: the token is for another run (recreated under this name?)".into());
    }
    Ok(c.seq)
}

/// The page size asked for, capped: 0 or absent means the default.
pub fn page_size(limit: Option<u64>) -> u64 {
    match limit {
        None | Some(0) => DEFAULT_PAGE,
        Some(n) => n.min(MAX_PAGE),
    }
}

/// The run's metadata as a RunLog carries it; `resourceVersion` is the
/// log's length.
pub fn meta(run: &AgentRun, length: u64) -> ObjectMeta {
    ObjectMeta {
        name: run.metadata.name.clone(),
        namespace: run.metadata.namespace.clone(),
        uid: run.metadata.uid.clone(),
        creation_timestamp: run.metadata.creation_timestamp.clone(),
        resource_version: Some(length.to_string()),
        ..Default::default()
    }
}

fn phase(run: &AgentRun) -> Option<String> {
    run.status
        .as_ref()
        .and_then(|s| s.phase)
        .map(|p| format!("{p:?}"))
}

/// `status.log.headHash` and `status.log.length` of the run.
fn recorded_head(run: &AgentRun) -> (Option<String>, u64) {
    let log = run.status.as_ref().and_then(|s| s.log.as_ref());
    (
        log.and_then(|l| l.head_hash.clone()),
        log.map(|l| l.length).unwrap_or(0),
    )
}

fn unavailable(e: StoreError) -> Response {
    status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        format!("reading the step log: {e}"),
    )
}

/// One page of the run's log.
pub async fn get(api: &LogApi, run: &AgentRun, params: &Params, headers: &HeaderMap) -> Response {
    let uid = crate::api::RunUid::of(run);
    let from = match (&params.continue_token, params.from_seq) {
        (Some(token), _) => match decode_continue(token, &uid) {
            Ok(seq) => seq,
            Err(e) => return status(StatusCode::GONE, "Expired", e),
        },
        (None, Some(seq)) => seq,
        (None, None) => 0,
    };
    let size = page_size(params.limit);
    let bytes = page_bytes(params.limit_bytes);
    let Some(ticket) = api.reads.page_within(super::READ_WAIT).await else {
        return busy();
    };
    let head = match api.store.head(&uid).await {
        Ok(h) => h,
        Err(e) => return unavailable(e),
    };
    let (records, verification) = match read_page(api, run, &uid, from, size, bytes).await {
        Ok(read) => read,
        Err(e) => return unavailable(e),
    };
    let next = records.last().map(|r| r.seq + 1).unwrap_or(from);
    let finished = records.last().is_some_and(ends_the_log)
        || (next >= head.len && last_is_finished(api, &uid, head).await);
    let mut log = RunLog::new(
        meta(run, head.len),
        RunState {
            phase: phase(run),
            finished,
            length: head.len,
        },
    );
    log.page = Some(Page {
        from_seq: from,
        next_seq: next,
        r#continue: (next < head.len && !records.is_empty()).then(|| encode_continue(&uid, next)),
    });
    log.records = records;
    log.verification = Some(verification);
    if wants_table(headers) {
        return table(vec![(log.metadata.clone(), log.run.clone())]);
    }
    holding(axum::Json(log).into_response(), ticket)
}

/// The bytes of record bodies a page holds at most: `limitBytes`, capped at
/// [`super::PAGE_BYTES`] (a record larger than that is a page of its own).
pub fn page_bytes(limit: Option<u64>) -> usize {
    match limit {
        None | Some(0) => super::PAGE_BYTES,
        Some(n) => usize::try_from(n).map_or(super::PAGE_BYTES, |n| n.min(super::PAGE_BYTES)),
    }
}

/// The answer when the read budget stays taken: try again.
pub fn busy() -> Response {
    status(
        StatusCode::TOO_MANY_REQUESTS,
        "TooManyRequests",
        "the log API is reading as many pages as it may at once; try again".to_string(),
    )
}

/// `response`, holding `ticket` until its body is sent (or dropped): the
/// page counts against the budget for as long as it is in memory.
pub fn holding(response: Response, ticket: crate::store::PageTicket) -> Response {
    use futures::StreamExt;
    let (parts, body) = response.into_parts();
    let chunks = body.into_data_stream().map(move |chunk| {
        let _held = &ticket;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(chunks))
}

/// A stored `RunFinished` that verifies as a record (an altered one ends nothing).
pub fn ends_the_log(r: &StoredRecord) -> bool {
    r.decode().is_ok_and(|r| r.kind == StepKind::RunFinished)
}

async fn last_is_finished(api: &LogApi, uid: &str, head: Head) -> bool {
    head.len > 0
        && api
            .store
            .read_range(uid, head.len - 1, None)
            .await
            .is_ok_and(|r| r.last().is_some_and(|r| r.kind == StepKind::RunFinished))
}

/// Records `from..from+size`, as stored, and what checking them found. A
/// record that does not verify (its bytes altered, or not a record at all)
/// fails the check at its seq; it is sent as stored all the same, so that
/// the client names it too.
async fn read_page(
    api: &LogApi,
    run: &AgentRun,
    uid: &str,
    from: u64,
    size: u64,
    bytes: usize,
) -> Result<(Vec<StoredRecord>, Verification), StoreError> {
    let (head_hash, head_length) = recorded_head(run);
    let mut verification = Verification {
        head_hash: head_hash.clone(),
        head_length,
        result: VERIFIED.into(),
        message: String::new(),
        signing_keys: run
            .status
            .as_ref()
            .and_then(|s| s.log.as_ref())
            .and_then(|l| l.signing_keys.clone()),
    };
    // The record before the page, so its first record's link is checked too.
    let before = match from {
        0 => Ok(Vec::new()),
        _ => api.store.read_stored(uid, from - 1, Some(from)).await,
    };
    let read = match before {
        Ok(before) => api
            .store
            .read_stored_page(uid, from, Some(from.saturating_add(size)), bytes)
            .await
            .map(|page| (before, page)),
        Err(e) => Err(e),
    };
    let (before, page) = match read {
        Ok(r) => r,
        Err(StoreError::Corrupt { seq, reason, .. }) => {
            verification.result = FAILED.into();
            verification.message = format!("record {seq} cannot be read as a record: {reason}");
            return Ok((Vec::new(), verification));
        }
        Err(e) => return Err(e),
    };
    let (base, records) = match (from, before.first()) {
        (0, _) => (Head::EMPTY, page),
        (_, Some(prev)) => (
            Head {
                len: from,
                hash: prev.hash,
            },
            page,
        ),
        // Past the end: nothing to check.
        _ => (
            Head {
                len: from,
                hash: Hash::default(),
            },
            Vec::new(),
        ),
    };
    if let Err(e) = check(uid, &base, &records, head_hash.as_deref(), head_length) {
        verification.result = FAILED.into();
        verification.message = e.into();
    }
    Ok((records, verification))
}

/// The page's chain, from the stored bytes, and the recorded head where
/// the page holds it.
pub fn check(
    uid: &str,
    base: &Head,
    records: &[StoredRecord],
    head_hash: Option<&str>,
    head_length: u64,
) -> Result<(), Refusal> {
    crate::store::verify_stored_extension(uid, base, records).map_err(|e| e.to_string())?;
    let Some(expected) = head_hash else {
        return Ok(());
    };
    match records.iter().find(|r| r.seq + 1 == head_length) {
        Some(r) if r.hash.to_hex() != expected => Err(format!(
            "record {} has hash {}, but the run's status.log.headHash is {expected}",
            r.seq,
            r.hash.to_hex()
        )
        .into()),
        _ => Ok(()),
    }
}

/// The runs of `ns` (all namespaces for `None`), without records.
pub async fn list(
    api: &LogApi,
    ns: Option<&str>,
    params: &Params,
    headers: &HeaderMap,
) -> Response {
    let ns = ns.or(api.namespace.as_deref());
    let runs: Api<AgentRun> = match ns {
        Some(ns) => Api::namespaced(api.client.clone(), ns),
        None => Api::all(api.client.clone()),
    };
    let mut lp = ListParams::default();
    if let Some(name) = &params.field_name {
        lp = lp.fields(&format!("metadata.name={name}"));
    }
    let listed = match runs.list(&lp).await {
        Ok(l) => l,
        Err(e) => {
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("listing AgentRuns: {e}"),
            );
        }
    };
    let rows: Vec<(ObjectMeta, RunState)> = listed
        .items
        .iter()
        .map(|run| {
            let (_, length) = recorded_head(run);
            let terminal = run
                .status
                .as_ref()
                .is_some_and(|s| s.phase.is_some_and(|p| p.is_terminal()));
            let state = RunState {
                phase: phase(run),
                finished: terminal,
                length,
            };
            (meta(run, length), state)
        })
        .collect();
    if wants_table(headers) {
        return table(rows);
    }
    let list = RunLogList {
        api_version: LOG_API_VERSION.into(),
        kind: "RunLogList".into(),
        metadata: ListMeta {
            resource_version: listed.metadata.resource_version.clone(),
            ..Default::default()
        },
        items: rows
            .into_iter()
            .map(|(meta, run)| RunLog::new(meta, run))
            .collect(),
    };
    axum::Json(list).into_response()
}

/// Whether the client (kubectl get) asks for a `meta.k8s.io` Table.
fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=Table") && a.contains("g=meta.k8s.io"))
}

/// `kubectl get runlogs`' columns.
fn table(rows: Vec<(ObjectMeta, RunState)>) -> Response {
    let rows: Vec<Value> = rows
        .into_iter()
        .map(|(meta, run)| {
            json!({
                "cells": [
                    meta.name.clone().unwrap_or_default(),
                    run.phase.clone().unwrap_or_default(),
                    run.length,
                    run.finished,
                    meta.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default(),
                ],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                },
            })
        })
        .collect();
    let body = json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {},
        "columnDefinitions": [
            {"name": "Name", "type": "string", "format": "name", "description": "The AgentRun's name", "priority": 0},
            {"name": "Phase", "type": "string", "format": "", "description": "The run's phase", "priority": 0},
            {"name": "Records", "type": "integer", "format": "", "description": "Records in the log", "priority": 0},
            {"name": "Finished", "type": "boolean", "format": "", "description": "The log ends with RunFinished", "priority": 0},
            {"name": "Created", "type": "string", "format": "date", "description": "When the run was created", "priority": 0},
        ],
        "rows": rows,
    });
    axum::Json(body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Record, RecordDraft};

    fn chain(n: u64) -> Vec<StoredRecord> {
        let mut out: Vec<Record> = Vec::new();
        for seq in 0..n {
            let head = out.last().map(Record::head).unwrap_or(Head::EMPTY);
            let draft = RecordDraft::new(StepKind::Observation, json!({"text": format!("r{seq}")}));
            out.push(draft.seal(&head).unwrap());
        }
        out.iter().map(StoredRecord::of).collect()
    }

    fn head(r: &StoredRecord) -> Head {
        Head {
            len: r.seq + 1,
            hash: r.hash,
        }
    }

    /// Stored bytes respelled behind the store's back (they decode to the
    /// same record): the page fails at that record, even with its hash
    /// recomputed over the new bytes.
    #[test]
    fn a_page_fails_at_a_record_whose_stored_bytes_are_not_its_canonical_form() {
        let log = chain(4);
        for body in [
            log[2].body.replacen('{', "{\"tampered\":true,", 1),
            log[2].body.replace(',', ", "),
        ] {
            for rehash in [false, true] {
                let mut altered = log.clone();
                altered[2].body = body.clone();
                if rehash {
                    altered[2].hash = crate::store::chain_hash(&log[1].hash, body.as_bytes());
                }
                let err = check("u", &Head::EMPTY, &altered, None, 4).unwrap_err();
                assert!(err.contains("seq 2") && err.contains("altered"), "{err}");
            }
        }
    }

    #[test]
    fn a_continue_token_is_bound_to_its_run() {
        let token = encode_continue("uid-1", 42);
        assert_eq!(decode_continue(&token, "uid-1"), Ok(42));
        assert!(
            decode_continue(&token, "uid-2")
                .unwrap_err()
                .contains("another run")
        );
        assert!(decode_continue("garbage!", "uid-1").is_err());
    }

    #[test]
    fn a_huge_limit_is_capped_and_zero_means_the_default() {
        assert_eq!(page_size(Some(1_000_000)), MAX_PAGE);
        assert_eq!(page_size(Some(0)), DEFAULT_PAGE);
        assert_eq!(page_size(None), DEFAULT_PAGE);
        assert_eq!(page_size(Some(7)), 7);
    }

    #[test]
    fn a_page_is_checked_from_its_predecessor_and_against_the_recorded_head() {
        let log = chain(5);
        let head_hash = log[4].hash.to_hex();
        assert!(check("u", &head(&log[1]), &log[2..], Some(&head_hash), 5).is_ok());
        let mut altered = log.clone();
        altered[3].body = altered[3].body.replace("r3", "rewritten");
        let err = check("u", &head(&log[1]), &altered[2..], Some(&head_hash), 5).unwrap_err();
        assert!(err.contains("seq 3"), "{err}");
        let other = chain(6);
        let err = check(
            "u",
            &head(&log[1]),
            &log[2..],
            Some(&other[5].hash.to_hex()),
            5,
        )
        .unwrap_err();
        assert!(err.contains("headHash"), "{err}");
    }
}
