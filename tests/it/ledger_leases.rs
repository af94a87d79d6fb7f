//! Local capacity leases (`ledger::lease`): what slices of more than one request may change, and
//! (Over 500 lines: the property run and the Redis scenarios share the helpers here.)
//! what they never may. (The contract suite runs on the leased ledger too, and the differential
//! test holds one-request slices to the memory ledger's answers exactly.)
//!
//! - **Never more than the exact bucket**: a property test drives the leased Redis ledger through
//!   the differential test's random operations (hold-backs and retries among them, which slices
//!   decide when they cover them); each grant is replayed on a memory ledger at the
//!   same instant, which must grant it too (else the slices over-admitted), and every snapshot
//!   must show the same reservations in flight and no more requests than the memory ledger
//!   holds, nor more tokens beyond the one bound the module docs leave open (a transit's refill).
//! - **Several replicas on one Redis**, hammered at once, never grant more than the bucket held
//!   plus its refill over the elapsed Redis time, and most decisions take no round trip.
//! - **A dead replica's slice expires**: its permits come back at the lease's end, its tokens stay
//!   charged.
//! - Slices go back when idle and at shutdown; an unreachable Redis is an error, or the local share
//!   with `on_error = "local"`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use proptest::{
    strategy::Strategy,
    test_runner::{Config, TestCaseError, TestRunner},
};
use tokengate::ledger::{
    Clock, FallbackLedger, LeaseCounts, LeaseOptions, LeasedLedger, Ledger, Limits, MemoryLedger,
    Origin, PoolSnapshot, RedisLedger, RedisOptions, Reservation, ReserveRequest, RouteShare,
    Verdict,
};

use crate::{
    common::redis_server::RedisServer,
    ledger_differential::{Case, Op, case, permille_of},
};

fn pool_name(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("leases-{what}-{}-{nanos}", std::process::id())
}

fn options(server: &RedisServer, lease: Duration) -> RedisOptions {
    RedisOptions {
        url: server.url(),
        timeout: Duration::from_secs(5),
        lease,
    }
}

async fn leased(server: &RedisServer, leases: LeaseOptions) -> LeasedLedger {
    let shared = RedisLedger::connect(options(server, Duration::from_secs(60)))
        .await
        .expect("redis ledger");
    LeasedLedger::new(shared, leases)
}

fn request(pool: &str, limits: Limits, tokens: u64) -> ReserveRequest<'_> {
    ReserveRequest {
        pool,
        limits,
        tokens,
        share: None,
        hold_back: 0,
    }
}

fn limits(tokens_per_minute: u64, max_concurrency: u32) -> Limits {
    Limits {
        tokens_per_minute,
        requests_per_minute: None,
        max_concurrency,
        tokens_per_day: None,
    }
}

async fn admit(ledger: &dyn Ledger, request: &ReserveRequest<'_>) -> Reservation {
    match ledger.reserve(request).await.expect("ledger answers") {
        Verdict::Granted(r) => r,
        Verdict::Refused(r) => panic!("expected a grant, got {r:?}"),
    }
}

async fn snapshot(ledger: &dyn Ledger, pool: &str, limits: Limits) -> PoolSnapshot {
    ledger.snapshot(pool, &limits).await.expect("snapshot")
}

// === never more than the exact bucket ===

/// What the property run covered: grants, refusals, snapshots, and the grants with a hold-back
/// and of retries decided in the slice with no round trip.
#[derive(Debug, Default)]
struct Tally {
    granted: AtomicU64,
    refused: AtomicU64,
    snapshots: AtomicU64,
    in_slice: AtomicU64,
    held_back_in_slice: AtomicU64,
    retries_in_slice: AtomicU64,
}

