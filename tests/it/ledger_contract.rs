//! The `Ledger` contract: what every backend must do, run against every backend.
//! (Over 500 lines: one case list instantiated per backend; the cases share its helpers.)
//!
//! Each case is an `async fn(Arc<dyn Ledger>)`; [`contract_suite!`] instantiates all of them for
//! one backend, so adding a backend is one line at the bottom of this file. The suite proves:
//!
//! - **all or nothing**: a request turned away by concurrency or by the request bucket leaves the
//!   token bucket as it was; one turned away by tokens takes no request and no permit;
//! - **no over-admission** under concurrent callers on a multi-threaded runtime, for tokens and
//!   for concurrency, and no permit leak under sustained reserve/settle churn;
//! - **settlement arithmetic**: a refund of `reserved - charged`, an extra debit when the charge
//!   exceeds the reservation (the level may go negative), repaid by refill;
//! - **rejection facts**: the binding limit, the projected refill wait, the in-flight figures;
//! - **limits travel with each call**: shrinking a bucket clamps its level, raising one does not
//!   credit a burst, raising `max_concurrency` admits more;
//! - **route shares**: a route within its guarantee is admitted when borrowers are not; an idle
//!   route's guarantee is lent; a route's `max_share` binds with its own refill; retries use the
//!   retry reserve within their recovery budget and first attempts never do;
//! - **daily quotas**: a pool's `tokens_per_day` bucket is checked and taken with the rest (a
//!   request it refuses takes no tokens, request or permit), reports a wait to the tick that
//!   makes room, settles like the minute bucket, and follows its limit as it changes;
//! - **budgets** (the account's daily quota, route budgets): every window of a scope taken or
//!   none, the binding window named with its wait, settlement and give-back, windows that change
//!   or go with the config;
//! - **route concurrency**: a route's `max_concurrency` is a pool of its own holding no tokens
//!   (reservations of 0 tokens in a 1-token bucket): its permits bind, come back at settlement,
//!   and follow the limit as it changes;
//! - **the transit hold**: after a reservation empties a full bucket, refill restarts 100 ms later
//!   (a literal here, so changing `units::UPSTREAM_TRANSIT` or the Lua's `TRANSIT_MS` fails);
//! - no reservation is ever dropped unsettled (the ledger's `stats().unsettled_drops() == 0`
//!   after every case).
//!
//! The Redis backend runs against a private `redis-server` per case (see
//! `common/redis_server.rs`): always under CI; locally, without `redis-server`, each Redis case
//! is a named, counted skip (`common/skip.rs`).
//!
//! Backends whose clock is not injectable (Redis uses the server's `TIME`) must pass too, so no
//! case relies on a manual clock: limits are chosen so that refill during a case is small
//! (600 tokens per minute refills 10 per second), and wherever refill matters the tolerance is
//! bounded by the elapsed time measured in the test. Pool names are unique per case and per run,
//! because shared backends keep state between runs.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokengate::ledger::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Clock, LeaseOptions, LeasedLedger, Ledger, Limit,
    Limits, MemoryLedger, PoolSnapshot, RedisLedger, RedisOptions, Rejection, Reservation,
    ReserveRequest, RouteShare, ShareRequest, Verdict,
};
use tokio::sync::Barrier;

/// 600 tokens per minute: 10 tokens of refill per second.
const TPM: u64 = 600;
const TOKENS_PER_SEC: f64 = TPM as f64 / 60.0;

use crate::common::{redis_cluster::RedisCluster, redis_server};

/// A ledger under test, and whatever must live as long as it (a private Redis).
struct Backend {
    ledger: Arc<dyn Ledger>,
    _server: Option<redis_server::RedisServer>,
    _cluster: Option<(RedisCluster, tempfile::TempDir)>,
}

