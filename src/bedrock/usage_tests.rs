//! Tests for `usage.rs`: one section per response kind, then splitting and corruption.
//!
//! (Long: one section per response kind.)

use base64::Engine as _;
use http::{HeaderMap, HeaderValue};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::bedrock::ErrorCode;
use crate::bedrock::eventstream::{event_frame, exception_frame};

fn usage(input: u64, output: u64, cache_read: u64, cache_write: u64) -> Usage {
    Usage::counts(input, output, cache_read, cache_write)
}

/// Feeds `parts` in order and returns (index of the call that returned usage, that usage).
fn feed(observer: &mut UsageObserver, parts: &[&[u8]]) -> Vec<(usize, Usage)> {
    let mut found = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if let Some(u) = observer.on_data(part) {
            found.push((i, u));
        }
    }
    if let Some(u) = observer.on_end() {
        found.push((parts.len(), u));
    }
    found
}

fn event(kind: &str, payload: &Value) -> Vec<u8> {
    event_frame(kind, payload.to_string().as_bytes()).to_vec()
}

/// A realistic ConverseStream: text deltas (with Bedrock's `p` padding), a tool-use delta, stop,
/// metadata. Returns the frames.
fn converse_stream_frames(texts: &[&str]) -> Vec<Vec<u8>> {
    let mut frames = vec![event(
        "messageStart",
        &json!({"role": "assistant", "p": "abcd"}),
    )];
    for t in texts {
        frames.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": t}, "p": "abcdefghijklmnop"}),
        ));
    }
    frames.push(event(
        "contentBlockStop",
        &json!({"contentBlockIndex": 0, "p": "ab"}),
    ));
    frames.push(event(
        "messageStop",
        &json!({"stopReason": "end_turn", "p": "abc"}),
    ));
    frames.push(event(
        "metadata",
        &json!({
            "usage": {"inputTokens": 25, "outputTokens": 12, "totalTokens": 37,
                      "cacheReadInputTokens": 100, "cacheWriteInputTokens": 7},
            "metrics": {"latencyMs": 412},
            "p": "abcdefg"
        }),
    ));
    frames
}

fn chunk(event: &Value) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(event.to_string());
    event_frame(
        "chunk",
        json!({"bytes": b64, "p": "abcdef"}).to_string().as_bytes(),
    )
    .to_vec()
}

fn metrics(input: u64, output: u64) -> Value {
    json!({"inputTokenCount": input, "outputTokenCount": output,
           "invocationLatency": 900, "firstByteLatency": 200,
           "cacheReadInputTokenCount": 3, "cacheWriteInputTokenCount": 4})
}

