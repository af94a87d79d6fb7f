//! Adaptive maxTokens (issue #22): for a route with `adaptive_max_tokens`, the output cap the
//! proxy writes into a forwarded request and reserves, learned per (route, model) from the
//! outputs upstream reported, and guarded by the truncations it causes.
//!
//! # The cap
//! Each (route, model) has a [`Learner`]: a fixed-bucket histogram of output tokens (the
//! maxTokens advice's [`Lengths`]: lock-free, quantiles err high by at most one bucket, 12.5%).
//! Once it has seen `min_samples` calls settled with usage, its cap is the `quantile` of output
//! (p99.9 by default) times `margin` (1.2) times 2^`raises`, rounded up to a multiple of 64
//! ([`with_margin`]), and at least `floor`. A request is capped only when that is below what it
//! would otherwise carry (the caller's own `maxTokens`, within the route's ceiling, or what the
//! pool reserves when it names none): the cap never exceeds the caller's value, never drops
//! below the floor (unless the caller's own value is lower: then the caller's stands), and
//! before `min_samples` the caller's value stands. The cap is recomputed every
//! [`REFRESH_EVERY`] samples and at each raise, so admission reads one atomic.
//!
//! # The guard
//! A call the proxy capped that stopped at that cap is a truncation the proxy caused (the
//! caller's own value would have let it go on). [`Guard`] counts capped calls and those
//! truncations in a tumbling window of `10 / truncation_target` capped calls; when the
//! truncations pass `truncation_target` of the window's calls (counted over at least
//! `1 / truncation_target` calls, so one truncation in a quiet window is allowed), the cap is
//! raised at once (its multiplier doubles) and a new window starts; learning continues. Raises
//! are never taken back: a cap errs high after a burst of long outputs, never low.
//! A truncation is recognised from the stop reason (`max_tokens`, `length`, ...: the usage
//! observer's, noted on the [`super::Hold`] before the usage settles it), or, where no stop
//! reason is read (InvokeModel streams), from the output reaching the cap (`output >= cap`).
//!
//! # Where it meets the rest of the policy
//! - **Shadow** (the route's or the pool's `shadow`): the cap is not written and the caller's
//!   value is reserved ([`Capping::Observe`]); the learner learns, and the guard counts what the
//!   cap would have done (a call it would have lowered as capped, an output at or past it as a
//!   truncation, raising the cap as enforcement would), so `/v1/pools` shows what turning it on
//!   would give.
//! - **A call that names no `maxTokens`** and gets the cap counts as
//!   [`MissingMaxTokens::AdaptiveCap`] (what was written in and reserved), not as the pool's rule.
//! - **A spilled call** keeps the cap learned for the model it asked for (the body is written
//!   before the pools are tried), and its [`Ticket`] goes with its hold, so that model's learner
//!   learns its output: an answer's length is the prompt's, and a spill target is usually the
//!   same model elsewhere.
//! - **The adaptive retry** (`routes[].adaptive_retry`, `crate::proxy::adaptive_retry`) of a
//!   call the cap stopped is decided with [`Capping::Uncapped`]: the caller's value, and its
//!   output (the whole answer) learned.
//!
//! # Scope
//! The learned cap is per replica: in memory, from that replica's traffic; a reload keeps what
//! a route learned for a model when its `adaptive_max_tokens` did not change
//! ([`Learner::inherit`]), and starts again otherwise. That is safe with a shared Redis ledger because each replica's
//! reservations are its own: a replica reserves the cap it wrote, and settles to what upstream
//! charged, so replicas with different caps reserve differently but each truthfully.
//! Nothing here writes a metric or speaks HTTP; `GET /v1/pools` reads [`Learner::view`].

use foldhash::HashMap;
use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

use serde::Serialize;

use super::{
    Estimate, MissingMaxTokens, Route,
    advice::{Lengths, with_margin},
};
use crate::{
    bedrock::{ModelRef, Operation, max_tokens::field_to_set},
    config::{AdaptiveMaxTokens, PoolConfig, RouteConfig},
};

