//! Controller signatures on the records only the controller writes
//! (`RunStarted`, `VersionChanged`, `ApprovalDecided`, `RunFinished`), so
//! that not even a holder of a database credential can forge one: the chain
//! alone is an unkeyed hash anyone can recompute.
//!
//! The signature is Ed25519 over the hash the record would have without it,
//! carried in the payload under [`SIGNATURE_FIELD`] (so it is chained like
//! the rest of the record and the storage format is unchanged). The step
//! runner gets the public key in its Job and checks every such record it
//! replays; the controller checks them on every read.

use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};

use super::{Hash, Head, Record, RecordDraft, StepKind, StoreError};

/// Payload field of a controller record that holds its signature (hex).
pub const SIGNATURE_FIELD: &str = "controllerSignature";
/// Domain separation of what is signed.
const CONTEXT: &[u8] = b"agentrun.dev/controller-record/v1\0";

/// Whether only the controller may write records of `kind`.
pub fn controller_only(kind: StepKind) -> bool {
    matches!(
        kind,
        StepKind::RunStarted
            | StepKind::VersionChanged
            | StepKind::ApprovalDecided
            | StepKind::RunFinished
    )
}

fn message(unsigned: &Hash) -> Vec<u8> {
    let mut m = CONTEXT.to_vec();
    m.extend_from_slice(&unsigned.0);
    m
}

/// The controller's signing key.
pub struct RecordSigner(Ed25519KeyPair);

impl std::fmt::Debug for RecordSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecordSigner(public {})", self.public_key_hex())
    }
}

impl RecordSigner {
    /// The key pair of a 32-byte seed (derived from the replicas' shared key).
    pub fn from_seed(seed: &[u8; 32]) -> RecordSigner {
        RecordSigner(Ed25519KeyPair::from_seed_unchecked(seed).expect("any 32 bytes are a seed"))
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.0.public_key().as_ref())
    }

    /// The verifier of this key's signatures.
    pub fn verifier(&self) -> RecordVerifier {
        RecordVerifier(self.0.public_key().as_ref().to_vec())
    }

    /// Signs `message` under `context` (domain separation from records and
    /// from other messages); the signature in hex.
    pub fn sign_message(&self, context: &[u8], message: &[u8]) -> String {
        let mut m = context.to_vec();
        m.extend_from_slice(message);
        hex::encode(self.0.sign(&m).as_ref())
    }

    /// Seals `draft` after `head` like [`RecordDraft::seal`], signed when its
    /// kind is a controller kind (its payload must then be an object).
    pub fn seal(&self, draft: RecordDraft, head: &Head) -> Result<Record, StoreError> {
        if !controller_only(draft.kind) {
            return draft.seal(head);
        }
        let unsigned = draft.clone().seal(head)?;
        let signature = self.0.sign(&message(&unsigned.hash));
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
            hex::encode(signature.as_ref()).into(),
        );
        draft.seal(head)
    }
}

/// Checks controller signatures with the controller's public key.
#[derive(Clone, Debug)]
pub struct RecordVerifier(Vec<u8>);

impl RecordVerifier {
    /// From the hex public key (`AGENTRUN_CONTROLLER_KEY` in a step Job).
    pub fn from_hex(s: &str) -> Result<RecordVerifier, String> {
        let key = hex::decode(s.trim()).map_err(|e| format!("controller public key: {e}"))?;
        if key.len() != 32 {
            return Err(format!(
                "controller public key: {} bytes, an Ed25519 key has 32",
                key.len()
            ));
        }
        Ok(RecordVerifier(key))
    }

    /// Whether `signature` (hex) is this key's over `message` under `context`.
    pub fn verify_message(&self, context: &[u8], message: &[u8], signature: &str) -> bool {
        let Ok(signature) = hex::decode(signature) else {
            return false;
        };
        let mut m = context.to_vec();
        m.extend_from_slice(message);
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(&m, &signature)
            .is_ok()
    }

    /// Every controller record of `records` from seq `signed_from` on must
    /// carry a valid signature (earlier ones predate signing: see
    /// `status.log.signedFrom`); otherwise [`StoreError::ChainBroken`]
    /// naming the first bad seq.
    pub fn check(&self, run: &str, records: &[Record], signed_from: u64) -> Result<(), StoreError> {
        for r in records
            .iter()
            .filter(|r| r.seq >= signed_from && controller_only(r.kind))
        {
            self.check_one(r)
                .map_err(|reason| StoreError::ChainBroken {
                    run: run.to_string(),
                    seq: r.seq,
                    reason,
                })?;
        }
        Ok(())
    }

    fn check_one(&self, r: &Record) -> Result<(), String> {
        let signature = r
            .payload
            .get(SIGNATURE_FIELD)
            .and_then(|s| s.as_str())
            .ok_or_else(|| format!("the {} record is not signed by the controller", r.kind))?;
        let signature = hex::decode(signature)
            .map_err(|_| format!("the {} record's signature is not hex", r.kind))?;
        let mut unsigned = r.clone();
        if let Some(p) = unsigned.payload.as_object_mut() {
            p.remove(SIGNATURE_FIELD);
        }
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(&message(&unsigned.compute_hash()), &signature)
            .map_err(|_| {
                format!(
                    "the {} record's signature does not verify: it was not written by the controller",
                    r.kind
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn signer(b: u8) -> RecordSigner {
        RecordSigner::from_seed(&[b; 32])
    }

    #[test]
    fn store_controller_records_are_signed_and_verify() {
        let s = signer(1);
        let started = s
            .seal(
                RecordDraft::new(StepKind::RunStarted, json!({"agent": {}})),
                &Head::EMPTY,
            )
            .unwrap();
        assert!(started.payload[SIGNATURE_FIELD].is_string());
        let obs = s
            .seal(
                RecordDraft::new(StepKind::Observation, json!({"text": "x"})),
                &started.head(),
            )
            .unwrap();
        assert!(
            obs.payload.get(SIGNATURE_FIELD).is_none(),
            "runner kinds are not signed"
        );
        let decided = s
            .seal(
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &obs.head(),
            )
            .unwrap();
        let log = vec![started, obs, decided];
        super::super::verify_chain("r", &log, None).unwrap();
        let v = RecordVerifier::from_hex(&s.public_key_hex()).unwrap();
        v.check("r", &log, 0).unwrap();
    }

    #[test]
    fn store_forged_or_unsigned_controller_records_are_refused() {
        let s = signer(1);
        let v = s.verifier();
        // Written with a database credential: chained correctly, but unsigned.
        let forged = RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"}))
            .seal(&Head::EMPTY)
            .unwrap();
        let e = v.check("r", std::slice::from_ref(&forged), 0).unwrap_err();
        assert!(
            e.to_string().contains("not signed by the controller"),
            "{e}"
        );
        // Signed by another key.
        let other = signer(2)
            .seal(
                RecordDraft::new(StepKind::RunFinished, json!({})),
                &Head::EMPTY,
            )
            .unwrap();
        let e = v.check("r", &[other], 0).unwrap_err();
        assert!(e.to_string().contains("does not verify"), "{e}");
        // A signed decision whose verdict was changed (and re-hashed).
        let mut d = s
            .seal(
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Reject"})),
                &Head::EMPTY,
            )
            .unwrap();
        d.payload["verdict"] = json!("Approve");
        d.hash = d.compute_hash();
        assert!(v.check("r", &[d], 0).is_err());
        assert!(RecordVerifier::from_hex("abcd").is_err());
        // Records before `signedFrom` predate signing: kept as they were.
        v.check("r", &[forged], 1).unwrap();
    }
}
