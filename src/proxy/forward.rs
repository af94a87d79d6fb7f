//! Step 4: forward an admitted (or passed) request upstream, and turn upstream's answer into the
//! client's: the response head passed on (hop-by-hop headers removed, those its `Connection`
//! names too), an upstream throttle
//! passed on with a hint and fed back to the pool, no answer turned into a retryable 503 (in the
//! error shape of the request's API); the reservation settled by the rule that applies
//! ([`crate::admission::hold`]). A streamed Chat Completions call whose usage the proxy asked
//! for on the client's behalf has the usage chunk taken out of its stream
//! ([`UsageChunkFilter`]). A success of a call whose route retries what its learned cap
//! truncated goes to [`adaptive_retry::after_capped`] instead of straight to the client.

use std::sync::Arc;

use crate::upstream::PooledBody;
use axum::{body::Body, response::Response};
use http::{HeaderValue, StatusCode, header, request::Parts};

use super::{
    adaptive_retry,
    meter::{ExceptionFrame, InFlight, Meter, MeteredBody},
    usage_reader::UsageReader,
};
use crate::{
    admission::{Admitted, hint},
    answer,
    bedrock::{
        ErrorCode, Operation, eventstream,
        operation::{model_path, raw_path_and_query},
        sse::UsageChunkFilter,
        usage::ResponseKind,
    },
    observe::Observation,
    sagemaker,
    state::{AppState, Policy},
    upstream::{Upstream, UpstreamError, headers::strip_hop_by_hop},
};

/// The request to send upstream.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub parts: &'a Parts,
    /// The headers to send, chosen already ([`crate::upstream::headers::Api::forwarded`]).
    pub headers: http::HeaderMap,
    pub operation: Operation,
    /// The Region it goes to ([`crate::admission::Admission::region_of`]).
    pub region: String,
    /// The caller's body (replaced by admission's rewrite, if it made one).
    pub body: bytes::Bytes,
    /// Where it goes: bedrock-runtime, or the endpoint's sagemaker-runtime.
    pub upstream: &'a Upstream,
    /// What a second call needs, when the caller's route retries calls its learned cap
    /// truncated ([`adaptive_retry`]).
    pub retry: Option<adaptive_retry::Retry<'a>>,
}

/// InvokeModel's service tier (Converse names it in the body).
pub(super) const SERVICE_TIER: header::HeaderName =
    header::HeaderName::from_static("x-amzn-bedrock-service-tier");

/// Forwards `request`; an `admitted` request takes `obs` along, to be written at settlement.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps each argument twice while the call waits (rust-lang/rust#62958)"
)]
pub fn forward(
    state: &AppState,
    policy: &Arc<Policy>,
    request: Outgoing<'_>,
    admitted: Option<Admitted>,
    obs: &mut Option<Observation>,
) -> impl Future<Output = Response> {
    async move {
        let parts = request.parts;
        let mut body = request.body;
        let mut spilled_path = None;
        let mut strip_usage_chunk = false;
        let mut headers = request.headers;
        let in_flight = admitted.map(|mut admitted| {
            let sent = (request.operation, parts);
            spilled_path = admitted_changes(&mut admitted, sent, &mut body, &mut headers);
            strip_usage_chunk = admitted.strip_usage_chunk;
            InFlight::new(admitted.hold, obs.take(), policy.observer.clone())
        });
        // Only a call the learned cap was written into can stop at it.
        let retry = request.retry.filter(|_| {
            in_flight
                .as_ref()
                .and_then(|f| f.hold().adaptive_cap())
                .is_some()
        });
        let operation = request.operation;
        let path_and_query = spilled_path
            .as_deref()
            .unwrap_or_else(|| raw_path_and_query(&parts.uri));
        let sent = request
            .upstream
            .send(
                operation,
                &request.region,
                parts.method.clone(),
                path_and_query,
                &headers,
                body,
            )
            .await;
        match (sent, in_flight) {
            (Ok(response), Some(in_flight))
                if response.status() == StatusCode::TOO_MANY_REQUESTS =>
            {
                throttled(state, policy, in_flight, response, operation).await
            }
            (Ok(response), Some(in_flight))
                if retry.is_some() && response.status().is_success() =>
            {
                let first = adaptive_retry::First {
                    parts: request.parts,
                    operation,
                    upstream: request.upstream,
                };
                // Rare, and the largest state: boxed, so that every other call's is smaller.
                Box::pin(adaptive_retry::after_capped(
                    state, policy, first, in_flight, response, retry,
                ))
                .await
            }
            (Ok(response), in_flight) => respond(
                state,
                policy,
                operation,
                in_flight,
                response,
                strip_usage_chunk,
            ),
            (Err(e), in_flight) => unreachable(policy, in_flight, &e, operation),
        }
    }
}

