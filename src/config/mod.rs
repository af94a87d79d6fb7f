//! Configuration: the TOML file ([`raw`]) validated into typed settings ([`Config`]).
//!
//! Every error names the key at fault and says what to write instead, so that
//! `tokengate check-config FILE` is enough to fix a file.

pub mod endpoints;
pub mod raw;
pub mod routes;
mod server;

use std::{collections::BTreeMap, path::Path, time::Duration};

use http::Uri;

use crate::simulator::SimulatorConfig;
pub use endpoints::EndpointConfig;
use raw::{RawConfig, RawPool};
pub use routes::{AuthConfig, AuthMode, MaxTokensPolicy, RouteConfig, Secret, ShareConfig};
pub use server::{ServerConfig, TlsFiles};

/// A configuration error: the key at fault and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },
    #[error("{0}")]
    Parse(String),
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub ledger: LedgerConfig,
    pub admission: AdmissionConfig,
    pub log: LogConfig,
    pub pools: Vec<PoolConfig>,
    pub auth: AuthConfig,
    /// At least one: a config without `[[routes]]` has the implicit default route.
    pub routes: Vec<RouteConfig>,
    /// `[[endpoints]]`: SageMaker endpoint pools.
    pub endpoints: Vec<EndpointConfig>,
    pub simulator: SimulatorConfig,
}

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `https://bedrock-runtime.{region}.amazonaws.com`
    Aws,
    /// The built-in simulator, started in the same process.
    Simulated,
    /// An explicit base URL (`http://127.0.0.1:9000`, a VPC endpoint, ...).
    Url(Uri),
}

#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamConfig {
    pub region: String,
    pub endpoint: Endpoint,
    pub connect_timeout: Duration,
    /// Longest wait for the response head. Non-streaming generations answer only when done.
    pub response_timeout: Duration,
    /// Longest silence between two body chunks of a response.
    pub idle_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerConfig {
    Memory,
    Redis(RedisLedgerConfig),
}

/// `[ledger] backend = "redis"`: one quota shared by every replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisLedgerConfig {
    /// `redis://host:6379`, `redis://user:password@host:6379/0`, `redis+unix:///path/redis.sock`:
    /// `url` from the file, or the value of the environment variable named by `url_env`.
    pub url: String,
    /// The longest one ledger call may take (connecting included) before it counts as failed.
    pub timeout: Duration,
    /// How long a reservation outlives its replica's last renewal (renewed every third of it).
    pub lease: Duration,
    pub on_error: OnLedgerError,
}

/// What admission does while Redis is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLedgerError {
    /// 503 `ServiceUnavailableException` with a retry hint; readiness false.
    FailClosed,
    /// Admit from a local share of `1 / expected_replicas` of each pool until Redis answers.
    Local { expected_replicas: u32 },
}

const DEFAULT_LEDGER_TIMEOUT_MS: u64 = 250;
const DEFAULT_LEASE_SECS: u64 = 600;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Default admission-queue wait: long enough to ride out a refill or a completion, short
/// against SDK timeouts.
const DEFAULT_MAX_WAIT_MS: u64 = 2_000;
const MAX_WAIT_LIMIT_MS: u64 = 30_000;
const DEFAULT_MAX_QUEUE: usize = 1_000;
/// How long a quiet route keeps its guarantee protected: a few seconds covers the gaps between
/// one caller's requests without holding idle capacity back for long.
const DEFAULT_SHARE_IDLE_MS: u64 = 5_000;
const DEFAULT_PRIORITY_MARGIN: f64 = 0.1;

