//! Step records, their one canonical encoding and the hash chain
//! (DESIGN.md section 3).
//!
//! A record's canonical form is the RFC 8785 (JCS) encoding of the record
//! *without* `hash` and `createdAt`: object keys sorted, no whitespace,
//! numbers in their ECMAScript shortest form. `createdAt` is server time
//! metadata, so an identical retry encodes to identical bytes.
//!
//! `hash = sha256(prev_hash ‖ canonical record)`, where `prev_hash` is the 32
//! raw bytes of the previous record's hash (all zero for seq 0). Hashes are
//! written as 64 lowercase hex digits.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The newest record format this code reads and writes. A record is written
/// in the oldest format that holds it ([`RecordDraft::format`]): format 1
/// for everything a built-in agent records, format 2 for records that carry
/// what a container agent adds (its container, its wire requests), so that
/// an earlier release refuses those instead of misreading them.
pub const FORMAT: u32 = FORMAT_2;

/// The format of every record that holds nothing newer.
pub const FORMAT_1: u32 = 1;
/// The format of records holding what a container agent adds (`runlog::v2`).
pub const FORMAT_2: u32 = 2;

/// Largest integer magnitude a payload may hold (2^53 - 1): the canonical
/// encoding writes every number as an IEEE double (RFC 8785), so a larger
/// integer would not survive the round trip.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// The canonical JSON encoding (RFC 8785 / JCS) of a JSON value.
///
/// Key order in the input does not matter; numbers are written as IEEE
/// doubles in their shortest form (integers beyond 2^53 lose precision, which
/// [`RecordDraft::seal`] refuses for payloads).
pub fn canonical_json(value: &serde_json::Value) -> Vec<u8> {
    crate::jcs::to_vec(value)
}

/// Lowercase hex sha256 of some bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A sha256 hash (a record hash, or the head of a log).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// The `prev_hash` of seq 0 and the head of an empty log.
    pub const ZERO: Hash = Hash([0; 32]);

    pub fn is_zero(&self) -> bool {
        *self == Self::ZERO
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Hash> {
        <[u8; 32]>::try_from(bytes).ok().map(Hash)
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", self.to_hex())
    }
}

/// Parse error of a hex hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a sha256 hash (expected 64 hex digits): {0:?}")]
pub struct ParseHashError(pub String);

impl FromStr for Hash {
    type Err = ParseHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s.trim(), &mut out).map_err(|_| ParseHashError(s.to_string()))?;
        Ok(Hash(out))
    }
}

impl Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a step record is (DESIGN.md section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StepKind {
    RunStarted,
    ModelCall,
    ToolIntent,
    ToolResult,
    ApprovalRequested,
    ApprovalDecided,
    ApprovalVoided,
    Observation,
    Summary,
    VersionChanged,
    RunFinished,
    /// A fork's record after its copied prefix (names the parent).
    Forked,
}

impl StepKind {
    pub const ALL: [StepKind; 12] = [
        StepKind::RunStarted,
        StepKind::ModelCall,
        StepKind::ToolIntent,
        StepKind::ToolResult,
        StepKind::ApprovalRequested,
        StepKind::ApprovalDecided,
        StepKind::ApprovalVoided,
        StepKind::Observation,
        StepKind::Summary,
        StepKind::VersionChanged,
        StepKind::RunFinished,
        StepKind::Forked,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            StepKind::RunStarted => "RunStarted",
            StepKind::ModelCall => "ModelCall",
            StepKind::ToolIntent => "ToolIntent",
            StepKind::ToolResult => "ToolResult",
            StepKind::ApprovalRequested => "ApprovalRequested",
            StepKind::ApprovalDecided => "ApprovalDecided",
            StepKind::ApprovalVoided => "ApprovalVoided",
            StepKind::Observation => "Observation",
            StepKind::Summary => "Summary",
            StepKind::VersionChanged => "VersionChanged",
            StepKind::RunFinished => "RunFinished",
            StepKind::Forked => "Forked",
        }
    }
}

