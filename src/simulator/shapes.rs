//! Response bodies and event-stream frames, in each operation's and model family's native shape.
//! [`Framing`] is what a streamed answer of any API provides to the paced body
//! ([`super::stream`]); the body-model APIs' SSE framings live in `apis`.

use base64::Engine;
use bytes::Bytes;
use serde_json::{Value, json};

use super::models::Family;
use super::tier::Tier;
use crate::bedrock::eventstream::event_frame;

/// The facts of a finished (or planned) generation.
#[derive(Debug, Clone)]
pub struct Usage<'a> {
    pub model_id: &'a str,
    pub input: u64,
    pub output: u64,
    pub hit_max: bool,
    pub latency_ms: u64,
    pub first_byte_ms: u64,
    /// The tier that served the call, echoed when the call named one.
    pub tier: Option<Tier>,
}

impl Usage<'_> {
    fn metrics(&self) -> Value {
        json!({
            "inputTokenCount": self.input,
            "outputTokenCount": self.output,
            "invocationLatency": self.latency_ms,
            "firstByteLatency": self.first_byte_ms,
        })
    }

    /// Converse's `serviceTier` member, when there is a tier to echo.
    fn service_tier(&self) -> Option<Value> {
        self.tier.map(|t| json!({"type": t.name()}))
    }

    fn converse_stop(&self) -> &'static str {
        if self.hit_max {
            "max_tokens"
        } else {
            "end_turn"
        }
    }
}

/// The Converse response body.
pub fn converse_body(text: &str, u: &Usage<'_>) -> Vec<u8> {
    let mut v = json!({
        "output": {"message": {"role": "assistant", "content": [{"text": text}]}},
        "stopReason": u.converse_stop(),
        "usage": {"inputTokens": u.input, "outputTokens": u.output, "totalTokens": u.input + u.output},
        "metrics": {"latencyMs": u.latency_ms},
    });
    if let Some(tier) = u.service_tier() {
        v["serviceTier"] = tier;
    }
    v.to_string().into_bytes()
}

/// The InvokeModel response body of a family.
pub fn invoke_body(family: Family, text: &str, u: &Usage<'_>, request_id: &str) -> Vec<u8> {
    let v = match family {
        Family::Anthropic => json!({
            "id": format!("msg_bdrk_{}", request_id.replace('-', "")),
            "type": "message",
            "role": "assistant",
            "model": u.model_id,
            "content": [{"type": "text", "text": text}],
            "stop_reason": u.converse_stop(),
            "stop_sequence": null,
            "usage": {"input_tokens": u.input, "output_tokens": u.output},
        }),
        Family::Nova => json!({
            "output": {"message": {"role": "assistant", "content": [{"text": text}]}},
            "stopReason": u.converse_stop(),
            "usage": {"inputTokens": u.input, "outputTokens": u.output, "totalTokens": u.input + u.output},
        }),
        Family::Titan => json!({
            "inputTextTokenCount": u.input,
            "results": [{
                "tokenCount": u.output,
                "outputText": text,
                "completionReason": if u.hit_max { "LENGTH" } else { "FINISH" },
            }],
        }),
        Family::Llama => json!({
            "generation": text,
            "prompt_token_count": u.input,
            "generation_token_count": u.output,
            "stop_reason": if u.hit_max { "length" } else { "stop" },
        }),
        Family::Generic => json!({
            "id": request_id,
            "object": "chat.completion",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": if u.hit_max { "length" } else { "stop" },
            }],
            "usage": {"prompt_tokens": u.input, "completion_tokens": u.output, "total_tokens": u.input + u.output},
        }),
    };
    v.to_string().into_bytes()
}

/// Which stream a call answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// ConverseStream events.
    Converse,
    /// InvokeModelWithResponseStream `chunk` events carrying the family's stream JSON.
    Invoke(Family),
}

/// A `chunk` event carrying `v` as base64 `bytes` (InvokeModelWithResponseStream and the
/// bidirectional stream).
pub(crate) fn chunk(v: &Value) -> Bytes {
    let b64 = base64::engine::general_purpose::STANDARD.encode(v.to_string());
    event_frame("chunk", json!({ "bytes": b64 }).to_string().as_bytes())
}

fn event(kind: &str, v: &Value) -> Bytes {
    event_frame(kind, v.to_string().as_bytes())
}

