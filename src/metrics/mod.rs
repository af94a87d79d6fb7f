//! Every `tokengate_*` metric, registered in a [`prometheus::Registry`] that is passed in (so each
//! test gets a fresh one), and the `/metrics` text exposition.
//!
//! Labels are bounded: `pool` comes from config (plus `none` for calls outside any pool),
//! `operation` from the fixed operation list, `api` from the fixed API families
//! ([`crate::bedrock::Api`]: `bedrock`, `openai_chat`, `openai_responses`, `anthropic_messages`,
//! `sagemaker`), `outcome`, `reason` and `rule` from fixed enums,
//! `status` from upstream status codes.

use std::{
    cell::RefCell,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The `pool` label for calls that belong to no pool.
pub const NO_POOL: &str = "none";

#[derive(Debug, Clone)]
pub struct Metrics {
    /// Requests by final outcome: admitted, rejected, invalid, passthrough, unknown_model.
    pub requests: IntCounterVec,
    /// Rejections by the limit that bound: tokens, requests, concurrency, never_fits.
    pub rejections: IntCounterVec,
    pub reserved_tokens: IntGaugeVec,
    pub inflight_requests: IntGaugeVec,
    pub tokens_available: GaugeVec,
    pub configured_tokens_per_minute: GaugeVec,
    pub effective_tokens_per_minute: GaugeVec,
    pub upstream_throttles: IntCounterVec,
    pub upstream_daily_throttles: IntCounterVec,
    pub upstream_responses: IntCounterVec,
    pub upstream_errors: IntCounterVec,
    /// Settlements by rule: usage, not_charged, no_usage, timeout, abandoned.
    pub settlements: IntCounterVec,
    pub reserved_tokens_total: IntCounterVec,
    pub charged_tokens: IntCounterVec,
    pub input_tokens: IntCounterVec,
    pub output_tokens: IntCounterVec,
    pub cache_read_tokens: IntCounterVec,
    pub cache_write_tokens: IntCounterVec,
    pub calibration_ratio: GaugeVec,
    pub retry_hint_seconds: HistogramVec,
    pub request_duration_seconds: HistogramVec,
    pub time_to_first_byte_seconds: HistogramVec,
    pub over_reservation_ratio: HistogramVec,
    pub ledger_errors: IntCounterVec,
    pub ledger_seconds: Histogram,
    /// Times the shared ledger became unreachable and admission fell back to the local share.
    pub ledger_fallbacks: IntCounter,
    /// 1 for the mode the ledger serves in now (memory, shared, local_share, unavailable).
    pub ledger_mode: IntGaugeVec,
    pub config_reloads: IntCounterVec,
    pub queue_depth: IntGaugeVec,
    /// Tokens the requests waiting in the queue would reserve.
    pub queued_tokens: IntGaugeVec,
    pub daily_tokens_available: IntGaugeVec,
    pub budget_tokens_available: IntGaugeVec,
    pub queue_wait_seconds: HistogramVec,
    /// Queued requests by outcome: admitted, timed_out, cancelled, shutdown.
    pub queue_outcomes: IntCounterVec,
    pub unsettled_reservations: IntCounter,
    // === Lengths, time to first token and maxTokens advice (see `admission::advice`) ===
    pub time_to_first_token_seconds: HistogramVec,
    pub input_tokens_per_request: HistogramVec,
    pub output_tokens_per_request: HistogramVec,
    pub requested_max_tokens: HistogramVec,
    pub output_tokens_p99: IntGaugeVec,
    pub requested_max_tokens_p99: IntGaugeVec,
    pub suggested_max_tokens: IntGaugeVec,
    pub max_tokens_unused_ratio: GaugeVec,
    // === Adaptive maxTokens (see `admission::adaptive`), per pool, route and model ===
    pub adaptive_max_tokens: IntGaugeVec,
    pub adaptive_capped_calls: IntGaugeVec,
    pub adaptive_proxy_truncations: IntGaugeVec,
    pub adaptive_raises: IntGaugeVec,
    /// Calls the learned cap truncated, sent again with the caller's maxTokens, by outcome.
    pub adaptive_retries: IntCounterVec,
    // === Routes and callers (see `admission::routes`, `auth`) ===
    /// Requests by pool, route and outcome: admitted, rejected, not_allowed, invalid, shadow_rejected.
    pub route_requests: IntCounterVec,
    pub route_reserved_tokens: IntGaugeVec,
    pub route_charged_tokens: IntCounterVec,
    /// Retries admitted into the pool's retry reserve, by route.
    pub recovery_admissions: IntCounterVec,
    /// Requests admitted in another pool of their home pool's spill chain, by home pool (`from`),
    /// the pool they ran in (`to`) and route.
    pub spillover: IntCounterVec,
    /// Requests shadow mode forwarded that enforcement would have turned away, by reason.
    pub shadow_rejections: IntCounterVec,
    /// Requests whose maxTokens was lowered to the route's ceiling.
    pub max_tokens_clamped: IntCounterVec,
    pub truncated: IntCounterVec,
    /// Requests that named no maxTokens, by what was done: route_ceiling, reserve_model_max,
    /// inject, reject.
    pub max_tokens_missing: IntCounterVec,
    /// Requests that failed identification, by reason (never said to the caller).
    pub auth_failures: IntCounterVec,
    /// Spans handed to the OTLP exporter, by result: exported, dropped (queue full), failed.
    pub trace_spans: IntCounterVec,
    // === The listener (see `server` and `body_budget`) ===
    /// Request-body bytes held in memory now, by every request together.
    pub buffered_body_bytes: IntGauge,
    /// Requests answered 503 because the body budget was spent.
    pub body_budget_refusals: IntCounter,
    /// Open connections, by listener (`proxy`, `admin`).
    pub open_connections: IntGaugeVec,
    /// Connections shed at the cap, by listener and action: `closed_idle`, `refused`.
    pub connections_shed: IntCounterVec,
    /// Connections closed by a timeout, by listener and kind: `first_request`, `header`, `idle`.
    pub connection_timeouts: IntCounterVec,
    // === The upstream HTTP/2 connections (see `upstream::h2_connections`) ===
    /// Open upstream HTTP/2 connections, by host.
    pub upstream_connections: IntGaugeVec,
    /// Streams in flight on them, by host.
    pub upstream_streams: IntGaugeVec,
    // === Endpoint pools (see `admission::endpoint`, `copies`) ===
    /// Copies serving an endpoint pool now.
    pub endpoint_copies: IntGaugeVec,
    /// (In flight + queued) / copies: the scaling signal.
    pub endpoint_demand_per_copy: GaugeVec,
    /// Reads of the copies from the control plane, by result: ok, error.
    pub endpoint_copy_refreshes: IntCounterVec,
    /// Every metric registered, for [`Metrics::families`].
    families: Arc<[Family]>,
}

/// A registered metric: its name and type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// Exported as `NAME_bucket`, `NAME_sum` and `NAME_count`.
    Histogram,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
];
const HINT_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0];
const RATIO_BUCKETS: &[f64] = &[1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0];
/// Token counts per request: powers of two from 16 to 256K.
const LENGTH_BUCKETS: &[f64] = &[
    16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0, 131072.0, 262144.0,
];
const LEDGER_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new(registry: &Registry) -> Result<Metrics, prometheus::Error> {
        let r = Reg::new(registry);
        Ok(Metrics {
            requests: r.counter("tokengate_requests_total", "Requests by pool, API, operation and outcome.", &["pool", "api", "operation", "outcome"])?,
            rejections: r.counter("tokengate_rejections_total", "Requests turned away, by pool and the limit that bound.", &["pool", "reason"])?,
            reserved_tokens: r.int_gauge("tokengate_reserved_tokens", "Tokens reserved by requests in flight.", &["pool"])?,
            inflight_requests: r.int_gauge("tokengate_inflight_requests", "Admitted requests not yet settled.", &["pool"])?,
            tokens_available: r.gauge("tokengate_tokens_available", "Tokens in the pool's bucket at the last decision (negative while repaying burndown).", &["pool"])?,
            configured_tokens_per_minute: r.gauge("tokengate_configured_tokens_per_minute", "The pool's configured tokens per minute.", &["pool"])?,
            effective_tokens_per_minute: r.gauge("tokengate_effective_tokens_per_minute", "Tokens per minute admission applies now (after headroom and throttle feedback).", &["pool"])?,
            upstream_throttles: r.counter("tokengate_upstream_throttles_total", "ThrottlingExceptions received from upstream on its per-minute limits (the pool's limit shrinks).", &["pool"])?,
            upstream_daily_throttles: r.counter("tokengate_upstream_daily_throttles_total", "ThrottlingExceptions received from upstream on its daily quota (Too many tokens per day): the per-minute limit is left alone.", &["pool"])?,
            upstream_responses: r.counter("tokengate_upstream_responses_total", "Upstream responses by status code.", &["pool", "status"])?,
            upstream_errors: r.counter("tokengate_upstream_errors_total", "Upstream failures without a response: connect, timeout, stream_cut, bad_frame, idle_timeout.", &["pool", "kind"])?,
            settlements: r.counter("tokengate_settlements_total", "Reservations settled, by the rule that priced them.", &["pool", "rule"])?,
            reserved_tokens_total: r.counter("tokengate_reserved_tokens_total", "Tokens reserved at admission (input estimate + maxTokens).", &["pool"])?,
            charged_tokens: r.counter("tokengate_charged_tokens_total", "Quota tokens charged at settlement (input + cacheWrite + output x burndown).", &["pool"])?,
            input_tokens: r.counter("tokengate_input_tokens_total", "Input tokens reported by upstream.", &["pool"])?,
            output_tokens: r.counter("tokengate_output_tokens_total", "Output tokens reported by upstream.", &["pool"])?,
            cache_read_tokens: r.counter("tokengate_cache_read_tokens_total", "Cache-read input tokens reported by upstream.", &["pool"])?,
            cache_write_tokens: r.counter("tokengate_cache_write_tokens_total", "Cache-write input tokens reported by upstream.", &["pool"])?,
            calibration_ratio: r.gauge("tokengate_input_calibration_ratio", "Actual input tokens / estimated input tokens (online calibration).", &["pool"])?,
            retry_hint_seconds: r.histogram("tokengate_retry_hint_seconds", "Retry hints sent with rejections.", &["pool"], HINT_BUCKETS)?,
            request_duration_seconds: r.histogram("tokengate_request_duration_seconds", "Time from admission to settlement.", &["pool", "operation"], LATENCY_BUCKETS)?,
            time_to_first_byte_seconds: r.histogram("tokengate_time_to_first_byte_seconds", "Time from admission to the first response body bytes.", &["pool", "operation"], LATENCY_BUCKETS)?,
            over_reservation_ratio: r.histogram("tokengate_over_reservation_ratio", "Reserved tokens / charged tokens, per settled request with usage.", &["pool"], RATIO_BUCKETS)?,
            ledger_errors: r.counter("tokengate_ledger_errors_total", "Ledger backend failures.", &["backend"])?,
            ledger_seconds: {
                let h = Histogram::with_opts(HistogramOpts::new("tokengate_ledger_seconds", "Ledger round-trip time of reserve and settle calls, every backend (for Redis, the Redis round trip).").buckets(LEDGER_BUCKETS.to_vec()))?;
                r.register("tokengate_ledger_seconds", Kind::Histogram, Box::new(h.clone()))?;
                h
            },
            ledger_fallbacks: r.single_counter("tokengate_ledger_fallback_total", "Times the shared ledger was unreachable and admission fell back to the local share.")?,
            ledger_mode: r.int_gauge("tokengate_ledger_mode", "1 for the mode the ledger serves in: memory, shared, local_share, unavailable.", &["mode"])?,
            config_reloads: r.counter("tokengate_config_reloads_total", "Config reloads by result.", &["result"])?,
            queue_depth: r.int_gauge("tokengate_queue_depth", "Requests waiting in the pool's admission queue.", &["pool"])?,
            queued_tokens: r.int_gauge("tokengate_queued_tokens", "Tokens the requests waiting in the pool's admission queue would reserve.", &["pool"])?,
            daily_tokens_available: r.int_gauge("tokengate_daily_tokens_available", "Tokens left of the pool's daily quota (tokens_per_day), for pools that set one; negative while repaying a burndown debt.", &["pool"])?,
            budget_tokens_available: r.int_gauge("tokengate_budget_tokens_available", "Tokens left of a budget window: the account's daily quota (scope account) and each route's budgets (scope route:NAME).", &["scope", "window"])?,
            queue_wait_seconds: r.histogram("tokengate_queue_wait_seconds", "Time queued requests waited.", &["pool"], HINT_BUCKETS)?,
            queue_outcomes: r.counter("tokengate_queue_outcomes_total", "Queued requests by outcome: admitted, timed_out, cancelled, shutdown.", &["pool", "outcome"])?,
            unsettled_reservations: r.single_counter("tokengate_unsettled_reservations_total", "Reservations settled by the drop safety net (a bug if non-zero).")?,
            time_to_first_token_seconds: r.histogram("tokengate_time_to_first_token_seconds", "Time from admission to the first generated content: the first content event of a stream, the first body bytes otherwise.", &["pool", "operation"], LATENCY_BUCKETS)?,
            input_tokens_per_request: r.histogram("tokengate_input_tokens_per_request", "Prompt length per request: input + cache-read + cache-write tokens reported by upstream.", &["pool"], LENGTH_BUCKETS)?,
            output_tokens_per_request: r.histogram("tokengate_output_tokens_per_request", "Output tokens per request reported by upstream.", &["pool"], LENGTH_BUCKETS)?,
            requested_max_tokens: r.histogram("tokengate_requested_max_tokens", "maxTokens reserved per request settled with usage (the pool default when the caller sent none).", &["pool"], LENGTH_BUCKETS)?,
            output_tokens_p99: r.int_gauge("tokengate_output_tokens_p99", "p99 output tokens per request since start, by pool and configured model (maxTokens advice).", &["pool", "model"])?,
            requested_max_tokens_p99: r.int_gauge("tokengate_requested_max_tokens_p99", "p99 maxTokens reserved per request since start, by pool and configured model (maxTokens advice).", &["pool", "model"])?,
            suggested_max_tokens: r.int_gauge("tokengate_suggested_max_tokens", "Suggested maxTokens: p99 output x 1.2 rounded up to 64, once 20 requests were seen (maxTokens advice).", &["pool", "model"])?,
            max_tokens_unused_ratio: r.gauge("tokengate_max_tokens_unused_ratio", "Share of reserved maxTokens that output did not use since start: 1 - sum(output) / sum(maxTokens).", &["pool", "model"])?,
            adaptive_max_tokens: r.int_gauge("tokengate_adaptive_max_tokens", "The output cap a route's adaptive_max_tokens learned for a model and writes into forwarded requests (0 until min_samples).", &["pool", "route", "model"])?,
            adaptive_capped_calls: r.int_gauge("tokengate_adaptive_capped_calls", "Calls settled with usage whose maxTokens the learned cap lowered, since start.", &["pool", "route", "model"])?,
            adaptive_proxy_truncations: r.int_gauge("tokengate_adaptive_proxy_truncations", "Capped calls that stopped at the learned cap (truncations the proxy caused), since start.", &["pool", "route", "model"])?,
            adaptive_raises: r.int_gauge("tokengate_adaptive_raises", "Times the truncation guard raised the learned cap, since start.", &["pool", "route", "model"])?,
            adaptive_retries: r.counter("tokengate_adaptive_retries_total", "Non-streamed calls that stopped at the learned cap and were sent again with the caller's own maxTokens (routes[].adaptive_retry), by outcome: answered (the retry's answer returned), refused (the retry was not admitted: the truncated first answer returned), failed (upstream failed the retry: the first answer returned).", &["pool", "route", "outcome"])?,
            route_requests: r.counter("tokengate_route_requests_total", "Requests by pool, route and outcome: admitted, rejected, not_allowed, invalid, shadow_rejected.", &["pool", "route", "outcome"])?,
            route_reserved_tokens: r.int_gauge("tokengate_route_reserved_tokens", "Tokens reserved by the route's requests in flight.", &["pool", "route"])?,
            route_charged_tokens: r.counter("tokengate_route_charged_tokens_total", "Quota tokens charged to the route at settlement.", &["pool", "route"])?,
            recovery_admissions: r.counter("tokengate_recovery_admissions_total", "SDK retries admitted into the pool's retry reserve (the route's recovery budget).", &["pool", "route"])?,
            spillover: r.counter("tokengate_spillover_total", "Requests whose home pool could not admit them now, admitted in another pool of its spill_to chain: from the home pool, to the pool they ran in.", &["from", "to", "route"])?,
            shadow_rejections: r.counter("tokengate_shadow_rejections_total", "Requests forwarded in shadow mode that enforcement would have turned away, by reason.", &["pool", "route", "reason"])?,
            max_tokens_clamped: r.counter("tokengate_max_tokens_clamped_total", "Requests whose maxTokens was lowered to the route's max_tokens_ceiling.", &["pool", "route"])?,
            truncated: r.counter("tokengate_truncated_total", "Calls whose output stopped at its cap (stop reason max_tokens, length, max_output_tokens): maxTokens, or the default written in, too low for what was asked.", &["pool", "route"])?,
            max_tokens_missing: r.counter("tokengate_max_tokens_missing_total", "Requests that named no maxTokens, by what was done: route_ceiling (the route's ceiling written in), reserve_model_max (the model's maximum reserved, as Bedrock does), inject (the pool's default_max_tokens written in), reject (refused), adaptive_cap (the route's learned adaptive cap written in). Counted once per call decided, not per throttled attempt.", &["pool", "route", "action"])?,
            auth_failures: r.counter("tokengate_auth_failures_total", "Requests that failed identification, by auth mode and reason.", &["mode", "reason"])?,
            trace_spans: r.counter("tokengate_trace_spans_total", "Spans of traced requests, by result: exported to the OTLP collector, dropped (the export queue was full), failed (the export failed).", &["result"])?,
            buffered_body_bytes: r.single_gauge("tokengate_buffered_body_bytes", "Request-body bytes held in memory now (server.max_buffered_body_bytes bounds it).")?,
            body_budget_refusals: r.single_counter("tokengate_body_budget_refusals_total", "Requests answered 503 because their body would have taken the buffered bytes past server.max_buffered_body_bytes.")?,
            open_connections: r.int_gauge("tokengate_open_connections", "Open client connections, by listener.", &["listener"])?,
            connections_shed: r.counter("tokengate_connections_shed_total", "Connections shed at server.max_connections: closed_idle (an idle one closed to make room), refused (none idle: the newcomer closed).", &["listener", "action"])?,
            connection_timeouts: r.counter("tokengate_connection_timeouts_total", "Connections closed by a timeout: first_request, header (an HTTP/1.1 head), idle.", &["listener", "kind"])?,
            upstream_connections: r.int_gauge("tokengate_upstream_connections", "Open upstream HTTP/2 connections, by host (upstream.http \"http2\", or \"auto\" over TLS).", &["host"])?,
            upstream_streams: r.int_gauge("tokengate_upstream_streams", "Streams in flight on the upstream HTTP/2 connections, by host.", &["host"])?,
            endpoint_copies: r.int_gauge("tokengate_endpoint_copies", "Copies serving an endpoint pool now (the concurrency limit is copies x max_concurrency_per_copy).", &["pool"])?,
            endpoint_demand_per_copy: r.gauge("tokengate_endpoint_demand_per_copy", "An endpoint pool's requests in flight plus queued, per copy serving: the signal to scale the endpoint on.", &["pool"])?,
            endpoint_copy_refreshes: r.counter("tokengate_endpoint_copy_refreshes_total", "Reads of an endpoint pool's copies from the SageMaker control plane, by result: ok, error.", &["pool", "result"])?,
            families: r.families.take().into(),
        })
        .inspect(Metrics::init_global_series)
    }

    /// Series of fixed label sets that exist from the start, at zero, so `rate()` and alerts see
    /// them before the first event. (`with_label_values` creates a missing series at zero and
    /// leaves an existing one as it is, so a config reload never resets a counter.)
    fn init_global_series(&self) {
        for result in ["ok", "error"] {
            self.config_reloads.with_label_values(&[result]);
        }
        for result in ["exported", "dropped", "failed"] {
            self.trace_spans.with_label_values(&[result]);
        }
    }

    /// The connection metrics of the listener named `listener`, every series at zero if new.
    pub fn listener(&self, listener: &str) -> ListenerMetrics {
        let shed = |action| self.connections_shed.with_label_values(&[listener, action]);
        let timeouts = |kind| {
            self.connection_timeouts
                .with_label_values(&[listener, kind])
        };
        ListenerMetrics {
            open: self.open_connections.with_label_values(&[listener]),
            closed_idle: shed("closed_idle"),
            refused: shed("refused"),
            first_request_timeouts: timeouts("first_request"),
            header_timeouts: timeouts("header"),
            idle_timeouts: timeouts("idle"),
        }
    }

    /// Every metric this process exports, whether or not it has a sample yet: what dashboards and
    /// alert rules may refer to.
    pub fn families(&self) -> &[Family] {
        &self.families
    }

    /// A registry of its own, for tests and tools.
    pub fn standalone() -> (Registry, Metrics) {
        let registry = Registry::new();
        // Registering fresh metrics in a fresh registry cannot collide.
        let metrics =
            Metrics::new(&registry).unwrap_or_else(|e| unreachable!("fresh registry: {e}"));
        (registry, metrics)
    }
}

