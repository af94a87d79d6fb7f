//! InvokeEndpoint and InvokeEndpointWithResponseStream against a simulated fleet.
//!
//! The container speaks two schemas, read here on the simulator's own terms:
//! - **OpenAI-style** (`messages` or `prompt`): output cap `max_completion_tokens`, else
//!   `max_tokens`; answers a `chat.completion` with `usage`; streams `chat.completion.chunk`
//!   server-sent events, a usage chunk when `stream_options.include_usage` is true, then
//!   `data: [DONE]`.
//! - **TGI-style** (`inputs`): output cap `parameters.max_new_tokens`; answers
//!   `[{"generated_text": ...}]`, with `details` (`generated_tokens`, `finish_reason`) when
//!   `parameters.details` is true; streams one `data:{"token": ...}` event per token, the last
//!   with `generated_text` and `details`.
//!
//! A stream's events reach the client as `PayloadPart` event-stream frames. Timing and output
//! length follow [`crate::simulator::generate`] with the endpoint's own `time_to_first_token_ms`
//! and `tokens_per_second`; a call holds its slot on a copy until its answer ends.
//!
//! Errors, in sagemaker-runtime's shapes (the simulator's reading where AWS documents no body):
//! an unknown endpoint or a missing inference component is `400 ValidationError`; an inference
//! component with no copies `400 ValidationError` ("no capacity"); a container past its cap
//! answers 429, which SageMaker hands back as `424 ModelError` with `OriginalStatusCode` 429, and
//! SDKs do not retry it; a body the container cannot read is a `424 ModelError` with 400.

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header, request::Parts};
use serde_json::{Value, json};

use super::fleet::{Fleet, Refusal, Slot};
use crate::bedrock::error::{X_AMZN_ERROR_TYPE, X_AMZN_REQUEST_ID, new_request_id};
use crate::bedrock::eventstream::{self, typed_event_frame};
use crate::simulator::config::SimulatorConfig;
use crate::simulator::generate::{self, Fault};
use crate::simulator::request::{self, input_tokens, input_tokens_of, positive};
use crate::simulator::shapes::{Framing, Usage};
use crate::simulator::stream::{self, Paced};

const CUSTOM_ATTRIBUTES: &str = "x-amzn-sagemaker-custom-attributes";

/// The largest request body (the service model's `BodyBlob`).
pub const MAX_BODY_BYTES: usize = 6 * 1024 * 1024;

/// The schema a request speaks, and what it asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Schema {
    /// OpenAI-style; `include_usage` in a stream.
    OpenAi { chat: bool, include_usage: bool },
    /// TGI-style; `details` in a whole answer.
    Tgi { details: bool },
}

/// A container request, read.
#[derive(Debug)]
struct Ask {
    schema: Schema,
    input: u64,
    max_tokens: u64,
}

/// Reads a request body as the simulated container does; `Err` is the container's 400 message.
fn read(body: &[u8], default_max: u64) -> Result<Ask, String> {
    let v = request::parse_object(body)?;
    let (schema, input, max) = if v.get("messages").is_some() || v.get("prompt").is_some() {
        let max = match positive(&v, &["max_completion_tokens"], "max_completion_tokens")? {
            Some(n) => Some(n),
            None => positive(&v, &["max_tokens"], "max_tokens")?,
        };
        let include_usage = request::at(&v, &["stream_options", "include_usage"])
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let chat = v.get("messages").is_some();
        (
            Schema::OpenAi {
                chat,
                include_usage,
            },
            input_tokens(&v),
            max,
        )
    } else if let Some(inputs) = v.get("inputs") {
        let max = positive(
            &v,
            &["parameters", "max_new_tokens"],
            "parameters.max_new_tokens",
        )?;
        let details = request::at(&v, &["parameters", "details"])
            .and_then(Value::as_bool)
            .unwrap_or(false);
        (Schema::Tgi { details }, input_tokens_of([inputs], 1), max)
    } else {
        return Err(
            "the container reads OpenAI-style (messages, prompt) or TGI-style (inputs) JSON".into(),
        );
    };
    Ok(Ask {
        schema,
        input,
        max_tokens: max.unwrap_or(default_max),
    })
}

