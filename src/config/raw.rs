//! The configuration file as written: serde structs that mirror the TOML, unknown keys refused.
//! [`super::Config::from_raw`] turns them into the validated, typed [`super::Config`]. Each
//! section's raw struct lives with its validation, in the section's file.

use serde::Deserialize;

pub use super::admission::RawAdmission;
pub use super::auth::RawAuth;
pub use super::endpoints::RawEndpoint;
pub use super::ledger::RawLedger;
pub use super::log::RawLog;
pub use super::pools::RawPool;
pub use super::routes::{RawRoute, RawShare};
pub use super::server::RawServer;
use super::simulator::SimulatorConfig;
pub use super::telemetry::{RawMetrics, RawTracing};
pub use super::upstream::RawUpstream;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub server: RawServer,
    pub upstream: RawUpstream,
    #[serde(default)]
    pub ledger: RawLedger,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub simulator: Option<SimulatorConfig>,
    #[serde(default)]
    pub tracing: RawTracing,
    #[serde(default)]
    pub metrics: RawMetrics,
    #[serde(default)]
    pub admission: RawAdmission,
    #[serde(default)]
    pub pools: Vec<RawPool>,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    #[serde(default)]
    pub endpoints: Vec<RawEndpoint>,
}

/// The policy sections of the file: `[admission]`, `[[pools]]`, `[auth]`, `[[routes]]` and
/// `[[endpoints]]`.
#[derive(Debug)]
pub struct RawPolicy {
    pub admission: RawAdmission,
    pub pools: Vec<RawPool>,
    pub auth: RawAuth,
    pub routes: Vec<RawRoute>,
    pub endpoints: Vec<RawEndpoint>,
}
