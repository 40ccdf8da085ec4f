//! A fork run by the step runner (DESIGN.md "Forks"): after the copied
//! prefix nothing recorded is asked or called again, and the calls the
//! fork makes carry the fork's keys, never the parent's.

use super::*;
use crate::fork::{ForkPoint, copy_prefix, read_parent};
use crate::store::{RecordSigner, SignatureRules, SqliteStore};

pub(super) const FORK: &str = "fork-uid-1";

fn signer() -> RecordSigner {
    RecordSigner::from_seed(&[3; 32])
}

/// The parent's whole canned run, written as the controller and a worker
/// did, then forked after `seq` as the controller does.
pub(super) async fn forked_log(
    dir: &std::path::Path,
    history: &[Entry],
    seq: u64,
) -> Arc<dyn StepStore> {
    crate::tools::ensure_crypto_provider();
    let url = format!("sqlite://{}", dir.join("log.db").display());
    let store = SqliteStore::open(&url, &Default::default()).await.unwrap();
    let lease = store.acquire(RUN, "parent", LEASE_TTL).await.unwrap();
    let mut head = Head::EMPTY;
    for step in history {
        let record = signer().seal(RUN, step.draft(), &head).unwrap();
        head = store
            .append(RUN, lease.epoch, &record)
            .await
            .unwrap()
            .head();
    }
    store.release(&lease).await.unwrap();
    let parent = read_parent(
        &store,
        &signer().verifier(),
        RUN,
        None,
        &SignatureRules::STRICT,
    )
    .await
    .unwrap();
    let point = ForkPoint {
        parent_uid: RUN.into(),
        parent_name: "r1".into(),
        seq,
        requester: Some("alice".into()),
        agent: None,
        test: None,
        budget: Default::default(),
        replace: None,
    };
    copy_prefix(&store, &signer(), FORK, &parent, &point, "controller")
        .await
        .unwrap();
    Arc::new(store)
}

/// The canned run as the fork records it when forked after `seq`: the
/// parent's records to `seq`, `Forked`, then the rest one seq later, each
/// call first intended after the fork point under the fork's key.
pub(super) fn fork_history(history: &[Entry], seq: u64, forked: Entry) -> Vec<Entry> {
    shifted(history, seq, vec![forked], FORK)
}

/// `history` with `inserted` after its record `seq`, as run `run` would
/// have recorded it: the records after it that many seqs later (and the
/// seqs they name), each call intended after `seq` under `run`'s key.
pub(super) fn shifted(history: &[Entry], seq: u64, inserted: Vec<Entry>, run: &str) -> Vec<Entry> {
    let n = inserted.len() as u64;
    let later = |at: u64| if at > seq { at + n } else { at };
    let mut log = history[..=seq as usize].to_vec();
    log.extend(inserted);
    for step in &history[seq as usize + 1..] {
        log.push(match step {
            Entry::ToolIntent(i) => Entry::ToolIntent(ToolIntent {
                model_call_seq: later(i.model_call_seq),
                key: idempotency_key(run, later(i.model_call_seq), i.call_index),
                ..i.clone()
            }),
            Entry::ToolResult(r) => Entry::ToolResult(ToolResult {
                intent_seq: later(r.intent_seq),
                ..r.clone()
            }),
            Entry::ApprovalRequested(r) => Entry::ApprovalRequested(ApprovalRequested {
                model_call_seq: later(r.model_call_seq),
                intent_seq: r.intent_seq.map(later),
                ..r.clone()
            }),
            Entry::ApprovalDecided(d) => {
                Entry::ApprovalDecided(crate::runlog::records::ApprovalDecided {
                    request_seq: later(d.request_seq),
                    ..d.clone()
                })
            }
            other => other.clone(),
        });
    }
    log
}

