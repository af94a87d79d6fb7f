//! Bedrock's quota arithmetic, done on its own (never with tokengate's ledger).
//!
//! One continuously refilling token bucket per (base model, inference route): capacity
//! `tokens_per_minute`, refill `tokens_per_minute / 60` per second. A call reserves
//! `input + maxTokens` if that fits in what is left (else 429); at the end the reservation is
//! settled to `input + cacheWrite + output x burndown`, which may take the bucket below zero.
//! A [`Reservation`] dropped unsettled (client gone, stream cut) settles at
//! `input + generated-so-far x burndown`.
//!
//! The bucket's time is passed in (`Instant`), so unit tests drive it without sleeping.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering::Relaxed},
};
use std::time::Instant;

use dashmap::DashMap;

use super::stats::BucketStats;

/// One quota bucket.
#[derive(Debug)]
pub struct Bucket {
    tokens_per_minute: u64,
    level: Mutex<Level>,
    requests: AtomicU64,
    throttled: AtomicU64,
    completed: AtomicU64,
    errors: AtomicU64,
    tokens_charged: AtomicU64,
    reserved_in_flight: AtomicU64,
    in_flight: AtomicU64,
}

#[derive(Debug)]
struct Level {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub fn new(tokens_per_minute: u64, now: Instant) -> Bucket {
        Bucket {
            tokens_per_minute,
            level: Mutex::new(Level {
                tokens: tokens_per_minute as f64,
                at: now,
            }),
            requests: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            tokens_charged: AtomicU64::new(0),
            reserved_in_flight: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }

    /// Runs `f` on the level refilled up to `now`.
    fn with_level<R>(&self, now: Instant, f: impl FnOnce(&mut f64) -> R) -> R {
        let mut level = self.level.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = now.saturating_duration_since(level.at).as_secs_f64();
        let cap = self.tokens_per_minute as f64;
        level.tokens = (level.tokens + elapsed * cap / 60.0).min(cap);
        level.at = level.at.max(now);
        f(&mut level.tokens)
    }

    /// Tokens available at `now` (negative after a burndown overshoot).
    pub fn available(&self, now: Instant) -> f64 {
        self.with_level(now, |l| *l)
    }

    /// Counts an arriving call.
    pub fn count_request(&self) {
        self.requests.fetch_add(1, Relaxed);
    }

    /// Counts an injected fault.
    pub fn count_error(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    /// Reserves `amount` if it fits; counts a throttle if not.
    pub fn try_reserve(self: &Arc<Self>, amount: u64, now: Instant) -> Option<Reservation> {
        let fits = self.with_level(now, |level| {
            let ok = *level >= amount as f64;
            if ok {
                *level -= amount as f64;
            }
            ok
        });
        if !fits {
            self.throttled.fetch_add(1, Relaxed);
            return None;
        }
        self.reserved_in_flight.fetch_add(amount, Relaxed);
        self.in_flight.fetch_add(1, Relaxed);
        Some(Reservation {
            bucket: Arc::clone(self),
            reserved: amount,
            input: 0,
            burndown: 1,
            generated: 0,
            settled: false,
        })
    }

    fn settle(&self, reserved: u64, charged: u64, now: Instant) {
        self.with_level(now, |level| {
            let cap = self.tokens_per_minute as f64;
            *level = (*level + reserved as f64 - charged as f64).min(cap);
        });
        self.tokens_charged.fetch_add(charged, Relaxed);
        self.reserved_in_flight.fetch_sub(reserved, Relaxed);
        self.in_flight.fetch_sub(1, Relaxed);
    }

    pub fn stats(&self, now: Instant) -> BucketStats {
        BucketStats {
            requests: self.requests.load(Relaxed),
            throttled: self.throttled.load(Relaxed),
            completed: self.completed.load(Relaxed),
            errors: self.errors.load(Relaxed),
            tokens_charged: self.tokens_charged.load(Relaxed),
            tokens_reserved_in_flight: self.reserved_in_flight.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed),
            tokens_available: self.available(now).floor() as i64,
            tokens_per_minute: self.tokens_per_minute,
        }
    }
}

/// A reservation held by one call. Settle it with [`Reservation::complete`]; dropping it
/// settles at `input + generated x burndown` (a cut or abandoned call).
#[must_use]
#[derive(Debug)]
pub struct Reservation {
    bucket: Arc<Bucket>,
    reserved: u64,
    input: u64,
    burndown: u64,
    generated: u64,
    settled: bool,
}

impl Reservation {
    /// Sets what an unfinished call is charged per generated token, and its input.
    pub fn with_charge(mut self, input: u64, burndown: u64) -> Self {
        self.input = input;
        self.burndown = burndown;
        self
    }

