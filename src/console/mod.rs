//! The approver's web console (DESIGN.md section 10, "The approver's
//! inbox"): pending Approvals the person may decide, each with its exact
//! arguments beside the model's proposal, the agent's reason, observations
//! and dependencies; approve, reject or edit through a form built from the
//! tool's schema; runs and their timelines from the log API, followed live.
//!
//! Two ways to serve it, one set of pages:
//! - **loopback** (`kubectl agentrun console`): on 127.0.0.1, acting with
//!   the user's own kubeconfig identity; the URL it prints carries a random
//!   session secret, exchanged for an HttpOnly, SameSite=Strict cookie.
//! - **in the cluster** (`agentrun console`, the chart's `console:`): behind
//!   the platform's login proxy, acting with the person's forwarded bearer
//!   token, one kube client per request; its own service account is used
//!   for nothing a person reads or decides.
//!
//! Either way the page holds no credential, every request is checked for
//! its Host (DNS rebinding) and Origin, every write for the session's
//! anti-forgery token, and everything a model, a tool or a run creator
//! wrote is escaped by the templates and never becomes a link or a script.

pub mod form;
pub mod guard;
mod views;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use minijinja::Environment;
use serde::Serialize;

use crate::bounded;

/// `kubectl agentrun console`'s flags.
#[derive(clap::Args, Clone, Debug)]
pub struct LoopbackArgs {
    /// Port to listen on (a free one when 0).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Address to listen on; keep it a loopback address. By default a
    /// random one of 127.0.0.0/8 (where the system routes all of it to
    /// loopback, as Linux does), so that the session cookie, which browsers
    /// scope by host and not by port, goes to no other server on 127.0.0.1.
    #[arg(long)]
    pub address: Option<IpAddr>,
    /// Open the console in the default browser.
    #[arg(long)]
    pub open: bool,
    /// More namespaces to look in when you may not list across all of them
    /// (the context's namespace, or --namespace, always).
    #[arg(long = "also-namespace", value_name = "NAMESPACE")]
    pub also_namespaces: Vec<String>,
    /// Namespace of the controller's published public keys (a run's log is
    /// verified with them).
    #[arg(
        long,
        env = "AGENTRUN_CONTROLLER_NAMESPACE",
        default_value = "agentrun-system"
    )]
    pub controller_namespace: String,
}

/// `agentrun console`'s flags: the console in the cluster, behind a login
/// proxy that forwards each person's token.
#[derive(clap::Args, Clone, Debug)]
pub struct InClusterArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// The URL people open (the login proxy's), e.g.
    /// `https://agentrun.example.com`: requests for another Host or from
    /// another Origin are refused.
    #[arg(long, env = "AGENTRUN_CONSOLE_PUBLIC_URL")]
    pub public_url: url::Url,
    /// The API server (in a pod: from KUBERNETES_SERVICE_HOST/PORT).
    #[arg(long, env = "AGENTRUN_CONSOLE_API_SERVER")]
    pub api_server: Option<String>,
    /// The API server's CA bundle (PEM).
    #[arg(
        long,
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    )]
    pub ca_file: std::path::PathBuf,
    /// Namespaces to look in for people who may not list across all of them.
    #[arg(long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// Namespace of the controller's published public keys.
    #[arg(
        long,
        env = "AGENTRUN_CONTROLLER_NAMESPACE",
        default_value = "agentrun-system"
    )]
    pub controller_namespace: String,
}

/// How the console reaches the API server for a person.
pub enum Mode {
    /// One person, their kubeconfig client, and their one session.
    Loopback {
        client: kube::Client,
        session: LoopbackSession,
    },
    /// Every request as the person whose token the login proxy forwarded.
    InCluster(ClusterAccess),
}

/// The one session of a loopback console. The URL printed carries a
/// ticket that opens it once: its first use sets a session cookie with a
/// secret of its own and burns the ticket, so the URL left in a command
/// line, a terminal's scrollback or the browser's history opens nothing.
pub struct LoopbackSession {
    ticket: String,
    secret: std::sync::OnceLock<String>,
}

