//! What `/metrics` copies from live state at each scrape: gauges of what pools, queues, routes
//! and the ledger hold now, the maxTokens advice, what adaptive maxTokens learned, and counts kept by their owners (queue
//! cancellations, reservations dropped unsettled). Computing them here, when read, keeps the
//! request path free of it.

use crate::{
    admission::{Admission, PoolView, budgets::BudgetView},
    ledger::{Ledger, LedgerMode},
    metrics::{Metrics, Publication},
    upstream::HostView,
};

use super::Observer;

/// Publications of counts the ledger keeps ([`crate::ledger::LedgerStats`]), which outlive
/// policy reloads (as the ledger does).
#[derive(Debug, Default)]
pub struct LedgerPublications {
    unsettled: Publication,
    absorbed_errors: Publication,
    fallbacks: Publication,
}

impl Observer {
    /// Copies the state of every pool of `admission` (`views`, read from it just now).
    pub fn publish_pools(&self, admission: &Admission, views: &[PoolView]) {
        let m = &self.metrics;
        for (pool, view) in admission.pools().iter().zip(views) {
            let Some(s) = self.series(pool) else { continue };
            if let Some(ledger) = &view.ledger {
                m.tokens_available
                    .with_label_values(&[&*pool.name])
                    .set(ledger.tokens_available as f64);
                if let Some(day) = ledger.day_tokens_available {
                    m.daily_tokens_available
                        .with_label_values(&[&*pool.name])
                        .set(day);
                }
            }
            s.effective_tokens_per_minute
                .set(view.effective_tokens_per_minute as f64);
            s.calibration_ratio
                .set(view.learned.input_calibration_ratio);
            s.reserved_tokens
                .set(i64::try_from(pool.load.reserved_tokens()).unwrap_or(i64::MAX));
            s.inflight_requests
                .set(i64::try_from(pool.load.in_flight()).unwrap_or(i64::MAX));
            m.queue_depth
                .with_label_values(&[&*pool.name])
                .set(i64::try_from(pool.queue.depth()).unwrap_or(i64::MAX));
            m.queued_tokens
                .with_label_values(&[&*pool.name])
                .set(i64::try_from(pool.queue.queued_tokens()).unwrap_or(i64::MAX));
            s.queue_cancelled.publish(
                &m.queue_outcomes
                    .with_label_values(&[&*pool.name, "cancelled"]),
                pool.queue.cancelled(),
            );
            for (route, series) in view.routes.iter().zip(s.routes()) {
                series.reserved_tokens.set(route.reserved_tokens);
            }
            if let (Some(series), Some(endpoint)) = (&s.endpoint, &view.endpoint) {
                series.copies.set(i64::from(endpoint.copies));
                series.demand_per_copy.set(endpoint.demand_per_copy);
                let (counter, published) = &series.refreshes_ok;
                published.publish(counter, endpoint.refreshes);
                let (counter, published) = &series.refreshes_error;
                published.publish(counter, endpoint.refresh_errors);
            }
            self.publish_advice(&pool.name, view);
            self.publish_adaptive(&pool.name, view);
        }
    }

    /// What each route's adaptive maxTokens learned, as `{pool,route,model}` gauges.
    fn publish_adaptive(&self, pool: &str, view: &PoolView) {
        let m = &self.metrics;
        for a in &view.adaptive_max_tokens {
            let labels = [pool, a.route.as_str(), a.model.as_str()];
            let gauge = |g: &prometheus::IntGaugeVec, v: u64| {
                g.with_label_values(&labels)
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            };
            gauge(&m.adaptive_max_tokens, a.cap.unwrap_or(0));
            gauge(&m.adaptive_capped_calls, a.guard.capped_calls);
            gauge(&m.adaptive_proxy_truncations, a.guard.proxy_truncations);
            gauge(&m.adaptive_raises, u64::from(a.guard.raises));
        }
    }

    /// What is left of every budget window (`views`, read just now).
    pub fn publish_budgets(&self, views: &[BudgetView]) {
        for budget in views {
            for w in &budget.windows {
                if let Some(left) = w.available {
                    self.metrics
                        .budget_tokens_available
                        .with_label_values(&[budget.scope.as_str(), w.name])
                        .set(left);
                }
            }
        }
    }

    /// The maxTokens advice as `{pool,model}` gauges.
    fn publish_advice(&self, pool: &str, view: &PoolView) {
        let m = &self.metrics;
        for a in &view.max_tokens_advice {
            let labels = [pool, a.model.as_str()];
            let gauge = |g: &prometheus::IntGaugeVec, v: u64| {
                g.with_label_values(&labels)
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            };
            gauge(&m.output_tokens_p99, a.p99_output);
            gauge(&m.requested_max_tokens_p99, a.p99_requested_max_tokens);
            if let Some(s) = a.suggested_max_tokens {
                gauge(&m.suggested_max_tokens, s);
            }
            m.max_tokens_unused_ratio
                .with_label_values(&labels)
                .set(a.reserved_but_unused_share);
        }
    }
}

/// The ledger's mode, and what it counts itself: reservations dropped unsettled, the errors it
/// absorbed (added to `tokengate_ledger_errors_total`, where the pipeline counts the errors it
/// was returned), switches to the local share.
pub fn ledger(metrics: &Metrics, ledger: &dyn Ledger, published: &LedgerPublications) {
    let mode = ledger.mode();
    for m in LedgerMode::ALL {
        metrics
            .ledger_mode
            .with_label_values(&[m.label()])
            .set(i64::from(m == mode));
    }
    let stats = ledger.stats();
    published
        .unsettled
        .publish(&metrics.unsettled_reservations, stats.unsettled_drops());
    published.absorbed_errors.publish(
        &metrics.ledger_errors.with_label_values(&[ledger.backend()]),
        stats.absorbed_errors(),
    );
    published
        .fallbacks
        .publish(&metrics.ledger_fallbacks, stats.fallbacks());
}

/// Copies the upstream HTTP/2 connections and their streams, per host.
pub fn upstream(metrics: &Metrics, hosts: &[HostView]) {
    for view in hosts {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        metrics
            .upstream_connections
            .with_label_values(&[&*view.host])
            .set(count(view.connections));
        metrics
            .upstream_streams
            .with_label_values(&[&*view.host])
            .set(count(view.streams));
    }
}
