//! `[[pools]]`: the units Bedrock enforces quota on (model x Region x inference route), their
//! limits, and how requests that do not fit wait.

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use super::{ConfigError, EndpointConfig, fraction, invalid};

/// Default admission-queue wait: long enough to ride out a refill or a completion, short
/// against SDK timeouts.
const DEFAULT_MAX_WAIT_MS: u64 = 2_000;
const MAX_WAIT_LIMIT_MS: u64 = 30_000;
const DEFAULT_MAX_QUEUE: usize = 1_000;
/// The largest bucket the ledgers keep exact.
pub const MAX_TOKENS_PER_MINUTE: u64 = 1_000_000_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    pub name: String,
    pub models: Vec<String>,
    pub region: Option<String>,
    pub tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: u32,
    pub output_burndown: u32,
    pub default_max_tokens: u64,
    pub bidirectional_reservation: Option<u64>,
    pub headroom: Option<f64>,
    pub input_estimate: Option<InputEstimate>,
    pub max_wait_ms: Option<u64>,
    pub max_queue: Option<usize>,
    pub retry_reserve: Option<f64>,
    pub shadow: Option<bool>,
}

/// `pools[].input_estimate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputEstimate {
    /// The built-in text estimate, calibrated online.
    Heuristic,
    /// Ask upstream CountTokens (free of charge) before admitting.
    CountTokens,
}

/// A quota pool: the unit Bedrock enforces quota on (model x Region x inference route).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    pub name: String,
    pub models: Vec<String>,
    pub region: String,
    pub tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: u32,
    pub output_burndown: u32,
    pub default_max_tokens: u64,
    /// Reserved for the whole of an InvokeModelWithBidirectionalStream session, whose input and
    /// output are not known when it opens (`bidirectional_reservation`, else `default_max_tokens`).
    pub bidirectional_reservation: u64,
    /// Fraction of the bucket kept free, in `[0, 1)`.
    pub headroom: f64,
    pub input_estimate: InputEstimate,
    /// How long a request that does not fit may wait in the admission queue; zero rejects at once.
    pub max_wait: Duration,
    /// Most requests waiting in this pool's queue at once.
    pub max_queue: usize,
    /// Fraction of the bucket first attempts leave for SDK retries.
    pub retry_reserve: f64,
    /// Decide and count, but forward everything.
    pub shadow: bool,
    /// An endpoint pool's endpoint (`[[endpoints]]`); `None` for a Bedrock pool.
    pub endpoint: Option<EndpointConfig>,
}

impl PoolConfig {
    /// Tokens per minute after headroom: the capacity admission works with.
    pub fn usable_tokens_per_minute(&self) -> u64 {
        ((self.tokens_per_minute as f64) * (1.0 - self.headroom)).floor() as u64
    }

    /// Whether a reservation of `tokens` fits the bucket at all (else it could never be admitted).
    pub fn can_ever_hold(&self, tokens: u64) -> bool {
        tokens <= self.usable_tokens_per_minute()
    }
}

/// Validates pool `i`; `default_region` is `upstream.region`.
pub(super) fn validate(
    i: usize,
    raw: RawPool,
    default_region: &str,
) -> Result<PoolConfig, ConfigError> {
    let key = |field: &str| {
        if raw.name.is_empty() {
            format!("pools[{i}].{field}")
        } else {
            format!("pools[{i}] ({}).{field}", raw.name)
        }
    };
    check_identity(&raw, &key)?;
    let nonzero = |field: &str, v: u64| {
        if v == 0 {
            Err(invalid(key(field), "must be greater than zero"))
        } else {
            Ok(v)
        }
    };
    let tokens_per_minute = nonzero("tokens_per_minute", raw.tokens_per_minute)?;
    if tokens_per_minute > MAX_TOKENS_PER_MINUTE {
        return Err(invalid(
            key("tokens_per_minute"),
            format!("must be at most {MAX_TOKENS_PER_MINUTE}"),
        ));
    }
    let requests_per_minute = raw
        .requests_per_minute
        .map(|v| nonzero("requests_per_minute", v))
        .transpose()?;
    let max_concurrency = nonzero("max_concurrency", u64::from(raw.max_concurrency))? as u32;
    if raw.output_burndown < 1 {
        return Err(invalid(
            key("output_burndown"),
            "must be at least 1 (5 for Claude 3.7 and Claude 4 models, 1 for most others)",
        ));
    }
    let default_max_tokens = nonzero("default_max_tokens", raw.default_max_tokens)?;
    let headroom = raw.headroom.unwrap_or(0.0);
    if !(0.0..0.9).contains(&headroom) {
        return Err(invalid(
            key("headroom"),
            "must be a fraction in [0, 0.9), e.g. 0.05",
        ));
    }
    let (max_wait, max_queue) = queue_settings(raw.max_wait_ms, raw.max_queue, &key)?;
    let retry_reserve = fraction(&key("retry_reserve"), raw.retry_reserve.unwrap_or(0.0), 0.5)?;
    let pool = PoolConfig {
        name: raw.name.clone(),
        models: raw.models,
        region: raw.region.unwrap_or_else(|| default_region.to_string()),
        tokens_per_minute,
        requests_per_minute,
        max_concurrency,
        output_burndown: raw.output_burndown,
        default_max_tokens,
        bidirectional_reservation: match raw.bidirectional_reservation {
            Some(v) => nonzero("bidirectional_reservation", v)?,
            None => default_max_tokens,
        },
        headroom,
        input_estimate: raw.input_estimate.unwrap_or(InputEstimate::Heuristic),
        max_wait,
        max_queue,
        retry_reserve,
        shadow: raw.shadow.unwrap_or(false),
        endpoint: None,
    };
    reservations_fit(&pool, &key)?;
    Ok(pool)
}

