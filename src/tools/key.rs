//! Idempotency keys and the tool schema hash.

use serde::Serialize;
use sha2::{Digest, Sha256};

use super::ToolDef;

/// Domain separation prefix: a key can never collide with another sha256 the
/// project computes over similar inputs.
const KEY_DOMAIN: &[u8] = b"agentrun.dev/idempotency-key/v1\0";

/// The idempotency key of one proposed tool call (DESIGN.md section 4):
/// `sha256(run uid, seq of the proposing ModelCall, call index)`, hex encoded.
///
/// The encoding is unambiguous: a domain prefix, the run uid's length as a
/// big-endian u64 followed by its bytes, then the two numbers as big-endian
/// u64. It depends only on the run and the step, never on the worker, so
/// every attempt at the same call sends the same key.
pub fn idempotency_key(run_uid: &str, model_call_seq: u64, call_index: usize) -> String {
    let mut hasher = Sha256::new();
    hasher.update(KEY_DOMAIN);
    hasher.update((run_uid.len() as u64).to_be_bytes());
    hasher.update(run_uid.as_bytes());
    hasher.update(model_call_seq.to_be_bytes());
    hasher.update((call_index as u64).to_be_bytes());
    hex::encode(hasher.finalize())
}

/// sha256 (hex) of the canonical JSON (RFC 8785) of the tool definitions the
/// model is shown, in the order given. Pinned in `RunStarted` so a change of
/// any tool's name, description or schema is visible as a version change.
pub fn schema_hash(defs: &[ToolDef]) -> String {
    hex::encode(Sha256::digest(canonical_json(&defs).as_bytes()))
}

/// RFC 8785 canonical JSON of a value.
pub(crate) fn canonical_json<T: Serialize>(value: &T) -> String {
    // Serialising plain JSON values (no non-string map keys, no NaN) cannot fail.
    serde_json_canonicalizer::to_string(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_is_stable() {
        // A fixed value: changing the derivation would make resumed runs send
        // different keys than their first attempt did.
        let key = idempotency_key("7f0c2a5e-run", 3, 1);
        assert_eq!(key.len(), 64);
        assert_eq!(key, idempotency_key("7f0c2a5e-run", 3, 1));
        assert_eq!(key, expected_key_for_test());
        assert_eq!(
            key,
            "c27e6144f0fcef67e2d7331ba7190956270ef477e7c3f9d70b7c629bc5424d79"
        );
    }

    /// The derivation written out independently of `idempotency_key`.
    fn expected_key_for_test() -> String {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"agentrun.dev/idempotency-key/v1\0");
        bytes.extend_from_slice(&12u64.to_be_bytes());
        bytes.extend_from_slice(b"7f0c2a5e-run");
        bytes.extend_from_slice(&3u64.to_be_bytes());
        bytes.extend_from_slice(&1u64.to_be_bytes());
        hex::encode(Sha256::digest(&bytes))
    }

    #[test]
    fn key_differs_per_run_seq_and_index() {
        let base = idempotency_key("run-a", 5, 0);
        assert_ne!(base, idempotency_key("run-b", 5, 0));
        assert_ne!(base, idempotency_key("run-a", 6, 0));
        assert_ne!(base, idempotency_key("run-a", 5, 1));
        // No ambiguity between the uid and the numbers.
        assert_ne!(
            idempotency_key("run-1", 2, 0),
            idempotency_key("run-12", 0, 0)
        );
        assert_ne!(idempotency_key("a", 1, 2), idempotency_key("a", 2, 1));
    }

    #[test]
    fn schema_hash_depends_on_every_field_and_not_on_key_order() {
        let def = |desc: &str, schema| ToolDef {
            name: "lookup".into(),
            description: desc.into(),
            input_schema: schema,
        };
        let a = schema_hash(&[def("find", json!({"type": "object", "required": ["id"]}))]);
        let same = schema_hash(&[def(
            "find",
            serde_json::from_str(r#"{"required": ["id"], "type": "object"}"#).unwrap(),
        )]);
        assert_eq!(a, same);
        assert_ne!(
            a,
            schema_hash(&[def("find!", json!({"type": "object", "required": ["id"]}))])
        );
        assert_ne!(a, schema_hash(&[def("find", json!({"type": "object"}))]));
        assert_eq!(a.len(), 64);
    }
}
