//! What the shared stand-ins saw of a run: every model and tool request
//! with its arrival time and the stand-in's own time. Every figure of every
//! system is computed from these records the same way, so only the engines
//! differ, never the stopwatch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::common::standins::Standins;

/// One request a stand-in answered.
#[derive(Clone, Debug)]
pub struct Call {
    /// Arrival (the stand-in's clock: this machine's).
    pub at: f64,
    /// How long the stand-in spent on it (scripted delays included), s.
    pub service: f64,
    pub kind: CallKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CallKind {
    /// A model call, with the `[[turn N]]` the answer to it carries and the
    /// stand-in's index of the request within its script.
    Model {
        turn: i64,
        index: u64,
    },
    Tool {
        key: Option<String>,
    },
}

/// A run's requests, in arrival order.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub calls: Vec<Call>,
    /// The stand-in indexes of the model answers the run went on with (the
    /// ids of the tool calls in its last request's conversation).
    pub used_answers: Vec<u64>,
}

pub fn unix(t: &str) -> f64 {
    DateTime::parse_from_rfc3339(t)
        .map(|d| d.with_timezone(&Utc).timestamp_micros() as f64 / 1e6)
        .unwrap_or(f64::NAN)
}

pub fn now() -> f64 {
    Utc::now().timestamp_micros() as f64 / 1e6
}

/// The highest `[[turn N]]` marker in `text` (-1 without one).
fn highest_turn(text: &str) -> i64 {
    text.split("[[turn ")
        .skip(1)
        .filter_map(|rest| rest.split("]]").next()?.trim().parse::<i64>().ok())
        .max()
        .unwrap_or(-1)
}

/// The stand-in's request index a tool call id names (`call_{tag}_{n}_{i}`).
fn answer_index(id: &str) -> Option<u64> {
    let mut parts = id.rsplit('_');
    parts.next()?;
    parts.next()?.parse().ok()
}

/// Every tool request of a tenant, grouped by the run header they carry.
pub async fn tool_calls(standins: &Standins, tenant: &str) -> HashMap<String, Vec<Call>> {
    let mut by_run: HashMap<String, Vec<Call>> = HashMap::new();
    for r in standins.tool_requests(tenant).await {
        let run = r["run"].as_str().unwrap_or_default().to_string();
        by_run.entry(run).or_default().push(Call {
            at: unix(r["receivedAt"].as_str().unwrap_or_default()),
            service: r["serviceMicros"].as_f64().unwrap_or(0.0) / 1e6,
            kind: CallKind::Tool {
                key: r["key"].as_str().map(str::to_string),
            },
        });
    }
    by_run
}

/// The trace of run `run` (its task carries `[[run RUN]]`) on model script
/// `script`, with `tools` its tool requests.
pub async fn trace(standins: &Standins, script: &str, run: &str, tools: Vec<Call>) -> Trace {
    let calls: Value = standins
        .get(&format!("/scripts/{script}/calls?run={run}"))
        .await;
    let empty = Vec::new();
    let requests = calls["requests"].as_array().unwrap_or(&empty);
    let received = calls["receivedAt"].as_array().unwrap_or(&empty);
    let service = calls["serviceMicros"].as_array().unwrap_or(&empty);
    let indexes = calls["indexes"].as_array().unwrap_or(&empty);
    let mut all: Vec<Call> = tools;
    for (i, request) in requests.iter().enumerate() {
        all.push(Call {
            at: unix(received[i].as_str().unwrap_or_default()),
            service: service[i].as_f64().unwrap_or(0.0) / 1e6,
            kind: CallKind::Model {
                turn: highest_turn(&request.to_string()) + 1,
                index: indexes[i].as_u64().unwrap_or(0),
            },
        });
    }
    all.sort_by(|a, b| a.at.total_cmp(&b.at));
    let used_answers = requests
        .last()
        .and_then(|r| r["messages"].as_array())
        .map(|messages| {
            messages
                .iter()
                .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
                .filter_map(|c| answer_index(c["id"].as_str()?))
                .collect()
        })
        .unwrap_or_default();
    Trace {
        calls: all,
        used_answers,
    }
}

