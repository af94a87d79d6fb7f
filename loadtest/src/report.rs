//! Turning records into the numbers the issue asks for, per side and per team: completed and
//! failed calls, retries, upstream throttles (from the simulator), goodput against the quota,
//! latency and time-to-first-token percentiles; and a Markdown table of both sides.

use std::collections::BTreeMap;

use serde::Serialize;
use tokengate::simulator::SimStats;

use crate::client::Record;
use crate::proxy::Memory;

/// Percentiles, milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Pcts {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

/// Nearest-rank percentiles of `v` (None when empty).
pub fn pcts(mut v: Vec<f64>) -> Option<Pcts> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Pcts {
        p50: at(0.50),
        p99: at(0.99),
        p999: at(0.999),
    })
}

/// What the clients saw.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub requests: u64,
    pub completed: u64,
    /// Client-visible errors after the SDK gave up, by kind.
    pub failed: u64,
    pub errors: BTreeMap<String, u64>,
    /// Still running when the drain ended.
    pub unfinished: u64,
    /// Completed calls cut short below their own maxTokens (by the proxy's adaptive cap).
    pub cut_short: u64,
    pub attempts: u64,
    pub retries: u64,
    /// Charged tokens of calls completed inside the window, per minute.
    pub goodput_tpm: f64,
    pub goodput_fraction: f64,
    pub latency_ms: Option<Pcts>,
    pub ttft_ms: Option<Pcts>,
}

/// Summarises `records`; goodput counts completions ending in `window` (seconds).
pub fn summarize(records: &[&Record], window: (f64, f64), quota_tpm: u64) -> Summary {
    let ok = |r: &&&Record| r.outcome == "ok";
    let mut errors = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.outcome != "ok" && r.outcome != "unfinished")
    {
        *errors.entry(r.outcome.clone()).or_insert(0) += 1;
    }
    let attempts: u64 = records.iter().map(|r| r.attempts as u64).sum();
    let in_window = |r: &&&Record| (window.0 * 1e3..=window.1 * 1e3).contains(&r.end_ms);
    let charged: u64 = records
        .iter()
        .filter(ok)
        .filter(in_window)
        .map(|r| r.charged)
        .sum();
    let minutes = ((window.1 - window.0) / 60.0).max(1e-9);
    let goodput_tpm = charged as f64 / minutes;
    Summary {
        requests: records.len() as u64,
        completed: records.iter().filter(ok).count() as u64,
        failed: errors.values().sum(),
        errors,
        unfinished: records.iter().filter(|r| r.outcome == "unfinished").count() as u64,
        cut_short: records.iter().filter(|r| r.cut_short).count() as u64,
        attempts,
        retries: records
            .iter()
            .map(|r| r.attempts.saturating_sub(1) as u64)
            .sum(),
        goodput_tpm,
        goodput_fraction: goodput_tpm / quota_tpm as f64,
        latency_ms: pcts(
            records
                .iter()
                .filter(ok)
                .map(|r| r.end_ms - r.start_ms)
                .collect(),
        ),
        ttft_ms: pcts(
            records
                .iter()
                .filter(ok)
                .filter_map(|r| r.ttft_ms)
                .collect(),
        ),
    }
}

/// What the simulated Bedrock saw, summed over buckets.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Upstream {
    pub requests: u64,
    pub throttled: u64,
    pub completed: u64,
    pub errors: u64,
    pub tokens_charged: u64,
}

impl From<&SimStats> for Upstream {
    fn from(s: &SimStats) -> Upstream {
        let mut u = Upstream::default();
        for b in s.buckets.values() {
            u.requests += b.requests;
            u.throttled += b.throttled;
            u.completed += b.completed;
            u.errors += b.errors;
            u.tokens_charged += b.tokens_charged;
        }
        u
    }
}

/// One side of a scenario.
#[derive(Debug, Clone, Serialize)]
pub struct SideReport {
    pub side: String,
    pub all: Summary,
    pub teams: BTreeMap<String, Summary>,
    pub upstream: Upstream,
    pub proxy_memory: Option<Memory>,
    /// Proxy side: its refusals by reason (`tokengate_rejections_total`), at the end of the run
    /// (summed over the replicas).
    pub proxy_refusals: Option<BTreeMap<String, u64>>,
    /// Proxy side: what each route's adaptive maxTokens learned (`GET /v1/pools`'
    /// `adaptive_max_tokens` of every pool), at the end of the run.
    pub proxy_adaptive: Option<Vec<serde_json::Value>>,
    /// Proxy side, with several replicas or a shared ledger: what each replica decided.
    pub replicas: Option<Vec<Replica>>,
}

/// One proxy replica's decisions over the run, from its `/metrics` at the end.
#[derive(Debug, Clone, Serialize)]
pub struct Replica {
    /// Admitted calls (`tokengate_requests_total{outcome="admitted"}`).
    pub admitted: u64,
    /// Refused by a limit (`outcome="rejected"`).
    pub rejected: u64,
    /// Admitted and refused, per second of the run (load and drain).
    pub decisions_per_sec: f64,
    /// Upstream throttles this replica received (`tokengate_upstream_throttles_total`).
    pub upstream_throttles: u64,
    pub memory: Memory,
}

