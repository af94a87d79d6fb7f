//! Nova Sonic sessions over InvokeModelWithBidirectionalStream, for tests of the simulator and of
//! the proxy: aws-sdk-bedrockruntime's `invoke_model_with_bidirectional_stream` through an h2c
//! connector (the SDK's default client speaks HTTP/2 only over TLS), a caller side fed through a
//! channel so a test decides when each event goes. Raw sessions, for what the SDK cannot say, are
//! in [`super::sonic_raw`].
// Helpers that run only inside tests; a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::{net::SocketAddr, time::Duration};

use aws_credential_types::Credentials;
use aws_sdk_bedrockruntime::{
    Client,
    config::{BehaviorVersion, Region, retry::RetryConfig},
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
use hyper_util::{
    client::legacy::{Client as HttpClient, connect::HttpConnector as TcpConnector},
    rt::TokioExecutor,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub const SONIC: &str = "amazon.nova-sonic-v1:0";
pub const SONIC_PATH: &str = "/model/amazon.nova-sonic-v1%3A0/invoke-with-bidirectional-stream";

/// The SDK's answer to the call: its `body` receives the output events.
pub type Session = aws_sdk_bedrockruntime::operation::invoke_model_with_bidirectional_stream::InvokeModelWithBidirectionalStreamOutput;
pub type Input =
    Result<InvokeModelWithBidirectionalStreamInput, InvokeModelWithBidirectionalStreamInputError>;

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

/// An SDK client for `addr` over h2c, signing with `key_id` / `secret` for `region`, no retries.
pub fn h2c_client(addr: SocketAddr, region: &str, key_id: &str, secret: &str) -> Client {
    let http = HttpClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build(TcpConnector::new());
    let connector = SharedHttpConnector::new(H2c(http));
    let config = aws_sdk_bedrockruntime::Config::builder()
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new(region.to_string()))
        .credentials_provider(Credentials::new(key_id, secret, None, None, "test"))
        .http_client(http_client_fn(move |_, _| connector.clone()))
        .retry_config(RetryConfig::disabled())
        .behavior_version(BehaviorVersion::latest())
        .build();
    Client::from_conf(config)
}

/// A chunk event carrying one Nova Sonic event.
pub fn chunk(name: &str, body: Value) -> Input {
    let bytes = json!({"event": {name: body}}).to_string();
    Ok(InvokeModelWithBidirectionalStreamInput::Chunk(
        BidirectionalInputPayloadPart::builder()
            .bytes(Blob::new(bytes))
            .build(),
    ))
}

/// The caller's side of a session: a channel feeding the SDK's input stream. Dropping it ends
/// the input (the SDK then sends its signed end envelope).
pub struct Caller(pub mpsc::Sender<Input>);

impl Caller {
    pub async fn send(&self, name: &str, body: Value) {
        self.0.send(chunk(name, body)).await.unwrap();
    }

    /// One user text turn of prompt `p1`: contentStart, textInput, contentEnd.
    pub async fn user_text(&self, content: &str, text: &str) {
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

pub fn input_stream(
    rx: mpsc::Receiver<Input>,
) -> EventStreamSender<
    InvokeModelWithBidirectionalStreamInput,
    InvokeModelWithBidirectionalStreamInputError,
> {
    // Fused: the SDK polls its input once more after the end.
    futures_util::StreamExt::fuse(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (e, rx))
    }))
    .into()
}

/// Opens a session whose `sessionStart` asks for `max_tokens`: the caller's side and the SDK's
/// answer (an error if the call was refused before the stream).
pub async fn try_open(
    client: &Client,
    max_tokens: u64,
) -> (
    Caller,
    Result<Session, aws_sdk_bedrockruntime::error::SdkError<
        aws_sdk_bedrockruntime::operation::invoke_model_with_bidirectional_stream::InvokeModelWithBidirectionalStreamError,
        HttpResponse,
    >>,
){
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
        .await;
    (caller, session)
}

/// [`try_open`], which must succeed.
pub async fn open(client: &Client, max_tokens: u64) -> (Caller, Session) {
    let (caller, session) = try_open(client, max_tokens).await;
    (caller, session.expect("the session opens"))
}

/// A hang guard, not a timing assertion: generous, and only there so a broken relay fails the
/// test instead of hanging it.
pub const HANG_GUARD: Duration = Duration::from_secs(60);

/// The output events until (and including) the next `usageEvent`, or the end of the stream.
/// A relay that buffered the caller's input until it ended would never answer here.
pub async fn until_usage(out: &mut Session) -> Vec<Value> {
    let body = &mut out.body;
    let mut events = Vec::new();
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
    tokio::time::timeout(HANG_GUARD, recv)
        .await
        .expect("answered while the caller's side is still open");
    events
}

/// The error the output stream ends with (within the hang guard).
pub async fn stream_error(
    out: &mut Session,
) -> aws_sdk_bedrockruntime::types::error::InvokeModelWithBidirectionalStreamOutputError {
    let recv = async {
        loop {
            match out.body.recv().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without an error"),
                Err(e) => return e.into_service_error(),
            }
        }
    };
    tokio::time::timeout(HANG_GUARD, recv)
        .await
        .expect("the stream ends")
}

/// The events that answer a prompt's first user turn.
pub const FIRST_TURN: [&str; 5] = [
    "completionStart",
    "contentStart",
    "textOutput",
    "contentEnd",
    "usageEvent",
];

/// A `usageEvent`'s running totals: (input, output).
pub fn totals(event: &Value) -> (u64, u64) {
    let usage = &event["event"]["usageEvent"];
    let count = |k: &str| usage[k].as_u64().expect("a usageEvent total");
    (count("totalInputTokens"), count("totalOutputTokens"))
}

/// Each event's name.
pub fn names(events: &[Value]) -> Vec<String> {
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