/// The request for the call `intent` makes, with the gate the policy
/// pinned in `log` gives it, and its approval (with `intent`'s arguments)
/// as the controller records it for the Approval `approval` (of a request
/// appended to `log`).
fn approval_of(
    log: &[Entry],
    intent: &ToolIntent,
    approval: &str,
) -> (ApprovalRequested, crate::runlog::records::ApprovalDecided) {
    let state = RunState::replay(log.to_vec());
    let network = crate::policy::Network::of("ns");
    let crate::policy::Classification::RequireApproval(gate) =
        state.classify_at(state.len(), &intent.tool, &intent.arguments, &network)
    else {
        panic!("{} is not gated", intent.tool)
    };
    let request = ApprovalRequested {
        model_call_seq: intent.model_call_seq,
        call_index: intent.call_index,
        call_id: intent.call_id.clone(),
        tool: intent.tool.clone(),
        arguments_hash: crate::policy::arguments_hash(&intent.tool, &intent.arguments),
        arguments: intent.arguments.clone(),
        reason: None,
        observations: vec![],
        dependencies: vec![],
        gate: *gate,
        escalation: 0,
        alternative: None,
        kind: Default::default(),
        intent_seq: None,
    };
    let decided = crate::runlog::records::ApprovalDecided {
        request_seq: log.len() as u64,
        approval: approval.into(),
        verdict: crate::runlog::records::Verdict::Approve,
        decisions: vec![],
        arguments: Some(intent.arguments.clone()),
        observations_hash: "o".into(),
        on_expiry: None,
    };
    (request, decided)
}

/// The canned run on the agent whose policy gates the refund (above 10,
/// alice approves: [`super::gated_run_started`]): the search made, the
/// refund asked for, approved by alice and made, the rest as in `history`.
fn approved_history(base: &str) -> Vec<Entry> {
    let plain = history_of(super::gated_run_started(base, "refund"), turns());
    let refund = plain
        .iter()
        .position(|s| matches!(s, Entry::ToolIntent(i) if i.tool == "refund"))
        .unwrap();
    let Entry::ToolIntent(intent) = &plain[refund] else {
        unreachable!()
    };
    let (request, decided) = approval_of(&plain[..refund], intent, "r1-refund");
    shifted(
        &plain,
        refund as u64 - 1,
        vec![
            Entry::ApprovalRequested(request),
            Entry::ApprovalDecided(decided),
        ],
        RUN,
    )
}

