//! Adaptive retry (`routes[].adaptive_retry`, issue #22): a non-streamed call that stopped at the
//! route's learned cap is sent again with the caller's own maxTokens and that answer returned;
//! when the retry is not admitted, or upstream fails it, the caller gets the truncated first
//! answer; a stream is never retried. Through aws-sdk-bedrockruntime (Converse, InvokeModel,
//! ConverseStream) and the simulator, which stops at the maxTokens it receives and counts every
//! call it is sent.

use aws_sdk_bedrockruntime::{
    primitives::Blob,
    types::{ConverseStreamOutput, StopReason},
};
use serde_json::{Value, json};

use crate::{
    adaptive::{INSTANT_SIM, converse_answer, haiku_pool, learned},
    common::*,
};

/// A route learning from 3 calls, floor 64, retrying what its cap truncated; `extra` adds keys.
fn retry_route(extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"chat\"\nadaptive_retry = true\n{extra}\
         adaptive_max_tokens = {{ min_samples = 3, floor = 64 }}\n"
    )
}

/// Calls the simulator was sent.
fn upstream_calls(stack: &Stack) -> u64 {
    let stats = stack.sim.simulator.stats();
    stats.buckets.values().map(|b| b.requests).sum()
}

async fn converse(stack: &Stack, prompt: &str, max: i32) -> (i32, StopReason) {
    converse_answer(stack, prompt, max).await
}

/// Three calls of 100 output tokens: the cap is 100 x 1.2, rounded up to 128.
async fn learn(stack: &Stack) {
    for _ in 0..3 {
        assert_eq!(converse(stack, "[sim:output=100] a", 4000).await.0, 100);
    }
    assert_eq!(learned(&stack.proxy).await.cap, Some(128));
}

/// `tokengate_adaptive_retries_total` of the route, by outcome (0 before the first).
async fn retries(stack: &Stack, outcome: &str) -> f64 {
    let m = scrape(stack.proxy.addr).await;
    let series = m.0.get("tokengate_adaptive_retries_total");
    let of_outcome = |(labels, _): &&(std::collections::BTreeMap<String, String>, f64)| {
        labels.get("outcome").map(String::as_str) == Some(outcome)
            && labels.get("route").map(String::as_str) == Some("chat")
    };
    series
        .and_then(|s| s.iter().find(of_outcome))
        .map_or(0.0, |(_, v)| *v)
}

