//! Forks (DESIGN.md "Forks"): a run that begins with its parent's verified
//! records `0..=seq` and goes on live from there.
//!
//! The fork's log holds the parent's records `0..=seq` at the same seqs,
//! their payloads unchanged (only a controller record's signature is made
//! again, for the fork's uid: a v2 signature names its run), then the
//! controller's `Forked` record at `seq + 1`. Same seqs keep every seq a
//! record names (`modelCallSeq`, `intentSeq`, `requestSeq`, `throughSeq`)
//! right, so replay reads the prefix as a resumed run's: nothing recorded is
//! asked or called again, an intent copied without its result is recovered
//! with its recorded key, and a call proposed in the prefix but first
//! intended in the fork gets the fork's key (keys derive from the run uid).
//! A decision copied in the prefix was given to the parent: it authorizes
//! no effect that is new in the fork (the fork asks its own approvers;
//! `crate::replay::RunState::authority_from`).

use std::time::Duration;

use crate::replay::Entry;
use crate::runlog::records::{Forked, PrefixUsage, Replaced, VersionChanged};
use crate::store::{
    Head, Record, RecordDraft, RecordSigner, RecordVerifier, SIGNATURE_FIELD, SignatureRules,
    StepKind, StepStore, StoreError, check_anchor,
};

/// Where a fork begins: the parent, the seq of its last record copied, who
/// forked, and the agent it goes on with.
#[derive(Clone, Debug, PartialEq)]
pub struct ForkPoint {
    pub parent_uid: String,
    pub parent_name: String,
    pub seq: u64,
    pub requester: Option<String>,
    /// `spec.forkOf.agent`: recorded as a `VersionChanged` right after
    /// `Forked`, so the rest runs on it; `None` keeps the parent's agent in
    /// force at `seq`.
    pub agent: Option<VersionChanged>,
    /// A replay test's recorded calls (`spec.testOf`): the fork calls no
    /// tool and raises no approval (`crate::sandbox`).
    pub test: Option<crate::runlog::records::Sandbox>,
    /// `spec.forkOf.budget`: what the fork's budgets count.
    pub budget: crate::api::ForkBudget,
    /// `spec.forkOf.replace`: a copied record replaced.
    pub replace: Option<crate::api::ForkReplace>,
}

/// Why a fork's prefix was not copied.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The parent's chain or signatures do not verify: nothing is copied.
    #[error("the parent's log does not verify, so nothing of it is copied: {0}")]
    ParentUnverified(StoreError),
    #[error("spec.forkOf.seq: {seq} is past the parent's last record ({last})")]
    PastEnd { seq: u64, last: u64 },
    #[error(
        "spec.forkOf.seq: record {seq} of the parent is its RunFinished: a fork there has nothing to go on with"
    )]
    AtEnd { seq: u64 },
    /// The fork's log holds records that are not this fork's copy.
    #[error("the fork's log already holds another record at seq {seq}: it is not this fork's copy")]
    Occupied { seq: u64 },
    /// `spec.forkOf.replace` names no record that may be replaced, or its
    /// replacement is not one (the message names the field).
    #[error("{0}")]
    Replace(String),
    #[error(transparent)]
    Store(StoreError),
}

/// The parent's log, verified as the controller reads any run's: its chain,
/// its anchored head (when the status holds one) and the controller's
/// signatures under the parent's rules. It is held whole: the controller's
/// start of a fork is to read it by pages within its read budget instead
/// (DESIGN.md §8), copying as it goes.
pub async fn read_parent(
    store: &dyn StepStore,
    verifier: &RecordVerifier,
    parent_uid: &str,
    anchor: Option<&Head>,
    rules: &SignatureRules,
) -> Result<Vec<Record>, ForkError> {
    let unverified = |e: StoreError| match e {
        e @ StoreError::ChainBroken { .. } => ForkError::ParentUnverified(e),
        e => ForkError::Store(e),
    };
    let records = store
        .read_verified(parent_uid, None)
        .await
        .map_err(unverified)?;
    if let Some(anchor) = anchor {
        check_anchor(parent_uid, &records, anchor).map_err(unverified)?;
    }
    verifier
        .check(parent_uid, &records, rules)
        .map_err(unverified)?;
    Ok(records)
}

