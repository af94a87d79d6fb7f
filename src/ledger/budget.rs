//! Budgets outside any pool: tokens over long windows for a scope (the account's daily quota
//! across every pool; a route's hourly, daily and 30-day budgets), each window a
//! [`WindowBucket`].
//!
//! A budget lives under its scope's own keys (on Redis, its own hash tag `{budget:SCOPE}`, so on
//! a Cluster it cannot share a pool's script): admission takes it in a call of its own *before*
//! the pool's reservation, and gives it back (settles it to zero) when the pool refuses. Between
//! the two calls, another request may be refused by the budget for tokens the pool then refused
//! too: the budget under-admits by at most the tokens of the requests in that gap, never
//! over-admits. A crash between the two calls leaves the tokens taken (they refill with the
//! window); a crash after the pool's reservation leaves the budget charged the reservation.
//!
//! All windows of a budget are checked and taken together, all or nothing. A refusal names the
//! window with the longest wait (one that never fits counts as longest; ties: the first listed).
//! Tokens and charges above [`MAX_BUDGET_TOKENS`] count as that much, on both backends.

use std::{collections::BTreeMap, sync::Mutex, time::Duration};

use dashmap::DashMap;
use serde::Serialize;

use super::{units::MAX_BUDGET_TOKENS, window::WindowBucket};

/// One window of a budget: `capacity` tokens per `window_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetWindow {
    /// Its name in the scope (`tokens_per_day`, ...), for refusals and views.
    pub name: &'static str,
    pub capacity: u64,
    pub window_ms: u64,
}

/// Tokens asked of (or given back to) a scope's budget.
#[derive(Debug, Clone, Copy)]
pub struct BudgetRequest<'a> {
    /// The scope: `account`, `route:NAME`.
    pub scope: &'a str,
    pub windows: &'a [BudgetWindow],
    pub tokens: u64,
}

/// Why a budget turned tokens away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// The binding window's name.
    pub window: &'static str,
    /// Until refill makes room; `None` when it never will (more than the window holds).
    pub wait: Option<Duration>,
    /// Tokens missing now.
    pub deficit: u64,
}

/// A budget's window now (the Redis budget script's snapshot reply, field for field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct WindowSnapshot {
    /// Tokens left (negative while repaying a debt).
    pub available: i64,
    pub capacity: u64,
    /// Milliseconds until the window's bucket is full again.
    pub full_in_ms: u64,
}

/// One scope's buckets, by window name.
type ScopeBuckets = BTreeMap<&'static str, WindowBucket>;

/// The memory backend's budgets.
#[derive(Debug, Default)]
pub struct Budgets {
    scopes: DashMap<String, Mutex<ScopeBuckets>>,
}

impl Budgets {
    fn with<T>(&self, scope: &str, work: impl FnOnce(&mut ScopeBuckets) -> T) -> T {
        let lock = |m: &Mutex<ScopeBuckets>| {
            // A poisoned lock: the buckets are a few integers, consistent after any update.
            let mut buckets = m.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            work(&mut buckets)
        };
        if let Some(m) = self.scopes.get(scope) {
            return lock(&m);
        }
        let m = self
            .scopes
            .entry(scope.to_string())
            .or_default()
            .downgrade();
        lock(&m)
    }

    /// Takes `request.tokens` from every window, or nothing.
    pub fn take(&self, request: &BudgetRequest<'_>, now_ms: u64) -> Result<(), BudgetRefusal> {
        let tokens = request.tokens.min(MAX_BUDGET_TOKENS);
        self.with(request.scope, |buckets| {
            sync(buckets, request.windows, now_ms);
            let mut refusal: Option<BudgetRefusal> = None;
            for w in request.windows {
                let Some(b) = buckets.get(w.name).filter(|b| !b.fits(tokens)) else {
                    continue;
                };
                let candidate = BudgetRefusal {
                    window: w.name,
                    wait: b.wait_for(tokens, now_ms),
                    deficit: u64::try_from(i128::from(tokens) - i128::from(b.level())).unwrap_or(0),
                };
                if refusal.as_ref().is_none_or(|r| longer(&candidate, r)) {
                    refusal = Some(candidate);
                }
            }
            if let Some(refusal) = refusal {
                return Err(refusal);
            }
            for w in request.windows {
                if let Some(b) = buckets.get_mut(w.name) {
                    b.take(tokens);
                }
            }
            Ok(())
        })
    }

    /// Settles `tokens` taken to `charged`: credits back the difference, or debits it.
    pub fn settle(&self, request: &BudgetRequest<'_>, charged: u64, now_ms: u64) {
        let delta = i128::from(request.tokens.min(MAX_BUDGET_TOKENS))
            - i128::from(charged.min(MAX_BUDGET_TOKENS));
        let delta = delta.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        self.with(request.scope, |buckets| {
            sync(buckets, request.windows, now_ms);
            for w in request.windows {
                if let Some(b) = buckets.get_mut(w.name) {
                    b.adjust(delta);
                }
            }
        });
    }

    /// Every window of the scope now, in the order given.
    pub fn snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
        now_ms: u64,
    ) -> Vec<WindowSnapshot> {
        self.with(scope, |buckets| {
            sync(buckets, windows, now_ms);
            windows
                .iter()
                .filter_map(|w| buckets.get(w.name))
                .map(|b| WindowSnapshot {
                    available: b.level(),
                    capacity: b.capacity(),
                    full_in_ms: u64::try_from(b.full_in(now_ms).as_millis()).unwrap_or(u64::MAX),
                })
                .collect()
        })
    }
}

/// Whether refusal `a` binds over `b`: a longer wait (never counts as longest).
pub fn longer(a: &BudgetRefusal, b: &BudgetRefusal) -> bool {
    match (a.wait, b.wait) {
        (None, Some(_)) => true,
        (Some(x), Some(y)) => x > y,
        _ => false,
    }
}

/// Creates the windows the call names (full), follows capacity changes, refills; forgets
/// windows it no longer names.
fn sync(buckets: &mut ScopeBuckets, windows: &[BudgetWindow], now_ms: u64) {
    buckets.retain(|name, _| windows.iter().any(|w| w.name == *name));
    for w in windows {
        let fresh = || WindowBucket::new(w.capacity, w.window_ms, now_ms);
        let b = buckets.entry(w.name).or_insert_with(fresh);
        if b.window_ms() != w.window_ms {
            *b = fresh();
        } else if b.capacity() != w.capacity {
            b.set_capacity(w.capacity, now_ms);
        }
        b.refill(now_ms);
    }
}
