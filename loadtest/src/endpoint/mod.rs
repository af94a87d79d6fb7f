//! The SageMaker endpoint scenario: a morning ramp against a simulated real-time endpoint whose
//! copies serve a bounded number of generations each and arrive late when asked for, run twice
//! with the same calls at the same times:
//!
//! 1. **direct**: `aws-sdk-sagemakerruntime` clients call the simulated endpoint; the scaler
//!    tracks SageMaker's own concurrency per copy;
//! 2. **proxy**: the same clients call a `tokengate serve` child process in front of another
//!    fresh simulator; the scaler tracks tokengate's demand per copy (in flight plus queued).
//!
//! Reported per side: calls, failures by kind (the endpoint's overload errors among them), the
//! latency of each team (short lookups against long summaries), the copies over time and what
//! they cost (copy-minutes), the signal; and three plots.
//!
//! # Layout
//! [`scenario`] the file · [`caller`] the SDK calls · [`scaler`] Application Auto Scaling,
//! emulated · [`outputs`] the report, table and plots.

mod caller;
mod outputs;
mod scaler;
pub mod scenario;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokengate::simulator;
use tokio::task::JoinSet;

use crate::arrivals::schedule;
use crate::client::Record;
use crate::drive::{Ctx, Sink, finish, record_call};
use crate::proxy::ProxyProcess;
use crate::stack::Options;
use outputs::SideReport;
use scaler::Signal;
use scenario::EndpointScenario;

/// Runs the endpoint scenario at `path` on both sides and writes its outputs.
pub async fn run(path: &Path, o: &Options) -> anyhow::Result<()> {
    let s = EndpointScenario::load(path, o.quick)?;
    std::fs::create_dir_all(&o.out)?;
    std::fs::create_dir_all(&o.plots)?;
    let (direct, direct_records) = run_side(&s, o, false).await?;
    let (proxy, proxy_records) = run_side(&s, o, true).await?;
    outputs::write(&s, o, [direct, proxy], [&direct_records, &proxy_records])
}

async fn run_side(
    s: &EndpointScenario,
    o: &Options,
    through_proxy: bool,
) -> anyhow::Result<(SideReport, Vec<Record>)> {
    let side = if through_proxy { "proxy" } else { "direct" };
    eprintln!("[{}] {side}: {:.0} s of load", s.name, s.duration_secs);
    let sim = simulator::spawn(s.simulator_config(), SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let proxy = match through_proxy {
        true => {
            let path = o.out.join(format!("{}.proxy.toml", s.name));
            Some(ProxyProcess::start(&o.tokengate_bin, &s.proxy_config(sim.addr), &path).await?)
        }
        false => None,
    };
    let (target, signal) = match &proxy {
        Some(p) => (p.addr, Signal::Demand(p.addr)),
        None => (sim.addr, Signal::Concurrency),
    };
    let epoch = Instant::now();
    let end = epoch + Duration::from_secs_f64(s.duration_secs);
    let drain_end = end + Duration::from_secs_f64(s.drain_secs);
    let scaling = {
        let (s, simulator, addr) = (s.clone(), sim.simulator.clone(), sim.addr);
        tokio::spawn(
            async move { scaler::run(&s, &simulator, addr, signal, epoch, drain_end).await },
        )
    };
    let ctx = Ctx {
        model: Arc::from(scenario::ENDPOINT),
        burndown: 1,
        epoch,
        sink: Sink::default(),
    };
    let mut set = JoinSet::new();
    for (i, group) in s.groups.iter().enumerate() {
        let partition = format!("{side}-{}", group.team);
        let client = caller::client(
            target,
            group.max_attempts,
            &partition,
            EndpointScenario::key(i),
        );
        let seed = s.seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
        let team: Arc<str> = group.team.as_str().into();
        for call in schedule(&s.arrival_group(i), seed, s.duration_secs) {
            let (ctx, client, team) = (ctx.clone(), client.clone(), team.clone());
            let at = epoch + Duration::from_secs_f64(call.at);
            set.spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let sent = caller::execute(&client, &call, &team, epoch);
                record_call(&ctx, &call, &team, sent).await;
            });
        }
    }
    finish(set, drain_end).await;
    let timeline = scaling.await?;
    let records = ctx.sink.take();
    let fleet = sim.simulator.endpoint_stats().into_iter().next();
    let report = SideReport::new(side, &records, timeline, fleet);
    if let Some(p) = proxy {
        p.stop().await;
    }
    sim.shutdown().await;
    Ok((report, records))
}
