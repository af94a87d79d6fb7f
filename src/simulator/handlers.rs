//! The HTTP edge: one fallback handler that routes on the raw path (so percent-encoded modelIds
//! and ARNs stay one segment), checks credentials ([`super::auth`]), and answers each operation.
//! The body-model APIs (`/openai/...`, `/v1/chat/completions`, `/anthropic/...`) go to
//! [`super::apis`], the bidirectional stream to [`super::bidi`] before its body is read.
//!
//! A model call: resolve the Region ([`super::region`]) and the model's bucket, read the body,
//! plan the generation, inject a fault if planned (before any quota is taken), reserve through
//! [`Call`], then answer: paced frames for a stream, the whole body once the generation's time
//! has passed otherwise.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::json;

use super::Inner;
use super::charge::{self, Admitted, Call};
use super::generate::{self, Fault, Plan};
use super::models::Family;
use super::quota::Reservation;
use super::shapes::{self, Framing, StreamKind, Usage};
use super::stream::{self, Paced};
use super::tier::Tier;
use super::{apis, auth, bidi, region, request};
use crate::bedrock::error::{X_AMZN_ERROR_TYPE, X_AMZN_REQUEST_ID, new_request_id};
use crate::bedrock::{BedrockError, ErrorCode, Operation, Target, TargetError, eventstream};

/// InvokeModel accepts bodies up to 25 MB; leave room for JSON framing.
pub(super) const MAX_BODY_BYTES: usize = 26 * 1024 * 1024;

pub(super) async fn handle(State(sim): State<Arc<Inner>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    if let Some(api) = apis::Api::of_path(parts.uri.path()) {
        return apis::handle(&sim, api, parts, body).await;
    }
    let target = Target::parse(&parts.method, parts.uri.path());
    if let Ok(Target {
        operation: op @ Operation::InvokeModelWithBidirectionalStream,
        model_id: Some(model_id),
    }) = &target
    {
        sim.traceparents.observe(parts.headers.get("traceparent"));
        return bidi::handle(Arc::clone(&sim), *op, model_id, parts, body).await;
    }
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return BedrockError::validation(
            "The request body could not be read or is larger than 25 MB.",
        )
        .into_response();
    };
    if let Err(refusal) = auth::check(&sim, &parts, &body) {
        return refusal.into_response();
    }
    let target = match target {
        Ok(t) => t,
        Err(e @ TargetError::UnknownOperation { .. }) => {
            return BedrockError::new(ErrorCode::ResourceNotFound, e.to_string())
                .with_header(X_AMZN_ERROR_TYPE, "UnknownOperationException")
                .into_response();
        }
        Err(e) => return BedrockError::validation(e.to_string()).into_response(),
    };
    sim.count_operation(target.operation);
    sim.traceparents.observe(parts.headers.get("traceparent"));
    let model_id = target.model_id.unwrap_or_default();
    match target.operation {
        op @ (Operation::Converse
        | Operation::ConverseStream
        | Operation::InvokeModel
        | Operation::InvokeModelWithResponseStream) => {
            model_call(&sim, op, &model_id, &parts, &body).await
        }
        Operation::CountTokens => count_tokens(&sim, &model_id, &parts, &body),
        Operation::InvokeModelWithBidirectionalStream => {
            BedrockError::validation("The modelId in the path is empty").into_response()
        }
        Operation::ApplyGuardrail => json_ok(&json!({
            "usage": {"topicPolicyUnits": 0, "contentPolicyUnits": 1, "wordPolicyUnits": 0,
                "sensitiveInformationPolicyUnits": 0, "sensitiveInformationPolicyFreeUnits": 0,
                "contextualGroundingPolicyUnits": 0},
            "action": "NONE", "outputs": [], "assessments": [],
        })),
        Operation::InvokeGuardrailChecks => json_ok(&json!({"action": "NONE", "results": []})),
        Operation::StartAsyncInvoke => json_ok(&json!({
            "invocationArn": format!("arn:aws:bedrock:{}:123456789012:async-invoke/{}",
                request_region(&sim, &parts), new_request_id().replace('-', "")),
        })),
        Operation::GetAsyncInvoke => get_async_invoke(parts.uri.path()),
        Operation::ListAsyncInvokes => json_ok(&json!({"asyncInvokeSummaries": []})),
        // Endpoint calls are routed to `super::sagemaker` before this handler; the Bedrock path
        // parser never yields them.
        Operation::InvokeEndpoint | Operation::InvokeEndpointWithResponseStream => {
            BedrockError::new(
                ErrorCode::ResourceNotFound,
                "not a bedrock-runtime operation",
            )
            .into_response()
        }
        // Their paths are answered by `apis::handle` above; a path reaches here only unmatched.
        Operation::OpenAIChatCompletions
        | Operation::OpenAIResponses
        | Operation::AnthropicMessages => {
            BedrockError::new(ErrorCode::UnknownOperation, "Unknown request URL.").into_response()
        }
    }
}

