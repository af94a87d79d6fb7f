//! Tests for `body.rs`: the one-pass read agrees with the parsed-`Value` functions and with
//! independent references for both answers (the estimate's below, `maxTokens`'s in
//! `max_tokens_reference.rs`), and refuses exactly what `serde_json::from_slice::<Value>`
//! refuses, with the same message.
//!
//! (Long: one table of cases per body family, each checked against the oracle; split by family it
//! would repeat the harness.)

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::{
    admission::estimate::{IMAGE_TOKENS, estimate_input_tokens},
    bedrock::max_tokens::requested_max_tokens,
};

#[path = "max_tokens_reference.rs"]
mod max_tokens_reference;

use max_tokens_reference::Expected;

const OPERATIONS: [Operation; 4] = [
    Operation::Converse,
    Operation::InvokeModel,
    Operation::InvokeModelWithResponseStream,
    Operation::CountTokens,
];
const PROVIDERS: [Option<&str>; 8] = [
    None,
    Some("anthropic"),
    Some("amazon"),
    Some("meta"),
    Some("ai21"),
    Some("mistral"),
    Some("cohere"),
    Some("someone-new"),
];

/// `read` of `text` against the parsed-`Value` functions and the independent oracles of the
/// estimate ([`reference`]) and of `maxTokens` ([`max_tokens_reference`]), for every operation
/// and provider.
fn check_agrees(text: &str) {
    let parsed: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => panic!("not JSON: {e}: {text}"),
    };
    for operation in OPERATIONS {
        for provider in PROVIDERS {
            let raw = read(operation, provider, text.as_bytes());
            if !parsed.is_object() {
                assert!(matches!(raw, Err(BodyError::NotObject)), "{raw:?}: {text}");
                continue;
            }
            let input_tokens = reference::estimate_input_tokens(operation, &parsed);
            assert_eq!(
                estimate_input_tokens(operation, &parsed),
                input_tokens,
                "{text}"
            );
            let expected =
                requested_max_tokens(operation, provider, &parsed).map(|max_tokens| BodyFacts {
                    max_tokens,
                    input_tokens,
                    api: None,
                    service_tier: matches!(
                        operation,
                        Operation::Converse | Operation::ConverseStream
                    )
                    .then(|| parsed.get("serviceTier").and_then(tier_type))
                    .flatten(),
                });
            let oracle = max_tokens_reference::max_tokens(operation, provider, &parsed);
            match (&expected, &oracle) {
                (Ok(facts), Expected::Absent) => assert_eq!(facts.max_tokens, None, "{text}"),
                (Ok(facts), Expected::Value(n)) => assert_eq!(facts.max_tokens, Some(*n), "{text}"),
                (Err(e), Expected::Unusable(field)) => assert_eq!(&e.field, field, "{text}"),
                (expected, oracle) => panic!(
                    "{operation} {provider:?}: {expected:?}, the reference says {oracle:?}: {text}"
                ),
            }
            match (raw, expected) {
                (Ok(raw), Ok(expected)) => {
                    assert_eq!(raw, expected, "{operation} {provider:?}: {text}")
                }
                (Err(BodyError::MaxTokens(raw)), Err(expected)) => assert_eq!(raw, expected),
                (raw, expected) => panic!("{raw:?} against {expected:?}: {text}"),
            }
        }
    }
}

/// `read` refuses `body` as `from_slice::<Value>` does, with the same message.
fn check_refused(body: &[u8]) {
    let expected = serde_json::from_slice::<Value>(body).expect_err("invalid JSON");
    match read(Operation::Converse, None, body) {
        Err(BodyError::NotJson(e)) => assert_eq!(e.to_string(), expected.to_string()),
        other => panic!("{other:?} for {}", String::from_utf8_lossy(body)),
    }
}

