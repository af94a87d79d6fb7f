//! InvokeModelWithBidirectionalStream, driven by aws-sdk-bedrockruntime's
//! `invoke_model_with_bidirectional_stream` over HTTP/2 cleartext (prior knowledge): the SDK's
//! default client speaks HTTP/2 only over TLS, so the test gives it an h2c connector.

use std::time::Duration;

use aws_sdk_bedrockruntime::{
    Client,
    config::{BehaviorVersion, Credentials, Region},
    primitives::{Blob, event_stream::EventStreamSender},
    types::{
        BidirectionalInputPayloadPart, InvokeModelWithBidirectionalStreamInput,
        InvokeModelWithBidirectionalStreamOutput,
        error::InvokeModelWithBidirectionalStreamInputError,
    },
};
use aws_smithy_runtime_api::client::{
    http::{HttpConnector, HttpConnectorFuture, SharedHttpConnector, http_client_fn},
    orchestrator::HttpResponse,
    result::ConnectorError,
};
use aws_smithy_types::body::SdkBody;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client as HttpClient, connect::HttpConnector as TcpConnector},
    rt::TokioExecutor,
};
use serde_json::{Value, json};
use tokengate::bedrock::eventstream::{Frame, FrameReader, event_frame};
use tokengate::simulator::{SimulatorConfig, SimulatorHandle};
use tokio::sync::mpsc;

/// The SDK's answer to the call: its `body` receives the output events.
type Session = aws_sdk_bedrockruntime::operation::invoke_model_with_bidirectional_stream::InvokeModelWithBidirectionalStreamOutput;

use super::{instant_config, start, verifying};

const SONIC: &str = "amazon.nova-sonic-v1:0";

/// An HTTP/2-only (prior knowledge) connector for the SDK.
#[derive(Debug, Clone)]
struct H2c(HttpClient<TcpConnector, SdkBody>);

impl HttpConnector for H2c {
    fn call(&self, request: aws_smithy_runtime_api::http::Request) -> HttpConnectorFuture {
        let client = self.0.clone();
        HttpConnectorFuture::new(async move {
            let request = request
                .try_into_http1x()
                .map_err(|e| ConnectorError::other(e.into(), None))?;
            let response = client
                .request(request)
                .await
                .map_err(|e| ConnectorError::io(e.into()))?;
            HttpResponse::try_from(response.map(SdkBody::from_body_1_x))
                .map_err(|e| ConnectorError::other(e.into(), None))
        })
    }
}

fn h2c_client(sim: &SimulatorHandle, region: &str) -> Client {
    let http = HttpClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build(TcpConnector::new());
    let connector = SharedHttpConnector::new(H2c(http));
    let config = aws_sdk_bedrockruntime::Config::builder()
        .endpoint_url(format!("http://{}", sim.addr))
        .region(Region::new(region.to_string()))
        .credentials_provider(Credentials::new("AKIDTEST", "secret", None, None, "test"))
        .http_client(http_client_fn(move |_, _| connector.clone()))
        .behavior_version(BehaviorVersion::latest())
        .build();
    Client::from_conf(config)
}

type Input =
    Result<InvokeModelWithBidirectionalStreamInput, InvokeModelWithBidirectionalStreamInputError>;

/// A chunk event carrying one Nova Sonic event.
fn chunk(name: &str, body: Value) -> Input {
    let bytes = json!({"event": {name: body}}).to_string();
    Ok(InvokeModelWithBidirectionalStreamInput::Chunk(
        BidirectionalInputPayloadPart::builder()
            .bytes(Blob::new(bytes))
            .build(),
    ))
}

/// The caller's side of a session: a channel feeding the SDK's input stream.
struct Caller(mpsc::Sender<Input>);

impl Caller {
    async fn send(&self, name: &str, body: Value) {
        self.0.send(chunk(name, body)).await.unwrap();
    }

