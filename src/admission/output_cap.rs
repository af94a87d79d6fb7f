//! The output cap a request carries upstream, and so reserves.
//!
//! Bedrock deducts `input + maxTokens` at the start of a call, and when the call names no
//! `maxTokens`, `input + the model's maximum output`. So what is reserved here follows what
//! upstream will read:
//!
//! - **A route's `max_tokens_ceiling`** ([`super::ceiling`]): a request above it is refused or
//!   lowered to it; one that names no `maxTokens` gets the ceiling written in, and reserves it.
//! - **A request that names none** (and no route ceiling applies): the pool's
//!   `when_max_tokens_missing` decides. `reserve_model_max` (the default) reserves the model's
//!   maximum output (the catalogue's or the pool's `max_output_tokens`), as Bedrock does;
//!   `inject` writes the pool's `default_max_tokens` into the forwarded body (in the field of the
//!   operation and model family, through [`super::rewrite`], the same edit as the ceiling's) and
//!   reserves that, so Bedrock reserves the same; `reject` refuses it with a
//!   `ValidationException` naming the field to send. A family tokengate has no field for (an
//!   unknown provider) falls back to `reserve_model_max`.
//!
//! An InvokeModelWithBidirectionalStream session names its `maxTokens` in its `sessionStart`
//! event, after admission: it reserves the pool's `bidirectional_reservation` (capped by the
//! route's ceiling) and neither rule above applies to it here.

use bytes::Bytes;
use serde_json::Value;

use super::{Estimate, Problem, Route, ceiling};
use crate::{
    bedrock::{ModelRef, Operation, max_tokens::field_to_set},
    config::{PoolConfig, WhenMaxTokensMissing},
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
    /// The cap a route's `adaptive_max_tokens` learned was written in ([`super::adaptive`]),
    /// below what the rules above would have reserved.
    AdaptiveCap,
}

impl MissingMaxTokens {
    pub const ALL: [MissingMaxTokens; 5] = [
        MissingMaxTokens::RouteCeiling,
        MissingMaxTokens::ReserveModelMax,
        MissingMaxTokens::Inject,
        MissingMaxTokens::Reject,
        MissingMaxTokens::AdaptiveCap,
    ];

    pub fn label(self) -> &'static str {
        match self {
            MissingMaxTokens::RouteCeiling => "route_ceiling",
            MissingMaxTokens::ReserveModelMax => WhenMaxTokensMissing::ReserveModelMax.label(),
            MissingMaxTokens::Inject => WhenMaxTokensMissing::Inject.label(),
            MissingMaxTokens::Reject => WhenMaxTokensMissing::Reject.label(),
            MissingMaxTokens::AdaptiveCap => "adaptive_cap",
        }
    }
}

/// What the request asks for, as the cap sees it.
pub(super) struct Asked<'a> {
    pub operation: Operation,
    pub model: &'a ModelRef<'a>,
    pub body: &'a Bytes,
    /// The `maxTokens` the body names, if any.
    pub max_tokens: Option<u64>,
}

/// The output cap to write into the forwarded body, if any.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct OutputCap {
    pub write: Option<u64>,
    /// Lowered (or set) to the route's ceiling.
    pub clamped: bool,
}

/// Applies the route's ceiling and the pool's `when_max_tokens_missing` to `estimate` (its
/// `max_tokens` and `max_tokens_missing`); returns the cap to write, if any.
pub(super) fn apply(
    route: &Route,
    pool: &PoolConfig,
    asked: &Asked<'_>,
    estimate: &mut Estimate,
) -> Result<OutputCap, Problem> {
    if let Some(ceiling) = ceiling::apply(route, asked.operation, asked.max_tokens, estimate)? {
        if asked.max_tokens.is_none() {
            estimate.max_tokens_missing = Some(MissingMaxTokens::RouteCeiling);
        }
        return Ok(OutputCap {
            write: Some(ceiling),
            clamped: true,
        });
    }
    if asked.max_tokens.is_some()
        || asked.operation == Operation::InvokeModelWithBidirectionalStream
    {
        return Ok(OutputCap::default());
    }
    let provider = asked.model.provider();
    match pool.when_max_tokens_missing {
        WhenMaxTokensMissing::Inject if field_to_set(asked.operation, provider, None).is_some() => {
            estimate.max_tokens = pool.default_max_tokens;
            estimate.max_tokens_missing = Some(MissingMaxTokens::Inject);
            Ok(OutputCap {
                write: Some(pool.default_max_tokens),
                clamped: false,
            })
        }
        WhenMaxTokensMissing::Reject => {
            let json: Option<Value> = serde_json::from_slice(asked.body).ok();
            let field = field_to_set(asked.operation, provider, json.as_ref());
            Err(Problem::MaxTokensMissing {
                field: field.unwrap_or("the maxTokens field of its model family"),
                pool: pool.name.clone(),
                model_max: pool.max_output_tokens,
            })
        }
        // Reserve what Bedrock will (also for `inject` where no field can be written).
        _ => {
            estimate.max_tokens = pool.max_output_tokens;
            estimate.max_tokens_missing = Some(MissingMaxTokens::ReserveModelMax);
            Ok(OutputCap::default())
        }
    }
}
