//! Admission control: from a request to a reservation, or to a rejection that says when to retry.
//!
//! For every operation that names a model, the caller's route allow-list first ([`allow`]); then,
//! for a model call: resolve the pool from the modelId; read `maxTokens` (the pool's
//! `default_max_tokens` when absent: Bedrock itself would reserve the model's maximum, so set the
//! default to what your callers really need); estimate input tokens (conservative, calibrated
//! online from reported usage); reserve `input + maxTokens` in the ledger, all limits at once.
//!
//! - A reservation larger than the pool can ever hold is a 400 `ValidationException` that says
//!   which `maxTokens` would fit: retrying would never help.
//! - A reservation that does not fit now is a 429 `ThrottlingException` with a jittered retry
//!   hint projected from the ledger ([`hint`]).
//! - An admitted request carries an [`Admitted`] guard that settles it ([`settle`] has the rules).

pub mod advice;
mod allow;
pub mod body;
mod ceiling;
pub mod estimate;
pub mod hint;
pub mod pools;
pub mod queue;
pub mod retries;
pub mod routes;
pub mod settle;
mod waiting;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use rand::{SeedableRng, rngs::SmallRng};
use serde::Serialize;

use crate::{
    bedrock::{BedrockError, ErrorCode, ModelRef, Operation},
    config::{AdmissionConfig, InputEstimate, PoolConfig, RouteConfig, UnknownModels},
    ledger::{
        Decision, Ledger, LedgerError, Limit, PoolSnapshot, Rejection, Reservation, ReserveRequest,
    },
    metrics::{Metrics, NO_POOL},
};
pub use pools::{Pool, PoolTable};
pub use routes::{Caller, Route, RouteTable};
pub use settle::{Admitted, Estimate, Rule};

pub const X_TOKENGATE_REASON: &str = "x-tokengate-reason";
pub const X_TOKENGATE_POOL: &str = "x-tokengate-pool";

/// What admission decided for a request that may go upstream.
#[derive(Debug)]
pub enum Verdict {
    /// Counted against a pool; settle through the guard. (Boxed: the guard is large and a
    /// verdict is moved around before the request is forwarded.)
    Admitted(Box<Admitted>),
    /// Forwarded without a reservation: not a quota-consuming call, or an unknown model under
    /// `unknown_models = "pass"`.
    Uncounted,
}

/// The admission controller: pools, the ledger, and the metrics they move.
#[derive(Debug)]
pub struct Admission {
    table: PoolTable,
    routes: RouteTable,
    ledger: Arc<dyn Ledger>,
    metrics: Arc<Metrics>,
    config: AdmissionConfig,
    counter: Option<Arc<dyn InputCounter>>,
}

/// Counts input tokens exactly, for pools with `input_estimate = "count_tokens"` (upstream's
/// CountTokens, which is free of charge).
#[async_trait::async_trait]
pub trait InputCounter: Send + Sync + std::fmt::Debug {
    async fn count_input_tokens(
        &self,
        model_id: &str,
        operation: Operation,
        body: &Bytes,
    ) -> Result<u64, String>;
}

impl Admission {
    /// `routes` holds at least one route (a config without `[[routes]]` has the implicit one).
    pub fn new(
        pools: &[PoolConfig],
        routes: &[RouteConfig],
        config: AdmissionConfig,
        ledger: Arc<dyn Ledger>,
        metrics: Arc<Metrics>,
    ) -> Admission {
        let table = PoolTable::new(pools, routes, &config, &metrics);
        let routes = RouteTable::new(routes);
        for pool in table.pools() {
            let name = &*pool.name;
            metrics
                .configured_tokens_per_minute
                .with_label_values(&[name])
                .set(pool.config.tokens_per_minute as f64);
            metrics
                .effective_tokens_per_minute
                .with_label_values(&[name])
                .set(pool.limits().tokens_per_minute as f64);
            metrics
                .calibration_ratio
                .with_label_values(&[name])
                .set(pool.calibration_ratio());
            metrics.reserved_tokens.with_label_values(&[name]);
            metrics.inflight_requests.with_label_values(&[name]);
            // Create every per-pool series at zero, so dashboards and alerts see them before the
            // first event (rate() over a missing series is empty, not zero).
            for counter in [
                &metrics.upstream_throttles,
                &metrics.reserved_tokens_total,
                &metrics.charged_tokens,
                &metrics.input_tokens,
                &metrics.output_tokens,
                &metrics.cache_read_tokens,
                &metrics.cache_write_tokens,
            ] {
                counter.with_label_values(&[name]);
            }
            for reason in ["tokens", "requests", "concurrency", "share", "never_fits"] {
                metrics.rejections.with_label_values(&[name, reason]);
            }
            metrics.init_pool_series(name, ledger.backend());
        }
        Admission {
            table,
            routes,
            ledger,
            metrics,
            config,
            counter: None,
        }
    }

