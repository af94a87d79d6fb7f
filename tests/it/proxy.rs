//! The foundation: every operation through the proxy, driven by aws-sdk-bedrockruntime, equals
//! the same call made directly to the simulator; the upstream sees only the proxy's signature;
//! streams are not buffered; the proxy's own errors are Bedrock-shaped.

use crate::common::*;
use aws_sdk_bedrockruntime::{
    primitives::Blob,
    types::{ConverseStreamOutput, ConverseTokensRequest, CountTokensInput, ResponseStream},
};

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

fn pools() -> String {
    format!(
        "{}\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 16\n\
         output_burndown = 1\ndefault_max_tokens = 500\n",
        sonnet_pool(1_000_000, 16)
    )
}

#[derive(Debug, PartialEq)]
struct ConverseResult {
    text: String,
    stop_reason: String,
    input: i32,
    output: i32,
}

async fn converse(
    client: &aws_sdk_bedrockruntime::Client,
    model: &str,
    prompt: &str,
) -> ConverseResult {
    let out = client
        .converse()
        .model_id(model)
        .messages(user_message(prompt))
        .inference_config(max_tokens(300))
        .send()
        .await
        .unwrap_or_else(|e| panic!("converse {model}: {:?}", e));
    let message = out
        .output()
        .and_then(|o| o.as_message().ok())
        .expect("message");
    let text = message
        .content()
        .iter()
        .filter_map(|c| c.as_text().ok())
        .cloned()
        .collect::<String>();
    let usage = out.usage().expect("usage");
    ConverseResult {
        text,
        stop_reason: out.stop_reason().as_str().to_string(),
        input: usage.input_tokens(),
        output: usage.output_tokens(),
    }
}

/// Event names in order, the text, and the metadata usage.
async fn converse_stream(
    client: &aws_sdk_bedrockruntime::Client,
    model: &str,
    prompt: &str,
) -> (Vec<String>, String, (i32, i32)) {
    let mut out = client
        .converse_stream()
        .model_id(model)
        .messages(user_message(prompt))
        .inference_config(max_tokens(300))
        .send()
        .await
        .unwrap_or_else(|e| panic!("converse-stream {model}: {:?}", e));
    let (mut events, mut text, mut usage) = (Vec::new(), String::new(), (0, 0));
    while let Some(event) = out.stream.recv().await.expect("stream event") {
        let name = match &event {
            ConverseStreamOutput::MessageStart(_) => "messageStart",
            ConverseStreamOutput::ContentBlockStart(_) => "contentBlockStart",
            ConverseStreamOutput::ContentBlockDelta(d) => {
                if let Some(t) = d.delta().and_then(|d| d.as_text().ok()) {
                    text.push_str(t);
                }
                "contentBlockDelta"
            }
            ConverseStreamOutput::ContentBlockStop(_) => "contentBlockStop",
            ConverseStreamOutput::MessageStop(_) => "messageStop",
            ConverseStreamOutput::Metadata(m) => {
                let u = m.usage().expect("metadata usage");
                usage = (u.input_tokens(), u.output_tokens());
                "metadata"
            }
            _ => "other",
        };
        if events.last().map(String::as_str) != Some(name) || name != "contentBlockDelta" {
            events.push(name.to_string());
        }
    }
    (events, text, usage)
}

fn anthropic_body(prompt: &str) -> Vec<u8> {
    serde_json::json!({
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    })
    .to_string()
    .into_bytes()
}

async fn invoke(
    client: &aws_sdk_bedrockruntime::Client,
    model: &str,
    prompt: &str,
) -> (serde_json::Value, Option<String>) {
    let out = client
        .invoke_model()
        .model_id(model)
        .content_type("application/json")
        .body(Blob::new(anthropic_body(prompt)))
        .send()
        .await
        .unwrap_or_else(|e| panic!("invoke {model}: {:?}", e));
    let mut body: serde_json::Value =
        serde_json::from_slice(out.body().as_ref()).expect("json body");
    body.as_object_mut().map(|o| o.remove("id"));
    (body, None)
}

