//! Who is asking, as Kubernetes' aggregation layer tells it: the API server
//! authenticates the person (any method it supports), then calls us with
//! its front-proxy client certificate and the user in `X-Remote-*` headers.
//! Those headers mean something only on a connection that presented that
//! certificate: anyone else could write them. What the certificate must
//! chain to and be called, and which headers carry the user, the API server
//! publishes in `kube-system/extension-apiserver-authentication`.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;

use crate::bounded::tls::PeerCert;

/// Namespace and name of the ConfigMap the API server publishes.
pub const CONFIGMAP_NAMESPACE: &str = "kube-system";
pub const CONFIGMAP: &str = "extension-apiserver-authentication";

/// The request-header authentication the API server configured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHeaderConfig {
    /// The front-proxy CA bundle (PEM); empty: not configured.
    pub client_ca_pem: String,
    /// Common names the proxy's certificate may have; empty: any the CA signed.
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
    pub uid_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_prefixes: Vec<String>,
}

/// Why the front-proxy settings could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrontProxyError {
    #[error("reading ConfigMap {CONFIGMAP_NAMESPACE}/{CONFIGMAP}: {0}")]
    Read(kube::Error),
    #[error("{CONFIGMAP_NAMESPACE}/{CONFIGMAP} entry {key}: not a JSON list of strings: {error}")]
    Entry {
        key: &'static str,
        error: serde_json::Error,
    },
}

impl RequestHeaderConfig {
    /// Reads it from the ConfigMap's `data`; an error names the entry.
    pub fn from_data(
        data: &BTreeMap<String, String>,
    ) -> Result<RequestHeaderConfig, FrontProxyError> {
        let list = |key: &'static str| -> Result<Vec<String>, FrontProxyError> {
            match data.get(key) {
                None => Ok(Vec::new()),
                Some(v) if v.trim().is_empty() => Ok(Vec::new()),
                Some(v) => {
                    serde_json::from_str(v).map_err(|error| FrontProxyError::Entry { key, error })
                }
            }
        };
        Ok(RequestHeaderConfig {
            client_ca_pem: data
                .get("requestheader-client-ca-file")
                .cloned()
                .unwrap_or_default(),
            allowed_names: list("requestheader-allowed-names")?,
            username_headers: list("requestheader-username-headers")?,
            uid_headers: list("requestheader-uid-headers")?,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
        })
    }

    /// Reads the ConfigMap; `Ok(None)` when the API server publishes none
    /// (the aggregation layer is off: nothing can be authenticated).
    pub async fn read(
        client: &kube::Client,
    ) -> Result<Option<RequestHeaderConfig>, FrontProxyError> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), CONFIGMAP_NAMESPACE);
        let cm = api
            .get_opt(CONFIGMAP)
            .await
            .map_err(FrontProxyError::Read)?;
        let Some(cm) = cm else { return Ok(None) };
        let config = RequestHeaderConfig::from_data(&cm.data.unwrap_or_default())?;
        Ok((!config.client_ca_pem.trim().is_empty()).then_some(config))
    }
}

/// An authenticated person, as the API server vouched for them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct User {
    pub name: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Why a request is not authenticated (HTTP 401).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error(
        "no client certificate: only the Kubernetes API server's front proxy may call the log API (use kubectl against the API server)"
    )]
    NoCertificate,
    #[error(
        "the client certificate's common name {0:?} is not one the API server allows for its front proxy"
    )]
    NameNotAllowed(String),
    #[error("the front proxy named no user (header {0})")]
    NoUser(String),
    #[error("the API server publishes no front-proxy configuration (is the aggregation layer on?)")]
    NotConfigured,
}

