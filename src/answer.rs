//! The one map from what was decided (and what upstream did) to the answer the client gets:
//! status, `x-amzn-ErrorType`, a message that says what to change, and for what retrying can
//! cure, the retry hint headers and tokengate's own `x-tokengate-reason` / `x-tokengate-pool`.
//!
//! The body takes the shape the request's API speaks ([`Dialect`]): Bedrock's `{"message"}`, or
//! the OpenAI and Anthropic APIs' own error objects, which their SDKs read. The retry hint goes in
//! every header a client of any of them obeys: `x-amz-retry-after` (ms: the AWS SDKs),
//! `retry-after-ms` (ms: the OpenAI and Anthropic SDKs read it first), `Retry-After` (s), and
//! `x-should-retry: true` (which those two SDKs obey over their own rules).
//!
//! The `match` over [`Decision`] is exhaustive: a new decision cannot reach the wire unanswered.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{
    admission::{
        BudgetScope, Decision, Invalid, MissingMaxTokens, NeverFits, NotAllowed, Problem,
        QueueRefusal, Throttle, ThrottleWhy, Unavailability, Unavailable, hint,
    },
    bedrock::{
        BedrockError, Dialect, ErrorCode, Operation, TargetError, api, max_tokens::cap_field_name,
    },
    ledger::Limit,
    sagemaker::EndpointTargetError,
};

pub const X_TOKENGATE_REASON: HeaderName = HeaderName::from_static("x-tokengate-reason");
pub const X_TOKENGATE_POOL: HeaderName = HeaderName::from_static("x-tokengate-pool");
const X_AMZ_RETRY_AFTER: HeaderName = HeaderName::from_static("x-amz-retry-after");
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

/// The answer to a request of `operation` admission did not admit; `None` for decisions that go
/// upstream (admitted, passed).
pub fn refusal(decision: &Decision, operation: Operation) -> Option<Response> {
    let error = match decision {
        Decision::Admit(_) | Decision::Pass(_) => return None,
        Decision::Throttle(t) => throttle(t),
        Decision::NeverFits(n) => never_fits(n, operation),
        Decision::NotAllowed(n) => not_allowed(n),
        Decision::Invalid(i) => invalid(i, operation),
        Decision::UnknownModel { model } => BedrockError::validation(format!(
            "tokengate has no quota pool for model {model:?}: add it to the models list of a [[pools]] entry, \
             or set [admission] unknown_models = \"pass\" to forward unknown models uncounted"
        )),
        Decision::UnknownEndpoint {
            endpoint,
            inference_component,
        } => unknown_endpoint(endpoint, inference_component.as_deref()),
        Decision::Unavailable(u) => unavailable(u),
    };
    Some(error.into_response_in(operation.api().dialect()))
}

fn throttle(t: &Throttle) -> BedrockError {
    let name = &*t.pool.name;
    let message = match &t.why {
        ThrottleWhy::NoRoom {
            reserving,
            available,
            in_flight,
        } => match t.limit {
            Limit::Tokens => format!(
                "Too many tokens: this request reserves {reserving} tokens and pool {name:?} has {available} available now; retry after the hinted delay"
            ),
            Limit::Requests => format!(
                "Too many requests: pool {name:?} is at its requests-per-minute limit; retry after the hinted delay"
            ),
            Limit::Concurrency => format!(
                "Too many concurrent requests: pool {name:?} has all {in_flight} slots in use; retry after the hinted delay"
            ),
            Limit::Share => format!(
                "Too many tokens for this route: it has used its max_share of pool {name:?}; retry after the hinted delay"
            ),
            Limit::DailyQuota => format!(
                "Too many tokens per day: this request reserves {reserving} tokens and pool {name:?} has {available} left of its daily quota (tokens_per_day); retry after the hinted delay, when the day has refilled enough"
            ),
            Limit::Budget => format!(
                "Too many tokens for this route's budget: this request reserves {reserving} tokens and {available} are left; retry after the hinted delay"
            ),
            Limit::RouteConcurrency => format!(
                "Too many concurrent requests for this route: it has all {in_flight} of its max_concurrency in flight; retry after the hinted delay"
            ),
        },
        ThrottleWhy::Budget {
            scope,
            window,
            reserving,
            available,
        } => match scope {
            BudgetScope::Account => format!(
                "Too many tokens per day across the account: this request reserves {reserving} tokens and {available} are left of admission.account_tokens_per_day; retry after the hinted delay, when the day has refilled enough"
            ),
            BudgetScope::Route(route) => format!(
                "Too many tokens for route {route:?}: this request reserves {reserving} tokens and {available} are left of its budgets.{window}; retry after the hinted delay"
            ),
        },
        ThrottleWhy::Queue(refusal) => {
            let why = match refusal {
                QueueRefusal::Full => "the admission queue is full",
                QueueRefusal::ProjectedTooLong => {
                    "its projected wait is longer than the pool's max_wait"
                }
                QueueRefusal::TimedOut { .. } => {
                    "it waited the pool's max_wait without room appearing"
                }
            };
            format!(
                "Too many {} in pool {name:?}: the request was not queued or not admitted because {why}; retry after the hinted delay",
                limit_noun(t.limit)
            )
        }
    };
    retryable(ErrorCode::Throttling, message, t.hint)
        .with_header(X_TOKENGATE_REASON, t.reason())
        .with_header(X_TOKENGATE_POOL, name)
}

