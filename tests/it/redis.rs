//! The shared ledger end to end: replicas that crash, replicas that share one quota, and a Redis
//! that stops answering. Each test runs its own `redis-server` (see `common/redis_server.rs`);
//! without one they are named, counted skips locally and failures under CI (`common/skip.rs`).
//! (Over 500 lines: every Redis scenario shares the private-server harness in one binary.)

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Command, Stdio},
    time::Duration,
};

use crate::common::{load::Load, redis_server::RedisServer, *};
use tokengate::{
    gateway::Gateway,
    ledger::{Ledger, Limits, PoolSnapshot, RedisLedger, RedisOptions},
};
use tokio::time::Instant;

const POOL: &str = "sonnet4-us";

/// A ledger of the test's own on `server`, to look at the shared state as every replica sees it.
async fn observer(server: &RedisServer) -> RedisLedger {
    let options = RedisOptions {
        url: server.url(),
        timeout: Duration::from_secs(5),
        lease: Duration::from_secs(60),
    };
    RedisLedger::connect(options)
        .await
        .expect("observer connects")
}

async fn shared_state(ledger: &RedisLedger, limits: Limits) -> PoolSnapshot {
    ledger.snapshot(POOL, &limits).await.expect("snapshot")
}

/// Polls `check` every 20 ms until it holds, for at most `within`; returns how long it took.
async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// === crash safety ===

