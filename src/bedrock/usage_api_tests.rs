//! The usage observer on the OpenAI and Anthropic APIs' responses: JSON bodies and SSE streams,
//! fed at arbitrary chunk boundaries.

use http::{HeaderMap, HeaderValue};
use serde_json::json;

use crate::bedrock::{
    Operation, Usage, UsageObserver,
    usage::{ResponseKind, TRUNCATED_STOP_REASONS},
};

fn usage(input: u64, output: u64, cache_read: u64, cache_write: u64) -> Usage {
    Usage::counts(input, output, cache_read, cache_write)
}

/// Feeds `stream` one byte at a time (every boundary); the usage and when it was reported.
fn feed_bytewise(kind: ResponseKind, stream: &str) -> (UsageObserver, Option<Usage>, usize) {
    let mut o = UsageObserver::new(kind);
    let mut found = None;
    let mut at = 0;
    for (i, byte) in stream.as_bytes().iter().enumerate() {
        if let Some(u) = o.on_data(&[*byte]) {
            assert!(found.is_none(), "usage reported twice");
            found = Some(u);
            at = i + 1;
        }
    }
    if let Some(u) = o.on_end() {
        assert!(found.is_none(), "usage reported twice");
        found = Some(u);
        at = stream.len();
    }
    (o, found, at)
}

fn sse(events: &[(&str, serde_json::Value)]) -> String {
    events
        .iter()
        .map(|(name, data)| match name {
            &"" => format!("data: {data}\n\n"),
            name => format!("event: {name}\ndata: {data}\n\n"),
        })
        .collect()
}

#[test]
fn the_kind_follows_the_content_type() {
    let mut sse = HeaderMap::new();
    sse.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    let json = HeaderMap::new();
    for (op, streamed, whole) in [
        (
            Operation::OpenAIChatCompletions,
            ResponseKind::ChatStream,
            ResponseKind::ChatJson,
        ),
        (
            Operation::OpenAIResponses,
            ResponseKind::ResponsesStream,
            ResponseKind::ResponsesJson,
        ),
        (
            Operation::AnthropicMessages,
            ResponseKind::MessagesStream,
            ResponseKind::MessagesJson,
        ),
    ] {
        assert_eq!(ResponseKind::for_response(op, &sse), Some(streamed));
        assert_eq!(ResponseKind::for_response(op, &json), Some(whole));
    }
    assert_eq!(
        ResponseKind::for_response(Operation::Converse, &sse),
        Some(ResponseKind::ConverseJson)
    );
}

#[test]
fn json_bodies_give_usage_and_stop_reason_at_the_end() {
    let chat = json!({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
                  "prompt_tokens_details": {"cached_tokens": 10}}});
    let responses = json!({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "output": [], "usage": {"input_tokens": 12, "output_tokens": 4, "total_tokens": 16,
                               "input_tokens_details": {"cached_tokens": 0}}});
    let messages = json!({"type": "message", "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}});
    for (kind, body, expected, stop) in [
        (ResponseKind::ChatJson, chat, usage(20, 5, 10, 0), "length"),
        (
            ResponseKind::ResponsesJson,
            responses,
            usage(12, 4, 0, 0),
            "max_output_tokens",
        ),
        (
            ResponseKind::MessagesJson,
            messages,
            usage(7, 3, 100, 20),
            "end_turn",
        ),
    ] {
        let (o, found, _) = feed_bytewise(kind, &body.to_string());
        assert_eq!(found, Some(expected), "{kind:?}");
        assert_eq!(o.stop_reason(), Some(stop), "{kind:?}");
        assert_eq!(o.truncated(), TRUNCATED_STOP_REASONS.contains(&stop));
    }
}

#[test]
fn a_chat_stream_settles_on_its_usage_chunk() {
    let stream = sse(&[
        (
            "",
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}], "usage": null}),
        ),
        (
            "",
            json!({"choices": [{"index": 0, "delta": {"content": "12345678"}, "finish_reason": null}], "usage": null}),
        ),
        (
            "",
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}, "finish_reason": null}]}),
        ),
        (
            "",
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": null}),
        ),
        (
            "",
            json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
        ),
    ]) + "data: [DONE]\n\n";
    let (o, found, at) = feed_bytewise(ResponseKind::ChatStream, &stream);
    assert_eq!(found, Some(usage(9, 4, 0, 0)));
    assert_eq!(
        at,
        stream.len() - "data: [DONE]\n\n".len(),
        "settled with the usage chunk"
    );
    // "12345678" is two tokens of output, the arguments `{"a":1}` two more.
    assert_eq!(o.output_tokens_seen(), 4);
    assert_eq!((o.stop_reason(), o.truncated()), (Some("stop"), false));
}

#[test]
fn a_responses_stream_settles_on_its_last_event() {
    let stream = sse(&[
        (
            "response.created",
            json!({"type": "response.created", "response": {"status": "in_progress", "usage": null}}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "delta": "abcdefgh"}),
        ),
        (
            "response.output_text.done",
            json!({"type": "response.output_text.done", "text": "abcdefgh"}),
        ),
        (
            "response.incomplete",
            json!({"type": "response.incomplete", "response": {"status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "usage": {"input_tokens": 20, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 5}}}}),
        ),
    ]);
    let (o, found, at) = feed_bytewise(ResponseKind::ResponsesStream, &stream);
    assert_eq!(found, Some(usage(15, 2, 5, 0)));
    assert_eq!(at, stream.len());
    assert_eq!(o.output_tokens_seen(), 2);
    assert!(o.truncated());
}

#[test]
fn a_messages_stream_takes_the_last_cumulative_output() {
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 25, "output_tokens": 1,
                "cache_read_input_tokens": 50, "cache_creation_input_tokens": 0}}}),
        ),
        ("ping", json!({"type": "ping"})),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "abcd"}}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": null}, "usage": {"output_tokens": 6}}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 11}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let stream = sse(&events);
    let (o, found, at) = feed_bytewise(ResponseKind::MessagesStream, &stream);
    assert_eq!(found, Some(usage(25, 11, 50, 0)));
    assert_eq!(at, stream.len(), "settled at message_stop");
    assert_eq!((o.stop_reason(), o.truncated()), (Some("max_tokens"), true));
    assert_eq!(o.output_tokens_seen(), 1);

    // No message_stop: the last message_delta's output, at the end.
    let cut = sse(&events[..4]);
    let (_, found, at) = feed_bytewise(ResponseKind::MessagesStream, &cut);
    assert_eq!((found, at), (Some(usage(25, 6, 50, 0)), cut.len()));
    // No message_delta: no usage (the stream is settled by the output seen).
    let (o, found, _) = feed_bytewise(ResponseKind::MessagesStream, &sse(&events[..3]));
    assert_eq!((found, o.output_tokens_seen()), (None, 1));
}

#[test]
fn errors_in_a_stream_are_noted_and_garbage_never_panics() {
    let stream = sse(&[(
        "error",
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
    )]);
    let (o, found, _) = feed_bytewise(ResponseKind::MessagesStream, &stream);
    assert_eq!(
        (found, o.stream_exception()),
        (None, Some("overloaded_error"))
    );
    for kind in [
        ResponseKind::ChatStream,
        ResponseKind::ResponsesStream,
        ResponseKind::MessagesStream,
        ResponseKind::ChatJson,
    ] {
        let (o, found, _) = feed_bytewise(kind, "data: {\"usage\": 3}\n\n\u{0}\u{ff}garbage {[");
        assert_eq!(found, None, "{kind:?}");
        assert_eq!(o.stop_reason(), None);
    }
}