/// The fork's first records, sealed for `fork_uid`: the parent's `0..=seq`
/// copied, then `Forked`, then the `VersionChanged` to `point.agent`. Pure, and deterministic
/// (Ed25519 signs deterministically): a copy cut short by a crash is
/// written again byte for byte.
pub fn plan(
    signer: &RecordSigner,
    fork_uid: &str,
    parent: &[Record],
    point: &ForkPoint,
    writer: &str,
) -> Result<Vec<Record>, ForkError> {
    let last = parent.len().saturating_sub(1) as u64;
    let Some((i, at)) = index(point.seq).and_then(|i| Some((i, parent.get(i)?))) else {
        return Err(ForkError::PastEnd {
            seq: point.seq,
            last,
        });
    };
    if at.kind == StepKind::RunFinished {
        return Err(ForkError::AtEnd { seq: point.seq });
    }
    let prefix = &parent[..=i];
    let replaced = match &point.replace {
        Some(r) => Some(replacement(prefix, r, point.requester.clone())?),
        None => None,
    };
    let mut out: Vec<Record> = Vec::with_capacity(prefix.len() + 2);
    let mut head = Head::EMPTY;
    for record in prefix {
        let draft = match &replaced {
            Some((seq, draft, _)) if *seq == record.seq => draft.clone(),
            _ => copied_draft(record),
        };
        let sealed = signer
            .seal(fork_uid, draft, &head)
            .map_err(ForkError::Store)?;
        head = sealed.head();
        out.push(sealed);
    }
    let forked = Entry::Forked(Forked {
        parent_uid: point.parent_uid.clone(),
        parent_name: point.parent_name.clone(),
        seq: point.seq,
        parent_hash: at.hash.to_hex(),
        requester: point.requester.clone(),
        test: point.test.clone(),
        budget: Some(point.budget),
        prefix_usage: (point.budget == crate::api::ForkBudget::FromFork)
            .then(|| prefix_usage(&out)),
        replaced: replaced.map(|(_, _, r)| r),
    });
    let changed = point.agent.clone().map(Entry::VersionChanged);
    for entry in std::iter::once(forked).chain(changed) {
        let mut draft = entry.draft();
        draft.worker = crate::store::Worker {
            pod: writer.to_string(),
            attempt: 0,
        };
        let sealed = signer
            .seal(fork_uid, draft, &head)
            .map_err(ForkError::Store)?;
        head = sealed.head();
        out.push(sealed);
    }
    Ok(out)
}

/// A seq (written by a user: `spec.forkOf.seq`, a `Forked` record's) as an
/// index of a log held in memory; `None` when no log in memory is that long
/// (a seq past `usize` on a 32-bit target is past every log's end, never
/// a truncated index).
pub fn index(seq: u64) -> Option<usize> {
    usize::try_from(seq).ok()
}

/// How many records `0..=seq` are, saturating: a seq of `u64::MAX` keeps
/// everything rather than overflowing.
pub fn through(seq: u64) -> usize {
    index(seq).map_or(usize::MAX, |i| i.saturating_add(1))
}

