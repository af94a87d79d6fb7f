//! The access log: one structured line per proxied request, an INFO event with target
//! `tokengate::access` (JSON with `[log] format = "json"`; `RUST_LOG=tokengate::access=off` turns
//! it off).
//!
//! # When the line is written
//! - An admitted request: when its reservation is settled ([`crate::admission::Admitted`] owns the
//!   record from admission on), so the line carries the charge and the settlement rule; for a
//!   stream that is when its usage arrives, before the last bytes reach the client.
//! - Anything else (rejected, invalid, passed through uncounted, unknown operation): when the
//!   response head is sent ([`crate::proxy::handle`]).
//!
//! Exactly one of the two writes it: handing the record to the guard takes it out of the proxy.
//!
//! # Fields
//! | field | |
//! |---|---|
//! | `request_id` | the `x-amzn-RequestId` the client received: upstream's, or the one tokengate put on its own answer |
//! | `pool` | the pool, absent outside any pool |
//! | `route` | the caller's application route, once identified |
//! | `operation` | `Converse`, `ConverseStream`, `InvokeModel`, ...; absent for an unknown path |
//! | `model` | the modelId as the caller sent it (decoded) |
//! | `decision` | `admitted`, `queued_then_admitted`, `rejected` (429), `invalid` (4xx), `unavailable` (503: ledger or shutdown), `passthrough` (forwarded uncounted) |
//! | `status` | the HTTP status the client got (absent if the client left before any answer) |
//! | `reserved`, `charged`, `rule` | tokens reserved and charged, and the [settlement rule](crate::admission::settle); admitted requests only |
//! | `max_tokens`, `input_tokens`, `output_tokens` | maxTokens reserved, and the usage upstream reported (when it did) |
//! | `latency_ms` | from the request's arrival to settlement (admitted) or to the response head (others), queue wait included |
//! | `ttft_ms` | from arrival to the first generated content (streams: the first content event) |
//!
//! No bodies, no headers other than the request id, no credentials.

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use crate::bedrock::{Usage, error::X_AMZN_REQUEST_ID};

/// The `tracing` target of access-log events.
pub const TARGET: &str = "tokengate::access";

/// What happened to a request at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Admitted,
    QueuedThenAdmitted,
    Rejected,
    Invalid,
    Unavailable,
    Passthrough,
}

impl Decision {
    pub fn label(self) -> &'static str {
        match self {
            Decision::Admitted => "admitted",
            Decision::QueuedThenAdmitted => "queued_then_admitted",
            Decision::Rejected => "rejected",
            Decision::Invalid => "invalid",
            Decision::Unavailable => "unavailable",
            Decision::Passthrough => "passthrough",
        }
    }

    /// The decision behind a response tokengate answered itself.
    fn from_status(status: StatusCode) -> Decision {
        match status.as_u16() {
            429 => Decision::Rejected,
            503 => Decision::Unavailable,
            _ => Decision::Invalid,
        }
    }
}

/// What a settled request adds to its line.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    pub pool: &'a str,
    pub reserved: u64,
    pub charged: u64,
    pub rule: &'static str,
    pub max_tokens: u64,
    pub usage: Option<Usage>,
    pub first_token: Option<Instant>,
}

/// One request's line, filled in as the request goes.
#[derive(Debug)]
pub struct AccessRecord {
    arrived: Instant,
    operation: Option<&'static str>,
    model: Option<String>,
    route: Option<std::sync::Arc<str>>,
    decision: Option<Decision>,
    status: Option<u16>,
    request_id: Option<http::HeaderValue>,
}

impl AccessRecord {
    /// A record for a request that arrived now.
    pub fn start() -> AccessRecord {
        AccessRecord {
            arrived: Instant::now(),
            operation: None,
            model: None,
            route: None,
            decision: None,
            status: None,
            request_id: None,
        }
    }

    pub fn target(&mut self, operation: &'static str, model: Option<&str>) {
        self.operation = Some(operation);
        self.model = model.map(str::to_string);
    }

    /// The route the caller identified as.
    pub fn route(&mut self, route: &std::sync::Arc<str>) {
        self.route = Some(route.clone());
    }

    pub fn decide(&mut self, decision: Decision) {
        self.decision = Some(decision);
    }

    pub fn decision(&self) -> Option<Decision> {
        self.decision
    }

    /// The answer the client gets: its status and request id.
    pub fn answered(&mut self, status: StatusCode, headers: &HeaderMap) {
        self.status = Some(status.as_u16());
        if let Some(id) = headers.get(X_AMZN_REQUEST_ID) {
            self.request_id = Some(id.clone());
        }
    }

    /// Writes the line of a request that was not admitted (or not counted), answered with
    /// `status` and `headers`.
    pub fn finish_unadmitted(mut self, status: StatusCode, headers: &HeaderMap) {
        self.answered(status, headers);
        let decision = self
            .decision
            .unwrap_or_else(|| Decision::from_status(status));
        let pool = headers
            .get(crate::admission::X_TOKENGATE_POOL)
            .and_then(|v| v.to_str().ok());
        tracing::info!(
            target: TARGET,
            request_id = self.request_id(),
            pool,
            route = self.route.as_deref(),
            operation = self.operation,
            model = self.model.as_deref(),
            decision = decision.label(),
            status = self.status,
            latency_ms = millis(self.arrived.elapsed()),
            "request"
        );
    }

    /// Writes the line of an admitted request, at its settlement.
    pub fn finish_settled(self, s: &Settlement<'_>) {
        let decision = self.decision.unwrap_or(Decision::Admitted);
        let ttft = s
            .first_token
            .map(|t| millis(t.saturating_duration_since(self.arrived)));
        tracing::info!(
            target: TARGET,
            request_id = self.request_id(),
            pool = s.pool,
            route = self.route.as_deref(),
            operation = self.operation,
            model = self.model.as_deref(),
            decision = decision.label(),
            status = self.status,
            reserved = s.reserved,
            charged = s.charged,
            rule = s.rule,
            max_tokens = s.max_tokens,
            input_tokens = s.usage.map(|u| u.input_tokens),
            output_tokens = s.usage.map(|u| u.output_tokens),
            latency_ms = millis(self.arrived.elapsed()),
            ttft_ms = ttft,
            "request"
        );
    }

    fn request_id(&self) -> Option<&str> {
        self.request_id.as_ref().and_then(|v| v.to_str().ok())
    }
}

/// Milliseconds with microsecond precision.
fn millis(d: std::time::Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_of_tokengate_answers() {
        assert_eq!(
            Decision::from_status(StatusCode::TOO_MANY_REQUESTS),
            Decision::Rejected
        );
        assert_eq!(
            Decision::from_status(StatusCode::SERVICE_UNAVAILABLE),
            Decision::Unavailable
        );
        assert_eq!(
            Decision::from_status(StatusCode::BAD_REQUEST),
            Decision::Invalid
        );
        assert_eq!(
            Decision::from_status(StatusCode::NOT_FOUND),
            Decision::Invalid
        );
    }
}
