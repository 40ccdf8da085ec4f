//! The controller's own serving certificate, for installs without Helm or
//! cert-manager (the kustomize base, `servingCert.mode=controller`): the
//! HTTPS port that serves the log API to the aggregator and the requester
//! stamp to the API server needs a certificate those trust.
//!
//! [`provision`] reads a `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`,
//! `ca.crt`) or, when there is none, generates a CA and a leaf for the
//! Service's DNS names and creates it; the replica that loses the race to
//! create it reads the winner's. The CA's private key is never stored: it
//! signs the one leaf and is dropped, so nothing can mint another
//! certificate this CA vouches for. Both are valid for ten years (a start
//! one day back, for skewed clocks) and are not renewed: to replace them,
//! delete the Secret and restart the controller.
//!
//! [`inject_ca_bundle`] then writes the CA into the APIService and the
//! mutating webhook configuration, so the API server trusts the leaf.

use base64::Engine as _;
use chrono::{Datelike as _, Days, NaiveDate, Utc};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;

use crate::controller::FIELD_MANAGER;

/// The Secret's keys (those of a `kubernetes.io/tls` Secret, and cert-manager's `ca.crt`).
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";
pub const CA_KEY: &str = "ca.crt";
/// Years the generated CA and leaf are valid for.
const VALID_YEARS: i32 = 10;

/// A serving certificate: the leaf, its private key, and the CA that signed it (PEM).
#[derive(Clone)]
pub struct ServingCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl std::fmt::Debug for ServingCert {
    // The private key never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field("ca_pem", &self.ca_pem)
            .finish()
    }
}

/// Why the serving certificate could not be had: what was being done (the
/// text) and why (the source), as the controller's start-up prints them.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}: no `{1}` entry (delete the Secret to have the controller generate one)")]
    NoEntry(String, String),
    #[error("{what}: `{key}` is not PEM text")]
    NotText {
        what: String,
        key: String,
        #[source]
        source: std::string::FromUtf8Error,
    },
    #[error("{what}: `{CERT_KEY}`")]
    Leaf {
        what: String,
        #[source]
        source: Box<CertError>,
    },
    #[error("not a PEM certificate: {0}")]
    NotPem(String),
    #[error("not an X.509 certificate: {0}")]
    NotX509(String),
    #[error(
        "expired or not yet valid (valid from {0} to {1}); delete the Secret and restart the controller to generate a new one"
    )]
    NotValidNow(String, String),
    #[error("unreadable subjectAltName: {0}")]
    SubjectAltName(String),
    #[error(
        "does not name {missing:?} (it names {names:?}); delete the Secret and restart the controller to generate one for the current names"
    )]
    Unnamed {
        missing: Vec<String>,
        names: Vec<String>,
    },
    #[error(
        "--serving-dns-name: at least one DNS name is needed (the Service's, e.g. agentrun-controller.agentrun-system.svc)"
    )]
    NoDnsName,
    #[error(transparent)]
    Params(rcgen::Error),
    #[error("{0}")]
    Generate(&'static str, #[source] rcgen::Error),
    #[error("{what}")]
    Inject {
        what: String,
        #[source]
        source: Box<CertError>,
    },
    #[error("{0}")]
    Step(&'static str, #[source] kube::Error),
    #[error("it has no webhooks")]
    NoWebhooks,
    #[error("building the patch")]
    Patch(#[source] serde_json::Error),
}

/// The serving certificate in Secret `namespace/secret`, generated for
/// `dns_names` and stored there when the Secret does not exist.
pub async fn provision(
    client: &kube::Client,
    namespace: &str,
    secret: &str,
    dns_names: &[String],
) -> Result<ServingCert, CertError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let where_ = format!("Secret {namespace}/{secret}");
    if let Some(existing) = secrets
        .get_opt(secret)
        .await
        .map_err(|source| CertError::Api {
            what: format!("reading {where_}"),
            source,
        })?
    {
        return checked(&existing, &where_, dns_names);
    }
    let generated = generate(dns_names)?;
    match secrets
        .create(&PostParams::default(), &to_secret(secret, &generated))
        .await
    {
        Ok(_) => {
            tracing::info!(secret = %where_, ?dns_names, "generated the serving certificate");
            Ok(generated)
        }
        // Another replica created it first: use theirs, so both serve one certificate.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = secrets.get(secret).await.map_err(|source| CertError::Api {
                what: format!("reading {where_} after another replica created it"),
                source,
            })?;
            checked(&existing, &where_, dns_names)
        }
        Err(source) => Err(CertError::Api {
            what: format!("creating {where_}"),
            source,
        }),
    }
}