/// A pool's fixed reservations (`default_max_tokens`, `bidirectional_reservation`) must fit its
/// bucket, or requests that use them could never be admitted.
fn reservations_fit(pool: &PoolConfig, key: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    for (name, tokens) in [
        ("default_max_tokens", pool.default_max_tokens),
        ("bidirectional_reservation", pool.bidirectional_reservation),
    ] {
        if tokens >= pool.usable_tokens_per_minute() {
            return Err(invalid(
                key(name),
                format!(
                    "{tokens} does not fit in the bucket ({} tokens per minute after headroom): lower it",
                    pool.usable_tokens_per_minute()
                ),
            ));
        }
    }
    Ok(())
}

/// The pool's name and model list.
fn check_identity(raw: &RawPool, key: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    if !is_pool_name(&raw.name) {
        return Err(invalid(
            key("name"),
            "must be non-empty letters, digits, '-', '_' or '.'",
        ));
    }
    if raw.models.is_empty() {
        return Err(invalid(key("models"), "list at least one model id"));
    }
    if let Some(m) = raw
        .models
        .iter()
        .find(|m| m.trim().is_empty() || m.trim() != m.as_str())
    {
        return Err(invalid(key("models"), format!("{m:?} is not a model id")));
    }
    Ok(())
}

/// A pool's name (also its metrics label): letters, digits, '-', '_' and '.'.
pub(super) fn is_pool_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// `max_wait_ms` and `max_queue` of a pool or an endpoint; `key` names a field of its table.
pub(super) fn queue_settings(
    max_wait_ms: Option<u64>,
    max_queue: Option<usize>,
    key: &dyn Fn(&str) -> String,
) -> Result<(Duration, usize), ConfigError> {
    let max_wait_ms = max_wait_ms.unwrap_or(DEFAULT_MAX_WAIT_MS);
    if max_wait_ms > MAX_WAIT_LIMIT_MS {
        return Err(invalid(
            key("max_wait_ms"),
            format!(
                "{max_wait_ms} is longer than {MAX_WAIT_LIMIT_MS} ms; SDK read timeouts and retry budgets make longer waits useless"
            ),
        ));
    }
    let max_queue = max_queue.unwrap_or(DEFAULT_MAX_QUEUE);
    if max_queue == 0 && max_wait_ms > 0 {
        return Err(invalid(
            key("max_queue"),
            "must be greater than zero when max_wait_ms is (set max_wait_ms = 0 to disable queueing)",
        ));
    }
    Ok((Duration::from_millis(max_wait_ms), max_queue))
}

/// Pool names are unique, and a model (or an endpoint pool's name, which route allow-lists
/// share with model ids) belongs to one pool. `pools` holds `[[pools]]` then `[[endpoints]]`.
pub(super) fn check_disjoint(pools: &[PoolConfig]) -> Result<(), ConfigError> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    let mut names: BTreeMap<&str, usize> = BTreeMap::new();
    let bedrock = pools.iter().filter(|p| p.endpoint.is_none()).count();
    for (i, pool) in pools.iter().enumerate() {
        // An endpoint pool's one "model" is its name.
        let (table, models_key) = match pool.endpoint {
            None => (format!("pools[{i}]"), "models"),
            Some(_) => (format!("endpoints[{}]", i - bedrock), "name"),
        };
        if names.insert(&pool.name, i).is_some() {
            return Err(invalid(
                format!("{table}.name"),
                format!(
                    "{:?} names two pools (or endpoints); pool names must be unique",
                    pool.name
                ),
            ));
        }
        for model in &pool.models {
            if let Some(other) = seen.insert(model, &pool.name) {
                return Err(invalid(
                    format!("{table} ({}).{models_key}", pool.name),
                    format!("{model:?} is already in pool {other:?}; a model belongs to one pool"),
                ));
            }
        }
    }
    Ok(())
}