/// A `tokengate serve` process holding three reservations is killed with SIGKILL: its permits
/// stay held while the leases run (it might still be generating), and come back within a lease
/// of its last renewal; the tokens stay charged in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_gives_its_capacity_back_when_its_leases_expire() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("replica.toml");
    let (tpm, lease) = (6_000, Duration::from_secs(2));
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\n\
             [ledger]\nbackend = \"redis\"\nurl = \"{}\"\ntimeout_ms = 500\nlease_secs = {}\n\n\
             [simulator]\ntime_to_first_token_ms = 600000\n\n{}",
            server.url(),
            lease.as_secs(),
            sonnet_pool(tpm, 8)
        ),
    )
    .expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("tokengate serve starts");
    let addr = listening_addr(child.stdout.take().expect("stdout"));
    let limits = Limits {
        tokens_per_minute: tpm,
        requests_per_minute: None,
        max_concurrency: 8,
        tokens_per_day: None,
    };
    let observer = observer(&server).await;
    // Three calls that hang upstream (first token in ten minutes).
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let client = sdk_client(addr, 1);
            tokio::spawn(async move {
                let _ = client
                    .converse()
                    .model_id(SONNET_US)
                    .messages(user_message("hello"))
                    .inference_config(max_tokens(1000))
                    .send()
                    .await;
            })
        })
        .collect();
    eventually(
        Duration::from_secs(20),
        "three requests in flight",
        || async { shared_state(&observer, limits).await.in_flight_requests == 3 },
    )
    .await;
    let held = shared_state(&observer, limits).await;
    assert!(held.reserved_tokens >= 3_000, "{held:?}");

    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let killed = Instant::now();
    // While Redis's clock is before the leases' expiry, every reading shows the permits held
    // (each reading is taken before the clock read that follows it); the first reading comes
    // right after the kill, within the two thirds of a lease left since the last renewal.
    let expiries = server.lease_expiries(POOL).await;
    assert_eq!(expiries.len(), 3, "three leases: {expiries:?}");
    let (first_expiry, last_expiry) = (expiries[0], expiries[2]);
    let mut readings = 0;
    loop {
        let s = shared_state(&observer, limits).await;
        if server.time_ms().await >= first_expiry {
            break;
        }
        assert_eq!(s.in_flight_requests, 3, "leases still live after the kill");
        readings += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(readings > 0, "no reading before the first lease expired");
    // Once Redis's clock passes the last expiry, the next call reclaims them all.
    while server.time_ms().await <= last_expiry {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = shared_state(&observer, limits).await;
    assert_eq!(
        (after.in_flight_requests, after.reserved_tokens),
        (0, 0),
        "{after:?}"
    );
    // Charged in full: no refund of the ~3,000 reserved tokens (refill adds 100 per second).
    let refill = (killed.elapsed().as_secs_f64() * tpm as f64 / 60.0).ceil() as i64 + 1;
    assert!(
        after.tokens_available <= held.tokens_available + refill,
        "expired leases are not refunded: {after:?} (was {held:?})"
    );
    for call in calls {
        call.abort();
    }
}

/// A live replica renews the leases it holds: a call held open upstream for more than two
/// leases (by Redis's clock, the scripts' clock) keeps its permit all along, and its lease's
/// expiry moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_replica_keeps_its_permits_past_two_leases() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    // The first token would take ten minutes: the call is held until the test hangs up.
    let sim = start_simulator("time_to_first_token_ms = 600000\ntokens_per_second = 0\n").await;
    let ledger = format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\ntimeout_ms = 200\nlease_secs = 2\n",
        server.url()
    );
    let proxy = start_proxy(proxy_config(sim.addr, &sonnet_pool(60_000, 4), &ledger)).await;
    let observer = observer(&server).await;
    let limits = proxy.admission().pools()[0].limits();
    let call = tokio::spawn(converse(proxy.addr));
    eventually(Duration::from_secs(20), "the call in flight", || async {
        shared_state(&observer, limits).await.in_flight_requests == 1
    })
    .await;
    let admitted = server.time_ms().await;
    let first_expiry = server.lease_expiries(POOL).await[0];
    let two_leases = admitted + 2 * 2_000;
    while server.time_ms().await < two_leases {
        let s = shared_state(&observer, limits).await;
        assert_eq!(s.in_flight_requests, 1, "the live replica's permit is held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = shared_state(&observer, limits).await;
    assert_eq!(s.in_flight_requests, 1, "still held after two leases");
    let renewed = server.lease_expiries(POOL).await;
    assert!(
        renewed.len() == 1 && renewed[0] > first_expiry,
        "the lease was renewed: {renewed:?}, first {first_expiry}"
    );
    // The caller hangs up: the reservation settles (abandoned) and the lease goes.
    call.abort();
    assert_ledger_zero(&proxy).await;
    let s = shared_state(&observer, limits).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}

/// Reads the child's stdout until it says where it listens; keeps draining it afterwards.
fn listening_addr(stdout: std::process::ChildStdout) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("tokengate listening on http://") {
                let _ = tx.send(addr.to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("tokengate serve prints its address");
    addr.parse().expect("an address")
}

// === three replicas, one quota ===

const QUOTA: u64 = 300_000;

/// Three proxies on one Redis in front of one simulator whose quota equals the pool's, driven by
/// SDK clients spread over the three: upstream never throttles and the quota stays busy (the same
/// measure as `tests/saturation.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_one_quota() {
    three_replicas_on_one_redis("").await;
}

/// The same with local capacity leases: most decisions come from each replica's slice of the
/// bucket, and upstream still never throttles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_one_quota_with_local_leases() {
    three_replicas_on_one_redis("[ledger.local_leases]\nmax_fraction = 0.1\n").await;
}

