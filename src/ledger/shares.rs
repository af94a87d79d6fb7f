//! Route shares: how the application routes that use one pool divide it.
//!
//! Every route has, per pool, three token buckets beside the pool's own (all refilling
//! continuously over a minute, like the pool's):
//!
//! - the **guarantee** (`min_share x` the pool's tokens per minute): what the route is owed. A
//!   request takes what it can from it; the rest of its tokens are **borrowed**.
//! - the **ceiling** (`max_share x` tokens per minute, when set): every token the route takes.
//! - the **recovery budget**: what the route's retries may take from the pool's retry reserve.
//!
//! A request of `T` tokens from route `r` is admitted when the pool's bucket holds
//! `T + protected + retry_reserve`, where
//!
//! - `protected` is zero when the request fits in `r`'s unused guarantee; when it borrows, it is
//!   the unused guarantees of the other **active** routes (that asked for, or settled, a request
//!   within `idle`), plus `priority_margin` if any active route has a higher priority. So a route
//!   within its guarantee is never turned away because another borrowed, idle guarantees are lent,
//!   and a returning owner's requests win over the borrowers' from its first request on;
//!   lower-priority borrowers are turned away first as the pool fills.
//! - `retry_reserve` is waived for a retry (`amz-sdk-request: attempt=N`, N > 1) while the
//!   route's recovery budget holds `T`: retries may use the reserve, first attempts never can.
//!
//! Settlement credits back to each bucket what it lent beyond the charge: the guarantee keeps the
//! charge first (it is what the route consumed), the ceiling and the recovery budget follow the
//! pool's own credit.
//!
//! A route's buckets are created, full, when it first asks, and follow the pool's capacity when
//! it asks again. Another route's unused guarantee is read as of now within its current capacity,
//! and not written: a route's buckets change only through its own requests and settlements. The
//! same rules run in the memory backend (here) and in the Redis scripts (`lua/admit.lua`), held
//! together by the contract suite and the differential test.

use std::{sync::Arc, time::Duration};

use foldhash::HashMap;

use super::bucket::TokenBucket;

/// One route's part of a pool, as fractions of the pool's current effective tokens per minute
/// (so that shares follow headroom, upstream-throttle feedback and reloads).
#[derive(Debug, Clone, PartialEq)]
pub struct RouteShare {
    pub route: Arc<str>,
    /// Higher wins as the pool fills.
    pub priority: i32,
    /// Guaranteed fraction (`min_share`).
    pub min_share: f64,
    /// Largest fraction (`max_share`); `None`: the whole pool.
    pub max_share: Option<f64>,
    /// Fraction of the pool per minute this route's retries may take from the retry reserve.
    pub recovery_share: f64,
}

/// Tokens of `fraction` of a pool of `tokens_per_minute`.
pub fn share_tokens(fraction: f64, tokens_per_minute: u64) -> u64 {
    (fraction.clamp(0.0, 1.0) * tokens_per_minute as f64).floor() as u64
}

impl RouteShare {
    /// Guarantee, ceiling and recovery capacities in a pool of `tpm` tokens per minute.
    pub fn capacities(&self, tpm: u64) -> (u64, Option<u64>, u64) {
        (
            share_tokens(self.min_share, tpm),
            self.max_share.map(|m| share_tokens(m, tpm)),
            share_tokens(self.recovery_share, tpm),
        )
    }
}

/// Who asks, among the routes that share a pool. Owned and cheap to clone (the route list is
/// shared), so a request waiting in the admission queue keeps its own.
#[derive(Debug, Clone)]
pub struct ShareRequest {
    /// Every route that uses the pool.
    pub routes: Arc<[RouteShare]>,
    /// Index of the calling route in `routes`.
    pub caller: usize,
    /// The request is an SDK retry (attempt > 1).
    pub retry: bool,
    /// Fraction of the bucket first attempts leave for retries.
    pub retry_reserve: f64,
    /// Fraction of the bucket a borrowing route leaves for active routes of higher priority.
    pub priority_margin: f64,
    /// A route that has asked nothing for this long and has nothing in flight lends its guarantee.
    pub idle: Duration,
}

impl ShareRequest {
    pub fn caller(&self) -> &RouteShare {
        &self.routes[self.caller]
    }
}

/// What a reservation took from its route's buckets, to give back at settlement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHold {
    pub route: Arc<str>,
    /// Tokens taken from the route's guarantee (the rest was borrowed).
    pub guaranteed: u64,
    /// Taken under the recovery budget (a retry admitted into the retry reserve).
    pub recovered: bool,
}

