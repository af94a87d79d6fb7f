//! maxTokens advice: how long outputs really are, per pool and model, against the `maxTokens`
//! callers reserve.
//!
//! Bedrock deducts `input + maxTokens` at the start of a request, so a `maxTokens` far above what
//! the model really writes holds quota that no one uses until settlement. This module keeps, for
//! every (pool, model) slot, the distribution of output tokens reported by upstream and of the
//! `maxTokens` reserved for the same requests (for a caller that sent none, what
//! [`super::output_cap`] reserved: the model's maximum, the injected default or the route's ceiling), and turns them into advice: p50 and p99 output, p99 reserved `maxTokens`, a suggested
//! `maxTokens` (p99 output plus [`SUGGESTION_MARGIN`], rounded up to [`SUGGESTION_STEP`]) and the
//! share of reserved `maxTokens` that output did not use. `GET /v1/pools` shows it per pool
//! (`max_tokens_advice`) and the `tokengate_*_p99{pool,model}` gauges export it at each scrape.
//!
//! # Slots
//! A pool has one slot per model id in its config, plus `other` for requests that reached the pool
//! another way (an ARN, an application inference profile), so the `model` label stays bounded by
//! the config. Routes (callers) will add a dimension: the slot key becomes (route, model) and each
//! advice entry gains a `route` field; [`PoolAdvice::slot`] is the one place that maps a request
//! to its slot.
//!
//! # Cost and memory
//! Each slot holds two fixed log-linear histograms of [`BUCKETS`] atomic counters (exact below 8,
//! then 8 sub-buckets per power of two: at most 12.5% wide, up to 2^21 tokens) plus four sums.
//! Recording is a handful of relaxed atomic adds: no lock, no allocation. Quantiles are computed
//! only when read (`/v1/pools`, `/metrics`), reported as the upper edge of their bucket, capped at
//! the largest value seen, so they err high by at most one bucket (12.5%).
//!
//! # Window
//! The counts are cumulative since the process started: the advice describes all traffic seen,
//! not the last hour. For windowed distributions use the `tokengate_output_tokens_per_request`
//! and `tokengate_requested_max_tokens` histograms with `histogram_quantile` over a range.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use serde::Serialize;

/// Exact buckets below this value, log-linear above.
const LINEAR: u64 = 8;
/// Sub-buckets per power of two (8 = 3 bits).
const SUB_BITS: u32 = 3;
/// The largest exponent with its own buckets; larger values share the last bucket.
const MAX_EXP: u32 = 20;
/// Number of buckets: 8 exact ones, then 8 per power of two from 2^3 to 2^20.
pub const BUCKETS: usize = (LINEAR as usize) + ((MAX_EXP - SUB_BITS + 1) as usize) * 8;
/// Requests needed in a slot before a `maxTokens` is suggested.
pub const MIN_SAMPLES: u64 = 20;
/// The suggestion: p99 output times this margin ...
pub const SUGGESTION_MARGIN: f64 = 1.2;
/// ... rounded up to a multiple of this.
pub const SUGGESTION_STEP: u64 = 64;
/// The `model` label of the slot for requests whose model id is not one of the pool's own.
pub const OTHER_MODEL: &str = "other";

/// The bucket of `v`.
fn bucket(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let exp = (63 - v.leading_zeros()).min(MAX_EXP);
    if exp == MAX_EXP && v >= (1 << (MAX_EXP + 1)) {
        return BUCKETS - 1;
    }
    let sub = (v >> (exp - SUB_BITS)) - LINEAR;
    LINEAR as usize + (exp - SUB_BITS) as usize * 8 + sub as usize
}

/// The largest value in bucket `i` (the last bucket is open-ended: `u64::MAX`).
fn upper_edge(i: usize) -> u64 {
    if i < LINEAR as usize {
        return i as u64;
    }
    if i == BUCKETS - 1 {
        return u64::MAX;
    }
    let k = i - LINEAR as usize;
    let exp = (k / 8) as u32 + SUB_BITS;
    let sub = (k % 8) as u64;
    ((LINEAR + sub + 1) << (exp - SUB_BITS)) - 1
}

/// A fixed-bucket histogram of token counts, updated lock-free; also the quota report's
/// distributions ([`crate::observe::report`]).
#[derive(Debug)]
pub struct Lengths {
    counts: Box<[AtomicU64]>,
    max: AtomicU64,
    sum: AtomicU64,
}

impl Default for Lengths {
    fn default() -> Self {
        Lengths::new()
    }
}

