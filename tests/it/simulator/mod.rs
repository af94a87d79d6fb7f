//! The simulator driven by the real `aws-sdk-bedrockruntime` client (and raw HTTP where the SDK
//! hides what we check), on `127.0.0.1:0`.

// Helpers below run only inside tests; a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use aws_sdk_bedrockruntime::{
    Client,
    config::{BehaviorVersion, Credentials, Region, retry::RetryConfig},
    primitives::Blob,
    types::{
        ContentBlock, ConversationRole, ConverseStreamOutput, ConverseTokensRequest,
        CountTokensInput, InferenceConfiguration, InvokeModelTokensRequest, Message,
        ResponseStream,
    },
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client as HttpClient, rt::TokioExecutor};
use serde_json::{Value, json};
use tokengate::simulator::{SigV4Key, SimulatorConfig, SimulatorHandle, spawn};

mod api_errors;
mod apis;
mod bidi;
mod credentials;
mod daily;
mod faults;
mod model_ids;
mod tiers;

const SONNET: &str = "anthropic.claude-sonnet-4-20250514-v1:0";

fn instant_config() -> SimulatorConfig {
    SimulatorConfig {
        time_to_first_token_ms: 0,
        tokens_per_second: 0.0,
        ..SimulatorConfig::default()
    }
}

/// `config` verifying SigV4 signatures of the key the test clients sign with.
fn verifying(config: SimulatorConfig) -> SimulatorConfig {
    SimulatorConfig {
        verify_sigv4: Some(SigV4Key {
            access_key_id: "AKIDTEST".into(),
            secret_access_key: "secret".into(),
        }),
        ..config
    }
}

async fn start(config: SimulatorConfig) -> SimulatorHandle {
    spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap()
}

fn client(sim: &SimulatorHandle, secret: &str) -> Client {
    client_in(sim, "us-east-1", secret)
}

/// A client signing for `region`.
fn client_in(sim: &SimulatorHandle, region: &str, secret: &str) -> Client {
    let config = aws_sdk_bedrockruntime::Config::builder()
        .endpoint_url(format!("http://{}", sim.addr))
        .region(Region::new(region.to_string()))
        .credentials_provider(Credentials::new("AKIDTEST", secret, None, None, "test"))
        .retry_config(RetryConfig::disabled())
        .behavior_version(BehaviorVersion::latest())
        .build();
    Client::from_conf(config)
}

fn user(text: &str) -> Message {
    Message::builder()
        .role(ConversationRole::User)
        .content(ContentBlock::Text(text.into()))
        .build()
        .unwrap()
}

fn max_tokens(n: i32) -> InferenceConfiguration {
    InferenceConfiguration::builder().max_tokens(n).build()
}

fn anthropic_body(text: &str, max: u64) -> Vec<u8> {
    json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": max,
        "messages": [{"role": "user", "content": text}]})
    .to_string()
    .into_bytes()
}