async fn three_replicas_on_one_redis(leases: &str) {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let sim = start_simulator(&format!(
        "time_to_first_token_ms = 20\ntokens_per_second = 2000\ndefault_tokens_per_minute = {QUOTA}\n"
    ))
    .await;
    let pool = format!("{}max_wait_ms = 0\n", sonnet_pool(QUOTA, 64));
    let ledger = format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\n{leases}",
        server.url()
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(start_proxy(proxy_config(sim.addr, &pool, &ledger)).await);
    }
    let mix = fleet::SONNET_MIXED;
    let start = Instant::now();
    let runs: Vec<_> = replicas
        .iter()
        .map(|r| {
            let (addr, mix) = (r.addr, mix.clone());
            tokio::spawn(async move { fleet::run(addr, 11, Duration::from_secs(30), &mix).await })
        })
        .collect();
    let (mut completed, mut failed) = (0, 0);
    for run in runs {
        let r = run.await.expect("fleet");
        completed += r.completed;
        failed += r.failed;
    }
    let elapsed = start.elapsed();
    let stats = sim.simulator.stats();
    let charged: u64 = stats.tokens_charged();
    let throttled: u64 = stats.throttled();
    let utilisation = charged as f64 / (QUOTA as f64 * (1.0 + elapsed.as_secs_f64() / 60.0));
    let rejected: Vec<u64> = replicas.iter().map(rejections).collect();
    println!(
        "completed {completed} failed {failed} proxy-rejections {rejected:?} upstream-throttles {throttled} \
         utilisation {utilisation:.3} over {elapsed:?}"
    );
    assert_eq!(throttled, 0, "upstream must never throttle: {stats:?}");
    assert!(
        rejected.iter().all(|&r| r > 0),
        "every replica must be saturated for this to mean anything: {rejected:?}"
    );
    // A margin a loaded machine holds; the measured figure is in loadtest/RESULTS.md ("The CI
    // fleet tests": 1.03 with the machine's load average at 11).
    assert!(
        utilisation >= 0.7,
        "the quota must stay busy: utilisation {utilisation:.3}"
    );
    for replica in &replicas {
        assert_ledger_zero(replica).await;
    }
}

/// With `[ledger.local_leases]`, calls are admitted from the replica's slice (the shared state
/// shows the slice, not the calls, while the replica is idle), and shutdown gives it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_capacity_slices_back() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let sim = start_simulator("time_to_first_token_ms = 0\ntokens_per_second = 0\n").await;
    let ledger = format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\n\n[ledger.local_leases]\nhorizon_ms = 60000\nmax_age_ms = 60000\nmax_fraction = 0.5\n",
        server.url()
    );
    let proxy = start_proxy(proxy_config(sim.addr, &sonnet_pool(60_000, 8), &ledger)).await;
    for _ in 0..3 {
        // Charged well under the reservation: a charge above it would give the slice back.
        let body = converse_body("[sim:output=5] hello", Some(100));
        let path = model_path(SONNET_US, "converse");
        let answer = raw_request(proxy.addr, "POST", &path, body, false).await;
        assert_eq!(answer.status, 200);
    }
    let limits = Limits {
        tokens_per_minute: 60_000,
        requests_per_minute: None,
        max_concurrency: 8,
        tokens_per_day: None,
    };
    let observer = observer(&server).await;
    let held = shared_state(&observer, limits).await;
    assert!(
        held.reserved_tokens > 0 && held.in_flight_requests > 0,
        "a live slice holds tokens and permits while no call is in flight: {held:?}"
    );
    let report = proxy.shutdown().await.expect("shutdown");
    assert!(report.is_clean(), "{report:?}");
    let after = shared_state(&observer, limits).await;
    assert_eq!(
        (after.reserved_tokens, after.in_flight_requests),
        (0, 0),
        "the slice went back at shutdown: {after:?}"
    );
}

fn rejections(proxy: &Gateway) -> u64 {
    proxy
        .state
        .metrics
        .rejections
        .with_label_values(&[POOL, "tokens"])
        .get()
}

// === round trips ===

