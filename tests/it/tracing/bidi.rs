//! A bidirectional stream (InvokeModelWithBidirectionalStream, Nova Sonic over h2c with the
//! Rust SDK) is traced as any call: the caller's trace continued, a request span and an upstream
//! span with the session's usage and settlement, and the trace passed on to the simulator.

use serde_json::json;

use super::{
    CALLER_SPAN,
    receiver::{assert_child, attributes, http_receiver, one_of_kind},
    tracing_config,
};
use crate::common::{sonic::*, *};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

const SESSION_TRACE: &str = "5af7651916cd43dd8448eb211c80319c";
/// What a session reserves in the proxy's pool (`bidirectional_reservation`).
const RESERVATION: u64 = 1_000;

fn sonic_pool() -> String {
    format!(
        "[[pools]]\nname = \"sonic\"\nmodels = [\"{SONIC}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 2\noutput_burndown = 1\ndefault_max_tokens = 500\n\
         bidirectional_reservation = {RESERVATION}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bidirectional_session_is_traced_and_its_trace_continues_upstream() {
    let (otlp, received) = http_receiver().await;
    let tracing = tracing_config(&format!("http://{otlp}"), "http/protobuf");
    let stack = Stack::start(SONIC_SIM, &sonic_pool(), &tracing).await;
    let client = h2c_client(
        stack.proxy.addr,
        "us-east-1",
        CLIENT_KEY_ID,
        "application-secret",
    );
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let caller = Caller(tx);
    caller
        .send(
            "sessionStart",
            json!({"inferenceConfiguration": {"maxTokens": 300}}),
        )
        .await;
    let traceparent = format!("00-{SESSION_TRACE}-{CALLER_SPAN}-01");
    let mut session = client
        .invoke_model_with_bidirectional_stream()
        .model_id(SONIC)
        .body(input_stream(rx))
        .customize()
        .mutate_request(move |r| {
            r.headers_mut().insert("traceparent", traceparent.clone());
        })
        .send()
        .await
        .expect("the session opens");
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hello sonic [sim:output=20]").await;
    let first = until_usage(&mut session).await;
    assert_eq!(names(&first), FIRST_TURN);
    let (input, output) = totals(&first[4]);
    assert_eq!(output, 20);
    caller.send("promptEnd", json!({"promptName": "p1"})).await;
    caller.send("sessionEnd", json!({})).await;
    drop(caller);
    while session
        .body
        .recv()
        .await
        .expect("the session ends cleanly")
        .is_some()
    {}

    let spans = received
        .trace(&hex::decode(SESSION_TRACE).expect("hex"), 2)
        .await;
    let server = one_of_kind(&spans, SpanKind::Server);
    let upstream = one_of_kind(&spans, SpanKind::Client);
    assert_eq!(hex::encode(&server.parent_span_id), CALLER_SPAN);
    assert_eq!(
        server.name,
        format!("InvokeModelWithBidirectionalStream {SONIC}")
    );
    assert_child(&upstream, &server);
    assert_eq!(
        upstream.name,
        "BedrockRuntime/InvokeModelWithBidirectionalStream"
    );
    let a = attributes(&server);
    for (key, value) in [
        ("gen_ai.system", "aws.bedrock"),
        (
            "gen_ai.operation.name",
            "InvokeModelWithBidirectionalStream",
        ),
        ("gen_ai.request.model", SONIC),
        ("gen_ai.usage.input_tokens", &input.to_string()),
        ("gen_ai.usage.output_tokens", "20"),
        ("tokengate.pool", "sonic"),
        ("tokengate.route", "default"),
        ("tokengate.decision", "admitted"),
        ("tokengate.reservation", &RESERVATION.to_string()),
        ("tokengate.settlement_rule", "usage"),
        ("tokengate.charge", &(input + output).to_string()),
        ("http.response.status_code", "200"),
    ] {
        assert_eq!(a.get(key).map(String::as_str), Some(value), "{key}: {a:?}");
    }
    assert_eq!(
        attributes(&upstream)["rpc.method"],
        "InvokeModelWithBidirectionalStream"
    );
    // Upstream received the trace: the caller's trace id, the upstream span as parent.
    assert_eq!(
        stack.sim.simulator.stats().traceparents,
        [format!(
            "00-{SESSION_TRACE}-{}-01",
            hex::encode(&upstream.span_id)
        )]
    );
    stack.assert_ledger_zero().await;
}
