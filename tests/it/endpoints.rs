//! SageMaker endpoint pools end to end, with `aws-sdk-sagemakerruntime` through the proxy to the
//! simulator's fleets (which check that the proxy signs for `sagemaker` with its own key): both
//! operations admitted within the per-copy limit, a call queued then served, a refusal with a
//! hint the SDK obeys where the endpoint alone answers an error the SDK does not retry, the
//! copies followed from the control plane, the token envelope, errors in sagemaker-runtime's
//! names. Every test ends with the ledger at zero.

use std::time::Duration;

use crate::common::{
    assert_ledger_zero,
    endpoints::{self, chat, client, endpoint_pool, fleet, read_stream, tgi, until},
    raw_request, raw_request_with, scrape,
};
use aws_sdk_sagemakerruntime::error::ProvideErrorMetadata;

const ENDPOINT: &str = "llm-prod";
const POOL: &str = "summarizer";

/// A fleet of `ENDPOINT` with one copy serving one call at a time, generating
/// `tokens_per_second` from the first byte.
fn one_slot(tokens_per_second: u32) -> String {
    let timing = format!("time_to_first_token_ms = 0\ntokens_per_second = {tokens_per_second}");
    fleet(ENDPOINT, None, 1, 1, &timing)
}

/// A 40-token call sent in the background; returns once the proxy holds it in flight (its
/// task ends true if it succeeded).
async fn hold_the_copy(stack: &crate::common::Stack) -> tokio::task::JoinHandle<bool> {
    let c = client(stack.proxy.addr, 1);
    let call = tokio::spawn(async move {
        let sent = c
            .invoke_endpoint()
            .endpoint_name(ENDPOINT)
            .body(chat(40, 100));
        sent.send().await.is_ok()
    });
    until(Duration::from_secs(10), "a call in flight", async || {
        crate::common::in_flight(&stack.proxy, POOL) == 1
    })
    .await;
    call
}

/// The pool of `ENDPOINT` with `copies` of `cap`, in front of the simulator at `sim`.
fn pool(copies: u32, cap: u32, extra: &str) -> impl Fn(std::net::SocketAddr) -> String {
    let extra = extra.to_string();
    move |sim| endpoint_pool(POOL, ENDPOINT, None, copies, cap, sim, &extra)
}

#[tokio::test]
async fn both_operations_are_admitted_within_the_per_copy_limit() {
    let fleets = fleet(ENDPOINT, None, 2, 2, "tokens_per_second = 0");
    let stack = endpoints::start(&fleets, pool(2, 2, ""), "").await;
    let c = client(stack.proxy.addr, 1);
    let whole = c
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .content_type("application/json")
        .custom_attributes("trace=abc")
        .body(chat(12, 100))
        .send()
        .await
        .expect("InvokeEndpoint through the proxy");
    let answer: serde_json::Value =
        serde_json::from_slice(whole.body().expect("body").as_ref()).expect("json");
    assert_eq!(answer["usage"]["completion_tokens"], 12);
    assert_eq!(whole.invoked_production_variant(), Some("AllTraffic"));
    assert_eq!(
        whole.custom_attributes(),
        Some("trace=abc"),
        "passed both ways"
    );

    let streamed = c
        .invoke_endpoint_with_response_stream()
        .endpoint_name(ENDPOINT)
        .content_type("application/json")
        .body(tgi(7, 50))
        .send()
        .await
        .expect("InvokeEndpointWithResponseStream through the proxy");
    let (text, error) = read_stream(streamed.body).await;
    assert_eq!(error, None);
    assert_eq!(text.matches("\"token\":{").count(), 7, "{text}");
    assert!(text.contains("\"generated_tokens\":7"), "{text}");

    let fleet = endpoints::fleet_stats(stack.sim.addr, ENDPOINT).await;
    assert_eq!((fleet.served, fleet.overloaded), (2, 0));
    let sim = stack.sim.simulator.stats();
    assert_eq!(
        sim.sigv4.rejected, 0,
        "the proxy signs for sagemaker with its key"
    );
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_settlements_total",
        &[("pool", POOL), ("rule", "usage")],
        2.0,
    );
    m.expect("tokengate_output_tokens_total", &[("pool", POOL)], 19.0);
    m.expect("tokengate_endpoint_copies", &[("pool", POOL)], 2.0);
    assert_ledger_zero(&stack.proxy).await;
}

