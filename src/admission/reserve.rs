//! Taking a reservation: at once when it fits, through the pool's queue when it soon will, and
//! the refusal (with its retry hint) when it will not.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use rand::{SeedableRng, rngs::SmallRng};

use super::{
    Admission, Admitted, Caller, Decision, Estimate, Facts, Hold, NeverFits, Pool, ShadowReason,
    Throttle, ThrottleWhy, Unavailability, Unavailable,
    budgets::TakenBudgets,
    candidates::{FirstAdmitting, Refusal, first_admitting},
    hint, spill,
};
use crate::{
    bedrock::tier::ServiceTier,
    ledger::{LedgerError, Rejection, Reservation, ReserveRequest, Verdict},
};

/// What admission prepared before reserving: the estimate and the body to forward.
#[derive(Debug)]
pub(super) struct Prepared<'a> {
    pub estimate: Estimate,
    /// The model id as the pool's config lists it (the maxTokens-advice slot).
    pub configured_model: &'a str,
    /// The body to forward instead of the caller's, if it was rewritten ([`super::rewrite`]).
    pub body: Option<Bytes>,
    /// Lowered to the route's ceiling.
    pub clamped: bool,
    /// The response's usage chunk is taken out ([`super::Admitted::strip_usage_chunk`]).
    pub strip_usage_chunk: bool,
    /// [`super::Admitted::service_tier_header`].
    pub service_tier_header: Option<ServiceTier>,
    /// Why exact input counting failed, if it did.
    pub count_tokens_failed: Option<String>,
    /// The route's adaptive maxTokens learner for this model, and the cap written if any.
    pub adaptive: Option<super::adaptive::Ticket>,
}

/// A reservation taken, the pool it was taken in, and how long the request waited in the queue
/// for it.
#[derive(Debug)]
pub(super) struct Granted {
    pub pool: Arc<Pool>,
    pub reservation: Reservation,
    pub queued_for: Option<Duration>,
    /// The budgets taken before the reservation ([`super::budgets`]), settled with it.
    pub budgets: Option<TakenBudgets>,
}

impl Admission {
    /// Reserves what `prepared` estimated in `pool` (in shadow mode, without waiting or
    /// refusing; else trying the reserved-capacity pool `ahead` first, for a `reserved` call) and
    /// admits the request holding it, or refuses it; the pool counts an admission or a throttle
    /// under the call's API.
    pub(super) async fn take(
        &self,
        pool: &Arc<Pool>,
        prepared: Prepared<'_>,
        facts: &Facts<'_>,
        (shadow, ahead): (bool, Option<&Arc<Pool>>),
    ) -> Decision {
        let granted = if shadow {
            self.reserve_shadow(pool, prepared.estimate, facts.caller)
                .await
        } else {
            self.reserve(pool, prepared.estimate, facts, ahead).await
        };
        let decision = match granted {
            Ok(g) => spill::sent_as_its_pool(self.admitted(pool, g, prepared, facts.caller), facts),
            Err(refusal) => refusal,
        };
        if let Decision::Admit(_) | Decision::Throttle(_) = decision {
            pool.counts.api_decided(
                facts.operation.api(),
                matches!(decision, Decision::Admit(_)),
            );
        }
        decision
    }

    /// Reserves `estimate`: first the budgets it draws on besides its pool (the account's day,
    /// its route's budgets and concurrency: [`super::budgets`]), then in the reserved-capacity
    /// pool `ahead` (a `reserved` call), or `pool`, or, when neither can admit now, the first pool
    /// of its spill chain that can ([`super::spill`]); else after waiting in `pool`'s queue. The
    /// budgets go back if no pool admits.
    pub(super) async fn reserve(
        &self,
        pool: &Arc<Pool>,
        estimate: Estimate,
        facts: &Facts<'_>,
        ahead: Option<&Arc<Pool>>,
    ) -> Result<Granted, Decision> {
        let caller = facts.caller;
        let tokens = estimate.reservation();
        if !pool.can_ever_hold(tokens) {
            return Err(self.never_fits(pool, &estimate));
        }
        let budgets = match self.take_budgets(pool, tokens, caller).await {
            Ok(budgets) => budgets,
            Err(refusal) => {
                if let Some(slot) = pool.shares.slot(&caller.route.name) {
                    pool.shares.counts(slot).rejected();
                }
                return Err(refusal);
            }
        };
        self.reserve_in_pools(pool, tokens, facts, ahead)
            .await
            .map(|granted| Granted {
                budgets: Some(budgets),
                ..granted
            })
    }

