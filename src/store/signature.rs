//! Controller signatures on the records only the controller writes
//! (`RunStarted`, `VersionChanged`, `ApprovalDecided`, `RunFinished`,
//! `Forked`), so
//! that not even a holder of a database credential can forge one: the chain
//! alone is an unkeyed hash anyone can recompute.
//!
//! The signature is Ed25519, carried in the payload under
//! [`SIGNATURE_FIELD`] (so it is chained like the rest of the record and the
//! storage format is unchanged), in one of two schemes:
//!
//! - **v2** (`v2:<key id>:<hex>`), what this code writes: over the run's uid,
//!   the record's seq and kind and the hash the record would have without
//!   the signature. A record copied into another run's log, or moved to
//!   another seq, no longer verifies, even where the chains around it are
//!   byte-identical. The key id names which of the controller's keys signed
//!   (the current one, or one a rotation retired).
//! - **v1** (bare hex), what releases before 2026-12 wrote: over the unsigned
//!   hash only. Such a signature is *legacy*: accepted only before
//!   `status.log.boundFrom` (the records a run had when a binding controller
//!   first saw it, all anchored by `status.log.headHash`), refused anywhere
//!   else, so a v1 record transplanted into a newer log stops the run.
//!
//! The step runner gets the public keys in its Job and checks every such
//! record it replays; the controller checks them on every read; `kubectl
//! agentrun verify` checks them with the keys the controller publishes.

use crate::refusal::Refusal;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use sha2::{Digest, Sha256};

use super::{Hash, Head, KeyError, Record, RecordDraft, StepKind, StoreError};

/// Payload field of a controller record that holds its signature.
pub const SIGNATURE_FIELD: &str = "controllerSignature";
/// Domain separation of what v1 signed (the unsigned hash alone).
const CONTEXT_V1: &[u8] = b"agentrun.dev/controller-record/v1\0";
/// Domain separation of what v2 signs (run, seq, kind, unsigned hash).
const CONTEXT_V2: &[u8] = b"agentrun.dev/controller-record/v2\0";
/// Prefix of a v2 signature in [`SIGNATURE_FIELD`].
const V2_PREFIX: &str = "v2:";

/// Whether only the controller may write records of `kind`.
pub fn controller_only(kind: StepKind) -> bool {
    matches!(
        kind,
        StepKind::RunStarted
            | StepKind::VersionChanged
            | StepKind::ApprovalDecided
            | StepKind::RunFinished
            | StepKind::Forked
    )
}

fn message_v1(unsigned: &Hash) -> Vec<u8> {
    let mut m = CONTEXT_V1.to_vec();
    m.extend_from_slice(&unsigned.0);
    m
}

/// What v2 signs: every part length-prefixed, so no two places share bytes.
fn message_v2(run: &str, seq: u64, kind: StepKind, unsigned: &Hash) -> Vec<u8> {
    let mut m = CONTEXT_V2.to_vec();
    for part in [run.as_bytes(), kind.as_str().as_bytes()] {
        m.extend_from_slice(&(part.len() as u64).to_be_bytes());
        m.extend_from_slice(part);
    }
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(&unsigned.0);
    m
}

/// The id of a public key: the first 8 bytes of its sha256, hex. Short
/// enough to read in a ConfigMap and a signature, and computed, so a
/// published id cannot name another key.
pub fn key_id(public: &[u8]) -> String {
    hex::encode(&Sha256::digest(public)[..8])
}

/// Where a run's signatures must follow which scheme (from `status.log`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SignatureRules {
    /// Controller records before this seq predate signing (`signedFrom`).
    pub signed_from: u64,
    /// Controller records before this seq may carry a legacy v1 signature
    /// (`boundFrom`); from it on only v2 counts.
    pub bound_from: u64,
    /// Where each of the controller's keys signs this run's records
    /// (`signingKeys`): a retired key's signature counts only before them.
    pub keys: KeyWindows,
}

impl SignatureRules {
    /// A run begun by this release: every controller record signed, bound,
    /// and by the current key (no retired key ever signed for it).
    pub const STRICT: SignatureRules = SignatureRules {
        signed_from: 0,
        bound_from: 0,
        keys: KeyWindows::Recorded(Vec::new()),
    };
}

