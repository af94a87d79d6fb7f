//! The product's promise under saturating load: 32 aws-sdk-bedrockruntime clients with a mix of
//! short and long (maxTokens 4000) Converse and ConverseStream calls, against a simulator whose
//! quota equals the pool's, for 30 seconds. Upstream never throttles, and the quota stays busy.
//!
//! Utilisation is the charged tokens over the quota made available during the run: the bucket
//! that was full at the start plus the refill over the run. (With burndown 5 a long answer is
//! charged several times its reservation, so the bucket runs into debt that later refill repays;
//! a window shorter than that cycle would measure the cycle, not the proxy.)

use std::{sync::Arc, time::Duration};

use crate::common::*;
use tokio::time::Instant;

const QUOTA: u64 = 300_000;
const CLIENTS: u64 = 32;
const RUN: Duration = Duration::from_secs(30);

fn charged(stack: &Stack) -> u64 {
    stack.sim.simulator.stats().tokens_charged()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturating_sdk_clients_never_see_upstream_throttles() {
    let sim = format!(
        "time_to_first_token_ms = 20\ntokens_per_second = 2000\ndefault_tokens_per_minute = {QUOTA}\n"
    );
    // No admission queue: this is the reject-with-a-hint baseline (the queue has its own test).
    let pool = format!("{}max_wait_ms = 0\n", sonnet_pool(QUOTA, 64));
    let stack = Arc::new(Stack::start(&sim, &pool, "").await);
    let mix = fleet::SONNET_MIXED;
    let start = Instant::now();
    let result = fleet::run(stack.proxy.addr, CLIENTS, RUN, &mix).await;
    let elapsed = start.elapsed();
    let available = QUOTA as f64 * (1.0 + elapsed.as_secs_f64() / 60.0);
    let utilisation = charged(&stack) as f64 / available;
    let stats = stack.sim.simulator.stats();
    let throttled: u64 = stats.throttled();
    let rejected: u64 = stack
        .proxy
        .state
        .metrics
        .rejections
        .with_label_values(&["sonnet4-us", "tokens"])
        .get();
    println!(
        "completed {} failed {} proxy-rejections {rejected} upstream-throttles {throttled} \
         utilisation {utilisation:.3} over {elapsed:?}",
        result.completed, result.failed,
    );
    assert_eq!(throttled, 0, "upstream must never throttle: {stats:?}");
    assert!(
        rejected > 0,
        "the load must saturate the pool for this test to mean anything"
    );
    // The precise figure is a measurement (loadtest/RESULTS.md, "The CI fleet tests": 1.00 with
    // the machine's load average at 11); the bound leaves room for a machine too loaded to keep
    // 32 clients busy, while still failing a proxy that holds the quota idle.
    assert!(
        utilisation >= 0.7,
        "the quota must stay busy: utilisation {utilisation:.3}"
    );
    stack.assert_ledger_zero().await;
}
