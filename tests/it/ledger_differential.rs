//! The memory ledger and the Redis ledger, driven through the same random operation sequences at
//! (Over 500 lines: one generator and one runner, for pools and budgets alike.)
//! the same instants, must give the same answers, exactly.
//!
//! proptest generates a case: up to three sets of pool limits (limits travel with each call, so
//! switching between them exercises capacity changes), up to three routes sharing the pool in up
//! to two configurations (shares change on reload: ceilings appear and go), and a sequence of
//! operations: reserve (random tokens, limits with or without a daily quota, calling route or none, retry flag,
//! hold-back), settle a random held reservation (a random charge from zero to twice the
//! reservation: refunds and burndown debts), advance the clock by random milliseconds, snapshot.
//! A budget (the account's daily quota, a route's budgets: one to three long windows, in one or
//! two configurations) is taken, settled and read on the same sequence, its refusals and
//! snapshots compared too.
//! Every answer is compared: granted or refused, the route hold of a grant, every field of a
//! rejection (binding limit, refill wait, deficit, in-flight tokens and requests,
//! held_for_others), every field of a snapshot. At the end everything still held is settled and
//! both pools must agree again, with nothing in flight.
//!
//! Both ledgers read one manual clock: the memory backend its nanoseconds, the Redis scripts its
//! milliseconds (through [`RedisLedger::connect_with_clock`], the test-only clock source), and the
//! clock only moves by whole milliseconds, where the two resolutions agree exactly. Leases last
//! a year of that clock, so none expires (the memory backend has no leases).
//!
//! It runs twice: on the Redis ledger, and on the Redis ledger with local capacity leases whose
//! slices are exactly the request that asks ([`LeasedLedger`] with a horizon of zero), which must
//! move the shared state exactly as plain reservations do. Slices of more than one request change
//! what is admitted when (never more than the exact bucket would): `ledger_leases.rs` holds them
//! to that.
//!
//! Like the contract suite, it runs against a private `redis-server` (`common/redis_server.rs`):
//! always under CI (`CI=true` fails without one); locally, without `redis-server`, it is a named,
//! counted skip (`common/skip.rs`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::common::redis_server;
use proptest::{
    prelude::*,
    test_runner::{Config, TestCaseError, TestRunner},
};
use tokengate::ledger::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Clock, LeaseOptions, LeasedLedger, Ledger, Limit,
    Limits, MemoryLedger, RedisLedger, RedisOptions, Rejection, Reservation, ReserveRequest,
    RouteShare, ShareRequest, Verdict,
};

/// Cases per run: enough to reach every rule many times, few enough for a few seconds in CI.
/// `PROPTEST_CASES` overrides it for a longer search.
const CASES: u32 = 256;
const LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

// === the operations ===

/// Who asks: the index of a route in the case's routes, and whether it is an SDK retry.
type Caller = Option<(usize, bool)>;

/// One configuration of the pool's routes (the same route names in every configuration).
type Routes = Arc<[RouteShare]>;

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Reserve {
        /// Which of the case's limits and route configurations this call applies.
        limits: usize,
        routes: usize,
        /// Tokens, in thousandths of the applied tokens per minute (above 1,000: never fits).
        permille: u64,
        caller: Caller,
        /// Hold-back, in thousandths of the applied tokens per minute.
        hold_back_permille: u64,
    },
    Settle {
        /// Which held reservation (modulo how many are held).
        pick: usize,
        /// The charge, in percent of the reservation.
        charge_pct: u64,
    },
    Advance {
        ms: u64,
    },
    Snapshot {
        limits: usize,
    },
    /// Tokens from a budget (in thousandths of its smallest window), with one of its window sets.
    TakeBudget {
        windows: usize,
        permille: u64,
    },
    SettleBudget {
        pick: usize,
        charge_pct: u64,
    },
    BudgetSnapshot {
        windows: usize,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Case {
    pub(crate) limits: Vec<Limits>,
    /// The budget's window sets (a reload changes capacities, adds and drops windows).
    budgets: Vec<Vec<BudgetWindow>>,
    pub(crate) routes: Vec<Routes>,
    retry_reserve: f64,
    priority_margin: f64,
    idle_ms: u64,
    pub(crate) ops: Vec<Op>,
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        prop_oneof![100u64..2_000, 2_000u64..200_000],
        prop_oneof![
            Just(None),
            (1u64..8).prop_map(Some),
            (8u64..120).prop_map(Some)
        ],
        1u32..6,
        // A daily quota small enough to bind within a case, or large (up to the ledgers' exact
        // range), or none.
        prop_oneof![
            2 => Just(None),
            2 => (1_000u64..400_000).prop_map(Some),
            1 => (1_000_000u64..=100_000_000_000).prop_map(Some)
        ],
    )
        .prop_map(
            |(tokens_per_minute, requests_per_minute, max_concurrency, tokens_per_day)| Limits {
                tokens_per_minute,
                requests_per_minute,
                max_concurrency,
                tokens_per_day,
            },
        )
}

