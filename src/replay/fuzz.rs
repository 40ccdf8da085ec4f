//! Fuzzing the record decoders: whatever bytes a store holds (written by a
//! step pod, a database writer, a bug) and whatever a record's payload says,
//! decoding returns a record or an error and replaying a log of what decodes
//! gives a state: never a panic, which in the controller would end the
//! reconcile and, before it was contained, the process.
//!
//! The records start from the format-1 fixture (every kind, every field
//! filled) with places in them replaced by arbitrary JSON, so the decoders
//! see both the shapes they expect and the ones nobody wrote.

use proptest::prelude::*;
use serde_json::Value;

use crate::replay::{Entry, RunState};
use crate::runlog::budget::Limits;
use crate::store::{Hash, Head, Record, StepKind, Usage, Versions, Worker};

/// The fixture's records, each a (kind, payload).
fn fixture() -> &'static [(String, Value)] {
    static RECORDS: std::sync::LazyLock<Vec<(String, Value)>> = std::sync::LazyLock::new(|| {
        let records: Vec<Value> =
            serde_json::from_str(include_str!("../runlog/testdata/format1.json"))
                .expect("the fixture is JSON");
        records
            .into_iter()
            .map(|r| {
                (
                    r["kind"].as_str().unwrap_or_default().to_string(),
                    r["payload"].clone(),
                )
            })
            .collect()
    });
    &RECORDS
}

/// A leaf: the numbers at every edge (the largest integers, negative,
/// fractions), strings of any characters, and the rest.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(vec![0u64, 1, 2, u64::from(u32::MAX), 1 << 53, u64::MAX])
            .prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![-1.0f64, 0.5, -1e308, 1e308, f64::MIN_POSITIVE])
            .prop_map(Value::from),
        any::<f64>().prop_filter_map("a JSON number", |f| {
            serde_json::Number::from_f64(f).map(Value::Number)
        }),
        any::<String>().prop_map(Value::from),
        prop::sample::select(vec![
            "", "Ok", "Failed", "Approve", "Reject", "Edit", "Expired", "finish", "0:00"
        ])
        .prop_map(Value::from),
    ]
}

/// Any JSON: leaves, and arrays and objects of them a few levels deep, with
/// keys the records use as well as any.
fn json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        prop::sample::select(vec![
            "seq",
            "kind",
            "format",
            "payload",
            "usage",
            "inputTokens",
            "outputTokens",
            "costUsd",
            "response",
            "toolCalls",
            "arguments",
            "name",
            "id",
            "requestSeq",
            "intentSeq",
            "modelCallSeq",
            "callIndex",
            "verdict",
            "decisions",
            "gate",
            "agent",
            "budgets",
            "maxSteps",
            "maxTokens",
            "maxCostUSD",
            "outcome",
            "text",
            "stop",
            "context",
            "fromSeq",
            "summarySeq",
        ])
        .prop_map(str::to_string),
        any::<String>(),
    ];
    leaf().prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Every place in `v` as a JSON pointer, the root ("") first.
