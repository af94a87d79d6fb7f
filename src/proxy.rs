//! The life of a proxied request: parse the target, identify the caller from the head, read the
//! body (bounded), finish identification, admit, forward, and hand the response back metered.
//! See DESIGN.md, "The life of a request".
//!
//! Nothing about the caller is trusted before it is checked: the path is refused when it could
//! name another resource upstream ([`Target::parse`]); the caller is identified before any body
//! byte is read ([`crate::auth::Authenticator::identify`]); only the headers the API defines, and
//! a SigV4 caller signed, go upstream ([`BEDROCK_RUNTIME`]); and a call counts as a retry only if
//! this proxy turned the same invocation away ([`crate::admission::retries`]).

use std::{sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::{Request, State},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::{HeaderValue, header, request::Parts};

use crate::{
    access_log::{AccessRecord, Decision},
    admission::{
        Admission, Admitted, Caller, Verdict, X_TOKENGATE_POOL, retries::invocation_id,
        routes::sdk_attempt,
    },
    app::{AppState, Policy},
    auth::Identity,
    bedrock::{
        BedrockError, ErrorCode, Target, TargetError, UsageObserver, eventstream,
        usage::ResponseKind,
    },
    metrics::NO_POOL,
    upstream::{
        MeteredBody, UpstreamError,
        headers::{BEDROCK_RUNTIME, strip_hop_by_hop},
    },
};

/// Handles every `bedrock-runtime` call, and writes its access-log line unless the admission guard
/// took the record (an admitted request's line is written at its settlement).
pub async fn handle(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let mut exchange = Exchange {
        record: Some(AccessRecord::start()),
        route: None,
    };
    let invocation = invocation_id(request.headers()).map(str::to_owned);
    let response = forward(&state, request, &mut exchange).await;
    if let Some(record) = exchange.record {
        record.finish_unadmitted(response.status(), response.headers());
    }
    // A rejection the SDK will retry: remember it, so that the retry may use the reserve.
    let status = response.status();
    if let (Some(route), Some(id), true) = (
        &exchange.route,
        invocation.as_deref(),
        status == http::StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
    ) {
        state
            .rejections
            .record(route, id, std::time::Instant::now());
    }
    response
}

/// What [`handle`] learns about a request while [`forward`] decides it.
struct Exchange {
    /// The access-log record, until an admitted request's guard takes it.
    record: Option<AccessRecord>,
    /// The caller's route, once identified.
    route: Option<Arc<str>>,
}

async fn forward(state: &AppState, request: Request, exchange: &mut Exchange) -> Response {
    let (parts, body) = request.into_parts();
    let target = match Target::parse(&parts.method, parts.uri.path()) {
        Ok(t) => t,
        Err(e) => return target_error(e).into_response(),
    };
    if let Some(r) = exchange.record.as_mut() {
        r.target(target.operation.name(), target.model_id.as_deref());
    }
    if !target.operation.forwarded() {
        return BedrockError::validation(
            "tokengate does not forward InvokeModelWithBidirectionalStream yet; call bedrock-runtime directly for bidirectional streams",
        )
        .into_response();
    }
    // One policy generation for the whole request, whatever a reload does meanwhile.
    let policy = state.policy();
    // Who is calling, from the head alone: an unknown caller never gets a body buffered.
    let identity = match policy.auth.identify(&parts) {
        Ok(identity) => identity,
        Err(e) => return e.into_response(),
    };
    let body = match read_body(state, body).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = policy.auth.verify_body(&identity, &parts, &body) {
        return e.into_response();
    }
    let caller = match caller(state, &policy, &identity, &parts) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    exchange.route = Some(caller.route.name.clone());
    if let Some(r) = exchange.record.as_mut() {
        r.route(&caller.route.name);
    }
    let verdict = match policy
        .admission
        .admit(target.operation, target.model_id.as_deref(), &body, &caller)
        .await
    {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let mut body = body;
    let admitted = match verdict {
        Verdict::Admitted(a) => {
            let mut a = *a;
            if let Some(rewritten) = a.take_rewritten_body() {
                body = rewritten;
            }
            if let Some(r) = exchange.record.take() {
                a.attach_access(r);
            }
            Some(a)
        }
        Verdict::Uncounted => {
            if let Some(r) = exchange.record.as_mut() {
                r.decide(Decision::Passthrough);
            }
            None
        }
    };
    let headers = BEDROCK_RUNTIME.forwarded(&parts.headers, identity.signed_headers());
    let upstream = Outgoing {
        parts: &parts,
        headers: &headers,
        body,
        target: &target,
    };
    send(state, &policy, upstream, admitted).await
}

/// The request body, whole, within `server.max_body_bytes` and `server.body_read_timeout_secs`.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, BedrockError> {
    // A client that sends a head and then trickles (or stalls) its body holds a connection but
    // never a reservation; it gets an answer when the body is overdue.
    let read = tokio::time::timeout(
        state.body_read_timeout,
        axum::body::to_bytes(body, state.max_body_bytes),
    );
    match read.await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(body_error(&e, state.max_body_bytes)),
        Err(_) => Err(BedrockError::validation(format!(
            "the request body did not arrive within {} s, the limit set by [server] body_read_timeout_secs; send the whole body at once",
            state.body_read_timeout.as_secs()
        ))),
    }
}

