//! A route's `max_tokens_ceiling`, applied to what upstream will read: a request above it is
//! lowered to it (the body rewritten) or refused (`max_tokens_policy = "reject"`), and a request
//! that does not say gets the ceiling written in, since Bedrock would otherwise reserve, and
//! allow, the model's maximum. (A `maxTokens` named twice never gets here: [`super::body`]
//! refuses it.)

use bytes::Bytes;
use serde_json::Value;

use super::{Admission, Estimate, Pool, Route};
use crate::{
    bedrock::{BedrockError, ModelRef, Operation, max_tokens::clamp_max_tokens},
    config::MaxTokensPolicy,
};

/// What a route's `max_tokens_ceiling` looks at in a request.
pub(super) struct Ceiling<'a> {
    pub operation: Operation,
    pub model: &'a ModelRef<'a>,
    pub body: &'a Bytes,
    /// The `maxTokens` the body asks for, `None` if it does not say.
    pub requested: Option<u64>,
}

impl Admission {
    /// The route's `max_tokens_ceiling`: a request above it is rejected, or clamped (its body
    /// rewritten, returned). A request that does not say gets the ceiling written in (Bedrock
    /// would otherwise reserve, and allow, the model's maximum), and reserves it.
    pub(super) fn apply_ceiling(
        &self,
        pool: &Pool,
        route: &Route,
        request: &Ceiling<'_>,
        estimate: &mut Estimate,
    ) -> Result<Option<Bytes>, BedrockError> {
        let Some(ceiling) = route.config.max_tokens_ceiling else {
            return Ok(None);
        };
        match request.requested {
            Some(n) if n <= ceiling => return Ok(None),
            Some(n) if route.config.max_tokens_policy == MaxTokensPolicy::Reject => {
                return Err(BedrockError::validation(format!(
                    "maxTokens {n} is above the ceiling of {ceiling} that tokengate route {:?} allows; set maxTokens to at most {ceiling}",
                    route.name
                )));
            }
            _ => {}
        }
        let mut json: Value = serde_json::from_slice(request.body).map_err(|e| {
            BedrockError::validation(format!("the request body is not valid JSON ({e})"))
        })?;
        clamp_max_tokens(
            request.operation,
            request.model.provider(),
            &mut json,
            ceiling,
        )
        .map_err(|e| {
            BedrockError::validation(format!(
                "maxTokens cannot be limited to the route's ceiling of {ceiling}: {e}"
            ))
        })?;
        let rewritten = serde_json::to_vec(&json).map_err(|e| {
            BedrockError::validation(format!("the request body cannot be rewritten: {e}"))
        })?;
        estimate.max_tokens = ceiling;
        self.metrics
            .max_tokens_clamped
            .with_label_values(&[&pool.name, &route.name])
            .inc();
        Ok(Some(Bytes::from(rewritten)))
    }
}
