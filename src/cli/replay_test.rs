//! `kubectl agentrun replay-test`: try an Agent on recorded runs without
//! touching the world (DESIGN.md §11). One test AgentRun per recorded run
//! (`spec.testOf`), waited for, then a report from both verified logs.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kube::api::{ListParams, ObjectMeta, PostParams};

use crate::api::{AgentRun, AgentRunSpec, TestBudgets, TestOf};
use crate::client::Kube;
use crate::client::approvals::{abbreviate, visible, visible_json};
use crate::client::log;
use crate::replay::Entry;
use crate::sandbox::report::{RunReport, report};

/// Label on every test run: the batch it belongs to.
pub const BATCH_LABEL: &str = "agentrun.dev/replay-test";

#[derive(clap::Args)]
pub struct ReplayTestArgs {
    /// Recorded runs to test (and/or `-l`).
    runs: Vec<String>,
    /// Recorded runs by label selector (test runs themselves are skipped).
    #[arg(short = 'l', long)]
    selector: Option<String>,
    /// The Agent (same namespace) to try.
    #[arg(long)]
    agent: String,
    /// Each test's cost limit, in US dollars (it ends `BudgetExceeded`).
    #[arg(long, default_value_t = 1.0)]
    max_cost_usd: f64,
    /// Each test's token limit.
    #[arg(long)]
    max_tokens: Option<u64>,
    /// How long to wait for the tests to end.
    #[arg(long, default_value = "10m", value_parser = crate::api::parse_duration)]
    timeout: Duration,
    /// `table` (default) or `json`.
    #[arg(short = 'o', long, default_value = "table")]
    output: Output,
    #[command(flatten)]
    source: super::SourceArgs,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

/// Creates the tests, waits for them, prints the report; fails when any
/// run diverged or a test did not end (so it fits a CI check).
pub async fn replay_test(
    k: &Kube,
    args: ReplayTestArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.max_cost_usd > 0.0 && args.max_cost_usd.is_finite(),
        "--max-cost-usd must be a positive number"
    );
    let recorded = recorded_runs(k, &args).await?;
    anyhow::ensure!(
        !recorded.is_empty(),
        "no recorded runs: name them or give -l SELECTOR"
    );
    let batch = batch_id();
    let mut tests = Vec::new();
    for run in &recorded {
        let test = test_of(run, &args, &batch);
        let created = k
            .runs
            .create(&PostParams::default(), &test)
            .await
            .with_context(|| format!("creating a replay test of run {:?}", name(run)))?;
        tests.push((name(run), name(&created)));
    }
    eprintln!(
        "replay-test: {} test runs (label {BATCH_LABEL}={batch}); waiting up to {}s",
        tests.len(),
        args.timeout.as_secs()
    );
    let pending = wait(k, &tests, args.timeout).await?;
    let mut reports = Vec::new();
    for (run, test) in &tests {
        let recorded = entries(k, run, &args.source).await?;
        let tested = entries(k, test, &args.source).await?;
        reports.push(report(run, test, &recorded, &tested));
    }
    match args.output {
        Output::Json => print_json(&reports, out)?,
        Output::Table => print_table(&reports, out)?,
    }
    let diverged = reports.iter().filter(|r| r.diverged()).count();
    anyhow::ensure!(
        diverged == 0 && pending.is_empty(),
        "{diverged} of {} runs diverged{}",
        reports.len(),
        if pending.is_empty() {
            String::new()
        } else {
            format!("; not ended in time: {}", pending.join(", "))
        }
    );
    Ok(())
}

fn name(run: &AgentRun) -> String {
    run.metadata.name.clone().unwrap_or_default()
}

/// The named runs and those the selector picks, each once; never a test.
async fn recorded_runs(k: &Kube, args: &ReplayTestArgs) -> anyhow::Result<Vec<AgentRun>> {
    let mut runs = BTreeMap::new();
    for n in &args.runs {
        let run = k
            .runs
            .get(n)
            .await
            .with_context(|| format!("reading run {n:?} in namespace {:?}", k.ns))?;
        anyhow::ensure!(
            run.spec.test_of.is_none(),
            "run {n:?} is itself a replay test; test the run it tested"
        );
        runs.insert(n.clone(), run);
    }
    if let Some(selector) = &args.selector {
        let listed = k
            .runs
            .list(&ListParams::default().labels(selector))
            .await
            .with_context(|| format!("listing runs with -l {selector:?}"))?;
        for run in listed
            .items
            .into_iter()
            .filter(|r| r.spec.test_of.is_none())
        {
            runs.insert(name(&run), run);
        }
    }
    Ok(runs.into_values().collect())
}