/// The identified caller's route, and whether this call is a retry of one turned away.
fn caller(
    state: &AppState,
    policy: &Policy,
    identity: &Identity,
    parts: &Parts,
) -> Result<Caller, BedrockError> {
    let route = policy
        .admission
        .routes()
        .get(&identity.route)
        .cloned()
        .ok_or_else(|| {
            BedrockError::new(
                ErrorCode::AccessDenied,
                "tokengate has no route for this caller",
            )
        })?;
    let retry = sdk_attempt(&parts.headers) > 1
        && invocation_id(&parts.headers).is_some_and(|id| {
            state
                .rejections
                .take(&route.name, id, std::time::Instant::now())
        });
    Ok(Caller { route, retry })
}

/// What goes upstream.
struct Outgoing<'a> {
    parts: &'a Parts,
    /// The headers to forward, chosen already.
    headers: &'a http::HeaderMap,
    body: Bytes,
    target: &'a Target,
}

/// Forwards the request and returns upstream's answer, metered (or the 503 for no answer).
async fn send(
    state: &AppState,
    policy: &Policy,
    outgoing: Outgoing<'_>,
    mut admitted: Option<Admitted>,
) -> Response {
    let pool: Arc<str> = admitted
        .as_ref()
        .map_or_else(|| Arc::from(NO_POOL), |a| a.pool().name.clone());
    let Outgoing {
        parts,
        headers,
        body,
        target,
    } = outgoing;
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let response = match state
        .upstream
        .send(parts.method.clone(), path_and_query, headers, body)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            return unreachable_upstream(state, &policy.admission, admitted.as_mut(), &pool, &e);
        }
    };
    let status = response.status();
    if let Some(a) = admitted.as_mut() {
        a.answered(status, response.headers());
    }
    state
        .metrics
        .upstream_responses
        .with_label_values(&[&pool, status.as_str()])
        .inc();
    let (mut head, incoming) = response.into_parts();
    strip_hop_by_hop(&mut head.headers);
    let event_stream = head.headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        v.as_bytes()
            .starts_with(eventstream::CONTENT_TYPE.as_bytes())
    });
    if event_stream {
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let metered = match admitted {
        Some(mut a) if !status.is_success() => {
            upstream_refused(&policy.admission, &mut a, &mut head.headers, status);
            None
        }
        Some(mut a) => ResponseKind::for_operation(target.operation).map(|kind| {
            let mut observer = UsageObserver::new(kind);
            if let Some(usage) = observer.on_headers(&head.headers) {
                a.settle_usage(&usage);
            }
            (observer, a)
        }),
        None => None,
    };
    let body = MeteredBody::new(
        incoming,
        metered,
        state.metrics.clone(),
        pool,
        &state.upstream,
        event_stream,
    );
    Response::from_parts(head, Body::new(body))
}

