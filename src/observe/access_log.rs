//! The access log: one structured line per proxied request, an INFO event with target
//! `tokengate::access` (JSON with `[log] format = "json"`; `RUST_LOG=tokengate::access=off` turns
//! it off).
//!
//! # When the line is written
//! - An admitted request: when its reservation is settled, so the line carries the charge and the
//!   settlement rule; for a stream that is when its usage arrives, before the last bytes reach the
//!   client.
//! - Anything else (rejected, invalid, passed through uncounted, unknown operation): when the
//!   answer is ready.
//!
//! [`super::Observation`] is consumed by the write, so a request has exactly one line.
//!
//! # Fields
//! | field | |
//! |---|---|
//! | `request_id` | the `x-amzn-RequestId` the client received: upstream's, or the one tokengate put on its own answer |
//! | `pool` | the pool, absent outside any pool; for a request that spilled, the pool it ran in |
//! | `spilled_from` | the request's home pool, when it could not admit it now and the request ran in `pool`, another of its `spill_to` chain |
//! | `route` | the caller's application route, once identified |
//! | `api` | the API family: `bedrock`, `openai_chat`, `openai_responses`, `anthropic_messages`, `sagemaker`; absent for an unknown path |
//! | `operation` | `Converse`, `ConverseStream`, `InvokeModel`, ..., `OpenAIChatCompletions`, `OpenAIResponses`, `AnthropicMessages`; absent for an unknown path |
//! | `model` | the modelId as the caller sent it (decoded from the path; the OpenAI and Anthropic APIs' body `model`) |
//! | `decision` | `admitted`, `queued_then_admitted`, `rejected` (429), `invalid` (4xx), `unavailable` (503: ledger or shutdown), `passthrough` (forwarded uncounted) |
//! | `status` | the HTTP status the client got (absent if the client left before any answer) |
//! | `reserved`, `charged`, `rule` | tokens reserved and charged, and the [settlement rule](crate::admission::hold); admitted requests only |
//! | `max_tokens`, `input_tokens`, `output_tokens` | maxTokens reserved, and the usage upstream reported (when it did) |
//! | `latency_ms` | from the request's arrival to settlement (admitted) or to the answer (others), queue wait included |
//! | `ttft_ms` | from arrival to the first generated content (streams: the first content event) |
//!
//! No bodies, no headers other than the request id, no credentials.

use super::Observation;
use crate::admission::Settled;

/// The `tracing` target of access-log events.
pub const TARGET: &str = "tokengate::access";

/// What happened to a request, as the access log says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admitted,
    QueuedThenAdmitted,
    Rejected,
    Invalid,
    Unavailable,
    Passthrough,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Admitted => "admitted",
            Verdict::QueuedThenAdmitted => "queued_then_admitted",
            Verdict::Rejected => "rejected",
            Verdict::Invalid => "invalid",
            Verdict::Unavailable => "unavailable",
            Verdict::Passthrough => "passthrough",
        }
    }
}

/// Writes the line of a request that was not admitted (or not counted).
pub fn unadmitted(obs: &Observation) {
    tracing::info!(
        target: TARGET,
        request_id = obs.request_id(),
        pool = obs.pool_name(),
        route = obs.route.as_deref(),
        api = obs.operation.map(|o| o.api().label()),
        operation = obs.operation.map(|o| o.name()),
        model = obs.model.as_deref(),
        decision = obs.verdict.map(Verdict::label),
        status = obs.status,
        latency_ms = millis(obs.arrived.elapsed()),
        "request"
    );
}

/// Writes the line of an admitted request, at its settlement.
pub fn settled(obs: &Observation, s: &Settled) {
    let ttft = obs
        .first_token
        .map(|t| millis(t.saturating_duration_since(obs.arrived)));
    tracing::info!(
        target: TARGET,
        request_id = obs.request_id(),
        pool = obs.pool_name(),
        spilled_from = obs.spilled_from.as_deref(),
        route = obs.route.as_deref(),
        api = obs.operation.map(|o| o.api().label()),
        operation = obs.operation.map(|o| o.name()),
        model = obs.model.as_deref(),
        decision = obs.verdict.map(Verdict::label),
        status = obs.status,
        reserved = s.reserved,
        charged = s.charge,
        rule = s.rule.label(),
        max_tokens = s.max_tokens,
        input_tokens = s.usage.map(|u| u.input_tokens),
        output_tokens = s.usage.map(|u| u.output_tokens),
        latency_ms = millis(obs.arrived.elapsed()),
        ttft_ms = ttft,
        "request"
    );
}

/// Milliseconds with microsecond precision.
fn millis(d: std::time::Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}
