//! `[[pools]]`: the units Bedrock enforces quota on (model x Region x inference route x tier),
//! their limits, the model facts in force (the built-in catalogue's, or the pool's own), what a
//! request that names no output cap reserves, and how requests that do not fit wait.

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use super::{ConfigError, EndpointConfig, fraction, invalid};
use crate::bedrock::{catalogue, max_tokens::MAX_TOKENS_LIMIT};

/// Default admission-queue wait: long enough to ride out a refill or a completion, short
/// against SDK timeouts.
const DEFAULT_MAX_WAIT_MS: u64 = 2_000;
const MAX_WAIT_LIMIT_MS: u64 = 30_000;
const DEFAULT_MAX_QUEUE: usize = 1_000;
/// The largest bucket the ledgers keep exact.
pub const MAX_TOKENS_PER_MINUTE: u64 = 1_000_000_000;
/// The largest daily bucket the ledgers keep exact (see `ledger::window`).
pub use crate::ledger::units::MAX_TOKENS_PER_WINDOW;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    pub name: String,
    pub models: Vec<String>,
    pub region: Option<String>,
    pub tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: u32,
    pub output_burndown: Option<u32>,
    pub max_output_tokens: Option<u64>,
    pub default_max_tokens: u64,
    pub when_max_tokens_missing: Option<WhenMaxTokensMissing>,
    pub tokens_per_day: Option<u64>,
    pub tier: Option<PoolTier>,
    pub bidirectional_reservation: Option<u64>,
    pub headroom: Option<f64>,
    pub input_estimate: Option<InputEstimate>,
    pub max_wait_ms: Option<u64>,
    pub max_queue: Option<usize>,
    pub retry_reserve: Option<f64>,
    pub shadow: Option<bool>,
    pub spill_to: Option<Vec<String>>,
    pub spill_cached: Option<bool>,
}

/// `pools[].when_max_tokens_missing`: what a request that names no `maxTokens` reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenMaxTokensMissing {
    /// Reserve the model's maximum output, exactly what Bedrock reserves (the default).
    ReserveModelMax,
    /// Write `default_max_tokens` into the forwarded body and reserve it: Bedrock then reserves
    /// the same.
    Inject,
    /// 400 `ValidationException` naming the field to send.
    Reject,
}

impl WhenMaxTokensMissing {
    /// The config value, and the `action` label of `tokengate_max_tokens_missing_total`.
    pub fn label(self) -> &'static str {
        match self {
            WhenMaxTokensMissing::ReserveModelMax => "reserve_model_max",
            WhenMaxTokensMissing::Inject => "inject",
            WhenMaxTokensMissing::Reject => "reject",
        }
    }
}

/// `pools[].tier`: which of Bedrock's capacities the pool stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolTier {
    /// The on-demand quota, shared by the `priority`, `default` and `flex` service tiers.
    OnDemand,
    /// Reserved capacity (the `reserved` service tier), which overflows to on-demand when full.
    Reserved,
}

impl PoolTier {
    pub fn label(self) -> &'static str {
        match self {
            PoolTier::OnDemand => "on_demand",
            PoolTier::Reserved => "reserved",
        }
    }
}

/// Where a value in force comes from (`tokengate check-config` prints it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Set in the pool's config.
    Config,
    /// The built-in catalogue's figure for the family named, certain or not.
    Catalogue { family: &'static str, certain: bool },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Config => f.write_str("from the config"),
            Source::Catalogue {
                family,
                certain: true,
            } => write!(f, "catalogue: {family}"),
            Source::Catalogue {
                family,
                certain: false,
            } => write!(f, "catalogue: {family}, uncertain"),
        }
    }
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
    /// Quota tokens per output token (the pool's, or the catalogue's for its models).
    pub output_burndown: u32,
    /// The model's maximum output: what Bedrock reserves for a call that names no `maxTokens`.
    pub max_output_tokens: u64,
    /// Where `output_burndown` and `max_output_tokens` come from.
    pub sources: FactSources,
    /// What `inject` writes into a request that names no `maxTokens`.
    pub default_max_tokens: u64,
    pub when_max_tokens_missing: WhenMaxTokensMissing,
    /// The daily quota: a bucket refilling continuously over 24 hours.
    pub tokens_per_day: Option<u64>,
    pub tier: PoolTier,
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
    /// Pools a request may run in when this one cannot admit it now, in order
    /// ([`super::spill`]).
    pub spill_to: Vec<String>,
    /// Whether a request with a prompt-cache point may spill (its cache is in this Region).
    pub spill_cached: bool,
    /// An endpoint pool's endpoint (`[[endpoints]]`); `None` for a Bedrock pool.
    pub endpoint: Option<EndpointConfig>,
}

