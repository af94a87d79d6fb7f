//! The OpenAI and Anthropic APIs are traced as the native operations are: a `chat` request span
//! with the call's usage and settlement, an upstream span, and the caller's trace continued to
//! the simulator.

use serde_json::json;

use super::{
    receiver::{assert_child, attributes, http_receiver, one_of_kind},
    tracing_config,
};
use crate::common::{apis::*, *};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_and_anthropic_calls_are_traced_and_their_trace_continues_upstream() {
    let (otlp, received) = http_receiver().await;
    let tracing = tracing_config(&format!("http://{otlp}"), "http/protobuf");
    let pools = format!("{}\n{}", gpt_pool(1_000_000, ""), sonnet_pool(1_000_000, 4));
    let stack = Stack::start(FAST_SIM, &pools, &tracing).await;
    let chat = json!({"model": GPT, "max_completion_tokens": 200,
        "messages": [{"role": "user", "content": "hello [sim:output=12]"}]});
    let messages = json!({"model": SONNET_US, "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello [sim:output=9]"}]});
    let calls = [
        (CHAT, chat, "6", GPT, "gpt", "OpenAIChatCompletions", 12),
        (
            MESSAGES,
            messages,
            "7",
            SONNET_US,
            "sonnet4-us",
            "AnthropicMessages",
            9,
        ),
    ];
    for (path, body, digit, model, pool, operation, output) in calls {
        let trace = digit.repeat(32);
        let parent = format!("00-{trace}-{}-01", digit.repeat(16));
        let r = raw_request_with(
            stack.proxy.addr,
            "POST",
            path,
            body.to_string(),
            false,
            &[("traceparent", parent.as_str())],
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let spans = received.trace(&hex::decode(&trace).expect("hex"), 2).await;
        let server = one_of_kind(&spans, SpanKind::Server);
        let upstream = one_of_kind(&spans, SpanKind::Client);
        assert_eq!(hex::encode(&server.parent_span_id), digit.repeat(16));
        assert_eq!(server.name, format!("chat {model}"));
        assert_child(&upstream, &server);
        assert_eq!(upstream.name, format!("BedrockRuntime/{operation}"));
        let a = attributes(&server);
        for (key, value) in [
            ("gen_ai.operation.name", "chat"),
            ("gen_ai.request.model", model),
            ("gen_ai.usage.output_tokens", &output.to_string()),
            ("tokengate.pool", pool),
            ("tokengate.decision", "admitted"),
            ("tokengate.settlement_rule", "usage"),
            ("http.response.status_code", "200"),
        ] {
            assert_eq!(a.get(key).map(String::as_str), Some(value), "{key}: {a:?}");
        }
        assert_eq!(
            stack.sim.simulator.stats().traceparents.last(),
            Some(&format!("00-{trace}-{}-01", hex::encode(&upstream.span_id)))
        );
    }
    stack.assert_ledger_zero().await;
}