impl LoopbackSession {
    /// A session still to be opened with `ticket`.
    pub fn new(ticket: String) -> LoopbackSession {
        LoopbackSession {
            ticket,
            secret: std::sync::OnceLock::new(),
        }
    }

    /// Whether `sent` is the ticket (constant time).
    pub fn is_ticket(&self, sent: &str) -> bool {
        guard::same(sent.as_bytes(), self.ticket.as_bytes())
    }

    /// Opens the session: its secret, or `None` when the ticket was used.
    pub fn open(&self) -> Result<Option<String>, NoRandomness> {
        let fresh = hex::encode(random_bytes()?);
        Ok(self.secret.set(fresh.clone()).is_ok().then_some(fresh))
    }

    /// The session's secret, once opened.
    pub fn secret(&self) -> Option<&str> {
        self.secret.get().map(String::as_str)
    }

    /// A session `ticket` opened already, with `secret`.
    #[cfg(test)]
    pub fn opened(ticket: &str, secret: &str) -> LoopbackSession {
        let session = LoopbackSession::new(ticket.into());
        let _ = session.secret.set(secret.into());
        session
    }
}

/// The API server's address and CA: a client per forwarded token.
pub struct ClusterAccess {
    pub api_server: axum::http::Uri,
    pub ca: Vec<Vec<u8>>,
}

impl ClusterAccess {
    /// A client acting as the holder of `token` (nothing else: no
    /// kubeconfig, no service account).
    pub fn client_for(&self, token: &str) -> Result<kube::Client, kube::Error> {
        let mut config = kube::Config::new(self.api_server.clone());
        config.root_cert = Some(self.ca.clone());
        config.auth_info.token = Some(token.to_string().into());
        config.default_namespace = "default".into();
        kube::Client::try_from(config)
    }
}

/// The console's state.
pub struct Console {
    pub mode: Mode,
    /// Per-process key of the anti-forgery tokens.
    pub key: ring::hmac::Key,
    /// `host:port` requests must name.
    pub host: String,
    /// `scheme://host:port` a browser's Origin must be.
    pub origin: String,
    /// Where to look when the person may not list across namespaces.
    pub namespaces: Vec<String>,
    pub controller_namespace: String,
    templates: Environment<'static>,
}

impl Console {
    pub fn new(
        mode: Mode,
        host: String,
        origin: String,
        namespaces: Vec<String>,
        controller_namespace: String,
    ) -> Result<Console, NoRandomness> {
        Ok(Console {
            mode,
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &random_bytes()?),
            host,
            origin,
            namespaces,
            controller_namespace,
            templates: templates(),
        })
    }

    /// Renders template `name` (escaping HTML: the names end in `.html`).
    pub fn render(&self, name: &str, ctx: impl Serialize) -> Result<String, RenderError> {
        self.templates
            .get_template(name)
            .and_then(|t| t.render(minijinja::value::Serde(&ctx)))
            .map_err(|error| RenderError {
                name: name.to_string(),
                error,
            })
    }

    /// The page saying why a request was refused or failed.
    pub fn page_error(&self, status: StatusCode, why: &str) -> axum::response::Html<String> {
        let ctx = minijinja::context! {
            status => status.as_u16(),
            reason => status.canonical_reason().unwrap_or(""),
            message => why,
        };
        axum::response::Html(self.render("error.html", ctx).unwrap_or_else(|e| {
            // Never the raw message: escaped by hand here.
            format!("<!doctype html><p>{}</p>", html_escape(&e.to_string()))
        }))
    }
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#x27;")
}

