//! Usage extraction from every response kind, fed incrementally as the response streams through.
//! (Over 500 lines: one observer for every response kind, so each kind's rules sit side by side.)
//!
//! A [`UsageObserver`] watches one successful response, chunk by chunk at whatever boundaries the
//! network gives, and hands back the [`Usage`] from the call at which it first becomes known, so
//! the proxy can settle its quota reservation then rather than at connection close.
//!
//! # Where usage comes from
//! - **Converse**: the JSON body's `usage`, read at [`UsageObserver::on_end`].
//! - **ConverseStream**: the `metadata` event's `usage`, returned by the `on_data` call that
//!   completes that frame.
//! - **InvokeModel**: the `X-Amzn-Bedrock-*-Token-Count` headers (input and output both needed),
//!   else the model-native body's own usage at `on_end`: Anthropic `usage.input_tokens`, Nova
//!   `usage.inputTokens`, OpenAI-style `usage.prompt_tokens`, Llama `prompt_token_count`, Titan
//!   `inputTextTokenCount` plus `results[].tokenCount`.
//! - **InvokeModelWithResponseStream**: the `chunk` whose decoded JSON carries
//!   `amazon-bedrock-invocationMetrics`.
//! - **OpenAI Chat Completions, OpenAI Responses, Anthropic Messages**: their JSON body's `usage`
//!   at `on_end`, or their SSE stream's usage event (see `usage_api.rs`).
//!
//! The stop reason ([`UsageObserver::stop_reason`]; [`UsageObserver::truncated`] when the output
//! hit its cap: `max_tokens`, `length`, `LENGTH`, `max_output_tokens`) is read from Converse's
//! body `stopReason` and ConverseStream's `messageStop` event, an InvokeModel body's family field
//! (Anthropic/Llama `stop_reason`, Nova `stopReason`, OpenAI-style `choices[].finish_reason`,
//! Titan `results[].completionReason`) and the OpenAI and Anthropic APIs' own; not from
//! InvokeModelWithResponseStream chunks.
//! - **InvokeModelWithBidirectionalStream**: `chunk` events whose decoded JSON is a Nova Sonic
//!   event; each `usageEvent` carries the session's running totals (`totalInputTokens`,
//!   `totalOutputTokens`). They are kept as they come ([`UsageObserver::running_usage`]) and the
//!   last ones are the session's usage, returned by [`UsageObserver::on_end`]: a session is
//!   charged when it ends, not at its first usage event.
//!
//! # Output seen
//! [`UsageObserver::output_tokens_seen`] is the settlement basis for a stream cut before its
//! usage arrived. Streams: for every text delta (Converse `delta.text`, `toolUse.input`,
//! `reasoningContent.text`; the model-native deltas of each family), `ceil(bytes / 4)` tokens,
//! summed per delta, so a one-token delta of two bytes still counts one. Non-streamed bodies:
//! `ceil(body bytes / 4)`, JSON overhead included.
//!
//! # Failure semantics and memory
//! Usage is returned at most once. Bad framing, bad base64 or undecodable JSON never panic: the
//! observer marks itself corrupt ([`UsageObserver::is_corrupt`]), drops its buffers and reports no
//! usage from then on; output seen so far is kept. Memory stays bounded: the frame reader holds
//! at most one partial frame plus the current chunk, a partial frame past [`FRAME_CAP`] counts as
//! corrupt, and body copies stop at [`BODY_CAP`] (past it, no usage is reported from the body).
//!
//! (Long: one observer for every response kind, each kind a short section; they share the frame
//! and JSON buffering.)

use base64::Engine as _;
use http::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Operation;
use super::eventstream::{Frame, FrameReader};
use super::sse::{self, SseReader};

#[path = "usage_api.rs"]
mod api;
use api::{ApiKind, MessagesStream};

/// The most body bytes kept to read usage from at the end (Converse, InvokeModel without headers).
pub const BODY_CAP: usize = 8 * 1024 * 1024;

/// The largest partial frame held while waiting for the rest of it. The event-stream decoder
/// trusts the length in a frame's prelude, so without this a frame claiming gigabytes would be
/// buffered; Bedrock's own frames are a few kilobytes.
pub const FRAME_CAP: usize = 8 * 1024 * 1024;

