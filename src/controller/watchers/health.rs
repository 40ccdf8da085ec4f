//! The health of the controller's watches: every watch (and every other
//! wait before the controller can act, such as its CRDs) is named here, its
//! errors are logged and counted, and `/readyz` says which one keeps the
//! controller from acting and why. A watch whose list keeps failing (RBAC
//! refusing it, a CRD missing) must never be a silent wait.
//!
//! | metric | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `agentrun_watch_errors_total` | counter | `watch` | errors a watch returned (each retried with backoff) |
//! | `agentrun_watch_listed` | gauge | `watch` | 1 once the watch's first list succeeded |

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchLabel {
    watch: String,
}

/// One watch (or wait) as last seen.
#[derive(Clone, Debug, Default, PartialEq)]
struct State {
    /// Its first list succeeded (a wait: it is over).
    listed: bool,
    /// Its latest error, until it next succeeds.
    failing: Option<String>,
}

/// The watches of this process, shared by the probes and the watches.
#[derive(Clone, Default)]
pub struct Watches {
    states: Arc<Mutex<BTreeMap<String, State>>>,
    errors: Family<WatchLabel, Counter>,
    listed: Family<WatchLabel, Gauge>,
}

impl Watches {
    /// Watches whose metrics are registered in `registry`.
    pub fn new(registry: &mut Registry) -> Watches {
        let w = Watches::default();
        registry.register(
            "agentrun_watch_errors",
            "Errors the controller's watches returned (each retried with backoff)",
            w.errors.clone(),
        );
        registry.register(
            "agentrun_watch_listed",
            "1 once a watch's first list succeeded",
            w.listed.clone(),
        );
        w
    }

    /// `stream` (a watcher's events) reported as the watch `name`: its
    /// errors logged and counted, its first list awaited by `/readyz`.
    /// Put it before `default_backoff`, which retries after each error.
    pub fn follow<K, S>(
        &self,
        name: &str,
        stream: S,
    ) -> impl Stream<Item = S::Item> + Send + use<K, S>
    where
        S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
        K: Send,
    {
        self.set(name, |_| {});
        let (me, name) = (self.clone(), name.to_string());
        stream.inspect(move |item| me.observe(&name, item))
    }

    fn observe<K>(&self, name: &str, item: &Result<watcher::Event<K>, watcher::Error>) {
        match item {
            Ok(watcher::Event::InitDone) => self.set(name, |s| {
                s.listed = true;
                s.failing = None;
            }),
            Ok(_) => self.set(name, |s| s.failing = None),
            Err(e) => self.failed(name, &e.to_string()),
        }
    }

    /// Records an error of `name`: logged with it, counted, shown by `/readyz`.
    pub fn failed(&self, name: &str, error: &str) {
        tracing::warn!(watch = name, %error, "watch failed; retrying with backoff");
        self.errors.get_or_create(&label(name)).inc();
        self.set(name, |s| s.failing = Some(error.to_string()));
    }

    /// A wait that is not a watch (`why` is shown by `/readyz` until
    /// [`Watches::done`]).
    pub fn waiting(&self, name: &str, why: &str) {
        self.set(name, |s| s.failing = Some(why.to_string()));
    }

    /// The wait `name` is over.
    pub fn done(&self, name: &str) {
        self.set(name, |s| {
            s.listed = true;
            s.failing = None;
        });
    }

    fn set(&self, name: &str, change: impl FnOnce(&mut State)) {
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let state = states.entry(name.to_string()).or_default();
        change(state);
        self.listed
            .get_or_create(&label(name))
            .set(i64::from(state.listed));
    }

    /// Why the controller cannot act on what it watches, if it cannot: a
    /// watch not listed yet, or one whose latest attempt failed (its cache
    /// is stale until the retry succeeds). One line per watch.
    pub fn unready(&self) -> Option<String> {
        let states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let lines: Vec<String> = states
            .iter()
            .filter_map(|(name, s)| match (&s.failing, s.listed) {
                (Some(e), false) => Some(format!("{name}: not listed yet: {e}")),
                (Some(e), true) => Some(format!("{name}: failing: {e}")),
                (None, false) => Some(format!("{name}: not listed yet")),
                (None, true) => None,
            })
            .collect();
        (!lines.is_empty()).then(|| lines.join("\n"))
    }
}

fn label(name: &str) -> WatchLabel {
    WatchLabel {
        watch: name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::stream;

    type Item = Result<watcher::Event<()>, watcher::Error>;

    fn denied() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(
            kube::core::Status::failure("agentpolicies.agentrun.dev is forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        ))
    }

    #[tokio::test]
    async fn a_failing_list_is_the_reason_until_it_succeeds() {
        let w = Watches::new(&mut Registry::default());
        let items: Vec<Item> = vec![Err(denied())];
        let _: Vec<_> = w
            .follow("agentpolicies", stream::iter(items))
            .collect()
            .await;
        let why = w.unready().expect("not ready");
        assert!(why.starts_with("agentpolicies: not listed yet: "), "{why}");
        assert!(why.contains("forbidden"), "{why}");
        assert_eq!(w.errors.get_or_create(&label("agentpolicies")).get(), 1);

        let items: Vec<Item> = vec![Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)];
        let _: Vec<_> = w
            .follow("agentpolicies", stream::iter(items))
            .collect()
            .await;
        assert_eq!(w.unready(), None);
        assert_eq!(w.listed.get_or_create(&label("agentpolicies")).get(), 1);

        // A later failure makes the cache stale: shown until the retry works.
        let items: Vec<Item> = vec![Err(denied())];
        let _: Vec<_> = w
            .follow("agentpolicies", stream::iter(items))
            .collect()
            .await;
        assert!(w.unready().unwrap().starts_with("agentpolicies: failing: "));
    }

    #[test]
    fn a_watch_not_listed_and_a_wait_are_named() {
        let w = Watches::default();
        let _ = w.follow("jobs", stream::empty::<Item>());
        w.waiting("crd/agentruns.agentrun.dev", "not established yet");
        assert_eq!(
            w.unready().unwrap(),
            "crd/agentruns.agentrun.dev: not listed yet: not established yet\njobs: not listed yet"
        );
        w.done("crd/agentruns.agentrun.dev");
        assert_eq!(w.unready().unwrap(), "jobs: not listed yet");
    }
}
