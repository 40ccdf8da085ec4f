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
    let later = |at: u64| if at > seq { at + 1 } else { at };
    let mut log = history[..=seq as usize].to_vec();
    log.push(forked);
    for step in &history[seq as usize + 1..] {
        log.push(match step {
            Entry::ToolIntent(i) => Entry::ToolIntent(ToolIntent {
                model_call_seq: later(i.model_call_seq),
                key: idempotency_key(FORK, later(i.model_call_seq), i.call_index),
                ..i.clone()
            }),
            Entry::ToolResult(r) => Entry::ToolResult(ToolResult {
                intent_seq: later(r.intent_seq),
                ..r.clone()
            }),
            other => other.clone(),
        });
    }
    log
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
