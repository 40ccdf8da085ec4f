//! One controller process: its clients, caches and watches, the servers it
//! hosts, leadership, and the controller loops.

mod leader;
mod throttle;

use crate::refusal::Refusal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;

use super::memory;
use super::reconciler::{self, job};
use super::servers::{gateway, https, probes as http, serving_cert};
use super::watchers::{
    agent_status as agent, health as watches, platform, tool_discovery as discovery,
};
use super::{FIELD_MANAGER, context, metrics, slots};
use crate::keys::{published as published_keys, step_token};

use crate::api::{Agent, AgentRun, Approval};

/// Flags of `agentrun controller`.
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// Watch only this namespace (all namespaces when omitted).
    #[arg(long, env = "AGENTRUN_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "AGENTRUN_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Elect one active replica through a coordination.k8s.io Lease.
    #[arg(long, env = "AGENTRUN_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "agentrun-controller")]
    pub lease_name: String,
    /// Namespace of the Lease (the watched namespace, else the pod's, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Namespace of the ConfigMap the controller publishes its public keys
    /// in (`agentrun-controller-keys`, read by `kubectl agentrun verify`):
    /// the pod's, else the watched namespace, else `default`.
    #[arg(long, env = "AGENTRUN_KEYS_NAMESPACE")]
    pub keys_namespace: Option<String>,
    /// Identity of this replica in the Lease and in Events.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds a leader holds the Lease without renewing it.
    #[arg(long, default_value_t = 15)]
    pub lease_seconds: u64,
    /// Step-log store the controller reads and appends to.
    #[arg(long, env = "AGENTRUN_STORE_URL", hide_env_values = true)]
    pub store_url: String,
    /// Address of the step-log gateway step pods read and append through
    /// (served by every replica, leader or not).
    #[arg(long, env = "AGENTRUN_STEP_API_ADDR", default_value = "0.0.0.0:8081")]
    pub step_api_addr: SocketAddr,
    /// URL of that gateway as step pods reach it (e.g.
    /// `http://agentrun-controller.<ns>.svc:8081`). Default: `http://` plus
    /// `--step-api-addr`, when that is not a wildcard address.
    #[arg(long, env = "AGENTRUN_STEP_API_URL")]
    pub step_api_url: Option<String>,
    /// Database connections of the step-log gateway (its own pool).
    #[arg(long, env = "AGENTRUN_STEP_API_CONNECTIONS", default_value_t = 64)]
    pub step_api_connections: u32,
    /// Client connections the gateway serves at once (more are closed on
    /// arrival); lowered to fit the open-files limit.
    #[arg(
        long,
        env = "AGENTRUN_STEP_API_MAX_CONNECTIONS",
        default_value_t = 4096
    )]
    pub step_api_max_connections: usize,
    /// Seconds a gateway client has to send a request's head (also how long
    /// an idle keep-alive connection stays open).
    #[arg(long, env = "AGENTRUN_STEP_API_HEADER_TIMEOUT", default_value_t = 10)]
    pub step_api_header_timeout_seconds: u64,
    /// Seconds a gateway client has to send a request's body after its head.
    #[arg(long, env = "AGENTRUN_STEP_API_BODY_TIMEOUT", default_value_t = 60)]
    pub step_api_body_timeout_seconds: u64,
    /// MiB of request bodies the gateway reads at once, over all clients
    /// (at least one largest body, 16 MiB).
    #[arg(long, env = "AGENTRUN_STEP_API_BODY_BUDGET_MIB", default_value_t = 32)]
    pub step_api_body_budget_mib: usize,
    /// Address of the HTTPS port the API server calls: the log API
    /// (`log.agentrun.dev`, through the aggregation layer) and the
    /// requester-stamping webhook. Served by every replica.
    #[arg(long, env = "AGENTRUN_SERVING_ADDR", default_value = "0.0.0.0:9443")]
    pub serving_addr: SocketAddr,
    /// PEM certificate of that port (re-read when it changes). Without it
    /// (nor `--serving-cert-secret`) the port is not served.
    #[arg(
        long,
        env = "AGENTRUN_SERVING_CERT_FILE",
        requires = "serving_key_file"
    )]
    pub serving_cert_file: Option<std::path::PathBuf>,
    /// Its PEM private key.
    #[arg(
        long,
        env = "AGENTRUN_SERVING_KEY_FILE",
        requires = "serving_cert_file"
    )]
    pub serving_key_file: Option<std::path::PathBuf>,
    /// Instead of the files: a `kubernetes.io/tls` Secret in the
    /// controller's namespace holding the certificate, generated and stored
    /// by the controller when it does not exist (installs without Helm or
    /// cert-manager); its CA is written into the CA bundles named by
    /// `--inject-ca-apiservice` and `--inject-ca-webhook`.
    #[arg(
        long,
        env = "AGENTRUN_SERVING_CERT_SECRET",
        conflicts_with = "serving_cert_file"
    )]
    pub serving_cert_secret: Option<String>,
    /// DNS names a generated certificate is for (repeatable), e.g.
    /// `agentrun-controller.agentrun-system.svc`.
    #[arg(
        long = "serving-dns-name",
        env = "AGENTRUN_SERVING_DNS_NAMES",
        value_delimiter = ','
    )]
    pub serving_dns_names: Vec<String>,
    /// APIService whose `spec.caBundle` gets the generated CA.
    #[arg(long, env = "AGENTRUN_INJECT_CA_APISERVICE")]
    pub inject_ca_apiservice: Option<String>,
    /// MutatingWebhookConfiguration whose webhooks get the generated CA.
    #[arg(long, env = "AGENTRUN_INJECT_CA_WEBHOOK")]
    pub inject_ca_webhook: Option<String>,
    /// Database connections of the log API (its own pool).
    #[arg(long, env = "AGENTRUN_LOG_API_CONNECTIONS", default_value_t = 8)]
    pub log_api_connections: u32,
    /// Seconds a SubjectAccessReview's answer is reused for the same user
    /// and request.
    #[arg(
        long,
        env = "AGENTRUN_AUTHORIZATION_CACHE_SECONDS",
        default_value_t = 10
    )]
    pub authorization_cache_seconds: u64,
    /// Connections the HTTPS port serves at once (followers hold one each).
    #[arg(long, env = "AGENTRUN_SERVING_MAX_CONNECTIONS", default_value_t = 1024)]
    pub serving_max_connections: usize,
    /// File holding the key step tokens are HMACs of (shared by all replicas).
    #[arg(long, env = "AGENTRUN_STEP_TOKEN_KEY_FILE")]
    pub step_token_key_file: Option<std::path::PathBuf>,
    /// The key itself, when not in a file (e.g. from a Secret through the environment).
    #[arg(long, env = "AGENTRUN_STEP_TOKEN_KEY", hide_env_values = true)]
    pub step_token_key: Option<String>,
    /// File of keys a rotation retired, one per line: tokens they minted
    /// still open their runs, records they signed still verify.
    #[arg(long, env = "AGENTRUN_STEP_TOKEN_RETIRED_KEYS_FILE")]
    pub step_token_retired_keys_file: Option<std::path::PathBuf>,
    /// The retired keys themselves, one per line (from the Secret's `retired`).
    #[arg(long, env = "AGENTRUN_STEP_TOKEN_RETIRED_KEYS", hide_env_values = true)]
    pub step_token_retired_keys: Option<String>,
    /// MiB of log records the controller keeps replayed between reconciles
    /// (one run at most a quarter); runs beyond are read again from the store.
    #[arg(long, env = "AGENTRUN_LOG_CACHE_MIB", default_value_t = 64)]
    pub log_cache_mib: usize,
    /// MiB of log pages the reconciles read and hold at once, over all
    /// runs (pages of 4 MiB, or one record of up to 16 MiB: one page per 16
    /// MiB, one at least).
    #[arg(long, env = "AGENTRUN_LOG_READ_MIB", default_value_t = 32)]
    pub log_read_mib: usize,
    /// Image of the step Jobs (the operator's own image).
    #[arg(long, env = "AGENTRUN_STEP_IMAGE", default_value = "agentrun:dev")]
    pub step_image: String,
    /// Service account of step pods (its token is never mounted).
    #[arg(long, default_value = "default")]
    pub step_service_account: String,
    /// How long one step Job keeps taking further steps before it exits.
    #[arg(long, default_value_t = 60)]
    pub time_slice_seconds: u64,
    /// AgentRuns reconciled at once (0: unbounded).
    #[arg(long, env = "AGENTRUN_RECONCILE_CONCURRENCY", default_value_t = 32)]
    pub reconcile_concurrency: u16,
    /// AgentRuns of one namespace reconciled at once (0: unbounded). Default:
    /// a quarter of `--reconcile-concurrency` when watching all namespaces,
    /// unbounded when watching one.
    #[arg(long, env = "AGENTRUN_RECONCILE_NAMESPACE_CONCURRENCY")]
    pub reconcile_namespace_concurrency: Option<u16>,
    /// Reconcile only the AgentRuns with these labels (a label selector), e.g.
    /// to shard runs between controllers.
    #[arg(long, env = "AGENTRUN_RUN_SELECTOR")]
    pub run_selector: Option<String>,
    /// Seconds MCP discovery may take for one server.
    #[arg(
        long,
        env = "AGENTRUN_DISCOVERY_SERVER_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    pub discovery_server_timeout_seconds: u64,
    /// Seconds MCP discovery may take for one run, all its servers together.
    #[arg(
        long,
        env = "AGENTRUN_DISCOVERY_DEADLINE_SECONDS",
        default_value_t = 30
    )]
    pub discovery_deadline_seconds: u64,
    /// Runs whose MCP servers are discovered at once.
    #[arg(long, env = "AGENTRUN_DISCOVERY_CONCURRENCY", default_value_t = 8)]
    pub discovery_concurrency: u16,
    /// Runs of one namespace whose MCP servers are discovered at once.
    #[arg(
        long,
        env = "AGENTRUN_DISCOVERY_NAMESPACE_CONCURRENCY",
        default_value_t = 2
    )]
    pub discovery_namespace_concurrency: u16,
    /// Requests per second the controller's API client sends on average
    /// (0: no limit).
    #[arg(long, env = "AGENTRUN_API_QPS", default_value_t = 100)]
    pub api_qps: u32,
    /// Requests the controller's API client may send at once above `--api-qps`.
    #[arg(long, env = "AGENTRUN_API_BURST", default_value_t = 200)]
    pub api_burst: u32,
    /// A run's log whose window (the records from its latest model call on)
    /// starts at least this far in gets a signed checkpoint in its status,
    /// so a controller without its replayed log reads the window, not the
    /// whole log, before deciding.
    #[arg(long, env = "AGENTRUN_CHECKPOINT_MIN_RECORDS", default_value_t = reconciler::checkpoint::MIN_SEQ)]
    pub checkpoint_min_records: u64,
    /// Addresses the controller may reach for users (MCP discovery, approval
    /// webhooks) although they are cluster-internal: CIDR ranges or
    /// `host[:port]` names (`*.example.com` for subdomains). Repeatable or
    /// comma-separated. Loopback, private (RFC 1918), CGNAT and unique-local
    /// addresses are refused unless listed; link-local and metadata addresses always.
    #[arg(
        long = "user-url-allow",
        env = "AGENTRUN_USER_URL_ALLOW",
        value_delimiter = ','
    )]
    pub user_url_allow: Vec<crate::egress::Entry>,
    /// Ranges never reached for users, even when listed in `--user-url-allow`
    /// (e.g. the cluster's Service CIDR when it is not a private range).
    #[arg(
        long = "user-url-deny",
        env = "AGENTRUN_USER_URL_DENY",
        value_delimiter = ','
    )]
    pub user_url_deny: Vec<ipnet::IpNet>,
    /// Whether public addresses may be reached for users without being listed.
    #[arg(long = "user-url-public", env = "AGENTRUN_USER_URL_PUBLIC", default_value_t = true, action = clap::ArgAction::Set)]
    pub user_url_public: bool,
    /// The console's base URL, as people reach it (e.g.
    /// `https://agentrun.example.com`): approval notifications link to
    /// `{url}/approvals/{namespace}/{approval}`. http(s) only; without it
    /// they carry the plugin command alone.
    #[arg(long, env = "AGENTRUN_CONSOLE_URL", value_parser = parse_console_url)]
    pub console_url: Option<String>,
    /// Pass the `agentrun.dev/failpoint` annotation to step pods, so tests can
    /// kill a step at a chosen boundary. Never in production.
    #[arg(long, env = "AGENTRUN_ALLOW_FAILPOINTS", default_value_t = false)]
    pub allow_failpoints: bool,
}

