//! A route's `max_tokens_ceiling`, applied to what upstream will read: a request above it is
//! refused (`policy = "reject"`), or lowered to the ceiling (`"clamp"`). A request that names no
//! `maxTokens` gets the ceiling written in (whatever the policy), and reserves it: Bedrock would
//! otherwise reserve, and allow, the model's maximum. The writing is [`super::rewrite`]'s. (A
//! `maxTokens` named twice never gets here: [`super::body`] refuses it.)
//!
//! An InvokeModelWithBidirectionalStream session names its `maxTokens` in its `sessionStart`
//! event, which arrives after admission: the ceiling only caps its reservation here, and is
//! applied to that event as it passes ([`crate::proxy::duplex`]).

use super::{Estimate, Problem, Route};
use crate::{bedrock::Operation, config::MaxTokensPolicy};

/// Applies the route's ceiling to `estimate`, given the `maxTokens` the body names (`None` if it
/// names none); returns the ceiling to write into the forwarded body, if it must be.
pub(super) fn apply(
    route: &Route,
    operation: Operation,
    max_tokens: Option<u64>,
    estimate: &mut Estimate,
) -> Result<Option<u64>, Problem> {
    let Some(ceiling) = route.config.max_tokens_ceiling else {
        return Ok(None);
    };
    if operation == Operation::InvokeModelWithBidirectionalStream {
        estimate.max_tokens = estimate.max_tokens.min(ceiling);
        return Ok(None);
    }
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
