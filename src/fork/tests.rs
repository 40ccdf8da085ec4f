//! A fork's log, in process (SQLite): the copy replays to the parent's
//! `Next` at every seq of a canned run, and is refused when the parent's
//! log does not verify.

mod authority;

use std::time::Duration;

use super::*;
use crate::replay::RunState;
use crate::replay::tests::long_log;
use crate::store::{SignatureRules, SqliteStore};

const PARENT: &str = "parent-uid";
const CONTROLLER: &str = "controller-0";

fn signer() -> RecordSigner {
    RecordSigner::from_seed(&[7; 32])
}

async fn store(dir: &std::path::Path) -> SqliteStore {
    let url = format!("sqlite://{}", dir.join("log.db").display());
    SqliteStore::open(&url, &Default::default()).await.unwrap()
}

/// What a fork at the end of `parent` does next: the parent's `Next`, but
/// for a call the parent was approved to make, or waited to have decided:
/// that approval (or request) is the parent's, and the fork's gate asks
/// again under the fork's own policy (`authority::*`).
fn forks_next(parent: &RunState) -> crate::replay::Next {
    use crate::replay::Next;
    let request = match parent.next() {
        Next::Approved { request, .. } => *request,
        Next::AwaitApproval { request_seq } => match parent.entry(request_seq) {
            Some(Entry::ApprovalRequested(r))
                if r.kind == crate::runlog::v1::ApprovalKind::Call =>
            {
                r.clone()
            }
            _ => return parent.next(),
        },
        theirs => return theirs,
    };
    let Some(Entry::ModelCall(m)) = parent.entry(request.model_call_seq) else {
        unreachable!()
    };
    Next::RecordIntent {
        model_call_seq: request.model_call_seq,
        call_index: request.call_index,
        call: m.response.tool_calls[request.call_index].clone().into(),
    }
}

/// `entries` appended to `run`'s log, the controller's records signed.
async fn write_log(store: &SqliteStore, run: &str, entries: &[Entry]) -> Vec<Record> {
    let lease = store
        .acquire(run, "w", Duration::from_secs(60))
        .await
        .unwrap();
    let mut head = Head::EMPTY;
    let mut out = Vec::new();
    for entry in entries {
        let record = signer().seal(run, entry.draft(), &head).unwrap();
        head = store
            .append(run, lease.epoch, &record)
            .await
            .unwrap()
            .head();
        out.push(record);
    }
    store.release(&lease).await.unwrap();
    out
}

fn point(parent_uid: &str, seq: u64) -> ForkPoint {
    ForkPoint {
        parent_uid: parent_uid.into(),
        parent_name: "refund-1".into(),
        seq,
        requester: Some("alice".into()),
        agent: None,
        test: None,
        budget: Default::default(),
        replace: None,
    }
}

/// Reads, verifies and copies, as the controller does before a fork's first step.
async fn fork(
    store: &SqliteStore,
    parent_uid: &str,
    fork_uid: &str,
    seq: u64,
) -> Result<Head, ForkError> {
    let parent = read_parent(
        store,
        &signer().verifier(),
        parent_uid,
        None,
        &SignatureRules::STRICT,
    )
    .await?;
    copy_prefix(
        store,
        &signer(),
        fork_uid,
        &parent,
        &point(parent_uid, seq),
        CONTROLLER,
    )
    .await
}

fn decode(records: &[Record]) -> Vec<Entry> {
    records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect()
}