impl fmt::Display for StepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Versions in force when the step was made (all optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
// Fields are declared in the sorted order of their JSON names: serde_json
// then writes them in canonical order (see `Record::canonical_bytes`).
pub struct Versions {
    /// The model id as the provider reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_schema_hash: Option<String>,
}

/// Usage of this step (zero for steps that call no model).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
// Fields in the sorted order of their JSON names (canonical order).
pub struct Usage {
    /// Cost in millionths of the price currency.
    #[serde(default)]
    pub cost_micros: u64,
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
}

/// The worker that wrote the step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
// Fields in the sorted order of their JSON names (canonical order).
pub struct Worker {
    pub attempt: u32,
    pub pod: String,
}

/// One step of a run's log, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// Record format version ([`FORMAT`] for what this code writes).
    pub format: u32,
    pub seq: u64,
    pub kind: StepKind,
    pub payload: serde_json::Value,
    #[serde(default)]
    pub versions: Versions,
    #[serde(default)]
    pub usage: Usage,
    #[serde(default)]
    pub worker: Worker,
    pub prev_hash: Hash,
    /// `sha256(prev_hash ‖ canonical record)`; not part of the canonical form.
    #[serde(default)]
    pub hash: Hash,
    /// Server time of the first successful append; not part of the canonical
    /// form. `None` until stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}

/// The hashed part of a record, borrowed (field names as in [`Record`]).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CanonicalView<'a> {
    format: u32,
    seq: u64,
    kind: StepKind,
    payload: &'a serde_json::Value,
    versions: &'a Versions,
    usage: &'a Usage,
    worker: &'a Worker,
    prev_hash: &'a Hash,
}

impl Record {
    /// The one canonical encoding of this record (excludes `hash` and `createdAt`).
    ///
    /// Equal to the RFC 8785 encoding of the record (pinned by tests against
    /// `serde_json_canonicalizer`); the fixed envelope is written directly
    /// (its keys in sorted order, its strings escaped as RFC 8785 does) and
    /// only the free-form payload goes through [`crate::jcs`], which makes
    /// replay verification several times faster.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let safe = |n: u64| n <= MAX_SAFE_INTEGER;
        if !(safe(self.seq)
            && safe(self.usage.cost_micros)
            && safe(self.usage.input_tokens)
            && safe(self.usage.output_tokens))
        {
            // Integers beyond 2^53 are written as doubles: leave that to the canonicalizer.
            return self.canonical_bytes_generic();
        }
        let mut out = Vec::with_capacity(384);
        out.extend_from_slice(b"{\"format\":");
        out.extend_from_slice(self.format.to_string().as_bytes());
        out.extend_from_slice(b",\"kind\":\"");
        out.extend_from_slice(self.kind.as_str().as_bytes());
        out.extend_from_slice(b"\",\"payload\":");
        crate::jcs::write(&self.payload, &mut out).expect("writing to a Vec cannot fail");
        out.extend_from_slice(b",\"prevHash\":\"");
        out.extend_from_slice(self.prev_hash.to_hex().as_bytes());
        out.extend_from_slice(b"\",\"seq\":");
        out.extend_from_slice(self.seq.to_string().as_bytes());
        // serde_json's compact output of these fixed structs (fields declared
        // in sorted order, strings and safe integers only) is canonical.
        out.extend_from_slice(b",\"usage\":");
        serde_json::to_writer(&mut out, &self.usage).expect("usage serializes");
        out.extend_from_slice(b",\"versions\":");
        serde_json::to_writer(&mut out, &self.versions).expect("versions serialize");
        out.extend_from_slice(b",\"worker\":");
        serde_json::to_writer(&mut out, &self.worker).expect("worker serializes");
        out.push(b'}');
        out
    }

    /// The canonical encoding computed by the RFC 8785 canonicalizer alone
    /// (reference for [`Record::canonical_bytes`]).
    pub fn canonical_bytes_generic(&self) -> Vec<u8> {
        let view = CanonicalView {
            format: self.format,
            seq: self.seq,
            kind: self.kind,
            payload: &self.payload,
            versions: &self.versions,
            usage: &self.usage,
            worker: &self.worker,
            prev_hash: &self.prev_hash,
        };
        serde_json_canonicalizer::to_vec(&view).expect("a record is always canonicalizable")
    }

    /// The hash this record must carry: `sha256(prev_hash ‖ canonical record)`.
    pub fn compute_hash(&self) -> Hash {
        chain_hash(&self.prev_hash, &self.canonical_bytes())
    }

    /// Decode a stored canonical body (the canonical form, without hash and
    /// createdAt), refusing formats this code cannot read and a body that is
    /// not exactly the canonical form of the record it decodes to: the hash
    /// covers the stored bytes, so a field added, keys reordered or spacing
    /// changed is bytes nobody hashed or signed, however the record reads.
    pub fn from_canonical(
        body: &[u8],
        hash: Hash,
        created_at: Option<DateTime<Utc>>,
    ) -> Result<Record, UnreadableRecord> {
        #[derive(Deserialize)]
        struct FormatOnly {
            format: u32,
        }
        let mut record: Record = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => {
                return Err(match serde_json::from_slice::<FormatOnly>(body) {
                    Ok(f) if f.format > FORMAT => UnreadableRecord::Newer(f.format),
                    _ => UnreadableRecord::Undecodable(e),
                });
            }
        };
        if record.format == 0 || record.format > FORMAT {
            return Err(UnreadableRecord::Unsupported(record.format));
        }
        record.hash = hash;
        record.created_at = created_at;
        if record.canonical_bytes() != body {
            return Err(UnreadableRecord::NotCanonical(Box::new(record)));
        }
        Ok(record)
    }

    /// The head of the log that ends with this record.
    pub fn head(&self) -> Head {
        Head {
            len: self.seq + 1,
            hash: self.hash,
        }
    }

    /// Whether `other` is the same record (same canonical bytes and hash),
    /// ignoring `createdAt`.
    pub fn same_as(&self, other: &Record) -> bool {
        self.hash == other.hash && self.canonical_bytes() == other.canonical_bytes()
    }
}

