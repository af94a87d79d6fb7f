//! What admission decided about one request: pure data.
//!
//! [`super::Admission::decide`] returns a [`Decision`]; nothing in it is HTTP, a metric or a log
//! line. [`crate::answer`] maps every refusal to its Bedrock-shaped response (status, error type,
//! message, retry hint headers) with one exhaustive `match`, and [`crate::observe`] records it.
//! A retry hint is decided here, jittered, because when to come back is admission's call.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{MissingMaxTokens, Pool, hold::Hold};
use crate::{
    bedrock::{max_tokens::MaxTokensError, tier::ServiceTier},
    ledger::Limit,
};

/// The outcome of admission for one request.
#[derive(Debug)]
pub enum Decision {
    /// Reserved in a pool: forward it, and settle through its [`Hold`].
    Admit(Admitted),
    /// Forward without a reservation.
    Pass(Pass),
    /// Does not fit now: 429 `ThrottlingException` with a retry hint.
    Throttle(Throttle),
    /// Larger than the pool can ever hold: 400, saying what would fit.
    NeverFits(NeverFits),
    /// The caller's route may not call this model: 403.
    NotAllowed(NotAllowed),
    /// Admission cannot read what it needs from the request: 400.
    Invalid(Invalid),
    /// The model is in no pool, and unknown models are refused: 400.
    UnknownModel { model: String },
    /// The endpoint (or inference component) is in no `[[endpoints]]` entry, and unknown
    /// models are refused: 400.
    UnknownEndpoint {
        endpoint: String,
        inference_component: Option<String>,
    },
    /// Admission could not decide, or is shutting down: 503 with a retry hint.
    Unavailable(Unavailable),
}

impl Decision {
    /// The pool the request was decided in, if any.
    pub fn pool(&self) -> Option<&Arc<Pool>> {
        match self {
            Decision::Admit(a) => Some(a.hold.pool()),
            Decision::Pass(Pass::Shadow { pool, .. }) => pool.as_ref(),
            Decision::Pass(_)
            | Decision::UnknownModel { .. }
            | Decision::UnknownEndpoint { .. } => None,
            Decision::Throttle(t) => Some(&t.pool),
            Decision::NeverFits(n) => Some(&n.pool),
            Decision::NotAllowed(n) => n.pool.as_ref(),
            Decision::Invalid(i) => i.pool.as_ref(),
            Decision::Unavailable(u) => Some(&u.pool),
        }
    }
}

/// An admitted request.
#[derive(Debug)]
pub struct Admitted {
    /// The reservation, until settled; its pool is where the request runs.
    pub hold: Hold,
    /// The request's own pool, when it could not admit now and the request spilled to the
    /// hold's pool ([`super::spill`]): sent as that pool's model, in its Region.
    pub spilled_from: Option<Arc<Pool>>,
    /// The body to forward instead of the caller's (maxTokens rewritten to the route's ceiling,
    /// streamed usage asked for: [`super::rewrite`]).
    pub body: Option<Bytes>,
    /// Lowered to the route's `max_tokens_ceiling`.
    pub clamped: bool,
    /// The forwarded body asks for a streamed usage chunk the caller did not ask for: take it
    /// out of the response ([`crate::bedrock::sse::UsageChunkFilter`]).
    pub strip_usage_chunk: bool,
    /// The service tier to send in `X-Amzn-Bedrock-Service-Tier` in place of the caller's: a
    /// route that forces one (`routes[].service_tier`), on InvokeModel.
    pub service_tier_header: Option<ServiceTier>,
    /// How long it waited in the pool's queue, if it did.
    pub queued_for: Option<Duration>,
    /// An SDK retry admitted into the pool's retry reserve (its route's recovery budget).
    pub recovered: bool,
    /// Exact counting (`input_estimate = "count_tokens"`) failed and the estimate was used.
    pub count_tokens_failed: Option<String>,
}

/// Why a request is forwarded without a reservation.
#[derive(Debug, Clone)]
pub enum Pass {
    /// The operation spends no quota (CountTokens, guardrails, async job queries), or names no
    /// model.
    NotMetered,
    /// A model in no pool, under `unknown_models = "pass"`.
    UnknownModel,
    /// Shadow mode: enforcement would have refused it for `reason` (in `pool`; `None` for a
    /// model in no pool that a shadow route's allow-list does not hold).
    Shadow {
        pool: Option<Arc<Pool>>,
        reason: ShadowReason,
    },
}

/// What shadow mode waived; the `reason` label of `tokengate_shadow_rejections_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowReason {
    Limit(Limit),
    NeverFits,
    NotAllowed,
    MaxTokensCeiling,
    LedgerError,
}

impl ShadowReason {
    pub const ALL: [ShadowReason; 11] = [
        ShadowReason::Limit(Limit::Tokens),
        ShadowReason::Limit(Limit::Requests),
        ShadowReason::Limit(Limit::Concurrency),
        ShadowReason::Limit(Limit::Share),
        ShadowReason::Limit(Limit::DailyQuota),
        ShadowReason::Limit(Limit::Budget),
        ShadowReason::Limit(Limit::RouteConcurrency),
        ShadowReason::NeverFits,
        ShadowReason::NotAllowed,
        ShadowReason::MaxTokensCeiling,
        ShadowReason::LedgerError,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ShadowReason::Limit(limit) => limit.label(),
            ShadowReason::NeverFits => "never_fits",
            ShadowReason::NotAllowed => "not_allowed",
            ShadowReason::MaxTokensCeiling => "max_tokens_ceiling",
            ShadowReason::LedgerError => "ledger_error",
        }
    }
}