fn parse_console_url(s: &str) -> Result<String, Refusal> {
    crate::controller::approvals::notify::console_url(s)
}

/// Why the controller did not start, by the step of its start-up that failed.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Config(#[from] kube::config::InferConfigError),
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Key(#[from] step_token::KeyError),
    #[error("serving the step-log gateway on --step-api-addr {addr}: {cause}")]
    Gateway { addr: SocketAddr, cause: String },
    #[error("serving HTTPS on --serving-addr {addr}: {cause}")]
    Https { addr: SocketAddr, cause: String },
    #[error(
        "--serving-cert-secret needs --serving-dns-name (the Service's DNS names the API server calls)"
    )]
    NoDnsNames,
    #[error(transparent)]
    ServingCert(#[from] serving_cert::CertError),
    #[error(transparent)]
    Leadership(#[from] leader::LeadershipError),
    #[error(transparent)]
    Policies(#[from] kube::runtime::reflector::store::WriterDropped),
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("--step-api-url {url:?}: {error}")]
    StepApiUrl { url: String, error: url::ParseError },
    #[error("--step-api-url {0:?}: expected an http:// or https:// URL")]
    StepApiScheme(String),
    #[error(
        "--step-api-url is required when --step-api-addr ({0}) is a wildcard address: \
         step pods need the address they reach the gateway at"
    )]
    StepApiWildcard(SocketAddr),
    #[error(transparent)]
    Crd(#[from] kube::runtime::wait::Error),
}

