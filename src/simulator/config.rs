//! The `[simulator]` table: latency, output lengths, faults, quotas (per minute, per day,
//! reserved), Regions, application profiles and optional credential checks.

use super::model_id::{self, Resolved};
pub use crate::config::simulator::{QuotaOverride, SigV4Key, SimulatorConfig};

/// The quotas of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub tokens_per_minute: u64,
    pub tokens_per_day: u64,
    /// Tokens per minute of the model's reserved capacity, if it has any.
    pub reserved_tokens_per_minute: Option<u64>,
}

impl SimulatorConfig {
    /// Checks every value; the message names the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        let key = |k: &str, m: &str| Err(format!("simulator.{k}: {m}"));
        if self.region.is_empty() {
            return key("region", "must not be empty (e.g. \"us-east-1\")");
        }
        for (name, value) in [
            (
                "default_tokens_per_minute",
                Some(self.default_tokens_per_minute),
            ),
            ("default_tokens_per_day", self.default_tokens_per_day),
            ("account_tokens_per_day", self.account_tokens_per_day),
            ("day_secs", Some(self.day_secs)),
            (
                "h2_max_concurrent_streams",
                Some(self.h2_max_concurrent_streams.into()),
            ),
            (
                "bidirectional_session_secs",
                Some(self.bidirectional_session_secs),
            ),
        ] {
            if value == Some(0) {
                return key(name, "must be greater than zero");
            }
        }
        if self.bidirectional_session_secs > 3600 {
            return key(
                "bidirectional_session_secs",
                "must be at most 3600 (one hour)",
            );
        }
        self.validate_quotas()?;
        self.validate_credentials()?;
        super::sagemaker::config::validate(&self.endpoints)?;
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
        Ok(())
    }

    fn validate_quotas(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, q) in self.quotas.iter().enumerate() {
            let key = |k: &str, m: &str| Err(format!("simulator.quotas[{i}].{k}: {m}"));
            if q.model.trim().is_empty() {
                return key("model", "must name a model id");
            }
            if q.region
                .as_deref()
                .is_some_and(|r| !super::region::is_region(r))
            {
                return key("region", "must be a Region name (e.g. \"us-west-2\")");
            }
            let quotas = [
                ("tokens_per_minute", q.tokens_per_minute),
                ("tokens_per_day", q.tokens_per_day),
                ("reserved_tokens_per_minute", q.reserved_tokens_per_minute),
            ];
            if quotas.iter().all(|(_, v)| v.is_none()) {
                return key(
                    "model",
                    "set at least one of tokens_per_minute, tokens_per_day, reserved_tokens_per_minute",
                );
            }
            if let Some((name, _)) = quotas.iter().find(|(_, v)| *v == Some(0)) {
                return key(name, "must be greater than zero");
            }
            let region = q.region.as_deref().unwrap_or(&self.region);
            let bucket = self.resolve(&q.model, region).bucket;
            if !seen.insert((bucket.clone(), q.region.clone())) {
                return key(
                    "model",
                    &format!(
                        "{:?} lands in bucket {bucket}, which an earlier entry already sets",
                        q.model
                    ),
                );
            }
        }
        Ok(())
    }

    fn validate_credentials(&self) -> Result<(), String> {
        if let Some(k) = &self.verify_sigv4
            && (k.access_key_id.is_empty() || k.secret_access_key.is_empty())
        {
            return Err(
                "simulator.verify_sigv4: access_key_id and secret_access_key must both be non-empty"
                    .into(),
            );
        }
        if let Some(i) = self.api_keys.iter().position(|k| k.trim().is_empty()) {
            return Err(format!("simulator.api_keys[{i}]: must not be empty"));
        }
        for (profile, model) in &self.application_profiles {
            if profile.trim().is_empty() || model.trim().is_empty() {
                return Err(format!(
                    "simulator.application_profiles: {profile:?} = {model:?} needs a profile ARN or id and a model id"
                ));
            }
        }
        Ok(())
    }

    /// Resolves a model id called in `region` (see [`model_id::resolve`]).
    pub(crate) fn resolve(&self, model: &str, region: &str) -> Resolved {
        model_id::resolve(model, region, &self.region, &self.application_profiles)
    }

    /// The maximum output tokens of a model, after `max_output_tokens`.
    pub(crate) fn max_output_tokens_for(&self, base_model: &str) -> u64 {
        self.max_output_tokens
            .unwrap_or_else(|| super::models::max_output_tokens(base_model))
    }

    /// The quotas of the bucket `model` resolved to: an entry for its Region first, then one for
    /// every Region, then the defaults.
    pub(crate) fn limits_for(&self, model: &Resolved) -> Limits {
        let matching = |regional: bool| {
            self.quotas.iter().find(|q| {
                q.region.is_some() == regional
                    && q.region.as_deref().is_none_or(|r| r == model.region)
                    && self.resolve(&q.model, &model.region).bucket == model.bucket
            })
        };
        let regional = matching(true);
        let general = matching(false);
        let pick = |f: fn(&QuotaOverride) -> Option<u64>| {
            regional.and_then(f).or_else(|| general.and_then(f))
        };
        let tokens_per_minute =
            pick(|q| q.tokens_per_minute).unwrap_or(self.default_tokens_per_minute);
        Limits {
            tokens_per_minute,
            tokens_per_day: pick(|q| q.tokens_per_day)
                .or(self.default_tokens_per_day)
                .unwrap_or(tokens_per_minute.saturating_mul(1440)),
            reserved_tokens_per_minute: pick(|q| q.reserved_tokens_per_minute),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<SimulatorConfig, String> {
        let c: SimulatorConfig = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    const SONNET: &str = "anthropic.claude-sonnet-4-20250514-v1:0";

    fn limits(c: &SimulatorConfig, model: &str, region: &str) -> Limits {
        c.limits_for(&c.resolve(model, region))
    }

    #[test]
    fn defaults_and_overrides() {
        let c = parse("").unwrap();
        assert_eq!(c.default_tokens_per_minute, 200_000);
        assert_eq!(
            limits(&c, SONNET, "us-east-1"),
            Limits {
                tokens_per_minute: 200_000,
                tokens_per_day: 200_000 * 1440,
                reserved_tokens_per_minute: None
            }
        );
        let c = parse(
            r#"
            default_tokens_per_minute = 1000
            [[quotas]]
            model = "us.anthropic.claude-sonnet-4-20250514-v1:0"
            tokens_per_minute = 50
            reserved_tokens_per_minute = 20
            [[quotas]]
            model = "us.anthropic.claude-sonnet-4-20250514-v1:0"
            region = "us-west-2"
            tokens_per_day = 7
            "#,
        )
        .unwrap();
        let geo = limits(&c, &format!("us.{SONNET}"), "us-east-1");
        assert_eq!(
            (
                geo.tokens_per_minute,
                geo.tokens_per_day,
                geo.reserved_tokens_per_minute
            ),
            (50, 50 * 1440, Some(20))
        );
        assert_eq!(limits(&c, SONNET, "us-east-1").tokens_per_minute, 1000);
        // The regional entry wins where it sets a value; the general one fills the rest.
        let west = limits(&c, &format!("us.{SONNET}"), "us-west-2");
        assert_eq!(
            (
                west.tokens_per_minute,
                west.tokens_per_day,
                west.reserved_tokens_per_minute
            ),
            (50, 7, Some(20))
        );
        let c = parse("default_tokens_per_minute = 10\ndefault_tokens_per_day = 99").unwrap();
        assert_eq!(limits(&c, SONNET, "eu-west-1").tokens_per_day, 99);
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
                "[[quotas]]\nmodel = \"m\"",
                "simulator.quotas[0].model: set at least one of tokens_per_minute, tokens_per_day, reserved_tokens_per_minute",
            ),
            (
                "[[quotas]]\nmodel = \"m\"\nregion = \"west\"\ntokens_per_day = 1",
                "simulator.quotas[0].region: must be a Region name (e.g. \"us-west-2\")",
            ),
            (
                "[[quotas]]\nmodel = \"m\"\nreserved_tokens_per_minute = 0",
                "simulator.quotas[0].reserved_tokens_per_minute: must be greater than zero",
            ),
            (
                "default_tokens_per_day = 0",
                "simulator.default_tokens_per_day: must be greater than zero",
            ),
            (
                "account_tokens_per_day = 0",
                "simulator.account_tokens_per_day: must be greater than zero",
            ),
            (
                "day_secs = 0",
                "simulator.day_secs: must be greater than zero",
            ),
            (
                "bidirectional_session_secs = 3601",
                "simulator.bidirectional_session_secs: must be at most 3600 (one hour)",
            ),
            (
                "api_keys = [\"k\", \"\"]",
                "simulator.api_keys[1]: must not be empty",
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
        // The same bucket in one Region and in every Region is not a duplicate.
        let regional = "[[quotas]]\nmodel = \"a.b\"\ntokens_per_minute = 1\n[[quotas]]\nmodel = \"a.b\"\nregion = \"us-east-1\"\ntokens_per_minute = 2";
        assert!(parse(regional).is_ok());
        assert!(parse("bogus = 1").unwrap_err().contains("bogus"));
    }
}
