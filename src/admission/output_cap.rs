//! The output cap a request carries upstream, and so reserves.
//!
//! Bedrock deducts `input + maxTokens` at the start of a call, and when the call names no
//! `maxTokens`, `input + the model's maximum output`. So what is reserved here follows what
//! upstream will read:
//!
//! - **A route's `max_tokens_ceiling`**: a request above it is refused (`policy = "reject"`) or
//!   its body rewritten with the ceiling (`"clamp"`); a request that names no `maxTokens` gets the
//!   ceiling written in (whatever the policy), and reserves it.
//! - **A request that names none** (and no route ceiling applies): the pool's
//!   `when_max_tokens_missing` decides. `reserve_model_max` (the default) reserves the model's
//!   maximum output, as Bedrock does; `inject` writes the pool's `default_max_tokens` into the
//!   forwarded body (per API and model family, through the same rewrite as the ceiling) and
//!   reserves that, so Bedrock reserves the same; `reject` refuses it with a
//!   `ValidationException` naming the field to send. A body whose model family tokengate cannot
//!   write a field for (an unknown provider) falls back to `reserve_model_max`.
//!
//! An InvokeModelWithBidirectionalStream session names its `maxTokens` in its `sessionStart`
//! event, which arrives after admission: it reserves the pool's `bidirectional_reservation`
//! (capped by the route's ceiling), and neither rule above applies to it here.
//!
//! The rewrite is the one case where the proxy re-serialises a body. (A `maxTokens` named twice
//! never gets here: [`super::body`] refuses it.)

use bytes::Bytes;
use serde_json::Value;

use super::{Estimate, Problem, Route};
use crate::{
    bedrock::{
        ModelRef, Operation,
        max_tokens::{clamp_max_tokens, field_to_set},
    },
    config::{MaxTokensPolicy, PoolConfig, WhenMaxTokensMissing},
};

/// What was done with a request that named no `maxTokens`: the `action` label of
/// `tokengate_max_tokens_missing_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingMaxTokens {
    /// The route's `max_tokens_ceiling` was written in.
    RouteCeiling,
    /// The model's maximum output was reserved.
    ReserveModelMax,
    /// The pool's `default_max_tokens` was written in.
    Inject,
    /// Refused (`when_max_tokens_missing = "reject"`).
    Reject,
}

impl MissingMaxTokens {
    pub const ALL: [MissingMaxTokens; 4] = [
        MissingMaxTokens::RouteCeiling,
        MissingMaxTokens::ReserveModelMax,
        MissingMaxTokens::Inject,
        MissingMaxTokens::Reject,
    ];

    pub fn label(self) -> &'static str {
        match self {
            MissingMaxTokens::RouteCeiling => "route_ceiling",
            MissingMaxTokens::ReserveModelMax => WhenMaxTokensMissing::ReserveModelMax.label(),
            MissingMaxTokens::Inject => WhenMaxTokensMissing::Inject.label(),
            MissingMaxTokens::Reject => WhenMaxTokensMissing::Reject.label(),
        }
    }
}

/// What the request asks for, as the cap sees it.
pub(super) struct Asked<'a> {
    pub operation: Operation,
    pub model: &'a ModelRef<'a>,
    pub body: &'a Bytes,
    /// The `maxTokens` the body names, `None` if it names none.
    pub max_tokens: Option<u64>,
}

/// The body to forward instead of the caller's, when it was rewritten.
#[derive(Debug, Default)]
pub(super) struct Capped {
    pub body: Option<Bytes>,
    /// Lowered (or set) to the route's ceiling.
    pub clamped: bool,
}

/// A value to write into the body: the route's ceiling, or the pool's default.
struct Write {
    value: u64,
    ceiling: bool,
}

