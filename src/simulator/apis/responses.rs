//! OpenAI Responses: the request, the `response` body and its event stream.
//!
//! A finished response has `status: "completed"`, or `"incomplete"` with
//! `incomplete_details.reason: "max_output_tokens"` when the cap was hit. A stream is SSE events
//! (`event:` and `data:` lines, each with a `sequence_number`): `response.created`,
//! `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, then `response.completed` carrying `response.usage`, or, when
//! the cap was hit, `response.incomplete` (as OpenAI ends such a stream; the usage is there too).
//! `background: true` is refused: Bedrock's Responses API is synchronous only.

use std::cell::Cell;

use bytes::Bytes;
use serde_json::{Value, json};

use super::{Ask, Invalid, service_tier, sse, unix_now};
use crate::simulator::request;
use crate::simulator::shapes::{Framing, Usage};
use crate::simulator::tier::Tier;

/// Reads a Responses request (`model` and `stream` already in `ask`).
pub(super) fn parse(v: &Value, ask: Ask) -> Result<Ask, Invalid> {
    let messages = match v.get("input") {
        Some(Value::String(_)) => 1,
        Some(Value::Array(items)) if !items.is_empty() => items.len() as u64,
        _ => return Err("input is required: a string or a non-empty array of input items.".into()),
    };
    if request::at(v, &["background"]) == Some(&Value::Bool(true)) {
        return Err(
            "background is not supported: Bedrock answers Responses requests synchronously.".into(),
        );
    }
    let texts = [v.get("input"), request::at(v, &["instructions"])];
    Ok(Ask {
        input_tokens: request::input_tokens_of(texts.into_iter().flatten(), messages),
        max_tokens: request::positive(v, &["max_output_tokens"], "max_output_tokens")?,
        tier: service_tier(v, Tier::parse_openai)?,
        ..ask
    })
}

fn status(u: &Usage<'_>) -> &'static str {
    if u.hit_max { "incomplete" } else { "completed" }
}

fn message(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": format!("msg_{id}"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

/// A `response` object; `text` is `None` while it is in progress.
fn response(id: &str, text: Option<&str>, u: &Usage<'_>) -> Value {
    let (status, output, usage) = match text {
        None => ("in_progress", json!([]), Value::Null),
        Some(text) => (
            status(u),
            json!([message(id, text, status(u))]),
            json!({
                "input_tokens": u.input,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": u.output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.input + u.output,
            }),
        ),
    };
    let incomplete = match (status, u.hit_max) {
        ("incomplete", true) => json!({"reason": "max_output_tokens"}),
        _ => Value::Null,
    };
    json!({
        "id": format!("resp_{id}"),
        "object": "response",
        "created_at": unix_now(),
        "status": status,
        "background": false,
        "error": null,
        "incomplete_details": incomplete,
        "instructions": null,
        "metadata": {},
        "model": u.model_id,
        "output": output,
        "parallel_tool_calls": true,
        "service_tier": u.tier.map(Tier::name),
        "store": false,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": usage,
    })
}

/// The `response` body of a finished call.
pub(super) fn body(id: &str, text: &str, u: &Usage<'_>) -> Value {
    response(id, Some(text), u)
}

/// The event stream. Frames are laid out once, in order, so a counter gives the sequence.
pub(super) struct Sse {
    id: String,
    text: String,
    sequence: Cell<u64>,
}

impl Sse {
    pub fn new(id: &str, text: &str) -> Sse {
        Sse {
            id: id.to_string(),
            text: text.to_string(),
            sequence: Cell::new(0),
        }
    }

    fn event(&self, kind: &str, mut v: Value) -> Bytes {
        let n = self.sequence.replace(self.sequence.get() + 1);
        v["type"] = json!(kind);
        v["sequence_number"] = json!(n);
        sse::event(kind, &v)
    }

    fn item_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn part(&self, text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }
}

impl Framing for Sse {
    fn prelude(&self, u: &Usage<'_>, _request_id: &str) -> Vec<Bytes> {
        let in_progress = response(&self.id, None, u);
        let mut item = message(&self.id, "", "in_progress");
        item["content"] = json!([]);
        vec![
            self.event("response.created", json!({"response": in_progress.clone()})),
            self.event("response.in_progress", json!({"response": in_progress})),
            self.event("response.output_item.added", json!({"output_index": 0, "item": item})),
            self.event(
                "response.content_part.added",
                json!({"item_id": self.item_id(), "output_index": 0, "content_index": 0, "part": self.part("")}),
            ),
        ]
    }

    fn delta(&self, text: &str, _so_far: u64, _u: &Usage<'_>) -> Bytes {
        self.event(
            "response.output_text.delta",
            json!({"item_id": self.item_id(), "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
        )
    }

    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes> {
        let text = &self.text;
        let last = if u.hit_max {
            "response.incomplete"
        } else {
            "response.completed"
        };
        vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": self.item_id(), "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": self.item_id(), "output_index": 0, "content_index": 0, "part": self.part(text)}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": message(&self.id, text, status(u))}),
            ),
            self.event(last, json!({"response": response(&self.id, Some(text), u)})),
        ]
    }
}
