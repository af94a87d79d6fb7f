//! All or nothing across a spill chain, under concurrency, on both ledgers (issue #18).
//!
//! proptest draws a chain of one to four pools (each its own concurrency and token limits) and
//! up to 24 requests sent at once, on tasks of a multi-thread runtime, through
//! `Admission::decide`. The ledger's clock is manual and never moves, so nothing refills and
//! nothing settles while they run: a pool that refused one request refuses every later one of
//! the same size, which makes the outcome checkable exactly. Then:
//! - every reservation is held once: each pool's ledger holds exactly the requests admitted in
//!   it (in flight and tokens), and a refused request holds nothing anywhere;
//! - in order: a request ran in the `k`-th pool of the chain only if every pool before it is
//!   full (cannot hold one more such request), and a request was refused only if all are;
//! - everything settles back to zero, with no reservation dropped unsettled.
//!
//! Run against the memory ledger, and the Redis ledger on a private `redis-server`
//! (`common/redis_server.rs`; without one, a named skip outside CI).

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::common::redis_server;
use bytes::Bytes;
use proptest::{
    prelude::*,
    test_runner::{Config as RunnerConfig, TestCaseError, TestRunner},
};
use tokengate::{
    admission::{Admission, Decision, Facts},
    bedrock::Operation,
    config::Config,
    ledger::{Clock, Ledger, MemoryLedger, RedisLedger, RedisOptions},
};

const CASES: u32 = 48;
const SONNET_US: &str = "us.anthropic.claude-sonnet-4-20250514-v1:0";
/// Each pool of a chain serves Sonnet 4 through another door (same base model).
const DOORS: [&str; 4] = [
    "us.anthropic.claude-sonnet-4-20250514-v1:0",
    "global.anthropic.claude-sonnet-4-20250514-v1:0",
    "arn:aws:bedrock:us-west-2::foundation-model/anthropic.claude-sonnet-4-20250514-v1:0",
    "arn:aws:bedrock:us-east-2::foundation-model/anthropic.claude-sonnet-4-20250514-v1:0",
];
const MAX_TOKENS: u64 = 100;

#[derive(Debug, Clone)]
struct Case {
    /// Per pool of the chain, in order: (max_concurrency, requests' worth of tokens).
    pools: Vec<(u32, u64)>,
    requests: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((1u32..6, 1u64..8), 1..=4),
        1usize..=24,
    )
        .prop_map(|(pools, requests)| Case { pools, requests })
}

/// The policy of `case`, pool names prefixed with `prefix` (unique per case on a shared Redis).
fn config(case: &Case, prefix: &str, reservation: u64) -> Config {
    let names: Vec<String> = (0..case.pools.len())
        .map(|i| format!("{prefix}-{i}"))
        .collect();
    let mut text = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n",
    );
    for (i, (concurrency, worth)) in case.pools.iter().enumerate() {
        let spill = if i == 0 && names.len() > 1 {
            let rest: Vec<String> = names[1..].iter().map(|n| format!("{n:?}")).collect();
            format!("spill_to = [{}]\n", rest.join(", "))
        } else {
            String::new()
        };
        // `worth` whole requests fit, plus a part of one that does not.
        let tokens = reservation * worth + reservation / 2;
        text.push_str(&format!(
            "[[pools]]\nname = \"{}\"\nmodels = [\"{}\"]\ntokens_per_minute = {tokens}\n\
             max_concurrency = {concurrency}\noutput_burndown = 5\ndefault_max_tokens = 10\n\
             max_wait_ms = 0\n{spill}",
            names[i], DOORS[i]
        ));
    }
    Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn admission(config: &Config, ledger: Arc<dyn Ledger>) -> Arc<Admission> {
    let p = &config.policy;
    Arc::new(Admission::new(
        &p.pools,
        &p.routes,
        p.admission.clone(),
        ledger,
    ))
}

fn body() -> Bytes {
    Bytes::from(format!(
        r#"{{"messages":[{{"role":"user","content":[{{"text":"hello"}}]}}],"inferenceConfig":{{"maxTokens":{MAX_TOKENS}}}}}"#
    ))
}

/// One Converse call of [`body`] to the chain's home model, from the default route.
async fn decide(admission: &Admission) -> Decision {
    let caller = admission.first_route_caller();
    let body = body();
    admission
        .decide(&Facts {
            operation: Operation::Converse,
            model_id: Some(SONNET_US),
            body: &body,
            read: None,
            caller: &caller,
            endpoint: None,
            service_tier: None,
        })
        .await
}

