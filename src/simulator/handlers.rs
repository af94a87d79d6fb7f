//! The HTTP edge: one fallback handler that routes on the raw path (so percent-encoded modelIds
//! and ARNs stay one segment), checks SigV4 when configured, and answers each operation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde_json::json;

use super::Inner;
use super::generate::{self, Fault};
use super::models::{self, Family};
use super::request;
use super::shapes::{self, StreamKind, Usage};
use super::stream::{self, Paced};
use crate::auth::sigv4::{self, SigV4Error};
use crate::bedrock::error::{X_AMZN_ERROR_TYPE, X_AMZN_REQUEST_ID, new_request_id};
use crate::bedrock::{BedrockError, ErrorCode, Operation, Target, TargetError, eventstream};

/// InvokeModel accepts bodies up to 25 MB; leave room for JSON framing.
const MAX_BODY_BYTES: usize = 26 * 1024 * 1024;

pub(super) async fn handle(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return BedrockError::validation(
            "The request body could not be read or is larger than 25 MB.",
        )
        .into_response();
    };
    let authorization = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    sim.sigv4.observe(authorization);
    if let Some(rejection) = sigv4_rejection(&sim, &parts, &body) {
        return rejection.into_response();
    }
    let target = match Target::parse(&parts.method, parts.uri.path()) {
        Ok(t) => t,
        Err(e @ TargetError::UnknownOperation { .. }) => {
            return BedrockError::new(ErrorCode::ResourceNotFound, e.to_string())
                .with_header(X_AMZN_ERROR_TYPE, "UnknownOperationException")
                .into_response();
        }
        Err(e) => return BedrockError::validation(e.to_string()).into_response(),
    };
    sim.count_operation(target.operation);
    let model_id = target.model_id.unwrap_or_default();
    match target.operation {
        op @ (Operation::Converse
        | Operation::ConverseStream
        | Operation::InvokeModel
        | Operation::InvokeModelWithResponseStream) => model_call(&sim, op, &model_id, &body).await,
        Operation::CountTokens => count_tokens(&sim, &model_id, &body),
        Operation::InvokeModelWithBidirectionalStream => BedrockError::validation(
            "InvokeModelWithBidirectionalStream is not simulated by tokengate's simulator.",
        )
        .into_response(),
        Operation::ApplyGuardrail => json_ok(&json!({
            "usage": {"topicPolicyUnits": 0, "contentPolicyUnits": 1, "wordPolicyUnits": 0,
                "sensitiveInformationPolicyUnits": 0, "sensitiveInformationPolicyFreeUnits": 0,
                "contextualGroundingPolicyUnits": 0},
            "action": "NONE", "outputs": [], "assessments": [],
        })),
        Operation::InvokeGuardrailChecks => json_ok(&json!({"action": "NONE", "results": []})),
        Operation::StartAsyncInvoke => json_ok(&json!({
            "invocationArn": format!("arn:aws:bedrock:{}:123456789012:async-invoke/{}",
                sim.config.region, new_request_id().replace('-', "")),
        })),
        Operation::GetAsyncInvoke => get_async_invoke(parts.uri.path()),
        Operation::ListAsyncInvokes => json_ok(&json!({"asyncInvokeSummaries": []})),
    }
}

/// The 403 for a request whose signature does not verify, when `verify_sigv4` is set.
fn sigv4_rejection(sim: &Inner, parts: &http::request::Parts, body: &[u8]) -> Option<BedrockError> {
    let key = sim.config.verify_sigv4.as_ref()?;
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let result = sigv4::verify_with_authority(
        &parts.method,
        path_and_query,
        parts.uri.authority().map(|a| a.as_str()),
        &parts.headers,
        body,
        |id| (id == key.access_key_id).then(|| key.secret_access_key.clone()),
        std::time::SystemTime::now(),
    );
    sim.sigv4.record(result.is_ok());
    result.err().map(|e| match e {
        SigV4Error::Missing => BedrockError::new(ErrorCode::AccessDenied, "Missing Authentication Token")
            .with_header(X_AMZN_ERROR_TYPE, "MissingAuthenticationTokenException"),
        SigV4Error::UnknownKey(_) => BedrockError::new(
            ErrorCode::UnrecognizedClient,
            "The security token included in the request is invalid.",
        ),
        SigV4Error::SignatureMismatch => BedrockError::new(
            ErrorCode::AccessDenied,
            "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.",
        )
        .with_header(X_AMZN_ERROR_TYPE, "InvalidSignatureException"),
        other => BedrockError::new(ErrorCode::AccessDenied, other.to_string())
            .with_header(X_AMZN_ERROR_TYPE, "InvalidSignatureException"),
    })
}

