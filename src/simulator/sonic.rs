//! The events of a Nova Sonic session (the JSON inside the bidirectional stream's `chunk`
//! events), as a state machine without I/O: [`Session::accept`] reads one input event and says
//! what to do; [`Session::reply`] makes the output events of one assistant turn.
//!
//! Input (`{"event": {name: {...}}}`): `sessionStart` (first; `inferenceConfiguration.maxTokens`
//! caps the session's output), `promptStart`, `contentStart` (`type` TEXT/AUDIO/TOOL, `role`
//! SYSTEM/USER/ASSISTANT/TOOL), `textInput`/`audioInput` (base64 PCM), `contentEnd`,
//! `promptEnd`, `sessionEnd`. The assistant answers each USER content when it ends.
//!
//! Output: `completionStart` (once per prompt), then per turn `contentStart` (TEXT, ASSISTANT),
//! `textOutput`, `contentEnd` (`END_TURN`) and a `usageEvent` with the running totals
//! (`totalInputTokens`, `totalOutputTokens`, `totalTokens`, and `details.delta`/`details.total`
//! split into `speechTokens` and `textTokens`, the shape AWS documents); `completionEnd` at
//! `promptEnd`.
//!
//! Token rules of the simulator: text input costs `ceil(bytes / 4)` per content; audio input
//! `ceil(decoded bytes / 1280)` speech tokens (25 tokens a second of 16 kHz 16-bit mono PCM);
//! output is text only, planned like any call from the turn's text (so `[sim:output=N]` works),
//! within what is left of the session's `maxTokens`.

use std::collections::HashMap;

use base64::Engine;
use serde_json::{Value, json};

use crate::bedrock::error::new_request_id;

/// Bytes of 16 kHz 16-bit mono PCM per speech token.
pub const AUDIO_BYTES_PER_TOKEN: u64 = 1280;

/// What the edge must do after an input event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Nothing to send.
    None,
    /// The session started: reserve its output cap (`None`: the model's maximum).
    Start { max_tokens: Option<u64> },
    /// A USER content ended: plan an answer to `text` and send [`Session::reply`].
    Turn { text: String },
    /// Send these events.
    Send(Vec<Value>),
    /// The caller ended the session.
    End,
}

/// A malformed or out-of-order event (a `validationException` frame ends the stream).
pub type Invalid = String;

#[derive(Debug, Default, Clone)]
struct Content {
    audio: bool,
    user: bool,
    text: String,
    audio_bytes: u64,
}

/// Running token counts, split as the `usageEvent` splits them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub input_text: u64,
    pub input_speech: u64,
    pub output_text: u64,
    pub output_speech: u64,
}

impl Counts {
    pub fn input(&self) -> u64 {
        self.input_text + self.input_speech
    }

    pub fn output(&self) -> u64 {
        self.output_text + self.output_speech
    }

    fn json(&self) -> Value {
        json!({
            "input": {"speechTokens": self.input_speech, "textTokens": self.input_text},
            "output": {"speechTokens": self.output_speech, "textTokens": self.output_text},
        })
    }
}

/// One session's state.
#[derive(Debug, Default)]
pub struct Session {
    session_id: String,
    started: bool,
    prompt: Option<String>,
    completion: Option<String>,
    contents: HashMap<String, Content>,
    /// Totals so far, and at the last usage event.
    pub counts: Counts,
    reported: Counts,
}

fn field<'a>(v: &'a Value, name: &str, event: &str) -> Result<&'a str, Invalid> {
    v.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("The {event} event must have a string {name}."))
}

impl Session {
    pub fn new() -> Session {
        Session {
            session_id: new_request_id(),
            ..Session::default()
        }
    }

    /// Reads one input event.
    pub fn accept(&mut self, event: &Value) -> Result<Action, Invalid> {
        let Some((name, body)) = event
            .get("event")
            .and_then(Value::as_object)
            .and_then(|o| o.iter().next())
        else {
            return Err(
                "Each input chunk must be a JSON object {\"event\": {name: {...}}}.".into(),
            );
        };
        if !self.started && name != "sessionStart" {
            return Err(format!(
                "The session must start with sessionStart, not {name}."
            ));
        }
        match name.as_str() {
            "sessionStart" => {
                if self.started {
                    return Err("sessionStart was already sent.".into());
                }
                self.started = true;
                let max = body.pointer("/inferenceConfiguration/maxTokens");
                let max_tokens = match max {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(v.as_u64().filter(|n| *n >= 1).ok_or(
                        "inferenceConfiguration.maxTokens must be an integer greater than or equal to 1.",
                    )?),
                };
                Ok(Action::Start { max_tokens })
            }
            "promptStart" => {
                self.prompt = Some(field(body, "promptName", name)?.to_string());
                Ok(Action::None)
            }
            "contentStart" => self.content_start(body),
            "textInput" | "audioInput" => self.input(name, body),
            "contentEnd" => self.content_end(body),
            "promptEnd" => Ok(match self.completion.take() {
                Some(completion) => Action::Send(vec![self.output(
                    "completionEnd",
                    &completion,
                    json!({"stopReason": "END_TURN"}),
                )]),
                None => Action::None,
            }),
            "sessionEnd" => Ok(Action::End),
            other => Err(format!("Unknown input event {other}.")),
        }
    }