    /// Records how many output tokens have been generated so far.
    pub fn set_generated(&mut self, tokens: u64) {
        self.generated = tokens;
    }

    /// Settles a completed call: `input + cache_write + output x burndown`.
    pub fn complete(mut self, cache_write: u64, output: u64, now: Instant) {
        let charge = self.input + cache_write + output * self.burndown;
        self.bucket.completed.fetch_add(1, Relaxed);
        self.bucket.settle(self.reserved, charge, now);
        self.settled = true;
    }

    /// Settles a call that ended in an injected fault at what it generated.
    pub fn fail(mut self, now: Instant) {
        self.bucket.count_error();
        self.settle_partial(now);
    }

    fn settle_partial(&mut self, now: Instant) {
        if !self.settled {
            self.settled = true;
            let charge = self.input + self.generated * self.burndown;
            self.bucket.settle(self.reserved, charge, now);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.settle_partial(Instant::now());
    }
}

/// Every bucket, created on first use.
#[derive(Debug, Default)]
pub struct Buckets {
    map: DashMap<String, Arc<Bucket>>,
}

impl Buckets {
    /// The bucket `key`, created with `tokens_per_minute()` if new.
    pub fn get(&self, key: &str, tokens_per_minute: impl FnOnce() -> u64) -> Arc<Bucket> {
        if let Some(b) = self.map.get(key) {
            return Arc::clone(b.value());
        }
        let entry = self
            .map
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Bucket::new(tokens_per_minute(), Instant::now())));
        Arc::clone(entry.value())
    }

    pub fn snapshot(&self, now: Instant) -> std::collections::BTreeMap<String, BucketStats> {
        self.map
            .iter()
            .map(|e| (e.key().clone(), e.value().stats(now)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn reserve_settle_and_refill() {
        let t0 = Instant::now();
        let b = Arc::new(Bucket::new(6000, t0)); // refills 100 tokens/s
        let r = b.try_reserve(5000, t0).unwrap().with_charge(100, 5);
        assert_eq!(b.stats(t0).tokens_available, 1000);
        assert!(b.try_reserve(1001, t0).is_none(), "does not fit");
        assert_eq!(b.stats(t0).throttled, 1);
        assert_eq!(b.stats(t0).in_flight, 1);
        r.complete(0, 200, t0); // charge 100 + 200 x 5 = 1100
        let s = b.stats(t0);
        assert_eq!(
            (s.tokens_available, s.tokens_charged, s.in_flight),
            (4900, 1100, 0)
        );
        assert_eq!(s.tokens_reserved_in_flight, 0);
        assert_eq!(b.stats(t0 + Duration::from_secs(1)).tokens_available, 5000);
        assert_eq!(
            b.stats(t0 + Duration::from_secs(60)).tokens_available,
            6000,
            "capped"
        );
    }

    #[test]
    fn burndown_can_overdraw_and_later_calls_wait_for_refill() {
        let t0 = Instant::now();
        let b = Arc::new(Bucket::new(6000, t0));
        let r = b.try_reserve(1000, t0).unwrap().with_charge(1000, 5);
        r.complete(0, 2000, t0); // 11000 charged against 6000
        assert_eq!(b.stats(t0).tokens_available, -5000);
        assert!(b.try_reserve(1, t0).is_none());
        assert!(b.try_reserve(1, t0 + Duration::from_secs(50)).is_none());
        assert!(b.try_reserve(100, t0 + Duration::from_secs(51)).is_some());
    }

    #[test]
    fn dropped_reservations_settle_at_what_was_generated() {
        let t0 = Instant::now();
        let b = Arc::new(Bucket::new(60_000, t0));
        let mut r = b.try_reserve(10_000, t0).unwrap().with_charge(100, 5);
        r.set_generated(10);
        drop(r);
        let s = b.stats(t0);
        assert_eq!((s.tokens_charged, s.in_flight, s.completed), (150, 0, 0));
        let mut r = b.try_reserve(10_000, t0).unwrap().with_charge(100, 1);
        r.set_generated(7);
        r.fail(t0);
        let s = b.stats(t0);
        assert_eq!(
            (s.tokens_charged, s.errors, s.tokens_reserved_in_flight),
            (257, 1, 0)
        );
    }
}
