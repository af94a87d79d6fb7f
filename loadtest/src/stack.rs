//! What a run stands on: its options, the simulator and the proxy it starts, and plain HTTP to
//! their admin endpoints.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokengate::simulator::{self, SimulatorHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// One proxy on the memory ledger (the overhead scenario, the soak).
pub async fn start_proxy(
    s: &Scenario,
    o: &Options,
    upstream: SocketAddr,
) -> anyhow::Result<ProxyProcess> {
    let path = o.out.join(format!("{}.proxy.toml", s.name));
    ProxyProcess::start(&o.tokengate_bin, &s.proxy_config(upstream, None), &path).await
}

/// The scenario's `replicas` proxies, on the shared ledger at `redis_url` if any: each its own
/// process, its config `<name>.proxy.toml` (`<name>.proxy-<i>.toml` with several), log beside it.
pub async fn start_replicas(
    s: &Scenario,
    o: &Options,
    upstream: SocketAddr,
    redis_url: Option<&str>,
) -> anyhow::Result<Vec<ProxyProcess>> {
    let mut replicas = Vec::new();
    for i in 0..s.replicas {
        let file = match s.replicas {
            1 => format!("{}.proxy.toml", s.name),
            _ => format!("{}.proxy-{i}.toml", s.name),
        };
        let config = s.proxy_config(upstream, redis_url);
        replicas.push(ProxyProcess::start(&o.tokengate_bin, &config, &o.out.join(file)).await?);
    }
    Ok(replicas)
}

/// One `GET` over HTTP/1.1 (`connection: close`); the body of a 200 response.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    http(addr, "GET", path, "").await
}

/// One request over HTTP/1.1 (`connection: close`) with a JSON `body`; the body of a 200
/// response.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .context("the request timed out")??;
    let text = String::from_utf8(response).context("response is not UTF-8")?;
    let (head, body) = text.split_once("\r\n\r\n").context("no response head")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{method} {path}: {head}");
    Ok(body.to_string())
}