/// What an admitted call changes in the request it sends: admission's rewritten `body`, the
/// route's forced tier in `headers`; the path it goes to when it spilled.
fn admitted_changes(
    admitted: &mut Admitted,
    (operation, parts): (Operation, &Parts),
    body: &mut bytes::Bytes,
    headers: &mut http::HeaderMap,
) -> Option<String> {
    if let Some(rewritten) = admitted.body.take() {
        *body = rewritten;
    }
    if let Some(tier) = admitted.service_tier_header {
        // The route's forced tier, in place of the caller's.
        headers.insert(SERVICE_TIER, HeaderValue::from_static(tier.label()));
    }
    admitted.spilled_from.as_ref()?;
    // Sent as the pool's own model; the path signed is this path.
    let model = admitted.hold.pool().config.model_id();
    model_path(operation, model, parts.uri.query())
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
    response: http::Response<PooledBody>,
    operation: Operation,
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
    if daily && is_throttle(status, &head.headers, operation) {
        let reserved = in_flight.hold().reserved();
        let hint = policy.admission.upstream_daily_throttled(&pool, reserved);
        policy.observer.upstream_daily_throttled(&pool, hint);
        answer::upstream_daily_throttled(&mut head.headers, hint);
        in_flight.answered(status, &head.headers);
        in_flight.settle_not_charged();
    } else {
        refused(policy, &mut in_flight, &mut head.headers, status, operation);
    }
    Response::from_parts(head, Body::from(body))
}

/// A 429 `ThrottlingException`, by its error-type header. The OpenAI and Anthropic paths' 429s
/// may not name their type (U): a 429 there is a throttle.
fn is_throttle(status: StatusCode, headers: &http::HeaderMap, operation: Operation) -> bool {
    let error_type = headers
        .get(crate::bedrock::error::X_AMZN_ERROR_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(ErrorCode::from_name);
    status == StatusCode::TOO_MANY_REQUESTS
        && match error_type {
            Some(code) => code == Some(ErrorCode::Throttling),
            None => operation.model_in_body(),
        }
}

/// Upstream's answer, on its way to the client: an error status settled and passed on, a
/// success passed through a body that meters it (and takes out the usage chunk asked for on the
/// client's behalf, when `strip_usage_chunk`).
pub fn respond(
    state: &AppState,
    policy: &Arc<Policy>,
    operation: Operation,
    in_flight: Option<InFlight>,
    response: http::Response<PooledBody>,
    strip_usage_chunk: bool,
) -> Response {
    let status = response.status();
    let (head, incoming) = response.into_parts();
    let Head {
        mut head,
        meter,
        pool,
        kind,
        event_stream,
    } = answer_head(policy, operation, in_flight, head);
    // The usage chunk asked for on the client's behalf comes out of a successful stream.
    let filter =
        (strip_usage_chunk && status.is_success() && kind == Some(ResponseKind::ChatStream))
            .then(UsageChunkFilter::new);
    if event_stream || filter.is_some() {
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let exception: ExceptionFrame = if operation.is_endpoint() {
        sagemaker::error::stream_exception_frame
    } else {
        eventstream::exception_frame
    };
    // Every upstream client shares the idle timeout and the drain deadline: bedrock-runtime's
    // stands for them all.
    let body = MeteredBody::new(
        incoming,
        meter,
        policy.observer.clone(),
        pool,
        &state.upstream,
        event_stream.then_some(exception),
    )
    .with_filter(filter);
    Response::from_parts(head, Body::new(body))
}

/// Upstream's response head as the client gets it, and the meter for its body.
pub(super) struct Head {
    pub head: http::response::Parts,
    /// `None` for a response that settles nothing (or settled already: an error status).
    pub meter: Option<Meter>,
    pub pool: Option<Arc<crate::admission::Pool>>,
    pub kind: Option<ResponseKind>,
    /// An event stream (`application/vnd.amazon.eventstream`).
    pub event_stream: bool,
}

/// Upstream's response head, observed and passed on (hop-by-hop headers out, the pool it ran
/// in named), with the meter of an admitted request's body ([`meter`]).
pub(super) fn answer_head(
    policy: &Policy,
    operation: Operation,
    mut in_flight: Option<InFlight>,
    mut head: http::response::Parts,
) -> Head {
    let pool = in_flight.as_ref().map(|f| f.hold().pool().clone());
    let status = head.status;
    policy.observer.upstream_response(pool.as_deref(), status);
    strip_hop_by_hop(&mut head.headers);
    if let Some(name) = pool
        .as_ref()
        .and_then(|p| HeaderValue::from_str(&p.name).ok())
    {
        // Where it ran: its own pool, or the one it spilled to.
        head.headers.insert(answer::X_TOKENGATE_POOL, name);
    }
    let event_stream = head.headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        v.as_bytes()
            .starts_with(eventstream::CONTENT_TYPE.as_bytes())
    });
    let kind = ResponseKind::for_response(operation, &head.headers);
    let meter = in_flight.take().and_then(|f| {
        let response = Answered {
            status,
            headers: &mut head.headers,
            operation,
            kind,
        };
        meter(policy, f, response)
    });
    Head {
        head,
        meter,
        pool,
        kind,
        event_stream,
    }
}

