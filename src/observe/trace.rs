//! OpenTelemetry traces of requests (`[tracing] otlp_endpoint`): W3C trace context in and out,
//! and the spans of one request, built from its [`super::Observation`] when its line is written.
//!
//! # Spans
//! One `SERVER` span per request, named `{gen_ai.operation.name} {model}`, with the GenAI
//! semantic conventions (`gen_ai.system` and `gen_ai.provider.name` = `aws.bedrock`, or
//! `aws.sagemaker` for an endpoint call,
//! `gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.request.max_tokens`,
//! `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`) and tokengate's own
//! (`tokengate.pool`, `.spilled_from` (the home pool of a request that ran in another pool of its
//! chain), `.route`, `.decision`, `.reservation`, `.charge`, `.settlement_rule`,
//! `.queue_wait_ms`, `.rejection_reason`, `.retry_after_ms`), plus `http.response.status_code`
//! and `aws.request_id`. Its children: `queue wait` (`INTERNAL`) for a request that waited in
//! the admission queue, and `BedrockRuntime/{Operation}` (`CLIENT`, `rpc.*` attributes) for
//! the call upstream, from its sending to its settlement (for a request forwarded uncounted,
//! to its response head). A 5xx answer marks the spans as errors.
//!
//! # Context
//! A valid `traceparent` from the caller makes the request span its child, in its trace, and
//! its sampled flag decides whether the request is traced; without one, a new trace is started
//! for `sample_ratio` of requests. Upstream receives `traceparent` naming the upstream span (and
//! the caller's `tracestate` unchanged), so a trace continues into Bedrock's side. A request
//! that is not traced (tracing off, or the caller's context not sampled) forwards the caller's
//! valid `traceparent` and its `tracestate` untouched (a SigV4 caller's only if it signed them,
//! as for every header that goes upstream).
//!
//! Off (no `otlp_endpoint`) the observer holds no tracer and an observation carries no trace:
//! one branch per request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry_proto::tonic::{
    common::v1::{AnyValue, KeyValue, any_value},
    trace::v1::{Span, Status, span::SpanKind, status::StatusCode},
};
use tokio::time::Instant;

use super::{Observation, Verdict};
use crate::{
    admission::{Decision, Settled},
    bedrock::{Api, Operation},
};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Span flags: the W3C sampled bit, "the parent's remoteness is known", "the parent is remote".
const SAMPLED: u32 = 0x01;
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// A caller's `traceparent`, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceParent {
    /// `00-{32 hex}-{16 hex}-{2 hex}` (a later version may append fields); `None` if invalid,
    /// including all-zero ids and version `ff`.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut fields = value.trim().split('-');
        let version = fields.next().filter(|v| v.len() == 2)?;
        let version = u8::from_str_radix(version, 16).ok()?;
        let trace_id: [u8; 16] = hex_array(fields.next()?)?;
        let span_id: [u8; 8] = hex_array(fields.next()?)?;
        let flags = fields.next().filter(|f| f.len() == 2)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        let valid = version != 0xff
            && (version != 0 || fields.next().is_none())
            && trace_id != [0; 16]
            && span_id != [0; 8];
        valid.then_some(TraceParent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }
}

fn hex_array<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2 || s.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// A traced request's ids and what its spans need beyond the observation.
#[derive(Debug)]
pub struct RequestTrace {
    trace_id: [u8; 16],
    /// The request's span.
    span_id: [u8; 8],
    /// The caller's span, from its `traceparent`.
    parent: Option<[u8; 8]>,
    upstream_span_id: [u8; 8],
    /// A copy: the caller's value is a slice of its connection's read buffer (ARCHITECTURE.md,
    /// bounded memory), and a trace lives as long as its request.
    tracestate: Option<HeaderValue>,
    /// Wall-clock time at the request's arrival, in nanoseconds since the Unix epoch.
    arrived_unix_nanos: u64,
    decided_at: Option<Instant>,
    queued_for: Option<Duration>,
    rejection_reason: Option<&'static str>,
    retry_after: Option<Duration>,
}

