//! The in-process ledger: one mutex-guarded state per pool, for a single replica.
//!
//! Each decision takes the pool's lock once, refills, checks every limit, and commits all of them
//! or none, so a rejected request holds nothing. Pools are created on first use from the limits
//! passed in, and follow those limits as they change.
//!
//! It never waits and cannot fail, except to settle a reservation of a pool it never saw (only a
//! bug can do that: the reservation came from another ledger). Time comes from an injectable
//! [`Clock`], in nanoseconds.

use std::sync::{
    Arc, Mutex, MutexGuard,
    atomic::{AtomicU64, Ordering},
};

use async_trait::async_trait;
use dashmap::{DashMap, mapref::one::Ref};

use super::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Clock, Issuer, Ledger, LedgerError, LedgerStats,
    Limit, Limits, Origin, PoolSnapshot, Rejection, Reservation, ReserveRequest, ShareHold,
    ShareRequest, Verdict, WindowSnapshot,
    bucket::TokenBucket,
    budget::Budgets,
    shares::{Need, RouteStates},
    units::{DAY_MS, UPSTREAM_TRANSIT_NS},
    window::WindowBucket,
};

#[derive(Debug)]
struct PoolLedger {
    tokens: TokenBucket,
    requests: Option<TokenBucket>,
    day: Option<WindowBucket>,
    max_concurrency: u32,
    in_flight: u32,
    reserved_tokens: u64,
    routes: RouteStates,
}

impl PoolLedger {
    fn new(limits: &Limits, now: u64) -> Self {
        PoolLedger {
            tokens: TokenBucket::new(limits.tokens_per_minute, now),
            requests: limits
                .requests_per_minute
                .map(|rpm| TokenBucket::new(rpm, now)),
            day: limits
                .tokens_per_day
                .map(|d| WindowBucket::new(d, DAY_MS, millis(now))),
            max_concurrency: limits.max_concurrency,
            in_flight: 0,
            reserved_tokens: 0,
            routes: RouteStates::default(),
        }
    }

    /// Brings the state up to `now` under (possibly changed) `limits`.
    fn sync(&mut self, limits: &Limits, now: u64) {
        if self.tokens.capacity() != limits.tokens_per_minute {
            self.tokens.set_capacity(limits.tokens_per_minute, now);
        }
        self.tokens.refill(now);
        match (&mut self.requests, limits.requests_per_minute) {
            (Some(bucket), Some(rpm)) => {
                if bucket.capacity() != rpm {
                    bucket.set_capacity(rpm, now);
                }
                bucket.refill(now);
            }
            (slot, rpm) => *slot = rpm.map(|rpm| TokenBucket::new(rpm, now)),
        }
        match (&mut self.day, limits.tokens_per_day) {
            (Some(day), Some(tpd)) => {
                if day.capacity() != tpd {
                    day.set_capacity(tpd, millis(now));
                }
                day.refill(millis(now));
            }
            (slot, tpd) => *slot = tpd.map(|d| WindowBucket::new(d, DAY_MS, millis(now))),
        }
        self.max_concurrency = limits.max_concurrency;
    }

    /// Checks every limit for `tokens` (and the caller's share, if any) and takes them all, or
    /// nothing.
    fn reserve(
        &mut self,
        tokens: u64,
        hold_back: u64,
        share: Option<&ShareRequest>,
        now: u64,
    ) -> Result<Option<ShareHold>, Rejection> {
        let plan = match share {
            None => None,
            Some(request) => {
                let tpm = self.tokens.capacity();
                // Whether a retry must dip into the retry reserve is judged on what the bucket
                // holds beyond the hold-back, which it must keep either way.
                let level = self
                    .tokens
                    .level()
                    .saturating_sub(i64::try_from(hold_back).unwrap_or(i64::MAX));
                match self.routes.need(request, tokens, level, tpm, now) {
                    Ok(need) => Some((request, need)),
                    Err(over) => {
                        return Err(Rejection {
                            limit: Limit::Share,
                            refill_wait: over.wait,
                            token_deficit: over.deficit,
                            in_flight_tokens: self.reserved_tokens,
                            in_flight_requests: self.in_flight,
                            held_for_others: false,
                        });
                    }
                }
            }
        };
        if let Some(day) = self.day.as_ref().filter(|d| !d.fits(tokens)) {
            return Err(Rejection {
                limit: Limit::DailyQuota,
                refill_wait: day.wait_for(tokens, millis(now)),
                token_deficit: u64::try_from(i128::from(tokens) - i128::from(day.level()))
                    .unwrap_or(0),
                in_flight_tokens: self.reserved_tokens,
                in_flight_requests: self.in_flight,
                held_for_others: false,
            });
        }
        let protected = plan.map_or(0, |(_, n)| n.protected);
        let need = plan
            .map_or(tokens, |(_, need)| need.tokens)
            .saturating_add(hold_back);
        self.check(need).map_err(|mut rejection| {
            rejection.held_for_others = rejection.limit == Limit::Tokens
                && protected > 0
                && self.tokens.fits(need - protected);
            rejection
        })?;
        self.take(tokens, now);
        Ok(plan.map(|(request, Need { hold, .. })| self.routes.take(request, tokens, hold)))
    }

