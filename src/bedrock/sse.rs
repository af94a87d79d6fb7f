//! Server-sent events (`text/event-stream`), as the OpenAI and Anthropic APIs stream responses:
//! reading them from chunks at any boundary ([`SseReader`]), and taking the usage chunk the proxy
//! asked for on a client's behalf out of a Chat Completions stream ([`UsageChunkFilter`]).
//!
//! An event is a run of lines ended by a blank line; lines end with `\n`, `\r\n` or `\r`. A line
//! `event: NAME` names it, `data: ...` lines (joined with `\n`) are its data, lines starting
//! with `:` are comments, other fields are ignored (the WHATWG rules, which the SDKs follow).
//! Memory is bounded: past [`EVENT_CAP`] bytes without an event's end, the reader gives up.

use bytes::{Bytes, BytesMut};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The largest event held while waiting for its end (the events of these APIs are a few KB).
pub const EVENT_CAP: usize = 8 * 1024 * 1024;

/// The media type of an SSE response.
pub const CONTENT_TYPE: &str = "text/event-stream";

/// One whole event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's bytes as received, its blank line included.
    pub raw: Bytes,
    /// `event:`, if the event names itself.
    pub name: Option<String>,
    /// Its `data:` lines, joined with `\n`.
    pub data: String,
    /// How many `data:` lines it had.
    pub data_lines: usize,
}

/// An event longer than [`EVENT_CAP`], or not UTF-8.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an event is longer than {EVENT_CAP} bytes")]
    TooLong,
    #[error("an event is not UTF-8")]
    NotUtf8,
}

/// Splits a byte stream into events.
#[derive(Debug, Default)]
pub struct SseReader {
    buf: BytesMut,
}

impl SseReader {
    pub fn new() -> SseReader {
        SseReader::default()
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes held that are not yet a whole event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Takes what is held, whole event or not (the end of the stream).
    pub fn take_rest(&mut self) -> Bytes {
        self.buf.split().freeze()
    }

    /// The next whole event, if one has arrived.
    pub fn next_event(&mut self) -> Result<Option<Event>, SseError> {
        let Some(end) = event_end(&self.buf) else {
            return match self.buf.len() > EVENT_CAP {
                true => Err(SseError::TooLong),
                false => Ok(None),
            };
        };
        let raw = self.buf.split_to(end).freeze();
        let text = std::str::from_utf8(&raw).map_err(|_| SseError::NotUtf8)?;
        let mut event = Event {
            raw: raw.clone(),
            name: None,
            data: String::new(),
            data_lines: 0,
        };
        for line in text.split(['\n', '\r']).filter(|l| !l.is_empty()) {
            let (field, value) = match line.split_once(':') {
                Some(("", _)) => continue,
                Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
                None => (line, ""),
            };
            match field {
                "event" => event.name = Some(value.to_string()),
                "data" => {
                    if event.data_lines > 0 {
                        event.data.push('\n');
                    }
                    event.data.push_str(value);
                    event.data_lines += 1;
                }
                _ => {}
            }
        }
        Ok(Some(event))
    }
}

/// The end of the first event in `buf` (just past its blank line), if it is all there. A `\r`
/// at the very end may be the first half of `\r\n`: it waits for the next byte.
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut line_start = 0;
    let mut i = 0;
    while i < buf.len() {
        let terminator = match buf[i] {
            b'\n' => 1,
            b'\r' if i + 1 == buf.len() => return None,
            b'\r' if buf[i + 1] == b'\n' => 2,
            b'\r' => 1,
            _ => {
                i += 1;
                continue;
            }
        };
        if i == line_start && i > 0 {
            return Some(i + terminator);
        }
        i += terminator;
        line_start = i;
    }
    None
}

// === Chat Completions' usage chunk ===

/// Takes out of a Chat Completions stream what `stream_options.include_usage` adds: the last
/// chunk, whose `choices` is empty and which carries the `usage`, and the `"usage": null` member
/// of every other chunk. What remains is, byte for byte, the stream upstream sends a client that
/// did not ask (other members keep their order and their text; the edited chunk is written
/// without spaces between members, as upstream writes it).
///
/// Events pass whole: a partial event is held until its end arrives. Whatever does not parse as
/// a chunk (`[DONE]`, comments, other APIs' events) passes unchanged.
#[derive(Debug, Default)]
pub struct UsageChunkFilter {
    reader: SseReader,
}

impl UsageChunkFilter {
    pub fn new() -> UsageChunkFilter {
        UsageChunkFilter::default()
    }

    /// Feeds a chunk of the upstream stream; returns what the client gets now.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.reader.push(chunk);
        let mut out = BytesMut::new();
        loop {
            match self.reader.next_event() {
                Ok(Some(event)) => out.extend_from_slice(&client_event(&event)),
                Ok(None) => break,
                // Not SSE after all: pass the rest through untouched.
                Err(_) => {
                    out.extend_from_slice(&self.reader.take_rest());
                    break;
                }
            }
        }
        out.freeze()
    }

    /// The stream ended: whatever is still held, as it came.
    pub fn finish(&mut self) -> Bytes {
        self.reader.take_rest()
    }
}

/// What the client gets of one event.
fn client_event(event: &Event) -> Bytes {
    if event.data_lines != 1 || event.name.is_some() {
        return event.raw.clone();
    }
    let Ok(members) = top_level_members(&event.data) else {
        return event.raw.clone();
    };
    let value_of = |key: &str| {
        members
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.get().trim())
    };
    let usage = value_of("usage");
    if usage.is_some_and(|u| u.starts_with('{')) && value_of("choices") == Some("[]") {
        return Bytes::new();
    }
    if usage != Some("null") {
        return event.raw.clone();
    }
    let mut json = String::with_capacity(event.data.len());
    json.push('{');
    let kept = members.iter().filter(|(k, _)| k != "usage");
    for (i, (key, value)) in kept.enumerate() {
        if i > 0 {
            json.push(',');
        }
        // A key read from JSON is always writable as JSON.
        json.push_str(&serde_json::to_string(key).unwrap_or_default());
        json.push(':');
        json.push_str(value.get());
    }
    json.push('}');
    Bytes::from(format!("data: {json}\n\n"))
}

/// The members of a JSON object, in order, values as written.
fn top_level_members(json: &str) -> Result<Vec<(String, &RawValue)>, serde_json::Error> {
    struct Members;
    impl<'de> Visitor<'de> for Members {
        type Value = Vec<(String, &'de RawValue)>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                out.push(entry);
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(json);
    let members = (&mut de).deserialize_map(Members)?;
    de.end()?;
    Ok(members)
}

#[cfg(test)]
#[path = "sse_tests.rs"]
mod tests;
