//! Daily quotas end to end: upstream's daily 429 classified (the per-minute limit untouched,
//! callers told `daily_quota`), a pool's own `tokens_per_day`, and the account's
//! `admission.account_tokens_per_day` across pools; `/v1/pools` shows what is left.

use serde_json::Value;

use crate::common::*;

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

async fn pools_json(stack: &Stack) -> Value {
    let r = raw_request(stack.proxy.addr, "GET", "/v1/pools", "", false).await;
    serde_json::from_slice(&r.body).expect("json")
}

#[tokio::test]
async fn an_upstream_daily_429_leaves_the_minute_limit_alone_and_says_daily_quota() {
    // Upstream's day holds 5,000 tokens; the proxy knows no daily quota.
    let sim = format!("{FAST_SIM}default_tokens_per_day = 5000\n");
    let stack = Stack::start(&sim, &sonnet_pool(100_000, 8), "").await;
    let ok = converse(
        stack.proxy.addr,
        SONNET_US,
        "[sim:output=900] hi",
        Some(1_000),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.message());
    // 900 x 5 + input charged to upstream's day, about 490 left: 4,000 does not fit.
    let r = converse(
        stack.proxy.addr,
        SONNET_US,
        "[sim:output=10] again",
        Some(4_000),
    )
    .await;
    assert_eq!(
        (r.status, r.error_type(), r.header("x-tokengate-reason")),
        (429, "ThrottlingException", Some("daily_quota"))
    );
    assert!(
        r.message().contains("per day"),
        "upstream's message passed on: {}",
        r.message()
    );
    assert!(r.header("x-amz-retry-after").is_some(), "a hint");
    let pool = &pools_json(&stack).await["pools"][0];
    assert_eq!(
        pool["effective_tokens_per_minute"], pool["usable_tokens_per_minute"],
        "no AIMD shrink: {pool}"
    );
    assert_eq!(pool["upstream_throttles"], 0);
    let m = scrape(stack.proxy.addr).await;
    let s = [("pool", "sonnet4-us")];
    m.expect("tokengate_upstream_daily_throttles_total", &s, 1.0);
    m.expect("tokengate_upstream_throttles_total", &s, 0.0);
    // Through the SDK, a ThrottlingException.
    let e = stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=5] sdk"))
        .inference_config(max_tokens(4_000))
        .send()
        .await
        .expect_err("upstream's day is spent");
    assert!(e.into_service_error().is_throttling_exception());
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn a_pools_own_day_refuses_with_daily_quota_and_shows_what_is_left() {
    let pools = format!(
        "{}tokens_per_day = 25000\nmax_wait_ms = 0\n",
        sonnet_pool(20_000, 8)
    );
    let stack = Stack::start(FAST_SIM, &pools, "").await;
    let addr = stack.proxy.addr;
    let call = |max| converse(addr, SONNET_US, "[sim:output=10] hi", Some(max));
    // Two calls settle at about 70 tokens each: the day keeps almost all of it.
    for _ in 0..2 {
        assert_eq!(call(19_000).await.status, 200);
    }
    let day = &pools_json(&stack).await["pools"][0]["ledger"];
    let left = day["day_tokens_available"]
        .as_i64()
        .expect("a daily bucket");
    assert!((24_000..25_000).contains(&left), "{day}");
    assert_eq!(day["day_tokens_capacity"], 25_000);
    assert!(
        day["day_full_in_ms"].as_u64().expect("full in") > 0,
        "{day}"
    );
    // What the day cannot hold: refused by the proxy itself, before upstream.
    let sent = stack.sim.simulator.stats().operations.values().sum::<u64>();
    let r = call(19_000).await;
    assert_eq!(
        r.status,
        200,
        "the minute and the day both hold it: {}",
        r.message()
    );
    let r = converse(
        stack.proxy.addr,
        SONNET_US,
        "[sim:output=19000] long",
        Some(19_000),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    // The long answer charged 19,000 x 5: the day is in debt now.
    let r = call(1_000).await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("daily_quota"))
    );
    assert!(
        r.message().contains("tokens_per_day"),
        "says which quota: {}",
        r.message()
    );
    assert_eq!(
        stack.sim.simulator.stats().operations.values().sum::<u64>(),
        sent + 2,
        "the refusal never went upstream"
    );
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_rejections_total",
        &[("pool", "sonnet4-us"), ("reason", "daily_quota")],
        1.0,
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn the_accounts_day_spans_pools_and_goes_back_when_a_pool_refuses() {
    let pools = format!(
        "{}max_wait_ms = 0\n\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 5000\n\
         max_concurrency = 8\ndefault_max_tokens = 100\nmax_wait_ms = 0\n",
        sonnet_pool(100_000, 8)
    );
    let stack = Stack::start(
        FAST_SIM,
        &pools,
        "[admission]\naccount_tokens_per_day = 40000\n",
    )
    .await;
    let addr = stack.proxy.addr;
    let call =
        |model: &'static str, text: &'static str, max| converse(addr, model, text, Some(max));
    let account_left = || async {
        let budgets = pools_json(&stack).await["budgets"].clone();
        assert_eq!(budgets[0]["scope"], "account", "{budgets}");
        assert!(
            budgets[0]["windows"][0]["full_in_ms"]
                .as_u64()
                .expect("read")
                > 0
        );
        budgets[0]["windows"][0]["available"]
            .as_i64()
            .expect("read")
    };
    // Sonnet charges about 10 + 5,000 x 5 of the account's day; haiku, another pool, 4,010.
    let r = call(SONNET_US, "[sim:output=5000] long", 5_000).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let r = call(HAIKU, "[sim:output=4000] long", 4_000).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let left = account_left().await;
    assert!(
        (10_900..11_100).contains(&left),
        "both pools' charges are gone: {left}"
    );
    // Haiku's minute (about 1,000 left) refuses 3,000; the account's day held them and gets
    // them back.
    let r = call(HAIKU, "[sim:output=5] hi", 3_000).await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("tokens"))
    );
    // Given back (the day refills about a token every two seconds meanwhile).
    let back = account_left().await;
    assert!(
        (left..=left + 2).contains(&back),
        "given back: {back} after {left}"
    );
    // 12,000 fit sonnet's minute but not the account's day.
    let r = call(SONNET_US, "[sim:output=5] hi", 12_000).await;
    assert_eq!(
        (
            r.status,
            r.header("x-tokengate-reason"),
            r.header("x-tokengate-pool")
        ),
        (429, Some("daily_quota"), Some("sonnet4-us"))
    );
    assert!(
        r.message().contains("account_tokens_per_day"),
        "{}",
        r.message()
    );
    let back = account_left().await;
    assert!(
        (left..=left + 4).contains(&back),
        "nothing taken: {back} after {left}"
    );
    let r = call(HAIKU, "[sim:output=5] small", 100).await;
    assert_eq!(r.status, 200, "{}", r.message());
    stack.assert_ledger_zero().await;
}
