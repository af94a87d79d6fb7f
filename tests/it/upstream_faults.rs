//! Upstream faults end to end, injected by the simulator (or a closed port): bursts of 500s and
//! 503s, a refused connection, a connection dropped before the answer and during it, a stream
//! cut after its 200, and a slow stream that trickles within the idle timeout. Each test checks
//! the client's answer, the settlement rule (README, "Settlement rules") and the ledger at zero.
//!
//! Already covered elsewhere, not repeated here: a single 503 and a ConverseStream cut seen by the
//! SDK, and a stall past the idle timeout (`tests/admission.rs`); a response head later than the
//! response timeout (`tests/admission.rs`).

use crate::common;
use std::time::{Duration, Instant};

use crate::common::{wire::*, *};
use aws_sdk_bedrockruntime::{
    error::{ProvideErrorMetadata, SdkError},
    types::ConverseStreamOutput,
};
use tokengate::gateway::Gateway;

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";
const POOL: &str = "sonnet4-us";

fn settled(proxy: &Gateway, rule: &str) -> u64 {
    common::settlements(proxy, POOL, rule)
}

fn upstream_errors(proxy: &Gateway, kind: &str) -> u64 {
    common::metric(
        proxy,
        "tokengate_upstream_errors_total",
        &[("pool", POOL), ("kind", kind)],
    ) as u64
}

fn admitted(proxy: &Gateway, operation: &str) -> u64 {
    common::metric(
        proxy,
        "tokengate_requests_total",
        &[
            ("pool", POOL),
            ("api", "bedrock"),
            ("operation", operation),
            ("outcome", "admitted"),
        ],
    ) as u64
}

fn sim_calls(stack: &Stack, operation: &str) -> u64 {
    let stats = stack.sim.simulator.stats();
    stats.operations.get(operation).copied().unwrap_or(0)
}

#[tokio::test]
async fn bursts_of_500s_and_503s_pass_through_retryable_and_uncharged() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 64), "").await;
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    for (fault, status, error_type) in [
        ("500", 500, "InternalServerException"),
        ("503", 503, "ServiceUnavailableException"),
    ] {
        let before = settled(&stack.proxy, "not_charged");
        let burst = (0..20).map(|i| {
            let body = converse_body(&format!("[sim:fault={fault}] call {i}"), Some(100));
            raw_request(addr, "POST", &path, body, false)
        });
        for r in futures_util::future::join_all(burst).await {
            assert_eq!((r.status, r.error_type()), (status, error_type));
            assert!(!r.message().is_empty(), "Bedrock's message is passed on");
            assert!(r.header("x-amzn-requestid").is_some());
        }
        assert_eq!(settled(&stack.proxy, "not_charged") - before, 20);

        // The SDK retries them (3 attempts reach upstream) and gives up with the same error.
        let calls_before = sim_calls(&stack, "Converse");
        let err = sdk_client(addr, 3)
            .converse()
            .model_id(SONNET_US)
            .messages(user_message(&format!("[sim:fault={fault}] sdk")))
            .inference_config(max_tokens(100))
            .send()
            .await
            .expect_err("every attempt fails");
        assert_eq!(err.code(), Some(error_type), "{err:?}");
        assert_eq!(sim_calls(&stack, "Converse") - calls_before, 3, "retried");
    }
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "not_charged"), 2 * (20 + 3));
    assert_eq!(stack.sim.simulator.stats().tokens_charged(), 0);
}

#[tokio::test]
async fn a_refused_connection_is_a_retryable_503_and_charges_nothing() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dead = closed.local_addr().expect("addr");
    drop(closed);
    let proxy = start_proxy(proxy_config(dead, &sonnet_pool(1_000_000, 8), "")).await;
    let path = model_path(SONNET_US, "converse-stream");
    let r = raw_request(
        proxy.addr,
        "POST",
        &path,
        converse_body("x", Some(10)),
        false,
    )
    .await;
    assert_eq!(
        (r.status, r.error_type()),
        (503, "ServiceUnavailableException")
    );
    assert!(
        r.message()
            .contains("could not get an answer from bedrock-runtime"),
        "{}",
        r.message()
    );
    assert!(r.header("x-amz-retry-after").is_some() && r.header("retry-after").is_some());
    assert_eq!(r.header("x-tokengate-pool"), Some(POOL));
    assert_eq!(settled(&proxy, "not_charged"), 1);
    assert_eq!(upstream_errors(&proxy, "connect"), 1);

    // The SDK retries the 503: three attempts reach the proxy.
    let err = sdk_client(proxy.addr, 3)
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("x"))
        .inference_config(max_tokens(10))
        .send()
        .await
        .expect_err("upstream is gone");
    assert_eq!(err.code(), Some("ServiceUnavailableException"));
    assert_eq!(admitted(&proxy, "Converse"), 3);
    assert_eq!(settled(&proxy, "not_charged"), 4);
    assert_ledger_zero(&proxy).await;
}

#[tokio::test]
async fn a_connection_dropped_before_the_answer_is_a_retryable_503() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), "").await;
    let addr = stack.proxy.addr;
    for op in ["converse", "converse-stream"] {
        let r = raw_request(
            addr,
            "POST",
            &model_path(SONNET_US, op),
            converse_body("[sim:fault=reset] x", Some(10)),
            false,
        )
        .await;
        assert_eq!(
            (r.status, r.error_type()),
            (503, "ServiceUnavailableException"),
            "{op}: {}",
            r.message()
        );
        assert!(r.header("x-amz-retry-after").is_some());
    }
    assert_eq!(settled(&stack.proxy, "not_charged"), 2);
    assert_eq!(upstream_errors(&stack.proxy, "connect"), 2);
    // The dropped connection is not reused: the next call goes through.
    let ok = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=5] fine", Some(10)),
        false,
    )
    .await;
    assert_eq!(ok.status, 200);
    stack.assert_ledger_zero().await;
    let sim = stack.sim.simulator.stats();
    let bucket = sim.buckets.values().next().expect("a bucket");
    assert_eq!((bucket.errors, bucket.completed), (2, 1));
}

