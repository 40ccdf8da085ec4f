//! What a run's status says about the signatures of its log, as every
//! verifier reads it (the controller, the step runner's Job settings, the
//! plugin, the console): from which seq controller records must be signed,
//! from which the signature binds run and seq, and where each of the
//! controller's keys signs. Only the controller writes these fields
//! (`controller::reconciler::status` writes them).

use super::{AgentRun, SigningKey};
use crate::store::KeyWindows;

/// From which record on the run's controller records must be signed: every
/// record of a run whose log this release anchored from the start, and the
/// records past `signedFrom` for a run an older, unsigning release began.
/// Such a run has no `signedFrom` until a status of this release fixes it
/// (the controller's status writer fixes it); until then nothing is checked (`u64::MAX`):
/// the earlier release's step worker, still running across the upgrade,
/// appends unsigned records of kinds that are the controller's now (its
/// `RunFinished`), as that release did.
pub fn signed_from(run: &AgentRun) -> u64 {
    match run.status.as_ref().and_then(|s| s.log.as_ref()) {
        None => 0,
        Some(log) => log.signed_from.unwrap_or(u64::MAX),
    }
}

/// From which record on the run's controller signatures must bind their
/// place (v2): as [`signed_from`], for the release that began binding
/// (`u64::MAX` until fixed: legacy v1 signatures of an earlier release's
/// run count until its status records the head it had then).
pub fn bound_from(run: &AgentRun) -> u64 {
    match run.status.as_ref().and_then(|s| s.log.as_ref()) {
        None => 0,
        Some(log) => log.bound_from.unwrap_or(u64::MAX),
    }
}

/// The signature rules of the run's log (see [`crate::store::SignatureRules`]).
pub fn signature_rules(run: &AgentRun) -> crate::store::SignatureRules {
    crate::store::SignatureRules {
        signed_from: signed_from(run),
        bound_from: bound_from(run),
        keys: key_windows(run),
    }
}

/// Where each of the controller's keys signs the run's records, as its
/// status records them: for a run with no status yet, none (a retired key
/// signed nothing for it); for an earlier release's run whose status
/// records no keys yet, unbounded (as that release had it).
pub fn key_windows(run: &AgentRun) -> KeyWindows {
    match run.status.as_ref().and_then(|s| s.log.as_ref()) {
        None => KeyWindows::Recorded(Vec::new()),
        Some(log) => match &log.signing_keys {
            None => KeyWindows::Unrecorded,
            Some(keys) => windows_of(keys),
        },
    }
}

/// `status.log.signingKeys` as the verifiers read it.
pub fn windows_of(keys: &[SigningKey]) -> KeyWindows {
    KeyWindows::Recorded(keys.iter().map(|k| (k.key.clone(), k.from)).collect())
}
