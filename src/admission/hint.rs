//! Retry hints: when a rejected request should come back, jittered.
//!
//! The projection comes from the ledger: the time until refill makes room for this reservation,
//! shortened when requests in flight are expected to hand back enough of their reservations when
//! they settle (most callers ask for far more `maxTokens` than they use), and for concurrency the
//! expected time until the next in-flight request completes.
//!
//! Jitter spreads the hints of simultaneous rejections over a window so that callers do not come
//! back in lockstep. Hints stay within `max_retry_hint` (default 5 s): boto3 and the JS SDK honour
//! a hint only up to their own backoff + 5 s, the Rust SDK up to 20 s.

use std::time::Duration;

use rand::Rng;

use crate::ledger::{Limit, Rejection};

/// The wait hinted when there is nothing to project from: the ledger or upstream unavailable,
/// shutting down, upstream throttling.
pub const UNAVAILABLE_WAIT: Duration = Duration::from_secs(1);
/// No hint shorter than this: a retry sooner would find the same state.
pub const MIN_HINT: Duration = Duration::from_millis(50);
/// The narrowest jitter window.
const MIN_SPREAD: Duration = Duration::from_millis(100);

/// What the pool has learned that shapes the projection.
#[derive(Debug, Clone, Copy)]
pub struct PoolHistory {
    /// Typical admission-to-settlement time.
    pub typical_duration: Duration,
    /// Typical charged / reserved.
    pub charge_ratio: f64,
}

/// The projected wait before this request would fit, without jitter.
pub fn projected_wait(rejection: &Rejection, history: PoolHistory, max_hint: Duration) -> Duration {
    let refill = rejection.refill_wait.unwrap_or(max_hint);
    match rejection.limit {
        // A route's ceiling refills like a bucket; its in-flight refunds are not tracked apart.
        Limit::Requests | Limit::Share => refill,
        // The day refills a 1,440th of the quota a minute: only refill makes room (in-flight
        // refunds are small against a day).
        Limit::DailyQuota | Limit::Budget => refill,
        Limit::Concurrency | Limit::RouteConcurrency => {
            // With n requests in flight finishing at random, the next one ends after about
            // typical / n.
            history.typical_duration / rejection.in_flight_requests.max(1)
        }
        Limit::Tokens => {
            let refund =
                (rejection.in_flight_tokens as f64) * (1.0 - history.charge_ratio).max(0.0);
            if refund >= rejection.token_deficit as f64 && rejection.in_flight_requests > 0 {
                refill.min(history.typical_duration / 2)
            } else {
                refill
            }
        }
    }
}

/// A jittered hint around `base`, within `[MIN_HINT, max_hint]`.
///
/// The window starts at the projection and is half as wide (at least 100 ms), so nobody is told
/// to come back before the ledger expects room. Near the cap the window is pinned to the top fifth
/// of the allowed range instead, so that long projections still spread out.
pub fn jittered(base: Duration, max_hint: Duration, rng: &mut impl Rng) -> Duration {
    let max_hint = max_hint.max(MIN_HINT + MIN_SPREAD);
    let base = base.clamp(MIN_HINT, max_hint);
    let spread = (base / 2).max(MIN_SPREAD);
    let (low, high) = if base + spread <= max_hint {
        (base, base + spread)
    } else {
        let top = spread.min(max_hint / 5).max(MIN_SPREAD);
        (base.min(max_hint - top), max_hint)
    };
    let width = (high - low).as_micros() as u64;
    (low + Duration::from_micros(rng.random_range(0..=width))).clamp(MIN_HINT, max_hint)
}

/// `x-amz-retry-after` (milliseconds) and `Retry-After` (whole seconds, at least 1) values, the
/// seconds rounded up from the same whole milliseconds (so the two never disagree by a second:
/// 1000.4 ms is 1000 ms and 1 s).
pub fn header_values(hint: Duration) -> (String, String) {
    let ms = hint.as_millis().max(1);
    let secs = ms.div_ceil(1000);
    (ms.to_string(), secs.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{SeedableRng, rngs::SmallRng};

    fn rejection(
        limit: Limit,
        refill_ms: u64,
        deficit: u64,
        in_flight_tokens: u64,
        n: u32,
    ) -> Rejection {
        Rejection {
            held_for_others: false,
            limit,
            refill_wait: Some(Duration::from_millis(refill_ms)),
            token_deficit: deficit,
            in_flight_tokens,
            in_flight_requests: n,
        }
    }

    const HISTORY: PoolHistory = PoolHistory {
        typical_duration: Duration::from_secs(4),
        charge_ratio: 0.25,
    };
    const MAX: Duration = Duration::from_secs(5);

    #[test]
    fn tokens_wait_for_refill_or_expected_refunds() {
        // Refunds of in-flight reservations cover the deficit: half a typical duration.
        let r = rejection(Limit::Tokens, 30_000, 1_000, 40_000, 10);
        assert_eq!(projected_wait(&r, HISTORY, MAX), Duration::from_secs(2));
        // They do not: refill decides.
        let r = rejection(Limit::Tokens, 1_500, 50_000, 40_000, 10);
        assert_eq!(
            projected_wait(&r, HISTORY, MAX),
            Duration::from_millis(1_500)
        );
    }

    #[test]
    fn concurrency_waits_for_the_next_completion() {
        let r = rejection(Limit::Concurrency, 0, 0, 0, 8);
        assert_eq!(projected_wait(&r, HISTORY, MAX), Duration::from_millis(500));
    }

    #[test]
    fn jitter_stays_in_bounds_and_spreads() {
        let mut rng = SmallRng::seed_from_u64(7);
        for base_ms in [0u64, 10, 300, 1_000, 4_900, 60_000] {
            let hints: Vec<Duration> = (0..200)
                .map(|_| jittered(Duration::from_millis(base_ms), MAX, &mut rng))
                .collect();
            assert!(
                hints.iter().all(|h| *h >= MIN_HINT && *h <= MAX),
                "base {base_ms}"
            );
            let distinct: std::collections::BTreeSet<_> = hints.iter().collect();
            assert!(
                distinct.len() > 50,
                "hints for base {base_ms} must spread, got {}",
                distinct.len()
            );
            if (50..=3_000).contains(&base_ms) {
                assert!(
                    hints.iter().all(|h| *h >= Duration::from_millis(base_ms)),
                    "never earlier than projected"
                );
            }
        }
    }

    #[test]
    fn header_values_round_up() {
        assert_eq!(
            header_values(Duration::from_millis(1_234)),
            ("1234".into(), "2".into())
        );
        assert_eq!(
            header_values(Duration::from_millis(80)),
            ("80".into(), "1".into())
        );
        // A fraction of a millisecond past a whole second does not add a second.
        assert_eq!(
            header_values(Duration::from_micros(1_000_400)),
            ("1000".into(), "1".into())
        );
    }
}