#[tokio::test]
async fn a_fork_replays_to_the_parents_next_at_every_seq() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(3);
    let parent = write_log(&store, PARENT, &log).await;
    for seq in 0..log.len() as u64 {
        let uid = format!("fork-{seq}");
        fork(&store, PARENT, &uid, seq).await.unwrap();
        let records = store.read_verified(&uid, None).await.unwrap();
        assert_eq!(records.len() as u64, seq + 2, "the prefix and Forked");
        // The fork's controller records verify for the fork, strictly.
        signer()
            .verifier()
            .check(&uid, &records, &SignatureRules::STRICT)
            .unwrap();
        let origin = origin(&records)
            .unwrap()
            .expect("a fork's log names its parent");
        assert_eq!(origin.at, seq + 1);
        assert_eq!(
            origin.forked.parent_hash,
            parent[seq as usize].hash.to_hex()
        );
        assert_eq!(origin.forked.requester.as_deref(), Some("alice"));
        check_prefix(&records, &origin, &parent).unwrap();

        let forked = RunState::replay(decode(&records));
        let resumed = RunState::replay(log[..=seq as usize].to_vec());
        let expected = forks_next(&resumed);
        assert_eq!(forked.next(), expected, "at seq {seq}");
        assert_eq!(forked.spent, resumed.spent, "at seq {seq}");
        assert_eq!(forked.snapshot, resumed.snapshot, "at seq {seq}");
        let awaits = matches!(expected, crate::replay::Next::AwaitApproval { .. });
        assert_eq!(
            forked.pending_approval().map(|(s, r)| (s, r.clone())),
            resumed
                .pending_approval()
                .map(|(s, r)| (s, r.clone()))
                .filter(|_| awaits),
            "at seq {seq}"
        );
        // And so does a controller's compacted state of it.
        let mut compacted = RunState::default();
        for entry in decode(&records) {
            compacted.apply(entry);
            compacted.compact();
        }
        assert_eq!(compacted.next(), expected, "compacted, at seq {seq}");
    }
}

#[tokio::test]
async fn a_fork_mid_call_recovers_the_intent_with_its_recorded_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    write_log(&store, PARENT, &log).await;
    let intent_seq = log
        .iter()
        .position(|e| matches!(e, Entry::ToolIntent(_)))
        .unwrap() as u64;
    fork(&store, PARENT, "fork", intent_seq).await.unwrap();
    let records = store.read_verified("fork", None).await.unwrap();
    match RunState::replay(decode(&records)).next() {
        crate::replay::Next::ExecuteTool {
            intent_seq: s,
            intent,
        } => {
            assert_eq!(s, intent_seq);
            let Entry::ToolIntent(recorded) = &log[intent_seq as usize] else {
                unreachable!()
            };
            assert_eq!(intent.key, recorded.key, "the parent's call, its key");
        }
        other => panic!("expected the open intent recovered, got {other:?}"),
    }
}

#[tokio::test]
async fn the_copy_is_refused_when_the_parents_chain_does_not_verify() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    // Record 1 rewritten in the database, its own hash made to match.
    let mut altered = parent[1].clone();
    altered.payload["cost_usd_note"] = "altered".into();
    sqlx::query("DROP TRIGGER agentrun_steps_no_update")
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE agentrun_steps SET body = ?, hash = ? WHERE run = ? AND seq = 1")
        .bind(String::from_utf8(altered.canonical_bytes()).unwrap())
        .bind(altered.compute_hash().0.to_vec())
        .bind(PARENT)
        .execute(store.pool())
        .await
        .unwrap();
    let err = fork(&store, PARENT, "fork", 3).await.unwrap_err();
    assert!(matches!(err, ForkError::ParentUnverified(_)), "{err}");
    assert!(
        store.read_all("fork").await.unwrap().is_empty(),
        "nothing copied"
    );
}

#[tokio::test]
async fn the_copy_is_refused_when_a_parents_controller_record_is_not_the_controllers() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    // Its RunStarted signed by a key the controller does not publish.
    let lease = store
        .acquire(PARENT, "w", Duration::from_secs(60))
        .await
        .unwrap();
    let mut head = Head::EMPTY;
    for (i, entry) in log.iter().enumerate() {
        let key = if i == 0 {
            RecordSigner::from_seed(&[9; 32])
        } else {
            signer()
        };
        let record = key.seal(PARENT, entry.draft(), &head).unwrap();
        head = store
            .append(PARENT, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    let err = fork(&store, PARENT, "fork", 2).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ForkError::ParentUnverified(StoreError::ChainBroken { seq: 0, .. })
        ),
        "{err}"
    );
    assert!(
        store.read_all("fork").await.unwrap().is_empty(),
        "nothing copied"
    );
}

