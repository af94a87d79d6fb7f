//! Usage, output and stop reasons of the OpenAI and Anthropic APIs' responses, for
//! [`super::UsageObserver`]: their JSON bodies and their SSE events ([`crate::bedrock::sse`]).
//!
//! - **Chat Completions**: `usage` {`prompt_tokens`, `completion_tokens`,
//!   `prompt_tokens_details.cached_tokens`}; streamed, in the chunk whose `choices` is empty (sent
//!   only with `stream_options.include_usage`, which the proxy asks for). Output: each choice's
//!   `delta.content` (and reasoning, refusal, tool-call arguments). Stop: `finish_reason`.
//! - **Responses**: `usage` {`input_tokens`, `output_tokens`,
//!   `input_tokens_details.cached_tokens`}; streamed, in `response.completed` (or
//!   `response.incomplete`, `response.failed`) `response.usage`. Output: every `*.delta` event's
//!   `delta`. Stop: `incomplete_details.reason` (`max_output_tokens`) or the `status`.
//! - **Messages**: Anthropic's `usage` {`input_tokens`, `output_tokens`,
//!   `cache_read_input_tokens`, `cache_creation_input_tokens`}; streamed, the input counts in
//!   `message_start.message.usage` and the output, cumulative, in each `message_delta.usage`
//!   (which may repeat the input counts): the usage is known at `message_stop`, or at the end of
//!   a stream that had a `message_delta` but no `message_stop`. Output: `content_block_delta`.
//!   Stop: `stop_reason`.
//!
//! The OpenAI usage counts cached prompt tokens inside `prompt_tokens` / `input_tokens`; they are
//! reported as cache reads (which Bedrock does not charge) and taken out of the input (U: how
//! Bedrock charges cached tokens on these paths is not documented; its own operations charge
//! cache reads nothing).

use serde_json::Value;

use super::{Usage, UsageObserver};

/// Which API a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ApiKind {
    Chat,
    Responses,
    Messages,
}

/// What one event (or a whole body) says.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Reading {
    /// Output text seen, in bytes per delta.
    pub deltas: Vec<u64>,
    pub usage: Option<Usage>,
    pub stop_reason: Option<String>,
    /// The error the stream ended with, if it reported one.
    pub exception: Option<String>,
}

/// A whole JSON body, read for its usage and stop reason only (serde skips the rest without
/// building it).
pub(super) fn body(kind: ApiKind, bytes: &[u8]) -> Result<Reading, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct Choice {
        finish_reason: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Body {
        usage: Option<Value>,
        choices: Option<Vec<Choice>>,
        status: Option<String>,
        incomplete_details: Option<Value>,
        stop_reason: Option<String>,
    }
    let b: Body = serde_json::from_slice(bytes)?;
    let usage = b.usage.as_ref();
    let (usage, stop_reason) = match kind {
        ApiKind::Chat => (
            usage.and_then(openai_chat_usage),
            b.choices
                .unwrap_or_default()
                .into_iter()
                .find_map(|c| c.finish_reason),
        ),
        ApiKind::Responses => (
            usage.and_then(openai_responses_usage),
            b.incomplete_details
                .as_ref()
                .and_then(|d| d.get("reason"))
                .and_then(Value::as_str)
                .map(str::to_string)
                .or(b.status),
        ),
        ApiKind::Messages => (usage.and_then(anthropic_usage), b.stop_reason),
    };
    Ok(Reading {
        usage,
        stop_reason,
        ..Reading::default()
    })
}

/// One Chat Completions chunk.
pub(super) fn chat_chunk(v: &Value) -> Reading {
    let choices = v.get("choices");
    let deltas = choices
        .and_then(Value::as_array)
        .map(|cs| cs.iter().map(chat_delta_len).collect())
        .unwrap_or_default();
    Reading {
        deltas,
        usage: v.get("usage").and_then(openai_chat_usage),
        stop_reason: first_finish_reason(choices),
        exception: v.get("error").map(error_kind),
    }
}

/// One Responses event (`type` names it).
pub(super) fn responses_event(v: &Value) -> Reading {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
    let mut reading = Reading::default();
    if kind.ends_with(".delta")
        && let Some(delta) = v.get("delta").and_then(Value::as_str)
    {
        reading.deltas.push(delta.len() as u64);
    }
    match kind {
        "response.completed" | "response.incomplete" | "response.failed" => {
            let response = v.get("response").unwrap_or(&Value::Null);
            reading.usage = response.get("usage").and_then(openai_responses_usage);
            reading.stop_reason = responses_stop(response);
            if kind == "response.failed" {
                reading.exception = Some(
                    response
                        .get("error")
                        .map_or_else(|| kind.to_string(), error_kind),
                );
            }
        }
        "error" => reading.exception = Some(error_kind(v)),
        _ => {}
    }
    reading
}

/// An Anthropic Messages stream's running usage.
#[derive(Debug, Default)]
pub(super) struct MessagesStream {
    usage: Option<Usage>,
    /// A `message_delta` has given the (cumulative) output.
    delta_seen: bool,
}