    /// Whether the token bucket holds `tokens` (a request's own plus what it must leave), a
    /// request fits the request bucket and a permit is free.
    fn check(&self, tokens: u64) -> Result<(), Rejection> {
        let reject = |limit, refill_wait, token_deficit| Rejection {
            limit,
            refill_wait,
            token_deficit,
            in_flight_tokens: self.reserved_tokens,
            in_flight_requests: self.in_flight,
            held_for_others: false,
        };
        let token_fit = self.tokens.fits(tokens);
        let request_fit = self.requests.as_ref().is_none_or(|b| b.fits(1));
        if !token_fit || !request_fit {
            let token_wait = self.tokens.wait_for(tokens);
            let request_wait = self.requests.as_ref().and_then(|b| b.wait_for(1));
            let deficit =
                u64::try_from(i128::from(tokens) - i128::from(self.tokens.level())).unwrap_or(0);
            // Report the limit with the longer wait; refill never satisfying counts as longest.
            let tokens_bind = !token_fit
                && (request_fit || token_wait.is_none_or(|t| request_wait.is_some_and(|r| t >= r)));
            // Refill is a known wait; a free permit is not (it comes with a settlement), so a
            // bucket that is short binds even when the semaphore is full too.
            return Err(if tokens_bind {
                reject(Limit::Tokens, token_wait, deficit)
            } else {
                reject(Limit::Requests, request_wait, deficit)
            });
        }
        if self.in_flight >= self.max_concurrency {
            return Err(reject(
                Limit::Concurrency,
                Some(std::time::Duration::ZERO),
                0,
            ));
        }
        Ok(())
    }

    fn take(&mut self, tokens: u64, now: u64) {
        self.tokens
            .take_in_transit(tokens, now, UPSTREAM_TRANSIT_NS);
        if let Some(b) = &mut self.requests {
            b.take(1);
        }
        if let Some(d) = &mut self.day {
            d.take(tokens);
        }
        self.in_flight += 1;
        self.reserved_tokens += tokens;
    }
}

/// The single-process ledger.
#[derive(Debug)]
pub struct MemoryLedger {
    pools: DashMap<Arc<str>, MemoryPool, foldhash::fast::RandomState>,
    clock: Clock,
    next_id: AtomicU64,
    stats: Arc<LedgerStats>,
    budgets: Budgets,
}

/// One pool: its state, and the issuer its reservations share.
#[derive(Debug)]
struct MemoryPool {
    issuer: Arc<Issuer>,
    state: Mutex<PoolLedger>,
}

impl MemoryLedger {
    pub fn new(clock: Clock) -> Self {
        Self::with_stats(clock, Arc::default())
    }

    /// A memory ledger counting into `stats` (a fallback's local share counts with the shared
    /// ledger).
    pub(crate) fn with_stats(clock: Clock, stats: Arc<LedgerStats>) -> Self {
        MemoryLedger {
            pools: DashMap::default(),
            clock,
            next_id: AtomicU64::new(1),
            stats,
            budgets: Budgets::default(),
        }
    }

    /// The pool, created on first use from `limits`. The map's read guard is held while the
    /// caller works on the pool (a few integer updates): creating another pool waits for it.
    fn pool(&self, name: &str, limits: &Limits) -> Ref<'_, Arc<str>, MemoryPool> {
        if let Some(pool) = self.pools.get(name) {
            return pool;
        }
        let key: Arc<str> = Arc::from(name);
        self.pools
            .entry(key.clone())
            .or_insert_with(|| MemoryPool {
                issuer: Arc::new(Issuer {
                    pool: key,
                    origin: Origin::Local,
                    stats: self.stats.clone(),
                }),
                state: Mutex::new(PoolLedger::new(limits, self.clock.now_ns())),
            })
            .downgrade()
    }
}

