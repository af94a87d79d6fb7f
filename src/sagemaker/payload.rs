//! What tokengate reads in a container's request and response: the output cap a request asks
//! for, and the usage an answer reports. Containers speak their own schemas; two are read:
//!
//! | schema | output cap in the request | usage in the answer |
//! |---|---|---|
//! | OpenAI-style (vLLM, LMI, SGLang `/v1/chat/completions` shapes) | `max_completion_tokens`, else `max_tokens` | `usage.prompt_tokens`, `usage.completion_tokens` (a stream's last chunk, with `stream_options.include_usage`) |
//! | TGI-style (Hugging Face TGI, LMI rolling batch) | `parameters.max_new_tokens` | `details.generated_tokens` (a list's first item, or a stream's last event) |
//!
//! Anything else (CSV, images, another JSON schema) is forwarded untouched and reserved at the
//! pool's default; a response without usage settles by the `no_usage` rule. A streamed answer
//! reaches the client as `PayloadPart` events whose bytes are the container's own stream,
//! split anywhere: [`PayloadUsage`] joins them into lines (`data: {...}` server-sent events or
//! JSON lines) and reads each line once.
//!
//! # Failure semantics and memory
//! Nothing here panics on bad input. A request field of the wrong type is a [`PayloadError`]
//! naming the field. A response that cannot be read (bad framing, a line over [`LINE_CAP`])
//! stops being read for usage; output seen so far is kept. Memory per response: one partial
//! frame (capped as in [`crate::bedrock::usage`]), one partial line, or a body copy up to
//! [`crate::bedrock::usage::BODY_CAP`].

use serde_json::Value;

use crate::bedrock::{
    Usage,
    eventstream::FrameReader,
    usage::{BoundedBody, FRAME_CAP, OPENAI_KEYS, choice_text_len, usage_in},
};

/// The longest line of a streamed answer held while waiting for its end.
pub const LINE_CAP: usize = 1024 * 1024;

/// A request field tokengate reads is not what the schema says it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("the request body starts like a JSON object but is not valid JSON ({0})")]
    NotJson(String),
    #[error("{field} must be a whole number of tokens, not {found}")]
    NotACount { field: &'static str, found: String },
}

/// The output cap a container request asks for: the largest of the fields it sets (the
/// container honours one of them; reserving the largest never under-reserves). `None` when the
/// body is not a JSON object or sets none of them.
pub fn requested_max_tokens(body: &[u8]) -> Result<Option<u64>, PayloadError> {
    let starts_object = body
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !starts_object {
        return Ok(None);
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| PayloadError::NotJson(e.to_string()))?;
    let fields = [
        ("max_completion_tokens", "/max_completion_tokens"),
        ("max_tokens", "/max_tokens"),
        ("parameters.max_new_tokens", "/parameters/max_new_tokens"),
    ];
    let mut largest = None;
    for (field, pointer) in fields {
        match value.pointer(pointer) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| PayloadError::NotACount {
                    field,
                    found: v.to_string(),
                })?;
                largest = largest.max(Some(n));
            }
        }
    }
    Ok(largest)
}

/// Watches one successful endpoint answer go by and reports its usage the moment it is known.
#[derive(Debug)]
pub struct PayloadUsage {
    stream: bool,
    frames: FrameReader,
    line: Vec<u8>,
    body: BoundedBody,
    usage: Option<Usage>,
    body_bytes: u64,
    output_seen: u64,
    corrupt: bool,
}

impl PayloadUsage {
    /// For an InvokeEndpoint answer (`stream` false) or an InvokeEndpointWithResponseStream one.
    pub fn new(stream: bool) -> PayloadUsage {
        PayloadUsage {
            stream,
            frames: FrameReader::new(),
            line: Vec::new(),
            body: BoundedBody::default(),
            usage: None,
            body_bytes: 0,
            output_seen: 0,
            corrupt: false,
        }
    }