/// The key of the usage object in the last InvokeModelWithResponseStream chunk.
const INVOCATION_METRICS: &str = "amazon-bedrock-invocationMetrics";

/// Token usage as Bedrock reports it at the end of a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_write_input_tokens: u64,
}

impl Usage {
    /// Bedrock's end-of-request quota charge: `input + cacheWrite + output x burndown`.
    /// Cache reads are not charged.
    pub fn charge(&self, burndown: u32) -> u64 {
        self.input_tokens
            .saturating_add(self.cache_write_input_tokens)
            .saturating_add(self.output_tokens.saturating_mul(u64::from(burndown)))
    }
}

#[cfg(test)]
impl Usage {
    /// The four counts, in the order the tests write them.
    pub(crate) fn counts(input: u64, output: u64, cache_read: u64, cache_write: u64) -> Usage {
        Usage {
            input_tokens: input,
            output_tokens: output,
            cache_read_input_tokens: cache_read,
            cache_write_input_tokens: cache_write,
        }
    }
}

/// How a response carries its usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseKind {
    /// Converse: a JSON body with `usage`.
    ConverseJson,
    /// ConverseStream: event stream, usage in the `metadata` event.
    ConverseStream,
    /// InvokeModel: `X-Amzn-Bedrock-*-Token-Count` headers, else the model-native body's usage.
    InvokeModel,
    /// InvokeModelWithResponseStream: `chunk` events; the last carries
    /// `amazon-bedrock-invocationMetrics`.
    InvokeModelStream,
    /// OpenAI Chat Completions: a JSON body with `usage`.
    ChatJson,
    /// Chat Completions streamed (SSE `data:` chunks): the usage chunk.
    ChatStream,
    /// OpenAI Responses: a JSON `response` with `usage`.
    ResponsesJson,
    /// Responses streamed (SSE events): `response.completed` and its kin.
    ResponsesStream,
    /// Anthropic Messages: a JSON `message` with `usage`.
    MessagesJson,
    /// Messages streamed (SSE events): `message_start`, `message_delta`, `message_stop`.
    MessagesStream,
    /// InvokeModelWithBidirectionalStream: `chunk` events of Nova Sonic; `usageEvent`s carry
    /// running totals, the last of which is the usage.
    BidirectionalStream,
}

impl ResponseKind {
    /// The kind of an operation's successful responses (the OpenAI and Anthropic APIs: their
    /// JSON body; [`ResponseKind::for_response`] tells a stream).
    pub fn for_operation(op: Operation) -> Option<ResponseKind> {
        match op {
            Operation::Converse => Some(ResponseKind::ConverseJson),
            Operation::ConverseStream => Some(ResponseKind::ConverseStream),
            Operation::InvokeModel => Some(ResponseKind::InvokeModel),
            Operation::InvokeModelWithResponseStream => Some(ResponseKind::InvokeModelStream),
            Operation::InvokeModelWithBidirectionalStream => {
                Some(ResponseKind::BidirectionalStream)
            }
            Operation::OpenAIChatCompletions => Some(ResponseKind::ChatJson),
            Operation::OpenAIResponses => Some(ResponseKind::ResponsesJson),
            Operation::AnthropicMessages => Some(ResponseKind::MessagesJson),
            _ => None,
        }
    }

