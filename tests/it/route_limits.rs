//! A route's limits across pools and replicas: `budgets` (hour, day, 30 days) and
//! `max_concurrency`, each refused with its own reason and a hint; `/v1/pools` shows the budgets.

use serde_json::Value;

use crate::common::*;

const FAST_SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\nstall_ms = 2000\n";

async fn pools_json(stack: &Stack) -> Value {
    let r = raw_request(stack.proxy.addr, "GET", "/v1/pools", "", false).await;
    serde_json::from_slice(&r.body).expect("json")
}

#[tokio::test]
async fn a_route_budget_refuses_with_reason_budget_and_a_hint() {
    let routes = "[[routes]]\nname = \"batch\"\nbudgets = { tokens_per_hour = 20000, tokens_per_day = 30000 }\n\
                  [auth]\ndefault_route = \"batch\"\n";
    let stack = Stack::start(FAST_SIM, &sonnet_pool(100_000, 8), routes).await;
    let addr = stack.proxy.addr;
    // About 10 + 3,000 x 5 charged to both windows: 5,000 left of the hour.
    let r = converse(addr, SONNET_US, "[sim:output=3000] long", Some(3_000)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let r = converse(addr, SONNET_US, "[sim:output=5] hi", Some(6_000)).await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("budget"))
    );
    assert!(
        r.message().contains("route \"batch\"") && r.message().contains("budgets.tokens_per_hour"),
        "{}",
        r.message()
    );
    assert!(r.header("x-amz-retry-after").is_some());
    let budgets = pools_json(&stack).await["budgets"].clone();
    assert_eq!(budgets[0]["scope"], "route:batch", "{budgets}");
    let hour = budgets[0]["windows"][0]["available"]
        .as_i64()
        .expect("read");
    assert!((4_900..5_100).contains(&hour), "{budgets}");
    let r = converse(addr, SONNET_US, "[sim:output=5] hi", Some(1_000)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn a_routes_max_concurrency_spans_its_calls_and_frees_as_they_end() {
    let routes =
        "[[routes]]\nname = \"batch\"\nmax_concurrency = 2\n[auth]\ndefault_route = \"batch\"\n";
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), routes).await;
    let addr = stack.proxy.addr;
    // Two calls held 2 s upstream take the route's two slots (the pool has eight).
    let held: Vec<_> = (0..2)
        .map(|k| {
            let text = format!("[sim:output=5] [sim:fault=stall] held {k}");
            tokio::spawn(async move { converse(addr, SONNET_US, &text, Some(100)).await })
        })
        .collect();
    let proxy = &stack.proxy;
    eventually(
        std::time::Duration::from_secs(10),
        "two calls in flight",
        || in_flight(proxy, "sonnet4-us") == 2,
    )
    .await;
    let r = converse(addr, SONNET_US, "[sim:output=5] third", Some(100)).await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("route_concurrency"))
    );
    assert!(r.message().contains("this route"), "{}", r.message());
    assert!(r.header("x-amz-retry-after").is_some());
    for call in held {
        assert_eq!(call.await.expect("task").status, 200);
    }
    // Their slots came back with their settlement.
    let r = converse(addr, SONNET_US, "[sim:output=5] after", Some(100)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let m = scrape(addr).await;
    m.expect(
        "tokengate_rejections_total",
        &[("pool", "sonnet4-us"), ("reason", "route_concurrency")],
        1.0,
    );
    stack.assert_ledger_zero().await;
}