/// Upstream answered with an error status: nothing is charged; a throttle shrinks the pool.
fn upstream_refused(
    admission: &Admission,
    admitted: &mut Admitted,
    headers: &mut http::HeaderMap,
    status: http::StatusCode,
) {
    let throttled = status == http::StatusCode::TOO_MANY_REQUESTS
        && headers
            .get(crate::bedrock::error::X_AMZN_ERROR_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(ErrorCode::from_name)
            .is_some_and(|c| c == ErrorCode::Throttling);
    if throttled {
        let pool = admitted.pool().clone();
        admission.upstream_throttled(&pool);
        if !headers.contains_key("x-amz-retry-after") {
            let wait = crate::admission::settle::upstream_throttle_wait(&pool);
            let hinted = admission.retryable(ErrorCode::Throttling, &pool, wait, String::new());
            for (name, value) in hinted.headers {
                headers.insert(name, value);
            }
        }
        if let Ok(v) = HeaderValue::from_str("upstream") {
            headers.insert(crate::admission::X_TOKENGATE_REASON, v);
        }
    }
    admitted.settle_not_charged();
}

/// No response from upstream: a retryable 503, settled by the rule for the failure.
fn unreachable_upstream(
    state: &AppState,
    admission: &Admission,
    admitted: Option<&mut Admitted>,
    pool: &str,
    error: &UpstreamError,
) -> Response {
    state
        .metrics
        .upstream_errors
        .with_label_values(&[pool, error.kind()])
        .inc();
    tracing::warn!(pool, error = %error, "upstream request failed");
    let message = format!("tokengate could not get an answer from bedrock-runtime: {error}");
    let Some(admitted) = admitted else {
        return BedrockError::new(ErrorCode::ServiceUnavailable, message).into_response();
    };
    let pool = admitted.pool().clone();
    let response = admission
        .retryable(
            ErrorCode::ServiceUnavailable,
            &pool,
            Duration::from_secs(1),
            message,
        )
        .with_header(http::HeaderName::from_static(X_TOKENGATE_POOL), &*pool.name)
        .into_response();
    admitted.answered(response.status(), response.headers());
    match error {
        // No answer yet, but the request may be running upstream: charge the reservation.
        UpstreamError::Timeout(_) | UpstreamError::ShuttingDown => admitted.settle_timeout(),
        _ => admitted.settle_not_charged(),
    }
    response
}

fn target_error(e: TargetError) -> BedrockError {
    match e {
        TargetError::UnknownOperation { .. } => BedrockError::new(
            ErrorCode::UnknownOperation,
            format!(
                "{e}; tokengate serves the bedrock-runtime API (e.g. POST /model/{{modelId}}/converse)"
            ),
        ),
        TargetError::EmptyModelId | TargetError::BadModelIdEncoding => {
            BedrockError::validation(format!(
                "{e}; send the modelId percent-encoded once, as the AWS SDKs do (':' as %3A, '/' as %2F)"
            ))
        }
        TargetError::UnsafePath { .. } => BedrockError::validation(e.to_string()),
    }
}

fn body_error(e: &axum::Error, limit: usize) -> BedrockError {
    let too_large = std::error::Error::source(e)
        .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        || e.to_string().contains("length limit");
    if too_large {
        BedrockError::validation(format!(
            "the request body is larger than {limit} bytes, the limit set by [server] max_body_bytes; send a smaller body"
        ))
    } else {
        BedrockError::validation(format!("the request body could not be read: {e}"))
    }
}
