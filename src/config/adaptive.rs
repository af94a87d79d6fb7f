//! `routes[].adaptive_max_tokens`: a route's opt-in to adaptive maxTokens (issue #22), the output
//! cap the proxy learns from the route's observed outputs per model and writes into forwarded
//! requests ([`crate::admission::adaptive`] learns and applies it).
//!
//! A table of its own rather than a third `max_tokens_policy` value: `max_tokens_policy` says
//! what happens above a fixed `max_tokens_ceiling` (`clamp` or `reject`), and a route may want
//! both (a hard ceiling it rejects above, and a learned cap below it); the table also carries the
//! learner's parameters, which a policy value could not.
//!
//! ```toml
//! [[routes]]
//! name = "chat"
//! [routes.adaptive_max_tokens]
//! quantile = 0.999
//! margin = 1.2
//! floor = 256
//! min_samples = 300
//! truncation_target = 0.001
//! models = ["anthropic.claude-3-haiku-20240307-v1:0"]
//! ```
//! Every key is optional (an empty table takes the defaults below); `models` limits the learned
//! cap to some of the pooled models the route calls (default: all of them).

use serde::Deserialize;

use super::{ConfigError, PoolConfig, invalid};

/// The quantile of observed output the cap is learned from (p99.9).
pub const DEFAULT_QUANTILE: f64 = 0.999;
/// The cap is the quantile times this.
pub const DEFAULT_MARGIN: f64 = 1.2;
/// The learned cap is never below this.
pub const DEFAULT_FLOOR: u64 = 256;
/// Calls settled with usage before the learned cap applies; until then the caller's own stands.
pub const DEFAULT_MIN_SAMPLES: u64 = 300;
/// The share of capped calls the proxy's cap may truncate before the cap rises.
pub const DEFAULT_TRUNCATION_TARGET: f64 = 0.001;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdaptive {
    pub quantile: Option<f64>,
    pub margin: Option<f64>,
    pub floor: Option<u64>,
    pub min_samples: Option<u64>,
    pub truncation_target: Option<f64>,
    pub models: Option<Vec<String>>,
}

/// A route's adaptive maxTokens, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveMaxTokens {
    /// In (0, 1].
    pub quantile: f64,
    /// At least 1.
    pub margin: f64,
    /// At least 1.
    pub floor: u64,
    pub min_samples: u64,
    /// In (0, 1).
    pub truncation_target: f64,
    /// The pooled model ids the cap applies to; `None`: every model the route calls.
    pub models: Option<Vec<String>>,
}

impl Default for AdaptiveMaxTokens {
    fn default() -> Self {
        AdaptiveMaxTokens {
            quantile: DEFAULT_QUANTILE,
            margin: DEFAULT_MARGIN,
            floor: DEFAULT_FLOOR,
            min_samples: DEFAULT_MIN_SAMPLES,
            truncation_target: DEFAULT_TRUNCATION_TARGET,
            models: None,
        }
    }
}

impl AdaptiveMaxTokens {
    /// Whether the cap applies to `model` (the model id as its pool's config lists it).
    pub fn covers(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|m| m == model))
    }
}

/// Validates a route's `adaptive_max_tokens`, if it has one; `key` names a field of the route
/// (`routes[0] (chat).` + field).
pub(super) fn validate(
    raw: Option<RawAdaptive>,
    pools: &[PoolConfig],
    key: &dyn Fn(&str) -> String,
) -> Result<Option<AdaptiveMaxTokens>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let field = |name: &str| key(&format!("adaptive_max_tokens.{name}"));
    let d = AdaptiveMaxTokens::default();
    let quantile = raw.quantile.unwrap_or(d.quantile);
    if !(quantile > 0.0 && quantile <= 1.0) {
        return Err(invalid(
            field("quantile"),
            "must be a fraction in (0, 1], e.g. 0.999 for p99.9",
        ));
    }
    let margin = raw.margin.unwrap_or(d.margin);
    if !(margin.is_finite() && (1.0..=100.0).contains(&margin)) {
        return Err(invalid(
            field("margin"),
            "must be a multiplier from 1 to 100, e.g. 1.2",
        ));
    }
    let floor = raw.floor.unwrap_or(d.floor);
    if floor == 0 {
        return Err(invalid(field("floor"), "must be at least 1 token"));
    }
    let truncation_target = raw.truncation_target.unwrap_or(d.truncation_target);
    if !(truncation_target > 0.0 && truncation_target < 1.0) {
        return Err(invalid(
            field("truncation_target"),
            "must be a fraction in (0, 1), e.g. 0.001 for 0.1% of calls",
        ));
    }
    if let Some(models) = &raw.models {
        if models.is_empty() {
            return Err(invalid(
                field("models"),
                "an empty list caps nothing; remove the key to cap every model the route calls",
            ));
        }
        if let Some(m) = models
            .iter()
            .find(|m| !pools.iter().any(|p| p.models.contains(m)))
        {
            return Err(invalid(
                field("models"),
                format!("{m:?} is in no pool's models"),
            ));
        }
    }
    Ok(Some(AdaptiveMaxTokens {
        quantile,
        margin,
        floor,
        min_samples: raw.min_samples.unwrap_or(d.min_samples),
        truncation_target,
        models: raw.models,
    }))
}