/// The test run of `recorded`: `spec.testOf`, its task, marked with the batch.
fn test_of(recorded: &AgentRun, args: &ReplayTestArgs, batch: &str) -> AgentRun {
    let run = name(recorded);
    let mut labels = BTreeMap::new();
    labels.insert(BATCH_LABEL.to_string(), batch.to_string());
    AgentRun {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-test-", truncate(&run, 40))),
            labels: Some(labels),
            ..Default::default()
        },
        spec: AgentRunSpec {
            test_of: Some(TestOf {
                run,
                agent: args.agent.clone(),
                budgets: Some(TestBudgets {
                    max_tokens: args.max_tokens,
                    max_cost_usd: Some(args.max_cost_usd),
                }),
            }),
            input: recorded.spec.input.clone(),
            step_timeout: recorded.spec.step_timeout.clone(),
            store: recorded.spec.store.clone(),
            ..Default::default()
        },
        status: None,
    }
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((at, _)) => &s[..at],
        None => s,
    }
}

fn batch_id() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{:x}", now.as_millis())
}

/// Waits until every test ended; the names of those that did not in time.
async fn wait(
    k: &Kube,
    tests: &[(String, String)],
    timeout: Duration,
) -> anyhow::Result<Vec<String>> {
    let started = Instant::now();
    loop {
        let mut pending = Vec::new();
        for (_, test) in tests {
            let run = k
                .runs
                .get(test)
                .await
                .with_context(|| format!("reading test run {test:?}"))?;
            let ended = run
                .status
                .and_then(|s| s.phase)
                .is_some_and(|p| p.is_terminal());
            if !ended {
                pending.push(test.clone());
            }
        }
        if pending.is_empty() || started.elapsed() >= timeout {
            return Ok(pending);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// A run's records, its log verified (through the log API, or the store).
async fn entries(k: &Kube, run: &str, source: &super::SourceArgs) -> anyhow::Result<Vec<Entry>> {
    let read = log::read_verified(k, run, &source.source())
        .await
        .with_context(|| format!("reading the log of run {run:?}"))?;
    anyhow::ensure!(
        read.verdict.ok(),
        "the log of run {run:?} does not verify: {}",
        log::summary(&read.verdict)
    );
    read.records
        .iter()
        .map(|r| Entry::decode(r.seq, r.kind.as_str(), &r.payload))
        .collect::<Result<_, _>>()
        .with_context(|| format!("decoding the log of run {run:?}"))
}

fn print_json(reports: &[RunReport], out: &mut impl Write) -> anyhow::Result<()> {
    let diverged = reports.iter().filter(|r| r.diverged()).count();
    let same = reports.iter().filter(|r| r.same_answer).count();
    let total = |f: fn(&RunReport) -> f64| reports.iter().map(f).sum::<f64>();
    let body = serde_json::json!({
        "runs": reports,
        "total": {
            "runs": reports.len(),
            "sameAnswer": same,
            "diverged": diverged,
            "recordedCostUSD": total(|r| r.recorded.cost_usd),
            "newCostUSD": total(|r| r.new.cost_usd),
            "recordedTokens": reports.iter().map(|r| r.recorded.tokens).sum::<u64>(),
            "newTokens": reports.iter().map(|r| r.new.tokens).sum::<u64>(),
            "moreGated": gated_change(reports, std::cmp::Ordering::Greater),
            "fewerGated": gated_change(reports, std::cmp::Ordering::Less),
        }
    });
    writeln!(out, "{}", serde_json::to_string_pretty(&body)?)?;
    Ok(())
}

/// The runs where the new version gated more (or fewer) calls than the recorded run.
fn gated_change(reports: &[RunReport], way: std::cmp::Ordering) -> Vec<&str> {
    reports
        .iter()
        .filter(|r| r.new.gated_calls.cmp(&r.recorded.gated_calls) == way)
        .map(|r| r.run.as_str())
        .collect()
}

fn print_table(reports: &[RunReport], out: &mut impl Write) -> anyhow::Result<()> {
    writeln!(
        out,
        "{:<28} {:<34} {:<16} {:<6} {:>15} {:>19} {:>7}",
        "RUN", "TEST", "OUTCOME", "SAME", "TOKENS(REC→NEW)", "COST(REC→NEW)", "GATED"
    )?;
    for r in reports {
        let outcome = match (r.diverged(), r.outcome) {
            (true, _) => "Diverged".to_string(),
            (false, Some(o)) => format!("{o:?}"),
            (false, None) => "not ended".to_string(),
        };
        writeln!(
            out,
            "{:<28} {:<34} {:<16} {:<6} {:>15} {:>19} {:>7}",
            visible(&r.run),
            visible(&r.test),
            outcome,
            if r.same_answer { "yes" } else { "no" },
            format!("{}→{}", r.recorded.tokens, r.new.tokens),
            format!("${:.4}→${:.4}", r.recorded.cost_usd, r.new.cost_usd),
            format!("{}→{}", r.recorded.gated_calls, r.new.gated_calls),
        )?;
    }
    for r in reports {
        if let Some(d) = &r.diverged {
            writeln!(
                out,
                "\n{}: diverged at its call {} (test record {}):",
                visible(&r.run),
                d.call,
                d.seq
            )?;
            let recorded = d.recorded.as_ref().map_or(
                "(the recorded run made no more calls)".to_string(),
                |c| {
                    format!(
                        "{} {}",
                        visible(&c.tool),
                        abbreviate(&visible_json(&c.arguments), 100)
                    )
                },
            );
            writeln!(out, "  recorded: {recorded}")?;
            writeln!(
                out,
                "  new:      {} {}",
                visible(&d.new.tool),
                abbreviate(&visible_json(&d.new.arguments), 100)
            )?;
        }
        if let Some(e) = &r.error {
            writeln!(out, "\n{}: {}", visible(&r.run), visible(e))?;
        }
    }
    let diverged = reports.iter().filter(|r| r.diverged()).count();
    let same = reports.iter().filter(|r| r.same_answer).count();
    writeln!(
        out,
        "\n{} runs: {same} reached the same answer, {diverged} diverged",
        reports.len()
    )?;
    for (way, word) in [
        (std::cmp::Ordering::Greater, "more"),
        (std::cmp::Ordering::Less, "fewer"),
    ] {
        let runs = gated_change(reports, way);
        if !runs.is_empty() {
            writeln!(out, "{word} gated calls than recorded: {}", runs.join(", "))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn args(line: &[&str]) -> ReplayTestArgs {
        let mut argv = vec!["kubectl-agentrun", "replay-test"];
        argv.extend_from_slice(line);
        match super::super::Cli::parse_from(argv).command {
            super::super::Command::ReplayTest(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_test_run_names_the_recorded_run_the_agent_and_its_budget_and_is_labelled() {
        let a = args(&["refund-1", "--agent", "refunds-v2", "--max-tokens", "5000"]);
        assert_eq!(a.timeout, Duration::from_secs(600));
        let longer = args(&["refund-1", "--agent", "refunds-v2", "--timeout", "1h30m"]);
        assert_eq!(longer.timeout, Duration::from_secs(5400));
        let mut recorded = AgentRun::new("refund-1", Default::default());
        recorded.spec.input = "Refund order 1042.".into();
        let test = test_of(&recorded, &a, "b1");
        let of = test.spec.test_of.clone().unwrap();
        assert_eq!(
            (of.run.as_str(), of.agent.as_str()),
            ("refund-1", "refunds-v2")
        );
        let budgets = of.budgets.unwrap();
        assert_eq!(
            (budgets.max_tokens, budgets.max_cost_usd),
            (Some(5000), Some(1.0))
        );
        assert_eq!(test.spec.input, "Refund order 1042.");
        assert!(test.spec.agent_ref.is_none() && test.spec.fork_of.is_none());
        assert_eq!(
            test.metadata.generate_name.as_deref(),
            Some("refund-1-test-")
        );
        assert_eq!(
            test.metadata
                .labels
                .unwrap()
                .get(BATCH_LABEL)
                .map(String::as_str),
            Some("b1")
        );
    }
}
