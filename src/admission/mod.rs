//! Admission control: from a request's facts to a [`Decision`].
//!
//! For every operation that names a model (in its path, or in its body for StartAsyncInvoke and
//! the OpenAI and Anthropic APIs): the caller's route may call it ([`allow`]), before anything is
//! passed through. Then, for a model call: resolve the pool from the modelId; read `maxTokens`
//! and estimate input tokens (conservative, calibrated online from reported usage), in one pass
//! over the body ([`body`]); apply the route's `max_tokens_ceiling`, or, for a request that names
//! no `maxTokens`, the pool's `when_max_tokens_missing` ([`output_cap`]); write what the
//! forwarded body must say ([`rewrite`]); take the budgets the request draws on besides its pool
//! ([`budgets`]); reserve `input + maxTokens` in the ledger, every limit at once, waiting in the
//! pool's queue when the wait is worth it ([`queue`]). Each pool counts what it admitted and
//! throttled by API family. An InvokeModelWithBidirectionalStream session, decided from its head
//! before any event arrives, reserves the pool's `bidirectional_reservation`.
//! A sagemaker-runtime call is decided the same way in its endpoint pool, whose limits follow the
//! endpoint's copies ([`endpoint`]).
//!
//! [`Admission::decide`] returns pure data ([`decision`]): an admitted request carries a [`Hold`]
//! that settles it ([`hold`] has the rules); a refusal says why and, when retrying can help, when
//! to come back ([`hint`]). Nothing here speaks HTTP, writes a metric or a log line: the pipeline
//! answers ([`crate::answer`]) and records ([`crate::observe`]) what was decided.
//! (Over 500 lines: the decision's steps and `GET /v1/pools`' pool view share these types.)

pub mod adaptive;
pub mod advice;
mod allow;
pub mod body;
pub mod budgets;
pub mod candidates;
mod ceiling;
pub mod decision;
pub mod endpoint;
pub mod estimate;
pub mod hint;
pub mod hold;
pub mod output_cap;
pub mod pools;
pub mod queue;
mod reserve;
pub mod retries;
mod rewrite;
pub mod routes;
pub mod spill;
mod waiting;

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::{
    bedrock::tier::ServiceTier,
    bedrock::{Api, ModelRef, Operation},
    config::{AdmissionConfig, InputEstimate, PoolConfig, RouteConfig, UnknownModels},
    ledger::{Ledger, PoolSnapshot},
    sagemaker::EndpointTarget,
};
pub use decision::{
    Admitted, BudgetScope, Decision, Invalid, NeverFits, NotAllowed, Pass, Problem, QueueRefusal,
    ShadowReason, Throttle, ThrottleWhy, Unavailability, Unavailable,
};
pub use hold::{Estimate, Hold, Settled, SettlementRule};
pub use output_cap::MissingMaxTokens;
pub use pools::{Pool, PoolTable};
pub use routes::{Caller, Route, RouteTable};

/// What admission decides a request on.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    pub operation: Operation,
    /// The modelId of the path, decoded; `None` for operations that name none there.
    pub model_id: Option<&'a str>,
    /// The whole request body.
    pub body: &'a Bytes,
    /// The body as [`body::read`] read it, when the pipeline read it first (the OpenAI and
    /// Anthropic APIs, whose model it names); `None`: read here, when needed.
    pub read: Option<&'a BodyRead>,
    pub caller: &'a Caller,
    /// The `X-Amzn-Bedrock-Service-Tier` header (InvokeModel's tier), if sent.
    pub service_tier: Option<&'a str>,
    /// A sagemaker-runtime call's endpoint and inference component (its `model_id` is `None`).
    pub endpoint: Option<&'a EndpointTarget>,
}

/// A body read in one pass ([`body::read`]), or why it could not be.
pub type BodyRead = Result<body::BodyFacts, body::BodyError>;