/// The certificate of an existing Secret, refused (naming the key and the
/// reason) when it is incomplete, expired or does not cover `dns_names`: a
/// certificate the API server would refuse fails here, where it is said why.
fn checked(secret: &Secret, where_: &str, dns_names: &[String]) -> Result<ServingCert, CertError> {
    let data = secret.data.clone().unwrap_or_default();
    let text = |key: &str| -> Result<String, CertError> {
        let bytes = data
            .get(key)
            .ok_or_else(|| CertError::NoEntry(where_.into(), key.into()))?;
        String::from_utf8(bytes.0.clone()).map_err(|source| CertError::NotText {
            what: where_.into(),
            key: key.into(),
            source,
        })
    };
    let cert = ServingCert {
        cert_pem: text(CERT_KEY)?,
        key_pem: text(KEY_KEY)?,
        ca_pem: text(CA_KEY)?,
    };
    check_leaf(&cert.cert_pem, dns_names).map_err(|e| CertError::Leaf {
        what: where_.into(),
        source: Box::new(e),
    })?;
    Ok(cert)
}

/// The leaf is current and names every one of `dns_names`.
fn check_leaf(cert_pem: &str, dns_names: &[String]) -> Result<(), CertError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| CertError::NotPem(e.to_string()))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| CertError::NotX509(e.to_string()))?;
    if !cert.validity().is_valid() {
        return Err(CertError::NotValidNow(
            cert.validity().not_before.to_string(),
            cert.validity().not_after.to_string(),
        ));
    }
    let names: Vec<&str> = cert
        .subject_alternative_name()
        .map_err(|e| CertError::SubjectAltName(e.to_string()))?
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(*d),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let missing: Vec<&String> = dns_names
        .iter()
        .filter(|d| !names.contains(&d.as_str()))
        .collect();
    if !missing.is_empty() {
        return Err(CertError::Unnamed {
            missing: missing.into_iter().cloned().collect(),
            names: names.into_iter().map(str::to_string).collect(),
        });
    }
    Ok(())
}

/// A new CA and a leaf it signed for `dns_names` (ECDSA P-256).
pub fn generate(dns_names: &[String]) -> Result<ServingCert, CertError> {
    if dns_names.is_empty() {
        return Err(CertError::NoDnsName);
    }
    let today = Utc::now().date_naive();

    let mut ca_params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(CertError::Params)?;
    ca_params.distinguished_name = rcgen::DistinguishedName::new();
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "agentrun-controller-ca");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut ca_params, today);
    let ca_key =
        rcgen::KeyPair::generate().map_err(|e| CertError::Generate("generating the CA key", e))?;
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)
        .map_err(|e| CertError::Generate("signing the CA certificate", e))?;

    let mut leaf_params = rcgen::CertificateParams::new(dns_names.to_vec())
        .map_err(|e| CertError::Generate("--serving-dns-name: not a valid DNS name", e))?;
    leaf_params.distinguished_name = rcgen::DistinguishedName::new();
    leaf_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, dns_names[0].as_str());
    leaf_params.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    leaf_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    leaf_params.use_authority_key_identifier_extension = true;
    set_validity(&mut leaf_params, today);
    let leaf_key = rcgen::KeyPair::generate()
        .map_err(|e| CertError::Generate("generating the serving key", e))?;
    let leaf = leaf_params
        .signed_by(&leaf_key, &ca)
        .map_err(|e| CertError::Generate("signing the serving certificate", e))?;

    Ok(ServingCert {
        cert_pem: leaf.pem(),
        key_pem: leaf_key.serialize_pem(),
        ca_pem: ca.pem(),
    })
}

/// From yesterday (clocks of the API server and the controller may
/// disagree) to the same day [`VALID_YEARS`] later (the 28th at the latest,
/// so that 29 February has a counterpart).
fn set_validity(params: &mut rcgen::CertificateParams, today: NaiveDate) {
    let start = today.checked_sub_days(Days::new(1)).unwrap_or(today);
    let (month, day) = (start.month() as u8, start.day() as u8);
    params.not_before = rcgen::date_time_ymd(start.year(), month, day);
    params.not_after = rcgen::date_time_ymd(start.year() + VALID_YEARS, month, day.min(28));
}

fn to_secret(name: &str, cert: &ServingCert) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/part-of": "agentrun",
                "app.kubernetes.io/component": "controller",
                "app.kubernetes.io/managed-by": FIELD_MANAGER,
            },
        },
        "type": "kubernetes.io/tls",
    }))
    .map(|mut s: Secret| {
        s.data = Some(
            [
                (CERT_KEY, &cert.cert_pem),
                (KEY_KEY, &cert.key_pem),
                (CA_KEY, &cert.ca_pem),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), bytes(v)))
            .collect(),
        );
        s
    })
    .expect("a Secret")
}

