//! `maxTokens` from request bodies: Converse `inferenceConfig.maxTokens`, and per model family for
//! InvokeModel bodies.
//!
//! STUB: interface fixed, implementation pending.

use serde_json::Value;

use super::Operation;

/// A `maxTokens` field that is present but unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct MaxTokensError {
    /// The JSON path of the field, e.g. `inferenceConfig.maxTokens`.
    pub field: String,
    /// What is wrong with it, e.g. `must be a positive integer, got -3`.
    pub problem: String,
}

/// The maximum output tokens the request asks for, `Ok(None)` if it does not say.
/// `provider` is the model's provider (`anthropic`, `amazon`, `meta`, ...) for InvokeModel bodies.
pub fn requested_max_tokens(
    _operation: Operation,
    _provider: Option<&str>,
    _body: &Value,
) -> Result<Option<u64>, MaxTokensError> {
    Ok(None)
}
