//! Running a scenario twice, direct to a fresh simulator and through a fresh tokengate process
//! in front of another fresh simulator (same quota, same seed), then writing the report, the
//! per-call records (JSON lines) and the plots.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use crate::client::Record;
use crate::drive::drive;
use crate::overhead::{self, OverheadReport};
use crate::plot::{self, Series};
use crate::redis::SharedLedger;
use crate::report::{Replica, SideReport, adaptive_views, markdown, series};
use crate::scenario::Scenario;
use crate::soak::{self, SoakReport};
use crate::stack::{Options, http_get, start_replicas, start_simulator};

/// Everything one scenario produced; written as `<out>/<name>.json`.
#[derive(Debug, Serialize)]
pub struct ScenarioReport {
    pub name: String,
    pub description: String,
    pub quick: bool,
    pub quota_tpm: u64,
    pub duration_secs: f64,
    pub warmup_secs: f64,
    pub direct: Option<SideReport>,
    pub proxy: Option<SideReport>,
    pub overhead: Option<OverheadReport>,
    pub soak: Option<SoakReport>,
    pub table: String,
}

/// Runs `s` on both sides and writes its outputs.
pub async fn run_scenario(s: &Scenario, o: &Options) -> anyhow::Result<ScenarioReport> {
    std::fs::create_dir_all(&o.out)?;
    std::fs::create_dir_all(&o.plots)?;
    if s.overhead.is_some() {
        let report = overhead::run(s, o).await?;
        report.plot(&o.plots.join(format!("{}-latency.png", s.name)))?;
        return write_report(
            o,
            ScenarioReport {
                table: report.markdown(),
                overhead: Some(report),
                ..base(s, o)
            },
        );
    }
    if s.soak.is_some() {
        let report = soak::run(s, o).await?;
        let passed = report.passed();
        let written = write_report(
            o,
            ScenarioReport {
                table: report.markdown(),
                soak: Some(report),
                ..base(s, o)
            },
        )?;
        anyhow::ensure!(passed, "soak {}: a check failed (see the table)", s.name);
        return Ok(written);
    }
    let (direct, direct_records) = run_side(s, o, false).await?;
    let (proxy, proxy_records) = run_side(s, o, true).await?;
    write_records(
        &o.out.join(format!("{}.direct.jsonl", s.name)),
        &direct_records,
    )?;
    write_records(
        &o.out.join(format!("{}.proxy.jsonl", s.name)),
        &proxy_records,
    )?;
    plots(s, o, &direct_records, &proxy_records)?;
    let table = markdown(&[&direct, &proxy]);
    write_report(
        o,
        ScenarioReport {
            direct: Some(direct),
            proxy: Some(proxy),
            table,
            ..base(s, o)
        },
    )
}

fn base(s: &Scenario, o: &Options) -> ScenarioReport {
    ScenarioReport {
        name: s.name.clone(),
        description: s.description.clone(),
        quick: o.quick,
        quota_tpm: s.quota_tpm,
        duration_secs: s.duration_secs,
        warmup_secs: s.warmup_secs,
        direct: None,
        proxy: None,
        overhead: None,
        soak: None,
        table: String::new(),
    }
}

