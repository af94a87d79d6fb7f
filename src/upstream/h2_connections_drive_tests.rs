//! A connection's task ([`Drive`]) polled by hand, with a stand-in for hyper's dispatch.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    task::Waker,
};

use hyper::rt::Executor;
use hyper_util::rt::TokioIo;

use super::*;

/// hyper's dispatch, never ending, with a server that allows one stream.
struct Dispatch;

impl Future for Dispatch {
    type Output = hyper::Result<()>;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<hyper::Result<()>> {
        Poll::Pending
    }
}

impl MaxSendStreams for Dispatch {
    fn max_send_streams(&self) -> usize {
        1
    }
}

#[test]
fn a_panic_in_one_handed_future_ends_it_alone() {
    let (socket, _peer) = tokio::io::duplex(64);
    let (_io, writes) = pass_io(TokioIo::new(socket));
    let handed = ConnFutures::default();
    let (limit, _) = watch::channel(0);
    let mut drive = Drive::new(Dispatch, handed.clone(), writes, limit);

    let finished = Arc::new(AtomicBool::new(false));
    handed.execute(async { panic!("one stream's future fails") });
    let flag = finished.clone();
    handed.execute(async move { flag.store(true, Ordering::SeqCst) });

    let mut cx = Context::from_waker(Waker::noop());
    assert!(Pin::new(&mut drive).poll(&mut cx).is_pending());
    assert!(
        finished.load(Ordering::SeqCst),
        "the other future ran to its end"
    );
    assert!(drive.work.futures.is_empty(), "both have ended");
    assert!(drive.work.connection.is_some(), "the connection goes on");

    let second = Arc::new(AtomicBool::new(false));
    let flag = second.clone();
    handed.execute(async move { flag.store(true, Ordering::SeqCst) });
    assert!(Pin::new(&mut drive).poll(&mut cx).is_pending());
    assert!(
        second.load(Ordering::SeqCst),
        "and runs what it is handed next"
    );
}