fn unknown_endpoint(endpoint: &str, component: Option<&str>) -> BedrockError {
    let (what, keys) = match component {
        Some(ic) => (
            format!("endpoint {endpoint:?} with inference component {ic:?}"),
            format!("endpoint = {endpoint:?} and inference_component = {ic:?}"),
        ),
        None => (
            format!("endpoint {endpoint:?} (no inference component)"),
            format!("endpoint = {endpoint:?} and no inference_component"),
        ),
    };
    BedrockError::validation(format!(
        "tokengate has no endpoint pool for {what}: add an [[endpoints]] entry with {keys}, \
         or set [admission] unknown_models = \"pass\" to forward it uncounted"
    ))
}

fn limit_noun(limit: Limit) -> &'static str {
    match limit {
        Limit::Tokens => "tokens",
        Limit::Requests => "requests",
        Limit::Concurrency => "concurrent requests",
        Limit::Share => "tokens of its route's max_share",
        Limit::DailyQuota => "tokens of its daily quota",
        Limit::Budget => "tokens of its route's budget",
        Limit::RouteConcurrency => "concurrent requests of its route",
    }
}

fn never_fits(n: &NeverFits, operation: Operation) -> BedrockError {
    let name = &*n.pool.name;
    let fits = n.capacity.saturating_sub(n.input);
    if n.pool.endpoint_config().is_some() {
        return BedrockError::validation(format!(
            "this request may generate {} tokens but endpoint pool {name:?} generates at most {} a minute with the copies \
             serving now (its token envelope), so it cannot be admitted; set max_tokens (or parameters.max_new_tokens) \
             to at most {fits}",
            n.max_tokens, n.capacity
        ))
        .with_header(X_TOKENGATE_POOL, name);
    }
    let cap = cap_field_name(operation);
    let advice = match n.max_tokens_missing {
        Some(MissingMaxTokens::ReserveModelMax) => format!(
            "it names no maximum output, so it reserves the model's maximum ({} tokens) as Bedrock does: send {cap} of at most {fits}",
            n.max_tokens
        ),
        Some(_) => format!(
            "it names no maximum output and tokengate set {}: send {cap} of at most {fits}",
            n.max_tokens
        ),
        None => format!("set {cap} to at most {fits}"),
    };
    BedrockError::validation(format!(
        "this request reserves {} tokens (about {} input + {} maxTokens) but pool {name:?} holds at most {} \
         tokens per minute, so it can never be admitted; {advice}, or shorten the input",
        n.reserving, n.input, n.max_tokens, n.capacity
    ))
    .with_header(X_TOKENGATE_POOL, name)
    .with_header(X_SHOULD_RETRY, "false")
}

fn not_allowed(n: &NotAllowed) -> BedrockError {
    BedrockError::new(
        ErrorCode::AccessDenied,
        format!(
            "route {:?} is not allowed to call model {:?}: add it to the route's models list in the tokengate config",
            n.route, n.model
        ),
    )
}

fn invalid(i: &Invalid, operation: Operation) -> BedrockError {
    let message = match &i.problem {
        // The ceiling in the field the caller's API names.
        Problem::AboveCeiling {
            max_tokens,
            ceiling,
            route,
        } if operation.model_in_body() => {
            let cap = cap_field_name(operation);
            format!(
                "{cap} {max_tokens} is above the ceiling of {ceiling} that tokengate route {route:?} allows; \
                 set {cap} to at most {ceiling}"
            )
        }
        problem => problem.to_string(),
    };
    BedrockError::validation(message)
}

fn unavailable(u: &Unavailable) -> BedrockError {
    let message = match &u.cause {
        Unavailability::Ledger { .. } => "the quota ledger is unavailable; retry shortly",
        Unavailability::ShuttingDown { .. } => "tokengate is shutting down; retry",
    };
    retryable(ErrorCode::ServiceUnavailable, message.to_string(), u.hint)
        .with_header(X_TOKENGATE_POOL, &*u.pool.name)
}

/// A retryable error carrying `hint` in every retry header (see the module doc).
pub fn retryable(code: ErrorCode, message: String, hint: Duration) -> BedrockError {
    retry_headers(hint)
        .into_iter()
        .fold(BedrockError::new(code, message), |e, (name, value)| {
            e.with_header(name, value)
        })
}

