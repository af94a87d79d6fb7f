//! Endpoint pools: a SageMaker endpoint (or one inference component on it) admitted by
//! concurrency per model copy, with an optional token envelope.
//!
//! An endpoint pool is a [`Pool`] like any other (the same ledger, queue, priorities, routes and
//! hints); what differs is where its limits come from and how a call finds it:
//!
//! - **Limits follow the copies.** The pool holds the copies serving now ([`EndpointCopies`]):
//!   from the config, then from the control plane when a refresher sets them
//!   ([`Pool::set_copies`]). Its concurrency is `copies x max_concurrency_per_copy`, its token
//!   bucket `copies x tokens_per_second_per_copy x 60` a minute, or one that never binds. Limits
//!   travel with each ledger call, so new copies change the next decision; more copies wake the
//!   queue. Upstream throttles shrink both (the pool's limit factor), as for Bedrock pools.
//! - **Found by endpoint and inference component** ([`super::PoolTable::resolve_endpoint`]),
//!   never by model id.
//! - **Reserve and charge generated tokens.** With an envelope a call reserves the output cap it
//!   asks for (`max_tokens`, `parameters.max_new_tokens`, else `default_max_tokens`) and is
//!   charged the tokens it generated; input is not counted. Without one it reserves nothing but
//!   its concurrency permit.
//! - **The scaling signal** is [`Pool::demand_per_copy`]: requests in flight plus waiting in the
//!   queue, per copy serving. The queue holds back what SageMaker would see, so its own
//!   concurrency metric saturates at the per-copy cap while demand grows; this one does not.
//!
//! A route's `max_tokens_ceiling` does not apply to endpoint calls (their bodies are the
//! container's own); its allow-list does, by the endpoint pool's name (a route with a list calls
//! no endpoint in no pool).

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU32, AtomicU64, Ordering},
};

use serde::Serialize;

use super::{Admission, Decision, Estimate, Facts, Invalid, Pass, Pool, Problem, allow, reserve};
use crate::{
    bedrock::Usage,
    config::{EndpointConfig, UnknownModels},
    sagemaker::{EndpointTarget, control::Copies, payload},
};