/// `sha256(prev ‖ canonical)`.
pub fn chain_hash(prev: &Hash, canonical: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update(prev.0);
    h.update(canonical);
    Hash(h.finalize().into())
}

/// Length and head hash of a run's log ([`Hash::ZERO`] when empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Head {
    pub len: u64,
    pub hash: Hash,
}

impl Head {
    pub const EMPTY: Head = Head {
        len: 0,
        hash: Hash::ZERO,
    };
}

/// What a caller writes; [`RecordDraft::seal`] turns it into the next record.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordDraft {
    /// The format the record is written in ([`FORMAT_1`] unless it holds
    /// something newer).
    pub format: u32,
    pub kind: StepKind,
    pub payload: serde_json::Value,
    pub versions: Versions,
    pub usage: Usage,
    pub worker: Worker,
}

impl RecordDraft {
    pub fn new(kind: StepKind, payload: serde_json::Value) -> Self {
        RecordDraft {
            format: FORMAT_1,
            kind,
            payload,
            versions: Versions::default(),
            usage: Usage::default(),
            worker: Worker::default(),
        }
    }

    /// The same draft, written in `format` (see [`FORMAT`]).
    pub fn in_format(mut self, format: u32) -> Self {
        self.format = format;
        self
    }
}

impl Head {
    /// Parses an anchor written as `<length>:<hash hex>` (see [`Head::anchor`]).
    pub fn parse_anchor(s: &str) -> Result<Head, AnchorError> {
        let (len, hash) = s
            .trim()
            .split_once(':')
            .ok_or_else(|| AnchorError::Shape(s.to_string()))?;
        let len = len.parse().map_err(|_| AnchorError::Length {
            anchor: s.to_string(),
            len: len.to_string(),
        })?;
        let hash = hash.parse().map_err(|source| AnchorError::Hash {
            anchor: s.to_string(),
            source,
        })?;
        Ok(Head { len, hash })
    }

    /// `<length>:<hash hex>`.
    pub fn anchor(&self) -> String {
        format!("{}:{}", self.len, self.hash)
    }
}

