//! `kubectl agentrun`: the kubectl plugin for people deciding approvals and
//! auditing runs. It shows what is asked before anyone decides, fills in the
//! arguments hash and the caller's own user name (from a SelfSubjectReview),
//! and leaves enforcement to the API server's admission policies.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value, json};

use crate::api::{AgentRun, Approval, ApprovalState, Verdict};

#[derive(Parser)]
#[command(
    name = "kubectl-agentrun",
    version,
    about = "Decide approvals and audit agentrun runs"
)]
pub struct Cli {
    /// Namespace (the kubeconfig context's when omitted).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    /// Act as this user (impersonation, like kubectl's --as).
    #[arg(long = "as", global = true)]
    as_user: Option<String>,
    /// Groups of the impersonated user.
    #[arg(long = "as-group", global = true)]
    as_groups: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pending approvals: run, tool, key arguments, approvers, time left.
    Approvals {
        /// Across all namespaces.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Everything an approver should see before deciding.
    Show { approval: String },
    /// Approve the call exactly as shown.
    Approve {
        approval: String,
        #[arg(short = 'm', long)]
        reason: Option<String>,
    },
    /// Reject the call; the reason goes back to the agent.
    Reject {
        approval: String,
        #[arg(short = 'm', long)]
        reason: Option<String>,
    },
    /// Approve the call with changed arguments.
    Edit {
        approval: String,
        /// Set one argument: `--set amount=300` (values are JSON when they parse as JSON).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Replace all arguments with this JSON file.
        #[arg(short = 'f', long = "file")]
        file: Option<std::path::PathBuf>,
        #[arg(short = 'm', long)]
        reason: Option<String>,
    },
    /// A run's audit trail, from its step log.
    Log {
        run: String,
        #[arg(long, env = "AGENTRUN_STORE_URL", hide_env_values = true)]
        store_url: String,
    },
    /// Check a run's hash chain ends at the head recorded in its status.
    Verify {
        run: String,
        #[arg(long, env = "AGENTRUN_STORE_URL", hide_env_values = true)]
        store_url: String,
    },
    /// Cancel a run (it stops at the next step boundary).
    Cancel { run: String },
}

/// Runs the plugin.
pub async fn main(cli: Cli) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = KubeConfigOptions {
        context: cli.context.clone(),
        ..Default::default()
    };
    let mut config = match Kubeconfig::read() {
        Ok(kc) => kube::Config::from_custom_kubeconfig(kc, &options).await?,
        Err(_) => kube::Config::infer().await?,
    };
    if let Some(user) = &cli.as_user {
        config.auth_info.impersonate = Some(user.clone());
        config.auth_info.impersonate_groups =
            (!cli.as_groups.is_empty()).then(|| cli.as_groups.clone());
    }
    let ns = cli
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config)?;
    let approvals: Api<Approval> = Api::namespaced(client.clone(), &ns);
    let runs: Api<AgentRun> = Api::namespaced(client.clone(), &ns);
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    match cli.command {
        Command::Approvals { all_namespaces } => {
            let api: Api<Approval> = if all_namespaces {
                Api::all(client)
            } else {
                approvals
            };
            let list = api.list(&ListParams::default()).await?;
            writeln!(
                out,
                "{:<16} {:<28} {:<20} {:<14} {:<36} {:<24} EXPIRES-IN",
                "NAMESPACE", "NAME", "RUN", "TOOL", "ARGUMENTS", "APPROVERS"
            )?;
            for a in list
                .items
                .iter()
                .filter(|a| state(a) == ApprovalState::Pending)
            {
                writeln!(
                    out,
                    "{:<16} {:<28} {:<20} {:<14} {:<36} {:<24} {}",
                    a.metadata.namespace.as_deref().unwrap_or_default(),
                    a.metadata.name.as_deref().unwrap_or_default(),
                    a.spec.run_ref.name,
                    a.spec.tool,
                    abbreviate(&a.spec.arguments.to_string(), 36),
                    approvers(a),
                    time_left(a),
                )?;
            }
        }
        Command::Show { approval } => {
            let a = get(&approvals, &approval, &ns).await?;
            write!(out, "{}", describe(&a))?;
        }
        Command::Approve { approval, reason } => {
            let a = decide(
                &client,
                &approvals,
                &approval,
                &ns,
                Verdict::Approve,
                None,
                reason,
            )
            .await?;
            writeln!(
                out,
                "approved {} ({} {})",
                approval, a.spec.tool, a.spec.arguments
            )?;
        }
        Command::Reject { approval, reason } => {
            decide(
                &client,
                &approvals,
                &approval,
                &ns,
                Verdict::Reject,
                None,
                reason,
            )
            .await?;
            writeln!(out, "rejected {approval}")?;
        }
        Command::Edit {
            approval,
            set,
            file,
            reason,
        } => {
            let current = get(&approvals, &approval, &ns).await?;
            let arguments = edited_arguments(&current.spec.arguments, &set, file.as_deref())?;
            decide(
                &client,
                &approvals,
                &approval,
                &ns,
                Verdict::Edit,
                Some(arguments.clone()),
                reason,
            )
            .await?;
            writeln!(out, "approved {approval} with arguments {arguments}")?;
        }
        Command::Log { run, store_url } => {
            let r = runs
                .get(&run)
                .await
                .with_context(|| format!("no run {run:?} in namespace {ns:?}"))?;
            let store = crate::store::open(&store_url).await?;
            for record in store.read_all(&r.metadata.uid.unwrap_or_default()).await? {
                writeln!(out, "{}", audit_line(&record))?;
            }
        }
        Command::Verify { run, store_url } => {
            let r = runs
                .get(&run)
                .await
                .with_context(|| format!("no run {run:?} in namespace {ns:?}"))?;
            let head = r
                .status
                .as_ref()
                .and_then(|s| s.log.as_ref())
                .and_then(|l| l.head_hash.clone());
            let head = head.context("the run has no recorded head hash yet")?;
            let expected: crate::store::Hash = head
                .parse()
                .map_err(|e| anyhow::anyhow!("status.log.headHash: {e:?}"))?;
            let store = crate::store::open(&store_url).await?;
            let verified = store
                .verify(&r.metadata.uid.unwrap_or_default(), Some(&expected))
                .await?;
            writeln!(
                out,
                "ok: {} records, chain intact, ends at the recorded head {head}",
                verified.len
            )?;
        }
        Command::Cancel { run } => {
            runs.patch(
                &run,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"cancel": true}})),
            )
            .await
            .with_context(|| format!("cancelling run {run:?} in namespace {ns:?}"))?;
            writeln!(out, "cancelling {run}: it stops at the next step boundary")?;
        }
    }
    Ok(())
}

