//! Operations and their REST paths.
//!
//! The list also holds the two `sagemaker-runtime` invocations tokengate admits for endpoint
//! pools (InvokeEndpoint, InvokeEndpointWithResponseStream): they are metered, observed and
//! labelled like the model calls; their paths are parsed in [`crate::sagemaker::operation`].
//!
//! SDKs percent-encode the modelId in the path (`:` as `%3A`, `/` as `%2F`, so ARNs stay one
//! segment). We route on the raw path: the model segment is everything between `/model/` and the
//! last `/{operation}`, decoded exactly once. The raw path is forwarded upstream unchanged.
//!
//! So what is admitted is what upstream acts on, a path is refused ([`TargetError::UnsafePath`],
//! a `ValidationException`) when any segment, raw or decoded once (`%2F` inside a modelId
//! included), is empty (`//`), `.` or `..`, or when it holds `%25` (an encoded `%`: the path is
//! encoded twice): a server that normalises or decodes again would see another resource than the one
//! admitted. No SDK sends such paths.

use http::Method;
use percent_encoding::percent_decode_str;

use super::api::{self, Api};

/// A `bedrock-runtime` operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Converse,
    ConverseStream,
    InvokeModel,
    InvokeModelWithResponseStream,
    InvokeModelWithBidirectionalStream,
    CountTokens,
    ApplyGuardrail,
    InvokeGuardrailChecks,
    StartAsyncInvoke,
    GetAsyncInvoke,
    ListAsyncInvokes,
    /// OpenAI Chat Completions (`/openai/v1/chat/completions`, `/v1/chat/completions`).
    OpenAIChatCompletions,
    /// OpenAI Responses (`/openai/v1/responses`).
    OpenAIResponses,
    /// Anthropic Messages (`/anthropic/v1/messages`).
    AnthropicMessages,
    /// sagemaker-runtime `POST /endpoints/{EndpointName}/invocations`.
    InvokeEndpoint,
    /// sagemaker-runtime `POST /endpoints/{EndpointName}/invocations-response-stream`.
    InvokeEndpointWithResponseStream,
}

impl Operation {
    pub const ALL: [Operation; 16] = [
        Operation::Converse,
        Operation::ConverseStream,
        Operation::InvokeModel,
        Operation::InvokeModelWithResponseStream,
        Operation::InvokeModelWithBidirectionalStream,
        Operation::CountTokens,
        Operation::ApplyGuardrail,
        Operation::InvokeGuardrailChecks,
        Operation::StartAsyncInvoke,
        Operation::GetAsyncInvoke,
        Operation::ListAsyncInvokes,
        Operation::OpenAIChatCompletions,
        Operation::OpenAIResponses,
        Operation::AnthropicMessages,
        Operation::InvokeEndpoint,
        Operation::InvokeEndpointWithResponseStream,
    ];

