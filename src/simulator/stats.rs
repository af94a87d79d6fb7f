//! What the simulator has seen, served as JSON on `GET /_sim/stats`: every bucket, and the
//! quota-counted calls broken down by API, by requested service tier and by Region.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use dashmap::{DashMap, DashSet};
use serde::{Deserialize, Serialize};

/// A snapshot of every bucket and of SigV4 checking.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SimStats {
    /// Keyed as [`super::model_id`] says: `{base model}@{region}`, `{base model}@geo:{prefix}`,
    /// `{base model}@global` (profiles called from another Region than the default one:
    /// `{base model}@{region}/geo:{prefix}`), reserved capacity with `#reserved` after the key.
    pub buckets: BTreeMap<String, BucketStats>,
    pub sigv4: SigV4Stats,
    /// Calls by operation name (every operation, quota-counted or not).
    pub operations: BTreeMap<String, u64>,
    /// Bytes of streaming response bodies handed to connections so far: how far the streams got,
    /// against what their clients read (a measure of back-pressure).
    #[serde(default)]
    pub stream_bytes_sent: u64,
    /// Faults injected, by kind (`503`, `500`, `reset`, `cut`, `stall`), forced or drawn.
    #[serde(default)]
    pub faults: BTreeMap<String, u64>,
    /// Quota-counted calls by API: `Converse`, `ConverseStream`, `InvokeModel`,
    /// `InvokeModelWithResponseStream`, `InvokeModelWithBidirectionalStream`,
    /// `OpenAIChatCompletions`, `OpenAIResponses`, `AnthropicMessages`.
    #[serde(default)]
    pub apis: BTreeMap<String, CallStats>,
    /// Quota-counted calls by the service tier they asked for (none asked = `default`).
    #[serde(default)]
    pub tiers: BTreeMap<String, CallStats>,
    /// Quota-counted calls, buckets and the account-wide day, by Region.
    #[serde(default)]
    pub regions: BTreeMap<String, RegionStats>,
    /// The quota day now.
    #[serde(default)]
    pub day: DayStats,
    /// Bearer and `x-api-key` credentials seen and checked.
    #[serde(default)]
    pub api_keys: ApiKeyStats,
    /// The `traceparent` headers of the last [`RECENT_TRACEPARENTS`] model calls (any API), oldest
    /// first: what a proxy propagated of its callers' traces.
    #[serde(default)]
    pub traceparents: Vec<String>,
}

/// How many `traceparent` headers the stats keep.
pub const RECENT_TRACEPARENTS: usize = 64;

/// The last `traceparent` headers received.
#[derive(Debug, Default)]
pub(crate) struct TraceParents(std::sync::Mutex<std::collections::VecDeque<String>>);

impl TraceParents {
    pub fn observe(&self, value: Option<&http::HeaderValue>) {
        let Some(value) = value.and_then(|v| v.to_str().ok()) else {
            return;
        };
        let mut recent = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() == RECENT_TRACEPARENTS {
            recent.pop_front();
        }
        recent.push_back(value.to_string());
    }

    pub fn snapshot(&self) -> Vec<String> {
        let recent = self.0.lock().unwrap_or_else(|p| p.into_inner());
        recent.iter().cloned().collect()
    }
}

impl SimStats {
    /// Requests throttled, over every bucket.
    pub fn throttled(&self) -> u64 {
        self.buckets.values().map(|b| b.throttled).sum()
    }

    /// Calls received, every operation.
    pub fn calls(&self) -> u64 {
        self.operations.values().sum()
    }

    /// Tokens charged at settlement, over every bucket.
    pub fn tokens_charged(&self) -> u64 {
        self.buckets.values().map(|b| b.tokens_charged).sum()
    }
}

