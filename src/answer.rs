//! The one map from what was decided (and what upstream did) to the Bedrock-shaped answer the
//! client gets: status, `x-amzn-ErrorType`, a message that says what to change, and for what
//! retrying can cure, the retry hint headers (`x-amz-retry-after` in milliseconds, `Retry-After`
//! in seconds) and tokengate's own `x-tokengate-reason` / `x-tokengate-pool`.
//!
//! The `match` over [`Decision`] is exhaustive: a new decision cannot reach the wire unanswered.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{
    admission::{
        BudgetScope, Decision, Invalid, MissingMaxTokens, NeverFits, NotAllowed, QueueRefusal,
        Throttle, ThrottleWhy, Unavailability, Unavailable, hint,
    },
    bedrock::{BedrockError, ErrorCode, Operation, TargetError},
    ledger::Limit,
};

pub const X_TOKENGATE_REASON: HeaderName = HeaderName::from_static("x-tokengate-reason");
pub const X_TOKENGATE_POOL: HeaderName = HeaderName::from_static("x-tokengate-pool");
const X_AMZ_RETRY_AFTER: HeaderName = HeaderName::from_static("x-amz-retry-after");

/// The answer to a request admission did not admit; `None` for decisions that go upstream
/// (admitted, passed).
pub fn refusal(decision: &Decision) -> Option<Response> {
    let error = match decision {
        Decision::Admit(_) | Decision::Pass(_) => return None,
        Decision::Throttle(t) => throttle(t),
        Decision::NeverFits(n) => never_fits(n),
        Decision::NotAllowed(n) => not_allowed(n),
        Decision::Invalid(i) => invalid(i),
        Decision::UnknownModel { model } => BedrockError::validation(format!(
            "tokengate has no quota pool for model {model:?}: add it to the models list of a [[pools]] entry, \
             or set [admission] unknown_models = \"pass\" to forward unknown models uncounted"
        )),
        Decision::Unavailable(u) => unavailable(u),
    };
    Some(error.into_response())
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

fn limit_noun(limit: Limit) -> &'static str {
    match limit {
        Limit::Tokens => "tokens",
        Limit::Requests => "requests",
        Limit::Concurrency => "concurrent requests",
        Limit::Share => "tokens of its route's max_share",
        Limit::DailyQuota => "tokens of its daily quota",
        Limit::Budget => "tokens of its route's budget",
    }
}

fn never_fits(n: &NeverFits) -> BedrockError {
    let name = &*n.pool.name;
    let fits = n.capacity.saturating_sub(n.input);
    let cap = match n.max_tokens_missing {
        Some(MissingMaxTokens::ReserveModelMax) => format!(
            "it names no maximum output, so it reserves the model's maximum ({} tokens) as Bedrock does; send maxTokens (or your model family's output-cap field) of at most {fits}",
            n.max_tokens
        ),
        Some(_) => format!(
            "it names no maximum output and tokengate set {}; send maxTokens of at most {fits}",
            n.max_tokens
        ),
        None => format!("set maxTokens to at most {fits}"),
    };
    BedrockError::validation(format!(
        "this request reserves {} tokens (about {} input + {} maxTokens) but pool {name:?} holds at most {} \
         tokens per minute, so it can never be admitted: {cap}, or shorten the input",
        n.reserving, n.input, n.max_tokens, n.capacity
    ))
    .with_header(X_TOKENGATE_POOL, name)
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

fn invalid(i: &Invalid) -> BedrockError {
    BedrockError::validation(i.problem.to_string())
}

fn unavailable(u: &Unavailable) -> BedrockError {
    let message = match &u.cause {
        Unavailability::Ledger { .. } => "the quota ledger is unavailable; retry shortly",
        Unavailability::ShuttingDown { .. } => "tokengate is shutting down; retry",
    };
    retryable(ErrorCode::ServiceUnavailable, message.to_string(), u.hint)
        .with_header(X_TOKENGATE_POOL, &*u.pool.name)
}

/// A retryable error carrying `hint` as `x-amz-retry-after` (ms) and `Retry-After` (s).
pub fn retryable(code: ErrorCode, message: String, hint: Duration) -> BedrockError {
    let (ms, secs) = hint::header_values(hint);
    BedrockError::new(code, message)
        .with_header(X_AMZ_RETRY_AFTER, ms)
        .with_header(http::header::RETRY_AFTER, secs)
}

/// Upstream throttled a request this proxy admitted: pass its 429 on, with a hint if it gave
/// none, and say it was upstream's.
pub fn upstream_throttled(headers: &mut HeaderMap, hint: Duration) {
    if !headers.contains_key(X_AMZ_RETRY_AFTER) {
        let (ms, secs) = hint::header_values(hint);
        for (name, value) in [(X_AMZ_RETRY_AFTER, ms), (http::header::RETRY_AFTER, secs)] {
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

/// No answer from upstream: a retryable 503 (with a hint when the request was admitted in a
/// pool).
pub fn upstream_unreachable(
    error: &dyn std::fmt::Display,
    pool: Option<&str>,
    hint: Duration,
) -> Response {
    let message = format!("tokengate could not get an answer from bedrock-runtime: {error}");
    match pool {
        None => BedrockError::new(ErrorCode::ServiceUnavailable, message),
        Some(pool) => retryable(ErrorCode::ServiceUnavailable, message, hint)
            .with_header(X_TOKENGATE_POOL, pool),
    }
    .into_response()
}

/// A path that is not a `bedrock-runtime` operation, or a bad modelId in it.
pub fn target_error(e: TargetError) -> Response {
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
pub fn body_timeout(after: Duration) -> Response {
    BedrockError::validation(format!(
        "the request body did not arrive within {} s, the limit set by [server] body_read_timeout_secs; send the whole body at once",
        after.as_secs()
    ))
    .into_response()
}
