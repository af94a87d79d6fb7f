//! The life of a proxied request, step by step (see ARCHITECTURE.md, "The life of a request"):
//!
//! 1. **Target**: the operation and modelId from the raw path ([`crate::bedrock::Target`]); a
//!    path that could name another resource upstream is refused.
//! 2. **Caller**: who is calling, from the head before any body byte is read, and in sigv4 mode
//!    from the signature over the body too ([`caller`]); the body is read (bounded) in between.
//! 3. **Decide**: [`crate::admission::Admission::decide`] returns a pure [`Decision`].
//! 4. **Answer** a refusal ([`crate::answer`]), or **forward** the request ([`forward`]).
//! 5. **Meter** the response on its way back and settle the reservation ([`meter`]).
//!
//! Every step records what happened through the policy's [`crate::observe::Observer`]: an
//! admitted request's access-log line is written at its settlement, any other request's when
//! its answer is ready. A 429 or 5xx answered to an identified caller is remembered
//! ([`crate::admission::retries`]), so that the SDK's retry of that call may use the retry reserve.
//! Only the headers the API defines (and a SigV4 caller signed) go upstream
//! ([`crate::upstream::headers`]).
//!
//! InvokeModelWithBidirectionalStream takes the same steps from its head alone, its body being
//! the session's events, which stream upstream as they come ([`duplex`], [`relay`]).

pub mod caller;
pub mod count_tokens;
pub mod duplex;
pub mod forward;
pub mod meter;
pub mod relay;

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Request, State},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::StatusCode;

use crate::{
    admission::{Decision, Facts},
    answer,
    bedrock::{Operation, Target},
    observe::{Observation, Verdict},
    state::{AppState, Policy},
    upstream::headers::BEDROCK_RUNTIME,
};

/// Handles every `bedrock-runtime` call.
pub async fn handle(State(state): State<Arc<AppState>>, request: Request) -> Response {
    // One policy generation for the whole request, whatever a reload does meanwhile.
    let policy = state.policy();
    let mut obs = Some(Observation::start());
    let invocation = caller::invocation_id(request.headers()).map(str::to_owned);
    let mut route = None;
    let response = proxy(&state, &policy, request, &mut obs, &mut route).await;
    if let Some(mut obs) = obs {
        obs.answered(response.status(), response.headers());
        policy.observer.finished(obs);
    }
    let status = response.status();
    if let (Some(route), Some(id), true) = (
        route,
        invocation,
        status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
    ) {
        state
            .rejections
            .record(&route, &id, std::time::Instant::now());
    }
    response
}

/// Steps 1 to 4; `obs` is taken by an admitted request, whose line is written when it settles;
/// `route` is the caller's, once identified.
async fn proxy(
    state: &AppState,
    policy: &Arc<Policy>,
    request: Request,
    obs: &mut Option<Observation>,
    route: &mut Option<Arc<str>>,
) -> Response {
    let (parts, body) = request.into_parts();
    let record = obs.get_or_insert_with(Observation::start);
    // Until admission decides, an answer refuses the request itself (its path, its
    // credentials, its body).
    record.refused(Verdict::Invalid);
    let target = match Target::parse(&parts.method, parts.uri.path()) {
        Ok(t) => t,
        Err(e) => return answer::target_error(e),
    };
    record.target(target.operation, target.model_id.as_deref());
    if target.operation == Operation::InvokeModelWithBidirectionalStream {
        let model_id = target.model_id.as_deref();
        return duplex::proxy(state, policy, parts, body, model_id, obs, route).await;
    }
    // Who is calling, from the head alone: an unknown caller never gets a body buffered.
    let identity = match caller::identify_head(policy, &parts) {
        Ok(identity) => identity,
        Err(refusal) => return refusal.into_response(),
    };
    let body = match read_body(state, &parts.headers, body).await {
        Ok(body) => body,
        Err(refusal) => return refusal,
    };
    let caller = match caller::identify(policy, &identity, &parts, &body, &state.rejections) {
        Ok(caller) => caller,
        Err(refusal) => return refusal.into_response(),
    };
    *route = Some(caller.route.name.clone());
    record.route(&caller.route.name);
    let decision = policy
        .admission
        .decide(&Facts {
            operation: target.operation,
            model_id: target.model_id.as_deref(),
            body: &body,
            caller: &caller,
        })
        .await;
    policy.observer.decided(record, &decision);
    if let Some(refusal) = answer::refusal(&decision) {
        return refusal;
    }
    let admitted = match decision {
        Decision::Admit(admitted) => Some(admitted),
        _ => None,
    };
    let request = forward::Outgoing {
        parts: &parts,
        headers: BEDROCK_RUNTIME.forwarded(&parts.headers, identity.signed_headers()),
        operation: target.operation,
        body,
    };
    forward::forward(state, policy, request, admitted, obs).await
}

/// Reads the whole request body, within `server.max_body_bytes`, the buffered-body budget
/// (`server.max_buffered_body_bytes`, the bytes carry their charge until the last copy is dropped)
/// and `server.body_read_timeout_secs`. A client that sends a head and then trickles (or stalls)
/// its body holds a connection but never a reservation.
async fn read_body(
    state: &AppState,
    headers: &http::HeaderMap,
    body: Body,
) -> Result<Bytes, Response> {
    let read = state.body_budget.read(body, headers, state.max_body_bytes);
    match tokio::time::timeout(state.body_read_timeout, read).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(e.into_bedrock().into_response()),
        Err(_) => Err(answer::body_timeout(state.body_read_timeout)),
    }
}
