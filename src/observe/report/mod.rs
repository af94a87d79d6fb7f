//! The quota report (`GET /v1/quota-report`, `tokengate report`): what each pool needed over a
//! recent window, in the figures a quota increase is asked for with.
//!
//! # Recording
//! The observer counts every request's [`Event`]s into its pool's [`PoolWindow`]: one
//! [`super::tally::Tally`] per minute with traffic, and per hour the distributions of tokens per
//! call and of queue waits. Minutes come from the gateway's clock (the ledger's), so tests
//! control them. The window (`[metrics] quota_report_window_hours`, 24 by default) bounds the
//! memory: at most one slot per minute of it and pool, about 150 KiB a pool for a day. Pools
//! keep their history across config reloads (by name). Nothing is written to disk: a restart
//! starts an empty window.
//!
//! # Figures, per pool
//! - tokens per minute reserved, charged and demanded (reservations asked for, admitted or turned
//!   away at a first attempt): **steady** is the median of the minutes with traffic, **peak** the
//!   busiest minute (and when it was);
//! - requests per minute (steady, peak), peak concurrency (requests in flight at once);
//! - p50 and p99 of input tokens (`inputTokens + cacheWriteInputTokens`: what Bedrock charges;
//!   cache reads are free) and output tokens per call with usage, and of queue waits;
//! - throttles: 429s tokengate sent, and those upstream sent although tokengate admitted;
//! - **what to request**: tokens per minute enough for the busiest minute with zero rejections:
//!   the larger of that minute's demand and its charge (burndown can charge more than was
//!   reserved), divided by `1 - headroom` (the part of the quota the pool keeps free), rounded
//!   up to a thousand. Bedrock reserves `input + maxTokens` when a call starts, so a quota that
//!   holds a minute's reservations refuses none of them.
//!
//! # Limits
//! Minutes are calendar minutes of the proxy's clock: a burst that straddles two is split
//! between them. Each replica reports its own traffic; with the Redis ledger, add the replicas'
//! figures (their peaks may fall in different minutes, so the sum errs high). The distributions
//! cover whole hours, so up to 59 minutes more than the window. Quantiles are bucketed as in the
//! maxTokens advice: they err high by at most 12.5%.

pub mod markdown;
pub mod window;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::Serialize;

pub use super::tally::Event;
use super::tally::Tally;
use crate::{admission::Pool, ledger::Clock};
pub use window::PoolWindow;

const NANOS_PER_MINUTE: u64 = 60_000_000_000;
/// Quota requests are rounded up to this many tokens per minute.
const REQUEST_STEP: u64 = 1_000;

/// Every pool's window, by pool name (so a reloaded pool keeps its history).
#[derive(Debug)]
pub struct QuotaReport {
    clock: Clock,
    /// Wall-clock time at the clock's zero, in seconds since the Unix epoch.
    epoch_unix_secs: u64,
    window_minutes: u64,
    pools: Mutex<HashMap<String, Arc<PoolWindow>>>,
}

impl QuotaReport {
    pub fn new(clock: Clock, window: Duration) -> QuotaReport {
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        QuotaReport {
            epoch_unix_secs: now_unix.saturating_sub(clock.now_ns() / 1_000_000_000),
            clock,
            window_minutes: (window.as_secs() / 60).max(1),
            pools: Mutex::new(HashMap::new()),
        }
    }

    /// The minute now, counted from the clock's zero.
    pub fn minute(&self) -> u64 {
        self.clock.now_ns() / NANOS_PER_MINUTE
    }

    /// The window of pool `name`, created on first use.
    pub fn pool(&self, name: &str) -> Arc<PoolWindow> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(PoolWindow::new(self.window_minutes)))
            .clone()
    }

    fn unix(&self, minute: u64) -> u64 {
        self.epoch_unix_secs + minute * 60
    }

    /// The report of `pools` (the policy in force) now.
    pub fn report(&self, pools: &[Arc<Pool>]) -> Report {
        let now = self.minute();
        Report {
            generated_at_unix: self.unix(now) + (self.clock.now_ns() / 1_000_000_000) % 60,
            window_minutes: self.window_minutes,
            pools: pools
                .iter()
                .map(|pool| self.pool_report(pool, now))
                .collect(),
        }
    }

    fn pool_report(&self, pool: &Pool, now: u64) -> PoolReport {
        let (minutes, dist) = self.pool(&pool.name).read(now);
        let mut totals = Tally::default();
        for (_, t) in &minutes {
            add(&mut totals, t);
        }
        let per_minute = |f: fn(&Tally) -> u64| self.steady_and_peak(&minutes, f);
        let demand = per_minute(|t| t.demand_tokens);
        let charged = per_minute(|t| t.charged_tokens);
        let quota_request = (!minutes.is_empty()).then(|| {
            quota_request(
                demand.peak.max(charged.peak),
                pool.config.headroom,
                pool.config.tokens_per_minute,
            )
        });
        PoolReport {
            pool: pool.name.to_string(),
            configured_tokens_per_minute: pool.config.tokens_per_minute,
            headroom: pool.config.headroom,
            minutes_with_traffic: minutes.len(),
            first_minute_unix: minutes.first().map(|(m, _)| self.unix(*m)),
            tokens_per_minute: TokensPerMinute {
                reserved: per_minute(|t| t.reserved_tokens),
                charged,
                demand,
            },
            requests_per_minute: per_minute(|t| t.requests),
            peak_concurrency: totals.peak_in_flight,
            input_tokens: Quantiles::of(&dist.input),
            output_tokens: Quantiles::of(&dist.output),
            queue_wait_ms: Quantiles::of(&dist.queue_wait),
            totals,
            quota_request,
        }
    }

    /// The median of the minutes with traffic, and the busiest minute.
    fn steady_and_peak(&self, minutes: &[(u64, Tally)], f: fn(&Tally) -> u64) -> SteadyPeak {
        let mut values: Vec<u64> = minutes.iter().map(|(_, t)| f(t)).collect();
        let peak = minutes.iter().max_by_key(|(m, t)| (f(t), u64::MAX - m));
        values.sort_unstable();
        SteadyPeak {
            steady: values.get(values.len().saturating_sub(1) / 2).copied(),
            peak: peak.map_or(0, |(_, t)| f(t)),
            peak_minute_unix: peak.map(|(m, _)| self.unix(*m)),
        }
    }
}