/// Which of the controller's keys signed a run's controller records from
/// which seq on (`status.log.signingKeys`, written by the controller in the
/// run's status, which no database writer and no run creator can move).
///
/// The key in charge when the controller wrote the status is always
/// recorded last; a rotation appends the new key at the log's length when
/// the new key's controller first wrote the run's status. A *retired* key's
/// signature therefore counts only before the seq at which the key after it
/// took over ([`KeyWindows::until`]): whoever holds a leaked retired key can
/// sign records, but not at any position after its retirement. The current
/// (not retired) key is bounded by nothing but the chain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KeyWindows {
    /// Nothing recorded: a run an earlier release began, until a status of
    /// this release records its keys. Any published key, anywhere, as
    /// before.
    #[default]
    Unrecorded,
    /// `(key id, first seq)`, in the order the keys took over.
    Recorded(Vec<(String, u64)>),
}

impl KeyWindows {
    /// The first seq at which retired key `id` no longer signs for this run
    /// (`None`: no bound). A key the run never recorded signed nothing
    /// after the first recorded one took over (from seq 0 for a run begun
    /// by this release: nowhere).
    pub fn until(&self, id: &str) -> Option<u64> {
        let KeyWindows::Recorded(keys) = self else {
            return None;
        };
        match keys.iter().rposition(|(k, _)| k == id) {
            Some(i) => keys.get(i + 1).map(|(_, from)| *from),
            None => Some(keys.first().map_or(0, |(_, from)| *from)),
        }
    }

    /// Parses `<key id>:<from>,...` (what a step Job is given); `none` (or
    /// nothing): recorded, with no key (every retired key refused).
    pub fn parse(s: &str) -> Result<KeyWindows, Refusal> {
        let mut keys = Vec::new();
        if s.trim() == NO_KEYS {
            return Ok(KeyWindows::Recorded(keys));
        }
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (id, from) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?} is not `<key id>:<seq>`"))?;
            let from = from
                .parse::<u64>()
                .map_err(|_| format!("{part:?}: {from:?} is not a seq"))?;
            keys.push((id.to_string(), from));
        }
        Ok(KeyWindows::Recorded(keys))
    }

    /// The form [`KeyWindows::parse`] reads (`None` for
    /// [`KeyWindows::Unrecorded`]).
    pub fn to_text(&self) -> Option<String> {
        let KeyWindows::Recorded(keys) = self else {
            return None;
        };
        if keys.is_empty() {
            // Not empty: an empty variable reads as an unset one.
            return Some(NO_KEYS.into());
        }
        Some(
            keys.iter()
                .map(|(id, from)| format!("{id}:{from}"))
                .collect::<Vec<_>>()
                .join(","),
        )
    }
}

/// [`KeyWindows::to_text`] of a record of no key.
const NO_KEYS: &str = "none";

/// The controller's signing key.
pub struct RecordSigner {
    pair: Ed25519KeyPair,
    id: String,
}

impl std::fmt::Debug for RecordSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecordSigner({} {})", self.id, self.public_key_hex())
    }
}

