//! Adaptive retry (`routes[].adaptive_retry`, issue #22): a non-streamed call whose route's
//! learned cap ([`crate::admission::adaptive`]) was written into it, and which stopped at that
//! cap, is sent again with the caller's own `maxTokens`, and that answer is returned instead.
//!
//! # How
//! Converse and InvokeModel only. The first answer (a success) is read whole before any of it
//! goes to the client (at most [`FIRST_ANSWER_LIMIT`] bytes, within the upstream idle timeout: a
//! non-streamed answer is sent once generated) and metered as any: the first call settles to
//! its usage, is charged, and writes its access-log line. When its stop reason says it stopped
//! at its cap (`max_tokens`, `length`, ...), the caller's own body is decided again
//! ([`crate::admission::Admission::decide_adaptive_retry`]): a second call, admitted like any
//! (it may wait in the queue or be refused, and draws on the route's budgets and shares), with
//! no learned cap, whose output the learner records (the whole answer the cap cut short). It
//! has its own observation, so its own access-log line, and is forwarded as any call.
//!
//! # What the caller gets ([`RetryOutcome`], the `x-tokengate-adaptive-retry` header and
//! `tokengate_adaptive_retries_total`)
//! - `answered`: the retry was admitted and upstream answered it 2xx: the retry's answer.
//! - `refused`: the retry was not admitted (no room within its queue wait, a budget, ...): the
//!   first answer, truncated, its stop reason saying so, as Bedrock answers a call with that
//!   `maxTokens`. A usable answer is better than a 429, which the SDK would answer by sending
//!   the whole call again.
//! - `failed`: upstream failed the retry (an error status, no answer): the first answer.
//!
//! Both calls are charged and counted (the guard counts the first as a proxy-caused
//! truncation, which is what raises the cap). A first answer that cannot be read whole (cut,
//! idle, or larger than the limit) settles by the `no_usage` rule and reaches the client as a
//! body that ends in an error, as a cut plain body does through [`super::meter::MeteredBody`].
//!
//! # Streams
//! A stream (ConverseStream, InvokeModelWithResponseStream, the OpenAI and Anthropic APIs'
//! streams) is never retried: its content has reached the client by the time its stop reason
//! arrives, and a stream cannot be resumed. Its truncation counts in the guard like any other.
//! The OpenAI and Anthropic APIs' non-streamed calls are not retried either (their truncations
//! count the same way).

use std::sync::Arc;

use crate::upstream::PooledBody;
use axum::{body::Body, response::Response};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, request::Parts};
use http_body_util::{BodyExt, Limited};

use super::{
    Call,
    forward::{self, Head, Outgoing},
    meter::InFlight,
};
use crate::{
    admission::{Caller, Decision, Facts, adaptive::RetryOutcome},
    answer,
    bedrock::{Operation, usage::ResponseKind},
    observe::Observation,
    state::{AppState, Policy},
    upstream::Upstream,
};

/// The header that says what became of an adaptive retry.
pub const X_TOKENGATE_ADAPTIVE_RETRY: HeaderName =
    HeaderName::from_static("x-tokengate-adaptive-retry");

/// The most of a first answer read to see its stop reason (a capped answer is short: the cap
/// is a learned output length).
pub const FIRST_ANSWER_LIMIT: usize = 8 * 1024 * 1024;

/// What the second call needs of the first: who called, what, and the caller's own body.
#[derive(Debug)]
pub struct Retry<'a> {
    caller: &'a Caller,
    model_id: Option<&'a str>,
    service_tier: Option<&'a str>,
    /// The caller's body, before any rewrite.
    body: Bytes,
    /// The headers forwarded upstream.
    headers: http::HeaderMap,
}

impl<'a> Retry<'a> {
    /// The retry of `call`, if its route retries and its operation can be: `service_tier` is
    /// its `X-Amzn-Bedrock-Service-Tier` header; `body` the caller's, `headers` those forwarded.
    pub fn for_call(
        caller: &'a Caller,
        call: &'a Call,
        service_tier: Option<&'a str>,
        body: &Bytes,
        headers: &http::HeaderMap,
    ) -> Option<Retry<'a>> {
        let Call::Model(target) = call else {
            return None;
        };
        let retryable = matches!(
            target.operation,
            Operation::Converse | Operation::InvokeModel
        );
        (retryable && caller.route.config.adaptive_retry).then(|| Retry {
            caller,
            model_id: target.model_id.as_deref(),
            service_tier,
            body: body.clone(),
            headers: headers.clone(),
        })
    }
}

