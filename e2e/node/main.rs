//! agentrun-process-node: the kubelet of one Node for the e2e control plane.
//!
//! There is no container engine on the machines that run the e2e tests, so
//! this node runs every pod bound to it as plain local processes: one process
//! group per container, logs in the state dir, status reported honestly
//! through `pods/status`. It is a test fixture, not a sandbox: processes run
//! on the host, but they start from a clean environment and only get
//! Kubernetes credentials when the pod asks for a service-account token.

mod container;
mod env;
mod identity;
mod image;
mod in_process;
mod lifecycle;
mod loopback;
mod node;
mod pods;
mod process;
mod rewrite;
mod status;
mod supervision;
mod volumes;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::Arc,
};

use anyhow::Context as _;
use base64::Engine as _;
use clap::Parser;
use tracing::info;

#[derive(Parser, Debug)]
#[command(about = "Runs the pods bound to one Node as local processes (e2e only)")]
struct Args {
    /// Name of the Node object this process registers and serves.
    #[arg(long, default_value = "agentrun-node")]
    node_name: String,
    /// Pod working dirs (`pods/`) and container logs (`logs/`).
    #[arg(long)]
    state_dir: PathBuf,
    /// `NAME=DIR`: containers whose image repository ends in NAME run with DIR
    /// first in PATH, and with DIR/NAME as entrypoint when they set no command.
    /// NAME may carry a tag (`agentrun:391b983`): that image's own binaries,
    /// chosen before the untagged NAME's.
    #[arg(long = "image-bin", value_parser = parse_image_bin)]
    image_bins: Vec<(String, PathBuf)>,
    /// The cluster CA, written into the kubeconfigs handed to pods.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Also bind pending pods that have no node (when no scheduler runs).
    #[arg(long)]
    bind_unscheduled: bool,
    /// Run `agentrun step` containers as tasks of this process calling the
    /// library's step runner, not as processes (see `in_process.rs`): the
    /// scale benchmark's 1,000 concurrent step pods on 2 cores.
    #[arg(long, env = "AGENTRUN_NODE_IN_PROCESS_STEPS", action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    in_process_steps: bool,
    /// Pods the node accepts at once (status.capacity/allocatable `pods`);
    /// its CPU and memory grow with it so 50m/64Mi step pods fit.
    #[arg(long, env = "AGENTRUN_NODE_MAX_PODS", default_value_t = 110)]
    max_pods: u32,
    /// A port each pod has to itself on its loopback (see `loopback.rs`):
    /// `127.0.0.1:PORT` and `localhost:PORT` in a pod's spec mean the pod's
    /// own loopback address. Other loopback addresses stay the host's.
    #[arg(long = "pod-loopback-port")]
    pod_loopback_ports: Vec<u16>,
}

fn parse_image_bin(s: &str) -> Result<(String, PathBuf), String> {
    let (name, dir) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=DIR, got {s:?}"))?;
    if name.is_empty() || dir.is_empty() {
        return Err(format!("expected NAME=DIR, got {s:?}"));
    }
    Ok((name.to_string(), PathBuf::from(dir)))
}

/// What every part of the node needs; shared read-only.
pub struct NodeCtx {
    pub client: kube::Client,
    pub node_name: String,
    pub state_dir: PathBuf,
    pub image_bins: BTreeMap<String, PathBuf>,
    /// API server URL written into pod kubeconfigs.
    pub server_url: String,
    /// PEM of the cluster CA, base64-encoded for `certificate-authority-data`.
    pub ca_data: Option<String>,
    /// The node's own PATH, inherited by pods after the image-bin dirs.
    pub host_path: String,
    /// Where step pods run when they run in process (`--in-process-steps`).
    pub in_process_steps: Option<tokio::runtime::Handle>,
    pub max_pods: u32,
    /// The pods' own loopback addresses, and the ports that are the pod's there.
    pub loopbacks: Arc<loopback::Pool>,
    pub pod_loopback_ports: Arc<BTreeSet<u16>>,
}