/// The user a request speaks for, or why it speaks for nobody.
pub fn authenticate(
    config: Option<&RequestHeaderConfig>,
    cert: Option<&PeerCert>,
    headers: &HeaderMap,
) -> Result<User, Unauthenticated> {
    let config = config.ok_or(Unauthenticated::NotConfigured)?;
    // The TLS handshake verified any presented certificate against the
    // front-proxy CA; no certificate means nobody vouches for the headers.
    let cn = cert
        .and_then(|c| c.common_name.clone())
        .ok_or(Unauthenticated::NoCertificate)?;
    if !config.allowed_names.is_empty() && !config.allowed_names.contains(&cn) {
        return Err(Unauthenticated::NameNotAllowed(cn));
    }
    let name = first_value(headers, &config.username_headers)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Unauthenticated::NoUser(config.username_headers.join(", ")))?;
    let groups = config
        .group_headers
        .iter()
        .flat_map(|h| headers.get_all(h.as_str()))
        .filter_map(|v| v.to_str().ok())
        .map(str::to_string)
        .collect();
    Ok(User {
        name,
        uid: first_value(headers, &config.uid_headers),
        groups,
        extra: extra(headers, &config.extra_prefixes),
    })
}

fn first_value(headers: &HeaderMap, names: &[String]) -> Option<String> {
    names
        .iter()
        .find_map(|h| headers.get(h.as_str()))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// `X-Remote-Extra-<key>` headers: the key lower-cased and unescaped
/// (the API server percent-encodes it).
fn extra(headers: &HeaderMap, prefixes: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in headers {
        let lower = name.as_str();
        let Some(key) = prefixes.iter().find_map(|p| {
            let p = p.to_ascii_lowercase();
            lower.strip_prefix(p.as_str()).map(str::to_string)
        }) else {
            continue;
        };
        let key = percent_encoding::percent_decode_str(&key)
            .decode_utf8_lossy()
            .to_lowercase();
        if let Ok(v) = value.to_str() {
            out.entry(key).or_default().push(v.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RequestHeaderConfig {
        let data: BTreeMap<String, String> = [
            (
                "requestheader-client-ca-file",
                "-----BEGIN CERTIFICATE-----\n",
            ),
            ("requestheader-allowed-names", r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            (
                "requestheader-extra-headers-prefix",
                r#"["X-Remote-Extra-"]"#,
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        RequestHeaderConfig::from_data(&data).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn cert(cn: &str) -> PeerCert {
        PeerCert {
            common_name: Some(cn.into()),
        }
    }

    #[test]
    fn the_user_comes_from_the_headers_only_behind_the_front_proxy_certificate() {
        let c = config();
        let h = headers(&[
            ("X-Remote-User", "alice"),
            ("X-Remote-Group", "finance"),
            ("X-Remote-Group", "system:authenticated"),
            ("X-Remote-Extra-Scopes%2fone", "a"),
        ]);
        let user = authenticate(Some(&c), Some(&cert("front-proxy-client")), &h).unwrap();
        assert_eq!(user.name, "alice");
        assert_eq!(user.groups, ["finance", "system:authenticated"]);
        assert_eq!(user.extra.get("scopes/one").unwrap(), &["a"]);

        assert_eq!(
            authenticate(Some(&c), None, &h),
            Err(Unauthenticated::NoCertificate)
        );
        assert_eq!(
            authenticate(Some(&c), Some(&PeerCert::default()), &h),
            Err(Unauthenticated::NoCertificate)
        );
        assert_eq!(
            authenticate(Some(&c), Some(&cert("alice")), &h),
            Err(Unauthenticated::NameNotAllowed("alice".into()))
        );
        assert_eq!(
            authenticate(None, Some(&cert("front-proxy-client")), &h),
            Err(Unauthenticated::NotConfigured)
        );
        assert!(matches!(
            authenticate(Some(&c), Some(&cert("front-proxy-client")), &headers(&[])),
            Err(Unauthenticated::NoUser(_))
        ));
    }

    #[test]
    fn a_malformed_configmap_entry_is_named() {
        let data: BTreeMap<String, String> = [(
            "requestheader-allowed-names".to_string(),
            "front".to_string(),
        )]
        .into();
        let err = RequestHeaderConfig::from_data(&data)
            .unwrap_err()
            .to_string();
        assert!(err.contains("requestheader-allowed-names"), "{err}");
    }
}
