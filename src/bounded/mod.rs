//! Serving HTTP with bounds: every listener the controller opens (the
//! step-log gateway, `/metrics` with the probes) is served by [`serve`], so
//! no client, authenticated or not, holds more than a slot, a few seconds and
//! a bounded body of the process:
//!
//! - at most [`Limits::max_connections`] connections at once; a connection
//!   beyond that takes the slot of the oldest connection not serving a
//!   request (see [`Slots`]), or, when every slot is serving one, is closed
//!   at once (it never waits in the kernel's queue; its client sees a reset
//!   and retries);
//! - a request's head must arrive within [`Limits::header_timeout`] of the
//!   connection opening or going idle (hyper's header read timeout, which
//!   also closes an idle keep-alive connection after that time);
//! - a request's body must arrive within [`Limits::body_timeout`] of its head,
//!   however slowly it trickles (a deadline, not a per-frame timeout);
//! - bodies are cut while streaming by each router's `DefaultBodyLimit`.
//!
//! Health is kept apart from load: the probes are served on their own
//! listener with their own slots, so a gateway whose slots are all held still
//! answers `/readyz` (and the controller raises its open-files limit at start,
//! [`raise_open_files_limit`], so the slots fit in it).

pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tower::Service;

/// What one server allows each client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; more are closed on arrival.
    pub max_connections: usize,
    /// Time to send a request's head (also the keep-alive idle timeout).
    pub header_timeout: Duration,
    /// Time to send a request's body, counted from its head.
    pub body_timeout: Duration,
}

impl Limits {
    /// The probes and `/metrics`: a kubelet, a scraper and a port-forward.
    pub const PROBES: Limits = Limits {
        max_connections: 64,
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_secs(5),
    };
}

/// Serves `router` on `listener` within `limits` until the listener fails.
/// Each request carries its peer as [`ConnectInfo<SocketAddr>`].
pub async fn serve(listener: TcpListener, router: Router, limits: Limits) {
    serve_with(listener, router, limits, None).await
}

/// Same, over TLS: the handshake must end within the header timeout, and
/// each request also carries the client's verified certificate as
/// [`tls::PeerCert`].
pub async fn serve_tls(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: tls::TlsConfigs,
) {
    serve_with(listener, router, limits, Some(tls)).await
}

async fn serve_with(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<tls::TlsConfigs>,
) {
    let slots = Slots::new(limits.max_connections);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it
                // was accepted: wait a moment rather than spin.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(conn) = slots.take() else {
            tracing::debug!(%peer, limit = limits.max_connections, "connection refused: every slot is serving a request");
            // Reset rather than linger: the slot count is the bound.
            let _ = stream.set_zero_linger();
            drop(stream);
            continue;
        };
        let (router, slots, tls) = (router.clone(), slots.clone(), tls.clone());
        tokio::spawn(async move {
            let service = PeerService {
                router,
                peer,
                body_timeout: limits.body_timeout,
                conn: conn.clone(),
                cert: None,
            };
            match tls {
                None => serve_connection(stream, service, limits).await,
                Some(tls) => {
                    let handshake = tls.acceptor().accept(stream);
                    match tokio::time::timeout(limits.header_timeout, handshake).await {
                        Ok(Ok(stream)) => {
                            let cert = tls::PeerCert::of(stream.get_ref().1);
                            let service = PeerService {
                                cert: Some(cert),
                                ..service
                            };
                            serve_connection(stream, service, limits).await
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
            slots.release(&conn);
        });
    }
}

async fn serve_connection<IO>(stream: IO, service: PeerService, limits: Limits)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (peer, conn) = (service.peer, service.conn.clone());
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let served = builder.serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        served = served => if let Err(e) = served {
            tracing::debug!(%peer, error = %e, "connection ended");
        },
        () = conn.evicted.notified() => {
            tracing::debug!(%peer, "connection closed to make room (it was not serving a request)");
        }
    }
}

/// The connection slots of one server. When all are taken, a new
/// connection takes the slot of the oldest one that is not serving a request
/// (waiting for its head, or idle between requests), so connections that
/// only hold a slot cannot keep out a client that sends its request: they
/// are closed first. Only when every slot is serving a request is a new
/// connection refused.
#[derive(Clone)]
struct Slots {
    max: usize,
    open: Arc<std::sync::Mutex<Open>>,
}