/// Anthropic messages over InvokeModelWithResponseStream.
fn anthropic_stream_frames(texts: &[&str]) -> Vec<Vec<u8>> {
    let mut frames = vec![
        chunk(
            &json!({"type": "message_start", "message": {"id": "msg_01", "type": "message",
            "role": "assistant", "model": "claude-3-haiku", "content": [],
            "usage": {"input_tokens": 30, "output_tokens": 1}}}),
        ),
        chunk(&json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}})),
    ];
    for t in texts {
        frames.push(chunk(&json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": t}})));
    }
    frames.push(chunk(&json!({"type": "content_block_stop", "index": 0})));
    frames.push(chunk(&json!({"type": "message_delta",
        "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}})));
    frames.push(chunk(
        &json!({"type": "message_stop", INVOCATION_METRICS: metrics(30, 9)}),
    ));
    frames
}

// === Usage arithmetic ===

#[test]
fn charge_counts_cache_writes_and_burndown_but_not_cache_reads() {
    let u = usage(1000, 200, 5000, 300);
    assert_eq!(u.charge(1), 1000 + 300 + 200);
    assert_eq!(u.charge(5), 1000 + 300 + 200 * 5);
    assert_eq!(usage(u64::MAX, 1, 0, 1).charge(5), u64::MAX);
}

#[test]
fn kinds_follow_operations() {
    assert_eq!(
        ResponseKind::for_operation(Operation::ConverseStream),
        Some(ResponseKind::ConverseStream)
    );
    assert_eq!(ResponseKind::for_operation(Operation::CountTokens), None);
    assert_eq!(
        ResponseKind::for_operation(Operation::InvokeModelWithBidirectionalStream),
        Some(ResponseKind::BidirectionalStream)
    );
}

// === The bidirectional stream ===

/// A Nova Sonic output event, as a `chunk`.
fn sonic(name: &str, body: Value) -> Vec<u8> {
    chunk(&json!({"event": {name: body}}))
}

fn usage_event(input: u64, output: u64) -> Vec<u8> {
    sonic(
        "usageEvent",
        json!({"totalInputTokens": input, "totalOutputTokens": output,
               "totalTokens": input + output, "details": {"delta": {}, "total": {}}}),
    )
}

#[test]
fn a_session_is_charged_its_last_running_totals_at_its_end() {
    let mut o = UsageObserver::new(ResponseKind::BidirectionalStream);
    let turn = [
        sonic("completionStart", json!({})),
        sonic("textOutput", json!({"content": "twelve bytes"})),
        usage_event(7, 20),
    ];
    for frame in &turn {
        assert_eq!(o.on_data(frame), None, "running totals settle nothing yet");
    }
    assert_eq!(o.running_usage(), Some(usage(7, 20, 0, 0)));
    assert_eq!(
        o.output_tokens_seen(),
        20,
        "the totals, not the 3 tokens of text"
    );
    for frame in [
        sonic("textOutput", json!({"content": "more"})),
        usage_event(13, 50),
    ] {
        assert_eq!(o.on_data(&frame), None);
    }
    assert_eq!(o.on_end(), Some(usage(13, 50, 0, 0)));
    assert_eq!(o.on_end(), None, "reported once");
}

#[test]
fn a_session_without_totals_or_cut_short_reports_what_it_can() {
    let mut o = UsageObserver::new(ResponseKind::BidirectionalStream);
    o.on_data(&sonic("textOutput", json!({"content": "eight by"})));
    assert_eq!(o.output_tokens_seen(), 2);
    o.on_data(&exception_frame(ErrorCode::Throttling, "Too many tokens"));
    assert_eq!(o.stream_exception(), Some("throttlingException"));
    assert_eq!(o.on_end(), None);

    // Corrupt after a usage event: the totals seen are kept, but are not the session's usage.
    let mut o = UsageObserver::new(ResponseKind::BidirectionalStream);
    o.on_data(&usage_event(5, 9));
    o.on_data(&event_frame("chunk", br#"{"bytes": "not base64!"}"#));
    assert!(o.is_corrupt());
    assert_eq!(o.running_usage(), Some(usage(5, 9, 0, 0)));
    assert_eq!(o.on_end(), None);
}

// === Converse JSON ===

#[test]
fn converse_json_usage_at_end() {
    let body = json!({
        "output": {"message": {"role": "assistant", "content": [{"text": "Hello there."}]}},
        "stopReason": "end_turn",
        "usage": {"inputTokens": 12, "outputTokens": 4, "totalTokens": 16,
                  "cacheReadInputTokens": 2048, "cacheWriteInputTokens": 10},
        "metrics": {"latencyMs": 250}
    })
    .to_string();
    let (a, b) = body.as_bytes().split_at(40);
    let mut o = UsageObserver::new(ResponseKind::ConverseJson);
    assert_eq!(o.on_headers(&HeaderMap::new()), None);
    assert_eq!(feed(&mut o, &[a, b]), vec![(2, usage(12, 4, 2048, 10))]);
    assert_eq!(o.on_end(), None, "usage is returned once");
    assert_eq!(o.output_tokens_seen(), (body.len() as u64).div_ceil(4));
}

#[test]
fn converse_json_without_cache_fields_defaults_them_to_zero() {
    let body = br#"{"usage":{"inputTokens":3,"outputTokens":5,"totalTokens":8}}"#;
    let mut o = UsageObserver::new(ResponseKind::ConverseJson);
    assert_eq!(feed(&mut o, &[body]), vec![(1, usage(3, 5, 0, 0))]);
}

#[test]
fn converse_json_past_the_cap_reports_nothing() {
    let mut o = UsageObserver::new(ResponseKind::ConverseJson);
    let filler = vec![b' '; 1024 * 1024];
    o.on_data(br#"{"usage":{"inputTokens":3,"outputTokens":5},"pad":""#);
    for _ in 0..9 {
        o.on_data(&filler);
    }
    o.on_data(br#""}"#);
    assert_eq!(o.on_end(), None);
    assert!(
        o.body.bytes.capacity() == 0,
        "the copy is dropped past the cap"
    );
}

#[test]
fn converse_json_that_is_not_json_is_corrupt() {
    let mut o = UsageObserver::new(ResponseKind::ConverseJson);
    assert_eq!(feed(&mut o, &[b"{\"usage\": {\"inputT"]), vec![]);
    assert!(o.is_corrupt());
}

// === ConverseStream ===

#[test]
fn converse_stream_usage_comes_with_the_metadata_frame() {
    let frames = converse_stream_frames(&["Hello", ", world! How are you today?"]);
    let parts: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    assert_eq!(o.on_headers(&HeaderMap::new()), None);
    let found = feed(&mut o, &parts);
    assert_eq!(found, vec![(parts.len() - 1, usage(25, 12, 100, 7))]);
    // "Hello" = 5 bytes -> 2; the second delta = 27 bytes -> 7. Padding is not output.
    assert_eq!(o.output_tokens_seen(), 2 + 7);
    assert_eq!(o.stream_exception(), None);
    assert!(!o.is_corrupt());
}

#[test]
fn converse_stream_metadata_split_across_calls_reports_on_the_last_piece() {
    let frames = converse_stream_frames(&["Hi"]);
    let last = frames.len() - 1;
    let (head, tail) = frames[last].split_at(frames[last].len() / 2);
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    for f in &frames[..last] {
        assert_eq!(o.on_data(f), None);
    }
    assert_eq!(o.on_data(head), None);
    assert_eq!(o.on_data(tail), Some(usage(25, 12, 100, 7)));
    assert_eq!(o.on_end(), None);
}

#[test]
fn converse_stream_counts_tool_use_and_reasoning_deltas() {
    let wire = [
        event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0,
            "delta": {"reasoningContent": {"text": "Let me think."}}}),
        ),
        event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 1,
            "delta": {"toolUse": {"input": "{\"city\": \"Paris\"}"}}}),
        ),
    ]
    .concat();
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    assert_eq!(o.on_data(&wire), None);
    assert_eq!(
        o.output_tokens_seen(),
        13u64.div_ceil(4) + 17u64.div_ceil(4)
    );
}

#[test]
fn converse_stream_exception_is_recorded() {
    let mut wire = converse_stream_frames(&["partial answer"])[..2].concat();
    wire.extend_from_slice(&exception_frame(ErrorCode::ModelStreamError, "boom"));
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    assert_eq!(o.on_data(&wire), None);
    assert_eq!(o.on_end(), None);
    assert_eq!(o.stream_exception(), Some("modelStreamErrorException"));
    assert_eq!(o.output_tokens_seen(), 4);
}

#[test]
fn corrupt_frames_stop_usage_but_keep_output_seen() {
    let frames = converse_stream_frames(&["abcdefgh"]);
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    o.on_data(&frames[..2].concat());
    let mut bad = frames[frames.len() - 1].clone();
    bad[20] ^= 0x55;
    assert_eq!(o.on_data(&bad), None);
    assert!(o.is_corrupt());
    assert_eq!(o.frames.pending(), 0, "buffers are dropped");
    assert_eq!(o.on_data(&frames[frames.len() - 1]), None, "stays corrupt");
    assert_eq!(o.output_tokens_seen(), 2);
}

#[test]
fn an_oversized_frame_is_corrupt_rather_than_buffered() {
    let payload = vec![b' '; FRAME_CAP + 1024];
    let wire = event_frame("metadata", &payload);
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    for piece in wire.chunks(1024 * 1024) {
        assert_eq!(o.on_data(piece), None);
    }
    assert!(o.is_corrupt());
    assert_eq!(o.frames.pending(), 0);
}

#[test]
fn undecodable_json_in_a_frame_is_corrupt() {
    let mut o = UsageObserver::new(ResponseKind::ConverseStream);
    assert_eq!(o.on_data(&event_frame("metadata", b"{not json")), None);
    assert!(o.is_corrupt());
}

#[test]
fn garbage_never_panics() {
    for kind in [
        ResponseKind::ConverseJson,
        ResponseKind::ConverseStream,
        ResponseKind::InvokeModel,
        ResponseKind::InvokeModelStream,
    ] {
        let mut o = UsageObserver::new(kind);
        assert_eq!(o.on_data(&[0xff; 64]), None);
        assert_eq!(o.on_data(&[0u8; 3]), None);
        assert_eq!(o.on_end(), None);
    }
}

// === InvokeModel ===

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.insert(*name, HeaderValue::from_static(value));
    }
    map
}

#[test]
fn invoke_model_headers_give_usage_at_once() {
    let h = headers(&[
        ("X-Amzn-Bedrock-Input-Token-Count", "120"),
        ("x-amzn-bedrock-output-token-count", "45"),
        ("X-AMZN-BEDROCK-CACHE-READ-INPUT-TOKEN-COUNT", "1000"),
        ("X-Amzn-Bedrock-Cache-Write-Input-Token-Count", "30"),
        ("X-Amzn-Bedrock-Invocation-Latency", "812"),
    ]);
    let mut o = UsageObserver::new(ResponseKind::InvokeModel);
    assert_eq!(o.on_headers(&h), Some(usage(120, 45, 1000, 30)));
    let body = br#"{"usage":{"input_tokens":1,"output_tokens":1}}"#;
    assert_eq!(feed(&mut o, &[body]), vec![], "usage is returned once");
    assert!(o.body.bytes.is_empty(), "no body copy once usage is known");
}

#[test]
fn invoke_model_needs_both_input_and_output_headers() {
    let mut o = UsageObserver::new(ResponseKind::InvokeModel);
    assert_eq!(
        o.on_headers(&headers(&[("x-amzn-bedrock-input-token-count", "12")])),
        None
    );
    let body = br#"{"prompt_token_count":12,"generation_token_count":3,"generation":"ok"}"#;
    assert_eq!(feed(&mut o, &[body]), vec![(1, usage(12, 3, 0, 0))]);
}

/// Model-native bodies of each family, read when the headers are missing.
#[test]
fn invoke_model_body_fallback_for_each_family() {
    let cases = [
        (
            "anthropic",
            json!({"id": "msg_1", "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 10, "output_tokens": 2,
                          "cache_creation_input_tokens": 50, "cache_read_input_tokens": 60}}),
            usage(10, 2, 60, 50),
        ),
        (
            "nova",
            json!({"output": {"message": {"role": "assistant", "content": [{"text": "Hi"}]}},
                "stopReason": "end_turn",
                "usage": {"inputTokens": 7, "outputTokens": 3, "totalTokens": 10,
                          "cacheReadInputTokenCount": 4, "cacheWriteInputTokenCount": 5}}),
            usage(7, 3, 4, 5),
        ),
        (
            "llama",
            json!({"generation": "Hi", "prompt_token_count": 8, "generation_token_count": 2,
                "stop_reason": "stop"}),
            usage(8, 2, 0, 0),
        ),
        (
            "titan",
            json!({"inputTextTokenCount": 6, "results": [
                {"tokenCount": 4, "outputText": "Hi", "completionReason": "FINISH"},
                {"tokenCount": 5, "outputText": "Yo", "completionReason": "FINISH"}]}),
            usage(6, 9, 0, 0),
        ),
        (
            "openai-style",
            json!({"id": "chatcmpl-1", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
                "usage": {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12}}),
            usage(11, 1, 0, 0),
        ),
    ];
    for (family, body, expected) in cases {
        let body = body.to_string();
        let mut o = UsageObserver::new(ResponseKind::InvokeModel);
        assert_eq!(o.on_headers(&HeaderMap::new()), None, "{family}");
        let (a, b) = body.as_bytes().split_at(body.len() / 3);
        assert_eq!(feed(&mut o, &[a, b]), vec![(2, expected)], "{family}");
    }
}

