//! Each pool's and route's metric series, resolved once per policy.
//!
//! `MetricVec::with_label_values` hashes the label values and takes a lock on every call; an
//! admitted and settled request touches about twenty series, which would cost a microsecond on
//! the request path. The series of every pool (names fixed by config), operation (a fixed list),
//! settlement rule and route are resolved when the policy is built, and the request path indexes
//! them by the pool's id and the route's slot. Every series of a fixed label set is created at
//! zero, so `rate()` and alerts see it before the first event (`with_label_values` leaves an
//! existing series as it is, so a reload never resets a counter).

use prometheus::{Gauge, Histogram, IntCounter, IntGauge};

use crate::{
    admission::{
        Admission, MissingMaxTokens, Pool, SettlementRule, ShadowReason, adaptive::RetryOutcome,
    },
    bedrock::Operation,
    metrics::{Metrics, Publication},
};

/// Series of one pool and one operation.
#[derive(Debug, Clone)]
pub struct OperationSeries {
    pub admitted: IntCounter,
    pub rejected: IntCounter,
    pub request_duration: Histogram,
    pub time_to_first_byte: Histogram,
    pub time_to_first_token: Histogram,
}

/// Series of one route in one pool.
#[derive(Debug, Clone)]
pub struct RouteSeries {
    pub admitted: IntCounter,
    pub rejected: IntCounter,
    pub reserved_tokens: IntGauge,
    pub charged_tokens: IntCounter,
    pub recovery_admissions: IntCounter,
    pub max_tokens_clamped: IntCounter,
    pub truncated: IntCounter,
    /// By action, in the order of [`MissingMaxTokens::ALL`].
    max_tokens_missing: Vec<IntCounter>,
    /// By outcome, in the order of [`RetryOutcome::ALL`].
    adaptive_retries: Vec<IntCounter>,
}

/// Series of one pool.
#[derive(Debug)]
pub struct PoolSeries {
    /// Publishes the queue's count of waiters whose caller left.
    pub queue_cancelled: Publication,
    /// An endpoint pool's: its copies, demand per copy, and published refresh counts.
    pub endpoint: Option<EndpointSeries>,
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
    pub retry_hint: Histogram,
    pub queue_wait: Histogram,
    /// By settlement rule, in the order of [`SettlementRule::ALL`].
    settlements: Vec<IntCounter>,
    /// By operation, in the order of [`Operation::ALL`].
    operations: Vec<OperationSeries>,
    /// By route slot, in the pool's route order.
    routes: Vec<RouteSeries>,
}

/// Series of an endpoint pool.
#[derive(Debug)]
pub struct EndpointSeries {
    pub copies: IntGauge,
    pub demand_per_copy: Gauge,
    /// Publish the pool's counts of successful and failed refreshes.
    pub refreshes_ok: (IntCounter, Publication),
    pub refreshes_error: (IntCounter, Publication),
}

impl EndpointSeries {
    fn new(m: &Metrics, pool: &str) -> EndpointSeries {
        let refreshes = |result| {
            (
                m.endpoint_copy_refreshes.with_label_values(&[pool, result]),
                Publication::default(),
            )
        };
        EndpointSeries {
            copies: m.endpoint_copies.with_label_values(&[pool]),
            demand_per_copy: m.endpoint_demand_per_copy.with_label_values(&[pool]),
            refreshes_ok: refreshes("ok"),
            refreshes_error: refreshes("error"),
        }
    }
}

/// The `outcome` labels of `tokengate_queue_outcomes_total`.
pub const QUEUE_OUTCOMES: [&str; 4] = ["admitted", "timed_out", "cancelled", "shutdown"];
/// The `kind` labels of `tokengate_upstream_errors_total`.
pub const UPSTREAM_ERROR_KINDS: [&str; 8] = [
    "connect",
    "timeout",
    "credentials",
    "signing",
    "stream_cut",
    "bad_frame",
    "idle_timeout",
    "count_tokens",
];
/// The `reason` labels of `tokengate_rejections_total`.
pub const REJECTION_REASONS: [&str; 9] = [
    "tokens",
    "requests",
    "concurrency",
    "share",
    "daily_quota",
    "budget",
    "route_concurrency",
    "never_fits",
    "queue_full",
];

impl PoolSeries {
    /// Resolves (and creates at zero) every series of `pool`.
    pub fn new(m: &Metrics, pool: &Pool, ledger_backend: &str) -> PoolSeries {
        let name = &*pool.name;
        let one = [name];
        init_fixed(m, name, ledger_backend);
        m.configured_tokens_per_minute
            .with_label_values(&one)
            .set(pool.config.tokens_per_minute as f64);
        let operations = Operation::ALL
            .iter()
            .map(|op| OperationSeries::new(m, name, *op))
            .collect();
        let routes = pool
            .shares
            .shares()
            .iter()
            .map(|share| RouteSeries::new(m, name, &share.route))
            .collect();
        PoolSeries {
            queue_cancelled: Publication::default(),
            endpoint: pool.endpoint_config().map(|_| EndpointSeries::new(m, name)),
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
            retry_hint: m.retry_hint_seconds.with_label_values(&one),
            queue_wait: m.queue_wait_seconds.with_label_values(&one),
            settlements: SettlementRule::ALL
                .iter()
                .map(|rule| m.settlements.with_label_values(&[name, rule.label()]))
                .collect(),
            operations,
            routes,
        }
    }

