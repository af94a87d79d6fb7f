//! A soak: the scenario's mixed load through a tokengate child process for minutes, with upstream
//! faults injected by the simulator (its `*_rate` keys) and client faults (callers that drop
//! streams, `hang_up_rate`). Only the proxy side runs: there is nothing to compare.
//!
//! At the end it checks, and the run fails if any check fails:
//! - **every call was answered**: none cut off at the end of the drain (`unfinished`), none that
//!   could not reach the proxy or timed out waiting for it;
//! - **the ledger is at zero**: `/v1/pools` shows no tokens reserved and nothing in flight, and no
//!   reservation was dropped unsettled;
//! - **memory is flat**: the proxy's RSS at the end of the load is within `max_rss_growth` (plus
//!   4 MiB of allocator noise) of its RSS after the warm-up (`--quick` is too short to say: the
//!   check is reported `skipped`, never `pass`);
//! - **faults were injected**, and **stalls end at the idle timeout**: a stream the simulator
//!   stalls past the proxy's idle timeout ends with the proxy's `idle_timeout` (reported `skipped`
//!   if no stall was drawn);
//! - **shutdown is clean**: SIGTERM makes it exit 0 with its last line saying every reservation
//!   was settled.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::client::Record;
use crate::drive::drive;
use crate::proxy::memory_of;
use crate::report::{Upstream, series};
use crate::scenario::Scenario;
use crate::stack::{Options, http_get, start_proxy, start_simulator};

/// Outcomes that are not an answer from the proxy.
const UNANSWERED: [&str; 3] = ["unfinished", "dispatch_failure", "timeout"];

/// What a soak measured, and its verdicts.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub requests: u64,
    /// Calls that got an answer (a success or an error the SDK gave up on).
    pub answered: u64,
    /// Answers by kind, as the clients saw them after the SDK's retries.
    pub answers: BTreeMap<String, u64>,
    /// SDK attempts, retries included.
    pub attempts: u64,
    /// Faults injected: the simulator's, by kind, and the clients' hang-ups.
    pub faults_injected: BTreeMap<String, u64>,
    /// What the simulated Bedrock saw.
    pub upstream: Upstream,
    /// The proxy's own counters at the end: upstream answers by status, upstream failures by
    /// kind, settlements by rule.
    pub proxy_upstream_statuses: BTreeMap<String, u64>,
    pub proxy_upstream_errors: BTreeMap<String, u64>,
    pub settlements: BTreeMap<String, u64>,
    pub ledger_end: LedgerEnd,
    /// Requests the proxy held admitted (`/v1/pools`), sampled under load (after the warm-up).
    pub in_flight: InFlight,
    pub rss: Rss,
    pub exit_code: Option<i32>,
    /// The proxy's last log line.
    pub last_log_line: String,
    pub checks: Vec<Check>,
}

/// The ledger as `/v1/pools` shows it once the load is over.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LedgerEnd {
    pub reserved_tokens: u64,
    pub in_flight_requests: u64,
    pub unsettled_reservations: u64,
}

/// Requests in flight in the proxy's pools under load, from samples of `/v1/pools`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct InFlight {
    pub mean: f64,
    pub peak: u64,
    pub samples: usize,
}

/// The proxy's resident memory over the run, KiB.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rss {
    /// The first sample after the warm-up.
    pub start_kib: u64,
    /// The last sample under load.
    pub end_kib: u64,
    pub after_drain_kib: u64,
    pub peak_kib: u64,
    /// (seconds, KiB) every `sample_secs`.
    pub samples: Vec<(f64, u64)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
}

/// A check's verdict; `Skipped` when the run could not evaluate it (said in the detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Skipped,
}

impl Check {
    fn new(name: &'static str, passed: bool, detail: String) -> Check {
        let status = if passed { Status::Pass } else { Status::Fail };
        Check {
            name,
            status,
            detail,
        }
    }

    fn skipped(name: &'static str, detail: String) -> Check {
        Check {
            name,
            status: Status::Skipped,
            detail,
        }
    }
}