/// The first call, as sent.
#[derive(Debug)]
pub struct First<'a> {
    pub parts: &'a Parts,
    pub operation: Operation,
    pub upstream: &'a Upstream,
}

/// Upstream answered 2xx a call the learned cap was written into: its answer, or, when it
/// stopped at the cap and `retry` is set, the retry's ([`RetryOutcome`]).
pub async fn after_capped(
    state: &AppState,
    policy: &Arc<Policy>,
    first: First<'_>,
    in_flight: InFlight,
    response: http::Response<PooledBody>,
    retry: Option<Retry<'_>>,
) -> Response {
    let operation = first.operation;
    let whole = matches!(
        ResponseKind::for_response(operation, response.headers()),
        Some(ResponseKind::ConverseJson | ResponseKind::InvokeModel)
    );
    let Some(retry) = retry.filter(|_| whole) else {
        return forward::respond(state, policy, operation, Some(in_flight), response, false);
    };
    let (pool, slot) = (in_flight.hold().pool().clone(), in_flight.hold().route());
    let (head, incoming) = response.into_parts();
    let Head { head, meter, .. } = forward::answer_head(policy, operation, Some(in_flight), head);
    let read = Limited::new(incoming, FIRST_ANSWER_LIMIT).collect();
    let body = match tokio::time::timeout(state.upstream.idle_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        // The meter, dropped unsettled, settles by the `no_usage` rule.
        Ok(Err(e)) => return cut(head, &e.to_string()),
        Err(_) => return cut(head, "upstream sent nothing for the idle timeout"),
    };
    let truncated = meter.is_some_and(|meter| meter.whole(&body));
    if !truncated {
        return Response::from_parts(head, Body::from(body));
    }
    let (outcome, answer) = second_call(state, policy, &first, retry).await;
    policy.observer.adaptive_retry(&pool, slot, outcome);
    let mut answer = answer.unwrap_or_else(|| Response::from_parts(head, Body::from(body)));
    answer.headers_mut().insert(
        X_TOKENGATE_ADAPTIVE_RETRY,
        HeaderValue::from_static(outcome.label()),
    );
    answer
}

/// A first answer that could not be read whole: its head, and a body that ends in an error.
fn cut(head: http::response::Parts, why: &str) -> Response {
    tracing::warn!(
        error = why,
        "adaptive retry: the first answer could not be read"
    );
    let failed = std::io::Error::other(format!("upstream response cut: {why}"));
    let body = Body::from_stream(futures_util::stream::once(async move {
        Err::<Bytes, _>(failed)
    }));
    Response::from_parts(head, body)
}

/// The second call: decided (no learned cap) and, when admitted, forwarded as any call. The
/// response is the retry's answer when it is one to return (`answered`).
async fn second_call(
    state: &AppState,
    policy: &Arc<Policy>,
    first: &First<'_>,
    retry: Retry<'_>,
) -> (RetryOutcome, Option<Response>) {
    let operation = first.operation;
    let mut obs = Observation::start();
    policy.observer.began(&mut obs, &first.parts.headers);
    obs.target(operation, retry.model_id);
    obs.caller(retry.caller);
    let decision = policy
        .admission
        .decide_adaptive_retry(&Facts {
            operation,
            model_id: retry.model_id,
            body: &retry.body,
            read: None,
            caller: retry.caller,
            service_tier: retry.service_tier,
            endpoint: None,
        })
        .await;
    policy.observer.decided(&mut obs, &decision);
    let region = super::region(state, policy, &decision, retry.model_id);
    let Decision::Admit(admitted) = decision else {
        // Its line records the answer it would have had.
        if let Some(refusal) = answer::refusal(&decision, operation) {
            obs.answered(refusal.status(), refusal.headers());
        }
        policy.observer.finished(obs);
        return (RetryOutcome::Refused, None);
    };
    let request = Outgoing {
        parts: first.parts,
        headers: retry.headers,
        operation,
        region,
        body: retry.body,
        upstream: first.upstream,
        retry: None,
    };
    let mut obs = Some(obs);
    let response = Box::pin(forward::forward(
        state,
        policy,
        request,
        Some(admitted),
        &mut obs,
    ))
    .await;
    if response.status().is_success() {
        (RetryOutcome::Answered, Some(response))
    } else {
        (RetryOutcome::Failed, None)
    }
}