impl Trace {
    /// Engine time of each step (a model call and the tool call it asked
    /// for): from the stand-in answering the model to the tool request, plus
    /// from the tool's answer to the next model request. In seconds.
    pub fn step_overheads(&self) -> Vec<f64> {
        let gap = |i: usize| self.calls[i + 1].at - self.calls[i].at - self.calls[i].service;
        let mut out = Vec::new();
        let mut i = 0;
        while i + 2 < self.calls.len() {
            let model = matches!(self.calls[i].kind, CallKind::Model { .. });
            let tool = matches!(self.calls[i + 1].kind, CallKind::Tool { .. });
            if model && tool {
                out.push(gap(i) + gap(i + 1));
                i += 2;
            } else {
                i += 1;
            }
        }
        out
    }

    /// Tool requests made.
    pub fn tool_count(&self) -> usize {
        self.calls
            .iter()
            .filter(|c| matches!(c.kind, CallKind::Tool { .. }))
            .count()
    }

    pub fn first(&self) -> Option<f64> {
        self.calls.first().map(|c| c.at)
    }

    pub fn last_end(&self) -> Option<f64> {
        self.calls.last().map(|c| c.at + c.service)
    }

    /// The first request after `t` (progress after a kill or a decision).
    pub fn next_after(&self, t: f64) -> Option<&Call> {
        self.calls.iter().find(|c| c.at > t)
    }

    /// The first tool request after `t`.
    pub fn next_tool_after(&self, t: f64) -> Option<f64> {
        self.calls
            .iter()
            .find(|c| c.at > t && matches!(c.kind, CallKind::Tool { .. }))
            .map(|c| c.at)
    }

    /// Model answers the run had already been given and went on with, asked
    /// for again: requests for the turn of an answer it used, made after
    /// that answer. An answer lost with its worker before it was recorded
    /// may be asked again; one that was recorded must never be.
    pub fn recorded_answers_asked_again(&self) -> usize {
        let mut used_turn: HashMap<i64, u64> = HashMap::new();
        for c in &self.calls {
            if let CallKind::Model { turn, index } = c.kind
                && self.used_answers.contains(&index)
            {
                used_turn.insert(turn, index);
            }
        }
        self.calls
            .iter()
            .filter(|c| match c.kind {
                CallKind::Model { turn, index } => {
                    used_turn.get(&turn).is_some_and(|used| index > *used)
                }
                _ => false,
            })
            .count()
    }
}

/// Real effects beyond the first for any idempotency key of `tenant`.
pub async fn effects_twice(standins: &Standins, tenant: &str) -> usize {
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for e in standins.effects(tenant).await {
        let key = e["key"].as_str().unwrap_or("(no key)").to_string();
        *per_key.entry(key).or_default() += 1;
    }
    per_key.values().map(|n| n.saturating_sub(1)).sum()
}

/// The q-quantile (0..=1) of `values` (nearest rank); NaN when empty.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The analysis on canned traces (a bench has no test harness: check
/// mode runs this before measuring anything).
pub fn self_check() {
    use canned::*;
    a_step_is_the_engine_time_around_a_model_and_a_tool_call();
    only_a_used_answer_asked_again_counts();
    markers_and_ids_parse();
}

mod canned {
    use super::*;

    fn model(at: f64, turn: i64, index: u64) -> Call {
        Call {
            at,
            service: 0.001,
            kind: CallKind::Model { turn, index },
        }
    }

    fn tool(at: f64) -> Call {
        Call {
            at,
            service: 0.002,
            kind: CallKind::Tool { key: None },
        }
    }

    pub fn a_step_is_the_engine_time_around_a_model_and_a_tool_call() {
        let t = Trace {
            calls: vec![model(0.0, 0, 0), tool(0.101), model(0.203, 1, 1)],
            used_answers: vec![0],
        };
        let o = t.step_overheads();
        assert_eq!(o.len(), 1);
        assert!((o[0] - 0.2).abs() < 1e-9, "{o:?}");
    }

    pub fn only_a_used_answer_asked_again_counts() {
        // Turn 0 asked twice before its answer was used (lost with a
        // worker): fine. Turn 1's used answer (index 3) asked again: counted.
        let t = Trace {
            calls: vec![
                model(0.0, 0, 0),
                model(1.0, 0, 1),
                tool(1.1),
                model(1.2, 1, 3),
                model(5.0, 1, 4),
            ],
            used_answers: vec![1, 3],
        };
        assert_eq!(t.recorded_answers_asked_again(), 1);
    }

    pub fn markers_and_ids_parse() {
        assert_eq!(highest_turn("a [[turn 3]] b [[turn 12]]"), 12);
        assert_eq!(highest_turn("none"), -1);
        assert_eq!(answer_index("call_bench_17_0"), Some(17));
    }
}