async fn invoke_stream(
    client: &aws_sdk_bedrockruntime::Client,
    model: &str,
    prompt: &str,
) -> (usize, serde_json::Value) {
    let mut out = client
        .invoke_model_with_response_stream()
        .model_id(model)
        .content_type("application/json")
        .body(Blob::new(anthropic_body(prompt)))
        .send()
        .await
        .unwrap_or_else(|e| panic!("invoke stream {model}: {:?}", e));
    let (mut chunks, mut last) = (0, serde_json::Value::Null);
    while let Some(event) = out.body.recv().await.expect("chunk") {
        if let ResponseStream::Chunk(part) = event {
            chunks += 1;
            last =
                serde_json::from_slice(part.bytes().expect("bytes").as_ref()).expect("chunk json");
        }
    }
    (chunks, last)
}

async fn count_tokens(client: &aws_sdk_bedrockruntime::Client, model: &str, prompt: &str) -> i32 {
    let request = ConverseTokensRequest::builder()
        .messages(user_message(prompt))
        .build();
    client
        .count_tokens()
        .model_id(model)
        .input(CountTokensInput::Converse(request))
        .send()
        .await
        .unwrap_or_else(|e| panic!("count-tokens {model}: {:?}", e))
        .input_tokens()
}

#[tokio::test]
async fn every_operation_through_the_proxy_equals_direct() {
    let stack = Stack::start(FAST_SIM, &pools(), "").await;
    let (proxied, direct) = (stack.client(), stack.direct_client());
    for model in [HAIKU, SONNET_US, SONNET_US_ARN] {
        let prompt = format!("Summarise the quarterly report for {model}.");
        let via = converse(&proxied, model, &prompt).await;
        assert!(via.output > 0 && !via.text.is_empty());
        assert_eq!(
            via,
            converse(&direct, model, &prompt).await,
            "converse {model}"
        );

        let via = converse_stream(&proxied, model, &prompt).await;
        // Bedrock's order for a text answer (consecutive deltas counted once).
        assert_eq!(
            via.0,
            [
                "messageStart",
                "contentBlockDelta",
                "contentBlockStop",
                "messageStop",
                "metadata"
            ],
            "converse-stream {model}"
        );
        assert!(via.2.1 > 0, "metadata usage reported");
        assert_eq!(
            via,
            converse_stream(&direct, model, &prompt).await,
            "converse-stream {model}"
        );

        let via = invoke(&proxied, model, &prompt).await;
        assert!(
            via.0["usage"]["output_tokens"].as_u64().unwrap_or(0) > 0,
            "{:?}",
            via.0
        );
        assert_eq!(via, invoke(&direct, model, &prompt).await, "invoke {model}");

        let via = invoke_stream(&proxied, model, &prompt).await;
        assert!(via.0 >= 2);
        assert!(
            via.1.get("amazon-bedrock-invocationMetrics").is_some(),
            "last chunk carries metrics: {}",
            via.1
        );
        let mut direct_result = invoke_stream(&direct, model, &prompt).await;
        let strip = |v: &mut serde_json::Value| {
            v["amazon-bedrock-invocationMetrics"]
                .as_object_mut()
                .map(|m| {
                    m.remove("invocationLatency");
                    m.remove("firstByteLatency");
                })
        };
        let mut via = via;
        strip(&mut via.1);
        strip(&mut direct_result.1);
        assert_eq!(via, direct_result, "invoke-with-response-stream {model}");

        let via = count_tokens(&proxied, model, &prompt).await;
        assert!(via > 0);
        assert_eq!(
            via,
            count_tokens(&direct, model, &prompt).await,
            "count-tokens {model}"
        );
    }
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn upstream_sees_only_the_proxy_signature() {
    let sim = format!(
        "{FAST_SIM}verify_sigv4 = {{ access_key_id = \"{PROXY_KEY_ID}\", secret_access_key = \"{PROXY_SECRET}\" }}\n"
    );
    let stack = Stack::start(&sim, &pools(), "").await;
    converse(&stack.client(), SONNET_US, "hello").await;
    converse_stream(&stack.client(), HAIKU, "hello").await;
    invoke(&stack.client(), SONNET_US_ARN, "hello").await;

    // The same call straight to the simulator with the application's own key is refused, so
    // the verification is real.
    let direct = stack
        .direct_client()
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hi"))
        .send()
        .await;
    let err = direct.expect_err("the application's key is not the proxy's");
    assert_eq!(err.raw_response().map(|r| r.status().as_u16()), Some(403));

    let stats = stack.sim.simulator.stats();
    assert_eq!(stats.sigv4.verified, 3, "{stats:?}");
    assert_eq!(stats.sigv4.rejected, 1);
    assert!(stats.sigv4.access_key_ids.contains(PROXY_KEY_ID));
    assert!(
        stats.sigv4.access_key_ids.contains(CLIENT_KEY_ID),
        "only from the direct call"
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn streaming_is_not_buffered() {
    // 400 output tokens at 100 tokens/s: two seconds of generation.
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 100\ndefault_tokens_per_minute = 10000000\n";
    let stack = Stack::start(sim, &pools(), "").await;
    let mut out = stack
        .client()
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=400] write at length"))
        .inference_config(max_tokens(1000))
        .send()
        .await
        .expect("stream starts");
    let mut in_flight_at_first_delta = None;
    let mut deltas = 0;
    while let Some(event) = out.stream.recv().await.expect("event") {
        if let ConverseStreamOutput::ContentBlockDelta(_) = event {
            deltas += 1;
            if in_flight_at_first_delta.is_none() {
                let stats = stack.sim.simulator.stats();
                in_flight_at_first_delta =
                    Some(stats.buckets.values().map(|b| b.in_flight).sum::<u64>());
            }
        }
    }
    assert!(deltas > 1);
    assert_eq!(
        in_flight_at_first_delta,
        Some(1),
        "the first delta arrived while the simulator was still generating"
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn http2_cleartext_is_served_on_the_same_port() {
    let stack = Stack::start(FAST_SIM, &pools(), "").await;
    let path = model_path(SONNET_US, "converse");
    for h2 in [true, false] {
        let response = raw_request(
            stack.proxy.addr,
            "POST",
            &path,
            converse_body("hello over h2c", Some(100)),
            h2,
        )
        .await;
        assert_eq!(response.status, 200, "h2={h2}: {:?}", response.body);
        let body: serde_json::Value = serde_json::from_slice(&response.body).expect("json");
        assert!(body["usage"]["outputTokens"].as_u64().unwrap_or(0) > 0);
    }
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn the_proxys_own_errors_are_bedrock_shaped() {
    let stack = Stack::start(FAST_SIM, &pools(), "").await;
    let addr = stack.proxy.addr;
    let converse_path = model_path(SONNET_US, "converse");

    let r = raw_request(addr, "POST", "/model/x/chat", "{}", false).await;
    assert_eq!(
        (r.status, r.error_type()),
        (404, "UnknownOperationException")
    );

    let r = raw_request(addr, "POST", &converse_path, "{not json", false).await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(r.message().contains("not valid JSON"), "{}", r.message());

    let r = raw_request(addr, "POST", "/model/a%G1/converse", "{}", false).await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));

    let r = raw_request(
        addr,
        "POST",
        &model_path("meta.llama3-70b-instruct-v1:0", "converse"),
        converse_body("x", Some(10)),
        false,
    )
    .await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(
        r.message().contains("meta.llama3-70b-instruct-v1:0") && r.message().contains("[[pools]]"),
        "{}",
        r.message()
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn oversized_bodies_and_unreachable_upstreams_get_clear_errors() {
    // An upstream that is gone: bind, note the port, close it.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dead = closed.local_addr().expect("addr");
    drop(closed);
    let mut config = proxy_config(dead, &sonnet_pool(100_000, 4), "");
    config.process.server.max_body_bytes = 1024;
    let proxy = start_proxy(config).await;
    let path = model_path(SONNET_US, "converse");

    let r = raw_request(
        proxy.addr,
        "POST",
        &path,
        converse_body(&"x".repeat(2000), Some(10)),
        false,
    )
    .await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(r.message().contains("max_body_bytes"), "{}", r.message());

    let r = raw_request(
        proxy.addr,
        "POST",
        &path,
        converse_body("hello", Some(10)),
        false,
    )
    .await;
    assert_eq!(
        (r.status, r.error_type()),
        (503, "ServiceUnavailableException"),
        "{:?}",
        r.message()
    );
    assert!(r.header("x-amz-retry-after").is_some());
    assert_ledger_zero(&proxy).await;
}