    /// The kind of a successful response to `op` with these headers: the OpenAI and Anthropic
    /// APIs stream (SSE) when the client asked, which the `content-type` says.
    pub fn for_response(op: Operation, headers: &HeaderMap) -> Option<ResponseKind> {
        let sse = headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(sse::CONTENT_TYPE.as_bytes()));
        let kind = Self::for_operation(op)?;
        Some(match (kind, sse) {
            (ResponseKind::ChatJson, true) => ResponseKind::ChatStream,
            (ResponseKind::ResponsesJson, true) => ResponseKind::ResponsesStream,
            (ResponseKind::MessagesJson, true) => ResponseKind::MessagesStream,
            (kind, _) => kind,
        })
    }

    /// Output is counted from the deltas of a stream (else from the body's size).
    fn is_stream(self) -> bool {
        self.is_event_stream() || self.is_sse()
    }

    fn is_event_stream(self) -> bool {
        matches!(
            self,
            ResponseKind::ConverseStream
                | ResponseKind::InvokeModelStream
                | ResponseKind::BidirectionalStream
        )
    }

    fn is_sse(self) -> bool {
        matches!(
            self,
            ResponseKind::ChatStream | ResponseKind::ResponsesStream | ResponseKind::MessagesStream
        )
    }

    /// The OpenAI or Anthropic API a response belongs to.
    fn api(self) -> Option<ApiKind> {
        match self {
            ResponseKind::ChatJson | ResponseKind::ChatStream => Some(ApiKind::Chat),
            ResponseKind::ResponsesJson | ResponseKind::ResponsesStream => Some(ApiKind::Responses),
            ResponseKind::MessagesJson | ResponseKind::MessagesStream => Some(ApiKind::Messages),
            _ => None,
        }
    }
}

/// The stop reasons that say the output hit its cap: Chat Completions `length`, Responses
/// `max_output_tokens`, Messages (and Anthropic InvokeModel bodies) `max_tokens`.
pub const TRUNCATED_STOP_REASONS: [&str; 4] =
    ["length", "max_output_tokens", "max_tokens", "LENGTH"];

/// Watches one successful (2xx) response go by and reports its usage the moment it is known.
#[derive(Debug)]
pub struct UsageObserver {
    kind: ResponseKind,
    frames: FrameReader,
    events: SseReader,
    messages: MessagesStream,
    stop_reason: Option<String>,
    body: BoundedBody,
    usage: Option<Usage>,
    /// A bidirectional stream's latest running totals.
    running: Option<Usage>,
    body_bytes: u64,
    output_seen: u64,
    exception: Option<String>,
    corrupt: bool,
}

impl UsageObserver {
    pub fn new(kind: ResponseKind) -> Self {
        UsageObserver {
            kind,
            frames: FrameReader::new(),
            events: SseReader::new(),
            messages: MessagesStream::default(),
            stop_reason: None,
            body: BoundedBody::default(),
            usage: None,
            running: None,
            body_bytes: 0,
            output_seen: 0,
            exception: None,
            corrupt: false,
        }
    }

    pub fn kind(&self) -> ResponseKind {
        self.kind
    }

    /// Feeds the response headers. Returns the usage if the headers carry it (InvokeModel).
    pub fn on_headers(&mut self, headers: &HeaderMap) -> Option<Usage> {
        if self.kind != ResponseKind::InvokeModel {
            return None;
        }
        header_usage(headers).and_then(|u| self.report(u))
    }

    /// Feeds one body chunk. Returns `Some` exactly once: when usage first becomes known.
    pub fn on_data(&mut self, chunk: &[u8]) -> Option<Usage> {
        self.body_bytes = self.body_bytes.saturating_add(chunk.len() as u64);
        if self.kind.is_sse() {
            return self.on_sse_data(chunk);
        }
        if self.kind.is_event_stream() {
            return self.on_stream_data(chunk);
        }
        // Kept even when the headers gave the usage: the body says why the output stopped.
        self.body.push(chunk);
        None
    }

    /// The body ended. Returns the usage if it becomes known only now (Converse JSON, InvokeModel
    /// body usage) and was not returned before.
    pub fn on_end(&mut self) -> Option<Usage> {
        if self.kind == ResponseKind::BidirectionalStream && !self.corrupt {
            return self.running.and_then(|u| self.report(u));
        }
        if self.corrupt || (self.usage.is_some() && self.kind.is_stream()) {
            return None;
        }
        if self.kind == ResponseKind::MessagesStream {
            // A stream that gave its output but no `message_stop`.
            return self.messages.finished().and_then(|u| self.report(u));
        }
        if self.kind.is_stream() {
            return None;
        }
        let body = self.body.take()?;
        let found = match (self.kind, self.kind.api()) {
            (_, Some(api)) => api::body(api, &body).map(|reading| {
                self.stop_reason = reading.stop_reason;
                reading.usage
            }),
            (ResponseKind::ConverseJson, None) => serde_json::from_slice::<ConverseBody>(&body)
                .map(|b| {
                    self.stop_reason = b.stop_reason;
                    b.usage.as_ref().and_then(|u| usage_in(u, &CONVERSE_KEYS))
                }),
            (_, None) => serde_json::from_slice::<NativeBody>(&body).map(|b| {
                self.stop_reason = b.stop_reason();
                b.usage()
            }),
        };
        match found {
            // Usage the headers gave first is not reported twice.
            Ok(usage) => usage.and_then(|u| self.report(u)),
            Err(_) if self.usage.is_some() => None,
            Err(_) => {
                self.corrupt = true;
                None
            }
        }
    }

