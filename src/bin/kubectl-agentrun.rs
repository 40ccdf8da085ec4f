//! `kubectl agentrun`: the kubectl plugin for people working with runs and
//! approvals. The approval commands (approve, reject, edit, log, verify,
//! cancel) arrive with the approvals work; today it reports its version.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "kubectl-agentrun",
    version,
    about = "Work with agentrun runs and approvals"
)]
struct Cli {}

fn main() {
    Cli::parse();
    println!("kubectl-agentrun {}", env!("CARGO_PKG_VERSION"));
}
