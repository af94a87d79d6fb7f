//! The listener: HTTP/1.1 and HTTP/2 (h2c prior knowledge, or ALPN `h2` over TLS) on one port,
//! told apart by their first bytes ([`protocol`]) and served by hyper, with what a client may
//! hold bounded, and graceful shutdown.
//!
//! Tests own the socket: they bind `127.0.0.1:0`, read the address, and pass the listener in.
//!
//! # What a client can hold
//! Every limit below is also listed in SECURITY.md, with its default.
//! - **Connections**: at most `max_connections` open; at the cap the oldest idle one is closed to
//!   make room, and a newcomer is refused only when none is idle ([`registry`]). The cap is
//!   lowered to what the file descriptor limit allows ([`fd_limit`]).
//! - **Time**: the first request (TLS handshake and HTTP/2 preface included) and each HTTP/1.1
//!   head within `header_read_timeout`; no request in flight for `idle_timeout` closes a connection
//!   of either protocol ([`connection`]). HTTP/2 connections are pinged every
//!   `h2_keep_alive_interval` they stay silent, and closed when a ping goes unanswered for
//!   `h2_keep_alive_timeout`, so a peer that vanished mid-stream does not hold its streams.
//! - **Heads**: header fields and bytes are bounded, with a Bedrock-shaped answer ([`service`]).
//! - **Streams**: at most `h2_max_concurrent_streams` per HTTP/2 connection; more are refused
//!   with `RST_STREAM(REFUSED_STREAM)`, which clients retry.
//! - **Bodies**: bounded where they are read ([`crate::body_budget`], [`crate::proxy`]).
//!
//! # Shutdown
//! The server stops accepting at once and lets open connections finish their in-flight requests
//! up to `drain` (idle ones close gracefully at once). At that deadline it cancels
//! [`ServeOptions::deadline`]: every response still in flight ends (a stream with an exception
//! frame), settles, and gets a moment to flush; then whatever is left is closed.

/// `AsyncWrite` for a wrapper that sees only what is read (a pin-projected `inner` stream):
/// every write goes to `inner` as it is.
macro_rules! write_through {
    ($wrapper:ident) => {
        impl<I: tokio::io::AsyncWrite> tokio::io::AsyncWrite for $wrapper<I> {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                self.project().inner.poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                self.project().inner.poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                self.project().inner.poll_flush(cx)
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                self.project().inner.poll_shutdown(cx)
            }
        }
    };
}
use write_through;

mod connection;
pub mod fd_limit;
mod protocol;
mod registry;
mod service;
mod tls;

use std::{future::Future, io, net::SocketAddr, sync::Arc, task::Poll, time::Duration};

use bytes::Bytes;
use hyper::body::Incoming;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::metrics::ListenerMetrics;
use crate::own_wake::OwnWake;
use connection::{Expiry, Timeouts, TrackedIo};
use protocol::Protocols;
use registry::{Connections, Slot};
use service::ConnService;
pub use service::{MAX_HEADER_BYTES, MAX_HEADER_FIELDS};
pub use tls::{TlsError, tls_acceptor};

/// The connection cap of the admin listener (probes and scrapes need a handful).
pub const ADMIN_MAX_CONNECTIONS: usize = 64;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a listener serves: a service from requests to responses (the proxy's router, the
/// simulator's).
pub trait HttpService<B>:
    tower::Service<
        http::Request<Incoming>,
        Response = http::Response<B>,
        Error: Into<BoxError>,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> HttpService<B> for S where
    S: tower::Service<
            http::Request<Incoming>,
            Response = http::Response<B>,
            Error: Into<BoxError>,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// A response body a listener can send.
pub trait ResponseBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> ResponseBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

/// How the server treats clients, and how it shuts down.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// How long a connection may take to send its first request (TLS handshake and HTTP/2
    /// preface included), and each HTTP/1.1 request head from its first byte.
    pub header_read_timeout: Duration,
    /// How long a connection may stay open with no request in flight.
    pub idle_timeout: Duration,
    /// Open connections at most (see [`registry`]).
    pub max_connections: usize,
    pub h2_max_concurrent_streams: u32,
    pub h2_keep_alive_interval: Duration,
    pub h2_keep_alive_timeout: Duration,
    /// Once shutdown starts, how long in-flight requests and streams may finish.
    pub drain: Duration,
    /// Cancelled when the drain deadline passes: responses still in flight end at once (a stream
    /// with an exception frame, see [`crate::upstream::body`]) and settle.
    pub deadline: CancellationToken,
    /// This listener's connection metrics, if it reports any.
    pub metrics: Option<ListenerMetrics>,
}

