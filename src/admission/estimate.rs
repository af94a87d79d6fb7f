//! Input-token estimates from request bodies.
//!
//! STUB: interface fixed, implementation pending.

use serde_json::Value;

use crate::bedrock::Operation;

/// A conservative estimate of the input tokens of a request body (before calibration).
pub fn estimate_input_tokens(_operation: Operation, _body: &Value) -> u64 {
    0
}
