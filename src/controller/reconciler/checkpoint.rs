//! Where a controller that holds no replayed log of a long run resumes
//! reading it: `status.log.checkpoint`, signed by the controller.
//!
//! A controller keeps each run's replayed log in memory between reconciles,
//! compacted to the records the next step can depend on (from the latest
//! `ModelCall`). A controller that does not hold it (a restart, or a run
//! woken from waiting for a human) would read and verify the whole log
//! before deciding anything: a second or more at 100,000 records. The
//! checkpoint lets it decide from the window instead: the records from
//! `seq` on, chained from `hash`, plus the few records before it that stay
//! in force (read by seq, each checked against its signed hash) and what
//! the rest spent.
//!
//! Trust: the checkpoint is in the run's status, which only the controller
//! should write; the signature makes that a fact, not a hope (a forged or
//! stale-key checkpoint is ignored and the log read whole). A record it
//! names that no longer has its signed hash is a rewritten log. The whole
//! log is verified right after the decision (by the reconcile that hands
//! the run over to a Job, a human or its end), so a log rewritten in the
//! database is still caught when a controller that held no replayed log
//! looks at the run; and step runners verify the whole chain before acting
//! on any of it.

use crate::api::{LogCheckpoint, PinnedRecord};
use crate::replay::{Entry, RunState, Spent};
use crate::store::{
    Hash, Head, Record, RecordSigner, RecordVerifier, StepStore, StoreError, canonical_json,
};

use crate::controller::memory::Replayed;

/// Logs whose window starts earlier are read whole: cheap, and no checkpoint
/// to write (the default of `--checkpoint-min-records`) ...
pub const MIN_SEQ: u64 = 1_000;

/// ... unless the records before the window come to this many bytes: a
/// few large records cost what thousands of small ones do to read again.
pub const MIN_BYTES: usize = crate::store::PAGE_BYTES;

/// Domain separation of what is signed.
const CONTEXT: &[u8] = b"agentrun.dev/log-checkpoint/v1\0";

