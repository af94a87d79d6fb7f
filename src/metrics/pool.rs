//! One pool's metric handles, resolved once.
//!
//! `MetricVec::with_label_values` hashes the label values and takes a lock on every call; an
//! admitted and settled request touches about twenty series, which would cost a microsecond on
//! the request path. Each pool resolves its series when it is built (pool names and operations
//! are fixed by config), and the request path uses these handles directly.

use prometheus::{Gauge, Histogram, IntCounter, IntGauge};

use super::Metrics;
use crate::bedrock::Operation;

/// Series of one pool and one operation.
#[derive(Debug, Clone)]
pub struct OperationMetrics {
    pub admitted: IntCounter,
    pub rejected: IntCounter,
    pub request_duration: Histogram,
    pub time_to_first_byte: Histogram,
    pub time_to_first_token: Histogram,
}

/// The `reason` labels of `tokengate_shadow_rejections_total`.
pub const SHADOW_REASONS: [&str; 8] = [
    "tokens",
    "requests",
    "concurrency",
    "share",
    "never_fits",
    "not_allowed",
    "max_tokens_ceiling",
    "ledger_error",
];

/// Series of one route in one pool.
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    pub admitted: IntCounter,
    pub rejected: IntCounter,
    pub reserved_tokens: IntGauge,
    pub charged_tokens: IntCounter,
    pub recovery_admissions: IntCounter,
}

impl RouteMetrics {
    /// Resolves (and creates at zero) the route's series in `pool`.
    pub fn new(m: &Metrics, pool: &str, route: &str) -> RouteMetrics {
        let two = [pool, route];
        for outcome in ["not_allowed", "invalid", "shadow_rejected"] {
            m.route_requests.with_label_values(&[pool, route, outcome]);
        }
        m.max_tokens_clamped.with_label_values(&two);
        for reason in SHADOW_REASONS {
            m.shadow_rejections
                .with_label_values(&[pool, route, reason]);
        }
        let reserved_tokens = m.route_reserved_tokens.with_label_values(&two);
        RouteMetrics {
            admitted: m
                .route_requests
                .with_label_values(&[pool, route, "admitted"]),
            rejected: m
                .route_requests
                .with_label_values(&[pool, route, "rejected"]),
            reserved_tokens,
            charged_tokens: m.route_charged_tokens.with_label_values(&two),
            recovery_admissions: m.recovery_admissions.with_label_values(&two),
        }
    }
}

/// Series of one pool.
#[derive(Debug, Clone)]
pub struct PoolMetrics {
    pub reserved_tokens: IntGauge,
    pub inflight_requests: IntGauge,
    pub reserved_tokens_total: IntCounter,
    pub charged_tokens: IntCounter,
    pub input_tokens: IntCounter,
    pub output_tokens: IntCounter,
    pub cache_read_tokens: IntCounter,
    pub cache_write_tokens: IntCounter,
    pub over_reservation_ratio: Histogram,
    pub calibration_ratio: Gauge,
    pub effective_tokens_per_minute: Gauge,
    pub input_tokens_per_request: Histogram,
    pub output_tokens_per_request: Histogram,
    pub requested_max_tokens: Histogram,
    /// By settlement rule, in the order of [`crate::admission::Rule::ALL`].
    pub settlements: Vec<IntCounter>,
    /// By operation, in the order of [`Operation::ALL`].
    operations: Vec<OperationMetrics>,
}

impl PoolMetrics {
    pub fn new(m: &Metrics, pool: &str) -> PoolMetrics {
        let one = [pool];
        let operations = Operation::ALL
            .iter()
            .map(|op| {
                let labels = [pool, op.name()];
                OperationMetrics {
                    admitted: m.requests.with_label_values(&[pool, op.name(), "admitted"]),
                    rejected: m.requests.with_label_values(&[pool, op.name(), "rejected"]),
                    request_duration: m.request_duration_seconds.with_label_values(&labels),
                    time_to_first_byte: m.time_to_first_byte_seconds.with_label_values(&labels),
                    time_to_first_token: m.time_to_first_token_seconds.with_label_values(&labels),
                }
            })
            .collect();
        PoolMetrics {
            reserved_tokens: m.reserved_tokens.with_label_values(&one),
            inflight_requests: m.inflight_requests.with_label_values(&one),
            reserved_tokens_total: m.reserved_tokens_total.with_label_values(&one),
            charged_tokens: m.charged_tokens.with_label_values(&one),
            input_tokens: m.input_tokens.with_label_values(&one),
            output_tokens: m.output_tokens.with_label_values(&one),
            cache_read_tokens: m.cache_read_tokens.with_label_values(&one),
            cache_write_tokens: m.cache_write_tokens.with_label_values(&one),
            over_reservation_ratio: m.over_reservation_ratio.with_label_values(&one),
            calibration_ratio: m.calibration_ratio.with_label_values(&one),
            effective_tokens_per_minute: m.effective_tokens_per_minute.with_label_values(&one),
            input_tokens_per_request: m.input_tokens_per_request.with_label_values(&one),
            output_tokens_per_request: m.output_tokens_per_request.with_label_values(&one),
            requested_max_tokens: m.requested_max_tokens.with_label_values(&one),
            settlements: crate::admission::Rule::ALL
                .iter()
                .map(|rule| m.settlements.with_label_values(&[pool, rule.label()]))
                .collect(),
            operations,
        }
    }

    pub fn operation(&self, op: Operation) -> &OperationMetrics {
        // `operations` holds one entry per member of Operation::ALL, in order.
        &self.operations[op.index()]
    }

    pub fn settlement(&self, rule: crate::admission::Rule) -> &IntCounter {
        &self.settlements[rule.index()]
    }
}
