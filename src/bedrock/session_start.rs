//! The one input event of a bidirectional stream the proxy reads: Nova Sonic's `sessionStart`,
//! whose `inferenceConfiguration.maxTokens` caps the session's output (a route's
//! `max_tokens_ceiling` holds there).
//!
//! Input events are `chunk` events: the frame's payload is `{"bytes": "<base64>"}` and the bytes
//! are the JSON event, `{"event": {"sessionStart": {"inferenceConfiguration": {"maxTokens": N,
//! ...}}}}`. Nothing else in the stream is parsed; a rewrite replaces `maxTokens` and keeps every
//! other field of the event.

use base64::Engine as _;
use bytes::Bytes;
use serde_json::Value;

use super::usage::decode_chunk;

const MAX_TOKENS: &str = "/event/sessionStart/inferenceConfiguration/maxTokens";

/// A first event that is not a readable `sessionStart`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionStartError {
    #[error("the first input event must be a chunk whose bytes are base64 of a JSON event")]
    NotAChunk,
    #[error("the first input event must be sessionStart")]
    NotSessionStart,
    #[error("sessionStart's inferenceConfiguration.maxTokens must be a positive integer")]
    BadMaxTokens,
}

/// The session start in a `chunk` event's payload.
#[derive(Debug, Clone)]
pub struct SessionStart {
    event: Value,
}

impl SessionStart {
    /// Reads a `chunk` event's payload, which must carry `sessionStart`.
    pub fn read(chunk_payload: &[u8]) -> Result<SessionStart, SessionStartError> {
        let event: Value = decode_chunk(chunk_payload)
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or(SessionStartError::NotAChunk)?;
        if event
            .pointer("/event/sessionStart")
            .is_none_or(|s| !s.is_object())
        {
            return Err(SessionStartError::NotSessionStart);
        }
        Ok(SessionStart { event })
    }

    /// The `maxTokens` it asks for, `None` if it names none.
    pub fn max_tokens(&self) -> Result<Option<u64>, SessionStartError> {
        match self.event.pointer(MAX_TOKENS) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|n| *n >= 1)
                .map(Some)
                .ok_or(SessionStartError::BadMaxTokens),
        }
    }

    /// The chunk payload of this event with `maxTokens` set to `n`.
    pub fn with_max_tokens(mut self, n: u64) -> Bytes {
        let start = &mut self.event["event"]["sessionStart"];
        if !start["inferenceConfiguration"].is_object() {
            start["inferenceConfiguration"] = Value::Object(serde_json::Map::new());
        }
        start["inferenceConfiguration"]["maxTokens"] = Value::from(n);
        let bytes = base64::engine::general_purpose::STANDARD.encode(self.event.to_string());
        Bytes::from(serde_json::json!({ "bytes": bytes }).to_string())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chunk(event: &Value) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(event.to_string());
        json!({ "bytes": b64 }).to_string().into_bytes()
    }

    #[test]
    fn max_tokens_is_read_and_rewritten_keeping_the_rest() {
        let start = json!({"event": {"sessionStart": {"inferenceConfiguration":
            {"maxTokens": 1024, "topP": 0.9}, "turnDetectionConfiguration": {"x": 1}}}});
        let read = SessionStart::read(&chunk(&start)).unwrap();
        assert_eq!(read.max_tokens(), Ok(Some(1024)));
        let rewritten = SessionStart::read(&read.with_max_tokens(300)).unwrap();
        assert_eq!(rewritten.max_tokens(), Ok(Some(300)));
        let mut expected = start.clone();
        expected["event"]["sessionStart"]["inferenceConfiguration"]["maxTokens"] = json!(300);
        assert_eq!(rewritten.event, expected);

        let bare = SessionStart::read(&chunk(&json!({"event": {"sessionStart": {}}}))).unwrap();
        assert_eq!(bare.max_tokens(), Ok(None));
        let written = SessionStart::read(&bare.with_max_tokens(5)).unwrap();
        assert_eq!(written.max_tokens(), Ok(Some(5)));
    }

    #[test]
    fn other_first_events_are_refused() {
        let prompt = chunk(&json!({"event": {"promptStart": {"promptName": "p"}}}));
        assert_eq!(
            SessionStart::read(&prompt).unwrap_err(),
            SessionStartError::NotSessionStart
        );
        assert_eq!(
            SessionStart::read(b"{}").unwrap_err(),
            SessionStartError::NotAChunk
        );
        let zero = json!({"event": {"sessionStart": {"inferenceConfiguration": {"maxTokens": 0}}}});
        assert_eq!(
            SessionStart::read(&chunk(&zero)).unwrap().max_tokens(),
            Err(SessionStartError::BadMaxTokens)
        );
    }
}
