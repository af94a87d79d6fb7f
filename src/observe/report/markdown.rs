//! The quota report as Markdown (`?format=markdown`, `tokengate report --format markdown`): one
//! section per pool, the figures in a table, the quota request in a sentence to paste.

use std::fmt::Write;

use super::{PoolReport, Quantiles, Report, SteadyPeak};

pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# tokengate quota report\n\nGenerated {} over the last {} (this replica's traffic).\n",
        utc(report.generated_at_unix),
        span(report.window_minutes)
    );
    for pool in &report.pools {
        section(&mut out, pool);
    }
    out
}

fn section(out: &mut String, p: &PoolReport) {
    let _ = writeln!(out, "## {}\n", p.pool);
    let Some(request) = p.quota_request else {
        let _ = writeln!(out, "No traffic in the window.\n");
        return;
    };
    let since = p.first_minute_unix.map_or_else(String::new, utc);
    let _ = writeln!(
        out,
        "Traffic in {} of the window's minutes, the first at {since}; configured quota {} tokens per minute{}.\n",
        p.minutes_with_traffic,
        p.configured_tokens_per_minute,
        if p.headroom > 0.0 {
            format!(" with {}% headroom", p.headroom * 100.0)
        } else {
            String::new()
        }
    );
    let t = &p.totals;
    let tpm = &p.tokens_per_minute;
    let _ = writeln!(
        out,
        "| figure | steady | peak | peak minute |\n|---|---|---|---|"
    );
    for (name, sp) in [
        ("tokens per minute demanded", tpm.demand),
        ("tokens per minute reserved", tpm.reserved),
        ("tokens per minute charged", tpm.charged),
        ("requests per minute", p.requests_per_minute),
    ] {
        row(out, name, sp);
    }
    let _ = writeln!(
        out,
        "| peak concurrency | | {} | |\n\n| per call | p50 | p99 | max |\n|---|---|---|---|",
        p.peak_concurrency
    );
    for (name, q) in [
        ("input tokens", p.input_tokens),
        ("output tokens", p.output_tokens),
        ("queue wait (ms)", p.queue_wait_ms),
    ] {
        quantiles(out, name, q);
    }
    let _ = writeln!(
        out,
        "\nRequests: {} admitted, {} turned away with a 429 by tokengate, {} throttled upstream; {} waited in the queue.\n",
        t.admitted, t.throttled, t.upstream_throttles, t.queued
    );
    let (n, basis) = (request.tokens_per_minute, request.basis_tokens_per_minute);
    let _ = if request.increase_needed {
        writeln!(
            out,
            "**Request an increase to {n} tokens per minute**: enough for the busiest minute ({basis} tokens) with zero rejections.\n"
        )
    } else {
        writeln!(
            out,
            "No increase needed: {n} tokens per minute serve the busiest minute ({basis} tokens) with zero rejections.\n"
        )
    };
    if t.upstream_throttles > 0 {
        let _ = writeln!(
            out,
            "Upstream throttled {} requests tokengate admitted: other traffic shares this account's quota, or the real quota is below the configured one.\n",
            t.upstream_throttles
        );
    }
}

fn row(out: &mut String, name: &str, sp: SteadyPeak) {
    let steady = sp.steady.map_or_else(|| "-".to_string(), |s| s.to_string());
    let at = sp.peak_minute_unix.map_or_else(|| "-".to_string(), utc);
    let _ = writeln!(out, "| {name} | {steady} | {} | {at} |", sp.peak);
}

fn quantiles(out: &mut String, name: &str, q: Option<Quantiles>) {
    let _ = match q {
        Some(q) => writeln!(out, "| {name} | {} | {} | {} |", q.p50, q.p99, q.max),
        None => writeln!(out, "| {name} | - | - | - |"),
    };
}

/// `N hours` or `N minutes`.
fn span(minutes: u64) -> String {
    if minutes.is_multiple_of(60) {
        format!("{} hours", minutes / 60)
    } else {
        format!("{minutes} minutes")
    }
}

/// `YYYY-MM-DD HH:MM UTC` of a Unix time.
pub fn utc(unix_secs: u64) -> String {
    let days = i64::try_from(unix_secs / 86_400).unwrap_or(i64::MAX);
    let secs = unix_secs % 86_400;
    let (y, m, d) = crate::calendar::civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        secs / 3600,
        (secs % 3600) / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::{
        report::{PoolReport, QuotaRequest, TokensPerMinute},
        tally::Tally,
    };

    #[test]
    fn a_pool_over_its_quota_is_told_what_to_request() {
        let busy = SteadyPeak {
            steady: Some(90_000),
            peak: 240_000,
            peak_minute_unix: Some(1_798_761_540),
        };
        let report = Report {
            generated_at_unix: 1_798_761_599,
            window_minutes: 1440,
            pools: vec![PoolReport {
                pool: "sonnet4-us".into(),
                configured_tokens_per_minute: 200_000,
                headroom: 0.0,
                minutes_with_traffic: 42,
                first_minute_unix: Some(1_798_759_080),
                tokens_per_minute: TokensPerMinute {
                    reserved: busy,
                    charged: busy,
                    demand: busy,
                },
                requests_per_minute: busy,
                peak_concurrency: 31,
                input_tokens: None,
                output_tokens: Some(Quantiles {
                    p50: 311,
                    p99: 903,
                    max: 1200,
                }),
                queue_wait_ms: None,
                totals: Tally {
                    throttled: 17,
                    ..Tally::default()
                },
                quota_request: Some(QuotaRequest {
                    tokens_per_minute: 240_000,
                    increase_needed: true,
                    basis_tokens_per_minute: 240_000,
                }),
            }],
        };
        let md = render(&report);
        for needle in [
            "over the last 24 hours",
            "Traffic in 42 of the window's minutes, the first at 2026-12-31 23:18 UTC",
            "| tokens per minute demanded | 90000 | 240000 | 2026-12-31 23:59 UTC |",
            "| peak concurrency | | 31 | |",
            "| input tokens | - | - | - |",
            "| output tokens | 311 | 903 | 1200 |",
            "17 turned away with a 429",
            "**Request an increase to 240000 tokens per minute**",
        ] {
            assert!(md.contains(needle), "{needle:?} not in:\n{md}");
        }
    }

    #[test]
    fn unix_times_read_as_utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00 UTC");
        assert_eq!(utc(1_798_761_599), "2026-12-31 23:59 UTC");
        assert_eq!(utc(4_107_542_400), "2100-03-01 00:00 UTC");
    }
}