#[derive(Default)]
struct Open {
    next_id: u64,
    /// In the order they were accepted.
    conns: std::collections::VecDeque<Arc<Conn>>,
}

/// One open connection as its slot sees it.
struct Conn {
    id: u64,
    /// Requests being served (0 or 1 on HTTP/1).
    serving: AtomicUsize,
    /// Told to close (its slot went to a newer connection).
    evicted: tokio::sync::Notify,
}

impl Slots {
    fn new(max: usize) -> Slots {
        Slots {
            max: max.max(1),
            open: Default::default(),
        }
    }

    /// A slot for a new connection, making room if need be; None when every
    /// slot is serving a request.
    fn take(&self) -> Option<Arc<Conn>> {
        let mut open = self.open.lock().expect("not poisoned");
        if open.conns.len() >= self.max {
            let idle = open
                .conns
                .iter()
                .position(|c| c.serving.load(Ordering::Acquire) == 0)?;
            let old = open.conns.remove(idle).expect("found");
            old.evicted.notify_one();
        }
        open.next_id += 1;
        let conn = Arc::new(Conn {
            id: open.next_id,
            serving: AtomicUsize::new(0),
            evicted: tokio::sync::Notify::new(),
        });
        open.conns.push_back(conn.clone());
        Some(conn)
    }

    fn release(&self, conn: &Conn) {
        let mut open = self.open.lock().expect("not poisoned");
        if let Some(i) = open.conns.iter().position(|c| c.id == conn.id) {
            open.conns.remove(i);
        }
    }
}

/// Marks its connection as serving a request while it lives.
struct Serving(Arc<Conn>);

impl Serving {
    fn new(conn: Arc<Conn>) -> Serving {
        conn.serving.fetch_add(1, Ordering::AcqRel);
        Serving(conn)
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.serving.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The router as hyper calls it for one connection: each request gets its
/// peer and a body with a deadline, and marks its connection as serving.
#[derive(Clone)]
struct PeerService {
    router: Router,
    peer: SocketAddr,
    body_timeout: Duration,
    conn: Arc<Conn>,
    /// The client's certificate, on a TLS listener.
    cert: Option<tls::PeerCert>,
}

impl hyper::service::Service<Request<Incoming>> for PeerService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let serving = Serving::new(self.conn.clone());
        let mut req = req.map(|body| Body::new(DeadlineBody::new(body, self.body_timeout)));
        req.extensions_mut().insert(ConnectInfo(self.peer));
        if let Some(cert) = &self.cert {
            req.extensions_mut().insert(cert.clone());
        }
        let mut router = self.router.clone();
        let peer = self.peer;
        Box::pin(async move {
            // A panic in one request's handler answers that request 500 and
            // ends nothing else (see `crate::contain`).
            let response = crate::contain::contain(router.call(req))
                .await
                .unwrap_or_else(|panicked| {
                    tracing::error!(%peer, error = %panicked, "a request's handler panicked");
                    Ok(axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response())
                });
            drop(serving);
            response
        })
    }
}

/// A request body that fails once its deadline passes.
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl DeadlineBody {
    fn new(inner: Incoming, timeout: Duration) -> DeadlineBody {
        DeadlineBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }
}

/// The error of a body that did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
struct BodyTimeout(Duration);

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(BodyTimeout(this.timeout).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Raises this process's soft open-files limit to its hard limit (as Go
/// programs do) and returns the soft limit now in force: the connection
/// slots of the servers must fit in it with room for the database pools,
/// the API client and the watches.
pub fn raise_open_files_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write or read only the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Some(lim.rlim_cur)
}

/// File descriptors kept for everything but the servers' connections.
pub const RESERVED_FILES: u64 = 256;