fn templates() -> Environment<'static> {
    let mut env = Environment::new();
    for (name, text) in [
        ("base.html", include_str!("templates/base.html")),
        ("error.html", include_str!("templates/error.html")),
        ("inbox.html", include_str!("templates/inbox.html")),
        ("approval.html", include_str!("templates/approval.html")),
        ("runs.html", include_str!("templates/runs.html")),
        ("run.html", include_str!("templates/run.html")),
    ] {
        env.add_template(name, text)
            .unwrap_or_else(|e| panic!("console template {name}: {e}"));
    }
    env
}

/// Listens on `address`, or on a loopback address of its own: a random
/// 127.x.y.z (x not 0, so never 127.0.0.1's neighbours other tools take),
/// else 127.0.0.1 where the system answers only that one.
async fn listen(address: Option<IpAddr>, port: u16) -> Result<tokio::net::TcpListener, ServeError> {
    if let Some(address) = address {
        return tokio::net::TcpListener::bind((address, port))
            .await
            .map_err(|source| ServeError::Listen {
                address: format!("{address}:{port}"),
                source,
            });
    }
    let own = own_loopback(random_bytes()?);
    match tokio::net::TcpListener::bind((own, port)).await {
        Ok(listener) => Ok(listener),
        Err(_) => tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port))
            .await
            .map_err(|source| ServeError::Listen {
                address: format!("127.0.0.1:{port}"),
                source,
            }),
    }
}

/// A loopback address of 127.0.0.0/8 from `random`, outside 127.0.0.0/16.
fn own_loopback(random: [u8; 32]) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, random[0].max(1), random[1], random[2].max(1))
}

/// Why the console could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    NoRandomness(#[from] NoRandomness),
    #[error("listening on {address}")]
    Listen {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("no --api-server and no KUBERNETES_SERVICE_HOST: not in a pod?")]
    NoApiServer(#[source] std::env::VarError),
    #[error("reading the API server's CA {}", .0.display())]
    ReadCa(std::path::PathBuf, #[source] rustls::pki_types::pem::Error),
    #[error("parsing {}", .0.display())]
    ParseCa(std::path::PathBuf, #[source] rustls::pki_types::pem::Error),
    #[error(
        "--public-url {0}: the console serves its pages at the root of its URL; give it without a path"
    )]
    PublicUrlPath(url::Url),
    #[error("--public-url {0} has no host")]
    PublicUrlHost(url::Url),
    #[error("--api-server {0}")]
    ApiServer(String, #[source] axum::http::uri::InvalidUri),
    #[error("the console's listener on {0} failed")]
    ListenerFailed(SocketAddr),
}

/// The system gave no random bytes.
#[derive(Debug, thiserror::Error)]
#[error("no system randomness")]
pub struct NoRandomness;

/// A console template that did not render. The message quotes the cause,
/// so it is a plain field, not a `#[source]` (the chain would say it twice).
#[derive(Debug, thiserror::Error)]
#[error("rendering {name}: {error}")]
pub struct RenderError {
    name: String,
    error: minijinja::Error,
}

fn random_bytes() -> Result<[u8; 32], NoRandomness> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| NoRandomness)?;
    Ok(b)
}

/// The console's routes, behind its gate and headers.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(views::inbox))
        .route("/approvals/{ns}/{name}", get(views::approval))
        .route("/approvals/{ns}/{name}/decide", post(views::decide))
        .route("/runs", get(views::runs))
        .route("/runs/{ns}/{name}", get(views::run))
        .route("/runs/{ns}/{name}/records", get(views::records))
        .route("/runs/{ns}/{name}/fork", post(views::fork))
        .route("/static/console.css", get(views::stylesheet))
        .route("/static/console.js", get(views::script))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(views::not_found)
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            guard::gate,
        ))
        .layer(axum::middleware::from_fn(guard::headers))
        .with_state(console)
}

