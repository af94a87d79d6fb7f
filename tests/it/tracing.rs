//! OpenTelemetry traces, received by OTLP receivers in the test that decode the official
//! protobuf definitions (`opentelemetry-proto`): an axum server for OTLP/HTTP and the
//! collector's own generated gRPC `TraceService`. Each test drives the proxy with real clients
//! and checks the spans' attributes, their parent/child links, and the `traceparent` the
//! simulator received upstream. The receivers are in [`receiver`]; the bidirectional stream's
//! session is in [`bidi`], the OpenAI and Anthropic APIs' calls in [`apis`].

mod apis;
mod bidi;
mod receiver;

use std::{net::SocketAddr, time::Duration};

use crate::common::{tap, *};
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode};
use receiver::{assert_child, attributes, grpc_receiver, http_receiver, one_of_kind};
use tokio::net::TcpListener;

/// Instant answers, except that `[sim:fault=stall]` holds a call for a while.
const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 300\n";

fn tracing_config(endpoint: &str, protocol: &str) -> String {
    format!(
        "[tracing]\notlp_endpoint = \"{endpoint}\"\nprotocol = \"{protocol}\"\nservice_name = \"gateway-test\"\nexport_interval_ms = 50\n"
    )
}

/// Sonnet queues behind one request at a time; Haiku refuses at once.
fn pools() -> String {
    format!(
        "{}max_wait_ms = 5000\n\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n",
        sonnet_pool(100_000, 1)
    )
}

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_carry_the_genai_attributes_and_the_trace_continues_upstream() {
    let (otlp, received) = http_receiver().await;
    let stack = Stack::start(
        SIM,
        &pools(),
        &tracing_config(&format!("http://{otlp}"), "http/protobuf"),
    )
    .await;
    let addr = stack.proxy.addr;
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("tracestate", "vendor=abc"),
    ];

    // The caller's trace, continued: admitted, forwarded, settled with usage.
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=42] hello", Some(300)),
        false,
        &headers,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    let usage: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    let input_tokens = usage["usage"]["inputTokens"].as_u64().expect("input");
    let spans = received
        .trace(&hex::decode(CALLER_TRACE).expect("hex"), 2)
        .await;
    let server = one_of_kind(&spans, SpanKind::Server);
    let upstream = one_of_kind(&spans, SpanKind::Client);
    assert_eq!(hex::encode(&server.parent_span_id), CALLER_SPAN);
    assert_eq!(server.trace_state, "vendor=abc");
    assert_eq!(server.name, format!("chat {SONNET_US}"));
    assert_child(&upstream, &server);
    assert_eq!(upstream.name, "BedrockRuntime/Converse");
    let a = attributes(&server);
    for (key, value) in [
        ("gen_ai.system", "aws.bedrock"),
        ("gen_ai.provider.name", "aws.bedrock"),
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.request.model", SONNET_US),
        ("gen_ai.request.max_tokens", "300"),
        ("gen_ai.usage.output_tokens", "42"),
        ("gen_ai.usage.input_tokens", &input_tokens.to_string()),
        ("tokengate.pool", "sonnet4-us"),
        ("tokengate.route", "default"),
        ("tokengate.decision", "admitted"),
        ("tokengate.settlement_rule", "usage"),
        ("tokengate.charge", &(input_tokens + 42 * 5).to_string()),
        ("http.response.status_code", "200"),
    ] {
        assert_eq!(a.get(key).map(String::as_str), Some(value), "{key}: {a:?}");
    }
    let reserved: u64 = a["tokengate.reservation"].parse().expect("a number");
    assert!(reserved >= 300 + input_tokens, "{reserved}");
    assert_eq!(
        a["aws.request_id"],
        r.header("x-amzn-requestid").expect("id")
    );
    let up = attributes(&upstream);
    assert_eq!(up["rpc.method"], "Converse");
    assert_eq!(up["gen_ai.usage.output_tokens"], "42");
    // Upstream received the trace: the caller's trace id, the upstream span as parent.
    let seen = stack.sim.simulator.stats().traceparents;
    assert_eq!(
        seen,
        [format!(
            "00-{CALLER_TRACE}-{}-01",
            hex::encode(&upstream.span_id)
        )]
    );
    assert_eq!(received.services.lock().expect("lock")[0], "gateway-test");

    // A queued request, from the SDK (no traceparent: a new trace): a queue-wait child.
    let first = tokio::spawn(converse_raw(addr, "[sim:fault=stall] first"));
    wait_in_flight(&stack, "sonnet4-us").await;
    let client = stack.client();
    let out = client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=7] second"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("admitted after waiting");
    assert_eq!(out.usage().expect("usage").output_tokens(), 7);
    assert_eq!(first.await.expect("task"), 200);
    let queued_trace = received.first(|s| s.name == "queue wait").await.trace_id;
    let spans = received.trace(&queued_trace, 3).await;
    let server = one_of_kind(&spans, SpanKind::Server);
    assert!(server.parent_span_id.is_empty(), "a root span");
    let queue = one_of_kind(&spans, SpanKind::Internal);
    assert_child(&queue, &server);
    assert_child(&one_of_kind(&spans, SpanKind::Client), &server);
    let a = attributes(&server);
    assert_eq!(a["tokengate.decision"], "queued_then_admitted");
    assert_eq!(
        a["tokengate.queue_wait_ms"],
        attributes(&queue)["tokengate.queue_wait_ms"]
    );
    assert!(queue.end_time_unix_nano <= one_of_kind(&spans, SpanKind::Client).start_time_unix_nano);

    // Turned away (Haiku is busy): one span, no upstream call, the reason and the hint.
    let busy = tokio::spawn(async move {
        raw_request(
            addr,
            "POST",
            &model_path(HAIKU, "converse"),
            converse_body("[sim:fault=stall] hold", Some(10)),
            false,
        )
        .await
        .status
    });
    wait_in_flight(&stack, "haiku").await;
    let rejected_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(HAIKU, "converse"),
        converse_body("x", Some(10)),
        false,
        &[("traceparent", rejected_parent)],
    )
    .await;
    assert_eq!(r.status, 429);
    let spans = received
        .trace(
            &hex::decode("0af7651916cd43dd8448eb211c80319c").expect("hex"),
            1,
        )
        .await;
    let a = attributes(&spans[0]);
    assert_eq!(a["tokengate.decision"], "rejected");
    assert_eq!(a["tokengate.rejection_reason"], "concurrency");
    assert_eq!(a["http.response.status_code"], "429");
    let hint_ms: u64 = r
        .header("x-amz-retry-after")
        .expect("hint")
        .parse()
        .expect("ms");
    assert_eq!(a["tokengate.retry_after_ms"], hint_ms.to_string());
    assert!(spans[0].status.is_none(), "a 429 is not a server error");
    assert_eq!(busy.await.expect("task"), 200);

    // An upstream 503: the spans are errors.
    let failed_parent = "00-11111111111111111111111111111111-2222222222222222-01";
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:fault=503] x", Some(10)),
        false,
        &[("traceparent", failed_parent)],
    )
    .await;
    assert_eq!(r.status, 503);
    let spans = received.trace(&[0x11; 16], 2).await;
    for span in &spans {
        let status = span.status.as_ref().expect("an error status");
        assert_eq!(status.code, StatusCode::Error as i32, "{}", span.name);
    }
    let server = attributes(&one_of_kind(&spans, SpanKind::Server));
    assert_eq!(server["tokengate.settlement_rule"], "not_charged");

    // A caller that did not sample its trace: nothing is recorded, its header goes upstream as is.
    let unsampled = "00-33333333333333333333333333333333-4444444444444444-00";
    let before = received.spans.lock().expect("lock").len();
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("x", Some(10)),
        false,
        &[("traceparent", unsampled)],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        stack
            .sim
            .simulator
            .stats()
            .traceparents
            .last()
            .map(String::as_str),
        Some(unsampled)
    );
    stack.assert_ledger_zero().await;
    // Shutdown flushes what is queued; nothing of the unsampled trace was among it.
    stack.proxy.shutdown().await.expect("shutdown");
    let spans = received.spans.lock().expect("lock");
    assert!(
        spans[before..].iter().all(|s| s.trace_id != [0x33; 16]),
        "an unsampled request was traced"
    );
}

