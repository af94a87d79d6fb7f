//! Settling an admitted request: the guard that holds its reservation until the price is known.
//!
//! # Settlement rules
//!
//! Every admitted request is settled exactly once, by the first of these that applies:
//!
//! | rule | when | charge |
//! |---|---|---|
//! | `usage` | upstream reported usage (Converse body, ConverseStream `metadata`, InvokeModel headers or body, the last chunk's invocation metrics) | `input + cacheWrite + output x burndown`, the moment it is seen |
//! | `not_charged` | upstream answered an error status, or was never reached | 0: Bedrock does not charge failed requests |
//! | `no_usage` | a response started but ended without usage: stream cut, idle timeout, corrupt frames, the client hung up | the larger of the reservation and `input estimate + output seen x burndown`: generation may have run to `maxTokens` and may still be running upstream |
//! | `timeout` | no response head within `upstream.response_timeout_secs`, or by the shutdown drain deadline | the reservation |
//! | `abandoned` | the request was dropped before any of the above (the client hung up while the proxy waited for upstream) | the reservation |
//!
//! The guard settles on `Drop` by the `abandoned` rule, so no path can leak a reservation or a
//! concurrency permit.
//!
//! Settlement is also where a request is observed: the charge and duration metrics, the length
//! histograms and maxTokens advice ([`super::advice`], on `usage`), and the request's access-log
//! line ([`crate::access_log`]), written once, by whichever rule settles it.

use std::{sync::Arc, time::Duration};

use futures_util::FutureExt;
use tokio::time::Instant;

use super::{advice::SlotIndex, pools::Pool, queue::AdmissionQueue};
use crate::{
    access_log::{AccessRecord, Decision, Settlement},
    bedrock::{Operation, Usage},
    ledger::{Ledger, Reservation},
    metrics::{Metrics, RouteMetrics},
};

/// How a request's reservation was priced; the `rule` label of `tokengate_settlements_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Usage,
    NotCharged,
    NoUsage,
    Timeout,
    Abandoned,
}

impl Rule {
    pub const ALL: [Rule; 5] = [
        Rule::Usage,
        Rule::NotCharged,
        Rule::NoUsage,
        Rule::Timeout,
        Rule::Abandoned,
    ];

    /// The position of this rule in [`Rule::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            Rule::Usage => "usage",
            Rule::NotCharged => "not_charged",
            Rule::NoUsage => "no_usage",
            Rule::Timeout => "timeout",
            Rule::Abandoned => "abandoned",
        }
    }
}

/// The estimate a reservation was made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// The estimator's raw input figure (before calibration).
    pub raw_input: u64,
    /// The calibrated input figure that was reserved.
    pub input: u64,
    pub max_tokens: u64,
}

impl Estimate {
    pub fn reservation(&self) -> u64 {
        self.input.saturating_add(self.max_tokens)
    }
}

/// An admitted request holding its reservation until settled.
#[derive(Debug)]
pub struct Admitted {
    pool: Arc<Pool>,
    ledger: Arc<dyn Ledger>,
    metrics: Arc<Metrics>,
    reservation: Option<Reservation>,
    operation: Operation,
    estimate: Estimate,
    started: Instant,
    first_byte_seen: bool,
    /// Observability: the maxTokens-advice slot, queueing, first content, the access-log line.
    first_token: Option<Instant>,
    advice_slot: SlotIndex,
    queued: bool,
    usage: Option<Usage>,
    /// Boxed: the guard travels in `Result`s on the request path and should stay small.
    access: Option<Box<AccessRecord>>,
    /// The caller's route series in this pool.
    route: Option<Arc<RouteMetrics>>,
    /// The body to forward instead of the caller's (maxTokens lowered to the route's ceiling).
    rewritten_body: Option<bytes::Bytes>,
    /// This request's part of its pool's pending burndown excess.
    excess_claimed: u64,
}

impl Admitted {
    pub(crate) fn new(
        pool: Arc<Pool>,
        ledger: Arc<dyn Ledger>,
        metrics: Arc<Metrics>,
        reservation: Reservation,
        operation: Operation,
        estimate: Estimate,
    ) -> Admitted {
        let pm = &pool.metrics;
        pm.reserved_tokens.add(reservation.tokens() as i64);
        pm.inflight_requests.inc();
        pm.reserved_tokens_total.inc_by(reservation.tokens());
        Admitted {
            pool,
            ledger,
            metrics,
            reservation: Some(reservation),
            operation,
            estimate,
            started: Instant::now(),
            first_byte_seen: false,
            first_token: None,
            advice_slot: SlotIndex::default(),
            queued: false,
            usage: None,
            access: None,
            route: None,
            rewritten_body: None,
            excess_claimed: 0,
        }
    }