/// Instantiates every contract case for one backend: `contract_suite!(name => async factory)`.
/// The factory returns `None` to skip (no Redis available outside CI; the skip is recorded).
macro_rules! contract_suite {
    ($backend:ident => $factory:expr) => {
        contract_suite!(@cases $backend => $factory;
            all_or_nothing_concurrency,
            all_or_nothing_requests,
            all_or_nothing_tokens,
            no_over_admission_tokens,
            no_over_admission_concurrency,
            churn_never_exceeds_concurrency,
            settlement_refunds_unused,
            settlement_burndown_goes_negative_and_refill_repays,
            rejection_facts_tokens,
            rejection_facts_concurrency,
            rejection_facts_never_fits,
            rejection_facts_requests,
            rejection_binds_longest_wait_with_concurrency,
            limits_shrink_clamps_level,
            limits_raise_credits_no_burst,
            limits_raise_concurrency,
            shares_guarantee_is_protected_from_borrowers,
            shares_idle_guarantees_are_lent,
            shares_ceiling_binds_with_its_own_refill,
            shares_retries_use_the_reserve_within_the_budget,
            hold_back_stays_in_the_bucket,
            refill_after_a_full_bucket_waits_for_transit,
            daily_quota_binds_in_the_same_step_and_takes_nothing_else,
            daily_quota_settles_refunds_and_debts,
            daily_quota_follows_its_limit,
            budget_takes_every_window_or_none,
            budget_settles_and_gives_back,
            budget_windows_follow_their_config,
            route_concurrency_is_a_concurrency_only_pool,
        );
    };
    (@cases $backend:ident => $factory:expr; $($(#[$attr:meta])* $case:ident),* $(,)?) => {
        mod $backend {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $case() {
                    let Some(backend): Option<Backend> = $factory.await else {
                        return;
                    };
                    super::$case(backend.ledger.clone()).await;
                    assert_eq!(backend.ledger.stats().unsettled_drops(), 0, "a reservation was dropped unsettled");
                }
            )*
        }
    };
}

async fn memory_ledger() -> Option<Backend> {
    Some(Backend {
        ledger: Arc::new(MemoryLedger::new(Clock::tokio())),
        _server: None,
        _cluster: None,
    })
}

async fn redis_ledger() -> Option<Backend> {
    let server = redis_server::RedisServer::start().await?;
    let options = RedisOptions {
        url: server.url(),
        timeout: Duration::from_secs(5),
        lease: Duration::from_secs(60),
    };
    let ledger = RedisLedger::connect(options).await.expect("redis ledger");
    assert!(ledger.is_healthy(), "the private redis-server answers");
    Some(Backend {
        ledger: Arc::new(ledger),
        _server: Some(server),
        _cluster: None,
    })
}

/// The Redis ledger on a three-master Redis Cluster (`redis+cluster://`): every script's keys
/// share one slot, so each case runs as on one node.
async fn redis_cluster_ledger() -> Option<Backend> {
    let dir = tempfile::tempdir().expect("temp dir");
    let cluster = crate::cluster::start_cluster(dir.path(), 3, 0).await?;
    let ledger = crate::cluster::cluster_ledger(cluster.url(), Duration::from_secs(5)).await;
    assert!(ledger.is_healthy(), "the private cluster answers");
    Some(Backend {
        ledger: Arc::new(ledger),
        _server: None,
        _cluster: Some((cluster, dir)),
    })
}

/// Slices up to the whole of each limit: most cases' requests are then admitted from a slice,
/// and every case must hold as it does without.
const LEASES: LeaseOptions = LeaseOptions {
    horizon: Duration::from_millis(250),
    max_fraction: 1.0,
    max_age: Duration::from_secs(1),
};

/// The Redis ledger with local capacity leases ([`LEASES`]).
async fn redis_leased_ledger() -> Option<Backend> {
    let server = redis_server::RedisServer::start().await?;
    let options = RedisOptions {
        url: server.url(),
        timeout: Duration::from_secs(5),
        lease: Duration::from_secs(60),
    };
    let shared = RedisLedger::connect(options).await.expect("redis ledger");
    assert!(shared.is_healthy(), "the private redis-server answers");
    Some(Backend {
        ledger: Arc::new(LeasedLedger::new(shared, LEASES)),
        _server: Some(server),
        _cluster: None,
    })
}

/// The same on a three-master Redis Cluster: a slice's keys are its pool's, in one slot.
async fn redis_cluster_leased_ledger() -> Option<Backend> {
    let dir = tempfile::tempdir().expect("temp dir");
    let cluster = crate::cluster::start_cluster(dir.path(), 3, 0).await?;
    let shared = crate::cluster::cluster_ledger(cluster.url(), Duration::from_secs(5)).await;
    assert!(shared.is_healthy(), "the private cluster answers");
    Some(Backend {
        ledger: Arc::new(LeasedLedger::new(shared, LEASES)),
        _server: None,
        _cluster: Some((cluster, dir)),
    })
}

contract_suite!(memory => memory_ledger());
contract_suite!(redis => redis_ledger());
contract_suite!(redis_leases => redis_leased_ledger());
contract_suite!(redis_cluster => redis_cluster_ledger());
contract_suite!(redis_cluster_leases => redis_cluster_leased_ledger());

// === helpers ===

/// A pool name no other case or earlier run uses.
fn pool_name(case: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("contract-{case}-{}-{nanos}", std::process::id())
}

fn limits(
    tokens_per_minute: u64,
    requests_per_minute: Option<u64>,
    max_concurrency: u32,
) -> Limits {
    Limits {
        tokens_per_minute,
        requests_per_minute,
        max_concurrency,
        tokens_per_day: None,
    }
}

async fn reserve(ledger: &dyn Ledger, pool: &str, limits: Limits, tokens: u64) -> Verdict {
    ledger
        .reserve(&ReserveRequest {
            pool,
            limits,
            tokens,
            share: None,
            hold_back: 0,
        })
        .await
        .expect("ledger reachable")
}

async fn admit(ledger: &dyn Ledger, pool: &str, limits: Limits, tokens: u64) -> Reservation {
    match reserve(ledger, pool, limits, tokens).await {
        Verdict::Granted(r) => r,
        Verdict::Refused(r) => panic!("expected {tokens} tokens admitted, got {r:?}"),
    }
}

async fn reject(ledger: &dyn Ledger, pool: &str, limits: Limits, tokens: u64) -> Rejection {
    match reserve(ledger, pool, limits, tokens).await {
        Verdict::Refused(r) => r,
        Verdict::Granted(r) => {
            let id = r.id();
            ledger.settle(r, 0).await.expect("settle");
            panic!("expected {tokens} tokens rejected, but reservation {id} was admitted")
        }
    }
}

async fn settle(ledger: &dyn Ledger, reservation: Reservation, charged: u64) {
    ledger.settle(reservation, charged).await.expect("settle");
}

async fn snapshot(ledger: &dyn Ledger, pool: &str, limits: Limits) -> PoolSnapshot {
    ledger.snapshot(pool, &limits).await.expect("snapshot")
}

/// Whole tokens that refill may have added since `since` at `TPM`, plus one for the rounding of
/// whole-token levels.
fn refill_tolerance(since: Instant) -> i64 {
    (since.elapsed().as_secs_f64() * TOKENS_PER_SEC).ceil() as i64 + 1
}

/// `after` is `expected` plus at most the refill since `since` (never less).
fn assert_level(after: i64, expected: i64, since: Instant, what: &str) {
    let tolerance = refill_tolerance(since);
    assert!(
        (expected..=expected + tolerance).contains(&after),
        "{what}: tokens_available {after}, expected {expected} (+ refill up to {tolerance})"
    );
}

fn assert_idle(s: &PoolSnapshot) {
    assert_eq!(s.reserved_tokens, 0, "nothing reserved: {s:?}");
    assert_eq!(s.in_flight_requests, 0, "nothing in flight: {s:?}");
}

// === all or nothing ===

/// A request turned away on concurrency leaves tokens (and requests) untouched.
async fn all_or_nothing_concurrency(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("aon-concurrency"), limits(TPM, Some(10), 1));
    let held = admit(&*ledger, &pool, l, 60).await;
    let start = Instant::now();
    let before = snapshot(&*ledger, &pool, l).await;
    for _ in 0..3 {
        let r = reject(&*ledger, &pool, l, 60).await;
        assert_eq!(r.limit, Limit::Concurrency);
    }
    let after = snapshot(&*ledger, &pool, l).await;
    assert_level(
        after.tokens_available,
        before.tokens_available,
        start,
        "after concurrency rejections",
    );
    assert_eq!(
        after.requests_available, before.requests_available,
        "no request taken"
    );
    assert_eq!((after.reserved_tokens, after.in_flight_requests), (60, 1));
    settle(&*ledger, held, 60).await;
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

/// A request turned away by the request bucket leaves tokens untouched and takes no permit.
async fn all_or_nothing_requests(ledger: Arc<dyn Ledger>) {
    // One request per minute: the bucket refills one request per 60 s, never during the case.
    let (pool, l) = (pool_name("aon-requests"), limits(TPM, Some(1), 10));
    let first = admit(&*ledger, &pool, l, 60).await;
    let start = Instant::now();
    let before = snapshot(&*ledger, &pool, l).await;
    assert_eq!(before.requests_available, Some(0));
    for _ in 0..3 {
        let r = reject(&*ledger, &pool, l, 60).await;
        assert_eq!(r.limit, Limit::Requests);
    }
    let after = snapshot(&*ledger, &pool, l).await;
    assert_level(
        after.tokens_available,
        before.tokens_available,
        start,
        "after request rejections",
    );
    assert_eq!(
        (after.reserved_tokens, after.in_flight_requests),
        (60, 1),
        "no permit taken"
    );
    settle(&*ledger, first, 60).await;
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

/// A request turned away on tokens takes no request from the request bucket and no permit.
async fn all_or_nothing_tokens(ledger: Arc<dyn Ledger>) {
    // Five requests per minute and two permits: five token rejections that each took a request
    // would empty the request bucket; any that took a permit would block the two reserves below.
    let (pool, l) = (pool_name("aon-tokens"), limits(TPM, Some(5), 2));
    let all = admit(&*ledger, &pool, l, TPM).await;
    for _ in 0..5 {
        let r = reject(&*ledger, &pool, l, 60).await;
        assert_eq!(r.limit, Limit::Tokens);
    }
    let s = snapshot(&*ledger, &pool, l).await;
    assert_eq!(
        s.requests_available,
        Some(4),
        "only the admitted request counted: {s:?}"
    );
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (TPM, 1));
    settle(&*ledger, all, 0).await;
    let a = admit(&*ledger, &pool, l, 60).await;
    let b = admit(&*ledger, &pool, l, 60).await;
    settle(&*ledger, a, 60).await;
    settle(&*ledger, b, 60).await;
    let s = snapshot(&*ledger, &pool, l).await;
    assert_eq!(
        s.requests_available,
        Some(2),
        "three admitted requests counted: {s:?}"
    );
    assert_idle(&s);
}

// === no over-admission ===

/// Fires `n` reserves of `tokens` at once from spawned tasks; returns what was admitted and
/// rejected, and when the race started.
async fn race(
    ledger: &Arc<dyn Ledger>,
    pool: &str,
    l: Limits,
    n: usize,
    tokens: u64,
) -> (Vec<Reservation>, Vec<Rejection>, Instant) {
    let barrier = Arc::new(Barrier::new(n));
    let start = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (ledger, barrier, pool) = (ledger.clone(), barrier.clone(), pool.to_owned());
            tokio::spawn(async move {
                barrier.wait().await;
                reserve(&*ledger, &pool, l, tokens).await
            })
        })
        .collect();
    let (mut admitted, mut rejected) = (Vec::new(), Vec::new());
    for task in tasks {
        match task.await.expect("task") {
            Verdict::Granted(r) => admitted.push(r),
            Verdict::Refused(r) => rejected.push(r),
        }
    }
    (admitted, rejected, start)
}

