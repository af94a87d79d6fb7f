//! Step 5: the response body on its way back to the client, metered as it passes.
//! (Over 500 lines: the guards, the body and its end-of-stream paths settle one hold, side by side.)
//!
//! Each frame from upstream is handed to the client as is. On the way, a [`UsageReader`] reads
//! it (Bedrock's [`crate::bedrock::UsageObserver`], or an endpoint container's
//! [`crate::sagemaker::PayloadUsage`]), and the
//! request's reservation is settled the moment usage is known, not when the connection closes.
//! The body also enforces the idle timeout between chunks.
//!
//! An event stream is passed on in whole frames ([`WholeFrames`]): a chunk that ends inside a frame
//! passes on up to the last frame boundary, and the rest waits for the next chunk (at most one
//! frame, up to [`FRAME_CAP`]), so the client never holds part of a frame the proxy cannot finish.
//!
//! A streamed Chat Completions call whose usage the proxy asked for on the client's behalf
//! passes through a [`UsageChunkFilter`], which takes that usage chunk out (holding at most one
//! partial SSE event back until its end arrives); the meter reads the stream as upstream sent it.
//!
//! When the upstream fails mid-body (connection reset, stream cut, idle timeout, a stream that
//! ends inside a frame, framing that is not event-stream), an event stream drops any partial
//! frame held and ends with a `modelStreamErrorException` frame (an endpoint's: `ModelStreamError`),
//! the only way a stream that
//! answered 200 can report an error, and one that starts on a frame boundary; a plain body ends
//! with an error, which aborts the response so the client sees a truncated body rather than a
//! complete-looking one. Either way the reservation is settled by the `no_usage` rule. If the
//! client hangs up, the body is dropped and settles the same way.
//!
//! A bidirectional stream (InvokeModelWithBidirectionalStream) settles when it ends, to the last
//! running totals its `usageEvent`s reported; ended early, by the `no_usage` rule on those totals.
//! One that upstream refuses in-band (a `throttlingException` before any usage) is not charged,
//! and shrinks its pool as a 429 does.
//!
//! At shutdown, once the drain deadline passes ([`crate::server::ServeOptions::deadline`]), a
//! response still in flight ends the same way, with a `serviceUnavailableException` frame for a
//! stream, and settles by the `no_usage` rule.
//!
//! An admitted request travels as an [`InFlight`]: its [`Hold`] and its [`Observation`]. Every
//! settlement goes through it, so what settled is observed once, whichever path settled it; if it
//! is dropped unsettled (the client left while the proxy waited for upstream) it settles by the
//! `abandoned` rule.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use crate::upstream::PooledBody;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{
    admission::{Hold, Pool, Settled},
    bedrock::{
        ErrorCode, Usage, eventstream::WholeFrames, sse::UsageChunkFilter, usage::FRAME_CAP,
    },
    observe::{Observation, Observer},
    upstream::Upstream,
};

use super::usage_reader::UsageReader;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The frame that ends an event stream early, in the dialect of the API that streams it.
pub type ExceptionFrame = fn(ErrorCode, &str) -> Bytes;

/// An admitted request on its way: its reservation and its record. Every settlement goes
/// through here and is observed once.
#[derive(Debug)]
pub struct InFlight {
    hold: Hold,
    obs: Option<Observation>,
    observer: Arc<Observer>,
}

impl InFlight {
    pub fn new(hold: Hold, obs: Option<Observation>, observer: Arc<Observer>) -> InFlight {
        InFlight {
            hold,
            obs,
            observer,
        }
    }

    pub fn hold(&self) -> &Hold {
        &self.hold
    }

    /// The answer the client gets (upstream's head, or tokengate's own error).
    pub fn answered(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        if let Some(obs) = self.obs.as_mut() {
            obs.answered(status, headers);
        }
    }

    fn observed(&mut self, settled: Option<Settled>) {
        if let (Some(settled), Some(obs)) = (settled, self.obs.take()) {
            self.observer.settled(obs, &settled);
        }
    }

    /// The call stopped at its output cap (its stop reason said so).
    pub fn truncated(&mut self) {
        self.hold.note_truncated();
        self.observer.truncated(self.hold.pool(), self.hold.route());
    }

