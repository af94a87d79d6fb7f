//! The usage observer on every response kind: headers, then body chunks, then the end. Stream
//! kinds get real event-stream frames with fuzzed event types and payloads (plus garbage), so the
//! JSON inside frames is fuzzed too; the OpenAI and Anthropic APIs' streams get SSE events
//! (`event:` names of theirs, fuzzed `data:`); plain kinds get the fuzzed bytes as the body.
//!
//! Properties: never panics; usage is reported at most once; output seen never decreases.

#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tokengate::bedrock::{Operation, UsageObserver, eventstream::event_frame, usage::ResponseKind};

const EVENTS: [&str; 8] = [
    "messageStart",
    "contentBlockStart",
    "contentBlockDelta",
    "contentBlockStop",
    "messageStop",
    "metadata",
    "chunk",
    "somethingNew",
];

/// SSE event names of the OpenAI Responses and Anthropic Messages streams (Chat Completions
/// names none).
const SSE_EVENTS: [&str; 8] = [
    "",
    "message_start",
    "content_block_delta",
    "message_delta",
    "message_stop",
    "response.output_text.delta",
    "response.completed",
    "error",
];

const HEADERS: [&str; 4] = [
    "x-amzn-bedrock-input-token-count",
    "x-amzn-bedrock-output-token-count",
    "x-amzn-bedrock-cache-read-input-token-count",
    "x-amzn-bedrock-cache-write-input-token-count",
];

#[derive(Arbitrary, Debug)]
struct Input {
    operation: u8,
    headers: Vec<(u8, String)>,
    /// Stream kinds: (event type index, payload) frames; plain kinds: the payloads, joined.
    events: Vec<(u8, Vec<u8>)>,
    tail: Vec<u8>,
    splits: Vec<u16>,
}

fuzz_target!(|input: Input| {
    let operation = [
        Operation::Converse,
        Operation::ConverseStream,
        Operation::InvokeModel,
        Operation::InvokeModelWithResponseStream,
        Operation::OpenAIChatCompletions,
        Operation::OpenAIResponses,
        Operation::AnthropicMessages,
        Operation::InvokeModelWithBidirectionalStream,
    ][usize::from(input.operation % 8)];
    // The OpenAI and Anthropic APIs stream when the response says SSE.
    let mut response_headers = HeaderMap::new();
    if input.operation & 0x80 != 0 {
        response_headers.insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
    }
    let Some(kind) = ResponseKind::for_response(operation, &response_headers) else {
        return;
    };
    let sse = matches!(
        kind,
        ResponseKind::ChatStream | ResponseKind::ResponsesStream | ResponseKind::MessagesStream
    );
    let stream = matches!(
        kind,
        ResponseKind::ConverseStream
            | ResponseKind::InvokeModelStream
            | ResponseKind::BidirectionalStream
    );
    let mut body = Vec::new();
    for (event, payload) in &input.events {
        if stream {
            body.extend_from_slice(&event_frame(
                EVENTS[usize::from(*event) % EVENTS.len()],
                payload,
            ));
        } else if sse {
            let name = SSE_EVENTS[usize::from(*event) % SSE_EVENTS.len()];
            if !name.is_empty() {
                body.extend_from_slice(format!("event: {name}\n").as_bytes());
            }
            body.extend_from_slice(b"data: ");
            body.extend_from_slice(payload);
            body.extend_from_slice(b"\n\n");
        } else {
            body.extend_from_slice(payload);
        }
    }
    body.extend_from_slice(&input.tail);

    let mut headers = HeaderMap::new();
    for (name, value) in &input.headers {
        if let Ok(value) = HeaderValue::from_str(value) {
            let name = HeaderName::from_static(HEADERS[usize::from(*name) % HEADERS.len()]);
            headers.append(name, value);
        }
    }

    let mut observer = UsageObserver::new(kind);
    let mut reported = usize::from(observer.on_headers(&headers).is_some());
    let mut seen = observer.output_tokens_seen();
    let mut rest = &body[..];
    let mut splits = input.splits.iter().cycle();
    while !rest.is_empty() {
        let n = splits
            .next()
            .map_or(rest.len(), |s| usize::from(*s).max(1))
            .min(rest.len());
        reported += usize::from(observer.on_data(&rest[..n]).is_some());
        rest = &rest[n..];
        assert!(
            observer.output_tokens_seen() >= seen,
            "output seen went down"
        );
        seen = observer.output_tokens_seen();
    }
    reported += usize::from(observer.on_end().is_some());
    assert!(reported <= 1, "usage reported {reported} times");
    let _ = (
        observer.stream_exception(),
        observer.is_corrupt(),
        observer.usage(),
        observer.stop_reason(),
        observer.truncated(),
        observer.running_usage(),
    );
});
