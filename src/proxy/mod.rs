//! The life of a proxied request, step by step (see ARCHITECTURE.md, "The life of a request"):
//!
//! 1. **Target**: the operation and modelId from the raw path ([`crate::bedrock::Target`]), or
//!    for a sagemaker-runtime call the endpoint and inference component
//!    ([`crate::sagemaker::EndpointTarget`]): a [`Call`]; a path that could name another
//!    resource upstream is refused.
//! 2. **Caller**: who is calling, from the head before any body byte is read, and in sigv4 mode
//!    from the signature over the body too ([`caller`]); the body is read (bounded) in between.
//! 3. **Decide**: [`crate::admission::Admission::decide`] returns a pure [`Decision`].
//! 4. **Answer** a refusal ([`crate::answer`]), or **forward** the request ([`forward`]); a
//!    call its route's learned cap stopped may be sent again with the caller's own `maxTokens`
//!    ([`adaptive_retry`]).
//! 5. **Meter** the response on its way back and settle the reservation ([`meter`]).
//!
//! Every step records what happened through the policy's [`crate::observe::Observer`]: an
//! admitted request's access-log line is written at its settlement, any other request's when
//! its answer is ready. A 429 or 5xx answered to an identified caller whose SDK names the call
//! is remembered ([`crate::admission::retries`]), so that the SDK's retry of that call may use the
//! retry reserve.
//! Only the headers the API defines (and a SigV4 caller signed) go upstream
//! ([`crate::upstream::headers`]). tokengate's own answers to endpoint calls carry
//! sagemaker-runtime's error names ([`crate::sagemaker::error::own_answer`]).
//!
//! Every answer of tokengate's own is in the error shape of the path's clients
//! ([`crate::bedrock::Dialect`]): Bedrock's for the native operations, OpenAI's under `/openai/`
//! and `/v1/`, Anthropic's under `/anthropic/`. The OpenAI and Anthropic APIs take JSON only: a
//! `Content-Type` that says otherwise is refused before the body is read.
//!
//! InvokeModelWithBidirectionalStream takes the same steps from its head alone, its body being
//! the session's events, which stream upstream as they come ([`duplex`], [`relay`]).

pub mod adaptive_retry;
pub mod caller;
pub mod count_tokens;
pub mod duplex;
pub mod forward;
pub mod meter;
pub mod relay;
pub mod usage_reader;

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Request, State},
    response::Response,
};
use bytes::Bytes;
use http::{StatusCode, request::Parts};

use crate::{
    admission::{self, Caller, Decision, Facts, retries::CallId},
    answer,
    bedrock::{Dialect, Operation, Target, TargetError},
    observe::{Observation, Verdict},
    sagemaker::{self, EndpointTarget},
    state::{AppState, Policy},
    upstream::{Upstream, UpstreamError, headers, sagemaker::Service},
};

/// What a request calls: a `bedrock-runtime` operation, or a SageMaker endpoint.
#[derive(Debug)]
pub enum Call {
    Model(Target),
    Endpoint(EndpointTarget),
}

/// Why a request line is not a call tokengate serves.
#[derive(Debug)]
enum CallError {
    Model(TargetError),
    Endpoint(sagemaker::EndpointTargetError),
}

impl Call {
    /// Reads the call from the request line (and the inference component header).
    fn parse(parts: &Parts) -> Result<Call, CallError> {
        let path = parts.uri.path();
        if let Some(endpoint) = EndpointTarget::parse(&parts.method, path, &parts.headers) {
            return endpoint.map(Call::Endpoint).map_err(CallError::Endpoint);
        }
        Target::parse(&parts.method, path)
            .map(Call::Model)
            .map_err(CallError::Model)
    }

    pub fn operation(&self) -> Operation {
        match self {
            Call::Model(t) => t.operation,
            Call::Endpoint(t) => t.operation,
        }
    }

    /// What the access log records as the model: the modelId, or `endpoint[/component]`.
    fn label(&self) -> Option<String> {
        match self {
            Call::Model(t) => t.model_id.clone(),
            Call::Endpoint(t) => Some(match &t.inference_component {
                Some(ic) => format!("{}/{ic}", t.endpoint),
                None => t.endpoint.clone(),
            }),
        }
    }
}