#[tokio::test]
async fn adaptive_retry_answers_a_converse_call_the_cap_cut_with_the_callers_own_max_tokens() {
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &retry_route("")).await;
    learn(&stack).await;
    let sent = upstream_calls(&stack);
    // An answer within the cap is the first answer: no second call.
    assert_eq!(
        converse(&stack, "[sim:output=100] b", 4000).await,
        (100, StopReason::EndTurn)
    );
    assert_eq!(upstream_calls(&stack), sent + 1);
    // Cut at 128 by the proxy's cap: sent again with 4000, and that answer returned whole.
    assert_eq!(
        converse(&stack, "[sim:output=900] c", 4000).await,
        (900, StopReason::EndTurn)
    );
    assert_eq!(upstream_calls(&stack), sent + 3, "a second call upstream");
    assert_eq!(retries(&stack, "answered").await, 1.0);
    // Both calls settled with usage and were learned: the truncated 128 (capped, the guard's
    // truncation) and the retry's 900 (uncapped: the answer's real length).
    let view = learned(&stack.proxy).await;
    assert_eq!(
        (
            view.samples,
            view.guard.capped_calls,
            view.guard.proxy_truncations
        ),
        (6, 2, 1),
        "{view:?}"
    );
    assert_eq!(view.quantile_output, Some(900), "{view:?}");
    // The second call's own access-log line and charge: two calls settled for one.
    scrape(stack.proxy.addr).await.expect(
        "tokengate_settlements_total",
        &[("pool", "haiku"), ("rule", "usage")],
        6.0,
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_retry_answers_an_invoke_model_call_and_says_so_in_a_header() {
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &retry_route("")).await;
    learn(&stack).await;
    let body = |prompt: &str| {
        json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 4000,
               "messages": [{"role": "user", "content": prompt}]})
        .to_string()
    };
    let out = stack
        .client()
        .invoke_model()
        .model_id(HAIKU)
        .content_type("application/json")
        .body(Blob::new(body("[sim:output=900] d")))
        .send()
        .await
        .expect("admitted and answered");
    let answer: Value = serde_json::from_slice(out.body().as_ref()).expect("JSON");
    assert_eq!(answer["usage"]["output_tokens"], 900, "{answer}");
    assert_eq!(answer["stop_reason"], "end_turn", "{answer}");
    assert_eq!(retries(&stack, "answered").await, 1.0);
    // The header on the raw wire (the SDK keeps unmodelled headers to itself).
    let raw = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(HAIKU, "invoke"),
        body("[sim:output=700] e"),
        false,
    )
    .await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.header("x-tokengate-adaptive-retry"), Some("answered"));
    let answer: Value = serde_json::from_slice(&raw.body).expect("JSON");
    assert_eq!(answer["usage"]["output_tokens"], 700, "{answer}");
    // An answer within the cap carries no such header.
    let plain = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(HAIKU, "invoke"),
        body("[sim:output=100] f"),
        false,
    )
    .await;
    assert_eq!(plain.header("x-tokengate-adaptive-retry"), None);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_retry_refused_returns_the_truncated_first_answer() {
    // The route's hourly budget holds the learning calls and a capped call (input + 128), not
    // a retry reserving input + 4000: the retry is refused as any call would be.
    let budget = "budgets = { tokens_per_hour = 1500 }\n";
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &retry_route(budget)).await;
    for _ in 0..3 {
        assert_eq!(converse(&stack, "[sim:output=100] a", 400).await.0, 100);
    }
    assert_eq!(learned(&stack.proxy).await.cap, Some(128));
    let sent = upstream_calls(&stack);
    assert_eq!(
        converse(&stack, "[sim:output=900] g", 4000).await,
        (128, StopReason::MaxTokens),
        "the first answer, cut where the cap stopped it"
    );
    assert_eq!(upstream_calls(&stack), sent + 1, "the retry never left");
    assert_eq!(retries(&stack, "refused").await, 1.0);
    assert_eq!(retries(&stack, "answered").await, 0.0);
    let raw = converse_raw(&stack, "[sim:output=900] h", 4000).await;
    assert_eq!(raw.status, 200);
    assert_eq!(raw.header("x-tokengate-adaptive-retry"), Some("refused"));
    stack.assert_ledger_zero().await;
}

async fn converse_raw(stack: &Stack, prompt: &str, max: u64) -> RawResponse {
    crate::common::converse(stack.proxy.addr, HAIKU, prompt, Some(max)).await
}

#[tokio::test]
async fn adaptive_retry_never_retries_a_stream() {
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &retry_route("")).await;
    learn(&stack).await;
    let sent = upstream_calls(&stack);
    let mut out = stack
        .client()
        .converse_stream()
        .model_id(HAIKU)
        .messages(user_message("[sim:output=900] i"))
        .inference_config(max_tokens(4000))
        .send()
        .await
        .expect("admitted");
    let (mut output, mut stop) = (None, None);
    while let Some(event) = out.stream.recv().await.expect("stream") {
        match event {
            ConverseStreamOutput::Metadata(m) => output = m.usage().map(|u| u.output_tokens()),
            ConverseStreamOutput::MessageStop(s) => stop = Some(s.stop_reason().clone()),
            _ => {}
        }
    }
    // Cut at the cap, and it stays cut: the caller has the content already.
    assert_eq!((output, stop), (Some(128), Some(StopReason::MaxTokens)));
    assert_eq!(upstream_calls(&stack), sent + 1);
    assert_eq!(learned(&stack.proxy).await.guard.proxy_truncations, 1);
    assert_eq!(retries(&stack, "answered").await, 0.0);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_retry_failed_upstream_returns_the_first_answer() {
    // Upstream's own quota (3,000 tokens a minute, the proxy's pool believing in far more)
    // holds the capped call (input + 128) but throttles its retry (input + 4000).
    let sim =
        "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 3000\n";
    let stack = Stack::start(sim, &haiku_pool(), &retry_route("")).await;
    for _ in 0..3 {
        assert_eq!(converse(&stack, "[sim:output=100] a", 400).await.0, 100);
    }
    assert_eq!(learned(&stack.proxy).await.cap, Some(128));
    let sent = upstream_calls(&stack);
    assert_eq!(
        converse(&stack, "[sim:output=900] j", 4000).await,
        (128, StopReason::MaxTokens),
        "the first answer"
    );
    assert_eq!(
        upstream_calls(&stack),
        sent + 2,
        "the retry reached upstream"
    );
    assert_eq!(retries(&stack, "failed").await, 1.0);
    stack.assert_ledger_zero().await;
}
