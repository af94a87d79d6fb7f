//! Tests for `estimate.rs`.

use base64::Engine as _;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn converse(content: Value) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "inferenceConfig": {"maxTokens": 512, "temperature": 0.5, "stopSequences": ["END"]}
    })
}

fn est(body: &Value) -> u64 {
    estimate(Operation::Converse, body)
}

/// The estimate of `body`, checked to be the same walked parsed (`estimate_input_tokens`) and
/// walked raw in admission's one pass (`body::read`).
fn estimate(operation: Operation, body: &Value) -> u64 {
    let parsed = estimate_input_tokens(operation, body);
    let raw = serde_json::to_vec(body).expect("a Value serializes");
    match crate::admission::body::read(operation, None, &raw) {
        Ok(facts) => assert_eq!(facts.input_tokens, parsed, "raw and parsed differ: {body}"),
        // Admission reads objects only (and the parser refuses the deepest odd body).
        Err(e) => assert!(!body.is_object(), "{e}: {body}"),
    }
    parsed
}

#[test]
fn the_rule_is_overhead_plus_text_over_three() {
    // 12 bytes of text, one message: 16 + 4 + ceil(12 / 3).
    assert_eq!(
        est(&converse(json!([{"text": "hello world!"}]))),
        16 + 4 + 4
    );
    assert_eq!(
        est(&converse(json!([{"text": "hello world!!"}]))),
        16 + 4 + 5
    );
}

#[test]
fn monotone_in_text_size() {
    let mut last = 0;
    for n in [0, 1, 2, 3, 10, 100, 1_000, 10_000, 100_000] {
        let e = est(&converse(json!([{"text": "a".repeat(n)}])));
        assert!(e >= last, "{n} bytes gave {e}, less than {last}");
        last = e;
    }
    assert!(last >= 100_000 / 3);
}

#[test]
fn system_and_every_message_count() {
    let body = json!({
        "system": [{"text": "You are terse."}, {"cachePoint": {"type": "default"}}],
        "messages": [
            {"role": "user", "content": [{"text": "abc"}]},
            {"role": "assistant", "content": [{"text": "def"}]},
            {"role": "user", "content": [{"text": "ghi"}, {"cachePoint": {"type": "default"}}]}
        ]
    });
    // 14 + 9 bytes of text = 8 tokens; 3 messages; cache points add nothing.
    assert_eq!(est(&body), 16 + 3 * 4 + 8);
}

#[test]
fn images_count_a_fixed_amount_whatever_their_size() {
    let text_only = est(&converse(json!([{"text": "describe"}])));
    let big_png = b64(&vec![0x89; 1_000_000]);
    for source in [
        json!({"bytes": big_png}),
        json!({"s3Location": {"uri": "s3://b/k.png"}}),
    ] {
        let body = converse(json!([
            {"text": "describe"},
            {"image": {"format": "png", "source": source}}
        ]));
        assert_eq!(est(&body), text_only + IMAGE_TOKENS);
    }
}

#[test]
fn documents_count_their_decoded_size() {
    let pdf = vec![b'%'; 3_000];
    let body = converse(json!([
        {"document": {"format": "pdf", "name": "report", "source": {"bytes": b64(&pdf)}}},
        {"text": "summarize"}
    ]));
    let text_only = est(&converse(json!([{"text": "summarize"}])));
    // 3,000 decoded bytes plus the 6-byte name, over 3.
    assert_eq!(est(&body), 16 + 4 + (3_000u64 + 6 + 9).div_ceil(3));
    assert!(est(&body) > text_only + 999);
    let by_reference = converse(json!([
        {"document": {"format": "pdf", "name": "r", "source": {"s3Location": {"uri": "s3://b/k"}}}}
    ]));
    assert!(est(&by_reference) >= UNSIZED_DOCUMENT_TOKENS);
    let inline_text = converse(json!([
        {"document": {"format": "txt", "name": "n", "source": {"text": "x".repeat(300)}}}
    ]));
    assert_eq!(est(&inline_text), 16 + 4 + 301u64.div_ceil(3));
}

#[test]
fn tool_specs_tool_uses_and_results_count() {
    let tools = json!({"tools": [{"toolSpec": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "inputSchema": {"json": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    }}]});
    let mut body = converse(json!([{"text": "weather in Paris?"}]));
    let without = est(&body);
    body["toolConfig"] = tools.clone();
    let spec_len = tools.to_string().len() as u64;
    assert!(est(&body) >= without + spec_len / 3);

    let turn = json!({"messages": [
        {"role": "assistant", "content": [{"toolUse": {"toolUseId": "t1", "name": "get_weather",
            "input": {"city": "Paris"}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "status": "success",
            "content": [{"json": {"temp_c": 21, "sky": "clear"}}, {"text": "fine"}]}}]}
    ]});
    let e = est(&turn);
    assert!(e > 16 + 2 * 4 + 20, "{e}");
}