impl SoakReport {
    /// No check failed (a skipped one is named in the table, not failed).
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.status != Status::Fail)
    }

    pub fn markdown(&self) -> String {
        let join = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut out = String::from("| figure | value |\n|---|---|\n");
        let mut row = |k: &str, v: String| out.push_str(&format!("| {k} | {v} |\n"));
        row("calls", self.requests.to_string());
        row(
            "answered",
            format!("{} of {}", self.answered, self.requests),
        );
        row("answers by kind", join(&self.answers));
        row("SDK attempts", self.attempts.to_string());
        row("faults injected", join(&self.faults_injected));
        row(
            "upstream requests / 429 / completed",
            format!(
                "{} / {} / {}",
                self.upstream.requests, self.upstream.throttled, self.upstream.completed
            ),
        );
        row(
            "proxy: upstream statuses",
            join(&self.proxy_upstream_statuses),
        );
        row("proxy: upstream errors", join(&self.proxy_upstream_errors));
        row("settlements by rule", join(&self.settlements));
        let l = self.ledger_end;
        row(
            "ledger at the end",
            format!(
                "reserved {} tokens, {} in flight, {} dropped unsettled",
                l.reserved_tokens, l.in_flight_requests, l.unsettled_reservations
            ),
        );
        row(
            "requests in flight under load: mean / peak",
            format!(
                "{:.1} / {} ({} samples)",
                self.in_flight.mean, self.in_flight.peak, self.in_flight.samples
            ),
        );
        let mib = |k: u64| format!("{:.1} MiB", k as f64 / 1024.0);
        row(
            "proxy RSS: after warm-up / end of load / after drain / peak",
            format!(
                "{} / {} / {} / {}",
                mib(self.rss.start_kib),
                mib(self.rss.end_kib),
                mib(self.rss.after_drain_kib),
                mib(self.rss.peak_kib)
            ),
        );
        row("exit code after SIGTERM", format!("{:?}", self.exit_code));
        row("last log line", format!("`{}`", self.last_log_line));
        for c in &self.checks {
            let verdict = match c.status {
                Status::Pass => "pass",
                Status::Fail => "FAIL",
                Status::Skipped => "skipped",
            };
            row(
                &format!("check: {}", c.name),
                format!("{verdict}: {}", c.detail),
            );
        }
        out
    }
}

/// Runs the soak of `s` and checks it.
pub async fn run(s: &Scenario, o: &Options) -> anyhow::Result<SoakReport> {
    let soak = s.soak.clone().context("not a soak scenario")?;
    eprintln!(
        "[{}] soak: {:.0} s of load through the proxy",
        s.name, s.duration_secs
    );
    let sim = start_simulator(s).await?;
    let proxy = start_proxy(s, o, sim.addr).await?;
    let (pid, addr, log) = (proxy.pid(), proxy.addr, proxy.log.clone());
    let samples = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(Mutex::new(Vec::new()));
    let epoch = Instant::now();
    let period = Duration::from_secs_f64(soak.sample_secs.min(s.duration_secs / 4.0).max(0.1));
    let sampler = {
        let (samples, in_flight) = (samples.clone(), in_flight.clone());
        tokio::spawn(async move {
            loop {
                let rss = memory_of(pid).rss_kib;
                let at = epoch.elapsed().as_secs_f64();
                if let Ok(mut v) = samples.lock() {
                    v.push((at, rss));
                }
                if let Ok(n) = in_flight_now(addr).await
                    && let Ok(mut v) = in_flight.lock()
                {
                    v.push((at, n));
                }
                tokio::time::sleep(period).await;
            }
        })
    };
    let records = drive(s, &[addr], "proxy").await;
    sampler.abort();
    let after_drain = memory_of(pid);
    let ledger = ledger_at_rest(addr).await?;
    let metrics = http_get(addr, "/metrics").await?;
    let exit_code = proxy.terminate(Duration::from_secs(60)).await?;
    let last_log_line = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let stats = sim.simulator.stats();
    sim.shutdown().await;

    let samples = samples.lock().map(|v| v.clone()).unwrap_or_default();
    let rss = rss(&samples, s, after_drain.rss_kib, after_drain.hwm_kib);
    let in_flight = in_flight.lock().map(|v| v.clone()).unwrap_or_default();
    let in_flight = in_flight_under_load(&in_flight, s);
    let mut report = SoakReport {
        requests: records.len() as u64,
        answered: 0,
        answers: answers(&records),
        attempts: records.iter().map(|r| u64::from(r.attempts)).sum(),
        faults_injected: stats.faults.clone(),
        upstream: (&stats).into(),
        proxy_upstream_statuses: series(&metrics, "tokengate_upstream_responses_total", "status"),
        proxy_upstream_errors: series(&metrics, "tokengate_upstream_errors_total", "kind"),
        settlements: series(&metrics, "tokengate_settlements_total", "rule"),
        ledger_end: ledger,
        in_flight,
        rss,
        exit_code,
        last_log_line,
        checks: Vec::new(),
    };
    let hang_ups = report.answers.get("hung_up").copied().unwrap_or(0);
    report
        .faults_injected
        .insert("client_hang_up".into(), hang_ups);
    report.answered = report
        .answers
        .iter()
        .filter(|(k, _)| !UNANSWERED.contains(&k.as_str()))
        .map(|(_, v)| v)
        .sum();
    report.checks = checks(&report, s, o.quick, soak.max_rss_growth);
    Ok(report)
}

fn answers(records: &[Record]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for r in records {
        *out.entry(r.outcome.clone()).or_insert(0) += 1;
    }
    out
}

fn rss(samples: &[(f64, u64)], s: &Scenario, after_drain: u64, peak: u64) -> Rss {
    let under_load = |t: f64| t >= s.warmup_secs && t <= s.duration_secs;
    let loaded: Vec<_> = samples.iter().filter(|(t, _)| under_load(*t)).collect();
    Rss {
        start_kib: loaded.first().map_or(0, |(_, k)| *k),
        end_kib: loaded.last().map_or(0, |(_, k)| *k),
        after_drain_kib: after_drain,
        peak_kib: peak,
        samples: samples.to_vec(),
    }
}