#[tokio::test]
async fn a_fork_of_a_fork_checks_against_its_parent_and_the_parents_parent() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(2);
    let root = write_log(&store, PARENT, &log).await;
    fork(&store, PARENT, "child", 4).await.unwrap();
    let child = store.read_verified("child", None).await.unwrap();
    // The child goes on after its Forked record (seq 5)...
    let mut grown = decode(&child);
    grown.extend(log[5..9].iter().cloned());
    let child = write_log(&store, "child-grown", &grown).await;
    // ...and is forked again, past its own fork point.
    fork(&store, "child-grown", "grandchild", 7).await.unwrap();
    let grandchild = store.read_verified("grandchild", None).await.unwrap();
    let origin2 = origin(&grandchild).unwrap().unwrap();
    assert_eq!(origin2.forked.parent_uid, "child-grown");
    check_prefix(&grandchild, &origin2, &child).unwrap();
    let origin1 = origin(&child).unwrap().unwrap();
    assert_eq!(origin1.at, 5);
    check_prefix(&child, &origin1, &root).unwrap();
    // The grandchild's copy holds the child's Forked record; its own is
    // the last one.
    assert_eq!(grandchild[5].kind, StepKind::Forked);
    assert_eq!(origin2.at, 8);
    // It replays as the child did at seq 7.
    let forked = RunState::replay(decode(&grandchild));
    let resumed = RunState::replay(grown[..=7].to_vec());
    assert_eq!(forked.next(), resumed.next());
}