/// Reads a request body for admission, in its one pass: for the OpenAI and Anthropic APIs, the
/// model they name with the rest ([`Facts::read`]).
pub fn read_body(operation: Operation, body: &[u8]) -> BodyRead {
    body::read(operation, None, body)
}

/// The admission controller: pools, routes and the ledger they reserve in.
#[derive(Debug)]
pub struct Admission {
    table: PoolTable,
    routes: RouteTable,
    ledger: Arc<dyn Ledger>,
    config: AdmissionConfig,
    counter: Option<Arc<dyn InputCounter>>,
    /// `config.account_tokens_per_day`, as a budget.
    account_budget: Option<Arc<budgets::Budget>>,
}

/// Counts input tokens exactly, for pools with `input_estimate = "count_tokens"` (upstream's
/// CountTokens, which is free of charge).
#[async_trait::async_trait]
pub trait InputCounter: Send + Sync + std::fmt::Debug {
    async fn count_input_tokens(
        &self,
        region: &str,
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
    ) -> Admission {
        Admission {
            table: PoolTable::new(pools, routes, &config),
            routes: RouteTable::new(routes, pools),
            ledger,
            account_budget: config
                .account_tokens_per_day
                .map(|d| Arc::new(budgets::Budget::account(d))),
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

    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// A first attempt from the first configured route (the default route of a config without
    /// `[[routes]]`): for benchmarks and tests that do not care who calls.
    pub fn first_route_caller(&self) -> Caller {
        Caller {
            route: self.routes.routes()[0].clone(),
            retry: false,
        }
    }

    /// Decides a request: admitted (holding a reservation), passed, or refused with the reason.
    pub async fn decide(&self, facts: &Facts<'_>) -> Decision {
        self.decide_capping(facts, adaptive::Capping::Write).await
    }

    /// Decides the adaptive retry of a call its route's learned cap truncated: as any call, with
    /// the caller's own `maxTokens` (no learned cap), its output learned.
    pub async fn decide_adaptive_retry(&self, facts: &Facts<'_>) -> Decision {
        self.decide_capping(facts, adaptive::Capping::Uncapped)
            .await
    }

    /// [`Self::decide`], with the route's learned cap applied as `capping` says (observed only
    /// in shadow mode).
    async fn decide_capping(&self, facts: &Facts<'_>, capping: adaptive::Capping) -> Decision {
        if let Some(target) = facts.endpoint {
            return self.decide_endpoint(facts, target).await;
        }
        let read_here;
        let read = match facts.read {
            Some(read) => Some(read),
            None if facts.operation.model_in_body() => {
                read_here = read_body(facts.operation, facts.body);
                Some(&read_here)
            }
            None => None,
        };
        let in_body = match model_in_body(facts, read) {
            Ok(model) => model,
            Err(invalid) => return Decision::Invalid(invalid),
        };
        let Some(model_id) = in_body.as_deref().or(facts.model_id) else {
            return Decision::Pass(Pass::NotMetered);
        };
        let model = ModelRef::parse(model_id);
        let resolved = self.table.resolve(&model);
        let route = &facts.caller.route;
        if let Some(refusal) = allow::check(route, model_id, resolved) {
            return refusal;
        }
        if !facts.operation.consumes_quota() {
            return Decision::Pass(Pass::NotMetered);
        }
        let Some((pool, configured)) = resolved else {
            return self.unknown_model(model_id);
        };
        let shadow = pool.config.shadow || route.config.shadow;
        let capping = match capping {
            adaptive::Capping::Write if shadow => adaptive::Capping::Observe,
            capping => capping,
        };
        // Shadow mode forwards what enforcement would refuse, and says why.
        let refuse = |decision: Decision, reason: ShadowReason| {
            if shadow {
                Decision::Pass(Pass::Shadow {
                    pool: Some(pool.clone()),
                    reason,
                })
            } else {
                decision
            }
        };
        let invalid = |problem| {
            Decision::Invalid(Invalid {
                pool: Some(pool.clone()),
                problem,
            })
        };
        let estimated = match self.estimate(pool, facts, &model, read).await {
            Ok(estimated) => estimated,
            Err(problem) => return invalid(problem),
        };
        let ahead = match self.reserved_ahead(estimated.tier, facts, configured) {
            Ok(ahead) => ahead,
            Err(problem) => return invalid(problem),
        };
        let learned = (&model, configured, capping);
        let prepared = match prepare(route, &pool.config, facts, learned, estimated) {
            Ok(prepared) => prepared,
            Err(problem @ (Problem::AboveCeiling { .. } | Problem::CannotClamp { .. })) => {
                return refuse(invalid(problem), ShadowReason::MaxTokensCeiling);
            }
            Err(problem) => return invalid(problem),
        };
        let ahead = ahead.and_then(|id| self.pools().get(id));
        self.take(pool, prepared, facts, (shadow, ahead)).await
    }

    /// A model in no pool: passed uncounted, or refused, as `unknown_models` says.
    fn unknown_model(&self, model_id: &str) -> Decision {
        match self.config.unknown_models {
            UnknownModels::Pass => Decision::Pass(Pass::UnknownModel),
            UnknownModels::Reject => Decision::UnknownModel {
                model: model_id.to_string(),
            },
        }
    }

    /// The pool to try before the on-demand one: reserved capacity for a `reserved` call (its
    /// tier from the body, else the header), which overflows to on-demand; or the refusal of a
    /// tier the route's `allowed_tiers` leaves out (a call naming none is `default`).
    fn reserved_ahead(
        &self,
        body_tier: Option<ServiceTier>,
        facts: &Facts<'_>,
        configured: &str,
    ) -> Result<Option<usize>, Problem> {
        let route = &facts.caller.route;
        // A route that forces a tier runs every call in it (written into the request on its
        // way out: [`prepare`]); config checked it is among the route's allowed tiers.
        let tier = route
            .config
            .service_tier
            .or(body_tier)
            .or_else(|| facts.service_tier.and_then(ServiceTier::parse));
        if let Some(allowed) = &route.config.allowed_tiers {
            let asked = tier.unwrap_or(ServiceTier::Default);
            if !allowed.contains(&asked) {
                return Err(Problem::TierNotAllowed {
                    route: route.name.to_string(),
                    tier: asked.label(),
                    allowed: allowed
                        .iter()
                        .map(|t| t.label())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        Ok(match tier {
            Some(ServiceTier::Reserved) => self.table.reserved_for(configured).map(|p| p.id),
            _ => None,
        })
    }

    /// The reservation's estimate: `maxTokens` from the body (or the model's maximum) and the
    /// calibrated input, counted exactly when the pool asks for it. A failed count falls back
    /// to the estimate, and says so.
    async fn estimate(
        &self,
        pool: &Pool,
        facts: &Facts<'_>,
        model: &ModelRef<'_>,
        read: Option<&BodyRead>,
    ) -> Result<Estimated, Problem> {
        let operation = facts.operation;
        if operation == Operation::InvokeModelWithBidirectionalStream {
            // Its events have not arrived yet (they stream for up to 8 minutes): the session
            // reserves what its pool says one holds, and settles to its usage at the end.
            let estimate = Estimate {
                raw_input: 0,
                input: 0,
                max_tokens: pool.config.bidirectional_reservation,
                max_tokens_missing: None,
            };
            return Ok(Estimated {
                estimate,
                requested: None,
                api: None,
                count_failed: None,
                tier: None,
            });
        }
        let read_here;
        let read = match read {
            Some(read) => read,
            None => {
                read_here = body::read(operation, model.provider(), facts.body);
                &read_here
            }
        };
        let read = read.as_ref().map_err(|e| problem(operation, e))?;
        let mut estimate = Estimate {
            raw_input: read.input_tokens,
            input: pool.calibrated_input(read.input_tokens),
            max_tokens: read.max_tokens.unwrap_or(pool.config.max_output_tokens),
            max_tokens_missing: None,
        };
        let mut count_failed = None;
        // CountTokens takes Converse and InvokeModel bodies only.
        if let (InputEstimate::CountTokens, Some(counter), Some(model_id), false) = (
            pool.config.input_estimate,
            &self.counter,
            facts.model_id,
            operation.model_in_body(),
        ) {
            match counter
                .count_input_tokens(&pool.config.region, model_id, operation, facts.body)
                .await
            {
                Ok(n) => estimate.input = n.max(1),
                Err(e) => count_failed = Some(e),
            }
        }
        Ok(Estimated {
            estimate,
            requested: read.max_tokens,
            api: read.api.clone(),
            count_failed,
            tier: read.service_tier.as_deref().and_then(ServiceTier::parse),
        })
    }

    /// The Region a decided request goes to: its pool's (the pool it was admitted in, for an
    /// admitted request), else the pool of `model_id`, else the Region an ARN `model_id` names;
    /// `None` for any other model in no pool (it goes to `upstream.region`).
    pub fn region_of(&self, decision: &Decision, model_id: Option<&str>) -> Option<String> {
        if let Some(pool) = decision.pool() {
            return Some(pool.config.region.clone());
        }
        let model = ModelRef::parse(model_id?);
        match self.table.resolve(&model) {
            Some((pool, _)) => Some(pool.config.region.clone()),
            // A model no pool meters, named by an ARN: the ARN's Region.
            None => model.arn_region.map(str::to_string),
        }
    }

    /// Live state of every pool, for `GET /v1/pools`.
    pub async fn pool_views(&self) -> Vec<PoolView> {
        let mut out = Vec::with_capacity(self.pools().len());
        for pool in self.pools() {
            let limits = pool.limits();
            let ledger = self.ledger.snapshot(&pool.name, &limits).await.ok();
            let c = &pool.counts;
            let load =
                |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            out.push(PoolView {
                name: pool.name.to_string(),
                models: pool.config.models.clone(),
                region: pool.config.region.clone(),
                spill_chain: self
                    .table
                    .chain(pool.id)
                    .iter()
                    .filter_map(|&i| self.pools().get(i))
                    .map(|p| p.name.to_string())
                    .collect(),
                spill_cached: pool.config.spill_cached,
                tokens_per_minute: pool.config.tokens_per_minute,
                usable_tokens_per_minute: pool.capacity(),
                effective_tokens_per_minute: limits.tokens_per_minute,
                requests_per_minute: limits.requests_per_minute,
                tokens_per_day: limits.tokens_per_day,
                max_concurrency: limits.max_concurrency,
                output_burndown: pool.config.output_burndown,
                max_output_tokens: pool.config.max_output_tokens,
                when_max_tokens_missing: pool.config.when_max_tokens_missing.label(),
                default_max_tokens: pool.config.default_max_tokens,
                ledger,
                admitted: load(&c.admitted),
                rejected: RejectedCounts {
                    tokens: load(&c.rejected_tokens),
                    requests: load(&c.rejected_requests),
                    concurrency: load(&c.rejected_concurrency),
                    daily_quota: load(&c.rejected_daily),
                    never_fits: load(&c.never_fits),
                },
                upstream_throttles: load(&c.upstream_throttles),
                apis: Api::ALL
                    .iter()
                    .zip(&c.apis)
                    .map(|(api, counts)| {
                        let counts = ApiCountsView {
                            admitted: load(&counts.admitted),
                            rejected: load(&counts.rejected),
                        };
                        (api.label(), counts)
                    })
                    .collect(),
                pending_burndown_excess: pool.pending_excess(),
                learned: pool.learned_view(),
                queue: pool.queue.view(),
                max_tokens_advice: pool.advice.view(),
                adaptive_max_tokens: adaptive::views(self.routes.routes(), &pool.config.models),
                routes: pool.shares.views(),
                endpoint: pool.endpoint_view(),
            });
        }
        out
    }

    /// Takes over what `previous` (the policy before a reload) learned: each pool's history
    /// ([`Pool::inherit`]) and each route's adaptive maxTokens, by name.
    pub fn inherit(&self, previous: &Admission) {
        for pool in self.pools() {
            if let Some(old) = previous.pools().iter().find(|p| p.name == pool.name) {
                pool.inherit(old);
            }
        }
        for route in self.routes.routes() {
            let old = previous.routes.get(&route.name);
            if let (Some(new), Some(old)) = (&route.adaptive, old.and_then(|r| r.adaptive.as_ref()))
            {
                new.inherit(old);
            }
        }
    }

    /// Answers every queued request at once (shutdown).
    pub fn close_queues(&self) {
        for pool in self.pools() {
            pool.queue.close();
        }
    }
}

/// The model StartAsyncInvoke and the OpenAI and Anthropic APIs name in their body (other
/// operations name theirs in the path).
fn model_in_body(facts: &Facts<'_>, read: Option<&BodyRead>) -> Result<Option<String>, Invalid> {
    let invalid = |problem| Invalid {
        pool: None,
        problem,
    };
    match read {
        Some(Ok(read)) => return Ok(read.api.as_ref().map(|api| api.model.clone())),
        Some(Err(e)) => return Err(invalid(problem(facts.operation, e))),
        None => {}
    }
    if facts.operation != Operation::StartAsyncInvoke {
        return Ok(None);
    }
    body::async_invoke_model_id(facts.body).map_err(|e| invalid(problem(facts.operation, &e)))
}

/// What is wrong with a body admission could not read.
fn problem(operation: Operation, e: &body::BodyError) -> Problem {
    match e {
        body::BodyError::NotJson(e) => Problem::NotJson {
            operation: operation.name(),
            error: e.to_string(),
        },
        body::BodyError::NotObject => Problem::NotObject {
            operation: operation.name(),
        },
        body::BodyError::MaxTokens(e) => Problem::MaxTokens(e.clone()),
        body::BodyError::Field { field, problem } => Problem::Field { field, problem },
    }
}

/// The route's ceiling and its learned cap applied ([`adaptive`]), and the body to forward:
/// rewritten for either, or to ask for a streamed Chat Completions usage the caller did not ask
/// for ([`rewrite`]).
fn prepare<'p>(
    route: &Route,
    pool: &PoolConfig,
    facts: &Facts<'_>,
    (model, configured_model, capping): (&ModelRef<'_>, &'p str, adaptive::Capping),
    estimated: Estimated,
) -> Result<reserve::Prepared<'p>, Problem> {
    let Estimated {
        mut estimate,
        requested,
        api,
        count_failed,
        ..
    } = estimated;
    let asked = output_cap::Asked {
        operation: facts.operation,
        model,
        body: facts.body,
        max_tokens: requested,
    };
    let cap = output_cap::apply(route, pool, &asked, &mut estimate)?;
    let learned = (model, configured_model, pool.max_output_tokens);
    let adaptive = adaptive::apply(
        route,
        facts.operation,
        learned,
        (requested, capping),
        &mut estimate,
    );
    let ask_usage = facts.operation == Operation::OpenAIChatCompletions
        && api.is_some_and(|api| api.stream && api.include_usage != Some(true));
    // A route's forced tier: Converse and the OpenAI and Anthropic APIs name it in the body,
    // InvokeModel in a header.
    let forced_tier = route.config.service_tier;
    let tier_in_body = body::tier_member(facts.operation).is_some();
    let tier_in_header = matches!(
        facts.operation,
        Operation::InvokeModel | Operation::InvokeModelWithResponseStream
    );
    let edits = rewrite::Edits {
        // The learned cap is below the ceiling or injected default when there is one.
        ceiling: adaptive
            .as_ref()
            .and_then(adaptive::Ticket::written_cap)
            .or(cap.write),
        ask_usage,
        tier: forced_tier.filter(|_| tier_in_body),
    };
    let body = rewrite::apply(facts.operation, model, facts.body, edits)?;
    Ok(reserve::Prepared {
        estimate,
        configured_model,
        body,
        clamped: cap.clamped,
        strip_usage_chunk: ask_usage,
        service_tier_header: forced_tier.filter(|_| tier_in_header),
        count_tokens_failed: count_failed,
        adaptive,
    })
}

/// What [`Admission::estimate`] found.
struct Estimated {
    estimate: Estimate,
    /// The `maxTokens` the body itself asks for, `None` if it does not say.
    requested: Option<u64>,
    /// An OpenAI or Anthropic API body's model and streaming.
    api: Option<body::ApiBody>,
    /// Exact counting failed, and why.
    count_failed: Option<String>,
    /// The service tier the body names (Converse's `serviceTier.type`).
    tier: Option<ServiceTier>,
}

/// One pool in `GET /v1/pools`.
#[derive(Debug, Clone, Serialize)]
pub struct PoolView {
    pub name: String,
    pub models: Vec<String>,
    pub region: String,
    /// Where a request of this pool runs when the pool cannot admit it now, in the order tried
    /// (its `spill_to`, then theirs: [`crate::config::spill`]), for routes with `spill = true`.
    pub spill_chain: Vec<String>,
    /// Whether a request with a prompt-cache point may spill.
    pub spill_cached: bool,
    pub tokens_per_minute: u64,
    pub usable_tokens_per_minute: u64,
    pub effective_tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    /// The daily quota; what is left of it and when it is full again are in `ledger`
    /// (`day_tokens_available`, `day_full_in_ms`).
    pub tokens_per_day: Option<u64>,
    pub max_concurrency: u32,
    pub output_burndown: u32,
    /// The model's maximum output in force (the catalogue's or the pool's).
    pub max_output_tokens: u64,
    pub when_max_tokens_missing: &'static str,
    /// What `inject` writes.
    pub default_max_tokens: u64,
    /// `null` when the ledger could not be read.
    pub ledger: Option<PoolSnapshot>,
    pub admitted: u64,
    pub rejected: RejectedCounts,
    pub upstream_throttles: u64,
    /// Admitted and throttled requests by API family (`bedrock`, `openai_chat`,
    /// `openai_responses`, `anthropic_messages`; `sagemaker` in an endpoint pool): every API
    /// draws on the same pool.
    pub apis: std::collections::BTreeMap<&'static str, ApiCountsView>,
    /// What streams in flight will be charged beyond their reservations, from the output seen
    /// so far (burndown); kept free in the bucket until they settle.
    pub pending_burndown_excess: u64,
    pub learned: pools::LearnedView,
    pub queue: queue::QueueView,
    /// Output lengths against the maxTokens reserved, per model seen ([`advice`]).
    pub max_tokens_advice: Vec<advice::MaxTokensAdvice>,
    /// What each route with `adaptive_max_tokens` learned for this pool's models: samples, the
    /// cap in force, capped calls, proxy-caused truncations and raises ([`adaptive`]).
    pub adaptive_max_tokens: Vec<adaptive::LearnerView>,
    /// Each route's share of this pool and what it used, in slot order.
    pub routes: Vec<routes::RouteView>,
    /// An endpoint pool's copies and scaling signal; absent for a Bedrock pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<endpoint::EndpointView>,
}

/// One API family's requests in a pool, in `GET /v1/pools`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ApiCountsView {
    pub admitted: u64,
    /// Turned away with a 429 (it did not fit now).
    pub rejected: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RejectedCounts {
    pub tokens: u64,
    pub requests: u64,
    pub concurrency: u64,
    pub daily_quota: u64,
    pub never_fits: u64,
}