    /// Feeds one body chunk. Returns `Some` exactly once: when usage first becomes known.
    pub fn on_data(&mut self, chunk: &[u8]) -> Option<Usage> {
        self.body_bytes = self.body_bytes.saturating_add(chunk.len() as u64);
        if !self.stream {
            if self.usage.is_none() {
                self.body.push(chunk);
            }
            return None;
        }
        if self.corrupt {
            return None;
        }
        let (frames, broken) = self.frames.frames_of(chunk, FRAME_CAP);
        let mut found = None;
        for frame in &frames {
            if frame.message_type == "event" && frame.kind == "PayloadPart" {
                found = found.or(self.on_part(&frame.payload));
            }
        }
        self.corrupt |= broken;
        found
    }

    /// The body ended: a non-streamed answer's usage, if it has one and it was not returned.
    pub fn on_end(&mut self) -> Option<Usage> {
        if self.stream {
            // A last line without its newline.
            let rest = std::mem::take(&mut self.line);
            return self.on_line(&rest);
        }
        if self.usage.is_some() {
            return None;
        }
        let body = self.body.take()?;
        let value: Value = serde_json::from_slice(&body).ok()?;
        // TGI answers a list with one generation per input.
        let answer = value.get(0).unwrap_or(&value);
        self.report(answer_usage(answer))
    }

    /// An estimate of the output generated so far: a stream's text deltas (`ceil(bytes / 4)`
    /// each, one per TGI token event), or `ceil(body bytes / 4)` of a whole answer.
    pub fn output_tokens_seen(&self) -> u64 {
        if self.stream {
            self.output_seen
        } else {
            self.body_bytes.div_ceil(4)
        }
    }

    fn on_part(&mut self, bytes: &[u8]) -> Option<Usage> {
        let mut found = None;
        for piece in bytes.split_inclusive(|b| *b == b'\n') {
            if self.line.len() + piece.len() > LINE_CAP {
                self.corrupt = true;
                self.line = Vec::new();
                return found;
            }
            self.line.extend_from_slice(piece);
            if self.line.ends_with(b"\n") {
                let line = std::mem::take(&mut self.line);
                found = found.or(self.on_line(&line));
            }
        }
        found
    }

    /// One line of the container's stream: `data: {...}`, or a bare JSON line.
    fn on_line(&mut self, line: &[u8]) -> Option<Usage> {
        let text = std::str::from_utf8(line).ok()?.trim();
        let json = text.strip_prefix("data:").map_or(text, str::trim_start);
        if !json.starts_with('{') {
            return None;
        }
        let event: Value = serde_json::from_str(json).ok()?;
        if event.get("token").is_some() {
            // TGI: one event per generated token.
            self.output_seen = self.output_seen.saturating_add(1);
        } else if let Some(choices) = event.get("choices").and_then(Value::as_array) {
            let bytes: u64 = choices.iter().map(choice_text_len).sum();
            self.output_seen = self.output_seen.saturating_add(bytes.div_ceil(4));
        }
        self.report(answer_usage(&event))
    }

    fn report(&mut self, usage: Option<Usage>) -> Option<Usage> {
        if self.usage.is_some() {
            return None;
        }
        self.usage = usage;
        usage
    }
}