/// The cap is recomputed from the histogram every this many samples.
pub const REFRESH_EVERY: u64 = 16;
/// Each raise multiplies the cap by this.
pub const RAISE_FACTOR: f64 = 2.0;
/// Raises past this many change nothing more (2^32 times any cap exceeds every caller's).
const MAX_RAISES: u32 = 32;
/// The guard's window, in multiples of `1 / truncation_target` capped calls.
const WINDOW_TARGETS: f64 = 10.0;

/// The cap learned from `quantile_output` (the configured quantile of observed output) after
/// `raises` raises: quantile x margin x 2^raises, rounded up to 64, at least the floor.
pub fn learned_cap(params: &AdaptiveMaxTokens, quantile_output: u64, raises: u32) -> u64 {
    let margin = params.margin * RAISE_FACTOR.powi(raises.min(MAX_RAISES) as i32);
    with_margin(quantile_output, margin).max(params.floor)
}

/// The truncation guard: capped calls and the truncations they ended in, in the current window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Guard {
    /// Capped calls in the current window.
    pub window_calls: u64,
    /// Of which stopped at the proxy's cap.
    pub window_truncated: u64,
    /// Times the cap was raised.
    pub raises: u32,
    /// Capped calls since start.
    pub capped_calls: u64,
    /// Truncations the proxy's cap caused since start.
    pub proxy_truncations: u64,
}

impl Guard {
    /// Records one settled call the proxy capped, and whether it stopped at the cap; returns
    /// whether the cap must rise (the window's truncations passed `target`).
    pub fn record(&mut self, truncated: bool, target: f64) -> bool {
        self.window_calls += 1;
        self.capped_calls += 1;
        if truncated {
            self.window_truncated += 1;
            self.proxy_truncations += 1;
        }
        let over_at_least = (1.0 / target).ceil().max(1.0);
        let allowed = target * (self.window_calls as f64).max(over_at_least);
        if truncated && self.window_truncated as f64 > allowed {
            self.raises = self.raises.saturating_add(1).min(MAX_RAISES);
            self.window_calls = 0;
            self.window_truncated = 0;
            return true;
        }
        if self.window_calls as f64 >= (WINDOW_TARGETS / target).ceil() {
            self.window_calls = 0;
            self.window_truncated = 0;
        }
        false
    }
}

/// What one (route, model) learned.
#[derive(Debug)]
pub struct Learner {
    params: AdaptiveMaxTokens,
    outputs: Lengths,
    samples: AtomicU64,
    /// The cap in force; 0 before `min_samples`.
    cap: AtomicU64,
    guard: Mutex<Guard>,
}

/// What a request does with its learner's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capping {
    /// Writes the cap into the forwarded body and reserves it (an enforcing route and pool).
    Write,
    /// A shadow route or pool: the caller's value goes as it was and is reserved; the learner
    /// learns from the output, and counts the call as capped, and a truncation, as the cap
    /// would have (an output at or past it), so that the guard and `/v1/pools` show what
    /// turning it on would do.
    Observe,
    /// The adaptive retry of a call the cap truncated ([`crate::config::RouteConfig::adaptive_retry`]):
    /// the caller's own value; its output is learned (the full answer the cap cut short).
    Uncapped,
}

/// A request's part in its learner: the cap the proxy chose (if it did) against the value it
/// would have carried otherwise; its [`super::Hold`] reports the outcome ([`Ticket::settled`]).
#[derive(Debug, Clone)]
pub struct Ticket {
    learner: Arc<Learner>,
    /// The learned cap below the caller's value; `None`: the caller's value went as it was and
    /// the call counts as uncapped.
    pub cap: Option<u64>,
    /// Whether `cap` was written into the forwarded body (else observed: [`Capping::Observe`]).
    pub written: bool,
    /// The `maxTokens` the request would have carried without the learned cap.
    pub caller: u64,
}

impl Ticket {
    /// The cap written into the forwarded body, if the proxy capped it.
    pub fn written_cap(&self) -> Option<u64> {
        self.cap.filter(|_| self.written)
    }