    fn content_start(&mut self, body: &Value) -> Result<Action, Invalid> {
        let name = field(body, "contentName", "contentStart")?;
        let kind = field(body, "type", "contentStart")?;
        let role = field(body, "role", "contentStart")?;
        let content = Content {
            audio: kind == "AUDIO",
            user: role == "USER",
            ..Content::default()
        };
        self.contents.insert(name.to_string(), content);
        Ok(Action::None)
    }

    fn input(&mut self, event: &str, body: &Value) -> Result<Action, Invalid> {
        let name = field(body, "contentName", event)?;
        let text = field(body, "content", event)?;
        let content = self
            .contents
            .get_mut(name)
            .ok_or_else(|| format!("{event} names content {name:?}, which was not started."))?;
        if event == "audioInput" {
            let audio = base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|_| "audioInput content must be base64-encoded audio.".to_string())?;
            content.audio_bytes += audio.len() as u64;
        } else {
            content.text.push_str(text);
        }
        Ok(Action::None)
    }

    fn content_end(&mut self, body: &Value) -> Result<Action, Invalid> {
        let name = field(body, "contentName", "contentEnd")?;
        let content = self
            .contents
            .remove(name)
            .ok_or_else(|| format!("contentEnd names content {name:?}, which was not started."))?;
        self.counts.input_text += (content.text.len() as u64).div_ceil(4);
        self.counts.input_speech += content.audio_bytes.div_ceil(AUDIO_BYTES_PER_TOKEN);
        let answers = content.user && (content.audio || !content.text.is_empty());
        Ok(match answers {
            true => Action::Turn { text: content.text },
            false => Action::None,
        })
    }

    /// The output events of one assistant turn of `output` text tokens saying `text`, ending
    /// with the usage event.
    pub fn reply(&mut self, text: &str, output: u64) -> Vec<Value> {
        let mut events = Vec::with_capacity(5);
        let completion = match &self.completion {
            Some(c) => c.clone(),
            None => {
                let c = new_request_id();
                events.push(self.output("completionStart", &c, json!({})));
                self.completion = Some(c.clone());
                c
            }
        };
        let content_id = new_request_id();
        let ids = json!({"contentId": content_id, "role": "ASSISTANT"});
        let mut start = ids.clone();
        start["type"] = json!("TEXT");
        start["additionalModelFields"] = json!("{\"generationStage\":\"FINAL\"}");
        let mut said = ids.clone();
        said["content"] = json!(text);
        let mut end = ids;
        end["type"] = json!("TEXT");
        end["stopReason"] = json!("END_TURN");
        events.push(self.output("contentStart", &completion, start));
        events.push(self.output("textOutput", &completion, said));
        events.push(self.output("contentEnd", &completion, end));
        self.counts.output_text += output;
        events.push(self.usage_event(&completion));
        events
    }

    /// A `usageEvent` with the totals so far and what changed since the last one.
    fn usage_event(&mut self, completion: &str) -> Value {
        let (now, before) = (self.counts, self.reported);
        let delta = Counts {
            input_text: now.input_text - before.input_text,
            input_speech: now.input_speech - before.input_speech,
            output_text: now.output_text - before.output_text,
            output_speech: now.output_speech - before.output_speech,
        };
        self.reported = now;
        self.output(
            "usageEvent",
            completion,
            json!({
                "details": {"delta": delta.json(), "total": now.json()},
                "totalInputTokens": now.input(),
                "totalOutputTokens": now.output(),
                "totalTokens": now.input() + now.output(),
            }),
        )
    }

    /// `{"event": {name: {sessionId, promptName, completionId, ...fields}}}`.
    fn output(&self, name: &str, completion: &str, mut fields: Value) -> Value {
        fields["sessionId"] = json!(self.session_id);
        fields["promptName"] = json!(self.prompt.as_deref().unwrap_or(""));
        fields["completionId"] = json!(completion);
        json!({ "event": { name: fields } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(name: &str, body: Value) -> Value {
        json!({"event": {name: body}})
    }

    #[test]
    fn a_session_answers_each_user_content_with_running_totals() {
        let mut s = Session::new();
        assert_eq!(
            s.accept(&ev(
                "sessionStart",
                json!({"inferenceConfiguration": {"maxTokens": 500}})
            )),
            Ok(Action::Start {
                max_tokens: Some(500)
            })
        );
        assert_eq!(
            s.accept(&ev("promptStart", json!({"promptName": "p"}))),
            Ok(Action::None)
        );
        let start = |name: &str, kind: &str, role: &str| {
            ev(
                "contentStart",
                json!({"promptName": "p", "contentName": name, "type": kind, "role": role}),
            )
        };
        s.accept(&start("sys", "TEXT", "SYSTEM")).unwrap();
        s.accept(&ev(
            "textInput",
            json!({"contentName": "sys", "content": "be brief"}),
        ))
        .unwrap();
        assert_eq!(
            s.accept(&ev("contentEnd", json!({"contentName": "sys"}))),
            Ok(Action::None)
        );
        s.accept(&start("a1", "AUDIO", "USER")).unwrap();
        let pcm = base64::engine::general_purpose::STANDARD.encode(vec![0u8; 3000]);
        s.accept(&ev(
            "audioInput",
            json!({"contentName": "a1", "content": pcm}),
        ))
        .unwrap();
        assert_eq!(
            s.accept(&ev("contentEnd", json!({"contentName": "a1"}))),
            Ok(Action::Turn {
                text: String::new()
            })
        );
        // "be brief" = 8 bytes -> 2 text tokens; 3000 bytes of audio -> 3 speech tokens.
        assert_eq!((s.counts.input_text, s.counts.input_speech), (2, 3));
        let events = s.reply("hi there", 7);
        let names: Vec<&str> = events
            .iter()
            .map(|e| {
                e["event"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .next()
                    .unwrap()
                    .as_str()
            })
            .collect();
        assert_eq!(
            names,
            [
                "completionStart",
                "contentStart",
                "textOutput",
                "contentEnd",
                "usageEvent"
            ]
        );
        let usage = &events[4]["event"]["usageEvent"];
        assert_eq!(
            (
                usage["totalInputTokens"].as_u64(),
                usage["totalOutputTokens"].as_u64()
            ),
            (Some(5), Some(7))
        );
        assert_eq!(usage["details"]["total"]["input"]["speechTokens"], 3);
        // A second turn: no new completionStart; the delta is only what is new.
        s.accept(&start("t2", "TEXT", "USER")).unwrap();
        s.accept(&ev(
            "textInput",
            json!({"contentName": "t2", "content": "again?"}),
        ))
        .unwrap();
        s.accept(&ev("contentEnd", json!({"contentName": "t2"})))
            .unwrap();
        let events = s.reply("ok", 4);
        assert_eq!(events.len(), 4);
        let usage = &events[3]["event"]["usageEvent"];
        assert_eq!(usage["totalOutputTokens"], 11);
        assert_eq!(usage["totalInputTokens"], 7);
        assert_eq!(usage["details"]["delta"]["output"]["textTokens"], 4);
        assert_eq!(usage["details"]["delta"]["input"]["textTokens"], 2);
        assert!(
            matches!(s.accept(&ev("promptEnd", json!({"promptName": "p"}))), Ok(Action::Send(e)) if e.len() == 1)
        );
        assert_eq!(s.accept(&ev("sessionEnd", json!({}))), Ok(Action::End));
    }

    #[test]
    fn bad_events_are_refused() {
        let mut s = Session::new();
        assert!(
            s.accept(&ev("promptStart", json!({"promptName": "p"})))
                .unwrap_err()
                .contains("sessionStart")
        );
        assert!(s.accept(&json!({"nope": 1})).is_err());
        s.accept(&ev("sessionStart", json!({}))).unwrap();
        assert!(s.accept(&ev("sessionStart", json!({}))).is_err());
        assert!(
            s.accept(&ev(
                "textInput",
                json!({"contentName": "x", "content": "y"})
            ))
            .is_err()
        );
        assert!(s.accept(&ev("bogus", json!({}))).is_err());
        let max0 = ev(
            "sessionStart",
            json!({"inferenceConfiguration": {"maxTokens": 0}}),
        );
        assert!(Session::new().accept(&max0).is_err());
    }
}