/// The gateway's connection slots that fit in `open_files` next to the
/// probes' slots and [`RESERVED_FILES`] (at least 16).
pub fn fitting_connections(wanted: usize, open_files: Option<u64>) -> usize {
    let Some(open_files) = open_files else {
        return wanted;
    };
    let room = open_files
        .saturating_sub(RESERVED_FILES)
        .saturating_sub(Limits::PROBES.max_connections as u64);
    wanted.min(usize::try_from(room).unwrap_or(usize::MAX).max(16))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn server(limits: Limits) -> SocketAddr {
        let router = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/echo",
                post(|body: Bytes| async move { body.len().to_string() }),
            )
            .route("/panic", get(panics));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, router, limits));
        addr
    }

    const FAST: Limits = Limits {
        max_connections: 4,
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(600),
    };

    /// Reads until the peer closes; returns what arrived (or None on a reset).
    async fn until_closed(s: &mut tokio::net::TcpStream) -> Option<String> {
        let mut out = Vec::new();
        match tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await {
            Ok(Ok(_)) => Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(Err(_)) => None,
            Err(_) => panic!("the server kept the connection open"),
        }
    }

    #[tokio::test]
    async fn a_head_that_never_ends_is_closed_after_the_header_timeout() {
        let addr = server(FAST).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = std::time::Instant::now();
        until_closed(&mut s).await;
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed() {
        let addr = server(FAST).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let got = until_closed(&mut s).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }

    #[tokio::test]
    async fn a_trickling_body_is_cut_at_its_deadline() {
        let addr = server(FAST).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            .await
            .unwrap();
        // A byte every 100 ms: no single wait is long, the whole is.
        let trickle = async {
            for _ in 0..100 {
                if s.write_all(b"x").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let started = std::time::Instant::now();
        trickle.await;
        let got = until_closed(&mut s).await.unwrap_or_default();
        assert!(
            !got.contains("\r\n\r\n100"),
            "the body was read whole: {got}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    async fn get_healthz(addr: SocketAddr) -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").await;
        until_closed(&mut s).await
    }

    #[tokio::test]
    async fn connections_that_only_hold_a_slot_make_room_for_a_request() {
        let addr = server(FAST).await;
        let mut held = Vec::new();
        for _ in 0..FAST.max_connections {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /").await.unwrap();
            held.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let got = get_healthz(addr).await.unwrap_or_default();
        assert!(got.starts_with("HTTP/1.0 200"), "{got}");
        // The oldest half-sent connection gave its slot.
        let started = std::time::Instant::now();
        until_closed(&mut held[0]).await;
        assert!(
            started.elapsed() < FAST.header_timeout,
            "closed by its timeout, not evicted"
        );
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_are_refused_while_every_slot_serves() {
        let addr = server(FAST).await;
        let mut serving = Vec::new();
        for _ in 0..FAST.max_connections {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nx")
                .await
                .unwrap();
            serving.push(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let got = get_healthz(addr).await.unwrap_or_default();
        assert!(!got.contains("200"), "served beyond the limit: {got}");
        // Their bodies' deadlines free the slots; then a request is served.
        for mut s in serving {
            until_closed(&mut s).await;
        }
        let got = get_healthz(addr).await.unwrap();
        assert!(got.starts_with("HTTP/1.0 200"), "{got}");
    }

    /// A handler with a bug that its request reaches.
    async fn panics() -> &'static str {
        panic!("a bug this request reached")
    }

    /// One request's panic is that request's 500; the connection's slot is
    /// given back and the server answers the next one.
    #[tokio::test]
    async fn a_panicking_request_is_answered_500_and_the_server_goes_on() {
        let addr = server(FAST).await;
        for _ in 0..=FAST.max_connections {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /panic HTTP/1.0\r\n\r\n").await.unwrap();
            let got = until_closed(&mut s).await.unwrap_or_default();
            assert!(got.starts_with("HTTP/1.0 500"), "{got}");
        }
        let got = get_healthz(addr).await.unwrap();
        assert!(got.starts_with("HTTP/1.0 200"), "{got}");
    }

    #[test]
    fn slots_fit_in_the_open_files_limit() {
        assert_eq!(fitting_connections(4096, None), 4096);
        assert_eq!(fitting_connections(4096, Some(1_048_576)), 4096);
        assert_eq!(fitting_connections(4096, Some(1024)), 1024 - 256 - 64);
        assert_eq!(fitting_connections(4096, Some(100)), 16);
    }
}
