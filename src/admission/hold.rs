//! The guard an admitted request holds until the price of its reservation is known.
//!
//! # Settlement rules
//!
//! Every admitted request is settled exactly once, by the first of these that applies:
//!
//! | rule | when | charge |
//! |---|---|---|
//! | `usage` | upstream reported usage (Converse body, ConverseStream `metadata`, InvokeModel headers or body, the last chunk's invocation metrics, a bidirectional stream's last `usageEvent` when it ends; an endpoint container's `usage` or `details`) | `input + cacheWrite + output x burndown`, the moment it is seen (an endpoint pool: the output) |
//! | `not_charged` | upstream answered an error status, or was never reached, or refused a bidirectional stream in-band (a `throttlingException` before any usage) | 0: Bedrock does not charge failed requests |
//! | `no_usage` | a response started but ended without usage: stream cut, idle timeout, corrupt frames, the client hung up | the larger of the reservation and `input estimate + output seen x burndown` (a bidirectional stream: its last running totals' charge): generation may have run to `maxTokens` and may still be running upstream |
//! | `timeout` | no response head within `upstream.response_timeout_secs`, or by the shutdown drain deadline | the reservation |
//! | `abandoned` | the request was dropped before any of the above (the client hung up while the proxy waited for upstream) | the reservation |
//!
//! The guard settles on `Drop` by the `abandoned` rule, so no path can leak a reservation or a
//! concurrency permit. Each `settle_*` returns what it settled ([`Settled`]) for the pipeline to
//! observe; the guard itself only settles: it updates the ledger and what its pool learns
//! (calibration, typical duration, maxTokens advice, the load it carries) and, for a route with
//! adaptive maxTokens, what that route learns of the model's outputs ([`super::adaptive`]),
//! nothing else.

use std::{sync::Arc, time::Duration};

use futures_util::FutureExt;
use tokio::time::Instant;

use super::{
    adaptive::Ticket, advice::SlotIndex, budgets::TakenBudgets, pools::Pool, queue::AdmissionQueue,
    routes::RouteSlot,
};
use crate::{
    bedrock::Usage,
    ledger::{Ledger, Reservation},
};

/// How a request's reservation was priced; the `rule` label of `tokengate_settlements_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettlementRule {
    Usage,
    NotCharged,
    NoUsage,
    Timeout,
    Abandoned,
}

impl SettlementRule {
    pub const ALL: [SettlementRule; 5] = [
        SettlementRule::Usage,
        SettlementRule::NotCharged,
        SettlementRule::NoUsage,
        SettlementRule::Timeout,
        SettlementRule::Abandoned,
    ];

    /// The position of this rule in [`SettlementRule::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            SettlementRule::Usage => "usage",
            SettlementRule::NotCharged => "not_charged",
            SettlementRule::NoUsage => "no_usage",
            SettlementRule::Timeout => "timeout",
            SettlementRule::Abandoned => "abandoned",
        }
    }
}

/// The estimate a reservation was made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// The estimator's raw input figure (before calibration).
    pub raw_input: u64,
    /// The calibrated input figure that was reserved.
    pub input: u64,
    pub max_tokens: u64,
    /// The request named no `maxTokens`, and what was done about it.
    pub max_tokens_missing: Option<super::MissingMaxTokens>,
}

impl Estimate {
    pub fn reservation(&self) -> u64 {
        self.input.saturating_add(self.max_tokens)
    }
}

/// What a settlement priced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub rule: SettlementRule,
    pub reserved: u64,
    pub charge: u64,
    /// The `maxTokens` that was reserved.
    pub max_tokens: u64,
    /// The usage upstream reported (rule `usage` only).
    pub usage: Option<Usage>,
    /// From admission to settlement.
    pub elapsed: Duration,
}

/// An admitted request's reservation, held until settled.
#[derive(Debug)]
pub struct Hold {
    pool: Arc<Pool>,
    ledger: Arc<dyn Ledger>,
    reservation: Option<Reservation>,
    estimate: Estimate,
    admitted_at: Instant,
    /// The maxTokens-advice slot (model) of its pool.
    advice_slot: SlotIndex,
    /// The caller's route in this pool.
    route: Option<RouteSlot>,
    /// This request's part of its pool's pending burndown excess.
    excess_claimed: u64,
    /// Budgets taken before the reservation, settled with it (boxed: most requests have none,
    /// and every `Decision` carries a `Hold`'s size).
    budgets: Option<Box<TakenBudgets>>,
    /// Its route's adaptive maxTokens learner for its model, told the output at settlement
    /// (boxed: most requests have none, and every `Decision` carries a `Hold`'s size).
    adaptive: Option<Box<Ticket>>,
    /// Its stop reason said the output hit its cap ([`Hold::note_truncated`]).
    stopped_at_cap: bool,
}