    /// An estimate of the output tokens generated so far, from the content seen; the basis for
    /// settling a stream that was cut before its usage arrived.
    pub fn output_tokens_seen(&self) -> u64 {
        if self.kind.is_stream() {
            self.output_seen
        } else {
            self.body_bytes.div_ceil(4)
        }
    }

    /// The `:exception-type` of an exception frame seen in the stream, if any.
    pub fn stream_exception(&self) -> Option<&str> {
        self.exception.as_deref()
    }

    /// Whether the response could not be parsed (bad framing, base64 or JSON); no usage will be
    /// reported after this turns true.
    pub fn is_corrupt(&self) -> bool {
        self.corrupt
    }

    /// The usage, once known (whether or not it has been returned already).
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Why the output stopped, in the operation's or family's own words (`end_turn`,
    /// `max_tokens`, `stop`, `length`, `LENGTH`, `completed`, `max_output_tokens`, ...), once seen.
    pub fn stop_reason(&self) -> Option<&str> {
        self.stop_reason.as_deref()
    }

    /// Whether the output hit its cap ([`TRUNCATED_STOP_REASONS`]).
    pub fn truncated(&self) -> bool {
        self.stop_reason()
            .is_some_and(|r| TRUNCATED_STOP_REASONS.contains(&r))
    }

    /// A bidirectional stream's running totals so far (the last `usageEvent`), kept even if the
    /// stream turned corrupt after them.
    pub fn running_usage(&self) -> Option<Usage> {
        self.running
    }

    /// Records usage and returns it, unless usage was already reported.
    fn report(&mut self, usage: Usage) -> Option<Usage> {
        if self.usage.is_some() {
            return None;
        }
        self.usage = Some(usage);
        self.body = BoundedBody::default();
        Some(usage)
    }

    fn on_stream_data(&mut self, chunk: &[u8]) -> Option<Usage> {
        if self.corrupt {
            return None;
        }
        let (frames, broken) = self.frames.frames_of(chunk, FRAME_CAP);
        let mut found = None;
        for frame in &frames {
            if let Some(usage) = self.on_frame(frame) {
                found = found.or(self.report(usage));
            }
            if self.corrupt {
                return found;
            }
        }
        if broken {
            self.mark_corrupt();
        }
        found
    }

    fn on_frame(&mut self, frame: &Frame) -> Option<Usage> {
        match frame.message_type.as_str() {
            "event" => {}
            "exception" | "error" => {
                self.exception.get_or_insert_with(|| frame.kind.clone());
                return None;
            }
            _ => return None,
        }
        let result = match (self.kind, frame.kind.as_str()) {
            (ResponseKind::ConverseStream, "contentBlockDelta") => {
                serde_json::from_slice::<Value>(&frame.payload).map(|v| {
                    self.add_output(delta_text_len(v.get("delta")));
                    None
                })
            }
            (ResponseKind::ConverseStream, "messageStop") => {
                serde_json::from_slice::<Value>(&frame.payload).map(|v| {
                    self.stop_reason = v
                        .get("stopReason")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    None
                })
            }
            (ResponseKind::ConverseStream, "metadata") => {
                serde_json::from_slice::<Value>(&frame.payload)
                    .map(|v| v.get("usage").and_then(|u| usage_in(u, &CONVERSE_KEYS)))
            }
            (ResponseKind::InvokeModelStream, "chunk") => return self.on_chunk(&frame.payload),
            (ResponseKind::BidirectionalStream, "chunk") => {
                self.on_session_chunk(&frame.payload);
                return None;
            }
            _ => Ok(None),
        };
        result.unwrap_or_else(|_| {
            self.mark_corrupt();
            None
        })
    }

    /// One InvokeModelWithResponseStream `chunk`: `{"bytes": "<base64 of model-native JSON>"}`.
    fn on_chunk(&mut self, payload: &[u8]) -> Option<Usage> {
        let Some(decoded) = decode_chunk(payload) else {
            self.mark_corrupt();
            return None;
        };
        match serde_json::from_slice::<Value>(&decoded) {
            Ok(event) => {
                self.add_output(native_delta_len(&event));
                event
                    .get(INVOCATION_METRICS)
                    .and_then(|m| usage_in(m, &METRICS_KEYS))
            }
            // Not JSON: count the raw bytes as output, there is nothing else to read.
            Err(_) => {
                self.add_output(decoded.len() as u64);
                None
            }
        }
    }

    /// One bidirectional stream `chunk`: `{"bytes": "<base64 of a Nova Sonic event>"}`.
    fn on_session_chunk(&mut self, payload: &[u8]) {
        let event = decode_chunk(payload).and_then(|d| serde_json::from_slice::<Value>(&d).ok());
        let Some(event) = event else {
            self.mark_corrupt();
            return;
        };
        let Some(event) = event.get("event") else {
            return;
        };
        if let Some(text) = event.pointer("/textOutput/content").and_then(Value::as_str) {
            self.add_output(text.len() as u64);
        }
        if let Some(totals) = event
            .get("usageEvent")
            .and_then(|u| usage_in(u, &SESSION_KEYS))
        {
            self.output_seen = self.output_seen.max(totals.output_tokens);
            self.running = Some(totals);
        }
    }

    fn add_output(&mut self, text_bytes: u64) {
        self.output_seen = self.output_seen.saturating_add(text_bytes.div_ceil(4));
    }

    fn mark_corrupt(&mut self) {
        self.corrupt = true;
        self.frames = FrameReader::new();
        self.events = SseReader::new();
        self.body = BoundedBody::default();
    }
}

// === Body copies ===

/// A copy of the body up to [`BODY_CAP`]; past the cap it is dropped for good.
#[derive(Debug, Default)]
pub(crate) struct BoundedBody {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl BoundedBody {
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        if self.overflowed {
            return;
        }
        if self.bytes.len().saturating_add(chunk.len()) > BODY_CAP {
            self.overflowed = true;
            self.bytes = Vec::new();
            return;
        }
        self.bytes.extend_from_slice(chunk);
    }