#[test]
fn invoke_model_body_without_usage_reports_nothing() {
    let mut o = UsageObserver::new(ResponseKind::InvokeModel);
    let body = br#"{"embedding":[0.1,0.2],"inputTextTokenCount":3}"#;
    assert_eq!(feed(&mut o, &[body]), vec![]);
    assert!(!o.is_corrupt());
}

// === InvokeModelWithResponseStream ===

#[test]
fn invoke_stream_anthropic_usage_from_invocation_metrics() {
    let frames = anthropic_stream_frames(&["Hello", " world"]);
    let parts: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    let mut o = UsageObserver::new(ResponseKind::InvokeModelStream);
    let found = feed(&mut o, &parts);
    assert_eq!(found, vec![(parts.len() - 1, usage(30, 9, 3, 4))]);
    assert_eq!(o.output_tokens_seen(), 2 + 2);
}

#[test]
fn invoke_stream_output_seen_for_each_family() {
    let cases = [
        (
            "nova",
            json!({"contentBlockDelta": {"delta": {"text": "12345678"}, "contentBlockIndex": 0}}),
            2,
        ),
        (
            "llama",
            json!({"generation": "123456789", "prompt_token_count": null}),
            3,
        ),
        (
            "titan",
            json!({"outputText": "1234", "index": 0, "totalOutputTextTokenCount": null}),
            1,
        ),
        (
            "mistral",
            json!({"outputs": [{"text": "12345", "stop_reason": null}]}),
            2,
        ),
        (
            "openai-style",
            json!({"choices": [{"index": 0, "delta": {"content": "123456789012"}}]}),
            3,
        ),
        (
            "nova-start",
            json!({"messageStart": {"role": "assistant"}}),
            0,
        ),
        ("generic", json!({"weird": {"field": "12345"}}), 2),
    ];
    for (family, event, expected) in cases {
        let mut o = UsageObserver::new(ResponseKind::InvokeModelStream);
        assert_eq!(o.on_data(&chunk(&event)), None, "{family}");
        assert_eq!(o.output_tokens_seen(), expected, "{family}");
    }
}

