//! Long-window token buckets: a daily quota (and any window of whole ticks), exact in integers
//! on both backends.
//!
//! The arithmetic is [`super::bucket`]'s, with one token worth `window_ticks` units and refill
//! of `capacity` units per elapsed tick ([`WINDOW_TICK_MS`], a second): over a full window the
//! bucket refills exactly its capacity, continuously (one tick at a time). Ticks, not
//! nanoseconds, so that the Redis scripts (Lua doubles, exact below 2^53) hold a day's bucket of
//! up to [`super::units::MAX_TOKENS_PER_WINDOW`] tokens exactly; `lua/common.lua` has the same
//! functions (`win_*`). Both backends read the tick as `floor(now_ms / WINDOW_TICK_MS)`.
//!
//! Bedrock documents no reset rule for its daily quotas: a continuous refill over 24 hours is
//! the model here (a burst spends the day, and it comes back a 1,440th a minute). A fixed-window
//! variant (reset at a time of day) would replace [`WindowBucket::refill`] alone: the rest of the
//! ledger only asks whether tokens fit, takes them, credits them back and asks when they fit.

use std::time::Duration;

use super::units::WINDOW_TICK_MS;

/// A bucket of `capacity` tokens refilling `capacity` per window of `window_ticks` ticks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowBucket {
    capacity: u64,
    window_ticks: u64,
    /// In units: one token is `window_ticks` units. Negative while repaying a burndown debt.
    level: i128,
    updated_tick: u64,
}

/// The tick of `now_ms`.
pub fn tick(now_ms: u64) -> u64 {
    now_ms / WINDOW_TICK_MS
}