/// The retry headers of `hint`: `x-amz-retry-after`, `retry-after-ms`, `Retry-After`,
/// `x-should-retry`.
fn retry_headers(hint: Duration) -> [(HeaderName, String); 4] {
    let (ms, secs) = hint::header_values(hint);
    [
        (X_AMZ_RETRY_AFTER, ms.clone()),
        (RETRY_AFTER_MS, ms),
        (http::header::RETRY_AFTER, secs),
        (X_SHOULD_RETRY, "true".to_string()),
    ]
}

/// Upstream throttled a request this proxy admitted: pass its 429 on, with a hint if it gave
/// none, and say it was upstream's.
pub fn upstream_throttled(headers: &mut HeaderMap, hint: Duration) {
    let has_hint = [
        &X_AMZ_RETRY_AFTER,
        &RETRY_AFTER_MS,
        &http::header::RETRY_AFTER,
    ]
    .iter()
    .any(|h| headers.contains_key(*h));
    if !has_hint {
        for (name, value) in retry_headers(hint) {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        }
    }
    headers.insert(X_TOKENGATE_REASON, HeaderValue::from_static("upstream"));
}

/// Upstream refused an admitted request on its daily quota: pass its 429 on, with a hint if it
/// gave none, and say which quota.
pub fn upstream_daily_throttled(headers: &mut HeaderMap, hint: Duration) {
    upstream_throttled(headers, hint);
    headers.insert(X_TOKENGATE_REASON, HeaderValue::from_static("daily_quota"));
}

/// No answer from `service` (`bedrock-runtime`, `sagemaker-runtime`): a retryable 503 (with a
/// hint when the request was admitted in a pool).
pub fn upstream_unreachable(
    service: &str,
    error: &dyn std::fmt::Display,
    pool: Option<&str>,
    hint: Duration,
    dialect: Dialect,
) -> Response {
    let message = format!("tokengate could not get an answer from {service}: {error}");
    match pool {
        None => BedrockError::new(ErrorCode::ServiceUnavailable, message),
        Some(pool) => retryable(ErrorCode::ServiceUnavailable, message, hint)
            .with_header(X_TOKENGATE_POOL, pool),
    }
    .into_response_in(dialect)
}

/// A path that is not a `bedrock-runtime` operation, or a bad modelId in it, answered in the
/// dialect of the path's clients.
pub fn target_error(e: TargetError, dialect: Dialect) -> Response {
    match e {
        TargetError::UnknownOperation { .. } => BedrockError::new(
            ErrorCode::UnknownOperation,
            format!(
                "{e}; tokengate serves the bedrock-runtime API here: {}",
                api::served_paths(dialect)
            ),
        ),
        TargetError::EmptyModelId | TargetError::BadModelIdEncoding => {
            BedrockError::validation(format!(
                "{e}; send the modelId percent-encoded once, as the AWS SDKs do (':' as %3A, '/' as %2F)"
            ))
        }
        TargetError::UnsafePath { .. } => BedrockError::validation(e.to_string()),
    }
    .into_response_in(dialect)
}

/// An OpenAI or Anthropic API request whose body is declared as something other than JSON.
pub fn not_json(operation: Operation, content_type: &str) -> Response {
    BedrockError::validation(format!(
        "{operation} takes a JSON body, but the request's Content-Type is {content_type:?}; \
         send Content-Type: application/json"
    ))
    .into_response_in(operation.api().dialect())
}

/// A path under `/endpoints/` that is not a call tokengate forwards, or a bad endpoint or
/// inference component name.
pub fn endpoint_target_error(e: &EndpointTargetError) -> Response {
    match e {
        EndpointTargetError::UnknownOperation { .. } => {
            BedrockError::new(ErrorCode::UnknownOperation, e.to_string())
        }
        EndpointTargetError::BadEndpointName(_) | EndpointTargetError::BadInferenceComponent(_) => {
            BedrockError::validation(e.to_string())
        }
    }
    .into_response()
}

/// A streaming operation called over HTTP/1.1.
pub fn needs_http2(operation: Operation) -> Response {
    BedrockError::validation(format!(
        "{operation} needs HTTP/2: it streams events both ways at once. Use an HTTP/2 client (the \
         AWS SDKs' default for this operation; h2c with prior knowledge over plain HTTP)."
    ))
    .into_response()
}

/// A caller with no route in the config.
pub fn no_route() -> BedrockError {
    BedrockError::new(
        ErrorCode::AccessDenied,
        "tokengate has no route for this caller",
    )
}

/// The request body did not arrive within `server.body_read_timeout_secs`.
pub fn body_timeout(after: Duration, dialect: Dialect) -> Response {
    BedrockError::validation(format!(
        "the request body did not arrive within {} s, the limit set by [server] body_read_timeout_secs; send the whole body at once",
        after.as_secs()
    ))
    .into_response_in(dialect)
}
