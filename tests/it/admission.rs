//! Admission control end to end: rejections and their hints, never-fitting requests, every
//! settlement path, burndown hold-back, and reservations that cover upstream's input count.
//! (Over 500 lines: admission's end-to-end cases share one stack harness; tests/it/ will split it.)

use std::{collections::BTreeSet, time::Duration};

use crate::common::*;
use aws_sdk_bedrockruntime::types::ConverseStreamOutput;
use tokengate::gateway::Gateway;

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

fn settled(proxy: &Gateway, pool: &str, rule: &str) -> u64 {
    proxy
        .state
        .metrics
        .settlements
        .with_label_values(&[pool, rule])
        .get()
}

fn pool_with(extra: &str) -> String {
    format!("{}{extra}\n", sonnet_pool(60_000, 8))
}

#[tokio::test]
async fn rejections_carry_bedrock_shape_and_jittered_hints() {
    // 60,000 tokens per minute; each request reserves about 10,000 and holds it until the test
    // hangs up (the first token would take ten minutes): the count admitted is the ledger's
    // arithmetic, not a race with settlements. Refill (1,000 a second) would take 9 s to make
    // room for a seventh.
    let sim = "time_to_first_token_ms = 600000\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &pool_with("max_wait_ms = 0"), "").await;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=10] hello", Some(9_900));
    let calls: Vec<_> = (0..60)
        .map(|_| {
            let (addr, path, body) = (stack.proxy.addr, path.clone(), body.clone());
            tokio::spawn(async move { raw_request(addr, "POST", &path, body, false).await })
        })
        .collect();
    let rejected = || {
        stack
            .proxy
            .state
            .metrics
            .rejections
            .with_label_values(&["sonnet4-us", "tokens"])
            .get()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let in_flight = loop {
        let pools = stack.proxy.admission().pool_views().await;
        let in_flight = pools[0].ledger.as_ref().expect("ledger").in_flight_requests;
        if u64::from(in_flight) + rejected() == 60 {
            break in_flight;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "60 calls neither admitted nor rejected: {in_flight} in flight, {} rejected",
            rejected()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Six reservations of about 10,000 fit in 60,000; the other calls find them holding it.
    assert_eq!(in_flight, 6, "all or nothing, and never more than fits");
    while calls.iter().filter(|c| c.is_finished()).count() < 54 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rejected calls were not answered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut hints = BTreeSet::new();
    let mut answered = 0;
    for call in calls {
        if !call.is_finished() {
            call.abort();
            continue;
        }
        let r = call.await.expect("call");
        answered += 1;
        assert_eq!(r.status, 429, "{}", r.message());
        assert_eq!(r.error_type(), "ThrottlingException");
        assert_eq!(r.header("x-tokengate-reason"), Some("tokens"));
        assert_eq!(r.header("x-tokengate-pool"), Some("sonnet4-us"));
        assert!(r.message().contains("Too many tokens"), "{}", r.message());
        let ms: u64 = r
            .header("x-amz-retry-after")
            .expect("hint")
            .parse()
            .expect("ms");
        let secs: u64 = r
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("secs");
        assert!(
            (50..=5_000).contains(&ms),
            "hint {ms} ms within what SDKs honour"
        );
        assert_eq!(secs, ms.div_ceil(1000).max(1));
        hints.insert(ms);
    }
    assert_eq!(answered, 54, "every rejected call was answered");
    assert!(
        hints.len() >= 30,
        "hints must be spread, got {} distinct: {hints:?}",
        hints.len()
    );
    assert_eq!(stack.sim.simulator.stats().throttled(), 0);
    // The six hang up: they settle as abandoned.
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "sonnet4-us", "abandoned"), 6);
}