/// An endpoint pool's copies: what serves now, and what the control plane said last.
#[derive(Debug)]
pub struct EndpointCopies {
    current: AtomicU32,
    /// What scaling asked for, when the control plane says (`u32::MAX`: not known).
    desired: AtomicU32,
    refreshes: AtomicU64,
    refresh_errors: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl EndpointCopies {
    pub fn new(copies: u32) -> EndpointCopies {
        EndpointCopies {
            current: AtomicU32::new(copies),
            desired: AtomicU32::new(u32::MAX),
            refreshes: AtomicU64::new(0),
            refresh_errors: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// The copies serving now.
    pub fn current(&self) -> u32 {
        self.current.load(Ordering::Relaxed)
    }

    /// Successful and failed refreshes since start.
    pub fn refreshes(&self) -> (u64, u64) {
        (
            self.refreshes.load(Ordering::Relaxed),
            self.refresh_errors.load(Ordering::Relaxed),
        )
    }

    /// What `previous` knew of the endpoint (its refresh counts stay with it: they are
    /// published per pool generation).
    fn take_over(&self, previous: &EndpointCopies) {
        self.current.store(previous.current(), Ordering::Relaxed);
        self.desired
            .store(previous.desired.load(Ordering::Relaxed), Ordering::Relaxed);
        *lock(&self.last_error) = lock(&previous.last_error).clone();
    }
}

/// An endpoint pool in `GET /v1/pools`.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointView {
    pub endpoint: String,
    pub inference_component: Option<String>,
    /// Copies serving now (the limit follows them).
    pub copies: u32,
    /// What scaling asked for, when the control plane said.
    pub desired_copies: Option<u32>,
    pub max_concurrency_per_copy: u32,
    pub tokens_per_second_per_copy: Option<u64>,
    /// (In flight + queued) / copies: the scaling signal.
    pub demand_per_copy: f64,
    /// Reads of the copies from the control plane since this pool's config was loaded.
    pub refreshes: u64,
    pub refresh_errors: u64,
    pub last_refresh_error: Option<String>,
}

/// What differs between a Bedrock pool and an endpoint pool, in one place.
impl Pool {
    /// Concurrent requests admitted now under throttle feedback `factor`: the configured limit,
    /// or an endpoint's copies x its per-copy cap (scaled too, never to zero while a copy serves).
    pub(super) fn concurrency(&self, factor: f64) -> u32 {
        match (self.endpoint_config(), self.copies()) {
            (Some(e), Some(copies)) => {
                let full = e.max_concurrency(copies);
                ((f64::from(full) * factor).floor() as u32).max(u32::from(full > 0))
            }
            _ => self.config.max_concurrency,
        }
    }

    /// Tokens per minute the pool holds at most now, before throttle feedback: the configured
    /// quota after headroom, or an endpoint's envelope at the copies serving.
    pub fn capacity(&self) -> u64 {
        match (self.endpoint_config(), self.copies()) {
            (Some(e), Some(copies)) => e.tokens_per_minute(copies),
            _ => self.config.usable_tokens_per_minute(),
        }
    }

    /// Whether a reservation of `tokens` fits the bucket at all (else it could never be
    /// admitted). An endpoint scaled to zero is judged as one copy: it refuses for now, not
    /// forever.
    pub fn can_ever_hold(&self, tokens: u64) -> bool {
        match (self.endpoint_config(), self.copies()) {
            (Some(e), Some(copies)) => tokens <= e.tokens_per_minute(copies.max(1)),
            _ => self.config.can_ever_hold(tokens),
        }
    }

    /// The charge of a request that reported `usage`: Bedrock's (`input + cacheWrite + output
    /// x burndown`), or for an endpoint the tokens it generated.
    pub fn charge(&self, usage: &Usage) -> u64 {
        if self.config.endpoint.is_some() {
            usage.output_tokens
        } else {
            usage.charge(self.config.output_burndown)
        }
    }
}

impl Pool {
    /// The endpoint this pool admits for, if it is an endpoint pool.
    pub fn endpoint_config(&self) -> Option<&EndpointConfig> {
        self.config.endpoint.as_ref()
    }

    /// The copies serving now; `None` for a Bedrock pool.
    pub fn copies(&self) -> Option<u32> {
        self.copies.as_ref().map(EndpointCopies::current)
    }

    /// The control plane said how many copies serve: the limits follow from the next decision
    /// on, and queued requests are woken when capacity grew.
    pub fn set_copies(&self, update: Copies) {
        let Some(copies) = &self.copies else { return };
        let before = copies.current.swap(update.current, Ordering::Relaxed);
        copies
            .desired
            .store(update.desired.unwrap_or(u32::MAX), Ordering::Relaxed);
        copies.refreshes.fetch_add(1, Ordering::Relaxed);
        *lock(&copies.last_error) = None;
        if update.current > before {
            self.queue.wake();
        }
    }

    /// The control plane could not be read: the copies stay as they were.
    pub fn copies_refresh_failed(&self, error: String) {
        if let Some(copies) = &self.copies {
            copies.refresh_errors.fetch_add(1, Ordering::Relaxed);
            *lock(&copies.last_error) = Some(error);
        }
    }

    /// Requests in flight from this replica plus those waiting in its queue, per copy serving
    /// (per one copy while none serves, so that demand on an endpoint scaled to zero shows).
    pub fn demand_per_copy(&self) -> Option<f64> {
        let copies = self.copies()?;
        let demand = self.load.in_flight() + self.queue.depth() as u64;
        Some(demand as f64 / f64::from(copies.max(1)))
    }

    pub(super) fn endpoint_view(&self) -> Option<EndpointView> {
        let (config, copies) = (self.endpoint_config()?, self.copies.as_ref()?);
        let (refreshes, refresh_errors) = copies.refreshes();
        let desired = copies.desired.load(Ordering::Relaxed);
        Some(EndpointView {
            endpoint: config.endpoint.clone(),
            inference_component: config.inference_component.clone(),
            copies: copies.current(),
            desired_copies: (desired != u32::MAX).then_some(desired),
            max_concurrency_per_copy: config.max_concurrency_per_copy,
            tokens_per_second_per_copy: config.tokens_per_second_per_copy,
            demand_per_copy: self.demand_per_copy().unwrap_or(0.0),
            refreshes,
            refresh_errors,
            last_refresh_error: lock(&copies.last_error).clone(),
        })
    }

    /// Takes over the copies `previous` (this pool before a reload) knew, if it served the
    /// same endpoint.
    pub(super) fn inherit_copies(&self, previous: &Pool) {
        let same = |p: &Pool| {
            p.endpoint_config()
                .map(|e| (e.endpoint.clone(), e.inference_component.clone()))
        };
        if let (Some(now), Some(before)) = (&self.copies, &previous.copies)
            && same(self) == same(previous)
            && previous.endpoint_config().and_then(|e| e.refresh).is_some()
        {
            now.take_over(before);
        }
    }
}

impl Admission {
    /// Decides an endpoint call: its pool by endpoint and inference component, the route's
    /// allow-list, the envelope's reservation, then the pool's limits (concurrency first).
    pub(super) async fn decide_endpoint(
        &self,
        facts: &Facts<'_>,
        target: &EndpointTarget,
    ) -> Decision {
        let component = target.inference_component.as_deref();
        let resolved = self.table.resolve_endpoint(&target.endpoint, component);
        let route = &facts.caller.route;
        let named = resolved.map(|pool| (pool, pool.config.name.as_str()));
        let requested = named.map_or(target.endpoint.as_str(), |(_, name)| name);
        if let Some(refusal) = allow::check(route, requested, named) {
            return refusal;
        }
        let Some(pool) = resolved else {
            return match self.config.unknown_models {
                UnknownModels::Pass => Decision::Pass(Pass::UnknownModel),
                UnknownModels::Reject => Decision::UnknownEndpoint {
                    endpoint: target.endpoint.clone(),
                    inference_component: target.inference_component.clone(),
                },
            };
        };
        let shadow = pool.config.shadow || route.config.shadow;
        let estimate = match endpoint_estimate(pool, facts) {
            Ok(estimate) => estimate,
            Err(problem) => {
                return Decision::Invalid(Invalid {
                    pool: Some(pool.clone()),
                    problem,
                });
            }
        };
        let prepared = reserve::Prepared {
            estimate,
            configured_model: &pool.name,
            body: None,
            clamped: false,
            strip_usage_chunk: false,
            service_tier_header: None,
            count_tokens_failed: None,
            adaptive: None,
        };
        self.take(pool, prepared, facts, (shadow, None)).await
    }
}

/// With a token envelope, the output cap the call asks for (or the pool's default); without
/// one, nothing: the concurrency permit is the whole reservation.
fn endpoint_estimate(pool: &Pool, facts: &Facts<'_>) -> Result<Estimate, Problem> {
    let none = Estimate {
        raw_input: 0,
        input: 0,
        max_tokens: 0,
        max_tokens_missing: None,
    };
    if pool
        .endpoint_config()
        .is_none_or(|e| e.tokens_per_second_per_copy.is_none())
    {
        return Ok(none);
    }
    let asked = payload::requested_max_tokens(facts.body).map_err(Problem::Payload)?;
    Ok(Estimate {
        max_tokens: asked.unwrap_or(pool.config.default_max_tokens),
        ..none
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl super::PoolTable {
    /// The endpoint pool of a call to `endpoint` naming `component` (or none).
    pub fn resolve_endpoint(&self, endpoint: &str, component: Option<&str>) -> Option<&Arc<Pool>> {
        let key = (endpoint.to_string(), component.map(str::to_string));
        self.pools.get(*self.by_endpoint.get(&key)?)
    }
}

/// The endpoint pools' part of [`super::PoolTable`]: (endpoint, inference component) to pool.
pub(super) type EndpointIndex = std::collections::HashMap<(String, Option<String>), usize>;

/// The index entry of `config`, if it is an endpoint pool's.
pub(super) fn index_key(config: &crate::config::PoolConfig) -> Option<(String, Option<String>)> {
    config
        .endpoint
        .as_ref()
        .map(|e| (e.endpoint.clone(), e.inference_component.clone()))
}