fn budget_windows() -> impl Strategy<Value = Vec<BudgetWindow>> {
    const DAY: u64 = 86_400_000;
    let window = |name: &'static str, window_ms: u64| {
        prop_oneof![1_000u64..100_000, 100_000u64..=100_000_000_000].prop_map(move |capacity| {
            BudgetWindow {
                name,
                capacity,
                window_ms,
            }
        })
    };
    (
        prop::option::of(window("tokens_per_hour", 3_600_000)),
        prop::option::of(window("tokens_per_day", DAY)),
        prop::option::of(window("tokens_per_30_days", 30 * DAY)),
    )
        .prop_map(|(h, d, m)| [h, d, m].into_iter().flatten().collect::<Vec<_>>())
        .prop_filter("at least one window", |w| !w.is_empty())
}

fn route(name: &'static str) -> impl Strategy<Value = RouteShare> {
    (
        0i32..3,
        prop::sample::select(vec![0.0, 0.1, 0.2, 0.3]),
        prop::sample::select(vec![None, None, Some(0.3), Some(0.6), Some(1.0)]),
        prop::sample::select(vec![0.0, 0.05, 0.2]),
    )
        .prop_map(
            move |(priority, min_share, max_share, recovery_share)| RouteShare {
                route: Arc::from(name),
                priority,
                min_share,
                max_share,
                recovery_share,
            },
        )
}

fn op(
    limit_sets: usize,
    route_sets: usize,
    routes: usize,
    budget_sets: usize,
) -> impl Strategy<Value = Op> {
    let caller = prop_oneof![
        1 => Just(None),
        3 => (0..routes, prop::bool::weighted(0.5)).prop_map(Some),
    ];
    prop_oneof![
        6 => (0..limit_sets, 0..route_sets, prop_oneof![1u64..100, 1u64..1_100], caller, prop_oneof![3 => Just(0u64), 1 => 0u64..300])
            .prop_map(|(limits, routes, permille, caller, hold_back_permille)| Op::Reserve {
                limits,
                routes,
                permille,
                caller,
                hold_back_permille,
            }),
        3 => (any::<usize>(), 0u64..=200)
            .prop_map(|(pick, charge_pct)| Op::Settle { pick, charge_pct }),
        3 => prop_oneof![0u64..20, 0u64..5_000].prop_map(|ms| Op::Advance { ms }),
        1 => (0..limit_sets).prop_map(|limits| Op::Snapshot { limits }),
        2 => (0..budget_sets, prop_oneof![1u64..300, 1u64..1_100])
            .prop_map(|(windows, permille)| Op::TakeBudget { windows, permille }),
        1 => (any::<usize>(), 0u64..=200)
            .prop_map(|(pick, charge_pct)| Op::SettleBudget { pick, charge_pct }),
        1 => (0..budget_sets).prop_map(|windows| Op::BudgetSnapshot { windows }),
    ]
}

pub(crate) fn case() -> impl Strategy<Value = Case> {
    let routes = (1usize..=3).prop_flat_map(|n| {
        let set = ["triage", "batch", "chat"][..n]
            .iter()
            .map(|&name| route(name))
            .collect::<Vec<_>>()
            .prop_map(Routes::from);
        prop::collection::vec(set, 1..=2)
    });
    (
        (
            prop::collection::vec(limits(), 1..=3),
            prop::collection::vec(budget_windows(), 1..=2),
        ),
        routes,
        prop::sample::select(vec![0.0, 0.1, 0.2]),
        prop::sample::select(vec![0.0, 0.05]),
        prop_oneof![Just(0u64), 1u64..20_000],
    )
        .prop_flat_map(
            |((limits, budgets), routes, retry_reserve, priority_margin, idle_ms)| {
                let ops = prop::collection::vec(
                    op(limits.len(), routes.len(), routes[0].len(), budgets.len()),
                    1..60,
                );
                (
                    Just((limits, budgets)),
                    Just(routes),
                    Just(retry_reserve),
                    Just(priority_margin),
                    Just(idle_ms),
                    ops,
                )
            },
        )
        .prop_map(
            |((limits, budgets), routes, retry_reserve, priority_margin, idle_ms, ops)| Case {
                limits,
                budgets,
                routes,
                retry_reserve,
                priority_margin,
                idle_ms,
                ops,
            },
        )
}

