//! Which recorded answer an agent's request gets when its step pod starts
//! again, when a request may go out live, and when the run has diverged.
//!
//! A new step pod starts the agent from its beginning. The runner answers
//! every request that matches a recorded one from the log: the k-th request
//! with a given digest gets the k-th recorded answer of that digest, so the
//! tool calls a framework runs in parallel match in whatever order they
//! arrive. A request goes out live once every recorded request is used, or
//! when it is a tool call an answer served in this pod proposed and the log
//! holds no request for (a parallel call the crash came before).
//!
//! Any other request that matches nothing while recorded requests remain
//! unused means the agent is not deterministic given what it was told (a
//! time or a random id in its prompt, another image): the run stops,
//! naming the recorded request the new one most likely replaced (the
//! earliest unused of its kind). Nothing is asked and nothing runs.
//!
//! [`Matching::ByPosition`] loosens this for model requests only: the k-th
//! model request gets the k-th recorded model answer whatever it asks. The
//! agent then receives answers to questions it did not ask this time; tool
//! calls still match exactly, so no effect is made that was not asked for.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

/// What a recorded request was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Model,
    Tool,
}

/// One recorded request, as the log holds it (in log order).
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub seq: u64,
    pub kind: Kind,
    /// The request's digest: [`super::canonical::Canonical::digest`] for a
    /// model request, the tool call's for a tool.
    pub digest: String,
}

/// How requests are matched to recorded ones on replay.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Matching {
    /// By content: a request gets a recorded answer only to the same request.
    #[default]
    Exact,
    /// Model requests by position (tool calls still by content).
    ByPosition,
}

/// What to do with one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Answer from the record at `seq`.
    Replay { seq: u64 },
    /// Ask the model or call the tool, and record the answer first.
    Live,
    /// Stop the run: nothing recorded matches, and `replaced` (the earliest
    /// unused recorded request of the kind) was not asked again.
    Diverged { replaced: u64 },
}

/// The recorded requests of a run not yet asked again in this pod.
#[derive(Debug, Default)]
pub struct Matcher {
    matching: Matching,
    by_digest: HashMap<(Kind, String), VecDeque<u64>>,
    unused: BTreeMap<u64, (Kind, String)>,
    /// Tool calls proposed by answers served here and not called yet.
    proposed: HashMap<String, usize>,
}

impl Matcher {
    pub fn new(recorded: impl IntoIterator<Item = Recorded>, matching: Matching) -> Matcher {
        let mut m = Matcher {
            matching,
            ..Matcher::default()
        };
        for r in recorded {
            m.by_digest
                .entry((r.kind, r.digest.clone()))
                .or_default()
                .push_back(r.seq);
            m.unused.insert(r.seq, (r.kind, r.digest));
        }
        m
    }

    /// Recorded requests not asked again yet.
    pub fn unused(&self) -> usize {
        self.unused.len()
    }

    /// A model request with `digest`.
    pub fn model(&mut self, digest: &str) -> Decision {
        if let Some(seq) = self.take(Kind::Model, digest) {
            return Decision::Replay { seq };
        }
        if self.matching == Matching::ByPosition
            && let Some(seq) = self.earliest(Kind::Model)
        {
            self.use_seq(seq);
            return Decision::Replay { seq };
        }
        self.live_or_diverged(Kind::Model)
    }

    /// A tool call with `digest`.
    pub fn tool(&mut self, digest: &str) -> Decision {
        let proposed = self.take_proposed(digest);
        if let Some(seq) = self.take(Kind::Tool, digest) {
            return Decision::Replay { seq };
        }
        if proposed {
            return Decision::Live;
        }
        self.live_or_diverged(Kind::Tool)
    }

    /// An answer served here proposed these tool calls (their digests).
    pub fn propose(&mut self, digests: impl IntoIterator<Item = String>) {
        for d in digests {
            *self.proposed.entry(d).or_default() += 1;
        }
    }

