//! The service hyper calls for each request of a connection: it marks the request in flight
//! until its response body is done (for the connection's timeouts and the cap), and enforces the
//! documented limits of a request head with a Bedrock-shaped answer.
//!
//! # Request heads
//! A head may carry at most [`MAX_HEADER_FIELDS`] header fields and [`MAX_HEADER_BYTES`] of
//! them, counted as HTTP/2 counts a header list (each field's name and value plus 32 bytes, and
//! the method and target), for both protocols. Past either, the answer is a 400
//! `ValidationException` that says the limit. hyper refuses heads past its own limits itself,
//! with a bare 431 it writes without asking the service; those limits are set above the
//! documented ones (twice the bytes, [`HYPER_MAX_HEAD_BYTES`]; four times the fields,
//! [`HYPER_MAX_HEADER_FIELDS`]), so a head a little over gets the shaped answer and only a far
//! larger one gets hyper's.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::response::IntoResponse;
use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use hyper::body::Incoming;
use tower::ServiceExt;

use super::{BoxError, HttpService, ResponseBody, connection::Activity};
use crate::bedrock::BedrockError;

/// The most header fields a request may carry.
pub const MAX_HEADER_FIELDS: usize = 100;
/// The most header bytes a request may carry, counted as HTTP/2 counts a header list.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// hyper's own limit on a head: HTTP/1.1 read buffer, HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`.
pub const HYPER_MAX_HEAD_BYTES: usize = 2 * MAX_HEADER_BYTES;
/// hyper's own limit on HTTP/1.1 header fields (HTTP/2 has none but the size). hyper sets out
/// two arrays of this many slots for every head it parses, so it costs on every request: at
/// 20 x 100 it was 6% of a proxied call's instructions (loadtest/RESULTS.md).
pub const HYPER_MAX_HEADER_FIELDS: usize = 4 * MAX_HEADER_FIELDS;
/// What RFC 9113 adds to each field's name and value when it sizes a header list.
const FIELD_OVERHEAD: usize = 32;

/// Wraps the listener's service for one connection.
#[derive(Debug, Clone)]
pub struct ConnService<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> ConnService<S> {
    pub fn new(inner: S, activity: Arc<Activity>) -> ConnService<S> {
        ConnService { inner, activity }
    }
}

impl<S, B> hyper::service::Service<Request<Incoming>> for ConnService<S>
where
    S: tower::Service<Request<Incoming>, Response = Response<B>> + HttpService<B>,
    B: ResponseBody,
{
    type Response = Response<TrackedBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let in_flight = InFlight::start(self.activity.clone(), request.version());
        if let Some(refusal) = head_refusal(&request) {
            let response = refusal
                .into_response()
                .map(|body| TrackedBody::new(Either::Right(body), in_flight));
            return Box::pin(std::future::ready(Ok(response)));
        }
        let service = self.inner.clone();
        Box::pin(async move {
            let response = service.oneshot(request).await.map_err(Into::into)?;
            Ok(response.map(|body| TrackedBody::new(Either::Left(body), in_flight)))
        })
    }
}

/// The documented head limit a request breaks, as the answer to give it.
fn head_refusal<T>(request: &Request<T>) -> Option<BedrockError> {
    let fields = request.headers().len();
    if fields > MAX_HEADER_FIELDS {
        return Some(BedrockError::validation(format!(
            "the request carries {fields} header fields; tokengate accepts at most {MAX_HEADER_FIELDS}: send fewer headers"
        )));
    }
    let size = header_list_size(request);
    (size > MAX_HEADER_BYTES).then(|| {
        BedrockError::validation(format!(
            "the request headers take {size} bytes (each field's name and value plus 32, as HTTP/2 counts them); \
             tokengate accepts at most {MAX_HEADER_BYTES}: send fewer or smaller headers"
        ))
    })
}

/// A request head's size as RFC 9113 sizes a header list, the method and target included.
fn header_list_size<T>(request: &Request<T>) -> usize {
    let uri = request.uri();
    let target = uri.scheme_str().map_or(0, str::len)
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len());
    let fields: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + FIELD_OVERHEAD)
        .sum();
    request.method().as_str().len() + target + fields
}

/// A request in flight on its connection, from its head until its response body is done.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: Arc<Activity>, version: http::Version) -> InFlight {
        activity.request_started(version);
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request in flight until it is done or dropped.
    pub struct TrackedBody<B> {
        #[pin]
        inner: Either<B, axum::body::Body>,
        in_flight: InFlight,
    }
}

impl<B> TrackedBody<B> {
    fn new(inner: Either<B, axum::body::Body>, in_flight: InFlight) -> TrackedBody<B> {
        TrackedBody { inner, in_flight }
    }
}

impl<B: ResponseBody> Body for TrackedBody<B> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(String, String)]) -> Request<()> {
        let mut builder = Request::post("/model/m/converse");
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        builder.body(()).expect("request")
    }

    #[test]
    fn heads_are_sized_as_http2_sizes_a_header_list() {
        let r = request(&[("x-a".into(), "12345".into())]);
        assert_eq!(
            header_list_size(&r),
            "POST".len() + "/model/m/converse".len() + 3 + 5 + 32
        );
    }

    #[test]
    fn heads_past_the_documented_limits_are_refused_with_the_limit() {
        let at_limit = vec![("x-big".to_string(), "a".repeat(60_000))];
        assert!(head_refusal(&request(&at_limit)).is_none());
        let over = vec![("x-big".to_string(), "a".repeat(MAX_HEADER_BYTES))];
        let refusal = head_refusal(&request(&over)).expect("too large");
        assert_eq!(refusal.code, crate::bedrock::ErrorCode::Validation);
        assert!(refusal.message.contains("65536"), "{}", refusal.message);
        let many: Vec<_> = (0..=MAX_HEADER_FIELDS)
            .map(|i| (format!("x-h{i}"), "v".to_string()))
            .collect();
        let refusal = head_refusal(&request(&many)).expect("too many");
        assert!(
            refusal.message.contains("101 header fields"),
            "{}",
            refusal.message
        );
    }
}