    /// Output seen so far in the response (an estimate): with burndown, what it will cost
    /// beyond the reservation is held back in the pool until the request settles.
    pub fn output_progress(&mut self, output_seen: u64) {
        let burndown = u64::from(self.pool.config.output_burndown);
        let Some(reservation) = self.reservation.as_ref() else {
            return;
        };
        if burndown <= 1 {
            return;
        }
        let projected = self
            .estimate
            .input
            .saturating_add(output_seen.saturating_mul(burndown));
        let excess = projected.saturating_sub(reservation.tokens());
        if excess > self.excess_claimed {
            self.pool.add_pending_excess(excess - self.excess_claimed);
            self.excess_claimed = excess;
        }
    }

    /// Counts the request in its route's series until it settles.
    pub(crate) fn set_route(&mut self, route: Option<Arc<RouteMetrics>>) {
        let (Some(route), Some(reservation)) = (route, self.reservation.as_ref()) else {
            return;
        };
        route.admitted.inc();
        route.reserved_tokens.add(reservation.tokens() as i64);
        if reservation.share().is_some_and(|s| s.recovered) {
            route.recovery_admissions.inc();
        }
        self.route = Some(route);
    }

    pub(crate) fn set_rewritten_body(&mut self, body: bytes::Bytes) {
        self.rewritten_body = Some(body);
    }

