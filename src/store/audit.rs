//! An auditor's verification of one run's log: the hash chain (against the
//! head the run's status recorded) and, record by record, what each
//! controller signature is worth under the keys the controller publishes.
//! Pure: `kubectl agentrun verify` reads the records, the run and the keys,
//! and prints this.

use super::{
    Hash, Head, Record, RecordVerifier, SignatureCheck, SignatureRules, StepKind, StoreError,
};

/// One controller record's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedRecord {
    pub seq: u64,
    pub kind: StepKind,
    pub check: SignatureCheck,
}

/// The verdict on a whole log.
#[derive(Debug)]
pub struct Audit {
    /// The chain's head, or where it broke.
    pub chain: Result<Head, StoreError>,
    /// Every controller record, in order.
    pub signed: Vec<SignedRecord>,
}

impl Audit {
    /// Checks `records` of run `run` (its uid).
    pub fn of(
        run: &str,
        records: &[Record],
        expected_head: Option<&Hash>,
        keys: &RecordVerifier,
        rules: &SignatureRules,
    ) -> Audit {
        let chain = super::verify_chain(run, records, expected_head);
        let signed = records
            .iter()
            .filter_map(|r| {
                keys.classify(run, r, rules).map(|check| SignedRecord {
                    seq: r.seq,
                    kind: r.kind,
                    check,
                })
            })
            .collect();
        Audit { chain, signed }
    }

    /// The controller records that may not be acted on.
    pub fn refused(&self) -> impl Iterator<Item = &SignedRecord> {
        self.signed.iter().filter(|s| !s.check.accepted())
    }

    /// Whether the log verifies: chain intact and every signature accepted.
    pub fn ok(&self) -> bool {
        self.chain.is_ok() && self.refused().next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{RecordDraft, RecordSigner};
    use serde_json::json;

    #[test]
    fn store_audit_names_each_record_moved_from_another_run() {
        let s = RecordSigner::from_seed(&[3; 32]);
        let started = s
            .seal(
                "a",
                RecordDraft::new(StepKind::RunStarted, json!({})),
                &Head::EMPTY,
            )
            .unwrap();
        let call = RecordDraft::new(StepKind::ModelCall, json!({}))
            .seal(&started.head())
            .unwrap();
        let decided = s
            .seal(
                "a",
                RecordDraft::new(StepKind::ApprovalDecided, json!({"verdict": "Approve"})),
                &call.head(),
            )
            .unwrap();
        let log = [started, call, decided];
        let head = log[2].hash;
        let own = Audit::of(
            "a",
            &log,
            Some(&head),
            &s.verifier(),
            &SignatureRules::STRICT,
        );
        assert!(own.ok(), "{own:?}");
        assert_eq!(own.signed.len(), 2, "runner records are not listed");
        let moved = Audit::of(
            "b",
            &log,
            Some(&head),
            &s.verifier(),
            &SignatureRules::STRICT,
        );
        assert!(moved.chain.is_ok(), "the copied chain itself is intact");
        let refused: Vec<u64> = moved.refused().map(|r| r.seq).collect();
        assert_eq!(refused, [0, 2]);
        assert!(!moved.ok());
    }
}
