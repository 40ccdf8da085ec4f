//! A server on a runtime of its own (two worker threads): the reconciler
//! busy replaying logs never delays what step pods and the API server ask
//! of the controller, nor the other way round.

use std::future::Future;
use std::net::SocketAddr;

/// Why a server did not start: what its start-up needed, by what failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("starting its runtime")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Gone(#[from] tokio::sync::oneshot::error::RecvError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Tls(#[from] crate::bounded::tls::TlsError),
    #[error("reading the serving {what} {}: {error}", path.display())]
    ReadCertificate {
        what: &'static str,
        path: std::path::PathBuf,
        error: std::io::Error,
    },
}

/// Runs `start` on a new runtime named `name` and keeps that runtime alive
/// once it succeeded; returns what `start` returned (the bound address).
pub async fn spawn<F, Fut>(name: &'static str, start: F) -> Result<SocketAddr, StartError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<SocketAddr, StartError>>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(name)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(StartError::Runtime(e)));
                    return;
                }
            };
            rt.block_on(async move {
                let started = start().await;
                let up = started.is_ok();
                let _ = tx.send(started);
                if up {
                    std::future::pending::<()>().await;
                }
            });
        })?;
    rx.await?
}

/// Binds `addr` with SO_REUSEPORT, so replicas sharing one host's network
/// (as on the e2e process node) can all serve the same port.
pub fn bind_shared(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}
