//! The `[simulator]` table: latency, output lengths, faults, quotas and optional SigV4 checks.

use serde::{Deserialize, Serialize};

/// `[simulator]` settings. Every key is optional; the defaults suit a newcomer trying the proxy
/// against a plausible Bedrock (200 ms to first token, 150 tokens/s, no faults).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimulatorConfig {
    /// The Region on-demand buckets are in (an ARN's own Region wins). Default `us-east-1`.
    pub region: String,
    /// Tokens per minute of every bucket without an override. Default 200000.
    pub default_tokens_per_minute: u64,
    /// Per-model overrides, `[[simulator.quotas]]`.
    pub quotas: Vec<QuotaOverride>,
    /// Seed of the output-length and fault draws. Default 0.
    pub seed: u64,
    /// Output length range (uniform, inclusive) when the prompt has no `[sim:output=N]`.
    /// Defaults 50 and 400.
    pub output_tokens_min: u32,
    pub output_tokens_max: u32,
    /// Delay before the first token. Default 200.
    pub time_to_first_token_ms: u64,
    /// Generation speed; 0 means instant. Default 150.
    pub tokens_per_second: f64,
    /// Fraction of quota-counted calls answered 503 `ServiceUnavailableException`. Default 0.
    pub error_503_rate: f64,
    /// Fraction of quota-counted calls answered 500 `InternalServerException`. Default 0.
    pub error_500_rate: f64,
    /// Fraction of quota-counted calls whose connection closes before any response. Default 0.
    pub reset_rate: f64,
    /// Fraction of streaming calls cut mid-way (the connection aborts). Default 0.
    pub stream_cut_rate: f64,
    /// Fraction of streaming calls that pause for `stall_ms` mid-way. Default 0.
    pub stall_rate: f64,
    /// Length of a stall. Default 5000.
    pub stall_ms: u64,
    /// Replaces every model's maximum output tokens (for tests that need streams of many MB).
    /// Default: each model's own ([`super::models::max_output_tokens`]).
    pub max_output_tokens: Option<u64>,
    /// When set, every request must be SigV4-signed (service `bedrock`) with this key.
    pub verify_sigv4: Option<SigV4Key>,
}

impl Default for SimulatorConfig {
    fn default() -> Self {
        SimulatorConfig {
            region: "us-east-1".into(),
            default_tokens_per_minute: 200_000,
            quotas: Vec::new(),
            seed: 0,
            output_tokens_min: 50,
            output_tokens_max: 400,
            time_to_first_token_ms: 200,
            tokens_per_second: 150.0,
            error_503_rate: 0.0,
            error_500_rate: 0.0,
            reset_rate: 0.0,
            stream_cut_rate: 0.0,
            stall_rate: 0.0,
            stall_ms: 5000,
            max_output_tokens: None,
            verify_sigv4: None,
        }
    }
}

/// `[[simulator.quotas]]`: the quota of the bucket a model id (as callers send it) lands in.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QuotaOverride {
    pub model: String,
    pub tokens_per_minute: u64,
}

/// `verify_sigv4 = { access_key_id = "...", secret_access_key = "..." }`
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SigV4Key {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for SigV4Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigV4Key")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .finish()
    }
}

