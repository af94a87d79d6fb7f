//! The body-model APIs `bedrock-runtime` serves beside its own operations: OpenAI Chat
//! Completions (`POST /openai/v1/chat/completions`, also `/v1/chat/completions`), OpenAI
//! Responses (`POST /openai/v1/responses`) and Anthropic Messages (`POST /anthropic/v1/messages`).
//!
//! The model comes from the body's `model` (no percent-decoding; profile ids and ARNs as in a
//! path) and is charged through [`Call`] to the same bucket as the native operations for that
//! model, so Converse and Chat Completions callers drain one quota (V: "they aren't per-API").
//! The output cap is `max_completion_tokens` (else `max_tokens`) for chat, `max_output_tokens`
//! for Responses, `max_tokens` for Messages; absent, the model's maximum is reserved, as natively
//! (Anthropic's own API requires `max_tokens`; whether Bedrock's path does is U, and the
//! simulator accepts its absence). Input tokens follow [`super::request`]'s rule over
//! `messages`/`system` (chat, Messages) or `input`/`instructions` (Responses).
//!
//! Every error is in the API's own shape, with Bedrock's status and an `x-amzn-ErrorType`
//! header: OpenAI `{"error": {"message", "type", "param", "code"}}`, Anthropic `{"type":
//! "error", "error": {"type", "message"}}`. A call that does not fit is a 429 whose body carries
//! Bedrock's message (`Too many tokens, please wait before trying again.`, or `... per day ...`)
//! in the API's rate-limit shape (OpenAI `type: "tokens"`, `code: "rate_limit_exceeded"`;
//! Anthropic `rate_limit_error`), and no retry hint, as Bedrock's own 429s carry none (U: the
//! body Bedrock sends on these paths is not documented). A body without `model` or with bad
//! fields is a 400, an unknown model (not `{provider}.{model}` of a Bedrock provider) a 404, a
//! content type other than JSON a 400, any other path under `/openai/` or `/anthropic/` a 404.

mod chat;
mod messages;
mod responses;
mod sse;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, header};
use serde_json::Value;

use super::Inner;
use super::charge::{self, Call};
use super::generate;
use super::handlers::{self, Generation, MAX_BODY_BYTES, fault_response};
use super::request;
use super::tier::Tier;
use super::{auth, shapes::Framing};
use crate::bedrock::error::new_request_id;
use crate::bedrock::{BedrockError, Dialect, ErrorCode};

/// A body-model API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Responses,
    Messages,
}

/// A path of the body-model APIs: its dialect, and the API if it is one that is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub dialect: Dialect,
    pub api: Option<Api>,
}

impl Api {
    pub const ALL: [Api; 3] = [Api::ChatCompletions, Api::Responses, Api::Messages];

    /// The API's name in `/_sim/stats` (`operations` and `apis`).
    pub fn label(self) -> &'static str {
        match self {
            Api::ChatCompletions => "OpenAIChatCompletions",
            Api::Responses => "OpenAIResponses",
            Api::Messages => "AnthropicMessages",
        }
    }

    /// The endpoint of `path`, if it belongs to these APIs.
    pub fn of_path(path: &str) -> Option<Endpoint> {
        let (dialect, api) = match path {
            "/openai/v1/chat/completions" | "/v1/chat/completions" => {
                (Dialect::OpenAI, Some(Api::ChatCompletions))
            }
            "/openai/v1/responses" => (Dialect::OpenAI, Some(Api::Responses)),
            "/anthropic/v1/messages" => (Dialect::Anthropic, Some(Api::Messages)),
            p if p.starts_with("/openai/") => (Dialect::OpenAI, None),
            p if p.starts_with("/anthropic/") => (Dialect::Anthropic, None),
            _ => return None,
        };
        Some(Endpoint { dialect, api })
    }
}

/// What the simulator needs from a request body of these APIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub model: String,
    pub input_tokens: u64,
    /// The output cap, `None` when absent.
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// Chat: `stream_options.include_usage`.
    pub include_usage: bool,
    pub tier: Option<Tier>,
}

/// A 400 with this message.
type Invalid = String;

/// Answers one request to a body-model API.
pub(super) async fn handle(sim: &Inner, endpoint: Endpoint, parts: Parts, body: Body) -> Response {
    let dialect = endpoint.dialect;
    let fail = |e: BedrockError| error_response(dialect, e);
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return fail(BedrockError::validation(
            "The request body could not be read or is larger than 25 MB.",
        ));
    };
    if let Err(refusal) = auth::check(sim, &parts, &body) {
        return fail(refusal);
    }
    let api = match endpoint.api {
        Some(api) if parts.method == Method::POST => api,
        _ => {
            return fail(BedrockError::new(
                ErrorCode::UnknownOperation,
                format!(
                    "Unknown request URL: {} {}. Use POST /openai/v1/chat/completions, POST /openai/v1/responses or POST /anthropic/v1/messages.",
                    parts.method,
                    parts.uri.path()
                ),
            ));
        }
    };
    sim.count_api(api);
    sim.traceparents.observe(parts.headers.get("traceparent"));
    match answer(sim, api, &parts, &body).await {
        Ok(response) => response,
        Err(e) => fail(e),
    }
}

