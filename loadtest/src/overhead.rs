//! The overhead scenario: a simulator with no latency, fixed Converse rates, a ConverseStream
//! rate, a closed-loop max-throughput step and many concurrent open streams, each step run
//! direct and through the proxy, to isolate what the proxy adds (latency, throughput, memory).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::task::JoinSet;

use crate::arrivals::{Call, Op, prompt};
use crate::client::{Record, sdk_client};
use crate::drive::{Ctx, Sink, drive, finish, run_call};
use crate::proxy::{Memory, ProxyProcess};
use crate::report::{Pcts, pcts};
use crate::scenario::{Arrival, Group, OpMix, Scenario, Shape};
use crate::stack::{Options, start_proxy, start_simulator};

/// One step on one side.
#[derive(Debug, Clone, Serialize)]
pub struct StepSide {
    pub calls: u64,
    pub completed: u64,
    pub failed: u64,
    pub throughput_rps: f64,
    pub latency_ms: Option<Pcts>,
    pub ttft_ms: Option<Pcts>,
}

/// One step, both sides.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub name: String,
    pub direct: StepSide,
    pub proxy: StepSide,
}

/// Everything the overhead scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadReport {
    pub steps: Vec<Step>,
    /// Max throughput through the proxy over max throughput direct.
    pub throughput_ratio: f64,
    pub open_streams_target: u32,
    pub open_streams_reached: [u64; 2],
    pub proxy_memory_idle: Memory,
    pub proxy_memory_open_streams: Memory,
    pub proxy_memory_end: Memory,
}

/// What one side measured.
struct SideRun {
    steps: Vec<(String, StepSide)>,
    streams_reached: u64,
    memory: [Memory; 3],
}

pub async fn run(s: &Scenario, o: &Options) -> anyhow::Result<OverheadReport> {
    let direct = run_side(s, o, false).await?;
    let proxy = run_side(s, o, true).await?;
    let steps: Vec<Step> = direct
        .steps
        .into_iter()
        .zip(proxy.steps)
        .map(|((name, d), (_, p))| Step {
            name,
            direct: d,
            proxy: p,
        })
        .collect();
    let max = steps.iter().find(|st| st.name == "max");
    Ok(OverheadReport {
        throughput_ratio: max.map_or(0.0, |m| {
            m.proxy.throughput_rps / m.direct.throughput_rps.max(1e-9)
        }),
        steps,
        open_streams_target: s.overhead.as_ref().map_or(0, |x| x.open_streams),
        open_streams_reached: [direct.streams_reached, proxy.streams_reached],
        proxy_memory_idle: proxy.memory[0],
        proxy_memory_open_streams: proxy.memory[1],
        proxy_memory_end: proxy.memory[2],
    })
}

fn group(arrival: Arrival, op: Op) -> Group {
    Group {
        team: "overhead".into(),
        arrival,
        max_attempts: 3,
        pause_after_failure_ms: 0,
        hang_up_rate: 0.0,
        mix: OpMix {
            converse: f64::from(op == Op::Converse),
            converse_stream: f64::from(op == Op::ConverseStream),
            invoke: 0.0,
        },
        shapes: vec![Shape {
            weight: 1.0,
            prompt_words: [20, 20],
            output_tokens: [10, 10],
            max_tokens: Some(100),
        }],
    }
}

/// The steps: one per fixed rate, one streaming rate, one closed-loop maximum.
fn steps(s: &Scenario) -> Vec<(String, Group)> {
    let Some(o) = &s.overhead else {
        return Vec::new();
    };
    let poisson = |rps: f64| Arrival::Poisson {
        start_per_min: rps * 60.0,
        end_per_min: rps * 60.0,
        ramp_secs: None,
    };
    let mut v: Vec<(String, Group)> = o
        .rates
        .iter()
        .map(|r| (format!("converse@{r}/s"), group(poisson(*r), Op::Converse)))
        .collect();
    v.push((
        format!("stream@{}/s", o.stream_rate),
        group(poisson(o.stream_rate), Op::ConverseStream),
    ));
    v.push((
        "max".into(),
        group(
            Arrival::Closed {
                clients: o.max_clients,
            },
            Op::Converse,
        ),
    ));
    v
}