async fn model_call(sim: &Inner, op: Operation, model_id: &str, body: &Bytes) -> Response {
    let model = models::resolve(model_id, &sim.config.region);
    let model_max = sim.config.max_output_tokens_for(&model.base);
    let family = Family::of(&model.base);
    let prompt = if op.is_converse() {
        request::converse(body, model_max)
    } else {
        request::invoke(family, body, model_max)
    };
    let prompt = match prompt {
        Ok(p) => p,
        Err(message) => return BedrockError::validation(message).into_response(),
    };
    let bucket = sim.buckets.get(&model.bucket, || {
        sim.config.tokens_per_minute_for(&model.bucket)
    });
    bucket.count_request();
    let max_tokens = prompt.max_tokens.unwrap_or(model_max);
    let plan = generate::plan(
        &sim.config,
        body,
        max_tokens,
        op.is_streaming(),
        sim.next_arrival(),
    );
    if let Some(fault) = plan.fault {
        sim.count_fault(fault);
    }
    match plan.fault {
        Some(Fault::Unavailable) => {
            bucket.count_error();
            return BedrockError::new(
                ErrorCode::ServiceUnavailable,
                "Bedrock is unable to process your request.",
            )
            .into_response();
        }
        Some(Fault::Internal) => {
            bucket.count_error();
            return BedrockError::new(
                ErrorCode::InternalServer,
                "The server encountered an internal error while processing the request.",
            )
            .into_response();
        }
        Some(Fault::Reset) => {
            bucket.count_error();
            return super::reset::response();
        }
        _ => {}
    }
    let Some(reservation) = bucket.try_reserve(prompt.input_tokens + max_tokens, Instant::now())
    else {
        return BedrockError::new(
            ErrorCode::Throttling,
            "Too many tokens, please wait before trying again.",
        )
        .into_response();
    };
    let mut reservation =
        reservation.with_charge(prompt.input_tokens, models::burndown(&model.base));

    let stall = match plan.fault {
        Some(Fault::Stall) => Duration::from_millis(sim.config.stall_ms),
        _ => Duration::ZERO,
    };
    let latency = generate::ready_at(&sim.config, plan.output_tokens) + stall;
    let usage = Usage {
        model_id,
        input: prompt.input_tokens,
        output: plan.output_tokens,
        hit_max: plan.hit_max,
        latency_ms: latency.as_millis() as u64,
        first_byte_ms: sim.config.time_to_first_token_ms,
    };
    let text = generate::text(plan.text_seed, plan.output_tokens);
    let request_id = new_request_id();
    let cut = plan.fault == Some(Fault::Cut);

    if op.is_streaming() {
        let kind = if op.is_converse() {
            StreamKind::Converse
        } else {
            StreamKind::Invoke(family)
        };
        let steps = stream::steps(&sim.config, kind, &text, &usage, &request_id, plan.fault);
        let paced = Paced::new(steps, Some(reservation), usage.output, cut)
            .counting(sim.stream_bytes.clone());
        let body = Body::from_stream(paced);
        let mut response = respond(body, eventstream::CONTENT_TYPE, &request_id);
        if !op.is_converse() {
            response.headers_mut().insert(
                "x-amzn-bedrock-content-type",
                HeaderValue::from_static("application/json"),
            );
        }
        return response;
    }
    if cut {
        // A non-streaming call cut half-way: the connection breaks before any body.
        reservation.set_generated(plan.output_tokens / 2);
        let body = Body::from_stream(Paced::new(
            Vec::new(),
            Some(reservation),
            usage.output,
            true,
        ));
        return respond(body, "application/json", &request_id);
    }
    // A caller that hangs up now is still charged the whole generation, as Bedrock would.
    reservation.set_generated(plan.output_tokens);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    reservation.complete(0, plan.output_tokens, Instant::now());
    if op.is_converse() {
        let body = shapes::converse_body(&text, &usage);
        return respond(Body::from(body), "application/json", &request_id);
    }
    let body = shapes::invoke_body(family, &text, &usage, &request_id);
    let mut response = respond(Body::from(body), "application/json", &request_id);
    let h = response.headers_mut();
    for (name, value) in [
        ("x-amzn-bedrock-input-token-count", usage.input),
        ("x-amzn-bedrock-output-token-count", usage.output),
        ("x-amzn-bedrock-invocation-latency", usage.latency_ms),
    ] {
        h.insert(name, HeaderValue::from(value));
    }
    response
}

fn count_tokens(sim: &Inner, model_id: &str, body: &[u8]) -> Response {
    let model = models::resolve(model_id, &sim.config.region);
    match request::count_tokens(Family::of(&model.base), body) {
        Ok(n) => json_ok(&json!({ "inputTokens": n })),
        Err(message) => BedrockError::validation(message).into_response(),
    }
}

fn get_async_invoke(path: &str) -> Response {
    let encoded = path.trim_start_matches("/async-invoke/");
    let arn = percent_encoding::percent_decode_str(encoded).decode_utf8_lossy();
    json_ok(&json!({
        "invocationArn": arn,
        "modelArn": "arn:aws:bedrock:us-east-1::foundation-model/amazon.nova-reel-v1:1",
        "clientRequestToken": "simulated",
        "status": "Completed",
        "submitTime": "2026-01-01T00:00:00Z",
        "lastModifiedTime": "2026-01-01T00:01:00Z",
        "endTime": "2026-01-01T00:01:00Z",
        "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": "s3://simulated-bucket/output/"}},
    }))
}

fn json_ok(v: &serde_json::Value) -> Response {
    respond(
        Body::from(v.to_string()),
        "application/json",
        &new_request_id(),
    )
}

fn respond(body: Body, content_type: &'static str, request_id: &str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Ok(id) = HeaderValue::from_str(request_id) {
        h.insert(X_AMZN_REQUEST_ID, id);
    }
    response
}