    pub fn settle_usage(&mut self, usage: &Usage) {
        let settled = self.hold.settle_usage(usage);
        self.observed(settled);
    }

    pub fn settle_not_charged(&mut self) {
        let settled = self.hold.settle_not_charged();
        self.observed(settled);
    }

    pub fn settle_without_usage(&mut self, output_seen: u64) {
        let settled = self.hold.settle_without_usage(output_seen);
        self.observed(settled);
    }

    pub fn settle_cut_after(&mut self, running: &Usage) {
        let settled = self.hold.settle_cut_after(running);
        self.observed(settled);
    }

    /// Upstream turned the call away in-band (a stream's `throttlingException`): the pool
    /// shrinks as for a 429, and nothing is charged.
    pub fn throttled_in_band(&mut self) {
        self.hold.pool().upstream_throttled();
        self.upstream_throttled(None);
        self.settle_not_charged();
    }

    pub fn settle_timeout(&mut self) {
        let settled = self.hold.settle_timeout();
        self.observed(settled);
    }

    /// Upstream throttled the request: `hint` is the retry hint answered to the client (none
    /// for a throttle reported in-band).
    pub fn upstream_throttled(&self, hint: Option<Duration>) {
        self.observer
            .upstream_throttled(self.hold.pool(), self.obs.as_ref(), hint);
    }

    fn first_byte(&mut self) {
        if let Some(obs) = self.obs.as_mut() {
            self.observer.first_byte(obs);
        }
    }

    fn first_token(&mut self) {
        if let Some(obs) = self.obs.as_mut() {
            self.observer.first_token(obs);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let settled = self.hold.settle_abandoned();
        self.observed(settled);
    }
}

/// Reads usage out of a response in flight and settles its reservation with it.
#[derive(Debug)]
pub struct Meter {
    usage: UsageReader,
    in_flight: InFlight,
}

impl Meter {
    pub fn new(usage: UsageReader, in_flight: InFlight) -> Meter {
        Meter { usage, in_flight }
    }

    fn unsettled_output(&self) -> u64 {
        self.usage.output_tokens_seen()
    }

    /// Bytes passed to the client: settle the moment they carry usage.
    fn data(&mut self, data: &[u8]) {
        self.in_flight.first_byte();
        let usage = self.usage.on_data(data);
        // Generated content seen: a stream's first content event, any body bytes of a
        // non-streamed response.
        let seen = self.usage.output_tokens_seen();
        if seen > 0 {
            self.in_flight.first_token();
            self.in_flight.hold.output_progress(seen);
        }
        if let Some(usage) = usage {
            self.in_flight.settle_usage(&usage);
        }
    }

    /// The body ended cleanly: settle on its usage, as not charged if upstream refused a
    /// bidirectional stream in-band, or by the `no_usage` rule.
    fn end(&mut self) {
        let usage = self.usage.on_end();
        if self.usage.truncated() {
            self.in_flight.truncated();
        }
        match usage {
            Some(usage) => self.in_flight.settle_usage(&usage),
            None if self.usage.refused_in_band() => self.in_flight.throttled_in_band(),
            None => self.cut(),
        }
    }

    /// A response body read whole before any of it went to the client (the first answer of an
    /// adaptive retry: [`super::adaptive_retry`]): metered as if it had passed through, and
    /// settled. Returns whether its stop reason said it stopped at its output cap.
    pub fn whole(mut self, body: &[u8]) -> bool {
        self.data(body);
        self.end();
        self.usage.truncated()
    }

