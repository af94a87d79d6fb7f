//! `sagemaker-runtime`'s error shapes, for tokengate's own answers to endpoint calls.
//!
//! The service is restJson1 like `bedrock-runtime` (status, `x-amzn-ErrorType`, a JSON body with
//! the message), but names its errors its own way (botocore's service model, 2017-05-13):
//! `ValidationError` (400), `ModelError` (424), `InternalFailure` (500), `ServiceUnavailable`
//! (503), `ModelNotReadyException` (429), `InternalDependencyException` (530); in a response
//! stream, the `ModelStreamError` member (`ErrorCode` `StreamBroken` or
//! `ModelInvocationTimeExceeded`) and `InternalStreamFailure`. Throttling is not a modeled error:
//! tokengate answers `429 ThrottlingException`, which the SDKs retry by its code (botocore's
//! standard and legacy retry modes both list it) and whose `x-amz-retry-after` they honour.
//!
//! Nothing here reaches upstream's own answers: they pass through as SageMaker sent them. Only
//! responses tokengate made itself (marked [`OwnAnswer`]) are renamed.

use axum::response::Response;
use bytes::Bytes;
use http::HeaderValue;

use crate::bedrock::{
    ErrorCode,
    error::{OwnAnswer, X_AMZN_ERROR_TYPE},
    eventstream::member_exception_frame,
};

/// The `x-amzn-ErrorType` sagemaker-runtime uses for what Bedrock calls `code`.
pub fn error_type(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::Validation => "ValidationError",
        ErrorCode::ServiceUnavailable => "ServiceUnavailable",
        ErrorCode::InternalServer => "InternalFailure",
        ErrorCode::ModelError => "ModelError",
        ErrorCode::ModelStreamError => "ModelStreamError",
        // Not modeled by sagemaker-runtime: the names AWS services share.
        other => other.name(),
    }
}

/// Renames tokengate's own answer to an endpoint call to sagemaker-runtime's error names;
/// upstream's answers (unmarked) pass as they are.
pub fn own_answer(mut response: Response) -> Response {
    if let Some(OwnAnswer(code)) = response.extensions().get::<OwnAnswer>().copied() {
        response.headers_mut().insert(
            X_AMZN_ERROR_TYPE,
            HeaderValue::from_static(error_type(code)),
        );
    }
    response
}

/// The frame that ends an endpoint's response stream early: `ModelStreamError` (`StreamBroken`)
/// when upstream's stream broke or went quiet, `InternalStreamFailure` otherwise (tokengate's
/// drain deadline).
pub fn stream_exception_frame(code: ErrorCode, message: &str) -> Bytes {
    let (member, payload) = match code {
        ErrorCode::ModelStreamError => (
            "ModelStreamError",
            serde_json::json!({ "Message": message, "ErrorCode": "StreamBroken" }),
        ),
        _ => (
            "InternalStreamFailure",
            serde_json::json!({ "Message": message }),
        ),
    };
    member_exception_frame(member, payload.to_string().as_bytes())
}

#[cfg(test)]
mod tests {
    use axum::response::IntoResponse;

    use super::*;
    use crate::bedrock::{BedrockError, eventstream::FrameReader};

    #[test]
    fn own_answers_take_sagemaker_names_and_upstream_answers_stay() {
        let own = own_answer(BedrockError::validation("bad").into_response());
        assert_eq!(own.headers()[X_AMZN_ERROR_TYPE], "ValidationError");
        assert_eq!(own.status(), 400);
        let throttle = own_answer(BedrockError::new(ErrorCode::Throttling, "x").into_response());
        assert_eq!(throttle.headers()[X_AMZN_ERROR_TYPE], "ThrottlingException");
        let unavailable =
            own_answer(BedrockError::new(ErrorCode::ServiceUnavailable, "x").into_response());
        assert_eq!(
            unavailable.headers()[X_AMZN_ERROR_TYPE],
            "ServiceUnavailable"
        );

        let mut upstream = Response::new(axum::body::Body::empty());
        upstream.headers_mut().insert(
            X_AMZN_ERROR_TYPE,
            HeaderValue::from_static("ValidationException"),
        );
        let passed = own_answer(upstream);
        assert_eq!(passed.headers()[X_AMZN_ERROR_TYPE], "ValidationException");
    }

    #[test]
    fn stream_errors_are_the_services_members() {
        let mut reader = FrameReader::new();
        reader.push(&stream_exception_frame(ErrorCode::ModelStreamError, "cut"));
        reader.push(&stream_exception_frame(
            ErrorCode::ServiceUnavailable,
            "late",
        ));
        let cut = reader.next_frame().unwrap().unwrap();
        assert_eq!(
            (cut.message_type.as_str(), cut.kind.as_str()),
            ("exception", "ModelStreamError")
        );
        let payload: serde_json::Value = serde_json::from_slice(&cut.payload).unwrap();
        assert_eq!(payload["ErrorCode"], "StreamBroken");
        assert_eq!(payload["Message"], "cut");
        let late = reader.next_frame().unwrap().unwrap();
        assert_eq!(late.kind, "InternalStreamFailure");
    }
}