/// A fraction in `[0, max)`.
fn fraction(key: &str, value: f64, max: f64) -> Result<f64, ConfigError> {
    if (0.0..max).contains(&value) {
        Ok(value)
    } else {
        Err(invalid(
            key,
            format!("must be a fraction in [0, {max}), e.g. 0.05"),
        ))
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Config::parse(&text)
    }

    /// Parses and validates TOML text; `url_env` reads the process environment.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, &process_env)
    }

    /// Parses and validates TOML text, looking environment variables up with `env`.
    pub fn parse_with_env(text: &str, env: &Env) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Config::from_raw_with_env(raw, env)
    }

    pub fn from_raw(raw: RawConfig) -> Result<Config, ConfigError> {
        Config::from_raw_with_env(raw, &process_env)
    }

    pub fn from_raw_with_env(raw: RawConfig, env: &Env) -> Result<Config, ConfigError> {
        let server = server::validate(raw.server)?;
        let upstream = validate_upstream(raw.upstream)?;
        let ledger = validate_ledger(raw.ledger, env)?;
        let admission = AdmissionConfig {
            unknown_models: match raw.admission.unknown_models.as_deref().unwrap_or("reject") {
                "reject" => UnknownModels::Reject,
                "pass" => UnknownModels::Pass,
                other => {
                    return Err(invalid(
                        "admission.unknown_models",
                        format!("{other:?}: use \"reject\" or \"pass\""),
                    ));
                }
            },
            application_profiles: raw.admission.application_profiles,
            max_retry_hint: Duration::from_millis(positive(
                "admission.max_retry_hint_ms",
                raw.admission.max_retry_hint_ms.unwrap_or(5000),
            )?),
            share_idle: Duration::from_millis(
                raw.admission.share_idle_ms.unwrap_or(DEFAULT_SHARE_IDLE_MS),
            ),
            priority_margin: fraction(
                "admission.priority_margin",
                raw.admission
                    .priority_margin
                    .unwrap_or(DEFAULT_PRIORITY_MARGIN),
                0.5,
            )?,
        };
        let log = LogConfig {
            format: match raw.log.format.as_deref().unwrap_or("text") {
                "text" => LogFormat::Text,
                "json" => LogFormat::Json,
                other => {
                    return Err(invalid(
                        "log.format",
                        format!("{other:?}: use \"text\" or \"json\""),
                    ));
                }
            },
            level: raw.log.level.unwrap_or_else(|| "info".to_string()),
        };
        let mut pools = Vec::with_capacity(raw.pools.len());
        for (i, pool) in raw.pools.into_iter().enumerate() {
            pools.push(validate_pool(i, pool, &upstream.region)?);
        }
        let endpoints = endpoints::validate(raw.endpoints, &upstream.region, &upstream.endpoint)?;
        let all_pools: Vec<PoolConfig> = pools
            .iter()
            .cloned()
            .chain(endpoints.iter().map(EndpointConfig::pool))
            .collect();
        check_pools_disjoint(&all_pools)?;
        for (profile, model) in &admission.application_profiles {
            if !pools.iter().any(|p| p.models.contains(model)) {
                return Err(invalid(
                    format!("admission.application_profiles.{profile:?}"),
                    format!("maps to {model:?}, which no pool lists in its models"),
                ));
            }
        }
        let (auth, routes) = routes::validate(
            raw.auth,
            raw.routes,
            &all_pools,
            &admission.application_profiles,
            &server,
            &upstream,
            env,
        )?;
        Ok(Config {
            server,
            upstream,
            ledger,
            admission,
            log,
            pools,
            auth,
            routes,
            endpoints,
            simulator: raw.simulator.unwrap_or_default(),
        })
    }

    /// Every pool admission holds: the `[[pools]]`, then one per `[[endpoints]]` entry.
    pub fn admission_pools(&self) -> Vec<PoolConfig> {
        self.pools
            .iter()
            .cloned()
            .chain(self.endpoints.iter().map(EndpointConfig::pool))
            .collect()
    }
}

