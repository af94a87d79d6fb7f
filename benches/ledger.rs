//! Admission decisions against each ledger backend, in one run: the memory ledger, and the Redis
//! ledger over loopback TCP and over a unix socket, each against a private `redis-server`, alone
//! and with local capacity leases (`LeasedLedger`, the default `[ledger.local_leases]`), and on a
//! private three-master Redis Cluster over loopback TCP (`redis+cluster://`); and the Redis ledger
//! with and without leases for requests carrying a hold-back (admission's [`HOLD_BACK`]: a
//! burndown pool with streams in flight on this replica).
//!
//! For each backend:
//! - **latency**: one task doing `reserve` then `settle`, one after the other; the latency of each
//!   `reserve` (the admission decision) and of each `settle` is recorded; p50 / p99 / p99.9.
//! - **throughput**: 32 tasks on a 2-worker runtime doing reserve/settle pairs for a few seconds:
//!   decisions per second (one decision = one reserve; each is followed by its settle).
//! - **round trips**: Redis's own count of `EVALSHA` calls (`INFO commandstats`) per decision, to
//!   show one round trip to admit and one to settle, and Redis's own time per call (the scripts'
//!   cost on the server, which client-side latency on a busy machine hides).
//!
//! Run: `cargo bench --bench ledger` (needs `redis-server` and `redis-cli` on PATH; prints a
//! Markdown table). `cargo bench --bench ledger -- WORD` runs only the rows whose name holds WORD
//! (e.g. `hold-back`).

// The test harness's Redis servers; the bench uses only starting them.
#[allow(dead_code)]
#[path = "../tests/it/common/redis_cluster.rs"]
mod redis_cluster;
#[allow(dead_code)]
#[path = "../tests/it/common/redis_server.rs"]
mod redis_server;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokengate::ledger::{
    Clock, LeaseOptions, LeasedLedger, Ledger, Limits, MemoryLedger, RedisLedger, RedisOptions,
    ReserveRequest, Verdict,
};

