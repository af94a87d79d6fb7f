//! The paced response body of a streaming call.
//!
//! All frames are laid out up front as [`Step`]s (bytes and the time they are due), then yielded
//! one timer at a time: deltas batch several tokens (about 20 frames a second, or 8 deltas in
//! all at instant speed), so there is never a timer per token. The body holds the call's
//! [`Reservation`]: it settles the full charge as the last frame goes out, and on a cut (or a
//! client that hangs up) settles at `input + generated x burndown`.
//!
//! A cut ends the body with an error, which makes hyper abort the connection (HTTP/1.1: no final
//! chunk; HTTP/2: `RST_STREAM`), the way a broken upstream looks to a client.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use tokio::time::{Instant, Sleep};

use super::config::SimulatorConfig;
use super::generate::{self, Fault};
use super::quota::Reservation;
use super::shapes::{Framing, Usage};

/// Frames due at one moment.
#[derive(Debug)]
pub struct Step {
    pub at: Duration,
    pub bytes: Bytes,
    /// Output tokens generated once these frames are out.
    pub generated: u64,
}

/// Lays out a stream's frames. `fault` shortens (cut) or delays (stall) it.
pub fn steps(
    config: &SimulatorConfig,
    kind: &dyn Framing,
    text: &str,
    usage: &Usage<'_>,
    request_id: &str,
    fault: Option<Fault>,
) -> Vec<Step> {
    let n = usage.output;
    let batch = if config.tokens_per_second > 0.0 {
        (config.tokens_per_second / 20.0).ceil() as u64
    } else {
        n.div_ceil(8)
    }
    .max(1);
    let mut out = Vec::with_capacity(usize::try_from(n / batch + 3).unwrap_or(8));
    let mut prelude = BytesMut::new();
    for frame in kind.prelude(usage, request_id) {
        prelude.extend_from_slice(&frame);
    }
    let mut emitted = 0;
    while emitted < n {
        let next = (emitted + batch).min(n);
        let mut bytes = std::mem::take(&mut prelude);
        let delta = generate::token_span(text, emitted, next);
        bytes.extend_from_slice(&kind.delta(delta, next, usage));
        out.push(Step {
            at: generate::ready_at(config, next),
            bytes: bytes.freeze(),
            generated: next,
        });
        emitted = next;
    }
    let mut tail = prelude;
    for frame in kind.epilogue(usage) {
        tail.extend_from_slice(&frame);
    }
    out.push(Step {
        at: generate::ready_at(config, n),
        bytes: tail.freeze(),
        generated: n,
    });
    let deltas = out.len() - 1;
    match fault {
        Some(Fault::Cut) => out.truncate((deltas / 2).max(1)),
        Some(Fault::Stall) => {
            let stall = Duration::from_millis(config.stall_ms);
            for step in out.iter_mut().skip((deltas / 2).max(1)) {
                step.at += stall;
            }
        }
        Some(Fault::Unavailable | Fault::Internal | Fault::Reset) | None => {}
    }
    out
}

/// The streaming body: yields [`Step`]s on time, then ends cleanly or, if `cut`, with an error.
pub struct Paced {
    steps: std::vec::IntoIter<Step>,
    next: Option<Step>,
    start: Instant,
    sleep: Pin<Box<Sleep>>,
    reservation: Option<Reservation>,
    output: u64,
    cut: bool,
    /// When the cut happens, once armed.
    cut_at: Option<Instant>,
    /// Adds the bytes of every frame handed to the connection (`SimStats::stream_bytes_sent`).
    sent: Option<Arc<AtomicU64>>,
}

/// How long after the last frame a cut breaks the connection. Pausing first lets hyper flush
/// what was sent, so the client sees frames and then a broken stream (not an empty reply).
const CUT_GRACE: Duration = Duration::from_millis(20);

impl Paced {
    pub fn new(
        steps: Vec<Step>,
        reservation: Option<Reservation>,
        output: u64,
        cut: bool,
    ) -> Paced {
        let start = Instant::now();
        let mut steps = steps.into_iter();
        Paced {
            next: steps.next(),
            steps,
            start,
            sleep: Box::pin(tokio::time::sleep_until(start)),
            reservation,
            output,
            cut,
            cut_at: None,
            sent: None,
        }
    }

