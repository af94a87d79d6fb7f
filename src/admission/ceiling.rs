//! A route's `max_tokens_ceiling`, applied to what upstream will read: a request above it is
//! refused (`policy = "reject"`), or its body rewritten with the ceiling (`"clamp"`), the one case
//! where the proxy re-serialises a body. A request that names no `maxTokens` gets the ceiling
//! written in (whatever the policy), and reserves it: Bedrock would otherwise reserve, and allow,
//! the model's maximum. (A `maxTokens` named twice never gets here: [`super::body`] refuses it.)
//!
//! An InvokeModelWithBidirectionalStream session names its `maxTokens` in its `sessionStart`
//! event, which arrives after admission: the ceiling only caps its reservation here, and is
//! applied to that event as it passes ([`crate::proxy::duplex`]).

use bytes::Bytes;
use serde_json::Value;

use super::{Estimate, Problem, Route};
use crate::{
    bedrock::{ModelRef, Operation, max_tokens::clamp_max_tokens},
    config::MaxTokensPolicy,
};

/// What the request asks for, as the ceiling sees it.
pub(super) struct Asked<'a> {
    pub operation: Operation,
    pub model: &'a ModelRef<'a>,
    pub body: &'a Bytes,
    /// The `maxTokens` the body names, `None` if it names none.
    pub max_tokens: Option<u64>,
}

/// Applies the route's ceiling to `estimate`; returns the body to forward instead of the
/// caller's when it was rewritten.
pub(super) fn apply(
    route: &Route,
    asked: &Asked<'_>,
    estimate: &mut Estimate,
) -> Result<Option<Bytes>, Problem> {
    let Some(ceiling) = route.config.max_tokens_ceiling else {
        return Ok(None);
    };
    if asked.operation == Operation::InvokeModelWithBidirectionalStream {
        estimate.max_tokens = estimate.max_tokens.min(ceiling);
        return Ok(None);
    }
    match asked.max_tokens {
        Some(n) if n <= ceiling => return Ok(None),
        Some(n) if route.config.max_tokens_policy == MaxTokensPolicy::Reject => {
            return Err(Problem::AboveCeiling {
                max_tokens: n,
                ceiling,
                route: route.name.clone(),
            });
        }
        // Above the ceiling under "clamp", or absent: write the ceiling in.
        _ => {}
    }
    let cannot = |reason: String| Problem::CannotClamp { ceiling, reason };
    let mut json: Value = serde_json::from_slice(asked.body)
        .map_err(|e| cannot(format!("the body is not JSON ({e})")))?;
    clamp_max_tokens(asked.operation, asked.model.provider(), &mut json, ceiling)
        .map_err(|e| cannot(e.to_string()))?;
    let rewritten = serde_json::to_vec(&json).map_err(|e| cannot(e.to_string()))?;
    estimate.max_tokens = ceiling;
    Ok(Some(Bytes::from(rewritten)))
}