/// "One Redis round trip per decision", as Redis sees it (`MONITOR`): with routes, shares and a
/// retry reserve in play, each admitted call sends Redis exactly one script call to admit and
/// one to settle, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_one_redis_call_to_admit_and_one_to_settle() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let sim = start_simulator("time_to_first_token_ms = 0\ntokens_per_second = 0\n").await;
    let extra = format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\n\n[auth]\nmode = \"none\"\ndefault_route = \"triage\"\n\n\
         [[routes]]\nname = \"triage\"\npriority = 10\n[routes.shares]\n{POOL} = {{ min = 0.3, max = 0.9 }}\n\n\
         [[routes]]\nname = \"backlog\"\n[routes.shares]\n{POOL} = {{ min = 0.2 }}\n",
        server.url()
    );
    let pool = format!("{}retry_reserve = 0.1\n", sonnet_pool(1_000_000, 8));
    let proxy = start_proxy(proxy_config(sim.addr, &pool, &extra)).await;
    // Every reserve and settle that came back (the proxy's own count: no Redis call of ours).
    let ledger_calls =
        || crate::common::metric(&proxy, "tokengate_ledger_seconds_count", &[]) as u64;
    assert_eq!(
        converse(proxy.addr).await.status,
        200,
        "warm: scripts loaded"
    );
    eventually(
        Duration::from_secs(10),
        "the first call settled",
        || async { ledger_calls() == 2 },
    )
    .await;
    let monitor = server.monitor().await;
    const CALLS: u64 = 10;
    for _ in 0..CALLS {
        assert_eq!(converse(proxy.addr).await.status, 200);
    }
    // With Redis a settlement may finish after the answer reached the client.
    eventually(Duration::from_secs(10), "every call settled", || async {
        ledger_calls() == 2 * (CALLS + 1)
    })
    .await;
    let sent = monitor.stop().await;
    assert_eq!(
        sent,
        vec!["evalsha"; 2 * CALLS as usize],
        "one admit and one settle script per call, nothing else"
    );
    let states = proxy.admission().pool_views().await;
    assert_eq!(
        states[0].routes[0].name, "triage",
        "routes and shares are on"
    );
    assert_ledger_zero(&proxy).await;
}

// === Redis outages ===

async fn converse(addr: SocketAddr) -> RawResponse {
    raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=20] hello", Some(100)),
        false,
    )
    .await
}

/// A call the simulator holds (a stall of `stall_ms`) until the caller hangs up.
async fn stalled_converse(addr: SocketAddr) -> RawResponse {
    raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:fault=stall] hold on", Some(100)),
        false,
    )
    .await
}

async fn readyz(addr: SocketAddr) -> RawResponse {
    raw_request(addr, "GET", "/readyz", "", false).await
}

fn outage_ledger(server: &RedisServer, on_error: &str) -> String {
    format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\ntimeout_ms = 100\nlease_secs = 2\n{on_error}\n",
        server.url()
    )
}

