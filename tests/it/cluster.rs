//! The shared ledger on a real Redis Cluster (`ledger.url = "redis+cluster://..."`): pools
//! spread over the masters' slots, and a master killed under load while the outage policy
//! (`on_error`) holds. Each test starts its own cluster on loopback ports
//! (`common/redis_cluster.rs`); without `redis-server` and `redis-cli` it is a named, counted
//! skip locally and a failure under CI (`common/skip.rs`).

use std::{sync::atomic::Ordering, time::Duration};

use crate::common::{
    load::Load,
    redis_cluster::{self, RedisCluster},
    redis_server::skip,
    *,
};
use tokengate::ledger::{Ledger, Limits, RedisLedger, RedisOptions, ReserveRequest, Verdict};
use tokio::time::Instant;

/// A cluster of `masters` masters with `replicas` replicas each, in `dir`; `None` after a
/// recorded skip when the tools are missing.
pub async fn start_cluster(
    dir: &std::path::Path,
    masters: usize,
    replicas: usize,
) -> Option<RedisCluster> {
    if let Some(missing) = redis_cluster::missing_tools(true) {
        skip::skip(missing);
        return None;
    }
    Some(
        RedisCluster::start(dir, masters, replicas)
            .await
            .unwrap_or_else(|e| panic!("the cluster starts: {e}")),
    )
}

/// A ledger of the test's own on `url`.
pub async fn cluster_ledger(url: String, timeout: Duration) -> RedisLedger {
    let options = RedisOptions {
        url,
        timeout,
        lease: Duration::from_secs(60),
    };
    RedisLedger::connect(options)
        .await
        .expect("a usable cluster URL")
}

/// The state key of `pool` (`ledger/scripts.rs`): its slot is the pool's.
fn state_key(pool: &str) -> String {
    format!("tg:v1:{{{pool}}}:s")
}

/// One pool name per master (`prefix-N`, the first N whose slot each master serves), in the
/// masters' order of discovery, with the master's port.
async fn pools_on_every_master(
    cluster: &RedisCluster,
    prefix: &str,
    masters: usize,
) -> Vec<(String, u16)> {
    let mut found: Vec<(String, u16)> = Vec::new();
    for n in 0..1000 {
        let pool = format!("{prefix}-{n}");
        let master = cluster
            .master_of(&state_key(&pool))
            .await
            .expect("a master serves the slot");
        if found.iter().all(|(_, m)| *m != master) {
            found.push((pool, master));
        }
        if found.len() == masters {
            return found;
        }
    }
    panic!("no pool names spread over {masters} masters: {found:?}");
}

fn request(pool: &str) -> ReserveRequest<'_> {
    ReserveRequest {
        pool,
        limits: LIMITS,
        tokens: 1_000,
        share: None,
        hold_back: 0,
    }
}

const LIMITS: Limits = Limits {
    tokens_per_minute: 60_000,
    requests_per_minute: None,
    max_concurrency: 2,
    tokens_per_day: None,
};

/// Three pools on three masters: each reservation's lease lands on the master of its pool's
/// slot (read there directly), all or nothing holds per pool (its concurrency of two binds on
/// its own), and every settlement returns its pool to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_spread_over_the_masters_each_on_its_own_slot() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(cluster) = start_cluster(dir.path(), 3, 0).await else {
        return;
    };
    let ledger = cluster_ledger(cluster.url(), Duration::from_secs(5)).await;
    let pools = pools_on_every_master(&cluster, "spread", 3).await;
    let mut held = Vec::new();
    for (pool, master) in &pools {
        for _ in 0..2 {
            match ledger.reserve(&request(pool)).await.expect("reserve") {
                Verdict::Granted(r) => held.push(r),
                Verdict::Refused(r) => panic!("{pool}: refused {r:?}"),
            }
        }
        let third = ledger.reserve(&request(pool)).await.expect("reserve");
        assert!(
            matches!(third, Verdict::Refused(ref r) if r.in_flight_requests == 2),
            "{pool}: its own concurrency binds: {third:?}"
        );
        let leases = redis_cluster::command(*master, &format!("ZCARD tg:v1:{{{pool}}}:l"))
            .await
            .expect("ZCARD on the pool's master");
        assert_eq!(leases, "2", "{pool}: both leases on master {master}");
    }
    for reservation in held {
        ledger.settle(reservation, 500).await.expect("settle");
    }
    for (pool, master) in &pools {
        let s = ledger.snapshot(pool, &LIMITS).await.expect("snapshot");
        assert_eq!((s.reserved_tokens, s.in_flight_requests), (0, 0), "{pool}");
        let leases = redis_cluster::command(*master, &format!("ZCARD tg:v1:{{{pool}}}:l"))
            .await
            .expect("ZCARD");
        assert_eq!(leases, "0", "{pool}");
    }
    assert!(ledger.is_healthy());
    assert_eq!(ledger.stats().unsettled_drops(), 0);
}

