//! The controller's HTTPS port: what the API server calls, the log API
//! (through its aggregation layer) and the requester-stamping admission
//! webhook. Served by every replica, leader or not, from a runtime of its
//! own (as the step-log gateway is), with its own store pool and API client.
//!
//! Its TLS material is re-read every [`REFRESH`]: the serving certificate
//! (a file a Secret mount updates, or one the controller provisioned) and
//! the front-proxy CA the API server publishes, so rotations land without a
//! restart.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::log_api::LogApi;
use super::log_api::front_proxy::RequestHeaderConfig;
use super::own_runtime::StartError;
use crate::bounded::Limits;
use crate::bounded::tls::{Material, TlsConfigs};

/// How often the TLS material is looked at again.
const REFRESH: Duration = Duration::from_secs(30);

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum CertSource {
    /// PEM files (a mounted Secret), re-read when they change.
    Files { cert: PathBuf, key: PathBuf },
    /// PEM texts (provisioned by the controller itself).
    Pem { cert: String, key: String },
}

impl CertSource {
    fn read(&self) -> Result<(String, String), StartError> {
        match self {
            CertSource::Files { cert, key } => {
                let read = |p: &PathBuf, what| {
                    std::fs::read_to_string(p).map_err(|error| StartError::ReadCertificate {
                        what,
                        path: p.clone(),
                        error,
                    })
                };
                Ok((read(cert, "certificate")?, read(key, "key")?))
            }
            CertSource::Pem { cert, key } => Ok((cert.clone(), key.clone())),
        }
    }
}

/// What the HTTPS server needs.
pub struct Settings {
    pub addr: SocketAddr,
    pub cert: CertSource,
    pub store_url: String,
    pub store_connections: u32,
    /// Serve only this namespace's runs.
    pub namespace: Option<String>,
    pub authz_ttl: Duration,
    pub limits: Limits,
}

/// Starts the server on a runtime of its own; returns the bound address.
pub async fn spawn(settings: Settings) -> Result<SocketAddr, StartError> {
    super::own_runtime::spawn("https", move || start(settings)).await
}

async fn start(s: Settings) -> Result<SocketAddr, StartError> {
    let pool = crate::store::OpenOptions {
        max_connections: s.store_connections.max(2),
        ..Default::default()
    };
    let store = crate::store::open_with(&s.store_url, &pool).await?;
    let client = kube::Client::try_default().await?;
    let api = LogApi::new(store, client.clone(), s.namespace.clone(), s.authz_ttl).await?;
    let headers = read_request_headers(&client).await;
    let (cert, key) = s.cert.read()?;
    let tls = TlsConfigs::new(material(cert, key, headers.as_ref()))?;
    api.set_request_headers(headers);
    let listener = super::own_runtime::bind_shared(s.addr)?;
    let local = listener.local_addr()?;
    tokio::spawn(refresh(client, s.cert, tls.clone(), api.clone()));
    let router = super::log_api::router(api).merge(super::admission::router());
    tokio::spawn(crate::bounded::serve_tls(listener, router, s.limits, tls));
    Ok(local)
}

fn material(cert_pem: String, key_pem: String, headers: Option<&RequestHeaderConfig>) -> Material {
    Material {
        cert_pem,
        key_pem,
        client_ca_pem: headers.map(|h| h.client_ca_pem.clone()).unwrap_or_default(),
    }
}

/// The front-proxy settings, or `None` (logged) when they cannot be read:
/// then every log API request is refused as unauthenticated.
async fn read_request_headers(client: &kube::Client) -> Option<RequestHeaderConfig> {
    match RequestHeaderConfig::read(client).await {
        Ok(Some(c)) => Some(c),
        Ok(None) => {
            tracing::warn!(
                "the API server publishes no front-proxy CA (kube-system/extension-apiserver-authentication): the log API refuses every request until it does"
            );
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "reading the front-proxy settings; the log API refuses every request until they are read");
            None
        }
    }
}

/// Re-reads the TLS material every [`REFRESH`] and swaps what changed.
async fn refresh(client: kube::Client, cert: CertSource, tls: TlsConfigs, api: LogApi) {
    loop {
        tokio::time::sleep(REFRESH).await;
        let headers = read_request_headers(&client).await;
        let (cert_pem, key_pem) = match cert.read() {
            Ok(pair) => pair,
            Err(e) => {
                tracing::warn!(error = %e, "re-reading the serving certificate; keeping the current one");
                continue;
            }
        };
        match tls.update(material(cert_pem, key_pem, headers.as_ref())) {
            Ok(true) => tracing::info!(
                "the HTTPS server's certificate or front-proxy CA changed; new connections use the new one"
            ),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "new TLS material refused; keeping the current one")
            }
        }
        api.set_request_headers(headers);
    }
}
