//! The life of a proxied request: parse the target, read the body (bounded), admit, forward,
//! and hand the response back metered. See DESIGN.md, "The life of a request".

use std::{sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::{Request, State},
    response::{IntoResponse, Response},
};
use http::{HeaderValue, header};

use crate::{
    access_log::{AccessRecord, Decision},
    admission::{Admission, Admitted, Caller, Verdict, X_TOKENGATE_POOL, routes::sdk_attempt},
    app::AppState,
    bedrock::{
        BedrockError, ErrorCode, Target, TargetError, UsageObserver, eventstream,
        usage::ResponseKind,
    },
    metrics::NO_POOL,
    upstream::{MeteredBody, UpstreamError, is_hop_by_hop},
};

/// Handles every `bedrock-runtime` call, and writes its access-log line unless the admission guard
/// took the record (an admitted request's line is written at its settlement).
pub async fn handle(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let mut record = Some(AccessRecord::start());
    let response = forward(&state, request, &mut record).await;
    if let Some(record) = record {
        record.finish_unadmitted(response.status(), response.headers());
    }
    response
}

async fn forward(
    state: &AppState,
    request: Request,
    record: &mut Option<AccessRecord>,
) -> Response {
    let (parts, body) = request.into_parts();
    let target = match Target::parse(&parts.method, parts.uri.path()) {
        Ok(t) => t,
        Err(e) => return target_error(e).into_response(),
    };
    if let Some(r) = record.as_mut() {
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
    let head_identity = policy.auth.identify_head(&parts);
    if let Some(Err(e)) = head_identity {
        return e.into_response();
    }
    // A client that sends a head and then trickles (or stalls) its body holds a connection but
    // never a reservation; it gets an answer when the body is overdue.
    // The bytes carry their charge of the body budget until the last clone is dropped.
    let read = tokio::time::timeout(
        state.body_read_timeout,
        state
            .body_budget
            .read(body, &parts.headers, state.max_body_bytes),
    );
    let body = match read.await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return e.into_bedrock().into_response(),
        Err(_) => {
            return BedrockError::validation(format!(
                "the request body did not arrive within {} s, the limit set by [server] body_read_timeout_secs; send the whole body at once",
                state.body_read_timeout.as_secs()
            ))
            .into_response();
        }
    };
    let route_name = match head_identity {
        Some(identity) => identity,
        None => policy.auth.identify_signed(&parts, &body),
    };
    let caller = match route_name.map(|name| policy.admission.routes().get(&name).cloned()) {
        Ok(Some(route)) => Caller {
            route,
            attempt: sdk_attempt(&parts.headers),
        },
        Ok(None) => {
            return BedrockError::new(
                ErrorCode::AccessDenied,
                "tokengate has no route for this caller",
            )
            .into_response();
        }
        Err(e) => return e.into_response(),
    };
    if let Some(r) = record.as_mut() {
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
    let mut admitted = match verdict {
        Verdict::Admitted(a) => {
            let mut a = *a;
            if let Some(rewritten) = a.take_rewritten_body() {
                body = rewritten;
            }
            if let Some(r) = record.take() {
                a.attach_access(r);
            }
            Some(a)
        }
        Verdict::Uncounted => {
            if let Some(r) = record.as_mut() {
                r.decide(Decision::Passthrough);
            }
            None
        }
    };
    let pool: Arc<str> = admitted
        .as_ref()
        .map_or_else(|| Arc::from(NO_POOL), |a| a.pool().name.clone());
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let response = match state
        .upstream
        .send(parts.method.clone(), path_and_query, &parts.headers, body)
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
    let hop: Vec<_> = head
        .headers
        .keys()
        .filter(|k| is_hop_by_hop(k))
        .cloned()
        .collect();
    for name in hop {
        head.headers.remove(name);
    }
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
    }
}
