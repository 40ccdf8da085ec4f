//! `kubectl agentrun`: see `agentrun::cli`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    agentrun::cli::main(agentrun::cli::Cli::parse()).await
}