async fn run_side(s: &Scenario, o: &Options, through_proxy: bool) -> anyhow::Result<SideRun> {
    let side = if through_proxy { "proxy" } else { "direct" };
    let sim = start_simulator(s).await?;
    let proxy = match through_proxy {
        true => Some(start_proxy(s, o, sim.addr).await?),
        false => None,
    };
    let mem = |p: &Option<ProxyProcess>| p.as_ref().map(ProxyProcess::memory).unwrap_or_default();
    let idle = mem(&proxy);
    let addr = proxy.as_ref().map_or(sim.addr, |p| p.addr);
    let mut out = Vec::new();
    for (name, g) in steps(s) {
        eprintln!("[{}] {side}: {name}", s.name);
        let step = Scenario {
            groups: vec![g],
            duration_secs: s.overhead.as_ref().map_or(1.0, |x| x.step_secs),
            drain_secs: 5.0,
            ..s.clone()
        };
        let records = drive(&step, &[addr], &format!("{side}-{name}")).await;
        out.push((name, step_side(&records, step.duration_secs)));
    }
    eprintln!("[{}] {side}: open streams", s.name);
    let (reached, at_peak) = open_streams(s, addr, &sim, || mem(&proxy)).await;
    let end = mem(&proxy);
    if let Some(p) = proxy {
        p.stop().await;
    }
    sim.shutdown().await;
    Ok(SideRun {
        steps: out,
        streams_reached: reached,
        memory: [idle, at_peak, end],
    })
}

fn step_side(records: &[Record], secs: f64) -> StepSide {
    let ok: Vec<&Record> = records.iter().filter(|r| r.outcome == "ok").collect();
    let in_run = ok.iter().filter(|r| r.end_ms <= secs * 1e3).count();
    StepSide {
        calls: records.len() as u64,
        completed: ok.len() as u64,
        failed: (records.len() - ok.len()) as u64,
        throughput_rps: in_run as f64 / secs,
        latency_ms: pcts(ok.iter().map(|r| r.end_ms - r.start_ms).collect()),
        ttft_ms: pcts(ok.iter().filter_map(|r| r.ttft_ms).collect()),
    }
}