/// One quota bucket.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketStats {
    /// Quota-counted calls that reached the bucket (503-injected ones included).
    pub requests: u64,
    /// Calls refused with 429 `ThrottlingException`.
    pub throttled: u64,
    /// Calls that finished normally and were settled.
    pub completed: u64,
    /// Injected faults (503s, 500s, resets, cut streams).
    pub errors: u64,
    /// Sum of settled charges (`input + cacheWrite + output x burndown`).
    pub tokens_charged: u64,
    /// Sum of the reservations of calls still running.
    pub tokens_reserved_in_flight: u64,
    pub in_flight: u64,
    /// Tokens left now; negative after a burndown overshoot.
    pub tokens_available: i64,
    pub tokens_per_minute: u64,
    /// The Region whose capacity this is.
    #[serde(default)]
    pub region: String,
    /// The base model.
    #[serde(default)]
    pub model: String,
    /// `on_demand`, `geo:{prefix}`, `global` or `dedicated`.
    #[serde(default)]
    pub route: String,
    /// `on_demand` or `reserved` capacity.
    #[serde(default)]
    pub tier: String,
    /// The daily quota; none for reserved capacity.
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
    /// Tokens of the day used so far (reservations in flight included).
    #[serde(default)]
    pub tokens_used_today: u64,
    /// Of `throttled`, the calls refused because the day (the bucket's or the Region's) was used
    /// up.
    #[serde(default)]
    pub throttled_daily: u64,
    /// Reserved capacity only: calls that did not fit and went on to the on-demand bucket.
    #[serde(default)]
    pub overflowed: u64,
}

/// Quota-counted calls of one API, tier or Region.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct CallStats {
    /// Calls that reached a bucket (injected faults included).
    pub requests: u64,
    /// Calls refused with 429 (any API's shape).
    pub throttled: u64,
    /// Of `throttled`, those refused for the day.
    pub throttled_daily: u64,
    /// Calls that finished normally and were settled.
    pub completed: u64,
    /// Injected faults.
    pub errors: u64,
    /// Sum of settled charges.
    pub tokens_charged: u64,
}

/// One Region.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionStats {
    #[serde(flatten)]
    pub calls: CallStats,
    /// Keys of the Region's buckets in [`SimStats::buckets`].
    pub buckets: Vec<String>,
    /// The account-wide daily quota, when configured.
    pub account_tokens_per_day: Option<u64>,
    /// The account-wide use of the day so far.
    pub account_tokens_used_today: u64,
}

/// The quota day.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct DayStats {
    pub day_secs: u64,
    /// The day's number (Unix time / `day_secs`, plus the days started by `POST /_sim/daily`).
    pub day: u64,
    /// Seconds until the day ends by the clock.
    pub secs_left: u64,
}

/// Bearer and `x-api-key` credentials.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct ApiKeyStats {
    /// Requests that carried `Authorization: Bearer` or `x-api-key`.
    pub seen: u64,
    /// Of those, the ones checked against `api_keys` and accepted.
    pub accepted: u64,
    pub rejected: u64,
}

/// Live counters of one API, tier or Region.
#[derive(Debug, Default)]
pub struct Tally {
    pub requests: AtomicU64,
    pub throttled: AtomicU64,
    pub throttled_daily: AtomicU64,
    pub completed: AtomicU64,
    pub errors: AtomicU64,
    pub tokens_charged: AtomicU64,
}

impl Tally {
    pub fn snapshot(&self) -> CallStats {
        CallStats {
            requests: self.requests.load(Relaxed),
            throttled: self.throttled.load(Relaxed),
            throttled_daily: self.throttled_daily.load(Relaxed),
            completed: self.completed.load(Relaxed),
            errors: self.errors.load(Relaxed),
            tokens_charged: self.tokens_charged.load(Relaxed),
        }
    }
}

/// The tallies by API, tier and Region, created on first use.
#[derive(Debug, Default)]
pub(crate) struct Tallies {
    apis: DashMap<String, Arc<Tally>>,
    tiers: DashMap<String, Arc<Tally>>,
    regions: DashMap<String, Arc<Tally>>,
}

/// The tally of `key`, created if new (a read lock on the common path).
fn tally(map: &DashMap<String, Arc<Tally>>, key: &str) -> Arc<Tally> {
    if let Some(t) = map.get(key) {
        return Arc::clone(t.value());
    }
    Arc::clone(map.entry(key.to_string()).or_default().value())
}