/// A stored record body this code cannot read (what [`Record::from_canonical`]
/// refuses); the store reports it as corruption or a broken chain, at its seq.
#[derive(Debug, thiserror::Error)]
pub enum UnreadableRecord {
    /// Written by a newer release: upgrade before reading this log.
    #[error("record format {0} is newer than this code reads (≤ {FORMAT})")]
    Newer(u32),
    /// Not a record at all.
    #[error("undecodable record: {0}")]
    Undecodable(serde_json::Error),
    /// A record, of a format no release writes.
    #[error("record format {0} is not one this code reads (1..={FORMAT})")]
    Unsupported(u32),
    /// It decodes (to the record held here), but its stored bytes are not
    /// that record's canonical form: bytes were added, reordered or respaced
    /// after it was written. Never acted on, shown only as altered.
    #[error(
        "the stored body is not the canonical form of the record it decodes to (a field added, keys reordered, spacing or a number's form changed): the record was altered"
    )]
    NotCanonical(Box<Record>),
}

/// A record as a store holds it: its body byte for byte (the canonical form
/// its writer hashed), with the hash and time stored beside it. This, not a
/// record decoded from it, is what readers verify (the hash is taken over
/// these bytes) and what the step-log gateway and the log API hand on, so
/// that whoever reads them can verify them too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredRecord {
    /// Its position in the log (the store's key; the body says it too).
    pub seq: u64,
    /// The stored body, exactly as stored.
    pub body: String,
    /// The stored hash: `sha256(prev_hash ‖ body)` for an intact record.
    pub hash: Hash,
    /// Server time of the append.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}

impl StoredRecord {
    /// How `record` is stored: its canonical form.
    pub fn of(record: &Record) -> StoredRecord {
        StoredRecord {
            seq: record.seq,
            // Canonical JSON is UTF-8 (RFC 8785 writes strings as they are).
            body: String::from_utf8_lossy(&record.canonical_bytes()).into_owned(),
            hash: record.hash,
            created_at: record.created_at,
        }
    }

    /// The record its body decodes to, if the body is exactly that
    /// record's canonical form ([`Record::from_canonical`]); the hash is
    /// not checked here (it chains: see `verify_stored`).
    pub fn decode(&self) -> Result<Record, UnreadableRecord> {
        Record::from_canonical(self.body.as_bytes(), self.hash, self.created_at)
    }
}

/// A log anchor (`<length>:<hash hex>`, see [`super::Head::anchor`]) that
/// does not parse; the anchor is quoted as given.
#[derive(Debug, thiserror::Error)]
pub enum AnchorError {
    #[error("log anchor {0:?}: expected <length>:<hash>")]
    Shape(String),
    #[error("log anchor {anchor:?}: length {len:?} is not a number")]
    Length { anchor: String, len: String },
    #[error("log anchor {anchor:?}: {source}")]
    Hash {
        anchor: String,
        source: ParseHashError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;
    use crate::store::chain::*;
    use serde_json::json;

    fn sample() -> RecordDraft {
        RecordDraft {
            format: FORMAT_1,
            kind: StepKind::ModelCall,
            payload: json!({"response": {"text": "hello", "toolCalls": [{"name": "lookup", "arguments": {"id": 7}}]}}),
            versions: Versions {
                prompt_version: Some("v3".into()),
                prompt_hash: Some("abc".into()),
                model_id: Some("gpt-test-2025".into()),
                tool_schema_hash: None,
            },
            usage: Usage {
                input_tokens: 120,
                output_tokens: 30,
                cost_micros: 450,
            },
            worker: Worker {
                pod: "run-a-step-0".into(),
                attempt: 1,
            },
        }
    }

    #[test]
    fn store_canonical_json_is_key_order_independent() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"b":1,"a":{"y":[1,2,{"q":true,"p":null}],"x":"s"}}"#).unwrap();
        let b: serde_json::Value =
            serde_json::from_str(r#"{ "a" : {"x":"s","y":[1,2,{"p":null,"q":true}]}, "b":1.0 }"#)
                .unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(
            String::from_utf8(canonical_json(&a)).unwrap(),
            r#"{"a":{"x":"s","y":[1,2,{"p":null,"q":true}]},"b":1}"#
        );
        // Array order does matter.
        let c = json!({"a": {"x": "s", "y": [2, 1, {"p": null, "q": true}]}, "b": 1});
        assert_ne!(canonical_json(&a), canonical_json(&c));
    }