    /// [`Self::reserve`] after the budgets: the candidate pools, then `pool`'s queue.
    async fn reserve_in_pools(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        facts: &Facts<'_>,
        ahead: Option<&Arc<Pool>>,
    ) -> Result<Granted, Decision> {
        let caller = facts.caller;
        let spill = self.spill_candidates(pool, facts, tokens);
        // While requests wait in this pool, newcomers queue behind them instead of taking the
        // capacity freed for them.
        let queue_busy = pool.queue.enabled() && !pool.queue.is_empty();
        let home = (!queue_busy).then_some(pool);
        let reserved = ahead.filter(|p| p.can_ever_hold(tokens));
        let candidates: Vec<Arc<Pool>> = reserved
            .into_iter()
            .chain(home)
            .chain(spill.iter().copied())
            .cloned()
            .collect();
        let walk = first_admitting(candidates, |p: Arc<Pool>| async move {
            self.try_reserve(&p, tokens, caller).await
        })
        .await;
        let refused = match walk {
            FirstAdmitting::Admitted { pool, reservation } => {
                return Ok(Granted {
                    pool,
                    reservation,
                    queued_for: None,
                    budgets: None,
                });
            }
            FirstAdmitting::Refused(refused) => refused,
        };
        let rejection = match spill::home_refusal(pool, &refused) {
            Some(Refusal::Failed(e)) => return Err(self.ledger_unavailable(pool, e)),
            Some(Refusal::NoRoom(rejection)) => Some(rejection),
            None => None,
        };
        let outcome = match (rejection, pool.queue.enabled()) {
            (Some(rejection), false) => {
                Err(self.throttle_soonest(pool, rejection, &refused, tokens))
            }
            _ => self.wait_in_queue(pool, tokens, rejection, caller).await,
        };
        if outcome.is_err()
            && let Some(slot) = pool.shares.slot(&caller.route.name)
        {
            pool.shares.counts(slot).rejected();
        }
        outcome
    }

    /// Shadow mode: decide at once (no queueing) and take the reservation when it fits, so the
    /// ledger sees the real load; when it does not, say what enforcement would have done.
    pub(super) async fn reserve_shadow(
        &self,
        pool: &Arc<Pool>,
        estimate: Estimate,
        caller: &Caller,
    ) -> Result<Granted, Decision> {
        let waived = |reason| {
            Decision::Pass(super::Pass::Shadow {
                pool: Some(pool.clone()),
                reason,
            })
        };
        if !pool.can_ever_hold(estimate.reservation()) {
            return Err(waived(ShadowReason::NeverFits));
        }
        match self.try_reserve(pool, estimate.reservation(), caller).await {
            Ok(Verdict::Granted(reservation)) => Ok(Granted {
                pool: pool.clone(),
                reservation,
                queued_for: None,
                budgets: None,
            }),
            Ok(Verdict::Refused(rejection)) => Err(waived(ShadowReason::Limit(rejection.limit))),
            Err(_) => Err(waived(ShadowReason::LedgerError)),
        }
    }

    /// One ledger decision with the pool's current limits.
    pub(crate) async fn try_reserve(
        &self,
        pool: &Pool,
        tokens: u64,
        caller: &Caller,
    ) -> Result<Verdict, LedgerError> {
        let share = pool.shares.request(&caller.route.name, caller.retry);
        self.ledger
            .reserve(&ReserveRequest {
                pool: &pool.name,
                limits: pool.limits(),
                tokens,
                share: share.as_ref(),
                hold_back: pool.pending_excess(),
            })
            .await
    }