/// The usage in one answer object (or stream event): OpenAI `usage`, or TGI
/// `details.generated_tokens` (which counts no input).
fn answer_usage(answer: &Value) -> Option<Usage> {
    if let Some(usage) = answer.get("usage").filter(|u| u.is_object()) {
        return usage_in(usage, &OPENAI_KEYS);
    }
    let generated = answer.pointer("/details/generated_tokens")?.as_u64()?;
    Some(Usage {
        output_tokens: generated,
        ..Usage::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bedrock::eventstream::typed_event_frame;

    #[test]
    fn the_output_cap_of_each_schema() {
        let cap = |body: &str| requested_max_tokens(body.as_bytes());
        assert_eq!(cap(r#"{"messages":[],"max_tokens":300}"#), Ok(Some(300)));
        assert_eq!(
            cap(r#"{"max_tokens":300,"max_completion_tokens":500}"#),
            Ok(Some(500))
        );
        assert_eq!(
            cap(r#"{"inputs":"hi","parameters":{"max_new_tokens":64}}"#),
            Ok(Some(64))
        );
        assert_eq!(cap(r#"{"inputs":"hi","parameters":{}}"#), Ok(None));
        assert_eq!(cap(r#"{"max_tokens":null}"#), Ok(None));
        assert_eq!(cap("1,2,3\n4,5,6"), Ok(None));
        assert_eq!(cap(r#"[{"inputs":"x"}]"#), Ok(None));
        assert!(matches!(cap("{not json"), Err(PayloadError::NotJson(_))));
        assert_eq!(
            cap(r#"{"parameters":{"max_new_tokens":"many"}}"#),
            Err(PayloadError::NotACount {
                field: "parameters.max_new_tokens",
                found: "\"many\"".into()
            })
        );
        assert!(cap(r#"{"max_tokens":-1}"#).is_err());
    }

    fn whole(body: &str) -> (Option<Usage>, u64) {
        let mut u = PayloadUsage::new(false);
        assert_eq!(u.on_data(body.as_bytes()), None);
        (u.on_end(), u.output_tokens_seen())
    }

    #[test]
    fn usage_of_whole_answers() {
        let (usage, _) = whole(
            r#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":40}}"#,
        );
        assert_eq!(
            usage,
            Some(Usage {
                input_tokens: 12,
                output_tokens: 40,
                ..Usage::default()
            })
        );
        let (usage, _) = whole(
            r#"[{"generated_text":"x","details":{"generated_tokens":7,"finish_reason":"length"}}]"#,
        );
        assert_eq!(
            usage.map(|u| (u.input_tokens, u.output_tokens)),
            Some((0, 7))
        );
        let plain = r#"[{"generated_text":"no details here"}]"#;
        let (usage, seen) = whole(plain);
        assert_eq!(usage, None);
        assert_eq!(seen, (plain.len() as u64).div_ceil(4));
    }

    fn stream_of(parts: &[&str]) -> Vec<u8> {
        parts
            .iter()
            .flat_map(|p| {
                typed_event_frame("PayloadPart", "application/octet-stream", p.as_bytes()).to_vec()
            })
            .collect()
    }

    #[test]
    fn usage_of_streams_split_anywhere() {
        // TGI server-sent events, one token each, the last with details; parts split mid-line.
        let tgi = stream_of(&[
            "data:{\"token\":{\"text\":\"He\"},\"details\":null}\n\ndata:{\"tok",
            "en\":{\"text\":\"llo\"},\"details\":null}\n\n",
            "data:{\"token\":{\"text\":\"!\"},\"details\":{\"generated_tokens\":3}}\n\n",
        ]);
        // OpenAI chunks, then a usage chunk and [DONE].
        let openai = stream_of(&[
            "data: {\"choices\":[{\"delta\":{\"content\":\"abcdefgh\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
        ]);
        for (wire, usage, seen) in [(tgi, (0, 3), 3), (openai, (5, 2), 2)] {
            for split in [1, 7, wire.len() / 2, wire.len() - 1] {
                let mut u = PayloadUsage::new(true);
                let mut found: Vec<Usage> = [&wire[..split], &wire[split..]]
                    .iter()
                    .filter_map(|part| u.on_data(part))
                    .collect();
                found.extend(u.on_end());
                assert_eq!(found.len(), 1, "usage once, split at {split}");
                assert_eq!((found[0].input_tokens, found[0].output_tokens), usage);
                assert_eq!(u.output_tokens_seen(), seen);
            }
        }
    }

    #[test]
    fn json_lines_without_a_final_newline_and_corrupt_frames() {
        let wire =
            stream_of(&["{\"token\":{\"text\":\"a\"}}\n{\"details\":{\"generated_tokens\":1}}"]);
        let mut u = PayloadUsage::new(true);
        assert_eq!(u.on_data(&wire), None);
        assert_eq!(u.on_end().map(|u| u.output_tokens), Some(1));

        let mut wire = stream_of(&["data:{\"token\":{\"text\":\"a\"}}\n"]);
        let last = wire.len() - 1;
        wire[last] ^= 0xff;
        let mut u = PayloadUsage::new(true);
        assert_eq!(u.on_data(&wire), None);
        assert_eq!(u.on_end(), None);
    }
}
