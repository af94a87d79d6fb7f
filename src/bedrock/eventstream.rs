//! `application/vnd.amazon.eventstream` frames, via `aws-smithy-eventstream`.
//!
//! [`FrameReader`] decodes frames incrementally from arbitrary chunk boundaries, so the proxy can
//! watch a stream pass through without holding it; the `*_frame` functions encode the frames the
//! simulator sends and the proxy's own exception frames.

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder, write_message_to};
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use bytes::{Buf, Bytes, BytesMut};

use super::ErrorCode;

pub const CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

fn string_header(name: &'static str, value: impl Into<String>) -> Header {
    Header::new(name, HeaderValue::String(value.into().into()))
}

fn encode(message: &Message) -> Bytes {
    let mut buf = Vec::with_capacity(message.payload().len() + 96);
    // Writing to a Vec cannot fail short of headers too large for the format, which our
    // fixed header set never is.
    if write_message_to(message, &mut buf).is_err() {
        return Bytes::new();
    }
    Bytes::from(buf)
}

/// An event frame: `:message-type=event`, `:event-type={event_type}`, JSON payload.
pub fn event_frame(event_type: &str, payload: &[u8]) -> Bytes {
    typed_event_frame(event_type, "application/json", payload)
}

/// An event frame whose payload is of `content_type` (SageMaker's `PayloadPart` carries the
/// container's raw bytes as `application/octet-stream`).
pub fn typed_event_frame(event_type: &str, content_type: &str, payload: &[u8]) -> Bytes {
    let message = Message::new(Bytes::copy_from_slice(payload))
        .add_header(string_header(":event-type", event_type))
        .add_header(string_header(":content-type", content_type.to_string()))
        .add_header(string_header(":message-type", "event"));
    encode(&message)
}

/// An exception frame: `:message-type=exception`, `:exception-type={member}`, `{"message": ...}`.
pub fn exception_frame(code: ErrorCode, message: &str) -> Bytes {
    let payload = serde_json::json!({ "message": message }).to_string();
    member_exception_frame(&code.event_member(), payload.as_bytes())
}

/// An exception frame for the event-stream member `member` with a JSON `payload` (SageMaker's
/// members are PascalCase and carry fields of their own).
pub fn member_exception_frame(member: &str, payload: &[u8]) -> Bytes {
    let message = Message::new(Bytes::copy_from_slice(payload))
        .add_header(string_header(":exception-type", member.to_string()))
        .add_header(string_header(":content-type", "application/json"))
        .add_header(string_header(":message-type", "exception"));
    encode(&message)
}

/// One decoded frame: its type headers and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// `:message-type`: `event`, `exception` or `error`.
    pub message_type: String,
    /// `:event-type` for events, `:exception-type` for exceptions, `:error-code` for errors.
    pub kind: String,
    pub payload: Bytes,
}

impl Frame {
    fn from_message(message: &Message) -> Frame {
        let header = |name: &str| {
            message
                .headers()
                .iter()
                .find(|h| h.name().as_str() == name)
                .and_then(|h| h.value().as_string().ok())
                .map(|s| s.as_str().to_string())
        };
        let message_type = header(":message-type").unwrap_or_default();
        let kind = match message_type.as_str() {
            "exception" => header(":exception-type"),
            "error" => header(":error-code"),
            _ => header(":event-type"),
        }
        .unwrap_or_default();
        Frame {
            message_type,
            kind,
            payload: message.payload().clone(),
        }
    }
}

/// The stream is not valid event-stream framing (bad CRC, impossible lengths).
#[derive(Debug, thiserror::Error)]
#[error("invalid event-stream frame: {0}")]
pub struct FrameError(String);

/// Incremental frame decoder over chunks of any size.
#[derive(Debug, Default)]
pub struct FrameReader {
    buffer: BytesMut,
    decoder: MessageFrameDecoder,
}

impl FrameReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buffer.extend_from_slice(chunk);
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if !self.buffer.has_remaining() {
            return Ok(None);
        }
        match self.decoder.decode_frame(&mut self.buffer) {
            Ok(DecodedFrame::Complete(message)) => Ok(Some(Frame::from_message(&message))),
            Ok(DecodedFrame::Incomplete) => Ok(None),
            Err(e) => Err(FrameError(e.to_string())),
        }
    }

    /// Bytes received that do not yet form a whole frame.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_across_any_split() {
        let mut wire = event_frame("messageStart", br#"{"role":"assistant"}"#).to_vec();
        wire.extend_from_slice(&exception_frame(ErrorCode::Throttling, "too many"));
        for split in 0..wire.len() {
            let mut reader = FrameReader::new();
            let mut frames = Vec::new();
            for part in [&wire[..split], &wire[split..]] {
                reader.push(part);
                while let Some(f) = reader.next_frame().unwrap() {
                    frames.push(f);
                }
            }
            assert_eq!(frames.len(), 2, "split at {split}");
            assert_eq!(frames[0].message_type, "event");
            assert_eq!(frames[0].kind, "messageStart");
            assert_eq!(frames[1].message_type, "exception");
            assert_eq!(frames[1].kind, "throttlingException");
            assert_eq!(reader.pending(), 0);
        }
    }

    #[test]
    fn corrupt_frames_are_errors() {
        let mut wire = event_frame("chunk", b"{}").to_vec();
        let last = wire.len() - 1;
        wire[last] ^= 0xff;
        let mut reader = FrameReader::new();
        reader.push(&wire);
        assert!(reader.next_frame().is_err());
    }
}
