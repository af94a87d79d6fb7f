//! The endpoint scenario's outputs: per side the calls and their failures, each team's latency,
//! the endpoint's own counts, the copies and what they cost, the signal; a Markdown table; the
//! report (`<name>.json`), the records (`<name>.direct.jsonl`, `<name>.proxy.jsonl`) and three
//! plots (`-scaling`, `-errors`, `-latency`).

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;
use tokengate::simulator::sagemaker::FleetStats;

use super::scaler::Sample;
use super::scenario::EndpointScenario;
use crate::client::Record;
use plotters::style::RGBColor;

use crate::plot::{self, Series};
use crate::report::{Pcts, pcts};
use crate::stack::Options;

/// What one side's callers saw, by team.
#[derive(Debug, Clone, Serialize)]
pub struct TeamSummary {
    pub calls: u64,
    pub completed: u64,
    pub failed: u64,
    pub latency_ms: Option<Pcts>,
}

/// One side of the run.
#[derive(Debug, Clone, Serialize)]
pub struct SideReport {
    pub side: String,
    pub calls: u64,
    pub completed: u64,
    /// Client-visible errors after the SDK gave up, by kind (`modelerror` is the endpoint's
    /// overload answer).
    pub errors: BTreeMap<String, u64>,
    pub unfinished: u64,
    pub retries: u64,
    pub teams: BTreeMap<String, TeamSummary>,
    /// What the simulated endpoint counted (`overloaded`: calls past every copy's cap).
    pub endpoint: Option<FleetStats>,
    pub peak_copies: u32,
    /// Copies serving, integrated over the run: what the capacity cost.
    pub copy_minutes: f64,
    pub peak_signal: f64,
    pub timeline: Vec<Sample>,
}

impl SideReport {
    pub fn new(
        side: &str,
        records: &[Record],
        timeline: Vec<Sample>,
        endpoint: Option<FleetStats>,
    ) -> SideReport {
        let failed = |r: &&Record| r.outcome != "ok" && r.outcome != "unfinished";
        let mut errors = BTreeMap::new();
        for r in records.iter().filter(failed) {
            *errors.entry(r.outcome.clone()).or_insert(0) += 1;
        }
        let mut teams: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
        for r in records {
            teams.entry(r.team.clone()).or_default().push(r);
        }
        let copy_minutes = timeline
            .windows(2)
            .map(|w| f64::from(w[0].copies) * (w[1].t - w[0].t) / 60.0)
            .sum();
        SideReport {
            side: side.into(),
            calls: records.len() as u64,
            completed: records.iter().filter(|r| r.outcome == "ok").count() as u64,
            unfinished: records.iter().filter(|r| r.outcome == "unfinished").count() as u64,
            retries: records
                .iter()
                .map(|r| u64::from(r.attempts.saturating_sub(1)))
                .sum(),
            teams: teams
                .into_iter()
                .map(|(team, rs)| (team, team_summary(&rs)))
                .collect(),
            errors,
            endpoint,
            peak_copies: timeline.iter().map(|s| s.copies).max().unwrap_or(0),
            copy_minutes,
            peak_signal: timeline.iter().map(|s| s.signal).fold(0.0, f64::max),
            timeline,
        }
    }

    fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

fn team_summary(records: &[&Record]) -> TeamSummary {
    let ok: Vec<&&Record> = records.iter().filter(|r| r.outcome == "ok").collect();
    TeamSummary {
        calls: records.len() as u64,
        completed: ok.len() as u64,
        failed: records
            .iter()
            .filter(|r| r.outcome != "ok" && r.outcome != "unfinished")
            .count() as u64,
        latency_ms: pcts(ok.iter().map(|r| r.end_ms - r.start_ms).collect()),
    }
}

/// The report file.
#[derive(Debug, Serialize)]
struct Report<'a> {
    name: &'a str,
    description: &'a str,
    quick: bool,
    duration_secs: f64,
    direct: &'a SideReport,
    proxy: &'a SideReport,
    table: String,
}