#[tokio::test]
async fn a_copied_record_that_differs_from_the_parents_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    fork(&store, PARENT, "fork", 3).await.unwrap();
    let mut records = store.read_verified("fork", None).await.unwrap();
    let origin = origin(&records).unwrap().unwrap();
    records[2].payload["arguments"] = serde_json::json!({"amount": 1});
    let err = check_prefix(&records, &origin, &parent).unwrap_err();
    assert!(err.to_string().starts_with("record 2:"), "{err}");
    let mut other = origin.clone();
    other.forked.parent_hash = parent[2].hash.to_hex();
    let err = check_prefix(&records, &other, &parent).unwrap_err();
    assert!(
        matches!(err, NotTheParents::HashDiffers { seq: 3, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn an_interrupted_copy_goes_on_and_a_foreign_log_is_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    let planned = plan(&signer(), "fork", &parent, &point(PARENT, 4), CONTROLLER).unwrap();
    // A controller that died after three records.
    let lease = store
        .acquire("fork", "w", Duration::from_secs(60))
        .await
        .unwrap();
    for record in &planned[..3] {
        store.append("fork", lease.epoch, record).await.unwrap();
    }
    store.release(&lease).await.unwrap();
    fork(&store, PARENT, "fork", 4).await.unwrap();
    let hashes = |records: &[Record]| records.iter().map(|r| r.hash).collect::<Vec<_>>();
    let written = store.read_verified("fork", None).await.unwrap();
    assert_eq!(hashes(&written), hashes(&planned));
    // Copying again changes nothing.
    fork(&store, PARENT, "fork", 4).await.unwrap();
    assert_eq!(store.read_all("fork").await.unwrap().len(), planned.len());
    // A log that holds something else is left alone.
    write_log(&store, "taken", &log[1..3]).await;
    let err = fork(&store, PARENT, "taken", 4).await.unwrap_err();
    assert!(matches!(err, ForkError::Occupied { seq: 0 }), "{err}");
}

#[tokio::test]
async fn a_copy_cut_at_every_record_is_finished_by_another_replica_into_a_fork_that_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    let seq = 4;
    let mut at = point(PARENT, seq);
    let resumed = RunState::replay(log[..=seq as usize].to_vec());
    at.agent = Some(VersionChanged {
        agent: crate::runlog::v1::AgentTemplate::default(),
        tools: vec![],
        mcp: Default::default(),
        from: Default::default(),
        to: Default::default(),
        container: None,
    });
    // Begun by replica 0, which died after `cut` records (its own
    // `Forked` among them from cut 6 on); replica 1 finishes it.
    let planned = plan(&signer(), "x", &parent, &at, "controller/replica-0").unwrap();
    for cut in 0..=planned.len() {
        let uid = format!("fork-cut-{cut}");
        let planned = plan(&signer(), &uid, &parent, &at, "controller/replica-0").unwrap();
        let lease = store
            .acquire(&uid, "w", Duration::from_secs(60))
            .await
            .unwrap();
        for record in &planned[..cut] {
            store.append(&uid, lease.epoch, record).await.unwrap();
        }
        store.release(&lease).await.unwrap();
        let head = copy_prefix(
            &store,
            &signer(),
            &uid,
            &parent,
            &at,
            "controller/replica-1",
        )
        .await
        .unwrap_or_else(|e| panic!("cut after {cut}: {e}"));
        let records = store.read_verified(&uid, None).await.unwrap();
        assert_eq!(head, records.last().unwrap().head(), "cut after {cut}");
        assert_eq!(
            records.len(),
            planned.len(),
            "cut after {cut}: the whole start, once"
        );
        signer()
            .verifier()
            .check(&uid, &records, &SignatureRules::STRICT)
            .unwrap();
        let origin = origin(&records).unwrap().unwrap();
        check_prefix(&records, &origin, &parent).unwrap();
        assert_eq!(records[seq as usize + 2].kind, StepKind::VersionChanged);
        let forked = RunState::replay(decode(&records));
        assert_eq!(forked.next(), forks_next(&resumed), "cut after {cut}");
    }
}

#[tokio::test]
async fn a_copy_while_another_holds_the_forks_lease_writes_nothing_and_is_retried_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    let planned = plan(&signer(), "fork", &parent, &point(PARENT, 4), CONTROLLER).unwrap();
    // Someone else holds the fork's lease (a step pod it never should
    // have): the copy does not write under it, and says so as a store
    // error (retried), never as a refusal of the fork.
    let other = store
        .acquire("fork", "intruder", Duration::from_secs(60))
        .await
        .unwrap();
    let err = fork(&store, PARENT, "fork", 4).await.unwrap_err();
    assert!(matches!(err, ForkError::Store(_)), "{err}");
    assert!(store.read_all("fork").await.unwrap().is_empty());
    store.release(&other).await.unwrap();
    fork(&store, PARENT, "fork", 4).await.unwrap();
    assert_eq!(store.read_all("fork").await.unwrap().len(), planned.len());
}

#[tokio::test]
async fn a_seq_past_the_parents_log_or_at_its_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let mut log = long_log(1);
    log.push(Entry::RunFinished(crate::runlog::records::RunFinished {
        outcome: crate::runlog::records::Outcome::Succeeded,
        result: Some("done".into()),
        error: None,
    }));
    write_log(&store, PARENT, &log).await;
    let last = log.len() as u64 - 1;
    let err = fork(&store, PARENT, "fork", last + 1).await.unwrap_err();
    assert!(
        err.to_string().starts_with("spec.forkOf.seq: ")
            && matches!(err, ForkError::PastEnd { .. }),
        "{err}"
    );
    let err = fork(&store, PARENT, "fork", last).await.unwrap_err();
    assert!(matches!(err, ForkError::AtEnd { .. }), "{err}");
    fork(&store, PARENT, "fork", last - 1).await.unwrap();
}

#[test]
fn a_step_pod_may_not_write_a_forked_record_and_it_is_the_controllers() {
    use crate::controller::servers::gateway::runner_may_write;
    assert!(!runner_may_write(StepKind::Forked));
    assert!(crate::store::controller_only(StepKind::Forked));
}