impl RecordSigner {
    /// The key pair of a 32-byte seed (derived from the replicas' shared key).
    pub fn from_seed(seed: &[u8; 32]) -> RecordSigner {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed).expect("any 32 bytes are a seed");
        let id = key_id(pair.public_key().as_ref());
        RecordSigner { pair, id }
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.pair.public_key().as_ref())
    }

    /// The id of this key (see [`key_id`]).
    pub fn key_id(&self) -> &str {
        &self.id
    }

    /// The public half, as a verifier knows it.
    pub fn public_key(&self, retired: bool) -> PublicKey {
        PublicKey {
            id: self.id.clone(),
            key: self.pair.public_key().as_ref().to_vec(),
            retired,
        }
    }

    /// The verifier of this key's signatures alone.
    pub fn verifier(&self) -> RecordVerifier {
        RecordVerifier {
            keys: vec![self.public_key(false)],
        }
    }

    /// Signs `message` under `context` (domain separation from records and
    /// from other messages); the signature in hex.
    pub fn sign_message(&self, context: &[u8], message: &[u8]) -> String {
        let mut m = context.to_vec();
        m.extend_from_slice(message);
        hex::encode(self.pair.sign(&m).as_ref())
    }

    /// Seals `draft` after `head` in run `run` like [`RecordDraft::seal`],
    /// signed (v2) when its kind is a controller kind (its payload must then
    /// be an object).
    pub fn seal(&self, run: &str, draft: RecordDraft, head: &Head) -> Result<Record, StoreError> {
        if !controller_only(draft.kind) {
            return draft.seal(head);
        }
        let unsigned = draft.clone().seal(head)?;
        let signature = self.pair.sign(&message_v2(
            run,
            unsigned.seq,
            unsigned.kind,
            &unsigned.hash,
        ));
        let mut draft = draft;
        let Some(payload) = draft.payload.as_object_mut() else {
            return Err(StoreError::InvalidRecord {
                reason: format!(
                    "a {} payload must be a JSON object to be signed",
                    draft.kind
                ),
            });
        };
        payload.insert(
            SIGNATURE_FIELD.into(),
            format!("{V2_PREFIX}{}:{}", self.id, hex::encode(signature.as_ref())).into(),
        );
        draft.seal(head)
    }

    /// Seals like releases before 2026-12 did (v1: not bound to the run):
    /// for tests of the legacy rules only.
    #[doc(hidden)]
    pub fn seal_v1(&self, draft: RecordDraft, head: &Head) -> Result<Record, StoreError> {
        let unsigned = draft.clone().seal(head)?;
        let signature = self.pair.sign(&message_v1(&unsigned.hash));
        let mut draft = draft;
        if let Some(payload) = draft.payload.as_object_mut() {
            payload.insert(
                SIGNATURE_FIELD.into(),
                hex::encode(signature.as_ref()).into(),
            );
        }
        draft.seal(head)
    }
}

/// One of the controller's public keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey {
    pub id: String,
    pub key: Vec<u8>,
    /// Retired by a rotation: its signatures still verify, it signs no more.
    pub retired: bool,
}

impl PublicKey {
    /// From its hex form (32 bytes).
    pub fn from_hex(s: &str, retired: bool) -> Result<PublicKey, KeyError> {
        let key = hex::decode(s.trim())?;
        if key.len() != 32 {
            return Err(KeyError::Length(key.len()));
        }
        Ok(PublicKey {
            id: key_id(&key),
            key,
            retired,
        })
    }

    pub fn to_hex(&self) -> String {
        hex::encode(&self.key)
    }

    fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.key)
            .verify(message, signature)
            .is_ok()
    }
}

/// What one controller record's signature is worth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SignatureCheck {
    /// Bound to this run and seq, by key `key` (`retired`: by a key a
    /// rotation retired, which signed it before that).
    Valid { key: String, retired: bool },
    /// A v1 signature, not bound to its place, where it is still accepted
    /// (before `boundFrom`).
    Legacy { key: String, retired: bool },
    /// No signature, before `signedFrom`: the record predates signing.
    PredatesSigning,
    /// No signature where one is required.
    Missing,
    /// A signature that does not verify here (the reason says why).
    Invalid(String),
}

impl SignatureCheck {
    /// Whether the record may be acted on.
    pub fn accepted(&self) -> bool {
        matches!(
            self,
            SignatureCheck::Valid { .. }
                | SignatureCheck::Legacy { .. }
                | SignatureCheck::PredatesSigning
        )
    }
}

impl std::fmt::Display for SignatureCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by = |retired: &bool| if *retired { "retired key" } else { "key" };
        match self {
            SignatureCheck::Valid { key, retired } => {
                write!(f, "signature valid ({} {key})", by(retired))
            }
            SignatureCheck::Legacy { key, retired } => write!(
                f,
                "legacy v1 signature ({} {key}), not bound to run and seq; accepted before boundFrom",
                by(retired)
            ),
            SignatureCheck::PredatesSigning => f.write_str("unsigned, predates signing"),
            SignatureCheck::Missing => f.write_str("signature MISSING (required)"),
            SignatureCheck::Invalid(reason) => write!(f, "signature INVALID: {reason}"),
        }
    }
}

/// Checks controller signatures with the controller's public keys: the
/// current one and those retired by rotations.
#[derive(Clone, Debug)]
pub struct RecordVerifier {
    keys: Vec<PublicKey>,
}

