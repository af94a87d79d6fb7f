//! InvokeModelWithBidirectionalStream, driven by aws-sdk-bedrockruntime's
//! `invoke_model_with_bidirectional_stream` over HTTP/2 cleartext (prior knowledge), through the
//! h2c connector of `tests/it/common/sonic.rs`.

use aws_sdk_bedrockruntime::types::InvokeModelWithBidirectionalStreamOutput;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client as HttpClient, rt::TokioExecutor};
use serde_json::{Value, json};
use tokengate::bedrock::eventstream::{Frame, FrameReader};
use tokengate::simulator::{SimulatorConfig, SimulatorHandle};
use tokio::sync::mpsc;

use super::{instant_config, start, verifying};
use crate::common::sonic::{FIRST_TURN, SONIC, input_stream, names, open, totals, until_usage};
use crate::common::sonic_raw::raw_session;

/// The SDK over h2c, signing with the key the simulator verifies.
fn h2c_client(sim: &SimulatorHandle, region: &str) -> aws_sdk_bedrockruntime::Client {
    crate::common::sonic::h2c_client(sim.addr, region, "AKIDTEST", "secret")
}

#[tokio::test]
async fn a_session_answers_turn_by_turn_and_is_charged_its_usage_totals() {
    let sim = start(verifying(instant_config())).await;
    let (caller, mut body) = open(&h2c_client(&sim, "us-east-1"), 300).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hello sonic [sim:output=20]").await;
    let first = until_usage(&mut body).await;
    assert_eq!(names(&first), FIRST_TURN);
    let usage = &first[4]["event"]["usageEvent"];
    // "hello sonic [sim:output=20]" = 27 bytes -> 7 text tokens.
    assert_eq!(totals(&first[4]), (7, 20));
    assert_eq!(usage["totalTokens"], 27);
    let text = first[2]["event"]["textOutput"]["content"].as_str().unwrap();
    assert_eq!(text.len().div_ceil(4), 20, "4 bytes a token: {text:?}");

    // Mid-session, the reservation of the session's cap is held.
    let key = format!("{SONIC}@us-east-1");
    let bucket = sim.simulator.stats().buckets[&key].clone();
    assert_eq!(
        (bucket.in_flight, bucket.tokens_reserved_in_flight),
        (1, 300)
    );

    caller.user_text("t2", "again [sim:output=30]").await;
    let second = until_usage(&mut body).await;
    assert_eq!(
        names(&second),
        ["contentStart", "textOutput", "contentEnd", "usageEvent"]
    );
    let usage = &second[3]["event"]["usageEvent"];
    // "again [sim:output=30]" = 21 bytes -> 6 tokens.
    assert_eq!(totals(&second[3]), (13, 50));
    assert_eq!(usage["details"]["delta"]["output"]["textTokens"], 30);

    caller.send("promptEnd", json!({"promptName": "p1"})).await;
    caller.send("sessionEnd", json!({})).await;
    drop(caller);
    let mut rest = Vec::new();
    while let Some(InvokeModelWithBidirectionalStreamOutput::Chunk(part)) =
        body.body.recv().await.unwrap()
    {
        rest.push(serde_json::from_slice::<Value>(part.bytes().unwrap().as_ref()).unwrap());
    }
    assert_eq!(names(&rest), ["completionEnd"]);

    let stats = sim.simulator.stats();
    let b = &stats.buckets[&key];
    // Nova Sonic burns down 1: input 13 + output 50.
    assert_eq!(
        (
            b.completed,
            b.tokens_charged,
            b.in_flight,
            b.tokens_reserved_in_flight
        ),
        (1, 63, 0, 0)
    );
    assert_eq!(
        stats.apis["InvokeModelWithBidirectionalStream"].tokens_charged,
        63
    );
    assert_eq!(stats.operations["InvokeModelWithBidirectionalStream"], 1);
    assert_eq!(stats.sigv4.verified, 1, "the request's own SigV4 verified");
    // sessionStart, promptStart, 2 x 3 user content events, promptEnd, sessionEnd (which ends
    // the session before the end envelope is read).
    assert_eq!(
        (stats.sigv4.events_verified, stats.sigv4.events_rejected),
        (10, 0),
        "each event's chained signature verified"
    );
}

#[tokio::test]
async fn a_session_that_does_not_fit_ends_with_a_throttling_exception_and_the_limit_ends_long_ones()
{
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 1_000,
        bidirectional_session_secs: 1,
        ..instant_config()
    })
    .await;
    let client = h2c_client(&sim, "us-east-1");
    // maxTokens above the bucket: the reservation cannot fit.
    let (caller, mut session) = open(&client, 1_001).await;
    let err = session.body.recv().await.unwrap_err();
    let service = err.into_service_error();
    assert!(service.is_throttling_exception(), "{service:?}");
    assert_eq!(
        service.meta().message(),
        Some("Too many tokens, please wait before trying again.")
    );
    drop(caller);

    // A session that stays open past bidirectional_session_secs: a modelTimeoutException, and
    // the session is charged what it used.
    let (caller, mut body) = open(&client, 100).await;
    caller
        .send("promptStart", json!({"promptName": "p1"}))
        .await;
    caller.user_text("t1", "hold [sim:output=5]").await;
    let events = until_usage(&mut body).await;
    assert_eq!(events.len(), 5);
    let err = body.body.recv().await.unwrap_err();
    assert!(err.into_service_error().is_model_timeout_exception());
    let stats = sim.simulator.stats();
    let b = &stats.buckets[&format!("{SONIC}@us-east-1")];
    // "hold [sim:output=5]" = 19 bytes -> 5 input tokens, 5 output.
    assert_eq!(
        (b.throttled, b.completed, b.tokens_charged, b.in_flight),
        (1, 1, 10, 0)
    );
    drop(caller);
}

