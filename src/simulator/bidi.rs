//! InvokeModelWithBidirectionalStream: HTTP/2 only, full duplex, event stream both ways.
//!
//! The response (200, `application/vnd.amazon.eventstream`) starts at once; a task then reads
//! the request body frame by frame and answers as input arrives, not after the body ends. Input
//! frames are `chunk` events whose JSON `bytes` (base64) hold Nova Sonic events
//! ([`super::sonic`]); an SDK signs each one, wrapping it in an envelope frame (`:date`,
//! `:chunk-signature`, the message as payload, an empty one at the end), which is unwrapped.
//! With `verify_sigv4` set, the head's SigV4 (over an empty payload, or the
//! `STREAMING-AWS4-HMAC-SHA256-EVENTS` marker) is verified, and so is every envelope's signature,
//! chained from the head's: an event that is not signed, or whose signature does not verify,
//! ends the stream with a `validationException` frame (the exception is the simulator's reading:
//! AWS does not document which it sends). Without it, bare events are read too. Output events go
//! back as `chunk` events.
//!
//! Quota: `sessionStart` reserves the session's output cap (`maxTokens`, else the model's
//! maximum; the input is not known yet) through [`Call`]; a reservation that does not fit ends
//! the stream with a `throttlingException` frame (U: whether Bedrock refuses before the 200).
//! The session is settled to `input + output x burndown` from its running totals when it ends:
//! `sessionEnd`, the request body ending, or `bidirectional_session_secs` (8 minutes), which
//! ends the stream with a `modelTimeoutException` frame (U: the exception Bedrock uses). A
//! caller that goes away is charged what was used. Only models whose id names `sonic` are
//! served; HTTP/1.1 gets a ValidationException.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Version};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::Inner;
use super::charge::{self, Call};
use super::generate;
use super::handlers::{request_region, respond};
use super::model_id::Resolved;
use super::quota::Reservation;
use super::sonic::{Action, Session};
use super::{auth, shapes};
use crate::auth::event_stream::{ChainVerifier, is_envelope};
use crate::bedrock::eventstream::{self, Frame, FrameReader, exception_frame};
use crate::bedrock::{BedrockError, ErrorCode, Operation};
use aws_smithy_types::event_stream::Message;

const API: &str = "InvokeModelWithBidirectionalStream";

/// Answers a bidirectional stream request; the session runs in a task of its own.
pub(super) async fn handle(
    sim: Arc<Inner>,
    op: Operation,
    model_id: &str,
    parts: Parts,
    body: Body,
) -> Response {
    let verifier = match auth::check_stream(&sim, &parts) {
        Ok(verifier) => verifier,
        Err(refusal) => return refusal.into_response(),
    };
    sim.count_operation(op);
    if parts.version != Version::HTTP_2 {
        return BedrockError::validation(
            "InvokeModelWithBidirectionalStream needs HTTP/2: it streams events both ways at once. Use an HTTP/2 client.",
        )
        .into_response();
    }
    let model = sim.config.resolve(model_id, request_region(&sim, &parts));
    if !model.base.contains("sonic") {
        return BedrockError::validation(format!(
            "The model {model_id} does not support InvokeModelWithBidirectionalStream. Use a Nova Sonic model such as amazon.nova-sonic-v1:0."
        ))
        .into_response();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(session(sim, model, body, tx, verifier));
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|frame| (Ok::<Bytes, std::io::Error>(frame), rx))
    });
    let mut response = respond(
        Body::from_stream(frames),
        eventstream::CONTENT_TYPE,
        &crate::bedrock::error::new_request_id(),
    );
    response.headers_mut().insert(
        "x-amzn-bedrock-content-type",
        HeaderValue::from_static("application/json"),
    );
    response
}

/// One session: its events, its reservation, its output.
struct Live<'a> {
    sim: &'a Inner,
    model: Resolved,
    session: Session,
    reservation: Option<Reservation>,
    /// The session's output cap.
    max_tokens: u64,
    tx: mpsc::Sender<Bytes>,
    /// With `verify_sigv4`: the verifier of the envelopes.
    verifier: Option<ChainVerifier>,
}

/// Why a session ended.
enum End {
    /// Clean: `sessionEnd`, or the caller closed its side.
    Done,
    /// An exception frame was sent, or the caller went away: settle what was used.
    Broken,
}

async fn session(
    sim: Arc<Inner>,
    model: Resolved,
    mut body: Body,
    tx: mpsc::Sender<Bytes>,
    verifier: Option<ChainVerifier>,
) {
    let limit = Duration::from_secs(sim.config.bidirectional_session_secs);
    let deadline = tokio::time::Instant::now() + limit;
    let mut live = Live {
        sim: &sim,
        max_tokens: sim.config.max_output_tokens_for(&model.base),
        model,
        session: Session::new(),
        reservation: None,
        tx,
        verifier,
    };
    let mut reader = FrameReader::new();
    let end = loop {
        let frame = tokio::select! {
            () = tokio::time::sleep_until(deadline) => {
                let message = format!("The session reached its limit of {} seconds.", limit.as_secs());
                live.send(exception_frame(ErrorCode::ModelTimeout, &message)).await;
                break End::Done;
            }
            () = live.tx.closed() => break End::Broken,
            frame = body.frame() => frame,
        };
        let data = match frame {
            None => break End::Done,
            Some(Err(_)) => break End::Broken,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue,
            },
        };
        reader.push(&data);
        match live.drain(&mut reader).await {
            Ok(None) => {}
            Ok(Some(end)) => break end,
            Err(message) => {
                live.send(exception_frame(ErrorCode::Validation, &message))
                    .await;
                break End::Broken;
            }
        }
    };
    live.settle(end);
}