    fn take_proposed(&mut self, digest: &str) -> bool {
        match self.proposed.get_mut(digest) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                self.proposed.remove(digest);
                true
            }
            None => false,
        }
    }

    fn take(&mut self, kind: Kind, digest: &str) -> Option<u64> {
        let key = (kind, digest.to_string());
        let queue = self.by_digest.get_mut(&key)?;
        let seq = queue.pop_front()?;
        if queue.is_empty() {
            self.by_digest.remove(&key);
        }
        self.unused.remove(&seq);
        Some(seq)
    }

    fn use_seq(&mut self, seq: u64) {
        if let Some(key) = self.unused.remove(&seq)
            && let Some(queue) = self.by_digest.get_mut(&key)
        {
            queue.retain(|s| *s != seq);
            if queue.is_empty() {
                self.by_digest.remove(&key);
            }
        }
    }

    fn earliest(&self, kind: Kind) -> Option<u64> {
        self.unused
            .iter()
            .find(|(_, (k, _))| *k == kind)
            .map(|(seq, _)| *seq)
    }

    fn live_or_diverged(&self, kind: Kind) -> Decision {
        match self
            .earliest(kind)
            .or_else(|| self.unused.keys().next().copied())
        {
            Some(replaced) => Decision::Diverged { replaced },
            None => Decision::Live,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One exchange of a canned run: a model answer proposing tool calls,
    /// or a tool call.
    #[derive(Clone, Debug)]
    enum Step {
        Model(&'static str, &'static [&'static str]),
        Tool(&'static str),
    }
    use Step::*;

    /// A refund run: the model asks for two lookups at once, then a refund,
    /// then answers.
    const RUN: &[Step] = &[
        Model("m1", &["lookup-a", "lookup-b"]),
        Tool("lookup-a"),
        Tool("lookup-b"),
        Model("m2", &["refund"]),
        Tool("refund"),
        Model("m3", &[]),
    ];

    fn recorded(steps: &[Step]) -> Vec<Recorded> {
        steps
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                Model(d, _) => Recorded {
                    seq: i as u64,
                    kind: Kind::Model,
                    digest: d.to_string(),
                },
                Tool(d) => Recorded {
                    seq: i as u64,
                    kind: Kind::Tool,
                    digest: d.to_string(),
                },
            })
            .collect()
    }

    /// What the agent asks, in order, and what each request was decided.
    fn drive(m: &mut Matcher, asks: &[Step]) -> Vec<Decision> {
        asks.iter()
            .map(|s| match s {
                Model(d, proposes) => {
                    let decision = m.model(d);
                    m.propose(proposes.iter().map(|p| p.to_string()));
                    decision
                }
                Tool(d) => m.tool(d),
            })
            .collect()
    }

    /// The run as a deterministic agent asks it again, the two lookups in
    /// `order`.
    fn asked(order: [&'static str; 2]) -> Vec<Step> {
        let mut steps = RUN.to_vec();
        steps[1] = Tool(order[0]);
        steps[2] = Tool(order[1]);
        steps
    }

    /// A crash after any prefix of the run (the two parallel lookups
    /// recorded in either order): the agent asking the same gets every
    /// recorded answer once, in any order of its parallel calls, and goes
    /// live exactly where the log ends.
    #[test]
    fn a_deterministic_agent_replays_every_prefix_and_goes_live_where_the_log_ends() {
        for recorded_order in [["lookup-a", "lookup-b"], ["lookup-b", "lookup-a"]] {
            let log = asked(recorded_order);
            for prefix in 0..=log.len() {
                for ask_order in [["lookup-a", "lookup-b"], ["lookup-b", "lookup-a"]] {
                    let mut m = Matcher::new(recorded(&log[..prefix]), Matching::Exact);
                    let decisions = drive(&mut m, &asked(ask_order));
                    let replayed = decisions
                        .iter()
                        .filter(|d| matches!(d, Decision::Replay { .. }))
                        .count();
                    assert_eq!(replayed, prefix, "prefix {prefix}: {decisions:?}");
                    assert!(
                        decisions
                            .iter()
                            .all(|d| !matches!(d, Decision::Diverged { .. })),
                        "prefix {prefix}, asked {ask_order:?}: {decisions:?}"
                    );
                    assert_eq!(m.unused(), 0);
                    let mut seqs: Vec<u64> = decisions
                        .iter()
                        .filter_map(|d| match d {
                            Decision::Replay { seq } => Some(*seq),
                            _ => None,
                        })
                        .collect();
                    seqs.sort();
                    assert_eq!(seqs, (0..prefix as u64).collect::<Vec<_>>(), "each once");
                }
            }
        }
    }

    /// One lookup of a pair recorded, the crash before the other: the other
    /// was proposed by the replayed answer, so it goes live, whichever of
    /// the two the agent sends first.
    #[test]
    fn a_parallel_call_the_crash_came_before_goes_live_in_either_order() {
        let log = [Model("m1", &["lookup-a", "lookup-b"]), Tool("lookup-b")];
        let mut m = Matcher::new(recorded(&log), Matching::Exact);
        let d = drive(
            &mut m,
            &[
                Model("m1", &["lookup-a", "lookup-b"]),
                Tool("lookup-a"),
                Tool("lookup-b"),
            ],
        );
        assert_eq!(
            d,
            [
                Decision::Replay { seq: 0 },
                Decision::Live,
                Decision::Replay { seq: 1 }
            ]
        );
    }

    /// The agent asks something else first (a timestamp in its prompt):
    /// diverged at once, naming the answer it did not ask for again, at
    /// every prefix that holds one.
    #[test]
    fn an_agent_asking_anew_diverges_at_every_prefix_naming_the_replaced_request() {
        for prefix in 1..=RUN.len() {
            let mut m = Matcher::new(recorded(&RUN[..prefix]), Matching::Exact);
            assert_eq!(m.model("m1 at 10:05"), Decision::Diverged { replaced: 0 });
        }
        let mut m = Matcher::new(recorded(&[]), Matching::Exact);
        assert_eq!(
            m.model("m1 at 10:05"),
            Decision::Live,
            "nothing recorded: live"
        );
    }

    /// A tool call no answer proposed and the log does not hold, while
    /// recorded calls remain: diverged, never made.
    #[test]
    fn an_unrecorded_call_while_recorded_ones_remain_diverges() {
        let mut m = Matcher::new(recorded(RUN), Matching::Exact);
        assert_eq!(m.model("m1"), Decision::Replay { seq: 0 });
        m.propose(["lookup-a".to_string(), "lookup-b".to_string()]);
        assert_eq!(m.tool("refund of 900"), Decision::Diverged { replaced: 1 });
        // A later model request with its tool calls unused names the calls.
        let mut m = Matcher::new(recorded(&RUN[..3]), Matching::Exact);
        assert_eq!(m.model("m1"), Decision::Replay { seq: 0 });
        assert_eq!(m.model("m2"), Decision::Diverged { replaced: 1 });
    }

    /// The k-th identical request gets the k-th recorded answer.
    #[test]
    fn identical_requests_get_their_answers_in_recorded_order() {
        let log = [Tool("ping"), Model("m", &[]), Tool("ping")];
        let mut m = Matcher::new(recorded(&log), Matching::Exact);
        assert_eq!(m.tool("ping"), Decision::Replay { seq: 0 });
        assert_eq!(m.model("m"), Decision::Replay { seq: 1 });
        assert_eq!(m.tool("ping"), Decision::Replay { seq: 2 });
        assert_eq!(m.tool("ping"), Decision::Live);
    }

    /// By position, model requests get the recorded answers in order
    /// whatever they ask; tool calls still match by content.
    #[test]
    fn by_position_model_answers_follow_the_order_and_tools_stay_exact() {
        let mut m = Matcher::new(recorded(RUN), Matching::ByPosition);
        assert_eq!(m.model("m1 at 10:05"), Decision::Replay { seq: 0 });
        m.propose(["lookup-a".to_string(), "lookup-b".to_string()]);
        assert_eq!(m.tool("lookup-a"), Decision::Replay { seq: 1 });
        assert_eq!(m.tool("lookup-b"), Decision::Replay { seq: 2 });
        assert_eq!(m.model("m2 at 10:06"), Decision::Replay { seq: 3 });
        assert_eq!(m.tool("refund of 900"), Decision::Diverged { replaced: 4 });
    }
}
