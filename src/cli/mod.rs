//! `kubectl agentrun`: the kubectl plugin for people deciding approvals and
//! auditing runs. It shows what is asked before anyone decides, fills in the
//! arguments hash and the caller's own user name (from a SelfSubjectReview),
//! and leaves enforcement to the API server's admission policies.

use std::io::Write;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;

use crate::api::{Approval, ApprovalState, Verdict};

mod keys;
mod replay_test;

use crate::client::approvals::{
    abbreviate, approvers, decide, describe, edited_arguments, get, state, time_left, visible,
    visible_json,
};
use crate::client::{Kube, log};

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
    /// A run's audit trail, from its step log, verified here: the hash
    /// chain, the controller's signatures and the head recorded in the run's
    /// status. Records that fail are marked `!` and the command fails.
    Log {
        run: String,
        /// Print records as they are appended, until the run finishes.
        #[arg(short = 'f', long)]
        follow: bool,
        #[command(flatten)]
        source: SourceArgs,
    },
    /// Check a run's hash chain reaches the head recorded in its status (a
    /// finished run's: ends there), and every controller record's signature
    /// with the controller's published public keys (bound to this run and
    /// seq). A fork's copied prefix is checked against its parent's
    /// verified log (and so on back to a run that is no fork), and where
    /// each fork begins is printed. Reads the log API, or the store with
    /// --store-url.
    Verify {
        run: String,
        #[command(flatten)]
        source: SourceArgs,
    },
    /// Cancel a run (it stops at the next step boundary).
    Cancel { run: String },
    /// Fork a run: a new run that begins with RUN's verified records up to
    /// --at (its seq in `kubectl agentrun log`) and goes on live from
    /// there. You need to create AgentRuns here and read RUN's log.
    /// Prints the fork's name.
    Fork {
        run: String,
        /// The seq of the last record of RUN the fork keeps.
        #[arg(long = "at", value_name = "SEQ",
              value_parser = clap::value_parser!(u64).range(1..=crate::api::MAX_FORK_SEQ))]
        at: u64,
        /// Go on with this Agent (same namespace) after the fork point.
        #[arg(long)]
        agent: Option<String>,
        /// The fork's name (RUN-fork-XXXXX when omitted).
        #[arg(long)]
        name: Option<String>,
        /// Replace the fork's copy of the tool result or model answer at
        /// SEQ (at or before --at) with the JSON in FILE: SEQ=@FILE.
        #[arg(long, value_name = "SEQ=@FILE", requires = "reason")]
        replace: Option<String>,
        /// Why the record is replaced (recorded in the fork's log).
        #[arg(long, requires = "replace")]
        reason: Option<String>,
    },
    /// Try an Agent on recorded runs without touching the world: one test
    /// run per recorded run asks the model anew, calls no tool (each
    /// proposed call gets the recorded run's result for the same call) and
    /// raises no approval; the first call no recorded call matches ends
    /// that test as diverged. Prints a report; fails when any diverged.
    ReplayTest(replay_test::ReplayTestArgs),
    /// Serve the approver's web console on loopback, acting with your own
    /// kubeconfig identity: the inbox of approvals you may decide, each
    /// approval with its arguments and context, runs and their timelines.
    Console(crate::console::LoopbackArgs),
    /// Rotate the controller's step-token key (its signing key derives from
    /// it): a new random key becomes current, the old one is retired at the
    /// API server's time (its tokens open only runs created by then; its
    /// signatures count only where each run's status says it still signed).
    /// Restart the controller afterwards to use it.
    RotateKey {
        /// Instead of rotating, prune the retired keys no step Job holds a
        /// token of (kept: their public signing keys, so what they signed
        /// still verifies); names the runs holding the others and fails
        /// while there are any.
        #[arg(long)]
        prune: bool,
        /// Namespace of the controller and of the key's Secret.
        #[arg(
            long,
            env = "AGENTRUN_CONTROLLER_NAMESPACE",
            default_value = "agentrun-system"
        )]
        controller_namespace: String,
        /// The Secret (`key`, `retired`): the chart's, or
        /// `controller.stepTokenKey.existingSecret`.
        #[arg(long, default_value = "agentrun-step-token-key")]
        secret: String,
    },
}

