//! Hold, don't bounce: 24 closed-loop SDK clients against a 60,000 tokens-per-minute quota for
//! 40 seconds (80% maxTokens 400, 20% maxTokens 4000). With the admission queue, few calls fail,
//! upstream never throttles, and the quota stays busy. `side_by_side` (ignored; run it with
//! `cargo nextest run --test queue_fleet --run-ignored all --no-capture`) adds the same run
//! without the queue and straight at the simulator, for loadtest/RESULTS.md.

use std::time::Duration;

use crate::common::{fleet::Mix, *};

const QUOTA: u64 = 60_000;
const CLIENTS: u64 = 24;
const RUN: Duration = Duration::from_secs(40);

const MIX: Mix = Mix {
    model: HAIKU,
    long_share: 0.2,
    short_max_tokens: 400,
    short_output: 150..350,
    long_max_tokens: 4000,
    long_output: 1000..3000,
};

fn sim() -> String {
    format!(
        "time_to_first_token_ms = 100\ntokens_per_second = 1000\ndefault_tokens_per_minute = {QUOTA}\n"
    )
}

fn pool(max_wait_ms: u64) -> String {
    format!(
        "[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = {QUOTA}\nmax_concurrency = 64\n\
         output_burndown = 1\ndefault_max_tokens = 400\nmax_wait_ms = {max_wait_ms}\n"
    )
}

struct Outcome {
    label: &'static str,
    result: fleet::FleetResult,
    throttled: u64,
    goodput: f64,
}

impl Outcome {
    fn print(&self) {
        println!(
            "| {} | {} | {} | {:.1}% | {} | {:.1}% |",
            self.label,
            self.result.completed,
            self.result.failed,
            100.0 * self.result.failure_rate(),
            self.throttled,
            100.0 * self.goodput
        );
    }
}

/// Charged tokens of completed calls over the quota made available during the run (the full
/// bucket at the start plus refill).
fn goodput(sim: &tokengate::simulator::SimulatorHandle, elapsed: Duration) -> f64 {
    let charged: u64 = sim.simulator.stats().tokens_charged();
    charged as f64 / (QUOTA as f64 * (1.0 + elapsed.as_secs_f64() / 60.0))
}

async fn through_proxy(label: &'static str, max_wait_ms: u64) -> Outcome {
    let stack = Stack::start(&sim(), &pool(max_wait_ms), "").await;
    let result = fleet::run(stack.proxy.addr, CLIENTS, RUN, &MIX).await;
    stack.assert_ledger_zero().await;
    let throttled = stack.sim.simulator.stats().throttled();
    let goodput = goodput(&stack.sim, result.elapsed);
    Outcome {
        label,
        result,
        throttled,
        goodput,
    }
}

async fn direct() -> Outcome {
    let sim = start_simulator(&sim()).await;
    let result = fleet::run(sim.addr, CLIENTS, RUN, &MIX).await;
    let throttled = sim.simulator.stats().throttled();
    let goodput = goodput(&sim, result.elapsed);
    Outcome {
        label: "direct to the simulator",
        result,
        throttled,
        goodput,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_clients_rarely_fail_and_keep_the_quota_busy() {
    let queued = through_proxy("tokengate, max_wait_ms = 25000", 25_000).await;
    queued.print();
    assert_eq!(queued.throttled, 0, "upstream never throttles");
    // Margins a loaded machine holds; the measured figures (1.8-3.1% failures, goodput 96-99%)
    // are in loadtest/RESULTS.md. Without the queue, 99% of these calls fail.
    assert!(
        queued.result.failure_rate() <= 0.20,
        "failures {:.3}",
        queued.result.failure_rate()
    );
    assert!(queued.goodput >= 0.75, "goodput {:.3}", queued.goodput);
}

/// A measurement (its table is in loadtest/RESULTS.md); it asserts only what RESULTS.md
/// concludes from it: through the proxy upstream never throttles, straight at the simulator it
/// does, and the queue turns most failures into completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a 2-minute comparison for loadtest/RESULTS.md"]
async fn side_by_side() {
    println!(
        "| side | completed | failed | failure rate | upstream throttles | goodput |\n|---|---|---|---|---|---|"
    );
    let direct = direct().await;
    direct.print();
    let bounce = through_proxy("tokengate, no queue (max_wait_ms = 0)", 0).await;
    bounce.print();
    let queued = through_proxy("tokengate, max_wait_ms = 25000", 25_000).await;
    queued.print();
    assert!(direct.throttled > 0, "the load exceeds the quota");
    assert_eq!((bounce.throttled, queued.throttled), (0, 0));
    assert!(
        queued.result.failure_rate() < bounce.result.failure_rate() / 2.0,
        "the queue holds calls instead of bouncing them"
    );
}