fn snapshot(map: &DashMap<String, Arc<Tally>>) -> BTreeMap<String, CallStats> {
    map.iter()
        .map(|e| (e.key().clone(), e.value().snapshot()))
        .collect()
}

impl Tallies {
    /// The tallies of a call: its API, its requested tier, its Region.
    pub fn of_call(&self, api: &'static str, tier: &'static str, region: &str) -> Vec<Arc<Tally>> {
        vec![
            tally(&self.apis, api),
            tally(&self.tiers, tier),
            tally(&self.regions, region),
        ]
    }

    pub fn apis(&self) -> BTreeMap<String, CallStats> {
        snapshot(&self.apis)
    }

    pub fn tiers(&self) -> BTreeMap<String, CallStats> {
        snapshot(&self.tiers)
    }

    pub fn regions(&self) -> BTreeMap<String, CallStats> {
        snapshot(&self.regions)
    }
}

/// Each Region's calls, bucket keys and account-wide day: `accounts` is (Region, used today,
/// tokens per day).
pub(crate) fn regions(
    buckets: &BTreeMap<String, BucketStats>,
    calls: BTreeMap<String, CallStats>,
    accounts: Vec<(String, u64, u64)>,
) -> BTreeMap<String, RegionStats> {
    let mut out: BTreeMap<String, RegionStats> = calls
        .into_iter()
        .map(|(region, calls)| {
            let stats = RegionStats {
                calls,
                ..RegionStats::default()
            };
            (region, stats)
        })
        .collect();
    for (key, b) in buckets {
        out.entry(b.region.clone())
            .or_default()
            .buckets
            .push(key.clone());
    }
    for (region, used, limit) in accounts {
        let r = out.entry(region).or_default();
        r.account_tokens_per_day = Some(limit);
        r.account_tokens_used_today = used;
    }
    out
}

/// SigV4 signatures seen and checked.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct SigV4Stats {
    pub verified: u64,
    pub rejected: u64,
    /// Access key ids named in `Authorization` headers (verified or not).
    pub access_key_ids: BTreeSet<String>,
    /// Requests that carried an `Authorization` header.
    pub authorization_headers_seen: u64,
    /// Signed events of bidirectional streams whose chained signature verified, and did not.
    #[serde(default)]
    pub events_verified: u64,
    #[serde(default)]
    pub events_rejected: u64,
}

/// Live SigV4 counters.
#[derive(Debug, Default)]
pub(crate) struct SigV4Counters {
    pub verified: AtomicU64,
    pub rejected: AtomicU64,
    pub seen: AtomicU64,
    pub key_ids: DashSet<String>,
    pub events_verified: AtomicU64,
    pub events_rejected: AtomicU64,
}

impl SigV4Counters {
    /// Records the `Authorization` header of a request, if any.
    pub fn observe(&self, authorization: Option<&str>) {
        let Some(value) = authorization else { return };
        self.seen.fetch_add(1, Relaxed);
        let key_id = value
            .split_once("Credential=")
            .and_then(|(_, rest)| rest.split('/').next())
            .filter(|k| !k.is_empty() && k.len() <= 128);
        // Bounded: a stand-in for tests and benchmarks, not an audit log.
        if let Some(k) = key_id
            && self.key_ids.len() < 1024
            && !self.key_ids.contains(k)
        {
            self.key_ids.insert(k.to_string());
        }
    }

    /// Counts one verification.
    pub fn record(&self, verified: bool) {
        let counter = if verified {
            &self.verified
        } else {
            &self.rejected
        };
        counter.fetch_add(1, Relaxed);
    }

    /// Counts one event's verification.
    pub fn record_event(&self, verified: bool) {
        let counter = if verified {
            &self.events_verified
        } else {
            &self.events_rejected
        };
        counter.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> SigV4Stats {
        SigV4Stats {
            verified: self.verified.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
            access_key_ids: self.key_ids.iter().map(|k| k.key().clone()).collect(),
            authorization_headers_seen: self.seen.load(Relaxed),
            events_verified: self.events_verified.load(Relaxed),
            events_rejected: self.events_rejected.load(Relaxed),
        }
    }
}