    /// The call settled with `output_tokens`; `stopped_at_cap` when its stop reason said it hit
    /// its output cap. Output at or past a cap the proxy chose is a truncation the proxy caused
    /// (or, observed, would have caused); a stop reason counts only for a cap written.
    pub fn settled(&self, output_tokens: u64, stopped_at_cap: bool) {
        let proxy_truncated = self
            .cap
            .map(|cap| (self.written && stopped_at_cap) || output_tokens >= cap);
        self.learner.settled(output_tokens, proxy_truncated);
    }
}

/// What became of the adaptive retry of a call the cap stopped (`routes[].adaptive_retry`,
/// `crate::proxy::adaptive_retry`): the `outcome` label of `tokengate_adaptive_retries_total`
/// and the value of the `x-tokengate-adaptive-retry` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOutcome {
    /// Admitted and answered 2xx: the retry's answer returned.
    Answered,
    /// Not admitted: the truncated first answer returned.
    Refused,
    /// Upstream failed it: the first answer returned.
    Failed,
}

impl RetryOutcome {
    pub const ALL: [RetryOutcome; 3] = [
        RetryOutcome::Answered,
        RetryOutcome::Refused,
        RetryOutcome::Failed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            RetryOutcome::Answered => "answered",
            RetryOutcome::Refused => "refused",
            RetryOutcome::Failed => "failed",
        }
    }
}

/// One (route, model) in `GET /v1/pools` (`adaptive_max_tokens`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LearnerView {
    pub route: String,
    pub model: String,
    /// Calls settled with usage.
    pub samples: u64,
    pub min_samples: u64,
    /// The learned cap in force; `null` until `min_samples`.
    pub cap: Option<u64>,
    /// The configured quantile of observed output.
    pub quantile_output: Option<u64>,
    #[serde(flatten)]
    pub guard: Guard,
}

impl Learner {
    pub fn new(params: AdaptiveMaxTokens) -> Learner {
        Learner {
            params,
            outputs: Lengths::new(),
            samples: AtomicU64::new(0),
            cap: AtomicU64::new(0),
            guard: Mutex::new(Guard::default()),
        }
    }

    /// The cap to write for a request that would carry `caller`: `Some` only when the learner
    /// has its samples and its cap is below `caller`.
    pub fn cap_for(&self, caller: u64) -> Option<u64> {
        let cap = self.cap.load(Ordering::Relaxed);
        (cap != 0 && cap < caller).then_some(cap)
    }

    /// Records a settled call's output; `proxy_truncated` is `Some` for a call the proxy capped
    /// (whether it stopped at that cap). Raises the cap at once when the guard says so.
    pub fn settled(&self, output_tokens: u64, proxy_truncated: Option<bool>) {
        self.outputs.record(output_tokens);
        let samples = self.samples.fetch_add(1, Ordering::Relaxed) + 1;
        let raised = proxy_truncated.is_some_and(|truncated| {
            self.guard()
                .record(truncated, self.params.truncation_target)
        });
        let due = samples == self.params.min_samples
            || (samples > self.params.min_samples && samples.is_multiple_of(REFRESH_EVERY));
        if raised || due {
            self.refresh(samples);
        }
    }

    /// Recomputes the cap in force.
    fn refresh(&self, samples: u64) {
        if samples < self.params.min_samples {
            return;
        }
        let Some(q) = self.outputs.quantile(self.params.quantile) else {
            return;
        };
        let raises = self.guard().raises;
        self.cap
            .store(learned_cap(&self.params, q, raises), Ordering::Relaxed);
    }