    /// The admitted request, holding `granted` until it settles; `home` is the pool its model
    /// resolved to (another than `granted`'s when it spilled).
    pub(super) fn admitted(
        &self,
        home: &Arc<Pool>,
        granted: Granted,
        prepared: Prepared<'_>,
        caller: &Caller,
    ) -> Admitted {
        let Granted {
            pool,
            reservation,
            queued_for,
            budgets,
        } = granted;
        let Prepared {
            estimate,
            configured_model,
            body,
            clamped,
            strip_usage_chunk,
            service_tier_header,
            count_tokens_failed,
            adaptive,
        } = prepared;
        // Reserved capacity for the call's own model (a `reserved` tier call) is no spill.
        let spilled =
            pool.id != home.id && !pool.config.models.iter().any(|m| m == configured_model);
        let spilled_from = spilled.then(|| home.clone());
        // A spilled request runs as the pool's own model.
        let configured_model = match spilled_from {
            Some(_) => pool.config.model_id(),
            None => configured_model,
        };
        let pool = &pool;
        pool.counts
            .admitted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let route = pool.shares.slot(&caller.route.name);
        let recovered = reservation.share().is_some_and(|s| s.recovered);
        if let (Some(slot), true) = (route, recovered) {
            pool.shares.counts(slot).recovered();
        }
        let advice_slot = pool.advice.slot(configured_model);
        if estimate.max_tokens_missing.is_some() {
            pool.advice.named_none(advice_slot);
        }
        let hold = Hold::new(
            pool.clone(),
            self.ledger.clone(),
            reservation,
            estimate,
            advice_slot,
            route,
        )
        .with_budgets(budgets)
        .with_adaptive(adaptive);
        Admitted {
            hold,
            spilled_from,
            clamped,
            strip_usage_chunk,
            service_tier_header,
            body,
            queued_for,
            recovered,
            count_tokens_failed,
        }
    }

    /// A reservation above the pool's whole bucket would be refused forever.
    fn never_fits(&self, pool: &Arc<Pool>, estimate: &Estimate) -> Decision {
        pool.counts
            .never_fits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Decision::NeverFits(NeverFits {
            pool: pool.clone(),
            reserving: estimate.reservation(),
            input: estimate.input,
            max_tokens: estimate.max_tokens,
            max_tokens_missing: estimate.max_tokens_missing,
            capacity: pool.capacity(),
        })
    }

    /// The 429 for a request that does not fit now and will not wait.
    pub(super) fn throttle(
        &self,
        pool: &Arc<Pool>,
        rejection: &Rejection,
        tokens: u64,
    ) -> Decision {
        pool.counts.rejected(rejection.limit);
        let wait = hint::projected_wait(rejection, pool.history(), self.config.max_retry_hint);
        Decision::Throttle(Throttle {
            pool: pool.clone(),
            limit: rejection.limit,
            reserving: tokens,
            why: ThrottleWhy::NoRoom {
                reserving: tokens,
                available: tokens.saturating_sub(rejection.token_deficit),
                in_flight: rejection.in_flight_requests,
            },
            hint: self.hint(wait),
        })
    }

    /// The ledger failed: a 503 the SDKs retry.
    pub(super) fn ledger_unavailable(&self, pool: &Arc<Pool>, e: &LedgerError) -> Decision {
        self.unavailable(
            pool,
            Unavailability::Ledger {
                backend: e.backend,
                error: e.to_string(),
            },
        )
    }

    pub(super) fn unavailable(&self, pool: &Arc<Pool>, cause: Unavailability) -> Decision {
        Decision::Unavailable(Unavailable {
            pool: pool.clone(),
            cause,
            hint: self.hint(hint::UNAVAILABLE_WAIT),
        })
    }

    /// A jittered retry hint around `wait`, within `max_retry_hint`.
    pub fn hint(&self, wait: Duration) -> Duration {
        let mut rng = SmallRng::from_rng(&mut rand::rng());
        hint::jittered(wait, self.config.max_retry_hint, &mut rng)
    }

    /// Upstream refused a request of `pool` reserving `reserved` tokens on its *daily* quota:
    /// the per-minute limit is not the cause, so it does not shrink. Returns the hint to pass
    /// on: how long the day takes to refill this request's tokens (a 1,440th of the quota a
    /// minute) when the pool's `tokens_per_day` is known, else the longest hint; jittered and
    /// capped by `max_retry_hint` as always.
    pub fn upstream_daily_throttled(&self, pool: &Pool, reserved: u64) -> Duration {
        let wait = match pool.config.tokens_per_day {
            Some(per_day) => {
                Duration::from_secs_f64(reserved.max(1) as f64 * 86_400.0 / per_day as f64)
            }
            None => self.config.max_retry_hint,
        };
        self.hint(wait.max(hint::UNAVAILABLE_WAIT))
    }

    /// Upstream throttled a request this proxy admitted in `pool` with its per-minute limits
    /// (other traffic shares the account quota): the pool's limit shrinks. Returns the hint to pass on: about half a
    /// typical request, at least a second, jittered.
    pub fn upstream_throttled(&self, pool: &Pool) -> Duration {
        pool.upstream_throttled();
        let wait = (pool.history().typical_duration / 2).max(hint::UNAVAILABLE_WAIT);
        self.hint(wait)
    }
}
