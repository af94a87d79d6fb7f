//! Bedrock's restJson1 error shape: status code, `x-amzn-ErrorType`, `{"message": ...}` and an
//! `x-amzn-RequestId`. Used for the proxy's own errors and by the simulator.
//!
//! The OpenAI and Anthropic APIs on `bedrock-runtime` answer the same errors (the same status and
//! `x-amzn-ErrorType`) in their own body shape, which their SDKs read
//! ([`BedrockError::into_response_in`]): OpenAI `{"error": {"message", "type", "param",
//! "code"}}`, Anthropic `{"type": "error", "error": {"type", "message"}}`.

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde_json::json;

use super::api::Dialect;

/// The errors `bedrock-runtime` answers with (and the SDK error codes they map to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Throttling,
    ModelNotReady,
    ServiceUnavailable,
    InternalServer,
    Validation,
    ServiceQuotaExceeded,
    AccessDenied,
    UnrecognizedClient,
    ResourceNotFound,
    ModelTimeout,
    ModelError,
    ModelStreamError,
    UnknownOperation,
}

impl ErrorCode {
    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::Throttling | ErrorCode::ModelNotReady => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::InternalServer => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Validation | ErrorCode::ServiceQuotaExceeded => StatusCode::BAD_REQUEST,
            ErrorCode::AccessDenied | ErrorCode::UnrecognizedClient => StatusCode::FORBIDDEN,
            ErrorCode::ResourceNotFound | ErrorCode::UnknownOperation => StatusCode::NOT_FOUND,
            ErrorCode::ModelTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorCode::ModelError | ErrorCode::ModelStreamError => StatusCode::FAILED_DEPENDENCY,
        }
    }

    /// The `x-amzn-ErrorType` value, e.g. `ThrottlingException`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Throttling => "ThrottlingException",
            ErrorCode::ModelNotReady => "ModelNotReadyException",
            ErrorCode::ServiceUnavailable => "ServiceUnavailableException",
            ErrorCode::InternalServer => "InternalServerException",
            ErrorCode::Validation => "ValidationException",
            ErrorCode::ServiceQuotaExceeded => "ServiceQuotaExceededException",
            ErrorCode::AccessDenied => "AccessDeniedException",
            ErrorCode::UnrecognizedClient => "UnrecognizedClientException",
            ErrorCode::ResourceNotFound => "ResourceNotFoundException",
            ErrorCode::ModelTimeout => "ModelTimeoutException",
            ErrorCode::ModelError => "ModelErrorException",
            ErrorCode::ModelStreamError => "ModelStreamErrorException",
            ErrorCode::UnknownOperation => "UnknownOperationException",
        }
    }

    /// The event-stream `:exception-type`: the lowerCamel member name (`throttlingException`).
    pub fn event_member(self) -> String {
        let name = self.name();
        let mut out = String::with_capacity(name.len());
        let mut chars = name.chars();
        if let Some(first) = chars.next() {
            out.push(first.to_ascii_lowercase());
        }
        out.extend(chars);
        out
    }

    /// Parses an `x-amzn-ErrorType` value (which may carry a `:namespace` suffix).
    pub fn from_name(value: &str) -> Option<ErrorCode> {
        let name = value.split(':').next().unwrap_or(value).trim();
        ALL_CODES.into_iter().find(|c| c.name() == name)
    }

    /// Whether the SDKs retry it (see BEDROCK.md, "How SDKs retry").
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Throttling
                | ErrorCode::ModelNotReady
                | ErrorCode::ServiceUnavailable
                | ErrorCode::InternalServer
        )
    }
}

const ALL_CODES: [ErrorCode; 13] = [
    ErrorCode::Throttling,
    ErrorCode::ModelNotReady,
    ErrorCode::ServiceUnavailable,
    ErrorCode::InternalServer,
    ErrorCode::Validation,
    ErrorCode::ServiceQuotaExceeded,
    ErrorCode::AccessDenied,
    ErrorCode::UnrecognizedClient,
    ErrorCode::ResourceNotFound,
    ErrorCode::ModelTimeout,
    ErrorCode::ModelError,
    ErrorCode::ModelStreamError,
    ErrorCode::UnknownOperation,
];

pub const X_AMZN_ERROR_TYPE: HeaderName = HeaderName::from_static("x-amzn-errortype");
pub const X_AMZN_REQUEST_ID: HeaderName = HeaderName::from_static("x-amzn-requestid");

/// An error response in Bedrock's shape, with optional extra headers (retry hints,
/// `x-tokengate-*`).
#[derive(Debug, Clone)]
pub struct BedrockError {
    pub code: ErrorCode,
    pub message: String,
    /// Extra response headers (kept as a list: the error path is cold, and a small error keeps
    /// `Result`s small on the hot one).
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl BedrockError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        BedrockError {
            code,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Validation, message)
    }

    /// Adds a header; values that are not valid header text are dropped.
    pub fn with_header(mut self, name: impl Into<HeaderName>, value: impl AsRef<str>) -> Self {
        if let Ok(v) = HeaderValue::from_str(value.as_ref()) {
            self.headers.push((name.into(), v));
        }
        self
    }

    /// The JSON body, `{"message": "..."}`.
    pub fn body(&self) -> Bytes {
        Bytes::from(json!({ "message": self.message }).to_string())
    }

    /// The JSON body in `dialect`'s shape.
    pub fn body_in(&self, dialect: Dialect) -> Bytes {
        let body = match dialect {
            Dialect::Bedrock => return self.body(),
            Dialect::OpenAI => {
                let (kind, code) = openai_kind(self.code);
                json!({"error": {"message": self.message, "type": kind, "param": null, "code": code}})
            }
            Dialect::Anthropic => json!({
                "type": "error",
                "error": {"type": anthropic_kind(self.code.status()), "message": self.message},
            }),
        };
        Bytes::from(body.to_string())
    }

    /// The response in `dialect`'s body shape, with Bedrock's status, `x-amzn-ErrorType`, a
    /// request id and the extra headers (which may replace the error type).
    pub fn into_response_in(self, dialect: Dialect) -> Response {
        let body = self.body_in(dialect);
        let mut response = (self.code.status(), body).into_response();
        response.extensions_mut().insert(OwnAnswer(self.code));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            X_AMZN_ERROR_TYPE,
            HeaderValue::from_static(self.code.name()),
        );
        if let Ok(id) = HeaderValue::from_str(&new_request_id()) {
            headers.insert(X_AMZN_REQUEST_ID, id);
        }
        for (name, value) in self.headers {
            headers.insert(name, value);
        }
        response
    }
}