/// The frames of a streamed answer: what comes before the first delta, each delta, and what
/// follows the last (which carries the usage).
pub trait Framing {
    /// Frames sent before the first delta.
    fn prelude(&self, u: &Usage<'_>, request_id: &str) -> Vec<Bytes>;
    /// One delta carrying `text`; `so_far` tokens generated including it.
    fn delta(&self, text: &str, so_far: u64, u: &Usage<'_>) -> Bytes;
    /// Frames after the last delta; the last carries the usage.
    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes>;
}

impl Framing for StreamKind {
    fn prelude(&self, u: &Usage<'_>, request_id: &str) -> Vec<Bytes> {
        match *self {
            StreamKind::Converse => vec![event("messageStart", &json!({"role": "assistant"}))],
            StreamKind::Invoke(Family::Anthropic) => vec![
                chunk(&json!({"type": "message_start", "message": {
                    "id": format!("msg_bdrk_{}", request_id.replace('-', "")),
                    "type": "message", "role": "assistant", "model": u.model_id,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": u.input, "output_tokens": 1},
                }})),
                chunk(&json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}})),
            ],
            StreamKind::Invoke(Family::Nova) => {
                vec![chunk(&json!({"messageStart": {"role": "assistant"}}))]
            }
            StreamKind::Invoke(_) => Vec::new(),
        }
    }

    fn delta(&self, text: &str, so_far: u64, u: &Usage<'_>) -> Bytes {
        match *self {
            StreamKind::Converse => event(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 0, "delta": {"text": text}}),
            ),
            StreamKind::Invoke(family) => chunk(&match family {
                Family::Anthropic => json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}),
                Family::Nova => {
                    json!({"contentBlockDelta": {"delta": {"text": text}, "contentBlockIndex": 0}})
                }
                Family::Titan => json!({"outputText": text, "index": 0,
                    "totalOutputTextTokenCount": so_far, "completionReason": null,
                    "inputTextTokenCount": u.input}),
                Family::Llama => json!({"generation": text, "prompt_token_count": u.input,
                    "generation_token_count": so_far, "stop_reason": null}),
                Family::Generic => json!({"choices": [{"index": 0,
                    "delta": {"content": text}, "finish_reason": null}]}),
            }),
        }
    }

    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes> {
        let metrics = u.metrics();
        let length = u.hit_max;
        match *self {
            StreamKind::Converse => {
                let mut metadata = json!({
                    "usage": {"inputTokens": u.input, "outputTokens": u.output, "totalTokens": u.input + u.output},
                    "metrics": {"latencyMs": u.latency_ms},
                });
                if let Some(tier) = u.service_tier() {
                    metadata["serviceTier"] = tier;
                }
                vec![
                    event("contentBlockStop", &json!({"contentBlockIndex": 0})),
                    event("messageStop", &json!({"stopReason": u.converse_stop()})),
                    event("metadata", &metadata),
                ]
            }
            StreamKind::Invoke(Family::Anthropic) => vec![
                chunk(&json!({"type": "content_block_stop", "index": 0})),
                chunk(&json!({"type": "message_delta",
                    "delta": {"stop_reason": u.converse_stop(), "stop_sequence": null},
                    "usage": {"output_tokens": u.output}})),
                chunk(
                    &json!({"type": "message_stop", "amazon-bedrock-invocationMetrics": metrics}),
                ),
            ],
            StreamKind::Invoke(Family::Nova) => vec![
                chunk(&json!({"contentBlockStop": {"contentBlockIndex": 0}})),
                chunk(&json!({"messageStop": {"stopReason": u.converse_stop()}})),
                chunk(
                    &json!({"metadata": {"usage": {"inputTokens": u.input, "outputTokens": u.output}},
                    "amazon-bedrock-invocationMetrics": metrics}),
                ),
            ],
            StreamKind::Invoke(Family::Titan) => vec![chunk(&json!({"outputText": "", "index": 0,
                "totalOutputTextTokenCount": u.output,
                "completionReason": if length { "LENGTH" } else { "FINISH" },
                "inputTextTokenCount": u.input, "amazon-bedrock-invocationMetrics": metrics}))],
            StreamKind::Invoke(Family::Llama) => vec![chunk(&json!({"generation": "",
                "prompt_token_count": null, "generation_token_count": u.output,
                "stop_reason": if length { "length" } else { "stop" },
                "amazon-bedrock-invocationMetrics": metrics}))],
            StreamKind::Invoke(Family::Generic) => vec![chunk(&json!({"choices": [{"index": 0,
                "delta": {}, "finish_reason": if length { "length" } else { "stop" }}],
                "amazon-bedrock-invocationMetrics": metrics}))],
        }
    }
}
