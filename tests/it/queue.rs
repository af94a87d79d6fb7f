//! The admission queue through `Admission::decide`, on tokio's paused clock: waiters are admitted
//! the moment a settlement frees room, rejected at once when their projected wait is too long,
//! answered with a hint when their wait runs out, and leave nothing behind when they go.
//! End to end elsewhere: a raw-TCP client that hangs up while queued (`tests/client_faults.rs`),
//! shutdown with calls queued (`tests/lifecycle.rs`), a saturating SDK fleet
//! (`tests/queue_fleet.rs`).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use tokengate::{
    admission::{Admission, Decision, Facts, Hold},
    bedrock::Operation,
    config::Config,
    ledger::{Clock, MemoryLedger},
};
use tokio::time::Instant;

fn admission(pool: &str) -> Arc<Admission> {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\
         [[pools]]\nname = \"p\"\nmodels = [\"m.x\"]\noutput_burndown = 1\nmax_output_tokens = 10\ndefault_max_tokens = 10\n{pool}"
    );
    let config = Config::parse(&text).expect("config");
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    Arc::new(Admission::new(
        &config.policy.pools,
        &config.policy.routes,
        config.policy.admission,
        ledger,
    ))
}

/// A Converse body reserving `max_tokens` plus a small input estimate.
fn body(max_tokens: u64) -> Bytes {
    Bytes::from(format!(
        r#"{{"messages":[{{"role":"user","content":[{{"text":"x"}}]}}],"inferenceConfig":{{"maxTokens":{max_tokens}}}}}"#
    ))
}

/// A refusal, as the client gets it.
#[derive(Debug)]
struct Refused(axum::response::Response);

impl Refused {
    fn header(&self, name: &str) -> Option<&str> {
        self.0.headers().get(name).and_then(|v| v.to_str().ok())
    }

    fn is_throttle(&self) -> bool {
        self.0.status() == 429 && self.header("x-amzn-errortype") == Some("ThrottlingException")
    }
}

async fn admit(adm: &Admission, max_tokens: u64) -> Result<Hold, Refused> {
    let caller = adm.first_route_caller();
    let decision = adm
        .decide(&Facts {
            operation: Operation::Converse,
            model_id: Some("m.x"),
            body: &body(max_tokens),
            read: None,
            caller: &caller,
            service_tier: None,
            endpoint: None,
        })
        .await;
    match decision {
        Decision::Admit(a) => Ok(a.hold),
        refused => Err(Refused(
            tokengate::answer::refusal(&refused, Operation::Converse)
                .expect("a refusal has an answer"),
        )),
    }
}

async fn assert_zero(adm: &Admission) {
    let state = &adm.pool_views().await[0];
    let ledger = state.ledger.as_ref().expect("ledger");
    assert_eq!(
        (
            ledger.reserved_tokens,
            ledger.in_flight_requests,
            state.queue.depth
        ),
        (0, 0, 0)
    );
    assert_eq!(adm.ledger().stats().unsettled_drops(), 0);
}

fn hint_ms(e: &Refused) -> u64 {
    e.header("x-amz-retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a retry hint")
}

