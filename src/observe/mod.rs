//! Recording what happened: every request's metrics, its access-log line, and what the
//! operator-facing outputs count (the quota report, CloudWatch EMF), in one place.
//!
//! The pipeline carries an [`Observation`] through the request (arrival, target, route,
//! verdict, answer, first byte and token) and hands each event to the policy's [`Observer`]:
//! [`Observer::decided`] when admission decided, [`Observer::settled`] when an admitted request
//! settled, [`Observer::finished`] when any other request was answered. Metrics are only written
//! here, never read back; what code needs to know lives in atomics owned by the pools, queues
//! and the ledger, and [`publish`] copies it into gauges when `/metrics` is read.
//!
//! The same events feed the process-wide [`Telemetry`], which outlives config reloads: each
//! pool's [`report`] window and [`emf`] tallies ([`tally::Event`]), and, for traced requests,
//! the spans [`trace`] builds from the observation when its line is written, sent by [`otlp`].

pub mod access_log;
pub mod emf;
pub mod log_fields;
pub mod log_writer;
mod observation;
pub mod otlp;
pub mod publish;
pub mod report;
pub mod series;
pub mod tally;
mod telemetry;
pub mod timed;
pub mod trace;

use std::{sync::Arc, time::Duration};

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use crate::{
    admission::{
        Admission, Admitted, Decision, MissingMaxTokens, Pass, Pool, Problem, QueueRefusal,
        Settled, Throttle, ThrottleWhy, Unavailability, adaptive::RetryOutcome,
    },
    metrics::{Metrics, NO_POOL},
};
pub use access_log::Verdict;
pub use observation::Observation;
use report::PoolWindow;
use series::PoolSeries;
use tally::Event;
use telemetry::EmfSlots;
pub use telemetry::{Telemetry, Tracer};

/// Writes what requests of one policy generation did into the metrics and the access log.
#[derive(Debug)]
pub struct Observer {
    metrics: Arc<Metrics>,
    /// By pool id.
    pools: Vec<PoolSeries>,
    telemetry: Arc<Telemetry>,
    /// Each pool's quota-report window, by pool id.
    windows: Vec<Arc<PoolWindow>>,
    /// Each pool's EMF tallies, by pool id (empty without EMF).
    emf: Vec<EmfSlots>,
}

