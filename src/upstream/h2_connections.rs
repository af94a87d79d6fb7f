//! The upstream HTTP/2 connection set: per host, as many HTTP/2 connections as the streams in
//! flight need.
//!
//! hyper's pooled client keeps one HTTP/2 connection per host and never opens a second
//! (hyperium/hyper #2197, #3623): past the server's `SETTINGS_MAX_CONCURRENT_STREAMS` (AWS front
//! ends commonly advertise 128; Bedrock's figure is not documented) further calls would wait
//! inside it, unseen, holding their reservations. Here a call goes to the open connection of its
//! host with the fewest streams in flight, among those below their limit (the lower of
//! `upstream.h2_streams_per_connection` and what the server allows, read after each poll of the
//! connection); when every connection is full, another is opened (one at a time per host, so a
//! burst opens what it needs, not one each). A connection is used only once the server's first
//! SETTINGS is in (the handshake starts with a limit of 0 streams), so a burst never runs past
//! a limit it does not know yet.
//!
//! A stream is counted by a [`StreamGuard`] from the moment it is chosen until its response body
//! ends, fails or is dropped ([`PooledBody`]), or its request fails.
//!
//! [`StreamGuard`]: super::body::StreamGuard
//!
//! # Failure semantics
//! - **Connect**: the connector's TCP connect timeout, and the whole connect, TLS, handshake and
//!   first SETTINGS within `connect_timeout`; a failure fails the call that opened it and the
//!   calls that were waiting for that attempt (their callers answer 503), and the next call
//!   tries again.
//! - **A connection that closes** (a reset, a failed keep-alive ping, 30 s apart and 20 s to
//!   answer) is dropped from the set at the next choice; its streams in flight fail with it (a
//!   stream's body ends in an error, which the metered body settles). One whose server sent
//!   GOAWAY takes no new stream from the first call that learns it; its streams below the
//!   GOAWAY's last one go on.
//! - **Retries**: a request the server did not process (RFC 9113 8.7: `REFUSED_STREAM`, or a
//!   graceful GOAWAY naming a last stream below it), or that never left because its connection
//!   had closed, goes once more on another connection; any other failure is the caller's.
//! - **Idle**: a connection with no stream in flight for `idle_timeout` is dropped from the set
//!   (by a sweep every quarter of it), which closes it.
//! - **HTTP/1.1**: with ALPN offering both, a server that picks HTTP/1.1 marks its host; the
//!   call (and every later one to it) is handed back for the HTTP/1.1 client ([`Sent::Http1`]).

use std::{
    collections::HashMap,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures_util::{
    FutureExt, StreamExt, future::CatchUnwind, stream::FuturesUnordered, task::AtomicWaker,
};
use http::{Request, Response, Uri};
use http_body::Body;
use hyper::{
    body::Incoming,
    client::conn::http2::{self, SendRequest},
};
use hyper_util::{client::legacy::connect::Connection, rt::TokioTimer};
use tokio::{sync::watch, time::Instant};
use tower::ServiceExt;

use crate::own_wake::OwnWake;

use super::{
    Connector,
    body::{PooledBody, StreamCount, StreamGuard},
    error_chain,
    pass_writes::{PassWrites, pass_io},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the set could not carry a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum H2Error {
    #[error("{0}")]
    Connect(String),
    #[error("no HTTP/2 connection within the connect timeout ({0:?})")]
    ConnectTimeout(Duration),
    #[error("{0}")]
    Send(String),
}

/// What became of a request given to [`ConnectionSet::send`].
pub enum Sent<B> {
    Answered(Response<PooledBody>),
    /// The host speaks HTTP/1.1 (ALPN chose it): the request, unsent, for the HTTP/1.1 client.
    Http1(Request<B>),
}

/// How the set behaves.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Streams on one connection at most (fewer if the server allows fewer).
    pub streams_per_connection: usize,
    pub connect_timeout: Duration,
    /// A connection with nothing in flight this long is closed.
    pub idle_timeout: Duration,
}

/// One host's connections, and how many streams are open on them (for `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostView {
    /// `scheme://authority`.
    pub host: String,
    pub connections: usize,
    pub streams: usize,
}

/// The connections of every host, for request bodies of type `B`.
pub struct ConnectionSet<B> {
    inner: Arc<Inner<B>>,
}

