//! Bedrock's quota arithmetic, done on its own (never with tokengate's ledger).
//!
//! - **Per minute**: one continuously refilling token bucket per (Region, base model, inference
//!   route, tier capacity): capacity `tokens_per_minute`, refill `tokens_per_minute / 60` per
//!   second. A call reserves `input + maxTokens` if that fits in what is left (else 429); at the
//!   end the reservation is settled to `input + cacheWrite + output x burndown`, which may take
//!   the bucket below zero.
//! - **Per day** (on-demand buckets): the day's use, reserved and settled the same way, must stay
//!   within `tokens_per_day`; nothing refills within a day, and a new day starts from zero. A
//!   [`DayBudget`] does the same across every model of a Region (the account-wide daily quota),
//!   taken in the same step. Reading of an uncertain fact (U): the daily count is reserved at
//!   request start and settled like the minute one, burndown included. A call settled after its
//!   day ended leaves the new day untouched.
//! - A call that does not fit the day is refused before the minute is looked at, so it is told
//!   about the day (nothing frees up for hours).
//!
//! A [`Reservation`] dropped unsettled (client gone, stream cut) settles at
//! `input + generated-so-far x burndown`. Time is passed in (`Instant` for the minute, a day
//! number for the day), so unit tests drive it without sleeping.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering::Relaxed},
};
use std::time::Instant;

use dashmap::DashMap;

use super::stats::{BucketStats, Tally};

/// What a bucket is, for `/_sim/stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BucketInfo {
    pub region: String,
    /// The base model.
    pub model: String,
    /// `on_demand`, `geo:{prefix}`, `global` or `dedicated`.
    pub route: String,
    /// Reserved-tier capacity rather than on-demand.
    pub reserved: bool,
    pub tokens_per_minute: u64,
    /// `None` for reserved capacity, which has no daily quota.
    pub tokens_per_day: Option<u64>,
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// Not enough left of the minute.
    Minute,
    /// Not enough left of the day (the bucket's or the Region's).
    Day,
}

/// The account-wide daily quota of one Region.
#[derive(Debug)]
pub struct DayBudget {
    pub tokens_per_day: u64,
    used: Mutex<DayUse>,
}

#[derive(Debug, Default, Clone, Copy)]
struct DayUse {
    day: u64,
    used: u64,
}

impl DayUse {
    /// The use on `day`, starting a new day if needed.
    fn on(&mut self, day: u64) -> &mut u64 {
        if self.day != day {
            *self = DayUse { day, used: 0 };
        }
        &mut self.used
    }