impl Live<'_> {
    async fn send(&self, frame: Bytes) {
        self.sim.stream_bytes.fetch_add(frame.len() as u64, Relaxed);
        let _ = self.tx.send(frame).await;
    }

    /// Handles every whole frame read so far; `Some` when the session is over.
    async fn drain(&mut self, reader: &mut FrameReader) -> Result<Option<End>, String> {
        while let Some(message) = reader.next_message().map_err(|e| e.to_string())? {
            // A signed envelope has no :message-type; its payload is the message itself.
            let message = if is_envelope(&message) {
                let payload = self.unwrap(&message)?;
                if payload.is_empty() {
                    return Ok(Some(End::Done));
                }
                eventstream::whole_message(&payload)
                    .map_err(|_| "A signed frame does not hold a whole message.".to_string())?
            } else if self.verifier.is_some() {
                self.sim.sigv4.record_event(false);
                return Err(
                    "Each input event must be signed (a :chunk-signature envelope).".into(),
                );
            } else {
                message
            };
            let frame = Frame::from_message(&message);
            if frame.kind != "chunk" {
                return Err(format!(
                    "Unexpected input event {:?}; send chunk events.",
                    frame.kind
                ));
            }
            let event = chunk_json(&frame.payload)?;
            if let Some(end) = self.event(&event).await? {
                return Ok(Some(end));
            }
        }
        Ok(None)
    }

    /// An envelope's payload, its signature verified when the simulator verifies SigV4.
    fn unwrap(&mut self, envelope: &Message) -> Result<Bytes, String> {
        let Some(verifier) = self.verifier.as_mut() else {
            return Ok(envelope.payload().clone());
        };
        let verified = verifier.verify(envelope, std::time::SystemTime::now());
        self.sim.sigv4.record_event(verified.is_ok());
        verified.map_err(|_| {
            "The request signature we calculated does not match the signature you provided. \
             Check your AWS Secret Access Key and signing method."
                .to_string()
        })
    }

    async fn event(&mut self, event: &Value) -> Result<Option<End>, String> {
        match self.session.accept(event)? {
            Action::None => {}
            Action::Start { max_tokens } => {
                if let Some(n) = max_tokens {
                    self.max_tokens = n.min(self.max_tokens);
                }
                if let Err(message) = self.reserve() {
                    self.send(exception_frame(ErrorCode::Throttling, message))
                        .await;
                    return Ok(Some(End::Broken));
                }
            }
            Action::Turn { text } => self.turn(&text).await,
            Action::Send(events) => {
                for e in events {
                    self.send(shapes::chunk(&e)).await;
                }
            }
            Action::End => return Ok(Some(End::Done)),
        }
        Ok(None)
    }

    fn reserve(&mut self) -> Result<(), &'static str> {
        let call =
            Call::arrive(self.sim, API, &self.model, None).map_err(|_| charge::TOO_MANY_TOKENS)?;
        let admitted = call
            .reserve(self.max_tokens, 0)
            .map_err(charge::throttle_message)?;
        self.reservation = Some(admitted.reservation);
        Ok(())
    }

    /// Answers one user turn, after the generation's time.
    async fn turn(&mut self, text: &str) {
        let left = self.max_tokens.saturating_sub(self.session.counts.output());
        let plan = generate::plan(
            &self.sim.config,
            text.as_bytes(),
            left,
            true,
            self.sim.next_arrival(),
        );
        let ready = generate::ready_at(&self.sim.config, plan.output_tokens);
        if !ready.is_zero() {
            tokio::time::sleep(ready).await;
        }
        let said = generate::text(plan.text_seed, plan.output_tokens);
        for e in self.session.reply(&said, plan.output_tokens) {
            self.send(shapes::chunk(&e)).await;
        }
        if let Some(r) = self.reservation.as_mut() {
            r.set_input(self.session.counts.input());
            r.set_generated(self.session.counts.output());
        }
    }

    fn settle(self, end: End) {
        let Some(mut r) = self.reservation else {
            return;
        };
        let counts = self.session.counts;
        r.set_input(counts.input());
        r.set_generated(counts.output());
        match end {
            End::Done => r.complete(0, counts.output(), Instant::now()),
            // Dropped: charged input + generated x burndown, counted as not completed.
            End::Broken => drop(r),
        }
    }
}

/// The JSON event inside a `chunk` event's `{"bytes": base64}`.
fn chunk_json(payload: &[u8]) -> Result<Value, String> {
    let bad = || "Each chunk must be {\"bytes\": base64 of a JSON event}.".to_string();
    let outer: Value = serde_json::from_slice(payload).map_err(|_| bad())?;
    let bytes = outer
        .get("bytes")
        .and_then(Value::as_str)
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .ok_or_else(bad)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("A chunk's bytes are not a JSON event: {e}."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_carry_base64_json() {
        let inner = json!({"event": {"sessionEnd": {}}});
        let b64 = base64::engine::general_purpose::STANDARD.encode(inner.to_string());
        let payload = json!({ "bytes": b64 }).to_string();
        assert_eq!(chunk_json(payload.as_bytes()).unwrap(), inner);
        assert!(chunk_json(b"{}").is_err());
        assert!(chunk_json(br#"{"bytes":"bm90IGpzb24="}"#).is_err());
    }
}
