//! `[[routes]]`: application routes (a team or workload class): their credentials, the models
//! they may call, their ceilings and their share of each pool.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{AuthMode, ConfigError, Env, PoolConfig, Secret, invalid};
use crate::bedrock::tier::ServiceTier;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: String,
    pub priority: Option<i32>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub secret_access_key_env: Option<String>,
    pub bearer_token_sha256: Option<String>,
    pub models: Option<Vec<String>>,
    pub max_tokens_ceiling: Option<u64>,
    pub max_tokens_policy: Option<MaxTokensPolicy>,
    pub adaptive_max_tokens: Option<super::adaptive::RawAdaptive>,
    pub adaptive_retry: Option<bool>,
    pub shadow: Option<bool>,
    pub recovery_budget: Option<f64>,
    pub spill: Option<bool>,
    pub regions: Option<Vec<String>>,
    #[serde(default)]
    pub shares: BTreeMap<String, RawShare>,
    pub budgets: Option<RawBudgets>,
    pub max_concurrency: Option<u32>,
    pub allowed_tiers: Option<Vec<ServiceTier>>,
    pub service_tier: Option<ServiceTier>,
}

/// `routes[].budgets`: tokens the route may use per hour, day and 30 days, across pools.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudgets {
    pub tokens_per_hour: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub tokens_per_30_days: Option<u64>,
}

/// A route's budgets, across every pool and replica (each a bucket refilling over its window).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteBudgets {
    pub tokens_per_hour: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub tokens_per_30_days: Option<u64>,
}

impl RouteBudgets {
    /// The ledger windows, shortest first.
    pub fn windows(&self) -> Vec<crate::ledger::BudgetWindow> {
        const HOUR_MS: u64 = 3_600_000;
        const DAY_MS: u64 = 24 * HOUR_MS;
        [
            ("tokens_per_hour", self.tokens_per_hour, HOUR_MS),
            ("tokens_per_day", self.tokens_per_day, DAY_MS),
            ("tokens_per_30_days", self.tokens_per_30_days, 30 * DAY_MS),
        ]
        .into_iter()
        .filter_map(|(name, capacity, window_ms)| {
            capacity.map(|capacity| crate::ledger::BudgetWindow {
                name,
                capacity,
                window_ms,
            })
        })
        .collect()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShare {
    pub min: Option<f64>,
    pub max: Option<f64>,
}

/// What happens to a request whose maxTokens is above the route's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MaxTokensPolicy {
    /// Lower it to the ceiling (the forwarded body is rewritten).
    Clamp,
    /// 400 `ValidationException`.
    Reject,
}

/// A route's share of one pool, as fractions of the pool's tokens per minute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShareConfig {
    pub min: f64,
    pub max: Option<f64>,
}

/// An application route: a team or workload class.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    pub name: String,
    pub priority: i32,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<Secret>,
    /// SHA-256 of the bearer key.
    pub bearer_token_sha256: Option<[u8; 32]>,
    /// Model ids this route may call; `None`: any model of any pool.
    pub models: Option<Vec<String>>,
    pub max_tokens_ceiling: Option<u64>,
    pub max_tokens_policy: MaxTokensPolicy,
    /// The output cap learned from the route's outputs ([`crate::admission::adaptive`]);
    /// `None`: the caller's own `maxTokens` (within the ceiling) is forwarded.
    pub adaptive_max_tokens: Option<super::AdaptiveMaxTokens>,
    /// A non-streamed call that stopped at the learned cap is sent again with the caller's own
    /// `maxTokens` (a second call, admitted as any), and that answer returned
    /// (`crate::proxy::adaptive_retry`). Only with `adaptive_max_tokens`.
    pub adaptive_retry: bool,
    /// Decide and count, but forward everything.
    pub shadow: bool,
    /// Fraction of a pool's tokens per minute this route's retries may take from the pool's
    /// retry reserve; `None`: the whole reserve.
    pub recovery_budget: Option<f64>,
    /// Per pool name.
    pub shares: BTreeMap<String, ShareConfig>,
    /// Across pools and replicas.
    pub budgets: RouteBudgets,
    /// Calls of this route in flight at once, across pools and replicas.
    pub max_concurrency: Option<u32>,
    /// The service tiers it may ask for; `None`: any.
    pub allowed_tiers: Option<Vec<ServiceTier>>,
    /// The service tier every call of the route runs in, whatever it asks for: written into the
    /// forwarded request (Converse's `serviceTier`, InvokeModel's header); `None`: the call's own.
    pub service_tier: Option<ServiceTier>,
    /// Whether its requests may run in the pools of their home pool's `spill_to` chain.
    pub spill: bool,
    /// The Regions its requests may run in (data residency); `None`: any.
    pub regions: Option<Vec<String>>,
}

