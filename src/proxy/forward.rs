//! Step 4: forward an admitted (or passed) request upstream, and turn upstream's answer into the
//! client's: the response head passed on (hop-by-hop headers removed, those its `Connection`
//! names too), an upstream throttle
//! passed on with a hint and fed back to the pool, no answer turned into a retryable 503; the
//! reservation settled by the rule that applies ([`crate::admission::hold`]).

use std::sync::Arc;

use axum::{body::Body, response::Response};
use http::{StatusCode, header, request::Parts};
use hyper::body::Incoming;

use super::meter::{InFlight, Meter, MeteredBody};
use crate::{
    admission::{Admitted, hint},
    answer,
    bedrock::{
        ErrorCode, Operation, UsageObserver, eventstream, operation::raw_path_and_query,
        usage::ResponseKind,
    },
    observe::Observation,
    state::{AppState, Policy},
    upstream::{UpstreamError, headers::strip_hop_by_hop},
};

/// The request to send upstream.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub parts: &'a Parts,
    /// The headers to send, chosen already ([`crate::upstream::headers::Api::forwarded`]).
    pub headers: http::HeaderMap,
    pub operation: Operation,
    /// The caller's body (replaced by admission's rewrite, if it made one).
    pub body: bytes::Bytes,
}

/// Forwards `request`; an `admitted` request takes `obs` along, to be written at settlement.
pub async fn forward(
    state: &AppState,
    policy: &Arc<Policy>,
    request: Outgoing<'_>,
    admitted: Option<Admitted>,
    obs: &mut Option<Observation>,
) -> Response {
    let mut body = request.body;
    let in_flight = admitted.map(|admitted| {
        if let Some(rewritten) = admitted.body {
            body = rewritten;
        }
        InFlight::new(admitted.hold, obs.take(), policy.observer.clone())
    });
    let parts = request.parts;
    let path_and_query = raw_path_and_query(&parts.uri);
    let sent = state
        .upstream
        .send(parts.method.clone(), path_and_query, &request.headers, body)
        .await;
    match sent {
        Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => match in_flight {
            Some(in_flight) => throttled(state, policy, in_flight, response).await,
            None => respond(state, policy, request.operation, None, response),
        },
        Ok(response) => respond(state, policy, request.operation, in_flight, response),
        Err(e) => unreachable(policy, in_flight, &e),
    }
}

/// The most of a 429's body read to tell a daily quota from a per-minute one (Bedrock's are
/// a short JSON message).
const THROTTLE_BODY_LIMIT: usize = 16 * 1024;

/// Upstream answered an admitted request 429: its body (a short JSON error) is read whole, to
/// tell Bedrock's daily quota (`Too many tokens per day`) from the per-minute limits, and passed
/// on as read. A body that cannot be read in time counts as a per-minute throttle and is passed
/// on empty.
async fn throttled(
    state: &AppState,
    policy: &Arc<Policy>,
    mut in_flight: InFlight,
    response: http::Response<Incoming>,
) -> Response {
    use http_body_util::{BodyExt, Limited};
    let pool = in_flight.hold().pool().clone();
    let status = response.status();
    policy.observer.upstream_response(Some(&pool), status);
    let (mut head, incoming) = response.into_parts();
    strip_hop_by_hop(&mut head.headers);
    let read = Limited::new(incoming, THROTTLE_BODY_LIMIT).collect();
    let body = match tokio::time::timeout(state.upstream.idle_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        _ => bytes::Bytes::new(),
    };
    head.headers.remove(header::CONTENT_LENGTH);
    let daily = crate::bedrock::error::is_daily_quota(&body);
    if daily && is_throttling(&head.headers) {
        let reserved = in_flight.hold().reserved();
        let hint = policy.admission.upstream_daily_throttled(&pool, reserved);
        policy.observer.upstream_daily_throttled(&pool, hint);
        answer::upstream_daily_throttled(&mut head.headers, hint);
        in_flight.answered(status, &head.headers);
        in_flight.settle_not_charged();
    } else {
        refused(policy, &mut in_flight, &mut head.headers, status);
    }
    Response::from_parts(head, Body::from(body))
}

/// A `ThrottlingException`, by its error-type header.
fn is_throttling(headers: &http::HeaderMap) -> bool {
    headers
        .get(crate::bedrock::error::X_AMZN_ERROR_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(ErrorCode::from_name)
        .is_some_and(|c| c == ErrorCode::Throttling)
}

/// Upstream's answer, on its way to the client: an error status settled and passed on, a
/// success passed through a body that meters it.
pub fn respond(
    state: &AppState,
    policy: &Arc<Policy>,
    operation: Operation,
    mut in_flight: Option<InFlight>,
    response: http::Response<Incoming>,
) -> Response {
    let pool = in_flight.as_ref().map(|f| f.hold().pool().clone());
    let status = response.status();
    policy.observer.upstream_response(pool.as_deref(), status);
    let (mut head, incoming) = response.into_parts();
    strip_hop_by_hop(&mut head.headers);
    let event_stream = head.headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        v.as_bytes()
            .starts_with(eventstream::CONTENT_TYPE.as_bytes())
    });
    if event_stream {
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let meter = match in_flight.take() {
        Some(mut f) if !status.is_success() => {
            refused(policy, &mut f, &mut head.headers, status);
            None
        }
        Some(mut f) => {
            f.answered(status, &head.headers);
            ResponseKind::for_operation(operation).map(|kind| {
                let mut usage = UsageObserver::new(kind);
                if let Some(u) = usage.on_headers(&head.headers) {
                    f.settle_usage(&u);
                }
                Meter::new(usage, f)
            })
        }
        None => None,
    };
    let body = MeteredBody::new(
        incoming,
        meter,
        policy.observer.clone(),
        pool,
        &state.upstream,
        event_stream,
    );
    Response::from_parts(head, Body::new(body))
}

/// Upstream answered an admitted request with an error status: nothing is charged; a throttle
/// shrinks the pool and is passed on with a hint.
fn refused(
    policy: &Policy,
    in_flight: &mut InFlight,
    headers: &mut http::HeaderMap,
    status: StatusCode,
) {
    if status == StatusCode::TOO_MANY_REQUESTS && is_throttling(headers) {
        let pool = in_flight.hold().pool().clone();
        let hint = policy.admission.upstream_throttled(&pool);
        policy.observer.upstream_throttled(&pool, Some(hint));
        answer::upstream_throttled(headers, hint);
    }
    in_flight.answered(status, headers);
    in_flight.settle_not_charged();
}

/// No response from upstream: a retryable 503, settled by the rule for the failure.
pub fn unreachable(
    policy: &Policy,
    in_flight: Option<InFlight>,
    error: &UpstreamError,
) -> Response {
    let pool = in_flight.as_ref().map(|f| f.hold().pool().clone());
    policy
        .observer
        .upstream_error(pool.as_deref(), error.kind(), error);
    let Some(mut in_flight) = in_flight else {
        return answer::upstream_unreachable(error, None, hint::UNAVAILABLE_WAIT);
    };
    let hint = policy.admission.hint(hint::UNAVAILABLE_WAIT);
    let response = answer::upstream_unreachable(error, pool.as_deref().map(|p| &*p.name), hint);
    in_flight.answered(response.status(), response.headers());
    match error {
        // No answer yet, but the request may be running upstream: charge the reservation.
        UpstreamError::Timeout(_) | UpstreamError::ShuttingDown => in_flight.settle_timeout(),
        _ => in_flight.settle_not_charged(),
    }
    response
}