/// Upstream's answer to an admitted request, as the meter needs it.
struct Answered<'a> {
    status: StatusCode,
    headers: &'a mut http::HeaderMap,
    operation: Operation,
    kind: Option<ResponseKind>,
}

/// The meter of an admitted request's response: none for an error status (settled as refused
/// here) or a response that carries no usage; usage in the headers settles at once.
fn meter(policy: &Policy, mut in_flight: InFlight, response: Answered<'_>) -> Option<Meter> {
    let Answered {
        status,
        headers,
        operation,
        kind,
    } = response;
    if !status.is_success() {
        refused(policy, &mut in_flight, headers, status, operation);
        return None;
    }
    in_flight.answered(status, headers);
    let mut usage = UsageReader::for_response(operation, kind)?;
    if let Some(u) = usage.on_headers(headers) {
        in_flight.settle_usage(&u);
    }
    Some(Meter::new(usage, in_flight))
}

/// Upstream answered an admitted request with an error status: nothing is charged; a throttle
/// shrinks the pool and is passed on with a hint.
fn refused(
    policy: &Policy,
    in_flight: &mut InFlight,
    headers: &mut http::HeaderMap,
    status: StatusCode,
    operation: Operation,
) {
    if is_throttle(status, headers, operation) {
        let pool = in_flight.hold().pool().clone();
        let hint = policy.admission.upstream_throttled(&pool);
        in_flight.upstream_throttled(Some(hint));
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
    operation: Operation,
) -> Response {
    let pool = in_flight.as_ref().map(|f| f.hold().pool().clone());
    policy
        .observer
        .upstream_error(pool.as_deref(), error.kind(), error);
    let service = if operation.is_endpoint() {
        "sagemaker-runtime"
    } else {
        "bedrock-runtime"
    };
    let dialect = operation.api().dialect();
    let Some(mut in_flight) = in_flight else {
        return answer::upstream_unreachable(service, error, None, hint::UNAVAILABLE_WAIT, dialect);
    };
    let hint = policy.admission.hint(hint::UNAVAILABLE_WAIT);
    let pool_name = pool.as_deref().map(|p| &*p.name);
    let response = answer::upstream_unreachable(service, error, pool_name, hint, dialect);
    in_flight.answered(response.status(), response.headers());
    match error {
        // No answer yet, but the request may be running upstream: charge the reservation.
        UpstreamError::Timeout(_) | UpstreamError::ShuttingDown => in_flight.settle_timeout(),
        _ => in_flight.settle_not_charged(),
    }
    response
}