/// The fork's draft of the record `replace.seq` names, and what `Forked`
/// says of it: only a `ToolResult` (its outcome becomes `Ok(with)`) or a
/// `ModelCall` (its response becomes `with`) may be replaced.
fn replacement(
    prefix: &[Record],
    replace: &crate::api::ForkReplace,
    by: Option<String>,
) -> Result<(u64, RecordDraft, Replaced), ForkError> {
    let refuse = |m: String| ForkError::Replace(m);
    let Some(record) = index(replace.seq).and_then(|i| prefix.get(i)) else {
        return Err(refuse(format!(
            "spec.forkOf.replace.seq: {} is not a copied record (the fork keeps 0..={})",
            replace.seq,
            prefix.len().saturating_sub(1)
        )));
    };
    if replace.reason.trim().is_empty() {
        return Err(refuse(
            "spec.forkOf.replace.reason: required (recorded with the replacement)".into(),
        ));
    }
    let mut draft = copied_draft(record);
    match record.kind {
        StepKind::ToolResult => {
            draft.payload["outcome"] = serde_json::json!({"Ok": replace.with});
        }
        StepKind::ModelCall => {
            let response: crate::runlog::v1::ModelResponse =
                serde_json::from_value(replace.with.clone()).map_err(|e| {
                    refuse(format!(
                        "spec.forkOf.replace.with: record {} is a ModelCall, and this is no model answer: {e}",
                        replace.seq
                    ))
                })?;
            draft.payload["response"] =
                serde_json::to_value(response).expect("a model answer serializes");
        }
        other => {
            return Err(refuse(format!(
                "spec.forkOf.replace.seq: record {} is a {other}; only a ToolResult or a ModelCall may be replaced",
                replace.seq
            )));
        }
    }
    let replaced = Replaced {
        seq: record.seq,
        parent_hash: record.hash.to_hex(),
        by,
        reason: replace.reason.clone(),
    };
    Ok((record.seq, draft, replaced))
}

/// What the records of a fork's prefix spent, summed as replay sums them
/// (in order, so the sum is the same to the last bit).
pub fn prefix_usage(prefix: &[Record]) -> PrefixUsage {
    let mut spent = crate::replay::Spent::default();
    for r in prefix {
        if let Ok(step) = Entry::decode(r.seq, r.kind.as_str(), &r.payload) {
            spent.count(&step);
        }
    }
    PrefixUsage {
        input_tokens: spent.input_tokens,
        output_tokens: spent.output_tokens,
        cost_usd: spent.cost_usd,
    }
}

/// A parent's record as the fork's draft: everything hashed but the
/// controller's signature, which names the parent's uid.
fn copied_draft(record: &Record) -> RecordDraft {
    RecordDraft {
        format: record.format,
        kind: record.kind,
        payload: unsigned_payload(&record.payload),
        versions: record.versions.clone(),
        usage: record.usage,
        worker: record.worker.clone(),
    }
}

/// Whether `mine` is a copy of `theirs`: all but the signature, payloads
/// compared as hashed (canonical JSON: a cost of `0.0` held in memory and
/// the `0` read back from the store are the same number).
fn same_copy(mine: &Record, theirs: &Record) -> bool {
    let (mut a, mut b) = (copied_draft(mine), copied_draft(theirs));
    let payloads =
        crate::store::canonical_json(&a.payload) == crate::store::canonical_json(&b.payload);
    (a.payload, b.payload) = (serde_json::Value::Null, serde_json::Value::Null);
    payloads && a == b && mine.seq == theirs.seq
}

fn unsigned_payload(payload: &serde_json::Value) -> serde_json::Value {
    let mut payload = payload.clone();
    if let Some(p) = payload.as_object_mut() {
        p.remove(SIGNATURE_FIELD);
    }
    payload
}

/// How long the copy's lease lasts between renewals: renewed at a third of
/// it, so a copy of many records (or one paused longer than this) keeps it
/// while nobody else took it.
const COPY_LEASE: Duration = Duration::from_secs(10);

