//! `[[simulator.endpoints]]`: the SageMaker endpoints (and inference components) the simulator
//! runs, each a fleet of copies of one model: the settings' checks (the settings themselves are
//! with the rest of `[simulator]`, in [`crate::config::simulator`]).

pub use crate::config::simulator::EndpointSimConfig;

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