// === running a case ===

/// The two ledgers under comparison, on one clock.
struct Pair<'a> {
    memory: MemoryLedger,
    /// The Redis ledger, alone or with local capacity leases in front of it.
    redis: Box<dyn Ledger>,
    clock: Clock,
    pool: String,
    seen: &'a Seen,
}

/// What the agreed answers covered over a whole run: a run that never reached a rule proves
/// nothing about it, so the test requires each at least once.
#[derive(Debug, Default)]
struct Seen {
    granted: AtomicU64,
    granted_borrowing: AtomicU64,
    recovered: AtomicU64,
    refused_tokens: AtomicU64,
    refused_never: AtomicU64,
    refused_requests: AtomicU64,
    refused_concurrency: AtomicU64,
    refused_share: AtomicU64,
    refused_daily: AtomicU64,
    budget_taken: AtomicU64,
    budget_refused: AtomicU64,
    budget_refused_never: AtomicU64,
    held_for_others: AtomicU64,
    in_debt: AtomicU64,
}

impl Seen {
    fn grant(&self, reservation: &Reservation) {
        count(&self.granted);
        if let Some(hold) = reservation.share() {
            if hold.guaranteed < reservation.tokens() {
                count(&self.granted_borrowing);
            }
            if hold.recovered {
                count(&self.recovered);
            }
        }
    }

    fn refusal(&self, r: &Rejection) {
        count(match r.limit {
            Limit::Tokens if r.refill_wait.is_none() => &self.refused_never,
            Limit::Tokens => &self.refused_tokens,
            Limit::Requests => &self.refused_requests,
            Limit::Concurrency => &self.refused_concurrency,
            Limit::Share => &self.refused_share,
            Limit::DailyQuota => &self.refused_daily,
            Limit::Budget | Limit::RouteConcurrency => {
                unreachable!("a pool's reservation is never refused on a route's limits")
            }
        });
        if r.held_for_others {
            count(&self.held_for_others);
        }
    }

    fn assert_all_reached(&self) {
        let all = [
            ("granted", &self.granted),
            ("granted while borrowing", &self.granted_borrowing),
            ("granted from the retry reserve", &self.recovered),
            ("refused on tokens", &self.refused_tokens),
            ("refused, never fits", &self.refused_never),
            ("refused on requests", &self.refused_requests),
            ("refused on concurrency", &self.refused_concurrency),
            ("refused on a share ceiling", &self.refused_share),
            ("refused on the daily quota", &self.refused_daily),
            ("budget taken", &self.budget_taken),
            ("budget refused", &self.budget_refused),
            ("budget refused, never fits", &self.budget_refused_never),
            ("refused, held for others", &self.held_for_others),
            ("a snapshot in burndown debt", &self.in_debt),
        ];
        let missing: Vec<_> = all
            .iter()
            .filter(|(_, n)| n.load(Ordering::Relaxed) == 0)
            .map(|(what, _)| *what)
            .collect();
        assert!(
            missing.is_empty(),
            "the run never reached: {missing:?} ({self:?})"
        );
    }
}

fn count(n: &AtomicU64) {
    n.fetch_add(1, Ordering::Relaxed);
}

impl Pair<'_> {
    async fn reserve(
        &self,
        request: &ReserveRequest<'_>,
    ) -> Result<Option<(Reservation, Reservation)>, TestCaseError> {
        let memory = self.memory.reserve(request).await.expect("memory answers");
        let redis = self.redis.reserve(request).await.expect("redis answers");
        match (memory, redis) {
            (Verdict::Granted(m), Verdict::Granted(r)) => {
                prop_assert_eq!(m.share(), r.share(), "the route holds of a grant");
                prop_assert_eq!(m.tokens(), r.tokens());
                self.seen.grant(&m);
                Ok(Some((m, r)))
            }
            (Verdict::Refused(m), Verdict::Refused(r)) => {
                prop_assert_eq!(&m, &r, "the rejections");
                self.seen.refusal(&m);
                Ok(None)
            }
            (m, r) => {
                let verdicts = format!("memory {m:?}, redis {r:?}");
                self.settle_both(m, r).await;
                Err(TestCaseError::fail(format!("verdicts differ: {verdicts}")))
            }
        }
    }

    /// Settles whatever either side granted (uncharged), so nothing is dropped unsettled.
    async fn settle_both(&self, memory: Verdict, redis: Verdict) {
        if let Verdict::Granted(m) = memory {
            self.memory.settle(m, 0).await.expect("memory settles");
        }
        if let Verdict::Granted(r) = redis {
            self.redis.settle(r, 0).await.expect("redis settles");
        }
    }

    async fn settle(&self, (m, r): (Reservation, Reservation), charge: u64) {
        self.memory.settle(m, charge).await.expect("memory settles");
        self.redis.settle(r, charge).await.expect("redis settles");
    }

    async fn snapshots_agree(&self, limits: &Limits) -> Result<(), TestCaseError> {
        let memory = self.memory.snapshot(&self.pool, limits).await;
        let redis = self.redis.snapshot(&self.pool, limits).await;
        let memory = memory.expect("memory answers");
        prop_assert_eq!(&memory, &redis.expect("redis answers"), "the snapshots");
        if memory.tokens_available < 0 {
            count(&self.seen.in_debt);
        }
        Ok(())
    }
}