/// OpenAI's error `type` and `code` for a Bedrock error (OpenAI's own: `tokens` /
/// `rate_limit_exceeded` for a token rate limit, `invalid_request_error` for the caller's
/// mistakes).
fn openai_kind(code: ErrorCode) -> (&'static str, Option<&'static str>) {
    match code {
        ErrorCode::Throttling => ("tokens", Some("rate_limit_exceeded")),
        ErrorCode::ResourceNotFound => ("invalid_request_error", Some("model_not_found")),
        ErrorCode::UnknownOperation => ("invalid_request_error", Some("unknown_url")),
        ErrorCode::AccessDenied | ErrorCode::UnrecognizedClient => {
            ("invalid_request_error", Some("invalid_api_key"))
        }
        ErrorCode::ServiceUnavailable | ErrorCode::InternalServer => ("server_error", None),
        _ => ("invalid_request_error", None),
    }
}

/// Anthropic's error `type` for a status.
fn anthropic_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

impl std::fmt::Display for BedrockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

/// Marks a response tokengate answered itself (never upstream's), in its extensions: an answer
/// to a `sagemaker-runtime` call is renamed to that service's error names on its way out
/// ([`crate::sagemaker::error::own_answer`]).
#[derive(Debug, Clone, Copy)]
pub struct OwnAnswer(pub ErrorCode);

impl IntoResponse for BedrockError {
    fn into_response(self) -> Response {
        self.into_response_in(Dialect::Bedrock)
    }
}

/// A fresh request id in the UUID form AWS uses.
/// Whether an error body is Bedrock's daily-quota throttle (`Too many tokens per day, please
/// wait before trying again.`, BEDROCK-APIS.md "Daily quotas"): its message says "per day".
pub fn is_daily_quota(body: &[u8]) -> bool {
    const NEEDLE: &[u8] = b"per day";
    body.windows(NEEDLE.len())
        .any(|w| w.eq_ignore_ascii_case(NEEDLE))
}

pub fn new_request_id() -> String {
    let v: u128 = rand::random();
    let h = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_daily_throttle_is_told_by_its_message() {
        let daily = br#"{"message":"Too many tokens per day, please wait before trying again."}"#;
        assert!(is_daily_quota(daily));
        assert!(is_daily_quota(b"{\"Message\":\"Too Many Tokens Per Day\"}"));
        for minute in [
            &br#"{"message":"Too many tokens, please wait before trying again."}"#[..],
            br#"{"message":"Too many requests, please wait before trying again."}"#,
            b"",
        ] {
            assert!(!is_daily_quota(minute));
        }
    }

    use super::*;

    #[test]
    fn names_round_trip_and_member_names_are_lower_camel() {
        for code in ALL_CODES {
            assert_eq!(ErrorCode::from_name(code.name()), Some(code));
        }
        assert_eq!(ErrorCode::Throttling.event_member(), "throttlingException");
        assert_eq!(
            ErrorCode::from_name(
                "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"
            ),
            Some(ErrorCode::Throttling)
        );
    }

    #[test]
    fn response_has_bedrock_shape() {
        let r = BedrockError::new(ErrorCode::Throttling, "slow down")
            .with_header(HeaderName::from_static("x-amz-retry-after"), "1500")
            .into_response();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[X_AMZN_ERROR_TYPE], "ThrottlingException");
        assert_eq!(r.headers()["x-amz-retry-after"], "1500");
        assert!(r.headers().contains_key(X_AMZN_REQUEST_ID));
    }

    fn json(bytes: &Bytes) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn each_dialect_has_its_own_body_shape() {
        let e = BedrockError::new(ErrorCode::Throttling, "slow down");
        assert_eq!(
            json(&e.body_in(Dialect::Bedrock)),
            json!({"message": "slow down"})
        );
        assert_eq!(
            json(&e.body_in(Dialect::OpenAI)),
            json!({"error": {"message": "slow down", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}})
        );
        assert_eq!(
            json(&e.body_in(Dialect::Anthropic)),
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})
        );
        let bad = BedrockError::validation("no model");
        assert_eq!(
            json(&bad.body_in(Dialect::Anthropic))["error"]["type"],
            "invalid_request_error"
        );
        assert_eq!(
            json(&bad.body_in(Dialect::OpenAI))["error"]["type"],
            "invalid_request_error"
        );
        let r = BedrockError::new(ErrorCode::AccessDenied, "no")
            .with_header(X_AMZN_ERROR_TYPE, "MissingAuthenticationTokenException")
            .into_response_in(Dialect::Anthropic);
        assert_eq!(r.status(), 403);
        assert_eq!(
            r.headers()[X_AMZN_ERROR_TYPE],
            "MissingAuthenticationTokenException"
        );
    }
}