/// Runs the controller until SIGTERM/SIGINT or until leadership is lost
/// (the process's edge: `agentrun controller` prints what this returns).
pub async fn run(opts: Options) -> anyhow::Result<()> {
    Ok(start_and_run(opts).await?)
}

async fn start_and_run(opts: Options) -> Result<(), StartupError> {
    if !opts.allow_failpoints {
        crate::failpoint::disable();
    }
    // reqwest and kube share rustls; pick ring once for the whole process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = api_client(&opts).await?;
    let identity = replica_identity(&opts);

    // Servers first: the probes answer (not ready) while the rest starts.
    let mut registry = Registry::default();
    let metrics = metrics::Metrics::new(&mut registry);
    let watches = watches::Watches::new(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let open_files = crate::bounded::raise_open_files_limit();
    serve_probes(&opts, registry, &ready, &watches).await?;
    let store = crate::store::open(&opts.store_url).await?;
    tracing::info!(store = %store.url(), "step store opened");
    let tokens = step_token::TokenKey::load(
        opts.step_token_key_file.as_deref(),
        opts.step_token_key.as_deref(),
        opts.step_token_retired_keys_file.as_deref(),
        opts.step_token_retired_keys.as_deref(),
    )?;
    let step_api_url = serve_gateway(&opts, &tokens, open_files).await?;
    serve_https(&opts, &client, open_files).await?;
    wait_for_crds(&client, &watches).await?;
    ready.store(true, Ordering::Relaxed);
    published_keys::spawn_publish(
        client.clone(),
        keys_namespace(&opts),
        tokens.record_verifier(),
    );

    // Leadership, then the caches and watches only the leader needs.
    let mut shutdown = Box::pin(shutdown_signal());
    let leadership = tokio::select! {
        l = lead(&opts, &client, &identity) => l?,
        _ = &mut shutdown => return Ok(()),
    };
    // Head events (PostgreSQL LISTEN/NOTIFY) wake the runs whose log grew or
    // whose worker gave the run back; without them running runs are polled.
    let head_events = store.head_events().await?;
    let policies = platform::PolicyCache::follow(&client, opts.namespace.as_deref(), &watches);
    tracing::info!("waiting for the platform policies to be listed (/readyz names what fails)");
    policies.ready().await?;
    let caches = Caches::new();
    let parts = Parts {
        client: client.clone(),
        identity,
        metrics,
        store: store.clone(),
        tokens,
        step_api_url,
        store_pushes: head_events.is_some(),
        policies,
    };
    let (ctx, discovered) = context(&opts, parts, &caches)?;

    // The controller loops, until shutdown or lost leadership.
    let lost = leadership.as_ref().map(|l| l.lost());
    let stop = stop_signal(shutdown, lost);
    let wake = wake_runs(ctx.clone(), head_events, store, caches.runs.clone());
    run_controllers(&opts, ctx.clone(), caches, &watches, wake, discovered, stop).await;
    // Another replica drives the runs now: remember nothing of them.
    ctx.memory.clear();
    if let Some(l) = leadership {
        l.release().await;
    }
    tracing::info!("controller stopped");
    Ok(())
}

/// The API client, behind the `--api-qps`/`--api-burst` token bucket.
async fn api_client(opts: &Options) -> Result<Client, StartupError> {
    let config = kube::Config::infer().await?;
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&throttle::ThrottleLayer::new(opts.api_qps, opts.api_burst))
        .build())
}

