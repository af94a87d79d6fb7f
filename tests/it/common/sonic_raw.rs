//! Raw HTTP/2 sessions of InvokeModelWithBidirectionalStream, for what the SDK cannot say: bare
//! event frames, heads signed (or not) as a test needs, events signed or forged one by one, input
//! sent and output read a frame at a time, and a connection dropped mid-session.

// Helpers that run only inside tests; a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::{convert::Infallible, net::SocketAddr};

use aws_credential_types::Credentials;
use aws_sigv4::{
    event_stream::{sign_empty_message, sign_message},
    http_request::{PayloadChecksumKind, SignableBody, SignableRequest, SigningSettings, sign},
    sign::v4::SigningParams,
};
use aws_smithy_types::event_stream::Message;
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokengate::bedrock::eventstream::{Frame, FrameReader, event_frame};
use tokio::sync::mpsc;

use super::sonic::{HANG_GUARD, SONIC_PATH};

/// An unsigned `chunk` frame carrying one Nova Sonic event.
pub fn raw_chunk(name: &str, body: Value) -> Bytes {
    use base64::Engine;
    let event = json!({"event": {name: body}}).to_string();
    let b64 = base64::engine::general_purpose::STANDARD.encode(event);
    event_frame("chunk", json!({ "bytes": b64 }).to_string().as_bytes())
}

/// A whole text turn as raw unsigned frames: sessionStart (with `max_tokens`, if any),
/// promptStart, one user text content, promptEnd, sessionEnd.
pub fn raw_session(max_tokens: Option<u64>, text: &str) -> Vec<Bytes> {
    let ids = json!({"promptName": "p", "contentName": "c"});
    let mut start = ids.clone();
    start["type"] = json!("TEXT");
    start["role"] = json!("USER");
    let mut input = ids.clone();
    input["content"] = json!(text);
    vec![
        raw_chunk(
            "sessionStart",
            max_tokens.map_or(
                json!({}),
                |n| json!({"inferenceConfiguration": {"maxTokens": n}}),
            ),
        ),
        raw_chunk("promptStart", json!({"promptName": "p"})),
        raw_chunk("contentStart", start),
        raw_chunk("textInput", input),
        raw_chunk("contentEnd", ids),
        raw_chunk("promptEnd", json!({"promptName": "p"})),
        raw_chunk("sessionEnd", json!({})),
    ]
}

/// How a raw session's head is signed.
pub enum Head<'a> {
    /// No `authorization` at all.
    Unsigned,
    /// Over an empty payload, as aws-sdk-rust signs it.
    EmptyPayload { key_id: &'a str, secret: &'a str },
    /// With `x-amz-content-sha256: STREAMING-AWS4-HMAC-SHA256-EVENTS` (`marker`, to try others).
    Marker {
        key_id: &'a str,
        secret: &'a str,
        marker: &'a str,
    },
}

/// The headers of a session's head to `host`, and its signature (the seed of the events').
pub fn head(host: &str, how: Head<'_>) -> (Vec<(String, String)>, String) {
    signed_head(host, SONIC_PATH, "application/vnd.amazon.eventstream", how)
}

