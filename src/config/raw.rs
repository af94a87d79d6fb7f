//! The configuration file as written: serde structs that mirror the TOML, unknown keys refused.
//! [`super::Config::from_raw`] turns them into the validated, typed [`super::Config`].

use std::collections::BTreeMap;

use serde::Deserialize;

pub use super::endpoints::RawEndpoint;
pub use super::routes::{RawAuth, RawRoute, RawShare};
use crate::simulator::SimulatorConfig;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub server: RawServer,
    pub upstream: RawUpstream,
    #[serde(default)]
    pub ledger: RawLedger,
    #[serde(default)]
    pub admission: RawAdmission,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub pools: Vec<RawPool>,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    #[serde(default)]
    pub endpoints: Vec<RawEndpoint>,
    #[serde(default)]
    pub simulator: Option<SimulatorConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: String,
    pub admin_listen: Option<String>,
    pub tls_cert: Option<String>,
    pub tls_key: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub drain_secs: Option<u64>,
    pub accept_grace_secs: Option<u64>,
    pub header_read_timeout_secs: Option<u64>,
    pub body_read_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub max_connections: Option<u64>,
    pub max_buffered_body_bytes: Option<u64>,
    pub h2_max_concurrent_streams: Option<u64>,
    pub h2_keep_alive_interval_secs: Option<u64>,
    pub h2_keep_alive_timeout_secs: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub region: String,
    pub endpoint: Option<String>,
    pub connect_timeout_secs: Option<u64>,
    pub response_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLedger {
    pub backend: Option<String>,
    pub url: Option<String>,
    /// The name of an environment variable holding the URL (for a password kept in a secret).
    pub url_env: Option<String>,
    pub timeout_ms: Option<u64>,
    pub lease_secs: Option<u64>,
    pub on_error: Option<String>,
    pub expected_replicas: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmission {
    pub unknown_models: Option<String>,
    #[serde(default)]
    pub application_profiles: BTreeMap<String, String>,
    pub max_retry_hint_ms: Option<u64>,
    pub share_idle_ms: Option<u64>,
    pub priority_margin: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: Option<String>,
    pub level: Option<String>,
}

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
    pub headroom: Option<f64>,
    pub input_estimate: Option<String>,
    pub max_wait_ms: Option<u64>,
    pub max_queue: Option<usize>,
    pub retry_reserve: Option<f64>,
    pub shadow: Option<bool>,
}
