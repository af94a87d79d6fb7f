//! The budgets a request draws on besides its pool: the account's daily quota
//! (`admission.account_tokens_per_day`, across every pool), its route's `budgets`, and its
//! route's `max_concurrency` (a slot in a concurrency-only ledger "pool" of the route's own,
//! `route:NAME`, with the pools' leases: shared across replicas, freed if a replica dies).
//!
//! Each is a ledger budget under its own scope ([`crate::ledger::budget`]), taken in a call of
//! its own before the pool's reservation: all of a request's budgets, in order, or none (a
//! refusal gives back what the earlier ones took). The [`TakenBudgets`] travel with the
//! reservation and settle with it, to the same charge; if the pool then refuses (or the request
//! is dropped while it waits in the queue), they are given back. A budget refusal is a 429:
//! `daily_quota` for the account, `budget` for a route, with a hint to when refill makes room;
//! the route's concurrency, `route_concurrency`, with a hint of the pool's typical call duration
//! over the route's limit.

use std::{sync::Arc, time::Duration};

use super::{
    Admission, BudgetScope, Caller, Decision, Pool, Throttle, ThrottleWhy, hold::now_or_spawn,
};
use crate::ledger::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Ledger, Limit, Limits, Origin, Reservation,
    ReserveRequest, Verdict, units::DAY_MS,
};

/// One budget: its scope's name in the ledger, its windows, and whose it is.
#[derive(Debug)]
pub struct Budget {
    pub scope: BudgetScope,
    /// The ledger's scope key (`account`, `route:NAME`).
    pub key: Arc<str>,
    pub windows: Arc<[BudgetWindow]>,
}

impl Budget {
    /// The account's daily quota.
    pub fn account(tokens_per_day: u64) -> Budget {
        Budget {
            scope: BudgetScope::Account,
            key: Arc::from("account"),
            windows: Arc::from([BudgetWindow {
                name: "tokens_per_day",
                capacity: tokens_per_day,
                window_ms: DAY_MS,
            }]),
        }
    }

    /// A route's budgets (none: `None`).
    pub fn route(name: &str, windows: Vec<BudgetWindow>) -> Option<Budget> {
        (!windows.is_empty()).then(|| Budget {
            scope: BudgetScope::Route(name.to_string()),
            key: Arc::from(format!("route:{name}")),
            windows: Arc::from(windows),
        })
    }

    /// The limit a refusal of this budget reports.
    pub fn limit(&self) -> Limit {
        match self.scope {
            BudgetScope::Account => Limit::DailyQuota,
            BudgetScope::Route(_) => Limit::Budget,
        }
    }

    fn request(&self, tokens: u64) -> BudgetRequest<'_> {
        BudgetRequest {
            scope: &self.key,
            windows: &self.windows,
            tokens,
        }
    }
}

/// Budgets taken for one request: settled with its reservation, given back if it is refused or
/// dropped first.
#[derive(Debug)]
pub struct TakenBudgets {
    ledger: Arc<dyn Ledger>,
    taken: Vec<(Arc<Budget>, Origin)>,
    tokens: u64,
    /// The route's concurrency slot, if it has a `max_concurrency`.
    slot: Option<Reservation>,
}

impl TakenBudgets {
    fn new(ledger: Arc<dyn Ledger>, tokens: u64) -> TakenBudgets {
        TakenBudgets {
            ledger,
            taken: Vec::new(),
            tokens,
            slot: None,
        }
    }

    /// Settles every budget taken to `charge` (in the background when the ledger must wait).
    pub fn settle(mut self, charge: u64) {
        self.finish(charge);
    }

    fn finish(&mut self, charge: u64) {
        let taken = std::mem::take(&mut self.taken);
        let slot = self.slot.take();
        if taken.is_empty() && slot.is_none() {
            return;
        }
        let (ledger, tokens) = (self.ledger.clone(), self.tokens);
        now_or_spawn(async move {
            if let Some(slot) = slot
                && let Err(e) = ledger.settle(slot, 0).await
            {
                tracing::error!(error = %e, "route concurrency slot settlement failed");
            }
            for (budget, origin) in taken {
                if let Err(e) = ledger
                    .settle_budget(&budget.request(tokens), origin, charge)
                    .await
                {
                    tracing::error!(budget = %budget.key, error = %e, "budget settlement failed");
                }
            }
        });
    }
}