/// The models of the failover test's three pools, one pool per master.
const MODELS: [&str; 3] = [SONNET_US, HAIKU, "us.amazon.nova-lite-v1:0"];

fn cluster_pools(names: &[(String, u16)]) -> String {
    names
        .iter()
        .zip(MODELS)
        .map(|((name, _), model)| {
            format!(
                "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\ntokens_per_minute = 1000000\n\
                 max_concurrency = 16\noutput_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n\n"
            )
        })
        .collect()
}

/// A 3-master cluster with a replica per master, two proxies on it (one `fail-closed`, one
/// `local`) each calling all three pools without pause; the master of the first pool is killed
/// (SIGKILL) and its replica takes over. While it is out, the fail-closed proxy answers that
/// pool's calls 503 and keeps admitting the other masters' pools; the local proxy admits from its
/// local share throughout and returns to the cluster once the probe reaches every master. After
/// the failover every pool admits on both, and nothing leaks: both ledgers return to zero with no
/// reservation dropped unsettled, and the cluster holds no lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failover_under_load_keeps_the_outage_policy_and_leaks_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(mut cluster) = start_cluster(dir.path(), 3, 1).await else {
        return;
    };
    let pools = pools_on_every_master(&cluster, "failover", 3).await;
    let sim = start_simulator("time_to_first_token_ms = 5\ntokens_per_second = 0\n").await;
    let ledger = |on_error: &str| {
        format!(
            "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\ntimeout_ms = 100\nlease_secs = 2\n{on_error}\n",
            cluster.url()
        )
    };
    let closed = start_proxy(proxy_config(
        sim.addr,
        &cluster_pools(&pools),
        &ledger("on_error = \"fail-closed\""),
    ))
    .await;
    let local = start_proxy(proxy_config(
        sim.addr,
        &cluster_pools(&pools),
        &ledger("on_error = \"local\"\nexpected_replicas = 2"),
    ))
    .await;
    for proxy in [&closed, &local] {
        for model in MODELS {
            let r = converse(proxy.addr, model, "[sim:output=20] hello", Some(100)).await;
            assert_eq!(
                r.status,
                200,
                "{model} before the failover: {}",
                r.message()
            );
        }
    }
    let loads: Vec<Vec<Load>> = [&closed, &local]
        .iter()
        .map(|p| MODELS.iter().map(|m| Load::start(p.addr, m)).collect())
        .collect();
    let ok_everywhere = |loads: &Vec<Vec<Load>>| {
        loads
            .iter()
            .flatten()
            .map(|l| l.counts().ok.load(Ordering::Relaxed))
            .collect::<Vec<_>>()
    };
    let before = ok_everywhere(&loads);
    wait_for("every load admitted again", || {
        ok_everywhere(&loads)
            .iter()
            .zip(&before)
            .all(|(now, then)| now > then)
    })
    .await;

    let (victim_pool, victim) = pools[0].clone();
    cluster.kill(victim);
    let killed = Instant::now();
    wait_for(
        "the fail-closed proxy answers 503 for the dead master's pool",
        || loads[0][0].counts().unavailable.load(Ordering::Relaxed) > 0,
    )
    .await;
    let promoted = cluster
        .wait_failover(&state_key(&victim_pool), victim)
        .await
        .expect("a replica takes over");
    println!(
        "{victim_pool}: master {victim} killed, replica {promoted} serving after {:?}",
        killed.elapsed()
    );

    // Back on the cluster: each pool admits on both proxies, the local one serves from Redis.
    for proxy in [&closed, &local] {
        for model in MODELS {
            let deadline = Instant::now() + Duration::from_secs(20);
            while converse(proxy.addr, model, "[sim:output=20] hello", Some(100))
                .await
                .status
                != 200
            {
                assert!(
                    Instant::now() < deadline,
                    "{model}: not admitted after the failover"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(
        &raw_request(local.addr, "GET", "/readyz", "", false)
            .await
            .body,
    )
    .contains("shared")
    {
        assert!(
            Instant::now() < deadline,
            "the local proxy did not return to the cluster"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = ok_everywhere(&loads);
    wait_for("every load admitted after the failover", || {
        ok_everywhere(&loads)
            .iter()
            .zip(&after)
            .all(|(now, then)| now > then)
    })
    .await;

    let mut outcomes = Vec::new();
    for proxy_loads in loads {
        let mut per_pool = Vec::new();
        for load in proxy_loads {
            per_pool.push(load.stop().await);
        }
        outcomes.push(per_pool);
    }
    println!(
        "(ok, 503, other) per pool, fail-closed: {:?}; local: {:?}",
        outcomes[0], outcomes[1]
    );
    assert!(
        outcomes[0][0].1 > 0,
        "fail-closed: the dead master's pool got 503s"
    );
    for (pool, outcome) in outcomes[0].iter().enumerate().skip(1) {
        assert_eq!(
            outcome.1, 0,
            "fail-closed: pool {pool} is on a live master: {outcome:?}"
        );
    }
    for outcome in outcomes.iter().flatten() {
        assert_eq!(outcome.2, 0, "nothing but 200 and 503: {outcome:?}");
    }
    for outcome in &outcomes[1] {
        assert_eq!(outcome.1, 0, "local: admitted throughout: {outcome:?}");
    }
    let local_metrics = scrape(local.addr).await;
    assert!(local_metrics.get("tokengate_ledger_fallback_total", &[]) >= 1.0);

    for proxy in [&closed, &local] {
        assert_ledger_zero(proxy).await;
    }
    let observer = cluster_ledger(cluster.url(), Duration::from_secs(5)).await;
    let limits = closed.admission().pools()[0].limits();
    for (pool, _) in &pools {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = observer.snapshot(pool, &limits).await.expect("snapshot");
            if (s.reserved_tokens, s.in_flight_requests) == (0, 0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{pool}: leases left in the cluster: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Polls `condition` every 10 ms for up to 30 s (a bound against hangs, not a timing assertion).
async fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    eventually(Duration::from_secs(30), what, condition).await;
}

/// A ledger that saw a master die and then sends nothing (no traffic, no lease on that master)
/// is healthy again once a replica took over: its background probe reaches every master of the
/// new slot map by itself, which is what brings a `local` fallback back to the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_probe_finds_the_promoted_master_without_traffic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(mut cluster) = start_cluster(dir.path(), 3, 1).await else {
        return;
    };
    let ledger = cluster_ledger(cluster.url(), Duration::from_millis(100)).await;
    let pools = pools_on_every_master(&cluster, "probe", 3).await;
    let (pool, victim) = pools[0].clone();
    let granted = ledger.reserve(&request(&pool)).await.expect("reserve");
    let Verdict::Granted(reservation) = granted else {
        panic!("{granted:?}");
    };
    ledger.settle(reservation, 100).await.expect("settle");
    cluster.kill(victim);
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Ok(verdict) = ledger.reserve(&request(&pool)).await {
        if let Verdict::Granted(reservation) = verdict {
            ledger.settle(reservation, 100).await.expect("settle");
        }
        assert!(
            Instant::now() < deadline,
            "calls to the dead master still succeed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !ledger.is_healthy(),
        "a failed call marks the ledger unavailable"
    );
    cluster
        .wait_failover(&state_key(&pool), victim)
        .await
        .expect("a replica takes over");
    wait_for("the probe finds every master again", || ledger.is_healthy()).await;
    let verdict = ledger
        .reserve(&request(&pool))
        .await
        .expect("served by the new master");
    let Verdict::Granted(reservation) = verdict else {
        panic!("{verdict:?}");
    };
    ledger.settle(reservation, 100).await.expect("settle");
    assert_eq!(ledger.stats().unsettled_drops(), 0);
}
