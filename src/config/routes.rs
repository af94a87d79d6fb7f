//! `[auth]` and `[[routes]]`: who may call, as which route, with which share of each pool.

use std::{collections::BTreeMap, fmt};

use serde::Deserialize;

use super::{ConfigError, PoolConfig, ServerConfig, UpstreamConfig, invalid};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub mode: Option<String>,
    pub default_route: Option<String>,
    pub allow_plaintext_bearer: Option<bool>,
}

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
    pub max_tokens_policy: Option<String>,
    pub shadow: Option<bool>,
    pub recovery_budget: Option<f64>,
    #[serde(default)]
    pub shares: BTreeMap<String, RawShare>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShare {
    pub min: Option<f64>,
    pub max: Option<f64>,
}

/// How callers identify themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// No identification: every request is the default route (a loopback sidecar).
    None,
    /// `Authorization: Bearer <key>`, the key's SHA-256 configured per route.
    Bearer,
    /// The SDK's own SigV4 signature, with a key pair issued per route.
    SigV4,
}

impl AuthMode {
    pub fn label(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Bearer => "bearer",
            AuthMode::SigV4 => "sigv4",
        }
    }
}

#[derive(Debug, Clone)]
pub struct AuthConfig {
    pub mode: AuthMode,
    /// The route of every request in mode `none`.
    pub default_route: String,
    /// The Regions this proxy serves (`upstream.region` and every pool's): a SigV4 credential
    /// scope must name one of them.
    pub regions: Vec<String>,
}

/// A secret from the config file or the environment; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// What happens to a request whose maxTokens is above the route's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Decide and count, but forward everything.
    pub shadow: bool,
    /// Fraction of a pool's tokens per minute this route's retries may take from the pool's
    /// retry reserve; `None`: the whole reserve.
    pub recovery_budget: Option<f64>,
    /// Per pool name.
    pub shares: BTreeMap<String, ShareConfig>,
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
            shadow: false,
            recovery_budget: None,
            shares: BTreeMap::new(),
        }
    }
}