impl Observer {
    /// Resolves the series of every pool and route of `admission`, and each pool's place in
    /// `telemetry`.
    pub fn new(
        metrics: Arc<Metrics>,
        admission: &Admission,
        telemetry: Arc<Telemetry>,
    ) -> Observer {
        let pools = series::for_policy(&metrics, admission);
        let windows = admission
            .pools()
            .iter()
            .map(|p| telemetry.report.pool(&p.name))
            .collect();
        let emf = match &telemetry.emf {
            Some(emf) => admission
                .pools()
                .iter()
                .map(|p| {
                    let pool = emf.pool(&p.name);
                    let routes = p
                        .shares
                        .views()
                        .iter()
                        .map(|r| pool.route(&r.name))
                        .collect();
                    EmfSlots { pool, routes }
                })
                .collect(),
            None => Vec::new(),
        };
        Observer {
            metrics,
            pools,
            telemetry,
            windows,
            emf,
        }
    }

    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// Counts `event` of a request in `pool` (from `route`, its slot there, if known) wherever
    /// the operator outputs keep counts.
    fn tally(&self, pool: &Pool, route: Option<usize>, event: Event) {
        if let Some(window) = self.windows.get(pool.id) {
            window.record(self.telemetry.report.minute(), &event);
        }
        if let Some(slots) = self.emf.get(pool.id) {
            let route = route.and_then(|i| slots.routes.get(i));
            slots.pool.record(route.map(|r| &**r), &event);
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn series(&self, pool: &Pool) -> Option<&PoolSeries> {
        self.pools.get(pool.id)
    }

    /// A request arrived with `headers`: trace it if tracing is on and it is sampled.
    pub fn began(&self, obs: &mut Observation, headers: &HeaderMap) {
        if let Some(tracer) = &self.telemetry.tracer {
            obs.trace = trace::RequestTrace::start(headers, tracer.sample_ratio);
        }
    }

    /// Hands a finished request's spans to the exporter.
    fn trace(&self, obs: &mut Observation, settled: Option<&Settled>) {
        if let (Some(tracer), Some(t)) = (&self.telemetry.tracer, obs.trace.take()) {
            tracer.exporter.export(trace::spans(obs, &t, settled));
        }
    }

    /// Admission decided: count it, and note what the access log needs.
    pub fn decided(&self, obs: &mut Observation, decision: &Decision) {
        obs.pool = decision.pool().cloned();
        if let Some(t) = obs.trace.as_mut() {
            t.decided(decision);
        }
        let m = &self.metrics;
        let (api, op) = (obs.api_label(), obs.operation_label());
        let route = obs.route.clone().unwrap_or_else(|| Arc::from(""));
        let count = |pool: &str, outcome: &str| {
            m.requests
                .with_label_values(&[pool, api, op, outcome])
                .inc();
        };
        let count_route = |pool: &Pool, outcome: &str| {
            m.route_requests
                .with_label_values(&[&pool.name, &route, outcome])
                .inc();
        };
        match decision {
            Decision::Admit(admitted) => self.admitted(obs, admitted),
            Decision::Pass(Pass::NotMetered) => {
                obs.verdict = Some(Verdict::Passthrough);
                count(NO_POOL, "passthrough");
            }
            Decision::Pass(Pass::UnknownModel) => {
                obs.verdict = Some(Verdict::Passthrough);
                count(NO_POOL, "unknown_model_passed");
            }
            Decision::Pass(Pass::Shadow { pool, reason }) => {
                obs.verdict = Some(Verdict::Passthrough);
                let name = pool.as_ref().map_or(NO_POOL, |p| &p.name);
                count(name, "passthrough");
                m.shadow_rejections
                    .with_label_values(&[name, &route, reason.label()])
                    .inc();
                if let Some(pool) = pool {
                    count_route(pool, "shadow_rejected");
                }
            }
            Decision::Throttle(throttle) => self.throttled(obs, throttle),
            Decision::NeverFits(n) => {
                obs.verdict = Some(Verdict::Invalid);
                count(&n.pool.name, "invalid");
                m.rejections
                    .with_label_values(&[&n.pool.name, "never_fits"])
                    .inc();
                self.max_tokens_missing(obs, &n.pool, n.max_tokens_missing);
            }
            Decision::NotAllowed(n) => {
                obs.verdict = Some(Verdict::Invalid);
                count(n.pool.as_ref().map_or(NO_POOL, |p| &p.name), "not_allowed");
                if let Some(pool) = &n.pool {
                    count_route(pool, "not_allowed");
                }
            }
            Decision::Invalid(invalid) => {
                obs.verdict = Some(Verdict::Invalid);
                let pool = invalid.pool.as_ref();
                count(pool.map_or(NO_POOL, |p| &p.name), "invalid");
                if let Some(pool) = pool {
                    count_route(pool, "invalid");
                    if matches!(invalid.problem, Problem::MaxTokensMissing { .. }) {
                        self.max_tokens_missing(obs, pool, Some(MissingMaxTokens::Reject));
                    }
                }
            }
            Decision::UnknownModel { .. } => {
                obs.verdict = Some(Verdict::Invalid);
                count(NO_POOL, "unknown_model");
            }
            Decision::UnknownEndpoint { .. } => {
                obs.verdict = Some(Verdict::Invalid);
                count(NO_POOL, "unknown_endpoint");
            }
            Decision::Unavailable(u) => self.unavailable(obs, u),
        }
    }

    fn admitted(&self, obs: &mut Observation, admitted: &Admitted) {
        let hold = &admitted.hold;
        obs.admitted_at = Some(Instant::now());
        obs.route_slot = hold.route().map(|r| r.index());
        obs.verdict = Some(match admitted.queued_for {
            Some(_) => Verdict::QueuedThenAdmitted,
            None => Verdict::Admitted,
        });
        let pool = hold.pool();
        if let Some(from) = &admitted.spilled_from {
            let route = obs.route.as_deref().unwrap_or("");
            self.metrics
                .spillover
                .with_label_values(&[&from.name, &pool.name, route])
                .inc();
            obs.spilled_from = Some(from.name.clone());
        }
        self.tally(
            pool,
            obs.route_slot,
            Event::Admitted {
                reserved: hold.reserved(),
                in_flight: pool.load.in_flight(),
                queued_for: admitted.queued_for,
                spilled: admitted.spilled_from.is_some(),
            },
        );
        if let Some(e) = &admitted.count_tokens_failed {
            self.metrics
                .upstream_errors
                .with_label_values(&[&pool.name, "count_tokens"])
                .inc();
            tracing::warn!(pool = %pool.name, error = %e, "CountTokens failed; using the calibrated estimate");
        }
        let Some(s) = self.series(pool) else { return };
        if let Some(op) = obs.operation {
            s.operation(op).admitted.inc();
        }
        s.reserved_tokens_total.inc_by(hold.reserved());
        if let Some(waited) = admitted.queued_for {
            self.queue_outcome(pool, s, "admitted", Some(waited));
        }
        if let Some(route) = obs.route_slot.and_then(|i| s.route(i)) {
            route.admitted.inc();
            if admitted.recovered {
                route.recovery_admissions.inc();
            }
            if admitted.clamped {
                route.max_tokens_clamped.inc();
            }
        }
        self.max_tokens_missing(obs, pool, hold.estimate().max_tokens_missing);
    }

    /// A request that named no maxTokens, counted by what was done about it.
    fn max_tokens_missing(&self, obs: &Observation, pool: &Pool, action: Option<MissingMaxTokens>) {
        let Some(action) = action else { return };
        let slot = obs.route.as_deref().and_then(|r| pool.shares.slot(r));
        let counter = slot
            .and_then(|slot| self.series(pool)?.route(slot.index()))
            .and_then(|route| route.max_tokens_missing(action));
        if let Some(counter) = counter {
            counter.inc();
        }
    }

    fn throttled(&self, obs: &mut Observation, throttle: &Throttle) {
        obs.verdict = Some(Verdict::Rejected);
        let pool = &throttle.pool;
        self.metrics
            .rejections
            .with_label_values(&[&pool.name, throttle.reason()])
            .inc();
        self.count_rejected(obs, pool);
        let waited = match throttle.why {
            ThrottleWhy::Queue(QueueRefusal::TimedOut { waited }) => Some(waited),
            _ => None,
        };
        let route = obs.route.as_deref().and_then(|r| pool.shares.slot(r));
        self.tally(
            pool,
            route.map(|r| r.index()),
            Event::Throttled {
                demand: (!obs.retry).then_some(throttle.reserving),
                queued_for: waited,
            },
        );
        let Some(s) = self.series(pool) else { return };
        s.retry_hint.observe(throttle.hint.as_secs_f64());
        if let Some(waited) = waited {
            self.queue_outcome(pool, s, "timed_out", Some(waited));
        }
    }

    fn unavailable(&self, obs: &mut Observation, u: &crate::admission::Unavailable) {
        obs.verdict = Some(Verdict::Unavailable);
        let pool = &u.pool;
        match &u.cause {
            Unavailability::Ledger { backend, error } => {
                self.metrics
                    .ledger_errors
                    .with_label_values(&[backend])
                    .inc();
                let (api, op) = (obs.api_label(), obs.operation_label());
                self.metrics
                    .requests
                    .with_label_values(&[&pool.name, api, op, "ledger_error"])
                    .inc();
                tracing::error!(error = %error, pool = %pool.name, "ledger unavailable");
            }
            Unavailability::ShuttingDown { waited } => {
                self.count_rejected(obs, pool);
                if let (Some(s), Some(waited)) = (self.series(pool), waited) {
                    self.queue_outcome(pool, s, "shutdown", Some(*waited));
                }
            }
        }
        if let Some(s) = self.series(pool) {
            s.retry_hint.observe(u.hint.as_secs_f64());
        }
    }

    /// A refusal that counts as `rejected` for the pool, the operation and the route.
    fn count_rejected(&self, obs: &Observation, pool: &Pool) {
        let Some(s) = self.series(pool) else { return };
        if let Some(op) = obs.operation {
            s.operation(op).rejected.inc();
        }
        let route = obs.route.as_deref().and_then(|r| pool.shares.slot(r));
        if let Some(route) = route.and_then(|slot| s.route(slot.index())) {
            route.rejected.inc();
        }
    }

    fn queue_outcome(&self, pool: &Pool, s: &PoolSeries, outcome: &str, waited: Option<Duration>) {
        self.metrics
            .queue_outcomes
            .with_label_values(&[&pool.name, outcome])
            .inc();
        if let Some(w) = waited {
            s.queue_wait.observe(w.as_secs_f64());
        }
    }

    /// The first bytes of an admitted request's response body.
    pub fn first_byte(&self, obs: &mut Observation) {
        if obs.first_byte.is_some() {
            return;
        }
        let now = Instant::now();
        obs.first_byte = Some(now);
        self.time_since_admission(obs, now, |o| &o.time_to_first_byte);
    }

    /// The first generated content (a stream's first content event, or any body bytes).
    pub fn first_token(&self, obs: &mut Observation) {
        if obs.first_token.is_some() {
            return;
        }
        let now = Instant::now();
        obs.first_token = Some(now);
        self.time_since_admission(obs, now, |o| &o.time_to_first_token);
    }

    fn time_since_admission(
        &self,
        obs: &Observation,
        now: Instant,
        histogram: impl Fn(&series::OperationSeries) -> &prometheus::Histogram,
    ) {
        let (Some(pool), Some(op), Some(at)) = (&obs.pool, obs.operation, obs.admitted_at) else {
            return;
        };
        if let Some(s) = self.series(pool) {
            histogram(s.operation(op)).observe(now.duration_since(at).as_secs_f64());
        }
    }

    /// An admitted request settled: its charge and usage, and its access-log line.
    pub fn settled(&self, mut obs: Observation, settled: &Settled) {
        self.trace(&mut obs, Some(settled));
        if let Some(pool) = obs.pool.as_deref() {
            self.tally(
                pool,
                obs.route_slot,
                Event::Settled {
                    charge: settled.charge,
                    usage: settled.usage,
                },
            );
        }
        if let Some(s) = obs.pool.as_deref().and_then(|p| self.series(p)) {
            record_settlement(s, &obs, settled);
        }
        access_log::settled(&obs, settled);
    }

    /// A request that was not admitted was answered (or its client left): its line.
    pub fn finished(&self, mut obs: Observation) {
        self.trace(&mut obs, None);
        access_log::unadmitted(&obs);
    }

    /// Upstream answered an admitted or passed request with `status`.
    pub fn upstream_response(&self, pool: Option<&Pool>, status: StatusCode) {
        let pool = pool.map_or(NO_POOL, |p| &p.name);
        self.metrics
            .upstream_responses
            .with_label_values(&[pool, status.as_str()])
            .inc();
    }

    /// Upstream failed without a response, or mid-response.
    pub fn upstream_error(&self, pool: Option<&Pool>, kind: &str, error: &dyn std::fmt::Display) {
        let pool = pool.map_or(NO_POOL, |p| &p.name);
        self.metrics
            .upstream_errors
            .with_label_values(&[pool, kind])
            .inc();
        tracing::warn!(pool, kind, %error, "upstream request failed");
    }

    /// A call of `pool` from route slot `route` stopped at its output cap.
    pub fn truncated(&self, pool: &Pool, route: Option<crate::admission::routes::RouteSlot>) {
        let series = route.and_then(|slot| self.series(pool)?.route(slot.index()));
        if let Some(series) = series {
            series.truncated.inc();
        }
    }

    /// A call of `pool` from route slot `route` that stopped at the learned cap was sent again
    /// with the caller's own maxTokens; `outcome` is what the caller got.
    pub fn adaptive_retry(
        &self,
        pool: &Pool,
        route: Option<crate::admission::routes::RouteSlot>,
        outcome: RetryOutcome,
    ) {
        let series = route.and_then(|slot| self.series(pool)?.route(slot.index()));
        if let Some(counter) = series.and_then(|s| s.adaptive_retry(outcome)) {
            counter.inc();
        }
    }

    /// Upstream refused a call of `pool` on its daily quota; `hint` is passed on to the client.
    pub fn upstream_daily_throttled(&self, pool: &Pool, hint: Duration) {
        self.metrics
            .upstream_daily_throttles
            .with_label_values(&[&pool.name])
            .inc();
        if let Some(s) = self.series(pool) {
            s.retry_hint.observe(hint.as_secs_f64());
        }
        tracing::warn!(
            pool = %pool.name,
            retry_after_ms = hint.as_millis() as u64,
            "upstream refused a call on its daily quota (Too many tokens per day): callers get 429 daily_quota until the day refills; the per-minute limit is unchanged"
        );
    }

    /// Upstream throttled a call of `pool`; `hint` is the retry hint passed on to the client
    /// (none for a throttle reported in-band, where the client gets upstream's frame as is).
    pub fn upstream_throttled(
        &self,
        pool: &Pool,
        obs: Option<&Observation>,
        hint: Option<Duration>,
    ) {
        self.tally(
            pool,
            obs.and_then(|o| o.route_slot),
            Event::UpstreamThrottled,
        );
        self.metrics
            .upstream_throttles
            .with_label_values(&[&pool.name])
            .inc();
        if let (Some(s), Some(hint)) = (self.series(pool), hint) {
            s.retry_hint.observe(hint.as_secs_f64());
        }
    }
}

fn record_settlement(s: &PoolSeries, obs: &Observation, settled: &Settled) {
    s.settlement(settled.rule).inc();
    s.charged_tokens.inc_by(settled.charge);
    if let Some(op) = obs.operation {
        s.operation(op)
            .request_duration
            .observe(settled.elapsed.as_secs_f64());
    }
    if let Some(route) = obs.route_slot.and_then(|i| s.route(i)) {
        route.charged_tokens.inc_by(settled.charge);
    }
    let Some(usage) = settled.usage else { return };
    s.input_tokens.inc_by(usage.input_tokens);
    s.output_tokens.inc_by(usage.output_tokens);
    s.cache_read_tokens.inc_by(usage.cache_read_input_tokens);
    s.cache_write_tokens.inc_by(usage.cache_write_input_tokens);
    if settled.charge > 0 {
        s.over_reservation_ratio
            .observe(settled.reserved as f64 / settled.charge as f64);
    }
    let prompt = usage
        .input_tokens
        .saturating_add(usage.cache_read_input_tokens)
        .saturating_add(usage.cache_write_input_tokens);
    s.input_tokens_per_request.observe(prompt as f64);
    s.output_tokens_per_request
        .observe(usage.output_tokens as f64);
    s.requested_max_tokens.observe(settled.max_tokens as f64);
}
