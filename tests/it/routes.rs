//! Application routes and caller identity through the proxy, with aws-sdk-bedrockruntime:
//! bearer and SigV4 keys identify the route, route rules (models, maxTokens ceiling) hold, a
//! retry draws on the recovery budget, shadow mode forwards what it would reject, and a
//! high-priority route keeps its guaranteed share of a saturated pool while lending it when idle.
//! (Over 500 lines: the route cases share one harness; the move to tests/it/ will split them.)

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use crate::common::*;
use aws_sdk_bedrockruntime::Client;
use tokio::time::Instant;

const TRIAGE_KEY: &str = "tg-triage-0123456789";
const BACKLOG_KEY: &str = "tg-backlog-0123456789";

fn haiku_pool(tokens_per_minute: u64, max_wait_ms: u64, extra: &str) -> String {
    format!(
        "[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = {tokens_per_minute}\n\
         max_concurrency = 64\noutput_burndown = 1\ndefault_max_tokens = 500\nmax_wait_ms = {max_wait_ms}\n{extra}\n"
    )
}

/// Bearer mode with two routes; `triage` gets `triage_extra` (e.g. shares), and the pools follow.
fn bearer_routes(triage_extra: &str, backlog_extra: &str) -> String {
    format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n\
         [[routes]]\nname = \"triage\"\npriority = 10\nbearer_token_sha256 = \"{}\"\n{triage_extra}\n\n\
         [[routes]]\nname = \"backlog\"\nbearer_token_sha256 = \"{}\"\n{backlog_extra}\n",
        sha256_hex(TRIAGE_KEY),
        sha256_hex(BACKLOG_KEY)
    )
}

const INSTANT_SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\n";

async fn converse(client: &Client, prompt: &str, max: i32) -> Result<i32, String> {
    client
        .converse()
        .model_id(HAIKU)
        .messages(user_message(prompt))
        .inference_config(max_tokens(max))
        .send()
        .await
        .map(|out| out.usage().map_or(0, |u| u.output_tokens()))
        .map_err(|e| {
            use aws_sdk_bedrockruntime::error::ProvideErrorMetadata;
            let e = e.into_service_error();
            format!("{}: {}", e.code().unwrap_or("?"), e.message().unwrap_or(""))
        })
}

/// `result` is an error whose code is `code`.
fn assert_refused<T: std::fmt::Debug>(result: &Result<T, String>, code: &str) {
    assert!(
        result.as_ref().is_err_and(|e| e.starts_with(code)),
        "expected {code}, got {result:?}"
    );
}

fn route_requests(m: &scrape::Scrape, route: &str, outcome: &str) -> f64 {
    m.get(
        "tokengate_route_requests_total",
        &[("pool", "haiku"), ("route", route), ("outcome", outcome)],
    )
}

