//! Input-token estimates from request bodies.
//!
//! The estimate is **conservative**: it should come out above the count Bedrock reports, because
//! admission reserves it before the call and an under-reservation lets the proxy overcommit the
//! bucket. The proxy multiplies it by a calibrated ratio learned from reported usage, never below
//! 1 (calibration raises an estimate that runs low, never lowers one that runs high), so it only
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
//!
//! # Where it runs
//! The walk is written once, as serde seeds (`estimate/walk.rs`), and runs over a raw body as
//! `serde_json` parses it (admission's one pass, [`super::body`], which builds no tree) or over a
//! parsed `Value` ([`estimate_input_tokens`]). On a raw body a member name repeated within one
//! object is counted each time (a `Value` keeps only the last); otherwise the two agree exactly.

use std::io;

use base64::Engine as _;
use serde::Serialize;
use serde_json::Value;

use crate::bedrock::Operation;

pub(crate) mod walk;

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

/// A conservative estimate of the input tokens of a parsed request body (before calibration).
pub fn estimate_input_tokens(operation: Operation, body: &Value) -> u64 {
    let mut tally = Tally::default();
    if operation == Operation::CountTokens {
        tally.count_tokens_input(body);
    } else {
        tally.walk_value(body);
    }
    tally.tokens()
}

/// What the walk has counted so far.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    text_bytes: u64,
    messages: u64,
    fixed_tokens: u64,
}

impl Tally {
    /// The estimate: the rule of the module doc.
    pub(crate) fn tokens(&self) -> u64 {
        PER_REQUEST_TOKENS
            .saturating_add(self.messages.saturating_mul(PER_MESSAGE_TOKENS))
            .saturating_add(self.text_bytes.div_ceil(BYTES_PER_TOKEN))
            .saturating_add(self.fixed_tokens)
    }

    fn add_text(&mut self, bytes: usize) {
        self.add_text_u64(bytes as u64);
    }

    fn add_text_u64(&mut self, bytes: u64) {
        self.text_bytes = self.text_bytes.saturating_add(bytes);
    }

    fn add_messages(&mut self, messages: u64) {
        self.messages = self.messages.saturating_add(messages);
    }

    fn add_fixed(&mut self, tokens: u64) {
        self.fixed_tokens = self.fixed_tokens.saturating_add(tokens);
    }

    /// Adds what another tally counted.
    fn add(&mut self, other: &Tally) {
        self.add_text_u64(other.text_bytes);
        self.add_messages(other.messages);
        self.add_fixed(other.fixed_tokens);
    }

    /// Walks a parsed value.
    fn walk_value(&mut self, value: &Value) {
        // Walking a `Value` cannot fail: every seed accepts every JSON type.
        let _ = walk::walk(self, value);
    }

    /// CountTokens: estimate the Converse document or the decoded InvokeModel body it wraps.
    pub(crate) fn count_tokens_input(&mut self, body: &Value) {
        let input = body.get("input");
        if let Some(converse) = input.and_then(|i| i.get("converse")) {
            return self.walk_value(converse);
        }
        match input.and_then(|i| i.pointer("/invokeModel/body")) {
            Some(Value::String(encoded)) => self.encoded_body(encoded),
            Some(inner) => self.walk_value(inner),
            None => self.walk_value(body),
        }
    }

    /// A base64 InvokeModel body: walked as JSON if it is JSON, else counted as text.
    fn encoded_body(&mut self, encoded: &str) {
        let engine = &base64::engine::general_purpose::STANDARD;
        let Ok(bytes) = engine.decode(encoded) else {
            return self.add_text(encoded.len());
        };
        let mut inner = Tally::default();
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        match walk::walk(&mut inner, &mut de).and_then(|()| de.end()) {
            Ok(()) => self.add(&inner),
            Err(_) => self.add_text(bytes.len()),
        }
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

/// The length of `value` serialized as compact JSON.
fn serialized_len<T: Serialize + ?Sized>(value: &T) -> u64 {
    let mut counter = ByteCounter(0);
    // Writing to a counter cannot fail; on the impossible error we keep what was counted.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
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
