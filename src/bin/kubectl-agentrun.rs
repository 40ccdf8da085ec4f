//! `kubectl agentrun`: see `agentrun::cli`.

use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let result = agentrun::cli::main(agentrun::cli::Cli::parse()).await;
    agentrun::exit::code("kubectl-agentrun", result)
}
