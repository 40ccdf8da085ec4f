//! The controller's own appends to a run's log (RunStarted, VersionChanged,
//! its own RunFinished and decisions): sealed with its signing key and
//! written under the run's store lease like any worker's, so the log has
//! one writer at a time whoever writes.

use std::time::{Duration, Instant};

use crate::controller::context::Context;
use crate::controller::error::Error;
use crate::failpoint;
use crate::replay::Entry;
use crate::store::{Head, StoreError};

/// Appends one record as the controller (RunStarted, VersionChanged, its own
/// RunFinished), under the run's lease like any worker.
pub(crate) async fn append(
    ctx: &Context,
    uid: &str,
    head: &Head,
    step: Entry,
) -> Result<(), Error> {
    let lease = ctx
        .log
        .store
        .acquire(uid, &ctx.log.identity, Duration::from_secs(10))
        .await
        .map_err(Error::Store)?;
    let kind = step.store_kind();
    failpoint::hit(&format!("controller:before-append:{kind}"));
    let mut draft = step.draft();
    draft.worker = crate::store::Worker {
        pod: ctx.log.identity.clone(),
        attempt: 0,
    };
    let started = Instant::now();
    let result = match ctx.log.signer.seal(uid, draft, head) {
        Ok(record) => ctx
            .log
            .store
            .append(uid, lease.epoch, &record)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    ctx.metrics.observe_append(started.elapsed(), &result);
    if result.is_ok() {
        failpoint::hit(&format!("controller:after-append:{kind}"));
    }
    let _ = ctx.log.store.release(&lease).await;
    if matches!(result, Ok(()) | Err(StoreError::Conflict { .. })) {
        // The head moved under the run's cached log: read past it next time.
        ctx.memory.mark_changed(uid);
    }
    match result {
        // Someone recorded that seq first: reconcile again from the new head.
        Ok(()) | Err(StoreError::Conflict { .. }) => Ok(()),
        Err(e) => Err(Error::Store(e)),
    }
}
