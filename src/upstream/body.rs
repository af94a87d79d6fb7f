//! The response body on its way back to the client, metered as it passes.
//!
//! Each frame from upstream is handed to the client as is. On the way, a [`UsageObserver`] reads
//! it, and the request's reservation is settled the moment usage is known, not when the
//! connection closes. The body also enforces the idle timeout between chunks.
//!
//! When the upstream fails mid-body (connection reset, stream cut, idle timeout), an event stream
//! ends with a `modelStreamErrorException` frame, the only way a stream that answered 200 can
//! report an error; a plain body ends with an error, which aborts the response so the client sees
//! a truncated body rather than a complete-looking one. Either way the reservation is settled by
//! the `no_usage` rule. If the client hangs up, the body is dropped and settles the same way.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::{
    admission::Admitted,
    bedrock::{ErrorCode, UsageObserver, eventstream::exception_frame},
    metrics::Metrics,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Settles the reservation of a response in flight.
#[derive(Debug)]
struct Meter {
    observer: UsageObserver,
    admitted: Admitted,
}

impl Meter {
    fn unsettled_output(&self) -> u64 {
        self.observer.output_tokens_seen()
    }

    /// The body ended cleanly: settle on its usage, or by the `no_usage` rule.
    fn end(&mut self) {
        match self.observer.on_end() {
            Some(usage) => self.admitted.settle_usage(&usage),
            None => {
                let seen = self.unsettled_output();
                self.admitted.settle_without_usage(seen);
            }
        }
    }
}

impl Drop for Meter {
    /// The client went away (or the body was otherwise dropped) before usage arrived.
    fn drop(&mut self) {
        if !self.admitted.is_settled() {
            let seen = self.unsettled_output();
            self.admitted.settle_without_usage(seen);
        }
    }
}

pin_project! {
    /// An upstream response body, passed through and metered.
    pub struct MeteredBody {
        #[pin]
        inner: Incoming,
        meter: Option<Meter>,
        metrics: std::sync::Arc<Metrics>,
        pool: std::sync::Arc<str>,
        #[pin]
        idle: Sleep,
        idle_timeout: Duration,
        event_stream: bool,
        finished: bool,
    }
}

impl std::fmt::Debug for MeteredBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBody")
            .field("meter", &self.meter)
            .finish_non_exhaustive()
    }
}

impl MeteredBody {
    /// Wraps `inner`. `meter` is `None` for responses that settle nothing (uncounted calls,
    /// error responses already settled).
    pub fn new(
        inner: Incoming,
        metered: Option<(UsageObserver, Admitted)>,
        metrics: std::sync::Arc<Metrics>,
        pool: std::sync::Arc<str>,
        idle_timeout: Duration,
        event_stream: bool,
    ) -> MeteredBody {
        MeteredBody {
            inner,
            meter: metered.map(|(observer, admitted)| Meter { observer, admitted }),
            metrics,
            pool,
            idle: tokio::time::sleep(idle_timeout),
            idle_timeout,
            event_stream,
            finished: false,
        }
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.finished {
            return Poll::Ready(None);
        }
        let polled = this.inner.as_mut().poll_frame(cx);
        let failure = match polled {
            Poll::Pending => {
                ready!(this.idle.as_mut().poll(cx));
                format!("upstream sent nothing for {:?}", this.idle_timeout)
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.idle
                    .as_mut()
                    .reset(Instant::now() + *this.idle_timeout);
                if let (Some(meter), Some(data)) = (this.meter.as_mut(), frame.data_ref()) {
                    meter.admitted.first_byte();
                    let usage = meter.observer.on_data(data);
                    // Generated content seen: a stream's first content event, any body bytes
                    // of a non-streamed response.
                    let seen = meter.observer.output_tokens_seen();
                    if seen > 0 {
                        meter.admitted.first_token();
                        meter.admitted.output_progress(seen);
                    }
                    if let Some(usage) = usage {
                        meter.admitted.settle_usage(&usage);
                    }
                }
                // A body of known length is complete with its last byte, and the server may
                // drop it without polling for the end: settle now.
                if this.inner.is_end_stream() {
                    *this.finished = true;
                    if let Some(meter) = this.meter.as_mut() {
                        meter.end();
                    }
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(None) => {
                *this.finished = true;
                if let Some(meter) = this.meter.as_mut() {
                    meter.end();
                }
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => format!("upstream stream interrupted: {e}"),
        };
        // The upstream failed mid-body.
        *this.finished = true;
        let kind = if failure.starts_with("upstream sent nothing") {
            "idle_timeout"
        } else {
            "stream_cut"
        };
        this.metrics
            .upstream_errors
            .with_label_values(&[this.pool, kind])
            .inc();
        tracing::warn!(pool = %this.pool, %failure, "response ended early");
        if let Some(meter) = this.meter.as_mut() {
            let seen = meter.unsettled_output();
            meter.admitted.settle_without_usage(seen);
        }
        if *this.event_stream {
            Poll::Ready(Some(Ok(Frame::data(exception_frame(
                ErrorCode::ModelStreamError,
                &failure,
            )))))
        } else {
            Poll::Ready(Some(Err(failure.into())))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        if self.event_stream {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}
