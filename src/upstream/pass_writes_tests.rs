use std::{
    sync::atomic::{AtomicUsize, Ordering},
    task::Wake,
};

use hyper::rt::ReadBuf;

use super::*;

/// A socket in memory: what each write call took, flushes, shutdown; it can be made to take at
/// most some bytes per call, to wait (waking when told), or to fail.
#[derive(Clone, Default)]
struct Socket(Arc<Mutex<Sink>>);

#[derive(Default)]
struct Sink {
    writes: Vec<Vec<u8>>,
    flushes: usize,
    shut: bool,
    per_call: Option<usize>,
    blocked: bool,
    waiting: Option<Waker>,
    fail: Option<io::ErrorKind>,
}

impl Socket {
    fn sink(&self) -> MutexGuard<'_, Sink> {
        lock(&self.0)
    }

    fn received(&self) -> Vec<u8> {
        self.sink().writes.concat()
    }

    fn unblock(&self) {
        let mut sink = self.sink();
        sink.blocked = false;
        wake(&mut sink.waiting);
    }
}

impl Read for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        _: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        self.sink().waiting = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Write for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut sink = self.sink();
        if let Some(kind) = sink.fail {
            return Poll::Ready(Err(kind.into()));
        }
        if sink.blocked {
            sink.waiting = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = sink.per_call.map_or(buf.len(), |most| most.min(buf.len()));
        sink.writes.push(buf[..n].to_vec());
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.sink().flushes += 1;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.sink().shut = true;
        Poll::Ready(Ok(()))
    }
}

/// A waker that counts its wake-ups.
#[derive(Default)]
struct Wakes(AtomicUsize);

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A task context whose wake-ups are counted.
struct Task {
    wakes: Arc<Wakes>,
    waker: Waker,
}

impl Task {
    fn new() -> Task {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        Task { wakes, waker }
    }

    fn cx(&self) -> Context<'_> {
        Context::from_waker(&self.waker)
    }

    fn wakes(&self) -> usize {
        self.wakes.0.load(Ordering::SeqCst)
    }
}

fn write(io: &mut PassIo<Socket>, task: &Task, bytes: &[u8]) -> Poll<io::Result<usize>> {
    Pin::new(io).poll_write(&mut task.cx(), bytes)
}

fn flush(io: &mut PassIo<Socket>, task: &Task) -> Poll<io::Result<()>> {
    Pin::new(io).poll_flush(&mut task.cx())
}

fn read(io: &mut PassIo<Socket>, task: &Task) -> Poll<io::Result<()>> {
    let mut bytes = [0u8; 16];
    let mut buf = ReadBuf::new(&mut bytes);
    Pin::new(io).poll_read(&mut task.cx(), buf.unfilled())
}

fn ok<T: std::fmt::Debug>(polled: Poll<io::Result<T>>) -> T {
    match polled {
        Poll::Ready(Ok(value)) => value,
        other => panic!("expected Ready(Ok), got {other:?}"),
    }
}

fn failed_with<T: std::fmt::Debug>(polled: Poll<io::Result<T>>) -> io::ErrorKind {
    match polled {
        Poll::Ready(Err(e)) => e.kind(),
        other => panic!("expected Ready(Err), got {other:?}"),
    }
}

#[test]
fn what_a_poll_writes_and_flushes_reaches_the_socket_in_one_call_when_sent() {
    let socket = Socket::default();
    let (mut io, writes) = pass_io(socket.clone());
    let h2 = Task::new();
    assert_eq!(ok(write(&mut io, &h2, b"HEADERS")), 7);
    ok(flush(&mut io, &h2));
    let vectored = [IoSlice::new(b"DA"), IoSlice::new(b"TA")];
    assert_eq!(
        ok(Pin::new(&mut io).poll_write_vectored(&mut h2.cx(), &vectored)),
        4
    );
    ok(flush(&mut io, &h2));
    assert!(socket.sink().writes.is_empty(), "nothing before the send");

    ok(writes.poll_send(&mut Task::new().cx()));
    assert_eq!(socket.sink().writes, vec![b"HEADERSDATA".to_vec()]);
    assert_eq!(socket.sink().flushes, 1, "flushed once, after the write");

    ok(writes.poll_send(&mut Task::new().cx()));
    assert_eq!(socket.sink().writes.len(), 1, "nothing more to send");
    assert_eq!(socket.sink().flushes, 1, "nor to flush");
}

