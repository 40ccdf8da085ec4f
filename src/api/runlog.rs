//! `RunLog` (API group `log.agentrun.dev`, version `v1alpha1`): a run's step
//! log as the controller's aggregated API serves it (DESIGN.md section 10).
//! Read-only; named like its AgentRun, in its namespace. These are the wire
//! types the server writes and `kubectl agentrun log|verify` reads.
//!
//! Paths (all under `/apis/log.agentrun.dev/v1alpha1`):
//! - `GET namespaces/NS/runlogs/NAME?limit=N&continue=T` (or `fromSeq=N`):
//!   one page of records ([`RunLog`]); `page.continue` names the next page.
//! - `GET namespaces/NS/runlogs` : every run of the namespace, no records
//!   ([`RunLogList`]).
//! - `GET namespaces/NS/runlogs?watch=true&fieldSelector=metadata.name=NAME&fromSeq=N`
//!   (the watch form: the API server treats it as long-running), or
//!   `GET namespaces/NS/runlogs/NAME?follow=true&fromSeq=N` (a plain get to
//!   the API server, so its request timeout, 60 s by default, cuts it: a
//!   client reconnects from the next seq):
//!   newline-delimited [`WatchEvent`]s: `ADDED` with the records appended
//!   (from `fromSeq`, or `resourceVersion`, on), one final `MODIFIED` whose
//!   `run.finished` is true when the run ends, or `ERROR` with a `Status`
//!   naming why the stream stopped (the run was deleted, the log does not
//!   verify). A reconnect resumes with `fromSeq` = the next seq wanted.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::store::StoredRecord;

/// API group of the log API.
pub const LOG_GROUP: &str = "log.agentrun.dev";
/// Its one version.
pub const LOG_VERSION: &str = "v1alpha1";
/// `log.agentrun.dev/v1alpha1`.
pub const LOG_API_VERSION: &str = "log.agentrun.dev/v1alpha1";
/// The resource (plural).
pub const RUNLOGS: &str = "runlogs";
/// Records a page holds when the client names no `limit`.
pub const DEFAULT_PAGE: u64 = 500;
/// Records a page holds at most (a larger `limit` is capped to this).
pub const MAX_PAGE: u64 = 5000;

/// One run's log, or one page of it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunLog {
    /// `log.agentrun.dev/v1alpha1`.
    pub api_version: String,
    /// `RunLog`.
    pub kind: String,
    /// The AgentRun's name, namespace, uid and creation time;
    /// `resourceVersion` is the log's length when it was read.
    pub metadata: ObjectMeta,
    /// What the run is now.
    pub run: RunState,
    /// Records in seq order (this page's), as the store holds them: each
    /// body byte for byte, so that the client verifies the very bytes the
    /// hashes cover (and decodes them itself).
    #[serde(default)]
    pub records: Vec<StoredRecord>,
    /// Where this page starts and what comes next (`get` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<Page>,
    /// What the server checked of what it sends. Clients verify on their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Verification>,
}

/// The run a log belongs to, as the AgentRun's status and its log say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunState {
    /// `status.phase` of the AgentRun (absent before the controller set one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The log ends with `RunFinished`: nothing more will be appended.
    #[serde(default)]
    pub finished: bool,
    /// Records in the store when this was read.
    #[serde(default)]
    pub length: u64,
}

/// Paging of `get`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Page {
    /// Seq of the first record of this page.
    pub from_seq: u64,
    /// Seq the next page starts at (the log's length when this page ends it).
    pub next_seq: u64,
    /// The token of the next page (`?continue=`), absent on the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r#continue: Option<String>,
}

/// What the server checked: every record's hash, the links between them
/// (from the record before the page on), and, when the page holds the
/// record at `status.log.length - 1`, that its hash is `status.log.headHash`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Verification {
    /// `status.log.headHash` of the AgentRun, the head checked against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_hash: Option<String>,
    /// `status.log.length` of the AgentRun.
    #[serde(default)]
    pub head_length: u64,
    /// `status.log.signingKeys` of the AgentRun: where each controller key
    /// signs, for clients that may read the log but not the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_keys: Option<Vec<crate::api::SigningKey>>,
    /// `Verified`, or `Failed` (then `message` names the first bad seq).
    pub result: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// [`Verification::result`] values.
pub const VERIFIED: &str = "Verified";
pub const FAILED: &str = "Failed";

/// `GET namespaces/NS/runlogs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunLogList {
    pub api_version: String,
    /// `RunLogList`.
    pub kind: String,
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta,
    pub items: Vec<RunLog>,
}

/// One line of a watch or follow stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// `ADDED` (records), `MODIFIED` (the run finished), `ERROR` (the
    /// stream stops: `object` is a `Status`).
    #[serde(rename = "type")]
    pub kind: String,
    /// A [`RunLog`] (records appended since the previous event), or a
    /// `Status` for `ERROR`.
    pub object: serde_json::Value,
}

/// [`WatchEvent::kind`] values.
pub const ADDED: &str = "ADDED";
pub const MODIFIED: &str = "MODIFIED";
pub const ERROR: &str = "ERROR";

impl RunLog {
    /// An empty log object for the run `metadata` names.
    pub fn new(metadata: ObjectMeta, run: RunState) -> RunLog {
        RunLog {
            api_version: LOG_API_VERSION.into(),
            kind: "RunLog".into(),
            metadata,
            run,
            records: Vec::new(),
            page: None,
            verification: None,
        }
    }
}