/// 50 concurrent reserves of 60 tokens against a 600-token bucket admit exactly 10.
async fn no_over_admission_tokens(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("race-tokens"), limits(TPM, None, 1_000));
    let (admitted, rejected, start) = race(&ledger, &pool, l, 50, 60).await;
    // An 11th only if the race itself lasted long enough to refill 60 tokens (6 s).
    let refilled = (start.elapsed().as_secs_f64() * TOKENS_PER_SEC) as usize;
    let most = 10 + refilled / 60;
    assert!(
        (10..=most).contains(&admitted.len()),
        "admitted {} of 50 (allowed 10..={most})",
        admitted.len()
    );
    assert!(
        rejected.iter().all(|r| r.limit == Limit::Tokens),
        "{rejected:?}"
    );
    for r in admitted {
        settle(&*ledger, r, 60).await;
    }
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

/// 50 concurrent reserves with `max_concurrency = 5` and plenty of tokens admit exactly 5.
async fn no_over_admission_concurrency(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("race-concurrency"), limits(1_000_000, None, 5));
    let (admitted, rejected, _) = race(&ledger, &pool, l, 50, 60).await;
    assert_eq!(admitted.len(), 5, "nothing settles during the race");
    assert!(
        rejected.iter().all(|r| r.limit == Limit::Concurrency),
        "{rejected:?}"
    );
    for r in admitted {
        settle(&*ledger, r, 60).await;
    }
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