#[tokio::test]
async fn a_fork_with_another_agent_goes_on_with_it_from_the_fork_point() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    // After the lookup's result: the refund is still to be decided.
    let seq = 3;
    let resumed = RunState::replay(log[..=seq].to_vec());
    let mut agent = crate::runlog::v1::AgentTemplate::default();
    agent.prompt.version = "v2-stricter".into();
    let changed = crate::runlog::records::VersionChanged {
        agent,
        tools: vec![],
        mcp: Default::default(),
        from: resumed.snapshot.as_ref().unwrap().versions.clone(),
        to: crate::runlog::records::Versions {
            prompt_version: "v2-stricter".into(),
            ..Default::default()
        },
        container: None,
    };
    let mut at = point(PARENT, seq as u64);
    at.agent = Some(changed);
    let head = copy_prefix(&store, &signer(), "fork", &parent, &at, CONTROLLER)
        .await
        .unwrap();
    assert_eq!(
        head.len,
        seq as u64 + 3,
        "the prefix, Forked, VersionChanged"
    );
    let records = store.read_verified("fork", None).await.unwrap();
    signer()
        .verifier()
        .check("fork", &records, &SignatureRules::STRICT)
        .unwrap();
    assert_eq!(records[seq + 2].kind, StepKind::VersionChanged);
    let forked = RunState::replay(decode(&records));
    assert_eq!(forked.next(), resumed.next(), "the same call is next");
    let snapshot = forked.snapshot.as_ref().unwrap();
    let version = |a: &crate::api::AgentTemplate| a.prompt.as_ref().map(|p| p.version.clone());
    assert_eq!(version(&snapshot.agent).as_deref(), Some("v2-stricter"));
    assert_eq!(snapshot.versions.prompt_version, "v2-stricter");
    // What was recorded before the fork point was the parent's agent's.
    assert_eq!(
        version(forked.agent_at(seq as u64).unwrap()),
        version(resumed.agent_at(seq as u64).unwrap())
    );
    // The origin is still the Forked record, and the prefix the parent's.
    let origin = origin(&records).unwrap().unwrap();
    assert_eq!(origin.at, seq as u64 + 1);
    check_prefix(&records, &origin, &parent).unwrap();
}

#[test]
fn the_audit_trail_says_where_a_fork_begins_and_who_forked() {
    let line = crate::client::approvals::describe_entry(&Entry::Forked(Forked {
        parent_uid: PARENT.into(),
        parent_name: "refund-1".into(),
        seq: 3,
        parent_hash: "ab".repeat(32),
        requester: Some("alice".into()),
        test: None,
        budget: None,
        prefix_usage: None,
        replaced: None,
    }))
    .unwrap();
    assert_eq!(
        line,
        "forked from refund-1 (parent-uid) after its seq 3 (hash abababababab) by alice"
    );
    let line = crate::client::approvals::describe_entry(&Entry::Forked(Forked {
        parent_uid: PARENT.into(),
        parent_name: "refund-1".into(),
        seq: 3,
        parent_hash: "ab".repeat(32),
        requester: Some("alice".into()),
        budget: None,
        prefix_usage: None,
        replaced: Some(crate::runlog::records::Replaced {
            seq: 2,
            parent_hash: "cd".repeat(32),
            by: Some("alice".into()),
            reason: "what if it had shipped".into(),
        }),
        test: None,
    }))
    .unwrap();
    assert!(
        line.ends_with("by alice; record 2 replaced: what if it had shipped"),
        "{line}"
    );
}

