//! TLS for the controller's HTTPS port (the log API and the admission
//! webhook): the serving certificate, reloaded when it changes (a rotation
//! by cert-manager or the chart lands without a restart), and the clients'
//! certificates checked against the front-proxy CA the API server publishes
//! (so the log API can tell the aggregator from anyone else).
//!
//! A client certificate is optional at the TLS level (the API server calls
//! the webhook without one); one that is presented must chain to the
//! front-proxy CA or the handshake fails. What a request may do with or
//! without one is the router's decision ([`PeerCert`]).

use std::sync::{Arc, RwLock};

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

/// The client's certificate as the handshake verified it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerCert {
    /// Common name of the verified end-entity certificate; `None` when the
    /// client presented none.
    pub common_name: Option<String>,
}

impl PeerCert {
    /// What the finished handshake of `conn` verified.
    pub fn of(conn: &rustls::ServerConnection) -> PeerCert {
        let common_name = conn
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(|der| common_name(der.as_ref()));
        PeerCert { common_name }
    }
}

/// The subject's CN of a DER certificate.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string)
}

/// PEM texts the server is configured from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Material {
    pub cert_pem: String,
    pub key_pem: String,
    /// The front-proxy CA bundle (`requestheader-client-ca-file`); empty
    /// while unknown: then no client certificate is accepted.
    pub client_ca_pem: String,
}

/// The current TLS configuration, swapped whole when its material changes;
/// a connection uses the one current at its handshake.
#[derive(Clone)]
pub struct TlsConfigs {
    current: Arc<RwLock<(Material, TlsAcceptor)>>,
}

impl TlsConfigs {
    /// Builds the first configuration; an error names what is wrong.
    pub fn new(material: Material) -> Result<TlsConfigs, TlsError> {
        let acceptor = acceptor(&material)?;
        Ok(TlsConfigs {
            current: Arc::new(RwLock::new((material, acceptor))),
        })
    }

    /// The acceptor for a new connection.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.current.read().expect("not poisoned").1.clone()
    }

    /// The material in force.
    pub fn material(&self) -> Material {
        self.current.read().expect("not poisoned").0.clone()
    }

    /// Switches to `material` when it differs; a material that does not
    /// make a configuration is refused and the current one kept.
    pub fn update(&self, material: Material) -> Result<bool, TlsError> {
        if self.material() == material {
            return Ok(false);
        }
        let acceptor = acceptor(&material)?;
        *self.current.write().expect("not poisoned") = (material, acceptor);
        Ok(true)
    }
}

/// Why a material makes no TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the serving certificate: {0}")]
    Certificate(rustls::pki_types::pem::Error),
    #[error("the serving certificate: no CERTIFICATE block")]
    NoCertificate,
    #[error("the serving key: {0}")]
    Key(rustls::pki_types::pem::Error),
    #[error(transparent)]
    Protocols(rustls::Error),
    #[error("the front-proxy CA: {0}")]
    FrontProxyCa(Box<dyn std::error::Error + Send + Sync>),
    #[error("the serving certificate and key: {0}")]
    CertificateAndKey(rustls::Error),
}

fn acceptor(m: &Material) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(m.cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(TlsError::Certificate)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(m.key_pem.as_bytes()).map_err(TlsError::Key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?;
    let mut config = match client_roots(&m.client_ca_pem)? {
        Some(roots) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::FrontProxyCa(e.into()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    }
    .with_single_cert(certs, key)
    .map_err(TlsError::CertificateAndKey)?;
    // HTTP/1.1 only: watch streams are chunked responses, and the
    // connection slots count HTTP/1 connections.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The front-proxy CA bundle as roots; `None` for an empty bundle.
fn client_roots(pem: &str) -> Result<Option<RootCertStore>, TlsError> {
    if pem.trim().is_empty() {
        return Ok(None);
    }
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| TlsError::FrontProxyCa(e.into()))?;
        roots
            .add(cert)
            .map_err(|e| TlsError::FrontProxyCa(e.into()))?;
    }
    Ok((!roots.is_empty()).then_some(roots))
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A CA and a leaf it signed (PEM): `(ca_cert, leaf_cert, leaf_key)`.
    pub fn issue(cn: &str, dns: &[&str]) -> (String, String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, format!("{cn}-ca"));
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut leaf =
            rcgen::CertificateParams::new(dns.iter().map(|d| d.to_string()).collect::<Vec<_>>())
                .unwrap();
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, cn.to_string());
        let cert = leaf.signed_by(&key, &issuer).unwrap();
        (ca_cert.pem(), cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_configuration_is_swapped_only_for_new_valid_material() {
        let (_, cert, key) = issue("server", &["localhost"]);
        let (front_ca, _, _) = issue("front-proxy", &[]);
        let m = Material {
            cert_pem: cert,
            key_pem: key,
            client_ca_pem: String::new(),
        };
        let configs = TlsConfigs::new(m.clone()).unwrap();
        assert!(!configs.update(m.clone()).unwrap(), "same material");
        let with_ca = Material {
            client_ca_pem: front_ca,
            ..m.clone()
        };
        assert!(configs.update(with_ca.clone()).unwrap());
        let broken = Material {
            key_pem: "not a key".into(),
            ..m
        };
        assert!(configs.update(broken).is_err());
        assert_eq!(
            configs.material(),
            with_ca,
            "a bad update keeps the current one"
        );
    }

    #[test]
    fn the_common_name_is_read_from_a_certificate() {
        let (_, cert, _) = issue("front-proxy-client", &[]);
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert_eq!(
            common_name(der.as_ref()).as_deref(),
            Some("front-proxy-client")
        );
    }
}