/// 50 tasks looping reserve/settle with 5 permits: never more than 5 holders, every admission
/// settles, and the pool ends idle.
async fn churn_never_exceeds_concurrency(ledger: Arc<dyn Ledger>) {
    const TASKS: usize = 50;
    const ITERATIONS: usize = 300;
    let (pool, l) = (pool_name("churn"), limits(1_000_000_000, None, 5));
    let holders = Arc::new(AtomicU32::new(0));
    let most_holders = Arc::new(AtomicU32::new(0));
    let (admitted, settled) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let ledger = ledger.clone();
            let pool = pool.clone();
            let (holders, most_holders) = (holders.clone(), most_holders.clone());
            let (admitted, settled) = (admitted.clone(), settled.clone());
            tokio::spawn(async move {
                for _ in 0..ITERATIONS {
                    match reserve(&*ledger, &pool, l, 60).await {
                        Verdict::Granted(r) => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                            most_holders.fetch_max(now, Ordering::Relaxed);
                            tokio::task::yield_now().await;
                            holders.fetch_sub(1, Ordering::SeqCst);
                            settle(&*ledger, r, 30).await;
                            settled.fetch_add(1, Ordering::Relaxed);
                        }
                        Verdict::Refused(r) => {
                            assert_eq!(r.limit, Limit::Concurrency, "{r:?}");
                            tokio::task::yield_now().await;
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("no task panicked");
    }
    let most = most_holders.load(Ordering::Relaxed);
    assert!(
        (1..=5).contains(&most),
        "at most 5 holders at once, saw {most}"
    );
    let admitted = admitted.load(Ordering::Relaxed);
    assert!(admitted > 0);
    assert_eq!(
        admitted,
        settled.load(Ordering::Relaxed),
        "every admission settled"
    );
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

// === settlement arithmetic ===

/// Reserve 60, settle for 20: the bucket ends 20 lower than before the reservation.
async fn settlement_refunds_unused(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("settle-refund"), limits(TPM, None, 10));
    // Start below capacity so that the level is not held down by the cap.
    let drain = admit(&*ledger, &pool, l, 300).await;
    settle(&*ledger, drain, 300).await;
    let start = Instant::now();
    let before = snapshot(&*ledger, &pool, l).await.tokens_available;
    let r = admit(&*ledger, &pool, l, 60).await;
    let during = snapshot(&*ledger, &pool, l).await;
    assert_level(
        during.tokens_available,
        before - 60,
        start,
        "while reserved",
    );
    assert_eq!((during.reserved_tokens, during.in_flight_requests), (60, 1));
    settle(&*ledger, r, 20).await;
    let after = snapshot(&*ledger, &pool, l).await;
    assert_level(
        after.tokens_available,
        before - 20,
        start,
        "after settling 60 for 20",
    );
    assert_idle(&after);
}

/// Settling for more than was reserved debits the excess, even below zero; refill repays it.
async fn settlement_burndown_goes_negative_and_refill_repays(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("settle-burndown"), limits(TPM, None, 10));
    let drain = admit(&*ledger, &pool, l, 540).await;
    settle(&*ledger, drain, 540).await;
    let start = Instant::now();
    let before = snapshot(&*ledger, &pool, l).await.tokens_available;
    let r = admit(&*ledger, &pool, l, 60).await;
    settle(&*ledger, r, 100).await;
    let debt_seen = Instant::now();
    let after = snapshot(&*ledger, &pool, l).await;
    assert_level(
        after.tokens_available,
        before - 100,
        start,
        "after settling 60 for 100",
    );
    assert!(after.tokens_available < 0, "in debt: {after:?}");
    assert_idle(&after);
    // In debt, even one token waits for the debt to be repaid.
    let r = reject(&*ledger, &pool, l, 1).await;
    assert_eq!(r.limit, Limit::Tokens);
    assert!(r.token_deficit > 1, "{r:?}");
    let nap = Duration::from_millis(500);
    tokio::time::sleep(nap).await;
    let later = snapshot(&*ledger, &pool, l).await.tokens_available;
    let repaid = later - after.tokens_available;
    // At least the nap's refill (less one for whole-token rounding), at most the refill since
    // just before the first of the two snapshots.
    let least = (nap.as_secs_f64() * TOKENS_PER_SEC) as i64 - 1;
    assert!(
        (least..=refill_tolerance(debt_seen)).contains(&repaid),
        "refill repaid {repaid} tokens in {:?} (expected at least {least})",
        debt_seen.elapsed()
    );
}

// === rejection facts ===

/// Tokens: the deficit, a refill wait of deficit / rate, and what is in flight.
async fn rejection_facts_tokens(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("facts-tokens"), limits(TPM, None, 10));
    let held = admit(&*ledger, &pool, l, 500).await;
    let start = Instant::now();
    let r = reject(&*ledger, &pool, l, 160).await;
    assert_eq!(r.limit, Limit::Tokens);
    let tolerance = u64::try_from(refill_tolerance(start)).unwrap_or(u64::MAX);
    assert!(
        (60u64.saturating_sub(tolerance)..=60).contains(&r.token_deficit),
        "deficit {} (expected 60 less refill)",
        r.token_deficit
    );
    let wait = r.refill_wait.expect("refill makes room");
    let per_token = Duration::from_secs_f64(1.0 / TOKENS_PER_SEC);
    let projected = per_token * u32::try_from(r.token_deficit).unwrap_or(u32::MAX);
    let slack = per_token + Duration::from_millis(50);
    assert!(
        wait + slack >= projected && wait <= projected + slack,
        "refill wait {wait:?} for a deficit of {} at {TOKENS_PER_SEC}/s",
        r.token_deficit
    );
    assert_eq!((r.in_flight_tokens, r.in_flight_requests), (500, 1));
    settle(&*ledger, held, 500).await;
}

/// Concurrency: a zero refill wait (permits do not refill) and the in-flight figures.
async fn rejection_facts_concurrency(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("facts-concurrency"), limits(TPM, None, 2));
    let a = admit(&*ledger, &pool, l, 60).await;
    let b = admit(&*ledger, &pool, l, 70).await;
    let r = reject(&*ledger, &pool, l, 60).await;
    assert_eq!(r.limit, Limit::Concurrency);
    assert_eq!(r.refill_wait, Some(Duration::ZERO));
    assert_eq!((r.in_flight_tokens, r.in_flight_requests), (130, 2));
    settle(&*ledger, a, 60).await;
    settle(&*ledger, b, 70).await;
}

/// Demand above capacity: refill alone never makes room, on a full bucket too.
async fn rejection_facts_never_fits(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("facts-never-fits"), limits(TPM, None, 10));
    let r = reject(&*ledger, &pool, l, TPM + 1).await;
    assert_eq!(r.limit, Limit::Tokens);
    assert_eq!(r.refill_wait, None);
    assert_eq!(r.token_deficit, 1, "a full bucket is one token short");
    assert_eq!((r.in_flight_tokens, r.in_flight_requests), (0, 0));
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

/// Requests: the request bucket's own refill wait; when tokens and requests are both short,
/// the binding limit is the one with the longer wait.
async fn rejection_facts_requests(ledger: Arc<dyn Ledger>) {
    // Two requests per minute: one refills every 30 s.
    let (pool, l) = (pool_name("facts-requests"), limits(TPM, Some(2), 10));
    let start = Instant::now();
    let a = admit(&*ledger, &pool, l, 60).await;
    let b = admit(&*ledger, &pool, l, 500).await;
    // Tokens are short too (40 left, 60 asked: about 2 s), but requests wait about 30 s.
    let r = reject(&*ledger, &pool, l, 60).await;
    assert_eq!(r.limit, Limit::Requests, "{r:?}");
    let wait = r.refill_wait.expect("requests refill");
    let elapsed = start.elapsed();
    assert!(
        wait <= Duration::from_secs(30)
            && wait + elapsed + Duration::from_millis(50) >= Duration::from_secs(30),
        "request refill wait {wait:?} after {elapsed:?}"
    );
    assert_eq!((r.in_flight_tokens, r.in_flight_requests), (560, 2));
    settle(&*ledger, a, 60).await;
    settle(&*ledger, b, 500).await;
    // Requests still empty (about 30 s), tokens now far shorter for a big ask: tokens bind.
    let r = reject(&*ledger, &pool, l, TPM).await;
    assert_eq!(r.limit, Limit::Tokens, "{r:?}");
    assert!(
        r.refill_wait.expect("fits in time") > Duration::from_secs(30),
        "{r:?}"
    );
}