/// Writes the report, the records and the plots, and prints the table.
pub fn write(
    s: &EndpointScenario,
    o: &Options,
    [direct, proxy]: [SideReport; 2],
    [direct_records, proxy_records]: [&[Record]; 2],
) -> anyhow::Result<()> {
    for (side, records) in [("direct", direct_records), ("proxy", proxy_records)] {
        let path = o.out.join(format!("{}.{side}.jsonl", s.name));
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for r in records {
            serde_json::to_writer(&mut f, r)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
    }
    plots(s, o, [&direct, &proxy], [direct_records, proxy_records])?;
    let table = markdown(&[&direct, &proxy]);
    let report = Report {
        name: &s.name,
        description: &s.description,
        quick: o.quick,
        duration_secs: s.duration_secs,
        direct: &direct,
        proxy: &proxy,
        table: table.clone(),
    };
    std::fs::write(
        o.out.join(format!("{}.json", s.name)),
        serde_json::to_vec_pretty(&report)?,
    )?;
    println!("## {}\n\n{table}", s.name);
    Ok(())
}

fn secs(p: Option<Pcts>) -> String {
    p.map_or("-".into(), |p| {
        format!("{:.1} / {:.1}", p.p50 / 1e3, p.p99 / 1e3)
    })
}

/// One row per side; a latency column per team.
fn markdown(sides: &[&SideReport]) -> String {
    let teams: Vec<&String> = sides[0].teams.keys().collect();
    let mut out =
        String::from("| side | calls | completed | failed (by kind) | endpoint overloads |");
    for t in &teams {
        out.push_str(&format!(" {t} p50 / p99 s |"));
    }
    out.push_str(" peak copies | copy-minutes | signal peak |\n|");
    out.push_str(&"---|".repeat(8 + teams.len()));
    out.push('\n');
    for s in sides {
        let kinds: Vec<String> = s.errors.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let overloads = s.endpoint.as_ref().map_or(0, |e| e.overloaded);
        out.push_str(&format!(
            "| {} | {} | {} | {} ({}) | {overloads} |",
            s.side,
            s.calls,
            s.completed,
            s.failed(),
            kinds.join(", ")
        ));
        for t in &teams {
            out.push_str(&format!(
                " {} |",
                secs(s.teams.get(*t).and_then(|x| x.latency_ms))
            ));
        }
        out.push_str(&format!(
            " {} | {:.1} | {:.1} |\n",
            s.peak_copies, s.copy_minutes, s.peak_signal
        ));
    }
    out
}

fn plots(
    s: &EndpointScenario,
    o: &Options,
    sides: [&SideReport; 2],
    records: [&[Record]; 2],
) -> anyhow::Result<()> {
    let path = |kind: &str| o.plots.join(format!("{}-{kind}.png", s.name));
    plot::lines(
        &path("scaling"),
        &format!(
            "{}: copies serving, and the per-copy signal each side scales on",
            s.name
        ),
        ("seconds", "copies / signal per copy"),
        &scaling_lines(sides),
    )?;
    let until = s.duration_secs + s.drain_secs;
    let window = (s.duration_secs / 12.0).clamp(0.5, 20.0);
    let [direct_records, proxy_records] = records;
    plot::lines(
        &path("errors"),
        &format!(
            "{}: calls failed after the SDK's retries, per minute ({window:.0} s window)",
            s.name
        ),
        ("seconds", "failed calls per minute"),
        &[
            line(
                "direct",
                failures_per_minute(direct_records, window, until),
                plot::DIRECT,
            ),
            line(
                "tokengate",
                failures_per_minute(proxy_records, window, until),
                plot::PROXY,
            ),
        ],
    )?;
    plot::lines(
        &path("latency"),
        &format!(
            "{}: p99 latency of completed calls by start time, per team",
            s.name
        ),
        ("seconds", "latency, s"),
        &latency_lines(sides[0].teams.keys(), records, s.duration_secs),
    )
}

fn line(label: &str, points: Vec<(f64, f64)>, color: RGBColor) -> Series {
    Series {
        label: label.into(),
        points,
        color,
    }
}

/// A lighter shade of `c`, for a side's second line.
fn light(c: RGBColor) -> RGBColor {
    RGBColor(c.0 / 2 + 120, c.1 / 2 + 120, c.2 / 2 + 120)
}

/// Copies serving and the signal, both sides.
fn scaling_lines([direct, proxy]: [&SideReport; 2]) -> Vec<Series> {
    let copies = |r: &SideReport| {
        r.timeline
            .iter()
            .map(|x| (x.t, f64::from(x.copies)))
            .collect()
    };
    let signal = |r: &SideReport| r.timeline.iter().map(|x| (x.t, x.signal)).collect();
    vec![
        line("copies, direct", copies(direct), plot::DIRECT),
        line("copies, tokengate", copies(proxy), plot::PROXY),
        line(
            "direct: SageMaker concurrency per copy",
            signal(direct),
            light(plot::DIRECT),
        ),
        line(
            "tokengate: demand per copy",
            signal(proxy),
            light(plot::PROXY),
        ),
    ]
}

/// Each team's p99 latency by start time, both sides (the first team in full colour).
fn latency_lines<'a>(
    teams: impl Iterator<Item = &'a String>,
    [direct, proxy]: [&[Record]; 2],
    until: f64,
) -> Vec<Series> {
    let mut lines = Vec::new();
    for (i, team) in teams.enumerate() {
        for (side, records, color) in [
            ("direct", direct, plot::DIRECT),
            ("tokengate", proxy, plot::PROXY),
        ] {
            let of_team: Vec<Record> = records
                .iter()
                .filter(|r| &r.team == team)
                .cloned()
                .collect();
            let color = if i == 0 { color } else { light(color) };
            let points = plot::latency_over_time(&of_team, 0.99, 12, until);
            lines.push(line(&format!("{side} {team} p99"), points, color));
        }
    }
    lines
}

/// Failed calls (after the SDK gave up) ending in a sliding `window`, per minute.
fn failures_per_minute(records: &[Record], window: f64, until: f64) -> Vec<(f64, f64)> {
    let ends: Vec<f64> = records
        .iter()
        .filter(|r| r.outcome != "ok" && r.outcome != "unfinished")
        .map(|r| r.end_ms / 1e3)
        .collect();
    let step = (until / 200.0).max(0.1);
    (0..=(until / step) as usize)
        .map(|i| {
            let t = i as f64 * step;
            let n = ends.iter().filter(|e| **e > t - window && **e <= t).count();
            (t, n as f64 * 60.0 / window)
        })
        .collect()
}