/// Adds a minute's counts to the window's (peaks are the larger).
fn add(to: &mut Tally, t: &Tally) {
    to.requests += t.requests;
    to.admitted += t.admitted;
    to.throttled += t.throttled;
    to.upstream_throttles += t.upstream_throttles;
    to.queued += t.queued;
    to.reserved_tokens += t.reserved_tokens;
    to.charged_tokens += t.charged_tokens;
    to.demand_tokens += t.demand_tokens;
    to.spilled_in += t.spilled_in;
    to.peak_in_flight = to.peak_in_flight.max(t.peak_in_flight);
    to.queue_wait_ms += t.queue_wait_ms;
    to.queue_wait_max_ms = to.queue_wait_max_ms.max(t.queue_wait_max_ms);
}

/// What to ask for: `basis` tokens per minute after the pool's headroom, rounded up.
fn quota_request(basis: u64, headroom: f64, configured: u64) -> QuotaRequest {
    let needed = (basis as f64 / (1.0 - headroom)).ceil() as u64;
    let tokens_per_minute = needed.div_ceil(REQUEST_STEP).saturating_mul(REQUEST_STEP);
    QuotaRequest {
        tokens_per_minute,
        increase_needed: tokens_per_minute > configured,
        basis_tokens_per_minute: basis,
    }
}

/// `GET /v1/quota-report`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub generated_at_unix: u64,
    pub window_minutes: u64,
    pub pools: Vec<PoolReport>,
}

/// One pool's figures over the window.
#[derive(Debug, Clone, Serialize)]
pub struct PoolReport {
    pub pool: String,
    pub configured_tokens_per_minute: u64,
    pub headroom: f64,
    pub minutes_with_traffic: usize,
    /// The first minute with traffic in the window.
    pub first_minute_unix: Option<u64>,
    pub tokens_per_minute: TokensPerMinute,
    pub requests_per_minute: SteadyPeak,
    pub peak_concurrency: u64,
    pub input_tokens: Option<Quantiles>,
    pub output_tokens: Option<Quantiles>,
    pub queue_wait_ms: Option<Quantiles>,
    /// The window's counts summed (`peak_in_flight` and `queue_wait_max_ms` are maxima).
    pub totals: Tally,
    /// `null` before the pool saw traffic.
    pub quota_request: Option<QuotaRequest>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokensPerMinute {
    pub reserved: SteadyPeak,
    pub charged: SteadyPeak,
    pub demand: SteadyPeak,
}

/// A per-minute figure: the median minute with traffic, and the busiest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SteadyPeak {
    pub steady: Option<u64>,
    pub peak: u64,
    /// The start of the busiest minute (the earliest, on a tie).
    pub peak_minute_unix: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Quantiles {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

impl Quantiles {
    fn of(h: &crate::admission::advice::Lengths) -> Option<Quantiles> {
        Some(Quantiles {
            p50: h.quantile(0.5)?,
            p99: h.quantile(0.99)?,
            max: h.max(),
        })
    }
}

/// What to ask AWS for to serve the window's busiest minute with zero rejections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QuotaRequest {
    /// Tokens per minute to request (rounded up to a thousand).
    pub tokens_per_minute: u64,
    /// Above the pool's configured `tokens_per_minute`.
    pub increase_needed: bool,
    /// The busiest minute's tokens the request is based on: the larger of its demand and its
    /// charge, before headroom.
    pub basis_tokens_per_minute: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_covers_the_peak_after_headroom_rounded_up() {
        let r = quota_request(180_001, 0.0, 200_000);
        assert_eq!(r.tokens_per_minute, 181_000);
        assert!(!r.increase_needed);
        let r = quota_request(180_000, 0.1, 200_000);
        assert_eq!(r.tokens_per_minute, 200_000, "180000 / 0.9");
        assert!(!r.increase_needed);
        let r = quota_request(190_000, 0.1, 200_000);
        assert_eq!(r.tokens_per_minute, 212_000, "211112 rounded up");
        assert!(r.increase_needed);
    }

    #[test]
    fn steady_is_the_median_minute_and_peak_the_busiest() {
        let report = QuotaReport::new(Clock::manual(), Duration::from_secs(3600));
        let tally = |demand_tokens| Tally {
            demand_tokens,
            ..Tally::default()
        };
        let minutes = [
            (3, tally(10)),
            (4, tally(50)),
            (7, tally(20)),
            (9, tally(50)),
        ];
        let sp = report.steady_and_peak(&minutes, |t| t.demand_tokens);
        assert_eq!(sp.steady, Some(20));
        assert_eq!(sp.peak, 50);
        assert_eq!(sp.peak_minute_unix, Some(report.epoch_unix_secs + 4 * 60));
        let empty = report.steady_and_peak(&[], |t| t.demand_tokens);
        assert_eq!(
            (empty.steady, empty.peak, empty.peak_minute_unix),
            (None, 0, None)
        );
    }
}