/// Answers one invocation on `fleet`; `arrival` numbers the simulator's calls.
pub(super) async fn invoke(
    config: &SimulatorConfig,
    fleet: &Arc<Fleet>,
    parts: &Parts,
    body: &[u8],
    streaming: bool,
    arrival: u64,
) -> Response {
    let ask = match read(body, fleet.config.default_max_new_tokens) {
        Ok(ask) => ask,
        Err(message) => return model_error(400, &json!({ "error": message }).to_string()),
    };
    let slot = match fleet.acquire() {
        Ok(slot) => slot,
        Err(Refusal::Overloaded) => {
            let original = json!({"error": "Model is overloaded", "error_type": "overloaded"});
            return model_error(429, &original.to_string());
        }
        Err(Refusal::NoCapacity) => return no_capacity(fleet),
    };
    let plan = generate::plan(config, body, ask.max_tokens, streaming, arrival);
    match plan.fault {
        Some(Fault::Unavailable) => return model_error(503, r#"{"error":"simulated fault"}"#),
        Some(Fault::Internal | Fault::Reset) => {
            return model_error(500, r#"{"error":"simulated fault"}"#);
        }
        _ => {}
    }
    let timing = SimulatorConfig {
        time_to_first_token_ms: fleet.config.time_to_first_token_ms,
        tokens_per_second: fleet.config.tokens_per_second,
        stall_ms: config.stall_ms,
        ..SimulatorConfig::default()
    };
    let text = generate::text(plan.text_seed, plan.output_tokens);
    let usage = Usage {
        model_id: &fleet.config.name,
        input: ask.input,
        output: plan.output_tokens,
        hit_max: plan.hit_max,
        latency_ms: generate::ready_at(&timing, plan.output_tokens).as_millis() as u64,
        first_byte_ms: timing.time_to_first_token_ms,
        tier: None,
    };
    let request_id = new_request_id();
    let answer = Answer {
        schema: ask.schema,
        text: &text,
        usage: &usage,
        request_id: &request_id,
        timing: &timing,
    };
    let mut response = if streaming {
        let cut = plan.fault == Some(Fault::Cut);
        answer.streamed(plan.fault, cut, slot, fleet.clone())
    } else {
        answer.whole(slot, fleet).await
    };
    stamp(&mut response, parts, &request_id);
    response
}

/// What a call answers, once planned.
struct Answer<'a> {
    schema: Schema,
    text: &'a str,
    usage: &'a Usage<'a>,
    request_id: &'a str,
    /// The endpoint's own timing, in the shape the simulator's stream layout reads.
    timing: &'a SimulatorConfig,
}

impl Answer<'_> {
    /// A stream of paced `PayloadPart` frames that holds `slot` until it ends.
    fn streamed(&self, fault: Option<Fault>, cut: bool, slot: Slot, fleet: Arc<Fleet>) -> Response {
        let u = self.usage;
        let steps = stream::steps(
            self.timing,
            &self.schema,
            self.text,
            u,
            self.request_id,
            fault,
        );
        let paced = Paced::new(steps, None, u.output, cut);
        let mut r = Response::new(Body::from_stream(Served::new(paced, slot, fleet, u.output)));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(eventstream::CONTENT_TYPE),
        );
        h.insert(
            "x-amzn-sagemaker-content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        r
    }

    /// The whole answer, once the generation's time has passed; the slot is held until then.
    async fn whole(&self, slot: Slot, fleet: &Fleet) -> Response {
        tokio::time::sleep(generate::ready_at(self.timing, self.usage.output)).await;
        fleet.served(self.usage.output);
        drop(slot);
        let body = whole(&self.schema, self.text, self.usage, self.request_id);
        let mut r = Response::new(Body::from(body));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// The headers every answer carries: the variant that served it, the caller's custom attributes
/// echoed (as a container may answer its own), the request id.
fn stamp(response: &mut Response, parts: &Parts, request_id: &str) {
    let variant = parts
        .headers
        .get("x-amzn-sagemaker-target-variant")
        .cloned()
        .unwrap_or(HeaderValue::from_static("AllTraffic"));
    let h = response.headers_mut();
    h.insert("x-amzn-invoked-production-variant", variant);
    if let Some(attributes) = parts.headers.get(CUSTOM_ATTRIBUTES) {
        h.insert(CUSTOM_ATTRIBUTES, attributes.clone());
    }
    if let Ok(id) = HeaderValue::from_str(request_id) {
        h.insert(X_AMZN_REQUEST_ID, id);
    }
}

/// A whole (non-streamed) answer.
fn whole(schema: &Schema, text: &str, u: &Usage<'_>, request_id: &str) -> Vec<u8> {
    let finish = finish_reason(schema, u.hit_max);
    let v = match *schema {
        Schema::OpenAi { chat, .. } => {
            let choice = if chat {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": text, "finish_reason": finish})
            };
            json!({
                "id": format!("cmpl-{request_id}"),
                "object": if chat { "chat.completion" } else { "text_completion" },
                "model": u.model_id,
                "choices": [choice],
                "usage": {"prompt_tokens": u.input, "completion_tokens": u.output, "total_tokens": u.input + u.output},
            })
        }
        Schema::Tgi { details: true } => json!([{
            "generated_text": text,
            "details": {"finish_reason": finish, "generated_tokens": u.output, "seed": null},
        }]),
        Schema::Tgi { details: false } => json!([{ "generated_text": text }]),
    };
    v.to_string().into_bytes()
}

fn finish_reason(schema: &Schema, hit_max: bool) -> &'static str {
    match (schema, hit_max) {
        (_, true) => "length",
        (Schema::OpenAi { .. }, false) => "stop",
        (Schema::Tgi { .. }, false) => "eos_token",
    }
}

/// One `PayloadPart` frame carrying server-sent events.
fn part(events: &str) -> Bytes {
    typed_event_frame("PayloadPart", "application/octet-stream", events.as_bytes())
}

/// The streamed answer of each schema, as `PayloadPart` frames of server-sent events.
impl Framing for Schema {
    fn prelude(&self, _u: &Usage<'_>, _request_id: &str) -> Vec<Bytes> {
        Vec::new()
    }

    fn delta(&self, text: &str, so_far: u64, u: &Usage<'_>) -> Bytes {
        match *self {
            Schema::OpenAi { chat, .. } => {
                let choice = if chat {
                    json!({"index": 0, "delta": {"content": text}, "finish_reason": null})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": null})
                };
                let chunk = json!({"object": "chat.completion.chunk", "model": u.model_id, "choices": [choice]});
                part(&format!("data: {chunk}\n\n"))
            }
            Schema::Tgi { .. } => {
                // One event per token: the delta's tokens are 4 bytes each.
                let first = so_far + 1 - (text.len() as u64).div_ceil(4).max(1);
                let mut events = String::new();
                for (i, token) in text.as_bytes().chunks(4).enumerate() {
                    let token = String::from_utf8_lossy(token);
                    let id = first + i as u64;
                    let event = json!({"index": id, "token": {"id": id, "text": token, "logprob": 0.0, "special": false},
                        "generated_text": null, "details": null});
                    events.push_str(&format!("data:{event}\n\n"));
                }
                part(&events)
            }
        }
    }

    fn epilogue(&self, u: &Usage<'_>) -> Vec<Bytes> {
        let finish = finish_reason(self, u.hit_max);
        match *self {
            Schema::OpenAi { include_usage, .. } => {
                let stop = json!({"object": "chat.completion.chunk", "model": u.model_id,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]});
                let mut events = format!("data: {stop}\n\n");
                if include_usage {
                    let usage = json!({"object": "chat.completion.chunk", "model": u.model_id, "choices": [],
                        "usage": {"prompt_tokens": u.input, "completion_tokens": u.output, "total_tokens": u.input + u.output}});
                    events.push_str(&format!("data: {usage}\n\n"));
                }
                events.push_str("data: [DONE]\n\n");
                vec![part(&events)]
            }
            Schema::Tgi { .. } => {
                let last = json!({"index": u.output, "token": null, "generated_text": "",
                    "details": {"finish_reason": finish, "generated_tokens": u.output, "seed": null}});
                vec![part(&format!("data:{last}\n\n"))]
            }
        }
    }
}

