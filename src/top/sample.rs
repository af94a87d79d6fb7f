//! One reading of `GET /v1/pools`, and the rates over the last few ([`RATE_WINDOW`]).

use std::time::{Duration, Instant};

use serde_json::Value;

/// The figures `top` shows of one pool (or route), as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub name: String,
    /// Tokens reserved by requests in flight.
    pub reserved: u64,
    /// Since start: admitted, turned away, throttled upstream, tokens charged.
    pub admitted: u64,
    pub rejected: u64,
    pub upstream_throttles: u64,
    pub charged: u64,
}

/// One pool as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolSample {
    pub counts: Counts,
    pub effective_tokens_per_minute: u64,
    /// `None` when the ledger could not be read.
    pub tokens_available: Option<i64>,
    pub in_flight: u64,
    pub max_concurrency: u64,
    pub queue_depth: u64,
    pub oldest_wait_secs: f64,
    pub routes: Vec<Counts>,
}

/// Every pool, as read at `at`.
#[derive(Debug, Clone)]
pub struct Sample {
    pub at: Instant,
    pub ledger: String,
    pub pools: Vec<PoolSample>,
}

/// Per-second (per-minute for tokens) rates between two readings of one pool or route.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub admitted: f64,
    pub rejected: f64,
    pub upstream_throttles: f64,
    pub charged_per_minute: f64,
}

/// Readings kept for the rates: the newest and up to this many before it.
pub const RATE_WINDOW: usize = 5;

/// The latest sample, and the rates over the last few (none on the first).
#[derive(Debug, Clone)]
pub struct Reading {
    pub sample: Sample,
    /// By pool, then its routes, in the sample's order; `None` until two readings.
    pub rates: Option<Vec<(Rates, Vec<Rates>)>>,
    /// The samples before this one, oldest first (at most [`RATE_WINDOW`]).
    earlier: std::collections::VecDeque<Sample>,
}

impl Reading {
    pub fn first(sample: Sample) -> Reading {
        Reading {
            sample,
            rates: None,
            earlier: std::collections::VecDeque::new(),
        }
    }

    /// The reading after this one: rates between the oldest kept sample and `sample`, matched by
    /// name (a pool or route new since, or reset by a restart, has none).
    pub fn next(mut self, sample: Sample) -> Reading {
        self.earlier.push_back(self.sample);
        while self.earlier.len() > RATE_WINDOW {
            self.earlier.pop_front();
        }
        let Some(oldest) = self.earlier.front() else {
            return Reading::first(sample);
        };
        let secs = sample.at.duration_since(oldest.at).as_secs_f64();
        let rates = (secs > 0.0).then(|| {
            sample
                .pools
                .iter()
                .map(|pool| {
                    let before = oldest
                        .pools
                        .iter()
                        .find(|p| p.counts.name == pool.counts.name);
                    let routes = pool
                        .routes
                        .iter()
                        .map(|r| {
                            let old =
                                before.and_then(|b| b.routes.iter().find(|o| o.name == r.name));
                            rates(old, r, secs)
                        })
                        .collect();
                    (rates(before.map(|b| &b.counts), &pool.counts, secs), routes)
                })
                .collect()
        });
        Reading {
            sample,
            rates,
            earlier: self.earlier,
        }
    }
}

fn rates(before: Option<&Counts>, now: &Counts, secs: f64) -> Rates {
    let Some(b) = before else {
        return Rates::default();
    };
    let per_sec = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
    Rates {
        admitted: per_sec(now.admitted, b.admitted),
        rejected: per_sec(now.rejected, b.rejected),
        upstream_throttles: per_sec(now.upstream_throttles, b.upstream_throttles),
        charged_per_minute: per_sec(now.charged, b.charged) * 60.0,
    }
}

/// Reads `endpoint` (`.../v1/pools`) within `timeout`.
pub fn fetch(endpoint: &str, timeout: Duration) -> Result<Sample, String> {
    let answer = crate::healthcheck::get(endpoint, timeout).map_err(|e| e.to_string())?;
    if answer.status != 200 {
        return Err(format!("{endpoint} answered {}", answer.status));
    }
    let v: Value = serde_json::from_slice(&answer.body)
        .map_err(|e| format!("{endpoint}: not the /v1/pools JSON ({e})"))?;
    Ok(parse(&v, Instant::now()))
}