#[tokio::test]
async fn a_request_that_can_never_fit_is_a_validation_error() {
    let stack = Stack::start(FAST_SIM, &pool_with(""), "").await;
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hi", Some(100_000)),
        false,
    )
    .await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(
        r.message().contains("can never be admitted")
            && r.message().contains("set maxTokens to at most"),
        "{}",
        r.message()
    );
    for bad in ["0", "-3", "1.5", "\"many\""] {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"text":"hi"}}]}}],"inferenceConfig":{{"maxTokens":{bad}}}}}"#
        );
        let r = raw_request(
            stack.proxy.addr,
            "POST",
            &model_path(SONNET_US, "converse"),
            body,
            false,
        )
        .await;
        assert_eq!(
            (r.status, r.error_type()),
            (400, "ValidationException"),
            "maxTokens {bad}"
        );
        assert!(r.message().contains("maxTokens"), "{}", r.message());
    }
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn concurrency_and_request_limits_reject_with_their_reason() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 200\ndefault_tokens_per_minute = 10000000\n";
    let pools = format!(
        "{}max_wait_ms = 0\n\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1000000\n\
         max_concurrency = 10\nrequests_per_minute = 2\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n",
        sonnet_pool(1_000_000, 1)
    );
    let stack = Stack::start(sim, &pools, "").await;
    // Hold the only sonnet slot with a 2-second stream.
    let client = stack.client();
    let mut held = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=400] long"))
        .send()
        .await
        .expect("first stream");
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("concurrency"))
    );
    while held.stream.recv().await.expect("event").is_some() {}

    let path = model_path(HAIKU, "converse");
    for _ in 0..2 {
        let r = raw_request(
            stack.proxy.addr,
            "POST",
            &path,
            converse_body("[sim:output=1] hi", Some(10)),
            false,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &path,
        converse_body("[sim:output=1] hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(
        (r.status, r.header("x-tokengate-reason")),
        (429, Some("requests"))
    );
    let ms: u64 = r
        .header("x-amz-retry-after")
        .expect("hint")
        .parse()
        .expect("ms");
    assert!(
        ms >= 4_000,
        "one request refills every 30 s; the hint says wait (capped at 5 s), got {ms}"
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn every_response_kind_settles_on_its_usage() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), "").await;
    let client = stack.client();
    client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("a"))
        .send()
        .await
        .expect("converse");
    let mut s = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("b"))
        .send()
        .await
        .expect("stream");
    while s.stream.recv().await.expect("event").is_some() {}
    let body = serde_json::json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 50,
        "messages": [{"role": "user", "content": "c"}]})
    .to_string();
    client
        .invoke_model()
        .model_id(SONNET_US)
        .body(aws_sdk_bedrockruntime::primitives::Blob::new(body.clone()))
        .send()
        .await
        .expect("invoke");
    let mut s = client
        .invoke_model_with_response_stream()
        .model_id(SONNET_US)
        .body(aws_sdk_bedrockruntime::primitives::Blob::new(body))
        .send()
        .await
        .expect("invoke stream");
    while s.body.recv().await.expect("chunk").is_some() {}
    stack.assert_ledger_zero().await;
    let rules: Vec<_> = ["usage", "no_usage", "not_charged", "abandoned"]
        .iter()
        .map(|r| (*r, settled(&stack.proxy, "sonnet4-us", r)))
        .collect();
    assert_eq!(settled(&stack.proxy, "sonnet4-us", "usage"), 4, "{rules:?}");
    // The proxy charged exactly what the simulator (Bedrock's arithmetic) charged.
    let sim_charged: u64 = stack.sim.simulator.stats().tokens_charged();
    let proxy_charged = stack
        .proxy
        .state
        .metrics
        .charged_tokens
        .with_label_values(&["sonnet4-us"])
        .get();
    assert_eq!(proxy_charged, sim_charged);
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_stream_releases_its_reservation() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 100\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let mut s = stack
        .client()
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=1000] long"))
        .inference_config(max_tokens(2000))
        .send()
        .await
        .expect("stream");
    // Read one event, then hang up.
    let first = s.stream.recv().await.expect("event");
    assert!(matches!(first, Some(ConverseStreamOutput::MessageStart(_))));
    drop(s);
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "sonnet4-us", "no_usage"), 1);
}

