//! Requests that name no `maxTokens`: what each `when_max_tokens_missing` reserves, writes
//! upstream and answers, through the proxy to the simulator (which, like Bedrock, reserves and
//! allows the model's maximum when a call names none).

use std::time::Duration;

use crate::common::*;

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

/// An Anthropic InvokeModel body without `max_tokens` (Bedrock requires it for this family).
const ANTHROPIC_NO_MAX: &str = r#"{"anthropic_version":"bedrock-2023-05-31","messages":[{"role":"user","content":"[sim:output=100] hi"}]}"#;

fn pool(tokens_per_minute: u64, extra: &str) -> String {
    format!("{}{extra}\n", sonnet_pool(tokens_per_minute, 8))
}

fn upstream_calls(stack: &Stack) -> u64 {
    stack.sim.simulator.stats().operations.values().sum()
}

async fn missing(stack: &Stack, action: &str) -> f64 {
    scrape(stack.proxy.addr).await.get(
        "tokengate_max_tokens_missing_total",
        &[
            ("pool", "sonnet4-us"),
            ("route", "default"),
            ("action", action),
        ],
    )
}

#[tokio::test]
async fn by_default_the_model_maximum_is_reserved_and_a_pool_too_small_for_it_says_to_send_max_tokens()
 {
    // Sonnet 4's maximum output is 64,000 (the catalogue): a 20,000-token pool can never hold it.
    let stack = Stack::start(FAST_SIM, &pool(20_000, ""), "").await;
    let r = converse(stack.proxy.addr, SONNET_US, "hi", None).await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    let says = r.message();
    assert!(
        says.contains("names no maximum output, so it reserves the model's maximum (64000 tokens)")
            && says.contains("send maxTokens"),
        "{says}"
    );
    // With maxTokens it fits.
    let r = converse(stack.proxy.addr, SONNET_US, "hi", Some(500)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(missing(&stack, "reserve_model_max").await, 1.0);
    stack.assert_ledger_zero().await;

    // A pool that holds it reserves 64,000 and forwards the body as sent.
    let stack = Stack::start(FAST_SIM, &pool(1_000_000, ""), "").await;
    let r = converse(stack.proxy.addr, SONNET_US, "[sim:output=3000] hi", None).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(body["usage"]["outputTokens"], 3000, "upstream read no cap");
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_requested_max_tokens_sum",
        &[("pool", "sonnet4-us")],
        64_000.0,
    );
    assert_eq!(missing(&stack, "reserve_model_max").await, 1.0);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn inject_writes_the_pools_default_into_what_upstream_reads() {
    let stack = Stack::start(
        FAST_SIM,
        &pool(20_000, "when_max_tokens_missing = \"inject\"")
            .replace("default_max_tokens = 1000", "default_max_tokens = 40"),
        "",
    )
    .await;
    // Converse: the simulator stops at the injected 40.
    let out = stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=100] hi"))
        .send()
        .await
        .expect("converse");
    assert_eq!(out.usage().map(|u| u.output_tokens()), Some(40));
    assert_eq!(
        out.stop_reason(),
        &aws_sdk_bedrockruntime::types::StopReason::MaxTokens
    );
    // InvokeModel, Anthropic: max_tokens is written in (without it upstream refuses the call).
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(SONNET_US, "invoke"),
        ANTHROPIC_NO_MAX,
        false,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(
        (&body["usage"]["output_tokens"], &body["stop_reason"]),
        (&serde_json::json!(40), &serde_json::json!("max_tokens"))
    );
    // A caller's own maxTokens is left alone.
    let r = converse(stack.proxy.addr, SONNET_US, "[sim:output=100] hi", Some(90)).await;
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(body["usage"]["outputTokens"], 90);
    assert_eq!(missing(&stack, "inject").await, 2.0);
    assert_eq!(missing(&stack, "reserve_model_max").await, 0.0);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn reject_names_the_field_to_send_and_forwards_nothing() {
    let stack = Stack::start(
        FAST_SIM,
        &pool(1_000_000, "when_max_tokens_missing = \"reject\""),
        "",
    )
    .await;
    let cases = [
        (
            "converse",
            converse_body("hi", None),
            "send inferenceConfig.maxTokens",
        ),
        ("invoke", ANTHROPIC_NO_MAX.to_string(), "send max_tokens"),
    ];
    for (op, body, says) in cases {
        let r = raw_request(
            stack.proxy.addr,
            "POST",
            &model_path(SONNET_US, op),
            body,
            false,
        )
        .await;
        assert_eq!(
            (r.status, r.error_type()),
            (400, "ValidationException"),
            "{op}"
        );
        assert!(
            r.message().contains(says) && r.message().contains("when_max_tokens_missing"),
            "{op}: {}",
            r.message()
        );
    }
    assert_eq!(upstream_calls(&stack), 0);
    let r = converse(stack.proxy.addr, SONNET_US, "hi", Some(100)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(missing(&stack, "reject").await, 2.0);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn calls_stopped_at_their_cap_are_counted_per_route_and_beside_the_advice() {
    let stack = Stack::start(FAST_SIM, &pool(1_000_000, ""), "").await;
    let addr = stack.proxy.addr;
    // Converse: 100 wanted, 40 allowed: stopReason max_tokens. 10 wanted: end_turn.
    let r = converse(addr, SONNET_US, "[sim:output=100] cut", Some(40)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    let r = converse(addr, SONNET_US, "[sim:output=10] whole", Some(40)).await;
    assert_eq!(r.status, 200, "{}", r.message());
    // ConverseStream, through the SDK: the messageStop event says max_tokens.
    let mut out = stack
        .client()
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=100] stream"))
        .inference_config(max_tokens(30))
        .send()
        .await
        .expect("stream");
    while out.stream.recv().await.expect("event").is_some() {}
    // InvokeModel, Anthropic: stop_reason max_tokens in the body.
    let invoke = r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":20,"messages":[{"role":"user","content":"[sim:output=100] hi"}]}"#;
    let r = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "invoke"),
        invoke,
        false,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    // The stream's end reaches the proxy just after the client has read its last event.
    let labels = [("pool", "sonnet4-us"), ("route", "default")];
    let truncated = || metric(&stack.proxy, "tokengate_truncated_total", &labels);
    eventually(Duration::from_secs(5), "three truncations counted", || {
        truncated() >= 3.0
    })
    .await;
    assert_eq!(truncated(), 3.0);
    let pools = raw_request(addr, "GET", "/v1/pools", "", false).await;
    let v: serde_json::Value = serde_json::from_slice(&pools.body).expect("json");
    let advice = &v["pools"][0]["max_tokens_advice"][0];
    assert_eq!(advice["truncated"], 3, "{advice}");
    stack.assert_ledger_zero().await;
}