/// The clock's nanoseconds as the whole milliseconds long-window buckets tick on (the Redis
/// scripts' resolution).
fn millis(now_ns: u64) -> u64 {
    now_ns / 1_000_000
}

/// A poisoned lock means a panic mid-update elsewhere; the state itself is still consistent
/// (every update is a handful of integer writes), so keep serving.
fn lock(state: &Mutex<PoolLedger>) -> MutexGuard<'_, PoolLedger> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[async_trait]
impl Ledger for MemoryLedger {
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        let pool = self.pool(request.pool, &request.limits);
        let now = self.clock.now_ns();
        let mut state = lock(&pool.state);
        state.sync(&request.limits, now);
        Ok(
            match state.reserve(request.tokens, request.hold_back, request.share, now) {
                Ok(hold) => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    Verdict::Granted(
                        Reservation::new(pool.issuer.clone(), request.tokens, id).with_share(hold),
                    )
                }
                Err(rejection) => Verdict::Refused(rejection),
            },
        )
    }

    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError> {
        let Some(pool) = self.pools.get(reservation.pool()) else {
            let message = format!("settle for unknown pool {}", reservation.pool());
            let _ = reservation.disarm();
            return Err(LedgerError {
                backend: "memory",
                message,
            });
        };
        let (reserved, _id, hold) = reservation.disarm();
        let now = self.clock.now_ns();
        let mut state = lock(&pool.state);
        state.tokens.refill(now);
        let delta = i128::from(reserved) - i128::from(charged_tokens);
        let delta = delta.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        state.tokens.adjust(delta);
        if let Some(day) = &mut state.day {
            day.refill(millis(now));
            day.adjust(delta);
        }
        state.in_flight = state.in_flight.saturating_sub(1);
        state.reserved_tokens = state.reserved_tokens.saturating_sub(reserved);
        if let Some(hold) = &hold {
            state.routes.settle(hold, reserved, charged_tokens, now);
        }
        Ok(())
    }

    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError> {
        let pool = self.pool(pool, limits);
        let now = self.clock.now_ns();
        let mut state = lock(&pool.state);
        state.sync(limits, now);
        Ok(PoolSnapshot {
            tokens_available: state.tokens.level(),
            tokens_capacity: state.tokens.capacity(),
            reserved_tokens: state.reserved_tokens,
            in_flight_requests: state.in_flight,
            requests_available: state.requests.as_ref().map(TokenBucket::available),
            day_tokens_available: state.day.as_ref().map(WindowBucket::level),
            day_tokens_capacity: state.day.as_ref().map(WindowBucket::capacity),
            day_full_in_ms: state
                .day
                .as_ref()
                .map(|d| u64::try_from(d.full_in(millis(now)).as_millis()).unwrap_or(u64::MAX)),
        })
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError> {
        let now = millis(self.clock.now_ns());
        Ok(match self.budgets.take(request, now) {
            Ok(()) => BudgetVerdict::Taken(Origin::Local),
            Err(refusal) => BudgetVerdict::Refused(refusal),
        })
    }

    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        _origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError> {
        self.budgets
            .settle(request, charged, millis(self.clock.now_ns()));
        Ok(())
    }

    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError> {
        Ok(self
            .budgets
            .snapshot(scope, windows, millis(self.clock.now_ns())))
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    fn stats(&self) -> &LedgerStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_ledger_counts_its_own_unsettled_drops() {
        let (a, b) = (
            MemoryLedger::new(Clock::manual()),
            MemoryLedger::new(Clock::manual()),
        );
        let request = crate::ledger::tests::small_request();
        let Ok(Verdict::Granted(settled)) = a.reserve(&request).await else {
            panic!("admitted");
        };
        a.settle(settled, 10).await.expect("settles");
        let Ok(Verdict::Granted(dropped)) = a.reserve(&request).await else {
            panic!("admitted");
        };
        drop(dropped); // unsettled, on purpose
        assert_eq!(a.stats().unsettled_drops(), 1);
        assert_eq!(b.stats().unsettled_drops(), 0, "another ledger's drop");
    }
}