/// Concurrency and tokens both short. `Rejection::limit` is documented as "the binding limit: the
/// one with the longest projected wait", and a permit has no refill wait (zero), so tokens bind;
/// otherwise the caller is told to come back when a permit frees up, only to be turned away on
/// tokens then.
async fn rejection_binds_longest_wait_with_concurrency(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("facts-both"), limits(TPM, None, 1));
    let held = admit(&*ledger, &pool, l, 580).await;
    let r = reject(&*ledger, &pool, l, 60).await;
    settle(&*ledger, held, 580).await;
    assert_eq!(r.limit, Limit::Tokens, "{r:?}");
    assert!(
        r.refill_wait.is_some_and(|w| w > Duration::from_secs(3)),
        "{r:?}"
    );
}

// === limits travel with each call ===

/// Shrinking `tokens_per_minute` clamps the level to the new capacity.
async fn limits_shrink_clamps_level(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("limits-shrink");
    let wide = limits(TPM, None, 10);
    let full = snapshot(&*ledger, &pool, wide).await;
    assert_eq!((full.tokens_available, full.tokens_capacity), (600, 600));
    let narrow = limits(120, None, 10);
    let s = snapshot(&*ledger, &pool, narrow).await;
    assert_eq!(
        (s.tokens_available, s.tokens_capacity),
        (120, 120),
        "clamped"
    );
    let r = reject(&*ledger, &pool, narrow, 121).await;
    assert_eq!(r.refill_wait, None, "above the new capacity");
    let r = admit(&*ledger, &pool, narrow, 120).await;
    settle(&*ledger, r, 120).await;
}

/// Raising `tokens_per_minute` raises the capacity, not the level: no burst is credited.
async fn limits_raise_credits_no_burst(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("limits-raise"), limits(TPM, None, 10));
    let drain = admit(&*ledger, &pool, l, 540).await;
    settle(&*ledger, drain, 540).await;
    let start = Instant::now();
    let before = snapshot(&*ledger, &pool, l).await.tokens_available;
    let raised = limits(2 * TPM, None, 10);
    let s = snapshot(&*ledger, &pool, raised).await;
    assert_eq!(s.tokens_capacity, 2 * TPM);
    // Refill runs at up to the raised rate (20 per second) after the raise.
    let tolerance = 2 * refill_tolerance(start);
    assert!(
        (before..=before + tolerance).contains(&s.tokens_available),
        "level {} after raising, was {before}",
        s.tokens_available
    );
    let r = reject(&*ledger, &pool, raised, 300).await;
    assert_eq!(r.limit, Limit::Tokens);
}

/// Raising `max_concurrency` between calls admits more at once.
async fn limits_raise_concurrency(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("limits-concurrency");
    let (two, three) = (limits(TPM, None, 2), limits(TPM, None, 3));
    let a = admit(&*ledger, &pool, two, 60).await;
    let b = admit(&*ledger, &pool, two, 60).await;
    assert_eq!(
        reject(&*ledger, &pool, two, 60).await.limit,
        Limit::Concurrency
    );
    let c = admit(&*ledger, &pool, three, 60).await;
    assert_eq!(
        reject(&*ledger, &pool, three, 60).await.limit,
        Limit::Concurrency
    );
    // Lowering it again turns away new requests without touching those in flight.
    let r = reject(&*ledger, &pool, two, 60).await;
    assert_eq!((r.limit, r.in_flight_requests), (Limit::Concurrency, 3));
    for r in [a, b, c] {
        settle(&*ledger, r, 60).await;
    }
    assert_idle(&snapshot(&*ledger, &pool, two).await);
}

// === route shares ===

fn route(name: &str, priority: i32, min_share: f64, max_share: Option<f64>) -> RouteShare {
    RouteShare {
        route: Arc::from(name),
        priority,
        min_share,
        max_share,
        recovery_share: 0.0,
    }
}

/// No retry reserve, no priority margin, routes active for a minute after they ask.
fn share_request(routes: &[RouteShare], caller: usize) -> ShareRequest {
    ShareRequest {
        routes: routes.into(),
        caller,
        retry: false,
        retry_reserve: 0.0,
        priority_margin: 0.0,
        idle: Duration::from_secs(60),
    }
}

async fn reserve_as(ledger: &dyn Ledger, pool: &str, tokens: u64, share: &ShareRequest) -> Verdict {
    ledger
        .reserve(&ReserveRequest {
            pool,
            limits: limits(TPM, None, 100),
            tokens,
            share: Some(share),
            hold_back: 0,
        })
        .await
        .expect("ledger reachable")
}

async fn admit_as(
    ledger: &dyn Ledger,
    pool: &str,
    tokens: u64,
    share: &ShareRequest,
) -> Reservation {
    match reserve_as(ledger, pool, tokens, share).await {
        Verdict::Granted(r) => r,
        Verdict::Refused(r) => panic!("expected {tokens} tokens admitted, got {r:?}"),
    }
}

async fn reject_as(
    ledger: &dyn Ledger,
    pool: &str,
    tokens: u64,
    share: &ShareRequest,
) -> Rejection {
    match reserve_as(ledger, pool, tokens, share).await {
        Verdict::Refused(r) => r,
        Verdict::Granted(r) => {
            let id = r.id();
            ledger.settle(r, 0).await.expect("settle");
            panic!("expected {tokens} tokens rejected, but reservation {id} was admitted")
        }
    }
}

/// Triage (guaranteed half the pool) has asked; backlog borrows only what leaves triage's unused
/// guarantee free, and triage is admitted into what backlog could not take.
async fn shares_guarantee_is_protected_from_borrowers(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("shares-guarantee");
    let routes = [
        route("triage", 10, 0.5, None),
        route("backlog", 0, 0.0, None),
    ];
    let (triage, backlog) = (share_request(&routes, 0), share_request(&routes, 1));
    let first = admit_as(&*ledger, &pool, 10, &triage).await;
    assert_eq!(
        first.share().map(|h| h.guaranteed),
        Some(10),
        "taken from the guarantee"
    );
    settle(&*ledger, first, 10).await;
    // Bucket 590, triage's unused guarantee 290: backlog may take 590 - 290 = 300.
    let borrowed = admit_as(&*ledger, &pool, 250, &backlog).await;
    assert_eq!(borrowed.share().map(|h| h.guaranteed), Some(0));
    let refused = reject_as(&*ledger, &pool, 100, &backlog).await;
    assert_eq!(refused.limit, Limit::Tokens);
    assert!(
        refused.token_deficit >= 40,
        "must leave triage's guarantee: {refused:?}"
    );
    let owner = admit_as(&*ledger, &pool, 290, &triage).await;
    settle(&*ledger, owner, 290).await;
    settle(&*ledger, borrowed, 250).await;
    assert_idle(&snapshot(&*ledger, &pool, limits(TPM, None, 100)).await);
}