/// Patches are the controller's, under its field manager.
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// The API group and version of the APIService kind (not in k8s_openapi).
fn apiservice_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("apiregistration.k8s.io", "v1", "APIService"),
        "apiservices",
    )
}

/// Writes `ca_pem` as the CA bundle of APIService `apiservice`
/// (`spec.caBundle`) and of every webhook of MutatingWebhookConfiguration
/// `webhook` (`webhooks[].clientConfig.caBundle`). Each is read first and
/// written only where it differs, so a restart writes nothing.
pub async fn inject_ca_bundle(
    client: &kube::Client,
    ca_pem: &str,
    apiservice: Option<&str>,
    webhook: Option<&str>,
) -> Result<(), CertError> {
    let bundle = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    if let Some(name) = apiservice {
        inject_apiservice(client, name, &bundle)
            .await
            .map_err(|e| CertError::Inject {
                what: format!("--inject-ca-apiservice: APIService {name}: spec.caBundle"),
                source: Box::new(e),
            })?;
    }
    if let Some(name) = webhook {
        inject_webhook(client, name, &bundle).await.map_err(|e| CertError::Inject {
            what: format!(
                "--inject-ca-webhook: MutatingWebhookConfiguration {name}: webhooks[].clientConfig.caBundle"
            ),
            source: Box::new(e),
        })?;
    }
    Ok(())
}

async fn inject_apiservice(
    client: &kube::Client,
    name: &str,
    bundle: &str,
) -> Result<(), CertError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &apiservice_resource());
    let current = api
        .get(name)
        .await
        .map_err(|e| CertError::Step("reading it", e))?;
    if current.data["spec"]["caBundle"].as_str() == Some(bundle) {
        return Ok(());
    }
    // A merge patch of one nested field: the rest of spec is the installer's.
    let patch = json!({"spec": {"caBundle": bundle}});
    api.patch(name, &patch_params(), &Patch::Merge(&patch))
        .await
        .map_err(|e| CertError::Step("patching it", e))?;
    tracing::info!(
        apiservice = name,
        "wrote the serving CA into the APIService"
    );
    Ok(())
}

async fn inject_webhook(client: &kube::Client, name: &str, bundle: &str) -> Result<(), CertError> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let current = api
        .get(name)
        .await
        .map_err(|e| CertError::Step("reading it", e))?;
    let webhooks = current.webhooks.unwrap_or_default();
    if webhooks.is_empty() {
        return Err(CertError::NoWebhooks);
    }
    let ops = webhook_patch(&webhooks, bundle);
    if ops.is_empty() {
        return Ok(());
    }
    // A JSON Patch: a merge patch would replace the whole list. Each write
    // is guarded by a test of the webhook's name at that index, so a
    // configuration changed since it was read is refused, not corrupted.
    let patch: json_patch::Patch =
        serde_json::from_value(serde_json::Value::Array(ops)).map_err(CertError::Patch)?;
    api.patch(name, &patch_params(), &Patch::<()>::Json(patch))
        .await
        .map_err(|e| CertError::Step("patching it", e))?;
    tracing::info!(
        webhook = name,
        "wrote the serving CA into the webhook configuration"
    );
    Ok(())
}