#[tokio::test]
async fn every_operation_answers_the_sdk_for_base_profile_and_arn_ids() {
    let sim = start(instant_config()).await;
    let c = client(&sim, "secret");
    let arn = format!("arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.{SONNET}");
    for model in [SONNET.to_string(), format!("us.{SONNET}"), arn] {
        let prompt = "hello simulator [sim:output=12]";
        let out = c
            .converse()
            .model_id(&model)
            .messages(user(prompt))
            .send()
            .await
            .unwrap();
        let usage = out.usage().unwrap();
        assert_eq!(usage.output_tokens(), 12, "{model}");
        assert_eq!(usage.total_tokens(), usage.input_tokens() + 12);
        assert_eq!(out.stop_reason().as_str(), "end_turn");
        let text = out.output().unwrap().as_message().unwrap().content()[0]
            .as_text()
            .unwrap();
        assert_eq!(
            text.len().div_ceil(4),
            12,
            "about 4 bytes a token: {text:?}"
        );

        // ConverseStream: every event, in order, and the metadata agrees with Converse.
        let mut stream = c
            .converse_stream()
            .model_id(&model)
            .messages(user(prompt))
            .send()
            .await
            .unwrap()
            .stream;
        let mut kinds = Vec::new();
        let mut streamed = String::new();
        while let Some(event) = stream.recv().await.unwrap() {
            match &event {
                ConverseStreamOutput::MessageStart(_) => kinds.push("start"),
                ConverseStreamOutput::ContentBlockDelta(d) => {
                    streamed.push_str(d.delta().unwrap().as_text().unwrap());
                    if kinds.last() != Some(&"delta") {
                        kinds.push("delta");
                    }
                }
                ConverseStreamOutput::ContentBlockStop(_) => kinds.push("stop"),
                ConverseStreamOutput::MessageStop(s) => {
                    assert_eq!(s.stop_reason().as_str(), "end_turn");
                    kinds.push("messageStop");
                }
                ConverseStreamOutput::Metadata(m) => {
                    let u = m.usage().unwrap();
                    assert_eq!(
                        (u.input_tokens(), u.output_tokens()),
                        (usage.input_tokens(), 12)
                    );
                    kinds.push("metadata");
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        assert_eq!(kinds, ["start", "delta", "stop", "messageStop", "metadata"]);
        assert_eq!(&streamed, text, "same request, same answer");

        // InvokeModel, Anthropic messages body.
        let out = c
            .invoke_model()
            .model_id(&model)
            .content_type("application/json")
            .body(Blob::new(anthropic_body(prompt, 100)))
            .send()
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(out.body().as_ref()).unwrap();
        assert_eq!(v["type"], "message");
        assert_eq!(v["content"][0]["type"], "text");
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(v["usage"]["output_tokens"], 12);

        // InvokeModelWithResponseStream: the last chunk carries the invocation metrics.
        let mut body = c
            .invoke_model_with_response_stream()
            .model_id(&model)
            .body(Blob::new(anthropic_body(prompt, 100)))
            .send()
            .await
            .unwrap()
            .body;
        let mut chunks = Vec::new();
        while let Some(ResponseStream::Chunk(part)) = body.recv().await.unwrap() {
            chunks.push(serde_json::from_slice::<Value>(part.bytes().unwrap().as_ref()).unwrap());
        }
        let types: Vec<&str> = chunks.iter().map(|c| c["type"].as_str().unwrap()).collect();
        assert_eq!(types.first(), Some(&"message_start"));
        assert_eq!(types.last(), Some(&"message_stop"));
        assert!(types.contains(&"content_block_delta") && types.contains(&"message_delta"));
        let metrics = &chunks.last().unwrap()["amazon-bedrock-invocationMetrics"];
        assert_eq!(metrics["outputTokenCount"], 12);
        assert_eq!(metrics["inputTokenCount"], v["usage"]["input_tokens"]);

        // CountTokens, both input forms, with the same rule as Converse's usage.
        let request = ConverseTokensRequest::builder()
            .messages(user(prompt))
            .build();
        let n = c
            .count_tokens()
            .model_id(&model)
            .input(CountTokensInput::Converse(request))
            .send()
            .await
            .unwrap()
            .input_tokens();
        assert_eq!(n, usage.input_tokens());
        let request = InvokeModelTokensRequest::builder()
            .body(Blob::new(anthropic_body(prompt, 100)))
            .build()
            .unwrap();
        let n = c
            .count_tokens()
            .model_id(&model)
            .input(CountTokensInput::InvokeModel(request))
            .send()
            .await
            .unwrap()
            .input_tokens();
        assert_eq!(i64::from(n), metrics["inputTokenCount"].as_i64().unwrap());
    }
    let stats = sim.simulator.stats();
    assert_eq!(stats.operations["CountTokens"], 6);
    let base = &stats.buckets[&format!("{SONNET}@us-east-1")];
    let geo = &stats.buckets[&format!("{SONNET}@geo:us")];
    assert_eq!(
        (base.completed, geo.completed),
        (4, 8),
        "the ARN lands in the us. bucket"
    );
    assert_eq!(geo.in_flight, 0);
}

/// POSTs raw bytes (unsigned) and returns status, headers and body.
async fn post(sim: &SimulatorHandle, path: &str, body: &[u8]) -> (u16, http::HeaderMap, Value) {
    let (status, headers, bytes) = post_with(sim, path, &[], body).await;
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// POSTs raw bytes with extra headers; returns status, headers and the body's bytes.
async fn post_with(
    sim: &SimulatorHandle,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, http::HeaderMap, Bytes) {
    let http = HttpClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::post(format!("http://{}{path}", sim.addr));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).unwrap();
    let resp = http.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status.as_u16(), parts.headers, bytes)
}

#[tokio::test]
async fn raw_wire_headers_and_validation_errors() {
    let sim = start(instant_config()).await;
    let path = format!("/model/{}/invoke", SONNET.replace(':', "%3A"));
    let (status, h, v) = post(&sim, &path, &anthropic_body("hi [sim:output=7]", 50)).await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(h["x-amzn-bedrock-output-token-count"], "7");
    assert_eq!(
        h["x-amzn-bedrock-input-token-count"],
        v["usage"]["input_tokens"].to_string().as_str()
    );
    assert!(h.contains_key("x-amzn-bedrock-invocation-latency"));
    assert!(h.contains_key("x-amzn-requestid"));

    let stream_path = path.replace("/invoke", "/invoke-with-response-stream");
    let (status, h, _) = post(&sim, &stream_path, &anthropic_body("hi", 50)).await;
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "application/vnd.amazon.eventstream");
    assert_eq!(h["x-amzn-bedrock-content-type"], "application/json");

    let no_max = br#"{"anthropic_version":"bedrock-2023-05-31","messages":[]}"#;
    let converse = path.replace("/invoke", "/converse");
    let too_many = br#"{"messages":[{"role":"user","content":[{"text":"x"}]}],"inferenceConfig":{"maxTokens":64001}}"#;
    for (p, body, needle) in [
        (&path, &no_max[..], "required key [max_tokens]"),
        (&path, b"{nope", "Malformed input request"),
        (&converse, b"{}", "'messages'"),
        (&converse, &too_many[..], "model limit of 64000"),
        (
            &path.replace("/invoke", "/invoke-with-bidirectional-stream"),
            b"{}",
            "needs HTTP/2",
        ),
    ] {
        let (status, h, v) = post(&sim, p, body).await;
        assert_eq!(
            (status, &h["x-amzn-errortype"]),
            (400, &"ValidationException".parse().unwrap())
        );
        assert!(v["message"].as_str().unwrap().contains(needle), "{v}");
    }
    let (status, h, _) = post(&sim, "/model/x/chat", b"{}").await;
    assert_eq!(
        (status, &h["x-amzn-errortype"]),
        (404, &"UnknownOperationException".parse().unwrap())
    );

    // h2c prior knowledge on the same port, as the JS SDK speaks it.
    let h2 = HttpClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://{}{converse}", sim.addr))
        .body(Full::new(Bytes::from_static(
            br#"{"messages":[{"role":"user","content":[{"text":"x"}]}]}"#,
        )))
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(
        (resp.status().as_u16(), resp.version()),
        (200, http::Version::HTTP_2)
    );

    let http = HttpClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = http
        .get(format!("http://{}/_sim/stats", sim.addr).parse().unwrap())
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let stats: tokengate::simulator::SimStats = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(stats.operations, sim.simulator.stats().operations);
    assert_eq!(stats.buckets[&format!("{SONNET}@us-east-1")].completed, 3);
}

#[tokio::test]
async fn reservations_throttle_burndown_settles_and_routes_are_separate_buckets() {
    // 60000 TPM refills 1000 tokens/s; the assertions below leave seconds of slack.
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 60_000,
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let started = Instant::now();
    let out = c
        .converse()
        .model_id(SONNET)
        .messages(user("burn [sim:output=1000]"))
        .inference_config(max_tokens(1000))
        .send()
        .await
        .unwrap();
    let u = out.usage().unwrap();
    assert_eq!(u.output_tokens(), 1000);
    let key = format!("{SONNET}@us-east-1");
    let b = &sim.simulator.stats().buckets[&key];
    assert_eq!(
        b.tokens_charged,
        u.input_tokens() as u64 + 5 * 1000,
        "burndown 5"
    );
    assert_eq!((b.in_flight, b.tokens_reserved_in_flight), (0, 0));
    // The charge left the bucket: what is there is at most the rest plus what refilled since the
    // call started (1,000 a second), however slow the machine.
    let refilled = (started.elapsed().as_secs_f64() * 1_000.0).ceil() as i64;
    assert!(
        b.tokens_available <= 60_000 - b.tokens_charged as i64 + refilled,
        "{} after {refilled} refilled",
        b.tokens_available
    );

    // input + 58000 fits in an empty bucket but not in what is left (about 55000).
    let big = || max_tokens(58_000);
    let arn = format!("arn:aws:bedrock:us-east-1::foundation-model/{SONNET}");
    for model in [SONNET.to_string(), arn] {
        let err = c
            .converse()
            .model_id(model)
            .messages(user("x"))
            .inference_config(big())
            .send()
            .await
            .unwrap_err();
        assert_eq!(err.raw_response().unwrap().status().as_u16(), 429);
        assert!(err.into_service_error().is_throttling_exception());
    }
    let b = &sim.simulator.stats().buckets[&key];
    assert_eq!((b.throttled, b.requests, b.completed), (2, 3, 1));

    // The us. and global. buckets of the same model still admit the same call.
    for model in [format!("us.{SONNET}"), format!("global.{SONNET}")] {
        c.converse()
            .model_id(model)
            .messages(user("x [sim:output=1]"))
            .inference_config(big())
            .send()
            .await
            .unwrap();
    }
    let stats = sim.simulator.stats();
    assert_eq!(stats.buckets[&format!("{SONNET}@geo:us")].completed, 1);
    assert_eq!(stats.buckets[&format!("{SONNET}@global")].throttled, 0);
}