async fn converse_raw(addr: SocketAddr, text: &str) -> u16 {
    converse_raw_model(addr, SONNET_US, text).await
}

async fn converse_raw_model(addr: SocketAddr, model: &str, text: &str) -> u16 {
    raw_request(
        addr,
        "POST",
        &model_path(model, "converse"),
        converse_body(text, Some(10)),
        false,
    )
    .await
    .status
}

/// Waits (bounded) until `pool` has a request in flight.
async fn wait_in_flight(stack: &Stack, pool: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while in_flight(&stack.proxy, pool) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing admitted in {pool}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_grpc_and_a_down_collector_costs_requests_nothing() {
    let (otlp, received) = grpc_receiver().await;
    let stack = Stack::start(
        SIM,
        &sonnet_pool(100_000, 4),
        &tracing_config(&format!("http://{otlp}"), "grpc"),
    )
    .await;
    let client = stack.client();
    let out = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=12] stream"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .expect("stream");
    let mut events = out.stream;
    while events.recv().await.expect("event").is_some() {}
    let trace_id = received.first(|_| true).await.trace_id;
    let spans = received.trace(&trace_id, 2).await;
    let server = one_of_kind(&spans, SpanKind::Server);
    assert_child(&one_of_kind(&spans, SpanKind::Client), &server);
    let a = attributes(&server);
    assert_eq!(a["gen_ai.usage.output_tokens"], "12");
    assert_eq!(a["tokengate.settlement_rule"], "usage");
    assert_eq!(
        one_of_kind(&spans, SpanKind::Client).name,
        "BedrockRuntime/ConverseStream"
    );
    stack.assert_ledger_zero().await;
    stack.proxy.shutdown().await.expect("shutdown");

    // A collector nobody listens on: requests are served as before; the spans fail to export
    // and are counted.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let stack = Stack::start(
        SIM,
        &sonnet_pool(100_000, 4),
        &tracing_config(&format!("http://{closed}"), "http/protobuf"),
    )
    .await;
    let r = converse_raw(stack.proxy.addr, "[sim:output=3] x").await;
    assert_eq!(r, 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = scrape(stack.proxy.addr).await;
        if m.get("tokengate_trace_spans_total", &[("result", "failed")]) == 2.0 {
            m.expect(
                "tokengate_trace_spans_total",
                &[("result", "exported")],
                0.0,
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the failed export was not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.assert_ledger_zero().await;
}

/// Adds a `traceparent` after the SDK signed the request, as something between the caller and
/// the proxy could.
#[derive(Debug)]
struct AddedAfterSigning;

impl aws_sdk_bedrockruntime::config::Intercept for AddedAfterSigning {
    fn name(&self) -> &'static str {
        "AddedAfterSigning"
    }

    fn modify_before_transmit(
        &self,
        context: &mut aws_sdk_bedrockruntime::config::interceptors::BeforeTransmitInterceptorContextMut<'_>,
        _: &aws_sdk_bedrockruntime::config::RuntimeComponents,
        _: &mut aws_sdk_bedrockruntime::config::ConfigBag,
    ) -> Result<(), aws_sdk_bedrockruntime::error::BoxError> {
        context.request_mut().headers_mut().insert(
            "traceparent",
            "00-55555555555555555555555555555555-6666666666666666-01",
        );
        Ok(())
    }
}

/// Tracing off: the caller's trace context goes upstream as it came, through the header
/// allow-list; a SigV4 caller's only when it signed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tracing_a_signed_caller_context_passes_through_and_an_unsigned_one_does_not() {
    const KEY_ID: &str = "AKIATRIAGE0000000001";
    const SECRET: &str = "triage-secret";
    let sim = start_simulator(SIM).await;
    let tap = tap::Tap::start(sim.addr, &[]).await;
    let routes = format!(
        "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"triage\"\naccess_key_id = \"{KEY_ID}\"\nsecret_access_key = \"{SECRET}\"\n"
    );
    let stack = Stack {
        proxy: start_proxy(proxy_config(tap.addr, &sonnet_pool(100_000, 4), &routes)).await,
        sim,
    };
    let client = keyed_client(stack.proxy.addr, KEY_ID, SECRET);
    let caller = "00-77777777777777777777777777777777-8888888888888888-01";
    client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=3] signed context"))
        .customize()
        .mutate_request(move |r| {
            r.headers_mut().insert("traceparent", caller);
            r.headers_mut().insert("tracestate", "vendor=xyz");
        })
        .send()
        .await
        .expect("signed with the trace context");
    client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=3] added context"))
        .customize()
        .interceptor(AddedAfterSigning)
        .send()
        .await
        .expect("signed without it");
    let seen = tap.seen();
    assert_eq!(seen.len(), 2);
    let header = |i: usize, name: &str| {
        seen[i]
            .headers
            .get(name)
            .map(|v| v.to_str().expect("ascii").to_string())
    };
    assert_eq!(header(0, "traceparent").as_deref(), Some(caller));
    assert_eq!(header(0, "tracestate").as_deref(), Some("vendor=xyz"));
    assert_eq!(header(1, "traceparent"), None, "added after signing");
    stack.assert_ledger_zero().await;
}

