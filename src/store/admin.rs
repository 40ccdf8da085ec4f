//! `agentrun store …`: administration of the step log.
//!
//! Wire into the main CLI as
//! `Store(agentrun::store::admin::StoreArgs)` and call
//! `agentrun::store::admin::main(args).await`, or use [`StoreCommand`] with
//! your own `--store-url` and call [`run`].

use std::io::Write;

use anyhow::Context;

use super::{Hash, STORE_URL_ENV, StoreError};

/// `agentrun store [--store-url URL] <command>`.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// Step store URL: postgres://user:password@host/db, sqlite://path or file://path.
    #[arg(long, env = STORE_URL_ENV, hide_env_values = true)]
    pub store_url: String,
    #[command(subcommand)]
    pub command: StoreCommand,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum StoreCommand {
    /// Create or upgrade the schema (on PostgreSQL also the agentrun_writer and
    /// agentrun_retention roles and the append-only trigger). Idempotent.
    Migrate,
    /// Recompute a run's hash chain; exits non-zero naming the first bad seq.
    Verify {
        /// Run key (the AgentRun's uid).
        run: String,
        /// The head hash the run recorded (status.log.headHash): the log must end there.
        #[arg(long)]
        head: Option<String>,
    },
    /// Print the length and head hash of a run's log.
    Head {
        /// Run key (the AgentRun's uid).
        run: String,
    },
    /// Print a run's records, one JSON object per line.
    Log {
        /// Run key (the AgentRun's uid).
        run: String,
        /// First seq to print.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Stop before this seq.
        #[arg(long)]
        to: Option<u64>,
    },
}

/// Run `agentrun store …` with its own `--store-url`.
pub async fn main(args: StoreArgs) -> anyhow::Result<()> {
    run(&args.store_url, args.command).await
}

/// Run one store command against `url`. Errors (a broken chain included)
/// come back as `Err`: the caller prints them and exits non-zero.
pub async fn run(url: &str, cmd: StoreCommand) -> anyhow::Result<()> {
    let store = super::open(url).await?;
    let mut out = std::io::stdout().lock();
    let result: anyhow::Result<()> = async {
        match cmd {
            StoreCommand::Migrate => {
                store.migrate().await?;
                writeln!(out, "store {} migrated", store.url())?;
            }
            StoreCommand::Verify { run, head } => {
                let expected = head
                    .as_deref()
                    .map(|h| h.parse::<Hash>())
                    .transpose()
                    .context("--head")?;
                match store.verify(&run, expected.as_ref()).await {
                    Ok(h) => writeln!(
                        out,
                        "ok: run {run}: {} records, head {}{}",
                        h.len,
                        h.hash,
                        if expected.is_some() {
                            " (matches the recorded head)"
                        } else {
                            ""
                        }
                    )?,
                    Err(e @ StoreError::ChainBroken { .. }) => {
                        writeln!(out, "FAILED: {e}")?;
                        return Err(e.into());
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            StoreCommand::Head { run } => {
                let h = store.head(&run).await?;
                writeln!(out, "{}", serde_json::to_string(&h)?)?;
            }
            StoreCommand::Log { run, from, to } => {
                for r in store.read_range(&run, from, to).await? {
                    writeln!(out, "{}", serde_json::to_string(&r)?)?;
                }
            }
        }
        Ok(())
    }
    .await;
    store.close().await;
    result
}