async fn answer(
    sim: &Inner,
    api: Api,
    parts: &Parts,
    body: &Bytes,
) -> Result<Response, BedrockError> {
    let content_type = parts.headers.get(header::CONTENT_TYPE);
    if content_type.is_some_and(|v| !v.to_str().unwrap_or("").starts_with("application/json")) {
        return Err(BedrockError::validation(
            "The request's Content-Type must be application/json.",
        ));
    }
    let ask = parse(api, body).map_err(BedrockError::validation)?;
    let model = sim
        .config
        .resolve(&ask.model, handlers::request_region(sim, parts));
    if !model.known {
        return Err(BedrockError::new(
            ErrorCode::ResourceNotFound,
            format!(
                "The model {:?} does not exist or you do not have access to it. Use a Bedrock model id, inference profile id or ARN (e.g. \"openai.gpt-oss-120b-1:0\").",
                ask.model
            ),
        ));
    }
    let model_max = sim.config.max_output_tokens_for(&model.base);
    request::check_max(ask.max_tokens, model_max).map_err(BedrockError::validation)?;
    let call = Call::arrive(sim, api.label(), &model, ask.tier)
        .map_err(|refusal| BedrockError::validation(refusal.to_string()))?;
    let max_tokens = ask.max_tokens.unwrap_or(model_max);
    let plan = generate::plan(
        &sim.config,
        body,
        max_tokens,
        ask.stream,
        sim.next_arrival(),
    );
    let dialect = Endpoint::dialect_of(api);
    if let Some(early) = fault_response(sim, &call, plan.fault, |e| error_response(dialect, e)) {
        return Ok(early);
    }
    let admitted = call
        .reserve(ask.input_tokens + max_tokens, ask.input_tokens)
        .map_err(|shortfall| {
            BedrockError::new(ErrorCode::Throttling, charge::throttle_message(shortfall))
        })?;
    let generation = Generation::new(sim, &plan, &ask.model, ask.input_tokens, admitted);
    let id = generation.request_id.replace('-', "");
    if ask.stream {
        let framing: Box<dyn Framing> = match api {
            Api::ChatCompletions => Box::new(chat::Sse::new(&id, ask.include_usage)),
            Api::Responses => Box::new(responses::Sse::new(&id, &generation.text)),
            Api::Messages => Box::new(messages::Sse::new(&id)),
        };
        let request_id = generation.request_id.clone();
        let body = generation.stream(sim, framing.as_ref());
        return Ok(respond(
            body,
            "text/event-stream; charset=utf-8",
            &request_id,
        ));
    }
    let done = match generation.finish().await {
        Ok(done) => done,
        Err(broken) => return Ok(respond(broken, "application/json", &new_request_id())),
    };
    let v = match api {
        Api::ChatCompletions => chat::body(&id, &done.text, &done.usage),
        Api::Responses => responses::body(&id, &done.text, &done.usage),
        Api::Messages => messages::body(&id, &done.text, &done.usage),
    };
    Ok(respond(
        Body::from(v.to_string()),
        "application/json",
        &done.request_id,
    ))
}

impl Endpoint {
    fn dialect_of(api: Api) -> Dialect {
        match api {
            Api::ChatCompletions | Api::Responses => Dialect::OpenAI,
            Api::Messages => Dialect::Anthropic,
        }
    }
}

fn parse(api: Api, body: &[u8]) -> Result<Ask, Invalid> {
    let v = request::parse_object(body)?;
    let model = match v.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(_) => return Err("model must be a non-empty string naming a Bedrock model id, inference profile id or ARN.".into()),
        None => return Err("model is required: name a Bedrock model id, inference profile id or ARN.".into()),
    };
    let stream = match request::at(&v, &["stream"]) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream must be true or false.".into()),
    };
    let ask = Ask {
        model,
        input_tokens: 0,
        max_tokens: None,
        stream,
        include_usage: false,
        tier: None,
    };
    match api {
        Api::ChatCompletions => chat::parse(&v, ask),
        Api::Responses => responses::parse(&v, ask),
        Api::Messages => messages::parse(&v, ask),
    }
}

/// The `service_tier` string of a body, read by `parse_tier`.
fn service_tier(
    v: &Value,
    parse_tier: fn(&str) -> Result<Tier, super::tier::UnknownTier>,
) -> Result<Option<Tier>, Invalid> {
    match request::at(v, &["service_tier"]) {
        None => Ok(None),
        Some(Value::String(name)) => parse_tier(name).map(Some).map_err(|e| e.to_string()),
        Some(_) => Err("service_tier must be a string.".into()),
    }
}

fn respond(body: Body, content_type: &'static str, request_id: &str) -> Response {
    let mut response = handlers::respond(body, "application/json", request_id);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A Bedrock error in the dialect's shape, with Bedrock's status and error type header.
pub(super) fn error_response(dialect: Dialect, e: BedrockError) -> Response {
    e.into_response_in(dialect)
}

/// Seconds since the Unix epoch, for `created` fields.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