/// `kubectl agentrun console`: serves on loopback as the kubeconfig's user
/// until interrupted.
pub async fn serve_loopback(
    client: kube::Client,
    namespace: String,
    args: LoopbackArgs,
) -> Result<(), ServeError> {
    if let Some(address) = args.address.filter(|a| !a.is_loopback()) {
        eprintln!(
            "warning: --address {address} is not a loopback address: anyone who can reach it and \
             learns the URL acts as you",
        );
    }
    let listener = listen(args.address, args.port).await?;
    let bound = listener.local_addr()?;
    let host = bound.to_string();
    let ticket = hex::encode(random_bytes()?);
    let mut namespaces = vec![namespace];
    namespaces.extend(args.also_namespaces.iter().cloned());
    namespaces.dedup();
    let console = Console::new(
        Mode::Loopback {
            client,
            session: LoopbackSession::new(ticket.clone()),
        },
        host.clone(),
        format!("http://{host}"),
        namespaces,
        args.controller_namespace.clone(),
    )?;
    let url = format!("http://{host}/?session={ticket}");
    {
        // Whoever reads the URL may stop reading: the console keeps serving.
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "agentrun console: {url}");
        let _ = writeln!(
            out,
            "(acting as your kubeconfig user; the URL opens your session once, in one browser; Ctrl-C stops)"
        );
        let _ = out.flush();
    }
    if args.open {
        open_browser(&url);
    }
    axum::serve(listener, router(Arc::new(console)))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

fn open_browser(url: &str) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    if let Err(e) = std::process::Command::new(opener).arg(url).spawn() {
        eprintln!("could not open a browser ({opener}: {e}); open the URL above");
    }
}

/// `agentrun console`: serves in the cluster, every request as the person
/// whose token the login proxy forwards.
pub async fn serve_in_cluster(args: InClusterArgs) -> anyhow::Result<()> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let api_server = match &args.api_server {
        Some(a) => a.clone(),
        None => {
            let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(ServeError::NoApiServer)?;
            let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
            if host.contains(':') {
                format!("https://[{host}]:{port}")
            } else {
                format!("https://{host}:{port}")
            }
        }
    };
    let ca: Vec<Vec<u8>> = CertificateDer::pem_file_iter(&args.ca_file)
        .map_err(|e| ServeError::ReadCa(args.ca_file.clone(), e))?
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<_, _>>()
        .map_err(|e| ServeError::ParseCa(args.ca_file.clone(), e))?;
    if args.public_url.path() != "/" {
        return Err(ServeError::PublicUrlPath(args.public_url.clone()).into());
    }
    let origin = args.public_url.origin().ascii_serialization();
    let host = match (args.public_url.host_str(), args.public_url.port()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_string(),
        _ => return Err(ServeError::PublicUrlHost(args.public_url.clone()).into()),
    };
    let console = Console::new(
        Mode::InCluster(ClusterAccess {
            api_server: api_server
                .parse()
                .map_err(|e| ServeError::ApiServer(api_server.clone(), e))?,
            ca,
        }),
        host,
        origin,
        args.namespaces.clone(),
        args.controller_namespace.clone(),
    )?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| ServeError::Listen {
            address: args.listen.to_string(),
            source,
        })?;
    tracing::info!(listen = %args.listen, public_url = %args.public_url, "console serving");
    println!(
        "agentrun console on {} for {} (acting with each request's forwarded token)",
        args.listen, args.public_url
    );
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        }
    };
    // Reachable by anyone on the cluster network before its proxy checks
    // them: bounded like every server of the controller (slots, header and
    // body deadlines; bodies are cut at MAX_FORM by the gate).
    let limits = bounded::Limits {
        max_connections: bounded::fitting_connections(512, bounded::raise_open_files_limit()),
        header_timeout: std::time::Duration::from_secs(10),
        body_timeout: std::time::Duration::from_secs(30),
    };
    tokio::select! {
        () = bounded::serve(listener, router(Arc::new(console)), limits) => {
            Err(ServeError::ListenerFailed(args.listen).into())
        }
        () = shutdown => Ok(()),
    }
}

#[cfg(test)]
mod tests;
