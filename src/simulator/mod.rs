//! A faithful stand-in for `bedrock-runtime`. STUB (being written on another branch).

use std::net::SocketAddr;

use serde::Deserialize;

/// `[simulator]` settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulatorConfig {
    #[serde(default)]
    pub region: String,
}

#[derive(Debug)]
pub struct SimulatorHandle {
    pub addr: SocketAddr,
}

impl SimulatorHandle {
    pub async fn shutdown(self) {}
}

pub async fn spawn(_config: SimulatorConfig, addr: SocketAddr) -> std::io::Result<SimulatorHandle> {
    Ok(SimulatorHandle { addr })
}
