//! Taking a reservation: at once when it fits, through the pool's queue when it soon will, and
//! the refusal (with its retry hint) when it will not.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use rand::{SeedableRng, rngs::SmallRng};

use super::{
    Admission, Admitted, Caller, Decision, Estimate, Hold, NeverFits, Pool, ShadowReason, Throttle,
    ThrottleWhy, Unavailability, Unavailable, budgets::TakenBudgets, hint,
};
use crate::{
    bedrock::Api,
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
    /// Why exact input counting failed, if it did.
    pub count_tokens_failed: Option<String>,
}

/// A reservation taken, how long the request waited in the queue for it, and the budgets it
/// took beforehand.
#[derive(Debug)]
pub(super) struct Granted {
    pub reservation: Reservation,
    pub queued_for: Option<Duration>,
    pub budgets: Option<TakenBudgets>,
}

impl Admission {
    /// Reserves what `prepared` estimated in `pool`, or the first of the pools `ahead` that
    /// admits it now (in shadow mode, in `pool` without waiting or refusing), and admits the
    /// request holding it, or refuses it; the pool counts an admission or a throttle under the
    /// call's `api`.
    pub(super) async fn take(
        &self,
        pool: &Arc<Pool>,
        prepared: Prepared<'_>,
        caller: &Caller,
        (shadow, api): (bool, Api),
        ahead: &[usize],
    ) -> Decision {
        let granted = if shadow {
            self.reserve_shadow(pool, prepared.estimate, caller).await
        } else {
            self.reserve(pool, prepared.estimate, caller, ahead).await
        };
        let decision = match granted {
            Ok((won, granted)) => Decision::Admit(self.admitted(&won, granted, prepared, caller)),
            Err(refusal) => refusal,
        };
        if let Decision::Admit(_) | Decision::Throttle(_) = decision {
            pool.counts
                .api_decided(api, matches!(decision, Decision::Admit(_)));
        }
        decision
    }

    /// Reserves `estimate`: the budgets it draws on (the account's day, its route's budgets),
    /// then the first of the pools `ahead` (ids) that admits it now ([`super::candidates`]),
    /// else `pool`, at once or after waiting in its queue. The budgets go back if no pool
    /// admits. Returns the pool that admitted.
    pub(super) async fn reserve(
        &self,
        pool: &Arc<Pool>,
        estimate: Estimate,
        caller: &Caller,
        ahead: &[usize],
    ) -> Result<(Arc<Pool>, Granted), Decision> {
        let tokens = estimate.reservation();
        if !pool.can_ever_hold(tokens) {
            return Err(self.never_fits(pool, &estimate));
        }
        let outcome = match self.take_budgets(pool, tokens, caller).await {
            Ok(budgets) => {
                let won = match self.first_admitting_now(ahead, tokens, caller).await {
                    Some(won) => Ok(won),
                    None => self
                        .reserve_in_pool(pool, tokens, caller)
                        .await
                        .map(|granted| (pool.clone(), granted)),
                };
                won.map(|(won, granted)| {
                    let budgets = Some(budgets);
                    (won, Granted { budgets, ..granted })
                })
            }
            Err(refused) => Err(refused),
        };
        if outcome.is_err()
            && let Some(slot) = pool.shares.slot(&caller.route.name)
        {
            pool.shares.counts(slot).rejected();
        }
        outcome
    }

    /// The pool's reservation, at once or through its queue.
    async fn reserve_in_pool(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        caller: &Caller,
    ) -> Result<Granted, Decision> {
        // While requests wait in this pool, newcomers queue behind them instead of taking the
        // capacity freed for them.
        let queue_busy = pool.queue.enabled() && !pool.queue.is_empty();
        let rejection = if queue_busy {
            None
        } else {
            match self.try_reserve(pool, tokens, caller).await {
                Ok(Verdict::Granted(reservation)) => {
                    return Ok(Granted {
                        reservation,
                        queued_for: None,
                        budgets: None,
                    });
                }
                Ok(Verdict::Refused(rejection)) => Some(rejection),
                Err(e) => return Err(self.ledger_unavailable(pool, &e)),
            }
        };
        match (&rejection, pool.queue.enabled()) {
            (Some(rejection), false) => Err(self.throttle(pool, rejection, tokens)),
            _ => {
                self.wait_in_queue(pool, tokens, rejection.as_ref(), caller)
                    .await
            }
        }
    }

    /// Shadow mode: decide at once (no queueing) and take the reservation when it fits, so the
    /// ledger sees the real load; when it does not, say what enforcement would have done.
    pub(super) async fn reserve_shadow(
        &self,
        pool: &Arc<Pool>,
        estimate: Estimate,
        caller: &Caller,
    ) -> Result<(Arc<Pool>, Granted), Decision> {
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
            Ok(Verdict::Granted(reservation)) => Ok((
                pool.clone(),
                Granted {
                    reservation,
                    queued_for: None,
                    budgets: None,
                },
            )),
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

    /// The admitted request, holding `granted` until it settles.
    pub(super) fn admitted(
        &self,
        pool: &Arc<Pool>,
        granted: Granted,
        prepared: Prepared<'_>,
        caller: &Caller,
    ) -> Admitted {
        let Granted {
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
            count_tokens_failed,
        } = prepared;
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
        .with_budgets(budgets);
        Admitted {
            hold,
            clamped,
            strip_usage_chunk,
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
    /// (other traffic shares the account quota): the pool's limit shrinks. Returns the hint to
    /// pass on: about half a typical request, at least a second, jittered.
    pub fn upstream_throttled(&self, pool: &Pool) -> Duration {
        pool.upstream_throttled();
        let wait = (pool.history().typical_duration / 2).max(hint::UNAVAILABLE_WAIT);
        self.hint(wait)
    }
}