    fn cut(&mut self) {
        match self.usage.running_usage() {
            Some(running) => self.in_flight.settle_cut_after(&running),
            None => {
                let seen = self.unsettled_output();
                self.in_flight.settle_without_usage(seen);
            }
        }
    }
}

impl Drop for Meter {
    /// The client went away (or the body was otherwise dropped) before usage arrived.
    fn drop(&mut self) {
        if !self.in_flight.hold.is_settled() {
            self.cut();
        }
    }
}

pin_project! {
    /// An upstream response body, passed through and metered.
    #[project = MeteredBodyProj]
    pub struct MeteredBody {
        #[pin]
        inner: PooledBody,
        meter: Option<Meter>,
        observer: Arc<Observer>,
        pool: Option<Arc<Pool>>,
        #[pin]
        idle: Sleep,
        idle_timeout: Duration,
        // The drain deadline: checked on every frame, waited on while upstream is quiet.
        deadline: CancellationToken,
        #[pin]
        deadline_passed: WaitForCancellationFutureOwned,
        // Event streams only: what is passed on, whole frames, and how the stream ends early.
        frames: Option<(WholeFrames, ExceptionFrame)>,
        // Takes out of a Chat Completions stream the usage chunk the client did not ask for.
        filter: Option<UsageChunkFilter>,
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
    /// Wraps `inner`, a response of `upstream` (whose idle timeout and drain deadline apply).
    /// `meter` is `None` for responses that settle nothing (uncounted calls, error responses
    /// already settled). `event_stream` is how an event stream ends early (`None`: a plain body).
    pub fn new(
        inner: PooledBody,
        meter: Option<Meter>,
        observer: Arc<Observer>,
        pool: Option<Arc<Pool>>,
        upstream: &Upstream,
        event_stream: Option<ExceptionFrame>,
    ) -> MeteredBody {
        let idle_timeout = upstream.idle_timeout;
        let deadline = upstream.deadline().clone();
        MeteredBody {
            inner,
            meter,
            observer,
            pool,
            idle: tokio::time::sleep(idle_timeout),
            idle_timeout,
            deadline_passed: deadline.clone().cancelled_owned(),
            deadline,
            frames: event_stream.map(|exception| (WholeFrames::new(FRAME_CAP), exception)),
            filter: None,
            finished: false,
        }
    }

    /// Passes the body through `filter` on its way to the client (the meter still reads what
    /// upstream sent).
    pub fn with_filter(mut self, filter: Option<UsageChunkFilter>) -> MeteredBody {
        self.filter = filter;
        self
    }
}

/// Why a response ended before upstream finished it.
enum Failure {
    /// Upstream sent nothing for the idle timeout.
    Idle,
    /// The upstream connection failed.
    Upstream(String),
    /// The shutdown drain deadline passed.
    Deadline,
    /// The event stream is not whole frames: it ended inside one, or a frame's length is
    /// impossible.
    Framing(String),
}

impl Failure {
    /// The exception to end a stream with, its message, and the `kind` of
    /// `tokengate_upstream_errors_total` (none for the deadline: not upstream's fault).
    fn describe(self, idle_timeout: Duration) -> (ErrorCode, String, Option<&'static str>) {
        match self {
            Failure::Idle => (
                ErrorCode::ModelStreamError,
                format!("upstream sent nothing for {idle_timeout:?}"),
                Some("idle_timeout"),
            ),
            Failure::Upstream(e) => (
                ErrorCode::ModelStreamError,
                format!("upstream stream interrupted: {e}"),
                Some("stream_cut"),
            ),
            Failure::Framing(e) => (
                ErrorCode::ModelStreamError,
                format!("upstream stream broken: {e}"),
                Some("bad_frame"),
            ),
            Failure::Deadline => (
                ErrorCode::ServiceUnavailable,
                "tokengate is shutting down and this response did not finish within its drain \
                 deadline (server.drain_secs); retry the request"
                    .to_string(),
                None,
            ),
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
        let failure = loop {
            if *this.finished {
                return Poll::Ready(None);
            }
            if this.deadline.is_cancelled() {
                break Failure::Deadline;
            }
            let frame = match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    if this.deadline_passed.as_mut().poll(cx).is_ready() {
                        break Failure::Deadline;
                    }
                    ready!(this.idle.as_mut().poll(cx));
                    break Failure::Idle;
                }
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(e))) => break Failure::Upstream(e.to_string()),
                Poll::Ready(None) => match end(&mut this) {
                    Ok(()) => return Poll::Ready(filtered_rest(this.filter).map(Ok)),
                    Err(broken) => break broken,
                },
            };
            this.idle
                .as_mut()
                .reset(Instant::now() + *this.idle_timeout);
            let last = this.inner.is_end_stream();
            let frame = match whole_frames(this.frames.as_mut().map(|(f, _)| f), frame) {
                Ok(Some(frame)) => frame,
                // Nothing whole yet: read on.
                Ok(None) if !last => continue,
                Ok(None) => match end(&mut this) {
                    Ok(()) => return Poll::Ready(None),
                    Err(broken) => break broken,
                },
                Err(broken) => break broken,
            };
            if let (Some(meter), Some(data)) = (this.meter.as_mut(), frame.data_ref()) {
                meter.data(data);
            }
            // A body of known length is complete with its last byte, and the server may drop it
            // without polling for the end: settle now.
            if last && let Err(broken) = end(&mut this) {
                break broken;
            }
            // A filtered stream may hold all of a frame back (part of an event): read on.
            if let Some(frame) = pass_on(this.filter, frame, last) {
                return Poll::Ready(Some(Ok(frame)));
            }
        };
        end_early(this, failure)
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        if self.frames.is_some() || self.filter.is_some() {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

/// The body ended: settle on its usage, unless it is an event stream that ended inside a frame.
fn end(this: &mut MeteredBodyProj<'_>) -> Result<(), Failure> {
    if let Some(broken) = unfinished_frame(this.frames.as_ref().map(|(f, _)| f)) {
        return Err(broken);
    }
    *this.finished = true;
    if let Some(meter) = this.meter.as_mut() {
        meter.end();
    }
    Ok(())
}

/// The response ends early (upstream failed, went quiet, or the drain deadline passed): count
/// it, settle without usage, and end a stream with an exception frame, any other body with an
/// error.
fn end_early(
    this: MeteredBodyProj<'_>,
    failure: Failure,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    *this.finished = true;
    let (code, message, kind) = failure.describe(*this.idle_timeout);
    match kind {
        Some(kind) => this
            .observer
            .upstream_error(this.pool.as_deref(), kind, &message),
        None => tracing::warn!(failure = %message, "response ended early"),
    }
    if let Some(meter) = this.meter.as_mut() {
        meter.cut();
    }
    match *this.frames {
        // Any partial frame held is dropped: the exception starts on a frame boundary.
        Some((_, exception_frame)) => {
            Poll::Ready(Some(Ok(Frame::data(exception_frame(code, &message)))))
        }
        None => Poll::Ready(Some(Err(message.into()))),
    }
}

/// An event stream's chunk cut back to the whole frames it completes (`None`: none yet); any
/// other body's frame as it is.
fn whole_frames(
    frames: Option<&mut WholeFrames>,
    frame: Frame<Bytes>,
) -> Result<Option<Frame<Bytes>>, Failure> {
    let Some(frames) = frames else {
        return Ok(Some(frame));
    };
    match frame.into_data() {
        Ok(chunk) => match frames.push(chunk) {
            Ok(whole) if whole.is_empty() => Ok(None),
            Ok(whole) => Ok(Some(Frame::data(whole))),
            Err(e) => Err(Failure::Framing(e.to_string())),
        },
        Err(trailers) => Ok(Some(trailers)),
    }
}

/// What the client gets of one upstream frame: the frame, or what the filter lets through of its
/// data (with the filter's rest at the `end`); `None` when that is nothing yet.
fn pass_on(
    filter: &mut Option<UsageChunkFilter>,
    frame: Frame<Bytes>,
    end: bool,
) -> Option<Frame<Bytes>> {
    let Some(filter) = filter else {
        return Some(frame);
    };
    let data = match frame.into_data() {
        Ok(data) => data,
        Err(frame) => return Some(frame),
    };
    let mut out = bytes::BytesMut::from(filter.push(&data));
    if end {
        out.extend_from_slice(&filter.finish());
    }
    (!out.is_empty()).then(|| Frame::data(out.freeze()))
}

/// The end of a filtered stream: what the filter still holds, if anything.
fn filtered_rest(filter: &mut Option<UsageChunkFilter>) -> Option<Frame<Bytes>> {
    let rest = filter.as_mut()?.finish();
    (!rest.is_empty()).then(|| Frame::data(rest))
}

/// The failure of an event stream that ends with part of a frame held.
fn unfinished_frame(frames: Option<&WholeFrames>) -> Option<Failure> {
    let held = frames.map_or(0, WholeFrames::held);
    (held > 0).then(|| {
        Failure::Framing(format!(
            "the stream ended inside a frame ({held} bytes of it arrived)"
        ))
    })
}
