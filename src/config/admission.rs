//! `[admission]`: settings that apply across pools (unknown models, application profiles, retry
//! hints, how routes share pools).

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use super::{ConfigError, PoolConfig, fraction, invalid, positive};

/// How long a quiet route keeps its guarantee protected: a few seconds covers the gaps between
/// one caller's requests without holding idle capacity back for long.
const DEFAULT_SHARE_IDLE_MS: u64 = 5_000;
const DEFAULT_PRIORITY_MARGIN: f64 = 0.1;
const DEFAULT_MAX_RETRY_HINT_MS: u64 = 5_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmission {
    pub unknown_models: Option<UnknownModels>,
    #[serde(default)]
    pub application_profiles: BTreeMap<String, String>,
    pub max_retry_hint_ms: Option<u64>,
    pub share_idle_ms: Option<u64>,
    pub priority_margin: Option<f64>,
    pub account_tokens_per_day: Option<u64>,
}

/// `admission.unknown_models`: what happens to a model in no pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownModels {
    /// 400 `ValidationException` naming the model.
    Reject,
    /// Forwarded uncounted (and counted in metrics as such).
    Pass,
}

#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    pub unknown_models: UnknownModels,
    /// Application-inference-profile ARN or id -> the model id whose pool it draws on.
    pub application_profiles: BTreeMap<String, String>,
    /// Upper bound of the `x-amz-retry-after` hint. SDKs honour hints up to about their own
    /// backoff + 5 s (boto3, JS) or 20 s (Rust).
    pub max_retry_hint: Duration,
    /// A route that has asked nothing for this long (and has nothing in flight) lends its
    /// guaranteed share to the others.
    pub share_idle: Duration,
    /// Fraction of a pool a borrowing route leaves free for active routes of higher priority.
    pub priority_margin: f64,
    /// The account's daily quota across every pool (Bedrock's account-wide daily limit): a
    /// budget taken before each pool's reservation.
    pub account_tokens_per_day: Option<u64>,
}

pub(super) fn validate(raw: RawAdmission) -> Result<AdmissionConfig, ConfigError> {
    Ok(AdmissionConfig {
        unknown_models: raw.unknown_models.unwrap_or(UnknownModels::Reject),
        application_profiles: raw.application_profiles,
        max_retry_hint: Duration::from_millis(positive(
            "admission.max_retry_hint_ms",
            raw.max_retry_hint_ms.unwrap_or(DEFAULT_MAX_RETRY_HINT_MS),
        )?),
        share_idle: Duration::from_millis(raw.share_idle_ms.unwrap_or(DEFAULT_SHARE_IDLE_MS)),
        priority_margin: fraction(
            "admission.priority_margin",
            raw.priority_margin.unwrap_or(DEFAULT_PRIORITY_MARGIN),
            0.5,
        )?,
        account_tokens_per_day: raw
            .account_tokens_per_day
            .map(|v| super::pools::window_limit("admission.account_tokens_per_day", v))
            .transpose()?,
    })
}

/// Every application profile maps to a model some pool lists.
pub(super) fn check_profiles(
    admission: &AdmissionConfig,
    pools: &[PoolConfig],
) -> Result<(), ConfigError> {
    for (profile, model) in &admission.application_profiles {
        if !pools.iter().any(|p| p.models.contains(model)) {
            return Err(invalid(
                format!("admission.application_profiles.{profile:?}"),
                format!("maps to {model:?}, which no pool lists in its models"),
            ));
        }
    }
    Ok(())
}