/// The defaults of `[server]`, without a connection cap (the simulator's listener); the proxy
/// passes its configured values.
impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: usize::MAX,
            h2_max_concurrent_streams: 100,
            h2_keep_alive_interval: Duration::from_secs(30),
            h2_keep_alive_timeout: Duration::from_secs(20),
            drain: Duration::from_secs(30),
            deadline: CancellationToken::new(),
            metrics: None,
        }
    }
}

/// The accept queue asked of the kernel (which caps it at `net.core.somaxconn`): a burst of
/// connections waits there for the accept loop, which sheds what is over the cap, instead of the
/// kernel dropping SYNs past a short queue (a client whose SYN is dropped retries a second later).
const LISTEN_BACKLOG: i32 = 4096;

/// After the drain deadline, how long responses that were told to end may take to flush theirs.
const FLUSH_AFTER_DEADLINE: Duration = Duration::from_secs(2);

/// Serves `service` on `listener` until `shutdown` resolves, then drains (see [`ServeOptions`]).
///
/// A service error closes its connection without an answer (the simulator uses this to play a
/// connection reset); the proxy's router never fails.
pub async fn serve<S: HttpService<B>, B: ResponseBody>(
    listener: TcpListener,
    service: S,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
    options: ServeOptions,
) -> io::Result<()> {
    // Listening again on a listening socket only changes its backlog.
    if let Err(e) = rustix::net::listen(&listener, LISTEN_BACKLOG) {
        tracing::debug!(error = %e, "could not widen the accept queue");
    }
    let protocols = Arc::new(Protocols::new(&options));
    let connections = Connections::new(options.max_connections, options.metrics.clone());
    let timeouts = Timeouts {
        header: options.header_read_timeout,
        idle: options.idle_timeout,
    };
    let drain = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = connections.admit() else {
            tracing::debug!(%peer, "at server.max_connections with none idle; connection refused");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let task = Task {
            slot,
            peer,
            timeouts,
            drain: drain.clone(),
            protocols: protocols.clone(),
        };
        let service = service.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => task.serve(stream, service).await,
                // On the heap, so that a plain connection's task is not as large as a TLS one's.
                Some(acceptor) => Box::pin(task.serve_tls(&acceptor, stream, service)).await,
            }
        });
    }
    drop(listener);
    drain.cancel();
    tokio::select! {
        () = connections.emptied() => {}
        () = tokio::time::sleep(options.drain) => {
            tracing::warn!(drain_secs = options.drain.as_secs_f64(), "drain deadline passed; ending the responses still in flight");
            options.deadline.cancel();
            if tokio::time::timeout(FLUSH_AFTER_DEADLINE, connections.emptied()).await.is_err() {
                tracing::warn!("connections still open after the drain deadline; closing them");
                connections.close_all();
            }
        }
    }
    Ok(())
}

/// What woke a connection's serving loop.
enum Wake {
    /// The connection ended.
    Ended(Result<(), BoxError>),
    /// Told to close at once ([`registry`]).
    Closed,
    /// Shutdown began: close gracefully.
    Draining,
    /// One of the connection's deadlines passed.
    Expired(Expiry),
}

/// A timer not armed yet.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// One accepted connection's serving task.
struct Task {
    slot: Slot,
    peer: SocketAddr,
    timeouts: Timeouts,
    drain: CancellationToken,
    protocols: Arc<Protocols>,
}

impl Task {
    fn count(&self, expiry: Expiry) {
        let Some(m) = self.slot.metrics() else {
            return;
        };
        match expiry {
            Expiry::FirstRequest => m.first_request_timeouts.inc(),
            Expiry::Header => m.header_timeouts.inc(),
            Expiry::Idle => m.idle_timeouts.inc(),
            Expiry::CloseGrace => {}
        }
    }