    /// Settles a reservation of `day`: `used += charged - reserved` if `day` is still today.
    fn settle(&mut self, day: u64, reserved: u64, charged: u64) {
        if self.day == day {
            self.used = (self.used + charged).saturating_sub(reserved);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DayBudget {
    pub fn new(tokens_per_day: u64) -> DayBudget {
        DayBudget {
            tokens_per_day,
            used: Mutex::new(DayUse::default()),
        }
    }

    /// Tokens used on `day`.
    pub fn used(&self, day: u64) -> u64 {
        *lock(&self.used).on(day)
    }

    /// Sets the use of `day` (`POST /_sim/daily`).
    pub fn set_used(&self, day: u64, used: u64) {
        *lock(&self.used).on(day) = used;
    }
}

/// One quota bucket.
#[derive(Debug)]
pub struct Bucket {
    info: BucketInfo,
    level: Mutex<Level>,
    requests: AtomicU64,
    throttled: AtomicU64,
    throttled_daily: AtomicU64,
    overflowed: AtomicU64,
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
    day: DayUse,
}

impl Bucket {
    pub fn new(info: BucketInfo, now: Instant) -> Bucket {
        Bucket {
            level: Mutex::new(Level {
                tokens: info.tokens_per_minute as f64,
                at: now,
                day: DayUse::default(),
            }),
            info,
            requests: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            throttled_daily: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            tokens_charged: AtomicU64::new(0),
            reserved_in_flight: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }

    /// Runs `f` on the level refilled up to `now`.
    fn with_level<R>(&self, now: Instant, f: impl FnOnce(&mut Level) -> R) -> R {
        let mut level = lock(&self.level);
        let elapsed = now.saturating_duration_since(level.at).as_secs_f64();
        let cap = self.info.tokens_per_minute as f64;
        level.tokens = (level.tokens + elapsed * cap / 60.0).min(cap);
        level.at = level.at.max(now);
        f(&mut level)
    }

    /// The Region whose capacity this is.
    pub fn region(&self) -> &str {
        &self.info.region
    }

    /// Tokens available at `now` (negative after a burndown overshoot).
    pub fn available(&self, now: Instant) -> f64 {
        self.with_level(now, |l| l.tokens)
    }

    /// Tokens used on `day`.
    pub fn used_on(&self, day: u64) -> u64 {
        *lock(&self.level).day.on(day)
    }

    /// Sets the use of `day` (`POST /_sim/daily`).
    pub fn set_used_on(&self, day: u64, used: u64) {
        *lock(&self.level).day.on(day) = used;
    }

    /// Counts an arriving call.
    pub fn count_request(&self) {
        self.requests.fetch_add(1, Relaxed);
    }

    /// Counts an injected fault.
    pub fn count_error(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    /// Counts a reserved-tier call that did not fit and went on to the on-demand bucket.
    pub fn count_overflow(&self) {
        self.overflowed.fetch_add(1, Relaxed);
    }

    /// Counts a refusal.
    pub fn count_throttle(&self, shortfall: Shortfall) {
        self.throttled.fetch_add(1, Relaxed);
        if shortfall == Shortfall::Day {
            self.throttled_daily.fetch_add(1, Relaxed);
        }
    }

    /// Reserves `amount` on `day` in this bucket and in `account` (all or nothing), without
    /// counting a refusal: the caller decides whether it is a throttle or an overflow.
    pub fn try_reserve(
        self: &Arc<Self>,
        amount: u64,
        now: Instant,
        day: u64,
        account: Option<&Arc<DayBudget>>,
    ) -> Result<Reservation, Shortfall> {
        self.with_level(now, |level| {
            let day_used = level.day.on(day);
            if self
                .info
                .tokens_per_day
                .is_some_and(|limit| day_used.saturating_add(amount) > limit)
            {
                return Err(Shortfall::Day);
            }
            let mut account_use = account.map(|a| (lock(&a.used), a.tokens_per_day));
            if let Some((used, limit)) = account_use.as_mut()
                && used.on(day).saturating_add(amount) > *limit
            {
                return Err(Shortfall::Day);
            }
            if level.tokens < amount as f64 {
                return Err(Shortfall::Minute);
            }
            level.tokens -= amount as f64;
            if self.info.tokens_per_day.is_some() {
                *level.day.on(day) += amount;
            }
            if let Some((mut used, _)) = account_use {
                *used.on(day) += amount;
            }
            Ok(())
        })?;
        self.reserved_in_flight.fetch_add(amount, Relaxed);
        self.in_flight.fetch_add(1, Relaxed);
        Ok(Reservation {
            bucket: Arc::clone(self),
            account: account.cloned(),
            day,
            reserved: amount,
            input: 0,
            burndown: 1,
            generated: 0,
            settled: false,
            tallies: Vec::new(),
        })
    }

    fn settle(&self, r: &Reservation, charged: u64, now: Instant) {
        self.with_level(now, |level| {
            let cap = self.info.tokens_per_minute as f64;
            level.tokens = (level.tokens + r.reserved as f64 - charged as f64).min(cap);
            if self.info.tokens_per_day.is_some() {
                level.day.settle(r.day, r.reserved, charged);
            }
        });
        if let Some(account) = &r.account {
            lock(&account.used).settle(r.day, r.reserved, charged);
        }
        self.tokens_charged.fetch_add(charged, Relaxed);
        self.reserved_in_flight.fetch_sub(r.reserved, Relaxed);
        self.in_flight.fetch_sub(1, Relaxed);
        for t in &r.tallies {
            t.tokens_charged.fetch_add(charged, Relaxed);
        }
    }

    pub fn stats(&self, now: Instant, day: u64) -> BucketStats {
        let info = &self.info;
        BucketStats {
            requests: self.requests.load(Relaxed),
            throttled: self.throttled.load(Relaxed),
            completed: self.completed.load(Relaxed),
            errors: self.errors.load(Relaxed),
            tokens_charged: self.tokens_charged.load(Relaxed),
            tokens_reserved_in_flight: self.reserved_in_flight.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed),
            tokens_available: self.available(now).floor() as i64,
            tokens_per_minute: info.tokens_per_minute,
            region: info.region.clone(),
            model: info.model.clone(),
            route: info.route.clone(),
            tier: if info.reserved {
                "reserved"
            } else {
                "on_demand"
            }
            .to_string(),
            tokens_per_day: info.tokens_per_day,
            tokens_used_today: self.used_on(day),
            throttled_daily: self.throttled_daily.load(Relaxed),
            overflowed: self.overflowed.load(Relaxed),
        }
    }
}

/// A reservation held by one call. Settle it with [`Reservation::complete`]; dropping it
/// settles at `input + generated x burndown` (a cut or abandoned call).
#[must_use]
#[derive(Debug)]
pub struct Reservation {
    bucket: Arc<Bucket>,
    account: Option<Arc<DayBudget>>,
    day: u64,
    reserved: u64,
    input: u64,
    burndown: u64,
    generated: u64,
    settled: bool,
    /// Where the charge is also counted (the call's API, tier and Region).
    tallies: Vec<Arc<Tally>>,
}

impl Reservation {
    /// Sets what an unfinished call is charged per generated token, and its input.
    pub fn with_charge(mut self, input: u64, burndown: u64) -> Self {
        self.input = input;
        self.burndown = burndown;
        self
    }

    /// Also counts the charge, completion or failure into `tallies`.
    pub fn with_tallies(mut self, tallies: Vec<Arc<Tally>>) -> Self {
        self.tallies = tallies;
        self
    }

    /// Sets the input once it is known (a bidirectional stream learns it as it goes).
    pub fn set_input(&mut self, input: u64) {
        self.input = input;
    }

    /// Records how many output tokens have been generated so far.
    pub fn set_generated(&mut self, tokens: u64) {
        self.generated = tokens;
    }

    /// Settles a completed call: `input + cache_write + output x burndown`.
    pub fn complete(mut self, cache_write: u64, output: u64, now: Instant) {
        let charge = self.input + cache_write + output * self.burndown;
        self.bucket.completed.fetch_add(1, Relaxed);
        for t in &self.tallies {
            t.completed.fetch_add(1, Relaxed);
        }
        self.bucket.settle(&self, charge, now);
        self.settled = true;
    }

    /// Settles a call that ended in an injected fault at what it generated.
    pub fn fail(mut self, now: Instant) {
        self.bucket.count_error();
        for t in &self.tallies {
            t.errors.fetch_add(1, Relaxed);
        }
        self.settle_partial(now);
    }

    fn settle_partial(&mut self, now: Instant) {
        if !self.settled {
            self.settled = true;
            let charge = self.input + self.generated * self.burndown;
            self.bucket.settle(self, charge, now);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.settle_partial(Instant::now());
    }
}

/// Every bucket, created on first use, and every Region's account-wide daily budget.
#[derive(Debug, Default)]
pub struct Buckets {
    map: DashMap<String, Arc<Bucket>>,
    accounts: DashMap<String, Arc<DayBudget>>,
}

impl Buckets {
    /// The bucket `key`, created with `info()` if new.
    pub fn get(&self, key: &str, info: impl FnOnce() -> BucketInfo) -> Arc<Bucket> {
        if let Some(b) = self.map.get(key) {
            return Arc::clone(b.value());
        }
        let entry = self
            .map
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Bucket::new(info(), Instant::now())));
        Arc::clone(entry.value())
    }

    /// The account-wide daily budget of `region`, created with `tokens_per_day` if new.
    pub fn account(&self, region: &str, tokens_per_day: u64) -> Arc<DayBudget> {
        if let Some(a) = self.accounts.get(region) {
            return Arc::clone(a.value());
        }
        let entry = self
            .accounts
            .entry(region.to_string())
            .or_insert_with(|| Arc::new(DayBudget::new(tokens_per_day)));
        Arc::clone(entry.value())
    }

    pub fn snapshot(
        &self,
        now: Instant,
        day: u64,
    ) -> std::collections::BTreeMap<String, BucketStats> {
        self.map
            .iter()
            .map(|e| (e.key().clone(), e.value().stats(now, day)))
            .collect()
    }

    /// Each Region's account-wide use on `day`, for the Regions that have a budget.
    pub fn account_use(&self, day: u64) -> Vec<(String, u64, u64)> {
        self.accounts
            .iter()
            .map(|e| {
                (
                    e.key().clone(),
                    e.value().used(day),
                    e.value().tokens_per_day,
                )
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "quota_tests.rs"]
mod tests;