struct Inner<B> {
    hosts: Mutex<HashMap<String, Arc<Host<B>>>>,
    connector: Connector,
    settings: Settings,
    sweeping: AtomicBool,
}

struct Host<B> {
    connections: Mutex<Vec<Arc<Conn<B>>>>,
    /// Held while a connection is being opened: one at a time per host.
    opening: tokio::sync::Mutex<()>,
    /// ALPN picked HTTP/1.1 on this host.
    http1: AtomicBool,
    /// The last failure to open a connection, and when: the calls that waited for that attempt
    /// fail with it rather than each trying (and timing out) in turn.
    failed: Mutex<Option<(Instant, H2Error)>>,
}

/// One HTTP/2 connection.
struct Conn<B> {
    send: SendRequest<B>,
    /// Streams chosen for this connection and not yet ended.
    in_flight: AtomicUsize,
    /// The server's `SETTINGS_MAX_CONCURRENT_STREAMS` as the connection last saw it (0 until
    /// its first SETTINGS).
    server_limit: watch::Receiver<usize>,
    /// When `in_flight` last fell to zero.
    idle_since: Mutex<Instant>,
    /// The server sent GOAWAY: no new stream goes here (hyper reports the connection closed only
    /// once its last stream ends).
    going_away: AtomicBool,
}

impl<B> std::fmt::Debug for ConnectionSet<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionSet")
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

impl<B> std::fmt::Debug for Sent<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sent::Answered(r) => f.debug_tuple("Answered").field(&r.status()).finish(),
            Sent::Http1(_) => f.write_str("Http1"),
        }
    }
}

impl<B> Conn<B> {
    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Streams this connection may carry now.
    fn limit(&self, configured: usize) -> usize {
        configured.min(*self.server_limit.borrow())
    }

    fn is_idle_for(&self, idle: Duration, now: Instant) -> bool {
        self.in_flight() == 0 && now.saturating_duration_since(*lock(&self.idle_since)) >= idle
    }
}

/// A poisoned lock's data is still consistent here (counts and lists, no invariant spans a
/// panic), so it is used as it is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<B: Send + 'static> StreamCount for Conn<B> {
    fn release(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            *lock(&self.idle_since) = Instant::now();
        }
    }
}

