//! Service-account identity for pods that mount a token.
//!
//! A real kubelet writes the projected token into a volume. Here processes
//! share the host filesystem, so the node writes a kubeconfig (cluster URL,
//! CA, bound token) into the pod dir and points `KUBECONFIG` at it. A pod
//! without a token volume (`automountServiceAccountToken: false`) gets no
//! credentials at all.

use std::{
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Container, Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::json;
use tracing::{info, warn};

use crate::NodeCtx;

/// The projected volume the ServiceAccount admission plugin adds.
#[derive(Debug, Clone)]
pub struct TokenVolume {
    pub volume: String,
    pub audience: Option<String>,
    pub expiration_seconds: Option<i64>,
}

/// The first volume projecting a service-account token, if any.
pub fn token_volume(pod: &Pod) -> Option<TokenVolume> {
    let volumes = pod.spec.as_ref()?.volumes.as_ref()?;
    volumes.iter().find_map(|v| {
        let sources = v.projected.as_ref()?.sources.as_ref()?;
        let sat = sources
            .iter()
            .find_map(|s| s.service_account_token.as_ref())?;
        Some(TokenVolume {
            volume: v.name.clone(),
            audience: sat.audience.clone().filter(|a| !a.is_empty()),
            expiration_seconds: sat.expiration_seconds,
        })
    })
}

/// Whether `container` mounts the token volume (mounts are per container).
pub fn mounts(container: &Container, token: &TokenVolume) -> bool {
    container
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| m.name == token.volume)
}

/// A kubeconfig kept fresh for as long as the value lives.
pub struct Identity {
    pub kubeconfig: PathBuf,
    refresher: tokio::task::JoinHandle<()>,
}

impl Drop for Identity {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

struct Token {
    token: String,
    /// How long until it should be renewed (80% of its lifetime, as the kubelet).
    renew_in: Duration,
}

async fn request_token(ctx: &NodeCtx, pod: &Pod, vol: &TokenVolume) -> anyhow::Result<Token> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let sa_name = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("default");
    let api: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), namespace);
    let mut spec = json!({
        // Empty audiences mean the API server's own audience.
        "audiences": vol.audience.iter().collect::<Vec<_>>(),
        "boundObjectRef": {
            "apiVersion": "v1", "kind": "Pod",
            "name": pod.metadata.name, "uid": pod.metadata.uid,
        },
    });
    if let Some(exp) = vol.expiration_seconds {
        spec["expirationSeconds"] = json!(exp);
    }
    let request = json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": spec,
    });
    let response: serde_json::Value = api
        .create_subresource("token", sa_name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for serviceaccount {namespace}/{sa_name}"))?;
    let token = response["status"]["token"]
        .as_str()
        .filter(|t| !t.is_empty())
        .context("TokenRequest returned no token")?
        .to_string();
    let lifetime = response["status"]["expirationTimestamp"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .and_then(|exp| {
            (exp.with_timezone(&chrono::Utc) - chrono::Utc::now())
                .to_std()
                .ok()
        })
        .unwrap_or(Duration::from_secs(600));
    Ok(Token {
        token,
        renew_in: lifetime.mul_f64(0.8).max(Duration::from_secs(30)),
    })
}

fn kubeconfig_yaml(ctx: &NodeCtx, namespace: &str, token: &str) -> anyhow::Result<String> {
    let mut cluster = json!({ "server": ctx.server_url });
    match &ctx.ca_data {
        Some(ca) => cluster["certificate-authority-data"] = json!(ca),
        None => warn!("no CA known: pod kubeconfigs will not verify the API server"),
    }
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "cluster", "cluster": cluster }],
        "users": [{ "name": "serviceaccount", "user": { "token": token } }],
        "contexts": [{
            "name": "serviceaccount",
            "context": { "cluster": "cluster", "user": "serviceaccount", "namespace": namespace },
        }],
        "current-context": "serviceaccount",
    });
    Ok(serde_yaml::to_string(&config)?)
}

/// Writes atomically so a process never reads a half-written kubeconfig.
fn write_private(path: &Path, contents: &str, owner: Option<(u32, u32)>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(contents.as_bytes())?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Requests a token bound to the pod and writes the pod's kubeconfig into
/// `dir`, renewing it in the background.
pub async fn provision(
    ctx: Arc<NodeCtx>,
    pod: &Pod,
    vol: TokenVolume,
    dir: &Path,
    owner: Option<(u32, u32)>,
) -> anyhow::Result<Identity> {
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let path = dir.join("kubeconfig");
    let first = request_token(&ctx, pod, &vol).await?;
    write_private(
        &path,
        &kubeconfig_yaml(&ctx, &namespace, &first.token)?,
        owner,
    )?;
    info!(pod = pod.metadata.name.as_deref().unwrap_or(""), %namespace, "service-account kubeconfig written");

    let (pod, file) = (pod.clone(), path.clone());
    let refresher = tokio::spawn(async move {
        let mut wait = first.renew_in;
        loop {
            tokio::time::sleep(wait).await;
            let renewed = async {
                let token = request_token(&ctx, &pod, &vol).await?;
                write_private(
                    &file,
                    &kubeconfig_yaml(&ctx, &namespace, &token.token)?,
                    owner,
                )?;
                anyhow::Ok(token.renew_in)
            };
            wait = match renewed.await {
                Ok(next) => next,
                Err(e) => {
                    warn!(error = %format!("{e:#}"), "renewing the pod token failed");
                    Duration::from_secs(10)
                }
            };
        }
    });
    Ok(Identity {
        kubeconfig: path,
        refresher,
    })
}