impl RouteConfig {
    /// The implicit route of a config without `[[routes]]`.
    pub fn implicit(name: &str) -> RouteConfig {
        RouteConfig {
            name: name.to_string(),
            priority: 0,
            access_key_id: None,
            secret_access_key: None,
            bearer_token_sha256: None,
            models: None,
            max_tokens_ceiling: None,
            max_tokens_policy: MaxTokensPolicy::Clamp,
            adaptive_max_tokens: None,
            adaptive_retry: false,
            shadow: false,
            recovery_budget: None,
            shares: BTreeMap::new(),
            budgets: RouteBudgets::default(),
            max_concurrency: None,
            allowed_tiers: None,
            service_tier: None,
            // Without [[routes]], the pools' own spill_to chains are the only opt-in.
            spill: true,
            regions: None,
        }
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Validates every `[[routes]]` entry for auth `mode` against the pools; `env` reads environment
/// variables (`secret_access_key_env`).
pub(super) fn validate(
    routes: Vec<RawRoute>,
    mode: AuthMode,
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
    env: &Env,
) -> Result<Vec<RouteConfig>, ConfigError> {
    let mut out: Vec<RouteConfig> = Vec::with_capacity(routes.len());
    for (i, raw) in routes.into_iter().enumerate() {
        let route = validate_route(i, raw, mode, pools, application_profiles, env)?;
        check_unique(i, &route, &out)?;
        out.push(route);
    }
    for pool in pools {
        let total: f64 = out
            .iter()
            .filter_map(|r| r.shares.get(&pool.name))
            .map(|s| s.min)
            .sum();
        if total > 1.0 + 1e-9 {
            return Err(invalid(
                "routes.shares",
                format!(
                    "the min shares of pool {:?} add up to {total:.3}; guarantees cannot exceed the whole pool (1.0)",
                    pool.name
                ),
            ));
        }
    }
    Ok(out)
}

/// Route `i` has a name, a key and a bearer key no route before it has.
fn check_unique(i: usize, route: &RouteConfig, before: &[RouteConfig]) -> Result<(), ConfigError> {
    if before.iter().any(|r| r.name == route.name) {
        return Err(invalid(
            format!("routes[{i}].name"),
            format!(
                "{:?} names two routes; route names must be unique",
                route.name
            ),
        ));
    }
    let taken = |field: &str| {
        invalid(
            format!("routes[{i}] ({}).{field}", route.name),
            "is already another route's key; each route needs its own",
        )
    };
    if let Some(key) = &route.access_key_id
        && before.iter().any(|r| r.access_key_id.as_ref() == Some(key))
    {
        return Err(taken("access_key_id"));
    }
    if let Some(hash) = &route.bearer_token_sha256
        && before
            .iter()
            .any(|r| r.bearer_token_sha256.as_ref() == Some(hash))
    {
        return Err(taken("bearer_token_sha256"));
    }
    Ok(())
}

fn validate_route(
    i: usize,
    raw: RawRoute,
    mode: AuthMode,
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
    env: &Env,
) -> Result<RouteConfig, ConfigError> {
    let key = |field: &str| {
        if raw.name.is_empty() {
            format!("routes[{i}].{field}")
        } else {
            format!("routes[{i}] ({}).{field}", raw.name)
        }
    };
    if !valid_name(&raw.name) {
        return Err(invalid(
            key("name"),
            "must be 1 to 64 letters, digits, '-', '_' or '.'",
        ));
    }
    let (secret_access_key, bearer_token_sha256) = credentials(&raw, mode, env, &key)?;
    if let Some(models) = &raw.models {
        check_models(models, pools, application_profiles, &key)?;
    }
    if raw.max_tokens_ceiling == Some(0) {
        return Err(invalid(
            key("max_tokens_ceiling"),
            "must be greater than zero",
        ));
    }
    if let Some(b) = raw.recovery_budget
        && !(0.0..=1.0).contains(&b)
    {
        return Err(invalid(
            key("recovery_budget"),
            "must be a fraction of the pool in [0, 1], e.g. 0.05",
        ));
    }
    let shares = shares(&raw.shares, pools, &key)?;
    let budgets = budgets(raw.budgets.as_ref(), &key)?;
    let allowed_tiers = tiers(raw.allowed_tiers, raw.service_tier, &key)?;
    if raw.max_concurrency == Some(0) {
        return Err(invalid(
            key("max_concurrency"),
            "must be greater than zero (remove the key for no limit)",
        ));
    }
    let adaptive_max_tokens = super::adaptive::validate(raw.adaptive_max_tokens, pools, &key)?;
    let adaptive_retry =
        super::adaptive::validate_retry(raw.adaptive_retry, adaptive_max_tokens.is_some(), &key)?;
    for region in raw.regions.iter().flatten() {
        super::upstream::region(&key("regions"), region.clone())?;
    }
    Ok(RouteConfig {
        name: raw.name,
        priority: raw.priority.unwrap_or(0),
        access_key_id: raw.access_key_id,
        secret_access_key,
        bearer_token_sha256,
        models: raw.models,
        max_tokens_ceiling: raw.max_tokens_ceiling,
        max_tokens_policy: raw.max_tokens_policy.unwrap_or(MaxTokensPolicy::Clamp),
        adaptive_max_tokens,
        adaptive_retry,
        shadow: raw.shadow.unwrap_or(false),
        recovery_budget: raw.recovery_budget,
        shares,
        budgets,
        max_concurrency: raw.max_concurrency,
        allowed_tiers,
        service_tier: raw.service_tier,
        spill: raw.spill.unwrap_or(false),
        regions: raw.regions,
    })
}

/// `allowed_tiers` (not empty when set), and the forced `service_tier` among them.
fn tiers(
    allowed: Option<Vec<ServiceTier>>,
    forced: Option<ServiceTier>,
    key: &impl Fn(&str) -> String,
) -> Result<Option<Vec<ServiceTier>>, ConfigError> {
    let allowed_tiers = match allowed {
        Some(tiers) if tiers.is_empty() => {
            return Err(invalid(
                key("allowed_tiers"),
                "is empty: list the tiers the route may use (priority, default, flex, reserved), or remove the key",
            ));
        }
        tiers => tiers,
    };
    if let (Some(forced), Some(allowed)) = (forced, &allowed_tiers)
        && !allowed.contains(&forced)
    {
        return Err(invalid(
            key("service_tier"),
            format!(
                "is {:?}, which the route's allowed_tiers leave out: add it there or choose one of them",
                forced.label()
            ),
        ));
    }
    Ok(allowed_tiers)
}

/// `budgets`: each window positive and within the ledgers' exact range, at least one set, and a
/// longer window holding at least a shorter one's tokens.
fn budgets(
    raw: Option<&RawBudgets>,
    key: &dyn Fn(&str) -> String,
) -> Result<RouteBudgets, ConfigError> {
    let Some(raw) = raw else {
        return Ok(RouteBudgets::default());
    };
    let check = |field: &str, v: Option<u64>| {
        v.map(|v| super::pools::window_limit(&key(&format!("budgets.{field}")), v))
            .transpose()
    };
    let budgets = RouteBudgets {
        tokens_per_hour: check("tokens_per_hour", raw.tokens_per_hour)?,
        tokens_per_day: check("tokens_per_day", raw.tokens_per_day)?,
        tokens_per_30_days: check("tokens_per_30_days", raw.tokens_per_30_days)?,
    };
    let windows = budgets.windows();
    if windows.is_empty() {
        return Err(invalid(
            key("budgets"),
            "names no limit: set tokens_per_hour, tokens_per_day or tokens_per_30_days (or remove the table)",
        ));
    }
    for pair in windows.windows(2) {
        if pair[1].capacity < pair[0].capacity {
            return Err(invalid(
                key(&format!("budgets.{}", pair[1].name)),
                format!(
                    "{} is less than {} = {}: the longer window would always bind first",
                    pair[1].capacity, pair[0].name, pair[0].capacity
                ),
            ));
        }
    }
    Ok(budgets)
}

/// The route's SigV4 secret and bearer key hash, as auth `mode` needs them.
fn credentials(
    raw: &RawRoute,
    mode: AuthMode,
    env: &Env,
    key: &dyn Fn(&str) -> String,
) -> Result<(Option<Secret>, Option<[u8; 32]>), ConfigError> {
    let secret_access_key = match (&raw.secret_access_key, &raw.secret_access_key_env) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                key("secret_access_key"),
                "set secret_access_key or secret_access_key_env, not both",
            ));
        }
        (Some(s), None) => Some(Secret(s.clone())),
        (None, Some(var)) => Some(Secret(env(var).filter(|v| !v.is_empty()).ok_or_else(
            || {
                invalid(
                    key("secret_access_key_env"),
                    format!("the environment variable {var:?} is not set or empty"),
                )
            },
        )?)),
        (None, None) => None,
    };
    if let Some(id) = &raw.access_key_id
        && (id.len() < 16 || id.len() > 128 || !id.chars().all(|c| c.is_ascii_alphanumeric()))
    {
        return Err(invalid(
            key("access_key_id"),
            "must be 16 to 128 letters and digits, like an AWS access key id (AKIA...)",
        ));
    }
    let bearer_token_sha256 = raw
        .bearer_token_sha256
        .as_deref()
        .map(|h| {
            let mut out = [0u8; 32];
            hex::decode_to_slice(h.trim(), &mut out)
                .map(|()| out)
                .map_err(|_| {
                    invalid(
                        key("bearer_token_sha256"),
                        "must be 64 hex digits: the SHA-256 of the key (printf %s KEY | sha256sum)",
                    )
                })
        })
        .transpose()?;
    match mode {
        AuthMode::SigV4 if raw.access_key_id.is_none() || secret_access_key.is_none() => {
            Err(invalid(
                key("access_key_id"),
                "auth.mode = \"sigv4\" needs access_key_id and secret_access_key_env (or secret_access_key) on every route",
            ))
        }
        AuthMode::Bearer if bearer_token_sha256.is_none() => Err(invalid(
            key("bearer_token_sha256"),
            "auth.mode = \"bearer\" needs bearer_token_sha256 on every route",
        )),
        _ => Ok((secret_access_key, bearer_token_sha256)),
    }
}