/// Copies the parent's verified prefix and `Forked` into the fork's log,
/// under the fork's lease (renewed while it copies), going on from what an
/// interrupted copy wrote. Returns the fork's head after its start.
pub async fn copy_prefix(
    store: &dyn StepStore,
    signer: &RecordSigner,
    fork_uid: &str,
    parent: &[Record],
    point: &ForkPoint,
    writer: &str,
) -> Result<Head, ForkError> {
    let planned = plan(signer, fork_uid, parent, point, writer)?;
    let written = store
        .read_verified(fork_uid, None)
        .await
        .map_err(ForkError::Store)?;
    if written.len() >= planned.len() {
        // The copy is complete (and the fork may have gone on).
        return Ok(written[planned.len() - 1].head());
    }
    let rest = rest_of_copy(signer, fork_uid, &planned, &written, through(point.seq))?;
    let mut lease = store
        .acquire(fork_uid, writer, COPY_LEASE)
        .await
        .map_err(ForkError::Store)?;
    let mut renewed = std::time::Instant::now();
    let mut result = Ok(());
    let mut head = Head::EMPTY;
    for record in &rest {
        if renewed.elapsed() >= COPY_LEASE / 3 {
            // A lapsed lease nobody took is revived; one taken over is
            // refused (StaleEpoch): the next reconcile goes on from there.
            match store.renew(&lease, COPY_LEASE).await {
                Ok(l) => (lease, renewed) = (l, std::time::Instant::now()),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        match store.append(fork_uid, lease.epoch, record).await {
            Ok(stored) => head = stored.head(),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let _ = store.release(&lease).await;
    // Anything refused mid-copy (another writer, a lease taken over) is
    // looked at again by the next attempt, which compares what stands.
    result.map_err(ForkError::Store)?;
    Ok(head)
}

/// The planned records still to write after `written`, chained from its
/// head. What stands must be the plan: the parent's records (the first
/// `parent_len`) exactly; the start's own in everything but the writer (another controller replica
/// may have begun the copy, so they are written again after it).
fn rest_of_copy(
    signer: &RecordSigner,
    fork_uid: &str,
    planned: &[Record],
    written: &[Record],
    parent_len: usize,
) -> Result<Vec<Record>, ForkError> {
    for (i, (have, want)) in written.iter().zip(planned).enumerate() {
        let same = have.hash == want.hash || (i >= parent_len && same_but_writer(have, want));
        if !same {
            return Err(ForkError::Occupied { seq: have.seq });
        }
    }
    let Some(last) = written.last() else {
        return Ok(planned.to_vec());
    };
    if last.hash == planned[written.len() - 1].hash {
        return Ok(planned[written.len()..].to_vec());
    }
    let mut head = last.head();
    let mut rest = Vec::with_capacity(planned.len() - written.len());
    for want in &planned[written.len()..] {
        let sealed = signer
            .seal(fork_uid, copied_draft(want), &head)
            .map_err(ForkError::Store)?;
        head = sealed.head();
        rest.push(sealed);
    }
    Ok(rest)
}

/// [`same_copy`], whoever wrote each.
fn same_but_writer(have: &Record, want: &Record) -> bool {
    let mut have = have.clone();
    have.worker = want.worker.clone();
    same_copy(&have, want)
}

/// Why a fork's log is not what its `Forked` record says it is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NotTheParents {
    #[error("record {seq}: the Forked record does not decode: {reason}")]
    Undecodable { seq: u64, reason: String },
    #[error(
        "record {seq}: Forked names the parent's seq {names}, but a fork's Forked record follows its copied prefix at seq {}", names + 1
    )]
    Misplaced { seq: u64, names: u64 },
    #[error("the fork begins after the parent's seq {seq}, but the parent's log has {len} records")]
    ParentTooShort { seq: u64, len: u64 },
    #[error(
        "Forked names the parent's hash {named} at seq {seq}, but the parent's record there hashes to {actual}"
    )]
    HashDiffers {
        seq: u64,
        named: String,
        actual: String,
    },
    #[error(
        "Forked says the copied prefix spent {named:?}, but the parent's records 0..={seq} spent {actual:?}"
    )]
    UsageDiffers {
        seq: u64,
        named: PrefixUsage,
        actual: PrefixUsage,
    },
    #[error(
        "Forked says record {seq} replaced the parent's record hashing to {named}, but the parent's record {seq} is not that one"
    )]
    ReplacedDiffers { seq: u64, named: String },
    #[error("record {seq}: the fork's {kind} is not the parent's record {seq} ({parent_kind})")]
    RecordDiffers {
        seq: u64,
        kind: StepKind,
        parent_kind: StepKind,
    },
}