impl NodeCtx {
    pub fn logs_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }
    pub fn pods_dir(&self) -> PathBuf {
        self.state_dir.join("pods")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .init();
    let args = Args::parse();
    let bind_unscheduled = args.bind_unscheduled;
    let ctx = Arc::new(node_ctx(args).await?);
    if ctx.in_process_steps.is_some() {
        info!("step pods run in process (the library's runner), not as processes");
    }

    let leftovers = process::kill_leftovers(&ctx.pods_dir());
    if leftovers > 0 {
        tracing::warn!(leftovers, "killed processes left behind by a previous run");
    }
    node::register(&ctx).await?;
    info!(node = %ctx.node_name, "node registered and Ready");

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let heartbeat = tokio::spawn(node::heartbeat(ctx.clone()));
    let binder = bind_unscheduled.then(|| tokio::spawn(pods::bind_unscheduled(ctx.clone())));
    let mut manager = tokio::spawn(pods::run(ctx.clone(), shutdown_rx));

    let outcome = tokio::select! {
        signal = wait_for_signal() => {
            signal?;
            info!("shutting down: stopping every pod process");
            let _ = shutdown_tx.send(true);
            // e2e/cluster SIGKILLs the node 5 s after SIGTERM; pods get ~2 s of grace.
            match tokio::time::timeout(std::time::Duration::from_secs(4), &mut manager).await {
                Ok(joined) => joined,
                Err(_) => {
                    tracing::warn!("pods did not stop in time");
                    Ok(Ok(()))
                }
            }
        }
        joined = &mut manager => joined,
    };
    heartbeat.abort();
    if let Some(b) = binder {
        b.abort();
    }
    match outcome {
        Ok(result) => result,
        Err(e) => Err(anyhow::anyhow!("pod manager panicked: {e}")),
    }
}

/// The node's context, from its flags and the admin kubeconfig; its state
/// dirs made.
async fn node_ctx(args: Args) -> anyhow::Result<NodeCtx> {
    let config = kube::Config::infer()
        .await
        .context("loading the admin kubeconfig (KUBECONFIG)")?;
    let ca_data = match &args.ca_file {
        Some(path) => {
            let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            Some(base64::engine::general_purpose::STANDARD.encode(pem))
        }
        // Fall back to the CA the admin kubeconfig trusts, re-encoded as PEM.
        None => config.root_cert.as_deref().map(pem_bundle),
    };
    let server_url = config
        .cluster_url
        .to_string()
        .trim_end_matches('/')
        .to_string();
    let client = kube::Client::try_from(config).context("building the API client")?;

    for dir in ["logs", "pods"] {
        std::fs::create_dir_all(args.state_dir.join(dir))
            .with_context(|| format!("creating {}/{dir}", args.state_dir.display()))?;
    }
    // Absolute, so that process working dirs can be compared against it.
    let state_dir = std::fs::canonicalize(&args.state_dir)?;
    Ok(NodeCtx {
        client,
        node_name: args.node_name,
        state_dir,
        image_bins: args.image_bins.into_iter().collect(),
        server_url,
        ca_data,
        host_path: std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        in_process_steps: match args.in_process_steps {
            true => Some(in_process::runtime().context("starting the step pods' runtime")?),
            false => None,
        },
        max_pods: args.max_pods,
        loopbacks: Arc::default(),
        pod_loopback_ports: Arc::new(args.pod_loopback_ports.into_iter().collect()),
    })
}

/// DER certificates as one PEM bundle, base64-encoded (a kubeconfig's
/// `certificate-authority-data`).
fn pem_bundle(ders: &[Vec<u8>]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let pem: String = ders
        .iter()
        .map(|der| {
            let body = b64.encode(der);
            let lines: Vec<&str> = body
                .as_bytes()
                .chunks(64)
                .filter_map(|c| std::str::from_utf8(c).ok())
                .collect();
            format!(
                "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
                lines.join("\n")
            )
        })
        .collect();
    b64.encode(pem)
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    #[test]
    fn a_bundle_is_each_certificate_in_pem_lines_of_64() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let bundle = super::pem_bundle(&[vec![7; 100], vec![8; 3]]);
        let pem = String::from_utf8(b64.decode(bundle).unwrap()).unwrap();
        let blocks: Vec<&str> = pem.split_inclusive("-----END CERTIFICATE-----\n").collect();
        assert_eq!(blocks.len(), 2, "{pem}");
        let first: Vec<&str> = blocks[0].lines().collect();
        assert_eq!(first[0], "-----BEGIN CERTIFICATE-----");
        assert_eq!(first[1].len(), 64);
        assert_eq!(
            b64.decode(first[1..first.len() - 1].concat()).unwrap(),
            vec![7; 100]
        );
        assert!(blocks[1].contains(&b64.encode([8, 8, 8])));
    }
}
