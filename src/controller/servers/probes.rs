//! The controller's HTTP endpoints: `/metrics`, `/healthz`, `/readyz`, and
//! `/loglevel` (GET shows the filter; PUT with a `RUST_LOG`-style body
//! replaces it at run time, accepted from loopback only: reach it with
//! `kubectl port-forward`, which needs `pods/portforward` on the pod).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{ConnectInfo, State};
use axum::{Router, http::StatusCode, routing::get};
use prometheus_client::registry::Registry;

/// What the probes report.
#[derive(Clone)]
pub struct Health {
    pub registry: Arc<Registry>,
    /// Set once the CRDs are established and the client works; a standby
    /// replica is ready too (it serves probes and waits for the lease).
    pub ready: Arc<AtomicBool>,
    /// The watches (and waits) that keep the controller from acting, named
    /// with their errors by `/readyz`.
    pub watches: crate::controller::watchers::health::Watches,
}

pub fn router(health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/loglevel", get(get_log_level).put(put_log_level))
        // A log filter is a line; nothing here reads more.
        .layer(axum::extract::DefaultBodyLimit::max(4096))
        .with_state(health)
}

/// Serves the router on `listener` (with the peer address, for `/loglevel`),
/// on a listener and slots of its own: an attack on the step-log gateway
/// never takes the probes' connections.
pub async fn serve(listener: tokio::net::TcpListener, health: Health) {
    crate::bounded::serve(listener, router(health), crate::bounded::Limits::PROBES).await
}

async fn metrics(
    State(h): State<Health>,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &h.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain")],
            e.to_string(),
        ),
    }
}

async fn readyz(State(h): State<Health>) -> (StatusCode, String) {
    if let Some(why) = h.watches.unready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready:\n{why}\n"),
        )
    } else if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready".into())
    }
}

async fn get_log_level() -> (StatusCode, String) {
    match crate::telemetry::log_level() {
        Some(level) => (StatusCode::OK, format!("{level}\n")),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "logging is not initialised\n".into(),
        ),
    }
}

async fn put_log_level(
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: String,
) -> (StatusCode, String) {
    if !may_change_log_level(&peer) {
        return (
            StatusCode::FORBIDDEN,
            "the log level can be changed from loopback only (kubectl port-forward)\n".into(),
        );
    }
    match crate::telemetry::set_log_level(&body) {
        Ok(()) => (StatusCode::OK, format!("{}\n", body.trim())),
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

/// Only a peer inside the pod (port-forward arrives on loopback) may change it.
fn may_change_log_level(peer: &SocketAddr) -> bool {
    match peer.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_peers_may_change_the_log_level() {
        for ok in [
            "127.0.0.1:5000",
            "127.9.9.9:1",
            "[::1]:80",
            "[::ffff:127.0.0.1]:80",
        ] {
            assert!(may_change_log_level(&ok.parse().unwrap()), "{ok}");
        }
        for no in [
            "10.0.0.7:5000",
            "192.168.1.2:1",
            "[fd00::1]:80",
            "[::ffff:10.1.1.1]:80",
        ] {
            assert!(!may_change_log_level(&no.parse().unwrap()), "{no}");
        }
    }
}