impl Case {
    /// The share request of `caller` (a route and whether it retries) under route set `routes`.
    pub(crate) fn share(&self, routes: usize, caller: Caller) -> Option<ShareRequest> {
        caller.map(|(caller, retry)| ShareRequest {
            routes: self.routes[routes].clone(),
            caller,
            retry,
            retry_reserve: self.retry_reserve,
            priority_margin: self.priority_margin,
            idle: Duration::from_millis(self.idle_ms),
        })
    }
}

/// A tokens-per-minute fraction in thousandths, at least one token.
pub(crate) fn permille_of(limits: &Limits, permille: u64) -> u64 {
    (limits.tokens_per_minute * permille / 1_000).max(1)
}

impl Pair<'_> {
    fn budget<'a>(&'a self, windows: &'a [BudgetWindow], tokens: u64) -> BudgetRequest<'a> {
        BudgetRequest {
            scope: &self.pool,
            windows,
            tokens,
        }
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<bool, TestCaseError> {
        let refusal = |v: BudgetVerdict| match v {
            BudgetVerdict::Taken(_) => None,
            BudgetVerdict::Refused(r) => Some(r),
        };
        let memory = refusal(self.memory.take_budget(request).await.expect("memory"));
        let redis = refusal(self.redis.take_budget(request).await.expect("redis"));
        match (&memory, &redis) {
            (None, None) => {
                count(&self.seen.budget_taken);
                Ok(true)
            }
            (Some(m), Some(_)) => {
                prop_assert_eq!(&memory, &redis, "the budget refusals");
                count(if m.wait.is_none() {
                    &self.seen.budget_refused_never
                } else {
                    &self.seen.budget_refused
                });
                Ok(false)
            }
            _ => Err(TestCaseError::fail(format!(
                "budget verdicts differ: memory {memory:?}, redis {redis:?}"
            ))),
        }
    }

    async fn settle_budget(&self, request: &BudgetRequest<'_>, charged: u64) {
        let local = tokengate::ledger::Origin::Local;
        let shared = tokengate::ledger::Origin::Shared;
        self.memory
            .settle_budget(request, local, charged)
            .await
            .expect("memory settles");
        self.redis
            .settle_budget(request, shared, charged)
            .await
            .expect("redis settles");
    }

    async fn budget_snapshots_agree(&self, windows: &[BudgetWindow]) -> Result<(), TestCaseError> {
        let memory = self.memory.budget_snapshot(&self.pool, windows).await;
        let redis = self.redis.budget_snapshot(&self.pool, windows).await;
        prop_assert_eq!(
            memory.expect("memory answers"),
            redis.expect("redis answers"),
            "the budget snapshots"
        );
        Ok(())
    }
}

/// A budget's take: thousandths of its smallest window, at least one token.
fn budget_tokens(windows: &[BudgetWindow], permille: u64) -> u64 {
    let smallest = windows.iter().map(|w| w.capacity).min().unwrap_or(1);
    (smallest / 1_000 * permille).max(1)
}

async fn run(case: &Case, pair: &Pair<'_>) -> Result<(), TestCaseError> {
    let mut held: Vec<(Reservation, Reservation)> = Vec::new();
    let mut budgets: Vec<u64> = Vec::new();
    let outcome = step_all(case, pair, &mut held, &mut budgets).await;
    // Settle what is still held whatever happened, so that nothing is dropped unsettled.
    for pair_held in held.drain(..) {
        let charge = pair_held.0.tokens();
        pair.settle(pair_held, charge).await;
    }
    outcome?;
    let last_windows = &case.budgets[case.budgets.len() - 1];
    for tokens in budgets.drain(..) {
        pair.settle_budget(&pair.budget(last_windows, tokens), tokens)
            .await;
    }
    pair.budget_snapshots_agree(last_windows).await?;
    let last = case.limits[case.limits.len() - 1];
    pair.snapshots_agree(&last).await?;
    let end = pair
        .memory
        .snapshot(&pair.pool, &last)
        .await
        .expect("memory answers");
    prop_assert_eq!((end.reserved_tokens, end.in_flight_requests), (0, 0));
    prop_assert_eq!(pair.memory.stats().unsettled_drops(), 0);
    prop_assert_eq!(pair.redis.stats().unsettled_drops(), 0);
    Ok(())
}