#[tokio::test]
async fn upstream_faults_settle_by_the_documented_rules() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 1000\ndefault_tokens_per_minute = 10000000\nstall_ms = 3000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let client = stack.client();

    // Upstream 503: not charged, passed on as the retryable error it is.
    let err = client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:fault=503] x"))
        .send()
        .await
        .expect_err("503");
    assert_eq!(err.raw_response().map(|r| r.status().as_u16()), Some(503));
    assert_eq!(settled(&stack.proxy, "sonnet4-us", "not_charged"), 1);

    // A stream cut mid-way: the client sees a stream error, the reservation settles without usage.
    let mut s = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:fault=cut] [sim:output=500] x"))
        .send()
        .await
        .expect("stream starts");
    let mut saw_error = false;
    loop {
        match s.stream.recv().await {
            Ok(Some(ConverseStreamOutput::Metadata(_))) => panic!("a cut stream has no metadata"),
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                saw_error = true;
                break;
            }
        }
    }
    assert!(saw_error, "the client learns the stream failed");
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "sonnet4-us", "no_usage"), 1);
}

#[tokio::test]
async fn upstream_throttles_shrink_the_pool_and_reach_the_client_with_a_hint() {
    // The simulator's quota is far below the pool's: other traffic shares the account.
    let sim =
        "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 1000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let path = model_path(SONNET_US, "converse");
    let mut throttled = None;
    for _ in 0..5 {
        let r = raw_request(
            stack.proxy.addr,
            "POST",
            &path,
            converse_body("[sim:output=10] x", Some(2_000)),
            false,
        )
        .await;
        if r.status == 429 {
            throttled = Some(r);
            break;
        }
    }
    let r = throttled.expect("the simulator throttles");
    assert_eq!(r.error_type(), "ThrottlingException");
    assert_eq!(r.header("x-tokengate-reason"), Some("upstream"));
    assert!(r.header("x-amz-retry-after").is_some());
    crate::common::scrape(stack.proxy.addr).await.expect(
        "tokengate_upstream_throttles_total",
        &[("pool", "sonnet4-us")],
        1.0,
    );
    let admission = stack.proxy.admission();
    let pool = &admission.pools()[0];
    assert!(pool.limit_factor() < 1.0, "the effective limit shrank");
    stack.assert_ledger_zero().await;
    assert!(settled(&stack.proxy, "sonnet4-us", "not_charged") >= 1);
}

#[tokio::test]
async fn an_upstream_that_does_not_answer_in_time_is_a_retryable_error() {
    let sim = "time_to_first_token_ms = 3000\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
    let sim = start_simulator(sim).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.upstream.response_timeout = Duration::from_millis(300);
    let proxy = start_proxy(config).await;
    let r = raw_request(
        proxy.addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("x", Some(10)),
        false,
    )
    .await;
    assert_eq!(
        (r.status, r.error_type()),
        (503, "ServiceUnavailableException")
    );
    assert_ledger_zero(&proxy).await;
    assert_eq!(settled(&proxy, "sonnet4-us", "timeout"), 1);
}

#[tokio::test]
async fn a_stream_that_goes_quiet_ends_with_an_exception_frame() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 1000\ndefault_tokens_per_minute = 10000000\nstall_ms = 3000\n";
    let sim = start_simulator(sim).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.upstream.idle_timeout = Duration::from_millis(300);
    let proxy = start_proxy(config).await;
    let mut s = sdk_client(proxy.addr, 1)
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:fault=stall] [sim:output=500] x"))
        .send()
        .await
        .expect("stream starts");
    let err = loop {
        match s.stream.recv().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("a stalled stream must not end cleanly"),
            Err(e) => break e,
        }
    };
    assert!(format!("{err:?}").contains("ModelStreamError"), "{err:?}");
    assert_ledger_zero(&proxy).await;
    assert_eq!(
        proxy
            .state
            .metrics
            .upstream_errors
            .with_label_values(&["sonnet4-us", "idle_timeout"])
            .get(),
        1
    );
}