/// Where `log` and `verify` read a run's log, and the keys they check it with.
#[derive(clap::Args)]
struct SourceArgs {
    /// Read the store directly (administrators) instead of the log API
    /// (`log.agentrun.dev`), which serves every user RBAC lets read runlogs.
    /// `log` then prints the records as stored, unchecked (`verify` checks).
    #[arg(long, env = "AGENTRUN_STORE_URL", hide_env_values = true)]
    store_url: Option<String>,
    /// Namespace of the controller, where it publishes its public keys
    /// (ConfigMap `agentrun-controller-keys`).
    #[arg(
        long,
        env = "AGENTRUN_CONTROLLER_NAMESPACE",
        default_value = "agentrun-system"
    )]
    controller_namespace: String,
}

impl SourceArgs {
    fn source(&self) -> log::Source<'_> {
        log::Source {
            store_url: self.store_url.as_deref(),
            controller_namespace: &self.controller_namespace,
        }
    }
}

/// Runs the plugin.
pub async fn main(cli: Cli) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (client, ns) = connect(&cli).await?;
    let k = Kube {
        approvals: Api::namespaced(client.clone(), &ns),
        runs: Api::namespaced(client.clone(), &ns),
        client,
        ns,
    };
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::Approvals { all_namespaces } => list_approvals(&k, all_namespaces, &mut out).await,
        Command::Show { approval } => show(&k, &approval, &mut out).await,
        Command::Approve { approval, reason } => approve(&k, &approval, reason, &mut out).await,
        Command::Reject { approval, reason } => reject(&k, &approval, reason, &mut out).await,
        Command::Edit {
            approval,
            set,
            file,
            reason,
        } => edit(&k, &approval, &set, file.as_deref(), reason, &mut out).await,
        Command::Log {
            run,
            follow,
            source,
        } => Ok(log::log(&k, &run, &source.source(), follow, &mut out).await?),
        Command::Verify { run, source } => {
            Ok(log::verify(&k, &run, &source.source(), &mut out).await?)
        }
        Command::Cancel { run } => cancel(&k, &run, &mut out).await,
        Command::Fork {
            run,
            at,
            agent,
            name,
            replace,
            reason,
        } => {
            let replace = match (replace, reason) {
                (Some(r), Some(why)) => Some(parse_replace(&r, why)?),
                _ => None,
            };
            fork(&k, &run, at, (agent, replace), name, &mut out).await
        }
        Command::ReplayTest(args) => replay_test::replay_test(&k, args, &mut out).await,
        Command::Console(args) => {
            drop(out);
            crate::console::serve_loopback(k.client, k.ns, args)
                .await
                .map_err(Into::into)
        }
        Command::RotateKey {
            prune: false,
            controller_namespace,
            secret,
        } => keys::rotate(&k.client, &controller_namespace, &secret, &mut out).await,
        Command::RotateKey {
            prune: true,
            controller_namespace,
            secret,
        } => keys::prune(&k.client, &controller_namespace, &secret, &mut out).await,
    }
}

/// The client (as `--as`/`--as-group` when given) and the namespace to act in.
pub(crate) async fn connect(cli: &Cli) -> anyhow::Result<(kube::Client, String)> {
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
    Ok((kube::Client::try_from(config)?, ns))
}

async fn list_approvals(
    k: &Kube,
    all_namespaces: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let api: Api<Approval> = if all_namespaces {
        Api::all(k.client.clone())
    } else {
        k.approvals.clone()
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
            visible(&a.spec.run_ref.name),
            visible(&a.spec.tool),
            abbreviate(&visible_json(&a.spec.arguments), 36),
            visible(&approvers(a)),
            time_left(a),
        )?;
    }
    Ok(())
}

async fn show(k: &Kube, approval: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let a = get(&k.approvals, approval, &k.ns).await?;
    write!(out, "{}", describe(&a))?;
    Ok(())
}

async fn approve(
    k: &Kube,
    approval: &str,
    reason: Option<String>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let a = decide(k, approval, Verdict::Approve, None, reason).await?;
    writeln!(
        out,
        "approved {} ({} {})",
        approval,
        visible(&a.spec.tool),
        visible_json(&a.spec.arguments)
    )?;
    Ok(())
}

async fn reject(
    k: &Kube,
    approval: &str,
    reason: Option<String>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    decide(k, approval, Verdict::Reject, None, reason).await?;
    writeln!(out, "rejected {approval}")?;
    Ok(())
}

