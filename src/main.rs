//! `agentrun`: the operator binary (controller, step runner, CRD generator, store tools).

use clap::{Parser, Subcommand};

// A step runner allocates for every request an agent sends (a whole
// conversation parsed, hashed, converted): mimalloc does that in a fraction
// of glibc's time (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "agentrun",
    version,
    about = "Durable LLM agent runs on Kubernetes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the controller (reconciles AgentRuns, creates step Jobs and Approvals).
    Controller(agentrun::controller::Options),
    /// Execute the next step(s) of a run; this is what each step Job runs.
    Step(agentrun::step::runner::StepArgs),
    /// Run a container agent's own command beside the runner and report how
    /// it ended (what wraps the agent in its container).
    AgentShim(agentrun::step::agent_shim::ShimArgs),
    /// Copy this binary where a container agent's shim runs from (the step
    /// pod's init container).
    AgentShimInstall(agentrun::step::agent_shim::InstallArgs),
    /// Step-log store tools: migrate the schema, verify a run's hash chain.
    Store(agentrun::store::admin::StoreArgs),
    /// Print the CustomResourceDefinitions as YAML (what `crds/` holds).
    Crds,
    /// Serve the approvers' web console in the cluster, behind a login proxy
    /// that forwards each person's token (every request acts as that person).
    Console(agentrun::console::InClusterArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let result = run(Cli::parse()).await;
    agentrun::exit::code("agentrun", result)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    // kube, reqwest and sqlx share rustls; pick one crypto provider for the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match cli.command {
        Command::Crds => {
            print!("{}", agentrun::api::crds_yaml()?);
            Ok(())
        }
        Command::Controller(opts) => {
            agentrun::telemetry::init("agentrun-controller");
            let result = agentrun::controller::run(opts).await;
            agentrun::telemetry::trace::shutdown().await;
            result
        }
        Command::Step(args) => {
            agentrun::telemetry::init("agentrun-step");
            termination::on_panic();
            let result = agentrun::step::runner::run(args).await;
            agentrun::telemetry::trace::shutdown().await;
            if let Err(e) = &result {
                termination::write(&format!("{e:#}"));
            }
            // A worker whose lease was taken over exits with its own code.
            if let Err(e) = &result
                && e.downcast_ref::<agentrun::step::runner::StepError>()
                    .is_some_and(agentrun::step::runner::StepError::lease_lost)
            {
                std::process::exit(agentrun::step::runner::LEASE_LOST_EXIT_CODE);
            }
            result
        }
        Command::AgentShim(args) => {
            let code = agentrun::step::agent_shim::run(args).await?;
            std::process::exit(code)
        }
        Command::AgentShimInstall(args) => {
            agentrun::step::agent_shim::install(&args)?;
            Ok(())
        }
        Command::Store(args) => agentrun::store::admin::main(args).await,
        Command::Console(args) => {
            agentrun::telemetry::init("agentrun-console");
            agentrun::console::serve_in_cluster(args).await
        }
    }
}

/// The step container's termination message: the controller quotes it when
/// a step fails, so the cause outlives the pod and its log.
mod termination {
    /// Where the kubelet mounts the container's termination message file.
    /// Written only where it exists (in a pod): never created elsewhere.
    const PATH: &str = "/dev/termination-log";
    /// The kubelet keeps at most 4096 bytes of it.
    const MAX_BYTES: usize = 4096;

    pub fn write(message: &str) {
        if std::path::Path::new(PATH).exists() {
            let _ = std::fs::write(PATH, agentrun::text::prefix(message, MAX_BYTES));
        }
    }

    /// A panic's message goes there too (the default hook still prints it).
    pub fn on_panic() {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            write(&format!("panicked: {info}"));
            default(info);
        }));
    }
}