#[tokio::test]
async fn a_connection_dropped_during_a_plain_answer_aborts_it_and_settles_without_usage() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), "").await;
    // Non-streaming: upstream sends its 200 head, then the connection breaks.
    let r = try_request(
        stack.proxy.addr,
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:fault=cut] [sim:output=40] x", Some(100)),
    )
    .await;
    assert_eq!(r.status, 200, "the head was already on its way");
    let err = r.body.expect_err("the body must not look complete");
    assert!(!err.is_empty());
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "no_usage"), 1);
    assert_eq!(upstream_errors(&stack.proxy, "stream_cut"), 1);

    // The SDK sees an error (and retries it), never a truncated success.
    let calls_before = sim_calls(&stack, "Converse");
    let err = sdk_client(stack.proxy.addr, 3)
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:fault=cut] [sim:output=40] sdk"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect_err("a cut answer is an error");
    assert!(
        matches!(err, SdkError::ResponseError(_)),
        "a broken body, not a service error: {err:?}"
    );
    assert_eq!(
        sim_calls(&stack, "Converse") - calls_before,
        3,
        "the SDK retries a broken body"
    );
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "no_usage"), 1 + 3);
}

#[tokio::test]
async fn a_stream_cut_after_its_200_ends_with_an_exception_frame() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 1000\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 8), "").await;
    let body = serde_json::json!({
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 600,
        "messages": [{"role": "user", "content": "[sim:fault=cut] [sim:output=500] x"}],
    });
    for (op, event) in [
        ("converse-stream", "contentBlockDelta"),
        ("invoke-with-response-stream", "chunk"),
    ] {
        let payload = if op == "converse-stream" {
            converse_body("[sim:fault=cut] [sim:output=500] x", Some(600))
        } else {
            body.to_string()
        };
        let r = try_request(stack.proxy.addr, &model_path(SONNET_US, op), payload).await;
        assert_eq!(r.status, 200, "{op}");
        let bytes = r.body.expect("the proxy ends the stream cleanly, in-band");
        let frames = frames(&bytes);
        let (last, events) = frames.split_last().expect("frames");
        assert!(
            events
                .iter()
                .any(|f| f.message_type == "event" && f.kind == event),
            "{op}: content passed through before the cut"
        );
        assert_eq!(
            (last.message_type.as_str(), last.kind.as_str()),
            ("exception", "modelStreamErrorException"),
            "{op}"
        );
        let message: serde_json::Value = serde_json::from_slice(&last.payload).expect("json");
        assert!(
            message["message"]
                .as_str()
                .is_some_and(|m| m.contains("upstream stream interrupted")),
            "{message}"
        );
    }
    stack.assert_ledger_zero().await;
    assert_eq!(settled(&stack.proxy, "no_usage"), 2);
    assert_eq!(upstream_errors(&stack.proxy, "stream_cut"), 2);
    // Charged the larger of the reservation and what was seen (half of 500 tokens x burndown 5
    // is over the 600 reserved): generation may have gone on upstream.
    let charged = stack
        .proxy
        .state
        .metrics
        .charged_tokens
        .with_label_values(&[POOL])
        .get();
    let reserved = stack
        .proxy
        .state
        .metrics
        .reserved_tokens_total
        .with_label_values(&[POOL])
        .get();
    assert!(
        charged >= reserved && charged >= 2 * 5 * 200,
        "charged {charged}, reserved {reserved}"
    );
}

#[tokio::test]
async fn a_slow_stream_trickles_through_without_timing_out() {
    // 80 tokens at 40 tokens/s: frames of 2 tokens every 50 ms, two seconds in all, far longer
    // than the idle timeout (500 ms) and the header read timeout (1 s), each gap far shorter.
    // (That the frames are forwarded as they come is `tests/proxy.rs` streaming_is_not_buffered.)
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 40\ndefault_tokens_per_minute = 10000000\n";
    let sim = start_simulator(sim).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(1_000_000, 8), "");
    config.process.upstream.idle_timeout = Duration::from_millis(500);
    config.process.upstream.response_timeout = Duration::from_millis(500);
    config.process.server.header_read_timeout = Duration::from_secs(1);
    let proxy = start_proxy(config).await;
    let started = Instant::now();
    let mut out = sdk_client(proxy.addr, 1)
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=80] trickle"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("stream starts");
    let (mut text, mut usage) = (String::new(), None);
    while let Some(event) = out.stream.recv().await.expect("no stream error") {
        match event {
            ConverseStreamOutput::ContentBlockDelta(d) => {
                if let Some(Ok(t)) = d.delta().map(|d| d.as_text()) {
                    text.push_str(t);
                }
            }
            ConverseStreamOutput::Metadata(m) => usage = m.usage().cloned(),
            _ => {}
        }
    }
    // A lower bound, which a busy machine can only make truer: the stream outlived both timeouts.
    let elapsed = started.elapsed();
    assert!(elapsed > Duration::from_millis(1500), "took {elapsed:?}");
    assert_eq!(text.len(), 80 * 4 - 1, "every token arrived");
    assert_eq!(usage.map(|u| u.output_tokens()), Some(80));
    assert_ledger_zero(&proxy).await;
    assert_eq!(settled(&proxy, "usage"), 1);
    assert_eq!(upstream_errors(&proxy, "idle_timeout"), 0);
}
