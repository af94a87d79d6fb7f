//! Input-token estimates from request bodies.
//!
//! The estimate is **conservative**: it should come out above the count Bedrock reports, because
//! admission reserves it before the call and an under-reservation lets the proxy overcommit the
//! bucket. The proxy multiplies it by a calibrated ratio learned from reported usage, so it only
//! has to be stable and on the high side, not exact.
//!
//! # Rule
//! `estimate = 16 per request + 4 per message + ceil(text bytes / 3) + fixed media tokens`, where
//! - **text bytes** are the UTF-8 bytes of every string value in the body (one walk of the JSON),
//!   except fields that are not model input (`inferenceConfig`, `textGenerationConfig`,
//!   `cachePoint`, `cache_control`, `anthropic_version`, `role`, `type`, `model`, stop sequences,
//!   signatures, request metadata, ...). Three bytes per token over-counts English prose and code
//!   (tokenizers average about four) and is close for non-Latin scripts.
//! - **tool definitions and structured inputs** (`tools`, `toolConfig`, a `toolUse`/`tool_use`
//!   `input` object, a `json` tool-result block) count their serialized JSON length, since their
//!   keys and punctuation are tokenized too.
//! - **documents** (Converse/Nova `document.source.bytes`, Anthropic `document` `source.data`, a
//!   non-image `data:` URL) count their base64-decoded size as text bytes. For PDF or DOCX this
//!   is the compressed file size, of the same order as the text it holds.
//!   A document named by reference only (S3, URL, file id) counts [`UNSIZED_DOCUMENT_TOKENS`].
//! - **images** count [`IMAGE_TOKENS`] each, whatever their encoded size: Claude resizes images to
//!   about 1.15 megapixels (at most 1568 px on a side) and charges `width x height / 750`, about
//!   1,600 tokens at most; Nova's per-image counts are of the same order. Counting image bytes as
//!   text would over-count a 1 MB PNG by a factor of hundreds.
//! - **videos** count [`VIDEO_TOKENS`] each: a placeholder, not a measurement (see its doc).
//! - cache points add nothing.
//!
//! CountTokens bodies (`{"input":{"converse":{...}}}` or `{"input":{"invokeModel":{"body":
//! "<base64>"}}}`) are estimated on the inner document. The walk never panics, stops descending
//! at depth [`MAX_DEPTH`], and returns at least the per-request overhead.

use std::io;

use base64::Engine as _;
use serde_json::{Map, Value};

use crate::bedrock::Operation;

/// Fixed tokens every request carries (system framing, turn markers).
pub const PER_REQUEST_TOKENS: u64 = 16;
/// Fixed tokens per message (role markers and separators).
pub const PER_MESSAGE_TOKENS: u64 = 4;
/// Bytes of text counted as one token: conservative against the ~4 of common tokenizers.
pub const BYTES_PER_TOKEN: u64 = 3;
/// Tokens per image: the most Claude charges for one image after its automatic resize.
pub const IMAGE_TOKENS: u64 = 1_600;
/// Tokens per video block. No documented per-video figure applies across models (Nova samples
/// frames from the video's length, which the body does not state); this is a generous
/// placeholder that calibration can correct on average but not per request.
pub const VIDEO_TOKENS: u64 = 32_000;
/// Tokens for a document given only by reference (S3, URL, file id), whose size we cannot see.
pub const UNSIZED_DOCUMENT_TOKENS: u64 = 8_000;
/// The deepest nesting walked; `serde_json` refuses to parse deeper than 128 anyway.
pub const MAX_DEPTH: usize = 128;

/// A conservative estimate of the input tokens of a request body (before calibration).
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

#[cfg(test)]
#[path = "estimate_tests.rs"]
mod tests;