/// A counter whose total is kept elsewhere (an atomic owned by the ledger or a queue) and
/// published when `/metrics` is read: each publication adds what the total gained since the last.
#[derive(Debug, Default)]
pub struct Publication {
    last: AtomicU64,
}

impl Publication {
    pub fn publish(&self, counter: &IntCounter, total: u64) {
        // Two scrapes at once: only the one that moves `last` forward adds the difference.
        let previous = self.last.fetch_max(total, Ordering::Relaxed);
        if total > previous {
            counter.inc_by(total - previous);
        }
    }
}

/// One listener's connection series, resolved once (see [`Metrics::listener`]).
#[derive(Debug, Clone)]
pub struct ListenerMetrics {
    pub open: IntGauge,
    pub closed_idle: IntCounter,
    pub refused: IntCounter,
    pub first_request_timeouts: IntCounter,
    pub header_timeouts: IntCounter,
    pub idle_timeouts: IntCounter,
}

/// Registers metrics and remembers their names.
struct Reg<'a> {
    registry: &'a Registry,
    families: RefCell<Vec<Family>>,
}

impl<'a> Reg<'a> {
    fn new(registry: &'a Registry) -> Reg<'a> {
        Reg {
            registry,
            families: RefCell::new(Vec::new()),
        }
    }

    fn register(
        &self,
        name: &'static str,
        kind: Kind,
        collector: Box<dyn prometheus::core::Collector>,
    ) -> Result<(), prometheus::Error> {
        self.registry.register(collector)?;
        self.families.borrow_mut().push(Family { name, kind });
        Ok(())
    }

    fn single_counter(
        &self,
        name: &'static str,
        help: &str,
    ) -> Result<IntCounter, prometheus::Error> {
        let m = IntCounter::new(name, help)?;
        self.register(name, Kind::Counter, Box::new(m.clone()))?;
        Ok(m)
    }
    fn single_gauge(&self, name: &'static str, help: &str) -> Result<IntGauge, prometheus::Error> {
        let m = IntGauge::new(name, help)?;
        self.register(name, Kind::Gauge, Box::new(m.clone()))?;
        Ok(m)
    }
    fn counter(
        &self,
        name: &'static str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        let m = IntCounterVec::new(Opts::new(name, help), labels)?;
        self.register(name, Kind::Counter, Box::new(m.clone()))?;
        Ok(m)
    }
    fn int_gauge(
        &self,
        name: &'static str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntGaugeVec, prometheus::Error> {
        let m = IntGaugeVec::new(Opts::new(name, help), labels)?;
        self.register(name, Kind::Gauge, Box::new(m.clone()))?;
        Ok(m)
    }
    fn gauge(
        &self,
        name: &'static str,
        help: &str,
        labels: &[&str],
    ) -> Result<GaugeVec, prometheus::Error> {
        let m = GaugeVec::new(Opts::new(name, help), labels)?;
        self.register(name, Kind::Gauge, Box::new(m.clone()))?;
        Ok(m)
    }
    fn histogram(
        &self,
        name: &'static str,
        help: &str,
        labels: &[&str],
        buckets: &[f64],
    ) -> Result<HistogramVec, prometheus::Error> {
        let m = HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )?;
        self.register(name, Kind::Histogram, Box::new(m.clone()))?;
        Ok(m)
    }
}

/// The text exposition of `registry`.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    if TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .is_err()
    {
        return String::new();
    }
    String::from_utf8(buf).unwrap_or_default()
}