impl WindowBucket {
    /// A full bucket.
    pub fn new(capacity: u64, window_ticks: u64, now_ms: u64) -> Self {
        WindowBucket {
            capacity,
            window_ticks,
            level: i128::from(capacity) * i128::from(window_ticks),
            updated_tick: tick(now_ms),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn full(&self) -> i128 {
        i128::from(self.capacity) * i128::from(self.window_ticks)
    }

    fn units(&self, tokens: u64) -> i128 {
        i128::from(tokens) * i128::from(self.window_ticks)
    }

    /// Adds what refilled by `now_ms`'s tick; never above capacity, never backwards.
    pub fn refill(&mut self, now_ms: u64) {
        let now = tick(now_ms);
        if now > self.updated_tick {
            let elapsed = i128::from(now - self.updated_tick);
            self.level = (self.level + elapsed * i128::from(self.capacity)).min(self.full());
            self.updated_tick = now;
        }
    }

    /// Changes the capacity (a config reload), keeping the level within it.
    pub fn set_capacity(&mut self, capacity: u64, now_ms: u64) {
        self.refill(now_ms);
        self.capacity = capacity;
        self.level = self.level.min(self.full());
    }

    /// Whole tokens now (after [`Self::refill`]); negative while in debt.
    pub fn level(&self) -> i64 {
        let whole = self.level.div_euclid(i128::from(self.window_ticks.max(1)));
        whole.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
    }

    pub fn fits(&self, tokens: u64) -> bool {
        self.units(tokens) <= self.level
    }

    /// Takes `tokens` unconditionally (callers check [`Self::fits`] first).
    pub fn take(&mut self, tokens: u64) {
        self.level -= self.units(tokens);
    }

    /// Credits back (`delta > 0`) or debits (`delta < 0`); never above capacity.
    pub fn adjust(&mut self, delta: i64) {
        self.level =
            (self.level + i128::from(delta) * i128::from(self.window_ticks)).min(self.full());
    }

    /// How long from `now_ms` until `tokens` fit by refill alone (the tick they fit at); zero if
    /// they fit now, `None` if they never will (more than the capacity).
    pub fn wait_for(&self, tokens: u64, now_ms: u64) -> Option<Duration> {
        let need = self.units(tokens);
        if need <= self.level {
            return Some(Duration::ZERO);
        }
        if tokens > self.capacity || self.capacity == 0 {
            return None;
        }
        Some(self.ticks_to(need, now_ms))
    }

    /// How long from `now_ms` until the bucket is full again.
    pub fn full_in(&self, now_ms: u64) -> Duration {
        if self.capacity == 0 || self.level >= self.full() {
            return Duration::ZERO;
        }
        self.ticks_to(self.full(), now_ms)
    }

    /// Time from `now_ms` to the first tick at which the level reaches `units`.
    fn ticks_to(&self, units: i128, now_ms: u64) -> Duration {
        let cap = i128::from(self.capacity);
        let ticks = (units - self.level + cap - 1) / cap;
        let at_ms = (i128::from(self.updated_tick) + ticks) * i128::from(WINDOW_TICK_MS);
        let wait = (at_ms - i128::from(now_ms)).max(0);
        Duration::from_millis(u64::try_from(wait).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::units::DAY_TICKS;
    use proptest::prelude::*;

    const DAY_MS: u64 = 86_400_000;

    #[test]
    fn a_day_refills_its_capacity_a_tick_at_a_time() {
        let mut b = WindowBucket::new(86_400, DAY_TICKS, 0);
        b.take(86_400);
        assert_eq!(b.level(), 0);
        b.refill(999);
        assert_eq!(b.level(), 0, "within the first tick, nothing");
        b.refill(1_000);
        assert_eq!(b.level(), 1, "a token a second");
        b.refill(DAY_MS / 2);
        assert_eq!(b.level(), 43_200);
        b.refill(3 * DAY_MS);
        assert_eq!(b.level(), 86_400, "never above capacity");
    }

    #[test]
    fn waits_land_on_the_tick_that_makes_room() {
        let mut b = WindowBucket::new(86_400, DAY_TICKS, 0);
        b.take(86_400);
        b.refill(1_500);
        assert_eq!(b.level(), 1);
        assert_eq!(b.wait_for(1, 1_500), Some(Duration::ZERO));
        // Three tokens: at tick 3, 1.5 s from now.
        assert_eq!(b.wait_for(3, 1_500), Some(Duration::from_millis(1_500)));
        assert_eq!(b.wait_for(86_401, 1_500), None);
        assert_eq!(b.full_in(1_500), Duration::from_millis(DAY_MS - 1_500));
        b.adjust(-100);
        assert_eq!(b.level(), -99);
        assert_eq!(b.wait_for(1, 1_500), Some(Duration::from_millis(99_500)));
    }

    proptest! {
        /// Refill over any split of an interval equals refill over the whole of it, the level
        /// stays within capacity, and a wait is exactly the first moment the tokens fit.
        #[test]
        fn refill_is_exact_and_waits_are_tight(
            capacity in 1u64..1_000_000_000,
            taken_pct in 0u64..=100,
            steps in proptest::collection::vec(0u64..20_000_000, 1..8),
            want_pct in 1u64..=100,
        ) {
            let mut whole = WindowBucket::new(capacity, DAY_TICKS, 0);
            whole.take(capacity / 100 * taken_pct);
            let mut split = whole.clone();
            let mut now = 0;
            for s in &steps {
                now += s;
                split.refill(now);
            }
            whole.refill(now);
            prop_assert_eq!(&whole, &split);
            prop_assert!(whole.level() <= capacity as i64);
            let want = (capacity / 100 * want_pct).max(1);
            let wait = whole.wait_for(want, now).expect("within capacity");
            let at = now + wait.as_millis() as u64;
            let mut later = whole.clone();
            later.refill(at);
            prop_assert!(later.fits(want), "fits at the wait");
            if wait > Duration::ZERO {
                let mut before = whole.clone();
                before.refill(at - 1);
                prop_assert!(!before.fits(want), "and not a millisecond before");
            }
        }
    }
}