#[tokio::test]
async fn a_call_past_the_limit_waits_in_the_queue_then_is_served() {
    // One copy serving one call at a time; the first call takes a while (40 tokens at 40/s).
    let fleets = one_slot(40);
    let stack = endpoints::start(&fleets, pool(1, 1, "max_wait_ms = 20000"), "").await;
    let first = hold_the_copy(&stack).await;
    let proxy = &stack.proxy;
    let second = tokio::spawn({
        let c = client(stack.proxy.addr, 1);
        async move {
            c.invoke_endpoint()
                .endpoint_name(ENDPOINT)
                .body(chat(3, 100))
                .send()
                .await
        }
    });
    let pool = proxy.admission().pools()[0].clone();
    until(
        Duration::from_secs(10),
        "the second call queued",
        async || pool.queue.depth() == 1,
    )
    .await;
    let m = scrape(proxy.addr).await;
    m.expect("tokengate_endpoint_demand_per_copy", &[("pool", POOL)], 2.0);
    m.expect("tokengate_queue_depth", &[("pool", POOL)], 1.0);

    assert!(first.await.expect("task"), "the first call");
    second
        .await
        .expect("task")
        .expect("the queued call, served");
    let fleet = endpoints::fleet_stats(stack.sim.addr, ENDPOINT).await;
    assert_eq!(fleet.peak_in_flight, 1, "never past the copy's cap");
    assert_eq!((fleet.served, fleet.overloaded), (2, 0));
    let m = scrape(proxy.addr).await;
    m.expect(
        "tokengate_queue_outcomes_total",
        &[("pool", POOL), ("outcome", "admitted")],
        1.0,
    );
    assert_ledger_zero(proxy).await;
}

#[tokio::test]
async fn a_refusal_carries_a_hint_the_sdk_obeys_where_the_endpoint_alone_fails_the_call() {
    let fleets = one_slot(40);
    let stack = endpoints::start(&fleets, pool(1, 1, "max_wait_ms = 0"), "").await;
    let busy = hold_the_copy(&stack).await;
    let proxy = &stack.proxy;

    // Straight at the endpoint, the second call is the container's 429 inside a ModelError: the
    // SDK does not retry it.
    let direct = endpoints::direct_client(stack.sim.addr, 5)
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(chat(3, 100))
        .send()
        .await
        .expect_err("the fleet is full");
    assert_eq!(direct.code(), Some("ModelError"));
    assert_eq!(
        endpoints::fleet_stats(stack.sim.addr, ENDPOINT)
            .await
            .overloaded,
        1
    );

    // Through the proxy: a ThrottlingException with x-amz-retry-after, retried by the SDK at
    // the hinted time until the copy is free.
    let refused = raw_request(
        proxy.addr,
        "POST",
        &format!("/endpoints/{ENDPOINT}/invocations"),
        "{}",
        false,
    )
    .await;
    assert_eq!(
        (refused.status, refused.error_type()),
        (429, "ThrottlingException")
    );
    assert_eq!(refused.header("x-tokengate-reason"), Some("concurrency"));
    let hint: u64 = refused
        .header("x-amz-retry-after")
        .expect("hint")
        .parse()
        .expect("ms");
    assert!((50..=5000).contains(&hint), "{hint}");
    let retried = client(proxy.addr, 8)
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(chat(3, 100))
        .send()
        .await
        .expect("the SDK retries until admitted");
    assert!(retried.body().is_some());
    assert!(busy.await.expect("task"), "the first call");
    let m = scrape(proxy.addr).await;
    let rejected = m.get(
        "tokengate_rejections_total",
        &[("pool", POOL), ("reason", "concurrency")],
    );
    assert!(
        rejected >= 2.0,
        "the raw call and at least one SDK attempt: {rejected}"
    );
    assert_eq!(
        endpoints::fleet_stats(stack.sim.addr, ENDPOINT)
            .await
            .overloaded,
        1,
        "only the direct call"
    );
    assert_ledger_zero(proxy).await;
}