#[tokio::test]
async fn bearer_keys_identify_the_route_for_the_rust_sdk() {
    let extra = bearer_routes("", "");
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(1_000_000, 0, ""), &extra).await;
    let addr = stack.proxy.addr;
    converse(&bearer_client(addr, TRIAGE_KEY), "hello", 50)
        .await
        .expect("triage key admitted");
    for _ in 0..2 {
        converse(&bearer_client(addr, BACKLOG_KEY), "hello", 50)
            .await
            .expect("backlog key admitted");
    }
    let wrong = converse(&bearer_client(addr, "tg-not-issued"), "hello", 50).await;
    assert_refused(&wrong, "AccessDeniedException");
    // SigV4 credentials in bearer mode carry no bearer key.
    let signed = converse(&stack.client(), "hello", 50).await;
    assert_refused(&signed, "AccessDeniedException");
    let m = scrape(addr).await;
    assert_eq!(route_requests(&m, "triage", "admitted"), 1.0);
    assert_eq!(route_requests(&m, "backlog", "admitted"), 2.0);
    m.expect(
        "tokengate_auth_failures_total",
        &[("mode", "bearer"), ("reason", "bad_token")],
        1.0,
    );
    m.expect(
        "tokengate_auth_failures_total",
        &[("mode", "bearer"), ("reason", "malformed")],
        1.0,
    );
    // Nothing that failed identification reached upstream.
    assert_eq!(stack.sim.simulator.stats().calls(), 3);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn sigv4_keys_issued_per_route_are_verified() {
    let extra = "[auth]\nmode = \"sigv4\"\n\n\
        [[routes]]\nname = \"triage\"\naccess_key_id = \"AKIATRIAGE0000000001\"\nsecret_access_key = \"triage-secret\"\n\n\
        [[routes]]\nname = \"backlog\"\naccess_key_id = \"AKIABACKLOG000000001\"\nsecret_access_key = \"backlog-secret\"\n";
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(1_000_000, 0, ""), extra).await;
    let addr = stack.proxy.addr;
    converse(
        &keyed_client(addr, "AKIATRIAGE0000000001", "triage-secret"),
        "hello",
        50,
    )
    .await
    .expect("triage's own signature verifies");
    let wrong_secret = converse(
        &keyed_client(addr, "AKIATRIAGE0000000001", "backlog-secret"),
        "hello",
        50,
    )
    .await;
    assert_refused(&wrong_secret, "AccessDeniedException");
    let unknown = converse(
        &keyed_client(addr, "AKIANOTISSUED0000001", "x"),
        "hello",
        50,
    )
    .await;
    assert_refused(&unknown, "UnrecognizedClientException");
    let m = scrape(addr).await;
    assert_eq!(route_requests(&m, "triage", "admitted"), 1.0);
    m.expect(
        "tokengate_auth_failures_total",
        &[("mode", "sigv4"), ("reason", "signature")],
        1.0,
    );
    m.expect(
        "tokengate_auth_failures_total",
        &[("mode", "sigv4"), ("reason", "unknown_key")],
        1.0,
    );
    assert_eq!(stack.sim.simulator.stats().calls(), 1);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn route_rules_allow_list_and_max_tokens_ceiling() {
    let extra = bearer_routes(
        &format!("models = [\"{HAIKU}\"]\nmax_tokens_ceiling = 100\nmax_tokens_policy = \"clamp\""),
        &format!(
            "models = [\"{SONNET_US}\"]\nmax_tokens_ceiling = 100\nmax_tokens_policy = \"reject\""
        ),
    );
    let pools = format!(
        "{}{}",
        haiku_pool(1_000_000, 0, ""),
        sonnet_pool(1_000_000, 64)
    );
    let stack = Stack::start(INSTANT_SIM, &pools, &extra).await;
    let addr = stack.proxy.addr;
    let triage = bearer_client(addr, TRIAGE_KEY);
    // Clamped: the forwarded body asks for 100, so upstream generates at most 100.
    let output = converse(&triage, "[sim:output=400] write at length", 1000)
        .await
        .expect("clamped and admitted");
    assert_eq!(output, 100);
    // Not on triage's allow-list.
    let denied = triage
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hello"))
        .send()
        .await
        .expect_err("sonnet is not allowed for triage");
    let denied = denied.into_service_error();
    assert!(denied.is_access_denied_exception(), "{denied:?}");
    // Backlog rejects above its ceiling instead, and says what to send.
    let rejected = bearer_client(addr, BACKLOG_KEY)
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hello"))
        .inference_config(max_tokens(1000))
        .send()
        .await
        .expect_err("above backlog's ceiling");
    let rejected = rejected.into_service_error();
    assert!(rejected.is_validation_exception(), "{rejected:?}");
    assert!(rejected.to_string().contains("at most 100"), "{rejected}");
    let m = scrape(addr).await;
    m.expect(
        "tokengate_max_tokens_clamped_total",
        &[("pool", "haiku"), ("route", "triage")],
        1.0,
    );
    assert_eq!(
        m.get(
            "tokengate_route_requests_total",
            &[
                ("pool", "sonnet4-us"),
                ("route", "triage"),
                ("outcome", "not_allowed")
            ]
        ),
        1.0
    );
    assert_eq!(stack.sim.simulator.stats().calls(), 1);
    stack.assert_ledger_zero().await;
}

/// Fills the pool with first attempts until one is turned away; then the SDK's retry of that
/// call (same `amz-sdk-invocation-id`, `amz-sdk-request: attempt=2`) is admitted from the retry
/// reserve while first attempts stay out, until the route's recovery budget is spent.
#[tokio::test]
async fn retries_draw_on_the_recovery_budget_and_first_attempts_cannot() {
    // 60,000 per minute, a reserve of 0.25 (15,000) and a budget of 0.1 (6,000) per minute.
    let pool = haiku_pool(60_000, 0, "retry_reserve = 0.25");
    let extra = "[[routes]]\nname = \"app\"\nrecovery_budget = 0.1\n";
    let stack = Stack::start(INSTANT_SIM, &pool, extra).await;
    let addr = stack.proxy.addr;
    let path = model_path(HAIKU, "converse");
    // Each reserves about 4,030 (4,000 + a small input estimate) and is charged a little less.
    // A twelfth first attempt would be about 3,300 tokens over the 45,000 (refill: 1,000 a
    // second), so the count below does not depend on how fast the calls come.
    let body = converse_body("[sim:output=4000] go", Some(4000));
    let call = |id: String, attempt: &'static str| {
        let path = path.clone();
        let body = body.clone();
        async move {
            raw_request_with(
                addr,
                "POST",
                &path,
                body,
                false,
                &[
                    ("amz-sdk-invocation-id", id.as_str()),
                    ("amz-sdk-request", attempt),
                ],
            )
            .await
        }
    };
    let mut admitted = 0;
    let turned_away = loop {
        let id = format!("call-{admitted}");
        let r = call(id.clone(), "attempt=1; max=3").await;
        if r.status == 429 {
            break id;
        }
        assert_eq!(r.status, 200, "{}", r.message());
        admitted += 1;
        assert!(admitted < 20, "the pool never filled");
    };
    // 45,000 of 60,000 is what first attempts may use: 11 requests of about 4,030.
    assert_eq!(admitted, 11);
    let retry = call(turned_away, "attempt=2; max=3").await;
    assert_eq!(
        retry.status,
        200,
        "a retry uses the reserve: {}",
        retry.message()
    );
    let first = call("call-new".into(), "attempt=1; max=3").await;
    assert_eq!(first.status, 429, "first attempts cannot");
    // The budget (6,000) holds one more retry of 4,030? No: about 2,000 are left of it.
    let second = call("call-new".into(), "attempt=2; max=3").await;
    assert_eq!(second.status, 429, "the route's recovery budget is spent");
    let m = scrape(addr).await;
    m.expect(
        "tokengate_recovery_admissions_total",
        &[("pool", "haiku"), ("route", "app")],
        1.0,
    );
    assert_eq!(stack.sim.simulator.stats().throttled(), 0);
    stack.assert_ledger_zero().await;
}

