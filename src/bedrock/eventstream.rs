//! `application/vnd.amazon.eventstream` frames, via `aws-smithy-eventstream`.
//!
//! [`FrameReader`] decodes frames incrementally from arbitrary chunk boundaries, so the proxy can
//! watch a stream pass through without holding it; [`WholeFrames`] cuts chunks at frame
//! boundaries, so that what the proxy forwards can always be followed by a frame of its own; the
//! `*_frame` functions encode the frames the simulator sends and the proxy's own exception frames.

use aws_smithy_eventstream::frame::{
    DecodedFrame, MessageFrameDecoder, read_message_from, write_message_to,
};
use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
use bytes::{Buf, Bytes, BytesMut};

use super::ErrorCode;

pub const CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

fn string_header(name: &'static str, value: impl Into<String>) -> Header {
    Header::new(name, HeaderValue::String(value.into().into()))
}

fn encode(message: &Message) -> Bytes {
    // Writing to a Vec cannot fail short of headers too large for the format, which our
    // fixed header set never is.
    encode_message(message).unwrap_or_default()
}

/// The frame that encodes `message`.
pub fn encode_message(message: &Message) -> Result<Bytes, FrameError> {
    let mut buf = Vec::with_capacity(message.payload().len() + 96);
    write_message_to(message, &mut buf).map_err(|e| FrameError(e.to_string()))?;
    Ok(Bytes::from(buf))
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

/// The one whole message that `bytes` encode (a signed envelope's payload), nothing before or
/// after it.
pub fn whole_message(bytes: &Bytes) -> Result<Message, FrameError> {
    let mut buffer = bytes.clone();
    let message = read_message_from(&mut buffer).map_err(|e| FrameError(e.to_string()))?;
    if buffer.has_remaining() {
        return Err(FrameError(format!(
            "{} bytes follow the message",
            buffer.remaining()
        )));
    }
    Ok(message)
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
    /// The frame's type headers and payload.
    pub fn from_message(message: &Message) -> Frame {
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
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
        Ok(self.next_message()?.map(|m| Frame::from_message(&m)))
    }

    /// The next complete frame as the message it encodes, `Ok(None)` when more bytes are
    /// needed.
    pub fn next_message(&mut self) -> Result<Option<Message>, FrameError> {
        if !self.buffer.has_remaining() {
            return Ok(None);
        }
        match self.decoder.decode_frame(&mut self.buffer) {
            Ok(DecodedFrame::Complete(message)) => Ok(Some(message)),
            Ok(DecodedFrame::Incomplete) => Ok(None),
            Err(e) => Err(FrameError(e.to_string())),
        }
    }

    /// Bytes received that do not yet form a whole frame.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Appends `chunk` and returns the frames it completes, and whether the stream is broken:
    /// bad framing, or a partial frame grown past `cap` bytes (the decoder trusts the length a
    /// prelude claims). A broken reader yields nothing more worth reading.
    pub fn frames_of(&mut self, chunk: &[u8], cap: usize) -> (Vec<Frame>, bool) {
        self.push(chunk);
        let mut frames = Vec::new();
        loop {
            match self.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => return (frames, self.pending() > cap),
                Err(_) => return (frames, true),
            }
        }
    }
}

/// The smallest frame: a 12-byte prelude (lengths and their CRC) and the 4-byte message CRC.
const MIN_FRAME: usize = 16;

/// Passes chunks on at frame boundaries: the whole frames a chunk completes go on at once, a
/// partial frame is held until its last byte arrives. Only the frame lengths are read (the first
/// four bytes of each prelude); checksums are for the receiver. At most one partial frame is
/// held, and a frame may not claim more than `cap` bytes.
#[derive(Debug)]
pub struct WholeFrames {
    pending: BytesMut,
    cap: usize,
}

impl WholeFrames {
    pub fn new(cap: usize) -> WholeFrames {
        WholeFrames {
            pending: BytesMut::new(),
            cap,
        }
    }

    /// Takes the next chunk; returns the whole frames now complete (empty if none), in order.
    pub fn push(&mut self, chunk: Bytes) -> Result<Bytes, FrameError> {
        let data = if self.pending.is_empty() {
            chunk
        } else {
            self.pending.extend_from_slice(&chunk);
            self.pending.split().freeze()
        };
        let whole = self.whole_prefix(&data)?;
        if whole < data.len() {
            self.pending.extend_from_slice(&data[whole..]);
        }
        Ok(data.slice(..whole))
    }

    /// Bytes of a partial frame held back.
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    /// The length of the longest run of whole frames at the start of `data`.
    fn whole_prefix(&self, data: &[u8]) -> Result<usize, FrameError> {
        let mut at = 0;
        while let Some(prelude) = data.get(at..at + 4) {
            let len = u32::from_be_bytes([prelude[0], prelude[1], prelude[2], prelude[3]]) as usize;
            if !(MIN_FRAME..=self.cap).contains(&len) {
                return Err(FrameError(format!(
                    "a frame claims {len} bytes (at least {MIN_FRAME}, at most {})",
                    self.cap
                )));
            }
            if data.len() - at < len {
                break;
            }
            at += len;
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_frames_pass_whatever_the_chunks() {
        let mut wire = event_frame("messageStart", br#"{"role":"assistant"}"#).to_vec();
        let delta = event_frame("contentBlockDelta", &[b'x'; 300]);
        wire.extend_from_slice(&delta);
        wire.extend_from_slice(&exception_frame(ErrorCode::Throttling, "too many"));
        for size in [1, 3, 7, 64, 100, wire.len()] {
            let mut frames = WholeFrames::new(1024);
            let mut passed = Vec::new();
            for chunk in wire.chunks(size) {
                let whole = frames.push(Bytes::copy_from_slice(chunk)).unwrap();
                // Each piece passed on is whole frames: it decodes with nothing left over.
                let mut reader = FrameReader::new();
                reader.push(&whole);
                while reader.next_frame().unwrap().is_some() {}
                assert_eq!(reader.pending(), 0, "chunks of {size}");
                passed.extend_from_slice(&whole);
                assert!(
                    frames.held() < delta.len(),
                    "never more than a partial frame"
                );
            }
            assert_eq!(passed, wire, "chunks of {size}");
            assert_eq!(frames.held(), 0);
        }
    }

    #[test]
    fn a_frame_claiming_too_much_or_too_little_is_an_error() {
        let mut frames = WholeFrames::new(1024);
        assert!(frames.push(Bytes::from_static(&[0, 0, 0x10, 0])).is_err());
        let mut frames = WholeFrames::new(1024);
        assert!(
            frames
                .push(Bytes::from_static(&[0, 0, 0, 3, 1, 2]))
                .is_err()
        );
        let mut frames = WholeFrames::new(1024);
        let partial = frames.push(Bytes::from_static(&[0, 0, 0])).unwrap();
        assert!(
            partial.is_empty() && frames.held() == 3,
            "a prelude not yet whole waits"
        );
    }

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
    fn an_envelope_holds_one_whole_message() {
        let inner = event_frame("chunk", b"{}");
        let message = whole_message(&inner).unwrap();
        assert_eq!(Frame::from_message(&message).kind, "chunk");
        let mut two = inner.to_vec();
        two.extend_from_slice(&inner);
        assert!(whole_message(&Bytes::from(two)).is_err());
        assert!(whole_message(&inner.slice(..inner.len() - 1)).is_err());
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
