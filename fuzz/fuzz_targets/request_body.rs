//! A request body as admission reads it: JSON, then the input-token estimate and the requested
//! `maxTokens`, for every operation and every model family.
//!
//! Kept thin on purpose: `run` is the one place that names the estimator's entry points, so it
//! is easy to re-point when they change.
//!
//! Properties: never panics; the estimate is at least the per-request overhead; a `maxTokens`
//! that is accepted is at least 1.

#![no_main]

#[path = "families.rs"]
mod families;

use families::PROVIDERS;
use libfuzzer_sys::fuzz_target;
use tokengate::{
    admission::estimate::{PER_REQUEST_TOKENS, estimate_input_tokens},
    bedrock::{Operation, max_tokens::requested_max_tokens},
};

fn run(body: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    for operation in Operation::ALL {
        assert!(estimate_input_tokens(operation, &json) >= PER_REQUEST_TOKENS);
        for provider in PROVIDERS {
            if let Ok(Some(n)) = requested_max_tokens(operation, provider, &json) {
                assert!(n >= 1, "{operation} {provider:?}: maxTokens {n}");
            }
        }
    }
}

fuzz_target!(|body: &[u8]| run(body));