async fn step_all(
    case: &Case,
    pair: &Pair<'_>,
    held: &mut Vec<(Reservation, Reservation)>,
    budgets: &mut Vec<u64>,
) -> Result<(), TestCaseError> {
    for op in &case.ops {
        match *op {
            Op::Reserve {
                limits,
                routes,
                permille,
                caller,
                hold_back_permille,
            } => {
                let limits = case.limits[limits];
                let share = case.share(routes, caller);
                let request = ReserveRequest {
                    pool: &pair.pool,
                    limits,
                    tokens: permille_of(&limits, permille),
                    share: share.as_ref(),
                    hold_back: limits.tokens_per_minute * hold_back_permille / 1_000,
                };
                if let Some(granted) = pair.reserve(&request).await? {
                    held.push(granted);
                }
            }
            Op::Settle { pick, charge_pct } => {
                if !held.is_empty() {
                    let granted = held.swap_remove(pick % held.len());
                    let charge = granted.0.tokens() * charge_pct / 100;
                    pair.settle(granted, charge).await;
                }
            }
            Op::Advance { ms } => pair.clock.advance(Duration::from_millis(ms)),
            Op::Snapshot { limits } => pair.snapshots_agree(&case.limits[limits]).await?,
            Op::TakeBudget { windows, permille } => {
                let windows = &case.budgets[windows];
                let tokens = budget_tokens(windows, permille);
                if pair.take_budget(&pair.budget(windows, tokens)).await? {
                    budgets.push(tokens);
                }
            }
            Op::SettleBudget { pick, charge_pct } => {
                if !budgets.is_empty() {
                    let tokens = budgets.swap_remove(pick % budgets.len());
                    // Settled under the set in force now (a reload between take and settle).
                    let windows = &case.budgets[pick % case.budgets.len()];
                    pair.settle_budget(&pair.budget(windows, tokens), tokens * charge_pct / 100)
                        .await;
                }
            }
            Op::BudgetSnapshot { windows } => {
                pair.budget_snapshots_agree(&case.budgets[windows]).await?
            }
        }
    }
    Ok(())
}

#[test]
fn memory_and_redis_ledgers_agree_exactly() {
    differential(None);
}

/// With local capacity leases whose slices are exactly the request that asks (a horizon of
/// zero), the shared state moves exactly as with plain reservations: every request goes through
/// `lua/slice.lua` (a slice taken, admitted from in memory, used up and so given back at once,
/// its reservation a lease of its own), and every answer must still be the memory ledger's. What
/// slices of more than one request may change, and what they never may, is in
/// `ledger_leases.rs`.
#[test]
fn memory_and_leased_redis_agree_exactly_with_one_request_slices() {
    differential(Some(LeaseOptions {
        horizon: Duration::ZERO,
        max_fraction: 1.0,
        max_age: Duration::from_secs(3_600),
    }));
}

fn differential(leases: Option<LeaseOptions>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(server) = runtime.block_on(redis_server::RedisServer::start()) else {
        return;
    };
    let run_id = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut runner = TestRunner::new(Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(CASES),
        max_shrink_iters: 2_000,
        failure_persistence: None,
        ..Config::default()
    });
    let cases_run = AtomicU64::new(0);
    let seen = Seen::default();
    let result = runner.run(&case(), |case| {
        let n = cases_run.fetch_add(1, Ordering::Relaxed);
        runtime.block_on(async {
            let clock = Clock::manual();
            let options = RedisOptions {
                url: server.url(),
                timeout: Duration::from_secs(5),
                lease: LEASE,
            };
            let shared = RedisLedger::connect_with_clock(options, clock.clone())
                .await
                .expect("redis ledger");
            let redis: Box<dyn Ledger> = match leases {
                Some(leases) => Box::new(LeasedLedger::new(shared, leases)),
                None => Box::new(shared),
            };
            let pair = Pair {
                memory: MemoryLedger::new(clock.clone()),
                redis,
                clock,
                pool: format!("differential-{run_id}-{n}"),
                seen: &seen,
            };
            run(&case, &pair).await
        })
    });
    if let Err(e) = result {
        panic!("the ledgers disagree: {e}");
    }
    seen.assert_all_reached();
    println!("{seen:?}");
}