    /// Takes over what `previous` learned (a reload), when its parameters are the same: its
    /// outputs, samples, guard and cap in force.
    pub fn inherit(&self, previous: &Learner) {
        if self.params != previous.params {
            return;
        }
        self.outputs.absorb(&previous.outputs);
        let samples = previous.samples.load(Ordering::Relaxed);
        self.samples.fetch_add(samples, Ordering::Relaxed);
        *self.guard() = *previous.guard();
        self.cap
            .store(previous.cap.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, Guard> {
        // A panic while holding it leaves plain counters: still usable.
        self.guard.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn view(&self, route: &str, model: &str) -> LearnerView {
        let cap = self.cap.load(Ordering::Relaxed);
        LearnerView {
            route: route.to_string(),
            model: model.to_string(),
            samples: self.samples.load(Ordering::Relaxed),
            min_samples: self.params.min_samples,
            cap: (cap != 0).then_some(cap),
            quantile_output: self.outputs.quantile(self.params.quantile),
            guard: *self.guard(),
        }
    }
}

/// A route's learners, one per pooled model its `adaptive_max_tokens` covers.
#[derive(Debug, Default)]
pub struct RouteLearners {
    by_model: HashMap<String, Arc<Learner>>,
}

impl RouteLearners {
    /// The learners of `route` over `pools`' models; `None` when the route does not opt in.
    pub fn new(route: &RouteConfig, pools: &[PoolConfig]) -> Option<RouteLearners> {
        let params = route.adaptive_max_tokens.as_ref()?;
        let allowed =
            |m: &String| route.models.as_ref().is_none_or(|ms| ms.contains(m)) && params.covers(m);
        let by_model = pools
            .iter()
            .flat_map(|p| p.models.iter())
            .filter(|m| allowed(m))
            .map(|m| (m.clone(), Arc::new(Learner::new(params.clone()))))
            .collect();
        Some(RouteLearners { by_model })
    }

    /// The learner of `model` (the model id as its pool's config lists it).
    pub fn get(&self, model: &str) -> Option<&Arc<Learner>> {
        self.by_model.get(model)
    }

    /// Takes over what `previous` (the same route before a reload) learned, model by model.
    pub fn inherit(&self, previous: &RouteLearners) {
        for (model, learner) in &self.by_model {
            if let Some(old) = previous.get(model) {
                learner.inherit(old);
            }
        }
    }

    /// A ticket for a request of `model` that would carry `caller`.
    pub fn ticket(&self, model: &str, caller: u64, capping: Capping) -> Option<Ticket> {
        let learner = self.get(model)?;
        Some(Ticket {
            cap: learner
                .cap_for(caller)
                .filter(|_| capping != Capping::Uncapped),
            written: capping == Capping::Write,
            learner: learner.clone(),
            caller,
        })
    }
}

/// What every route learned for `models` (a pool's), for `GET /v1/pools`.
pub fn views(routes: &[Arc<Route>], models: &[String]) -> Vec<LearnerView> {
    let mut out = Vec::new();
    for route in routes {
        let Some(learners) = &route.adaptive else {
            continue;
        };
        for model in models {
            if let Some(learner) = learners.get(model) {
                out.push(learner.view(&route.name, model));
            }
        }
    }
    out
}

/// A request of `route` for `model` (its id as the pool's config lists it), about to reserve
/// `estimate`: with [`Capping::Write`], lowers `estimate.max_tokens` to the learned cap when
/// there is one below it (a call that named none counts as [`MissingMaxTokens::AdaptiveCap`]),
/// and returns the request's ticket (its [`Ticket::written_cap`] is what to write into the
/// forwarded body). `requested`: the `maxTokens` the body names. `None` when the route does not
/// learn this model, or the cap could not be written: a bidirectional stream (its `maxTokens`
/// arrives after admission), or a body that names none in a family whose field is unknown; and a
/// body that names more than `model_max` (the pool's `max_output_tokens`), which Bedrock refuses:
/// lowering it would make a call succeed through the proxy that fails without it.
pub(super) fn apply(
    route: &Route,
    operation: Operation,
    model: (&ModelRef<'_>, &str, u64),
    (requested, capping): (Option<u64>, Capping),
    estimate: &mut Estimate,
) -> Option<Ticket> {
    let learners = route.adaptive.as_ref()?;
    let (model, configured, model_max) = model;
    let named = requested.is_some();
    let writable = named || field_to_set(operation, model.provider(), None).is_some();
    if operation == Operation::InvokeModelWithBidirectionalStream
        || !writable
        || requested.is_some_and(|asked| asked > model_max)
    {
        return None;
    }
    let ticket = learners.ticket(configured, estimate.max_tokens, capping)?;
    if let Some(cap) = ticket.written_cap() {
        estimate.max_tokens = cap;
        if estimate.max_tokens_missing.is_some() {
            estimate.max_tokens_missing = Some(MissingMaxTokens::AdaptiveCap);
        }
    }
    Some(ticket)
}

#[cfg(test)]
#[path = "adaptive_tests.rs"]
mod tests;
