//! `[ledger]`: where reservations are kept (this process's memory, or a Redis shared by every
//! replica) and what admission does while Redis is unreachable.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Env, invalid, positive};

const DEFAULT_LEDGER_TIMEOUT_MS: u64 = 250;
const DEFAULT_LEASE_SECS: u64 = 600;
const DEFAULT_SLICE_HORIZON_MS: u64 = 250;
const DEFAULT_SLICE_MAX_FRACTION: f64 = 0.1;
const DEFAULT_SLICE_MAX_AGE_MS: u64 = 2_000;

/// `ledger.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Memory,
    Redis,
}

/// `ledger.on_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnError {
    FailClosed,
    Local,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLedger {
    pub backend: Option<Backend>,
    pub url: Option<String>,
    /// The name of an environment variable holding the URL (for a password kept in a secret).
    pub url_env: Option<String>,
    pub timeout_ms: Option<u64>,
    pub lease_secs: Option<u64>,
    pub on_error: Option<OnError>,
    pub expected_replicas: Option<u32>,
    /// `[ledger.local_leases]`: present (even empty) turns local capacity leases on.
    pub local_leases: Option<RawLocalLeases>,
}

/// `[ledger.local_leases]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLocalLeases {
    pub horizon_ms: Option<u64>,
    pub max_fraction: Option<f64>,
    pub max_age_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LedgerConfig {
    Memory,
    Redis(RedisLedgerConfig),
}

/// `[ledger] backend = "redis"`: one quota shared by every replica.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisLedgerConfig {
    /// `redis://host:6379`, `redis://user:password@host:6379/0`, `redis+unix:///path/redis.sock`,
    /// or a Redis Cluster's seed nodes, `redis+cluster://[user:password@]host:port[,host:port...]`
    /// (parsed by the ledger at start, `ledger::connection`): `url` from the file, or the value of
    /// the environment variable named by `url_env`.
    pub url: String,
    /// The longest one ledger call may take (connecting included) before it counts as failed.
    pub timeout: Duration,
    /// How long a reservation outlives its replica's last renewal (renewed every third of it).
    pub lease: Duration,
    pub on_error: OnLedgerError,
    /// `[ledger.local_leases]`: admit from slices of each pool's bucket in memory (off: every
    /// decision is a round trip).
    pub local_leases: Option<LocalLeasesConfig>,
}

/// `[ledger.local_leases]` (see `ledger::lease`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalLeasesConfig {
    /// A slice holds about twice the demand of the last `horizon_ms`; an idle slice goes back
    /// after it.
    pub horizon: Duration,
    /// The largest part of each of a pool's limits one slice holds, in (0, 1].
    pub max_fraction: f64,
    /// A slice goes back at the latest this long after it was taken.
    pub max_age: Duration,
}

/// What admission does while Redis is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLedgerError {
    /// 503 `ServiceUnavailableException` with a retry hint; readiness false.
    FailClosed,
    /// Admit from a local share of `1 / expected_replicas` of each pool until Redis answers.
    Local { expected_replicas: u32 },
}

pub(super) fn validate(raw: RawLedger, env: &Env) -> Result<LedgerConfig, ConfigError> {
    let url = match raw.backend.unwrap_or(Backend::Memory) {
        Backend::Memory => {
            let redis_only = [
                ("ledger.url", raw.url.is_some()),
                ("ledger.url_env", raw.url_env.is_some()),
                ("ledger.timeout_ms", raw.timeout_ms.is_some()),
                ("ledger.lease_secs", raw.lease_secs.is_some()),
                ("ledger.on_error", raw.on_error.is_some()),
                ("ledger.expected_replicas", raw.expected_replicas.is_some()),
                ("ledger.local_leases", raw.local_leases.is_some()),
            ];
            if let Some((key, _)) = redis_only.iter().find(|(_, set)| *set) {
                return Err(invalid(*key, "only the redis backend takes this key"));
            }
            return Ok(LedgerConfig::Memory);
        }
        Backend::Redis => redis_url(raw.url, raw.url_env.as_deref(), env)?,
    };
    if !["redis://", "redis+unix://", "unix://", "redis+cluster://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        let hint = if url.starts_with("rediss://") {
            "TLS (rediss://) is not supported in this build; "
        } else {
            ""
        };
        // Never echo the URL: it may hold a password.
        return Err(invalid(
            url_key(raw.url_env.as_deref()),
            format!(
                "{hint}write redis://host:6379, redis+unix:///path/to/redis.sock, or for a Redis \
                 Cluster redis+cluster://host1:6379,host2:6379 (seed nodes, comma-separated)"
            ),
        ));
    }
    let timeout = Duration::from_millis(positive(
        "ledger.timeout_ms",
        raw.timeout_ms.unwrap_or(DEFAULT_LEDGER_TIMEOUT_MS),
    )?);
    let lease = Duration::from_secs(positive(
        "ledger.lease_secs",
        raw.lease_secs.unwrap_or(DEFAULT_LEASE_SECS),
    )?);
    if lease <= timeout * 3 {
        return Err(invalid(
            "ledger.lease_secs",
            "must be longer than three ledger.timeout_ms (leases are renewed every third of it)",
        ));
    }
    let on_error = on_error(raw.on_error, raw.expected_replicas)?;
    Ok(LedgerConfig::Redis(RedisLedgerConfig {
        url,
        timeout,
        lease,
        on_error,
        local_leases: local_leases(raw.local_leases, lease)?,
    }))
}

