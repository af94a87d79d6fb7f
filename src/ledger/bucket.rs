//! Continuous-refill token bucket arithmetic, exact in integers.
//!
//! Levels are kept in "token-nanominutes": one token is [`SCALE`] units, and a bucket of
//! capacity `C` tokens per minute refills exactly `C` units per elapsed nanosecond. No floating
//! point, no rounding drift: refill over any split of the same interval gives the same level.
//!
//! The level never rises above capacity. It can fall below zero only through settlement: Bedrock
//! charges `output x burndown` at the end of a request, which may exceed what was reserved at its
//! start, and the debt is repaid by refill before anything new fits (as upstream does).

use std::time::Duration;

use super::units::NANOS_PER_MINUTE;

/// Units per token: nanoseconds per minute.
pub const SCALE: i128 = NANOS_PER_MINUTE as i128;

const NANOS_PER_MILLI: i128 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u64,
    level: i128,
    updated_ns: u64,
}

impl TokenBucket {
    /// A full bucket holding `capacity` tokens, refilling `capacity` per minute.
    pub fn new(capacity: u64, now_ns: u64) -> Self {
        TokenBucket {
            capacity,
            level: i128::from(capacity) * SCALE,
            updated_ns: now_ns,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whole tokens available now (after [`Self::refill`]); negative while in debt.
    pub fn level(&self) -> i64 {
        (self.level.div_euclid(SCALE)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
    }

    /// Whole tokens available, never negative.
    pub fn available(&self) -> u64 {
        self.level().max(0) as u64
    }

    /// Adds what has refilled since the last update. Time never runs backwards here: an
    /// earlier `now_ns` than the last update adds nothing.
    pub fn refill(&mut self, now_ns: u64) {
        if now_ns > self.updated_ns {
            let elapsed = i128::from(now_ns - self.updated_ns);
            let full = i128::from(self.capacity) * SCALE;
            self.level = (self.level + elapsed * i128::from(self.capacity)).min(full);
            self.updated_ns = now_ns;
        }
    }

    /// Changes the capacity (and so the refill rate), keeping the level within it.
    pub fn set_capacity(&mut self, capacity: u64, now_ns: u64) {
        self.refill(now_ns);
        self.capacity = capacity;
        self.level = self.level.min(i128::from(capacity) * SCALE);
    }

    /// How long until `tokens` fit, given refill alone; zero if they fit now. `None` if they can
    /// never fit (more than the capacity, or a zero-capacity bucket). Rounded up to the whole
    /// millisecond: the resolution of the Redis scripts, so that both backends report the same
    /// wait (and compare waits the same way), and never a moment before refill makes room.
    pub fn wait_for(&self, tokens: u64) -> Option<Duration> {
        let need = i128::from(tokens) * SCALE;
        if need <= self.level {
            return Some(Duration::ZERO);
        }
        if tokens > self.capacity || self.capacity == 0 {
            return None;
        }
        let deficit = need - self.level;
        // Refill is `capacity` units per nanosecond: a millisecond refills 10^6 times that.
        let per_ms = i128::from(self.capacity) * NANOS_PER_MILLI;
        let millis = (deficit + per_ms - 1) / per_ms;
        Some(Duration::from_millis(
            u64::try_from(millis).unwrap_or(u64::MAX),
        ))
    }

    /// Whether `tokens` fit now (call [`Self::refill`] first).
    pub fn fits(&self, tokens: u64) -> bool {
        i128::from(tokens) * SCALE <= self.level
    }

    /// Takes `tokens` unconditionally (callers check [`Self::fits`] first).
    pub fn take(&mut self, tokens: u64) {
        self.level -= i128::from(tokens) * SCALE;
    }

    /// [`Self::take`] for a reservation that upstream will only see `transit_ns` from now: when
    /// the bucket was full, refill is held back until then.
    ///
    /// Upstream's own bucket, full too, stays capped (refilling nothing) until the request reaches
    /// it; a ledger that started refilling at once would run ahead of upstream by that transit
    /// time after every idle spell, and admit what upstream then throttles.
    pub fn take_in_transit(&mut self, tokens: u64, now_ns: u64, transit_ns: u64) {
        let full = self.level >= i128::from(self.capacity) * SCALE;
        self.take(tokens);
        if full {
            self.updated_ns = self.updated_ns.max(now_ns.saturating_add(transit_ns));
        }
    }

    /// Credits back (`delta > 0`) or debits more (`delta < 0`) at settlement; never above capacity.
    pub fn adjust(&mut self, delta: i64) {
        let full = i128::from(self.capacity) * SCALE;
        self.level = (self.level + i128::from(delta) * SCALE).min(full);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MINUTE: u64 = 60_000_000_000;

    #[test]
    fn refill_is_exact() {
        let mut b = TokenBucket::new(60_000, 0);
        b.take(60_000);
        assert_eq!(b.level(), 0);
        b.refill(MINUTE / 60); // one second: 1,000 tokens
        assert_eq!(b.level(), 1_000);
        b.refill(MINUTE);
        assert_eq!(b.level(), 60_000);
        b.refill(2 * MINUTE);
        assert_eq!(b.level(), 60_000, "never above capacity");
    }

    #[test]
    fn wait_projects_refill() {
        let mut b = TokenBucket::new(60_000, 0);
        b.take(59_000);
        assert_eq!(b.wait_for(1_000), Some(Duration::ZERO));
        assert_eq!(b.wait_for(2_000), Some(Duration::from_secs(1)));
        assert_eq!(b.wait_for(60_001), None);
        b.adjust(-10_000); // a burndown charge larger than the reservation
        assert_eq!(b.level(), -9_000);
        assert_eq!(b.available(), 0);
        assert_eq!(b.wait_for(1_000), Some(Duration::from_secs(10)));
    }

    #[test]
    fn waits_round_up_to_the_millisecond() {
        let mut b = TokenBucket::new(60_000, 0);
        b.take(60_000);
        // One token refills in 1 ms exactly; 1.5 ms of refill is reported as 2 ms.
        assert_eq!(b.wait_for(1), Some(Duration::from_millis(1)));
        b.refill(500_000);
        assert_eq!(b.wait_for(2), Some(Duration::from_millis(2)));
        // 999,990 ns of refill missing: 1 ms.
        b.refill(1_000_001);
        assert_eq!(b.wait_for(2), Some(Duration::from_millis(1)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Reserve(u64),
        /// A reservation through [`TokenBucket::take_in_transit`], reaching upstream `.1` ns later.
        ReserveInTransit(u64, u64),
        Settle {
            index: usize,
            charge_pct: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..5_000_000_000).prop_map(Op::Advance),
            (1u64..20_000).prop_map(Op::Reserve),
            (1u64..20_000, 0u64..200_000_000).prop_map(|(n, t)| Op::ReserveInTransit(n, t)),
            (any::<usize>(), 0u64..=100)
                .prop_map(|(index, charge_pct)| Op::Settle { index, charge_pct }),
        ]
    }

    /// The bucket as its documentation describes it, computed here without calling it: a level
    /// in token-nanominutes (one token is `MINUTE` units, so `C` tokens per minute refill `C`
    /// units per nanosecond), refill from `refills_from` on, never above capacity; a reservation
    /// taken in transit from a full bucket moves `refills_from` to when it reaches upstream.
    struct Model {
        full: i128,
        level: i128,
        refills_from: u64,
        /// Tokens that came in by refill, and credit dropped at the cap, in units.
        refilled: i128,
        dropped: i128,
    }

    impl Model {
        fn new(capacity: u64) -> Model {
            let full = i128::from(capacity) * i128::from(MINUTE);
            Model {
                full,
                level: full,
                refills_from: 0,
                refilled: 0,
                dropped: 0,
            }
        }

        fn advance_to(&mut self, now: u64, capacity: u64) {
            if now > self.refills_from {
                let elapsed = i128::from(now - self.refills_from);
                let refill = (elapsed * i128::from(capacity)).min(self.full - self.level);
                self.level += refill.max(0);
                self.refilled += refill.max(0);
                self.refills_from = now;
            }
        }

        fn take(&mut self, tokens: u64) {
            self.level -= i128::from(tokens) * i128::from(MINUTE);
        }

        fn credit(&mut self, tokens: u64) {
            let credit = i128::from(tokens) * i128::from(MINUTE);
            let kept = credit.min(self.full - self.level);
            self.level += kept;
            self.dropped += credit - kept;
        }
    }

    proptest! {
        /// With charges never above the reservation (burndown 1): the level is the model's
        /// (refill of elapsed x capacity / 1 min from when refill runs, capped at capacity;
        /// credit capped at capacity), computed independently of the code under test; it stays
        /// within [0, capacity]; refill over any split of time equals refill in one step; and
        /// tokens are conserved: capacity + refilled = level + outstanding + charged + dropped.
        #[test]
        fn bucket_invariants(capacity in 1u64..1_000_000, ops in prop::collection::vec(op(), 1..200)) {
            let mut b = TokenBucket::new(capacity, 0);
            let mut model = Model::new(capacity);
            let mut now = 0u64;
            let mut outstanding: Vec<u64> = Vec::new();
            let mut charged: i128 = 0;
            for op in ops {
                match op {
                    Op::Advance(ns) => {
                        now += ns;
                        let mut split = b.clone();
                        split.refill(now - ns / 2);
                        split.refill(now);
                        b.refill(now);
                        prop_assert_eq!(&split, &b, "refill must not depend on how time is split");
                        model.advance_to(now, capacity);
                    }
                    Op::Reserve(n) | Op::ReserveInTransit(n, _) => {
                        b.refill(now);
                        model.advance_to(now, capacity);
                        let fits = model.level >= i128::from(n) * i128::from(MINUTE);
                        prop_assert_eq!(b.fits(n), fits, "fits {} tokens", n);
                        if fits {
                            if let Op::ReserveInTransit(_, transit) = op {
                                if model.level == model.full {
                                    model.refills_from = model.refills_from.max(now + transit);
                                }
                                b.take_in_transit(n, now, transit);
                            } else {
                                b.take(n);
                            }
                            model.take(n);
                            outstanding.push(n);
                        } else {
                            prop_assert!(b.wait_for(n).is_none_or(|w| w > Duration::ZERO));
                        }
                    }
                    Op::Settle { index, charge_pct } => {
                        if !outstanding.is_empty() {
                            let reserved = outstanding.swap_remove(index % outstanding.len());
                            let charge = reserved * charge_pct / 100;
                            b.adjust(reserved as i64 - charge as i64);
                            model.credit(reserved - charge);
                            charged += i128::from(charge);
                        }
                    }
                }
                prop_assert_eq!(
                    b.level * i128::from(MINUTE),
                    model.level * SCALE,
                    "the level is the model's"
                );
                prop_assert!(b.level >= 0, "never negative");
                prop_assert!(b.level() as u64 <= capacity, "never above capacity");
                let out: i128 = outstanding.iter().map(|&n| i128::from(n)).sum();
                prop_assert_eq!(
                    model.full + model.refilled,
                    model.level + (out + charged) * i128::from(MINUTE) + model.dropped,
                    "tokens are conserved"
                );
            }
        }
    }
}