    async fn user_text(&self, content: &str, text: &str) {
        let ids = json!({"promptName": "p1", "contentName": content});
        let mut start = ids.clone();
        start["type"] = json!("TEXT");
        start["role"] = json!("USER");
        start["interactive"] = json!(true);
        self.send("contentStart", start).await;
        let mut input = ids.clone();
        input["content"] = json!(text);
        self.send("textInput", input).await;
        self.send("contentEnd", ids).await;
    }
}

fn input_stream(
    rx: mpsc::Receiver<Input>,
) -> EventStreamSender<
    InvokeModelWithBidirectionalStreamInput,
    InvokeModelWithBidirectionalStreamInputError,
> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })
        .into()
}

/// Opens a session whose `sessionStart` asks for `max_tokens`: the caller's side and the SDK's
/// answer.
async fn open(client: &Client, max_tokens: u64) -> (Caller, Session) {
    let (tx, rx) = mpsc::channel(16);
    let caller = Caller(tx);
    caller
        .send(
            "sessionStart",
            json!({"inferenceConfiguration": {"maxTokens": max_tokens}}),
        )
        .await;
    let session = client
        .invoke_model_with_bidirectional_stream()
        .model_id(SONIC)
        .body(input_stream(rx))
        .send()
        .await
        .unwrap();
    (caller, session)
}

/// The output events until (and including) the next `usageEvent`, or the end of the stream.
async fn until_usage(out: &mut Session) -> Vec<Value> {
    let body = &mut out.body;
    let mut events = Vec::new();
    // A hang guard, not a timing assertion: a simulator that answered only after the request
    // body ended would never answer here, because the caller has not ended it.
    let recv = async {
        while let Some(InvokeModelWithBidirectionalStreamOutput::Chunk(part)) =
            body.recv().await.unwrap()
        {
            let event: Value = serde_json::from_slice(part.bytes().unwrap().as_ref()).unwrap();
            let usage = event["event"].get("usageEvent").is_some();
            events.push(event);
            if usage {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), recv)
        .await
        .expect("the simulator answers while the caller's side is still open");
    events
}

fn names(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            e["event"]
                .as_object()
                .unwrap()
                .keys()
                .next()
                .unwrap()
                .clone()
        })
        .collect()
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
    assert_eq!(
        names(&first),
        [
            "completionStart",
            "contentStart",
            "textOutput",
            "contentEnd",
            "usageEvent"
        ]
    );
    let usage = &first[4]["event"]["usageEvent"];
    // "hello sonic [sim:output=20]" = 27 bytes -> 7 text tokens.
    assert_eq!(
        (
            usage["totalInputTokens"].as_u64(),
            usage["totalOutputTokens"].as_u64()
        ),
        (Some(7), Some(20))
    );
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
    assert_eq!(
        (
            usage["totalInputTokens"].as_u64(),
            usage["totalOutputTokens"].as_u64()
        ),
        (Some(13), Some(50))
    );
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

/// An unsigned `chunk` frame carrying one Nova Sonic event.
fn raw_chunk(name: &str, body: Value) -> Vec<u8> {
    use base64::Engine;
    let event = json!({"event": {name: body}}).to_string();
    let b64 = base64::engine::general_purpose::STANDARD.encode(event);
    event_frame("chunk", json!({ "bytes": b64 }).to_string().as_bytes()).to_vec()
}

#[tokio::test]
async fn unsigned_frames_are_read_and_api_keys_and_other_models_are_refused() {
    let sim = start(instant_config()).await;
    // Unsigned chunk frames (no SDK envelope), all sent before reading: the session still runs.
    let ids = json!({"promptName": "p", "contentName": "c"});
    let mut start_content = ids.clone();
    start_content["type"] = json!("TEXT");
    start_content["role"] = json!("USER");
    let mut input = ids.clone();
    input["content"] = json!("raw [sim:output=3]");
    let frames = [
        raw_chunk("sessionStart", json!({})),
        raw_chunk("promptStart", json!({"promptName": "p"})),
        raw_chunk("contentStart", start_content),
        raw_chunk("textInput", input),
        raw_chunk("contentEnd", ids),
        raw_chunk("promptEnd", json!({"promptName": "p"})),
        raw_chunk("sessionEnd", json!({})),
    ]
    .concat();
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