/// Where a pool's model facts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FactSources {
    pub output_burndown: Source,
    pub max_output_tokens: Source,
}

impl PoolConfig {
    /// Tokens per minute after headroom: the capacity admission works with.
    pub fn usable_tokens_per_minute(&self) -> u64 {
        ((self.tokens_per_minute as f64) * (1.0 - self.headroom)).floor() as u64
    }

    /// The model id a request spilled into this pool is sent with: its first configured model.
    pub fn model_id(&self) -> &str {
        self.models.first().map_or("", String::as_str)
    }

    /// The values in force, one line, with where the model facts come from (`check-config`).
    pub fn in_force(&self) -> String {
        let day = self
            .tokens_per_day
            .map_or_else(|| "none".to_string(), |d| d.to_string());
        format!(
            "pool {:?} ({}): tokens_per_minute = {}, tokens_per_day = {day}, max_output_tokens = {} ({}), \
             output_burndown = {} ({}), when_max_tokens_missing = {:?}, default_max_tokens = {}",
            self.name,
            self.tier.label(),
            self.tokens_per_minute,
            self.max_output_tokens,
            self.sources.max_output_tokens,
            self.output_burndown,
            self.sources.output_burndown,
            self.when_max_tokens_missing.label(),
            self.default_max_tokens,
        )
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
    let facts = model_facts(&raw, &key)?;
    let default_max_tokens = nonzero("default_max_tokens", raw.default_max_tokens)?;
    let tokens_per_day = raw
        .tokens_per_day
        .map(|v| window_limit(&key("tokens_per_day"), v))
        .transpose()?;
    let headroom = headroom(raw.headroom, &key)?;
    if let Some(region) = &raw.region {
        super::upstream::region(&key("region"), region.clone())?;
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
        output_burndown: facts.output_burndown,
        max_output_tokens: facts.max_output_tokens,
        sources: facts.sources,
        default_max_tokens,
        when_max_tokens_missing: raw
            .when_max_tokens_missing
            .unwrap_or(WhenMaxTokensMissing::ReserveModelMax),
        tokens_per_day,
        tier: raw.tier.unwrap_or(PoolTier::OnDemand),
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
        spill_to: raw.spill_to.unwrap_or_default(),
        spill_cached: raw.spill_cached.unwrap_or(true),
        endpoint: None,
    };
    reservations_fit(&pool, &key)?;
    day_holds_a_minute(&pool, &key)?;
    Ok(pool)
}

/// `headroom`: a fraction in `[0, 0.9)`, 0 when absent.
fn headroom(raw: Option<f64>, key: &dyn Fn(&str) -> String) -> Result<f64, ConfigError> {
    let headroom = raw.unwrap_or(0.0);
    if !(0.0..0.9).contains(&headroom) {
        return Err(invalid(
            key("headroom"),
            "must be a fraction in [0, 0.9), e.g. 0.05",
        ));
    }
    Ok(headroom)
}

/// A daily quota below a minute's would make the per-minute limit meaningless: a mistake.
fn day_holds_a_minute(pool: &PoolConfig, key: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    match pool.tokens_per_day {
        Some(day) if day < pool.usable_tokens_per_minute() => Err(invalid(
            key("tokens_per_day"),
            format!(
                "{day} is less than a minute's quota ({} tokens per minute after headroom); Bedrock's daily quota is by default 1,440 minutes' worth",
                pool.usable_tokens_per_minute()
            ),
        )),
        _ => Ok(()),
    }
}

/// A limit of a long window (a day, a route's budget): positive and within the ledgers' exact
/// range.
pub(super) fn window_limit(key: &str, v: u64) -> Result<u64, ConfigError> {
    if v == 0 {
        return Err(invalid(
            key,
            "must be greater than zero (remove the key for no limit)",
        ));
    }
    if v > MAX_TOKENS_PER_WINDOW {
        return Err(invalid(
            key,
            format!("must be at most {MAX_TOKENS_PER_WINDOW}, the largest the ledgers keep exact"),
        ));
    }
    Ok(v)
}

/// The burndown and maximum output in force, and where they come from.
struct Facts {
    output_burndown: u32,
    max_output_tokens: u64,
    sources: FactSources,
}

/// `output_burndown` and `max_output_tokens`: the pool's own, or the catalogue's for its models
/// (the largest among them). A value the pool does not set needs every model it lists known.
fn model_facts(raw: &RawPool, key: &dyn Fn(&str) -> String) -> Result<Facts, ConfigError> {
    let burndown = match raw.output_burndown {
        Some(0) => {
            return Err(invalid(
                key("output_burndown"),
                "must be at least 1 (5 for Claude 3.7 and Claude 4 models, 1 for most others)",
            ));
        }
        Some(b) => (u64::from(b), Source::Config),
        None => from_catalogue(raw, &key("output_burndown"), |f| Some(f.output_burndown))?,
    };
    let max_output = match raw.max_output_tokens {
        Some(m) if m == 0 || m > MAX_TOKENS_LIMIT => {
            return Err(invalid(
                key("max_output_tokens"),
                format!("must be a positive integer no larger than {MAX_TOKENS_LIMIT}"),
            ));
        }
        Some(m) => (m, Source::Config),
        None => from_catalogue(raw, &key("max_output_tokens"), |f| f.max_output_tokens)?,
    };
    Ok(Facts {
        output_burndown: u32::try_from(burndown.0).unwrap_or(u32::MAX),
        max_output_tokens: max_output.0,
        sources: FactSources {
            output_burndown: burndown.1,
            max_output_tokens: max_output.1,
        },
    })
}

/// The largest catalogue figure among the pool's models (`figure` picks which), or the error
/// naming `key` and the first model the catalogue cannot answer for.
fn from_catalogue(
    raw: &RawPool,
    key: &str,
    figure: impl Fn(&catalogue::ModelFacts) -> Option<catalogue::Figure>,
) -> Result<(u64, Source), ConfigError> {
    let mut best: Option<(u64, Source)> = None;
    for model in &raw.models {
        let found = catalogue::lookup(model).and_then(|facts| {
            figure(&facts).map(|f| {
                let source = Source::Catalogue {
                    family: facts.family,
                    certain: f.certain,
                };
                (f.value, source)
            })
        });
        let Some((value, source)) = found else {
            return Err(invalid(
                key,
                format!(
                    "the built-in model catalogue has no figure for {model:?}: set it for this pool"
                ),
            ));
        };
        if best.is_none_or(|(b, _)| value > b) {
            best = Some((value, source));
        }
    }
    best.ok_or_else(|| invalid(key, "the pool lists no model to look up"))
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
/// share with model ids) belongs to one pool of each tier; a model with reserved capacity has an
/// on-demand pool too (reserved capacity overflows to it). `pools` holds `[[pools]]` then
/// `[[endpoints]]`.
pub(super) fn check_disjoint(pools: &[PoolConfig]) -> Result<(), ConfigError> {
    let mut seen: BTreeMap<(&str, PoolTier), &str> = BTreeMap::new();
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
            if let Some(other) = seen.insert((model, pool.tier), &pool.name) {
                return Err(invalid(
                    format!("{table} ({}).{models_key}", pool.name),
                    format!(
                        "{model:?} is already in pool {other:?}; a model belongs to one pool (of each tier)"
                    ),
                ));
            }
        }
    }
    for (i, pool) in pools.iter().enumerate() {
        if pool.tier != PoolTier::Reserved {
            continue;
        }
        if let Some(model) = pool
            .models
            .iter()
            .find(|m| !seen.contains_key(&(m.as_str(), PoolTier::OnDemand)))
        {
            return Err(invalid(
                format!("pools[{i}] ({}).models", pool.name),
                format!(
                    "{model:?} has reserved capacity but no on_demand pool: reserved capacity overflows to on-demand, so list it in an on_demand pool too"
                ),
            ));
        }
    }
    Ok(())
}