async fn run_side(
    s: &Scenario,
    o: &Options,
    through_proxy: bool,
) -> anyhow::Result<(SideReport, Vec<Record>)> {
    let side = if through_proxy { "proxy" } else { "direct" };
    eprintln!("[{}] {side}: {:.0} s of load", s.name, s.duration_secs);
    let sim = start_simulator(s).await?;
    let ledger = match through_proxy {
        true => SharedLedger::start(s.ledger, &o.out.join(format!("{}.redis", s.name))).await?,
        false => None,
    };
    let proxies = match through_proxy {
        true => {
            start_replicas(
                s,
                o,
                sim.addr,
                ledger.as_ref().map(SharedLedger::url).as_deref(),
            )
            .await?
        }
        false => Vec::new(),
    };
    let addrs: Vec<_> = match proxies.is_empty() {
        true => vec![sim.addr],
        false => proxies.iter().map(|p| p.addr).collect(),
    };
    let started = Instant::now();
    let records = drive(s, &addrs, side).await;
    let elapsed = started.elapsed().as_secs_f64();
    let quota = if through_proxy {
        s.proxy_quota_tpm()
    } else {
        s.quota_tpm
    };
    let mut report = SideReport::new(side, &records, (s.warmup_secs, s.duration_secs), quota);
    report.upstream = (&sim.simulator.stats()).into();
    if !proxies.is_empty() {
        let mut refusals = BTreeMap::new();
        let mut replicas = Vec::new();
        let mut adaptive = Vec::new();
        for p in &proxies {
            let metrics = http_get(p.addr, "/metrics").await?;
            for (reason, n) in series(&metrics, "tokengate_rejections_total", "reason") {
                *refusals.entry(reason).or_insert(0) += n;
            }
            replicas.push(Replica::new(&metrics, p.memory(), elapsed));
            let pools: serde_json::Value =
                serde_json::from_str(&http_get(p.addr, "/v1/pools").await?)
                    .context("GET /v1/pools")?;
            adaptive.extend(adaptive_views(&pools));
        }
        report.proxy_memory = Some(proxies[0].memory());
        report.proxy_refusals = Some(refusals);
        report.proxy_adaptive = Some(adaptive);
        if s.replicas > 1 || ledger.is_some() {
            report.replicas = Some(replicas);
        }
        for p in proxies {
            p.stop().await;
        }
    }
    drop(ledger);
    sim.shutdown().await;
    Ok((report, records))
}

fn write_records(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in records {
        serde_json::to_writer(&mut f, r)?;
        f.write_all(b"\n")?;
    }
    Ok(f.flush()?)
}

fn write_report(o: &Options, r: ScenarioReport) -> anyhow::Result<ScenarioReport> {
    let path = o.out.join(format!("{}.json", r.name));
    std::fs::write(&path, serde_json::to_vec_pretty(&r)?)
        .with_context(|| path.display().to_string())?;
    println!("## {}\n\n{}", r.name, r.table);
    Ok(r)
}

fn plots(s: &Scenario, o: &Options, direct: &[Record], proxy: &[Record]) -> anyhow::Result<()> {
    let until = s.duration_secs + s.drain_secs.min(s.duration_secs / 4.0);
    let window = (s.duration_secs / 6.0).clamp(0.5, 20.0);
    let line = |label: &str, points, color| Series {
        label: label.into(),
        points,
        color,
    };
    let quota = vec![(0.0, s.quota_tpm as f64), (until, s.quota_tpm as f64)];
    let combined = s.proxy_quota_tpm() as f64;
    let combined = vec![(0.0, combined), (until, combined)];
    plot::lines(
        &o.plots.join(format!("{}-tokens.png", s.name)),
        &format!(
            "{}: charged tokens/min of completed calls ({window:.0} s window)",
            s.name
        ),
        ("seconds", "tokens per minute"),
        &[
            line(
                "direct",
                plot::tokens_per_minute(direct, window, until),
                plot::DIRECT,
            ),
            line(
                "tokengate",
                plot::tokens_per_minute(proxy, window, until),
                plot::PROXY,
            ),
            line("quota", quota, plot::QUOTA),
        ]
        .into_iter()
        .chain((s.spill_pools > 0).then(|| {
            line(
                "combined quota (spill chain)",
                combined,
                plotters::style::RGBColor(90, 90, 90),
            )
        }))
        .collect::<Vec<_>>(),
    )?;
    let bins = 12;
    let lat = |r: &[Record], q| plot::latency_over_time(r, q, bins, s.duration_secs);
    plot::lines(
        &o.plots.join(format!("{}-latency.png", s.name)),
        &format!(
            "{}: latency of completed calls by start time (p50, p99)",
            s.name
        ),
        ("seconds", "latency, s"),
        &[
            line("direct p50", lat(direct, 0.5), plot::DIRECT),
            line(
                "direct p99",
                lat(direct, 0.99),
                plotters::style::RGBColor(240, 150, 130),
            ),
            line("tokengate p50", lat(proxy, 0.5), plot::PROXY),
            line(
                "tokengate p99",
                lat(proxy, 0.99),
                plotters::style::RGBColor(120, 170, 240),
            ),
        ],
    )
}