/// Opens `open_streams` stalled ConverseStream calls at once, waits (up to 60 s) until the
/// simulator holds them all, samples memory, then lets them finish.
async fn open_streams(
    s: &Scenario,
    addr: SocketAddr,
    sim: &tokengate::simulator::SimulatorHandle,
    memory: impl Fn() -> Memory,
) -> (u64, Memory) {
    let n = s.overhead.as_ref().map_or(0, |x| x.open_streams);
    let ctx = Ctx {
        model: s.model.as_str().into(),
        burndown: s.burndown,
        epoch: Instant::now(),
        sink: Sink::default(),
    };
    let client = sdk_client(addr, 1, "open-streams", None);
    let mut set = JoinSet::new();
    for i in 0..n {
        let (ctx, client) = (ctx.clone(), client.clone());
        let call = Call {
            at: 0.0,
            op: Op::ConverseStream,
            prompt: format!("[sim:fault=stall] {}", prompt(20, 5, i)),
            max_tokens: Some(100),
            output_tokens: 20,
            hang_up: false,
        };
        set.spawn(async move {
            run_call(&ctx, &client, &call, "streams").await;
        });
    }
    let in_flight = || {
        sim.simulator
            .stats()
            .buckets
            .values()
            .map(|b| b.in_flight)
            .sum::<u64>()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peak = (0, Memory::default());
    while Instant::now() < deadline {
        let k = in_flight();
        if k >= peak.0 {
            peak = (k, memory());
        }
        if k >= n as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    finish(set, Instant::now() + Duration::from_secs(60)).await;
    peak
}

fn fmt(p: Option<Pcts>, g: fn(&Pcts) -> f64) -> String {
    p.map_or("-".into(), |p| format!("{:.2}", g(&p)))
}

/// `proxy - direct` of one percentile, or `-`.
fn added(d: Option<Pcts>, p: Option<Pcts>, g: fn(&Pcts) -> f64) -> String {
    match (d, p) {
        (Some(d), Some(p)) => format!("{:+.2}", g(&p) - g(&d)),
        _ => "-".into(),
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

impl Step {
    /// Three table rows: direct, proxy, and what the proxy added.
    fn rows(&self) -> String {
        let mut out = String::new();
        for (side, x) in [("direct", &self.direct), ("proxy", &self.proxy)] {
            let (l, t) = (x.latency_ms, x.ttft_ms);
            out.push_str(&format!(
                "| {} | {side} | {} | {} | {:.0} | {} / {} / {} | {} / {} |\n",
                self.name,
                x.calls,
                x.failed,
                x.throughput_rps,
                fmt(l, |p| p.p50),
                fmt(l, |p| p.p99),
                fmt(l, |p| p.p999),
                fmt(t, |p| p.p50),
                fmt(t, |p| p.p99),
            ));
        }
        let (d, p) = (self.direct.latency_ms, self.proxy.latency_ms);
        let (dt, pt) = (self.direct.ttft_ms, self.proxy.ttft_ms);
        out.push_str(&format!(
            "| {} | **added** | | | | {} / {} / {} | {} / {} |\n",
            self.name,
            added(d, p, |p| p.p50),
            added(d, p, |p| p.p99),
            added(d, p, |p| p.p999),
            added(dt, pt, |p| p.p50),
            added(dt, pt, |p| p.p99),
        ));
        out
    }
}

/// Picks one side of a step.
type Pick = fn(&Step) -> &StepSide;

impl OverheadReport {
    /// A table of every step (both sides and the added latency), then throughput and memory.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "| step | side | calls | failed | completed/s | latency p50 / p99 / p99.9 ms | TTFT p50 / p99 ms |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for st in &self.steps {
            out.push_str(&st.rows());
        }
        out.push_str(&format!(
            "\nMax throughput ratio (proxy / direct): {:.2}. Open streams reached: direct {}, proxy {} of {}.\n\
             Proxy RSS: idle {}, with the streams open {}, at the end {} (peak VmHWM {}).\n",
            self.throughput_ratio,
            self.open_streams_reached[0],
            self.open_streams_reached[1],
            self.open_streams_target,
            mib(self.proxy_memory_idle.rss_kib),
            mib(self.proxy_memory_open_streams.rss_kib),
            mib(self.proxy_memory_end.rss_kib),
            mib(self.proxy_memory_end.hwm_kib),
        ));
        out
    }

    /// Latency percentiles of the fixed-rate Converse steps, both sides, against the rate.
    pub fn plot(&self, path: &std::path::Path) -> anyhow::Result<()> {
        use crate::plot::{DIRECT, PROXY, Series, lines};
        use plotters::style::RGBColor;
        let fixed: Vec<&Step> = self
            .steps
            .iter()
            .filter(|s| s.name.starts_with("converse@"))
            .collect();
        let rate = |s: &Step| s.direct.throughput_rps;
        let series =
            |label: &str, side: fn(&Step) -> &StepSide, g: fn(&Pcts) -> f64, color| Series {
                label: label.into(),
                points: fixed
                    .iter()
                    .filter_map(|s| side(s).latency_ms.map(|p| (rate(s), g(&p))))
                    .collect(),
                color,
            };
        let (d, p): (Pick, Pick) = (|s| &s.direct, |s| &s.proxy);
        lines(
            path,
            "overhead: Converse latency vs calls per step (p50, p99, p99.9)",
            (
                "offered calls per second (direct side achieved)",
                "latency, ms",
            ),
            &[
                series("direct p50", d, |p| p.p50, DIRECT),
                series("direct p99", d, |p| p.p99, RGBColor(240, 150, 130)),
                series("direct p99.9", d, |p| p.p999, RGBColor(250, 200, 190)),
                series("tokengate p50", p, |p| p.p50, PROXY),
                series("tokengate p99", p, |p| p.p99, RGBColor(120, 170, 240)),
                series("tokengate p99.9", p, |p| p.p999, RGBColor(180, 210, 250)),
            ],
        )
    }
}