#[tokio::test]
async fn a_parent_begun_before_binding_gives_a_fork_whose_controller_records_are_all_bound_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    // An earlier release's run: controller records signed v1 (bound to no
    // run), accepted only before its `boundFrom`.
    let lease = store
        .acquire(PARENT, "w", Duration::from_secs(60))
        .await
        .unwrap();
    let mut head = Head::EMPTY;
    for entry in &log {
        let record = if crate::store::controller_only(entry.store_kind()) {
            signer().seal_v1(entry.draft(), &head).unwrap()
        } else {
            entry.draft().seal(&head).unwrap()
        };
        head = store
            .append(PARENT, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    let legacy = SignatureRules {
        signed_from: 0,
        bound_from: log.len() as u64,
        keys: Default::default(),
    };
    let verifier = signer().verifier();
    let strict = read_parent(&store, &verifier, PARENT, None, &SignatureRules::STRICT).await;
    assert!(matches!(strict, Err(ForkError::ParentUnverified(_))));
    let parent = read_parent(&store, &verifier, PARENT, Some(&head), &legacy)
        .await
        .unwrap();
    let seq = 5;
    copy_prefix(
        &store,
        &signer(),
        "fork",
        &parent,
        &point(PARENT, seq),
        CONTROLLER,
    )
    .await
    .unwrap();
    let records = store.read_verified("fork", None).await.unwrap();
    // The fork is this release's run: every controller record v2, for it.
    verifier
        .check("fork", &records, &SignatureRules::STRICT)
        .unwrap();
    let origin = origin(&records).unwrap().unwrap();
    check_prefix(&records, &origin, &parent).unwrap();
}

#[tokio::test]
async fn a_seq_of_u64_max_is_past_the_end_everywhere_and_overflows_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(1);
    let parent = write_log(&store, PARENT, &log).await;
    let err = plan(
        &signer(),
        "fork",
        &parent,
        &point(PARENT, u64::MAX),
        CONTROLLER,
    )
    .unwrap_err();
    assert!(
        matches!(err, ForkError::PastEnd { seq: u64::MAX, .. }),
        "{err}"
    );
    // A Forked record naming u64::MAX cannot sit after its prefix...
    fork(&store, PARENT, "fork", 3).await.unwrap();
    let records = store.read_verified("fork", None).await.unwrap();
    let mut origin = origin(&records).unwrap().unwrap();
    let mut lying = records.clone();
    lying[4].payload["seq"] = serde_json::json!(u64::MAX);
    assert!(matches!(
        super::origin(&lying),
        Err(NotTheParents::Misplaced {
            names: u64::MAX,
            ..
        })
    ));
    // ...and checked against a parent, it names a parent too short.
    origin.forked.seq = u64::MAX;
    assert!(matches!(
        check_prefix(&records, &origin, &parent),
        Err(NotTheParents::ParentTooShort { seq: u64::MAX, .. })
    ));
    // The controller's paged read keeps everything, never wraps to nothing.
    assert_eq!(through(u64::MAX), usize::MAX);
    assert_eq!(through(3), 4);
}

#[tokio::test]
async fn a_forked_record_that_misstates_the_prefixs_spending_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let parent = write_log(&store, PARENT, &long_log(1)).await;
    fork(&store, PARENT, "fork", 3).await.unwrap();
    let records = store.read_verified("fork", None).await.unwrap();
    let mut origin = origin(&records).unwrap().unwrap();
    assert_eq!(origin.forked.budget, Some(crate::api::ForkBudget::FromFork));
    check_prefix(&records, &origin, &parent).unwrap();
    // A smaller sum would let the fork spend what its parent already did.
    origin.forked.prefix_usage.as_mut().unwrap().input_tokens += 1;
    let err = check_prefix(&records, &origin, &parent).unwrap_err();
    assert!(
        matches!(err, NotTheParents::UsageDiffers { seq: 3, .. }),
        "{err}"
    );
}

fn replace(seq: u64, with: serde_json::Value) -> crate::api::ForkReplace {
    crate::api::ForkReplace {
        seq,
        with,
        reason: "what if the order had shipped".into(),
    }
}