impl Tally {
    /// Counts a grant of `request` decided in the slice, from the ledger's counts before it.
    fn in_slice(&self, request: &ReserveRequest<'_>, before: LeaseCounts, after: LeaseCounts) {
        if after.from_slices == before.from_slices || after.slice_calls != before.slice_calls {
            return;
        }
        self.in_slice.fetch_add(1, Ordering::Relaxed);
        if request.hold_back > 0 {
            self.held_back_in_slice.fetch_add(1, Ordering::Relaxed);
        }
        if request.share.is_some_and(|s| s.retry) {
            self.retries_in_slice.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn shadow_step(
    leased: &LeasedLedger,
    exact: &MemoryLedger,
    clock: &Clock,
    (pool, case, op): (&str, &Case, &Op),
    held: &mut Vec<(Reservation, Reservation)>,
    tally: &Tally,
) -> Result<(), TestCaseError> {
    match *op {
        Op::Reserve {
            limits,
            routes,
            permille,
            caller,
            hold_back_permille,
        } => {
            let limits = case.limits[limits];
            // Shares with guarantees, ceilings or priorities to weigh are decided in Redis alone,
            // and weigh which routes asked lately: Redis learns of a route's asks from slices
            // only when it takes one, so across a reload from plain shares to weighed ones it
            // may lend an active route's guarantee for a moment (see `ledger::lease`). Here
            // the shares are plain ones (slices decide them) or none.
            let share = case.share(routes, caller).filter(|s| {
                s.routes
                    .iter()
                    .all(|r| r.min_share == 0.0 && r.max_share.is_none())
            });
            // The hold-back: the case's arbitrary one where it has one, else as admission's, the
            // excess expected of the reservations in flight (a fifth of them here, as a stream
            // whose output costs 5 per token adds to it).
            let in_flight: u64 = held.iter().map(|(r, _)| r.tokens()).sum();
            let hold_back = match hold_back_permille {
                0 => in_flight / 5,
                p => limits.tokens_per_minute * p / 1_000,
            };
            let request = ReserveRequest {
                pool,
                limits,
                tokens: permille_of(&limits, permille),
                share: share.as_ref(),
                hold_back,
            };
            let before = leased.counts();
            match leased.reserve(&request).await.expect("redis answers") {
                Verdict::Granted(r) => match exact.reserve(&request).await.expect("memory") {
                    Verdict::Granted(m) => {
                        tally.granted.fetch_add(1, Ordering::Relaxed);
                        tally.in_slice(&request, before, leased.counts());
                        held.push((r, m));
                    }
                    Verdict::Refused(m) => {
                        leased.settle(r, 0).await.expect("settles");
                        return Err(TestCaseError::fail(format!(
                            "over-admission: the slices granted {request:?}, the exact bucket refuses: {m:?}"
                        )));
                    }
                },
                Verdict::Refused(_) => {
                    // A refusal takes nothing, but the limits it carried apply from now on
                    // (a snapshot applies them in the exact bucket too).
                    snapshot(exact, pool, limits).await;
                    tally.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Op::Settle { pick, charge_pct } if !held.is_empty() => {
            let (r, m) = held.swap_remove(pick % held.len());
            let charge = r.tokens() * charge_pct / 100;
            leased.settle(r, charge).await.expect("settles");
            exact.settle(m, charge).await.expect("settles");
        }
        Op::Advance { ms } => clock.advance(Duration::from_millis(ms)),
        Op::Snapshot { limits } => {
            let limits = case.limits[limits];
            let (l, m) = (
                snapshot(leased, pool, limits).await,
                snapshot(exact, pool, limits).await,
            );
            tally.snapshots.fetch_add(1, Ordering::Relaxed);
            proptest::prop_assert_eq!(
                (l.reserved_tokens, l.in_flight_requests),
                (m.reserved_tokens, m.in_flight_requests),
                "the same reservations in flight"
            );
            proptest::prop_assert!(
                l.tokens_available <= m.tokens_available + transit_refill(&limits),
                "slices hold no more tokens than the exact bucket: {l:?} {m:?}"
            );
            proptest::prop_assert!(
                l.requests_available <= m.requests_available,
                "nor requests: {l:?} {m:?}"
            );
        }
        _ => {}
    }
    Ok(())
}

/// `routes` with no guarantee, ceiling or priority to weigh: their retry reserve and recovery
/// stay.
fn plain(routes: &[RouteShare]) -> Arc<[RouteShare]> {
    routes
        .iter()
        .map(|r| RouteShare {
            priority: 0,
            min_share: 0.0,
            max_share: None,
            ..r.clone()
        })
        .collect()
}

/// The one bound the module docs leave open on one replica: after slices the shared level can
/// trail the exact one, and a take from a bucket just short of full then refills at once where
/// the exact bucket waits a transit (100 ms): one transit's refill, and a token of rounding.
/// Grants are held to no tolerance.
fn transit_refill(limits: &Limits) -> i64 {
    i64::try_from(limits.tokens_per_minute / 600).unwrap_or(i64::MAX) + 1
}

#[test]
fn slices_never_admit_more_than_the_exact_bucket() {
    let Some(tally) = shadow_run(case()) else {
        return;
    };
    assert!(tally.granted.load(Ordering::Relaxed) > 500, "{tally:?}");
    assert!(tally.refused.load(Ordering::Relaxed) > 100, "{tally:?}");
    assert!(tally.snapshots.load(Ordering::Relaxed) > 100, "{tally:?}");
}

/// The same with the traffic slices are for: one pool's limits and routes throughout (plain
/// shares: no guarantee, ceiling or priority, so slices decide them, retries too), 20 times the
/// concurrency (and request limit) of the cases above and no daily quota, requests of 0.1% to 15%
/// of its tokens, so that a slice holds several and the bucket still runs out; most carry a
/// hold-back (the reservations in flight make one), and many are retries. Hundreds of grants are
/// then decided in a slice with no round trip, hold-backs and retries among them.
#[test]
fn slices_never_admit_more_than_the_exact_bucket_with_small_requests_and_hold_back() {
    let small = case().prop_map(|mut case| {
        // One route configuration throughout: a reload of the routes' recovery shares is seen by
        // Redis only when a route asks there (see `ledger::lease`).
        let routes = plain(&case.routes[0]);
        case.routes = vec![routes; case.routes.len()];
        for l in &mut case.limits {
            l.max_concurrency *= 20;
            l.requests_per_minute = l.requests_per_minute.map(|r| r * 20);
            l.tokens_per_day = None;
        }
        for op in &mut case.ops {
            match op {
                Op::Reserve {
                    limits, permille, ..
                } => {
                    *limits = 0;
                    *permille = *permille % 150 + 1;
                }
                Op::Snapshot { limits } => *limits = 0,
                _ => {}
            }
        }
        case
    });
    let Some(tally) = shadow_run(small) else {
        return;
    };
    let count = |n: &AtomicU64| n.load(Ordering::Relaxed);
    assert!(count(&tally.granted) > 1_000, "{tally:?}");
    assert!(count(&tally.refused) > 100, "the bucket ran out: {tally:?}");
    assert!(count(&tally.in_slice) > 200, "{tally:?}");
    assert!(count(&tally.held_back_in_slice) > 150, "{tally:?}");
    assert!(count(&tally.retries_in_slice) > 50, "{tally:?}");
}

/// Runs the shadow comparison on `cases` (`PROPTEST_CASES`, 256 by default); what it covered, or
/// nothing without `redis-server`.
fn shadow_run(cases: impl Strategy<Value = Case>) -> Option<Tally> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = runtime.block_on(RedisServer::start())?;
    let run = pool_name("shadow");
    let mut runner = TestRunner::new(Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(256),
        failure_persistence: None,
        ..Config::default()
    });
    let (n, tally) = (AtomicU64::new(0), Tally::default());
    let result = runner.run(&cases, |case| {
        let pool = format!("{run}-{}", n.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(async {
            let clock = Clock::manual();
            let redis = options(&server, Duration::from_secs(365 * 24 * 3600));
            let shared = RedisLedger::connect_with_clock(redis, clock.clone())
                .await
                .expect("redis ledger");
            // Slices of up to all or half of each limit, sized from real time while the test
            // clock moves in jumps: any size, any moment of giving back, must stay within.
            let max_fraction = if case.ops.len() % 2 == 0 { 1.0 } else { 0.5 };
            let leases = LeaseOptions {
                horizon: Duration::from_millis(20),
                max_fraction,
                max_age: Duration::from_millis(200),
            };
            let leased = LeasedLedger::new(shared, leases);
            let exact = MemoryLedger::new(clock.clone());
            let mut held = Vec::new();
            let mut outcome = Ok(());
            for op in &case.ops {
                outcome = shadow_step(
                    &leased,
                    &exact,
                    &clock,
                    (&pool, &case, op),
                    &mut held,
                    &tally,
                )
                .await;
                if outcome.is_err() {
                    break;
                }
            }
            for (r, m) in held.drain(..) {
                let charge = r.tokens();
                leased.settle(r, charge).await.expect("settles");
                exact.settle(m, charge).await.expect("settles");
            }
            leased.close().await;
            outcome?;
            let last = case.limits[case.limits.len() - 1];
            let (l, m) = (
                snapshot(&leased, &pool, last).await,
                snapshot(&exact, &pool, last).await,
            );
            proptest::prop_assert_eq!((l.reserved_tokens, l.in_flight_requests), (0, 0));
            proptest::prop_assert!(
                l.tokens_available <= m.tokens_available + transit_refill(&last),
                "{:?} {:?}",
                l,
                m
            );
            proptest::prop_assert_eq!(leased.live_slices(), 0, "close gave every slice back");
            proptest::prop_assert_eq!(leased.stats().unsettled_drops(), 0);
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!("{tally:?}");
    Some(tally)
}

// === several replicas, one Redis ===

/// Three replicas with slices, 8 tasks each, on one pool of 60,000 tokens a minute (1,000 a
/// second), requests of 100 tokens charged in full: what they grant together never exceeds the
/// bucket plus its refill over the Redis time the run took. (Once the bucket is empty, every
/// refusal is Redis's: slices cut round trips only while there is capacity to hand out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_one_redis_never_grant_more_than_the_bucket() {
    const TPM: u64 = 60_000;
    const TOKENS: u64 = 100;
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let pool = pool_name("replicas");
    let l = limits(TPM, 1_000);
    let leases = LeaseOptions {
        horizon: Duration::from_millis(100),
        max_fraction: 0.2,
        max_age: Duration::from_secs(1),
    };
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Arc::new(leased(&server, leases).await));
    }
    let granted = Arc::new(AtomicU64::new(0));
    let started_ms = server.time_ms().await;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1_500);
    let mut tasks = Vec::new();
    for replica in &replicas {
        for _ in 0..8 {
            let (replica, granted, pool) = (replica.clone(), granted.clone(), pool.clone());
            tasks.push(tokio::spawn(async move {
                while tokio::time::Instant::now() < deadline {
                    match replica.reserve(&request(&pool, l, TOKENS)).await {
                        Ok(Verdict::Granted(r)) => {
                            granted.fetch_add(1, Ordering::Relaxed);
                            tokio::task::yield_now().await;
                            replica.settle(r, TOKENS).await.expect("settles");
                        }
                        Ok(Verdict::Refused(_)) => tokio::task::yield_now().await,
                        Err(e) => panic!("redis answers: {e}"),
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("no task panicked");
    }
    let elapsed_ms = server.time_ms().await - started_ms;
    let granted_tokens = granted.load(Ordering::Relaxed) * TOKENS;
    let most = TPM + TPM * elapsed_ms / 60_000 + TOKENS;
    assert!(
        granted_tokens <= most,
        "granted {granted_tokens} tokens in {elapsed_ms} ms of Redis time: at most {most}"
    );
    assert!(
        granted_tokens >= TPM / 2,
        "the replicas used the quota: {granted_tokens} tokens granted"
    );
    for replica in &replicas {
        assert!(
            replica.counts().from_slices > 0,
            "every replica admitted from slices"
        );
        replica.close().await;
        assert_eq!(replica.live_slices(), 0);
        assert_eq!(replica.stats().unsettled_drops(), 0);
    }
    let s = snapshot(&*replicas[0], &pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}

/// One replica doing reserve/settle pairs: the round trips are a small part of the decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn most_decisions_take_no_round_trip() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let pool = pool_name("local");
    let l = limits(1_000_000_000, 1_000);
    let leases = LeaseOptions {
        horizon: Duration::from_millis(250),
        max_fraction: 0.1,
        max_age: Duration::from_secs(1),
    };
    let ledger = leased(&server, leases).await;
    for i in 0..10_000u64 {
        let r = admit(&ledger, &request(&pool, l, 1_000)).await;
        ledger.settle(r, i % 1_000).await.expect("settles");
    }
    let counts = ledger.counts();
    assert_eq!(counts.from_slices, 10_000);
    assert!(counts.slice_calls <= 100, "{counts:?}");
    ledger.close().await;
    let s = snapshot(&ledger, &pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}

// === expiry, idle, shutdown, outage ===

/// A replica that dies holding a slice (and a request admitted from it): the slice's permits
/// come back when its lease ends, its tokens stay charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_slice_expires_and_its_permits_return() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let pool = pool_name("dead");
    // 600 tokens a minute: 10 of refill a second.
    let l = limits(600, 4);
    let leases = LeaseOptions {
        horizon: Duration::from_secs(30),
        max_fraction: 1.0,
        max_age: Duration::from_secs(60),
    };
    let lease = Duration::from_secs(1);
    let dying = LeasedLedger::new(
        RedisLedger::connect(options(&server, lease))
            .await
            .expect("redis"),
        leases,
    );
    let first = admit(&dying, &request(&pool, l, 60)).await;
    assert_eq!(dying.live_slices(), 1);
    let other = RedisLedger::connect(options(&server, lease))
        .await
        .expect("redis");
    let before = snapshot(&other, &pool, l).await;
    let slice_tokens = before.reserved_tokens;
    assert!(
        slice_tokens > 60,
        "the slice holds more than its request: {before:?}"
    );
    assert!(
        before.in_flight_requests >= 2,
        "and more than one permit: {before:?}"
    );
    let died_ms = server.time_ms().await;
    // Dies: nothing is settled, given back or renewed again.
    std::mem::forget(first);
    drop(dying);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let after = loop {
        let s = snapshot(&other, &pool, l).await;
        if s.in_flight_requests == 0 {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slice never expired: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let refill = i64::try_from((server.time_ms().await - died_ms) / 100 + 1).expect("small");
    assert_eq!(after.reserved_tokens, 0, "{after:?}");
    let charged = 600 - i64::try_from(slice_tokens).expect("small");
    assert!(
        after.tokens_available <= before.tokens_available + refill
            && after.tokens_available <= charged + refill,
        "the slice's tokens stay charged: {after:?} (slice {slice_tokens}, before {before:?})"
    );
    // Every permit is back.
    let mut all = Vec::new();
    for _ in 0..4 {
        all.push(admit(&other, &request(&pool, l, 0)).await);
    }
    for r in all {
        other.settle(r, 0).await.expect("settles");
    }
}

/// A slice that admits nothing for `horizon` goes back by itself; `close` gives back the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_slices_go_back_and_close_gives_back_the_rest() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let (idle_pool, busy_pool) = (pool_name("idle"), pool_name("busy"));
    let l = limits(600_000, 100);
    let ledger = leased(
        &server,
        LeaseOptions {
            horizon: Duration::from_millis(50),
            max_fraction: 0.5,
            max_age: Duration::from_secs(600),
        },
    )
    .await;
    let r = admit(&ledger, &request(&idle_pool, l, 100)).await;
    ledger.settle(r, 40).await.expect("settles");
    assert_eq!(ledger.live_slices(), 1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ledger.live_slices() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle slice stayed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let other = RedisLedger::connect(options(&server, Duration::from_secs(60)))
        .await
        .expect("redis");
    let s = snapshot(&other, &idle_pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
    assert!(
        s.tokens_available >= 600_000 - 40,
        "only the charge stays taken: {s:?}"
    );

    // A slice in use goes back at close, its reservation in flight a lease of its own.
    let a = admit(&ledger, &request(&busy_pool, l, 100)).await;
    ledger.close().await;
    assert_eq!(ledger.live_slices(), 0);
    let s = snapshot(&other, &busy_pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (100, 1), "{s:?}");
    ledger.settle(a, 100).await.expect("settles in redis");
    let s = snapshot(&other, &busy_pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}

/// Redis unreachable: a slice cannot be taken, so the decision is an error (fail-closed), or with
/// `on_error = "local"` the local share's.
#[tokio::test]
async fn an_unreachable_redis_is_an_error_or_the_local_share() {
    let dir = tempfile::tempdir().expect("temp dir");
    let nobody = RedisOptions {
        url: format!("redis+unix://{}/nobody.sock", dir.path().display()),
        timeout: Duration::from_millis(200),
        lease: Duration::from_secs(60),
    };
    let leases = LeaseOptions {
        horizon: Duration::from_millis(100),
        max_fraction: 0.5,
        max_age: Duration::from_secs(1),
    };
    let pool = pool_name("outage");
    let l = limits(600_000, 100);
    let closed = LeasedLedger::new(
        RedisLedger::connect(nobody.clone()).await.expect("url"),
        leases,
    );
    let e = closed
        .reserve(&request(&pool, l, 100))
        .await
        .expect_err("no slice without Redis");
    assert!(e.message.contains("slice"), "{e}");
    let local = FallbackLedger::new(
        LeasedLedger::new(RedisLedger::connect(nobody).await.expect("url"), leases),
        Clock::tokio(),
        2,
    );
    let r = admit(&local, &request(&pool, l, 100)).await;
    assert_eq!(r.origin(), Origin::Local);
    local.settle(r, 100).await.expect("settles locally");
    assert_eq!(local.stats().unsettled_drops(), 0);
}

/// Callers that go away mid-decision (a client hanging up while its request waits for a slice,
/// here while Redis is frozen): the slice calls run to their end once Redis answers, and the
/// reservations nobody took are settled uncharged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_leaves_nothing_held() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let pool = pool_name("abandoned");
    let l = limits(600_000, 8);
    let ledger = leased(
        &server,
        LeaseOptions {
            horizon: Duration::from_millis(250),
            max_fraction: 0.5,
            max_age: Duration::from_secs(1),
        },
    )
    .await;
    let asked = request(&pool, l, 1_000);
    server.pause();
    for _ in 0..5 {
        // Polled once, then dropped: its slice call is waiting for the frozen Redis.
        let once = tokio::time::timeout(Duration::ZERO, ledger.reserve(&asked));
        assert!(once.await.is_err(), "no decision while Redis is frozen");
    }
    server.resume();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = snapshot(&ledger, &pool, l).await;
        if (s.reserved_tokens, s.in_flight_requests) == (0, 0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "still held: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        ledger.counts().from_slices >= 1,
        "the abandoned calls were admitted"
    );
    ledger.close().await;
    let other = RedisLedger::connect(options(&server, Duration::from_secs(60)))
        .await
        .expect("redis");
    let s = snapshot(&other, &pool, l).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
    assert_eq!(s.tokens_available, 600_000, "everything given back: {s:?}");
    assert_eq!(ledger.stats().unsettled_drops(), 0);
}
