//! Waiting in the admission queue ([`super::queue`]) on behalf of one request: the projection
//! that decides whether to wait at all, the wait, and the answers when waiting fails.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{
    Admission, Caller, Pool, X_TOKENGATE_REASON,
    queue::{QueueOutcome, WaitError, WaiterClass},
};
use crate::{
    bedrock::{BedrockError, ErrorCode},
    ledger::{Limit, Rejection, Reservation},
};

/// Counts a queued request that left without an answer (its client hung up).
struct QueuedGuard<'a> {
    admission: &'a Admission,
    pool: &'a Pool,
    answered: bool,
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.admission
                .queue_outcome(self.pool, QueueOutcome::Cancelled, None);
        }
    }
}

impl Admission {
    /// Waits in the pool's queue for up to its `max_wait`, unless the projection says that
    /// would be in vain.
    pub(super) async fn wait_in_queue(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        rejection: Option<&Rejection>,
        caller: &Caller,
    ) -> Result<Reservation, BedrockError> {
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
                projected,
                "its projected wait is longer than the pool's max_wait",
            ));
        }
        let class = WaiterClass {
            priority: caller.route.config.priority,
            route: caller.route.name.clone(),
            demand: pool.shares.request(&caller.route.name, caller.is_retry()),
        };
        let Some(ticket) = queue.enqueue(&class, tokens, self.ledger.clone()) else {
            let reason = if queue.is_closed() {
                "tokengate is shutting down"
            } else {
                "the admission queue is full"
            };
            if queue.is_closed() {
                return Err(self.retryable(
                    ErrorCode::ServiceUnavailable,
                    pool,
                    Duration::from_secs(1),
                    reason.into(),
                ));
            }
            self.metrics
                .rejections
                .with_label_values(&[&pool.name, "queue_full"])
                .inc();
            return Err(self
                .turned_away(pool, limit, projected, reason)
                .with_header(
                    http::HeaderName::from_static(X_TOKENGATE_REASON),
                    "queue_full",
                ));
        };
        self.start_dispatcher(pool);
        self.metrics
            .queue_depth
            .with_label_values(&[&pool.name])
            .set(queue.depth().0 as i64);
        let mut guard = QueuedGuard {
            admission: self,
            pool,
            answered: false,
        };
        let started = Instant::now();
        let result = ticket.wait(started + queue.max_wait).await;
        guard.answered = true;
        let waited = started.elapsed();
        match result {
            Ok(reservation) => {
                self.queue_outcome(pool, QueueOutcome::Admitted, Some(waited));
                Ok(reservation)
            }
            Err(WaitError::TimedOut) => {
                self.queue_outcome(pool, QueueOutcome::TimedOut, Some(waited));
                let limit = queue.last_limit().unwrap_or(limit);
                let wait = self
                    .projected_queue_wait(pool, tokens, None)
                    .max(Duration::from_millis(100));
                Err(self.turned_away(
                    pool,
                    limit,
                    wait,
                    "it waited the pool's max_wait without room appearing",
                ))
            }
            Err(WaitError::Shutdown) => {
                self.queue_outcome(pool, QueueOutcome::Shutdown, Some(waited));
                Err(self.retryable(
                    ErrorCode::ServiceUnavailable,
                    pool,
                    Duration::from_secs(1),
                    "tokengate is shutting down; retry".into(),
                ))
            }
        }
    }

    /// The 429 for a request the queue will not hold or could not admit in time.
    fn turned_away(&self, pool: &Pool, limit: Limit, wait: Duration, why: &str) -> BedrockError {
        pool.counters.rejected(limit);
        self.metrics
            .rejections
            .with_label_values(&[&pool.name, limit.label()])
            .inc();
        let message = format!(
            "Too many {} in pool {:?}: the request was not queued or not admitted because {why}; retry after the hinted delay",
            limit_noun(limit),
            &*pool.name
        );
        self.retryable(ErrorCode::Throttling, pool, wait, message)
            .with_header(
                http::HeaderName::from_static(X_TOKENGATE_REASON),
                limit.label(),
            )
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
        let (depth, queued_tokens) = pool.queue.depth();
        let limits = pool.limits();
        let (typical, charge_ratio) = pool.typical();
        let free_now = rejection.map_or(0, |r| tokens.saturating_sub(r.token_deficit));
        // Those ahead each need their whole reservation to fit when their turn comes, but over
        // the wait they consume only what they will be charged (the rest comes back at their
        // settlement), so the queue ahead weighs its reservations times the charge ratio.
        let ahead = (queued_tokens as f64 * charge_ratio.clamp(0.05, 1.0)) as u64;
        let deficit = ahead.saturating_add(tokens).saturating_sub(free_now);
        let rate = limits.tokens_per_minute as f64 / 60.0;
        let mut token_wait = Duration::from_secs_f64((deficit as f64 / rate).min(3600.0));
        let in_flight = self
            .metrics
            .reserved_tokens
            .with_label_values(&[&pool.name])
            .get()
            .max(0) as f64;
        if in_flight * (1.0 - charge_ratio).max(0.0) >= deficit as f64 {
            token_wait = token_wait.min(typical / 2);
        }
        let limit = rejection.map(|r| r.limit).or(pool.queue.last_limit());
        match limit {
            Some(Limit::Concurrency) => {
                let completions = (depth as u32).saturating_add(1);
                let concurrency_wait = typical
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

    pub(super) fn queue_outcome(
        &self,
        pool: &Pool,
        outcome: QueueOutcome,
        waited: Option<Duration>,
    ) {
        let name = &*pool.name;
        self.metrics
            .queue_outcomes
            .with_label_values(&[name, outcome.label()])
            .inc();
        if let Some(w) = waited {
            self.metrics
                .queue_wait_seconds
                .with_label_values(&[name])
                .observe(w.as_secs_f64());
        }
        self.metrics
            .queue_depth
            .with_label_values(&[name])
            .set(pool.queue.depth().0 as i64);
    }

    /// Answers every queued request at once (shutdown).
    pub fn close_queues(&self) {
        for pool in self.pools() {
            pool.queue.close();
        }
    }
}

fn limit_noun(limit: Limit) -> &'static str {
    match limit {
        Limit::Tokens => "tokens",
        Limit::Requests => "requests",
        Limit::Concurrency => "concurrent requests",
        Limit::Share => "tokens of its route's max_share",
    }
}