#[tokio::test]
async fn a_replaced_lookup_result_is_what_the_forks_next_model_call_sees_and_verify_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let log = long_log(2);
    let parent = write_log(&store, PARENT, &log).await;
    let lookup = parent
        .iter()
        .find(|r| r.kind == StepKind::ToolResult)
        .unwrap()
        .seq;
    // The fork point: the record before the second model call.
    let second = parent
        .iter()
        .filter(|r| r.kind == StepKind::ModelCall)
        .nth(1)
        .unwrap()
        .seq;
    let mut at = point(PARENT, second - 1);
    at.replace = Some(replace(
        lookup,
        serde_json::json!({"status": "REPLACED-MARKER"}),
    ));
    let planned = plan(&signer(), "fork", &parent, &at, CONTROLLER).unwrap();
    let entries = decode(&planned);
    let state = RunState::replay(entries.clone());
    assert!(
        matches!(state.next(), crate::replay::Next::CallModel),
        "{:?}",
        state.next()
    );
    let (request, _) =
        crate::step::prompt::request_for_step(&state, state.snapshot.as_ref().unwrap());
    let sent = serde_json::to_string(&request).unwrap();
    assert!(sent.contains("REPLACED-MARKER"), "{sent}");
    // The parent's own run would have sent its recorded result.
    let theirs = RunState::replay(log[..second as usize].to_vec());
    let (request, _) =
        crate::step::prompt::request_for_step(&theirs, theirs.snapshot.as_ref().unwrap());
    assert!(
        !serde_json::to_string(&request)
            .unwrap()
            .contains("REPLACED-MARKER")
    );

    // Forked names the replacement, who made it and why; the prefix still
    // checks against the parent, every other record compared.
    let origin = origin(&planned).unwrap().unwrap();
    let replaced = origin.forked.replaced.clone().unwrap();
    assert_eq!(replaced.seq, lookup);
    assert_eq!(replaced.by.as_deref(), Some("alice"));
    assert_eq!(replaced.parent_hash, parent[lookup as usize].hash.to_hex());
    check_prefix(&planned, &origin, &parent).unwrap();
    // Another record altered is still caught...
    let mut altered = planned.clone();
    altered[1].payload["context"] = serde_json::json!({"altered": true});
    let err = check_prefix(&altered, &origin, &parent);
    assert!(
        matches!(err, Err(NotTheParents::RecordDiffers { seq: 1, .. })),
        "{err:?}"
    );
    // ...and a replacement claimed of a record the parent does not have.
    let mut lying = origin.clone();
    lying.forked.replaced.as_mut().unwrap().parent_hash = "00".repeat(32);
    assert!(matches!(
        check_prefix(&planned, &lying, &parent),
        Err(NotTheParents::ReplacedDiffers { .. })
    ));
}

#[tokio::test]
async fn a_replacement_of_anything_but_a_copied_result_or_answer_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let parent = write_log(&store, PARENT, &long_log(1)).await;
    let intent = parent
        .iter()
        .find(|r| r.kind == StepKind::ToolIntent)
        .unwrap()
        .seq;
    let model = parent
        .iter()
        .find(|r| r.kind == StepKind::ModelCall)
        .unwrap()
        .seq;
    let cases = [
        (
            replace(intent, serde_json::json!({})),
            intent,
            "spec.forkOf.replace.seq",
        ),
        (
            replace(6, serde_json::json!({})),
            3,
            "spec.forkOf.replace.seq",
        ),
        (
            replace(model, serde_json::json!({"nonsense": 1, "usage": "x"})),
            3,
            "spec.forkOf.replace.with",
        ),
    ];
    for (r, seq, field) in cases {
        let mut at = point(PARENT, seq);
        at.replace = Some(r);
        let err = plan(&signer(), "fork", &parent, &at, CONTROLLER).unwrap_err();
        assert!(
            matches!(err, ForkError::Replace(_)) && err.to_string().starts_with(field),
            "{err}"
        );
    }
    let mut at = point(PARENT, 3);
    at.replace = Some(crate::api::ForkReplace {
        reason: " ".into(),
        ..replace(3, serde_json::json!({}))
    });
    let err = plan(&signer(), "fork", &parent, &at, CONTROLLER).unwrap_err();
    assert!(
        err.to_string().starts_with("spec.forkOf.replace.reason"),
        "{err}"
    );
}