    pub fn operation(&self, op: Operation) -> &OperationSeries {
        // `operations` holds one entry per member of Operation::ALL, in order.
        &self.operations[op.index()]
    }

    pub fn settlement(&self, rule: SettlementRule) -> &IntCounter {
        &self.settlements[rule.index()]
    }

    /// The route's series; `None` for a slot the pool does not have (never, for slots it issued).
    pub fn route(&self, slot: usize) -> Option<&RouteSeries> {
        self.routes.get(slot)
    }

    pub fn routes(&self) -> &[RouteSeries] {
        &self.routes
    }
}

/// Series of a pool with fixed label sets that no handle above covers.
fn init_fixed(m: &Metrics, pool: &str, ledger_backend: &str) {
    m.ledger_errors.with_label_values(&[ledger_backend]);
    m.queue_depth.with_label_values(&[pool]);
    m.queued_tokens.with_label_values(&[pool]);
    m.upstream_throttles.with_label_values(&[pool]);
    m.upstream_daily_throttles.with_label_values(&[pool]);
    for outcome in QUEUE_OUTCOMES {
        m.queue_outcomes.with_label_values(&[pool, outcome]);
    }
    for kind in UPSTREAM_ERROR_KINDS {
        m.upstream_errors.with_label_values(&[pool, kind]);
    }
    for reason in REJECTION_REASONS {
        m.rejections.with_label_values(&[pool, reason]);
    }
}

impl OperationSeries {
    fn new(m: &Metrics, pool: &str, op: Operation) -> OperationSeries {
        let labels = [pool, op.name()];
        let api = op.api().label();
        OperationSeries {
            admitted: m
                .requests
                .with_label_values(&[pool, api, op.name(), "admitted"]),
            rejected: m
                .requests
                .with_label_values(&[pool, api, op.name(), "rejected"]),
            request_duration: m.request_duration_seconds.with_label_values(&labels),
            time_to_first_byte: m.time_to_first_byte_seconds.with_label_values(&labels),
            time_to_first_token: m.time_to_first_token_seconds.with_label_values(&labels),
        }
    }
}

impl RouteSeries {
    /// Resolves (and creates at zero) the route's series in `pool`.
    fn new(m: &Metrics, pool: &str, route: &str) -> RouteSeries {
        let two = [pool, route];
        for outcome in ["not_allowed", "invalid", "shadow_rejected"] {
            m.route_requests.with_label_values(&[pool, route, outcome]);
        }
        for reason in ShadowReason::ALL {
            m.shadow_rejections
                .with_label_values(&[pool, route, reason.label()]);
        }
        RouteSeries {
            admitted: m
                .route_requests
                .with_label_values(&[pool, route, "admitted"]),
            rejected: m
                .route_requests
                .with_label_values(&[pool, route, "rejected"]),
            reserved_tokens: m.route_reserved_tokens.with_label_values(&two),
            charged_tokens: m.route_charged_tokens.with_label_values(&two),
            recovery_admissions: m.recovery_admissions.with_label_values(&two),
            max_tokens_clamped: m.max_tokens_clamped.with_label_values(&two),
            truncated: m.truncated.with_label_values(&two),
            max_tokens_missing: MissingMaxTokens::ALL
                .iter()
                .map(|a| {
                    m.max_tokens_missing
                        .with_label_values(&[pool, route, a.label()])
                })
                .collect(),
            adaptive_retries: RetryOutcome::ALL
                .iter()
                .map(|o| {
                    m.adaptive_retries
                        .with_label_values(&[pool, route, o.label()])
                })
                .collect(),
        }
    }

    /// The call's adaptive retry ended with `outcome`.
    pub fn adaptive_retry(&self, outcome: RetryOutcome) -> Option<&IntCounter> {
        let at = RetryOutcome::ALL.iter().position(|o| *o == outcome)?;
        self.adaptive_retries.get(at)
    }

    /// The request named no maxTokens, and `action` was taken.
    pub fn max_tokens_missing(&self, action: MissingMaxTokens) -> Option<&IntCounter> {
        let at = MissingMaxTokens::ALL.iter().position(|a| *a == action)?;
        self.max_tokens_missing.get(at)
    }
}

/// Every pool's series, by pool id.
pub fn for_policy(m: &Metrics, admission: &Admission) -> Vec<PoolSeries> {
    let backend = admission.ledger().backend();
    admission
        .pools()
        .iter()
        .map(|pool| PoolSeries::new(m, pool, backend))
        .collect()
}
