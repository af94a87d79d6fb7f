//! The product's promise under saturating load: 32 aws-sdk-bedrockruntime clients with a mix of
//! short and long (maxTokens 4000) Converse and ConverseStream calls, against a simulator whose
//! quota equals the pool's, for 30 seconds. Upstream never throttles, and the quota stays busy.
//!
//! Utilisation is the charged tokens over the quota made available during the run: the bucket
//! that was full at the start plus the refill over the run. (With burndown 5 a long answer is
//! charged several times its reservation, so the bucket runs into debt that later refill repays;
//! a window shorter than that cycle would measure the cycle, not the proxy.)

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use aws_sdk_bedrockruntime::Client;
use common::*;
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tokio::time::Instant;

const QUOTA: u64 = 300_000;
const CLIENTS: u64 = 32;
const RUN: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
}

async fn one_call(client: &Client, rng: &mut SmallRng) -> bool {
    let long = rng.random_bool(0.25);
    let (max, output) = if long {
        (4000, rng.random_range(1500..3500))
    } else {
        (400, rng.random_range(150..300))
    };
    let prompt = format!(
        "[sim:output={output}] {}",
        "please summarise the incident report ".repeat(rng.random_range(2..20))
    );
    if rng.random_bool(0.5) {
        client
            .converse()
            .model_id(SONNET_US)
            .messages(user_message(&prompt))
            .inference_config(max_tokens(max))
            .send()
            .await
            .is_ok()
    } else {
        let Ok(mut out) = client
            .converse_stream()
            .model_id(SONNET_US)
            .messages(user_message(&prompt))
            .inference_config(max_tokens(max))
            .send()
            .await
        else {
            return false;
        };
        loop {
            match out.stream.recv().await {
                Ok(Some(_)) => {}
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    }
}

fn charged(stack: &Stack) -> u64 {
    stack
        .sim
        .simulator
        .stats()
        .buckets
        .values()
        .map(|b| b.tokens_charged)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturating_sdk_clients_never_see_upstream_throttles() {
    let sim = format!(
        "time_to_first_token_ms = 20\ntokens_per_second = 2000\ndefault_tokens_per_minute = {QUOTA}\n"
    );
    // No admission queue: this is the reject-with-a-hint baseline (the queue has its own test).
    let pool = format!("{}max_wait_ms = 0\n", sonnet_pool(QUOTA, 64));
    let stack = Arc::new(Stack::start(&sim, &pool, "").await);
    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (stack, tally) = (stack.clone(), tally.clone());
            tokio::spawn(async move {
                let client = sdk_client(stack.proxy.addr, 3);
                let mut rng = SmallRng::seed_from_u64(i);
                while start.elapsed() < RUN {
                    let counter = if one_call(&client, &mut rng).await {
                        &tally.ok
                    } else {
                        &tally.failed
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("client task");
    }
    let elapsed = start.elapsed();
    let available = QUOTA as f64 * (1.0 + elapsed.as_secs_f64() / 60.0);
    let utilisation = charged(&stack) as f64 / available;
    let stats = stack.sim.simulator.stats();
    let throttled: u64 = stats.buckets.values().map(|b| b.throttled).sum();
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
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
    );
    assert_eq!(throttled, 0, "upstream must never throttle: {stats:?}");
    assert!(
        rejected > 0,
        "the load must saturate the pool for this test to mean anything"
    );
    assert!(
        utilisation >= 0.85,
        "the quota must stay busy: utilisation {utilisation:.3}"
    );
    stack.assert_ledger_zero().await;
}
