//! Anthropic Messages: the request, the `message` body and its event stream.
//!
//! A stream is SSE events: `message_start` (the input counts in `message.usage`),
//! `content_block_start`, `ping`, `content_block_delta`..., `content_block_stop`, `message_delta`
//! (`delta.stop_reason`, `max_tokens` when the cap was hit, and the cumulative
//! `usage.output_tokens`), `message_stop`. The tier that served a call naming one is echoed as
//! `usage.service_tier`.

use bytes::Bytes;
use serde_json::{Value, json};

use super::{Ask, Invalid, service_tier, sse};
use crate::simulator::request;
use crate::simulator::shapes::{Framing, Usage};
use crate::simulator::tier::Tier;

/// Reads a Messages request (`model` and `stream` already in `ask`).
pub(super) fn parse(v: &Value, ask: Ask) -> Result<Ask, Invalid> {
    match v.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        _ => return Err("messages: Field required (a non-empty array of messages).".into()),
    }
    Ok(Ask {
        input_tokens: request::input_tokens(v),
        max_tokens: request::positive(v, &["max_tokens"], "max_tokens")?,
        tier: service_tier(v, Tier::parse_anthropic)?,
        ..ask
    })
}

fn stop_reason(u: &Usage<'_>) -> &'static str {
    if u.hit_max { "max_tokens" } else { "end_turn" }
}

fn usage(u: &Usage<'_>, output: u64) -> Value {
    let mut v = json!({
        "input_tokens": u.input,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output,
    });
    if let Some(tier) = u.tier {
        v["service_tier"] = json!(tier.name());
    }
    v
}

fn message(id: &str, content: Value, stop: Option<&str>, usage: Value, u: &Usage<'_>) -> Value {
    json!({
        "id": format!("msg_bdrk_{id}"),
        "type": "message",
        "role": "assistant",
        "model": u.model_id,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": usage,
    })
}

/// The `message` body.
pub(super) fn body(id: &str, text: &str, u: &Usage<'_>) -> Value {
    let content = json!([{"type": "text", "text": text}]);
    message(id, content, Some(stop_reason(u)), usage(u, u.output), u)
}

/// The event stream.
pub(super) struct Sse {
    id: String,
}

impl Sse {
    pub fn new(id: &str) -> Sse {
        Sse { id: id.to_string() }
    }
}

fn event(kind: &str, mut v: Value) -> Bytes {
    v["type"] = json!(kind);
    sse::event(kind, &v)
}

impl Framing for Sse {
    fn prelude(&self, u: &Usage<'_>, _request_id: &str) -> Vec<Bytes> {
        let start = message(&self.id, json!([]), None, usage(u, 1), u);
        vec![
            event("message_start", json!({"message": start})),
            event(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", json!({})),
        ]
    }

    fn delta(&self, text: &str, _so_far: u64, _u: &Usage<'_>) -> Bytes {
        event(
            "content_block_delta",
            json!({"index": 0, "delta": {"type": "text_delta", "text": text}}),
        )
    }

    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes> {
        vec![
            event("content_block_stop", json!({"index": 0})),
            event(
                "message_delta",
                json!({"delta": {"stop_reason": stop_reason(u), "stop_sequence": null},
                    "usage": {"output_tokens": u.output}}),
            ),
            event("message_stop", json!({})),
        ]
    }
}