    /// The TLS handshake, within the first request's deadline; `None` if it failed.
    async fn handshake<I>(
        &self,
        acceptor: &TlsAcceptor,
        stream: I,
    ) -> Option<tokio_rustls::server::TlsStream<I>>
    where
        I: AsyncRead + AsyncWrite + Unpin,
    {
        let deadline = self.slot.activity.accepted() + self.timeouts.header;
        let peer = self.peer;
        tokio::select! {
            done = tokio::time::timeout_at(deadline, acceptor.accept(stream)) => match done {
                Ok(Ok(tls_stream)) => Some(tls_stream),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake not done within the header read timeout");
                    self.count(Expiry::FirstRequest);
                    None
                }
            },
            () = self.slot.close.cancelled() => None,
        }
    }

    /// The TLS handshake, then [`Task::serve`].
    async fn serve_tls<S: HttpService<B>, B: ResponseBody>(
        self,
        acceptor: &TlsAcceptor,
        stream: tokio::net::TcpStream,
        service: S,
    ) {
        if let Some(tls_stream) = self.handshake(acceptor, stream).await {
            self.serve(tls_stream, service).await;
        }
    }

    /// Serves the connection until it ends, a timeout passes, or it is told to close.
    async fn serve<I, S: HttpService<B>, B: ResponseBody>(self, io: I, service: S)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = self.slot.activity.clone();
        let io = TrackedIo::new(io, activity.clone());
        let conn = self
            .protocols
            .serve(io, ConnService::new(service, activity.clone()));
        tokio::pin!(conn);
        let mut closing = None;
        let mut changed = std::pin::pin!(None::<tokio::sync::futures::Notified<'_>>);
        let mut close = std::pin::pin!(self.slot.close.cancelled());
        let mut drain = std::pin::pin!(self.drain.cancelled());
        let mut timer = std::pin::pin!(tokio::time::sleep(NEVER));
        let mut armed = None;
        let own = OwnWake::new();
        loop {
            let wake = std::future::poll_fn(|cx| {
                // The connection first, with nothing registered for its changes: those it makes
                // itself (an HTTP/1.1 head arriving, a request starting or ending) are read
                // below. A wake-up of this task from within its own poll would have tokio put it
                // at the back of the queue and wake the other worker thread to steal it; the
                // connection's own wake-ups (a handler reading its body) are answered by polling
                // it again ([`crate::own_wake`]).
                changed.set(None);
                if let Poll::Ready(result) = own.poll(cx, |cx| conn.as_mut().poll(cx)) {
                    return Poll::Ready(Wake::Ended(result));
                }
                if close.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Wake::Closed);
                }
                if closing.is_none() && drain.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Wake::Draining);
                }
                // Changes made by other tasks (HTTP/2 streams run as tasks of their own) wake
                // it; registered before the state is read, so none is missed.
                loop {
                    changed.set(Some(activity.changed()));
                    if let Some(notified) = changed.as_mut().as_pin_mut()
                        && notified.poll(cx).is_pending()
                    {
                        break;
                    }
                }
                let due = match closing {
                    Some(at) => activity.close_deadline(at),
                    None => activity.next_deadline(&self.timeouts),
                };
                if let Some((at, kind)) = due {
                    if armed != Some(at) {
                        timer.as_mut().reset(at);
                        armed = Some(at);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Wake::Expired(kind));
                    }
                }
                Poll::Pending
            })
            .await;
            if !self.closes_gracefully(wake) {
                return;
            }
            conn.as_mut().graceful_shutdown();
            closing = Some(tokio::time::Instant::now());
        }
    }

    /// What a wake-up of the serving loop means: `true` to close the connection gracefully and
    /// serve it until it has; `false` when it is over.
    fn closes_gracefully(&self, wake: Wake) -> bool {
        let peer = self.peer;
        match wake {
            Wake::Ended(result) => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection closed with error");
                }
                false
            }
            Wake::Closed => false,
            Wake::Expired(kind) => {
                self.count(kind);
                if kind != Expiry::Idle {
                    tracing::debug!(%peer, ?kind, "connection timed out; closing");
                }
                kind == Expiry::Idle
            }
            Wake::Draining => true,
        }
    }
}