    /// The body to forward in place of the caller's, if admission rewrote it.
    pub fn take_rewritten_body(&mut self) -> Option<bytes::Bytes> {
        self.rewritten_body.take()
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn estimate(&self) -> Estimate {
        self.estimate
    }

    pub fn is_settled(&self) -> bool {
        self.reservation.is_none()
    }

    /// Records time to first byte, once.
    pub fn first_byte(&mut self) {
        if !self.first_byte_seen {
            self.first_byte_seen = true;
            self.pool
                .metrics
                .operation(self.operation)
                .time_to_first_byte
                .observe(self.started.elapsed().as_secs_f64());
        }
    }

    /// Records time to first token (the first generated content), once.
    pub fn first_token(&mut self) {
        if self.first_token.is_none() {
            let now = Instant::now();
            self.first_token = Some(now);
            self.pool
                .metrics
                .operation(self.operation)
                .time_to_first_token
                .observe(now.duration_since(self.started).as_secs_f64());
        }
    }

    /// Which maxTokens-advice slot (model) of its pool this request counts in.
    pub(crate) fn set_advice_slot(&mut self, slot: SlotIndex) {
        self.advice_slot = slot;
    }

    /// The request waited in the admission queue before it was admitted.
    pub(crate) fn set_queued(&mut self) {
        self.queued = true;
    }

    /// Takes the request's access-log record: the line is written at settlement.
    pub fn attach_access(&mut self, mut record: AccessRecord) {
        record.decide(if self.queued {
            Decision::QueuedThenAdmitted
        } else {
            Decision::Admitted
        });
        self.access = Some(Box::new(record));
    }

    /// The answer the client gets (upstream's head, or tokengate's own error), for the access log.
    pub fn answered(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        if let Some(record) = self.access.as_mut() {
            record.answered(status, headers);
        }
    }

    /// Settles to Bedrock's charge for `usage`.
    pub fn settle_usage(&mut self, usage: &Usage) {
        let Some(reserved) = self.reservation.as_ref().map(Reservation::tokens) else {
            return;
        };
        let charge = usage.charge(self.pool.config.output_burndown);
        let pm = &self.pool.metrics;
        pm.input_tokens.inc_by(usage.input_tokens);
        pm.output_tokens.inc_by(usage.output_tokens);
        pm.cache_read_tokens.inc_by(usage.cache_read_input_tokens);
        pm.cache_write_tokens.inc_by(usage.cache_write_input_tokens);
        if charge > 0 {
            pm.over_reservation_ratio
                .observe(reserved as f64 / charge as f64);
        }
        let actual_input =
            usage.input_tokens + usage.cache_read_input_tokens + usage.cache_write_input_tokens;
        // One clock read serves both the pool's typical duration and the request's.
        let elapsed = self.started.elapsed();
        self.pool.learn(
            self.estimate.raw_input,
            actual_input,
            reserved,
            charge,
            elapsed,
        );
        pm.calibration_ratio.set(self.pool.calibration_ratio());
        super::advice::on_usage(
            &self.pool,
            self.advice_slot,
            self.estimate.max_tokens,
            usage,
        );
        self.usage = Some(*usage);
        self.finish_after(charge, Rule::Usage, elapsed);
    }

    /// Upstream answered an error, or was never reached: nothing is charged.
    pub fn settle_not_charged(&mut self) {
        self.finish(0, Rule::NotCharged);
    }

    /// The response ended without usage; `output_seen` is the estimate of what was generated.
    pub fn settle_without_usage(&mut self, output_seen: u64) {
        let Some(reserved) = self.reservation.as_ref().map(Reservation::tokens) else {
            return;
        };
        let seen = self.estimate.input
            + output_seen.saturating_mul(u64::from(self.pool.config.output_burndown));
        self.finish(reserved.max(seen), Rule::NoUsage);
    }

    /// No response head in time: the request may still run upstream.
    pub fn settle_timeout(&mut self) {
        let reserved = self.reservation.as_ref().map_or(0, Reservation::tokens);
        self.finish(reserved, Rule::Timeout);
    }

    fn finish(&mut self, charge: u64, rule: Rule) {
        if self.reservation.is_some() {
            self.finish_after(charge, rule, self.started.elapsed());
        }
    }

    /// Settles `elapsed` after admission.
    fn finish_after(&mut self, charge: u64, rule: Rule, elapsed: Duration) {
        let Some(reservation) = self.reservation.take() else {
            return;
        };
        self.pool
            .release_pending_excess(std::mem::take(&mut self.excess_claimed));
        let name = &*self.pool.name;
        let pm = &self.pool.metrics;
        pm.reserved_tokens.sub(reservation.tokens() as i64);
        pm.inflight_requests.dec();
        pm.settlement(rule).inc();
        pm.charged_tokens.inc_by(charge);
        if let Some(route) = &self.route {
            route.reserved_tokens.sub(reservation.tokens() as i64);
            route.charged_tokens.inc_by(charge);
        }
        pm.operation(self.operation)
            .request_duration
            .observe(elapsed.as_secs_f64());
        if let Some(record) = self.access.take() {
            record.finish_settled(&Settlement {
                pool: name,
                reserved: reservation.tokens(),
                charged: charge,
                rule: rule.label(),
                max_tokens: self.estimate.max_tokens,
                usage: self.usage,
                first_token: self.first_token,
            });
        }
        settle_in_background(
            self.ledger.clone(),
            self.metrics.clone(),
            self.pool.queue.clone(),
            reservation,
            charge,
        );
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(reserved) = self.reservation.as_ref().map(Reservation::tokens) {
            self.finish(reserved, Rule::Abandoned);
        }
    }
}

/// Settles now if the backend answers without waiting (the memory ledger always does), else on
/// a task: settlement happens from `Drop` and `poll_frame`, which cannot wait.
fn settle_in_background(
    ledger: Arc<dyn Ledger>,
    metrics: Arc<Metrics>,
    queue: Arc<AdmissionQueue>,
    reservation: Reservation,
    charge: u64,
) {
    let backend = ledger.backend();
    let started = std::time::Instant::now();
    now_or_spawn(async move {
        let result = ledger.settle(reservation, charge).await;
        // Capacity came back: queued requests may fit now.
        queue.wake();
        metrics
            .ledger_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            metrics.ledger_errors.with_label_values(&[backend]).inc();
            tracing::error!(error = %e, "settlement failed");
        }
    });
}

/// Runs `work` to completion now if it never waits (the memory ledger), else on a task.
/// Settlement happens from `Drop` and `poll_frame`, which cannot wait. A settlement on its way
/// counts in its ledger's `LedgerStats::settlements_in_flight` from its first poll (here) on,
/// and shutdown waits for them.
fn now_or_spawn(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let mut work = Box::pin(work);
    if (&mut work).now_or_never().is_some() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(work);
        }
        Err(_) => tracing::error!("settlement outside a runtime could not complete"),
    }
}

/// The `x-amz-retry-after` window used when passing on an upstream throttle: about half a typical
/// request, at least a second.
pub fn upstream_throttle_wait(pool: &Pool) -> Duration {
    (pool.typical().0 / 2).max(Duration::from_secs(1))
}

/// Releases a reservation that was never used (its caller left before taking it), uncharged.
pub fn release_unused(ledger: Arc<dyn Ledger>, reservation: Reservation) {
    now_or_spawn(async move {
        if let Err(e) = ledger.settle(reservation, 0).await {
            tracing::error!(error = %e, "releasing an unused reservation failed");
        }
    });
}
