//! What a reconcile makes of records it did not write (issue 39): the
//! stored bytes are the evidence, and a step pod's record is a claim,
//! checked against the log before the controller acts on it or shows it.

use std::time::Duration;

use serde_json::{Value, json};

use super::paths::{UID, complete, job, model_call, started, step_pod};
use crate::store::testing::respell_as_superuser;

/// The status patches among the requests a reconcile made.
fn status_writes(seen: &[(String, Value)]) -> Vec<&Value> {
    seen.iter()
        .filter(|(what, _)| what.ends_with("/agentruns/r1/status"))
        .map(|(_, body)| body)
        .collect()
}

/// A model's final answer, stored with a field no one hashed or signed
/// (its hash recomputed over the new bytes, past the anchored head): the
/// run stops as tampered instead of finishing on it.
#[tokio::test]
async fn a_record_whose_stored_bytes_are_not_its_canonical_form_stops_the_run() {
    let respellings: [(&str, fn(&str) -> String); 3] = [
        ("a field added", |b| {
            b.replacen('{', "{\"tampered\":true,", 1)
        }),
        ("keys reordered", |b| {
            b.replacen(
                "{\"format\":1,\"kind\":\"ModelCall\",",
                "{\"kind\":\"ModelCall\",\"format\":1,",
                1,
            )
        }),
        ("extra whitespace", |b| b.replace(',', ", ")),
    ];
    for (how, respell) in respellings {
        let dir = tempfile::tempdir().unwrap();
        let (ctx, handle, run) = started(dir.path(), super::run()).await;
        step_pod(
            &ctx,
            vec![model_call(Some("refunded 500"), vec![])],
            Duration::from_secs(30),
            true,
        )
        .await;
        let db = dir.path().join("log.db");
        respell_as_superuser(&db, ctx.store.as_ref(), UID, 1, respell).await;

        let step = super::paths::STEP_1;
        let (_, seen) = super::reconcile_recorded(&ctx, handle, &run, job(step, complete())).await;
        let writes = status_writes(&seen);
        let last = writes
            .last()
            .unwrap_or_else(|| panic!("{how}: no status write"));
        let s = &last["status"];
        assert_eq!(s["phase"], "Failed", "{how}: {last}");
        let intact = s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "LogIntact")
            .unwrap_or_else(|| panic!("{how}: no LogIntact condition: {last}"));
        assert_eq!(
            (&intact["status"], &intact["reason"]),
            (&json!("False"), &json!("LogTampered")),
            "{how}: {intact}"
        );
        let message = intact["message"].as_str().unwrap();
        assert!(
            message.contains("seq 1") && message.contains("not the canonical form"),
            "{how}: {message}"
        );
        // Nothing was recorded on the strength of it.
        let stored = ctx.store.read_stored(UID, 0, None).await.unwrap();
        assert_eq!(stored.len(), 2, "{how}: no RunFinished was appended");
    }
}