impl Hold {
    pub(crate) fn new(
        pool: Arc<Pool>,
        ledger: Arc<dyn Ledger>,
        reservation: Reservation,
        estimate: Estimate,
        advice_slot: SlotIndex,
        route: Option<RouteSlot>,
    ) -> Hold {
        let tokens = reservation.tokens();
        pool.load.admitted(tokens);
        if let Some(route) = route {
            pool.shares.counts(route).admitted(tokens);
        }
        Hold {
            pool,
            ledger,
            reservation: Some(reservation),
            estimate,
            admitted_at: Instant::now(),
            advice_slot,
            route,
            excess_claimed: 0,
            budgets: None,
            adaptive: None,
            stopped_at_cap: false,
        }
    }

    /// Settles `budgets` with the reservation, to the same charge.
    pub(crate) fn with_budgets(mut self, budgets: Option<TakenBudgets>) -> Hold {
        self.budgets = budgets.map(Box::new);
        self
    }

    /// Reports the output to `ticket`'s learner when the request settles with usage.
    pub(crate) fn with_adaptive(mut self, ticket: Option<Ticket>) -> Hold {
        self.adaptive = ticket.map(Box::new);
        self
    }

    /// The adaptive maxTokens cap the proxy wrote into the forwarded body, if it capped it.
    pub fn adaptive_cap(&self) -> Option<u64> {
        self.adaptive.as_ref().and_then(|t| t.written_cap())
    }