/// A route that has not asked within `idle` lends its whole guarantee.
async fn shares_idle_guarantees_are_lent(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("shares-idle");
    let routes = [
        route("triage", 10, 0.5, None),
        route("backlog", 0, 0.0, None),
    ];
    let mut triage = share_request(&routes, 0);
    let mut backlog = share_request(&routes, 1);
    triage.idle = Duration::ZERO;
    backlog.idle = Duration::ZERO;
    let first = admit_as(&*ledger, &pool, 10, &triage).await;
    settle(&*ledger, first, 10).await;
    let all = admit_as(&*ledger, &pool, 580, &backlog).await;
    settle(&*ledger, all, 580).await;
}

/// `max_share` 0.25 of 600: 150 tokens per minute at most, refilling at 2.5 per second.
async fn shares_ceiling_binds_with_its_own_refill(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("shares-ceiling");
    let routes = [
        route("batch", 0, 0.0, Some(0.25)),
        route("app", 0, 0.0, None),
    ];
    let batch = share_request(&routes, 0);
    let held = admit_as(&*ledger, &pool, 100, &batch).await;
    let refused = reject_as(&*ledger, &pool, 100, &batch).await;
    assert_eq!(refused.limit, Limit::Share);
    assert!((49..=50).contains(&refused.token_deficit), "{refused:?}");
    let wait = refused.refill_wait.expect("the ceiling refills");
    assert!(
        (Duration::from_secs(19)..=Duration::from_secs(20)).contains(&wait),
        "50 tokens at 2.5 per second: {wait:?}"
    );
    // The pool itself still has room for other routes.
    let other = admit_as(&*ledger, &pool, 300, &share_request(&routes, 1)).await;
    settle(&*ledger, other, 0).await;
    settle(&*ledger, held, 0).await;
    let again = admit_as(&*ledger, &pool, 140, &batch).await;
    settle(&*ledger, again, 0).await;
}

/// A reserve of 0.2 (120 tokens) that first attempts leave alone, and a recovery budget of 0.1
/// (60 tokens per minute) for the route's retries.
async fn shares_retries_use_the_reserve_within_the_budget(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("shares-retry");
    let mut routes = [route("app", 0, 0.0, None)];
    routes[0].recovery_share = 0.1;
    let mut first = share_request(&routes, 0);
    first.retry_reserve = 0.2;
    let mut retry = first.clone();
    retry.retry = true;
    assert_eq!(
        reject_as(&*ledger, &pool, 500, &first).await.limit,
        Limit::Tokens
    );
    let bulk = admit_as(&*ledger, &pool, 480, &first).await;
    assert_eq!(bulk.share().map(|h| h.recovered), Some(false));
    // 120 left: only the reserve. A first attempt cannot have it; a retry can.
    reject_as(&*ledger, &pool, 10, &first).await;
    let recovering = admit_as(&*ledger, &pool, 50, &retry).await;
    assert_eq!(recovering.share().map(|h| h.recovered), Some(true));
    // The budget has 10 left: the next retry of 50 waits like a first attempt.
    reject_as(&*ledger, &pool, 50, &retry).await;
    settle(&*ledger, recovering, 50).await;
    settle(&*ledger, bulk, 480).await;
    assert_idle(&snapshot(&*ledger, &pool, limits(TPM, None, 100)).await);
}

/// `hold_back` tokens (charges expected but not settled) must stay in the bucket.
async fn hold_back_stays_in_the_bucket(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("hold-back");
    let l = limits(TPM, None, 10);
    let request = |tokens, hold_back| ReserveRequest {
        pool: &pool,
        limits: l,
        tokens,
        share: None,
        hold_back,
    };
    let refused = match ledger.reserve(&request(500, 200)).await.expect("ledger") {
        Verdict::Refused(r) => r,
        Verdict::Granted(r) => panic!("500 + 200 held back cannot fit 600: {r:?}"),
    };
    assert_eq!(refused.limit, Limit::Tokens);
    assert_eq!(refused.token_deficit, 100);
    let fits = match ledger.reserve(&request(400, 200)).await.expect("ledger") {
        Verdict::Granted(r) => r,
        Verdict::Refused(r) => panic!("400 + 200 fits 600: {r:?}"),
    };
    settle(&*ledger, fits, 0).await;
    assert_idle(&snapshot(&*ledger, &pool, l).await);
}

// === the transit hold ===

/// From a full bucket, refill restarts 100 ms after the reservation (the request's transit to
/// upstream, whose own full bucket refills nothing until it arrives). At 600,000 tokens per
/// minute (10 a millisecond), a bucket emptied at `T` holds `10 x (t - T - 100 ms)` tokens at
/// `t`: the snapshot is checked against that, with `T` and `t` bounded by clocks read around
/// the calls. Only an attempt whose two calls took under 50 ms together can tell a hold of
/// 100 ms from none, so slower attempts are repeated on a fresh pool.
async fn refill_after_a_full_bucket_waits_for_transit(ledger: Arc<dyn Ledger>) {
    const TPM: u64 = 600_000;
    const PER_MS: i64 = 10;
    let hold = Duration::from_millis(100);
    let l = limits(TPM, None, 10);
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    for attempt in 0..10 {
        let pool = pool_name(&format!("transit-{attempt}"));
        let before_admit = Instant::now();
        let all = admit(&*ledger, &pool, l, TPM).await;
        let after_admit = Instant::now();
        let early = snapshot(&*ledger, &pool, l).await.tokens_available;
        let early_read = Instant::now();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let before_read = Instant::now();
        let late = snapshot(&*ledger, &pool, l).await.tokens_available;
        let after_read = Instant::now();
        settle(&*ledger, all, TPM).await;
        // Refill since the hold ended, as bounded by the clocks around the calls (a token of
        // rounding either way: Redis counts whole milliseconds).
        let least = PER_MS * ms(before_read.saturating_duration_since(after_admit + hold)) - PER_MS;
        let most = PER_MS * ms(after_read.saturating_duration_since(before_admit + hold)) + PER_MS;
        assert!(
            (least..=most).contains(&late),
            "{late} tokens {:?} after taking the whole bucket: refill from 100 ms after, \
             {least}..={most}",
            before_read - after_admit
        );
        if early_read - before_admit < hold {
            assert_eq!(early, 0, "nothing refills while the request is in transit");
        }
        if after_read - before_admit < before_read - after_admit + Duration::from_millis(50) {
            return;
        }
    }
    panic!("no attempt made its ledger calls within 50 ms: the machine is too slow to tell");
}

