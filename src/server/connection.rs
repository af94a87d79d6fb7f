//! One connection: what it is doing ([`Activity`]: requests in flight, an HTTP/1.1 head on its
//! way), and the task that serves it and closes it when one of its timeouts passes.
//!
//! | state | deadline | past it |
//! |---|---|---|
//! | no request yet (TLS handshake, HTTP/2 preface and settings, the first head) | accept + `header_read_timeout` | closed at once |
//! | HTTP/1.1, a head started arriving | its first byte + `header_read_timeout` | closed at once |
//! | a request in flight (its body being read, its response being sent) | none | (body read timeout, upstream timeouts, HTTP/2 pings) |
//! | no request in flight | the last one's end + `idle_timeout` | closed gracefully (HTTP/2 `GOAWAY`), then at once after [`CLOSE_GRACE`] |
//!
//! A request is in flight from the moment hyper hands its head to the service until its response
//! body has been sent or dropped ([`super::service`]). Only reads tell an HTTP/1.1 head is on its
//! way ([`TrackedIo`]); on HTTP/2, frames arrive idle too (pings, window updates, a `HEADERS`
//! frame sent in part), so an HTTP/2 connection is idle until a request reaches the service.

use std::{
    io,
    pin::Pin,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    task::{Context, Poll},
    time::Duration,
};

use http::Version;
use tokio::{
    io::{AsyncRead, ReadBuf},
    sync::Notify,
    time::Instant,
};

/// After a graceful close starts on a connection with nothing in flight, how long hyper may take
/// to finish it (an HTTP/2 `GOAWAY` waits for a ping round trip) before the socket is dropped.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// No time recorded.
const NONE: u64 = u64::MAX;

/// The timeouts a connection is held to.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// The first request, and each HTTP/1.1 head from its first byte.
    pub header: Duration,
    /// No request in flight.
    pub idle: Duration,
}

/// Which deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    FirstRequest,
    Header,
    Idle,
    /// A graceful close did not finish in [`CLOSE_GRACE`].
    CloseGrace,
}

/// What one connection is doing, shared by its reads, its requests and its serving task.
#[derive(Debug)]
pub struct Activity {
    accepted: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    http1: AtomicBool,
    /// Milliseconds after `accepted` at which the last request ended.
    idle_since: AtomicU64,
    /// Milliseconds after `accepted` at which an HTTP/1.1 head began to arrive, or [`NONE`].
    head_since: AtomicU64,
    changed: Notify,
}

impl Activity {
    pub fn new() -> Activity {
        Activity {
            accepted: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            http1: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(NONE),
            changed: Notify::new(),
        }
    }

    pub fn accepted(&self) -> Instant {
        self.accepted
    }

    /// No request in flight: the connection may be closed without cutting a call short.
    pub fn is_idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }

    fn now_ms(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.accepted)
            .as_millis() as u64
    }

    fn at(&self, ms: u64) -> Instant {
        self.accepted + Duration::from_millis(ms)
    }

    /// A request head reached the service.
    pub fn request_started(&self, version: Version) {
        if self.requests.fetch_add(1, Ordering::AcqRel) == 0 {
            self.http1
                .store(version < Version::HTTP_2, Ordering::Release);
        }
        self.head_since.store(NONE, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// A request's response was sent (or dropped).
    pub fn request_ended(&self) {
        self.idle_since.store(self.now_ms(), Ordering::Release);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Bytes arrived: on an idle HTTP/1.1 connection, the next head has begun.
    fn bytes_read(&self) {
        if self.http1.load(Ordering::Acquire)
            && self.is_idle()
            && self.head_since.load(Ordering::Acquire) == NONE
        {
            self.head_since.store(self.now_ms(), Ordering::Release);
            self.changed.notify_waiters();
        }
    }

    /// The next deadline and what it is, or `None` while a request is in flight.
    pub fn next_deadline(&self, timeouts: &Timeouts) -> Option<(Instant, Expiry)> {
        if !self.is_idle() {
            return None;
        }
        if self.requests.load(Ordering::Acquire) == 0 {
            return Some((self.accepted + timeouts.header, Expiry::FirstRequest));
        }
        let head = self.head_since.load(Ordering::Acquire);
        if head != NONE {
            return Some((self.at(head) + timeouts.header, Expiry::Header));
        }
        let idle = self.idle_since.load(Ordering::Acquire);
        Some((self.at(idle) + timeouts.idle, Expiry::Idle))
    }

    /// Once a graceful close started at `closing`: when to stop waiting for it, counted from the
    /// later of that and the last request's end (so a response's last bytes can flush).
    pub fn close_deadline(&self, closing: Instant) -> Option<(Instant, Expiry)> {
        let idle = self.at(self.idle_since.load(Ordering::Acquire));
        self.is_idle()
            .then(|| (closing.max(idle) + CLOSE_GRACE, Expiry::CloseGrace))
    }

    /// Resolves at the next change of state; register it (`enable`) before reading the state.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

pin_project_lite::pin_project! {
    /// A connection's byte stream, reporting reads to its [`Activity`].
    pub struct TrackedIo<T> {
        #[pin]
        inner: T,
        activity: std::sync::Arc<Activity>,
    }
}

impl<T> TrackedIo<T> {
    pub fn new(inner: T, activity: std::sync::Arc<Activity>) -> TrackedIo<T> {
        TrackedIo { inner, activity }
    }
}

impl<T: AsyncRead> AsyncRead for TrackedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let result = this.inner.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.bytes_read();
        }
        result
    }
}

super::write_through!(TrackedIo);

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUTS: Timeouts = Timeouts {
        header: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };

    #[tokio::test(start_paused = true)]
    async fn each_state_has_its_deadline() {
        let a = Activity::new();
        let start = a.accepted();
        assert_eq!(
            a.next_deadline(&TIMEOUTS),
            Some((start + TIMEOUTS.header, Expiry::FirstRequest))
        );
        a.request_started(Version::HTTP_11);
        assert_eq!(a.next_deadline(&TIMEOUTS), None, "in flight");
        tokio::time::advance(Duration::from_secs(3)).await;
        a.request_ended();
        let ended = start + Duration::from_secs(3);
        assert_eq!(
            a.next_deadline(&TIMEOUTS),
            Some((ended + TIMEOUTS.idle, Expiry::Idle))
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        a.bytes_read();
        assert_eq!(
            a.next_deadline(&TIMEOUTS),
            Some((
                ended + Duration::from_secs(2) + TIMEOUTS.header,
                Expiry::Header
            )),
            "an HTTP/1.1 head began"
        );
        a.request_started(Version::HTTP_11);
        a.request_ended();
        assert_eq!(
            a.next_deadline(&TIMEOUTS).map(|(_, e)| e),
            Some(Expiry::Idle),
            "the head became a request"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn http2_reads_never_start_a_head_timeout() {
        let a = Activity::new();
        a.request_started(Version::HTTP_2);
        a.request_ended();
        a.bytes_read();
        assert_eq!(
            a.next_deadline(&TIMEOUTS).map(|(_, e)| e),
            Some(Expiry::Idle)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_graceful_close_waits_for_the_last_response_then_its_grace() {
        let a = Activity::new();
        a.request_started(Version::HTTP_2);
        let closing = Instant::now();
        assert_eq!(a.close_deadline(closing), None, "in flight");
        tokio::time::advance(Duration::from_secs(7)).await;
        a.request_ended();
        assert_eq!(
            a.close_deadline(closing),
            Some((Instant::now() + CLOSE_GRACE, Expiry::CloseGrace))
        );
    }
}
