//! What a run stands on: its options, and the simulator and the proxy it starts.

use std::net::SocketAddr;
use std::path::PathBuf;

use tokengate::simulator::{self, SimulatorHandle};

use crate::proxy::ProxyProcess;
use crate::scenario::Scenario;

/// Command-line choices that apply to every scenario.
#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// Where PNGs go (default: `out`).
    pub plots: PathBuf,
    pub tokengate_bin: PathBuf,
}

pub async fn start_simulator(s: &Scenario) -> anyhow::Result<SimulatorHandle> {
    let addr = SocketAddr::from(([127, 0, 0, 1], 0));
    Ok(simulator::spawn(s.simulator_config()?, addr).await?)
}

pub async fn start_proxy(
    s: &Scenario,
    o: &Options,
    upstream: SocketAddr,
) -> anyhow::Result<ProxyProcess> {
    let path = o.out.join(format!("{}.proxy.toml", s.name));
    ProxyProcess::start(&o.tokengate_bin, &s.proxy_config(upstream), &path).await
}
