//! InvokeModelWithBidirectionalStream: an event stream both ways at once over HTTP/2, for up to
//! 8 minutes (Nova Sonic speech).
//!
//! The steps are the pipeline's, decided from the head alone since the body is the session
//! itself:
//!
//! 1. HTTP/2 only: HTTP/1.1 cannot stream both ways, and gets a `ValidationException`.
//! 2. **Caller** from the head ([`crate::auth::Authenticator::identify_stream`]): in `sigv4` mode
//!    the head's signature is checked now, and each event's as it arrives ([`relay`]).
//! 3. **Decide** as any model call; the session reserves its pool's `bidirectional_reservation`
//!    (capped by the route's `max_tokens_ceiling`). Its concurrency permit is held for the whole
//!    session.
//! 4. **Forward** over HTTP/2 ([`crate::upstream::Upstream::open_duplex`]): the request body is
//!    the [`relay::InputRelay`], which streams the client's events upstream one by one, re-signed,
//!    while the response streams back through the pipeline's metered body.
//! 5. **Meter**: the `usageEvent` running totals in the output; the session settles when it ends
//!    ([`crate::proxy::meter`]).
//!
//! # Settlement, path by path
//! - The client ends its input, upstream ends the session (`sessionEnd`, its own 8-minute limit
//!   with a `modelTimeoutException`): the response ends cleanly and settles to the last usage
//!   totals (rule `usage`).
//! - Upstream refuses the session in-band (`throttlingException` before any usage): `not_charged`,
//!   and the pool shrinks as for a 429.
//! - Upstream silent for `upstream.idle_timeout_secs`, its connection failing, the drain deadline
//!   at shutdown, the client hanging up, an input event refused: the response ends early (an
//!   exception frame when anyone is left to read it) and settles by `no_usage`, the larger of the
//!   reservation and the last totals' charge. The input then stops, which resets the upstream
//!   stream: upstream ends the session too.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::{Version, request::Parts};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio_util::sync::{DropGuard, WaitForCancellationFutureOwned};

use super::{
    Retryable, caller, forward,
    meter::InFlight,
    relay::{Ceiling, Input, InputRelay, Link},
};
use crate::{
    admission::{Caller, Decision, Facts},
    answer,
    bedrock::{Operation, eventstream::exception_frame, operation::raw_path_and_query},
    observe::Observation,
    state::{AppState, Policy},
    upstream::{headers::BEDROCK_RUNTIME, signer::SIGNING_NAME},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const OPERATION: Operation = Operation::InvokeModelWithBidirectionalStream;

/// Steps 2 to 5 for one session; `obs` and `retryable` as in [`super::proxy`].
pub(super) async fn proxy(
    state: &AppState,
    policy: &Arc<Policy>,
    parts: Parts,
    client: Body,
    model_id: Option<&str>,
    obs: &mut Option<Observation>,
    retryable: &mut Option<Retryable>,
) -> Response {
    if parts.version != Version::HTTP_2 {
        return answer::needs_http2(OPERATION);
    }
    let (identity, verifier) = match policy.auth.identify_stream(&parts, SIGNING_NAME) {
        Ok(identified) => identified,
        Err(refusal) => return refusal.into_response(),
    };
    let call = caller::call_id(&parts.headers, None);
    let caller =
        match caller::caller_of(policy, &identity, &parts, call.as_ref(), &state.rejections) {
            Ok(caller) => caller,
            Err(refusal) => return refusal.into_response(),
        };
    let record = obs.get_or_insert_with(Observation::start);
    *retryable = Retryable::of(call, &caller);
    record.caller(&caller);
    let no_body = Bytes::new();
    let decision = policy
        .admission
        .decide(&Facts {
            operation: OPERATION,
            model_id,
            body: &no_body,
            read: None,
            caller: &caller,
            service_tier: None,
            endpoint: None,
        })
        .await;
    policy.observer.decided(record, &decision);
    if let Some(refusal) = answer::refusal(&decision, OPERATION) {
        return refusal;
    }
    let region = super::region(state, policy, &decision, model_id);
    let mut headers = BEDROCK_RUNTIME.forwarded(&parts.headers, identity.signed_headers());
    record.propagate_trace(&parts.headers, identity.signed_headers(), &mut headers);
    let in_flight = match decision {
        Decision::Admit(admitted) => Some(InFlight::new(
            admitted.hold,
            obs.take(),
            policy.observer.clone(),
        )),
        _ => None,
    };
    let link = Arc::new(Link::default());
    let input = Input {
        client,
        verifier,
        ceiling: ceiling(&caller),
        link: link.clone(),
        auth: policy.auth.clone(),
    };
    let path_and_query = raw_path_and_query(&parts.uri);
    let sent = state
        .upstream
        .open_duplex(&region, path_and_query, &headers, |signer| {
            InputRelay::new(input, signer).boxed_unsync()
        })
        .await;
    match sent {
        Ok(response) => forward::respond(state, policy, OPERATION, in_flight, response, false)
            .map(|body| Body::new(DuplexResponse::new(body, link))),
        Err(e) => forward::unreachable(policy, in_flight, &e, OPERATION),
    }
}

/// The route's `max_tokens_ceiling`, which the session's `sessionStart` is held to.
fn ceiling(caller: &Caller) -> Option<Ceiling> {
    let config = &caller.route.config;
    config.max_tokens_ceiling.map(|max_tokens| Ceiling {
        max_tokens,
        policy: config.max_tokens_policy,
        route: caller.route.name.clone(),
    })
}

pin_project! {
    /// The response of a session: the metered body, ended early with the input's refusal if
    /// the input was refused; dropping it (finished, or the client gone) stops the input.
    struct DuplexResponse {
        #[pin]
        inner: Body,
        link: Arc<Link>,
        #[pin]
        input_failed: WaitForCancellationFutureOwned,
        finished: bool,
        _stop_input: DropGuard,
    }
}

impl DuplexResponse {
    fn new(inner: Body, link: Arc<Link>) -> DuplexResponse {
        DuplexResponse {
            inner,
            input_failed: link.input_failed.clone().cancelled_owned(),
            _stop_input: link.response_done.clone().drop_guard(),
            link,
            finished: false,
        }
    }
}

impl http_body::Body for DuplexResponse {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.finished {
            return Poll::Ready(None);
        }
        let polled = match this.input_failed.as_mut().poll(cx) {
            Poll::Ready(()) => None,
            Poll::Pending => Some(this.inner.as_mut().poll_frame(cx)),
        };
        // The input's refusal wins over what upstream did about the reset it caused.
        if let Some(refusal) = this.link.refusal() {
            *this.finished = true;
            let frame = exception_frame(refusal.code, &refusal.message);
            return Poll::Ready(Some(Ok(Frame::data(frame))));
        }
        match polled {
            Some(Poll::Ready(Some(Err(e)))) => Poll::Ready(Some(Err(e.into()))),
            Some(Poll::Ready(Some(Ok(frame)))) => Poll::Ready(Some(Ok(frame))),
            Some(Poll::Ready(None)) | None => {
                *this.finished = true;
                Poll::Ready(None)
            }
            Some(Poll::Pending) => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