impl RequestTrace {
    /// The trace of a request with `headers`, or `None` when it is not to be traced.
    pub fn start(headers: &HeaderMap, sample_ratio: f64) -> Option<Box<RequestTrace>> {
        let parent = headers
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceParent::parse);
        let sampled = match parent {
            Some(p) => p.sampled,
            None => sample_ratio >= 1.0 || rand::random::<f64>() < sample_ratio,
        };
        if !sampled {
            return None;
        }
        let arrived = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Some(Box::new(RequestTrace {
            trace_id: parent.map_or_else(nonzero, |p| p.trace_id),
            span_id: nonzero(),
            parent: parent.map(|p| p.span_id),
            upstream_span_id: nonzero(),
            tracestate: parent
                .and(headers.get(TRACESTATE))
                .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()),
            arrived_unix_nanos: arrived,
            decided_at: None,
            queued_for: None,
            rejection_reason: None,
            retry_after: None,
        }))
    }

    /// Notes what admission decided, for the spans.
    pub fn decided(&mut self, decision: &Decision) {
        self.decided_at = Some(Instant::now());
        match decision {
            Decision::Admit(a) => self.queued_for = a.queued_for,
            Decision::Throttle(t) => {
                self.rejection_reason = Some(t.reason());
                self.retry_after = Some(t.hint);
                if let crate::admission::ThrottleWhy::Queue(
                    crate::admission::QueueRefusal::TimedOut { waited },
                ) = t.why
                {
                    self.queued_for = Some(waited);
                }
            }
            Decision::Unavailable(u) => self.retry_after = Some(u.hint),
            _ => {}
        }
    }

    /// The headers that carry this trace upstream: `traceparent` naming the upstream span, and
    /// the caller's `tracestate`.
    pub fn upstream_headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        let traceparent = format!(
            "00-{}-{}-01",
            hex::encode(self.trace_id),
            hex::encode(self.upstream_span_id)
        );
        let mut out = Vec::with_capacity(2);
        if let Ok(v) = HeaderValue::from_str(&traceparent) {
            out.push((TRACEPARENT, v));
        }
        if let Some(state) = &self.tracestate {
            out.push((TRACESTATE, state.clone()));
        }
        out
    }

    fn unix(&self, obs: &Observation, at: Instant) -> u64 {
        let since = at.saturating_duration_since(obs.arrived);
        self.arrived_unix_nanos
            .saturating_add(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    fn span(&self, name: String, kind: SpanKind, id: [u8; 8], parent: Option<[u8; 8]>) -> Span {
        let remote = if parent.is_some() && parent == self.parent {
            IS_REMOTE
        } else {
            0
        };
        Span {
            trace_id: self.trace_id.to_vec(),
            span_id: id.to_vec(),
            parent_span_id: parent.map(|p| p.to_vec()).unwrap_or_default(),
            trace_state: self
                .tracestate
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string(),
            flags: SAMPLED | HAS_IS_REMOTE | remote,
            name,
            kind: kind as i32,
            ..Span::default()
        }
    }
}

/// Adds the trace context to the headers going upstream (see [`super::Observation::propagate_trace`]).
pub fn propagate(
    trace: Option<&RequestTrace>,
    caller: &HeaderMap,
    signed: Option<&str>,
    out: &mut HeaderMap,
) {
    if let Some(t) = trace {
        for (name, value) in t.upstream_headers() {
            out.insert(name, value);
        }
        return;
    }
    let Some(parent) = caller.get(TRACEPARENT) else {
        return;
    };
    let valid = parent.to_str().ok().and_then(TraceParent::parse).is_some();
    let was_signed =
        |name: &HeaderName| signed.is_none_or(|s| s.split(';').any(|h| h == name.as_str()));
    if !valid || !was_signed(&TRACEPARENT) {
        return;
    }
    out.insert(TRACEPARENT, parent.clone());
    if let Some(state) = caller.get(TRACESTATE).filter(|_| was_signed(&TRACESTATE)) {
        out.insert(TRACESTATE, state.clone());
    }
}

/// Random non-zero ids (an all-zero id is invalid).
fn nonzero<const N: usize>() -> [u8; N] {
    loop {
        let id: [u8; N] = std::array::from_fn(|_| rand::random());
        if id != [0; N] {
            return id;
        }
    }
}

/// The spans of a request whose line is being written now: its own, its queue wait, its
/// upstream call.
pub fn spans(obs: &Observation, trace: &RequestTrace, settled: Option<&Settled>) -> Vec<Span> {
    let now = Instant::now();
    let error = obs.status.is_none_or(|s| s >= 500);
    let mut request = trace.span(
        request_name(obs),
        SpanKind::Server,
        trace.span_id,
        trace.parent,
    );
    request.start_time_unix_nano = trace.arrived_unix_nanos;
    request.end_time_unix_nano = trace.unix(obs, now);
    request.attributes = request_attributes(obs, trace, settled);
    request.status = status(error, obs.status);
    let mut out = vec![request];
    if let (Some(waited), Some(decided)) = (trace.queued_for, trace.decided_at) {
        let mut queue = trace.span(
            "queue wait".into(),
            SpanKind::Internal,
            nonzero(),
            Some(trace.span_id),
        );
        queue.start_time_unix_nano =
            trace.unix(obs, decided.checked_sub(waited).unwrap_or(decided));
        queue.end_time_unix_nano = trace.unix(obs, decided);
        queue.attributes = vec![int("tokengate.queue_wait_ms", millis(waited))];
        out.push(queue);
    }
    let forwarded = matches!(
        obs.verdict,
        Some(Verdict::Admitted | Verdict::QueuedThenAdmitted | Verdict::Passthrough)
    );
    if let (true, Some(sent), Some(op)) = (forwarded, trace.decided_at, obs.operation) {
        let mut upstream = trace.span(
            format!("BedrockRuntime/{}", op.name()),
            SpanKind::Client,
            trace.upstream_span_id,
            Some(trace.span_id),
        );
        upstream.start_time_unix_nano = trace.unix(obs, sent);
        upstream.end_time_unix_nano = trace.unix(obs, now);
        upstream.attributes = upstream_attributes(obs, op, settled);
        upstream.status = status(error, obs.status);
        out.push(upstream);
    }
    out
}

fn request_name(obs: &Observation) -> String {
    match (obs.operation, obs.model.as_deref()) {
        (Some(op), Some(model)) => format!("{} {model}", operation_name(op, model)),
        (Some(op), None) => op.name().to_string(),
        (None, _) => "unknown operation".to_string(),
    }
}

/// `gen_ai.operation.name`: `chat` for Converse, the InvokeModel family (model-native bodies
/// are read as chat) and the OpenAI and Anthropic APIs, `embeddings` for embedding models, else
/// the operation's own name.
fn operation_name(op: Operation, model: &str) -> &'static str {
    if model.contains("embed") {
        return "embeddings";
    }
    match op {
        Operation::Converse
        | Operation::ConverseStream
        | Operation::InvokeModel
        | Operation::InvokeModelWithResponseStream
        | Operation::OpenAIChatCompletions
        | Operation::OpenAIResponses
        | Operation::AnthropicMessages => "chat",
        other => other.name(),
    }
}