fn state(a: &Approval) -> ApprovalState {
    a.status.as_ref().and_then(|s| s.state).unwrap_or_default()
}

async fn get(api: &Api<Approval>, name: &str, ns: &str) -> anyhow::Result<Approval> {
    api.get_opt(name)
        .await?
        .with_context(|| format!("no approval named {name:?} in namespace {ns:?}"))
}

/// Adds the caller's own decision, quoting the hash of what they were shown.
async fn decide(
    client: &kube::Client,
    api: &Api<Approval>,
    name: &str,
    ns: &str,
    verdict: Verdict,
    arguments: Option<Value>,
    reason: Option<String>,
) -> anyhow::Result<Approval> {
    let a = get(api, name, ns).await?;
    let st = state(&a);
    if st != ApprovalState::Pending {
        bail!("approval {name} is already {st:?}: no more decisions are taken");
    }
    if Timestamp::now() >= a.spec.expires_at.0 {
        bail!("approval {name} expired at {}", a.spec.expires_at.0);
    }
    let me = whoami(client).await?;
    if a.spec.decisions.iter().any(|d| d.approver == me) {
        bail!("{me} has already decided approval {name}");
    }
    let mut entry =
        json!({"approver": me, "verdict": verdict, "argumentsHash": a.spec.arguments_hash});
    if let Some(args) = arguments {
        entry["arguments"] = args;
    }
    if let Some(r) = reason {
        entry["reason"] = json!(r);
    }
    let patch: json_patch::Patch = serde_json::from_value(json!([
        // Fails if someone decided in between: the list is not what we saw.
        {"op": "test", "path": "/spec/decisions", "value": a.spec.decisions},
        {"op": "add", "path": "/spec/decisions/-", "value": entry}
    ]))?;
    match api
        .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(a) => Ok(a),
        Err(kube::Error::Api(e)) => bail!("the API server refused the decision: {}", e.message),
        Err(e) => Err(e.into()),
    }
}

/// The caller's user name, as the API server sees it.
async fn whoami(client: &kube::Client) -> anyhow::Result<String> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .context("the API server did not say who you are")
}

/// Applies `--set key=value` (JSON values when they parse) or `-f file`.
pub fn edited_arguments(
    current: &Value,
    set: &[String],
    file: Option<&std::path::Path>,
) -> anyhow::Result<Value> {
    let mut args = match file {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?,
        None => current.clone(),
    };
    if set.is_empty() && file.is_none() {
        bail!("edit needs --set KEY=VALUE or -f FILE");
    }
    let map = args
        .as_object_mut()
        .context("arguments must be a JSON object")?;
    for kv in set {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--set {kv}: expected KEY=VALUE"))?;
        let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()));
        map.insert(k.to_string(), value);
    }
    Ok(args)
}

fn approvers(a: &Approval) -> String {
    let mut v: Vec<String> = a.spec.approvers.users.clone();
    v.extend(a.spec.approvers.groups.iter().map(|g| format!("group:{g}")));
    format!("{} of {}", a.spec.required_approvals, v.join(","))
}

fn time_left(a: &Approval) -> String {
    let left = a
        .spec
        .expires_at
        .0
        .duration_since(Timestamp::now())
        .as_secs();
    if left <= 0 {
        "expired".into()
    } else {
        format!("{}m{}s", left / 60, left % 60)
    }
}