fn checks(r: &SoakReport, s: &Scenario, quick: bool, max_growth: f64) -> Vec<Check> {
    let unanswered = r.requests - r.answered;
    let l = r.ledger_end;
    let faults: u64 = r.faults_injected.values().sum();
    vec![
        Check::new(
            "every call answered",
            unanswered == 0 && r.requests > 0,
            format!("{unanswered} of {} without an answer", r.requests),
        ),
        Check::new(
            "ledger at zero",
            l.reserved_tokens == 0 && l.in_flight_requests == 0 && l.unsettled_reservations == 0,
            format!(
                "reserved {}, in flight {}, dropped unsettled {}",
                l.reserved_tokens, l.in_flight_requests, l.unsettled_reservations
            ),
        ),
        Check::new(
            "clean shutdown",
            r.exit_code == Some(0)
                && r.last_log_line
                    .contains("stopped: every reservation settled"),
            format!("exit {:?}", r.exit_code),
        ),
        memory_check(r, s, quick, max_growth),
        Check::new("faults were injected", faults > 0, format!("{faults}")),
        stall_check(r),
    ]
}

fn memory_check(r: &SoakReport, s: &Scenario, quick: bool, max_growth: f64) -> Check {
    const NAME: &str = "memory flat";
    if quick {
        return Check::skipped(NAME, "not evaluated in --quick (too short to say)".into());
    }
    let allowed = (r.rss.start_kib as f64 * (1.0 + max_growth)) as u64 + 4096;
    Check::new(
        NAME,
        r.rss.start_kib > 0 && r.rss.end_kib <= allowed,
        format!(
            "{} KiB after the {:.0} s warm-up, {} KiB at the end of the load (at most {allowed})",
            r.rss.start_kib, s.warmup_secs, r.rss.end_kib
        ),
    )
}

/// Stalls outlast the proxy's idle timeout (the scenario's `stall_ms`, also in `--quick`), so
/// each ends with the proxy's `idle_timeout`, unless its caller hung up first.
fn stall_check(r: &SoakReport) -> Check {
    const NAME: &str = "stalls end at the idle timeout";
    let stalls = r.faults_injected.get("stall").copied().unwrap_or(0);
    let timeouts = r
        .proxy_upstream_errors
        .get("idle_timeout")
        .copied()
        .unwrap_or(0);
    if stalls == 0 {
        return Check::skipped(NAME, "no stall was drawn in this run".into());
    }
    Check::new(
        NAME,
        timeouts > 0 && timeouts <= stalls,
        format!("{stalls} stalls injected, {timeouts} idle timeouts"),
    )
}

/// Polls `/v1/pools` until nothing is reserved or in flight (calls cut off at the end of the
/// drain settle as the proxy notices the hang-up), for up to 30 s; returns the last reading.
/// Requests in flight in every pool now.
async fn in_flight_now(addr: SocketAddr) -> anyhow::Result<u64> {
    let body = http_get(addr, "/v1/pools").await?;
    let v: serde_json::Value = serde_json::from_str(&body).context("/v1/pools JSON")?;
    Ok(v["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["ledger"]["in_flight_requests"].as_u64())
        .sum())
}

/// Mean and peak of the samples taken under load (after the warm-up, before the drain).
fn in_flight_under_load(samples: &[(f64, u64)], s: &Scenario) -> InFlight {
    let loaded: Vec<u64> = samples
        .iter()
        .filter(|(t, _)| *t >= s.warmup_secs && *t <= s.duration_secs)
        .map(|(_, n)| *n)
        .collect();
    InFlight {
        mean: loaded.iter().sum::<u64>() as f64 / loaded.len().max(1) as f64,
        peak: loaded.iter().copied().max().unwrap_or(0),
        samples: loaded.len(),
    }
}

async fn ledger_at_rest(addr: SocketAddr) -> anyhow::Result<LedgerEnd> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = http_get(addr, "/v1/pools").await?;
        let v: serde_json::Value = serde_json::from_str(&body).context("/v1/pools JSON")?;
        let mut end = LedgerEnd {
            unsettled_reservations: v["unsettled_reservations"].as_u64().unwrap_or(u64::MAX),
            ..LedgerEnd::default()
        };
        for pool in v["pools"].as_array().into_iter().flatten() {
            let ledger = &pool["ledger"];
            end.reserved_tokens += ledger["reserved_tokens"].as_u64().unwrap_or(u64::MAX / 4);
            end.in_flight_requests += ledger["in_flight_requests"]
                .as_u64()
                .unwrap_or(u64::MAX / 4);
        }
        if (end.reserved_tokens == 0 && end.in_flight_requests == 0) || Instant::now() > deadline {
            return Ok(end);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