impl RecordVerifier {
    /// From public keys (none retired first is the convention, not a rule).
    pub fn new(keys: Vec<PublicKey>) -> Result<RecordVerifier, KeyError> {
        if keys.is_empty() {
            return Err(KeyError::NoKey);
        }
        Ok(RecordVerifier { keys })
    }

    /// From `AGENTRUN_CONTROLLER_KEY` in a step Job: hex public keys,
    /// comma-separated, the current one first (one key alone is what
    /// releases before rotation passed).
    pub fn from_hex(s: &str) -> Result<RecordVerifier, KeyError> {
        let keys = s
            .split(',')
            .filter(|k| !k.trim().is_empty())
            .enumerate()
            .map(|(i, k)| PublicKey::from_hex(k, i > 0))
            .collect::<Result<Vec<_>, _>>()?;
        RecordVerifier::new(keys)
    }

    /// The form [`RecordVerifier::from_hex`] reads.
    pub fn to_hex(&self) -> String {
        self.keys
            .iter()
            .map(PublicKey::to_hex)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn keys(&self) -> &[PublicKey] {
        &self.keys
    }

    /// Whether `signature` (hex) is the current key's over `message` under
    /// `context`. A retired key's is not: what it signed outside a log (a
    /// checkpoint) is made again by the current key, so a retired key, if
    /// it leaked, vouches for nothing new.
    pub fn verify_message(&self, context: &[u8], message: &[u8], signature: &str) -> bool {
        let Ok(signature) = hex::decode(signature) else {
            return false;
        };
        let mut m = context.to_vec();
        m.extend_from_slice(message);
        self.keys
            .iter()
            .any(|k| !k.retired && k.verifies(&m, &signature))
    }

    /// Every controller record of `records` must be accepted under `rules`
    /// (see [`RecordVerifier::classify`]); otherwise
    /// [`StoreError::ChainBroken`] naming the first bad seq.
    pub fn check(
        &self,
        run: &str,
        records: &[Record],
        rules: &SignatureRules,
    ) -> Result<(), StoreError> {
        for r in records {
            let Some(check) = self.classify(run, r, rules) else {
                continue;
            };
            if !check.accepted() {
                let reason = match check {
                    SignatureCheck::Missing => {
                        format!("the {} record is not signed by the controller", r.kind)
                    }
                    other => format!("the {} record's {other}", r.kind),
                };
                return Err(StoreError::ChainBroken {
                    run: run.to_string(),
                    seq: r.seq,
                    reason,
                });
            }
        }
        Ok(())
    }

    /// What the signature of record `r` of run `run` is worth; `None` for a
    /// runner's record (never signed).
    pub fn classify(
        &self,
        run: &str,
        r: &Record,
        rules: &SignatureRules,
    ) -> Option<SignatureCheck> {
        if !controller_only(r.kind) {
            return None;
        }
        let Some(field) = r.payload.get(SIGNATURE_FIELD) else {
            return Some(if r.seq < rules.signed_from {
                SignatureCheck::PredatesSigning
            } else {
                SignatureCheck::Missing
            });
        };
        let Some(field) = field.as_str() else {
            return Some(SignatureCheck::Invalid("not a string".into()));
        };
        let mut unsigned = r.clone();
        if let Some(p) = unsigned.payload.as_object_mut() {
            p.remove(SIGNATURE_FIELD);
        }
        let unsigned = unsigned.compute_hash();
        let check = match field.strip_prefix(V2_PREFIX) {
            Some(v2) => self.classify_v2(run, r, &unsigned, v2),
            None => self.classify_v1(r, &unsigned, field, rules),
        };
        Some(within_window(check, r.seq, &rules.keys))
    }

    fn classify_v2(&self, run: &str, r: &Record, unsigned: &Hash, v2: &str) -> SignatureCheck {
        let Some((id, signature)) = v2.split_once(':') else {
            return SignatureCheck::Invalid("a v2 signature is `v2:<key id>:<hex>`".into());
        };
        let Ok(signature) = hex::decode(signature) else {
            return SignatureCheck::Invalid("the signature is not hex".into());
        };
        let Some(key) = self.keys.iter().find(|k| k.id == id) else {
            return SignatureCheck::Invalid(format!(
                "signed by key {id}, which is not one of the controller's published keys"
            ));
        };
        if key.verifies(&message_v2(run, r.seq, r.kind, unsigned), &signature) {
            return SignatureCheck::Valid {
                key: key.id.clone(),
                retired: key.retired,
            };
        }
        SignatureCheck::Invalid(format!(
            "does not verify for run {run} at seq {}: the record was signed for another run \
             or position, or not by the controller",
            r.seq
        ))
    }

    fn classify_v1(
        &self,
        r: &Record,
        unsigned: &Hash,
        field: &str,
        rules: &SignatureRules,
    ) -> SignatureCheck {
        let Ok(signature) = hex::decode(field) else {
            return SignatureCheck::Invalid("the signature is not hex".into());
        };
        let message = message_v1(unsigned);
        let Some(key) = self.keys.iter().find(|k| k.verifies(&message, &signature)) else {
            return SignatureCheck::Invalid(
                "does not verify: it was not written by the controller".into(),
            );
        };
        if r.seq >= rules.bound_from {
            return SignatureCheck::Invalid(format!(
                "is a legacy v1 signature, which does not bind a record to its run and seq: \
                 accepted only before seq {} (status.log.boundFrom)",
                rules.bound_from
            ));
        }
        SignatureCheck::Legacy {
            key: key.id.clone(),
            retired: key.retired,
        }
    }
}

/// `check`, refused when a retired key signed at or after the seq where
/// the run's status says the key after it took over.
fn within_window(check: SignatureCheck, seq: u64, windows: &KeyWindows) -> SignatureCheck {
    let (SignatureCheck::Valid { key, retired: true }
    | SignatureCheck::Legacy { key, retired: true }) = &check
    else {
        return check;
    };
    match windows.until(key) {
        Some(until) if seq >= until => SignatureCheck::Invalid(format!(
            "is by key {key}, which a rotation retired: this run's status records that \
             another key signs its records from seq {until} on (status.log.signingKeys), \
             so a signature of the retired key counts only before seq {until}, not at seq {seq}"
        )),
        _ => check,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn signer(b: u8) -> RecordSigner {
        RecordSigner::from_seed(&[b; 32])
    }

    /// RunStarted, an Observation and an ApprovalDecided of run `run`.
    fn log(s: &RecordSigner, run: &str) -> Vec<Record> {
        let started = s
            .seal(
                run,
                RecordDraft::new(StepKind::RunStarted, json!({"agent": {}})),
                &Head::EMPTY,
            )
            .unwrap();
        let obs = s
            .seal(
                run,
                RecordDraft::new(StepKind::Observation, json!({"text": "x"})),
                &started.head(),
            )
            .unwrap();
        let decided = s
            .seal(
                run,
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &obs.head(),
            )
            .unwrap();
        vec![started, obs, decided]
    }

    #[test]
    fn store_controller_records_are_signed_and_verify() {
        let s = signer(1);
        let log = log(&s, "r");
        assert!(
            log[0].payload[SIGNATURE_FIELD]
                .as_str()
                .unwrap()
                .starts_with(&format!("v2:{}:", s.key_id()))
        );
        assert!(
            log[1].payload.get(SIGNATURE_FIELD).is_none(),
            "runner kinds are not signed"
        );
        super::super::verify_chain("r", &log, None).unwrap();
        let v = RecordVerifier::from_hex(&s.public_key_hex()).unwrap();
        v.check("r", &log, &SignatureRules::STRICT).unwrap();
        assert_eq!(
            v.classify("r", &log[2], &SignatureRules::STRICT),
            Some(SignatureCheck::Valid {
                key: s.key_id().into(),
                retired: false
            })
        );
    }

    #[test]
    fn store_a_record_copied_to_another_run_or_seq_is_refused() {
        let s = signer(1);
        let v = s.verifier();
        // Byte-identical chains in two runs (a whole log copied): the
        // records hash the same, but the signatures name run "a".
        let copied = log(&s, "a");
        let e = v.check("b", &copied, &SignatureRules::STRICT).unwrap_err();
        assert!(matches!(&e, StoreError::ChainBroken { seq: 0, .. }), "{e}");
        assert!(e.to_string().contains("signed for another run"), "{e}");
        // The decision re-linked at another seq of its own run, its
        // signature kept: the chain verifies, the signature does not.
        let mut moved = log(&s, "a");
        let decided = moved.pop().unwrap();
        let mut again = decided.clone();
        again.seq = 3;
        again.prev_hash = decided.hash;
        again.hash = again.compute_hash();
        moved.extend([decided, again]);
        super::super::verify_chain("a", &moved, None).unwrap();
        let e = v.check("a", &moved, &SignatureRules::STRICT).unwrap_err();
        assert!(matches!(e, StoreError::ChainBroken { seq: 3, .. }), "{e}");
    }

    #[test]
    fn store_legacy_signatures_count_only_before_bound_from() {
        let s = signer(1);
        let v = s.verifier();
        let old = s
            .seal_v1(
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &Head::EMPTY,
            )
            .unwrap();
        let rules = SignatureRules {
            signed_from: 0,
            bound_from: 1,
            ..SignatureRules::STRICT
        };
        assert_eq!(
            v.classify("r", &old, &rules),
            Some(SignatureCheck::Legacy {
                key: s.key_id().into(),
                retired: false
            })
        );
        v.check("r", std::slice::from_ref(&old), &rules).unwrap();
        let e = v
            .check("r", std::slice::from_ref(&old), &SignatureRules::STRICT)
            .unwrap_err();
        assert!(e.to_string().contains("legacy v1 signature"), "{e}");
    }

    /// The rules of a run whose records the old key signed before seq
    /// `switched`, where the new key took over.
    fn rotated_at(old: &RecordSigner, new: &RecordSigner, switched: u64) -> SignatureRules {
        SignatureRules {
            keys: KeyWindows::Recorded(vec![
                (old.key_id().into(), 0),
                (new.key_id().into(), switched),
            ]),
            ..SignatureRules::STRICT
        }
    }

    #[test]
    fn store_a_retired_key_still_verifies_what_it_signed() {
        let (old, new) = (signer(1), signer(2));
        let records = log(&old, "r");
        let ring = RecordVerifier::new(vec![new.public_key(false), old.public_key(true)]).unwrap();
        let round = RecordVerifier::from_hex(&ring.to_hex()).unwrap();
        assert_eq!(round.keys(), ring.keys());
        let rules = rotated_at(&old, &new, 3);
        ring.check("r", &records, &rules).unwrap();
        assert_eq!(
            ring.classify("r", &records[0], &rules),
            Some(SignatureCheck::Valid {
                key: old.key_id().into(),
                retired: true
            })
        );
        // A run that recorded no windows yet (an earlier release's): as before.
        let unrecorded = SignatureRules {
            keys: KeyWindows::Unrecorded,
            ..SignatureRules::STRICT
        };
        ring.check("r", &records, &unrecorded).unwrap();
        // Without the retired key: named as unknown.
        let e = new.verifier().check("r", &records, &rules).unwrap_err();
        assert!(
            e.to_string()
                .contains("not one of the controller's published keys"),
            "{e}"
        );
    }

    /// Mallory holds the retired key (leaked) and a database credential:
    /// records she signs with it verify only before the seq where the run's
    /// status says the new key took over, and nowhere in a run the retired
    /// key never signed for.
    #[test]
    fn store_a_retired_key_signs_nothing_after_its_retirement() {
        let (old, new) = (signer(1), signer(2));
        let ring = RecordVerifier::new(vec![new.public_key(false), old.public_key(true)]).unwrap();
        // The run's log: seq 0..3 by the old key, then the new key from 3.
        let mut records = log(&old, "r");
        let forged = old
            .seal(
                "r",
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &records[2].head(),
            )
            .unwrap();
        records.push(forged);
        let e = ring
            .check("r", &records, &rotated_at(&old, &new, 3))
            .unwrap_err();
        assert!(matches!(&e, StoreError::ChainBroken { seq: 3, .. }), "{e}");
        assert!(e.to_string().contains("retired"), "{e}");
        // The same record where the old key was still in charge verifies.
        ring.check("r", &records, &rotated_at(&old, &new, 4))
            .unwrap();
        // A run begun after the rotation (only the new key recorded): the
        // old key's RunStarted at seq 0 is refused.
        let fresh = log(&old, "s");
        let after = SignatureRules {
            keys: KeyWindows::Recorded(vec![(new.key_id().into(), 0)]),
            ..SignatureRules::STRICT
        };
        let e = ring.check("s", &fresh, &after).unwrap_err();
        assert!(matches!(&e, StoreError::ChainBroken { seq: 0, .. }), "{e}");
        // ...as under the strict rules (no key recorded at all).
        assert!(ring.check("s", &fresh, &SignatureRules::STRICT).is_err());
        // The current key is bounded by the chain only.
        ring.check("s", &log(&new, "s"), &rotated_at(&old, &new, 3))
            .unwrap();
        // A legacy v1 signature of the retired key: the same window.
        let v1 = old
            .seal_v1(
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &Head::EMPTY,
            )
            .unwrap();
        let legacy = |switched| SignatureRules {
            bound_from: 1,
            ..rotated_at(&old, &new, switched)
        };
        ring.check("r", std::slice::from_ref(&v1), &legacy(1))
            .unwrap();
        assert!(
            ring.check("r", std::slice::from_ref(&v1), &legacy(0))
                .is_err()
        );
    }

    #[test]
    fn store_key_windows_round_trip_and_name_bad_input() {
        let w = KeyWindows::Recorded(vec![("a1".into(), 0), ("b2".into(), 17)]);
        assert_eq!(w.to_text().as_deref(), Some("a1:0,b2:17"));
        assert_eq!(KeyWindows::parse("a1:0,b2:17").unwrap(), w);
        assert_eq!(w.until("a1"), Some(17));
        assert_eq!(w.until("b2"), None, "the last key: no bound");
        assert_eq!(w.until("zz"), Some(0), "never recorded: nowhere");
        assert_eq!(KeyWindows::parse("").unwrap(), KeyWindows::Recorded(vec![]));
        let none = KeyWindows::Recorded(vec![]);
        assert_eq!(KeyWindows::parse(&none.to_text().unwrap()).unwrap(), none);
        assert_eq!(KeyWindows::Unrecorded.to_text(), None);
        assert_eq!(KeyWindows::Unrecorded.until("a1"), None);
        assert!(
            KeyWindows::parse("a1")
                .unwrap_err()
                .contains("`<key id>:<seq>`")
        );
        assert!(KeyWindows::parse("a1:x").unwrap_err().contains("not a seq"));
    }

    #[test]
    fn store_forged_or_unsigned_controller_records_are_refused() {
        let s = signer(1);
        let v = s.verifier();
        // Written with a database credential: chained correctly, but unsigned.
        let forged = RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"}))
            .seal(&Head::EMPTY)
            .unwrap();
        let e = v
            .check("r", std::slice::from_ref(&forged), &SignatureRules::STRICT)
            .unwrap_err();
        assert!(
            e.to_string().contains("not signed by the controller"),
            "{e}"
        );
        // Signed by another key, under its own id or claiming ours.
        let other = signer(2)
            .seal(
                "r",
                RecordDraft::new(StepKind::RunFinished, json!({})),
                &Head::EMPTY,
            )
            .unwrap();
        assert!(
            v.check("r", std::slice::from_ref(&other), &SignatureRules::STRICT)
                .is_err()
        );
        let mut claimed = other.clone();
        let sig = claimed.payload[SIGNATURE_FIELD]
            .as_str()
            .unwrap()
            .to_string();
        let forged_id = format!("v2:{}:{}", s.key_id(), sig.rsplit(':').next().unwrap());
        claimed.payload[SIGNATURE_FIELD] = json!(forged_id);
        claimed.hash = claimed.compute_hash();
        let e = v
            .check("r", &[claimed], &SignatureRules::STRICT)
            .unwrap_err();
        assert!(e.to_string().contains("does not verify"), "{e}");
        // A signed decision whose verdict was changed (and re-hashed).
        let mut d = s
            .seal(
                "r",
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Reject"})),
                &Head::EMPTY,
            )
            .unwrap();
        d.payload["verdict"] = json!("Approve");
        d.hash = d.compute_hash();
        assert!(v.check("r", &[d], &SignatureRules::STRICT).is_err());
        assert!(RecordVerifier::from_hex("abcd").is_err());
        assert!(RecordVerifier::from_hex("").is_err());
        // Records before `signedFrom` predate signing: kept as they were.
        let rules = SignatureRules {
            signed_from: 1,
            bound_from: 1,
            ..SignatureRules::STRICT
        };
        v.check("r", &[forged], &rules).unwrap();
    }
}