#[test]
fn guard_content_and_reasoning_text_count_signatures_do_not() {
    let guarded = converse(json!([{"guardContent": {"text": {"text": "x".repeat(30),
        "qualifiers": ["guard_content"]}}}]));
    assert!(est(&guarded) >= 16 + 4 + 10);
    let reasoning = json!({"messages": [{"role": "assistant", "content": [{"reasoningContent": {
        "reasoningText": {"text": "abc", "signature": "s".repeat(3_000)}}}]}]});
    assert_eq!(est(&reasoning), 16 + 4 + 1);
}

#[test]
fn anthropic_messages_invoke_body() {
    let body = json!({
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 1024,
        "system": "You are a helpful assistant.",
        "tools": [{"name": "lookup", "description": "Look a thing up.",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                    "data": b64(&vec![0xff; 200_000])}},
                {"type": "text", "text": "What is in this picture?", "cache_control": {"type": "ephemeral"}}
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "lookup",
                "input": {"q": "cat"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                "content": [{"type": "text", "text": "a cat"}]}]}
        ]
    });
    let e = estimate(Operation::InvokeModel, &body);
    assert!(e >= IMAGE_TOKENS + 3 * PER_MESSAGE_TOKENS + 24 / 3, "{e}");
    assert!(
        e < IMAGE_TOKENS + 200,
        "image bytes must not count as text: {e}"
    );
    let pdf = json!({"messages": [{"role": "user", "content": [{"type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": b64(&[1; 3_000])}}]}]});
    assert_eq!(estimate(Operation::InvokeModel, &pdf), 16 + 4 + 1_000);
}

#[test]
fn other_native_bodies() {
    let op = Operation::InvokeModelWithResponseStream;
    let llama = json!({"prompt": "a".repeat(300), "max_gen_len": 10, "images": [b64(&[0; 9_000])]});
    assert_eq!(estimate(op, &llama), 16 + 100 + IMAGE_TOKENS);
    let titan = json!({"inputText": "b".repeat(30), "textGenerationConfig": {"maxTokenCount": 5,
        "stopSequences": ["User:"]}});
    assert_eq!(estimate(op, &titan), 16 + 10);
    let data_url = format!("data:image/png;base64,{}", b64(&[7; 30_000]));
    let openai = json!({"model": "gpt-oss", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "c".repeat(9)},
        {"type": "image_url", "image_url": {"url": data_url}}]}]});
    assert_eq!(estimate(op, &openai), 16 + 4 + 3 + IMAGE_TOKENS);
}

#[test]
fn count_tokens_bodies_estimate_the_inner_document() {
    let inner = converse(json!([{"text": "d".repeat(90)}]));
    let wrapped = json!({"input": {"converse": inner}});
    assert_eq!(estimate(Operation::CountTokens, &wrapped), est(&inner));

    let native = json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 10,
        "messages": [{"role": "user", "content": "e".repeat(60)}]});
    let encoded = json!({"input": {"invokeModel": {"body": b64(native.to_string().as_bytes())}}});
    assert_eq!(
        estimate(Operation::CountTokens, &encoded),
        estimate(Operation::InvokeModel, &native)
    );
}

#[test]
fn odd_bodies_never_panic_and_give_at_least_one() {
    let mut deep = json!("leaf");
    for _ in 0..300 {
        deep = json!([deep]);
    }
    let odd = [
        Value::Null,
        json!(42),
        json!("just a string"),
        json!({"messages": "not an array"}),
        json!({"input": {"invokeModel": {"body": "%%% not base64"}}}),
        json!({"image": "not an object", "images": "one", "source": 3}),
        json!({"text": "data:;base64,"}),
        json!({"text": "data:image/png;base64"}),
        deep,
    ];
    for body in &odd {
        for op in [
            Operation::Converse,
            Operation::InvokeModel,
            Operation::CountTokens,
        ] {
            assert!(estimate(op, body) >= 1, "{op} {body}");
        }
    }
}

#[test]
fn decoded_len_matches_decoding() {
    for n in 0..20 {
        let data = vec![0u8; n];
        assert_eq!(decoded_len(&b64(&data)), n);
    }
}

proptest! {
    #[test]
    fn never_below_a_quarter_token_per_byte(
        texts in proptest::collection::vec("[ -~]{0,200}", 1..10),
    ) {
        let messages: Vec<Value> = texts
            .iter()
            .map(|t| json!({"role": "user", "content": [{"text": t}]}))
            .collect();
        let bytes: u64 = texts.iter().map(|t| t.len() as u64).sum();
        let body = json!({"messages": messages});
        prop_assert!(est(&body) >= bytes.div_ceil(4));
        prop_assert!(est(&body) >= 1);
    }

    #[test]
    fn more_text_never_lowers_the_estimate(a in "\\PC{0,100}", b in "\\PC{0,100}") {
        let one = est(&converse(json!([{"text": a}])));
        let two = est(&converse(json!([{"text": format!("{a}{b}")}])));
        prop_assert!(two >= one);
    }
}
