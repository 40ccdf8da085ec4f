//! `verify` on a fork: its copied prefix against its parent's verified
//! log, back to a run that is no fork.

use std::collections::BTreeMap;

use super::*;
use crate::fork::{ForkPoint, plan};

/// Runs by name: their uid and their log.
struct Known(BTreeMap<String, (String, Vec<Record>)>);

impl Parents for Known {
    async fn read(&self, name: &str) -> Result<(String, Read), LogError> {
        let (uid, records) = self.0.get(name).expect("a known run").clone();
        let length = records.len() as u64;
        let head = records.last().map(|r| r.hash.to_hex());
        let mut run = agent_run_at(head, length, "Running");
        run.metadata.uid = Some(uid.clone());
        let trust = Trust::of_run(&run).unwrap();
        let (records, verdict) = check::judge(&uid, &stored(&records), keys(), &trust).unwrap();
        Ok((uid, Read { records, verdict }))
    }
}

/// The fork `uid` of `parent` (named `parent_name`) after its seq `seq`.
fn fork_of(
    parent: &[Record],
    parent_uid: &str,
    parent_name: &str,
    uid: &str,
    seq: u64,
) -> Vec<Record> {
    let point = ForkPoint {
        parent_uid: parent_uid.into(),
        parent_name: parent_name.into(),
        seq,
        requester: Some("alice".into()),
        agent: None,
        test: None,
        budget: Default::default(),
        replace: None,
    };
    plan(&signer(), uid, parent, &point, "controller").unwrap()
}

/// A parent `p` (the root, [`UID`]), its fork `f` after seq 1, and `g`, a
/// fork of `f` after its seq 2 (its own Forked record).
fn family() -> (Vec<Record>, Vec<Record>, Vec<Record>) {
    let p = chain(5);
    let f = fork_of(&p, UID, "p", "uid-f", 1);
    let g = fork_of(&f, "uid-f", "f", "uid-g", 2);
    (p, f, g)
}

fn known(runs: &[(&str, &str, &[Record])]) -> Known {
    Known(
        runs.iter()
            .map(|(name, uid, records)| (name.to_string(), (uid.to_string(), records.to_vec())))
            .collect(),
    )
}

async fn verify(
    parents: &Known,
    run: &str,
    records: Vec<Record>,
) -> (Result<(), LogError>, String) {
    let mut out = Vec::new();
    let result = verify_parents(parents, run, records, &mut out).await;
    (result, text(&out))
}

#[tokio::test]
async fn a_fork_of_a_fork_verifies_back_to_the_root_and_says_where_each_begins() {
    let (p, f, g) = family();
    let parents = known(&[("p", UID, &p), ("f", "uid-f", &f)]);
    let (result, out) = verify(&parents, "g", g).await;
    result.map_err(|e| format!("{e}: {out}")).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "fork: g begins at seq 3 after the parent f's seq 2, forked by alice",
            &format!(
                "ok: g's records 0..=2 are f's, whose hash at seq 2 is {}",
                f[2].hash
            ),
            "fork: f begins at seq 2 after the parent p's seq 1, forked by alice",
            &format!(
                "ok: f's records 0..=1 are p's, whose hash at seq 1 is {}",
                p[1].hash
            ),
        ]
    );
}

#[tokio::test]
async fn a_run_that_is_no_fork_prints_nothing_more() {
    let (result, out) = verify(&known(&[]), "p", chain(4)).await;
    result.unwrap();
    assert_eq!(out, "");
}

#[tokio::test]
async fn a_parent_rewritten_before_the_fork_point_fails_the_fork() {
    let (mut p, f, _) = family();
    // The parent's record 1 and everything after it rewritten and
    // re-signed: the parent verifies alone, but is no longer what was copied.
    let mut head = p[0].head();
    let mut rewritten = vec![p[0].clone()];
    for r in &p[1..] {
        let mut draft = RecordDraft::new(r.kind, r.payload.clone());
        if r.seq == 1 {
            draft.payload["tool"] = "refund".into();
        }
        if let Some(o) = draft.payload.as_object_mut() {
            o.remove(crate::store::SIGNATURE_FIELD);
        }
        draft.worker = r.worker.clone();
        let sealed = signer().seal(UID, draft, &head).unwrap();
        head = sealed.head();
        rewritten.push(sealed);
    }
    p = rewritten;
    let parents = known(&[("p", UID, &p)]);
    let (result, out) = verify(&parents, "f", f).await;
    assert!(matches!(result, Err(LogError::VerifyFailed { .. })));
    assert!(
        out.contains("FAILED: run f's copied prefix: Forked names the parent's hash"),
        "{out}"
    );
}

#[tokio::test]
async fn a_parent_whose_name_now_holds_another_run_fails_the_fork() {
    let (p, f, _) = family();
    let parents = known(&[("p", "uid-of-a-new-p", &p)]);
    let (result, out) = verify(&parents, "f", f).await;
    assert!(result.is_err());
    assert!(out.contains("the parent is gone"), "{out}");
}

#[tokio::test]
async fn a_copied_record_altered_in_the_fork_is_named() {
    let (p, mut f, _) = family();
    // Record 1 of the fork altered (its broken chain is what `verify`
    // reports first; this is what the prefix check adds).
    f[1].payload["tool"] = "refund".into();
    let parents = known(&[("p", UID, &p)]);
    let (result, out) = verify(&parents, "f", f).await;
    assert!(result.is_err());
    assert!(
        out.contains("FAILED: run f's copied prefix: record 1: the fork's ToolIntent is not the parent's record 1"),
        "{out}"
    );
}