fn intents(log: &[Entry]) -> Vec<&ToolIntent> {
    log.iter()
        .filter_map(|s| match s {
            Entry::ToolIntent(i) => Some(i),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_fork_before_the_refund_makes_it_again_with_its_own_key_and_asks_nothing_recorded() {
    let standins = Standins::start().await;
    let history = history(&standins.base);
    // After the first reply: the search and the refund it proposed are
    // still to be made.
    let seq = 1;
    let dir = tempfile::tempdir().unwrap();
    let store = forked_log(dir.path(), &history, seq).await;
    let copied = store.read_verified(FORK, None).await.unwrap();
    let forked = &copied[seq as usize + 1];
    let forked = Entry::decode(forked.seq, forked.kind.as_str(), &forked.payload).unwrap();
    let expected = fork_history(&history, seq, forked);
    standins.script(&history);
    standins.script(&expected);
    // Every call of the parent took effect.
    let parent_keys: Vec<String> = intents(&history).iter().map(|i| i.key.clone()).collect();
    standins.reset(parent_keys.clone());

    let mut args = step_args();
    args.run_uid = FORK.into();
    args.run_name = "r1-fork".into();
    tokio::time::timeout(Duration::from_secs(30), run_on(args, store.clone()))
        .await
        .expect("the fork's step ends")
        .unwrap_or_else(|e| panic!("the fork's step: {e:#}"));

    let records = store.read_verified(FORK, None).await.unwrap();
    let log: Vec<Entry> = records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect();
    let essential = |l: &[Entry]| l.iter().map(essence).collect::<Vec<_>>();
    assert_eq!(essential(&log), essential(&expected));

    let counts = standins.counts();
    // The first reply was recorded: only the later ones were asked.
    assert_eq!(counts.model_requests, model_calls(&history) - 1);
    for key in &parent_keys {
        assert_eq!(
            counts.posts.get(key),
            None,
            "a parent's call was made again"
        );
        assert_eq!(
            counts.lookups.get(key),
            None,
            "a parent's call was looked up"
        );
    }
    // Every call the fork made, the refund among them, once, with the
    // fork's key.
    let made = intents(&log);
    assert_eq!(made.len(), parent_keys.len());
    assert!(
        made.iter()
            .any(|i| i.tool == "refund" && i.key == idempotency_key(FORK, 1, 1))
    );
    for intent in made {
        assert!(!parent_keys.contains(&intent.key), "{}", intent.tool);
        assert_eq!(counts.posts.get(&intent.key), Some(&1), "{}", intent.tool);
    }
}

#[tokio::test]
async fn a_fork_at_an_intent_without_its_result_recovers_the_parents_call_and_makes_it_no_more() {
    let standins = Standins::start().await;
    let history = history(&standins.base);
    // The refund's intent, the last record copied: the parent made that
    // call (its result follows in the parent, not in the fork).
    let seq = history
        .iter()
        .position(|s| matches!(s, Entry::ToolIntent(i) if i.tool == "refund"))
        .unwrap() as u64;
    let Entry::ToolIntent(refund) = &history[seq as usize] else {
        unreachable!()
    };
    let dir = tempfile::tempdir().unwrap();
    let store = forked_log(dir.path(), &history, seq).await;
    let copied = store.read_verified(FORK, None).await.unwrap();
    let forked = &copied[seq as usize + 1];
    let forked = Entry::decode(forked.seq, forked.kind.as_str(), &forked.payload).unwrap();
    let expected = fork_history(&history, seq, forked);
    standins.script(&history);
    standins.script(&expected);
    let parent_keys: Vec<String> = intents(&history).iter().map(|i| i.key.clone()).collect();
    standins.reset(parent_keys.clone());

    let mut args = step_args();
    args.run_uid = FORK.into();
    tokio::time::timeout(Duration::from_secs(30), run_on(args, store.clone()))
        .await
        .expect("the fork's step ends")
        .unwrap_or_else(|e| panic!("the fork's step: {e:#}"));

    let log: Vec<Entry> = store
        .read_verified(FORK, None)
        .await
        .unwrap()
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
        .collect();
    let essential = |l: &[Entry]| l.iter().map(essence).collect::<Vec<_>>();
    assert_eq!(essential(&log), essential(&expected));
    // Its lookup, under the parent's (recorded) key, said it had happened.
    match &log[seq as usize + 2] {
        Entry::ToolResult(r) => {
            assert_eq!(r.intent_seq, seq);
            assert_eq!(r.recovery, Some(Recovery::LookupFoundResult));
        }
        other => panic!("expected the refund's result, got {other:?}"),
    }
    let counts = standins.counts();
    assert_eq!(counts.lookups.get(&refund.key), Some(&1));
    for key in &parent_keys {
        assert_eq!(
            counts.posts.get(key),
            None,
            "a parent's call was made again"
        );
    }
    // The replies after it were asked; the calls they proposed carry the
    // fork's keys.
    assert_eq!(counts.model_requests, model_calls(&history) - 1);
    let after: Vec<&ToolIntent> = intents(&log[seq as usize + 1..]);
    assert!(!after.is_empty());
    for intent in after {
        assert!(!parent_keys.contains(&intent.key));
        assert_eq!(counts.posts.get(&intent.key), Some(&1), "{}", intent.tool);
    }
}

/// Issue 50: a run creator who may read her run's log but approves
/// nothing forks it at alice's approval of the refund, before its intent.
/// The fork makes no refund on alice's word: it asks its own approvers
/// (an `ApprovalRequested` after `Forked`, which the controller takes) and
/// makes nothing until that is decided; then it makes the refund once,
/// with the fork's key, and never the parent's.
#[tokio::test]
async fn a_fork_at_the_parents_approval_makes_no_refund_until_its_own_approval_is_decided() {
    let standins = Standins::start().await;
    let history = approved_history(&standins.base);
    let seq = history
        .iter()
        .position(|s| matches!(s, Entry::ApprovalDecided(_)))
        .unwrap() as u64;
    assert!(
        matches!(&history[seq as usize + 1], Entry::ToolIntent(i) if i.tool == "refund"),
        "the fork point is the approval, before the refund's intent"
    );
    let dir = tempfile::tempdir().unwrap();
    let store = forked_log(dir.path(), &history, seq).await;
    let parent_keys: Vec<String> = intents(&history).iter().map(|i| i.key.clone()).collect();
    standins.script(&history);
    standins.reset(parent_keys.clone());
    let read = |store: Arc<dyn StepStore>| async move {
        let records = store.read_verified(FORK, None).await.unwrap();
        let log: Vec<Entry> = records
            .iter()
            .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload).unwrap())
            .collect();
        (records, log)
    };
    let mut args = step_args();
    args.run_uid = FORK.into();
    args.run_name = "r1-fork".into();
    let step = |args: StepArgs, store: Arc<dyn StepStore>| async move {
        tokio::time::timeout(Duration::from_secs(30), run_on(args, store))
            .await
            .expect("the fork's step ends")
            .unwrap_or_else(|e| panic!("the fork's step: {e:#}"))
    };

    // The fork's first step: the refund goes to the fork's gate.
    step(args.clone(), store.clone()).await;
    let (records, log) = read(store.clone()).await;
    assert_eq!(log.len() as u64, seq + 3, "the copy, Forked, the request");
    let own_seq = seq + 2;
    let Some(Entry::ApprovalRequested(own)) = log.last() else {
        panic!("the fork did not ask its own approvers: {:?}", log.last())
    };
    assert_eq!(
        (own.tool.as_str(), own.model_call_seq, own.call_index),
        ("refund", 1, 1)
    );
    let counts = standins.counts();
    assert!(
        counts.posts.is_empty(),
        "a call was made: {:?}",
        counts.posts
    );
    assert_eq!(counts.model_requests, 0);
    let state = RunState::replay(log.clone());
    assert_eq!(
        state.next(),
        Next::AwaitApproval {
            request_seq: own_seq
        }
    );
    // The controller takes it: the Approval it raises is the fork's.
    crate::controller::approvals::pinned_gate::check_on(
        &state,
        own_seq,
        &crate::policy::Network::of("ns"),
    )
    .unwrap_or_else(|e| panic!("the controller refuses the fork's request: {e}"));

    // Nobody decided: another step makes nothing either.
    step(args.clone(), store.clone()).await;
    assert_eq!(read(store.clone()).await.1, log, "nothing appended");
    assert!(standins.counts().posts.is_empty());

    // The fork's approver decides; the controller records it.
    let Entry::ToolIntent(refund) = &history[seq as usize + 1] else {
        unreachable!()
    };
    let (_, mut decided) = approval_of(&log, refund, "r1-fork-refund");
    decided.request_seq = own_seq;
    let decided = Entry::ApprovalDecided(decided);
    let lease = store.acquire(FORK, "controller", LEASE_TTL).await.unwrap();
    let record = signer()
        .seal(FORK, decided.draft(), &records.last().unwrap().head())
        .unwrap();
    store.append(FORK, lease.epoch, &record).await.unwrap();
    store.release(&lease).await.unwrap();

    let expected = shifted(
        &history,
        seq,
        vec![
            log[seq as usize + 1].clone(),
            Entry::ApprovalRequested(own.clone()),
            decided,
        ],
        FORK,
    );
    standins.script(&expected);
    step(args, store.clone()).await;
    let (_, log) = read(store.clone()).await;
    let essential = |l: &[Entry]| l.iter().map(essence).collect::<Vec<_>>();
    assert_eq!(essential(&log), essential(&expected));

    let counts = standins.counts();
    let fork_refund = idempotency_key(FORK, 1, 1);
    assert_eq!(
        counts.posts.get(&fork_refund),
        Some(&1),
        "the refund, once, the fork's key"
    );
    for key in &parent_keys {
        assert_eq!(
            counts.posts.get(key),
            None,
            "a parent's call was made again"
        );
    }
    let made = intents(&log[seq as usize + 1..]);
    assert!(
        made.iter()
            .any(|i| i.tool == "refund" && i.key == fork_refund)
    );
    for intent in made {
        assert_eq!(counts.posts.get(&intent.key), Some(&1), "{}", intent.tool);
    }
    assert_eq!(counts.model_requests, model_calls(&history) - 1);
}