    /// The whole body, or `None` if it outgrew the cap.
    pub(crate) fn take(&mut self) -> Option<Vec<u8>> {
        if self.overflowed {
            return None;
        }
        Some(std::mem::take(&mut self.bytes))
    }
}

// === Usage shapes ===

/// Where one usage shape keeps its four counts. Cache counts are optional (0 when absent);
/// each lists the names it goes by.
pub(crate) struct UsageKeys {
    input: &'static str,
    output: &'static str,
    cache_read: &'static [&'static str],
    cache_write: &'static [&'static str],
}

/// Converse `usage`, and Nova's model-native `usage` (which names its cache counts `...Count`).
const CONVERSE_KEYS: UsageKeys = UsageKeys {
    input: "inputTokens",
    output: "outputTokens",
    cache_read: &["cacheReadInputTokens", "cacheReadInputTokenCount"],
    cache_write: &["cacheWriteInputTokens", "cacheWriteInputTokenCount"],
};
const METRICS_KEYS: UsageKeys = UsageKeys {
    input: "inputTokenCount",
    output: "outputTokenCount",
    cache_read: &["cacheReadInputTokenCount"],
    cache_write: &["cacheWriteInputTokenCount"],
};
/// Nova Sonic's `usageEvent`: running totals of the session (speech and text together).
const SESSION_KEYS: UsageKeys = UsageKeys {
    input: "totalInputTokens",
    output: "totalOutputTokens",
    cache_read: &[],
    cache_write: &[],
};
const ANTHROPIC_KEYS: UsageKeys = UsageKeys {
    input: "input_tokens",
    output: "output_tokens",
    cache_read: &["cache_read_input_tokens"],
    cache_write: &["cache_creation_input_tokens"],
};
pub(crate) const OPENAI_KEYS: UsageKeys = UsageKeys {
    input: "prompt_tokens",
    output: "completion_tokens",
    cache_read: &[],
    cache_write: &[],
};