impl<B> ConnectionSet<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static,
{
    /// A set connecting with `connector` (whose ALPN says which protocols TLS offers; over plain
    /// http it speaks HTTP/2 by prior knowledge).
    pub(super) fn new(connector: Connector, settings: Settings) -> ConnectionSet<B> {
        ConnectionSet {
            inner: Arc::new(Inner {
                hosts: Mutex::new(HashMap::new()),
                connector,
                settings,
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// Connections and streams per host, now.
    pub fn views(&self) -> Vec<HostView> {
        let hosts = lock(&self.inner.hosts);
        let mut views: Vec<HostView> = hosts
            .iter()
            .map(|(name, host)| {
                let conns = lock(&host.connections);
                let open = conns.iter().filter(|c| !c.send.is_closed());
                let (connections, streams) =
                    open.fold((0, 0), |(n, s), c| (n + 1, s + c.in_flight()));
                HostView {
                    host: name.clone(),
                    connections,
                    streams,
                }
            })
            .collect();
        views.sort_by(|a, b| a.host.cmp(&b.host));
        views
    }

    /// Sends `request` (absolute URI) on a connection to its host, and waits for the response
    /// head. `replay` is a copy to send again if the server did not process the first (`None`:
    /// not retried).
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps each argument twice while the call waits (rust-lang/rust#62958)"
    )]
    pub fn send(
        &self,
        request: Request<B>,
        replay: Option<Request<B>>,
    ) -> impl Future<Output = Result<Sent<B>, H2Error>> + '_ {
        async move {
            let uri = request.uri().clone();
            let host = self.host(&uri);
            if host.http1.load(Ordering::Acquire) {
                return Ok(Sent::Http1(request));
            }
            let (conn, guard) = match self.stream(&host, &uri, None).await? {
                Some(chosen) => chosen,
                None => return Ok(Sent::Http1(request)),
            };
            let mut failed = match conn.send.clone().try_send_request(request).await {
                Ok(response) => return Ok(answered(response, guard)),
                Err(e) => e,
            };
            drop(guard);
            // Sent again only if it never left (its connection had closed) or was not processed.
            let unsent = failed.take_message();
            let error = failed.into_error();
            if h2_error(&error).is_some_and(::h2::Error::is_go_away) {
                conn.going_away.store(true, Ordering::Release);
            }
            let request = match (unsent, replay) {
                (Some(unsent), _) => unsent,
                (None, Some(copy)) if unprocessed(&error) => copy,
                _ => return Err(H2Error::Send(error_chain(&error))),
            };
            tracing::debug!(error = %error_chain(&error), "upstream did not process the request; sending it again");
            let (conn, guard) = match self.stream(&host, &uri, Some(&conn)).await? {
                Some(chosen) => chosen,
                None => return Ok(Sent::Http1(request)),
            };
            match conn.send.clone().send_request(request).await {
                Ok(response) => Ok(answered(response, guard)),
                Err(e) => Err(H2Error::Send(error_chain(&e))),
            }
        }
    }

    fn host(&self, uri: &Uri) -> Arc<Host<B>> {
        let key = host_key(uri);
        let mut hosts = lock(&self.inner.hosts);
        if let Some(host) = hosts.get(&key) {
            return host.clone();
        }
        let host = Arc::new(Host {
            connections: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
            http1: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        hosts.insert(key, host.clone());
        host
    }

    /// A stream on the least loaded connection with room (other than `avoid`, the one that did
    /// not process the request), opening one if none has; `None` if the host turned out to speak
    /// HTTP/1.1.
    async fn stream(
        &self,
        host: &Host<B>,
        uri: &Uri,
        avoid: Option<&Arc<Conn<B>>>,
    ) -> Result<Option<(Arc<Conn<B>>, StreamGuard)>, H2Error> {
        if let Some(chosen) = self.choose(host, avoid) {
            return Ok(Some(chosen));
        }
        let waited_from = Instant::now();
        let _opening = host.opening.lock().await;
        // Another call may have opened one while this one waited, or failed to.
        if let Some(chosen) = self.choose(host, avoid) {
            return Ok(Some(chosen));
        }
        if let Some((at, e)) = lock(&host.failed).as_ref()
            && *at >= waited_from
        {
            return Err(e.clone());
        }
        let timeout = self.inner.settings.connect_timeout;
        // Boxed: a rare path whose future (connector, TLS, handshake) would otherwise make every
        // call's future several KiB larger.
        let opened = tokio::time::timeout(timeout, Box::pin(self.open(uri))).await;
        let failed = |e: H2Error| {
            *lock(&host.failed) = Some((Instant::now(), e.clone()));
            Err(e)
        };
        let conn = match opened {
            Err(_) => return failed(H2Error::ConnectTimeout(timeout)),
            Ok(Err(e)) => return failed(e),
            Ok(Ok(None)) => {
                host.http1.store(true, Ordering::Release);
                return Ok(None);
            }
            Ok(Ok(Some(conn))) => conn,
        };
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        lock(&host.connections).push(conn.clone());
        self.start_sweeping();
        let guard = StreamGuard::new(conn.clone());
        Ok(Some((conn, guard)))
    }

    /// Counts a stream on the open connection with the fewest in flight below its limit (other
    /// than `avoid`), and drops closed connections from the host.
    fn choose(
        &self,
        host: &Host<B>,
        avoid: Option<&Arc<Conn<B>>>,
    ) -> Option<(Arc<Conn<B>>, StreamGuard)> {
        let configured = self.inner.settings.streams_per_connection;
        let mut conns = lock(&host.connections);
        conns.retain(|c| !c.send.is_closed() && !c.going_away.load(Ordering::Acquire));
        let conn = conns
            .iter()
            .filter(|c| avoid.is_none_or(|avoid| !Arc::ptr_eq(c, avoid)))
            .filter(|c| c.in_flight() < c.limit(configured))
            .min_by_key(|c| c.in_flight())?
            .clone();
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = StreamGuard::new(conn.clone());
        Some((conn, guard))
    }

    /// Connects to `uri`'s host and shakes hands; `None` if ALPN chose HTTP/1.1. Returns once the
    /// server's first SETTINGS is in.
    async fn open(&self, uri: &Uri) -> Result<Option<Arc<Conn<B>>>, H2Error> {
        let connect = |e: BoxError| H2Error::Connect(error_chain(&*e));
        let io = self
            .inner
            .connector
            .clone()
            .oneshot(uri.clone())
            .await
            .map_err(connect)?;
        let tls = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        if tls && !io.connected().is_negotiated_h2() {
            return Ok(None);
        }
        let handed = ConnFutures::default();
        let (io, writes) = pass_io(io);
        let (send, connection) = http2::Builder::new(handed.clone())
            .timer(TokioTimer::new())
            // No stream goes before the server says how many it takes.
            .initial_max_send_streams(0)
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(20))
            .handshake(io)
            .await
            .map_err(|e| H2Error::Connect(error_chain(&e)))?;
        let (limit_tx, mut server_limit) = watch::channel(0);
        tokio::spawn(Drive::new(connection, handed, writes, limit_tx));
        if server_limit.wait_for(|limit| *limit > 0).await.is_err() {
            return Err(H2Error::Connect(
                "the connection closed before the server's SETTINGS".into(),
            ));
        }
        Ok(Some(Arc::new(Conn {
            send,
            in_flight: AtomicUsize::new(0),
            server_limit,
            idle_since: Mutex::new(Instant::now()),
            going_away: AtomicBool::new(false),
        })))
    }

    /// Starts the idle sweep (once, from the first connection on: a runtime is running then).
    fn start_sweeping(&self) {
        if self.inner.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let every = (self.inner.settings.idle_timeout / 4).max(Duration::from_millis(10));
        let inner = Arc::downgrade(&self.inner);
        tokio::spawn(sweep(inner, every));
    }
}

/// Every `every`, drops each host's connections that are closed or idle past the idle timeout,
/// until the set is gone.
async fn sweep<B>(inner: Weak<Inner<B>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let idle = inner.settings.idle_timeout;
        let now = Instant::now();
        let hosts: Vec<_> = lock(&inner.hosts).values().cloned().collect();
        for host in hosts {
            lock(&host.connections).retain(|c| !c.send.is_closed() && !c.is_idle_for(idle, now));
        }
    }
}

fn answered<B>(response: Response<Incoming>, guard: StreamGuard) -> Sent<B> {
    Sent::Answered(response.map(|inner| PooledBody::counted(inner, guard)))
}

/// Whether the server said it did not process the stream (RFC 9113 8.7): `REFUSED_STREAM`, or
/// a graceful GOAWAY whose last stream is below it.
fn unprocessed(e: &hyper::Error) -> bool {
    h2_error(e).is_some_and(|h2| {
        let refused = h2.reason() == Some(::h2::Reason::REFUSED_STREAM);
        let graceful =
            h2.is_go_away() && h2.is_remote() && h2.reason() == Some(::h2::Reason::NO_ERROR);
        refused || graceful
    })
}

/// The HTTP/2 error under hyper's, if there is one.
fn h2_error(e: &hyper::Error) -> Option<&::h2::Error> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<::h2::Error>() {
            return Some(h2);
        }
        source = s.source();
    }
    None
}