/// A route's allow-list names pooled models (or application profiles) only.
fn check_models(
    models: &[String],
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
    key: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if models.is_empty() {
        return Err(invalid(
            key("models"),
            "an empty allow-list admits nothing; remove the key to allow every pooled model",
        ));
    }
    for model in models {
        let pooled = pools.iter().any(|p| p.models.contains(model))
            || application_profiles.contains_key(model);
        if !pooled {
            return Err(invalid(
                key("models"),
                format!("{model:?} is in no pool's models (nor admission.application_profiles)"),
            ));
        }
    }
    Ok(())
}

/// The route's `shares` table: each names a pool, with `0 <= min <= max <= 1`.
fn shares(
    raw: &BTreeMap<String, RawShare>,
    pools: &[PoolConfig],
    key: &dyn Fn(&str) -> String,
) -> Result<BTreeMap<String, ShareConfig>, ConfigError> {
    let mut shares = BTreeMap::new();
    for (pool, share) in raw {
        let field = format!("shares.{pool}");
        let Some(target) = pools.iter().find(|p| &p.name == pool) else {
            return Err(invalid(
                key(&field),
                format!("there is no pool named {pool:?}"),
            ));
        };
        if target
            .endpoint
            .as_ref()
            .is_some_and(|e| e.tokens_per_second_per_copy.is_none())
        {
            return Err(invalid(
                key(&field),
                format!(
                    "shares divide a pool's tokens, and endpoint pool {pool:?} has no token envelope: \
                     set its tokens_per_second_per_copy, or remove this share"
                ),
            ));
        }
        let min = share.min.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min) {
            return Err(invalid(key(&field), "min must be a fraction in [0, 1]"));
        }
        if let Some(max) = share.max
            && !(max > 0.0 && max <= 1.0 && max >= min)
        {
            return Err(invalid(
                key(&field),
                "max must be a fraction in (0, 1] and at least min",
            ));
        }
        shares.insert(
            pool.clone(),
            ShareConfig {
                min,
                max: share.max.filter(|m| *m < 1.0),
            },
        );
    }
    Ok(shares)
}