/// The checkpoint of `replayed` (compacted to its window), signed, if its
/// window starts at `min_seq` or later, or after [`MIN_BYTES`] of records,
/// or the run has one already. `previous` (the status's) is
/// returned as it is when nothing in it changed: most reconciles of a long
/// run sign nothing.
pub fn make(
    signer: &RecordSigner,
    uid: &str,
    replayed: &Replayed,
    min_seq: u64,
    previous: Option<&LogCheckpoint>,
) -> Option<LogCheckpoint> {
    let state = &replayed.state;
    let seq = state.base();
    let long = seq >= min_seq || replayed.released() >= MIN_BYTES || previous.is_some();
    if seq == 0 || !long {
        return None;
    }
    let hash = replayed.link_into(seq)?;
    let pinned = state
        .pinned_before(seq)
        .into_iter()
        .map(|s| {
            replayed.hash_of(s).map(|h| PinnedRecord {
                seq: s,
                hash: h.to_hex(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let spent = state.spent_before_base();
    let mut checkpoint = LogCheckpoint {
        seq,
        hash: hash.to_hex(),
        pinned,
        input_tokens: spent.input_tokens,
        output_tokens: spent.output_tokens,
        cost_usd: spent.cost_usd,
        signature: String::new(),
    };
    if let Some(previous) = previous {
        checkpoint.signature.clone_from(&previous.signature);
        if checkpoint == *previous {
            return Some(checkpoint);
        }
    }
    checkpoint.signature = signer.sign_message(CONTEXT, &message(uid, &checkpoint));
    Some(checkpoint)
}

/// What is signed: the run's uid and every field but the signature.
fn message(uid: &str, checkpoint: &LogCheckpoint) -> Vec<u8> {
    let mut unsigned = checkpoint.clone();
    unsigned.signature.clear();
    canonical_json(&serde_json::json!({"run": uid, "checkpoint": unsigned}))
}

/// Whether the checkpoint is this controller's, for this run, and no
/// further than the head anchored with it.
pub fn trusted(
    verifier: &RecordVerifier,
    uid: &str,
    checkpoint: &LogCheckpoint,
    anchored: &Head,
) -> bool {
    checkpoint.seq > 0
        && checkpoint.seq <= anchored.len
        && verifier.verify_message(CONTEXT, &message(uid, checkpoint), &checkpoint.signature)
}

/// A log resumed at its checkpoint.
pub struct Resumed {
    /// The state up to the checkpoint's `seq` (the window is still to be read).
    pub state: RunState,
    /// The checkpoint's head: record `seq - 1` and its hash.
    pub head: Head,
    /// The pinned records, as read (their hashes are the signed ones).
    pub records: Vec<Record>,
}

/// The state at the checkpoint, with its window still to be read: the
/// pinned records read by seq and checked against their signed hashes.
/// `Ok(None)`: unusable (malformed), read the log whole.
/// `Err(ChainBroken)`: a pinned record was rewritten.
pub async fn resume(
    store: &dyn StepStore,
    verifier: &RecordVerifier,
    uid: &str,
    checkpoint: &LogCheckpoint,
    rules: &crate::store::SignatureRules,
) -> Result<Option<Resumed>, StoreError> {
    let Ok(link) = checkpoint.hash.parse::<Hash>() else {
        return Ok(None);
    };
    let mut pinned = Vec::with_capacity(checkpoint.pinned.len());
    let mut records = Vec::with_capacity(checkpoint.pinned.len());
    for p in &checkpoint.pinned {
        let Ok(signed) = p.hash.parse::<Hash>() else {
            return Ok(None);
        };
        let record = store
            .read_range(uid, p.seq, Some(p.seq + 1))
            .await
            .map_err(StoreError::corrupt_as_broken)?
            .into_iter()
            .next();
        let broken = |reason: String| StoreError::ChainBroken {
            run: uid.to_string(),
            seq: p.seq,
            reason,
        };
        let Some(record) = record else {
            return Err(broken(format!(
                "record {} named by the checkpoint is gone: records were removed",
                p.seq
            )));
        };
        if record.hash != signed || record.compute_hash() != signed {
            return Err(broken(format!(
                "record {} does not have the hash the checkpoint signed ({}): the record was altered",
                p.seq, p.hash
            )));
        }
        verifier.check(uid, std::slice::from_ref(&record), rules)?;
        let Ok(step) = Entry::decode(record.seq, record.kind.as_str(), &record.payload) else {
            return Ok(None);
        };
        pinned.push((record.seq, step));
        records.push(record);
    }
    let spent = Spent {
        input_tokens: checkpoint.input_tokens,
        output_tokens: checkpoint.output_tokens,
        cost_usd: checkpoint.cost_usd,
    };
    Ok(Some(Resumed {
        state: RunState::resume_at(checkpoint.seq, pinned, spent),
        head: Head {
            len: checkpoint.seq,
            hash: link,
        },
        records,
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::replay::tests::{long_log, seen};
    use crate::store::{RecordDraft, SqliteStore};

    /// A SQLite store holding `log` as run `uid`, controller records signed.
    async fn stored(
        dir: &std::path::Path,
        signer: &RecordSigner,
        uid: &str,
        log: &[Entry],
    ) -> SqliteStore {
        let url = format!("sqlite://{}", dir.join("log.db").display());
        let store = SqliteStore::open(&url, &Default::default()).await.unwrap();
        let lease = store
            .acquire(uid, "w", Duration::from_secs(60))
            .await
            .unwrap();
        let mut head = Head::EMPTY;
        for step in log {
            let record = signer
                .seal(
                    uid,
                    RecordDraft::new(step.store_kind(), step.payload()),
                    &head,
                )
                .unwrap();
            head = store
                .append(uid, lease.epoch, &record)
                .await
                .unwrap()
                .head();
        }
        store
    }

    /// The log read whole and compacted, as a controller keeps it.
    async fn read_whole(store: &SqliteStore, uid: &str) -> Replayed {
        let mut whole = Replayed::empty();
        for r in store.read_verified(uid, None).await.unwrap() {
            let step = Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap();
            whole.apply(&r, step);
        }
        whole.compact();
        whole
    }

    /// A long log of run `uid` stored, read whole and checkpointed.
    async fn checkpointed(
        dir: &std::path::Path,
        uid: &str,
    ) -> (SqliteStore, RecordSigner, Replayed, LogCheckpoint) {
        let signer = RecordSigner::from_seed(&[7; 32]);
        let store = stored(dir, &signer, uid, &long_log(150)).await;
        let whole = read_whole(&store, uid).await;
        let cp = make(&signer, uid, &whole, MIN_SEQ, None).expect("a long log has a checkpoint");
        (store, signer, whole, cp)
    }

    #[tokio::test]
    async fn checkpoint_resumes_a_long_log_reading_its_window_only() {
        let dir = tempfile::tempdir().unwrap();
        let (store, signer, whole, cp) = checkpointed(dir.path(), "uid-long").await;
        assert!(cp.seq >= MIN_SEQ, "{cp:?}");
        assert!(trusted(&signer.verifier(), "uid-long", &cp, &whole.head));

        let resumed = resume(
            &store,
            &signer.verifier(),
            "uid-long",
            &cp,
            &crate::store::SignatureRules::STRICT,
        )
        .await
        .unwrap()
        .expect("resumed");
        assert!(
            resumed.records.len() <= 4,
            "{} pinned",
            resumed.records.len()
        );
        let mut replayed = Replayed::resumed(resumed.state, resumed.head, &resumed.records);
        let window = store
            .read_verified_after("uid-long", &replayed.head)
            .await
            .unwrap();
        assert!(window.len() < 10, "read {} records", window.len());
        for r in &window {
            let step = Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap();
            replayed.apply(r, step);
        }
        assert_eq!(replayed.head, whole.head);
        assert_eq!(seen(&replayed.state), seen(&whole.state));
        // And it writes the same checkpoint again.
        replayed.compact();
        assert_eq!(
            make(&signer, "uid-long", &replayed, MIN_SEQ, None),
            Some(cp.clone())
        );
        // Unchanged, the status's is kept; another window is signed anew.
        assert_eq!(
            make(&signer, "uid-long", &replayed, MIN_SEQ, Some(&cp)),
            Some(cp.clone())
        );
        let mut stale = cp.clone();
        stale.seq -= 7;
        assert_eq!(
            make(&signer, "uid-long", &replayed, MIN_SEQ, Some(&stale)),
            Some(cp)
        );
    }

    #[tokio::test]
    async fn checkpoint_is_trusted_only_as_this_controller_signed_it_for_this_run() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, signer, whole, cp) = checkpointed(dir.path(), "uid-a").await;
        let verifier = signer.verifier();
        assert!(trusted(&verifier, "uid-a", &cp, &whole.head));
        let other_key = RecordSigner::from_seed(&[8; 32]).verifier();
        assert!(
            !trusted(&other_key, "uid-a", &cp, &whole.head),
            "another key"
        );
        // After a rotation its key is retired: the log is read whole once
        // and a checkpoint of the new key made.
        let rotated = crate::store::RecordVerifier::new(vec![
            RecordSigner::from_seed(&[8; 32]).public_key(false),
            signer.public_key(true),
        ])
        .unwrap();
        assert!(
            !trusted(&rotated, "uid-a", &cp, &whole.head),
            "a retired key's"
        );
        assert!(
            !trusted(&verifier, "uid-b", &cp, &whole.head),
            "another run"
        );
        let short = Head {
            len: cp.seq - 1,
            hash: whole.head.hash,
        };
        assert!(
            !trusted(&verifier, "uid-a", &cp, &short),
            "past the anchored head"
        );
        let mut cheaper = cp.clone();
        cheaper.cost_usd = 0.0;
        assert!(
            !trusted(&verifier, "uid-a", &cheaper, &whole.head),
            "a budget reset"
        );
        let mut later = cp.clone();
        later.seq += 7;
        assert!(
            !trusted(&verifier, "uid-a", &later, &whole.head),
            "another window"
        );
    }

    #[tokio::test]
    async fn checkpoint_resume_refuses_a_pinned_record_rewritten_in_the_database() {
        let dir = tempfile::tempdir().unwrap();
        let (store, signer, _whole, cp) = checkpointed(dir.path(), "uid-t").await;
        // The run's input rewritten, its hash recomputed (the chain after it
        // would break, but a resume does not read it).
        let record = store
            .read_range("uid-t", 0, Some(1))
            .await
            .unwrap()
            .remove(0);
        let mut forged = record.clone();
        forged.payload["input"] = "wire the money elsewhere".into();
        let hash = forged.compute_hash();
        sqlx::query("DROP TRIGGER agentrun_steps_no_update")
            .execute(store.pool())
            .await
            .unwrap();
        sqlx::query("UPDATE agentrun_steps SET body = ?, hash = ? WHERE run = 'uid-t' AND seq = 0")
            .bind(String::from_utf8(forged.canonical_bytes()).unwrap())
            .bind(hash.0.to_vec())
            .execute(store.pool())
            .await
            .unwrap();
        let err = match resume(
            &store,
            &signer.verifier(),
            "uid-t",
            &cp,
            &crate::store::SignatureRules::STRICT,
        )
        .await
        {
            Err(e) => e,
            Ok(r) => panic!("resumed: {:?}", r.map(|r| r.head)),
        };
        assert!(
            matches!(&err, StoreError::ChainBroken { seq: 0, reason, .. } if reason.contains("altered")),
            "{err}"
        );
    }
}