/// The headers of a POST head to `path` on `host` with `content_type`, signed as `how` says,
/// and its signature.
pub fn signed_head(
    host: &str,
    path: &str,
    content_type: &str,
    how: Head<'_>,
) -> (Vec<(String, String)>, String) {
    let (key_id, secret, body, with_header) = match how {
        Head::Unsigned => {
            return (
                vec![("content-type".into(), content_type.into())],
                String::new(),
            );
        }
        Head::EmptyPayload { key_id, secret } => (key_id, secret, SignableBody::Bytes(&[]), false),
        Head::Marker {
            key_id,
            secret,
            marker,
        } => (
            key_id,
            secret,
            SignableBody::Precomputed(marker.into()),
            true,
        ),
    };
    let identity = Credentials::new(key_id, secret, None, None, "tests").into();
    let mut settings = SigningSettings::default();
    if with_header {
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    }
    let params = SigningParams::builder()
        .identity(&identity)
        .region("us-east-1")
        .name("bedrock")
        .time(std::time::SystemTime::now())
        .settings(settings)
        .build()
        .unwrap()
        .into();
    let base = [("host", host), ("content-type", content_type)];
    let request = SignableRequest::new(
        "POST",
        format!("http://{host}{path}"),
        base.iter().copied(),
        body,
    )
    .unwrap();
    let (instructions, signature) = sign(request, &params).unwrap().into_parts();
    let headers = base
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain(
            instructions
                .headers()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .collect();
    (headers, signature)
}

/// Signs events as an SDK does, each chained from the one before, the head's first.
pub struct EventSigner {
    identity: aws_smithy_runtime_api::client::identity::Identity,
    prior: String,
}

impl EventSigner {
    pub fn new(key_id: &str, secret: &str, seed: &str) -> EventSigner {
        EventSigner {
            identity: Credentials::new(key_id, secret, None, None, "tests").into(),
            prior: seed.to_string(),
        }
    }

    /// `frame` (an encoded event) in a signed envelope; `None` signs the end envelope.
    pub fn sign(&mut self, frame: Option<&Bytes>) -> Bytes {
        let params = SigningParams::builder()
            .identity(&self.identity)
            .region("us-east-1")
            .name("bedrock")
            .time(std::time::SystemTime::now())
            .settings(())
            .build()
            .unwrap();
        let signed = match frame {
            Some(frame) => {
                let message = aws_smithy_eventstream::frame::read_message_from(frame.clone())
                    .expect("an encoded event");
                sign_message(&message, &self.prior, &params).unwrap()
            }
            None => sign_empty_message(&self.prior, &params).unwrap(),
        };
        let (envelope, signature) = signed.into_parts();
        self.prior = signature;
        encode(&envelope)
    }
}

pub fn encode(message: &Message) -> Bytes {
    tokengate::bedrock::eventstream::encode_message(message).unwrap()
}

/// A raw HTTP/2 session on its own connection: frames go when the test sends them, output is
/// read frame by frame, and [`RawSession::hang_up`] drops the connection.
pub struct RawSession {
    pub status: u16,
    pub headers: http::HeaderMap,
    input: Option<mpsc::Sender<Result<http_body::Frame<Bytes>, Infallible>>>,
    output: hyper::body::Incoming,
    reader: FrameReader,
    connection: tokio::task::JoinHandle<()>,
    _sender: hyper::client::conn::http2::SendRequest<RawBody>,
}

type RawBody = StreamBody<
    futures_util::stream::Fuse<
        std::pin::Pin<
            Box<
                dyn futures_util::Stream<Item = Result<http_body::Frame<Bytes>, Infallible>> + Send,
            >,
        >,
    >,
>;

impl RawSession {
    /// POSTs to Nova Sonic's bidirectional stream on `addr` with `headers`, sending `first` at
    /// once.
    pub async fn open(addr: SocketAddr, headers: &[(String, String)], first: &[Bytes]) -> Self {
        Self::open_at(addr, SONIC_PATH, headers, first).await
    }

    /// [`RawSession::open`] to `path`.
    pub async fn open_at(
        addr: SocketAddr,
        path: &str,
        headers: &[(String, String)],
        first: &[Bytes],
    ) -> Self {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        let (tx, rx) = mpsc::channel(16);
        for frame in first {
            tx.send(Ok(http_body::Frame::data(frame.clone())))
                .await
                .unwrap();
        }
        let frames: std::pin::Pin<Box<dyn futures_util::Stream<Item = _> + Send>> =
            Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|f| (f, rx))
            }));
        let body: RawBody = StreamBody::new(futures_util::StreamExt::fuse(frames));
        let mut request = http::Request::post(format!("http://{addr}{path}"));
        for (name, value) in headers {
            if name != "host" {
                request = request.header(name, value);
            }
        }
        let response = sender
            .send_request(request.body(body).unwrap())
            .await
            .unwrap();
        let status = response.status().as_u16();
        let (parts, output) = response.into_parts();
        RawSession {
            status,
            headers: parts.headers,
            input: Some(tx),
            output,
            reader: FrameReader::new(),
            connection,
            _sender: sender,
        }
    }

    /// Sends one more input frame.
    pub async fn send(&self, frame: Bytes) {
        if let Some(tx) = &self.input {
            let _ = tx.send(Ok(http_body::Frame::data(frame))).await;
        }
    }

    /// Ends the input (END_STREAM, without an end envelope).
    pub fn close_input(&mut self) {
        self.input = None;
    }

    /// The next output frame, `None` at the end of the stream (within the hang guard).
    pub async fn next(&mut self) -> Option<Frame> {
        let read = async {
            loop {
                if let Some(frame) = self.reader.next_frame().unwrap() {
                    return Some(frame);
                }
                match self.output.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.reader.push(&data);
                        }
                    }
                    Some(Err(_)) | None => return None,
                }
            }
        };
        tokio::time::timeout(HANG_GUARD, read)
            .await
            .expect("the output moves")
    }

    /// Every output frame to the end.
    pub async fn rest(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(frame) = self.next().await {
            out.push(frame);
        }
        out
    }

    /// The whole body of a refusal answered before the stream.
    pub async fn body(self) -> Bytes {
        self.output.collect().await.unwrap().to_bytes()
    }

    /// Drops the connection, as a client that crashed.
    pub fn hang_up(self) {
        self.connection.abort();
    }
}