fn places(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            out.push(at.clone());
            for (k, x) in map {
                let k = k.replace('~', "~0").replace('/', "~1");
                places(x, format!("{at}/{k}"), out);
            }
        }
        Value::Array(items) => {
            out.push(at.clone());
            for (i, x) in items.iter().enumerate() {
                places(x, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// `v` with the places the indexes pick replaced by their values.
fn mutated(mut v: Value, changes: &[(prop::sample::Index, Value)]) -> Value {
    for (at, new) in changes {
        let mut all = Vec::new();
        places(&v, String::new(), &mut all);
        let pointer = &all[at.index(all.len())];
        if let Some(place) = v.pointer_mut(pointer) {
            *place = new.clone();
        }
    }
    v
}

fn changes() -> impl Strategy<Value = Vec<(prop::sample::Index, Value)>> {
    prop::collection::vec((any::<prop::sample::Index>(), json()), 0..4)
}

/// The fixture's record `i` as stored: its envelope around its payload.
fn stored(i: usize, kind: &str, payload: &Value) -> Value {
    let kind = StepKind::ALL
        .into_iter()
        .find(|k| k.as_str() == kind)
        .expect("a kind of the fixture");
    serde_json::to_value(Record {
        format: 1,
        seq: i as u64,
        kind,
        payload: payload.clone(),
        versions: Versions::default(),
        usage: Usage::default(),
        worker: Worker::default(),
        prev_hash: Hash::ZERO,
        hash: Hash::ZERO,
        created_at: None,
    })
    .expect("a record serializes")
}

/// Decodes a stored body as the store does, then its payload as replay does,
/// and encodes it again as a verifier does: each may refuse, none may panic.
fn decode_stored(body: &[u8]) {
    if let Ok(record) = Record::from_canonical(body, Hash::ZERO, None) {
        let _ = record.canonical_bytes();
        let _ = record.compute_hash();
        if let Ok(step) = Entry::decode(record.seq, record.kind.as_str(), &record.payload) {
            let _ = step.payload();
        }
    }
}

/// Replays `steps` and asks the state everything the runner and the
/// controller ask of it.
fn replay_and_ask(steps: Vec<Entry>) {
    let mut state = RunState::replay(steps);
    let _ = state.next();
    let _ = state.pending_approval();
    let _ = state.last_text();
    let budgets = state.budgets();
    let _ = state.budget_exceeded(budgets.as_ref());
    if let Some(b) = &budgets {
        let _ = state.budget_proposal(b);
    }
    for (seq, step) in state.records().collect::<Vec<_>>() {
        if let Entry::ModelCall(call) = step {
            for index in 0..call.response.tool_calls.len() {
                let _ = state.call_state(seq, index);
            }
        }
        let _ = state.call_state_of(seq);
        let _ = state.agent_at(seq);
    }
    let _ = state.pinned_before(state.len());
    state.compact();
    let _ = state.window_start();
    let _ = state.next();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_bytes_as_a_stored_record_decode_or_are_refused(
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        decode_stored(&body);
    }

    #[test]
    fn any_json_as_a_stored_record_or_a_payload_decodes_or_is_refused(
        v in json(),
        kind in prop::sample::select(StepKind::ALL.to_vec()),
    ) {
        decode_stored(&serde_json::to_vec(&v).unwrap());
        if let Ok(step) = Entry::decode(0, kind.as_str(), &v) {
            replay_and_ask(vec![step]);
        }
        let _ = Limits::parse(&v);
    }

    #[test]
    fn a_fixture_record_changed_anywhere_decodes_or_is_refused(
        which in any::<prop::sample::Index>(),
        changes in changes(),
    ) {
        let records = fixture();
        let i = which.index(records.len());
        let (kind, payload) = &records[i];
        let body = mutated(stored(i, kind, payload), &changes);
        decode_stored(&serde_json::to_vec(&body).unwrap());
    }

    #[test]
    fn a_log_of_changed_records_in_any_order_replays(
        log in prop::collection::vec((any::<prop::sample::Index>(), changes()), 0..24),
    ) {
        let records = fixture();
        let steps: Vec<Entry> = log
            .iter()
            .enumerate()
            .filter_map(|(seq, (which, changes))| {
                let (kind, payload) = &records[which.index(records.len())];
                Entry::decode(seq as u64, kind, &mutated(payload.clone(), changes)).ok()
            })
            .collect();
        replay_and_ask(steps);
    }

    #[test]
    fn any_anchor_parses_or_is_refused(s in any::<String>(), n in any::<u64>()) {
        let _ = Head::parse_anchor(&s);
        let _ = Head::parse_anchor(&format!("{n}:{s}"));
    }
}

/// A model (or a step pod) reporting the most tokens there are, twice:
/// the sums saturate where they overflowed (a panic in a debug build, a
/// wrapped small total that let the run past its token budget in release).
#[test]
fn the_most_tokens_reported_twice_saturate_the_budget_spent() {
    let records = fixture();
    let (kind, payload) = records
        .iter()
        .find(|(kind, _)| kind == "ModelCall")
        .expect("a ModelCall in the fixture");
    let mut payload = payload.clone();
    payload["response"]["usage"] =
        serde_json::json!({"inputTokens": u64::MAX, "outputTokens": u64::MAX});
    payload["costUsd"] = serde_json::json!(-1e308);
    let started = records
        .iter()
        .find(|(kind, _)| kind == "RunStarted")
        .unwrap();
    let steps = vec![
        Entry::decode(0, "RunStarted", &started.1).unwrap(),
        Entry::decode(1, kind, &payload).unwrap(),
        Entry::decode(2, kind, &payload).unwrap(),
    ];
    let state = RunState::replay(steps);
    assert_eq!(state.spent.input_tokens, u64::MAX);
    assert_eq!(state.spent.cost_usd, 0.0, "a negative cost counts as none");
    let budgets = crate::api::Budgets {
        max_tokens: Some(1000),
        ..Default::default()
    };
    let exceeded = state
        .budget_exceeded(Some(&budgets))
        .expect("the budget is used up");
    assert!(exceeded.contains(&u64::MAX.to_string()), "{exceeded}");
    let _ = state.budget_proposal(&budgets);
}