// === daily quotas ===

/// A day of `tpd` tokens on the contract's minute limits: refill of `tpd / 86,400` a second.
fn daily(tpd: u64) -> Limits {
    Limits {
        tokens_per_day: Some(tpd),
        ..limits(TPM, Some(100), 4)
    }
}

/// `wait` is `expected` less at most the time since `since` (refill meanwhile) and a tick.
fn assert_wait(wait: Option<Duration>, expected: Duration, since: Instant, what: &str) {
    let wait = wait.unwrap_or_else(|| panic!("{what}: refill makes room"));
    let low = expected.saturating_sub(since.elapsed() + Duration::from_secs(1));
    assert!(
        (low..=expected).contains(&wait),
        "{what}: wait {wait:?}, expected {low:?}..={expected:?}"
    );
}

/// The day binds where the minute bucket would admit: nothing is taken, and the wait is the
/// day's refill (500 tokens a day: one every 172.8 s).
async fn daily_quota_binds_in_the_same_step_and_takes_nothing_else(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("daily-binds"), daily(500));
    let start = Instant::now();
    let held = admit(&*ledger, &pool, l, 300).await;
    let before = snapshot(&*ledger, &pool, l).await;
    assert_eq!(
        (before.day_tokens_available, before.day_tokens_capacity),
        (Some(200), Some(500))
    );
    let r = reject(&*ledger, &pool, l, 300).await;
    assert_eq!((r.limit, r.token_deficit), (Limit::DailyQuota, 100));
    assert_eq!((r.in_flight_tokens, r.in_flight_requests), (300, 1));
    // 100 tokens at 500 a day: 17,280 s.
    assert_wait(
        r.refill_wait,
        Duration::from_secs(17_280),
        start,
        "daily wait",
    );
    let after = snapshot(&*ledger, &pool, l).await;
    assert_level(
        after.tokens_available,
        before.tokens_available,
        start,
        "minute bucket untouched",
    );
    assert_eq!(
        after.requests_available, before.requests_available,
        "no request taken"
    );
    assert_eq!(after.in_flight_requests, 1, "no permit taken");
    assert_eq!(after.day_tokens_available, Some(200));
    // Full again when the 300 taken have refilled: 51,840 s.
    let full_in = Duration::from_millis(after.day_full_in_ms.expect("a daily bucket"));
    assert_wait(Some(full_in), Duration::from_secs(51_840), start, "full in");
    // More than the day holds never fits by refill.
    let never = reject(&*ledger, &pool, l, 501).await;
    assert_eq!((never.limit, never.refill_wait), (Limit::DailyQuota, None));
    // What fits the day is admitted.
    let small = admit(&*ledger, &pool, l, 200).await;
    settle(&*ledger, small, 200).await;
    settle(&*ledger, held, 300).await;
    let end = snapshot(&*ledger, &pool, l).await;
    assert_idle(&end);
    assert_eq!(end.day_tokens_available, Some(0));
}

/// Settlement credits the day what was not used and debits a charge above the reservation.
async fn daily_quota_settles_refunds_and_debts(ledger: Arc<dyn Ledger>) {
    let (pool, l) = (pool_name("daily-settles"), daily(1_000));
    let r = admit(&*ledger, &pool, l, 400).await;
    settle(&*ledger, r, 100).await;
    assert_eq!(
        snapshot(&*ledger, &pool, l).await.day_tokens_available,
        Some(900)
    );
    let r = admit(&*ledger, &pool, l, 100).await;
    settle(&*ledger, r, 1_150).await;
    let s = snapshot(&*ledger, &pool, l).await;
    assert_eq!(s.day_tokens_available, Some(-250), "a burndown debt");
    let r = reject(&*ledger, &pool, l, 1).await;
    assert_eq!(r.limit, Limit::DailyQuota);
    assert_idle(&s);
}

/// No daily quota, no daily bucket; a lowered quota clamps the level, a raised one credits no
/// burst.
async fn daily_quota_follows_its_limit(ledger: Arc<dyn Ledger>) {
    let pool = pool_name("daily-limits");
    let none = limits(TPM, None, 4);
    let s = snapshot(&*ledger, &pool, none).await;
    assert_eq!(
        (
            s.day_tokens_available,
            s.day_tokens_capacity,
            s.day_full_in_ms
        ),
        (None, None, None)
    );
    let r = admit(&*ledger, &pool, daily(2_000), 500).await;
    settle(&*ledger, r, 500).await;
    assert_eq!(
        snapshot(&*ledger, &pool, daily(2_000))
            .await
            .day_tokens_available,
        Some(1_500)
    );
    // Lowered below the level: clamped to the new capacity.
    let s = snapshot(&*ledger, &pool, daily(1_000)).await;
    assert_eq!(
        (s.day_tokens_available, s.day_tokens_capacity),
        (Some(1_000), Some(1_000))
    );
    // Raised: the level stays, refill continues at the new rate.
    let s = snapshot(&*ledger, &pool, daily(5_000)).await;
    assert_eq!(
        (s.day_tokens_available, s.day_tokens_capacity),
        (Some(1_000), Some(5_000))
    );
    assert_eq!(
        reject(&*ledger, &pool, daily(5_000), 1_001).await.limit,
        Limit::DailyQuota
    );
}

// === budgets ===

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 86_400_000;

fn window(name: &'static str, capacity: u64, window_ms: u64) -> BudgetWindow {
    BudgetWindow {
        name,
        capacity,
        window_ms,
    }
}

async fn take_budget(
    ledger: &dyn Ledger,
    scope: &str,
    windows: &[BudgetWindow],
    tokens: u64,
) -> BudgetVerdict {
    let request = BudgetRequest {
        scope,
        windows,
        tokens,
    };
    ledger
        .take_budget(&request)
        .await
        .expect("ledger reachable")
}

