//! `[[simulator.endpoints]]`: the SageMaker endpoints (and inference components) the simulator
//! runs, each a fleet of copies of one model.

use serde::{Deserialize, Serialize};

/// One simulated endpoint, or one inference component on an endpoint.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointSimConfig {
    /// The endpoint name.
    pub name: String,
    /// The inference component: calls must name it (`X-Amzn-SageMaker-Inference-Component`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_component: Option<String>,
    /// Copies serving at start (instances of a single-model endpoint).
    pub copies: u32,
    /// Requests one copy serves at once; past that on every copy, a call is refused as the
    /// container refuses it (429 inside a `ModelError`).
    pub max_concurrency_per_copy: u32,
    /// Delay before the first token. Default 200.
    #[serde(default = "default_ttft_ms")]
    pub time_to_first_token_ms: u64,
    /// Generation speed of one request, in tokens per second (0: instant). Default 50.
    #[serde(default = "default_tokens_per_second")]
    pub tokens_per_second: f64,
    /// How long copies asked for by `POST /_sim/sagemaker` take to arrive or leave (new
    /// instances take minutes on AWS). Default 0.
    #[serde(default)]
    pub scale_delay_ms: u64,
    /// The output cap of a request that names none. Default 1024.
    #[serde(default = "default_max_new_tokens")]
    pub default_max_new_tokens: u64,
}

fn default_ttft_ms() -> u64 {
    200
}

fn default_tokens_per_second() -> f64 {
    50.0
}

fn default_max_new_tokens() -> u64 {
    1024
}

/// Checks `[[simulator.endpoints]]`; the message names the key at fault.
pub fn validate(endpoints: &[EndpointSimConfig]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for (i, e) in endpoints.iter().enumerate() {
        let key = |k: &str, m: &str| Err(format!("simulator.endpoints[{i}].{k}: {m}"));
        let name_ok = |n: &str| crate::sagemaker::operation::is_name(n);
        if !name_ok(&e.name) {
            return key(
                "name",
                "must be a SageMaker endpoint name (letters, digits, hyphens)",
            );
        }
        if e.inference_component
            .as_deref()
            .is_some_and(|c| !name_ok(c))
        {
            return key(
                "inference_component",
                "must be an inference component name (letters, digits, hyphens)",
            );
        }
        if e.max_concurrency_per_copy == 0 {
            return key("max_concurrency_per_copy", "must be greater than zero");
        }
        let tps = e.tokens_per_second;
        if !(tps.is_finite() && (tps == 0.0 || tps >= 0.01)) {
            return key(
                "tokens_per_second",
                "must be 0 (instant) or a number >= 0.01",
            );
        }
        if e.time_to_first_token_ms > 3_600_000 || e.scale_delay_ms > 3_600_000 {
            return key(
                "scale_delay_ms",
                "delays must be at most 3600000 (one hour)",
            );
        }
        if e.default_max_new_tokens == 0 {
            return key("default_max_new_tokens", "must be greater than zero");
        }
        if !seen.insert((e.name.clone(), e.inference_component.clone())) {
            return key("name", "names an endpoint (and inference component) twice");
        }
    }
    Ok(())
}
