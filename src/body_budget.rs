//! The budget of request-body bytes held in memory by all requests together
//! (`server.max_buffered_body_bytes`), and the bounded body read that charges it.
//!
//! A request body is read whole before admission (admission needs `maxTokens` and the input
//! estimate, SigV4 the payload hash), so without a bound the bodies of many slow or never-finished
//! requests add up to whatever the clients choose. [`BodyBudget::read`] charges the budget for a
//! body before holding it: the whole `Content-Length` up front when the request declares one (so a
//! body that could never fit is refused before a byte of it is read), otherwise each chunk as it
//! arrives. A request that would take the total past the limit is answered at once with a
//! retryable 503 `ServiceUnavailableException` and a jittered retry hint; nothing waits for room.
//!
//! # Release
//! The charge travels with the bytes: the [`Bytes`] a read returns owns it, and gives it back when
//! its last clone is dropped (the request was forwarded, refused or abandoned). A read that fails,
//! times out or is dropped because the client hung up gives its charge back at once. So the
//! budget counts exactly the bodies alive in memory, and returns to zero when they are gone
//! (`tokengate_buffered_body_bytes`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, header};
use http_body_util::BodyExt;
use prometheus::{IntCounter, IntGauge};
use rand::{SeedableRng, rngs::SmallRng};

use crate::{
    admission::hint,
    bedrock::{BedrockError, ErrorCode},
    metrics::Metrics,
};

/// Where the retry hint of a refusal starts: bodies in memory are forwarded (and released) within
/// about a round trip of the proxy, so room comes back quickly.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);
/// The longest hint a refusal carries (the default `admission.max_retry_hint_ms`).
const MAX_REFUSAL_HINT: Duration = Duration::from_secs(5);

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(
        "the request body is larger than {limit} bytes, the limit set by [server] max_body_bytes; send a smaller body"
    )]
    TooLarge { limit: usize },
    #[error(
        "tokengate is holding as many request bodies as it may ({limit} bytes, [server] max_buffered_body_bytes); retry shortly"
    )]
    OverBudget { limit: usize },
    #[error("the request body could not be read: {0}")]
    Read(String),
}

impl BodyError {
    /// The Bedrock-shaped answer: a `ValidationException`, or a retryable 503 with a hint.
    pub fn into_bedrock(self) -> BedrockError {
        match self {
            BodyError::OverBudget { .. } => {
                let mut rng = SmallRng::from_rng(&mut rand::rng());
                let wait = hint::jittered(REFUSAL_WAIT, MAX_REFUSAL_HINT, &mut rng);
                let (ms, secs) = hint::header_values(wait);
                BedrockError::new(ErrorCode::ServiceUnavailable, self.to_string())
                    .with_header(HeaderName::from_static("x-amz-retry-after"), ms)
                    .with_header(header::RETRY_AFTER, secs)
            }
            BodyError::TooLarge { .. } | BodyError::Read(_) => {
                BedrockError::validation(self.to_string())
            }
        }
    }
}

/// Request-body bytes held in memory, against `server.max_buffered_body_bytes`.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: AtomicUsize,
    gauge: IntGauge,
    refusals: IntCounter,
}

impl BodyBudget {
    pub fn new(limit: usize, metrics: &Metrics) -> Arc<BodyBudget> {
        Arc::new(BodyBudget {
            limit,
            held: AtomicUsize::new(0),
            gauge: metrics.buffered_body_bytes.clone(),
            refusals: metrics.body_budget_refusals.clone(),
        })
    }

    /// Bytes charged now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Takes `bytes` if they fit; counts a refusal if not.
    fn take(&self, bytes: usize) -> Result<(), BodyError> {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            });
        if taken.is_err() {
            self.refusals.inc();
            return Err(BodyError::OverBudget { limit: self.limit });
        }
        self.gauge.add(bytes as i64);
        Ok(())
    }

    fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.sub(bytes as i64);
    }

    /// Reads `body` whole, at most `max_body` bytes, charging the budget as it goes (see the
    /// module doc). The returned bytes carry the charge until their last clone is dropped.
    pub async fn read(
        self: &Arc<Self>,
        body: Body,
        headers: &HeaderMap,
        max_body: usize,
    ) -> Result<Bytes, BodyError> {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut charge = Charge {
            budget: self.clone(),
            bytes: 0,
        };
        let mut data = Vec::new();
        if let Some(declared) = declared {
            let declared = usize::try_from(declared)
                .ok()
                .filter(|n| *n <= max_body)
                .ok_or(BodyError::TooLarge { limit: max_body })?;
            charge.grow_to(declared)?;
            // Reserved, not touched: pages are committed as the bytes arrive.
            data.reserve_exact(declared);
        }
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| BodyError::Read(e.to_string()))?;
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            let total = data.len() + chunk.len();
            if total > max_body {
                return Err(BodyError::TooLarge { limit: max_body });
            }
            charge.grow_to(total)?;
            data.extend_from_slice(&chunk);
        }
        if data.is_empty() {
            return Ok(Bytes::new());
        }
        charge.shrink_to(data.len());
        Ok(Bytes::from_owner(Buffered {
            data,
            _charge: charge,
        }))
    }
}