/// A route's buckets in one pool.
#[derive(Debug)]
struct RouteState {
    guarantee: TokenBucket,
    ceiling: Option<TokenBucket>,
    recovery: TokenBucket,
    /// When the route last asked for or settled a request.
    last_seen_ns: Option<u64>,
}

impl RouteState {
    fn new(share: &RouteShare, tpm: u64, now: u64) -> RouteState {
        let (guaranteed, ceiling, recovery) = share.capacities(tpm);
        RouteState {
            guarantee: TokenBucket::new(guaranteed, now),
            ceiling: ceiling.map(|c| TokenBucket::new(c, now)),
            recovery: TokenBucket::new(recovery, now),
            last_seen_ns: None,
        }
    }

    fn sync(&mut self, share: &RouteShare, tpm: u64, now: u64) {
        let (guaranteed, ceiling, recovery) = share.capacities(tpm);
        sync_bucket(&mut self.guarantee, guaranteed, now);
        sync_bucket(&mut self.recovery, recovery, now);
        match (&mut self.ceiling, ceiling) {
            (Some(bucket), Some(cap)) => sync_bucket(bucket, cap, now),
            (slot, cap) => *slot = cap.map(|c| TokenBucket::new(c, now)),
        }
    }

    /// The guarantee's whole tokens now, within the current capacity `guaranteed`, as another
    /// route sees it: read, not written (the route's own calls bring it up to date).
    fn unused_guarantee(&self, guaranteed: u64, now: u64) -> u64 {
        let mut bucket = self.guarantee.clone();
        bucket.refill(now);
        bucket.available().min(guaranteed)
    }

    fn active(&self, now: u64, idle: Duration) -> bool {
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        self.last_seen_ns
            .is_some_and(|seen| now.saturating_sub(seen) < idle)
    }
}

fn sync_bucket(bucket: &mut TokenBucket, capacity: u64, now: u64) {
    if bucket.capacity() != capacity {
        bucket.set_capacity(capacity, now);
    }
    bucket.refill(now);
}

/// What the pool's bucket must hold for one request to be admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Need {
    /// Tokens the pool's bucket must hold (the request's own plus what it must leave).
    pub tokens: u64,
    /// Of those, what it must leave for other routes (their guarantees, the priority margin).
    pub protected: u64,
    pub hold: Plan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub guaranteed: u64,
    pub recovered: bool,
}

/// A route is over its ceiling: the wait until its ceiling bucket holds the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OverCeiling {
    pub wait: Option<Duration>,
    pub deficit: u64,
}

/// The routes' buckets of one pool (memory backend).
#[derive(Debug, Default)]
pub(crate) struct RouteStates {
    routes: HashMap<Arc<str>, RouteState>,
}

impl RouteStates {
    /// What the pool's bucket (`pool_level` whole tokens now beyond the request's hold-back,
    /// `tpm` capacity) must hold for
    /// `tokens` from the caller, or the caller's ceiling refusing. Marks the caller active, and
    /// brings its buckets to `now` under the capacities of `tpm` (created full the first time it
    /// asks). Other routes' buckets change only when they ask or settle.
    pub fn need(
        &mut self,
        request: &ShareRequest,
        tokens: u64,
        pool_level: i64,
        tpm: u64,
        now: u64,
    ) -> Result<Need, OverCeiling> {
        let caller = request.caller();
        let (guarantee, recovery_fits) = {
            let state = self
                .routes
                .entry(caller.route.clone())
                .and_modify(|state| state.sync(caller, tpm, now))
                .or_insert_with(|| RouteState::new(caller, tpm, now));
            state.last_seen_ns = Some(now);
            if let Some(ceiling) = &state.ceiling
                && !ceiling.fits(tokens)
            {
                return Err(OverCeiling {
                    wait: ceiling.wait_for(tokens),
                    deficit: u64::try_from(i128::from(tokens) - i128::from(ceiling.level()))
                        .unwrap_or(0),
                });
            }
            (state.guarantee.available(), state.recovery.fits(tokens))
        };
        let guaranteed = guarantee.min(tokens);
        let protected = if guaranteed < tokens {
            self.protected(request, tpm, now)
        } else {
            0
        };
        let reserve = share_tokens(request.retry_reserve, tpm);
        let first = tokens.saturating_add(protected).saturating_add(reserve);
        let fits = |need: u64| i128::from(need) <= i128::from(pool_level);
        let recovered = request.retry
            && reserve > 0
            && !fits(first)
            && recovery_fits
            && fits(tokens.saturating_add(protected));
        Ok(Need {
            protected,
            tokens: if recovered {
                tokens.saturating_add(protected)
            } else {
                first
            },
            hold: Plan {
                guaranteed,
                recovered,
            },
        })
    }

