//! A route's `max_tokens_ceiling`: a request above it is refused (`policy = "reject"`), or its
//! body rewritten with the ceiling (`"clamp"`), the one case where the proxy re-serialises a body.
//!
//! A request that names no `maxTokens` is reserved at its pool's `default_max_tokens`; when that
//! is above the ceiling, clamping writes the ceiling in.

use bytes::Bytes;
use serde_json::Value;

use super::{Estimate, Problem, Route};
use crate::{
    bedrock::{ModelRef, Operation, max_tokens::clamp_max_tokens},
    config::MaxTokensPolicy,
};

/// Applies the route's ceiling to `estimate`; returns the body to forward instead of the
/// caller's when it was rewritten.
pub(super) fn apply(
    route: &Route,
    operation: Operation,
    model: &ModelRef<'_>,
    body: &Bytes,
    estimate: &mut Estimate,
) -> Result<Option<Bytes>, Problem> {
    let Some(ceiling) = route.config.max_tokens_ceiling else {
        return Ok(None);
    };
    if estimate.max_tokens <= ceiling {
        return Ok(None);
    }
    if route.config.max_tokens_policy == MaxTokensPolicy::Reject {
        return Err(Problem::AboveCeiling {
            max_tokens: estimate.max_tokens,
            ceiling,
            route: route.name.clone(),
        });
    }
    let cannot = |reason: String| Problem::CannotClamp { ceiling, reason };
    let mut json: Value =
        serde_json::from_slice(body).map_err(|e| cannot(format!("the body is not JSON ({e})")))?;
    clamp_max_tokens(operation, model.provider(), &mut json, ceiling)
        .map_err(|e| cannot(e.to_string()))?;
    let rewritten = serde_json::to_vec(&json).map_err(|e| cannot(e.to_string()))?;
    estimate.max_tokens = ceiling;
    Ok(Some(Bytes::from(rewritten)))
}