/// Bytes of the budget held by one body; given back when dropped.
#[derive(Debug)]
struct Charge {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl Charge {
    fn grow_to(&mut self, bytes: usize) -> Result<(), BodyError> {
        if bytes > self.bytes {
            self.budget.take(bytes - self.bytes)?;
            self.bytes = bytes;
        }
        Ok(())
    }

    fn shrink_to(&mut self, bytes: usize) {
        if bytes < self.bytes {
            self.budget.give_back(self.bytes - bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

/// A body in memory and its charge: the owner behind the [`Bytes`] a read returns.
struct Buffered {
    data: Vec<u8>,
    _charge: Charge,
}

impl AsRef<[u8]> for Buffered {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    fn budget(limit: usize) -> (Arc<BodyBudget>, Metrics) {
        let (_, metrics) = Metrics::standalone();
        (BodyBudget::new(limit, &metrics), metrics)
    }

    fn length(n: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, n.into());
        headers
    }

    fn chunked(parts: &[&'static [u8]]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            parts.iter().map(|p| Ok(Bytes::from_static(p))).collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    #[tokio::test]
    async fn the_charge_lives_as_long_as_the_bytes() {
        let (budget, metrics) = budget(10);
        let body = budget
            .read(Body::from("hello"), &length(5), 100)
            .await
            .expect("fits");
        let copy = body.clone();
        assert_eq!((budget.held(), metrics.buffered_body_bytes.get()), (5, 5));
        drop(body);
        assert_eq!(budget.held(), 5, "a clone still holds the bytes");
        assert_eq!(&copy[..], b"hello");
        drop(copy);
        assert_eq!((budget.held(), metrics.buffered_body_bytes.get()), (0, 0));
    }

    #[tokio::test]
    async fn a_declared_length_that_cannot_fit_is_refused_before_reading() {
        let (budget, metrics) = budget(10);
        let held = budget
            .read(Body::from("123456"), &length(6), 100)
            .await
            .expect("fits");
        let refused = budget.read(Body::from("12345"), &length(5), 100).await;
        assert!(matches!(refused, Err(BodyError::OverBudget { limit: 10 })));
        let too_large = budget.read(Body::from("x"), &length(101), 100).await;
        assert!(matches!(too_large, Err(BodyError::TooLarge { limit: 100 })));
        assert_eq!(metrics.body_budget_refusals.get(), 1);
        assert_eq!(budget.held(), 6);
        drop(held);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn chunks_are_charged_as_they_arrive_and_given_back_on_refusal() {
        let (budget, _metrics) = budget(10);
        let first = budget
            .read(chunked(&[b"abc", b"def"]), &HeaderMap::new(), 100)
            .await
            .expect("fits");
        assert_eq!((&first[..], budget.held()), (&b"abcdef"[..], 6));
        let second = budget
            .read(chunked(&[b"ab", b"cd", b"ef"]), &HeaderMap::new(), 100)
            .await;
        assert!(matches!(second, Err(BodyError::OverBudget { .. })));
        assert_eq!(
            budget.held(),
            6,
            "the refused body's first chunks were given back"
        );
        let over = budget
            .read(chunked(&[b"ab", b"cd"]), &HeaderMap::new(), 3)
            .await;
        assert!(matches!(over, Err(BodyError::TooLarge { limit: 3 })));
        drop(first);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_dropped_read_gives_its_charge_back() {
        let (budget, _metrics) = budget(100);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let headers = length(50);
        let mut read = Box::pin(budget.read(Body::from_stream(stream), &headers, 100));
        tx.send(Ok(Bytes::from_static(b"part")))
            .await
            .expect("send");
        assert!(read.as_mut().now_or_never().is_none(), "waits for the rest");
        assert_eq!(budget.held(), 50, "the declared length is charged up front");
        drop(read);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn refusals_are_retryable_503s_with_a_hint() {
        let error = BodyError::OverBudget { limit: 10 }.into_bedrock();
        assert_eq!(error.code, ErrorCode::ServiceUnavailable);
        assert!(error.message.contains("max_buffered_body_bytes"));
        let hint = |name: &str| {
            error
                .headers
                .iter()
                .find(|(n, _)| n.as_str() == name)
                .and_then(|(_, v)| v.to_str().ok()?.parse::<u64>().ok())
        };
        let ms = hint("x-amz-retry-after").expect("x-amz-retry-after");
        assert!((1_000..=5_000).contains(&ms), "{ms}");
        assert!(hint("retry-after").is_some_and(|s| s >= 1));
    }
}