impl Replica {
    /// From a replica's `/metrics` text, over `elapsed` seconds.
    pub fn new(metrics: &str, memory: Memory, elapsed: f64) -> Replica {
        let outcomes = series(metrics, "tokengate_requests_total", "outcome");
        let count = |outcome: &str| outcomes.get(outcome).copied().unwrap_or(0);
        let (admitted, rejected) = (count("admitted"), count("rejected"));
        let throttles = series(metrics, "tokengate_upstream_throttles_total", "pool");
        Replica {
            admitted,
            rejected,
            decisions_per_sec: (admitted + rejected) as f64 / elapsed.max(1e-9),
            upstream_throttles: throttles.values().sum(),
            memory,
        }
    }
}

impl SideReport {
    pub fn new(side: &str, records: &[Record], window: (f64, f64), quota: u64) -> SideReport {
        let all: Vec<&Record> = records.iter().collect();
        let mut teams: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
        for r in records {
            teams.entry(r.team.clone()).or_default().push(r);
        }
        SideReport {
            side: side.to_string(),
            all: summarize(&all, window, quota),
            teams: teams
                .into_iter()
                .map(|(t, rs)| (t, summarize(&rs, window, quota)))
                .collect(),
            upstream: Upstream::default(),
            proxy_memory: None,
            proxy_refusals: None,
            proxy_adaptive: None,
            replicas: None,
        }
    }
}

fn ms(p: Option<Pcts>, f: fn(&Pcts) -> f64) -> String {
    p.map_or("-".into(), |p| format!("{:.0}", f(&p)))
}

/// One Markdown row per side (and per team when there are several).
pub fn markdown(sides: &[&SideReport]) -> String {
    let mut out = String::from(
        "| side | team | calls | completed | failed | unfinished | cut short | retries | upstream 429 | goodput tok/min | of quota | latency p50 / p99 ms | TTFT p50 / p99 ms |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in sides {
        let mut rows = vec![("all", &s.all)];
        if s.teams.len() > 1 {
            rows.extend(s.teams.iter().map(|(t, x)| (t.as_str(), x)));
        }
        for (team, x) in rows {
            let throttles = if team == "all" {
                s.upstream.throttled.to_string()
            } else {
                "".into()
            };
            out.push_str(&format!(
                "| {} | {team} | {} | {} | {} | {} | {} | {} | {throttles} | {:.0} | {:.0}% | {} / {} | {} / {} |\n",
                s.side, x.requests, x.completed, x.failed, x.unfinished, x.cut_short, x.retries,
                x.goodput_tpm, x.goodput_fraction * 100.0,
                ms(x.latency_ms, |p| p.p50), ms(x.latency_ms, |p| p.p99),
                ms(x.ttft_ms, |p| p.p50), ms(x.ttft_ms, |p| p.p99),
            ));
        }
    }
    for s in sides {
        if let Some(replicas) = &s.replicas {
            out.push_str(&format!("\n{} replicas (one shared ledger):\n\n", s.side));
            out.push_str("| replica | admitted | refused | decisions/s | upstream 429 | RSS MiB |\n|---|---|---|---|---|---|\n");
            for (i, r) in replicas.iter().enumerate() {
                out.push_str(&format!(
                    "| {i} | {} | {} | {:.1} | {} | {:.1} |\n",
                    r.admitted,
                    r.rejected,
                    r.decisions_per_sec,
                    r.upstream_throttles,
                    r.memory.rss_kib as f64 / 1024.0
                ));
            }
        }
    }
    for s in sides {
        if let Some(refusals) = s.proxy_refusals.as_ref().filter(|r| !r.is_empty()) {
            let by_reason: Vec<String> = refusals.iter().map(|(r, n)| format!("{r} {n}")).collect();
            out.push_str(&format!(
                "\n{} refusals by reason: {}\n",
                s.side,
                by_reason.join(", ")
            ));
        }
    }
    for s in sides {
        for a in s.proxy_adaptive.iter().flatten() {
            let n = |k: &str| a[k].as_u64().map_or("-".into(), |n| n.to_string());
            out.push_str(&format!(
                "\n{} adaptive maxTokens, route {} model {}: cap {}, samples {}, capped calls {}, \
                 proxy-caused truncations {}, raises {}\n",
                s.side,
                a["route"].as_str().unwrap_or("?"),
                a["model"].as_str().unwrap_or("?"),
                n("cap"),
                n("samples"),
                n("capped_calls"),
                n("proxy_truncations"),
                n("raises"),
            ));
        }
    }
    out
}

/// Every pool's `adaptive_max_tokens` views in a `GET /v1/pools` answer.
pub fn adaptive_views(pools: &serde_json::Value) -> Vec<serde_json::Value> {
    pools["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| {
            p["adaptive_max_tokens"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

/// The samples of counter `name` by the value of `label` (summed over the other labels).
pub fn series(metrics: &str, name: &str, label: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let prefix = format!("{name}{{");
    for line in metrics.lines().filter(|l| l.starts_with(&prefix)) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let key = format!("{label}=\"");
        let Some(v) = series
            .split_once(&key)
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(v, _)| v.to_string())
        else {
            continue;
        };
        let n = value.parse::<f64>().unwrap_or(0.0) as u64;
        if n > 0 {
            *out.entry(v).or_insert(0) += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let p = pcts((1..=1000).map(f64::from).collect()).unwrap();
        assert_eq!((p.p50, p.p99, p.p999), (500.0, 990.0, 999.0));
        assert!(pcts(Vec::new()).is_none());
    }
}