/// `on_error = "fail-closed"`: while Redis is frozen, and again while it is down, requests get 503
/// `ServiceUnavailableException` with a retry hint and readiness is false; both come back with
/// Redis, and every reservation and permit is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_503_while_redis_is_out_and_recovers() {
    let Some(mut server) = RedisServer::start().await else {
        return;
    };
    let sim = start_simulator("time_to_first_token_ms = 5\ntokens_per_second = 0\n").await;
    let config = proxy_config(
        sim.addr,
        &sonnet_pool(1_000_000, 16),
        &outage_ledger(&server, "on_error = \"fail-closed\""),
    );
    let proxy = start_proxy(config).await;
    let addr = proxy.addr;
    assert_eq!(converse(addr).await.status, 200);
    let load = Load::start(addr, SONNET_US);

    for outage in ["frozen (SIGSTOP)", "down (killed, restarted empty)"] {
        if outage.starts_with("frozen") {
            server.pause();
        } else {
            server.kill();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = loop {
            let r = converse(addr).await;
            if r.status == 503 {
                break r;
            }
            assert!(Instant::now() < deadline, "{outage}: no 503 within 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(r.error_type(), "ServiceUnavailableException", "{outage}");
        assert!(
            r.header("x-amz-retry-after").is_some(),
            "{outage}: retry hint"
        );
        assert!(r.header("retry-after").is_some(), "{outage}: Retry-After");
        assert_eq!(readyz(addr).await.status, 503, "{outage}: not ready");
        // Keep Redis out for a while under load.
        tokio::time::sleep(Duration::from_millis(500)).await;
        if outage.starts_with("frozen") {
            server.resume();
        } else {
            server.restart().await;
        }
        let back = eventually(Duration::from_secs(10), "ready again", || async {
            readyz(addr).await.status == 200
        })
        .await;
        assert_eq!(
            converse(addr).await.status,
            200,
            "{outage}: admitting again"
        );
        println!("{outage}: ready again {back:?} after Redis returned");
    }
    let (ok, unavailable, _) = load.stop().await;
    println!("load: {ok} ok, {unavailable} unavailable");
    assert!(
        ok > 0 && unavailable > 0,
        "{ok} ok, {unavailable} unavailable"
    );
    let errors = scrape(addr)
        .await
        .get("tokengate_ledger_errors_total", &[("backend", "redis")]);
    assert!(errors > 0.0, "ledger errors counted");
    // Reserves that timed out but ran once Redis thawed hold leases nobody renews: they expire
    // (2 s) and the ledger returns to zero.
    assert_ledger_zero(&proxy).await;
    let observer = observer(&server).await;
    let s = shared_state(&observer, proxy.admission().pools()[0].limits()).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}

/// `on_error = "local"` with two expected replicas: while Redis is frozen the proxy keeps
/// admitting, within half of each limit; when Redis returns it admits from Redis again, and
/// nothing is left held in either ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_share_keeps_admitting_within_its_share_and_returns_to_redis() {
    let Some(server) = RedisServer::start().await else {
        return;
    };
    // Calls that say `[sim:fault=stall]` are held upstream (an hour) until the test hangs up.
    let sim =
        start_simulator("time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 3600000\n")
            .await;
    let config = proxy_config(
        sim.addr,
        &format!("{}max_wait_ms = 0\n", sonnet_pool(60_000, 4)),
        &outage_ledger(&server, "on_error = \"local\"\nexpected_replicas = 2"),
    );
    let proxy = start_proxy(config).await;
    let addr = proxy.addr;
    assert_eq!(converse(addr).await.status, 200);
    assert!(
        String::from_utf8_lossy(&readyz(addr).await.body).contains("shared"),
        "serving from Redis"
    );

    server.pause();
    // The first call after the freeze pays the timeout, then falls back: still admitted.
    assert_eq!(
        converse(addr).await.status,
        200,
        "admitted from the local share"
    );
    let ready = readyz(addr).await;
    assert_eq!(ready.status, 200, "a local share serves: still ready");
    assert!(String::from_utf8_lossy(&ready.body).contains("local_share"));
    // A concurrency share of 2 (4 / 2 replicas): two held calls fill it, and four more are
    // turned away on concurrency.
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(stalled_converse(addr)))
        .collect();
    eventually(Duration::from_secs(10), "two calls held", || async {
        let pools = proxy.admission().pool_views().await;
        pools[0].ledger.as_ref().map(|l| l.in_flight_requests) == Some(2)
    })
    .await;
    for _ in 0..4 {
        let r = converse(addr).await;
        assert_eq!(
            (r.status, r.header("x-tokengate-reason")),
            (429, Some("concurrency")),
            "the local share"
        );
    }
    for call in held {
        call.abort();
    }
    eventually(
        Duration::from_secs(10),
        "the held calls settled",
        || async {
            let pools = proxy.admission().pool_views().await;
            pools[0].ledger.as_ref().map(|l| l.in_flight_requests) == Some(0)
        },
    )
    .await;
    let pools = proxy.admission().pool_views().await;
    let local = pools[0].ledger.as_ref().expect("local snapshot");
    assert_eq!(
        local.tokens_capacity, 30_000,
        "half of 60,000 tokens per minute"
    );
    scrape(addr)
        .await
        .expect("tokengate_ledger_fallback_total", &[], 1.0);

    server.resume();
    eventually(Duration::from_secs(10), "back on Redis", || async {
        String::from_utf8_lossy(&readyz(addr).await.body).contains("shared")
    })
    .await;
    let observer = observer(&server).await;
    let limits = proxy.admission().pools()[0].limits();
    let call = tokio::spawn(stalled_converse(addr));
    eventually(
        Duration::from_secs(5),
        "a call in flight in Redis",
        || async { shared_state(&observer, limits).await.in_flight_requests == 1 },
    )
    .await;
    call.abort();
    assert_eq!(converse(addr).await.status, 200, "admitted through Redis");
    assert_ledger_zero(&proxy).await;
    let s = shared_state(&observer, limits).await;
    assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{s:?}");
}