/// A request that spilled: its span names the pool it ran in and its home pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spilled_request_s_span_names_its_home_pool() {
    let (otlp, received) = http_receiver().await;
    let pools = haiku_spilling_west();
    let config = format!(
        "{}\n[[routes]]\nname = \"default\"\nspill = true\n",
        tracing_config(&format!("http://{otlp}"), "http/protobuf")
    );
    let stack = Stack::start(SIM, &pools, &config).await;
    let addr = stack.proxy.addr;
    // The home pool's only permit, held by a call that stalls.
    let first = tokio::spawn(converse_raw_model(addr, HAIKU, "[sim:fault=stall] first"));
    wait_in_flight(&stack, "haiku").await;
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(HAIKU, "converse"),
        converse_body("[sim:output=3] spilled", Some(100)),
        false,
        &[("traceparent", traceparent.as_str())],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    let spans = received
        .trace(&hex::decode(CALLER_TRACE).expect("hex"), 2)
        .await;
    let a = attributes(&one_of_kind(&spans, SpanKind::Server));
    assert_eq!(
        a.get("tokengate.pool").map(String::as_str),
        Some("haiku-west"),
        "{a:?}"
    );
    assert_eq!(
        a.get("tokengate.spilled_from").map(String::as_str),
        Some("haiku"),
        "{a:?}"
    );
    assert_eq!(first.await.expect("task"), 200);
    stack.assert_ledger_zero().await;
}
