//! OpenAI Chat Completions: the request, the `chat.completion` body and the
//! `chat.completion.chunk` stream.
//!
//! A stream is `data:` lines: a first chunk with the assistant role, content deltas, a chunk
//! with `finish_reason` (`stop`, or `length` when the cap was hit), then, only when
//! `stream_options.include_usage` is true, a last chunk with empty `choices` and the `usage`
//! (every earlier chunk then carries `"usage": null`, as OpenAI's do), and `data: [DONE]`.

use bytes::Bytes;
use serde_json::{Value, json};

use super::{Ask, Invalid, service_tier, sse, unix_now};
use crate::simulator::request;
use crate::simulator::shapes::{Framing, Usage};
use crate::simulator::tier::Tier;

/// Reads a chat request (`model` and `stream` already in `ask`).
pub(super) fn parse(v: &Value, ask: Ask) -> Result<Ask, Invalid> {
    match v.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        _ => return Err("messages is required: a non-empty array of chat messages.".into()),
    }
    let max_tokens =
        match request::positive(v, &["max_completion_tokens"], "max_completion_tokens")? {
            Some(n) => Some(n),
            None => request::positive(v, &["max_tokens"], "max_tokens")?,
        };
    let include_usage = match request::at(v, &["stream_options", "include_usage"]) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream_options.include_usage must be true or false.".into()),
    };
    if include_usage && !ask.stream {
        return Err("stream_options is only allowed when stream is true.".into());
    }
    Ok(Ask {
        input_tokens: request::input_tokens(v),
        max_tokens,
        include_usage,
        tier: service_tier(v, Tier::parse_openai)?,
        ..ask
    })
}

fn finish_reason(u: &Usage<'_>) -> &'static str {
    if u.hit_max { "length" } else { "stop" }
}

fn usage(u: &Usage<'_>) -> Value {
    json!({
        "prompt_tokens": u.input,
        "completion_tokens": u.output,
        "total_tokens": u.input + u.output,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

/// The fields every chat object starts with.
fn head(id: &str, object: &str, u: &Usage<'_>) -> Value {
    let mut v = json!({
        "id": format!("chatcmpl-{id}"),
        "object": object,
        "created": unix_now(),
        "model": u.model_id,
        "system_fingerprint": null,
    });
    if let Some(tier) = u.tier {
        v["service_tier"] = json!(tier.name());
    }
    v
}

/// The `chat.completion` body.
pub(super) fn body(id: &str, text: &str, u: &Usage<'_>) -> Value {
    let mut v = head(id, "chat.completion", u);
    v["choices"] = json!([{
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": null},
        "logprobs": null,
        "finish_reason": finish_reason(u),
    }]);
    v["usage"] = usage(u);
    v
}

/// The chunk stream.
pub(super) struct Sse {
    id: String,
    include_usage: bool,
}

impl Sse {
    pub fn new(id: &str, include_usage: bool) -> Sse {
        Sse {
            id: id.to_string(),
            include_usage,
        }
    }

    fn chunk(&self, u: &Usage<'_>, choices: Value) -> Bytes {
        let mut v = head(&self.id, "chat.completion.chunk", u);
        v["choices"] = choices;
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        sse::data(&v)
    }
}

impl Framing for Sse {
    fn prelude(&self, u: &Usage<'_>, _request_id: &str) -> Vec<Bytes> {
        let delta = json!({"role": "assistant", "content": ""});
        vec![self.chunk(
            u,
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]),
        )]
    }

    fn delta(&self, text: &str, _so_far: u64, u: &Usage<'_>) -> Bytes {
        let delta = json!({"content": text});
        self.chunk(
            u,
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]),
        )
    }

    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes> {
        let finish =
            json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(u)}]);
        let mut frames = vec![self.chunk(u, finish)];
        if self.include_usage {
            let mut last = head(&self.id, "chat.completion.chunk", u);
            last["choices"] = json!([]);
            last["usage"] = usage(u);
            frames.push(sse::data(&last));
        }
        frames.push(sse::done());
        frames
    }
}