/// Applies the route's ceiling and the pool's `when_max_tokens_missing` to `estimate` (its
/// `max_tokens` and `max_tokens_missing`); returns the rewritten body, if any.
pub(super) fn apply(
    route: &Route,
    pool: &PoolConfig,
    asked: &Asked<'_>,
    estimate: &mut Estimate,
) -> Result<Capped, Problem> {
    let ceiling = route.config.max_tokens_ceiling;
    if asked.operation == Operation::InvokeModelWithBidirectionalStream {
        // Its `sessionStart` event (with any maxTokens) arrives after admission: the session
        // reserves the pool's `bidirectional_reservation`, capped by the ceiling here, and the
        // ceiling is applied to that event as it passes ([`crate::proxy::duplex`]).
        if let Some(c) = ceiling {
            estimate.max_tokens = estimate.max_tokens.min(c);
        }
        return Ok(Capped::default());
    }
    let write = match (asked.max_tokens, ceiling) {
        (Some(n), Some(c)) if n > c => {
            if route.config.max_tokens_policy == MaxTokensPolicy::Reject {
                return Err(Problem::AboveCeiling {
                    max_tokens: n,
                    ceiling: c,
                    route: route.name.clone(),
                });
            }
            Write {
                value: c,
                ceiling: true,
            }
        }
        (Some(_), _) => return Ok(Capped::default()),
        (None, Some(c)) => {
            estimate.max_tokens_missing = Some(MissingMaxTokens::RouteCeiling);
            Write {
                value: c,
                ceiling: true,
            }
        }
        (None, None) => match missing(pool, asked, estimate)? {
            Some(write) => write,
            None => return Ok(Capped::default()),
        },
    };
    match rewrite(asked, write.value) {
        Ok(body) => {
            estimate.max_tokens = write.value;
            Ok(Capped {
                body: Some(body),
                clamped: write.ceiling,
            })
        }
        Err(reason) if write.ceiling => Err(Problem::CannotClamp {
            ceiling: write.value,
            reason,
        }),
        // No field to write for this family: reserve what Bedrock will.
        Err(_) => {
            reserve_model_max(pool, estimate);
            Ok(Capped::default())
        }
    }
}

/// The pool's answer to a request that names no `maxTokens`: a value to write in, nothing to
/// write (the model maximum is reserved), or the refusal.
fn missing(
    pool: &PoolConfig,
    asked: &Asked<'_>,
    estimate: &mut Estimate,
) -> Result<Option<Write>, Problem> {
    match pool.when_max_tokens_missing {
        WhenMaxTokensMissing::ReserveModelMax => {
            reserve_model_max(pool, estimate);
            Ok(None)
        }
        WhenMaxTokensMissing::Inject => {
            estimate.max_tokens_missing = Some(MissingMaxTokens::Inject);
            Ok(Some(Write {
                value: pool.default_max_tokens,
                ceiling: false,
            }))
        }
        WhenMaxTokensMissing::Reject => {
            let json: Option<Value> = serde_json::from_slice(asked.body).ok();
            let field = field_to_set(asked.operation, asked.model.provider(), json.as_ref());
            Err(Problem::MaxTokensMissing {
                field: field.unwrap_or("the maxTokens field of its model family"),
                pool: pool.name.clone(),
                model_max: pool.max_output_tokens,
            })
        }
    }
}

fn reserve_model_max(pool: &PoolConfig, estimate: &mut Estimate) {
    estimate.max_tokens = pool.max_output_tokens;
    estimate.max_tokens_missing = Some(MissingMaxTokens::ReserveModelMax);
}

/// The caller's body with its output cap set to `value`.
fn rewrite(asked: &Asked<'_>, value: u64) -> Result<Bytes, String> {
    let mut json: Value =
        serde_json::from_slice(asked.body).map_err(|e| format!("the body is not JSON ({e})"))?;
    clamp_max_tokens(asked.operation, asked.model.provider(), &mut json, value)
        .map_err(|e| e.to_string())?;
    serde_json::to_vec(&json)
        .map(Bytes::from)
        .map_err(|e| e.to_string())
}
