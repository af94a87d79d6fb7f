//! The life of a proxied request, step by step (see ARCHITECTURE.md, "The life of a request"):
//!
//! 1. **Target**: the operation and modelId from the raw path ([`crate::bedrock::Target`]).
//! 2. **Caller**: who is calling, from the head, and in sigv4 mode from the signed body too
//!    ([`caller`]); the body is read (bounded) in between.
//! 3. **Decide**: [`crate::admission::Admission::decide`] returns a pure [`Decision`].
//! 4. **Answer** a refusal ([`crate::answer`]), or **forward** the request ([`forward`]).
//! 5. **Meter** the response on its way back and settle the reservation ([`meter`]).
//!
//! Every step records what happened through the policy's [`crate::observe::Observer`]: an
//! admitted request's access-log line is written at its settlement, any other request's when
//! its answer is ready.

pub mod caller;
pub mod count_tokens;
pub mod forward;
pub mod meter;

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Request, State},
    response::{IntoResponse, Response},
};
use bytes::Bytes;

use crate::{
    admission::{Decision, Facts},
    answer::{self, BodyReadError},
    bedrock::Target,
    observe::{Observation, Verdict},
    state::{AppState, Policy},
};

/// Handles every `bedrock-runtime` call.
pub async fn handle(State(state): State<Arc<AppState>>, request: Request) -> Response {
    // One policy generation for the whole request, whatever a reload does meanwhile.
    let policy = state.policy();
    let mut obs = Some(Observation::start());
    let response = proxy(&state, &policy, request, &mut obs).await;
    if let Some(mut obs) = obs {
        obs.answered(response.status(), response.headers());
        policy.observer.finished(obs);
    }
    response
}

/// Steps 1 to 4; `obs` is taken by an admitted request, whose line is written when it settles.
async fn proxy(
    state: &AppState,
    policy: &Arc<Policy>,
    request: Request,
    obs: &mut Option<Observation>,
) -> Response {
    let (parts, body) = request.into_parts();
    let record = obs.get_or_insert_with(Observation::start);
    policy.observer.began(record, &parts.headers);
    // Until admission decides, an answer refuses the request itself (its path, its
    // credentials, its body).
    record.refused(Verdict::Invalid);
    let target = match Target::parse(&parts.method, parts.uri.path()) {
        Ok(t) => t,
        Err(e) => return answer::target_error(e),
    };
    record.target(target.operation, target.model_id.as_deref());
    if !target.operation.forwarded() {
        return answer::not_forwarded(target.operation);
    }
    let identified = match caller::identify_head(policy, &parts) {
        Ok(identified) => identified,
        Err(refusal) => return refusal.into_response(),
    };
    let body = match read_body(state, body).await {
        Ok(body) => body,
        Err(e) => return answer::body_error(&e),
    };
    let caller = match caller::identify(policy, identified, &parts, &body) {
        Ok(caller) => caller,
        Err(refusal) => return refusal.into_response(),
    };
    record.caller(&caller);
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
        operation: target.operation,
        body,
    };
    forward::forward(state, policy, request, admitted, obs).await
}

/// Reads the whole request body, within `server.max_body_bytes` and
/// `server.body_read_timeout_secs`. A client that sends a head and then trickles (or stalls) its
/// body holds a connection but never a reservation.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, BodyReadError> {
    let limit = state.max_body_bytes;
    let read = tokio::time::timeout(state.body_read_timeout, axum::body::to_bytes(body, limit));
    match read.await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            Err(if too_large {
                BodyReadError::TooLarge { limit }
            } else {
                BodyReadError::Failed(e.to_string())
            })
        }
        Err(_) => Err(BodyReadError::TimedOut {
            after: state.body_read_timeout,
        }),
    }
}