fn abbreviate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

/// The `show` text.
pub fn describe(a: &Approval) -> String {
    let s = &a.spec;
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<14} {v}\n"));
    line("Approval:", a.metadata.name.clone().unwrap_or_default());
    line(
        "Run:",
        format!("{} (log record {})", s.run_ref.name, s.step),
    );
    line("State:", format!("{:?}", state(a)));
    line("Rule:", s.rule.clone().unwrap_or_default());
    line("Tool:", s.tool.clone());
    line(
        "Arguments:",
        serde_json::to_string_pretty(&s.arguments)
            .unwrap_or_default()
            .replace('\n', "\n               "),
    );
    line("Hash:", s.arguments_hash.clone());
    line(
        "Agent reason:",
        s.observations
            .reason
            .clone()
            .unwrap_or_else(|| "(none given)".into()),
    );
    for r in &s.observations.recent_results {
        line(
            "Observed:",
            format!("[{}] {}: {}", r.seq, r.tool, r.summary),
        );
    }
    for d in &s.dependencies {
        line(
            "Depends on:",
            format!("{} at version {}", d.name, d.version),
        );
    }
    line("Approvers:", approvers(a));
    if let Some(req) = &s.requester {
        line(
            "Requester:",
            format!(
                "{req}{}",
                if s.separation_of_duties {
                    " (may not decide)"
                } else {
                    ""
                }
            ),
        );
    }
    line(
        "Expires:",
        format!(
            "{} ({}), then {:?}",
            s.expires_at.0,
            time_left(a),
            s.on_expiry
        ),
    );
    let by: BTreeMap<_, _> = s
        .decisions
        .iter()
        .map(|d| (d.approver.clone(), d))
        .collect();
    for (who, d) in by {
        line(
            "Decision:",
            format!(
                "{who}: {:?}{}",
                d.verdict,
                d.reason
                    .as_deref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ),
        );
    }
    out
}

/// One readable line of the audit trail.
pub fn audit_line(r: &crate::store::Record) -> String {
    let p = &r.payload;
    let what = match r.kind.as_str() {
        "ModelCall" => {
            let calls: Vec<String> = p["response"]["toolCalls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("{}({})", c["name"].as_str().unwrap_or("?"), c["arguments"]))
                .collect();
            format!(
                "model {} proposed {}",
                p["response"]["modelId"].as_str().unwrap_or("?"),
                if calls.is_empty() {
                    "an answer".into()
                } else {
                    calls.join(", ")
                }
            )
        }
        "ToolIntent" => format!(
            "calling {}({}) key {}",
            p["tool"].as_str().unwrap_or("?"),
            p["arguments"],
            &p["key"].as_str().unwrap_or("")[..12.min(p["key"].as_str().unwrap_or("").len())]
        ),
        "ToolResult" => format!(
            "{} returned {}",
            p["tool"].as_str().unwrap_or("?"),
            abbreviate(&p["outcome"].to_string(), 100)
        ),
        "ApprovalRequested" => format!(
            "approval requested for {}({}) by rule {}",
            p["tool"].as_str().unwrap_or("?"),
            p["arguments"],
            p["gate"]["rule"].as_str().unwrap_or("?")
        ),
        "ApprovalDecided" => {
            let who: Vec<String> = p["decisions"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| {
                    format!(
                        "{} {} ({})",
                        d["approver"].as_str().unwrap_or("?"),
                        d["verdict"].as_str().unwrap_or("?"),
                        d["reason"].as_str().unwrap_or("")
                    )
                })
                .collect();
            format!(
                "{} {}: {}",
                p["approval"].as_str().unwrap_or("?"),
                p["verdict"].as_str().unwrap_or("?"),
                who.join("; ")
            )
        }
        "ApprovalVoided" => format!("approval voided: {}", p["reason"].as_str().unwrap_or("?")),
        "RunFinished" => format!(
            "{}: {}",
            p["outcome"].as_str().unwrap_or("?"),
            p["result"].as_str().or(p["error"].as_str()).unwrap_or("")
        ),
        _ => abbreviate(&p.to_string(), 100),
    };
    format!(
        "{:>4} {:<18} {:<28} {}",
        r.seq,
        r.kind.as_str(),
        format!("{}#{}", r.worker.pod, r.worker.attempt),
        what
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_set_json_values_and_strings() {
        let args = json!({"orderId": "1042", "amount": 500});
        let edited = edited_arguments(
            &args,
            &["amount=300".into(), "note=partial refund".into()],
            None,
        )
        .unwrap();
        assert_eq!(
            edited,
            json!({"orderId": "1042", "amount": 300, "note": "partial refund"})
        );
        assert!(edited_arguments(&args, &[], None).is_err());
        assert!(
            edited_arguments(&args, &["amount".into()], None)
                .unwrap_err()
                .to_string()
                .contains("KEY=VALUE")
        );
    }
}