/// The Region the request is made in ([`region::of_request`]).
pub(super) fn request_region<'a>(sim: &'a Inner, parts: &'a Parts) -> &'a str {
    region::of_request(
        &parts.headers,
        parts.uri.authority().map(|a| a.as_str()),
        &sim.config.region,
    )
}

/// The InvokeModel `X-Amzn-Bedrock-Service-Tier` header.
fn header_tier(headers: &HeaderMap) -> Result<Option<Tier>, BedrockError> {
    let Some(value) = headers.get("x-amzn-bedrock-service-tier") else {
        return Ok(None);
    };
    let name = value.to_str().unwrap_or("");
    Tier::parse(name)
        .map(Some)
        .map_err(|_| BedrockError::validation(request::tier_error(name, "serviceTier")))
}

async fn model_call(
    sim: &Inner,
    op: Operation,
    model_id: &str,
    parts: &Parts,
    body: &Bytes,
) -> Response {
    let model = sim.config.resolve(model_id, request_region(sim, parts));
    let model_max = sim.config.max_output_tokens_for(&model.base);
    let family = Family::of(&model.base);
    let prompt = if op.is_converse() {
        request::converse(body, model_max)
    } else {
        request::invoke(family, body, model_max)
    };
    let mut prompt = match prompt {
        Ok(p) => p,
        Err(message) => return BedrockError::validation(message).into_response(),
    };
    if !op.is_converse() {
        match header_tier(&parts.headers) {
            Ok(tier) => prompt.tier = tier,
            Err(e) => return e.into_response(),
        }
    }
    let call = match Call::arrive(sim, op.name(), &model, prompt.tier) {
        Ok(call) => call,
        Err(refusal) => return BedrockError::validation(refusal.to_string()).into_response(),
    };
    let max_tokens = prompt.max_tokens.unwrap_or(model_max);
    let plan = generate::plan(
        &sim.config,
        body,
        max_tokens,
        op.is_streaming(),
        sim.next_arrival(),
    );
    if let Some(early) = fault_response(sim, &call, plan.fault, IntoResponse::into_response) {
        return early;
    }
    let admitted = match call.reserve(prompt.input_tokens + max_tokens, prompt.input_tokens) {
        Ok(a) => a,
        Err(shortfall) => {
            return BedrockError::new(ErrorCode::Throttling, charge::throttle_message(shortfall))
                .into_response();
        }
    };
    let generation = Generation::new(sim, &plan, model_id, prompt.input_tokens, admitted);
    native_answer(sim, op, family, generation).await
}

/// The answer of an admitted native call: paced frames for a stream, else the whole body (with
/// the usage headers of InvokeModel) once the generation is done.
async fn native_answer(
    sim: &Inner,
    op: Operation,
    family: Family,
    generation: Generation<'_>,
) -> Response {
    if op.is_streaming() {
        let kind = if op.is_converse() {
            StreamKind::Converse
        } else {
            StreamKind::Invoke(family)
        };
        let request_id = generation.request_id.clone();
        let tier = generation.usage.tier;
        let body = generation.stream(sim, &kind);
        let mut response = respond(body, eventstream::CONTENT_TYPE, &request_id);
        if !op.is_converse() {
            let h = response.headers_mut();
            h.insert(
                "x-amzn-bedrock-content-type",
                HeaderValue::from_static("application/json"),
            );
            echo_tier_header(h, tier);
        }
        return response;
    }
    let done = match generation.finish().await {
        Ok(done) => done,
        Err(broken) => return respond(broken, "application/json", &new_request_id()),
    };
    if op.is_converse() {
        let body = shapes::converse_body(&done.text, &done.usage);
        return respond(Body::from(body), "application/json", &done.request_id);
    }
    let usage = &done.usage;
    let body = shapes::invoke_body(family, &done.text, usage, &done.request_id);
    let mut response = respond(Body::from(body), "application/json", &done.request_id);
    let h = response.headers_mut();
    for (name, value) in [
        ("x-amzn-bedrock-input-token-count", usage.input),
        ("x-amzn-bedrock-output-token-count", usage.output),
        ("x-amzn-bedrock-invocation-latency", usage.latency_ms),
    ] {
        h.insert(name, HeaderValue::from(value));
    }
    echo_tier_header(h, usage.tier);
    response
}