async fn edit(
    k: &Kube,
    approval: &str,
    set: &[String],
    file: Option<&std::path::Path>,
    reason: Option<String>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let current = get(&k.approvals, approval, &k.ns).await?;
    let arguments = edited_arguments(&current.spec.arguments, set, file)?;
    decide(k, approval, Verdict::Edit, Some(arguments.clone()), reason).await?;
    writeln!(
        out,
        "approved {approval} with arguments {}",
        visible_json(&arguments)
    )?;
    Ok(())
}

async fn cancel(k: &Kube, run: &str, out: &mut impl Write) -> anyhow::Result<()> {
    k.runs
        .patch(
            run,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .with_context(|| format!("cancelling run {run:?} in namespace {:?}", k.ns))?;
    writeln!(out, "cancelling {run}: it stops at the next step boundary")?;
    Ok(())
}

async fn fork(
    k: &Kube,
    run: &str,
    at: u64,
    (agent, replace): (Option<String>, Option<crate::api::ForkReplace>),
    name: Option<String>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let parent = k
        .runs
        .get(run)
        .await
        .with_context(|| format!("reading run {run:?} in namespace {:?}", k.ns))?;
    let mut fork = crate::client::fork_of(&parent, run, at, agent, name);
    if let Some(of) = fork.spec.fork_of.as_mut() {
        of.replace = replace;
    }
    let created = k
        .runs
        .create(&kube::api::PostParams::default(), &fork)
        .await
        .with_context(|| format!("creating a fork of {run:?} in namespace {:?}", k.ns))?;
    writeln!(out, "{}", created.metadata.name.unwrap_or_default())?;
    Ok(())
}

/// `--replace SEQ=@FILE` with `--reason`: the seq, the JSON the file
/// holds (an object: a tool's answer or a model answer), and why.
fn parse_replace(spec: &str, reason: String) -> anyhow::Result<crate::api::ForkReplace> {
    let Some((seq, file)) = spec.split_once("=@") else {
        anyhow::bail!("--replace {spec:?}: expected SEQ=@FILE (a seq, then the JSON file)");
    };
    let seq: u64 = seq
        .parse()
        .map_err(|e| anyhow::anyhow!("--replace {spec:?}: SEQ {seq:?} is not a seq: {e}"))?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("--replace {spec:?}: reading {file:?}"))?;
    let with: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--replace {spec:?}: {file:?} is not JSON"))?;
    if !with.is_object() {
        anyhow::bail!(
            "--replace {spec:?}: {file:?} must hold a JSON object (a tool's answer or a model answer)"
        );
    }
    Ok(crate::api::ForkReplace { seq, with, reason })
}

#[cfg(test)]
mod fork_tests {
    use crate::client::fork_of;

    #[test]
    fn a_fork_names_its_parent_and_seq_and_keeps_neither_agent_field() {
        let mut parent = crate::api::AgentRun::new("refund-1", Default::default());
        parent.spec.agent_ref = Some(crate::api::LocalRef {
            name: "refunds".into(),
        });
        parent.spec.input = "refund order 1042".into();
        let fork = fork_of(&parent, "refund-1", 3, Some("refunds-v2".into()), None);
        assert_eq!(
            fork.metadata.generate_name.as_deref(),
            Some("refund-1-fork-")
        );
        assert_eq!(fork.metadata.name, None);
        let of = fork.spec.fork_of.unwrap();
        assert_eq!(
            (of.run.as_str(), of.seq, of.agent.as_deref()),
            ("refund-1", 3, Some("refunds-v2"))
        );
        assert!(fork.spec.agent_ref.is_none() && fork.spec.agent.is_none());
        assert_eq!(fork.spec.input, "refund order 1042");
        let named = fork_of(&parent, "refund-1", 3, None, Some("retry".into()));
        assert_eq!(named.metadata.name.as_deref(), Some("retry"));
        assert_eq!(named.metadata.generate_name, None);
    }
}

#[cfg(test)]
mod fork_seq_tests {
    use super::*;

    #[test]
    fn a_fork_seq_past_the_api_maximum_is_refused_naming_at() {
        for at in [
            u64::MAX.to_string(),
            (crate::api::MAX_FORK_SEQ + 1).to_string(),
            "0".into(),
        ] {
            let err = Cli::try_parse_from(["kubectl-agentrun", "fork", "refund-1", "--at", &at])
                .err()
                .unwrap_or_else(|| panic!("--at {at} accepted"));
            assert!(err.to_string().contains("--at"), "{err}");
        }
        let max = crate::api::MAX_FORK_SEQ.to_string();
        Cli::try_parse_from(["kubectl-agentrun", "fork", "refund-1", "--at", &max]).unwrap();
    }
}