/// A paced stream that holds its slot on a copy until it ends, and counts the call served when
/// it ends in full.
struct Served {
    paced: Paced,
    slot: Option<Slot>,
    fleet: Arc<Fleet>,
    output: u64,
}

impl Served {
    fn new(paced: Paced, slot: Slot, fleet: Arc<Fleet>, output: u64) -> Served {
        Served {
            paced,
            slot: Some(slot),
            fleet,
            output,
        }
    }
}

impl futures_util::Stream for Served {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let next = std::pin::Pin::new(&mut this.paced).poll_next(cx);
        match &next {
            // The answer went out in full: the copy is free, the call served.
            std::task::Poll::Ready(None) if this.slot.take().is_some() => {
                this.fleet.served(this.output);
            }
            std::task::Poll::Ready(Some(Err(_))) => this.slot = None,
            _ => {}
        }
        next
    }
}

/// An error in sagemaker-runtime's shape: `x-amzn-ErrorType` and a JSON body.
pub(super) fn error(status: StatusCode, kind: &'static str, body: Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(X_AMZN_ERROR_TYPE, HeaderValue::from_static(kind));
    if let Ok(id) = HeaderValue::from_str(&new_request_id()) {
        h.insert(X_AMZN_REQUEST_ID, id);
    }
    r
}