#[tokio::test]
async fn copies_follow_the_control_plane() {
    let fleets = format!(
        "{}{}",
        fleet(ENDPOINT, None, 1, 2, ""),
        fleet("shared", Some("ic-small"), 2, 3, "")
    );
    let endpoints = |sim| {
        format!(
            "{}{}{}",
            endpoint_pool(POOL, ENDPOINT, None, 1, 2, sim, "refresh_secs = 1"),
            endpoint_pool(
                "small",
                "shared",
                Some("ic-small"),
                1,
                3,
                sim,
                "refresh_secs = 1"
            ),
            endpoint_pool("ghost", "not-there", None, 4, 1, sim, "refresh_secs = 1"),
        )
    };
    let stack = endpoints::start(&fleets, endpoints, "").await;
    let pools = stack.proxy.admission().pools().to_vec();
    let (endpoint, component, ghost) = (&pools[0], &pools[1], &pools[2]);
    until(
        Duration::from_secs(10),
        "the component's two copies read",
        async || component.copies() == Some(2),
    )
    .await;
    assert_eq!(component.limits().max_concurrency, 6);

    endpoints::scale(stack.sim.addr, ENDPOINT, None, 3).await;
    until(Duration::from_secs(10), "three copies", async || {
        endpoint.copies() == Some(3)
    })
    .await;
    assert_eq!(endpoint.limits().max_concurrency, 6);

    // Scaled to zero: no copy serves, a call is turned away at once, never queued for minutes.
    endpoints::scale(stack.sim.addr, "shared", Some("ic-small"), 0).await;
    until(Duration::from_secs(10), "no copies", async || {
        component.copies() == Some(0)
    })
    .await;
    let refused = raw_request_with(
        stack.proxy.addr,
        "POST",
        "/endpoints/shared/invocations",
        "{}",
        false,
        &[("x-amzn-sagemaker-inference-component", "ic-small")],
    )
    .await;
    assert_eq!(
        (refused.status, refused.error_type()),
        (429, "ThrottlingException"),
        "{:?}",
        refused.body
    );

    // An endpoint the control plane does not know keeps its configured copies, and says why.
    let admission = stack.proxy.admission();
    until(Duration::from_secs(10), "a failed refresh", async || {
        admission.pool_views().await[2]
            .endpoint
            .as_ref()
            .is_some_and(|e| e.refresh_errors > 0)
    })
    .await;
    assert_eq!(ghost.copies(), Some(4));
    let view = admission.pool_views().await;
    let error = view[2]
        .endpoint
        .as_ref()
        .and_then(|e| e.last_refresh_error.clone())
        .unwrap_or_default();
    assert!(error.contains("Could not find endpoint"), "{error}");
    let m = scrape(stack.proxy.addr).await;
    assert!(
        m.get(
            "tokengate_endpoint_copy_refreshes_total",
            &[("pool", "ghost"), ("result", "error")]
        ) >= 1.0
    );
    m.expect("tokengate_endpoint_copies", &[("pool", "small")], 0.0);
    assert_ledger_zero(&stack.proxy).await;
}

#[tokio::test]
async fn the_token_envelope_reserves_the_output_cap_and_charges_what_was_generated() {
    // One copy of 10 tokens a second: 600 tokens a minute.
    let fleets = fleet(ENDPOINT, None, 1, 4, "tokens_per_second = 0");
    let envelope = "tokens_per_second_per_copy = 10\ndefault_max_tokens = 100\nmax_wait_ms = 0";
    let stack = endpoints::start(&fleets, pool(1, 4, envelope), "").await;
    let c = client(stack.proxy.addr, 1);
    c.invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(chat(30, 500))
        .send()
        .await
        .expect("fits");
    // The bucket held 500 of 600 and got back the 470 not generated: 570 are free, 600 are not.
    let m = scrape(stack.proxy.addr).await;
    m.expect("tokengate_charged_tokens_total", &[("pool", POOL)], 30.0);
    m.expect("tokengate_reserved_tokens_total", &[("pool", POOL)], 500.0);
    let refused = c
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(tgi(5, 590))
        .send()
        .await
        .expect_err("590 do not fit now");
    assert_eq!(refused.code(), Some("ThrottlingException"));
    let never = c
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(chat(5, 601))
        .send()
        .await
        .expect_err("601 never fit");
    assert_eq!(never.code(), Some("ValidationError"));
    assert!(
        never.message().unwrap_or_default().contains("at most 600"),
        "{never:?}"
    );
    let bad = raw_request(
        stack.proxy.addr,
        "POST",
        &format!("/endpoints/{ENDPOINT}/invocations"),
        r#"{"inputs":"x","parameters":{"max_new_tokens":"lots"}}"#,
        false,
    )
    .await;
    assert_eq!((bad.status, bad.error_type()), (400, "ValidationError"));
    assert!(
        bad.message().contains("parameters.max_new_tokens"),
        "{}",
        bad.message()
    );
    assert_ledger_zero(&stack.proxy).await;
}

