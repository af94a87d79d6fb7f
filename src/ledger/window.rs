//! Long-window token buckets: a daily quota, a route's hourly, daily and 30-day budgets, exact
//! in integers on both backends.
//!
//! The arithmetic is [`super::bucket`]'s, in ticks instead of nanoseconds: one token is worth
//! `ticks` units (the ticks in the window), and the bucket refills `capacity` units per elapsed
//! tick, so over a full window it refills exactly its capacity, continuously (a tick at a time).
//! A tick is a second ([`WINDOW_TICK_MS`]) for windows up to a day and `window / 86,400` beyond
//! ([`tick_ms`]), so that a full bucket of up to [`super::units::MAX_TOKENS_PER_WINDOW`] tokens stays below
//! 2^53 units, exact in the Redis scripts' doubles; `lua/common.lua` has the same functions
//! (`win_*`). Both backends read the tick as `floor(now_ms / tick_ms)`.
//!
//! Bedrock documents no reset rule for its daily quotas: a continuous refill over 24 hours is
//! the model here (a burst spends the day, and it comes back a 1,440th a minute). A fixed-window
//! variant (reset at a time of day) would replace [`WindowBucket::refill`] alone: the rest of the
//! ledger only asks whether tokens fit, takes them, credits them back and asks when they fit.

use std::time::Duration;

use super::units::{MAX_WINDOW_TICKS, WINDOW_TICK_MS};

/// A window's tick: a second, or `window_ms / 86,400` for windows longer than a day (rounded
/// up to a whole millisecond).
pub fn tick_ms(window_ms: u64) -> u64 {
    WINDOW_TICK_MS.max(window_ms.div_ceil(MAX_WINDOW_TICKS))
}

/// A bucket of `capacity` tokens refilling `capacity` per window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowBucket {
    capacity: u64,
    /// Ticks in the window: a token's units.
    window_ticks: u64,
    tick_ms: u64,
    window_ms: u64,
    /// In units: one token is `window_ticks` units. Negative while repaying a burndown debt.
    level: i128,
    updated_tick: u64,
}

impl WindowBucket {
    /// A full bucket for a window of `window_ms` (a whole number of ticks).
    pub fn new(capacity: u64, window_ms: u64, now_ms: u64) -> Self {
        let tick_ms = tick_ms(window_ms);
        let window_ticks = (window_ms / tick_ms).max(1);
        WindowBucket {
            capacity,
            window_ticks,
            tick_ms,
            window_ms,
            level: i128::from(capacity) * i128::from(window_ticks),
            updated_tick: now_ms / tick_ms,
        }
    }

    fn tick(&self, now_ms: u64) -> u64 {
        now_ms / self.tick_ms
    }

    /// The window's length, as built.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
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
        let now = self.tick(now_ms);
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
        let at_ms = (i128::from(self.updated_tick) + ticks) * i128::from(self.tick_ms);
        let wait = (at_ms - i128::from(now_ms)).max(0);
        Duration::from_millis(u64::try_from(wait).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::units::{DAY_MS, MAX_TOKENS_PER_WINDOW};
    use proptest::prelude::*;

    #[test]
    fn a_day_refills_its_capacity_a_tick_at_a_time() {
        let mut b = WindowBucket::new(86_400, DAY_MS, 0);
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
        let mut b = WindowBucket::new(86_400, DAY_MS, 0);
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

    #[test]
    fn windows_past_a_day_tick_slower_and_stay_exact() {
        assert_eq!(tick_ms(3_600_000), 1_000);
        assert_eq!(tick_ms(DAY_MS), 1_000);
        assert_eq!(tick_ms(30 * DAY_MS), 30_000);
        let mut b = WindowBucket::new(MAX_TOKENS_PER_WINDOW, 30 * DAY_MS, 0);
        b.take(MAX_TOKENS_PER_WINDOW);
        b.refill(29_999);
        assert_eq!(b.level(), 0);
        // A tick of 30 s refills a 86,400th of the window's capacity.
        b.refill(30_000);
        assert_eq!(b.level(), (MAX_TOKENS_PER_WINDOW / MAX_WINDOW_TICKS) as i64);
        assert!(i128::from(MAX_TOKENS_PER_WINDOW) * i128::from(b.window_ticks) < 1 << 53);
    }

    proptest! {
        /// Refill over any split of an interval equals refill over the whole of it, the level
        /// stays within capacity, and a wait is exactly the first moment the tokens fit.
        #[test]
        fn refill_is_exact_and_waits_are_tight(
            capacity in 1u64..1_000_000_000,
            window_ms in prop::sample::select(vec![3_600_000, DAY_MS, 30 * DAY_MS]),
            taken_pct in 0u64..=100,
            steps in proptest::collection::vec(0u64..20_000_000, 1..8),
            want_pct in 1u64..=100,
        ) {
            let mut whole = WindowBucket::new(capacity, window_ms, 0);
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
