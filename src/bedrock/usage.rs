//! Usage extraction from every response kind, fed incrementally as the response streams through.
//!
//! STUB: interface fixed, implementation pending.

use http::HeaderMap;
use serde::Serialize;

use super::Operation;

/// Token usage as Bedrock reports it at the end of a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_write_input_tokens: u64,
}

impl Usage {
    /// Bedrock's end-of-request quota charge: `input + cacheWrite + output x burndown`.
    /// Cache reads are not charged.
    pub fn charge(&self, burndown: u32) -> u64 {
        self.input_tokens
            .saturating_add(self.cache_write_input_tokens)
            .saturating_add(self.output_tokens.saturating_mul(u64::from(burndown)))
    }
}

/// How a response carries its usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseKind {
    /// Converse: a JSON body with `usage`.
    ConverseJson,
    /// ConverseStream: event stream, usage in the `metadata` event.
    ConverseStream,
    /// InvokeModel: `X-Amzn-Bedrock-*-Token-Count` headers, else the model-native body's usage.
    InvokeModel,
    /// InvokeModelWithResponseStream: `chunk` events; the last carries
    /// `amazon-bedrock-invocationMetrics`.
    InvokeModelStream,
}

impl ResponseKind {
    pub fn for_operation(op: Operation) -> Option<ResponseKind> {
        match op {
            Operation::Converse => Some(ResponseKind::ConverseJson),
            Operation::ConverseStream => Some(ResponseKind::ConverseStream),
            Operation::InvokeModel => Some(ResponseKind::InvokeModel),
            Operation::InvokeModelWithResponseStream => Some(ResponseKind::InvokeModelStream),
            _ => None,
        }
    }
}

/// Watches one successful (2xx) response go by and reports its usage the moment it is known.
#[derive(Debug)]
pub struct UsageObserver {
    kind: ResponseKind,
}

impl UsageObserver {
    pub fn new(kind: ResponseKind) -> Self {
        UsageObserver { kind }
    }

    pub fn kind(&self) -> ResponseKind {
        self.kind
    }

    /// Feeds the response headers. Returns the usage if the headers carry it (InvokeModel).
    pub fn on_headers(&mut self, _headers: &HeaderMap) -> Option<Usage> {
        None
    }

    /// Feeds one body chunk. Returns `Some` exactly once: when usage first becomes known.
    pub fn on_data(&mut self, _chunk: &[u8]) -> Option<Usage> {
        None
    }

    /// The body ended. Returns the usage if it becomes known only now (Converse JSON, InvokeModel
    /// body usage) and was not returned before.
    pub fn on_end(&mut self) -> Option<Usage> {
        None
    }

    /// An estimate of the output tokens generated so far, from the content seen; the basis for
    /// settling a stream that was cut before its usage arrived.
    pub fn output_tokens_seen(&self) -> u64 {
        0
    }

    /// The `:exception-type` of an exception frame seen in the stream, if any.
    pub fn stream_exception(&self) -> Option<&str> {
        None
    }
}
