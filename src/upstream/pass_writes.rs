//! An upstream HTTP/2 connection's writes, sent to its socket once per poll of its task.
//!
//! h2 flushes its socket at the end of every poll of the connection, and a call with a body
//! takes two polls to leave: the first writes the request's HEADERS (h2 gives a new stream no
//! send capacity until the connection has opened it), the second its DATA, once hyper's body
//! pipe, woken by that capacity, has queued it. That was two system calls, and with
//! `TCP_NODELAY` two segments that each wake the server, for what fits in one.
//!
//! [`PassIo`] is the connection's socket as h2 sees it. What h2 writes is kept and its flushes
//! are answered at once; nothing reaches the socket until the connection's task has finished
//! its poll and calls [`PassWrites::poll_send`], which writes all of it in one call (and flushes
//! TLS). Reads pass through. What is kept is bounded ([`LIMIT`]): a write past it waits, and h2
//! with it, until the task has sent what is kept. A send that fails fails every later read,
//! write and flush with the same error, and wakes the connection, so it closes.
//!
//! Only the connection's task polls either side (h2 polls [`PassIo`] inside the task's poll;
//! [`PassWrites`] is polled after it), so the lock they share is never contended.

use std::{
    io::{self, IoSlice},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    task::{Context, Poll, Waker},
};

use hyper::rt::{Read, ReadBufCursor, Write};

/// Bytes kept for the socket at most; a write past it waits until they are sent.
pub(super) const LIMIT: usize = 64 * 1024;

/// Past this capacity, the buffer is freed once it has been sent, so a connection that once
/// sent a large body does not hold its buffer while idle.
const KEEP_CAPACITY: usize = 16 * 1024;

/// `io` as h2 should see it, and the handle its task sends the kept writes with.
pub(super) fn pass_io<T>(io: T) -> (PassIo<T>, PassWrites)
where
    T: Write + Unpin + Send + 'static,
{
    with_limit(io, LIMIT)
}

/// [`pass_io`] keeping `limit` bytes at most.
fn with_limit<T>(io: T, limit: usize) -> (PassIo<T>, PassWrites)
where
    T: Write + Unpin + Send + 'static,
{
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            io,
            kept: Vec::new(),
            unflushed: false,
            failed: None,
            writer: None,
            reader: None,
            limit,
        }),
    });
    let writes = PassWrites {
        shared: shared.clone(),
    };
    (PassIo { shared }, writes)
}

/// The socket as h2 sees it: see the module documentation.
pub(super) struct PassIo<T> {
    shared: Arc<Shared<T>>,
}

/// Sends what [`PassIo`] kept, once per poll of the connection's task.
pub(super) struct PassWrites {
    shared: Arc<dyn SendKept>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
}

struct State<T> {
    io: T,
    /// Written by h2, not yet sent.
    kept: Vec<u8>,
    /// Sent to `io` since its last flush (TLS may hold what it was given until flushed).
    unflushed: bool,
    /// Why sending failed: every later call fails the same way.
    failed: Option<(io::ErrorKind, String)>,
    /// h2, waiting for room (or for everything to be sent, to shut down).
    writer: Option<Waker>,
    /// h2's last read that waited: woken if sending fails, to see the failure.
    reader: Option<Waker>,
    limit: usize,
}

impl PassWrites {
    /// Sends what h2 wrote during the task's poll, then flushes the socket. Pending until all
    /// of it is out (the socket then wakes the task); an error is also kept for h2's next call.
    pub(super) fn poll_send(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.shared.poll_send(cx)
    }
}

/// [`PassWrites`]' view of its socket, whatever its type.
trait SendKept: Send + Sync {
    fn poll_send(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

impl<T: Write + Unpin + Send> SendKept for Shared<T> {
    fn poll_send(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = lock(&self.state);
        if let Some(failed) = state.failure() {
            return Poll::Ready(Err(failed));
        }
        let sent = state.send(cx);
        match &sent {
            Poll::Ready(Ok(())) => wake(&mut state.writer),
            Poll::Ready(Err(e)) => {
                state.failed = Some((e.kind(), e.to_string()));
                wake(&mut state.writer);
                wake(&mut state.reader);
            }
            // Part sent: room for the writer.
            Poll::Pending if state.kept.len() < state.limit => wake(&mut state.writer),
            Poll::Pending => {}
        }
        sent
    }
}

impl<T: Write + Unpin> State<T> {
    /// Writes what is kept to `io`, then flushes it.
    fn send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.kept.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, &self.kept))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.unflushed = true;
            if n == self.kept.len() {
                self.kept.clear();
                if self.kept.capacity() > KEEP_CAPACITY {
                    self.kept = Vec::new();
                }
            } else {
                self.kept.drain(..n);
            }
        }
        if self.unflushed {
            std::task::ready!(Pin::new(&mut self.io).poll_flush(cx))?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T> State<T> {
    fn failure(&self) -> Option<io::Error> {
        self.failed
            .as_ref()
            .map(|(kind, message)| io::Error::new(*kind, message.clone()))
    }

    /// Keeps what fits of `bufs`; `Pending` (waking on room) when nothing does.
    fn keep(&mut self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if let Some(failed) = self.failure() {
            return Poll::Ready(Err(failed));
        }
        let mut room = self.limit.saturating_sub(self.kept.len());
        let wanted: usize = bufs.iter().map(|b| b.len()).sum();
        if room == 0 && wanted > 0 {
            remember(&mut self.writer, cx);
            return Poll::Pending;
        }
        let mut taken = 0;
        for buf in bufs {
            let part = &buf[..buf.len().min(room)];
            self.kept.extend_from_slice(part);
            taken += part.len();
            room -= part.len();
            if room == 0 {
                break;
            }
        }
        Poll::Ready(Ok(taken))
    }
}

impl<T: Read + Unpin> Read for PassIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let mut state = lock(&self.shared.state);
        if let Some(failed) = state.failure() {
            return Poll::Ready(Err(failed));
        }
        let read = Pin::new(&mut state.io).poll_read(cx, buf);
        if read.is_pending() {
            remember(&mut state.reader, cx);
        }
        read
    }
}

impl<T: Write + Unpin> Write for PassIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        lock(&self.shared.state).keep(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        lock(&self.shared.state).keep(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Answered at once: what is kept is sent when the task's poll ends.
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match lock(&self.shared.state).failure() {
            Some(failed) => Poll::Ready(Err(failed)),
            None => Poll::Ready(Ok(())),
        }
    }

    /// Once everything kept is sent, shuts the socket down.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = lock(&self.shared.state);
        if let Some(failed) = state.failure() {
            return Poll::Ready(Err(failed));
        }
        if !state.kept.is_empty() || state.unflushed {
            remember(&mut state.writer, cx);
            return Poll::Pending;
        }
        Pin::new(&mut state.io).poll_shutdown(cx)
    }
}

fn remember(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(waker) if waker.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

fn wake(slot: &mut Option<Waker>) {
    if let Some(waker) = slot.take() {
        waker.wake();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[path = "pass_writes_tests.rs"]
mod tests;
