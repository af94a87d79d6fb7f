//! Waiting in the admission queue ([`super::queue`]) on behalf of one request: the projection
//! that decides whether to wait at all, the wait, and the refusal when waiting fails.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{
    Admission, Caller, Decision, Pool, QueueRefusal, Throttle, ThrottleWhy, Unavailability,
    queue::{WaitError, WaiterClass},
    reserve::Granted,
};
use crate::ledger::{Limit, Rejection};

/// A queued request's wait is never hinted shorter than this.
const MIN_QUEUE_HINT: Duration = Duration::from_millis(100);
/// The projected wait while a pool has no concurrency at all (an endpoint scaled to zero).
const NO_CAPACITY_WAIT: Duration = Duration::from_secs(3600);

impl Admission {
    /// Waits in the pool's queue for up to its `max_wait`, unless the projection says that
    /// would be in vain.
    pub(super) async fn wait_in_queue(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        rejection: Option<&Rejection>,
        caller: &Caller,
    ) -> Result<Granted, Decision> {
        let queue = &pool.queue;
        if let Some(r) = rejection {
            queue.set_last_limit(r.limit);
        }
        let limit = queue.last_limit().unwrap_or(Limit::Tokens);
        let projected = self.projected_queue_wait(pool, tokens, rejection);
        if projected > queue.max_wait {
            return Err(self.turned_away(
                pool,
                limit,
                tokens,
                projected,
                QueueRefusal::ProjectedTooLong,
            ));
        }
        let class = WaiterClass {
            priority: caller.route.config.priority,
            route: caller.route.name.clone(),
            demand: pool.shares.request(&caller.route.name, caller.retry),
        };
        let Some(ticket) = queue.enqueue(&class, tokens, self.ledger.clone()) else {
            if queue.is_closed() {
                return Err(self.unavailable(pool, Unavailability::ShuttingDown { waited: None }));
            }
            return Err(self.turned_away(pool, limit, tokens, projected, QueueRefusal::Full));
        };
        self.start_dispatcher(pool);
        let started = Instant::now();
        let result = ticket.wait(started + queue.max_wait).await;
        let waited = started.elapsed();
        match result {
            Ok(reservation) => Ok(Granted {
                pool: pool.clone(),
                reservation,
                queued_for: Some(waited),
                budgets: None,
            }),
            Err(WaitError::TimedOut) => {
                let limit = queue.last_limit().unwrap_or(limit);
                let wait = self
                    .projected_queue_wait(pool, tokens, None)
                    .max(MIN_QUEUE_HINT);
                Err(self.turned_away(pool, limit, tokens, wait, QueueRefusal::TimedOut { waited }))
            }
            Err(WaitError::Shutdown) => Err(self.unavailable(
                pool,
                Unavailability::ShuttingDown {
                    waited: Some(waited),
                },
            )),
        }
    }

    /// The 429 for a request the queue will not hold or could not admit in time.
    fn turned_away(
        &self,
        pool: &Arc<Pool>,
        limit: Limit,
        tokens: u64,
        wait: Duration,
        refusal: QueueRefusal,
    ) -> Decision {
        pool.counts.rejected(limit);
        Decision::Throttle(Throttle {
            pool: pool.clone(),
            limit,
            reserving: tokens,
            why: ThrottleWhy::Queue(refusal),
            hint: self.hint(wait),
        })
    }

    /// When this request would be admitted if it joined the queue now: what the queue ahead of it
    /// will consume, and its own reservation, must be covered by refill (beyond what is free now);
    /// if concurrency is what holds the queue back, enough requests in flight must finish.
    pub(super) fn projected_queue_wait(
        &self,
        pool: &Pool,
        tokens: u64,
        rejection: Option<&Rejection>,
    ) -> Duration {
        let depth = pool.queue.depth();
        let queued_tokens = pool.queue.queued_tokens();
        let limits = pool.limits();
        if limits.max_concurrency == 0 {
            // An endpoint with no copies serving: new ones take minutes, not a queue's wait.
            return NO_CAPACITY_WAIT;
        }
        let history = pool.history();
        let free_now = rejection.map_or(0, |r| tokens.saturating_sub(r.token_deficit));
        // Those ahead each need their whole reservation to fit when their turn comes, but over
        // the wait they consume only what they will be charged (the rest comes back at their
        // settlement), so the queue ahead weighs its reservations times the charge ratio.
        let charge_ratio = history.charge_ratio;
        let ahead = (queued_tokens as f64 * charge_ratio.clamp(0.05, 1.0)) as u64;
        let deficit = ahead.saturating_add(tokens).saturating_sub(free_now);
        let rate = limits.tokens_per_minute as f64 / 60.0;
        let mut token_wait = Duration::from_secs_f64((deficit as f64 / rate).min(3600.0));
        let in_flight = pool.load.reserved_tokens() as f64;
        if in_flight * (1.0 - charge_ratio).max(0.0) >= deficit as f64 {
            token_wait = token_wait.min(history.typical_duration / 2);
        }
        let limit = rejection.map(|r| r.limit).or(pool.queue.last_limit());
        match limit {
            Some(Limit::Concurrency) => {
                let completions = (depth as u32).saturating_add(1);
                let concurrency_wait = history
                    .typical_duration
                    .mul_f64(f64::from(completions) / f64::from(limits.max_concurrency.max(1)));
                concurrency_wait.max(if rejection.is_some() {
                    Duration::ZERO
                } else {
                    token_wait
                })
            }
            Some(Limit::Requests) => {
                let rpm = limits.requests_per_minute.unwrap_or(u64::MAX).max(1) as f64;
                Duration::from_secs_f64(((depth as f64 + 1.0) * 60.0 / rpm).min(3600.0))
                    .max(token_wait)
            }
            _ => token_wait,
        }
    }

    fn start_dispatcher(&self, pool: &Arc<Pool>) {
        if !pool.queue.claim_dispatcher() {
            return;
        }
        let queue = pool.queue.clone();
        let ledger = self.ledger.clone();
        let for_limits = pool.clone();
        let name = pool.name.clone();
        tokio::spawn(async move {
            queue
                .dispatch(ledger, name, move || {
                    (for_limits.limits(), for_limits.pending_excess())
                })
                .await
        });
    }
}