/// Handles every `bedrock-runtime` and `sagemaker-runtime` call.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps each argument twice while the call waits (rust-lang/rust#62958)"
)]
pub fn handle(
    State(state): State<Arc<AppState>>,
    request: Request,
) -> impl Future<Output = Response> {
    async move {
        // One policy generation for the whole request, whatever a reload does meanwhile.
        let policy = state.policy();
        let mut obs = Some(Observation::start());
        let endpoint_call = request
            .uri()
            .path()
            .starts_with(sagemaker::operation::PATH_PREFIX);
        let mut turned_away = None;
        let mut response = proxy(&state, &policy, request, &mut obs, &mut turned_away).await;
        if endpoint_call {
            response = sagemaker::error::own_answer(response);
        }
        if let Some(mut obs) = obs {
            obs.answered(response.status(), response.headers());
            policy.observer.finished(obs);
        }
        let status = response.status();
        if let (Some(Retryable { route, call }), true) = (
            turned_away,
            status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
        ) {
            state
                .rejections
                .record(&route, &call, std::time::Instant::now());
        }
        response
    }
}

/// A call its SDK may retry, and its route: a rejection answered to it vouches for the retry.
pub(super) struct Retryable {
    pub route: Arc<str>,
    pub call: CallId,
}

impl Retryable {
    /// `caller`'s call, if its SDK names it.
    fn of(call: Option<CallId>, caller: &Caller) -> Option<Retryable> {
        call.map(|call| Retryable {
            route: caller.route.name.clone(),
            call,
        })
    }
}

/// Steps 1 to 4; `obs` is taken by an admitted request, whose line is written when it settles;
/// `retryable` is set once the caller is identified, if its SDK names the call.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps each argument twice while the call waits (rust-lang/rust#62958)"
)]
fn proxy(
    state: &AppState,
    policy: &Arc<Policy>,
    request: Request,
    obs: &mut Option<Observation>,
    retryable: &mut Option<Retryable>,
) -> impl Future<Output = Response> {
    async move {
        let (parts, body) = request.into_parts();
        let record = obs.get_or_insert_with(Observation::start);
        policy.observer.began(record, &parts.headers);
        // Until admission decides, an answer refuses the request itself (its path, its
        // credentials, its body), in the error shape of the path's clients.
        record.refused(Verdict::Invalid);
        let dialect = Dialect::of_path(parts.uri.path());
        let call = match Call::parse(&parts) {
            Ok(call) => call,
            Err(CallError::Model(e)) => return answer::target_error(e, dialect),
            Err(CallError::Endpoint(e)) => return answer::endpoint_target_error(&e),
        };
        let operation = call.operation();
        record.target(operation, call.label().as_deref());
        if let Call::Model(target) = &call
            && operation == Operation::InvokeModelWithBidirectionalStream
        {
            let model_id = target.model_id.as_deref();
            return duplex::proxy(state, policy, parts, body, model_id, obs, retryable).await;
        }
        // Who is calling, from the head alone: an unknown caller never gets a body buffered.
        let identity = match caller::identify_head(policy, &parts, operation) {
            Ok(identity) => identity,
            Err(refusal) => return refusal.into_response_in(dialect),
        };
        if let Some(refusal) = declared_not_json(operation, &parts.headers) {
            return refusal;
        }
        let body = match read_body(state, &parts.headers, body, dialect).await {
            Ok(body) => body,
            Err(refusal) => return refusal,
        };
        let call_id = caller::call_id(&parts.headers, Some(&body));
        let (id, rejections) = (call_id.as_ref(), &state.rejections);
        let caller = match caller::identify(policy, &identity, &parts, &body, id, rejections) {
            Ok(caller) => caller,
            Err(refusal) => return refusal.into_response_in(dialect),
        };
        *retryable = Retryable::of(call_id, &caller);
        record.caller(&caller);
        let tier = service_tier(&parts.headers);
        let decision = decide(policy, &call, (&body, tier), &caller, record).await;
        if let Some(refusal) = answer::refusal(&decision, operation) {
            return refusal;
        }
        let (upstream, region) = match destination(state, policy, &call, &decision) {
            Ok(destination) => destination,
            Err(unreachable) => return *unreachable,
        };
        let admitted = match decision {
            Decision::Admit(admitted) => Some(admitted),
            _ => None,
        };
        let mut headers =
            headers::table(operation.api()).forwarded(&parts.headers, identity.signed_headers());
        record.propagate_trace(&parts.headers, identity.signed_headers(), &mut headers);
        let retry = adaptive_retry::Retry::for_call(&caller, &call, tier, &body, &headers);
        let request = forward::Outgoing {
            parts: &parts,
            headers,
            operation,
            region,
            body,
            upstream: &upstream,
            retry,
        };
        forward::forward(state, policy, request, admitted, obs).await
    }
}

/// InvokeModel's service tier header, if sent.
fn service_tier(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(forward::SERVICE_TIER)
        .and_then(|v| v.to_str().ok())
}