    /// Uses `counter` for pools that ask for exact input counts.
    pub fn with_input_counter(mut self, counter: Arc<dyn InputCounter>) -> Admission {
        self.counter = Some(counter);
        self
    }

    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        self.table.pools()
    }

    pub fn routes(&self) -> &RouteTable {
        &self.routes
    }

    /// A first attempt from the first configured route (the default route of a config without
    /// `[[routes]]`): for benchmarks and tests that do not care who calls.
    pub fn first_route_caller(&self) -> Caller {
        Caller {
            route: self.routes.routes()[0].clone(),
            retry: false,
        }
    }

    /// Decides a request from `caller`. `body` is the whole request body; `model_id` the one in
    /// the path (StartAsyncInvoke names its model in the body, read here).
    ///
    /// The route's allow-list comes first, for every operation that names a model, before any
    /// pass-through; then only calls that spend quota are counted.
    pub async fn admit(
        &self,
        operation: Operation,
        model_id: Option<&str>,
        body: &Bytes,
        caller: &Caller,
    ) -> Result<Verdict, BedrockError> {
        let in_body;
        let model_id = if operation == Operation::StartAsyncInvoke {
            in_body = body::async_invoke_model_id(body).map_err(|e| {
                self.count(NO_POOL, operation, "invalid");
                BedrockError::validation(format!("StartAsyncInvoke: the request body {e}"))
            })?;
            in_body.as_deref()
        } else {
            model_id
        };
        let Some(model_id) = model_id else {
            self.count(NO_POOL, operation, "passthrough");
            return Ok(Verdict::Uncounted);
        };
        let model = ModelRef::parse(model_id);
        let resolved = self.table.resolve(&model);
        if let Some(waived) = self.check_allowed(operation, model_id, resolved, caller)? {
            return Ok(waived);
        }
        if !operation.consumes_quota() {
            self.count(NO_POOL, operation, "passthrough");
            return Ok(Verdict::Uncounted);
        }
        let Some((pool, configured)) = resolved else {
            return self.unknown_model(operation, model_id);
        };
        let pool = pool.clone();
        let route = &caller.route;
        let shadow = pool.config.shadow || route.config.shadow;
        let (mut estimate, requested) =
            self.estimate(&pool, operation, &model, body)
                .inspect_err(|_| {
                    self.count_for(&pool, route, operation, "invalid");
                })?;
        self.count_input_exactly(&pool, model_id, operation, body, &mut estimate)
            .await;
        let ceiling = ceiling::Ceiling {
            operation,
            model: &model,
            body,
            requested,
        };
        let rewritten = match self.apply_ceiling(&pool, route, &ceiling, &mut estimate) {
            Ok(rewritten) => rewritten,
            Err(error) => {
                self.count_for(&pool, route, operation, "invalid");
                return self.enforce_or_shadow(shadow, &pool, route, "max_tokens_ceiling", error);
            }
        };
        let slot = pool.advice.slot(configured);
        let mut verdict = if shadow {
            self.reserve_shadow(pool.clone(), operation, estimate, caller)
                .await?
        } else {
            self.reserve(pool.clone(), operation, estimate, caller)
                .await?
        };
        if let Verdict::Admitted(a) = &mut verdict {
            a.set_advice_slot(slot);
            a.set_route(pool.shares.metrics(&route.name).cloned());
            if let Some(body) = rewritten {
                a.set_rewritten_body(body);
            }
        }
        Ok(verdict)
    }

    /// A model in no pool: forwarded uncounted, or refused (`admission.unknown_models`).
    fn unknown_model(&self, operation: Operation, model_id: &str) -> Result<Verdict, BedrockError> {
        match self.config.unknown_models {
            UnknownModels::Pass => {
                self.count(NO_POOL, operation, "unknown_model_passed");
                Ok(Verdict::Uncounted)
            }
            UnknownModels::Reject => {
                self.count(NO_POOL, operation, "unknown_model");
                Err(BedrockError::validation(format!(
                    "tokengate has no quota pool for model {model_id:?}: add it to the models list of a [[pools]] entry, \
                     or set [admission] unknown_models = \"pass\" to forward unknown models uncounted"
                )))
            }
        }
    }

    /// For a pool with `input_estimate = "count_tokens"`, upstream's exact input count replaces
    /// the estimate (which stays if CountTokens fails).
    async fn count_input_exactly(
        &self,
        pool: &Pool,
        model_id: &str,
        operation: Operation,
        body: &Bytes,
        estimate: &mut Estimate,
    ) {
        let (InputEstimate::CountTokens, Some(counter)) =
            (pool.config.input_estimate, &self.counter)
        else {
            return;
        };
        match counter.count_input_tokens(model_id, operation, body).await {
            Ok(n) => estimate.input = n.max(1),
            Err(e) => {
                self.metrics
                    .upstream_errors
                    .with_label_values(&[&pool.name, "count_tokens"])
                    .inc();
                tracing::warn!(pool = %pool.name, error = %e, "CountTokens failed; using the calibrated estimate");
            }
        }
    }

    /// An error for a rule the request broke: returned, or in shadow mode counted and waived.
    fn enforce_or_shadow(
        &self,
        shadow: bool,
        pool: &Pool,
        route: &Route,
        reason: &str,
        error: BedrockError,
    ) -> Result<Verdict, BedrockError> {
        if !shadow {
            return Err(error);
        }
        self.count_shadow(pool, route, reason);
        Ok(Verdict::Uncounted)
    }

    fn count_shadow(&self, pool: &Pool, route: &Route, reason: &str) {
        self.metrics
            .shadow_rejections
            .with_label_values(&[&pool.name, &route.name, reason])
            .inc();
        self.count_route(pool, route, "shadow_rejected");
    }

    /// Counts an outcome in the pool's and the route's series.
    fn count_for(&self, pool: &Pool, route: &Route, operation: Operation, outcome: &str) {
        self.count(&pool.name, operation, outcome);
        self.count_route(pool, route, outcome);
    }

    fn count_route(&self, pool: &Pool, route: &Route, outcome: &str) {
        self.metrics
            .route_requests
            .with_label_values(&[&pool.name, &route.name, outcome])
            .inc();
    }

    /// Shadow mode: decide at once (no queueing) and take the reservation when it fits, so the
    /// ledger sees the real load; when it does not, count what enforcement would have done and
    /// forward uncounted.
    async fn reserve_shadow(
        &self,
        pool: Arc<Pool>,
        operation: Operation,
        estimate: Estimate,
        caller: &Caller,
    ) -> Result<Verdict, BedrockError> {
        let route = &caller.route;
        if !pool.config.can_ever_hold(estimate.reservation()) {
            self.count_shadow(&pool, route, "never_fits");
            return Ok(Verdict::Uncounted);
        }
        match self
            .try_reserve(&pool, estimate.reservation(), caller)
            .await
        {
            Ok(Decision::Admitted(reservation)) => {
                Ok(self.admitted(pool, reservation, operation, estimate))
            }
            Ok(Decision::Rejected(rejection)) => {
                self.count_shadow(&pool, route, rejection.limit.label());
                Ok(Verdict::Uncounted)
            }
            Err(e) => {
                tracing::warn!(pool = %pool.name, error = %e, "ledger unavailable in shadow mode; forwarding");
                self.count_shadow(&pool, route, "ledger_error");
                Ok(Verdict::Uncounted)
            }
        }
    }

    /// The reservation's parts, and the `maxTokens` the body itself asks for.
    fn estimate(
        &self,
        pool: &Pool,
        operation: Operation,
        model: &ModelRef,
        body: &Bytes,
    ) -> Result<(Estimate, Option<u64>), BedrockError> {
        let facts = body::read(operation, model.provider(), body).map_err(|e| match e {
            body::BodyError::NotJson(e) => BedrockError::validation(format!(
                "the request body is not valid JSON ({e}); {} needs a JSON body",
                operation.name()
            )),
            body::BodyError::NotObject => BedrockError::validation(format!(
                "the request body must be a JSON object for {}",
                operation.name()
            )),
            body::BodyError::MaxTokens(e) => BedrockError::validation(e.to_string()),
        })?;
        let max_tokens = facts.max_tokens.unwrap_or(pool.config.default_max_tokens);
        let raw_input = facts.input_tokens;
        let estimate = Estimate {
            raw_input,
            input: pool.calibrated_input(raw_input),
            max_tokens,
        };
        Ok((estimate, facts.max_tokens))
    }

    async fn reserve(
        &self,
        pool: Arc<Pool>,
        operation: Operation,
        estimate: Estimate,
        caller: &Caller,
    ) -> Result<Verdict, BedrockError> {
        let tokens = estimate.reservation();
        self.check_can_ever_fit(&pool, operation, &estimate)?;
        // While requests wait in this pool, newcomers queue behind them instead of taking the
        // capacity freed for them.
        let queue_busy = pool.queue.enabled() && pool.queue.depth().0 > 0;
        let rejection = if queue_busy {
            None
        } else {
            match self.try_reserve(&pool, tokens, caller).await {
                Ok(Decision::Admitted(reservation)) => {
                    return Ok(self.admitted(pool, reservation, operation, estimate));
                }
                Ok(Decision::Rejected(rejection)) => Some(rejection),
                Err(e) => return Err(self.ledger_unavailable(&pool, operation, &e)),
            }
        };
        let outcome = match (&rejection, pool.queue.enabled()) {
            (Some(rejection), false) => Err(self.rejection(&pool, rejection, tokens)),
            _ => {
                self.wait_in_queue(&pool, tokens, rejection.as_ref(), caller)
                    .await
            }
        };
        match outcome {
            Ok(reservation) => {
                let mut verdict = self.admitted(pool, reservation, operation, estimate);
                if let Verdict::Admitted(a) = &mut verdict {
                    a.set_queued();
                }
                Ok(verdict)
            }
            Err(e) => {
                self.count(&pool.name, operation, "rejected");
                if let Some(m) = pool.shares.metrics(&caller.route.name) {
                    m.rejected.inc();
                }
                Err(e)
            }
        }
    }

    /// A reservation above the pool's whole bucket would be refused forever: say so, and what fits.
    fn check_can_ever_fit(
        &self,
        pool: &Pool,
        operation: Operation,
        estimate: &Estimate,
    ) -> Result<(), BedrockError> {
        let name = &*pool.name;
        let tokens = estimate.reservation();
        if pool.config.can_ever_hold(tokens) {
            return Ok(());
        }
        let capacity = pool.config.usable_tokens_per_minute();
        self.count(name, operation, "invalid");
        self.metrics
            .rejections
            .with_label_values(&[name, "never_fits"])
            .inc();
        pool.counters
            .never_fits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let fits = capacity.saturating_sub(estimate.input);
        Err(BedrockError::validation(format!(
            "this request reserves {tokens} tokens (about {} input + {} maxTokens) but pool {name:?} holds at most {capacity} \
             tokens per minute, so it can never be admitted; set maxTokens to at most {fits}, or shorten the input",
            estimate.input, estimate.max_tokens
        ))
        .with_header(http::HeaderName::from_static(X_TOKENGATE_POOL), name))
    }

    /// One ledger decision with the pool's current limits.
    pub(crate) async fn try_reserve(
        &self,
        pool: &Pool,
        tokens: u64,
        caller: &Caller,
    ) -> Result<Decision, LedgerError> {
        let limits = pool.limits();
        pool.metrics
            .effective_tokens_per_minute
            .set(limits.tokens_per_minute as f64);
        let started = std::time::Instant::now();
        let decision = self
            .ledger
            .reserve(&ReserveRequest {
                pool: &pool.name,
                limits,
                tokens,
                share: pool.shares.request(&caller.route.name, caller.is_retry()),
                hold_back: pool.pending_excess(),
            })
            .await;
        self.metrics
            .ledger_seconds
            .observe(started.elapsed().as_secs_f64());
        decision
    }

    fn admitted(
        &self,
        pool: Arc<Pool>,
        reservation: Reservation,
        operation: Operation,
        estimate: Estimate,
    ) -> Verdict {
        pool.counters
            .admitted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        pool.metrics.operation(operation).admitted.inc();
        Verdict::Admitted(Box::new(Admitted::new(
            pool,
            self.ledger.clone(),
            self.metrics.clone(),
            reservation,
            operation,
            estimate,
        )))
    }

    fn ledger_unavailable(
        &self,
        pool: &Pool,
        operation: Operation,
        e: &LedgerError,
    ) -> BedrockError {
        self.metrics
            .ledger_errors
            .with_label_values(&[self.ledger.backend()])
            .inc();
        self.count(&pool.name, operation, "ledger_error");
        tracing::error!(error = %e, pool = %pool.name, "ledger unavailable");
        self.retryable(
            ErrorCode::ServiceUnavailable,
            pool,
            Duration::from_secs(1),
            "the quota ledger is unavailable; retry shortly".into(),
        )
    }

    /// The 429 for a request that does not fit now.
    fn rejection(&self, pool: &Pool, rejection: &Rejection, tokens: u64) -> BedrockError {
        let name = &*pool.name;
        pool.counters.rejected(rejection.limit);
        self.metrics
            .rejections
            .with_label_values(&[name, rejection.limit.label()])
            .inc();
        let (typical_duration, charge_ratio) = pool.typical();
        let history = hint::PoolHistory {
            typical_duration,
            charge_ratio,
        };
        let wait = hint::projected_wait(rejection, history, self.config.max_retry_hint);
        let message = match rejection.limit {
            Limit::Tokens => format!(
                "Too many tokens: this request reserves {tokens} tokens and pool {name:?} has {} available now; retry after the hinted delay",
                tokens.saturating_sub(rejection.token_deficit)
            ),
            Limit::Requests => format!(
                "Too many requests: pool {name:?} is at its requests-per-minute limit; retry after the hinted delay"
            ),
            Limit::Concurrency => format!(
                "Too many concurrent requests: pool {name:?} has all {} slots in use; retry after the hinted delay",
                rejection.in_flight_requests
            ),
            Limit::Share => format!(
                "Too many tokens for this route: it has used its max_share of pool {name:?}; retry after the hinted delay"
            ),
        };
        self.retryable(ErrorCode::Throttling, pool, wait, message)
            .with_header(
                http::HeaderName::from_static(X_TOKENGATE_REASON),
                rejection.limit.label(),
            )
    }

    /// A retryable error with jittered `x-amz-retry-after` / `Retry-After` around `wait`.
    pub fn retryable(
        &self,
        code: ErrorCode,
        pool: &Pool,
        wait: Duration,
        message: String,
    ) -> BedrockError {
        let mut rng = SmallRng::from_rng(&mut rand::rng());
        let hint = hint::jittered(wait, self.config.max_retry_hint, &mut rng);
        self.metrics
            .retry_hint_seconds
            .with_label_values(&[&pool.name])
            .observe(hint.as_secs_f64());
        let (ms, secs) = hint::header_values(hint);
        BedrockError::new(code, message)
            .with_header(http::HeaderName::from_static("x-amz-retry-after"), ms)
            .with_header(http::header::RETRY_AFTER, secs)
            .with_header(http::HeaderName::from_static(X_TOKENGATE_POOL), &*pool.name)
    }

    /// Upstream throttled a request this proxy admitted: shrink the pool's limit and count it.
    pub fn upstream_throttled(&self, pool: &Pool) {
        pool.upstream_throttled();
        self.metrics
            .upstream_throttles
            .with_label_values(&[&pool.name])
            .inc();
        self.metrics
            .effective_tokens_per_minute
            .with_label_values(&[&pool.name])
            .set(pool.limits().tokens_per_minute as f64);
    }

    fn count(&self, pool: &str, operation: Operation, outcome: &str) {
        self.metrics
            .requests
            .with_label_values(&[pool, operation.name(), outcome])
            .inc();
    }

    /// Live state of every pool, for `GET /v1/pools`.
    pub async fn pool_states(&self) -> Vec<PoolState> {
        let mut out = Vec::with_capacity(self.pools().len());
        for pool in self.pools() {
            let limits = pool.limits();
            let ledger = self.ledger.snapshot(&pool.name, &limits).await.ok();
            if let Some(s) = &ledger {
                self.metrics
                    .tokens_available
                    .with_label_values(&[&pool.name])
                    .set(s.tokens_available as f64);
            }
            let c = &pool.counters;
            let load =
                |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            out.push(PoolState {
                name: pool.name.to_string(),
                models: pool.config.models.clone(),
                region: pool.config.region.clone(),
                tokens_per_minute: pool.config.tokens_per_minute,
                usable_tokens_per_minute: pool.config.usable_tokens_per_minute(),
                effective_tokens_per_minute: limits.tokens_per_minute,
                requests_per_minute: limits.requests_per_minute,
                max_concurrency: limits.max_concurrency,
                output_burndown: pool.config.output_burndown,
                default_max_tokens: pool.config.default_max_tokens,
                ledger,
                admitted: load(&c.admitted),
                rejected: RejectedCounts {
                    tokens: load(&c.rejected_tokens),
                    requests: load(&c.rejected_requests),
                    concurrency: load(&c.rejected_concurrency),
                    never_fits: load(&c.never_fits),
                },
                upstream_throttles: load(&c.upstream_throttles),
                pending_burndown_excess: pool.pending_excess(),
                learned: pool.learned_view(),
                queue: pool.queue.view(),
                max_tokens_advice: advice::publish(pool, &self.metrics),
                routes: pool.shares.views(),
            });
        }
        out
    }
}

/// One pool in `GET /v1/pools`.
#[derive(Debug, Clone, Serialize)]
pub struct PoolState {
    pub name: String,
    pub models: Vec<String>,
    pub region: String,
    pub tokens_per_minute: u64,
    pub usable_tokens_per_minute: u64,
    pub effective_tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: u32,
    pub output_burndown: u32,
    pub default_max_tokens: u64,
    /// `null` when the ledger could not be read.
    pub ledger: Option<PoolSnapshot>,
    pub admitted: u64,
    pub rejected: RejectedCounts,
    pub upstream_throttles: u64,
    /// What streams in flight will be charged beyond their reservations, from the output seen
    /// so far (burndown); kept free in the bucket until they settle.
    pub pending_burndown_excess: u64,
    pub learned: pools::LearnedView,
    pub queue: queue::QueueView,
    /// Output lengths against the maxTokens reserved, per model seen ([`advice`]).
    pub max_tokens_advice: Vec<advice::MaxTokensAdvice>,
    /// Each route's share of this pool and what it used.
    pub routes: Vec<routes::RouteView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RejectedCounts {
    pub tokens: u64,
    pub requests: u64,
    pub concurrency: u64,
    pub never_fits: u64,
}
