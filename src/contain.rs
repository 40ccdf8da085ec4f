//! Panics contained to the work that raised them. The controller serves every
//! tenant from one process; a bug that one run's input reaches (a reconcile,
//! a notification's formatting, one HTTP request) must fail that work, never
//! the process: kube-runtime polls reconciles inside the controller's own
//! future, so a panic there would otherwise end every run's reconciling, the
//! gateway and the log API with it.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;

/// The most of a panic's message kept: it may quote input (a string slice's
/// panic quotes the string), and it lands in a status and an Event.
const MESSAGE_MAX_BYTES: usize = 300;

/// A panic caught at its boundary, with its message (cut, one line).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("panicked (a bug in agentrun; the controller's log has where): {0}")]
pub struct Panicked(pub String);

impl Panicked {
    fn of(payload: Box<dyn Any + Send>) -> Panicked {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        Panicked(crate::text::excerpt(
            &crate::text::escape_controls(&message),
            MESSAGE_MAX_BYTES,
        ))
    }
}

/// Runs `work` to its end; a panic in it becomes [`Panicked`] (the panic
/// hook has already logged where it happened). Whatever `work` shared with
/// others is left as the panic left it: callers hold no lock across it.
pub async fn contain<F: Future>(work: F) -> Result<F::Output, Panicked> {
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .map_err(Panicked::of)
}

/// [`contain`] for synchronous work.
pub fn contain_sync<T>(work: impl FnOnce() -> T) -> Result<T, Panicked> {
    std::panic::catch_unwind(AssertUnwindSafe(work)).map_err(Panicked::of)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boom(message: String) -> u8 {
        panic!("{message}")
    }

    #[tokio::test]
    async fn a_panic_becomes_an_error_with_its_message_cut_to_one_line() {
        let got = contain(async { boom(format!("bad\ninput {}", "x".repeat(1000))) }).await;
        let Err(Panicked(message)) = got else {
            panic!("not contained: {got:?}")
        };
        assert!(message.starts_with("bad\\ninput xxx"), "{message}");
        assert!(message.len() <= MESSAGE_MAX_BYTES + '…'.len_utf8());
        assert_eq!(contain(async { 7 }).await, Ok(7));
        assert_eq!(
            contain_sync(|| boom("static".into())),
            Err(Panicked("static".into()))
        );
    }
}