/// Usage from an object holding `keys`; `None` unless input and output are both counts.
pub(crate) fn usage_in(object: &Value, keys: &UsageKeys) -> Option<Usage> {
    let count = |k: &str| object.get(k).and_then(Value::as_u64);
    let first = |names: &[&str]| names.iter().find_map(|k| count(k)).unwrap_or(0);
    Some(Usage {
        input_tokens: count(keys.input)?,
        output_tokens: count(keys.output)?,
        cache_read_input_tokens: first(keys.cache_read),
        cache_write_input_tokens: first(keys.cache_write),
    })
}

/// `X-Amzn-Bedrock-*-Token-Count` (HeaderMap lookups are case-insensitive).
fn header_usage(headers: &HeaderMap) -> Option<Usage> {
    let count = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    Some(Usage {
        input_tokens: count("x-amzn-bedrock-input-token-count")?,
        output_tokens: count("x-amzn-bedrock-output-token-count")?,
        cache_read_input_tokens: count("x-amzn-bedrock-cache-read-input-token-count").unwrap_or(0),
        cache_write_input_tokens: count("x-amzn-bedrock-cache-write-input-token-count")
            .unwrap_or(0),
    })
}

/// A Converse response, read for its `usage` only (serde skips the rest without building it).
#[derive(Deserialize)]
struct ConverseBody {
    usage: Option<Value>,
    #[serde(rename = "stopReason")]
    stop_reason: Option<String>,
}

/// The usage-bearing fields of every model-native InvokeModel response we know.
#[derive(Deserialize)]
struct NativeBody {
    usage: Option<Value>,
    prompt_token_count: Option<Value>,
    generation_token_count: Option<Value>,
    #[serde(rename = "inputTextTokenCount")]
    input_text_token_count: Option<Value>,
    results: Option<Value>,
    /// Anthropic, Llama, Mistral: `stop_reason`.
    stop_reason: Option<Value>,
    /// Nova: `stopReason`.
    #[serde(rename = "stopReason")]
    stop_reason_camel: Option<Value>,
    /// OpenAI-style: `choices[].finish_reason`.
    choices: Option<Value>,
}

impl NativeBody {
    /// Why the output stopped, in the family's own words (Titan: `results[0].completionReason`).
    fn stop_reason(&self) -> Option<String> {
        let first = |v: &Option<Value>, key: &str| {
            v.as_ref()?
                .as_array()?
                .first()?
                .get(key)?
                .as_str()
                .map(str::to_string)
        };
        let string = |v: &Option<Value>| v.as_ref()?.as_str().map(str::to_string);
        string(&self.stop_reason)
            .or_else(|| string(&self.stop_reason_camel))
            .or_else(|| first(&self.choices, "finish_reason"))
            .or_else(|| first(&self.results, "completionReason"))
    }

    fn usage(&self) -> Option<Usage> {
        // Anthropic, Nova, OpenAI-style: a `usage` object.
        let shapes = [&ANTHROPIC_KEYS, &CONVERSE_KEYS, &OPENAI_KEYS];
        let found = self
            .usage
            .as_ref()
            .and_then(|u| shapes.into_iter().find_map(|keys| usage_in(u, keys)));
        if found.is_some() {
            return found;
        }
        let count = |v: &Option<Value>| v.as_ref().and_then(Value::as_u64);
        // Llama: `prompt_token_count` and `generation_token_count` at the top.
        if let (Some(input), Some(output)) = (
            count(&self.prompt_token_count),
            count(&self.generation_token_count),
        ) {
            return Some(Usage {
                input_tokens: input,
                output_tokens: output,
                ..Usage::default()
            });
        }
        // Titan: input count at the top, one output count per result.
        let input = count(&self.input_text_token_count)?;
        let results = self.results.as_ref()?.as_array()?;
        let output = results
            .iter()
            .map(|r| r.get("tokenCount").and_then(Value::as_u64))
            .try_fold(0u64, |sum, n| n.map(|n| sum.saturating_add(n)))?;
        Some(Usage {
            input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        })
    }
}