    /// The position of this operation in [`Operation::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The operation's name as AWS spells it (and as metrics label it).
    pub fn name(self) -> &'static str {
        match self {
            Operation::Converse => "Converse",
            Operation::ConverseStream => "ConverseStream",
            Operation::InvokeModel => "InvokeModel",
            Operation::InvokeModelWithResponseStream => "InvokeModelWithResponseStream",
            Operation::InvokeModelWithBidirectionalStream => "InvokeModelWithBidirectionalStream",
            Operation::CountTokens => "CountTokens",
            Operation::ApplyGuardrail => "ApplyGuardrail",
            Operation::InvokeGuardrailChecks => "InvokeGuardrailChecks",
            Operation::StartAsyncInvoke => "StartAsyncInvoke",
            Operation::GetAsyncInvoke => "GetAsyncInvoke",
            Operation::ListAsyncInvokes => "ListAsyncInvokes",
            Operation::OpenAIChatCompletions => "OpenAIChatCompletions",
            Operation::OpenAIResponses => "OpenAIResponses",
            Operation::AnthropicMessages => "AnthropicMessages",
            Operation::InvokeEndpoint => "InvokeEndpoint",
            Operation::InvokeEndpointWithResponseStream => "InvokeEndpointWithResponseStream",
        }
    }

    /// The API family the operation belongs to.
    pub fn api(self) -> Api {
        match self {
            Operation::OpenAIChatCompletions => Api::OpenAIChat,
            Operation::OpenAIResponses => Api::OpenAIResponses,
            Operation::AnthropicMessages => Api::AnthropicMessages,
            Operation::InvokeEndpoint | Operation::InvokeEndpointWithResponseStream => {
                Api::SageMaker
            }
            _ => Api::Bedrock,
        }
    }

    /// Whether the body's `model` names the model (the OpenAI and Anthropic APIs): whether it
    /// streams is the body's `stream` too.
    pub fn model_in_body(self) -> bool {
        !matches!(self.api(), Api::Bedrock | Api::SageMaker)
    }

    /// The trailing path segment of a `/model/{modelId}/{segment}` operation.
    pub fn model_segment(self) -> Option<&'static str> {
        match self {
            Operation::Converse => Some("converse"),
            Operation::ConverseStream => Some("converse-stream"),
            Operation::InvokeModel => Some("invoke"),
            Operation::InvokeModelWithResponseStream => Some("invoke-with-response-stream"),
            Operation::InvokeModelWithBidirectionalStream => {
                Some("invoke-with-bidirectional-stream")
            }
            Operation::CountTokens => Some("count-tokens"),
            _ => None,
        }
    }

    /// Whether the call draws on the model's tokens-per-minute quota (Bedrock's on-demand
    /// throughput), or on an endpoint's copies. CountTokens is free of charge; guardrails and
    /// async jobs are billed apart.
    pub fn consumes_quota(self) -> bool {
        matches!(
            self,
            Operation::Converse
                | Operation::ConverseStream
                | Operation::InvokeModel
                | Operation::InvokeModelWithResponseStream
                | Operation::InvokeModelWithBidirectionalStream
                | Operation::OpenAIChatCompletions
                | Operation::OpenAIResponses
                | Operation::AnthropicMessages
        ) || self.is_endpoint()
    }

    /// Whether it is a sagemaker-runtime call to a real-time endpoint.
    pub fn is_endpoint(self) -> bool {
        matches!(
            self,
            Operation::InvokeEndpoint | Operation::InvokeEndpointWithResponseStream
        )
    }

    /// Whether the response is always an `application/vnd.amazon.eventstream`.
    pub fn is_streaming(self) -> bool {
        matches!(
            self,
            Operation::ConverseStream
                | Operation::InvokeModelWithResponseStream
                | Operation::InvokeModelWithBidirectionalStream
                | Operation::InvokeEndpointWithResponseStream
        )
    }

    /// Whether bedrock-runtime accepts a Bedrock API key (`Authorization: Bearer`) for it: every
    /// operation but the bidirectional stream, which takes SigV4 only (V, BEDROCK-APIS.md).
    /// sagemaker-runtime's endpoint calls take SigV4 only.
    pub fn accepts_api_key(self) -> bool {
        self != Operation::InvokeModelWithBidirectionalStream && !self.is_endpoint()
    }

    /// The IAM action that authorizes the call, as AWS documents it: the API reference says
    /// which action Converse, ConverseStream, StartAsyncInvoke and
    /// InvokeModelWithBidirectionalStream need (`bedrock:InvokeModel` or
    /// `bedrock:InvokeModelWithResponseStream`); the Service Authorization Reference for Amazon
    /// Bedrock lists the others under their own names. `None` where AWS documents no action
    /// (InvokeGuardrailChecks, as of the 2026-06 launch). The README's IAM policy is checked
    /// against this table (`tests/it/iam_policy.rs`).
    ///
    /// The OpenAI and Anthropic APIs run model inference: AWS's pages for them name no action of
    /// their own, so this reads them as `bedrock:InvokeModel` (and their streamed calls as
    /// `bedrock:InvokeModelWithResponseStream`, which the README's policy grants too) (U).
    pub fn iam_action(self) -> Option<&'static str> {
        match self {
            Operation::Converse
            | Operation::InvokeModel
            | Operation::StartAsyncInvoke
            | Operation::InvokeModelWithBidirectionalStream
            | Operation::OpenAIChatCompletions
            | Operation::OpenAIResponses
            | Operation::AnthropicMessages => Some("bedrock:InvokeModel"),
            Operation::ConverseStream | Operation::InvokeModelWithResponseStream => {
                Some("bedrock:InvokeModelWithResponseStream")
            }
            Operation::CountTokens => Some("bedrock:CountTokens"),
            Operation::ApplyGuardrail => Some("bedrock:ApplyGuardrail"),
            Operation::GetAsyncInvoke => Some("bedrock:GetAsyncInvoke"),
            Operation::ListAsyncInvokes => Some("bedrock:ListAsyncInvokes"),
            // The sagemaker-runtime service model documents both as needing this one action.
            Operation::InvokeEndpoint | Operation::InvokeEndpointWithResponseStream => {
                Some("sagemaker:InvokeEndpoint")
            }
            Operation::InvokeGuardrailChecks => None,
        }
    }

    /// Whether the request body is a Converse-shaped JSON document (as opposed to a
    /// model-native InvokeModel body).
    pub fn is_converse(self) -> bool {
        matches!(self, Operation::Converse | Operation::ConverseStream)
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a request addresses: the operation and, for model operations, the decoded modelId (the
/// OpenAI and Anthropic APIs name theirs in the body: `None` here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub operation: Operation,
    /// The modelId, percent-decoded once. `None` for operations without one in the path.
    pub model_id: Option<String>,
}

/// Why a path is not a `bedrock-runtime` operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("no bedrock-runtime operation is served at {method} {path}")]
    UnknownOperation { method: String, path: String },
    #[error("the modelId in the path is empty")]
    EmptyModelId,
    #[error("the modelId in the path is not valid percent-encoded UTF-8")]
    BadModelIdEncoding,
    #[error("the path {path} {problem}")]
    UnsafePath { path: String, problem: &'static str },
}

impl Target {
    /// Parses a request line. `raw_path` is the path exactly as received, without the query.
    pub fn parse(method: &Method, raw_path: &str) -> Result<Target, TargetError> {
        let unknown = || TargetError::UnknownOperation {
            method: method.to_string(),
            path: raw_path.to_string(),
        };
        check_segments(raw_path)?;
        if let Some(rest) = raw_path.strip_prefix("/model/") {
            if method != Method::POST {
                return Err(unknown());
            }
            let (encoded_model, segment) = rest.rsplit_once('/').ok_or_else(unknown)?;
            let operation = Operation::ALL
                .into_iter()
                .find(|op| op.model_segment() == Some(segment))
                .ok_or_else(unknown)?;
            if encoded_model.is_empty() {
                return Err(TargetError::EmptyModelId);
            }
            let model_id = decode_once(encoded_model)?;
            if model_id.is_empty() {
                return Err(TargetError::EmptyModelId);
            }
            return Ok(Target {
                operation,
                model_id: Some(model_id),
            });
        }
        if let (&Method::POST, Some(operation)) = (method, api::body_model_operation(raw_path)) {
            return Ok(Target {
                operation,
                model_id: None,
            });
        }
        let operation = match (method, raw_path) {
            (&Method::POST, "/guardrail-checks/invoke") => Operation::InvokeGuardrailChecks,
            (&Method::POST, "/async-invoke") => Operation::StartAsyncInvoke,
            (&Method::GET, "/async-invoke") => Operation::ListAsyncInvokes,
            (&Method::GET, p) if p.starts_with("/async-invoke/") && p.len() > 14 => {
                Operation::GetAsyncInvoke
            }
            (&Method::POST, p) if is_apply_guardrail(p) => Operation::ApplyGuardrail,
            _ => return Err(unknown()),
        };
        Ok(Target {
            operation,
            model_id: None,
        })
    }
}

/// Characters left as they are in a modelId path segment; everything else is percent-encoded, as
/// the SDKs do (`:` as `%3A`, `/` as `%2F`).
pub const MODEL_ID_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `/model/{model_id}/{segment}` for `operation`, the modelId percent-encoded as the SDKs do
/// ([`MODEL_ID_SEGMENT`]), with `query` (`None` or `Some("a=b")`) kept; `None` for an operation
/// that names no model in its path.
pub fn model_path(operation: Operation, model_id: &str, query: Option<&str>) -> Option<String> {
    let segment = operation.model_segment()?;
    let encoded = percent_encoding::utf8_percent_encode(model_id, MODEL_ID_SEGMENT);
    Some(match query {
        Some(q) => format!("/model/{encoded}/{segment}?{q}"),
        None => format!("/model/{encoded}/{segment}"),
    })
}

/// The path and query of `uri` exactly as received (what is forwarded and signed).
pub fn raw_path_and_query(uri: &http::Uri) -> &str {
    uri.path_and_query().map_or(uri.path(), |p| p.as_str())
}

/// Refuses paths whose segments, raw or decoded once, are empty, `.` or `..`, or that hold a
/// `%25` (see the module doc). `/` alone is left to routing.
fn check_segments(raw_path: &str) -> Result<(), TargetError> {
    let unsafe_path = |problem| TargetError::UnsafePath {
        path: raw_path.to_string(),
        problem,
    };
    let Some(rest) = raw_path.strip_prefix('/').filter(|r| !r.is_empty()) else {
        return Ok(());
    };
    for raw in rest.split('/') {
        if raw.contains("%25") {
            return Err(unsafe_path(
                "is percent-encoded twice (%25); encode each character once, as the AWS SDKs do",
            ));
        }
        for part in percent_decode_str(raw).decode_utf8_lossy().split('/') {
            match part {
                "" => {
                    return Err(unsafe_path(
                        "has an empty segment (//); send the path the AWS SDKs send",
                    ));
                }
                "." | ".." => {
                    return Err(unsafe_path(
                        "has a '.' or '..' segment; send the path the AWS SDKs send, without dot segments",
                    ));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// `/guardrail/{id}/version/{version}/apply`
fn is_apply_guardrail(path: &str) -> bool {
    let mut parts = path.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(""), Some("guardrail"), Some(id), Some("version"), Some(v), Some("apply"), None)
            if !id.is_empty() && !v.is_empty()
    )
}

fn decode_once(encoded: &str) -> Result<String, TargetError> {
    // Reject malformed escapes ("%G1", a trailing "%") rather than passing them through literally.
    let bytes = encoded.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'%' {
            let ok = bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit));
            if !ok {
                return Err(TargetError::BadModelIdEncoding);
            }
        }
    }
    percent_decode_str(encoded)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| TargetError::BadModelIdEncoding)
}

#[cfg(test)]
#[path = "operation_tests.rs"]
mod tests;