/// The figures of a `/v1/pools` document.
pub fn parse(v: &Value, at: Instant) -> Sample {
    let pools = v["pools"].as_array().map(Vec::as_slice).unwrap_or_default();
    Sample {
        at,
        ledger: v["ledger"].as_str().unwrap_or("?").to_string(),
        pools: pools.iter().map(pool).collect(),
    }
}

fn n(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i.max(0) as u64))
        .unwrap_or(0)
}

fn pool(p: &Value) -> PoolSample {
    let rejected = p["rejected"]
        .as_object()
        .map_or(0, |r| r.values().map(n).sum());
    let routes: Vec<Counts> = p["routes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|r| Counts {
            name: r["name"].as_str().unwrap_or("?").to_string(),
            reserved: n(&r["reserved_tokens"]),
            admitted: n(&r["admitted"]),
            rejected: n(&r["rejected"]),
            upstream_throttles: 0,
            charged: n(&r["charged_tokens"]),
        })
        .collect();
    let ledger = &p["ledger"];
    PoolSample {
        counts: Counts {
            name: p["name"].as_str().unwrap_or("?").to_string(),
            reserved: n(&ledger["reserved_tokens"]),
            admitted: n(&p["admitted"]),
            rejected,
            upstream_throttles: n(&p["upstream_throttles"]),
            charged: routes.iter().map(|r| r.charged).sum(),
        },
        effective_tokens_per_minute: n(&p["effective_tokens_per_minute"]),
        tokens_available: ledger["tokens_available"].as_i64(),
        in_flight: n(&ledger["in_flight_requests"]),
        max_concurrency: n(&p["max_concurrency"]),
        queue_depth: n(&p["queue"]["depth"]),
        oldest_wait_secs: p["queue"]["oldest_wait_secs"].as_f64().unwrap_or(0.0),
        routes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(admitted: u64, charged: u64) -> Value {
        serde_json::json!({"ledger": "memory", "pools": [{
            "name": "sonnet4-us", "effective_tokens_per_minute": 200000, "max_concurrency": 32,
            "ledger": {"tokens_available": -5, "reserved_tokens": 1200, "in_flight_requests": 3},
            "admitted": admitted, "upstream_throttles": 1,
            "rejected": {"tokens": 2, "requests": 0, "concurrency": 1, "never_fits": 0},
            "queue": {"depth": 2, "oldest_wait_secs": 0.25},
            "routes": [{"name": "app", "reserved_tokens": 1200, "admitted": admitted, "rejected": 3,
                        "charged_tokens": charged}]
        }]})
    }

    #[test]
    fn readings_give_rates_per_second_and_tokens_per_minute() {
        let t0 = Instant::now();
        let first = parse(&doc(10, 1000), t0);
        let p = &first.pools[0];
        assert_eq!(p.counts.rejected, 3);
        assert_eq!(p.tokens_available, Some(-5));
        assert_eq!((p.in_flight, p.queue_depth), (3, 2));
        let reading = Reading::first(first);
        assert!(reading.rates.is_none());
        let reading = reading.next(parse(&doc(30, 4000), t0 + Duration::from_secs(2)));
        let rates = reading.rates.clone().expect("two readings");
        assert_eq!(rates[0].0.admitted, 10.0);
        assert_eq!(rates[0].0.charged_per_minute, 90_000.0);
        assert_eq!(rates[0].1[0].admitted, 10.0);
        // Rates span the kept readings: 10 -> 60 admitted over 5 s.
        let mut reading = reading;
        for (i, admitted) in [(3, 40), (4, 50), (5, 60)] {
            reading = reading.next(parse(&doc(admitted, 0), t0 + Duration::from_secs(i)));
        }
        assert_eq!(reading.rates.clone().expect("rates")[0].0.admitted, 10.0);
        // Past the window, the oldest reading drops out: from 30 at 2 s to 90 at 8 s.
        let reading = reading.next(parse(&doc(70, 0), t0 + Duration::from_secs(7)));
        let reading = reading.next(parse(&doc(90, 0), t0 + Duration::from_secs(8)));
        assert_eq!(reading.rates.clone().expect("rates")[0].0.admitted, 10.0);
        // A proxy restarted meanwhile (counts went down): no negative rates.
        let reading = reading.next(parse(&doc(1, 0), t0 + Duration::from_secs(9)));
        assert_eq!(reading.rates.expect("rates")[0].0.admitted, 0.0);
    }
}