    #[test]
    fn store_canonical_json_rfc8785_numbers_and_strings() {
        let v = json!({"n": [0.1, 1e21, -0.0, 100, 1.5e-7], "s": "é\u{1}\"\\/"});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            "{\"n\":[0.1,1e+21,0,100,1.5e-7],\"s\":\"é\\u0001\\\"\\\\/\"}"
        );
    }

    #[test]
    fn store_sha256_hex_known_vector() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn store_record_hash_is_stable() {
        let r = sample().seal(&Head::EMPTY).unwrap();
        let canonical = String::from_utf8(r.canonical_bytes()).unwrap();
        assert_eq!(
            canonical,
            r#"{"format":1,"kind":"ModelCall","payload":{"response":{"text":"hello","toolCalls":[{"arguments":{"id":7},"name":"lookup"}]}},"prevHash":"0000000000000000000000000000000000000000000000000000000000000000","seq":0,"usage":{"costMicros":450,"inputTokens":120,"outputTokens":30},"versions":{"modelId":"gpt-test-2025","promptHash":"abc","promptVersion":"v3"},"worker":{"attempt":1,"pod":"run-a-step-0"}}"#
        );
        // hash = sha256(32 zero bytes ‖ canonical)
        let mut input = vec![0u8; 32];
        input.extend_from_slice(canonical.as_bytes());
        assert_eq!(r.hash.to_hex(), sha256_hex(&input));
        // Pinned: a change of the encoding breaks every stored log.
        assert_eq!(
            r.hash.to_hex(),
            "85187fa1b9e4ad3a03ef8059d455529a70c718da2fb8016fd6d66e56daa770c1"
        );
    }

    #[test]
    fn store_hash_excludes_created_at_and_chains() {
        let r0 = sample().seal(&Head::EMPTY).unwrap();
        let mut r0b = r0.clone();
        r0b.created_at = Some(Utc::now());
        assert_eq!(r0b.compute_hash(), r0.hash);
        assert!(r0.same_as(&r0b));

        let r1 = RecordDraft::new(StepKind::ToolIntent, json!({"tool": "lookup"}))
            .seal(&r0.head())
            .unwrap();
        assert_eq!(r1.seq, 1);
        assert_eq!(r1.prev_hash, r0.hash);
        let head = verify_chain("r", &[r0.clone(), r1.clone()], Some(&r1.hash)).unwrap();
        assert_eq!(head, r1.head());

        // The same content after a different predecessor hashes differently.
        let other = RecordDraft::new(StepKind::ToolIntent, json!({"tool": "lookup"}))
            .seal(&Head {
                len: 1,
                hash: Hash([1; 32]),
            })
            .unwrap();
        assert_ne!(other.hash, r1.hash);
    }

    #[test]
    fn store_verify_chain_names_first_bad_seq() {
        let mut head = Head::EMPTY;
        let mut log = Vec::new();
        for i in 0..5 {
            let r = RecordDraft::new(StepKind::Observation, json!({"i": i}))
                .seal(&head)
                .unwrap();
            head = r.head();
            log.push(r);
        }
        assert_eq!(verify_chain("r", &log, None).unwrap(), head);

        let mut tampered = log.clone();
        tampered[2].payload = json!({"i": 99});
        match verify_chain("r", &tampered, None) {
            Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 2),
            other => panic!("expected ChainBroken at 2, got {other:?}"),
        }

        // Altered and re-hashed: the next record no longer links.
        tampered[2].hash = tampered[2].compute_hash();
        match verify_chain("r", &tampered, None) {
            Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 3),
            other => panic!("expected ChainBroken at 3, got {other:?}"),
        }

        // Truncated: the recorded head is never reached.
        match verify_chain("r", &log[..3], Some(&head.hash)) {
            Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 3),
            other => panic!("expected ChainBroken at 3, got {other:?}"),
        }
        // Longer than recorded: names the first record past the recorded head.
        match verify_chain("r", &log, Some(&log[1].hash)) {
            Err(StoreError::ChainBroken { seq, .. }) => assert_eq!(seq, 2),
            other => panic!("expected ChainBroken at 2, got {other:?}"),
        }
    }

    #[test]
    fn store_record_roundtrips_through_canonical_form() {
        let r = sample().seal(&Head::EMPTY).unwrap();
        let back = Record::from_canonical(&r.canonical_bytes(), r.hash, None).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.canonical_bytes(), r.canonical_bytes());

        let newer = br#"{"format":3,"seq":0}"#;
        let err = Record::from_canonical(newer, Hash::ZERO, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("format 3"), "{err}");
    }

    /// A record that holds what a container agent adds is written as format
    /// 2 and reads back as such; everything else stays format 1, byte for
    /// byte (`store_record_hash_is_stable`).
    #[test]
    fn a_draft_in_format_2_is_sealed_and_read_as_format_2() {
        let r = sample().in_format(FORMAT).seal(&Head::EMPTY).unwrap();
        assert_eq!(r.format, 2);
        assert!(
            String::from_utf8(r.canonical_bytes())
                .unwrap()
                .starts_with(r#"{"format":2,"#)
        );
        let back = Record::from_canonical(&r.canonical_bytes(), r.hash, None).unwrap();
        assert_eq!(back, r);
        assert_eq!(sample().seal(&Head::EMPTY).unwrap().format, FORMAT_1);
    }

    /// The ways the stored bytes of one record can change while it still
    /// decodes to the same record: each is an altered record.
    fn respellings(canonical: &str) -> Vec<(&'static str, String)> {
        vec![
            (
                "a field added",
                canonical.replacen("{", "{\"tampered\":true,", 1),
            ),
            (
                "a field added inside usage",
                canonical.replacen("\"usage\":{", "\"usage\":{\"extra\":1,", 1),
            ),
            (
                "keys reordered",
                canonical.replacen(
                    "{\"format\":1,\"kind\":\"ModelCall\",",
                    "{\"kind\":\"ModelCall\",\"format\":1,",
                    1,
                ),
            ),
            ("spacing", canonical.replacen(",", ", ", 1)),
            ("a trailing newline", format!("{canonical}\n")),
            (
                "a number's form",
                canonical.replacen("\"id\":7", "\"id\":7.0", 1),
            ),
            (
                "a string's escapes",
                canonical.replacen("hello", "h\\u0065llo", 1),
            ),
        ]
    }

    #[test]
    fn store_a_body_that_is_not_its_records_canonical_form_is_refused_as_altered() {
        let r = sample().seal(&Head::EMPTY).unwrap();
        let canonical = String::from_utf8(r.canonical_bytes()).unwrap();
        for (how, body) in respellings(&canonical) {
            assert_ne!(body, canonical, "{how}: the spelling changed nothing");
            match Record::from_canonical(body.as_bytes(), r.hash, None) {
                Err(UnreadableRecord::NotCanonical(decoded)) => assert_eq!(
                    decoded.canonical_bytes(),
                    r.canonical_bytes(),
                    "{how}: it says what the record said"
                ),
                other => panic!("{how}: expected NotCanonical, got {other:?}"),
            }
        }
        assert_eq!(
            Record::from_canonical(canonical.as_bytes(), r.hash, None).unwrap(),
            r
        );
    }

    /// A database superuser who respells a record and hashes the new bytes
    /// (the tail of a log, past every anchor) still leaves an altered record.
    #[test]
    fn store_a_respelled_record_is_altered_even_with_its_hash_recomputed() {
        let r0 = sample().seal(&Head::EMPTY).unwrap();
        let mut d = sample();
        d.kind = StepKind::ModelCall;
        let r1 = d.seal(&r0.head()).unwrap();
        let canonical = String::from_utf8(r1.canonical_bytes()).unwrap();
        for (how, body) in respellings(&canonical) {
            for rehashed in [false, true] {
                let stored = StoredRecord {
                    seq: 1,
                    hash: if rehashed {
                        chain_hash(&r0.hash, body.as_bytes())
                    } else {
                        r1.hash
                    },
                    body: body.clone(),
                    created_at: None,
                };
                match verify_stored("r", &r0.head(), &stored) {
                    Err(StoreError::ChainBroken { seq: 1, reason, .. }) => {
                        assert!(reason.contains("altered"), "{how}: {reason}")
                    }
                    other => panic!("{how} (rehashed {rehashed}): {other:?}"),
                }
            }
        }
        assert_eq!(
            verify_stored("r", &r0.head(), &StoredRecord::of(&r1)).unwrap(),
            r1
        );
    }

    #[test]
    fn store_seal_refuses_unsafe_integers() {
        let d = RecordDraft::new(
            StepKind::ToolResult,
            json!({"a": [1, {"big": 9007199254740993u64}]}),
        );
        match d.seal(&Head::EMPTY) {
            Err(StoreError::InvalidRecord { reason }) => {
                assert!(reason.contains("payload.a[1].big"), "{reason}")
            }
            other => panic!("expected InvalidRecord, got {other:?}"),
        }
        let ok = RecordDraft::new(
            StepKind::ToolResult,
            json!({"a": 9007199254740991u64, "b": -9007199254740991i64}),
        );
        assert!(ok.seal(&Head::EMPTY).is_ok());
    }

    #[test]
    fn store_fast_canonical_form_equals_rfc8785() {
        let strings = [
            "",
            "plain",
            "quote \" backslash \\ slash /",
            "controls \u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}\u{7f}",
            "unicode é ü 漢字 😀 \u{2028}\u{2029}",
        ];
        let mut head = Head::EMPTY;
        for (i, s) in strings.iter().enumerate() {
            for big in [false, true] {
                let mut d = sample();
                let mut m = serde_json::Map::new();
                m.insert(s.to_string(), json!([s, 1.5, -3, {"z": null, "a": s}]));
                m.insert("n".into(), json!(i));
                d.payload = serde_json::Value::Object(m);
                d.versions.tool_schema_hash = Some(s.to_string());
                d.versions.model_id = None;
                d.worker.pod = s.to_string();
                if big {
                    d.usage.cost_micros = u64::MAX;
                }
                let r = d.seal(&head).unwrap();
                assert_eq!(
                    String::from_utf8(r.canonical_bytes()).unwrap(),
                    String::from_utf8(r.canonical_bytes_generic()).unwrap()
                );
                head = r.head();
            }
        }
        let mut r = sample().seal(&head).unwrap();
        r.versions = Versions::default();
        r.worker = Worker::default();
        r.usage = Usage::default();
        r.payload = json!(null);
        assert_eq!(r.canonical_bytes(), r.canonical_bytes_generic());
    }

    #[test]
    fn store_hash_hex_roundtrip() {
        let h = Hash([0xab; 32]);
        assert_eq!(h.to_string().parse::<Hash>().unwrap(), h);
        assert!("xyz".parse::<Hash>().is_err());
        assert_eq!(
            serde_json::to_string(&h).unwrap(),
            format!("\"{}\"", "ab".repeat(32))
        );
    }

    fn log_of(n: usize) -> Vec<Record> {
        let mut head = Head::EMPTY;
        (0..n)
            .map(|i| {
                let r = RecordDraft::new(StepKind::Observation, json!({"text": i}))
                    .seal(&head)
                    .unwrap();
                head = r.head();
                r
            })
            .collect()
    }

    #[test]
    fn store_anchor_accepts_a_log_that_extends_it() {
        let log = log_of(5);
        for at in [0, 1, 3, 5] {
            let anchor = if at == 0 {
                Head::EMPTY
            } else {
                log[at - 1].head()
            };
            check_anchor("r", &log, &anchor).unwrap();
        }
        let a = log[2].head();
        assert_eq!(Head::parse_anchor(&a.anchor()).unwrap(), a);
        assert!(Head::parse_anchor("3").is_err() && Head::parse_anchor("x:00").is_err());
    }

    #[test]
    fn store_anchor_refuses_truncation_and_rewrites() {
        let log = log_of(5);
        let anchor = log[3].head();
        // The tail deleted: the verified chain is shorter than the anchor.
        let e = check_anchor("r", &log[..3], &anchor).unwrap_err();
        assert!(e.to_string().contains("records were removed"), "{e}");
        // History rewritten and re-hashed consistently: the chain verifies, the anchor does not.
        let mut forged = log_of(2);
        let mut head = forged[1].head();
        for i in 2..5 {
            let r = RecordDraft::new(
                StepKind::Observation,
                json!({"text": format!("forged {i}")}),
            )
            .seal(&head)
            .unwrap();
            head = r.head();
            forged.push(r);
        }
        verify_chain("r", &forged, None).unwrap();
        let e = check_anchor("r", &forged, &anchor).unwrap_err();
        assert!(matches!(e, StoreError::ChainBroken { seq: 3, .. }), "{e}");
    }
}