fn request_attributes(
    obs: &Observation,
    trace: &RequestTrace,
    settled: Option<&Settled>,
) -> Vec<KeyValue> {
    let mut a = gen_ai_attributes(obs, settled);
    a.extend(obs.pool_name().map(|p| string("tokengate.pool", p)));
    a.extend(
        obs.spilled_from
            .as_deref()
            .map(|p| string("tokengate.spilled_from", p)),
    );
    a.extend(obs.route.as_deref().map(|r| string("tokengate.route", r)));
    a.extend(obs.verdict.map(|v| string("tokengate.decision", v.label())));
    a.extend(
        obs.status
            .map(|s| int("http.response.status_code", u64::from(s))),
    );
    a.extend(obs.request_id().map(|id| string("aws.request_id", id)));
    a.extend(
        trace
            .queued_for
            .map(|w| int("tokengate.queue_wait_ms", millis(w))),
    );
    a.extend(
        trace
            .rejection_reason
            .map(|r| string("tokengate.rejection_reason", r)),
    );
    // As `x-amz-retry-after` says it.
    a.extend(trace.retry_after.map(|h| {
        let ms = u64::try_from(h.as_millis().max(1)).unwrap_or(u64::MAX);
        int("tokengate.retry_after_ms", ms)
    }));
    if let Some(s) = settled {
        a.push(int("tokengate.reservation", s.reserved));
        a.push(int("tokengate.charge", s.charge));
        a.push(string("tokengate.settlement_rule", s.rule.label()));
    }
    a
}