/// Validates a route's `adaptive_retry`: it retries what the learned cap truncated, so it needs
/// the route's `adaptive_max_tokens` (`learns`).
pub(super) fn validate_retry(
    raw: Option<bool>,
    learns: bool,
    key: &dyn Fn(&str) -> String,
) -> Result<bool, ConfigError> {
    let retry = raw.unwrap_or(false);
    if retry && !learns {
        return Err(invalid(
            key("adaptive_retry"),
            "retries calls the learned cap truncated, so it needs adaptive_max_tokens on the \
             same route (add `adaptive_max_tokens = {}`), or remove the key",
        ));
    }
    Ok(retry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const BASE: &str = "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nregion = \"us-east-1\"\n\
        [ledger]\nbackend = \"memory\"\n[[pools]]\nname = \"p\"\nmodels = [\"a.m-1\", \"a.m-2\"]\n\
        tokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\n\
        default_max_tokens = 4096\nmax_output_tokens = 8192\n[[routes]]\nname = \"chat\"\n";

    fn route(table: &str) -> Result<Option<AdaptiveMaxTokens>, String> {
        Config::parse(&format!("{BASE}{table}"))
            .map(|c| c.policy.routes[0].adaptive_max_tokens.clone())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn adaptive_max_tokens_parses_with_defaults() {
        assert_eq!(route(""), Ok(None), "off unless asked for");
        assert_eq!(
            route("adaptive_max_tokens = {}\n"),
            Ok(Some(AdaptiveMaxTokens::default()))
        );
        let set = route(
            "adaptive_max_tokens = { quantile = 0.99, margin = 1.5, floor = 128, min_samples = 50, \
             truncation_target = 0.01, models = [\"a.m-2\"] }\n",
        )
        .expect("valid")
        .expect("set");
        assert_eq!(
            set,
            AdaptiveMaxTokens {
                quantile: 0.99,
                margin: 1.5,
                floor: 128,
                min_samples: 50,
                truncation_target: 0.01,
                models: Some(vec!["a.m-2".into()]),
            }
        );
        assert!(set.covers("a.m-2") && !set.covers("a.m-1"));
        let table = route("[routes.adaptive_max_tokens]\nfloor = 300\n").expect("valid");
        assert_eq!(table.map(|a| (a.floor, a.min_samples)), Some((300, 300)));
    }

    #[test]
    fn adaptive_retry_needs_adaptive_max_tokens() {
        let retry = |table: &str| {
            Config::parse(&format!("{BASE}{table}"))
                .map(|c| c.policy.routes[0].adaptive_retry)
                .map_err(|e| e.to_string())
        };
        assert_eq!(retry(""), Ok(false), "off unless asked for");
        assert_eq!(
            retry("adaptive_retry = true\nadaptive_max_tokens = {}\n"),
            Ok(true)
        );
        let err = retry("adaptive_retry = true\n").expect_err("no learned cap to retry");
        assert!(
            err.contains("routes[0] (chat).adaptive_retry: retries calls the learned cap")
                && err.contains("adaptive_max_tokens = {}"),
            "{err}"
        );
    }

    #[test]
    fn each_invalid_adaptive_setting_names_its_key() {
        let cases = [
            (
                "quantile = 0.0",
                "adaptive_max_tokens.quantile: must be a fraction",
            ),
            ("quantile = 1.5", "adaptive_max_tokens.quantile"),
            (
                "margin = 0.5",
                "adaptive_max_tokens.margin: must be a multiplier",
            ),
            ("floor = 0", "adaptive_max_tokens.floor: must be at least 1"),
            (
                "truncation_target = 0.0",
                "adaptive_max_tokens.truncation_target",
            ),
            (
                "truncation_target = 1.0",
                "adaptive_max_tokens.truncation_target",
            ),
            ("models = []", "adaptive_max_tokens.models: an empty list"),
            (
                "models = [\"b.x\"]",
                "adaptive_max_tokens.models: \"b.x\" is in no pool",
            ),
            ("margins = 2.0", "unknown field `margins`"),
        ];
        for (set, want) in cases {
            let err = route(&format!("adaptive_max_tokens = {{ {set} }}\n")).expect_err(set);
            assert!(err.contains(want), "{set}\n  got: {err}\n  want: {want}");
            if !want.starts_with("unknown") {
                assert!(err.contains("routes[0] (chat)."), "{err}");
            }
        }
    }
}
