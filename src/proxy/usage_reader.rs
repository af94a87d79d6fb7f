//! Where a response's usage is read from, whichever API answered: Bedrock's
//! [`UsageObserver`] for a bedrock-runtime model call, an endpoint container's
//! [`PayloadUsage`] for a sagemaker-runtime call. Reading never fails: a response whose usage
//! cannot be read yields none, and the meter settles it by the `no_usage` rule ([`super::meter`]).

use crate::{
    bedrock::{ErrorCode, Operation, Usage, UsageObserver, usage::ResponseKind},
    sagemaker::PayloadUsage,
};

/// Where a response's usage is read from.
#[derive(Debug)]
pub enum UsageReader {
    /// A bedrock-runtime model call.
    Bedrock(UsageObserver),
    /// A sagemaker-runtime endpoint call: the container's payload.
    Endpoint(PayloadUsage),
}

impl UsageReader {
    /// The reader for a response to `operation` of `kind` (Bedrock's, read from its head), if
    /// its usage is read at all.
    pub fn for_response(operation: Operation, kind: Option<ResponseKind>) -> Option<UsageReader> {
        if operation.is_endpoint() {
            return Some(UsageReader::Endpoint(PayloadUsage::new(
                operation.is_streaming(),
            )));
        }
        kind.map(|kind| UsageReader::Bedrock(UsageObserver::new(kind)))
    }

    /// The response head: Bedrock's InvokeModel may carry its usage there.
    pub fn on_headers(&mut self, headers: &http::HeaderMap) -> Option<Usage> {
        match self {
            UsageReader::Bedrock(u) => u.on_headers(headers),
            UsageReader::Endpoint(_) => None,
        }
    }

    pub(super) fn on_data(&mut self, data: &[u8]) -> Option<Usage> {
        match self {
            UsageReader::Bedrock(u) => u.on_data(data),
            UsageReader::Endpoint(u) => u.on_data(data),
        }
    }

    pub(super) fn on_end(&mut self) -> Option<Usage> {
        match self {
            UsageReader::Bedrock(u) => u.on_end(),
            UsageReader::Endpoint(u) => u.on_end(),
        }
    }

    /// Whether the output stopped at its cap (Bedrock's stop reasons; endpoint payloads say
    /// none this proxy reads).
    pub(super) fn truncated(&self) -> bool {
        match self {
            UsageReader::Bedrock(u) => u.truncated(),
            UsageReader::Endpoint(_) => false,
        }
    }

    pub(super) fn output_tokens_seen(&self) -> u64 {
        match self {
            UsageReader::Bedrock(u) => u.output_tokens_seen(),
            UsageReader::Endpoint(u) => u.output_tokens_seen(),
        }
    }

    /// A bidirectional stream's running totals so far (only Bedrock's bidirectional streams
    /// report usage before they end).
    pub(super) fn running_usage(&self) -> Option<Usage> {
        match self {
            UsageReader::Bedrock(u) => u.running_usage(),
            UsageReader::Endpoint(_) => None,
        }
    }

    /// A bidirectional stream that ended on a `throttlingException` before any usage: upstream
    /// never started the session (Bedrock reserves when the session starts).
    pub(super) fn refused_in_band(&self) -> bool {
        let UsageReader::Bedrock(u) = self else {
            return false;
        };
        u.kind() == ResponseKind::BidirectionalStream
            && u.running_usage().is_none()
            && u.stream_exception() == Some(ErrorCode::Throttling.event_member().as_str())
    }
}