/// Where a verified fork begins, as its `Forked` record says.
#[derive(Clone, Debug, PartialEq)]
pub struct Origin {
    /// Seq of the `Forked` record in the fork's log.
    pub at: u64,
    pub forked: Forked,
}

/// The `Forked` record of a log, if it is a fork's: the last one (a fork
/// of a fork holds its parent's, copied, before its own).
pub fn origin(records: &[Record]) -> Result<Option<Origin>, NotTheParents> {
    let Some(record) = records.iter().rev().find(|r| r.kind == StepKind::Forked) else {
        return Ok(None);
    };
    let forked: Forked =
        serde_json::from_value(record.payload.clone()).map_err(|e| NotTheParents::Undecodable {
            seq: record.seq,
            reason: e.to_string(),
        })?;
    if forked.seq.checked_add(1) != Some(record.seq) {
        return Err(NotTheParents::Misplaced {
            seq: record.seq,
            names: forked.seq,
        });
    }
    Ok(Some(Origin {
        at: record.seq,
        forked,
    }))
}

/// Checks a fork's copied prefix against its parent's verified log: every
/// record before `Forked` is the parent's record at the same seq (all but
/// the signature, which the fork's controller signed for the fork and its
/// own check covers), and the parent's hash at the fork's seq is the one
/// `Forked` names.
pub fn check_prefix(
    fork: &[Record],
    origin: &Origin,
    parent: &[Record],
) -> Result<(), NotTheParents> {
    let seq = origin.forked.seq;
    let Some((i, at)) = index(seq).and_then(|i| Some((i, parent.get(i)?))) else {
        return Err(NotTheParents::ParentTooShort {
            seq,
            len: parent.len() as u64,
        });
    };
    if at.hash.to_hex() != origin.forked.parent_hash {
        return Err(NotTheParents::HashDiffers {
            seq,
            named: origin.forked.parent_hash.clone(),
            actual: at.hash.to_hex(),
        });
    }
    let replaced = origin.forked.replaced.as_ref();
    if let Some(r) = replaced {
        let theirs = index(r.seq).and_then(|j| parent[..=i].get(j));
        match theirs {
            Some(theirs) if theirs.hash.to_hex() == r.parent_hash => {}
            _ => {
                return Err(NotTheParents::ReplacedDiffers {
                    seq: r.seq,
                    named: r.parent_hash.clone(),
                });
            }
        }
    }
    for (mine, theirs) in fork.iter().zip(&parent[..=i]) {
        if replaced.is_some_and(|r| r.seq == mine.seq) {
            // Replaced: the same kind at the same seq; its content is the
            // replacement `Forked` names.
            if mine.kind != theirs.kind || mine.seq != theirs.seq {
                return Err(NotTheParents::RecordDiffers {
                    seq: mine.seq,
                    kind: mine.kind,
                    parent_kind: theirs.kind,
                });
            }
            continue;
        }
        if !same_copy(mine, theirs) {
            return Err(NotTheParents::RecordDiffers {
                seq: mine.seq,
                kind: mine.kind,
                parent_kind: theirs.kind,
            });
        }
    }
    if let Some(named) = &origin.forked.prefix_usage {
        // The fork's own copy, checked record by record above (a replaced
        // model answer spends what its replacement says).
        let actual = prefix_usage(&fork[..fork.len().min(i + 1)]);
        if *named != actual {
            return Err(NotTheParents::UsageDiffers {
                seq,
                named: named.clone(),
                actual,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