#[tokio::test]
async fn errors_carry_sagemaker_runtime_names_and_upstream_errors_pass_as_they_are() {
    let fleets = fleet(ENDPOINT, None, 1, 1, "tokens_per_second = 0");
    let stack = endpoints::start(&fleets, pool(1, 1, ""), "").await;
    let addr = stack.proxy.addr;
    let unknown = raw_request(addr, "POST", "/endpoints/other/invocations", "{}", false).await;
    assert_eq!(
        (unknown.status, unknown.error_type()),
        (400, "ValidationError")
    );
    assert!(
        unknown.message().contains("[[endpoints]]"),
        "{}",
        unknown.message()
    );
    let asynchronous = raw_request(
        addr,
        "POST",
        &format!("/endpoints/{ENDPOINT}/async-invocations"),
        "{}",
        false,
    )
    .await;
    assert_eq!(
        (asynchronous.status, asynchronous.error_type()),
        (404, "UnknownOperationException")
    );
    let bad_name = raw_request(addr, "POST", "/endpoints/bad_name/invocations", "{}", false).await;
    assert_eq!(bad_name.error_type(), "ValidationError");
    // The container cannot read this body: SageMaker's ModelError, passed through.
    let model_error = client(addr, 1)
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .body(aws_sdk_sagemakerruntime::primitives::Blob::new("1,2,3"))
        .send()
        .await
        .expect_err("the container refuses it");
    assert_eq!(model_error.code(), Some("ModelError"));
    let m = scrape(addr).await;
    m.expect(
        "tokengate_settlements_total",
        &[("pool", POOL), ("rule", "not_charged")],
        1.0,
    );
    m.expect(
        "tokengate_requests_total",
        &[
            ("pool", "none"),
            ("api", "sagemaker"),
            ("operation", "InvokeEndpoint"),
            ("outcome", "unknown_endpoint"),
        ],
        1.0,
    );
    assert_ledger_zero(&stack.proxy).await;
}

#[tokio::test]
async fn a_cut_stream_ends_with_a_model_stream_error_and_settles() {
    let fleets = one_slot(200);
    let stack = endpoints::start(&fleets, pool(1, 1, ""), "").await;
    let body = serde_json::json!({"inputs": "[sim:output=40] [sim:fault=cut]", "parameters": {"max_new_tokens": 100}});
    let streamed = client(stack.proxy.addr, 1)
        .invoke_endpoint_with_response_stream()
        .endpoint_name(ENDPOINT)
        .body(aws_sdk_sagemakerruntime::primitives::Blob::new(
            body.to_string(),
        ))
        .send()
        .await
        .expect("the stream starts");
    let (text, error) = read_stream(streamed.body).await;
    assert!(text.contains("\"token\""), "part of it arrived: {text}");
    let error = error.expect("the stream ends in an error");
    assert!(error.contains("ModelStreamError"), "{error}");
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_settlements_total",
        &[("pool", POOL), ("rule", "no_usage")],
        1.0,
    );
    assert_ledger_zero(&stack.proxy).await;
}

#[tokio::test]
async fn the_emf_line_of_an_endpoint_pool_carries_its_copies_and_demand_per_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("emf.log");
    let extra = format!(
        "[metrics]\ncloudwatch_emf = \"{}\"\ncloudwatch_emf_interval_secs = 1\n",
        path.display()
    );
    let fleets = one_slot(20);
    let stack = endpoints::start(&fleets, pool(1, 1, ""), &extra).await;
    let held = hold_the_copy(&stack).await;
    // One call in flight on one copy: a line says so (the first may predate the call).
    until(
        Duration::from_secs(10),
        "an EMF line with the call",
        async || {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            text.lines().any(|line| {
                let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
                let named = v["_aws"]["CloudWatchMetrics"][0]["Metrics"]
                    .as_array()
                    .is_some_and(|m| m.iter().any(|m| m["Name"] == "DemandPerCopy"));
                v["Pool"] == POOL && named && v["Copies"] == 1 && v["DemandPerCopy"] == 1.0
            })
        },
    )
    .await;
    assert!(held.await.expect("join"), "the held call succeeds");
    assert_ledger_zero(&stack.proxy).await;
}