    /// Counts the bytes this body hands to the connection into `sent`.
    pub fn counting(mut self, sent: Arc<AtomicU64>) -> Paced {
        self.sent = Some(sent);
        self
    }
}

impl Stream for Paced {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(step) = this.next.as_ref() else {
            if this.cut {
                let due = *this
                    .cut_at
                    .get_or_insert_with(|| Instant::now() + CUT_GRACE);
                if this.sleep.deadline() != due {
                    this.sleep.as_mut().reset(due);
                }
                if this.sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.cut = false;
                if let Some(r) = this.reservation.take() {
                    r.fail(std::time::Instant::now());
                }
                return Poll::Ready(Some(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "simulated stream cut",
                ))));
            }
            return Poll::Ready(None);
        };
        let due = this.start + step.at;
        if due > Instant::now() {
            if this.sleep.deadline() != due {
                this.sleep.as_mut().reset(due);
            }
            if this.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        let Some(step) = this.next.take() else {
            return Poll::Ready(None);
        };
        this.next = this.steps.next();
        if let Some(r) = this.reservation.as_mut() {
            r.set_generated(step.generated);
        }
        if this.next.is_none()
            && !this.cut
            && let Some(r) = this.reservation.take()
        {
            r.complete(0, this.output, std::time::Instant::now());
        }
        if let Some(sent) = &this.sent {
            sent.fetch_add(step.bytes.len() as u64, Relaxed);
        }
        Poll::Ready(Some(Ok(step.bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulator::shapes::StreamKind;
    use futures_util::StreamExt;

    fn usage(output: u64) -> Usage<'static> {
        Usage {
            model_id: "m",
            input: 10,
            output,
            hit_max: false,
            latency_ms: 0,
            first_byte_ms: 0,
            tier: None,
        }
    }

    #[test]
    fn deltas_are_batched_and_paced() {
        let c = SimulatorConfig {
            time_to_first_token_ms: 200,
            tokens_per_second: 100.0,
            ..SimulatorConfig::default()
        };
        let text = generate::text(1, 100);
        let s = steps(&c, &StreamKind::Converse, &text, &usage(100), "id", None);
        assert_eq!(
            s.len(),
            20 + 1,
            "5 tokens a frame at 100 tok/s, then the epilogue"
        );
        assert_eq!(s[0].at, Duration::from_millis(240));
        assert_eq!(s[20].at, Duration::from_millis(1190));
        assert_eq!(s[20].generated, 100);

        let cut = steps(
            &c,
            &StreamKind::Converse,
            &text,
            &usage(100),
            "id",
            Some(Fault::Cut),
        );
        assert_eq!((cut.len(), cut[9].generated), (10, 50));
        let stall = steps(
            &c,
            &StreamKind::Converse,
            &text,
            &usage(100),
            "id",
            Some(Fault::Stall),
        );
        assert_eq!(stall[20].at, Duration::from_millis(6190));
        assert_eq!(stall[9].at, s[9].at);
    }

    #[tokio::test(start_paused = true)]
    async fn the_body_keeps_time_and_ends_with_an_error_when_cut() {
        let c = SimulatorConfig {
            time_to_first_token_ms: 200,
            tokens_per_second: 100.0,
            ..SimulatorConfig::default()
        };
        let text = generate::text(1, 100);
        let start = Instant::now();
        let s = steps(&c, &StreamKind::Converse, &text, &usage(100), "id", None);
        let items: Vec<_> = Paced::new(s, None, 100, false).collect().await;
        assert_eq!(items.len(), 21);
        assert!(items.iter().all(Result::is_ok));
        assert_eq!(start.elapsed(), Duration::from_millis(1190));

        let s = steps(
            &c,
            &StreamKind::Converse,
            &text,
            &usage(100),
            "id",
            Some(Fault::Cut),
        );
        let items: Vec<_> = Paced::new(s, None, 100, true).collect().await;
        assert_eq!(items.len(), 11);
        assert!(items.last().is_some_and(Result::is_err));
    }
}