impl SimulatorConfig {
    /// Checks every value; the message names the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        let key = |k: &str, m: &str| Err(format!("simulator.{k}: {m}"));
        if self.region.is_empty() {
            return key("region", "must not be empty (e.g. \"us-east-1\")");
        }
        if self.default_tokens_per_minute == 0 {
            return key("default_tokens_per_minute", "must be greater than zero");
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, q) in self.quotas.iter().enumerate() {
            if q.model.trim().is_empty() {
                return key(&format!("quotas[{i}].model"), "must name a model id");
            }
            if q.tokens_per_minute == 0 {
                return key(
                    &format!("quotas[{i}].tokens_per_minute"),
                    "must be greater than zero",
                );
            }
            let bucket = super::models::bucket_key(&q.model, &self.region);
            if !seen.insert(bucket.clone()) {
                return key(
                    &format!("quotas[{i}].model"),
                    &format!(
                        "{:?} lands in bucket {bucket}, which an earlier entry already sets",
                        q.model
                    ),
                );
            }
        }
        if self.output_tokens_min > self.output_tokens_max {
            return key(
                "output_tokens_min",
                "must not be greater than simulator.output_tokens_max",
            );
        }
        let tps = self.tokens_per_second;
        if !(tps.is_finite() && (tps == 0.0 || tps >= 0.01)) {
            return key(
                "tokens_per_second",
                "must be 0 (instant) or a number >= 0.01",
            );
        }
        for (name, ms) in [
            ("time_to_first_token_ms", self.time_to_first_token_ms),
            ("stall_ms", self.stall_ms),
        ] {
            if ms > 3_600_000 {
                return key(name, "must be at most 3600000 (one hour)");
            }
        }
        if self.max_output_tokens == Some(0) {
            return key("max_output_tokens", "must be greater than zero");
        }
        for (name, rate) in [
            ("error_503_rate", self.error_503_rate),
            ("error_500_rate", self.error_500_rate),
            ("reset_rate", self.reset_rate),
            ("stream_cut_rate", self.stream_cut_rate),
            ("stall_rate", self.stall_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return key(name, "must be in [0, 1]");
            }
        }
        if let Some(k) = &self.verify_sigv4
            && (k.access_key_id.is_empty() || k.secret_access_key.is_empty())
        {
            return key(
                "verify_sigv4",
                "access_key_id and secret_access_key must both be non-empty",
            );
        }
        Ok(())
    }

    /// The maximum output tokens of a model, after `max_output_tokens`.
    pub(crate) fn max_output_tokens_for(&self, base_model: &str) -> u64 {
        self.max_output_tokens
            .unwrap_or_else(|| super::models::max_output_tokens(base_model))
    }

    /// The quota of a bucket.
    pub(crate) fn tokens_per_minute_for(&self, bucket: &str) -> u64 {
        self.quotas
            .iter()
            .find(|q| super::models::bucket_key(&q.model, &self.region) == bucket)
            .map_or(self.default_tokens_per_minute, |q| q.tokens_per_minute)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<SimulatorConfig, String> {
        let c: SimulatorConfig = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    #[test]
    fn defaults_and_overrides() {
        let c = parse("").unwrap();
        assert_eq!(c.default_tokens_per_minute, 200_000);
        let c = parse(
            r#"
            default_tokens_per_minute = 1000
            [[quotas]]
            model = "us.anthropic.claude-sonnet-4-20250514-v1:0"
            tokens_per_minute = 50
            "#,
        )
        .unwrap();
        assert_eq!(
            c.tokens_per_minute_for("anthropic.claude-sonnet-4-20250514-v1:0@geo:us"),
            50
        );
        assert_eq!(
            c.tokens_per_minute_for("anthropic.claude-sonnet-4-20250514-v1:0@us-east-1"),
            1000
        );
    }

    #[test]
    fn errors_name_the_key() {
        for (text, msg) in [
            (
                "stream_cut_rate = 1.5",
                "simulator.stream_cut_rate: must be in [0, 1]",
            ),
            (
                "error_503_rate = -0.1",
                "simulator.error_503_rate: must be in [0, 1]",
            ),
            (
                "error_500_rate = 2",
                "simulator.error_500_rate: must be in [0, 1]",
            ),
            ("reset_rate = -1", "simulator.reset_rate: must be in [0, 1]"),
            (
                "max_output_tokens = 0",
                "simulator.max_output_tokens: must be greater than zero",
            ),
            (
                "default_tokens_per_minute = 0",
                "simulator.default_tokens_per_minute: must be greater than zero",
            ),
            (
                "output_tokens_min = 10\noutput_tokens_max = 5",
                "simulator.output_tokens_min: must not be greater than simulator.output_tokens_max",
            ),
            (
                "stall_ms = 3600001",
                "simulator.stall_ms: must be at most 3600000 (one hour)",
            ),
            (
                "tokens_per_second = -1.0",
                "simulator.tokens_per_second: must be 0 (instant) or a number >= 0.01",
            ),
            (
                "[[quotas]]\nmodel = \"m\"\ntokens_per_minute = 0",
                "simulator.quotas[0].tokens_per_minute: must be greater than zero",
            ),
            (
                "verify_sigv4 = { access_key_id = \"\", secret_access_key = \"s\" }",
                "simulator.verify_sigv4: access_key_id and secret_access_key must both be non-empty",
            ),
        ] {
            assert_eq!(parse(text).unwrap_err(), msg, "{text}");
        }
        let dup = "[[quotas]]\nmodel = \"a.b\"\ntokens_per_minute = 1\n[[quotas]]\nmodel = \"arn:aws:bedrock:us-east-1::foundation-model/a.b\"\ntokens_per_minute = 2";
        assert!(
            parse(dup)
                .unwrap_err()
                .starts_with("simulator.quotas[1].model")
        );
        assert!(parse("bogus = 1").unwrap_err().contains("bogus"));
    }
}