const DEFAULT_ROUTE: &str = "default";

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Validates `[auth]` and `[[routes]]` against the pools and the listener (plaintext bearer keys
/// only on loopback). `env` reads environment variables (`secret_access_key_env`).
pub fn validate(
    auth: RawAuth,
    routes: Vec<RawRoute>,
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
    server: &ServerConfig,
    upstream: &UpstreamConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(AuthConfig, Vec<RouteConfig>), ConfigError> {
    let mode = match auth.mode.as_deref().unwrap_or("none") {
        "none" => AuthMode::None,
        "bearer" => AuthMode::Bearer,
        "sigv4" => AuthMode::SigV4,
        other => {
            return Err(invalid(
                "auth.mode",
                format!("{other:?}: use \"none\", \"bearer\" or \"sigv4\""),
            ));
        }
    };
    check_plaintext_bearer(mode, auth.allow_plaintext_bearer.unwrap_or(false), server)?;
    let mut out: Vec<RouteConfig> = Vec::with_capacity(routes.len());
    for (i, raw) in routes.into_iter().enumerate() {
        let route = validate_route(i, raw, mode, pools, application_profiles, env)?;
        if out.iter().any(|r| r.name == route.name) {
            return Err(invalid(
                format!("routes[{i}].name"),
                format!(
                    "{:?} names two routes; route names must be unique",
                    route.name
                ),
            ));
        }
        if let Some(key) = &route.access_key_id
            && out.iter().any(|r| r.access_key_id.as_ref() == Some(key))
        {
            return Err(invalid(
                format!("routes[{i}] ({}).access_key_id", route.name),
                "is already another route's key; each route needs its own",
            ));
        }
        if let Some(hash) = &route.bearer_token_sha256
            && out
                .iter()
                .any(|r| r.bearer_token_sha256.as_ref() == Some(hash))
        {
            return Err(invalid(
                format!("routes[{i}] ({}).bearer_token_sha256", route.name),
                "is already another route's key; each route needs its own",
            ));
        }
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
    let default_route = match (mode, auth.default_route, out.len()) {
        (AuthMode::None, Some(name), _) => {
            if !out.is_empty() && !out.iter().any(|r| r.name == name) {
                return Err(invalid(
                    "auth.default_route",
                    format!("{name:?} is not the name of a [[routes]] entry"),
                ));
            }
            name
        }
        (AuthMode::None, None, 0) => DEFAULT_ROUTE.to_string(),
        (AuthMode::None, None, 1) => out[0].name.clone(),
        (AuthMode::None, None, _) => {
            return Err(invalid(
                "auth.default_route",
                "with auth.mode = \"none\" and several routes, name the route every request belongs to",
            ));
        }
        (_, Some(_), _) => {
            return Err(invalid(
                "auth.default_route",
                "only applies to auth.mode = \"none\"; with keys, each key names its route",
            ));
        }
        (_, None, 0) => {
            return Err(invalid(
                "routes",
                format!(
                    "auth.mode = {:?} needs at least one [[routes]] entry with credentials",
                    mode.label()
                ),
            ));
        }
        (_, None, _) => String::new(),
    };
    if out.is_empty() {
        out.push(RouteConfig::implicit(&default_route));
    }
    Ok((
        AuthConfig {
            mode,
            default_route,
            regions: served_regions(upstream, pools),
        },
        out,
    ))
}

/// The Regions this proxy serves: `upstream.region`, then each pool's, once each.
fn served_regions(upstream: &UpstreamConfig, pools: &[PoolConfig]) -> Vec<String> {
    let mut regions = vec![upstream.region.clone()];
    for pool in pools {
        if !regions.contains(&pool.region) {
            regions.push(pool.region.clone());
        }
    }
    regions
}

/// Bearer keys travel in the clear only to a loopback listener, and only when asked for.
fn check_plaintext_bearer(
    mode: AuthMode,
    allowed: bool,
    server: &ServerConfig,
) -> Result<(), ConfigError> {
    if allowed && !server.listen.ip().is_loopback() {
        return Err(invalid(
            "auth.allow_plaintext_bearer",
            format!(
                "server.listen is {}, not a loopback address: bearer keys would cross the network in the clear; \
                 remove this key and set server.tls_cert and server.tls_key",
                server.listen
            ),
        ));
    }
    if mode == AuthMode::Bearer && server.tls.is_none() && !allowed {
        return Err(invalid(
            "auth.mode",
            "\"bearer\" sends keys in the clear without TLS (and boto3 refuses bearer auth over plain HTTP): \
             set server.tls_cert and server.tls_key, or auth.allow_plaintext_bearer = true for a loopback-only listener",
        ));
    }
    Ok(())
}

fn validate_route(
    i: usize,
    raw: RawRoute,
    mode: AuthMode,
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
    env: &dyn Fn(&str) -> Option<String>,
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
    let secret_access_key = match (raw.secret_access_key, raw.secret_access_key_env) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                key("secret_access_key"),
                "set secret_access_key or secret_access_key_env, not both",
            ));
        }
        (Some(s), None) => Some(Secret(s)),
        (None, Some(var)) => Some(Secret(env(&var).filter(|v| !v.is_empty()).ok_or_else(
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
    let bearer_token_sha256 =
        raw.bearer_token_sha256
            .as_deref()
            .map(|h| {
                let mut out = [0u8; 32];
                hex::decode_to_slice(h.trim(), &mut out).map(|()| out).map_err(|_| {
                invalid(
                    key("bearer_token_sha256"),
                    "must be 64 hex digits: the SHA-256 of the key (printf %s KEY | sha256sum)",
                )
            })
            })
            .transpose()?;
    match mode {
        AuthMode::SigV4 if raw.access_key_id.is_none() || secret_access_key.is_none() => {
            return Err(invalid(
                key("access_key_id"),
                "auth.mode = \"sigv4\" needs access_key_id and secret_access_key_env (or secret_access_key) on every route",
            ));
        }
        AuthMode::Bearer if bearer_token_sha256.is_none() => {
            return Err(invalid(
                key("bearer_token_sha256"),
                "auth.mode = \"bearer\" needs bearer_token_sha256 on every route",
            ));
        }
        _ => {}
    }
    if let Some(models) = &raw.models {
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
                    format!(
                        "{model:?} is in no pool's models (nor admission.application_profiles)"
                    ),
                ));
            }
        }
    }
    if raw.max_tokens_ceiling == Some(0) {
        return Err(invalid(
            key("max_tokens_ceiling"),
            "must be greater than zero",
        ));
    }
    let max_tokens_policy = match raw.max_tokens_policy.as_deref().unwrap_or("clamp") {
        "clamp" => MaxTokensPolicy::Clamp,
        "reject" => MaxTokensPolicy::Reject,
        other => {
            return Err(invalid(
                key("max_tokens_policy"),
                format!("{other:?}: use \"clamp\" or \"reject\""),
            ));
        }
    };
    if let Some(b) = raw.recovery_budget
        && !(0.0..=1.0).contains(&b)
    {
        return Err(invalid(
            key("recovery_budget"),
            "must be a fraction of the pool in [0, 1], e.g. 0.05",
        ));
    }
    let mut shares = BTreeMap::new();
    for (pool, share) in raw.shares {
        let field = format!("shares.{pool}");
        let Some(target) = pools.iter().find(|p| p.name == pool) else {
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
            pool,
            ShareConfig {
                min,
                max: share.max.filter(|m| *m < 1.0),
            },
        );
    }
    Ok(RouteConfig {
        name: raw.name,
        priority: raw.priority.unwrap_or(0),
        access_key_id: raw.access_key_id,
        secret_access_key,
        bearer_token_sha256,
        models: raw.models,
        max_tokens_ceiling: raw.max_tokens_ceiling,
        max_tokens_policy,
        shadow: raw.shadow.unwrap_or(false),
        recovery_budget: raw.recovery_budget,
        shares,
    })
}