const LIMITS: Limits = Limits {
    tokens_per_minute: 1_000_000_000,
    requests_per_minute: None,
    max_concurrency: 1_000_000,
    tokens_per_day: None,
};
const SEQUENTIAL: usize = 20_000;
const TASKS: usize = 32;
const THROUGHPUT_RUN: Duration = Duration::from_secs(4);
/// The hold-back of the rows that carry one: the expected burndown excess of, say, 20 streams in
/// flight at 5,000 tokens each (`Pool::pending_excess`), held constant.
const HOLD_BACK: u64 = 100_000;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let Some(unix) = redis_server::RedisServer::start().await else {
        eprintln!("no redis-server: nothing to compare");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let tcp = redis_cluster::RedisNode::start(dir.path(), false)
        .await
        .expect("redis-server on loopback TCP");
    let cluster = redis_cluster::RedisCluster::start(dir.path(), 3, 0)
        .await
        .expect("a three-master cluster (redis-cli --cluster create)");
    println!(
        "| backend | reserve p50 | reserve p99 | reserve p99.9 | settle p50 | settle p99 | decisions/s ({TASKS} tasks) | EVALSHA per reserve + settle | Redis µs per EVALSHA |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    // The first argument that is not a flag (cargo passes `--bench`): a filter on row names.
    let only = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let wanted = |name: &str| only.as_deref().is_none_or(|w| name.contains(w));
    if wanted("memory") {
        let memory: Arc<dyn Ledger> = Arc::new(MemoryLedger::new(Clock::tokio()));
        report("memory", &memory, &[], 0).await;
    }
    let node_url = |port: u16| format!("redis://127.0.0.1:{port}");
    let masters: Vec<String> = cluster.nodes.iter().map(|n| node_url(n.port)).collect();
    let tcp_url = node_url(tcp.port);
    let rows = [
        (
            "redis, loopback TCP",
            &tcp_url,
            vec![tcp_url.clone()],
            false,
            0,
        ),
        (
            "redis, unix socket",
            &unix.url(),
            vec![unix.url()],
            false,
            0,
        ),
        (
            "redis cluster (3 masters), loopback TCP",
            &cluster.url(),
            masters,
            false,
            0,
        ),
        (
            "redis + local leases, loopback TCP",
            &tcp_url,
            vec![tcp_url.clone()],
            true,
            0,
        ),
        (
            "redis + local leases, unix socket",
            &unix.url(),
            vec![unix.url()],
            true,
            0,
        ),
        (
            "redis, unix socket, hold-back",
            &unix.url(),
            vec![unix.url()],
            false,
            HOLD_BACK,
        ),
        (
            "redis + local leases, loopback TCP, hold-back",
            &tcp_url,
            vec![tcp_url.clone()],
            true,
            HOLD_BACK,
        ),
        (
            "redis + local leases, unix socket, hold-back",
            &unix.url(),
            vec![unix.url()],
            true,
            HOLD_BACK,
        ),
    ];
    for (name, url, stats, leases, hold_back) in rows {
        if !wanted(name) {
            continue;
        }
        let options = RedisOptions {
            url: url.clone(),
            timeout: Duration::from_secs(2),
            lease: Duration::from_secs(600),
        };
        let shared = RedisLedger::connect(options).await.expect("redis ledger");
        let ledger: Arc<dyn Ledger> = if leases {
            Arc::new(LeasedLedger::new(shared, LEASES))
        } else {
            Arc::new(shared)
        };
        report(name, &ledger, &stats, hold_back).await;
        ledger.close().await;
    }
}

/// `[ledger.local_leases]` with its defaults (`src/config/ledger.rs`).
const LEASES: LeaseOptions = LeaseOptions {
    horizon: Duration::from_millis(250),
    max_fraction: 0.1,
    max_age: Duration::from_secs(2),
};

/// Measures `ledger` with requests carrying `hold_back`; `redis`: the servers whose `EVALSHA`
/// counts add up to its calls.
async fn report(name: &str, ledger: &Arc<dyn Ledger>, redis: &[String], hold_back: u64) {
    // Warm up: connection, script load.
    for _ in 0..1_000 {
        pair(ledger.as_ref(), "warm-up", hold_back).await;
    }
    let evals_before = evalsha_sum(redis).await;
    let (mut reserves, mut settles) = (
        Vec::with_capacity(SEQUENTIAL),
        Vec::with_capacity(SEQUENTIAL),
    );
    for _ in 0..SEQUENTIAL {
        let (r, s) = pair(ledger.as_ref(), "latency", hold_back).await;
        reserves.push(r);
        settles.push(s);
    }
    let (per_decision, server_us) = match redis.is_empty() {
        false => {
            let (calls, usec) = evalsha_sum(redis).await;
            let calls = calls - evals_before.0;
            (
                format!("{:.2}", calls as f64 / SEQUENTIAL as f64),
                format!("{:.2}", (usec - evals_before.1) as f64 / calls as f64),
            )
        }
        true => ("-".into(), "-".into()),
    };
    let rate = throughput(ledger, hold_back).await;
    reserves.sort_unstable();
    settles.sort_unstable();
    println!(
        "| {name} | {} | {} | {} | {} | {} | {rate:.0} | {per_decision} | {server_us} |",
        us(percentile(&reserves, 0.50)),
        us(percentile(&reserves, 0.99)),
        us(percentile(&reserves, 0.999)),
        us(percentile(&settles, 0.50)),
        us(percentile(&settles, 0.99)),
    );
}

/// One decision and its settlement; the time each took.
async fn pair(ledger: &dyn Ledger, pool: &str, hold_back: u64) -> (Duration, Duration) {
    let request = ReserveRequest {
        pool,
        limits: LIMITS,
        tokens: 1_000,
        share: None,
        hold_back,
    };
    let started = Instant::now();
    let decision = ledger.reserve(&request).await;
    let reserved = started.elapsed();
    let Ok(Verdict::Granted(reservation)) = decision else {
        panic!("the bench pool admits everything: {decision:?}");
    };
    let started = Instant::now();
    ledger.settle(reservation, 0).await.expect("settle");
    (reserved, started.elapsed())
}

async fn throughput(ledger: &Arc<dyn Ledger>, hold_back: u64) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while started.elapsed() < THROUGHPUT_RUN {
                    pair(ledger.as_ref(), "throughput", hold_back).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut decisions = 0;
    for t in tasks {
        decisions += t.await.expect("task");
    }
    decisions as f64 / started.elapsed().as_secs_f64()
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// [`evalsha_stats`] summed over `urls`.
async fn evalsha_sum(urls: &[String]) -> (u64, u64) {
    let mut sum = (0, 0);
    for url in urls {
        let (calls, usec) = evalsha_stats(url).await;
        sum = (sum.0 + calls, sum.1 + usec);
    }
    sum
}

/// `EVALSHA` calls so far and the microseconds Redis spent in them, from `INFO commandstats`.
async fn evalsha_stats(url: &str) -> (u64, u64) {
    let client = redis::Client::open(url).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    let Some(line) = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
    else {
        return (0, 0);
    };
    let field = |name: &str| {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (field("calls"), field("usec"))
}