impl Lengths {
    pub fn new() -> Lengths {
        Lengths {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            max: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    pub fn record(&self, v: u64) {
        if let Some(c) = self.counts.get(bucket(v)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.max.fetch_max(v, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
    }

    /// Adds every value `other` recorded.
    pub fn absorb(&self, other: &Lengths) {
        for (to, from) in self.counts.iter().zip(other.counts.iter()) {
            to.fetch_add(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.max
            .fetch_max(other.max.load(Ordering::Relaxed), Ordering::Relaxed);
        self.sum
            .fetch_add(other.sum.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// The largest value recorded (0 when empty).
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// The `q` quantile (0 < q <= 1): the upper edge of the bucket holding it, capped at the
    /// largest value seen. `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        let max = self.max.load(Ordering::Relaxed);
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(upper_edge(i).min(max));
            }
        }
        Some(max)
    }
}

/// One (pool, model) slot.
#[derive(Debug)]
struct Slot {
    model: Arc<str>,
    requests: AtomicU64,
    /// Requests admitted that named no `maxTokens`.
    without_max_tokens: AtomicU64,
    /// Calls that stopped at their output cap.
    truncated: AtomicU64,
    output: Lengths,
    requested: Lengths,
}

/// The advice state of one pool.
#[derive(Debug)]
pub struct PoolAdvice {
    /// The pool's configured models in config order, then [`OTHER_MODEL`].
    slots: Vec<Slot>,
}

/// Which slot of a pool a request counts in (see [`PoolAdvice::slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotIndex(usize);

/// One entry of a pool's `max_tokens_advice` in `GET /v1/pools`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MaxTokensAdvice {
    /// A model id from the pool's config, or `other`.
    pub model: String,
    /// Requests settled with reported usage.
    pub requests: u64,
    /// Requests admitted that named no `maxTokens` (what was reserved for them instead is the
    /// pool's `when_max_tokens_missing`, or the route's ceiling).
    pub requests_without_max_tokens: u64,
    /// Calls that stopped at their output cap (`max_tokens`, `length`, ...): a `maxTokens` (or
    /// injected default) too low for what callers ask of the model.
    pub truncated: u64,
    pub p50_output: u64,
    pub p99_output: u64,
    /// p99 of the `maxTokens` reserved (for callers that sent none, what was reserved instead).
    pub p99_requested_max_tokens: u64,
    /// p99 output x 1.2, rounded up to 64; `null` below [`MIN_SAMPLES`] requests.
    pub suggested_max_tokens: Option<u64>,
    /// 1 - sum(output) / sum(maxTokens): the share of reserved maxTokens that output did not use.
    pub reserved_but_unused_share: f64,
}

impl PoolAdvice {
    pub fn new(models: &[String]) -> PoolAdvice {
        let slots = models
            .iter()
            .map(String::as_str)
            .chain(std::iter::once(OTHER_MODEL))
            .map(|m| Slot {
                model: Arc::from(m),
                requests: AtomicU64::new(0),
                without_max_tokens: AtomicU64::new(0),
                truncated: AtomicU64::new(0),
                output: Lengths::new(),
                requested: Lengths::new(),
            })
            .collect();
        PoolAdvice { slots }
    }

    /// The slot of a request for `model_id` (a model id from the pool's config, or anything else).
    pub fn slot(&self, model_id: &str) -> SlotIndex {
        let last = self.slots.len().saturating_sub(1);
        SlotIndex(
            self.slots[..last]
                .iter()
                .position(|s| &*s.model == model_id)
                .unwrap_or(last),
        )
    }

    /// The model label of a slot.
    pub fn model(&self, slot: SlotIndex) -> &str {
        self.slots.get(slot.0).map_or(OTHER_MODEL, |s| &s.model)
    }

    /// Records one request settled with usage: the `maxTokens` it reserved and the output tokens
    /// upstream reported.
    pub fn record(&self, slot: SlotIndex, requested_max_tokens: u64, output_tokens: u64) {
        let Some(s) = self.slots.get(slot.0).or(self.slots.last()) else {
            return;
        };
        s.requests.fetch_add(1, Ordering::Relaxed);
        s.output.record(output_tokens);
        s.requested.record(requested_max_tokens);
    }

    /// Counts an admitted request that named no `maxTokens`.
    pub fn named_none(&self, slot: SlotIndex) {
        if let Some(s) = self.slots.get(slot.0).or(self.slots.last()) {
            s.without_max_tokens.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a call that stopped at its output cap.
    pub fn truncated(&self, slot: SlotIndex) {
        if let Some(s) = self.slots.get(slot.0).or(self.slots.last()) {
            s.truncated.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The advice for every slot that has seen a request.
    pub fn view(&self) -> Vec<MaxTokensAdvice> {
        self.slots.iter().filter_map(Slot::advice).collect()
    }
}

impl Slot {
    fn advice(&self) -> Option<MaxTokensAdvice> {
        let requests = self.requests.load(Ordering::Relaxed);
        let p99_output = self.output.quantile(0.99)?;
        let output_sum = self.output.sum.load(Ordering::Relaxed);
        let requested_sum = self.requested.sum.load(Ordering::Relaxed);
        let unused = if requested_sum == 0 {
            0.0
        } else {
            (1.0 - output_sum as f64 / requested_sum as f64).clamp(0.0, 1.0)
        };
        Some(MaxTokensAdvice {
            model: self.model.to_string(),
            requests,
            requests_without_max_tokens: self.without_max_tokens.load(Ordering::Relaxed),
            truncated: self.truncated.load(Ordering::Relaxed),
            p50_output: self.output.quantile(0.5).unwrap_or(0),
            p99_output,
            p99_requested_max_tokens: self.requested.quantile(0.99).unwrap_or(0),
            suggested_max_tokens: (requests >= MIN_SAMPLES).then(|| suggest(p99_output)),
            reserved_but_unused_share: unused,
        })
    }
}

/// p99 output x [`SUGGESTION_MARGIN`], rounded up to [`SUGGESTION_STEP`]; never below the p99.
fn suggest(p99_output: u64) -> u64 {
    with_margin(p99_output, SUGGESTION_MARGIN)
}

/// `tokens` x `margin`, rounded up to a multiple of [`SUGGESTION_STEP`]; never below `tokens`
/// (saturating: a product past `u64::MAX` is `u64::MAX`). Also the adaptive cap's rounding
/// ([`super::adaptive`]).
pub fn with_margin(tokens: u64, margin: f64) -> u64 {
    // `as` saturates a float too large for u64.
    let scaled = (tokens as f64 * margin).ceil() as u64;
    scaled
        .max(1)
        .div_ceil(SUGGESTION_STEP)
        .saturating_mul(SUGGESTION_STEP)
        .max(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotone_and_at_most_an_eighth_wide() {
        let mut last = 0;
        for v in 0..(1u64 << 21) {
            let b = bucket(v);
            assert!(b >= last && b < BUCKETS, "{v} -> {b}");
            assert!(upper_edge(b) >= v, "{v} above the edge of its bucket {b}");
            if v >= LINEAR && b < BUCKETS - 1 {
                assert!(
                    (upper_edge(b) - v) as f64 <= v as f64 / 8.0,
                    "{v}: edge {}",
                    upper_edge(b)
                );
            }
            last = b;
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket((1 << 21) - (1 << 17) - 1), BUCKETS - 2);
        assert_eq!(bucket(1 << 21), BUCKETS - 1);
    }

    #[test]
    fn quantiles_err_high_by_at_most_a_bucket_and_never_above_the_max() {
        let h = Lengths::new();
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.quantile(0.5).expect("samples");
        let p99 = h.quantile(0.99).expect("samples");
        assert!((500..=563).contains(&p50), "{p50}");
        assert!((990..=1000).contains(&p99), "{p99}");
        assert_eq!(h.quantile(1.0), Some(1000));
        assert_eq!(Lengths::new().quantile(0.99), None);
    }

    #[test]
    fn advice_per_model_with_an_other_slot() {
        let advice = PoolAdvice::new(&["a".to_string(), "b".to_string()]);
        let (a, other) = (advice.slot("a"), advice.slot("arn:whatever"));
        assert_eq!(advice.model(a), "a");
        assert_eq!(advice.model(other), OTHER_MODEL);
        for i in 0..100 {
            advice.record(a, 1000, 100 + i);
        }
        advice.record(other, 4096, 4000);
        let view = advice.view();
        assert_eq!(view.len(), 2, "b saw nothing: {view:?}");
        let a = &view[0];
        assert_eq!((a.model.as_str(), a.requests), ("a", 100));
        assert_eq!(a.p99_requested_max_tokens, 1000, "capped at the max seen");
        assert!(a.p99_output >= 198 && a.p99_output <= 199, "{a:?}");
        assert_eq!(a.suggested_max_tokens, Some(256));
        // 1 - (sum 100..=199) / 100_000
        assert!((a.reserved_but_unused_share - 0.8505).abs() < 1e-9, "{a:?}");
        assert_eq!(view[1].model, OTHER_MODEL);
        assert_eq!(view[1].suggested_max_tokens, None, "one request is too few");
    }

    #[test]
    fn the_suggestion_covers_the_p99() {
        for p99 in [0, 1, 63, 64, 65, 1000, 4097, 100_000] {
            let s = suggest(p99);
            assert!(
                s >= p99 && s.is_multiple_of(SUGGESTION_STEP),
                "{p99} -> {s}"
            );
        }
    }
}
