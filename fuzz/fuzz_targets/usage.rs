//! The usage observer on every response kind: headers, then body chunks, then the end. Stream
//! kinds get real event-stream frames with fuzzed event types and payloads (plus garbage), so the
//! JSON inside frames is fuzzed too; plain kinds get the fuzzed bytes as the body.
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
        Operation::InvokeModelWithBidirectionalStream,
    ][usize::from(input.operation % 5)];
    let Some(kind) = ResponseKind::for_operation(operation) else {
        return;
    };
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
        observer.running_usage(),
    );
});