/// Shadow mode forwards every request and counts the ones it would have turned away.
#[tokio::test]
async fn shadow_mode_forwards_everything_and_counts_what_it_would_reject() {
    let pool = haiku_pool(10_000, 0, "shadow = true");
    let stack = Stack::start(INSTANT_SIM, &pool, "").await;
    let client = stack.client();
    let mut ok = 0;
    for _ in 0..8 {
        converse(&client, "[sim:output=2000] go", 2000)
            .await
            .expect("shadow mode forwards");
        ok += 1;
    }
    assert_eq!(ok, 8);
    let m = scrape(stack.proxy.addr).await;
    let would_reject = m.get(
        "tokengate_shadow_rejections_total",
        &[
            ("pool", "haiku"),
            ("route", "default"),
            ("reason", "tokens"),
        ],
    );
    // 10,000 tokens hold four reservations of about 2,010 (the rest refill meanwhile at most a
    // little): at least three of the eight would have been turned away.
    assert!(
        (3.0..=4.0).contains(&would_reject),
        "would have rejected {would_reject}"
    );
    assert_eq!(
        route_requests(&m, "default", "shadow_rejected"),
        would_reject
    );
    assert_eq!(stack.sim.simulator.stats().calls(), 8);
    stack.assert_ledger_zero().await;
}