fn gen_ai_attributes(obs: &Observation, settled: Option<&Settled>) -> Vec<KeyValue> {
    // The semantic conventions name `aws.bedrock`; a SageMaker endpoint is AWS's other runtime.
    let provider = match obs.operation.map(Operation::api) {
        Some(Api::SageMaker) => "aws.sagemaker",
        _ => "aws.bedrock",
    };
    let mut a = vec![
        string("gen_ai.system", provider),
        string("gen_ai.provider.name", provider),
    ];
    if let (Some(op), Some(model)) = (obs.operation, obs.model.as_deref()) {
        a.push(string("gen_ai.operation.name", operation_name(op, model)));
        a.push(string("gen_ai.request.model", model));
    }
    if let Some(s) = settled {
        a.push(int("gen_ai.request.max_tokens", s.max_tokens));
        if let Some(u) = s.usage {
            a.push(int("gen_ai.usage.input_tokens", u.input_tokens));
            a.push(int("gen_ai.usage.output_tokens", u.output_tokens));
        }
    }
    a
}

fn upstream_attributes(
    obs: &Observation,
    op: Operation,
    settled: Option<&Settled>,
) -> Vec<KeyValue> {
    let mut a = gen_ai_attributes(obs, settled);
    a.push(string("rpc.system", "aws-api"));
    a.push(string("rpc.service", "BedrockRuntime"));
    a.push(string("rpc.method", op.name()));
    a.extend(
        obs.status
            .map(|s| int("http.response.status_code", u64::from(s))),
    );
    a.extend(obs.request_id().map(|id| string("aws.request_id", id)));
    a
}

fn status(error: bool, http: Option<u16>) -> Option<Status> {
    error.then(|| Status {
        code: StatusCode::Error as i32,
        message: match http {
            Some(s) => format!("answered {s}"),
            None => "no answer: the client left".to_string(),
        },
    })
}

fn string(key: &str, value: &str) -> KeyValue {
    attribute(key, any_value::Value::StringValue(value.to_string()))
}

fn int(key: &str, value: u64) -> KeyValue {
    attribute(
        key,
        any_value::Value::IntValue(i64::try_from(value).unwrap_or(i64::MAX)),
    )
}

fn attribute(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue { value: Some(value) }),
        ..KeyValue::default()
    }
}

fn millis(d: Duration) -> u64 {
    super::tally::millis(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_as_the_w3c_spec_says() {
        let p = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the spec's example");
        assert_eq!(hex::encode(p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(p.span_id), "00f067aa0ba902b7");
        assert!(p.sampled);
        let unsampled =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
        assert!(!unsampled.expect("valid").sampled);
        // A later version may add fields.
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra")
                .is_some()
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_caller_context_is_continued_and_an_unsampled_one_is_not_traced() {
        let mut headers = HeaderMap::new();
        headers.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        headers.insert(TRACESTATE, HeaderValue::from_static("vendor=abc"));
        let t = RequestTrace::start(&headers, 0.0).expect("the caller sampled it");
        assert_eq!(hex::encode(t.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            t.parent.map(hex::encode).as_deref(),
            Some("00f067aa0ba902b7")
        );
        let up = t.upstream_headers();
        let traceparent = up[0].1.to_str().expect("ascii");
        assert_eq!(
            traceparent,
            format!(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01",
                hex::encode(t.upstream_span_id)
            )
        );
        assert_eq!(up[1], (TRACESTATE, HeaderValue::from_static("vendor=abc")));
        headers.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
        );
        assert!(RequestTrace::start(&headers, 1.0).is_none());
        let fresh = RequestTrace::start(&HeaderMap::new(), 1.0).expect("ratio 1");
        assert_eq!(fresh.parent, None);
        assert!(RequestTrace::start(&HeaderMap::new(), 0.0).is_none());
    }
}