/// `ledger.on_error`, with the `expected_replicas` only `"local"` takes.
fn on_error(
    on_error: Option<OnError>,
    expected_replicas: Option<u32>,
) -> Result<OnLedgerError, ConfigError> {
    match (on_error.unwrap_or(OnError::FailClosed), expected_replicas) {
        (OnError::FailClosed, None) => Ok(OnLedgerError::FailClosed),
        (OnError::FailClosed, Some(_)) => Err(invalid(
            "ledger.expected_replicas",
            "only on_error = \"local\" uses it; remove it or set on_error = \"local\"",
        )),
        (OnError::Local, Some(n)) if n > 0 => Ok(OnLedgerError::Local {
            expected_replicas: n,
        }),
        (OnError::Local, _) => Err(invalid(
            "ledger.expected_replicas",
            "on_error = \"local\" needs expected_replicas = N (the replica count): each replica then \
             admits 1/N of each pool while Redis is unreachable",
        )),
    }
}

/// `[ledger.local_leases]`, when present.
fn local_leases(
    raw: Option<RawLocalLeases>,
    lease: Duration,
) -> Result<Option<LocalLeasesConfig>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let horizon = Duration::from_millis(positive(
        "ledger.local_leases.horizon_ms",
        raw.horizon_ms.unwrap_or(DEFAULT_SLICE_HORIZON_MS),
    )?);
    let max_fraction = raw.max_fraction.unwrap_or(DEFAULT_SLICE_MAX_FRACTION);
    if !(max_fraction > 0.0 && max_fraction <= 1.0) {
        return Err(invalid(
            "ledger.local_leases.max_fraction",
            "must be a fraction in (0, 1], e.g. 0.1 (the most of each pool limit one slice holds)",
        ));
    }
    let max_age = Duration::from_millis(positive(
        "ledger.local_leases.max_age_ms",
        raw.max_age_ms.unwrap_or(DEFAULT_SLICE_MAX_AGE_MS),
    )?);
    if max_age < horizon || max_age * 3 > lease {
        return Err(invalid(
            "ledger.local_leases.max_age_ms",
            "must be at least horizon_ms and at most a third of ledger.lease_secs (a slice goes back long before its lease ends)",
        ));
    }
    Ok(Some(LocalLeasesConfig {
        horizon,
        max_fraction,
        max_age,
    }))
}

/// `ledger.url`, or the value of the variable `ledger.url_env` names: one of the two.
fn redis_url(url: Option<String>, url_env: Option<&str>, env: &Env) -> Result<String, ConfigError> {
    match (url, url_env) {
        (Some(url), None) => Ok(url),
        (None, Some(name)) => {
            if name.is_empty() {
                return Err(invalid("ledger.url_env", "name an environment variable"));
            }
            env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
                invalid(
                    "ledger.url_env",
                    format!("the environment variable {name} is not set (or is empty); set it to redis://host:6379"),
                )
            })
        }
        (Some(_), Some(_)) => Err(invalid("ledger.url_env", "set url or url_env, not both")),
        (None, None) => Err(invalid(
            "ledger.url",
            "backend = \"redis\" needs url = \"redis://host:6379\" (or url_env = \"VARIABLE\" naming an environment variable that holds it)",
        )),
    }
}

/// The key to blame for a bad Redis URL.
fn url_key(url_env: Option<&str>) -> String {
    match url_env {
        Some(name) => format!("ledger.url_env ({name})"),
        None => "ledger.url".to_string(),
    }
}
