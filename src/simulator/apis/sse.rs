//! Server-sent events, as the OpenAI and Anthropic APIs frame them.

use bytes::Bytes;
use serde_json::Value;

/// `data: {json}` and a blank line (OpenAI Chat Completions).
pub fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// `event: {name}`, `data: {json}` and a blank line (OpenAI Responses, Anthropic Messages).
pub fn event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

/// The end of an OpenAI Chat Completions stream.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}
