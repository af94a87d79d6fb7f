//! What the simulator has seen, served as JSON on `GET /_sim/stats`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use dashmap::DashSet;
use serde::{Deserialize, Serialize};

/// A snapshot of every bucket and of SigV4 checking.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SimStats {
    /// Keyed `{base model}@{region}`, `{base model}@geo:{prefix}` or `{base model}@global`.
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
}

/// Live SigV4 counters.
#[derive(Debug, Default)]
pub(crate) struct SigV4Counters {
    pub verified: AtomicU64,
    pub rejected: AtomicU64,
    pub seen: AtomicU64,
    pub key_ids: DashSet<String>,
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

    pub fn snapshot(&self) -> SigV4Stats {
        SigV4Stats {
            verified: self.verified.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
            access_key_ids: self.key_ids.iter().map(|k| k.key().clone()).collect(),
            authorization_headers_seen: self.seen.load(Relaxed),
        }
    }
}
