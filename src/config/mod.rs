//! Configuration: the TOML file validated into typed settings ([`Config`]).
//!
//! A config has two halves. [`ProcessConfig`] is what the process is built from (listeners,
//! the upstream client, the ledger backend, logging, the built-in simulator, traces and the
//! other telemetry outputs): a reload logs a
//! change there and leaves it for the next restart. [`PolicyConfig`] is what requests are decided
//! by (pools, routes, who may call, admission settings): a reload swaps it atomically.
//!
//! Each section lives in its own file: the raw serde struct that mirrors the TOML (unknown keys
//! refused), the validated typed struct, and its validation. Every error names the key at fault
//! and says what to write instead, so that `tokengate check-config FILE` is enough to fix a file.
//! Keys that take one of a few words are serde enums: a wrong word is refused by the parser, with
//! the line, the key and the words it accepts.

pub mod adaptive;
pub mod admission;
pub mod auth;
pub mod endpoints;
pub mod ledger;
pub mod log;
pub mod pools;
pub mod raw;
pub mod routes;
pub mod server;
pub mod simulator;
pub mod spill;
pub mod telemetry;
pub mod upstream;

use std::path::Path;

pub use adaptive::AdaptiveMaxTokens;
pub use admission::{AdmissionConfig, UnknownModels};
pub use auth::{AuthConfig, AuthMode, Secret};
pub use endpoints::EndpointConfig;
pub use ledger::{LedgerConfig, LocalLeasesConfig, OnLedgerError, RedisLedgerConfig};
pub use log::{LogConfig, LogFormat};
pub use pools::{InputEstimate, PoolConfig, PoolTier, Source, WhenMaxTokensMissing};
use raw::RawConfig;
pub use routes::{MaxTokensPolicy, RouteBudgets, RouteConfig, ShareConfig};
pub use server::{ServerConfig, TlsFiles};
pub use simulator::SimulatorConfig;
pub use telemetry::{EmfConfig, EmfTarget, MetricsConfig, OtlpProtocol, TracingConfig};
pub use upstream::{Endpoint, UpstreamApiKey, UpstreamConfig, UpstreamHttp};

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
    pub process: ProcessConfig,
    pub policy: PolicyConfig,
}

/// What the process is built from; changes wait for a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessConfig {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub ledger: LedgerConfig,
    pub log: LogConfig,
    pub simulator: SimulatorConfig,
    /// `[tracing]`: OpenTelemetry spans, when an OTLP endpoint is set.
    pub tracing: Option<TracingConfig>,
    /// `[metrics]`: CloudWatch EMF output and the quota report's window.
    pub metrics: MetricsConfig,
}

/// What requests are decided by; a reload swaps it.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    pub admission: AdmissionConfig,
    pub pools: Vec<PoolConfig>,
    pub auth: AuthConfig,
    /// At least one: a config without `[[routes]]` has the implicit default route.
    pub routes: Vec<RouteConfig>,
    /// `[[endpoints]]`: SageMaker endpoint pools.
    pub endpoints: Vec<EndpointConfig>,
}

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

    /// Parses and validates TOML text; `url_env` and `secret_access_key_env` read the process
    /// environment.
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
        let process = ProcessConfig {
            server: server::validate(raw.server)?,
            upstream: upstream::validate(raw.upstream, env)?,
            ledger: ledger::validate(raw.ledger, env)?,
            log: raw.log.into(),
            simulator: raw.simulator.unwrap_or_default(),
            tracing: telemetry::validate_tracing(raw.tracing)?,
            metrics: telemetry::validate_metrics(raw.metrics)?,
        };
        let policy = raw::RawPolicy {
            admission: raw.admission,
            pools: raw.pools,
            auth: raw.auth,
            routes: raw.routes,
            endpoints: raw.endpoints,
        };
        let policy = PolicyConfig::validate(policy, &process, env)?;
        Ok(Config { process, policy })
    }
}

impl Config {
    /// Remarks on a valid config for `tokengate check-config` to print: settings that work but
    /// depend on something outside the file.
    pub fn notes(&self) -> Vec<String> {
        upstream::notes(&self.process.upstream, &self.policy.pools)
    }
}

impl PolicyConfig {
    /// Validates the policy sections against the process they run in (its listener and Region).
    fn validate(
        raw: raw::RawPolicy,
        process: &ProcessConfig,
        env: &Env,
    ) -> Result<PolicyConfig, ConfigError> {
        let admission = admission::validate(raw.admission)?;
        let mut pools = Vec::with_capacity(raw.pools.len());
        for (i, pool) in raw.pools.into_iter().enumerate() {
            pools.push(pools::validate(i, pool, &process.upstream.region)?);
        }
        let endpoints = endpoints::validate(
            raw.endpoints,
            &process.upstream.region,
            &process.upstream.endpoint,
        )?;
        let all_pools: Vec<PoolConfig> = pools
            .iter()
            .cloned()
            .chain(endpoints.iter().map(EndpointConfig::pool))
            .collect();
        pools::check_disjoint(&all_pools)?;
        spill::check_chains(&pools)?;
        admission::check_profiles(&admission, &pools)?;
        let mode = raw.auth.mode.unwrap_or(AuthMode::None);
        auth::check_plaintext_bearer(
            mode,
            raw.auth.allow_plaintext_bearer.unwrap_or(false),
            &process.server,
        )?;
        let mut routes = routes::validate(
            raw.routes,
            mode,
            &all_pools,
            &admission.application_profiles,
            env,
        )?;
        spill::check_route_regions(&routes, &pools, &admission.application_profiles)?;
        let default_route = auth::default_route(mode, raw.auth.default_route, &routes)?;
        if routes.is_empty() {
            routes.push(RouteConfig::implicit(&default_route));
        }
        let auth = AuthConfig {
            mode,
            default_route,
            regions: auth::served_regions(&process.upstream, &all_pools),
        };
        Ok(PolicyConfig {
            admission,
            pools,
            auth,
            routes,
            endpoints,
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

fn positive(key: &str, v: u64) -> Result<u64, ConfigError> {
    if v == 0 {
        Err(invalid(key, "must be greater than zero"))
    } else {
        Ok(v)
    }
}

#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod tests;