impl Drop for TakenBudgets {
    /// Dropped unsettled: the request never reached upstream (refused, or dropped while it
    /// waited), so everything goes back.
    fn drop(&mut self) {
        self.finish(0);
    }
}

impl Admission {
    /// Takes every budget `caller` draws on for `tokens`, or none: the throttle (or the ledger's
    /// 503) when one refuses.
    pub(super) async fn take_budgets(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        caller: &Caller,
    ) -> Result<TakenBudgets, Decision> {
        let mut taken = TakenBudgets::new(self.ledger.clone(), tokens);
        let budgets = self.account_budget.iter().chain(caller.route.budget.iter());
        for budget in budgets {
            match self.ledger.take_budget(&budget.request(tokens)).await {
                Ok(BudgetVerdict::Taken(origin)) => taken.taken.push((budget.clone(), origin)),
                Ok(BudgetVerdict::Refused(refusal)) => {
                    let limit = budget.limit();
                    pool.counts.rejected(limit);
                    let wait = refusal.wait.unwrap_or(self.config.max_retry_hint);
                    return Err(Decision::Throttle(Throttle {
                        pool: pool.clone(),
                        limit,
                        reserving: tokens,
                        why: ThrottleWhy::Budget {
                            scope: budget.scope.clone(),
                            window: refusal.window,
                            reserving: tokens,
                            available: tokens.saturating_sub(refusal.deficit),
                        },
                        hint: self.hint(wait.max(Duration::from_millis(1))),
                    }));
                }
                Err(e) => return Err(self.ledger_unavailable(pool, &e)),
            }
        }
        if let Some(n) = caller.route.config.max_concurrency {
            taken.slot = Some(self.take_route_slot(pool, tokens, caller, n).await?);
        }
        Ok(taken)
    }

    /// A slot of the route's `max_concurrency` (`n`), or the `route_concurrency` throttle.
    async fn take_route_slot(
        &self,
        pool: &Arc<Pool>,
        tokens: u64,
        caller: &Caller,
        n: u32,
    ) -> Result<Reservation, Decision> {
        let request = ReserveRequest {
            pool: &caller.route.concurrency_key,
            limits: Limits {
                tokens_per_minute: 1,
                requests_per_minute: None,
                max_concurrency: n,
                tokens_per_day: None,
            },
            tokens: 0,
            share: None,
            hold_back: 0,
        };
        match self.ledger.reserve(&request).await {
            Ok(Verdict::Granted(slot)) => Ok(slot),
            Ok(Verdict::Refused(rejection)) => {
                let limit = Limit::RouteConcurrency;
                pool.counts.rejected(limit);
                // The next of the route's calls ends after about a typical call over n.
                let wait = pool.history().typical_duration / n.max(1);
                Err(Decision::Throttle(Throttle {
                    pool: pool.clone(),
                    limit,
                    reserving: tokens,
                    why: ThrottleWhy::NoRoom {
                        reserving: tokens,
                        available: tokens,
                        in_flight: rejection.in_flight_requests,
                    },
                    hint: self.hint(wait),
                }))
            }
            Err(e) => Err(self.ledger_unavailable(pool, &e)),
        }
    }
}

/// A budget now, for `GET /v1/pools`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BudgetView {
    /// `account`, or `route:NAME`.
    pub scope: String,
    pub windows: Vec<WindowView>,
}

/// One window of a budget now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WindowView {
    pub name: &'static str,
    pub capacity: u64,
    /// Tokens left (negative while repaying a debt); `null` when the ledger could not be read.
    pub available: Option<i64>,
    /// Milliseconds until the window is full again.
    pub full_in_ms: Option<u64>,
}

impl Admission {
    /// Every budget (the account's, each route's) as the ledger holds it now.
    pub async fn budget_views(&self) -> Vec<BudgetView> {
        let routes = self
            .routes
            .routes()
            .iter()
            .filter_map(|r| r.budget.as_ref());
        let mut out = Vec::new();
        for budget in self.account_budget.iter().chain(routes) {
            let now = self
                .ledger
                .budget_snapshot(&budget.key, &budget.windows)
                .await
                .ok();
            let windows = budget
                .windows
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let s = now.as_ref().and_then(|s| s.get(i));
                    WindowView {
                        name: w.name,
                        capacity: w.capacity,
                        available: s.map(|s| s.available),
                        full_in_ms: s.map(|s| s.full_in_ms),
                    }
                })
                .collect();
            out.push(BudgetView {
                scope: budget.key.to_string(),
                windows,
            });
        }
        out
    }
}