/// `scheme://authority` of `uri`: the key of its host.
fn host_key(uri: &Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or("http");
    let authority = uri.authority().map_or("", |a| a.as_str());
    format!("{scheme}://{authority}")
}

/// Drives one connection, and after each poll publishes the server's stream limit.
///
/// hyper hands the connection's futures (its I/O; per request, the wait for the response head, and
/// the request body's pipe when the body is not all there) to its executor: here
/// [`ConnFutures`], which gives them to this task. So a call's request, its answer and the
/// connection's I/O pass between futures of one task instead of between three tasks, and no task
/// is spawned per request (each spawn woke the other worker thread). Wake-ups among them during
/// the task's poll are answered by polling again ([`OwnWake`]). What the connection wrote
/// during the poll is sent to its socket when the poll ends, in one call ([`PassWrites`]).
///
/// Until the server's first SETTINGS is seen it also wakes itself every [`SETTINGS_POLL`] to look.
struct Drive<C> {
    work: Work<C>,
    own: OwnWake,
    writes: PassWrites,
    limit: watch::Sender<usize>,
    looking: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// What a [`Drive`] task polls.
struct Work<C> {
    /// hyper's dispatch; `None` once it has ended (dropped then, so that callers holding its
    /// `SendRequest` see it closed), while the futures may still be finishing streams.
    connection: Option<Pin<Box<C>>>,
    futures: FuturesUnordered<Isolated>,
    handed: ConnFutures,
}

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A handed future whose panic ends it alone, as it would have ended the task of its own it was
/// once spawned as: the connection and its other streams go on.
type Isolated = CatchUnwind<AssertUnwindSafe<BoxFuture>>;

/// The executor hyper's HTTP/2 client is given for one connection: what it executes is run by
/// that connection's [`Drive`] task.
#[derive(Clone, Default)]
struct ConnFutures {
    shared: Arc<Handed>,
}

#[derive(Default)]
struct Handed {
    futures: Mutex<Vec<BoxFuture>>,
    /// The [`Drive`] task, to be woken when a future is handed over from elsewhere.
    drive: AtomicWaker,
}

impl<F> hyper::rt::Executor<F> for ConnFutures
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, future: F) {
        lock(&self.shared.futures).push(Box::pin(future));
        self.shared.drive.wake();
    }
}

