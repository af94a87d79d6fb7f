//! A route's `max_tokens_ceiling`, applied to what upstream will read: a request above it is
//! refused (`policy = "reject"`), or lowered to the ceiling (`"clamp"`). A request that names no
//! `maxTokens` gets the ceiling written in (whatever the policy), and reserves it: Bedrock would
//! otherwise reserve, and allow, the model's maximum. The writing is [`super::rewrite`]'s. (A
//! `maxTokens` named twice never gets here: [`super::body`] refuses it.)

use super::{Estimate, Problem, Route};
use crate::config::MaxTokensPolicy;

/// Applies the route's ceiling to `estimate`, given the `maxTokens` the body names (`None` if it
/// names none); returns the ceiling to write into the forwarded body, if it must be.
pub(super) fn apply(
    route: &Route,
    max_tokens: Option<u64>,
    estimate: &mut Estimate,
) -> Result<Option<u64>, Problem> {
    let Some(ceiling) = route.config.max_tokens_ceiling else {
        return Ok(None);
    };
    match max_tokens {
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
    estimate.max_tokens = ceiling;
    Ok(Some(ceiling))
}