/// A raw HTTP/2 POST of `frames` to the bidirectional stream, with extra headers; returns the
/// status and the decoded response frames.
async fn raw_h2(
    sim: &SimulatorHandle,
    headers: &[(&str, &str)],
    frames: Vec<u8>,
) -> (u16, Vec<Frame>) {
    let http = HttpClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut request = http::Request::post(format!(
        "http://{}/model/{SONIC}/invoke-with-bidirectional-stream",
        sim.addr
    ));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = http
        .request(request.body(Full::new(Bytes::from(frames))).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let mut reader = FrameReader::new();
    reader.push(&bytes);
    let mut out = Vec::new();
    while let Some(frame) = reader.next_frame().unwrap() {
        out.push(frame);
    }
    (status, out)
}

#[tokio::test]
async fn unsigned_frames_are_read_and_api_keys_and_other_models_are_refused() {
    let sim = start(instant_config()).await;
    // Unsigned chunk frames (no SDK envelope), all sent before reading: the session still runs.
    let frames = raw_session(None, "raw [sim:output=3]").concat();
    let (status, out) = raw_h2(&sim, &[], frames).await;
    assert_eq!(status, 200);
    assert!(
        out.iter()
            .all(|f| f.message_type == "event" && f.kind == "chunk")
    );
    assert_eq!(
        out.len(),
        6,
        "completionStart, contentStart, textOutput, contentEnd, usageEvent, completionEnd"
    );
    let b = &sim.simulator.stats().buckets[&format!("{SONIC}@us-east-1")];
    // "raw [sim:output=3]" = 18 bytes -> 5 input tokens; 3 output.
    assert_eq!((b.completed, b.tokens_charged), (1, 8));

    // SigV4 only: an API key is refused whatever is configured.
    let (status, _) = raw_h2(&sim, &[("authorization", "Bearer some-key")], Vec::new()).await;
    assert_eq!(status, 403);
    assert_eq!(sim.simulator.stats().api_keys.rejected, 1);

    let (tx, rx) = mpsc::channel(1);
    drop(tx);
    let err = h2c_client(&sim, "us-east-1")
        .invoke_model_with_bidirectional_stream()
        .model_id("anthropic.claude-3-haiku-20240307-v1:0")
        .body(input_stream(rx))
        .send()
        .await
        .unwrap_err();
    let service = err.into_service_error();
    assert!(service.is_validation_exception(), "{service:?}");
    assert!(service.meta().message().unwrap().contains("Nova Sonic"));
}

/// With `verify_sigv4`, every event's chained signature is checked: a forged one ends the
/// stream, and so does a bare event; a head signed with the events marker is accepted.
#[tokio::test]
async fn forged_and_unsigned_events_end_the_stream_when_signatures_are_verified() {
    use crate::common::sonic_raw::{EventSigner, Head, RawSession, head, raw_chunk};
    let sim = start(verifying(instant_config())).await;
    let host = sim.addr.to_string();
    let start_event = raw_chunk("sessionStart", json!({}));
    let prompt = raw_chunk("promptStart", json!({"promptName": "p"}));

    let marker = Head::Marker {
        key_id: "AKIDTEST",
        secret: "secret",
        marker: "STREAMING-AWS4-HMAC-SHA256-EVENTS",
    };
    let (headers, seed) = head(&host, marker);
    let mut good = EventSigner::new("AKIDTEST", "secret", &seed);
    let mut forger = EventSigner::new("AKIDTEST", "not-the-secret", "");
    let first = good.sign(Some(&start_event));
    let mut session = RawSession::open(sim.addr, &headers, &[first]).await;
    assert_eq!(session.status, 200, "the events marker is a signed head");
    session.send(forger.sign(Some(&prompt))).await;
    let end = session.rest().await;
    assert_eq!(end.len(), 1);
    assert_eq!(
        (end[0].message_type.as_str(), end[0].kind.as_str()),
        ("exception", "validationException")
    );
    let stats = sim.simulator.stats();
    assert_eq!(
        (stats.sigv4.events_verified, stats.sigv4.events_rejected),
        (1, 1)
    );

    let (headers, _) = head(
        &host,
        Head::EmptyPayload {
            key_id: "AKIDTEST",
            secret: "secret",
        },
    );
    let mut bare = RawSession::open(sim.addr, &headers, &[start_event]).await;
    assert_eq!(bare.status, 200);
    let end = bare.rest().await;
    assert_eq!(end.len(), 1);
    assert!(
        String::from_utf8_lossy(&end[0].payload).contains("must be signed"),
        "{:?}",
        end[0]
    );
    assert_eq!(sim.simulator.stats().sigv4.events_rejected, 2);
}