#[test]
fn members_in_the_order_clients_write_them() {
    // Anthropic and OpenAI clients write `type` first; a serialized `Value` writes it last.
    let image = r#"{"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "text", "text": "what is it?"}]}], "max_tokens": 100}"#;
    check_agrees(image);
    let facts = read(Operation::InvokeModel, Some("anthropic"), image.as_bytes());
    assert_eq!(
        facts.ok(),
        Some(BodyFacts {
            max_tokens: Some(100),
            input_tokens: 16 + 4 + IMAGE_TOKENS + 4,
            api: None,
            service_tier: None,
        })
    );
    for source in [
        r#"{"type": "text", "data": "abcdefghijkl"}"#,
        r#"{"data": "abcdefghijkl", "type": "text"}"#,
        r#"{"type": "base64", "data": "AAAAAAAA", "text": "ignored"}"#,
        r#"{"text": "counted", "type": "content"}"#,
        r#"{"content": [{"type": "text", "text": "abc"}], "type": "content"}"#,
        r#"{"bytes": null, "data": "AAAA", "text": "bytes decides"}"#,
        r#"{"type": "url", "url": "https://example.com/a.pdf"}"#,
        r#""not an object""#,
    ] {
        check_agrees(&format!(
            r#"{{"messages": [{{"role": "user", "content": [{{"type": "document", "source": {source}}}]}}]}}"#
        ));
        check_agrees(&format!(
            r#"{{"messages": [{{"role": "user", "content": [{{"source": {source}, "type": "document"}}]}}]}}"#
        ));
    }
    check_agrees(
        r#"{"source": {"bytes": "AAAA"}, "type": "image", "document": {"source": {"bytes": "AAAA"}, "name": "n"}}"#,
    );
    check_agrees(r#"{"document": {"name": "no source"}, "type": 3, "source": "walked"}"#);
}

#[test]
fn max_tokens_fields_in_every_place_and_form() {
    for body in [
        r#"{"inferenceConfig": {"maxTokens": 512, "temperature": 0.2}, "messages": []}"#,
        r#"{"messages": [], "inferenceConfig": {"max_new_tokens": 200}}"#,
        r#"{"inputText": "hi", "textGenerationConfig": {"maxTokenCount": 256}}"#,
        r#"{"textGenerationConfig": null, "inferenceConfig": {"maxTokens": 9}}"#,
        r#"{"inferenceConfig": [1, 2], "max_tokens": 5}"#,
        r#"{"max_tokens": 1024.0}"#,
        r#"{"max_tokens": null, "max_completion_tokens": 800}"#,
        r#"{"max_gen_len": "64", "max_tokens": -3}"#,
        r#"{"maxTokens": 7, "max_gen_len": 9, "max_tokens_to_sample": {"n": 1}}"#,
        r#"{"max_tokens": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#,
        r#"{"max_tokens": 2147483648, "inferenceConfig": {"maxTokens": 1e300}}"#,
        r#"{"max_tokens": [1], "inferenceConfig": {"maxTokens": true}}"#,
        r#"{"input": {"converse": {"inferenceConfig": {"maxTokens": 5}}}}"#,
    ] {
        check_agrees(body);
    }
}

/// A `maxTokens` field or config object named twice is refused, naming it: the proxy would
/// reserve one value while upstream might read the other.
#[test]
fn a_repeated_max_tokens_member_is_refused() {
    let refusal = |operation: Operation, provider: Option<&str>, body: &str| match read(
        operation,
        provider,
        body.as_bytes(),
    ) {
        Err(BodyError::MaxTokens(e)) => e.to_string(),
        other => panic!("{other:?} for {body}"),
    };
    let converse = |body: &str| refusal(Operation::Converse, None, body);
    assert_eq!(
        converse(r#"{"inferenceConfig": {"maxTokens": 60000, "maxTokens": 1}}"#),
        "inferenceConfig.maxTokens appears more than once in the body; send it once"
    );
    assert_eq!(
        converse(r#"{"inferenceConfig": {"maxTokens": 1}, "inferenceConfig": {"topP": 1}}"#),
        "inferenceConfig appears more than once in the body; send it once"
    );
    // Escaped names are the same names.
    assert_eq!(
        refusal(
            Operation::InvokeModel,
            Some("anthropic"),
            r#"{"max_tokens": 60000, "\u006dax_tokens": 1}"#
        ),
        "max_tokens appears more than once in the body; send it once"
    );
    assert!(
        refusal(
            Operation::InvokeModel,
            Some("amazon"),
            r#"{"inputText": "x", "textGenerationConfig": {}, "textGenerationConfig": {"maxTokenCount": 1}}"#
        )
        .starts_with("textGenerationConfig appears more than once")
    );
    // Other repeated members are not refused here (the estimate counts each copy).
    let fine = read(
        Operation::Converse,
        None,
        br#"{"system": [], "system": [], "inferenceConfig": {"maxTokens": 5}}"#,
    );
    assert_eq!(fine.ok().and_then(|f| f.max_tokens), Some(5));
    // A StartAsyncInvoke body names its model once.
    assert_eq!(
        async_invoke_model_id(br#"{"modelId": "a", "modelInput": {}}"#).ok(),
        Some(Some("a".to_string()))
    );
    assert!(async_invoke_model_id(br#"{"modelId": "a", "modelId": "b"}"#).is_err());
    assert_eq!(async_invoke_model_id(b"{}").ok(), Some(None));
}

#[test]
fn a_repeated_member_counts_each_time_for_the_estimate() {
    let body = r#"{"messages": [{"content": [{"text": "abc"}]}], "messages": [{"content": [{"text": "abc"}]}]}"#;
    let raw = read(Operation::Converse, None, body.as_bytes()).map(|facts| facts.input_tokens);
    let parsed: Value = serde_json::from_str(body).expect("JSON");
    assert_eq!(
        estimate_input_tokens(Operation::Converse, &parsed),
        16 + 4 + 1
    );
    assert_eq!(raw.ok(), Some(16 + 2 * 4 + 2), "over, never under");
}

#[test]
fn escaped_member_names_are_read_as_unescaped() {
    let body = r#"{"mess\u0061ges": [{"content": [{"te\u0078t": "abc"}]}], "inferenceConfig": {"max\u0054okens": 9}}"#;
    check_agrees(body);
    let facts = read(Operation::Converse, None, body.as_bytes()).ok();
    assert_eq!(
        facts,
        Some(BodyFacts {
            max_tokens: Some(9),
            input_tokens: 16 + 4 + 1,
            api: None,
            service_tier: None,
        })
    );
}

#[test]
fn tools_count_their_compact_serialized_length() {
    // Whitespace, escapes and number spellings as written do not count; the compact form does.
    for body in [
        r#"{"toolConfig": {"tools": [{"toolSpec": {"name": "w", "inputSchema": {"json": {"type": "object"}}}}]}}"#,
        r#"{"tools" : [ 1.50 , -0 , 1E2 , 12345678901234567890 , true , null , "\u00e9\n\"/" ] }"#,
        r#"{"messages": [{"content": [{"toolUse": {"input": {"b": [], "a": {}}, "name": "x"}}]}]}"#,
        r#"{"json": "a string", "input": "not an object", "image": "x", "video": [1]}"#,
    ] {
        check_agrees(body);
    }
}

#[test]
fn anything_but_an_object_is_refused_after_it_is_read() {
    for body in [
        "[]",
        "[1, {\"a\": 2}]",
        "1",
        "\"s\"",
        "null",
        "true",
        " 2.5 ",
    ] {
        assert!(
            matches!(
                read(Operation::Converse, None, body.as_bytes()),
                Err(BodyError::NotObject)
            ),
            "{body}"
        );
    }
    // Still invalid JSON first.
    check_refused(b"[1, 2");
    check_refused(b"\"s\" x");
}

#[test]
fn invalid_json_anywhere_is_refused_with_serde_jsons_message() {
    let cases: &[&[u8]] = &[
        b"",
        b"{",
        b"{\"messages\": [",
        b"{\"a\": }",
        b"{\"a\": 1,}",
        b"{} x",
        b"{\"role\": \"\xff\"}",
        b"{\"a\": } \"\xff\"",
        b"{\"text\": \"\xe2\x82\"}",
        b"{\"inferenceConfig\": {\"stopSequences\": [\"\xc3\"]}}",
        b"{\"role\": \"\\ud800\"}",
        b"{\"role\": \"\\x\"}",
        b"{\"role\": \"a\x01b\"}",
        b"{\"inferenceConfig\": {\"temperature\": 1e400}}",
        b"{\"tools\": [1e400]}",
        b"{\"images\": [01]}",
        b"{\"max_tokens\": tru}",
        b"{1: 2}",
    ];
    for body in cases {
        check_refused(body);
    }
}

#[test]
fn nesting_is_bounded_by_the_parsers_limit_never_the_stack() {
    let nested = |depth: usize, member: &str| {
        let open = "[".repeat(depth);
        let close = "]".repeat(depth);
        format!(r#"{{"{member}": {open}"text"{close}}}"#)
    };
    // The body object plus 126 arrays is the deepest serde_json parses.
    for member in [
        "messages", "role", "tools", "images", "document", "source", "x",
    ] {
        check_agrees(&nested(126, member));
        check_refused(nested(127, member).as_bytes());
    }
    check_refused("[".repeat(1_000_000).as_bytes());
    check_refused(format!("{{\"a\": {}", "{\"a\": ".repeat(100_000)).as_bytes());
}

#[test]
fn count_tokens_bodies_are_estimated_on_their_document() {
    let inner = json!({"messages": [{"role": "user", "content": [{"text": "d".repeat(90)}]}]});
    let body = json!({"input": {"converse": inner}}).to_string();
    let facts = read(Operation::CountTokens, None, body.as_bytes()).ok();
    assert_eq!(
        facts,
        Some(BodyFacts {
            max_tokens: None,
            input_tokens: 16 + 4 + 30,
            api: None,
            service_tier: None,
        })
    );
    check_agrees(r#"{"input": {"invokeModel": {"body": "bm90IGpzb24="}}}"#);
    check_agrees(r#"{"input": {"document": {"source": {"s3Location": {}}}}}"#);
}

// === generated bodies ===

/// A JSON document with members in a chosen order (a `Value` would sort them).
#[derive(Debug, Clone)]
enum Doc {
    Leaf(String),
    Array(Vec<Doc>),
    Object(Vec<(String, Doc)>),
}

impl Doc {
    fn render(&self, out: &mut String) {
        match self {
            Doc::Leaf(text) => out.push_str(text),
            Doc::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.render(out);
                }
                out.push(']');
            }
            Doc::Object(members) => {
                out.push('{');
                for (i, (key, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(key);
                    out.push_str(": ");
                    value.render(out);
                }
                out.push('}');
            }
        }
    }
}

/// Member names the rules look at, some written with an escape.
fn member_name() -> impl Strategy<Value = String> {
    const NAMES: &[&str] = &[
        "messages",
        "chat_history",
        "system",
        "content",
        "text",
        "role",
        "type",
        "source",
        "image",
        "video",
        "document",
        "images",
        "image_url",
        "inputImage",
        "tools",
        "toolConfig",
        "json",
        "input",
        "name",
        "bytes",
        "data",
        "format",
        "cachePoint",
        "inferenceConfig",
        "textGenerationConfig",
        "inputText",
        "maxTokens",
        "max_tokens",
        "max_new_tokens",
        "maxTokenCount",
        "max_gen_len",
        "max_completion_tokens",
        "max_tokens_to_sample",
        "prompt",
        "converse",
        "invokeModel",
        "body",
    ];
    prop_oneof![
        4 => proptest::sample::select(NAMES).prop_map(|n| format!("\"{n}\"")),
        1 => proptest::sample::select(NAMES).prop_map(|n| {
            let (first, rest) = n.split_at(1);
            format!("\"\\u{:04x}{rest}\"", u32::from(first.as_bytes()[0]))
        }),
        1 => "[a-z]{1,6}".prop_map(|n| format!("\"{n}\"")),
    ]
}

fn leaf() -> impl Strategy<Value = Doc> {
    const STRINGS: &[&str] = &[
        "image",
        "document",
        "text",
        "base64",
        "AAAA",
        "QUJDRA==",
        "data:image/png;base64,AAAA",
        "data:application/pdf;base64,QUJDREVGRw==",
        "data:;base64,",
        "",
        "é\\n\\u0041",
    ];
    prop_oneof![
        Just("null".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        (-5i64..3000).prop_map(|n| n.to_string()),
        proptest::sample::select(&["1024.0", "1e3", "2147483648", "-0", "0.5", "3E-2"][..])
            .prop_map(str::to_string),
        proptest::sample::select(STRINGS).prop_map(|s| format!("\"{s}\"")),
        "\\PC{0,12}".prop_map(|s| Value::String(s).to_string()),
    ]
    .prop_map(Doc::Leaf)
}

fn doc() -> impl Strategy<Value = Doc> {
    leaf().prop_recursive(5, 48, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Doc::Array),
            proptest::collection::vec((member_name(), inner), 0..5).prop_map(|members| {
                // Distinct names (after unescaping): a `Value` keeps one member per name.
                let mut seen = std::collections::HashSet::new();
                let members = members
                    .into_iter()
                    .filter(|(name, _)| {
                        seen.insert(serde_json::from_str::<String>(name).unwrap_or_default())
                    })
                    .collect();
                Doc::Object(members)
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn generated_bodies_read_as_their_parsed_value(
        members in proptest::collection::vec((member_name(), doc()), 0..6),
    ) {
        let mut seen = std::collections::HashSet::new();
        let members = members
            .into_iter()
            .filter(|(name, _)| seen.insert(serde_json::from_str::<String>(name).unwrap_or_default()))
            .collect();
        let mut text = String::new();
        Doc::Object(members).render(&mut text);
        check_agrees(&text);
    }
}

/// The estimate as it was computed before the one-pass read: a walk of a parsed `Value`, written
/// independently of the seeds in `estimate/walk.rs` (a copy of `estimate.rs` at 776fde8, trimmed).
/// The oracle both walks are checked against.
mod reference {
    use std::io;

    use base64::Engine as _;
    use serde_json::{Map, Value};

    use crate::{
        admission::estimate::{
            BYTES_PER_TOKEN, IMAGE_TOKENS, MAX_DEPTH, PER_MESSAGE_TOKENS, PER_REQUEST_TOKENS,
            UNSIZED_DOCUMENT_TOKENS, VIDEO_TOKENS,
        },
        bedrock::Operation,
    };

    pub fn estimate_input_tokens(operation: Operation, body: &Value) -> u64 {
        let mut tally = Tally::default();
        if operation == Operation::CountTokens {
            tally.count_tokens_input(body);
        } else {
            tally.walk(body, 0);
        }
        tally.tokens()
    }

    /// What the walk has counted so far.
    #[derive(Debug, Default)]
    struct Tally {
        text_bytes: u64,
        messages: u64,
        fixed_tokens: u64,
    }

    impl Tally {
        fn tokens(&self) -> u64 {
            PER_REQUEST_TOKENS
                .saturating_add(self.messages.saturating_mul(PER_MESSAGE_TOKENS))
                .saturating_add(self.text_bytes.div_ceil(BYTES_PER_TOKEN))
                .saturating_add(self.fixed_tokens)
        }

        fn add_text(&mut self, bytes: usize) {
            self.text_bytes = self.text_bytes.saturating_add(bytes as u64);
        }

        fn add_fixed(&mut self, tokens: u64) {
            self.fixed_tokens = self.fixed_tokens.saturating_add(tokens);
        }

        /// CountTokens: estimate the Converse document or the decoded InvokeModel body it wraps.
        fn count_tokens_input(&mut self, body: &Value) {
            let input = body.get("input");
            if let Some(converse) = input.and_then(|i| i.get("converse")) {
                return self.walk(converse, 0);
            }
            match input.and_then(|i| i.pointer("/invokeModel/body")) {
                Some(Value::String(encoded)) => self.encoded_body(encoded),
                Some(inner) => self.walk(inner, 0),
                None => self.walk(body, 0),
            }
        }

        /// A base64 InvokeModel body: walked as JSON if it is JSON, else counted as text.
        fn encoded_body(&mut self, encoded: &str) {
            let engine = &base64::engine::general_purpose::STANDARD;
            let Ok(bytes) = engine.decode(encoded) else {
                return self.add_text(encoded.len());
            };
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(inner) => self.walk(&inner, 0),
                Err(_) => self.add_text(bytes.len()),
            }
        }

        fn walk(&mut self, value: &Value, depth: usize) {
            if depth > MAX_DEPTH {
                return;
            }
            match value {
                Value::String(s) => self.string(s),
                Value::Array(items) => items.iter().for_each(|v| self.walk(v, depth + 1)),
                Value::Object(map) => self.object(map, depth + 1),
                Value::Number(_) | Value::Bool(_) | Value::Null => {}
            }
        }

        fn object(&mut self, map: &Map<String, Value>, depth: usize) {
            let kind = map.get("type").and_then(Value::as_str);
            for (key, value) in map {
                self.field(key, value, kind, depth);
            }
        }

        /// One member of an object; `kind` is the object's own `type` (Anthropic content blocks).
        fn field(&mut self, key: &str, value: &Value, kind: Option<&str>, depth: usize) {
            match key {
                // Not model input, or not text.
                "inferenceConfig"
                | "textGenerationConfig"
                | "cachePoint"
                | "cache_control"
                | "anthropic_version"
                | "anthropic_beta"
                | "requestMetadata"
                | "performanceConfig"
                | "guardrailConfig"
                | "additionalModelResponseFieldPaths"
                | "serviceTier"
                | "stopSequences"
                | "stop_sequences"
                | "stop"
                | "signature"
                | "model"
                | "role"
                | "type"
                | "format"
                | "media_type"
                | "s3Location"
                | "bucketOwner" => {}
                "messages" | "chat_history" => {
                    let count = value.as_array().map_or(0, Vec::len);
                    self.messages = self.messages.saturating_add(count as u64);
                    self.walk(value, depth);
                }
                "tools" | "toolConfig" | "json" => self.json(value),
                "input" if value.is_object() => self.json(value),
                "image" if value.is_object() => self.add_fixed(IMAGE_TOKENS),
                "video" if value.is_object() => self.add_fixed(VIDEO_TOKENS),
                "document" if value.is_object() => self.converse_document(value, depth),
                "source" if kind == Some("image") => self.add_fixed(IMAGE_TOKENS),
                "source" if kind == Some("document") => self.document_source(value, depth),
                "image_url" | "inputImage" => self.add_fixed(IMAGE_TOKENS),
                "images" => self.images(value),
                _ => self.walk(value, depth),
            }
        }

        /// Converse / Nova `document`: `name` plus its source.
        fn converse_document(&mut self, document: &Value, depth: usize) {
            if let Some(name) = document.get("name") {
                self.walk(name, depth);
            }
            match document.get("source") {
                Some(source) => self.document_source(source, depth),
                None => self.add_fixed(UNSIZED_DOCUMENT_TOKENS),
            }
        }

        /// A document source: inline bytes (Converse `bytes`, Anthropic `data`), inline text
        /// (`text`, `content`, an Anthropic `text` source), or a reference we cannot size.
        fn document_source(&mut self, source: &Value, depth: usize) {
            let text_source = source.get("type").and_then(Value::as_str) == Some("text");
            let inline = source.get("bytes").or_else(|| source.get("data"));
            if let Some(data) = inline.and_then(Value::as_str) {
                let bytes = if text_source {
                    data.len()
                } else {
                    decoded_len(data)
                };
                return self.add_text(bytes);
            }
            let mut found = false;
            for key in ["text", "content"] {
                if let Some(inner) = source.get(key) {
                    found = true;
                    self.walk(inner, depth);
                }
            }
            if !found {
                self.add_fixed(UNSIZED_DOCUMENT_TOKENS);
            }
        }

        /// Llama 3.2 `images: ["<base64>", ...]`, or a single image value.
        fn images(&mut self, value: &Value) {
            let count = value.as_array().map_or(1, Vec::len);
            self.add_fixed(IMAGE_TOKENS.saturating_mul(count as u64));
        }

        /// A string value: text, unless it is a `data:...;base64,` URL.
        fn string(&mut self, s: &str) {
            match data_url(s) {
                Some((media_type, _)) if media_type.starts_with("image/") => {
                    self.add_fixed(IMAGE_TOKENS)
                }
                Some((_, data)) => self.add_text(decoded_len(data)),
                None => self.add_text(s.len()),
            }
        }

        /// Structured input counted by its serialized length.
        fn json(&mut self, value: &Value) {
            let mut counter = ByteCounter(0);
            // Writing to a counter cannot fail; on the impossible error we keep what was counted.
            let _ = serde_json::to_writer(&mut counter, value);
            self.text_bytes = self.text_bytes.saturating_add(counter.0);
        }
    }

    /// `data:{media type};base64,{data}` split into its media type and data.
    fn data_url(s: &str) -> Option<(&str, &str)> {
        let rest = s.strip_prefix("data:")?;
        let head_len = rest.len().min(128);
        let head = rest.get(..head_len)?;
        let marker = head.find(";base64,")?;
        Some((&rest[..marker], &rest[marker + ";base64,".len()..]))
    }

    /// The decoded size of base64 text, without decoding it.
    fn decoded_len(data: &str) -> usize {
        let symbols = data.trim_end_matches('=').len();
        symbols / 4 * 3 + (symbols % 4) * 3 / 4
    }

    /// An `io::Write` that only counts.
    struct ByteCounter(u64);

    impl io::Write for ByteCounter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 = self.0.saturating_add(buf.len() as u64);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}

#[test]
fn the_openai_and_anthropic_apis_name_their_model_and_stream_in_the_body() {
    let chat =
        br#"{"model": "openai.gpt-oss-120b-1:0", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 64, "stream": true, "stream_options": {"include_usage": false}}"#;
    let facts = read(Operation::OpenAIChatCompletions, None, chat).unwrap();
    assert_eq!(facts.max_tokens, Some(64));
    assert_eq!(
        facts.api,
        Some(ApiBody {
            model: "openai.gpt-oss-120b-1:0".into(),
            stream: true,
            include_usage: Some(false),
        })
    );
    // The model is not input; the message is.
    let parsed: Value = serde_json::from_slice(chat).unwrap();
    assert_eq!(
        facts.input_tokens,
        reference::estimate_input_tokens(Operation::OpenAIChatCompletions, &parsed)
    );
    let arn = "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-sonnet-4-20250514-v1:0";
    let messages = json!({"model": arn, "max_tokens": 100, "messages": []}).to_string();
    let facts = read(Operation::AnthropicMessages, None, messages.as_bytes()).unwrap();
    let api = facts.api.unwrap();
    assert_eq!((api.model.as_str(), api.stream), (arn, false));
    assert_eq!(facts.max_tokens, Some(100));
    let responses = br#"{"model": "m%3A0", "input": "x", "max_output_tokens": 9}"#;
    let facts = read(Operation::OpenAIResponses, None, responses).unwrap();
    assert_eq!(facts.api.unwrap().model, "m%3A0", "no percent-decoding");
    assert_eq!(facts.max_tokens, Some(9));
    // Other operations read no model.
    let facts = read(Operation::Converse, None, chat).unwrap();
    assert_eq!(facts.api, None);
}

#[test]
fn api_fields_missing_repeated_or_mistyped_are_refused() {
    let field = |op, body: &str| match read(op, None, body.as_bytes()) {
        Err(BodyError::Field { field, problem }) => format!("{field} {problem}"),
        Err(BodyError::MaxTokens(e)) => e.to_string(),
        other => panic!("{other:?} for {body}"),
    };
    let chat = Operation::OpenAIChatCompletions;
    assert!(field(chat, r#"{"messages": []}"#).starts_with("model is required"));
    assert!(field(chat, r#"{"model": ""}"#).starts_with("model must be a non-empty string"));
    assert!(field(chat, r#"{"model": 3}"#).starts_with("model must be"));
    assert_eq!(
        field(chat, r#"{"model": "a", "model": "b"}"#),
        "model appears more than once in the body; send it once"
    );
    assert_eq!(
        field(chat, r#"{"model": "a", "stream": "yes"}"#),
        "stream must be true or false"
    );
    assert_eq!(
        field(chat, r#"{"model": "a", "stream": true, "stream": false}"#),
        "stream appears more than once in the body; send it once"
    );
    assert_eq!(
        field(chat, r#"{"model": "a", "stream_options": []}"#),
        "stream_options must be an object"
    );
    assert_eq!(
        field(
            chat,
            r#"{"model": "a", "stream_options": {"include_usage": 1}}"#
        ),
        "stream_options.include_usage must be true or false"
    );
    assert_eq!(
        field(
            Operation::OpenAIResponses,
            r#"{"model": "a", "max_output_tokens": 5, "max_output_tokens": 500}"#
        ),
        "max_output_tokens appears more than once in the body; send it once"
    );
    assert_eq!(
        field(
            Operation::AnthropicMessages,
            r#"{"model": "a", "max_tokens": 0}"#
        ),
        "max_tokens must be a positive integer, got 0"
    );
    // The Responses and Messages APIs do not read stream_options.
    assert!(
        read(
            Operation::AnthropicMessages,
            None,
            br#"{"model": "a", "stream_options": 1}"#
        )
        .is_ok()
    );
}

#[test]
fn api_caps_agree_with_the_reference() {
    let caps = [
        json!({}),
        json!({"max_completion_tokens": 80}),
        json!({"max_tokens": 70}),
        json!({"max_completion_tokens": 80, "max_tokens": 900}),
        json!({"max_completion_tokens": null, "max_tokens": 12}),
        json!({"max_completion_tokens": 8, "max_tokens": -1}),
        json!({"max_completion_tokens": "8", "max_tokens": 5}),
        json!({"max_output_tokens": 64.0}),
        json!({"max_output_tokens": 0}),
        json!({"max_tokens": 2147483648u64}),
    ];
    for op in [
        Operation::OpenAIChatCompletions,
        Operation::OpenAIResponses,
        Operation::AnthropicMessages,
    ] {
        for cap in &caps {
            let mut body = cap.clone();
            body["model"] = json!("m");
            body["messages"] = json!([{"role": "user", "content": "hi"}]);
            let oracle = max_tokens_reference::max_tokens(op, None, &body);
            let read = read(op, None, body.to_string().as_bytes());
            match (read, &oracle) {
                (Ok(facts), Expected::Absent) => assert_eq!(facts.max_tokens, None, "{op} {body}"),
                (Ok(facts), Expected::Value(n)) => {
                    assert_eq!(facts.max_tokens, Some(*n), "{op} {body}")
                }
                (Err(BodyError::MaxTokens(e)), Expected::Unusable(field)) => {
                    assert_eq!(&e.field, field, "{op} {body}")
                }
                (read, oracle) => panic!("{op} {body}: {read:?}, the reference says {oracle:?}"),
            }
        }
    }
}

#[test]
fn converse_names_its_service_tier_in_the_body_and_only_converse_is_read_for_it() {
    let body = br#"{"messages":[{"role":"user","content":[{"text":"hi"}]}],"serviceTier":{"type":"reserved"}}"#;
    for op in [Operation::Converse, Operation::ConverseStream] {
        let facts = read(op, Some("anthropic"), body).expect("reads");
        assert_eq!(facts.service_tier.as_deref(), Some("reserved"));
    }
    let without = br#"{"messages":[{"role":"user","content":[{"text":"hi"}]}]}"#;
    let facts = read(Operation::Converse, Some("anthropic"), without).expect("reads");
    assert_eq!(facts.service_tier, None);
    // Model-native bodies name the tier in a header, not the body.
    let native = br#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":5,"messages":[],"serviceTier":{"type":"flex"}}"#;
    let facts = read(Operation::InvokeModel, Some("anthropic"), native).expect("reads");
    assert_eq!(facts.service_tier, None);
}

#[test]
fn the_openai_and_anthropic_apis_name_their_tier_in_service_tier() {
    for (op, body, tier) in [
        (
            Operation::OpenAIChatCompletions,
            r#"{"model":"m","messages":[],"service_tier":"flex"}"#,
            Some("flex"),
        ),
        (
            Operation::OpenAIResponses,
            r#"{"model":"m","input":"hi","service_tier":"auto"}"#,
            Some("default"),
        ),
        (
            Operation::AnthropicMessages,
            r#"{"model":"m","max_tokens":5,"messages":[],"service_tier":"standard_only"}"#,
            Some("default"),
        ),
        (
            Operation::AnthropicMessages,
            r#"{"model":"m","max_tokens":5,"messages":[],"serviceTier":{"type":"flex"}}"#,
            None,
        ),
    ] {
        let facts = read(op, None, body.as_bytes()).expect("reads");
        assert_eq!(facts.service_tier.as_deref(), tier, "{body}");
    }
}