#[test]
fn a_socket_that_takes_part_of_a_send_gets_the_rest_in_order() {
    let socket = Socket::default();
    socket.sink().per_call = Some(3);
    let (mut io, writes) = pass_io(socket.clone());
    let h2 = Task::new();
    ok(write(&mut io, &h2, b"abcdefgh"));
    ok(writes.poll_send(&mut Task::new().cx()));
    assert_eq!(
        socket.sink().writes,
        vec![b"abc".to_vec(), b"def".to_vec(), b"gh".to_vec()]
    );
}

#[test]
fn a_write_past_the_limit_waits_until_the_send_makes_room() {
    let socket = Socket::default();
    socket.sink().blocked = true;
    let (mut io, writes) = with_limit(socket.clone(), 8);
    let h2 = Task::new();
    assert_eq!(ok(write(&mut io, &h2, b"0123456789")), 8, "what fits");
    assert!(write(&mut io, &h2, b"89").is_pending(), "full");

    let drive = Task::new();
    assert!(
        writes.poll_send(&mut drive.cx()).is_pending(),
        "the socket waits"
    );
    assert_eq!(h2.wakes(), 0, "no room yet");
    socket.unblock();
    assert_eq!(drive.wakes(), 1, "the socket wakes the task that sends");
    ok(writes.poll_send(&mut drive.cx()));
    assert_eq!(h2.wakes(), 1, "room: the writer is woken");
    assert_eq!(ok(write(&mut io, &h2, b"89")), 2);
    ok(writes.poll_send(&mut drive.cx()));
    assert_eq!(socket.received(), b"0123456789");
}

#[test]
fn a_failed_send_fails_what_follows_and_wakes_the_reader() {
    let socket = Socket::default();
    let (mut io, writes) = pass_io(socket.clone());
    let h2 = Task::new();
    assert!(read(&mut io, &h2).is_pending());
    ok(write(&mut io, &h2, b"HEADERS"));
    socket.sink().fail = Some(io::ErrorKind::BrokenPipe);

    let failed = writes.poll_send(&mut Task::new().cx());
    assert_eq!(failed_with(failed), io::ErrorKind::BrokenPipe);
    assert_eq!(h2.wakes(), 1, "the waiting read is woken to see it");
    socket.sink().fail = None;
    assert_eq!(failed_with(read(&mut io, &h2)), io::ErrorKind::BrokenPipe);
    assert_eq!(
        failed_with(write(&mut io, &h2, b"DATA")),
        io::ErrorKind::BrokenPipe
    );
    assert_eq!(failed_with(flush(&mut io, &h2)), io::ErrorKind::BrokenPipe);
    assert_eq!(
        failed_with(writes.poll_send(&mut Task::new().cx())),
        io::ErrorKind::BrokenPipe
    );
}

#[test]
fn shutdown_waits_until_everything_kept_is_sent() {
    let socket = Socket::default();
    let (mut io, writes) = pass_io(socket.clone());
    let h2 = Task::new();
    ok(write(&mut io, &h2, b"GOAWAY"));
    assert!(Pin::new(&mut io).poll_shutdown(&mut h2.cx()).is_pending());
    assert!(!socket.sink().shut);

    ok(writes.poll_send(&mut Task::new().cx()));
    assert_eq!(h2.wakes(), 1, "sent: shutdown may go on");
    ok(Pin::new(&mut io).poll_shutdown(&mut h2.cx()));
    assert!(socket.sink().shut);
    assert_eq!(socket.received(), b"GOAWAY");
}