/// A request that does not fit now.
#[derive(Debug, Clone)]
pub struct Throttle {
    pub pool: Arc<Pool>,
    /// The limit that bound.
    pub limit: Limit,
    /// The reservation it asked for (`input + maxTokens`).
    pub reserving: u64,
    pub why: ThrottleWhy,
    /// When to come back: projected from the ledger, jittered, within `max_retry_hint`.
    pub hint: Duration,
}

impl Throttle {
    /// The `x-tokengate-reason` value and the `reason` label of `tokengate_rejections_total`.
    pub fn reason(&self) -> &'static str {
        match self.why {
            ThrottleWhy::Queue(QueueRefusal::Full) => "queue_full",
            _ => self.limit.label(),
        }
    }
}

/// Why a throttled request was not held until it fit.
#[derive(Debug, Clone, PartialEq)]
pub enum ThrottleWhy {
    /// Refused at once (the pool has no queue).
    NoRoom {
        /// Tokens this request reserves.
        reserving: u64,
        /// Tokens the bucket held for it.
        available: u64,
        in_flight: u32,
    },
    /// The admission queue would not hold it, or could not admit it in time.
    Queue(QueueRefusal),
    /// A budget outside the pool turned it away (taken before the pool's reservation).
    Budget {
        scope: BudgetScope,
        /// The binding window (`tokens_per_day`, ...).
        window: &'static str,
        reserving: u64,
        /// Tokens the window had left.
        available: u64,
    },
}

/// Whose budget refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetScope {
    /// `admission.account_tokens_per_day`, across every pool.
    Account,
    /// The named route's `budgets`.
    Route(String),
}

/// Why the admission queue turned a request away.
#[derive(Debug, Clone, PartialEq)]
pub enum QueueRefusal {
    /// The queue is at `max_queue`.
    Full,
    /// Its projected wait is longer than the pool's `max_wait`.
    ProjectedTooLong,
    /// It waited `max_wait` without room appearing.
    TimedOut { waited: Duration },
}

/// A reservation larger than the pool's whole bucket.
#[derive(Debug, Clone)]
pub struct NeverFits {
    pub pool: Arc<Pool>,
    pub reserving: u64,
    pub input: u64,
    pub max_tokens: u64,
    /// The request named no `maxTokens` (so `max_tokens` is the model's maximum, or the pool's
    /// default), and what was done about it.
    pub max_tokens_missing: Option<MissingMaxTokens>,
    /// The most the pool holds.
    pub capacity: u64,
}

/// A route calling a model it may not.
#[derive(Debug, Clone)]
pub struct NotAllowed {
    /// The model's pool; `None` for a model in no pool (on no allow-list).
    pub pool: Option<Arc<Pool>>,
    pub route: Arc<str>,
    pub model: String,
}

/// A request admission cannot read, or a `maxTokens` its route refuses.
#[derive(Debug)]
pub struct Invalid {
    /// `None` when the request never reached a pool.
    pub pool: Option<Arc<Pool>>,
    pub problem: Problem,
}

/// What is wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("the request body is not valid JSON ({error}); {operation} needs a JSON body")]
    NotJson {
        operation: &'static str,
        error: String,
    },
    #[error("the request body must be a JSON object for {operation}")]
    NotObject { operation: &'static str },
    #[error(transparent)]
    MaxTokens(#[from] MaxTokensError),
    #[error(
        "maxTokens {max_tokens} is above the ceiling of {ceiling} that tokengate route {route:?} allows; set maxTokens to at most {ceiling}"
    )]
    AboveCeiling {
        max_tokens: u64,
        ceiling: u64,
        route: Arc<str>,
    },
    #[error("maxTokens cannot be limited to the route's ceiling of {ceiling}: {reason}")]
    CannotClamp { ceiling: u64, reason: String },
    /// The route's `allowed_tiers` leave out the tier the call asks for.
    #[error(
        "route {route:?} may not use service tier {tier:?} (a call that names none is \"default\"): send serviceTier (Converse) or X-Amzn-Bedrock-Service-Tier (InvokeModel) with one of: {allowed}"
    )]
    TierNotAllowed {
        route: String,
        tier: &'static str,
        allowed: String,
    },
    #[error(
        "this request names no maximum output, so Bedrock would reserve the model's maximum ({model_max} tokens), and tokengate pool {pool:?} refuses such requests (when_max_tokens_missing = \"reject\"): send {field} with the most output tokens you need"
    )]
    MaxTokensMissing {
        /// The field to send (`inferenceConfig.maxTokens`, `max_tokens`, ...).
        field: &'static str,
        pool: String,
        model_max: u64,
    },
    /// An endpoint call's container payload, read for its output cap.
    #[error("{0}; send max_tokens (or parameters.max_new_tokens) as a whole number")]
    Payload(#[from] crate::sagemaker::payload::PayloadError),
    #[error("the streamed usage cannot be asked for on the caller's behalf: {reason}")]
    CannotAskUsage { reason: String },
    /// A field of an OpenAI or Anthropic API body that is missing, repeated or mistyped.
    #[error("{field} {problem}")]
    Field {
        field: &'static str,
        problem: &'static str,
    },
}

/// Admission could not decide.
#[derive(Debug, Clone)]
pub struct Unavailable {
    pub pool: Arc<Pool>,
    pub cause: Unavailability,
    pub hint: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Unavailability {
    /// The quota ledger failed.
    Ledger {
        backend: &'static str,
        /// What failed, naming the operation and the pool.
        error: String,
    },
    /// tokengate is shutting down; a queued request is answered at once.
    ShuttingDown { waited: Option<Duration> },
}