fn echo_tier_header(h: &mut HeaderMap, tier: Option<Tier>) {
    if let Some(tier) = tier {
        h.insert(
            "x-amzn-bedrock-service-tier",
            HeaderValue::from_static(tier.name()),
        );
    }
}

/// The answer to a call whose plan injects a 503, a 500 or a reset (before any quota is
/// taken), shaped by `shape`; `None` when the call goes on.
pub(super) fn fault_response(
    sim: &Inner,
    call: &Call<'_>,
    fault: Option<Fault>,
    shape: impl FnOnce(BedrockError) -> Response,
) -> Option<Response> {
    let fault = fault?;
    sim.count_fault(fault);
    let error = match fault {
        Fault::Unavailable => BedrockError::new(
            ErrorCode::ServiceUnavailable,
            "Bedrock is unable to process your request.",
        ),
        Fault::Internal => BedrockError::new(
            ErrorCode::InternalServer,
            "The server encountered an internal error while processing the request.",
        ),
        Fault::Reset => {
            call.count_fault();
            return Some(super::reset::response());
        }
        Fault::Cut | Fault::Stall => return None,
    };
    call.count_fault();
    Some(shape(error))
}

/// An admitted call, ready to be answered.
pub(super) struct Generation<'a> {
    pub usage: Usage<'a>,
    pub text: String,
    pub request_id: String,
    fault: Option<Fault>,
    latency: Duration,
    reservation: Reservation,
}

/// A call whose whole generation is done and settled.
pub(super) struct Finished<'a> {
    pub usage: Usage<'a>,
    pub text: String,
    pub request_id: String,
}

impl<'a> Generation<'a> {
    pub fn new(
        sim: &Inner,
        plan: &Plan,
        model_id: &'a str,
        input: u64,
        admitted: Admitted,
    ) -> Generation<'a> {
        let stall = match plan.fault {
            Some(Fault::Stall) => Duration::from_millis(sim.config.stall_ms),
            _ => Duration::ZERO,
        };
        let latency = generate::ready_at(&sim.config, plan.output_tokens) + stall;
        Generation {
            usage: Usage {
                model_id,
                input,
                output: plan.output_tokens,
                hit_max: plan.hit_max,
                latency_ms: latency.as_millis() as u64,
                first_byte_ms: sim.config.time_to_first_token_ms,
                tier: admitted.served,
            },
            text: generate::text(plan.text_seed, plan.output_tokens),
            request_id: new_request_id(),
            fault: plan.fault,
            latency,
            reservation: admitted.reservation,
        }
    }

    /// The paced streaming body in `framing`; it settles the call as its last frame goes out.
    pub fn stream(self, sim: &Inner, framing: &dyn Framing) -> Body {
        let cut = self.fault == Some(Fault::Cut);
        let steps = stream::steps(
            &sim.config,
            framing,
            &self.text,
            &self.usage,
            &self.request_id,
            self.fault,
        );
        let paced = Paced::new(steps, Some(self.reservation), self.usage.output, cut)
            .counting(sim.stream_bytes.clone());
        Body::from_stream(paced)
    }

    /// Waits out the generation and settles it; a cut call gets `Err`, a body that breaks the
    /// connection before any byte.
    pub async fn finish(mut self) -> Result<Finished<'a>, Body> {
        if self.fault == Some(Fault::Cut) {
            self.reservation.set_generated(self.usage.output / 2);
            let broken = Paced::new(Vec::new(), Some(self.reservation), self.usage.output, true);
            return Err(Body::from_stream(broken));
        }
        // A caller that hangs up now is still charged the whole generation, as Bedrock would.
        self.reservation.set_generated(self.usage.output);
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        self.reservation
            .complete(0, self.usage.output, Instant::now());
        Ok(Finished {
            usage: self.usage,
            text: self.text,
            request_id: self.request_id,
        })
    }
}

fn count_tokens(sim: &Inner, model_id: &str, parts: &Parts, body: &[u8]) -> Response {
    let model = sim.config.resolve(model_id, request_region(sim, parts));
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

pub(super) fn json_ok(v: &serde_json::Value) -> Response {
    respond(
        Body::from(v.to_string()),
        "application/json",
        &new_request_id(),
    )
}

pub(super) fn respond(body: Body, content_type: &'static str, request_id: &str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Ok(id) = HeaderValue::from_str(request_id) {
        h.insert(X_AMZN_REQUEST_ID, id);
    }
    response
}