/// JSON Patch operations setting `bundle` (base64) on each webhook whose
/// CA bundle differs; none when all carry it.
fn webhook_patch(
    webhooks: &[k8s_openapi::api::admissionregistration::v1::MutatingWebhook],
    bundle: &str,
) -> Vec<serde_json::Value> {
    let want = base64::engine::general_purpose::STANDARD
        .decode(bundle)
        .unwrap_or_default();
    webhooks
        .iter()
        .enumerate()
        .filter(|(_, w)| w.client_config.ca_bundle.as_ref().map(|b| &b.0) != Some(&want))
        .flat_map(|(i, w)| {
            [
                json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": w.name}),
                json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": bundle}),
            ]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhook;
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    fn names() -> Vec<String> {
        vec![
            "agentrun-controller.agentrun-system.svc".to_string(),
            "agentrun-controller.agentrun-system.svc.cluster.local".to_string(),
        ]
    }

    /// Verifies `cert` for `name` as a TLS client trusting only `ca` would.
    fn verify(ca_pem: &str, cert_pem: &str, name: &str) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
            .unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            provider,
        )
        .build()
        .unwrap();
        let leaf = CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap();
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .map(|_| ())
    }

    #[test]
    fn the_generated_leaf_verifies_against_its_ca_for_every_name() {
        let cert = generate(&names()).unwrap();
        for name in names() {
            verify(&cert.ca_pem, &cert.cert_pem, &name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        // Not for another name, nor against another CA.
        assert!(verify(&cert.ca_pem, &cert.cert_pem, "evil.example.com").is_err());
        let other = generate(&names()).unwrap();
        assert!(verify(&other.ca_pem, &cert.cert_pem, &names()[0]).is_err());
        // The key is the leaf's, in PEM.
        assert!(
            cert.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"),
            "{}",
            cert.key_pem
        );
        rustls::pki_types::PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes()).unwrap();
        // Debug output never shows it.
        assert!(!format!("{cert:?}").contains("PRIVATE KEY"));
    }

    #[test]
    fn the_generated_leaf_carries_the_sans_and_ten_years() {
        let cert = generate(&names()).unwrap();
        check_leaf(&cert.cert_pem, &names()).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(cert.cert_pem.as_bytes()).unwrap();
        let x509 = pem.parse_x509().unwrap();
        let years = (x509.validity().not_after.timestamp()
            - x509.validity().not_before.timestamp())
            / (365 * 86400);
        assert_eq!(years, 10, "{:?}", x509.validity());
        assert!(
            x509.validity().not_before.timestamp() < Utc::now().timestamp() - 3600,
            "valid from yesterday"
        );
        let (_, ca) = x509_parser::pem::parse_x509_pem(cert.ca_pem.as_bytes()).unwrap();
        assert!(ca.parse_x509().unwrap().is_ca());
        assert!(!x509.is_ca());
        // A name the certificate does not carry is named in the refusal.
        let more = [names(), vec!["other.ns.svc".to_string()]].concat();
        let e = check_leaf(&cert.cert_pem, &more).unwrap_err().to_string();
        assert!(
            e.contains("other.ns.svc") && e.contains("delete the Secret"),
            "{e}"
        );
        assert!(
            generate(&[])
                .unwrap_err()
                .to_string()
                .contains("--serving-dns-name")
        );
    }

    #[test]
    fn the_validity_of_a_leap_day_ends_on_a_real_day() {
        let mut params = rcgen::CertificateParams::default();
        set_validity(&mut params, NaiveDate::from_ymd_opt(2028, 3, 1).unwrap());
        assert_eq!(params.not_before, rcgen::date_time_ymd(2028, 2, 29));
        assert_eq!(params.not_after, rcgen::date_time_ymd(2038, 2, 28));
    }

    #[test]
    fn a_secret_round_trips_and_an_incomplete_one_is_refused_naming_the_key() {
        let cert = generate(&names()).unwrap();
        let secret = to_secret("agentrun-serving-cert", &cert);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        let read = checked(&secret, "Secret ns/agentrun-serving-cert", &names()).unwrap();
        assert_eq!(
            (read.cert_pem, read.key_pem, read.ca_pem),
            (cert.cert_pem, cert.key_pem, cert.ca_pem)
        );
        let mut partial = secret.clone();
        partial.data.as_mut().unwrap().remove(CA_KEY);
        let e = checked(&partial, "Secret ns/s", &names())
            .unwrap_err()
            .to_string();
        assert!(e.contains("Secret ns/s") && e.contains("`ca.crt`"), "{e}");
    }

    #[test]
    fn the_webhook_patch_sets_each_differing_bundle_guarded_by_its_name() {
        let bundle = base64::engine::general_purpose::STANDARD.encode(b"CA");
        let hook = |name: &str, ca: Option<&[u8]>| -> MutatingWebhook {
            serde_json::from_value(json!({
                "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "clientConfig": {"service": {"namespace": "ns", "name": "svc"}}
            }))
            .map(|mut w: MutatingWebhook| {
                w.client_config.ca_bundle = ca.map(|c| ByteString(c.to_vec()));
                w
            })
            .unwrap()
        };
        let hooks = [
            hook("a.agentrun.dev", Some(b"CA")),
            hook("requester.agentrun.dev", None),
        ];
        let ops = webhook_patch(&hooks, &bundle);
        assert_eq!(
            serde_json::Value::Array(ops.clone()),
            json!([
                {"op": "test", "path": "/webhooks/1/name", "value": "requester.agentrun.dev"},
                {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": bundle},
            ])
        );
        // It applies to the configuration as the API server holds it.
        let mut doc = json!({"webhooks": hooks});
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc["webhooks"][1]["clientConfig"]["caBundle"], bundle);
        // Nothing to write when every webhook carries it.
        let done: Vec<MutatingWebhook> = serde_json::from_value(doc["webhooks"].clone()).unwrap();
        assert!(webhook_patch(&done, &bundle).is_empty());
    }
}
