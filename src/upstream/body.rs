//! An upstream response body, and the count of its HTTP/2 stream ([`StreamGuard`]) that it holds
//! until the body ends, fails or is dropped, whichever comes first (so a connection's count
//! never outlives its streams, whatever path a response takes).

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// Counts one stream on a connection until dropped.
pub struct StreamGuard {
    conn: Arc<dyn StreamCount>,
}

impl StreamGuard {
    pub(super) fn new(conn: Arc<dyn StreamCount>) -> StreamGuard {
        StreamGuard { conn }
    }
}

/// What a stream is counted on (an HTTP/2 connection of the set).
pub(super) trait StreamCount: Send + Sync {
    fn release(&self);
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.conn.release();
    }
}

impl std::fmt::Debug for StreamGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamGuard")
    }
}

/// A response body from upstream, holding its stream's count (if it came over the set) until
/// it ends, fails or is dropped.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    stream: Option<StreamGuard>,
}

impl PooledBody {
    /// A body that came over hyper's own client: nothing to count.
    pub fn plain(inner: Incoming) -> PooledBody {
        PooledBody {
            inner,
            stream: None,
        }
    }

    /// A body whose stream stays counted by `stream` until it ends.
    pub(super) fn counted(inner: Incoming, stream: StreamGuard) -> PooledBody {
        PooledBody {
            inner,
            stream: Some(stream),
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.stream = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