#[tokio::test(start_paused = true)]
async fn a_waiter_is_admitted_the_moment_a_settlement_frees_room() {
    let adm = admission("tokens_per_minute = 1000000\nmax_concurrency = 1\nmax_wait_ms = 5000\n");
    let mut first = admit(&adm, 100).await.expect("first admitted");
    let start = Instant::now();
    let waiting = tokio::spawn({
        let adm = adm.clone();
        async move { admit(&adm, 100).await.map(|a| (a, Instant::now())) }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiting.is_finished(),
        "nothing frees room for three seconds: still queued"
    );
    assert_eq!(adm.pools()[0].queue.depth(), 1);
    first.settle_not_charged();
    let (mut second, at) = waiting
        .await
        .expect("task")
        .expect("admitted from the queue");
    assert_eq!(
        at - start,
        Duration::from_secs(3),
        "admitted at the settlement, not later"
    );
    second.settle_not_charged();
    assert_zero(&adm).await;
}

#[tokio::test(start_paused = true)]
async fn a_wait_projected_beyond_max_wait_is_rejected_at_once() {
    // 6,000 tokens per minute: 100 per second.
    let adm = admission("tokens_per_minute = 6000\nmax_concurrency = 10\nmax_wait_ms = 2000\n");
    let mut all = admit(&adm, 5_900).await.expect("takes nearly everything");
    let left = 6_000 - all.estimate().reservation();
    all.settle_timeout(); // charged in full: what is left stays left
    let start = Instant::now();
    let err = admit(&adm, 1_000)
        .await
        .expect_err("ten seconds of refill is past max_wait");
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "rejected at once, not after waiting"
    );
    assert!(err.is_throttle(), "{err:?}");
    assert!(
        hint_ms(&err) >= 4_000,
        "the hint is the projection (capped at 5 s), got {}",
        hint_ms(&err)
    );

    // One that fits within max_wait waits and gets in when refill covers it, never before.
    // Refill started when the transit hold (100 ms) of the first reservation, taken from the
    // full bucket, ended.
    let mut ok = admit(&adm, 100).await.expect("queued, then admitted");
    let waited = start.elapsed();
    let missing = ok.estimate().reservation() - left;
    let refill = Duration::from_millis(missing * 10) + Duration::from_millis(100);
    assert!(
        waited >= refill && waited <= refill + Duration::from_millis(5),
        "{waited:?} for {missing} missing tokens"
    );
    ok.settle_not_charged();
    assert_zero(&adm).await;
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_time_runs_out_gets_a_throttle_with_a_hint() {
    let adm = admission("tokens_per_minute = 1000000\nmax_concurrency = 1\nmax_wait_ms = 1000\n");
    let mut held = admit(&adm, 100).await.expect("holds the only slot");
    let start = Instant::now();
    let err = admit(&adm, 100).await.expect_err("the slot never frees");
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert!(err.is_throttle(), "{err:?}");
    assert_eq!(err.header("x-tokengate-reason"), Some("concurrency"));
    assert!(hint_ms(&err) >= 50);
    held.settle_not_charged();
    assert_zero(&adm).await;
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_the_queue_holds_nothing() {
    let adm = admission("tokens_per_minute = 1000000\nmax_concurrency = 1\nmax_wait_ms = 5000\n");
    let mut held = admit(&adm, 100).await.expect("holds the only slot");
    let waiting = tokio::spawn({
        let adm = adm.clone();
        async move {
            admit(&adm, 100).await.map(|mut a| {
                a.settle_not_charged();
            })
        }
    });
    while adm.pools()[0].queue.depth() == 0 {
        tokio::task::yield_now().await;
    }
    waiting.abort();
    assert!(waiting.await.expect_err("aborted").is_cancelled());
    assert_eq!(adm.pools()[0].queue.depth(), 0, "it left the queue");
    held.settle_not_charged();
    assert_zero(&adm).await;
}

#[tokio::test(start_paused = true)]
async fn newcomers_pass_a_waiting_large_request_only_a_bounded_number_of_times() {
    // 100 tokens per second; the bucket is drained, a large request waits, small ones arrive.
    let adm = admission("tokens_per_minute = 6000\nmax_concurrency = 20\nmax_wait_ms = 10000\n");
    let mut all = admit(&adm, 5_900).await.expect("drain");
    all.settle_timeout();
    let spawn = |max_tokens: u64| {
        let adm = adm.clone();
        tokio::spawn(async move {
            let mut a = admit(&adm, max_tokens)
                .await
                .expect("admitted from the queue");
            a.settle_timeout();
            Instant::now()
        })
    };
    let large = spawn(400);
    while adm.pools()[0].queue.depth() == 0 {
        tokio::task::yield_now().await;
    }
    let small: Vec<_> = (0..8).map(|_| spawn(1)).collect();
    let large_at = large.await.expect("large");
    let mut small_at = Vec::new();
    for s in small {
        small_at.push(s.await.expect("small"));
    }
    let passed = small_at.iter().filter(|t| **t < large_at).count();
    assert!(
        passed <= tokengate::admission::queue::MAX_BYPASS as usize,
        "{passed} small requests passed the large one"
    );
    assert!(
        small_at.iter().any(|t| *t > large_at),
        "the rest waited behind it"
    );
    assert_zero(&adm).await;
}

#[tokio::test(start_paused = true)]
async fn a_flood_fills_the_queue_to_max_queue_and_no_further() {
    // A long max_wait, so that the projection (about a second per request ahead) lets all 50
    // into the queue and only max_queue limits it.
    let adm = admission(
        "tokens_per_minute = 1000000\nmax_concurrency = 1\nmax_wait_ms = 30000\nmax_queue = 10\n",
    );
    let mut held = admit(&adm, 100).await.expect("holds the only slot");
    let flood: Vec<_> = (0..50)
        .map(|_| {
            let adm = adm.clone();
            tokio::spawn(async move {
                admit(&adm, 100).await.map(|mut a| {
                    a.settle_not_charged();
                })
            })
        })
        .collect();
    for _ in 0..1_000 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        adm.pools()[0].queue.depth(),
        10,
        "never more than max_queue"
    );
    let finished: Vec<_> = flood.iter().filter(|t| t.is_finished()).collect();
    assert_eq!(finished.len(), 40, "the rest are turned away at once");
    held.settle_not_charged();
    let mut admitted = 0;
    let mut full = 0;
    for t in flood {
        match t.await.expect("task") {
            Ok(()) => admitted += 1,
            Err(e) => {
                assert_eq!(e.header("x-tokengate-reason"), Some("queue_full"), "{e:?}");
                full += 1;
            }
        }
    }
    assert_eq!((admitted, full), (10, 40));
    assert_zero(&adm).await;
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Memory per queued request (the queue record plus the waiting admission future, with a small
/// Converse body): a measurement for loadtest/RESULTS.md, bounded loosely (RSS moves in pages;
/// the figure there is about 4.7 KB in a debug build). Run: `cargo nextest run --test queue
/// --run-ignored all --no-capture queue_memory`.
#[tokio::test(start_paused = true)]
#[ignore = "a measurement for loadtest/RESULTS.md"]
async fn queue_memory() {
    const N: usize = 20_000;
    // 1,000 slots, all held: the projection (a typical duration per 1,000 requests ahead) stays
    // within max_wait for all N, so only memory is measured.
    let adm = admission(
        "tokens_per_minute = 1000000000\nmax_concurrency = 1000\nmax_wait_ms = 30000\nmax_queue = 100000\n",
    );
    let mut held = Vec::new();
    for _ in 0..1_000 {
        held.push(admit(&adm, 100).await.expect("holds a slot"));
    }
    let before = rss_kib();
    let waiting: Vec<_> = (0..N)
        .map(|_| {
            let adm = adm.clone();
            tokio::spawn(async move {
                admit(&adm, 100).await.map(|mut a| {
                    a.settle_not_charged();
                })
            })
        })
        .collect();
    for _ in 0..100_000 {
        if adm.pools()[0].queue.depth() == N {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(adm.pools()[0].queue.depth(), N, "all queued");
    let after = rss_kib();
    let per_request = (after - before) * 1024 / N as u64;
    println!(
        "{N} queued requests: RSS +{} KiB, {per_request} bytes per queued request (body {} bytes)",
        after - before,
        body(100).len()
    );
    assert!(
        per_request < 16 * 1024,
        "a queued request costs {per_request} bytes"
    );
    for mut h in held {
        h.settle_not_charged();
    }
    for w in waiting {
        let _ = w.await;
    }
    assert_zero(&adm).await;
}
