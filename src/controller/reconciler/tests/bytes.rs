//! A log of large records (issue 39): a reconcile reads it by pages and
//! holds its window, and a run whose window is too large to keep between
//! reconciles is resumed at its checkpoint, never read whole each time.

use std::time::Duration;

use super::paths::{UID, job, model_call, observation, running, start, step_pod};
use crate::controller::memory::RunMemory;
use crate::runlog::v1::ToolCall;

const MIB: usize = 1 << 20;

/// The bytes of log payloads the reconciles have read so far.
fn read_bytes(ctx: &crate::controller::context::Context) -> u64 {
    ctx.metrics.store_read_bytes.get()
}

#[tokio::test]
async fn a_log_too_large_to_hold_is_resumed_at_its_checkpoint_not_read_whole_at_each_reconcile() {
    let dir = tempfile::tempdir().unwrap();
    // One run may hold a quarter of the memory's budget: 1 MiB here.
    let (ctx, handle) = super::mocked_with(dir.path(), |ctx| {
        ctx.memory = std::sync::Arc::new(RunMemory::with_budget(4 * MIB));
    })
    .await;
    let (ctx, handle, run) = start(ctx, handle, super::run()).await;
    // Two records of 3 MiB, then a window (from the latest model call) of
    // 2 MiB; the step is still running (a lookup is still to be made).
    let big = |n: usize, c: char| observation(&c.to_string().repeat(n));
    let lookup = |id: &str| ToolCall {
        id: id.into(),
        name: "lookup".into(),
        arguments: serde_json::json!({"q": id}),
    };
    step_pod(
        &ctx,
        vec![
            model_call(None, vec![lookup("c1")]),
            big(3 * MIB, 'a'),
            big(3 * MIB, 'b'),
            model_call(None, vec![lookup("c2")]),
            big(2 * MIB, 'c'),
        ],
        Duration::from_secs(60),
        false,
    )
    .await;
    let whole = (8 * MIB) as u64;

    let step = super::paths::STEP_1;
    let before = read_bytes(&ctx);
    let (handle, seen) = super::reconcile_recorded(&ctx, handle, &run, job(step, running())).await;
    assert!(
        read_bytes(&ctx) - before >= whole,
        "the first reconcile reads it all"
    );
    let status = super::written_status(&seen);
    let checkpoint = &status["status"]["log"]["checkpoint"];
    assert_eq!(
        checkpoint["seq"], 4,
        "the latest model call, after 6 MiB: {checkpoint}"
    );
    assert_eq!(
        ctx.memory.logs_held(),
        0,
        "a 2 MiB window is over a quarter of the budget"
    );
    let run = super::with_status(run, &status);

    // Every later reconcile reads the pinned records and the window only,
    // and does not verify the whole log again (this process did).
    let mut handle = handle;
    for _ in 0..3 {
        let before = read_bytes(&ctx);
        let (h, _) = super::reconcile_recorded(&ctx, handle, &run, job(step, running())).await;
        handle = h;
        let read = read_bytes(&ctx) - before;
        assert!(
            read < (3 * MIB) as u64,
            "a reconcile read {read} bytes of a log of {whole}"
        );
    }
    assert_eq!(ctx.log.store.head(UID).await.unwrap().len, 6);
}

/// A fork's or test's start holds at most its bound of the parent's log
/// (issue 50): what it reads past its prefix is let go page by page; a
/// prefix (or, for a test, a whole log) over the bound is refused, naming
/// what and the bound, before more is held.
#[tokio::test]
async fn a_start_keeps_only_what_it_copies_and_refuses_a_prefix_over_its_bound() {
    use crate::controller::reconciler::fork_start::{Unread, read_log};
    let dir = tempfile::tempdir().unwrap();
    let (ctx, handle) = super::mocked(dir.path()).await;
    let (ctx, _handle, parent) = start(ctx, handle, super::run()).await;
    // Records 1..=6: an observation of 1 MiB each, after `RunStarted`.
    let big = |c: char| observation(&c.to_string().repeat(MIB));
    let steps = ['a', 'b', 'c', 'd', 'e', 'f'].map(big).to_vec();
    step_pod(&ctx, steps, Duration::from_secs(60), true).await;
    let bound = 4 * MIB;

    // A fork at seq 2 keeps records 0..=2 and reads the rest only to verify.
    let kept = read_log(&ctx, &parent, UID, 3, bound)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.iter().map(|r| r.seq).collect::<Vec<_>>(), [0, 1, 2]);
    // A fork at seq 5, and a test (which answers from the whole log): refused.
    for keep in [6, usize::MAX] {
        let read = read_log(&ctx, &parent, UID, keep, bound).await.unwrap();
        assert!(
            matches!(read, Err(Unread::TooLarge { bound: b }) if b == bound),
            "keeping {keep}: {read:?}"
        );
    }
}