/// Where a decided call goes: its upstream ([`upstream_of`]) and Region (its pool's, or for an
/// endpoint its client's); the answer to give when no client can be made.
fn destination(
    state: &AppState,
    policy: &Policy,
    call: &Call,
    decision: &Decision,
) -> Result<(Arc<Upstream>, String), Box<Response>> {
    let upstream = upstream_of(state, call, decision).map_err(|e| {
        let (hint, dialect) = (Default::default(), Dialect::Bedrock);
        Box::new(answer::upstream_unreachable(
            "sagemaker-runtime",
            &e,
            None,
            hint,
            dialect,
        ))
    })?;
    let region = match call {
        Call::Model(target) => region(state, policy, decision, target.model_id.as_deref()),
        // An endpoint's client is its Region's.
        Call::Endpoint(_) => upstream.signer().default_region().to_string(),
    };
    Ok((upstream, region))
}

/// Where a call goes: bedrock-runtime, or the sagemaker-runtime of its endpoint's pool (of
/// `upstream.region` for an endpoint in no pool).
fn upstream_of(
    state: &AppState,
    call: &Call,
    decision: &Decision,
) -> Result<Arc<Upstream>, UpstreamError> {
    if let Call::Model(_) = call {
        return Ok(state.upstream.clone());
    }
    match decision.pool().and_then(|p| p.endpoint_config()) {
        Some(e) => state
            .sagemaker
            .client(Service::Runtime, &e.runtime, &e.region),
        None => state.sagemaker.default_runtime(),
    }
}

/// Step 3: admission decides, and the observer counts it. The OpenAI and Anthropic APIs name
/// their model in the body: admission's one pass reads it, and the record takes it.
/// `service_tier` is the request's `X-Amzn-Bedrock-Service-Tier` header, as plain data.
async fn decide(
    policy: &Policy,
    call: &Call,
    (body, service_tier): (&Bytes, Option<&str>),
    caller: &Caller,
    record: &mut Observation,
) -> Decision {
    let operation = call.operation();
    let (model_id, endpoint) = match call {
        Call::Model(t) => (t.model_id.as_deref(), None),
        Call::Endpoint(t) => (None, Some(t)),
    };
    let read = operation
        .model_in_body()
        .then(|| admission::read_body(operation, body));
    let in_body = read
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .and_then(|facts| facts.api.as_ref())
        .map(|api| api.model.as_str());
    if let Some(model) = in_body {
        record.target(operation, Some(model));
    }
    let decision = policy
        .admission
        .decide(&Facts {
            operation,
            model_id,
            body,
            read: read.as_ref(),
            caller,
            service_tier,
            endpoint,
        })
        .await;
    policy.observer.decided(record, &decision);
    decision
}

/// An OpenAI or Anthropic API request with a `Content-Type` that says its body is not JSON
/// (absent, it is read as JSON; every one sent must say JSON).
fn declared_not_json(operation: Operation, headers: &http::HeaderMap) -> Option<Response> {
    if !operation.model_in_body() {
        return None;
    }
    headers
        .get_all(http::header::CONTENT_TYPE)
        .iter()
        .map(|declared| String::from_utf8_lossy(declared.as_bytes()).into_owned())
        .find(|text| {
            let essence = text.split(';').next().unwrap_or("").trim();
            !essence.eq_ignore_ascii_case("application/json")
        })
        .map(|text| answer::not_json(operation, &text))
}

/// Reads the whole request body, within `server.max_body_bytes`, the buffered-body budget
/// (`server.max_buffered_body_bytes`, the bytes carry their charge until the last copy is dropped)
/// and `server.body_read_timeout_secs`. A client that sends a head and then trickles (or stalls)
/// its body holds a connection but never a reservation. Refusals speak `dialect`.
async fn read_body(
    state: &AppState,
    headers: &http::HeaderMap,
    body: Body,
    dialect: Dialect,
) -> Result<Bytes, Response> {
    let read = state.body_budget.read(body, headers, state.max_body_bytes);
    match tokio::time::timeout(state.body_read_timeout, read).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(e.into_bedrock().into_response_in(dialect)),
        Err(_) => Err(answer::body_timeout(state.body_read_timeout, dialect)),
    }
}

/// The Region a decided request goes to: its pool's (the one it was admitted in), else
/// `upstream.region` ([`crate::admission::Admission::region_of`]).
pub(super) fn region(
    state: &AppState,
    policy: &Policy,
    decision: &Decision,
    model_id: Option<&str>,
) -> String {
    policy
        .admission
        .region_of(decision, model_id)
        .unwrap_or_else(|| state.upstream.signer().default_region().to_string())
}