impl<C> Drive<C> {
    fn new(
        connection: C,
        handed: ConnFutures,
        writes: PassWrites,
        limit: watch::Sender<usize>,
    ) -> Drive<C> {
        Drive {
            work: Work {
                connection: Some(Box::pin(connection)),
                futures: FuturesUnordered::new(),
                handed,
            },
            own: OwnWake::new(),
            writes,
            limit,
            looking: None,
        }
    }
}

/// How often a new connection looks for the server's first SETTINGS (for about one round trip).
const SETTINGS_POLL: Duration = Duration::from_millis(1);

/// The connection future's view of the server's limit.
trait MaxSendStreams {
    fn max_send_streams(&self) -> usize;
}

impl<T, B> MaxSendStreams for http2::Connection<T, B, ConnFutures>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static,
{
    fn max_send_streams(&self) -> usize {
        self.current_max_send_streams()
    }
}

impl<C> Work<C>
where
    C: Future<Output = hyper::Result<()>> + MaxSendStreams,
{
    /// One pass over the dispatch and the handed futures; ready once all have ended.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(connection) = self.connection.as_mut()
            && let Poll::Ready(result) = connection.as_mut().poll(cx)
        {
            if let Err(e) = result {
                tracing::debug!(error = %error_chain(&e), "upstream HTTP/2 connection closed with an error");
            }
            self.connection = None;
        }
        self.futures.extend(
            lock(&self.handed.shared.futures)
                .drain(..)
                .map(|future| AssertUnwindSafe(future).catch_unwind()),
        );
        while let Poll::Ready(Some(ended)) = self.futures.poll_next_unpin(cx) {
            if let Err(panic) = ended {
                let message = panic_message(&*panic);
                tracing::error!(
                    panic = message,
                    "a future of an upstream HTTP/2 connection panicked; its stream fails, the \
                     connection and its other streams go on"
                );
            }
        }
        let finished = self.connection.is_none()
            && self.futures.is_empty()
            && lock(&self.handed.shared.futures).is_empty();
        if finished {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// What a panic said, if it said it as a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

impl<C> Future for Drive<C>
where
    C: Future<Output = hyper::Result<()>> + MaxSendStreams,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        // A future handed over during the poll (a request's wait for its head) is polled in the
        // same poll; one handed over from elsewhere wakes the task.
        this.work.handed.shared.drive.register(this.own.waker());
        let polled = this.own.poll(cx, |cx| this.work.poll(cx));
        // A failure to send is h2's to see (its next read or write fails with it); a send
        // that waits wakes the task when the socket takes more.
        let _ = this.writes.poll_send(cx);
        let now = this
            .work
            .connection
            .as_ref()
            .map_or(0, |connection| connection.max_send_streams());
        this.limit.send_if_modified(|limit| {
            let changed = *limit != now;
            *limit = now;
            changed
        });
        if now > 0 {
            this.looking = None;
        } else if polled.is_pending() && this.work.connection.is_some() {
            let looking = this
                .looking
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(SETTINGS_POLL)));
            if looking.as_mut().poll(cx).is_ready() {
                looking.as_mut().reset(Instant::now() + SETTINGS_POLL);
                cx.waker().wake_by_ref();
            }
        }
        polled
    }
}

#[cfg(test)]
#[path = "h2_connections_drive_tests.rs"]
mod drive_tests;