/// `400 ValidationError`.
pub(super) fn validation(message: &str) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "ValidationError",
        json!({ "Message": message }),
    )
}

/// The container answered `status`: SageMaker's `424 ModelError` carrying it.
fn model_error(status: u16, original: &str) -> Response {
    let kind = if status < 500 { "client" } else { "server" };
    let message = format!(
        "Received {kind} error ({status}) from primary with message \"{original}\". See the endpoint's log stream for more information."
    );
    error(
        StatusCode::FAILED_DEPENDENCY,
        "ModelError",
        json!({
            "Message": message,
            "OriginalStatusCode": status,
            "OriginalMessage": original,
            "LogStreamArn": "arn:aws:logs:us-east-1:111122223333:log-group:/aws/sagemaker/Endpoints/simulated",
        }),
    )
}

fn no_capacity(fleet: &Fleet) -> Response {
    validation(&format!(
        "Inference Component {} has no capacity to process this request. ApplicationAutoScaling may be in-progress (if configured) or try to increase the capacity by invoking UpdateInferenceComponentRuntimeConfig API.",
        fleet
            .config
            .inference_component
            .as_deref()
            .unwrap_or(&fleet.config.name)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_each_schema() {
        let ask = read(br#"{"messages":[{"role":"user","content":"hello there"}],"max_tokens":30,"stream_options":{"include_usage":true}}"#, 99).unwrap();
        assert_eq!(
            ask.schema,
            Schema::OpenAi {
                chat: true,
                include_usage: true
            }
        );
        assert_eq!(ask.max_tokens, 30);
        let ask = read(
            br#"{"inputs":"abcdefgh","parameters":{"details":true}}"#,
            99,
        )
        .unwrap();
        assert_eq!(ask.schema, Schema::Tgi { details: true });
        assert_eq!((ask.input, ask.max_tokens), (2 + 3, 99));
        assert!(read(br#"{"instances":[1,2]}"#, 1).is_err());
        assert!(read(br#"{"inputs":"x","parameters":{"max_new_tokens":0}}"#, 1).is_err());
        assert!(read(b"1,2,3", 1).is_err());
    }

    #[test]
    fn tgi_streams_one_event_per_token() {
        let u = Usage {
            model_id: "e",
            input: 1,
            output: 3,
            hit_max: false,
            latency_ms: 0,
            first_byte_ms: 0,
            tier: None,
        };
        let frame = Schema::Tgi { details: false }.delta("abc def ghi", 3, &u);
        let mut reader = crate::bedrock::eventstream::FrameReader::new();
        reader.push(&frame);
        let f = reader.next_frame().unwrap().unwrap();
        assert_eq!(f.kind, "PayloadPart");
        let text = String::from_utf8(f.payload.to_vec()).unwrap();
        assert_eq!(text.matches("data:").count(), 3);
        assert!(text.contains(r#""id":1"#) && text.contains(r#""id":3"#));
    }
}