#[tokio::test]
async fn count_tokens_pools_reserve_the_exact_input() {
    let pools = format!(
        "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 8\n\
         output_burndown = 5\ndefault_max_tokens = 1000\ninput_estimate = \"count_tokens\"\n"
    );
    let stack = Stack::start(FAST_SIM, &pools, "").await;
    let prompt = "word ".repeat(400);
    let out = stack
        .client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message(&prompt))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("converse");
    let input = out.usage().expect("usage").input_tokens() as u64;
    let reserved = stack
        .proxy
        .state
        .metrics
        .reserved_tokens_total
        .with_label_values(&["sonnet4-us"])
        .get();
    assert_eq!(
        reserved,
        input + 100,
        "the reservation is CountTokens' exact input + maxTokens"
    );
    stack.assert_ledger_zero().await;
}

/// With burndown, a stream's output soon costs more than its reservation; upstream deducts the
/// excess when the stream ends, a moment before the proxy sees the usage. Until then the pool
/// holds the excess seen so far back from admission, and releases it at settlement.
#[tokio::test]
async fn a_burndown_stream_holds_back_its_excess_until_it_settles() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 100\n";
    let stack = Stack::start(sim, &sonnet_pool(400_000, 8), "").await;
    let mut stream = stack
        .client()
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=100] go on"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("stream starts")
        .stream;
    // Read until the output seen costs more than the reservation: 100 tokens of maxTokens,
    // each output token charged 5.
    let mut held = 0;
    while held == 0 {
        let event = stream.recv().await.expect("event").expect("not ended yet");
        let _ = event;
        held = stack.proxy.admission().pool_views().await[0].pending_burndown_excess;
    }
    // The excess of `s` output tokens seen is `5 x s - 100` (the input estimate cancels out):
    // a multiple of 5, at most 5 x 100 - 100 once all 100 are seen.
    assert!(
        held % 5 == 0 && (5..=400).contains(&held),
        "held back {held}"
    );
    while stream.recv().await.expect("event").is_some() {}
    stack.assert_ledger_zero().await;
    assert_eq!(
        stack.proxy.admission().pool_views().await[0].pending_burndown_excess,
        0,
        "released at settlement"
    );
}

/// The input estimate errs high, never low: through the proxy, every reservation covers what
/// upstream deducts at the start, `input + maxTokens` with the input as the simulator (Bedrock's
/// arithmetic) counts it, while calibration learns from answers whose input is well under the
/// raw estimate (English prose, about four bytes a token against the estimate's three).
#[tokio::test]
async fn every_reservation_covers_upstreams_input_count() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(10_000_000, 8), "").await;
    let reserved = || {
        stack
            .proxy
            .state
            .metrics
            .reserved_tokens_total
            .with_label_values(&["sonnet4-us"])
            .get()
    };
    let client = stack.client();
    for i in 0..40 {
        let prompt = format!(
            "[sim:output=5] {}",
            "summarise the quarterly report ".repeat(1 + (i * 7) % 50)
        );
        let before = reserved();
        let out = client
            .converse()
            .model_id(SONNET_US)
            .messages(user_message(&prompt))
            .inference_config(max_tokens(100))
            .send()
            .await
            .expect("converse");
        let input = u64::try_from(out.usage().expect("usage").input_tokens()).expect("count");
        let reservation = reserved() - before;
        assert!(
            reservation >= input + 100,
            "call {i}: reserved {reservation} for {input} input tokens + maxTokens 100"
        );
    }
    let ratio = stack.proxy.admission().pools()[0].calibration_ratio();
    assert!(
        ratio >= 1.0,
        "calibration never lowers the estimate: {ratio}"
    );
    stack.assert_ledger_zero().await;
}