/// Keeps `clients` callers of one route busy while `run` is set.
fn saturate(
    addr: std::net::SocketAddr,
    key: &'static str,
    clients: usize,
    run: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let run = run.clone();
            tokio::spawn(async move {
                let client = bearer_client(addr, key);
                while run.load(Ordering::Relaxed) {
                    if converse(&client, "[sim:output=200] summarise the ticket", 200)
                        .await
                        .is_err()
                    {
                        // Turned away after the queue wait: come back shortly.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            })
        })
        .collect()
}

/// The pool as the ledger and the routes see it now.
struct Reading {
    available: i64,
    triage: u64,
    backlog: u64,
    /// Requests that had to wait for room, or were turned away: demand above supply.
    waited: u64,
}

async fn reading(stack: &Stack) -> Reading {
    let pool = &stack.proxy.admission().pool_views().await[0];
    let charged = |name: &str| {
        pool.routes
            .iter()
            .find(|r| r.name == name)
            .map_or(0, |r| r.charged_tokens)
    };
    let m = |name: &str, labels: &[(&str, &str)]| {
        crate::common::metric(&stack.proxy, name, labels) as u64
    };
    let waited = m(
        "tokengate_queue_outcomes_total",
        &[("pool", "haiku"), ("outcome", "admitted")],
    ) + m(
        "tokengate_queue_outcomes_total",
        &[("pool", "haiku"), ("outcome", "timed_out")],
    ) + pool.rejected.tokens
        + m(
            "tokengate_rejections_total",
            &[("pool", "haiku"), ("reason", "share")],
        );
    Reading {
        available: pool.ledger.as_ref().expect("ledger").tokens_available,
        triage: charged("triage"),
        backlog: charged("backlog"),
        waited,
    }
}

/// Polls until `done` holds of a reading (every 20 ms, for at most 60 s); calls `each` on
/// every reading on the way. Returns the last.
async fn until(
    stack: &Stack,
    what: &str,
    mut each: impl FnMut(&Reading),
    done: impl Fn(&Reading) -> bool,
) -> Reading {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = reading(stack).await;
        each(&r);
        if done(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Triage (priority 10, `min_share` 0.6) and backlog share one saturated pool: triage gets at
/// least its share; once triage has been quiet for `share_idle_ms` backlog takes the whole
/// pool; when triage comes back it regains its share from its first requests. Phases end on
/// what the ledger has charged, not on the clock; upstream (quota equal to the pool's) never
/// throttles.
#[tokio::test]
async fn a_guaranteed_route_keeps_its_share_lends_it_when_idle_and_regains_it() {
    const TPM: u64 = 120_000;
    // Each window measures this many tokens charged: four seconds of refill.
    const WINDOW: u64 = 8_000;
    // What a borrower must leave while a higher-priority route is active (`priority_margin`).
    const MARGIN: i64 = 12_000;
    let idle = Duration::from_millis(1000);
    let sim = format!("{INSTANT_SIM}default_tokens_per_minute = {TPM}\n");
    let extra = format!(
        "[admission]\nshare_idle_ms = {}\npriority_margin = 0.1\n\n{}",
        idle.as_millis(),
        bearer_routes("[routes.shares]\nhaiku = { min = 0.6 }", "")
    );
    let stack = Stack::start(&sim, &haiku_pool(TPM, 1500, ""), &extra).await;
    let addr = stack.proxy.addr;

    // Phase 1: both saturate. Once the full bucket is drained, triage gets at least its share
    // of what the pool gives, while both routes ask for more than it has.
    let triage_on = Arc::new(AtomicBool::new(true));
    let backlog_on = Arc::new(AtomicBool::new(true));
    let triage = saturate(addr, TRIAGE_KEY, 8, triage_on.clone());
    let backlog = saturate(addr, BACKLOG_KEY, 8, backlog_on.clone());
    let start = until(
        &stack,
        "the bucket drained",
        |_| {},
        |r| r.available < 2_000,
    )
    .await;
    let end = until(
        &stack,
        "phase 1",
        |_| {},
        |r| r.triage + r.backlog >= start.triage + start.backlog + WINDOW,
    )
    .await;
    let (t, b) = (end.triage - start.triage, end.backlog - start.backlog);
    let share = t as f64 / (t + b) as f64;
    assert!(share >= 0.6, "triage got {share:.2} of {} tokens", t + b);
    assert!(
        end.waited > start.waited,
        "both routes asked for more than the pool had"
    );

    // Phase 2: triage stops. Once it has been quiet for share_idle_ms its guarantee is lent:
    // backlog keeps the bucket below what it must leave for an active triage (the priority
    // margin alone), while it is charged a window's worth.
    triage_on.store(false, Ordering::Relaxed);
    for task in triage {
        task.await.expect("triage client");
    }
    tokio::time::sleep(idle).await;
    let start = reading(&stack).await;
    let mut most = i64::MIN;
    let end = until(
        &stack,
        "phase 2",
        |r| most = most.max(r.available),
        |r| r.backlog >= start.backlog + WINDOW,
    )
    .await;
    assert_eq!(end.triage, start.triage, "triage is quiet");
    assert!(
        most < MARGIN,
        "backlog takes the idle capacity: the bucket held up to {most} tokens"
    );

    // Phase 3: triage returns and gets at least its share from its first requests on.
    triage_on.store(true, Ordering::Relaxed);
    let triage = saturate(addr, TRIAGE_KEY, 8, triage_on.clone());
    let start = until(&stack, "triage back", |_| {}, |r| r.triage > end.triage).await;
    let end = until(
        &stack,
        "phase 3",
        |_| {},
        |r| r.triage + r.backlog >= start.triage + start.backlog + WINDOW,
    )
    .await;
    let (t, b) = (end.triage - start.triage, end.backlog - start.backlog);
    let regained = t as f64 / (t + b) as f64;
    assert!(
        regained >= 0.6,
        "triage regained only {regained:.2} of the pool"
    );

    triage_on.store(false, Ordering::Relaxed);
    backlog_on.store(false, Ordering::Relaxed);
    for task in triage.into_iter().chain(backlog) {
        task.await.expect("client");
    }
    assert_eq!(
        stack.sim.simulator.stats().throttled(),
        0,
        "upstream never throttles"
    );
    stack.assert_ledger_zero().await;
    // /v1/pools shows each route's share and use.
    let states = stack.proxy.admission().pool_views().await;
    let routes = &states[0].routes;
    assert_eq!(routes[0].name, "triage");
    assert_eq!((routes[0].priority, routes[0].min_share), (10, 0.6));
    assert!(routes[0].charged_tokens >= end.triage && routes[1].charged_tokens >= end.backlog);
    assert_eq!(
        (routes[0].reserved_tokens, routes[1].reserved_tokens),
        (0, 0)
    );
}