#[derive(Deserialize)]
struct ChunkPayload {
    bytes: String,
}

/// The bytes a `chunk` event's `{"bytes": base64}` carries.
pub(super) fn decode_chunk(payload: &[u8]) -> Option<Vec<u8>> {
    let chunk = serde_json::from_slice::<ChunkPayload>(payload).ok()?;
    base64::engine::general_purpose::STANDARD
        .decode(chunk.bytes)
        .ok()
}

// === Output text ===

/// Text bytes in a Converse `delta` (or an Anthropic / Nova model-native delta).
pub(super) fn delta_text_len(delta: Option<&Value>) -> u64 {
    let Some(delta) = delta else { return 0 };
    text_len_at(
        delta,
        &[
            "/text",
            "/partial_json",
            "/thinking",
            "/toolUse/input",
            "/reasoningContent/text",
        ],
    )
}

/// Bytes of the strings found at `pointers` in `value`.
fn text_len_at(value: &Value, pointers: &[&str]) -> u64 {
    pointers
        .iter()
        .filter_map(|p| value.pointer(p).and_then(Value::as_str))
        .map(|s| s.len() as u64)
        .sum()
}

/// Nova model-native stream events that carry no output text.
const NOVA_NON_DELTA: &[&str] = &[
    "messageStart",
    "contentBlockStart",
    "contentBlockStop",
    "messageStop",
    "metadata",
];

/// Output text bytes in one decoded InvokeModelWithResponseStream chunk, by family.
fn native_delta_len(event: &Value) -> u64 {
    let str_len = |v: Option<&Value>| v.and_then(Value::as_str).map_or(0, |s| s.len() as u64);
    // Anthropic messages: `{"type": "content_block_delta", "delta": {...}}`, other types carry none.
    if let Some(kind) = event.get("type").and_then(Value::as_str) {
        return match kind {
            "content_block_delta" => delta_text_len(event.get("delta")),
            _ => 0,
        };
    }
    if let Some(block) = event.get("contentBlockDelta") {
        return delta_text_len(block.get("delta"));
    }
    // Llama `generation`, Titan `outputText`, Anthropic text completions `completion`, Cohere `text`.
    for key in ["generation", "outputText", "completion", "text"] {
        if let Some(s) = event.get(key).and_then(Value::as_str) {
            return s.len() as u64;
        }
    }
    if let Some(outputs) = event.get("outputs").and_then(Value::as_array) {
        return outputs.iter().map(|o| str_len(o.get("text"))).sum();
    }
    if let Some(choices) = event.get("choices").and_then(Value::as_array) {
        return choices.iter().map(choice_text_len).sum();
    }
    let quiet = NOVA_NON_DELTA.iter().any(|k| event.get(k).is_some())
        || event.get("event_type").is_some()
        || event.get(INVOCATION_METRICS).is_some();
    if quiet { 0 } else { string_bytes(event) }
}

/// OpenAI-style `choices[]`: streamed `delta.content` (and reasoning), or whole `text`/`message`.
pub(crate) fn choice_text_len(choice: &Value) -> u64 {
    text_len_at(
        choice,
        &[
            "/delta/content",
            "/delta/reasoning_content",
            "/delta/reasoning",
            "/text",
            "/message/content",
        ],
    )
}

/// Fallback for unknown shapes: the bytes of every string value (JSON syntax left out).
fn string_bytes(value: &Value) -> u64 {
    match value {
        Value::String(s) => s.len() as u64,
        Value::Array(items) => items.iter().map(string_bytes).sum(),
        Value::Object(map) => map.values().map(string_bytes).sum(),
        _ => 0,
    }
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