    /// What a borrower from the caller must leave: the unused guarantees of the other active
    /// routes, and the priority margin if an active route outranks it.
    fn protected(&self, request: &ShareRequest, tpm: u64, now: u64) -> u64 {
        let caller = request.caller();
        let mut protected = 0u64;
        let mut outranked = false;
        for (i, share) in request.routes.iter().enumerate() {
            if i == request.caller {
                continue;
            }
            let Some(state) = self.routes.get(&share.route) else {
                continue;
            };
            if !state.active(now, request.idle) {
                continue;
            }
            let (guaranteed, _, _) = share.capacities(tpm);
            protected = protected.saturating_add(state.unused_guarantee(guaranteed, now));
            outranked |= share.priority > caller.priority;
        }
        if outranked {
            protected = protected.saturating_add(share_tokens(request.priority_margin, tpm));
        }
        protected
    }

    /// Takes an admitted request's tokens from the caller's buckets.
    pub fn take(&mut self, request: &ShareRequest, tokens: u64, plan: Plan) -> ShareHold {
        let route = request.caller().route.clone();
        if let Some(state) = self.routes.get_mut(&route) {
            state.guarantee.take(plan.guaranteed);
            if let Some(ceiling) = &mut state.ceiling {
                ceiling.take(tokens);
            }
            if plan.recovered {
                state.recovery.take(tokens);
            }
        }
        ShareHold {
            route,
            guaranteed: plan.guaranteed,
            recovered: plan.recovered,
        }
    }

    /// Gives back what `hold` took beyond the charge.
    pub fn settle(&mut self, hold: &ShareHold, reserved: u64, charged: u64, now: u64) {
        let Some(state) = self.routes.get_mut(&hold.route) else {
            return;
        };
        let (guarantee_credit, delta) = settle_credits(hold, reserved, charged);
        state.guarantee.refill(now);
        state.guarantee.adjust(guarantee_credit);
        if let Some(ceiling) = &mut state.ceiling {
            ceiling.refill(now);
            ceiling.adjust(delta);
        }
        if hold.recovered {
            state.recovery.refill(now);
            state.recovery.adjust(delta);
        }
        state.last_seen_ns = Some(state.last_seen_ns.map_or(now, |seen| seen.max(now)));
    }
}