    /// The call stopped at its output cap (its stop reason said so): counted beside its pool's
    /// maxTokens advice, and told to its adaptive maxTokens learner at settlement.
    pub fn note_truncated(&mut self) {
        self.stopped_at_cap = true;
        self.pool.advice.truncated(self.advice_slot);
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn estimate(&self) -> Estimate {
        self.estimate
    }

    /// The caller's route in the pool, if it has a share there.
    pub fn route(&self) -> Option<RouteSlot> {
        self.route
    }

    /// Tokens reserved (zero once settled).
    pub fn reserved(&self) -> u64 {
        self.reservation.as_ref().map_or(0, Reservation::tokens)
    }

    pub fn is_settled(&self) -> bool {
        self.reservation.is_none()
    }

    /// Output seen so far in the response (an estimate): with burndown, what it will cost
    /// beyond the reservation is held back in the pool until the request settles.
    pub fn output_progress(&mut self, output_seen: u64) {
        let burndown = u64::from(self.pool.config.output_burndown);
        let Some(reservation) = self.reservation.as_ref() else {
            return;
        };
        if burndown <= 1 {
            return;
        }
        let projected = self
            .estimate
            .input
            .saturating_add(output_seen.saturating_mul(burndown));
        let excess = projected.saturating_sub(reservation.tokens());
        if excess > self.excess_claimed {
            self.pool.add_pending_excess(excess - self.excess_claimed);
            self.excess_claimed = excess;
        }
    }

    /// Settles to Bedrock's charge for `usage`, and learns from it.
    pub fn settle_usage(&mut self, usage: &Usage) -> Option<Settled> {
        let reserved = self.reservation.as_ref().map(Reservation::tokens)?;
        let charge = self.pool.charge(usage);
        let actual_input =
            usage.input_tokens + usage.cache_read_input_tokens + usage.cache_write_input_tokens;
        // One clock read serves both the pool's typical duration and the request's.
        let elapsed = self.admitted_at.elapsed();
        self.pool.learn(
            self.estimate.raw_input,
            actual_input,
            reserved,
            charge,
            elapsed,
        );
        self.pool.advice.record(
            self.advice_slot,
            self.estimate.max_tokens,
            usage.output_tokens,
        );
        if let Some(ticket) = &self.adaptive {
            // A capped call is a proxy-caused truncation when its stop reason said so (noted
            // before the usage settles it), or, where no stop reason is read (InvokeModel
            // streams), when its output reached the cap.
            ticket.settled(usage.output_tokens, self.stopped_at_cap);
        }
        self.finish(charge, SettlementRule::Usage, elapsed, Some(*usage))
    }

    /// Upstream answered an error, or was never reached: nothing is charged.
    pub fn settle_not_charged(&mut self) -> Option<Settled> {
        self.finish_now(|_| 0, SettlementRule::NotCharged)
    }

    /// The response ended without usage; `output_seen` is the estimate of what was generated.
    pub fn settle_without_usage(&mut self, output_seen: u64) -> Option<Settled> {
        if !self.is_settled() {
            self.pool.learn_duration(self.admitted_at.elapsed());
        }
        let seen = self.estimate.input
            + output_seen.saturating_mul(u64::from(self.pool.config.output_burndown));
        self.finish_now(|reserved| reserved.max(seen), SettlementRule::NoUsage)
    }

    /// A bidirectional stream ended without its final usage, after upstream reported `running`
    /// totals: the larger of the reservation and those totals' charge (the session may have
    /// used more since).
    pub fn settle_cut_after(&mut self, running: &Usage) -> Option<Settled> {
        let seen = running.charge(self.pool.config.output_burndown);
        self.finish_now(|reserved| reserved.max(seen), SettlementRule::NoUsage)
    }

    /// No response head in time: the request may still run upstream.
    pub fn settle_timeout(&mut self) -> Option<Settled> {
        self.finish_now(|reserved| reserved, SettlementRule::Timeout)
    }

    /// The request was dropped before anything else settled it.
    pub fn settle_abandoned(&mut self) -> Option<Settled> {
        self.finish_now(|reserved| reserved, SettlementRule::Abandoned)
    }

    fn finish_now(
        &mut self,
        charge: impl FnOnce(u64) -> u64,
        rule: SettlementRule,
    ) -> Option<Settled> {
        let reserved = self.reservation.as_ref().map(Reservation::tokens)?;
        self.finish(charge(reserved), rule, self.admitted_at.elapsed(), None)
    }

    fn finish(
        &mut self,
        charge: u64,
        rule: SettlementRule,
        elapsed: Duration,
        usage: Option<Usage>,
    ) -> Option<Settled> {
        let reservation = self.reservation.take()?;
        let reserved = reservation.tokens();
        self.pool
            .release_pending_excess(std::mem::take(&mut self.excess_claimed));
        self.pool.load.settled(reserved);
        if let Some(route) = self.route {
            self.pool.shares.counts(route).settled(reserved, charge);
        }
        settle_in_background(
            self.ledger.clone(),
            self.pool.queue.clone(),
            reservation,
            charge,
        );
        if let Some(budgets) = self.budgets.take() {
            budgets.settle(charge);
        }
        Some(Settled {
            rule,
            reserved,
            charge,
            max_tokens: self.estimate.max_tokens,
            usage,
            elapsed,
        })
    }
}

impl Drop for Hold {
    /// The last safety net: the pipeline settles (and observes) an abandoned request itself.
    fn drop(&mut self) {
        let _ = self.settle_abandoned();
    }
}

/// Settles now if the backend answers without waiting (the memory ledger always does), else on
/// a task: settlement happens from `Drop` and `poll_frame`, which cannot wait.
fn settle_in_background(
    ledger: Arc<dyn Ledger>,
    queue: Arc<AdmissionQueue>,
    reservation: Reservation,
    charge: u64,
) {
    now_or_spawn(async move {
        let result = ledger.settle(reservation, charge).await;
        // Capacity came back: queued requests may fit now.
        queue.capacity_returned();
        if let Err(e) = result {
            tracing::error!(error = %e, "settlement failed");
        }
    });
}

/// Runs `work` to completion now if it never waits (the memory ledger), else on a task.
/// Settlement happens from `Drop` and `poll_frame`, which cannot wait. A settlement on its way
/// counts in its ledger's `LedgerStats::settlements_in_flight` from its first poll (here) on,
/// and shutdown waits for them.
pub(super) fn now_or_spawn(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let mut work = Box::pin(work);
    if (&mut work).now_or_never().is_some() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(work);
        }
        Err(_) => tracing::error!("settlement outside a runtime could not complete"),
    }
}

/// Releases a reservation that was never used (its caller left before taking it), uncharged.
pub fn release_unused(ledger: Arc<dyn Ledger>, reservation: Reservation) {
    now_or_spawn(async move {
        if let Err(e) = ledger.settle(reservation, 0).await {
            tracing::error!(error = %e, "releasing an unused reservation failed");
        }
    });
}