impl MessagesStream {
    /// One event; its usage only once the message stops.
    pub fn event(&mut self, v: &Value) -> Reading {
        let mut reading = Reading::default();
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                self.usage = v.pointer("/message/usage").and_then(anthropic_usage);
            }
            "content_block_delta" => {
                reading.deltas.push(super::delta_text_len(v.get("delta")));
            }
            "message_delta" => {
                self.delta(v.get("usage"));
                reading.stop_reason = v
                    .pointer("/delta/stop_reason")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
            "message_stop" => reading.usage = self.finished(),
            "error" => {
                reading.exception = Some(v.get("error").map_or_else(|| "error".into(), error_kind))
            }
            _ => {}
        }
        reading
    }

    /// The stream ended: its usage, if a `message_delta` gave the output.
    pub fn finished(&self) -> Option<Usage> {
        self.usage.filter(|_| self.delta_seen)
    }

    fn delta(&mut self, usage: Option<&Value>) {
        let Some(usage) = usage else { return };
        let count = |k: &str| usage.get(k).and_then(Value::as_u64);
        let Some(output) = count("output_tokens") else {
            return;
        };
        let running = self.usage.get_or_insert_with(Usage::default);
        running.output_tokens = output;
        // Newer streams repeat the input counts here, cumulative too.
        if let Some(n) = count("input_tokens") {
            running.input_tokens = n;
        }
        if let Some(n) = count("cache_read_input_tokens") {
            running.cache_read_input_tokens = n;
        }
        if let Some(n) = count("cache_creation_input_tokens") {
            running.cache_write_input_tokens = n;
        }
        self.delta_seen = true;
    }
}

/// Chat Completions usage: input excludes the cached prompt tokens, reported as cache reads.
fn openai_chat_usage(u: &Value) -> Option<Usage> {
    openai_usage(
        u,
        "prompt_tokens",
        "completion_tokens",
        "/prompt_tokens_details/cached_tokens",
    )
}

/// Responses usage, likewise.
fn openai_responses_usage(u: &Value) -> Option<Usage> {
    openai_usage(
        u,
        "input_tokens",
        "output_tokens",
        "/input_tokens_details/cached_tokens",
    )
}

fn openai_usage(u: &Value, input: &str, output: &str, cached: &str) -> Option<Usage> {
    let prompt = u.get(input)?.as_u64()?;
    let cached = u
        .pointer(cached)
        .and_then(Value::as_u64)
        .unwrap_or(0)
        .min(prompt);
    Some(Usage {
        input_tokens: prompt - cached,
        output_tokens: u.get(output)?.as_u64()?,
        cache_read_input_tokens: cached,
        cache_write_input_tokens: 0,
    })
}

/// Anthropic usage (cache reads and writes apart from the input, as Bedrock reports them).
fn anthropic_usage(u: &Value) -> Option<Usage> {
    let count = |k: &str| u.get(k).and_then(Value::as_u64);
    Some(Usage {
        input_tokens: count("input_tokens")?,
        output_tokens: count("output_tokens")?,
        cache_read_input_tokens: count("cache_read_input_tokens").unwrap_or(0),
        cache_write_input_tokens: count("cache_creation_input_tokens").unwrap_or(0),
    })
}

/// Bytes of output in one streamed choice.
fn chat_delta_len(choice: &Value) -> u64 {
    let text = super::choice_text_len(choice) + string_len(choice.pointer("/delta/refusal"));
    let tools: u64 = choice
        .pointer("/delta/tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| string_len(c.pointer("/function/arguments")))
                .sum()
        })
        .unwrap_or(0);
    text + tools
}

fn first_finish_reason(choices: Option<&Value>) -> Option<String> {
    choices?
        .as_array()?
        .iter()
        .find_map(|c| c.get("finish_reason").and_then(Value::as_str))
        .map(str::to_string)
}

/// `incomplete_details.reason` of an incomplete response, else its `status`.
fn responses_stop(response: &Value) -> Option<String> {
    response
        .pointer("/incomplete_details/reason")
        .and_then(Value::as_str)
        .or_else(|| response.get("status").and_then(Value::as_str))
        .map(str::to_string)
}

/// An error object's `type` (or `code`), else `error`.
fn error_kind(error: &Value) -> String {
    ["type", "code"]
        .iter()
        .find_map(|k| error.get(*k).and_then(Value::as_str))
        .unwrap_or("error")
        .to_string()
}

fn string_len(v: Option<&Value>) -> u64 {
    v.and_then(Value::as_str).map_or(0, |s| s.len() as u64)
}

// === The observer's SSE side ===

impl UsageObserver {
    /// SSE (the OpenAI and Anthropic APIs): each whole event read as its API says.
    pub(super) fn on_sse_data(&mut self, chunk: &[u8]) -> Option<Usage> {
        if self.corrupt {
            return None;
        }
        self.events.push(chunk);
        let mut found = None;
        loop {
            let event = match self.events.next_event() {
                Ok(Some(event)) => event,
                Ok(None) => return found,
                Err(_) => {
                    self.mark_corrupt();
                    return found;
                }
            };
            // `[DONE]`, pings and comments carry nothing to read.
            let Ok(v) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            let reading = match self.kind.api() {
                Some(ApiKind::Chat) => chat_chunk(&v),
                Some(ApiKind::Responses) => responses_event(&v),
                Some(ApiKind::Messages) => self.messages.event(&v),
                None => Reading::default(),
            };
            if let Some(usage) = self.read(reading) {
                found = found.or(self.report(usage));
            }
        }
    }

    /// Takes in what an API event said; returns its usage.
    fn read(&mut self, reading: Reading) -> Option<Usage> {
        for bytes in reading.deltas {
            self.add_output(bytes);
        }
        if reading.stop_reason.is_some() {
            self.stop_reason = reading.stop_reason;
        }
        if let Some(e) = reading.exception {
            self.exception.get_or_insert(e);
        }
        reading.usage
    }
}

#[cfg(test)]
#[path = "usage_api_tests.rs"]
mod tests;