#[test]
fn invoke_stream_llama_final_chunk_carries_usage() {
    let wire = [
        chunk(&json!({"generation": "Hello", "prompt_token_count": 9,
            "generation_token_count": 1, "stop_reason": null})),
        chunk(&json!({"generation": "", "prompt_token_count": null,
            "generation_token_count": 2, "stop_reason": "stop",
            INVOCATION_METRICS: {"inputTokenCount": 9, "outputTokenCount": 2,
                "invocationLatency": 300, "firstByteLatency": 100}})),
    ];
    let mut o = UsageObserver::new(ResponseKind::InvokeModelStream);
    assert_eq!(o.on_data(&wire[0]), None);
    assert_eq!(o.on_data(&wire[1]), Some(usage(9, 2, 0, 0)));
}

#[test]
fn invoke_stream_bad_base64_is_corrupt() {
    let mut o = UsageObserver::new(ResponseKind::InvokeModelStream);
    assert_eq!(
        o.on_data(&event_frame("chunk", br#"{"bytes":"%%%"}"#)),
        None
    );
    assert!(o.is_corrupt());
}

#[test]
fn invoke_stream_exception_is_recorded() {
    let mut wire = anthropic_stream_frames(&["Hel"])[..3].concat();
    wire.extend_from_slice(&exception_frame(ErrorCode::Throttling, "slow down"));
    let mut o = UsageObserver::new(ResponseKind::InvokeModelStream);
    assert_eq!(o.on_data(&wire), None);
    assert_eq!(o.stream_exception(), Some("throttlingException"));
    assert_eq!(o.output_tokens_seen(), 1);
}

// === Arbitrary chunk boundaries ===

/// Splits `wire` at the given cut points (any order, duplicates allowed) and feeds it.
fn feed_split(kind: ResponseKind, wire: &[u8], cuts: &[usize]) -> (Vec<Usage>, u64, usize) {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    cuts.sort_unstable();
    let mut o = UsageObserver::new(kind);
    let (mut found, mut at, mut start) = (Vec::new(), 0, 0);
    for end in cuts.into_iter().chain([wire.len()]) {
        if let Some(u) = o.on_data(&wire[start..end]) {
            found.push(u);
            at = end;
        }
        start = end;
    }
    found.extend(o.on_end());
    (found, o.output_tokens_seen(), at)
}

proptest! {
    #[test]
    fn any_split_gives_the_same_usage_and_output_estimate(
        texts in proptest::collection::vec("[ -~]{0,40}|\\PC{0,10}", 0..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        anthropic in any::<bool>(),
    ) {
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let (kind, frames) = if anthropic {
            (ResponseKind::InvokeModelStream, anthropic_stream_frames(&texts))
        } else {
            (ResponseKind::ConverseStream, converse_stream_frames(&texts))
        };
        let wire = frames.concat();
        let whole = feed_split(kind, &wire, &[]);
        let split = feed_split(kind, &wire, &cuts);
        prop_assert_eq!(whole.0.len(), 1);
        prop_assert_eq!(&split.0, &whole.0);
        prop_assert_eq!(split.1, whole.1);
        let expected: u64 = texts.iter().map(|t| (t.len() as u64).div_ceil(4)).sum();
        prop_assert_eq!(split.1, expected);
        // Usage arrives with the call whose chunk completes the last frame, never earlier.
        let last_frame_start = wire.len() - frames[frames.len() - 1].len();
        prop_assert!(split.2 > last_frame_start);
        prop_assert_eq!(split.2, wire.len());
    }
}