/// Looks up an environment variable: the process environment, or a stand-in in tests.
pub type Env = dyn Fn(&str) -> Option<String>;

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn validate_ledger(raw: raw::RawLedger, env: &Env) -> Result<LedgerConfig, ConfigError> {
    let backend = raw.backend.as_deref().unwrap_or("memory");
    let url = match backend {
        "memory" => {
            let redis_only = [
                ("ledger.url", raw.url.is_some()),
                ("ledger.url_env", raw.url_env.is_some()),
                ("ledger.timeout_ms", raw.timeout_ms.is_some()),
                ("ledger.lease_secs", raw.lease_secs.is_some()),
                ("ledger.on_error", raw.on_error.is_some()),
                ("ledger.expected_replicas", raw.expected_replicas.is_some()),
            ];
            if let Some((key, _)) = redis_only.iter().find(|(_, set)| *set) {
                return Err(invalid(*key, "only the redis backend takes this key"));
            }
            return Ok(LedgerConfig::Memory);
        }
        "redis" => redis_url(raw.url, raw.url_env.as_deref(), env)?,
        other => {
            return Err(invalid(
                "ledger.backend",
                format!("{other:?} is not a backend; use \"memory\" or \"redis\""),
            ));
        }
    };
    if !["redis://", "redis+unix://", "unix://"]
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
            format!("{hint}write redis://host:6379 or redis+unix:///path/to/redis.sock"),
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
    let on_error = match (
        raw.on_error.as_deref().unwrap_or("fail-closed"),
        raw.expected_replicas,
    ) {
        ("fail-closed", None) => OnLedgerError::FailClosed,
        ("fail-closed", Some(_)) => {
            return Err(invalid(
                "ledger.expected_replicas",
                "only on_error = \"local\" uses it; remove it or set on_error = \"local\"",
            ));
        }
        ("local", Some(n)) if n > 0 => OnLedgerError::Local {
            expected_replicas: n,
        },
        ("local", _) => {
            return Err(invalid(
                "ledger.expected_replicas",
                "on_error = \"local\" needs expected_replicas = N (the replica count): each replica then \
                 admits 1/N of each pool while Redis is unreachable",
            ));
        }
        (other, _) => {
            return Err(invalid(
                "ledger.on_error",
                format!("{other:?}: use \"fail-closed\" or \"local\""),
            ));
        }
    };
    Ok(LedgerConfig::Redis(RedisLedgerConfig {
        url,
        timeout,
        lease,
        on_error,
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

fn positive(key: &str, v: u64) -> Result<u64, ConfigError> {
    if v == 0 {
        Err(invalid(key, "must be greater than zero"))
    } else {
        Ok(v)
    }
}

/// `region` if it looks like a Region name.
fn region(key: &str, region: String) -> Result<String, ConfigError> {
    let ok = !region.is_empty()
        && region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(region)
    } else {
        Err(invalid(
            key,
            format!("{region:?} is not a Region name like \"us-east-1\""),
        ))
    }
}

fn validate_upstream(raw: raw::RawUpstream) -> Result<UpstreamConfig, ConfigError> {
    let region = region("upstream.region", raw.region)?;
    let endpoint = parse_endpoint("upstream.endpoint", raw.endpoint.as_deref())?;
    Ok(UpstreamConfig {
        region,
        endpoint,
        connect_timeout: Duration::from_secs(positive(
            "upstream.connect_timeout_secs",
            raw.connect_timeout_secs.unwrap_or(5),
        )?),
        response_timeout: Duration::from_secs(positive(
            "upstream.response_timeout_secs",
            raw.response_timeout_secs.unwrap_or(3600),
        )?),
        idle_timeout: Duration::from_secs(positive(
            "upstream.idle_timeout_secs",
            raw.idle_timeout_secs.unwrap_or(300),
        )?),
    })
}

/// An upstream base URL: absent for AWS, `"simulated"`, or a URL without a path or credentials.
fn parse_endpoint(key: &str, value: Option<&str>) -> Result<Endpoint, ConfigError> {
    let Some(url) = value else {
        return Ok(Endpoint::Aws);
    };
    if url == "simulated" {
        return Ok(Endpoint::Simulated);
    }
    // Never echo what may be a password.
    let shown = crate::upstream::redact_userinfo(url);
    let uri: Uri = url
        .parse()
        .map_err(|_| invalid(key, format!("{shown:?} is not a URL")))?;
    match (uri.scheme_str(), uri.authority()) {
        (_, Some(authority)) if authority.as_str().contains('@') => Err(invalid(
            key,
            format!(
                "{shown:?} carries credentials (user:password@): tokengate signs upstream requests \
                 with its own AWS credentials (SigV4) and never sends these; write the URL without them"
            ),
        )),
        (Some("http" | "https"), Some(_)) if uri.path() == "/" || uri.path().is_empty() => {
            Ok(Endpoint::Url(uri))
        }
        _ => Err(invalid(
            key,
            format!(
                "{shown:?}: write \"simulated\" or a base URL such as \"http://127.0.0.1:9000\" (no path)"
            ),
        )),
    }
}

/// A pool's name (also its metrics label): letters, digits, '-', '_' and '.'.
fn is_pool_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// `max_wait_ms` and `max_queue` of a pool or endpoint; `key` names a field of the table.
fn queue_settings(
    key: &dyn Fn(&str) -> String,
    max_wait_ms: Option<u64>,
    max_queue: Option<usize>,
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

fn validate_pool(i: usize, raw: RawPool, default_region: &str) -> Result<PoolConfig, ConfigError> {
    let key = |field: &str| {
        if raw.name.is_empty() {
            format!("pools[{i}].{field}")
        } else {
            format!("pools[{i}] ({}).{field}", raw.name)
        }
    };
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
    let nonzero = |field: &str, v: u64| {
        if v == 0 {
            Err(invalid(key(field), "must be greater than zero"))
        } else {
            Ok(v)
        }
    };
    let tokens_per_minute = nonzero("tokens_per_minute", raw.tokens_per_minute)?;
    if tokens_per_minute > 1_000_000_000 {
        return Err(invalid(
            key("tokens_per_minute"),
            "must be at most 1000000000",
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
    let input_estimate = match raw.input_estimate.as_deref().unwrap_or("heuristic") {
        "heuristic" => InputEstimate::Heuristic,
        "count_tokens" => InputEstimate::CountTokens,
        other => {
            return Err(invalid(
                key("input_estimate"),
                format!("{other:?}: use \"heuristic\" or \"count_tokens\""),
            ));
        }
    };
    let (max_wait, max_queue) = queue_settings(&key, raw.max_wait_ms, raw.max_queue)?;
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
        headroom,
        input_estimate,
        max_wait,
        max_queue,
        retry_reserve,
        shadow: raw.shadow.unwrap_or(false),
        endpoint: None,
    };
    if default_max_tokens >= pool.usable_tokens_per_minute() {
        return Err(invalid(
            key("default_max_tokens"),
            format!(
                "{default_max_tokens} does not fit in the bucket ({} tokens per minute after headroom): lower it",
                pool.usable_tokens_per_minute()
            ),
        ));
    }
    Ok(pool)
}

/// Pool names are unique, and a model (or an endpoint pool's name, which route allow-lists
/// share with model ids) belongs to one pool. `pools` holds `[[pools]]` then `[[endpoints]]`.
fn check_pools_disjoint(pools: &[PoolConfig]) -> Result<(), ConfigError> {
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

#[cfg(test)]
mod tests;