async fn settle_budget(
    ledger: &dyn Ledger,
    scope: &str,
    windows: &[BudgetWindow],
    (tokens, charged): (u64, u64),
    verdict: BudgetVerdict,
) {
    let BudgetVerdict::Taken(origin) = verdict else {
        panic!("expected the budget taken, got {verdict:?}");
    };
    let request = BudgetRequest {
        scope,
        windows,
        tokens,
    };
    ledger
        .settle_budget(&request, origin, charged)
        .await
        .expect("settles");
}

async fn available(ledger: &dyn Ledger, scope: &str, windows: &[BudgetWindow]) -> Vec<i64> {
    let snapshot = ledger
        .budget_snapshot(scope, windows)
        .await
        .expect("snapshot");
    snapshot.iter().map(|w| w.available).collect()
}

/// A take that one window cannot hold takes nothing from the others, and names that window with
/// the wait to the tick that makes room.
async fn budget_takes_every_window_or_none(ledger: Arc<dyn Ledger>) {
    let scope = pool_name("budget-all");
    let windows = [
        window("tokens_per_hour", 3_600, HOUR_MS),
        window("tokens_per_day", 500, DAY_MS),
    ];
    let start = Instant::now();
    let first = take_budget(&*ledger, &scope, &windows, 300).await;
    assert_eq!(available(&*ledger, &scope, &windows).await, [3_300, 200]);
    let BudgetVerdict::Refused(r) = take_budget(&*ledger, &scope, &windows, 300).await else {
        panic!("the day holds 200");
    };
    assert_eq!((r.window, r.deficit), ("tokens_per_day", 100));
    assert_wait(r.wait, Duration::from_secs(17_280), start, "budget wait");
    assert_eq!(
        available(&*ledger, &scope, &windows).await[0],
        3_300,
        "the hour untouched (it refills a token a second: none within the case)"
    );
    // More than a window holds: that window binds, never by refill.
    let BudgetVerdict::Refused(never) = take_budget(&*ledger, &scope, &windows, 3_601).await else {
        panic!("more than the hour holds");
    };
    assert_eq!((never.window, never.wait), ("tokens_per_hour", None));
    settle_budget(&*ledger, &scope, &windows, (300, 300), first).await;
}

/// Settlement credits back what was not used, debits more, and a give-back (charged 0) returns
/// everything.
async fn budget_settles_and_gives_back(ledger: Arc<dyn Ledger>) {
    let scope = pool_name("budget-settle");
    let windows = [window("tokens_per_day", 1_000, DAY_MS)];
    let taken = take_budget(&*ledger, &scope, &windows, 400).await;
    settle_budget(&*ledger, &scope, &windows, (400, 0), taken).await;
    assert_eq!(available(&*ledger, &scope, &windows).await, [1_000]);
    let taken = take_budget(&*ledger, &scope, &windows, 400).await;
    settle_budget(&*ledger, &scope, &windows, (400, 100), taken).await;
    assert_eq!(available(&*ledger, &scope, &windows).await, [900]);
    let taken = take_budget(&*ledger, &scope, &windows, 100).await;
    settle_budget(&*ledger, &scope, &windows, (100, 1_200), taken).await;
    assert_eq!(
        available(&*ledger, &scope, &windows).await,
        [-300],
        "a debt"
    );
    assert!(matches!(
        take_budget(&*ledger, &scope, &windows, 1).await,
        BudgetVerdict::Refused(_)
    ));
}

/// A lowered capacity clamps, a window dropped from the config is forgotten (and starts full
/// when it comes back), a window whose length changes starts full; scopes are independent.
async fn budget_windows_follow_their_config(ledger: Arc<dyn Ledger>) {
    let scope = pool_name("budget-config");
    let day = [window("tokens_per_day", 2_000, DAY_MS)];
    let taken = take_budget(&*ledger, &scope, &day, 500).await;
    settle_budget(&*ledger, &scope, &day, (500, 500), taken).await;
    assert_eq!(available(&*ledger, &scope, &day).await, [1_500]);
    let lowered = [window("tokens_per_day", 1_000, DAY_MS)];
    assert_eq!(available(&*ledger, &scope, &lowered).await, [1_000]);
    let other = pool_name("budget-config-other");
    assert_eq!(
        available(&*ledger, &other, &day).await,
        [2_000],
        "another scope"
    );
    let hour = [window("tokens_per_hour", 100, HOUR_MS)];
    assert_eq!(available(&*ledger, &scope, &hour).await, [100]);
    assert_eq!(
        available(&*ledger, &scope, &day).await,
        [2_000],
        "the day was dropped with the config that named only the hour"
    );
    let taken = take_budget(&*ledger, &scope, &day, 700).await;
    settle_budget(&*ledger, &scope, &day, (700, 700), taken).await;
    let longer = [window("tokens_per_day", 2_000, 2 * DAY_MS)];
    assert_eq!(
        available(&*ledger, &scope, &longer).await,
        [2_000],
        "a new window length"
    );
}

// === route concurrency ===

/// How admission counts a route's `max_concurrency` (`admission/budgets.rs`): zero-token
/// reservations in a concurrency-only pool named after the route.
async fn route_concurrency_is_a_concurrency_only_pool(ledger: Arc<dyn Ledger>) {
    let pool = format!("route:{}", pool_name("route-slots"));
    let slots = |n| Limits {
        tokens_per_minute: 1,
        requests_per_minute: None,
        max_concurrency: n,
        tokens_per_day: None,
    };
    let a = admit(&*ledger, &pool, slots(2), 0).await;
    let b = admit(&*ledger, &pool, slots(2), 0).await;
    let r = reject(&*ledger, &pool, slots(2), 0).await;
    assert_eq!((r.limit, r.in_flight_requests), (Limit::Concurrency, 2));
    settle(&*ledger, a, 0).await;
    let c = admit(&*ledger, &pool, slots(2), 0).await;
    // Raised on a reload: a third fits at once.
    let d = admit(&*ledger, &pool, slots(3), 0).await;
    for held in [b, c, d] {
        settle(&*ledger, held, 0).await;
    }
    let s = snapshot(&*ledger, &pool, slots(3)).await;
    assert_idle(&s);
    assert_eq!(s.tokens_available, 1, "no token ever taken");
}