/// The credits at settlement: to the guarantee (what it lent beyond the charge; never negative:
/// the charge counts against the guarantee first), and to the ceiling, recovery and pool buckets
/// (`reserved - charged`, negative when burndown made the charge larger).
pub fn settle_credits(hold: &ShareHold, reserved: u64, charged: u64) -> (i64, i64) {
    let guarantee = hold.guaranteed.saturating_sub(charged.min(hold.guaranteed));
    let delta = (i128::from(reserved) - i128::from(charged))
        .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    (i64::try_from(guarantee).unwrap_or(i64::MAX), delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    /// Every test pool holds 1,000 tokens per minute.
    const TPM: u64 = 1_000;

    fn share(route: &str, priority: i32, min_share: f64) -> RouteShare {
        RouteShare {
            route: Arc::from(route),
            priority,
            min_share,
            max_share: None,
            recovery_share: 0.0,
        }
    }

    fn request(routes: &[RouteShare], caller: usize) -> ShareRequest {
        ShareRequest {
            routes: routes.into(),
            caller,
            retry: false,
            retry_reserve: 0.0,
            priority_margin: 0.0,
            idle: Duration::from_secs(5),
        }
    }

    #[test]
    fn within_guarantee_needs_only_its_own_tokens() {
        let routes = [share("triage", 10, 0.6), share("backlog", 0, 0.0)];
        let mut states = RouteStates::default();
        let r = request(&routes, 0);
        let need = states.need(&r, 500, 1_000, TPM, 0).unwrap();
        assert_eq!(need.tokens, 500);
        assert_eq!(need.hold.guaranteed, 500);
    }

    #[test]
    fn borrower_leaves_active_guarantees_and_idle_ones_are_lent() {
        let routes = [share("triage", 10, 0.6), share("backlog", 0, 0.0)];
        let mut states = RouteStates::default();
        // Triage asked at t=0: active for 5 s.
        states.need(&request(&routes, 0), 1, 1_000, TPM, 0).unwrap();
        let b = request(&routes, 1);
        assert_eq!(states.need(&b, 100, 1_000, TPM, SEC).unwrap().tokens, 700);
        // Six seconds later triage is idle: its guarantee is lent.
        assert_eq!(
            states.need(&b, 100, 1_000, TPM, 6 * SEC).unwrap().tokens,
            100
        );
    }

    #[test]
    fn settling_keeps_a_route_active() {
        let routes = [share("triage", 0, 0.6), share("backlog", 0, 0.0)];
        let mut states = RouteStates::default();
        let t = request(&routes, 0);
        let need = states.need(&t, 100, 1_000, TPM, 0).unwrap();
        let hold = states.take(&t, 100, need.hold);
        let b = request(&routes, 1);
        // A minute later triage has not asked again: idle, its guarantee is lent.
        assert_eq!(
            states.need(&b, 100, 1_000, TPM, 60 * SEC).unwrap().tokens,
            100
        );
        // Its long request finishing makes it active again.
        states.settle(&hold, 100, 100, 60 * SEC);
        assert_eq!(
            states.need(&b, 100, 1_000, TPM, 60 * SEC).unwrap().tokens,
            700
        );
    }

    #[test]
    fn priority_margin_only_against_higher_priority() {
        let routes = [share("high", 10, 0.0), share("low", 0, 0.0)];
        let mut states = RouteStates::default();
        let mut h = request(&routes, 0);
        h.priority_margin = 0.05;
        let mut l = request(&routes, 1);
        l.priority_margin = 0.05;
        states.need(&h, 1, 1_000, TPM, 0).unwrap();
        states.need(&l, 1, 1_000, TPM, 0).unwrap();
        assert_eq!(states.need(&l, 100, 1_000, TPM, 0).unwrap().tokens, 150);
        assert_eq!(states.need(&h, 100, 1_000, TPM, 0).unwrap().tokens, 100);
    }

    #[test]
    fn retries_use_the_reserve_within_the_recovery_budget() {
        let mut routes = [share("app", 0, 0.0)];
        routes[0].recovery_share = 0.15;
        let mut states = RouteStates::default();
        let mut r = request(&routes, 0);
        r.retry_reserve = 0.2;
        // The bucket holds 250: a first attempt of 100 must leave 200.
        assert_eq!(states.need(&r, 100, 250, TPM, 0).unwrap().tokens, 300);
        r.retry = true;
        let need = states.need(&r, 100, 250, TPM, 0).unwrap();
        assert_eq!(need.tokens, 100);
        assert!(need.hold.recovered);
        let hold = states.take(&r, 100, need.hold);
        // 50 left in the recovery budget: the next retry of 100 waits like a first attempt.
        let next = states.need(&r, 100, 150, TPM, 0).unwrap();
        assert!(!next.hold.recovered);
        assert_eq!(next.tokens, 300);
        states.settle(&hold, 100, 40, 0);
        assert!(states.need(&r, 100, 150, TPM, 0).unwrap().hold.recovered);
    }

    #[test]
    fn ceiling_refuses_and_projects_its_refill() {
        let mut routes = [share("batch", 0, 0.0)];
        routes[0].max_share = Some(0.6);
        let mut states = RouteStates::default();
        let r = request(&routes, 0);
        let need = states.need(&r, 500, 10_000, TPM, 0).unwrap();
        states.take(&r, 500, need.hold);
        let over = states.need(&r, 200, 10_000, TPM, 0).unwrap_err();
        assert_eq!(over.deficit, 100);
        assert_eq!(over.wait, Some(Duration::from_secs(10)));
    }

    #[test]
    fn settlement_keeps_the_charge_against_the_guarantee() {
        let hold = ShareHold {
            route: Arc::from("a"),
            guaranteed: 300,
            recovered: false,
        };
        assert_eq!(settle_credits(&hold, 1_000, 100), (200, 900));
        assert_eq!(settle_credits(&hold, 1_000, 500), (0, 500));
        assert_eq!(settle_credits(&hold, 1_000, 2_000), (0, -1_000));
    }
}