/// The reservation one request of [`body`] takes (the same in every pool: one model).
async fn reservation_of_one() -> u64 {
    let probe = Case {
        pools: vec![(1, 1000)],
        requests: 1,
    };
    let config = config(&probe, "probe", 1000);
    let admission = admission(&config, Arc::new(MemoryLedger::new(Clock::manual())));
    match decide(&admission).await {
        Decision::Admit(mut a) => {
            let tokens = a.hold.reserved();
            a.hold.settle_not_charged();
            tokens
        }
        other => panic!("the probe is admitted: {other:?}"),
    }
}

/// Sends `case.requests` at once and checks the module doc's properties.
async fn run(
    case: &Case,
    admission: Arc<Admission>,
    reservation: u64,
) -> Result<(), TestCaseError> {
    let tasks: Vec<_> = (0..case.requests)
        .map(|_| {
            let admission = admission.clone();
            tokio::spawn(async move { decide(&admission).await })
        })
        .collect();
    let mut holds: Vec<Vec<_>> = (0..case.pools.len()).map(|_| Vec::new()).collect();
    let mut refused = 0;
    for task in tasks {
        match task.await.expect("task") {
            Decision::Admit(a) => holds[a.hold.pool().id].push(a),
            Decision::Throttle(_) => refused += 1,
            other => return Err(TestCaseError::fail(format!("unexpected {other:?}"))),
        }
    }
    let pools = admission.pools();
    let mut full = Vec::new();
    for (i, pool) in pools.iter().enumerate() {
        let snapshot = admission
            .ledger()
            .snapshot(&pool.name, &pool.limits())
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let held = holds[i].len() as u64;
        prop_assert_eq!(u64::from(snapshot.in_flight_requests), held, "pool {}", i);
        prop_assert_eq!(snapshot.reserved_tokens, held * reservation, "pool {}", i);
        let no_permit = snapshot.in_flight_requests >= pool.config.max_concurrency;
        let no_tokens = snapshot.tokens_available < reservation as i64;
        full.push(no_permit || no_tokens);
    }
    for (i, admitted) in holds.iter().enumerate() {
        if !admitted.is_empty() {
            prop_assert!(
                full[..i].iter().all(|f| *f),
                "ran in pool {} while an earlier one had room: {:?}",
                i,
                full
            );
        }
    }
    if refused > 0 {
        prop_assert!(full.iter().all(|f| *f), "refused with room: {:?}", full);
    }
    let admitted: usize = holds.iter().map(Vec::len).sum();
    prop_assert_eq!(admitted + refused, case.requests);
    drop(holds);
    // Dropped holds settle (abandoned); a Redis settlement finishes on its own task.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for pool in pools {
        loop {
            let s = admission
                .ledger()
                .snapshot(&pool.name, &pool.limits())
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            if s.in_flight_requests == 0 && s.reserved_tokens == 0 {
                break;
            }
            prop_assert!(
                tokio::time::Instant::now() < deadline,
                "{} never settled",
                pool.name
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    prop_assert_eq!(admission.ledger().stats().unsettled_drops(), 0);
    Ok(())
}

fn runner() -> TestRunner {
    TestRunner::new(RunnerConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(CASES),
        failure_persistence: None,
        ..RunnerConfig::default()
    })
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn a_chain_admits_all_or_nothing_under_concurrency_memory_ledger() {
    let runtime = multi_thread();
    let reservation = runtime.block_on(reservation_of_one());
    let result = runner().run(&case(), |case| {
        runtime.block_on(async {
            let config = config(&case, "mem", reservation);
            let ledger = Arc::new(MemoryLedger::new(Clock::manual()));
            run(&case, admission(&config, ledger), reservation).await
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn a_chain_admits_all_or_nothing_under_concurrency_redis_ledger() {
    let runtime = multi_thread();
    let Some(server) = runtime.block_on(redis_server::RedisServer::start()) else {
        return;
    };
    let reservation = runtime.block_on(reservation_of_one());
    let run_id = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = std::sync::atomic::AtomicU64::new(0);
    let result = runner().run(&case(), |case| {
        let n = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(async {
            let config = config(&case, &format!("spill-{run_id}-{n}"), reservation);
            let options = RedisOptions {
                url: server.url(),
                timeout: Duration::from_secs(5),
                lease: Duration::from_secs(365 * 24 * 3600),
            };
            let ledger = RedisLedger::connect_with_clock(options, Clock::manual())
                .await
                .expect("redis ledger");
            run(&case, admission(&config, Arc::new(ledger)), reservation).await
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