/// This replica's name in the Lease and in Events.
fn replica_identity(opts: &Options) -> String {
    opts.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`.
async fn serve_probes(
    opts: &Options,
    registry: Registry,
    ready: &Arc<AtomicBool>,
    watches: &watches::Watches,
) -> Result<(), StartupError> {
    let health = http::Health {
        registry: Arc::new(registry),
        ready: ready.clone(),
        watches: watches.clone(),
    };
    let listener = tokio::net::TcpListener::bind(opts.metrics_addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    tokio::spawn(http::serve(listener, health));
    Ok(())
}

/// Serves the step-log gateway on `--step-api-addr`; returns the URL step
/// pods reach it at.
async fn serve_gateway(
    opts: &Options,
    tokens: &step_token::TokenKey,
    open_files: Option<u64>,
) -> Result<String, StartupError> {
    // The gateway's own pool: step pods' traffic never starves the reconciler's.
    let gateway_pool = crate::store::OpenOptions {
        max_connections: opts.step_api_connections,
        // Under a burst of step pods a request waits for a connection
        // rather than failing: the runner's HTTP timeout is longer.
        acquire_timeout: Duration::from_secs(25),
        ..Default::default()
    };
    let served = gateway::spawn(
        opts.step_api_addr,
        opts.store_url.clone(),
        gateway_pool,
        tokens.clone(),
        gateway_limits(opts, open_files),
    )
    .await
    .map_err(|e| StartupError::Gateway {
        addr: opts.step_api_addr,
        cause: crate::text::chain(&e),
    })?;
    let url = step_api_url(opts, served)?;
    tracing::info!(addr = %served, url = %url, "serving the step-log gateway");
    Ok(url)
}

/// Serves the HTTPS port (log API, admission webhook) when it has a
/// certificate.
async fn serve_https(
    opts: &Options,
    client: &Client,
    open_files: Option<u64>,
) -> Result<(), StartupError> {
    let cert = match (&opts.serving_cert_file, &opts.serving_key_file) {
        (Some(cert), Some(key)) => https::CertSource::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        _ if opts.serving_cert_secret.is_some() => provisioned_cert(opts, client).await?,
        _ => {
            tracing::warn!(
                "no --serving-cert-file: the log API and the admission webhook are not served"
            );
            return Ok(());
        }
    };
    let wanted = opts.serving_max_connections.max(1);
    let settings = https::Settings {
        addr: opts.serving_addr,
        cert,
        store_url: opts.store_url.clone(),
        store_connections: opts.log_api_connections,
        namespace: opts.namespace.clone(),
        authz_ttl: Duration::from_secs(opts.authorization_cache_seconds),
        limits: crate::bounded::Limits {
            max_connections: crate::bounded::fitting_connections(wanted, open_files),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
        },
    };
    let served = https::spawn(settings)
        .await
        .map_err(|e| StartupError::Https {
            addr: opts.serving_addr,
            cause: crate::text::chain(&e),
        })?;
    tracing::info!(addr = %served, "serving the log API and the admission webhook (HTTPS)");
    Ok(())
}

/// The certificate the controller keeps in `--serving-cert-secret`
/// (generating it the first time), its CA written where the API server
/// reads it.
async fn provisioned_cert(
    opts: &Options,
    client: &Client,
) -> Result<https::CertSource, StartupError> {
    let secret = opts.serving_cert_secret.as_deref().unwrap_or_default();
    if opts.serving_dns_names.is_empty() {
        return Err(StartupError::NoDnsNames);
    }
    let ns = keys_namespace(opts);
    let cert = serving_cert::provision(client, &ns, secret, &opts.serving_dns_names).await?;
    serving_cert::inject_ca_bundle(
        client,
        &cert.ca_pem,
        opts.inject_ca_apiservice.as_deref(),
        opts.inject_ca_webhook.as_deref(),
    )
    .await?;
    Ok(https::CertSource::Pem {
        cert: cert.cert_pem,
        key: cert.key_pem,
    })
}

/// Where the controller's public keys are published.
fn keys_namespace(opts: &Options) -> String {
    opts.keys_namespace
        .clone()
        .or_else(|| opts.lease_namespace.clone())
        .or_else(|| opts.namespace.clone())
        .unwrap_or_else(|| "default".into())
}

/// Waits for leadership (`--leader-elect`); `None` when not electing.
async fn lead(
    opts: &Options,
    client: &Client,
    identity: &str,
) -> Result<Option<leader::Leadership>, StartupError> {
    if !opts.leader_elect {
        return Ok(None);
    }
    let ns = opts
        .namespace
        .clone()
        .or_else(|| opts.lease_namespace.clone())
        .unwrap_or_else(|| "default".into());
    tracing::info!(%identity, lease = %opts.lease_name, namespace = %ns, "waiting for leadership");
    let lead = leader::acquire(
        client.clone(),
        &ns,
        &opts.lease_name,
        identity,
        opts.lease_seconds,
    )
    .await?;
    tracing::info!(%identity, "became leader");
    Ok(Some(lead))
}

/// Runs whose MCP discovery finished, to reconcile again.
type Discovered = tokio::sync::mpsc::UnboundedReceiver<ObjectRef<AgentRun>>;

/// The watch caches reconciles read from, and their writers.
struct Caches {
    runs: reflector::Store<AgentRun>,
    runs_writer: reflector::store::Writer<AgentRun>,
    jobs: reflector::Store<Job>,
    jobs_writer: reflector::store::Writer<Job>,
    agents: reflector::Store<Agent>,
    agents_writer: reflector::store::Writer<Agent>,
}

impl Caches {
    fn new() -> Caches {
        let (runs, runs_writer) = reflector::store::<AgentRun>();
        let (jobs, jobs_writer) = reflector::store::<Job>();
        let (agents, agents_writer) = reflector::store::<Agent>();
        Caches {
            runs,
            runs_writer,
            jobs,
            jobs_writer,
            agents,
            agents_writer,
        }
    }
}

/// What the process built before the reconciler's context.
struct Parts {
    client: Client,
    identity: String,
    metrics: metrics::Metrics,
    store: Arc<dyn crate::store::StepStore>,
    tokens: step_token::TokenKey,
    step_api_url: String,
    store_pushes: bool,
    policies: platform::PolicyCache,
}

/// The reconciler's shared context, and the stream of runs whose MCP
/// discovery finished.
fn context(
    opts: &Options,
    parts: Parts,
    caches: &Caches,
) -> Result<(Arc<context::Context>, Discovered), StartupError> {
    let user_urls = Arc::new(crate::egress::Policy::new(
        opts.user_url_allow.clone(),
        opts.user_url_deny.clone(),
        opts.user_url_public,
    ));
    let memory = Arc::new(memory::RunMemory::with_budget(opts.log_cache_mib << 20));
    let (discovery, discovered) = discovery::Discovery::new(
        crate::egress::client(user_urls.clone())?,
        user_urls.clone(),
        discovery::Limits {
            per_server: Duration::from_secs(opts.discovery_server_timeout_seconds),
            deadline: Duration::from_secs(opts.discovery_deadline_seconds),
            concurrency: opts.discovery_concurrency.into(),
            namespace_concurrency: opts.discovery_namespace_concurrency.into(),
        },
        memory.clone(),
    );
    let verifier = parts.tokens.record_verifier();
    let key_id = parts.tokens.record_signer().key_id().to_string();
    let verifier_hex = verifier.to_hex();
    let ctx = context::Context {
        client: parts.client,
        reporter: Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(parts.identity.clone()),
        },
        metrics: parts.metrics,
        log: context::LogAccess {
            store: parts.store,
            store_name: "default".into(),
            pushes: parts.store_pushes,
            signer: parts.tokens.record_signer(),
            verifier,
            tokens: parts.tokens,
            identity: format!("controller/{}", parts.identity),
            reads: crate::store::ReadBudget::new(opts.log_read_mib << 20),
            checkpoint_min: opts.checkpoint_min_records,
        },
        jobs: context::JobSettings {
            image: opts.step_image.clone(),
            store_url: parts.step_api_url,
            controller_key: verifier_hex,
            key_id: key_id.clone(),
            service_account: opts.step_service_account.clone(),
            time_slice_seconds: opts.time_slice_seconds,
            allow_failpoints: opts.allow_failpoints,
            telemetry_env: crate::telemetry::step_env(),
        },
        outbound: context::Outbound {
            http: crate::egress::client(user_urls.clone())?,
            user_urls,
            console_url: opts.console_url.clone(),
        },
        caches: context::Caches {
            jobs: Some(caches.jobs.clone()),
            agents: Some(caches.agents.clone()),
            policies: Some(parts.policies),
            runs: Some(caches.runs.clone()),
        },
        memory,
        discovery,
        slots: slots::Slots::new(
            opts.reconcile_concurrency.into(),
            namespace_slots(opts).into(),
        ),
    };
    Ok((Arc::new(ctx), discovered))
}

/// One stop signal for both controllers: shutdown, or leadership lost.
fn stop_signal(
    shutdown: std::pin::Pin<Box<impl std::future::Future<Output = ()> + Send + 'static>>,
    lost: Option<impl std::future::Future<Output = ()> + Send + 'static>,
) -> tokio::sync::watch::Receiver<bool> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let lost = async move {
            match lost {
                Some(lost) => lost.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown => tracing::info!("shutting down"),
            _ = lost => tracing::error!("leadership lost; stopping"),
        }
        let _ = stop_tx.send(true);
    });
    stop_rx
}

/// The APIs the controller watches: one namespace's, or every namespace's.
fn watched_apis(
    opts: &Options,
    client: &Client,
) -> (
    Api<AgentRun>,
    Api<Job>,
    Api<PartialObjectMeta<Approval>>,
    Api<Agent>,
) {
    match &opts.namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
        ),
    }
}

/// The AgentRun controller (woken by its runs, their Jobs and Approvals,
/// head events, lapsed leases, finished discoveries and their Agents) and
/// the Agent status controller, until `stop`.
async fn run_controllers(
    opts: &Options,
    ctx: Arc<context::Context>,
    caches: Caches,
    watches: &watches::Watches,
    wake: impl futures::Stream<Item = ObjectRef<AgentRun>> + Send + 'static,
    discovered: Discovered,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let (runs, jobs, approvals, agents) = watched_apis(opts, &ctx.client);
    let mut watched = watcher::Config::default();
    if let Some(selector) = &opts.run_selector {
        watched = watched.labels(selector);
    }
    let run_events = watches
        .follow("agentruns", watcher(runs, watched))
        .default_backoff()
        .modify(slim_run)
        .reflect(caches.runs_writer)
        .applied_objects();
    // Unbounded here: `Slots` bounds reconciles, fairly between namespaces.
    let controller = Controller::for_stream(run_events, caches.runs.clone());
    ctx.metrics.watch_runs(caches.runs.clone());
    // Only the operator's own Jobs, without their pod templates or field
    // ownership: thousands of step Jobs stay small in memory.
    let job_events = watches
        .follow(
            "jobs",
            watcher(jobs, watcher::Config::default().labels(job::RUN_LABEL)),
        )
        .default_backoff()
        .modify(job::slim)
        .reflect(caches.jobs_writer)
        .touched_objects();
    let agent_events = watches
        .follow(
            "agents",
            watcher(agents.clone(), watcher::Config::default()),
        )
        .default_backoff()
        .reflect(caches.agents_writer)
        .touched_objects();
    let runs_controller = controller
        .owns_stream(job_events)
        // Approvals wake their run; their content is read when it is judged.
        .owns_stream(
            watches
                .follow("approvals", watcher(approvals, watcher::Config::default()))
                .default_backoff()
                .touched_objects(),
        )
        .reconcile_on(wake)
        .reconcile_on(futures::stream::unfold(discovered, |mut rx| async move {
            rx.recv().await.map(|r| (r, rx))
        }))
        .watches_stream(agent_events, runs_of_agent(caches.runs))
        .graceful_shutdown_on(stopped(stop.clone()))
        .run(reconciler::reconcile, reconciler::error_policy, ctx.clone())
        .for_each(|_| async {});
    tokio::join!(
        runs_controller,
        agent::run(agents, ctx.client.clone(), watches, stopped(stop))
    );
}

/// When an Agent appears or changes, the runs naming it (as `agentRef`,
/// `forkOf.agent` or `testOf.agent`) are reconciled at once.
fn runs_of_agent(
    runs: reflector::Store<AgentRun>,
) -> impl Fn(Agent) -> Vec<ObjectRef<AgentRun>> + Send + Sync + 'static {
    move |agent: Agent| {
        let ns = agent.namespace();
        runs.state()
            .into_iter()
            .filter(|run| run.namespace() == ns && run.spec.names_agent(&agent.name_any()))
            .map(|run| ObjectRef::from_obj(&*run))
            .collect()
    }
}

/// What the controller keeps of a run in its watch cache: no field ownership
/// and no copy of the manifest `kubectl apply` leaves in an annotation
/// (nothing reads them), so ten thousand waiting runs stay small in memory.
fn slim_run(run: &mut AgentRun) {
    run.metadata.managed_fields = None;
    if let Some(a) = run.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// The runs to reconcile besides what the API server's watches say: those
/// whose log head moved (head events), those whose worker's lease lapsed
/// (one store query every [`SWEEP_EVERY`] for all runs), and every run
/// followed when head events may have been missed. Also forgets the
/// replayed logs of runs deleted unfinished.
fn wake_runs(
    ctx: Arc<context::Context>,
    head_events: Option<tokio::sync::mpsc::Receiver<crate::store::HeadEvent>>,
    store: Arc<dyn crate::store::StepStore>,
    runs: kube::runtime::reflector::Store<AgentRun>,
) -> impl futures::Stream<Item = ObjectRef<AgentRun>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    if let Some(mut events) = head_events {
        let (ctx, tx) = (ctx.clone(), tx.clone());
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if event == crate::store::HeadEvent::Resync {
                    ctx.memory.set_pushed();
                }
                for run in ctx.memory.on_event(event) {
                    if tx.send(run).is_err() {
                        return;
                    }
                }
            }
        });
    }
    tokio::spawn(async move {
        let mut since = chrono::Utc::now() - chrono::Duration::seconds(30);
        let mut ticks = tokio::time::interval(SWEEP_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for n in 0u64.. {
            ticks.tick().await;
            match store.lapsed_leases(since).await {
                Ok((lapsed, now)) => {
                    since = now;
                    for run in ctx.memory.refs_of(&lapsed) {
                        if tx.send(run).is_err() {
                            return;
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "looking for lapsed step leases"),
            }
            // Runs deleted before they finished leave nothing behind.
            if n % 30 == 29 && runs.wait_until_ready().await.is_ok() {
                let live: std::collections::HashSet<String> =
                    runs.state().iter().filter_map(|r| r.uid()).collect();
                ctx.memory.retain(|uid| live.contains(uid));
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) })
}

/// Reconciles of one namespace at once (see `--reconcile-namespace-concurrency`).
fn namespace_slots(opts: &Options) -> u16 {
    match (opts.reconcile_namespace_concurrency, &opts.namespace) {
        (Some(n), _) => n,
        (None, Some(_)) => 0,
        (None, None) => (opts.reconcile_concurrency / 4).max(1),
    }
}

/// How often the store is asked for lapsed leases.
const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// The gateway URL step pods are given.
/// The gateway's bounds from the flags, its connection slots fitted in the
/// open-files limit (an exhausted descriptor table would silence the probes too).
fn gateway_limits(opts: &Options, open_files: Option<u64>) -> gateway::GatewayLimits {
    let wanted = opts.step_api_max_connections.max(1);
    let max_connections = crate::bounded::fitting_connections(wanted, open_files);
    if max_connections < wanted {
        tracing::warn!(
            wanted,
            max_connections,
            open_files,
            "--step-api-max-connections lowered to fit the open-files limit"
        );
    }
    gateway::GatewayLimits {
        server: crate::bounded::Limits {
            max_connections,
            header_timeout: Duration::from_secs(opts.step_api_header_timeout_seconds.max(1)),
            body_timeout: Duration::from_secs(opts.step_api_body_timeout_seconds.max(1)),
        },
        body_budget: opts.step_api_body_budget_mib.saturating_mul(1 << 20),
    }
}

fn step_api_url(opts: &Options, served: SocketAddr) -> Result<String, StartupError> {
    if let Some(url) = &opts.step_api_url {
        let parsed = url::Url::parse(url).map_err(|error| StartupError::StepApiUrl {
            url: url.clone(),
            error,
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(StartupError::StepApiScheme(url.clone()));
        }
        return Ok(url.trim_end_matches('/').to_string());
    }
    if opts.step_api_addr.ip().is_unspecified() {
        return Err(StartupError::StepApiWildcard(opts.step_api_addr));
    }
    Ok(format!("http://{served}"))
}

/// Waits until the agentrun CRDs are installed and established (`/readyz`
/// names the one waited for).
async fn wait_for_crds(client: &Client, watches: &watches::Watches) -> Result<(), StartupError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crate::api::crds() {
        let name = crd.name_any();
        tracing::info!(crd = %name, "waiting for CRD to be established");
        let wait = format!("crd/{name}");
        watches.waiting(&wait, "not established yet (install crds/)");
        await_condition(crds.clone(), &name, conditions::is_crd_established()).await?;
        watches.done(&wait);
    }
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    // Give in-flight reconciles a moment; kube-runtime waits for them too.
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cached_run_keeps_its_own_annotations_but_not_kubectls_copy_of_the_manifest() {
        let mut run: super::AgentRun = serde_json::from_value(serde_json::json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r", "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{\"spec\":{}}",
                "agentrun.dev/requester": "alice"},
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "spec": {"input": "x", "agentRef": {"name": "a"}}
        }))
        .unwrap();
        super::slim_run(&mut run);
        let annotations = run.metadata.annotations.unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            ["agentrun.dev/requester"]
        );
        assert!(run.metadata.managed_fields.is_none());
    }

    #[test]
    fn a_change_to_an_agent_reaches_the_runs_forks_and_tests_that_name_it() {
        use kube::runtime::reflector::{self, store::Writer};
        use kube::runtime::watcher::Event;
        let run = |name: &str, ns: &str, spec: serde_json::Value| -> super::AgentRun {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                "metadata": {"name": name, "namespace": ns},
                "spec": spec,
            }))
            .unwrap()
        };
        let (store, mut writer): (_, Writer<super::AgentRun>) = reflector::store();
        for r in [
            run(
                "by-ref",
                "a",
                serde_json::json!({"input": "x", "agentRef": {"name": "refund"}}),
            ),
            run(
                "fork-onto",
                "a",
                serde_json::json!({"input": "x", "forkOf": {"run": "p", "seq": 3, "agent": "refund"}}),
            ),
            run(
                "test-of",
                "a",
                serde_json::json!({"input": "x", "testOf": {"run": "p", "agent": "refund"}}),
            ),
            run(
                "fork-keeps",
                "a",
                serde_json::json!({"input": "x", "forkOf": {"run": "p", "seq": 3}}),
            ),
            run(
                "other-agent",
                "a",
                serde_json::json!({"input": "x", "agentRef": {"name": "incident"}}),
            ),
            run(
                "other-ns",
                "b",
                serde_json::json!({"input": "x", "agentRef": {"name": "refund"}}),
            ),
        ] {
            writer.apply_watcher_event(&Event::Apply(r));
        }
        let mut agent = super::Agent::new("refund", crate::api::AgentTemplate::default());
        agent.metadata.namespace = Some("a".into());
        let mut names: Vec<String> = super::runs_of_agent(store)(agent)
            .into_iter()
            .map(|r| r.name)
            .collect();
        names.sort();
        assert_eq!(names, ["by-ref", "fork-onto", "test-of"]);
    }
}
